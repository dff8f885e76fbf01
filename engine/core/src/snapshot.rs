//! Snapshots on disk: one directory per snapshot, the tier's own files beside a `manifest.json` that names every
//! file with its size and sha256, and a `manifest.seal` that vouches for the manifest.
//!
//! **Trust.** A snapshot is untrusted data once written: a job that can write where snapshots live could rewrite
//! the manifest (which records what forks get: grants, environment, network, limits) or swap a file. So every
//! manifest is sealed with the host's key ([`SnapshotKey`], a keyed BLAKE3 MAC over its exact bytes), and
//! [`SnapshotTrust`] — the key, the [`SnapshotBounds`] and the only way to open a snapshot — reads the seal and a
//! bounded number of manifest bytes and compares the MAC (in constant time) before it parses anything; then each
//! file is checked against the sealed size and sha256. A manifest that was altered, copied from another home or
//! made before format 2 (unsealed) is refused as `snapshot_invalid`; nothing of it reaches a tier. A [`Snapshot`]
//! exists only as this module made it (opened, re-opened or committed), and a tier forking one re-opens it first
//! ([`SnapshotTrust::reopen`]): the directory must still hold the same sealed manifest, and its files are hashed
//! again unless their identity, size and times are those they were verified with (any write moves the change time,
//! which no one but the kernel sets). Across processes likewise: after a full verification, a trust with a home
//! writes the stamps the files were verified with to a record under the home ([`VERIFIED_DIR`], not in the
//! snapshot directory), sealed with the key under the manifest's seal, and a later open hashes only the files
//! whose stamp differs from the record's ([`crate::file_stamp`] for when a stamp vouches for bytes). Tiers read their files only through [`Snapshot::read_file`] (bytes checked
//! against the manifest as they are read) and [`Snapshot::open_file`] (the verified file itself), and map only
//! [`Snapshot::private_copy`] (the bytes copied where no one else can change them, checked as they are copied).
//!
//! **Bounded work.** Every size comes from `fstatat` without following links and is checked against the manifest
//! and the bounds before a byte is hashed; files are opened only after `lstat` says they are regular, never
//! through a link (`O_NOFOLLOW` at every component) and never blocking (`O_NONBLOCK`: a FIFO is refused, not
//! waited on). Holes count: a sparse file is hashed byte for byte, so the bounds are on apparent sizes. The walk
//! that finds unlisted files stops at the bounds' counts and depth. Defaults: 4096 files, 4096 directories, 64
//! levels, 16 GiB a file, 32 GiB in all.
//!
//! **Writing.** A [`SnapshotWriter`] fills a private (0700) staging directory `.NAME.partial-PID-RAND` beside
//! the destination; [`SnapshotWriter::commit`] hashes the files, writes and seals the manifest, syncs everything
//! and renames the directory into place (never over a path that appeared meanwhile), so a snapshot is whole or
//! absent. A writer killed before that leaves its staging directory: killed before the seal, it has none and is
//! refused; killed between the seal and the rename, its files were synced before the manifest was sealed, so it
//! opens only as whole as any snapshot (every file checked against the seal). Nothing opens a staging directory by
//! itself, and the next writer in that directory removes the ones whose process is gone ([`sweep_partials`]).
//!
//! ```text
//! snapshot/
//!   manifest.json   {"format":2,"tier":"process","id":"…","parent":null,"created":"…Z","persists":["filesystem"],
//!                    "files":[{"path":"upper.tree","size":10240,"sha256":"…"}],"total_bytes":10240,"meta":{…}}
//!   manifest.seal   strata-seal blake3-keyed <64 hex digits: the MAC of manifest.json's bytes>
//!   upper.tree      the tier's files, as it names them
//! ```

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::OwnedFd;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Component, Path, PathBuf};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, SystemTime};

use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag, openat};
use nix::sys::stat::{FileStat, Mode, SFlag, fstat, fstatat};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::dirfd;
use crate::file_stamp::FileStamp;
use crate::outcome::TierKind;
use crate::private_copy::PrivateCopy;
use crate::random::random_hex;
pub use crate::snapshot_key::SnapshotKey;
use crate::snapshot_key::SnapshotKeyError;

/// The manifest format this build writes and reads: 2, sealed (format 1 had no seal and is refused).
pub const FORMAT_VERSION: u32 = 2;

/// The manifest's file name inside a snapshot directory.
pub const MANIFEST: &str = "manifest.json";

/// The seal's file name inside a snapshot directory.
pub const SEAL: &str = "manifest.seal";

/// What a seal file says before the MAC's hex digits.
const SEAL_TAG: &str = "strata-seal blake3-keyed ";

/// A manifest larger than this is not one of ours.
const MAX_MANIFEST_BYTES: u64 = 1 << 20;

/// Where, under a home, the unnamed files of private copies are made ([`Snapshot::private_copy`]).
pub const COPIES_DIR: &str = "run/copies";
/// Where, under a home, private copies are kept for later processes ([`Snapshot::private_copy`]): beside the
/// compiled code and memory images the host maps (`<key>.image` + `<key>.image.sum`), which only the host may
/// write and `strata images prune` evicts least recently used first.
pub const KEPT_DIR: &str = "modules";

/// Where, under a home, the sealed records of the stamps snapshots were verified with are kept
/// ([`SnapshotTrust::with_verified_in`]).
pub const VERIFIED_DIR: &str = "run/verified";

/// What a record of verified stamps says first.
const VERIFIED_TAG: &str = "strata-verified-stamps 1";

/// A seal file larger than this is not one of ours.
const MAX_SEAL_BYTES: u64 = 128;

/// How many entries [`sweep_partials`] looks at in one directory.
const MAX_SWEEP_ENTRIES: usize = 1 << 16;

/// How much a snapshot may hold, checked before the work it would cost is done: when it is opened (from `stat`,
/// before any byte is hashed) and when it is committed (a snapshot that could not be opened is not written).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SnapshotBounds {
    /// Files in the manifest (and non-directories in the directory).
    pub max_files: usize,
    /// Directories in the snapshot directory, itself excluded.
    pub max_dirs: usize,
    /// Levels of directories below the snapshot directory.
    pub max_depth: usize,
    /// Bytes of one file, holes included (a sparse file is hashed byte for byte).
    pub max_file_bytes: u64,
    /// Bytes of all files together, holes included.
    pub max_total_bytes: u64,
}

impl Default for SnapshotBounds {
    fn default() -> Self {
        SnapshotBounds {
            max_files: 4096,
            max_dirs: 4096,
            max_depth: 64,
            max_file_bytes: 16 << 30,
            max_total_bytes: 32 << 30,
        }
    }
}

/// A kind of state a snapshot holds, so `strata snapshot inspect` says honestly what a fork gets back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Persisted {
    /// Guest memory: the interpreter's heap, imported modules, live objects.
    Memory,
    /// CPU state: registers of every vCPU (microVM).
    Cpu,
    /// Device state: virtio queues, interrupt controllers, clock (microVM).
    Devices,
    /// The sandbox's writable filesystem layer.
    Filesystem,
    /// Open files, working directory and environment of the guest.
    Descriptors,
    /// Processes left running by the setup job keep running in every fork.
    Processes,
}

/// One file of a snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ManifestFile {
    /// Relative path inside the snapshot directory (`/`-separated, no `..`).
    pub path: String,
    /// Size in bytes.
    pub size: u64,
    /// sha256 of the contents, lower-case hex.
    pub sha256: String,
}

/// `manifest.json`: what a snapshot is and what it holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// [`FORMAT_VERSION`] of the build that wrote it.
    pub format: u32,
    /// The Strata version that wrote it (informative; compatibility is `format`'s business).
    pub strata: String,
    /// The tier it belongs to: only that tier forks it.
    pub tier: TierKind,
    /// A random identifier (32 hex digits).
    pub id: String,
    /// The snapshot this one was made from (a sandbox forked from it, then snapshotted), if any.
    pub parent: Option<String>,
    /// When it was written, RFC 3339 UTC.
    pub created: String,
    /// What state it holds.
    pub persists: Vec<Persisted>,
    /// Every file but the manifest and its seal.
    pub files: Vec<ManifestFile>,
    /// The sum of the files' sizes.
    pub total_bytes: u64,
    /// The tier's own description of the state (format of its files, guest facts); JSON object.
    pub meta: serde_json::Value,
}

impl Manifest {
    /// Parses a manifest received from elsewhere (another node of a fleet sending one of its snapshots), at most
    /// 1 MiB, and checks everything it says against itself and `bounds` as an opened one is (format, plain unique
    /// paths, sha256 shapes, sizes and their sum) — before a byte of its files is fetched. `origin` names it in
    /// errors. Its files are then checked by [`SnapshotWriter::commit_copy`].
    pub fn parse_received(origin: &Path, bytes: &[u8], bounds: &SnapshotBounds) -> Result<Manifest, SnapshotError> {
        if bytes.len() as u64 > MAX_MANIFEST_BYTES {
            return Err(too_large(
                origin,
                format!("a manifest of {} bytes (at most {MAX_MANIFEST_BYTES})", bytes.len()),
            ));
        }
        parse_manifest(origin, bytes, bounds)
    }

    /// The manifest's bytes as sent to another node (JSON; [`Manifest::parse_received`] reads them).
    pub fn to_json(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }
}

/// Why a snapshot could not be written or was refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SnapshotError {
    /// A file or directory could not be read or written.
    #[error("{}: {source}", path.display())]
    Io {
        /// The path.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// The destination exists already; snapshots are never overwritten.
    #[error("{} exists already (snapshots are never overwritten)", .0.display())]
    Exists(PathBuf),
    /// The directory has no manifest: it is not a snapshot, or its writing never finished.
    #[error("{} is not a Strata snapshot (no {MANIFEST})", .0.display())]
    NotASnapshot(PathBuf),
    /// The directory has a manifest but no seal: made before snapshot format 2, or not by Strata.
    #[error(
        "{} has no {SEAL}: it was not sealed on this host (snapshots made before format 2 are refused; make it \
         again)",
        .0.display()
    )]
    Unsealed(PathBuf),
    /// The manifest's seal does not match: altered, or sealed with another home's key.
    #[error("the manifest of {} does not match its seal (altered, or sealed with another key)", .0.display())]
    Seal(PathBuf),
    /// The host's snapshot key could not be used.
    #[error("snapshot key {}: {message}", path.display())]
    Key {
        /// The key file (or its directory).
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// The manifest is not valid JSON of the expected shape.
    #[error("the manifest of {} is invalid: {message}", dir.display())]
    InvalidManifest {
        /// The snapshot directory.
        dir: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// The manifest was written by a build with another format.
    #[error("{} has snapshot format {found}; this build reads format {supported}", dir.display())]
    FormatVersion {
        /// The snapshot directory.
        dir: PathBuf,
        /// The manifest's format.
        found: u32,
        /// [`FORMAT_VERSION`].
        supported: u32,
    },
    /// The snapshot belongs to another tier.
    #[error("{} is a {found} snapshot, not a {expected} one", dir.display())]
    WrongTier {
        /// The snapshot directory.
        dir: PathBuf,
        /// The tier asked for.
        expected: TierKind,
        /// The manifest's tier.
        found: TierKind,
    },
    /// More than [`SnapshotBounds`] allow: refused before the work is done.
    #[error("{}: {message}", path.display())]
    TooLarge {
        /// The snapshot directory or file.
        path: PathBuf,
        /// Which bound, and by how much.
        message: String,
    },
    /// A file the manifest lists is missing.
    #[error("{} is missing from the snapshot", .0.display())]
    MissingFile(PathBuf),
    /// A file's size differs from the manifest's (truncated or grown).
    #[error("{} is {found} bytes; the manifest says {expected} (truncated or altered)", path.display())]
    SizeMismatch {
        /// The file.
        path: PathBuf,
        /// The manifest's size.
        expected: u64,
        /// The file's size.
        found: u64,
    },
    /// A file's contents differ from the manifest's checksum.
    #[error("{} does not match its sha256 in the manifest (corrupted or altered)", .0.display())]
    Checksum(PathBuf),
    /// A file changed after it was verified, or while it was.
    #[error("{} changed since it was verified", .0.display())]
    Changed(PathBuf),
    /// The directory holds another snapshot than the one that was opened there.
    #[error("{} no longer holds the snapshot that was opened there (replaced)", .0.display())]
    Replaced(PathBuf),
    /// A file in the directory that the manifest does not list.
    #[error("{} is not listed in the snapshot's manifest", .0.display())]
    UnlistedFile(PathBuf),
    /// A path in the manifest or the directory that is not a plain relative path, or a file that is not a
    /// regular file (a symlink, a FIFO, a device).
    #[error("{path:?} in {}: {reason}", dir.display())]
    UnsafePath {
        /// The snapshot directory.
        dir: PathBuf,
        /// The path.
        path: String,
        /// What is wrong with it.
        reason: &'static str,
    },
}

impl SnapshotError {
    /// A stable, machine-readable code.
    pub fn code(&self) -> &'static str {
        match self {
            SnapshotError::Io { .. } => "snapshot_io",
            SnapshotError::Exists(_) => "snapshot_exists",
            SnapshotError::FormatVersion { .. } => "snapshot_version",
            SnapshotError::WrongTier { .. } => "snapshot_tier",
            SnapshotError::Key { .. } => "snapshot_key",
            SnapshotError::TooLarge { .. } => "snapshot_too_large",
            SnapshotError::NotASnapshot(_)
            | SnapshotError::Unsealed(_)
            | SnapshotError::Seal(_)
            | SnapshotError::InvalidManifest { .. }
            | SnapshotError::MissingFile(_)
            | SnapshotError::SizeMismatch { .. }
            | SnapshotError::Checksum(_)
            | SnapshotError::Changed(_)
            | SnapshotError::Replaced(_)
            | SnapshotError::UnlistedFile(_)
            | SnapshotError::UnsafePath { .. } => "snapshot_invalid",
        }
    }
}

