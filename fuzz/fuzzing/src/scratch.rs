//! Where the targets keep their files (disk images, sockets, server state, snapshot directories): one directory
//! per process, `strata-fuzz-<pid>` in the temporary directory, removed when the process exits. libFuzzer ends a
//! run with `exit` (time or run count reached), and so does a test binary, so the directory goes with them; a
//! process that dies on a crash or a timeout cannot remove its own, and the next one to make its directory removes
//! those of processes that are gone.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

const PREFIX: &str = "strata-fuzz-";

static DIR: OnceLock<PathBuf> = OnceLock::new();

/// This process's directory, made (and its removal at exit arranged) on first use.
pub fn dir() -> &'static Path {
    DIR.get_or_init(|| {
        let tmp = std::env::temp_dir();
        sweep(&tmp);
        let dir = tmp.join(format!("{PREFIX}{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("the process's scratch directory");
        // SAFETY: atexit(3) only records a plain `extern "C" fn()` without arguments, run once at exit.
        unsafe { libc::atexit(remove_at_exit) };
        dir
    })
}

/// A new, empty directory below [`dir`], its name starting with `what`.
pub fn fresh(what: &str) -> PathBuf {
    static COUNT: AtomicU64 = AtomicU64::new(0);
    let path = dir().join(format!("{what}-{}", COUNT.fetch_add(1, Ordering::Relaxed)));
    std::fs::create_dir_all(&path).expect("a scratch directory");
    path
}

extern "C" fn remove_at_exit() {
    if let Some(dir) = DIR.get() {
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// Removes the directories in `tmp` of processes that no longer run. Without `/proc` nothing is known to be gone.
fn sweep(tmp: &Path) {
    if !Path::new("/proc/self").exists() {
        return;
    }
    let Ok(entries) = std::fs::read_dir(tmp) else { return };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(|n| n.strip_prefix(PREFIX)) else { continue };
        if pid.is_empty() || !pid.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        if !Path::new("/proc").join(pid).exists() {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_directory_of_a_process_that_is_gone_is_swept_and_a_live_ones_kept() {
        let tmp = fresh("sweep");
        let gone = {
            let mut child = std::process::Command::new("true").spawn().expect("spawn true");
            let pid = child.id();
            child.wait().expect("wait");
            pid
        };
        let dead = tmp.join(format!("{PREFIX}{gone}"));
        let live = tmp.join(format!("{PREFIX}{}", std::process::id()));
        let other = tmp.join(format!("{PREFIX}block-{gone}"));
        for dir in [&dead, &live, &other] {
            std::fs::create_dir_all(dir.join("inside")).expect("a directory");
        }
        sweep(&tmp);
        assert!(!dead.exists(), "the directory of pid {gone}, which exited, is still there");
        assert!(live.exists() && other.exists(), "a directory not known to be abandoned was removed");
    }

    #[test]
    fn a_process_removes_its_directory_when_it_exits() {
        const CHILD: &str = "STRATA_FUZZ_SCRATCH_CHILD";
        let name = "scratch::tests::a_process_removes_its_directory_when_it_exits";
        if std::env::var_os(CHILD).is_some() {
            std::fs::write(fresh("child").join("file"), b"x").expect("a file");
            println!("dir={}", dir().display());
            return;
        }
        let exe = std::env::current_exe().expect("the test binary");
        let out = std::process::Command::new(exe)
            .args(["--exact", name, "--nocapture", "--test-threads=1"])
            .env(CHILD, "1")
            .output()
            .expect("run the test binary again");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let stdout = String::from_utf8_lossy(&out.stdout);
        let dir = stdout.lines().find_map(|l| l.split_once("dir=")).map(|(_, d)| d).expect("the child's directory");
        assert!(dir.contains(PREFIX), "{dir}");
        assert!(!Path::new(dir).exists(), "{dir} outlived its process");
    }
}
