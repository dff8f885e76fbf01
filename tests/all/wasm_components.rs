//! WASI 0.2 command components (`wasm32-wasip2`) on the wasm tier: output, exit status, capabilities and limits
//! as for preview1 commands, the compiled-component cache, typed errors for what is not a command, and network
//! egress through `wasi:sockets` checked against the allowlist and logged in the outcome, each connection's bytes
//! counted.

use std::io::{Read, Write};
use std::net::TcpListener;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use strata_core::{
    Capabilities, EgressEntry, EnvVar, ExecOptions, Grant, GrantMode, Job, LimitKind, Limits, ModuleSource, Net,
    Outcome, PythonSource, Status, Tier, TierKind,
};
use strata_engine::TierChoice;
use strata_test_programs as programs;
use strata_tier_wasm::{CacheOutcome, WasmTier, WasmTierConfig};

use crate::util::{ORIGIN_BODY, Origin, engine, job, limits, run, run_with_stdin, stdout, try_run};

const TOOL: &str = programs::COMPONENT_TOOL;
const NET: &str = programs::COMPONENT_NET;

fn allow(specs: &[String]) -> Capabilities {
    Capabilities { net: Net::allow(specs).expect("valid allowlist"), ..Capabilities::default() }
}

fn stderr(outcome: &Outcome) -> String {
    String::from_utf8_lossy(&outcome.stderr).into_owned()
}

/// The single egress entry of `outcome`.
fn one_entry(outcome: &Outcome) -> &EgressEntry {
    let [entry] = outcome.egress.as_slice() else { panic!("one egress entry: {:?}", outcome.egress) };
    entry
}

/// A port nothing listens on, and a listener on 127.0.0.1 that counts the connections it accepts (a guest that
/// is refused must not reach it).
struct Sentinel {
    port: u16,
    accepted: Arc<AtomicUsize>,
}

impl Sentinel {
    fn start() -> Sentinel {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind sentinel");
        let port = listener.local_addr().expect("addr").port();
        let accepted = Arc::new(AtomicUsize::new(0));
        let counter = accepted.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                counter.fetch_add(1, Ordering::SeqCst);
                if let Ok(mut stream) = stream {
                    let _ = stream.read(&mut [0u8; 64]);
                }
            }
        });
        Sentinel { port, accepted }
    }

    fn accepted(&self) -> usize {
        self.accepted.load(Ordering::SeqCst)
    }
}

/// A host server on 127.0.0.1 that reads each connection to the end of what the client sends and answers
/// `received N`, N the bytes it read.
fn sink() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind sink");
    let port = listener.local_addr().expect("addr").port();
    std::thread::spawn(move || {
        for mut stream in listener.incoming().flatten() {
            std::thread::spawn(move || {
                let _ = stream.set_read_timeout(Some(Duration::from_secs(10)));
                let mut reader = stream.try_clone().expect("clone");
                if let Ok(received) = std::io::copy(&mut reader, &mut std::io::sink()) {
                    let _ = write!(stream, "received {received}");
                }
            });
        }
    });
    port
}

#[test]
fn a_component_prints_and_exits_like_a_command() {
    let outcome = run(TOOL, &["hello", "Strata"], &Capabilities::default(), &Limits::default());
    assert_eq!(outcome.status, Status::Exited { code: 0 }, "{outcome:?}");
    assert_eq!(outcome.tier, TierKind::Wasm);
    assert_eq!(stdout(&outcome), "Hello, Strata! (component)\n");
    assert_eq!(stderr(&outcome), "to stderr\n");
    assert_eq!(outcome.usage.stdout_bytes, outcome.stdout.len() as u64);
    assert!(outcome.usage.peak_memory > 0, "{:?}", outcome.usage);
    assert_eq!(outcome.usage.fuel, None, "unmetered by default");
    assert!(outcome.egress.is_empty());
}

