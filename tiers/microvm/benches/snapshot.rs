//! Snapshot, restore and fork of a tiny guest (`cargo bench -p strata-tier-microvm --bench snapshot`), and what N
//! forks of one snapshot cost in memory:
//!
//! | name                  | what one iteration does                                                            |
//! |-----------------------|------------------------------------------------------------------------------------|
//! | `snapshot_save`       | a paused 2 MiB counting guest into a new snapshot directory (state, RAM, sha256,   |
//! |                       | fsync, rename)                                                                     |
//! | `snapshot_open`       | `VmSnapshot::open`: sha256 of every file, state parsed and validated               |
//! | `restore`             | from an opened snapshot: new VM, RAM's non-zero pages copied into a fresh memfd,  |
//! |                       | VM, device and vCPU state set                                                      |
//! | `fork`                | the same over the memory file mapped `MAP_PRIVATE` (no copy)                       |
//! | `fork_first_out`      | `fork` plus running the guest to its next serial byte                              |
//! | `restore_irqchip`     | `restore` of a guest with the in-kernel irqchip and PIT (their state set too)      |
//! | `fork_irqchip`        | `fork` of that guest                                                               |
//!
//! Teardown is not timed (a VM with the irqchip takes the kernel ~16 ms to close). Then `pss`: N forks of a
//! 64 MiB guest, each having run a little and read all of its RAM, against N restores (each a private copy) as
//! the peer: the process's PSS growth (`/proc/self/smaps_rollup`) for each. The target: `restore` ≤ 1 ms
//! p50. Nothing here asserts a figure. Iterations: `$STRATA_BENCH_ITERS`, else 500; forks: `$STRATA_BENCH_FORKS`,
//! else 16.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use strata_benches::{Figures, latency, ratio};
use strata_tier_microvm::machine::Machine;
use strata_tier_microvm::persist::RestoreArgs;
use strata_tier_microvm::snapshot::VmSnapshot;
use strata_tier_microvm::vstate::vcpu::VcpuExit;
use strata_vmm::test_utils::tiny::{self, counter_code, parts_with_memory, run_until, tiny_machine};
use vm_memory::GuestAddress;

fn counter(machine: &Machine) -> u64 {
    let mut buf = [0u8; 8];
    machine.memory().read(GuestAddress(0x4000), &mut buf).map(|()| u64::from_le_bytes(buf)).unwrap_or(0)
}

/// A paused counting guest that has counted to at least 50.
fn paused_counter(irqchip: bool, memory_bytes: u64) -> anyhow::Result<Machine> {
    let mut machine = if memory_bytes == tiny::MEM_SIZE {
        tiny_machine(&counter_code(), irqchip)
    } else {
        parts_with_memory(&counter_code(), irqchip, memory_bytes).machine()
    };
    run_until(&mut machine, Duration::from_secs(10), |m| counter(m) >= 50);
    machine.pause()?;
    Ok(machine)
}

/// Times `make` only; what it returns is dropped outside the timing. `iters / 10` untimed warm-ups first.
fn timed<T>(name: &'static str, iters: usize, mut make: impl FnMut() -> anyhow::Result<T>) -> anyhow::Result<Figures> {
    let mut figures = Figures::new(name);
    for i in 0..iters + (iters / 10).max(1) {
        let t = Instant::now();
        let made = make()?;
        let took = t.elapsed();
        drop(made);
        if i >= (iters / 10).max(1) {
            figures.record(took);
        }
    }
    Ok(figures)
}

fn pss_kib() -> anyhow::Result<u64> {
    let rollup = std::fs::read_to_string("/proc/self/smaps_rollup").context("smaps_rollup")?;
    rollup
        .lines()
        .find_map(|line| line.strip_prefix("Pss:"))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
        .context("no Pss line in smaps_rollup")
}

/// Runs `machine`'s vCPU for `outs` serial bytes on this thread.
fn run_outs(machine: &mut Machine, outs: usize) -> anyhow::Result<()> {
    for _ in 0..outs {
        let exit = machine.vcpus_mut()[0].run_once()?;
        ensure!(matches!(exit, VcpuExit::IoOut { port: 0x3f8, .. }), "the guest ended with {exit:?}");
    }
    Ok(())
}

/// N machines from `make`, each run for a few serial bytes and made to read all of its RAM (as a guest touching
/// its memory would); returns the PSS growth in KiB with all of them alive.
fn pss_of(n: usize, buf: &mut [u8], mut make: impl FnMut() -> anyhow::Result<Machine>) -> anyhow::Result<u64> {
    let before = pss_kib()?;
    let mut machines = Vec::with_capacity(n);
    for _ in 0..n {
        let mut machine = make()?;
        run_outs(&mut machine, 20)?;
        let size = machine.memory().size();
        let mut addr = 0;
        while addr < size {
            let len = buf.len().min(usize::try_from(size - addr)?);
            machine.memory().read(GuestAddress(addr), &mut buf[..len])?;
            addr += len as u64;
        }
        machines.push(machine);
    }
    let after = pss_kib()?;
    drop(machines);
    Ok(after.saturating_sub(before))
}

