//! Snapshots and forks of wasm sandboxes: a snapshot's files, saved from a live interpreter and read back by a
//! fork. The submodules make an interpreter snapshottable in the first place:
//!
//! - [`ready_module`]: the rewrite that makes a module snapshot-ready (its globals exported, its data segments
//!   laid out into a memory image);
//! - [`ready_runtime`]: the snapshot-ready Python runtime, made once per runtime and kept in the module cache;
//! - [`memory_image`]: linear memories mapped copy-on-write from a memory image, a fresh session's or a fork's.
//!
//! A wasm sandbox's state between jobs is its capabilities and limits and, once a Python job has run, its
//! interpreter: one instance of the snapshot-ready Python runtime. A snapshot holds
//!
//! ```text
//! state.json    SandboxState: format, capabilities, limits, and for the interpreter: the runtime's identity,
//!               fuel mode, memory size, the values of every mutable global, the monotonic clock's reading
//! memory.img    the interpreter's linear memory, byte for byte (zero pages left as holes)
//! tmp/…         the interpreter's scratch /tmp, file for file
//! ```
//!
//! beside the manifest that [`strata_core::SnapshotWriter`] seals with the host's key. A fork re-opens the
//! snapshot with the tier's [`strata_core::SnapshotTrust`] first and reads nothing else: `state.json` (which holds
//! the capabilities a fork gets) is parsed from the sealed bytes as they are read ([`Snapshot::read_file`]),
//! `memory.img` is mapped from the descriptor that was verified ([`Snapshot::open_file`]), and `tmp/` is copied
//! file by file from what the manifest lists, its directories walked without following a link. Grants are host
//! directories: a fork sees the same ones, live, not a copy. A fork maps `memory.img` copy-on-write as the new
//! instance's memory (no compile, no copy: the compiled snapshot-ready runtime is the one every session uses),
//! sets the globals, copies `tmp/` into a scratch directory of its own and gets a new WASI context from the
//! capabilities: the same stdio and preopens in the same order (wasi-libc's preopen table is in the memory),
//! fresh randomness (WASI's random source is seeded per context; Python's `random` and `numpy.random` are
//! reseeded from it before the fork's first job), a wall clock that is the host's and a monotonic clock that
//! goes on from the snapshot's reading.
//!
//! Refused with a typed error rather than snapshotted wrongly: a session with guest files open beyond stdio
//! and the preopens (their host descriptors cannot be carried over), a session that ended, a Python runtime
//! that could not be made snapshot-ready, and a Python session started with secrets (their values are in its
//! memory; secrets are never written to disk). A sandbox without an interpreter records its secrets by name
//! only, and its snapshot cannot be forked without them.

use std::fs::{self, File};
use std::io::{Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use strata_core::{Capabilities, Limits, Persisted, Snapshot, SnapshotError, TierError, TierKind};
use wasmtime::{Extern, Instance, Store, Val, ValType};
use wasmtime_wasi::p1::WasiP1Ctx;

use self::memory_image::MemoryImage;
use self::ready_module::{GLOBAL_EXPORT_PREFIX, WASM_PAGE};
use crate::error::{internal, internal_from};

#[doc(hidden)]
pub mod fuzzing;
pub(crate) mod memory_image;
mod ready_module;
pub(crate) mod ready_runtime;

/// The state file's name.
pub(crate) const STATE_FILE: &str = "state.json";
/// The linear memory's file name.
pub(crate) const MEMORY_FILE: &str = "memory.img";
/// The scratch `/tmp`'s directory name.
pub(crate) const SCRATCH_DIR: &str = "tmp";
/// The format of `state.json` this build writes and reads.
pub(crate) const STATE_FORMAT: u32 = 1;
/// A state file larger than this is not one of ours.
const MAX_STATE_BYTES: u64 = 16 << 20;
/// The largest linear memory a wasm32 module can have: 65536 pages.
const MAX_WASM32_MEMORY: u64 = WASM_PAGE << 16;
/// How many descriptor numbers past the preopens are checked for open files.
const DESCRIPTOR_PROBE: u32 = 4096;

/// The value of one exported mutable global.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct GlobalValue {
    /// Its export name (`strata:global:<index>`).
    pub(crate) name: String,
    /// `i32`, `i64`, `f32` or `f64`.
    #[serde(rename = "type")]
    pub(crate) ty: String,
    /// Its bits, zero-extended.
    pub(crate) bits: u64,
}

