//! PID 1's filesystem methods: listing, stat, making directories, renaming, removing, on the jail's root.
//!
//! PID 1 sees the jail's tree exactly as the guest does (it lives in the jail's mount namespace, whose root is
//! the jail's), but it holds every capability, so it never lets the kernel follow a link the guest wrote: each
//! path is walked one component at a time with `openat(O_PATH | O_NOFOLLOW)`, a symlink met on the way is read
//! (`readlinkat`) and its text resolved again from the jail's root, so no link — not even a `/proc` magic link,
//! whose text is only a name — takes the walk anywhere the guest could not name; `..` never climbs above `/`
//! (the kernel stops it at PID 1's root). The last component is never followed by `stat`, `rename` and
//! `remove`. Directories of the jail's kernel filesystems (`/proc`, `/sys`, `/dev`, recognised by their device)
//! are refused wherever the walk ends up in them, and a recursive listing or removal never descends into one.
//! (`openat2` with `RESOLVE_IN_ROOT` would do the walk in the kernel, but the jail's filter answers it `ENOSYS`,
//! and PID 1 runs under that filter.)

use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};

use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag, openat, readlinkat, renameat};
use nix::sys::stat::{FileStat, Mode, SFlag, fstat, fstatat, mkdirat};
use nix::unistd::{UnlinkatFlags, unlinkat};

use crate::proto::{Entry, EntryKind, IdMap, JailFrame, MAX_INLINE, MAX_LIST_BYTES};

/// The most symlinks one walk follows (the kernel's own limit).
const MAX_LINKS: usize = 40;

/// The deepest tree `remove` descends (a guest can nest directories far below `PATH_MAX`).
const MAX_REMOVE_DEPTH: usize = 512;

/// The deepest a listing goes, whatever it is asked.
const MAX_LIST_DEPTH: u32 = 64;

/// The jail's filesystem as PID 1 works on it.
#[derive(Debug)]
pub struct Files {
    /// The jail's root directory (`O_PATH`).
    root: OwnedFd,
    /// The devices of the jail's kernel filesystems.
    kernel_devs: Vec<u64>,
    /// The jobs' ID mapping (IDs are reported as jobs see them).
    id_map: Option<IdMap>,
    /// The jail's user and group that own what is created ([`Files::set_owner`]); the jail's root when `None`.
    owner: Option<(u32, u32)>,
}

/// Why a file method failed: an errno and a message naming the path.
#[derive(Debug)]
pub struct FileFailure {
    errno: Errno,
    message: String,
}

impl FileFailure {
    /// `errno` as a phrase about the path it happened to (`"does not exist"`).
    fn new(errno: Errno) -> FileFailure {
        let message = match errno {
            Errno::ENOENT => "does not exist".to_owned(),
            Errno::ENOTDIR => "is not a directory (or a component of it is not)".to_owned(),
            Errno::EEXIST => "already exists".to_owned(),
            Errno::ENOTEMPTY => "is a directory that is not empty".to_owned(),
            other => other.desc().to_lowercase(),
        };
        FileFailure { errno, message }
    }

    /// The failure, said of the destination of a rename.
    fn of_destination(self, to: &str) -> FileFailure {
        FileFailure { errno: self.errno, message: format!("(the destination {to}) {}", self.message) }
    }

    /// The frame reporting `errno` for `path`.
    pub fn frame_of(errno: Errno) -> JailFrame {
        FileFailure::new(errno).frame()
    }

    /// The frame that reports it.
    pub fn frame(self) -> JailFrame {
        JailFrame::FileError { errno: self.errno as i32, message: self.message }
    }
}

impl std::fmt::Display for FileFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

/// The result of a file method.
pub type FileResult<T> = Result<T, FileFailure>;

/// A path split into the directory holding it and its last component.
struct Split<'a> {
    parent: &'a str,
    name: &'a str,
}

fn split(path: &str) -> FileResult<Split<'_>> {
    let trimmed = path.trim_end_matches('/');
    match trimmed.rsplit_once('/') {
        Some((parent, name)) if !name.is_empty() && name != "." && name != ".." => Ok(Split { parent, name }),
        _ => Err(FileFailure::new(Errno::EINVAL)),
    }
}

