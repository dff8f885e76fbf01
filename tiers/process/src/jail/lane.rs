//! Lanes: more control connections into a running jail, so that its jobs run at the same time.
//!
//! The jail's first connection ([`Jail`](super::Jail)) runs one job at a time. A lane ([`HostFrame::Lane`]) is
//! another connection that PID 1 serves beside it; [`Lanes`] opens one per job or file operation and closes it
//! afterwards, so any number run at once, from any thread. Each job on a lane gets a child cgroup of the jail's
//! ([`Cgroup::child`]): its CPU time, memory and limits are its own (the jail's limits still bound all jobs
//! together), and stopping it kills every process it started, wherever they went in the process tree.
//!
//! A job's background processes outlive it, as they do on the first connection: its cgroup stays until they
//! are gone, and is removed by a later call or with the jail.

use std::fs::File;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::{Arc, Mutex, Weak};
use std::time::Instant;

use nix::sys::socket::{AddressFamily, SockFlag, SockType, socketpair};
use strata_core::LimitKind;
use strata_egress::{Drained, EgressHandle};
use strata_jail::proto::{self, Exec, HostFrame, JailFrame, WatchEvent};

use super::files::request_on;
use super::{
    Baseline, Cgroup, CgroupLimits, Counters, DRAIN_TIMEOUT, DiskWatch, FileAnswer, JAMMED, JailError, JailWatch,
    JobEnd, JobIo, JobReport, JobWatch, MEMORY_HEADROOM, Pump, Scratch, WATCH_INTERVAL, job_pipes, read_file_on, tty,
    write_file_on,
};

/// Opens a lane through the connection `ctl`: returns the host's end.
pub(super) fn open(ctl: BorrowedFd<'_>) -> Result<OwnedFd, JailError> {
    let (host, jail) = socketpair(AddressFamily::Unix, SockType::SeqPacket, None, SockFlag::SOCK_CLOEXEC)
        .map_err(|e| JailError::Spawn(e.into()))?;
    match proto::send(ctl, &HostFrame::Lane, &[jail.as_fd()]) {
        Ok(()) => Ok(host),
        // PID 1 is gone: the socket's peer closed.
        Err(proto::ProtoError::Io(err))
            if matches!(err.raw_os_error(), Some(libc::EPIPE | libc::ECONNRESET | libc::ENOTCONN)) =>
        {
            Err(JailError::Ended)
        }
        Err(err) => Err(err.into()),
    }
}

/// Opens lanes into one jail ([`Jail::lanes`](super::Jail::lanes)); `Send + Sync`, used from any thread.
#[derive(Debug)]
pub struct Lanes {
    /// A lane used only to open the others.
    root: OwnedFd,
    /// The jail's cgroup.
    cgroup: Cgroup,
    /// The jail's egress proxy (the jail owns it).
    egress: Weak<EgressHandle>,
    /// Cgroups of ended jobs whose background processes still run.
    lingering: Mutex<Vec<Cgroup>>,
    /// The jail's writable layer.
    scratch: Option<Arc<Scratch>>,
}

impl Lanes {
    pub(super) fn new(
        root: OwnedFd,
        cgroup: Cgroup,
        egress: Weak<EgressHandle>,
        scratch: Option<Arc<Scratch>>,
    ) -> Lanes {
        Lanes { root, cgroup, egress, lingering: Mutex::new(Vec::new()), scratch }
    }

    /// Opens a lane of its own for one request.
    pub(super) fn open_lane(&self) -> Result<OwnedFd, JailError> {
        open(self.root.as_fd())
    }

    /// The jail's cgroup.
    pub(super) fn jail_cgroup(&self) -> &Cgroup {
        &self.cgroup
    }