impl From<SnapshotKeyError> for SnapshotError {
    fn from(err: SnapshotKeyError) -> SnapshotError {
        SnapshotError::Key { path: err.path, message: err.message }
    }
}

fn io_error(path: &Path) -> impl FnOnce(io::Error) -> SnapshotError + '_ {
    move |source| SnapshotError::Io { path: path.to_owned(), source }
}

fn errno_error(path: &Path) -> impl FnOnce(Errno) -> SnapshotError + '_ {
    move |errno| SnapshotError::Io { path: path.to_owned(), source: io::Error::from(errno) }
}

fn too_large(path: &Path, message: String) -> SnapshotError {
    SnapshotError::TooLarge { path: path.to_owned(), message }
}

/// A verified snapshot: its directory and sealed manifest, and the stamps its files were verified with. Made only
/// by [`SnapshotTrust`] and [`SnapshotWriter::commit`]; tiers fork from it ([`crate::Tier::fork`]).
#[derive(Debug, Clone)]
pub struct Snapshot {
    /// The tier that made it.
    pub tier: TierKind,
    /// Its directory.
    pub dir: PathBuf,
    /// Its manifest.
    pub manifest: Manifest,
    /// The stamps of `manifest.files`, in order, when they were verified.
    stamps: Vec<FileStamp>,
    /// How many bytes were hashed to verify it.
    hashed: u64,
    /// Whether every file had last changed [`crate::file_stamp::SETTLE`] before it was verified: then an
    /// unchanged stamp vouches for its bytes ([`Snapshot::private_copy`]).
    settled: bool,
    /// Sealed copies of its files made so far ([`Snapshot::sealed_file`]), shared by its clones.
    copies: Arc<Copies>,
}

/// Live private copies of snapshot files by content (sha256 and size): one trust's, shared by every snapshot
/// it opens, so forks of one image from several snapshot handles share one copy. Only weak references: a copy
/// lives as long as a snapshot handle or a mapping holds it.
type ByContent = Arc<Mutex<HashMap<(String, u64), Weak<PrivateCopy>>>>;

/// Where a trust's private copies go, and the live ones.
#[derive(Debug, Clone, Default)]
struct CopyPlace {
    /// The directory of their unnamed files (see [`crate::private_copy`]); `None`: sealed memfds.
    dir: Option<PathBuf>,
    /// Where copies are kept for later processes ([`KEPT_DIR`] under a home), if anywhere.
    kept: Option<PathBuf>,
    by_content: ByContent,
}

/// The private copies one verified snapshot holds.
#[derive(Debug)]
struct Copies {
    held: Mutex<HashMap<String, Arc<PrivateCopy>>>,
    place: CopyPlace,
}

impl Copies {
    fn new(place: &CopyPlace) -> Arc<Copies> {
        Arc::new(Copies { held: Mutex::default(), place: place.clone() })
    }
}

impl PartialEq for Snapshot {
    fn eq(&self, other: &Snapshot) -> bool {
        (self.tier, &self.dir, &self.manifest) == (other.tier, &other.dir, &other.manifest)
    }
}

impl Eq for Snapshot {}

impl Snapshot {
    /// How many bytes of its files were hashed when it was opened: 0 when every file still had the stamp of a
    /// verified stamps record ([`SnapshotTrust::with_verified_in`]), or of the handle it was re-opened from.
    pub fn bytes_hashed(&self) -> u64 {
        self.hashed
    }

    /// The path of one of its files (for messages; read it with [`Snapshot::read_file`] or
    /// [`Snapshot::open_file`]).
    pub fn file(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// The manifest's entry for `name`.
    pub fn listed(&self, name: &str) -> Option<&ManifestFile> {
        self.manifest.files.iter().find(|f| f.path == name)
    }

    /// Opens the listed file `name` as it was verified: never through a link, and only while its identity, size
    /// and times are those it was verified with.
    pub fn open_file(&self, name: &str) -> Result<File, SnapshotError> {
        let index = self
            .manifest
            .files
            .iter()
            .position(|f| f.path == name)
            .ok_or_else(|| SnapshotError::MissingFile(self.file(name)))?;
        let root = open_root(&self.dir)?;
        let (file, st) = open_regular(&root, &self.dir, name)?;
        if self.stamps.get(index) != Some(&FileStamp::of_stat(&st)) {
            return Err(SnapshotError::Changed(self.file(name)));
        }
        Ok(file)
    }

    /// The stamp the listed file `name` was verified with.
    fn stamp_of(&self, name: &str) -> Option<&FileStamp> {
        self.manifest.files.iter().position(|f| f.path == name).and_then(|index| self.stamps.get(index))
    }

    /// The bytes of the listed file `name`, at most `max` of them, checked against the manifest's size and
    /// sha256 as they are read (what a tier parses must be exactly what was sealed).
    pub fn read_file(&self, name: &str, max: u64) -> Result<Vec<u8>, SnapshotError> {
        let path = self.file(name);
        let listed = self.listed(name).ok_or_else(|| SnapshotError::MissingFile(path.clone()))?;
        if listed.size > max {
            return Err(too_large(&path, format!("{} bytes (at most {max} read)", listed.size)));
        }
        let file = self.open_file(name)?;
        let mut bytes = Vec::with_capacity(usize::try_from(listed.size).unwrap_or(0));
        file.take(listed.size.saturating_add(1)).read_to_end(&mut bytes).map_err(io_error(&path))?;
        if bytes.len() as u64 != listed.size {
            return Err(SnapshotError::SizeMismatch { path, expected: listed.size, found: bytes.len() as u64 });
        }
        if strata_image_util::hex(&Sha256::digest(&bytes)) != listed.sha256 {
            return Err(SnapshotError::Checksum(path));
        }
        Ok(bytes)
    }

    /// The listed file `name` as a [`PrivateCopy`]: its bytes copied where no one else can reach them (an
    /// unnamed file in the trust's directory for them, or a sealed memfd) and checked as they are copied: against
    /// the manifest's size and sha256, or, when every file had settled before it was verified
    /// ([`crate::file_stamp`]), by the file's stamp, which must be the verified one before and after the copy.
    /// This, not the file, is what a tier maps: nothing done to the snapshot directory afterwards (truncating the
    /// file, rewriting it) reaches a mapping of the copy. The copy is made
    /// once per content: this snapshot keeps it, and every snapshot of the same trust asking for the same bytes
    /// while it lives gets the same one. A trust that keeps copies ([`SnapshotTrust::with_kept_copies_in`]) keeps
    /// it for later processes too, which take the kept file (checked by its recorded stamp) instead of copying:
    /// the bytes it holds are the ones the manifest's sha256 names, whatever the snapshot's file holds by then.
    pub fn private_copy(&self, name: &str) -> Result<Arc<PrivateCopy>, SnapshotError> {
        let path = self.file(name);
        let listed = self.listed(name).ok_or_else(|| SnapshotError::MissingFile(path.clone()))?;
        let mut held = self.copies.held.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(copy) = held.get(name) {
            return Ok(copy.clone());
        }
        let key = (listed.sha256.clone(), listed.size);
        let place = &self.copies.place;
        let shared = place.by_content.lock().unwrap_or_else(|p| p.into_inner()).get(&key).and_then(Weak::upgrade);
        let copy = match shared {
            Some(copy) => copy,
            None => {
                let kept = place.kept.as_deref().map(|dir| kept_paths(dir, &listed.sha256, listed.size));
                let found = kept.as_ref().and_then(|(file, sum)| open_kept(file, sum, &listed.sha256, listed.size));
                let copy = match found {
                    Some(copy) => copy,
                    None => {
                        let mut copy = self.copy_verified(name, listed)?;
                        if let Some((file, sum)) = &kept {
                            // Best effort: without it, the next process copies again.
                            let _ = keep(&mut copy, file, sum, &listed.sha256);
                        }
                        copy
                    }
                };
                let copy = Arc::new(copy);
                let mut by_content = place.by_content.lock().unwrap_or_else(|p| p.into_inner());
                by_content.retain(|_, weak| weak.strong_count() > 0);
                by_content.insert(key, Arc::downgrade(&copy));
                copy
            }
        };
        held.insert(name.to_owned(), copy.clone());
        Ok(copy)
    }

    /// A new private copy of the listed file `name`, checked as [`Snapshot::private_copy`] says.
    fn copy_verified(&self, name: &str, listed: &ManifestFile) -> Result<PrivateCopy, SnapshotError> {
        let path = self.file(name);
        let place = &self.copies.place;
        let file = self.open_file(name)?;
        // Settled, the verified stamp vouches for the bytes as long as it holds (checked after the copy);
        // otherwise a write in the clock tick of the verification could hide behind it: hash them.
        let mut hasher = (!self.settled).then(Sha256::new);
        if let Some(dir) = &place.dir {
            // Best effort: without it the copy is a memfd.
            let _ = std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir);
        }
        let label = c"strata-snapshot-file";
        let mut hash = |chunk: &[u8]| {
            if let Some(hasher) = &mut hasher {
                hasher.update(chunk);
            }
        };
        let inspect: Option<crate::private_copy::Inspect<'_>> = if self.settled { None } else { Some(&mut hash) };
        let copy =
            PrivateCopy::copy_file(place.dir.as_deref(), label, &file, listed.size, inspect).map_err(|source| {
                match source.kind() {
                    io::ErrorKind::UnexpectedEof | io::ErrorKind::InvalidData => SnapshotError::Changed(path.clone()),
                    _ => SnapshotError::Io { path: path.clone(), source },
                }
            })?;
        match hasher {
            Some(hasher) => {
                if strata_image_util::hex(&hasher.finalize()) != listed.sha256 {
                    return Err(SnapshotError::Checksum(path));
                }
            }
            None => {
                let after = fstat(&file).map_err(errno_error(&path))?;
                if self.stamp_of(name) != Some(&FileStamp::of_stat(&after)) {
                    return Err(SnapshotError::Changed(path));
                }
            }
        }
        Ok(copy)
    }
}

/// Where a trust's key comes from.
enum KeySource {
    Given(SnapshotKey),
    /// `$STRATA_HOME/keys/snapshot.key`, loaded (or created) on first use; a failure is retried next time.
    Home {
        path: PathBuf,
        loaded: Mutex<Option<SnapshotKey>>,
    },
    ProcessLocal,
}

/// What snapshots are trusted by: the key that seals them and the bounds of what is read. The only way to open a
/// snapshot ([`SnapshotTrust::open`]) or to start writing one ([`SnapshotTrust::writer`]). Cheap to clone; the
/// engine gives its tiers one ([`crate::snapshot_key`] for where the key lives).
#[derive(Clone)]
pub struct SnapshotTrust {
    key: Arc<KeySource>,
    bounds: SnapshotBounds,
    copies: CopyPlace,
    /// Where sealed records of verified stamps are kept, if anywhere.
    verified: Option<PathBuf>,
    /// How long before a verification a file must have last changed for its stamp to be recorded.
    settle: Duration,
}

