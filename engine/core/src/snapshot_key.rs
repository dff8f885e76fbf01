//! The host's snapshot key: what makes a snapshot directory more than data anyone who can write there could
//! have made.
//!
//! A snapshot's manifest says what a fork gets: the capabilities (host grants, environment, network), the limits,
//! the files that hold the state. Once written it is untrusted data, as anything on disk is: a job that can write
//! where snapshots live could rewrite it. So every manifest is sealed — a keyed BLAKE3 MAC over its exact bytes,
//! kept beside it in `manifest.seal` — with a key that exists only on the host, and nothing of a manifest is
//! parsed before its seal is checked ([`crate::snapshot::SnapshotTrust`]). A snapshot sealed with another key (another home,
//! another host), or not at all (made before snapshot format 2), is refused with `snapshot_invalid`.
//!
//! The key is 32 random bytes. An engine with a home keeps it in `$STRATA_HOME/keys/snapshot.key` (mode 0600,
//! in a 0700 directory), created once, atomically (written under a temporary name opened with `O_EXCL`, then
//! renamed into place with `RENAME_NOREPLACE`: concurrent first uses agree on one key). A key file that is not a
//! regular file of exactly 32 bytes, that others may read or write, or that another user owns, is refused rather
//! than used. An embedder can pass its own key ([`SnapshotKey::from_bytes`]), or use a key that lives as long as
//! its process ([`SnapshotKey::process_local`]): snapshots it seals then open in that process only.

use std::fmt;
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use crate::random::random_hex;

/// Where an engine's home keeps its snapshot key.
pub const KEY_FILE: &str = "keys/snapshot.key";

/// A key's length in bytes.
pub const KEY_LEN: usize = 32;

/// The context of the seal's key derivation: a seal is never valid as any other MAC made with the same key.
const SEAL_CONTEXT: &str = "strata snapshot manifest seal, format 2";

/// The context of the key that seals records of verified stamps ([`crate::snapshot`]).
const STAMPS_CONTEXT: &str = "strata snapshot verified stamps, format 1";

/// The host-only key that seals snapshot manifests. Its bytes are never printed.
#[derive(Clone, PartialEq, Eq)]
pub struct SnapshotKey {
    /// The key the seals are made with, derived from the key's bytes for this use only.
    seal_key: [u8; KEY_LEN],
    /// The key records of verified stamps are sealed with, derived likewise.
    stamps_key: [u8; KEY_LEN],
}

impl fmt::Debug for SnapshotKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SnapshotKey(…)")
    }
}

/// Why the host's snapshot key could not be used; a [`crate::snapshot::SnapshotError::Key`] (`snapshot_key`) where
/// a snapshot needed it.
#[derive(Debug, thiserror::Error)]
#[error("snapshot key {}: {message}", path.display())]
pub struct SnapshotKeyError {
    /// The key file (or its directory).
    pub path: PathBuf,
    /// What is wrong.
    pub message: String,
}

fn key_error(path: &Path, message: impl Into<String>) -> SnapshotKeyError {
    SnapshotKeyError { path: path.to_owned(), message: message.into() }
}

impl SnapshotKey {
    /// A key from its bytes (an embedder that keeps its own).
    pub fn from_bytes(bytes: [u8; KEY_LEN]) -> SnapshotKey {
        SnapshotKey {
            seal_key: blake3::derive_key(SEAL_CONTEXT, &bytes),
            stamps_key: blake3::derive_key(STAMPS_CONTEXT, &bytes),
        }
    }

    /// A new random key from the kernel.
    pub fn generate() -> Result<SnapshotKey, SnapshotKeyError> {
        let bytes = random_key().map_err(|e| key_error(Path::new("/dev/urandom"), format!("no randomness: {e}")))?;
        Ok(SnapshotKey::from_bytes(bytes))
    }

    /// A random key that lives as long as this process: snapshots sealed with it open in this process only.
    pub fn process_local() -> Result<SnapshotKey, SnapshotKeyError> {
        static KEY: OnceLock<Option<SnapshotKey>> = OnceLock::new();
        KEY.get_or_init(|| SnapshotKey::generate().ok())
            .clone()
            .ok_or_else(|| key_error(Path::new("/dev/urandom"), "no randomness for a process-local key"))
    }

