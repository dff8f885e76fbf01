//! File transfers: chunked, atomic writes and bounded reads of regular files.

use std::collections::HashMap;
use std::fs::{self, File, OpenOptions};
use std::io::{self, ErrorKind, Read, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use strata_guest_proto::{GuestMessage, MAX_CHUNK, RequestId};

/// A file operation that failed: the `errno` and a message naming the path.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct FileError {
    /// The OS error number.
    pub errno: i32,
    /// What failed.
    pub message: String,
}

impl FileError {
    pub(crate) fn io(path: &str, err: &io::Error) -> FileError {
        FileError { errno: err.raw_os_error().unwrap_or(libc::EIO), message: format!("{path}: {err}") }
    }

    pub(crate) fn new(errno: i32, message: String) -> FileError {
        FileError { errno, message }
    }

    /// The message answering request `id`.
    pub fn answer(self, id: RequestId) -> GuestMessage {
        GuestMessage::FileError { id, errno: self.errno, message: self.message }
    }
}

/// A path the host named: absolute, not a directory name, no NUL.
pub fn checked_path(path: &str) -> Result<&Path, FileError> {
    if !path.starts_with('/') || path.ends_with('/') || path.contains('\0') {
        return Err(FileError::new(libc::EINVAL, format!("{path:?} is not an absolute file path")));
    }
    Ok(Path::new(path))
}

/// A directory path the host named: absolute, no NUL (a trailing `/` is allowed).
pub fn checked_dir_path(path: &str) -> Result<&Path, FileError> {
    if !path.starts_with('/') || path.contains('\0') {
        return Err(FileError::new(libc::EINVAL, format!("{path:?} is not an absolute directory path")));
    }
    Ok(Path::new(path))
}

/// Creates the directory `path` (and missing parents, mode `0o755`) or finds one there, then sets its permission
/// bits; with `empty`, a directory that already has entries is `ENOTEMPTY`. A symbolic link at `path` is never
/// followed (`ENOTDIR`).
pub fn make_dir(path: &str, mode: u32, empty: bool) -> Result<(), FileError> {
    let target = checked_dir_path(path)?;
    if mode > 0o7777 {
        return Err(FileError::new(libc::EINVAL, format!("mode {mode:#o} for {path}")));
    }
    if let Some(parent) = target.parent()
        && !parent.is_dir()
    {
        fs::DirBuilder::new().recursive(true).mode(0o755).create(parent).map_err(|e| FileError::io(path, &e))?;
    }
    match fs::DirBuilder::new().mode(0o700).create(target) {
        Ok(()) => {}
        Err(err) if err.kind() == ErrorKind::AlreadyExists => {}
        Err(err) => return Err(FileError::io(path, &err)),
    }
    // Opened without following a link, and checked through the descriptor: what was found is what is changed.
    let dir =
        OpenOptions::new().read(true).custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW).open(target).map_err(|e| {
            match e.raw_os_error() {
                Some(libc::ELOOP) => FileError::new(libc::ENOTDIR, format!("{path} is a symbolic link")),
                _ => FileError::io(path, &e),
            }
        })?;
    if empty && fs::read_dir(target).map_err(|e| FileError::io(path, &e))?.next().is_some() {
        return Err(FileError::new(libc::ENOTEMPTY, format!("{path} is not empty")));
    }
    dir.set_permissions(fs::Permissions::from_mode(mode)).map_err(|e| FileError::io(path, &e))
}

/// Creates a symbolic link at `path` whose target is `target`, stored as given. Missing parents are created.
pub fn make_symlink(path: &str, target: &str) -> Result<(), FileError> {
    let link = checked_path(path)?;
    if target.is_empty() || target.len() > strata_guest_proto::MAX_PATH || target.contains('\0') {
        return Err(FileError::new(libc::EINVAL, format!("link target for {path}: empty, too long or with NUL")));
    }
    if let Some(parent) = link.parent()
        && !parent.is_dir()
    {
        fs::DirBuilder::new().recursive(true).mode(0o755).create(parent).map_err(|e| FileError::io(path, &e))?;
    }
    std::os::unix::fs::symlink(target, link).map_err(|e| FileError::io(path, &e))
}

/// Writes in progress on one connection, by request.
#[derive(Debug, Default)]
pub struct Writes {
    open: HashMap<RequestId, PendingWrite>,
}

#[derive(Debug)]
enum PendingWrite {
    Open {
        file: File,
        temp: PathBuf,
        path: String,
        mode: u32,
    },
    /// Failed and answered; its remaining chunks are dropped.
    Failed,
}

