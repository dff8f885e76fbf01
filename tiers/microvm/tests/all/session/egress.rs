//! Network egress through the agent's forwarder and the session's host proxy, with the real agent over a Unix
//! socket: the forwarder's streams go to `<agent socket>_1028`, where the session's egress proxy listens — the
//! same socket path the vsock device connects a guest's port-1028 streams to. The job's client is a host program
//! (`busybox wget`, `python3`), as in a guest it would be the image's.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::unix::net::UnixStream;
use std::thread::JoinHandle;

use super::*;
use strata_core::Net;

/// A local HTTP origin on 127.0.0.1: answers every request with `body` (then closes), counting requests.
struct Origin {
    port: u16,
    _thread: JoinHandle<()>,
}

impl Origin {
    fn http(body: &'static str) -> Origin {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind origin");
        let port = listener.local_addr().expect("addr").port();
        let thread = std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { continue };
                let mut head = Vec::new();
                let mut byte = [0u8; 1];
                while !head.ends_with(b"\r\n\r\n") && stream.read(&mut byte).is_ok_and(|n| n == 1) {
                    head.push(byte[0]);
                }
                let answer =
                    format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len());
                let _ = stream.write_all(answer.as_bytes());
                let _ = stream.shutdown(Shutdown::Both);
            }
        });
        Origin { port, _thread: thread }
    }

    /// A TCP origin that reads whatever comes and never answers (a TLS server that is never reached).
    fn silent() -> Origin {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind origin");
        let port = listener.local_addr().expect("addr").port();
        let thread = std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { continue };
                std::thread::spawn(move || {
                    let mut sink = Vec::new();
                    let _ = stream.read_to_end(&mut sink);
                });
            }
        });
        Origin { port, _thread: thread }
    }
}

fn with_net(fixture: &Fixture, allow: Vec<String>) -> Capabilities {
    Capabilities { net: Net::allow(&allow).expect("valid allowlist"), ..fixture.caps() }
}

fn wget(port: u16) -> String {
    format!("busybox wget -q -O - http://127.0.0.1:{port}/hello")
}

#[test]
fn an_allowed_origin_is_reached_through_the_tunnel_and_logged() {
    let _shared = shared();
    let origin = Origin::http("hello from the origin");
    let fixture = Fixture::new();
    let caps = with_net(&fixture, vec![format!("127.0.0.1:{}", origin.port)]);
    let Some((mut session, _)) = fixture.session_with(&caps, &limits()) else { return };
    let outcome = exec(&mut session, &format!("echo \"$HTTP_PROXY $https_proxy\" >&2; {}", wget(origin.port)));
    assert_eq!(outcome.status, Status::Exited { code: 0 }, "{outcome:?}");
    assert_eq!(String::from_utf8_lossy(&outcome.stdout), "hello from the origin");
    let proxy = session.with_host(|host| host.egress.listen_port).expect("host");
    let url = format!("http://127.0.0.1:{proxy}");
    assert_eq!(String::from_utf8_lossy(&outcome.stderr).trim(), format!("{url} {url}"));
    assert_eq!(outcome.egress.len(), 1, "{:?}", outcome.egress);
    let record = &outcome.egress[0];
    assert_eq!((record.host.as_str(), record.port), ("127.0.0.1", origin.port));
    assert_eq!((record.kind.as_str(), record.verdict.as_str()), ("http", "allowed"));
    assert!(record.bytes_down > 21, "{record:?}");

    // The next job's records are its own.
    let again = exec(&mut session, &wget(origin.port));
    assert_eq!(again.status, Status::Exited { code: 0 }, "{again:?}");
    assert_eq!(again.egress.len(), 1, "{:?}", again.egress);

    // Closing stops both ends: the proxy's socket is removed, nothing listens on the forwarder's port.
    let socket = session.with_host(|host| host.egress.socket.clone()).expect("host");
    assert!(socket.exists());
    session.close().expect("close");
    assert!(!socket.exists(), "the egress proxy's socket outlived the session");
    assert!(TcpStream::connect(("127.0.0.1", proxy)).is_err(), "the forwarder outlived the session");
}

#[test]
fn a_resumed_session_starts_its_egress_too() {
    let _shared = shared();
    let origin = Origin::http("after a fork");
    let fixture = Fixture::new();
    // A fork's guest already holds its grants: none here.
    let caps = Capabilities {
        net: Net::allow([format!("127.0.0.1:{}", origin.port)]).expect("valid allowlist"),
        ..Capabilities::default()
    };
    let work = fixture.guest_root.path().join("work");
    fs::create_dir_all(&work).expect("workdir");
    let Some((agent, client)) = ProcessAgent::spawn(&work) else { return };
    let mut session = Session::resumed(agent, client, &caps, &limits(), Some("parent".into())).expect("resumed");
    let outcome = exec(&mut session, &wget(origin.port));
    assert_eq!(String::from_utf8_lossy(&outcome.stdout), "after a fork", "{outcome:?}");
    assert_eq!(outcome.egress.len(), 1, "{:?}", outcome.egress);
}

#[test]
fn an_origin_not_in_the_allowlist_is_refused_and_logged() {
    let _shared = shared();
    let origin = Origin::http("secret");
    let fixture = Fixture::new();
    let caps = with_net(&fixture, vec!["example.com".into()]);
    let Some((mut session, _)) = fixture.session_with(&caps, &limits()) else { return };
    let outcome = exec(&mut session, &wget(origin.port));
    assert_ne!(outcome.status, Status::Exited { code: 0 }, "{outcome:?}");
    assert!(!String::from_utf8_lossy(&outcome.stdout).contains("secret"));
    assert_eq!(outcome.egress.len(), 1, "{:?}", outcome.egress);
    let record = &outcome.egress[0];
    assert_eq!((record.host.as_str(), record.port), ("127.0.0.1", origin.port));
    assert_eq!(record.verdict, "denied", "{record:?}");
    assert!(record.reason.is_some());
}

