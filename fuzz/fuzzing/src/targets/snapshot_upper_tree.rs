//! The process tier's snapshot layer (`tiers/process/jail/src/tree.rs`): the `upper.tree` a fork's PID 1 restores
//! into its empty upper directory — paths, modes (setuid bits too), owners, extended attributes, file extents,
//! links, FIFOs and whiteouts.
//!
//! Input: the tree file's bytes (seeds are real trees; mutations reach every record).
//!
//! Oracles: restoring never panics, and creates nothing outside the directory it restores into (no `..`, no
//! absolute path, no link followed, no hard link to a file it did not create); a tree it restores writes back
//! (`write_tree`) into a tree that restores again.

use std::os::fd::AsFd;
use std::os::unix::fs::DirBuilderExt;

use strata_jail::tree::{extract_tree, write_tree};

use crate::targets::snapshot_open::scratch;

fn names(dir: &std::path::Path) -> Vec<std::ffi::OsString> {
    let mut names: Vec<_> = std::fs::read_dir(dir).expect("ls").map(|e| e.expect("entry").file_name()).collect();
    names.sort();
    names
}

/// Restores `data` as a tree.
pub fn run(data: &[u8]) {
    // Private (0700): what the tree makes (setuid files of any owner) is reachable by no other user meanwhile.
    let root = scratch("tree");
    std::fs::DirBuilder::new().mode(0o700).create(root.join("private")).expect("private");
    let into = root.join("private/into");
    std::fs::create_dir(&into).expect("into");
    let before = names(&root.join("private"));
    let dir = std::fs::File::open(&into).expect("open");
    let restored = extract_tree(data, dir.as_fd(), None);
    assert_eq!(names(&root.join("private")), before, "the restore created something beside its directory");
    if restored.is_ok() {
        let mut again = Vec::new();
        write_tree(dir.as_fd(), &mut again, None).expect("a restored tree writes back");
        let second = root.join("private/second");
        std::fs::create_dir(&second).expect("second");
        let second = std::fs::File::open(&second).expect("open");
        extract_tree(&again[..], second.as_fd(), None).expect("a tree written back restores");
    }
    let _ = std::fs::remove_dir_all(&root);
}
