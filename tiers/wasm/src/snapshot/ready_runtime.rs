//! The snapshot-ready form of the Python runtime ([`super::ready_module`]), made once per runtime and kept in the
//! module cache directory beside the compiled code:
//!
//! ```text
//! <id>.image       the initial memory of a fresh interpreter (the module's data segments, laid out)
//! <id>.image.sum   `blake3 HASH LEN` of it, checked before the same descriptor is mapped, and the stamp of the
//!                  file it was last checked against (hashed again only when the stamp differs, as the module
//!                  cache's entries are)
//! <id>.refused     why the runtime cannot be made snapshot-ready (sessions then run the plain runtime)
//! ```
//!
//! A load records the image's last use on its `.image.sum` as the module cache records its entries' (see
//! [`crate::cache`]), for prune's least-recently-used order.
//!
//! `<id>` is derived from the runtime's sha256 and this rewrite's version; the rewritten module is compiled
//! into the module cache under the same id, and rewritten again only when that entry must be compiled.

use std::fs::{self, File};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use strata_core::{FileStamp, PrivateCopy, TierError};

use super::memory_image::MemoryImage;
use super::ready_module::{WASM_PAGE, instrument};
use crate::cache::{Digest, ModuleCache, Sum, write_atomically};

/// The snapshot-ready Python runtime a session runs: what a snapshot of it records and a fork needs.
#[derive(Debug, Clone)]
pub(crate) struct ReadyRuntime {
    /// The snapshot-ready module's identity (derived from the runtime's sha256).
    pub(crate) digest: Digest,
    /// The initial memory of a fresh interpreter.
    pub(crate) base_image: Arc<MemoryImage>,
    /// The module's minimum memory size, in wasm pages.
    pub(crate) minimum_pages: u64,
}

impl ReadyRuntime {
    /// The identity recorded in a snapshot, hex.
    pub(crate) fn identity(&self) -> String {
        hex(&self.digest)
    }
}

/// The identity of the snapshot-ready form of the runtime whose sha256 is `runtime`.
pub(crate) fn ready_digest(runtime: &Digest) -> Digest {
    let mut hasher = blake3::Hasher::new();
    hasher.update(b"strata snapshot-ready python v2\0");
    hasher.update(runtime);
    *hasher.finalize().as_bytes()
}

