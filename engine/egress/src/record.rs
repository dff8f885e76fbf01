//! The egress log: one [`EgressRecord`] per request the proxy saw.

use std::time::{Duration, SystemTime};

use serde::ser::{Serialize, SerializeStruct, Serializer};

/// How the client asked to go out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EgressKind {
    /// `CONNECT host:port`: a byte tunnel (TLS or plain TCP).
    Connect,
    /// An absolute-form `http://` request forwarded by the proxy.
    Http,
}

impl EgressKind {
    /// `"connect"` or `"http"`.
    pub fn as_str(self) -> &'static str {
        match self {
            EgressKind::Connect => "connect",
            EgressKind::Http => "http",
        }
    }
}

/// What the proxy decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EgressVerdict {
    /// The allowlist allowed it and the origin was reached.
    Allowed,
    /// Refused by policy or as malformed: not in the allowlist, a private address behind an allowed name, an SNI
    /// that differs from the CONNECT host, a malformed or oversized request.
    Denied {
        /// A short sentence saying why.
        reason: String,
    },
    /// Allowed, but the origin could not be reached (name does not resolve, connection refused, timeout).
    Failed {
        /// A short sentence saying why.
        reason: String,
    },
}

impl EgressVerdict {
    /// `"allowed"`, `"denied"` or `"failed"`.
    pub fn as_str(&self) -> &'static str {
        match self {
            EgressVerdict::Allowed => "allowed",
            EgressVerdict::Denied { .. } => "denied",
            EgressVerdict::Failed { .. } => "failed",
        }
    }

    /// The reason, unless allowed.
    pub fn reason(&self) -> Option<&str> {
        match self {
            EgressVerdict::Allowed => None,
            EgressVerdict::Denied { reason } | EgressVerdict::Failed { reason } => Some(reason),
        }
    }

    /// Whether this is [`EgressVerdict::Denied`].
    pub fn is_denied(&self) -> bool {
        matches!(self, EgressVerdict::Denied { .. })
    }
}

/// One request through the proxy.
///
/// `bytes_up` counts what the proxy wrote to the origin (for HTTP, the rewritten request head and body; for
/// CONNECT, the tunnelled bytes), `bytes_down` what it relayed from the origin to the client. A request refused
/// before reaching an origin has both at 0; when the request head could not be parsed, `host` is empty and `port`
/// is 0.
///
/// Serialises as `{"host","port","kind","bytes_up","bytes_down","verdict","reason"}` (the Outcome's `egress`
/// entries; `reason` is null when allowed), with `secrets_injected` / `secrets_withheld` (names of egress secrets,
/// never their values) when not empty. `started` and `duration` are for the host's own logs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EgressRecord {
    /// The target host as requested (normalised).
    pub host: String,
    /// The target port.
    pub port: u16,
    /// CONNECT tunnel or forwarded HTTP request.
    pub kind: EgressKind,
    /// Bytes written to the origin.
    pub bytes_up: u64,
    /// Bytes relayed from the origin to the client.
    pub bytes_down: u64,
    /// What the proxy decided.
    pub verdict: EgressVerdict,
    /// Egress secrets this request concerned (names only: put in, or withheld from another host).
    pub secrets: crate::secrets::SecretUse,
    /// When the client connection was accepted.
    pub started: SystemTime,
    /// How long the connection lasted.
    pub duration: Duration,
}

impl Serialize for EgressRecord {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut st = s.serialize_struct("EgressRecord", 7)?;
        st.serialize_field("host", &self.host)?;
        st.serialize_field("port", &self.port)?;
        st.serialize_field("kind", self.kind.as_str())?;
        st.serialize_field("bytes_up", &self.bytes_up)?;
        st.serialize_field("bytes_down", &self.bytes_down)?;
        st.serialize_field("verdict", self.verdict.as_str())?;
        st.serialize_field("reason", &self.verdict.reason())?;
        if !self.secrets.injected.is_empty() {
            st.serialize_field("secrets_injected", &self.secrets.injected)?;
        }
        if !self.secrets.withheld.is_empty() {
            st.serialize_field("secrets_withheld", &self.secrets.withheld)?;
        }
        st.end()
    }
}

/// The record as the Outcome's plain `egress` entry (what every tier reports).
impl From<EgressRecord> for strata_core::outcome::EgressEntry {
    fn from(record: EgressRecord) -> Self {
        strata_core::outcome::EgressEntry {
            reason: record.verdict.reason().map(str::to_owned),
            verdict: record.verdict.as_str().to_owned(),
            kind: record.kind.as_str().to_owned(),
            host: record.host,
            port: record.port,
            bytes_up: record.bytes_up,
            bytes_down: record.bytes_down,
            secrets_injected: record.secrets.injected,
            secrets_withheld: record.secrets.withheld,
        }
    }
}

/// The records of one proxy, capped so a guest opening connections in a loop cannot grow host memory without end.
#[derive(Debug, Default)]
pub(crate) struct EgressLog {
    pub(crate) records: Vec<EgressRecord>,
    pub(crate) dropped: u64,
    pub(crate) cap: usize,
}

impl EgressLog {
    pub(crate) fn push(&mut self, r: EgressRecord) {
        if self.records.len() < self.cap {
            self.records.push(r);
        } else {
            self.dropped += 1;
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn serialises_as_the_outcome_entry() {
        let mut r = EgressRecord {
            host: "example.com".into(),
            port: 443,
            kind: EgressKind::Connect,
            bytes_up: 10,
            bytes_down: 20,
            verdict: EgressVerdict::Allowed,
            secrets: Default::default(),
            started: SystemTime::UNIX_EPOCH,
            duration: Duration::from_millis(3),
        };
        assert_eq!(
            serde_json::to_string(&r).unwrap(),
            r#"{"host":"example.com","port":443,"kind":"connect","bytes_up":10,"bytes_down":20,"verdict":"allowed","reason":null}"#
        );
        r.verdict = EgressVerdict::Denied { reason: "not in the allowlist".into() };
        r.kind = EgressKind::Http;
        let v: serde_json::Value = serde_json::to_value(&r).unwrap();
        assert_eq!(v["verdict"], "denied");
        assert_eq!(v["kind"], "http");
        assert_eq!(v["reason"], "not in the allowlist");
        let entry = strata_core::outcome::EgressEntry::from(r);
        assert_eq!((entry.verdict.as_str(), entry.kind.as_str()), ("denied", "http"));
        assert_eq!(entry.reason.as_deref(), Some("not in the allowlist"));
        assert_eq!((entry.host.as_str(), entry.port, entry.bytes_up, entry.bytes_down), ("example.com", 443, 10, 20));
    }
}
