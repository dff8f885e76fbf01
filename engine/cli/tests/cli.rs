//! The `strata` command's contract (docs/DESIGN.md §5): output, `--json`, exit statuses and one-line errors.

use std::io::Write;
use std::path::Path;
use std::process::{Command, Output, Stdio};

use strata_test_programs as programs;

struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

fn strata(home: &Path, args: &[&str], stdin: &[u8]) -> Run {
    strata_in(home, None, args, stdin)
}

/// [`strata`] with its working directory at `cwd` (this process's when `None`).
fn strata_in(home: &Path, cwd: Option<&Path>, args: &[&str], stdin: &[u8]) -> Run {
    let mut command = Command::new(env!("CARGO_BIN_EXE_strata"));
    if let Some(cwd) = cwd {
        command.current_dir(cwd);
    }
    let mut child = command
        .args(args)
        .env("STRATA_HOME", home)
        .env_remove("RUST_BACKTRACE")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn strata");
    child.stdin.take().expect("stdin").write_all(stdin).expect("write stdin");
    let Output { status, stdout, stderr } = child.wait_with_output().expect("wait");
    let run = Run {
        code: status.code().expect("exit code, not a signal"),
        stdout: String::from_utf8_lossy(&stdout).into_owned(),
        stderr: String::from_utf8_lossy(&stderr).into_owned(),
    };
    assert!(
        !run.stderr.contains("panicked at") || run.stderr.contains("guest panicked"),
        "strata panicked: {}",
        run.stderr
    );
    assert!(!run.stderr.contains("RUST_BACKTRACE") || run.stderr.contains("guest panicked"), "{}", run.stderr);
    run
}

fn home() -> tempfile::TempDir {
    tempfile::tempdir().expect("tempdir")
}

fn json(run: &Run) -> serde_json::Value {
    assert_eq!(run.stdout.lines().count(), 1, "exactly one JSON line: {:?}", run.stdout);
    serde_json::from_str(&run.stdout).unwrap_or_else(|e| panic!("not JSON ({e}): {}", run.stdout))
}

#[test]
fn the_demo_job_prints_and_exits_zero() {
    let home = home();
    let run = strata(home.path(), &["run", programs::HELLO, "--", "newcomer"], b"");
    assert_eq!(run.code, 0, "{}", run.stderr);
    assert_eq!(run.stdout, "Hello, newcomer! This line was printed by a WebAssembly guest inside Strata.\n");
    assert_eq!(run.stderr, "");
    let mut cached: Vec<String> = std::fs::read_dir(home.path().join("modules"))
        .expect("module cache in STRATA_HOME")
        .filter_map(|e| e.ok()?.path().extension().map(|x| x.to_string_lossy().into_owned()))
        .collect();
    cached.sort();
    assert_eq!(cached, ["cwasm", "lock", "sum"], "one compiled module, its checksum and its compile lock");
}

#[test]
fn json_prints_exactly_the_outcome_object() {
    let run = strata(home().path(), &["run", "--json", programs::EXIT, "--", "3"], b"");
    assert_eq!(run.code, 3);
    let v = json(&run);
    let keys: Vec<&str> = v.as_object().expect("object").keys().map(String::as_str).collect();
    assert_eq!(keys, ["escalations", "route", "status", "stderr", "stdout", "tier", "tools", "truncated", "usage"]);
    assert_eq!(v["route"], serde_json::json!({"tier": "wasm", "reason": "wasm module"}));
    assert_eq!(v["tier"], "wasm");
    assert_eq!(v["status"], serde_json::json!({"kind": "exited", "code": 3}));
    assert_eq!(v["stdout"], "exiting with 3\n");
    assert_eq!(v["stderr"], "to stderr\n");
    let usage: Vec<&str> = v["usage"].as_object().expect("usage").keys().map(String::as_str).collect();
    assert_eq!(usage, ["cpu_ms", "fuel", "peak_memory_bytes", "stderr_bytes", "stdout_bytes", "wall_ms"]);
    assert!(v["usage"]["fuel"].is_null());
    assert_eq!(run.stderr, "");
}

#[test]
fn each_limit_exits_124_with_its_kind() {
    let home = home();
    for (args, limit) in [
        (vec!["--timeout", "200ms", programs::SPIN], "wall"),
        (vec!["--cpu", "200ms", programs::SPIN], "cpu"),
        (vec!["--fuel", "1000000", programs::SPIN], "fuel"),
        (vec!["--memory", "8MiB", programs::ALLOC, "--", "32"], "memory"),
    ] {
        let mut all = vec!["run", "--json"];
        all.extend(&args);
        let run = strata(home.path(), &all, b"");
        assert_eq!(run.code, 124, "{args:?}: {}", run.stdout);
        assert_eq!(json(&run)["status"], serde_json::json!({"kind": "limit_exceeded", "limit": limit}));
    }
    let run = strata(home.path(), &["run", "--timeout", "200ms", programs::SPIN], b"");
    assert_eq!((run.code, run.stderr.as_str()), (124, "strata: wall limit exceeded (200ms)\n"));
}

#[test]
fn a_trap_exits_125() {
    let run = strata(home().path(), &["run", "--json", programs::PANIC], b"");
    assert_eq!(run.code, 125);
    let v = json(&run);
    assert_eq!(v["status"]["kind"], "trapped");
    assert!(v["status"]["message"].as_str().expect("message").starts_with("wasm trap: wasm `unreachable`"));
}

#[test]
fn stdin_is_piped_to_the_guest() {
    let run = strata(home().path(), &["run", programs::ECHO], b"from a pipe");
    assert!(run.stdout.ends_with("stdin=from a pipe\n"), "{}", run.stdout);
}

