//! Connections that never finish a request: header, keep-alive, body and write timeouts, caps per peer and in all,
//! and the body limit — each enforced before authentication, each leaving the server's descriptors as they were.
//! The server runs in this process, so `/proc/self/fd` counts its sockets (and the test's own ends of them).

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use futures_util::{SinkExt, StreamExt};
use serde_json::{Value, json};
use strata_serve::{ConnectionLimits, KeyStore};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};
use tokio_tungstenite::tungstenite::Message;

use crate::util::{TestServer, engine, process_tier};

fn addr(server: &TestServer) -> SocketAddr {
    server.base.strip_prefix("http://").and_then(|a| a.parse().ok()).expect("server address")
}

/// A connection to the server from the loopback address `source` (127.0.0.2 is another peer than 127.0.0.1).
async fn connect_from(server: &TestServer, source: &str) -> TcpStream {
    let socket = TcpSocket::new_v4().expect("socket");
    socket.bind(SocketAddr::new(source.parse().expect("source ip"), 0)).expect("bind the source address");
    socket.connect(addr(server)).await.expect("connect")
}

/// Reads one response: its status and JSON body (`Null` when empty, a string when not JSON).
async fn read_response(stream: &mut TcpStream) -> (u16, Value) {
    let mut data = Vec::new();
    let mut buf = [0u8; 4096];
    let head_end = loop {
        if let Some(end) = data.windows(4).position(|w| w == b"\r\n\r\n") {
            break end + 4;
        }
        let n = stream.read(&mut buf).await.expect("read a response");
        assert!(n > 0, "the connection closed before a response: {:?}", String::from_utf8_lossy(&data));
        data.extend_from_slice(&buf[..n]);
    };
    let head = String::from_utf8_lossy(&data[..head_end]).into_owned();
    let status = head.split(' ').nth(1).and_then(|s| s.parse().ok()).expect("a status line");
    let length: usize = head
        .lines()
        .find_map(|l| {
            let (name, value) = l.split_once(':')?;
            name.eq_ignore_ascii_case("content-length").then(|| value.trim().parse().ok())?
        })
        .unwrap_or(0);
    while data.len() < head_end + length {
        let n = stream.read(&mut buf).await.expect("read a body");
        assert!(n > 0, "the connection closed inside a body");
        data.extend_from_slice(&buf[..n]);
    }
    let body = &data[head_end..head_end + length];
    let body = if body.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(body).unwrap_or_else(|_| Value::String(String::from_utf8_lossy(body).into_owned()))
    };
    (status, body)
}

/// Waits up to `limit` for the server to close `stream` (end of file or reset), discarding what it sends;
/// `None` while it is still open.
async fn closed_within(stream: &mut TcpStream, limit: Duration) -> Option<Duration> {
    let started = Instant::now();
    let mut buf = [0u8; 65536];
    tokio::time::timeout(limit, async {
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return started.elapsed(),
                Ok(_) => {}
            }
        }
    })
    .await
    .ok()
}

/// What a server's connections hold: this process's descriptors in all, and its TCP sockets connected to or from
/// the server's port (both ends, the test's and the server's: the server runs in this process).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Held {
    fds: usize,
    connections: usize,
}

