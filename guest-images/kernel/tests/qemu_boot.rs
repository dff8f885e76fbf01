//! Boots the installed kernel under qemu's `microvm` machine with TCG (software emulation: this host's KVM is
//! PVM, which cannot run a stock guest kernel) and a tiny busybox initramfs whose `/init` prints what the kernel
//! gave it. Skipped, with one `skip:` line, when the kernel is not built, qemu is missing or busybox is not the
//! static build.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use strata_kernel_image::KernelImage;

const MARKER: &str = "STRATA-INIT-MARKER";
const DONE: &str = "STRATA-INIT-DONE";
/// The whole boot, checks and reboot take about a second under TCG; this only bounds a hang.
const TIMEOUT: Duration = Duration::from_secs(60);

/// `/init`: prints the marker, then what the kernel shows, then reboots (`-no-reboot` makes qemu exit; without
/// ACPI `poweroff -f` only halts the CPU).
const INIT: &str = r#"#!/bin/busybox sh
/bin/busybox echo STRATA-INIT-MARKER
/bin/busybox mount -t proc proc /proc
/bin/busybox mount -t sysfs sysfs /sys
/bin/busybox echo "uname-r: $(/bin/busybox uname -r)"
/bin/busybox echo "cmdline: $(/bin/busybox cat /proc/cmdline)"
/bin/busybox echo "virtio: $(/bin/busybox ls /sys/bus/virtio/devices)"
/bin/busybox echo "block: $(/bin/busybox ls /sys/block)"
/bin/busybox echo "filesystems: $(/bin/busybox grep -v nodev /proc/filesystems | /bin/busybox xargs)"
/bin/busybox echo STRATA-INIT-DONE
/bin/busybox reboot -f
"#;

/// `$STRATA_HOME`, else `$XDG_CACHE_HOME/strata`, else `~/.cache/strata` (as the engine resolves it).
fn strata_home() -> Option<PathBuf> {
    let var = |name| std::env::var_os(name).filter(|v| !v.is_empty()).map(PathBuf::from);
    var("STRATA_HOME")
        .or_else(|| var("XDG_CACHE_HOME").map(|d| d.join("strata")))
        .or_else(|| var("HOME").map(|d| d.join(".cache/strata")))
}

fn on_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path).map(|dir| dir.join(name)).find(|p| p.is_file())
}

/// Whether `bytes` is an x86_64 ELF executable without a program interpreter (statically linked).
fn is_static_elf(bytes: &[u8]) -> bool {
    let u16_at = |at: usize| bytes.get(at..at + 2).map(|b| u16::from_le_bytes([b[0], b[1]]) as usize);
    let u32_at = |at: usize| bytes.get(at..at + 4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]));
    let u64_at = |at: usize| {
        bytes.get(at..at + 8).and_then(|b| <[u8; 8]>::try_from(b).ok()).map(|b| u64::from_le_bytes(b) as usize)
    };
    if bytes.get(..5) != Some(b"\x7fELF\x02") || u16_at(0x12) != Some(62) {
        return false;
    }
    let (Some(phoff), Some(phentsize), Some(phnum)) = (u64_at(0x20), u16_at(0x36), u16_at(0x38)) else {
        return false;
    };
    const PT_INTERP: u32 = 3;
    (0..phnum).all(|i| u32_at(phoff + i * phentsize).is_some_and(|t| t != PT_INTERP))
}

/// One `newc` cpio entry.
fn cpio_entry(out: &mut Vec<u8>, name: &str, mode: u32, rdev: (u32, u32), data: &[u8]) {
    let pad = |out: &mut Vec<u8>| out.resize(out.len().next_multiple_of(4), 0);
    let ino = out.len() as u32 + 1;
    let fields = [ino, mode, 0, 0, 1, 0, data.len() as u32, 0, 0, rdev.0, rdev.1, name.len() as u32 + 1, 0];
    out.extend_from_slice(b"070701");
    for field in fields {
        out.extend_from_slice(format!("{field:08x}").as_bytes());
    }
    out.extend_from_slice(name.as_bytes());
    out.push(0);
    pad(out);
    out.extend_from_slice(data);
    pad(out);
}

/// A gzip-compressed initramfs: `/init`, `/bin/busybox`, `/dev/console` and mount points.
fn initramfs(busybox: &[u8], path: &Path) {
    let mut cpio = Vec::new();
    for dir in ["bin", "dev", "proc", "sys"] {
        cpio_entry(&mut cpio, dir, 0o040_755, (0, 0), &[]);
    }
    cpio_entry(&mut cpio, "dev/console", 0o020_600, (5, 1), &[]);
    cpio_entry(&mut cpio, "bin/busybox", 0o100_755, (0, 0), busybox);
    cpio_entry(&mut cpio, "init", 0o100_755, (0, 0), INIT.as_bytes());
    cpio_entry(&mut cpio, "TRAILER!!!", 0, (0, 0), &[]);
    let mut gzip = Command::new("gzip")
        .args(["-n", "-1", "-c"])
        .stdin(Stdio::piped())
        .stdout(std::fs::File::create(path).expect("create the initramfs"))
        .spawn()
        .expect("run gzip");
    gzip.stdin.take().expect("stdin").write_all(&cpio).expect("feed gzip");
    assert!(gzip.wait().expect("wait for gzip").success());
}

