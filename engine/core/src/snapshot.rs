//! Snapshots on disk: one directory per snapshot, the tier's own files beside a `manifest.json` that names every
//! file with its size and sha256.
//!
//! A snapshot directory is written by a [`SnapshotWriter`]: the tier writes its files into a temporary directory
//! beside the destination, [`SnapshotWriter::commit`] hashes them, writes the manifest, syncs everything and renames
//! the directory into place, so a snapshot is either complete or absent — never half-written, whatever crashes.
//! [`Snapshot::open`] reads it back (in this process or another) and refuses anything it cannot vouch for, each
//! with its own [`SnapshotError`]: a directory without a manifest, a manifest of another format version, a file
//! missing, truncated or grown, a checksum that does not match, a file the manifest does not list, a path that
//! would leave the directory. Nothing of a refused snapshot is ever restored.
//!
//! ```text
//! snapshot/
//!   manifest.json   {"format":1,"tier":"process","id":"…","parent":null,"created":"…Z","persists":["filesystem"],
//!                    "files":[{"path":"upper.tar","size":10240,"sha256":"…"}],"total_bytes":10240,"meta":{…}}
//!   upper.tar       the tier's files, as it names them
//! ```

use std::fs::{self, File};
use std::io::{self, Write};
use std::path::{Component, Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::outcome::TierKind;

/// The manifest format this build writes and reads.
pub const FORMAT_VERSION: u32 = 1;

/// The manifest's file name inside a snapshot directory.
pub const MANIFEST: &str = "manifest.json";

/// A manifest larger than this is not one of ours.
const MAX_MANIFEST_BYTES: u64 = 1 << 20;

/// A snapshot with more files than this is not one of ours.
const MAX_FILES: usize = 4096;

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
    /// Every file but the manifest.
    pub files: Vec<ManifestFile>,
    /// The sum of the files' sizes.
    pub total_bytes: u64,
    /// The tier's own description of the state (format of its files, guest facts); JSON object.
    pub meta: serde_json::Value,
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
    /// A file in the directory that the manifest does not list.
    #[error("{} is not listed in the snapshot's manifest", .0.display())]
    UnlistedFile(PathBuf),
    /// A path in the manifest or the directory that is not a plain relative path, or a file that is not a
    /// regular file (a symlink, a device).
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
            SnapshotError::NotASnapshot(_)
            | SnapshotError::InvalidManifest { .. }
            | SnapshotError::MissingFile(_)
            | SnapshotError::SizeMismatch { .. }
            | SnapshotError::Checksum(_)
            | SnapshotError::UnlistedFile(_)
            | SnapshotError::UnsafePath { .. } => "snapshot_invalid",
        }
    }
}

fn io_error(path: &Path) -> impl FnOnce(io::Error) -> SnapshotError + '_ {
    move |source| SnapshotError::Io { path: path.to_owned(), source }
}

/// A verified snapshot: its directory and manifest. Tiers fork from it ([`crate::Tier::fork`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    /// The tier that made it.
    pub tier: TierKind,
    /// Its directory.
    pub dir: PathBuf,
    /// Its manifest.
    pub manifest: Manifest,
}

impl Snapshot {
    /// Reads and verifies a snapshot directory: the manifest, then every file's size and sha256, and that no
    /// other file is there. Reads every byte once (about 1 s per GiB).
    pub fn open(dir: &Path) -> Result<Snapshot, SnapshotError> {
        let manifest = read_manifest(dir)?;
        verify_files(dir, &manifest)?;
        Ok(Snapshot { tier: manifest.tier, dir: dir.to_owned(), manifest })
    }

    /// [`Snapshot::open`], and the snapshot must belong to `tier`.
    pub fn open_for(dir: &Path, tier: TierKind) -> Result<Snapshot, SnapshotError> {
        let manifest = read_manifest(dir)?;
        if manifest.tier != tier {
            return Err(SnapshotError::WrongTier { dir: dir.to_owned(), expected: tier, found: manifest.tier });
        }
        verify_files(dir, &manifest)?;
        Ok(Snapshot { tier, dir: dir.to_owned(), manifest })
    }

