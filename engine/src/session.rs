//! A wasm Python session is one interpreter on one tier for its whole life: the engine never runs part of a session
//! elsewhere. [`WasmSession`] wraps every wasm sandbox [`Engine::start`](crate::Engine::start) makes and judges each
//! Python job by the same import scan as the router ([`scan::judge_source`]) before the interpreter sees it:
//!
//! - a session `Auto` started refuses a job the router would send to a native tier (it needs processes, sockets,
//!   native extensions, or computes with numpy whose wasm32 integers could differ) with
//!   [`TierError::SessionTier`], naming the reason and the tier that would run it;
//! - numpy on wasm32 runs where the user asked for it (a session started with `Tier(Wasm)`, or the policy's
//!   `python_wasm_numpy`), and its outcome says so (`"platform":"wasm32"`).

use std::path::Path;
use std::sync::Arc;

use strata_core::{
    EntryInfo, ExecOptions, GuestPath, Job, Outcome, Platform, Sandbox, Snapshot, TierError, TierKind, Watcher,
};

use crate::scan::{self, PythonVerdict, Wasm32Numerics, WasmModules};

/// Whether the user chose the session's tier or the engine did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Chosen {
    /// `TierChoice::Auto`: the session refuses what wasm cannot run as native code would.
    ByEngine,
    /// `TierChoice::Tier(Wasm)`: the session runs what it is given, as asked.
    ByUser,
}

/// A wasm sandbox whose Python jobs are judged before they run ([the module docs](self)).
pub(crate) struct WasmSession {
    inner: Box<dyn Sandbox>,
    chosen: Chosen,
    /// `python_wasm_numpy`: numpy on wasm32 accepted by the policy.
    numerics: Wasm32Numerics,
    /// The tier a refused job would run on (the policy's native tier).
    native: TierKind,
    /// The wasm build's module list, when it could be made.
    modules: Option<Arc<WasmModules>>,
}

impl std::fmt::Debug for WasmSession {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WasmSession").field("chosen", &self.chosen).field("numerics", &self.numerics).finish()
    }
}

impl WasmSession {
    pub(crate) fn new(
        inner: Box<dyn Sandbox>,
        chosen: Chosen,
        numerics: Wasm32Numerics,
        native: TierKind,
        modules: Option<Arc<WasmModules>>,
    ) -> WasmSession {
        WasmSession { inner, chosen, numerics, native, modules }
    }

    /// Whether `job` may run here, and whether it computes with numpy on wasm32.
    fn admit(&self, job: &Job) -> Result<bool, TierError> {
        let Job::Python { source, .. } = job else { return Ok(false) };
        // Judged as if numerics were refused, to know whether the job computes with numpy at all.
        let verdict = scan::judge_source(source, Wasm32Numerics::Refused, || self.modules.as_deref());
        let refuse = |reason: String| TierError::SessionTier { session: TierKind::Wasm, needs: self.native, reason };
        match (verdict, self.chosen) {
            (PythonVerdict::Wasm(_), _) => Ok(false),
            (PythonVerdict::Numerics(_), Chosen::ByUser) => Ok(true),
            (PythonVerdict::Numerics(_), Chosen::ByEngine) if self.numerics == Wasm32Numerics::Accepted => Ok(true),
            (PythonVerdict::Numerics(reason) | PythonVerdict::Native(reason), Chosen::ByEngine) => Err(refuse(reason)),
            (PythonVerdict::Native(_), Chosen::ByUser) => Ok(false),
        }
    }
}

impl Sandbox for WasmSession {
    fn tier(&self) -> TierKind {
        self.inner.tier()
    }

    fn exec(&self, job: &Job, opts: ExecOptions) -> Result<Outcome, TierError> {
        let wasm32_numerics = self.admit(job)?;
        let mut outcome = self.inner.exec(job, opts)?;
        if wasm32_numerics {
            outcome.platform = Some(Platform::Wasm32);
        }
        Ok(outcome)
    }

    fn write_file(&self, guest_path: &str, contents: &[u8]) -> Result<(), TierError> {
        self.inner.write_file(guest_path, contents)
    }

    fn read_file(&self, guest_path: &str) -> Result<Vec<u8>, TierError> {
        self.inner.read_file(guest_path)
    }

    fn snapshot(&self, destination: &Path) -> Result<Snapshot, TierError> {
        self.inner.snapshot(destination)
    }

    fn usage(&self) -> Result<strata_core::SandboxUsage, TierError> {
        self.inner.usage()
    }

    fn set_network(&self, net: &strata_core::Net) -> Result<(), TierError> {
        self.inner.set_network(net)
    }

    fn list_dir(&self, path: &GuestPath, depth: u32) -> Result<Vec<EntryInfo>, TierError> {
        self.inner.list_dir(path, depth)
    }

    fn stat(&self, path: &GuestPath) -> Result<EntryInfo, TierError> {
        self.inner.stat(path)
    }

    fn make_dir(&self, path: &GuestPath) -> Result<bool, TierError> {
        self.inner.make_dir(path)
    }

    fn rename(&self, from: &GuestPath, to: &GuestPath) -> Result<EntryInfo, TierError> {
        self.inner.rename(from, to)
    }

    fn remove(&self, path: &GuestPath) -> Result<(), TierError> {
        self.inner.remove(path)
    }

    fn watch(&self, path: &GuestPath, recursive: bool) -> Result<Watcher, TierError> {
        self.inner.watch(path, recursive)
    }

    fn close(&self) -> Result<(), TierError> {
        self.inner.close()
    }
}
