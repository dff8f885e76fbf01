//! A fleet: three `strata serve` nodes and a three-member etcd cluster (Debian's `etcd-server`, started here on
//! loopback ports), as processes. Creates through one node spread by capacity; any node answers for any sandbox
//! (exec, files, a WebSocket job, the operations API); a SIGKILLed node's sandboxes are `sandbox_lost` within its
//! lease's TTL and it rejoins cleanly; with one etcd member down the fleet goes on, with two it refuses new
//! placements (a typed error) while every node keeps serving what it holds, and recovers when etcd does. A fleet
//! over mutual TLS works the same through any node and refuses a rogue (another CA's certificate) everywhere.

use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use strata_benches::fleet::{Etcd, Node, Pki, etcd_available, request, websocket_job};

/// Node `name` of the fleet on `etcd`: a 3 s lease, and two vCPU slots (this host's two CPUs, one slot each), so
/// capacity runs out after a few sandboxes.
fn node(name: &str, etcd: &Etcd) -> Node {
    Node::start(strata(), name, etcd, NODE_ARGS)
}

const NODE_ARGS: &[&str] = &["--lease-ttl", "3s", "--cpu-overcommit", "1"];

fn strata() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_strata"))
}

/// `node`'s sandboxes count in `GET /v1/nodes` as one node answers it.
fn placed(nodes: &Value, node: &str) -> u64 {
    nodes["nodes"]
        .as_array()
        .and_then(|all| all.iter().find(|n| n["name"] == node))
        .map_or(0, |n| n["sandboxes"].as_u64().unwrap_or(0))
}

