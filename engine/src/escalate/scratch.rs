//! The scratch copies of a job's read-write grants a wasm attempt writes to, committed to the host grants only when the attempt is the result ([`ScratchGrants`]).

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::fs::File;
use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag, openat, renameat};
use nix::sys::stat::{Mode, SFlag, fchmod, fstatat, mkdirat};
use nix::unistd::{UnlinkatFlags, symlinkat, unlinkat};
use strata_core::dirfd::{DIR_FLAGS, kind_of, open_beneath, remove_at};
use strata_core::{Capabilities, GrantMode};
/// The most entries one read-write grant may hold to get a scratch copy.
pub const MAX_ENTRIES: u64 = 100_000;
/// Why the scratch copies of a job's read-write grants could not be made or committed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ScratchError {
    /// The read-write grants' files are larger than the job's disk limit.
    #[error("the read-write grants hold more than {cap} bytes of files (the disk limit)")]
    TooLarge {
        /// The disk limit, in bytes.
        cap: u64,
    },
    /// A read-write grant holds more than [`MAX_ENTRIES`] entries.
    #[error("read-write grant {} holds more than {MAX_ENTRIES} entries", .0.display())]
    TooManyEntries(PathBuf),
    /// A read-write grant holds something that is not a file, a directory or a symbolic link.
    #[error("{} is not a file, a directory or a symbolic link", .0.display())]
    Unsupported(PathBuf),
    /// A read-write grant's host directory contains, or is inside, another grant's.
    #[error("read-write grant {} overlaps grant {}", rw.display(), other.display())]
    Overlap {
        /// The read-write grant's host directory.
        rw: PathBuf,
        /// The other grant's host directory.
        other: PathBuf,
    },
    /// Making the copies failed.
    #[error("cannot copy {} into scratch: {source}", path.display())]
    Copy {
        /// The host path being copied.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// Committing the copy's changes to the host grant failed (what was already moved into place stays).
    #[error("cannot commit the job's writes to {}: {source}", path.display())]
    Commit {
        /// The host path being written.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// A host directory on the way to a changed file is now a symbolic link or not a directory: nothing is written
    /// through it.
    #[error("cannot commit the job's writes to {}: a directory on the way is a symbolic link or not a directory", .0.display())]
    NotADirectory(PathBuf),
}

/// One node of a tree, as far as committing needs to tell whether it changed.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Node {
    Dir { mode: u32 },
    // `ctime` changes with every write and cannot be set back by the guest: same inode and ctime, same file.
    File { ino: u64, ctime: (i64, i64), size: u64, mode: u32 },
    Symlink { target: PathBuf },
}

impl Node {
    fn same_kind(&self, other: &Node) -> bool {
        std::mem::discriminant(self) == std::mem::discriminant(other)
    }
}

type Tree = BTreeMap<PathBuf, Node>;

/// The copy of one read-write grant.
#[derive(Debug)]
struct ScratchGrant {
    /// Its index in the job's grants.
    index: usize,
    host: PathBuf,
    copy: PathBuf,
    /// The copy as made, before the job.
    baseline: Tree,
}

/// Scratch copies of a job's read-write grants (see the module docs). Dropping it discards them.
#[derive(Debug)]
pub struct ScratchGrants {
    grants: Vec<ScratchGrant>,
    dir: tempfile::TempDir,
}

/// What [`ScratchGrants::commit`] changed on the host.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Committed {
    /// Files and links written.
    pub written: u64,
    /// Directories made.
    pub dirs: u64,
    /// Entries removed (a directory and its contents count one each).
    pub removed: u64,
}

