//! Booting Linux on the microVM tier with hardware KVM, beside QEMU's `microvm` machine booting the same kernel and
//! initramfs in the same run (`cargo bench -p strata-tier-microvm --bench linux_boot`):
//!
//! | name               | contender            | what one iteration does                                                  |
//! |--------------------|----------------------|--------------------------------------------------------------------------|
//! | `boot_ready_line`  | strata, qemu         | start until the agent's `ready` line is on the serial console            |
//! | `boot_agent_ready` | strata, qemu (vsock) | the same, then connect to the agent over vsock and finish its handshake  |
//! | `true_via_tier`    | strata               | `MicrovmTier::run` of `/bin/true`: boot, agent, exec, exit, teardown     |
//! | `monitor_rss`      | strata, qemu         | resident memory of the monitor process minus its `memfd:` guest-RAM maps |
//!
//! Strata's start is `Microvm::boot` (memfd RAM, VM and irqchip, serial, virtio-vsock, kernel and initramfs loaded,
//! vCPU started); QEMU's is the spawn of `qemu-system-x86_64 -M microvm -accel kvm` with the same kernel, initramfs,
//! command line, RAM (a memfd backend) and one vCPU, its agent reached through `vhost-vsock-device` when
//! `/dev/vhost-vsock` is usable (else only `boot_ready_line` is compared). Teardown is not timed. Strata's RSS is
//! read in a fresh process of this binary that booted one VM, reached the agent and ran `/bin/true`, so the figure
//! is not inflated by the other iterations.
//!
//! Targets, printed beside the figures: `boot_agent_ready` p50 ≤ 60 ms, strata/qemu ≤ 0.5×, monitor RSS ≤ 5 MiB.
//! Nothing here asserts a time.
//!
//! It needs hardware KVM: elsewhere (a PVM `/dev/kvm`, like the machines Strata is developed on) it prints one
//! `linux_boot: skipped: …` line saying why and exits 0. It never builds the kernel (minutes): without the images it
//! says so in that line. Settings: `STRATA_BENCH_ITERS` (default 20; 3 under TCG), `STRATA_BENCH_QEMU` (the QEMU
//! binary), `STRATA_BENCH_KERNEL` and `STRATA_BENCH_INITRAMFS` (other images than the installed ones),
//! `STRATA_BENCH_QEMU_ACCEL=tcg` (the QEMU peer alone under TCG, which runs without KVM: it exercises the
//! peer's path and its figures are not comparable with a KVM boot).

use std::collections::VecDeque;
use std::fs;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use strata_benches::{Figures, latency, ratio};
use strata_core::{ByteSize, Capabilities, ExecOptions, Job, Limits, Status, Tier};
use strata_guest_proto::{AgentClient, ClientConfig, DEFAULT_AGENT_PORT, ExecRequest, ExitStatus, VsockStream};
use strata_tier_microvm::builder::{Microvm, MicrovmConfig};
use strata_tier_microvm::tier::{MicrovmTier, MicrovmTierConfig};
use strata_tier_microvm::vstate::vcpu::cpuid::CpuidProfile;

/// Guest RAM of every VM, both contenders.
const MEMORY_MIB: u64 = 256;
/// What the agent prints on the console once it listens on vsock.
const READY_LINE: &[u8] = b"strata-agent: ready";
/// The command line `Microvm::boot` gives the kernel, before its virtio-mmio devices (QEMU adds its own).
const CMDLINE: &str = "console=ttyS0 reboot=t panic=-1 pci=off nokaslr i8042.noaux i8042.nomux i8042.dumbkbd \
                       strata.halt=restart strata.port=1024";

const TARGET_BOOT_MS: f64 = 60.0;
const TARGET_RATIO: f64 = 0.5;
const TARGET_RSS_MIB: f64 = 5.0;

/// Set (to the kernel's path) in the fresh process that measures the monitor's RSS.
const CHILD_KERNEL_ENV: &str = "STRATA_LINUX_BOOT_CHILD_KERNEL";
const CHILD_INITRAMFS_ENV: &str = "STRATA_LINUX_BOOT_CHILD_INITRAMFS";
const CHILD_RUN_DIR_ENV: &str = "STRATA_LINUX_BOOT_CHILD_RUN_DIR";

