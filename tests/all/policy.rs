//! Policy files: `policies/strict.toml` keeps every job on wasm with tight limits, `policies/default.toml` still
//! loads, and the `[escalation]`, `[network]` and `[grants.NAME]` tables parse, are checked and reach the job.

use std::path::{Path, PathBuf};

use strata_core::{Capabilities, Job, Net, PythonSource, Status, TierKind};
use strata_engine::policy::EscalationReason;
use strata_engine::{Engine, EngineConfig, Policy, RunRequest, TierChoice};
use strata_test_programs as programs;

use crate::util;

fn policy_file(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../policies").join(name)
}

fn engine_with(policy: Policy) -> Engine {
    let home = strata_engine::strata_home().expect("STRATA_HOME or HOME");
    Engine::new(EngineConfig { home: Some(home), policy, ..EngineConfig::default() }).expect("engine")
}

#[test]
fn the_strict_policy_runs_python_on_wasm_within_its_limits_and_refuses_native_tiers() {
    let policy = Policy::from_file(&policy_file("strict.toml")).expect("strict.toml");
    assert_eq!(policy.tiers.allowed, [TierKind::Wasm]);
    assert!(!policy.escalation.allowed);
    assert_eq!(policy.network.net_with(&strata_core::Allowlist::default()), Net::Deny);
    let limits = policy.limits.clone();
    let engine = engine_with(policy);

    // Even a script whose imports would send it native stays on wasm, and runs within the strict limits.
    let job =
        Job::Python { source: PythonSource::Code("import subprocess\nprint(sum(range(10)))".into()), args: Vec::new() };
    let route = engine.route(TierChoice::Auto, &job).expect("route");
    assert_eq!(route.decision.tier, TierKind::Wasm, "{}", route.decision.reason);
    assert!(route.decision.reason.contains("allows only wasm"), "{}", route.decision.reason);
    let outcome = engine.execute(RunRequest::new(&job).limits(limits.clone())).expect("python on wasm");
    assert_eq!(outcome.status, Status::Exited { code: 0 }, "{}", util::stderr(&outcome));
    assert_eq!((outcome.tier, util::stdout(&outcome).as_str()), (TierKind::Wasm, "45\n"));
    assert!(outcome.usage.fuel.is_some_and(|fuel| fuel > 0), "fuel is metered: {:?}", outcome.usage);

    for tier in [TierKind::Process, TierKind::Microvm] {
        let echo = Job::Command { argv: vec!["echo".into(), "no".into()] };
        let err = engine
            .execute(RunRequest::new(&echo).limits(limits.clone()).tier(TierChoice::Tier(tier)))
            .expect_err("a native tier");
        assert_eq!(err.code(), "tier_not_allowed", "{err}");
        let err = engine.route(TierChoice::Auto, &echo).expect_err("a command has nowhere to go");
        assert_eq!(err.code(), "tier_not_allowed", "{err}");
    }
}

#[test]
fn the_default_policy_file_loads_with_escalation_allowed_and_no_network() {
    let policy = Policy::from_file(&policy_file("default.toml")).expect("default.toml");
    assert_eq!(policy, Policy::default());
    assert!(policy.escalation.permits(EscalationReason::MissingModule));
    assert!(policy.escalation.permits(EscalationReason::UnsupportedCall));
    assert_eq!(policy.network.net_with(&strata_core::Allowlist::default()), Net::Deny);
    assert!(policy.grant_sets.is_empty());
}

#[test]
fn a_named_grant_set_is_granted_to_the_job() {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::create_dir(dir.path().join("inputs")).expect("mkdir");
    std::fs::write(dir.path().join("inputs/data.txt"), "from the grant set").expect("write");
    let path = dir.path().join("policy.toml");
    std::fs::write(&path, "[grants.inputs]\ndirs = [\"inputs:/inputs\"]\n").expect("write");
    let policy = Policy::from_file(&path).expect("policy");
    let grants = policy.grants_with(&["inputs".into()], Vec::new()).expect("the set");
    assert_eq!(grants[0].host, dir.path().join("inputs"), "relative to the policy file");
    let caps = Capabilities { grants, ..Capabilities::default() };
    let outcome = util::run(programs::FS, &["read", "/inputs/data.txt"], &caps, &util::limits(""));
    assert_eq!(outcome.status, Status::Exited { code: 0 }, "{}", util::stderr(&outcome));
    assert_eq!(util::stdout(&outcome), "from the grant set");
    let err = policy.grants_with(&["outputs".into()], Vec::new()).expect_err("no such set");
    assert_eq!(err.available, ["inputs"]);
}

#[test]
fn every_new_key_malformed_names_file_line_and_key() {
    let cases = [
        ("[escalation]\nallowed = 1\n", 2, "allowed"),
        ("[escalation]\non = [\"oom\"]\n", 2, "on"),
        ("[escalation]\nallowed = true\nretries = 2\n", 3, "retries"),
        ("[tiers]\nallowed = [\"wasm\"]\n[escalation]\nallowed = true\n", 4, "allowed"),
        ("[network]\nallow = [\"example.com:http\"]\n", 2, "allow"),
        ("[network]\nallow = [\"fe80::1\"]\n", 2, "allow"),
        ("[network]\nallow = [\"*\"]\n", 2, "allow"),
        ("[network]\nallow = []\ndeny = []\n", 3, "deny"),
        ("[grants.data]\ndirs = [\"relative\"]\n", 2, "dirs"),
        ("[grants.data]\ndirs = [\"/a:/x/../y\"]\n", 2, "dirs"),
        ("[grants.data]\ndirs = []\nmode = \"ro\"\n", 3, "mode"),
        ("[grants.data]\n\n", 1, "dirs"),
    ];
    for (text, line, key) in cases {
        let err = Policy::from_toml(text, Path::new("/etc/strata/mine.toml")).expect_err(text).to_string();
        assert!(err.contains("/etc/strata/mine.toml"), "{text}: {err}");
        assert!(err.contains(&format!("line {line}")), "{text}: {err}");
        assert!(err.contains(key), "{text}: {err}");
    }
}

#[test]
fn network_specs_of_every_form_are_accepted() {
    let text = "[network]\nallow = [\"pypi.org:443\", \"*.example.com\", \"10.0.0.1:8080\", \"[2001:db8::1]:443\", \
                \"[::1]\", \"localhost\"]\n";
    let policy = Policy::from_toml(text, Path::new("net.toml")).expect("valid");
    assert_eq!(policy.network.allowlist().rules().len(), 6);
    let extra = strata_core::Allowlist::parse(["extra.org"]).expect("valid");
    let Net::Allow(hosts) = policy.network.net_with(&extra) else { panic!("allowed") };
    assert_eq!(hosts.specs().last().map(String::as_str), Some("extra.org"), "--allow-net adds to the policy");
    assert_eq!(hosts.rules().len(), 7);
}
