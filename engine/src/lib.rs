//! The Strata engine: the facade embedders call.
//!
//! ```no_run
//! use strata_engine::{Engine, EngineConfig};
//! use strata_core::{Capabilities, ExecOptions, Job};
//!
//! let engine = Engine::new(EngineConfig::from_env()?)?;
//! let job = Job::wasm_file("hello.wasm", vec!["world".into()]);
//! let outcome = engine.run(&job, &Capabilities::default(), engine.default_limits(), ExecOptions::default())?;
//! println!("{} -> {}", outcome.status, String::from_utf8_lossy(&outcome.stdout));
//! # Ok::<(), strata_engine::EngineError>(())
//! ```
//!
//! [`Engine::run`] routes each job to a tier ([`TierChoice::Auto`] picks the cheapest that can run it) and
//! returns its [`Outcome`]; [`Engine::start`] opens a [`Sandbox`] that runs several jobs in turn. Today the
//! wasm tier is built; asking for the process or microVM tier is a typed [`EngineError::TierUnavailable`].

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod policy;

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use strata_core::{Capabilities, ExecOptions, Job, JobKind, Limits, Outcome, Sandbox, Tier, TierError, TierKind};
use strata_tier_wasm::{WasmTier, WasmTierConfig};

pub use policy::{Policy, PolicyError};
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

/// Why the engine could not run a job.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EngineError {
    /// The tier refused or could not start the job.
    #[error(transparent)]
    Tier(#[from] TierError),
    /// The tier exists in Strata's design but not in this build or on this host.
    #[error("the {tier} tier is not available: {reason}")]
    TierUnavailable {
        /// The tier.
        tier: TierKind,
        /// Why.
        reason: &'static str,
    },
    /// No available tier runs this kind of job.
    #[error("no available tier runs {0} jobs yet")]
    NoTierFor(JobKind),
    /// A tier name that is not `auto`, `wasm`, `process`, `vm` or `microvm`.
    #[error("unknown tier {0:?} (expected auto, wasm, process or vm)")]
    UnknownTier(String),
    /// A policy file could not be used.
    #[error(transparent)]
    Policy(#[from] PolicyError),
}

impl EngineError {
    /// A stable, machine-readable code for this error.
    pub fn code(&self) -> &'static str {
        match self {
            EngineError::Tier(err) => err.code(),
            EngineError::TierUnavailable { .. } => "tier_unavailable",
            EngineError::NoTierFor(_) => "no_tier",
            EngineError::UnknownTier(_) => "unknown_tier",
            EngineError::Policy(_) => "invalid_policy",
        }
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
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig { home: None, policy: Policy::default(), max_wasm_instances: 64 }
    }
}

impl EngineConfig {
    /// The default configuration with `home` from the environment ([`strata_home`]).
    pub fn from_env() -> Result<EngineConfig, EngineError> {
        Ok(EngineConfig { home: strata_home(), ..EngineConfig::default() })
    }
}

/// `$STRATA_HOME`, else `$XDG_CACHE_HOME/strata`, else `$HOME/.cache/strata` (DESIGN §1); `None` without any.
pub fn strata_home() -> Option<PathBuf> {
    let var = |name| std::env::var_os(name).filter(|v| !v.is_empty()).map(PathBuf::from);
    var("STRATA_HOME")
        .or_else(|| var("XDG_CACHE_HOME").map(|p| p.join("strata")))
        .or_else(|| var("HOME").map(|p| p.join(".cache/strata")))
}

/// The engine: owns the tiers and routes jobs to them. Share one per process; it is `Send + Sync` and its
/// methods take `&self`.
#[derive(Debug)]
pub struct Engine {
    config: EngineConfig,
    wasm: WasmTier,
}

impl Engine {
    /// An engine with this configuration. Tiers start their runtimes on first use.
    pub fn new(config: EngineConfig) -> Result<Engine, EngineError> {
        let wasm = WasmTier::new(WasmTierConfig {
            cache_dir: config.home.as_ref().map(|home| home.join("modules")),
            max_instances: config.max_wasm_instances,
        });
        Ok(Engine { config, wasm })
    }

    /// The policy's limits, for jobs that do not bring their own.
    pub fn default_limits(&self) -> &Limits {
        &self.config.policy.limits
    }

    /// Where built artifacts live.
    pub fn home(&self) -> Option<&Path> {
        self.config.home.as_deref()
    }

    /// The wasm tier itself, for embedders that want its specific API (e.g. [`WasmTier::prepare`]).
    pub fn wasm(&self) -> &WasmTier {
        &self.wasm
    }

    /// The tier a job goes to.
    pub fn route(&self, choice: TierChoice, job: &Job) -> Result<&dyn Tier, EngineError> {
        let tier = match choice {
            TierChoice::Tier(tier) => tier,
            TierChoice::Auto => match job.kind() {
                JobKind::Wasm => TierKind::Wasm,
                kind => return Err(EngineError::NoTierFor(kind)),
            },
        };
        self.tier(tier)
    }

    fn tier(&self, tier: TierKind) -> Result<&dyn Tier, EngineError> {
        match tier {
            TierKind::Wasm => Ok(&self.wasm),
            TierKind::Process => Err(EngineError::TierUnavailable { tier, reason: "not part of this build yet" }),
            TierKind::Microvm => Err(EngineError::TierUnavailable { tier, reason: "not part of this build yet" }),
        }
    }

    /// Runs a job on the cheapest tier that can run it.
    pub fn run(
        &self,
        job: &Job,
        caps: &Capabilities,
        limits: &Limits,
        opts: ExecOptions,
    ) -> Result<Outcome, EngineError> {
        self.run_on(TierChoice::Auto, job, caps, limits, opts)
    }

    /// Runs a job on the chosen tier.
    pub fn run_on(
        &self,
        choice: TierChoice,
        job: &Job,
        caps: &Capabilities,
        limits: &Limits,
        opts: ExecOptions,
    ) -> Result<Outcome, EngineError> {
        Ok(self.route(choice, job)?.run(job, caps, limits, opts)?)
    }

    /// Starts a sandbox on a tier (`Auto` starts on the cheapest, wasm).
    pub fn start(
        &self,
        choice: TierChoice,
        caps: &Capabilities,
        limits: &Limits,
    ) -> Result<Box<dyn Sandbox>, EngineError> {
        let tier = match choice {
            TierChoice::Auto => TierKind::Wasm,
            TierChoice::Tier(tier) => tier,
        };
        Ok(self.tier(tier)?.start(caps, limits)?)
    }
}

/// The README's Rust examples compile as part of the doc tests.
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
struct ReadmeDoctests;
