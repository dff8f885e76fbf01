//! The on-disk cache of precompiled modules and components.
//!
//! An entry is `<key>.cwasm` (wasmtime's serialized module or component) beside `<key>.sum` (its BLAKE3 digest and length,
//! and the stamp of the file that digest was last checked against). The key hashes the module's identity with
//! the engine's compatibility fingerprint, so a different wasmtime version or configuration (fuel on/off,
//! features) never reads another's entry; modules and components are keyed apart ([`ModuleCache::key`],
//! [`ModuleCache::component_key`]). Both files are written to temporary names and renamed into place;
//! one process compiles a given entry at a time (an `flock` on `<key>.lock`), the others wait and load it.
//!
//! On load the `.cwasm` is opened once and that descriptor is both checked and mapped (a module) or read (a
//! component: wasmtime 48 deserializes components from bytes or a path, not from an open file). When its stamp (device,
//! inode, size, modification and change times) matches the one recorded after its last full check, the digest
//! is not recomputed: any write, truncation, `chmod` or `touch` changes the change time, which a user process
//! cannot set back. Otherwise it is hashed in full. A truncated, corrupted or swapped entry is detected,
//! recompiled and replaced, never executed.
//!
//! Nothing a failed or killed write leaves is trusted: both files are synced before they are renamed into place
//! (so a stamp recorded is never of bytes still in flight), a `.sum` is read at most 4 KiB of and a `.cwasm` never
//! through a link, a full disk fails the store (logged; the job runs from the module compiled in memory) and
//! removes its temporary, and the temporaries of processes that died while writing are swept by the next store.
//!
//! **Last use.** Every hit records the entry's last use as the modification time of its `.sum` (the memory image's
//! `.image.sum` likewise), so that `strata images prune --budget` (`strata_engine::cache`) can evict the entries
//! used least recently first. It costs one `stat` of the `.sum` per hit and a `futimens` at most once per
//! [`LAST_USE_RESOLUTION`] per entry; the `.cwasm`'s own times are never touched (they are part of its stamp). An
//! entry's files may be removed at any time by a prune: a process that has the `.cwasm` mapped keeps its pages (the
//! inode lives until it is unmapped), and a load that finds the entry gone compiles it again.

use std::fmt;
use std::fs::{self, File};
use std::io::{self, Read, Seek, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use strata_core::FileStamp;
use wasmtime::component::Component;
use wasmtime::{Engine, Module};

/// What the cache holds: compiled code wasmtime can serialize, and load back from an entry it checked.
pub trait Compiled: Sized + sealed::Sealed {
    /// The bytes of the entry.
    fn serialize(&self) -> wasmtime::Result<Vec<u8>>;

    /// Loads the entry behind `file`, whose bytes were produced by [`Compiled::serialize`] for a compatible
    /// engine.
    ///
    /// # Safety
    ///
    /// wasmtime trusts serialized code: the bytes behind `file` must be what `serialize` wrote under a key that
    /// includes the engine's compatibility fingerprint, and must not change while this runs.
    unsafe fn load(engine: &Engine, file: File) -> wasmtime::Result<Self>;
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for wasmtime::Module {}
    impl Sealed for wasmtime::component::Component {}
}

impl Compiled for Module {
    fn serialize(&self) -> wasmtime::Result<Vec<u8>> {
        Module::serialize(self)
    }

    unsafe fn load(engine: &Engine, file: File) -> wasmtime::Result<Module> {
        // SAFETY: the caller guarantees the bytes behind `file` are a serialized module for this engine.
        unsafe { Module::deserialize_open_file(engine, file) }
    }
}

impl Compiled for Component {
    fn serialize(&self) -> wasmtime::Result<Vec<u8>> {
        Component::serialize(self)
    }

    unsafe fn load(engine: &Engine, mut file: File) -> wasmtime::Result<Component> {
        // The same descriptor the caller checked, read from its start (a check leaves it at the end).
        let mut bytes = Vec::new();
        file.seek(io::SeekFrom::Start(0))?;
        file.read_to_end(&mut bytes)?;
        // SAFETY: the caller guarantees the bytes behind `file` are a serialized component for this engine; these
        // are those bytes.
        unsafe { Component::deserialize(engine, &bytes) }
    }
}

/// A 32-byte digest.
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

impl fmt::Display for CacheOutcome {
    /// What a user is told: "loaded from the cache", "compiled and cached", "recompiled (its cached entry failed
    /// verification)".
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            CacheOutcome::Hit => "loaded from the cache",
            CacheOutcome::Compiled => "compiled and cached",
            CacheOutcome::Rebuilt => "recompiled (its cached entry failed verification)",
        })
    }
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

