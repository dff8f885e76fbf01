//! The Strata engine: the facade embedders call.
//!
//! ```no_run
//! use strata_engine::{Engine, EngineConfig, RunRequest};
//! use strata_core::Job;
//!
//! let engine = Engine::new(EngineConfig::from_env()?)?;
//! let job = Job::wasm_file("hello.wasm", vec!["world".into()]);
//! let outcome = engine.execute(RunRequest::new(&job))?;
//! println!("{} -> {}", outcome.status, String::from_utf8_lossy(&outcome.stdout));
//! # Ok::<(), strata_engine::EngineError>(())
//! ```
//!
//! [`Engine::execute`] routes each job ([`RunRequest`]) to a tier ([`TierChoice::Auto`] picks the cheapest that can run it) and
//! returns its [`Outcome`]; [`Engine::start`] opens a [`Sandbox`] that runs several jobs in turn (for Python,
//! turns of one live interpreter). Three tiers: wasm (WebAssembly and Python), process (Linux programs and the
//! Debian image's CPython in a jail) and microVM (the same jobs in a KVM guest of their own, where the host has
//! hardware KVM; elsewhere asking for it is a typed [`EngineError::TierUnavailable`] at once, and `Auto` falls back
//! to the process tier when the policy allows, recorded in the outcome's `escalations`).
//!
//! A Python job `Auto` sent to wasm that fails there for a reason the policy's `[escalation]` marks escalatable (a
//! module the wasm build lacks, an OS call WASI does not support) re-runs on the native tier from a clean state,
//! recorded in `escalations` too ([`escalate`]).

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod build;
pub mod cache;
pub mod doctor;
pub mod escalate;
mod image_start;
pub mod images;
pub mod policy;
pub mod request;
pub mod router;
pub mod scan;
mod session;
pub mod warm;

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use std::sync::{Arc, OnceLock};

use strata_core::{
    Capabilities, Escalation, ExecOptions, ImageName, Job, JobKind, Limits, Net, Outcome, PythonSource, RouteDecision,
    Sandbox, Snapshot, SnapshotBounds, SnapshotError, SnapshotKey, SnapshotTrust, Status, Tier, TierError, TierKind,
    ToolRegistry,
};
use strata_image_store::ImageStore;
use strata_python_image::PythonImage;
use strata_rootfs_image::DebianImage;
use strata_tier_process::{ProcessTier, ProcessTierConfig};
use strata_tier_wasm::{PythonArtifacts, PythonProvider, WasmTier, WasmTierConfig};

pub use images::Images;
pub use policy::{Policy, PolicyError};
pub use request::RunRequest;
pub use router::{RoutePlan, Router, TierSet};
pub use strata_core;

/// Which tier a job should run on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TierChoice {
    /// The cheapest tier that can run the job.
    #[default]
    Auto,
    /// A specific tier.
    Tier(TierKind),
}

impl FromStr for TierChoice {
    type Err = EngineError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(TierChoice::Auto),
            "wasm" => Ok(TierChoice::Tier(TierKind::Wasm)),
            "process" => Ok(TierChoice::Tier(TierKind::Process)),
            "vm" | "microvm" => Ok(TierChoice::Tier(TierKind::Microvm)),
            other => Err(EngineError::UnknownTier(other.to_owned())),
        }
    }
}

impl fmt::Display for TierChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TierChoice::Auto => f.write_str("auto"),
            TierChoice::Tier(tier) => tier.fmt(f),
        }
    }
}

/// Where [`Engine::route`] sends a job.
pub struct Route {
    /// The tier that runs it.
    pub tier: Arc<dyn Tier>,
    /// Set when the preferred tier could not run here and the policy let the job fall back to this one.
    pub escalation: Option<Escalation>,
    /// The tier and why, as the outcome's `route` reports it.
    pub decision: RouteDecision,
}

impl fmt::Debug for Route {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Route")
            .field("tier", &self.tier.kind())
            .field("escalation", &self.escalation)
            .field("decision", &self.decision)
            .finish()
    }
}

/// The engine's tiers as the router sees them: available when they start.
struct EngineTiers<'e>(&'e Engine);

impl TierSet for EngineTiers<'_> {
    fn available(&self, tier: TierKind) -> Result<(), EngineError> {
        self.0.tier(tier).map(drop)
    }
}

/// The root filesystem of a microVM's jobs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum VmImage {
    /// The initramfs alone (the agent and busybox): the fastest boot.
    Initramfs,
    /// The Debian image as a read-only disk with a tmpfs overlay: python3, coreutils and the rest.
    #[default]
    Debian,
}

impl FromStr for VmImage {
    type Err = EngineError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "initramfs" => Ok(VmImage::Initramfs),
            "debian" => Ok(VmImage::Debian),
            other => Err(EngineError::UnknownImage(other.to_owned())),
        }
    }
}