    /// Runs one job on a lane of its own and waits for it: stdin fed, output captured, `watch` enforced on the
    /// job's own cgroup (created with `limits`). Other jobs may run meanwhile.
    pub fn exec(
        &self,
        exec: &Exec,
        program: Option<File>,
        io: &JobIo<'_>,
        watch: &JobWatch,
        limits: &CgroupLimits,
    ) -> Result<JobReport, JailError> {
        self.prune();
        let lane = open(self.root.as_fd())?;
        let cgroup = self.cgroup.child(limits)?;
        let started = self.start(&lane, &cgroup, exec, program, io);
        let (_tty, (stdin_w, stdout_r, stderr_r)) = match started {
            Ok(started) => started,
            Err(err) => {
                cgroup.kill_all();
                self.retire(cgroup);
                return Err(err);
            }
        };
        let report = self.watch(&lane, &cgroup, (stdin_w, stdout_r, stderr_r), io, watch);
        drop(lane);
        self.retire(cgroup);
        if report.as_ref().is_ok_and(|r| r.end == JobEnd::Limit(LimitKind::Memory))
            && !self.cgroup.can_make_room(MEMORY_HEADROOM)
        {
            // Everything in the jail's cgroup, PID 1 included: the jail ends, as its handle then finds.
            log::warn!("{JAMMED}");
            self.cgroup.kill_all();
        }
        report
    }

    /// Sends the job on `lane`, with its pipes (or on a terminal, [`tty`]) and its cgroup's files; returns the
    /// host's ends of its streams, and its terminal while it has one.
    fn start(
        &self,
        lane: &OwnedFd,
        cgroup: &Cgroup,
        exec: &Exec,
        program: Option<File>,
        io: &JobIo<'_>,
    ) -> Result<(Option<tty::TtyLink>, tty::Ends), JailError> {
        let files = cgroup
            .self_join_files()
            .iter()
            .map(|path| File::options().write(true).open(path))
            .collect::<Result<Vec<File>, _>>()
            .map_err(JailError::Spawn)?;
        let mut exec = exec.clone();
        exec.cgroup_files = files.len() as u32;
        let mut extra: Vec<BorrowedFd<'_>> = files.iter().map(AsFd::as_fd).collect();
        extra.extend(program.as_ref().map(AsFd::as_fd));
        if let Some(terminal) = io.terminal {
            let (link, ends) = tty::start(lane.as_fd(), &exec, &extra, terminal, io.stdin_stream)?;
            return Ok((Some(link), ends));
        }
        let (pipes, theirs) = job_pipes()?;
        let mut fds = vec![io.stdin_stream.unwrap_or(theirs.0.as_fd()), theirs.1.as_fd(), theirs.2.as_fd()];
        fds.extend(extra);
        proto::send(lane.as_fd(), &HostFrame::Exec(exec), &fds)?;
        Ok((None, pipes))
    }

    /// Pumps the job's streams and enforces `watch` until it ends.
    fn watch(
        &self,
        lane: &OwnedFd,
        cgroup: &Cgroup,
        (stdin_w, stdout_r, stderr_r): (OwnedFd, OwnedFd, OwnedFd),
        io: &JobIo<'_>,
        watch: &JobWatch,
    ) -> Result<JobReport, JailError> {
        let counters = Counters {
            job: Baseline::take(cgroup),
            outer: Some(Baseline::take(&self.cgroup)),
            disk: DiskWatch::take(self.scratch.as_deref()),
        };
        let start = Instant::now();
        let mut pump = Pump::new(stdin_w, stdout_r, stderr_r, io, true);
        let mut exit: Option<JobEnd> = None;
        let mut stopped: Option<JobEnd> = None;
        let mut killed_at: Option<Instant> = None;
        let mut lane_open = true;
        loop {
            if exit.is_some() {
                // Its background processes may hold the pipes open: take what is there and stop.
                pump.drain_available(io);
                break;
            }
            if !lane_open {
                // The jail is gone: the pipes reach end of file once its last process is.
                if pump.drained() || killed_at.unwrap_or(start).elapsed() > DRAIN_TIMEOUT {
                    break;
                }
            }
            if killed_at.is_some_and(|t| t.elapsed() > DRAIN_TIMEOUT) {
                break;
            }
            let deadline = start + watch.wall;
            let mut timeout = WATCH_INTERVAL;
            if stopped.is_none() {
                timeout = timeout.min(deadline.saturating_duration_since(Instant::now()));
            }
            let ready = pump.poll(lane_open.then(|| lane.as_fd()), timeout);
            if ready.ctl {
                match proto::recv::<JailFrame>(lane.as_fd()) {
                    Ok(Some((JailFrame::Started { .. }, _))) => {}
                    Ok(Some((JailFrame::Exited { code, signal }, _))) => {
                        exit = Some(JobEnd::of_exit(code, signal));
                    }
                    Ok(Some((JailFrame::ExecFailed { stage, errno, message }, _))) => {
                        return Err(JailError::NotStarted { stage, errno, message });
                    }
                    Ok(Some((other, _))) => {
                        cgroup.kill_all();
                        return Err(JailError::Protocol(format!("unexpected {other:?} during a job")));
                    }
                    Ok(None) | Err(_) => {
                        lane_open = false;
                        killed_at.get_or_insert_with(Instant::now);
                    }
                }
            }
            pump.transfer(&ready, io);
            if stopped.is_none()
                && exit.is_none()
                && lane_open
                && let Some(reason) = counters.reached(watch, start)
            {
                stopped = Some(reason);
                killed_at = Some(Instant::now());
                // Every process the job started, wherever it went: they are all in its cgroup.
                cgroup.kill_all();
            }
        }
        let wall = start.elapsed();
        let peak_memory = if cgroup.has_memory() { cgroup.peak_memory() } else { self.cgroup.peak_memory() };
        Ok(JobReport { end: counters.explain(stopped, exit, watch), wall, cpu: counters.job.cpu(), peak_memory })
    }