    /// The key of the home `home` (`$STRATA_HOME`): [`KEY_FILE`] under it, created on first use.
    pub fn in_home(home: &Path) -> Result<SnapshotKey, SnapshotKeyError> {
        SnapshotKey::load_or_create(&home.join(KEY_FILE))
    }

    /// The key in `path`, created (with its directory, mode 0700) when there is none.
    pub fn load_or_create(path: &Path) -> Result<SnapshotKey, SnapshotKeyError> {
        match SnapshotKey::load(path) {
            Ok(key) => return Ok(key),
            Err(_) if !exists(path) => {}
            // Missing when read and there now: another process (or thread) put its key in place meanwhile (a key
            // appears whole, by rename), so read again; a key that is there but wrong fails the same way again.
            Err(_) => return SnapshotKey::load(path),
        }
        let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
        if !exists(dir) {
            if let Some(home) = dir.parent().filter(|d| !d.as_os_str().is_empty()) {
                std::fs::create_dir_all(home).map_err(|e| key_error(home, format!("cannot create it: {e}")))?;
            }
            match std::fs::DirBuilder::new().mode(0o700).create(dir) {
                Ok(()) => {}
                Err(err) if err.kind() == io::ErrorKind::AlreadyExists => {}
                Err(err) => return Err(key_error(dir, format!("cannot create it: {err}"))),
            }
        }
        check_directory(dir)?;
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let temporary = dir.join(format!(".{name}.{}.{}.tmp", std::process::id(), random_hex(4)));
        let written = (|| {
            let mut file = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .custom_flags(libc_flags::NOFOLLOW)
                .open(&temporary)?;
            file.write_all(&random_key()?)?;
            file.sync_all()?;
            // Never replaces a key another process put there first: that one is everybody's key then.
            nix::fcntl::renameat2(
                nix::fcntl::AT_FDCWD,
                &temporary,
                nix::fcntl::AT_FDCWD,
                path,
                nix::fcntl::RenameFlags::RENAME_NOREPLACE,
            )
            .map_err(io::Error::from)
        })();
        match written {
            Ok(()) => {
                if let Ok(dir) = File::open(dir) {
                    let _ = dir.sync_all();
                }
            }
            Err(err) => {
                let _ = std::fs::remove_file(&temporary);
                if err.kind() != io::ErrorKind::AlreadyExists {
                    return Err(key_error(path, format!("cannot create it: {err}")));
                }
            }
        }
        SnapshotKey::load(path)
    }

    /// The key in `path`, which must be a regular file of exactly [`KEY_LEN`] bytes, owned by this user and
    /// private to it.
    pub fn load(path: &Path) -> Result<SnapshotKey, SnapshotKeyError> {
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc_flags::NOFOLLOW | libc_flags::NONBLOCK)
            .open(path)
            .map_err(|e| key_error(path, format!("cannot open it: {e}")))?;
        let meta = file.metadata().map_err(|e| key_error(path, format!("cannot stat it: {e}")))?;
        if !meta.file_type().is_file() {
            return Err(key_error(path, "not a regular file"));
        }
        let me = nix::unistd::geteuid().as_raw();
        if meta.uid() != me {
            return Err(key_error(path, format!("owned by uid {}, not by this user ({me})", meta.uid())));
        }
        if meta.mode() & 0o077 != 0 {
            return Err(key_error(
                path,
                format!("mode {:o} lets others read or write it (it must be 600)", meta.mode() & 0o7777),
            ));
        }
        if meta.len() != KEY_LEN as u64 {
            return Err(key_error(path, format!("{} bytes, not {KEY_LEN}", meta.len())));
        }
        let mut bytes = [0u8; KEY_LEN];
        file.read_exact(&mut bytes).map_err(|e| key_error(path, format!("cannot read it: {e}")))?;
        Ok(SnapshotKey::from_bytes(bytes))
    }

    /// The seal of a manifest's bytes.
    pub(crate) fn seal(&self, manifest: &[u8]) -> blake3::Hash {
        blake3::keyed_hash(&self.seal_key, manifest)
    }

    /// The seal of a record of verified stamps (never valid as a manifest's seal, nor one as this).
    pub(crate) fn seal_stamps(&self, record: &[u8]) -> blake3::Hash {
        blake3::keyed_hash(&self.stamps_key, record)
    }
}