#[test]
fn a_components_exit_status_is_reported() {
    let outcome = run(TOOL, &["exit", "0"], &Capabilities::default(), &Limits::default());
    assert_eq!(outcome.status, Status::Exited { code: 0 }, "{outcome:?}");
    // Rust's std on wasm32-wasip2 exits through `wasi:cli/exit.exit(result)`: failure, without its code.
    let outcome = run(TOOL, &["exit", "3"], &Capabilities::default(), &Limits::default());
    assert_eq!(outcome.status, Status::Exited { code: 1 }, "{outcome:?}");
    let outcome = run(TOOL, &["no-such-mode"], &Capabilities::default(), &Limits::default());
    assert_eq!(outcome.status, Status::Exited { code: 1 }, "{outcome:?}");
    assert!(stderr(&outcome).contains("unknown mode"), "{outcome:?}");
}

#[test]
fn args_env_stdin_and_secrets_reach_a_component() {
    let caps = Capabilities {
        env: vec!["GREETING=hi there".parse().expect("env")],
        secrets: vec![EnvVar { name: "API_KEY".into(), value: "sk-live-0123456789".into() }],
        ..Capabilities::default()
    };
    let outcome = run_with_stdin(TOOL, &["echo", "a b", "sk-live-0123456789"], &caps, b"line one\nline two");
    let text = stdout(&outcome);
    assert_eq!(outcome.status, Status::Exited { code: 0 }, "{outcome:?}");
    assert!(text.starts_with("arg[0]=tool.wasm\narg[1]=echo\narg[2]=a b\narg[3]=[REDACTED:API_KEY]\n"), "{text}");
    assert!(text.contains("env API_KEY=[REDACTED:API_KEY]\nenv GREETING=hi there\n"), "{text}");
    assert!(text.ends_with("stdin=line one\nline two\n"), "{text}");
    assert!(!text.contains("env PATH=") && !text.contains("sk-live"), "{text}");
}

#[test]
fn grants_are_read_only_or_writable_as_for_preview1_commands() {
    let ro = tempfile::tempdir().expect("tempdir");
    let rw = tempfile::tempdir().expect("tempdir");
    std::fs::write(ro.path().join("in.txt"), "granted input").expect("write");
    let caps = Capabilities {
        grants: vec![
            Grant::new(ro.path(), "/in", GrantMode::Ro).expect("grant"),
            Grant::new(rw.path(), "/out", GrantMode::Rw).expect("grant"),
        ],
        ..Capabilities::default()
    };
    let l = Limits::default();
    assert_eq!(stdout(&run(TOOL, &["cat", "/in/in.txt"], &caps, &l)), "granted input");
    assert!(stdout(&run(TOOL, &["write", "/in/new.txt", "x"], &caps, &l)).starts_with("refused"));
    assert!(stdout(&run(TOOL, &["write", "/in/in.txt", "x"], &caps, &l)).starts_with("refused"));
    assert_eq!(std::fs::read_to_string(ro.path().join("in.txt")).expect("read"), "granted input");
    assert!(!ro.path().join("new.txt").exists());
    assert_eq!(stdout(&run(TOOL, &["write", "/out/result.txt", "from the component"], &caps, &l)), "wrote\n");
    assert_eq!(std::fs::read_to_string(rw.path().join("result.txt")).expect("read"), "from the component");
    // Nothing else of the host is visible.
    for path in ["/etc/passwd", "/in/../../etc/passwd", "/out/../in/in.txt"] {
        let outcome = run(TOOL, &["cat", path], &caps, &l);
        assert_eq!(outcome.status, Status::Exited { code: 1 }, "{path}: {outcome:?}");
        assert!(stdout(&outcome).starts_with("refused"), "{path}: {outcome:?}");
    }
    let outcome = run(TOOL, &["cat", "/in/in.txt"], &Capabilities::default(), &l);
    assert!(stdout(&outcome).starts_with("refused"), "no grants, no files: {outcome:?}");
}

