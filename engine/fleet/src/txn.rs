//! etcd's transactions and key-values, as plain data: the protocol's functions return a [`Txn`], and whatever
//! talks to etcd (the `etcd-client` adapter, or [`crate::model::Etcd`] in tests) executes it.
//!
//! Mapping onto etcd's `Compare` (all with `=` unless said): [`Compare::Exists`] is `version > 0`,
//! [`Compare::Missing`] is `create_revision = 0`, [`Compare::ModRevision`] is `mod_revision`, [`Compare::Lease`]
//! is `lease` (0 for a key without a lease, or absent) and [`Compare::Value`] is `value` (false when the key is
//! absent). A transaction has no failure branch: when a compare fails, nothing is written, and the caller reads
//! again and decides again.

/// Most compares, and most operations, etcd accepts in one transaction (its `--max-txn-ops` default). The
/// protocol never builds a bigger transaction; requests and batches are bounded to fit.
pub const MAX_TXN_OPS: usize = 128;

/// A condition of a transaction on one key, as it is when the transaction runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Compare {
    /// The key exists.
    Exists {
        /// The key.
        key: String,
    },
    /// The key does not exist (its create revision is 0).
    Missing {
        /// The key.
        key: String,
    },
    /// The key's mod revision is `rev` (0: absent): nobody wrote it since it was read at `rev`.
    ModRevision {
        /// The key.
        key: String,
        /// The mod revision read.
        rev: i64,
    },
    /// The key is attached to `lease` (0: to none, or absent).
    Lease {
        /// The key.
        key: String,
        /// The lease id.
        lease: i64,
    },
    /// The key exists and holds exactly `value`.
    Value {
        /// The key.
        key: String,
        /// The bytes expected.
        value: Vec<u8>,
    },
}

impl Compare {
    /// The key compared.
    pub fn key(&self) -> &str {
        match self {
            Compare::Exists { key }
            | Compare::Missing { key }
            | Compare::ModRevision { key, .. }
            | Compare::Lease { key, .. }
            | Compare::Value { key, .. } => key,
        }
    }
}

/// A write of a transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    /// Sets the key, attached to `lease` (or to none).
    Put {
        /// The key.
        key: String,
        /// The value.
        value: Vec<u8>,
        /// The lease the key lives by; `None`: the key lives until deleted.
        lease: Option<i64>,
    },
    /// Deletes the key (nothing when absent).
    Delete {
        /// The key.
        key: String,
    },
}

impl Op {
    /// The key written.
    pub fn key(&self) -> &str {
        match self {
            Op::Put { key, .. } | Op::Delete { key } => key,
        }
    }
}

/// An etcd transaction without a failure branch: every operation of `success` is applied, atomically, when every
/// compare holds; otherwise nothing is.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Txn {
    /// What must hold.
    pub compares: Vec<Compare>,
    /// What is then written.
    pub success: Vec<Op>,
}

impl Txn {
    /// Whether the transaction writes nothing.
    pub fn is_empty(&self) -> bool {
        self.success.is_empty()
    }
}

/// A key-value as etcd returns it from a range.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyValue {
    /// The key.
    pub key: String,
    /// The value.
    pub value: Vec<u8>,
    /// The revision that created the key.
    pub create_revision: i64,
    /// The revision that last wrote the key.
    pub mod_revision: i64,
    /// Writes since the key was created (1 after the first).
    pub version: i64,
    /// The lease the key is attached to; 0 for none.
    pub lease: i64,
}
