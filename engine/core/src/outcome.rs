//! The result of a job: how it ended, what it printed, what it used.
//!
//! The JSON form is the contract of docs/DESIGN.md §5 (`strata run --json`, the server's responses); see [`Outcome`].

use std::fmt;
use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::limits::LimitKind;
use crate::tools::ToolCall;

/// The tiers, cheapest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TierKind {
    /// wasmtime.
    Wasm,
    /// A Linux jail.
    Process,
    /// A KVM microVM.
    Microvm,
}

impl TierKind {
    /// The name used in JSON and messages.
    pub fn as_str(self) -> &'static str {
        match self {
            TierKind::Wasm => "wasm",
            TierKind::Process => "process",
            TierKind::Microvm => "microvm",
        }
    }

    /// Whether this tier's sandboxes run several jobs at once (see [`crate::Sandbox`]); elsewhere a job while
    /// another runs is [`crate::TierError::Busy`].
    pub fn runs_jobs_at_once(self) -> bool {
        match self {
            TierKind::Process => true,
            TierKind::Wasm | TierKind::Microvm => false,
        }
    }
}

impl fmt::Display for TierKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Which output stream a chunk came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Stream {
    /// Standard output.
    Stdout,
    /// Standard error.
    Stderr,
}

/// How a job ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Status {
    /// The guest exited with this code.
    Exited {
        /// Exit code.
        code: i32,
    },
    /// A limit stopped the guest.
    LimitExceeded {
        /// Which limit.
        limit: LimitKind,
    },
    /// The guest faulted (a WebAssembly trap, a fatal signal).
    Trapped {
        /// What happened.
        message: String,
    },
    /// The guest died abnormally (kernel panic, agent lost).
    Crashed {
        /// What happened.
        message: String,
    },
}

impl Status {
    /// The exit status `strata run` uses for this outcome (docs/DESIGN.md §5): the guest's code, 124 for a limit,
    /// 125 for a trap or crash.
    pub fn exit_code(&self) -> i32 {
        match self {
            Status::Exited { code } => *code,
            Status::LimitExceeded { .. } => 124,
            Status::Trapped { .. } | Status::Crashed { .. } => 125,
        }
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Status::Exited { code } => write!(f, "exited with code {code}"),
            Status::LimitExceeded { limit } => write!(f, "{limit} limit exceeded"),
            Status::Trapped { message } => write!(f, "trapped: {message}"),
            Status::Crashed { message } => write!(f, "crashed: {message}"),
        }
    }
}

/// What was cut: captured streams at the output limit, egress entries at the log's cap.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Truncated {
    /// stdout was cut.
    pub stdout: bool,
    /// stderr was cut.
    pub stderr: bool,
    /// Network requests made but not listed in `egress` (the log keeps a bounded number per job); absent when 0.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub egress: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// What a job used.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Usage {
    /// Wall-clock time from start to finish.
    pub wall: Duration,
    /// CPU time.
    pub cpu: Duration,
    /// Fuel consumed, when the job was fuel-metered.
    pub fuel: Option<u64>,
    /// Peak guest memory in bytes.
    pub peak_memory: u64,
    /// Bytes the guest wrote to stdout, including any beyond the output limit.
    pub stdout_bytes: u64,
    /// Bytes the guest wrote to stderr, including any beyond the output limit.
    pub stderr_bytes: u64,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct UsageJson {
    wall_ms: f64,
    cpu_ms: f64,
    fuel: Option<u64>,
    peak_memory_bytes: u64,
    stdout_bytes: u64,
    stderr_bytes: u64,
}

fn millis(d: Duration) -> f64 {
    // Microsecond precision is what the clocks give; more digits would be noise in the JSON.
    (d.as_nanos() as f64 / 1_000.0).round() / 1_000.0
}

fn from_millis(ms: f64) -> Duration {
    if ms.is_finite() && ms > 0.0 { Duration::from_secs_f64(ms / 1_000.0) } else { Duration::ZERO }
}

impl Serialize for Usage {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        UsageJson {
            wall_ms: millis(self.wall),
            cpu_ms: millis(self.cpu),
            fuel: self.fuel,
            peak_memory_bytes: self.peak_memory,
            stdout_bytes: self.stdout_bytes,
            stderr_bytes: self.stderr_bytes,
        }
        .serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for Usage {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let u = UsageJson::deserialize(deserializer)?;
        Ok(Usage {
            wall: from_millis(u.wall_ms),
            cpu: from_millis(u.cpu_ms),
            fuel: u.fuel,
            peak_memory: u.peak_memory_bytes,
            stdout_bytes: u.stdout_bytes,
            stderr_bytes: u.stderr_bytes,
        })
    }
}

/// A job that moved to a stronger tier, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Escalation {
    /// The tier that could not run it.
    pub from: TierKind,
    /// The tier that ran it next.
    pub to: TierKind,
    /// Why.
    pub reason: String,
}

