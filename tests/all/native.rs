//! The native conformance suite: one table of cases that every native tier must pass (today the process tier;
//! the microVM tier runs the same table where the host has hardware KVM).
//!
//! Each case is a job, its capabilities and limits, and what the outcome must be. A tier that cannot run on this
//! host is skipped with one line saying why; nothing passes without running.

use std::io::Write;
use std::net::TcpListener;
use std::path::Path;

use strata_core::{
    Capabilities, EnvVar, ExecOptions, Grant, GrantMode, Job, LimitKind, Limits, LimitsOverride, Outcome, PythonSource,
    Status, TierKind,
};
use strata_engine::{Engine, RunRequest, TierChoice};
use strata_test_programs as programs;

use crate::util::python_engine;

/// The native tiers this host can run one-shot jobs on, each with the engine to run it on; prints a skip line for
/// the others.
fn native_tiers() -> Vec<(&'static Engine, TierKind)> {
    let mut tiers = session_tiers();
    let engine = python_engine();
    match engine.microvm() {
        Ok(_) => tiers.push((engine, TierKind::Microvm)),
        Err(err) => eprintln!("skip: the microvm tier cannot run on this host: {err}"),
    }
    tiers
}

/// The native tiers this host can run sessions on (the microVM tier has no sessions yet: one line says so).
fn session_tiers() -> Vec<(&'static Engine, TierKind)> {
    let engine = python_engine();
    let mut tiers = Vec::new();
    match engine.process() {
        Ok(_) => tiers.push((engine, TierKind::Process)),
        Err(err) => eprintln!("skip: the process tier cannot run on this host: {err}"),
    }
    assert!(!tiers.is_empty() || std::env::var_os("STRATA_REQUIRE_PROCESS_TIER").is_none(), "process tier required");
    tiers
}

fn sh(script: &str) -> Job {
    Job::Command { argv: vec!["sh".into(), "-c".into(), script.into()] }
}

fn python(code: &str) -> Job {
    Job::Python { source: PythonSource::Code(code.into()), args: Vec::new() }
}

fn limits(text: &str) -> Limits {
    let over: LimitsOverride = toml::from_str(text).expect("limits");
    over.apply(&Limits::default())
}

fn run(engine: &Engine, tier: TierKind, job: &Job, caps: &Capabilities, limits: &Limits) -> Outcome {
    engine
        .execute(RunRequest::new(job).caps(caps).limits(limits.clone()).tier(TierChoice::Tier(tier)))
        .unwrap_or_else(|e| panic!("{tier}: {job:?}: {e}"))
}

