//! Secrets that never enter the sandbox: the guest sees a placeholder, the egress proxy puts the value into the
//! request headers of plain-HTTP requests to the hosts the secret is bound to (docs/DESIGN.md §3).
//!
//! An [`EgressSecret`] is a name, a value and the hosts (`HOST[:PORT]` specs, inside the sandbox's network
//! allowlist) the value may go to. Each sandbox gets its own unguessable placeholder per secret
//! ([`placeholder`]: `strata-secret-NAME-<32 hex digits>`) as the environment variable `NAME`; the proxy replaces
//! it in header values (never the request line or the body) of requests to a bound host, and leaves it as it is
//! toward any other host. With [`EgressSecret::header`] set, the guest gets no placeholder at all: the proxy sets
//! that header to the value on every request to a bound host (E2B's per-host header transforms).
//!
//! Only plain HTTP is substituted: the proxy relays `CONNECT` tunnels without terminating TLS, so it never sees
//! the headers inside one. A binding to port 443 could never be used and is refused ([`EgressSecretError::Tls`]).
//!
//! The value is never serialised (it is skipped on the way out and a secret without one is refused on the way
//! in), never printed by `Debug`, and snapshots record egress secrets by name only.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::allow::{AllowRule, Allowlist, HostPattern};

/// Longest secret name, in bytes.
pub const MAX_NAME_BYTES: usize = 128;
/// Longest secret value, in bytes: it goes into a request header, which the proxy bounds.
pub const MAX_VALUE_BYTES: usize = 4096;
/// Most egress secrets per sandbox.
pub const MAX_SECRETS: usize = 64;
/// The port a binding may not name: its requests are TLS inside a `CONNECT` tunnel, which the proxy relays
/// without seeing the headers.
pub const TLS_PORT: u16 = 443;

/// An egress secret that is malformed or contradicts the other capabilities.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EgressSecretError {
    /// `--egress-secret` text that is not `NAME=VALUE@HOST[,HOST...]`.
    #[error("invalid egress secret {spec:?}: {reason}")]
    Spec {
        /// The text as given, its value left out.
        spec: String,
        /// What was wrong.
        reason: &'static str,
    },
    /// A name that is not an environment variable name (`[A-Za-z_][A-Za-z0-9_]*`, at most 128 bytes).
    #[error("invalid egress secret name {0:?}: expected [A-Za-z_][A-Za-z0-9_]*, at most 128 bytes")]
    Name(String),
    /// A value that is empty, too long or holds a byte a header value cannot.
    #[error("invalid value of egress secret {name}: {reason}")]
    Value {
        /// The secret.
        name: String,
        /// What was wrong.
        reason: &'static str,
    },
    /// A header name that is not an HTTP token.
    #[error("invalid header {header:?} of egress secret {name}")]
    Header {
        /// The secret.
        name: String,
        /// The header name as given.
        header: String,
    },
    /// A host spec that is not `HOST[:PORT]`, or no host at all.
    #[error("invalid hosts of egress secret {name}: {reason}")]
    Hosts {
        /// The secret.
        name: String,
        /// What was wrong.
        reason: String,
    },
    /// A host the sandbox's network allowlist does not cover.
    #[error("egress secret {name} is bound to {host}, which the network allowlist does not cover")]
    OutsideAllowlist {
        /// The secret.
        name: String,
        /// The host spec.
        host: String,
    },
    /// A host bound on the TLS port, where the proxy never sees headers.
    #[error(
        "egress secret {name} is bound to {host}: the proxy relays TLS without terminating it, so a secret is only \
         put into plain HTTP requests"
    )]
    Tls {
        /// The secret.
        name: String,
        /// The host spec.
        host: String,
    },
    /// Two secrets, or a secret and an environment variable, with the same name.
    #[error("egress secret {0} is defined twice (or also as an environment variable or secret)")]
    Duplicate(String),
    /// More than [`MAX_SECRETS`].
    #[error("more than {MAX_SECRETS} egress secrets")]
    TooMany,
}

/// A secret the egress proxy puts into requests to `hosts`; the guest sees a placeholder instead.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EgressSecret {
    /// An environment variable name: the guest's `NAME` holds the placeholder.
    pub name: String,
    /// The value. Never serialised: a deserialised secret has none, and is refused until given one.
    #[serde(skip_serializing, default)]
    pub value: String,
    /// Where the value may go: `HOST[:PORT]` specs, each inside the sandbox's network allowlist.
    pub hosts: Allowlist,
    /// When set, the proxy sets this header to the value on every plain-HTTP request to `hosts` (replacing one
    /// the request carries), and the guest gets no placeholder.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub header: Option<String>,
}

