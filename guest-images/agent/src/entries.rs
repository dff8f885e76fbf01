//! The sandbox's file methods in the guest ([`strata_guest_proto::HostMessage::Stat`], `ListDir`, `CreateDir`,
//! `Rename`, `Remove`): what is at a path, what a directory holds, and changes to the tree.
//!
//! Nothing is followed where the operation is on the path itself: a link is described, listed, moved and removed
//! as a link (`lstat`, `rename(2)`, `unlink`), a listing never enters one (it walks as [`crate::tree`] does), and
//! a link where a directory should be made is in the way. Paths sent back are at most [`MAX_PATH`] bytes.

use std::fs;
use std::os::fd::OwnedFd;
use std::os::unix::fs::DirBuilderExt;
use std::path::Path;

use nix::fcntl::{readlink, readlinkat};
use nix::sys::stat::{FileStat, SFlag, lstat};
use strata_guest_proto::{EntryInfo, FileType, MAX_PATH};

use crate::files::{FileError, checked_dir_path, checked_path};
use crate::tree::{self, Listed, errno};

/// Describes what is at `path` without following a link there.
pub fn stat(path: &str) -> Result<EntryInfo, FileError> {
    checked_dir_path(path)?;
    // Without a trailing slash, which would follow a link.
    let path = absolute(path);
    let stat = lstat(path.as_str()).map_err(|e| errno(&path, e))?;
    let target = || readlink(path.as_str()).map_err(|e| errno(&path, e));
    entry(path.clone(), &stat, target)
}

/// Lists the directory `path` down to `depth` levels (1: its own entries) in batches handed to `batch`, never
/// entering a link; more than `max_entries` entries is `E2BIG`. Entries whose path would be longer than
/// [`MAX_PATH`] bytes are skipped (counted).
pub fn list_dir(
    path: &str,
    depth: u32,
    max_entries: u64,
    batch: impl FnMut(Vec<EntryInfo>),
) -> Result<Listed, FileError> {
    let depth = depth.clamp(1, strata_guest_proto::MAX_LIST_DEPTH);
    let root = absolute(path);
    let describe = |parent: &OwnedFd, name: &str, rel: &str, stat: &FileStat| {
        let child = join(&root, rel);
        if child.len() > MAX_PATH {
            return Ok(None);
        }
        match entry(child, stat, || readlinkat(parent, name).map_err(|e| errno(path, e))) {
            Ok(entry) => Ok(Some(entry)),
            // A link removed between its listing and its reading.
            Err(err) if err.errno == libc::ENOENT => Ok(None),
            Err(err) => Err(err),
        }
    };
    tree::walk(path, depth, max_entries, describe, batch)
}

/// Makes the directory `path` and its missing parents, as `mkdir -p`; `false` when a directory was already there.
/// Anything else at `path`, a link too, is `ENOTDIR`.
pub fn create_dir(path: &str) -> Result<bool, FileError> {
    checked_dir_path(path)?;
    let found = |path: &str| match lstat(path) {
        Ok(stat) if kind(&stat) == FileType::Dir => Ok(false),
        Ok(_) => Err(FileError::new(libc::ENOTDIR, format!("{path} exists and is not a directory"))),
        Err(e) => Err(errno(path, e)),
    };
    match found(path) {
        Err(err) if err.errno == libc::ENOENT => {}
        other => return other,
    }
    if let Some(parent) = Path::new(path).parent() {
        fs::DirBuilder::new().recursive(true).mode(0o755).create(parent).map_err(|e| FileError::io(path, &e))?;
    }
    match fs::DirBuilder::new().mode(0o755).create(path) {
        Ok(()) => Ok(true),
        // Made meanwhile, or something else was.
        Err(err) if err.kind() == std::io::ErrorKind::AlreadyExists => found(path),
        Err(err) => Err(FileError::io(path, &err)),
    }
}

/// Moves `from` to `to` (`rename(2)`: a link is moved, not its target) and describes it there.
pub fn rename(from: &str, to: &str) -> Result<EntryInfo, FileError> {
    checked_path(from)?;
    checked_path(to)?;
    fs::rename(from, to).map_err(|e| FileError::io(from, &e))?;
    stat(to)
}