impl std::fmt::Debug for SnapshotTrust {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let key = match &*self.key {
            KeySource::Given(_) => "given".to_owned(),
            KeySource::Home { path, .. } => path.display().to_string(),
            KeySource::ProcessLocal => "process-local".to_owned(),
        };
        f.debug_struct("SnapshotTrust")
            .field("key", &key)
            .field("bounds", &self.bounds)
            .field("verified", &self.verified)
            .finish()
    }
}

impl SnapshotTrust {
    /// Trusts snapshots sealed with `key`.
    pub fn new(key: SnapshotKey) -> SnapshotTrust {
        SnapshotTrust::with_key(KeySource::Given(key), Some(std::env::temp_dir()))
    }

    /// Trusts snapshots sealed with the key of the home `home` ([`crate::snapshot_key::KEY_FILE`] under it,
    /// created on first use), and keeps its records of verified stamps there ([`VERIFIED_DIR`]).
    pub fn in_home(home: &Path) -> SnapshotTrust {
        let path = home.join(crate::snapshot_key::KEY_FILE);
        let mut trust =
            SnapshotTrust::with_key(KeySource::Home { path, loaded: Mutex::new(None) }, Some(home.join(COPIES_DIR)))
                .with_verified_in(home.join(VERIFIED_DIR));
        trust.copies.kept = Some(home.join(KEPT_DIR));
        trust
    }

    /// Trusts snapshots sealed in this process only ([`SnapshotKey::process_local`]).
    pub fn process_local() -> SnapshotTrust {
        SnapshotTrust::with_key(KeySource::ProcessLocal, Some(std::env::temp_dir()))
    }

    fn with_key(key: KeySource, copies: Option<PathBuf>) -> SnapshotTrust {
        let copies = CopyPlace { dir: copies, kept: None, by_content: ByContent::default() };
        SnapshotTrust {
            key: Arc::new(key),
            bounds: SnapshotBounds::default(),
            copies,
            verified: None,
            settle: crate::file_stamp::SETTLE,
        }
    }

    /// The same trust keeping sealed records of verified stamps in `dir` (created, mode 0700, when missing): after
    /// a snapshot's files are hashed in full, the stamps they were verified with ([`FileStamp`]: device, inode,
    /// size, modification and change times), sealed with the key under the manifest's seal; a later open (in any
    /// process) hashes only the files whose stamp, taken through the descriptor it checks, differs from the
    /// record's. A record is written only when every file last changed at least [`crate::file_stamp::SETTLE`]
    /// before the verification (file times are coarse); a record that is not sealed with this key, or names
    /// another manifest, is ignored. `dir` must be the host's (the home's), never a place a sandbox can write.
    pub fn with_verified_in(mut self, dir: PathBuf) -> SnapshotTrust {
        self.verified = Some(dir);
        self
    }

    /// The same trust recording the stamps of files changed as little as `settle` before their verification.
    #[cfg(any(test, feature = "test-utils"))]
    pub fn with_settle(mut self, settle: Duration) -> SnapshotTrust {
        self.settle = settle;
        self
    }

    /// The same trust with other bounds.
    pub fn with_bounds(mut self, bounds: SnapshotBounds) -> SnapshotTrust {
        self.bounds = bounds;
        self
    }

    /// The same trust with the unnamed files of its private copies ([`Snapshot::private_copy`]) made in `dir`
    /// (created when missing) instead of the default: [`COPIES_DIR`] under the home for [`SnapshotTrust::in_home`],
    /// the temporary directory otherwise.
    pub fn with_copies_in(mut self, dir: PathBuf) -> SnapshotTrust {
        self.copies.dir = Some(dir);
        self
    }

    /// The same trust keeping the private copies it makes in `dir` (created, mode 0700, when missing) for later
    /// processes, which then map the kept file instead of copying again (see [`Snapshot::private_copy`];
    /// [`KEPT_DIR`] under the home for [`SnapshotTrust::in_home`]). `dir` must be on the filesystem of the
    /// copies' directory, and the host's alone: whoever can write there can make the host map anything.
    pub fn with_kept_copies_in(mut self, dir: PathBuf) -> SnapshotTrust {
        self.copies.kept = Some(dir);
        self
    }

    /// Its bounds.
    pub fn bounds(&self) -> &SnapshotBounds {
        &self.bounds
    }

    /// The file its key is kept in, when it is a home's: what no sandbox may be granted (a job that can read the
    /// key can seal whatever it likes).
    pub fn key_file(&self) -> Option<&Path> {
        match &*self.key {
            KeySource::Home { path, .. } => Some(path),
            KeySource::Given(_) | KeySource::ProcessLocal => None,
        }
    }

    /// The key (loading or creating a home's key on first use).
    pub fn key(&self) -> Result<SnapshotKey, SnapshotError> {
        match &*self.key {
            KeySource::Given(key) => Ok(key.clone()),
            KeySource::ProcessLocal => SnapshotKey::process_local().map_err(SnapshotError::from),
            KeySource::Home { path, loaded } => {
                let mut loaded = loaded.lock().unwrap_or_else(|e| e.into_inner());
                if let Some(key) = &*loaded {
                    return Ok(key.clone());
                }
                let key = SnapshotKey::load_or_create(path)?;
                *loaded = Some(key.clone());
                Ok(key)
            }
        }
    }

    /// Starts a snapshot at `destination` ([`SnapshotWriter`]).
    pub fn writer(&self, destination: &Path) -> Result<SnapshotWriter, SnapshotError> {
        SnapshotWriter::create(destination, self)
    }

    /// Opens and verifies a snapshot directory: the seal, then the manifest, then that no unlisted file is there,
    /// then every file's size (all of them, from `stat`) and sha256 (reading every byte once, about 1 s per GiB),
    /// but for files that still have the stamp of this trust's record of verified stamps
    /// ([`SnapshotTrust::with_verified_in`]).
    pub fn open(&self, dir: &Path) -> Result<Snapshot, SnapshotError> {
        self.open_checked(dir, None)
    }

    /// [`SnapshotTrust::open`], and the snapshot must belong to `tier` (checked before its files are).
    pub fn open_for(&self, dir: &Path, tier: TierKind) -> Result<Snapshot, SnapshotError> {
        self.open_checked(dir, Some(tier))
    }

    /// The sealed manifest of `dir`, its files not checked (never for restoring).
    pub fn manifest(&self, dir: &Path) -> Result<Manifest, SnapshotError> {
        let root = open_root(dir)?;
        Ok(read_sealed(&root, dir, &self.key()?, &self.bounds)?.0)
    }

    /// `snapshot` as its directory holds it now, for a tier about to fork it: the same sealed manifest (else
    /// [`SnapshotError::Replaced`]), and its files verified again unless each still has the identity, size and
    /// times it was verified with.
    pub fn reopen(&self, snapshot: &Snapshot) -> Result<Snapshot, SnapshotError> {
        let dir = &snapshot.dir;
        let root = open_root(dir)?;
        let key = self.key()?;
        let (manifest, sealed) = read_sealed(&root, dir, &key, &self.bounds)?;
        if manifest != snapshot.manifest {
            return Err(SnapshotError::Replaced(dir.clone()));
        }
        let current: Option<Vec<FileStamp>> = manifest
            .files
            .iter()
            .map(|file| {
                fstatat(&root, file.path.as_str(), AtFlags::AT_SYMLINK_NOFOLLOW).ok().map(|st| FileStamp::of_stat(&st))
            })
            .collect();
        if current.as_ref() == Some(&snapshot.stamps) {
            return Ok(Snapshot { stamps: snapshot.stamps.clone(), hashed: 0, ..snapshot.clone() });
        }
        let (stamps, hashed, settled) = self.verify(&root, dir, &manifest, &sealed, &key)?;
        let copies = Copies::new(&self.copies);
        Ok(Snapshot { tier: manifest.tier, dir: dir.clone(), manifest, stamps, hashed, settled, copies })
    }

    fn open_checked(&self, dir: &Path, tier: Option<TierKind>) -> Result<Snapshot, SnapshotError> {
        let root = open_root(dir)?;
        let key = self.key()?;
        let (manifest, sealed) = read_sealed(&root, dir, &key, &self.bounds)?;
        if let Some(expected) = tier
            && manifest.tier != expected
        {
            return Err(SnapshotError::WrongTier { dir: dir.to_owned(), expected, found: manifest.tier });
        }
        let (stamps, hashed, settled) = self.verify(&root, dir, &manifest, &sealed, &key)?;
        let copies = Copies::new(&self.copies);
        Ok(Snapshot { tier: manifest.tier, dir: dir.to_owned(), manifest, stamps, hashed, settled, copies })
    }

    /// [`verify_files`], sparing the files this trust's record vouches for, and recording the stamps when
    /// something was hashed and every file had settled. Returns the stamps, how many bytes were hashed, and
    /// whether every file had settled.
    fn verify(
        &self,
        root: &OwnedFd,
        dir: &Path,
        manifest: &Manifest,
        sealed: &blake3::Hash,
        key: &SnapshotKey,
    ) -> Result<(Vec<FileStamp>, u64, bool), SnapshotError> {
        let record = self.verified.as_deref();
        let known = record.and_then(|record| read_verified(record, sealed, manifest.files.len(), key));
        let checked = SystemTime::now();
        let (stamps, hashed) = verify_files(root, dir, manifest, &self.bounds, known.as_deref())?;
        let settled = stamps.iter().all(|stamp| stamp.settled(checked, self.settle));
        if let Some(record) = record
            && settled
            && known.as_ref() != Some(&stamps)
        {
            // Best effort: without a record, the next open hashes again.
            let _ = write_verified(record, sealed, &stamps, key);
        }
        Ok((stamps, hashed, settled))
    }
}

/// The record of verified stamps for the manifest sealed `sealed`, from `record`: its seal checked with `key`
/// before anything else of it is believed. `None` when there is none, or it is not one for this manifest and
/// `files` files sealed with this key.
/// The kept copy of the content `sha256` of `size` bytes, and its record, in `dir`.
fn kept_paths(dir: &Path, sha256: &str, size: u64) -> (PathBuf, PathBuf) {
    let mut hasher = blake3::Hasher::new();
    hasher.update(KEPT_TAG.as_bytes());
    hasher.update(&[0]);
    hasher.update(sha256.as_bytes());
    hasher.update(&size.to_le_bytes());
    let key = hasher.finalize().to_hex();
    (dir.join(format!("{key}.image")), dir.join(format!("{key}.image.sum")))
}

/// What a kept copy's record starts with.
const KEPT_TAG: &str = "strata kept snapshot file v1";

/// The kept copy `file` of the content `sha256` of `size` bytes, if its record `sum` (`sha256 HEX LEN` and
/// `stamp …`, at most 4 KiB read) names that content and the file still has the stamp it was kept with.
fn open_kept(file: &Path, sum: &Path, sha256: &str, size: u64) -> Option<PrivateCopy> {
    let record = File::options().read(true).custom_flags(READ_FLAGS.bits()).open(sum).ok()?;
    let meta = record.metadata().ok()?;
    if !meta.is_file() || meta.len() > 4096 {
        return None;
    }
    let mut text = String::new();
    (&record).take(4096).read_to_string(&mut text).ok()?;
    let mut lines = text.lines();
    if lines.next()? != format!("sha256 {sha256} {size}") {
        return None;
    }
    let stamp = FileStamp::parse(lines.next()?.strip_prefix("stamp ")?)?;
    let copy = PrivateCopy::open_kept(file, size, &stamp)?;
    record_use(&record, &meta);
    Some(copy)
}

/// Keeps `copy` (of the content `sha256`) at `file` and records it in `sum`, written to a temporary and renamed
/// into place after the file is.
fn keep(copy: &mut PrivateCopy, file: &Path, sum: &Path, sha256: &str) -> io::Result<()> {
    let dir = file.parent().ok_or_else(|| io::Error::other("a kept copy needs a directory"))?;
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir)?;
    let stamp = copy.keep(file)?;
    let text = format!("sha256 {sha256} {}\nstamp {}\n", copy.len(), stamp.render());
    let name = sum.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let temporary = crate::private_copy::temporary_beside(dir, &name);
    replace_file(&temporary, sum, text.as_bytes())
}

/// Writes `text` (synced) to the new file `temporary` (mode 0600, never through a link) and renames it to `path`;
/// the temporary is removed if anything fails.
fn replace_file(temporary: &Path, path: &Path, text: &[u8]) -> io::Result<()> {
    let written = File::options()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(OFlag::O_NOFOLLOW.bits())
        .open(temporary)
        .and_then(|mut file| file.write_all(text).and_then(|()| file.sync_data()))
        .and_then(|()| std::fs::rename(temporary, path));
    if written.is_err() {
        let _ = std::fs::remove_file(temporary);
    }
    written
}

