//! API keys: a file of sha256-hashed keys with per-key quotas, and the request's [`Principal`].
//!
//! ```toml
//! # keys.toml — `strata serve --keys keys.toml`; the hash is `printf %s "$KEY" | sha256sum`.
//! [[key]]
//! name = "alice"
//! sha256 = "2bb80d537b1da3e38bd30361aa855686bde0eacd7162fef6a25fe97bf527a25b"
//! max_sandboxes = 10   # optional: concurrent sandboxes; none means no quota
//! max_memory = "8GiB"  # optional: the sum of its sandboxes' memory limits; none means no quota
//! ```
//!
//! The same shape is accepted as JSON (`{"key":[{"name":…,"sha256":…}]}`) when the file name ends in `.json`.
//! A request names its key in `Authorization: Bearer KEY` or `X-API-Key: KEY`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use axum::http::HeaderMap;
use serde::Deserialize;
use sha2::{Digest, Sha256};

use crate::error::ApiError;

/// Who made a request: the API key's name and quota.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Principal {
    /// The key's name (`anonymous` when the server has no keys file).
    pub name: String,
    /// Concurrent sandboxes it may hold; `None` is no quota.
    pub max_sandboxes: Option<usize>,
    /// Memory its sandboxes may commit (the sum of their memory limits) in bytes; `None` is no quota.
    pub max_memory: Option<u64>,
}

impl Principal {
    /// The principal of every request on a server without keys.
    pub fn anonymous() -> Principal {
        Principal { name: "anonymous".to_owned(), max_sandboxes: None, max_memory: None }
    }
}

/// A keys file could not be used.
#[derive(Debug, thiserror::Error)]
pub enum KeysError {
    /// The file could not be read.
    #[error("cannot read keys file {}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The file is not a valid keys file.
    #[error("invalid keys file {}: {message}", path.display())]
    Parse {
        /// The file.
        path: PathBuf,
        /// What was wrong.
        message: String,
    },
}

/// One key of a keys file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct KeyConfig {
    name: String,
    sha256: String,
    #[serde(default)]
    max_sandboxes: Option<usize>,
    #[serde(default)]
    max_memory: Option<strata_core::ByteSize>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct KeysFile {
    #[serde(default)]
    key: Vec<KeyConfig>,
}

/// The API keys a server accepts, by the hex sha256 of the key.
#[derive(Debug, Clone, Default)]
pub struct KeyStore {
    by_hash: HashMap<String, Principal>,
}

/// The lowercase hex sha256 of a key, as a keys file stores it.
pub fn hash_key(key: &str) -> String {
    let digest = Sha256::digest(key.as_bytes());
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

impl KeyStore {
    /// Reads a keys file (TOML, or JSON when the name ends in `.json`).
    pub fn from_file(path: &Path) -> Result<KeyStore, KeysError> {
        let text = std::fs::read_to_string(path).map_err(|source| KeysError::Read { path: path.to_owned(), source })?;
        let json = path.extension().is_some_and(|e| e == "json");
        KeyStore::parse(&text, json).map_err(|message| KeysError::Parse { path: path.to_owned(), message })
    }

    /// Parses a keys file's text.
    fn parse(text: &str, json: bool) -> Result<KeyStore, String> {
        let file: KeysFile = if json {
            serde_json::from_str(text).map_err(|e| e.to_string())?
        } else {
            toml::from_str(text).map_err(|e| e.to_string().trim_end().replace('\n', " "))?
        };
        let mut store = KeyStore::default();
        for key in file.key {
            let hash = key.sha256.to_ascii_lowercase();
            if hash.len() != 64 || !hash.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(format!("key {:?}: sha256 must be 64 hex digits", key.name));
            }
            if key.name.is_empty() {
                return Err("a key has an empty name".to_owned());
            }
            let principal = Principal {
                name: key.name.clone(),
                max_sandboxes: key.max_sandboxes,
                max_memory: key.max_memory.map(|m| m.0),
            };
            if store.by_hash.insert(hash, principal).is_some() {
                return Err(format!("key {:?}: the same sha256 appears twice", key.name));
            }
        }
        Ok(store)
    }

    /// A store of these `(name, key, quota)` entries, hashing each key (for tests and embedders).
    pub fn from_keys<'a>(keys: impl IntoIterator<Item = (&'a str, &'a str, Option<usize>)>) -> KeyStore {
        let by_hash = keys
            .into_iter()
            .map(|(name, key, max)| {
                (hash_key(key), Principal { name: name.to_owned(), max_sandboxes: max, max_memory: None })
            })
            .collect();
        KeyStore { by_hash }
    }

    /// How many keys it holds.
    pub fn len(&self) -> usize {
        self.by_hash.len()
    }

    /// Whether it holds no key.
    pub fn is_empty(&self) -> bool {
        self.by_hash.is_empty()
    }

    /// The principal of a request's key, from `Authorization: Bearer` or `X-API-Key`.
    pub fn authenticate(&self, headers: &HeaderMap) -> Result<Principal, ApiError> {
        let key = presented_key(headers).ok_or_else(|| {
            ApiError::unauthorized("missing API key: send Authorization: Bearer KEY or X-API-Key: KEY")
        })?;
        self.by_hash.get(&hash_key(&key)).cloned().ok_or_else(|| ApiError::unauthorized("unknown API key"))
    }
}

