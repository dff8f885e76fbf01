//! Grants copied into and back out of a guest, end to end through the real agent (the embedded static binary, run
//! as a host process over a Unix socket: its "guest" paths are a temporary directory here), and through a hostile
//! fake agent whose listings and files must change nothing on the host.

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt, symlink};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::Child;
use std::thread;

use strata_guest_proto::frame::{FrameReader, FrameWriter};
use strata_guest_proto::{
    AgentClient, ClientConfig, EntryKind, ExecEvent, ExecLimits, ExecRequest, GuestMessage, HostMessage,
    PROTOCOL_VERSION, TreeEntry,
};
use strata_tier_microvm::grants::{self, GrantError};
use strata_vmm::test_utils::process::shared;

use crate::agent_process;

/// The real agent in host mode.
struct RealAgent {
    child: Child,
    client: Option<AgentClient>,
    _dir: tempfile::TempDir,
}

impl RealAgent {
    /// `None` (after one skip line) when this build has no embedded agent.
    fn spawn() -> Option<RealAgent> {
        let agent_process::Spawned { child, client, dir } = agent_process::spawn()?;
        Some(RealAgent { child, client: Some(client), _dir: dir })
    }

    fn client(&self) -> &AgentClient {
        self.client.as_ref().expect("client")
    }

    fn sh(&self, script: &str) -> i32 {
        let request = ExecRequest {
            argv: vec!["/bin/sh".into(), "-c".into(), script.into()],
            env: vec![("PATH".into(), "/usr/bin:/bin".into())],
            cwd: "/".into(),
            stdin: false,
            limits: ExecLimits::default(),
            tty: None,
        };
        let mut handle = self.client().start(&request).expect("start");
        loop {
            match handle.next_event(None).expect("event") {
                ExecEvent::Exited(report) => match report.status {
                    strata_guest_proto::ExitStatus::Code(code) => return code,
                    other => panic!("{other:?}"),
                },
                ExecEvent::Output { data, .. } => eprint!("{}", String::from_utf8_lossy(&data)),
            }
        }
    }
}

impl Drop for RealAgent {
    fn drop(&mut self) {
        drop(self.client.take());
        let _ = self.child.wait();
    }
}

/// Everything under `root`, not following links: relative path → (kind, mode, contents or link target).
fn tree(root: &Path) -> BTreeMap<String, (char, u32, Vec<u8>)> {
    let mut found = BTreeMap::new();
    let mut pending = vec![PathBuf::new()];
    while let Some(rel) = pending.pop() {
        for entry in fs::read_dir(root.join(&rel)).expect("read_dir") {
            let entry = entry.expect("entry");
            let child = rel.join(entry.file_name());
            let path = root.join(&child);
            let meta = fs::symlink_metadata(&path).expect("meta");
            let mode = meta.mode() & 0o7777;
            let key = child.to_string_lossy().into_owned();
            if meta.is_dir() {
                pending.push(child);
                found.insert(key, ('d', mode, Vec::new()));
            } else if meta.file_type().is_symlink() {
                let target = fs::read_link(&path).expect("readlink");
                found.insert(key, ('l', 0, target.to_string_lossy().as_bytes().to_vec()));
            } else {
                found.insert(key, ('f', mode, fs::read(&path).expect("read")));
            }
        }
    }
    found
}

fn host_grant() -> tempfile::TempDir {
    let host = tempfile::tempdir().expect("tempdir");
    fs::create_dir_all(host.path().join("sub/deep")).expect("mkdir");
    fs::write(host.path().join("keep.txt"), b"unchanged").expect("write");
    fs::write(host.path().join("edit.txt"), b"before").expect("write");
    fs::write(host.path().join("gone.txt"), b"to be deleted").expect("write");
    fs::write(host.path().join("sub/deep/big.bin"), vec![5u8; 300_000]).expect("write");
    fs::set_permissions(host.path().join("sub"), fs::Permissions::from_mode(0o750)).expect("chmod");
    symlink("../keep.txt", host.path().join("sub/link")).expect("symlink");
    host
}