/// One network request a job made (the Outcome's `egress` entries): the host egress proxy's record on the native
/// tiers, the wasm tier's record of a component's connect, as plain data,
/// `{"host","port","kind","bytes_up","bytes_down","verdict","reason"}`, and `secrets_injected` /
/// `secrets_withheld` (names of egress secrets) when the request concerned any.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EgressEntry {
    /// The target host as requested (normalised; empty when the request could not be parsed).
    pub host: String,
    /// The target port (0 when the request could not be parsed).
    pub port: u16,
    /// `"connect"` (a tunnel through the egress proxy), `"http"` (a request the proxy forwarded) or `"tcp"` (a
    /// wasm component's `wasi:sockets` connect, checked against the allowlist by the wasm tier).
    pub kind: String,
    /// Bytes written to the origin.
    pub bytes_up: u64,
    /// Bytes relayed from the origin to the job.
    pub bytes_down: u64,
    /// `"allowed"`, `"denied"` or `"failed"`.
    pub verdict: String,
    /// Why, unless allowed.
    pub reason: Option<String>,
    /// Egress secrets the proxy put into this request's headers, by name (absent when none).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub secrets_injected: Vec<String>,
    /// Egress secrets whose placeholder the request carried toward a host they are not bound to, left as the
    /// placeholder, by name (absent when none).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub secrets_withheld: Vec<String>,
}

/// Where the router sent a job, and why (`"route": {"tier": "wasm", "reason": "..."}` in the JSON).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteDecision {
    /// The tier the job was sent to (after a fallback the policy allowed, which `escalations` also records).
    pub tier: TierKind,
    /// Why, in one line: `"wasm module"`, `"python: imports subprocess (needs processes)"`, `"explicit --tier
    /// process"`.
    pub reason: String,
}

/// The result of a job that ran.
///
/// Serialized, it is exactly the object of docs/DESIGN.md §5:
/// `{"tier":"wasm","status":{"kind":"exited","code":0},"stdout":"...","stderr":"...",
/// "truncated":{"stdout":false,"stderr":false},"usage":{...},"escalations":[],"tools":[]}`, with
/// `"route":{"tier":…,"reason":…}` after `tier` when the engine routed the job ([`RouteDecision`]; a tier leaves it
/// `None`, and then it is absent). Output that is not UTF-8 is base64 with `"stdout_encoding":"base64"` (or
/// `stderr_encoding`) beside it. `tools` lists the tool-protocol frames the job exchanged (see [`ToolCall`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    /// The tier that ran the job.
    pub tier: TierKind,
    /// How it ended.
    pub status: Status,
    /// Captured stdout (at most the output limit, secrets redacted).
    pub stdout: Vec<u8>,
    /// Captured stderr (at most the output limit, secrets redacted).
    pub stderr: Vec<u8>,
    /// Which streams were cut.
    pub truncated: Truncated,
    /// What the job used.
    pub usage: Usage,
    /// Tiers the job moved through before this one.
    pub escalations: Vec<Escalation>,
    /// Every tool-protocol frame the job exchanged with the host, in order.
    pub tools: Vec<ToolCall>,
    /// The router's decision, filled by the engine (`None` from a tier or a sandbox's `exec`).
    pub route: Option<RouteDecision>,
    /// Every request the job made through the egress proxy, in the order they finished (empty without
    /// network, and then absent from the JSON).
    pub egress: Vec<EgressEntry>,
    /// Set when the job's numbers follow a platform other than the host's because the user asked for it: Python
    /// computing with numpy on wasm32 (`"platform":"wasm32"`, where numpy's default integer is `int32`). Absent
    /// from the JSON otherwise.
    pub platform: Option<Platform>,
}

/// The platform whose numeric semantics a job ran under, when it is not the host's ([`Outcome::platform`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Platform {
    /// 32-bit WebAssembly: C `long` and numpy's default integer are 32 bits wide.
    Wasm32,
}

impl Outcome {
    /// An outcome of `tier` that ended as `status`, with no output, usage, history or egress yet: each tier
    /// fills what it measured with struct update syntax (`Outcome { stdout, ..Outcome::new(tier, status) }`).
    pub fn new(tier: TierKind, status: Status) -> Outcome {
        Outcome {
            tier,
            status,
            stdout: Vec::new(),
            stderr: Vec::new(),
            truncated: Truncated::default(),
            usage: Usage::default(),
            escalations: Vec::new(),
            tools: Vec::new(),
            route: None,
            egress: Vec::new(),
            platform: None,
        }
    }