    /// Reads the manifest only, checking its format but not the files (for `strata snapshot inspect` of a large
    /// snapshot; never for restoring).
    pub fn read_manifest(dir: &Path) -> Result<Manifest, SnapshotError> {
        read_manifest(dir)
    }

    /// The path of one of its files.
    pub fn file(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }
}

fn read_manifest(dir: &Path) -> Result<Manifest, SnapshotError> {
    let path = dir.join(MANIFEST);
    let file = match File::open(&path) {
        Ok(file) => file,
        Err(err) if err.kind() == io::ErrorKind::NotFound => {
            return Err(if dir.is_dir() {
                SnapshotError::NotASnapshot(dir.to_owned())
            } else {
                SnapshotError::Io { path: dir.to_owned(), source: err }
            });
        }
        Err(err) => return Err(SnapshotError::Io { path, source: err }),
    };
    let mut text = Vec::new();
    io::Read::read_to_end(&mut io::Read::take(file, MAX_MANIFEST_BYTES + 1), &mut text).map_err(io_error(&path))?;
    let invalid = |message: String| SnapshotError::InvalidManifest { dir: dir.to_owned(), message };
    if text.len() as u64 > MAX_MANIFEST_BYTES {
        return Err(invalid(format!("larger than {MAX_MANIFEST_BYTES} bytes")));
    }
    // The format is checked before the shape, so a manifest of a newer format is reported as such.
    let value: serde_json::Value = serde_json::from_slice(&text).map_err(|e| invalid(e.to_string()))?;
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
    if manifest.files.len() > MAX_FILES {
        return Err(invalid(format!("{} files (at most {MAX_FILES})", manifest.files.len())));
    }
    let mut seen = std::collections::HashSet::new();
    let mut total: u64 = 0;
    for file in &manifest.files {
        check_relative(dir, &file.path)?;
        if file.path == MANIFEST {
            return Err(invalid(format!("lists {MANIFEST} itself")));
        }
        if !seen.insert(file.path.as_str()) {
            return Err(invalid(format!("lists {:?} twice", file.path)));
        }
        if file.sha256.len() != 64 || !file.sha256.bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()) {
            return Err(invalid(format!("the sha256 of {:?} is not 64 lower-case hex digits", file.path)));
        }
        total = total.checked_add(file.size).ok_or_else(|| invalid("sizes overflow".into()))?;
    }
    if total != manifest.total_bytes {
        return Err(invalid(format!("total_bytes is {} but the files add up to {total}", manifest.total_bytes)));
    }
    if !manifest.meta.is_object() {
        return Err(invalid("meta is not a JSON object".into()));
    }
    Ok(manifest)
}

/// A manifest path must be plain: relative, `/`-separated normal components, nothing empty, no NUL.
fn check_relative(dir: &Path, path: &str) -> Result<(), SnapshotError> {
    let unsafe_path = |reason| SnapshotError::UnsafePath { dir: dir.to_owned(), path: path.to_owned(), reason };
    if path.is_empty() || path.contains('\0') || path.contains('\\') {
        return Err(unsafe_path("empty, or contains NUL or a backslash"));
    }
    if path.split('/').any(|part| part.is_empty() || part == "." || part == "..") {
        return Err(unsafe_path("not a plain relative path"));
    }
    if !Path::new(path).components().all(|c| matches!(c, Component::Normal(_))) {
        return Err(unsafe_path("not a plain relative path"));
    }
    Ok(())
}