/// Why the engine could not run a job.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EngineError {
    /// The tier refused or could not start the job.
    #[error(transparent)]
    Tier(#[from] TierError),
    /// The tier cannot run on this host, or could not start here.
    #[error("the {tier} tier is not available: {reason}{}", caused_by(.cause))]
    TierUnavailable {
        /// The tier.
        tier: TierKind,
        /// Why, or which step of its start failed.
        reason: String,
        /// The error that failed that step, when there is one (the same one for every caller: a tier that
        /// failed to start is not retried by this engine).
        #[source]
        cause: Option<Arc<dyn std::error::Error + Send + Sync + 'static>>,
    },
    /// The policy does not allow this tier (`[tiers] allowed`).
    #[error("the policy does not allow the {tier} tier")]
    TierNotAllowed {
        /// The tier.
        tier: TierKind,
    },
    /// No available tier runs this kind of job.
    #[error("no available tier runs {0} jobs yet")]
    NoTierFor(JobKind),
    /// A tier name that is not `auto`, `wasm`, `process`, `vm` or `microvm`.
    #[error("unknown tier {0:?} (expected auto, wasm, process or vm)")]
    UnknownTier(String),
    /// A microVM image name that is not `initramfs` or `debian`.
    #[error("unknown microVM image {0:?} (expected initramfs or debian)")]
    UnknownImage(String),
    /// A policy file could not be used.
    #[error(transparent)]
    Policy(#[from] PolicyError),
    /// A file that is neither a WebAssembly module, a Python script nor a Linux executable.
    #[error("{0} is not a WebAssembly module (no \\0asm magic), a Python script (.py) or an ELF executable")]
    UnknownFileKind(String),
    /// A guest image could not be built or checked.
    #[error("{0}")]
    Image(String),
    /// The writes of a job that ran against scratch copies of its read-write grants could not be committed.
    #[error(transparent)]
    Scratch(#[from] escalate::ScratchError),
    /// A snapshot asked to run on another tier than the one it was taken on.
    #[error("the snapshot was taken on the {snapshot} tier; it cannot be forked on the {asked} tier")]
    SnapshotTier {
        /// The snapshot's tier.
        snapshot: TierKind,
        /// The tier asked for.
        asked: TierKind,
    },
    /// A run in a fork of a snapshot was given capabilities: a fork keeps its snapshot's.
    #[error("a fork keeps its snapshot's capabilities: give them when the snapshot is made")]
    ForkCapabilities,
    /// A sandbox's image has a ready command that did not succeed in time (the sandbox was closed).
    #[error(
        "the image {image}'s ready command `{ready}` did not succeed within {}{}{}",
        strata_core::format_duration(*.waited),
        service.as_ref().map(|s| format!(" (its start command is {})", s)).unwrap_or_default(),
        if .output.trim().is_empty() { String::new() } else { format!(":\n{}", .output.trim_end()) }
    )]
    ImageNotReady {
        /// The image.
        image: String,
        /// Its ready command.
        ready: String,
        /// How long it was given.
        waited: std::time::Duration,
        /// The start command's state then.
        service: Option<String>,
        /// The last output of the ready command, then of the start command.
        output: String,
    },
    /// The engine has no home directory (`$STRATA_HOME`) for what was asked.
    #[error("no STRATA_HOME (nor HOME) to keep {0} in")]
    NoHome(&'static str),
    /// A Python job whose numbers could differ on wasm32 (it computes with numpy, whose default integer is `int32`
    /// there) when no native tier can run it: it is not run on wasm unless the user accepts wasm32 numerics.
    #[error(
        "{reason}, and {native}; run it with --tier wasm (or [tiers] python_wasm_numpy = true in the policy) to \
         accept wasm32 numerics"
    )]
    Wasm32Numerics {
        /// What the job imports.
        reason: String,
        /// Why no native tier runs it: the policy's, or the host's.
        native: String,
    },
    /// A grant that holds or lies in a directory of the host's own state: the snapshot key's (a job could read it
    /// and seal snapshots of its own), or under the home what the host maps into itself.
    #[error(
        "the grant of {} would expose {} ({what}); grant a directory that neither holds nor lies in it",
        grant.display(),
        dir.display()
    )]
    GrantExposesHostState {
        /// The grant's host directory.
        grant: PathBuf,
        /// The directory it would expose.
        dir: PathBuf,
        /// What that directory holds.
        what: &'static str,
    },
}

impl EngineError {
    /// A stable, machine-readable code for this error.
    pub fn code(&self) -> &'static str {
        match self {
            EngineError::Tier(err) => err.code(),
            EngineError::TierUnavailable { .. } => "tier_unavailable",
            EngineError::TierNotAllowed { .. } => "tier_not_allowed",
            EngineError::NoTierFor(_) => "no_tier",
            EngineError::Wasm32Numerics { .. } => "wasm32_numerics",
            EngineError::UnknownTier(_) => "unknown_tier",
            EngineError::ImageNotReady { .. } => "image_not_ready",
            EngineError::UnknownImage(_) => "unknown_image",
            EngineError::Policy(_) => "invalid_policy",
            EngineError::UnknownFileKind(_) => "wrong_format",
            EngineError::Image(_) => "artifact",
            EngineError::Scratch(_) => "scratch",
            EngineError::SnapshotTier { .. } => "snapshot_tier",
            EngineError::ForkCapabilities => "invalid_capability",
            EngineError::NoHome(_) => "no_home",
            EngineError::GrantExposesHostState { .. } => "invalid_capability",
        }
    }
}

/// `": {cause}"` after a reason, or nothing.
fn caused_by(cause: &Option<Arc<dyn std::error::Error + Send + Sync + 'static>>) -> String {
    cause.as_ref().map(|cause| format!(": {cause}")).unwrap_or_default()
}

/// Why a tier could not start: kept by the engine once, handed to every caller that asks for the tier.
#[derive(Debug, Clone)]
struct StartFailure {
    reason: String,
    cause: Option<Arc<dyn std::error::Error + Send + Sync + 'static>>,
}

impl StartFailure {
    /// A start that cannot happen here, for `reason`.
    fn new(reason: impl Into<String>) -> StartFailure {
        StartFailure { reason: reason.into(), cause: None }
    }

    /// A step (`reason`) that failed with `cause`.
    fn step<E: std::error::Error + Send + Sync + 'static>(reason: &str) -> impl FnOnce(E) -> StartFailure {
        move |cause| StartFailure { reason: reason.to_owned(), cause: Some(Arc::new(cause)) }
    }

    fn for_tier(&self, tier: TierKind) -> EngineError {
        EngineError::TierUnavailable { tier, reason: self.reason.clone(), cause: self.cause.clone() }
    }
}

/// Where the process tier's jails mount their private tmpfs (its egress sockets go beside it).
fn jail_run_dir(home: &Path) -> PathBuf {
    home.join("run/jail")
}

/// The route of a job run in a fork: the snapshot's own tier.
fn forked(snapshot: &Snapshot) -> RouteDecision {
    RouteDecision {
        tier: snapshot.tier,
        reason: format!("a fork of snapshot {} runs on the tier it was taken on", snapshot.manifest.id),
    }
}

/// How to build an [`Engine`].
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Where built artifacts live (the module cache under `modules/`); `None` keeps everything in memory.
    pub home: Option<PathBuf>,
    /// Limits of jobs that do not bring their own.
    pub policy: Policy,
    /// Concurrent wasm instances per engine configuration.
    pub max_wasm_instances: u32,
    /// The microVM tier's root filesystem.
    pub vm_image: VmImage,
    /// Where a job that may escalate keeps the scratch copies of its read-write grants ([`escalate`]); `None`:
    /// `run/scratch` under `home`, else the system's temporary directory.
    pub scratch_dir: Option<PathBuf>,
    /// The key snapshots are sealed with and opened by ([`SnapshotTrust`]); `None`: the home's
    /// (`$STRATA_HOME/keys/snapshot.key`, created on the first snapshot), else a key of this process alone.
    pub snapshot_key: Option<SnapshotKey>,
    /// How much a snapshot may hold (files, directories, bytes), checked before the work it costs.
    pub snapshot_bounds: SnapshotBounds,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            home: None,
            policy: Policy::default(),
            max_wasm_instances: 64,
            vm_image: VmImage::default(),
            scratch_dir: None,
            snapshot_key: None,
            snapshot_bounds: SnapshotBounds::default(),
        }
    }
}

impl EngineConfig {
    /// The default configuration with `home` from the environment ([`strata_home`]).
    pub fn from_env() -> Result<EngineConfig, EngineError> {
        Ok(EngineConfig { home: strata_home(), ..EngineConfig::default() })
    }
}

