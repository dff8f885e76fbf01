//! File grants on the microVM tier: a granted host directory is copied into the guest before the job and, for a
//! read-write grant, copied back after the job exits with status 0.
//!
//! **Copy-in** ([`scan`], [`copy_in`]): the host tree is walked without following symbolic links (a link is copied
//! as a link, its target stored as written) and recreated under the grant's guest path, which must be absent or an
//! empty directory in the image (so that what is copied back is exactly the grant). Only regular files,
//! directories and symbolic links are granted; anything else is refused by name. The total of file bytes counts
//! against the disk limit before the VM is even booted.
//!
//! **Copy-back** ([`copy_out`]): the guest's listing (`ListTree`) is the guest's word, so every field is checked
//! before anything is touched on the host: relative paths of normal components only, no duplicates, every entry's
//! parent a directory listed before it, modes and link targets bounded, the file bytes within the disk limit. The
//! files are then read into a staging directory inside the host grant, and only when all of them have arrived is
//! the host tree changed: directories made, each file moved into place with one `rename` (a reader sees the old
//! file or the new one, never a mix), links replaced the same way, and what the guest deleted deleted. A listing
//! or a transfer that fails any check applies nothing. The host tree is walked by descriptor, one component at a
//! time with `O_NOFOLLOW`, so no path the guest names can lead outside the grant, whatever links the host tree
//! holds. Whatever the guest claims, what lands on the host is a regular file the host created itself (`O_CREAT
//! | O_EXCL` in the staging directory, filled with bytes), a directory or a link: the listing has no kind for a
//! device, FIFO or socket (the agent leaves them out), modes are `mode & 0o777` (no set-user-ID, set-group-ID or
//! sticky bit), no extended attribute is ever set (so no file capability), a link is written as a link and never
//! followed, and what is created belongs to the grant directory's owner.
//!
//! Read-only grants are never copied back: the host copy is unchanged whatever the guest does to its own.

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag, openat, renameat};
use nix::sys::stat::{FileStat, Mode, SFlag, fchmod, fstat, fstatat, mkdirat};
use nix::unistd::{Gid, Uid, fchownat, symlinkat};
use strata_core::dirfd::{DIR_FLAGS, kind_of, open_beneath, remove_at};
use strata_guest_proto::{AgentClient, ClientError, EntryKind, MAX_CHUNK, MAX_PATH, TreeEntry};

/// The most entries one grant may hold, either way.
pub const MAX_ENTRIES: u64 = 100_000;

/// Permission bits kept from the guest: set-user-ID, set-group-ID and sticky are dropped.
const KEPT_MODE: u32 = 0o777;

/// Why a grant could not be copied in or back.
#[derive(Debug, thiserror::Error)]
pub enum GrantError {
    /// The host side failed.
    #[error("grant {}: {source}", path.display())]
    Host {
        /// The host path.
        path: PathBuf,
        /// The error.
        #[source]
        source: io::Error,
    },
    /// Something in a host grant that is not a regular file, directory or symbolic link, or a name that is not
    /// UTF-8.
    #[error("grant {}: {what} cannot be copied into a microVM (only files, directories and symbolic links)", path.display())]
    Unsupported {
        /// The host path.
        path: PathBuf,
        /// What it is.
        what: &'static str,
    },
    /// The grants' files are larger than the disk limit.
    #[error("the grants hold {bytes} bytes of files, over the disk limit of {cap} bytes")]
    TooLarge {
        /// Bytes found (so far).
        bytes: u64,
        /// The limit.
        cap: u64,
    },
    /// A grant holds more than [`MAX_ENTRIES`] entries.
    #[error("grant {place}: more than {MAX_ENTRIES} entries")]
    TooManyEntries {
        /// The host or guest path.
        place: String,
    },
    /// The guest path already holds files in the image.
    #[error("guest path {guest} is not empty in the image: grant the directory somewhere else")]
    NotEmpty {
        /// The guest path.
        guest: String,
    },
    /// The guest's listing or files failed a check; nothing was copied back.
    #[error("the guest's {guest} was not copied back: {reason}")]
    Refused {
        /// The grant's guest path.
        guest: String,
        /// What was wrong.
        reason: String,
    },
    /// The agent refused or the channel failed.
    #[error("guest agent: {0}")]
    Agent(#[from] ClientError),
}

fn host_err(path: &Path, source: impl Into<io::Error>) -> GrantError {
    GrantError::Host { path: path.to_owned(), source: source.into() }
}

/// One entry of a host grant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostEntry {
    /// Path relative to the grant, `/`-separated.
    pub rel: String,
    /// What it is; a link's target.
    pub kind: HostKind,
    /// Permission bits.
    pub mode: u32,
    /// Bytes of a regular file (0 otherwise).
    pub size: u64,
}