#[test]
fn grants_env_and_secrets_from_flags() {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("f.txt"), "granted").expect("write");
    let grant = format!("{}:/data:ro", dir.path().display());
    let home = home();
    let run = strata(home.path(), &["run", "--dir", &grant, programs::FS, "--", "read", "/data/f.txt"], b"");
    assert_eq!((run.code, run.stdout.as_str()), (0, "granted"));
    let run = strata(home.path(), &["run", "--env", "A=1", "--secret", "TOKEN=abc123xyz", programs::ECHO], b"");
    assert!(run.stdout.contains("env A=1\nenv TOKEN=[REDACTED:TOKEN]\n"), "{}", run.stdout);
}

#[test]
fn truncation_is_reported_on_stderr() {
    let run = strata(home().path(), &["run", "--output-limit", "16", programs::FLOOD, "--", "1000"], b"");
    assert_eq!(run.code, 0);
    assert_eq!(run.stdout, "x".repeat(16));
    assert!(run.stderr.ends_with("strata: stderr truncated at 16B (1000 bytes written)\n"), "{}", run.stderr);
}

#[test]
fn bad_input_exits_2_with_one_line_naming_the_problem() {
    let dir = tempfile::tempdir().expect("tempdir");
    let text = dir.path().join("notes.txt");
    std::fs::write(&text, "hello").expect("write");
    let malformed = dir.path().join("bad.wasm");
    std::fs::write(&malformed, b"\0asm\x01\0\0\0\x01\xff\xff").expect("write");
    let (text, malformed) = (text.to_str().expect("utf8"), malformed.to_str().expect("utf8"));
    let home = home();
    let cases: Vec<(Vec<&str>, &str, &str)> = vec![
        (vec!["/nonexistent/x.wasm"], "input_unreadable", "/nonexistent/x.wasm"),
        (vec![text], "wrong_format", "not a WebAssembly module"),
        (vec![malformed], "invalid_module", "bad.wasm"),
        (vec![programs::UNKNOWN_IMPORT_WAT], "unknown_import", "env::launch_missiles"),
        (vec!["--dir", "/nonexistent/d:/d", programs::HELLO], "invalid_capability", "/nonexistent/d does not exist"),
        (vec!["--memory", "lots", programs::HELLO], "usage", "invalid size \"lots\""),
        (vec!["--timeout", "5", programs::HELLO], "usage", "missing unit"),
        (vec!["--tier", "quantum", programs::HELLO], "usage", "unknown tier \"quantum\""),
        (vec!["--tier", "process", programs::HELLO], "wrong_job", "the process tier cannot run WebAssembly jobs"),
        (vec!["--tier", "vm", "--", "true"], "tier_unavailable", "microvm tier is not available"),
        (vec!["--image", "floppy", "--", "true"], "image_not_found", "no image named \"floppy\""),
        (vec!["--image", "../floppy", "--", "true"], "usage", "invalid image name"),
        (vec!["--image", "initramfs", "--tier", "process", "--", "true"], "usage", "does not apply to --tier process"),
        (vec!["--dir", "relative", programs::HELLO], "usage", "expected HOST:GUEST"),
        (vec!["--allow-net", "example.com", programs::HELLO], "unsupported", "network egress"),
    ];
    for (args, kind, needle) in cases {
        let mut plain = vec!["run"];
        plain.extend(&args);
        let run = strata(home.path(), &plain, b"");
        assert_eq!(run.code, 2, "{args:?}: {}", run.stderr);
        assert_eq!(run.stdout, "", "{args:?}");
        assert_eq!(run.stderr.lines().count(), 1, "{args:?}: {}", run.stderr);
        assert!(run.stderr.starts_with("strata: ") && run.stderr.contains(needle), "{args:?}: {}", run.stderr);

        let mut with_json = vec!["run", "--json"];
        with_json.extend(&args);
        let run = strata(home.path(), &with_json, b"");
        assert_eq!(run.code, 2, "{args:?}");
        let v = json(&run);
        assert_eq!(v["error"]["kind"], kind, "{args:?}: {v}");
        assert!(v["error"]["message"].as_str().expect("message").contains(needle), "{args:?}: {v}");
    }
}

#[test]
fn a_policy_file_sets_limits_and_flags_override_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let policy = dir.path().join("tight.toml");
    std::fs::write(&policy, "[limits]\nwall = \"150ms\"\n").expect("write");
    let policy = policy.to_str().expect("utf8");
    let home = home();
    let run = strata(home.path(), &["run", "--json", "--policy", policy, programs::SPIN], b"");
    assert_eq!(json(&run)["status"]["limit"], "wall");
    let run = strata(home.path(), &["run", "--json", "--policy", policy, "--fuel", "100000", programs::SPIN], b"");
    assert_eq!(json(&run)["status"]["limit"], "fuel");

    let bad = dir.path().join("bad.toml");
    std::fs::write(&bad, "[limits]\nwall = \"1s\"\nmemroy = \"1GiB\"\n").expect("write");
    let run = strata(home.path(), &["run", "--policy", bad.to_str().expect("utf8"), programs::HELLO], b"");
    assert_eq!(run.code, 2);
    assert!(
        run.stderr.contains("bad.toml") && run.stderr.contains("line 3") && run.stderr.contains("memroy"),
        "{}",
        run.stderr
    );
}

#[test]
fn a_closed_stdout_does_not_disturb_the_job() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(["run", programs::FLOOD, "--", "1000000"])
        .env("STRATA_HOME", home().path())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn");
    drop(child.stdout.take());
    let status = child.wait().expect("wait");
    assert_eq!(status.code(), Some(0), "the guest's exit status, not a broken pipe");
}

