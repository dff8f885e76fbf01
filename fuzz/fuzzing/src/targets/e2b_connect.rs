//! The E2B layer's request parsers (`engine/serve/src/e2b*.rs`): the Connect-RPC envelope, `process.Process/Start`
//! and the unary process calls' messages, the filesystem calls, and the control plane's and code interpreter's
//! JSON bodies, as the official SDK (or anyone holding a sandbox's token) sends them.
//!
//! Input: a selector byte, then the body (for a client stream, `StreamInput`'s, read whole and split at points the
//! body's first bytes choose).
//!
//! Oracles: nothing panics; a client stream gives the same messages (or the same refusal) however it is split; a refusal is a 4xx, never a server error; a command's argv is non-empty and free of
//! NUL, and when it goes through `env` a command follows the options; a filesystem call's
//! argv names the operation asked for, with non-empty, NUL-free paths.

use strata_serve::e2b::fuzzing::{
    connect_envelope, control_bodies, envelope_stream, filesystem_call, process_start, process_unary,
};

const CALLS: [&str; 6] = ["stat", "list", "mkdir", "move", "remove", "other"];

/// Parses `data` as one request body.
pub fn run(data: &[u8]) {
    let Some((&selector, body)) = data.split_first() else { return };
    match selector % 4 {
        0 => {
            if let Ok(message) = connect_envelope(body) {
                match process_start(message) {
                    Ok((argv, _stdin)) => check_argv(&argv),
                    Err(err) => assert!(err.status.is_client_error(), "{}: {}", err.status, err.message),
                }
            }
        }
        1 => {
            if let Err(err) = process_unary(body) {
                assert!(err.status.is_client_error(), "{}: {}", err.status, err.message);
            }
        }
        2 => {
            let call = CALLS[usize::from(selector / 4) % CALLS.len()];
            match filesystem_call(call, body) {
                Ok(argv) => {
                    assert_eq!(argv.first().map(String::as_str), Some(call));
                    assert!(argv.iter().all(|a| !a.is_empty() && !a.contains('\0')), "{argv:?}");
                }
                // No handler asks for another call: the parser's own refusal of it is an internal error.
                Err(_) if call == "other" => {}
                Err(err) => assert!(err.status.is_client_error(), "{}: {}", err.status, err.message),
            }
        }
        _ if (selector / 4) % 2 == 1 => stream(selector, body),
        _ => {
            let _ = control_bodies(body);
        }
    }
}

/// The most bytes of one message of a client stream here (small, so that the bound is reached).
const STREAM_MAX: usize = 256;

/// A client stream read whole and read split at points the input's first bytes choose: the same messages or the
/// same refusal either way, none over the bound.
fn stream(selector: u8, body: &[u8]) {
    let whole = envelope_stream(body, &[], STREAM_MAX);
    let splits: Vec<usize> = body.iter().take(usize::from(selector / 8) % 8).map(|b| usize::from(*b)).collect();
    let mut sorted = splits.clone();
    sorted.sort_unstable();
    let split = envelope_stream(body, &sorted, STREAM_MAX);
    match (&whole, &split) {
        (Ok(a), Ok(b)) => assert_eq!(a, b, "split at {sorted:?}"),
        (Err(_), Err(_)) => {}
        _ => panic!("whole: {whole:?}, split at {sorted:?}: {split:?}"),
    }
    if let Ok(messages) = whole {
        for message in messages {
            assert!(message.message.to_string().len() <= STREAM_MAX * 6 + 2, "{message:?}");
        }
    }
}

fn check_argv(argv: &[String]) {
    assert!(!argv.is_empty(), "an empty argv");
    assert!(argv.iter().all(|a| !a.contains('\0')), "a NUL in {argv:?}");
    if argv.first().map(String::as_str) == Some("/usr/bin/env") {
        // `env [-C DIR] NAME=VALUE… CMD ARGS`: something to run after the options.
        let mut rest = &argv[1..];
        if rest.first().map(String::as_str) == Some("-C") {
            rest = rest.get(2..).unwrap_or_default();
        }
        assert!(!rest.is_empty(), "env without a command: {argv:?}");
    }
}