fn stdout(o: &Outcome) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// What a case's outcome must satisfy.
enum Expect {
    /// Exit code and exact stdout.
    Prints(i32, &'static str),
    /// Exit code and a substring of stdout.
    Contains(i32, &'static str),
    /// A limit stopped it.
    Limit(LimitKind),
}

struct Case {
    name: &'static str,
    job: Job,
    caps: Capabilities,
    stdin: Vec<u8>,
    limits: Limits,
    expect: Expect,
}

fn case(name: &'static str, job: Job, expect: Expect) -> Case {
    Case { name, job, caps: Capabilities::default(), stdin: Vec::new(), limits: Limits::default(), expect }
}

fn cases() -> Vec<Case> {
    let libc = "import ctypes, os; libc = ctypes.CDLL(None, use_errno=True); ";
    vec![
        case("echo", Job::Command { argv: vec!["echo".into(), "hello".into()] }, Expect::Prints(0, "hello\n")),
        case("exit code", sh("exit 7"), Expect::Prints(7, "")),
        // A job starts with no signal ignored or blocked, as from a fresh shell (not with what the server's process
        // had: Rust ignores SIGPIPE, so `yes | head -1` said "Broken pipe"; a background start ignores SIGINT).
        case(
            "signals at their defaults",
            sh("yes 2>/tmp/yes.err | head -1 >/dev/null; cat /tmp/yes.err; grep -E '^Sig(Blk|Ign)' /proc/self/status"),
            Expect::Prints(0, "SigBlk:\t0000000000000000\nSigIgn:\t0000000000000000\n"),
        ),
        case("exit code 0 with output", sh("echo out; echo err >&2"), Expect::Prints(0, "out\n")),
        case(
            "argv passes words intact",
            Job::Command {
                argv: vec![
                    "sh".into(),
                    "-c".into(),
                    "printf '%s|' \"$@\"".into(),
                    "x".into(),
                    "a b".into(),
                    "c".into(),
                ],
            },
            Expect::Prints(0, "a b|c|"),
        ),
        Case {
            caps: Capabilities {
                env: vec![EnvVar { name: "GREETING".into(), value: "bonjour".into() }],
                ..Capabilities::default()
            },
            ..case("env", sh("echo $GREETING; echo $HOME"), Expect::Prints(0, "bonjour\n/root\n"))
        },
        Case { stdin: b"line one\nline two\n".to_vec(), ..case("stdin", sh("wc -l"), Expect::Prints(0, "2\n")) },
        Case {
            stdin: b"piped".to_vec(),
            ..case(
                "static C binary from the host",
                Job::Native {
                    program: programs::NATIVE_HELLO.into(),
                    args: vec!["--exit".into(), "3".into(), "--stdin".into(), "world".into()],
                },
                Expect::Contains(3, "): world\npiped"),
            )
        },
        case(
            "python3 with the stdlib",
            python("import json, hashlib, sqlite3; print(json.dumps({'h': hashlib.sha256(b'x').hexdigest()[:8]}))"),
            Expect::Prints(0, "{\"h\": \"2d711642\"}\n"),
        ),
        case("pip", Job::Command { argv: vec!["pip".into(), "--version".into()] }, Expect::Contains(0, "pip ")),
        case(
            "only the jail's own processes are visible",
            python(
                "import os; pids = sorted(int(p) for p in os.listdir('/proc') if p.isdigit()); \
                 print(len(pids), pids[0], os.getpid() in pids)",
            ),
            Expect::Prints(0, "2 1 True\n"),
        ),
        case("every capability dropped", sh("grep CapEff /proc/self/status"), Expect::Contains(0, "0000000000000000")),
        case("hostname", Job::Command { argv: vec!["hostname".into()] }, Expect::Prints(0, "strata\n")),
        case(
            "seccomp refuses mount",
            python(&format!("{libc}print(libc.mount(b'none', b'/mnt', b'tmpfs', 0, None), ctypes.get_errno())")),
            Expect::Prints(0, "-1 1\n"),
        ),
        case(
            "seccomp refuses ptrace",
            python(&format!("{libc}print(libc.ptrace(0, 0, None, None), ctypes.get_errno())")),
            Expect::Prints(0, "-1 1\n"),
        ),
        case(
            "seccomp refuses unshare of a namespace",
            python(&format!("{libc}print(libc.unshare(0x40000000), ctypes.get_errno())")),
            Expect::Prints(0, "-1 1\n"),
        ),
        case(
            "seccomp refuses keyring calls",
            python(&format!("{libc}print(libc.syscall(250, 0, 0, 0, 0), ctypes.get_errno())")),
            Expect::Prints(0, "-1 1\n"),
        ),
        case(
            "seccomp filter and no_new_privs are on",
            sh("grep -E '^(Seccomp|NoNewPrivs):' /proc/self/status | tr -s '\t' ' '"),
            Expect::Prints(0, "NoNewPrivs: 1\nSeccomp: 2\n"),
        ),
        case(
            "seccomp refuses even calls harmless without it (personality query) and the dangerous families",
            python(&format!(
                "{libc}print([(libc.syscall(n, 0xffffffff, 0, 0, 0, 0), ctypes.get_errno()) for n in \
                 (135, 321, 298, 246, 175, 308, 304, 425, 323, 155, 161, 167)])"
            )),
            Expect::Prints(
                0,
                "[(-1, 1), (-1, 1), (-1, 1), (-1, 1), (-1, 1), (-1, 1), (-1, 1), (-1, 1), (-1, 1), (-1, 1), (-1, 1), (-1, 1)]\n",
            ),
        ),
        case(
            "threads and processes still work (clone3 falls back to clone)",
            python(
                "import threading, subprocess; t = threading.Thread(target=print, args=('thread',)); t.start(); \
                 t.join(); print(subprocess.run(['echo', 'child'], capture_output=True, text=True).stdout, end='')",
            ),
            Expect::Prints(0, "thread\nchild\n"),
        ),
        case(
            "no network: only an unconnected loopback",
            python(
                "import socket\nfor addr in [('10.0.0.1', 80), ('8.8.8.8', 53)]:\n    s = socket.socket()\n    \
                 try:\n        s.connect(addr)\n    except OSError as e:\n        print(e.errno)\n",
            ),
            Expect::Prints(0, "101\n101\n"),
        ),
        Case {
            limits: limits("memory = \"64MiB\""),
            ..case("memory hog", python("x = bytearray(512 << 20)"), Expect::Limit(LimitKind::Memory))
        },
        Case {
            limits: limits("pids = 32\nwall = \"20s\""),
            ..case(
                "fork bomb",
                Job::Command { argv: vec!["bash".into(), "-c".into(), ":(){ :|:& };:; sleep 10".into()] },
                Expect::Limit(LimitKind::Pids),
            )
        },
        Case {
            limits: limits("cpu = \"300ms\""),
            ..case("spin loop (cpu)", sh("while :; do :; done"), Expect::Limit(LimitKind::Cpu))
        },
        Case {
            limits: limits("wall = \"300ms\""),
            ..case("sleeper (wall)", sh("sleep 30"), Expect::Limit(LimitKind::Wall))
        },
        Case {
            limits: limits("disk = \"8MiB\""),
            ..case(
                "scratch disk is capped",
                // The file goes again: a job that leaves the layer full is `limit_exceeded`/`disk` on the process
                // tier (tests/all/adversarial/outcomes.rs), and this case is the same on every tier.
                sh("dd if=/dev/zero of=/tmp/big bs=1M count=32 2>/dev/null; echo $?; rm /tmp/big"),
                Expect::Prints(0, "1\n"),
            )
        },
    ]
}

fn check(tier: TierKind, case: &Case, outcome: &Outcome) {
    let context = format!("{tier}: case {:?}: {outcome:?}", case.name);
    assert_eq!(outcome.tier, tier, "{context}");
    match &case.expect {
        Expect::Prints(code, text) => {
            assert_eq!(outcome.status, Status::Exited { code: *code }, "{context}");
            assert_eq!(stdout(outcome), *text, "{context}");
        }
        Expect::Contains(code, text) => {
            assert_eq!(outcome.status, Status::Exited { code: *code }, "{context}");
            assert!(stdout(outcome).contains(text), "{context}");
        }
        Expect::Limit(limit) => assert_eq!(outcome.status, Status::LimitExceeded { limit: *limit }, "{context}"),
    }
}

#[test]
fn conformance_cases() {
    for (engine, tier) in native_tiers() {
        for case in cases() {
            let request = RunRequest::new(&case.job).caps(&case.caps).limits(case.limits.clone());
            let request = request.tier(TierChoice::Tier(tier)).stdin(case.stdin.clone());
            let outcome = engine.execute(request).unwrap_or_else(|e| panic!("{tier}: {}: {e}", case.name));
            check(tier, &case, &outcome);
        }
    }
}

#[test]
fn ten_mib_of_output_arrive_byte_exact() {
    for (engine, tier) in native_tiers() {
        let job = python("import sys; sys.stdout.buffer.write(bytes(range(256)) * 40960)");
        let outcome = run(engine, tier, &job, &Capabilities::default(), &limits("output = \"16MiB\""));
        let expected: Vec<u8> = (0..=255u8).cycle().take(10 << 20).collect();
        assert_eq!(outcome.status, Status::Exited { code: 0 });
        assert!(outcome.stdout == expected, "{tier}: {} bytes, not the 10 MiB sent", outcome.stdout.len());
        assert_eq!(outcome.usage.stdout_bytes, 10 << 20);
        assert!(!outcome.truncated.stdout);
    }
}

#[test]
fn output_beyond_the_limit_is_counted_and_cut() {
    for (engine, tier) in native_tiers() {
        let job = sh("head -c 3000000 /dev/zero");
        let outcome = run(engine, tier, &job, &Capabilities::default(), &limits("output = \"1MiB\""));
        assert_eq!(outcome.status, Status::Exited { code: 0 });
        assert_eq!(outcome.stdout.len(), 1 << 20);
        assert_eq!(outcome.usage.stdout_bytes, 3_000_000);
        assert!(outcome.truncated.stdout);
    }
}

#[test]
fn usage_reports_cgroup_cpu_and_memory() {
    for (engine, tier) in native_tiers() {
        let job = python("x = bytearray(64 << 20)\nfor i in range(0, len(x), 4096): x[i] = 1\nsum(range(3_000_000))");
        let outcome = run(engine, tier, &job, &Capabilities::default(), &Limits::default());
        assert_eq!(outcome.status, Status::Exited { code: 0 }, "{outcome:?}");
        assert!(outcome.usage.peak_memory >= 64 << 20, "{tier}: peak {}", outcome.usage.peak_memory);
        assert!(outcome.usage.cpu.as_millis() >= 20, "{tier}: cpu {:?}", outcome.usage.cpu);
        assert_eq!(outcome.usage.fuel, None);
    }
}

#[test]
fn secrets_are_redacted_from_output() {
    for (engine, tier) in native_tiers() {
        let caps = Capabilities {
            secrets: vec![EnvVar { name: "TOKEN".into(), value: "s3cr3t-value".into() }],
            ..Capabilities::default()
        };
        let outcome = run(engine, tier, &sh("echo token=$TOKEN; echo $TOKEN >&2"), &caps, &Limits::default());
        assert_eq!(stdout(&outcome), "token=[REDACTED:TOKEN]\n");
        assert_eq!(String::from_utf8_lossy(&outcome.stderr), "[REDACTED:TOKEN]\n");
    }
}

#[test]
fn host_files_are_invisible() {
    let marker = tempfile::tempdir().expect("tempdir");
    std::fs::write(marker.path().join("marker"), "host secret").expect("write");
    let checkout = Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml");
    let home = std::env::var("HOME").unwrap_or_else(|_| "/root".into());
    let host_shadow = std::fs::read_to_string("/etc/shadow").unwrap_or_default();
    for (engine, tier) in native_tiers() {
        for path in [marker.path().join("marker"), checkout.clone(), Path::new(&home).join(".cache/strata")] {
            let job = Job::Command { argv: vec!["test".into(), "-e".into(), path.display().to_string()] };
            let outcome = run(engine, tier, &job, &Capabilities::default(), &Limits::default());
            assert_eq!(outcome.status, Status::Exited { code: 1 }, "{tier}: {} is visible", path.display());
        }
        let shadow = run(engine, tier, &sh("cat /etc/shadow"), &Capabilities::default(), &Limits::default());
        assert!(!host_shadow.is_empty() && stdout(&shadow) != host_shadow, "{tier}: the host's /etc/shadow is visible");
    }
}

#[test]
fn the_hosts_loopback_is_not_reachable() {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("addr").port();
    for (engine, tier) in native_tiers() {
        let code = format!(
            "import socket\ns = socket.socket()\ntry:\n    s.connect(('127.0.0.1', {port}))\n    print('connected')\n\
             except OSError as e:\n    print(e.errno)\n"
        );
        let outcome = run(engine, tier, &python(&code), &Capabilities::default(), &Limits::default());
        assert_eq!(stdout(&outcome), "111\n", "{tier}: {outcome:?}");
    }
    drop(listener);
}

#[test]
fn grants_are_bind_mounted_read_only_or_read_write() {
    let ro = tempfile::tempdir().expect("tempdir");
    let rw = tempfile::tempdir().expect("tempdir");
    std::fs::write(ro.path().join("in.txt"), "input").expect("write");
    for (engine, tier) in native_tiers() {
        let caps = Capabilities {
            grants: vec![
                Grant::new(ro.path(), "/data/in", GrantMode::Ro).expect("grant"),
                Grant::new(rw.path(), "/data/out", GrantMode::Rw).expect("grant"),
            ],
            ..Capabilities::default()
        };
        let script = "cat /data/in/in.txt; echo; echo x > /data/in/new 2>/dev/null || echo ro-refused; \
                      rm /data/in/in.txt 2>/dev/null || echo rm-refused; \
                      mount -o remount,rw /data/in 2>/dev/null || echo remount-refused; \
                      echo written > /data/out/result.txt && echo rw-ok";
        let outcome = run(engine, tier, &sh(script), &caps, &Limits::default());
        if tier == TierKind::Microvm {
            // The guest may change its own copy of a read-only grant; only the host's copy matters.
            let out = stdout(&outcome);
            assert!(out.starts_with("input\n") && out.ends_with("rw-ok\n"), "{tier}: {outcome:?}");
        } else {
            assert_eq!(
                stdout(&outcome),
                "input\nro-refused\nrm-refused\nremount-refused\nrw-ok\n",
                "{tier}: {outcome:?}"
            );
        }
        assert_eq!(std::fs::read_to_string(rw.path().join("result.txt")).expect("rw result"), "written\n");
        assert!(!ro.path().join("new").exists());
        assert!(ro.path().join("in.txt").exists());
        std::fs::remove_file(rw.path().join("result.txt")).expect("cleanup");
    }
}

#[test]
fn bad_jobs_are_typed_errors() {
    for (engine, tier) in native_tiers() {
        let run =
            |job: &Job| engine.execute(RunRequest::new(job).limits(Limits::default()).tier(TierChoice::Tier(tier)));
        let missing = Job::Command { argv: vec!["no-such-program".into()] };
        let err = run(&missing).expect_err("missing program");
        assert_eq!(err.code(), "program_not_found", "{err}");
        let empty = Job::Command { argv: vec![] };
        assert!(run(&empty).is_err());
        let absent = Job::Native { program: "/no/such/file".into(), args: vec![] };
        let err = run(&absent).expect_err("absent file");
        assert_eq!(err.code(), "input_unreadable", "{err}");
        let not_exec = Job::Command { argv: vec!["/etc/hostname".into()] };
        let err = run(&not_exec).expect_err("not executable");
        assert_eq!(err.code(), "exec_failed", "{err}");
        let wasm = Job::wasm_file(programs::HELLO, vec![]);
        let err = run(&wasm).expect_err("wasm on native");
        assert_eq!(err.code(), "wrong_job", "{err}");
    }
}

#[test]
fn sessions_keep_their_filesystem_between_jobs() {
    for (engine, tier) in session_tiers() {
        let sandbox =
            engine.start(TierChoice::Tier(tier), &Capabilities::default(), &Limits::default()).expect("start");
        assert_eq!(sandbox.tier(), tier);
        let first =
            sandbox.exec(&sh("echo 41 > /tmp/state; pip --version >/dev/null && echo ok"), ExecOptions::default());
        assert_eq!(stdout(&first.expect("first")), "ok\n");
        let second = sandbox.exec(&python("print(int(open('/tmp/state').read()) + 1)"), ExecOptions::default());
        assert_eq!(stdout(&second.expect("second")), "42\n");

        sandbox.write_file("/root/notes/hello.txt", b"from the host").expect("write_file");
        let third = sandbox.exec(&sh("cat /root/notes/hello.txt; echo back > /root/reply.txt"), ExecOptions::default());
        assert_eq!(stdout(&third.expect("third")), "from the host");
        assert_eq!(sandbox.read_file("/root/reply.txt").expect("read_file"), b"back\n");
        let err = sandbox.read_file("/root/absent").expect_err("absent");
        assert_eq!(err.code(), "guest_path");
        let err = sandbox.read_file("/root/../etc/passwd").expect_err("dotdot");
        assert_eq!(err.code(), "guest_path");

        // A job that hits its wall limit is killed; the session and its files live on.
        let opts = ExecOptions { limits: Some(limits("wall = \"200ms\"")), ..ExecOptions::default() };
        let slow = sandbox.exec(&sh("sleep 30"), opts).expect("slow");
        assert_eq!(slow.status, Status::LimitExceeded { limit: LimitKind::Wall });
        let after = sandbox.exec(&sh("cat /tmp/state"), ExecOptions::default()).expect("after");
        assert_eq!(stdout(&after), "41\n");
        sandbox.close().expect("close");
    }
}

#[test]
fn a_session_survives_an_oom_kill_and_reports_it() {
    for (engine, tier) in session_tiers() {
        let sandbox = engine
            .start(TierChoice::Tier(tier), &Capabilities::default(), &limits("memory = \"96MiB\""))
            .expect("start");
        let hog = sandbox.exec(&python("x = bytearray(400 << 20)"), ExecOptions::default()).expect("hog");
        assert_eq!(hog.status, Status::LimitExceeded { limit: LimitKind::Memory });
        let fine = sandbox.exec(&sh("echo alive"), ExecOptions::default()).expect("after oom");
        assert_eq!(stdout(&fine), "alive\n");
    }
}

#[test]
fn cancelling_a_job_stops_it() {
    for (engine, tier) in native_tiers() {
        let cancel = strata_core::CancelToken::new();
        let trigger = cancel.clone();
        let timer = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(200));
            trigger.cancel();
        });
        let started = std::time::Instant::now();
        let err = engine
            .execute(
                RunRequest::new(&sh("sleep 30")).limits(Limits::default()).tier(TierChoice::Tier(tier)).cancel(cancel),
            )
            .expect_err("cancelled");
        assert_eq!(err.code(), "cancelled");
        assert!(started.elapsed().as_secs() < 10);
        timer.join().expect("timer");
    }
}

