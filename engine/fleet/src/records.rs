//! The values the fleet keeps in etcd, as JSON: a node's [`NodeRecord`], its [`Alloc`], and the catalog's
//! [`CatalogEntry`] per sandbox.
//!
//! Every value is read back as input another process wrote: [`NodeRecord::parse`], [`Alloc::parse`] and
//! [`CatalogEntry::parse`] return a [`RecordError`] for anything malformed (bad JSON, an unknown field, a name
//! that is not one, a CPU count past [`MAX_CPUS`], a sandbox listed twice) and never panic. Unknown fields are
//! refused rather than ignored: a node that rewrote an alloc it only half understood would drop what it did not
//! know, so a fleet runs one format at a time.

use serde::{Deserialize, Serialize};

/// The most CPUs a node record may claim (a bound on what [`crate::Bins`] allocates for a record read from etcd).
pub const MAX_CPUS: u32 = 4096;

/// The longest node name or sandbox id, in bytes.
pub const MAX_NAME_LEN: usize = 253;

/// Whether `name` may name a node or a sandbox: 1 to [`MAX_NAME_LEN`] bytes of ASCII letters, digits, `.`, `_`, `:`
/// and `-` (a name is a path segment of a key, so never `/`).
pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_NAME_LEN
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b':' | b'-'))
}

/// Why a value read from etcd is not a valid record.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RecordError {
    /// The value is not the JSON of the record (syntax, a missing or unknown field, a wrong type).
    #[error("{key} does not hold a valid record: {reason}")]
    Json {
        /// The key read.
        key: String,
        /// What the JSON parser said.
        reason: String,
    },
    /// A node name or sandbox id in the record or its key is not one ([`valid_name`]).
    #[error("{key} holds the invalid name {name:?}")]
    BadName {
        /// The key read.
        key: String,
        /// The name.
        name: String,
    },
    /// A node record under `nodes/{a}` names another node.
    #[error("{key} holds the record of node {name}")]
    NameMismatch {
        /// The key read.
        key: String,
        /// The name the record gives.
        name: String,
    },
    /// A node record claims more CPUs than [`MAX_CPUS`].
    #[error("{key} claims {cpus} CPUs, more than {MAX_CPUS}")]
    TooManyCpus {
        /// The key read.
        key: String,
        /// The CPUs claimed.
        cpus: u32,
    },
    /// An alloc lists a sandbox twice.
    #[error("{key} lists sandbox {id} twice")]
    DuplicateEntry {
        /// The key read.
        key: String,
        /// The sandbox.
        id: String,
    },
}

/// Serializes a record. The records are plain structs of strings, numbers and lists, which `serde_json` always
/// serializes; were it ever to fail, the empty value written would be refused by every reader as malformed.
fn encode<T: Serialize>(value: &T) -> Vec<u8> {
    serde_json::to_vec(value).unwrap_or_default()
}

fn decode<'a, T: Deserialize<'a>>(key: &str, bytes: &'a [u8]) -> Result<T, RecordError> {
    serde_json::from_slice(bytes).map_err(|e| RecordError::Json { key: key.to_owned(), reason: e.to_string() })
}

fn check_name(key: &str, name: &str) -> Result<(), RecordError> {
    if valid_name(name) { Ok(()) } else { Err(RecordError::BadName { key: key.to_owned(), name: name.to_owned() }) }
}

/// A node of the fleet, at `{prefix}nodes/{name}`, written with the node's lease: it vanishes when the node stops
/// keeping its lease alive.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeRecord {
    /// The node's name, unique in the fleet.
    pub name: String,
    /// Where other nodes reach its API (a URL).
    pub advertise: String,
    /// New on each registration of the node (each start, and each new lease after the old one was lost).
    pub incarnation: u64,
    /// CPUs the node packs sandboxes onto.
    pub cpus: u32,
    /// vCPU slots per CPU; 0: CPUs are not admitted against.
    pub slots: u32,
    /// Bytes of sandbox memory limits the node admits in all.
    pub memory: u64,
    /// The node takes no new sandboxes.
    pub draining: bool,
}

