//! The native API's endpoints, happy paths and errors.

use serde_json::{Value, json};

use crate::util::{TestServer, code, process_tier};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_openapi_and_metrics_are_served() {
    let server = TestServer::start().await;
    let response = server.client.get(server.url("/health")).send().await.expect("health");
    assert_eq!(response.status().as_u16(), 204);
    assert!(response.headers().contains_key("x-request-id"));
    let (status, doc) = server.get("/v1/openapi.json").await;
    assert_eq!(status, 200);
    assert!(doc["openapi"].as_str().is_some_and(|v| v.starts_with('3')), "{doc}");
    for path in ["/v1/sandboxes", "/v1/sandboxes/{id}/exec", "/v1/run", "/v1/snapshots/{id}/fork"] {
        assert!(doc["paths"].get(path).is_some(), "openapi lacks {path}");
    }
    assert!(doc["components"]["schemas"].get("CreateSandboxRequest").is_some());
    let text = server.client.get(server.url("/metrics")).send().await.expect("metrics").text().await.expect("text");
    assert!(text.contains("# TYPE strata_jobs_total counter"), "{text}");
    assert!(text.contains("strata_sandboxes_active{tier=\"wasm\"} 0"), "{text}");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wasm_sandbox_create_exec_list_get_delete() {
    let server = TestServer::start().await;
    let id = server.create(json!({"tier": "wasm", "ttl": 60, "capabilities": {"env": {"GREETING": "hi"}}})).await;
    let (status, list) = server.get("/v1/sandboxes").await;
    assert_eq!(status, 200);
    assert!(list["sandboxes"].as_array().expect("list").iter().any(|s| s["id"] == id.as_str()), "{list}");
    let (status, info) = server.get(&format!("/v1/sandboxes/{id}")).await;
    assert_eq!((status, info["tier"].as_str()), (200, Some("wasm")), "{info}");
    assert!(info["expires_at"].as_u64() > info["created_at"].as_u64());

    // One interpreter across jobs: state persists.
    let exec = format!("/v1/sandboxes/{id}/exec");
    let (status, outcome) =
        server.post(&exec, json!({"python": "import os\nx = 41\nprint(os.environ['GREETING'])"})).await;
    assert_eq!(status, 200, "{outcome}");
    assert_eq!(outcome["status"], json!({"kind": "exited", "code": 0}), "{outcome}");
    assert_eq!(outcome["stdout"], "hi\n");
    assert_eq!(outcome["tier"], "wasm");
    assert!(outcome["usage"]["wall_ms"].is_number() && outcome["truncated"].is_object(), "{outcome}");
    let (_, outcome) = server.post(&exec, json!({"python": "print(x + 1)"})).await;
    assert_eq!(outcome["stdout"], "42\n", "{outcome}");
    // A wasm Python session's turn reads the stdin it brings.
    let (status, outcome) =
        server.post(&exec, json!({"python": "import sys\nprint(sys.stdin.read())", "stdin": "abc"})).await;
    assert_eq!((status, outcome["stdout"].as_str()), (200, Some("abc\n")), "{outcome}");

    // The Outcome is the engine's own serde: it deserializes back into strata_core::Outcome.
    let (_, outcome) = server.post(&exec, json!({"python": "raise SystemExit(3)"})).await;
    let parsed: strata_core::Outcome = serde_json::from_value(outcome.clone()).expect("an Outcome");
    assert_eq!(parsed.status, strata_core::Status::Exited { code: 3 }, "{outcome}");

    assert_eq!(server.delete(&format!("/v1/sandboxes/{id}")).await, 204);
    let (status, body) = server.get(&format!("/v1/sandboxes/{id}")).await;
    assert_eq!((status, code(&body)), (404, "sandbox_not_found"));
    assert_eq!(server.delete(&format!("/v1/sandboxes/{id}")).await, 404);
    let metrics = server.client.get(server.url("/metrics")).send().await.expect("m").text().await.expect("t");
    assert!(metrics.contains("strata_jobs_total{tier=\"wasm\",outcome=\"ok\"} 3"), "{metrics}");
    assert!(metrics.contains("strata_jobs_total{tier=\"wasm\",outcome=\"nonzero\"} 1"), "{metrics}");
    assert!(metrics.contains("strata_operation_duration_seconds_count{tier=\"wasm\",op=\"exec\"} 4"), "{metrics}");
    server.stop().await;
}

/// A sandbox is one interpreter on one tier for its life: one `auto` put on wasm refuses a job that needs the native
/// tier (409 `session_tier`, naming it) and keeps its state; one asked for on wasm runs numpy there, and says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_session_never_splits_across_tiers() {
    let server = TestServer::start().await;
    let id = server.create(json!({"tier": "auto", "ttl": 60})).await;
    let exec = format!("/v1/sandboxes/{id}/exec");
    let (status, outcome) = server.post(&exec, json!({"python": "x = 41"})).await;
    assert_eq!((status, outcome["tier"].as_str()), (200, Some("wasm")), "{outcome}");
    let (status, body) =
        server.post(&exec, json!({"python": "import numpy as np\nprint(np.arange(10**6).sum())"})).await;
    assert_eq!((status, code(&body)), (409, "session_tier"), "{body}");
    assert!(body["error"]["message"].as_str().is_some_and(|m| m.contains("process tier")), "{body}");
    let (_, outcome) = server.post(&exec, json!({"python": "print(x + 1)"})).await;
    assert_eq!(outcome["stdout"], "42\n", "{outcome}");
    assert_eq!(server.delete(&format!("/v1/sandboxes/{id}")).await, 204);
    let id = server.create(json!({"tier": "wasm", "ttl": 60})).await;
    let exec = format!("/v1/sandboxes/{id}/exec");
    let (status, outcome) =
        server.post(&exec, json!({"python": "import numpy as np\nprint(np.arange(10**6).sum())"})).await;
    assert_eq!((status, outcome["stdout"].as_str()), (200, Some("1783293664\n")), "{outcome}");
    assert_eq!(outcome["platform"], "wasm32", "{outcome}");
    assert_eq!(server.delete(&format!("/v1/sandboxes/{id}")).await, 204);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_shot_run_returns_the_routed_outcome() {
    let server = TestServer::start().await;
    let (status, outcome) = server.post("/v1/run", json!({"job": {"python": "print(6 * 7)"}})).await;
    assert_eq!(status, 200, "{outcome}");
    assert_eq!(outcome["stdout"], "42\n");
    let job = json!({"job": {"python": "import sys\nprint(sys.stdin.read().upper())", "stdin": "abc"}});
    let (_, outcome) = server.post("/v1/run", job).await;
    assert_eq!(outcome["stdout"], "ABC\n", "{outcome}");
    assert_eq!(outcome["route"]["tier"], "wasm", "{outcome}");
    let (status, outcome) = server
        .post("/v1/run", json!({"tier": "wasm", "job": {"python": "while True: pass", "limits": {"wall": "300ms"}}}))
        .await;
    assert_eq!(status, 200, "{outcome}");
    assert_eq!(outcome["status"], json!({"kind": "limit_exceeded", "limit": "wall"}), "{outcome}");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_typed_errors() {
    let server = TestServer::start().await;
    let cases: Vec<(&str, Value, u16, &str)> = vec![
        ("/v1/sandboxes/sb_nope/exec", json!({"python": "1"}), 404, "sandbox_not_found"),
        ("/v1/sandboxes", json!({"tier": "mainframe"}), 400, "unknown_tier"),
        ("/v1/sandboxes", json!({"colour": "blue"}), 400, "invalid_request"),
        ("/v1/sandboxes", json!({"ttl": 0}), 400, "invalid_ttl"),
        ("/v1/sandboxes", json!({"limits": {"wall": "100h"}}), 400, "limit_too_high"),
        ("/v1/sandboxes", json!({"limits": {"wall": "soon"}}), 400, "invalid_request"),
        ("/v1/sandboxes", json!({"capabilities": {"grants": ["/tmp:/data"]}}), 403, "grants_not_allowed"),
        ("/v1/sandboxes", json!({"capabilities": {"env": {"A=B": "x"}}}), 400, "invalid_capability"),
        ("/v1/sandboxes", json!({"capabilities": {"allow_net": ["exa mple.com"]}}), 400, "invalid_capability"),
        ("/v1/sandboxes", json!({"snapshot": "snap_nope"}), 404, "snapshot_not_found"),
        ("/v1/run", json!({"job": {}}), 400, "invalid_job"),
        ("/v1/run", json!({"job": {"python": "1", "command": ["ls"]}}), 400, "invalid_job"),
        ("/v1/run", json!({"tier": "wasm", "job": {"command": ["ls"]}}), 400, "wrong_job"),
        ("/v1/snapshots/snap_nope/fork", json!({"count": 1}), 404, "snapshot_not_found"),
        ("/v1/sandboxes/sb_nope/timeout", json!({"timeout": 5}), 404, "sandbox_not_found"),
        ("/v1/sandboxes/sb_nope/snapshot", json!({}), 404, "sandbox_not_found"),
    ];
    for (path, body, status, expected) in cases {
        let (got, json) = server.post(path, body.clone()).await;
        assert_eq!((got, code(&json)), (status, expected), "POST {path} {body}: {json}");
        assert!(json["error"]["message"].as_str().is_some_and(|m| !m.is_empty()), "{json}");
    }
    // Malformed JSON and a missing content type.
    let response = server
        .client
        .post(server.url("/v1/sandboxes"))
        .header("content-type", "application/json")
        .body("{not json")
        .send()
        .await
        .expect("request");
    let (status, json) = crate::util::status_json(response).await;
    assert_eq!((status, code(&json)), (400, "invalid_json"), "{json}");
    let response = server.client.post(server.url("/v1/sandboxes")).body("{}").send().await.expect("request");
    let (status, json) = crate::util::status_json(response).await;
    assert_eq!((status, code(&json)), (415, "unsupported_media_type"), "{json}");
    let (status, json) = server.get("/v1/nothing-here").await;
    assert_eq!((status, code(&json)), (404, "not_found"));
    let (status, json) = server.get("/v1/sandboxes/sb_nope/files?path=/x").await;
    assert_eq!((status, code(&json)), (404, "sandbox_not_found"));
    let id = server.create(json!({"tier": "wasm"})).await;
    let (status, json) = server.get(&format!("/v1/sandboxes/{id}/files")).await;
    assert_eq!((status, code(&json)), (400, "invalid_query"), "{json}");
    let (status, json) = server.post(&format!("/v1/sandboxes/{id}/exec"), json!({"command": ["ls"]})).await;
    assert_eq!((status, code(&json)), (400, "wrong_job"), "{json}");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn process_sandbox_runs_commands_and_moves_files() {
    if !process_tier("process_sandbox_runs_commands_and_moves_files") {
        return;
    }
    let server = TestServer::start().await;
    let id = server.create(json!({"tier": "process", "capabilities": {"secrets": {"TOKEN": "hunter2"}}})).await;
    let exec = format!("/v1/sandboxes/{id}/exec");
    let (status, outcome) = server.post(&exec, json!({"command": ["sh", "-c", "echo hi; echo $TOKEN"]})).await;
    assert_eq!(status, 200, "{outcome}");
    assert_eq!(outcome["stdout"], "hi\n[REDACTED:TOKEN]\n", "{outcome}");
    assert_eq!(outcome["tier"], "process");
    let (_, outcome) = server.post(&exec, json!({"command": ["sh", "-c", "exit 3"]})).await;
    assert_eq!(outcome["status"], json!({"kind": "exited", "code": 3}), "{outcome}");

    let file = server.url(&format!("/v1/sandboxes/{id}/files?path=/tmp/a.txt"));
    let response = server.client.put(&file).body(b"x\x00y".to_vec()).send().await.expect("put");
    assert_eq!(response.status().as_u16(), 204);
    let response = server.client.get(&file).send().await.expect("get");
    assert_eq!(response.status().as_u16(), 200);
    assert_eq!(response.headers()["content-type"], "application/octet-stream");
    assert_eq!(response.bytes().await.expect("bytes").as_ref(), b"x\x00y");
    let (_, outcome) = server.post(&exec, json!({"command": ["wc", "-c", "/tmp/a.txt"]})).await;
    assert_eq!(outcome["stdout"], "3 /tmp/a.txt\n", "{outcome}");
    let (_, _) = server.post(&exec, json!({"command": ["sh", "-c", "echo made > /tmp/b.txt"]})).await;
    let response =
        server.client.get(server.url(&format!("/v1/sandboxes/{id}/files?path=/tmp/b.txt"))).send().await.expect("get");
    assert_eq!(response.text().await.expect("text"), "made\n");
    let (status, json) = server.get(&format!("/v1/sandboxes/{id}/files?path=/tmp/missing")).await;
    assert_eq!(status, 404, "{json}");
    let (status, list) = server.get(&format!("/v1/sandboxes/{id}/files/list?path=/tmp")).await;
    assert_eq!(status, 200, "{list}");
    assert!(
        list["entries"].as_array().expect("entries").contains(&json!({"name": "a.txt", "type": "file", "size": 3}))
    );
    let (status, json) = server.get(&format!("/v1/sandboxes/{id}/files/list?path=/nope")).await;
    assert_eq!((status, code(&json)), (404, "guest_path"), "{json}");
    let (status, json) = server.get(&format!("/v1/sandboxes/{id}/files/list?path=tmp")).await;
    assert_eq!((status, code(&json)), (400, "invalid_query"), "{json}");

    let (status, outcome) =
        server.post("/v1/run", json!({"tier": "process", "job": {"command": ["uname", "-s"]}})).await;
    assert_eq!((status, outcome["stdout"].as_str()), (200, Some("Linux\n")), "{outcome}");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshot_forks_are_independent_copies() {
    let server = TestServer::start().await;
    let id = server.create(json!({"tier": "wasm"})).await;
    let (status, _) = server.post(&format!("/v1/sandboxes/{id}/exec"), json!({"python": "x = 5"})).await;
    assert_eq!(status, 200);
    let (status, snap) = server.post(&format!("/v1/sandboxes/{id}/snapshot"), json!({})).await;
    assert_eq!(status, 201, "{snap}");
    let snap_id = snap["id"].as_str().expect("snapshot id").to_owned();
    assert_eq!((snap["tier"].as_str(), snap["source"].as_str()), (Some("wasm"), Some(id.as_str())));
    let (status, list) = server.get("/v1/snapshots").await;
    assert_eq!((status, list["snapshots"].as_array().map(Vec::len)), (200, Some(1)));

    let (status, forks) = server.post(&format!("/v1/snapshots/{snap_id}/fork"), json!({"count": 2})).await;
    assert_eq!(status, 201, "{forks}");
    let forks: Vec<String> = forks["sandboxes"]
        .as_array()
        .expect("forks")
        .iter()
        .map(|f| f["id"].as_str().expect("id").to_owned())
        .collect();
    assert_eq!(forks.len(), 2);
    let (_, outcome) =
        server.post(&format!("/v1/sandboxes/{}/exec", forks[0]), json!({"python": "x += 1\nprint(x)"})).await;
    assert_eq!(outcome["stdout"], "6\n", "{outcome}");
    let (_, outcome) = server.post(&format!("/v1/sandboxes/{}/exec", forks[1]), json!({"python": "print(x)"})).await;
    assert_eq!(outcome["stdout"], "5\n", "{outcome}");
    let (_, outcome) = server.post(&format!("/v1/sandboxes/{id}/exec"), json!({"python": "print(x)"})).await;
    assert_eq!(outcome["stdout"], "5\n", "{outcome}");
    // A sandbox can start from a snapshot too.
    let from = server.create(json!({"snapshot": snap_id})).await;
    let (_, outcome) = server.post(&format!("/v1/sandboxes/{from}/exec"), json!({"python": "print(x * 2)"})).await;
    assert_eq!(outcome["stdout"], "10\n", "{outcome}");
    let (status, json) = server.post(&format!("/v1/snapshots/{snap_id}/fork"), json!({"count": 0})).await;
    assert_eq!((status, code(&json)), (400, "invalid_count"));

    // A live sandbox forks in one call (through a snapshot it returns).
    let (status, live) = server.post(&format!("/v1/sandboxes/{id}/fork"), json!({"count": 2})).await;
    assert_eq!(status, 201, "{live}");
    assert_eq!(live["snapshot"]["source"], id.as_str());
    for fork in live["sandboxes"].as_array().expect("forks") {
        let fork = fork["id"].as_str().expect("id");
        let (_, outcome) = server.post(&format!("/v1/sandboxes/{fork}/exec"), json!({"python": "print(x)"})).await;
        assert_eq!(outcome["stdout"], "5\n", "{outcome}");
    }
    // Listing a wasm session's directory (its private /tmp) is the tier's own method: nothing runs in the session,
    // whose names stay as they were.
    let exec = format!("/v1/sandboxes/{id}/exec");
    let (_, _) = server.post(&exec, json!({"python": "open('/tmp/n.txt', 'w').write('abcd')"})).await;
    let (status, list) = server.get(&format!("/v1/sandboxes/{id}/files/list?path=/tmp")).await;
    assert_eq!(status, 200, "{list}");
    let entries = list["entries"].as_array().expect("entries");
    assert!(entries.contains(&json!({"name": "n.txt", "type": "file", "size": 4})), "{list}");
    let (status, json) = server.get(&format!("/v1/sandboxes/{id}/files/list?path=/nope")).await;
    assert_eq!((status, code(&json)), (404, "guest_path"), "{json}");
    let (_, outcome) = server.post(&exec, json!({"python": "print(sorted(n for n in dir() if 'strata' in n))"})).await;
    assert_eq!(outcome["stdout"], "[]\n", "{outcome}");

    assert_eq!(server.delete(&format!("/v1/snapshots/{snap_id}")).await, 204);
    assert_eq!(server.delete(&format!("/v1/snapshots/{snap_id}")).await, 404);
    let dir = server.state.snapshot_dir.clone();
    server.stop().await;
    assert!(!dir.exists(), "the server's snapshot directory {} is removed at shutdown", dir.display());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_to_a_sandbox_running_a_job_is_409_busy() {
    let server = TestServer::start().await;
    let id = server.create(json!({"tier": "wasm"})).await;
    let (client, url) = (server.client.clone(), server.url(&format!("/v1/sandboxes/{id}/exec")));
    let long = tokio::spawn(async move {
        // Long enough that a loaded machine cannot finish it between the check below and the second request.
        let response = client.post(url).json(&json!({"python": "import time\ntime.sleep(5)\nprint('done')"})).send();
        crate::util::status_json(response.await.expect("exec")).await
    });
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while server.get(&format!("/v1/sandboxes/{id}")).await.1["running"] != true {
        assert!(std::time::Instant::now() < deadline, "the first job never ran");
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    let (status, json) = server.post(&format!("/v1/sandboxes/{id}/exec"), json!({"python": "print(1)"})).await;
    assert_eq!((status, code(&json)), (409, "sandbox_busy"), "{json}");
    let (status, outcome) = long.await.expect("first job");
    assert_eq!((status, outcome["stdout"].as_str()), (200, Some("done\n")), "{outcome}");
    // Free again afterwards.
    let (status, outcome) = server.post(&format!("/v1/sandboxes/{id}/exec"), json!({"python": "print(2)"})).await;
    assert_eq!((status, outcome["stdout"].as_str()), (200, Some("2\n")), "{outcome}");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_sandbox_serves_requests_while_a_job_runs() {
    if !process_tier("a_process_sandbox_serves_requests_while_a_job_runs") {
        return;
    }
    let server = TestServer::start().await;
    let id = server.create(json!({"tier": "process"})).await;
    let (client, url) = (server.client.clone(), server.url(&format!("/v1/sandboxes/{id}/exec")));
    // Waits for a file that only a later request writes.
    let waiter = "while [ ! -e /tmp/go ]; do sleep 0.02; done; echo went $(cat /tmp/go)";
    let long = tokio::spawn(async move {
        let response = client.post(url).json(&json!({"command": ["sh", "-c", waiter]})).send();
        crate::util::status_json(response.await.expect("exec")).await
    });
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let (_, info) = server.get(&format!("/v1/sandboxes/{id}")).await;
        if info["jobs_running"] == 1 {
            assert_eq!((info["running"].as_bool(), info["concurrent"].as_bool()), (Some(true), Some(true)), "{info}");
            break;
        }
        assert!(std::time::Instant::now() < deadline, "the first job never ran: {info}");
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    let exec = format!("/v1/sandboxes/{id}/exec");
    let (status, outcome) = server.post(&exec, json!({"command": ["echo", "beside"]})).await;
    assert_eq!((status, outcome["stdout"].as_str()), (200, Some("beside\n")), "{outcome}");
    // A snapshot is taken between jobs only.
    let (status, json) = server.post(&format!("/v1/sandboxes/{id}/snapshot"), json!({})).await;
    assert_eq!((status, code(&json)), (409, "sandbox_busy"), "{json}");
    let file = server.url(&format!("/v1/sandboxes/{id}/files?path=/tmp/go"));
    let response = server.client.put(&file).body(b"now".to_vec()).send().await.expect("put");
    assert_eq!(response.status().as_u16(), 204);
    let (status, outcome) = long.await.expect("first job");
    assert_eq!((status, outcome["stdout"].as_str()), (200, Some("went now\n")), "{outcome}");
    let (_, info) = server.get(&format!("/v1/sandboxes/{id}")).await;
    assert_eq!(info["jobs_running"], 0, "{info}");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_runs_at_most_max_jobs_at_once() {
    if !process_tier("a_sandbox_runs_at_most_max_jobs_at_once") {
        return;
    }
    let server = TestServer::start().await;
    let id = server.create(json!({"tier": "process"})).await;
    let max = strata_serve::registry::MAX_JOBS;
    let mut jobs = Vec::new();
    for _ in 0..max {
        let (client, url) = (server.client.clone(), server.url(&format!("/v1/sandboxes/{id}/exec")));
        jobs.push(tokio::spawn(async move {
            let response = client.post(url).json(&json!({"command": ["sleep", "30"]})).send();
            crate::util::status_json(response.await.expect("exec")).await
        }));
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while server.get(&format!("/v1/sandboxes/{id}")).await.1["jobs_running"] != max {
        assert!(std::time::Instant::now() < deadline, "the jobs never all ran");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let (status, json) = server.post(&format!("/v1/sandboxes/{id}/exec"), json!({"command": ["true"]})).await;
    assert_eq!((status, code(&json)), (429, "too_many_jobs"), "{json}");
    // Deleting the sandbox ends them all.
    assert_eq!(server.delete(&format!("/v1/sandboxes/{id}")).await, 204);
    for job in jobs {
        let (status, json) = job.await.expect("job");
        assert_ne!(status, 200, "{json}");
    }
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_sample_a_sandboxs_cpu_memory_and_disk_over_time() {
    if !crate::util::process_tier("metrics_sample_a_sandboxs_cpu_memory_and_disk_over_time") {
        return;
    }
    let server = TestServer::start().await;
    let id = server.create(json!({"tier": "process"})).await;
    let (status, first) = server.get(&format!("/v1/sandboxes/{id}/metrics")).await;
    assert_eq!(status, 200, "{first}");
    // A fixed amount of work (its CPU time whatever else runs on the host) and 16 MiB written.
    let script =
        "i=0; while [ $i -lt 300000 ]; do i=$((i+1)); done; dd if=/dev/zero of=/tmp/big bs=1M count=16 2>/dev/null";
    let (status, outcome) =
        server.post(&format!("/v1/sandboxes/{id}/exec"), json!({"command": ["/bin/sh", "-c", script]})).await;
    assert_eq!(status, 200);
    let job_cpu = outcome["usage"]["cpu_ms"].as_f64().expect("cpu_ms");
    let (_, metrics) = server.get(&format!("/v1/sandboxes/{id}/metrics")).await;
    let samples = metrics["samples"].as_array().expect("samples");
    assert!(samples.len() >= 2, "one sample per request at least: {metrics}");
    let (before, after) = (&first["samples"][0], &samples[samples.len() - 1]);
    let number = |v: &serde_json::Value, key: &str| v[key].as_f64().unwrap_or_else(|| panic!("{key} in {v}"));
    // The sandbox's CPU time holds the job's (measured on its own cgroup, inside the sandbox's).
    assert!(job_cpu >= 50.0, "{outcome}");
    assert!(number(after, "cpu_time_ms") >= number(before, "cpu_time_ms") + job_cpu * 0.9, "{before} {after}");
    assert!(number(after, "cpu_used_pct") > 0.0 && number(after, "cpu_used_pct") <= 100.0, "{after}");
    assert!(number(after, "disk_used") >= number(before, "disk_used") + 15.0 * 1048576.0, "{before} {after}");
    assert!(number(after, "memory_used") <= number(after, "memory_total"), "{after}");
    let later = number(after, "timestamp") + 1.0;
    let (_, none) = server.get(&format!("/v1/sandboxes/{id}/metrics?start={later}")).await;
    assert_eq!(none["samples"].as_array().map(Vec::len), Some(0), "{none}");
    let wasm = server.create(json!({"tier": "wasm"})).await;
    let (status, answer) = server.get(&format!("/v1/sandboxes/{wasm}/metrics")).await;
    assert_eq!((status, crate::util::code(&answer)), (501, "unsupported"), "{answer}");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_sandbox_keeps_its_files_under_its_id_until_resumed_or_deleted() {
    if !crate::util::process_tier("a_paused_sandbox_keeps_its_files_under_its_id_until_resumed_or_deleted") {
        return;
    }
    let server = TestServer::start().await;
    let (status, created) = server.post("/v1/sandboxes", json!({"tier": "process"})).await;
    assert_eq!(status, 201, "{created}");
    let id = created["id"].as_str().expect("id").to_owned();
    let (status, out) =
        server.post(&format!("/v1/sandboxes/{id}/exec"), json!({"command": ["sh", "-c", "echo kept > /tmp/k"]})).await;
    assert_eq!(status, 200, "{out}");
    let (status, paused) = server.post(&format!("/v1/sandboxes/{id}/pause"), json!({})).await;
    assert_eq!((status, paused["id"].as_str()), (200, Some(id.as_str())), "{paused}");
    assert_eq!(server.state.registry.list(None).len(), 0, "a paused sandbox holds no place");
    let (status, refused) = server.post(&format!("/v1/sandboxes/{id}/exec"), json!({"command": ["true"]})).await;
    assert_eq!((status, code(&refused)), (409, "sandbox_paused"), "{refused}");
    let (status, again) = server.post(&format!("/v1/sandboxes/{id}/pause"), json!({})).await;
    assert_eq!((status, code(&again)), (409, "sandbox_paused"), "{again}");
    let (_, listed) = server.get("/v1/sandboxes").await;
    assert_eq!(listed["paused"][0]["id"], json!(id), "{listed}");
    let (status, resumed) = server.post(&format!("/v1/sandboxes/{id}/resume"), json!({"ttl": 60})).await;
    assert_eq!((status, resumed["id"].as_str()), (200, Some(id.as_str())), "{resumed}");
    let (status, out) = server.post(&format!("/v1/sandboxes/{id}/exec"), json!({"command": ["cat", "/tmp/k"]})).await;
    assert_eq!((status, out["stdout"].as_str()), (200, Some("kept\n")), "{out}");
    // Paused again, then deleted: its snapshot goes with it.
    let dirs = || std::fs::read_dir(&server.state.snapshot_dir).map(|d| d.count()).unwrap_or(0);
    let (status, _) = server.post(&format!("/v1/sandboxes/{id}/pause"), json!({})).await;
    assert_eq!((status, dirs()), (200, 1));
    assert_eq!(server.delete(&format!("/v1/sandboxes/{id}")).await, 204);
    assert_eq!(dirs(), 0, "the paused sandbox's snapshot was removed");
    let (status, gone) = server.post(&format!("/v1/sandboxes/{id}/resume"), json!({})).await;
    assert_eq!((status, code(&gone)), (404, "sandbox_not_found"), "{gone}");
    // One holding secrets could not be resumed (their values are never on disk): refused, and it runs on.
    let body = json!({"tier": "process", "capabilities": {"secrets": {"TOKEN": "s3cret"}}});
    let (_, created) = server.post("/v1/sandboxes", body).await;
    let id = created["id"].as_str().expect("id").to_owned();
    let (status, refused) = server.post(&format!("/v1/sandboxes/{id}/pause"), json!({})).await;
    assert_eq!((status, code(&refused)), (400, "unsupported"), "{refused}");
    assert_eq!(dirs(), 0, "its snapshot was not kept");
    let (status, out) = server.post(&format!("/v1/sandboxes/{id}/exec"), json!({"command": ["true"]})).await;
    assert_eq!(status, 200, "{out}");
    server.stop().await;
}
