//! Many sandboxes at once: every result accounted for, nothing leaked.

use std::time::Instant;

use serde_json::json;

use crate::util::{TestServer, fd_count, process_tier};

async fn many_sandboxes(tier: &str, sandboxes: usize, jobs: usize) {
    let server = TestServer::with(|config| config.max_sandboxes = sandboxes).await;
    // Warm the tier once so that its first start is not counted as a leak.
    let warm = server.create(json!({"tier": tier})).await;
    assert_eq!(server.delete(&format!("/v1/sandboxes/{warm}")).await, 204);
    let fds_before = fd_count();
    let started = Instant::now();
    let mut tasks = Vec::new();
    for n in 0..sandboxes {
        let client = reqwest::Client::new();
        let base = server.base.clone();
        let tier = tier.to_owned();
        tasks.push(tokio::spawn(async move {
            let response = client.post(format!("{base}/v1/sandboxes")).json(&json!({"tier": tier})).send().await?;
            anyhow::ensure!(response.status() == 201, "create: {}", response.text().await?);
            let info: serde_json::Value = response.json().await?;
            let id = info["id"].as_str().unwrap_or_default().to_owned();
            let mut outputs = Vec::new();
            for j in 0..jobs {
                let job = if tier == "wasm" {
                    json!({"python": format!("print({n} * 100 + {j})")})
                } else {
                    json!({"command": ["sh", "-c", format!("echo $(({n} * 100 + {j}))")]})
                };
                let response = client.post(format!("{base}/v1/sandboxes/{id}/exec")).json(&job).send().await?;
                anyhow::ensure!(response.status() == 200, "exec: {}", response.text().await?);
                let outcome: serde_json::Value = response.json().await?;
                outputs.push(outcome["stdout"].as_str().unwrap_or_default().trim().to_owned());
            }
            let status = client.delete(format!("{base}/v1/sandboxes/{id}")).send().await?.status();
            anyhow::ensure!(status == 204, "delete: {status}");
            Ok::<_, anyhow::Error>((n, outputs))
        }));
    }
    for task in tasks {
        let (n, outputs) = task.await.expect("task").expect("sandbox round");
        let expected: Vec<String> = (0..jobs).map(|j| (n * 100 + j).to_string()).collect();
        assert_eq!(outputs, expected, "sandbox {n}");
    }
    let took = started.elapsed();
    eprintln!(
        "{sandboxes} {tier} sandboxes × {jobs} jobs in parallel: {took:?}; create p50/p99 {:?}, exec p50/p99 {:?}",
        server.state.metrics.percentiles(static_tier(tier), "create"),
        server.state.metrics.percentiles(static_tier(tier), "exec"),
    );
    assert!(server.state.registry.list(None).is_empty());
    // Sockets of the finished clients close asynchronously; give them a moment.
    let mut fds_after = fd_count();
    for _ in 0..50 {
        if fds_after <= fds_before + 2 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        fds_after = fd_count();
    }
    assert!(fds_after <= fds_before + 2, "fds before {fds_before}, after {fds_after}");
    server.stop().await;
}

fn static_tier(tier: &str) -> &'static str {
    if tier == "wasm" { "wasm" } else { "process" }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_wasm_sandboxes_in_parallel() {
    many_sandboxes("wasm", 20, 3).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_process_sandboxes_in_parallel() {
    if !process_tier("twenty_process_sandboxes_in_parallel") {
        return;
    }
    many_sandboxes("process", 20, 3).await;
}
