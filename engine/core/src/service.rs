//! A sandbox's service: a command its init starts when asked and supervises for the sandbox's whole life — an
//! image's start command (E2B's template start command, Docker's `CMD` run as a service). It is restarted
//! whenever it ends, whatever its exit, unless it was started [`ServiceSpec::burst`] times within
//! [`ServiceSpec::burst_window`] (then it is [`ServiceState::Failed`]), and it is stopped when the sandbox
//! closes: `SIGTERM`, then `SIGKILL` after [`ServiceSpec::stop_grace`]. See [`crate::Sandbox::start_service`].

use std::time::Duration;

use serde::Serialize;

use crate::error::TierError;

/// How a sandbox runs its service.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServiceSpec {
    /// The command, run by `/bin/sh -c` as the sandbox's jobs run (its user, environment, working directory).
    pub command: String,
    /// How long after it ended it is started again (the process tier waits 10 ms at least).
    pub restart_delay: Duration,
    /// The most starts within [`ServiceSpec::burst_window`]: when it ends having started that many times within
    /// the window, it is not started again (at least 1).
    pub burst: u32,
    /// The window over which starts are counted.
    pub burst_window: Duration,
    /// How long it may take to end after `SIGTERM` when it is stopped, before `SIGKILL`.
    pub stop_grace: Duration,
}

impl Default for ServiceSpec {
    /// No command; a second before a restart, at most 5 starts in 60 seconds, 2 seconds to stop.
    fn default() -> ServiceSpec {
        ServiceSpec {
            command: String::new(),
            restart_delay: Duration::from_secs(1),
            burst: 5,
            burst_window: Duration::from_secs(60),
            stop_grace: Duration::from_secs(2),
        }
    }
}

impl ServiceSpec {
    /// `command` with the default policy.
    pub fn new(command: impl Into<String>) -> ServiceSpec {
        ServiceSpec { command: command.into(), ..ServiceSpec::default() }
    }

    /// Refuses a spec no sandbox can run: an empty command (or one holding a NUL byte), a burst of 0.
    pub fn check(&self) -> Result<(), TierError> {
        if self.command.trim().is_empty() || self.command.contains('\0') {
            return Err(TierError::WrongFormat {
                what: "the service's command".into(),
                expected: "a non-empty shell command without NUL bytes",
            });
        }
        if self.burst == 0 {
            return Err(TierError::WrongFormat { what: "the service's burst".into(), expected: "at least 1 start" });
        }
        Ok(())
    }
}

/// What a service is doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ServiceState {
    /// It runs, and was started less than a second ago.
    Starting,
    /// It runs, and has run for a second at least.
    Running,
    /// It ended within a second of its start; it is started again after the restart delay.
    Backoff,
    /// It ended after it had been running; it is started again after the restart delay.
    Exited,
    /// It ended with its burst spent (or could not be started again): it stays down.
    Failed,
    /// It was stopped (the sandbox is closing): it stays down.
    Stopped,
}

/// How a run of a service ended: `{"code": 3}` or `{"signal": 9}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ServiceExit {
    /// It exited with this code.
    Code(i32),
    /// This signal killed it.
    Signal(i32),
}

/// A service as its sandbox describes it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ServiceStatus {
    /// What it is doing.
    pub state: ServiceState,
    /// How many times it was started again after it ended.
    pub restarts: u32,
    /// Its PID in the sandbox while it runs.
    pub pid: Option<u32>,
    /// How its last run ended.
    pub last_exit: Option<ServiceExit>,
    /// The end of its combined stdout and stderr (the process tier keeps 16 KiB), invalid UTF-8 replaced.
    pub log_tail: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_policy_and_the_checks() {
        let spec = ServiceSpec::new("python3 -m http.server");
        assert_eq!(
            (spec.restart_delay, spec.burst, spec.burst_window),
            (Duration::from_secs(1), 5, Duration::from_secs(60))
        );
        assert_eq!(spec.stop_grace, Duration::from_secs(2));
        assert!(spec.check().is_ok());
        assert!(ServiceSpec::new("  ").check().is_err());
        assert!(ServiceSpec::new("a\0b").check().is_err());
        assert!(ServiceSpec { burst: 0, ..spec }.check().is_err());
    }

    #[test]
    fn a_status_serialises_with_snake_case_fields() {
        let status = ServiceStatus {
            state: ServiceState::Backoff,
            restarts: 2,
            pid: None,
            last_exit: Some(ServiceExit::Code(3)),
            log_tail: "boom\n".into(),
        };
        let json = serde_json::to_value(&status).expect("serialises");
        assert_eq!(
            json,
            serde_json::json!({"state": "backoff", "restarts": 2, "pid": null, "last_exit": {"code": 3}, "log_tail": "boom\n"})
        );
    }
}
