//! The wasm tier's snapshot loader, for the fuzz targets (`fuzz/`): what a fork reads from a verified snapshot
//! before the interpreter starts — `state.json` and its checks, the memory image it maps and the scratch `/tmp`
//! it copies. Not an API.

use super::*;

/// Loads what a fork of `snapshot` would, short of starting the interpreter: its state (checked), then for a
/// Python state the memory image and the scratch copy. The size of the image mapped, when there is one.
pub fn load(snapshot: &Snapshot) -> Result<Option<u64>, TierError> {
    let state = SandboxState::read(snapshot)?;
    let Some(python) = &state.python else { return Ok(None) };
    let memory = open_memory(snapshot, python.memory_bytes)?;
    if python.scratch {
        drop(restore_scratch(snapshot)?);
    }
    Ok(Some(memory.len() as u64))
}
