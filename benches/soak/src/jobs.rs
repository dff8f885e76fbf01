//! The jobs of the load: each is tagged with a token of its own, carried into the sandbox and expected back in the
//! answer (exactly once), so that a lost, duplicated or crossed answer shows as a mismatch. Every answer is judged:
//! the expected result, a typed refusal (`429`/`503` with an error code: admission control under load is an
//! answer), or a failure (an untyped answer, another status, a wrong output, a transport error, no answer in time).

use std::time::{Duration, Instant};

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use futures_util::{SinkExt, StreamExt};
use serde_json::{Value, json};
use tokio_tungstenite::tungstenite::Message;

/// The kinds of job, in the order the report lists them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    /// `POST /v1/run` of Python on the wasm tier (a fresh instance of the runtime module).
    PythonOneShot,
    /// A wasm sandbox whose interpreter keeps a variable from one exec to the next.
    PythonSession,
    /// A process sandbox running two commands.
    ProcessCommand,
    /// A process sandbox that writes a file, is snapshotted and forked twice; each fork reads the file.
    Fork,
    /// A file written into a process sandbox, read back and listed.
    Files,
    /// Python streamed over a WebSocket: the chunks, then the Outcome.
    WsStream,
    /// A WebSocket job closed while it sleeps: the job is cancelled and the sandbox serves the next one.
    Cancel,
    /// A command past its wall limit: `limit_exceeded`, with the output it printed first.
    WallLimit,
    /// An E2B sandbox running a command over Connect-RPC.
    E2bCommand,
}

impl Kind {
    /// Every kind, with its weight in the mix.
    pub const MIX: [(Kind, u32); 9] = [
        (Kind::PythonOneShot, 4),
        (Kind::PythonSession, 2),
        (Kind::ProcessCommand, 3),
        (Kind::Fork, 1),
        (Kind::Files, 2),
        (Kind::WsStream, 2),
        (Kind::Cancel, 1),
        (Kind::WallLimit, 1),
        (Kind::E2bCommand, 1),
    ];

    /// Its name in the report.
    pub fn name(self) -> &'static str {
        match self {
            Kind::PythonOneShot => "python_oneshot",
            Kind::PythonSession => "python_session",
            Kind::ProcessCommand => "process_command",
            Kind::Fork => "fork",
            Kind::Files => "files",
            Kind::WsStream => "ws_stream",
            Kind::Cancel => "cancel",
            Kind::WallLimit => "wall_limit",
            Kind::E2bCommand => "e2b_command",
        }
    }

    /// The `n`-th kind of a weighted round robin over [`Kind::MIX`], shuffled by `seed`.
    pub fn pick(n: u64, seed: u64) -> Kind {
        let total: u64 = Kind::MIX.iter().map(|(_, w)| u64::from(*w)).sum();
        let mut at = mix(n ^ seed) % total;
        for (kind, weight) in Kind::MIX {
            if at < u64::from(weight) {
                return kind;
            }
            at -= u64::from(weight);
        }
        Kind::PythonOneShot
    }
}

/// splitmix64: a well-spread hash of a counter.
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// How a job ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// The answer expected, its tag back exactly once.
    Ok,
    /// A typed refusal under load: `(status, code)`.
    Refused(u16, String),
    /// Anything else: what was wrong.
    Failed(String),
}

/// Where the jobs go.
#[derive(Debug, Clone)]
pub struct Target {
    /// `http://127.0.0.1:PORT`.
    pub base: String,
    /// `ws://127.0.0.1:PORT`.
    pub ws_base: String,
    /// A pooled client.
    pub client: reqwest::Client,
}

/// A job's early end: a refusal or a failure, carried by `?` through its steps.
struct Stop(Verdict);

type Step<T> = Result<T, Stop>;

fn failed(message: impl Into<String>) -> Stop {
    Stop(Verdict::Failed(message.into()))
}

