use std::os::unix::fs::PermissionsExt;

use strata_guest_proto::{ClientError, MAX_CHUNK};

use crate::{noise, start};

#[test]
fn write_then_read_round_trips_large_files() {
    let agent = start();
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("nested/dir/data.bin");
    let path = path.to_str().expect("utf-8");
    let data = noise(3 * MAX_CHUNK * 16 + 123, 5);
    agent.client().write_file(path, 0o640, &data).expect("write");
    assert_eq!(std::fs::metadata(path).expect("meta").permissions().mode() & 0o7777, 0o640);
    let back = agent.client().read_file(path, data.len() as u64).expect("read");
    assert!(back == data, "read back {} of {} bytes", back.len(), data.len());

    // Overwriting replaces the file whole; an empty file is a file.
    agent.client().write_file(path, 0o600, b"short").expect("rewrite");
    assert_eq!(agent.client().read_file(path, 100).expect("read"), b"short");
    agent.client().write_file(path, 0o600, b"").expect("empty");
    assert_eq!(agent.client().read_file(path, 0).expect("read"), b"");
}

#[test]
fn missing_files_and_bad_paths_are_typed_errors() {
    let agent = start();
    let err = agent.client().read_file("/no/such/file", 10).expect_err("missing");
    assert!(matches!(&err, ClientError::File { errno, .. } if *errno == libc::ENOENT), "{err}");
    let err = agent.client().read_file("relative/path", 10).expect_err("relative");
    assert!(matches!(&err, ClientError::File { errno, .. } if *errno == libc::EINVAL), "{err}");
    let err = agent.client().read_file("/tmp", 10).expect_err("directory");
    assert!(matches!(&err, ClientError::File { errno, .. } if *errno == libc::EISDIR), "{err}");
    let err = agent.client().write_file("relative", 0o644, b"x").expect_err("relative");
    assert!(matches!(&err, ClientError::File { errno, .. } if *errno == libc::EINVAL), "{err}");
    let err = agent.client().write_file("/proc/version/x", 0o644, &vec![0; 3 * MAX_CHUNK]).expect_err("not a dir");
    assert!(matches!(&err, ClientError::File { .. }), "{err}");
    // A file over the host's limit is refused before any of it is sent.
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("f");
    std::fs::write(&path, vec![1; 1000]).expect("write");
    let err = agent.client().read_file(path.to_str().expect("utf-8"), 999).expect_err("too big");
    assert!(matches!(&err, ClientError::File { errno, .. } if *errno == libc::EFBIG), "{err}");
    // And the connection still works.
    assert_eq!(agent.client().read_file(path.to_str().expect("utf-8"), 1000).expect("read").len(), 1000);
}

#[test]
fn a_failed_write_leaves_nothing_behind() {
    let agent = start();
    let dir = tempfile::tempdir().expect("tempdir");
    let target = dir.path().join("sub");
    std::fs::create_dir(&target).expect("mkdir");
    // The target is a directory: the rename at the end fails.
    let err =
        agent.client().write_file(target.to_str().expect("utf-8"), 0o644, &vec![0; 2 * MAX_CHUNK]).expect_err("dir");
    assert!(matches!(&err, ClientError::File { .. }), "{err}");
    let left: Vec<_> = std::fs::read_dir(dir.path()).expect("dir").map(|e| e.expect("entry").file_name()).collect();
    assert_eq!(left, vec![std::ffi::OsString::from("sub")]);
}
