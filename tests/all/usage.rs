//! What a live sandbox uses (`Sandbox::usage`): the process tier reads its jail's cgroup and writable layer, so
//! CPU burnt, memory held and files written show in it, bounded by the sandbox's limits; wasm does not measure.

use strata_core::{ByteSize, Capabilities, ExecOptions, Job, Limits, Status, Tier, TierError};

use crate::util::{process_tier, python_engine};

fn sh(script: &str) -> Job {
    Job::Command { argv: vec!["/bin/sh".into(), "-c".into(), script.into()] }
}

#[test]
fn a_process_sandbox_reports_its_cpu_memory_and_disk() {
    let Some(tier) = process_tier("a_process_sandbox_reports_its_cpu_memory_and_disk") else { return };
    let limits = Limits { memory: ByteSize(512 << 20), disk: ByteSize(256 << 20), ..Limits::default() };
    let sandbox = tier.start(&Capabilities::default(), &limits).expect("start");
    let before = sandbox.usage().expect("usage");
    assert_eq!(before.cpu_count, limits.vcpus);
    assert_eq!(before.memory_total, 512 << 20);
    assert!(before.disk_total > 0 && before.disk_total <= 256 << 20, "{before:?}");
    // A fixed amount of work (its CPU time whatever else runs on the host), and 16 MiB written to the sandbox's own
    // filesystem.
    let job =
        sh("i=0; while [ $i -lt 300000 ]; do i=$((i+1)); done; dd if=/dev/zero of=/tmp/big bs=1M count=16 2>/dev/null");
    let outcome = sandbox.exec(&job, ExecOptions::default()).expect("exec");
    assert_eq!(outcome.status, Status::Exited { code: 0 });
    let after = sandbox.usage().expect("usage");
    // The sandbox's CPU time holds the job's (measured on its own cgroup, inside the sandbox's).
    assert!(outcome.usage.cpu >= std::time::Duration::from_millis(50), "{:?}", outcome.usage);
    assert!(
        after.cpu_time >= before.cpu_time + outcome.usage.cpu.mul_f64(0.9),
        "{before:?} {after:?} {:?}",
        outcome.usage
    );
    assert!(after.disk_used >= before.disk_used + (15 << 20), "{before:?} {after:?}");
    // The file's pages are the jail's tmpfs, charged to its memory.
    assert!(after.memory_used >= 16 << 20 && after.memory_used <= after.memory_total, "{after:?}");
    sandbox.close().expect("close");
    assert!(matches!(sandbox.usage(), Err(TierError::SessionEnded { .. })));
}

#[test]
fn a_wasm_sandbox_does_not_measure_its_use() {
    let engine = python_engine();
    let sandbox = engine.wasm().start(&Capabilities::default(), &Limits::default()).expect("start");
    assert!(matches!(sandbox.usage(), Err(TierError::Unsupported { .. })));
    sandbox.close().expect("close");
}