impl Files {
    /// Opens the jail's root (PID 1 has pivoted into it) and notes its kernel filesystems.
    pub fn open(id_map: Option<IdMap>) -> Result<Files, Errno> {
        let root = nix::fcntl::open("/", OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC, Mode::empty())?;
        let root_dev = fstat(&root)?.st_dev;
        // Those mounted: a kernel filesystem the jail does not mount is a plain directory of its root.
        let kernel_devs = ["/proc", "/sys", "/dev"]
            .iter()
            .filter_map(|dir| nix::sys::stat::lstat(*dir).ok())
            .filter(|st| st.st_mode & libc::S_IFMT == libc::S_IFDIR && st.st_dev != root_dev)
            .map(|st| st.st_dev)
            .collect();
        Ok(Files { root, kernel_devs, id_map, owner: None })
    }

    /// Makes what the file methods create (and the files they write) belong to the jail's user `uid`, group
    /// `gid`, instead of the jail's root. Only in a user namespace: without one, the IDs would be the host's.
    pub fn set_owner(&mut self, uid: u32, gid: u32) {
        self.owner = Some((uid, gid));
    }

    /// The host IDs the file methods give what they create, in a user namespace.
    fn owner_ids(&self) -> Option<(u32, u32)> {
        let map = self.id_map?;
        let (uid, gid) = self.owner.unwrap_or((0, 0));
        Some((map.base.saturating_add(uid), map.base.saturating_add(gid)))
    }

    fn is_kernel(&self, st: &FileStat) -> bool {
        self.kernel_devs.contains(&st.st_dev)
    }

    /// Opens the directory at `path` (every symlink on the way, the last included, resolved inside the jail's
    /// root), as `O_PATH`. With `make`, missing directories are created (mode 0755, owned by the jail's root);
    /// it is set when one was.
    fn open_dir(&self, path: &str, make: Option<&mut bool>) -> FileResult<OwnedFd> {
        self.resolve(path, make, false).map(|(fd, _)| fd)
    }

    /// Opens what `path` names as `O_PATH`, every symlink on the way and the last one resolved inside the jail's
    /// root, and describes it. Everything but the last component must be a directory, and so must the last
    /// unless `any_last`; `make` as for [`open_dir`](Self::open_dir).
    fn resolve(&self, path: &str, mut make: Option<&mut bool>, any_last: bool) -> FileResult<(OwnedFd, FileStat)> {
        let fail = FileFailure::new;
        let mut pending: Vec<OsString> = components(path.as_bytes()).rev().collect();
        let mut current = dup(self.root.as_fd()).map_err(fail)?;
        let mut links = 0;
        while let Some(name) = pending.pop() {
            if name == ".." {
                current = openat(&current, "..", path_flags(), Mode::empty()).map_err(fail)?;
                continue;
            }
            let next = match openat(&current, name.as_os_str(), path_flags(), Mode::empty()) {
                Err(Errno::ENOENT) if make.is_some() => {
                    let made = self.creating(|| mkdirat(&current, name.as_os_str(), Mode::from_bits_truncate(0o755)));
                    match made {
                        Ok(()) | Err(Errno::EEXIST) => {}
                        Err(errno) => return Err(fail(errno)),
                    }
                    if let Some(created) = make.as_deref_mut() {
                        *created = true;
                    }
                    if let Some((uid, gid)) = self.owner_ids() {
                        nix::unistd::fchownat(
                            &current,
                            name.as_os_str(),
                            Some(nix::unistd::Uid::from_raw(uid)),
                            Some(nix::unistd::Gid::from_raw(gid)),
                            AtFlags::AT_SYMLINK_NOFOLLOW,
                        )
                        .map_err(fail)?;
                    }
                    openat(&current, name.as_os_str(), path_flags(), Mode::empty()).map_err(fail)?
                }
                other => other.map_err(fail)?,
            };
            let st = fstat(&next).map_err(fail)?;
            match st.st_mode & libc::S_IFMT {
                libc::S_IFDIR => current = next,
                libc::S_IFLNK => {
                    links += 1;
                    if links > MAX_LINKS {
                        return Err(fail(Errno::ELOOP));
                    }
                    let target = readlinkat(&next, "").map_err(fail)?;
                    let target = target.as_bytes();
                    pending.extend(components(target).rev());
                    if target.starts_with(b"/") {
                        current = dup(self.root.as_fd()).map_err(fail)?;
                    }
                }
                _ if any_last && pending.is_empty() => return self.outside_kernel(next, st),
                _ => return Err(fail(Errno::ENOTDIR)),
            }
        }
        let st = fstat(&current).map_err(fail)?;
        self.outside_kernel(current, st)
    }