/// A `.sum` file is a line or two: more than this is not one.
const MAX_SUM_BYTES: u64 = 4096;

/// A hit refreshes its entry's last-use time (its `.sum`'s modification time) when that is older than this: the
/// time prune sorts by is exact to within it.
pub const LAST_USE_RESOLUTION: Duration = Duration::from_secs(3600);

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

    /// The key of a component for an engine with this fingerprint: never equal to a module's key.
    pub fn component_key(fingerprint: &Digest, component_hash: &Digest) -> Digest {
        let mut hasher = blake3::Hasher::new();
        hasher.update(b"strata component cache v1\0");
        hasher.update(fingerprint);
        hasher.update(component_hash);
        *hasher.finalize().as_bytes()
    }

    /// Paths of the entry for `key`: the serialized module and its checksum file.
    pub fn entry_paths(&self, key: &Digest) -> (PathBuf, PathBuf) {
        let name = hex(key);
        (self.dir.join(format!("{name}.cwasm")), self.dir.join(format!("{name}.sum")))
    }

    /// Loads the module (or component) for `key`, or compiles it with `compile` and stores it.
    ///
    /// `compile` returns the module or the compile error; a compile error is returned as is. A failure to
    /// store the entry does not fail the job: it is logged and the compiled module is used.
    pub fn load_or_compile<C: Compiled, E>(
        &self,
        engine: &Engine,
        key: &Digest,
        compile: impl FnOnce() -> Result<C, E>,
    ) -> Result<(C, CacheOutcome), E> {
        let outcome = match self.load(engine, key) {
            Ok(module) => {
                record_use(&self.entry_paths(key).1);
                return Ok((module, CacheOutcome::Hit));
            }
            Err(Invalid::Missing) => CacheOutcome::Compiled,
            Err(Invalid::Corrupt(why)) => {
                log::warn!("module cache entry {} is unusable ({why}); recompiling", hex(key));
                CacheOutcome::Rebuilt
            }
        };
        // One compiler per entry across processes: whoever waited for the lock loads what the other wrote.
        let lock = self.lock(key);
        if lock.is_some()
            && let Ok(module) = self.load(engine, key)
        {
            record_use(&self.entry_paths(key).1);
            return Ok((module, CacheOutcome::Hit));
        }
        let module = compile()?;
        if let Err(err) = self.store(key, &module) {
            log::warn!("cannot write module cache entry in {}: {err}", self.dir.display());
        }
        drop(lock);
        Ok((module, outcome))
    }

    /// An exclusive lock on the entry's lock file, or `None` when the cache directory cannot hold one (the
    /// compile then goes ahead unlocked).
    fn lock(&self, key: &Digest) -> Option<nix::fcntl::Flock<File>> {
        fs::create_dir_all(&self.dir).ok()?;
        let path = self.dir.join(format!("{}.lock", hex(key)));
        let file = File::options().create(true).truncate(false).write(true).open(path).ok()?;
        nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusive).ok()
    }

    fn load<C: Compiled>(&self, engine: &Engine, key: &Digest) -> Result<C, Invalid> {
        let (cwasm_path, sum_path) = self.entry_paths(key);
        let sum = match read_bounded(&sum_path, MAX_SUM_BYTES) {
            Ok(sum) => sum,
            Err(err) if err.kind() == io::ErrorKind::NotFound => return Err(Invalid::Missing),
            Err(err) => return Err(Invalid::Corrupt(format!("reading {}: {err}", sum_path.display()))),
        };
        let sum = std::str::from_utf8(&sum)
            .ok()
            .and_then(Sum::parse)
            .ok_or_else(|| Invalid::Corrupt("malformed .sum file".into()))?;
        let mut file = match open_no_follow(&cwasm_path) {
            Ok(file) => file,
            Err(err) if err.kind() == io::ErrorKind::NotFound => {
                return Err(Invalid::Corrupt(".sum without .cwasm".into()));
            }
            Err(err) => return Err(Invalid::Corrupt(format!("opening {}: {err}", cwasm_path.display()))),
        };
        let meta = file.metadata().map_err(|e| Invalid::Corrupt(format!("stat: {e}")))?;
        let stamp = FileStamp::of_metadata(&meta);
        if sum.stamp != Some(stamp) {
            let mut hasher = blake3::Hasher::new();
            let len = io::copy(&mut file, &mut hasher).map_err(|e| Invalid::Corrupt(format!("reading: {e}")))?;
            if len != sum.len {
                return Err(Invalid::Corrupt(format!("length {len}, expected {}", sum.len)));
            }
            if hasher.finalize().to_hex().as_str() != sum.hash {
                return Err(Invalid::Corrupt("checksum mismatch".into()));
            }
            // Checked in full: record the stamp so the next load need not hash again.
            let checked = Sum { stamp: Some(stamp), ..sum };
            let _ = write_atomically(&sum_path, checked.render().as_bytes());
        }
        // SAFETY: `Compiled::load` requires bytes produced by `Compiled::serialize` of a compatible engine. The
        // bytes behind this descriptor match the digest recorded when this code serialized them, under a key that
        // includes the engine's compatibility fingerprint (and the kind: modules and components are keyed apart):
        // checked just now, or unchanged (same inode, size, mtime and ctime) since they were last checked. The
        // cache directory is private to Strata; a writer able to forge both files could equally replace the
        // binary itself.
        unsafe { C::load(engine, file) }.map_err(|err| Invalid::Corrupt(format!("wasmtime refused it: {err}")))
    }

    fn store<C: Compiled>(&self, key: &Digest, module: &C) -> io::Result<()> {
        let bytes = module.serialize().map_err(|e| io::Error::other(e.to_string()))?;
        fs::create_dir_all(&self.dir)?;
        sweep_temporaries(&self.dir);
        let (cwasm_path, sum_path) = self.entry_paths(key);
        let hash = blake3::hash(&bytes).to_hex().to_string();
        // The .cwasm goes first: a reader that sees the new .sum then finds the matching .cwasm. A crash in
        // between leaves a mismatch, which the next load detects and repairs.
        write_atomically(&cwasm_path, &bytes)?;
        let stamp = fs::metadata(&cwasm_path).ok().map(|m| FileStamp::of_metadata(&m));
        write_atomically(&sum_path, Sum { hash, len: bytes.len() as u64, stamp }.render().as_bytes())
    }
}

