//! `strata serve` end to end: create → exec `echo hi` → delete through the API, beside the same three steps as
//! direct `Engine` calls in the same process (the API's overhead), on the process and wasm tiers; sandbox creates
//! per second with 8 concurrent clients; and the E2B SDK's `create` + `commands.run` + `kill` when its venv exists
//! (`$STRATA_HOME/e2b-sdk-2.63.0`, made by the tests); a GET through the port proxy to `python3 -m http.server` in a
//! process sandbox, beside the same GET straight to the same server program on the host's loopback; a key typed
//! into a sandbox's terminal over its WebSocket until its echo comes back, beside the same echo of a host terminal;
//! pause and resume of a process sandbox holding 16 MiB of files, beside a fresh create.
//! Figures for reading, not asserted.
//!
//! `cargo bench -p strata-serve --bench api [-- --quick]`

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;
use strata_benches::{Figures, ratio};
use strata_core::{Capabilities, ExecOptions, Job, PythonSource};
use strata_engine::{Engine, EngineConfig, TierChoice};
use strata_serve::{ServeConfig, Server};

fn job(tier: &str) -> (Job, serde_json::Value) {
    if tier == "wasm" {
        let code = "print('hi')".to_owned();
        (Job::Python { source: PythonSource::Code(code.clone()), args: Vec::new() }, json!({"python": code}))
    } else {
        let argv = vec!["echo".to_owned(), "hi".to_owned()];
        (Job::Command { argv: argv.clone() }, json!({"command": argv}))
    }
}

fn direct(engine: &Engine, tier: &str, iters: usize) -> anyhow::Result<Figures> {
    let choice: TierChoice = tier.parse()?;
    let (job, _) = job(tier);
    let mut figures = Figures::new("create+exec+delete");
    for i in 0..iters + iters / 10 {
        let started = Instant::now();
        let sandbox = engine.start(choice, &Capabilities::default(), engine.default_limits())?;
        let outcome = sandbox.exec(&job, ExecOptions::default())?;
        sandbox.close()?;
        anyhow::ensure!(outcome.stdout == b"hi\n", "{outcome:?}");
        if i >= iters / 10 {
            figures.record(started.elapsed());
        }
    }
    Ok(figures)
}

async fn api(base: &str, tier: &str, iters: usize) -> anyhow::Result<Figures> {
    let client = reqwest::Client::new();
    let (_, body) = job(tier);
    let mut figures = Figures::new("create+exec+delete");
    for i in 0..iters + iters / 10 {
        let started = Instant::now();
        let created: serde_json::Value =
            client.post(format!("{base}/v1/sandboxes")).json(&json!({"tier": tier})).send().await?.json().await?;
        let id = created["id"].as_str().unwrap_or_default().to_owned();
        let outcome: serde_json::Value =
            client.post(format!("{base}/v1/sandboxes/{id}/exec")).json(&body).send().await?.json().await?;
        client.delete(format!("{base}/v1/sandboxes/{id}")).send().await?;
        anyhow::ensure!(outcome["stdout"] == "hi\n", "{outcome}");
        if i >= iters / 10 {
            figures.record(started.elapsed());
        }
    }
    Ok(figures)
}

async fn creates_per_second(base: &str, tier: &str, total: usize) -> anyhow::Result<f64> {
    let client = reqwest::Client::new();
    let started = Instant::now();
    let mut ids = Vec::new();
    for chunk in 0..total.div_ceil(8) {
        let mut tasks = Vec::new();
        for _ in 0..8.min(total - chunk * 8) {
            let (client, url) = (client.clone(), format!("{base}/v1/sandboxes"));
            let tier = tier.to_owned();
            tasks.push(tokio::spawn(async move {
                let created: serde_json::Value =
                    client.post(url).json(&json!({"tier": tier})).send().await?.json().await?;
                anyhow::Ok(created["id"].as_str().unwrap_or_default().to_owned())
            }));
        }
        for task in tasks {
            ids.push(task.await??);
        }
    }
    let rate = total as f64 / started.elapsed().as_secs_f64();
    for id in ids {
        client.delete(format!("{base}/v1/sandboxes/{id}")).send().await?;
    }
    Ok(rate)
}

