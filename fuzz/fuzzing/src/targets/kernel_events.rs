//! The code interpreter's kernel events (`engine/serve/src/e2b/kernel.rs`): what a kernel inside a sandbox writes
//! on its stdout, which the server splits into lines, checks and sends on to the E2B SDKs. The kernel runs beside
//! the user's code, so every byte of it is the guest's.
//!
//! Input: the kernel's stdout; each `0xff` byte ends a chunk (the writes as the server receives them).
//!
//! Oracles: nothing panics; there is one event per line; chunking does not change the events (each equals
//! [`parse_event`] of its line when the line is within [`MAX_EVENT`]); a result carries only `is_main_result` (a
//! bool), E2B's string formats as strings and `json`/`data`/`extra` as objects; every line sent to the SDKs is a
//! JSON object with a `type` and serialises.

use serde_json::Value;
use strata_serve::e2b::fuzzing::{KernelEvent, MAX_EVENT, kernel_output, parse_event};

const STRINGS: [&str; 10] = ["text", "html", "markdown", "svg", "png", "jpeg", "pdf", "latex", "javascript", "chart"];

/// Feeds `data` to the server's kernel reader.
pub fn run(data: &[u8]) {
    let chunks: Vec<&[u8]> = data.split(|b| *b == 0xff).collect();
    let events = kernel_output(&chunks);
    let whole: Vec<u8> = chunks.concat();
    let lines: Vec<&[u8]> = whole.split(|b| *b == b'\n').collect();
    // The text after the last newline is not a line yet.
    assert_eq!(events.len(), lines.len() - 1, "one event per line");
    for ((event, sent), line) in events.iter().zip(&lines) {
        if line.len() <= MAX_EVENT {
            assert_eq!(*event, parse_event(line), "chunking changed an event");
        }
        if let KernelEvent::Result(fields) = event {
            for (key, value) in fields {
                match key.as_str() {
                    "is_main_result" => assert!(value.is_boolean()),
                    "json" | "data" | "extra" => assert!(value.is_object(), "{key}"),
                    key if STRINGS.contains(&key) => assert!(value.is_string(), "{key}"),
                    other => panic!("a result kept the unknown field {other}"),
                }
            }
        }
        if let Some(sent) = sent {
            assert!(sent.get("type").and_then(Value::as_str).is_some(), "a line without a type: {sent}");
            let text = serde_json::to_string(sent).expect("serialises");
            assert_eq!(serde_json::from_str::<Value>(&text).expect("parses"), *sent);
        }
    }
}
