//! A sandbox's grants seen from the host: where a guest path lands, and the filesystem methods on it
//! (`list_dir`, `stat`, `make_dir`, `rename`, `remove`; `watch` is in [`crate::watch`]).
//!
//! Each method opens the grant's host directory as a cap-std [`Dir`] and walks the guest path from it one
//! component at a time without following symbolic links ([`DirExt::open_dir_nofollow`]), then acts on the last
//! component relative to the directory it reached. A link or `..` a guest left in a grant can therefore never
//! take the host outside the grant: a link on the way is refused ("goes through a symbolic link"), never
//! followed, even when it points inside the grant, and a link at the end is described, listed and removed as
//! the link itself. Read-only grants refuse every change; a rename never crosses grants.
//!
//! The tree the guest sees: each grant is mounted at its guest path, and a grant mounted inside another shadows
//! the entry of the same name there. A directory that lies above grants but in none of them (`/` with grants at
//! `/data` and `/work/src`, or `/work`) exists only as the way to those mounts: it lists the next component of
//! each grant below it as a directory (`/` lists `data` and `work`), is described as an empty directory owned
//! by root (mode `0o555`, no modification time), and can be neither changed nor watched.
//!
//! Owners are the host's: WASI has none of its own. A name that is not UTF-8 is listed lossily (U+FFFD).

use std::io;
use std::path::Path;

use cap_fs_ext::DirExt;
use cap_std::ambient_authority;
use cap_std::fs::{Dir, Metadata, MetadataExt};
use strata_core::fs::{MAX_LIST_DEPTH, MAX_LIST_ENTRIES};
use strata_core::{CapsError, EntryInfo, FileType, Grant, GrantMode, GuestPath, TierError, TierKind};

/// Where a guest path lands.
#[derive(Debug)]
pub(crate) enum Place<'g, 'p> {
    /// Inside a grant.
    Grant(Located<'g, 'p>),
    /// A directory above grants that is in none of them.
    Mounts,
}

/// A guest path inside a grant.
#[derive(Debug)]
pub(crate) struct Located<'g, 'p> {
    /// The grant (the one mounted deepest above the path).
    pub(crate) grant: &'g Grant,
    /// The path's components below the grant's guest directory (none for the grant's directory itself).
    pub(crate) parts: Vec<&'p str>,
}

impl Located<'_, '_> {
    /// Refuses a change in a read-only grant.
    pub(crate) fn writable(&self, path: &GuestPath) -> Result<(), TierError> {
        match self.grant.mode {
            GrantMode::Rw => Ok(()),
            GrantMode::Ro => Err(bad(path, "is in a read-only grant")),
        }
    }

    /// The directory holding the path and its last component; refuses the grant's directory itself.
    fn parent(&self, path: &GuestPath) -> Result<(Dir, &str), TierError> {
        let Some((name, above)) = self.parts.split_last() else {
            return Err(bad(path, "is a grant's directory"));
        };
        let dir = walk_to(&open_grant(self.grant)?, above, false, path)?;
        Ok((dir, name))
    }

    /// The directory at the path.
    pub(crate) fn dir(&self, path: &GuestPath) -> Result<Dir, TierError> {
        walk(&open_grant(self.grant)?, &self.parts, path)
    }

    /// The path below the grant, as cap-std takes it (`"."` for the grant's directory).
    pub(crate) fn relative(&self) -> String {
        if self.parts.is_empty() { ".".into() } else { self.parts.join("/") }
    }
}

/// A refused guest path (`guest_path`).
pub(crate) fn bad(path: &GuestPath, reason: &str) -> TierError {
    TierError::GuestPath { path: path.to_string(), reason: reason.to_owned() }
}

