//! The microVM tier's integration tests, in one binary: a module per area.
//!
//! - [`kvm`]: the monitor core on real KVM with tiny hand-assembled guests; [`snapshot`]: their snapshots,
//!   restores and forks.
//! - [`devices`]: the virtio devices driven by the in-process guest driver, no vCPU.
//! - [`session`] (with its `egress` and `files`) and [`grants`]: the real guest agent, run as a host process
//!   ([`agent_process`]).
//! - [`monitor`]: tiny guests through the jailed monitor process: the jail and the filters seen from the host,
//!   calls outside a filter, saving in one monitor and forking into another, nothing left behind.
//! - [`linux_boot`] and [`guest_image`]: our kernel booted on Strata's monitor and under qemu.
//!
//! Every test shares this process with the others, so each takes one guard of
//! [`strata_vmm::test_utils::process`] first: [`kvm`](strata_vmm::test_utils::process::kvm) or
//! [`alone`](strata_vmm::test_utils::process::alone) when it runs vCPUs or checks the process's fds and threads
//! for leaks, [`shared`](strata_vmm::test_utils::process::shared) otherwise. Tests that need something this host
//! lacks (`/dev/kvm`, hardware virtualisation, the built kernel, the agent) pass after one `skip:` line.

mod agent_process;
mod devices;
mod grants;
mod guest_image;
mod kvm;
mod linux_boot;
mod monitor;
mod session;
mod snapshot;

use std::fmt;
use std::path::{Path, PathBuf};

/// Where Strata keeps its images: `$STRATA_HOME`, else `~/.cache/strata`.
fn strata_home() -> Option<PathBuf> {
    std::env::var_os("STRATA_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/strata")))
}

/// What `/dev/kvm` is on this host.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum KvmKind {
    /// KVM on VMX or SVM: a stock Linux guest boots.
    Hardware,
    /// PVM: KVM without hardware virtualisation, whose instruction emulator cannot run a stock kernel.
    Pvm,
    /// No usable `/dev/kvm`.
    None,
}

impl fmt::Display for KvmKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            KvmKind::Hardware => "hardware",
            KvmKind::Pvm => "pvm",
            KvmKind::None => "none",
        })
    }
}

fn kvm_kind() -> KvmKind {
    if !Path::new("/dev/kvm").exists() {
        return KvmKind::None;
    }
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let flags = cpuinfo.lines().find(|l| l.starts_with("flags")).unwrap_or("");
    if flags.split_whitespace().any(|f| f == "vmx" || f == "svm") {
        KvmKind::Hardware
    } else if Path::new("/sys/module/kvm_pvm").exists() {
        KvmKind::Pvm
    } else {
        KvmKind::None
    }
}