impl ScratchGrants {
    /// Copies every read-write grant of `caps` into a new directory under `parent`; `None` when there is none.
    /// The copies' files may hold `cap` bytes together.
    pub fn prepare(caps: &Capabilities, cap: u64, parent: &Path) -> Result<Option<ScratchGrants>, ScratchError> {
        if !caps.grants.iter().any(|grant| grant.mode == GrantMode::Rw) {
            return Ok(None);
        }
        check_overlaps(caps)?;
        std::fs::create_dir_all(parent).map_err(|source| ScratchError::Copy { path: parent.to_owned(), source })?;
        sweep_stale(parent);
        let dir = tempfile::Builder::new()
            .prefix(&format!("scratch-{}-", std::process::id()))
            .tempdir_in(parent)
            .map_err(|source| ScratchError::Copy { path: parent.to_owned(), source })?;
        let mut budget = Budget { bytes: cap, cap, entries: 0 };
        let mut grants = Vec::new();
        for (index, grant) in caps.grants.iter().enumerate() {
            if grant.mode != GrantMode::Rw {
                continue;
            }
            let copy = dir.path().join(index.to_string());
            // The grant's own path may be a link the user named (as the tiers follow it); nothing below it is.
            let host = std::fs::canonicalize(&grant.host)
                .map_err(|source| ScratchError::Copy { path: grant.host.clone(), source })?;
            if !host.is_dir() {
                return Err(ScratchError::Unsupported(grant.host.clone()));
            }
            budget.entries = 0;
            copy_tree(&host, &copy, &mut budget)?;
            let baseline = walk(&copy).map_err(|source| ScratchError::Copy { path: copy.clone(), source })?;
            grants.push(ScratchGrant { index, host, copy, baseline });
        }
        settle_clock(dir.path()).map_err(|source| ScratchError::Copy { path: dir.path().to_owned(), source })?;
        Ok(Some(ScratchGrants { grants, dir }))
    }

    /// `caps` with each read-write grant's host side replaced by its copy.
    pub fn caps(&self, caps: &Capabilities) -> Capabilities {
        let mut caps = caps.clone();
        for grant in &self.grants {
            if let Some(target) = caps.grants.get_mut(grant.index) {
                target.host = grant.copy.clone();
            }
        }
        caps
    }

    /// The directory holding the copies (removed when `self` is dropped).
    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Applies what the job changed in each copy to its host grant, then removes the copies.
    pub fn commit(self) -> Result<Committed, ScratchError> {
        let mut done = Committed::default();
        for grant in &self.grants {
            commit_grant(grant, &mut done)?;
        }
        Ok(done)
    }
}

/// Removes the scratch directories under `parent` of engine processes that are gone (killed before they could
/// remove their own): each is named `scratch-PID-…`.
pub(crate) fn sweep_stale(parent: &Path) {
    let Ok(entries) = std::fs::read_dir(parent) else { return };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(|n| n.strip_prefix("scratch-")).and_then(|n| n.split('-').next()) else {
            continue;
        };
        let Ok(pid) = pid.parse::<u32>() else { continue };
        if pid != std::process::id() && !Path::new("/proc").join(pid.to_string()).exists() {
            // remove_dir_all never follows a link out of the tree it removes.
            if let Err(err) = std::fs::remove_dir_all(entry.path()) {
                log::warn!("cannot remove stale scratch directory {}: {err}", entry.path().display());
            }
        }
    }
}

fn check_overlaps(caps: &Capabilities) -> Result<(), ScratchError> {
    let canonical = |path: &Path| std::fs::canonicalize(path).unwrap_or_else(|_| path.to_owned());
    for (i, rw) in caps.grants.iter().enumerate().filter(|(_, grant)| grant.mode == GrantMode::Rw) {
        let rw_path = canonical(&rw.host);
        for (j, other) in caps.grants.iter().enumerate() {
            let other_path = canonical(&other.host);
            if i != j && (rw_path.starts_with(&other_path) || other_path.starts_with(&rw_path)) {
                return Err(ScratchError::Overlap { rw: rw.host.clone(), other: other.host.clone() });
            }
        }
    }
    Ok(())
}

