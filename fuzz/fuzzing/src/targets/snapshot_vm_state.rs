//! The microVM tier's snapshot state (`tiers/microvm/vmm/src/persist.rs`): the `vmstate` file (magic, version, body
//! length, a JSON body of vCPU, interrupt controller, clock and device state) that a restore turns into KVM calls,
//! read through a sealed snapshot as a fork reads it.
//!
//! Input: the state file's bytes (a seed is a real state; mutations reach the header, the JSON and every count),
//! and the memory file's size as the last four bytes (at most 64 MiB, sparse).
//!
//! Oracles: parsing never panics; a state it accepts passes [`MicrovmState::validate`] and survives a round trip
//! through its bytes unchanged; a snapshot whose state it accepts has a memory file of the state's size.

use strata_core::{Persisted, SnapshotKey, SnapshotTrust, TierKind};
use strata_tier_microvm::persist::{MEMORY_FILE, MicrovmState, STATE_FILE};
use strata_tier_microvm::snapshot::VmSnapshot;

use crate::targets::snapshot_open::scratch;

/// Parses `data` as a state file, alone and inside a sealed snapshot.
pub fn run(data: &[u8]) {
    let path = std::path::Path::new("vmstate");
    if let Ok(state) = MicrovmState::from_bytes(data, path) {
        state.validate().expect("an accepted state validates");
        let bytes = state.to_bytes().expect("an accepted state encodes");
        assert_eq!(MicrovmState::from_bytes(&bytes, path).expect("its bytes parse again"), state);
    }
    let (state, size) = match data.len().checked_sub(4) {
        Some(at) => {
            let (state, size) = data.split_at(at);
            (state, u64::from(u32::from_le_bytes(size.try_into().unwrap_or([0; 4]))) % (64 << 20))
        }
        None => (data, 0),
    };
    let root = scratch("vm-snapshot");
    let trust = SnapshotTrust::new(SnapshotKey::from_bytes([0x33; 32]));
    let writer = trust.writer(&root.join("snap")).expect("a writer");
    std::fs::write(writer.dir().join(STATE_FILE), state).expect("state");
    std::fs::File::create(writer.dir().join(MEMORY_FILE)).and_then(|f| f.set_len(size)).expect("memory");
    let committed = writer.commit(TierKind::Microvm, None, vec![Persisted::Memory], serde_json::json!({}));
    if let Ok(vm) = committed.map_err(drop).and_then(|snapshot| VmSnapshot::from_verified(snapshot).map_err(drop)) {
        assert_eq!(vm.state().memory_bytes, size, "a state accepted beside a memory file of another size");
    }
    let _ = std::fs::remove_dir_all(&root);
}
