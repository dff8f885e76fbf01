//! The guest side of the microVM, checked under qemu's `microvm` machine with TCG (software emulation: this host's
//! `/dev/kvm` is PVM, which cannot run our kernel): our kernel boots our initramfs and the embedded agent runs as
//! PID 1 — it mounts, then listens for the host on vsock and says so on the console. Skipped with one `skip:` line when the kernel is not built,
//! qemu or busybox-static is missing, or this build has no agent.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use strata_vmm::test_utils::process::shared;

use crate::strata_home;

const TIMEOUT: Duration = Duration::from_secs(60);

/// Boots our kernel with the initramfs (and `disk`, as a read-only virtio-blk `/dev/vda`) under qemu TCG until the
/// agent says it listens; returns the console lines and when that happened. `None` (after a skip line) when
/// something needed is missing here.
fn boot_until_ready(disk: Option<&std::path::Path>, append: &str) -> Option<(Vec<String>, Option<Duration>)> {
    let Some(kernel) = strata_home().and_then(|h| strata_kernel_image::KernelImage::new(&h).ok()?.installed().ok())
    else {
        println!("skip: the guest kernel is not built (strata images build kernel)");
        return None;
    };
    let Ok(agent) = strata_tier_microvm::guest::agent_binary() else {
        println!("skip: this build has no guest agent (the x86_64-unknown-linux-musl target is missing)");
        return None;
    };
    if Command::new("qemu-system-x86_64").arg("--version").output().is_err() {
        println!("skip: qemu-system-x86_64 is not installed (apt-get install qemu-system-x86)");
        return None;
    }
    let home = tempfile::tempdir().expect("tempdir");
    let busybox = std::path::Path::new(strata_rootfs_image::initramfs::BUSYBOX_STATIC);
    let initramfs = match strata_rootfs_image::initramfs::ensure_initramfs(home.path(), agent, busybox) {
        Ok(initramfs) => initramfs,
        Err(err) => {
            println!("skip: {err}");
            return None;
        }
    };
    let started = Instant::now();
    let mut command = Command::new("qemu-system-x86_64");
    command
        .args(["-M", "microvm,acpi=off", "-accel", "tcg", "-m", "256", "-nodefaults", "-no-user-config"])
        .args(["-nographic", "-serial", "stdio", "-no-reboot"])
        .arg("-kernel")
        .arg(&kernel.vmlinux)
        .arg("-initrd")
        .arg(&initramfs.path)
        .args(["-append", &format!("console=ttyS0 reboot=t panic=-1 {append}")]);
    if let Some(disk) = disk {
        command
            .arg("-drive")
            .arg(format!("id=d0,if=none,format=raw,readonly=on,file={}", disk.display()))
            .args(["-device", "virtio-blk-device,drive=d0"]);
    }
    let mut qemu = command.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::null()).spawn().expect("run qemu");
    let (tx, rx) = mpsc::channel();
    let stdout = qemu.stdout.take().expect("stdout");
    let reader = std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut lines = Vec::new();
    let mut ready = None;
    while let Some(left) = TIMEOUT.checked_sub(started.elapsed()) {
        let Ok(line) = rx.recv_timeout(left) else { break };
        let listening = line.contains("strata-agent: ready: listening on vsock port");
        lines.push(line);
        if listening {
            ready = Some(started.elapsed());
            break;
        }
    }
    let _ = qemu.kill();
    let _ = qemu.wait();
    drop(rx);
    let _ = reader.join();
    Some((lines, ready))
}

#[test]
fn the_agent_runs_as_pid_1_of_our_kernel() {
    let _shared = shared();
    let Some((lines, ready)) = boot_until_ready(None, "strata.hostname=probe") else { return };
    let log = lines.join("\n");
    assert!(log.contains("Run /init as init process"), "the kernel did not start /init:\n{log}");
    assert!(!log.contains("Kernel panic"), "{log}");
    let at = ready.unwrap_or_else(|| panic!("the agent never reached its vsock listener in {TIMEOUT:?}:\n{log}"));
    println!("agent up as PID 1 after {at:.1?} (qemu TCG; without a vsock device it waits for one)");
}

#[test]
fn the_agent_moves_onto_the_debian_disk() {
    let _shared = shared();
    let Some(home) = strata_home() else { return };
    let Ok(rootfs) = strata_rootfs_image::DebianImage::new(&home).and_then(|image| image.installed()) else {
        println!("skip: the Debian image is not built (strata images build debian)");
        return;
    };
    let disk = match strata_rootfs_image::disk::ensure_disk_image(&rootfs, &|line| println!("{line}")) {
        Ok(disk) => disk,
        Err(err) => {
            println!("skip: {err}");
            return;
        }
    };
    let append = "strata.root=/dev/vda strata.rootfstype=squashfs";
    let Some((lines, ready)) = boot_until_ready(Some(&disk.path), append) else { return };
    let log = lines.join("\n");
    assert!(log.contains("strata-agent: root: /dev/vda, read-only, under a tmpfs overlay"), "{log}");
    let at = ready.unwrap_or_else(|| panic!("the agent never reached its vsock listener in {TIMEOUT:?}:\n{log}"));
    println!("agent up on the Debian disk after {at:.1?} (qemu TCG)");
}