#[test]
fn a_large_module_shows_compile_progress_once() {
    let home = home();
    let run = strata(home.path(), &["run", programs::LARGE_WAT], b"");
    assert_eq!((run.code, run.stdout.as_str()), (0, "sssss"));
    let first = run.stderr.lines().next().unwrap_or_default();
    assert!(first.starts_with("strata: compiling large.wasm (5.0 MB) for this machine, once: usually "), "{first}");
    assert!(first.ends_with("; later runs load it from the cache"), "{first}");
    assert!(run.stderr.contains("strata: compiled large.wasm in "), "{}", run.stderr);
    let run = strata(home.path(), &["run", programs::LARGE_WAT], b"");
    assert_eq!((run.code, run.stderr.as_str()), (0, ""), "the second process loads the cached code");
}

/// The real `$STRATA_HOME`, where the Python runtime is installed and compiled once across runs.
fn shared_home() -> std::path::PathBuf {
    std::env::var_os("STRATA_HOME")
        .map(Into::into)
        .unwrap_or_else(|| std::path::PathBuf::from(std::env::var_os("HOME").expect("HOME")).join(".cache/strata"))
}

/// The README's first mistake of every newcomer: a file of the current directory passed to a job that sees only
/// its grants. The job fails as it would (the guest cannot open it) and one line says which `--dir` shows it.
#[test]
fn a_failed_job_naming_an_ungranted_host_file_gets_a_dir_hint() {
    let home = home();
    let cwd = tempfile::tempdir().expect("tempdir");
    std::fs::write(cwd.path().join("input.csv"), "a,b\n1,2\n").expect("write input");
    let run = strata_in(home.path(), Some(cwd.path()), &["run", programs::TOOL, "--", "input.csv", "out.csv"], b"");
    assert_eq!(run.code, 1, "{}", run.stderr);
    let hint = run.stderr.lines().find(|l| l.starts_with("strata: hint:")).unwrap_or_else(|| panic!("{}", run.stderr));
    assert!(hint.contains("`input.csv` is a path on the host") && hint.contains("--dir .:/work"), "{hint}");
    assert!(hint.contains("`/work/input.csv`") && !hint.contains("out.csv"), "only the existing file: {hint}");

    let run = strata_in(
        home.path(),
        Some(cwd.path()),
        &["run", "--dir", ".:/work:rw", programs::TOOL, "--", "/work/input.csv", "/work/out.csv"],
        b"",
    );
    assert_eq!((run.code, run.stderr.as_str()), (0, ""), "the granted form works, with no hint");
    let out = std::fs::read_to_string(cwd.path().join("out.csv")).expect("the tool's output, in the grant");
    assert_eq!(out, "lines: 2\na,b\n1,2\n");

    // A job that succeeds gets no hint, whatever its arguments name; --json prints only the outcome.
    let run = strata_in(home.path(), Some(cwd.path()), &["run", programs::HELLO, "--", "input.csv"], b"");
    assert_eq!((run.code, run.stderr.as_str()), (0, ""));
    let run =
        strata_in(home.path(), Some(cwd.path()), &["run", "--json", programs::TOOL, "--", "input.csv", "out.csv"], b"");
    assert_eq!((run.code, run.stderr.as_str()), (1, ""));
}

#[test]
fn python_code_scripts_and_modules_run() {
    let home = shared_home();
    let run = strata(&home, &["run", "--python", "-c", "import sys; print(sys.argv[1:])", "--", "a", "b"], b"");
    assert_eq!((run.code, run.stdout.as_str()), (0, "['a', 'b']\n"), "{}", run.stderr);

    let dir = tempfile::tempdir().expect("tempdir");
    let script = dir.path().join("job.py");
    std::fs::write(&script, "import sys\ndata = sys.stdin.read()\nprint(len(data))\nsys.exit(4)\n").expect("write");
    let run = strata(&home, &["run", script.to_str().expect("utf8"), "--", "x"], b"12345");
    assert_eq!((run.code, run.stdout.as_str()), (4, "5\n"), "{}", run.stderr);

    let run = strata(&home, &["run", "--python", "-m", "json.tool"], b"[1]");
    assert_eq!((run.code, run.stdout.as_str()), (0, "[\n    1\n]\n"), "{}", run.stderr);

    let run = strata(&home, &["run", "--json", "--python", "-c", "raise KeyError('k')"], b"");
    assert_eq!(run.code, 1);
    let v = json(&run);
    assert_eq!(v["status"], serde_json::json!({"kind": "exited", "code": 1}));
    assert!(v["stderr"].as_str().expect("stderr").ends_with("KeyError: 'k'\n"), "{v}");
}

#[test]
fn json_route_says_where_python_went_and_why() {
    let home = shared_home();
    let run = strata(&home, &["run", "--json", "--python", "-c", "import json, yaml; print(yaml.safe_load('7'))"], b"");
    assert_eq!(run.code, 0, "{}", run.stderr);
    let v = json(&run);
    assert_eq!(v["stdout"], "7\n");
    assert_eq!(
        v["route"],
        serde_json::json!({"tier": "wasm", "reason": "python: imports only modules the wasm build has (json, yaml)"})
    );
    // Over the policy's python_native_above, with the native tier off: Python stays on wasm and says why.
    let dir = tempfile::tempdir().expect("tempdir");
    let policy = dir.path().join("wasm-only.toml");
    std::fs::write(&policy, "[tiers]\nallowed = [\"wasm\"]\npython_native_above = \"1s\"\n").expect("write");
    let args =
        ["run", "--json", "--policy", policy.to_str().expect("utf8"), "--timeout", "5s", "--python", "-c", "pass"];
    let v = json(&strata(&home, &args, b""));
    assert_eq!(v["route"]["tier"], "wasm", "{v}");
    let reason = v["route"]["reason"].as_str().expect("reason");
    assert!(reason.contains("wall limit 5s exceeds python_native_above (1s)"), "{reason}");
}

#[test]
fn python_limits_exit_124() {
    let run =
        strata(&shared_home(), &["run", "--json", "--timeout", "300ms", "--python", "-c", "while True: pass"], b"");
    assert_eq!(run.code, 124);
    assert_eq!(json(&run)["status"]["limit"], "wall");
}