/// An I/O failure at `path`, said the way the guest would understand it.
fn io_err(path: &GuestPath, what: &str, err: &io::Error) -> TierError {
    match err.kind() {
        io::ErrorKind::NotFound => bad(path, "does not exist"),
        io::ErrorKind::AlreadyExists => bad(path, "already exists"),
        io::ErrorKind::NotADirectory => bad(path, "goes through a file that is not a directory"),
        _ if err.raw_os_error() == Some(nix::libc::ELOOP) => bad(path, "goes through a symbolic link"),
        _ => bad(path, &format!("cannot {what}: {err}")),
    }
}

/// The grant's host directory as a capability.
pub(crate) fn open_grant(grant: &Grant) -> Result<Dir, TierError> {
    Dir::open_ambient_dir(&grant.host, ambient_authority())
        .map_err(|_| TierError::Capability(CapsError::GrantNotFound(grant.host.clone())))
}

/// The grants' guest paths, checked (a grant whose guest path breaks the rules holds no path).
fn mounts(grants: &[Grant]) -> impl Iterator<Item = (&Grant, GuestPath)> {
    grants.iter().filter_map(|g| GuestPath::new(&g.guest).ok().map(|guest| (g, guest)))
}

/// Where `path` lands among `grants`.
pub(crate) fn locate<'g, 'p>(grants: &'g [Grant], path: &'p GuestPath) -> Result<Place<'g, 'p>, TierError> {
    let deepest = mounts(grants)
        .filter_map(|(grant, guest)| path.relative_to(&guest).map(|rest| (grant, guest.as_str().len(), rest)))
        .max_by_key(|(_, depth, _)| *depth);
    if let Some((grant, _, rest)) = deepest {
        let parts = rest.split('/').filter(|part| !part.is_empty()).collect();
        return Ok(Place::Grant(Located { grant, parts }));
    }
    if mounts(grants).any(|(_, guest)| guest.is_within(path)) {
        return Ok(Place::Mounts);
    }
    Err(bad(path, "is not inside any grant"))
}

/// Where `path` lands, for a method that needs a grant (a mount-only directory cannot be changed or watched).
pub(crate) fn locate_in_grant<'g, 'p>(grants: &'g [Grant], path: &'p GuestPath) -> Result<Located<'g, 'p>, TierError> {
    match locate(grants, path)? {
        Place::Grant(located) => Ok(located),
        Place::Mounts => Err(bad(path, "is not inside any grant (it only holds grants' directories)")),
    }
}

/// The directory `parts` below `root` (the whole of `path`), walked without following a link.
pub(crate) fn walk(root: &Dir, parts: &[&str], path: &GuestPath) -> Result<Dir, TierError> {
    walk_to(root, parts, true, path)
}

/// The directory `parts` below `root`, walked without following a link; `whole` when they are all of `path`
/// (not its parent's), for the error's words.
fn walk_to(root: &Dir, parts: &[&str], whole: bool, path: &GuestPath) -> Result<Dir, TierError> {
    let mut dir = root.try_clone().map_err(|e| io_err(path, "open", &e))?;
    for (i, part) in parts.iter().enumerate() {
        let last = whole && i + 1 == parts.len();
        dir = dir.open_dir_nofollow(part).map_err(|e| refused_step(&dir, part, last, path, &e))?;
    }
    Ok(dir)
}

/// Why `part` in `dir` (the path's `last` component, or one on the way) could not be opened as a directory.
fn refused_step(dir: &Dir, part: &str, last: bool, path: &GuestPath, err: &io::Error) -> TierError {
    match dir.symlink_metadata(part) {
        Ok(md) if md.is_symlink() && last => bad(path, "is a symbolic link, not a directory"),
        Ok(md) if md.is_symlink() => bad(path, "goes through a symbolic link"),
        Ok(md) if !md.is_dir() && last => bad(path, "is not a directory"),
        Ok(md) if !md.is_dir() => bad(path, "goes through a file that is not a directory"),
        _ => io_err(path, "open", err),
    }
}

