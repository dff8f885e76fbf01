//! The microVM's initramfs: the guest agent as `/init` and a static busybox, in a `newc` cpio archive.
//!
//! The fastest root a microVM can have: the kernel unpacks it into a tmpfs and runs the agent as PID 1, which mounts
//! what it needs and serves the host. It carries no C library, so everything in it is static: the agent (musl) and
//! busybox from Debian's `busybox-static` package (`/bin/busybox`, applets as symlinks). The archive is uncompressed
//! (the kernel always reads that; unpacking is faster than decompressing) and cached by the hash of what goes in.
//!
//! Layout: `/init` (the agent), `/bin/busybox` + `/bin/<applet>` links, `/dev/console` and `/dev/null` nodes (the
//! kernel opens the console before anything is mounted), and empty `/proc /sys /tmp /run /etc /root /mnt /newroot`.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::{RootfsError, hex, io_err};

/// Bumped when the archive's layout changes, so cached archives are rebuilt.
pub const INITRAMFS_FORMAT: u32 = 1;

/// Where Debian's `busybox-static` puts its binary.
pub const BUSYBOX_STATIC: &str = "/bin/busybox";

/// Applets linked in `/bin`: what a job or a debugging session in the guest commonly runs.
const APPLETS: &[&str] = &[
    "sh", "ash", "cat", "ls", "echo", "mount", "umount", "mkdir", "rm", "cp", "mv", "ln", "ps", "kill", "sleep",
    "true", "false", "env", "uname", "id", "head", "tail", "wc", "grep", "sed", "awk", "sort", "dd", "df", "free",
    "dmesg", "hostname", "poweroff", "reboot", "sync", "test", "[", "printf", "date", "seq", "tr", "cut", "chmod",
    "chown", "touch", "stat", "find", "xargs", "yes", "which", "top", "uptime",
];

/// A file of the archive.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Entry {
    Dir { path: String, mode: u32 },
    File { path: String, mode: u32, data: Vec<u8> },
    Symlink { path: String, target: String },
    CharDevice { path: String, mode: u32, major: u32, minor: u32 },
}

/// Writes entries as a `newc` cpio archive (the format the kernel's initramfs unpacker reads), ending with the
/// `TRAILER!!!` record. Inode numbers are assigned in order; times are zero so the archive is reproducible.
fn cpio(entries: &[Entry]) -> Vec<u8> {
    let mut out = Vec::new();
    let mut ino = 1u32;
    let mut record = |out: &mut Vec<u8>, name: &str, mode: u32, data: &[u8], rdev: (u32, u32)| {
        let name_len = name.len() + 1;
        let header = format!(
            "070701{ino:08x}{mode:08x}{uid:08x}{gid:08x}{nlink:08x}{mtime:08x}{size:08x}{dmaj:08x}{dmin:08x}\
             {rmaj:08x}{rmin:08x}{name_len:08x}{check:08x}",
            uid = 0,
            gid = 0,
            nlink = 1,
            mtime = 0,
            size = data.len(),
            dmaj = 0,
            dmin = 0,
            rmaj = rdev.0,
            rmin = rdev.1,
            check = 0,
        );
        out.extend_from_slice(header.as_bytes());
        out.extend_from_slice(name.as_bytes());
        out.push(0);
        pad4(out);
        out.extend_from_slice(data);
        pad4(out);
        ino += 1;
    };
    for entry in entries {
        match entry {
            Entry::Dir { path, mode } => record(&mut out, path, 0o040000 | mode, &[], (0, 0)),
            Entry::File { path, mode, data } => record(&mut out, path, 0o100000 | mode, data, (0, 0)),
            Entry::Symlink { path, target } => record(&mut out, path, 0o120777, target.as_bytes(), (0, 0)),
            Entry::CharDevice { path, mode, major, minor } => {
                record(&mut out, path, 0o020000 | mode, &[], (*major, *minor))
            }
        }
    }
    record(&mut out, "TRAILER!!!", 0, &[], (0, 0));
    // The kernel reads the archive in 512-byte blocks; pad as cpio(1) does.
    while !out.len().is_multiple_of(512) {
        out.push(0);
    }
    out
}

fn pad4(out: &mut Vec<u8>) {
    while !out.len().is_multiple_of(4) {
        out.push(0);
    }
}

