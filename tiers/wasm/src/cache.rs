//! The on-disk cache of precompiled modules.
//!
//! An entry is `<key>.cwasm` (wasmtime's serialized module) beside `<key>.sum` (its BLAKE3 digest and length).
//! The key hashes the module's bytes with the engine's compatibility fingerprint, so a different wasmtime
//! version or configuration (fuel on/off, features) never reads another's entry. Both files are written to
//! temporary names and renamed into place. On load the `.cwasm` is hashed through the same open file
//! descriptor that is then mapped, so a truncated, corrupted or swapped entry is detected, recompiled and
//! replaced, never executed.

use std::fs::{self, File};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use wasmtime::{Engine, Module};

/// A 32-byte BLAKE3 digest.
pub type Digest = [u8; 32];

/// Where a module came from on this call, for tests and progress reporting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheOutcome {
    /// A valid entry was mapped from disk.
    Hit,
    /// There was no entry; the module was compiled and stored.
    Compiled,
    /// An entry existed but failed verification; the module was recompiled and the entry replaced.
    Rebuilt,
}

/// The precompiled-module directory.
#[derive(Debug, Clone)]
pub struct ModuleCache {
    dir: PathBuf,
}

/// Why an entry could not be used.
#[derive(Debug)]
enum Invalid {
    Missing,
    Corrupt(String),
}

static TEMP_COUNTER: AtomicU64 = AtomicU64::new(0);