    /// The exit status `strata run` uses for this outcome.
    pub fn exit_code(&self) -> i32 {
        self.status.exit_code()
    }
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct OutcomeJson {
    tier: TierKind,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    route: Option<RouteDecision>,
    status: Status,
    stdout: String,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    stdout_encoding: Option<Encoding>,
    stderr: String,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    stderr_encoding: Option<Encoding>,
    truncated: Truncated,
    usage: Usage,
    escalations: Vec<Escalation>,
    tools: Vec<ToolCall>,
    #[serde(skip_serializing_if = "Vec::is_empty", default)]
    egress: Vec<EgressEntry>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    platform: Option<Platform>,
}

#[derive(Serialize, Deserialize, Clone, Copy)]
#[serde(rename_all = "snake_case")]
enum Encoding {
    Base64,
}

fn encode(bytes: &[u8]) -> (String, Option<Encoding>) {
    match std::str::from_utf8(bytes) {
        Ok(text) => (text.to_owned(), None),
        Err(_) => (BASE64.encode(bytes), Some(Encoding::Base64)),
    }
}

fn decode<E: serde::de::Error>(text: String, encoding: Option<Encoding>) -> Result<Vec<u8>, E> {
    match encoding {
        None => Ok(text.into_bytes()),
        Some(Encoding::Base64) => BASE64.decode(text).map_err(E::custom),
    }
}

impl Serialize for Outcome {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let (stdout, stdout_encoding) = encode(&self.stdout);
        let (stderr, stderr_encoding) = encode(&self.stderr);
        OutcomeJson {
            tier: self.tier,
            route: self.route.clone(),
            status: self.status.clone(),
            stdout,
            stdout_encoding,
            stderr,
            stderr_encoding,
            truncated: self.truncated,
            usage: self.usage.clone(),
            escalations: self.escalations.clone(),
            tools: self.tools.clone(),
            egress: self.egress.clone(),
            platform: self.platform,
        }
        .serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for Outcome {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let o = OutcomeJson::deserialize(deserializer)?;
        Ok(Outcome {
            tier: o.tier,
            status: o.status,
            stdout: decode(o.stdout, o.stdout_encoding)?,
            stderr: decode(o.stderr, o.stderr_encoding)?,
            truncated: o.truncated,
            usage: o.usage,
            escalations: o.escalations,
            tools: o.tools,
            route: o.route,
            egress: o.egress,
            platform: o.platform,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Outcome {
        Outcome {
            stdout: b"hello\n".to_vec(),
            usage: Usage {
                wall: Duration::from_micros(1200),
                cpu: Duration::from_micros(1000),
                fuel: Some(12345),
                peak_memory: 1_114_112,
                stdout_bytes: 6,
                stderr_bytes: 0,
            },
            ..Outcome::new(TierKind::Wasm, Status::Exited { code: 0 })
        }
    }

    #[test]
    fn outcome_json_matches_the_design_contract() {
        let json = serde_json::to_string(&sample()).expect("serializes");
        assert_eq!(
            json,
            r#"{"tier":"wasm","status":{"kind":"exited","code":0},"stdout":"hello\n","stderr":"","truncated":{"stdout":false,"stderr":false},"usage":{"wall_ms":1.2,"cpu_ms":1.0,"fuel":12345,"peak_memory_bytes":1114112,"stdout_bytes":6,"stderr_bytes":0},"escalations":[],"tools":[]}"#
        );
    }

    #[test]
    fn egress_entries_not_kept_are_counted_in_truncated_only_when_there_are_some() {
        let mut outcome = sample();
        outcome.truncated.egress = 3;
        let json = serde_json::to_value(&outcome).expect("serializes");
        assert_eq!(json["truncated"], serde_json::json!({"stdout": false, "stderr": false, "egress": 3}));
        let back: Outcome = serde_json::from_value(json).expect("round-trips");
        assert_eq!(back.truncated.egress, 3);
    }

    #[test]
    fn route_follows_the_tier_when_set_and_round_trips() {
        let mut outcome = sample();
        outcome.route = Some(RouteDecision { tier: TierKind::Wasm, reason: "wasm module".into() });
        let json = serde_json::to_string(&outcome).expect("serializes");
        assert!(
            json.starts_with(r#"{"tier":"wasm","route":{"tier":"wasm","reason":"wasm module"},"status":"#),
            "{json}"
        );
        let back: Outcome = serde_json::from_str(&json).expect("deserializes");
        assert_eq!(back, outcome);
    }

    #[test]
    fn limit_status_names_the_limit() {
        let status = Status::LimitExceeded { limit: LimitKind::Memory };
        let json = serde_json::to_string(&status).expect("serializes");
        assert_eq!(json, r#"{"kind":"limit_exceeded","limit":"memory"}"#);
        assert_eq!(status.exit_code(), 124);
        assert_eq!(Status::Trapped { message: "x".into() }.exit_code(), 125);
    }

    #[test]
    fn binary_output_is_base64_with_an_encoding_field() {
        let mut outcome = sample();
        outcome.stdout = vec![0xff, 0x00, 0x80];
        let json = serde_json::to_value(&outcome).expect("serializes");
        assert_eq!(json["stdout"], "/wCA");
        assert_eq!(json["stdout_encoding"], "base64");
        assert!(json.get("stderr_encoding").is_none());
        let back: Outcome = serde_json::from_value(json).expect("deserializes");
        assert_eq!(back, outcome);
    }

    #[test]
    fn outcome_round_trips_through_json() {
        let outcome = sample();
        let back: Outcome = serde_json::from_str(&serde_json::to_string(&outcome).expect("ser")).expect("de");
        assert_eq!(back, outcome);
    }
}
