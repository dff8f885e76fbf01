//! What a node read from etcd, parsed: the [`View`] every decision of the protocol (`crate::Protocol`) is taken
//! from.
//!
//! A view is built from the key-values of any ranges and gets ([`View::parse`]); it does not need to be one
//! consistent snapshot, because every transaction compares what its decision rested on. A malformed value is
//! kept aside in [`View::malformed`] with its error rather than failing the whole view: one node writing
//! garbage must not stop the fleet.

use std::collections::BTreeMap;

use crate::records::{Alloc, CatalogEntry, NodeRecord, RecordError, SandboxState, valid_name};
use crate::txn::KeyValue;

/// A value read from etcd with its key's revisions and lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Versioned<T> {
    /// The value, parsed.
    pub value: T,
    /// The revision that created the key.
    pub create_revision: i64,
    /// The revision that last wrote it (the fencing revision of an alloc).
    pub mod_revision: i64,
    /// The lease the key is attached to; 0 for none.
    pub lease: i64,
}

/// The fleet's keys as read: node records, allocs and catalog entries, by node name and sandbox id.
///
/// What a key's absence means depends on what was read: an operation's docs say which keys its view must hold
/// (a range of `nodes/`, the alloc of one node, the catalog entries of some ids, or the whole catalog).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct View {
    /// Node records by node name, with each record's lease.
    pub nodes: BTreeMap<String, Versioned<NodeRecord>>,
    /// Allocs by node name, with each one's mod revision.
    pub allocs: BTreeMap<String, Versioned<Alloc>>,
    /// Catalog entries by sandbox id.
    pub catalog: BTreeMap<String, Versioned<CatalogEntry>>,
    /// Snapshot catalog entries by snapshot id (always [`crate::SandboxState::Active`]: the node that holds it).
    pub snapshots: BTreeMap<String, Versioned<CatalogEntry>>,
    /// Keys of the fleet whose values are malformed, with why.
    pub malformed: BTreeMap<String, RecordError>,
}

impl View {
    /// Parses the key-values of the fleet under `prefix` (the protocol's, ending with `/`); other keys are ignored. A later key-value of
    /// one key replaces an earlier one.
    pub fn parse(prefix: &str, kvs: &[KeyValue]) -> View {
        let mut view = View::default();
        for kv in kvs {
            view.insert(prefix, kv);
        }
        view
    }

    /// Adds one key-value read.
    pub fn insert(&mut self, prefix: &str, kv: &KeyValue) {
        let Some(rest) = kv.key.strip_prefix(prefix) else { return };
        let (kind, name) = match rest.split_once('/') {
            Some((kind @ ("nodes" | "alloc" | "sandboxes" | "snapshots"), name)) => (kind, name),
            _ => return,
        };
        self.malformed.remove(&kv.key);
        let key = kv.key.as_str();
        if !valid_name(name) {
            self.malformed.insert(key.to_owned(), RecordError::BadName { key: key.to_owned(), name: name.to_owned() });
            return;
        }
        fn versioned<T>(value: T, kv: &KeyValue) -> Versioned<T> {
            Versioned { value, create_revision: kv.create_revision, mod_revision: kv.mod_revision, lease: kv.lease }
        }
        let parsed = match kind {
            "nodes" => NodeRecord::parse(key, name, &kv.value).map(|r| {
                self.nodes.insert(name.to_owned(), versioned(r, kv));
            }),
            "alloc" => Alloc::parse(key, &kv.value).map(|a| {
                self.allocs.insert(name.to_owned(), versioned(a, kv));
            }),
            "snapshots" => CatalogEntry::parse(key, &kv.value).map(|e| {
                self.snapshots.insert(name.to_owned(), versioned(e, kv));
            }),
            _ => CatalogEntry::parse(key, &kv.value).map(|e| {
                self.catalog.insert(name.to_owned(), versioned(e, kv));
            }),
        };
        if let Err(error) = parsed {
            match kind {
                "nodes" => drop(self.nodes.remove(name)),
                "alloc" => drop(self.allocs.remove(name)),
                "snapshots" => drop(self.snapshots.remove(name)),
                _ => drop(self.catalog.remove(name)),
            }
            self.malformed.insert(key.to_owned(), error);
        }
    }

    /// Whether every sandbox of `ids` has a catalog entry naming `node` at `incarnation`, in `state`.
    pub fn all_in(&self, ids: &[String], node: &str, incarnation: u64, state: SandboxState) -> bool {
        ids.iter().all(|id| self.catalog.get(id).is_some_and(|e| e.value.is(node, incarnation, state)))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

    use super::*;
    use crate::protocol::Protocol;

    fn kv(key: &str, value: &[u8], mod_revision: i64) -> KeyValue {
        KeyValue { key: key.into(), value: value.to_vec(), create_revision: 2, mod_revision, version: 1, lease: 0 }
    }

    #[test]
    fn a_view_keeps_malformed_values_aside_and_ignores_other_keys() {
        let p = Protocol::default();
        let entry = CatalogEntry { node: "n".into(), incarnation: 1, state: SandboxState::Active };
        let alloc = Alloc { incarnation: 1, entries: vec![] };
        let view = p.view(&[
            kv("/strata/sandboxes/a", &entry.to_json(), 5),
            kv("/strata/sandboxes/b", b"\x00garbage", 6),
            kv("/strata/alloc/n", &alloc.to_json(), 7),
            kv("/strata/nodes/n", b"{}", 8),
            kv("/strata/nodes/a/b", b"{}", 9),
            kv("/strata/other/x", b"{}", 9),
            kv("/elsewhere/nodes/n", b"{}", 9),
        ]);
        assert_eq!(view.catalog["a"].value, entry);
        assert_eq!(view.catalog["a"].mod_revision, 5);
        assert_eq!(view.allocs["n"].value, alloc);
        assert!(view.nodes.is_empty());
        let malformed: Vec<&str> = view.malformed.keys().map(String::as_str).collect();
        assert_eq!(malformed, ["/strata/nodes/a/b", "/strata/nodes/n", "/strata/sandboxes/b"]);
        assert!(matches!(view.malformed["/strata/nodes/a/b"], RecordError::BadName { .. }));
        assert!(view.all_in(&["a".into()], "n", 1, SandboxState::Active));
        assert!(!view.all_in(&["a".into(), "b".into()], "n", 1, SandboxState::Active));
    }

    #[test]
    fn a_later_read_of_a_key_replaces_an_earlier_one() {
        let p = Protocol::default();
        let entry = CatalogEntry { node: "n".into(), incarnation: 1, state: SandboxState::Reserved };
        let mut view = p.view(&[kv("/strata/sandboxes/a", b"bad", 5)]);
        view.insert(p.prefix(), &kv("/strata/sandboxes/a", &entry.to_json(), 6));
        assert!(view.malformed.is_empty());
        assert_eq!(view.catalog["a"].mod_revision, 6);
        view.insert(p.prefix(), &kv("/strata/sandboxes/a", b"bad", 7));
        assert!(view.catalog.is_empty() && view.malformed.contains_key("/strata/sandboxes/a"));
    }
}