#[test]
fn limits_stop_a_component_with_their_own_kind() {
    let caps = Capabilities::default();
    let outcome = run(TOOL, &["alloc", "256"], &caps, &limits("memory = \"64MiB\""));
    assert_eq!(outcome.status, Status::LimitExceeded { limit: LimitKind::Memory }, "{outcome:?}");
    assert!(outcome.usage.peak_memory <= 64 << 20, "{:?}", outcome.usage);
    let outcome = run(TOOL, &["alloc", "16"], &caps, &limits("memory = \"64MiB\""));
    assert_eq!(stdout(&outcome), "allocated 16 MiB\n", "within the limit: {outcome:?}");

    let outcome = run(TOOL, &["spin"], &caps, &limits("wall = \"300ms\""));
    assert_eq!(outcome.status, Status::LimitExceeded { limit: LimitKind::Wall }, "{outcome:?}");
    let outcome = run(TOOL, &["sleep", "20000"], &caps, &limits("wall = \"300ms\""));
    assert_eq!(outcome.status, Status::LimitExceeded { limit: LimitKind::Wall }, "{outcome:?}");
    assert!(outcome.usage.wall < Duration::from_secs(5), "the sleep is cut short: {:?}", outcome.usage);

    let outcome = run(TOOL, &["spin"], &caps, &limits("fuel = 5000000"));
    assert_eq!(outcome.status, Status::LimitExceeded { limit: LimitKind::Fuel }, "{outcome:?}");
    assert_eq!(outcome.usage.fuel, Some(5_000_000));
    let outcome = run(TOOL, &["hello", "fuel"], &caps, &limits("fuel = 100000000"));
    assert_eq!(outcome.status, Status::Exited { code: 0 }, "{outcome:?}");
    assert!(outcome.usage.fuel.is_some_and(|f| f > 0 && f < 100_000_000), "{:?}", outcome.usage);

    let outcome = run(TOOL, &["echo"], &caps, &limits("output = \"16B\""));
    assert!(outcome.truncated.stdout && outcome.stdout.len() == 16, "{outcome:?}");
    assert!(outcome.usage.stdout_bytes > 16, "{:?}", outcome.usage);
}

#[test]
fn components_are_compiled_once_and_cached_apart_from_modules() {
    let dir = tempfile::tempdir().expect("tempdir");
    let tier = || WasmTier::new(WasmTierConfig { cache_dir: Some(dir.path().to_owned()), ..Default::default() });
    let component = ModuleSource::File(TOOL.into());
    let l = Limits::default();
    assert_eq!(tier().prepare(&component, &l).expect("compile"), Some(CacheOutcome::Compiled));
    assert_eq!(tier().prepare(&component, &l).expect("load"), Some(CacheOutcome::Hit));
    let warm = tier();
    warm.prepare(&component, &l).expect("load");
    assert_eq!(warm.prepare(&component, &l).expect("memory"), None);
    // The same bytes as a job, from the disk cache, in a new tier.
    let bytes = std::fs::read(TOOL).expect("read");
    let module = ModuleSource::Bytes { name: "tool.wasm".into(), bytes: bytes.into() };
    let job = Job::Wasm { module, args: vec!["hello".into(), "cache".into()] };
    let outcome = tier().run(&job, &Capabilities::default(), &l, ExecOptions::default()).expect("runs");
    assert_eq!(stdout(&outcome), "Hello, cache! (component)\n");
}

