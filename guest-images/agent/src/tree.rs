//! Tree listings ([`strata_guest_proto::HostMessage::ListTree`]): what a directory holds, for the host to copy a
//! read-write grant back.
//!
//! Nothing is followed: the listed directory is opened with `O_NOFOLLOW`, every directory below it is reopened
//! component by component from there with `O_NOFOLLOW | O_DIRECTORY` (so a directory swapped for a symbolic link
//! during the walk is never entered), and entries are described with `fstatat(AT_SYMLINK_NOFOLLOW)`. The walk is
//! breadth-first, so every directory is listed before its entries, and holds two descriptors at a time whatever
//! the depth. It is bounded by the host's `max_entries` and by [`MAX_PATH`] per path and link target.

use std::collections::VecDeque;
use std::ffi::OsStr;
use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt;

use nix::dir::Dir;
use nix::errno::Errno;
use nix::fcntl::{OFlag, openat, readlinkat};
use nix::sys::stat::{FileStat, Mode, SFlag, fstatat};
use nix::unistd::dup;
use strata_guest_proto::{EntryKind, MAX_PATH, MAX_TREE_BATCH, TreeEntry};

use crate::files::{FileError, checked_dir_path};

/// What a finished listing sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Listed {
    /// Entries sent.
    pub count: u64,
    /// Entries left out: names that are not UTF-8, devices, FIFOs, sockets, link targets that are not UTF-8.
    pub skipped: u64,
}

const DIR_FLAGS: OFlag = OFlag::O_RDONLY.union(OFlag::O_DIRECTORY).union(OFlag::O_NOFOLLOW).union(OFlag::O_CLOEXEC);

/// Lists the tree under the directory `path` in batches of at most [`MAX_TREE_BATCH`] entries handed to `batch`.
/// More than `max_entries` entries is `E2BIG`; a relative path or link target over [`MAX_PATH`] bytes is
/// `ENAMETOOLONG`. An entry that vanishes during the walk is left out.
pub fn list(path: &str, max_entries: u64, batch: impl FnMut(Vec<TreeEntry>)) -> Result<Listed, FileError> {
    let describe = |parent: &OwnedFd, name: &str, rel: &str, stat: &FileStat| {
        if rel.len() > MAX_PATH {
            return Err(too_long(path, rel));
        }
        let entry = describe(parent, name, rel, stat).map_err(|e| errno(&join(path, rel), e))?;
        if entry.as_ref().and_then(|e| e.target.as_ref()).is_some_and(|t| t.len() > MAX_PATH) {
            return Err(too_long(path, rel));
        }
        Ok(entry)
    };
    walk(path, u32::MAX, max_entries, describe, batch)
}

/// Walks the tree under the directory `path` breadth first, `max_depth` levels deep (1: its own entries), and
/// hands what `describe` makes of each entry (`None`: left out and counted as skipped) to `batch`, at most
/// [`MAX_TREE_BATCH`] at a time. `describe` gets the entry's directory, its name and its path relative to
/// `path`, and its `lstat`; only directories it describes are entered. More than `max_entries` entries is
/// `E2BIG`; names that are not UTF-8 are skipped; an entry that vanishes during the walk is left out.
pub(crate) fn walk<E>(
    path: &str,
    max_depth: u32,
    max_entries: u64,
    mut describe: impl FnMut(&OwnedFd, &str, &str, &FileStat) -> Result<Option<E>, FileError>,
    mut batch: impl FnMut(Vec<E>),
) -> Result<Listed, FileError> {
    let root_path = checked_dir_path(path)?;
    let root = nix::fcntl::open(root_path, DIR_FLAGS, Mode::empty()).map_err(|e| errno(path, e))?;
    let mut listed = Listed { count: 0, skipped: 0 };
    let mut pending = Vec::with_capacity(MAX_TREE_BATCH);
    let mut dirs = VecDeque::from([(String::new(), 1u32)]);
    while let Some((rel, depth)) = dirs.pop_front() {
        let fd = match open_beneath(&root, &rel) {
            Ok(fd) => fd,
            // Removed since it was listed.
            Err(Errno::ENOENT) => continue,
            Err(e) => return Err(errno(&join(path, &rel), e)),
        };
        let parent = dup(&fd).map_err(|e| errno(&join(path, &rel), e))?;
        for name in names(fd, &join(path, &rel))? {
            let Ok(name) = std::str::from_utf8(name.as_bytes()) else {
                listed.skipped += 1;
                continue;
            };
            let child = if rel.is_empty() { name.to_owned() } else { format!("{rel}/{name}") };
            let stat = match fstatat(&parent, name, nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW) {
                Ok(stat) => stat,
                Err(Errno::ENOENT) => continue,
                Err(e) => return Err(errno(&join(path, &child), e)),
            };
            let Some(entry) = describe(&parent, name, &child, &stat)? else {
                listed.skipped += 1;
                continue;
            };
            listed.count += 1;
            if listed.count > max_entries {
                return Err(FileError::new(libc::E2BIG, format!("{path} holds more than {max_entries} entries")));
            }
            if depth < max_depth && SFlag::from_bits_truncate(stat.st_mode & SFlag::S_IFMT.bits()) == SFlag::S_IFDIR {
                dirs.push_back((child, depth + 1));
            }
            pending.push(entry);
            if pending.len() == MAX_TREE_BATCH {
                batch(std::mem::replace(&mut pending, Vec::with_capacity(MAX_TREE_BATCH)));
            }
        }
    }
    if !pending.is_empty() {
        batch(pending);
    }
    Ok(listed)
}

