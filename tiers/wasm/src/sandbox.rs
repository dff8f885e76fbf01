//! A live wasm sandbox: a set of capabilities and limits that several jobs run under in turn, and file access
//! to its grants from the host side with the same confinement the guest has. WASI commands run in fresh
//! instances; Python runs in one live interpreter per sandbox, started by the first Python job.

use std::path::{Component, Path, PathBuf};
use std::sync::Arc;

use cap_std::ambient_authority;
use cap_std::fs::Dir;
use strata_core::{
    Capabilities, ExecOptions, Grant, GrantMode, Job, Limits, Outcome, Sandbox, Snapshot, SnapshotWriter, TierError,
    TierKind,
};

use crate::TierInner;
use crate::python::PythonSession;

/// A sandbox on the wasm tier.
pub struct WasmSandbox {
    tier: Arc<TierInner>,
    caps: Capabilities,
    limits: Limits,
    python: Option<PythonSession>,
    /// The id of the snapshot it was forked from.
    parent: Option<String>,
}

impl std::fmt::Debug for WasmSandbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WasmSandbox").field("caps", &self.caps).field("limits", &self.limits).finish()
    }
}

impl WasmSandbox {
    pub(crate) fn new(tier: Arc<TierInner>, caps: Capabilities, limits: Limits) -> WasmSandbox {
        WasmSandbox { tier, caps, limits, python: None, parent: None }
    }

    /// A sandbox forked from a snapshot, with its restored interpreter (if it had one).
    pub(crate) fn restored(
        tier: Arc<TierInner>,
        caps: Capabilities,
        limits: Limits,
        python: Option<PythonSession>,
        parent: Option<String>,
    ) -> WasmSandbox {
        WasmSandbox { tier, caps, limits, python, parent }
    }

    /// Finds the grant holding `guest_path` (the longest matching guest prefix) and the path inside it.
    fn resolve(&self, guest_path: &str) -> Result<(&Grant, PathBuf), TierError> {
        let bad = |reason: &str| TierError::GuestPath { path: guest_path.to_owned(), reason: reason.to_owned() };
        if !guest_path.starts_with('/') {
            return Err(bad("must be absolute"));
        }
        let mut inner = PathBuf::new();
        for component in Path::new(guest_path).components() {
            match component {
                Component::RootDir | Component::CurDir => {}
                Component::Normal(part) => inner.push(part),
                Component::ParentDir | Component::Prefix(_) => {
                    return Err(bad("must not contain `..`"));
                }
            }
        }
        let normal = format!("/{}", inner.display());
        let grant = self
            .caps
            .grants
            .iter()
            .filter(|g| g.guest == "/" || normal == g.guest || normal.starts_with(&format!("{}/", g.guest)))
            .max_by_key(|g| g.guest.len())
            .ok_or_else(|| bad("is not inside any grant"))?;
        let relative = inner.strip_prefix(grant.guest.trim_start_matches('/')).unwrap_or(&inner).to_path_buf();
        if relative.as_os_str().is_empty() {
            return Err(bad("names a grant's directory, not a file in it"));
        }
        Ok((grant, relative))
    }
}

fn open_grant(grant: &Grant) -> Result<Dir, TierError> {
    Dir::open_ambient_dir(&grant.host, ambient_authority())
        .map_err(|_| TierError::Capability(strata_core::CapsError::GrantNotFound(grant.host.clone())))
}

impl Sandbox for WasmSandbox {
    fn tier(&self) -> TierKind {
        TierKind::Wasm
    }

    fn exec(&mut self, job: &Job, opts: ExecOptions) -> Result<Outcome, TierError> {
        let limits = opts.limits.clone().unwrap_or_else(|| self.limits.clone());
        let Job::Python { source, args } = job else {
            return self.tier.run(job, &self.caps, &limits, opts);
        };
        if self.python.is_none() {
            crate::exec::refuse_net(&self.caps, crate::exec::PYTHON)?;
            // The session's fuel mode is the sandbox's: fuel-metered code only when its limits set fuel.
            let (artifacts, module, runtime) = self.tier.python_session(self.limits.fuel.limit().is_some())?;
            let tools = self.tier.tools(&self.caps)?;
            self.python =
                Some(PythonSession::start(runtime, &module, &artifacts, &self.caps, &self.limits, tools, None)?);
        }
        let Some(session) = self.python.as_mut() else {
            return Err(TierError::SessionEnded { reason: "the session did not start".into() });
        };
        let runtime = self.tier.runtime_of(session.metered(), session.allocation())?;
        session.turn(runtime, source, args, &limits, &opts)
    }

    fn write_file(&mut self, guest_path: &str, contents: &[u8]) -> Result<(), TierError> {
        let (grant, relative) = self.resolve(guest_path)?;
        if grant.mode == GrantMode::Ro {
            return Err(TierError::GuestPath { path: guest_path.to_owned(), reason: "is in a read-only grant".into() });
        }
        open_grant(grant)?
            .write(&relative, contents)
            .map_err(|e| TierError::GuestPath { path: guest_path.to_owned(), reason: format!("cannot write: {e}") })
    }

    fn read_file(&mut self, guest_path: &str) -> Result<Vec<u8>, TierError> {
        let (grant, relative) = self.resolve(guest_path)?;
        open_grant(grant)?
            .read(&relative)
            .map_err(|e| TierError::GuestPath { path: guest_path.to_owned(), reason: format!("cannot read: {e}") })
    }

    /// Secrets are never written to disk: a snapshot records their names only, and a Python session started
    /// with secrets (whose values are in the interpreter's memory) is not snapshotted at all.
    fn snapshot(&mut self, destination: &Path) -> Result<Snapshot, TierError> {
        let secret_names: Vec<&str> = self.caps.secrets.iter().map(|s| s.name.as_str()).collect();
        if self.python.is_some() && !secret_names.is_empty() {
            return Err(TierError::Unsupported {
                tier: TierKind::Wasm,
                what: format!(
                    "snapshots of a Python session started with secrets ({}): their values are in the \
                     interpreter's memory, and secrets are never written to disk",
                    secret_names.join(", ")
                ),
            });
        }
        let mut caps = self.caps.clone();
        for secret in &mut caps.secrets {
            secret.value.clear();
        }
        let writer = SnapshotWriter::create(destination, &self.tier.config.snapshots)?;
        let python = match self.python.as_mut() {
            Some(session) => Some(session.snapshot(writer.dir())?),
            None => None,
        };
        let state = crate::snapshot::SandboxState {
            format: crate::snapshot::STATE_FORMAT,
            caps,
            limits: self.limits.clone(),
            python,
        };
        state.write(writer.dir())?;
        Ok(writer.commit(TierKind::Wasm, self.parent.clone(), state.persists(), state.meta())?)
    }

    fn close(mut self: Box<Self>) -> Result<(), TierError> {
        self.shutdown();
        Ok(())
    }
}

impl WasmSandbox {
    /// Finalises the Python interpreter, if one was started. WASI commands leave nothing behind: each exec's
    /// instance is gone when it returns.
    fn shutdown(&mut self) {
        if let Some(mut session) = self.python.take()
            && let Ok(runtime) = self.tier.runtime_of(session.metered(), session.allocation())
        {
            session.close(runtime);
        }
    }
}

impl Drop for WasmSandbox {
    fn drop(&mut self) {
        self.shutdown();
    }
}
