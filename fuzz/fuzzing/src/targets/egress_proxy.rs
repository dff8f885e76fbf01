//! The egress proxy end to end (`engine/egress/src/proxy.rs`): a job's whole connection to the proxy's Unix
//! socket, through the head reader, the allowlist, the origin connection and the relay or the TLS gate, with an
//! origin on loopback that the allowlist names (`127.0.0.1:<port>`).
//!
//! Input: the bytes the job sends before it closes its side, where each `ORIGIN` stands for the origin's
//! `127.0.0.1:<port>` (its port is picked when the target starts).
//!
//! Oracles: nothing panics and the proxy always answers a complete head with a status line (a connection closed
//! before one may get nothing); a head it cannot parse gets the parser's status and reaches no origin; a target
//! the allowlist does not name gets `403` and reaches no origin; an absolute-form request reaches the origin as
//! its rewritten head and at most `Content-Length` body bytes, never the bytes after them; a `CONNECT` whose first
//! bytes are a TLS ClientHello naming a server reaches the origin with nothing (the SNI must equal the `CONNECT`
//! host, an IP address here), nor does one whose ClientHello is broken.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::Duration;

use strata_egress::http::{head_end, parse_head};
use strata_egress::sni::{ClientHelloParse, HANDSHAKE_RECORD, parse_client_hello};
use strata_egress::{Allowlist, EgressConfig, EgressHandle, EgressProxy, Host};

/// The origin's answer to whatever it is sent.
const ANSWER: &[u8] = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok";

struct Rig {
    socket: PathBuf,
    origin_port: u16,
    /// What each origin connection received, in order.
    received: Arc<Mutex<Vec<Vec<u8>>>>,
    proxy: EgressHandle,
}

