//! The official E2B SDK (Python, pinned) against a node of a fleet that does not hold its sandbox: the create is
//! placed on the other node and forwarded there, and every later call (commands over Connect streams, files,
//! kill) is forwarded to the owner, its answer unchanged. Two in-process nodes and a three-member etcd.
//!
//! And the fleet's TLS on its own: a node forwards only to a server whose certificate chains to the fleet CA, and
//! certificates reload when their files change (a broken replacement is not used).

use std::time::Duration;

use axum::body::Body;
use axum::extract::Request;
use serde_json::Value;
use strata_benches::fleet::{Etcd, Pki, etcd_available, free_port};
use strata_serve::fleet::{FleetConfig, proxy};
use strata_serve::tls::{Tls, TlsFiles};

use crate::e2b::{JS_PTY_SCRIPT, PTY_SCRIPT, SDK_KEY, both_sdks, run_sdk_script, sdk_python};
use crate::util::{TestServer, process_tier};

const FLEET_SCRIPT: &str = r#"
from e2b import Sandbox
sbx = Sandbox.create()
r = sbx.commands.run("echo hi; echo err >&2")
assert (r.stdout, r.stderr, r.exit_code) == ("hi\n", "err\n", 0), r
sbx.files.write("/tmp/a.txt", "through the fleet")
assert sbx.files.read("/tmp/a.txt") == "through the fleet"
assert sbx.commands.run("cat /tmp/a.txt").stdout == "through the fleet"
assert sbx.is_running()
sbx.kill()
print("FLEET OK")
"#;

