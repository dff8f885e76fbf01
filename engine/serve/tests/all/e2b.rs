//! The E2B-compatible layer: its protocol spoken by hand, and the official Python SDK run unmodified.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::{Value, json};

use crate::util::{TestServer, process_tier};

/// Splits a Connect stream into `(flags, message)` envelopes.
fn envelopes(mut body: &[u8]) -> Vec<(u8, Value)> {
    let mut frames = Vec::new();
    while body.len() >= 5 {
        let len = u32::from_be_bytes([body[1], body[2], body[3], body[4]]) as usize;
        let message = serde_json::from_slice(&body[5..5 + len]).expect("json envelope");
        frames.push((body[0], message));
        body = &body[5 + len..];
    }
    assert!(body.is_empty(), "trailing bytes");
    frames
}

/// One Connect envelope of `message`, with `flags`.
fn envelope(flags: u8, message: &Value) -> Vec<u8> {
    let payload = message.to_string().into_bytes();
    let mut body = vec![flags];
    body.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    body.extend_from_slice(&payload);
    body
}

fn start_request(command: &str) -> Vec<u8> {
    envelope(0, &json!({"process": {"cmd": "/bin/bash", "args": ["-l", "-c", command]}, "stdin": false}))
}

/// A new E2B sandbox of `server` (which takes anonymous calls): its id and envd access token.
pub(crate) async fn create_e2b(server: &TestServer) -> (String, String) {
    let created: Value = server
        .client
        .post(server.url("/v2/sandboxes"))
        .json(&json!({"templateID": "base"}))
        .send()
        .await
        .expect("create")
        .json()
        .await
        .expect("json");
    let id = created["sandboxID"].as_str().expect("id").to_owned();
    (id, created["envdAccessToken"].as_str().expect("token").to_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e2b_protocol_by_hand() {
    if !process_tier("e2b_protocol_by_hand") {
        return;
    }
    let server = TestServer::start().await;
    let client = &server.client;
    let response = client
        .post(server.url("/v2/sandboxes"))
        .header("X-API-KEY", SDK_KEY)
        .json(&json!({"templateID": "base", "metadata": {"who": "test"}, "envVars": {"GREETING": "hello"}}))
        .send()
        .await
        .expect("create");
    assert_eq!(response.status().as_u16(), 201);
    let created: Value = response.json().await.expect("json");
    for key in ["templateID", "sandboxID", "clientID", "envdVersion", "envdAccessToken"] {
        assert!(created[key].is_string(), "{key} in {created}");
    }
    let id = created["sandboxID"].as_str().expect("id").to_owned();
    let token = created["envdAccessToken"].as_str().expect("token").to_owned();
    let envd = |method: reqwest::Method, path: &str| {
        client
            .request(method, server.url(path))
            .header("E2b-Sandbox-Id", &id)
            .header("E2b-Sandbox-Port", "49983")
            .header("X-Access-Token", &token)
    };

    let response = envd(reqwest::Method::POST, "/process.Process/Start")
        .header("content-type", "application/connect+json")
        .body(start_request("echo $GREETING; echo oops >&2; exit 3"))
        .send()
        .await
        .expect("start");
    assert_eq!(response.status().as_u16(), 200);
    assert_eq!(response.headers()["content-type"], "application/connect+json");
    let frames = envelopes(&response.bytes().await.expect("body"));
    assert!(frames[0].1["event"]["start"]["pid"].is_u64(), "{frames:?}");
    let data = |key: &str| -> String {
        frames
            .iter()
            .filter_map(|(_, m)| m["event"]["data"][key].as_str())
            .map(|b64| {
                use base64::Engine as _;
                String::from_utf8(base64::engine::general_purpose::STANDARD.decode(b64).expect("base64")).expect("utf8")
            })
            .collect()
    };
    assert_eq!((data("stdout"), data("stderr")), ("hello\n".to_owned(), "oops\n".to_owned()));
    let (flags, end) = &frames[frames.len() - 2];
    assert_eq!((*flags, &end["event"]["end"]["exitCode"]), (0, &json!(3)), "{frames:?}");
    assert_eq!(frames.last().map(|(flags, m)| (*flags, m.clone())), Some((2, json!({}))));

    let response = client
        .post(server.url("/process.Process/Start"))
        .header("E2b-Sandbox-Id", &id)
        .header("X-Access-Token", "wrong")
        .body(start_request("true"))
        .send()
        .await
        .expect("start");
    assert_eq!(response.status().as_u16(), 401);

    // Files: octet-stream and multipart in, bytes out; a missing one is 404 with E2B's error shape.
    let response = envd(reqwest::Method::POST, "/files?path=%2Fhome%2Fuser%2Fa.txt")
        .header("content-type", "application/octet-stream");
    let written: Value = response.body("x").send().await.expect("write").json().await.expect("json");
    assert_eq!(written, json!([{"name": "a.txt", "type": "file", "path": "/home/user/a.txt"}]));
    let form = reqwest::multipart::Form::new()
        .part("file", reqwest::multipart::Part::bytes(b"yz".to_vec()).file_name("/tmp/b.txt"));
    let response = envd(reqwest::Method::POST, "/files?path=%2Ftmp%2Fb.txt").multipart(form).send().await.expect("mp");
    assert_eq!(response.status().as_u16(), 200, "{:?}", response.text().await);
    let read = envd(reqwest::Method::GET, "/files?path=%2Ftmp%2Fb.txt").send().await.expect("read");
    assert_eq!(read.text().await.expect("text"), "yz");
    let missing = envd(reqwest::Method::GET, "/files?path=%2Ftmp%2Fnope").send().await.expect("read");
    assert_eq!(missing.status().as_u16(), 404);
    let body: Value = missing.json().await.expect("json");
    assert_eq!(body["code"], 404, "{body}");

    // The code interpreter: the last expression is the main result; files are the sandbox's.
    let response = envd(reqwest::Method::POST, "/execute")
        .header("E2b-Sandbox-Port", "49999")
        .json(&json!({"code": "print(open('/home/user/a.txt').read())\n6 * 7", "context_id": null}))
        .send()
        .await
        .expect("execute");
    let text = response.text().await.expect("ndjson");
    let lines: Vec<Value> = text.lines().map(|l| serde_json::from_str(l).expect("json line")).collect();
    assert!(lines.iter().any(|l| l["type"] == "stdout" && l["text"] == "x\n"), "{text}");
    assert!(lines.iter().any(|l| l["type"] == "result" && l["text"] == "42" && l["is_main_result"] == true), "{text}");

    let health = |sandbox: &str| client.get(server.url("/health")).header("E2b-Sandbox-Id", sandbox.to_owned()).send();
    assert_eq!(health(&id).await.expect("health").status().as_u16(), 204);
    assert_eq!(health("sb_gone").await.expect("health").status().as_u16(), 502);

    let (status, list) = server.get("/v2/sandboxes").await;
    assert_eq!(status, 200);
    assert_eq!(list[0]["metadata"], json!({"who": "test"}), "{list}");
    let (status, _) = server.post(&format!("/sandboxes/{id}/timeout"), json!({"timeout": 60})).await;
    assert_eq!(status, 204);
    let (status, body) = server.post("/sandboxes/sb_gone/timeout", json!({"timeout": 60})).await;
    assert_eq!((status, &body["code"]), (404, &json!(404)), "{body}");
    // A WatchDir stream's watcher is the sandbox's own watch (no job runs for it): it sees a file that lives for a
    // few milliseconds, and a client that goes away stops it.
    let entry = server.state.registry.get_any(&id).expect("entry");
    let payload = json!({"path": "/tmp"}).to_string().into_bytes();
    let mut body = vec![0];
    body.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    body.extend_from_slice(&payload);
    let mut response = envd(reqwest::Method::POST, "/filesystem.Filesystem/WatchDir")
        .header("content-type", "application/connect+json")
        .body(body)
        .send()
        .await
        .expect("watch");
    assert_eq!(response.status().as_u16(), 200);
    let first = response.chunk().await.expect("chunk").expect("a start frame");
    assert_eq!(envelopes(&first)[0].1, json!({"start": {}}));
    assert_eq!((entry.jobs_running(), server.state.e2b.watchers_running(&id)), (0, 1));
    let brief = envd(reqwest::Method::POST, "/process.Process/Start")
        .header("content-type", "application/connect+json")
        .body(start_request("echo x > /tmp/brief; rm /tmp/brief"))
        .send()
        .await
        .expect("start");
    assert_eq!(brief.status().as_u16(), 200);
    brief.bytes().await.expect("the command ends");
    let mut seen = Vec::new();
    let mut pending = Vec::new();
    let wanted =
        [json!({"name": "brief", "type": "EVENT_TYPE_CREATE"}), json!({"name": "brief", "type": "EVENT_TYPE_REMOVE"})];
    while !wanted.iter().all(|event| seen.contains(event)) {
        let chunk = tokio::time::timeout(std::time::Duration::from_secs(20), response.chunk()).await;
        let chunk = chunk.expect("events in time").expect("chunk").expect("the stream goes on");
        pending.extend_from_slice(&chunk);
        while pending.len() >= 5 {
            let len = u32::from_be_bytes([pending[1], pending[2], pending[3], pending[4]]) as usize;
            if pending.len() < 5 + len {
                break;
            }
            let frame: Vec<u8> = pending.drain(..5 + len).collect();
            seen.extend(envelopes(&frame).into_iter().filter_map(|(_, m)| m.get("filesystem").cloned()));
        }
    }
    drop(response);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while server.state.e2b.watchers_running(&id) != 0 {
        assert!(std::time::Instant::now() < deadline, "the watcher outlived its client");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    // Watchers past the sandbox's bound are refused as a limit, and removing one makes room.
    let mut watchers = Vec::new();
    let refused = loop {
        let response = envd(reqwest::Method::POST, "/filesystem.Filesystem/CreateWatcher")
            .json(&json!({"path": "/tmp"}))
            .send()
            .await
            .expect("create watcher");
        let (status, body): (u16, Value) = (response.status().as_u16(), response.json().await.expect("json"));
        if status != 200 {
            break (status, body);
        }
        watchers.push(body["watcherId"].as_str().expect("watcherId").to_owned());
        assert!(watchers.len() <= 64, "no bound on watchers");
    };
    assert_eq!((refused.0, &refused.1["code"]), (429, &json!("resource_exhausted")), "{refused:?}");
    assert!(!watchers.is_empty());
    for watcher in &watchers {
        let response = envd(reqwest::Method::POST, "/filesystem.Filesystem/RemoveWatcher")
            .json(&json!({"watcherId": watcher}))
            .send()
            .await
            .expect("remove watcher");
        assert_eq!(response.status().as_u16(), 200);
    }
    let response = envd(reqwest::Method::POST, "/filesystem.Filesystem/GetWatcherEvents")
        .json(&json!({"watcherId": watchers[0]}))
        .send()
        .await
        .expect("events");
    assert_eq!(response.status().as_u16(), 404, "a removed watcher is gone");
    // Killing the sandbox stops a cell that would run forever.
    let looping = envd(reqwest::Method::POST, "/execute")
        .header("E2b-Sandbox-Port", "49999")
        .json(&json!({"code": "while True: pass"}))
        .send();
    let looping = tokio::spawn(looping);
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    let started = std::time::Instant::now();
    assert_eq!(server.delete(&format!("/sandboxes/{id}")).await, 204);
    assert!(started.elapsed() < std::time::Duration::from_secs(5), "kill took {:?}", started.elapsed());
    let _ = looping.await;
    assert_eq!(server.delete(&format!("/sandboxes/{id}")).await, 404);
    server.stop().await;
}

/// A venv with the pinned E2B SDK under `$STRATA_HOME/e2b-sdk`, installed once; `None` (with a line saying why)
/// when it cannot be made here.
pub(crate) fn sdk_python() -> Option<PathBuf> {
    let home = strata_engine::strata_home()?;
    let venv = home.join("e2b-sdk-2.63.0");
    let python = venv.join("bin/python");
    let ready = venv.join(".installed");
    if ready.exists() {
        return Some(python);
    }
    let made = Command::new("python3").arg("-m").arg("venv").arg(&venv).status().is_ok_and(|s| s.success())
        && Command::new(&python)
            .args(["-m", "pip", "install", "-q", "e2b==2.63.0", "e2b-code-interpreter==2.11.5"])
            .status()
            .is_ok_and(|s| s.success());
    if !made {
        eprintln!("skipping e2b_sdk_runs_unmodified: cannot install the pinned E2B SDK into {}", venv.display());
        return None;
    }
    let _ = std::fs::write(&ready, b"");
    Some(python)
}

const SDK_SCRIPT: &str = r#"
from e2b import Sandbox, CommandExitException, FileNotFoundException, NotFoundException
from e2b_code_interpreter import Sandbox as CodeSandbox

sbx = Sandbox.create()
r = sbx.commands.run("echo hi; echo err >&2")
assert (r.stdout, r.stderr, r.exit_code) == ("hi\n", "err\n", 0), r
try:
    sbx.commands.run("exit 3")
    raise SystemExit("no CommandExitException")
except CommandExitException as e:
    assert e.exit_code == 3
sbx.files.write("/tmp/a.txt", "x")
assert sbx.files.read("/tmp/a.txt") == "x"
assert sbx.commands.run("cat /tmp/a.txt").stdout == "x"
# Commands start in the user's home, as files' relative paths resolve there; root's is /root.
assert sbx.commands.run("pwd").stdout == "/home/user\n"
assert sbx.commands.run("pwd", user="root").stdout == "/root\n"
assert sbx.commands.run("pwd", cwd="/tmp").stdout == "/tmp\n"
sbx.commands.run("echo rel > rel.txt")
assert sbx.files.read("rel.txt") == "rel\n"
try:
    sbx.files.read("/tmp/missing")
    raise SystemExit("no FileNotFoundException")
except FileNotFoundException:
    pass
# The filesystem calls: make_dir, list (one level and deeper), get_info, exists, rename, remove.
assert sbx.files.make_dir("/home/user/d/e") is True
assert sbx.files.make_dir("/home/user/d/e") is False
sbx.files.write("/home/user/d/e/f.txt", "hey")
assert [e.name for e in sbx.files.list("/home/user/d")] == ["e"]
assert [e.path for e in sbx.files.list("d", depth=2)] == ["/home/user/d/e", "/home/user/d/e/f.txt"]
info = sbx.files.get_info("/home/user/d/e/f.txt")
assert (info.name, info.type.name, info.size) == ("f.txt", "FILE", 3), info
assert sbx.files.get_info("/home/user/d").type.name == "DIR"
assert sbx.files.exists("/home/user/d/e/f.txt") and not sbx.files.exists("/home/user/nope")
assert sbx.files.rename("/home/user/d/e/f.txt", "/home/user/d/g.txt").name == "g.txt"
assert sbx.files.read("/home/user/d/g.txt") == "hey"
try:
    sbx.files.get_info("/home/user/nope")
    raise SystemExit("no NotFoundException")
except NotFoundException:
    pass
sbx.files.remove("/home/user/d")
assert not sbx.files.exists("/home/user/d")
# A directory watcher: what commands and file calls change, seen as events (names relative to the directory).
import time
w = sbx.files.watch_dir("/home/user", recursive=True)
seen = set()
def wait_for(*events):
    global seen
    for _ in range(200):
        seen |= {(e.name, e.type.name) for e in w.get_new_events()}
        if set(events) <= seen:
            return
        time.sleep(0.05)
    raise SystemExit(f"watcher: {events} not in {seen}")
sbx.files.write("/home/user/w.txt", "1")
wait_for(("w.txt", "CREATE"))
sbx.commands.run("mkdir -p /home/user/sub && echo x > /home/user/sub/n.txt && rm /home/user/w.txt")
wait_for(("sub", "CREATE"), ("sub/n.txt", "CREATE"), ("w.txt", "REMOVE"))
w.stop()
# A file that lives for less than 10 ms is seen created and removed (the watch is the tier's, not a poll).
sbx.files.make_dir("/tmp/w")
w = sbx.files.watch_dir("/tmp/w")
seen = set()
for attempt in range(5):
    took = sbx.commands.run(
        f"sh -c 'a=$(date +%s%N); echo x > /tmp/w/f{attempt}; rm /tmp/w/f{attempt}; b=$(date +%s%N); echo $((b - a))'"
    )
    if int(took.stdout) < 10_000_000:
        break
else:
    raise SystemExit(f"no run made and removed a file within 10 ms (the last took {took.stdout.strip()} ns)")
wait_for((f"f{attempt}", "CREATE"), (f"f{attempt}", "REMOVE"))
w.stop()
# The async SDK's watcher is a stream of events, ended by stop().
import asyncio
from e2b import AsyncSandbox
async def watch_async():
    asbx = await AsyncSandbox.connect(sbx.sandbox_id)
    got = asyncio.Queue()
    handle = await asbx.files.watch_dir("/home/user", on_event=got.put_nowait)
    await asbx.files.write("/home/user/aw.txt", "1")
    while True:
        e = await asyncio.wait_for(got.get(), 20)
        if (e.name, e.type.name) == ("aw.txt", "CREATE"):
            break
    await handle.stop()
asyncio.run(watch_async())
try:
    sbx.files.watch_dir("/home/user/nope")
    raise SystemExit("no NotFoundException for a missing directory")
except NotFoundException:
    pass
sbx.set_timeout(120)
assert sbx.is_running()
again = Sandbox.connect(sbx.sandbox_id)
assert again.commands.run("cat /tmp/a.txt").stdout == "x"
assert [s.sandbox_id for s in Sandbox.list().next_items()] == [sbx.sandbox_id]
assert sbx.get_info().template_id == "base"
# stdin kept open: sent in pieces, then closed.
h = sbx.commands.run("tr a-z A-Z", background=True, stdin=True)
sbx.commands.send_stdin(h.pid, "abc\n")
sbx.commands.send_stdin(h.pid, b"def\n")
sbx.commands.close_stdin(h.pid)
assert h.wait().stdout == "ABC\nDEF\n"
# A second handle attaches to a running command and follows it to its end.
h = sbx.commands.run("sleep 0.5; echo late", background=True)
assert [p.pid for p in sbx.commands.list()] == [h.pid]
follower = sbx.commands.connect(h.pid)
assert follower.wait().stdout == "late\n"
assert h.wait().stdout == "late\n"
# A server in the background and commands that talk to it meanwhile (E2B's usual pattern), files calls too.
server = sbx.commands.run("python3 -m http.server 8000 --bind 127.0.0.1", background=True)
probe = "import urllib.request as u; print(u.urlopen('http://127.0.0.1:8000/').status)"
page = sbx.commands.run(f"for i in $(seq 200); do python3 -c \"{probe}\" 2>/dev/null && break; sleep 0.05; done")
assert page.stdout == "200\n", page
sbx.files.write("/tmp/during.txt", "w")
assert sbx.files.read("/tmp/during.txt") == "w"
assert [p.pid for p in sbx.commands.list()] == [server.pid]
assert sbx.commands.kill(server.pid) is True
handle = sbx.commands.run("sleep 30", background=True)
assert sbx.commands.kill(handle.pid) is True
assert sbx.commands.kill(999999) is False
assert sbx.kill() is True
assert Sandbox.list().next_items() == []

ci = CodeSandbox.create()
assert ci.run_code("1+1").text == "2"
# Files under /home/user (the cells' working directory) are shared with commands, both ways.
ex = ci.run_code("open('ci.txt', 'w').write('z')\nprint('hello')")
assert ex.logs.stdout == ["hello\n"], ex.logs
assert ci.commands.run("cat /home/user/ci.txt").stdout == "z"
ci.commands.run("echo from-bash > /home/user/cmd.txt")
assert ci.run_code("open('/home/user/cmd.txt').read().strip()").text == "'from-bash'"
# A cell the router sends native runs with the sandbox's python3.
assert ci.run_code("import subprocess\nsubprocess.run(['true']).returncode").text == "0"
assert ci.run_code("1/0").error.name == "ZeroDivisionError"
# State across cells: values, imports and definitions.
ci.run_code("import math\nx = 41\ndef inc(v):\n    return v + 1")
assert ci.run_code("inc(x)").text == "42"
assert ci.run_code("math.sqrt(x + 8)").text == "7.0"
ci.kill()
print("SDK OK")
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e2b_sdk_runs_unmodified() {
    if !process_tier("e2b_sdk_runs_unmodified") {
        return;
    }
    run_python_sdk_script(SDK_SCRIPT, "SDK OK").await;
}

/// Time as the client asks (issue 19 §4): a command lives until it exits, is killed or its sandbox ends; the
/// request's timeout (the SDK's 60 s default) bounds the client's stream only. A 45 s command runs to its end while
/// a background writer started with the default timeout outlives it by far; `kill` answers once the command is gone
/// and `wait()` after a kill reports the kill.
const TIME_SCRIPT: &str = r#"
import time
from e2b import Sandbox, CommandExitException
sbx = Sandbox.create(timeout=300)
started = int(sbx.commands.run("date +%s").stdout)
bg = sbx.commands.run("while true; do date +%s >> /tmp/alive; sleep 2; done", background=True)
t = time.time()
r = sbx.commands.run("sleep 45; echo done")
assert r.stdout == "done\n" and r.exit_code == 0 and time.time() - t >= 45, (r, time.time() - t)
time.sleep(max(0, 68 - (time.time() - t)))
last = int(sbx.files.read("/tmp/alive").split()[-1])
assert last >= started + 64, ("the background command stopped writing", started, last)
assert [p.pid for p in sbx.commands.list()] == [bg.pid]
assert sbx.commands.kill(bg.pid) is True
assert sbx.commands.list() == [], "kill answers once the command is gone"
h = sbx.commands.run("sleep 30", background=True)
assert sbx.commands.kill(h.pid) is True
try:
    h.wait()
    raise SystemExit("no CommandExitException after a kill")
except CommandExitException as e:
    assert e.exit_code == -1 and "killed" in (e.error or ""), (e.exit_code, e.error)
assert sbx.kill() is True
print("TIME OK")
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e2b_commands_live_as_long_as_the_client_asks() {
    if !process_tier("e2b_commands_live_as_long_as_the_client_asks") {
        return;
    }
    run_python_sdk_script(TIME_SCRIPT, "TIME OK").await;
}

/// Runs `script` with the pinned Python SDK against a new server and checks it printed `done`; returns at once
/// (the SDK's setup said why) when the SDK cannot be installed here.
pub(crate) async fn run_python_sdk_script(script: &str, done: &str) {
    let Some(python) = tokio::task::spawn_blocking(sdk_python).await.expect("setup") else { return };
    let server = TestServer::start().await;
    let dir = tempfile::tempdir().expect("tempdir");
    run_sdk_script(&server, &python, &["-c".as_ref(), script.as_ref()], dir.path(), done).await;
    server.stop().await;
}

/// The API key the SDK scripts use (E2B's format: `e2b_` and hex).
pub(crate) const SDK_KEY: &str = "e2b_0000000000000000000000000000000000000000";

/// A server whose only key is [`SDK_KEY`], so that a wrong key is refused.
pub(crate) async fn keyed_server() -> TestServer {
    TestServer::with(|config| config.keys = Some(strata_serve::KeyStore::from_keys([("sdk", SDK_KEY, None)]))).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e2b_errors_have_e2b_shapes() {
    let server = keyed_server().await;
    let client = &server.client;
    let call =
        |method: reqwest::Method, path: &str| client.request(method, server.url(path)).header("X-API-KEY", SDK_KEY);
    let answer = |request: reqwest::RequestBuilder| async move {
        let response = request.send().await.expect("request");
        let status = response.status().as_u16();
        let text = response.text().await.expect("body");
        (status, text)
    };
    let json = |text: &str| -> Value { serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text:?}")) };
    // REST: {"code": <status>, "message": …}, for a missing sandbox, a bad body, a wrong key, an unknown path or method.
    for (request, status) in [
        (call(reqwest::Method::GET, "/sandboxes/sb_nope"), 404),
        (call(reqwest::Method::POST, "/v2/sandboxes/sb_nope/connect").json(&json!({"timeout": 10})), 404),
        (call(reqwest::Method::POST, "/v2/sandboxes").body("{not json"), 400),
        (call(reqwest::Method::POST, "/sandboxes/sb_nope/timeout").body("[]"), 400),
        (client.post(server.url("/v2/sandboxes")).header("X-API-KEY", "e2b_1111").json(&json!({})), 401),
        (call(reqwest::Method::POST, "/sandboxes/sb_nope/pause"), 404),
        (call(reqwest::Method::POST, "/sandboxes/sb_nope/fork").json(&json!({"count": 99})), 400),
        (call(reqwest::Method::DELETE, "/templates/snap_nope"), 404),
        (call(reqwest::Method::GET, "/sandboxes/sb_nope/metrics"), 404),
        (call(reqwest::Method::PUT, "/v2/sandboxes"), 405),
        (client.get(server.url("/files?path=%2Ftmp%2Fa")).header("E2b-Sandbox-Id", "sb_nope"), 502),
        (client.get(server.url("/health")).header("E2b-Sandbox-Id", "sb_nope"), 502),
        (client.post(server.url("/execute")).header("E2b-Sandbox-Id", "sb_nope").body("{}"), 502),
    ] {
        let (got, text) = answer(request).await;
        let body = json(&text);
        assert_eq!((got, &body["code"]), (status, &json!(status)), "{text}");
        assert!(body["message"].as_str().is_some_and(|m| !m.is_empty()), "{text}");
    }
    // Connect unary: {"code": "<name>", "message": …} with the code's status.
    let envd = |path: &str| client.post(server.url(path)).header("E2b-Sandbox-Id", "sb_nope");
    for (request, status, code) in [
        (envd("/process.Process/List").json(&json!({})), 503, "unavailable"),
        (envd("/filesystem.Filesystem/Stat").json(&json!({"path": "/"})), 503, "unavailable"),
        (envd("/process.Process/Nope").json(&json!({})), 501, "unimplemented"),
        (client.get(server.url("/process.Process/List")), 501, "unimplemented"),
        (client.post(server.url("/process.Process/List")).json(&json!({})), 400, "invalid_argument"),
    ] {
        let (got, text) = answer(request).await;
        let body = json(&text);
        assert_eq!((got, body["code"].as_str()), (status, Some(code)), "{text}");
        assert!(body["message"].as_str().is_some_and(|m| !m.is_empty()), "{text}");
    }
    // A Connect stream: 200, then one end-of-stream envelope carrying the error.
    let response = envd("/process.Process/Start")
        .header("content-type", "application/connect+json")
        .body(start_request("true"))
        .send()
        .await
        .expect("start");
    assert_eq!(response.status().as_u16(), 200);
    assert_eq!(response.headers()["content-type"], "application/connect+json");
    let frames = envelopes(&response.bytes().await.expect("body"));
    assert_eq!(frames.len(), 1, "{frames:?}");
    assert_eq!((frames[0].0, &frames[0].1["error"]["code"]), (2, &json!("unavailable")), "{frames:?}");
    // Strata's own routes keep their shape.
    let (status, text) = answer(client.get(server.url("/v1/nope"))).await;
    assert_eq!((status, &json(&text)["error"]["code"]), (404, &json!("not_found")), "{text}");
    let (status, text) = answer(client.get(server.url("/v1/sandboxes")).header("X-API-KEY", "wrong")).await;
    assert_eq!((status, &json(&text)["error"]["code"]), (401, &json!("unauthorized")), "{text}");
    server.stop().await;
}

/// What the SDKs raise, in Python: their own exception types for every failure the script provokes.
const SDK_ERRORS_SCRIPT: &str = r#"
from e2b import Sandbox, AuthenticationException, FileNotFoundException, SandboxException
from e2b.exceptions import SandboxNotFoundException, SandboxNotRunningException

def expect(kind, what, call):
    try:
        call()
    except kind:
        return
    except Exception as e:
        raise SystemExit(f"{what}: {type(e).__module__}.{type(e).__name__}: {e}, not {kind.__name__}")
    raise SystemExit(f"{what}: no {kind.__name__}")

expect(SandboxNotFoundException, "connect to an unknown sandbox", lambda: Sandbox.connect("sb_nope"))
expect(AuthenticationException, "a bad API key", lambda: Sandbox.create(api_key="e2b_" + "1" * 40))
sbx = Sandbox.create()
expect(FileNotFoundException, "read a missing file", lambda: sbx.files.read("/tmp/missing"))
expect(SandboxException, "open the network to everything", lambda: sbx.update_network({"allow_out": ["0.0.0.0/0"]}))
assert sbx.kill() is True
expect(SandboxNotRunningException, "run in a killed sandbox", lambda: sbx.commands.run("true"))
expect(SandboxNotRunningException, "read in a killed sandbox", lambda: sbx.files.read("/tmp/a"))
expect(SandboxNotRunningException, "list in a killed sandbox", lambda: sbx.files.list("/"))
print("ERRORS OK")
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e2b_python_sdk_raises_its_own_errors() {
    if !process_tier("e2b_python_sdk_raises_its_own_errors") {
        return;
    }
    let Some(python) = tokio::task::spawn_blocking(sdk_python).await.expect("setup") else { return };
    let server = keyed_server().await;
    let dir = tempfile::tempdir().expect("tempdir");
    run_sdk_script(&server, &python, &["-c".as_ref(), SDK_ERRORS_SCRIPT.as_ref()], dir.path(), "ERRORS OK").await;
    server.stop().await;
}

/// Runs `program ARGS…` in `dir` with the SDK's environment pointed at `server` (its control plane and envd): it
/// must succeed, print `done`, and leave no sandbox behind.
pub(crate) async fn run_sdk_script(server: &TestServer, program: &Path, args: &[&OsStr], dir: &Path, done: &str) {
    let output = tokio::process::Command::new(program)
        .args(args)
        .current_dir(dir)
        .env("E2B_API_KEY", SDK_KEY)
        .env("E2B_API_URL", &server.base)
        .env("E2B_SANDBOX_URL", &server.base)
        .kill_on_drop(true)
        .output()
        .await
        .unwrap_or_else(|e| panic!("{} runs: {e}", program.display()));
    let (stdout, stderr) = (String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    assert!(output.status.success() && stdout.contains(done), "stdout: {stdout}\nstderr: {stderr}");
    assert!(server.state.registry.list(None).is_empty(), "the SDK killed its sandboxes");
}

/// Runs `python` (a script for the pinned Python SDK, printing `python_done`) and `js` (an ES module for the pinned
/// JS SDK, written as `js_name`, printing `js_done`) against `server`, each SDK that can be installed here.
pub(crate) async fn both_sdks(
    server: &TestServer,
    python: &str,
    python_done: &str,
    js: &str,
    js_name: &str,
    js_done: &str,
) {
    let dir = tempfile::tempdir().expect("tempdir");
    if let Some(interpreter) = tokio::task::spawn_blocking(sdk_python).await.expect("setup") {
        run_sdk_script(server, &interpreter, &["-c".as_ref(), python.as_ref()], dir.path(), python_done).await;
    }
    if let Some(sdk) = tokio::task::spawn_blocking(sdk_js).await.expect("setup") {
        let script = sdk.join(js_name);
        std::fs::write(&script, js).expect("script");
        run_sdk_script(server, "node".as_ref(), &[script.as_os_str()], &sdk, js_done).await;
    }
}

/// A test of both pinned SDKs against a keyed server ([`both_sdks`]), after one skip line where the process tier
/// cannot run.
async fn sdk_test(test: &str, python: &str, python_done: &str, js: &str, js_name: &str, js_done: &str) {
    if !process_tier(test) {
        return;
    }
    let server = keyed_server().await;
    both_sdks(&server, python, python_done, js, js_name, js_done).await;
    server.stop().await;
}

/// The pinned E2B JavaScript SDK under `$STRATA_HOME/e2b-js-2.51.0`, installed once with npm; `None` (with a line
/// saying why) when it cannot be installed here.
fn sdk_js() -> Option<PathBuf> {
    let dir = strata_engine::strata_home()?.join("e2b-js-2.51.0");
    if !Command::new("node").arg("--version").output().is_ok_and(|o| o.status.success()) {
        eprintln!("skipping e2b_js_sdk_raises_its_own_errors: no node here");
        return None;
    }
    let ready = dir.join(".installed");
    if ready.exists() {
        return Some(dir);
    }
    let installed = std::fs::create_dir_all(&dir).is_ok()
        && Command::new("npm")
            .args(["install", "--no-audit", "--no-fund", "--silent", "e2b@2.51.0"])
            .current_dir(&dir)
            .status()
            .is_ok_and(|s| s.success());
    if !installed {
        eprintln!(
            "skipping e2b_js_sdk_raises_its_own_errors: cannot install e2b@2.51.0 with npm into {}",
            dir.display()
        );
        return None;
    }
    let _ = std::fs::write(&ready, b"");
    Some(dir)
}

/// What the SDKs raise, in JavaScript: a command and files to see the SDK works, then every failure.
const JS_SDK_SCRIPT: &str = r#"
import {
  Sandbox, AuthenticationError, FileNotFoundError, SandboxError, SandboxNotFoundError, TimeoutError,
} from 'e2b'

async function expect(kind, what, call) {
  try {
    await call()
  } catch (e) {
    if (e instanceof kind) return
    console.error(`${what}: ${e?.constructor?.name}: ${e?.message}, not ${kind.name}`)
    process.exit(1)
  }
  console.error(`${what}: no ${kind.name}`)
  process.exit(1)
}

await expect(SandboxNotFoundError, 'connect to an unknown sandbox', () => Sandbox.connect('sb_nope'))
await expect(AuthenticationError, 'a bad API key', () => Sandbox.create({ apiKey: 'e2b_' + '1'.repeat(40) }))
const sbx = await Sandbox.create()
const run = await sbx.commands.run('echo hi')
if (run.stdout !== 'hi\n' || run.exitCode !== 0) throw new Error(`run: ${JSON.stringify(run)}`)
await sbx.files.write('/tmp/a.txt', 'x')
if ((await sbx.files.read('/tmp/a.txt')) !== 'x') throw new Error('read back')
await expect(FileNotFoundError, 'read a missing file', () => sbx.files.read('/tmp/missing'))
await expect(FileNotFoundError, 'stat a missing file', () => sbx.files.getInfo('/tmp/missing'))
await expect(SandboxError, 'open the network to everything', () => sbx.updateNetwork({ allowOut: ['0.0.0.0/0'] }))
await sbx.kill()
await expect(SandboxNotFoundError, 'run in a killed sandbox', () => sbx.commands.run('true'))
await expect(TimeoutError, 'read in a killed sandbox', () => sbx.files.read('/tmp/a.txt'))
await expect(TimeoutError, 'list in a killed sandbox', () => sbx.files.list('/'))
console.log('JS OK')
"#;

/// `get_host(port)` and a fetch of it (issue 19 §2): the server runs with keys and `--domain strata.test`, so the SDK
/// names the port `8000-{id}.strata.test`; without a wildcard DNS name here, the fetch goes to the server's address
/// with that Host name, and carries the sandbox's traffic token (a server with keys asks for it).
const PORTS_SCRIPT: &str = r#"
import os, time, urllib.error, urllib.request
from e2b import Sandbox
sbx = Sandbox.create()
sbx.files.write("/tmp/www/hello.txt", "hi from the sandbox")
sbx.commands.run("cd /tmp/www && python3 -m http.server 8000 --bind 127.0.0.1", background=True)
host = sbx.get_host(8000)
assert host == f"8000-{sbx.sandbox_id}.strata.test", host
def fetch(token):
    headers = {"Host": host}
    if token:
        headers["E2B-Traffic-Access-Token"] = token
    request = urllib.request.Request(os.environ["E2B_API_URL"] + "/hello.txt", headers=headers)
    return urllib.request.urlopen(request, timeout=10).read()
body = None
for _ in range(200):
    try:
        body = fetch(sbx.traffic_access_token)
        break
    except urllib.error.HTTPError as e:
        if e.code != 502:
            raise
        time.sleep(0.05)
assert body == b"hi from the sandbox", body
try:
    fetch(None)
    raise SystemExit("a port answered without the sandbox's token")
except urllib.error.HTTPError as e:
    assert e.code == 403, e.code
sbx.kill()
print("PORTS OK")
"#;

const JS_PORTS_SCRIPT: &str = r#"
import { Sandbox } from 'e2b'
import http from 'node:http'
const check = (ok, what) => { if (!ok) { console.error(what); process.exit(1) } }
const sbx = await Sandbox.create()
await sbx.files.write('/tmp/www/hello.txt', 'hi from the sandbox')
await sbx.commands.run('cd /tmp/www && python3 -m http.server 8000 --bind 127.0.0.1', { background: true })
const host = sbx.getHost(8000)
check(host === `8000-${sbx.sandboxId}.strata.test`, `getHost: ${host}`)
const fetch = (token) => new Promise((resolve, reject) => {
  const headers = { Host: host }
  if (token) headers['E2B-Traffic-Access-Token'] = token
  http.get(process.env.E2B_API_URL + '/hello.txt', { headers }, (res) => {
    let body = ''
    res.on('data', (c) => { body += c })
    res.on('end', () => resolve({ status: res.statusCode, body }))
  }).on('error', reject)
})
let got
for (let i = 0; i < 200; i++) {
  got = await fetch(sbx.trafficAccessToken)
  if (got.status !== 502) break
  await new Promise((r) => setTimeout(r, 50))
}
check(got.status === 200 && got.body === 'hi from the sandbox', `fetch: ${JSON.stringify(got)}`)
check((await fetch(undefined)).status === 403, 'a port answered without the token')
await sbx.kill()
console.log('JS PORTS OK')
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e2b_sdks_reach_a_port_by_get_host() {
    if !process_tier("e2b_sdks_reach_a_port_by_get_host") {
        return;
    }
    let server = TestServer::with(|config| {
        config.keys = Some(strata_serve::KeyStore::from_keys([("sdk", SDK_KEY, None)]));
        config.domain = Some("strata.test".into());
    })
    .await;
    both_sdks(&server, PORTS_SCRIPT, "PORTS OK", JS_PORTS_SCRIPT, "ports.mjs", "JS PORTS OK").await;
    server.stop().await;
}

/// [`TIME_SCRIPT`] with the JS SDK (`timeoutMs` 60 000 by default).
const JS_TIME_SCRIPT: &str = r#"
import { Sandbox, CommandExitError } from 'e2b'
const check = (ok, what) => { if (!ok) { console.error(what); process.exit(1) } }
const sleep = (ms) => new Promise((r) => setTimeout(r, ms))
const sbx = await Sandbox.create({ timeoutMs: 300_000 })
const started = Number((await sbx.commands.run('date +%s')).stdout)
const bg = await sbx.commands.run('while true; do date +%s >> /tmp/alive; sleep 2; done', { background: true })
const t = Date.now()
const r = await sbx.commands.run('sleep 45; echo done')
check(r.stdout === 'done\n' && r.exitCode === 0 && Date.now() - t >= 45_000, `45 s command: ${JSON.stringify(r)}`)
await sleep(Math.max(0, 68_000 - (Date.now() - t)))
const last = Number((await sbx.files.read('/tmp/alive')).trim().split('\n').pop())
check(last >= started + 64, `the background command stopped writing: ${started} ${last}`)
check(JSON.stringify((await sbx.commands.list()).map((p) => p.pid)) === JSON.stringify([bg.pid]), 'list')
check((await sbx.commands.kill(bg.pid)) === true, 'kill')
check((await sbx.commands.list()).length === 0, 'kill answers once the command is gone')
const h = await sbx.commands.run('sleep 30', { background: true })
check((await sbx.commands.kill(h.pid)) === true, 'kill the second')
try {
  await h.wait()
  check(false, 'no CommandExitError after a kill')
} catch (e) {
  check(e instanceof CommandExitError && e.exitCode === -1 && /killed/.test(e.error ?? ''), `wait: ${e} ${e?.exitCode} ${e?.error}`)
}
await sbx.kill()
console.log('JS TIME OK')
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e2b_js_commands_live_as_long_as_the_client_asks() {
    if !process_tier("e2b_js_commands_live_as_long_as_the_client_asks") {
        return;
    }
    let Some(dir) = tokio::task::spawn_blocking(sdk_js).await.expect("setup") else { return };
    let script = dir.join("time.mjs");
    std::fs::write(&script, JS_TIME_SCRIPT).expect("script");
    let server = keyed_server().await;
    run_sdk_script(&server, "node".as_ref(), &[script.as_os_str()], &dir, "JS TIME OK").await;
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e2b_js_sdk_raises_its_own_errors() {
    if !process_tier("e2b_js_sdk_raises_its_own_errors") {
        return;
    }
    let Some(dir) = tokio::task::spawn_blocking(sdk_js).await.expect("setup") else { return };
    let script = dir.join("errors.mjs");
    std::fs::write(&script, JS_SDK_SCRIPT).expect("script");
    let server = keyed_server().await;
    run_sdk_script(&server, "node".as_ref(), &[script.as_os_str()], &dir, "JS OK").await;
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e2b_state_goes_with_its_sandbox() {
    if !process_tier("e2b_state_goes_with_its_sandbox") {
        return;
    }
    let server = TestServer::start().await;
    let homes = server.state.snapshot_dir.join("e2b");
    let count = || std::fs::read_dir(&homes).map(|dir| dir.count()).unwrap_or(0);
    // A sandbox's home is in its own filesystem; only the wasm-Python template shares one from the host.
    let (status, created) = server.post("/v2/sandboxes", json!({"templateID": "base"})).await;
    assert_eq!(status, 201, "{created}");
    assert_eq!(count(), 0, "a base sandbox's home is its own");
    let base = created["sandboxID"].as_str().expect("id").to_owned();
    assert_eq!(server.delete(&format!("/v1/sandboxes/{base}")).await, 204);
    let (status, created) = server.post("/v2/sandboxes", json!({"templateID": "strata-wasm-python"})).await;
    assert_eq!(status, 201, "{created}");
    let id = created["sandboxID"].as_str().expect("id").to_owned();
    assert_eq!(count(), 1, "the sandbox's home directory");
    // Killed by the native API, not the E2B one: the E2B layer's state of it goes all the same.
    assert_eq!(server.delete(&format!("/v1/sandboxes/{id}")).await, 204);
    assert_eq!(count(), 0, "the home directory outlived its sandbox");
    let (status, body) = server.get(&format!("/sandboxes/{id}")).await;
    assert_eq!((status, &body["code"]), (404, &json!(404)), "{body}");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e2b_bodies_over_the_limit_are_refused_in_e2b_shapes() {
    let server = TestServer::with(|config| config.connections.max_body = 1024).await;
    let big = vec![b' '; 4096];
    let send = |path: &str, content_type: &str| {
        let request = server.client.post(server.url(path)).header("content-type", content_type.to_owned());
        request.header("E2b-Sandbox-Id", "sb_nope").body(big.clone()).send()
    };
    let response = send("/v2/sandboxes", "application/json").await.expect("create");
    assert_eq!(response.status().as_u16(), 413);
    assert_eq!(response.json::<Value>().await.expect("json")["code"], 413);
    let response = send("/process.Process/List", "application/json").await.expect("list");
    assert_eq!(response.status().as_u16(), 429);
    assert_eq!(response.json::<Value>().await.expect("json")["code"], "resource_exhausted");
    let response = send("/process.Process/Start", "application/connect+json").await.expect("start");
    assert_eq!(response.status().as_u16(), 200);
    let frames = envelopes(&response.bytes().await.expect("body"));
    assert_eq!((frames[0].0, &frames[0].1["error"]["code"]), (2, &json!("resource_exhausted")), "{frames:?}");
    let response = send("/v1/sandboxes", "application/json").await.expect("native");
    assert_eq!(response.json::<Value>().await.expect("json")["error"]["code"], "body_too_large");
    server.stop().await;
}

/// A terminal through the Python SDK: `pty.create` starts `bash -i -l` with `TERM=xterm-256color` on a terminal of
/// the asked size, `send_stdin` types, `resize` resizes (the shell sees it), `exit 3` ends it with its code, and
/// `kill` ends one at once, reported as killed.
pub(crate) const PTY_SCRIPT: &str = r#"
import threading, time
from e2b import Sandbox, CommandExitException
from e2b.sandbox.commands.command_handle import PtySize
sbx = Sandbox.create()
screen, ended = bytearray(), []
h = sbx.pty.create(PtySize(rows=24, cols=80))
def follow():
    try:
        ended.append(h.wait(on_pty=lambda data: screen.extend(data)).exit_code)
    except CommandExitException as e:
        ended.append(e.exit_code)
t = threading.Thread(target=follow)
t.start()
def until(text):
    deadline = time.time() + 30
    while text not in screen:
        assert time.time() < deadline, (text, bytes(screen))
        time.sleep(0.02)
sbx.pty.send_stdin(h.pid, b"echo $TERM; stty size; tty; pwd | tr / _\n")
until(b"xterm-256color\r\n24 80\r\n/dev/pts/")
until(b"_home_user\r\n")
sbx.pty.resize(h.pid, PtySize(rows=40, cols=120))
sbx.pty.send_stdin(h.pid, b"stty size\n")
until(b"40 120\r\n")
sbx.pty.send_stdin(h.pid, b"exit 3\n")
t.join(30)
assert ended == [3], (ended, bytes(screen))
k = sbx.pty.create(PtySize(rows=24, cols=80))
assert sbx.pty.kill(k.pid) is True
try:
    k.wait()
    raise SystemExit("no CommandExitException after a kill")
except CommandExitException as e:
    assert e.exit_code == -1, e
assert sbx.pty.kill(k.pid) is False
sbx.kill()
print("PTY OK")
"#;

/// [`PTY_SCRIPT`] with the JS SDK (`sendInput`).
pub(crate) const JS_PTY_SCRIPT: &str = r#"
import { Sandbox } from 'e2b'
const check = (ok, what) => { if (!ok) { console.error(what); process.exit(1) } }
const sbx = await Sandbox.create()
let screen = ''
const decoder = new TextDecoder()
const keys = (text) => new TextEncoder().encode(text)
const until = async (text) => {
  const deadline = Date.now() + 30_000
  while (!screen.includes(text)) {
    check(Date.now() < deadline, `no ${JSON.stringify(text)} in ${JSON.stringify(screen)}`)
    await new Promise((r) => setTimeout(r, 20))
  }
}
const h = await sbx.pty.create({ cols: 80, rows: 24, onData: (data) => { screen += decoder.decode(data) } })
await sbx.pty.sendInput(h.pid, keys('echo $TERM; stty size; tty\n'))
await until('xterm-256color\r\n24 80\r\n/dev/pts/')
await sbx.pty.resize(h.pid, { cols: 120, rows: 40 })
await sbx.pty.sendInput(h.pid, keys('stty size\n'))
await until('40 120\r\n')
await sbx.pty.sendInput(h.pid, keys('exit 3\n'))
const ended = await h.wait().catch((e) => e)
check(ended.exitCode === 3, `exit: ${ended} ${ended?.exitCode}`)
const k = await sbx.pty.create({ cols: 80, rows: 24, onData: () => {} })
check((await sbx.pty.kill(k.pid)) === true, 'kill')
const killed = await k.wait().catch((e) => e)
check(killed.exitCode === -1, `killed: ${killed} ${killed?.exitCode}`)
await sbx.kill()
console.log('JS PTY OK')
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e2b_sdks_drive_a_terminal() {
    sdk_test("e2b_sdks_drive_a_terminal", PTY_SCRIPT, "PTY OK", JS_PTY_SCRIPT, "pty.mjs", "JS PTY OK").await;
}

/// `get_metrics()` through the Python SDK: samples of the sandbox's CPU, memory and disk, in E2B's shape.
const METRICS_SCRIPT: &str = r#"
from e2b import Sandbox
sbx = Sandbox.create()
sbx.commands.run("i=0; while [ $i -lt 300000 ]; do i=$((i+1)); done; dd if=/dev/zero of=/tmp/big bs=1M count=16")
metrics = sbx.get_metrics()
assert metrics, metrics
last = metrics[-1]
assert last.cpu_count >= 1 and 0 <= last.cpu_used_pct <= 100, last
assert last.disk_used >= 16 << 20 and last.disk_used <= last.disk_total, last
assert 0 < last.mem_used <= last.mem_total and last.mem_cache <= last.mem_used, last
assert last.timestamp.year >= 2024, last
sbx.kill()
print("METRICS OK")
"#;

/// [`METRICS_SCRIPT`] with the JS SDK (`getMetrics`).
const JS_METRICS_SCRIPT: &str = r#"
import { Sandbox } from 'e2b'
const check = (ok, what) => { if (!ok) { console.error(what); process.exit(1) } }
const sbx = await Sandbox.create()
await sbx.commands.run('dd if=/dev/zero of=/tmp/big bs=1M count=16 2>/dev/null')
const metrics = await sbx.getMetrics()
const last = metrics[metrics.length - 1]
check(last && last.cpuCount >= 1 && last.diskUsed >= 16 * 1048576 && last.memUsed <= last.memTotal, JSON.stringify(metrics))
check(last.timestamp instanceof Date && !isNaN(last.timestamp), `timestamp ${last.timestamp}`)
await sbx.kill()
console.log('JS METRICS OK')
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e2b_batch_metrics_answer_the_keys_sandboxes_only() {
    if !process_tier("e2b_batch_metrics_answer_the_keys_sandboxes_only") {
        return;
    }
    let server = keyed_server().await;
    let call = |method: reqwest::Method, path: &str| {
        server.client.request(method, server.url(path)).header("X-API-KEY", SDK_KEY)
    };
    let created: Value = call(reqwest::Method::POST, "/v2/sandboxes")
        .json(&serde_json::json!({"templateID": "base"}))
        .send()
        .await
        .expect("create")
        .json()
        .await
        .expect("json");
    let id = created["sandboxID"].as_str().expect("id").to_owned();
    let response = call(reqwest::Method::GET, &format!("/sandboxes/metrics?sandbox_ids={id},sb_nope"))
        .send()
        .await
        .expect("metrics");
    assert_eq!(response.status(), 200);
    let batch: Value = response.json().await.expect("json");
    let sandboxes = batch["sandboxes"].as_object().expect("sandboxes");
    assert_eq!(sandboxes.keys().collect::<Vec<_>>(), [&id], "{batch}");
    assert!(sandboxes[&id]["memTotal"].as_u64().is_some_and(|m| m > 0), "{batch}");
    let many = vec!["sb_x"; 101].join(",");
    let response = call(reqwest::Method::GET, &format!("/sandboxes/metrics?sandbox_ids={many}")).send().await;
    assert_eq!(response.expect("metrics").status(), 400);
    assert_eq!(call(reqwest::Method::DELETE, &format!("/sandboxes/{id}")).send().await.expect("kill").status(), 204);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e2b_sdks_read_a_sandboxs_metrics() {
    sdk_test(
        "e2b_sdks_read_a_sandboxs_metrics",
        METRICS_SCRIPT,
        "METRICS OK",
        JS_METRICS_SCRIPT,
        "metrics.mjs",
        "JS METRICS OK",
    )
    .await;
}

/// A command on a terminal, typed into through `StreamInput` (a client stream: the process named first, then input
/// messages, then its end) and resized through `Update`, as envd's protocol has it, spoken by hand.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e2b_stream_input_and_update_reach_a_terminal() {
    use base64::Engine as _;
    if !process_tier("e2b_stream_input_and_update_reach_a_terminal") {
        return;
    }
    let server = TestServer::start().await;
    let (id, token) = create_e2b(&server).await;
    let envd = |path: &str| {
        server.client.post(server.url(path)).header("E2b-Sandbox-Id", &id).header("X-Access-Token", &token)
    };
    let script = "trap 'stty size' WINCH; echo ready; while :; do read -t 0.1 line && break; done; echo \"got:$line\"";
    let start =
        json!({"process": {"cmd": "/bin/bash", "args": ["-c", script]}, "pty": {"size": {"cols": 80, "rows": 24}}});
    let mut response = envd("/process.Process/Start")
        .header("content-type", "application/connect+json")
        .body(envelope(0, &start))
        .send()
        .await
        .expect("start");
    assert_eq!(response.status().as_u16(), 200);
    let (mut raw, mut screen, mut pid) = (Vec::new(), String::new(), None);
    let mut read_until = async |text: &str, raw: &mut Vec<u8>, screen: &mut String, pid: &mut Option<u64>| {
        while !screen.contains(text) {
            let chunk = tokio::time::timeout(std::time::Duration::from_secs(30), response.chunk()).await;
            let chunk =
                chunk.expect("output within 30 s").expect("the stream").unwrap_or_else(|| panic!("ended: {screen:?}"));
            raw.extend_from_slice(&chunk);
            // Whole envelopes only; a partial one waits for the next chunk.
            while raw.len() >= 5 {
                let len = u32::from_be_bytes([raw[1], raw[2], raw[3], raw[4]]) as usize;
                if raw.len() < 5 + len {
                    break;
                }
                let message: Value = serde_json::from_slice(&raw[5..5 + len]).expect("json");
                raw.drain(..5 + len);
                if let Some(started) = message["event"]["start"]["pid"].as_u64() {
                    *pid = Some(started);
                }
                if let Some(b64) = message["event"]["data"]["pty"].as_str() {
                    let bytes = base64::engine::general_purpose::STANDARD.decode(b64).expect("base64");
                    screen.push_str(&String::from_utf8_lossy(&bytes));
                }
            }
        }
    };
    read_until("ready\r\n", &mut raw, &mut screen, &mut pid).await;
    let mut started = pid;
    let pid = pid.expect("a start event");
    let resized = envd("/process.Process/Update")
        .json(&json!({"process": {"pid": pid}, "pty": {"size": {"cols": 120, "rows": 40}}}))
        .send()
        .await
        .expect("update");
    assert_eq!(resized.status().as_u16(), 200);
    read_until("40 120\r\n", &mut raw, &mut screen, &mut started).await;
    // Input for a terminal sent as stdin is refused, naming why.
    let wrong = envd("/process.Process/SendInput")
        .json(&json!({"process": {"pid": pid}, "input": {"stdin": "eA=="}}))
        .send()
        .await
        .expect("send input");
    let refusal: Value = wrong.json().await.expect("json");
    assert_eq!(refusal["code"], "failed_precondition", "{refusal}");
    let typed =
        |text: &str| json!({"data": {"input": {"pty": base64::engine::general_purpose::STANDARD.encode(text)}}});
    let stream = [
        envelope(0, &json!({"start": {"process": {"pid": pid}}})),
        envelope(0, &json!({"keepalive": {}})),
        envelope(0, &typed("h")),
        envelope(0, &typed("i\n")),
        envelope(2, &json!({})),
    ]
    .concat();
    let answer = envd("/process.Process/StreamInput")
        .header("content-type", "application/connect+json")
        .body(stream)
        .send()
        .await
        .expect("stream input");
    assert_eq!(answer.status().as_u16(), 200);
    read_until("hi\r\ngot:hi\r\n", &mut raw, &mut screen, &mut started).await;
    // A message before `start` is refused.
    let early = envd("/process.Process/StreamInput")
        .header("content-type", "application/connect+json")
        .body(envelope(0, &typed("x")))
        .send()
        .await
        .expect("stream input");
    // A streaming call's error is its end-of-stream message.
    let frames = envelopes(&early.bytes().await.expect("body"));
    let last = frames.last().expect("an end message");
    assert_eq!((last.0, &last.1["error"]["code"]), (2, &json!("invalid_argument")), "{frames:?}");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e2b_sdks_run_commands_as_user_with_sudo() {
    sdk_test(
        "e2b_sdks_run_commands_as_user_with_sudo",
        USERS_SCRIPT,
        "USERS OK",
        JS_USERS_SCRIPT,
        "users.mjs",
        "JS USERS OK",
    )
    .await;
}

/// Commands run as `user` (uid 1000) in `/home/user` unless `user="root"`, `sudo` reaches root, relative paths are
/// the user's home for commands and files alike, and files written through the SDK belong to the user.
const USERS_SCRIPT: &str = r#"
from e2b import Sandbox, CommandExitException
sbx = Sandbox.create()
r = sbx.commands.run("whoami; id -u; pwd; echo $HOME; sudo whoami; sudo -i pwd")
assert r.stdout == "user\n1000\n/home/user\n/home/user\nroot\n/root\n", repr(r.stdout)
r = sbx.commands.run("whoami; pwd", user="root")
assert r.stdout == "root\n/root\n", repr(r.stdout)
sbx.files.write("notes.txt", "a\n")
r = sbx.commands.run("echo b >> notes.txt && stat -c %U notes.txt")
assert r.stdout == "user\n", repr(r.stdout)
assert sbx.files.read("notes.txt") == "a\nb\n"
try:
    sbx.commands.run("touch /etc/nope")
    raise SystemExit("a user wrote /etc")
except CommandExitException as e:
    assert e.exit_code == 1 and "Permission denied" in e.stderr, (e.exit_code, e.stderr)
r = sbx.commands.run("sudo apt-get --version | head -1")
assert r.stdout.startswith("apt "), repr(r.stdout)
sbx.kill()
print("USERS OK")
"#;

/// [`USERS_SCRIPT`] with the JS SDK.
const JS_USERS_SCRIPT: &str = r#"
import { Sandbox } from 'e2b'
const check = (ok, what) => { if (!ok) { console.error(what); process.exit(1) } }
const sbx = await Sandbox.create()
let r = await sbx.commands.run('whoami; pwd; sudo id -u')
check(r.stdout === 'user\n/home/user\n0\n', JSON.stringify(r.stdout))
r = await sbx.commands.run('id -u', { user: 'root' })
check(r.stdout === '0\n', JSON.stringify(r.stdout))
await sbx.files.write('js.txt', 'x')
r = await sbx.commands.run('stat -c %U /home/user/js.txt')
check(r.stdout === 'user\n', JSON.stringify(r.stdout))
await sbx.kill()
console.log('JS USERS OK')
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e2b_sdks_pause_resume_snapshot_and_fork() {
    if !process_tier("e2b_sdks_pause_resume_snapshot_and_fork") {
        return;
    }
    let server = keyed_server().await;
    both_sdks(&server, LIFECYCLE_SCRIPT, "LIFECYCLE OK", JS_LIFECYCLE_SCRIPT, "lifecycle.mjs", "JS LIFECYCLE OK").await;
    assert!(server.state.registry.snapshots("sdk").is_empty(), "the SDKs deleted their snapshots");
    server.stop().await;
}

/// `pause()` keeps the filesystem (home and `/tmp`) under the same id and tokens, `connect` resumes it;
/// `create_snapshot` + `Sandbox.create(snapshot_id)`, `list_snapshots`, `delete_snapshot`; `fork(count=2)`: forks
/// independent of each other and of their source.
const LIFECYCLE_SCRIPT: &str = r#"
from e2b import Sandbox
sbx = Sandbox.create(metadata={"who": "lifecycle"})
sbx.files.write("state.txt", "before")
sbx.commands.run("echo tmp > /tmp/t")
assert sbx.pause() is True
assert sbx.pause() is False, "a second pause finds it paused"
assert not sbx.is_running()
listed = {s.sandbox_id: s.state for s in Sandbox.list().next_items()}
assert str(listed.get(sbx.sandbox_id)).endswith("paused"), listed
from e2b import SandboxQuery, SandboxState
query = SandboxQuery(state=[SandboxState.PAUSED], metadata={"who": "lifecycle"})
assert [s.sandbox_id for s in Sandbox.list(query=query).next_items()] == [sbx.sandbox_id]
query = SandboxQuery(state=[SandboxState.RUNNING])
assert sbx.sandbox_id not in [s.sandbox_id for s in Sandbox.list(query=query).next_items()]
query = SandboxQuery(metadata={"who": "nobody"})
assert Sandbox.list(query=query).next_items() == []
same = Sandbox.connect(sbx.sandbox_id)
assert same.sandbox_id == sbx.sandbox_id and same.is_running()
assert sbx.files.read("state.txt") == "before", "the old object works again: same tokens"
assert same.commands.run("cat /tmp/t; whoami").stdout == "tmp\nuser\n"
snap = same.create_snapshot(name="mine")
assert snap.snapshot_id and "mine" in snap.names, snap
listed = [s.snapshot_id for s in Sandbox.list_snapshots(sandbox_id=same.sandbox_id).next_items()]
assert listed == [snap.snapshot_id], listed
started = Sandbox.create(snap.snapshot_id)
assert started.sandbox_id != same.sandbox_id
assert started.files.read("state.txt") == "before"
started.files.write("state.txt", "changed")
assert same.files.read("state.txt") == "before"
forks = same.fork(count=2)
assert len(forks) == 2 and not any(isinstance(f, Exception) for f in forks), forks
forks[0].files.write("state.txt", "fork0")
assert forks[1].files.read("state.txt") == "before" and same.files.read("state.txt") == "before"
assert forks[0].commands.run("whoami").stdout == "user\n"
assert Sandbox.delete_snapshot(snap.snapshot_id) is True
assert Sandbox.delete_snapshot(snap.snapshot_id) is False
for s in [same, started, *forks]:
    s.kill()
print("LIFECYCLE OK")
"#;

/// [`LIFECYCLE_SCRIPT`] with the JS SDK.
const JS_LIFECYCLE_SCRIPT: &str = r#"
import { Sandbox } from 'e2b'
const check = (ok, what) => { if (!ok) { console.error(what); process.exit(1) } }
const sbx = await Sandbox.create()
await sbx.files.write('state.txt', 'before')
check(await sbx.pause() === true, 'paused')
check(!(await sbx.isRunning()), 'not running while paused')
const same = await Sandbox.connect(sbx.sandboxId)
check(await same.files.read('state.txt') === 'before', 'resumed with its files')
const snap = await same.createSnapshot()
const started = await Sandbox.create(snap.snapshotId)
check(await started.files.read('state.txt') === 'before', 'created from the snapshot')
const forks = await same.fork({ count: 2 })
check(forks.length === 2 && forks.every(f => !(f instanceof Error)), String(forks))
check(await forks[1].files.read('state.txt') === 'before', 'a fork has the files')
await Sandbox.deleteSnapshot(snap.snapshotId)
for (const s of [same, started, ...forks]) await s.kill()
console.log('JS LIFECYCLE OK')
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e2b_sdks_update_the_network_at_run_time() {
    if !process_tier("e2b_sdks_update_the_network_at_run_time") {
        return;
    }
    let port = crate::util::head_origin().0.to_string();
    let server = keyed_server().await;
    let (python, js) = (NETWORK_SCRIPT.replace("{PORT}", &port), JS_NETWORK_SCRIPT.replace("{PORT}", &port));
    both_sdks(&server, &python, "NETWORK OK", &js, "network.mjs", "JS NETWORK OK").await;
    server.stop().await;
}

/// `update_network` opens and closes the sandbox's egress for the commands that follow: a host on the host's
/// loopback (through the sandbox's proxy, named explicitly and with `NO_PROXY` dropped: it keeps the sandbox's own
/// loopback local).
const NETWORK_SCRIPT: &str = r#"
from e2b import Sandbox
FETCH = '''
import os, urllib.request as u
os.environ.pop("no_proxy", None); os.environ.pop("NO_PROXY", None)
o = u.build_opener(u.ProxyHandler({"http": "http://127.0.0.1:3128"}))
try:
    print(o.open("http://127.0.0.1:{PORT}/", timeout=10).read().decode())
except Exception as e:
    print("refused", getattr(e, "code", e))
'''
sbx = Sandbox.create()
sbx.files.write("/tmp/fetch.py", FETCH)
fetch = lambda: sbx.commands.run("python3 /tmp/fetch.py").stdout
assert fetch() == "refused 403\n", fetch()
sbx.update_network({"allow_out": ["127.0.0.1:{PORT}"], "deny_out": ["0.0.0.0/0"]})
assert fetch() == "origin\n", fetch()
sbx.update_network({})
assert fetch() == "refused 403\n", "omitted fields are cleared"
try:
    sbx.update_network({"allow_out": ["0.0.0.0/0"]})
    raise SystemExit("allow-all was taken")
except Exception as e:
    assert "allowlist" in str(e), e
opened = Sandbox.create(network={"allow_out": ["127.0.0.1:{PORT}"]})
opened.files.write("/tmp/fetch.py", FETCH)
assert opened.commands.run("python3 /tmp/fetch.py").stdout == "origin\n"
opened.kill()
sbx.kill()
print("NETWORK OK")
"#;

/// [`NETWORK_SCRIPT`] with the JS SDK (`updateNetwork`).
const JS_NETWORK_SCRIPT: &str = r#"
import { Sandbox } from 'e2b'
const check = (ok, what) => { if (!ok) { console.error(what); process.exit(1) } }
const sbx = await Sandbox.create()
const fetch = `import os, urllib.request as u
os.environ.pop("no_proxy", None); os.environ.pop("NO_PROXY", None)
o = u.build_opener(u.ProxyHandler({"http": "http://127.0.0.1:3128"}))
try:
    print(o.open("http://127.0.0.1:{PORT}/", timeout=10).read().decode())
except Exception as e:
    print("refused", getattr(e, "code", e))
`
await sbx.files.write('/tmp/fetch.py', fetch)
const run = async () => (await sbx.commands.run('python3 /tmp/fetch.py')).stdout
check(await run() === 'refused 403\n', 'closed at first')
await sbx.updateNetwork({ allowOut: ['127.0.0.1:{PORT}'], denyOut: ['0.0.0.0/0'] })
check(await run() === 'origin\n', 'opened')
await sbx.updateNetwork({})
check(await run() === 'refused 403\n', 'closed again')
await sbx.kill()
console.log('JS NETWORK OK')
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e2b_sdk_sandbox_pauses_at_its_timeout_and_resumes_on_use() {
    if !process_tier("e2b_sdk_sandbox_pauses_at_its_timeout_and_resumes_on_use") {
        return;
    }
    let Some(python) = tokio::task::spawn_blocking(sdk_python).await.expect("setup") else { return };
    let server = TestServer::with(|config| {
        config.keys = Some(strata_serve::KeyStore::from_keys([("sdk", SDK_KEY, None)]));
        config.reap_interval = std::time::Duration::from_millis(100);
    })
    .await;
    let dir = tempfile::tempdir().expect("tempdir");
    run_sdk_script(&server, &python, &["-c".as_ref(), AUTO_PAUSE_SCRIPT.as_ref()], dir.path(), "AUTO OK").await;
    server.stop().await;
}

/// `lifecycle={"on_timeout": "pause", "auto_resume": True}`: at its timeout the sandbox is paused, not killed, and
/// the next command wakes it with its files; without `auto_resume` a command finds it gone until `connect`.
const AUTO_PAUSE_SCRIPT: &str = r#"
import time
from e2b import Sandbox, SandboxException
def paused(sbx):
    deadline = time.time() + 30
    while time.time() < deadline:
        if str(Sandbox.get_info(sbx.sandbox_id).state).endswith("paused"):
            return True
        time.sleep(0.1)
    return False
sbx = Sandbox.create(timeout=1, lifecycle={"on_timeout": "pause", "auto_resume": True})
sbx.files.write("kept.txt", "kept")
assert paused(sbx), "paused at its timeout"
assert sbx.commands.run("cat kept.txt").stdout == "kept", "a command woke it"
assert sbx.is_running()
sbx.kill()
manual = Sandbox.create(timeout=1, lifecycle={"on_timeout": "pause"})
assert paused(manual)
try:
    manual.commands.run("true")
    raise SystemExit("a paused sandbox without auto_resume ran a command")
except SandboxException:
    pass
Sandbox.connect(manual.sandbox_id, timeout=60)
assert manual.commands.run("whoami").stdout == "user\n"
manual.kill()
print("AUTO OK")
"#;
