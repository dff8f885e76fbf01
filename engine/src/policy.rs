//! Policy files (`policies/*.toml`): their `[limits]` table, applied over the defaults of `policies/default.toml`,
//! and their `[tiers]` table (which tiers jobs may use, where `--tier auto` sends native code, and whether it may
//! fall back when the preferred tier cannot run on this host, and above which requested time limit Python goes to the
//! native tier).

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;
use strata_core::{Limits, LimitsOverride, TierKind};

/// A policy: what jobs may use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    /// Limits every job starts from.
    pub limits: Limits,
    /// Which tiers jobs may run on and how `auto` picks.
    pub tiers: TierPolicy,
}

/// The `[tiers]` table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TierPolicy {
    /// Tiers jobs may run on, whether chosen by the user, by `auto` or by a fallback.
    pub allowed: Vec<TierKind>,
    /// Where `auto` sends Linux programs and shell commands (and Python when wasm is not allowed).
    pub native: TierKind,
    /// When `native` cannot run on this host, `auto` runs the job on the process tier instead (recorded in the
    /// outcome's `escalations`); otherwise the job fails with `tier_unavailable`.
    pub fallback: bool,
    /// `auto` sends a Python job whose wall or CPU limit exceeds this to the native tier (CPython in wasm runs
    /// CPU-bound code about 4× slower than native); `None` (`"off"`) never does.
    pub python_native_above: Option<Duration>,
}

impl Default for TierPolicy {
    /// The `[tiers]` of `policies/default.toml`.
    fn default() -> Self {
        TierPolicy {
            allowed: vec![TierKind::Wasm, TierKind::Process, TierKind::Microvm],
            native: TierKind::Microvm,
            fallback: true,
            python_native_above: Some(Duration::from_secs(60)),
        }
    }
}

impl TierPolicy {
    /// Whether jobs may run on `tier`.
    pub fn allows(&self, tier: TierKind) -> bool {
        self.allowed.contains(&tier)
    }
}

impl Default for Policy {
    /// `policies/default.toml`, compiled in.
    fn default() -> Self {
        Policy { limits: Limits::default(), tiers: TierPolicy::default() }
    }
}

/// A policy file that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    /// The file could not be read.
    #[error("cannot read policy {}: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The file is not a valid policy; the message names the line and the key.
    #[error("invalid policy {}: {message}", path.display())]
    Invalid {
        /// The file.
        path: PathBuf,
        /// The parser's message, with line, column and key.
        message: String,
    },
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PolicyFile {
    #[serde(default)]
    limits: LimitsOverride,
    #[serde(default)]
    tiers: TiersFile,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct TiersFile {
    allowed: Option<Vec<TierName>>,
    native: Option<TierName>,
    fallback: Option<bool>,
    python_native_above: Option<Threshold>,
}

/// A duration (`"60s"`) or `"off"`.
struct Threshold(Option<Duration>);

impl<'de> Deserialize<'de> for Threshold {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        if text == "off" {
            return Ok(Threshold(None));
        }
        strata_core::parse_duration(&text)
            .map(|duration| Threshold(Some(duration)))
            .map_err(|err| serde::de::Error::custom(format!("{err} (expected a duration such as \"60s\", or \"off\")")))
    }
}

/// A tier as a policy spells it: `wasm`, `process`, `vm` or `microvm`.
#[derive(Clone, Copy)]
struct TierName(TierKind);

impl<'de> Deserialize<'de> for TierName {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let name = String::deserialize(deserializer)?;
        match name.as_str() {
            "wasm" => Ok(TierName(TierKind::Wasm)),
            "process" => Ok(TierName(TierKind::Process)),
            "vm" | "microvm" => Ok(TierName(TierKind::Microvm)),
            other => Err(serde::de::Error::custom(format!(
                "unknown tier {other:?} (expected \"wasm\", \"process\" or \"vm\")"
            ))),
        }
    }
}

impl Policy {
    /// Reads a policy file. Keys it leaves out keep the defaults of `policies/default.toml`.
    pub fn from_file(path: &Path) -> Result<Policy, PolicyError> {
        let text =
            std::fs::read_to_string(path).map_err(|source| PolicyError::Read { path: path.to_owned(), source })?;
        Policy::from_toml(&text, path)
    }

