//! The protocol's operations, as pure functions from what was read (a [`View`]) to a [`Txn`] or a decision. The
//! why of each transaction and compare is in [`crate::design`].

use std::collections::BTreeSet;

use crate::bins::Bins;
use crate::records::{Alloc, AllocEntry, CatalogEntry, NodeRecord, RecordError, SandboxState, valid_name};
use crate::txn::{Compare, KeyValue, MAX_TXN_OPS, Op, Txn};
use crate::view::View;

/// The key prefix of a fleet unless configured otherwise.
pub const DEFAULT_PREFIX: &str = "/strata/";

/// The most sandboxes one request may place, confirm or release: its transaction then compares a node's lease, its
/// alloc and each sandbox's catalog entry, within [`MAX_TXN_OPS`].
pub const MAX_REQUEST: usize = MAX_TXN_OPS - 2;

/// Why a list of sandboxes or a node record cannot be the subject of a transaction.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    /// No sandbox.
    #[error("the request has no sandbox")]
    Empty,
    /// More sandboxes than one transaction can hold.
    #[error("the request has {count} sandboxes, more than {max}")]
    TooLarge {
        /// Sandboxes in the request.
        count: usize,
        /// [`MAX_REQUEST`].
        max: usize,
    },
    /// A node name or sandbox id that is not one ([`valid_name`]).
    #[error("{name:?} is not a valid node name or sandbox id")]
    BadName {
        /// The name.
        name: String,
    },
    /// A sandbox twice.
    #[error("sandbox {id} is in the request twice")]
    Duplicate {
        /// The sandbox.
        id: String,
    },
}

/// One sandbox of a request to place.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SandboxRequest {
    /// Its id, chosen by the placer, new.
    pub id: String,
    /// Its vCPUs.
    pub vcpus: u32,
    /// Its memory limit, in bytes.
    pub memory: u64,
}

/// Why a node was passed over by [`Protocol::plan`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Skip {
    /// In the caller's exclude set.
    Excluded,
    /// Draining.
    Draining,
    /// Its alloc is absent or of another incarnation: it has not cleaned up since it registered.
    NotCleanedUp,
    /// Its alloc is malformed, or does not fit its record.
    Malformed,
    /// Not enough free CPU slots.
    Cpu,
    /// Not enough memory.
    Memory,
}

/// A node passed over, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Skipped {
    /// The node.
    pub node: String,
    /// Why.
    pub why: Skip,
}

fn describe(skipped: &[Skipped]) -> String {
    if skipped.is_empty() {
        return "no node is registered".to_owned();
    }
    let each: Vec<String> = skipped.iter().map(|s| format!("{}: {:?}", s.node, s.why)).collect();
    each.join(", ")
}

/// Why a request cannot be placed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    /// The request itself is invalid.
    #[error(transparent)]
    Request(#[from] RequestError),
    /// A sandbox id of the request is already placed.
    #[error("sandbox {id} is already placed on node {node}")]
    IdTaken {
        /// The sandbox.
        id: String,
        /// Its node.
        node: String,
    },
    /// No node can take the whole request now.
    #[error("no node can take the request ({})", describe(skipped))]
    NoRoom {
        /// Every registered node, and why it was passed over.
        skipped: Vec<Skipped>,
    },
}

/// Where a request goes, and the transaction that reserves it there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// The node chosen.
    pub node: String,
    /// Its incarnation, as read.
    pub incarnation: u64,
    /// Its lease, as read.
    pub lease: i64,
    /// Where it is reached.
    pub advertise: String,
    /// The request's sandboxes in the order given, each with the CPUs it takes on the node.
    pub entries: Vec<AllocEntry>,
    /// The reservation: compares the node's lease, its alloc's mod revision and that no sandbox id is taken; puts
    /// the alloc with the new entries and a `Reserved` catalog entry per sandbox.
    pub txn: Txn,
}

impl Plan {
    /// The request's sandbox ids.
    pub fn ids(&self) -> Vec<String> {
        self.entries.iter().map(|e| e.id.clone()).collect()
    }
}

/// What a node writes when it (re)registers, before it takes placements: [`Protocol::cleanup`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Cleanup {
    /// Rewrites the node's alloc to the new incarnation and the sandboxes it runs; `None` when it already is.
    pub alloc: Option<Txn>,
    /// Deletes the catalog entries of the node's earlier incarnations, for sandboxes it does not run, in
    /// transactions of at most [`MAX_TXN_OPS`] entries.
    pub catalog: Vec<Txn>,
}

impl Cleanup {
    /// Whether nothing is left to write.
    pub fn is_done(&self) -> bool {
        self.alloc.is_none() && self.catalog.is_empty()
    }
}

/// What releasing a reservation comes to ([`Protocol::release_reservation`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Release {
    /// Run this; when a compare fails, read again and decide again.
    Txn(Txn),
    /// The node confirmed the sandboxes: it took them, and the placement succeeded after all.
    Taken,
    /// None of the sandboxes is reserved on that incarnation of the node any more: nothing to release. Either
    /// someone released them (the node's sweep, or its cleanup after a restart), or the node took them and they
    /// have already ended. A placer that forwarded them therefore places the request again under *new* ids: an
    /// id that may have lived once is never placed twice.
    Gone,
}

/// Who owns a sandbox, for a request that names it ([`Protocol::lookup`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Owner {
    /// This node.
    Local,
    /// Another node, alive, reached there.
    Remote {
        /// The node's URL.
        advertise: String,
    },
    /// A node that is gone (its record expired) or restarted since (another incarnation): the sandbox is lost.
    Lost {
        /// The node.
        node: String,
    },
    /// No such sandbox (or not created yet: only reserved).
    Unknown,
}

/// The fleet protocol under one key prefix: key names, and every operation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Protocol {
    prefix: String,
}

impl Default for Protocol {
    fn default() -> Protocol {
        Protocol::new(DEFAULT_PREFIX)
    }
}

fn check_ids<'a>(ids: impl ExactSizeIterator<Item = &'a str>) -> Result<(), RequestError> {
    let count = ids.len();
    if count == 0 {
        return Err(RequestError::Empty);
    }
    if count > MAX_REQUEST {
        return Err(RequestError::TooLarge { count, max: MAX_REQUEST });
    }
    let mut seen = BTreeSet::new();
    for id in ids {
        if !valid_name(id) {
            return Err(RequestError::BadName { name: id.to_owned() });
        }
        if !seen.insert(id) {
            return Err(RequestError::Duplicate { id: id.to_owned() });
        }
    }
    Ok(())
}

