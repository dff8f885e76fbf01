//! Network egress on the process tier: the host egress proxy reached through the jail's forwarder
//! (`127.0.0.1:3128` in the jail, relayed to the proxy's Unix socket bound at `/run/strata/egress.sock`).
//!
//! The origin is a small HTTP server on the host's `127.0.0.1`, which inside the jail's network namespace is not
//! reachable directly (the jail's loopback is its own): every byte that arrives went through the proxy.

use std::path::Path;
use std::time::Duration;

use strata_core::{Capabilities, ExecOptions, Job, Limits, Net, Outcome, PythonSource, TierKind};
use strata_engine::{Engine, RunRequest, TierChoice};

use crate::util::{ORIGIN_BODY, Origin, python_engine};

const BODY: &[u8] = ORIGIN_BODY.as_bytes();

/// The engine, when this host can run the process tier (else one skip line).
fn process_engine() -> Option<&'static Engine> {
    let engine = python_engine();
    match engine.process() {
        Ok(_) => Some(engine),
        Err(err) => {
            assert!(std::env::var_os("STRATA_REQUIRE_PROCESS_TIER").is_none(), "process tier required: {err}");
            eprintln!("skip: the process tier cannot run on this host: {err}");
            None
        }
    }
}

fn python(code: &str) -> Job {
    Job::Python { source: PythonSource::Code(code.into()), args: Vec::new() }
}

fn allow(specs: &[String]) -> Capabilities {
    Capabilities { net: Net::allow(specs).expect("valid allowlist"), ..Capabilities::default() }
}

fn run(engine: &Engine, job: &Job, caps: &Capabilities) -> Outcome {
    engine
        .execute(RunRequest::new(job).caps(caps).limits(Limits::default()).tier(TierChoice::Tier(TierKind::Process)))
        .unwrap_or_else(|e| panic!("{job:?}: {e}"))
}

fn stdout(o: &Outcome) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// A GET of `http://127.0.0.1:PORT/` through `HTTP_PROXY` (urllib's default handler), printing the body or the
/// HTTP error code.
fn fetch(port: u16) -> Job {
    python(&format!(
        "import urllib.request, urllib.error\n\
         try:\n    print(urllib.request.urlopen('http://127.0.0.1:{port}/', timeout=20).read().decode())\n\
         except urllib.error.HTTPError as e:\n    print('http', e.code)\n"
    ))
}

/// This process's egress socket files (named `<pid>-<n>.sock`; other test processes share the directory).
fn egress_sockets(dir: &Path) -> usize {
    let prefix = format!("{}-", std::process::id());
    std::fs::read_dir(dir)
        .map(|d| d.flatten().filter(|e| e.file_name().to_string_lossy().starts_with(&prefix)).count())
        .unwrap_or(0)
}

#[test]
fn allowed_request_reaches_the_host_and_is_logged() {
    let Some(engine) = process_engine() else { return };
    let origin = Origin::start();
    let outcome = run(engine, &fetch(origin.port), &allow(&[format!("127.0.0.1:{}", origin.port)]));
    assert_eq!(outcome.exit_code(), 0, "{outcome:?}");
    assert_eq!(stdout(&outcome), "hello from the host\n", "{outcome:?}");
    assert_eq!(origin.hits(), 1);
    let [entry] = outcome.egress.as_slice() else { panic!("one egress entry: {:?}", outcome.egress) };
    assert_eq!((entry.host.as_str(), entry.port), ("127.0.0.1", origin.port));
    assert_eq!((entry.kind.as_str(), entry.verdict.as_str(), entry.reason.as_deref()), ("http", "allowed", None));
    assert!(entry.bytes_up > 0 && entry.bytes_down > BODY.len() as u64, "{entry:?}");
    let json = serde_json::to_value(&outcome).expect("json");
    assert_eq!(json["egress"][0]["verdict"], "allowed");
    assert_eq!(json["egress"][0]["bytes_down"], entry.bytes_down);
}