/// Whether Linux guests can boot here: `Err` says why not (as `strata doctor` decides, from the kernel's files).
fn hardware_kvm() -> Result<(), String> {
    if !Path::new("/dev/kvm").exists() {
        return Err("this host has no /dev/kvm".into());
    }
    let cpuinfo = fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let flags = cpuinfo.lines().find(|l| l.starts_with("flags")).unwrap_or("");
    if flags.split_whitespace().any(|f| f == "vmx" || f == "svm") {
        return Ok(());
    }
    let modules = fs::read_to_string("/proc/modules").unwrap_or_default();
    if Path::new("/sys/module/kvm_pvm").exists() || modules.lines().any(|l| l.starts_with("kvm_pvm ")) {
        return Err("this host's /dev/kvm is PVM: kvm_pvm is loaded and the CPU has no VMX/SVM, so a stock guest \
                    kernel runs in KVM's instruction emulator and cannot boot"
            .into());
    }
    Err("/dev/kvm exists but the CPU has no VMX/SVM and no PVM module is loaded".into())
}

/// The guest kernel and initramfs, as the tier uses them.
struct Images {
    kernel: PathBuf,
    initramfs: PathBuf,
    release: String,
}

/// `$STRATA_BENCH_KERNEL` and `$STRATA_BENCH_INITRAMFS` when both are set; else the installed kernel and the
/// initramfs (built from the embedded agent and Debian's static busybox when missing: a second's work). `Err` lists
/// what is missing; a kernel build is never started here.
fn images() -> Result<Images, String> {
    if let (Some(kernel), Some(initramfs)) =
        (std::env::var_os("STRATA_BENCH_KERNEL"), std::env::var_os("STRATA_BENCH_INITRAMFS"))
    {
        return Ok(Images {
            kernel: kernel.into(),
            initramfs: initramfs.into(),
            release: "(STRATA_BENCH_KERNEL)".into(),
        });
    }
    let home = strata_benches::strata_home();
    let mut missing = Vec::new();
    let kernel = strata_kernel_image::KernelImage::new(&home).ok().and_then(|k| k.installed().ok());
    if kernel.is_none() {
        missing.push(format!(
            "the guest kernel is not built under {} (`strata images build kernel`, minutes; this bench does not \
             start it)",
            home.join("images").display()
        ));
    }
    let initramfs = match strata_tier_microvm::guest::agent_binary() {
        Err(_) => {
            missing.push("this build has no guest agent (rustup target add x86_64-unknown-linux-musl)".into());
            None
        }
        Ok(agent) => {
            let busybox = Path::new(strata_rootfs_image::initramfs::BUSYBOX_STATIC);
            match strata_rootfs_image::initramfs::ensure_initramfs(&home, agent, busybox) {
                Ok(installed) => Some(installed.path),
                Err(err) => {
                    missing.push(format!("no initramfs: {err}"));
                    None
                }
            }
        }
    };
    match (kernel, initramfs) {
        (Some(kernel), Some(initramfs)) => Ok(Images { kernel: kernel.vmlinux, initramfs, release: kernel.release }),
        _ => Err(missing.join("; ")),
    }
}