/// The interpreter's part of a snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct PythonState {
    /// [`ReadyRuntime::identity`](ready_runtime::ReadyRuntime::identity) of the runtime it ran.
    pub(crate) runtime: String,
    /// Whether it ran fuel-metered code.
    pub(crate) metered: bool,
    /// The size of `memory.img`.
    pub(crate) memory_bytes: u64,
    /// Every exported mutable global.
    pub(crate) globals: Vec<GlobalValue>,
    /// The guest's monotonic clock at the snapshot, in nanoseconds.
    pub(crate) monotonic_ns: u64,
    /// Whether `tmp/` holds its scratch `/tmp` (no: a grant is mounted there).
    pub(crate) scratch: bool,
}

/// `state.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct SandboxState {
    /// [`STATE_FORMAT`].
    pub(crate) format: u32,
    /// The sandbox's capabilities, secrets by name only (their values are never written to disk).
    pub(crate) caps: Capabilities,
    /// The sandbox's limits.
    pub(crate) limits: Limits,
    /// The interpreter, if one was running.
    pub(crate) python: Option<PythonState>,
}

impl SandboxState {
    /// What a fork of it gets back, for the manifest.
    pub(crate) fn persists(&self) -> Vec<Persisted> {
        match &self.python {
            Some(python) if python.scratch => vec![Persisted::Memory, Persisted::Descriptors, Persisted::Filesystem],
            Some(_) => vec![Persisted::Memory, Persisted::Descriptors],
            None => Vec::new(),
        }
    }

    /// The manifest's `meta`.
    pub(crate) fn meta(&self) -> serde_json::Value {
        serde_json::json!({
            "state": STATE_FILE,
            "state_format": STATE_FORMAT,
            "python": self.python.as_ref().map(|p| serde_json::json!({
                "runtime": p.runtime,
                "memory_bytes": p.memory_bytes,
                "metered": p.metered,
            })),
        })
    }

    /// Writes `state.json` into a snapshot being written.
    pub(crate) fn write(&self, dir: &Path) -> Result<(), TierError> {
        let path = dir.join(STATE_FILE);
        let text = serde_json::to_vec_pretty(self).map_err(|e| internal_from("cannot encode the state", e))?;
        fs::write(&path, text).map_err(|source| TierError::Snapshot(SnapshotError::Io { path, source }))
    }

    /// Reads and checks `state.json` of a verified snapshot.
    pub(crate) fn read(snapshot: &Snapshot) -> Result<SandboxState, TierError> {
        if snapshot.tier != TierKind::Wasm {
            return Err(SnapshotError::WrongTier {
                dir: snapshot.dir.clone(),
                expected: TierKind::Wasm,
                found: snapshot.tier,
            }
            .into());
        }
        let path = snapshot.file(STATE_FILE);
        let invalid = |message: String| {
            TierError::Snapshot(SnapshotError::InvalidManifest {
                dir: snapshot.dir.clone(),
                message: format!("{STATE_FILE}: {message}"),
            })
        };
        if snapshot.listed(STATE_FILE).is_none() {
            return Err(SnapshotError::MissingFile(path).into());
        }
        // The bytes the manifest sealed, checked as they are read: nothing else is parsed.
        let text = snapshot.read_file(STATE_FILE, MAX_STATE_BYTES)?;
        let state: SandboxState = serde_json::from_slice(&text).map_err(|e| invalid(e.to_string()))?;
        if state.format != STATE_FORMAT {
            return Err(invalid(format!("format {} (this build reads {STATE_FORMAT})", state.format)));
        }
        if let Some(python) = &state.python {
            let memory = snapshot.manifest.files.iter().find(|f| f.path == MEMORY_FILE);
            match memory {
                Some(file) if file.size == python.memory_bytes => {}
                Some(file) => {
                    return Err(invalid(format!(
                        "memory_bytes is {} but {MEMORY_FILE} is {} bytes",
                        python.memory_bytes, file.size
                    )));
                }
                None => return Err(SnapshotError::MissingFile(snapshot.file(MEMORY_FILE)).into()),
            }
            if !python.memory_bytes.is_multiple_of(WASM_PAGE) || python.memory_bytes > MAX_WASM32_MEMORY {
                return Err(invalid(format!("memory_bytes {} is not a wasm memory size", python.memory_bytes)));
            }
        }
        Ok(state)
    }
}