/// Runs job `kind` tagged `tag`, within `limit`.
pub async fn run(target: &Target, kind: Kind, tag: &str, limit: Duration) -> Verdict {
    let job = async {
        match kind {
            Kind::PythonOneShot => python_oneshot(target, tag).await,
            Kind::PythonSession => python_session(target, tag).await,
            Kind::ProcessCommand => process_command(target, tag).await,
            Kind::Fork => fork(target, tag).await,
            Kind::Files => files(target, tag).await,
            Kind::WsStream => ws_stream(target, tag).await,
            Kind::Cancel => cancel(target, tag).await,
            Kind::WallLimit => wall_limit(target, tag).await,
            Kind::E2bCommand => e2b_command(target, tag).await,
        }
    };
    match tokio::time::timeout(limit, job).await {
        Ok(Ok(())) => Verdict::Ok,
        Ok(Err(Stop(verdict))) => verdict,
        Err(_) => Verdict::Failed(format!("no answer within {limit:?}")),
    }
}

/// Sends a request and reads its answer: `(status, JSON body)`; a transport error fails the job.
async fn send(request: reqwest::RequestBuilder) -> Step<(u16, Value)> {
    let response = request.send().await.map_err(|e| failed(format!("request: {e}")))?;
    let status = response.status().as_u16();
    let bytes = response.bytes().await.map_err(|e| failed(format!("reading the answer: {e}")))?;
    let body = if bytes.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(&bytes).map_err(|_| {
            failed(format!("an answer that is not JSON, status {status}: {:?}", String::from_utf8_lossy(&bytes)))
        })?
    };
    Ok((status, body))
}

/// The answer must have status `want`; a typed 429/503 is a refusal, anything else a failure.
fn expect(what: &str, (status, body): (u16, Value), want: u16) -> Step<Value> {
    if status == want {
        return Ok(body);
    }
    let code = body["error"]["code"].as_str().map(str::to_owned).or_else(|| {
        // The E2B control plane's shape: {"code": <status>, "message": …}.
        let e2b = body["code"].as_u64() == Some(u64::from(status)) && body["message"].is_string();
        e2b.then(|| "e2b".to_owned())
    });
    match code {
        Some(code) if status == 429 || status == 503 => Err(Stop(Verdict::Refused(status, code))),
        Some(code) => Err(failed(format!("{what}: status {status} {code}: {body}"))),
        None => Err(failed(format!("{what}: status {status} without an error code: {body}"))),
    }
}

/// The Outcome must be `exited 0` with exactly `stdout`.
fn expect_output(what: &str, outcome: &Value, stdout: &str) -> Step<()> {
    if outcome["status"] != json!({"kind": "exited", "code": 0}) {
        return Err(failed(format!("{what}: status {} (stderr {:?})", outcome["status"], outcome["stderr"])));
    }
    if outcome["stdout"].as_str() != Some(stdout) {
        return Err(failed(format!("{what}: stdout {:?}, expected {stdout:?}", outcome["stdout"])));
    }
    Ok(())
}

impl Target {
    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    async fn post(&self, path: &str, body: Value) -> Step<(u16, Value)> {
        send(self.client.post(self.url(path)).json(&body)).await
    }

    /// Creates a sandbox; its id.
    async fn create(&self, body: Value) -> Step<Sandbox<'_>> {
        let created = expect("create", self.post("/v1/sandboxes", body).await?, 201)?;
        let id = created["id"].as_str().ok_or_else(|| failed(format!("create: no id in {created}")))?;
        Ok(Sandbox { target: self, id: id.to_owned() })
    }

    async fn delete(&self, path: &str) -> Step<()> {
        let (status, body) = send(self.client.delete(self.url(path))).await?;
        if status == 204 { Ok(()) } else { Err(failed(format!("DELETE {path}: status {status}: {body}"))) }
    }
}

/// A sandbox of one job, deleted by [`Sandbox::close`] (or, when a step failed, by [`finish`]).
struct Sandbox<'a> {
    target: &'a Target,
    id: String,
}

impl Sandbox<'_> {
    async fn exec(&self, job: Value) -> Step<Value> {
        let answer = self.target.post(&format!("/v1/sandboxes/{}/exec", self.id), job).await?;
        expect("exec", answer, 200)
    }

    async fn close(&self) -> Step<()> {
        self.target.delete(&format!("/v1/sandboxes/{}", self.id)).await
    }
}

/// Runs `steps` on `sandbox`, then deletes it whatever happened; the steps' verdict first.
async fn finish(sandbox: &Sandbox<'_>, steps: impl std::future::Future<Output = Step<()>>) -> Step<()> {
    let result = steps.await;
    let closed = sandbox.close().await;
    result.and(closed)
}

