//! Local servers and a raw proxy client for the proxy tests (127.0.0.1 only).

#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::Duration;

use strata_egress::{Allowlist, EgressConfig, EgressHandle, EgressProxy, EgressRecord};

/// An origin on 127.0.0.1 handling one connection at a time on a single thread.
pub struct Origin {
    pub addr: SocketAddr,
    /// What each connection sent (HTTP: the request head; echo: every byte), in order.
    pub received: mpsc::Receiver<Vec<u8>>,
    _thread: JoinHandle<()>,
}

/// An HTTP origin answering every request with `200` and `body`.
pub fn http_origin(body: &'static [u8]) -> Origin {
    origin(move |mut s| {
        let mut head = Vec::new();
        let mut b = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            match s.read(&mut b) {
                Ok(1) => head.push(b[0]),
                _ => return head,
            }
        }
        let resp = format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n", body.len());
        let _ = s.write_all(resp.as_bytes());
        let _ = s.write_all(body);
        head
    })
}

/// An origin echoing every byte until the client half-closes.
pub fn echo_origin() -> Origin {
    origin(|mut s| {
        let mut seen = Vec::new();
        let mut buf = [0u8; 65536];
        loop {
            match s.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    seen.extend_from_slice(&buf[..n]);
                    if s.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
            }
        }
        seen
    })
}

fn origin(handle: impl Fn(TcpStream) -> Vec<u8> + Send + 'static) -> Origin {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind origin");
    let addr = listener.local_addr().expect("origin addr");
    let (tx, rx) = mpsc::channel();
    let thread = std::thread::spawn(move || {
        for s in listener.incoming() {
            let Ok(s) = s else { continue };
            if tx.send(handle(s)).is_err() {
                break;
            }
        }
    });
    Origin { addr, received: rx, _thread: thread }
}

pub fn proxy(specs: &[String]) -> EgressHandle {
    let allow = Allowlist::parse(specs).expect("allowlist");
    EgressProxy::start(EgressConfig::new(allow).with_tcp("127.0.0.1:0".parse().expect("addr"))).expect("start proxy")
}

pub fn connect(proxy: &EgressHandle) -> TcpStream {
    let s = TcpStream::connect(proxy.tcp_addr().expect("tcp listener")).expect("connect to proxy");
    s.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
    s
}

/// Reads until EOF (or reset).
pub fn read_all(s: &mut impl Read) -> Vec<u8> {
    let mut out = Vec::new();
    let mut buf = [0u8; 65536];
    loop {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => return out,
            Ok(n) => out.extend_from_slice(&buf[..n]),
        }
    }
}

/// Reads a response head (up to the blank line).
pub fn read_head(s: &mut impl Read) -> String {
    let mut head = Vec::new();
    let mut b = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        match s.read(&mut b) {
            Ok(1) => head.push(b[0]),
            _ => break,
        }
    }
    String::from_utf8_lossy(&head).into_owned()
}

/// Waits until `n` records are in, then returns them.
pub fn records(proxy: &EgressHandle, n: usize) -> Vec<EgressRecord> {
    for _ in 0..500 {
        let r = proxy.records();
        if r.len() >= n && proxy.active_connections() == 0 {
            return r;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!("expected {n} records, have {:?}", proxy.records());
}

/// An HTTP origin answering with everything it received: the head, `Content-Length` body bytes, and whatever else
/// arrives within 200 ms after them.
pub fn http_echo_origin() -> Origin {
    origin(|mut s| {
        let mut got = Vec::new();
        let mut b = [0u8; 1];
        while !got.ends_with(b"\r\n\r\n") {
            match s.read(&mut b) {
                Ok(1) => got.push(b[0]),
                _ => return got,
            }
        }
        let head = String::from_utf8_lossy(&got).to_ascii_lowercase();
        let len: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0);
        let mut body = vec![0u8; len];
        if s.read_exact(&mut body).is_err() {
            return got;
        }
        got.extend_from_slice(&body);
        let _ = s.set_read_timeout(Some(Duration::from_millis(200)));
        let mut extra = [0u8; 4096];
        while let Ok(n @ 1..) = s.read(&mut extra) {
            got.extend_from_slice(&extra[..n]);
        }
        let resp = format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n", got.len());
        let _ = s.write_all(resp.as_bytes());
        let _ = s.write_all(&got);
        got
    })
}