fn verify_files(dir: &Path, manifest: &Manifest) -> Result<(), SnapshotError> {
    for file in &manifest.files {
        let path = dir.join(&file.path);
        let meta = match fs::symlink_metadata(&path) {
            Ok(meta) => meta,
            Err(err) if err.kind() == io::ErrorKind::NotFound => return Err(SnapshotError::MissingFile(path)),
            Err(err) => return Err(SnapshotError::Io { path, source: err }),
        };
        if !meta.file_type().is_file() {
            return Err(SnapshotError::UnsafePath {
                dir: dir.to_owned(),
                path: file.path.clone(),
                reason: "not a regular file",
            });
        }
        if meta.len() != file.size {
            return Err(SnapshotError::SizeMismatch { path, expected: file.size, found: meta.len() });
        }
        let sum = strata_image_util::sha256_file(&path).map_err(io_error(&path))?;
        if sum != file.sha256 {
            return Err(SnapshotError::Checksum(path));
        }
    }
    let listed: std::collections::HashSet<&str> = manifest.files.iter().map(|f| f.path.as_str()).collect();
    for relative in walk(dir)? {
        if relative != MANIFEST && !listed.contains(relative.as_str()) {
            return Err(SnapshotError::UnlistedFile(dir.join(relative)));
        }
    }
    Ok(())
}