fn process_sandbox() -> Value {
    json!({"tier": "process", "ttl": 300, "limits": {"memory": "256MiB"}})
}

async fn python_oneshot(target: &Target, tag: &str) -> Step<()> {
    let job = json!({"tier": "wasm", "job": {"python": "import sys\nprint(sys.argv[1])", "args": [tag]}});
    let outcome = expect("run", target.post("/v1/run", job).await?, 200)?;
    expect_output("run", &outcome, &format!("{tag}\n"))
}

async fn python_session(target: &Target, tag: &str) -> Step<()> {
    let sandbox = target.create(json!({"tier": "wasm", "ttl": 300})).await?;
    let steps = async {
        let outcome = sandbox.exec(json!({"python": format!("tag = {}", json!(tag))})).await?;
        expect_output("set", &outcome, "")?;
        let outcome = sandbox.exec(json!({"python": "print(tag + '/' + tag)"})).await?;
        expect_output("get", &outcome, &format!("{tag}/{tag}\n"))
    };
    finish(&sandbox, steps).await
}

async fn process_command(target: &Target, tag: &str) -> Step<()> {
    let sandbox = target.create(process_sandbox()).await?;
    let steps = async {
        let outcome = sandbox.exec(json!({"command": ["echo", tag]})).await?;
        expect_output("echo", &outcome, &format!("{tag}\n"))?;
        let outcome = sandbox.exec(json!({"command": ["sh", "-c", "echo \"$0\" two", tag]})).await?;
        expect_output("sh", &outcome, &format!("{tag} two\n"))
    };
    finish(&sandbox, steps).await
}

async fn fork(target: &Target, tag: &str) -> Step<()> {
    let sandbox = target.create(process_sandbox()).await?;
    let steps = async {
        let outcome = sandbox.exec(json!({"command": ["sh", "-c", "printf %s \"$0\" > /tmp/tag", tag]})).await?;
        expect_output("write", &outcome, "")?;
        let answer = target.post(&format!("/v1/sandboxes/{}/fork", sandbox.id), json!({"count": 2})).await?;
        let forked = expect("fork", answer, 201)?;
        let snapshot = forked["snapshot"]["id"].as_str().map(str::to_owned);
        let forks: Vec<Sandbox<'_>> = forked["sandboxes"]
            .as_array()
            .map(|list| {
                list.iter().filter_map(|s| s["id"].as_str()).map(|id| Sandbox { target, id: id.to_owned() }).collect()
            })
            .unwrap_or_default();
        let mut result = if forks.len() == 2 { Ok(()) } else { Err(failed(format!("fork: {forked}"))) };
        for one in forks {
            let read = async { expect_output("read", &one.exec(json!({"command": ["cat", "/tmp/tag"]})).await?, tag) };
            result = result.and(finish(&one, read).await);
        }
        match snapshot {
            Some(id) => result.and(target.delete(&format!("/v1/snapshots/{id}")).await),
            None => result.and(Err(failed(format!("fork: no snapshot in {forked}")))),
        }
    };
    finish(&sandbox, steps).await
}

async fn files(target: &Target, tag: &str) -> Step<()> {
    let sandbox = target.create(process_sandbox()).await?;
    let steps = async {
        let file = target.url(&format!("/v1/sandboxes/{}/files?path=/tmp/{tag}.txt", sandbox.id));
        let (status, body) = send(target.client.put(&file).body(tag.to_owned())).await?;
        if status != 204 {
            expect("put", (status, body), 204)?;
        }
        let response = target.client.get(&file).send().await.map_err(|e| failed(format!("get: {e}")))?;
        let status = response.status().as_u16();
        let text = response.text().await.map_err(|e| failed(format!("get: {e}")))?;
        if status != 200 || text != tag {
            return Err(failed(format!("get: status {status}, {text:?}")));
        }
        let listed =
            send(target.client.get(target.url(&format!("/v1/sandboxes/{}/files/list?path=/tmp", sandbox.id)))).await?;
        let listed = expect("list", listed, 200)?;
        let name = format!("{tag}.txt");
        let entries = listed["entries"].as_array().map(|e| e.iter().filter(|e| e["name"] == name.as_str()).count());
        if entries == Some(1) { Ok(()) } else { Err(failed(format!("list: {listed}"))) }
    };
    finish(&sandbox, steps).await
}

