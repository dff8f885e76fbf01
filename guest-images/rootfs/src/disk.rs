//! The Debian image as a microVM disk: a read-only squashfs of the same tree the process tier uses as its lower
//! layer (one recipe, both tiers). The guest agent mounts it from `/dev/vda` under a tmpfs overlay
//! (`strata.root=/dev/vda strata.rootfstype=squashfs`).
//!
//! Built with `mksquashfs` (Debian's `squashfs-tools`), zstd-compressed, with every timestamp fixed so the same tree
//! gives the same image; cached as `$STRATA_HOME/images/debian-<recipe hash16>.squashfs`, keyed by the tree hash
//! recorded in the rootfs stamp, written atomically, its sha256 checked whenever it is reused.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::{InstalledRootfs, RootfsError, io_err};

/// Bumped when the way the image is made changes.
pub const DISK_FORMAT: u32 = 1;

/// A built disk image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InstalledDisk {
    /// The squashfs image.
    pub path: PathBuf,
    /// Its sha256, hex.
    pub sha256: String,
    /// Its size in bytes.
    pub size_bytes: u64,
}

/// The squashfs image of `rootfs`, built when missing, stale or damaged. `progress` gets a line when it builds.
pub fn ensure_disk_image(rootfs: &InstalledRootfs, progress: &dyn Fn(&str)) -> Result<InstalledDisk, RootfsError> {
    let (path, stamp, key) = locate(rootfs);
    if let Some(disk) = cached(&path, &stamp, &key) {
        return Ok(disk);
    }
    let mksquashfs = ["/usr/bin/mksquashfs", "/usr/sbin/mksquashfs"]
        .into_iter()
        .map(Path::new)
        .find(|p| p.exists())
        .ok_or(RootfsError::MissingTool("mksquashfs (apt-get install squashfs-tools)"))?;
    progress(&format!("debian disk image: mksquashfs {} (zstd; a minute or so)", rootfs.rootfs.display()));
    let temp = path.with_extension(format!("squashfs.tmp-{}", std::process::id()));
    let _ = fs::remove_file(&temp);
    let output = Command::new(mksquashfs)
        .arg(&rootfs.rootfs)
        .arg(&temp)
        .args(["-noappend", "-comp", "zstd", "-no-progress", "-quiet", "-mkfs-time", "0", "-all-time", "0"])
        .output()
        .map_err(io_err("cannot run", mksquashfs))?;
    if !output.status.success() {
        let _ = fs::remove_file(&temp);
        return Err(RootfsError::Recipe(format!(
            "mksquashfs failed ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        )));
    }
    let sha256 = sha256_file(&temp)?;
    let size_bytes = fs::metadata(&temp).map_err(io_err("cannot stat", &temp))?.len();
    fs::rename(&temp, &path).map_err(io_err("cannot rename", &path))?;
    let record = serde_json::json!({ "key": key, "sha256": sha256, "size_bytes": size_bytes });
    fs::write(&stamp, record.to_string()).map_err(io_err("cannot write", &stamp))?;
    progress(&format!("debian disk image: {} ({} MB)", path.display(), size_bytes.div_ceil(1_000_000)));
    Ok(InstalledDisk { path, sha256, size_bytes })
}

/// The disk image of `rootfs` when it is built, current and intact (its sha256 checked); builds nothing.
pub fn installed_disk_image(rootfs: &InstalledRootfs) -> Option<InstalledDisk> {
    let (path, stamp, key) = locate(rootfs);
    cached(&path, &stamp, &key)
}

/// Where the disk image of `rootfs` lives (or will, once built).
pub fn disk_image_path(rootfs: &InstalledRootfs) -> PathBuf {
    locate(rootfs).0
}

/// Where the disk image of `rootfs` lives, its stamp, and the key the stamp must record.
fn locate(rootfs: &InstalledRootfs) -> (PathBuf, PathBuf, String) {
    let images = rootfs.dir.parent().unwrap_or(&rootfs.dir).to_owned();
    let name = rootfs.dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "debian".into());
    let path = images.join(format!("{name}.squashfs"));
    let stamp = path.with_extension("squashfs.json");
    (path, stamp, format!("{DISK_FORMAT}:{}", rootfs.tree_hash))
}

fn cached(path: &Path, stamp: &Path, key: &str) -> Option<InstalledDisk> {
    let record: serde_json::Value = serde_json::from_str(&fs::read_to_string(stamp).ok()?).ok()?;
    if record["key"] != key {
        return None;
    }
    let sha256 = record["sha256"].as_str()?.to_owned();
    (sha256_file(path).ok()? == sha256).then(|| InstalledDisk {
        path: path.to_owned(),
        sha256,
        size_bytes: record["size_bytes"].as_u64().unwrap_or(0),
    })
}

fn sha256_file(path: &Path) -> Result<String, RootfsError> {
    strata_image_util::sha256_file(path).map_err(io_err("cannot read", path))
}