    /// Runs `create` (a call that makes a name in a directory), once more as the jail's root when the kernel
    /// refuses it with `EOVERFLOW`: in an idmapped mount (a grant) host root has no mapping, so it cannot be a new
    /// file's owner, while the jail's root, as whom jobs write there, has one. The file-system IDs are the calling
    /// thread's and are set back at once.
    fn creating<T>(&self, create: impl Fn() -> nix::Result<T>) -> nix::Result<T> {
        match (create(), self.id_map) {
            (Err(Errno::EOVERFLOW), Some(map)) => {
                use nix::unistd::{Gid, Uid, setfsgid, setfsuid};
                let gid = setfsgid(Gid::from_raw(map.base));
                let uid = setfsuid(Uid::from_raw(map.base));
                let again = create();
                setfsuid(uid);
                setfsgid(gid);
                again
            }
            (result, _) => result,
        }
    }

    /// `fd`, unless it is in one of the kernel filesystems.
    fn outside_kernel(&self, fd: OwnedFd, st: FileStat) -> FileResult<(OwnedFd, FileStat)> {
        if self.is_kernel(&st) {
            return Err(FileFailure {
                errno: Errno::EXDEV,
                message: "is in the guest's kernel filesystems (/proc, /sys, /dev)".into(),
            });
        }
        Ok((fd, st))
    }

    /// Opens a regular file for reading, symlinks resolved inside the jail's root; returns it and its size.
    pub fn open_read(&self, path: &str) -> FileResult<(File, u64)> {
        let (fd, st) = self.resolve(path, None, true)?;
        let file = reopen(&fd, &st, OFlag::O_RDONLY)?;
        Ok((file, u64::try_from(st.st_size).unwrap_or(0)))
    }

    /// Writes `contents` to `path` (its missing parents made), replacing the file there, or what a symlink
    /// there names inside the jail. The file gets `mode` (without set-user-ID and set-group-ID) and, in a user
    /// namespace, the jail's root as its owner.
    pub fn write(&self, path: &str, mode: u32, contents: &mut File) -> FileResult<()> {
        let split = split(path)?;
        let dir = self.open_dir(split.parent, Some(&mut false))?;
        let mode = Mode::from_bits_truncate(mode & 0o1777);
        let flags = OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC | OFlag::O_NONBLOCK;
        let fd = match self.creating(|| openat(&dir, split.name, flags | OFlag::O_NOCTTY, mode)) {
            Ok(fd) => fd,
            // A symlink: its target, as the guest resolves it.
            Err(Errno::ELOOP) => {
                let (fd, st) = self.resolve(path, None, true)?;
                return self.write_to(reopen(&fd, &st, OFlag::O_WRONLY)?, mode, contents);
            }
            Err(errno) => return Err(FileFailure::new(errno)),
        };
        let st = fstat(&fd).map_err(FileFailure::new)?;
        self.write_to(reopen(&fd, &st, OFlag::O_WRONLY)?, mode, contents)
    }

    /// Opens the regular file `path` for appending (emptied first with `truncate`), creating it (mode 0644, owned
    /// as [`write`](Self::write) makes files) and its missing parents. Its directory is resolved inside the jail's
    /// root; a link at the last component is refused, never followed, and so is anything but a regular file.
    pub fn open_append(&self, path: &str, truncate: bool) -> FileResult<File> {
        let split = split(path)?;
        let dir = self.open_dir(split.parent, Some(&mut false))?;
        let mut flags = OFlag::O_WRONLY
            | OFlag::O_APPEND
            | OFlag::O_CREAT
            | OFlag::O_NOFOLLOW
            | OFlag::O_CLOEXEC
            | OFlag::O_NONBLOCK
            | OFlag::O_NOCTTY;
        if truncate {
            flags |= OFlag::O_TRUNC;
        }
        let fd = self
            .creating(|| openat(&dir, split.name, flags, Mode::from_bits_truncate(0o644)))
            .map_err(FileFailure::new)?;
        let st = fstat(&fd).map_err(FileFailure::new)?;
        if st.st_mode & libc::S_IFMT != libc::S_IFREG {
            return Err(FileFailure { errno: Errno::EISDIR, message: "is not a regular file".into() });
        }
        if let Some((uid, gid)) = self.owner_ids() {
            nix::unistd::fchown(&fd, Some(nix::unistd::Uid::from_raw(uid)), Some(nix::unistd::Gid::from_raw(gid)))
                .map_err(FileFailure::new)?;
        }
        Ok(File::from(fd))
    }

