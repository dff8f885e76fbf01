//! Live forks on the process tier: a zygote held after its setup and forked per job (see
//! `strata_tier_process::zygote` and `strata_jail::zygote`). State carried into forks, forks independent of each
//! other and of the zygote, fresh randomness and identity, a clock that moves forward, each fork alone in its
//! namespaces with no capability, limits per fork, zygotes that cannot be held refused with a reason, a tampered
//! zygote's forks refused, nothing left behind.

use std::collections::HashSet;
use std::sync::Mutex;
use std::time::Duration;

use strata_core::{ByteSize, Capabilities, ExecOptions, Job, LimitKind, Limits, Outcome, Status, TierError};
use strata_tier_process::ProcessTier;
use strata_tier_process::zygote::ProcessZygote;

use crate::util::process_tier;

/// The tests here count processes and cgroups: one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn ok(outcome: &Outcome) -> String {
    assert_eq!(outcome.status, Status::Exited { code: 0 }, "{outcome:?}\nstderr: {}", text(&outcome.stderr));
    text(&outcome.stdout)
}

fn fork(zygote: &ProcessZygote, source: &str) -> Outcome {
    zygote.fork_python(source, &ExecOptions::default()).expect("fork")
}

/// Setup: a module imported, globals, a file in `/tmp` and one in the working directory, the time.
const SETUP: &str = "import json, os, time\n\
                     x = 41\n\
                     data = {'n': 1}\n\
                     open('/tmp/setup', 'w').write('from setup')\n\
                     os.chdir('/srv')\n\
                     open('here', 'w').write('cwd file')\n\
                     t0 = time.time()\n\
                     print('setup done')";

fn zygote(tier: &ProcessTier) -> ProcessZygote {
    let (zygote, setup) = tier.python_zygote(SETUP, &Capabilities::default(), &Limits::default()).expect("zygote");
    assert_eq!(ok(&setup), "setup done\n");
    zygote
}

#[test]
fn a_fork_starts_from_the_setup_state() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(tier) = process_tier("a_fork_starts_from_the_setup_state") else { return };
    let zygote = zygote(tier);
    let out = fork(
        &zygote,
        "import sys\n\
         print(x + 1, data['n'], 'json' in sys.modules)\n\
         print(open('/tmp/setup').read(), open('here').read(), os.getcwd())",
    );
    assert_eq!(ok(&out), "42 1 True\nfrom setup cwd file /srv\n");
    // The fork's stdin: what follows the source.
    let opts = ExecOptions { stdin: Some(b"hello from stdin".to_vec()), ..ExecOptions::default() };
    let out = zygote.fork_python("import sys\nprint(sys.stdin.read())", &opts).expect("fork");
    assert_eq!(ok(&out), "hello from stdin\n");
    // Exit codes and exceptions are the fork's.
    let out = fork(&zygote, "raise SystemExit(3)");
    assert_eq!(out.status, Status::Exited { code: 3 });
    let out = fork(&zygote, "raise ValueError('boom')");
    assert_eq!(out.status, Status::Exited { code: 1 });
    assert!(text(&out.stderr).contains("ValueError: boom"), "{}", text(&out.stderr));
    zygote.close();
}

#[test]
fn forks_are_independent_of_each_other_and_of_the_zygote() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(tier) = process_tier("forks_are_independent_of_each_other_and_of_the_zygote") else { return };
    let zygote = zygote(tier);
    let first = fork(
        &zygote,
        "x = 100\ndata['n'] = 2\n\
         open('/tmp/setup', 'w').write('changed')\n\
         open('/tmp/mine', 'w').write('first')\n\
         os.remove('here')\n\
         print(x, data['n'])",
    );
    assert_eq!(ok(&first), "100 2\n");
    let second = fork(
        &zygote,
        "print(x, data['n'], open('/tmp/setup').read(), os.path.exists('/tmp/mine'), os.path.exists('here'))",
    );
    assert_eq!(ok(&second), "41 1 from setup False True\n");
    zygote.close();
}

#[test]
fn forks_get_fresh_randomness_identity_and_a_clock_that_moves_on() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(tier) = process_tier("forks_get_fresh_randomness_identity_and_a_clock_that_moves_on") else { return };
    let zygote = zygote(tier);
    let probe = "import random, socket\n\
                 print(os.urandom(16).hex(), random.random(), socket.gethostname(), os.getpid(), time.time() >= t0)";
    let mut seen = HashSet::new();
    let mut hosts = HashSet::new();
    for _ in 0..4 {
        let line = ok(&fork(&zygote, probe));
        let fields: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(fields.len(), 5, "{line}");
        assert!(seen.insert(fields[0].to_owned()), "os.urandom repeated across forks: {line}");
        assert!(seen.insert(fields[1].to_owned()), "random.random repeated across forks: {line}");
        assert!(hosts.insert(fields[2].to_owned()), "hostname repeated across forks: {line}");
        assert_eq!(fields[3], "1", "a fork is PID 1 of its own PID namespace: {line}");
        assert_eq!(fields[4], "True", "the clock went back: {line}");
    }
    zygote.close();
}

