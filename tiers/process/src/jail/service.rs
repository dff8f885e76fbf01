//! The jail's service, seen from the host ([`strata_jail::service`]): started, asked about and stopped through
//! PID 1, each request on a lane of its own, so that none waits for a job on the jail's first connection (a
//! close stops the service while a job may still hold that connection).
//!
//! The service runs in the child cgroup [`SERVICE_CGROUP`] of the jail's, made when it is started: its processes
//! are apart from the jobs' (the first connection's `Kill` spares them; a job's cgroup kill does not reach
//! them) and go with the jail's cgroup when the jail ends. That cgroup existing is also what tells a second start
//! that the jail has a service already, before PID 1 (which refuses it too) is asked.

use std::fs::File;
use std::io::ErrorKind;
use std::os::fd::{AsFd, BorrowedFd};
use std::time::Duration;

use strata_core::{ServiceExit, ServiceState, ServiceStatus};
use strata_jail::proto::{self, HostFrame, JailFrame};

use super::{CgroupError, CgroupLimits, JailError, Lanes, reply_on, wait_readable};

/// The name of the service's cgroup under the jail's.
pub const SERVICE_CGROUP: &str = "service";

/// How much longer than its grace a stop may take before the host gives up waiting for PID 1's answer (it
/// answers once the `SIGKILL` it sends after the grace has been reaped).
pub const STOP_MARGIN: Duration = Duration::from_secs(1);

impl Lanes {
    /// Starts the jail's service in a cgroup of its own under `limits` (see [`strata_jail::service`]) and answers
    /// its first status. A jail that has one already is `NotStarted` with stage `busy` and `EBUSY`.
    pub fn start_service(&self, service: &proto::Service, limits: &CgroupLimits) -> Result<ServiceStatus, JailError> {
        let cgroup = match self.jail_cgroup().named_child(SERVICE_CGROUP, limits) {
            Ok(cgroup) => cgroup,
            Err(CgroupError::Io { source, .. }) if source.kind() == ErrorKind::AlreadyExists => return Err(busy()),
            Err(err) => return Err(err.into()),
        };
        let started = (|| {
            let files = cgroup
                .self_join_files()
                .iter()
                .map(|path| File::options().write(true).open(path))
                .collect::<Result<Vec<File>, _>>()
                .map_err(JailError::Spawn)?;
            let mut service = service.clone();
            service.exec.cgroup_files = files.len() as u32;
            let fds: Vec<BorrowedFd<'_>> = files.iter().map(AsFd::as_fd).collect();
            let lane = self.open_lane()?;
            proto::send(lane.as_fd(), &HostFrame::Service(service), &fds)?;
            match reply_on(lane.as_fd())? {
                (JailFrame::ExecFailed { stage, errno, message }, _) => {
                    Err(JailError::NotStarted { stage, errno, message })
                }
                (frame, _) => status_of(frame, "Service"),
            }
        })();
        if started.is_err() {
            // Whatever a start that failed left (nothing, unless the jail went away mid-way), and the cgroup, so
            // that a later start may try again.
            cgroup.kill_all();
            cgroup.remove();
        }
        started
    }

    /// The jail's service as it is now; `None` when it has none.
    pub fn service_status(&self) -> Result<Option<ServiceStatus>, JailError> {
        let lane = self.open_lane()?;
        proto::send(lane.as_fd(), &HostFrame::ServiceStatus, &[])?;
        match reply_on(lane.as_fd())? {
            (JailFrame::NoService, _) => Ok(None),
            (frame, _) => status_of(frame, "ServiceStatus").map(Some),
        }
    }

    /// Stops the jail's service for good: `SIGTERM` to its process group, `SIGKILL` after `grace`. Waits until
    /// it has ended, at most `grace` + [`STOP_MARGIN`]; `None` when the jail has no service.
    pub fn stop_service(&self, grace: Duration) -> Result<Option<ServiceStatus>, JailError> {
        let lane = self.open_lane()?;
        let grace_ms = u64::try_from(grace.as_millis()).unwrap_or(u64::MAX);
        proto::send(lane.as_fd(), &HostFrame::StopService { grace_ms: Some(grace_ms) }, &[])?;
        if !wait_readable(lane.as_fd(), grace.saturating_add(STOP_MARGIN)) {
            return Err(JailError::Protocol(format!("the service did not stop within {grace:?} and a margin")));
        }
        match proto::recv::<JailFrame>(lane.as_fd())?.ok_or(JailError::Ended)? {
            (JailFrame::NoService, _) => Ok(None),
            (frame, _) => status_of(frame, "StopService").map(Some),
        }
    }
}

/// Why a second service is refused.
fn busy() -> JailError {
    JailError::NotStarted {
        stage: "busy".into(),
        errno: libc::EBUSY,
        message: "the jail has a service already (one per jail)".into(),
    }
}

/// The status a `ServiceStatus` frame describes; any other frame is a protocol error (the answer to `request`).
fn status_of(frame: JailFrame, request: &str) -> Result<ServiceStatus, JailError> {
    let JailFrame::ServiceStatus { state, restarts, pid, last_exit, log_tail } = frame else {
        return Err(JailError::Protocol(format!("unexpected {frame:?} for {request}")));
    };
    let state = match state {
        proto::ServiceState::Starting => ServiceState::Starting,
        proto::ServiceState::Running => ServiceState::Running,
        proto::ServiceState::Backoff => ServiceState::Backoff,
        proto::ServiceState::Exited => ServiceState::Exited,
        proto::ServiceState::Failed => ServiceState::Failed,
        proto::ServiceState::Stopped => ServiceState::Stopped,
    };
    let last_exit = last_exit.map(|exit| match exit {
        proto::ServiceExit::Code(code) => ServiceExit::Code(code),
        proto::ServiceExit::Signal(signal) => ServiceExit::Signal(signal),
    });
    Ok(ServiceStatus { state, restarts, pid, last_exit, log_tail })
}
