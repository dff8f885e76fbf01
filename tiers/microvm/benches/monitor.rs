//! What the monitor process costs, beside the same guest run in the bench's own process (`cargo bench -p
//! strata-tier-microvm --bench monitor`):
//!
//! | name               | what one iteration does                                                             |
//! |--------------------|-------------------------------------------------------------------------------------|
//! | `monitor_start`    | `Monitor::start` of a 2 MiB tiny guest: spawn from the memfd, cgroup, namespaces,    |
//! |                    | root, user namespace, filters, the machine built and its vCPU started; then dropped  |
//! | `monitor_hello`    | the same guest printing `hello` and halting: start, wait for the halt, read the      |
//! |                    | console, stop                                                                        |
//! | `inprocess_hello`  | peer: the same machine built and run on a vCPU thread of this process (no jail)      |
//!
//! Then the memory a monitor holds beside its guest's RAM: the resident pages of every mapping but the guest's
//! memfd (`/proc/<pid>/smaps`: its code, heap, stacks, device buffers) of ten monitors running a spinning guest, and the keeper's `VmRSS`, against the target of the issue (≤ 5 MiB per
//! VM, Firecracker's figure). Nothing here asserts a time. Iterations: `$STRATA_BENCH_ITERS`, else 200.

use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use strata_benches::{Figures, latency, ratio};
use strata_tier_microvm::devices::bus::Bus;
use strata_tier_microvm::monitor::{Monitor, MonitorConfig};
use strata_tier_microvm::vstate::vcpu::VcpuExit;
use strata_vmm::proto::MachineSpec;
use strata_vmm::test_utils::tiny::{CODE, HLT, MEM_SIZE, print, tiny_guest};
/// The name of the guest RAM's memfd (`GuestMemory::new`).
const GUEST_MEMFD: &str = "strata-guest-ram";
/// Firecracker's figure for its VMM's own memory.
const RSS_TARGET_KIB: u64 = 5 * 1024;

fn hello_code() -> Vec<u8> {
    let mut code = print(b"hello\n");
    code.push(HLT);
    code
}

fn spec(code: Vec<u8>) -> MachineSpec {
    MachineSpec::code(code, CODE, MEM_SIZE).with_vsock("vsock.sock")
}

fn monitor_hello(config: &MonitorConfig) -> anyhow::Result<()> {
    let mut monitor = Monitor::start(config, &spec(hello_code()), &[], 1, MEM_SIZE)?;
    let deadline = Instant::now() + Duration::from_secs(10);
    let stopped = loop {
        if let Some(stopped) = monitor.status()? {
            break stopped;
        }
        ensure!(Instant::now() < deadline, "the guest did not halt");
        std::thread::sleep(Duration::from_micros(200));
    };
    ensure!(stopped.exits == ["Hlt"], "the guest ended with {:?}", stopped.exits);
    let (console, _) = monitor.console()?;
    ensure!(console == "hello\n", "the guest printed {console:?}");
    monitor.stop();
    Ok(())
}

fn inprocess_hello() -> anyhow::Result<()> {
    let guest = tiny_guest(&hello_code(), false, Bus::new());
    let (_vcpu, exit) = guest.vcpu.start()?.join()?;
    ensure!(exit.context("run")? == VcpuExit::Hlt, "the guest did not halt");
    ensure!(guest.serial.contents() == b"hello\n", "the guest printed {:?}", guest.serial.contents());
    Ok(())
}

/// Resident KiB of a process's mappings other than the guest's RAM (the memfd named `guest`).
fn rss_beside_guest(pid: i32, guest: &str) -> anyhow::Result<u64> {
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps"))?;
    let mut total = 0;
    let mut in_guest = false;
    for line in smaps.lines() {
        let mut fields = line.split_whitespace();
        let Some(first) = fields.next() else { continue };
        if first.contains('-') && first.chars().next().is_some_and(|c| c.is_ascii_hexdigit()) {
            in_guest = line.contains(guest);
        } else if first == "Rss:" && !in_guest {
            total += fields.next().context("Rss value")?.parse::<u64>()?;
        }
    }
    Ok(total)
}