    /// Parses a policy's text; `path` names it in errors.
    pub fn from_toml(text: &str, path: &Path) -> Result<Policy, PolicyError> {
        let invalid = |message: String| PolicyError::Invalid { path: path.to_owned(), message };
        let file: PolicyFile = toml::from_str(text).map_err(|err| invalid(one_line(&err.to_string())))?;
        let defaults = TierPolicy::default();
        let mut allowed: Vec<TierKind> = match file.tiers.allowed {
            Some(names) => names.into_iter().map(|name| name.0).collect(),
            None => defaults.allowed,
        };
        allowed.sort();
        allowed.dedup();
        if allowed.is_empty() {
            return Err(invalid("[tiers] allowed is empty: no job could run".into()));
        }
        let native = file.tiers.native.map_or(defaults.native, |name| name.0);
        if native == TierKind::Wasm {
            return Err(invalid(
                "[tiers] native must be \"process\" or \"vm\" (wasm does not run Linux programs)".into(),
            ));
        }
        if file.tiers.native.is_some() && !allowed.contains(&native) {
            return Err(invalid(format!("[tiers] native = \"{native}\" is not in [tiers] allowed")));
        }
        // A default `native` the file's `allowed` excludes gives way to the other native tier.
        let native = match file.tiers.native {
            None if !allowed.contains(&native) && allowed.contains(&TierKind::Process) => TierKind::Process,
            _ => native,
        };
        let tiers = TierPolicy {
            allowed,
            native,
            fallback: file.tiers.fallback.unwrap_or(defaults.fallback),
            python_native_above: file.tiers.python_native_above.map_or(defaults.python_native_above, |t| t.0),
        };
        Ok(Policy { limits: file.limits.apply(&Limits::default()), tiers })
    }
}

/// toml's messages span several lines (the offending source line and a caret); keep them on one.
fn one_line(message: &str) -> String {
    message
        .lines()
        .map(str::trim)
        .filter(|line| !line.is_empty() && !line.chars().all(|c| c == '|' || c == '^' || c.is_whitespace()))
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partial_policy_keeps_other_defaults() {
        let policy = Policy::from_toml("[limits]\nwall = \"5s\"\n", Path::new("p.toml")).expect("valid");
        assert_eq!(policy.limits.wall, std::time::Duration::from_secs(5));
        assert_eq!(policy.limits.memory, Limits::default().memory);
    }

    #[test]
    fn unknown_key_is_named_with_its_line() {
        let err =
            Policy::from_toml("[limits]\nwall = \"5s\"\nmemroy = \"1GiB\"\n", Path::new("p.toml")).expect_err("typo");
        let message = err.to_string();
        assert!(message.contains("p.toml") && message.contains("memroy") && message.contains("line 3"), "{message}");
        assert!(!message.contains('\n'), "{message}");
    }

    #[test]
    fn unknown_table_is_refused() {
        assert!(Policy::from_toml("[limitz]\n", Path::new("p.toml")).is_err());
    }

    #[test]
    fn tiers_table_parses_and_is_checked() {
        let policy = Policy::from_toml("[tiers]\nallowed = [\"wasm\"]\n", Path::new("p.toml")).expect("valid");
        assert_eq!(policy.tiers.allowed, [TierKind::Wasm]);
        assert!(!policy.tiers.allows(TierKind::Process));
        let policy =
            Policy::from_toml("[tiers]\nallowed = [\"process\", \"wasm\"]\n", Path::new("p.toml")).expect("valid");
        assert_eq!(policy.tiers.native, TierKind::Process, "the default vm gives way to an allowed process tier");
        let policy =
            Policy::from_toml("[tiers]\nnative = \"process\"\nfallback = false\n", Path::new("p.toml")).expect("valid");
        assert_eq!((policy.tiers.native, policy.tiers.fallback), (TierKind::Process, false));
        for bad in [
            "[tiers]\nallowed = []\n",
            "[tiers]\nallowed = [\"wasm\", \"kvm\"]\n",
            "[tiers]\nnative = \"wasm\"\n",
            "[tiers]\nallowed = [\"wasm\", \"process\"]\nnative = \"vm\"\n",
            "[tiers]\nfalback = true\n",
        ] {
            let err = Policy::from_toml(bad, Path::new("bad.toml")).expect_err(bad).to_string();
            assert!(err.contains("bad.toml"), "{err}");
        }
    }

    #[test]
    fn python_native_above_takes_a_duration_or_off() {
        let parse = |text: &str| Policy::from_toml(text, Path::new("p.toml"));
        assert_eq!(Policy::default().tiers.python_native_above, Some(Duration::from_secs(60)));
        let policy = parse("[tiers]\npython_native_above = \"5m\"\n").expect("valid");
        assert_eq!(policy.tiers.python_native_above, Some(Duration::from_secs(300)));
        let policy = parse("[tiers]\npython_native_above = \"off\"\n").expect("valid");
        assert_eq!(policy.tiers.python_native_above, None);
        let err = parse("[tiers]\npython_native_above = \"soon\"\n").expect_err("not a duration").to_string();
        assert!(err.contains("p.toml") && err.contains("line 2") && err.contains("python_native_above"), "{err}");
        let err = parse("[tiers]\npython_native_abov = \"5m\"\n").expect_err("typo").to_string();
        assert!(err.contains("python_native_abov"), "{err}");
    }

    #[test]
    fn the_default_policy_file_is_a_valid_policy() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../policies/default.toml");
        assert_eq!(Policy::from_file(&path).expect("valid"), Policy::default());
    }
}
