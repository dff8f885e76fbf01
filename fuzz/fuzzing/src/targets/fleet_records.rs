//! The fleet's keys as read from etcd (`engine/fleet`): values another node wrote — or anything that can write to
//! etcd — parsed into a view and decided on by the protocol, as every node does before it places, confirms,
//! releases, cleans up or looks a sandbox up.
//!
//! Input: up to 32 key-values, each a kind byte (node record, alloc, catalog entry, snapshot entry, or a key outside
//! the fleet),
//! a name block, a value block, a mod revision and a lease; then a request (count and sizes) and a sandbox id.
//!
//! Oracles: parsing never panics and a malformed value lands in `malformed`, never in the view; a plan names a
//! node of the view that is registered, not draining, cleaned up and not excluded, holds as many entries as
//! the request, with distinct CPUs per entry, and a transaction within etcd's operation limit that compares the
//! node's lease and its alloc's revision; a lookup never names an owner the view does not hold; cleanup,
//! release and the reservation sweep build transactions within the limit.

use std::collections::BTreeSet;

use strata_fleet::{Compare, KeyValue, MAX_TXN_OPS, Owner, PlanError, Protocol, SandboxRequest};

use crate::generate::Cursor;

/// Feeds one set of key-values and one request.
pub fn run(data: &[u8]) {
    let protocol = Protocol::default();
    let mut input = Cursor::new(data);
    let mut kvs = Vec::new();
    let count = input.u8() % 33;
    for revision in 0..i64::from(count) {
        let kind = input.u8() % 5;
        let name = String::from_utf8_lossy(input.block()).into_owned();
        let value = input.block().to_vec();
        let key = match kind {
            0 => protocol.node_key(&name),
            1 => protocol.alloc_key(&name),
            2 => protocol.sandbox_key(&name),
            3 => protocol.snapshot_key(&name),
            _ => format!("/elsewhere/{name}"),
        };
        let lease = i64::from(input.u8());
        kvs.push(KeyValue { key, value, create_revision: 1, mod_revision: revision + 1, version: 1, lease });
    }
    let view = protocol.view(&kvs);
    for name in view.malformed.keys() {
        assert!(name.starts_with(protocol.prefix()), "only the fleet's keys are parsed: {name}");
    }

    let sandboxes = usize::from(input.u8() % 4) + 1;
    let request: Vec<SandboxRequest> = (0..sandboxes)
        .map(|i| SandboxRequest {
            id: format!("sb_fuzz{i}"),
            vcpus: u32::from(input.u8() % 5),
            memory: u64::from(input.u32()),
        })
        .collect();
    let exclude: BTreeSet<String> = view.nodes.keys().filter(|_| input.u8() & 1 == 1).cloned().collect();
    match protocol.plan(&view, &request, &exclude) {
        Ok(plan) => {
            let record = view.nodes.get(&plan.node).expect("a plan names a node of the view");
            assert!(!record.value.draining && !exclude.contains(&plan.node), "{plan:?}");
            let alloc = view.allocs.get(&plan.node).expect("a node placed on is cleaned up");
            assert_eq!(alloc.value.incarnation, record.value.incarnation);
            assert_eq!(plan.entries.len(), request.len());
            for entry in &plan.entries {
                let distinct: BTreeSet<u32> = entry.cpus.iter().copied().collect();
                assert_eq!(distinct.len(), entry.cpus.len(), "one slot on each of distinct CPUs: {entry:?}");
            }
            assert!(plan.txn.success.len() <= MAX_TXN_OPS && plan.txn.compares.len() <= MAX_TXN_OPS);
            let fenced = plan.txn.compares.iter().any(|c| {
                matches!(c, Compare::ModRevision { key, rev } if *key == protocol.alloc_key(&plan.node)
                    && *rev == alloc.mod_revision)
            });
            let leased = plan.txn.compares.iter().any(
                |c| matches!(c, Compare::Lease { key, lease } if *key == protocol.node_key(&plan.node) && *lease == record.lease),
            );
            assert!(fenced && leased, "a reservation compares the fencing revision and the lease: {:?}", plan.txn);
        }
        Err(PlanError::NoRoom { .. } | PlanError::IdTaken { .. } | PlanError::Request(_)) => {}
    }

    let id = String::from_utf8_lossy(input.block()).into_owned();
    let this = view.nodes.keys().next().cloned().unwrap_or_else(|| "n1".to_owned());
    if let Ok(owner) = protocol.lookup(&view, &this, &id) {
        match owner {
            Owner::Remote { advertise } => {
                assert!(view.nodes.values().any(|n| n.value.advertise == advertise), "an owner of the view")
            }
            Owner::Local | Owner::Lost { .. } | Owner::Unknown => {}
        }
    }
    if let Ok(Owner::Remote { advertise }) = protocol.lookup_snapshot(&view, &this, &id) {
        assert!(view.nodes.values().any(|n| n.value.advertise == advertise), "a holder of the view");
    }
    let incarnation = view.nodes.get(&this).map_or(1, |n| n.value.incarnation);
    for txn in protocol.stale_snapshots(&view, &this, incarnation + 1) {
        assert!(txn.success.len() <= MAX_TXN_OPS && txn.compares.len() == txn.success.len());
    }
    if let Ok(cleanup) = protocol.cleanup(&view, &this, incarnation + 1, 7, &[]) {
        for txn in cleanup.alloc.iter().chain(&cleanup.catalog) {
            assert!(txn.success.len() <= MAX_TXN_OPS, "{} ops", txn.success.len());
        }
    }
    if let Some(txn) = protocol.release_sandbox(&view, &this, incarnation, &id) {
        assert!(txn.success.len() <= MAX_TXN_OPS);
    }
    let _ = protocol.reservations(&view, &this, incarnation);
    let _ = protocol.release_reservation(&view, &this, incarnation, std::slice::from_ref(&id));
}
