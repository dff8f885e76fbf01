//! A fleet: three `strata serve` nodes and a three-member etcd cluster (Debian's `etcd-server`, started here on
//! loopback ports), as processes. Creates through one node spread by capacity; any node answers for any sandbox
//! (exec, files, a WebSocket job, the operations API); a SIGKILLed node's sandboxes are `sandbox_lost` within its
//! lease's TTL and it rejoins cleanly; with one etcd member down the fleet goes on, with two it refuses new
//! placements (a typed error) while every node keeps serving what it holds, and recovers when etcd does.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

/// A free loopback port (bound and released: the process given it binds it next).
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port()
}

/// One HTTP/1.1 request on a fresh connection: the status and the body as JSON (`null` when empty or not JSON).
fn request(addr: &str, method: &str, path: &str, body: &Value) -> (u16, Value) {
    let body = if body.is_null() { String::new() } else { body.to_string() };
    let mut stream = TcpStream::connect(addr).unwrap_or_else(|e| panic!("connect {addr}: {e}"));
    stream.set_read_timeout(Some(Duration::from_secs(60))).expect("timeout");
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).and_then(|()| stream.write_all(body.as_bytes())).expect("send");
    let mut response = Vec::new();
    let _ = stream.read_to_end(&mut response);
    let response = String::from_utf8_lossy(&response);
    let status = response.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    let body = response.split_once("\r\n\r\n").map(|(_, b)| b).unwrap_or_default();
    (status, serde_json::from_str(body).unwrap_or(Value::Null))
}

/// Whether `etcd` can run here; else the one skip line.
fn etcd_available() -> bool {
    let found = Command::new("etcd").arg("--version").stdout(Stdio::null()).stderr(Stdio::null()).status();
    if found.is_ok_and(|s| s.success()) {
        return true;
    }
    eprintln!("skip: no etcd on PATH (tests/run installs Debian's etcd-server)");
    false
}

/// A member of the test's etcd cluster.
struct Member {
    name: String,
    client: u16,
    peer: u16,
    child: Option<Child>,
}

/// A three-member etcd cluster on loopback, its data in a temporary directory; killed when dropped.
struct Etcd {
    dir: tempfile::TempDir,
    members: Vec<Member>,
}

impl Etcd {
    fn start(size: usize) -> Etcd {
        let dir = tempfile::tempdir().expect("tempdir");
        let members: Vec<Member> = (0..size)
            .map(|i| Member { name: format!("etcd{i}"), client: free_port(), peer: free_port(), child: None })
            .collect();
        let mut etcd = Etcd { dir, members };
        for i in 0..size {
            etcd.launch(i, "new");
        }
        etcd.wait_healthy(Duration::from_secs(30));
        etcd
    }

    fn initial_cluster(&self) -> String {
        let each: Vec<String> =
            self.members.iter().map(|m| format!("{}=http://127.0.0.1:{}", m.name, m.peer)).collect();
        each.join(",")
    }

    fn launch(&mut self, i: usize, state: &str) {
        let cluster = self.initial_cluster();
        let member = &self.members[i];
        let data = self.dir.path().join(&member.name);
        let log = std::fs::File::create(self.dir.path().join(format!("{}.log", member.name))).expect("log");
        let child = Command::new("etcd")
            .args(["--name", &member.name, "--data-dir"])
            .arg(&data)
            .args([
                "--listen-client-urls",
                &format!("http://127.0.0.1:{}", member.client),
                "--advertise-client-urls",
                &format!("http://127.0.0.1:{}", member.client),
                "--listen-peer-urls",
                &format!("http://127.0.0.1:{}", member.peer),
                "--initial-advertise-peer-urls",
                &format!("http://127.0.0.1:{}", member.peer),
                "--initial-cluster",
                &cluster,
                "--initial-cluster-state",
                state,
                "--initial-cluster-token",
                "strata-fleet-test",
                "--heartbeat-interval",
                "50",
                "--election-timeout",
                "500",
            ])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn etcd");
        self.members[i].child = Some(child);
    }

    fn endpoints(&self) -> String {
        let each: Vec<String> = self.members.iter().map(|m| format!("http://127.0.0.1:{}", m.client)).collect();
        each.join(",")
    }

