//! E2B's network settings on Strata's egress allowlist: `network={allow_out, deny_out}` at create and
//! `update_network()` (`PUT /sandboxes/{id}/network`, which replaces the whole configuration for the connections
//! made from then on).
//!
//! Strata's egress is an allowlist and stays one: every E2B sandbox starts with an egress proxy whose allowlist is
//! the server policy's plus `allow_out` (empty: nothing), so that an update can open it later. `allow_out` entries
//! are Strata's `HOST[:PORT]` specs (a name, `*.name`, an IP; an IPv4 `/32` or IPv6 `/128` is its address), and, as
//! in E2B, they win over `deny_out`. Where E2B's default is an open network that `deny_out` narrows, Strata's is
//! `deny_out=[0.0.0.0/0]` (E2B's `ALL_TRAFFIC`): whatever `allow_out` does not name is denied, so every `deny_out`
//! entry holds. What would open more than `allow_out` names (`allow_out` of `0.0.0.0/0`, a CIDR range) or what
//! this server does not do (DNS servers, another egress proxy, per-host rules in an update) is refused with a 400
//! saying so, never approximated. Per-host header rules at create become egress secrets ([`super::secrets`]).

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Extension, Path, State};
use axum::http::StatusCode;
use serde::Deserialize;
use serde_json::Value;
use strata_core::{Allowlist, Net};

use super::{E2bError, e2b_sandbox};
use crate::error::ApiError;
use crate::{AppState, Principal};

/// E2B's "all traffic" selector.
pub const ALL_TRAFFIC: &str = "0.0.0.0/0";

/// The network part of a create or update request (unknown fields are ignored as elsewhere; the ones Strata cannot
/// honour are refused when set).
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(super) struct NetworkConfig {
    #[serde(default)]
    allow_out: Option<Vec<String>>,
    /// Taken and honoured as it is: Strata denies whatever `allow_out` does not name.
    #[serde(default)]
    #[allow(dead_code)]
    deny_out: Option<Vec<String>>,
    #[serde(default)]
    dns_servers: Option<Vec<String>>,
    #[serde(default)]
    rules: Option<Value>,
    #[serde(default)]
    egress_proxy: Option<Value>,
}

fn refused(message: String) -> E2bError {
    ApiError::bad_request("invalid_network", message).into()
}

/// An `allow_out` entry as a Strata spec: a `/32` or `/128` CIDR is its address; other ranges are refused.
fn spec_of(entry: &str) -> Result<String, E2bError> {
    match entry.split_once('/') {
        None => Ok(entry.to_owned()),
        Some((ip, bits)) => match (ip.parse::<std::net::IpAddr>(), bits) {
            (Ok(std::net::IpAddr::V4(v4)), "32") => Ok(v4.to_string()),
            (Ok(std::net::IpAddr::V6(v6)), "128") => Ok(format!("[{v6}]")),
            _ => Err(refused(format!(
                "allow_out {entry:?}: Strata's egress allows names and addresses, not ranges (name each address)"
            ))),
        },
    }
}

impl NetworkConfig {
    /// The per-host rules (`network.rules`), if any.
    pub(super) fn rules(&self) -> Option<&Value> {
        self.rules.as_ref().filter(|r| !r.is_null() && r.as_object().is_none_or(|o| !o.is_empty()))
    }

    /// The egress this configuration asks for, over the server policy's: always an allowlist, possibly empty.
    pub(super) fn net(&self, state: &AppState) -> Result<Net, E2bError> {
        if self.dns_servers.as_ref().is_some_and(|d| !d.is_empty()) {
            return Err(refused("dns_servers: a Strata sandbox resolves names through its egress proxy".into()));
        }
        if self.egress_proxy.as_ref().is_some_and(|p| !p.is_null()) {
            return Err(refused("egress_proxy: a Strata sandbox's egress goes through Strata's own proxy".into()));
        }
        let allow = self.allow_out.clone().unwrap_or_default();
        if allow.iter().any(|entry| entry == ALL_TRAFFIC) {
            return Err(refused(format!(
                "allow_out {ALL_TRAFFIC}: a Strata sandbox's egress is an allowlist; name the hosts it may reach"
            )));
        }
        // Denied: everything allow_out does not name, whatever deny_out names included (allow_out wins, as in E2B).
        let specs = allow.iter().map(|entry| spec_of(entry)).collect::<Result<Vec<_>, _>>()?;
        let asked = Allowlist::parse(&specs).map_err(|e| refused(e.to_string()))?;
        Ok(Net::Allow(state.policy.network.allowlist().union(&asked)))
    }
}

/// `PUT /sandboxes/{id}/network`: replaces the sandbox's egress for the connections its commands make from now on.
pub(super) async fn update(
    State(state): State<Arc<AppState>>,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
    body: Bytes,
) -> Result<StatusCode, E2bError> {
    let config: NetworkConfig = super::json_or_default(&body)?;
    if config.rules().is_some() {
        return Err(refused("rules (per-host transforms) are set when the sandbox is created, not updated".into()));
    }
    let net = config.net(&state)?;
    let (entry, _) = e2b_sandbox(&state, &id, &principal)?;
    crate::service::blocking(move || entry.call(|sandbox| sandbox.set_network(&net))).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn single_addresses_are_specs_and_ranges_are_refused() {
        assert_eq!(spec_of("example.com:443").ok(), Some("example.com:443".to_owned()));
        assert_eq!(spec_of("10.0.0.1/32").ok(), Some("10.0.0.1".to_owned()));
        assert_eq!(spec_of("::1/128").ok(), Some("[::1]".to_owned()));
        assert!(spec_of("10.0.0.0/8").is_err() && spec_of("x/32").is_err());
    }
}
