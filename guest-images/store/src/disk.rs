//! An image as a microVM disk: a read-only squashfs of the image's merged tree — the same layers the process tier
//! stacks, flattened by overlayfs itself (whiteouts hide what they delete, opaque directories hide what is below),
//! so both tiers see one filesystem. The guest agent mounts it from `/dev/vda` under a tmpfs overlay, as it does
//! the Debian disk.
//!
//! The merged view is mounted read-only in a mount namespace of its own (`unshare --mount`, so the host never sees
//! it and nothing is left mounted if the build dies) and read by `mksquashfs` (zstd, every timestamp fixed, links
//! stored as links, never followed). Disks are cached as `store/disks/<key>.squashfs`, keyed by the image's base
//! and layers, written atomically with their sha256 beside them, and checked whenever reused.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::store::{ImageStore, StoreError, disk_key};
use strata_core::ImageName;

pub use crate::store::IMAGE_DISK_FORMAT;

/// A built disk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageDisk {
    /// The squashfs file.
    pub path: PathBuf,
    /// Its sha256, hex.
    pub sha256: String,
    /// Its size in bytes.
    pub size_bytes: u64,
}

fn tool(names: &[&str]) -> Option<PathBuf> {
    names.iter().map(PathBuf::from).find(|p| p.exists())
}

fn failed(what: &str, output: &std::process::Output) -> StoreError {
    StoreError::Invalid(format!(
        "{what} failed ({}): {}",
        output.status,
        String::from_utf8_lossy(&output.stderr).trim()
    ))
}

impl ImageStore {
    /// The squashfs disk of the image `name`, built when missing or damaged; `progress` gets a line when it builds.
    pub fn ensure_disk(&self, name: &ImageName, progress: &dyn Fn(&str)) -> Result<ImageDisk, StoreError> {
        let record = self.get(name)?;
        let resolved = self.resolve_record(&record)?;
        let key = disk_key(&record);
        let dir = self.root().join("disks");
        fs::create_dir_all(&dir).map_err(|source| StoreError::Io { what: "creating", path: dir.clone(), source })?;
        let path = dir.join(format!("{key}.squashfs"));
        let stamp = dir.join(format!("{key}.sha256"));
        if let (Ok(recorded), true) = (fs::read_to_string(&stamp), path.exists()) {
            let sum = strata_image_util::sha256_file(&path).map_err(|source| StoreError::Io {
                what: "hashing",
                path: path.clone(),
                source,
            })?;
            if sum == recorded.trim() {
                let size_bytes = fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
                return Ok(ImageDisk { path, sha256: sum, size_bytes });
            }
        }
        let mksquashfs = tool(&["/usr/bin/mksquashfs", "/usr/sbin/mksquashfs"])
            .ok_or_else(|| StoreError::Invalid("mksquashfs is missing (apt-get install squashfs-tools)".into()))?;
        let temp = dir.join(format!(".{key}.tmp-{}", std::process::id()));
        let _ = fs::remove_file(&temp);
        progress(&format!("image {name}: disk of {} layers, mksquashfs (zstd)", resolved.lowers.len()));
        let squash = ["-noappend", "-comp", "zstd", "-no-progress", "-quiet", "-mkfs-time", "0", "-all-time", "0"];
        let output = if let [only] = resolved.lowers.as_slice() {
            Command::new(&mksquashfs).arg(only).arg(&temp).args(squash).output()
        } else {
            let unshare = tool(&["/usr/bin/unshare", "/bin/unshare"])
                .ok_or_else(|| StoreError::Invalid("unshare (util-linux) is missing".into()))?;
            let merged = dir.join(format!(".{key}.merged-{}", std::process::id()));
            fs::create_dir_all(&merged).map_err(|source| StoreError::Io {
                what: "creating",
                path: merged.clone(),
                source,
            })?;
            let lowers: Vec<String> = resolved.lowers.iter().map(|p| p.display().to_string()).collect();
            // In a mount namespace of its own: the merged view exists only for mksquashfs and dies with it.
            let script =
                "mount -t overlay strata-disk -o \"ro,lowerdir=$1\" \"$2\" && exec \"$3\" \"$2\" \"$4\" \"${@:5}\"";
            let output = Command::new(unshare)
                .args(["--mount", "--propagation", "private", "/bin/bash", "-c", script, "strata-disk"])
                .arg(lowers.join(":"))
                .arg(&merged)
                .arg(&mksquashfs)
                .arg(&temp)
                .args(squash)
                .output();
            let _ = fs::remove_dir(&merged);
            output
        }
        .map_err(|source| StoreError::Io { what: "running mksquashfs for", path: temp.clone(), source })?;
        if !output.status.success() {
            let _ = fs::remove_file(&temp);
            return Err(failed("mksquashfs", &output));
        }
        let sha256 = strata_image_util::sha256_file(&temp).map_err(|source| StoreError::Io {
            what: "hashing",
            path: temp.clone(),
            source,
        })?;
        let size_bytes = fs::metadata(&temp).map(|m| m.len()).unwrap_or(0);
        fs::rename(&temp, &path).map_err(|source| StoreError::Io { what: "installing", path: path.clone(), source })?;
        fs::write(&stamp, &sha256).map_err(|source| StoreError::Io { what: "writing", path: stamp.clone(), source })?;
        progress(&format!("image {name}: disk {} ({} MB)", path.display(), size_bytes.div_ceil(1_000_000)));
        Ok(ImageDisk { path, sha256, size_bytes })
    }
}

/// The paths in a squashfs disk (`unsquashfs -l`), relative to its root: for checking a disk's contents where no
/// guest can boot it.
pub fn disk_listing(disk: &Path) -> Result<Vec<String>, StoreError> {
    let unsquashfs = tool(&["/usr/bin/unsquashfs", "/usr/sbin/unsquashfs"])
        .ok_or_else(|| StoreError::Invalid("unsquashfs is missing (apt-get install squashfs-tools)".into()))?;
    let output = Command::new(unsquashfs)
        .args(["-lc", "-d", ""])
        .arg(disk)
        .output()
        .map_err(|source| StoreError::Io { what: "listing", path: disk.to_owned(), source })?;
    if !output.status.success() {
        return Err(failed("unsquashfs", &output));
    }
    Ok(String::from_utf8_lossy(&output.stdout).lines().map(|l| l.trim_start_matches('/').to_owned()).collect())
}