#[test]
fn denied_by_default_no_proxy_no_socket_no_env() {
    let Some(engine) = process_engine() else { return };
    let origin = Origin::start();
    let probe = format!(
        "import os, socket\n\
         print(sorted(k for k in os.environ if k.lower().endswith('_proxy')))\n\
         print(os.path.exists('/run/strata/egress.sock'))\n\
         for port in (3128, {}):\n\
         \x20   try:\n\
         \x20       socket.create_connection(('127.0.0.1', port), timeout=5)\n\
         \x20       print('connected')\n\
         \x20   except OSError as e:\n\
         \x20       print(type(e).__name__)\n",
        origin.port
    );
    let outcome = run(engine, &python(&probe), &Capabilities::default());
    assert_eq!(stdout(&outcome), "[]\nFalse\nConnectionRefusedError\nConnectionRefusedError\n", "{outcome:?}");
    assert!(outcome.egress.is_empty());
    assert!(serde_json::to_value(&outcome).expect("json").get("egress").is_none());
    assert_eq!(origin.hits(), 0);

    // With network, the same job sees the proxy's environment and the socket.
    let allowed = run(engine, &python(&probe.replace("3128, ", "3128, 1, ")), &allow(&["example.org".into()]));
    let out = stdout(&allowed);
    assert!(
        out.starts_with(
            "['HTTPS_PROXY', 'HTTP_PROXY', 'NO_PROXY', 'http_proxy', 'https_proxy', 'no_proxy']\nTrue\nconnected\n"
        ),
        "{allowed:?}"
    );
}

#[test]
fn the_jails_own_loopback_bypasses_the_proxy_unless_the_allowlist_names_the_hosts() {
    let Some(engine) = process_engine() else { return };
    let origin = Origin::start();
    // The job serves on its own 127.0.0.1 and fetches from it with urllib, which honours the proxy variables.
    let job = python(
        "import http.server, os, threading, urllib.request\n\
         class H(http.server.BaseHTTPRequestHandler):\n\
         \x20   def do_GET(self):\n\
         \x20       self.send_response(200); self.end_headers(); self.wfile.write(b'from inside')\n\
         \x20   def log_message(self, *a): pass\n\
         srv = http.server.HTTPServer(('127.0.0.1', 0), H)\n\
         threading.Thread(target=srv.serve_forever, daemon=True).start()\n\
         print(os.environ['NO_PROXY'])\n\
         try:\n\
         \x20   print(urllib.request.urlopen(f'http://127.0.0.1:{srv.server_port}/', timeout=20).read().decode())\n\
         except OSError as e:\n\
         \x20   print(type(e).__name__, e)\n",
    );
    let outcome = run(engine, &job, &allow(&["example.org".into()]));
    assert_eq!(stdout(&outcome), "localhost,127.0.0.1,::1\nfrom inside\n", "{outcome:?}");
    assert!(outcome.egress.is_empty(), "the proxy saw the job's own loopback: {:?}", outcome.egress);

    // An allowlist naming the host's loopback sends loopback requests to the proxy, which judges them: the job's
    // own server's port is not the allowed one.
    let outcome = run(engine, &job, &allow(&[format!("127.0.0.1:{}", origin.port)]));
    let out = stdout(&outcome);
    assert!(out.starts_with("\nHTTPError HTTP Error 403"), "{outcome:?}");
    let [entry] = outcome.egress.as_slice() else { panic!("one egress entry: {:?}", outcome.egress) };
    assert_eq!((entry.host.as_str(), entry.verdict.as_str()), ("127.0.0.1", "denied"), "{entry:?}");
    assert_eq!(origin.hits(), 0);
}

#[test]
fn a_job_holding_a_finished_connection_open_costs_no_cpu() {
    let Some(engine) = process_engine() else { return };
    let origin = Origin::start();
    // The proxy closes after the response; the job keeps its end open for a second. The forwarder must drop the
    // connection instead of polling its hung-up side in a loop (the jail's CPU time would show it).
    let code = format!(
        "import socket, time\n\
         s = socket.create_connection(('127.0.0.1', 3128), timeout=20)\n\
         s.sendall(b'GET http://127.0.0.1:{port}/ HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n')\n\
         data = b''\n\
         while True:\n\
         \x20   b = s.recv(65536)\n\
         \x20   if not b: break\n\
         \x20   data += b\n\
         print(data.endswith(b'hello from the host'))\n\
         time.sleep(1)\n",
        port = origin.port
    );
    let outcome = run(engine, &python(&code), &allow(&[format!("127.0.0.1:{}", origin.port)]));
    assert_eq!(stdout(&outcome), "True\n", "{outcome:?}");
    assert!(outcome.usage.cpu < Duration::from_millis(500), "{:?}", outcome.usage);
}