#[test]
fn python_usage_errors_exit_2() {
    let home = shared_home();
    let run = strata(&home, &["run", "--python", "-c", "1", "file.py"], b"");
    assert_eq!(run.code, 2, "{}", run.stderr);
    let run = strata(&home, &["run", "--python"], b"");
    assert_eq!(run.code, 2, "{}", run.stderr);
    let dir = tempfile::tempdir().expect("tempdir");
    let odd = dir.path().join("data.bin");
    std::fs::write(&odd, b"\x01\x02\x03").expect("write");
    let run = strata(&home, &["run", odd.to_str().expect("utf8")], b"");
    assert_eq!(run.code, 2);
    assert!(run.stderr.contains("not a WebAssembly module (no \\0asm magic), a Python script"), "{}", run.stderr);
}

/// Whether the process tier runs here; prints one skip line when it does not.
fn process_tier_available(home: &Path) -> bool {
    let run = strata(home, &["run", "--json", "--tier", "process", "--", "true"], b"");
    if run.code == 2 && run.stdout.contains("tier_unavailable") {
        eprintln!("skip: the process tier cannot run on this host: {}", run.stdout.trim());
        return false;
    }
    true
}

#[test]
fn native_commands_and_programs_run_on_the_process_tier() {
    let home = shared_home();
    if !process_tier_available(&home) {
        return;
    }
    let run = strata(&home, &["run", "--tier", "process", "--", "echo", "hi"], b"");
    assert_eq!((run.code, run.stdout.as_str()), (0, "hi\n"), "{}", run.stderr);
    // Auto routing sends commands and ELF files to the native tier.
    let run = strata(&home, &["run", "--json", "--", "sh", "-c", "cat; exit 5"], b"in");
    assert_eq!(run.code, 5);
    let v = json(&run);
    assert_eq!((v["tier"].as_str(), v["stdout"].as_str()), (Some("process"), Some("in")));
    let run = strata(&home, &["run", programs::NATIVE_HELLO, "--", "there"], b"");
    assert_eq!(run.code, 0, "{}", run.stderr);
    assert!(run.stdout.ends_with("there\n"), "{}", run.stdout);
    let run =
        strata(&home, &["run", "--tier", "process", "--python", "-c", "import sys; print(sys.version_info[:2])"], b"");
    assert_eq!((run.code, run.stdout.as_str()), (0, "(3, 11)\n"), "{}", run.stderr);

    let run = strata(&home, &["run", "--json", "--tier", "process", "--timeout", "300ms", "--", "sleep", "9"], b"");
    assert_eq!((run.code, json(&run)["status"]["limit"].as_str()), (124, Some("wall")));
    let run = strata(
        &home,
        &[
            "run",
            "--tier",
            "process",
            "--pids",
            "8",
            "--",
            "sh",
            "-c",
            "sleep 5 & sleep 5 & sleep 5 & sleep 5 & sleep 5 & sleep 5 & sleep 5 & sleep 5 & wait",
        ],
        b"",
    );
    assert_eq!(run.code, 124, "{}", run.stderr);
    assert!(run.stderr.contains("strata: pids limit exceeded (8)"), "{}", run.stderr);

    let run = strata(&home, &["run", "--json", "--tier", "process", "--", "no-such-program"], b"");
    assert_eq!(run.code, 2);
    assert_eq!(json(&run)["error"]["kind"], "program_not_found");
    let run = strata(&home, &["run", "--tier", "process"], b"");
    assert_eq!(run.code, 2);
    assert!(run.stderr.contains("nothing to run"), "{}", run.stderr);
}

/// A killed engine leaves no jail running (its PID 1 sees the control socket close) and its cgroup is removed
/// by the next engine that starts.
#[test]
fn a_killed_engine_leaves_nothing_behind() {
    let home = shared_home();
    if !process_tier_available(&home) {
        return;
    }
    // A duration unique to this test process names the jailed job among the host's processes.
    let marker = format!("61.{}", std::process::id());
    let mut child = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(["run", "--tier", "process", "--", "sh", "-c", &format!("sleep {marker}; echo never")])
        .env("STRATA_HOME", &home)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn strata");
    let engine_pid = child.id();
    let sleepers = || -> Vec<u32> {
        std::fs::read_dir("/proc")
            .expect("/proc")
            .flatten()
            .filter_map(|e| e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()))
            .filter(|pid| {
                std::fs::read(format!("/proc/{pid}/cmdline"))
                    .is_ok_and(|c| c == format!("sleep\0{marker}\0").as_bytes())
            })
            .collect()
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while sleepers().is_empty() {
        assert!(std::time::Instant::now() < deadline, "the jailed job never started");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    child.kill().expect("kill the engine");
    child.wait().expect("reap the engine");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !sleepers().is_empty() {
        assert!(std::time::Instant::now() < deadline, "the jail outlived its engine: {:?}", sleepers());
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    // The dead engine's cgroup is still there until another engine starts the process tier.
    let stale = || -> Vec<std::path::PathBuf> {
        ["memory", "pids", "cpu", "cpuacct", "unified"]
            .iter()
            .flat_map(|c| walk_strata_cgroups(Path::new("/sys/fs/cgroup").join(c).as_path()))
            .filter(|p| {
                p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with(&format!("{engine_pid}-")))
            })
            .collect()
    };
    assert!(!stale().is_empty(), "the killed engine's cgroup should remain until the next start");
    let run = strata(&home, &["run", "--tier", "process", "--", "true"], b"");
    assert_eq!(run.code, 0, "{}", run.stderr);
    assert_eq!(stale(), Vec::<std::path::PathBuf>::new(), "cgroups of the killed engine remain");
}

/// Every `strata/<name>` cgroup directory under a hierarchy's mount point.
fn walk_strata_cgroups(root: &Path) -> Vec<std::path::PathBuf> {
    let mut found = Vec::new();
    let mut stack = vec![root.to_owned()];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else { continue };
        for entry in entries.flatten() {
            let path = entry.path();
            if !entry.file_type().is_ok_and(|t| t.is_dir()) {
                continue;
            }
            if dir.file_name().is_some_and(|n| n == "strata") {
                found.push(path);
            } else {
                stack.push(path);
            }
        }
    }
    found
}

