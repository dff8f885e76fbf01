//! The server under test: the release `strata serve`, started on a free loopback port, killed or stopped.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use tokio::process::{Child, Command};

/// A running `strata serve`.
#[derive(Debug)]
pub struct Server {
    child: Child,
    /// Its process id.
    pub pid: u32,
    /// `http://127.0.0.1:PORT`.
    pub base: String,
    /// `ws://127.0.0.1:PORT`.
    pub ws_base: String,
}

/// How to start one.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// The `strata` binary.
    pub strata: PathBuf,
    /// Its stderr goes here (appended).
    pub log: PathBuf,
    /// Extra `strata serve` flags.
    pub flags: Vec<String>,
}

impl Server {
    /// Starts a server on a free loopback port and waits until `/health` answers.
    pub async fn start(config: &ServerConfig) -> anyhow::Result<Server> {
        let port = {
            let probe = std::net::TcpListener::bind("127.0.0.1:0").context("finding a free port")?;
            probe.local_addr()?.port()
        };
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&config.log)
            .with_context(|| format!("opening {}", config.log.display()))?;
        let child = Command::new(&config.strata)
            .arg("serve")
            .arg("--listen")
            .arg(addr.to_string())
            .args(&config.flags)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting {} serve", config.strata.display()))?;
        let pid = child.id().context("the server has no pid")?;
        let server = Server { child, pid, base: format!("http://{addr}"), ws_base: format!("ws://{addr}") };
        let client = reqwest::Client::new();
        let started = Instant::now();
        loop {
            if let Ok(response) = client.get(format!("{}/health", server.base)).send().await
                && response.status().is_success()
            {
                return Ok(server);
            }
            if started.elapsed() > Duration::from_secs(60) {
                bail!("the server did not answer /health within 60 s (see {})", config.log.display());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// SIGKILL, and waits for the process to be gone.
    pub async fn kill(mut self) -> anyhow::Result<()> {
        self.child.start_kill().context("SIGKILL")?;
        self.child.wait().await.context("waiting for the killed server")?;
        Ok(())
    }

    /// SIGTERM (the server drains: closes every sandbox, removes its snapshots), and waits up to `limit`.
    pub async fn stop(mut self, limit: Duration) -> anyhow::Result<std::process::ExitStatus> {
        let pid = nix::unistd::Pid::from_raw(i32::try_from(self.pid).context("pid")?);
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).context("SIGTERM")?;
        match tokio::time::timeout(limit, self.child.wait()).await {
            Ok(status) => Ok(status?),
            Err(_) => {
                let _ = self.child.start_kill();
                bail!("the server did not stop within {limit:?} of SIGTERM")
            }
        }
    }
}

/// The `strata` binary to test: `$CARGO_TARGET_DIR/release/strata`, else `target/release/strata`.
pub fn default_strata() -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("target"));
    target.join("release").join("strata")
}

/// `$STRATA_HOME`, as the server resolves it.
pub fn strata_home() -> Option<PathBuf> {
    std::env::var_os("STRATA_HOME").map(PathBuf::from).or_else(|| {
        let cache = std::env::var_os("XDG_CACHE_HOME")
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".cache")))?;
        Some(cache.join("strata"))
    })
}