#[test]
fn a_grant_goes_in_and_the_guests_changes_come_back() {
    let _shared = shared();
    let Some(agent) = RealAgent::spawn() else { return };
    let host = host_grant();
    let guest_root = tempfile::tempdir().expect("tempdir");
    let guest = guest_root.path().join("data");
    let guest = guest.to_str().expect("utf-8");

    let scanned = grants::scan(host.path(), 1 << 20).expect("scan");
    assert_eq!(scanned.bytes, 9 + 6 + 13 + 300_000);
    grants::copy_in(agent.client(), &scanned, guest).expect("copy in");
    assert_eq!(tree(Path::new(guest)), tree(host.path()), "the guest has exactly the host's tree");

    let script = format!(
        "cd {guest} && printf after > edit.txt && rm gone.txt && mkdir -p new/dir && printf n > new/dir/f \
         && chmod 4755 new/dir/f && rm -r sub/deep && printf x > sub/deep && ln -s /etc/passwd new/pw"
    );
    assert_eq!(agent.sh(&script), 0);
    let copied = grants::copy_out(agent.client(), guest, host.path(), 1 << 20).expect("copy out");
    assert_eq!(copied.files, 4, "{copied:?}");

    let mut expected = tree(Path::new(guest));
    // Set-user-ID is dropped on the host.
    expected.get_mut("new/dir/f").expect("f").1 = 0o755;
    assert_eq!(tree(host.path()), expected);
    assert_eq!(fs::read(host.path().join("edit.txt")).expect("read"), b"after");
    assert!(!host.path().join("gone.txt").exists());
    assert_eq!(fs::read_link(host.path().join("new/pw")).expect("link").to_str(), Some("/etc/passwd"));
    assert_eq!(fs::metadata(host.path().join("sub")).expect("meta").mode() & 0o7777, 0o750);
    // No staging directory left behind.
    assert!(
        fs::read_dir(host.path()).expect("dir").flatten().all(|e| !e.file_name().to_string_lossy().starts_with('.'))
    );
}

#[test]
fn a_guest_path_that_is_not_empty_is_refused() {
    let _shared = shared();
    let Some(agent) = RealAgent::spawn() else { return };
    let host = host_grant();
    let guest_root = tempfile::tempdir().expect("tempdir");
    fs::write(guest_root.path().join("image-file"), b"from the image").expect("write");
    let scanned = grants::scan(host.path(), 1 << 20).expect("scan");
    let err =
        grants::copy_in(agent.client(), &scanned, guest_root.path().to_str().expect("utf-8")).expect_err("not empty");
    assert!(matches!(err, GrantError::NotEmpty { .. }), "{err}");
}

#[test]
fn disk_limits_hold_both_ways_and_change_nothing() {
    let _shared = shared();
    let Some(agent) = RealAgent::spawn() else { return };
    let host = host_grant();
    assert!(matches!(grants::scan(host.path(), 1000), Err(GrantError::TooLarge { .. })));

    let scanned = grants::scan(host.path(), 1 << 20).expect("scan");
    let guest_root = tempfile::tempdir().expect("tempdir");
    let guest = guest_root.path().join("data");
    let guest = guest.to_str().expect("utf-8");
    grants::copy_in(agent.client(), &scanned, guest).expect("copy in");
    assert_eq!(agent.sh(&format!("head -c 2000000 /dev/zero > {guest}/huge && printf z > {guest}/keep.txt")), 0);
    let before = tree(host.path());
    let err = grants::copy_out(agent.client(), guest, host.path(), 1 << 20).expect_err("over the limit");
    assert!(matches!(err, GrantError::TooLarge { .. }), "{err}");
    assert_eq!(tree(host.path()), before, "nothing applied");
}

#[test]
fn links_on_the_host_are_never_followed_when_copying_back() {
    let _shared = shared();
    let Some(agent) = RealAgent::spawn() else { return };
    let host = tempfile::tempdir().expect("tempdir");
    let outside = tempfile::tempdir().expect("tempdir");
    fs::write(outside.path().join("secret"), b"outside").expect("write");
    symlink(outside.path(), host.path().join("link")).expect("symlink");
    let scanned = grants::scan(host.path(), 1 << 20).expect("scan");
    let guest_root = tempfile::tempdir().expect("tempdir");
    let guest = guest_root.path().join("data");
    let guest = guest.to_str().expect("utf-8");
    grants::copy_in(agent.client(), &scanned, guest).expect("copy in");
    // The guest swaps the link for a directory with a file named like the one outside.
    assert_eq!(agent.sh(&format!("cd {guest} && rm link && mkdir link && printf mine > link/secret")), 0);
    grants::copy_out(agent.client(), guest, host.path(), 1 << 20).expect("copy out");
    assert_eq!(fs::read(outside.path().join("secret")).expect("read"), b"outside", "outside untouched");
    assert!(fs::symlink_metadata(host.path().join("link")).expect("meta").is_dir());
    assert_eq!(fs::read(host.path().join("link/secret")).expect("read"), b"mine");
}