impl Writes {
    /// Handles one chunk; returns the answer when there is one (after the last chunk, or at the first failure).
    pub fn chunk(&mut self, id: RequestId, path: &str, mode: u32, data: &[u8], last: bool) -> Option<GuestMessage> {
        let state = match self.open.remove(&id) {
            Some(state) => state,
            None => match begin(id, path, mode) {
                Ok(state) => state,
                Err(err) => return self.failed(id, last, err),
            },
        };
        let PendingWrite::Open { mut file, temp, path, mode } = state else {
            if !last {
                self.open.insert(id, PendingWrite::Failed);
            }
            return None;
        };
        if let Err(err) = file.write_all(data) {
            let _ = fs::remove_file(&temp);
            return self.failed(id, last, FileError::io(&path, &err));
        }
        if !last {
            self.open.insert(id, PendingWrite::Open { file, temp, path, mode });
            return None;
        }
        let finished =
            file.set_permissions(fs::Permissions::from_mode(mode & 0o7777)).and_then(|()| fs::rename(&temp, &path));
        Some(match finished {
            Ok(()) => GuestMessage::Ack { id },
            Err(err) => {
                let _ = fs::remove_file(&temp);
                FileError::io(&path, &err).answer(id)
            }
        })
    }

    fn failed(&mut self, id: RequestId, last: bool, err: FileError) -> Option<GuestMessage> {
        if !last {
            self.open.insert(id, PendingWrite::Failed);
        }
        Some(err.answer(id))
    }

    /// Drops every unfinished write (the connection ended).
    pub fn abandon(&mut self) {
        for (_, state) in self.open.drain() {
            if let PendingWrite::Open { temp, .. } = state {
                let _ = fs::remove_file(temp);
            }
        }
    }
}

impl Drop for Writes {
    fn drop(&mut self) {
        self.abandon();
    }
}

fn begin(id: RequestId, path: &str, mode: u32) -> Result<PendingWrite, FileError> {
    let target = checked_path(path)?;
    let (Some(parent), Some(name)) = (target.parent(), target.file_name()) else {
        return Err(FileError::new(libc::EINVAL, format!("{path:?} is not a file path")));
    };
    if !parent.is_dir() {
        fs::DirBuilder::new().recursive(true).mode(0o755).create(parent).map_err(|e| FileError::io(path, &e))?;
    }
    let temp = parent.join(format!(".{}.strata-{}.tmp", name.to_string_lossy(), id.0));
    let file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&temp)
        .map_err(|e| FileError::io(path, &e))?;
    Ok(PendingWrite::Open { file, temp, path: path.to_owned(), mode })
}