/// Describes `host_name` in `parent` (listed as `name`), a link as itself.
fn describe(parent: &Dir, host_name: impl AsRef<Path>, name: String, path: GuestPath) -> io::Result<EntryInfo> {
    let host_name = host_name.as_ref();
    let md = parent.symlink_metadata(host_name)?;
    let target = match md.is_symlink() {
        true => Some(parent.read_link_contents(host_name)?.to_string_lossy().into_owned()),
        false => None,
    };
    Ok(entry(name, path, &md, target))
}

/// An entry from its metadata.
fn entry(name: String, path: GuestPath, md: &Metadata, symlink_target: Option<String>) -> EntryInfo {
    let kind = md.file_type();
    let file_type = if kind.is_symlink() {
        FileType::Symlink
    } else if kind.is_dir() {
        FileType::Dir
    } else if kind.is_file() {
        FileType::File
    } else {
        FileType::Other
    };
    EntryInfo {
        name,
        path,
        file_type,
        size: md.len(),
        mode: md.mode() & 0o7777,
        uid: md.uid(),
        gid: md.gid(),
        modified: md.modified().ok().map(|t| t.into_std()),
        symlink_target,
    }
}

/// A directory that exists only as the way to grants.
fn mount_only(path: GuestPath) -> EntryInfo {
    let name = path.file_name().unwrap_or_default().to_owned();
    EntryInfo {
        name,
        path,
        file_type: FileType::Dir,
        size: 0,
        mode: 0o555,
        uid: 0,
        gid: 0,
        modified: None,
        symlink_target: None,
    }
}

/// A grant's own directory, at its mount point.
fn grant_root(grant: &Grant, path: GuestPath) -> Result<EntryInfo, TierError> {
    let md = open_grant(grant)?.dir_metadata().map_err(|e| io_err(&path, "stat", &e))?;
    let name = path.file_name().unwrap_or_default().to_owned();
    Ok(entry(name, path, &md, None))
}

/// `stat`: the entry at `path`, a link as itself.
pub(crate) fn stat(grants: &[Grant], path: &GuestPath) -> Result<EntryInfo, TierError> {
    let located = match locate(grants, path)? {
        Place::Mounts => return Ok(mount_only(path.clone())),
        Place::Grant(located) => located,
    };
    if located.parts.is_empty() {
        return grant_root(located.grant, path.clone());
    }
    let (parent, name) = located.parent(path)?;
    describe(&parent, name, name.to_owned(), path.clone()).map_err(|e| io_err(path, "stat", &e))
}

/// `make_dir`: makes `path` and its missing parents; `false` when it was already a directory.
pub(crate) fn make_dir(grants: &[Grant], path: &GuestPath) -> Result<bool, TierError> {
    path.check_file_target()?;
    let located = match locate(grants, path)? {
        Place::Mounts => return Ok(false),
        Place::Grant(located) => located,
    };
    located.writable(path)?;
    let mut dir = open_grant(located.grant)?;
    let mut created = false;
    for (i, part) in located.parts.iter().enumerate() {
        created = match dir.create_dir(part) {
            Ok(()) => true,
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => false,
            Err(e) => return Err(io_err(path, "make the directory", &e)),
        };
        let last = i + 1 == located.parts.len();
        dir = dir.open_dir_nofollow(part).map_err(|e| refused_step(&dir, part, last, path, &e))?;
    }
    Ok(created)
}