fn storage<'p>(what: &'static str, path: &'p Path) -> impl FnOnce(std::io::Error) -> TierError + 'p {
    move |source| TierError::Storage { what, path: path.to_owned(), source }
}

/// Reads every exported mutable global of a snapshot-ready instance.
pub(crate) fn read_globals<T: 'static>(
    store: &mut Store<T>,
    instance: &Instance,
) -> Result<Vec<GlobalValue>, TierError> {
    let globals: Vec<(String, wasmtime::Global)> = instance
        .exports(&mut *store)
        .filter(|e| e.name().starts_with(GLOBAL_EXPORT_PREFIX))
        .filter_map(|e| {
            let name = e.name().to_owned();
            e.into_global().map(|g| (name, g))
        })
        .collect();
    let mut values = Vec::with_capacity(globals.len());
    for (name, global) in globals {
        let (ty, bits) = match global.get(&mut *store) {
            Val::I32(v) => ("i32", u64::from(v as u32)),
            Val::I64(v) => ("i64", v as u64),
            Val::F32(v) => ("f32", u64::from(v)),
            Val::F64(v) => ("f64", v),
            other => return Err(internal(format!("global {name} holds an unsupported value {other:?}"))),
        };
        values.push(GlobalValue { name, ty: ty.into(), bits });
    }
    Ok(values)
}

/// Sets the exported mutable globals of a fresh instance to a snapshot's values: exactly the globals the
/// instance exports, each of its own type.
pub(crate) fn set_globals<T: 'static>(
    store: &mut Store<T>,
    instance: &Instance,
    values: &[GlobalValue],
) -> Result<(), TierError> {
    let mismatch = |what: String| TierError::Unsupported {
        tier: TierKind::Wasm,
        what: format!("a snapshot whose globals do not fit this runtime ({what})"),
    };
    let exported = instance.exports(&mut *store).filter(|e| e.name().starts_with(GLOBAL_EXPORT_PREFIX)).count();
    if exported != values.len() {
        return Err(mismatch(format!("{} saved, {exported} in the runtime", values.len())));
    }
    for value in values {
        let Some(Extern::Global(global)) = instance.get_export(&mut *store, &value.name) else {
            return Err(mismatch(format!("no global {}", value.name)));
        };
        let val = match (global.ty(&*store).content(), value.ty.as_str()) {
            (ValType::I32, "i32") => {
                Val::I32(u32::try_from(value.bits).map_err(|_| mismatch(value.name.clone()))? as i32)
            }
            (ValType::I64, "i64") => Val::I64(value.bits as i64),
            (ValType::F32, "f32") => Val::F32(u32::try_from(value.bits).map_err(|_| mismatch(value.name.clone()))?),
            (ValType::F64, "f64") => Val::F64(value.bits),
            (ty, saved) => return Err(mismatch(format!("{} is {ty} here, {saved} in the snapshot", value.name))),
        };
        global.set(&mut *store, val).map_err(|e| mismatch(format!("{}: {e}", value.name)))?;
    }
    Ok(())
}