    fn write_to(&self, mut file: File, mode: Mode, contents: &mut File) -> FileResult<()> {
        let io = |e: std::io::Error| FileFailure::new(Errno::from_raw(e.raw_os_error().unwrap_or(libc::EIO)));
        file.set_len(0).map_err(io)?;
        std::io::copy(contents, &mut file).map_err(io)?;
        nix::sys::stat::fchmod(&file, mode).map_err(FileFailure::new)?;
        if let Some((uid, gid)) = self.owner_ids() {
            nix::unistd::fchown(&file, Some(nix::unistd::Uid::from_raw(uid)), Some(nix::unistd::Gid::from_raw(gid)))
                .map_err(FileFailure::new)?;
        }
        Ok(())
    }

    /// Describes `name` in `dir` (not following a link), at guest path `path`.
    fn entry_at(&self, dir: BorrowedFd<'_>, name: &OsStr, path: String) -> Result<(Entry, FileStat), Errno> {
        let st = fstatat(dir, name, AtFlags::AT_SYMLINK_NOFOLLOW)?;
        let link = if st.st_mode & libc::S_IFMT == libc::S_IFLNK {
            Some(String::from_utf8_lossy(readlinkat(dir, name)?.as_bytes()).into_owned())
        } else {
            None
        };
        Ok((self.entry(path, &st, link), st))
    }

    fn entry(&self, path: String, st: &FileStat, link: Option<String>) -> Entry {
        let kind = match SFlag::from_bits_truncate(st.st_mode & libc::S_IFMT) {
            SFlag::S_IFREG => EntryKind::File,
            SFlag::S_IFDIR => EntryKind::Dir,
            SFlag::S_IFLNK => EntryKind::Symlink,
            _ => EntryKind::Other,
        };
        let guest_id = |id: u32| match self.id_map {
            Some(map) if id >= map.base && id - map.base < map.count => id - map.base,
            Some(_) => OVERFLOW_ID,
            None => id,
        };
        let nanos = u32::try_from(st.st_mtime_nsec).ok().filter(|n| *n < 1_000_000_000);
        Entry {
            path,
            kind,
            size: u64::try_from(st.st_size).unwrap_or(0),
            mode: st.st_mode & 0o7777,
            uid: guest_id(st.st_uid),
            gid: guest_id(st.st_gid),
            modified: nanos.map(|n| (st.st_mtime, n)),
            link,
        }
    }

    /// `stat` without following a final symlink.
    pub fn stat(&self, path: &str) -> FileResult<Entry> {
        if path.trim_end_matches('/').is_empty() {
            let st = fstat(&self.root).map_err(FileFailure::new)?;
            return Ok(self.entry("/".into(), &st, None));
        }
        let split = split(path)?;
        let dir = self.open_dir(split.parent, None)?;
        let (entry, _) =
            self.entry_at(dir.as_fd(), OsStr::new(split.name), path.to_owned()).map_err(FileFailure::new)?;
        Ok(entry)
    }

    /// `mkdir -p`: whether a directory was created.
    pub fn make_dir(&self, path: &str) -> FileResult<bool> {
        let mut created = false;
        self.open_dir(path, Some(&mut created))?;
        Ok(created)
    }

    /// Moves `from` to `to` (replacing what `to` names, as `rename(2)` does) and describes it there.
    pub fn rename(&self, from: &str, to: &str) -> FileResult<Entry> {
        let (old, new) = (split(from)?, split(to)?);
        let old_dir = self.open_dir(old.parent, None)?;
        let new_dir = self.open_dir(new.parent, None).map_err(|e| e.of_destination(to))?;
        fstatat(&old_dir, old.name, AtFlags::AT_SYMLINK_NOFOLLOW).map_err(FileFailure::new)?;
        self.creating(|| renameat(&old_dir, old.name, &new_dir, new.name))
            .map_err(|e| FileFailure::new(e).of_destination(to))?;
        let (entry, _) = self
            .entry_at(new_dir.as_fd(), OsStr::new(new.name), to.to_owned())
            .map_err(|e| FileFailure::new(e).of_destination(to))?;
        Ok(entry)
    }

