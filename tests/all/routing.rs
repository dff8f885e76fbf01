//! Routing by policy and by content: where `auto` sends each kind of job, the fallback from the microVM to the process
//! tier where this host has no hardware KVM (recorded in `escalations`), tiers a policy does not allow, and Python
//! routed by a scan of its imports (the decision and its reason in the outcome's `route`).

use std::path::Path;

use strata_core::{Capabilities, Job, Limits, Net, Outcome, PythonSource, Status, TierKind};
use strata_engine::{Engine, EngineConfig, EngineError, Policy, RunRequest, TierChoice, doctor, scan};

fn engine_with(policy: &str) -> Engine {
    let policy = Policy::from_toml(policy, Path::new("test-policy.toml")).expect("policy");
    let home = strata_engine::strata_home().expect("STRATA_HOME or HOME");
    Engine::new(EngineConfig { home: Some(home), policy, ..EngineConfig::default() }).expect("engine")
}

fn run(engine: &Engine, choice: TierChoice, job: &Job) -> Result<Outcome, EngineError> {
    engine.execute(RunRequest::new(job).limits(Limits::default()).tier(choice))
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

fn python_code(code: &str) -> Job {
    Job::Python { source: PythonSource::Code(code.into()), args: vec![] }
}

/// The decision `auto` makes for a job under the default limits: (tier, reason).
fn decide(engine: &Engine, job: &Job) -> (TierKind, String) {
    let route =
        engine.route_with_limits(TierChoice::Auto, job, &Capabilities::default(), &Limits::default()).expect("routes");
    assert_eq!(route.tier.kind(), route.decision.tier);
    (route.decision.tier, route.decision.reason)
}

#[test]
fn python_goes_to_wasm_unless_its_imports_need_what_wasm_lacks() {
    let engine = engine_with("[tiers]\nnative = \"process\"\n");
    if !process_tier_runs(&engine, "python_goes_to_wasm_unless...") {
        return;
    }
    let modules = engine.wasm_modules().expect("the wasm build's module list");
    // Generated from the artifacts: the bundled packages and builtins are there, what was never bundled is not.
    assert!(["numpy", "pandas", "lxml", "json", "sys", "math"].iter().all(|m| modules.has(m)), "{modules:?}");
    assert!(!modules.has("requests") && !modules.has("torch"));
    let corpus: &[(&str, TierKind, &str)] = &[
        ("import numpy as np\nprint(np.arange(3).sum())\n", TierKind::Process, "imports numpy, whose integer"),
        ("import pandas as pd, json\n", TierKind::Process, "imports pandas, whose integer results on wasm32"),
        ("import json, yaml\n", TierKind::Wasm, "wasm build has (json, yaml)"),
        ("import lxml.etree\n", TierKind::Wasm, "(lxml)"),
        ("print('no imports')\n", TierKind::Wasm, "imports nothing"),
        ("import subprocess\nsubprocess.run(['ls'])\n", TierKind::Process, "imports subprocess (needs processes)"),
        ("from multiprocessing import Pool\n", TierKind::Process, "multiprocessing.Pool (needs processes)"),
        ("import requests\n", TierKind::Process, "imports requests, absent from the wasm build"),
        ("import importlib\nimportlib.import_module('ctypes')\n", TierKind::Process, "imports ctypes"),
        ("__import__('socket')\n", TierKind::Process, "imports socket (needs sockets)"),
        ("def f():\n    import subprocess\n", TierKind::Process, "imports subprocess"),
        ("import threading\nthreading.Thread(target=print).start()\n", TierKind::Process, "uses threading.Thread"),
        ("import threading\nlock = threading.Lock()\n", TierKind::Wasm, "(threading)"),
        ("try:\n    import requests\nexcept ImportError:\n    requests = None\n", TierKind::Wasm, "nothing"),
    ];
    for (code, tier, reason) in corpus {
        let (got, why) = decide(&engine, &python_code(code));
        assert_eq!(got, *tier, "{code}: {why}");
        assert!(why.contains(reason), "{code}: {why:?} lacks {reason:?}");
    }
    // A native decision names the tier.
    let (_, why) = decide(&engine, &python_code("import subprocess\n"));
    assert_eq!(why, "python: imports subprocess (needs processes) → the policy's native tier (process)");
    // `-m MODULE` is judged by the module, a script file by its text.
    let (tier, why) = decide(&engine, &Job::Python { source: PythonSource::Module("json.tool".into()), args: vec![] });
    assert_eq!(tier, TierKind::Wasm, "{why}");
    let dir = tempfile::tempdir().expect("tempdir");
    let script = dir.path().join("job.py");
    std::fs::write(&script, "import os\nos.system('true')\n").expect("write");
    let (tier, why) = decide(&engine, &Job::Python { source: PythonSource::File(script), args: vec![] });
    assert_eq!(
        (tier, why.as_str()),
        (TierKind::Process, "python: uses os.system (needs processes) → the policy's native tier (process)")
    );
}

#[test]
fn a_script_that_needs_processes_runs_natively_and_says_why() {
    let engine = engine_with("[tiers]\nnative = \"process\"\n");
    if !process_tier_runs(&engine, "a_script_that_needs_processes...") {
        return;
    }
    let job = python_code(
        "import subprocess\nprint(subprocess.run(['echo', 'forked'], capture_output=True, text=True).stdout, end='')",
    );
    let outcome = run(&engine, TierChoice::Auto, &job).expect("runs");
    assert_eq!((outcome.tier, &outcome.status), (TierKind::Process, &Status::Exited { code: 0 }), "{outcome:?}");
    assert_eq!(outcome.stdout, b"forked\n");
    let route = outcome.route.expect("route");
    assert_eq!(route.tier, TierKind::Process);
    assert!(route.reason.contains("subprocess (needs processes)"), "{}", route.reason);
}

#[test]
fn a_syntax_error_stays_on_wasm_which_reports_it() {
    let engine = engine_with("");
    let outcome = run(&engine, TierChoice::Auto, &python_code("import subprocess\nprint 'python 2'\n")).expect("runs");
    assert_eq!((outcome.tier, outcome.exit_code()), (TierKind::Wasm, 1), "{outcome:?}");
    assert!(String::from_utf8_lossy(&outcome.stderr).contains("SyntaxError"), "{outcome:?}");
    let route = outcome.route.expect("route");
    assert!(route.reason.starts_with("python: does not parse as Python 3 (line 2"), "{}", route.reason);
}

#[test]
fn long_python_jobs_go_native_above_the_policy_threshold() {
    let engine = engine_with("[tiers]\nnative = \"process\"\npython_native_above = \"10s\"\n");
    if !process_tier_runs(&engine, "long_python_jobs...") {
        return;
    }
    let job = python_code("import json\n");
    let mut limits = Limits { wall: std::time::Duration::from_secs(5), ..Limits::default() };
    limits.cpu = std::time::Duration::from_secs(5);
    let route = engine.route_with_limits(TierChoice::Auto, &job, &Capabilities::default(), &limits).expect("short");
    assert_eq!(route.decision.tier, TierKind::Wasm, "{:?}", route.decision);
    limits.cpu = std::time::Duration::from_secs(20);
    let route = engine.route_with_limits(TierChoice::Auto, &job, &Capabilities::default(), &limits).expect("long");
    assert_eq!(route.decision.tier, TierKind::Process, "{:?}", route.decision);
    assert!(route.decision.reason.contains("cpu limit 20s exceeds python_native_above (10s)"), "{:?}", route.decision);
    let off = engine_with("[tiers]\nnative = \"process\"\npython_native_above = \"off\"\n");
    let route = off.route_with_limits(TierChoice::Auto, &job, &Capabilities::default(), &limits).expect("off");
    assert_eq!(route.decision.tier, TierKind::Wasm, "{:?}", route.decision);
}

#[test]
fn python_with_network_goes_native_since_wasm_python_has_no_sockets() {
    let engine = engine_with("[tiers]\nnative = \"process\"\n");
    if !process_tier_runs(&engine, "python_with_network_goes_native...") {
        return;
    }
    // json alone would stay on wasm; the allowlist is what sends it native.
    let job = python_code("import json\n");
    let caps =
        Capabilities { net: Net::allow(["example.org:443"]).expect("valid allowlist"), ..Capabilities::default() };
    let route = engine.route_with_limits(TierChoice::Auto, &job, &caps, &Limits::default()).expect("routes");
    assert_eq!(route.decision.tier, TierKind::Process, "{:?}", route.decision);
    assert_eq!(
        route.decision.reason,
        "python: network egress (--allow-net example.org:443) needs sockets, which CPython in wasm does not have → \
         the policy's native tier (process)"
    );
    assert_eq!(decide(&engine, &job).0, TierKind::Wasm);
    // A wasm-only policy keeps it on wasm, which refuses the network with a typed error.
    let wasm_only = engine_with("[tiers]\nallowed = [\"wasm\"]\n");
    let err = wasm_only
        .execute(RunRequest::new(&job).caps(&caps).limits(Limits::default()))
        .expect_err("no network on wasm python");
    assert_eq!(err.code(), "unsupported", "{err}");
}

#[test]
fn a_wasm_only_policy_keeps_python_on_wasm_whatever_it_imports() {
    let engine = engine_with("[tiers]\nallowed = [\"wasm\"]\n");
    let outcome = run(&engine, TierChoice::Auto, &python_code("import subprocess\nprint('still wasm')")).expect("runs");
    assert_eq!((outcome.tier, outcome.stdout.as_slice()), (TierKind::Wasm, &b"still wasm\n"[..]), "{outcome:?}");
    let route = outcome.route.expect("route");
    assert_eq!(route.reason, "python: imports subprocess (needs processes), but the policy allows only wasm");
    // An explicit tier is the reason itself.
    let outcome = run(&engine, TierChoice::Tier(TierKind::Wasm), &python_code("pass")).expect("runs");
    assert_eq!(outcome.route.expect("route").reason, "explicit --tier wasm");
}

/// Integer results that wrap on wasm32 (numpy's default integer is `int32` there), each with the value native
/// Python computes: `(expression, native value)`.
const OVERFLOWS: &[(&str, &str)] = &[
    ("np.arange(10**6).sum()", "499999500000"),
    ("(np.array([100000]) ** 2)[0]", "10000000000"),
    ("np.prod(np.arange(1, 21))", "2432902008176640000"),
    ("np.arange(100000).cumsum()[-1]", "4999950000"),
    ("(np.array([2**31 - 1]) + 1)[0]", "2147483648"),
    ("np.array([70000]).dot(np.array([70000]))", "4900000000"),
    ("np.dtype(int).itemsize * 8", "64"),
    ("pd.Series(range(100000)).sum()", "4999950000"),
    ("(pd.DataFrame({'a': [100000] * 3})['a'] ** 2).sum()", "30000000000"),
    ("pd.Series(np.arange(100000)).cumsum().iloc[-1]", "4999950000"),
];

fn overflow_script() -> String {
    let mut script = String::from("import numpy as np, pandas as pd\n");
    for (expression, _) in OVERFLOWS {
        script.push_str(&format!("print(int({expression}))\n"));
    }
    script
}

#[test]
fn numpy_and_pandas_give_native_answers_on_the_default_route() {
    let engine = engine_with("[tiers]\nnative = \"process\"\n");
    if !process_tier_runs(&engine, "numpy_and_pandas_give_native_answers_on_the_default_route") {
        return;
    }
    let job = python_code(&overflow_script());
    let outcome = run(&engine, TierChoice::Auto, &job).expect("runs");
    let stdout = String::from_utf8_lossy(&outcome.stdout);
    assert_eq!(outcome.status, Status::Exited { code: 0 }, "{stdout}{}", String::from_utf8_lossy(&outcome.stderr));
    assert_eq!(outcome.tier, TierKind::Process, "{:?}", outcome.route);
    let route = outcome.route.as_ref().expect("route");
    assert!(route.reason.starts_with("python: imports numpy, pandas, whose integer results"), "{}", route.reason);
    let got: Vec<&str> = stdout.lines().collect();
    let native: Vec<&str> = OVERFLOWS.iter().map(|(_, value)| *value).collect();
    assert_eq!(got, native, "{:#?}", OVERFLOWS);
    assert_eq!(outcome.platform, None, "native numbers are the host's");
    // The same job where the user asked for wasm: wasm32 numbers (the classic case wraps), as asked, and said.
    let accepted = engine_with("[tiers]\nnative = \"process\"\npython_wasm_numpy = true\n");
    for (engine, choice) in [(&engine, TierChoice::Tier(TierKind::Wasm)), (&accepted, TierChoice::Auto)] {
        let outcome = run(engine, choice, &job).expect("runs");
        assert_eq!(outcome.tier, TierKind::Wasm, "{choice}: {:?}", outcome.route);
        let stdout = String::from_utf8_lossy(&outcome.stdout);
        assert_eq!(stdout.lines().next(), Some("1783293664"), "{choice}: {stdout}");
        assert_eq!(outcome.platform, Some(strata_core::Platform::Wasm32), "{choice}");
        let json = serde_json::to_value(&outcome).expect("json");
        assert_eq!(json["platform"], "wasm32", "{choice}");
    }
    // Python without numpy on wasm computes as native Python does: no platform is stated.
    let plain = run(&engine, TierChoice::Auto, &python_code("print(2**64)")).expect("runs");
    assert_eq!((plain.tier, plain.platform), (TierKind::Wasm, None));
    assert!(serde_json::to_value(&plain).expect("json").get("platform").is_none());
}

/// A session is one interpreter on one tier for its life: a wasm session the engine chose refuses a cell that
/// needs the native tier (naming why and the tier), and keeps its state; one the user chose runs numpy on wasm32,
/// and says so.
#[test]
fn a_wasm_session_never_splits_and_refuses_what_it_cannot_run_as_native_code_would() {
    let engine = engine_with("[tiers]\nnative = \"process\"\n");
    let session = engine.start(TierChoice::Auto, &Default::default(), engine.default_limits()).expect("session");
    let exec = |code: &str| session.exec(&python_code(code), Default::default());
    assert_eq!(exec("x = 41\nprint(x + 1)").expect("runs").stdout, b"42\n");
    for (code, why) in [
        ("import numpy as np\nprint(np.arange(10**6).sum())", "numpy"),
        ("import subprocess\nsubprocess.run(['true'])", "subprocess"),
    ] {
        let err = exec(code).expect_err("refused");
        assert_eq!(err.code(), "session_tier", "{err}");
        let text = err.to_string();
        assert!(text.contains("wasm tier") && text.contains("process tier") && text.contains(why), "{text}");
    }
    // The refused cells did not run anywhere: the session's state is as it was.
    assert_eq!(exec("print(x)").expect("runs").stdout, b"41\n");
    session.close().expect("close");
    let chosen =
        engine.start(TierChoice::Tier(TierKind::Wasm), &Default::default(), engine.default_limits()).expect("session");
    let outcome = chosen.exec(&python_code("import numpy as np\nprint(np.arange(10**6).sum())"), Default::default());
    let outcome = outcome.expect("runs");
    assert_eq!(outcome.stdout, b"1783293664\n");
    assert_eq!(outcome.platform, Some(strata_core::Platform::Wasm32));
    chosen.close().expect("close");
}

#[test]
fn numpy_is_refused_rather_than_run_on_wasm_where_no_native_tier_may_run_it() {
    let engine = engine_with("[tiers]\nallowed = [\"wasm\"]\n");
    let err = run(&engine, TierChoice::Auto, &python_code("import numpy\nprint(numpy.arange(10**6).sum())\n"))
        .expect_err("refused");
    assert_eq!(err.code(), "wasm32_numerics", "{err}");
    assert!(err.to_string().contains("--tier wasm"), "{err}");
    // Asking for it runs it there; so does a wasm-only policy that accepts wasm32 numerics.
    let job = python_code("import numpy\nprint(numpy.arange(3).sum())\n");
    assert_eq!(run(&engine, TierChoice::Tier(TierKind::Wasm), &job).expect("runs").stdout, b"3\n");
    let accepting = engine_with("[tiers]\nallowed = [\"wasm\"]\npython_wasm_numpy = true\n");
    assert_eq!(run(&accepting, TierChoice::Auto, &job).expect("runs").stdout, b"3\n");
}

/// The router's numpy lists match the installed wasm build: every third-party module whose import loads numpy
/// (each in a fresh interpreter) is in [`scan::WASM32_NUMERICS`] or [`scan::NUMPY_ONLY_RECOGNISED`], and every
/// module listed there loads it. A runtime that bundles a new numpy-based package fails this test until the
/// package is listed.
#[test]
fn the_numpy_lists_match_what_loads_numpy_on_wasm() {
    let engine = engine_with("");
    let wasm = TierChoice::Tier(TierKind::Wasm);
    let stdlib = run(&engine, wasm, &python_code("import sys\nprint('\\n'.join(sys.stdlib_module_names))"))
        .expect("stdlib names");
    let stdlib = String::from_utf8_lossy(&stdlib.stdout).into_owned();
    let stdlib: std::collections::HashSet<&str> = stdlib.lines().collect();
    let modules = engine.wasm_modules().expect("the wasm build's module list");
    let third_party: Vec<&str> =
        modules.names().filter(|name| !stdlib.contains(name) && !name.starts_with('_')).collect();
    assert!(third_party.len() > 20 && third_party.contains(&"numpy"), "{third_party:?}");
    let mut loads = Vec::new();
    for name in &third_party {
        // statsmodels' package imports lazily; its API is what jobs import.
        let import = if *name == "statsmodels" { "statsmodels.api" } else { name };
        let probe = format!(
            "import sys\ntry:\n    import {import}\nexcept BaseException:\n    pass\nprint('numpy' in sys.modules)\n"
        );
        let outcome = run(&engine, wasm, &python_code(&probe)).expect("probe");
        match outcome.stdout.as_slice() {
            b"True\n" => loads.push(*name),
            b"False\n" => {}
            other => {
                panic!("{name}: {:?} {:?}", String::from_utf8_lossy(other), String::from_utf8_lossy(&outcome.stderr))
            }
        }
    }
    let listed = |name: &&str| scan::WASM32_NUMERICS.contains(name) || scan::NUMPY_ONLY_RECOGNISED.contains(name);
    let unlisted: Vec<&&str> = loads.iter().filter(|name| !listed(name)).collect();
    assert!(unlisted.is_empty(), "modules that load numpy on wasm but are in neither list: {unlisted:?}");
    let stale: Vec<&&str> = scan::WASM32_NUMERICS
        .iter()
        .chain(scan::NUMPY_ONLY_RECOGNISED)
        .filter(|name| third_party.contains(name) && !loads.contains(name))
        .collect();
    assert!(stale.is_empty(), "listed, but their import does not load numpy: {stale:?}");
}

/// Every entry of the router's "needs native" list fails on the wasm tier, shown by its probe: an entry that
/// starts working there (a newer runtime, WASI sockets) fails this test and should leave the list.
#[test]
fn every_needs_native_entry_fails_on_wasm() {
    let entries: Vec<(&str, &str)> = scan::NEEDS_NATIVE.iter().map(|e| (e.name, e.probe)).collect();
    let script = format!(
        "import warnings, json\nwarnings.simplefilter('ignore')\nentries = json.loads({entries:?})\n{}",
        r#"
def attempt(name, probe):
    parts = name.split('.')
    ns = {}
    for i in range(len(parts), 0, -1):
        try:
            exec('import ' + '.'.join(parts[:i]), ns)
            break
        except ImportError:
            if i == 1:
                raise
    exec(probe, ns)
for name, probe in entries:
    try:
        attempt(name, probe)
        print('works', name)
    except SyntaxError as e:
        print('bad probe', name, e)
    except BaseException as e:
        print('fails', name, type(e).__name__)
"#,
        entries = serde_json::to_string(&entries).expect("json"),
    );
    let engine = engine_with("");
    let outcome = run(&engine, TierChoice::Tier(TierKind::Wasm), &python_code(&script)).expect("runs");
    let stdout = String::from_utf8_lossy(&outcome.stdout);
    assert_eq!(outcome.status, Status::Exited { code: 0 }, "{stdout}{}", String::from_utf8_lossy(&outcome.stderr));
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), entries.len(), "{stdout}");
    let working: Vec<&&str> = lines.iter().filter(|line| !line.starts_with("fails ")).collect();
    assert!(working.is_empty(), "entries that do not fail on wasm: {working:?}");
}
