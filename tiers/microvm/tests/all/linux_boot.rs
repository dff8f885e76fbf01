//! Booting our guest kernel (`strata images build kernel`) on Strata's own monitor.
//!
//! With hardware KVM the kernel must reach user space (it panics on the missing root at the end, which is the
//! milestone without an initramfs). On a PVM host (`/dev/kvm` without VMX/SVM, like the machines Strata is developed
//! on) a kernel that is not PVM-aware runs in KVM's instruction emulator and cannot boot: the test prints one skip
//! line saying so. `STRATA_PVM_BOOT_SECONDS=N` runs the boot there anyway for N seconds and prints how far the kernel
//! got (the serial log's last lines and how the vCPU stopped): a measurement, not a test.

use std::fs::File;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use linux_loader::cmdline::Cmdline;
use strata_tier_microvm::boot::{self, BootProtocol, CMDLINE_MAX_SIZE};
use strata_tier_microvm::devices::bus::Bus;
use strata_tier_microvm::devices::serial::{SERIAL_GSI, SERIAL_PORT_BASE, SERIAL_PORT_LEN, SerialDevice, SerialLog};
use strata_tier_microvm::vstate::memory::GuestMemory;
use strata_tier_microvm::vstate::vcpu::cpuid::CpuidProfile;
use strata_tier_microvm::vstate::vcpu::{Vcpu, VcpuConfig, VcpuExit};
use strata_tier_microvm::vstate::vm::{Vm, VmConfig};
use strata_vmm::test_utils::process::alone;

use crate::{KvmKind, kvm_kind, strata_home};

/// Boots the installed kernel with a serial console and no root, for at most `limit`; returns the serial log, how
/// the vCPU ended (or `None` when it was stopped at the limit) and how long it ran.
fn boot(vmlinux: &std::path::Path, cpuid: CpuidProfile, limit: Duration) -> (SerialLog, Option<VcpuExit>, Duration) {
    // Under PVM the guest still detects XSAVE with the XSAVE bits masked out of the CPUID we set; `noxsave` makes
    // it use FXSAVE.
    let extra = if cpuid == CpuidProfile::PvmCompat { " noxsave" } else { "" };
    let mem = GuestMemory::new(256 << 20).expect("guest memory");
    let mut cmdline = Cmdline::new(CMDLINE_MAX_SIZE).expect("cmdline");
    let args = format!("console=ttyS0 reboot=k panic=-1 pci=off nokaslr lpj=1000000 tsc=reliable{extra}");
    cmdline.insert_str(args).expect("cmdline");
    let mut kernel = File::open(vmlinux).expect("vmlinux");
    let loaded = boot::load_kernel(&mem, &mut kernel, &cmdline, None, BootProtocol::Linux64).expect("load kernel");
    let mut vm = Vm::new(&VmConfig { irqchip: true }).expect("vm");
    vm.register_memory(&mem).expect("memory");
    let serial = SerialDevice::new(256 * 1024).expect("serial");
    vm.register_irqfd(serial.interrupt_evt(), SERIAL_GSI).expect("irqfd");
    let log = serial.log();
    let mut io = Bus::new();
    io.insert(Arc::new(Mutex::new(serial)), SERIAL_PORT_BASE, SERIAL_PORT_LEN).expect("serial");
    let vcpu = Vcpu::new(&vm, 0, io, Bus::new()).expect("vcpu");
    vcpu.configure(&vm, &VcpuConfig { vcpu_count: 1, cpuid }).expect("configure");
    vcpu.set_entry(&loaded.entry).expect("entry");
    let started = Instant::now();
    let thread = vcpu.start().expect("start");
    let deadline = started + limit;
    while !thread.is_finished() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let stopped = !thread.is_finished();
    if stopped {
        thread.kick().expect("kick");
    }
    let (_vcpu, exit) = thread.join().expect("join");
    let ran = started.elapsed();
    (log, if stopped { None } else { Some(exit.unwrap_or(VcpuExit::Stopped)) }, ran)
}