impl NodeRecord {
    /// The record's JSON.
    pub fn to_json(&self) -> Vec<u8> {
        encode(self)
    }

    /// Parses and checks the record read at `key`, the key of node `node`.
    pub fn parse(key: &str, node: &str, bytes: &[u8]) -> Result<NodeRecord, RecordError> {
        let record: NodeRecord = decode(key, bytes)?;
        check_name(key, &record.name)?;
        if record.name != node {
            return Err(RecordError::NameMismatch { key: key.to_owned(), name: record.name });
        }
        if record.cpus > MAX_CPUS {
            return Err(RecordError::TooManyCpus { key: key.to_owned(), cpus: record.cpus });
        }
        Ok(record)
    }
}

/// One sandbox placed on a node and not yet released.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AllocEntry {
    /// The sandbox.
    pub id: String,
    /// Its vCPUs.
    pub vcpus: u32,
    /// Its memory limit, in bytes.
    pub memory: u64,
    /// The CPUs it takes a slot on (empty when the node does not admit against CPUs).
    pub cpus: Vec<u32>,
}

/// Everything placed on a node, at `{prefix}alloc/{node}`, without a lease. It is only written by transactions
/// that compare its mod revision (the fencing revision), so concurrent placers never both add to what they read.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Alloc {
    /// The node incarnation this alloc belongs to; a node not yet cleaned up after it registered has an alloc of
    /// an older incarnation, and takes no placements.
    pub incarnation: u64,
    /// The sandboxes placed, in the order placed.
    pub entries: Vec<AllocEntry>,
}

impl Alloc {
    /// The alloc's JSON.
    pub fn to_json(&self) -> Vec<u8> {
        encode(self)
    }

    /// Parses and checks the alloc read at `key`.
    pub fn parse(key: &str, bytes: &[u8]) -> Result<Alloc, RecordError> {
        let alloc: Alloc = decode(key, bytes)?;
        let mut seen = std::collections::BTreeSet::new();
        for entry in &alloc.entries {
            check_name(key, &entry.id)?;
            if !seen.insert(entry.id.as_str()) {
                return Err(RecordError::DuplicateEntry { key: key.to_owned(), id: entry.id.clone() });
            }
        }
        Ok(alloc)
    }

    /// The entry of sandbox `id`.
    pub fn entry(&self, id: &str) -> Option<&AllocEntry> {
        self.entries.iter().find(|e| e.id == id)
    }

    /// Memory limits of every entry, in bytes (saturating).
    pub fn memory(&self) -> u64 {
        self.entries.iter().fold(0u64, |sum, e| sum.saturating_add(e.memory))
    }
}

/// Where a sandbox is in its life, as the catalog says.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SandboxState {
    /// Placed on the node by a placer; the node has not taken it yet.
    Reserved,
    /// The node took it (it confirmed, then created the sandbox).
    Active,
}

/// Which node owns a sandbox, at `{prefix}sandboxes/{id}`, without a lease: it outlives the node's lease, so that
/// a request for a sandbox of a dead node is answered "lost" rather than "unknown".
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CatalogEntry {
    /// The owning node.
    pub node: String,
    /// The node's incarnation when the sandbox was placed.
    pub incarnation: u64,
    /// Reserved or active.
    pub state: SandboxState,
}

impl CatalogEntry {
    /// The entry's JSON. It is canonical (fields in declaration order, no spaces): the confirm transaction
    /// compares the stored value with the bytes it expects.
    pub fn to_json(&self) -> Vec<u8> {
        encode(self)
    }

    /// Parses and checks the catalog entry read at `key`.
    pub fn parse(key: &str, bytes: &[u8]) -> Result<CatalogEntry, RecordError> {
        let entry: CatalogEntry = decode(key, bytes)?;
        check_name(key, &entry.node)?;
        Ok(entry)
    }