#[test]
fn a_malformed_allowlist_is_refused_where_it_is_parsed_and_never_reaches_a_tier() {
    // `Net::Allow` carries a parsed allowlist: a malformed spec is a typed error at the edge (a policy, a flag, a
    // request body), a `wrong_format` naming it where a tier error is wanted.
    for spec in ["exa mple.org", "http://example.com", "example.com:99999"] {
        let err = strata_core::TierError::from(Net::allow([spec]).expect_err("malformed spec"));
        assert_eq!(err.code(), "wrong_format", "{err}");
        assert!(err.to_string().contains(spec), "{err}");
    }
}

#[test]
fn a_session_logs_each_jobs_egress_with_that_job() {
    let Some(engine) = process_engine() else { return };
    let origin = Origin::start();
    let caps = allow(&[format!("127.0.0.1:{}", origin.port)]);
    let sandbox = engine.start(TierChoice::Tier(TierKind::Process), &caps, &Limits::default()).expect("start sandbox");
    for round in 1..=2 {
        let outcome = sandbox.exec(&fetch(origin.port), ExecOptions::default()).expect("exec");
        assert_eq!(stdout(&outcome), "hello from the host\n", "{outcome:?}");
        assert_eq!(outcome.egress.len(), 1, "round {round}: {:?}", outcome.egress);
    }
    let quiet = sandbox.exec(&python("print('no network')"), ExecOptions::default()).expect("exec");
    assert!(quiet.egress.is_empty(), "{:?}", quiet.egress);
    sandbox.close().expect("close");
    assert_eq!(origin.hits(), 2);
}

/// Runs [`leak_probe`] in a process of its own, where no other test opens descriptors or threads meanwhile.
#[test]
fn twenty_jobs_with_egress_leave_nothing_behind() {
    let Some(_) = process_engine() else { return };
    let exe = std::env::current_exe().expect("test binary");
    let out = std::process::Command::new(exe)
        .args(["--exact", "egress::leak_probe", "--ignored", "--nocapture", "--test-threads=1"])
        .output()
        .expect("run the leak probe");
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "leak probe failed:\n{stdout}\n{stderr}");
    assert!(stdout.contains("leak probe: 20 jobs, nothing left"), "the probe did not run:\n{stdout}\n{stderr}");
}

#[test]
#[ignore = "run in its own process by twenty_jobs_with_egress_leave_nothing_behind"]
fn leak_probe() {
    let Some(engine) = process_engine() else { return };
    let dir = engine.process().expect("process tier").egress_dir();
    let origin = Origin::start();
    let caps = allow(&[format!("127.0.0.1:{}", origin.port)]);
    let job = fetch(origin.port);
    let count = |path: &str| std::fs::read_dir(path).expect(path).count();
    // One job first: lazily created state (the embedded jail binary, the engine's caches) is not a leak.
    assert_eq!(stdout(&run(engine, &job, &caps)), "hello from the host\n");
    let (fds, threads, sockets) = (count("/proc/self/fd"), count("/proc/self/task"), egress_sockets(&dir));
    for i in 0..20 {
        let outcome = run(engine, &job, &caps);
        assert_eq!(stdout(&outcome), "hello from the host\n", "job {i}: {outcome:?}");
        assert_eq!(outcome.egress.len(), 1, "job {i}");
    }
    assert_eq!(origin.hits(), 21);
    assert_eq!(count("/proc/self/fd"), fds, "descriptors");
    assert_eq!(count("/proc/self/task"), threads, "threads");
    assert_eq!(egress_sockets(&dir), sockets, "socket files in {}", dir.display());
    assert_eq!(sockets, 0, "socket files in {}", dir.display());
    println!("leak probe: 20 jobs, nothing left");
}