fn held(server: &TestServer) -> Held {
    let port = addr(server).port();
    let inodes: std::collections::HashSet<String> = std::fs::read_dir("/proc/self/fd")
        .map(|d| {
            d.flatten()
                .filter_map(|e| std::fs::read_link(e.path()).ok())
                .map(|l| l.to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    let fds = inodes.len();
    let port_of = |field: &str| field.rsplit(':').next().and_then(|p| u16::from_str_radix(p, 16).ok());
    let mut connections = 0;
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        for line in std::fs::read_to_string(table).unwrap_or_default().lines().skip(1) {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let (Some(local), Some(remote), Some(state), Some(inode)) =
                (fields.get(1), fields.get(2), fields.get(3), fields.get(9))
            else {
                continue;
            };
            let ours = inodes.contains(&format!("socket:[{inode}]"));
            let listening = *state == "0A";
            if ours && !listening && (port_of(local) == Some(port) || port_of(remote) == Some(port)) {
                connections += 1;
            }
        }
    }
    Held { fds, connections }
}

/// Asserts that the server's connections all closed (waiting up to 10 s for the last to go), printing the fds
/// before and after. (The fd total also counts runtimes of tests starting beside this one: it is printed, the
/// sockets are asserted.)
async fn assert_no_leak(what: &str, server: &TestServer, before: Held) {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut after = held(server);
    while after.connections > before.connections && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
        after = held(server);
    }
    eprintln!(
        "{what}: fds before {}, after {}; sockets of the server's connections before {}, after {}",
        before.fds, after.fds, before.connections, after.connections
    );
    assert!(after.connections <= before.connections, "{what}: connections left open: {before:?} → {after:?}");
}

const GET_LIST: &[u8] = b"GET /v1/sandboxes HTTP/1.1\r\nhost: strata\r\n\r\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_header_connections_are_closed_after_the_header_timeout() {
    let _ = engine();
    let server = TestServer::alone(|config| {
        config.connections.header_timeout = Duration::from_secs(1);
        config.connections.keep_alive_timeout = Duration::from_secs(60);
    })
    .await;
    let before = held(&server);
    let mut tasks = Vec::new();
    for n in 0..40 {
        let mut stream = connect_from(&server, "127.0.0.1").await;
        tasks.push(tokio::spawn(async move {
            let started = Instant::now();
            let (mut read, mut write) = stream.split();
            // Half of them trickle a header a line at a time (slowloris); the others send nothing at all.
            let trickle = n % 2 == 0;
            if trickle {
                let _ = write.write_all(b"GET /v1/sandboxes HTTP/1.1\r\nhost: strata\r\n").await;
            }
            let mut buf = [0u8; 1024];
            let mut tick = tokio::time::interval(Duration::from_millis(200));
            while started.elapsed() < Duration::from_secs(8) {
                tokio::select! {
                    read = read.read(&mut buf) => match read {
                        Ok(0) | Err(_) => return Some(started.elapsed()),
                        Ok(_) => {}
                    },
                    _ = tick.tick() => if trickle && write.write_all(b"x-slow: 1\r\n").await.is_err() {
                        return Some(started.elapsed());
                    },
                }
            }
            None
        }));
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let during = held(&server);
    let mut closed = Vec::new();
    for task in tasks {
        closed.push(task.await.expect("task"));
    }
    eprintln!("40 slow connections: while open {during:?}; closed after {closed:?}");
    for (n, at) in closed.iter().enumerate() {
        let at = at.unwrap_or_else(|| panic!("connection {n} was still open after 8 s"));
        assert!(at >= Duration::from_millis(900) && at < Duration::from_secs(5), "connection {n} closed after {at:?}");
    }
    assert_eq!(during.connections, before.connections + 80, "both ends of every connection were open meanwhile");
    assert_no_leak("slow headers", &server, before).await;
    let metrics = server.client.get(server.url("/metrics")).send().await.expect("metrics").text().await.expect("text");
    assert!(metrics.contains("strata_connections_closed_total{reason=\"header_timeout\"} 40"), "{metrics}");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_keep_alive_connections_are_closed_after_the_keep_alive_timeout() {
    let _ = engine();
    let server = TestServer::alone(|config| {
        config.connections.header_timeout = Duration::from_secs(1);
        config.connections.keep_alive_timeout = Duration::from_secs(3);
    })
    .await;
    let before = held(&server);
    let mut stream = connect_from(&server, "127.0.0.1").await;
    stream.write_all(GET_LIST).await.expect("request");
    assert_eq!(read_response(&mut stream).await.0, 200);
    // Idle for longer than the header timeout: still open, and serves the next request.
    tokio::time::sleep(Duration::from_secs(2)).await;
    stream.write_all(GET_LIST).await.expect("second request");
    assert_eq!(read_response(&mut stream).await.0, 200);
    let closed = closed_within(&mut stream, Duration::from_secs(10)).await;
    let closed = closed.expect("an idle keep-alive connection is closed");
    assert!(closed >= Duration::from_millis(2500) && closed < Duration::from_secs(6), "closed after {closed:?}");
    drop(stream);
    eprintln!("closed {closed:?} after its last response");
    assert_no_leak("keep-alive", &server, before).await;
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_past_the_per_peer_cap_are_refused_while_another_peer_is_served() {
    let _ = engine();
    let server = TestServer::alone(|config| {
        config.connections.max_connections_per_peer = 4;
        config.connections.max_connections = 100;
    })
    .await;
    let before = held(&server);
    let mut held = Vec::new();
    for _ in 0..4 {
        let mut stream = connect_from(&server, "127.0.0.1").await;
        stream.write_all(GET_LIST).await.expect("request");
        assert_eq!(read_response(&mut stream).await.0, 200);
        held.push(stream);
    }
    // The fifth from the same address is answered and closed at accept, without a byte read.
    let mut fifth = connect_from(&server, "127.0.0.1").await;
    let (status, body) =
        tokio::time::timeout(Duration::from_secs(5), read_response(&mut fifth)).await.expect("refused");
    assert_eq!((status, body["error"]["code"].as_str()), (429, Some("too_many_connections")), "{body}");
    assert!(closed_within(&mut fifth, Duration::from_secs(2)).await.is_some(), "the refused connection is closed");
    // Another peer is served meanwhile.
    let mut other = connect_from(&server, "127.0.0.2").await;
    other.write_all(GET_LIST).await.expect("request");
    assert_eq!(read_response(&mut other).await.0, 200);
    // A closed connection frees its place.
    held.pop();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut again = connect_from(&server, "127.0.0.1").await;
    again.write_all(GET_LIST).await.expect("request");
    assert_eq!(read_response(&mut again).await.0, 200);
    assert_eq!(server.state.connections.open(), 5);
    drop((held, fifth, other, again));
    assert_no_leak("per-peer cap", &server, before).await;
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_past_the_total_cap_are_refused() {
    let _ = engine();
    let server = TestServer::alone(|config| {
        config.connections.max_connections_per_peer = 4;
        config.connections.max_connections = 6;
    })
    .await;
    let before = held(&server);
    let mut held = Vec::new();
    for source in ["127.0.0.1", "127.0.0.1", "127.0.0.1", "127.0.0.2", "127.0.0.2", "127.0.0.3"] {
        let mut stream = connect_from(&server, source).await;
        stream.write_all(GET_LIST).await.expect("request");
        assert_eq!(read_response(&mut stream).await.0, 200);
        held.push(stream);
    }
    let mut seventh = connect_from(&server, "127.0.0.4").await;
    let (status, body) =
        tokio::time::timeout(Duration::from_secs(5), read_response(&mut seventh)).await.expect("refused");
    assert_eq!((status, body["error"]["code"].as_str()), (503, Some("too_many_connections")), "{body}");
    drop(seventh);
    held.pop();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut metrics = connect_from(&server, "127.0.0.4").await;
    metrics.write_all(b"GET /metrics HTTP/1.1\r\nhost: strata\r\n\r\n").await.expect("request");
    let (status, text) = read_response(&mut metrics).await;
    assert_eq!(status, 200);
    let text = text.as_str().unwrap_or_default().to_owned();
    assert!(text.contains("strata_connections_closed_total{reason=\"total_cap\"} 1"), "{text}");
    assert!(text.contains("strata_connections_open 6"), "{text}");
    drop((held, metrics));
    assert_no_leak("total cap", &server, before).await;
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_over_the_limit_gets_413_before_authentication_and_without_being_read() {
    let _ = engine();
    let server = TestServer::alone(|config| {
        config.keys = Some(KeyStore::from_keys([("alice", "alice-key", None)]));
        config.connections.max_body = 1 << 20;
    })
    .await;
    let before = held(&server);
    // No key, and a declared gigabyte of which 64 KiB come: 413 at once, not 401, and not after reading it.
    let mut stream = connect_from(&server, "127.0.0.1").await;
    let head = "POST /v1/sandboxes HTTP/1.1\r\nhost: strata\r\ncontent-type: application/json\r\n\
                content-length: 1073741824\r\n\r\n";
    stream.write_all(head.as_bytes()).await.expect("head");
    stream.write_all(&vec![b' '; 64 << 10]).await.expect("some body");
    let (status, body) =
        tokio::time::timeout(Duration::from_secs(5), read_response(&mut stream)).await.expect("answer");
    assert_eq!((status, body["error"]["code"].as_str()), (413, Some("body_too_large")), "{body}");
    assert!(closed_within(&mut stream, Duration::from_secs(5)).await.is_some(), "and the connection is closed");
    drop(stream);
    // The E2B shape off /v1.
    let mut stream = connect_from(&server, "127.0.0.1").await;
    let head = "POST /sandboxes HTTP/1.1\r\nhost: strata\r\ncontent-length: 2000000\r\n\r\n";
    stream.write_all(head.as_bytes()).await.expect("head");
    let (status, body) =
        tokio::time::timeout(Duration::from_secs(5), read_response(&mut stream)).await.expect("answer");
    assert_eq!((status, body["code"].as_u64()), (413, Some(413)), "{body}");
    drop(stream);
    // A body without a length, with a key: cut where it passes the limit.
    let mut stream = connect_from(&server, "127.0.0.1").await;
    let head = "POST /v1/sandboxes HTTP/1.1\r\nhost: strata\r\ncontent-type: application/json\r\n\
                authorization: Bearer alice-key\r\ntransfer-encoding: chunked\r\n\r\n";
    stream.write_all(head.as_bytes()).await.expect("head");
    let (mut read, mut write) = stream.into_split();
    let writer = tokio::spawn(async move {
        let chunk = format!("{:x}\r\n{}\r\n", 64 << 10, " ".repeat(64 << 10));
        let mut sent = 0usize;
        // 64 MiB at most: far past the limit, and past what socket buffers hold.
        while sent < 64 << 20 {
            if write.write_all(chunk.as_bytes()).await.is_err() {
                break;
            }
            sent += 64 << 10;
        }
        sent
    });
    let mut response = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), read.read_to_end(&mut response)).await;
    let sent = writer.await.expect("writer");
    let text = String::from_utf8_lossy(&response);
    assert!(text.starts_with("HTTP/1.1 413"), "{text}");
    assert!(text.contains("body_too_large"), "{text}");
    assert!(sent < 64 << 20, "the server read the whole 64 MiB ({sent} bytes sent)");
    drop(read);
    eprintln!("{sent} bytes of a chunked body sent before it was cut");
    assert_no_leak("body limit", &server, before).await;
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_body_times_out() {
    let _ = engine();
    let server = TestServer::alone(|config| config.connections.body_timeout = Duration::from_secs(1)).await;
    // The client's pooled connection and the wasm tier's first sandbox are open before counting.
    let warm = server.create(json!({"tier": "wasm"})).await;
    assert_eq!(server.delete(&format!("/v1/sandboxes/{warm}")).await, 204);
    let before = held(&server);
    let mut stream = connect_from(&server, "127.0.0.1").await;
    let head = "POST /v1/sandboxes HTTP/1.1\r\nhost: strata\r\ncontent-type: application/json\r\n\
                content-length: 100\r\n\r\n{\"tier\":";
    let started = Instant::now();
    stream.write_all(head.as_bytes()).await.expect("head");
    let (status, body) =
        tokio::time::timeout(Duration::from_secs(5), read_response(&mut stream)).await.expect("answer");
    let took = started.elapsed();
    assert_eq!((status, body["error"]["code"].as_str()), (408, Some("body_timeout")), "{body}");
    assert!(took >= Duration::from_millis(900), "answered after {took:?}");
    assert!(closed_within(&mut stream, Duration::from_secs(5)).await.is_some(), "and the connection is closed");
    drop(stream);
    // A WebSocket's job is its body: it must come in time too.
    let id = server.create(json!({"tier": "wasm"})).await;
    let url = format!("{}/v1/sandboxes/{id}/exec/ws", server.ws_base);
    let (mut socket, _) = tokio_tungstenite::connect_async(url).await.expect("websocket connects");
    let message = tokio::time::timeout(Duration::from_secs(5), socket.next()).await.expect("an answer within 5 s");
    let Some(Ok(Message::Text(text))) = message else { panic!("a text message, not {message:?}") };
    let message: Value = serde_json::from_str(&text).expect("json");
    assert_eq!((message["type"].as_str(), message["error"]["code"].as_str()), (Some("error"), Some("body_timeout")));
    drop(socket);
    assert_eq!(server.delete(&format!("/v1/sandboxes/{id}")).await, 204);
    eprintln!("the slow body was answered after {took:?}");
    assert_no_leak("slow body", &server, before).await;
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stops_reading_is_cut_by_the_write_timeout() {
    let _ = engine();
    let dir = tempfile::tempdir().expect("tempdir");
    let size = 32usize << 20;
    std::fs::write(dir.path().join("big"), vec![7u8; size]).expect("write the file");
    let server = TestServer::alone(|config| {
        config.allow_grants = true;
        config.connections.write_timeout = Duration::from_secs(1);
    })
    .await;
    let grant = format!("{}:/data:ro", dir.path().display());
    let id = server.create(json!({"tier": "wasm", "capabilities": {"grants": [grant]}})).await;
    let before = held(&server);
    let socket = TcpSocket::new_v4().expect("socket");
    socket.set_recv_buffer_size(16 << 10).expect("a small receive buffer");
    let mut stream = socket.connect(addr(&server)).await.expect("connect");
    let request = format!("GET /v1/sandboxes/{id}/files?path=/data/big HTTP/1.1\r\nhost: strata\r\n\r\n");
    stream.write_all(request.as_bytes()).await.expect("request");
    // Reads nothing for a while: the server's writes wait, then fail.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let mut received = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(20), stream.read_to_end(&mut received)).await;
    assert!(read.is_ok(), "the connection ended");
    assert!(
        received.starts_with(b"HTTP/1.1 200"),
        "{:?}",
        String::from_utf8_lossy(&received[..64.min(received.len())])
    );
    assert!(received.len() < size, "the whole {size} bytes came ({}): the stalled write was not cut", received.len());
    drop(stream);
    eprintln!("{} of {size} bytes came before the write timed out", received.len());
    assert_no_leak("write timeout", &server, before).await;
    assert_eq!(server.delete(&format!("/v1/sandboxes/{id}")).await, 204);
    server.stop().await;
}

/// A request in flight is not idle: a silent job, a WebSocket and a server-streaming call (with its keepalives)
/// outlive a keep-alive timeout shorter than they are. (A guard against an idle timeout that counts bytes.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_in_flight_and_streams_outlive_the_keep_alive_timeout() {
    let _ = engine();
    let limits = ConnectionLimits {
        header_timeout: Duration::from_secs(1),
        keep_alive_timeout: Duration::from_secs(1),
        ..ConnectionLimits::default()
    };
    let server = TestServer::with(|config| config.connections = limits).await;
    let id = server.create(json!({"tier": "wasm"})).await;
    let silent = json!({"python": "import time\ntime.sleep(2.5)\nprint('done')"});
    let (status, outcome) = server.post(&format!("/v1/sandboxes/{id}/exec"), silent.clone()).await;
    assert_eq!((status, outcome["stdout"].as_str()), (200, Some("done\n")), "{outcome}");
    let url = format!("{}/v1/sandboxes/{id}/exec/ws", server.ws_base);
    let (mut socket, _) = tokio_tungstenite::connect_async(url).await.expect("websocket connects");
    socket.send(Message::Text(silent.to_string().into())).await.expect("send the job");
    let mut last = Value::Null;
    while let Some(message) = tokio::time::timeout(Duration::from_secs(30), socket.next()).await.expect("messages") {
        if let Ok(Message::Text(text)) = message {
            last = serde_json::from_str(&text).expect("json");
        }
    }
    assert_eq!(
        (last["type"].as_str(), last["outcome"]["stdout"].as_str()),
        (Some("outcome"), Some("done\n")),
        "{last}"
    );
    assert_eq!(server.delete(&format!("/v1/sandboxes/{id}")).await, 204);

    if !process_tier("requests_in_flight_and_streams_outlive_the_keep_alive_timeout (its WatchDir part)") {
        return;
    }
    let (sandbox, token) = crate::e2b::create_e2b(&server).await;
    let payload = json!({"path": "/home/user"}).to_string().into_bytes();
    let mut body = vec![0];
    body.extend_from_slice(&u32::try_from(payload.len()).expect("small").to_be_bytes());
    body.extend_from_slice(&payload);
    let mut response = server
        .client
        .post(server.url("/filesystem.Filesystem/WatchDir"))
        .header("E2b-Sandbox-Id", &sandbox)
        .header("X-Access-Token", &token)
        .header("content-type", "application/connect+json")
        .body(body)
        .send()
        .await
        .expect("watch");
    assert_eq!(response.status().as_u16(), 200);
    let started = Instant::now();
    let mut frames = String::new();
    // The watcher's keepalive comes every 5 s: five keep-alive timeouts pass before the first.
    while !frames.contains("keepalive") {
        let chunk = tokio::time::timeout(Duration::from_secs(15), response.chunk()).await.expect("a frame in 15 s");
        let chunk = chunk.expect("the stream is open").expect("the stream is open");
        frames.push_str(&String::from_utf8_lossy(&chunk));
    }
    assert!(started.elapsed() >= Duration::from_secs(4), "{frames}");
    drop(response);
    assert_eq!(server.delete(&format!("/sandboxes/{sandbox}")).await, 204);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_handshakes_not_done_within_the_header_timeout_are_closed() {
    let _ = engine();
    let pki = strata_benches::fleet::Pki::new("strata test CA");
    let identity = pki.issue("server");
    let server = TestServer::alone(move |config| {
        config.connections.header_timeout = Duration::from_secs(1);
        config.tls = Some(strata_serve::tls::TlsFiles {
            cert: identity.cert.clone(),
            key: identity.key.clone(),
            fleet_ca: None,
        });
    })
    .await;
    let before = held(&server);
    let mut tasks = Vec::new();
    for n in 0..10 {
        let mut stream = connect_from(&server, "127.0.0.1").await;
        tasks.push(tokio::spawn(async move {
            let started = Instant::now();
            // Half of them trickle the start of a ClientHello a byte at a time; the others send nothing.
            let trickle = n % 2 == 0;
            let hello = [0x16u8, 0x03, 0x01, 0x02, 0x00, 0x01, 0x00, 0x01, 0xfc, 0x03, 0x03];
            let mut buf = [0u8; 1024];
            let mut tick = tokio::time::interval(Duration::from_millis(200));
            let mut sent = 0;
            while started.elapsed() < Duration::from_secs(8) {
                tokio::select! {
                    read = stream.read(&mut buf) => match read {
                        Ok(0) | Err(_) => return Some(started.elapsed()),
                        Ok(_) => {}
                    },
                    _ = tick.tick() => if trickle && sent < hello.len() {
                        if stream.write_all(&hello[sent..=sent]).await.is_err() {
                            return Some(started.elapsed());
                        }
                        sent += 1;
                    },
                }
            }
            None
        }));
    }
    for (n, task) in tasks.into_iter().enumerate() {
        let at = task.await.expect("task").unwrap_or_else(|| panic!("connection {n} was still open after 8 s"));
        assert!(at >= Duration::from_millis(900) && at < Duration::from_secs(5), "connection {n} closed after {at:?}");
    }
    assert_no_leak("slow TLS handshakes", &server, before).await;
    let mut metrics = String::new();
    server.state.connections.render_metrics(&mut metrics);
    assert!(metrics.contains("strata_connections_closed_total{reason=\"tls_handshake\"} 10"), "{metrics}");
    server.stop().await;
}
