//! The E2B layer's request parsers (`engine/serve/src/e2b*.rs`): the Connect-RPC envelope, `process.Process/Start`
//! and the unary process calls' messages, the filesystem calls, and the control plane's and code interpreter's
//! JSON bodies, as the official SDK (or anyone holding a sandbox's token) sends them; and `/files`' signed-URL
//! queries, gzipped uploads and coding headers, as anyone (with no token) may send them.
//!
//! Input: a selector byte, then the body (for a client stream, `StreamInput`'s, read whole and split at points the
//! body's first bytes choose; for `/files`, a query string, a gzip body, or `Content-Encoding` and
//! `Accept-Encoding` values split at the first newline).
//!
//! Oracles: nothing panics; a client stream gives the same messages (or the same refusal) however it is split; a refusal is a 4xx, never a server error; a command's argv is non-empty and free of
//! NUL, and when it goes through `env` a command follows the options; a filesystem call's
//! argv names the operation asked for, with non-empty, NUL-free paths; a signed query passes only with the
//! signature of its own path, user, operation and expiration, unexpired; a gzipped upload never inflates past the
//! bound, and what it inflates to gzips back to itself.

use strata_serve::e2b::fuzzing::{
    FileOperation, connect_envelope, control_bodies, envelope_stream, file_signature, files_download_gzipped,
    files_upload, filesystem_call, gzip, process_start, process_unary, signed_files_query,
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
        _ if (selector / 8) % 2 == 1 => files(selector, body),
        _ => {
            let _ = control_bodies(body);
        }
    }
}

/// The access token `/files` signatures are checked against, and the time they are checked at (the seeds' own).
pub const TOKEN: &str = "tok_0123456789abcdef";
/// See [`TOKEN`].
pub const NOW: i64 = 1_767_225_600;

/// The most bytes an upload here inflates to (small, so that the bound is reached).
const INFLATED_MAX: usize = 4096;

/// `/files` without a token: a signed query (read or write), a gzipped upload, or the coding headers.
fn files(selector: u8, body: &[u8]) {
    let refused =
        |err: strata_serve::e2b::E2bError| assert!(err.status.is_client_error(), "{}: {}", err.status, err.message);
    match (selector / 16) % 4 {
        kind @ (0 | 3) => {
            let operation = if kind == 3 { FileOperation::Write } else { FileOperation::Read };
            match signed_files_query(&String::from_utf8_lossy(body), operation, TOKEN, NOW) {
                Ok(query) => {
                    let expiration = query.signature_expiration.as_deref().map(|e| e.parse::<i64>().expect("checked"));
                    assert!(expiration.is_none_or(|e| e >= NOW), "expired at {expiration:?}");
                    let expected = file_signature(&query.path, operation, &query.username, TOKEN, expiration);
                    assert_eq!(query.signature.as_deref(), Some(expected.as_str()), "{query:?}");
                }
                Err(err) => refused(err),
            }
        }
        1 => match files_upload(Some("gzip"), body, INFLATED_MAX) {
            Ok(plain) => {
                assert!(plain.len() <= INFLATED_MAX, "inflated to {} bytes", plain.len());
                assert_eq!(files_upload(Some("gzip"), &gzip(&plain), INFLATED_MAX).ok(), Some(plain));
            }
            Err(err) => refused(err),
        },
        _ => {
            let text = String::from_utf8_lossy(body);
            let (content, accept) = text.split_once('\n').unwrap_or((&text, ""));
            if let Err(err) = files_upload(Some(content), b"", INFLATED_MAX) {
                refused(err);
            }
            if let Err(err) = files_download_gzipped(Some(accept)) {
                refused(err);
            }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The `/files` seeds reach what they are for: the signed queries pass (the expiring one until it expires), the
    /// bomb is refused at the bound, the upload inflates.
    #[test]
    fn files_seeds_reach_their_branches() {
        let seeds = crate::seeds::of("e2b_connect");
        let query = |name: &str| {
            let (_, bytes) = seeds.iter().find(|(n, _)| n == name).expect(name);
            String::from_utf8_lossy(&bytes[1..]).into_owned()
        };
        let read = query("seed-signed-read");
        assert!(signed_files_query(&read, FileOperation::Read, TOKEN, NOW).is_ok(), "{read}");
        assert!(signed_files_query(&read, FileOperation::Write, TOKEN, NOW).is_err(), "{read}");
        let write = query("seed-signed-write-expiring");
        assert!(signed_files_query(&write, FileOperation::Write, TOKEN, NOW).is_ok(), "{write}");
        assert!(signed_files_query(&write, FileOperation::Write, TOKEN, NOW + 3600).is_err(), "{write}");
        let body =
            |name: &str| seeds.iter().find(|(n, _)| n == name).map(|(_, bytes)| bytes[1..].to_vec()).expect(name);
        let bomb = files_upload(Some("gzip"), &body("seed-gzip-bomb"), INFLATED_MAX);
        assert_eq!(bomb.map_err(|e| e.status.as_u16()), Err(413));
        let upload = files_upload(Some("gzip"), &body("seed-gzip-upload"), INFLATED_MAX);
        assert_eq!(upload.ok(), Some(b"hello from a gzipped upload\n".to_vec()));
    }
}