/// Records a use of a kept copy for `strata images prune`'s least-recently-used order: its record's modification
/// time, set at most once an hour.
fn record_use(record: &File, meta: &std::fs::Metadata) {
    let now = SystemTime::now();
    let recent = meta.modified().ok().and_then(|t| now.duration_since(t).ok()).is_some_and(|age| age.as_secs() < 3600);
    if !recent {
        // The owner may set a file's times through a read-only descriptor.
        let _ = record.set_modified(now);
    }
}

fn read_verified(record: &Path, sealed: &blake3::Hash, files: usize, key: &SnapshotKey) -> Option<Vec<FileStamp>> {
    let max = 256 + 128 * u64::try_from(files).ok()?;
    let file = File::options()
        .read(true)
        .custom_flags((OFlag::O_NOFOLLOW | OFlag::O_NONBLOCK).bits())
        .open(record.join(sealed.to_hex().as_str()))
        .ok()?;
    let meta = file.metadata().ok()?;
    if !meta.is_file() || meta.len() > max {
        return None;
    }
    let mut text = String::new();
    file.take(max + 1).read_to_string(&mut text).ok()?;
    let (body, seal) = text.split_at(text.rfind("\nseal ")? + 1);
    let given = blake3::Hash::from_hex(seal.strip_prefix("seal ")?.strip_suffix('\n')?).ok()?;
    // blake3::Hash compares in constant time.
    if key.seal_stamps(body.as_bytes()) != given {
        return None;
    }
    let mut lines = body.lines();
    if lines.next()? != VERIFIED_TAG || lines.next()? != format!("manifest {}", sealed.to_hex()) {
        return None;
    }
    let stamps: Vec<FileStamp> = lines.map(FileStamp::parse).collect::<Option<_>>()?;
    (stamps.len() == files).then_some(stamps)
}

/// Writes (replaces) the record of the stamps the files of the manifest sealed `sealed` were verified with.
fn write_verified(record: &Path, sealed: &blake3::Hash, stamps: &[FileStamp], key: &SnapshotKey) -> io::Result<()> {
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(record)?;
    let mut body = format!("{VERIFIED_TAG}\nmanifest {}\n", sealed.to_hex());
    for stamp in stamps {
        body.push_str(&stamp.render());
        body.push('\n');
    }
    let text = format!("{body}seal {}\n", key.seal_stamps(body.as_bytes()).to_hex());
    let path = record.join(sealed.to_hex().as_str());
    let temporary = record.join(format!(".{}.{}.{}.tmp", sealed.to_hex(), std::process::id(), random_hex(4)));
    replace_file(&temporary, &path, text.as_bytes())
}

/// Opens a snapshot directory (the path itself may be a link; nothing below it is followed).
fn open_root(dir: &Path) -> Result<OwnedFd, SnapshotError> {
    match nix::fcntl::open(dir, OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC, Mode::empty()) {
        Ok(fd) => Ok(fd),
        Err(Errno::ENOTDIR) => Err(SnapshotError::NotASnapshot(dir.to_owned())),
        Err(errno) => Err(errno_error(dir)(errno)),
    }
}

/// Flags of every file this module reads: never through a link, never blocking (a FIFO), never a terminal.
const READ_FLAGS: OFlag =
    OFlag::O_RDONLY.union(OFlag::O_NOFOLLOW).union(OFlag::O_NONBLOCK).union(OFlag::O_NOCTTY).union(OFlag::O_CLOEXEC);

/// The file `rel` (a plain relative path) below `root`, which `lstat` says is a regular file before it is opened
/// (nothing else is ever opened) and `fstat` confirms is the same one after.
fn open_regular(root: &OwnedFd, dir: &Path, rel: &str) -> Result<(File, FileStat), SnapshotError> {
    let path = dir.join(rel);
    let not_regular =
        || SnapshotError::UnsafePath { dir: dir.to_owned(), path: rel.to_owned(), reason: "not a regular file" };
    let (parent, name) = match rel.rsplit_once('/') {
        Some((parent, name)) => (Some(parent), name),
        None => (None, rel),
    };
    let opened = match parent {
        Some(parent) => dirfd::open_beneath(root, Path::new(parent)),
        None => nix::unistd::dup(root),
    };
    let parent_fd = match opened {
        Ok(fd) => fd,
        Err(Errno::ENOENT) => return Err(SnapshotError::MissingFile(path)),
        Err(Errno::ELOOP | Errno::ENOTDIR) => return Err(not_regular()),
        Err(errno) => return Err(errno_error(&path)(errno)),
    };
    let before = match fstatat(&parent_fd, name, AtFlags::AT_SYMLINK_NOFOLLOW) {
        Ok(st) => st,
        Err(Errno::ENOENT) => return Err(SnapshotError::MissingFile(path)),
        Err(errno) => return Err(errno_error(&path)(errno)),
    };
    if dirfd::kind_of(&before) != SFlag::S_IFREG {
        return Err(not_regular());
    }
    let fd = match openat(&parent_fd, name, READ_FLAGS, Mode::empty()) {
        Ok(fd) => fd,
        Err(Errno::ENOENT) => return Err(SnapshotError::MissingFile(path)),
        Err(Errno::ELOOP) => return Err(not_regular()),
        Err(errno) => return Err(errno_error(&path)(errno)),
    };
    let st = fstat(&fd).map_err(errno_error(&path))?;
    if dirfd::kind_of(&st) != SFlag::S_IFREG || (st.st_dev, st.st_ino) != (before.st_dev, before.st_ino) {
        return Err(SnapshotError::Changed(path));
    }
    Ok((File::from(fd), st))
}

/// A small file of the snapshot's own (the manifest, the seal): at most `max` bytes, else `TooLarge` before
/// it is read. `None` when it does not exist.
fn read_small(root: &OwnedFd, dir: &Path, name: &str, max: u64) -> Result<Option<Vec<u8>>, SnapshotError> {
    let (file, st) = match open_regular(root, dir, name) {
        Ok(opened) => opened,
        Err(SnapshotError::MissingFile(_)) => return Ok(None),
        Err(err) => return Err(err),
    };
    let path = dir.join(name);
    let size = u64::try_from(st.st_size).unwrap_or(u64::MAX);
    if size > max {
        return Err(too_large(&path, format!("{size} bytes; a snapshot's {name} is at most {max}")));
    }
    let mut bytes = Vec::with_capacity(usize::try_from(size).unwrap_or(0));
    file.take(max + 1).read_to_end(&mut bytes).map_err(io_error(&path))?;
    if bytes.len() as u64 > max {
        return Err(too_large(&path, format!("more than {max} bytes")));
    }
    Ok(Some(bytes))
}

/// The seal file's text for a MAC.
fn seal_text(mac: &blake3::Hash) -> String {
    format!("{SEAL_TAG}{}\n", mac.to_hex())
}

/// Reads the seal and the manifest's bytes, checks the MAC, and only then parses and checks the manifest.
/// Returns it with its seal.
fn read_sealed(
    root: &OwnedFd,
    dir: &Path,
    key: &SnapshotKey,
    bounds: &SnapshotBounds,
) -> Result<(Manifest, blake3::Hash), SnapshotError> {
    let seal = read_small(root, dir, SEAL, MAX_SEAL_BYTES)?;
    let bytes = read_small(root, dir, MANIFEST, MAX_MANIFEST_BYTES)?;
    let (seal, bytes) = match (seal, bytes) {
        (_, None) => return Err(SnapshotError::NotASnapshot(dir.to_owned())),
        (None, Some(_)) => return Err(SnapshotError::Unsealed(dir.to_owned())),
        (Some(seal), Some(bytes)) => (seal, bytes),
    };
    let given = std::str::from_utf8(&seal)
        .ok()
        .and_then(|text| text.strip_prefix(SEAL_TAG))
        .and_then(|text| text.strip_suffix('\n'))
        .and_then(|hex| blake3::Hash::from_hex(hex).ok())
        .ok_or_else(|| SnapshotError::Seal(dir.to_owned()))?;
    // blake3::Hash compares in constant time.
    if key.seal(&bytes) != given {
        return Err(SnapshotError::Seal(dir.to_owned()));
    }
    Ok((parse_manifest(dir, &bytes, bounds)?, given))
}

/// Parses a sealed manifest's bytes and checks everything it says against itself and `bounds`.
fn parse_manifest(dir: &Path, text: &[u8], bounds: &SnapshotBounds) -> Result<Manifest, SnapshotError> {
    let invalid = |message: String| SnapshotError::InvalidManifest { dir: dir.to_owned(), message };
    // The format is checked before the shape, so a manifest of a newer format is reported as such.
    let value: serde_json::Value = serde_json::from_slice(text).map_err(|e| invalid(e.to_string()))?;
    let found = value.get("format").and_then(serde_json::Value::as_u64);
    match found {
        Some(found) if found == u64::from(FORMAT_VERSION) => {}
        Some(found) => {
            return Err(SnapshotError::FormatVersion {
                dir: dir.to_owned(),
                found: u32::try_from(found).unwrap_or(u32::MAX),
                supported: FORMAT_VERSION,
            });
        }
        None => return Err(invalid("no \"format\" number".into())),
    }
    let manifest: Manifest = serde_json::from_value(value).map_err(|e| invalid(e.to_string()))?;
    if manifest.files.len() > bounds.max_files {
        return Err(too_large(dir, format!("{} files (at most {})", manifest.files.len(), bounds.max_files)));
    }
    let mut seen = HashSet::new();
    let mut total: u64 = 0;
    for file in &manifest.files {
        check_relative(dir, &file.path)?;
        if file.path == MANIFEST || file.path == SEAL {
            return Err(invalid(format!("lists {} itself", file.path)));
        }
        if !seen.insert(file.path.as_str()) {
            return Err(invalid(format!("lists {:?} twice", file.path)));
        }
        if file.sha256.len() != 64 || !file.sha256.bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()) {
            return Err(invalid(format!("the sha256 of {:?} is not 64 lower-case hex digits", file.path)));
        }
        if file.size > bounds.max_file_bytes {
            return Err(too_large(
                &dir.join(&file.path),
                format!("{} bytes (a snapshot file is at most {})", file.size, bounds.max_file_bytes),
            ));
        }
        total = total.checked_add(file.size).ok_or_else(|| invalid("sizes overflow".into()))?;
    }
    if total != manifest.total_bytes {
        return Err(invalid(format!("total_bytes is {} but the files add up to {total}", manifest.total_bytes)));
    }
    if total > bounds.max_total_bytes {
        return Err(too_large(dir, format!("{total} bytes in all (at most {})", bounds.max_total_bytes)));
    }
    if !manifest.meta.is_object() {
        return Err(invalid("meta is not a JSON object".into()));
    }
    Ok(manifest)
}

/// A manifest path must be plain: relative, `/`-separated normal components, nothing empty, no NUL.
fn check_relative(dir: &Path, path: &str) -> Result<(), SnapshotError> {
    let unsafe_path = |reason| SnapshotError::UnsafePath { dir: dir.to_owned(), path: path.to_owned(), reason };
    if path.is_empty() || path.len() > 4096 || path.contains('\0') || path.contains('\\') {
        return Err(unsafe_path("empty, over-long, or contains NUL or a backslash"));
    }
    if path.split('/').any(|part| part.is_empty() || part == "." || part == "..") {
        return Err(unsafe_path("not a plain relative path"));
    }
    if !Path::new(path).components().all(|c| matches!(c, Component::Normal(_))) {
        return Err(unsafe_path("not a plain relative path"));
    }
    Ok(())
}