    /// Whether the entry names this incarnation of this node, in this state.
    pub fn is(&self, node: &str, incarnation: u64, state: SandboxState) -> bool {
        self.node == node && self.incarnation == incarnation && self.state == state
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

    use super::*;

    fn record() -> NodeRecord {
        NodeRecord {
            name: "n1".into(),
            advertise: "http://10.0.0.1:8080".into(),
            incarnation: 7,
            cpus: 4,
            slots: 2,
            memory: 8 << 30,
            draining: false,
        }
    }

    #[test]
    fn records_round_trip_through_their_json() {
        let r = record();
        assert_eq!(NodeRecord::parse("k", "n1", &r.to_json()).unwrap(), r);
        let alloc = Alloc {
            incarnation: 7,
            entries: vec![AllocEntry { id: "sb_1".into(), vcpus: 2, memory: 1 << 30, cpus: vec![0, 1] }],
        };
        assert_eq!(Alloc::parse("k", &alloc.to_json()).unwrap(), alloc);
        let entry = CatalogEntry { node: "n1".into(), incarnation: 7, state: SandboxState::Reserved };
        assert_eq!(entry.to_json(), br#"{"node":"n1","incarnation":7,"state":"reserved"}"#);
        assert_eq!(CatalogEntry::parse("k", &entry.to_json()).unwrap(), entry);
    }

    #[test]
    fn malformed_values_are_typed_errors() {
        let key = "/strata/nodes/n1";
        for bad in [&b""[..], b"null", b"{", b"[]", b"\xff\xfe", b"{\"name\":\"n1\"}", b"42"] {
            assert!(matches!(NodeRecord::parse(key, "n1", bad), Err(RecordError::Json { .. })), "{bad:?}");
            assert!(matches!(Alloc::parse(key, bad), Err(RecordError::Json { .. })), "{bad:?}");
            assert!(matches!(CatalogEntry::parse(key, bad), Err(RecordError::Json { .. })), "{bad:?}");
        }
        let mut json: serde_json::Value = serde_json::from_slice(&record().to_json()).unwrap();
        json["extra"] = 1.into();
        let err = NodeRecord::parse(key, "n1", json.to_string().as_bytes()).unwrap_err();
        assert!(matches!(err, RecordError::Json { ref reason, .. } if reason.contains("extra")), "{err}");
        json = serde_json::from_slice(&record().to_json()).unwrap();
        json["cpus"] = (-1).into();
        assert!(matches!(NodeRecord::parse(key, "n1", json.to_string().as_bytes()), Err(RecordError::Json { .. })));
        json["cpus"] = (MAX_CPUS + 1).into();
        assert_eq!(
            NodeRecord::parse(key, "n1", json.to_string().as_bytes()),
            Err(RecordError::TooManyCpus { key: key.into(), cpus: MAX_CPUS + 1 })
        );
        assert_eq!(
            NodeRecord::parse(key, "n2", &record().to_json()),
            Err(RecordError::NameMismatch { key: key.into(), name: "n1".into() })
        );
        let bad_name = NodeRecord { name: "a/b".into(), ..record() };
        assert!(matches!(NodeRecord::parse(key, "a/b", &bad_name.to_json()), Err(RecordError::BadName { .. })));
        let entry = r#"{"id":"a","vcpus":1,"memory":1,"cpus":[]}"#;
        let twice = format!(r#"{{"incarnation":1,"entries":[{entry},{entry}]}}"#);
        let twice = twice.as_bytes();
        assert_eq!(Alloc::parse(key, twice), Err(RecordError::DuplicateEntry { key: key.into(), id: "a".into() }));
        let state = br#"{"node":"n1","incarnation":1,"state":"gone"}"#;
        assert!(matches!(CatalogEntry::parse(key, state), Err(RecordError::Json { .. })));
        let node = br#"{"node":"","incarnation":1,"state":"active"}"#;
        assert!(matches!(CatalogEntry::parse(key, node), Err(RecordError::BadName { .. })));
    }

    #[test]
    fn names_are_path_segments() {
        assert!(valid_name("sb_0123abcd") && valid_name("node-1.example:8080"));
        assert!(!valid_name("") && !valid_name("a/b") && !valid_name("a b") && !valid_name("é"));
        assert!(valid_name(&"a".repeat(MAX_NAME_LEN)) && !valid_name(&"a".repeat(MAX_NAME_LEN + 1)));
    }
}