/// The kind of a [`HostEntry`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostKind {
    /// A directory.
    Dir,
    /// A regular file.
    File,
    /// A symbolic link and its target.
    Symlink(String),
}

/// A host grant walked for copy-in: its entries, every directory before what it holds.
#[derive(Debug, Clone)]
pub struct HostTree {
    /// The grant's host directory.
    pub root: PathBuf,
    /// Its permission bits.
    pub mode: u32,
    /// The entries.
    pub entries: Vec<HostEntry>,
    /// Bytes of all regular files.
    pub bytes: u64,
}

/// Walks the host directory `root` (not following links), refusing more than [`MAX_ENTRIES`] entries and more than
/// `cap` bytes of files.
pub fn scan(root: &Path, cap: u64) -> Result<HostTree, GrantError> {
    let meta = std::fs::symlink_metadata(root).map_err(|e| host_err(root, e))?;
    if !meta.is_dir() {
        return Err(host_err(root, io::Error::from_raw_os_error(libc::ENOTDIR)));
    }
    let mut tree = HostTree { root: root.to_owned(), mode: meta.mode() & 0o7777, entries: Vec::new(), bytes: 0 };
    let mut dirs = std::collections::VecDeque::from([String::new()]);
    while let Some(rel) = dirs.pop_front() {
        let dir = if rel.is_empty() { root.to_owned() } else { root.join(&rel) };
        let mut names = Vec::new();
        for entry in std::fs::read_dir(&dir).map_err(|e| host_err(&dir, e))? {
            names.push(entry.map_err(|e| host_err(&dir, e))?.file_name());
        }
        names.sort();
        for name in names {
            let path = dir.join(&name);
            let Some(name) = name.to_str() else {
                return Err(GrantError::Unsupported { path, what: "a name that is not UTF-8" });
            };
            let child = if rel.is_empty() { name.to_owned() } else { format!("{rel}/{name}") };
            if child.len() > MAX_PATH {
                return Err(GrantError::Unsupported { path, what: "a path longer than 4096 bytes" });
            }
            let meta = std::fs::symlink_metadata(&path).map_err(|e| host_err(&path, e))?;
            let file_type = meta.file_type();
            let kind = if file_type.is_dir() {
                dirs.push_back(child.clone());
                HostKind::Dir
            } else if file_type.is_file() {
                tree.bytes = tree.bytes.saturating_add(meta.len());
                if tree.bytes > cap {
                    return Err(GrantError::TooLarge { bytes: tree.bytes, cap });
                }
                HostKind::File
            } else if file_type.is_symlink() {
                let target = std::fs::read_link(&path).map_err(|e| host_err(&path, e))?;
                match target.into_os_string().into_string() {
                    Ok(target) if target.len() <= MAX_PATH => HostKind::Symlink(target),
                    _ => return Err(GrantError::Unsupported { path, what: "a link target that is not UTF-8" }),
                }
            } else {
                return Err(GrantError::Unsupported { path, what: "a device, FIFO or socket" });
            };
            let size = if kind == HostKind::File { meta.len() } else { 0 };
            tree.entries.push(HostEntry { rel: child, kind, mode: meta.mode() & 0o7777, size });
            if tree.entries.len() as u64 > MAX_ENTRIES {
                return Err(GrantError::TooManyEntries { place: root.display().to_string() });
            }
        }
    }
    Ok(tree)
}

