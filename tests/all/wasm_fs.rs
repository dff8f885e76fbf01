//! File grants: read-only really is, and nothing outside a grant is reachable by `..`, absolute paths or
//! symlinks.

use std::os::unix::fs::symlink;
use std::path::Path;

use strata_core::{Capabilities, Grant, GrantMode, Limits, Status};
use strata_test_programs as programs;

use crate::util::{listing, run, stdout};

/// `root/outside.txt` (the secret) and `root/grant/` with a file, a directory and symlinks pointing out.
fn fixture() -> tempfile::TempDir {
    let root = tempfile::tempdir().expect("tempdir");
    let grant = root.path().join("grant");
    std::fs::create_dir_all(grant.join("subdir")).expect("mkdir");
    std::fs::create_dir_all(grant.join("sub")).expect("mkdir");
    std::fs::write(root.path().join("outside.txt"), "top secret").expect("write");
    std::fs::write(grant.join("existing.txt"), "original").expect("write");
    symlink(root.path(), grant.join("link-out")).expect("symlink");
    symlink("/etc/passwd", grant.join("abs-link")).expect("symlink");
    symlink("../outside.txt", grant.join("rel-link")).expect("symlink");
    root
}

fn caps(host: &Path, mode: GrantMode) -> Capabilities {
    Capabilities { grants: vec![Grant::new(host, "/data", mode).expect("grant")], ..Capabilities::default() }
}

fn lines(text: &str) -> Vec<&str> {
    text.lines().collect()
}

#[test]
fn a_read_only_grant_refuses_every_change() {
    let root = fixture();
    let grant = root.path().join("grant");
    let before = listing(&grant);
    let outcome = run(programs::FS, &["mutate", "/data"], &caps(&grant, GrantMode::Ro), &Limits::default());
    assert_eq!(outcome.status, Status::Exited { code: 0 }, "{outcome:?}");
    let text = stdout(&outcome);
    for line in lines(&text) {
        if line.starts_with("read:") {
            assert_eq!(line, "read: allowed");
        } else {
            assert!(line.contains(": denied"), "a read-only grant allowed a change: {line}\n{text}");
        }
    }
    assert_eq!(lines(&text).len(), 13, "{text}");
    assert_eq!(listing(&grant), before, "the host directory changed");
}

#[test]
fn a_read_write_grant_allows_changes() {
    let root = fixture();
    let grant = root.path().join("grant");
    let outcome = run(programs::FS, &["mutate", "/data"], &caps(&grant, GrantMode::Rw), &Limits::default());
    let text = stdout(&outcome);
    for op in ["create", "overwrite", "append", "truncate", "mkdir", "rmdir", "symlink"] {
        assert!(text.contains(&format!("{op}: allowed")), "{op} was refused on a rw grant:\n{text}");
    }
    assert_eq!(std::fs::read_to_string(grant.join("new.txt")).expect("created"), "x");
}

#[test]
fn files_written_by_the_guest_reach_the_host_and_back() {
    let root = fixture();
    let grant = root.path().join("grant");
    let caps = caps(&grant, GrantMode::Rw);
    let outcome = run(programs::FS, &["write", "/data/out.txt", "from the guest"], &caps, &Limits::default());
    assert_eq!(outcome.status, Status::Exited { code: 0 }, "{outcome:?}");
    assert_eq!(std::fs::read_to_string(grant.join("out.txt")).expect("read"), "from the guest");
    let outcome = run(programs::FS, &["read", "/data/existing.txt"], &caps, &Limits::default());
    assert_eq!(stdout(&outcome), "original");
}

#[test]
fn dotdot_absolute_paths_and_symlinks_do_not_escape_a_grant() {
    let root = fixture();
    let grant = root.path().join("grant");
    let outcome = run(programs::FS, &["escape", "/data"], &caps(&grant, GrantMode::Rw), &Limits::default());
    assert_eq!(outcome.status, Status::Exited { code: 0 }, "{outcome:?}");
    let text = stdout(&outcome);
    assert_eq!(lines(&text).len(), 10, "every probe reports:\n{text}");
    for line in lines(&text) {
        assert!(line.contains(": denied"), "escaped the grant: {line}\n{text}");
    }
    assert!(!text.contains("top secret") && !text.contains("root:"), "{text}");
}

#[test]
fn paths_outside_every_grant_are_not_found() {
    let outcome = run(programs::FS, &["read", "/etc/passwd"], &Capabilities::default(), &Limits::default());
    assert_eq!(outcome.status, Status::Exited { code: 1 }, "{outcome:?}");
    assert!(outcome.stdout.is_empty());
}