#[test]
fn doctor_reports_the_host_and_each_tier() {
    let home = home();
    let run = strata(home.path(), &["doctor", "--json"], b"");
    assert_eq!(run.code, 0, "{}", run.stderr);
    let v = json(&run);
    assert!(["hardware", "pvm", "none"].contains(&v["kvm"]["kind"].as_str().expect("kvm kind")), "{v}");
    let tiers: Vec<&str> = v["tiers"].as_array().expect("tiers").iter().filter_map(|t| t["tier"].as_str()).collect();
    assert_eq!(tiers, ["wasm", "process", "microvm"]);
    assert!(v["cgroups"]["detail"].as_str().expect("cgroups").starts_with("cgroup v") || v["cgroups"]["ok"] == false);
    let run = strata(home.path(), &["doctor"], b"");
    assert_eq!(run.code, 0);
    assert!(run.stdout.contains("tier process"), "{}", run.stdout);
}

#[test]
fn snapshot_commands_refuse_bad_input_with_one_line() {
    let home = home();
    let dir = tempfile::tempdir().expect("tempdir");
    let at = |name: &str| dir.path().join(name).to_str().expect("utf8").to_owned();
    std::fs::create_dir(at("empty")).expect("mkdir");
    std::fs::create_dir(at("taken")).expect("mkdir");
    let cases: Vec<(Vec<String>, &str)> = vec![
        (vec!["snapshot".into(), "inspect".into(), at("missing")], "snapshot_invalid"),
        (vec!["snapshot".into(), "inspect".into(), at("empty")], "snapshot_invalid"),
        (vec!["run".into(), "--snapshot".into(), at("missing"), "--".into(), "true".into()], "snapshot_io"),
        (
            vec!["run".into(), "--snapshot".into(), at("empty"), "--dir".into(), "/tmp:/data".into(), "--".into()],
            "usage",
        ),
        (
            vec!["snapshot".into(), "create".into(), "-o".into(), at("taken"), "--".into(), "true".into()],
            "snapshot_exists",
        ),
        (vec!["snapshot".into(), "create".into(), "--".into(), "true".into()], "usage"),
    ];
    for (args, kind) in cases {
        let mut with_json: Vec<&str> = args.iter().map(String::as_str).collect();
        // --json before `--` (inspect has no --json: its errors are one line).
        if args[0] == "run" {
            with_json.insert(1, "--json");
        } else if args[1] == "create" {
            with_json.insert(2, "--json");
        }
        let run = strata(home.path(), &with_json, b"");
        assert_eq!(run.code, 2, "{args:?}: {} {}", run.stdout, run.stderr);
        if args[1] == "inspect" {
            assert_eq!(run.stderr.lines().count(), 1, "{args:?}: {}", run.stderr);
        } else {
            assert_eq!(json(&run)["error"]["kind"], kind, "{args:?}: {}", run.stdout);
        }
    }
    assert!(!Path::new(&at("taken")).join("manifest.json").exists());
}

#[test]
fn a_python_snapshot_is_forked_with_its_state() {
    let home = shared_home();
    let dir = tempfile::tempdir().expect("tempdir");
    let s1 = dir.path().join("s1");
    let s1 = s1.to_str().expect("utf8");
    // numpy on wasm is asked for by name: `auto` sends it native (wasm32's default int is int32).
    let create = ["snapshot", "create", "--tier", "wasm", "--python", "-c", "import numpy as np; x = 41", "-o", s1];
    let run = strata(&home, &create, b"");
    assert_eq!(run.code, 0, "{}", run.stderr);
    assert!(run.stderr.contains("strata: snapshot"), "{}", run.stderr);
    let run = strata(&home, &["run", "--snapshot", s1, "--python", "-c", "print(x + 1, np.arange(3).sum())"], b"");
    assert_eq!((run.code, run.stdout.as_str()), (0, "42 3\n"), "{}", run.stderr);
    let run = strata(&home, &["snapshot", "inspect", s1], b"");
    assert_eq!(run.code, 0, "{}", run.stderr);
    let manifest: serde_json::Value = serde_json::from_str(&run.stdout).expect("manifest JSON");
    assert_eq!(manifest["tier"], "wasm");
    assert_eq!(manifest["format"], 2);
    // A fork cannot go to another tier, and a setup that fails writes nothing.
    let run = strata(&home, &["run", "--json", "--snapshot", s1, "--tier", "process", "--", "true"], b"");
    assert_eq!((run.code, json(&run)["error"]["kind"].as_str()), (2, Some("snapshot_tier")));
    let failed = dir.path().join("failed");
    let run = strata(
        &home,
        &["snapshot", "create", "--python", "-c", "raise SystemExit(3)", "-o", failed.to_str().expect("utf8")],
        b"",
    );
    assert_eq!(run.code, 3, "{}", run.stderr);
    assert!(run.stderr.contains("no snapshot was written"), "{}", run.stderr);
    assert!(!failed.exists());
}