/// Every non-directory under `dir`, as `/`-separated relative paths; symlinks are reported, never followed.
fn walk(dir: &Path) -> Result<Vec<String>, SnapshotError> {
    let mut found = Vec::new();
    let mut pending = vec![(dir.to_owned(), String::new())];
    while let Some((path, prefix)) = pending.pop() {
        for entry in fs::read_dir(&path).map_err(io_error(&path))? {
            let entry = entry.map_err(io_error(&path))?;
            let name = entry.file_name();
            let name = name.to_str().ok_or_else(|| SnapshotError::UnsafePath {
                dir: dir.to_owned(),
                path: entry.file_name().to_string_lossy().into_owned(),
                reason: "not UTF-8",
            })?;
            let relative = if prefix.is_empty() { name.to_owned() } else { format!("{prefix}/{name}") };
            let kind = entry.file_type().map_err(io_error(&entry.path()))?;
            if kind.is_dir() {
                pending.push((entry.path(), relative));
            } else {
                found.push(relative);
            }
            if found.len() > MAX_FILES + 1 {
                return Err(SnapshotError::UnlistedFile(entry.path()));
            }
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
    committed: bool,
}

impl SnapshotWriter {
    /// Starts a snapshot that will be at `destination` (which must not exist; its parent must).
    pub fn create(destination: &Path) -> Result<SnapshotWriter, SnapshotError> {
        if fs::symlink_metadata(destination).is_ok() {
            return Err(SnapshotError::Exists(destination.to_owned()));
        }
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
        let staging = parent.join(format!(".{name}.partial-{}-{}", std::process::id(), random_hex(4)));
        fs::create_dir(&staging).map_err(io_error(&staging))?;
        Ok(SnapshotWriter { destination: destination.to_owned(), staging, committed: false })
    }

    /// Where the tier writes its files.
    pub fn dir(&self) -> &Path {
        &self.staging
    }

    /// Hashes every file the tier wrote, writes the manifest, syncs and renames the directory into place.
    pub fn commit(
        mut self,
        tier: TierKind,
        parent: Option<String>,
        persists: Vec<Persisted>,
        meta: serde_json::Value,
    ) -> Result<Snapshot, SnapshotError> {
        let staging = self.staging.clone();
        let mut names = walk(&staging)?;
        names.sort();
        let mut files = Vec::with_capacity(names.len());
        for name in names {
            check_relative(&staging, &name)?;
            if name == MANIFEST {
                return Err(SnapshotError::UnsafePath {
                    dir: staging,
                    path: name,
                    reason: "the tier's files may not be named manifest.json",
                });
            }
            let path = staging.join(&name);
            let meta = fs::symlink_metadata(&path).map_err(io_error(&path))?;
            if !meta.file_type().is_file() {
                return Err(SnapshotError::UnsafePath { dir: staging, path: name, reason: "not a regular file" });
            }
            File::open(&path).and_then(|f| f.sync_all()).map_err(io_error(&path))?;
            let sha256 = strata_image_util::sha256_file(&path).map_err(io_error(&path))?;
            files.push(ManifestFile { path: name, size: meta.len(), sha256 });
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
        let text = serde_json::to_vec_pretty(&manifest)
            .map_err(|e| SnapshotError::Io { path: path.clone(), source: io::Error::other(e) })?;
        let mut out = File::create(&path).map_err(io_error(&path))?;
        out.write_all(&text)
            .and_then(|()| out.write_all(b"\n"))
            .and_then(|()| out.sync_all())
            .map_err(io_error(&path))?;
        sync_dir(&staging)?;
        // rename(2) onto a path that appeared meanwhile would replace an empty directory: refuse it instead.
        if fs::symlink_metadata(&self.destination).is_ok() {
            return Err(SnapshotError::Exists(self.destination.clone()));
        }
        fs::rename(&staging, &self.destination).map_err(io_error(&self.destination))?;
        self.committed = true;
        if let Some(parent) = self.destination.parent().filter(|p| !p.as_os_str().is_empty()) {
            sync_dir(parent)?;
        }
        Ok(Snapshot { tier, dir: self.destination.clone(), manifest })
    }
}

impl Drop for SnapshotWriter {
    fn drop(&mut self) {
        if !self.committed {
            let _ = fs::remove_dir_all(&self.staging);
        }
    }
}

fn sync_dir(dir: &Path) -> Result<(), SnapshotError> {
    File::open(dir).and_then(|d| d.sync_all()).map_err(io_error(dir))
}

/// `bytes` random bytes from the kernel, hex (identifiers, temp names).
fn random_hex(bytes: usize) -> String {
    let mut buf = vec![0u8; bytes];
    let filled = File::open("/dev/urandom").and_then(|mut f| io::Read::read_exact(&mut f, &mut buf)).is_ok();
    if !filled {
        // Identifiers only need to be unique, not secret: time and pid will do.
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos();
        let seed = nanos ^ (u128::from(std::process::id()) << 64);
        for (i, b) in buf.iter_mut().enumerate() {
            *b = (seed >> ((i % 16) * 8)) as u8;
        }
    }
    strata_image_util::hex(&buf)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, name: &str, data: &[u8]) {
        let path = dir.join(name);
        if let Some(parent) = path.parent() {
            fs::create_dir_all(parent).expect("mkdir");
        }
        fs::write(path, data).expect("write");
    }

    fn snapshot(root: &Path) -> Snapshot {
        let writer = SnapshotWriter::create(&root.join("snap")).expect("create");
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

    #[test]
    fn a_committed_snapshot_opens_in_place_with_its_manifest() {
        let root = tempfile::tempdir().expect("tempdir");
        let made = snapshot(root.path());
        let opened = Snapshot::open_for(&root.path().join("snap"), TierKind::Process).expect("open");
        assert_eq!(opened, made);
        assert_eq!(opened.manifest.total_bytes, 10_009);
        assert_eq!(
            opened.manifest.files.iter().map(|f| f.path.as_str()).collect::<Vec<_>>(),
            ["fs/upper.tar", "memory"]
        );
        assert_eq!(opened.manifest.persists, [Persisted::Memory, Persisted::Filesystem]);
        assert_eq!(opened.manifest.id.len(), 32);
        // Nothing but the snapshot is left in the parent directory.
        let names: Vec<_> = fs::read_dir(root.path()).expect("ls").map(|e| e.expect("entry").file_name()).collect();
        assert_eq!(names, ["snap"]);
        let err = SnapshotWriter::create(&root.path().join("snap")).expect_err("exists");
        assert_eq!(err.code(), "snapshot_exists");
    }

    #[test]
    fn an_abandoned_writer_leaves_nothing() {
        let root = tempfile::tempdir().expect("tempdir");
        let writer = SnapshotWriter::create(&root.path().join("snap")).expect("create");
        write(writer.dir(), "memory", b"x");
        drop(writer);
        assert_eq!(fs::read_dir(root.path()).expect("ls").count(), 0);
    }

    fn refused(dir: &Path) -> SnapshotError {
        Snapshot::open(dir).expect_err("refused")
    }

    #[test]
    fn damaged_snapshots_are_refused_each_with_its_reason() {
        let root = tempfile::tempdir().expect("tempdir");
        let dir = snapshot(root.path()).dir;
        let manifest_text = fs::read_to_string(dir.join(MANIFEST)).expect("manifest");

        // Truncated, grown, corrupted in place, missing.
        let memory = dir.join("memory");
        fs::write(&memory, [7u8; 9_999]).expect("truncate");
        assert!(matches!(refused(&dir), SnapshotError::SizeMismatch { expected: 10_000, found: 9_999, .. }));
        fs::write(&memory, [7u8; 10_001]).expect("grow");
        assert!(matches!(refused(&dir), SnapshotError::SizeMismatch { found: 10_001, .. }));
        let mut flipped = vec![7u8; 10_000];
        flipped[5_000] = 8;
        fs::write(&memory, &flipped).expect("flip");
        assert!(matches!(refused(&dir), SnapshotError::Checksum(_)));
        fs::remove_file(&memory).expect("rm");
        assert!(matches!(refused(&dir), SnapshotError::MissingFile(_)));
        fs::write(&memory, [7u8; 10_000]).expect("restore");
        Snapshot::open(&dir).expect("whole again");

        // A file nobody listed, a symlink in place of a file.
        write(&dir, "extra", b"?");
        assert!(matches!(refused(&dir), SnapshotError::UnlistedFile(_)));
        fs::remove_file(dir.join("extra")).expect("rm");
        fs::rename(&memory, dir.join("memory.real")).expect("mv");
        std::os::unix::fs::symlink("memory.real", &memory).expect("symlink");
        assert!(matches!(refused(&dir), SnapshotError::UnsafePath { reason: "not a regular file", .. }));
        fs::remove_file(&memory).expect("rm");
        fs::rename(dir.join("memory.real"), &memory).expect("mv");

        // Manifests: another format, garbage, hostile paths, a wrong total, no manifest at all.
        let edit = |from: &str, to: &str| {
            assert!(manifest_text.contains(from), "{from}");
            fs::write(dir.join(MANIFEST), manifest_text.replacen(from, to, 1)).expect("edit");
        };
        edit("\"format\": 1", "\"format\": 2");
        let err = refused(&dir);
        assert!(matches!(err, SnapshotError::FormatVersion { found: 2, supported: 1, .. }), "{err}");
        assert_eq!(err.code(), "snapshot_version");
        edit("\"format\": 1", "\"format\": \"one\"");
        assert!(matches!(refused(&dir), SnapshotError::InvalidManifest { .. }));
        edit("\"fs/upper.tar\"", "\"../upper.tar\"");
        assert!(matches!(refused(&dir), SnapshotError::UnsafePath { .. }));
        edit("\"fs/upper.tar\"", "\"/etc/passwd\"");
        assert!(matches!(refused(&dir), SnapshotError::UnsafePath { .. }));
        edit("\"total_bytes\": 10009", "\"total_bytes\": 10008");
        assert!(matches!(refused(&dir), SnapshotError::InvalidManifest { .. }));
        edit("\"tier\": \"process\"", "\"tier\": \"wasm\", \"extra\": 1");
        assert!(matches!(refused(&dir), SnapshotError::InvalidManifest { .. }));
        fs::write(dir.join(MANIFEST), b"\0\0\0").expect("garbage");
        assert_eq!(refused(&dir).code(), "snapshot_invalid");
        fs::write(dir.join(MANIFEST), &manifest_text).expect("restore");
        let err = Snapshot::open_for(&dir, TierKind::Wasm).expect_err("wrong tier");
        assert_eq!(err.code(), "snapshot_tier", "{err}");
        fs::remove_file(dir.join(MANIFEST)).expect("rm");
        assert!(matches!(refused(&dir), SnapshotError::NotASnapshot(_)));
        assert!(matches!(refused(&root.path().join("nowhere")), SnapshotError::Io { .. }));
    }
}
