//! Policy files (`policies/*.toml`): their `[limits]` table, applied over the defaults of `policies/default.toml`,
//! and their `[tiers]` table (which tiers jobs may use, where `--tier auto` sends native code, and whether it may
//! fall back when the preferred tier cannot run on this host, and above which requested time limit Python goes to the
//! native tier), its `[escalation]` table (whether and why a failed wasm run may re-run on the native tier), its
//! `[network]` table (the default egress allowlist) and its `[grants.NAME]` tables (named sets of directory grants).

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;
use strata_core::allow::Allowlist;
use strata_core::{Grant, Limits, LimitsOverride, Net, TierKind};
use toml::Spanned;

/// A policy: what jobs may use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    /// Limits every job starts from.
    pub limits: Limits,
    /// Which tiers jobs may run on and how `auto` picks.
    pub tiers: TierPolicy,
    /// Whether and why a failed wasm run may re-run on the native tier.
    pub escalation: EscalationPolicy,
    /// Network egress every job gets (`--allow-net` adds to it).
    pub network: NetworkPolicy,
    /// Named sets of directory grants (`strata run --grants NAME`), by name.
    pub grant_sets: BTreeMap<String, Vec<Grant>>,
}

/// The `[escalation]` table: the rules dynamic escalation (wasm → the native tier, [`crate::escalate`]) obeys.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EscalationPolicy {
    /// Whether a failed wasm run may be re-run on the native tier at all.
    pub allowed: bool,
    /// The reasons a failed wasm run is re-run for (when `allowed`).
    pub on: Vec<EscalationReason>,
}

impl Default for EscalationPolicy {
    /// The `[escalation]` of `policies/default.toml`.
    fn default() -> Self {
        EscalationPolicy { allowed: true, on: vec![EscalationReason::MissingModule, EscalationReason::UnsupportedCall] }
    }
}

impl EscalationPolicy {
    /// Whether a wasm run that failed for `reason` may re-run on the native tier.
    pub fn permits(&self, reason: EscalationReason) -> bool {
        self.allowed && self.on.contains(&reason)
    }
}

/// Why a failed wasm run may be re-run on the native tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum EscalationReason {
    /// The job imports a module the wasm build does not have (`"missing_module"`).
    MissingModule,
    /// The job made an OS call the wasm runtime does not support (`"unsupported_call"`).
    UnsupportedCall,
}

impl EscalationReason {
    /// The name a policy spells it with.
    pub fn as_str(self) -> &'static str {
        match self {
            EscalationReason::MissingModule => "missing_module",
            EscalationReason::UnsupportedCall => "unsupported_call",
        }
    }
}

impl fmt::Display for EscalationReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The `[network]` table: the egress allowlist every job gets, parsed once when the policy is read.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NetworkPolicy {
    allowlist: Allowlist,
}

impl NetworkPolicy {
    /// The specs as the policy wrote them.
    pub fn specs(&self) -> &[String] {
        self.allowlist.specs()
    }

    /// The parsed allowlist (empty: no network).
    pub fn allowlist(&self) -> &Allowlist {
        &self.allowlist
    }

    /// The job's network: these specs, then those of `extra` (`--allow-net`, a request's `allow_net`); none at
    /// all is [`Net::Deny`].
    pub fn net_with(&self, extra: &Allowlist) -> Net {
        let all = self.allowlist.union(extra);
        if all.is_empty() { Net::Deny } else { Net::Allow(all) }
    }
}

/// `strata run --grants NAME` names a set the policy does not define.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("no grant set {name:?} in the policy (it defines {})", list_names(.available))]
pub struct UnknownGrantSet {
    /// The name asked for.
    pub name: String,
    /// The sets the policy defines.
    pub available: Vec<String>,
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
    /// Whether `auto` may run Python that computes with numpy on wasm, where numpy's default integer is `int32`
    /// and results can differ from a 64-bit host's ([`crate::scan::WASM32_NUMERICS`]). `false` (the default)
    /// sends such a job to the native tier, and refuses it (`wasm32_numerics`) where no native tier can run it.
    pub python_wasm_numpy: bool,
}

