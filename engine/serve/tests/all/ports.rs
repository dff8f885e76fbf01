//! A sandbox's ports through the server (issue 19 §2): a Python server in a process-tier sandbox reached by the
//! native route, E2B's headers and a `{port}-{id}.{domain}` Host name; HTTP both ways (a 1 MiB body up, JSON down),
//! a WebSocket echo joined through, the server's credentials never passed in, typed errors for a closed port and a
//! tier without ports.

use futures_util::{SinkExt, StreamExt};
use serde_json::{Value, json};
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;

use crate::util::{TestServer, code, process_tier, status_json};

/// An HTTP server with a WebSocket echo, from Python's standard library only (the Debian image's `python3`).
const SERVER: &str = r#"
import base64, hashlib, http.server, json, socketserver, struct
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a):
        pass
    def answer(self, value):
        body = json.dumps(value).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def do_GET(self):
        if self.headers.get("Upgrade", "").lower() == "websocket":
            return self.ws()
        h = self.headers
        self.answer({"path": self.path, "host": h.get("Host"), "seen": sorted(k.lower() for k in h.keys())})
    def do_POST(self):
        data = self.rfile.read(int(self.headers["Content-Length"]))
        self.answer({"len": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    def ws(self):
        key = self.headers["Sec-WebSocket-Key"] + "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
        self.send_response(101)
        self.send_header("Upgrade", "websocket")
        self.send_header("Connection", "Upgrade")
        self.send_header("Sec-WebSocket-Accept", base64.b64encode(hashlib.sha1(key.encode()).digest()).decode())
        self.end_headers()
        self.wfile.flush()
        while True:
            head = self.rfile.read(2)
            if len(head) < 2:
                return
            op, n = head[0] & 0x0F, head[1] & 0x7F
            if n == 126:
                n = struct.unpack(">H", self.rfile.read(2))[0]
            elif n == 127:
                n = struct.unpack(">Q", self.rfile.read(8))[0]
            mask = self.rfile.read(4)
            data = bytes(b ^ mask[i % 4] for i, b in enumerate(self.rfile.read(n)))
            if op == 8:
                self.wfile.write(b"\x88\x00")
                self.wfile.flush()
                return
            reply = b"echo:" + data
            size = bytes([len(reply)]) if len(reply) < 126 else b"\x7e" + struct.pack(">H", len(reply))
            self.wfile.write(bytes([0x80 | op]) + size + reply)
            self.wfile.flush()
class S(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
S(("127.0.0.1", 8000), H).serve_forever()
"#;

/// Starts [`SERVER`] in the sandbox `id` and waits until the native route reaches it.
async fn serve_in(server: &TestServer, id: &str) {
    let put = server
        .client
        .put(server.url(&format!("/v1/sandboxes/{id}/files?path=/tmp/srv.py")))
        .body(SERVER)
        .send()
        .await
        .expect("upload the server");
    assert_eq!(put.status().as_u16(), 204);
    let client = server.client.clone();
    let exec = server.url(&format!("/v1/sandboxes/{id}/exec"));
    tokio::spawn(async move {
        let body = json!({"command": ["python3", "/tmp/srv.py"]});
        let _ = client.post(exec).json(&body).send().await;
    });
    let mut last = Value::Null;
    for _ in 0..200 {
        let (status, body) = server.get(&format!("/v1/sandboxes/{id}/ports/8000/")).await;
        if status == 200 {
            return;
        }
        last = json!({"status": status, "body": body});
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    panic!("the sandbox's server never answered through the port route: {last}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_port_a_sandbox_serves_is_reached_by_every_route_both_ways() {
    if !process_tier("a_port_a_sandbox_serves_is_reached_by_every_route_both_ways") {
        return;
    }
    let server = TestServer::with(|config| config.domain = Some("strata.test".into())).await;
    let id = server.create(json!({"tier": "process"})).await;
    serve_in(&server, &id).await;

    // Native: path and query as sent, Host the sandbox's own, the server's credentials not passed on.
    let response = server
        .client
        .get(server.url(&format!("/v1/sandboxes/{id}/ports/8000/a/b%20c?x=1&y=2")))
        .header("authorization", "Bearer server-secret")
        .header("x-api-key", "server-secret")
        .header("cookie", "app=1")
        .send()
        .await
        .expect("get");
    let (status, seen) = status_json(response).await;
    assert_eq!(status, 200, "{seen}");
    assert_eq!((seen["path"].as_str(), seen["host"].as_str()), (Some("/a/b%20c?x=1&y=2"), Some("127.0.0.1:8000")));
    let headers: Vec<&str> = seen["seen"].as_array().expect("headers").iter().filter_map(Value::as_str).collect();
    assert!(headers.contains(&"cookie") && !headers.contains(&"authorization") && !headers.contains(&"x-api-key"));

    // A 1 MiB body up, streamed.
    let body: Vec<u8> = (0..1 << 20).map(|i| (i % 251) as u8).collect();
    let digest = {
        use sha2::Digest;
        format!("{:x}", sha2::Sha256::digest(&body))
    };
    let response = server
        .client
        .post(server.url(&format!("/v1/sandboxes/{id}/ports/8000/up")))
        .body(body)
        .send()
        .await
        .expect("post");
    let (status, got) = status_json(response).await;
    assert_eq!((status, got["len"].as_u64(), got["sha256"].as_str()), (200, Some(1 << 20), Some(digest.as_str())));

    // E2B's headers on the server's own address, and a Host name of the domain.
    let response = server
        .client
        .get(server.url("/e2b?via=headers"))
        .header("e2b-sandbox-id", &id)
        .header("e2b-sandbox-port", "8000")
        .send()
        .await
        .expect("get");
    let (status, seen) = status_json(response).await;
    assert_eq!((status, seen["path"].as_str()), (200, Some("/e2b?via=headers")), "{seen}");
    let host = format!("8000-{id}.strata.test");
    let response = server.client.get(server.url("/named")).header("host", &host).send().await.expect("get");
    let (status, seen) = status_json(response).await;
    assert_eq!((status, seen["path"].as_str(), seen["host"].as_str()), (200, Some("/named"), Some(host.as_str())));

    // A WebSocket joined through the native route.
    let url = format!("{}/v1/sandboxes/{id}/ports/8000/ws", server.ws_base);
    let (mut socket, _) = tokio_tungstenite::connect_async(url).await.expect("the WebSocket is joined through");
    for text in ["one", "two"] {
        socket.send(Message::text(text)).await.expect("send");
        let reply = socket.next().await.expect("a reply").expect("a frame");
        assert_eq!(reply.into_text().expect("text").as_str(), format!("echo:{text}"));
    }
    socket.close(None).await.expect("close");
    // And through E2B's headers.
    let mut request = format!("{}/ws", server.ws_base).into_client_request().expect("request");
    request.headers_mut().insert("e2b-sandbox-id", id.parse().expect("header"));
    request.headers_mut().insert("e2b-sandbox-port", "8000".parse().expect("header"));
    let (mut socket, _) = tokio_tungstenite::connect_async(request).await.expect("joined through E2B's headers");
    socket.send(Message::text("three")).await.expect("send");
    assert_eq!(socket.next().await.expect("reply").expect("frame").into_text().expect("text").as_str(), "echo:three");
    drop(socket);

    // Nothing listens on 9, a port 0 is no port, the sandbox's connections are released.
    let (status, err) = server.get(&format!("/v1/sandboxes/{id}/ports/9/")).await;
    assert_eq!((status, code(&err)), (502, "port_closed"), "{err}");
    let (status, err) = server.get(&format!("/v1/sandboxes/{id}/ports/0/")).await;
    assert_eq!((status, code(&err)), (400, "invalid_port"), "{err}");
    let (status, err) = server.get("/v1/sandboxes/sb_nope/ports/8000/").await;
    assert_eq!((status, code(&err)), (404, "sandbox_not_found"), "{err}");
    assert_eq!(server.delete(&format!("/v1/sandboxes/{id}")).await, 204);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wasm_sandbox_has_no_ports_and_says_so() {
    let server = TestServer::start().await;
    let id = server.create(json!({"tier": "wasm"})).await;
    let (status, err) = server.get(&format!("/v1/sandboxes/{id}/ports/8000/")).await;
    assert_eq!((status, code(&err)), (501, "unsupported"), "{err}");
    server.stop().await;
}
