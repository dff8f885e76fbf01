//! A real server on 127.0.0.1:0 in this process, sharing one engine across tests.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use serde_json::Value;
use strata_engine::{Engine, EngineConfig};
use strata_serve::{AppState, ServeConfig, ServeError, Server};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// One engine for every test (the wasm tier's Python runtime loads once).
pub fn engine() -> Arc<Engine> {
    static ENGINE: OnceLock<Arc<Engine>> = OnceLock::new();
    ENGINE
        .get_or_init(|| {
            let config = EngineConfig::from_env().expect("engine config");
            Arc::new(Engine::new(config).expect("engine"))
        })
        .clone()
}

/// Whether the process tier runs here; prints one line saying why not.
pub fn process_tier(test: &str) -> bool {
    match engine().process() {
        Ok(_) => true,
        Err(err) => {
            eprintln!("skipping {test}: the process tier is unavailable here ({err})");
            false
        }
    }
}

/// Tests that count this process's fds and threads run alone: every other server holds this shared.
static GATE: tokio::sync::RwLock<()> = tokio::sync::RwLock::const_new(());

/// A guard of [`GATE`].
#[allow(dead_code)]
enum Gate {
    Shared(tokio::sync::RwLockReadGuard<'static, ()>),
    Exclusive(tokio::sync::RwLockWriteGuard<'static, ()>),
}

/// A running server.
pub struct TestServer {
    pub base: String,
    pub ws_base: String,
    pub state: Arc<AppState>,
    pub client: reqwest::Client,
    shutdown: Option<oneshot::Sender<()>>,
    handle: Option<JoinHandle<Result<(), ServeError>>>,
    _gate: Gate,
}

impl TestServer {
    /// A server with the defaults (no keys, loopback).
    pub async fn start() -> TestServer {
        TestServer::with(|_| {}).await
    }

    /// A server whose config `f` adjusts.
    pub async fn with(f: impl FnOnce(&mut ServeConfig)) -> TestServer {
        TestServer::gated(Gate::Shared(GATE.read().await), f).await
    }

    /// A server that runs while no other test's server does (for tests that count fds and threads).
    pub async fn alone(f: impl FnOnce(&mut ServeConfig)) -> TestServer {
        TestServer::gated(Gate::Exclusive(GATE.write().await), f).await
    }

    async fn gated(gate: Gate, f: impl FnOnce(&mut ServeConfig)) -> TestServer {
        let mut config = ServeConfig::new(EngineConfig::from_env().expect("engine config"));
        config.listen = "127.0.0.1:0".parse().expect("addr");
        f(&mut config);
        let server = Server::bind_with_engine(engine(), config).await.expect("server binds");
        let addr = server.local_addr();
        let state = server.state();
        let (tx, rx) = oneshot::channel::<()>();
        let handle = tokio::spawn(server.run(async move {
            let _ = rx.await;
        }));
        TestServer {
            base: format!("http://{addr}"),
            ws_base: format!("ws://{addr}"),
            state,
            client: reqwest::Client::new(),
            shutdown: Some(tx),
            handle: Some(handle),
            _gate: gate,
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// POSTs JSON, returns status and body.
    pub async fn post(&self, path: &str, body: Value) -> (u16, Value) {
        let response = self.client.post(self.url(path)).json(&body).send().await.expect("request");
        status_json(response).await
    }

    /// GETs JSON.
    pub async fn get(&self, path: &str) -> (u16, Value) {
        let response = self.client.get(self.url(path)).send().await.expect("request");
        status_json(response).await
    }

    /// DELETE; returns the status.
    pub async fn delete(&self, path: &str) -> u16 {
        self.client.delete(self.url(path)).send().await.expect("request").status().as_u16()
    }

    /// Creates a sandbox and returns its id.
    pub async fn create(&self, body: Value) -> String {
        let (status, json) = self.post("/v1/sandboxes", body).await;
        assert_eq!(status, 201, "{json}");
        json["id"].as_str().expect("id").to_owned()
    }

    /// Stops the server and waits for it (it closes every sandbox).
    pub async fn stop(mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(handle) = self.handle.take() {
            tokio::time::timeout(Duration::from_secs(30), handle)
                .await
                .expect("server stops within 30 s")
                .expect("server task")
                .expect("server ran");
        }
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
    }
}

pub async fn status_json(response: reqwest::Response) -> (u16, Value) {
    let status = response.status().as_u16();
    let text = response.text().await.expect("body");
    let json = if text.is_empty() { Value::Null } else { serde_json::from_str(&text).unwrap_or(Value::String(text)) };
    (status, json)
}

/// The `error.code` of an error body.
pub fn code(json: &Value) -> &str {
    json["error"]["code"].as_str().unwrap_or("<no error code>")
}

/// Open file descriptors of this process.
pub fn fd_count() -> usize {
    std::fs::read_dir("/proc/self/fd").map(|d| d.count()).unwrap_or(0)
}

/// A host HTTP origin on 127.0.0.1 answering `origin` and sending each request head it got to the receiver.
pub fn head_origin() -> (u16, std::sync::mpsc::Receiver<String>) {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for mut stream in listener.incoming().flatten() {
            let _ = stream.set_read_timeout(Some(std::time::Duration::from_secs(5)));
            let mut head = Vec::new();
            let mut buf = [0u8; 4096];
            while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                match stream.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => head.extend_from_slice(&buf[..n]),
                }
            }
            let _ = stream.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\nConnection: close\r\n\r\norigin");
            let _ = tx.send(String::from_utf8_lossy(&head).into_owned());
        }
    });
    (port, rx)
}