#[test]
fn the_kernel_boots_to_init_under_qemu_tcg() {
    let Some(home) = strata_home() else {
        println!("skip: no STRATA_HOME nor HOME");
        return;
    };
    let kernel = match KernelImage::new(&home).and_then(|image| image.installed()) {
        Ok(kernel) => kernel,
        Err(err) => {
            println!("skip: {err}");
            return;
        }
    };
    let Some(qemu) = on_path("qemu-system-x86_64") else {
        println!("skip: qemu-system-x86_64 is not installed (apt-get install qemu-system-x86)");
        return;
    };
    let busybox = ["/bin/busybox", "/usr/bin/busybox"]
        .iter()
        .filter_map(|p| std::fs::read(p).ok())
        .find(|bytes| is_static_elf(bytes));
    let Some(busybox) = busybox else {
        println!("skip: no statically linked busybox (apt-get install busybox-static)");
        return;
    };

    let dir = tempfile::tempdir().expect("tempdir");
    let initrd = dir.path().join("initramfs.cpio.gz");
    initramfs(&busybox, &initrd);
    let disk = dir.path().join("disk.img");
    std::fs::write(&disk, vec![0u8; 1 << 20]).expect("disk image");

    let started = Instant::now();
    let mut child = Command::new(qemu)
        // acpi=off: the kernel has no ACPI, and without ACPI tables qemu lists the virtio-mmio devices on the
        // command line (virtio_mmio.device=...), which is what VIRTIO_MMIO_CMDLINE_DEVICES reads.
        .args(["-M", "microvm,acpi=off", "-accel", "tcg", "-m", "256", "-nodefaults", "-no-user-config"])
        .args(["-nographic", "-serial", "stdio", "-no-reboot"])
        .arg("-kernel")
        .arg(&kernel.vmlinux)
        .arg("-initrd")
        .arg(&initrd)
        .args(["-append", "console=ttyS0 reboot=t panic=-1"])
        .arg("-drive")
        .arg(format!("id=d0,if=none,format=raw,readonly=on,file={}", disk.display()))
        .args(["-device", "virtio-blk-device,drive=d0"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run qemu");
    let (tx, rx) = mpsc::channel();
    let stdout = child.stdout.take().expect("stdout");
    let reader = std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if tx.send((Instant::now(), line)).is_err() {
                break;
            }
        }
    });
    let mut lines = Vec::new();
    let mut marker_at = None;
    while let Some(left) = TIMEOUT.checked_sub(started.elapsed()) {
        let Ok((at, line)) = rx.recv_timeout(left) else { break };
        if line.trim_end() == MARKER {
            marker_at = Some(at - started);
        }
        let done = line.trim_end() == DONE;
        lines.push(line.trim_end().to_owned());
        if done {
            break;
        }
    }
    // Normally qemu has exited on the guest's reboot; kill it if it hangs.
    let exited = (0..50).any(|_| {
        std::thread::sleep(Duration::from_millis(20));
        child.try_wait().ok().flatten().is_some()
    });
    if !exited {
        let _ = child.kill();
    }
    let _ = child.wait();
    let _ = reader.join();
    let mut stderr = String::new();
    let _ = std::io::Read::read_to_string(&mut child.stderr.take().expect("stderr"), &mut stderr);
    let log = format!("{}\n---- qemu stderr ----\n{stderr}", lines.join("\n"));

    let Some(marker_at) = marker_at else { panic!("no {MARKER} within {TIMEOUT:?}:\n{log}") };
    let value = |prefix: &str| {
        lines.iter().find_map(|l| l.strip_prefix(prefix)).unwrap_or_else(|| panic!("no `{prefix}` line:\n{log}"))
    };
    assert_eq!(value("uname-r: "), kernel.release, "{log}");
    let cmdline = value("cmdline: ");
    assert!(cmdline.starts_with("console=ttyS0 reboot=t panic=-1"), "{log}");
    assert!(cmdline.contains("virtio_mmio.device="), "{log}");
    assert_eq!(value("virtio: "), "virtio0", "{log}");
    assert_eq!(value("block: "), "vda", "{log}");
    for fs in ["ext4", "squashfs"] {
        assert!(value("filesystems: ").split(' ').any(|f| f == fs), "{fs} missing:\n{log}");
    }
    let run_init = lines.iter().find(|l| l.contains("Run /init as init process")).cloned().unwrap_or_default();
    println!(
        "booted {} under TCG to the /init marker in {} ms (qemu start to marker; kernel log: {run_init}); qemu {}",
        kernel.release,
        marker_at.as_millis(),
        if exited { "exited on the guest's reboot" } else { "had to be killed" }
    );
    assert!(exited, "qemu did not exit after the guest rebooted:\n{log}");
}
