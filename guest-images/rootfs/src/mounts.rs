//! Leaving nothing behind: mounts under a build tree (debootstrap mounts `/proc`, `/sys` and host devices
//! inside its target while it configures packages) are detached before the tree is removed, and the removal
//! never crosses into another file system.

use std::fs;
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use crate::{RootfsError, io_err};

/// Mount points at or under `dir`, deepest first, from `/proc/self/mountinfo`.
pub(crate) fn mounts_under(dir: &Path) -> Result<Vec<PathBuf>, RootfsError> {
    let path = Path::new("/proc/self/mountinfo");
    let text = fs::read_to_string(path).map_err(io_err("cannot read", path))?;
    // The kernel reports resolved paths.
    let dir = fs::canonicalize(dir).unwrap_or_else(|_| dir.to_owned());
    Ok(mount_points_under(&text, &dir))
}

/// The mount points (5th field, octal-unescaped) at or under `dir` in mountinfo `text`, deepest first.
fn mount_points_under(text: &str, dir: &Path) -> Vec<PathBuf> {
    let mut found: Vec<PathBuf> = text
        .lines()
        .filter_map(|line| line.split(' ').nth(4))
        .map(|field| PathBuf::from(unescape_octal(field)))
        .filter(|mount| mount.starts_with(dir))
        .collect();
    found.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    found.dedup();
    found
}

