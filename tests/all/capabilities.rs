//! One capability model on every tier: a table of cases, each a set of capabilities, one Python program (wasm
//! CPython and the Debian image's python3 run the same text) and what must come of it, run on every tier this
//! host can run. A tier that cannot run here is skipped with one line saying why.
//!
//! Programs print normalised words (`refused`, `leaked`, …) rather than raw errors, since tiers word their errors
//! differently; where a tier legitimately does something else (no egress for Python on wasm, whose CPython has no
//! sockets), the case says so per tier.

use std::os::unix::fs::symlink;
use std::path::PathBuf;

use strata_core::{Capabilities, EnvVar, Grant, GrantMode, Job, Limits, Net, Outcome, PythonSource, Status, TierKind};
use strata_engine::{Engine, RunRequest, TierChoice};

use crate::util::{ORIGIN_BODY, Origin, python_engine};

const BODY: &str = ORIGIN_BODY;
const SECRET_TEXT: &str = "host secret: do not read";

/// The host side of one tier's run of the table: a read-only grant with `in.txt`, an empty read-write grant, a
/// secret file outside both (the rw grant holds symlinks to it), and an HTTP server on the host's loopback.
struct Fixture {
    _root: tempfile::TempDir,
    ro: PathBuf,
    rw: PathBuf,
    secret: PathBuf,
    origin: Origin,
}

impl Fixture {
    fn new() -> Fixture {
        let root = tempfile::tempdir().expect("tempdir");
        let (ro, rw, secret) = (root.path().join("ro"), root.path().join("rw"), root.path().join("secret.txt"));
        std::fs::create_dir(&ro).expect("mkdir ro");
        std::fs::create_dir(&rw).expect("mkdir rw");
        std::fs::write(ro.join("in.txt"), "input").expect("write in.txt");
        std::fs::write(&secret, SECRET_TEXT).expect("write secret");
        symlink(&secret, rw.join("abs-link")).expect("symlink");
        symlink("../secret.txt", rw.join("rel-link")).expect("symlink");
        Fixture { _root: root, ro, rw, secret, origin: Origin::start() }
    }

    /// Both grants: `/data/in` read-only, `/data/out` read-write.
    fn grants(&self) -> Capabilities {
        Capabilities {
            grants: vec![
                Grant::new(&self.ro, "/data/in", GrantMode::Ro).expect("grant"),
                Grant::new(&self.rw, "/data/out", GrantMode::Rw).expect("grant"),
            ],
            ..Capabilities::default()
        }
    }
}

