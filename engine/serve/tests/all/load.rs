//! Many sandboxes at once: every result accounted for, nothing leaked.

use std::time::Instant;

use serde_json::json;

use crate::util::{TestServer, fd_count, process_tier};

/// What this process holds: fds, threads, child processes, mounts it sees.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Held {
    fds: usize,
    threads: usize,
    children: usize,
    mounts: usize,
    /// Resident memory in KiB (`VmRSS`), compared with a margin: allocators keep freed memory.
    rss_kib: u64,
}

fn held() -> Held {
    let count = |dir: &str| std::fs::read_dir(dir).map(|d| d.count()).unwrap_or(0);
    let me = std::process::id().to_string();
    let children = std::fs::read_dir("/proc")
        .map(|d| {
            d.filter_map(Result::ok)
                .filter(|e| e.file_name().to_string_lossy().bytes().all(|b| b.is_ascii_digit()))
                .filter(|e| {
                    std::fs::read_to_string(e.path().join("stat")).ok().is_some_and(|stat| {
                        // The field after the parenthesised command name: state, then ppid.
                        stat.rsplit_once(") ").and_then(|(_, rest)| rest.split(' ').nth(1)).is_some_and(|p| p == me)
                    })
                })
                .count()
        })
        .unwrap_or(0);
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").map(|m| m.lines().count()).unwrap_or(0);
    let rss_kib = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find_map(|l| l.strip_prefix("VmRSS:").and_then(|v| v.trim().trim_end_matches(" kB").parse().ok()))
        })
        .unwrap_or(0);
    Held { fds: fd_count(), threads: count("/proc/self/task"), children, mounts, rss_kib }
}

async fn many_sandboxes(tier: &str, sandboxes: usize, jobs: usize) {
    let server = TestServer::alone(|config| {
        config.max_sandboxes = sandboxes;
        // Room on any host for every sandbox at once, one-CPU hosts included: admission still runs, and counts.
        config.cpu_overcommit = u32::try_from(sandboxes).unwrap_or(u32::MAX);
    })
    .await;
    // Warm the tier once (its first job maps the runtime and starts its timer thread), so that this is not
    // counted as a leak.
    let warm = server.create(json!({"tier": tier})).await;
    let job = if tier == "wasm" { json!({"python": "print(1)"}) } else { json!({"command": ["true"]}) };
    let (status, outcome) = server.post(&format!("/v1/sandboxes/{warm}/exec"), job).await;
    assert_eq!(status, 200, "{outcome}");
    assert_eq!(server.delete(&format!("/v1/sandboxes/{warm}")).await, 204);
    let before = held();
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
    eprintln!("held before {before:?}");
    eprintln!(
        "{sandboxes} {tier} sandboxes × {jobs} jobs in parallel: {took:?}; create p50/p99 {:?}, exec p50/p99 {:?}",
        server.state.metrics.percentiles(static_tier(tier), "create"),
        server.state.metrics.percentiles(static_tier(tier), "exec"),
    );
    assert!(server.state.registry.list(None).is_empty());
    assert_eq!(server.state.registry.host_slots().map(|(used, _)| used), Some(0), "every CPU slot given back");
    // Sockets of the finished clients close and worker threads end asynchronously; give them a moment.
    let settled = |before: Held, after: Held| {
        after.fds <= before.fds + 2
            && after.threads <= before.threads + 2
            && after.children <= before.children
            && after.mounts <= before.mounts
            && after.rss_kib <= before.rss_kib + 128 * 1024
    };
    let mut after = held();
    for _ in 0..100 {
        if settled(before, after) {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        after = held();
    }
    eprintln!("held after {after:?}");
    assert!(settled(before, after), "held before {before:?}, after {after:?}");
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

/// The load figure: 200 sandboxes at once, each running a few commands.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_process_sandboxes_in_parallel() {
    if !process_tier("two_hundred_process_sandboxes_in_parallel") {
        return;
    }
    many_sandboxes("process", 200, 3).await;
}
