//! Exec over a WebSocket: streamed output, stdin, and a client that goes away.

use std::time::{Duration, Instant};

use futures_util::{SinkExt, StreamExt};
use serde_json::{Value, json};
use tokio_tungstenite::tungstenite::Message;

use crate::util::TestServer;

type Socket = tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

async fn connect(server: &TestServer, id: &str) -> Socket {
    let url = format!("{}/v1/sandboxes/{id}/exec/ws", server.ws_base);
    let (socket, _) = tokio_tungstenite::connect_async(url).await.expect("websocket connects");
    socket
}

async fn next_json(socket: &mut Socket) -> Option<Value> {
    loop {
        match tokio::time::timeout(Duration::from_secs(60), socket.next()).await.expect("a message within 60 s") {
            Some(Ok(Message::Text(text))) => return Some(serde_json::from_str(&text).expect("json message")),
            Some(Ok(Message::Close(_))) | None => return None,
            Some(Ok(_)) => continue,
            Some(Err(err)) => panic!("websocket error: {err}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn output_streams_before_the_outcome() {
    let server = TestServer::start().await;
    let id = server.create(json!({"tier": "wasm"})).await;
    let mut socket = connect(&server, &id).await;
    let code = "import sys, time\nfor i in range(3):\n    print(i, flush=True)\n    time.sleep(0.3)\n\
                print('oops', file=sys.stderr)";
    socket.send(Message::Text(json!({"python": code}).to_string().into())).await.expect("send job");
    let started = Instant::now();
    let (mut stdout, mut stderr, mut first_chunk) = (String::new(), String::new(), None);
    let outcome = loop {
        let message = next_json(&mut socket).await.expect("a message before close");
        match message["type"].as_str() {
            Some("stdout") => {
                first_chunk.get_or_insert_with(|| started.elapsed());
                stdout.push_str(message["data"].as_str().expect("data"));
            }
            Some("stderr") => stderr.push_str(message["data"].as_str().expect("data")),
            Some("outcome") => break message["outcome"].clone(),
            other => panic!("unexpected message {other:?}: {message}"),
        }
    };
    let total = started.elapsed();
    assert_eq!(stdout, "0\n1\n2\n");
    assert_eq!(stderr, "oops\n");
    assert_eq!(outcome["stdout"], "0\n1\n2\n", "{outcome}");
    assert_eq!(outcome["status"], json!({"kind": "exited", "code": 0}));
    let first = first_chunk.expect("stdout chunks");
    assert!(
        first + Duration::from_millis(400) < total,
        "the first chunk ({first:?}) came as printed, not at the end ({total:?})"
    );
    assert!(next_json(&mut socket).await.is_none(), "the server closes after the outcome");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stdin_streams_into_the_running_job() {
    if !crate::util::process_tier("stdin_streams_into_the_running_job") {
        return;
    }
    let server = TestServer::start().await;
    let id = server.create(json!({"tier": "process"})).await;
    let mut socket = connect(&server, &id).await;
    let upper = "import sys\nfor line in sys.stdin:\n    print(line.strip().upper(), flush=True)";
    let job = json!({"command": ["python3", "-c", upper], "stdin_stream": true});
    socket.send(Message::Text(job.to_string().into())).await.expect("job");
    // Each line's answer comes back before the next line is sent: the job reads its stdin as it arrives.
    let mut stdout = String::new();
    for (line, answer) in [("abc\n", "ABC\n"), ("def\n", "ABC\nDEF\n")] {
        socket.send(Message::Binary(line.as_bytes().to_vec().into())).await.expect("stdin");
        while stdout != answer {
            let message = next_json(&mut socket).await.expect("message");
            assert_eq!(message["type"], "stdout", "{message}");
            stdout.push_str(message["data"].as_str().expect("data"));
        }
    }
    socket.send(Message::Text(String::new().into())).await.expect("eof");
    let outcome = loop {
        let message = next_json(&mut socket).await.expect("message");
        if message["type"] == "outcome" {
            break message["outcome"].clone();
        }
    };
    assert_eq!(outcome["stdout"], "ABC\nDEF\n", "{outcome}");
    assert_eq!(outcome["status"], json!({"kind": "exited", "code": 0}), "{outcome}");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_first_message_gets_an_error_frame() {
    let server = TestServer::start().await;
    let id = server.create(json!({"tier": "wasm"})).await;
    let mut socket = connect(&server, &id).await;
    socket.send(Message::Text("{nope".into())).await.expect("send");
    let message = next_json(&mut socket).await.expect("error frame");
    assert_eq!((message["type"].as_str(), message["error"]["code"].as_str()), (Some("error"), Some("invalid_json")));
    // An unknown sandbox is refused before the upgrade.
    let url = format!("{}/v1/sandboxes/sb_nope/exec/ws", server.ws_base);
    let err = tokio_tungstenite::connect_async(url).await.expect_err("404");
    assert!(err.to_string().contains("404"), "{err}");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnect_mid_stream_kills_the_job() {
    let server = TestServer::start().await;
    let id = server.create(json!({"tier": "wasm", "limits": {"wall": "25s", "cpu": "25s"}})).await;
    let mut socket = connect(&server, &id).await;
    let code = "import time\ni = 0\nwhile True:\n    print(i, flush=True)\n    i += 1\n    time.sleep(0.05)";
    socket.send(Message::Text(json!({"python": code}).to_string().into())).await.expect("job");
    let first = next_json(&mut socket).await.expect("first chunk");
    assert_eq!(first["type"], "stdout", "{first}");
    let dropped = Instant::now();
    drop(socket);
    // The job stops long before its 25 s wall limit.
    loop {
        let (status, info) = server.get(&format!("/v1/sandboxes/{id}")).await;
        assert_eq!(status, 200, "{info}");
        if info["running"] == false {
            break;
        }
        assert!(dropped.elapsed() < Duration::from_secs(10), "the job still runs 10 s after the client left");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let metrics = server.client.get(server.url("/metrics")).send().await.expect("m").text().await.expect("t");
    assert!(metrics.contains("op=\"exec_ws\"") || metrics.contains("outcome=\"error\""), "{metrics}");
    server.stop().await;
}