/// mountinfo writes space, tab, newline and backslash as `\040`, `\011`, `\012`, `\134`.
fn unescape_octal(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let digits = bytes.get(i + 1..i + 4);
        if bytes[i] == b'\\'
            && let Some(d) = digits
            && d.iter().all(|b| (b'0'..=b'7').contains(b))
        {
            out.push((d[0] - b'0') * 64 + (d[1] - b'0') * 8 + (d[2] - b'0'));
            i += 4;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Detaches (lazily) every mount at or under `dir`; an error names one that stays.
pub(crate) fn unmount_under(dir: &Path) -> Result<(), RootfsError> {
    // Mounts may be stacked on one point: a few rounds take them all.
    for _ in 0..8 {
        let mounts = mounts_under(dir)?;
        if mounts.is_empty() {
            return Ok(());
        }
        for mount in &mounts {
            let _ = nix::mount::umount2(mount, nix::mount::MntFlags::MNT_DETACH);
        }
    }
    match mounts_under(dir)?.into_iter().next() {
        None => Ok(()),
        Some(mount) => Err(RootfsError::StillMounted { mount, tree: dir.to_owned() }),
    }
}

/// Unmounts what is mounted under `dir`, then removes it without crossing into another file system (a mount
/// that appeared meanwhile stops the removal with an error instead of emptying the host's `/dev`).
pub(crate) fn remove_build_tree(dir: &Path) -> Result<(), RootfsError> {
    if fs::symlink_metadata(dir).is_err() {
        return Ok(());
    }
    unmount_under(dir)?;
    let dev = fs::symlink_metadata(dir).map_err(io_err("cannot stat", dir))?.dev();
    remove_tree(dir, dev, dir)
}

fn remove_tree(path: &Path, dev: u64, top: &Path) -> Result<(), RootfsError> {
    let meta = match fs::symlink_metadata(path) {
        Ok(meta) => meta,
        Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(err) => return Err(io_err("cannot stat", path)(err)),
    };
    if !meta.is_dir() {
        return match fs::remove_file(path) {
            Err(err) if err.kind() != io::ErrorKind::NotFound => Err(io_err("cannot remove", path)(err)),
            _ => Ok(()),
        };
    }
    if meta.dev() != dev {
        return Err(RootfsError::StillMounted { mount: path.to_owned(), tree: top.to_owned() });
    }
    for entry in fs::read_dir(path).map_err(io_err("cannot read", path))? {
        let entry = entry.map_err(io_err("cannot read", path))?;
        remove_tree(&entry.path(), dev, top)?;
    }
    match fs::remove_dir(path) {
        Err(err) if err.kind() != io::ErrorKind::NotFound => Err(io_err("cannot remove", path)(err)),
        _ => Ok(()),
    }
}

/// Removes temporary trees left by builds that did not finish ([`strata_image_util::stale_build_dirs`]), unmounting
/// what a killed build left mounted in them.
pub(crate) fn remove_stale_temp_dirs(images: &Path, hash16: &str) -> Result<(), RootfsError> {
    for dir in strata_image_util::stale_build_dirs(images, "debian", hash16).map_err(io_err("cannot read", images))? {
        remove_build_tree(&dir)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_lines_under_a_dir_come_deepest_first_and_unescaped() {
        let text = "\
22 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw
60 22 0:5 / /h/images/.debian-ab.tmp-7/rootfs/proc rw - proc proc rw
61 22 0:6 / /h/images/.debian-ab.tmp-7/rootfs/dev rw - tmpfs nodev rw
62 61 0:7 /null /h/images/.debian-ab.tmp-7/rootfs/dev/null rw - devtmpfs udev rw
63 22 0:8 / /h/images/.debian-ab.tmp-70/proc rw - proc proc rw
64 22 0:9 / /h/my\\040dir/x rw - tmpfs t rw
";
        let found = mount_points_under(text, Path::new("/h/images/.debian-ab.tmp-7"));
        assert_eq!(
            found,
            vec![
                PathBuf::from("/h/images/.debian-ab.tmp-7/rootfs/dev/null"),
                PathBuf::from("/h/images/.debian-ab.tmp-7/rootfs/proc"),
                PathBuf::from("/h/images/.debian-ab.tmp-7/rootfs/dev"),
            ]
        );
        assert_eq!(mount_points_under(text, Path::new("/h/my dir")), vec![PathBuf::from("/h/my dir/x")]);
    }

    #[test]
    fn a_build_tree_with_mounts_inside_is_unmounted_then_removed() {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("skipped: mounting needs root");
            return;
        }
        let images = tempfile::tempdir().expect("tempdir");
        let tree = images.path().join(".debian-0123456789abcdef.tmp-1");
        let proc_dir = tree.join("rootfs/proc");
        let dev_dir = tree.join("rootfs/dev");
        fs::create_dir_all(&proc_dir).expect("mkdir");
        fs::create_dir_all(&dev_dir).expect("mkdir");
        let tmpfs = |target: &Path| {
            nix::mount::mount(Some("strata-test"), target, Some("tmpfs"), nix::mount::MsFlags::empty(), None::<&str>)
                .expect("mount tmpfs");
        };
        tmpfs(&proc_dir);
        tmpfs(&dev_dir);
        fs::create_dir(dev_dir.join("pts")).expect("mkdir");
        tmpfs(&dev_dir.join("pts"));
        fs::write(dev_dir.join("pts/0"), "on another file system").expect("write");
        assert_eq!(mounts_under(&tree).expect("mountinfo").len(), 3);
        remove_build_tree(&tree).expect("removed");
        assert!(!tree.exists());
        assert!(mounts_under(images.path()).expect("mountinfo").is_empty());
    }

    #[test]
    fn stale_temp_dirs_are_removed_and_live_ones_kept() {
        let images = tempfile::tempdir().expect("tempdir");
        let mine = "0123456789abcdef";
        // pid_max is at most 2^22: no process has this id.
        let dead = images.path().join(".debian-fedcba9876543210.tmp-99999999");
        let same_recipe = images.path().join(format!(".debian-{mine}.tmp-1"));
        let live_other = images.path().join(format!(".debian-fedcba9876543210.tmp-{}", std::process::id()));
        let install = images.path().join(format!("debian-{mine}"));
        for dir in [&dead, &same_recipe, &live_other, &install] {
            fs::create_dir_all(dir.join("rootfs/etc")).expect("mkdir");
            fs::write(dir.join("rootfs/etc/hostname"), "strata\n").expect("write");
            std::os::unix::fs::symlink("/etc", dir.join("rootfs/host-etc")).expect("symlink");
        }
        remove_stale_temp_dirs(images.path(), mine).expect("cleanup");
        assert!(!dead.exists());
        assert!(!same_recipe.exists(), "this recipe's lock holder is the only builder");
        assert!(live_other.exists(), "another recipe's build in a live process");
        assert!(install.exists());
        assert!(Path::new("/etc/hostname").exists(), "symlinks are removed, not followed");
    }
}
