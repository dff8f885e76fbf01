//! Privileged files planted through a read-write grant: nothing a job writes into a grant may be, on the host,
//! set-user-ID, set-group-ID, a device node or a file with capabilities (`security.capability`), whatever call
//! made it — checked from the host after the job and while it still runs (a sweep after the job would be too
//! late: the file is usable meanwhile).
//!
//! Process tier: one case per way of making such a file (each system call by number, the shell's tools, copies
//! of the image's own set-user-ID programs, renames and links from elsewhere, a fork of a zygote), each in a
//! fresh grant. Wasm tier: WASI has no call that sets a mode or makes a node, and Strata's own commit of a
//! scratch copy into the grant (escalation) writes only plain files, directories and links, never through a
//! host link. The microVM tier's copy-back is tried in `tiers/microvm/tests/all/grants.rs` (over the real agent).

use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use strata_core::{Capabilities, ExecOptions, Grant, GrantMode, Job, Limits, Outcome, PythonSource, Status, TierKind};
use strata_engine::{Engine, RunRequest, TierChoice};
use strata_test_programs as programs;

use crate::util::python_engine;

/// What on the host under `root` a host user could gain privileges from: set-user-ID or set-group-ID bits, a
/// device node, a file capability. Links are not followed.
fn privileged(root: &Path) -> Vec<String> {
    let mut found = Vec::new();
    let mut pending = vec![root.to_owned()];
    while let Some(dir) = pending.pop() {
        for entry in std::fs::read_dir(&dir).expect("read_dir") {
            let path = entry.expect("entry").path();
            let meta = std::fs::symlink_metadata(&path).expect("lstat");
            let kind = meta.file_type();
            let name = path.strip_prefix(root).expect("prefix").display().to_string();
            if meta.mode() & 0o6000 != 0 {
                found.push(format!("{name}: mode {:o}", meta.mode()));
            }
            if kind.is_char_device() || kind.is_block_device() {
                found.push(format!("{name}: a device node"));
            }
            if has_capability_xattr(&path) {
                found.push(format!("{name}: security.capability"));
            }
            if kind.is_dir() {
                pending.push(path);
            }
        }
    }
    found
}

fn has_capability_xattr(path: &Path) -> bool {
    let path = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).expect("path");
    // SAFETY: lgetxattr with a null buffer and size 0 only reports the value's size; both strings are
    // NUL-terminated and outlive the call.
    let size = unsafe { libc::lgetxattr(path.as_ptr(), c"security.capability".as_ptr(), std::ptr::null_mut(), 0) };
    size >= 0
}

/// The engine, when this host runs the process tier (else one skip line).
fn process(test: &str) -> Option<&'static Engine> {
    crate::util::process_tier(test).map(|_| python_engine())
}

fn rw_grant(host: &Path) -> Capabilities {
    Capabilities { grants: vec![Grant::new(host, "/g", GrantMode::Rw).expect("grant")], ..Capabilities::default() }
}