fn check_name(name: &str) -> Result<(), RequestError> {
    if valid_name(name) { Ok(()) } else { Err(RequestError::BadName { name: name.to_owned() }) }
}

impl Protocol {
    /// The protocol under `prefix` (a `/` is added when it does not end with one).
    pub fn new(prefix: &str) -> Protocol {
        let mut prefix = prefix.to_owned();
        if !prefix.ends_with('/') {
            prefix.push('/');
        }
        Protocol { prefix }
    }

    /// The key prefix, ending with `/`.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// `{prefix}nodes/`: the node records.
    pub fn nodes_prefix(&self) -> String {
        format!("{}nodes/", self.prefix)
    }

    /// `{prefix}alloc/`: the allocs.
    pub fn allocs_prefix(&self) -> String {
        format!("{}alloc/", self.prefix)
    }

    /// `{prefix}sandboxes/`: the catalog.
    pub fn sandboxes_prefix(&self) -> String {
        format!("{}sandboxes/", self.prefix)
    }

    /// `{prefix}snapshots/`: the snapshot catalog.
    pub fn snapshots_prefix(&self) -> String {
        format!("{}snapshots/", self.prefix)
    }

    /// `{prefix}snapshots/{id}`: which node holds snapshot `id` (no lease: a snapshot of a node gone is lost, not
    /// unknown).
    pub fn snapshot_key(&self, id: &str) -> String {
        format!("{}snapshots/{id}", self.prefix)
    }

    /// `{prefix}nodes/{node}`.
    pub fn node_key(&self, node: &str) -> String {
        format!("{}nodes/{node}", self.prefix)
    }

    /// `{prefix}alloc/{node}`.
    pub fn alloc_key(&self, node: &str) -> String {
        format!("{}alloc/{node}", self.prefix)
    }

    /// `{prefix}sandboxes/{id}`.
    pub fn sandbox_key(&self, id: &str) -> String {
        format!("{}sandboxes/{id}", self.prefix)
    }

    /// Parses key-values read into a [`View`].
    pub fn view(&self, kvs: &[KeyValue]) -> View {
        View::parse(self.prefix(), kvs)
    }

    /// Registers a node: puts its record with its lease, if no record of that name exists. Two processes with
    /// one name therefore never both register; a node restarted before its previous lease expired retries until
    /// it has ([`Protocol::is_registered`] tells a lost reply from a refusal).
    pub fn register(&self, record: &NodeRecord, lease: i64) -> Result<Txn, RequestError> {
        check_name(&record.name)?;
        let key = self.node_key(&record.name);
        Ok(Txn {
            compares: vec![Compare::Missing { key: key.clone() }],
            success: vec![Op::Put { key, value: record.to_json(), lease: Some(lease) }],
        })
    }

    /// Rewrites a registered node's record (to drain it, say), if it is still the one of `lease`.
    pub fn update(&self, record: &NodeRecord, lease: i64) -> Result<Txn, RequestError> {
        check_name(&record.name)?;
        let key = self.node_key(&record.name);
        Ok(Txn {
            compares: vec![Compare::Lease { key: key.clone(), lease }],
            success: vec![Op::Put { key, value: record.to_json(), lease: Some(lease) }],
        })
    }

    /// Whether `node`'s record is the one registered with `lease` (view: the node's record).
    pub fn is_registered(&self, view: &View, node: &str, lease: i64) -> bool {
        view.nodes.get(node).is_some_and(|r| r.lease == lease)
    }

    /// What `node`, just registered as `incarnation` with `lease`, writes before it takes placements: its alloc
    /// becomes `{incarnation, running}`, where `running` is what the node actually runs (nothing after a restart,
    /// nor after a lost lease, when it killed everything first); and the catalog entries naming an earlier
    /// incarnation of it, for sandboxes it does not run, are deleted. Entries of `incarnation` itself are left
    /// alone: they are reservations made after the alloc was rewritten.
    ///
    /// View: the node's record and alloc, and the whole catalog. Run the alloc transaction first; when a compare
    /// fails, read again and call this again; the node is clean when this returns [`Cleanup::is_done`].
    pub fn cleanup(
        &self,
        view: &View,
        node: &str,
        incarnation: u64,
        lease: i64,
        running: &[AllocEntry],
    ) -> Result<Cleanup, RequestError> {
        check_name(node)?;
        let mut seen = BTreeSet::new();
        for entry in running {
            check_name(&entry.id)?;
            if !seen.insert(entry.id.as_str()) {
                return Err(RequestError::Duplicate { id: entry.id.clone() });
            }
        }
        let alloc_key = self.alloc_key(node);
        let alloc = match view.allocs.get(node) {
            Some(alloc) if alloc.value.incarnation == incarnation => None,
            current => {
                let fence = match current {
                    Some(alloc) => Compare::ModRevision { key: alloc_key.clone(), rev: alloc.mod_revision },
                    None => Compare::Missing { key: alloc_key.clone() },
                };
                let value = Alloc { incarnation, entries: running.to_vec() };
                Some(Txn {
                    compares: vec![Compare::Lease { key: self.node_key(node), lease }, fence],
                    success: vec![Op::Put { key: alloc_key, value: value.to_json(), lease: None }],
                })
            }
        };
        let stale: Vec<(String, i64)> = view
            .catalog
            .iter()
            .filter(|(id, e)| e.value.node == node && e.value.incarnation != incarnation && !seen.contains(id.as_str()))
            .map(|(id, e)| (self.sandbox_key(id), e.mod_revision))
            .collect();
        let catalog = stale
            .chunks(MAX_TXN_OPS)
            .map(|chunk| Txn {
                compares: chunk.iter().map(|(key, rev)| Compare::ModRevision { key: key.clone(), rev: *rev }).collect(),
                success: chunk.iter().map(|(key, _)| Op::Delete { key: key.clone() }).collect(),
            })
            .collect();
        Ok(Cleanup { alloc, catalog })
    }