/// Refuses a snapshot while the guest has files open beyond stdio and the preopens (`0..first_free`): their
/// host descriptors cannot be carried into a fork. Runs on the job's executor.
pub(crate) async fn check_descriptors(wasi: &mut WasiP1Ctx, first_free: u32) -> Result<(), TierError> {
    use wasmtime_wasi::p1::wasi_snapshot_preview1::WasiSnapshotPreview1;
    let mut open = Vec::new();
    let mut none: [u8; 0] = [];
    let mut memory = wiggle::GuestMemory::Unshared(&mut none);
    for fd in first_free..first_free.saturating_add(DESCRIPTOR_PROBE) {
        if wasi.fd_fdstat_get(&mut memory, fd.into()).await.is_ok() {
            open.push(fd);
            if open.len() >= 8 {
                break;
            }
        }
    }
    if open.is_empty() {
        return Ok(());
    }
    Err(TierError::Unsupported {
        tier: TierKind::Wasm,
        what: format!(
            "snapshots of a session with files open (guest descriptors {open:?}); close them before the snapshot"
        ),
    })
}

/// Writes a linear memory to `path`, leaving its all-zero pages as holes.
pub(crate) fn write_memory(path: &Path, memory: &[u8]) -> Result<(), TierError> {
    const CHUNK: usize = 1 << 16;
    let fail = |source| TierError::Snapshot(SnapshotError::Io { path: path.to_owned(), source });
    let mut file = File::create(path).map_err(fail)?;
    for (i, chunk) in memory.chunks(CHUNK).enumerate() {
        if chunk.iter().all(|b| *b == 0) {
            continue;
        }
        file.seek(SeekFrom::Start((i * CHUNK) as u64)).map_err(fail)?;
        file.write_all(chunk).map_err(fail)?;
    }
    file.set_len(memory.len() as u64).map_err(fail)?;
    Ok(())
}

/// Copies the directory tree `from` into `to` (created): directories and regular files. Anything else (a
/// symlink the guest made) is refused, as a snapshot holds regular files only.
pub(crate) fn copy_tree(from: &Path, to: &Path) -> Result<(), TierError> {
    fs::create_dir(to).map_err(storage("cannot create the snapshot directory", to))?;
    copy_into(from, to)
}

/// Copies the contents of `from` into the existing directory `to`; see [`copy_tree`].
fn copy_into(from: &Path, to: &Path) -> Result<(), TierError> {
    let mut pending = vec![(from.to_owned(), to.to_owned())];
    while let Some((src, dst)) = pending.pop() {
        for entry in fs::read_dir(&src).map_err(storage("cannot read the scratch directory", &src))? {
            let entry = entry.map_err(storage("cannot read the scratch directory", &src))?;
            let kind = entry.file_type().map_err(storage("cannot read the scratch directory", &src))?;
            let target: PathBuf = dst.join(entry.file_name());
            if kind.is_dir() {
                fs::create_dir(&target).map_err(storage("cannot copy the scratch directory to", &target))?;
                pending.push((entry.path(), target));
            } else if kind.is_file() {
                fs::copy(entry.path(), &target).map_err(storage("cannot copy a scratch file to", &target))?;
            } else {
                return Err(TierError::Unsupported {
                    tier: TierKind::Wasm,
                    what: format!(
                        "snapshots of a scratch /tmp holding {} (not a file or directory)",
                        entry.path().strip_prefix(from).unwrap_or(&entry.path()).display()
                    ),
                });
            }
        }
    }
    Ok(())
}

/// Most directories a fork's scratch `/tmp` is restored with, and how deep.
const MAX_SCRATCH_DIRS: usize = 4096;
const MAX_SCRATCH_DEPTH: usize = 64;

