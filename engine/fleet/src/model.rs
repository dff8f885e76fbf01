//! An in-memory model of the etcd features the protocol uses, for tests: a key-value store with a global
//! revision, each key's create and mod revisions and version, leases that expire at a simulated time and delete
//! their keys, atomic [`Txn`]s and prefix ranges. Time is passed in ([`Etcd::advance_to`]); nothing here reads
//! a clock.
//!
//! Like etcd: the store starts at revision 1; each transaction that writes something (and each lease expiry that
//! deletes keys) is one new revision shared by all its writes; deleting an absent key writes nothing; a put
//! without a lease detaches the key from its lease; a put naming a lease that does not exist fails the whole
//! transaction with an error; a transaction may not write one key twice nor hold more than [`MAX_TXN_OPS`]
//! compares or operations.

use std::collections::{BTreeMap, BTreeSet};

use crate::txn::{Compare, KeyValue, MAX_TXN_OPS, Op, Txn};

/// Why the model refused a call (etcd answers these with an error, not with a failed compare).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ModelError {
    /// A lease that does not exist (never granted, expired or revoked).
    #[error("lease {0} not found")]
    LeaseNotFound(i64),
    /// More compares or operations than etcd takes in one transaction.
    #[error("the transaction has {0} compares or operations, more than {MAX_TXN_OPS}")]
    TooManyOps(usize),
    /// Two writes of one key in one transaction.
    #[error("the transaction writes {0} twice")]
    DuplicateKey(String),
}

#[derive(Debug, Clone)]
struct Stored {
    value: Vec<u8>,
    create_revision: i64,
    mod_revision: i64,
    version: i64,
    lease: i64,
}

#[derive(Debug, Clone)]
struct Lease {
    ttl_ms: u64,
    deadline_ms: u64,
    keys: BTreeSet<String>,
}

/// The etcd model.
#[derive(Debug, Clone)]
pub struct Etcd {
    revision: i64,
    now_ms: u64,
    next_lease: i64,
    kvs: BTreeMap<String, Stored>,
    leases: BTreeMap<i64, Lease>,
}

impl Default for Etcd {
    fn default() -> Etcd {
        Etcd::new()
    }
}

impl Etcd {
    /// An empty store at revision 1, at time 0.
    pub fn new() -> Etcd {
        Etcd { revision: 1, now_ms: 0, next_lease: 1, kvs: BTreeMap::new(), leases: BTreeMap::new() }
    }

    /// The store's revision: that of its last write.
    pub fn revision(&self) -> i64 {
        self.revision
    }

    /// The time the model is at, in milliseconds.
    pub fn now_ms(&self) -> u64 {
        self.now_ms
    }

    /// Moves time to `now_ms` (never backwards) and expires every lease whose deadline has come, deleting its
    /// keys (one revision per lease, leases in id order); the leases expired.
    pub fn advance_to(&mut self, now_ms: u64) -> Vec<i64> {
        self.now_ms = self.now_ms.max(now_ms);
        let due: Vec<i64> =
            self.leases.iter().filter(|(_, l)| l.deadline_ms <= self.now_ms).map(|(&id, _)| id).collect();
        for &id in &due {
            if let Some(lease) = self.leases.remove(&id) {
                let present: Vec<&String> = lease.keys.iter().filter(|k| self.kvs.contains_key(*k)).collect();
                if !present.is_empty() {
                    self.revision += 1;
                    for key in present {
                        self.kvs.remove(key);
                    }
                }
            }
        }
        due
    }

    /// Grants a lease of `ttl_ms`, alive until `now + ttl_ms` unless kept alive; its id (never reused).
    pub fn grant(&mut self, ttl_ms: u64) -> i64 {
        let id = self.next_lease;
        self.next_lease += 1;
        self.leases
            .insert(id, Lease { ttl_ms, deadline_ms: self.now_ms.saturating_add(ttl_ms), keys: BTreeSet::new() });
        id
    }

    /// Keeps a lease alive for its TTL from now.
    pub fn keepalive(&mut self, lease: i64) -> Result<(), ModelError> {
        let now = self.now_ms;
        let l = self.leases.get_mut(&lease).ok_or(ModelError::LeaseNotFound(lease))?;
        l.deadline_ms = now.saturating_add(l.ttl_ms);
        Ok(())
    }

    /// Revokes a lease now, deleting its keys.
    pub fn revoke(&mut self, lease: i64) -> Result<(), ModelError> {
        let l = self.leases.get_mut(&lease).ok_or(ModelError::LeaseNotFound(lease))?;
        l.deadline_ms = 0;
        self.advance_to(self.now_ms);
        Ok(())
    }

    /// Milliseconds the lease has left, if it exists.
    pub fn time_to_live(&self, lease: i64) -> Option<u64> {
        self.leases.get(&lease).map(|l| l.deadline_ms.saturating_sub(self.now_ms))
    }

