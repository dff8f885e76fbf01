//! E2B's secrets: a write-only store per API key (`POST /secrets`, `GET /secrets`, `GET`/`POST`/`DELETE
//! /secrets/{id or name}`), in memory for the server's life, and the `${e2b.secrets.NAME}` placeholders that
//! `Secret.fill` writes into a create request's per-host header transforms (`network.rules`).
//!
//! A rule `{"HOST": [{"transform": {"headers": {"H": "Bearer ${e2b.secrets.NAME}"}}}]}` becomes one Strata
//! [`EgressSecret`] whose value is the header value with its placeholders resolved, bound to `HOST` and set as the
//! header `H` ([`EgressSecret::as_header`]): the sandbox never holds the value, and the proxy sets the header on its
//! plain-HTTP requests to `HOST`. No read returns a value. What does not map is refused with a 400: workload
//! identity tokens (`${e2b.identity...}`), rules on a host `allow_out` does not name, rules that would need the
//! proxy to see inside TLS (Strata's proxy does not terminate it: such rules apply to plain HTTP only).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use axum::Json;
use axum::body::Bytes;
use axum::extract::{Extension, Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Map, Value, json};
use strata_core::{Allowlist, EgressSecret};

use super::{E2bError, rfc3339};
use crate::error::ApiError;
use crate::registry::{lock, new_id};
use crate::{AppState, Principal};

/// Secrets one key may hold.
const MAX_PER_KEY: usize = 256;
/// Longest secret name.
const MAX_NAME: usize = 256;

/// One stored secret.
struct Stored {
    id: String,
    name: String,
    value: String,
    version: u64,
    metadata: Map<String, Value>,
    created: SystemTime,
    updated: SystemTime,
}

impl Stored {
    /// As E2B's API shows a secret: never its value.
    fn json(&self) -> Value {
        json!({
            "secretID": self.id,
            "name": self.name,
            "currentVersion": self.version,
            "metadata": self.metadata,
            "createdAt": rfc3339(self.created),
            "updatedAt": rfc3339(self.updated),
        })
    }
}

/// The secrets of every key, by the key's name.
#[derive(Default)]
pub struct SecretStore {
    keys: Mutex<HashMap<String, Vec<Stored>>>,
}

impl std::fmt::Debug for SecretStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SecretStore").finish_non_exhaustive()
    }
}