#[test]
fn what_is_not_a_command_component_is_a_typed_error() {
    let caps = Capabilities::default();
    let l = Limits::default();
    let err = try_run(programs::COMPONENT_LIBRARY_WAT, &[], &caps, &l).expect_err("a library component");
    assert_eq!(err.code(), "invalid_module", "{err}");
    assert!(err.to_string().contains("wasi:cli/run"), "{err}");
    let err = try_run(programs::COMPONENT_UNKNOWN_IMPORT_WAT, &[], &caps, &l).expect_err("unknown import");
    assert_eq!(err.code(), "unknown_import", "{err}");
    assert!(err.to_string().contains("strata:test/missiles@1.0.0"), "{err}");

    // A truncated component and a component header followed by garbage.
    let whole = std::fs::read(TOOL).expect("read");
    let dir = tempfile::tempdir().expect("tempdir");
    for (name, bytes) in [
        ("truncated.wasm", whole[..whole.len() / 2].to_vec()),
        ("garbage.wasm", [&whole[..8], b"\xff\xff\xff\xff garbage".as_slice()].concat()),
        ("header.wasm", whole[..8].to_vec()),
    ] {
        let path = dir.path().join(name);
        std::fs::write(&path, bytes).expect("write");
        let err = try_run(path.to_str().expect("utf-8"), &[], &caps, &l).expect_err(name);
        assert_eq!(err.code(), "invalid_module", "{name}: {err}");
    }
    // A binary of another layer or version.
    let path = dir.path().join("layer2.wasm");
    std::fs::write(&path, b"\0asm\x0d\0\x02\0").expect("write");
    let err = try_run(path.to_str().expect("utf-8"), &[], &caps, &l).expect_err("layer 2");
    assert_eq!(err.code(), "unsupported", "{err}");
}

#[test]
fn a_sandbox_runs_components_and_only_components_get_its_network() {
    let origin = Origin::start();
    let caps = allow(&[format!("127.0.0.1:{}", origin.port)]);
    let sandbox = engine().start(TierChoice::Auto, &caps, &Limits::default()).expect("start");
    let target = format!("127.0.0.1:{}", origin.port);
    for round in 0..2 {
        let outcome = sandbox.exec(&job(NET, &["get", &target]), ExecOptions::default()).expect("exec");
        assert!(stdout(&outcome).ends_with(ORIGIN_BODY), "round {round}: {outcome:?}");
        assert_eq!(one_entry(&outcome).verdict, "allowed", "each job logs its own: {:?}", outcome.egress);
    }
    assert_eq!(origin.hits(), 2);
    // A preview1 module and Python have no sockets: refused, not run without the network they were given.
    let err = sandbox.exec(&job(programs::HELLO, &[]), ExecOptions::default()).expect_err("preview1");
    assert_eq!(err.code(), "unsupported", "{err}");
    assert!(err.to_string().contains("wasm32-wasip2"), "{err}");
    let python = Job::Python { source: PythonSource::Code("print(1)".into()), args: vec![] };
    let err = sandbox.exec(&python, ExecOptions::default()).expect_err("python");
    assert_eq!(err.code(), "unsupported", "{err}");
    sandbox.close().expect("close");
}

#[test]
fn an_allowed_address_is_reached_and_the_connect_is_logged() {
    let origin = Origin::start();
    let target = format!("127.0.0.1:{}", origin.port);
    let outcome = run(NET, &["get", &target], &allow(std::slice::from_ref(&target)), &Limits::default());
    assert_eq!(outcome.status, Status::Exited { code: 0 }, "{outcome:?}: {}", stderr(&outcome));
    let text = stdout(&outcome);
    assert!(text.starts_with("HTTP/1.1 200 OK\r\n") && text.ends_with(ORIGIN_BODY), "{text}");
    assert_eq!(origin.hits(), 1);
    let entry = one_entry(&outcome);
    assert_eq!((entry.host.as_str(), entry.port), ("127.0.0.1", origin.port), "{entry:?}");
    assert_eq!((entry.kind.as_str(), entry.verdict.as_str(), entry.reason.as_deref()), ("tcp", "allowed", None));
    // Up: the guest's request, all of it; down: the whole response it read (and printed), the body included.
    let request = "GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n";
    assert_eq!(entry.bytes_up, request.len() as u64, "{entry:?}");
    assert_eq!(entry.bytes_down, text.len() as u64, "{entry:?}");
    assert!(entry.bytes_down >= ORIGIN_BODY.len() as u64);
    let json = serde_json::to_value(&outcome).expect("json");
    assert_eq!(json["egress"][0]["kind"], "tcp");
    assert_eq!(json["egress"][0]["bytes_down"], text.len());
}

