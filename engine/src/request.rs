//! What [`Engine::execute`](crate::Engine::execute) runs: a job and everything about how, with every default
//! written down here, once.

use std::sync::Arc;

use strata_core::{CancelToken, Capabilities, ExecOptions, Job, Limits, OutputSink, Snapshot, StdinStream};

use crate::TierChoice;

/// One job to run, built up from [`RunRequest::new`]: each method sets one thing and says what it is when left
/// unset.
///
/// ```no_run
/// # use strata_engine::{Engine, EngineConfig, RunRequest, TierChoice};
/// # use strata_core::{Job, Limits, PythonSource};
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let engine = Engine::new(EngineConfig::from_env()?)?;
/// let job = Job::Python { source: PythonSource::Code("print(6 * 7)".into()), args: vec![] };
/// let outcome = engine.execute(RunRequest::new(&job).limits(Limits::default()).stdin(b"input".to_vec()))?;
/// print!("{}", String::from_utf8_lossy(&outcome.stdout));
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct RunRequest<'a> {
    pub(crate) job: &'a Job,
    pub(crate) caps: Option<&'a Capabilities>,
    pub(crate) limits: Option<Limits>,
    pub(crate) tier: TierChoice,
    pub(crate) snapshot: Option<&'a Snapshot>,
    pub(crate) opts: ExecOptions,
}

impl<'a> RunRequest<'a> {
    /// `job`, with nothing granted, the policy's limits, on the tier the router picks, with stdin at its end,
    /// output only in the outcome, and no way to cancel it.
    pub fn new(job: &'a Job) -> RunRequest<'a> {
        RunRequest {
            job,
            caps: None,
            limits: None,
            tier: TierChoice::Auto,
            snapshot: None,
            opts: ExecOptions::default(),
        }
    }

    /// Runs it in a fresh fork of `snapshot` (default: a fresh sandbox). The fork keeps the snapshot's
    /// capabilities, so [`caps`](Self::caps) is refused with it; the tier, when named, must be the snapshot's.
    pub fn in_fork_of(mut self, snapshot: &'a Snapshot) -> RunRequest<'a> {
        self.snapshot = Some(snapshot);
        self
    }

    /// What the job may touch (default: nothing, [`Capabilities::default`]).
    pub fn caps(mut self, caps: &'a Capabilities) -> RunRequest<'a> {
        self.caps = Some(caps);
        self
    }

    /// What it may use (default: the policy's `[limits]`, [`Engine::default_limits`](crate::Engine::default_limits)).
    pub fn limits(mut self, limits: Limits) -> RunRequest<'a> {
        self.limits = Some(limits);
        self
    }

    /// Where it runs (default: [`TierChoice::Auto`], the router's choice, which may escalate a Python job from
    /// wasm to the native tier; an explicit tier never escalates).
    pub fn tier(mut self, tier: TierChoice) -> RunRequest<'a> {
        self.tier = tier;
        self
    }

    /// Bytes the job reads on stdin (default: none, stdin is at its end).
    pub fn stdin(mut self, bytes: Vec<u8>) -> RunRequest<'a> {
        self.opts.stdin = Some(bytes);
        self
    }

    /// stdin as a stream the caller writes while the job runs, read as it arrives (instead of [`stdin`](Self::stdin)).
    pub fn stdin_stream(mut self, stream: StdinStream) -> RunRequest<'a> {
        self.opts.stdin_stream = Some(stream);
        self
    }

    /// Where output goes as it is produced, besides the outcome (default: nowhere; the outcome holds it).
    pub fn on_output(mut self, sink: Arc<dyn OutputSink>) -> RunRequest<'a> {
        self.opts.sink = Some(sink);
        self
    }

    /// A token that cancels the job (default: none; it ends by itself or at a limit).
    pub fn cancel(mut self, token: CancelToken) -> RunRequest<'a> {
        self.opts.cancel = Some(token);
        self
    }

    /// The per-job options as a tier takes them, for callers that already hold them.
    pub fn options(mut self, opts: ExecOptions) -> RunRequest<'a> {
        self.opts = opts;
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_nothing_granted_auto_and_no_stdin() {
        let job = Job::Command { argv: vec!["true".into()] };
        let request = RunRequest::new(&job);
        assert!(request.caps.is_none() && request.limits.is_none());
        assert_eq!(request.tier, TierChoice::Auto);
        assert!(request.opts.stdin.is_none() && request.opts.sink.is_none() && request.opts.cancel.is_none());
        let caps = Capabilities::default();
        let request = RunRequest::new(&job)
            .caps(&caps)
            .tier(TierChoice::Tier(strata_core::TierKind::Process))
            .stdin(b"x".to_vec())
            .cancel(CancelToken::new());
        assert_eq!(request.opts.stdin.as_deref(), Some(&b"x"[..]));
        assert!(request.opts.cancel.is_some() && request.caps.is_some());
    }
}