impl Rig {
    /// What reached the origin for the connection just made: once the proxy has finished with it (its record
    /// is in when no connection is active, its origin socket closed), a marker connection to the origin, which
    /// accepts in order, comes after everything it caused.
    fn settle(&self) -> Vec<Vec<u8>> {
        for _ in 0..5000 {
            if self.proxy.active_connections() == 0 {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        let mut marker = TcpStream::connect(("127.0.0.1", self.origin_port)).expect("connect to the origin");
        marker.write_all(BARRIER).expect("write the marker");
        drop(marker);
        loop {
            let mut log = self.received.lock().unwrap_or_else(PoisonError::into_inner);
            if let Some(at) = log.iter().position(|r| r == BARRIER) {
                let reached: Vec<Vec<u8>> = log.drain(..=at).take(at).collect();
                return reached;
            }
            drop(log);
            std::thread::sleep(Duration::from_micros(200));
        }
    }
}

/// What the marker connection sends the origin.
const BARRIER: &[u8] = b"\0strata-fuzz barrier\0";

fn rig() -> &'static Rig {
    static RIG: OnceLock<Rig> = OnceLock::new();
    RIG.get_or_init(|| {
        let origin = TcpListener::bind("127.0.0.1:0").expect("an origin listener");
        let origin_port = origin.local_addr().expect("its address").port();
        let received = Arc::new(Mutex::new(Vec::new()));
        let log = received.clone();
        std::thread::spawn(move || {
            for stream in origin.incoming() {
                let Ok(mut stream) = stream else { continue };
                // Everything until the proxy closes its side, or falls silent (a forwarded request is not closed).
                let _ = stream.set_read_timeout(Some(Duration::from_millis(30)));
                let mut got = Vec::new();
                let mut buf = [0u8; 65536];
                while let Ok(n @ 1..) = stream.read(&mut buf) {
                    got.extend_from_slice(&buf[..n]);
                }
                log.lock().unwrap_or_else(PoisonError::into_inner).push(got);
                let _ = stream.write_all(ANSWER);
            }
        });
        let socket = crate::scratch::dir().join("egress.sock");
        let _ = std::fs::remove_file(&socket);
        let allow = Allowlist::parse([format!("127.0.0.1:{origin_port}")]).expect("the allowlist");
        let proxy = EgressProxy::start(
            EgressConfig::new(allow)
                .with_unix_socket(&socket)
                .with_idle_timeout(Duration::from_secs(2))
                .with_connect_timeout(Duration::from_secs(2))
                .with_worker_threads(1),
        )
        .expect("the proxy");
        Rig { socket, origin_port, received, proxy }
    })
}

/// Sends `data` through the proxy and checks what came back and what reached the origin.
pub fn run(data: &[u8]) {
    let rig = rig();
    let data = &substitute(data, format!("127.0.0.1:{}", rig.origin_port).as_bytes());
    let mut client = UnixStream::connect(&rig.socket).expect("connect to the proxy");
    client.set_read_timeout(Some(Duration::from_secs(10))).expect("a timeout");
    // The proxy may answer and close before it read everything: a failed write is its refusal, not a finding.
    let _ = client.write_all(data);
    let _ = client.shutdown(Shutdown::Write);
    let mut answer = Vec::new();
    let _ = client.read_to_end(&mut answer);
    let reached = rig.settle();
    let origin_bytes: usize = reached.iter().map(Vec::len).sum();

    let Some(end) = head_end(data).filter(|&end| end <= 16 * 1024) else {
        assert!(reached.is_empty(), "an origin was reached without a complete head");
        return;
    };
    assert!(
        answer.starts_with(b"HTTP/1.1 "),
        "no status line for a complete head: {:?}",
        String::from_utf8_lossy(&answer)
    );
    let status = &answer[9..answer.len().min(12)];
    let head = match parse_head(&data[..end]) {
        Ok(head) => head,
        Err(err) => {
            assert_eq!(status, &err.status().as_bytes()[..3], "the status of a head the parser refuses");
            assert!(reached.is_empty(), "a refused head reached an origin");
            return;
        }
    };
    let ours = head.host == Host::Ip([127, 0, 0, 1].into()) && head.port == rig.origin_port;
    if !ours {
        assert_eq!(status, b"403", "a target outside the allowlist");
        assert!(reached.is_empty(), "a target outside the allowlist was reached");
        return;
    }
    let leftover = &data[end..];
    if head.is_connect() {
        assert_eq!(status, b"200", "CONNECT to an allowed target");
        let tls = leftover.first() == Some(&HANDSHAKE_RECORD);
        match (tls, parse_client_hello(leftover)) {
            (true, Ok(ClientHelloParse::Complete(Some(name)))) => {
                assert_eq!(origin_bytes, 0, "a ClientHello naming {name} went to an IP CONNECT")
            }
            (true, Err(_)) | (true, Ok(ClientHelloParse::Incomplete)) => {
                assert_eq!(origin_bytes, 0, "a broken or unfinished ClientHello reached the origin")
            }
            (true, Ok(ClientHelloParse::Complete(None))) | (false, _) => {
                assert_eq!(origin_bytes, leftover.len(), "the tunnel did not carry the bytes sent")
            }
        }
    } else {
        let forwarded = head.origin_head();
        let body = usize::try_from(head.content_length).unwrap_or(usize::MAX).min(leftover.len());
        let expected = [forwarded.as_slice(), &leftover[..body]].concat();
        assert_eq!(reached.len(), 1, "one origin connection per request");
        assert!(
            reached[0] == expected,
            "the origin got {} bytes, not the rewritten head and {body} body bytes",
            reached[0].len()
        );
    }
}

/// `data` with every `ORIGIN` replaced by `origin`.
fn substitute(data: &[u8], origin: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(data.len() + 16);
    let mut rest = data;
    while let Some(at) = rest.windows(6).position(|w| w == b"ORIGIN") {
        out.extend_from_slice(&rest[..at]);
        out.extend_from_slice(origin);
        rest = &rest[at + 6..];
    }
    out.extend_from_slice(rest);
    out
}