fn tail(log: &SerialLog, lines: usize) -> String {
    let text = String::from_utf8_lossy(&log.contents()).into_owned();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

#[test]
fn our_kernel_boots_to_user_space_on_hardware_kvm() {
    let _alone = alone();
    let Some(kernel) =
        strata_home().and_then(|h| strata_kernel_image::KernelImage::new(&h).ok()).and_then(|k| k.installed().ok())
    else {
        eprintln!("skip: the guest kernel is not built (strata images build kernel)");
        return;
    };
    match kvm_kind() {
        KvmKind::Hardware => {
            let (log, exit, ran) = boot(&kernel.vmlinux, CpuidProfile::Standard, Duration::from_secs(20));
            let text = String::from_utf8_lossy(&log.contents()).into_owned();
            assert!(
                text.contains("Kernel panic - not syncing: VFS") || text.contains("Run /init"),
                "the kernel did not reach its root mount in {ran:?} (exit {exit:?}):\n{}",
                tail(&log, 30)
            );
        }
        KvmKind::Pvm => match std::env::var("STRATA_PVM_BOOT_SECONDS").ok().and_then(|s| s.parse::<u64>().ok()) {
            Some(seconds) => {
                for profile in [CpuidProfile::Standard, CpuidProfile::PvmCompat] {
                    let (log, exit, ran) = boot(&kernel.vmlinux, profile, Duration::from_secs(seconds));
                    eprintln!(
                        "PVM boot with {profile:?}: {ran:.1?}, {} serial bytes, ended {exit:?}; last lines:\n{}\n",
                        log.contents().len(),
                        tail(&log, 12)
                    );
                }
            }
            None => eprintln!(
                "skip: booting Linux needs hardware KVM; this host's /dev/kvm is PVM, whose instruction emulator \
                 cannot run a stock kernel (STRATA_PVM_BOOT_SECONDS=N measures how far it gets)"
            ),
        },
        KvmKind::None => {
            eprintln!("skip: booting Linux needs /dev/kvm with hardware virtualisation; this host has none")
        }
    }
}

/// What booting a real microVM needs here; `None` (after one skip line) when something is missing.
struct Inputs {
    home: std::path::PathBuf,
    kernel: strata_kernel_image::InstalledKernel,
    kind: KvmKind,
    scratch: tempfile::TempDir,
    initramfs: strata_rootfs_image::initramfs::InstalledInitramfs,
}

fn inputs() -> Option<Inputs> {
    let home = strata_home()?;
    let Some(kernel) = strata_kernel_image::KernelImage::new(&home).ok().and_then(|k| k.installed().ok()) else {
        eprintln!("skip: the guest kernel is not built (strata images build kernel)");
        return None;
    };
    let Ok(agent) = strata_tier_microvm::guest::agent_binary() else {
        eprintln!("skip: this build has no guest agent (the x86_64-unknown-linux-musl target is missing)");
        return None;
    };
    let kind = kvm_kind();
    if kind == KvmKind::None {
        eprintln!("skip: no /dev/kvm");
        return None;
    }
    let scratch = tempfile::tempdir().expect("tempdir");
    let busybox = std::path::Path::new(strata_rootfs_image::initramfs::BUSYBOX_STATIC);
    let Ok(initramfs) = strata_rootfs_image::initramfs::ensure_initramfs(scratch.path(), agent, busybox) else {
        eprintln!("skip: no static busybox for the initramfs");
        return None;
    };
    Some(Inputs { home, kernel, kind, scratch, initramfs })
}

/// The whole microVM as the tier builds it — memfd RAM, irqchip, serial, virtio-vsock for the agent, virtio-blk for
/// the Debian disk, our kernel and initramfs — then the agent over vsock. On hardware KVM the agent answers and runs a
/// command; on PVM the guest dies in the emulator, and that must come back as a typed `GuestDied` with the console,
/// fast (no hang), leaving no vCPU thread or socket behind.
#[test]
fn a_microvm_reaches_its_agent_or_reports_why_not() {
    use strata_tier_microvm::builder::{BuildError, Microvm, MicrovmConfig};
    let _alone = alone();
    let Some(Inputs { home, kernel, kind, scratch, initramfs }) = inputs() else { return };
    let disk = strata_rootfs_image::DebianImage::new(&home)
        .and_then(|image| image.installed())
        .and_then(|rootfs| strata_rootfs_image::disk::ensure_disk_image(&rootfs, &|_| {}))
        .ok()
        .map(|disk| disk.path);
    let cpuid = if kind == KvmKind::Pvm { CpuidProfile::PvmCompat } else { CpuidProfile::Standard };
    let config = MicrovmConfig {
        kernel: kernel.vmlinux,
        initramfs: initramfs.path,
        root_disk: disk,
        memory_bytes: 256 << 20,
        vcpus: 1,
        cpuid,
        run_dir: scratch.path().to_owned(),
    };
    let started = Instant::now();
    let mut vm = Microvm::boot(&config).expect("build the microVM");
    let result = vm.connect_agent(Duration::from_secs(if kind == KvmKind::Pvm { 120 } else { 20 }));
    match (kind, result) {
        (KvmKind::Hardware, Ok(client)) => {
            let request = strata_guest_proto::ExecRequest {
                argv: vec!["uname".into(), "-r".into()],
                cwd: "/".into(),
                ..Default::default()
            };
            let mut out = Vec::new();
            let report = client.exec(&request, b"", |_, data| out.extend_from_slice(data)).expect("exec");
            assert_eq!(report.status, strata_guest_proto::ExitStatus::Code(0));
            assert_eq!(String::from_utf8_lossy(&out).trim(), kernel.release);
            eprintln!("agent ready and a command run {:.1?} after boot", started.elapsed());
        }
        (KvmKind::Pvm, Err(BuildError::GuestDied { exit, console })) => {
            assert!(!console.is_empty(), "the console captured nothing");
            eprintln!(
                "PVM: the guest stopped after {:.1?} as expected on this host ({exit}); console tail:\n{console}",
                started.elapsed()
            );
        }
        (kind, other) => panic!("{kind} KVM: unexpected {other:?}\nconsole:\n{}", vm.console_tail(30)),
    }
    let socket_dir = scratch.path().to_owned();
    vm.shutdown();
    let threads = std::fs::read_dir("/proc/self/task")
        .expect("tasks")
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|comm| comm.starts_with("strata-vcpu"))
        .count();
    assert_eq!(threads, 0, "vCPU threads left running");
    let sockets = std::fs::read_dir(&socket_dir)
        .expect("dir")
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().ends_with(".sock"))
        .count();
    assert_eq!(sockets, 0, "the vsock socket was left behind");
}