/// What a case must produce on one tier.
enum Expect {
    /// Exit 0 and exactly this stdout.
    Prints(&'static str),
    /// Exit 0 and any one of these stdouts.
    PrintsOneOf(&'static [&'static str]),
    /// Exit 0, stdout not checked (a tier whose guest may do this to its own copy; the host check still runs).
    Exits,
    /// The engine refuses the job with this error code before it runs.
    Error(&'static str),
}

type HostCheck = Box<dyn Fn(&Fixture, &Outcome)>;

struct Case {
    name: &'static str,
    caps: Capabilities,
    program: String,
    expect: Box<dyn Fn(TierKind) -> Expect>,
    /// What must hold on the host after a run (only when the job ran).
    host: Option<HostCheck>,
}

fn same(expect: fn() -> Expect) -> Box<dyn Fn(TierKind) -> Expect> {
    Box::new(move |_| expect())
}

/// Python that prints, for each path, `leaked` if reading it shows the host secret, `refused` if the read fails,
/// `other` otherwise.
fn read_probe(paths: &[String]) -> String {
    let list = paths.iter().map(|p| format!("{p:?}")).collect::<Vec<_>>().join(", ");
    format!(
        "for p in [{list}]:\n\
         \x20   try:\n\
         \x20       text = open(p).read()\n\
         \x20       print('leaked' if {SECRET_TEXT:?} in text else 'other')\n\
         \x20   except OSError:\n\
         \x20       print('refused')\n"
    )
}

fn cases(fx: &Fixture) -> Vec<Case> {
    let port = fx.origin.port;
    let other_port = if port == u16::MAX { port - 1 } else { port + 1 };
    let secret = fx.secret.display().to_string();
    vec![
        Case {
            name: "a read-only grant's file is readable",
            caps: fx.grants(),
            program: "print(open('/data/in/in.txt').read())".into(),
            expect: same(|| Expect::Prints("input\n")),
            host: None,
        },
        Case {
            name: "a write into a read-only grant is refused and the host file is unchanged",
            caps: fx.grants(),
            program:
                "for p, mode in [('/data/in/in.txt', 'w'), ('/data/in/in.txt', 'a'), ('/data/in/new.txt', 'w')]:\n\
                      \x20   try:\n\
                      \x20       with open(p, mode) as f:\n\
                      \x20           f.write('changed')\n\
                      \x20       print('written')\n\
                      \x20   except OSError:\n\
                      \x20       print('refused')\n"
                    .into(),
            // In a microVM the guest may change its own copy of a read-only grant; only the host's copy matters.
            expect: Box::new(|tier| match tier {
                TierKind::Microvm => Expect::Exits,
                _ => Expect::Prints("refused\nrefused\nrefused\n"),
            }),
            host: Some(Box::new(|fx, _| {
                assert_eq!(std::fs::read_to_string(fx.ro.join("in.txt")).expect("in.txt"), "input");
                assert!(!fx.ro.join("new.txt").exists(), "a file appeared in the read-only grant");
            })),
        },
        Case {
            name: "a write into a read-write grant is visible on the host",
            caps: fx.grants(),
            program: "with open('/data/out/result.txt', 'w') as f:\n    f.write('from the guest')\nprint('ok')\n"
                .into(),
            expect: same(|| Expect::Prints("ok\n")),
            host: Some(Box::new(|fx, _| {
                assert_eq!(std::fs::read_to_string(fx.rw.join("result.txt")).expect("result.txt"), "from the guest");
            })),
        },
        Case {
            name: "`..` through a grant does not reach the host",
            caps: fx.grants(),
            program: read_probe(&[
                format!("/data/out/../../../../../../..{secret}"),
                format!("/data/in/../../../../../../..{secret}"),
                "/data/out/../../secret.txt".into(),
                "/data/out/../secret.txt".into(),
                secret.clone(),
            ]),
            expect: same(|| Expect::Prints("refused\nrefused\nrefused\nrefused\nrefused\n")),
            host: None,
        },
        Case {
            name: "a symlink planted in a read-write grant neither reveals nor changes the host file it points to",
            caps: fx.grants(),
            program: read_probe(&["/data/out/abs-link".into(), "/data/out/rel-link".into()])
                + "try:\n\
                   \x20   with open('/data/out/abs-link', 'w') as f:\n\
                   \x20       f.write('overwritten')\n\
                   \x20   print('written')\n\
                   except OSError:\n\
                   \x20   print('refused')\n",
            // (A write through `rel-link` is not probed: on the process tier `/data/secret.txt` is the jail's own
            // path, so creating it is legitimate; the host check below covers the host file either way.)
            expect: same(|| Expect::Prints("refused\nrefused\nrefused\n")),
            host: Some(Box::new(|fx, _| {
                assert_eq!(std::fs::read_to_string(&fx.secret).expect("secret"), SECRET_TEXT);
            })),
        },
        Case {
            name: "an environment variable reaches the guest",
            caps: Capabilities {
                env: vec![EnvVar { name: "GREETING".into(), value: "bonjour".into() }],
                ..Capabilities::default()
            },
            program: "import os\nprint(os.environ.get('GREETING'))\n".into(),
            expect: same(|| Expect::Prints("bonjour\n")),
            host: None,
        },
        Case {
            name: "a secret reaches the guest and its value is redacted from stdout",
            caps: Capabilities {
                secrets: vec![EnvVar { name: "TOKEN".into(), value: "s3cr3t-value".into() }],
                ..Capabilities::default()
            },
            program: "import os\nt = os.environ['TOKEN']\nprint(len(t), t == 's3cr3t-value')\nprint('token=' + t)\n"
                .into(),
            // The marker names the secret.
            expect: same(|| Expect::PrintsOneOf(&["12 True\ntoken=[REDACTED:TOKEN]\n"])),
            host: None,
        },
        Case {
            name: "without network a host server on 127.0.0.1 is not reachable",
            caps: Capabilities::default(),
            program: format!(
                "import socket\n\
                 try:\n\
                 \x20   s = socket.socket()\n\
                 \x20   s.settimeout(5)\n\
                 \x20   s.connect(('127.0.0.1', {port}))\n\
                 \x20   print('connected')\n\
                 except OSError:\n\
                 \x20   print('refused')\n"
            ),
            expect: same(|| Expect::Prints("refused\n")),
            host: Some(Box::new(|fx, _| assert_eq!(fx.origin.hits(), 0, "the origin was reached"))),
        },
        Case {
            name: "with network allowed a request through the proxy reaches the host server and is logged",
            caps: Capabilities {
                net: Net::allow([format!("127.0.0.1:{port}")]).expect("valid allowlist"),
                ..Capabilities::default()
            },
            program: format!(
                "import urllib.request\n\
                 print(urllib.request.urlopen('http://127.0.0.1:{port}/', timeout=20).read().decode())\n"
            ),
            // CPython in wasm has no sockets: the wasm tier refuses network with a typed error.
            expect: Box::new(|tier| match tier {
                TierKind::Wasm => Expect::Error("unsupported"),
                _ => Expect::Prints("hello from the host\n"),
            }),
            host: Some(Box::new(move |fx, outcome| {
                assert_eq!(fx.origin.hits(), 1, "the origin saw the request");
                let [entry] = outcome.egress.as_slice() else { panic!("one egress entry: {:?}", outcome.egress) };
                assert_eq!((entry.host.as_str(), entry.port), ("127.0.0.1", fx.origin.port), "{entry:?}");
                assert_eq!((entry.kind.as_str(), entry.verdict.as_str()), ("http", "allowed"), "{entry:?}");
                assert!(entry.bytes_down > BODY.len() as u64, "{entry:?}");
            })),
        },
        Case {
            name: "with network allowed a port the allowlist does not name is refused by the proxy and logged",
            caps: Capabilities {
                net: Net::allow([format!("127.0.0.1:{other_port}")]).expect("valid allowlist"),
                ..Capabilities::default()
            },
            program: format!(
                "import urllib.request, urllib.error\n\
                 try:\n\
                 \x20   urllib.request.urlopen('http://127.0.0.1:{port}/', timeout=20)\n\
                 \x20   print('reached')\n\
                 except urllib.error.HTTPError as e:\n\
                 \x20   print('refused', e.code)\n"
            ),
            expect: Box::new(|tier| match tier {
                TierKind::Wasm => Expect::Error("unsupported"),
                _ => Expect::Prints("refused 403\n"),
            }),
            host: Some(Box::new(move |fx, outcome| {
                assert_eq!(fx.origin.hits(), 0, "the origin was reached");
                let [entry] = outcome.egress.as_slice() else { panic!("one egress entry: {:?}", outcome.egress) };
                assert_eq!((entry.port, entry.verdict.as_str()), (fx.origin.port, "denied"), "{entry:?}");
                assert_eq!((entry.bytes_up, entry.bytes_down), (0, 0), "{entry:?}");
            })),
        },
        Case {
            name: "a TLS ClientHello whose SNI differs from the CONNECT host is refused and logged",
            caps: Capabilities {
                net: Net::allow([format!("127.0.0.1:{port}")]).expect("valid allowlist"),
                ..Capabilities::default()
            },
            // A CONNECT to the allowed address through the job's proxy, then a real ClientHello naming another host.
            program: format!(
                "import os, socket, ssl, urllib.parse\n\
                 proxy = urllib.parse.urlsplit(os.environ['HTTPS_PROXY'])\n\
                 s = socket.create_connection((proxy.hostname, proxy.port), timeout=20)\n\
                 s.sendall(b'CONNECT 127.0.0.1:{port} HTTP/1.1\\r\\nHost: 127.0.0.1:{port}\\r\\n\\r\\n')\n\
                 head = b''\n\
                 while b'\\r\\n\\r\\n' not in head:\n\
                 \x20   head += s.recv(1)\n\
                 print(head.split(b'\\r\\n')[0].decode())\n\
                 ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)\n\
                 ctx.check_hostname = False\n\
                 ctx.verify_mode = ssl.CERT_NONE\n\
                 try:\n\
                 \x20   ctx.wrap_socket(s, server_hostname='evil.example')\n\
                 \x20   print('handshake')\n\
                 except (ssl.SSLError, OSError):\n\
                 \x20   print('refused')\n"
            ),
            expect: Box::new(|tier| match tier {
                TierKind::Wasm => Expect::Error("unsupported"),
                _ => Expect::Prints("HTTP/1.1 200 Connection established\nrefused\n"),
            }),
            host: Some(Box::new(|_, outcome| {
                let [entry] = outcome.egress.as_slice() else { panic!("one egress entry: {:?}", outcome.egress) };
                assert_eq!((entry.kind.as_str(), entry.verdict.as_str()), ("connect", "denied"), "{entry:?}");
                assert!(entry.reason.as_deref().is_some_and(|r| r.contains("evil.example")), "{entry:?}");
            })),
        },
    ]
}

fn python(code: &str) -> Job {
    Job::Python { source: PythonSource::Code(code.into()), args: Vec::new() }
}

/// Runs every case on `tier`, each against a fresh fixture, and checks what it must produce.
fn run_table(engine: &Engine, tier: TierKind) {
    let limits = Limits::default();
    let count = cases(&Fixture::new()).len();
    for index in 0..count {
        let fx = Fixture::new();
        let case = cases(&fx).swap_remove(index);
        let context = format!("{tier}: case {:?}", case.name);
        let job = python(&case.program);
        let result =
            engine.execute(RunRequest::new(&job).caps(&case.caps).limits(limits.clone()).tier(TierChoice::Tier(tier)));
        match ((case.expect)(tier), result) {
            (Expect::Error(code), Err(err)) => {
                assert_eq!(err.code(), code, "{context}: {err}");
                continue;
            }
            (Expect::Error(code), Ok(outcome)) => panic!("{context}: expected error {code}, ran: {outcome:?}"),
            (_, Err(err)) => panic!("{context}: {err}"),
            (expect, Ok(outcome)) => {
                assert_eq!(outcome.tier, tier, "{context}");
                let out = String::from_utf8_lossy(&outcome.stdout).into_owned();
                let context = format!("{context}: stderr {:?}: {outcome:?}", String::from_utf8_lossy(&outcome.stderr));
                assert_eq!(outcome.status, Status::Exited { code: 0 }, "{context}");
                match expect {
                    Expect::Prints(text) => assert_eq!(out, text, "{context}"),
                    Expect::PrintsOneOf(texts) => assert!(texts.contains(&out.as_str()), "{context}"),
                    Expect::Exits | Expect::Error(_) => {}
                }
                assert!(!out.contains(SECRET_TEXT), "{context}: the host secret leaked");
                if let Some(check) = &case.host {
                    check(&fx, &outcome);
                }
            }
        }
    }
}

#[test]
fn capability_cases_on_wasm() {
    run_table(python_engine(), TierKind::Wasm);
}

#[test]
fn capability_cases_on_native_tiers() {
    let engine = python_engine();
    match engine.process() {
        Ok(_) => run_table(engine, TierKind::Process),
        Err(err) => {
            assert!(std::env::var_os("STRATA_REQUIRE_PROCESS_TIER").is_none(), "process tier required: {err}");
            eprintln!("skip: the process tier cannot run on this host: {err}");
        }
    }
    match engine.microvm() {
        Ok(_) => run_table(engine, TierKind::Microvm),
        Err(err) => eprintln!("skip: the microvm tier cannot run on this host: {err}"),
    }
}