fn hex(digest: &Digest) -> String {
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

impl ModuleCache {
    /// A cache in `dir`, created on first store.
    pub fn new(dir: impl Into<PathBuf>) -> ModuleCache {
        ModuleCache { dir: dir.into() }
    }

    /// The cache directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The key of a module for an engine with this fingerprint.
    pub fn key(fingerprint: &Digest, module_hash: &Digest) -> Digest {
        let mut hasher = blake3::Hasher::new();
        hasher.update(b"strata module cache v1\0");
        hasher.update(fingerprint);
        hasher.update(module_hash);
        *hasher.finalize().as_bytes()
    }

    /// Paths of the entry for `key`: the serialized module and its checksum file.
    pub fn entry_paths(&self, key: &Digest) -> (PathBuf, PathBuf) {
        let name = hex(key);
        (self.dir.join(format!("{name}.cwasm")), self.dir.join(format!("{name}.sum")))
    }

    /// Loads the module for `key`, or compiles it with `compile` and stores it.
    ///
    /// `compile` returns the module or the compile error; a compile error is returned as is. A failure to
    /// store the entry does not fail the job: it is logged and the compiled module is used.
    pub fn load_or_compile<E>(
        &self,
        engine: &Engine,
        key: &Digest,
        compile: impl FnOnce() -> Result<Module, E>,
    ) -> Result<(Module, CacheOutcome), E> {
        let outcome = match self.load(engine, key) {
            Ok(module) => return Ok((module, CacheOutcome::Hit)),
            Err(Invalid::Missing) => CacheOutcome::Compiled,
            Err(Invalid::Corrupt(why)) => {
                log::warn!("module cache entry {} is unusable ({why}); recompiling", hex(key));
                CacheOutcome::Rebuilt
            }
        };
        let module = compile()?;
        if let Err(err) = self.store(key, &module) {
            log::warn!("cannot write module cache entry in {}: {err}", self.dir.display());
        }
        Ok((module, outcome))
    }

    fn load(&self, engine: &Engine, key: &Digest) -> Result<Module, Invalid> {
        let (cwasm_path, sum_path) = self.entry_paths(key);
        let sum = match fs::read_to_string(&sum_path) {
            Ok(sum) => sum,
            Err(err) if err.kind() == io::ErrorKind::NotFound => return Err(Invalid::Missing),
            Err(err) => {
                return Err(Invalid::Corrupt(format!("reading {}: {err}", sum_path.display())));
            }
        };
        let (want_hash, want_len) = parse_sum(&sum).ok_or_else(|| Invalid::Corrupt("malformed .sum file".into()))?;
        let mut file = match File::open(&cwasm_path) {
            Ok(file) => file,
            Err(err) if err.kind() == io::ErrorKind::NotFound => {
                return Err(Invalid::Corrupt(".sum without .cwasm".into()));
            }
            Err(err) => {
                return Err(Invalid::Corrupt(format!("opening {}: {err}", cwasm_path.display())));
            }
        };
        let mut hasher = blake3::Hasher::new();
        let len = io::copy(&mut file, &mut hasher).map_err(|e| Invalid::Corrupt(format!("reading: {e}")))?;
        if len != want_len {
            return Err(Invalid::Corrupt(format!("length {len}, expected {want_len}")));
        }
        if hasher.finalize().to_hex().as_str() != want_hash {
            return Err(Invalid::Corrupt("checksum mismatch".into()));
        }
        // SAFETY: `deserialize_open_file` requires bytes produced by `Module::serialize` of a compatible
        // engine. The bytes behind this descriptor were just hashed and match the digest recorded when this
        // process's code serialized them under a key that includes the engine's compatibility fingerprint.
        // The cache directory is private to Strata; a writer able to forge both files could equally replace
        // the binary itself.
        unsafe { Module::deserialize_open_file(engine, file) }
            .map_err(|err| Invalid::Corrupt(format!("wasmtime refused it: {err}")))
    }

    fn store(&self, key: &Digest, module: &Module) -> io::Result<()> {
        let bytes = module.serialize().map_err(|e| io::Error::other(e.to_string()))?;
        fs::create_dir_all(&self.dir)?;
        let (cwasm_path, sum_path) = self.entry_paths(key);
        let digest = blake3::hash(&bytes);
        let sum = format!("blake3 {} {}\n", digest.to_hex(), bytes.len());
        // The .cwasm goes first: a reader that sees the new .sum then finds the matching .cwasm. A crash in
        // between leaves a mismatch, which the next load detects and repairs.
        write_atomically(&cwasm_path, &bytes)?;
        write_atomically(&sum_path, sum.as_bytes())
    }
}

fn parse_sum(text: &str) -> Option<(&str, u64)> {
    let mut parts = text.split_whitespace();
    match (parts.next(), parts.next(), parts.next(), parts.next()) {
        (Some("blake3"), Some(hash), Some(len), None) if hash.len() == 64 => Some((hash, len.parse().ok()?)),
        _ => None,
    }
}

/// Writes `bytes` to a unique temporary file beside `path` and renames it over `path`.
pub(crate) fn write_atomically(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let tmp = dir.join(format!(".{name}.{}.{}.tmp", std::process::id(), TEMP_COUNTER.fetch_add(1, Ordering::Relaxed)));
    let result = (|| {
        let mut file = File::create(&tmp)?;
        file.write_all(bytes)?;
        file.flush()?;
        fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    fn engine() -> Engine {
        Engine::default()
    }

    fn compile(engine: &Engine) -> Result<Module, wasmtime::Error> {
        Module::new(engine, r#"(module (func (export "_start")))"#)
    }

    #[test]
    fn second_load_is_a_hit() {
        let dir = tempfile::tempdir().expect("tempdir");
        let cache = ModuleCache::new(dir.path().join("modules"));
        let engine = engine();
        let key = [7u8; 32];
        let (_, first) = cache.load_or_compile(&engine, &key, || compile(&engine)).expect("compile");
        let (_, second) = cache.load_or_compile(&engine, &key, || compile(&engine)).expect("load");
        assert_eq!((first, second), (CacheOutcome::Compiled, CacheOutcome::Hit));
    }

    #[test]
    fn corrupt_entry_is_rebuilt_not_loaded() {
        let dir = tempfile::tempdir().expect("tempdir");
        let cache = ModuleCache::new(dir.path());
        let engine = engine();
        let key = [9u8; 32];
        cache.load_or_compile(&engine, &key, || compile(&engine)).expect("compile");
        let (cwasm, _) = cache.entry_paths(&key);
        let mut bytes = fs::read(&cwasm).expect("read");
        let middle = bytes.len() / 2;
        bytes[middle] ^= 0xff;
        fs::write(&cwasm, &bytes).expect("corrupt");
        let (_, outcome) = cache.load_or_compile(&engine, &key, || compile(&engine)).expect("rebuild");
        assert_eq!(outcome, CacheOutcome::Rebuilt);
        let (_, outcome) = cache.load_or_compile(&engine, &key, || compile(&engine)).expect("load");
        assert_eq!(outcome, CacheOutcome::Hit);
    }

    #[test]
    fn truncated_entry_and_garbage_sum_are_rebuilt() {
        let dir = tempfile::tempdir().expect("tempdir");
        let cache = ModuleCache::new(dir.path());
        let engine = engine();
        let key = [3u8; 32];
        cache.load_or_compile(&engine, &key, || compile(&engine)).expect("compile");
        let (cwasm, sum) = cache.entry_paths(&key);
        let len = fs::metadata(&cwasm).expect("meta").len();
        File::options().write(true).open(&cwasm).expect("open").set_len(len / 3).expect("truncate");
        let (_, outcome) = cache.load_or_compile(&engine, &key, || compile(&engine)).expect("rebuild");
        assert_eq!(outcome, CacheOutcome::Rebuilt);
        fs::write(&sum, "not a checksum").expect("garbage");
        let (_, outcome) = cache.load_or_compile(&engine, &key, || compile(&engine)).expect("rebuild");
        assert_eq!(outcome, CacheOutcome::Rebuilt);
    }

    #[test]
    fn no_temporary_files_are_left_behind() {
        let dir = tempfile::tempdir().expect("tempdir");
        let cache = ModuleCache::new(dir.path());
        let engine = engine();
        cache.load_or_compile(&engine, &[1u8; 32], || compile(&engine)).expect("compile");
        let names: Vec<String> = fs::read_dir(dir.path())
            .expect("ls")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into())
            .collect();
        assert_eq!(names.len(), 2, "{names:?}");
        assert!(names.iter().all(|n| !n.ends_with(".tmp")), "{names:?}");
    }
}
