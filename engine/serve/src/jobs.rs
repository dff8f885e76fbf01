//! A sandbox's recent jobs, for `GET /v1/sandboxes/{id}/jobs` (the console's job list and egress log): what ran,
//! how it ended, the ends of its output and the connections it made. Bounded: the last [`MAX_JOBS_KEPT`] jobs,
//! [`MAX_TAIL`] bytes of each stream, [`MAX_EGRESS_KEPT`] egress entries each.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::SystemTime;

use serde::Serialize;
use strata_core::{Job, Outcome, PythonSource};
use utoipa::ToSchema;

use strata_core::sync::lock;

/// Jobs kept per sandbox.
pub const MAX_JOBS_KEPT: usize = 32;

/// Bytes kept of the end of each output stream.
pub const MAX_TAIL: usize = 2048;

/// Egress entries kept per job.
pub const MAX_EGRESS_KEPT: usize = 32;

/// The most characters of a job's description.
const MAX_DESCRIPTION: usize = 200;

/// One job as the sandbox's log keeps it.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct JobRecord {
    /// Its number in the sandbox, from 1.
    pub number: u64,
    /// What ran: `python: CODE…`, `command: ARGV…`, `wasm: …`.
    pub description: String,
    /// Started, in seconds since the Unix epoch.
    pub started_at: f64,
    /// Ended, in seconds since the Unix epoch.
    pub ended_at: f64,
    /// How it ended: the outcome's `status`, or `{"kind":"error","message":…}` when it could not run.
    #[schema(value_type = Object)]
    pub status: serde_json::Value,
    /// The last bytes of its stdout (UTF-8, lossy).
    pub stdout_tail: String,
    /// The last bytes of its stderr (UTF-8, lossy).
    pub stderr_tail: String,
    /// The connections it made or tried through the egress proxy (the outcome's `egress`, at most 32).
    #[schema(value_type = Vec<Object>)]
    pub egress: Vec<serde_json::Value>,
}

/// A sandbox's recent jobs.
#[derive(Debug, Default)]
pub struct JobLog(Mutex<(u64, VecDeque<JobRecord>)>);

fn tail(bytes: &[u8]) -> String {
    let start = bytes.len().saturating_sub(MAX_TAIL);
    String::from_utf8_lossy(&bytes[start..]).into_owned()
}

fn seconds(at: SystemTime) -> f64 {
    at.duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default().as_secs_f64()
}

/// A job in one line, cut at 200 characters.
pub fn describe(job: &Job) -> String {
    let text = match job {
        Job::Python { source: PythonSource::Code(code), .. } => format!("python: {code}"),
        Job::Python { source: PythonSource::Module(module), .. } => format!("python -m {module}"),
        Job::Python { source: PythonSource::File(file), .. } => format!("python {}", file.display()),
        Job::Command { argv } => format!("command: {}", argv.join(" ")),
        Job::Native { program, args } => format!("native: {} {}", program.display(), args.join(" ")),
        Job::Wasm { args, .. } => format!("wasm: {}", args.join(" ")),
    };
    let line: String = text.split_whitespace().collect::<Vec<_>>().join(" ");
    match line.char_indices().nth(MAX_DESCRIPTION) {
        Some((at, _)) => format!("{}…", &line[..at]),
        None => line,
    }
}

impl JobLog {
    /// Records a job that started at `started` and ended now with `result`.
    pub fn record<E: std::fmt::Display>(&self, job: &Job, started: SystemTime, result: &Result<Outcome, E>) {
        let (status, stdout_tail, stderr_tail, egress) = match result {
            Ok(outcome) => (
                serde_json::to_value(&outcome.status).unwrap_or_default(),
                tail(&outcome.stdout),
                tail(&outcome.stderr),
                outcome
                    .egress
                    .iter()
                    .take(MAX_EGRESS_KEPT)
                    .filter_map(|entry| serde_json::to_value(entry).ok())
                    .collect(),
            ),
            Err(err) => (
                serde_json::json!({"kind": "error", "message": err.to_string()}),
                String::new(),
                String::new(),
                Vec::new(),
            ),
        };
        let mut log = lock(&self.0);
        log.0 += 1;
        let record = JobRecord {
            number: log.0,
            description: describe(job),
            started_at: seconds(started),
            ended_at: seconds(SystemTime::now()),
            status,
            stdout_tail,
            stderr_tail,
            egress,
        };
        log.1.push_back(record);
        while log.1.len() > MAX_JOBS_KEPT {
            log.1.pop_front();
        }
    }

    /// The jobs kept, oldest first.
    pub fn list(&self) -> Vec<JobRecord> {
        lock(&self.0).1.iter().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_log_keeps_the_last_jobs_and_the_ends_of_their_output() {
        let log = JobLog::default();
        let job = Job::Command { argv: vec!["echo".into(), "x".repeat(300)] };
        for _ in 0..MAX_JOBS_KEPT + 5 {
            log.record::<String>(&job, SystemTime::now(), &Err("no room".into()));
        }
        let kept = log.list();
        assert_eq!(kept.len(), MAX_JOBS_KEPT);
        assert_eq!(kept[0].number, 6);
        assert_eq!(kept[0].description.chars().count(), MAX_DESCRIPTION + 1, "cut, with an ellipsis");
        assert_eq!(kept[0].status["kind"], "error");
        assert_eq!(tail(&vec![b'a'; MAX_TAIL * 2]).len(), MAX_TAIL);
    }
}