/// A `.sum` file: `blake3 HASH LEN` and, once checked, `stamp DEV INO LEN MTIME.NS CTIME.NS` (the
/// [`FileStamp`] of the file it was last checked against). The snapshot-ready runtime's memory image has one too.
#[derive(Debug, Clone)]
pub(crate) struct Sum {
    pub(crate) hash: String,
    pub(crate) len: u64,
    pub(crate) stamp: Option<FileStamp>,
}

impl Sum {
    pub(crate) fn parse(text: &str) -> Option<Sum> {
        let mut lines = text.lines();
        let mut first = lines.next()?.split_whitespace();
        let (hash, len) = match (first.next(), first.next(), first.next(), first.next()) {
            (Some("blake3"), Some(hash), Some(len), None) if hash.len() == 64 => (hash.to_owned(), len.parse().ok()?),
            _ => return None,
        };
        let stamp = lines.next().and_then(|line| line.strip_prefix("stamp ")).and_then(FileStamp::parse);
        Some(Sum { hash, len, stamp })
    }

    pub(crate) fn render(&self) -> String {
        let mut text = format!("blake3 {} {}\n", self.hash, self.len);
        if let Some(stamp) = &self.stamp {
            text.push_str(&format!("stamp {}\n", stamp.render()));
        }
        text
    }
}

/// Records a use of the entry whose checksum file is `sum`: sets its modification time to now unless it is less
/// than [`LAST_USE_RESOLUTION`] old (one `stat` per hit; a write of the inode's times at most once an hour). Best
/// effort: a cache this process may not write is used all the same.
pub(crate) fn record_use(sum: &Path) {
    let Ok(file) = open_no_follow(sum) else { return };
    let Ok(modified) = file.metadata().and_then(|meta| meta.modified()) else { return };
    let now = SystemTime::now();
    // A time in the future (a clock set back) is corrected too.
    let recent = now.duration_since(modified).is_ok_and(|age| age < LAST_USE_RESOLUTION);
    if !recent {
        // futimens on a read-only descriptor: the owner may set a file's times without opening it for writing.
        let _ = file.set_modified(now);
    }
}