    /// Waits until a quorum answers a write.
    fn wait_healthy(&self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            let ok = Command::new("etcdctl")
                .env("ETCDCTL_API", "3")
                .args(["--endpoints", &self.endpoints(), "--command-timeout=1s", "put", "/health-probe", "1"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success());
            if ok {
                return;
            }
            assert!(Instant::now() < deadline, "etcd did not become healthy: {}", self.logs());
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    fn kill(&mut self, i: usize) {
        if let Some(mut child) = self.members[i].child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    fn restart(&mut self, i: usize) {
        self.launch(i, "existing");
    }

    fn logs(&self) -> String {
        let mut out = String::new();
        for m in &self.members {
            let text = std::fs::read_to_string(self.dir.path().join(format!("{}.log", m.name))).unwrap_or_default();
            let tail: Vec<&str> = text.lines().rev().take(5).collect();
            out.push_str(&format!("\n{}: {}", m.name, tail.join("\n  ")));
        }
        out
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        for i in 0..self.members.len() {
            self.kill(i);
        }
    }
}

/// A `strata serve` node of the fleet.
struct Node {
    addr: String,
    child: Option<Child>,
    log: Arc<Mutex<String>>,
}

impl Node {
    fn start(name: &str, etcd: &Etcd) -> Node {
        Node::start_on(name, etcd, free_port())
    }

    fn start_on(name: &str, etcd: &Etcd, port: u16) -> Node {
        let addr = format!("127.0.0.1:{port}");
        let mut child = Command::new(env!("CARGO_BIN_EXE_strata"))
            .args(["serve", "--listen", &addr, "--cluster", &etcd.endpoints(), "--node", name])
            .args(["--advertise", &format!("http://{addr}"), "--lease-ttl", "3s"])
            // Two vCPU slots a node (this host's two CPUs, one slot each): capacity runs out after a few.
            .args(["--cpu-overcommit", "1"])
            .env_remove("RUST_LOG")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn strata serve");
        let log = Arc::new(Mutex::new(String::new()));
        let stderr = child.stderr.take().expect("stderr");
        let sink = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                sink.lock().expect("log").push_str(&format!("{line}\n"));
            }
        });
        let node = Node { addr, child: Some(child), log };
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if TcpStream::connect(&node.addr).is_ok() && request(&node.addr, "GET", "/health", &Value::Null).0 == 204 {
                return node;
            }
            assert!(Instant::now() < deadline, "node {name} did not start: {}", node.log());
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn log(&self) -> String {
        self.log.lock().expect("log").clone()
    }

    fn port(&self) -> u16 {
        self.addr.rsplit_once(':').and_then(|(_, p)| p.parse().ok()).expect("port")
    }

    fn get(&self, path: &str) -> (u16, Value) {
        request(&self.addr, "GET", path, &Value::Null)
    }

    fn post(&self, path: &str, body: Value) -> (u16, Value) {
        request(&self.addr, "POST", path, &body)
    }

    fn create(&self) -> (u16, Value) {
        self.post("/v1/sandboxes", json!({"tier": "wasm", "ttl": 120}))
    }

    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        if let Some(child) = &self.child {
            let _ = Command::new("kill").args(["-TERM", &child.id().to_string()]).status();
        }
        if let Some(mut child) = self.child.take() {
            let deadline = Instant::now() + Duration::from_secs(20);
            while child.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// `node`'s sandboxes count in `GET /v1/nodes` as one node answers it.
fn placed(nodes: &Value, node: &str) -> u64 {
    nodes["nodes"]
        .as_array()
        .and_then(|all| all.iter().find(|n| n["name"] == node))
        .map_or(0, |n| n["sandboxes"].as_u64().unwrap_or(0))
}

fn code(body: &Value) -> &str {
    body["error"]["code"].as_str().unwrap_or("")
}

#[test]
fn creates_spread_by_capacity_and_any_node_answers_for_any_sandbox() {
    if !etcd_available() {
        return;
    }
    let etcd = Etcd::start(3);
    let nodes = [Node::start("n1", &etcd), Node::start("n2", &etcd), Node::start("n3", &etcd)];
    let (status, list) = nodes[2].get("/v1/nodes");
    assert_eq!(status, 200, "{list}");
    assert_eq!(list["node"], "n3");
    let names: Vec<&str> = list["nodes"].as_array().expect("nodes").iter().filter_map(|n| n["name"].as_str()).collect();
    assert_eq!(names, ["n1", "n2", "n3"], "{list}");
    let slots = list["nodes"][0]["cpus"].as_u64().unwrap_or(0);

    // Every create goes through n1; first-fit by name fills n1, then n2, then n3.
    let mut ids = Vec::new();
    for _ in 0..3 * slots {
        let (status, body) = nodes[0].create();
        assert_eq!(status, 201, "{body}\n{}", nodes[0].log());
        ids.push(body["id"].as_str().expect("id").to_owned());
    }
    let (status, body) = nodes[0].create();
    assert_eq!((status, code(&body)), (503, "capacity_exhausted"), "{body}");
    let (_, list) = nodes[1].get("/v1/nodes");
    for node in ["n1", "n2", "n3"] {
        assert_eq!(placed(&list, node), slots, "{node}: {list}");
    }

    // The last sandbox is on n3: through n1 and n2, one interpreter keeps its state.
    let last = ids.last().expect("ids");
    let exec = format!("/v1/sandboxes/{last}/exec");
    let (status, outcome) = nodes[0].post(&exec, json!({"python": "x = 41"}));
    assert_eq!(status, 200, "{outcome}");
    let (status, outcome) = nodes[1].post(&exec, json!({"python": "print(x + 1)"}));
    assert_eq!((status, outcome["stdout"].as_str()), (200, Some("42\n")), "{outcome}");
    let (status, info) = nodes[0].get(&format!("/v1/sandboxes/{last}"));
    assert_eq!((status, info["id"].as_str()), (200, Some(last.as_str())), "{info}");

    // A WebSocket job through a node that does not hold the sandbox.
    let ws = websocket_job(&nodes[0].addr, last, "print(x * 2)");
    assert!(ws.contains("82"), "{ws}");

    // Deleting through another node frees the room on the owner: a create fits again.
    let first = &ids[0];
    let (status, _) = request(&nodes[2].addr, "DELETE", &format!("/v1/sandboxes/{first}"), &Value::Null);
    assert_eq!(status, 204);
    let (status, body) = nodes[1].get(&format!("/v1/sandboxes/{first}"));
    assert_eq!((status, code(&body)), (404, "sandbox_not_found"), "{body}");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (status, body) = nodes[2].create();
        if status == 201 {
            break;
        }
        assert!(Instant::now() < deadline, "the freed slot was never placed again: {body}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn a_killed_node_loses_its_sandboxes_within_its_lease_and_rejoins_cleanly() {
    if !etcd_available() {
        return;
    }
    let etcd = Etcd::start(3);
    let n1 = Node::start("n1", &etcd);
    let mut n2 = Node::start("n2", &etcd);
    // Fill n1 so the next sandbox goes to n2.
    let (_, list) = n1.get("/v1/nodes");
    let slots = list["nodes"][0]["cpus"].as_u64().unwrap_or(0);
    for _ in 0..slots {
        assert_eq!(n1.create().0, 201);
    }
    let (status, body) = n1.create();
    assert_eq!(status, 201, "{body}");
    let on_n2 = body["id"].as_str().expect("id").to_owned();
    let (_, list) = n1.get("/v1/nodes");
    assert_eq!(placed(&list, "n2"), 1, "{list}");

    let port = n2.port();
    let killed = Instant::now();
    n2.kill();
    // Within the 3 s lease (and a margin for etcd's expiry): lost, typed, never a hang.
    let deadline = killed + Duration::from_secs(8);
    loop {
        let (status, body) = n1.get(&format!("/v1/sandboxes/{on_n2}"));
        if (status, code(&body)) == (410, "sandbox_lost") {
            break;
        }
        assert!(Instant::now() < deadline, "never lost: {status} {body}");
        std::thread::sleep(Duration::from_millis(200));
    }
    eprintln!("sandbox_lost {} ms after the SIGKILL", killed.elapsed().as_millis());
    let (_, list) = n1.get("/v1/nodes");
    let n2_state = list["nodes"].as_array().and_then(|a| a.iter().find(|n| n["name"] == "n2")).cloned();
    assert_eq!(n2_state.as_ref().map(|n| n["state"].clone()), Some(json!("lost")), "{list}");
    // New creates avoid it: n1 is full and n2 is out, so none fits.
    let (status, body) = n1.create();
    assert_eq!((status, code(&body)), (503, "capacity_exhausted"), "{body}");

    // It comes back on the same address: its old sandbox is gone for good (not found, no longer lost), and it
    // takes placements again.
    let n2 = Node::start_on("n2", &etcd, port);
    let (status, body) = n1.get(&format!("/v1/sandboxes/{on_n2}"));
    assert_eq!((status, code(&body)), (404, "sandbox_not_found"), "{body}");
    let (status, body) = n1.create();
    assert_eq!(status, 201, "{body}\n{}", n2.log());
    let (_, list) = n2.get("/v1/nodes");
    assert_eq!(placed(&list, "n2"), 1, "{list}");
}

#[test]
fn with_etcd_down_to_one_member_nodes_serve_what_they_hold_and_refuse_placements() {
    if !etcd_available() {
        return;
    }
    let mut etcd = Etcd::start(3);
    let n1 = Node::start("n1", &etcd);
    let n2 = Node::start("n2", &etcd);
    let (status, body) = n1.create();
    assert_eq!(status, 201, "{body}");
    let id = body["id"].as_str().expect("id").to_owned();
    let exec = format!("/v1/sandboxes/{id}/exec");

    // One member down: a quorum is left, the fleet goes on.
    etcd.kill(2);
    let (status, body) = n2.create();
    assert_eq!(status, 201, "{body}");
    let (status, outcome) = n2.post(&exec, json!({"python": "print('through n2')"}));
    assert_eq!((status, outcome["stdout"].as_str()), (200, Some("through n2\n")), "{outcome}");

    // Two down: no quorum. A node keeps serving what it holds, refuses placements with a typed error.
    etcd.kill(1);
    let (status, outcome) = n1.post(&exec, json!({"python": "print('still here')"}));
    assert_eq!((status, outcome["stdout"].as_str()), (200, Some("still here\n")), "{outcome}");
    let (status, body) = n1.create();
    assert_eq!((status, code(&body)), (503, "fleet_unavailable"), "{body}");

    // etcd recovers, and so does placement.
    etcd.restart(1);
    etcd.restart(2);
    etcd.wait_healthy(Duration::from_secs(30));
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (status, body) = n2.create();
        if status == 201 {
            break;
        }
        assert!(Instant::now() < deadline, "placement never recovered: {status} {body}\n{}", n2.log());
        std::thread::sleep(Duration::from_millis(250));
    }
    let (status, outcome) = n2.post(&exec, json!({"python": "print('after')"}));
    assert_eq!((status, outcome["stdout"].as_str()), (200, Some("after\n")), "{outcome}");
}

/// Runs `code` in sandbox `id` over the exec WebSocket of the node at `addr`; every text message received.
fn websocket_job(addr: &str, id: &str, code: &str) -> String {
    let mut stream = TcpStream::connect(addr).expect("connect");
    stream.set_read_timeout(Some(Duration::from_secs(30))).expect("timeout");
    let head = format!(
        "GET /v1/sandboxes/{id}/exec/ws HTTP/1.1\r\nHost: {addr}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
         Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
    );
    stream.write_all(head.as_bytes()).expect("handshake");
    let mut reader = BufReader::new(stream.try_clone().expect("clone"));
    let mut status = String::new();
    reader.read_line(&mut status).expect("status");
    assert!(status.contains(" 101 "), "{status}");
    loop {
        let mut line = String::new();
        reader.read_line(&mut line).expect("header");
        if line == "\r\n" {
            break;
        }
    }
    // One masked text frame with the job.
    let payload = json!({"python": code}).to_string().into_bytes();
    let mut frame = vec![0x81u8];
    let mask = [1u8, 2, 3, 4];
    if payload.len() < 126 {
        frame.push(0x80 | payload.len() as u8);
    } else {
        frame.push(0x80 | 126);
        frame.extend_from_slice(&(payload.len() as u16).to_be_bytes());
    }
    frame.extend_from_slice(&mask);
    frame.extend(payload.iter().enumerate().map(|(i, b)| b ^ mask[i % 4]));
    stream.write_all(&frame).expect("send frame");
    let mut texts = String::new();
    loop {
        let mut head = [0u8; 2];
        if reader.read_exact(&mut head).is_err() {
            break;
        }
        let mut len = u64::from(head[1] & 0x7f);
        if len == 126 {
            let mut ext = [0u8; 2];
            reader.read_exact(&mut ext).expect("len");
            len = u64::from(u16::from_be_bytes(ext));
        } else if len == 127 {
            let mut ext = [0u8; 8];
            reader.read_exact(&mut ext).expect("len");
            len = u64::from_be_bytes(ext);
        }
        let mut data = vec![0u8; usize::try_from(len).expect("len")];
        reader.read_exact(&mut data).expect("payload");
        match head[0] & 0x0f {
            0x1 => texts.push_str(&format!("{}\n", String::from_utf8_lossy(&data))),
            0x8 => break,
            _ => {}
        }
    }
    texts
}