/// The tier end to end: a job through `Tier::run`. On hardware KVM it runs; on PVM the guest dies before its agent
/// and the outcome says `crashed`, with the console in stderr — a typed answer in seconds, not a hang.
#[test]
fn the_tier_runs_a_job_or_reports_the_crash() {
    use strata_core::{Capabilities, ExecOptions, Job, Limits, Status, Tier};
    use strata_tier_microvm::tier::{MicrovmTier, MicrovmTierConfig};
    let _alone = alone();
    let Some(Inputs { kernel, kind, scratch, initramfs, .. }) = inputs() else { return };
    let tier = MicrovmTier::new(MicrovmTierConfig {
        kernel: kernel.vmlinux,
        initramfs: initramfs.path,
        root_disk: None,
        run_dir: scratch.path().to_owned(),
        cpuid: if kind == KvmKind::Pvm { CpuidProfile::PvmCompat } else { CpuidProfile::Standard },
        snapshots: strata_core::SnapshotTrust::process_local(),
    });
    let limits = Limits { memory: strata_core::ByteSize(256 << 20), ..Limits::default() };
    let job = Job::Command { argv: vec!["echo".into(), "hello".into()] };
    let started = Instant::now();
    let outcome = tier.run(&job, &Capabilities::default(), &limits, ExecOptions::default()).expect("run");
    match (kind, &outcome.status) {
        (KvmKind::Hardware, Status::Exited { code: 0 }) => assert_eq!(outcome.stdout, b"hello\n"),
        (KvmKind::Pvm, Status::Crashed { message }) => {
            assert!(!outcome.stderr.is_empty(), "no console in stderr");
            eprintln!("PVM: crashed after {:.1?}: {message}", started.elapsed());
        }
        (kind, _) => panic!("{kind} KVM: unexpected {outcome:?}"),
    }
    let wasm = Job::Wasm { module: strata_core::ModuleSource::File("x.wasm".into()), args: vec![] };
    let err = tier.run(&wasm, &Capabilities::default(), &limits, ExecOptions::default()).expect_err("wasm");
    assert_eq!(err.code(), "wrong_job");
}

