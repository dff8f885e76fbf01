//! A snapshot received from another node of a fleet (`engine/serve/src/fleet/snapshots.rs`): the manifest it sent,
//! parsed against this node's bounds before anything is fetched (`Manifest::parse_received`), and the files it
//! sent, sealed here only if they are exactly what that manifest lists (`SnapshotWriter::commit_copy`).
//!
//! Input: a flags byte (bit 0: the manifest is the input's bytes rather than a real one's after edits; bit 1:
//! send the files the input gives rather than the real ones), up to 4 files (a name block and a contents block)
//! making the real snapshot, edits to its manifest (offset and byte pairs), then up to 4 files sent (a name block
//! and a contents block).
//!
//! Oracles: nothing panics; a copy is sealed only when every file sent has the size and sha256 the received
//! manifest lists and none is missing or extra; the copy opens under this node's key; a real manifest sent with
//! its real files is always accepted.

use std::path::{Component, Path};

use sha2::{Digest, Sha256};
use strata_core::snapshot::Manifest;
use strata_core::{Persisted, SnapshotBounds, SnapshotKey, SnapshotTrust, TierKind};

use crate::generate::Cursor;

/// Small bounds: the target explores the checks, not the disk.
fn bounds() -> SnapshotBounds {
    SnapshotBounds { max_files: 8, max_dirs: 8, max_depth: 4, max_file_bytes: 1 << 16, max_total_bytes: 1 << 18 }
}

fn trust(key: u8) -> SnapshotTrust {
    SnapshotTrust::new(SnapshotKey::from_bytes([key; 32])).with_bounds(bounds())
}

/// A name below a snapshot directory, if `raw` is a plain relative one.
fn plain(raw: &[u8]) -> Option<String> {
    let name = std::str::from_utf8(raw).ok()?;
    let ok = !name.is_empty()
        && name.len() < 64
        && !name.contains(['\0', '\\'])
        && name.split('/').all(|c| !c.is_empty() && c != "." && c != "..")
        && Path::new(name).components().all(|c| matches!(c, Component::Normal(_)))
        && name != "manifest.json"
        && name != "manifest.seal";
    ok.then(|| name.to_owned())
}

/// Writes `files` below `dir`; `false` when one cannot be (a name that is another's directory, say).
fn write_all(dir: &Path, files: &[(String, Vec<u8>)]) -> bool {
    files.iter().all(|(name, bytes)| {
        let path = dir.join(name);
        path.parent().is_some_and(|p| std::fs::create_dir_all(p).is_ok()) && std::fs::write(&path, bytes).is_ok()
    })
}

fn files(input: &mut Cursor<'_>) -> Vec<(String, Vec<u8>)> {
    let count = input.u8() % 5;
    let mut out: Vec<(String, Vec<u8>)> = Vec::new();
    for _ in 0..count {
        let name = plain(input.block());
        let bytes = input.block().to_vec();
        if let Some(name) = name.filter(|n| !out.iter().any(|(m, _)| m == n)) {
            out.push((name, bytes));
        }
    }
    out
}

/// Feeds one transfer.
pub fn run(data: &[u8]) {
    let _ = transfer(data);
}

/// One transfer: `Some(true)` when the copy was sealed, `Some(false)` when it was refused, `None` when the input
/// made no transfer (its real snapshot could not be made, or the manifest was refused first).
pub fn transfer(data: &[u8]) -> Option<bool> {
    let mut input = Cursor::new(data);
    let flags = input.u8();
    let real = files(&mut input);
    let root = crate::scratch::fresh("snapshot-transfer");
    let sender = trust(1);
    let writer = sender.writer(&root.join("source")).ok()?;
    if !write_all(writer.dir(), &real) {
        return None;
    }
    let source = writer.commit(TierKind::Wasm, None, vec![Persisted::Memory], serde_json::json!({"k": 1})).ok()?;
    let mut sent_manifest = source.manifest.to_json();
    let edited = if flags & 1 == 1 {
        sent_manifest = input.block().to_vec();
        true
    } else {
        let edits = input.u8() % 8;
        for _ in 0..edits {
            let (at, byte) = (usize::from(input.u16()), input.u8());
            if let Some(slot) = sent_manifest.get_mut(at) {
                *slot = byte;
            }
        }
        edits > 0
    };
    let sent_files = if flags & 2 == 2 { files(&mut input) } else { real.clone() };
    let Ok(manifest) = Manifest::parse_received(Path::new("peer"), &sent_manifest, &bounds()) else {
        assert!(edited, "a real manifest is accepted");
        return None;
    };
    let receiver = trust(2);
    let writer = receiver.writer(&root.join("copy")).ok()?;
    if !write_all(writer.dir(), &sent_files) {
        return None;
    }
    let sealed = match writer.commit_copy(&manifest) {
        Ok(copy) => {
            let mut listed = manifest.files.clone();
            listed.sort_by(|a, b| a.path.cmp(&b.path));
            assert_eq!(copy.manifest.files, listed, "the copy lists exactly the received manifest's files");
            assert_eq!(sent_files.len(), listed.len(), "no file sent is missing or extra");
            for file in &listed {
                let (_, bytes) = sent_files.iter().find(|(n, _)| *n == file.path).expect("every listed file was sent");
                assert_eq!(bytes.len() as u64, file.size);
                assert_eq!(hex(&Sha256::digest(bytes)), file.sha256, "{}", file.path);
            }
            receiver.open(&root.join("copy")).expect("the copy opens under this node's key");
            true
        }
        Err(err) => {
            assert!(edited || flags & 2 == 2, "a real snapshot sent whole is accepted: {err}");
            false
        }
    };
    let _ = std::fs::remove_dir_all(&root);
    Some(sealed)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_seeds_reach_the_copy_both_ways() {
        let seeds: std::collections::BTreeMap<String, Vec<u8>> =
            crate::seeds::of("snapshot_transfer").into_iter().collect();
        assert_eq!(super::transfer(&seeds["seed-whole"]), Some(true));
        assert_eq!(super::transfer(&seeds["seed-altered"]), Some(false));
        assert_eq!(super::transfer(&seeds["seed-missing"]), Some(false));
    }
}