fn guest_join(root: &str, rel: &str) -> String {
    format!("{}/{rel}", root.trim_end_matches('/'))
}

/// Recreates `tree` under the guest directory `guest`, which must be absent or empty. Returns the bytes sent.
pub fn copy_in(client: &AgentClient, tree: &HostTree, guest: &str) -> Result<u64, GrantError> {
    client.make_dir(guest, tree.mode, true).map_err(|err| match err {
        ClientError::File { errno, .. } if errno == libc::ENOTEMPTY => GrantError::NotEmpty { guest: guest.to_owned() },
        other => GrantError::Agent(other),
    })?;
    let mut sent = 0u64;
    let mut buf = vec![0u8; MAX_CHUNK];
    for entry in &tree.entries {
        let path = guest_join(guest, &entry.rel);
        match &entry.kind {
            HostKind::Dir => client.make_dir(&path, entry.mode, false)?,
            HostKind::Symlink(target) => client.make_symlink(&path, target)?,
            HostKind::File => {
                let host = tree.root.join(&entry.rel);
                let mut file = std::fs::OpenOptions::new()
                    .read(true)
                    .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
                    .open(&host)
                    .map_err(|e| host_err(&host, e))?;
                let mut upload = client.upload(&path, entry.mode)?;
                let mut left = entry.size;
                // At most the size scanned: a file growing meanwhile is cut there, never over the disk limit.
                while left > 0 {
                    let want = buf.len().min(usize::try_from(left).unwrap_or(usize::MAX));
                    let n = match file.read(&mut buf[..want]) {
                        Ok(0) => break,
                        Ok(n) => n,
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                        Err(e) => return Err(host_err(&host, e)),
                    };
                    upload.write(&buf[..n])?;
                    left -= n as u64;
                    sent += n as u64;
                }
                upload.finish()?;
            }
        }
    }
    Ok(sent)
}

/// What a copy-back changed on the host.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CopiedBack {
    /// Files written (each replaced atomically).
    pub files: u64,
    /// Bytes of those files.
    pub bytes: u64,
    /// Host entries removed because the guest removed them.
    pub removed: u64,
}

/// A checked guest entry.
#[derive(Debug)]
struct Checked<'a> {
    entry: &'a TreeEntry,
    /// The parent directory's relative path (empty for the grant itself).
    parent: &'a str,
    /// The last component.
    name: &'a str,
}

/// Checks a guest listing against every rule in the module docs; returns the entries with their parents split
/// off.
fn check<'a>(entries: &'a [TreeEntry], cap: u64) -> Result<Vec<Checked<'a>>, String> {
    let mut dirs: HashSet<&str> = HashSet::from([""]);
    let mut seen: HashSet<&str> = HashSet::new();
    let mut bytes = 0u64;
    let mut checked = Vec::with_capacity(entries.len());
    for entry in entries {
        let path = entry.path.as_str();
        if path.is_empty() || path.len() > MAX_PATH || path.contains('\0') {
            return Err(format!("an entry path {:?} that is empty, too long or holds NUL", shorten(path)));
        }
        if path.split('/').any(|c| c.is_empty() || c == "." || c == "..") {
            return Err(format!("an entry path {:?} that is not relative with normal components", shorten(path)));
        }
        if !seen.insert(path) {
            return Err(format!("{:?} listed twice", shorten(path)));
        }
        let (parent, name) = path.rsplit_once('/').unwrap_or(("", path));
        if !dirs.contains(parent) {
            return Err(format!("{:?} listed without its directory before it", shorten(path)));
        }
        if entry.mode > 0o7777 {
            return Err(format!("mode {:#o} for {:?}", entry.mode, shorten(path)));
        }
        match (entry.kind, &entry.target) {
            (EntryKind::Dir, None) => {
                dirs.insert(path);
            }
            (EntryKind::File, None) => {
                bytes = bytes.saturating_add(entry.size);
                if bytes > cap {
                    return Err(format!("{bytes} bytes of files, over the disk limit of {cap} bytes"));
                }
            }
            (EntryKind::Symlink, Some(target)) if !target.is_empty() && target.len() <= MAX_PATH => {
                if target.contains('\0') {
                    return Err(format!("a link target with NUL at {:?}", shorten(path)));
                }
            }
            _ => return Err(format!("a malformed {:?} entry at {:?}", entry.kind, shorten(path))),
        }
        checked.push(Checked { entry, parent, name });
    }
    Ok(checked)
}

