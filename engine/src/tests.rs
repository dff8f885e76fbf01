//! The engine facade over tiers that are not the built-in ones ([`Engine::with_tier`]): routing, fallbacks,
//! escalation and sandboxes decided by the engine alone, on any host (no root, no KVM, no guest image).

use std::sync::{Arc, Mutex};

use strata_core::{
    Capabilities, ExecOptions, Job, Limits, Outcome, PythonSource, Sandbox, Status, Tier, TierError, TierKind,
};

use crate::{Engine, EngineConfig, EngineError, RunRequest, TierChoice};

/// A tier that records the jobs it is given and answers each with an exit status and stderr of its script.
struct FakeTier {
    kind: TierKind,
    answer: (i32, &'static str),
    ran: Mutex<Vec<Job>>,
}

impl FakeTier {
    fn new(kind: TierKind, code: i32, stderr: &'static str) -> Arc<FakeTier> {
        Arc::new(FakeTier { kind, answer: (code, stderr), ran: Mutex::new(Vec::new()) })
    }

    fn ran(&self) -> usize {
        self.ran.lock().expect("lock").len()
    }
}

impl Tier for FakeTier {
    fn kind(&self) -> TierKind {
        self.kind
    }

    fn run(&self, job: &Job, _: &Capabilities, _: &Limits, _: ExecOptions) -> Result<Outcome, TierError> {
        self.ran.lock().expect("lock").push(job.clone());
        Ok(Outcome {
            stderr: self.answer.1.as_bytes().to_vec(),
            ..Outcome::new(self.kind, Status::Exited { code: self.answer.0 })
        })
    }

    fn start(&self, _: &Capabilities, _: &Limits) -> Result<Box<dyn Sandbox>, TierError> {
        Err(TierError::Unsupported { tier: self.kind, what: "sandboxes of a fake tier".into() })
    }
}

/// An engine without a home whose tiers are `tiers`.
fn engine(tiers: &[&Arc<FakeTier>]) -> Engine {
    let mut engine = Engine::new(EngineConfig::default()).expect("an engine");
    for tier in tiers {
        engine = engine.with_tier((*tier).clone());
    }
    engine
}

fn python(code: &str) -> Job {
    Job::Python { source: PythonSource::Code(code.into()), args: Vec::new() }
}

const FORK_FAILED: &str = "Traceback (most recent call last):\n  File \"<string>\", line 1, in <module>\n\
                           AttributeError: module 'os' has no attribute 'fork'\n";

#[test]
fn jobs_go_to_the_tiers_put_in_place_by_kind() {
    let wasm = FakeTier::new(TierKind::Wasm, 0, "");
    let process = FakeTier::new(TierKind::Process, 0, "");
    let microvm = FakeTier::new(TierKind::Microvm, 0, "");
    let engine = engine(&[&wasm, &process, &microvm]);
    let command = Job::Command { argv: vec!["true".into()] };
    let outcome = engine.execute(RunRequest::new(&command)).expect("runs");
    // The default policy's native tier is the microVM, which is here now: no fallback.
    assert_eq!((outcome.tier, outcome.escalations.len()), (TierKind::Microvm, 0), "{outcome:?}");
    let outcome = engine.execute(RunRequest::new(&python("print(1)"))).expect("runs");
    assert_eq!(outcome.tier, TierKind::Wasm);
    let outcome = engine.execute(RunRequest::new(&command).tier(TierChoice::Tier(TierKind::Process))).expect("runs");
    assert_eq!(outcome.tier, TierKind::Process);
    assert_eq!((wasm.ran(), process.ran(), microvm.ran()), (1, 1, 1));
}

#[test]
fn a_native_tier_that_cannot_start_falls_back_and_says_so() {
    // No microVM in place and no home: the built-in one cannot start, whatever the host.
    let process = FakeTier::new(TierKind::Process, 0, "");
    let engine = engine(&[&process]);
    let outcome = engine.execute(RunRequest::new(&Job::Command { argv: vec!["true".into()] })).expect("runs");
    assert_eq!(outcome.tier, TierKind::Process);
    let fallback = outcome.escalations.first().expect("the fallback is recorded");
    assert_eq!((fallback.from, fallback.to), (TierKind::Microvm, TierKind::Process), "{fallback:?}");
    let asked = engine.execute(
        RunRequest::new(&Job::Command { argv: vec!["true".into()] }).tier(TierChoice::Tier(TierKind::Microvm)),
    );
    assert!(matches!(asked, Err(EngineError::TierUnavailable { tier: TierKind::Microvm, .. })), "{asked:?}");
}

#[test]
fn a_python_job_that_fails_on_wasm_for_an_unsupported_call_reruns_natively() {
    let wasm = FakeTier::new(TierKind::Wasm, 1, FORK_FAILED);
    let process = FakeTier::new(TierKind::Process, 0, "");
    let engine = engine(&[&wasm, &process]);
    // What the import scan cannot see (it would send `os.fork()` native at once).
    let hidden = python("getattr(__import__('o' + 's'), 'fork')()");
    let outcome = engine.execute(RunRequest::new(&hidden)).expect("runs");
    assert_eq!((outcome.tier, &outcome.status), (TierKind::Process, &Status::Exited { code: 0 }), "{outcome:?}");
    let rerun = outcome.escalations.first().expect("the escalation is recorded");
    assert_eq!((rerun.from, rerun.to), (TierKind::Wasm, TierKind::Process));
    assert!(rerun.reason.contains("os.fork"), "{}", rerun.reason);
    assert_eq!(outcome.route.expect("a route").tier, TierKind::Wasm, "the route stays the router's decision");
    assert_eq!((wasm.ran(), process.ran()), (1, 1));

    // An explicit tier never escalates: the wasm failure is the outcome.
    let outcome = engine.execute(RunRequest::new(&hidden).tier(TierChoice::Tier(TierKind::Wasm))).expect("runs");
    assert_eq!((outcome.tier, outcome.escalations.len()), (TierKind::Wasm, 0));
    assert_eq!(process.ran(), 1);
}

#[test]
fn a_tier_put_in_place_is_what_sandboxes_start_on() {
    let wasm = FakeTier::new(TierKind::Wasm, 0, "");
    let engine = engine(&[&wasm]);
    let refused = engine.start(TierChoice::Auto, &Capabilities::default(), &Limits::default()).err();
    assert!(matches!(refused, Some(EngineError::Tier(TierError::Unsupported { tier: TierKind::Wasm, .. }))));
    assert!(Arc::ptr_eq(&engine.tier(TierKind::Wasm).expect("the fake"), &(wasm.clone() as Arc<dyn Tier>)));
}