impl Default for TierPolicy {
    /// The `[tiers]` of `policies/default.toml`.
    fn default() -> Self {
        TierPolicy {
            allowed: vec![TierKind::Wasm, TierKind::Process, TierKind::Microvm],
            native: TierKind::Microvm,
            fallback: true,
            python_native_above: Some(Duration::from_secs(60)),
            python_wasm_numpy: false,
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
        Policy {
            limits: Limits::default(),
            tiers: TierPolicy::default(),
            escalation: EscalationPolicy::default(),
            network: NetworkPolicy::default(),
            grant_sets: BTreeMap::new(),
        }
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
    #[serde(default)]
    escalation: EscalationFile,
    #[serde(default)]
    network: NetworkFile,
    #[serde(default)]
    grants: BTreeMap<GrantSetName, GrantSetFile>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct EscalationFile {
    allowed: Option<Spanned<bool>>,
    on: Option<Vec<ReasonName>>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct NetworkFile {
    allow: Option<Vec<NetSpec>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct GrantSetFile {
    dirs: Spanned<Vec<GrantSpec>>,
}

/// An escalation reason as a policy spells it.
struct ReasonName(EscalationReason);

impl<'de> Deserialize<'de> for ReasonName {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let name = String::deserialize(deserializer)?;
        match name.as_str() {
            "missing_module" => Ok(ReasonName(EscalationReason::MissingModule)),
            "unsupported_call" => Ok(ReasonName(EscalationReason::UnsupportedCall)),
            other => Err(serde::de::Error::custom(format!(
                "[escalation] on: unknown reason {other:?} (expected \"missing_module\" or \"unsupported_call\")"
            ))),
        }
    }
}

/// A `[network] allow` spec, parsed (once) by the allowlist's parser, the one the egress proxy matches with.
struct NetSpec(Allowlist);

impl<'de> Deserialize<'de> for NetSpec {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let spec = String::deserialize(deserializer)?;
        match Allowlist::parse([&spec]) {
            Ok(one) => Ok(NetSpec(one)),
            Err(err) => Err(serde::de::Error::custom(format!("[network] allow: {err}"))),
        }
    }
}

/// A `[grants.NAME] dirs` entry, `HOST:GUEST[:ro|:rw]` as `--dir` takes it.
struct GrantSpec(Grant);

impl<'de> Deserialize<'de> for GrantSpec {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let spec = String::deserialize(deserializer)?;
        spec.parse().map(GrantSpec).map_err(|err| serde::de::Error::custom(format!("[grants] dirs: {err}")))
    }
}

/// The name of a grant set: letters, digits, `-` and `_`.
#[derive(PartialEq, Eq, PartialOrd, Ord)]
struct GrantSetName(String);

impl<'de> Deserialize<'de> for GrantSetName {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let name = String::deserialize(deserializer)?;
        if name.is_empty() || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_') {
            return Err(serde::de::Error::custom(format!(
                "[grants] set name {name:?} must be letters, digits, '-' and '_'"
            )));
        }
        Ok(GrantSetName(name))
    }
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct TiersFile {
    allowed: Option<Vec<TierName>>,
    native: Option<TierName>,
    fallback: Option<bool>,
    python_native_above: Option<Threshold>,
    python_wasm_numpy: Option<bool>,
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
            python_wasm_numpy: file.tiers.python_wasm_numpy.unwrap_or(defaults.python_wasm_numpy),
        };
        let line = |offset: usize| text.get(..offset).map_or(0, |before| before.matches('\n').count()) + 1;
        let native_allowed = tiers.allows(TierKind::Process) || tiers.allows(TierKind::Microvm);
        let escalation = match file.escalation.allowed {
            Some(allowed) if *allowed.get_ref() && !native_allowed => {
                return Err(invalid(format!(
                    "line {}, key `allowed`: [escalation] allowed = true, but [tiers] allowed has no native tier to \
                     escalate to",
                    line(allowed.span().start)
                )));
            }
            allowed => EscalationPolicy {
                // Left out, escalation follows the tiers: none when no native tier is allowed.
                allowed: allowed.map_or(native_allowed, |allowed| allowed.into_inner()),
                on: match file.escalation.on {
                    Some(names) => {
                        let mut on: Vec<EscalationReason> = names.into_iter().map(|name| name.0).collect();
                        on.sort();
                        on.dedup();
                        on
                    }
                    None => EscalationPolicy::default().on,
                },
            },
        };
        let network = NetworkPolicy {
            allowlist: file
                .network
                .allow
                .unwrap_or_default()
                .iter()
                .fold(Allowlist::default(), |all, one| all.union(&one.0)),
        };
        // Relative host paths of a grant set are relative to the policy file's directory.
        let base = path.parent().unwrap_or(Path::new(""));
        let mut grant_sets = BTreeMap::new();
        for (name, set) in file.grants {
            let span = set.dirs.span();
            let mut grants: Vec<Grant> = Vec::new();
            for GrantSpec(mut grant) in set.dirs.into_inner() {
                if grants.iter().any(|other| other.guest == grant.guest) {
                    return Err(invalid(format!(
                        "line {}, key `dirs`: [grants.{}] grants guest path {} twice",
                        line(span.start),
                        name.0,
                        grant.guest
                    )));
                }
                if grant.host.is_relative() {
                    grant.host = base.join(&grant.host);
                }
                grants.push(grant);
            }
            grant_sets.insert(name.0, grants);
        }
        Ok(Policy { limits: file.limits.apply(&Limits::default()), tiers, escalation, network, grant_sets })
    }

    /// The grants of the named sets in order, then `extra` (`--dir`); a later grant at a guest path replaces an
    /// earlier one, so flags override the policy.
    pub fn grants_with(&self, names: &[String], extra: Vec<Grant>) -> Result<Vec<Grant>, UnknownGrantSet> {
        let mut grants: Vec<Grant> = Vec::new();
        let mut add = |grant: Grant| match grants.iter_mut().find(|other| other.guest == grant.guest) {
            Some(other) => *other = grant,
            None => grants.push(grant),
        };
        for name in names {
            let set = self.grant_sets.get(name).ok_or_else(|| UnknownGrantSet {
                name: name.clone(),
                available: self.grant_sets.keys().cloned().collect(),
            })?;
            set.iter().cloned().for_each(&mut add);
        }
        extra.into_iter().for_each(add);
        Ok(grants)
    }
}