/// The WebSocket subprotocol a browser offers beside [`KEY_PROTOCOL_PREFIX`]`…` (a browser's WebSocket cannot
/// send headers); the server selects it.
pub const WS_PROTOCOL: &str = "strata";

/// A WebSocket subprotocol carrying the key, base64url without padding: `strata.key.BASE64URL`.
pub const KEY_PROTOCOL_PREFIX: &str = "strata.key.";

/// The key a request presents, if any: `Authorization: Bearer KEY`, `X-API-Key: KEY`, or (a browser's WebSocket)
/// the subprotocol `strata.key.BASE64URL(KEY)` — never a URL, which logs and histories keep.
fn presented_key(headers: &HeaderMap) -> Option<std::borrow::Cow<'_, str>> {
    use base64::Engine as _;
    if let Some(value) = headers.get(axum::http::header::AUTHORIZATION).and_then(|v| v.to_str().ok()) {
        let mut parts = value.splitn(2, ' ');
        if let (Some(scheme), Some(token)) = (parts.next(), parts.next())
            && scheme.eq_ignore_ascii_case("bearer")
        {
            return Some(token.trim().into());
        }
    }
    if let Some(key) = headers.get("x-api-key").and_then(|v| v.to_str().ok()) {
        return Some(key.trim().into());
    }
    let protocols = headers.get(axum::http::header::SEC_WEBSOCKET_PROTOCOL).and_then(|v| v.to_str().ok())?;
    let encoded = protocols.split(',').find_map(|p| p.trim().strip_prefix(KEY_PROTOCOL_PREFIX))?;
    let key = base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(encoded).ok()?;
    String::from_utf8(key).ok().map(Into::into)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_file_is_matched_by_hash_from_either_header() {
        let text = format!(
            "[[key]]\nname = \"alice\"\nsha256 = \"{}\"\nmax_sandboxes = 3\nmax_memory = \"1GiB\"\n",
            hash_key("s3cret")
        );
        let store = KeyStore::parse(&text, false).expect("parses");
        let mut headers = HeaderMap::new();
        headers.insert("authorization", "Bearer s3cret".parse().expect("header"));
        assert_eq!(store.authenticate(&headers).map(|p| (p.max_sandboxes, p.max_memory)), Ok((Some(3), Some(1 << 30))));
        let mut headers = HeaderMap::new();
        headers.insert("x-api-key", "s3cret".parse().expect("header"));
        assert_eq!(store.authenticate(&headers).map(|p| p.name), Ok("alice".to_owned()));
        headers.insert("x-api-key", "wrong".parse().expect("header"));
        assert_eq!(store.authenticate(&headers).map_err(|e| e.code), Err("unauthorized"));
        assert_eq!(store.authenticate(&HeaderMap::new()).map_err(|e| e.code), Err("unauthorized"));
        // A browser's WebSocket: the key as a subprotocol beside the one the server selects.
        let mut headers = HeaderMap::new();
        headers.insert("sec-websocket-protocol", "strata, strata.key.czNjcmV0".parse().expect("header"));
        assert_eq!(store.authenticate(&headers).map(|p| p.name), Ok("alice".to_owned()));
        headers.insert("sec-websocket-protocol", "strata, strata.key.d3Jvbmc".parse().expect("header"));
        assert_eq!(store.authenticate(&headers).map_err(|e| e.code), Err("unauthorized"));
    }

    #[test]
    fn malformed_keys_files_are_refused() {
        assert!(KeyStore::parse("[[key]]\nname = \"a\"\nsha256 = \"xyz\"\n", false).is_err());
        assert!(KeyStore::parse("[[key]]\nname = \"a\"\nsha256 = \"00\"\nquota = 1\n", false).is_err());
        let json = format!(r#"{{"key":[{{"name":"a","sha256":"{}"}}]}}"#, hash_key("k"));
        assert_eq!(KeyStore::parse(&json, true).map(|s| s.len()), Ok(1));
    }
}