/// Waits until the file system's clock, as inode change times show it, has moved past the copies' (one tick of
/// the kernel's coarse clock at most, a few milliseconds): a file the job writes afterwards then has another
/// change time than its baseline, however soon it writes.
fn settle_clock(dir: &Path) -> io::Result<()> {
    let marker = dir.join(".clock");
    std::fs::write(&marker, b"")?;
    let changed_at = |mode: u32| -> io::Result<(i64, i64)> {
        std::fs::set_permissions(&marker, std::fs::Permissions::from_mode(mode))?;
        let meta = std::fs::symlink_metadata(&marker)?;
        Ok((meta.ctime(), meta.ctime_nsec()))
    };
    let first = changed_at(0o600)?;
    for round in 0..1000u32 {
        std::thread::sleep(std::time::Duration::from_millis(1));
        if changed_at(if round % 2 == 0 { 0o644 } else { 0o600 })? != first {
            break;
        }
    }
    std::fs::remove_file(&marker)
}

struct Budget {
    bytes: u64,
    cap: u64,
    entries: u64,
}

/// Copies the tree at `src` to the new path `dst` without following links.
fn copy_tree(src: &Path, dst: &Path, budget: &mut Budget) -> Result<(), ScratchError> {
    let copy_err = |path: &Path| {
        let path = path.to_owned();
        move |source| ScratchError::Copy { path, source }
    };
    budget.entries += 1;
    if budget.entries > MAX_ENTRIES {
        return Err(ScratchError::TooManyEntries(src.to_owned()));
    }
    let meta = std::fs::symlink_metadata(src).map_err(copy_err(src))?;
    let kind = meta.file_type();
    if kind.is_dir() {
        std::fs::create_dir(dst).map_err(copy_err(dst))?;
        let mut names = Vec::new();
        for entry in std::fs::read_dir(src).map_err(copy_err(src))? {
            names.push(entry.map_err(copy_err(src))?.file_name());
        }
        names.sort();
        for name in names {
            copy_tree(&src.join(&name), &dst.join(&name), budget)?;
        }
        std::fs::set_permissions(dst, std::fs::Permissions::from_mode(meta.mode() & 0o7777)).map_err(copy_err(dst))?;
    } else if kind.is_file() {
        budget.bytes = budget.bytes.checked_sub(meta.len()).ok_or(ScratchError::TooLarge { cap: budget.cap })?;
        let mut from = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(OFlag::O_NOFOLLOW.bits())
            .open(src)
            .map_err(copy_err(src))?;
        let mut to =
            std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(dst).map_err(copy_err(dst))?;
        // A file that grew since it was measured still counts against the cap.
        let copied =
            io::copy(&mut io::Read::take(&mut from, budget.bytes + meta.len() + 1), &mut to).map_err(copy_err(dst))?;
        if copied > meta.len() {
            budget.bytes =
                budget.bytes.checked_sub(copied - meta.len()).ok_or(ScratchError::TooLarge { cap: budget.cap })?;
        }
        to.set_permissions(std::fs::Permissions::from_mode(meta.mode() & 0o7777)).map_err(copy_err(dst))?;
    } else if kind.is_symlink() {
        let target = std::fs::read_link(src).map_err(copy_err(src))?;
        std::os::unix::fs::symlink(&target, dst).map_err(copy_err(dst))?;
    } else {
        return Err(ScratchError::Unsupported(src.to_owned()));
    }
    Ok(())
}

/// The tree at `root` (its entries, relative to it), without following links; what is neither a file, a directory
/// nor a link is left out.
fn walk(root: &Path) -> io::Result<Tree> {
    let mut tree = Tree::new();
    let mut pending = vec![PathBuf::new()];
    while let Some(rel) = pending.pop() {
        for entry in std::fs::read_dir(root.join(&rel))? {
            let entry = entry?;
            let child = rel.join(entry.file_name());
            let meta = std::fs::symlink_metadata(root.join(&child))?;
            let kind = meta.file_type();
            let node = if kind.is_dir() {
                pending.push(child.clone());
                Node::Dir { mode: meta.mode() & 0o7777 }
            } else if kind.is_file() {
                Node::File {
                    ino: meta.ino(),
                    ctime: (meta.ctime(), meta.ctime_nsec()),
                    size: meta.len(),
                    mode: meta.mode() & 0o7777,
                }
            } else if kind.is_symlink() {
                Node::Symlink { target: std::fs::read_link(root.join(&child))? }
            } else {
                continue;
            };
            tree.insert(child, node);
        }
    }
    Ok(tree)
}