impl SecretStore {
    /// The value of `principal`'s secret `name`.
    fn value(&self, principal: &Principal, name: &str) -> Option<String> {
        let keys = lock(&self.keys);
        keys.get(&principal.name)?.iter().find(|s| s.name == name).map(|s| s.value.clone())
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
pub(super) struct NewSecret {
    name: String,
    value: String,
    #[serde(default)]
    metadata: Option<Map<String, Value>>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
pub(super) struct SecretUpdate {
    value: String,
    #[serde(default)]
    metadata: Option<Map<String, Value>>,
}

fn bad(message: impl Into<String>) -> E2bError {
    ApiError::bad_request("invalid_secret", message).into()
}

fn not_found(secret: &str) -> E2bError {
    ApiError::new(StatusCode::NOT_FOUND, "secret_not_found", format!("secret {secret} not found")).into()
}

fn parse<T: serde::de::DeserializeOwned>(body: &Bytes) -> Result<T, E2bError> {
    // The message of a failed parse could quote the value: say only where it failed.
    serde_json::from_slice(body).map_err(|e| {
        ApiError::bad_request(
            "invalid_json",
            format!("invalid secret request at line {} column {}", e.line(), e.column()),
        )
        .into()
    })
}

/// E2B's rule for a name, which it interpolates into `${e2b.secrets.NAME}`: not empty, no braces or controls.
fn check_name(name: &str) -> Result<(), E2bError> {
    if name.is_empty() || name.len() > MAX_NAME || name.chars().any(|c| c == '{' || c == '}' || c.is_control()) {
        return Err(bad(format!("secret name {name:?}: not empty, at most {MAX_NAME} bytes, no braces or controls")));
    }
    Ok(())
}

fn check_value(value: &str) -> Result<(), E2bError> {
    if value.is_empty() || value.len() > strata_core::egress_secret::MAX_VALUE_BYTES {
        return Err(bad("a secret's value is 1 to 4096 bytes"));
    }
    if value.bytes().any(|b| b.is_ascii_control() && b != b'\t') {
        return Err(bad("a secret's value cannot hold control characters (it goes into a request header)"));
    }
    Ok(())
}

fn metadata(given: Option<Map<String, Value>>) -> Result<Map<String, Value>, E2bError> {
    let given = given.unwrap_or_default();
    if given.values().any(|v| !v.is_string()) {
        return Err(bad("secret metadata values are strings"));
    }
    Ok(given)
}

/// `POST /secrets`.
pub(super) async fn create(
    State(state): State<Arc<AppState>>,
    Extension(principal): Extension<Principal>,
    body: Bytes,
) -> Result<Response, E2bError> {
    let req: NewSecret = parse(&body)?;
    check_name(&req.name)?;
    check_value(&req.value)?;
    let metadata = metadata(req.metadata)?;
    let mut keys = lock(&state.e2b.secrets.keys);
    let secrets = keys.entry(principal.name.clone()).or_default();
    if secrets.iter().any(|s| s.name == req.name) {
        return Err(ApiError::new(StatusCode::CONFLICT, "secret_exists", format!("secret {} exists", req.name)).into());
    }
    if secrets.len() >= MAX_PER_KEY {
        return Err(bad(format!("a key holds at most {MAX_PER_KEY} secrets")));
    }
    let now = SystemTime::now();
    let stored = Stored {
        id: new_id("sec_"),
        name: req.name,
        value: req.value,
        version: 1,
        metadata,
        created: now,
        updated: now,
    };
    let shown = stored.json();
    secrets.push(stored);
    Ok((StatusCode::CREATED, Json(shown)).into_response())
}

/// `GET /secrets`: every secret of the key, in one page.
pub(super) async fn list(
    State(state): State<Arc<AppState>>,
    Extension(principal): Extension<Principal>,
) -> Json<Value> {
    let keys = lock(&state.e2b.secrets.keys);
    let all = keys.get(&principal.name).map(|s| s.iter().map(Stored::json).collect()).unwrap_or_default();
    Json(Value::Array(all))
}

/// `GET /secrets/{id or name}`.
pub(super) async fn get(
    State(state): State<Arc<AppState>>,
    Extension(principal): Extension<Principal>,
    Path(secret): Path<String>,
) -> Result<Json<Value>, E2bError> {
    let keys = lock(&state.e2b.secrets.keys);
    let found = keys.get(&principal.name).and_then(|s| s.iter().find(|s| s.id == secret || s.name == secret));
    found.map(|s| Json(s.json())).ok_or_else(|| not_found(&secret))
}

/// `POST /secrets/{id or name}`: a new value (and version); metadata replaced when given.
pub(super) async fn update(
    State(state): State<Arc<AppState>>,
    Extension(principal): Extension<Principal>,
    Path(secret): Path<String>,
    body: Bytes,
) -> Result<Json<Value>, E2bError> {
    let req: SecretUpdate = parse(&body)?;
    check_value(&req.value)?;
    let new_metadata = req.metadata.map(|m| metadata(Some(m))).transpose()?;
    let mut keys = lock(&state.e2b.secrets.keys);
    let found = keys.get_mut(&principal.name).and_then(|s| s.iter_mut().find(|s| s.id == secret || s.name == secret));
    let stored = found.ok_or_else(|| not_found(&secret))?;
    stored.value = req.value;
    stored.version += 1;
    stored.updated = SystemTime::now();
    if let Some(m) = new_metadata {
        stored.metadata = m;
    }
    Ok(Json(stored.json()))
}

/// `DELETE /secrets/{id or name}`.
pub(super) async fn delete(
    State(state): State<Arc<AppState>>,
    Extension(principal): Extension<Principal>,
    Path(secret): Path<String>,
) -> Result<StatusCode, E2bError> {
    let mut keys = lock(&state.e2b.secrets.keys);
    let secrets = keys.get_mut(&principal.name).ok_or_else(|| not_found(&secret))?;
    let before = secrets.len();
    secrets.retain(|s| s.id != secret && s.name != secret);
    if secrets.len() == before {
        return Err(not_found(&secret));
    }
    Ok(StatusCode::NO_CONTENT)
}

/// The egress secrets of a create request's `network.rules`, each checked against `allowlist`: see the module
/// docs.
pub(super) fn rules_to_secrets(
    state: &AppState,
    principal: &Principal,
    rules: &Value,
    allowlist: Option<&Allowlist>,
) -> Result<Vec<EgressSecret>, E2bError> {
    let refused = |message: String| -> E2bError { ApiError::bad_request("invalid_network", message).into() };
    let Some(hosts) = rules.as_object() else {
        return if rules.is_null() { Ok(Vec::new()) } else { Err(refused("rules is an object of hosts".into())) };
    };
    let mut secrets = Vec::new();
    for (host, host_rules) in hosts {
        let host_rules = host_rules.as_array().ok_or_else(|| refused(format!("rules[{host:?}] is a list")))?;
        for rule in host_rules {
            let headers = rule.pointer("/transform/headers").and_then(Value::as_object);
            let Some(headers) = headers else {
                continue; // a rule without a transform changes nothing
            };
            for (header, template) in headers {
                let template =
                    template.as_str().ok_or_else(|| refused(format!("rules[{host:?}] header {header:?}: a string")))?;
                let value = resolve(state, principal, template).map_err(|why| refused(format!("{host}: {why}")))?;
                let name = format!("E2B_RULE_{}", secrets.len());
                let secret = EgressSecret::new(&name, &value, [host.as_str()])
                    .and_then(|s| s.as_header(header))
                    .and_then(|s| s.check_allowed(allowlist).map(|()| s))
                    .map_err(|e| refused(format!("rules[{host:?}] header {header:?}: {}", rule_error(&e))))?;
                secrets.push(secret);
            }
        }
    }
    Ok(secrets)
}

/// An egress secret's error in the words of a rule (its internal name means nothing to the client).
fn rule_error(err: &strata_core::EgressSecretError) -> String {
    use strata_core::EgressSecretError as E;
    match err {
        E::OutsideAllowlist { host, .. } => format!("{host} is not in allow_out (a rule does not allow egress)"),
        E::Value { reason, .. } => format!("the header value {reason}"),
        E::Header { header, .. } => format!("{header:?} is not a header name"),
        E::Hosts { reason, .. } => format!("the host is not HOST[:PORT]: {reason}"),
        E::Tls { host, .. } => format!("{host}: Strata's proxy does not terminate TLS, so it cannot set headers there"),
        other => other.to_string(),
    }
}

/// `template` with every `${e2b.secrets.NAME}` replaced by the key's secret's value.
fn resolve(state: &AppState, principal: &Principal, template: &str) -> Result<String, String> {
    const OPEN: &str = "${e2b.";
    let mut out = String::new();
    let mut rest = template;
    while let Some(at) = rest.find(OPEN) {
        out.push_str(&rest[..at]);
        let after = &rest[at + 2..];
        let end = after.find('}').ok_or("an unterminated ${e2b...} placeholder")?;
        let reference = &after[..end];
        let name = reference.strip_prefix("e2b.secrets.").ok_or_else(|| {
            format!("${{{reference}}}: only ${{e2b.secrets.NAME}} placeholders map here (no workload identity)")
        })?;
        let value = state.e2b.secrets.value(principal, name).ok_or_else(|| format!("no secret named {name:?}"))?;
        out.push_str(&value);
        rest = &after[end + 1..];
    }
    out.push_str(rest);
    Ok(out)
}