/// Checks the directory against the sealed manifest, bounded before the work is done: no unlisted entry (the
/// walk stops at the bounds), every listed file regular and of its sealed size (all from `lstat`, before any
/// byte is hashed), then every file's sha256 through the descriptor that was checked, unless that descriptor's
/// stamp is the one `known` has for it (a sealed record of a verification). Returns the stamps the files were
/// verified with and how many bytes were hashed.
fn verify_files(
    root: &OwnedFd,
    dir: &Path,
    manifest: &Manifest,
    bounds: &SnapshotBounds,
    known: Option<&[FileStamp]>,
) -> Result<(Vec<FileStamp>, u64), SnapshotError> {
    let listed: HashSet<&str> = manifest.files.iter().map(|f| f.path.as_str()).collect();
    for relative in walk(root, dir, bounds)? {
        if relative != MANIFEST && relative != SEAL && !listed.contains(relative.as_str()) {
            return Err(SnapshotError::UnlistedFile(dir.join(relative)));
        }
    }
    for file in &manifest.files {
        let st = match fstatat(root, file.path.as_str(), AtFlags::AT_SYMLINK_NOFOLLOW) {
            Ok(st) => st,
            Err(Errno::ENOENT) => return Err(SnapshotError::MissingFile(dir.join(&file.path))),
            // A component that is a link or not a directory: `open_regular` says which below.
            Err(_) => continue,
        };
        if dirfd::kind_of(&st) != SFlag::S_IFREG {
            return Err(SnapshotError::UnsafePath {
                dir: dir.to_owned(),
                path: file.path.clone(),
                reason: "not a regular file",
            });
        }
        let found = u64::try_from(st.st_size).unwrap_or(u64::MAX);
        if found != file.size {
            return Err(SnapshotError::SizeMismatch { path: dir.join(&file.path), expected: file.size, found });
        }
    }
    let mut stamps = Vec::with_capacity(manifest.files.len());
    let mut hashed = 0u64;
    for (index, file) in manifest.files.iter().enumerate() {
        let path = dir.join(&file.path);
        let (opened, before) = open_regular(root, dir, &file.path)?;
        let found = u64::try_from(before.st_size).unwrap_or(u64::MAX);
        if found != file.size {
            return Err(SnapshotError::SizeMismatch { path, expected: file.size, found });
        }
        let stamp = FileStamp::of_stat(&before);
        if known.and_then(|known| known.get(index)) == Some(&stamp) {
            stamps.push(stamp);
            continue;
        }
        hashed = hashed.saturating_add(file.size);
        let (read, sum) = sha256_of(opened, file.size).map_err(io_error(&path))?;
        if read != file.size {
            return Err(SnapshotError::SizeMismatch { path, expected: file.size, found: read });
        }
        if sum != file.sha256 {
            return Err(SnapshotError::Checksum(path));
        }
        let after = fstatat(root, file.path.as_str(), AtFlags::AT_SYMLINK_NOFOLLOW).map_err(errno_error(&path))?;
        if FileStamp::of_stat(&after) != FileStamp::of_stat(&before) {
            return Err(SnapshotError::Changed(path));
        }
        stamps.push(stamp);
    }
    Ok((stamps, hashed))
}

/// The sha256 of at most `size + 1` bytes of `file`, and how many there were.
fn sha256_of(file: File, size: u64) -> io::Result<(u64, String)> {
    let mut hasher = Sha256::new();
    let mut input = file.take(size.saturating_add(1));
    let mut buf = vec![0u8; 1 << 20];
    let mut read = 0u64;
    loop {
        let n = match input.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(err) if err.kind() == io::ErrorKind::Interrupted => continue,
            Err(err) => return Err(err),
        };
        hasher.update(&buf[..n]);
        read += n as u64;
    }
    Ok((read, strata_image_util::hex(&hasher.finalize())))
}

/// Every non-directory under `root`, as `/`-separated relative paths; links are reported, never followed. Stops
/// as soon as the bounds are passed (more non-directories than the manifest may list, more directories, deeper
/// levels), so a directory bomb costs what the bounds allow and no more.
fn walk(root: &OwnedFd, dir: &Path, bounds: &SnapshotBounds) -> Result<Vec<String>, SnapshotError> {
    let mut found = Vec::new();
    let mut dirs = 0usize;
    let mut pending = vec![(nix::unistd::dup(root).map_err(errno_error(dir))?, String::new(), 0usize)];
    while let Some((fd, prefix, depth)) = pending.pop() {
        let here = dir.join(&prefix);
        let parent = nix::unistd::dup(&fd).map_err(errno_error(&here))?;
        let mut listing = nix::dir::Dir::from_fd(fd).map_err(errno_error(&here))?;
        let mut subdirs = Vec::new();
        for entry in listing.iter() {
            let entry = entry.map_err(errno_error(&here))?;
            let bytes = entry.file_name().to_bytes();
            if bytes == b"." || bytes == b".." {
                continue;
            }
            let name = std::str::from_utf8(bytes).map_err(|_| SnapshotError::UnsafePath {
                dir: dir.to_owned(),
                path: String::from_utf8_lossy(bytes).into_owned(),
                reason: "not UTF-8",
            })?;
            let relative = if prefix.is_empty() { name.to_owned() } else { format!("{prefix}/{name}") };
            let is_dir = match entry.file_type() {
                Some(nix::dir::Type::Directory) => true,
                Some(_) => false,
                None => fstatat(&parent, name, AtFlags::AT_SYMLINK_NOFOLLOW)
                    .map(|st| dirfd::kind_of(&st) == SFlag::S_IFDIR)
                    .unwrap_or(false),
            };
            if is_dir {
                dirs += 1;
                if dirs > bounds.max_dirs {
                    return Err(too_large(dir, format!("more than {} directories", bounds.max_dirs)));
                }
                if depth + 1 > bounds.max_depth {
                    return Err(too_large(dir, format!("directories nested deeper than {}", bounds.max_depth)));
                }
                subdirs.push((name.to_owned(), relative));
            } else {
                found.push(relative);
                // The manifest and its seal besides the files.
                if found.len() > bounds.max_files + 2 {
                    return Err(too_large(dir, format!("more than {} files", bounds.max_files)));
                }
            }
        }
        for (name, relative) in subdirs {
            let child = match openat(&parent, name.as_str(), dirfd::DIR_FLAGS, Mode::empty()) {
                Ok(child) => child,
                // Replaced meanwhile by something that is not a directory: reported as a file.
                Err(Errno::ENOTDIR | Errno::ELOOP) => {
                    found.push(relative);
                    continue;
                }
                Err(errno) => return Err(errno_error(&dir.join(&relative))(errno)),
            };
            pending.push((child, relative, depth + 1));
        }
    }
    Ok(found)
}

/// Writes a snapshot directory atomically: files go into [`SnapshotWriter::dir`], [`SnapshotWriter::commit`]
/// seals them under a manifest and renames the directory into place. Dropped without committing, it removes what
/// was written.
#[derive(Debug)]
pub struct SnapshotWriter {
    destination: PathBuf,
    staging: PathBuf,
    key: SnapshotKey,
    bounds: SnapshotBounds,
    copies: CopyPlace,
    committed: bool,
}

impl SnapshotWriter {
    /// Starts a snapshot that will be at `destination` (which must not exist; its parent must), sealed with
    /// `trust`'s key. Staging directories of writers that died in the same parent are removed first.
    pub fn create(destination: &Path, trust: &SnapshotTrust) -> Result<SnapshotWriter, SnapshotError> {
        if std::fs::symlink_metadata(destination).is_ok() {
            return Err(SnapshotError::Exists(destination.to_owned()));
        }
        let key = trust.key()?;
        let name = destination
            .file_name()
            .ok_or_else(|| SnapshotError::Io {
                path: destination.to_owned(),
                source: io::Error::new(io::ErrorKind::InvalidInput, "a snapshot path needs a final name"),
            })?
            .to_string_lossy()
            .into_owned();
        let parent = match destination.parent() {
            Some(parent) if !parent.as_os_str().is_empty() => parent.to_owned(),
            _ => PathBuf::from("."),
        };
        sweep_partials(&parent);
        let staging = parent.join(format!(".{name}.partial-{}-{}", std::process::id(), random_hex(4)));
        std::fs::DirBuilder::new().mode(0o700).create(&staging).map_err(io_error(&staging))?;
        Ok(SnapshotWriter {
            destination: destination.to_owned(),
            staging,
            key,
            bounds: *trust.bounds(),
            copies: trust.copies.clone(),
            committed: false,
        })
    }

    /// Where the tier writes its files.
    pub fn dir(&self) -> &Path {
        &self.staging
    }

    /// Hashes every file the tier wrote (within the bounds, checked from `stat` first), writes the manifest and
    /// its seal, syncs and renames the directory into place.
    pub fn commit(
        self,
        tier: TierKind,
        parent: Option<String>,
        persists: Vec<Persisted>,
        meta: serde_json::Value,
    ) -> Result<Snapshot, SnapshotError> {
        self.seal_files(tier, parent, persists, meta, None)
    }

    /// Commits files received from elsewhere (another node of a fleet) as a copy of the snapshot `source`
    /// describes ([`Manifest::parse_received`]): the same tier, parent, state and meta, sealed with this host's key
    /// under a new id, if the directory holds exactly `source`'s files — the same names, sizes and sha256. Any
    /// difference is refused before anything is sealed, and the writer's files are removed.
    pub fn commit_copy(self, source: &Manifest) -> Result<Snapshot, SnapshotError> {
        self.seal_files(
            source.tier,
            source.parent.clone(),
            source.persists.clone(),
            source.meta.clone(),
            Some(&source.files),
        )
    }

    fn seal_files(
        mut self,
        tier: TierKind,
        parent: Option<String>,
        persists: Vec<Persisted>,
        meta: serde_json::Value,
        expected: Option<&[ManifestFile]>,
    ) -> Result<Snapshot, SnapshotError> {
        let staging = self.staging.clone();
        let root = open_root(&staging)?;
        let mut names = walk(&root, &staging, &self.bounds)?;
        names.sort();
        if names.len() > self.bounds.max_files {
            return Err(too_large(&staging, format!("{} files (at most {})", names.len(), self.bounds.max_files)));
        }
        let mut total = 0u64;
        for name in &names {
            check_relative(&staging, name)?;
            if name == MANIFEST || name == SEAL {
                return Err(SnapshotError::UnsafePath {
                    dir: staging,
                    path: name.clone(),
                    reason: "the tier's files may not be named like the manifest or its seal",
                });
            }
            let path = staging.join(name);
            let st = fstatat(&root, name.as_str(), AtFlags::AT_SYMLINK_NOFOLLOW).map_err(errno_error(&path))?;
            if dirfd::kind_of(&st) != SFlag::S_IFREG {
                return Err(SnapshotError::UnsafePath {
                    dir: staging,
                    path: name.clone(),
                    reason: "not a regular file",
                });
            }
            let size = u64::try_from(st.st_size).unwrap_or(u64::MAX);
            if size > self.bounds.max_file_bytes {
                return Err(too_large(
                    &path,
                    format!("{size} bytes (a snapshot file is at most {})", self.bounds.max_file_bytes),
                ));
            }
            total = total.saturating_add(size);
            if total > self.bounds.max_total_bytes {
                return Err(too_large(&staging, format!("more than {} bytes in all", self.bounds.max_total_bytes)));
            }
        }
        let mut files = Vec::with_capacity(names.len());
        let mut stamps = Vec::with_capacity(names.len());
        for name in names {
            let path = staging.join(&name);
            let (file, st) = open_regular(&root, &staging, &name)?;
            file.sync_all().map_err(io_error(&path))?;
            let size = u64::try_from(st.st_size).unwrap_or(u64::MAX);
            let (read, sha256) = sha256_of(file, size).map_err(io_error(&path))?;
            let after = fstatat(&root, name.as_str(), AtFlags::AT_SYMLINK_NOFOLLOW).map_err(errno_error(&path))?;
            if read != size || FileStamp::of_stat(&after) != FileStamp::of_stat(&st) {
                return Err(SnapshotError::Changed(path));
            }
            files.push(ManifestFile { path: name, size, sha256 });
            stamps.push(FileStamp::of_stat(&st));
        }
        if let Some(expected) = expected {
            let mut wanted = expected.to_vec();
            wanted.sort_by(|a, b| a.path.cmp(&b.path));
            for (got, want) in files.iter().zip(&wanted) {
                let path = staging.join(&want.path);
                if got.path != want.path {
                    return Err(SnapshotError::MissingFile(path));
                }
                if got.size != want.size {
                    return Err(SnapshotError::SizeMismatch { path, expected: want.size, found: got.size });
                }
                if got.sha256 != want.sha256 {
                    return Err(SnapshotError::Checksum(path));
                }
            }
            match files.len().cmp(&wanted.len()) {
                std::cmp::Ordering::Less => {
                    return Err(SnapshotError::MissingFile(staging.join(&wanted[files.len()].path)));
                }
                std::cmp::Ordering::Greater => {
                    return Err(SnapshotError::UnlistedFile(staging.join(&files[wanted.len()].path)));
                }
                std::cmp::Ordering::Equal => {}
            }
        }
        let mut persists = persists;
        persists.sort();
        persists.dedup();
        let manifest = Manifest {
            format: FORMAT_VERSION,
            strata: env!("CARGO_PKG_VERSION").to_owned(),
            tier,
            id: random_hex(16),
            parent,
            created: strata_image_util::rfc3339_now(),
            persists,
            total_bytes: files.iter().map(|f| f.size).sum(),
            files,
            meta: if meta.is_object() { meta } else { serde_json::json!({ "value": meta }) },
        };
        let path = staging.join(MANIFEST);
        let mut text = serde_json::to_vec_pretty(&manifest)
            .map_err(|e| SnapshotError::Io { path: path.clone(), source: io::Error::other(e) })?;
        text.push(b'\n');
        if text.len() as u64 > MAX_MANIFEST_BYTES {
            return Err(too_large(&path, format!("{} bytes (at most {MAX_MANIFEST_BYTES})", text.len())));
        }
        // Both written before either is synced: one journal commit then takes both files' blocks.
        let seal_path = staging.join(SEAL);
        let manifest_file = write_new(&path, &text)?;
        let seal_file = write_new(&seal_path, seal_text(&self.key.seal(&text)).as_bytes())?;
        manifest_file.sync_all().map_err(io_error(&path))?;
        seal_file.sync_all().map_err(io_error(&seal_path))?;
        sync_dir(&staging)?;
        // A plain rename(2) onto a path that appeared meanwhile would replace an empty directory: refuse it instead.
        nix::fcntl::renameat2(
            nix::fcntl::AT_FDCWD,
            &staging,
            nix::fcntl::AT_FDCWD,
            &self.destination,
            nix::fcntl::RenameFlags::RENAME_NOREPLACE,
        )
        .map_err(|errno| match errno {
            Errno::EEXIST => SnapshotError::Exists(self.destination.clone()),
            errno => SnapshotError::Io { path: self.destination.clone(), source: errno.into() },
        })?;
        self.committed = true;
        if let Some(parent) = self.destination.parent().filter(|p| !p.as_os_str().is_empty()) {
            sync_dir(parent)?;
        }
        let hashed = manifest.total_bytes;
        let copies = Copies::new(&self.copies);
        Ok(Snapshot { tier, dir: self.destination.clone(), manifest, stamps, hashed, settled: false, copies })
    }
}