#[test]
fn an_upload_is_counted_up_and_its_reply_down() {
    let port = sink();
    let target = format!("127.0.0.1:{port}");
    let size = (1 << 20) + 7;
    let outcome =
        run(NET, &["upload", &target, &size.to_string()], &allow(std::slice::from_ref(&target)), &Limits::default());
    assert_eq!(outcome.status, Status::Exited { code: 0 }, "{outcome:?}: {}", stderr(&outcome));
    let reply = format!("received {size}");
    assert_eq!(stdout(&outcome), format!("{target}: {reply}\n"));
    let entry = one_entry(&outcome);
    assert_eq!((entry.verdict.as_str(), entry.port), ("allowed", port), "{entry:?}");
    assert_eq!((entry.bytes_up, entry.bytes_down), (size as u64, reply.len() as u64), "{entry:?}");
}

#[test]
fn each_connection_of_a_job_counts_into_its_own_entry() {
    // Two connections to one address, open at once, sending and receiving different amounts; before them a
    // connect to another port of the same IP, denied.
    let port = sink();
    let refused = Sentinel::start();
    let target = format!("127.0.0.1:{port}");
    let denied = format!("127.0.0.1:{}", refused.port);
    let args = ["upload", &denied, "5", &target, "1000", &target, "100000"];
    let outcome = run(NET, &args, &allow(std::slice::from_ref(&target)), &Limits::default());
    assert_eq!(outcome.status, Status::Exited { code: 0 }, "{outcome:?}: {}", stderr(&outcome));
    assert_eq!(
        stdout(&outcome),
        format!("{denied}: error: connect: PermissionDenied\n{target}: received 100000\n{target}: received 1000\n")
    );
    let summary: Vec<_> =
        outcome.egress.iter().map(|e| (e.port, e.verdict.as_str(), e.bytes_up, e.bytes_down)).collect();
    assert_eq!(
        summary,
        [
            (refused.port, "denied", 0, 0),
            (port, "allowed", 1000, "received 1000".len() as u64),
            (port, "allowed", 100_000, "received 100000".len() as u64),
        ]
    );
    assert_eq!(refused.accepted(), 0);
}

#[test]
fn without_network_a_component_reaches_nothing() {
    let sentinel = Sentinel::start();
    let target = format!("127.0.0.1:{}", sentinel.port);
    for args in [vec!["get", target.as_str()], vec!["get", "localhost:80"], vec!["lookup", "localhost"]] {
        let outcome = run(NET, &args, &Capabilities::default(), &Limits::default());
        assert_eq!(outcome.status, Status::Exited { code: 1 }, "{args:?}: {outcome:?}");
        assert!(stdout(&outcome).starts_with("error: "), "{args:?}: {outcome:?}");
        assert!(outcome.egress.is_empty(), "no network, no egress log: {:?}", outcome.egress);
    }
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(sentinel.accepted(), 0, "the host listener was reached");
}