    fn holds(&self, compare: &Compare) -> bool {
        let stored = self.kvs.get(compare.key());
        match compare {
            Compare::Exists { .. } => stored.is_some(),
            Compare::Missing { .. } => stored.is_none(),
            Compare::ModRevision { rev, .. } => stored.map_or(0, |s| s.mod_revision) == *rev,
            Compare::Lease { lease, .. } => stored.map_or(0, |s| s.lease) == *lease,
            Compare::Value { value, .. } => stored.is_some_and(|s| s.value == *value),
        }
    }

    /// Runs a transaction: `Ok(true)` when every compare held and every operation was applied (in one revision
    /// if any wrote), `Ok(false)` when a compare failed and nothing was written.
    pub fn txn(&mut self, txn: &Txn) -> Result<bool, ModelError> {
        let most = txn.compares.len().max(txn.success.len());
        if most > MAX_TXN_OPS {
            return Err(ModelError::TooManyOps(most));
        }
        let mut written = BTreeSet::new();
        for op in &txn.success {
            if !written.insert(op.key()) {
                return Err(ModelError::DuplicateKey(op.key().to_owned()));
            }
            if let Op::Put { lease: Some(lease), .. } = op
                && !self.leases.contains_key(lease)
            {
                return Err(ModelError::LeaseNotFound(*lease));
            }
        }
        if !txn.compares.iter().all(|c| self.holds(c)) {
            return Ok(false);
        }
        let changes = txn.success.iter().any(|op| matches!(op, Op::Put { .. }) || self.kvs.contains_key(op.key()));
        if !changes {
            return Ok(true);
        }
        self.revision += 1;
        let revision = self.revision;
        for op in &txn.success {
            match op {
                Op::Put { key, value, lease } => {
                    let lease = lease.unwrap_or(0);
                    let (create_revision, version, old_lease) = match self.kvs.get(key) {
                        Some(s) => (s.create_revision, s.version + 1, s.lease),
                        None => (revision, 1, 0),
                    };
                    self.detach(key, old_lease);
                    if let Some(l) = self.leases.get_mut(&lease) {
                        l.keys.insert(key.clone());
                    }
                    let stored =
                        Stored { value: value.clone(), create_revision, mod_revision: revision, version, lease };
                    self.kvs.insert(key.clone(), stored);
                }
                Op::Delete { key } => {
                    if let Some(s) = self.kvs.remove(key) {
                        self.detach(key, s.lease);
                    }
                }
            }
        }
        Ok(true)
    }

    fn detach(&mut self, key: &str, lease: i64) {
        if let Some(l) = self.leases.get_mut(&lease) {
            l.keys.remove(key);
        }
    }

    /// Puts a key unconditionally (a transaction of one put).
    pub fn put(&mut self, key: &str, value: &[u8], lease: Option<i64>) -> Result<(), ModelError> {
        self.txn(&Txn {
            compares: vec![],
            success: vec![Op::Put { key: key.to_owned(), value: value.to_vec(), lease }],
        })
        .map(drop)
    }

    /// Deletes a key unconditionally.
    pub fn delete(&mut self, key: &str) {
        if let Some(s) = self.kvs.remove(key) {
            self.revision += 1;
            self.detach(key, s.lease);
        }
    }

    fn key_value(key: &str, s: &Stored) -> KeyValue {
        KeyValue {
            key: key.to_owned(),
            value: s.value.clone(),
            create_revision: s.create_revision,
            mod_revision: s.mod_revision,
            version: s.version,
            lease: s.lease,
        }
    }

    /// One key, if present.
    pub fn get(&self, key: &str) -> Option<KeyValue> {
        self.kvs.get(key).map(|s| Etcd::key_value(key, s))
    }

    /// The value of one key, if present.
    pub fn value(&self, key: &str) -> Option<&[u8]> {
        self.kvs.get(key).map(|s| s.value.as_slice())
    }