/// `rename`: moves `from` to `to`, both in one read-write grant.
pub(crate) fn rename(grants: &[Grant], from: &GuestPath, to: &GuestPath) -> Result<EntryInfo, TierError> {
    from.check_file_target()?;
    to.check_file_target()?;
    let source = locate_in_grant(grants, from)?;
    let target = locate_in_grant(grants, to)?;
    if !std::ptr::eq(source.grant, target.grant) {
        return Err(bad(to, &format!("is in another grant than {from}")));
    }
    source.writable(from)?;
    if to != from && to.is_within(from) {
        return Err(bad(to, &format!("is inside {from}, which is moved")));
    }
    let (from_dir, from_name) = source.parent(from)?;
    let (to_dir, to_name) = target.parent(to)?;
    from_dir.symlink_metadata(from_name).map_err(|e| io_err(from, "rename", &e))?;
    from_dir.rename(from_name, &to_dir, to_name).map_err(|e| io_err(to, "rename", &e))?;
    describe(&to_dir, to_name, to_name.to_owned(), to.clone()).map_err(|e| io_err(to, "stat", &e))
}

/// `remove`: the file or link at `path`, or the directory and everything in it (links inside are removed, never
/// followed).
pub(crate) fn remove(grants: &[Grant], path: &GuestPath) -> Result<(), TierError> {
    path.check_file_target()?;
    let located = locate_in_grant(grants, path)?;
    located.writable(path)?;
    let (parent, name) = located.parent(path)?;
    let md = parent.symlink_metadata(name).map_err(|e| io_err(path, "remove", &e))?;
    let removed = if md.is_dir() { parent.remove_dir_all(name) } else { parent.remove_file(name) };
    removed.map_err(|e| io_err(path, "remove", &e))
}

/// The most entries one listing answers.
pub(crate) const LIST_CAP: usize = MAX_LIST_ENTRIES;

/// `list_dir` with at most `cap` entries: the entries below `path` to `depth` levels (clamped to
/// `1..=MAX_LIST_DEPTH`), in directory order, each directory's mount points after its own entries.
pub(crate) fn list_dir(
    grants: &[Grant],
    path: &GuestPath,
    depth: u32,
    cap: usize,
) -> Result<Vec<EntryInfo>, TierError> {
    let dir = match locate(grants, path)? {
        Place::Mounts => None,
        Place::Grant(located) => Some((located.grant, located.dir(path)?)),
    };
    let mut listing = Listing { grants, cap, entries: Vec::new(), top: path };
    listing.directory(dir.as_ref().map(|(g, d)| (*g, d)), path, depth.clamp(1, MAX_LIST_DEPTH))?;
    Ok(listing.entries)
}

/// A listing being gathered, bounded by its cap.
struct Listing<'a> {
    grants: &'a [Grant],
    cap: usize,
    entries: Vec<EntryInfo>,
    top: &'a GuestPath,
}