/// The builder records every device it places, so a booted Linux VM can be paused, saved and forked into a new
/// monitor like the tiny guests. Here the guest is still booting (on PVM it dies in the emulator later on; this only
/// needs it to be running): the saved state holds the serial console, virtio-vsock and (with the Debian disk)
/// virtio-blk; the fork gets its own vsock socket, and everything is released afterwards.
#[test]
fn a_booting_microvm_is_snapshotted_and_forked_with_its_devices() {
    use strata_tier_microvm::builder::{Microvm, MicrovmConfig};
    use strata_tier_microvm::persist::VirtioDeviceState;
    use strata_tier_microvm::snapshot::{SnapshotExtra, VmSnapshot};
    let _alone = alone();
    let Some(Inputs { home, kernel, kind, scratch, initramfs }) = inputs() else { return };
    let disk = strata_rootfs_image::DebianImage::new(&home)
        .and_then(|image| image.installed())
        .and_then(|rootfs| strata_rootfs_image::disk::ensure_disk_image(&rootfs, &|_| {}))
        .ok()
        .map(|disk| disk.path);
    let config = MicrovmConfig {
        kernel: kernel.vmlinux,
        initramfs: initramfs.path,
        root_disk: disk.clone(),
        memory_bytes: 128 << 20,
        vcpus: 1,
        cpuid: if kind == KvmKind::Pvm { CpuidProfile::PvmCompat } else { CpuidProfile::Standard },
        run_dir: scratch.path().to_owned(),
    };
    let mut vm = Microvm::boot(&config).expect("boot");
    std::thread::sleep(Duration::from_millis(200));
    let dest = scratch.path().join("snap");
    let mut extra = SnapshotExtra::default();
    extra.meta.insert("images".into(), serde_json::json!({"kernel": "test"}));
    let started = Instant::now();
    let saved =
        vm.snapshot(&dest, None, extra, &strata_core::SnapshotTrust::process_local()).expect("snapshot a booting VM");
    eprintln!("saved a booting {kind} microVM in {:.1?}", started.elapsed());
    assert!(!vm.has_stopped() || kind == KvmKind::Pvm, "the VM did not resume");
    let state = saved.state();
    assert!(state.devices.serial.is_some(), "the serial console was not recorded");
    let kinds: Vec<&str> = state
        .devices
        .virtio
        .iter()
        .map(|slot| match slot.device {
            VirtioDeviceState::Vsock(_) => "vsock",
            VirtioDeviceState::Block(_) => "block",
        })
        .collect();
    assert_eq!(kinds, if disk.is_some() { vec!["vsock", "block"] } else { vec!["vsock"] });
    assert_eq!(saved.snapshot().manifest.meta["images"]["kernel"], "test");
    assert_eq!(state.memory_bytes, 128 << 20);

    let opened = VmSnapshot::open(&dest, &strata_core::SnapshotTrust::process_local()).expect("open");
    let fork = Microvm::fork(&opened, scratch.path(), 1234, disk).expect("fork into a new monitor");
    std::thread::sleep(Duration::from_millis(100));
    fork.shutdown();
    vm.shutdown();
    let threads = std::fs::read_dir("/proc/self/task")
        .expect("tasks")
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|comm| comm.starts_with("strata-vcpu"))
        .count();
    assert_eq!(threads, 0, "vCPU threads left running");
    let sockets = std::fs::read_dir(scratch.path())
        .expect("dir")
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().ends_with(".sock"))
        .count();
    assert_eq!(sockets, 0, "a vsock socket was left behind");
}