impl Drop for SnapshotWriter {
    fn drop(&mut self) {
        if !self.committed {
            let _ = std::fs::remove_dir_all(&self.staging);
        }
    }
}

/// Writes a new file (never through a link, never over one that exists) and syncs it.
/// Creates `path` (never through a link, never over a file) with `bytes`; the caller syncs it.
fn write_new(path: &Path, bytes: &[u8]) -> Result<File, SnapshotError> {
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o644)
        .custom_flags(OFlag::O_NOFOLLOW.bits())
        .open(path)
        .map_err(io_error(path))?;
    file.write_all(bytes).map_err(io_error(path))?;
    Ok(file)
}

fn sync_dir(dir: &Path) -> Result<(), SnapshotError> {
    File::open(dir).and_then(|d| d.sync_all()).map_err(io_error(dir))
}

/// The PID in a staging directory's name (`.NAME.partial-PID-RAND`, RAND 8 hex digits).
fn partial_pid(name: &str) -> Option<u32> {
    let (_, tail) = name.strip_prefix('.')?.rsplit_once(".partial-")?;
    let (pid, random) = tail.split_once('-')?;
    if random.len() != 8 || !random.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    pid.parse().ok()
}

/// Removes from `dir` the staging directories of writers whose process is gone (killed before they committed);
/// returns how many went. Never follows a link; looks at the first 65536 entries at most. Nothing opens a staging
/// directory as a snapshot by its name (and one that opens passed every check a snapshot does), so this only
/// reclaims space.
pub fn sweep_partials(dir: &Path) -> usize {
    let Ok(root) = nix::fcntl::open(dir, OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC, Mode::empty()) else {
        return 0;
    };
    let Ok(listing_fd) = nix::unistd::dup(&root) else { return 0 };
    let Ok(mut listing) = nix::dir::Dir::from_fd(listing_fd) else { return 0 };
    let me = std::process::id();
    let mut stale = Vec::new();
    for entry in listing.iter().take(MAX_SWEEP_ENTRIES).flatten() {
        let Ok(name) = entry.file_name().to_str() else { continue };
        if let Some(pid) = partial_pid(name)
            && pid != me
            && !Path::new(&format!("/proc/{pid}")).exists()
        {
            stale.push(name.to_owned());
        }
    }
    stale.iter().filter(|name| dirfd::remove_at(&root, name.as_str()).is_ok_and(|n| n > 0)).count()
}

/// For tests and fuzz targets: what only the key's holder can do.
#[cfg(any(test, feature = "test-utils"))]
pub mod test_utils {
    use super::*;

