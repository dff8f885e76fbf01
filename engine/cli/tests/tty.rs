//! `strata run --tty`: the job on a terminal of its own, driven from the caller's terminal (here a pseudo-terminal
//! the test holds the master of): the caller's window size, raw mode while the job runs (keys pass as typed), a
//! window change forwarded on `SIGWINCH`, the job's exit status, and the caller's terminal as it was afterwards.

use std::io::Write;
use std::os::fd::{AsFd, OwnedFd};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nix::pty::{OpenptyResult, Winsize, openpty};
use nix::sys::signal::{Signal, kill};
use nix::sys::termios::{LocalFlags, tcgetattr};
use nix::unistd::Pid;

fn shared_home() -> PathBuf {
    std::env::var_os("STRATA_HOME")
        .map(Into::into)
        .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").expect("HOME")).join(".cache/strata"))
}

fn strata() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_strata"));
    command.env("STRATA_HOME", shared_home()).env("STRATA_DAEMON", "off").env_remove("RUST_BACKTRACE");
    command
}

/// Whether the process tier runs here; prints one skip line when it does not.
fn process_tier_available() -> bool {
    let out = strata().args(["run", "--json", "--tier", "process", "--", "true"]).output().expect("strata");
    let stdout = String::from_utf8_lossy(&out.stdout);
    if stdout.contains("tier_unavailable") {
        eprintln!("skip: the process tier cannot run on this host: {}", stdout.trim());
        return false;
    }
    true
}

/// Everything the terminal's master reads, from a thread of its own.
fn follow(master: OwnedFd) -> Arc<Mutex<Vec<u8>>> {
    let screen = Arc::new(Mutex::new(Vec::new()));
    let sink = screen.clone();
    std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        while let Ok(n @ 1..) = nix::unistd::read(master.as_fd(), &mut buf) {
            sink.lock().expect("lock").extend_from_slice(&buf[..n]);
        }
    });
    screen
}

fn wait_for(screen: &Mutex<Vec<u8>>, text: &str) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let now = String::from_utf8_lossy(&screen.lock().expect("lock")).into_owned();
        if now.contains(text) {
            return;
        }
        assert!(Instant::now() < deadline, "no {text:?} on the terminal: {now:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_tty_run_is_raw_follows_the_window_and_gives_the_terminal_back() {
    if !process_tier_available() {
        return;
    }
    let size = Winsize { ws_row: 30, ws_col: 90, ws_xpixel: 0, ws_ypixel: 0 };
    let OpenptyResult { master, slave } = openpty(Some(&size), None).expect("openpty");
    let before = tcgetattr(&slave).expect("tcgetattr");
    let stdio = || Stdio::from(slave.try_clone().expect("dup"));
    let script = "trap 'stty size' WINCH; stty size; echo ready; \
                  while :; do read -t 0.1 line && break; done; echo \"got:$line\"; exit 5";
    let mut child = strata()
        .args(["run", "--tty", "--tier", "process", "--", "/bin/bash", "-c", script])
        .stdin(stdio())
        .stdout(stdio())
        .stderr(stdio())
        .spawn()
        .expect("spawn strata");
    let writer = master.try_clone().expect("dup");
    let screen = follow(master);
    wait_for(&screen, "30 90\r\nready\r\n");
    // Raw mode while the job runs: the caller's terminal neither echoes nor waits for a line.
    let raw = tcgetattr(&slave).expect("tcgetattr");
    assert!(!raw.local_flags.intersects(LocalFlags::ICANON | LocalFlags::ECHO), "{:?}", raw.local_flags);
    // A window change: what the kernel does for a terminal's foreground process group.
    strata_jail::tty::set_size(&writer, strata_jail::proto::TtySize { rows: 44, cols: 100 }).expect("resize");
    kill(Pid::from_raw(child.id() as i32), Signal::SIGWINCH).expect("SIGWINCH");
    wait_for(&screen, "44 100\r\n");
    // Enter is a carriage return on a raw terminal; the job's own terminal makes it a newline and echoes it.
    std::fs::File::from(writer).write_all(b"hi\r").expect("type");
    wait_for(&screen, "hi\r\ngot:hi\r\n");
    let status = child.wait().expect("wait");
    assert_eq!(status.code(), Some(5));
    let after = tcgetattr(&slave).expect("tcgetattr");
    assert_eq!(after.local_flags, before.local_flags, "the terminal as it was");
    assert_eq!(after.input_flags, before.input_flags);
}

#[test]
fn tty_without_a_terminal_is_a_usage_error() {
    let out = strata()
        .args(["run", "--tty", "--tier", "process", "--", "true"])
        .stdin(Stdio::null())
        .output()
        .expect("strata");
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--tty needs a terminal"), "{stderr}");
    let out = strata().args(["run", "--tty", "--json", "--", "true"]).output().expect("strata");
    assert_eq!(out.status.code(), Some(2), "{}", String::from_utf8_lossy(&out.stderr));
}
