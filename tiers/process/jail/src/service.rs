//! The jail's service: a command PID 1 starts, supervises and stops ([`HostFrame::Service`]), as a container
//! runtime runs an image's `CMD`, or E2B a template's start command.
//!
//! PID 1 starts it exactly as it starts a job (its account, rlimits, its own session and process group, the
//! jail's seccomp filter), in the cgroup whose files came with the frame, with an empty pipe as its stdin and one
//! pipe as its stdout and stderr. PID 1 reaps it like any process of the jail, but takes its exit status before
//! the generic reaper does (see `Init::reap`), and starts it again [`Service::restart_delay_ms`] after it ended —
//! whatever the exit: it is a service — unless it had been started [`Service::burst`] times within
//! [`Service::burst_window_ms`]: then it is [`ServiceState::Failed`] and stays down. When its main process ends,
//! what it left in its process group is killed (while its zombie still holds the group's ID), so a restart never
//! runs beside the previous run's children.
//!
//! Its output: PID 1 reads the pipe without ever waiting (a non-blocking read, at most [`READ_CHUNK`] bytes per
//! turn of its event loop; a service that writes faster than that waits on a full pipe, never PID 1), keeps the
//! last [`LOG_TAIL`] bytes for [`JailFrame::ServiceStatus`], and appends everything to [`LOG_FILE`] so the
//! jail's jobs can read it. That file is emptied when the service first starts; once it holds [`LOG_FILE_MAX`]
//! bytes it is renamed to [`LOG_ROTATED`] (replacing the one before) and a new one begins: at most twice that
//! on the jail's disk. It is opened through [`Files`] (its directory resolved inside the jail's root, a link in
//! its place refused), and opened again when a job removed it.
//!
//! A stop ([`HostFrame::StopService`]) sends `SIGTERM` to the service's process group, and `SIGKILL` once the
//! grace has passed; it is answered when the main process has ended.

use std::collections::VecDeque;
use std::fs::File;
use std::io::Write;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::fcntl::OFlag;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use crate::files::Files;
#[cfg(doc)]
use crate::proto::HostFrame;
use crate::proto::{Exec, JailFrame, Service, ServiceExit, ServiceState};
use crate::watch::Owner;

/// Where the service's output is written, for the jail's jobs to read.
pub const LOG_FILE: &str = "/run/strata/start.log";

/// Where [`LOG_FILE`] goes once it is full (replacing what was there).
pub const LOG_ROTATED: &str = "/run/strata/start.log.1";

/// The most bytes [`LOG_FILE`] holds before it is rotated.
pub const LOG_FILE_MAX: u64 = 1 << 20;

/// The most bytes of output PID 1 keeps for [`JailFrame::ServiceStatus`].
pub const LOG_TAIL: usize = 16 * 1024;

/// The most bytes read from the service's pipe per turn of PID 1's event loop.
pub const READ_CHUNK: usize = 64 * 1024;

/// How long a run of the service is `starting` before it is `running`; one that ends before is in `backoff`.
pub const START_SECONDS: u64 = 1;

const START: Duration = Duration::from_secs(START_SECONDS);

/// The least time between the end of a run and the next start, whatever the service asks: a service that ends at
/// once, with a burst window of zero, would otherwise keep PID 1 forking.
pub const MIN_RESTART_DELAY: Duration = Duration::from_millis(10);

/// The starts of a service within its burst window: whether it may be started again.
#[derive(Debug, Clone)]
pub struct Burst {
    /// When it was started, oldest first; none older than the window is kept.
    starts: VecDeque<Instant>,
    limit: u32,
    window: Duration,
}

impl Burst {
    /// At most `limit` starts (at least 1) within any `window`.
    pub fn new(limit: u32, window: Duration) -> Burst {
        Burst { starts: VecDeque::new(), limit: limit.max(1), window }
    }

    /// Records a start at `now`.
    pub fn started(&mut self, now: Instant) {
        self.forget(now);
        self.starts.push_back(now);
    }

    /// Whether the starts within the window that ends at `now` reached the limit: the service, ended at `now`,
    /// is not started again.
    pub fn exhausted(&mut self, now: Instant) -> bool {
        self.forget(now);
        self.starts.len() >= self.limit as usize
    }