    /// Every key starting with `prefix`, in key order.
    pub fn range(&self, prefix: &str) -> Vec<KeyValue> {
        self.kvs
            .range::<str, _>((std::ops::Bound::Included(prefix), std::ops::Bound::Unbounded))
            .take_while(|(k, _)| k.starts_with(prefix))
            .map(|(k, s)| Etcd::key_value(k, s))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

    use super::*;

    fn put(key: &str, value: &str, lease: Option<i64>) -> Op {
        Op::Put { key: key.into(), value: value.into(), lease }
    }

    fn txn(compares: Vec<Compare>, success: Vec<Op>) -> Txn {
        Txn { compares, success }
    }

    #[test]
    fn revisions_and_versions_follow_etcd() {
        let mut etcd = Etcd::new();
        assert_eq!(etcd.revision(), 1);
        assert!(etcd.txn(&txn(vec![], vec![put("a", "1", None), put("b", "1", None)])).unwrap());
        assert_eq!(etcd.revision(), 2, "one revision per transaction");
        etcd.put("a", b"2", None).unwrap();
        let a = etcd.get("a").unwrap();
        assert_eq!((a.create_revision, a.mod_revision, a.version, a.value.as_slice()), (2, 3, 2, &b"2"[..]));
        assert!(etcd.txn(&txn(vec![], vec![Op::Delete { key: "zz".into() }])).unwrap());
        assert_eq!(etcd.revision(), 3, "deleting an absent key writes nothing");
        etcd.delete("a");
        etcd.put("a", b"3", None).unwrap();
        let a = etcd.get("a").unwrap();
        assert_eq!((a.create_revision, a.version), (5, 1), "a key created again starts over");
        assert_eq!(etcd.range("").iter().map(|kv| kv.key.as_str()).collect::<Vec<_>>(), ["a", "b"]);
    }

    #[test]
    fn a_transaction_applies_everything_or_nothing() {
        let mut etcd = Etcd::new();
        etcd.put("k", b"v", None).unwrap();
        let rev = etcd.get("k").unwrap().mod_revision;
        let holds = [
            Compare::Exists { key: "k".into() },
            Compare::Missing { key: "m".into() },
            Compare::ModRevision { key: "k".into(), rev },
            Compare::ModRevision { key: "m".into(), rev: 0 },
            Compare::Lease { key: "k".into(), lease: 0 },
            Compare::Value { key: "k".into(), value: b"v".to_vec() },
        ];
        let fails = [
            Compare::Exists { key: "m".into() },
            Compare::Missing { key: "k".into() },
            Compare::ModRevision { key: "k".into(), rev: rev + 1 },
            Compare::Lease { key: "k".into(), lease: 9 },
            Compare::Value { key: "k".into(), value: b"w".to_vec() },
            Compare::Value { key: "m".into(), value: vec![] },
        ];
        for c in &holds {
            assert!(etcd.clone().txn(&txn(vec![c.clone()], vec![put("x", "1", None)])).unwrap(), "{c:?}");
        }
        for c in &fails {
            let mut all = holds.to_vec();
            all.push(c.clone());
            let before = etcd.revision();
            assert!(!etcd.txn(&txn(all, vec![put("x", "1", None), Op::Delete { key: "k".into() }])).unwrap(), "{c:?}");
            assert_eq!((etcd.revision(), etcd.get("x"), etcd.value("k")), (before, None, Some(&b"v"[..])));
        }
    }

    #[test]
    fn refused_transactions_are_errors() {
        let mut etcd = Etcd::new();
        let many: Vec<Op> = (0..=MAX_TXN_OPS).map(|i| put(&i.to_string(), "", None)).collect();
        assert_eq!(etcd.txn(&txn(vec![], many)), Err(ModelError::TooManyOps(MAX_TXN_OPS + 1)));
        let twice = vec![put("a", "", None), Op::Delete { key: "a".into() }];
        assert_eq!(etcd.txn(&txn(vec![], twice)), Err(ModelError::DuplicateKey("a".into())));
        assert_eq!(etcd.put("a", b"", Some(7)), Err(ModelError::LeaseNotFound(7)));
        assert_eq!(etcd.revision(), 1);
    }

    #[test]
    fn leases_expire_with_their_keys_unless_kept_alive() {
        let mut etcd = Etcd::new();
        let lease = etcd.grant(1000);
        etcd.put("n", b"1", Some(lease)).unwrap();
        etcd.put("moved", b"1", Some(lease)).unwrap();
        etcd.put("moved", b"2", None).unwrap();
        assert_eq!(etcd.get("n").unwrap().lease, lease);
        assert_eq!(etcd.advance_to(999), Vec::<i64>::new());
        etcd.keepalive(lease).unwrap();
        assert_eq!(etcd.time_to_live(lease), Some(1000));
        assert_eq!(etcd.advance_to(1998), Vec::<i64>::new());
        let rev = etcd.revision();
        assert_eq!(etcd.advance_to(1999), vec![lease]);
        assert_eq!((etcd.get("n"), etcd.revision()), (None, rev + 1), "the expiry deletes in one revision");
        assert!(etcd.get("moved").is_some(), "a key put without the lease is detached from it");
        assert_eq!(etcd.keepalive(lease), Err(ModelError::LeaseNotFound(lease)));
        let other = etcd.grant(10);
        assert_ne!(other, lease, "lease ids are never reused");
        etcd.put("o", b"", Some(other)).unwrap();
        etcd.revoke(other).unwrap();
        assert_eq!(etcd.get("o"), None);
        assert_eq!(etcd.advance_to(5), Vec::<i64>::new(), "time never goes back");
        assert_eq!(etcd.now_ms(), 1999);
    }
}
