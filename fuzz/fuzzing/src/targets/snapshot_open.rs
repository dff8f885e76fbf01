//! The snapshot store's open path (`engine/core/src/snapshot.rs`): a snapshot directory as anyone who can write
//! where snapshots live may leave it — a manifest and seal of their choosing, or a manifest sealed with the key
//! (what only the host can make) over files, directories, links, FIFOs and sparse files that disagree with it.
//!
//! Input: a flags byte (bit 0: seal the manifest with the fixed key, else the seal file is the input's; bit 1: the
//! manifest lists the regular entries truthfully before the input's edits, else it is the input's bytes), an
//! entry count (at most 16), each entry a kind byte (file, directory, link, FIFO, sparse file), a name block and a
//! contents block (a link's target; a sparse file's size is the block's first four bytes), then the seal block
//! and the manifest block or edits (offset, byte pairs).
//!
//! Oracles: opening never panics, never blocks (a FIFO is refused, not read) and stays within the bounds; it
//! succeeds only under the key's seal, and then every listed file is a regular file of its listed size and sha256,
//! nothing unlisted is there, and re-opening gives the same snapshot.

use std::os::unix::fs::symlink;
use std::path::{Component, Path, PathBuf};

use sha2::{Digest, Sha256};
use strata_core::snapshot::{SEAL, test_utils};
use strata_core::{SnapshotBounds, SnapshotKey, SnapshotTrust};

use crate::generate::Cursor;

/// The key the target seals with.
pub const KEY: [u8; 32] = [0x5e; 32];

/// Small bounds: the target explores the checks, not the disk.
fn trust() -> SnapshotTrust {
    SnapshotTrust::new(SnapshotKey::from_bytes(KEY)).with_bounds(SnapshotBounds {
        max_files: 32,
        max_dirs: 32,
        max_depth: 8,
        max_file_bytes: 1 << 20,
        max_total_bytes: 4 << 20,
    })
}

/// A fresh private directory for one input.
pub fn scratch(what: &str) -> PathBuf {
    crate::scratch::fresh(what)
}

/// A name the target may create below the snapshot directory (plain and relative), if `raw` is one.
fn plain(raw: &[u8]) -> Option<String> {
    let name = std::str::from_utf8(raw).ok()?;
    let ok = !name.is_empty()
        && !name.contains('\0')
        && name.len() < 200
        && Path::new(name).components().all(|c| matches!(c, Component::Normal(_)))
        && !name.split('/').any(|c| c.is_empty() || c == "..");
    ok.then(|| name.to_owned())
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Opens the directory `data` describes.
pub fn run(data: &[u8]) {
    let mut input = Cursor::new(data);
    let flags = input.u8();
    let root = scratch("snapshot");
    let dir = root.join("snap");
    std::fs::create_dir(&dir).expect("the snapshot directory");
    let mut listed = Vec::new();
    for _ in 0..input.u8() % 17 {
        let kind = input.u8() % 5;
        let name = plain(input.block());
        let contents = input.block();
        let Some(name) = name else { continue };
        let path = dir.join(&name);
        if let Some(parent) = path.parent() {
            let _ = std::fs::create_dir_all(parent);
        }
        let made = match kind {
            0 => std::fs::write(&path, contents).map(|()| Some(contents.len() as u64)),
            1 => std::fs::create_dir_all(&path).map(|()| None),
            2 => symlink(String::from_utf8_lossy(contents).as_ref(), &path).map(|()| None),
            3 => nix::unistd::mkfifo(&path, nix::sys::stat::Mode::from_bits_truncate(0o600))
                .map(|()| None)
                .map_err(std::io::Error::from),
            _ => {
                let size =
                    u64::from(u32::from_le_bytes(contents.get(..4).and_then(|b| b.try_into().ok()).unwrap_or([0; 4])));
                std::fs::File::create(&path).and_then(|f| f.set_len(size % (8 << 20))).map(|()| None)
            }
        };
        if let Ok(Some(size)) = made {
            listed.push(serde_json::json!({"path": name, "size": size, "sha256": hex(&Sha256::digest(contents))}));
        }
    }
    let seal = input.block().to_vec();
    let manifest = if flags & 2 != 0 {
        let total: u64 = listed.iter().filter_map(|f| f["size"].as_u64()).sum();
        let mut text = serde_json::to_vec_pretty(&serde_json::json!({
            "format": 2, "strata": "fuzz", "tier": "wasm", "id": "0".repeat(32), "parent": null,
            "created": "2026-01-01T00:00:00Z", "persists": [], "files": listed, "total_bytes": total, "meta": {},
        }))
        .expect("json");
        while !input.is_empty() {
            let at = usize::from(input.u16());
            let byte = input.u8();
            if let Some(len) = std::num::NonZeroUsize::new(text.len()) {
                text[at % len] = byte;
            }
        }
        text
    } else {
        input.rest().to_vec()
    };
    let sealed = flags & 1 != 0;
    if sealed {
        test_utils::seal(&dir, &SnapshotKey::from_bytes(KEY), &manifest).expect("seal");
    } else {
        std::fs::write(dir.join("manifest.json"), &manifest).expect("manifest");
        if !seal.is_empty() {
            std::fs::write(dir.join(SEAL), &seal).expect("seal file");
        }
    }
    let trust = trust();
    let opened = trust.open(&dir);
    if let Ok(snapshot) = &opened {
        assert!(sealed, "a snapshot opened without the key's seal");
        let bounds = trust.bounds();
        assert!(
            snapshot.manifest.files.len() <= bounds.max_files
                && snapshot.manifest.total_bytes <= bounds.max_total_bytes
        );
        for file in &snapshot.manifest.files {
            let path = dir.join(&file.path);
            let meta = std::fs::symlink_metadata(&path).expect("a listed file exists");
            assert!(meta.file_type().is_file(), "{} is not a regular file", file.path);
            let bytes = std::fs::read(&path).expect("read");
            assert_eq!(bytes.len() as u64, file.size, "{}", file.path);
            assert_eq!(hex(&Sha256::digest(&bytes)), file.sha256, "{}", file.path);
        }
        let again = trust.reopen(snapshot).expect("an unchanged snapshot re-opens");
        assert_eq!(&again, snapshot);
    }
    let _ = std::fs::remove_dir_all(&root);
}
