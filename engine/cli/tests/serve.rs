//! `strata serve` as a process: it listens, serves, and on SIGTERM closes every sandbox and exits 0.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// One HTTP/1.1 request on a fresh connection; returns the status and the body.
fn request(addr: &str, method: &str, path: &str, body: &str) -> (u16, String) {
    let mut stream = TcpStream::connect(addr).expect("connect");
    stream.set_read_timeout(Some(Duration::from_secs(60))).expect("timeout");
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).and_then(|()| stream.write_all(body.as_bytes())).expect("send");
    let mut response = String::new();
    stream.read_to_string(&mut response).expect("read");
    let status = response.split(' ').nth(1).and_then(|s| s.parse().ok()).expect("status line");
    let body = response.split_once("\r\n\r\n").map(|(_, b)| b.to_owned()).unwrap_or_default();
    (status, body)
}

#[test]
fn serve_answers_and_sigterm_closes_every_sandbox() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(["serve", "--listen", "127.0.0.1:0"])
        .env_remove("RUST_LOG")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn strata serve");
    let mut stderr = BufReader::new(child.stderr.take().expect("stderr"));
    let mut log = String::new();
    let addr = loop {
        let mut line = String::new();
        assert!(stderr.read_line(&mut line).expect("read log") > 0, "strata serve exited: {log}");
        log.push_str(&line);
        if let Some((_, rest)) = line.split_once("addr=") {
            break rest.trim().to_owned();
        }
    };
    assert!(log.contains("no API keys"), "the open server says so: {log}");
    let (status, _) = request(&addr, "GET", "/health", "");
    assert_eq!(status, 204);
    let (status, body) = request(&addr, "POST", "/v1/sandboxes", r#"{"tier":"wasm"}"#);
    assert_eq!(status, 201, "{body}");
    let (status, body) = request(&addr, "POST", "/v1/sandboxes", r#"{"tier":"process"}"#);
    assert!(status == 201 || status == 503, "{status} {body}");
    let (status, body) = request(&addr, "POST", "/v1/sandboxes", "{oops");
    assert_eq!(status, 400, "{body}");
    assert!(body.contains(r#""code":"invalid_json""#), "{body}");

    let kill = Command::new("kill").args(["-TERM", &child.id().to_string()]).status().expect("kill");
    assert!(kill.success());
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        assert!(started.elapsed() < Duration::from_secs(20), "strata serve still runs 20 s after SIGTERM");
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut rest = String::new();
    let _ = stderr.read_to_string(&mut rest);
    assert_eq!(status.code(), Some(0), "{rest}");
    assert!(rest.contains("SIGTERM received"), "{rest}");
    assert!(rest.contains("closed every sandbox"), "{rest}");
    assert!(!rest.contains("panicked"), "{rest}");
}