impl fmt::Debug for EgressSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EgressSecret")
            .field("name", &self.name)
            .field("value", &"[REDACTED]")
            .field("hosts", &self.hosts.specs())
            .field("header", &self.header)
            .finish()
    }
}

impl EgressSecret {
    /// A secret bound to `hosts`, its name, value and hosts checked (not yet against an allowlist:
    /// [`EgressSecret::check_allowed`]).
    pub fn new<I, S>(name: &str, value: &str, hosts: I) -> Result<EgressSecret, EgressSecretError>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let hosts = Allowlist::parse(hosts)
            .map_err(|e| EgressSecretError::Hosts { name: name.to_owned(), reason: e.to_string() })?;
        let secret = EgressSecret { name: name.to_owned(), value: value.to_owned(), hosts, header: None };
        secret.check()?;
        Ok(secret)
    }

    /// The same secret set as the header `header` instead of given to the guest as a placeholder.
    pub fn as_header(mut self, header: &str) -> Result<EgressSecret, EgressSecretError> {
        self.header = Some(header.to_owned());
        self.check()?;
        Ok(self)
    }

    /// Checks the name, the value, the header name and the hosts on their own.
    pub fn check(&self) -> Result<(), EgressSecretError> {
        check_name(&self.name)?;
        let bad_value = |reason| EgressSecretError::Value { name: self.name.clone(), reason };
        if self.value.is_empty() {
            return Err(bad_value("empty (or not given)"));
        }
        if self.value.len() > MAX_VALUE_BYTES {
            return Err(bad_value("longer than 4096 bytes"));
        }
        if self.value.bytes().any(|b| b.is_ascii_control() && b != b'\t') {
            return Err(bad_value("holds a control character (a header value cannot)"));
        }
        if self.value.starts_with([' ', '\t']) || self.value.ends_with([' ', '\t']) {
            return Err(bad_value("starts or ends with whitespace (a header value cannot)"));
        }
        if let Some(header) = &self.header
            && !is_token(header)
        {
            return Err(EgressSecretError::Header { name: self.name.clone(), header: header.clone() });
        }
        if self.hosts.is_empty() {
            return Err(EgressSecretError::Hosts { name: self.name.clone(), reason: "no host".into() });
        }
        if let Some(spec) = self.hosts.specs().iter().zip(self.hosts.rules()).find(|(_, r)| r.port == Some(TLS_PORT)) {
            return Err(EgressSecretError::Tls { name: self.name.clone(), host: spec.0.clone() });
        }
        Ok(())
    }

    /// Checks that `allowlist` covers every host this secret is bound to.
    pub fn check_allowed(&self, allowlist: Option<&Allowlist>) -> Result<(), EgressSecretError> {
        for (spec, rule) in self.hosts.specs().iter().zip(self.hosts.rules()) {
            if !allowlist.is_some_and(|list| list.rules().iter().any(|outer| covers(outer, rule))) {
                return Err(EgressSecretError::OutsideAllowlist { name: self.name.clone(), host: spec.clone() });
            }
        }
        Ok(())
    }

    /// Parses `NAME=VALUE@HOST[,HOST...]` (the CLI's `--egress-secret`). The value is taken up to the last `@`; a
    /// value `env:VAR` is read from `env("VAR")` instead, so that it need not appear on a command line.
    pub fn parse_spec(spec: &str, env: impl Fn(&str) -> Option<String>) -> Result<EgressSecret, EgressSecretError> {
        let (name, rest) = spec.split_once('=').ok_or_else(|| bad_spec(spec, "expected NAME=VALUE@HOST[,HOST...]"))?;
        let (value, hosts) =
            rest.rsplit_once('@').ok_or_else(|| bad_spec(spec, "expected NAME=VALUE@HOST[,HOST...]"))?;
        let value = match value.strip_prefix("env:") {
            Some(var) => env(var).ok_or_else(|| bad_spec(spec, "the environment variable it names is not set"))?,
            None => value.to_owned(),
        };
        EgressSecret::new(name, &value, hosts.split(',').filter(|h| !h.is_empty()))
    }
}

/// The spec as an error names it: the value left out.
fn bad_spec(spec: &str, reason: &'static str) -> EgressSecretError {
    let shown = match spec.split_once('=') {
        Some((name, rest)) => match rest.rsplit_once('@') {
            Some((_, hosts)) => format!("{name}=…@{hosts}"),
            None => format!("{name}=…"),
        },
        None => spec.chars().take(MAX_NAME_BYTES).collect(),
    };
    EgressSecretError::Spec { spec: shown, reason }
}