const SDK_LOOP: &str = r#"
import sys, time
from e2b import Sandbox
for i in range(int(sys.argv[1])):
    t = time.perf_counter()
    s = Sandbox.create()
    assert s.commands.run("echo hi").stdout == "hi\n"
    s.kill()
    print(int((time.perf_counter() - t) * 1e6))
"#;

const SDK_RUN_CODE: &str = r#"
import sys, time
from e2b_code_interpreter import Sandbox
s = Sandbox.create(template=sys.argv[2])
s.run_code("x = 1")
for i in range(int(sys.argv[1])):
    t = time.perf_counter()
    assert s.run_code("x + 1").text == "2"
    print(int((time.perf_counter() - t) * 1e6))
s.kill()
"#;

/// GETs of `url` with one client (keep-alive on the client's side), each checked to answer 200.
async fn gets(client: &reqwest::Client, name: &'static str, url: &str, iters: usize) -> anyhow::Result<Figures> {
    let mut figures = Figures::new(name);
    for i in 0..iters + iters / 10 {
        let started = Instant::now();
        let response = client.get(url).send().await?;
        anyhow::ensure!(response.status() == 200, "{url}: {}", response.status());
        response.bytes().await?;
        if i >= iters / 10 {
            figures.record(started.elapsed());
        }
    }
    Ok(figures)
}