/// Removes the file or link at `path`, or the directory and everything in it, never following a link (the
/// standard library's `remove_dir_all` opens each directory beneath the last without following one).
pub fn remove(path: &str) -> Result<(), FileError> {
    checked_path(path)?;
    let stat = lstat(path).map_err(|e| errno(path, e))?;
    let removed = if kind(&stat) == FileType::Dir { fs::remove_dir_all(path) } else { fs::remove_file(path) };
    removed.map_err(|e| FileError::io(path, &e))
}

/// The entry for `stat` at `path`; `target` reads a link's target (longer than [`MAX_PATH`] bytes, or not
/// UTF-8: shown lossily, cut at a character boundary).
fn entry(
    path: String,
    stat: &FileStat,
    target: impl FnOnce() -> Result<std::ffi::OsString, FileError>,
) -> Result<EntryInfo, FileError> {
    let file_type = kind(stat);
    let target = match file_type {
        FileType::Symlink => Some(bounded(target()?.to_string_lossy().into_owned())),
        _ => None,
    };
    let nanos = u32::try_from(stat.st_mtime_nsec).ok().filter(|n| *n < 1_000_000_000);
    Ok(EntryInfo {
        path,
        file_type,
        size: u64::try_from(stat.st_size).unwrap_or(0),
        mode: stat.st_mode & 0o7777,
        uid: stat.st_uid,
        gid: stat.st_gid,
        modified: nanos.map(|nanos| (stat.st_mtime, nanos)),
        target,
    })
}

fn kind(stat: &FileStat) -> FileType {
    match SFlag::from_bits_truncate(stat.st_mode & SFlag::S_IFMT.bits()) {
        SFlag::S_IFREG => FileType::File,
        SFlag::S_IFDIR => FileType::Dir,
        SFlag::S_IFLNK => FileType::Symlink,
        _ => FileType::Other,
    }
}

fn bounded(mut text: String) -> String {
    if text.len() > MAX_PATH {
        let mut end = MAX_PATH;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
    }
    text
}

/// `path` without trailing slashes (`/` for the root).
fn absolute(path: &str) -> String {
    match path.trim_end_matches('/') {
        "" => "/".to_owned(),
        trimmed => trimmed.to_owned(),
    }
}