type Socket = tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

async fn connect_ws(target: &Target, id: &str) -> Step<Socket> {
    let url = format!("{}/v1/sandboxes/{id}/exec/ws", target.ws_base);
    let (socket, _) = tokio_tungstenite::connect_async(url).await.map_err(|e| failed(format!("websocket: {e}")))?;
    Ok(socket)
}

async fn ws_stream(target: &Target, tag: &str) -> Step<()> {
    let sandbox = target.create(json!({"tier": "wasm", "ttl": 300})).await?;
    let steps = async {
        let mut socket = connect_ws(target, &sandbox.id).await?;
        let code = "import sys\nfor i in range(3):\n    print(sys.argv[1], i, flush=True)";
        let job = json!({"python": code, "args": [tag]}).to_string();
        socket.send(Message::Text(job.into())).await.map_err(|e| failed(format!("websocket send: {e}")))?;
        let expected: String = (0..3).map(|i| format!("{tag} {i}\n")).collect();
        let mut streamed = String::new();
        let outcome = loop {
            let message = match socket.next().await {
                Some(Ok(Message::Text(text))) => text,
                Some(Ok(Message::Close(_))) | None => return Err(failed("websocket closed before the outcome")),
                Some(Ok(_)) => continue,
                Some(Err(e)) => return Err(failed(format!("websocket: {e}"))),
            };
            let message: Value =
                serde_json::from_str(&message).map_err(|e| failed(format!("websocket message: {e}")))?;
            match message["type"].as_str() {
                Some("stdout") => streamed.push_str(message["data"].as_str().unwrap_or_default()),
                Some("outcome") => break message["outcome"].clone(),
                Some("error") => {
                    let code = message["error"]["code"].as_str().unwrap_or_default().to_owned();
                    return Err(failed(format!("websocket error {code}: {message}")));
                }
                _ => return Err(failed(format!("websocket: unexpected {message}"))),
            }
        };
        if streamed != expected {
            return Err(failed(format!("websocket chunks {streamed:?}, expected {expected:?}")));
        }
        expect_output("websocket", &outcome, &expected)
    };
    finish(&sandbox, steps).await
}