#[test]
fn streamed_output_reaches_the_sink() {
    struct Collect(std::sync::Mutex<Vec<u8>>);
    impl strata_core::OutputSink for Collect {
        fn output(&self, _: strata_core::Stream, chunk: &[u8]) {
            self.0.lock().expect("lock").write_all(chunk).expect("write");
        }
    }
    for (engine, tier) in native_tiers() {
        let sink = std::sync::Arc::new(Collect(std::sync::Mutex::new(Vec::new())));
        let outcome = engine
            .execute(
                RunRequest::new(&sh("seq 1 3"))
                    .limits(Limits::default())
                    .tier(TierChoice::Tier(tier))
                    .on_output(sink.clone()),
            )
            .expect("run");
        assert_eq!(outcome.stdout, b"1\n2\n3\n");
        assert_eq!(*sink.0.lock().expect("lock"), b"1\n2\n3\n");
    }
}

/// Host PIDs of processes whose command line is exactly `argv`.
fn host_processes(argv: &[&str]) -> Vec<u32> {
    let wanted: Vec<u8> = argv.iter().flat_map(|a| a.bytes().chain([0])).collect();
    std::fs::read_dir("/proc")
        .expect("/proc")
        .flatten()
        .filter_map(|e| e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()))
        .filter(|pid| std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| c == wanted))
        .collect()
}

