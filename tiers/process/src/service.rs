//! A process-tier sandbox's service ([`strata_core::service`]): the jail's PID 1 runs it
//! ([`strata_jail::service`]), in a cgroup of its own under the jail's ([`crate::jail::Lanes::start_service`]).
//!
//! Its command runs as the sandbox's jobs do: `/bin/sh -c COMMAND` prepared by the same code as a job's
//! ([`PreparedJob::new`]) — the base environment, the image's, the proxy variables and the capabilities' (egress
//! secrets' placeholders included), the image's working directory, the sandbox's (else the image's) user, the
//! open-files limit — but without the per-job CPU-time backstop (`RLIMIT_CPU`): a service runs for the sandbox's
//! whole life, bounded by the sandbox's cgroup like everything in it.
//!
//! Its output is in [`ServiceStatus::log_tail`] (the last 16 KiB) and, for the sandbox's jobs, in
//! `/run/strata/start.log` (rotated to `start.log.1` at 1 MiB). A sandbox's close stops it first: `SIGTERM` to its
//! process group, `SIGKILL` after [`ServiceSpec::stop_grace`], the close waiting at most that and
//! [`crate::jail::STOP_MARGIN`] for it. A fork of a snapshot does not run the service of the sandbox it was taken from.

use std::time::Duration;

use strata_core::{Capabilities, ExecOptions, Job, Limits, ServiceSpec, ServiceStatus, TierError, TierKind};
use strata_jail::proto;

use crate::jail::{JailError, Lanes};
use crate::{PreparedJob, RootImage, cgroup_limits, jail_error};

/// The jail's service frame for `spec`, as the sandbox with `caps`, `limits`, `image` and egress secrets'
/// placeholders `secret_env` runs its jobs.
pub(crate) fn prepare(
    spec: &ServiceSpec,
    caps: &Capabilities,
    limits: &Limits,
    image: &RootImage,
    secret_env: Vec<(String, String)>,
) -> Result<proto::Service, TierError> {
    spec.check()?;
    let job = Job::Command { argv: vec!["/bin/sh".into(), "-c".into(), spec.command.clone()] };
    let mut prepared = PreparedJob::new(&job, caps, limits, &ExecOptions::default(), image)?;
    prepared.add_env(secret_env);
    let mut exec = prepared.exec;
    exec.cpu_seconds = libc::RLIM_INFINITY;
    Ok(proto::Service {
        exec,
        restart_delay_ms: millis(spec.restart_delay),
        burst: spec.burst,
        burst_window_ms: millis(spec.burst_window),
        stop_grace_ms: millis(spec.stop_grace),
    })
}

/// Starts `service` in the jail behind `lanes`, its cgroup under the sandbox's `limits`.
pub(crate) fn start(lanes: &Lanes, service: &proto::Service, limits: &Limits) -> Result<ServiceStatus, TierError> {
    lanes.start_service(service, &cgroup_limits(limits)).map_err(|err| match err {
        JailError::NotStarted { errno: libc::EBUSY, .. } => {
            TierError::Busy { tier: TierKind::Process, doing: "its service (a sandbox runs one)" }
        }
        other => jail_error(other),
    })
}

/// The service of the jail behind `lanes`.
pub(crate) fn status(lanes: &Lanes) -> Result<Option<ServiceStatus>, TierError> {
    lanes.service_status().map_err(jail_error)
}

/// Stops the service of the jail behind `lanes` before the sandbox closes, waiting at most `grace` and
/// [`crate::jail::STOP_MARGIN`]; what it could not do is logged (the close goes on and kills everything anyway).
pub(crate) fn stop(lanes: &Lanes, grace: Duration) {
    match lanes.stop_service(grace) {
        Ok(_) | Err(JailError::Ended) => {}
        Err(err) => log::warn!("stopping the sandbox's service: {err}"),
    }
}

fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}