/// `rel` below the absolute directory `dir`.
pub(crate) fn join(dir: &str, rel: &str) -> String {
    if dir == "/" { format!("/{rel}") } else { format!("{dir}/{rel}") }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::{PermissionsExt, symlink};

    use super::*;

    fn at(dir: &tempfile::TempDir, name: &str) -> String {
        dir.path().join(name).to_str().expect("utf-8").to_owned()
    }

    fn listing(path: &str, depth: u32, max: u64) -> Result<Vec<EntryInfo>, FileError> {
        let mut entries = Vec::new();
        list_dir(path, depth, max, |batch| entries.extend(batch))?;
        Ok(entries)
    }

    #[test]
    fn stat_describes_a_link_as_a_link() {
        let dir = tempfile::tempdir().expect("tempdir");
        fs::write(dir.path().join("f"), b"12345").expect("write");
        fs::set_permissions(dir.path().join("f"), fs::Permissions::from_mode(0o640)).expect("chmod");
        symlink("f", dir.path().join("link")).expect("symlink");
        let file = stat(&at(&dir, "f")).expect("stat");
        assert_eq!((file.file_type, file.size, file.mode, file.target), (FileType::File, 5, 0o640, None));
        assert!(file.modified.is_some());
        let link = stat(&at(&dir, "link")).expect("stat link");
        assert_eq!((link.file_type, link.target.as_deref()), (FileType::Symlink, Some("f")));
        let root = stat(&at(&dir, "")).expect("stat the directory");
        assert_eq!((root.path, root.file_type), (dir.path().to_str().expect("utf-8").to_owned(), FileType::Dir));
        assert_eq!(stat(&at(&dir, "missing")).err().map(|e| e.errno), Some(libc::ENOENT));
        assert_eq!(stat("relative").err().map(|e| e.errno), Some(libc::EINVAL));
    }

    #[test]
    fn listings_go_as_deep_as_asked_and_never_into_a_link() {
        let dir = tempfile::tempdir().expect("tempdir");
        let outside = tempfile::tempdir().expect("tempdir");
        fs::write(outside.path().join("secret"), b"x").expect("write");
        fs::create_dir_all(dir.path().join("a/b")).expect("mkdir");
        fs::write(dir.path().join("a/b/deep"), b"").expect("write");
        symlink(outside.path(), dir.path().join("out")).expect("symlink");
        let root = at(&dir, "");
        let paths =
            |depth| -> Vec<String> { listing(&root, depth, 100).expect("list").into_iter().map(|e| e.path).collect() };
        assert_eq!(paths(1), [at(&dir, "a"), at(&dir, "out")]);
        assert_eq!(paths(2), [at(&dir, "a"), at(&dir, "out"), at(&dir, "a/b")]);
        assert_eq!(paths(64), [at(&dir, "a"), at(&dir, "out"), at(&dir, "a/b"), at(&dir, "a/b/deep")]);
        assert_eq!(listing(&root, 64, 3).err().map(|e| e.errno), Some(libc::E2BIG));
        let link = listing(&at(&dir, "out"), 1, 100).err().map(|e| e.errno);
        assert!(matches!(link, Some(libc::ENOTDIR | libc::ELOOP)), "{link:?}");
        assert_eq!(listing(&at(&dir, "nowhere"), 1, 100).err().map(|e| e.errno), Some(libc::ENOENT));
    }

    #[test]
    fn create_dir_is_mkdir_p_and_refuses_what_is_in_the_way() {
        let dir = tempfile::tempdir().expect("tempdir");
        assert_eq!(create_dir(&at(&dir, "a/b/c")), Ok(true));
        assert!(dir.path().join("a/b/c").is_dir());
        assert_eq!(create_dir(&at(&dir, "a/b/c")), Ok(false));
        fs::write(dir.path().join("file"), b"").expect("write");
        assert_eq!(create_dir(&at(&dir, "file")).err().map(|e| e.errno), Some(libc::ENOTDIR));
        symlink(dir.path().join("a"), dir.path().join("link")).expect("symlink");
        assert_eq!(create_dir(&at(&dir, "link")).err().map(|e| e.errno), Some(libc::ENOTDIR));
        let under_file = create_dir(&at(&dir, "file/sub")).err().map(|e| e.errno);
        assert!(matches!(under_file, Some(libc::ENOTDIR | libc::EEXIST)), "{under_file:?}");
    }

    #[test]
    fn rename_and_remove_act_on_links_not_their_targets() {
        let dir = tempfile::tempdir().expect("tempdir");
        let outside = tempfile::tempdir().expect("tempdir");
        fs::write(outside.path().join("keep"), b"x").expect("write");
        symlink(outside.path(), dir.path().join("link")).expect("symlink");
        let moved = rename(&at(&dir, "link"), &at(&dir, "moved")).expect("rename");
        assert_eq!((moved.path, moved.file_type), (at(&dir, "moved"), FileType::Symlink));
        remove(&at(&dir, "moved")).expect("remove the link");
        assert!(outside.path().join("keep").exists(), "the link's target was touched");
        fs::create_dir_all(dir.path().join("t/u")).expect("mkdir");
        symlink(outside.path(), dir.path().join("t/u/out")).expect("symlink");
        remove(&at(&dir, "t")).expect("remove a tree");
        assert!(!dir.path().join("t").exists());
        assert!(outside.path().join("keep").exists(), "a link inside the tree was followed");
        assert_eq!(remove(&at(&dir, "t")).err().map(|e| e.errno), Some(libc::ENOENT));
        assert_eq!(rename(&at(&dir, "t"), &at(&dir, "u")).err().map(|e| e.errno), Some(libc::ENOENT));
        assert_eq!(remove("/").err().map(|e| e.errno), Some(libc::EINVAL), "the root is never removed");
    }
}
