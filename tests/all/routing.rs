//! Routing by policy: where `auto` sends each kind of job, the fallback from the microVM to the process tier where
//! this host has no hardware KVM (recorded in `escalations`), and tiers a policy does not allow.

use std::path::Path;

use strata_core::{Capabilities, ExecOptions, Job, Limits, Outcome, PythonSource, Status, TierKind};
use strata_engine::{Engine, EngineConfig, EngineError, Policy, TierChoice, doctor};

fn engine_with(policy: &str) -> Engine {
    let policy = Policy::from_toml(policy, Path::new("test-policy.toml")).expect("policy");
    let home = strata_engine::strata_home().expect("STRATA_HOME or HOME");
    Engine::new(EngineConfig { home: Some(home), policy, ..EngineConfig::default() }).expect("engine")
}

fn run(engine: &Engine, choice: TierChoice, job: &Job) -> Result<Outcome, EngineError> {
    engine.run_on(choice, job, &Capabilities::default(), &Limits::default(), ExecOptions::default())
}

fn echo() -> Job {
    Job::Command { argv: vec!["echo".into(), "routed".into()] }
}

/// Whether the process tier runs here; prints the skip line when it does not.
fn process_tier_runs(engine: &Engine, test: &str) -> bool {
    match engine.process() {
        Ok(_) => true,
        Err(err) => {
            eprintln!("skip {test}: the process tier cannot run on this host: {err}");
            false
        }
    }
}

#[test]
fn auto_sends_native_jobs_to_the_microvm_or_falls_back_to_the_process_tier_saying_why() {
    let engine = engine_with("");
    let kvm = doctor::kvm();
    if kvm.kind == "hardware" {
        let outcome = run(&engine, TierChoice::Auto, &echo()).expect("auto on hardware KVM");
        assert_eq!((outcome.tier, outcome.escalations.len()), (TierKind::Microvm, 0), "{outcome:?}");
        return;
    }
    if !process_tier_runs(&engine, "auto_sends_native_jobs...") {
        return;
    }
    let outcome = run(&engine, TierChoice::Auto, &echo()).expect("auto falls back");
    assert_eq!(outcome.tier, TierKind::Process);
    assert_eq!(outcome.status, Status::Exited { code: 0 });
    assert_eq!(outcome.stdout, b"routed\n");
    let [escalation] = outcome.escalations.as_slice() else { panic!("one escalation: {:?}", outcome.escalations) };
    assert_eq!((escalation.from, escalation.to), (TierKind::Microvm, TierKind::Process));
    assert!(escalation.reason.contains(&kvm.detail), "{}", escalation.reason);

    // Asked for by name, the microVM tier does not fall back: the caller learns why at once.
    let err = run(&engine, TierChoice::Tier(TierKind::Microvm), &echo()).expect_err("explicit vm");
    assert_eq!(err.code(), "tier_unavailable", "{err}");
    // A policy whose native tier is the process tier routes there without an escalation.
    let outcome = run(&engine_with("[tiers]\nnative = \"process\"\n"), TierChoice::Auto, &echo()).expect("process");
    assert_eq!((outcome.tier, outcome.escalations.len()), (TierKind::Process, 0), "{outcome:?}");
    // A policy without fallback fails like the explicit choice.
    let strict = engine_with("[tiers]\nfallback = false\n");
    let err = run(&strict, TierChoice::Auto, &echo()).expect_err("no fallback");
    assert_eq!(err.code(), "tier_unavailable", "{err}");
}

#[test]
fn a_tier_the_policy_does_not_allow_is_refused_whoever_picks_it() {
    let wasm_only = engine_with("[tiers]\nallowed = [\"wasm\"]\n");
    for choice in [TierChoice::Auto, TierChoice::Tier(TierKind::Process), TierChoice::Tier(TierKind::Microvm)] {
        let err = run(&wasm_only, choice, &echo()).expect_err("not allowed");
        assert_eq!(err.code(), "tier_not_allowed", "{choice}: {err}");
    }
    let err = wasm_only
        .start(TierChoice::Tier(TierKind::Process), &Capabilities::default(), &Limits::default())
        .map(|_| ())
        .expect_err("session on a tier not allowed");
    assert_eq!(err.code(), "tier_not_allowed", "{err}");
    // Without wasm, `auto` sends Python to the native tier the policy allows.
    let native_only = engine_with("[tiers]\nallowed = [\"process\"]\n");
    if !process_tier_runs(&native_only, "a_tier_the_policy_does_not_allow...") {
        return;
    }
    let job = Job::Python {
        source: PythonSource::Code("import sys; print(sys.implementation._multiarch)".into()),
        args: vec![],
    };
    let outcome = run(&native_only, TierChoice::Auto, &job).expect("python on process");
    assert_eq!(outcome.tier, TierKind::Process);
    assert_eq!(String::from_utf8_lossy(&outcome.stdout), "x86_64-linux-gnu\n");
}