/// Opens `path` for reading, never through a link and never blocking on a FIFO.
fn open_no_follow(path: &Path) -> io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    let flags = nix::fcntl::OFlag::O_NOFOLLOW | nix::fcntl::OFlag::O_NONBLOCK;
    File::options().read(true).custom_flags(flags.bits()).open(path)
}

/// At most `max` bytes of the regular file `path` (more is an error, before anything is read).
fn read_bounded(path: &Path, max: u64) -> io::Result<Vec<u8>> {
    let file = open_no_follow(path)?;
    let meta = file.metadata()?;
    if !meta.file_type().is_file() || meta.len() > max {
        return Err(io::Error::new(io::ErrorKind::InvalidData, format!("not a regular file of at most {max} bytes")));
    }
    let mut bytes = Vec::new();
    file.take(max + 1).read_to_end(&mut bytes)?;
    Ok(bytes)
}

/// The PID in a temporary's name (`.NAME.PID.N.tmp`).
fn temporary_pid(name: &str) -> Option<u32> {
    let rest = name.strip_prefix('.')?.strip_suffix(".tmp")?;
    let mut parts = rest.rsplitn(3, '.');
    let (_counter, pid) = (parts.next()?.parse::<u64>().ok()?, parts.next()?);
    parts.next()?;
    pid.parse().ok()
}

/// Removes the temporaries that processes which are gone left in `dir` while they wrote (killed mid-store);
/// looks at 65536 entries at most.
fn sweep_temporaries(dir: &Path) {
    let Ok(entries) = fs::read_dir(dir) else { return };
    let me = std::process::id();
    for entry in entries.take(1 << 16).flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(temporary_pid) else { continue };
        if pid != me && !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = fs::remove_file(entry.path());
        }
    }
}