#[test]
fn jobs_are_an_unprivileged_host_user_and_die_with_their_session() {
    let engine = python_engine();
    let Ok(tier) = engine.process() else {
        eprintln!("skip: the process tier cannot run on this host");
        return;
    };
    let sandbox =
        engine.start(TierChoice::Tier(TierKind::Process), &Capabilities::default(), &Limits::default()).expect("start");
    // A duration unique to this test process names the background job among the host's processes.
    let marker = format!("47.{}", std::process::id());
    let script = format!("sleep {marker} >/dev/null 2>&1 & id -u");
    let outcome = sandbox.exec(&sh(&script), ExecOptions::default()).expect("exec");
    assert_eq!(stdout(&outcome), "0\n", "root inside the jail");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    let sleepers = loop {
        // The background shell may not have exec'd `sleep` yet when the job's main process has ended.
        let found = host_processes(&["sleep", &marker]);
        if !found.is_empty() || std::time::Instant::now() > deadline {
            break found;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    };
    assert_eq!(sleepers.len(), 1, "the background process runs on after its job");
    let status = std::fs::read_to_string(format!("/proc/{}/status", sleepers[0])).expect("status");
    let uid_line = status.lines().find(|l| l.starts_with("Uid:")).expect("Uid line").to_owned();
    if tier.uses_user_namespaces() {
        let expected = strata_tier_process::JAIL_IDS.base.to_string();
        assert!(uid_line.split_whitespace().skip(1).all(|id| id == expected), "host view: {uid_line}");
    } else {
        eprintln!("skip: user namespaces unavailable here; jobs run as host root without capabilities");
    }
    sandbox.close().expect("close");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while !host_processes(&["sleep", &marker]).is_empty() {
        assert!(std::time::Instant::now() < deadline, "a closed sandbox left a process running");
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

#[test]
fn kernel_knobs_and_host_views_stay_closed() {
    // The jail's hardening; in a microVM the job is root of a kernel of its own.
    for (engine, tier) in session_tiers() {
        let script = "echo evil > /proc/sys/kernel/hostname 2>/dev/null || echo sysctl-refused; \
                      for f in keys timer_list kallsyms kcore sysrq-trigger latency_stats; do \
                        [ -e /proc/$f ] || continue; \
                        grep -q \" /proc/$f \" /proc/self/mountinfo && echo masked || echo open-$f; done | sort -u; \
                      grep \" /proc/sys \" /proc/self/mountinfo | cut -d' ' -f6 | cut -d, -f1; \
                      ls /sys | wc -l; \
                      cat /proc/1/environ 2>/dev/null || echo pid1-closed; \
                      ls /proc/1/fd 2>/dev/null || echo pid1-fds-closed; \
                      mknod /tmp/sda b 8 0 2>/dev/null || echo mknod-refused; \
                      chroot / true 2>/dev/null || echo chroot-refused";
        let outcome = run(engine, tier, &sh(script), &Capabilities::default(), &Limits::default());
        assert_eq!(
            stdout(&outcome),
            "sysctl-refused\nmasked\nro\n0\npid1-closed\npid1-fds-closed\nmknod-refused\nchroot-refused\n",
            "{tier}: {outcome:?}"
        );
    }
}

#[test]
fn session_files_cannot_leave_the_jail_or_pass_read_only_mounts() {
    let ro = tempfile::tempdir().expect("tempdir");
    std::fs::write(ro.path().join("keep.txt"), "original").expect("write");
    for (engine, tier) in session_tiers() {
        let caps = Capabilities {
            grants: vec![Grant::new(ro.path(), "/ro", GrantMode::Ro).expect("grant")],
            ..Capabilities::default()
        };
        let sandbox = engine.start(TierChoice::Tier(tier), &caps, &Limits::default()).expect("start");
        // A job plants links and a FIFO; the host's file API must not follow them out, nor block.
        let plant = sh("ln -s / /tmp/root-link; ln -s /ro/keep.txt /tmp/ro-link; mkfifo /tmp/fifo; \
                        ln -s /proc/1/root /tmp/pid1-root");
        let planted = sandbox.exec(&plant, ExecOptions::default()).expect("plant");
        assert_eq!(planted.status, Status::Exited { code: 0 }, "{planted:?}");
        assert_eq!(sandbox.write_file("/ro/keep.txt", b"changed").expect_err("ro grant").code(), "guest_path");
        assert_eq!(sandbox.write_file("/tmp/ro-link", b"changed").expect_err("link to ro").code(), "guest_path");
        assert_eq!(std::fs::read_to_string(ro.path().join("keep.txt")).expect("read"), "original");
        assert_eq!(sandbox.read_file("/tmp/fifo").expect_err("fifo").code(), "guest_path");
        // Through the link, `/` is the jail's root: the jail's own /etc/hostname, not the host's.
        assert_eq!(sandbox.read_file("/tmp/root-link/etc/hostname").expect("jail file"), b"strata\n");
        sandbox.write_file("/tmp/root-link/tmp/through-link", b"x").expect("write through a link inside the jail");
        assert!(!std::path::Path::new("/tmp/through-link").exists(), "a write escaped to the host");
        sandbox.close().expect("close");
    }
}