/// The entries of the initramfs for this agent and busybox.
fn entries(agent: &[u8], busybox: &[u8]) -> Vec<Entry> {
    let mut entries = Vec::new();
    for dir in ["bin", "dev", "proc", "sys", "tmp", "run", "etc", "root", "mnt", "newroot"] {
        let mode = if dir == "tmp" { 0o1777 } else { 0o755 };
        entries.push(Entry::Dir { path: dir.into(), mode });
    }
    entries.push(Entry::CharDevice { path: "dev/console".into(), mode: 0o600, major: 5, minor: 1 });
    entries.push(Entry::CharDevice { path: "dev/null".into(), mode: 0o666, major: 1, minor: 3 });
    entries.push(Entry::File { path: "init".into(), mode: 0o755, data: agent.to_vec() });
    entries.push(Entry::File { path: "bin/busybox".into(), mode: 0o755, data: busybox.to_vec() });
    for applet in APPLETS {
        entries.push(Entry::Symlink { path: format!("bin/{applet}"), target: "busybox".into() });
    }
    entries.push(Entry::File { path: "etc/hostname".into(), mode: 0o644, data: b"strata\n".to_vec() });
    entries
}

/// A built initramfs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InstalledInitramfs {
    /// The archive.
    pub path: PathBuf,
    /// Its sha256, hex.
    pub sha256: String,
}

/// Builds (or finds in the cache) the initramfs for `agent` (the static guest agent's bytes) under
/// `home/images/initramfs-<hash16>.cpio`. `busybox` is a static busybox binary ([`BUSYBOX_STATIC`] from Debian's
/// `busybox-static`).
pub fn ensure_initramfs(home: &Path, agent: &[u8], busybox: &Path) -> Result<InstalledInitramfs, RootfsError> {
    let (busybox_bytes, path) = archive_path(home, agent, busybox)?;
    if let Some(installed) = cached(&path) {
        return Ok(installed);
    }
    let dir = home.join("images");
    fs::create_dir_all(&dir).map_err(io_err("cannot create", &dir))?;
    let archive = cpio(&entries(agent, &busybox_bytes));
    let sha256 = hex(&Sha256::digest(&archive));
    for (target, bytes) in [(path.with_extension("sha256"), sha256.as_bytes()), (path.clone(), archive.as_slice())] {
        let temp = target.with_extension(format!("tmp-{}", std::process::id()));
        let mut file = fs::File::create(&temp).map_err(io_err("cannot create", &temp))?;
        file.write_all(bytes).and_then(|()| file.sync_all()).map_err(io_err("cannot write", &temp))?;
        fs::rename(&temp, &target).map_err(io_err("cannot rename", &target))?;
    }
    Ok(InstalledInitramfs { path, sha256 })
}

/// The initramfs built for `agent` and `busybox`, if it is in the cache and intact; builds nothing (`strata images
/// list`).
pub fn installed_initramfs(
    home: &Path,
    agent: &[u8],
    busybox: &Path,
) -> Result<Option<InstalledInitramfs>, RootfsError> {
    let (_, path) = archive_path(home, agent, busybox)?;
    Ok(cached(&path))
}

/// Busybox's bytes (checked static) and the cache path of the archive for `agent` and that busybox.
fn archive_path(home: &Path, agent: &[u8], busybox: &Path) -> Result<(Vec<u8>, PathBuf), RootfsError> {
    let busybox_bytes = fs::read(busybox).map_err(|source| {
        if source.kind() == std::io::ErrorKind::NotFound {
            RootfsError::MissingTool("busybox-static (apt-get install busybox-static)")
        } else {
            RootfsError::Io { what: "cannot read", path: busybox.to_owned(), source }
        }
    })?;
    if !is_static_elf(&busybox_bytes) {
        return Err(RootfsError::Recipe(format!(
            "{} is not a static executable; the initramfs has no C library (install busybox-static)",
            busybox.display()
        )));
    }
    let mut key = Sha256::new();
    key.update(INITRAMFS_FORMAT.to_le_bytes());
    key.update(Sha256::digest(agent));
    key.update(Sha256::digest(&busybox_bytes));
    let key = hex(&key.finalize());
    Ok((busybox_bytes, home.join("images").join(format!("initramfs-{}.cpio", &key[..16]))))
}

/// The archive at `path` when its recorded sha256 matches its bytes.
fn cached(path: &Path) -> Option<InstalledInitramfs> {
    let existing = fs::read(path).ok()?;
    let sha256 = hex(&Sha256::digest(&existing));
    let recorded = fs::read_to_string(path.with_extension("sha256")).ok()?;
    (recorded.trim() == sha256).then(|| InstalledInitramfs { path: path.to_owned(), sha256 })
}