impl Listing<'_> {
    fn push(&mut self, entry: EntryInfo) -> Result<(), TierError> {
        if self.entries.len() >= self.cap {
            return Err(TierError::Capacity {
                tier: TierKind::Wasm,
                reason: format!("{} holds more than {} entries, the most one listing answers", self.top, self.cap),
            });
        }
        self.entries.push(entry);
        Ok(())
    }

    /// The entries of the directory at `path` and theirs to `depth`: `dir` is its grant and host directory, or
    /// `None` for a directory that only holds mount points.
    fn directory(&mut self, dir: Option<(&Grant, &Dir)>, path: &GuestPath, depth: u32) -> Result<(), TierError> {
        let mounted = self.mounted_below(dir.map(|(grant, _)| grant), path);
        if let Some((grant, dir)) = dir {
            let entries = dir.entries().map_err(|e| io_err(path, "list", &e))?;
            for item in entries {
                let item = item.map_err(|e| io_err(path, "list", &e))?;
                let host_name = item.file_name();
                let name = host_name.to_string_lossy().into_owned();
                if mounted.contains(&name) {
                    continue;
                }
                let Ok(child) = path.join(&name) else { continue };
                let entry = match describe(dir, &host_name, name, child.clone()) {
                    Ok(entry) => entry,
                    // Gone since the directory was read.
                    Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                    Err(e) => return Err(io_err(&child, "stat", &e)),
                };
                let descend = depth > 1 && entry.file_type == FileType::Dir;
                self.push(entry)?;
                if descend {
                    // Replaced by a link since it was described: not followed, not listed further.
                    let Ok(sub) = dir.open_dir_nofollow(&host_name) else { continue };
                    self.directory(Some((grant, &sub)), &child, depth - 1)?;
                }
            }
        }
        for name in mounted {
            let Ok(child) = path.join(&name) else { continue };
            match locate(self.grants, &child)? {
                Place::Mounts => {
                    self.push(mount_only(child.clone()))?;
                    if depth > 1 {
                        self.directory(None, &child, depth - 1)?;
                    }
                }
                Place::Grant(located) => {
                    self.push(grant_root(located.grant, child.clone())?)?;
                    if depth > 1 {
                        let sub = open_grant(located.grant)?;
                        self.directory(Some((located.grant, &sub)), &child, depth - 1)?;
                    }
                }
            }
        }
        Ok(())
    }

    /// The names directly below `path` that lead to another grant than `grant` (the one `path` is in): its
    /// mount points, and for a mount-only directory the way to deeper ones. They shadow `path`'s own entries.
    fn mounted_below(&self, grant: Option<&Grant>, path: &GuestPath) -> Vec<String> {
        let mut names: Vec<String> = mounts(self.grants)
            .filter_map(|(_, guest)| {
                let next = guest.relative_to(path)?.split('/').next().filter(|n| !n.is_empty())?;
                let child = path.join(next).ok()?;
                let leads_elsewhere = match locate(self.grants, &child) {
                    Ok(Place::Grant(located)) => grant.is_none_or(|g| !std::ptr::eq(g, located.grant)),
                    Ok(Place::Mounts) => true,
                    Err(_) => false,
                };
                leads_elsewhere.then(|| next.to_owned())
            })
            .collect();
        names.sort_unstable();
        names.dedup();
        names
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::symlink;

    use super::*;

    fn path(text: &str) -> GuestPath {
        GuestPath::new(text).expect("guest path")
    }

    /// `grant/` with `a.txt` (5 bytes), `sub/b.txt`, `sub/deeper/c.txt`, `etc-link -> /etc` and
    /// `sub-link -> sub`, beside `outside/` with `secret.txt`; the grant at `/data`.
    struct Fixture {
        root: tempfile::TempDir,
        grants: Vec<Grant>,
    }

    impl Fixture {
        fn new(mode: GrantMode) -> Fixture {
            let root = tempfile::tempdir().expect("tempdir");
            let grant = root.path().join("grant");
            std::fs::create_dir_all(grant.join("sub/deeper")).expect("mkdir");
            std::fs::create_dir_all(root.path().join("outside")).expect("mkdir");
            std::fs::write(grant.join("a.txt"), "hello").expect("write");
            std::fs::write(grant.join("sub/b.txt"), "b").expect("write");
            std::fs::write(grant.join("sub/deeper/c.txt"), "c").expect("write");
            std::fs::write(root.path().join("outside/secret.txt"), "secret").expect("write");
            symlink("/etc", grant.join("etc-link")).expect("symlink");
            symlink("sub", grant.join("sub-link")).expect("symlink");
            symlink(root.path().join("outside"), grant.join("out-link")).expect("symlink");
            let grants = vec![Grant::new(&grant, "/data", mode).expect("grant")];
            Fixture { root, grants }
        }

        fn host(&self, rest: &str) -> std::path::PathBuf {
            self.root.path().join(rest)
        }
    }

    fn names(entries: &[EntryInfo]) -> Vec<String> {
        let mut names: Vec<String> = entries.iter().map(|e| e.path.to_string()).collect();
        names.sort();
        names
    }

    fn reason(result: Result<impl std::fmt::Debug, TierError>) -> String {
        match result {
            Err(TierError::GuestPath { reason, .. }) => reason,
            other => panic!("expected a guest_path error, got {other:?}"),
        }
    }

    #[test]
    fn list_dir_lists_entries_to_the_depth_asked_and_never_through_links() {
        let fx = Fixture::new(GrantMode::Ro);
        let top = list_dir(&fx.grants, &path("/data"), 1, LIST_CAP).expect("list");
        assert_eq!(names(&top), ["/data/a.txt", "/data/etc-link", "/data/out-link", "/data/sub", "/data/sub-link"]);
        let a = top.iter().find(|e| e.name == "a.txt").expect("a.txt");
        assert_eq!((a.file_type, a.size, a.symlink_target.as_deref()), (FileType::File, 5, None));
        let link = top.iter().find(|e| e.name == "etc-link").expect("etc-link");
        assert_eq!((link.file_type, link.symlink_target.as_deref()), (FileType::Symlink, Some("/etc")));
        let deep = list_dir(&fx.grants, &path("/data"), 3, LIST_CAP).expect("list");
        assert_eq!(
            names(&deep),
            [
                "/data/a.txt",
                "/data/etc-link",
                "/data/out-link",
                "/data/sub",
                "/data/sub-link",
                "/data/sub/b.txt",
                "/data/sub/deeper",
                "/data/sub/deeper/c.txt",
            ],
            "links are listed, never descended into"
        );
        assert_eq!(names(&list_dir(&fx.grants, &path("/data/sub"), 0, LIST_CAP).expect("depth 0 is 1")).len(), 2);
    }

    #[test]
    fn list_dir_refuses_a_path_through_a_link_a_file_or_nothing() {
        let fx = Fixture::new(GrantMode::Ro);
        let link = "is a symbolic link, not a directory";
        assert_eq!(reason(list_dir(&fx.grants, &path("/data/etc-link"), 1, LIST_CAP)), link);
        assert_eq!(reason(list_dir(&fx.grants, &path("/data/out-link"), 1, LIST_CAP)), link);
        assert_eq!(
            reason(list_dir(&fx.grants, &path("/data/sub-link/deeper"), 1, LIST_CAP)),
            "goes through a symbolic link"
        );
        assert_eq!(reason(list_dir(&fx.grants, &path("/data/a.txt"), 1, LIST_CAP)), "is not a directory");
        assert_eq!(reason(list_dir(&fx.grants, &path("/data/nothing"), 1, LIST_CAP)), "does not exist");
        assert_eq!(reason(list_dir(&fx.grants, &path("/elsewhere"), 1, LIST_CAP)), "is not inside any grant");
    }

    #[test]
    fn a_listing_past_its_cap_is_refused() {
        let fx = Fixture::new(GrantMode::Ro);
        let err = list_dir(&fx.grants, &path("/data"), 3, 7).expect_err("8 entries, cap 7");
        assert_eq!(err.code(), "capacity", "{err}");
        assert_eq!(list_dir(&fx.grants, &path("/data"), 3, 8).expect("8 entries, cap 8").len(), 8);
    }

    #[test]
    fn stat_describes_a_link_as_itself() {
        let fx = Fixture::new(GrantMode::Ro);
        let link = stat(&fx.grants, &path("/data/etc-link")).expect("stat");
        assert_eq!(link.file_type, FileType::Symlink);
        assert_eq!(link.symlink_target.as_deref(), Some("/etc"));
        assert_eq!((link.name.as_str(), link.path.as_str()), ("etc-link", "/data/etc-link"));
        let file = stat(&fx.grants, &path("/data/sub/b.txt")).expect("stat");
        assert_eq!((file.file_type, file.size), (FileType::File, 1));
        assert!(file.modified.is_some() && file.mode & 0o400 != 0 && file.mode <= 0o7777, "{file:?}");
        let root = stat(&fx.grants, &path("/data")).expect("stat");
        assert_eq!((root.file_type, root.name.as_str()), (FileType::Dir, "data"));
        assert_eq!(reason(stat(&fx.grants, &path("/data/nothing"))), "does not exist");
        assert_eq!(reason(stat(&fx.grants, &path("/data/etc-link/passwd"))), "goes through a symbolic link");
    }

    #[test]
    fn make_dir_makes_parents_and_says_whether_it_made_the_directory() {
        let fx = Fixture::new(GrantMode::Rw);
        assert!(make_dir(&fx.grants, &path("/data/new/deeper")).expect("mkdir -p"));
        assert!(fx.host("grant/new/deeper").is_dir());
        assert!(!make_dir(&fx.grants, &path("/data/new/deeper")).expect("again"));
        assert!(!make_dir(&fx.grants, &path("/data")).expect("the grant's directory"));
        assert_eq!(reason(make_dir(&fx.grants, &path("/data/a.txt/x"))), "goes through a file that is not a directory");
        assert_eq!(reason(make_dir(&fx.grants, &path("/data/a.txt"))), "is not a directory");
    }

    #[test]
    fn make_dir_and_rename_through_a_symlinked_directory_are_refused() {
        let fx = Fixture::new(GrantMode::Rw);
        for through in ["/data/etc-link/strata-x", "/data/out-link/x", "/data/sub-link/x"] {
            assert_eq!(reason(make_dir(&fx.grants, &path(through))), "goes through a symbolic link", "{through}");
            assert_eq!(
                reason(rename(&fx.grants, &path("/data/a.txt"), &path(through))),
                "goes through a symbolic link",
                "{through}"
            );
        }
        assert_eq!(
            reason(rename(&fx.grants, &path("/data/out-link/secret.txt"), &path("/data/stolen.txt"))),
            "goes through a symbolic link"
        );
        assert!(!fx.host("outside/x").exists() && fx.host("outside/secret.txt").exists());
        assert!(!fx.host("grant/sub/x").exists() && fx.host("grant/a.txt").exists());
    }

    #[test]
    fn rename_moves_within_a_grant_and_describes_the_new_path() {
        let fx = Fixture::new(GrantMode::Rw);
        let moved = rename(&fx.grants, &path("/data/a.txt"), &path("/data/sub/moved.txt")).expect("rename");
        assert_eq!((moved.path.as_str(), moved.size), ("/data/sub/moved.txt", 5));
        assert!(fx.host("grant/sub/moved.txt").is_file() && !fx.host("grant/a.txt").exists());
        let link = rename(&fx.grants, &path("/data/etc-link"), &path("/data/link2")).expect("rename a link");
        assert_eq!((link.file_type, link.symlink_target.as_deref()), (FileType::Symlink, Some("/etc")));
        assert_eq!(reason(rename(&fx.grants, &path("/data/nothing"), &path("/data/x"))), "does not exist");
        let same = rename(&fx.grants, &path("/data/sub"), &path("/data/sub")).expect("onto itself");
        assert_eq!(same.file_type, FileType::Dir);
        assert_eq!(
            reason(rename(&fx.grants, &path("/data/sub"), &path("/data/sub/deeper/sub"))),
            "is inside /data/sub, which is moved"
        );
        assert_eq!(reason(rename(&fx.grants, &path("/data"), &path("/data2"))), "is not inside any grant");
    }

    #[test]
    fn rename_across_grants_is_refused() {
        let fx = Fixture::new(GrantMode::Rw);
        let mut grants = fx.grants.clone();
        grants.push(Grant::new(fx.host("outside"), "/other", GrantMode::Rw).expect("grant"));
        assert_eq!(
            reason(rename(&grants, &path("/data/a.txt"), &path("/other/a.txt"))),
            "is in another grant than /data/a.txt"
        );
        assert!(fx.host("grant/a.txt").exists());
    }

    #[test]
    fn remove_removes_a_link_not_its_target_and_directories_recursively() {
        let fx = Fixture::new(GrantMode::Rw);
        remove(&fx.grants, &path("/data/out-link")).expect("remove the link");
        assert!(fx.host("grant/out-link").symlink_metadata().is_err());
        assert!(fx.host("outside/secret.txt").is_file(), "the link's target is untouched");
        remove(&fx.grants, &path("/data/etc-link")).expect("remove the link");
        assert!(Path::new("/etc").is_dir());
        symlink(fx.host("outside"), fx.host("grant/sub/deeper/out")).expect("symlink");
        remove(&fx.grants, &path("/data/sub")).expect("remove a directory");
        assert!(!fx.host("grant/sub").exists());
        assert!(fx.host("outside/secret.txt").is_file(), "a link inside is removed, not followed");
        remove(&fx.grants, &path("/data/a.txt")).expect("remove a file");
        assert_eq!(reason(remove(&fx.grants, &path("/data/a.txt"))), "does not exist");
        assert_eq!(reason(remove(&fx.grants, &path("/data"))), "is a grant's directory");
        assert_eq!(reason(remove(&fx.grants, &path("/data/sub-link/b.txt"))), "goes through a symbolic link");
    }

    #[test]
    fn a_read_only_grant_refuses_every_change() {
        let fx = Fixture::new(GrantMode::Ro);
        let ro = "is in a read-only grant";
        assert_eq!(reason(make_dir(&fx.grants, &path("/data/new"))), ro);
        assert_eq!(reason(make_dir(&fx.grants, &path("/data/sub"))), ro);
        assert_eq!(reason(rename(&fx.grants, &path("/data/a.txt"), &path("/data/b.txt"))), ro);
        assert_eq!(reason(remove(&fx.grants, &path("/data/a.txt"))), ro);
        assert_eq!(reason(remove(&fx.grants, &path("/data/etc-link"))), ro);
        assert!(fx.host("grant/a.txt").is_file() && !fx.host("grant/new").exists());
    }

    #[test]
    fn the_root_above_several_grants_lists_their_mount_points() {
        let fx = Fixture::new(GrantMode::Ro);
        let mut grants = fx.grants.clone();
        grants.push(Grant::new(fx.host("outside"), "/work/src", GrantMode::Rw).expect("grant"));
        let top = list_dir(&grants, &GuestPath::root(), 1, LIST_CAP).expect("list /");
        assert_eq!(names(&top), ["/data", "/work"]);
        assert!(top.iter().all(|e| e.file_type == FileType::Dir), "{top:?}");
        let deep = list_dir(&grants, &GuestPath::root(), 3, LIST_CAP).expect("list / deeper");
        for expected in ["/data/a.txt", "/data/sub/b.txt", "/work/src", "/work/src/secret.txt"] {
            assert!(names(&deep).iter().any(|n| n == expected), "{expected} missing from {:?}", names(&deep));
        }
        assert_eq!(stat(&grants, &path("/work")).expect("stat").file_type, FileType::Dir);
        assert_eq!(stat(&grants, &GuestPath::root()).expect("stat").name, "");
        assert!(!make_dir(&grants, &path("/work")).expect("exists"));
        assert_eq!(
            reason(remove(&grants, &path("/work"))),
            "is not inside any grant (it only holds grants' directories)"
        );
    }

    #[test]
    fn a_grant_mounted_inside_another_shadows_its_entry() {
        let fx = Fixture::new(GrantMode::Ro);
        let mut grants = fx.grants.clone();
        grants.push(Grant::new(fx.host("outside"), "/data/sub", GrantMode::Ro).expect("grant"));
        let deep = list_dir(&grants, &path("/data"), 2, LIST_CAP).expect("list");
        let listed = names(&deep);
        assert!(listed.iter().any(|n| n == "/data/sub/secret.txt"), "{listed:?}");
        assert!(!listed.iter().any(|n| n == "/data/sub/b.txt"), "{listed:?}");
        assert_eq!(listed.iter().filter(|n| *n == "/data/sub").count(), 1, "{listed:?}");
    }
}