/// The node's `/metrics` text.
fn metrics(addr: &str) -> String {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(addr).expect("connect");
    let head = format!("GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    stream.write_all(head.as_bytes()).expect("send");
    let mut response = String::new();
    stream.read_to_string(&mut response).expect("read");
    response.split_once("\r\n\r\n").map(|(_, body)| body.to_owned()).unwrap_or_default()
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
    let nodes = [node("n1", &etcd), node("n2", &etcd), node("n3", &etcd)];
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

    // n1's figures count what it forwarded and placed.
    let metrics = metrics(&nodes[0].addr);
    for line in [
        "strata_fleet_registered{node=\"n1\"} 1",
        &format!("strata_fleet_placements_total{{node=\"n1\",result=\"here\"}} {slots}"),
        &format!("strata_fleet_placements_total{{node=\"n1\",result=\"elsewhere\"}} {}", 2 * slots),
        // The first exec and the GET above.
        "strata_fleet_forwarded_total{node=\"n1\"} 2",
    ] {
        assert!(metrics.lines().any(|l| l == line), "{line} in\n{metrics}");
    }

    // A WebSocket job through a node that does not hold the sandbox.
    let ws = websocket_job(&nodes[0].addr, last, "print(x * 2)");
    assert!(ws.contains("82"), "{ws}");

    // Deleting through another node frees the room on the owner: a create fits again.
    let first = &ids[0];
    let (status, _) = request(&nodes[2].addr, "DELETE", &format!("/v1/sandboxes/{first}"), &Value::Null);
    assert_eq!(status, 204);
    let (status, body) = nodes[1].get(&format!("/v1/sandboxes/{first}"));
    assert_eq!((status, code(&body)), (404, "sandbox_not_found"), "{body}");
    // The freed room on n1 takes a fork asked of n3 for n1's other sandbox: made on n1, in the catalog, so n2
    // reaches it too, and counted in n1's alloc.
    let on_n1 = &ids[1];
    let (status, forks) = nodes[2].post(&format!("/v1/sandboxes/{on_n1}/fork"), json!({"count": 1}));
    assert_eq!(status, 201, "{forks}");
    let fork = forks["sandboxes"][0]["id"].as_str().expect("fork id").to_owned();
    let (status, outcome) = nodes[1].post(&format!("/v1/sandboxes/{fork}/exec"), json!({"python": "print('forked')"}));
    assert_eq!((status, outcome["stdout"].as_str()), (200, Some("forked\n")), "{outcome}");
    let (_, list) = nodes[1].get("/v1/nodes");
    assert_eq!(placed(&list, "n1"), slots, "the fork counts on n1: {list}");
    let (status, body) = nodes[0].create();
    assert_eq!((status, code(&body)), (503, "capacity_exhausted"), "full again: {body}");
}

#[test]
fn a_killed_node_loses_its_sandboxes_within_its_lease_and_rejoins_cleanly() {
    if !etcd_available() {
        return;
    }
    let etcd = Etcd::start(3);
    let n1 = node("n1", &etcd);
    let mut n2 = node("n2", &etcd);
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
    let n2 = Node::start_on(strata(), "n2", &etcd, port, NODE_ARGS);
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
    // A longer lease than the other tests': the outage and the election after it take a few seconds under load.
    let args = ["--lease-ttl", "8s", "--cpu-overcommit", "1"];
    let n1 = Node::start(strata(), "n1", &etcd, &args);
    let n2 = Node::start(strata(), "n2", &etcd, &args);
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

/// The serial of the certificate a TLS server at `addr` presents now (`openssl s_client`), or of a PEM file.
fn serial(addr: Option<&str>, ca: &Path, file: Option<&Path>) -> String {
    use std::io::Write;
    use std::process::{Command, Stdio};
    let pem = match (addr, file) {
        (Some(addr), _) => {
            let out = Command::new("openssl")
                .args(["s_client", "-connect", addr, "-CAfile"])
                .arg(ca)
                .stdin(Stdio::null())
                .stderr(Stdio::null())
                .output()
                .expect("s_client");
            out.stdout
        }
        (None, Some(file)) => std::fs::read(file).expect("read"),
        (None, None) => unreachable!("an address or a file"),
    };
    let mut x509 = Command::new("openssl")
        .args(["x509", "-noout", "-serial"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("x509");
    x509.stdin.take().expect("stdin").write_all(&pem).expect("pem");
    String::from_utf8_lossy(&x509.wait_with_output().expect("x509").stdout).trim().to_owned()
}

#[test]
fn a_fleet_over_mutual_tls_answers_through_any_node_and_refuses_a_rogue_everywhere() {
    if !etcd_available() {
        return;
    }
    let (pki, rogue) = (Pki::new("strata fleet CA"), Pki::new("rogue CA"));
    let etcd = Etcd::start_tls(1, &pki);
    let n1_identity = pki.issue("n1");
    let n1 = Node::start_with(strata(), "n1", &etcd, &n1_identity, &pki.ca(), NODE_ARGS);
    let n2 = Node::start_tls(strata(), "n2", &etcd, &pki, NODE_ARGS);
    assert!(n1.log().contains("strata serve listening"), "{}", n1.log());
    assert!(!n1.log().contains("without TLS"), "a fleet over mutual TLS says nothing of running without: {}", n1.log());

    // A create through n1 lands on n1 (first fit by name); n2 forwards to it over mutual TLS.
    let (status, created) = n1.create();
    assert_eq!(status, 201, "{created}\n{}", n1.log());
    let id = created["id"].as_str().expect("id").to_owned();
    let exec = format!("/v1/sandboxes/{id}/exec");
    let (status, outcome) = n2.post(&exec, json!({"python": "print(6 * 7)"}));
    assert_eq!((status, outcome["stdout"].as_str()), (200, Some("42\n")), "{outcome}\n{}", n2.log());

    // Plain HTTP to a TLS node gets no answer.
    assert_eq!(request(&n1.addr, "GET", "/health", &Value::Null).0, 0);
    // A client (no certificate) saying it is a node is refused, on a forward and on a placement alike.
    let (status, body) =
        n2.request_with("POST", &exec, &json!({"python": "print(1)"}), &["-H", "x-strata-fleet-hop: n1"]);
    assert_eq!((status, code(&body)), (403, "not_a_node"), "{body}");
    let forged = ["-H", "x-strata-fleet-hop: n1", "-H", "x-strata-fleet-placed: sbx-forged"];
    let (status, body) = n2.request_with("POST", "/v1/sandboxes", &json!({"tier": "wasm"}), &forged);
    assert_eq!((status, code(&body)), (403, "not_a_node"), "{body}");
    // A client certificate of another CA fails the handshake, at a node and at etcd.
    let intruder = rogue.issue("intruder");
    let (cert, key) = (intruder.cert.display().to_string(), intruder.key.display().to_string());
    let (status, body) = n1.request_with("GET", "/health", &Value::Null, &["--cert", &cert, "--key", &key]);
    assert_eq!(status, 0, "a rogue certificate was accepted: {body}");

    // A rogue node: with the rogue CA it cannot verify etcd; with the fleet's CA file but its own certificate,
    // etcd refuses it. Neither joins, so none is ever placed on or forwarded to.
    for (ca, why) in [(rogue.ca(), "rogue CA"), (pki.ca(), "fleet CA, rogue certificate")] {
        let args: Vec<String> = vec![
            "--cluster".into(),
            etcd.endpoints(),
            "--node".into(),
            "rogue".into(),
            "--advertise".into(),
            "https://127.0.0.1:1".into(),
            "--tls-cert".into(),
            intruder.cert.display().to_string(),
            "--tls-key".into(),
            intruder.key.display().to_string(),
            "--fleet-ca".into(),
            ca.display().to_string(),
        ];
        match Node::try_start(strata(), "rogue", &args, &ca) {
            Ok(_) => panic!("a rogue node ({why}) joined the fleet"),
            Err(log) => assert!(log.contains("cannot join the fleet"), "{why}: {log}"),
        }
    }
    let (_, nodes) = n2.get("/v1/nodes");
    let names: Vec<&str> =
        nodes["nodes"].as_array().expect("nodes").iter().filter_map(|n| n["name"].as_str()).collect();
    assert_eq!(names, ["n1", "n2"], "{nodes}");

    // n1's certificate is replaced on disk: new connections get the new one, without a restart, and n1 goes on
    // placing (its etcd connection is made again with it) and being forwarded to.
    let before = serial(Some(&n1.addr), &pki.ca(), None);
    assert_eq!(before, serial(None, &pki.ca(), Some(&n1_identity.cert)));
    let renewed = pki.issue("n1");
    std::fs::copy(&renewed.key, &n1_identity.key).expect("key");
    std::fs::copy(&renewed.cert, &n1_identity.cert).expect("cert");
    let wanted = serial(None, &pki.ca(), Some(&renewed.cert));
    assert_ne!(before, wanted);
    let deadline = Instant::now() + Duration::from_secs(15);
    while serial(Some(&n1.addr), &pki.ca(), None) != wanted {
        assert!(Instant::now() < deadline, "the certificate was not reloaded: {}", n1.log());
        std::thread::sleep(Duration::from_millis(200));
    }
    let deadline = Instant::now() + Duration::from_secs(15);
    while !n1.log().contains("etcd reconnected") {
        assert!(Instant::now() < deadline, "etcd was not reconnected: {}", n1.log());
        std::thread::sleep(Duration::from_millis(200));
    }
    let (status, created) = n1.create();
    assert_eq!(status, 201, "{created}\n{}", n1.log());
    let second = created["id"].as_str().expect("id");
    let (status, outcome) = n2.post(&format!("/v1/sandboxes/{second}/exec"), json!({"python": "print('renewed')"}));
    assert_eq!((status, outcome["stdout"].as_str()), (200, Some("renewed\n")), "{outcome}");
}

#[test]
fn snapshots_are_reachable_from_every_node_and_a_full_holder_has_its_snapshot_fetched() {
    if !etcd_available() {
        return;
    }
    let etcd = Etcd::start(1);
    let mut n1 = node("n1", &etcd);
    let n2 = node("n2", &etcd);
    let (_, list) = n1.get("/v1/nodes");
    let slots = list["nodes"][0]["cpus"].as_u64().unwrap_or(0);
    assert!(slots >= 2, "{list}");
    // A sandbox on n1 with state, snapshotted through n2 (forwarded to n1, which records it in etcd).
    let (status, body) = n1.create();
    assert_eq!(status, 201, "{body}");
    let source = body["id"].as_str().expect("id").to_owned();
    let (status, outcome) = n1.post(&format!("/v1/sandboxes/{source}/exec"), json!({"python": "x = 41"}));
    assert_eq!(status, 200, "{outcome}");
    let (status, snap) = n2.post(&format!("/v1/sandboxes/{source}/snapshot"), json!({}));
    assert_eq!(status, 201, "{snap}");
    let snap = snap["id"].as_str().expect("snapshot id").to_owned();
    // Its manifest, through the node that does not hold it.
    let (status, manifest) = n2.get(&format!("/v1/snapshots/{snap}/manifest"));
    assert_eq!((status, manifest["format"].as_u64()), (200, Some(2)), "{manifest}");
    assert!(!manifest["files"].as_array().expect("files").is_empty(), "{manifest}");

    // A fork asked of n2 goes to the holder while it has room: made on n1, no copy.
    let fork = |node: &Node| {
        let (status, body) = node.post(&format!("/v1/snapshots/{snap}/fork"), json!({"count": 1}));
        (status, body["sandboxes"][0]["id"].as_str().unwrap_or_default().to_owned(), body)
    };
    let check = |node: &Node, id: &str| {
        let (status, outcome) = node.post(&format!("/v1/sandboxes/{id}/exec"), json!({"python": "print(x + 1)"}));
        assert_eq!((status, outcome["stdout"].as_str()), (200, Some("42\n")), "{outcome}");
    };
    let mut on_n1 = 1;
    while on_n1 < slots {
        let (status, id, body) = fork(&n2);
        assert_eq!(status, 201, "{body}\n{}", n1.log());
        check(&n2, &id);
        on_n1 += 1;
    }
    let (_, list) = n2.get("/v1/nodes");
    assert_eq!((placed(&list, "n1"), placed(&list, "n2")), (slots, 0), "{list}");
    assert!(!n2.log().contains("fetched a copy"), "{}", n2.log());
    // n1 is full: n2 fetches the snapshot, checks it against its manifest, and forks it itself.
    let (status, id, body) = fork(&n2);
    assert_eq!(status, 201, "{body}\n{}", n2.log());
    check(&n1, &id);
    let (_, list) = n2.get("/v1/nodes");
    assert_eq!((placed(&list, "n1"), placed(&list, "n2")), (slots, 1), "{list}");
    assert!(n2.log().contains("fetched a copy of the snapshot"), "{}", n2.log());
    // A second fork there uses the copy.
    let (status, id, body) = fork(&n2);
    assert_eq!(status, 201, "{body}");
    check(&n2, &id);
    assert_eq!(n2.log().matches("fetched a copy of the snapshot").count(), 1, "{}", n2.log());

    // Deleted through n2: gone from n1, and n2's copy forks no more.
    let (status, _) = n2.request("DELETE", &format!("/v1/snapshots/{snap}"), &Value::Null);
    assert_eq!(status, 204);
    for node in [&n2, &n1] {
        let (status, _, body) = fork(node);
        assert_eq!((status, code(&body)), (404, "snapshot_not_found"), "{body}");
    }

    // A snapshot whose node is killed is lost on the others, typed.
    let (status, outcome) = n1.post(&format!("/v1/sandboxes/{source}/snapshot"), json!({}));
    assert_eq!(status, 201, "{outcome}");
    let second = outcome["id"].as_str().expect("id").to_owned();
    n1.kill();
    let deadline = Instant::now() + Duration::from_secs(8);
    loop {
        let (status, body) = n2.get(&format!("/v1/snapshots/{second}/manifest"));
        if (status, code(&body)) == (410, "snapshot_lost") {
            break;
        }
        assert!(Instant::now() < deadline, "never lost: {status} {body}");
        std::thread::sleep(Duration::from_millis(200));
    }
}