/// A `/proc/<pid>/status` field in KiB.
fn kib(pid: i32, field: &str) -> anyhow::Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    for line in status.lines() {
        if let Some(rest) = line.strip_prefix(field).and_then(|r| r.strip_prefix(':')) {
            return Ok(rest.trim().trim_end_matches("kB").trim().parse()?);
        }
    }
    bail!("no {field} in /proc/{pid}/status")
}

fn keeper_pid(monitor_pid: i32) -> anyhow::Result<i32> {
    let status = std::fs::read_to_string(format!("/proc/{monitor_pid}/status"))?;
    let ppid = status.lines().find_map(|l| l.strip_prefix("PPid:")).context("PPid")?;
    Ok(ppid.trim().parse()?)
}

fn main() -> anyhow::Result<()> {
    if !std::path::Path::new("/dev/kvm").exists() {
        println!("skip: /dev/kvm is absent");
        return Ok(());
    }
    let iters = std::env::var("STRATA_BENCH_ITERS").ok().and_then(|v| v.parse().ok()).unwrap_or(200);
    let kind = if std::path::Path::new("/sys/module/kvm_pvm").exists() { "PVM" } else { "hardware" };
    println!("KVM: {kind}; {iters} iterations per figure");
    let dir = tempfile::tempdir()?;
    let config = MonitorConfig::new(dir.path().join("run"));
    if config.cgroups.is_none() {
        println!("note: no usable cgroups here; monitors run without one");
    }

    // Start and teardown timed apart.
    let mut start = Figures::new("monitor_start");
    let mut teardown = Figures::new("monitor_teardown");
    for i in 0..iters + iters / 10 {
        let t = Instant::now();
        let monitor = Monitor::start(&config, &spec(vec![0xeb, 0xfe]), &[], 1, MEM_SIZE)?;
        let started = t.elapsed();
        let t = Instant::now();
        monitor.stop();
        if i >= iters / 10 {
            start.record(started);
            teardown.record(t.elapsed());
        }
    }
    let hello = latency("monitor_hello", iters, || monitor_hello(&config))?;
    let peer = latency("inprocess_hello", iters, inprocess_hello)?;
    for f in [&start, &teardown, &hello] {
        f.print("strata-vmm (jailed process)");
    }
    peer.print("in this process (no jail)");
    ratio("monitor_hello", &hello, &peer, "in-process");

    // Ten monitors at once, each with a spinning guest.
    let monitors = (0..10)
        .map(|_| Monitor::start(&config, &spec(vec![0xeb, 0xfe]), &[], 1, MEM_SIZE))
        .collect::<Result<Vec<_>, _>>()?;
    std::thread::sleep(Duration::from_millis(50));
    let mut own = Figures::new("monitor_rss_kib");
    let mut keepers = Figures::new("keeper_rss_kib");
    for monitor in &monitors {
        let pid = monitor.pid();
        own.record(Duration::from_micros(rss_beside_guest(pid, GUEST_MEMFD)?));
        keepers.record(Duration::from_micros(kib(keeper_pid(pid)?, "VmRSS")?));
    }
    drop(monitors);
    // The histograms hold KiB as "microseconds": print them as such.
    let p50 = own.p_us(0.5) as u64;
    println!(
        "{:<26} monitor RSS beside guest RAM: p50 {p50} KiB, max {} KiB; keeper RSS p50 {} KiB",
        "memory",
        own.p_us(1.0) as u64,
        keepers.p_us(0.5) as u64
    );
    let verdict = if p50 <= RSS_TARGET_KIB { "PASS" } else { "MISS" };
    println!("{:<26} monitor RSS <= 5 MiB (Firecracker's figure): {p50} KiB {verdict}", "target");
    println!("{:<26} monitor start p50: {:.2} ms", "start", start.p_us(0.5) / 1000.0);
    Ok(())
}