#[test]
fn a_port_the_allowlist_does_not_name_is_denied_and_logged() {
    let sentinel = Sentinel::start();
    let other = Sentinel::start();
    let target = format!("127.0.0.1:{}", sentinel.port);
    let caps = allow(&[format!("127.0.0.1:{}", other.port)]);
    let outcome = run(NET, &["get", &target], &caps, &Limits::default());
    assert_eq!(outcome.status, Status::Exited { code: 1 }, "{outcome:?}");
    let text = stdout(&outcome);
    assert!(text.starts_with("error: connect: PermissionDenied"), "{text}");
    let entry = one_entry(&outcome);
    assert_eq!((entry.host.as_str(), entry.port, entry.kind.as_str()), ("127.0.0.1", sentinel.port, "tcp"));
    assert_eq!(entry.verdict, "denied", "{entry:?}");
    assert_eq!((entry.bytes_up, entry.bytes_down), (0, 0), "{entry:?}");
    assert_eq!(entry.reason.as_deref(), Some(format!("{target} is not in the allowlist").as_str()));
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!((sentinel.accepted(), other.accepted()), (0, 0));
}

#[test]
fn a_localhost_rule_is_resolved_by_the_host_and_other_names_are_not_looked_up() {
    let origin = Origin::start();
    let caps = allow(&[format!("localhost:{}", origin.port)]);
    let outcome = run(NET, &["get", &format!("localhost:{}", origin.port)], &caps, &Limits::default());
    assert_eq!(outcome.status, Status::Exited { code: 0 }, "{outcome:?}");
    assert!(stdout(&outcome).ends_with(ORIGIN_BODY), "{outcome:?}");
    assert_eq!(origin.hits(), 1);
    // std tries the addresses in turn; the one that answered is allowed as `localhost`.
    let allowed: Vec<_> = outcome.egress.iter().filter(|e| e.verdict == "allowed").collect();
    assert_eq!(allowed.len(), 1, "{:?}", outcome.egress);
    assert_eq!((allowed[0].host.as_str(), allowed[0].port), ("localhost", origin.port));

    // An address the guest did not look up: the host resolves the rule's name itself and finds it there.
    let outcome = run(NET, &["get", &format!("127.0.0.1:{}", origin.port)], &caps, &Limits::default());
    assert!(stdout(&outcome).ends_with(ORIGIN_BODY), "{outcome:?}");
    let entry = one_entry(&outcome);
    assert_eq!((entry.host.as_str(), entry.verdict.as_str()), ("localhost", "allowed"), "{entry:?}");
    assert_eq!(origin.hits(), 2);

    let outcome = run(NET, &["lookup", "localhost"], &caps, &Limits::default());
    assert!(stdout(&outcome).contains("addr 127.0.0.1\n"), "{outcome:?}");
    // Names no rule allows fail before any query, with a permanent resolver failure (EAI_FAIL), not as names
    // that do not exist.
    for name in ["example.org", "localhost.example.org", "pypi.org"] {
        let outcome = run(NET, &["lookup", name], &caps, &Limits::default());
        assert_eq!(outcome.status, Status::Exited { code: 1 }, "{name}: {outcome:?}");
        assert!(stdout(&outcome).starts_with("error: lookup: "), "{name}: {outcome:?}");
        assert!(stdout(&outcome).contains("Non-recoverable"), "{name}: {outcome:?}");
    }
    // With an IP rule only, no name may be looked up, not even one the host resolves without DNS; IP literals
    // resolve to themselves.
    let by_ip = allow(&[format!("127.0.0.1:{}", origin.port)]);
    let outcome = run(NET, &["lookup", "localhost"], &by_ip, &Limits::default());
    assert!(stdout(&outcome).contains("Non-recoverable"), "{outcome:?}");
    let outcome = run(NET, &["lookup", "127.0.0.1"], &by_ip, &Limits::default());
    assert_eq!(stdout(&outcome), "addr 127.0.0.1\n", "{outcome:?}");
    // The port is the rule's.
    let outcome = run(NET, &["get", &format!("localhost:{}", origin.port + 1)], &caps, &Limits::default());
    assert_eq!(outcome.status, Status::Exited { code: 1 }, "{outcome:?}");
    assert!(outcome.egress.iter().all(|e| e.verdict == "denied" && e.host == "localhost"), "{:?}", outcome.egress);
    assert_eq!(origin.hits(), 2);
}