/// A fork's scratch `/tmp`: a new private directory holding a copy of the snapshot's `tmp/` — its directories
/// (walked without following a link, bounded) and the files the manifest lists under it, each read from the file
/// the snapshot was verified with ([`Snapshot::open_file`]); nothing else of the directory is read.
pub(crate) fn restore_scratch(snapshot: &Snapshot) -> Result<tempfile::TempDir, TierError> {
    let dir = tempfile::Builder::new().prefix("strata-scratch-").tempdir().map_err(|source| TierError::Storage {
        what: "cannot create a scratch directory in",
        path: std::env::temp_dir(),
        source,
    })?;
    for relative in scratch_dirs(snapshot)? {
        let target = dir.path().join(&relative);
        fs::create_dir_all(&target).map_err(storage("cannot copy the scratch directory to", &target))?;
    }
    let prefix = format!("{SCRATCH_DIR}/");
    for file in &snapshot.manifest.files {
        let Some(relative) = file.path.strip_prefix(&prefix) else { continue };
        let target = dir.path().join(relative);
        if let Some(parent) = target.parent() {
            fs::create_dir_all(parent).map_err(storage("cannot copy the scratch directory to", parent))?;
        }
        let from = snapshot.open_file(&file.path)?;
        let mut to = File::options()
            .write(true)
            .create_new(true)
            .open(&target)
            .map_err(storage("cannot copy a scratch file to", &target))?;
        let copied = std::io::copy(&mut std::io::Read::take(from, file.size), &mut to)
            .map_err(storage("cannot copy a scratch file to", &target))?;
        if copied != file.size {
            return Err(SnapshotError::SizeMismatch {
                path: snapshot.file(&file.path),
                expected: file.size,
                found: copied,
            }
            .into());
        }
    }
    Ok(dir)
}

/// The directories under the snapshot's `tmp/` (relative to it), walked by descriptor without following links.
fn scratch_dirs(snapshot: &Snapshot) -> Result<Vec<PathBuf>, TierError> {
    use nix::sys::stat::{SFlag, fstatat};
    use strata_core::dirfd;
    let io = |path: PathBuf| move |errno: nix::errno::Errno| SnapshotError::Io { path, source: errno.into() };
    let root: std::os::fd::OwnedFd = match File::open(&snapshot.dir) {
        Ok(root) => root.into(),
        Err(source) => return Err(SnapshotError::Io { path: snapshot.dir.clone(), source }.into()),
    };
    let top = match dirfd::open_beneath(&root, Path::new(SCRATCH_DIR)) {
        Ok(top) => top,
        Err(nix::errno::Errno::ENOENT) => return Ok(Vec::new()),
        Err(errno) => return Err(io(snapshot.file(SCRATCH_DIR))(errno).into()),
    };
    let mut found = Vec::new();
    let mut pending = vec![(top, PathBuf::new(), 0usize)];
    while let Some((fd, relative, depth)) = pending.pop() {
        let here = snapshot.file(SCRATCH_DIR).join(&relative);
        for name in dirfd::names_in(&fd).map_err(io(here.clone()))? {
            let Ok(st) = fstatat(&fd, name.as_os_str(), nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW) else { continue };
            if dirfd::kind_of(&st) != SFlag::S_IFDIR {
                continue;
            }
            if found.len() >= MAX_SCRATCH_DIRS || depth >= MAX_SCRATCH_DEPTH {
                return Err(SnapshotError::TooLarge {
                    path: here,
                    message: format!(
                        "a scratch /tmp of more than {MAX_SCRATCH_DIRS} directories or {MAX_SCRATCH_DEPTH} levels"
                    ),
                }
                .into());
            }
            let child = relative.join(&name);
            let Ok(child_fd) =
                nix::fcntl::openat(&fd, name.as_os_str(), dirfd::DIR_FLAGS, nix::sys::stat::Mode::empty())
            else {
                continue;
            };
            found.push(child.clone());
            pending.push((child_fd, child, depth + 1));
        }
    }
    Ok(found)
}

/// A snapshot's memory file as an image to map: its private copy ([`Snapshot::private_copy`]), made once and
/// checked against the manifest as it is made; nothing done to the file afterwards reaches a fork.
pub(crate) fn open_memory(snapshot: &Snapshot, expected: u64) -> Result<Arc<MemoryImage>, TierError> {
    let path = snapshot.file(MEMORY_FILE);
    let copy = snapshot.private_copy(MEMORY_FILE)?;
    if copy.len() != expected {
        return Err(SnapshotError::SizeMismatch { path, expected, found: copy.len() }.into());
    }
    let image = MemoryImage::new(copy).map_err(|source| TierError::Snapshot(SnapshotError::Io { path, source }))?;
    Ok(Arc::new(image))
}