    /// Forgets the starts that are not within the window ending at `now` (those at least `window` old).
    fn forget(&mut self, now: Instant) {
        while self.starts.front().is_some_and(|start| now.saturating_duration_since(*start) >= self.window) {
            self.starts.pop_front();
        }
    }
}

/// The last bytes of a stream, at most a fixed number.
#[derive(Debug, Clone)]
pub struct Tail {
    bytes: VecDeque<u8>,
    max: usize,
}

impl Tail {
    /// An empty tail that keeps at most `max` bytes.
    pub fn new(max: usize) -> Tail {
        Tail { bytes: VecDeque::with_capacity(max.min(LOG_TAIL)), max }
    }

    /// Appends `data`, dropping the oldest bytes past the limit.
    pub fn push(&mut self, data: &[u8]) {
        let data = &data[data.len().saturating_sub(self.max)..];
        let over = (self.bytes.len() + data.len()).saturating_sub(self.max);
        self.bytes.drain(..over);
        self.bytes.extend(data);
    }

    /// The bytes as text: a character cut at the start is left out, invalid UTF-8 replaced.
    pub fn text(&self) -> String {
        let (front, back) = self.bytes.as_slices();
        let mut bytes = Vec::with_capacity(self.bytes.len());
        bytes.extend_from_slice(front);
        bytes.extend_from_slice(back);
        // At most three continuation bytes of a character whose first byte was dropped.
        let cut = bytes.iter().take(3).take_while(|b| (**b & 0xc0) == 0x80).count();
        String::from_utf8_lossy(&bytes[cut..]).into_owned()
    }
}

/// [`LOG_FILE`] while the service writes it.
#[derive(Debug, Default)]
struct LogFile {
    file: Option<File>,
    /// Bytes in the current file.
    written: u64,
    /// Whether the next open empties the file: the first (an earlier jail's log, from a snapshot, is not this
    /// service's), and the one after a rotation.
    fresh: bool,
}

impl LogFile {
    fn new() -> LogFile {
        LogFile { file: None, written: 0, fresh: true }
    }

    /// Appends `data`, opening the file (again, when a job removed it or a write failed) and rotating it as
    /// needed. A failure (a full disk, a directory in its place) loses the data for the file only.
    fn write(&mut self, files: &Files, data: &[u8]) {
        if self.file.as_ref().is_some_and(|file| nix::sys::stat::fstat(file).is_ok_and(|st| st.st_nlink == 0)) {
            self.file = None;
        }
        if self.file.is_some() && self.written.saturating_add(data.len() as u64) > LOG_FILE_MAX {
            let _ = files.rename(LOG_FILE, LOG_ROTATED);
            self.file = None;
            self.fresh = true;
        }
        if self.file.is_none() {
            self.file = files.open_append(LOG_FILE, self.fresh).ok();
            if let Some(file) = &self.file {
                self.fresh = false;
                self.written = file.metadata().map(|m| m.len()).unwrap_or(0);
            }
        }
        if let Some(file) = &mut self.file {
            match file.write_all(data) {
                Ok(()) => self.written = self.written.saturating_add(data.len() as u64),
                Err(_) => self.file = None,
            }
        }
    }
}

/// Where the service is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Run {
    /// Its main process runs (or has ended and is not reaped yet).
    Up {
        /// Its PID, and its process group's.
        pid: Pid,
        /// When it was started.
        since: Instant,
    },
    /// It ended; it is started again at `at`. `state` is `Backoff` or `Exited`.
    Waiting { at: Instant, state: ServiceState },
    /// It stays down: `Failed` or `Stopped`.
    Down(ServiceState),
}

/// A stop that waits for the service to end.
#[derive(Debug)]
struct Stopping {
    /// When `SIGKILL` follows the `SIGTERM`; `None` once sent.
    kill_at: Option<Instant>,
    /// The connections to answer when it has ended.
    reply_to: Vec<Owner>,
}

/// What a stop asks of PID 1.
#[derive(Debug, PartialEq, Eq)]
pub enum StopReply {
    /// Answer now: the service is down.
    Now,
    /// Answer once it has ended ([`Supervisor::reaped`] returns the connections).
    Later,
}