#[test]
fn without_network_nothing_listens_and_no_proxy_is_set() {
    let _shared = shared();
    let fixture = Fixture::new();
    let Some((mut session, _)) = fixture.session(&limits()) else { return };
    let (port, socket) = session.with_host(|host| (host.egress.listen_port, host.egress.socket.clone())).expect("host");
    assert!(session.with_egress_proxy(|_| ()).is_none());
    assert!(!socket.exists(), "an egress socket without network");
    assert!(TcpStream::connect(("127.0.0.1", port)).is_err(), "the forwarder listens without network");
    let outcome = exec(&mut session, "env | grep -i _proxy || echo none");
    assert_eq!(String::from_utf8_lossy(&outcome.stdout).trim(), "none");
    assert!(outcome.egress.is_empty());
}

#[test]
fn a_tls_client_hello_with_another_sni_is_refused_through_the_tunnel() {
    let _shared = shared();
    let origin = Origin::silent();
    let fixture = Fixture::new();
    let caps = with_net(&fixture, vec![format!("127.0.0.1:{}", origin.port)]);
    let Some((session, _)) = fixture.session_with(&caps, &limits()) else { return };
    let proxy = session.with_host(|host| host.egress.listen_port).expect("host");
    let script = format!(
        r#"
import socket, ssl
s = socket.create_connection(("127.0.0.1", {proxy}))
s.sendall(b"CONNECT 127.0.0.1:{port} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n")
head = b""
while not head.endswith(b"\r\n\r\n"):
    head += s.recv(1)
print(head.split(b"\r\n")[0].decode())
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
ctx.check_hostname = False
ctx.verify_mode = ssl.CERT_NONE
s.settimeout(5)
try:
    ctx.wrap_socket(s, server_hostname="evil.example")
    print("handshake done")
except Exception as e:
    print("handshake failed")
"#,
        port = origin.port
    );
    let job = Job::Command { argv: vec!["python3".into(), "-c".into(), script] };
    let outcome = session.exec(&job, ExecOptions::default()).expect("exec");
    assert_eq!(outcome.status, Status::Exited { code: 0 }, "{outcome:?}");
    let stdout = String::from_utf8_lossy(&outcome.stdout);
    assert!(stdout.contains(" 200 "), "{stdout}");
    assert!(stdout.contains("handshake failed"), "{stdout}");
    assert_eq!(outcome.egress.len(), 1, "{:?}", outcome.egress);
    let record = &outcome.egress[0];
    assert_eq!((record.kind.as_str(), record.verdict.as_str()), ("connect", "denied"), "{record:?}");
    assert!(record.reason.as_deref().is_some_and(|r| r.contains("SNI")), "{record:?}");
}

#[test]
fn tunnels_are_capped_on_both_sides() {
    let _shared = shared();
    let fixture = Fixture::new();
    let caps = with_net(&fixture, vec!["example.com".into()]);
    let Some((mut session, _)) = fixture.session_with(&caps, &limits()) else { return };
    let (port, socket) = session.with_host(|host| (host.egress.listen_port, host.egress.socket.clone())).expect("host");
    let cap = strata_guest_proto::DEFAULT_EGRESS_CONNECTIONS as usize;
    let read_answer = |s: &mut dyn Read| {
        let mut answer = String::new();
        let _ = s.read_to_string(&mut answer);
        answer
    };

    // The agent's forwarder: `cap` tunnels held open, the next client gets a 503.
    let held: Vec<TcpStream> = (0..cap).map(|_| TcpStream::connect(("127.0.0.1", port)).expect("connect")).collect();
    let deadline = Instant::now() + Duration::from_secs(10);
    while session.with_egress_proxy(|proxy| proxy.active_connections()).expect("proxy") < cap {
        assert!(Instant::now() < deadline, "the tunnels did not reach the proxy");
        std::thread::sleep(Duration::from_millis(10));
    }
    let mut extra = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    assert!(read_answer(&mut extra).starts_with("HTTP/1.1 503"));
    drop(held);

    // A guest going around the forwarder (its own streams to the egress port) meets the proxy's own cap.
    let deadline = Instant::now() + Duration::from_secs(10);
    while session.with_egress_proxy(|proxy| proxy.active_connections()).expect("proxy") > 0 {
        assert!(Instant::now() < deadline, "the tunnels did not close");
        std::thread::sleep(Duration::from_millis(10));
    }
    let direct: Vec<UnixStream> = (0..cap).map(|_| UnixStream::connect(&socket).expect("connect")).collect();
    let deadline = Instant::now() + Duration::from_secs(10);
    while session.with_egress_proxy(|proxy| proxy.active_connections()).expect("proxy") < cap {
        assert!(Instant::now() < deadline, "the streams did not reach the proxy");
        std::thread::sleep(Duration::from_millis(10));
    }
    let mut over = UnixStream::connect(&socket).expect("connect");
    assert!(read_answer(&mut over).starts_with("HTTP/1.1 503"));
    drop(direct);

    // The session goes on.
    let outcome = exec(&mut session, "echo still here");
    assert_eq!(String::from_utf8_lossy(&outcome.stdout).trim(), "still here");
}
