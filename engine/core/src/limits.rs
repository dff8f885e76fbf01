//! Resource limits of a job, and the defaults from `policies/default.toml`.

use std::fmt;
use std::str::FromStr;
use std::sync::LazyLock;
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::units::{ByteSize, duration_text};

/// The policy file compiled into Strata; its `[limits]` table gives every limit a default.
pub const DEFAULT_POLICY_TOML: &str = include_str!("../../../policies/default.toml");

/// What a job may consume. Every field has a default in `policies/default.toml`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Limits {
    /// Wall-clock time from start to finish.
    #[serde(with = "duration_text")]
    pub wall: Duration,
    /// CPU time.
    #[serde(with = "duration_text")]
    pub cpu: Duration,
    /// WebAssembly fuel; [`Fuel::Unlimited`] runs unmetered code.
    pub fuel: Fuel,
    /// Peak guest memory.
    pub memory: ByteSize,
    /// Captured output per stream.
    pub output: ByteSize,
    /// Virtual CPUs of a microVM.
    pub vcpus: u32,
    /// Scratch disk.
    pub disk: ByteSize,
    /// Processes and threads.
    pub pids: u32,
    /// Open files.
    pub files: u32,
}

/// The most of a job's stdin held in memory at once: a [`StdinStream`](crate::StdinStream) an escalating job's
/// wasm attempt read, kept for its native rerun, or the stdin a recording holds. A job reading its stream as it
/// arrives is not bounded by it.
pub const MAX_BUFFERED_STDIN: usize = 64 << 20;

/// WebAssembly fuel budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Fuel {
    /// No metering: the guest runs code compiled without fuel checks.
    #[default]
    Unlimited,
    /// At most this many units.
    Limited(u64),
}

impl Fuel {
    /// The budget, if metered.
    pub fn limit(self) -> Option<u64> {
        match self {
            Fuel::Unlimited => None,
            Fuel::Limited(n) => Some(n),
        }
    }
}

impl fmt::Display for Fuel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Fuel::Unlimited => f.write_str("unlimited"),
            Fuel::Limited(n) => write!(f, "{n}"),
        }
    }
}

/// A fuel value that is neither a whole number nor `unlimited`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid fuel {0:?}: expected a whole number of units or \"unlimited\"")]
pub struct FuelParseError(String);

impl FromStr for Fuel {
    type Err = FuelParseError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let text = s.trim();
        if text == "unlimited" {
            return Ok(Fuel::Unlimited);
        }
        let digits: String = text.chars().filter(|c| *c != '_').collect();
        digits.parse().map(Fuel::Limited).map_err(|_| FuelParseError(s.to_owned()))
    }
}

impl Serialize for Fuel {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            Fuel::Unlimited => serializer.serialize_str("unlimited"),
            Fuel::Limited(n) => serializer.serialize_u64(*n),
        }
    }
}

impl<'de> Deserialize<'de> for Fuel {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Units(u64),
            Text(String),
        }
        match Raw::deserialize(deserializer)? {
            Raw::Units(n) => Ok(Fuel::Limited(n)),
            Raw::Text(text) => text.parse().map_err(serde::de::Error::custom),
        }
    }
}

/// Which limit stopped a job. Serialized as docs/DESIGN.md §5 names them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LimitKind {
    /// Wall-clock deadline.
    Wall,
    /// CPU time.
    Cpu,
    /// WebAssembly fuel.
    Fuel,
    /// Memory.
    Memory,
    /// Output.
    Output,
    /// Processes.
    Pids,
    /// Scratch disk.
    Disk,
    /// Open files.
    Files,
}

impl LimitKind {
    /// The name used in JSON and messages.
    pub fn as_str(self) -> &'static str {
        match self {
            LimitKind::Wall => "wall",
            LimitKind::Cpu => "cpu",
            LimitKind::Fuel => "fuel",
            LimitKind::Memory => "memory",
            LimitKind::Output => "output",
            LimitKind::Pids => "pids",
            LimitKind::Disk => "disk",
            LimitKind::Files => "files",
        }
    }
}

impl fmt::Display for LimitKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A policy's `[limits]` table could not be read.
#[derive(Debug, thiserror::Error)]
#[error("invalid [limits] in {origin}: {message}")]
pub struct LimitsError {
    origin: String,
    message: String,
}

/// A policy file seen for its `[limits]` only: its other tables belong to the engine's policy, which checks them.
#[derive(Deserialize)]
struct LimitsFile {
    limits: Limits,
}