/// PID 1's service: its policy, its process, its output.
#[derive(Debug)]
pub struct Supervisor {
    service: Service,
    /// The service's cgroup files, a copy of which each start joins.
    cgroup: Vec<OwnedFd>,
    /// The read end of its output pipe (non-blocking) and the write end each start gets as stdout and stderr.
    log_r: OwnedFd,
    log_w: OwnedFd,
    tail: Tail,
    file: LogFile,
    burst: Burst,
    run: Run,
    restarts: u32,
    last_exit: Option<ServiceExit>,
    stopping: Option<Stopping>,
}

impl Supervisor {
    /// A supervisor of `service` (checked: no terminal, no program to copy in, `cgroup` as many as
    /// [`Exec::cgroup_files`]), not started yet.
    pub fn new(service: Service, cgroup: Vec<OwnedFd>) -> Result<Supervisor, JailFrame> {
        let refused = |message: &str| JailFrame::ExecFailed {
            stage: "protocol".into(),
            errno: libc::EINVAL,
            message: format!("a service {message}"),
        };
        if service.exec.tty.is_some() {
            return Err(refused("has no terminal"));
        }
        if service.exec.program_copy.is_some() {
            return Err(refused("has no program to copy in"));
        }
        if cgroup.len() != service.exec.cgroup_files as usize {
            return Err(refused(&format!(
                "came with {} descriptors, expected {}",
                cgroup.len(),
                service.exec.cgroup_files
            )));
        }
        let pipe_failed = |errno: Errno| JailFrame::ExecFailed {
            stage: "pipe".into(),
            errno: errno as i32,
            message: format!("the service's output pipe: {}", errno.desc()),
        };
        let (log_r, log_w) = nix::unistd::pipe2(OFlag::O_CLOEXEC | OFlag::O_NONBLOCK).map_err(pipe_failed)?;
        // The service's end blocks as a pipe normally does; only PID 1's never waits.
        let flags =
            OFlag::from_bits_truncate(nix::fcntl::fcntl(&log_w, nix::fcntl::FcntlArg::F_GETFL).map_err(pipe_failed)?);
        nix::fcntl::fcntl(&log_w, nix::fcntl::FcntlArg::F_SETFL(flags & !OFlag::O_NONBLOCK)).map_err(pipe_failed)?;
        let burst = Burst::new(service.burst, Duration::from_millis(service.burst_window_ms));
        Ok(Supervisor {
            service,
            cgroup,
            log_r,
            log_w,
            tail: Tail::new(LOG_TAIL),
            file: LogFile::new(),
            burst,
            run: Run::Down(ServiceState::Stopped),
            restarts: 0,
            last_exit: None,
            stopping: None,
        })
    }

    /// What each start runs.
    pub fn exec(&self) -> &Exec {
        &self.service.exec
    }

    /// The descriptors of a start: stdin (an empty pipe, at its end), stdout and stderr (the output pipe), then
    /// copies of the cgroup files.
    pub fn start_fds(&self) -> Result<Vec<OwnedFd>, Errno> {
        let (stdin, _closed) = nix::unistd::pipe2(OFlag::O_CLOEXEC)?;
        let mut fds = vec![stdin, self.log_w.try_clone().map_err(io_errno)?, self.log_w.try_clone().map_err(io_errno)?];
        for file in &self.cgroup {
            fds.push(file.try_clone().map_err(io_errno)?);
        }
        Ok(fds)
    }

    /// Records a start at `now` as `pid`.
    pub fn started(&mut self, pid: Pid, now: Instant) {
        self.burst.started(now);
        self.run = Run::Up { pid, since: now };
    }

    /// Records a start at `now` that could not be made (`message` goes to its log), as a run that ended at once.
    pub fn start_failed(&mut self, message: &str, files: &Files, now: Instant) {
        self.burst.started(now);
        self.log(files, format!("strata: the service could not be started again: {message}\n").as_bytes());
        self.run = self.after_run(now, now);
    }

    /// The PID of its main process while it runs.
    pub fn pid(&self) -> Option<Pid> {
        match self.run {
            Run::Up { pid, .. } => Some(pid),
            _ => None,
        }
    }

    /// Whether it is to be started again now.
    pub fn restart_due(&self, now: Instant) -> bool {
        matches!(self.run, Run::Waiting { at, .. } if at <= now) && self.stopping.is_none()
    }

    /// Counts a start after the first.
    pub fn restarting(&mut self) {
        self.restarts = self.restarts.saturating_add(1);
    }