#[test]
fn binds_listens_and_udp_are_refused_even_with_network() {
    let caps = allow(&["127.0.0.1".into(), "localhost".into()]);
    for mode in ["listen", "udp"] {
        let outcome = run(NET, &[mode], &caps, &Limits::default());
        assert_eq!(outcome.status, Status::Exited { code: 1 }, "{mode}: {outcome:?}");
        assert!(stdout(&outcome).starts_with(&format!("error: {mode}: ")), "{mode}: {outcome:?}");
        assert!(outcome.egress.is_empty(), "{mode}: {:?}", outcome.egress);
    }
}

#[test]
fn a_component_job_takes_one_instance_slot() {
    // A component holds several core instances, tables and memories; the tier's slot count is in jobs.
    let tier = WasmTier::new(WasmTierConfig { max_instances: 1, ..WasmTierConfig::default() });
    let job = job(TOOL, &["hello", "slot"]);
    for _ in 0..2 {
        let outcome = tier.run(&job, &Capabilities::default(), &Limits::default(), ExecOptions::default());
        assert_eq!(stdout(&outcome.expect("runs in one slot")), "Hello, slot! (component)\n");
    }
}

/// A host server on 127.0.0.1 that reports, for each connection, every byte the client sent before it closed.
fn recorder() -> (u16, std::sync::mpsc::Receiver<Vec<u8>>) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind recorder");
    let port = listener.local_addr().expect("addr").port();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for mut stream in listener.incoming().flatten() {
            let tx = tx.clone();
            std::thread::spawn(move || {
                let _ = stream.set_read_timeout(Some(Duration::from_secs(10)));
                let mut got = Vec::new();
                let _ = stream.read_to_end(&mut got);
                let _ = tx.send(got);
            });
        }
    });
    (port, rx)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[test]
fn a_tls_client_hello_must_name_what_the_connection_was_allowed_for() {
    use strata_egress::sni::testing::client_hello;
    let (port, received) = recorder();
    let by_ip = allow(&[format!("127.0.0.1:{port}")]);
    let by_name = allow(&[format!("localhost:{port}")]);
    let target = format!("127.0.0.1:{port}");
    let named = format!("localhost:{port}");
    let cases: [(&str, &Capabilities, &str, Option<&str>, bool); 4] = [
        ("no SNI where an IP rule allows the address", &by_ip, &target, None, true),
        ("an SNI through an IP rule: fronting", &by_ip, &target, Some("evil.example"), false),
        ("the allowed name the guest looked up", &by_name, &named, Some("localhost"), true),
        ("another name on an address allowed by name", &by_name, &named, Some("evil.example"), false),
    ];
    for (case, caps, to, sni, allowed) in cases {
        let hello = client_hello(sni);
        let outcome = run(NET, &["send", to, &hex(&hello)], caps, &Limits::default());
        let entry = one_entry(&outcome).clone();
        let got = received.recv_timeout(Duration::from_secs(20)).expect("the connection ended");
        if allowed {
            assert_eq!(stdout(&outcome), format!("sent {}\ngot 0\n", hello.len()), "{case}: {outcome:?}");
            assert_eq!((entry.verdict.as_str(), entry.bytes_up), ("allowed", hello.len() as u64), "{case}");
            assert_eq!(got, hello, "{case}: the server got the ClientHello");
        } else {
            assert_eq!(outcome.status, Status::Exited { code: 1 }, "{case}: {outcome:?}");
            assert!(stdout(&outcome).starts_with("error: write: "), "{case}: {outcome:?}");
            assert_eq!((entry.verdict.as_str(), entry.bytes_up), ("denied", 0), "{case}: {entry:?}");
            assert!(entry.reason.as_deref().is_some_and(|r| r.contains("evil.example")), "{case}: {entry:?}");
            assert!(got.is_empty(), "{case}: the server got {} bytes", got.len());
        }
    }
}