fn list_names(names: &[String]) -> String {
    if names.is_empty() { "none".to_owned() } else { names.join(", ") }
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
    fn python_wasm_numpy_is_off_unless_a_policy_says_so() {
        let parse = |text: &str| Policy::from_toml(text, Path::new("p.toml"));
        assert!(!Policy::default().tiers.python_wasm_numpy);
        assert!(parse("[tiers]\npython_wasm_numpy = true\n").expect("valid").tiers.python_wasm_numpy);
        assert!(!parse("[tiers]\npython_wasm_numpy = false\n").expect("valid").tiers.python_wasm_numpy);
        assert!(parse("[tiers]\npython_wasm_numpy = \"yes\"\n").is_err());
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

    /// The error for `text`, checked to name the file, the line and the key, on one line.
    fn error_names(text: &str, line: usize, key: &str) -> String {
        let err = Policy::from_toml(text, Path::new("bad.toml")).expect_err(text).to_string();
        assert!(err.contains("bad.toml"), "{text}: {err}");
        assert!(err.contains(&format!("line {line}")), "{text}: {err}");
        assert!(err.contains(key), "{text}: {err}");
        assert!(!err.contains('\n'), "{err}");
        err
    }

    #[test]
    fn escalation_table_parses_and_is_checked() {
        let parse = |text: &str| Policy::from_toml(text, Path::new("p.toml")).expect(text);
        let default = Policy::default().escalation;
        assert!(default.permits(EscalationReason::MissingModule) && default.permits(EscalationReason::UnsupportedCall));
        let policy = parse("[escalation]\nallowed = false\n");
        assert!(!policy.escalation.allowed && !policy.escalation.permits(EscalationReason::MissingModule));
        let policy = parse("[escalation]\non = [\"unsupported_call\", \"unsupported_call\"]\n");
        assert_eq!(policy.escalation.on, [EscalationReason::UnsupportedCall]);
        assert!(!policy.escalation.permits(EscalationReason::MissingModule));
        // A wasm-only policy has nowhere to escalate to: left out, escalation is off; asked for, it is an error.
        assert!(!parse("[tiers]\nallowed = [\"wasm\"]\n").escalation.allowed);
        error_names("[tiers]\nallowed = [\"wasm\"]\n\n[escalation]\nallowed = true\n", 5, "allowed");
        error_names("[escalation]\nallowed = \"yes\"\n", 2, "allowed");
        error_names("[escalation]\non = [\"missing_module\", \"segfault\"]\n", 2, "on");
        error_names("[escalation]\non = \"missing_module\"\n", 2, "on");
        error_names("[escalation]\nallowed = true\nwhen = []\n", 3, "when");
    }

    #[test]
    fn network_table_checks_every_spec() {
        let parse = |text: &str| Policy::from_toml(text, Path::new("p.toml"));
        assert_eq!(Policy::default().network.net_with(&Allowlist::default()), Net::Deny);
        let policy = parse("[network]\nallow = [\"example.com:443\", \"*.pypi.org\", \"10.0.0.1\", \"[::1]:8080\"]\n")
            .expect("valid");
        assert_eq!(policy.network.specs().len(), 4);
        assert_eq!(policy.network.allowlist().rules().len(), 4);
        assert_eq!(
            policy.network.net_with(&Allowlist::parse(["example.com:443", "localhost"]).expect("valid")),
            Net::allow(["example.com:443", "*.pypi.org", "10.0.0.1", "[::1]:8080", "localhost"]).expect("valid")
        );
        for bad in ["*", "http://example.com", "example.com:0", "example.com:99999", "::1:443", "a.*.com", "user@host"]
        {
            error_names(&format!("[network]\nallow = [\"{bad}\"]\n"), 2, "allow");
        }
        // In an array over several lines, the error points at the key's line.
        error_names("[network]\nallow = [\n  \"ok.example\",\n  \"bad host\",\n]\n", 2, "allow");
        error_names("[network]\ndeny = []\n", 2, "deny");
        error_names("[network]\nallow = \"example.com\"\n", 2, "allow");
    }

    #[test]
    fn grant_sets_parse_and_apply_by_name() {
        let text =
            "[grants.data]\ndirs = [\"/srv/data:/data\", \"/srv/out:/out:rw\"]\n\n[grants.rel]\ndirs = [\"in:/in\"]\n";
        let policy = Policy::from_toml(text, Path::new("/etc/strata/p.toml")).expect("valid");
        assert_eq!(policy.grant_sets.keys().collect::<Vec<_>>(), ["data", "rel"]);
        assert_eq!(policy.grant_sets["rel"][0].host, Path::new("/etc/strata/in"), "relative to the policy file");
        let grants = policy
            .grants_with(&["data".into()], vec!["/elsewhere:/out:ro".parse().expect("grant")])
            .expect("known set");
        let shown: Vec<String> = grants.iter().map(Grant::to_string).collect();
        assert_eq!(shown, ["/srv/data:/data:ro", "/elsewhere:/out:ro"], "--dir overrides the set at /out");
        let err = policy.grants_with(&["nope".into()], Vec::new()).expect_err("unknown set");
        assert_eq!(err.to_string(), "no grant set \"nope\" in the policy (it defines data, rel)");
        let err = Policy::default().grants_with(&["x".into()], Vec::new()).expect_err("none");
        assert!(err.to_string().ends_with("(it defines none)"), "{err}");

        error_names("[grants.data]\ndirs = [\"/srv/data\"]\n", 2, "dirs");
        error_names("[grants.data]\ndirs = [\"/srv:data\"]\n", 2, "dirs");
        error_names("[grants.data]\ndirs = [\"/srv:/d/../x\"]\n", 2, "dirs");
        error_names("[grants.data]\ndirs = [\"/a:/d\", \"/b:/d/\"]\n", 2, "dirs");
        error_names("[grants.data]\ndirs = []\nfiles = []\n", 3, "files");
        error_names("[grants.data]\ndris = []\n", 2, "dris");
        error_names("[grants]\ndirs = [\"/a:/a\"]\n", 2, "dirs");
        error_names("[grants.\"my set\"]\ndirs = []\n", 1, "my set");
    }

    #[test]
    fn the_strict_policy_file_is_wasm_only_and_tight() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../policies/strict.toml");
        let policy = Policy::from_file(&path).expect("valid");
        assert_eq!(policy.tiers.allowed, [TierKind::Wasm]);
        assert!(!policy.escalation.allowed);
        assert_eq!(policy.network.net_with(&Allowlist::default()), Net::Deny);
        assert!(policy.limits.wall <= Duration::from_secs(5) && policy.limits.cpu <= Duration::from_secs(5));
        assert!(policy.limits.fuel.limit().is_some(), "fuel is bounded");
        assert!(policy.limits.memory < Limits::default().memory);
        assert!(policy.limits.output < Limits::default().output);
    }

    #[test]
    fn the_default_policy_file_is_a_valid_policy() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../policies/default.toml");
        assert_eq!(Policy::from_file(&path).expect("valid"), Policy::default());
    }
}