    /// Removes a file or link, or a directory and everything in it; never follows a link.
    pub fn remove(&self, path: &str) -> FileResult<()> {
        let split = split(path)?;
        let dir = self.open_dir(split.parent, None)?;
        self.remove_at(dir.as_fd(), OsStr::new(split.name), 0).map_err(FileFailure::new)
    }

    fn remove_at(&self, dir: BorrowedFd<'_>, name: &OsStr, depth: usize) -> Result<(), Errno> {
        let st = fstatat(dir, name, AtFlags::AT_SYMLINK_NOFOLLOW)?;
        if st.st_mode & libc::S_IFMT != libc::S_IFDIR {
            return unlinkat(dir, name, UnlinkatFlags::NoRemoveDir);
        }
        if depth >= MAX_REMOVE_DEPTH {
            return Err(Errno::ELOOP);
        }
        if self.is_kernel(&st) {
            return Err(Errno::EBUSY);
        }
        let sub = openat(dir, name, read_dir_flags(), Mode::empty())?;
        for child in names(sub.as_fd())? {
            match self.remove_at(sub.as_fd(), &child, depth + 1) {
                Ok(()) | Err(Errno::ENOENT) => {}
                Err(errno) => return Err(errno),
            }
        }
        unlinkat(dir, name, UnlinkatFlags::RemoveDir)
    }

    /// Lists `path` down to `depth` levels, refusing more than `max` entries; sends the chunks on `send`.
    pub fn list_dir(&self, path: &str, depth: u32, max: u32, mut send: impl FnMut(&JailFrame)) {
        let mut listing = Listing { entries: Vec::new(), bytes: 0, max: max as usize, too_large: false };
        let walked = self.open_dir(path, None).and_then(|dir| {
            let dir = openat(&dir, ".", read_dir_flags(), Mode::empty()).map_err(FileFailure::new)?;
            let base = path.trim_end_matches('/').to_owned();
            self.walk(dir.as_fd(), &base, depth.clamp(1, MAX_LIST_DEPTH), &mut listing).map_err(FileFailure::new)
        });
        if let Err(failure) = walked {
            return send(&failure.frame());
        }
        if listing.too_large {
            return send(&JailFrame::ListTooLarge { limit: max });
        }
        // Chunks well under the inline limit: no listing needs a spill memfd.
        let mut chunk = Vec::new();
        let mut chunk_bytes = 0;
        for entry in listing.entries {
            let size = entry_size(&entry);
            if chunk_bytes + size > MAX_INLINE / 2 && !chunk.is_empty() {
                send(&JailFrame::Entries { entries: std::mem::take(&mut chunk), done: false });
                chunk_bytes = 0;
            }
            chunk_bytes += size;
            chunk.push(entry);
        }
        send(&JailFrame::Entries { entries: chunk, done: true });
    }

    fn walk(&self, dir: BorrowedFd<'_>, base: &str, depth: u32, listing: &mut Listing) -> Result<(), Errno> {
        // Read as it goes: a directory of millions of names is refused at the limit, not read whole first.
        let mut reader = nix::dir::Dir::from_fd(openat(dir, ".", read_dir_flags(), Mode::empty())?)?;
        for item in reader.iter() {
            let item = item?;
            let name = OsStr::from_bytes(item.file_name().to_bytes()).to_owned();
            if name == "." || name == ".." {
                continue;
            }
            let path = format!("{base}/{}", String::from_utf8_lossy(name.as_bytes()));
            // Gone since it was listed: not an error of the listing.
            let Ok((entry, st)) = self.entry_at(dir, &name, path.clone()) else { continue };
            let is_dir = entry.kind == EntryKind::Dir;
            if !listing.push(entry) {
                return Ok(());
            }
            if is_dir && depth > 1 && !self.is_kernel(&st) {
                let Ok(sub) = openat(dir, name.as_os_str(), read_dir_flags(), Mode::empty()) else { continue };
                self.walk(sub.as_fd(), &path, depth - 1, listing)?;
                if listing.too_large {
                    return Ok(());
                }
            }
        }
        Ok(())
    }

    /// Opens the directory at `path` for a watch (`O_PATH`; symlinks resolved inside the jail's root).
    pub fn open_watched(&self, path: &str) -> FileResult<OwnedFd> {
        self.open_dir(path, None)
    }