fn hex(digest: &Digest) -> String {
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

fn paths(dir: &Path, digest: &Digest) -> (PathBuf, PathBuf, PathBuf) {
    let name = hex(digest);
    (dir.join(format!("{name}.image")), dir.join(format!("{name}.image.sum")), dir.join(format!("{name}.refused")))
}

/// The snapshot-ready runtime (or why there is none), and the rewritten module when it was made just now.
pub(crate) type Made = (Result<ReadyRuntime, String>, Option<Arc<[u8]>>);

/// Loads the snapshot-ready runtime's base image from the cache, or rewrites the runtime (the module at `runtime`,
/// whose sha256 is `runtime_digest`) to make it.
pub(crate) fn load_or_make(
    cache: Option<&ModuleCache>,
    runtime: &Path,
    runtime_digest: &Digest,
) -> Result<Made, TierError> {
    let digest = ready_digest(runtime_digest);
    if let Some(cache) = cache {
        let (image_path, sum_path, refused_path) = paths(cache.dir(), &digest);
        if let Ok(reason) = fs::read_to_string(&refused_path) {
            return Ok((Err(reason), None));
        }
        if let Some(image) = load_image(&image_path, &sum_path) {
            crate::cache::record_use(&sum_path);
            return Ok((Ok(ready(digest, image)), None));
        }
    }
    let bytes = read_runtime(runtime)?;
    let done = match instrument(&bytes) {
        Ok(done) => done,
        Err(err) => {
            let reason = format!("the runtime cannot be made snapshot-ready: {err}");
            log::warn!("{reason}; Python sessions run without snapshots");
            if let Some(cache) = cache {
                let (_, _, refused_path) = paths(cache.dir(), &digest);
                let _ =
                    fs::create_dir_all(cache.dir()).and_then(|()| write_atomically(&refused_path, reason.as_bytes()));
            }
            return Ok((Err(reason), None));
        }
    };
    let image = store_image(cache, &digest, &done.image)?;
    Ok((Ok(ready(digest, image)), Some(Arc::from(done.module))))
}

/// The rewritten module, for a compile.
pub(crate) fn instrumented_module(runtime: &Path) -> Result<Arc<[u8]>, TierError> {
    let bytes = read_runtime(runtime)?;
    let done = instrument(&bytes).map_err(|err| TierError::InvalidModule {
        name: "the Python runtime".into(),
        reason: format!("cannot be made snapshot-ready: {err}"),
    })?;
    Ok(Arc::from(done.module))
}

fn read_runtime(path: &Path) -> Result<Vec<u8>, TierError> {
    fs::read(path).map_err(|source| TierError::ReadInput { path: path.to_owned(), source })
}

fn ready(digest: Digest, base_image: Arc<MemoryImage>) -> ReadyRuntime {
    let minimum_pages = base_image.len() as u64 / WASM_PAGE;
    ReadyRuntime { digest, base_image, minimum_pages }
}

/// The name of the memfd an image is copied into.
const IMAGE_NAME: &std::ffi::CStr = c"strata-python-image";

/// The cached image, if it is there and matches its checksum (or still has the stamp it had when it last did,
/// recorded then); the descriptor checked is the one mapped. Not copied (as a snapshot's memory is): the cache is
/// the host's own, written only by rename, like the compiled code wasmtime maps from it, and a copy would cost
/// every process that starts a session a write of the image.
fn load_image(image_path: &Path, sum_path: &Path) -> Option<Arc<MemoryImage>> {
    let sum = Sum::parse(&fs::read_to_string(sum_path).ok()?)?;
    let mut file = File::open(image_path).ok()?;
    let stamp = FileStamp::of_metadata(&file.metadata().ok()?);
    if sum.stamp != Some(stamp) {
        let mut hasher = blake3::Hasher::new();
        let read = std::io::copy(&mut std::io::Read::take(&mut file, sum.len.saturating_add(1)), &mut hasher).ok()?;
        if read != sum.len || hasher.finalize().to_hex().as_str() != sum.hash {
            log::warn!("{} does not match its checksum; making it again", image_path.display());
            return None;
        }
        let _ = write_atomically(sum_path, Sum { stamp: Some(stamp), ..sum.clone() }.render().as_bytes());
    }
    let len = sum.len;
    MemoryImage::cached(file, len).ok().map(Arc::new)
}

/// Writes the image into the cache (when there is one, for the next process) and returns its private copy.
fn store_image(cache: Option<&ModuleCache>, digest: &Digest, bytes: &[u8]) -> Result<Arc<MemoryImage>, TierError> {
    if let Some(cache) = cache {
        let (image_path, sum_path, _) = paths(cache.dir(), digest);
        let fail =
            |source| TierError::Storage { what: "cannot write the memory image", path: image_path.clone(), source };
        fs::create_dir_all(cache.dir()).map_err(fail)?;
        write_atomically(&image_path, bytes).map_err(fail)?;
        let sum = Sum { hash: blake3::hash(bytes).to_hex().to_string(), len: bytes.len() as u64, stamp: None };
        write_atomically(&sum_path, sum.render().as_bytes()).map_err(fail)?;
    }
    let fail = |source| TierError::Storage { what: "cannot make a memory image in", path: "memfd".into(), source };
    let dir = cache.map(ModuleCache::dir);
    let copy = PrivateCopy::copy_from(dir, IMAGE_NAME, bytes, bytes.len() as u64, |_| {}).map_err(fail)?;
    MemoryImage::new(Arc::new(copy)).map(Arc::new).map_err(fail)
}