/// Whether `bytes` is an ELF executable without a program interpreter (statically linked).
fn is_static_elf(bytes: &[u8]) -> bool {
    if bytes.len() < 64 || &bytes[..4] != b"\x7fELF" || bytes[4] != 2 {
        return false;
    }
    let u16_at = |o: usize| bytes.get(o..o + 2).map(|b| u16::from_le_bytes([b[0], b[1]]) as usize);
    let u64_at = |o: usize| {
        bytes
            .get(o..o + 8)
            .and_then(|b| b.try_into().ok())
            .map(u64::from_le_bytes)
            .and_then(|v| usize::try_from(v).ok())
    };
    let (Some(phoff), Some(phentsize), Some(phnum)) = (u64_at(0x20), u16_at(0x36), u16_at(0x38)) else {
        return false;
    };
    (0..phnum).all(|i| {
        let entry = phoff.saturating_add(i.saturating_mul(phentsize));
        // PT_INTERP = 3
        bytes.get(entry..entry + 4).is_some_and(|t| u32::from_le_bytes([t[0], t[1], t[2], t[3]]) != 3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// (name, mode, data, (rdev major, rdev minor)) of one archive record.
    type Record = (String, u32, Vec<u8>, (u32, u32));

    /// Parses a newc archive back into its records, checking every header.
    fn parse(archive: &[u8]) -> Vec<Record> {
        let mut records = Vec::new();
        let mut at = 0;
        loop {
            let header = std::str::from_utf8(&archive[at..at + 110]).expect("ascii header");
            assert_eq!(&header[..6], "070701");
            let field = |i: usize| u32::from_str_radix(&header[6 + i * 8..14 + i * 8], 16).expect("hex");
            let (mode, size, rmaj, rmin, name_len) =
                (field(1), field(6) as usize, field(9), field(10), field(11) as usize);
            let name_start = at + 110;
            let name = std::str::from_utf8(&archive[name_start..name_start + name_len - 1]).expect("name").to_owned();
            let data_start = (name_start + name_len).div_ceil(4) * 4;
            let data = archive[data_start..data_start + size].to_vec();
            at = (data_start + size).div_ceil(4) * 4;
            if name == "TRAILER!!!" {
                return records;
            }
            records.push((name, mode, data, (rmaj, rmin)));
        }
    }

    #[test]
    fn the_archive_round_trips_and_has_init_console_and_applets() {
        let archive = cpio(&entries(b"agent-bytes", b"busybox-bytes"));
        assert!(archive.len().is_multiple_of(512));
        let records = parse(&archive);
        let find = |name: &str| records.iter().find(|r| r.0 == name).unwrap_or_else(|| panic!("{name} missing"));
        assert_eq!(find("init").2, b"agent-bytes");
        assert_eq!(find("init").1, 0o100755);
        assert_eq!(find("dev/console").3, (5, 1));
        assert_eq!(find("dev/console").1 & 0o170000, 0o020000);
        assert_eq!(find("bin/sh").2, b"busybox");
        assert_eq!(find("tmp").1, 0o041777);
    }

    #[test]
    fn the_archive_is_reproducible() {
        assert_eq!(cpio(&entries(b"a", b"b")), cpio(&entries(b"a", b"b")));
    }

    #[test]
    fn static_and_dynamic_executables_are_told_apart() {
        if let Ok(busybox) = fs::read(BUSYBOX_STATIC) {
            assert!(is_static_elf(&busybox), "Debian's busybox-static is static");
        }
        let dynamic = fs::read("/bin/true").expect("/bin/true");
        assert!(!is_static_elf(&dynamic));
        assert!(!is_static_elf(b"#!/bin/sh\n"));
    }

    #[test]
    fn the_cache_is_keyed_by_content_and_reused() {
        let Ok(_) = fs::metadata(BUSYBOX_STATIC) else {
            eprintln!("skip: no {BUSYBOX_STATIC} (busybox-static) on this host");
            return;
        };
        let home = tempfile::tempdir().expect("tempdir");
        let first = ensure_initramfs(home.path(), b"agent one", Path::new(BUSYBOX_STATIC)).expect("build");
        let again = ensure_initramfs(home.path(), b"agent one", Path::new(BUSYBOX_STATIC)).expect("cached");
        assert_eq!(first, again);
        let other = ensure_initramfs(home.path(), b"agent two", Path::new(BUSYBOX_STATIC)).expect("build");
        assert_ne!(first.path, other.path);
        // A damaged cache entry is rebuilt, not used.
        fs::write(&first.path, b"garbage").expect("damage");
        let rebuilt = ensure_initramfs(home.path(), b"agent one", Path::new(BUSYBOX_STATIC)).expect("rebuild");
        assert_eq!(rebuilt, first);
        assert_ne!(fs::read(&rebuilt.path).expect("read"), b"garbage");
    }
}