/// Permission bits committed: set-user-ID and set-group-ID are dropped.
const KEPT_MODE: u32 = 0o1777;

/// A fresh name for a file being moved into place in a host directory.
fn staging_name() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    format!(".strata-commit-{}-{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed))
}

fn split(rel: &Path) -> (&Path, &OsStr) {
    let name = rel.file_name().unwrap_or_default();
    (rel.parent().unwrap_or(Path::new("")), name)
}

fn commit_grant(grant: &ScratchGrant, done: &mut Committed) -> Result<(), ScratchError> {
    let at = |rel: &Path| grant.host.join(rel);
    let host_err = |rel: &Path, errno: Errno| match errno {
        Errno::ELOOP | Errno::ENOTDIR => ScratchError::NotADirectory(at(rel)),
        other => ScratchError::Commit { path: at(rel), source: io::Error::from(other) },
    };
    let now = walk(&grant.copy).map_err(|source| ScratchError::Copy { path: grant.copy.clone(), source })?;
    let root = nix::fcntl::open(&grant.host, DIR_FLAGS, Mode::empty()).map_err(|e| host_err(Path::new(""), e))?;

    // What the job removed (or replaced by another kind), shallowest first; a removed directory takes its
    // contents with it.
    let mut removed: Vec<&Path> = Vec::new();
    for (rel, old) in &grant.baseline {
        if removed.iter().any(|gone| rel.starts_with(gone)) {
            continue;
        }
        if now.get(rel).is_some_and(|node| node.same_kind(old)) {
            continue;
        }
        let (parent, name) = split(rel);
        let parent = match open_beneath(&root, parent) {
            Ok(fd) => fd,
            // Gone from the host already, or no longer ours to walk through.
            Err(Errno::ENOENT | Errno::ENOTDIR | Errno::ELOOP) => continue,
            Err(e) => return Err(host_err(rel, e)),
        };
        done.removed += remove_at(&parent, name).map_err(|e| host_err(rel, e))?;
        removed.push(rel);
    }

    // What the job created or changed, parents first (the tree is ordered component by component).
    let mut dir_modes = Vec::new();
    for (rel, node) in &now {
        let old = grant.baseline.get(rel);
        if old == Some(node) {
            continue;
        }
        let (parent_rel, name) = split(rel);
        let parent = open_beneath(&root, parent_rel).map_err(|e| host_err(parent_rel, e))?;
        let existing = match fstatat(&parent, name, AtFlags::AT_SYMLINK_NOFOLLOW) {
            Ok(stat) => Some(kind_of(&stat)),
            Err(Errno::ENOENT) => None,
            Err(e) => return Err(host_err(rel, e)),
        };
        match node {
            Node::Dir { mode } => {
                if existing != Some(SFlag::S_IFDIR) {
                    if existing.is_some() {
                        done.removed += remove_at(&parent, name).map_err(|e| host_err(rel, e))?;
                    }
                    mkdirat(&parent, name, Mode::from_bits_truncate(0o700)).map_err(|e| host_err(rel, e))?;
                    done.dirs += 1;
                }
                dir_modes.push((rel.as_path(), *mode & KEPT_MODE));
            }
            Node::File { mode, .. } => {
                let staged = staging_name();
                let fd = openat(
                    &parent,
                    staged.as_str(),
                    OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_CLOEXEC,
                    Mode::from_bits_truncate(0o600),
                )
                .map_err(|e| host_err(rel, e))?;
                let mut to = File::from(fd);
                let written = copy_file(&grant.copy.join(rel), &mut to)
                    .and_then(|()| fchmod(&to, Mode::from_bits_truncate(*mode & KEPT_MODE)).map_err(io::Error::from));
                drop(to);
                if let Err(source) = written {
                    let _ = unlinkat(&parent, staged.as_str(), UnlinkatFlags::NoRemoveDir);
                    return Err(ScratchError::Commit { path: at(rel), source });
                }
                move_into_place(&parent, &staged, name, existing, done).map_err(|e| host_err(rel, e))?;
                done.written += 1;
            }
            Node::Symlink { target } => {
                let staged = staging_name();
                symlinkat(target.as_path(), &parent, staged.as_str()).map_err(|e| host_err(rel, e))?;
                move_into_place(&parent, &staged, name, existing, done).map_err(|e| host_err(rel, e))?;
                done.written += 1;
            }
        }
    }
    // Modes last, deepest first, so a directory made read-only still received its files.
    for (rel, mode) in dir_modes.into_iter().rev() {
        let dir = open_beneath(&root, rel).map_err(|e| host_err(rel, e))?;
        fchmod(&dir, Mode::from_bits_truncate(mode)).map_err(|e| host_err(rel, e))?;
    }
    Ok(())
}