/// The entry for `stat`, or `None` for what a listing leaves out.
fn describe(parent: &OwnedFd, name: &str, rel: &str, stat: &FileStat) -> Result<Option<TreeEntry>, Errno> {
    let mode = stat.st_mode & 0o7777;
    let entry = |kind, size, target| Some(TreeEntry { path: rel.to_owned(), kind, mode, size, target });
    Ok(match SFlag::from_bits_truncate(stat.st_mode & SFlag::S_IFMT.bits()) {
        SFlag::S_IFREG => entry(EntryKind::File, u64::try_from(stat.st_size).unwrap_or(0), None),
        SFlag::S_IFDIR => entry(EntryKind::Dir, 0, None),
        SFlag::S_IFLNK => {
            let target = match readlinkat(parent, name) {
                Ok(target) => target,
                Err(Errno::ENOENT) => return Ok(None),
                Err(e) => return Err(e),
            };
            match target.into_string() {
                Ok(target) => entry(EntryKind::Symlink, target.len() as u64, Some(target)),
                Err(_) => None,
            }
        }
        _ => None,
    })
}

/// The names in a directory (without `.` and `..`), sorted.
fn names(fd: OwnedFd, path: &str) -> Result<Vec<std::ffi::OsString>, FileError> {
    let mut dir = Dir::from_fd(fd).map_err(|e| errno(path, e))?;
    let mut names = Vec::new();
    for entry in dir.iter() {
        let entry = entry.map_err(|e| errno(path, e))?;
        let name = OsStr::from_bytes(entry.file_name().to_bytes());
        if name != "." && name != ".." {
            names.push(name.to_owned());
        }
    }
    names.sort();
    Ok(names)
}

/// Opens the directory `rel` (components separated by `/`; empty for `root` itself) below `root`, one component at
/// a time, never following a symbolic link.
fn open_beneath(root: &OwnedFd, rel: &str) -> Result<OwnedFd, Errno> {
    let mut fd = dup(root)?;
    for component in rel.split('/').filter(|c| !c.is_empty()) {
        fd = openat(&fd, component, DIR_FLAGS, Mode::empty())?;
    }
    Ok(fd)
}

pub(crate) fn join(root: &str, rel: &str) -> String {
    if rel.is_empty() { root.to_owned() } else { format!("{root}/{rel}") }
}

pub(crate) fn errno(path: &str, err: Errno) -> FileError {
    FileError::new(err as i32, format!("{path}: {}", err.desc()))
}

fn too_long(root: &str, rel: &str) -> FileError {
    let shown: String = rel.chars().take(64).collect();
    FileError::new(libc::ENAMETOOLONG, format!("{root}/{shown}...: longer than {MAX_PATH} bytes"))
}

#[cfg(test)]
mod tests {
    use std::fs;
    use std::os::unix::fs::{PermissionsExt, symlink};

    use super::*;