/// Writes `bytes` to a unique temporary file beside `path`, syncs it and renames it over `path`: whoever sees
/// `path` sees all of `bytes`, even after a crash.
pub(crate) fn write_atomically(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let tmp = dir.join(format!(".{name}.{}.{}.tmp", std::process::id(), TEMP_COUNTER.fetch_add(1, Ordering::Relaxed)));
    let result = (|| {
        let mut file = File::options().write(true).create_new(true).open(&tmp)?;
        file.write_all(bytes)?;
        file.sync_all()?;
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
    fn a_checked_entry_loads_without_rehashing_until_it_changes() {
        let dir = tempfile::tempdir().expect("tempdir");
        let cache = ModuleCache::new(dir.path());
        let engine = engine();
        let key = [5u8; 32];
        cache.load_or_compile(&engine, &key, || compile(&engine)).expect("compile");
        let (cwasm, sum) = cache.entry_paths(&key);
        let text = fs::read_to_string(&sum).expect("sum");
        assert!(text.lines().nth(1).is_some_and(|l| l.starts_with("stamp ")), "{text}");
        // Same length, same bytes rewritten in place: the stamp changes, so the file is hashed and passes.
        let bytes = fs::read(&cwasm).expect("read");
        fs::write(&cwasm, &bytes).expect("rewrite");
        let (_, outcome) = cache.load_or_compile(&engine, &key, || compile(&engine)).expect("load");
        assert_eq!(outcome, CacheOutcome::Hit);
        assert_ne!(fs::read_to_string(&sum).expect("sum"), text, "the new stamp is recorded");
    }

    #[test]
    fn components_are_cached_apart_from_modules_and_load_back() {
        let dir = tempfile::tempdir().expect("tempdir");
        let cache = ModuleCache::new(dir.path());
        let engine = engine();
        let (fingerprint, hash) = ([2u8; 32], [4u8; 32]);
        let key = ModuleCache::component_key(&fingerprint, &hash);
        assert_ne!(key, ModuleCache::key(&fingerprint, &hash));
        let component = || Component::new(&engine, "(component (core module))");
        let (_, first) = cache.load_or_compile(&engine, &key, component).expect("compile");
        let (_, second) = cache.load_or_compile(&engine, &key, component).expect("load");
        assert_eq!((first, second), (CacheOutcome::Compiled, CacheOutcome::Hit));
        // Rewritten in place: the stamp changes, the file is hashed in full, then read from its start.
        let (cwasm, _) = cache.entry_paths(&key);
        fs::write(&cwasm, fs::read(&cwasm).expect("read")).expect("rewrite");
        let (_, third) = cache.load_or_compile(&engine, &key, component).expect("load");
        assert_eq!(third, CacheOutcome::Hit);
        // A module's entry is not a component: wasmtime refuses it, and the entry is rebuilt.
        let module_key = [6u8; 32];
        cache.load_or_compile(&engine, &module_key, || compile(&engine)).expect("module");
        let (_, outcome) = cache.load_or_compile(&engine, &module_key, component).expect("rebuilt");
        assert_eq!(outcome, CacheOutcome::Rebuilt);
    }

    #[test]
    fn temporaries_of_dead_writers_are_swept_and_huge_sums_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let cache = ModuleCache::new(dir.path());
        let engine = engine();
        // A PID above the kernel's maximum cannot be running; this process's own is never swept.
        let dead = dir.path().join(format!(".{}.cwasm.4194305.0.tmp", hex(&[1u8; 32])));
        let mine = dir.path().join(format!(".x.sum.{}.9.tmp", std::process::id()));
        fs::write(&dead, b"half a module").expect("write");
        fs::write(&mine, b"in flight").expect("write");
        cache.load_or_compile(&engine, &[1u8; 32], || compile(&engine)).expect("compile");
        assert!(!dead.exists() && mine.exists());
        assert_eq!(temporary_pid(".a.b.cwasm.77.3.tmp"), Some(77));
        assert_eq!(temporary_pid(".a.tmp"), None);
        // A .sum of a megabyte is not read, let alone trusted: the entry is rebuilt.
        let (_, sum) = cache.entry_paths(&[1u8; 32]);
        fs::write(&sum, vec![b'a'; 1 << 20]).expect("huge sum");
        let (_, outcome) = cache.load_or_compile(&engine, &[1u8; 32], || compile(&engine)).expect("rebuild");
        assert_eq!(outcome, CacheOutcome::Rebuilt);
    }

    #[test]
    fn a_hit_refreshes_the_last_use_at_most_once_an_hour() {
        let dir = tempfile::tempdir().expect("tempdir");
        let cache = ModuleCache::new(dir.path());
        let engine = engine();
        let key = [8u8; 32];
        cache.load_or_compile(&engine, &key, || compile(&engine)).expect("compile");
        let (cwasm, sum) = cache.entry_paths(&key);
        let set_age = |age: Duration| {
            let file = File::options().write(true).open(&sum).expect("open sum");
            file.set_modified(SystemTime::now() - age).expect("set mtime");
        };
        let age = || SystemTime::now().duration_since(fs::metadata(&sum).expect("meta").modified().expect("mtime"));
        let cwasm_stamp = || FileStamp::of_metadata(&fs::metadata(&cwasm).expect("meta"));
        let before = cwasm_stamp();
        set_age(Duration::from_secs(2 * 3600));
        let (_, outcome) = cache.load_or_compile(&engine, &key, || compile(&engine)).expect("load");
        assert_eq!(outcome, CacheOutcome::Hit);
        assert!(age().is_ok_and(|age| age < Duration::from_secs(60)), "a hit on an entry idle for 2 h refreshes it");
        // Used 10 minutes ago: not written again.
        set_age(Duration::from_secs(600));
        cache.load_or_compile(&engine, &key, || compile(&engine)).expect("load");
        assert!(age().is_ok_and(|age| age >= Duration::from_secs(600)), "{:?}", age());
        // The module's own stamp is untouched: the entry is not hashed again.
        assert_eq!(cwasm_stamp(), before);
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
        assert_eq!(names.len(), 3, "the entry, its sum and its lock file: {names:?}");
        assert!(names.iter().all(|n| !n.ends_with(".tmp")), "{names:?}");
    }
}

/// Entry points of the fuzz targets (`fuzz/`): the entry loader, reachable without a compile.
#[doc(hidden)]
pub mod fuzzing;