fn shorten(path: &str) -> String {
    path.chars().take(80).collect()
}

/// The UTF-8 names in the directory `fd`, without `.` and `..` (a guest listing holds no other).
fn utf8_names_in(fd: &OwnedFd) -> io::Result<Vec<String>> {
    // /proc/self/fd/N names the open directory itself: nothing is resolved again.
    let mut names = Vec::new();
    for entry in std::fs::read_dir(format!("/proc/self/fd/{}", fd.as_raw_fd()))? {
        // A name that is not UTF-8 cannot be in a guest listing: it is left alone.
        if let Ok(name) = entry?.file_name().into_string() {
            names.push(name);
        }
    }
    Ok(names)
}

/// The staging directory inside the host grant, removed with everything in it when dropped.
struct Staging<'a> {
    root: &'a OwnedFd,
    name: String,
    fd: OwnedFd,
}

impl Drop for Staging<'_> {
    fn drop(&mut self) {
        let _ = remove_at(self.root, &self.name);
    }
}

/// Copies the guest directory `guest` back over the host directory `host` (see the module docs); `cap` bounds the
/// bytes of files. On any error the host tree is as it was, apart from files already moved into place when the
/// host itself fails midway (a full disk, a permission).
pub fn copy_out(client: &AgentClient, guest: &str, host: &Path, cap: u64) -> Result<CopiedBack, GrantError> {
    let refused = |reason: String| GrantError::Refused { guest: guest.to_owned(), reason };
    let listing = client.list_tree(guest, MAX_ENTRIES).map_err(|err| match err {
        ClientError::File { errno, .. } if errno == libc::E2BIG => {
            GrantError::TooManyEntries { place: guest.to_owned() }
        }
        ClientError::Violation { what: message } => refused(message),
        other => GrantError::Agent(other),
    })?;
    let checked = check(&listing.entries, cap).map_err(|reason| {
        if reason.contains("over the disk limit") {
            let bytes = listing.entries.iter().filter(|e| e.kind == EntryKind::File).map(|e| e.size).sum();
            GrantError::TooLarge { bytes, cap }
        } else {
            refused(reason)
        }
    })?;

    let root = nix::fcntl::open(host, DIR_FLAGS, Mode::empty()).map_err(|e| host_err(host, e))?;
    let owner = fstat(&root).map_err(|e| host_err(host, e))?;
    let chown = nix::unistd::geteuid().is_root();
    let staging_name = format!(".strata-copyback-{}-{:016x}", std::process::id(), random_u64());
    if checked.iter().any(|c| c.parent.is_empty() && c.name == staging_name) {
        return Err(refused("an entry named like the staging directory".into()));
    }
    mkdirat(&root, staging_name.as_str(), Mode::from_bits_truncate(0o700)).map_err(|e| host_err(host, e))?;
    let staging_fd = openat(&root, staging_name.as_str(), DIR_FLAGS, Mode::empty()).map_err(|e| host_err(host, e))?;
    let staging = Staging { root: &root, name: staging_name, fd: staging_fd };

    // Every file arrives before anything changes.
    let mut done = CopiedBack::default();
    for (index, item) in checked.iter().enumerate() {
        if item.entry.kind != EntryKind::File {
            continue;
        }
        let fd = openat(
            &staging.fd,
            index.to_string().as_str(),
            OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_CLOEXEC,
            Mode::from_bits_truncate(0o600),
        )
        .map_err(|e| host_err(host, e))?;
        let mut file = File::from(fd);
        let mut failed = None;
        let path = guest_join(guest, &item.entry.path);
        let size = client
            .read_file_to(&path, item.entry.size, |chunk| {
                if failed.is_none()
                    && let Err(e) = file.write_all(chunk)
                {
                    failed = Some(e);
                }
            })
            .map_err(|err| match err {
                ClientError::File { message, .. } => refused(format!("{message} (changed after its listing?)")),
                ClientError::Violation { what: message } => refused(message),
                other => GrantError::Agent(other),
            })?;
        if let Some(e) = failed {
            return Err(host_err(&host.join(&item.entry.path), e));
        }
        if size != item.entry.size {
            return Err(refused(format!("{path} has {size} bytes, listed with {}", item.entry.size)));
        }
        fchmod(&file, Mode::from_bits_truncate(item.entry.mode & KEPT_MODE)).map_err(|e| host_err(host, e))?;
        if chown {
            nix::unistd::fchown(&file, Some(Uid::from_raw(owner.st_uid)), Some(Gid::from_raw(owner.st_gid)))
                .map_err(|e| host_err(host, e))?;
        }
        done.files += 1;
        done.bytes += size;
    }

    // What the host has that the guest no longer does, found before anything changes.
    let wanted: HashMap<&str, EntryKind> = checked.iter().map(|c| (c.entry.path.as_str(), c.entry.kind)).collect();
    let mut gone = Vec::new();
    let mut pending = vec![String::new()];
    while let Some(rel) = pending.pop() {
        let Ok(dir) = open_beneath(&root, Path::new(&rel)) else { continue };
        for name in utf8_names_in(&dir).map_err(|e| host_err(host, e))? {
            if rel.is_empty() && name == staging.name {
                continue;
            }
            let child = if rel.is_empty() { name.clone() } else { format!("{rel}/{name}") };
            match wanted.get(child.as_str()) {
                None => gone.push(child),
                Some(EntryKind::Dir) => pending.push(child),
                Some(_) => {}
            }
        }
    }

    // Apply, parents first.
    let at = |rel: &str| host.join(rel);
    let mut dir_modes = Vec::new();
    for (index, item) in checked.iter().enumerate() {
        let parent = open_beneath(&root, Path::new(item.parent)).map_err(|e| host_err(&at(item.parent), e))?;
        let existing = match fstatat(&parent, item.name, AtFlags::AT_SYMLINK_NOFOLLOW) {
            Ok(stat) => Some(kind_of(&stat)),
            Err(Errno::ENOENT) => None,
            Err(e) => return Err(host_err(&at(&item.entry.path), e)),
        };
        let path = at(&item.entry.path);
        match item.entry.kind {
            EntryKind::Dir => {
                if existing != Some(SFlag::S_IFDIR) {
                    if existing.is_some() {
                        done.removed += remove_at(&parent, item.name).map_err(|e| host_err(&path, e))?;
                    }
                    mkdirat(&parent, item.name, Mode::from_bits_truncate(0o700)).map_err(|e| host_err(&path, e))?;
                    own(&parent, item.name, &owner, chown).map_err(|e| host_err(&path, e))?;
                }
                dir_modes.push((item.entry.path.as_str(), item.entry.mode & KEPT_MODE));
            }
            EntryKind::File | EntryKind::Symlink => {
                if existing == Some(SFlag::S_IFDIR) {
                    done.removed += remove_at(&parent, item.name).map_err(|e| host_err(&path, e))?;
                }
                let staged = if item.entry.kind == EntryKind::File {
                    index.to_string()
                } else {
                    let staged = format!("{index}.link");
                    let target = item.entry.target.as_deref().unwrap_or_default();
                    symlinkat(target, &staging.fd, staged.as_str()).map_err(|e| host_err(&path, e))?;
                    own(&staging.fd, &staged, &owner, chown).map_err(|e| host_err(&path, e))?;
                    staged
                };
                renameat(&staging.fd, staged.as_str(), &parent, item.name).map_err(|e| host_err(&path, e))?;
            }
        }
    }
    // Deepest first; an entry whose directory went already is gone.
    gone.sort_by_key(|rel| std::cmp::Reverse(rel.matches('/').count()));
    for rel in &gone {
        let (parent, name) = rel.rsplit_once('/').unwrap_or(("", rel));
        let Ok(parent) = open_beneath(&root, Path::new(parent)) else { continue };
        done.removed += remove_at(&parent, name).map_err(|e| host_err(&at(rel), e))?;
    }
    for (rel, mode) in dir_modes.into_iter().rev() {
        let dir = open_beneath(&root, Path::new(rel)).map_err(|e| host_err(&at(rel), e))?;
        fchmod(&dir, Mode::from_bits_truncate(mode)).map_err(|e| host_err(&at(rel), e))?;
    }
    drop(staging);
    Ok(done)
}