    /// Opens directory `name` of `dir` for a watch, not following a link; `None` for anything else, or a
    /// kernel filesystem.
    pub fn open_child_dir(&self, dir: BorrowedFd<'_>, name: &OsStr) -> Option<OwnedFd> {
        let fd = openat(dir, name, path_flags() | OFlag::O_DIRECTORY, Mode::empty()).ok()?;
        let st = fstat(&fd).ok()?;
        (st.st_mode & libc::S_IFMT == libc::S_IFDIR && !self.is_kernel(&st)).then_some(fd)
    }
}

/// The ID reported for an owner outside the jobs' mapping (the kernel's overflow ID).
const OVERFLOW_ID: u32 = 65_534;

struct Listing {
    entries: Vec<Entry>,
    bytes: usize,
    max: usize,
    too_large: bool,
}

impl Listing {
    /// Adds an entry; false (and `too_large`) past the limits.
    fn push(&mut self, entry: Entry) -> bool {
        self.bytes += entry_size(&entry);
        if self.entries.len() >= self.max || self.bytes > MAX_LIST_BYTES {
            self.too_large = true;
            self.entries = Vec::new();
            return false;
        }
        self.entries.push(entry);
        true
    }
}

/// About how many bytes an entry takes in a frame.
fn entry_size(entry: &Entry) -> usize {
    // JSON escapes can make a name up to six times longer (control characters as \u00XX).
    (entry.path.len() + entry.link.as_ref().map_or(0, String::len)) * 6 + 200
}

fn path_flags() -> OFlag {
    OFlag::O_PATH | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC
}

fn read_dir_flags() -> OFlag {
    OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC | OFlag::O_NONBLOCK
}

/// Opens the regular file `fd` (`O_PATH`, described by `st`) again with `flags`, through `/proc/self/fd`: the
/// file the walk found, whatever its path names now.
fn reopen(fd: &OwnedFd, st: &FileStat, flags: OFlag) -> FileResult<File> {
    if st.st_mode & libc::S_IFMT != libc::S_IFREG {
        return Err(FileFailure { errno: Errno::EISDIR, message: "is not a regular file".into() });
    }
    // O_NONBLOCK: a FIFO swapped in meanwhile must not block PID 1.
    let flags = flags | OFlag::O_CLOEXEC | OFlag::O_NONBLOCK | OFlag::O_NOCTTY;
    let path = format!("/proc/self/fd/{}", fd.as_raw_fd());
    let file = File::from(nix::fcntl::open(path.as_str(), flags, Mode::empty()).map_err(FileFailure::new)?);
    let now = fstat(&file).map_err(FileFailure::new)?;
    if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino) || now.st_mode & libc::S_IFMT != libc::S_IFREG {
        return Err(FileFailure { errno: Errno::EAGAIN, message: "was replaced while it was opened".into() });
    }
    Ok(file)
}

fn dup(fd: BorrowedFd<'_>) -> Result<OwnedFd, Errno> {
    nix::fcntl::fcntl(fd, nix::fcntl::FcntlArg::F_DUPFD_CLOEXEC(3)).map(|raw| {
        // SAFETY: F_DUPFD_CLOEXEC just returned this new descriptor; nothing else owns it.
        unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(raw) }
    })
}

/// The components of a path, without empty ones and `.`.
fn components(path: &[u8]) -> impl DoubleEndedIterator<Item = OsString> + '_ {
    path.split(|b| *b == b'/').filter(|c| !c.is_empty() && *c != b".").map(|c| OsString::from_vec(c.to_vec()))
}