/// Node `name` of the fleet on `etcd`, with the SDK's key.
async fn node(name: &str, etcd: &Etcd) -> TestServer {
    let port = free_port();
    let (endpoints, name) = (etcd.endpoints(), name.to_owned());
    TestServer::with(move |config| {
        config.listen = format!("127.0.0.1:{port}").parse().expect("addr");
        config.keys = Some(strata_serve::KeyStore::from_keys([("sdk", SDK_KEY, None)]));
        let urls = endpoints.split(',').map(str::to_owned).collect();
        config.fleet = Some(FleetConfig {
            lease_ttl: Duration::from_secs(3),
            ..FleetConfig::new(urls, &name, &format!("http://127.0.0.1:{port}"))
        });
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_e2b_sdk_works_through_a_node_that_does_not_hold_its_sandbox() {
    let test = "the_e2b_sdk_works_through_a_node_that_does_not_hold_its_sandbox";
    if !etcd_available() || !process_tier(test) {
        return;
    }
    let Some(python) = tokio::task::spawn_blocking(sdk_python).await.expect("setup") else { return };
    let etcd = tokio::task::spawn_blocking(|| Etcd::start(3)).await.expect("etcd");
    let n1 = node("n1", &etcd).await;
    let n2 = node("n2", &etcd).await;
    // n1 drains: whatever comes to it is placed on n2.
    let drained =
        n1.client.post(n1.url("/v1/nodes/n1/drain")).header("X-API-Key", SDK_KEY).send().await.expect("drain");
    assert_eq!(drained.status(), 200);
    let dir = tempfile::tempdir().expect("tempdir");
    run_sdk_script(&n1, &python, &["-c".as_ref(), FLEET_SCRIPT.as_ref()], dir.path(), "FLEET OK").await;
    // The sandbox lived on n2 (and the SDK killed it there).
    let created = |metrics: &str| {
        metrics
            .lines()
            .find_map(|l| l.strip_prefix("strata_sandboxes_created_total{tier=\"process\"} "))
            .and_then(|n| n.parse::<u64>().ok())
            .unwrap_or(0)
    };
    let metrics = n2.client.get(n2.url("/metrics")).send().await.expect("metrics").text().await.expect("text");
    assert_eq!(created(&metrics), 1, "{metrics}");
    assert!(n2.state.registry.list(None).is_empty(), "the SDK killed its sandbox on n2");
    // A terminal (E2B's PTY over Connect streams) through both SDKs, through n1 to sandboxes on n2.
    both_sdks(&n1, PTY_SCRIPT, "PTY OK", JS_PTY_SCRIPT, "pty.mjs", "JS PTY OK").await;
    let metrics = n2.client.get(n2.url("/metrics")).send().await.expect("metrics").text().await.expect("text");
    assert!(created(&metrics) >= 2, "the terminals ran on n2: {metrics}");
    assert!(n2.state.registry.list(None).is_empty(), "the SDKs killed their sandboxes on n2");
    let (status, nodes) = {
        let response = n2.client.get(n2.url("/v1/nodes")).header("X-API-Key", SDK_KEY).send().await.expect("nodes");
        (response.status().as_u16(), response.json::<Value>().await.expect("json"))
    };
    assert_eq!(status, 200);
    let drained = nodes["nodes"].as_array().and_then(|a| a.iter().find(|n| n["name"] == "n1")).cloned();
    assert_eq!(drained.map(|n| n["state"].clone()), Some(Value::from("draining")), "{nodes}");
    n1.stop().await;
    n2.stop().await;
    drop(etcd);
}

fn files(identity: &strata_benches::fleet::Identity, ca: std::path::PathBuf) -> TlsFiles {
    TlsFiles { cert: identity.cert.clone(), key: identity.key.clone(), fleet_ca: Some(ca) }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_forwards_only_to_a_server_whose_certificate_chains_to_the_fleet_ca() {
    let (pki, rogue) = (Pki::new("strata fleet CA"), Pki::new("rogue CA"));
    let ours = Tls::load(files(&pki.issue("n1"), pki.ca())).expect("load");
    let connector = ours.connector().expect("a fleet CA gives a connector");
    // A server with another CA's certificate (at an address the catalog might name) gets no request; a node's
    // gets it.
    for (identity, is_node) in [(rogue.issue("n2"), false), (pki.issue("n2"), true)] {
        let ca = pki.ca();
        let server = TestServer::with(move |config| config.tls = Some(files(&identity, ca))).await;
        let advertise = server.base.replace("http://", "https://");
        let request = Request::get("/health").body(Body::empty()).expect("request");
        let answer = proxy::forward("n1", &advertise, Some(&connector), None, request).await;
        match (answer, is_node) {
            (Ok(response), true) => assert_eq!(response.status(), 204),
            (Err(err), false) => assert!(err.to_string().contains("TLS"), "{err}"),
            (Ok(response), false) => panic!("a rogue certificate was accepted: {}", response.status()),
            (Err(err), true) => panic!("a node's certificate was refused: {err}"),
        }
        // Plain HTTP is not forwarded to an https:// node without a connector.
        let request = Request::get("/health").body(Body::empty()).expect("request");
        assert!(proxy::forward("n1", &advertise, None, None, request).await.is_err());
        server.stop().await;
    }
}

#[test]
fn certificates_reload_when_their_files_change_and_a_broken_replacement_is_kept_out() {
    let pki = Pki::new("strata fleet CA");
    let dir = tempfile::tempdir().expect("tempdir");
    let install = |identity: &strata_benches::fleet::Identity| {
        std::fs::copy(&identity.cert, dir.path().join("cert.pem")).expect("cert");
        std::fs::copy(&identity.key, dir.path().join("key.pem")).expect("key");
    };
    let first = pki.issue("n1");
    install(&first);
    let tls_files =
        TlsFiles { cert: dir.path().join("cert.pem"), key: dir.path().join("key.pem"), fleet_ca: Some(pki.ca()) };
    let tls = Tls::load(tls_files).expect("load");
    assert_eq!(tls.generation(), 1);
    assert!(!tls.reload_if_changed().expect("unchanged"), "nothing changed");
    // Not a certificate: refused, the one in use kept.
    std::fs::write(dir.path().join("cert.pem"), "not a certificate\n").expect("write");
    assert!(tls.reload_if_changed().is_err());
    assert_eq!(tls.generation(), 1);
    assert_eq!(tls.pem().cert, std::fs::read(&first.cert).expect("read"));
    // A certificate whose key is another's: refused too.
    let second = pki.issue("n1");
    std::fs::copy(&second.cert, dir.path().join("cert.pem")).expect("cert");
    let err = tls.reload_if_changed().expect_err("a key that does not match");
    assert!(err.to_string().contains("TLS configuration"), "{err}");
    assert_eq!(tls.generation(), 1);
    // The matching key arrives: the new pair is used.
    std::fs::copy(&second.key, dir.path().join("key.pem")).expect("key");
    assert!(tls.reload_if_changed().expect("reload"));
    assert_eq!(tls.generation(), 2);
    assert_eq!(tls.pem().cert, std::fs::read(&second.cert).expect("read"));
    // A key file over the size bound is refused before it is parsed.
    std::fs::write(dir.path().join("key.pem"), vec![b'A'; (1 << 20) + 1]).expect("write");
    let err = tls.reload_if_changed().expect_err("too large");
    assert!(err.to_string().contains("larger than"), "{err}");
    assert_eq!(tls.generation(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reservation_nobody_confirms_is_released_by_its_node() {
    if !etcd_available() {
        return;
    }
    let etcd = tokio::task::spawn_blocking(|| Etcd::start(1)).await.expect("etcd");
    let start = |name: &'static str| {
        let (endpoints, port) = (etcd.endpoints(), free_port());
        TestServer::with(move |config| {
            config.listen = format!("127.0.0.1:{port}").parse().expect("addr");
            config.fleet = Some(FleetConfig {
                lease_ttl: Duration::from_secs(3),
                reservation_sweep: Duration::from_millis(500),
                ..FleetConfig::new(vec![endpoints], name, &format!("http://127.0.0.1:{port}"))
            });
        })
    };
    let n1 = start("n1").await;
    let n2 = start("n2").await;
    // n1 places a sandbox on n2 and then never forwards it (a placer that died right after its reservation).
    let fleet = n1.state.fleet.clone().expect("a fleet");
    let request = [strata_fleet::SandboxRequest { id: "sb_orphan".into(), vcpus: 1, memory: 64 << 20 }];
    let plan = fleet.place(&request, &["n1".to_owned()].into_iter().collect()).await.expect("placed");
    assert_eq!(plan.node, "n2");
    let held = |view: &strata_fleet::View| view.allocs.get("n2").is_some_and(|a| a.value.entry("sb_orphan").is_some());
    assert!(held(&fleet.nodes().await.expect("nodes")), "reserved on n2");
    // n2 sees it reserved at one sweep and releases it at the next: its room and the catalog entry are free.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while held(&fleet.nodes().await.expect("nodes")) {
        assert!(std::time::Instant::now() < deadline, "the reservation was never released");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let kv = fleet.store().get(&fleet.protocol().sandbox_key("sb_orphan")).await.expect("get");
    assert!(kv.is_none(), "the catalog entry is gone: {kv:?}");
    n1.stop().await;
    n2.stop().await;
    drop(etcd);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forwarded_requests_reuse_an_idle_connection_to_their_node() {
    let server = TestServer::start().await;
    let pool = std::sync::Arc::new(proxy::Pool::default());
    let open = || server.state.connections.open();
    for round in 0..5 {
        // A client's `Connection: close` is its own connection's: the node's connection stays open.
        let request = Request::get("/health").header("connection", "close").body(Body::empty()).expect("request");
        let answer = proxy::forward("n1", &server.base, None, Some(&pool), request).await.expect("forwarded");
        assert_eq!(answer.status(), 204);
        // The connection goes back to the pool once its answer is done.
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while pool.idle_connections() != 1 && std::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(open(), 1, "round {round}: one connection, reused");
    }
    // Without a pool, each request has a connection of its own, closed after it.
    let request = Request::get("/health").body(Body::empty()).expect("request");
    proxy::forward("n1", &server.base, None, None, request).await.expect("forwarded");
    drop(pool);
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while open() != 0 && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(open(), 0, "dropping the pool closes its connections");
    server.stop().await;
}