/// The open flags this module needs, as `std` takes them.
mod libc_flags {
    pub(super) const NOFOLLOW: i32 = nix::fcntl::OFlag::O_NOFOLLOW.bits();
    pub(super) const NONBLOCK: i32 = nix::fcntl::OFlag::O_NONBLOCK.bits();
}

fn exists(path: &Path) -> bool {
    std::fs::symlink_metadata(path).is_ok()
}

/// The key's directory must be a real directory of this user's that nobody else may write to (else another
/// user could put a key of their own in place).
fn check_directory(dir: &Path) -> Result<(), SnapshotKeyError> {
    let meta = std::fs::symlink_metadata(dir).map_err(|e| key_error(dir, format!("cannot stat it: {e}")))?;
    if !meta.file_type().is_dir() {
        return Err(key_error(dir, "not a directory"));
    }
    let me = nix::unistd::geteuid().as_raw();
    if meta.uid() != me {
        return Err(key_error(dir, format!("owned by uid {}, not by this user ({me})", meta.uid())));
    }
    if meta.mode() & 0o022 != 0 {
        return Err(key_error(dir, format!("mode {:o} lets others write to it", meta.mode() & 0o7777)));
    }
    Ok(())
}

fn random_key() -> io::Result<[u8; KEY_LEN]> {
    let mut bytes = [0u8; KEY_LEN];
    File::open("/dev/urandom")?.read_exact(&mut bytes)?;
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn a_home_key_is_created_once_private_and_read_back() {
        let home = tempfile::tempdir().expect("tempdir");
        let first = SnapshotKey::in_home(home.path()).expect("create");
        let path = home.path().join(KEY_FILE);
        let meta = std::fs::metadata(&path).expect("key file");
        assert_eq!((meta.len(), meta.mode() & 0o777), (32, 0o600));
        assert_eq!(std::fs::metadata(path.parent().expect("dir")).expect("dir").mode() & 0o777, 0o700);
        assert_eq!(SnapshotKey::in_home(home.path()).expect("load"), first);
        assert_ne!(SnapshotKey::in_home(tempfile::tempdir().expect("tmp").path()).expect("other"), first);
        // Nothing but the key in its directory.
        assert_eq!(std::fs::read_dir(path.parent().expect("dir")).expect("ls").count(), 1);
        assert_eq!(format!("{first:?}"), "SnapshotKey(…)");
    }

    #[test]
    fn concurrent_first_uses_agree_on_one_key() {
        let home = tempfile::tempdir().expect("tempdir");
        let keys: Vec<SnapshotKey> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..8).map(|_| s.spawn(|| SnapshotKey::in_home(home.path()))).collect();
            handles.into_iter().map(|h| h.join().expect("thread").expect("key")).collect()
        });
        assert!(keys.windows(2).all(|w| w[0] == w[1]));
    }

    #[test]
    fn unsafe_key_files_are_refused() {
        let home = tempfile::tempdir().expect("tempdir");
        SnapshotKey::in_home(home.path()).expect("create");
        let path = home.path().join(KEY_FILE);
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).expect("chmod");
        let err = crate::SnapshotError::from(SnapshotKey::in_home(home.path()).expect_err("readable by others"));
        assert_eq!(err.code(), "snapshot_key", "{err}");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).expect("chmod");
        std::fs::write(&path, b"short").expect("write");
        assert!(SnapshotKey::in_home(home.path()).is_err(), "a short key");
        std::fs::remove_file(&path).expect("rm");
        std::os::unix::fs::symlink("/etc/hostname", &path).expect("symlink");
        assert!(SnapshotKey::in_home(home.path()).is_err(), "a symlinked key");
    }
}
