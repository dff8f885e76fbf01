//! Throughput of the process tier's network egress (docs/DESIGN.md §3; the target is ≥ 500 MB/s from the process tier):
//! a Python client in a real jail downloads from (then uploads to) a loopback HTTP origin on the host through
//!
//! ```text
//! job → the jail's 127.0.0.1:3128 (PID 1's forwarder) → the bound Unix socket → egress proxy → origin
//! ```
//!
//! The client is the same script in both contenders and times itself from its request to the end of the answer;
//! the peer, measured in the same run, is that script run by the host's `python3` against the same kind of proxy
//! reached directly over TCP (no jail, no forwarder). Both print MB/s (10^6 bytes/s) and the ratio. Uses the
//! Debian image under `$STRATA_HOME`; skips with one line when it, root or the host's `python3` is missing.
//! `STRATA_BENCH_MB` sets the bytes per figure (default 512); each figure is the best of 3 runs.

use std::path::PathBuf;
use std::process::Command;

use strata_benches::{bulk_origin, strata_home};
use strata_core::{Capabilities, ExecOptions, Job, Limits, Net, PythonSource, Status, Tier};
use strata_egress::{Allowlist, EgressConfig, EgressProxy};
use strata_rootfs_image::DebianImage;
use strata_tier_process::{ProcessTier, ProcessTierConfig};

const TARGET_MB_S: f64 = 500.0;
const RUNS: usize = 3;

/// Which way the payload goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Way {
    Download,
    Upload,
}

/// The client: through the proxy in `HTTP_PROXY`, GET (or POST `total` bytes to) the origin; prints
/// `<answer bytes> <seconds>`.
fn script(origin: u16, total: u64, way: Way) -> String {
    let upload = if way == Way::Upload { "True" } else { "False" };
    format!(
        "import os, socket, time, urllib.parse\n\
         p = urllib.parse.urlsplit(os.environ['HTTP_PROXY'])\n\
         s = socket.create_connection((p.hostname, p.port))\n\
         total, upload = {total}, {upload}\n\
         method = 'POST' if upload else 'GET'\n\
         head = f'{{method}} http://127.0.0.1:{origin}/ HTTP/1.1\\r\\nHost: 127.0.0.1:{origin}\\r\\n'\n\
         head += f'Content-Length: {{total}}\\r\\n\\r\\n' if upload else '\\r\\n'\n\
         start = time.perf_counter()\n\
         s.sendall(head.encode())\n\
         if upload:\n\
         \x20   chunk = memoryview(b'\\xa5' * (1 << 20))\n\
         \x20   left = total\n\
         \x20   while left:\n\
         \x20       n = min(left, len(chunk)); s.sendall(chunk[:n]); left -= n\n\
         buf = bytearray(1 << 20)\n\
         got = 0\n\
         while True:\n\
         \x20   n = s.recv_into(buf)\n\
         \x20   if not n: break\n\
         \x20   got += n\n\
         print(got, time.perf_counter() - start)\n"
    )
}

/// MB/s from the script's output, checking that the whole answer came.
fn mb_s(stdout: &[u8], total: u64, way: Way) -> anyhow::Result<f64> {
    let text = String::from_utf8_lossy(stdout);
    let mut words = text.split_whitespace();
    let got: u64 = words.next().unwrap_or_default().parse()?;
    let seconds: f64 = words.next().unwrap_or_default().parse()?;
    match way {
        Way::Download => anyhow::ensure!(got > total, "only {got} bytes came: {text}"),
        Way::Upload => anyhow::ensure!(got > 0 && got < 1024, "answer of {got} bytes: {text}"),
    }
    Ok(total as f64 / seconds / 1e6)
}