#[test]
fn a_fork_is_alone_and_unprivileged() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(tier) = process_tier("a_fork_is_alone_and_unprivileged") else { return };
    let zygote = zygote(tier);
    let out = fork(
        &zygote,
        "import ctypes, errno\n\
         pids = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())\n\
         status = dict(l.split(':\\t', 1) for l in open('/proc/self/status').read().splitlines() if ':\\t' in l)\n\
         print('pids', pids)\n\
         print('caps', status['CapEff'].strip(), status['CapPrm'].strip(), status['NoNewPrivs'].strip(), status['Seccomp'].strip())\n\
         print('fds', sorted(int(f) for f in os.listdir('/proc/self/fd')))\n\
         libc = ctypes.CDLL(None, use_errno=True)\n\
         rc = libc.unshare(0x10000000)\n\
         print('unshare', rc, errno.errorcode.get(ctypes.get_errno()))\n\
         rc = libc.mount(b'none', b'/mnt', b'tmpfs', 0, None)\n\
         print('mount', rc, errno.errorcode.get(ctypes.get_errno()))\n\
         print('keys', open('/proc/keys').read() == '')",
    );
    let out = ok(&out);
    // Only the fork itself (PID 1) — and the listing's own process is the fork too.
    assert!(out.contains("pids [1]\n"), "{out}");
    assert!(out.contains("caps 0000000000000000 0000000000000000 1 2\n"), "{out}");
    // 0, 1, 2 and the descriptor listing /proc/self/fd.
    assert!(out.contains("fds [0, 1, 2, 3]\n"), "{out}");
    assert!(out.contains("unshare -1 ENOSYS\n") || out.contains("unshare -1 EPERM\n"), "{out}");
    assert!(out.contains("mount -1 EPERM\n"), "{out}");
    assert!(out.contains("keys True\n"), "{out}");
    zygote.close();
}

#[test]
fn limits_are_the_forks_and_the_zygote_survives_them() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(tier) = process_tier("limits_are_the_forks_and_the_zygote_survives_them") else { return };
    let zygote = zygote(tier);
    let wall = ExecOptions {
        limits: Some(Limits { wall: Duration::from_millis(300), ..Limits::default() }),
        ..ExecOptions::default()
    };
    let out = zygote.fork_python("while True: pass", &wall).expect("fork");
    assert_eq!(out.status, Status::LimitExceeded { limit: LimitKind::Wall }, "{out:?}");
    let memory = ExecOptions {
        limits: Some(Limits { memory: ByteSize(64 << 20), ..Limits::default() }),
        ..ExecOptions::default()
    };
    let out = zygote.fork_python("b = bytearray(512 << 20)\nprint(len(b))", &memory).expect("fork");
    assert_eq!(out.status, Status::LimitExceeded { limit: LimitKind::Memory }, "{out:?}");
    let output =
        ExecOptions { limits: Some(Limits { output: ByteSize(1000), ..Limits::default() }), ..ExecOptions::default() };
    let out = zygote.fork_python("print('x' * 100000)", &output).expect("fork");
    assert!(out.truncated.stdout && out.stdout.len() <= 1000, "{out:?}");
    // Another disk limit than the zygote's: a fork made for the request, its tmpfs that size.
    let disk =
        ExecOptions { limits: Some(Limits { disk: ByteSize(4 << 20), ..Limits::default() }), ..ExecOptions::default() };
    let out = zygote
        .fork_python(
            "open('/tmp/small', 'wb').write(bytes(1 << 20))\nopen('/tmp/big', 'wb').write(bytes(8 << 20))",
            &disk,
        )
        .expect("fork");
    assert_eq!(out.status, Status::Exited { code: 1 }, "{out:?}");
    assert!(text(&out.stderr).contains("No space left on device"), "{}", text(&out.stderr));
    assert_eq!(ok(&fork(&zygote, "print(x)")), "41\n");
    zygote.close();
}

#[test]
fn forks_run_side_by_side() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(tier) = process_tier("forks_run_side_by_side") else { return };
    let zygote = zygote(tier);
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..6)
            .map(|i| {
                let zygote = &zygote;
                scope.spawn(move || {
                    for j in 0..3 {
                        let out = fork(zygote, &format!("import time\ntime.sleep(0.05)\nprint(x + {i} * 10 + {j})"));
                        assert_eq!(ok(&out), format!("{}\n", 41 + i * 10 + j));
                    }
                })
            })
            .collect();
        for handle in handles {
            handle.join().expect("thread");
        }
    });
    zygote.close();
}