fn python(code: &str) -> Job {
    Job::Python { source: PythonSource::Code(code.into()), args: Vec::new() }
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn limits() -> Limits {
    Limits { wall: Duration::from_secs(30), ..Limits::default() }
}

/// What every process-tier case starts with: `call(nr, *args)` makes system call `nr` and returns 0 or the
/// errno; `sh(script)` runs a shell script and returns its exit status; the working directory is the grant.
const PRELUDE: &str = r#"
import ctypes, os, struct, subprocess, errno
libc = ctypes.CDLL(None, use_errno=True)
def call(nr, *args):
    args = [a if isinstance(a, (bytes, ctypes.Array)) else ctypes.c_long(a) for a in args]
    return 0 if libc.syscall(ctypes.c_long(nr), *args) >= 0 else ctypes.get_errno()
def sh(script):
    return subprocess.run(['sh', '-c', script]).returncode
def suid_programs():
    found = subprocess.run(['find', '/usr/bin', '/usr/sbin', '-xdev', '-type', 'f', '-perm', '/6000'],
                           capture_output=True, text=True).stdout.split()
    assert found, 'the image has no set-user-ID program'
    return found
AT_FDCWD = -100
S_IFREG, S_IFCHR, S_IFBLK = 0o100000, 0o020000, 0o060000
os.chdir('/g')
open('f', 'w').close()
"#;

/// One way of planting a file: the Python after [`PRELUDE`] and what it must print (the errno it got, mostly).
struct Case {
    name: &'static str,
    code: &'static str,
    prints: &'static str,
}

/// Every way a job on the process tier could make a privileged file in the grant.
const CASES: &[Case] = &[
    Case { name: "chmod 4755", code: "print(call(90, b'f', 0o4755))", prints: "1" },
    Case { name: "chmod 2755", code: "print(call(90, b'f', 0o2755))", prints: "1" },
    Case { name: "fchmod 4755", code: "print(call(91, os.open('f', os.O_WRONLY), 0o4755))", prints: "1" },
    Case { name: "fchmodat 6755", code: "print(call(268, AT_FDCWD, b'f', 0o6755, 0))", prints: "1" },
    Case { name: "fchmodat2 4755", code: "print(call(452, AT_FDCWD, b'f', 0o4755, 0))", prints: "1" },
    Case {
        name: "os.chmod (the C library's path)",
        code: "try: os.chmod('f', 0o4755); print('set')\nexcept PermissionError: print('refused')",
        prints: "refused",
    },
    Case {
        name: "chown 0:0 and chmod 4755 (the shell)",
        code: "print(sh('chown 0:0 f && chmod 4755 f 2>/dev/null'))",
        prints: "1",
    },
    Case { name: "chmod u+s,g+s (the shell)", code: "print(sh('chmod u+s,g+s f 2>/dev/null'))", prints: "1" },
    Case { name: "open O_CREAT 4755", code: "print(call(2, b'n', os.O_CREAT | os.O_WRONLY, 0o4755))", prints: "1" },
    Case {
        name: "openat O_CREAT 2755",
        code: "print(call(257, AT_FDCWD, b'n', os.O_CREAT | os.O_WRONLY, 0o2755))",
        prints: "1",
    },
    Case { name: "creat 4755", code: "print(call(85, b'n', 0o4755))", prints: "1" },
    Case {
        name: "O_TMPFILE 4755, then linked in",
        code: "try:\n    fd = os.open('.', os.O_TMPFILE | os.O_WRONLY, 0o4755)\n    \
               os.link(f'/proc/self/fd/{fd}', 'n', follow_symlinks=True); print('linked')\n\
               except PermissionError: print('refused')",
        prints: "refused",
    },
    Case {
        name: "openat2 O_CREAT 4755",
        code: "how = ctypes.create_string_buffer(struct.pack('QQQ', os.O_CREAT | os.O_WRONLY, 0o4755, 0), 24)\n\
               print(call(437, AT_FDCWD, b'n', how, 24))",
        prints: "38",
    },
    Case { name: "mknod a regular file 4755", code: "print(call(133, b'n', S_IFREG | 0o4755, 0))", prints: "1" },
    Case {
        name: "mknodat a character device (/dev/null's numbers)",
        code: "print(call(259, AT_FDCWD, b'n', S_IFCHR | 0o666, os.makedev(1, 3)))",
        prints: "1",
    },
    Case {
        name: "mknod a block device (loop0's numbers)",
        code: "print(call(133, b'n', S_IFBLK | 0o666, os.makedev(7, 0)))",
        prints: "1",
    },
    Case { name: "mknod c 1 3 (the shell)", code: "print(sh('mknod n c 1 3 2>/dev/null'))", prints: "1" },
    Case { name: "mkdir 2755", code: "print(call(83, b'd', 0o2755))", prints: "1" },
    Case { name: "mkdirat 4755", code: "print(call(258, AT_FDCWD, b'd', 0o4755))", prints: "1" },
    Case { name: "mkdir -m 2775 (the shell)", code: "print(sh('mkdir -m 2775 d 2>/dev/null'))", prints: "1" },
    Case {
        name: "install -m 4755 (the shell)",
        code: "print(sh('install -m 4755 /bin/true t 2>/dev/null'))",
        prints: "1",
    },
    Case {
        name: "cp -a of the image's set-user-ID programs",
        code: "print(all(sh(f'cp -a {p} /g/ 2>/dev/null') != 0 for p in suid_programs()))",
        prints: "True",
    },
    Case {
        name: "cp -p of the image's set-user-ID programs",
        code: "print(all(sh(f'cp -p {p} /g/ 2>/dev/null') != 0 for p in suid_programs()))",
        prints: "True",
    },
    Case {
        name: "rename of a set-user-ID program into the grant",
        code: "p = suid_programs()[0]\ntry: os.rename(p, '/g/x'); print('renamed')\n\
               except OSError as e: print(errno.errorcode[e.errno])",
        prints: "EXDEV",
    },
    Case {
        name: "rename of a file of the jail's own into the grant",
        code: "open('/tmp/mine', 'w').close()\ntry: os.rename('/tmp/mine', '/g/x'); print('renamed')\n\
               except OSError as e: print(errno.errorcode[e.errno])",
        prints: "EXDEV",
    },
    Case {
        name: "hard link of a set-user-ID program into the grant",
        code: "try: os.link(suid_programs()[0], '/g/x'); print('linked')\n\
               except OSError as e: print(errno.errorcode[e.errno])",
        prints: "EXDEV",
    },
    Case {
        name: "mv of a set-user-ID program into the grant (a copy)",
        code: "sh(f'mv {suid_programs()[0]} /g/ 2>/dev/null'); print('tried')",
        prints: "tried",
    },
    Case {
        name: "security.capability (cap_net_raw+ep)",
        code: "try: os.setxattr('f', 'security.capability', struct.pack('<5I', 0x02000001, 1 << 13, 0, 0, 0)); \
               print('set')\nexcept PermissionError: print('refused')",
        prints: "refused",
    },
    Case { name: "io_uring_setup", code: "print(call(425, 8, ctypes.create_string_buffer(120)))", prints: "1" },
    Case {
        name: "a write to the host's set-user-ID file clears its bit",
        code: "open('host-suid', 'a').write('x'); print(oct(os.stat('host-suid').st_mode & 0o7777))",
        prints: "0o755",
    },
    Case {
        name: "modes without privilege bits still work",
        code: "print(call(90, b'f', 0o755), call(90, b'f', 0o1777), call(83, b'd', 0o1777), \
               call(133, b'p', 0o010600, 0), call(2, b'n', os.O_CREAT | os.O_WRONLY, 0o750))",
        prints: "0 0 0 0 0",
    },
];

/// A fresh grant directory holding the host's own set-user-ID file (root's, as a host installs one).
fn fresh_grant() -> tempfile::TempDir {
    let grant = tempfile::tempdir().expect("tempdir");
    let planted = grant.path().join("host-suid");
    std::fs::write(&planted, b"#!/bin/sh\n").expect("write");
    std::fs::set_permissions(&planted, std::fs::Permissions::from_mode(0o4755)).expect("chmod");
    std::fs::set_permissions(grant.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    grant
}

/// Everything privileged under `root` but the host's own file, untouched.
fn planted(root: &Path) -> Vec<String> {
    privileged(root).into_iter().filter(|line| !line.starts_with("host-suid:")).collect()
}

#[test]
fn no_call_plants_a_privileged_file_on_the_process_tier() {
    let Some(engine) = process("no_call_plants_a_privileged_file_on_the_process_tier") else { return };
    let mut failures = Vec::new();
    for case in CASES {
        let grant = fresh_grant();
        let program = format!("{PRELUDE}\n{}", case.code);
        let (job, caps) = (python(&program), rw_grant(grant.path()));
        let outcome = engine
            .execute(RunRequest::new(&job).caps(&caps).limits(limits()).tier(TierChoice::Tier(TierKind::Process)))
            .unwrap_or_else(|e| panic!("{}: {e}", case.name));
        let printed = text(&outcome.stdout);
        if outcome.status != (Status::Exited { code: 0 }) || printed.trim() != case.prints {
            failures.push(format!("{}: printed {printed:?}, expected {:?}: {outcome:?}", case.name, case.prints));
        }
        let host = planted(grant.path());
        if !host.is_empty() {
            failures.push(format!("{}: on the host: {host:?}", case.name));
        }
        if case.name.starts_with("a write") && !privileged(grant.path()).is_empty() {
            failures.push(format!("{}: the host's file kept its bit after the job wrote to it", case.name));
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// Runs `job` on its own thread and calls `during` once the job has created `/g/.ready`; the job ends when
/// `during` has returned (it removes the marker).
fn while_running(engine: &'static Engine, job: Job, grant: &Path, during: impl FnOnce()) -> Outcome {
    let caps = rw_grant(grant);
    let running = std::thread::spawn(move || {
        engine.execute(RunRequest::new(&job).caps(&caps).limits(limits()).tier(TierChoice::Tier(TierKind::Process)))
    });
    let ready = grant.join(".ready");
    let deadline = Instant::now() + Duration::from_secs(30);
    while !ready.exists() && !running.is_finished() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(ready.exists(), "the job never got ready");
    during();
    std::fs::remove_file(&ready).expect("remove the marker");
    running.join().expect("job thread").expect("job")
}

#[test]
fn a_running_job_has_no_privileged_file_in_its_grant() {
    let Some(engine) = process("a_running_job_has_no_privileged_file_in_its_grant") else { return };
    let grant = fresh_grant();
    // Every way at once, then it waits for the host to look.
    let attempts: Vec<&str> = CASES.iter().filter(|c| !c.name.starts_with("a write")).map(|c| c.code).collect();
    let program = format!(
        "{PRELUDE}\nimport time\n{}\nopen('/g/.ready', 'w').close()\n\
         while os.path.exists('/g/.ready'): time.sleep(0.01)\nprint('done')",
        attempts
            .iter()
            .map(|code| format!("try:\n    {}\nexcept Exception as e: print(e)", code.replace('\n', "\n    ")))
            .collect::<Vec<_>>()
            .join("\n")
    );
    let mut during = Vec::new();
    let outcome = while_running(engine, python(&program), grant.path(), || during = planted(grant.path()));
    assert!(during.is_empty(), "while the job ran: {during:?}");
    assert_eq!(outcome.status, Status::Exited { code: 0 }, "{outcome:?}\n{}", text(&outcome.stderr));
    assert!(text(&outcome.stdout).ends_with("done\n"), "{}", text(&outcome.stdout));
    assert_eq!(planted(grant.path()), Vec::<String>::new(), "after the job");
}

#[test]
fn a_zygote_fork_plants_no_privileged_file() {
    let Some(engine) = process("a_zygote_fork_plants_no_privileged_file") else { return };
    let tier = engine.process().expect("process tier");
    let grant = fresh_grant();
    let (zygote, setup) = tier.python_zygote("import os", &rw_grant(grant.path()), &limits()).expect("zygote");
    assert_eq!(setup.status, Status::Exited { code: 0 }, "{setup:?}");
    let fork = "import os\nos.chdir('/g')\nopen('f', 'w').close()\nout = []\n\
                for attempt in (lambda: os.chmod('f', 0o4755), lambda: os.open('n', os.O_CREAT | os.O_WRONLY, 0o2755),\n\
                                lambda: os.mkdir('d', 0o2755), lambda: os.mknod('c', 0o020666, os.makedev(1, 3))):\n\
                \x20   try: attempt(); out.append('allowed')\n\
                \x20   except PermissionError: out.append('refused')\n\
                print(' '.join(out))";
    let outcome = zygote.fork_python(fork, &ExecOptions::default()).expect("fork");
    assert_eq!(text(&outcome.stdout), "refused refused refused refused\n", "{outcome:?}\n{}", text(&outcome.stderr));
    assert_eq!(planted(grant.path()), Vec::<String>::new());
    zygote.close();
}

#[test]
fn wasi_has_no_way_to_plant_a_privileged_file() {
    // The fs probe tries every change WASI has (create, overwrite, mkdir, rename, symlink, hard link...).
    let grant = fresh_grant();
    std::fs::write(grant.path().join("existing.txt"), b"x").expect("write");
    std::fs::create_dir(grant.path().join("subdir")).expect("mkdir");
    let caps = Capabilities {
        grants: vec![Grant::new(grant.path(), "/data", GrantMode::Rw).expect("grant")],
        ..Capabilities::default()
    };
    let outcome = crate::util::run(programs::FS, &["mutate", "/data"], &caps, &Limits::default());
    assert_eq!(outcome.status, Status::Exited { code: 0 }, "{outcome:?}");
    assert_eq!(planted(grant.path()), Vec::<String>::new());
    assert!(only_plain_kinds(grant.path()).is_empty(), "{:?}", only_plain_kinds(grant.path()));

    // CPython on WASI asks for modes and nodes: the host makes none of them.
    let code = "import os\nout = []\n\
                for attempt in (lambda: os.chmod('/g/f', 0o4755), lambda: os.open('/g/n', os.O_CREAT | os.O_WRONLY, 0o4755),\n\
                                lambda: os.mkdir('/g/d', 0o2755), lambda: os.mknod('/g/c', 0o020666, 259),\n\
                                lambda: os.mkfifo('/g/p'), lambda: os.setxattr('/g/f', 'security.capability', b'x')):\n\
                \x20   try: attempt(); out.append('ran')\n\
                \x20   except Exception as e: out.append(type(e).__name__)\n\
                print(' '.join(out))";
    std::fs::write(grant.path().join("f"), b"").expect("write");
    let outcome = crate::util::python(code, &rw_grant(grant.path()), &Limits::default());
    assert_eq!(outcome.status, Status::Exited { code: 0 }, "{outcome:?}\n{}", text(&outcome.stderr));
    assert_eq!(planted(grant.path()), Vec::<String>::new(), "{}", text(&outcome.stdout));
    assert!(only_plain_kinds(grant.path()).is_empty(), "{:?}", only_plain_kinds(grant.path()));
}

/// What under `root` is neither a regular file, a directory nor a link.
fn only_plain_kinds(root: &Path) -> Vec<PathBuf> {
    let mut odd = Vec::new();
    let mut pending = vec![root.to_owned()];
    while let Some(dir) = pending.pop() {
        for entry in std::fs::read_dir(&dir).expect("read_dir") {
            let path = entry.expect("entry").path();
            let kind = std::fs::symlink_metadata(&path).expect("lstat").file_type();
            if kind.is_dir() {
                pending.push(path);
            } else if !kind.is_file() && !kind.is_symlink() {
                odd.push(path);
            }
        }
    }
    odd
}

/// Runs `script` with `sh` in `dir`, as root: what a guest cannot do, done to a scratch copy from outside.
fn sh_in(dir: &Path, script: &str) {
    let status = std::process::Command::new("sh").args(["-c", script]).current_dir(dir).status().expect("sh");
    assert!(status.success(), "{script}");
}

#[test]
fn committing_a_scratch_copy_plants_nothing() {
    use strata_engine::escalate::ScratchGrants;
    let grant = tempfile::tempdir().expect("tempdir");
    std::fs::write(grant.path().join("plain"), b"x").expect("write");
    let outside = tempfile::tempdir().expect("tempdir");
    let caps = rw_grant(grant.path());
    let parent = tempfile::tempdir().expect("tempdir");
    let scratch = ScratchGrants::prepare(&caps, 1 << 20, parent.path()).expect("prepare").expect("an rw grant");
    let copy = scratch.caps(&caps).grants[0].host.clone();
    sh_in(
        &copy,
        &format!(
            "printf new > new && chmod 4755 new plain && mkdir -m 2775 sgid && mknod dev c 1 3 && mkfifo fifo \
             && ln -s {} out && python3 -c \"import os, struct; \
             os.setxattr('new', 'security.capability', struct.pack('<5I', 0x02000001, 1 << 13, 0, 0, 0))\"",
            outside.path().display()
        ),
    );
    scratch.commit().expect("commit");
    assert_eq!(privileged(grant.path()), Vec::<String>::new());
    assert_eq!(only_plain_kinds(grant.path()), Vec::<PathBuf>::new(), "a device or FIFO was committed");
    let mode = |name: &str| std::fs::symlink_metadata(grant.path().join(name)).expect(name).mode() & 0o7777;
    assert_eq!((mode("new"), mode("plain"), mode("sgid")), (0o755, 0o755, 0o775));
    assert_eq!(std::fs::read_link(grant.path().join("out")).expect("a link, as a link"), outside.path());
    assert_eq!(std::fs::read_dir(outside.path()).expect("dir").count(), 0);
}

#[test]
fn committing_a_scratch_copy_never_writes_through_a_host_link() {
    use strata_engine::escalate::ScratchGrants;
    let grant = tempfile::tempdir().expect("tempdir");
    std::fs::create_dir(grant.path().join("sub")).expect("mkdir");
    let outside = tempfile::tempdir().expect("tempdir");
    let caps = rw_grant(grant.path());
    let parent = tempfile::tempdir().expect("tempdir");
    let scratch = ScratchGrants::prepare(&caps, 1 << 20, parent.path()).expect("prepare").expect("an rw grant");
    sh_in(&scratch.caps(&caps).grants[0].host, "printf mine > sub/inside && chmod 4755 sub/inside");
    // Someone on the host swaps the grant's directory for a link out of it before the commit.
    std::fs::remove_dir(grant.path().join("sub")).expect("rmdir");
    std::os::unix::fs::symlink(outside.path(), grant.path().join("sub")).expect("symlink");
    assert!(scratch.commit().is_err(), "a commit through a host link went on");
    assert_eq!(std::fs::read_dir(outside.path()).expect("dir").count(), 0, "the commit wrote through a host link");
}
