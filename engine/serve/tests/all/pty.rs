//! Terminals through the native API: `POST /v1/sandboxes/{id}/ptys`, a WebSocket that types, resizes and reads,
//! a terminal that outlives its client (a second client sees the screen it left), kill, and the refusals.

use std::time::{Duration, Instant};

use futures_util::{SinkExt, StreamExt};
use serde_json::{Value, json};
use tokio_tungstenite::tungstenite::Message;

use crate::util::{TestServer, code, process_tier};

type Socket = tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

async fn attach(server: &TestServer, id: &str, pty: &str) -> Socket {
    let url = format!("{}/v1/sandboxes/{id}/ptys/{pty}/ws", server.ws_base);
    let (socket, _) = tokio_tungstenite::connect_async(url).await.expect("websocket connects");
    socket
}

/// Reads the terminal until `screen` holds `text`; the last JSON message if one came instead.
async fn read_until(socket: &mut Socket, screen: &mut String, text: &str) -> Option<Value> {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !screen.contains(text) {
        let left = deadline.saturating_duration_since(Instant::now());
        let message = tokio::time::timeout(left, socket.next()).await;
        match message.unwrap_or_else(|_| panic!("no {text:?} on the screen within 60 s: {screen:?}")) {
            Some(Ok(Message::Binary(bytes))) => screen.push_str(&String::from_utf8_lossy(&bytes)),
            Some(Ok(Message::Text(text))) => return Some(serde_json::from_str(&text).expect("json")),
            Some(Ok(Message::Close(_))) | None => panic!("closed before {text:?}: {screen:?}"),
            Some(Ok(_)) => {}
            Some(Err(err)) => panic!("websocket error: {err}"),
        }
    }
    None
}

async fn type_in(socket: &mut Socket, keys: &str) {
    socket.send(Message::Binary(keys.as_bytes().to_vec().into())).await.expect("type");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_terminal_types_resizes_and_outlives_its_client() {
    if !process_tier("a_terminal_types_resizes_and_outlives_its_client") {
        return;
    }
    let server = TestServer::start().await;
    let id = server.create(json!({"tier": "process"})).await;
    let (status, pty) = server.post(&format!("/v1/sandboxes/{id}/ptys"), json!({"rows": 30, "cols": 100})).await;
    assert_eq!(status, 201, "{pty}");
    assert_eq!(pty["command"], json!(["/bin/bash", "-i", "-l"]));
    let pty_id = pty["id"].as_str().expect("id").to_owned();

    let mut socket = attach(&server, &id, &pty_id).await;
    let mut screen = String::new();
    type_in(&mut socket, "echo $TERM; stty size; tty\n").await;
    assert!(read_until(&mut socket, &mut screen, "xterm-256color\r\n30 100\r\n/dev/pts/0\r\n").await.is_none());
    let resize = json!({"type": "resize", "rows": 50, "cols": 132});
    socket.send(Message::Text(resize.to_string().into())).await.expect("resize");
    type_in(&mut socket, "stty size; echo left > /tmp/left\n").await;
    assert!(read_until(&mut socket, &mut screen, "50 132\r\n").await.is_none());
    // The client goes away; the terminal and its shell go on.
    drop(socket);
    let (_, listed) = server.get(&format!("/v1/sandboxes/{id}/ptys")).await;
    assert_eq!(listed["ptys"][0]["id"], pty_id.as_str(), "{listed}");

    // A new client sees what the terminal printed while it was away, then types on.
    let mut socket = attach(&server, &id, &pty_id).await;
    let mut replay = String::new();
    assert!(read_until(&mut socket, &mut replay, "50 132\r\n").await.is_none(), "the screen is replayed");
    let status =
        server.post(&format!("/v1/sandboxes/{id}/ptys/{pty_id}/resize"), json!({"rows": 10, "cols": 20})).await;
    assert_eq!(status.0, 204);
    type_in(&mut socket, "stty size; cat /tmp/left; exit 4\n").await;
    let last = read_until(&mut socket, &mut replay, "\u{0}never").await.expect("the exit message");
    assert!(replay.contains("10 20\r\nleft\r\n"), "{replay:?}");
    assert_eq!(last["type"], "exit", "{last}");
    assert_eq!(last["outcome"]["status"], json!({"kind": "exited", "code": 4}), "{last}");
    let (_, listed) = server.get(&format!("/v1/sandboxes/{id}/ptys")).await;
    assert_eq!(listed["ptys"], json!([]), "an ended terminal is gone");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_terminal_is_gone_when_delete_answers_and_bad_requests_are_refused() {
    if !process_tier("a_killed_terminal_is_gone_when_delete_answers_and_bad_requests_are_refused") {
        return;
    }
    let server = TestServer::start().await;
    let id = server.create(json!({"tier": "process"})).await;
    let command = json!({"command": ["/bin/sh", "-c", "echo up; exec sleep 600"]});
    let (status, pty) = server.post(&format!("/v1/sandboxes/{id}/ptys"), command).await;
    assert_eq!(status, 201, "{pty}");
    let pty_id = pty["id"].as_str().expect("id").to_owned();
    let mut socket = attach(&server, &id, &pty_id).await;
    let mut screen = String::new();
    assert!(read_until(&mut socket, &mut screen, "up").await.is_none());
    assert_eq!(server.delete(&format!("/v1/sandboxes/{id}/ptys/{pty_id}")).await, 204);
    let last = read_until(&mut socket, &mut screen, "\u{0}never").await.expect("the end message");
    assert_eq!(last["error"]["code"], "cancelled", "{last}");
    let (_, outcome) = server.post(&format!("/v1/sandboxes/{id}/exec"), json!({"command": ["pgrep", "sleep"]})).await;
    assert_eq!(outcome["status"], json!({"kind": "exited", "code": 1}), "no sleep is left: {outcome}");

    for (body, expected) in [
        (json!({"rows": 0}), "invalid_size"),
        (json!({"command": []}), "invalid_pty"),
        (json!({"env": {"A=B": "1"}}), "invalid_pty"),
        (json!({"colour": 1}), "invalid_request"),
    ] {
        let (status, answer) = server.post(&format!("/v1/sandboxes/{id}/ptys"), body.clone()).await;
        assert_eq!((status, code(&answer)), (400, expected), "{body}: {answer}");
    }
    assert_eq!(server.delete(&format!("/v1/sandboxes/{id}/ptys/pty_missing")).await, 404);
    let wasm = server.create(json!({"tier": "wasm"})).await;
    let (status, answer) = server.post(&format!("/v1/sandboxes/{wasm}/ptys"), json!({})).await;
    assert_eq!((status, code(&answer)), (501, "unsupported"), "{answer}");
    server.stop().await;
}