/// Renames `staged` over `name` in `parent` (a directory in the way is removed first); on failure `staged` goes.
fn move_into_place(
    parent: &OwnedFd,
    staged: &str,
    name: &OsStr,
    existing: Option<SFlag>,
    done: &mut Committed,
) -> Result<(), Errno> {
    let result = (|| {
        if existing == Some(SFlag::S_IFDIR) {
            done.removed += remove_at(parent, name)?;
        }
        renameat(parent, staged, parent, name)
    })();
    if result.is_err() {
        let _ = unlinkat(parent, staged, UnlinkatFlags::NoRemoveDir);
    }
    result
}

/// Copies the scratch file at `path` (opened without following a link) into `to`.
fn copy_file(path: &Path, to: &mut File) -> io::Result<()> {
    let mut from = std::fs::OpenOptions::new().read(true).custom_flags(OFlag::O_NOFOLLOW.bits()).open(path)?;
    io::copy(&mut from, to)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::symlink;

    use strata_core::Grant;

    use super::*;

    struct Fixture {
        root: tempfile::TempDir,
    }

    impl Fixture {
        fn new() -> Fixture {
            let root = tempfile::tempdir().expect("tempdir");
            for dir in ["rw", "rw/sub", "ro", "outside", "scratch"] {
                std::fs::create_dir(root.path().join(dir)).expect("mkdir");
            }
            std::fs::write(root.path().join("rw/keep.txt"), "keep").expect("write");
            std::fs::write(root.path().join("rw/change.txt"), "old").expect("write");
            std::fs::write(root.path().join("rw/delete.txt"), "delete me").expect("write");
            std::fs::write(root.path().join("rw/sub/deep.txt"), "deep").expect("write");
            std::fs::write(root.path().join("outside/secret.txt"), "secret").expect("write");
            std::fs::write(root.path().join("ro/in.txt"), "in").expect("write");
            symlink("../outside", root.path().join("rw/link")).expect("symlink");
            Fixture { root }
        }

        fn path(&self, rel: &str) -> PathBuf {
            self.root.path().join(rel)
        }

        fn caps(&self) -> Capabilities {
            Capabilities {
                grants: vec![
                    Grant::new(self.path("ro"), "/in", GrantMode::Ro).expect("grant"),
                    Grant::new(self.path("rw"), "/out", GrantMode::Rw).expect("grant"),
                ],
                ..Capabilities::default()
            }
        }

        fn scratch_is_empty(&self) -> bool {
            std::fs::read_dir(self.path("scratch")).expect("scratch").next().is_none()
        }
    }

    fn read(path: PathBuf) -> String {
        std::fs::read_to_string(path).expect("read")
    }

    #[test]
    fn no_rw_grant_needs_no_scratch() {
        let fx = Fixture::new();
        let caps = Capabilities { grants: fx.caps().grants[..1].to_vec(), ..Capabilities::default() };
        assert!(ScratchGrants::prepare(&caps, 1 << 20, &fx.path("scratch")).expect("prepare").is_none());
    }

    #[test]
    fn only_rw_grants_are_copied_and_links_stay_links() {
        let fx = Fixture::new();
        let scratch = ScratchGrants::prepare(&fx.caps(), 1 << 20, &fx.path("scratch")).expect("prepare").expect("rw");
        let caps = scratch.caps(&fx.caps());
        assert_eq!(caps.grants[0], fx.caps().grants[0], "the ro grant is used as it is");
        let copy = caps.grants[1].host.clone();
        assert!(copy.starts_with(scratch.path()));
        assert_eq!(read(copy.join("sub/deep.txt")), "deep");
        assert_eq!(std::fs::read_link(copy.join("link")).expect("link"), Path::new("../outside"));
        assert!(!copy.join("secret.txt").exists() && !copy.join("link/secret.txt").exists());
        drop(scratch);
        assert!(fx.scratch_is_empty(), "the copies are removed when dropped");
    }

    #[test]
    fn a_commit_applies_creations_changes_and_deletions_and_nothing_else() {
        let fx = Fixture::new();
        let scratch = ScratchGrants::prepare(&fx.caps(), 1 << 20, &fx.path("scratch")).expect("prepare").expect("rw");
        let copy = scratch.caps(&fx.caps()).grants[1].host.clone();
        std::fs::write(copy.join("change.txt"), "new").expect("change");
        std::fs::write(copy.join("created.txt"), "created").expect("create");
        std::fs::remove_file(copy.join("delete.txt")).expect("delete");
        std::fs::create_dir_all(copy.join("new/dir")).expect("mkdir");
        std::fs::write(copy.join("new/dir/f.txt"), "f").expect("write");
        std::fs::remove_dir_all(copy.join("sub")).expect("rmdir");
        std::fs::write(copy.join("sub"), "a file where a directory was").expect("write");
        symlink("created.txt", copy.join("new-link")).expect("symlink");
        // Meanwhile on the host, a file the job did not touch changes: the commit leaves it alone.
        std::fs::write(fx.path("rw/keep.txt"), "changed on the host").expect("write");
        let done = scratch.commit().expect("commit");
        assert_eq!(read(fx.path("rw/change.txt")), "new");
        assert_eq!(read(fx.path("rw/created.txt")), "created");
        assert!(!fx.path("rw/delete.txt").exists());
        assert_eq!(read(fx.path("rw/new/dir/f.txt")), "f");
        assert_eq!(read(fx.path("rw/sub")), "a file where a directory was");
        assert_eq!(std::fs::read_link(fx.path("rw/new-link")).expect("link"), Path::new("created.txt"));
        assert_eq!(read(fx.path("rw/keep.txt")), "changed on the host");
        assert_eq!(std::fs::read_link(fx.path("rw/link")).expect("link"), Path::new("../outside"));
        assert_eq!(done, Committed { written: 5, dirs: 2, removed: 3 });
        assert!(fx.scratch_is_empty());
        let leftovers: Vec<_> = std::fs::read_dir(fx.path("rw"))
            .expect("rw")
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().starts_with(".strata-commit-"))
            .collect();
        assert!(leftovers.is_empty(), "{leftovers:?}");
    }

    #[test]
    fn a_commit_never_writes_through_a_host_link() {
        let fx = Fixture::new();
        let scratch = ScratchGrants::prepare(&fx.caps(), 1 << 20, &fx.path("scratch")).expect("prepare").expect("rw");
        let copy = scratch.caps(&fx.caps()).grants[1].host.clone();
        // The job makes `link` a directory with a file in it; on the host `link` points outside the grant.
        std::fs::remove_file(copy.join("link")).expect("unlink");
        std::fs::create_dir(copy.join("link")).expect("mkdir");
        std::fs::write(copy.join("link/secret.txt"), "overwritten").expect("write");
        // And writes under `sub`, which the host meanwhile turns into a link to outside.
        std::fs::write(copy.join("sub/deep.txt"), "through").expect("write");
        std::fs::remove_dir_all(fx.path("rw/sub")).expect("rm");
        symlink("../outside", fx.path("rw/sub")).expect("symlink");
        std::fs::write(fx.path("outside/deep.txt"), "untouched").expect("write");
        let err = scratch.commit().expect_err("refused");
        assert!(matches!(err, ScratchError::NotADirectory(_)), "{err}");
        assert_eq!(read(fx.path("outside/secret.txt")), "secret");
        assert_eq!(read(fx.path("outside/deep.txt")), "untouched");
        // The link the job replaced by a directory was replaced on the host too, not followed.
        assert!(fx.path("rw/link").is_dir() && !fx.path("rw/link").is_symlink());
        assert!(fx.scratch_is_empty());
    }

    #[test]
    fn a_grant_named_through_a_link_is_copied_and_committed_as_its_directory() {
        let fx = Fixture::new();
        symlink(fx.path("rw"), fx.path("rw-link")).expect("symlink");
        let caps = Capabilities {
            grants: vec![Grant::new(fx.path("rw-link"), "/out", GrantMode::Rw).expect("grant")],
            ..Capabilities::default()
        };
        let scratch = ScratchGrants::prepare(&caps, 1 << 20, &fx.path("scratch")).expect("prepare").expect("rw");
        let copy = scratch.caps(&caps).grants[0].host.clone();
        assert!(copy.is_dir() && !copy.is_symlink(), "a copy, not a link to the host directory");
        std::fs::write(copy.join("change.txt"), "new").expect("change");
        assert_eq!(read(fx.path("rw/change.txt")), "old");
        scratch.commit().expect("commit");
        assert_eq!(read(fx.path("rw/change.txt")), "new");
    }

    #[test]
    fn a_discarded_scratch_changes_nothing() {
        let fx = Fixture::new();
        let scratch = ScratchGrants::prepare(&fx.caps(), 1 << 20, &fx.path("scratch")).expect("prepare").expect("rw");
        let copy = scratch.caps(&fx.caps()).grants[1].host.clone();
        std::fs::write(copy.join("change.txt"), "new").expect("change");
        std::fs::remove_file(copy.join("delete.txt")).expect("delete");
        drop(scratch);
        assert_eq!(read(fx.path("rw/change.txt")), "old");
        assert_eq!(read(fx.path("rw/delete.txt")), "delete me");
        assert!(fx.scratch_is_empty());
    }

    #[test]
    fn scratch_left_by_a_dead_engine_is_swept() {
        let fx = Fixture::new();
        // No process has PID u32::MAX (Linux PIDs stay below 2^22); this process is alive.
        let stale = fx.path("scratch/scratch-4294967295-abc");
        let live = fx.path(&format!("scratch/scratch-{}-abc", std::process::id()));
        let other = fx.path("scratch/unrelated");
        for dir in [&stale, &live, &other] {
            std::fs::create_dir_all(dir.join("0")).expect("mkdir");
        }
        symlink(fx.path("outside"), stale.join("0/link")).expect("symlink");
        let scratch = ScratchGrants::prepare(&fx.caps(), 1 << 20, &fx.path("scratch")).expect("prepare");
        assert!(!stale.exists() && live.exists() && other.exists());
        assert_eq!(read(fx.path("outside/secret.txt")), "secret");
        drop(scratch);
    }

    #[test]
    fn grants_over_the_disk_limit_or_overlapping_get_no_scratch() {
        let fx = Fixture::new();
        let err = ScratchGrants::prepare(&fx.caps(), 10, &fx.path("scratch")).expect_err("too large");
        assert!(matches!(err, ScratchError::TooLarge { cap: 10 }), "{err}");
        assert!(fx.scratch_is_empty(), "a refused copy leaves nothing");
        let mut caps = fx.caps();
        caps.grants.push(Grant::new(fx.path("rw/sub"), "/sub", GrantMode::Ro).expect("grant"));
        let err = ScratchGrants::prepare(&caps, 1 << 20, &fx.path("scratch")).expect_err("overlap");
        assert!(matches!(err, ScratchError::Overlap { .. }), "{err}");
        // 4 + 3 + 9 + 4 bytes of files fit in 20.
        assert!(ScratchGrants::prepare(&fx.caps(), 20, &fx.path("scratch")).expect("fits").is_some());
    }
}