/// Waits (at most 10 s) until `url` answers 200.
async fn answering(client: &reqwest::Client, url: &str) {
    for _ in 0..200 {
        if client.get(url).send().await.is_ok_and(|r| r.status() == 200) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A GET through `/v1/sandboxes/{id}/ports/8000/` to `python3 -m http.server` in a process sandbox, beside a GET
/// straight to the same program on the host's loopback.
async fn port_proxy(base: &str, iters: usize) -> anyhow::Result<()> {
    let client = reqwest::Client::new();
    let created: serde_json::Value =
        client.post(format!("{base}/v1/sandboxes")).json(&json!({"tier": "process"})).send().await?.json().await?;
    let id = created["id"].as_str().ok_or_else(|| anyhow::anyhow!("create: {created}"))?.to_owned();
    let exec = format!("{base}/v1/sandboxes/{id}/exec");
    let server = json!({"command": ["python3", "-m", "http.server", "8000", "--bind", "127.0.0.1"]});
    let background = client.clone();
    tokio::spawn(async move { background.post(exec).json(&server).send().await });
    let proxied = format!("{base}/v1/sandboxes/{id}/ports/8000/");
    answering(&client, &proxied).await;
    let ours = gets(&client, "port GET", &proxied, iters).await?;
    ours.print("through the port proxy (process)");
    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let mut host = tokio::process::Command::new("python3")
        .args(["-m", "http.server", &port.to_string(), "--bind", "127.0.0.1"])
        .current_dir(std::env::temp_dir())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()?;
    let direct = format!("http://127.0.0.1:{port}/");
    answering(&client, &direct).await;
    let peer = gets(&client, "port GET", &direct, iters).await?;
    peer.print("straight to the host's loopback");
    ratio("port GET", &ours, &peer, "direct loopback");
    let _ = host.kill().await;
    client.delete(format!("{base}/v1/sandboxes/{id}")).send().await?;
    Ok(())
}

/// A key typed into a terminal and its echo back: through a `strata serve` terminal's WebSocket (a process
/// sandbox's `cat` on the jail's own terminal), beside the same echo of a terminal on the host (the kernel's line
/// discipline alone: the floor).
async fn pty_round_trip(base: &str, iters: usize) -> anyhow::Result<()> {
    use futures_util::{SinkExt, StreamExt};
    use tokio_tungstenite::tungstenite::Message;
    let client = reqwest::Client::new();
    let created: serde_json::Value =
        client.post(format!("{base}/v1/sandboxes")).json(&json!({"tier": "process"})).send().await?.json().await?;
    let id = created["id"].as_str().ok_or_else(|| anyhow::anyhow!("create: {created}"))?.to_owned();
    let pty: serde_json::Value = client
        .post(format!("{base}/v1/sandboxes/{id}/ptys"))
        .json(&json!({"command": ["/bin/cat"]}))
        .send()
        .await?
        .json()
        .await?;
    let pty = pty["id"].as_str().ok_or_else(|| anyhow::anyhow!("pty: {pty}"))?.to_owned();
    let ws = format!("{}/v1/sandboxes/{id}/ptys/{pty}/ws", base.replacen("http", "ws", 1));
    let (mut socket, _) = tokio_tungstenite::connect_async(ws).await?;
    let mut figures = Figures::new("key echo");
    for i in 0..iters + iters / 10 {
        let started = Instant::now();
        socket.send(Message::Binary(vec![b'x'].into())).await?;
        loop {
            match tokio::time::timeout(Duration::from_secs(10), socket.next()).await? {
                Some(Ok(Message::Binary(bytes))) if bytes.contains(&b'x') => break,
                Some(Ok(_)) => continue,
                other => anyhow::bail!("the terminal went away: {other:?}"),
            }
        }
        if i >= iters / 10 {
            figures.record(started.elapsed());
        }
        if i % 64 == 63 {
            // A line now and then, so `cat`'s line stays short.
            socket.send(Message::Binary(vec![b'\n'].into())).await?;
        }
    }
    figures.print("a strata serve terminal (process)");
    drop(socket);
    client.delete(format!("{base}/v1/sandboxes/{id}")).send().await?;

    let host = tokio::task::spawn_blocking(move || -> anyhow::Result<Figures> {
        let nix::pty::OpenptyResult { master, slave } = nix::pty::openpty(None, None)?;
        let mut figures = Figures::new("key echo");
        let mut buf = [0u8; 64];
        for i in 0..iters + iters / 10 {
            let started = Instant::now();
            nix::unistd::write(&master, b"x")?;
            loop {
                let n = nix::unistd::read(&master, &mut buf)?;
                if buf[..n].contains(&b'x') {
                    break;
                }
            }
            if i >= iters / 10 {
                figures.record(started.elapsed());
            }
            if i % 64 == 63 {
                nix::unistd::write(&master, b"\n")?;
                // The line is echoed and queued for the slave, which nothing reads: drop it.
                nix::sys::termios::tcflush(&slave, nix::sys::termios::FlushArg::TCIFLUSH)?;
            }
        }
        Ok(figures)
    })
    .await??;
    host.print("a terminal on the host");
    ratio("key echo", &figures, &host, "host terminal");
    Ok(())
}

/// Pause and resume of a process sandbox holding 16 MiB of files, through `/v1`: each a snapshot of its filesystem
/// (pause) and a fork of it under the same id (resume), beside creating a fresh sandbox (what a resume stands in
/// for) in the same run.
async fn pause_resume(base: &str, iters: usize) -> anyhow::Result<()> {
    let client = reqwest::Client::new();
    let created: serde_json::Value =
        client.post(format!("{base}/v1/sandboxes")).json(&json!({"tier": "process"})).send().await?.json().await?;
    let id = created["id"].as_str().unwrap_or_default().to_owned();
    let fill = json!({"command": ["sh", "-c", "head -c 16777216 /dev/urandom > /tmp/state"]});
    client.post(format!("{base}/v1/sandboxes/{id}/exec")).json(&fill).send().await?.error_for_status()?;
    let (mut pause, mut resume) = (Figures::new("pause (16 MiB)"), Figures::new("resume (16 MiB)"));
    for _ in 0..iters {
        let started = Instant::now();
        client.post(format!("{base}/v1/sandboxes/{id}/pause")).json(&json!({})).send().await?.error_for_status()?;
        pause.record(started.elapsed());
        let started = Instant::now();
        client.post(format!("{base}/v1/sandboxes/{id}/resume")).json(&json!({})).send().await?.error_for_status()?;
        resume.record(started.elapsed());
    }
    client.delete(format!("{base}/v1/sandboxes/{id}")).send().await?;
    let mut create = Figures::new("create+delete");
    for _ in 0..iters {
        let started = Instant::now();
        let created: serde_json::Value =
            client.post(format!("{base}/v1/sandboxes")).json(&json!({"tier": "process"})).send().await?.json().await?;
        create.record(started.elapsed());
        client.delete(format!("{base}/v1/sandboxes/{}", created["id"].as_str().unwrap_or_default())).send().await?;
    }
    pause.print("POST /v1/sandboxes/{id}/pause");
    resume.print("POST /v1/sandboxes/{id}/resume");
    create.print("POST /v1/sandboxes (fresh)");
    ratio("resume", &resume, &create, "a fresh create");
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let quick = std::env::args().any(|a| a == "--quick");
    let iters = if quick { 30 } else { 200 };
    let engine = Arc::new(Engine::new(EngineConfig::from_env()?)?);
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let mut config = ServeConfig::new(EngineConfig::from_env()?);
    config.listen = "127.0.0.1:0".parse()?;
    config.max_sandboxes = 1024;
    let server = runtime.block_on(Server::bind_with_engine(engine.clone(), config))?;
    let base = format!("http://{}", server.local_addr());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let serving = runtime.spawn(server.run(async move {
        let _ = stopped.await;
    }));

    let tiers: Vec<&str> = if engine.process().is_ok() { vec!["process", "wasm"] } else { vec!["wasm"] };
    for tier in tiers {
        println!("-- {tier} tier");
        let ours = runtime.block_on(api(&base, tier, iters))?;
        ours.print(&format!("strata serve /v1 ({tier})"));
        let peer = direct(&engine, tier, iters)?;
        peer.print(&format!("Engine::start/exec/close ({tier})"));
        ratio("create+exec+delete", &ours, &peer, "direct");
        let total = if quick { 40 } else { 200 };
        let rate = runtime.block_on(creates_per_second(&base, tier, total))?;
        println!("{:<26} {total} creates, 8 concurrent clients: {rate:.0} sandboxes/s", "creates/s");
    }

    if engine.process().is_ok() {
        runtime.block_on(port_proxy(&base, iters * 5))?;
        runtime.block_on(pty_round_trip(&base, iters * 5))?;
        runtime.block_on(pause_resume(&base, iters / 2))?;
    }

    if let Some(home) = strata_engine::strata_home() {
        let python = home.join("e2b-sdk-2.63.0/bin/python");
        if python.exists() && engine.process().is_ok() {
            // A directory of its own: a stray module in the temporary directory must not shadow the SDK's imports.
            let dir = tempfile::tempdir()?;
            let sdk = |script: &str, template: &str, name: &'static str, who: &str| -> anyhow::Result<()> {
                let output = std::process::Command::new(&python)
                    .args(["-c", script, &(iters / 4).to_string(), template])
                    .current_dir(dir.path())
                    .env("E2B_API_KEY", "e2b_0000000000000000000000000000000000000000")
                    .env("E2B_API_URL", &base)
                    .env("E2B_SANDBOX_URL", &base)
                    .output()?;
                anyhow::ensure!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
                let mut figures = Figures::new(name);
                for line in String::from_utf8_lossy(&output.stdout).lines().skip(2) {
                    figures.record_us(line.trim().parse()?);
                }
                figures.print(who);
                Ok(())
            };
            sdk(SDK_LOOP, "base", "e2b create+run+kill", "E2B SDK 2.63.0 (process)")?;
            // The same cell in a context's IPython kernel inside the sandbox, and in the wasm template's session.
            let kernel = "e2b-code-interpreter 2.11.5 (IPython kernel, process)";
            sdk(SDK_RUN_CODE, "code-interpreter-v1", "e2b run_code warm", kernel)?;
            let wasm = "e2b-code-interpreter 2.11.5 (strata-wasm-python)";
            sdk(SDK_RUN_CODE, "strata-wasm-python", "e2b run_code warm wasm", wasm)?;
        }
    }
    let _ = stop.send(());
    runtime.block_on(async { tokio::time::timeout(Duration::from_secs(30), serving).await })???;
    Ok(())
}
