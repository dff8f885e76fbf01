//! Fleet figures, measured in one run beside their peers (run `benches/run.sh`; needs Debian's `etcd` and a
//! release `strata`):
//!
//! | name               | the fleet (three nodes, a three-member etcd)          | peer, same run                      |
//! |--------------------|-------------------------------------------------------|-------------------------------------|
//! | `create_local`     | create + delete through n1, placed on n1              | the same on one node without a fleet|
//! | `create_forwarded` | create + delete through n1, placed on n2 (n1 drains)  | the same on one node without a fleet|
//! | `creates_per_s`    | creates (+ deletes) per second through n1, 4 clients  | the same on one node without a fleet|
//! | `exec_hop`         | a job in n2's sandbox sent to n1 (one forwarding hop) | the same job sent to n2 directly    |
//! | `exec_hop_tls`     | the same over TLS, the hop over mutual TLS (two nodes) | the same job sent to n2 over TLS    |
//!
//! Sandboxes are wasm Python sessions (the cheapest to make, so the fleet's own cost shows); jobs are
//! `print(1)`. Nothing here asserts a time: the figures are for reading.
//!
//! Iterations per figure: `$STRATA_BENCH_ITERS`, else 300 (30 with `--quick`).

use std::path::Path;

use anyhow::Context;
use serde_json::{Value, json};
use strata_benches::fleet::{Etcd, Node, Pki, etcd_available, request};
use strata_benches::{Figures, find_strata, latency, ratio, throughput};

/// One create and delete of a wasm sandbox through `via`.
fn create_delete(via: &str) -> anyhow::Result<()> {
    let (status, body) = request(via, "POST", "/v1/sandboxes", &json!({"tier": "wasm", "ttl": 60}));
    anyhow::ensure!(status == 201, "create: {status} {body}");
    let id = body["id"].as_str().context("id")?;
    let (status, body) = request(via, "DELETE", &format!("/v1/sandboxes/{id}"), &Value::Null);
    anyhow::ensure!(status == 204, "delete: {status} {body}");
    Ok(())
}

/// One `print(1)` in sandbox `id` through `via`.
fn exec(via: &str, id: &str) -> anyhow::Result<()> {
    let (status, outcome) = request(via, "POST", &format!("/v1/sandboxes/{id}/exec"), &json!({"python": "print(1)"}));
    anyhow::ensure!(status == 200 && outcome["stdout"] == "1\n", "exec: {status} {outcome}");
    Ok(())
}

fn print_pair(name: &str, ours: &Figures, peer: &Figures, peer_name: &str) {
    ours.print(name);
    peer.print(peer_name);
    ratio(name, ours, peer, peer_name);
    println!(
        "{name:<26} added by the fleet: p50 {:+.0}us, p99 {:+.0}us",
        ours.p_us(0.5) - peer.p_us(0.5),
        ours.p_us(0.99) - peer.p_us(0.99)
    );
}

fn main() -> anyhow::Result<()> {
    let quick = std::env::args().any(|a| a == "--quick");
    let iters: usize = match std::env::var("STRATA_BENCH_ITERS") {
        Ok(n) => n.parse().context("STRATA_BENCH_ITERS")?,
        Err(_) if quick => 30,
        Err(_) => 300,
    };
    println!("# Strata fleet benchmarks ({} cores, {iters} runs per figure)", std::thread::available_parallelism()?);
    let Some(strata) = find_strata() else {
        println!("# fleet: skipped: no target/release/strata (benches/run.sh builds it)");
        return Ok(());
    };
    if !etcd_available() {
        return Ok(());
    }
    let strata: &Path = &strata;
    let etcd = Etcd::start(3);
    let nodes = [
        Node::start(strata, "n1", &etcd, &[]),
        Node::start(strata, "n2", &etcd, &[]),
        Node::start(strata, "n3", &etcd, &[]),
    ];
    let solo = Node::standalone(strata, &[]);
    let (n1, n2) = (nodes[0].addr.as_str(), nodes[1].addr.as_str());

    let solo_create = latency("create_solo", iters, || create_delete(&solo.addr))?;
    let local = latency("create_local", iters, || create_delete(n1))?;
    print_pair("create_local", &local, &solo_create, "one node, no fleet");
    let solo_rate = throughput(4, 3.0, || create_delete(&solo.addr))?;
    let fleet_rate = throughput(4, 3.0, || create_delete(n1))?;
    println!(
        "{:<26} creates/s, 4 clients: fleet {fleet_rate:.0}, one node {solo_rate:.0} ({:.2}x)",
        "creates_per_s",
        fleet_rate / solo_rate
    );

    // n1 drains: creates through it are placed on n2, the next by name, and forwarded there.
    let (status, body) = request(n1, "POST", "/v1/nodes/n1/drain", &Value::Null);
    anyhow::ensure!(status == 200, "drain: {status} {body}");
    let forwarded = latency("create_forwarded", iters, || create_delete(n1))?;
    print_pair("create_forwarded", &forwarded, &solo_create, "one node, no fleet");

    // A sandbox on n2: its jobs sent to n2, and through n1.
    let (status, body) = request(n1, "POST", "/v1/sandboxes", &json!({"tier": "wasm", "ttl": 600}));
    anyhow::ensure!(status == 201, "create: {status} {body}");
    let id = body["id"].as_str().context("id")?.to_owned();
    let direct = latency("exec_direct", iters, || exec(n2, &id))?;
    let hop = latency("exec_hop", iters, || exec(n1, &id))?;
    print_pair("exec_hop", &hop, &direct, "sent to the owner");
    drop(nodes);
    drop(etcd);

    // The same over TLS: clients to nodes over TLS, node to node and node to etcd over mutual TLS. Every request
    // is a new connection (a TLS handshake), and so is every forwarded one.
    let pki = Pki::new("strata bench fleet CA");
    let etcd = Etcd::start_tls(1, &pki);
    let t1 = Node::start_tls(strata, "n1", &etcd, &pki, &[]);
    let t2 = Node::start_tls(strata, "n2", &etcd, &pki, &[]);
    let (status, body) = t1.post("/v1/nodes/n1/drain", Value::Null);
    anyhow::ensure!(status == 200, "drain: {status} {body}");
    let (status, body) = t1.post("/v1/sandboxes", json!({"tier": "wasm", "ttl": 600}));
    anyhow::ensure!(status == 201, "create: {status} {body}");
    let id = body["id"].as_str().context("id")?.to_owned();
    let exec_tls = |node: &Node| {
        let (status, outcome) = node.post(&format!("/v1/sandboxes/{id}/exec"), json!({"python": "print(1)"}));
        anyhow::ensure!(status == 200 && outcome["stdout"] == "1\n", "exec: {status} {outcome}");
        Ok(())
    };
    let direct_tls = latency("exec_direct_tls", iters, || exec_tls(&t2))?;
    let hop_tls = latency("exec_hop_tls", iters, || exec_tls(&t1))?;
    print_pair("exec_hop_tls", &hop_tls, &direct_tls, "sent to the owner over TLS");
    ratio("exec_hop_tls", &hop_tls, &hop, "the hop without TLS");
    Ok(())
}
