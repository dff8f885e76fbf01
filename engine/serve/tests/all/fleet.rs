//! The official E2B SDK (Python, pinned) against a node of a fleet that does not hold its sandbox: the create is
//! placed on the other node and forwarded there, and every later call (commands over Connect streams, files,
//! kill) is forwarded to the owner, its answer unchanged. Two in-process nodes and a three-member etcd.

use std::time::Duration;

use serde_json::Value;
use strata_benches::fleet::{Etcd, etcd_available, free_port};
use strata_serve::fleet::FleetConfig;

use crate::e2b::{SDK_KEY, run_sdk_script, sdk_python};
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
    let metrics = n2.client.get(n2.url("/metrics")).send().await.expect("metrics").text().await.expect("text");
    assert!(metrics.contains("strata_sandboxes_created_total{tier=\"process\"} 1"), "{metrics}");
    assert!(n2.state.registry.list(None).is_empty(), "the SDK killed its sandbox on n2");
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
