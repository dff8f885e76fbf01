//! The harness Strata's bench binaries share: HDR-histogram figures printed as p50/p90/p99/max beside the
//! peer measured in the same run, and the ratio. Nothing here asserts a time: the figures are for reading.

#![forbid(unsafe_code)]

pub mod fleet;
pub mod images;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;

/// Latencies of one case for one contender, in nanoseconds.
#[derive(Debug)]
pub struct Figures {
    name: &'static str,
    hist: Histogram<u64>,
}

impl Figures {
    /// Empty figures for the named case.
    pub fn new(name: &'static str) -> Figures {
        Figures { name, hist: Histogram::new(3).expect("3 significant digits is a valid histogram") }
    }

    /// Records one sample.
    pub fn record(&mut self, d: Duration) {
        let _ = self.hist.record((d.as_nanos() as u64).max(1));
    }

    /// Records one sample given in microseconds (from a peer that reports its own timings).
    pub fn record_us(&mut self, us: u64) {
        let _ = self.hist.record(us.saturating_mul(1_000).max(1));
    }

    /// The value at quantile `q`, in microseconds.
    pub fn p_us(&self, q: f64) -> f64 {
        self.hist.value_at_quantile(q) as f64 / 1_000.0
    }

    /// Number of samples.
    pub fn len(&self) -> u64 {
        self.hist.len()
    }

    /// Whether nothing was recorded.
    pub fn is_empty(&self) -> bool {
        self.hist.is_empty()
    }

    /// One line: case, contender, n and percentiles, in µs or ms by size.
    pub fn print(&self, who: &str) {
        let ms = self.p_us(0.5) >= 10_000.0;
        let (scale, unit) = if ms { (1_000.0, "ms") } else { (1.0, "us") };
        println!(
            "{:<26} {:<36} n={:<6} p50={:>9.2}{unit} p90={:>9.2}{unit} p99={:>9.2}{unit} max={:>9.2}{unit}",
            self.name,
            who,
            self.hist.len(),
            self.p_us(0.5) / scale,
            self.p_us(0.9) / scale,
            self.p_us(0.99) / scale,
            self.hist.max() as f64 / 1_000.0 / scale,
        );
    }
}

/// Prints `ours / peer` at p50 and p99 (below 1.0: Strata is faster).
pub fn ratio(name: &str, ours: &Figures, peer: &Figures, peer_name: &str) {
    println!(
        "{name:<26} ratio strata/{peer_name}: p50 {:.2}x, p99 {:.2}x",
        ours.p_us(0.5) / peer.p_us(0.5),
        ours.p_us(0.99) / peer.p_us(0.99)
    );
}

/// Runs `f` `iters` times after `iters / 10` (at least one) untimed warm-up runs.
pub fn latency(name: &'static str, iters: usize, mut f: impl FnMut() -> anyhow::Result<()>) -> anyhow::Result<Figures> {
    for _ in 0..(iters / 10).max(1) {
        f()?;
    }
    let mut figures = Figures::new(name);
    for _ in 0..iters {
        let t = Instant::now();
        f()?;
        figures.record(t.elapsed());
    }
    Ok(figures)
}

/// Calls `f` on `threads` threads for `secs` seconds and returns calls per second.
pub fn throughput(threads: usize, secs: f64, f: impl Fn() -> anyhow::Result<()> + Sync) -> anyhow::Result<f64> {
    let deadline = Instant::now() + Duration::from_secs_f64(secs);
    let started = Instant::now();
    let total: usize = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(|| -> anyhow::Result<usize> {
                    let mut n = 0;
                    while Instant::now() < deadline {
                        f()?;
                        n += 1;
                    }
                    Ok(n)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().map_err(|_| anyhow::anyhow!("panicked"))?).sum::<anyhow::Result<usize>>()
    })?;
    Ok(total as f64 / started.elapsed().as_secs_f64())
}

/// Runs a whole process `iters` times after `warmup` untimed runs; `check` judges each run's output.
pub fn process(
    name: &'static str,
    iters: usize,
    warmup: usize,
    cmd: &mut dyn FnMut() -> Command,
    check: &dyn Fn(&Output) -> anyhow::Result<()>,
) -> anyhow::Result<Figures> {
    let mut figures = Figures::new(name);
    for i in 0..iters + warmup {
        let elapsed = run_once(name, cmd, check)?;
        if i >= warmup {
            figures.record(elapsed);
        }
    }
    Ok(figures)
}

/// One contender of [`interleaved`]: the name of its figures and the command of one run.
pub struct Contender<'a> {
    /// The case's name in the figures.
    pub name: &'static str,
    /// Makes the command of one run.
    pub cmd: &'a mut dyn FnMut() -> Command,
}

impl std::fmt::Debug for Contender<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Contender").field("name", &self.name).finish_non_exhaustive()
    }
}