#[test]
fn a_process_snapshot_is_forked_with_its_files() {
    let home = shared_home();
    if !process_tier_available(&home) {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let s2 = dir.path().join("s2");
    let s2 = s2.to_str().expect("utf8");
    let run = strata(
        &home,
        &["snapshot", "create", "--tier", "process", "-o", s2, "--", "sh", "-c", "echo 41 > /tmp/x"],
        b"",
    );
    assert_eq!(run.code, 0, "{}", run.stderr);
    let run = strata(&home, &["run", "--snapshot", s2, "--", "cat", "/tmp/x"], b"");
    assert_eq!((run.code, run.stdout.as_str()), (0, "41\n"), "{}", run.stderr);
    let run = strata(&home, &["run", "--json", "--snapshot", s2, "--", "cat", "/tmp/x"], b"");
    let v = json(&run);
    assert_eq!((v["tier"].as_str(), v["route"]["tier"].as_str()), (Some("process"), Some("process")), "{v}");
    assert!(v["route"]["reason"].as_str().is_some_and(|r| r.contains("a fork of snapshot")), "{v}");
    // A corrupted snapshot is refused, never forked.
    let manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(Path::new(s2).join("manifest.json")).expect("manifest"))
            .expect("json");
    let victim = manifest["files"].as_array().and_then(|f| f.iter().find(|f| f["size"].as_u64() > Some(0)));
    let victim = Path::new(s2).join(victim.expect("a non-empty file")["path"].as_str().expect("path"));
    let mut bytes = std::fs::read(&victim).expect("read");
    bytes[0] ^= 0xff;
    std::fs::write(&victim, bytes).expect("write");
    let run = strata(&home, &["run", "--json", "--snapshot", s2, "--", "cat", "/tmp/x"], b"");
    assert_eq!((run.code, json(&run)["error"]["kind"].as_str()), (2, Some("snapshot_invalid")), "{}", run.stdout);
}

fn repo_policy(name: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../policies").join(name).to_str().expect("utf8").to_owned()
}

#[test]
fn the_strict_policy_keeps_python_on_wasm_and_refuses_the_process_tier() {
    let home = shared_home();
    let strict = repo_policy("strict.toml");
    let run = strata(&home, &["run", "--json", "--policy", &strict, "--python", "-c", "print(6 * 7)"], b"");
    assert_eq!(run.code, 0, "{}", run.stderr);
    let v = json(&run);
    assert_eq!((v["tier"].as_str(), v["stdout"].as_str()), (Some("wasm"), Some("42\n")), "{v}");
    assert!(v["usage"]["fuel"].as_u64().is_some_and(|fuel| fuel > 0), "strict meters fuel: {v}");

    let run = strata(&home, &["run", "--json", "--policy", &strict, "--tier", "process", "--", "echo", "hi"], b"");
    assert_eq!(run.code, 2, "{}", run.stdout);
    assert_eq!(json(&run)["error"]["kind"], "tier_not_allowed", "{}", run.stdout);
    let run = strata(&home, &["run", "--policy", &strict, "--tier", "process", "--", "echo", "hi"], b"");
    assert_eq!(run.code, 2);
    assert!(run.stderr.contains("does not allow the process tier"), "{}", run.stderr);

    // The default policy file loads too.
    let run = strata(&home, &["run", "--policy", &repo_policy("default.toml"), programs::HELLO, "--", "d"], b"");
    assert_eq!(run.code, 0, "{}", run.stderr);
}

#[test]
fn grants_name_applies_a_grant_set_of_the_policy() {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::create_dir(dir.path().join("inputs")).expect("mkdir");
    std::fs::write(dir.path().join("inputs/data.txt"), "granted by name").expect("write");
    let policy = dir.path().join("sets.toml");
    std::fs::write(&policy, "[grants.inputs]\ndirs = [\"inputs:/inputs:ro\"]\n\n[grants.empty]\ndirs = []\n")
        .expect("write");
    let policy = policy.to_str().expect("utf8");
    let home = home();
    let read = [programs::FS, "--", "read", "/inputs/data.txt"];
    let args = [&["run", "--policy", policy, "--grants", "inputs"][..], &read[..]].concat();
    let run = strata(home.path(), &args, b"");
    assert_eq!((run.code, run.stdout.as_str()), (0, "granted by name"), "{}", run.stderr);

    // Without the set, the file is not there.
    let run = strata(home.path(), &[&["run", "--policy", policy][..], &read[..]].concat(), b"");
    assert_ne!(run.code, 0, "{}", run.stdout);

    // An unknown set is a usage error naming the policy and the sets it defines.
    let run = strata(home.path(), &["run", "--policy", policy, "--grants", "outputs", programs::HELLO], b"");
    assert_eq!(run.code, 2);
    assert!(run.stderr.contains("sets.toml") && run.stderr.contains("\"outputs\""), "{}", run.stderr);
    assert!(run.stderr.contains("empty, inputs"), "{}", run.stderr);
    let run = strata(home.path(), &["run", "--json", "--grants", "inputs", programs::HELLO], b"");
    assert_eq!(run.code, 2);
    let v = json(&run);
    assert_eq!(v["error"]["kind"], "usage", "{v}");
    assert!(v["error"]["message"].as_str().is_some_and(|m| m.contains("the default policy")), "{v}");
}

#[test]
fn policy_network_and_escalation_keys_are_checked_and_reach_the_job() {
    let dir = tempfile::tempdir().expect("tempdir");
    let home = home();
    for (text, line, key) in [
        ("[network]\nallow = [\"http://example.com\"]\n", 2, "allow"),
        ("[escalation]\non = [\"always\"]\n", 2, "on"),
        ("[escalation]\nallowed = false\nbudget = 1\n", 3, "budget"),
        ("[grants.x]\ndirs = [\"/tmp\"]\n", 2, "dirs"),
    ] {
        let bad = dir.path().join("bad.toml");
        std::fs::write(&bad, text).expect("write");
        let run = strata(home.path(), &["run", "--policy", bad.to_str().expect("utf8"), programs::HELLO], b"");
        assert_eq!(run.code, 2, "{text}");
        let line = format!("line {line}");
        assert!(
            run.stderr.contains("bad.toml") && run.stderr.contains(&line) && run.stderr.contains(key),
            "{text}: {}",
            run.stderr
        );
    }
    // The policy's allowlist reaches the job (the wasm tier, without network, says so), and --allow-net adds to it.
    let net = dir.path().join("net.toml");
    std::fs::write(&net, "[network]\nallow = [\"pypi.org:443\"]\n").expect("write");
    let net = net.to_str().expect("utf8");
    let run = strata(home.path(), &["run", "--policy", net, "--allow-net", "example.com", programs::HELLO], b"");
    assert_eq!(run.code, 2);
    assert!(run.stderr.contains("pypi.org:443,example.com"), "{}", run.stderr);
}