fn refused(tier: &ProcessTier, setup: &str) -> String {
    match tier.python_zygote(setup, &Capabilities::default(), &Limits::default()) {
        Ok(_) => panic!("{setup:?} was held as a zygote"),
        Err(err) => err.to_string(),
    }
}

#[test]
fn zygotes_that_cannot_be_held_are_refused_with_the_reason() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(tier) = process_tier("zygotes_that_cannot_be_held_are_refused_with_the_reason") else { return };
    let threads =
        refused(tier, "import threading, time\nthreading.Thread(target=time.sleep, args=(60,), daemon=True).start()");
    assert!(threads.contains("threads"), "{threads}");
    let shared = refused(tier, "import mmap\nm = mmap.mmap(-1, 4096, mmap.MAP_SHARED)");
    assert!(shared.contains("shared writable mapping"), "{shared}");
    let failed = refused(tier, "raise ValueError('bad setup')");
    assert!(failed.contains("ValueError: bad setup"), "{failed}");
    let network = tier.zygote(
        &Job::Command { argv: vec!["true".into()] },
        &Capabilities {
            net: strata_core::Net::allow(["example.com"]).expect("valid allowlist"),
            ..Capabilities::default()
        },
        &Limits::default(),
    );
    assert!(matches!(network, Err(TierError::Unsupported { .. })), "{network:?}");
}

#[test]
fn a_zygote_that_tampers_with_its_fork_channel_gets_no_fork() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(tier) = process_tier("a_zygote_that_tampers_with_its_fork_channel_gets_no_fork") else { return };
    // Descriptor 4 replaced by a pipe with bytes in it: the injected recvmsg must not take anything from it.
    let setup = "import os\nr, w = os.pipe()\nos.write(w, b'x' * 64)\nos.dup2(r, 4)";
    let (zygote, _) = tier.python_zygote(setup, &Capabilities::default(), &Limits::default()).expect("zygote");
    let err = zygote.fork_python("print('escaped')", &ExecOptions::default()).expect_err("fork");
    assert!(err.to_string().contains("stdio"), "{err}");
    // Still refused, nothing half-made left running.
    assert!(zygote.fork_python("print(1)", &ExecOptions::default()).is_err());
    zygote.close();
}

#[test]
fn a_command_zygote_follows_the_convention() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(tier) = process_tier("a_command_zygote_follows_the_convention") else { return };
    let script = "echo setting up; x=41; printf r >&3; read line; echo \"$line $x\"";
    let job = Job::Command { argv: vec!["sh".into(), "-c".into(), script.into()] };
    let (zygote, setup) = tier.zygote(&job, &Capabilities::default(), &Limits::default()).expect("zygote");
    assert_eq!(ok(&setup), "setting up\n");
    for word in ["one", "two"] {
        let out = zygote.fork(format!("{word}\n").as_bytes(), &ExecOptions::default()).expect("fork");
        assert_eq!(ok(&out), format!("{word} 41\n"));
    }
    assert!(zygote.fork_python("print(1)", &ExecOptions::default()).is_err());
    zygote.close();
}

fn count(dir: &str) -> usize {
    std::fs::read_dir(dir).map(|d| d.count()).unwrap_or(0)
}

/// Mounts, descriptors, child processes (jail keepers) and jail cgroups of this test process.
fn held(tier: &ProcessTier) -> [usize; 4] {
    let children = std::fs::read_dir("/proc/self/task")
        .map(|tasks| {
            tasks
                .flatten()
                .map(|t| std::fs::read_to_string(t.path().join("children")).unwrap_or_default())
                .map(|c| c.split_whitespace().count())
                .sum()
        })
        .unwrap_or(0);
    [
        std::fs::read_to_string("/proc/self/mountinfo").map(|m| m.lines().count()).unwrap_or(0),
        count("/proc/self/fd"),
        children,
        tier.cgroups().count(),
    ]
}

#[test]
fn a_hundred_forks_leave_nothing_behind() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(tier) = process_tier("a_hundred_forks_leave_nothing_behind") else { return };
    // Warm up (the embedded jail binary's memfd, the engine's lazies).
    let warm = zygote(tier);
    assert_eq!(ok(&fork(&warm, "print(x)")), "41\n");
    warm.close();
    let before = held(tier);
    let zygote = zygote(tier);
    for i in 0..100 {
        assert_eq!(ok(&fork(&zygote, &format!("print(x + {i})"))), format!("{}\n", 41 + i));
    }
    zygote.close();
    // Other tests of this binary start jails too: wait until theirs are gone as well.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let mut after = held(tier);
    while after.iter().zip(&before).any(|(a, b)| a > b) && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
        after = held(tier);
    }
    assert!(
        after.iter().zip(&before).all(|(a, b)| a <= b),
        "[mounts, fds, children, cgroups] before {before:?}, after {after:?}"
    );
}