fn main() -> anyhow::Result<()> {
    if !Path::new("/dev/kvm").exists() {
        println!("skip: /dev/kvm is absent");
        return Ok(());
    }
    let iters: usize = std::env::var("STRATA_BENCH_ITERS").ok().and_then(|v| v.parse().ok()).unwrap_or(500);
    let forks: usize = std::env::var("STRATA_BENCH_FORKS").ok().and_then(|v| v.parse().ok()).unwrap_or(16);
    let kind = if Path::new("/sys/module/kvm_pvm").exists() { "PVM" } else { "hardware" };
    println!("KVM: {kind}; {iters} iterations per figure ({} with the irqchip)", (iters / 5).max(1));
    let dir = tempfile::tempdir()?;
    let mut all: Vec<Figures> = Vec::new();

    let mut machine = paused_counter(false, tiny::MEM_SIZE)?;
    let mut save = Figures::new("snapshot_save");
    for i in 0..iters + (iters / 10).max(1) {
        let dest = dir.path().join(format!("save-{i}"));
        let t = Instant::now();
        VmSnapshot::save(&mut machine, &dest, None, &strata_core::SnapshotTrust::process_local())?;
        let took = t.elapsed();
        std::fs::remove_dir_all(&dest)?;
        if i >= (iters / 10).max(1) {
            save.record(took);
        }
    }
    all.push(save);

    let path = dir.path().join("snap");
    VmSnapshot::save(&mut machine, &path, None, &strata_core::SnapshotTrust::process_local())?;
    all.push(latency("snapshot_open", iters, || {
        VmSnapshot::open(&path, &strata_core::SnapshotTrust::process_local()).map(drop).map_err(Into::into)
    })?);
    let snap = VmSnapshot::open(&path, &strata_core::SnapshotTrust::process_local())?;
    let restore = timed("restore", iters, || Ok(snap.restore(RestoreArgs::default())?))?;
    let fork = timed("fork", iters, || Ok(snap.fork(RestoreArgs::default())?))?;
    let first_out = timed("fork_first_out", iters, || {
        let mut fork = snap.fork(RestoreArgs::default())?;
        run_outs(&mut fork, 1)?;
        Ok(fork)
    })?;
    let restore_p50_ms = restore.p_us(0.5) / 1000.0;
    let fork_p50_ms = fork.p_us(0.5) / 1000.0;

    let slow = (iters / 5).max(1);
    let mut with_irqchip = paused_counter(true, tiny::MEM_SIZE)?;
    let path = dir.path().join("snap-irqchip");
    VmSnapshot::save(&mut with_irqchip, &path, None, &strata_core::SnapshotTrust::process_local())?;
    drop(with_irqchip);
    let snap_irqchip = VmSnapshot::open(&path, &strata_core::SnapshotTrust::process_local())?;
    all.push(timed("restore_irqchip", slow, || Ok(snap_irqchip.restore(RestoreArgs::default())?))?);
    all.push(timed("fork_irqchip", slow, || Ok(snap_irqchip.fork(RestoreArgs::default())?))?);
    drop(machine);

    for f in all.iter().take(2).chain([&restore, &fork, &first_out]).chain(all.iter().skip(2)) {
        f.print("strata-tier-microvm");
    }
    let verdict = if restore_p50_ms <= 1.0 { "PASS" } else { "MISS" };
    println!("{:<26} restore p50 <= 1 ms: {restore_p50_ms:.3} ms {verdict} (fork p50 {fork_p50_ms:.3} ms)", "target");
    ratio("fork", &fork, &restore, "restore");

    // Memory: N forks of a 64 MiB guest against N restores.
    const PSS_GUEST: u64 = 64 << 20;
    let mut big = paused_counter(false, PSS_GUEST)?;
    let path = dir.path().join("snap-64m");
    VmSnapshot::save(&mut big, &path, None, &strata_core::SnapshotTrust::process_local())?;
    drop(big);
    let snap = VmSnapshot::open(&path, &strata_core::SnapshotTrust::process_local())?;
    let mut buf = vec![0u8; 1 << 20];
    let fork_kib = pss_of(forks, &mut buf, || Ok(snap.fork(RestoreArgs::default())?))?;
    let restore_kib = pss_of(forks, &mut buf, || Ok(snap.restore(RestoreArgs::default())?))?;
    let guest_kib = PSS_GUEST / 1024;
    println!(
        "{:<26} {forks} forks of a {} MiB guest: PSS +{:.1} MiB ({:.0} KiB per fork, {:.1}% of its RAM)",
        "pss_forks",
        guest_kib / 1024,
        fork_kib as f64 / 1024.0,
        fork_kib as f64 / forks as f64,
        100.0 * fork_kib as f64 / (forks as u64 * guest_kib) as f64,
    );
    println!(
        "{:<26} {forks} restores (private copies): PSS +{:.1} MiB ({:.0} KiB per restore)",
        "pss_restores",
        restore_kib as f64 / 1024.0,
        restore_kib as f64 / forks as f64,
    );
    println!("{:<26} forks/restores PSS: {:.3}x", "pss_ratio", fork_kib as f64 / (restore_kib.max(1)) as f64);
    Ok(())
}