/// Gives what was created the grant directory's owner (when running as root).
fn own(parent: &OwnedFd, name: &str, owner: &FileStat, chown: bool) -> Result<(), Errno> {
    if !chown {
        return Ok(());
    }
    fchownat(
        parent,
        name,
        Some(Uid::from_raw(owner.st_uid)),
        Some(Gid::from_raw(owner.st_gid)),
        AtFlags::AT_SYMLINK_NOFOLLOW,
    )
}

fn random_u64() -> u64 {
    let mut bytes = [0u8; 8];
    // SAFETY: the pointer and length describe `bytes`, writable for its whole length.
    let n = unsafe { libc::getrandom(bytes.as_mut_ptr().cast(), bytes.len(), 0) };
    if n == 8 {
        u64::from_ne_bytes(bytes)
    } else {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        now.as_nanos() as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(path: &str, kind: EntryKind) -> TreeEntry {
        let target = (kind == EntryKind::Symlink).then(|| "t".to_owned());
        TreeEntry { path: path.into(), kind, mode: 0o644, size: 1, target }
    }

    #[test]
    fn hostile_listings_are_refused() {
        use EntryKind::{Dir, File, Symlink};
        let cases: Vec<(&str, Vec<TreeEntry>)> = vec![
            ("parent", vec![entry("../x", File)]),
            ("absolute", vec![entry("/etc/passwd", File)]),
            ("empty component", vec![entry("a//b", File)]),
            ("dot", vec![entry("./x", File)]),
            ("no parent", vec![entry("a/b", File)]),
            ("under a link", vec![entry("a", Symlink), entry("a/passwd", File)]),
            ("under a file", vec![entry("a", File), entry("a/b", File)]),
            ("child before parent", vec![entry("a/b", File), entry("a", Dir)]),
            ("twice", vec![entry("a", File), entry("a", File)]),
            ("nul", vec![entry("a\0b", File)]),
            ("mode", vec![TreeEntry { mode: 0o17777, ..entry("a", File) }]),
            ("target on a file", vec![TreeEntry { target: Some("x".into()), ..entry("a", File) }]),
            ("link without target", vec![TreeEntry { target: None, ..entry("a", Symlink) }]),
            ("long", vec![entry(&"x".repeat(MAX_PATH + 1), File)]),
            ("over the cap", vec![TreeEntry { size: 11, ..entry("a", File) }]),
        ];
        for (name, entries) in cases {
            assert!(check(&entries, 10).is_err(), "{name} was accepted");
        }
        let good = vec![entry("a", Dir), entry("a/b", File), entry("a/l", Symlink), entry("c", File)];
        assert_eq!(check(&good, 10).expect("good listing").len(), 4);
    }
}