    /// Chooses the node for a request and builds its reservation. Nodes are tried by name, skipping those in
    /// `exclude`, draining ones, and those not cleaned up since they registered; the request goes whole to the
    /// first on which all of it fits, by [`Bins`] rebuilt from its alloc and by memory.
    ///
    /// View: every node record and alloc (catalog entries are looked at when present: an id already placed is
    /// refused before a transaction would fail on it).
    pub fn plan(&self, view: &View, request: &[SandboxRequest], exclude: &BTreeSet<String>) -> Result<Plan, PlanError> {
        check_ids(request.iter().map(|s| s.id.as_str()))?;
        for s in request {
            let taken = view.catalog.get(&s.id).map(|e| e.value.node.clone()).or_else(|| {
                view.allocs.iter().find(|(_, a)| a.value.entry(&s.id).is_some()).map(|(node, _)| node.clone())
            });
            if let Some(node) = taken {
                return Err(PlanError::IdTaken { id: s.id.clone(), node });
            }
        }
        let widths: Vec<u32> = request.iter().map(|s| s.vcpus).collect();
        let memory = request.iter().fold(0u64, |sum, s| sum.saturating_add(s.memory));
        let mut skipped = Vec::new();
        for (name, record) in &view.nodes {
            let why = |why| Skipped { node: name.clone(), why };
            if exclude.contains(name) {
                skipped.push(why(Skip::Excluded));
                continue;
            }
            if record.value.draining {
                skipped.push(why(Skip::Draining));
                continue;
            }
            if view.malformed.contains_key(&self.alloc_key(name)) {
                skipped.push(why(Skip::Malformed));
                continue;
            }
            let Some(alloc) = view.allocs.get(name).filter(|a| a.value.incarnation == record.value.incarnation) else {
                skipped.push(why(Skip::NotCleanedUp));
                continue;
            };
            let Ok(mut bins) = Bins::with_entries(record.value.cpus, record.value.slots, &alloc.value.entries) else {
                skipped.push(why(Skip::Malformed));
                continue;
            };
            let Some(cpus) = bins.place_all(&widths) else {
                skipped.push(why(Skip::Cpu));
                continue;
            };
            if alloc.value.memory().checked_add(memory).is_none_or(|total| total > record.value.memory) {
                skipped.push(why(Skip::Memory));
                continue;
            }
            let entries: Vec<AllocEntry> = request
                .iter()
                .zip(cpus)
                .map(|(s, cpus)| AllocEntry { id: s.id.clone(), vcpus: s.vcpus, memory: s.memory, cpus })
                .collect();
            let mut next = alloc.value.clone();
            next.entries.extend(entries.iter().cloned());
            let reserved = CatalogEntry {
                node: name.clone(),
                incarnation: record.value.incarnation,
                state: SandboxState::Reserved,
            }
            .to_json();
            let alloc_key = self.alloc_key(name);
            let mut compares = vec![
                Compare::Lease { key: self.node_key(name), lease: record.lease },
                Compare::ModRevision { key: alloc_key.clone(), rev: alloc.mod_revision },
            ];
            let mut success = vec![Op::Put { key: alloc_key, value: next.to_json(), lease: None }];
            for s in request {
                let key = self.sandbox_key(&s.id);
                compares.push(Compare::Missing { key: key.clone() });
                success.push(Op::Put { key, value: reserved.clone(), lease: None });
            }
            return Ok(Plan {
                node: name.clone(),
                incarnation: record.value.incarnation,
                lease: record.lease,
                advertise: record.value.advertise.clone(),
                entries,
                txn: Txn { compares, success },
            });
        }
        Err(PlanError::NoRoom { skipped })
    }

    /// What node `node`, registered as `incarnation` with `lease`, runs before it creates the sandboxes `ids`
    /// forwarded to it: every one must still be reserved on this very incarnation, and its own record must still
    /// stand; they become `Active`. The node creates them only when this succeeds.
    ///
    /// A node decides from the catalog, not from the answer: when the confirmation fails or gets no answer, it reads
    /// the entries back (an earlier confirmation, held up on its way to etcd, may have been applied since): `Active`
    /// on this incarnation means one of its confirmations was applied, and it creates the sandboxes; still
    /// `Reserved`, it confirms again; anything else, it refuses. That read is unambiguous because a node creates an
    /// id at most once per incarnation: it remembers the ids it took (running or ended), answers a duplicate
    /// forward of them "created" without confirming again, and confirms one request from one task at a time.
    pub fn confirm(&self, node: &str, incarnation: u64, lease: i64, ids: &[String]) -> Result<Txn, RequestError> {
        check_name(node)?;
        check_ids(ids.iter().map(String::as_str))?;
        let reserved = CatalogEntry { node: node.to_owned(), incarnation, state: SandboxState::Reserved }.to_json();
        let active = CatalogEntry { node: node.to_owned(), incarnation, state: SandboxState::Active }.to_json();
        let mut txn = Txn { compares: vec![Compare::Lease { key: self.node_key(node), lease }], success: vec![] };
        for id in ids {
            let key = self.sandbox_key(id);
            txn.compares.push(Compare::Value { key: key.clone(), value: reserved.clone() });
            txn.success.push(Op::Put { key, value: active.clone(), lease: None });
        }
        Ok(txn)
    }

    /// What a placer that gives up on a reservation (the node refused, or did not answer) runs, or a node for a
    /// reservation on itself that nobody forwarded: deletes the sandboxes' catalog entries and takes them out of
    /// the node's alloc, unless the node confirmed them meanwhile ([`Release::Taken`]).
    ///
    /// View: the node's alloc and the catalog entries of `ids`.
    pub fn release_reservation(
        &self,
        view: &View,
        node: &str,
        incarnation: u64,
        ids: &[String],
    ) -> Result<Release, RequestError> {
        check_name(node)?;
        check_ids(ids.iter().map(String::as_str))?;
        let entry =
            |id: &String| view.catalog.get(id).filter(|e| e.value.node == node && e.value.incarnation == incarnation);
        if ids.iter().any(|id| entry(id).is_some_and(|e| e.value.state == SandboxState::Active)) {
            return Ok(Release::Taken);
        }
        let reserved: Vec<(&String, i64)> =
            ids.iter().filter_map(|id| entry(id).map(|e| (id, e.mod_revision))).collect();
        if reserved.is_empty() {
            return Ok(Release::Gone);
        }
        let mut txn = Txn::default();
        for (id, rev) in &reserved {
            let key = self.sandbox_key(id);
            txn.compares.push(Compare::ModRevision { key: key.clone(), rev: *rev });
            txn.success.push(Op::Delete { key });
        }
        let alloc_key = self.alloc_key(node);
        match view.allocs.get(node) {
            Some(alloc) => {
                txn.compares.push(Compare::ModRevision { key: alloc_key.clone(), rev: alloc.mod_revision });
                if alloc.value.incarnation == incarnation {
                    let mut next = alloc.value.clone();
                    next.entries.retain(|e| !reserved.iter().any(|(id, _)| **id == e.id));
                    if next != alloc.value {
                        txn.success.push(Op::Put { key: alloc_key, value: next.to_json(), lease: None });
                    }
                }
            }
            None if !view.malformed.contains_key(&alloc_key) => txn.compares.push(Compare::Missing { key: alloc_key }),
            None => {}
        }
        Ok(Release::Txn(txn))
    }