#[test]
fn a_malformed_allow_net_is_a_usage_error_before_anything_runs() {
    let home = home();
    for spec in ["http://example.com", "example.com:99999", "exa mple.com", ""] {
        let run = strata(home.path(), &["run", "--allow-net", spec, programs::HELLO], b"");
        assert_eq!(run.code, 2, "{spec:?}: {}", run.stderr);
        assert!(run.stderr.contains("--allow-net") && run.stderr.lines().count() == 1, "{spec:?}: {}", run.stderr);
        let run = strata(home.path(), &["run", "--json", "--allow-net", spec, programs::HELLO], b"");
        assert_eq!((run.code, json(&run)["error"]["kind"].as_str()), (2, Some("usage")), "{spec:?}");
    }
    let run = strata(home.path(), &["run", "--allow-net", "*.example.com:443", programs::HELLO], b"");
    assert!(!run.stderr.contains("malformed"), "{}", run.stderr);
}

#[test]
fn json_shows_a_dynamic_escalation() {
    let home = shared_home();
    if !process_tier_available(&home) {
        return;
    }
    let code = "import importlib, sys\nimportlib.import_module('res' + 'ource')\nprint('on', sys.platform)";
    let run = strata(&home, &["run", "--json", "--python", "-c", code], b"");
    assert_eq!(run.code, 0, "{}", run.stdout);
    let v = json(&run);
    assert_eq!((v["stdout"].as_str(), v["route"]["tier"].as_str()), (Some("on linux\n"), Some("wasm")), "{v}");
    let escalations = v["escalations"].as_array().expect("escalations");
    assert_eq!(escalations.len(), 1, "{v}");
    assert_eq!((escalations[0]["from"].as_str(), &escalations[0]["to"]), (Some("wasm"), &v["tier"]), "{v}");
    let reason = escalations[0]["reason"].as_str().expect("reason");
    assert!(reason.starts_with("missing module 'resource' (the wasm attempt failed after "), "{reason}");
    // Without --json, the guest's output is the native run's and one line on stderr says what happened.
    let run = strata(&home, &["run", "--python", "-c", code], b"");
    assert_eq!((run.code, run.stdout.as_str()), (0, "on linux\n"), "{}", run.stderr);
    assert_eq!(run.stderr.lines().count(), 1, "{}", run.stderr);
    assert!(run.stderr.starts_with("strata: re-ran on the "), "{}", run.stderr);
    assert!(run.stderr.contains(" tier: missing module 'resource' (the wasm attempt failed after "), "{}", run.stderr);
    // --tier wasm never escalates: the wasm failure is the result.
    let run = strata(&home, &["run", "--json", "--tier", "wasm", "--python", "-c", code], b"");
    assert_eq!(run.code, 1);
    assert_eq!(json(&run)["escalations"], serde_json::json!([]));
}

/// A `strata run` whose stdin is a pipe the test holds: lines it writes, and whether it is still running.
struct Piped {
    child: std::process::Child,
    stdin: Option<std::process::ChildStdin>,
    lines: std::sync::mpsc::Receiver<String>,
}

/// How long a piped run may take to answer or end (a sanity bound).
const PIPED_BOUND: std::time::Duration = std::time::Duration::from_secs(20);

impl Piped {
    fn start(home: &Path, args: &[&str]) -> Piped {
        let mut child = Command::new(env!("CARGO_BIN_EXE_strata"))
            .args(args)
            .env("STRATA_HOME", home)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn strata");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in std::io::BufRead::lines(std::io::BufReader::new(stdout)) {
                let Ok(line) = line else { return };
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        Piped { stdin: child.stdin.take(), child, lines }
    }

    fn write(&mut self, text: &str) {
        let stdin = self.stdin.as_mut().expect("stdin open");
        stdin.write_all(text.as_bytes()).expect("write stdin");
        stdin.flush().expect("flush stdin");
    }

    /// The next line the guest printed, within the bound.
    fn line(&self) -> String {
        self.lines.recv_timeout(PIPED_BOUND).expect("a line from the guest within the bound")
    }

    /// Its exit code, within the bound (killed and failed past it); stdin stays as it is (open, unless closed).
    fn exit_code(&mut self) -> i32 {
        let started = std::time::Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return status.code().expect("exit code");
            }
            if started.elapsed() > PIPED_BOUND {
                let _ = self.child.kill();
                panic!("strata still running {PIPED_BOUND:?} after it started, its stdin held open");
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }
}

/// The same job, one per tier that runs here: `block lines` on wasm, a shell loop on the native tiers.
fn echo_lines_on(home: &Path) -> Vec<Vec<&'static str>> {
    let mut runs = vec![vec!["run", programs::BLOCK, "--", "lines"]];
    let shell = "while read line; do echo \"got $line\"; done; echo eof";
    if process_tier_available(home) {
        runs.push(vec!["run", "--tier", "process", "--", "sh", "-c", shell]);
    }
    // The microVM boots Linux only on hardware KVM; `strata doctor` says whether this host has it.
    let doctor = strata(home, &["doctor"], b"");
    if doctor.stdout.contains("tier microvm available") {
        runs.push(vec!["run", "--tier", "vm", "--", "sh", "-c", shell]);
    } else {
        eprintln!("skip: the microVM tier boots no Linux guest on this host (no hardware KVM)");
    }
    runs
}