/// `Ok` for a name like an environment variable's: `[A-Za-z_][A-Za-z0-9_]*`, at most [`MAX_NAME_BYTES`].
pub fn check_name(name: &str) -> Result<(), EgressSecretError> {
    let mut bytes = name.bytes();
    let first_ok = bytes.next().is_some_and(|b| b.is_ascii_alphabetic() || b == b'_');
    if !first_ok || name.len() > MAX_NAME_BYTES || !bytes.all(|b| b.is_ascii_alphanumeric() || b == b'_') {
        return Err(EgressSecretError::Name(name.chars().take(MAX_NAME_BYTES + 1).collect()));
    }
    Ok(())
}

/// Whether `s` is an HTTP token (a header name).
fn is_token(s: &str) -> bool {
    !s.is_empty() && s.len() <= 256 && s.bytes().all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

/// Whether every `host:port` that `inner` matches, `outer` matches too.
fn covers(outer: &AllowRule, inner: &AllowRule) -> bool {
    let port = match (outer.port, inner.port) {
        (None, _) => true,
        (Some(a), Some(b)) => a == b,
        (Some(_), None) => false,
    };
    let under = |name: &str, suffix: &str| {
        name.strip_suffix(suffix).and_then(|front| front.strip_suffix('.')).is_some_and(|front| !front.is_empty())
    };
    let host = match (&outer.host, &inner.host) {
        (HostPattern::Exact(a), HostPattern::Exact(b)) => a == b,
        (HostPattern::Subdomains(s), HostPattern::Exact(b)) => under(b, s),
        (HostPattern::Subdomains(s), HostPattern::Subdomains(b)) => s == b || under(b, s),
        (HostPattern::Ip(a), HostPattern::Ip(b)) => a == b,
        _ => false,
    };
    port && host
}

/// A fresh placeholder for the secret `name`: `strata-secret-NAME-` and 32 random hex digits, one per sandbox.
/// It holds only header-safe characters and cannot be guessed from inside the sandbox.
pub fn placeholder(name: &str) -> String {
    format!("strata-secret-{name}-{}", crate::random::random_hex(16))
}

/// Checks a sandbox's egress secrets against each other, the environment's names and the network allowlist.
pub(crate) fn check_all(caps: &crate::Capabilities) -> Result<(), EgressSecretError> {
    if caps.egress_secrets.len() > MAX_SECRETS {
        return Err(EgressSecretError::TooMany);
    }
    let mut names = std::collections::BTreeSet::new();
    for secret in &caps.egress_secrets {
        secret.check()?;
        secret.check_allowed(caps.net.allowlist())?;
        let clash = caps.guest_env().any(|var| var.name == secret.name);
        if !names.insert(secret.name.as_str()) || clash {
            return Err(EgressSecretError::Duplicate(secret.name.clone()));
        }
    }
    Ok(())
}

impl FromStr for EgressSecret {
    type Err = EgressSecretError;

    /// `NAME=VALUE@HOST[,HOST...]` with the value as written (see [`EgressSecret::parse_spec`] for `env:`).
    fn from_str(spec: &str) -> Result<Self, Self::Err> {
        EgressSecret::parse_spec(spec, |_| None)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::{Capabilities, Net};

    fn caps(allow: &[&str], secrets: Vec<EgressSecret>) -> Capabilities {
        Capabilities { net: Net::allow(allow).unwrap(), egress_secrets: secrets, ..Capabilities::default() }
    }

    #[test]
    fn spec_parses_name_value_and_hosts() {
        let s: EgressSecret = "TOKEN=a@b=c@api.example.com,*.svc.test:8080".parse().unwrap();
        assert_eq!((s.name.as_str(), s.value.as_str()), ("TOKEN", "a@b=c"));
        assert_eq!(s.hosts.specs(), ["api.example.com", "*.svc.test:8080"]);
        let s = EgressSecret::parse_spec("T=env:HOSTVAR@x.example", |v| (v == "HOSTVAR").then(|| "v1".into())).unwrap();
        assert_eq!(s.value, "v1");
        let err = EgressSecret::parse_spec("T=env:NOPE@x.example", |_| None).unwrap_err();
        assert!(matches!(err, EgressSecretError::Spec { .. }), "{err}");
    }

    #[test]
    fn malformed_secrets_are_typed_errors_that_never_show_the_value() {
        for (spec, kind) in [
            ("TOKEN", "spec"),
            ("TOKEN=hunter2", "spec"),
            ("1TOKEN=hunter2@x.example", "name"),
            ("TO-KEN=hunter2@x.example", "name"),
            ("=hunter2@x.example", "name"),
            ("TOKEN=@x.example", "value"),
            ("TOKEN=hunter2\r\nX: y@x.example", "value"),
            ("TOKEN=hunter2@", "hosts"),
            ("TOKEN=hunter2@http://x.example", "hosts"),
            ("TOKEN=hunter2@x.example:443", "tls"),
        ] {
            let err = spec.parse::<EgressSecret>().unwrap_err();
            let got = match err {
                EgressSecretError::Spec { .. } => "spec",
                EgressSecretError::Name(_) => "name",
                EgressSecretError::Value { .. } => "value",
                EgressSecretError::Hosts { .. } => "hosts",
                EgressSecretError::Tls { .. } => "tls",
                _ => "other",
            };
            assert_eq!(got, kind, "{spec}: {err}");
            assert!(!err.to_string().contains("hunter2"), "{err}");
        }
        let long = format!("T={}@x.example", "v".repeat(MAX_VALUE_BYTES + 1));
        assert!(matches!(long.parse::<EgressSecret>(), Err(EgressSecretError::Value { .. })));
    }

    #[test]
    fn hosts_must_be_inside_the_allowlist() {
        let s = |hosts: &[&str]| EgressSecret::new("T", "v", hosts).unwrap();
        assert!(check_all(&caps(&["api.example.com"], vec![s(&["api.example.com"])])).is_ok());
        assert!(check_all(&caps(&["*.example.com"], vec![s(&["a.example.com:8080", "*.b.example.com"])])).is_ok());
        assert!(check_all(&caps(&["127.0.0.1"], vec![s(&["127.0.0.1:9000"])])).is_ok());
        for (allow, hosts) in [
            (&["api.example.com:80"][..], &["api.example.com"][..]),
            (&["*.example.com"], &["example.com"]),
            (&["a.example.com"], &["*.a.example.com"]),
            (&["127.0.0.1:8080"], &["127.0.0.1:9000"]),
            (&["example.com"], &["example.org"]),
        ] {
            let err = check_all(&caps(allow, vec![s(hosts)])).unwrap_err();
            assert!(matches!(err, EgressSecretError::OutsideAllowlist { .. }), "{allow:?} {hosts:?}: {err}");
        }
        let denied = Capabilities { egress_secrets: vec![s(&["x.example"])], ..Capabilities::default() };
        assert!(matches!(check_all(&denied), Err(EgressSecretError::OutsideAllowlist { .. })));
    }

    #[test]
    fn names_are_unique_across_env_secrets_and_egress_secrets() {
        let s = EgressSecret::new("T", "v", ["x.example"]).unwrap();
        let mut c = caps(&["x.example"], vec![s.clone(), s.clone()]);
        assert_eq!(check_all(&c), Err(EgressSecretError::Duplicate("T".into())));
        c.egress_secrets.pop();
        c.env.push("T=1".parse().unwrap());
        assert_eq!(check_all(&c), Err(EgressSecretError::Duplicate("T".into())));
    }

    #[test]
    fn the_value_is_never_serialised_or_printed() {
        let s = EgressSecret::new("TOKEN", "hunter2", ["x.example"]).unwrap();
        let json = serde_json::to_string(&s).unwrap();
        assert_eq!(json, r#"{"name":"TOKEN","hosts":["x.example"]}"#);
        assert!(!format!("{s:?}").contains("hunter2"));
        let back: EgressSecret = serde_json::from_str(&json).unwrap();
        assert!(matches!(back.check(), Err(EgressSecretError::Value { .. })), "a secret without its value");
    }

    #[test]
    fn placeholders_are_fresh_and_header_safe() {
        let (a, b) = (placeholder("TOKEN"), placeholder("TOKEN"));
        assert_ne!(a, b);
        assert!(a.starts_with("strata-secret-TOKEN-") && a.len() == "strata-secret-TOKEN-".len() + 32, "{a}");
        assert!(is_token(&a));
    }

    #[test]
    fn a_header_secret_needs_a_token_name() {
        let s = EgressSecret::new("T", "Bearer v", ["x.example"]).unwrap();
        assert!(s.clone().as_header("Authorization").is_ok());
        assert!(matches!(s.as_header("Bad Header"), Err(EgressSecretError::Header { .. })));
    }
}
