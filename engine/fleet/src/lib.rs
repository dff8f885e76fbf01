//! The protocol many `strata serve` nodes follow to run as one fleet through etcd, without I/O.
//!
//! Each node registers a [`NodeRecord`] under its etcd lease, keeps an [`Alloc`] of everything placed on it, and
//! the catalog says which node owns each sandbox ([`CatalogEntry`]). A node receiving a create request is its
//! *placer*: it reads the fleet ([`View`]), chooses a node ([`Protocol::plan`], packing CPUs by the same
//! [`Bins`] rule a node applies to itself), reserves there in one transaction fenced by the alloc's mod revision,
//! and forwards the create; the chosen node confirms the reservation before it creates anything. A placer that
//! gives up releases the reservation unless the node took it. [`design`] is the design record: the keys, every
//! transaction, why each compare is there, and what a crash or a partition loses.
//!
//! Everything here is data in, data out: [`Protocol`]'s functions turn what was read into a [`Txn`] (plain
//! [`Compare`]s and [`Op`]s) or a decision, and the caller executes it, against etcd or against the in-memory
//! [`model::Etcd`]. The crate's simulation test (`tests/simulation`) runs nodes, placers, a lossy network, crashes,
//! partitions and lease expiry over that model, seeded and deterministic, and checks after every step that no
//! node is over-committed and no sandbox has two owners.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod bins;
pub mod design;
pub mod model;
pub mod protocol;
pub mod records;
pub mod txn;
pub mod view;

pub use bins::{Bins, BinsError};
pub use protocol::{
    Cleanup, DEFAULT_PREFIX, MAX_REQUEST, Owner, Plan, PlanError, Protocol, Release, RequestError, SandboxRequest,
    Skip, Skipped,
};
pub use records::{Alloc, AllocEntry, CatalogEntry, MAX_CPUS, NodeRecord, RecordError, SandboxState, valid_name};
pub use txn::{Compare, KeyValue, MAX_TXN_OPS, Op, Txn};
pub use view::{Versioned, View};