/// `$STRATA_HOME`, else `$XDG_CACHE_HOME/strata`, else `$HOME/.cache/strata` (docs/DESIGN.md §1); `None` without any.
pub fn strata_home() -> Option<PathBuf> {
    let var = |name| std::env::var_os(name).filter(|v| !v.is_empty()).map(PathBuf::from);
    var("STRATA_HOME")
        .or_else(|| var("XDG_CACHE_HOME").map(|p| p.join("strata")))
        .or_else(|| var("HOME").map(|p| p.join(".cache/strata")))
}

/// Supplies the wasm tier's Python runtime from the pinned image under `$STRATA_HOME/python`, installing it
/// on first use (with progress lines through `log`).
struct ImagePython {
    image: PythonImage,
}

impl PythonProvider for ImagePython {
    fn artifacts(&self) -> Result<PythonArtifacts, TierError> {
        let (installed, _) = self
            .image
            .ensure(&|line| log::info!("python runtime: {line}"))
            .map_err(|e| TierError::Artifact(e.to_string()))?;
        Ok(PythonArtifacts {
            snapshot: installed.snapshot,
            snapshot_digest: installed.snapshot_sha256,
            stdlib_dir: installed.stdlib_dir,
            stdlib_zip_name: installed.stdlib_zip_name,
            mpl_data_dir: Some(installed.mpl_data_dir),
        })
    }
}

/// What kind of job a file is, from its first bytes and its name: `\0asm` → WebAssembly, `\x7fELF` → a native
/// binary, `.py` or a `#!...python` first line → Python.
pub fn job_for_file(path: &Path, args: Vec<String>) -> Result<Job, EngineError> {
    use std::io::Read;
    let unreadable = |source| EngineError::Tier(TierError::ReadInput { path: path.to_owned(), source });
    let mut head = [0u8; 128];
    let mut file = std::fs::File::open(path).map_err(unreadable)?;
    let mut len = 0;
    while len < head.len() {
        match file.read(&mut head[len..]).map_err(unreadable)? {
            0 => break,
            n => len += n,
        }
    }
    let head = &head[..len];
    if head.starts_with(b"\0asm") {
        return Ok(Job::wasm_file(path, args));
    }
    if head.starts_with(b"\x7fELF") {
        return Ok(Job::Native { program: path.to_owned(), args });
    }
    let first_line = head.split(|b| *b == b'\n').next().unwrap_or_default();
    let python_shebang = first_line.starts_with(b"#!") && first_line.windows(6).any(|w| w == b"python");
    if path.extension().is_some_and(|e| e == "py") || python_shebang {
        return Ok(Job::Python { source: PythonSource::File(path.to_owned()), args });
    }
    Err(EngineError::UnknownFileKind(path.display().to_string()))
}

/// The engine: holds the tiers and routes jobs to them. Share one per process; it is `Send + Sync` and its
/// methods take `&self`.
///
/// Each tier is an `Arc<dyn Tier>` ([`Engine::tier`]). The built-in ones start on first use, and a tier that
/// cannot start here is a typed [`EngineError::TierUnavailable`] naming the step that failed, kept for every later
/// caller; [`Engine::with_tier`] puts another implementation in place of one (a test's fake, an embedder's own),
/// which routing, escalation, forks and sandboxes then use as they would the built-in one.
pub struct Engine {
    config: EngineConfig,
    wasm: Arc<WasmTier>,
    /// Started on first use: it checks the host and needs the Debian image.
    process: OnceLock<Result<Arc<ProcessTier>, StartFailure>>,
    /// Started on first use where the host has hardware KVM: it needs the kernel, initramfs and disk images.
    microvm: OnceLock<Result<Arc<strata_tier_microvm::tier::MicrovmTier>, StartFailure>>,
    /// Tiers put in place of built-in ones ([`Engine::with_tier`]).
    replaced: Vec<Arc<dyn Tier>>,
    /// What the wasm build of Python can import, for the router (generated on the first Python job).
    wasm_modules: OnceLock<Result<Arc<scan::WasmModules>, String>>,
    tools: ToolRegistry,
    /// What every tier seals its snapshots with and opens them by.
    snapshots: SnapshotTrust,
}

impl fmt::Debug for Engine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let replaced: Vec<TierKind> = self.replaced.iter().map(|tier| tier.kind()).collect();
        f.debug_struct("Engine").field("config", &self.config).field("replaced", &replaced).finish_non_exhaustive()
    }
}

impl Engine {
    /// An engine with this configuration. Tiers start their runtimes on first use; the Python runtime is
    /// installed into `$STRATA_HOME/python` by the first Python job (or `strata images build python`).
    pub fn new(config: EngineConfig) -> Result<Engine, EngineError> {
        let tools = ToolRegistry::new();
        let python = match &config.home {
            Some(home) => {
                let image = PythonImage::new(home).map_err(|e| EngineError::Image(e.to_string()))?;
                Some(Arc::new(ImagePython { image }) as Arc<dyn PythonProvider>)
            }
            None => None,
        };
        let snapshots = match (&config.snapshot_key, &config.home) {
            (Some(key), Some(home)) => SnapshotTrust::new(key.clone())
                .with_copies_in(home.join(strata_core::snapshot::COPIES_DIR))
                .with_kept_copies_in(home.join(strata_core::snapshot::KEPT_DIR)),
            (Some(key), None) => SnapshotTrust::new(key.clone()),
            (None, Some(home)) => SnapshotTrust::in_home(home),
            (None, None) => SnapshotTrust::process_local(),
        }
        .with_bounds(config.snapshot_bounds);
        let wasm = WasmTier::new(WasmTierConfig {
            cache_dir: config.home.as_ref().map(|home| home.join("modules")),
            max_instances: config.max_wasm_instances,
            python,
            tools: tools.clone(),
            snapshots: snapshots.clone(),
        });
        Ok(Engine {
            config,
            wasm: Arc::new(wasm),
            process: OnceLock::new(),
            microvm: OnceLock::new(),
            replaced: Vec::new(),
            wasm_modules: OnceLock::new(),
            tools,
            snapshots,
        })
    }

    /// The host tools jobs may call (`Capabilities::tools` picks them by name). Register tools here.
    pub fn tools(&self) -> &ToolRegistry {
        &self.tools
    }