async fn cancel(target: &Target, tag: &str) -> Step<()> {
    let sandbox = target.create(process_sandbox()).await?;
    let steps = async {
        let mut socket = connect_ws(target, &sandbox.id).await?;
        let job = json!({"command": ["sleep", "30"]}).to_string();
        socket.send(Message::Text(job.into())).await.map_err(|e| failed(format!("websocket send: {e}")))?;
        let info = format!("/v1/sandboxes/{}", sandbox.id);
        let running = |info: &Value| info["jobs_running"].as_u64().unwrap_or(0);
        // Wait for it to run, then go away.
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let now = expect("get", send(target.client.get(target.url(&info))).await?, 200)?;
            if running(&now) == 1 {
                break;
            }
            if Instant::now() > deadline {
                return Err(failed(format!("the sleep never ran: {now}")));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        drop(socket);
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            let now = expect("get", send(target.client.get(target.url(&info))).await?, 200)?;
            if running(&now) == 0 {
                break;
            }
            if Instant::now() > deadline {
                return Err(failed(format!("the job outlived its closed WebSocket by 15 s: {now}")));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let outcome = sandbox.exec(json!({"command": ["echo", tag]})).await?;
        expect_output("after the cancel", &outcome, &format!("{tag}\n"))
    };
    finish(&sandbox, steps).await
}

async fn wall_limit(target: &Target, tag: &str) -> Step<()> {
    let job = json!({"tier": "process", "job": {"command": ["sh", "-c", "echo \"$0\"; sleep 30", tag],
        "limits": {"wall": "500ms"}}});
    let outcome = expect("run", target.post("/v1/run", job).await?, 200)?;
    if outcome["status"] != json!({"kind": "limit_exceeded", "limit": "wall"}) {
        return Err(failed(format!("wall limit: status {}", outcome["status"])));
    }
    if outcome["stdout"].as_str() != Some(&format!("{tag}\n")) {
        return Err(failed(format!("wall limit: stdout {:?}", outcome["stdout"])));
    }
    Ok(())
}

/// One Connect envelope.
fn envelope(message: &Value) -> Vec<u8> {
    let payload = message.to_string().into_bytes();
    let mut body = vec![0];
    body.extend_from_slice(&u32::try_from(payload.len()).unwrap_or(u32::MAX).to_be_bytes());
    body.extend_from_slice(&payload);
    body
}

/// A Connect stream's envelopes, or what is wrong with it.
fn envelopes(mut body: &[u8]) -> Result<Vec<(u8, Value)>, String> {
    let mut frames = Vec::new();
    while !body.is_empty() {
        let (Some(flags), Some(len)) = (body.first(), body.get(1..5)) else { return Err("a short envelope".into()) };
        let len = u32::from_be_bytes([len[0], len[1], len[2], len[3]]) as usize;
        let message = body.get(5..5 + len).ok_or("a truncated envelope")?;
        frames.push((*flags, serde_json::from_slice(message).map_err(|e| e.to_string())?));
        body = &body[5 + len..];
    }
    Ok(frames)
}

async fn e2b_command(target: &Target, tag: &str) -> Step<()> {
    let created = target.post("/sandboxes", json!({"templateID": "base", "timeout": 300})).await?;
    let created = expect("e2b create", created, 201)?;
    let (Some(id), Some(token)) = (created["sandboxID"].as_str(), created["envdAccessToken"].as_str()) else {
        return Err(failed(format!("e2b create: {created}")));
    };
    let steps = async {
        let start =
            json!({"process": {"cmd": "/bin/bash", "args": ["-l", "-c", format!("echo {tag}")]}, "stdin": false});
        let response = target
            .client
            .post(target.url("/process.Process/Start"))
            .header("E2b-Sandbox-Id", id)
            .header("X-Access-Token", token)
            .header("content-type", "application/connect+json")
            .body(envelope(&start))
            .send()
            .await
            .map_err(|e| failed(format!("e2b start: {e}")))?;
        let status = response.status().as_u16();
        let body = response.bytes().await.map_err(|e| failed(format!("e2b start: {e}")))?;
        if status != 200 {
            let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
            expect("e2b start", (status, body), 200)?;
        }
        let frames = envelopes(&body).map_err(|e| failed(format!("e2b start: {e}")))?;
        let stdout: Vec<u8> = frames
            .iter()
            .filter_map(|(_, m)| m["event"]["data"]["stdout"].as_str())
            .flat_map(|b64| BASE64.decode(b64).unwrap_or_default())
            .collect();
        let ended = frames.iter().any(|(_, m)| m["event"]["end"]["exitCode"] == 0);
        if stdout != format!("{tag}\n").into_bytes() || !ended || frames.last().map(|f| f.0) != Some(2) {
            return Err(failed(format!("e2b start: {frames:?}")));
        }
        Ok(())
    };
    let result = steps.await;
    let killed = target.delete(&format!("/sandboxes/{id}")).await;
    result.and(killed)
}

/// Chaos: snapshots a process sandbox (a file written) and a wasm Python session (a variable set), deletes the
/// sandboxes and keeps the snapshots, so that a server killed later holds complete snapshots on disk beside any
/// its forks were writing. Their ids.
pub async fn keep_snapshots(target: &Target, tag: &str) -> Result<Vec<String>, String> {
    let kept = async {
        let mut ids = Vec::new();
        let setups = [
            (process_sandbox(), json!({"command": ["sh", "-c", "printf %s \"$0\" > /tmp/tag", tag]})),
            (json!({"tier": "wasm", "ttl": 300}), json!({"python": format!("tag = {}", json!(tag))})),
        ];
        for (sandbox, setup) in setups {
            let sandbox = target.create(sandbox).await?;
            let steps = async {
                expect_output("setup", &sandbox.exec(setup).await?, "")?;
                let answer = target.post(&format!("/v1/sandboxes/{}/snapshot", sandbox.id), json!({})).await?;
                let snapshot = expect("snapshot", answer, 201)?;
                let id = snapshot["id"].as_str().ok_or_else(|| failed(format!("snapshot: no id in {snapshot}")))?;
                ids.push(id.to_owned());
                Ok(())
            };
            finish(&sandbox, steps).await?;
        }
        Ok(ids)
    };
    kept.await.map_err(|Stop(verdict)| format!("{verdict:?}"))
}