/// Through a jail: the job's forwarder, the bound socket, the proxy.
fn jailed(tier: &ProcessTier, total: u64, way: Way) -> anyhow::Result<f64> {
    let port = bulk_origin(total)?;
    let caps = Capabilities {
        net: Net::allow([format!("127.0.0.1:{port}")]).expect("valid allowlist"),
        ..Capabilities::default()
    };
    let job = Job::Python { source: PythonSource::Code(script(port, total, way)), args: Vec::new() };
    let outcome = tier.run(&job, &caps, &Limits::default(), ExecOptions::default())?;
    anyhow::ensure!(
        outcome.status == Status::Exited { code: 0 },
        "{:?}: {}",
        outcome.status,
        String::from_utf8_lossy(&outcome.stderr)
    );
    anyhow::ensure!(outcome.egress.len() == 1 && outcome.egress[0].verdict == "allowed", "{:?}", outcome.egress);
    mb_s(&outcome.stdout, total, way)
}

/// The peer: the host's python3, the proxy over TCP.
fn direct(total: u64, way: Way) -> anyhow::Result<f64> {
    let port = bulk_origin(total)?;
    let allow = Allowlist::parse([format!("127.0.0.1:{port}")])?;
    let proxy = EgressProxy::start(EgressConfig::new(allow).with_tcp("127.0.0.1:0".parse()?))?;
    let proxy_addr = proxy.tcp_addr().ok_or_else(|| anyhow::anyhow!("no tcp listener"))?;
    let out = Command::new("python3")
        .args(["-c", &script(port, total, way)])
        .env("HTTP_PROXY", format!("http://{proxy_addr}"))
        .output()?;
    anyhow::ensure!(out.status.success(), "host python3: {}", String::from_utf8_lossy(&out.stderr));
    mb_s(&out.stdout, total, way)
}

fn best(runs: usize, mut f: impl FnMut() -> anyhow::Result<f64>) -> anyhow::Result<(f64, Vec<f64>)> {
    let all = (0..runs).map(|_| f()).collect::<anyhow::Result<Vec<f64>>>()?;
    Ok((all.iter().copied().fold(0.0, f64::max), all))
}

fn main() -> anyhow::Result<()> {
    let mb: u64 = std::env::var("STRATA_BENCH_MB").ok().and_then(|v| v.parse().ok()).unwrap_or(512);
    let total = mb << 20;
    let home = strata_home();
    let rootfs: PathBuf = match DebianImage::new(&home)?.installed() {
        Ok(installed) => installed.rootfs,
        Err(err) => {
            println!("process egress: skipped: no Debian image under {} ({err})", home.display());
            return Ok(());
        }
    };
    let tier = match ProcessTier::new(ProcessTierConfig {
        rootfs,
        run_dir: home.join("run/jail"),
        snapshots: strata_core::SnapshotTrust::process_local(),
        images: None,
    }) {
        Ok(tier) => tier,
        Err(err) => {
            println!("process egress: skipped: {err}");
            return Ok(());
        }
    };
    if Command::new("python3").arg("-V").output().map_or(true, |o| !o.status.success()) {
        println!("process egress: skipped: no python3 on the host for the peer");
        return Ok(());
    }
    println!("process-tier egress, {mb} MiB per figure, best of {RUNS} (loopback origin; MB = 10^6 bytes)");
    for (name, way) in [("download", Way::Download), ("upload", Way::Upload)] {
        // Warm both paths (the jail binary, the image's page cache) with a small transfer.
        jailed(&tier, 8 << 20, way)?;
        direct(8 << 20, way)?;
        let (peer, peer_runs) = best(RUNS, || direct(total, way))?;
        let (strata, strata_runs) = best(RUNS, || jailed(&tier, total, way))?;
        println!("{name}:");
        println!("  host python3 → proxy (TCP)          {peer:>7.0} MB/s   runs {peer_runs:.0?}");
        println!("  jailed python3 → forwarder → proxy  {strata:>7.0} MB/s   runs {strata_runs:.0?}");
        let verdict = if strata >= TARGET_MB_S { "PASS" } else { "MISS" };
        println!("  ratio strata/peer {:.2}x   (target >= {TARGET_MB_S:.0} MB/s: {verdict})", strata / peer);
    }
    Ok(())
}
