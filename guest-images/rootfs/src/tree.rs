//! The tree hash: one sha256 over every entry of the tree, in a fixed order, so that the same tree always
//! gives the same hash and any change to a byte, a mode, an owner, a link target or the set of entries gives
//! another.
//!
//! Entries are visited depth first, each directory's entries sorted by name (bytes). Each entry adds a record:
//! its path relative to the root (length-prefixed bytes), a type tag, its permission bits (mode & 0o7777), uid
//! and gid, then by type: a regular file its size and the sha256 of its contents; a symlink its target; a
//! device node its device number (never its contents); a directory, fifo or socket nothing more.
//! Modification times are left out: they say when, not what.

use std::collections::HashSet;
use std::ffi::OsString;
use std::fs::{self, File};
use std::io::Read;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::Path;

use sha2::{Digest, Sha256};

use crate::{RootfsError, hex, io_err};

/// What [`hash_tree`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TreeSummary {
    /// The tree hash, hex.
    pub hash: String,
    /// The size of the regular files, each inode once.
    pub size_bytes: u64,
}

struct Walk {
    hasher: Sha256,
    dev: u64,
    size_bytes: u64,
    seen: HashSet<u64>,
    buf: Vec<u8>,
}

/// Hashes the tree at `root` (which must not contain mount points).
pub(crate) fn hash_tree(root: &Path) -> Result<TreeSummary, RootfsError> {
    let meta = fs::symlink_metadata(root).map_err(io_err("cannot stat", root))?;
    let mut walk =
        Walk { hasher: Sha256::new(), dev: meta.dev(), size_bytes: 0, seen: HashSet::new(), buf: vec![0; 1 << 20] };
    walk.entry(root, b"", &meta)?;
    Ok(TreeSummary { hash: hex(&walk.hasher.finalize()), size_bytes: walk.size_bytes })
}

impl Walk {
    fn bytes(&mut self, bytes: &[u8]) {
        self.hasher.update((bytes.len() as u64).to_le_bytes());
        self.hasher.update(bytes);
    }

    fn entry(&mut self, path: &Path, relative: &[u8], meta: &fs::Metadata) -> Result<(), RootfsError> {
        let kind = meta.file_type();
        let tag: u8 = if kind.is_dir() {
            b'd'
        } else if kind.is_file() {
            b'f'
        } else if kind.is_symlink() {
            b'l'
        } else if kind.is_char_device() {
            b'c'
        } else if kind.is_block_device() {
            b'b'
        } else if kind.is_fifo() {
            b'p'
        } else {
            b's'
        };
        self.bytes(relative);
        self.hasher.update([tag]);
        self.hasher.update((meta.mode() & 0o7777).to_le_bytes());
        self.hasher.update(meta.uid().to_le_bytes());
        self.hasher.update(meta.gid().to_le_bytes());
        match tag {
            b'f' => {
                self.hasher.update(meta.len().to_le_bytes());
                let digest = self.file_digest(path)?;
                self.hasher.update(digest);
                if meta.nlink() <= 1 || self.seen.insert(meta.ino()) {
                    self.size_bytes += meta.len();
                }
            }
            b'l' => {
                let target = fs::read_link(path).map_err(io_err("cannot read link", path))?;
                self.bytes(target.as_os_str().as_bytes());
            }
            b'c' | b'b' => self.hasher.update(meta.rdev().to_le_bytes()),
            b'd' => {
                if meta.dev() != self.dev {
                    return Err(RootfsError::Io {
                        what: "cannot hash",
                        path: path.to_owned(),
                        source: std::io::Error::other("it is a mount point; unmount it first"),
                    });
                }
                let mut names: Vec<OsString> = fs::read_dir(path)
                    .map_err(io_err("cannot read", path))?
                    .map(|e| e.map(|e| e.file_name()))
                    .collect::<Result<_, _>>()
                    .map_err(io_err("cannot read", path))?;
                names.sort_by(|a, b| a.as_bytes().cmp(b.as_bytes()));
                for name in names {
                    let child = path.join(&name);
                    let mut child_relative = relative.to_vec();
                    if !child_relative.is_empty() {
                        child_relative.push(b'/');
                    }
                    child_relative.extend_from_slice(name.as_bytes());
                    let child_meta = fs::symlink_metadata(&child).map_err(io_err("cannot stat", &child))?;
                    self.entry(&child, &child_relative, &child_meta)?;
                }
            }
            _ => {}
        }
        Ok(())
    }

    fn file_digest(&mut self, path: &Path) -> Result<[u8; 32], RootfsError> {
        let mut file = File::open(path).map_err(io_err("cannot open", path))?;
        let mut hasher = Sha256::new();
        loop {
            let n = file.read(&mut self.buf).map_err(io_err("cannot read", path))?;
            if n == 0 {
                break;
            }
            hasher.update(&self.buf[..n]);
        }
        Ok(hasher.finalize().into())
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    fn sample(root: &Path) {
        fs::create_dir_all(root.join("etc/ssh")).expect("mkdir");
        fs::create_dir_all(root.join("usr/bin")).expect("mkdir");
        fs::write(root.join("etc/hostname"), "strata\n").expect("write");
        fs::write(root.join("usr/bin/tool"), vec![7u8; 3 << 20]).expect("write");
        fs::hard_link(root.join("usr/bin/tool"), root.join("usr/bin/tool2")).expect("link");
        std::os::unix::fs::symlink("usr/bin", root.join("bin")).expect("symlink");
    }

    #[test]
    fn the_same_tree_hashes_the_same_wherever_and_whenever_it_is() {
        let a = tempfile::tempdir().expect("tempdir");
        let b = tempfile::tempdir().expect("tempdir");
        sample(a.path());
        sample(b.path());
        let first = hash_tree(a.path()).expect("hash");
        assert_eq!(first, hash_tree(a.path()).expect("hash again"));
        fs::set_permissions(b.path(), fs::metadata(a.path()).expect("stat").permissions()).expect("chmod");
        assert_eq!(first, hash_tree(b.path()).expect("hash the copy"));
        // Hard links count once.
        assert_eq!(first.size_bytes, 7 + (3 << 20));
    }

    #[test]
    fn any_change_to_contents_mode_links_or_entries_changes_the_hash() {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path();
        sample(root);
        let mut seen = vec![hash_tree(root).expect("hash").hash];
        let mut changed = |what: &str| {
            let hash = hash_tree(root).expect("hash").hash;
            assert!(!seen.contains(&hash), "{what} did not change the hash");
            seen.push(hash);
        };
        fs::write(root.join("etc/hostname"), "strat4\n").expect("write");
        changed("a changed byte");
        fs::set_permissions(root.join("etc/hostname"), fs::Permissions::from_mode(0o600)).expect("chmod");
        changed("a mode");
        fs::remove_file(root.join("bin")).expect("rm");
        std::os::unix::fs::symlink("usr/sbin", root.join("bin")).expect("symlink");
        changed("a link target");
        fs::write(root.join("etc/ssh/empty"), "").expect("write");
        changed("a new empty file");
        fs::remove_file(root.join("etc/ssh/empty")).expect("rm");
        fs::create_dir(root.join("etc/ssh/empty")).expect("mkdir");
        changed("a file becoming a directory");
        fs::rename(root.join("etc/hostname"), root.join("etc/hostnamf")).expect("rename");
        changed("a renamed file");
    }
}