/// One boot's milestones, from the start.
struct BootSample {
    ready_line: Duration,
    agent: Option<Duration>,
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

fn microvm_config(images: &Images, run_dir: &Path) -> MicrovmConfig {
    MicrovmConfig {
        kernel: images.kernel.clone(),
        initramfs: images.initramfs.clone(),
        root_disk: None,
        memory_bytes: MEMORY_MIB << 20,
        vcpus: 1,
        cpuid: CpuidProfile::Standard,
        run_dir: run_dir.to_owned(),
    }
}

/// Boots one microVM, waits for the ready line, then connects to the agent (handshake included).
fn strata_boot(config: &MicrovmConfig, timeout: Duration) -> anyhow::Result<BootSample> {
    let started = Instant::now();
    let mut vm = Microvm::boot(config)?;
    let mut ready_line = None;
    while ready_line.is_none() && !vm.has_stopped() && started.elapsed() < timeout {
        if contains(vm.console().as_bytes(), READY_LINE) {
            ready_line = Some(started.elapsed());
        } else {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    // Reports a crash or a timeout with the console's tail.
    let client = vm.connect_agent(timeout)?;
    let agent = started.elapsed();
    let ready_line = ready_line.context("the agent answered, but its ready line never reached the console")?;
    drop(client);
    vm.shutdown();
    Ok(BootSample { ready_line, agent: Some(agent) })
}

/// Resident memory of a process, from its `smaps`, split by whether a mapping is guest RAM (`memfd:`).
#[derive(Debug, Default, Clone, Copy)]
struct Rss {
    total_kib: u64,
    guest_kib: u64,
    /// `Anonymous` of the mappings that are not guest RAM.
    anon_kib: u64,
}

impl Rss {
    fn parse(smaps: &str) -> Rss {
        let mut rss = Rss::default();
        let mut guest = false;
        for line in smaps.lines() {
            let mut words = line.split_whitespace();
            let Some(first) = words.next() else { continue };
            if !first.ends_with(':') {
                // A mapping's header: range, perms, offset, device, inode, then the name (which may hold spaces).
                guest = line.split_whitespace().skip(5).any(|w| w.contains("memfd:"));
                continue;
            }
            let kib = words.next().and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
            match first {
                "Rss:" => {
                    rss.total_kib += kib;
                    if guest {
                        rss.guest_kib += kib;
                    }
                }
                "Anonymous:" if !guest => rss.anon_kib += kib,
                _ => {}
            }
        }
        rss
    }

    fn of(pid: &str) -> anyhow::Result<Rss> {
        let path = format!("/proc/{pid}/smaps");
        let text = fs::read_to_string(&path).with_context(|| format!("cannot read {path}"))?;
        let rss = Rss::parse(&text);
        ensure!(rss.total_kib > 0, "{path} shows no resident memory");
        Ok(rss)
    }

    fn monitor_mib(&self) -> f64 {
        (self.total_kib - self.guest_kib) as f64 / 1024.0
    }

    fn print(&self, who: &str, target: bool) {
        let verdict = if !target {
            String::new()
        } else if self.monitor_mib() <= TARGET_RSS_MIB {
            format!("   target ≤ {TARGET_RSS_MIB} MiB: met")
        } else {
            format!("   target ≤ {TARGET_RSS_MIB} MiB: MISSED")
        };
        println!(
            "{:<26} {who:<36} {:>7.2} MiB excl. guest RAM (anon {:.2} MiB; guest RAM resident {:.1} MiB){verdict}",
            "monitor_rss",
            self.monitor_mib(),
            self.anon_kib as f64 / 1024.0,
            self.guest_kib as f64 / 1024.0,
        );
    }

    fn to_line(self) -> String {
        format!("rss-kib {} {} {}", self.total_kib, self.guest_kib, self.anon_kib)
    }

    fn from_line(line: &str) -> Option<Rss> {
        let mut words = line.strip_prefix("rss-kib ")?.split(' ').map(|w| w.parse::<u64>().ok());
        Some(Rss { total_kib: words.next()??, guest_kib: words.next()??, anon_kib: words.next()?? })
    }
}

/// In the fresh process: one VM, its agent, `/bin/true`, then this process's RSS on stdout.
fn rss_child(kernel: PathBuf) -> anyhow::Result<()> {
    let var = |name| std::env::var_os(name).map(PathBuf::from).with_context(|| format!("{name} is not set"));
    let images = Images { kernel, initramfs: var(CHILD_INITRAMFS_ENV)?, release: String::new() };
    let mut vm = Microvm::boot(&microvm_config(&images, &var(CHILD_RUN_DIR_ENV)?))?;
    let client = vm.connect_agent(Duration::from_secs(20))?;
    let request = ExecRequest { argv: vec!["/bin/true".into()], cwd: "/".into(), ..Default::default() };
    let report = client.exec(&request, b"", |_, _| {})?;
    ensure!(report.status == ExitStatus::Code(0), "/bin/true ended {:?}", report.status);
    let rss = Rss::of("self")?;
    println!("{}", rss.to_line());
    drop(client);
    vm.shutdown();
    Ok(())
}

fn strata_rss(images: &Images, run_dir: &Path) -> anyhow::Result<Rss> {
    let out = Command::new(std::env::current_exe()?)
        .env(CHILD_KERNEL_ENV, &images.kernel)
        .env(CHILD_INITRAMFS_ENV, &images.initramfs)
        .env(CHILD_RUN_DIR_ENV, run_dir)
        .stdin(Stdio::null())
        .output()?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    ensure!(out.status.success(), "the RSS process failed ({}): {}", out.status, String::from_utf8_lossy(&out.stderr));
    stdout.lines().find_map(Rss::from_line).with_context(|| format!("the RSS process printed {stdout:?}"))
}

/// How QEMU runs its guest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Accel {
    Kvm,
    Tcg,
}

impl Accel {
    fn name(self) -> &'static str {
        match self {
            Accel::Kvm => "kvm",
            Accel::Tcg => "tcg",
        }
    }
}

/// The QEMU peer.
struct Qemu {
    binary: PathBuf,
    accel: Accel,
    /// `vhost-vsock-device` is usable: the agent is reached as on Strata.
    vsock: bool,
}

impl Qemu {
    /// `$STRATA_BENCH_QEMU`, else `qemu-system-x86_64` on `PATH`; `Err` says why there is no peer.
    fn find(accel: Accel) -> Result<Qemu, String> {
        let binary = match std::env::var_os("STRATA_BENCH_QEMU") {
            Some(path) => PathBuf::from(path),
            None => std::env::var_os("PATH")
                .iter()
                .flat_map(std::env::split_paths)
                .map(|dir| dir.join("qemu-system-x86_64"))
                .find(|p| p.is_file())
                .ok_or("qemu-system-x86_64 is not installed (apt-get install qemu-system-x86)")?,
        };
        let devices = Command::new(&binary)
            .args(["-machine", "microvm", "-device", "help"])
            .stdin(Stdio::null())
            .output()
            .map_err(|e| format!("cannot run {}: {e}", binary.display()))?;
        let devices = String::from_utf8_lossy(&devices.stdout);
        let device = devices.contains("\"vhost-vsock-device\"");
        let host = fs::OpenOptions::new().read(true).write(true).open("/dev/vhost-vsock").is_ok();
        Ok(Qemu { binary, accel, vsock: device && host })
    }