    /// How long until it needs PID 1 again (a restart, a `SIGKILL` after a stop's grace).
    pub fn next_wake(&self, now: Instant) -> Option<Duration> {
        let restart = match self.run {
            Run::Waiting { at, .. } if self.stopping.is_none() => Some(at),
            _ => None,
        };
        let kill = self.stopping.as_ref().and_then(|stopping| stopping.kill_at);
        restart.into_iter().chain(kill).min().map(|at| at.saturating_duration_since(now))
    }

    /// Kills what is left in the service's process group once its main process has ended: called before that
    /// process is reaped, while its zombie still holds the group's ID (so no other process can have it).
    pub fn kill_group_if_ended(&self) {
        use nix::sys::wait::{Id, WaitPidFlag, WaitStatus, waitid};
        let Some(pid) = self.pid() else { return };
        let flags = WaitPidFlag::WEXITED | WaitPidFlag::WNOHANG | WaitPidFlag::WNOWAIT;
        if matches!(waitid(Id::Pid(pid), flags), Ok(WaitStatus::Exited(..) | WaitStatus::Signaled(..))) {
            let _ = kill(Pid::from_raw(-pid.as_raw()), Signal::SIGKILL);
        }
    }

    /// Its main process `pid` ended (`exit`), if it is the service's; returns the connections a stop waits to
    /// answer (empty when none does), or `None` when `pid` is not the service's.
    pub fn reaped(&mut self, pid: Pid, exit: ServiceExit, now: Instant) -> Option<Vec<Owner>> {
        let Run::Up { pid: own, since } = self.run else { return None };
        if own != pid {
            return None;
        }
        self.last_exit = Some(exit);
        if let Some(stopping) = self.stopping.take() {
            self.run = Run::Down(ServiceState::Stopped);
            return Some(stopping.reply_to);
        }
        self.run = self.after_run(since, now);
        Some(Vec::new())
    }

    /// Where a run started at `since` and ended at `now` leaves the service.
    fn after_run(&mut self, since: Instant, now: Instant) -> Run {
        if self.burst.exhausted(now) {
            return Run::Down(ServiceState::Failed);
        }
        let state =
            if now.saturating_duration_since(since) < START { ServiceState::Backoff } else { ServiceState::Exited };
        let delay = Duration::from_millis(self.service.restart_delay_ms).max(MIN_RESTART_DELAY);
        Run::Waiting { at: now + delay, state }
    }

    /// Stops the service for good: `SIGTERM` to its process group and `SIGKILL` after `grace` (the service's
    /// own when `None`), answering `reply_to` once it has ended; at once when it is not running.
    pub fn stop(&mut self, grace: Option<u64>, reply_to: Owner, now: Instant) -> StopReply {
        let Run::Up { pid, .. } = self.run else {
            self.run = Run::Down(ServiceState::Stopped);
            return StopReply::Now;
        };
        match &mut self.stopping {
            Some(stopping) => stopping.reply_to.push(reply_to),
            None => {
                let grace = Duration::from_millis(grace.unwrap_or(self.service.stop_grace_ms));
                let _ = kill(Pid::from_raw(-pid.as_raw()), Signal::SIGTERM);
                self.stopping = Some(Stopping { kill_at: Some(now + grace), reply_to: vec![reply_to] });
            }
        }
        StopReply::Later
    }

    /// Sends the `SIGKILL` of a stop whose grace has passed.
    pub fn kill_if_due(&mut self, now: Instant) {
        if let (Some(stopping), Run::Up { pid, .. }) = (&mut self.stopping, self.run)
            && stopping.kill_at.is_some_and(|at| at <= now)
        {
            stopping.kill_at = None;
            let _ = kill(Pid::from_raw(-pid.as_raw()), Signal::SIGKILL);
        }
    }