    /// The guest images under this engine's home: the Python runtime, the Debian tree, the microVM kernel and
    /// initramfs.
    pub fn images(&self) -> Images<'_> {
        Images::new(self.config.home.as_deref())
    }

    /// This engine with `tier` in place of the built-in tier of its kind: every job, sandbox and fork routed to
    /// that kind goes to it. The built-in tier of that kind is then never started.
    pub fn with_tier(mut self, tier: Arc<dyn Tier>) -> Engine {
        self.replaced.retain(|replaced| replaced.kind() != tier.kind());
        self.replaced.push(tier);
        self
    }

    /// The process tier, started on first use: it checks the host (root, cgroups) and builds the Debian image
    /// when it is missing (minutes, once; progress lines through `log`).
    /// The built-in one, whatever [`Engine::with_tier`] put in its place.
    pub fn process(&self) -> Result<&ProcessTier, EngineError> {
        Ok(self.process_arc()?)
    }

    fn process_arc(&self) -> Result<&Arc<ProcessTier>, EngineError> {
        let tier = self.process.get_or_init(|| {
            let home = (self.config.home.as_ref())
                .ok_or_else(|| StartFailure::new("no STRATA_HOME (nor HOME) to keep the Debian image in"))?;
            let image = DebianImage::new(home).map_err(StartFailure::step("the Debian image"))?;
            let (installed, _) =
                image.ensure(&|line| log::info!("{line}")).map_err(StartFailure::step("the Debian image"))?;
            let images = ImageStore::open(home).map_err(StartFailure::step("the image store"))?;
            ProcessTier::new(ProcessTierConfig {
                rootfs: installed.rootfs,
                run_dir: jail_run_dir(home),
                snapshots: self.snapshots.clone(),
                images: Some(images),
            })
            .map(Arc::new)
            .map_err(StartFailure::step("starting the tier"))
        });
        tier.as_ref().map_err(|failure| failure.for_tier(TierKind::Process))
    }

    /// Removes what engines that are no longer running left in this home — the process tier's cgroups (and any
    /// process still in them) and egress sockets, the scratch copies of escalated jobs — without starting a tier.
    /// Each tier sweeps the same when it starts; a long-lived server calls this at its own start, so that a
    /// predecessor killed mid-job leaves nothing past it even when no job comes. Blocks while it kills and
    /// removes; call it on a blocking thread.
    pub fn remove_stale(&self) {
        let Some(home) = &self.config.home else { return };
        if self.process.get().is_none() {
            let removed = strata_tier_process::remove_stale(&jail_run_dir(home));
            if removed > 0 {
                log::info!("removed {removed} cgroups left by engines that were killed");
            }
        }
        escalate::sweep_stale(&self.scratch_dir());
    }

    /// What this host can run and why not (`strata doctor`). Reads kernel files only; starts nothing.
    pub fn doctor(&self) -> doctor::HostReport {
        doctor::report(self)
    }

    /// The microVM tier, where this host has hardware KVM (else a typed `TierUnavailable` at once, saying why);
    /// started on first use, building the kernel, initramfs and Debian disk when missing (minutes, once).
    /// The built-in one, whatever [`Engine::with_tier`] put in its place.
    pub fn microvm(&self) -> Result<&strata_tier_microvm::tier::MicrovmTier, EngineError> {
        Ok(self.microvm_arc()?)
    }

    fn microvm_arc(&self) -> Result<&Arc<strata_tier_microvm::tier::MicrovmTier>, EngineError> {
        let tier = self.microvm.get_or_init(|| {
            // Decided once, from what /dev/kvm is (never by trying to boot and waiting).
            let kvm = doctor::kvm();
            if kvm.kind != "hardware" {
                return Err(StartFailure::new(format!("{} (run `strata doctor`)", kvm.detail)));
            }
            let home = (self.config.home.as_ref())
                .ok_or_else(|| StartFailure::new("no STRATA_HOME (nor HOME) to keep the guest images in"))?;
            let progress = |line: &str| log::info!("{line}");
            let kernel = strata_kernel_image::KernelImage::new(home).map_err(StartFailure::step("the kernel"))?;
            let (kernel, _) = kernel.ensure(&progress).map_err(StartFailure::step("the kernel"))?;
            let initramfs = self.images().initramfs().map_err(StartFailure::step("the initramfs"))?;
            let root_disk = match self.config.vm_image {
                VmImage::Initramfs => None,
                VmImage::Debian => {
                    let (rootfs, _) = DebianImage::new(home)
                        .and_then(|image| image.ensure(&progress))
                        .map_err(StartFailure::step("the Debian image"))?;
                    let disk = strata_rootfs_image::disk::ensure_disk_image(&rootfs, &progress)
                        .map_err(StartFailure::step("the Debian disk image"))?;
                    Some(disk.path)
                }
            };
            let run_dir = home.join("run/microvm");
            std::fs::create_dir_all(&run_dir).map_err(StartFailure::step(&format!("{}", run_dir.display())))?;
            Ok(Arc::new(
                strata_tier_microvm::tier::MicrovmTier::new(strata_tier_microvm::tier::MicrovmTierConfig {
                    kernel: kernel.vmlinux,
                    initramfs: initramfs.path,
                    root_disk,
                    run_dir,
                    cpuid: strata_tier_microvm::vstate::vcpu::cpuid::CpuidProfile::Standard,
                    snapshots: self.snapshots.clone(),
                })
                .with_images(ImageStore::open(home).map_err(StartFailure::step("the image store"))?),
            ))
        });
        tier.as_ref().map_err(|failure| failure.for_tier(TierKind::Microvm))
    }

    /// The policy's limits, for jobs that do not bring their own.
    pub fn default_limits(&self) -> &Limits {
        &self.config.policy.limits
    }

    /// Where built artifacts live.
    pub fn home(&self) -> Option<&Path> {
        self.config.home.as_deref()
    }

    /// What this engine's tiers seal snapshots with and open them by (see [`EngineConfig::snapshot_key`]).
    pub fn snapshots(&self) -> &SnapshotTrust {
        &self.snapshots
    }

    /// Refuses capabilities whose grants hold or lie in a directory of the host's own state
    /// ([`EngineError::GrantExposesHostState`]): the snapshot key (what makes a snapshot's recorded capabilities
    /// trusted, so no job may read or replace it) and, under the home, the compiled code, memory images and kept
    /// snapshot copies the host maps into itself, and its records of verified snapshot files.
    fn check_host_state_not_granted(&self, caps: &Capabilities) -> Result<(), EngineError> {
        // Most jobs have no grant: resolving the directories costs a few system calls, a third of a trivial
        // wasm job's time.
        if caps.grants.is_empty() {
            return Ok(());
        }
        let mut protected: Vec<(PathBuf, &'static str)> = Vec::new();
        if let Some(keys) = self.snapshots.key_file().and_then(Path::parent) {
            protected.push((keys.to_owned(), "the snapshot key: a job that reads it can forge snapshots"));
        }
        if let Some(home) = self.home() {
            let mapped = "compiled code, memory images and kept snapshot copies the host maps into itself";
            protected.push((home.join(strata_core::snapshot::KEPT_DIR), mapped));
            protected.push((home.join(strata_core::snapshot::COPIES_DIR), "private copies of snapshot memory"));
            protected.push((home.join(strata_core::snapshot::VERIFIED_DIR), "records of verified snapshot files"));
        }
        for (dir, what) in protected {
            // The directory as it resolves (it may not exist yet: then its parent's, or the path as given).
            let resolved = dir.canonicalize().unwrap_or_else(|_| {
                match (dir.parent().and_then(|parent| parent.canonicalize().ok()), dir.file_name()) {
                    (Some(parent), Some(name)) => parent.join(name),
                    _ => dir.clone(),
                }
            });
            for grant in &caps.grants {
                // A grant that does not resolve is the tier's to refuse (it names no directory).
                let Ok(host) = grant.host.canonicalize() else { continue };
                if resolved.starts_with(&host) || host.starts_with(&resolved) {
                    return Err(EngineError::GrantExposesHostState { grant: grant.host.clone(), dir: resolved, what });
                }
            }
        }
        Ok(())
    }

    /// Opens and verifies a snapshot directory with this engine's key ([`SnapshotTrust::open`]): a snapshot
    /// whose manifest is not sealed with it (altered, made in another home, or before snapshot format 2) is
    /// refused as `snapshot_invalid`.
    pub fn open_snapshot(&self, dir: &Path) -> Result<Snapshot, EngineError> {
        Ok(self.snapshots.open(dir).map_err(TierError::Snapshot)?)
    }

    /// A writer of a snapshot at `destination` sealed with this engine's key, within its bounds: for a snapshot
    /// received from another node of a fleet ([`strata_core::snapshot::SnapshotWriter::commit_copy`] checks its
    /// files against the manifest it came with).
    pub fn snapshot_writer(&self, destination: &Path) -> Result<strata_core::snapshot::SnapshotWriter, EngineError> {
        Ok(self.snapshots.writer(destination).map_err(TierError::Snapshot)?)
    }

    /// The bounds a snapshot is held to (files, sizes), checked before the work they would cost is done.
    pub fn snapshot_bounds(&self) -> SnapshotBounds {
        *self.snapshots.bounds()
    }

    /// Loads what a one-shot job of the default limits would load first, without running one: the router's list of
    /// what the wasm build of Python can import, the Python runtime's compiled code (the plain runtime one-shot
    /// jobs run, and the snapshot-ready one sessions and forks run). Starts no thread once everything is cached
    /// on disk (the first call may compile, which does), so a warmed engine may be forked ([`warm`]).
    pub fn warm(&self) -> Result<(), EngineError> {
        self.wasm_modules()?;
        let limits = self.default_limits().clone();
        self.wasm.prepare_python(&limits)?;
        self.wasm.prepare_python_sessions(&limits)?;
        Ok(())
    }

    /// Ends this engine in a process that exits next: the other tiers close as a drop closes them (the process
    /// tier stops its zygotes), but the wasm tier's compiled code, instance pools and registered types (for the
    /// Python runtime, ~300 MB of mappings and ~90,000 functions, which take milliseconds to unmap and unregister
    /// one by one) are left to the exit, which releases a process's memory at once. The wasm tier holds nothing
    /// else an exit would not release: its epoch thread ends with the process, and its jobs' scratch
    /// directories went with the jobs.
    pub fn close_for_exit(self) {
        let Engine { wasm, .. } = self;
        std::mem::forget(wasm);
    }

    /// Refuses an image `caps` names that the store does not have, before any tier starts (which for the process
    /// tier may mean building the Debian image first).
    fn check_image(&self, caps: &Capabilities) -> Result<(), EngineError> {
        let Some(name) = &caps.image else { return Ok(()) };
        match self.image_store()?.get(name) {
            Ok(_) => Ok(()),
            Err(strata_image_store::StoreError::NotFound(image)) => Err(TierError::ImageNotFound { image }.into()),
            Err(other) => Err(EngineError::Image(other.to_string())),
        }
    }

    /// The built-in wasm tier itself, for embedders that want its specific API (e.g. [`WasmTier::prepare`]).
    pub fn wasm(&self) -> &WasmTier {
        &self.wasm
    }

    /// Where a job with no capabilities goes, judged with the policy's default limits
    /// ([`Engine::route_with_limits`]).
    pub fn route(&self, choice: TierChoice, job: &Job) -> Result<Route, EngineError> {
        self.route_with_limits(choice, job, &Capabilities::default(), self.default_limits())
    }

    /// Where a job that runs with `caps` under `limits` goes: the tier, the fallback taken on the way if any, and the
    /// decision with its reason, by the policy's routing rule ([`Router::plan`] says it in full). A job the chosen
    /// tier cannot run is refused before the tier starts (which for the process tier may mean building its image);
    /// so is a tier the policy does not allow. Python is judged by its network (CPython in wasm has no sockets), the
    /// policy's `python_native_above` and the import scan ([`scan`]). A fallback taken is recorded in the outcome by
    /// [`Engine::execute`].
    pub fn route_with_limits(
        &self,
        choice: TierChoice,
        job: &Job,
        caps: &Capabilities,
        limits: &Limits,
    ) -> Result<Route, EngineError> {
        self.route_job(choice, job, caps, limits, &ExecOptions::default())
    }

    /// [`Engine::route_with_limits`] for a job run with `opts`: on a terminal, or as a user other than root (which
    /// wasm has not: such Python goes native).
    fn route_job(
        &self,
        choice: TierChoice,
        job: &Job,
        caps: &Capabilities,
        limits: &Limits,
        opts: &ExecOptions,
    ) -> Result<Route, EngineError> {
        self.check_host_state_not_granted(caps)?;
        self.check_image(caps)?;
        let user = opts.user.as_ref().or(caps.user.as_ref()).filter(|user| !user.is_root());
        let python = || match job {
            Job::Python { .. } if opts.terminal.is_some() => {
                scan::PythonVerdict::Native("python: a terminal (--tty), which the wasm tier does not have".into())
            }
            Job::Python { .. } if user.is_some() => scan::PythonVerdict::Native(format!(
                "python: running as the user {:?}, an account the wasm tier does not have",
                user.map(|u| u.as_str()).unwrap_or_default()
            )),
            Job::Python { .. } if caps.image.is_some() => scan::PythonVerdict::Native(format!(
                "python: the image {:?}, a filesystem the wasm tier does not have",
                caps.image.as_ref().map(|i| i.as_str()).unwrap_or_default()
            )),
            Job::Python { source, .. } => self.python_verdict(source, caps, limits),
            _ => scan::PythonVerdict::Wasm(String::new()),
        };
        let plan = Router::new(&self.config.policy.tiers).plan(choice, job, python, &EngineTiers(self))?;
        Ok(Route { tier: self.tier(plan.tier)?, escalation: plan.escalation, decision: plan.decision })
    }

    /// What the job's network, the policy's `python_native_above` and the import scan say about a Python job.
    fn python_verdict(&self, source: &PythonSource, caps: &Capabilities, limits: &Limits) -> scan::PythonVerdict {
        if let Net::Allow(allowlist) = &caps.net {
            return scan::PythonVerdict::Native(format!(
                "python: network egress (--allow-net {}) needs sockets, which CPython in wasm does not have",
                allowlist.specs().join(",")
            ));
        }
        if let Some(threshold) = self.config.policy.tiers.python_native_above {
            let over = [("wall", limits.wall), ("cpu", limits.cpu)].into_iter().find(|(_, limit)| *limit > threshold);
            if let Some((name, limit)) = over {
                return scan::PythonVerdict::Native(format!(
                    "python: its {name} limit {} exceeds python_native_above ({}); CPython in wasm runs CPU-bound \
                     code about 4× slower",
                    strata_core::format_duration(limit),
                    strata_core::format_duration(threshold)
                ));
            }
        }
        let numerics = match self.config.policy.tiers.python_wasm_numpy {
            true => scan::Wasm32Numerics::Accepted,
            false => scan::Wasm32Numerics::Refused,
        };
        // The module list is only needed when something is imported.
        scan::judge_source(source, numerics, || match self.wasm_modules() {
            Ok(modules) => Some(modules),
            Err(err) => {
                log::warn!("routing Python without the wasm build's module list: {err}");
                None
            }
        })
    }

    /// What the wasm build of Python can import: generated from the installed runtime on first use (its stdlib zip,
    /// and `sys.builtin_module_names` from one run of the interpreter) and cached beside it.
    pub fn wasm_modules(&self) -> Result<&scan::WasmModules, EngineError> {
        let modules = self.wasm_modules.get_or_init(|| {
            let image = self.images().python().map_err(|e| e.to_string())?;
            let (installed, _) =
                image.ensure(&|line| log::info!("python runtime: {line}")).map_err(|e| e.to_string())?;
            let digest: String = installed.snapshot_sha256.iter().take(8).map(|b| format!("{b:02x}")).collect();
            let cache = image.install_dir().with_file_name(format!("wasm-modules-{digest}.txt"));
            let zip = installed.stdlib_dir.join(&installed.stdlib_zip_name);
            scan::WasmModules::load_or_generate(&cache, &zip, || {
                let job = Job::Python {
                    source: PythonSource::Code("import sys\nprint('\\n'.join(sys.builtin_module_names))".into()),
                    args: Vec::new(),
                };
                let outcome = self
                    .wasm
                    .run(&job, &Capabilities::default(), &Limits::default(), ExecOptions::default())
                    .map_err(|e| e.to_string())?;
                if outcome.status != (Status::Exited { code: 0 }) {
                    return Err(format!("{}: {}", outcome.status, String::from_utf8_lossy(&outcome.stderr)));
                }
                Ok(String::from_utf8_lossy(&outcome.stdout).lines().map(str::to_owned).collect())
            })
            .map(Arc::new)
            .map_err(|e| e.to_string())
        });
        modules.as_deref().map_err(|reason| EngineError::Image(reason.clone()))
    }

    /// The tier of kind `tier`: one [`Engine::with_tier`] put in place, else the built-in one, started on first
    /// use.
    pub fn tier(&self, tier: TierKind) -> Result<Arc<dyn Tier>, EngineError> {
        if let Some(replaced) = self.replaced.iter().find(|replaced| replaced.kind() == tier) {
            return Ok(replaced.clone());
        }
        Ok(match tier {
            TierKind::Wasm => self.wasm.clone(),
            TierKind::Process => self.process_arc()?.clone(),
            TierKind::Microvm => self.microvm_arc()?.clone(),
        })
    }

    /// Runs the job `request` describes ([`RunRequest`] documents every default) and returns its [`Outcome`].
    ///
    /// **Routing.** The job runs on the tier the request names or, with [`TierChoice::Auto`], the one the router
    /// picks ([`Engine::route_with_limits`]); the decision is the outcome's `route`, and a fallback taken on the way
    /// is the first entry of its `escalations`.
    ///
    /// **Escalation.** A Python job that `Auto` sent to wasm may escalate ([`escalate`]): when the wasm run fails for
    /// a reason the policy's `[escalation]` allows (a module the wasm build lacks, an OS call WASI does not support),
    /// the job re-runs on the policy's native tier (or its fallback) with the same capabilities, limits and stdin, and
    /// the outcome is the native run's, with `{from: wasm, to, reason}` in `escalations` (`route` stays the router's
    /// decision). Until the wasm attempt is known to be the result, it writes to scratch copies of the read-write
    /// grants, committed to the host only then, and its streamed output is held back from the
    /// [`on_output`](RunRequest::on_output) sink; an explicit tier never escalates.
    ///
    /// **Forks.** With [`RunRequest::in_fork_of`] the job runs in a fresh fork of that snapshot ([`Engine::fork`]),
    /// closed afterwards, and never escalates; `route` says it ran on the snapshot's tier. Capabilities are then
    /// refused ([`EngineError::ForkCapabilities`]: a fork keeps its snapshot's), and a named tier must be the
    /// snapshot's.
    pub fn execute(&self, request: RunRequest<'_>) -> Result<Outcome, EngineError> {
        let limits = request.limits.as_ref().unwrap_or(self.default_limits());
        if let Some(snapshot) = request.snapshot {
            if request.caps.is_some() {
                return Err(EngineError::ForkCapabilities);
            }
            return self.run_from_snapshot(request.tier, snapshot, request.job, limits, request.opts);
        }
        let none = Capabilities::default();
        let caps = request.caps.unwrap_or(&none);
        let mut outcome = self.run_on(request.tier, request.job, caps, limits, request.opts)?;
        outcome.platform = self.platform_of(request.tier, request.job, outcome.tier);
        Ok(outcome)
    }

    /// Runs the setup job `request` describes in a new sandbox and, when it exits with status 0, snapshots the
    /// sandbox into the new directory `destination` (a snapshot is the complete state of an idle sandbox,
    /// docs/DESIGN.md §2). Returns the setup's outcome and the snapshot, `None` when the setup did not succeed (nothing is
    /// written then).
    ///
    /// The sandbox is a fresh one on the tier the request names or the router picks for the setup job (a fallback
    /// taken on the way is the first entry of the outcome's `escalations`; a failed setup is not re-run elsewhere),
    /// or, with [`RunRequest::in_fork_of`], a fork of that snapshot ([`Engine::fork`]), which the new snapshot names
    /// as its `parent`; capabilities are then refused ([`EngineError::ForkCapabilities`]: a fork keeps its
    /// snapshot's).
    pub fn snapshot(
        &self,
        request: RunRequest<'_>,
        destination: &Path,
    ) -> Result<(Outcome, Option<Snapshot>), EngineError> {
        let limits = request.limits.as_ref().unwrap_or(self.default_limits());
        if request.snapshot.is_some() && request.caps.is_some() {
            return Err(EngineError::ForkCapabilities);
        }
        if destination.exists() {
            return Err(TierError::Snapshot(SnapshotError::Exists(destination.to_owned())).into());
        }
        let none = Capabilities::default();
        let caps = request.caps.unwrap_or(&none);
        let (sandbox, escalation, decision) = match request.snapshot {
            Some(snapshot) => (self.fork(request.tier, snapshot)?, None, forked(snapshot)),
            None => {
                let route = self.route_with_limits(request.tier, request.job, caps, limits)?;
                (route.tier.start(caps, limits)?, route.escalation, route.decision)
            }
        };
        let mut outcome = sandbox.exec(request.job, ExecOptions { limits: Some(limits.clone()), ..request.opts })?;
        if let Some(escalation) = escalation {
            outcome.escalations.insert(0, escalation);
        }
        outcome.route = Some(decision);
        let snapshot = match outcome.status {
            Status::Exited { code: 0 } => Some(sandbox.snapshot(destination)?),
            _ => None,
        };
        sandbox.close()?;
        Ok((outcome, snapshot))
    }

    /// Runs a job on the chosen tier: [`Engine::execute`] without a snapshot, for a caller holding the parts apart.
    fn run_on(
        &self,
        choice: TierChoice,
        job: &Job,
        caps: &Capabilities,
        limits: &Limits,
        opts: ExecOptions,
    ) -> Result<Outcome, EngineError> {
        let route = self.route_job(choice, job, caps, limits, &opts)?;
        if route.tier.kind() != TierKind::Process
            && let Some(Ok(process)) = self.process.get()
        {
            // A jail built ahead for a Linux command ([`ProcessTier::prestart`]) is not this job's: closed
            // meanwhile, not after it.
            process.discard_spare();
        }
        if self.may_escalate(choice, job, &route) {
            return self.run_escalating(route, job, caps, limits, opts);
        }
        let mut outcome = route.tier.run(job, caps, limits, opts)?;
        if let Some(escalation) = route.escalation {
            outcome.escalations.insert(0, escalation);
        }
        outcome.route = Some(route.decision);
        Ok(outcome)
    }

    /// `Some(Wasm32)` when `job` is Python that computes with numpy and ran on wasm (the user asked for it: a
    /// default route never sends it there), for the outcome's `platform`.
    fn platform_of(&self, choice: TierChoice, job: &Job, tier: TierKind) -> Option<strata_core::Platform> {
        let Job::Python { source, .. } = job else { return None };
        // Only where the user asked for wasm32 numerics can they have run: the default route scanned the job already
        // and never sends numerics to wasm, so it is not scanned twice.
        let asked = choice == TierChoice::Tier(TierKind::Wasm) || self.config.policy.tiers.python_wasm_numpy;
        if tier != TierKind::Wasm || !asked {
            return None;
        }
        let verdict = scan::judge_source(source, scan::Wasm32Numerics::Refused, || self.wasm_modules().ok());
        matches!(verdict, scan::PythonVerdict::Numerics(_)).then_some(strata_core::Platform::Wasm32)
    }

    /// Whether a failed run of `job` on `route` may re-run natively: `Auto` sent Python to wasm, and the policy
    /// allows escalation for some reason and allows its native tier.
    fn may_escalate(&self, choice: TierChoice, job: &Job, route: &Route) -> bool {
        let policy = &self.config.policy;
        choice == TierChoice::Auto
            && job.kind() == JobKind::Python
            && route.decision.tier == TierKind::Wasm
            && policy.escalation.allowed
            && !policy.escalation.on.is_empty()
            && policy.tiers.allows(policy.tiers.native)
    }

    /// Where the scratch copies of escalatable jobs' read-write grants go.
    fn scratch_dir(&self) -> PathBuf {
        match (&self.config.scratch_dir, &self.config.home) {
            (Some(dir), _) => dir.clone(),
            (None, Some(home)) => home.join("run/scratch"),
            (None, None) => std::env::temp_dir(),
        }
    }

    /// Runs a job `Auto` sent to wasm, re-running it on the native tier when it fails there for an escalatable
    /// reason (see [`Engine::execute`] and [`escalate`]).
    fn run_escalating(
        &self,
        route: Route,
        job: &Job,
        caps: &Capabilities,
        limits: &Limits,
        opts: ExecOptions,
    ) -> Result<Outcome, EngineError> {
        let finish = |mut outcome: Outcome, decision: RouteDecision| {
            outcome.route = Some(decision);
            outcome
        };
        let scratch = match escalate::ScratchGrants::prepare(caps, limits.disk.0, &self.scratch_dir()) {
            Ok(scratch) => scratch,
            Err(err) => {
                // Never refuse a job for it: it runs as it would without escalation.
                log::warn!("this job will not escalate to a native tier: {err}");
                return Ok(finish(route.tier.run(job, caps, limits, opts)?, route.decision));
            }
        };
        let wasm_caps = match &scratch {
            Some(scratch) => std::borrow::Cow::Owned(scratch.caps(caps)),
            None => std::borrow::Cow::Borrowed(caps),
        };
        let held = opts.sink.as_ref().map(|_| Arc::new(escalate::HeldOutput::default()));
        // Both runs read a stdin stream as it arrives: the attempt through a tee, the rerun what it took and the rest.
        let (tee, attempt_stdin) = match opts.stdin_stream.clone() {
            Some(stream) => {
                let (tee, attempt) = escalate::StdinTee::start(stream, escalate::MAX_TEED_STDIN)
                    .map_err(|source| TierError::ReadInput { path: "stdin stream".into(), source })?;
                (Some(tee), Some(attempt))
            }
            None => (None, None),
        };
        let wasm_opts = ExecOptions {
            sink: held.clone().map(|held| held as Arc<dyn strata_core::OutputSink>),
            stdin_stream: attempt_stdin,
            ..opts.clone()
        };
        // A tier error means the job never ran: the copies go with `scratch`.
        let attempt = route.tier.run(job, &wasm_caps, limits, wasm_opts)?;
        let cancelled = opts.cancel.as_ref().is_some_and(|cancel| cancel.is_cancelled());
        let failure = if cancelled { None } else { self.escalatable(&attempt) };
        let native = match failure {
            Some(failure) => match self.native_route() {
                Ok(native) => Some((failure, native)),
                Err(err) => {
                    log::warn!("the job failed on wasm ({}) but cannot escalate: {err}", failure.what);
                    None
                }
            },
            None => None,
        };
        let (native, rerun_stdin) = match (native, tee) {
            (Some(native), Some(tee)) => match tee.rerun() {
                Ok(Some(rerun)) => (Some(native), Some(rerun)),
                Ok(None) => {
                    log::warn!(
                        "the job failed on wasm ({}) but cannot escalate: it read more than {} bytes of its stdin \
                         stream, which a rerun could not be given",
                        native.0.what,
                        escalate::MAX_TEED_STDIN
                    );
                    (None, None)
                }
                Err(err) => {
                    log::warn!("the job failed on wasm ({}) but cannot escalate: {err}", native.0.what);
                    (None, None)
                }
            },
            (native, _) => (native, None),
        };
        let Some((failure, native)) = native else {
            // The wasm attempt is the result: its output and its writes are the job's.
            if let (Some(held), Some(sink)) = (&held, &opts.sink) {
                held.release(sink.as_ref());
            }
            if let Some(scratch) = scratch {
                scratch.commit()?;
            }
            return Ok(finish(attempt, route.decision));
        };
        // The failed attempt's writes and output are discarded; the native run sees the host grants as they were.
        drop(scratch);
        let mut reason = failure.describe(&attempt);
        if let Some(fallback) = &native.escalation {
            // `to` is the process tier; say why it is not the policy's native tier.
            reason.push_str(&format!("; {}", fallback.reason));
        }
        let (stdin_stream, _replay) = match rerun_stdin {
            Some((stream, replay)) => (Some(stream), Some(replay)),
            None => (None, None),
        };
        let mut outcome = native.tier.run(job, caps, limits, ExecOptions { stdin_stream, ..opts })?;
        outcome.escalations.insert(0, Escalation { from: TierKind::Wasm, to: native.decision.tier, reason });
        Ok(finish(outcome, route.decision))
    }

    /// Why a wasm attempt's failure may escalate under the policy, if it may.
    fn escalatable(&self, attempt: &Outcome) -> Option<escalate::WasmFailure> {
        // Only an uncaught exception can escalate; nothing else needs the module list (made on first use).
        if attempt.status != (Status::Exited { code: 1 }) {
            return None;
        }
        let failure = match self.wasm_modules() {
            Ok(modules) => escalate::diagnose(attempt, Some(modules)),
            Err(err) => {
                log::warn!("judging a failed wasm run without the wasm build's module list: {err}");
                escalate::diagnose(attempt, None)
            }
        }?;
        self.config.policy.escalation.permits(failure.reason).then_some(failure)
    }

    /// The policy's native tier for an escalation, or the process tier when it falls back.
    fn native_route(&self) -> Result<Route, EngineError> {
        let plan = Router::new(&self.config.policy.tiers).escalation(&EngineTiers(self))?;
        Ok(Route { tier: self.tier(plan.tier)?, escalation: plan.escalation, decision: plan.decision })
    }

    /// Starts a fork of `snapshot` on its own tier ([`Tier::fork`]): independent of the snapshot and of every other
    /// fork, with fresh randomness. The fork keeps the snapshot's capabilities, read from its sealed manifest as
    /// the directory holds it when the fork is made (the tier re-opens it with this engine's key). `choice` must be
    /// `Auto` or the snapshot's tier; the policy must allow that tier.
    pub fn fork(&self, choice: TierChoice, snapshot: &Snapshot) -> Result<Box<dyn Sandbox>, EngineError> {
        if let TierChoice::Tier(tier) = choice
            && tier != snapshot.tier
        {
            return Err(EngineError::SnapshotTier { snapshot: snapshot.tier, asked: tier });
        }
        if !self.config.policy.tiers.allows(snapshot.tier) {
            return Err(EngineError::TierNotAllowed { tier: snapshot.tier });
        }
        let sandbox = self.tier(snapshot.tier)?.fork(snapshot)?;
        // A fork of a sandbox on an image runs the image's start command again (no process is kept in a snapshot).
        let image = snapshot.manifest.meta.pointer("/caps/image").and_then(|v| v.as_str());
        if let Some(image) = image.and_then(|name| ImageName::new(name).ok()) {
            self.start_image_service(sandbox.as_ref(), &image)?;
        }
        Ok(sandbox)
    }

    /// Runs one job in a fresh fork of `snapshot` ([`Engine::fork`]) as the fork's last ([`Sandbox::exec_and_close`]).
    fn run_from_snapshot(
        &self,
        choice: TierChoice,
        snapshot: &Snapshot,
        job: &Job,
        limits: &Limits,
        opts: ExecOptions,
    ) -> Result<Outcome, EngineError> {
        let sandbox = self.fork(choice, snapshot)?;
        let mut outcome = sandbox.exec_and_close(job, ExecOptions { limits: Some(limits.clone()), ..opts })?;
        outcome.route = Some(forked(snapshot));
        Ok(outcome)
    }

    /// Starts a sandbox on a tier (`Auto` starts on the cheapest, wasm). A sandbox lives on its tier for its whole
    /// life: a wasm sandbox `Auto` started refuses a Python job the router would send to a native tier
    /// ([`TierError::SessionTier`]: numpy whose wasm32 integers could differ, processes, sockets, native
    /// extensions), and numpy runs on wasm32 only where the user asked for it (`Tier(Wasm)` or the policy's
    /// `python_wasm_numpy`), its outcome then saying `"platform":"wasm32"`.
    pub fn start(
        &self,
        choice: TierChoice,
        caps: &Capabilities,
        limits: &Limits,
    ) -> Result<Box<dyn Sandbox>, EngineError> {
        self.check_host_state_not_granted(caps)?;
        self.check_image(caps)?;
        let tier = match choice {
            // An image is a root filesystem: the process tier's.
            TierChoice::Auto if caps.image.is_some() => TierKind::Process,
            TierChoice::Auto => TierKind::Wasm,
            TierChoice::Tier(tier) => tier,
        };
        if !self.config.policy.tiers.allows(tier) {
            return Err(EngineError::TierNotAllowed { tier });
        }
        let sandbox = self.tier(tier)?.start(caps, limits)?;
        if tier != TierKind::Wasm {
            if let Some(image) = &caps.image {
                self.start_image_service(sandbox.as_ref(), image)?;
            }
            return Ok(sandbox);
        }
        let chosen = match choice {
            TierChoice::Auto => session::Chosen::ByEngine,
            TierChoice::Tier(_) => session::Chosen::ByUser,
        };
        let modules = self.wasm_modules_arc();
        let policy = &self.config.policy.tiers;
        let numerics =
            if policy.python_wasm_numpy { scan::Wasm32Numerics::Accepted } else { scan::Wasm32Numerics::Refused };
        // The tier a refused job would run on, as the router would resolve it: the microVM only where /dev/kvm is
        // hardware (checked cheaply, without starting the tier), else the process tier when the policy falls back.
        let native = match policy.native {
            TierKind::Microvm
                if policy.fallback && policy.allows(TierKind::Process) && doctor::kvm().kind != "hardware" =>
            {
                TierKind::Process
            }
            native => native,
        };
        Ok(Box::new(session::WasmSession::new(sandbox, chosen, numerics, native, modules)))
    }

    /// The wasm build's module list, shared; `None` (logged) when it cannot be made.
    fn wasm_modules_arc(&self) -> Option<Arc<scan::WasmModules>> {
        if let Err(err) = self.wasm_modules() {
            log::warn!("judging a session's Python without the wasm build's module list: {err}");
        }
        self.wasm_modules.get().and_then(|modules| modules.as_ref().ok()).cloned()
    }
}

#[cfg(test)]
mod tests;

/// The README's Rust examples compile as part of the doc tests.
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
struct ReadmeDoctests;