/// A fake agent that answers a `ListTree` with `entries` and every `ReadFile` with `data`.
fn hostile(entries: Vec<TreeEntry>, data: Vec<u8>) -> (AgentClient, thread::JoinHandle<()>) {
    let (host_end, guest_end) = UnixStream::pair().expect("pair");
    let agent = thread::spawn(move || {
        let mut reader = FrameReader::new(guest_end.try_clone().expect("clone"));
        let mut writer = FrameWriter::new(guest_end);
        let _hello: Option<HostMessage> = reader.read().expect("hello");
        let hello =
            GuestMessage::Hello { version: PROTOCOL_VERSION, agent_version: "hostile".into(), kernel: "x".into() };
        writer.write(&hello).expect("write");
        while let Ok(Some(message)) = reader.read::<HostMessage>() {
            let answers = match message {
                HostMessage::ListTree { id, .. } => vec![
                    GuestMessage::TreeEntries { id, entries: entries.clone() },
                    GuestMessage::TreeDone { id, count: entries.len() as u64, skipped: 0 },
                ],
                HostMessage::ReadFile { id, .. } => vec![
                    GuestMessage::FileData { id, data: data.clone().into() },
                    GuestMessage::FileDone { id, size: data.len() as u64 },
                ],
                _ => Vec::new(),
            };
            for answer in answers {
                if writer.write(&answer).is_err() {
                    return;
                }
            }
        }
    });
    (AgentClient::connect(host_end, ClientConfig::default()).expect("connect"), agent)
}

fn file(path: &str, size: u64) -> TreeEntry {
    TreeEntry { path: path.into(), kind: EntryKind::File, mode: 0o644, size, target: None }
}

fn dir(path: &str) -> TreeEntry {
    TreeEntry { path: path.into(), kind: EntryKind::Dir, mode: 0o755, size: 0, target: None }
}

fn link(path: &str, target: &str) -> TreeEntry {
    TreeEntry { path: path.into(), kind: EntryKind::Symlink, mode: 0o777, size: 1, target: Some(target.into()) }
}

#[test]
fn hostile_listings_and_files_change_nothing_on_the_host() {
    let _shared = shared();
    let cases: Vec<(&str, Vec<TreeEntry>, Vec<u8>)> = vec![
        ("parent escape", vec![file("../escaped", 4)], b"evil".to_vec()),
        ("absolute", vec![file("/tmp/escaped", 4)], b"evil".to_vec()),
        ("through a link", vec![link("l", "/tmp"), file("l/escaped", 4)], b"evil".to_vec()),
        ("a file before its directory", vec![file("d/f", 4), dir("d")], b"evil".to_vec()),
        ("duplicates", vec![file("keep.txt", 4), file("keep.txt", 4)], b"evil".to_vec()),
        ("more bytes than listed", vec![file("keep.txt", 2)], b"evil".to_vec()),
        ("fewer bytes than listed", vec![file("keep.txt", 8)], b"evil".to_vec()),
        // A valid first file, a bad second one: the first is not applied either.
        ("second file bad", vec![file("a.txt", 4), file("b.txt", 9)], b"evil".to_vec()),
    ];
    let outside = tempfile::tempdir().expect("tempdir");
    for (name, entries, data) in cases {
        let host = host_grant();
        let before = tree(host.path());
        let (client, agent) = hostile(entries, data);
        let err = grants::copy_out(&client, "/data", host.path(), 1 << 20).expect_err(name);
        assert!(matches!(err, GrantError::Refused { .. }), "{name}: {err}");
        assert_eq!(tree(host.path()), before, "{name}: the host tree changed");
        assert!(!host.path().parent().expect("parent").join("escaped").exists(), "{name}");
        assert_eq!(fs::read_dir(outside.path()).expect("dir").count(), 0, "{name}");
        drop(client);
        agent.join().expect("fake agent");
    }
}

