//! The wasm tier's snapshot loader (`tiers/wasm/src/snapshot.rs`): what a fork reads from a snapshot before any
//! guest code runs — `state.json` (capabilities, limits, the interpreter's globals and memory size), the memory
//! image it maps and the scratch `/tmp` it copies. The snapshot is sealed (as the host seals its own), so this is
//! the tier's parsing of content that passed the store's checks.
//!
//! Input: a `state.json` block, the memory image's size (four bytes, at most 8 MiB, sparse), a count of scratch
//! entries (at most 8), each a name block and a contents block (an empty contents block makes a directory).
//!
//! Oracles: the loader never panics; a state it accepts that has an interpreter names a memory size that is the
//! memory file's and a whole number of wasm pages, and the image it maps is that size.

use strata_core::{SnapshotKey, SnapshotTrust, TierKind};
use strata_tier_wasm::snapshot_fuzzing::load;

use crate::generate::Cursor;
use crate::targets::snapshot_open::scratch;

/// Loads the snapshot `data` describes.
pub fn run(data: &[u8]) {
    let mut input = Cursor::new(data);
    let state = input.block().to_vec();
    let memory = u64::from(input.u32()) % (8 << 20);
    let root = scratch("wasm-snapshot");
    let trust = SnapshotTrust::new(SnapshotKey::from_bytes([0x77; 32]));
    let writer = trust.writer(&root.join("snap")).expect("a writer");
    std::fs::write(writer.dir().join("state.json"), &state).expect("state");
    std::fs::File::create(writer.dir().join("memory.img")).and_then(|f| f.set_len(memory)).expect("memory");
    for _ in 0..input.u8() % 9 {
        let name = String::from_utf8_lossy(input.block()).replace(['/', '\0'], "_");
        let contents = input.block();
        if name.is_empty() || name == "." || name == ".." {
            continue;
        }
        let path = writer.dir().join("tmp").join(&name);
        let _ = std::fs::create_dir_all(writer.dir().join("tmp"));
        let _ = if contents.is_empty() { std::fs::create_dir_all(&path) } else { std::fs::write(&path, contents) };
    }
    let Ok(snapshot) = writer.commit(TierKind::Wasm, None, Vec::new(), serde_json::json!({})) else {
        let _ = std::fs::remove_dir_all(&root);
        return;
    };
    if let Ok(Some(mapped)) = load(&snapshot) {
        assert_eq!(mapped, memory, "the image mapped is not the memory file's size");
        assert_eq!(mapped % 65536, 0, "a memory of {mapped} bytes is not whole wasm pages");
    }
    let _ = std::fs::remove_dir_all(&root);
}