    /// The output pipe, for PID 1's poll.
    pub fn log_fd(&self) -> BorrowedFd<'_> {
        self.log_r.as_fd()
    }

    /// Reads what the output pipe holds: one [`READ_CHUNK`], or (`all`) everything there now (bounded by what
    /// a pipe holds, since the read never waits for more).
    pub fn pump(&mut self, files: &Files, all: bool) {
        let mut buf = vec![0u8; READ_CHUNK];
        // A pipe holds at most 1 MiB (`/proc/sys/fs/pipe-max-size`'s default); the bound is a backstop.
        for _ in 0..if all { 64 } else { 1 } {
            match nix::unistd::read(self.log_r.as_fd(), &mut buf) {
                Ok(0) | Err(_) => return,
                Ok(n) => self.log(files, &buf[..n]),
            }
        }
    }

    fn log(&mut self, files: &Files, data: &[u8]) {
        self.tail.push(data);
        self.file.write(files, data);
    }

    /// Its status as of `now`.
    pub fn status(&self, now: Instant) -> JailFrame {
        let (state, pid) = match self.run {
            Run::Up { pid, since } if now.saturating_duration_since(since) < START => {
                (ServiceState::Starting, Some(pid))
            }
            Run::Up { pid, .. } => (ServiceState::Running, Some(pid)),
            Run::Waiting { state, .. } | Run::Down(state) => (state, None),
        };
        JailFrame::ServiceStatus {
            state,
            restarts: self.restarts,
            pid: pid.and_then(|pid| u32::try_from(pid.as_raw()).ok()),
            last_exit: self.last_exit,
            log_tail: self.tail.text(),
        }
    }
}