/// The extended attributes of `path` (not following a link).
fn xattrs(path: &Path) -> Vec<u8> {
    let name = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).expect("path");
    let mut buf = vec![0u8; 4096];
    // SAFETY: llistxattr writes at most `buf.len()` bytes into `buf` and reads a NUL-terminated path.
    let n = unsafe { libc::llistxattr(name.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    assert!(n >= 0, "llistxattr {}: {}", path.display(), std::io::Error::last_os_error());
    buf.truncate(n as usize);
    buf
}

/// Gives the file named by its argument a file capability (`cap_net_raw+ep`, a version 2 `security.capability`)
/// and a user attribute.
const SET_XATTRS: &str = "import os, struct, sys; \
    os.setxattr(sys.argv[1], 'security.capability', struct.pack('<5I', 0x02000001, 1 << 13, 0, 0, 0)); \
    os.setxattr(sys.argv[1], 'user.note', b'hi')";

#[test]
fn privileged_files_made_in_the_guest_come_back_as_plain_files() {
    let _shared = shared();
    let Some(agent) = RealAgent::spawn() else { return };
    let host = tempfile::tempdir().expect("tempdir");
    let outside = tempfile::tempdir().expect("tempdir");
    fs::write(outside.path().join("target"), b"outside").expect("write");
    symlink(outside.path().join("target"), host.path().join("out")).expect("symlink");
    let scanned = grants::scan(host.path(), 1 << 20).expect("scan");
    let guest_root = tempfile::tempdir().expect("tempdir");
    let guest = guest_root.path().join("data");
    let guest = guest.to_str().expect("utf-8");
    grants::copy_in(agent.client(), &scanned, guest).expect("copy in");
    // The agent runs as root here, as in a guest: every one of these succeeds in the "guest".
    let script = format!(
        "cd {guest} && cp /bin/sh suid && chmod 4755 suid && printf g > sgid && chmod 2755 sgid \
         && mkdir -m 2775 sgid-dir && mkdir -m 1777 sticky && mknod null c 1 3 && mknod loop b 7 0 \
         && mkfifo fifo && ln suid hard-link && printf c > caps && python3 -c \"{SET_XATTRS}\" caps \
         && rm out && printf mine > out"
    );
    if agent.sh("command -v python3 >/dev/null") != 0 {
        eprintln!("skip privileged_files_made_in_the_guest_come_back_as_plain_files: no python3 on this host");
        return;
    }
    assert_eq!(agent.sh(&script), 0);
    grants::copy_out(agent.client(), guest, host.path(), 4 << 20).expect("copy out");
    let found = tree(host.path());
    let kinds: Vec<(&str, char, u32)> = found.iter().map(|(k, (kind, mode, _))| (k.as_str(), *kind, *mode)).collect();
    assert_eq!(
        kinds,
        vec![
            ("caps", 'f', 0o644),
            ("hard-link", 'f', 0o755),
            ("out", 'f', 0o644),
            ("sgid", 'f', 0o755),
            ("sgid-dir", 'd', 0o775),
            ("sticky", 'd', 0o777),
            ("suid", 'f', 0o755),
        ],
        "devices and the FIFO stay in the guest; no mode keeps 07000 bits"
    );
    for name in found.keys() {
        assert!(xattrs(&host.path().join(name)).is_empty(), "{name} carries extended attributes");
    }
    // A hard link in the guest is two files on the host, not a link to anything.
    assert_ne!(
        fs::metadata(host.path().join("suid")).expect("meta").ino(),
        fs::metadata(host.path().join("hard-link")).expect("meta").ino()
    );
    assert_eq!(fs::read(outside.path().join("target")).expect("read"), b"outside", "a host link was followed");
    assert_eq!(fs::read(host.path().join("out")).expect("read"), b"mine");
}

#[test]
fn a_hostile_listing_cannot_set_privilege_bits() {
    let _shared = shared();
    let host = tempfile::tempdir().expect("tempdir");
    let entries = vec![
        TreeEntry { mode: 0o7777, ..dir("d") },
        TreeEntry { mode: 0o6755, ..file("d/f", 4) },
        TreeEntry { mode: 0o4777, ..file("g", 4) },
    ];
    let (client, agent) = hostile(entries, b"evil".to_vec());
    grants::copy_out(&client, "/data", host.path(), 1 << 20).expect("copy out");
    let modes: Vec<(String, char, u32)> =
        tree(host.path()).into_iter().map(|(k, (kind, mode, _))| (k, kind, mode)).collect();
    assert_eq!(modes, vec![("d".into(), 'd', 0o777), ("d/f".into(), 'f', 0o755), ("g".into(), 'f', 0o777)]);
    drop(client);
    agent.join().expect("fake agent");
}