#[test]
fn a_stdin_pipe_held_open_does_not_outlast_the_timeout() {
    let home = shared_home();
    for args in echo_lines_on(&home) {
        let mut args = args.clone();
        args.splice(1..1, ["--timeout", "2s"]);
        let mut run = Piped::start(&home, &args);
        // The pipe stays open: the job waits for input, inside its wall limit.
        assert_eq!(run.exit_code(), 124, "{args:?}");
    }
}

#[test]
fn stdin_lines_reach_the_guest_as_they_are_written_and_eof_ends_it() {
    let home = shared_home();
    for args in echo_lines_on(&home) {
        let mut run = Piped::start(&home, &args);
        for line in ["one", "two"] {
            run.write(&format!("{line}\n"));
            assert_eq!(run.line(), format!("got {line}"), "{args:?}: each line is answered before the next is written");
        }
        drop(run.stdin.take());
        assert_eq!(run.line(), "eof", "{args:?}");
        assert_eq!(run.exit_code(), 0, "{args:?}");
    }
}

#[test]
fn help_completions_and_manual_pages_come_from_the_same_definitions() {
    let home = home();
    let help = strata(home.path(), &["help"], b"");
    assert_eq!(help.code, 0, "{}", help.stderr);
    for command in ["run", "snapshot", "images", "doctor", "serve", "completions", "man"] {
        assert!(help.stdout.contains(&format!("\n  {command} ")), "`strata help` lists no {command}: {}", help.stdout);
    }
    let run_help = strata(home.path(), &["help", "run"], b"");
    assert_eq!(run_help.code, 0, "{}", run_help.stderr);
    assert!(run_help.stdout.contains("--timeout"), "{}", run_help.stdout);

    let bash = strata(home.path(), &["completions", "bash"], b"");
    assert_eq!(bash.code, 0, "{}", bash.stderr);
    assert!(bash.stdout.contains("complete -F _strata") && bash.stdout.contains("--timeout"), "{}", bash.stdout);
    let bad = strata(home.path(), &["completions", "tcsh"], b"");
    assert_eq!(bad.code, 2, "{}", bad.stderr);
    assert_eq!(bad.stderr.lines().count(), 1, "{}", bad.stderr);

    let man = strata(home.path(), &["man"], b"");
    assert_eq!(man.code, 0, "{}", man.stderr);
    assert!(man.stdout.contains(".TH strata 1") && man.stdout.contains("strata\\-run(1)"), "{}", man.stdout);
    let dir = home.path().join("man1");
    let pages = strata(home.path(), &["man", "--dir", dir.to_str().expect("utf-8")], b"");
    assert_eq!(pages.code, 0, "{}", pages.stderr);
    for page in ["strata.1", "strata-run.1", "strata-serve.1", "strata-snapshot.1"] {
        let text = std::fs::read_to_string(dir.join(page)).unwrap_or_else(|e| panic!("{page}: {e}"));
        assert!(text.starts_with(".ie") && text.contains(".SH SYNOPSIS"), "{page}: {text}");
    }
    let run_page = std::fs::read_to_string(dir.join("strata-run.1")).expect("strata-run.1");
    assert!(run_page.contains("\\-\\-timeout"), "{run_page}");
}

#[test]
fn seeded_python_runs_are_identical_and_a_recording_replays() {
    let home = shared_home();
    let code = "import time, random, os, uuid; print(time.time(), random.random(), os.urandom(8).hex(), uuid.uuid4())";
    let first = strata(&home, &["run", "--seed", "7", "--python", "-c", code], b"");
    assert_eq!(first.code, 0, "{}", first.stderr);
    let second = strata(&home, &["run", "--seed", "7", "--python", "-c", code], b"");
    assert_eq!(first.stdout, second.stdout);
    let other = strata(&home, &["run", "--seed", "8", "--python", "-c", code], b"");
    assert_ne!(first.stdout, other.stdout);

    // A reproducible run never goes to another tier.
    let run = strata(&home, &["run", "--seed", "7", "--tier", "process", "--", "true"], b"");
    assert_eq!(run.code, 2, "{}", run.stderr);
    assert!(run.stderr.contains("--seed needs the wasm tier"), "{}", run.stderr);

    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("run.json");
    let recorded = ["run", "--record", file.to_str().expect("utf8"), "--python", "-c"];
    let run =
        strata(&home, &[&recorded[..], &[&format!("{code}; import sys; print(sys.stdin.read())")]].concat(), b"in");
    assert_eq!(run.code, 0, "{}", run.stderr);
    assert!(run.stdout.ends_with(" in\n") || run.stdout.ends_with("\nin\n"), "{}", run.stdout);
    let replayed = strata(&home, &["replay", file.to_str().expect("utf8")], b"");
    assert_eq!(replayed.code, 0, "{}", replayed.stderr);
    assert!(replayed.stdout.starts_with("replay identical:"), "{}", replayed.stdout);

    // A tampered recording: the divergence names the stream and the byte.
    let mut recording = strata_core::Recording::read(&file).expect("the recording");
    recording.expected.stdout.0[3] ^= 1;
    recording.write(&file).expect("write");
    let diverged = strata(&home, &["replay", file.to_str().expect("utf8")], b"");
    assert_eq!(diverged.code, 1, "{}", diverged.stderr);
    assert!(diverged.stderr.contains("replay diverged: stdout differs at byte 3"), "{}", diverged.stderr);

    std::fs::write(&file, "{\"format\":\"strata-recording\",\"version\":1}").expect("write");
    let malformed = strata(&home, &["replay", "--json", file.to_str().expect("utf8")], b"");
    assert_eq!(malformed.code, 2, "{}", malformed.stderr);
    assert_eq!(json(&malformed)["error"]["kind"], "invalid_recording");
}
