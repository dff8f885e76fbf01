//! Directory-descriptor file operations that never follow a symbolic link: what copying grants back into host
//! directories needs (the engine's escalation scratch layer, the microVM tier's copy-back), where a name in the
//! host tree may be a link planted by a guest.

use std::ffi::{OsStr, OsString};
use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path};

use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag, openat};
use nix::sys::stat::{FileStat, Mode, SFlag, fstatat};
use nix::unistd::{UnlinkatFlags, unlinkat};

/// How directories are opened: read-only, must be a directory, never through a link, closed on exec.
pub const DIR_FLAGS: OFlag = OFlag::O_RDONLY.union(OFlag::O_DIRECTORY).union(OFlag::O_NOFOLLOW).union(OFlag::O_CLOEXEC);

/// Opens the directory `rel` below `root` one component at a time, never following a link (`ELOOP` or `ENOTDIR`
/// where a component is one). `/` and `.` components are skipped; `..` is `EINVAL`.
pub fn open_beneath(root: &OwnedFd, rel: &Path) -> Result<OwnedFd, Errno> {
    let mut fd = nix::unistd::dup(root)?;
    for component in rel.components() {
        match component {
            Component::Normal(name) => fd = openat(&fd, name, DIR_FLAGS, Mode::empty())?,
            Component::RootDir | Component::CurDir => {}
            Component::ParentDir | Component::Prefix(_) => return Err(Errno::EINVAL),
        }
    }
    Ok(fd)
}

/// The file type bits of `stat`.
pub fn kind_of(stat: &FileStat) -> SFlag {
    SFlag::from_bits_truncate(stat.st_mode & SFlag::S_IFMT.bits())
}

/// Every name in the directory `dir`, without `.` and `..`.
pub fn names_in(dir: &OwnedFd) -> Result<Vec<OsString>, Errno> {
    let mut names = Vec::new();
    let mut listing = nix::dir::Dir::from_fd(nix::unistd::dup(dir)?)?;
    for entry in listing.iter() {
        let bytes = entry?.file_name().to_bytes().to_vec();
        if bytes != b"." && bytes != b".." {
            names.push(OsStr::from_bytes(&bytes).to_owned());
        }
    }
    Ok(names)
}

/// Removes `name` in `parent`, a whole tree if it is a directory, never following a link; counts what went (0
/// when it was not there).
pub fn remove_at(parent: &OwnedFd, name: &(impl AsRef<OsStr> + ?Sized)) -> Result<u64, Errno> {
    let name = name.as_ref();
    let stat = match fstatat(parent, name, AtFlags::AT_SYMLINK_NOFOLLOW) {
        Ok(stat) => stat,
        Err(Errno::ENOENT) => return Ok(0),
        Err(e) => return Err(e),
    };
    if kind_of(&stat) != SFlag::S_IFDIR {
        unlinkat(parent, name, UnlinkatFlags::NoRemoveDir)?;
        return Ok(1);
    }
    let dir = openat(parent, name, DIR_FLAGS, Mode::empty())?;
    let mut removed = 0;
    for child in names_in(&dir)? {
        removed += remove_at(&dir, &child)?;
    }
    unlinkat(parent, name, UnlinkatFlags::RemoveDir)?;
    Ok(removed + 1)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

    use std::os::unix::fs::symlink;

    use super::*;

    #[test]
    fn removal_and_opening_never_follow_a_link() {
        let dir = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("keep"), "x").unwrap();
        let tree = dir.path().join("tree");
        std::fs::create_dir_all(tree.join("a/b")).unwrap();
        std::fs::write(tree.join("a/b/f"), "y").unwrap();
        symlink(outside.path(), tree.join("a/link")).unwrap();
        let root = nix::fcntl::open(dir.path(), DIR_FLAGS, Mode::empty()).unwrap();

        assert_eq!(open_beneath(&root, Path::new("tree/a/link")).err(), Some(Errno::ENOTDIR));
        assert_eq!(open_beneath(&root, Path::new("tree/../tree")).err(), Some(Errno::EINVAL));
        let a = open_beneath(&root, Path::new("tree/./a")).unwrap();
        let mut names = names_in(&a).unwrap();
        names.sort();
        assert_eq!(names, [OsString::from("b"), OsString::from("link")]);

        // tree, a, b, f and the link itself: five; what the link points at stays.
        assert_eq!(remove_at(&root, "tree").unwrap(), 5);
        assert!(!tree.exists());
        assert!(outside.path().join("keep").exists());
        assert_eq!(remove_at(&root, "tree").unwrap(), 0);
    }
}