    fn listing(path: &str, max: u64) -> Result<(Vec<TreeEntry>, Listed), FileError> {
        let mut entries = Vec::new();
        let listed = list(path, max, |batch| {
            assert!(batch.len() <= MAX_TREE_BATCH);
            entries.extend(batch);
        })?;
        Ok((entries, listed))
    }

    #[test]
    fn a_tree_is_listed_breadth_first_without_following_links() {
        let dir = tempfile::tempdir().expect("tempdir");
        let outside = tempfile::tempdir().expect("tempdir");
        fs::write(outside.path().join("secret"), b"outside").expect("write");
        fs::create_dir_all(dir.path().join("a/b")).expect("mkdir");
        fs::write(dir.path().join("a/b/f"), b"12345").expect("write");
        fs::set_permissions(dir.path().join("a/b/f"), fs::Permissions::from_mode(0o640)).expect("chmod");
        symlink(outside.path(), dir.path().join("a/out")).expect("symlink");
        nix::unistd::mkfifo(&dir.path().join("fifo"), Mode::from_bits_truncate(0o600)).expect("mkfifo");
        let path = dir.path().to_str().expect("utf-8");
        let (entries, listed) = listing(path, 100).expect("list");
        let shown: Vec<(&str, EntryKind, u64)> = entries.iter().map(|e| (e.path.as_str(), e.kind, e.size)).collect();
        let target_len = outside.path().as_os_str().len() as u64;
        assert_eq!(
            shown,
            vec![
                ("a", EntryKind::Dir, 0),
                ("a/b", EntryKind::Dir, 0),
                ("a/out", EntryKind::Symlink, target_len),
                ("a/b/f", EntryKind::File, 5)
            ]
        );
        assert_eq!(entries[2].target.as_deref(), outside.path().to_str());
        assert_eq!(entries[3].mode, 0o640);
        assert_eq!(listed, Listed { count: 4, skipped: 1 });
    }

    #[test]
    fn listings_are_bounded() {
        let dir = tempfile::tempdir().expect("tempdir");
        for i in 0..250 {
            fs::write(dir.path().join(format!("f{i:03}")), b"").expect("write");
        }
        let path = dir.path().to_str().expect("utf-8");
        assert_eq!(listing(path, 250).expect("list").1.count, 250);
        assert_eq!(listing(path, 249).err().map(|e| e.errno), Some(libc::E2BIG));

        // A relative path over MAX_PATH bytes, made one directory at a time (its absolute path is too long
        // for mkdir).
        let mut fd = nix::fcntl::open(dir.path(), DIR_FLAGS, Mode::empty()).expect("open");
        let mut rel_len = 0;
        for name in std::iter::once("d".to_owned()).chain(std::iter::repeat("x".repeat(200))) {
            if rel_len > MAX_PATH {
                break;
            }
            nix::sys::stat::mkdirat(&fd, name.as_str(), Mode::from_bits_truncate(0o755)).expect("mkdirat");
            fd = openat(&fd, name.as_str(), DIR_FLAGS, Mode::empty()).expect("openat");
            rel_len += name.len() + 1;
        }
        assert_eq!(listing(path, 100_000).err().map(|e| e.errno), Some(libc::ENAMETOOLONG));
    }

    #[test]
    fn the_listed_directory_must_be_one() {
        let dir = tempfile::tempdir().expect("tempdir");
        fs::write(dir.path().join("file"), b"").expect("write");
        symlink(dir.path(), dir.path().join("link")).expect("symlink");
        let at = |name: &str| dir.path().join(name).to_str().expect("utf-8").to_owned();
        assert_eq!(listing(&at("file"), 10).err().map(|e| e.errno), Some(libc::ENOTDIR));
        // O_DIRECTORY | O_NOFOLLOW on a link: ENOTDIR (ELOOP on some kernels).
        let link = listing(&at("link"), 10).err().map(|e| e.errno);
        assert!(matches!(link, Some(libc::ENOTDIR | libc::ELOOP)), "{link:?}");
        assert_eq!(listing(&at("missing"), 10).err().map(|e| e.errno), Some(libc::ENOENT));
        assert_eq!(listing("relative", 10).err().map(|e| e.errno), Some(libc::EINVAL));
    }
}
