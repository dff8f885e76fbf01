//! An image's start and ready commands (a Dockerfile's `# strata: start=… ready=…`, E2B's template start and ready
//! commands), run when a sandbox on the image starts or is forked: the start command as the sandbox's supervised
//! service ([`Sandbox::start_service`]: restarted when it ends, within a burst limit, stopped with `SIGTERM` then
//! `SIGKILL` when the sandbox ends), then the ready command as a job, again and again, until it exits 0 — only
//! then is the sandbox handed over. A ready command that does not succeed within [`READY_TIMEOUT`] (or a start
//! command whose restarts are spent) ends the sandbox and is [`EngineError::ImageNotReady`], with the last output
//! of both.

use std::time::{Duration, Instant};

use strata_core::{ExecOptions, ImageName, Job, Limits, Sandbox, ServiceSpec, ServiceState, Status};

use crate::{Engine, EngineError};

/// How long a sandbox's ready command has to succeed.
pub const READY_TIMEOUT: Duration = Duration::from_secs(60);

/// How long one run of the ready command may take.
const READY_RUN: Duration = Duration::from_secs(10);

/// The pause between two runs of the ready command.
const READY_PAUSE: Duration = Duration::from_millis(100);

impl Engine {
    /// Starts the image's start command in `sandbox` and waits for its ready command (see [`crate::image_start`]);
    /// nothing for an image that has neither. On failure the sandbox is closed.
    pub(crate) fn start_image_service(&self, sandbox: &dyn Sandbox, image: &ImageName) -> Result<(), EngineError> {
        let store = self.image_store()?;
        let config = store.get(image).map_err(|e| EngineError::Image(e.to_string()))?.config;
        let result = (|| {
            if let Some(start) = &config.start {
                sandbox.start_service(&ServiceSpec::new(start.clone()))?;
            }
            match &config.ready {
                Some(ready) => wait_ready(sandbox, image, ready),
                None => Ok(()),
            }
        })();
        if result.is_err() {
            let _ = sandbox.close();
        }
        result
    }
}

fn wait_ready(sandbox: &dyn Sandbox, image: &ImageName, ready: &str) -> Result<(), EngineError> {
    let started = Instant::now();
    let limits = Limits { wall: READY_RUN, ..Limits::default() };
    let job = Job::Command { argv: vec!["/bin/sh".into(), "-c".into(), ready.into()] };
    loop {
        let opts = ExecOptions { limits: Some(limits.clone()), ..ExecOptions::default() };
        let outcome = sandbox.exec(&job, opts)?;
        if outcome.status == (Status::Exited { code: 0 }) {
            return Ok(());
        }
        let output =
            format!("{}{}", String::from_utf8_lossy(&outcome.stdout), String::from_utf8_lossy(&outcome.stderr));
        let service = sandbox.service()?;
        let failed = service.as_ref().is_some_and(|s| s.state == ServiceState::Failed);
        if failed || started.elapsed() >= READY_TIMEOUT {
            let log = service.as_ref().map(|s| s.log_tail.clone()).unwrap_or_default();
            let tail: String = log.chars().rev().take(4000).collect::<Vec<_>>().into_iter().rev().collect();
            return Err(EngineError::ImageNotReady {
                image: image.to_string(),
                ready: ready.to_owned(),
                waited: started.elapsed(),
                service: service.map(|s| format!("{:?} after {} restarts", s.state, s.restarts).to_lowercase()),
                output: if tail.trim().is_empty() { output } else { format!("{output}\nstart command:\n{tail}") },
            });
        }
        std::thread::sleep(READY_PAUSE);
    }
}
