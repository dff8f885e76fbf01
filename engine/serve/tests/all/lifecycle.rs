//! API keys and quotas, TTLs, graceful shutdown.

use std::time::{Duration, Instant};

use serde_json::json;
use strata_serve::{KeyStore, ServeConfig, ServeError, Server};

use crate::util::{TestServer, code, engine};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_authenticate_and_quotas_admit() {
    let server = TestServer::with(|config| {
        config.keys = Some(KeyStore::from_keys([("alice", "alice-key", Some(2)), ("bob", "bob-key", None)]));
    })
    .await;
    let create = |key: Option<&'static str>| {
        let mut request = server.client.post(server.url("/v1/sandboxes")).json(&json!({"tier": "wasm"}));
        if let Some(key) = key {
            request = request.bearer_auth(key);
        }
        async move { crate::util::status_json(request.send().await.expect("request")).await }
    };
    let (status, json) = create(None).await;
    assert_eq!((status, code(&json)), (401, "unauthorized"), "{json}");
    let (status, json) = create(Some("wrong")).await;
    assert_eq!((status, code(&json)), (401, "unauthorized"), "{json}");
    let (status, first) = create(Some("alice-key")).await;
    assert_eq!(status, 201, "{first}");
    let response = server
        .client
        .post(server.url("/v1/sandboxes"))
        .header("X-API-Key", "alice-key")
        .json(&json!({"tier": "wasm"}))
        .send()
        .await
        .expect("request");
    assert_eq!(response.status().as_u16(), 201, "X-API-Key works too");
    let (status, json) = create(Some("alice-key")).await;
    assert_eq!((status, code(&json)), (429, "quota_exceeded"), "{json}");
    assert!(json["error"]["message"].as_str().is_some_and(|m| m.contains("alice")), "{json}");

    // Bob sees none of Alice's sandboxes.
    let first = first["id"].as_str().expect("id");
    let response = server
        .client
        .get(server.url(&format!("/v1/sandboxes/{first}")))
        .bearer_auth("bob-key")
        .send()
        .await
        .expect("get");
    assert_eq!(response.status().as_u16(), 404);
    let response = server.client.get(server.url("/v1/sandboxes")).bearer_auth("bob-key").send().await.expect("list");
    let (_, list) = crate::util::status_json(response).await;
    assert_eq!(list["sandboxes"], json!([]));

    // Deleting one frees a place.
    let response = server
        .client
        .delete(server.url(&format!("/v1/sandboxes/{first}")))
        .bearer_auth("alice-key")
        .send()
        .await
        .expect("del");
    assert_eq!(response.status().as_u16(), 204);
    let (status, json) = create(Some("alice-key")).await;
    assert_eq!(status, 201, "{json}");

    let metrics = server.client.get(server.url("/metrics")).send().await.expect("m").text().await.expect("t");
    assert!(metrics.contains("strata_admission_rejections_total{reason=\"quota\"} 1"), "{metrics}");
    assert!(metrics.contains("strata_admission_rejections_total{reason=\"unauthorized\"} 2"), "{metrics}");
    assert!(metrics.contains("strata_sandboxes_active{tier=\"wasm\"} 2"), "{metrics}");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_keys_only_loopback_is_served() {
    let mut config = ServeConfig::new(strata_engine::EngineConfig::from_env().expect("config"));
    config.listen = "0.0.0.0:0".parse().expect("addr");
    let err = Server::bind_with_engine(engine(), config).await.expect_err("refused");
    assert!(matches!(err, ServeError::OpenNonLoopback(_)), "{err}");
    assert!(err.to_string().contains("--keys"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_sandboxes_are_reaped_and_timeouts_extend_them() {
    let server = TestServer::with(|config| config.reap_interval = Duration::from_millis(100)).await;
    let short = server.create(json!({"tier": "wasm", "ttl": 1})).await;
    let extended = server.create(json!({"tier": "wasm", "ttl": 1})).await;
    let (status, _) = server.post(&format!("/v1/sandboxes/{extended}/timeout"), json!({"timeout": 60})).await;
    assert_eq!(status, 204);
    let (status, json) = server.post(&format!("/v1/sandboxes/{extended}/timeout"), json!({"timeout": 0})).await;
    assert_eq!((status, code(&json)), (400, "invalid_ttl"));
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (status, _) = server.get(&format!("/v1/sandboxes/{short}")).await;
        if status == 404 {
            break;
        }
        assert!(Instant::now() < deadline, "the 1 s sandbox is still there after 10 s");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (status, _) = server.get(&format!("/v1/sandboxes/{extended}")).await;
    assert_eq!(status, 200, "the extended sandbox lives on");
    let metrics = server.client.get(server.url("/metrics")).send().await.expect("m").text().await.expect("t");
    assert!(metrics.contains("strata_sandboxes_active{tier=\"wasm\"} 1"), "{metrics}");
    assert!(metrics.contains("op=\"expire\""), "{metrics}");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_kills_running_jobs_and_refuses_new_work() {
    let server = TestServer::start().await;
    let id = server.create(json!({"tier": "wasm"})).await;
    let _idle = server.create(json!({"tier": "wasm"})).await;
    let client = server.client.clone();
    let exec_url = server.url(&format!("/v1/sandboxes/{id}/exec"));
    let running = tokio::spawn(async move {
        let response = client.post(exec_url).json(&json!({"python": "while True: pass"})).send().await;
        match response {
            Ok(response) => crate::util::status_json(response).await,
            Err(err) => (0, json!(err.to_string())),
        }
    });
    // Wait until the job runs.
    let deadline = Instant::now() + Duration::from_secs(20);
    while !server.state.registry.list(None).iter().any(|e| e.is_running()) {
        assert!(Instant::now() < deadline, "the job never started");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let state = server.state.clone();
    let started = Instant::now();
    server.stop().await;
    assert!(started.elapsed() < Duration::from_secs(10), "shutdown took {:?}", started.elapsed());
    let (status, body) = running.await.expect("exec task");
    // The running job was cancelled: its request got an answer, not a hang.
    assert!(status == 499 || status == 200 || status == 0, "{status} {body}");
    assert!(state.registry.list(None).is_empty(), "every sandbox is closed");
    assert!(state.draining());
    assert_eq!(state.admit().map_err(|e| (e.status.as_u16(), e.code)), Err((503, "shutting_down")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_sandboxes_are_reaped() {
    let server = TestServer::with(|config| {
        config.reap_interval = Duration::from_millis(100);
        config.idle_timeout = Some(Duration::from_millis(800));
    })
    .await;
    let idle = server.create(json!({"tier": "wasm", "ttl": 600})).await;
    let busy = server.create(json!({"tier": "wasm", "ttl": 600})).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        // Using a sandbox keeps it alive.
        let (status, _) = server.post(&format!("/v1/sandboxes/{busy}/exec"), json!({"python": "1"})).await;
        assert_eq!(status, 200, "the busy sandbox was reaped");
        let (status, _) = server.get(&format!("/v1/sandboxes/{idle}")).await;
        if status == 404 {
            break;
        }
        assert!(Instant::now() < deadline, "the idle sandbox is still there after 10 s");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_quota_and_budget_admit_by_memory_limits() {
    let dir = tempfile::tempdir().expect("tempdir");
    let keys = dir.path().join("keys.toml");
    let text = format!(
        "[[key]]\nname = \"small\"\nsha256 = \"{}\"\nmax_memory = \"1GiB\"\n\n[[key]]\nname = \"big\"\nsha256 = \"{}\"\n",
        strata_serve::hash_key("small-key"),
        strata_serve::hash_key("big-key")
    );
    std::fs::write(&keys, text).expect("keys file");
    let store = KeyStore::from_file(&keys).expect("keys parse");
    let server = TestServer::with(|config| {
        config.keys = Some(store);
        config.memory_budget = Some(7 << 28);
    })
    .await;
    let create = |key: &'static str, memory: &'static str| {
        let request = server
            .client
            .post(server.url("/v1/sandboxes"))
            .bearer_auth(key)
            .json(&json!({"tier": "wasm", "limits": {"memory": memory}}));
        async move { crate::util::status_json(request.send().await.expect("request")).await }
    };
    assert_eq!(create("small-key", "512MiB").await.0, 201);
    assert_eq!(create("small-key", "512MiB").await.0, 201);
    let (status, json) = create("small-key", "1MiB").await;
    assert_eq!((status, code(&json)), (429, "quota_exceeded"), "{json}");
    assert_eq!(create("big-key", "512MiB").await.0, 201);
    let (status, json) = create("big-key", "512MiB").await;
    assert_eq!((status, code(&json)), (429, "server_at_capacity"), "{json}");
    let metrics = server.client.get(server.url("/metrics")).send().await.expect("m").text().await.expect("t");
    assert!(metrics.contains(&format!("strata_memory_committed_bytes {}", 3u64 << 29)), "{metrics}");
    assert!(metrics.contains("strata_vcpus_committed 3"), "{metrics}");
    assert!(metrics.contains("strata_admission_rejections_total{reason=\"memory_quota\"} 1"), "{metrics}");
    assert!(metrics.contains("strata_admission_rejections_total{reason=\"memory_budget\"} 1"), "{metrics}");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admission_packs_sandboxes_onto_the_hosts_cpus_and_keeps_its_memory_floor() {
    let cpus = std::thread::available_parallelism().map_or(1, usize::from);
    // One vCPU slot per host CPU: `cpus` one-vCPU sandboxes fill the host.
    let server = TestServer::with(|config| config.cpu_overcommit = 1).await;
    let create = || {
        let request = server.client.post(server.url("/v1/sandboxes")).json(&json!({"tier": "wasm"}));
        async move { crate::util::status_json(request.send().await.expect("request")).await }
    };
    let mut ids = Vec::new();
    for i in 0..cpus {
        let (status, json) = create().await;
        assert_eq!(status, 201, "{json}");
        // First-fit: the i-th sandbox goes onto the lowest CPU with a free slot, CPU i.
        assert_eq!(json["cpus"], json!([i]), "{json}");
        ids.push(json["id"].as_str().expect("id").to_owned());
    }
    let (status, json) = create().await;
    assert_eq!((status, code(&json)), (429, "server_at_capacity"), "{json}");
    assert!(json["error"]["message"].as_str().is_some_and(|m| m.contains("vCPU slots")), "{json}");
    let metrics = server.client.get(server.url("/metrics")).send().await.expect("m").text().await.expect("t");
    assert!(metrics.contains("strata_admission_rejections_total{reason=\"host_cpu\"} 1"), "{metrics}");
    assert!(metrics.contains(&format!("strata_host_vcpu_slots{{state=\"used\"}} {cpus}")), "{metrics}");
    // Deleting the first frees CPU 0, which the next sandbox gets.
    let deleted = server.client.delete(server.url(&format!("/v1/sandboxes/{}", ids[0]))).send().await.expect("delete");
    assert_eq!(deleted.status(), 204);
    let (status, json) = create().await;
    assert_eq!((status, &json["cpus"]), (201, &json!([0])), "{json}");
    server.stop().await;

    // A floor of free memory above what this host has: nothing is admitted, and the error says why.
    let server = TestServer::with(|config| config.min_free_memory = Some(1 << 50)).await;
    let (status, json) = crate::util::status_json(
        server.client.post(server.url("/v1/sandboxes")).json(&json!({"tier": "wasm"})).send().await.expect("request"),
    )
    .await;
    assert_eq!((status, code(&json)), (429, "server_at_capacity"), "{json}");
    assert!(json["error"]["message"].as_str().is_some_and(|m| m.contains("bytes of memory available")), "{json}");
    let metrics = server.client.get(server.url("/metrics")).send().await.expect("m").text().await.expect("t");
    assert!(metrics.contains("strata_admission_rejections_total{reason=\"host_memory\"} 1"), "{metrics}");
    server.stop().await;
}