/// Runs whole processes of several contenders in turn, one run of each per round, for `iters` rounds after
/// `warmup` untimed ones, and returns their figures in the contenders' order. Taking turns, a machine whose speed
/// drifts while the bench runs (other work starting or ending on it) moves every contender's figures alike, so the
/// ratios between them hold; one contender after the other, they would compare different moments. `check` judges
/// each run's output.
pub fn interleaved(
    iters: usize,
    warmup: usize,
    contenders: &mut [Contender<'_>],
    check: &dyn Fn(&Output) -> anyhow::Result<()>,
) -> anyhow::Result<Vec<Figures>> {
    let mut figures: Vec<Figures> = contenders.iter().map(|c| Figures::new(c.name)).collect();
    for i in 0..iters + warmup {
        for (contender, figures) in contenders.iter_mut().zip(&mut figures) {
            let elapsed = run_once(contender.name, contender.cmd, check)?;
            if i >= warmup {
                figures.record(elapsed);
            }
        }
    }
    Ok(figures)
}

/// Runs `cmd` once as a whole process (stdin empty, output captured), checks its output and returns how long it
/// took.
fn run_once(
    name: &str,
    cmd: &mut dyn FnMut() -> Command,
    check: &dyn Fn(&Output) -> anyhow::Result<()>,
) -> anyhow::Result<Duration> {
    let t = Instant::now();
    let out = cmd().stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).output()?;
    let elapsed = t.elapsed();
    check(&out).map_err(|e| anyhow::anyhow!("{name}: {e}: {}", String::from_utf8_lossy(&out.stderr)))?;
    Ok(elapsed)
}

/// `$STRATA_HOME`, else `~/.cache/strata`.
pub fn strata_home() -> PathBuf {
    std::env::var_os("STRATA_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/strata"))
}

/// The release `strata` binary: `$STRATA_BIN`, else `<target>/release/strata` when it exists.
pub fn find_strata() -> Option<PathBuf> {
    if let Some(bin) = std::env::var_os("STRATA_BIN") {
        return Some(bin.into());
    }
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../target"));
    Some(target.join("release/strata")).filter(|p| p.exists())
}

/// The summed PSS (KiB) of every process descending from this one (from `/proc/<pid>/smaps_rollup`): what forks
/// kept alive by a benchmark cost in memory.
pub fn descendants_pss_kib() -> anyhow::Result<u64> {
    let mut parents = std::collections::HashMap::new();
    for entry in std::fs::read_dir("/proc")?.flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else { continue };
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else { continue };
        let ppid = stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse::<u32>().ok());
        if let Some(ppid) = ppid {
            parents.insert(pid, ppid);
        }
    }
    let me = std::process::id();
    let descends = |mut pid: u32| {
        while let Some(&parent) = parents.get(&pid) {
            if parent == me {
                return true;
            }
            if parent <= 1 {
                return false;
            }
            pid = parent;
        }
        false
    };
    let mut total = 0;
    for &pid in parents.keys().filter(|&&pid| descends(pid)) {
        let Ok(rollup) = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")) else { continue };
        for line in rollup.lines() {
            if let Some(kib) = line.strip_prefix("Pss:").and_then(|v| v.trim().strip_suffix("kB")) {
                total += kib.trim().parse::<u64>().unwrap_or(0);
            }
        }
    }
    Ok(total)
}

/// A loopback HTTP origin for egress benchmarks, one thread per connection and one request per connection: a
/// `GET` gets `total` bytes; a `POST` has its `total` bytes read, then gets an empty `200`. Returns its port.
pub fn bulk_origin(total: u64) -> anyhow::Result<u16> {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    let port = listener.local_addr()?.port();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            std::thread::spawn(move || {
                let mut head = Vec::new();
                let mut byte = [0u8; 1];
                while !head.ends_with(b"\r\n\r\n") && stream.read(&mut byte).is_ok_and(|n| n == 1) {
                    head.push(byte[0]);
                }
                let upload = head.starts_with(b"POST");
                if upload {
                    let mut buf = vec![0u8; 1 << 20];
                    let mut left = total;
                    while left > 0 {
                        match stream.read(&mut buf) {
                            Ok(0) | Err(_) => return,
                            Ok(n) => left = left.saturating_sub(n as u64),
                        }
                    }
                }
                let len = if upload { 0 } else { total };
                let answer = format!("HTTP/1.1 200 OK\r\nContent-Length: {len}\r\nConnection: close\r\n\r\n");
                if stream.write_all(answer.as_bytes()).is_err() {
                    return;
                }
                let chunk = vec![0x5au8; 256 * 1024];
                let mut left = len;
                while left > 0 {
                    let n = left.min(chunk.len() as u64) as usize;
                    if stream.write_all(&chunk[..n]).is_err() {
                        return;
                    }
                    left -= n as u64;
                }
                let _ = stream.shutdown(std::net::Shutdown::Write);
            });
        }
    });
    Ok(port)
}