/// Reads a regular file of at most `max` bytes, handing it out in chunks of at most [`MAX_CHUNK`] bytes;
/// returns its size.
pub fn read(path: &str, max: u64, mut chunk: impl FnMut(&[u8])) -> Result<u64, FileError> {
    checked_path(path)?;
    // O_NONBLOCK: a FIFO planted by a job must not block the agent.
    let mut file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
        .map_err(|e| FileError::io(path, &e))?;
    let meta = file.metadata().map_err(|e| FileError::io(path, &e))?;
    if meta.is_dir() {
        return Err(FileError::new(libc::EISDIR, format!("{path} is a directory")));
    }
    if !meta.is_file() {
        return Err(FileError::new(libc::EINVAL, format!("{path} is not a regular file")));
    }
    let too_big = || FileError::new(libc::EFBIG, format!("{path} is larger than {max} bytes"));
    if meta.len() > max {
        return Err(too_big());
    }
    let mut buf = vec![0u8; MAX_CHUNK];
    let mut total = 0u64;
    loop {
        let n = match file.read(&mut buf) {
            Ok(0) => return Ok(total),
            Ok(n) => n,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => return Err(FileError::io(path, &e)),
        };
        // The file may grow while it is read.
        if total + n as u64 > max {
            return Err(too_big());
        }
        total += n as u64;
        chunk(&buf[..n]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn path_in(dir: &tempfile::TempDir, name: &str) -> String {
        dir.path().join(name).to_str().expect("utf-8").to_owned()
    }

    #[test]
    fn chunked_write_appears_only_when_complete() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = path_in(&dir, "sub/file");
        let mut writes = Writes::default();
        assert_eq!(writes.chunk(RequestId(1), &path, 0o640, b"hello ", false), None);
        assert!(!Path::new(&path).exists());
        assert_eq!(
            writes.chunk(RequestId(1), &path, 0o640, b"world", true),
            Some(GuestMessage::Ack { id: RequestId(1) })
        );
        assert_eq!(fs::read(&path).expect("read"), b"hello world");
        assert_eq!(fs::metadata(&path).expect("meta").permissions().mode() & 0o7777, 0o640);
        assert_eq!(fs::read_dir(dir.path().join("sub")).expect("dir").count(), 1, "no temporary file left");
    }

    #[test]
    fn a_failed_write_answers_once_and_drops_the_rest() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut writes = Writes::default();
        // The parent is a file.
        let file = path_in(&dir, "f");
        fs::write(&file, b"x").expect("write");
        let bad = format!("{file}/child");
        let first = writes.chunk(RequestId(2), &bad, 0o644, b"a", false);
        assert!(
            matches!(first, Some(GuestMessage::FileError { errno, .. }) if errno == libc::ENOTDIR || errno == libc::EEXIST)
        );
        assert_eq!(writes.chunk(RequestId(2), &bad, 0o644, b"b", false), None);
        assert_eq!(writes.chunk(RequestId(2), &bad, 0o644, b"", true), None);
        assert!(writes.open.is_empty());
    }

    #[test]
    fn relative_paths_are_refused() {
        let mut writes = Writes::default();
        let answer = writes.chunk(RequestId(3), "etc/passwd", 0o644, b"", true);
        assert!(matches!(answer, Some(GuestMessage::FileError { errno: libc::EINVAL, .. })));
        assert_eq!(read("x", 10, |_| {}).err().map(|e| e.errno), Some(libc::EINVAL));
    }

    #[test]
    fn reads_are_bounded_and_typed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = path_in(&dir, "data");
        fs::write(&path, vec![7u8; 200_000]).expect("write");
        let mut got = Vec::new();
        let size = read(&path, 200_000, |chunk| {
            assert!(chunk.len() <= MAX_CHUNK);
            got.extend_from_slice(chunk);
        })
        .expect("read");
        assert_eq!(size, 200_000);
        assert_eq!(got, vec![7u8; 200_000]);
        assert_eq!(read(&path, 199_999, |_| {}).err().map(|e| e.errno), Some(libc::EFBIG));
        assert_eq!(read(&path_in(&dir, "missing"), 10, |_| {}).err().map(|e| e.errno), Some(libc::ENOENT));
        let dir_path = dir.path().to_str().expect("utf-8");
        assert_eq!(read(dir_path, 10, |_| {}).err().map(|e| e.errno), Some(libc::EISDIR));
    }

    #[test]
    fn directories_and_links_are_made_without_following_links() {
        let dir = tempfile::tempdir().expect("tempdir");
        let sub = path_in(&dir, "a/b");
        make_dir(&sub, 0o750, true).expect("mkdir");
        assert_eq!(fs::metadata(&sub).expect("meta").permissions().mode() & 0o7777, 0o750);
        // Again: only the bits change.
        make_dir(&sub, 0o700, true).expect("again");
        assert_eq!(fs::metadata(&sub).expect("meta").permissions().mode() & 0o7777, 0o700);
        fs::write(dir.path().join("a/b/f"), b"x").expect("write");
        assert_eq!(make_dir(&sub, 0o700, true).err().map(|e| e.errno), Some(libc::ENOTEMPTY));
        make_dir(&sub, 0o755, false).expect("not asked to be empty");

        let link = path_in(&dir, "a/link");
        make_symlink(&link, "../../outside").expect("symlink");
        assert_eq!(fs::read_link(&link).expect("readlink").to_str(), Some("../../outside"));
        assert_eq!(make_symlink(&link, "x").err().map(|e| e.errno), Some(libc::EEXIST));
        // A directory request at a link is refused, and the link's target is untouched.
        let outside = tempfile::tempdir().expect("tempdir");
        let to_outside = path_in(&dir, "a/out");
        std::os::unix::fs::symlink(outside.path(), &to_outside).expect("symlink");
        let before = fs::metadata(outside.path()).expect("meta").permissions().mode();
        assert_eq!(make_dir(&to_outside, 0o777, false).err().map(|e| e.errno), Some(libc::ENOTDIR));
        assert_eq!(fs::metadata(outside.path()).expect("meta").permissions().mode(), before);
        assert_eq!(make_dir("rel", 0o755, false).err().map(|e| e.errno), Some(libc::EINVAL));
        assert_eq!(make_symlink(&path_in(&dir, "l2"), "").err().map(|e| e.errno), Some(libc::EINVAL));
    }

    #[test]
    fn a_fifo_does_not_block_a_read() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = path_in(&dir, "fifo");
        nix::unistd::mkfifo(path.as_str(), nix::sys::stat::Mode::from_bits_truncate(0o600)).expect("mkfifo");
        assert_eq!(read(&path, 10, |_| {}).err().map(|e| e.errno), Some(libc::EINVAL));
    }
}