fn io_errno(err: std::io::Error) -> Errno {
    Errno::from_raw(err.raw_os_error().unwrap_or(libc::EIO))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_counts_the_starts_within_its_window() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let mut burst = Burst::new(3, Duration::from_millis(1000));
        burst.started(at(0));
        assert!(!burst.exhausted(at(10)));
        burst.started(at(100));
        assert!(!burst.exhausted(at(110)));
        burst.started(at(200));
        assert!(burst.exhausted(at(210)), "three starts within a second");
        // The first start leaves the window at 1000 ms: one more may be made.
        assert!(!burst.exhausted(at(1000)));
        burst.started(at(1000));
        assert!(burst.exhausted(at(1050)));
        assert!(!burst.exhausted(at(1100)), "the start at 100 ms has left the window");
    }

    #[test]
    fn a_slow_service_never_exhausts_its_burst() {
        let t0 = Instant::now();
        let mut burst = Burst::new(2, Duration::from_secs(60));
        for minute in 0..10 {
            let now = t0 + Duration::from_secs(61 * minute);
            assert!(!burst.exhausted(now), "minute {minute}");
            burst.started(now);
        }
    }

    #[test]
    fn a_burst_of_zero_is_one_and_a_zero_window_holds_nothing() {
        let now = Instant::now();
        let mut once = Burst::new(0, Duration::from_secs(1));
        once.started(now);
        assert!(once.exhausted(now));
        let mut always = Burst::new(1, Duration::ZERO);
        always.started(now);
        assert!(!always.exhausted(now));
    }

    #[test]
    fn the_tail_keeps_the_last_bytes_and_whole_characters() {
        let mut tail = Tail::new(8);
        tail.push(b"abc");
        tail.push(b"defgh");
        assert_eq!(tail.text(), "abcdefgh");
        tail.push(b"ij");
        assert_eq!(tail.text(), "cdefghij");
        tail.push(b"0123456789");
        assert_eq!(tail.text(), "23456789");
        // "é" is two bytes: the cut leaves its second, which is not shown.
        let mut tail = Tail::new(4);
        tail.push("xé!!".as_bytes());
        assert_eq!(tail.bytes.len(), 4);
        assert_eq!(tail.text(), "é!!");
        tail.push(b"!");
        assert_eq!(tail.text(), "!!!");
        assert_eq!(Tail::new(4).text(), "");
    }

    #[test]
    fn a_supervisor_restarts_until_the_burst_then_fails() {
        let service = Service {
            exec: Exec {
                argv: vec!["/bin/sh".into(), "-c".into(), "exit 3".into()],
                env: vec![],
                cwd: "/".into(),
                program_copy: None,
                nofile: 64,
                cpu_seconds: 1,
                cgroup_files: 0,
                tty: None,
                user: None,
            },
            restart_delay_ms: 100,
            burst: 2,
            burst_window_ms: 60_000,
            stop_grace_ms: 2000,
        };
        let mut supervisor = Supervisor::new(service, Vec::new()).expect("a supervisor");
        let t0 = Instant::now();
        // PIDs no process has: the group kills find nothing.
        let pid = Pid::from_raw(i32::MAX - 1);
        supervisor.started(pid, t0);
        assert!(matches!(supervisor.status(t0), JailFrame::ServiceStatus { state: ServiceState::Starting, .. }));
        assert_eq!(supervisor.reaped(Pid::from_raw(i32::MAX - 2), ServiceExit::Code(0), t0), None, "not its PID");
        assert_eq!(supervisor.reaped(pid, ServiceExit::Code(3), t0), Some(Vec::new()));
        assert!(matches!(
            supervisor.status(t0),
            JailFrame::ServiceStatus { state: ServiceState::Backoff, pid: None, .. }
        ));
        assert!(!supervisor.restart_due(t0));
        assert_eq!(supervisor.next_wake(t0), Some(Duration::from_millis(100)));
        let t1 = t0 + Duration::from_millis(100);
        assert!(supervisor.restart_due(t1));
        supervisor.restarting();
        supervisor.started(pid, t1);
        let t2 = t1 + Duration::from_secs(2);
        assert!(matches!(supervisor.status(t2), JailFrame::ServiceStatus { state: ServiceState::Running, .. }));
        supervisor.reaped(pid, ServiceExit::Signal(9), t2);
        let JailFrame::ServiceStatus { state, restarts, last_exit, .. } = supervisor.status(t2) else { panic!() };
        assert_eq!((state, restarts, last_exit), (ServiceState::Failed, 1, Some(ServiceExit::Signal(9))));
        assert_eq!(supervisor.next_wake(t2), None);
        assert_eq!(supervisor.stop(None, None, t2), StopReply::Now);
    }

    #[test]
    fn a_stop_waits_for_the_end_and_answers_every_caller() {
        let service = Service {
            exec: Exec {
                argv: vec!["sleep".into(), "1000".into()],
                env: vec![],
                cwd: "/".into(),
                program_copy: None,
                nofile: 64,
                cpu_seconds: 1,
                cgroup_files: 0,
                tty: None,
                user: None,
            },
            restart_delay_ms: 0,
            burst: 5,
            burst_window_ms: 1000,
            stop_grace_ms: 2000,
        };
        let mut supervisor = Supervisor::new(service, Vec::new()).expect("a supervisor");
        let t0 = Instant::now();
        let pid = Pid::from_raw(i32::MAX - 1);
        supervisor.started(pid, t0);
        assert_eq!(supervisor.stop(Some(500), None, t0), StopReply::Later);
        assert_eq!(supervisor.stop(None, Some(7), t0), StopReply::Later);
        assert_eq!(supervisor.next_wake(t0), Some(Duration::from_millis(500)), "the first stop's grace");
        supervisor.kill_if_due(t0 + Duration::from_millis(500));
        assert_eq!(supervisor.next_wake(t0), None, "SIGKILL sent");
        assert_eq!(supervisor.reaped(pid, ServiceExit::Signal(9), t0), Some(vec![None, Some(7)]));
        assert!(matches!(supervisor.status(t0), JailFrame::ServiceStatus { state: ServiceState::Stopped, .. }));
        assert!(!supervisor.restart_due(t0 + Duration::from_secs(10)), "a stopped service stays down");
    }

    #[test]
    fn a_service_with_a_terminal_or_the_wrong_descriptors_is_refused() {
        let exec = Exec {
            argv: vec!["true".into()],
            env: vec![],
            cwd: "/".into(),
            program_copy: None,
            nofile: 64,
            cpu_seconds: 1,
            cgroup_files: 1,
            tty: None,
            user: None,
        };
        let service =
            |exec: Exec| Service { exec, restart_delay_ms: 0, burst: 1, burst_window_ms: 0, stop_grace_ms: 0 };
        assert!(Supervisor::new(service(exec.clone()), Vec::new()).is_err(), "one cgroup file announced, none came");
        let tty = Exec { tty: Some(crate::proto::TtySize { rows: 24, cols: 80 }), cgroup_files: 0, ..exec.clone() };
        assert!(Supervisor::new(service(tty), Vec::new()).is_err());
        let copy = Exec { program_copy: Some("/run/strata/bin/x".into()), cgroup_files: 0, ..exec };
        assert!(Supervisor::new(service(copy), Vec::new()).is_err());
    }
}