    /// Removes a job's cgroup, or keeps it while its background processes run.
    fn retire(&self, cgroup: Cgroup) {
        if !cgroup.try_remove()
            && let Ok(mut lingering) = self.lingering.lock()
        {
            lingering.push(cgroup);
        }
    }

    /// Removes the cgroups of ended jobs whose last processes have gone.
    fn prune(&self) {
        if let Ok(mut lingering) = self.lingering.lock() {
            lingering.retain(|cgroup| !cgroup.try_remove());
        }
    }

    /// Writes a file in the jail on a lane of its own (parents created), replacing any file there.
    pub fn write_file(&self, path: &str, contents: &[u8], mode: u32) -> Result<(), JailError> {
        write_file_on(open(self.root.as_fd())?.as_fd(), path, contents, mode)
    }

    /// Reads a regular file of the jail on a lane of its own, at most `max` bytes (more is `EFBIG`).
    pub fn read_file(&self, path: &str, max: u64) -> Result<Vec<u8>, JailError> {
        read_file_on(open(self.root.as_fd())?.as_fd(), path, max)
    }

    /// Sends a filesystem request to PID 1 on a lane of its own and reads its answer.
    pub fn file_request(&self, frame: &HostFrame) -> Result<FileAnswer, JailError> {
        request_on(open(self.root.as_fd())?.as_fd(), frame)
    }

    /// Watches the directory `path` (and every directory below it, `recursive`) on a lane of its own: PID 1's
    /// event frames are handed to `on_events`, with whether events were lost before them, from a thread of the
    /// watch's own, until it answers false or the returned watch is stopped or dropped.
    pub fn watch_dir(
        &self,
        path: &str,
        recursive: bool,
        on_events: impl FnMut(Vec<WatchEvent>, bool) -> bool + Send + 'static,
    ) -> Result<JailWatch, JailError> {
        JailWatch::start(open(self.root.as_fd())?, path, recursive, on_events)
    }

    /// What the whole jail uses now: its CPU time, its memory (used, of which page cache, limit) and its writable
    /// layer (used, size).
    pub fn usage(&self) -> (std::time::Duration, (u64, u64, u64), (u64, u64)) {
        let disk = self.scratch.as_deref().map(Scratch::usage).unwrap_or_default();
        (self.cgroup.cpu_time(), self.cgroup.memory_now(), disk)
    }

    /// The egress records of connections that ended since the last drain (of any job in the jail), first
    /// waiting up to `settle` for those still open.
    pub fn drain_egress(&self, settle: std::time::Duration) -> Drained {
        self.egress.upgrade().map(|proxy| proxy.drain_records_settled(settle)).unwrap_or_default()
    }
}