/// The names in a directory opened for reading, without `.` and `..`.
pub fn names(dir: BorrowedFd<'_>) -> Result<Vec<OsString>, Errno> {
    let fd = openat(dir, ".", read_dir_flags(), Mode::empty())?;
    let mut listing = nix::dir::Dir::from_fd(fd)?;
    let mut names = Vec::new();
    for entry in listing.iter() {
        let entry = entry?;
        let name = entry.file_name().to_bytes();
        if name != b"." && name != b".." {
            names.push(OsString::from_vec(name.to_vec()));
        }
    }
    Ok(names)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Files rooted at this process's root (the tests' tree lives in a temporary directory of it).
    fn files() -> Files {
        Files::open(None).expect("the root")
    }

    fn listing(files: &Files, path: &str, depth: u32, max: u32) -> Result<Vec<Entry>, JailFrame> {
        let mut entries = Vec::new();
        let mut end = None;
        files.list_dir(path, depth, max, |frame| match frame {
            JailFrame::Entries { entries: chunk, done } => {
                entries.extend(chunk.iter().cloned());
                if *done {
                    end = Some(Ok(()));
                }
            }
            other => end = Some(Err(other.clone())),
        });
        end.expect("a last frame").map(|()| entries)
    }

    fn errno(failure: FileFailure) -> Errno {
        failure.errno
    }

    #[test]
    fn a_listing_lists_links_unfollowed_and_refuses_past_its_cap() {
        let dir = tempfile::tempdir().expect("tempdir");
        let base = dir.path().to_str().expect("utf-8");
        std::fs::create_dir(dir.path().join("a")).expect("mkdir");
        std::fs::write(dir.path().join("a/f"), "x").expect("write");
        std::os::unix::fs::symlink("/etc", dir.path().join("etc-link")).expect("symlink");
        let files = files();
        let entries = listing(&files, base, 3, 100).expect("a listing");
        let mut paths: Vec<&str> = entries.iter().map(|e| e.path.strip_prefix(base).expect("below")).collect();
        paths.sort_unstable();
        assert_eq!(paths, ["/a", "/a/f", "/etc-link"]);
        let link = entries.iter().find(|e| e.path.ends_with("/etc-link")).expect("the link");
        assert_eq!((link.kind, link.link.as_deref()), (EntryKind::Symlink, Some("/etc")));
        assert_eq!(listing(&files, base, 1, 100).expect("one level").len(), 2);
        assert_eq!(listing(&files, base, 3, 2), Err(JailFrame::ListTooLarge { limit: 2 }));
        let missing = format!("{base}/nowhere");
        assert!(matches!(listing(&files, &missing, 1, 10), Err(JailFrame::FileError { errno: libc::ENOENT, .. })));
    }

    #[test]
    fn remove_takes_the_link_not_what_it_names() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir_all(dir.path().join("keep")).expect("mkdir");
        std::fs::write(dir.path().join("keep/file"), "x").expect("write");
        std::fs::create_dir_all(dir.path().join("d/e")).expect("mkdir");
        std::os::unix::fs::symlink(dir.path().join("keep"), dir.path().join("d/link")).expect("symlink");
        std::os::unix::fs::symlink(dir.path().join("keep"), dir.path().join("top-link")).expect("symlink");
        let files = files();
        let at = |name: &str| format!("{}/{name}", dir.path().display());
        files.remove(&at("top-link")).expect("remove a link");
        files.remove(&at("d")).expect("remove a tree");
        assert!(dir.path().join("keep/file").exists());
        assert!(!dir.path().join("d").exists() && !dir.path().join("top-link").exists());
        assert_eq!(files.remove(&at("d")).map_err(errno), Err(Errno::ENOENT));
    }

    #[test]
    fn walks_never_end_in_the_kernel_filesystems() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::os::unix::fs::symlink("/proc", dir.path().join("p")).expect("symlink");
        std::os::unix::fs::symlink("../../../../../../../proc/self", dir.path().join("up")).expect("symlink");
        let files = files();
        let at = |name: &str| format!("{}/{name}", dir.path().display());
        assert_eq!(files.stat(&at("p")).expect("the link itself").kind, EntryKind::Symlink);
        assert_eq!(files.stat(&at("p/self/status")).map_err(errno).err(), Some(Errno::EXDEV));
        assert_eq!(files.open_read(&at("up/status")).map_err(errno).err(), Some(Errno::EXDEV));
        assert_eq!(files.open_watched(&at("p")).map_err(errno).err(), Some(Errno::EXDEV));
    }

    #[test]
    fn make_dir_says_whether_it_made_one() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("file"), "x").expect("write");
        let files = files();
        let at = |name: &str| format!("{}/{name}", dir.path().display());
        assert!(files.make_dir(&at("x/y")).expect("mkdir -p"));
        assert!(!files.make_dir(&at("x/y")).expect("again"));
        assert_eq!(files.make_dir(&at("file/y")).map_err(errno), Err(Errno::ENOTDIR));
        let moved = files.rename(&at("x"), &at("z")).expect("rename");
        assert_eq!((moved.kind, moved.path), (EntryKind::Dir, at("z")));
        assert_eq!(files.rename(&at("x"), &at("w")).map_err(errno).err(), Some(Errno::ENOENT));
    }
}