    /// The contender's name in the figures.
    fn describe(&self) -> String {
        format!("qemu -M microvm ({}, {})", self.accel.name(), if self.vsock { "vsock" } else { "serial" })
    }

    /// One line on how the peer runs.
    fn print_header(&self) {
        let agent = if self.vsock {
            "the agent reached over vhost-vsock-device"
        } else {
            "boot_ready_line only: no usable /dev/vhost-vsock (modprobe vhost_vsock) or no vhost-vsock-device in \
             this QEMU"
        };
        println!("{:<26} {}, -accel {}, {agent}", "qemu peer", self.binary.display(), self.accel.name());
    }

    /// One boot: spawn to the ready line, then (with vsock) the agent's handshake; the RSS of the running QEMU
    /// when asked.
    fn boot(
        &self,
        images: &Images,
        cid: u32,
        timeout: Duration,
        rss: bool,
    ) -> anyhow::Result<(BootSample, Option<Rss>)> {
        let memory = format!("{MEMORY_MIB}M");
        let mut cmd = Command::new(&self.binary);
        cmd.args(["-machine", "microvm,acpi=off,memory-backend=ram", "-accel", self.accel.name()])
            .args(["-cpu", if self.accel == Accel::Kvm { "host" } else { "max" }, "-smp", "1", "-m", &memory])
            .args(["-object", &format!("memory-backend-memfd,id=ram,size={memory}")])
            .args(["-nodefaults", "-no-user-config", "-nographic", "-serial", "stdio"])
            .arg("-kernel")
            .arg(&images.kernel)
            .arg("-initrd")
            .arg(&images.initramfs)
            .args(["-append", CMDLINE]);
        if self.vsock {
            cmd.args(["-device", &format!("vhost-vsock-device,guest-cid={cid}")]);
        }
        cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
        let started = Instant::now();
        let mut child = Reaped(cmd.spawn().with_context(|| format!("cannot start {}", self.binary.display()))?);
        let stdout = child.0.stdout.take().context("qemu's stdout")?;
        let (lines, console) = mpsc::channel();
        let reader = std::thread::spawn(move || {
            let mut stdout = BufReader::new(stdout);
            let mut line = Vec::new();
            while stdout.read_until(b'\n', &mut line).is_ok_and(|n| n > 0) {
                if lines.send((Instant::now(), std::mem::take(&mut line))).is_err() {
                    break;
                }
            }
        });
        let mut tail: VecDeque<String> = VecDeque::new();
        let ready_line = loop {
            let left = timeout.saturating_sub(started.elapsed());
            match console.recv_timeout(left) {
                Ok((at, line)) if contains(&line, READY_LINE) => break at - started,
                Ok((_, line)) => {
                    if tail.len() == 20 {
                        tail.pop_front();
                    }
                    tail.push_back(String::from_utf8_lossy(&line).trim_end().to_owned());
                }
                Err(err) => {
                    let why = match err {
                        mpsc::RecvTimeoutError::Timeout => format!("no ready line within {timeout:?}"),
                        mpsc::RecvTimeoutError::Disconnected => "qemu exited before the ready line".into(),
                    };
                    let _ = child.0.kill();
                    let mut stderr = String::new();
                    if let Some(mut pipe) = child.0.stderr.take() {
                        let _ = pipe.read_to_string(&mut stderr);
                    }
                    let console = Vec::from(tail).join("\n");
                    bail!("{}: {why}; stderr:\n{stderr}\nconsole:\n{console}", self.describe());
                }
            }
        };
        let agent = if self.vsock {
            let stream = loop {
                match VsockStream::connect(cid, DEFAULT_AGENT_PORT) {
                    Ok(stream) => break stream,
                    Err(err) if started.elapsed() >= timeout => {
                        bail!(
                            "{}: cannot connect to the agent at vsock {cid}:{DEFAULT_AGENT_PORT}: {err}",
                            self.describe()
                        )
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(1)),
                }
            };
            let client = AgentClient::connect(stream, ClientConfig { timeout: Some(Duration::from_secs(10)) })?;
            let at = started.elapsed();
            drop(client);
            Some(at)
        } else {
            None
        };
        let rss = if rss { Some(Rss::of(&child.0.id().to_string())?) } else { None };
        drop(child);
        let _ = reader.join();
        Ok((BootSample { ready_line, agent }, rss))
    }
}

/// A child process killed and reaped when dropped.
struct Reaped(Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Figures of one contender's boots.
struct Boots {
    ready_line: Figures,
    agent: Figures,
    rss: Option<Rss>,
}

/// `warmup` untimed boots, then `iters` timed ones; `boot(i, last)` does one.
fn boots(
    iters: usize,
    warmup: usize,
    mut boot: impl FnMut(usize, bool) -> anyhow::Result<(BootSample, Option<Rss>)>,
) -> anyhow::Result<Boots> {
    let mut out =
        Boots { ready_line: Figures::new("boot_ready_line"), agent: Figures::new("boot_agent_ready"), rss: None };
    for i in 0..warmup + iters {
        let last = i + 1 == warmup + iters;
        let (sample, rss) = boot(i, last)?;
        if i >= warmup {
            out.ready_line.record(sample.ready_line);
            if let Some(agent) = sample.agent {
                out.agent.record(agent);
            }
        }
        out.rss = rss.or(out.rss);
    }
    Ok(out)
}

fn iterations(default: usize) -> usize {
    std::env::var("STRATA_BENCH_ITERS").ok().and_then(|v| v.parse().ok()).filter(|&n| n > 0).unwrap_or(default)
}

fn peer_cid(i: usize) -> u32 {
    // Unique on the host while this process lives; each QEMU is reaped before the next one starts.
    0x1000_0000 + std::process::id() * 4 + (i % 4) as u32
}

fn verdict(met: bool) -> &'static str {
    if met { "met" } else { "MISSED" }
}

/// Everything, on a host with hardware KVM and the images.
fn measure(images: &Images, accel: Accel) -> anyhow::Result<()> {
    let iters = iterations(20);
    let warmup = (iters / 10).max(1);
    let scratch = tempfile::tempdir()?;
    println!(
        "linux_boot: hardware KVM; {iters} iterations per figure; guest {MEMORY_MIB} MiB, 1 vCPU, kernel {}, \
         initramfs {}",
        images.release,
        images.initramfs.display()
    );

    let config = microvm_config(images, scratch.path());
    let timeout = Duration::from_secs(20);
    let mut strata = boots(iters, warmup, |_, _| Ok((strata_boot(&config, timeout)?, None)))?;
    strata.rss = Some(strata_rss(images, scratch.path())?);

    let tier = MicrovmTier::new(MicrovmTierConfig {
        kernel: images.kernel.clone(),
        initramfs: images.initramfs.clone(),
        root_disk: None,
        run_dir: scratch.path().to_owned(),
        cpuid: CpuidProfile::Standard,
        snapshots: strata_core::SnapshotTrust::process_local(),
    });
    let limits = Limits { memory: ByteSize(MEMORY_MIB << 20), ..Limits::default() };
    let job = Job::Command { argv: vec!["/bin/true".into()] };
    let true_via_tier = latency("true_via_tier", iters, || {
        let outcome = tier.run(&job, &Capabilities::default(), &limits, ExecOptions::default())?;
        ensure!(
            matches!(outcome.status, Status::Exited { code: 0 }),
            "/bin/true ended {:?}: {}",
            outcome.status,
            String::from_utf8_lossy(&outcome.stderr)
        );
        Ok(())
    })?;

    let who = "strata-tier-microvm";
    strata.ready_line.print(who);
    strata.agent.print(who);
    true_via_tier.print(who);
    let boot_p50_ms = strata.agent.p_us(0.5) / 1000.0;
    if let Some(rss) = &strata.rss {
        rss.print(who, true);
    }

    let peer = match Qemu::find(accel) {
        Ok(qemu) => {
            qemu.print_header();
            let name = qemu.describe();
            let timeout = Duration::from_secs(if accel == Accel::Tcg { 120 } else { 20 });
            let figures = boots(iters, warmup, |i, last| qemu.boot(images, peer_cid(i), timeout, last))?;
            figures.ready_line.print(&name);
            if !figures.agent.is_empty() {
                figures.agent.print(&name);
            }
            if let Some(rss) = &figures.rss {
                rss.print(&name, false);
            }
            Some((qemu, figures))
        }
        Err(why) => {
            println!("{:<26} skipped: {why}", "qemu peer");
            None
        }
    };

    println!(
        "{:<26} boot_agent_ready p50 ≤ {TARGET_BOOT_MS} ms: {boot_p50_ms:.1} ms {}",
        "target",
        verdict(boot_p50_ms <= TARGET_BOOT_MS)
    );
    match peer {
        Some((qemu, _)) if qemu.accel == Accel::Tcg => {
            println!("{:<26} no ratio: the qemu peer ran under TCG, not comparable with a KVM boot", "target");
        }
        Some((_, figures)) => {
            let (name, ours, theirs) = if figures.agent.is_empty() {
                ("boot_ready_line", &strata.ready_line, &figures.ready_line)
            } else {
                ("boot_agent_ready", &strata.agent, &figures.agent)
            };
            ratio(name, ours, theirs, "qemu");
            let r = ours.p_us(0.5) / theirs.p_us(0.5);
            println!(
                "{:<26} {name} strata/qemu p50 ≤ {TARGET_RATIO}x: {r:.2}x {}",
                "target",
                verdict(r <= TARGET_RATIO)
            );
        }
        None => println!("{:<26} no ratio: no qemu peer", "target"),
    }
    Ok(())
}

/// The QEMU peer alone under TCG, where Strata cannot boot Linux: the peer's path exercised, nothing compared.
fn tcg_peer_only(images: &Images, why_not_strata: &str) -> anyhow::Result<()> {
    println!("linux_boot: Strata not measured: needs hardware KVM ({why_not_strata})");
    let qemu = match Qemu::find(Accel::Tcg) {
        Ok(qemu) => qemu,
        Err(why) => {
            println!("linux_boot: qemu peer skipped: {why}");
            return Ok(());
        }
    };
    let iters = iterations(3);
    println!(
        "linux_boot: the qemu peer alone under TCG (software emulation), {iters} iterations, kernel {}: NOT \
         comparable with a KVM boot",
        images.release
    );
    qemu.print_header();
    let name = qemu.describe();
    let figures = boots(iters, 0, |i, last| qemu.boot(images, peer_cid(i), Duration::from_secs(120), last))?;
    figures.ready_line.print(&name);
    if !figures.agent.is_empty() {
        figures.agent.print(&name);
    }
    if let Some(rss) = &figures.rss {
        rss.print(&name, false);
    }
    Ok(())
}

fn main() -> anyhow::Result<()> {
    if let Some(kernel) = std::env::var_os(CHILD_KERNEL_ENV) {
        return rss_child(kernel.into());
    }
    let accel = match std::env::var("STRATA_BENCH_QEMU_ACCEL").ok().as_deref() {
        None | Some("" | "kvm") => Accel::Kvm,
        Some("tcg") => Accel::Tcg,
        Some(other) => bail!("STRATA_BENCH_QEMU_ACCEL={other}: expected kvm or tcg"),
    };
    match (hardware_kvm(), images()) {
        (Ok(()), Ok(images)) => measure(&images, accel),
        (Ok(()), Err(missing)) => {
            println!("linux_boot: skipped: the guest images are not built: {missing}");
            Ok(())
        }
        (Err(why), Ok(images)) if accel == Accel::Tcg => tcg_peer_only(&images, &why),
        (Err(why), images) => {
            let also = match images {
                Ok(_) => String::new(),
                Err(missing) if accel == Accel::Tcg => {
                    format!("; the TCG qemu peer needs the guest images, which are not built: {missing}")
                }
                Err(missing) => format!("; the guest images are not built either: {missing}"),
            };
            println!("linux_boot: skipped: needs hardware KVM ({why}){also}");
            Ok(())
        }
    }
}