    /// What node `node` runs once sandbox `id`, which it ran as `incarnation`, has ended and its resources are
    /// free: takes it out of the alloc and deletes its catalog entry if it still names this node; `None` when
    /// neither holds it any more.
    ///
    /// View: the node's alloc and the sandbox's catalog entry.
    pub fn release_sandbox(&self, view: &View, node: &str, incarnation: u64, id: &str) -> Option<Txn> {
        let mut txn = Txn::default();
        let alloc_key = self.alloc_key(node);
        if let Some(alloc) = view.allocs.get(node).filter(|a| a.value.incarnation == incarnation)
            && alloc.value.entry(id).is_some()
        {
            let mut next = alloc.value.clone();
            next.entries.retain(|e| e.id != id);
            txn.compares.push(Compare::ModRevision { key: alloc_key.clone(), rev: alloc.mod_revision });
            txn.success.push(Op::Put { key: alloc_key, value: next.to_json(), lease: None });
        }
        let key = self.sandbox_key(id);
        match view.catalog.get(id) {
            Some(entry) if entry.value.node == node && entry.value.incarnation == incarnation => {
                txn.compares.push(Compare::ModRevision { key: key.clone(), rev: entry.mod_revision });
                txn.success.push(Op::Delete { key });
            }
            Some(_) => {}
            // Deciding to leave the catalog alone rests on its entry being absent: compare that.
            None if !txn.is_empty() && !view.malformed.contains_key(&key) => {
                txn.compares.push(Compare::Missing { key })
            }
            None => {}
        }
        (!txn.is_empty()).then_some(txn)
    }

    /// The sandboxes reserved on this incarnation of `node` and not confirmed: those a node releases itself
    /// ([`Protocol::release_reservation`]) when they stay so for longer than any placer waits, because their
    /// placer is gone.
    ///
    /// View: the node's alloc and the catalog entries of its sandboxes.
    pub fn reservations(&self, view: &View, node: &str, incarnation: u64) -> Vec<String> {
        let Some(alloc) = view.allocs.get(node).filter(|a| a.value.incarnation == incarnation) else { return vec![] };
        alloc
            .value
            .entries
            .iter()
            .filter(|e| view.catalog.get(&e.id).is_some_and(|c| c.value.is(node, incarnation, SandboxState::Reserved)))
            .map(|e| e.id.clone())
            .collect()
    }

    /// Who owns sandbox `id`, as seen from node `this_node`.
    ///
    /// View: the sandbox's catalog entry and the record of the node it names.
    pub fn lookup(&self, view: &View, this_node: &str, id: &str) -> Result<Owner, RecordError> {
        self.owner_in(view, &view.catalog, &self.sandbox_key(id), this_node, id)
    }

    /// Which node holds snapshot `id`, as seen from node `this_node`.
    ///
    /// View: the snapshot's catalog entry and the record of the node it names.
    pub fn lookup_snapshot(&self, view: &View, this_node: &str, id: &str) -> Result<Owner, RecordError> {
        self.owner_in(view, &view.snapshots, &self.snapshot_key(id), this_node, id)
    }

    /// What node `node`, registered as `incarnation` with `lease`, runs when it has taken snapshot `id`: the
    /// snapshot catalog names it, while its record stands.
    pub fn hold_snapshot(&self, node: &str, incarnation: u64, lease: i64, id: &str) -> Result<Txn, RequestError> {
        check_name(node)?;
        check_name(id)?;
        let value = CatalogEntry { node: node.to_owned(), incarnation, state: SandboxState::Active }.to_json();
        Ok(Txn {
            compares: vec![Compare::Lease { key: self.node_key(node), lease }],
            success: vec![Op::Put { key: self.snapshot_key(id), value, lease: None }],
        })
    }

    /// What node `node` runs when snapshot `id`, which it held as `incarnation`, is deleted: deletes its entry if
    /// it still names this incarnation of this node.
    pub fn drop_snapshot(&self, node: &str, incarnation: u64, id: &str) -> Result<Txn, RequestError> {
        check_name(node)?;
        check_name(id)?;
        let key = self.snapshot_key(id);
        let value = CatalogEntry { node: node.to_owned(), incarnation, state: SandboxState::Active }.to_json();
        Ok(Txn { compares: vec![Compare::Value { key: key.clone(), value }], success: vec![Op::Delete { key }] })
    }

    /// The snapshot catalog entries naming an earlier incarnation of `node` (whose snapshots went with it), as
    /// transactions deleting them unless they changed meanwhile.
    ///
    /// View: the snapshot catalog.
    pub fn stale_snapshots(&self, view: &View, node: &str, incarnation: u64) -> Vec<Txn> {
        let stale: Vec<(String, i64)> = view
            .snapshots
            .iter()
            .filter(|(_, e)| e.value.node == node && e.value.incarnation != incarnation)
            .map(|(id, e)| (self.snapshot_key(id), e.mod_revision))
            .collect();
        stale
            .chunks(MAX_TXN_OPS)
            .map(|chunk| Txn {
                compares: chunk.iter().map(|(key, rev)| Compare::ModRevision { key: key.clone(), rev: *rev }).collect(),
                success: chunk.iter().map(|(key, _)| Op::Delete { key: key.clone() }).collect(),
            })
            .collect()
    }