    /// Writes `manifest` as the manifest of `dir` (replacing it) and seals it with `key`: a manifest that says
    /// whatever the test needs and still passes the seal.
    pub fn seal(dir: &Path, key: &SnapshotKey, manifest: &[u8]) -> io::Result<()> {
        std::fs::write(dir.join(MANIFEST), manifest)?;
        std::fs::write(dir.join(SEAL), seal_text(&key.seal(manifest)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    fn write(dir: &Path, name: &str, data: &[u8]) {
        let path = dir.join(name);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).expect("mkdir");
        }
        std::fs::write(path, data).expect("write");
    }

    fn trust() -> SnapshotTrust {
        SnapshotTrust::new(SnapshotKey::from_bytes([7; 32]))
    }

    fn snapshot(root: &Path, trust: &SnapshotTrust) -> Snapshot {
        let writer = trust.writer(&root.join("snap")).expect("create");
        write(writer.dir(), "memory", &[7u8; 10_000]);
        write(writer.dir(), "fs/upper.tar", b"tar bytes");
        writer
            .commit(
                TierKind::Process,
                None,
                vec![Persisted::Filesystem, Persisted::Memory],
                serde_json::json!({"k": 1}),
            )
            .expect("commit")
    }

    fn refused(dir: &Path) -> SnapshotError {
        trust().open(dir).expect_err("refused")
    }

    #[test]
    fn a_committed_snapshot_opens_in_place_with_its_manifest() {
        let root = tempfile::tempdir().expect("tempdir");
        let made = snapshot(root.path(), &trust());
        let opened = trust().open_for(&root.path().join("snap"), TierKind::Process).expect("open");
        assert_eq!(opened, made);
        assert_eq!(opened.manifest.format, 2);
        assert_eq!(opened.manifest.total_bytes, 10_009);
        assert_eq!(
            opened.manifest.files.iter().map(|f| f.path.as_str()).collect::<Vec<_>>(),
            ["fs/upper.tar", "memory"]
        );
        assert_eq!(opened.manifest.persists, [Persisted::Memory, Persisted::Filesystem]);
        assert_eq!(opened.manifest.id.len(), 32);
        assert_eq!(opened.read_file("fs/upper.tar", 100).expect("read"), b"tar bytes");
        assert_eq!(opened.read_file("memory", 100).expect_err("over max").code(), "snapshot_too_large");
        // Nothing but the snapshot is left in the parent directory.
        let names: Vec<_> =
            std::fs::read_dir(root.path()).expect("ls").map(|e| e.expect("entry").file_name()).collect();
        assert_eq!(names, ["snap"]);
        let err = trust().writer(&root.path().join("snap")).expect_err("exists");
        assert_eq!(err.code(), "snapshot_exists");
    }

    #[test]
    fn a_copy_is_sealed_here_only_when_its_files_are_exactly_the_manifests() {
        let from = tempfile::tempdir().expect("tempdir");
        let source = snapshot(from.path(), &trust());
        let sent = source.manifest.to_json();
        let here = tempfile::tempdir().expect("tempdir");
        let received =
            Manifest::parse_received(Path::new("n1:snap"), &sent, &SnapshotBounds::default()).expect("parse");
        assert_eq!(received, source.manifest);
        // Another host's key: the copy is sealed with it, and opens there.
        let other = SnapshotTrust::new(SnapshotKey::from_bytes([9; 32]));
        let copy_files = |dir: &Path, damage: Option<(&str, &[u8])>| {
            for file in &received.files {
                let bytes = std::fs::read(source.file(&file.path)).expect("read");
                let bytes = match damage {
                    Some((name, replacement)) if name == file.path => replacement.to_vec(),
                    _ => bytes,
                };
                write(dir, &file.path, &bytes);
            }
        };
        // One file altered (same size), one truncated, one missing, one extra: each refused, nothing left behind.
        let memory_altered = [8u8; 10_000];
        type Fill<'a> = Box<dyn Fn(&Path) + 'a>;
        let cases: [(&str, Fill); 4] = [
            ("altered", Box::new(|dir: &Path| copy_files(dir, Some(("memory", &memory_altered))))),
            ("truncated", Box::new(|dir: &Path| copy_files(dir, Some(("memory", &[7u8; 10]))))),
            ("missing", Box::new(|dir: &Path| write(dir, "memory", &[7u8; 10_000]))),
            (
                "extra",
                Box::new(|dir: &Path| {
                    copy_files(dir, None);
                    write(dir, "zz-extra", b"x");
                }),
            ),
        ];
        for (what, fill) in cases {
            let writer = other.writer(&here.path().join(what)).expect("writer");
            fill(writer.dir());
            let err = writer.commit_copy(&received).expect_err(what);
            assert_eq!(err.code(), "snapshot_invalid", "{what}: {err}");
            assert!(std::fs::read_dir(here.path()).expect("list").next().is_none(), "{what} left files");
        }
        let writer = other.writer(&here.path().join("copy")).expect("writer");
        copy_files(writer.dir(), None);
        let copy = writer.commit_copy(&received).expect("an exact copy");
        assert_eq!(
            (copy.tier, &copy.manifest.files, &copy.manifest.meta),
            (source.tier, &source.manifest.files, &source.manifest.meta)
        );
        assert_ne!(copy.manifest.id, source.manifest.id);
        other.open(&here.path().join("copy")).expect("the copy opens under this host's key");
        // A manifest whose shape is wrong is refused before any file is fetched.
        let mut bad = source.manifest.clone();
        bad.files[0].path = "../escape".into();
        bad.total_bytes = bad.files.iter().map(|f| f.size).sum();
        assert!(Manifest::parse_received(Path::new("n1"), &bad.to_json(), &SnapshotBounds::default()).is_err());
        let tight = SnapshotBounds { max_total_bytes: 100, ..SnapshotBounds::default() };
        assert_eq!(
            Manifest::parse_received(Path::new("n1"), &sent, &tight).expect_err("bounds").code(),
            "snapshot_too_large"
        );
        assert!(
            Manifest::parse_received(Path::new("n1"), &vec![b' '; (1 << 20) + 1], &SnapshotBounds::default()).is_err()
        );
    }

    #[test]
    fn an_abandoned_writer_leaves_nothing() {
        let root = tempfile::tempdir().expect("tempdir");
        let writer = trust().writer(&root.path().join("snap")).expect("create");
        write(writer.dir(), "memory", b"x");
        drop(writer);
        assert_eq!(std::fs::read_dir(root.path()).expect("ls").count(), 0);
    }

    #[test]
    fn a_manifest_is_trusted_only_under_its_seal_and_this_key() {
        let root = tempfile::tempdir().expect("tempdir");
        let dir = snapshot(root.path(), &trust()).dir;
        let text = std::fs::read_to_string(dir.join(MANIFEST)).expect("manifest");
        // Another key (another home) refuses it.
        let other = SnapshotTrust::new(SnapshotKey::from_bytes([8; 32]));
        assert!(matches!(other.open(&dir), Err(SnapshotError::Seal(_))));
        // Any edit breaks the seal, even one that keeps the JSON valid and harmless-looking.
        std::fs::write(dir.join(MANIFEST), text.replacen("\"k\": 1", "\"k\": 2", 1)).expect("edit");
        let err = refused(&dir);
        assert!(matches!(err, SnapshotError::Seal(_)), "{err}");
        assert_eq!(err.code(), "snapshot_invalid");
        std::fs::write(dir.join(MANIFEST), &text).expect("restore");
        trust().open(&dir).expect("whole again");
        // A damaged seal; no seal at all (what format 1 snapshots are).
        let seal = std::fs::read(dir.join(SEAL)).expect("seal");
        std::fs::write(dir.join(SEAL), b"strata-seal blake3-keyed zz\n").expect("garble");
        assert!(matches!(refused(&dir), SnapshotError::Seal(_)));
        std::fs::write(dir.join(SEAL), vec![b'a'; 4096]).expect("huge");
        assert_eq!(refused(&dir).code(), "snapshot_too_large");
        std::fs::remove_file(dir.join(SEAL)).expect("rm");
        let err = refused(&dir);
        assert!(matches!(err, SnapshotError::Unsealed(_)) && err.to_string().contains("format 2"), "{err}");
        std::fs::write(dir.join(SEAL), seal).expect("restore");
        trust().open(&dir).expect("whole again");
    }

    #[test]
    fn damaged_snapshots_are_refused_each_with_its_reason() {
        let root = tempfile::tempdir().expect("tempdir");
        let dir = snapshot(root.path(), &trust()).dir;
        let manifest_text = std::fs::read_to_string(dir.join(MANIFEST)).expect("manifest");
        let key = SnapshotKey::from_bytes([7; 32]);

        // Truncated, grown, corrupted in place, missing.
        let memory = dir.join("memory");
        std::fs::write(&memory, [7u8; 9_999]).expect("truncate");
        assert!(matches!(refused(&dir), SnapshotError::SizeMismatch { expected: 10_000, found: 9_999, .. }));
        std::fs::write(&memory, [7u8; 10_001]).expect("grow");
        assert!(matches!(refused(&dir), SnapshotError::SizeMismatch { found: 10_001, .. }));
        let mut flipped = vec![7u8; 10_000];
        flipped[5_000] = 8;
        std::fs::write(&memory, &flipped).expect("flip");
        assert!(matches!(refused(&dir), SnapshotError::Checksum(_)));
        std::fs::remove_file(&memory).expect("rm");
        assert!(matches!(refused(&dir), SnapshotError::MissingFile(_)));
        std::fs::write(&memory, [7u8; 10_000]).expect("restore");
        trust().open(&dir).expect("whole again");

        // A file nobody listed, a symlink in place of a file, a symlinked directory, a FIFO.
        write(&dir, "extra", b"?");
        assert!(matches!(refused(&dir), SnapshotError::UnlistedFile(_)));
        std::fs::remove_file(dir.join("extra")).expect("rm");
        std::fs::rename(&memory, root.path().join("memory.real")).expect("mv");
        std::os::unix::fs::symlink(root.path().join("memory.real"), &memory).expect("symlink");
        assert!(matches!(refused(&dir), SnapshotError::UnsafePath { reason: "not a regular file", .. }));
        std::fs::remove_file(&memory).expect("rm");
        std::fs::rename(root.path().join("memory.real"), &memory).expect("mv");
        std::fs::rename(dir.join("fs"), root.path().join("fs.real")).expect("mv");
        std::os::unix::fs::symlink(root.path().join("fs.real"), dir.join("fs")).expect("symlink");
        assert!(matches!(refused(&dir), SnapshotError::UnlistedFile(_)), "the link itself is an unlisted entry");
        std::fs::remove_file(dir.join("fs")).expect("rm");
        std::fs::rename(root.path().join("fs.real"), dir.join("fs")).expect("mv");
        std::fs::remove_file(&memory).expect("rm");
        nix::unistd::mkfifo(&memory, Mode::from_bits_truncate(0o600)).expect("mkfifo");
        let started = Instant::now();
        assert!(matches!(refused(&dir), SnapshotError::UnsafePath { reason: "not a regular file", .. }));
        assert!(started.elapsed() < Duration::from_secs(5), "a FIFO is refused, not read");
        std::fs::remove_file(&memory).expect("rm");
        std::fs::write(&memory, [7u8; 10_000]).expect("restore");

        // Manifests that say something wrong, sealed with the right key: the parser still refuses them.
        let edit = |from: &str, to: &str| {
            assert!(manifest_text.contains(from), "{from}");
            test_utils::seal(&dir, &key, manifest_text.replacen(from, to, 1).as_bytes()).expect("edit");
        };
        edit("\"format\": 2", "\"format\": 3");
        let err = refused(&dir);
        assert!(matches!(err, SnapshotError::FormatVersion { found: 3, supported: 2, .. }), "{err}");
        assert_eq!(err.code(), "snapshot_version");
        edit("\"format\": 2", "\"format\": \"two\"");
        assert!(matches!(refused(&dir), SnapshotError::InvalidManifest { .. }));
        edit("\"fs/upper.tar\"", "\"../upper.tar\"");
        assert!(matches!(refused(&dir), SnapshotError::UnsafePath { .. }));
        edit("\"fs/upper.tar\"", "\"/etc/passwd\"");
        assert!(matches!(refused(&dir), SnapshotError::UnsafePath { .. }));
        edit("\"total_bytes\": 10009", "\"total_bytes\": 10008");
        assert!(matches!(refused(&dir), SnapshotError::InvalidManifest { .. }));
        edit("\"tier\": \"process\"", "\"tier\": \"wasm\", \"extra\": 1");
        assert!(matches!(refused(&dir), SnapshotError::InvalidManifest { .. }));
        test_utils::seal(&dir, &key, b"\0\0\0").expect("garbage");
        assert_eq!(refused(&dir).code(), "snapshot_invalid");
        test_utils::seal(&dir, &key, manifest_text.as_bytes()).expect("restore");
        let err = trust().open_for(&dir, TierKind::Wasm).expect_err("wrong tier");
        assert_eq!(err.code(), "snapshot_tier", "{err}");
        std::fs::remove_file(dir.join(MANIFEST)).expect("rm");
        assert!(matches!(refused(&dir), SnapshotError::NotASnapshot(_)));
        assert!(matches!(refused(&root.path().join("nowhere")), SnapshotError::Io { .. }));
    }

    /// A sealed manifest listing `files` (path, size) with made-up hashes.
    fn sealed_claim(dir: &Path, files: &[(&str, u64)]) {
        let manifest = Manifest {
            format: FORMAT_VERSION,
            strata: "test".into(),
            tier: TierKind::Wasm,
            id: "0".repeat(32),
            parent: None,
            created: "2025-01-01T00:00:00Z".into(),
            persists: Vec::new(),
            files: files
                .iter()
                .map(|(path, size)| ManifestFile { path: (*path).into(), size: *size, sha256: "0".repeat(64) })
                .collect(),
            total_bytes: files.iter().map(|(_, size)| size).sum(),
            meta: serde_json::json!({}),
        };
        let text = serde_json::to_vec(&manifest).expect("json");
        test_utils::seal(dir, &SnapshotKey::from_bytes([7; 32]), &text).expect("seal");
    }

    #[test]
    fn work_is_bounded_before_it_is_done() {
        let root = tempfile::tempdir().expect("tempdir");
        let dir = root.path().join("snap");
        std::fs::create_dir(&dir).expect("mkdir");
        // A sparse file of 1 TiB that the (sealed) manifest claims: refused from stat, nothing hashed.
        let huge = File::create(dir.join("memory")).expect("create");
        huge.set_len(1 << 40).expect("sparse");
        sealed_claim(&dir, &[("memory", 1 << 40)]);
        let started = Instant::now();
        let err = refused(&dir);
        assert_eq!(err.code(), "snapshot_too_large", "{err}");
        assert!(started.elapsed() < Duration::from_secs(2), "{:?}", started.elapsed());
        // Within the default bounds, but not these: still refused before any byte is read.
        huge.set_len(64 << 20).expect("smaller");
        sealed_claim(&dir, &[("memory", 64 << 20)]);
        let tight = trust().with_bounds(SnapshotBounds { max_file_bytes: 1 << 20, ..SnapshotBounds::default() });
        assert_eq!(tight.open(&dir).expect_err("over").code(), "snapshot_too_large");
        let tight = trust().with_bounds(SnapshotBounds { max_total_bytes: 1 << 20, ..SnapshotBounds::default() });
        assert_eq!(tight.open(&dir).expect_err("over").code(), "snapshot_too_large");
        // A sealed manifest with too many files.
        let many: Vec<String> = (0..5000).map(|i| format!("f{i}")).collect();
        let claims: Vec<(&str, u64)> = many.iter().map(|name| (name.as_str(), 0)).collect();
        sealed_claim(&dir, &claims);
        assert_eq!(refused(&dir).code(), "snapshot_too_large");
        // A directory bomb: the walk stops at the bound.
        sealed_claim(&dir, &[("memory", 64 << 20)]);
        for i in 0..5000 {
            std::fs::create_dir(dir.join(format!("d{i}"))).expect("mkdir");
        }
        let err = refused(&dir);
        assert!(err.to_string().contains("directories"), "{err}");
        for i in 0..5000 {
            std::fs::remove_dir(dir.join(format!("d{i}"))).expect("rmdir");
        }
        let mut deep = dir.clone();
        for _ in 0..100 {
            deep.push("d");
        }
        std::fs::create_dir_all(&deep).expect("deep");
        let err = refused(&dir);
        assert!(err.to_string().contains("deeper"), "{err}");
    }

    #[test]
    fn a_commit_over_the_bounds_is_refused_before_hashing() {
        let root = tempfile::tempdir().expect("tempdir");
        let writer = trust().writer(&root.path().join("snap")).expect("create");
        File::create(writer.dir().join("memory")).expect("create").set_len(1 << 40).expect("sparse");
        let started = Instant::now();
        let err = writer.commit(TierKind::Wasm, None, Vec::new(), serde_json::json!({})).expect_err("too large");
        assert_eq!(err.code(), "snapshot_too_large", "{err}");
        assert!(started.elapsed() < Duration::from_secs(2), "{:?}", started.elapsed());
        assert_eq!(std::fs::read_dir(root.path()).expect("ls").count(), 0, "nothing is left");
    }

    #[test]
    fn a_reopened_snapshot_is_the_same_one_and_unchanged() {
        let root = tempfile::tempdir().expect("tempdir");
        let made = snapshot(root.path(), &trust());
        let again = trust().reopen(&made).expect("unchanged");
        assert_eq!(again, made);
        again.open_file("memory").expect("as verified");
        // Rewritten with the same bytes: hashed again, and still good.
        std::fs::write(made.dir.join("memory"), [7u8; 10_000]).expect("rewrite");
        assert!(matches!(made.open_file("memory"), Err(SnapshotError::Changed(_))));
        let again = trust().reopen(&made).expect("same bytes");
        again.open_file("memory").expect("verified again");
        // Changed: refused.
        std::fs::write(made.dir.join("memory"), [8u8; 10_000]).expect("change");
        assert!(matches!(trust().reopen(&made), Err(SnapshotError::Checksum(_))));
        // Another (genuine) snapshot moved in its place: refused as a replacement.
        std::fs::remove_dir_all(&made.dir).expect("rm");
        let other = snapshot(root.path(), &trust());
        assert_ne!(other.manifest.id, made.manifest.id);
        assert!(matches!(trust().reopen(&made), Err(SnapshotError::Replaced(_))));
    }

    #[test]
    fn a_private_copy_is_the_verified_bytes_whatever_happens_to_the_file() {
        use std::os::unix::fs::FileExt;
        let root = tempfile::tempdir().expect("tempdir");
        let trust = trust();
        let made = snapshot(root.path(), &trust);
        let copy = made.private_copy("memory").expect("sealed copy");
        // Truncated and rewritten under the copy: the copy is unchanged, and still the one this snapshot holds.
        let memory = made.dir.join("memory");
        std::fs::OpenOptions::new().write(true).open(&memory).expect("open").set_len(0).expect("truncate");
        let mut read = vec![0u8; 10_000];
        copy.file().read_exact_at(&mut read, 0).expect("read the copy");
        assert_eq!(read, [7u8; 10_000]);
        assert!(Arc::ptr_eq(&copy, &made.private_copy("memory").expect("again")));
        // Another handle of the same trust, to the same bytes: the same copy, made once.
        let other = snapshot(&root.path().join("other").tap_mkdir(), &trust);
        assert!(Arc::ptr_eq(&copy, &other.private_copy("memory").expect("shared")));
        // A handle with no copy yet, over the changed file: refused, nothing copied.
        drop(copy);
        drop(other);
        let reopened = trust.open(&made.dir);
        assert!(reopened.is_err(), "the truncated file no longer verifies");
        // A file changed after it was verified (same size, other bytes): its copy is refused, by its stamp or,
        // when the change landed within the clock tick of the verification (its times look the same), by the
        // hash of the bytes copied.
        // (With no live copy of those bytes left: while one lives, it is what the manifest's sha256 names, and is
        // given out without reading the file.)
        drop(made);
        let fresh = snapshot(&root.path().join("fresh").tap_mkdir(), &trust);
        std::fs::write(fresh.dir.join("memory"), [9u8; 10_000]).expect("rewrite");
        let refused = fresh.private_copy("memory").expect_err("changed");
        assert!(matches!(refused, SnapshotError::Changed(_) | SnapshotError::Checksum(_)), "{refused}");
        assert!(matches!(fresh.private_copy("absent"), Err(SnapshotError::MissingFile(_))));
    }

    #[test]
    fn a_kept_copy_serves_later_processes_until_anything_changes_it() {
        use std::os::unix::fs::{FileExt, MetadataExt, PermissionsExt};
        let root = tempfile::tempdir().expect("tempdir");
        let (copies, kept) = (root.path().join("copies"), root.path().join("kept"));
        // A new trust is a later process: nothing in memory is shared with the one before.
        let host = || trust().with_copies_in(copies.clone()).with_kept_copies_in(kept.clone());
        std::fs::create_dir(&copies).expect("mkdir");
        let made = snapshot(root.path(), &host());
        let bytes = |copy: &PrivateCopy| {
            let mut read = vec![0u8; 10_000];
            copy.file().read_exact_at(&mut read, 0).expect("read the copy");
            read
        };
        let first = made.private_copy("memory").expect("copy");
        if first.backing() == crate::private_copy::Backing::SealedMemfd {
            eprintln!("skipped: {} is not on a disk filesystem", copies.display());
            return;
        }
        assert_eq!(first.backing(), crate::private_copy::Backing::Kept);
        let ino = first.file().metadata().expect("stat").ino();
        let listing = || {
            let mut names: Vec<String> = std::fs::read_dir(&kept)
                .expect("ls")
                .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
                .collect();
            names.sort();
            names
        };
        let names = listing();
        assert_eq!(names.len(), 2, "{names:?}");
        assert!(names[0].ends_with(".image") && names[1].ends_with(".image.sum"), "{names:?}");
        let image = kept.join(&names[0]);
        assert_eq!(std::fs::metadata(&image).expect("stat").mode() & 0o7777, 0o400);
        drop(first);
        // A later process maps the kept file: no copy.
        let later = host().open(&made.dir).expect("open").private_copy("memory").expect("kept");
        assert_eq!(later.file().metadata().expect("stat").ino(), ino);
        assert_eq!(bytes(&later), [7u8; 10_000]);
        drop(later);
        // Rewritten in place (the same size): its stamp moved, so it is not used; a new copy replaces it.
        std::fs::set_permissions(&image, std::fs::Permissions::from_mode(0o600)).expect("chmod");
        std::fs::OpenOptions::new().write(true).open(&image).expect("open").write_all_at(&[1; 100], 0).expect("w");
        let third = host().open(&made.dir).expect("open").private_copy("memory").expect("copied again");
        let ino = third.file().metadata().expect("stat").ino();
        assert_eq!(bytes(&third), [7u8; 10_000]);
        assert_eq!(std::fs::metadata(&image).expect("stat").ino(), ino, "kept in its place");
        drop(third);
        // A link in its place is not followed.
        std::fs::remove_file(&image).expect("rm");
        std::os::unix::fs::symlink(made.dir.join("memory"), &image).expect("symlink");
        let fourth = host().open(&made.dir).expect("open").private_copy("memory").expect("copied again");
        let target = std::fs::metadata(made.dir.join("memory")).expect("stat").ino();
        assert_ne!(fourth.file().metadata().expect("stat").ino(), target, "the link's target is not mapped");
        assert!(std::fs::symlink_metadata(&image).expect("stat").is_file(), "replaced by a kept copy");
        drop(fourth);
        // A record that names other bytes is not believed.
        let sum = kept.join(&names[1]);
        let text = std::fs::read_to_string(&sum).expect("record");
        let forged = format!("sha256 {} 10000\n{}", "0".repeat(64), text.lines().nth(1).expect("stamp"));
        std::fs::write(&sum, forged).expect("forge");
        let fifth = host().open(&made.dir).expect("open").private_copy("memory").expect("copied again");
        assert_eq!(bytes(&fifth), [7u8; 10_000]);
        let rewritten = std::fs::read_to_string(&sum).expect("record");
        assert_eq!(rewritten.lines().next(), text.lines().next(), "recorded again, with the bytes' own sha256");
        assert_eq!(listing(), names, "no temporaries are left");
    }

    /// A trust keeping verified stamps in `record`, for files however recently changed.
    fn recording(record: &Path) -> SnapshotTrust {
        trust().with_verified_in(record.to_owned()).with_settle(Duration::ZERO)
    }

    /// A snapshot whose files changed a little while ago, and the directory its trusts keep records in.
    fn settled(root: &Path) -> (Snapshot, PathBuf) {
        let made = snapshot(root, &trust());
        std::thread::sleep(Duration::from_millis(30));
        (made, root.join("verified"))
    }

    #[test]
    fn a_verified_stamp_spares_the_next_open_the_hashing() {
        let root = tempfile::tempdir().expect("tempdir");
        let (made, record) = settled(root.path());
        let first = recording(&record).open(&made.dir).expect("open");
        assert_eq!(first.bytes_hashed(), 10_009);
        let again = recording(&record).open(&made.dir).expect("again");
        assert_eq!(again.bytes_hashed(), 0, "vouched for by the record");
        assert_eq!(again, first);
        assert_eq!(again.read_file("fs/upper.tar", 100).expect("read"), b"tar bytes");
        // The record lives under the host's directory, not in the snapshot (which still opens as whole).
        assert_eq!(std::fs::read_dir(&record).expect("ls").count(), 1);
        assert_eq!(trust().open(&made.dir).expect("no record").bytes_hashed(), 10_009);
    }

    #[test]
    fn a_file_changed_just_before_its_verification_gets_no_record() {
        let root = tempfile::tempdir().expect("tempdir");
        let made = snapshot(root.path(), &trust());
        let record = root.path().join("verified");
        let trust = trust().with_verified_in(record.clone());
        assert_eq!(trust.open(&made.dir).expect("open").bytes_hashed(), 10_009);
        assert_eq!(trust.open(&made.dir).expect("again").bytes_hashed(), 10_009, "hashed again");
        assert!(std::fs::read_dir(&record).map_or(true, |mut entries| entries.next().is_none()));
    }

    #[test]
    fn a_file_replaced_after_its_stamp_was_recorded_is_hashed_again() {
        let root = tempfile::tempdir().expect("tempdir");
        let (made, record) = settled(root.path());
        recording(&record).open(&made.dir).expect("open");
        // The same bytes in a new file renamed over it: a new inode, hashed, and good.
        write(root.path(), "same", &[7u8; 10_000]);
        std::fs::rename(root.path().join("same"), made.dir.join("memory")).expect("rename");
        assert_eq!(recording(&record).open(&made.dir).expect("same bytes").bytes_hashed(), 10_000);
        std::thread::sleep(Duration::from_millis(30));
        assert_eq!(recording(&record).open(&made.dir).expect("recorded again").bytes_hashed(), 0);
        // Other bytes, same size, renamed over it: refused.
        write(root.path(), "other", &[8u8; 10_000]);
        std::fs::rename(root.path().join("other"), made.dir.join("memory")).expect("rename");
        assert!(matches!(recording(&record).open(&made.dir), Err(SnapshotError::Checksum(_))));
    }

    #[test]
    fn a_file_rewritten_in_place_after_its_stamp_was_recorded_is_hashed_again() {
        use std::os::unix::fs::FileExt;
        let root = tempfile::tempdir().expect("tempdir");
        let (made, record) = settled(root.path());
        recording(&record).open(&made.dir).expect("open");
        let memory = made.dir.join("memory");
        let inode = std::fs::metadata(&memory).map(|m| std::os::unix::fs::MetadataExt::ino(&m)).expect("stat");
        // One byte, in place, its modification time then set back: the change time still moved.
        let before = std::fs::metadata(&memory).and_then(|m| m.modified()).expect("mtime");
        let file = std::fs::OpenOptions::new().write(true).open(&memory).expect("open");
        file.write_all_at(b"\x08", 5_000).expect("write");
        file.set_modified(before).expect("utimens");
        drop(file);
        assert_eq!(std::fs::metadata(&memory).map(|m| std::os::unix::fs::MetadataExt::ino(&m)).expect("stat"), inode);
        assert!(matches!(recording(&record).open(&made.dir), Err(SnapshotError::Checksum(_))));
        // Put back (bytes and modification time): hashed again (that file only), and good.
        let file = std::fs::OpenOptions::new().write(true).open(&memory).expect("open");
        file.write_all_at(b"\x07", 5_000).expect("write");
        file.set_modified(before).expect("utimens");
        drop(file);
        assert_eq!(recording(&record).open(&made.dir).expect("restored").bytes_hashed(), 10_000);
    }

    #[test]
    fn a_stamp_record_not_sealed_with_this_key_is_ignored() {
        let root = tempfile::tempdir().expect("tempdir");
        let (made, record) = settled(root.path());
        // Changed bytes, then a record that vouches for the files as they are now.
        std::fs::write(made.dir.join("memory"), [8u8; 10_000]).expect("change");
        std::thread::sleep(Duration::from_millis(30));
        let root_fd = open_root(&made.dir).expect("root");
        let (manifest, sealed) =
            read_sealed(&root_fd, &made.dir, &trust().key().expect("key"), &SnapshotBounds::default()).expect("sealed");
        let stamps: Vec<FileStamp> = manifest
            .files
            .iter()
            .map(|f| {
                FileStamp::of_stat(&fstatat(&root_fd, f.path.as_str(), AtFlags::AT_SYMLINK_NOFOLLOW).expect("stat"))
            })
            .collect();
        let path = record.join(sealed.to_hex().as_str());
        // Sealed with another key: ignored, so the files are hashed, and refused.
        write_verified(&record, &sealed, &stamps, &SnapshotKey::from_bytes([8; 32])).expect("forge");
        assert!(matches!(recording(&record).open(&made.dir), Err(SnapshotError::Checksum(_))));
        // Sealed with this key but edited afterwards (a stamp line), or cut short: ignored alike.
        write_verified(&record, &sealed, &stamps, &trust().key().expect("key")).expect("genuine");
        let genuine = std::fs::read_to_string(&path).expect("record");
        let edited = genuine.replacen(&stamps[0].render(), &FileStamp { ino: 1, ..stamps[0] }.render(), 1);
        for bad in [edited.as_str(), &genuine[..genuine.len() - 2], "", "seal \n"] {
            std::fs::write(&path, bad).expect("tamper");
            assert!(matches!(recording(&record).open(&made.dir), Err(SnapshotError::Checksum(_))), "{bad:?}");
        }
        // A genuine record of another manifest (the file named after this one): ignored.
        let other = snapshot(&root.path().join("other").tap_mkdir(), &trust());
        let other_fd = open_root(&other.dir).expect("root");
        let (_, other_sealed) =
            read_sealed(&other_fd, &other.dir, &trust().key().expect("key"), &SnapshotBounds::default())
                .expect("sealed");
        write_verified(&record, &other_sealed, &stamps, &trust().key().expect("key")).expect("other");
        std::fs::rename(record.join(other_sealed.to_hex().as_str()), &path).expect("rename");
        assert!(matches!(recording(&record).open(&made.dir), Err(SnapshotError::Checksum(_))));
        // The genuine record itself would vouch for the changed bytes: only the key's holder can write one.
        std::fs::write(&path, &genuine).expect("genuine");
        assert_eq!(recording(&record).open(&made.dir).expect("vouched").bytes_hashed(), 0);
    }

    trait TapMkdir {
        fn tap_mkdir(self) -> PathBuf;
    }

    impl TapMkdir for PathBuf {
        fn tap_mkdir(self) -> PathBuf {
            std::fs::create_dir_all(&self).expect("mkdir");
            self
        }
    }

    #[test]
    fn stale_staging_directories_are_swept_live_ones_kept() {
        let root = tempfile::tempdir().expect("tempdir");
        // A PID that cannot be running: above the kernel's maximum.
        let dead = root.path().join(".snap.partial-4194305-0123abcd");
        std::fs::create_dir(&dead).expect("mkdir");
        write(&dead, "memory", b"half");
        let mine = root.path().join(format!(".other.partial-{}-89abcdef", std::process::id()));
        std::fs::create_dir(&mine).expect("mkdir");
        let init = root.path().join(".init.partial-1-00000000");
        std::fs::create_dir(&init).expect("mkdir");
        let unrelated = root.path().join(".snap.partial-4194305-xyz");
        std::fs::create_dir(&unrelated).expect("mkdir");
        snapshot(root.path(), &trust());
        assert!(!dead.exists(), "the dead writer's directory is swept");
        assert!(mine.exists() && init.exists() && unrelated.exists());
        assert_eq!(sweep_partials(root.path()), 0);
    }
}
