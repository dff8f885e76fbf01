//! The E2B layer's request parsers (`engine/serve/src/e2b*.rs`): the Connect-RPC envelope, `process.Process/Start`
//! and the unary process calls' messages, the filesystem calls, and the control plane's and code interpreter's
//! JSON bodies, as the official SDK (or anyone holding a sandbox's token) sends them.
//!
//! Input: a selector byte, then the body.
//!
//! Oracles: nothing panics; a refusal is a 4xx, never a server error; a command's argv is non-empty and free of
//! NUL, and when it goes through `env` a command follows the options; a filesystem call's
//! argv names the operation asked for, with non-empty, NUL-free paths.

use strata_serve::e2b::fuzzing::{connect_envelope, control_bodies, filesystem_call, process_start, process_unary};

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
        _ => {
            let _ = control_bodies(body);
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