impl Limits {
    /// Reads the `[limits]` table of a policy file's text; `origin` names the file in errors.
    pub fn from_policy_toml(text: &str, origin: &str) -> Result<Limits, LimitsError> {
        toml::from_str::<LimitsFile>(text).map(|file| file.limits).map_err(|err| LimitsError {
            origin: origin.to_owned(),
            message: err.to_string().trim_end().replace('\n', " "),
        })
    }
}

/// Some limits, each optional: a policy's `[limits]` table or the CLI's flags, applied over defaults.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LimitsOverride {
    /// See [`Limits::wall`].
    #[serde(with = "opt_duration_text", skip_serializing_if = "Option::is_none")]
    pub wall: Option<Duration>,
    /// See [`Limits::cpu`].
    #[serde(with = "opt_duration_text", skip_serializing_if = "Option::is_none")]
    pub cpu: Option<Duration>,
    /// See [`Limits::fuel`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fuel: Option<Fuel>,
    /// See [`Limits::memory`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory: Option<ByteSize>,
    /// See [`Limits::output`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub output: Option<ByteSize>,
    /// See [`Limits::vcpus`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vcpus: Option<u32>,
    /// See [`Limits::disk`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub disk: Option<ByteSize>,
    /// See [`Limits::pids`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pids: Option<u32>,
    /// See [`Limits::files`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub files: Option<u32>,
}

impl LimitsOverride {
    /// `base` with every limit this override sets replaced.
    pub fn apply(&self, base: &Limits) -> Limits {
        Limits {
            wall: self.wall.unwrap_or(base.wall),
            cpu: self.cpu.unwrap_or(base.cpu),
            fuel: self.fuel.unwrap_or(base.fuel),
            memory: self.memory.unwrap_or(base.memory),
            output: self.output.unwrap_or(base.output),
            vcpus: self.vcpus.unwrap_or(base.vcpus),
            disk: self.disk.unwrap_or(base.disk),
            pids: self.pids.unwrap_or(base.pids),
            files: self.files.unwrap_or(base.files),
        }
    }
}

mod opt_duration_text {
    use super::*;

    pub fn serialize<S: Serializer>(value: &Option<Duration>, serializer: S) -> Result<S::Ok, S::Error> {
        match value {
            Some(d) => duration_text::serialize(d, serializer),
            None => serializer.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<Duration>, D::Error> {
        duration_text::deserialize(deserializer).map(Some)
    }
}

static DEFAULT_LIMITS: LazyLock<Limits> = LazyLock::new(|| {
    // The file is part of the build and checked by `default_policy_parses`; a parse failure is a build defect.
    #[allow(clippy::expect_used)]
    Limits::from_policy_toml(DEFAULT_POLICY_TOML, "policies/default.toml").expect("policies/default.toml is valid")
});

impl Default for Limits {
    /// The limits of `policies/default.toml`.
    fn default() -> Self {
        DEFAULT_LIMITS.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_policy_parses() {
        let limits = Limits::from_policy_toml(DEFAULT_POLICY_TOML, "default.toml").expect("parses");
        assert_eq!(limits, Limits::default());
        assert_eq!(limits.fuel, Fuel::Unlimited);
        assert!(limits.wall > Duration::ZERO && limits.memory.0 > 0 && limits.output.0 > 0);
    }

    #[test]
    fn unknown_limit_key_is_refused_with_its_name() {
        let text = DEFAULT_POLICY_TOML.replace("pids = 256", "pids = 256\nmemroy = \"1GiB\"");
        let err = Limits::from_policy_toml(&text, "p.toml").expect_err("typo");
        let message = err.to_string();
        assert!(message.contains("memroy") && message.contains("p.toml"), "{message}");
    }

    #[test]
    fn bad_limit_value_is_refused() {
        let text = DEFAULT_POLICY_TOML.replace("wall = \"30s\"", "wall = \"30 parsecs\"");
        let err = Limits::from_policy_toml(&text, "p.toml").expect_err("bad unit");
        assert!(err.to_string().contains("parsecs"), "{err}");
    }

    #[test]
    fn override_replaces_only_what_it_sets() {
        let patch: LimitsOverride = toml::from_str("wall = \"2s\"\nmemory = \"64MiB\"").expect("parses");
        let limits = patch.apply(&Limits::default());
        assert_eq!(limits.wall, Duration::from_secs(2));
        assert_eq!(limits.memory, ByteSize(64 << 20));
        assert_eq!(limits.cpu, Limits::default().cpu);
    }

    #[test]
    fn fuel_parses_numbers_and_unlimited() {
        assert_eq!("1_000_000".parse(), Ok(Fuel::Limited(1_000_000)));
        assert_eq!("unlimited".parse(), Ok(Fuel::Unlimited));
        assert!("lots".parse::<Fuel>().is_err());
        assert!("-5".parse::<Fuel>().is_err());
    }
}
