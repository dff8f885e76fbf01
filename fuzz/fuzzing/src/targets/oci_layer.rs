//! The image store's OCI layer extraction (`guest-images/store/src/layer_tar.rs`): one layer tar, plain or gzip,
//! applied as host root into an empty directory in overlayfs's form — names, parents opened without following a
//! link, hard links, whiteouts and opaque marks, owners, modes, PAX extended attributes, bounds.
//!
//! Input: the layer's bytes (seeds are real layers, gzipped and not, and one per kind of hostile entry; mutations
//! reach every header field and PAX record).
//!
//! Oracles: applying never panics; it creates nothing beside the directory it applies into (which sits in a private
//! directory beside a sentinel file, and beside an `outside/` directory that the seeds' relative symlinks name) and
//! nothing through a link; the tree it leaves (also on an error) holds no device but 0/0 whiteouts, no owner from
//! 65536 on, no hard link to a file outside it, and no extended attribute but `user.*` (not `user.overlay.*`),
//! `security.capability`, and `trusted.overlay.opaque` = `y` on a directory.

use std::collections::HashMap;
use std::ffi::{CString, OsString};
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::Path;

use strata_image_store::layer_tar::{ImportLimits, apply_layer};

/// Small enough that a run stays fast; large enough for the seeds.
const LIMITS: ImportLimits = ImportLimits { max_layer_bytes: 4 << 20, max_entries: 4096, max_image_bytes: 4 << 20 };

fn names(dir: &Path) -> Vec<OsString> {
    let mut names: Vec<_> = std::fs::read_dir(dir).expect("ls").map(|e| e.expect("entry").file_name()).collect();
    names.sort();
    names
}

/// The names of `path`'s extended attributes (not following a link).
fn xattr_names(path: &Path) -> Vec<Vec<u8>> {
    let c = CString::new(path.as_os_str().as_bytes()).expect("a path without NUL");
    let mut buf = vec![0u8; 64 * 1024];
    // SAFETY: llistxattr reads the NUL-terminated path and writes at most `buf.len()` bytes into `buf`.
    let n = unsafe { libc::llistxattr(c.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    assert!(n >= 0, "listing the attributes of {}: {}", path.display(), std::io::Error::last_os_error());
    buf.truncate(n as usize);
    buf.split(|b| *b == 0).filter(|n| !n.is_empty()).map(<[u8]>::to_vec).collect()
}

fn xattr_value(path: &Path, name: &[u8]) -> Vec<u8> {
    let c = CString::new(path.as_os_str().as_bytes()).expect("a path without NUL");
    let n = CString::new(name).expect("a name without NUL");
    let mut buf = vec![0u8; 64 * 1024];
    // SAFETY: lgetxattr reads the two NUL-terminated strings and writes at most `buf.len()` bytes into `buf`.
    let got = unsafe { libc::lgetxattr(c.as_ptr(), n.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    assert!(got >= 0, "reading an attribute of {}", path.display());
    buf.truncate(got as usize);
    buf
}

/// Walks the directory `dir` (never following a link) and checks every entry; counts the links found of each
/// inode with more than one. Paths go through `/proc/self/fd/<dir>/<name>` (a layer's paths may be as long as
/// `PATH_MAX` themselves), so each level holds a descriptor while its subdirectories are walked.
fn check_tree(dir: &std::fs::File, links: &mut HashMap<u64, (u64, u64)>) {
    let base = std::path::PathBuf::from(format!("/proc/self/fd/{}", dir.as_raw_fd()));
    for name in names(&base) {
        let path = base.join(&name);
        let meta = check_entry(&path, &Path::new(&name).display().to_string());
        let kind = meta.file_type();
        if kind.is_file() && meta.nlink() > 1 {
            links.entry(meta.ino()).or_insert((meta.nlink(), 0)).1 += 1;
        }
        if kind.is_dir() {
            let sub = std::fs::File::options()
                .read(true)
                .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC)
                .open(&path)
                .expect("open a directory");
            check_tree(&sub, links);
        }
    }
}

/// Checks one entry (not following a link): its type, owner and extended attributes.
fn check_entry(path: &Path, shown: &str) -> std::fs::Metadata {
    let meta = std::fs::symlink_metadata(path).expect("stat");
    let kind = meta.file_type();
    assert!(!kind.is_block_device() && !kind.is_socket(), "{shown} is a block device or a socket");
    if kind.is_char_device() {
        assert_eq!(meta.rdev(), 0, "{shown} is a device other than a whiteout");
    }
    assert!(meta.uid() < 65_536 && meta.gid() < 65_536, "{shown} is owned by {}:{}", meta.uid(), meta.gid());
    for attr in xattr_names(path) {
        let fine = (attr.starts_with(b"user.") && !attr.starts_with(b"user.overlay."))
            || attr == b"security.capability"
            || (attr == b"trusted.overlay.opaque" && kind.is_dir() && xattr_value(path, &attr) == b"y");
        assert!(fine, "{shown} has the attribute {}", String::from_utf8_lossy(&attr));
    }
    meta
}

/// Up to 2048 nested directories are walked, each holding a descriptor.
fn enough_descriptors() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE)
            && soft < 8192
        {
            let _ = setrlimit(Resource::RLIMIT_NOFILE, hard.min(8192), hard);
        }
    });
}

/// Applies `data` as a layer and checks what it made.
pub fn run(data: &[u8]) {
    let dir = crate::scratch::fresh("oci-layer");
    // Private (0700): what a layer makes (setuid files of any owner) is reachable by no other user meanwhile.
    let private = dir.join("private");
    std::fs::DirBuilder::new().mode(0o700).create(&private).expect("private");
    let root = private.join("root");
    std::fs::create_dir(&root).expect("root");
    std::fs::write(private.join("sentinel"), b"sentinel").expect("sentinel");
    let outside = dir.join("outside");
    std::fs::create_dir(&outside).expect("outside");
    let before = names(&private);

    let _ = apply_layer(data, &root, &LIMITS);

    assert_eq!(names(&private), before, "the layer created something beside its directory");
    assert_eq!(std::fs::read(private.join("sentinel")).expect("sentinel"), b"sentinel", "the sentinel changed");
    assert!(names(&outside).is_empty(), "the layer created something through a link");
    assert_eq!(names(&dir), vec![OsString::from("outside"), "private".into()]);
    enough_descriptors();
    check_entry(&root, "the root");
    let mut links = HashMap::new();
    check_tree(&std::fs::File::open(&root).expect("open the root"), &mut links);
    for (inode, (nlink, found)) in links {
        assert_eq!(nlink, found, "inode {inode} has {nlink} links, {found} of them in the layer");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