    fn owner_in(
        &self,
        view: &View,
        entries: &std::collections::BTreeMap<String, crate::view::Versioned<CatalogEntry>>,
        key: &str,
        this_node: &str,
        id: &str,
    ) -> Result<Owner, RecordError> {
        if let Some(error) = view.malformed.get(key) {
            return Err(error.clone());
        }
        let Some(entry) = entries.get(id).filter(|e| e.value.state == SandboxState::Active) else {
            return Ok(Owner::Unknown);
        };
        let node = &entry.value.node;
        if let Some(error) = view.malformed.get(&self.node_key(node)) {
            return Err(error.clone());
        }
        Ok(match view.nodes.get(node) {
            Some(record) if record.value.incarnation == entry.value.incarnation => {
                if node == this_node {
                    Owner::Local
                } else {
                    Owner::Remote { advertise: record.value.advertise.clone() }
                }
            }
            _ => Owner::Lost { node: node.clone() },
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

    use super::*;
    use crate::model::Etcd;

    const GIB: u64 = 1 << 30;

    /// A fleet in the etcd model.
    struct Fleet {
        etcd: Etcd,
        p: Protocol,
    }

    impl Fleet {
        fn new() -> Fleet {
            Fleet { etcd: Etcd::new(), p: Protocol::default() }
        }

        fn view(&self) -> View {
            let mut kvs = self.etcd.range(&self.p.nodes_prefix());
            kvs.extend(self.etcd.range(&self.p.allocs_prefix()));
            kvs.extend(self.etcd.range(&self.p.sandboxes_prefix()));
            kvs.extend(self.etcd.range(&self.p.snapshots_prefix()));
            self.p.view(&kvs)
        }

        fn run(&mut self, txn: &Txn) -> bool {
            self.etcd.txn(txn).unwrap()
        }

        /// Registers and cleans up a node; its lease.
        fn node(&mut self, name: &str, incarnation: u64, cpus: u32, slots: u32, memory: u64) -> i64 {
            let lease = self.etcd.grant(10_000);
            let record = NodeRecord {
                name: name.into(),
                advertise: format!("http://{name}:8080"),
                incarnation,
                cpus,
                slots,
                memory,
                draining: false,
            };
            assert!(self.run(&self.p.register(&record, lease).unwrap()));
            let cleanup = self.p.cleanup(&self.view(), name, incarnation, lease, &[]).unwrap();
            for txn in cleanup.alloc.iter().chain(&cleanup.catalog) {
                assert!(self.run(txn));
            }
            assert!(self.p.cleanup(&self.view(), name, incarnation, lease, &[]).unwrap().is_done());
            lease
        }

        fn plan(&self, request: &[SandboxRequest]) -> Result<Plan, PlanError> {
            self.p.plan(&self.view(), request, &BTreeSet::new())
        }

        fn alloc(&self, node: &str) -> Alloc {
            self.view().allocs[node].value.clone()
        }

        fn state(&self, id: &str) -> Option<SandboxState> {
            self.view().catalog.get(id).map(|e| e.value.state)
        }
    }

    #[test]
    fn a_snapshot_is_found_on_its_node_lost_with_it_and_gone_once_dropped() {
        let mut f = Fleet::new();
        let lease = f.node("n1", 1, 2, 1, GIB);
        f.node("n2", 1, 2, 1, GIB);
        assert!(f.run(&f.p.hold_snapshot("n1", 1, lease, "snap_a").unwrap()));
        assert!(f.run(&f.p.hold_snapshot("n1", 1, lease, "snap_b").unwrap()));
        let view = f.view();
        assert_eq!(f.p.lookup_snapshot(&view, "n1", "snap_a").unwrap(), Owner::Local);
        assert_eq!(
            f.p.lookup_snapshot(&view, "n2", "snap_a").unwrap(),
            Owner::Remote { advertise: "http://n1:8080".into() }
        );
        assert_eq!(f.p.lookup_snapshot(&view, "n2", "snap_x").unwrap(), Owner::Unknown);
        // A sandbox id is not a snapshot, nor the other way round.
        assert_eq!(f.p.lookup(&view, "n2", "snap_a").unwrap(), Owner::Unknown);
        // Another incarnation of n1 does not drop what it does not hold.
        assert!(!f.run(&f.p.drop_snapshot("n1", 2, "snap_b").unwrap()));
        assert!(f.run(&f.p.drop_snapshot("n1", 1, "snap_b").unwrap()));
        assert_eq!(f.p.lookup_snapshot(&f.view(), "n2", "snap_b").unwrap(), Owner::Unknown);
        // n1 goes (its lease ends): its snapshot is lost, not unknown; a record of a stale lease cannot hold one.
        f.etcd.revoke(lease).unwrap();
        assert_eq!(f.p.lookup_snapshot(&f.view(), "n2", "snap_a").unwrap(), Owner::Lost { node: "n1".into() });
        assert!(!f.run(&f.p.hold_snapshot("n1", 1, lease, "snap_c").unwrap()));
        // It comes back as incarnation 2 and deletes the entries of incarnation 1.
        f.node("n1", 2, 2, 1, GIB);
        let stale = f.p.stale_snapshots(&f.view(), "n1", 2);
        assert_eq!(stale.len(), 1);
        assert!(f.run(&stale[0]));
        assert_eq!(f.p.lookup_snapshot(&f.view(), "n2", "snap_a").unwrap(), Owner::Unknown);
        assert!(f.p.stale_snapshots(&f.view(), "n1", 2).is_empty());
    }

    fn sandboxes(prefix: &str, count: usize, vcpus: u32, memory: u64) -> Vec<SandboxRequest> {
        (0..count).map(|i| SandboxRequest { id: format!("{prefix}{i}"), vcpus, memory }).collect()
    }

    fn ids(request: &[SandboxRequest]) -> Vec<String> {
        request.iter().map(|s| s.id.clone()).collect()
    }

    #[test]
    fn a_name_registers_once_while_its_record_stands() {
        let mut f = Fleet::new();
        let lease = f.node("a", 1, 2, 1, GIB);
        let other = f.etcd.grant(10_000);
        let record = f.view().nodes["a"].value.clone();
        let again = NodeRecord { incarnation: 2, ..record.clone() };
        assert!(!f.run(&f.p.register(&again, other).unwrap()), "a second process of one name is refused");
        assert!(f.p.is_registered(&f.view(), "a", lease) && !f.p.is_registered(&f.view(), "a", other));
        let draining = NodeRecord { draining: true, ..record };
        assert!(!f.run(&f.p.update(&draining, other).unwrap()));
        assert!(f.run(&f.p.update(&draining, lease).unwrap()));
        assert_eq!(
            f.plan(&sandboxes("s", 1, 1, 1)),
            Err(PlanError::NoRoom { skipped: vec![Skipped { node: "a".into(), why: Skip::Draining }] })
        );
        f.etcd.revoke(lease).unwrap();
        assert!(f.run(&f.p.register(&again, other).unwrap()), "once the old lease is gone, it registers");
        let bad = NodeRecord { name: "a/b".into(), ..again };
        assert_eq!(f.p.register(&bad, other), Err(RequestError::BadName { name: "a/b".into() }));
    }

    #[test]
    fn plan_takes_the_first_node_by_name_with_room_for_the_whole_request() {
        let mut f = Fleet::new();
        f.node("c", 1, 4, 1, 8 * GIB);
        f.node("b", 1, 1, 4, 8 * GIB);
        f.node("a", 1, 2, 1, GIB);
        let view = f.view();
        // "a" is too small in memory, "b" too narrow for 2 vCPUs: "c", on its CPUs 0 and 1.
        let plan = f.plan(&sandboxes("s", 1, 2, 2 * GIB)).unwrap();
        assert_eq!((plan.node.as_str(), plan.entries[0].cpus.clone()), ("c", vec![0, 1]));
        assert_eq!(plan.advertise, "http://c:8080");
        // A fork of three 1-vCPU sandboxes fits "b" (1 CPU × 4 slots) whole.
        let fork = sandboxes("f", 3, 1, GIB);
        let plan = f.plan(&fork).unwrap();
        assert_eq!(plan.node, "b");
        assert_eq!(plan.entries.iter().map(|e| e.cpus.clone()).collect::<Vec<_>>(), vec![vec![0]; 3]);
        assert_eq!(plan.ids(), ids(&fork));
        // Excluding "b" moves it to "c"; excluding both leaves nothing, and says why.
        let exclude: BTreeSet<String> = ["b".to_owned()].into();
        assert_eq!(f.p.plan(&view, &fork, &exclude).unwrap().node, "c");
        let exclude: BTreeSet<String> = ["b".to_owned(), "c".to_owned()].into();
        let err = f.p.plan(&view, &fork, &exclude).unwrap_err();
        assert_eq!(
            err,
            PlanError::NoRoom {
                skipped: vec![
                    Skipped { node: "a".into(), why: Skip::Cpu },
                    Skipped { node: "b".into(), why: Skip::Excluded },
                    Skipped { node: "c".into(), why: Skip::Excluded },
                ]
            }
        );
        assert_eq!(err.to_string(), "no node can take the request (a: Cpu, b: Excluded, c: Excluded)");
        // A fork that fits no single node is not split across nodes.
        assert!(matches!(f.plan(&sandboxes("g", 5, 1, GIB)), Err(PlanError::NoRoom { .. })));
    }

    #[test]
    fn plan_refuses_what_no_transaction_could_hold() {
        let mut f = Fleet::new();
        f.node("a", 1, 1, 0, u64::MAX);
        assert_eq!(f.plan(&[]), Err(PlanError::Request(RequestError::Empty)));
        let huge = sandboxes("s", MAX_REQUEST + 1, 1, 0);
        assert_eq!(f.plan(&huge), Err(PlanError::Request(RequestError::TooLarge { count: 127, max: 126 })));
        let most = f.plan(&sandboxes("s", MAX_REQUEST, 1, 1)).unwrap();
        assert!(f.run(&most.txn), "the largest request fits one etcd transaction");
        let twice = [sandboxes("s", 1, 1, 0), sandboxes("s", 1, 1, 0)].concat();
        assert_eq!(f.plan(&twice), Err(PlanError::Request(RequestError::Duplicate { id: "s0".into() })));
        assert_eq!(
            f.plan(&sandboxes("x/", 1, 1, 0)),
            Err(PlanError::Request(RequestError::BadName { name: "x/0".into() }))
        );
        assert_eq!(f.plan(&sandboxes("s", 1, 1, 0)), Err(PlanError::IdTaken { id: "s0".into(), node: "a".into() }));
        // Memory sums do not wrap.
        let big = [SandboxRequest { id: "m".into(), vcpus: 1, memory: u64::MAX }];
        assert!(matches!(f.plan(&big), Err(PlanError::NoRoom { .. })));
    }

    #[test]
    fn a_node_not_cleaned_up_or_inconsistent_takes_nothing() {
        let mut f = Fleet::new();
        let lease = f.etcd.grant(10_000);
        let record = NodeRecord {
            name: "a".into(),
            advertise: String::new(),
            incarnation: 2,
            cpus: 2,
            slots: 1,
            memory: GIB,
            draining: false,
        };
        assert!(f.run(&f.p.register(&record, lease).unwrap()));
        let request = sandboxes("s", 1, 1, 1);
        let skipped = |why| PlanError::NoRoom { skipped: vec![Skipped { node: "a".into(), why }] };
        assert_eq!(f.plan(&request), Err(skipped(Skip::NotCleanedUp)), "no alloc yet");
        let key = f.p.alloc_key("a");
        f.etcd.put(&key, &Alloc { incarnation: 1, entries: vec![] }.to_json(), None).unwrap();
        assert_eq!(f.plan(&request), Err(skipped(Skip::NotCleanedUp)), "an older incarnation's alloc");
        let wrong = AllocEntry { id: "x".into(), vcpus: 1, memory: 0, cpus: vec![5] };
        f.etcd.put(&key, &Alloc { incarnation: 2, entries: vec![wrong] }.to_json(), None).unwrap();
        assert_eq!(f.plan(&request), Err(skipped(Skip::Malformed)), "an entry on a CPU the node lacks");
        f.etcd.put(&key, b"{not json", None).unwrap();
        assert_eq!(f.plan(&request), Err(skipped(Skip::Malformed)));
        assert!(matches!(f.view().malformed[&key], RecordError::Json { .. }));
    }

    #[test]
    fn the_fencing_revision_lets_one_of_two_concurrent_placers_through() {
        let mut f = Fleet::new();
        f.node("a", 1, 2, 1, GIB);
        let first = f.plan(&sandboxes("p", 1, 2, 0)).unwrap();
        let second = f.plan(&sandboxes("q", 1, 2, 0)).unwrap();
        assert_eq!((first.node.as_str(), second.node.as_str()), ("a", "a"), "both read a free node");
        assert!(f.run(&first.txn));
        assert!(!f.run(&second.txn), "the alloc changed since the second placer read it");
        assert_eq!(f.state("q0"), None);
        assert!(matches!(f.plan(&sandboxes("q", 1, 2, 0)), Err(PlanError::NoRoom { .. })), "re-planned: full");
        assert_eq!(f.alloc("a").entries, first.entries);
        assert_eq!(f.state("p0"), Some(SandboxState::Reserved));
        // A reservation on an incarnation whose lease is gone is refused.
        let mut f = Fleet::new();
        let lease = f.node("a", 1, 2, 1, GIB);
        let plan = f.plan(&sandboxes("p", 1, 1, 0)).unwrap();
        f.etcd.revoke(lease).unwrap();
        assert!(!f.run(&plan.txn));
    }

    #[test]
    fn confirm_takes_a_reservation_only_on_its_own_live_incarnation() {
        let mut f = Fleet::new();
        let lease = f.node("a", 1, 4, 1, GIB);
        let plan = f.plan(&sandboxes("s", 2, 1, 0)).unwrap();
        assert!(f.run(&plan.txn));
        let ids = plan.ids();
        assert!(!f.run(&f.p.confirm("a", 2, lease, &ids).unwrap()), "another incarnation");
        assert!(!f.run(&f.p.confirm("a", 1, lease + 1, &ids).unwrap()), "another lease");
        assert!(!f.run(&f.p.confirm("b", 1, lease, &ids).unwrap()), "another node");
        assert!(f.run(&f.p.confirm("a", 1, lease, &ids).unwrap()));
        assert_eq!((f.state("s0"), f.state("s1")), (Some(SandboxState::Active), Some(SandboxState::Active)));
        assert!(!f.run(&f.p.confirm("a", 1, lease, &ids).unwrap()), "a duplicate forward confirms nothing");
        assert_eq!(f.p.confirm("a", 1, lease, &[]), Err(RequestError::Empty));
        // The placer that timed out and comes to release finds the node took them.
        assert_eq!(f.p.release_reservation(&f.view(), "a", 1, &ids), Ok(Release::Taken));
    }

    #[test]
    fn a_released_reservation_cannot_be_confirmed_and_frees_its_room() {
        let mut f = Fleet::new();
        let lease = f.node("a", 1, 2, 1, GIB);
        f.node("b", 1, 2, 1, GIB);
        let plan = f.plan(&sandboxes("s", 1, 2, 0)).unwrap();
        assert!(f.run(&plan.txn));
        let other = f.plan(&sandboxes("o", 1, 1, 0)).unwrap();
        assert_eq!(other.node, "b");
        assert!(f.run(&other.txn));
        let ids = plan.ids();
        let Release::Txn(release) = f.p.release_reservation(&f.view(), "a", 1, &ids).unwrap() else { panic!() };
        // Someone else's placement on "a" meanwhile moves the fencing revision: read again.
        let third = f.plan(&[SandboxRequest { id: "t".into(), vcpus: 0, memory: 0 }]).unwrap();
        assert_eq!(third.node, "a");
        assert!(f.run(&third.txn));
        assert!(!f.run(&release));
        let Release::Txn(release) = f.p.release_reservation(&f.view(), "a", 1, &ids).unwrap() else { panic!() };
        assert!(f.run(&release));
        assert_eq!(f.state("s0"), None);
        assert_eq!(f.alloc("a").entries, third.entries);
        assert!(!f.run(&f.p.confirm("a", 1, lease, &ids).unwrap()), "released: the node refuses it");
        assert_eq!(f.p.release_reservation(&f.view(), "a", 1, &ids), Ok(Release::Gone));
        assert_eq!(f.plan(&sandboxes("s", 1, 2, 0)).unwrap().node, "a", "the room is free again");
    }

    #[test]
    fn an_ended_sandbox_leaves_the_alloc_and_the_catalog() {
        let mut f = Fleet::new();
        let lease = f.node("a", 1, 1, 2, GIB);
        let plan = f.plan(&sandboxes("s", 2, 1, GIB / 2)).unwrap();
        assert!(f.run(&plan.txn));
        assert!(f.run(&f.p.confirm("a", 1, lease, &plan.ids()).unwrap()));
        let view = f.view();
        let txn = f.p.release_sandbox(&view, "a", 1, "s0").unwrap();
        let other = f.p.release_sandbox(&view, "a", 1, "s1").unwrap();
        assert!(f.run(&txn));
        assert!(!f.run(&other), "the alloc changed: read again");
        assert!(f.run(&f.p.release_sandbox(&f.view(), "a", 1, "s1").unwrap()));
        assert_eq!((f.alloc("a").entries, f.state("s0"), f.state("s1")), (vec![], None, None));
        assert_eq!(f.p.release_sandbox(&f.view(), "a", 1, "s1"), None, "nothing left to release");
        // Releasing without having read the catalog entry compares its absence, and so fails rather than leaking it.
        let plan = f.plan(&sandboxes("t", 1, 1, 0)).unwrap();
        assert!(f.run(&plan.txn));
        let mut partial = f.view();
        partial.catalog.clear();
        assert!(!f.run(&f.p.release_sandbox(&partial, "a", 1, "t0").unwrap()));
    }

    #[test]
    fn cleanup_rewrites_the_alloc_and_deletes_the_old_incarnations_catalog_in_batches() {
        let mut f = Fleet::new();
        let lease = f.node("a", 1, 1, 0, u64::MAX);
        let placed: Vec<String> = (0..3)
            .flat_map(|round| {
                let plan = f.plan(&sandboxes(&format!("r{round}-"), MAX_REQUEST, 1, 1)).unwrap();
                assert!(f.run(&plan.txn));
                plan.ids()
            })
            .collect();
        let kept = f.alloc("a").entries[0].clone();
        // The node restarts as incarnation 2 and keeps running one sandbox.
        f.etcd.revoke(lease).unwrap();
        let lease = f.etcd.grant(10_000);
        let record =
            NodeRecord { incarnation: 2, ..f.view().nodes.get("a").map_or_else(|| record("a"), |r| r.value.clone()) };
        assert!(f.run(&f.p.register(&record, lease).unwrap()));
        assert!(matches!(f.plan(&sandboxes("x", 1, 1, 1)), Err(PlanError::NoRoom { .. })), "not cleaned up yet");
        let cleanup = f.p.cleanup(&f.view(), "a", 2, lease, std::slice::from_ref(&kept)).unwrap();
        let old = placed.len() - 1;
        assert_eq!(cleanup.catalog.len(), old.div_ceil(MAX_TXN_OPS));
        assert!(f.run(cleanup.alloc.as_ref().unwrap()));
        assert_eq!(f.alloc("a"), Alloc { incarnation: 2, entries: vec![kept.clone()] });
        // A placement between the two steps: its reservation belongs to incarnation 2 and is left alone.
        let plan = f.plan(&sandboxes("new", 1, 1, 1)).unwrap();
        assert!(f.run(&plan.txn));
        for txn in &cleanup.catalog {
            assert!(f.run(txn));
        }
        assert!(f.p.cleanup(&f.view(), "a", 2, lease, std::slice::from_ref(&kept)).unwrap().is_done());
        let catalog: Vec<String> = f.view().catalog.keys().cloned().collect();
        assert_eq!(catalog, vec!["new0".to_owned(), kept.id.clone()]);
        // A stale process (another lease) cannot rewrite the alloc.
        let zombie = f.p.cleanup(&f.view(), "a", 3, lease + 100, &[]).unwrap();
        assert!(!f.run(zombie.alloc.as_ref().unwrap()));
    }

    fn record(name: &str) -> NodeRecord {
        NodeRecord {
            name: name.into(),
            advertise: format!("http://{name}:8080"),
            incarnation: 1,
            cpus: 1,
            slots: 0,
            memory: u64::MAX,
            draining: false,
        }
    }

    #[test]
    fn a_node_releases_reservations_nobody_forwarded() {
        let mut f = Fleet::new();
        let lease = f.node("a", 1, 2, 1, GIB);
        let taken = f.plan(&sandboxes("t", 1, 1, 0)).unwrap();
        assert!(f.run(&taken.txn));
        assert!(f.run(&f.p.confirm("a", 1, lease, &taken.ids()).unwrap()));
        let orphan = f.plan(&sandboxes("o", 1, 1, 0)).unwrap();
        assert!(f.run(&orphan.txn));
        let reserved = f.p.reservations(&f.view(), "a", 1);
        assert_eq!(reserved, orphan.ids());
        let Release::Txn(txn) = f.p.release_reservation(&f.view(), "a", 1, &reserved).unwrap() else { panic!() };
        assert!(f.run(&txn));
        assert_eq!(f.alloc("a").entries, taken.entries);
        assert!(f.p.reservations(&f.view(), "a", 1).is_empty());
    }

    #[test]
    fn lookup_tells_local_remote_lost_and_unknown() {
        let mut f = Fleet::new();
        let la = f.node("a", 1, 1, 0, u64::MAX);
        let lb = f.node("b", 1, 1, 0, u64::MAX);
        let exclude = |n: &str| -> BTreeSet<String> { [n.to_owned()].into() };
        for (id, node, lease, skip) in [("x", "a", la, "b"), ("y", "b", lb, "a")] {
            let plan = f.p.plan(&f.view(), &sandboxes(id, 1, 1, 0), &exclude(skip)).unwrap();
            assert_eq!(plan.node, node);
            assert!(f.run(&plan.txn));
            assert_eq!(f.p.lookup(&f.view(), "a", &format!("{id}0")), Ok(Owner::Unknown), "only reserved");
            assert!(f.run(&f.p.confirm(node, 1, lease, &plan.ids()).unwrap()));
        }
        let view = f.view();
        assert_eq!(f.p.lookup(&view, "a", "x0"), Ok(Owner::Local));
        assert_eq!(f.p.lookup(&view, "a", "y0"), Ok(Owner::Remote { advertise: "http://b:8080".into() }));
        assert_eq!(f.p.lookup(&view, "b", "x0"), Ok(Owner::Remote { advertise: "http://a:8080".into() }));
        assert_eq!(f.p.lookup(&view, "a", "z"), Ok(Owner::Unknown));
        assert_eq!(f.p.lookup(&view, "a", "bad/id"), Ok(Owner::Unknown));
        // b's lease expires: its sandboxes are lost; b registers again as another incarnation: still lost, until
        // its cleanup deletes their entries.
        f.etcd.revoke(lb).unwrap();
        assert_eq!(f.p.lookup(&f.view(), "a", "y0"), Ok(Owner::Lost { node: "b".into() }));
        let lb = f.etcd.grant(10_000);
        assert!(f.run(&f.p.register(&NodeRecord { incarnation: 2, ..record("b") }, lb).unwrap()));
        assert_eq!(f.p.lookup(&f.view(), "a", "y0"), Ok(Owner::Lost { node: "b".into() }));
        let cleanup = f.p.cleanup(&f.view(), "b", 2, lb, &[]).unwrap();
        for txn in cleanup.alloc.iter().chain(&cleanup.catalog) {
            assert!(f.run(txn));
        }
        assert_eq!(f.p.lookup(&f.view(), "a", "y0"), Ok(Owner::Unknown));
        let key = f.p.sandbox_key("x0");
        f.etcd.put(&key, b"[1,2]", None).unwrap();
        assert!(matches!(f.p.lookup(&f.view(), "a", "x0"), Err(RecordError::Json { .. })));
    }

    #[test]
    fn keys_live_under_the_prefix() {
        let p = Protocol::new("/fleet");
        assert_eq!(p.prefix(), "/fleet/");
        assert_eq!(p.node_key("n"), "/fleet/nodes/n");
        assert_eq!(p.alloc_key("n"), "/fleet/alloc/n");
        assert_eq!(p.sandbox_key("s"), "/fleet/sandboxes/s");
        assert_eq!(Protocol::default().nodes_prefix(), "/strata/nodes/");
    }
}
