//! Egress secrets on the process tier: the job holds a placeholder; the jail's egress proxy puts the value into
//! the headers of plain-HTTP requests to the host the secret is bound to, and nowhere else. Two origins on the
//! host's 127.0.0.1 record the request heads they get; the value must reach the bound one only, and never the
//! job's environment, its output, the outcome's egress records or a snapshot's manifest.

use std::sync::mpsc;
use std::time::Duration;

use strata_core::{
    Capabilities, CapsError, EgressSecret, EgressSecretError, ExecOptions, Job, Limits, Net, Outcome, PythonSource,
    Sandbox, Tier, TierError,
};

use crate::util::process_tier;

/// A host HTTP origin on 127.0.0.1 that answers `ok` and sends each request head it got to `heads`.
struct HeadOrigin {
    port: u16,
    heads: mpsc::Receiver<String>,
}

impl HeadOrigin {
    fn start() -> HeadOrigin {
        use std::io::{Read, Write};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind origin");
        let port = listener.local_addr().expect("addr").port();
        let (tx, heads) = mpsc::channel();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { continue };
                let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
                let mut head = Vec::new();
                let mut buf = [0u8; 4096];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match stream.read(&mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                let _ = stream.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok");
                if tx.send(String::from_utf8_lossy(&head).into_owned()).is_err() {
                    break;
                }
            }
        });
        HeadOrigin { port, heads }
    }

    fn head(&self) -> String {
        self.heads.recv_timeout(Duration::from_secs(10)).expect("a request reached the origin")
    }
}

/// Prints the placeholder the job holds, then GETs each port with `Authorization: Bearer $TOKEN` through the
/// proxy (the allowlist names 127.0.0.1, so `NO_PROXY` is empty) and prints the status, then its whole
/// environment.
fn job(ports: &[u16]) -> Job {
    let code = format!(
        "import os, urllib.request\n\
         print(os.environ['TOKEN'])\n\
         for port in {ports:?}:\n\
         \x20   req = urllib.request.Request(f'http://127.0.0.1:{{port}}/x', headers={{'Authorization': 'Bearer ' + os.environ['TOKEN']}})\n\
         \x20   print(urllib.request.urlopen(req, timeout=20).status)\n\
         print(dict(os.environ))\n"
    );
    Job::Python { source: PythonSource::Code(code), args: Vec::new() }
}

fn caps(allowed: &[u16], bound: u16, value: &str) -> Capabilities {
    let allow: Vec<String> = allowed.iter().map(|p| format!("127.0.0.1:{p}")).collect();
    Capabilities {
        net: Net::allow(&allow).expect("allowlist"),
        egress_secrets: vec![EgressSecret::new("TOKEN", value, [format!("127.0.0.1:{bound}")]).expect("secret")],
        ..Capabilities::default()
    }
}

fn unique_value() -> String {
    format!("s3cr3t-{}-{}", std::process::id(), std::time::UNIX_EPOCH.elapsed().unwrap_or_default().as_nanos())
}

fn check_outcome(outcome: &Outcome, value: &str, bound: u16, other: u16) -> String {
    let out = String::from_utf8_lossy(&outcome.stdout).into_owned();
    assert_eq!(outcome.exit_code(), 0, "{outcome:?}");
    let placeholder = out.lines().next().unwrap_or_default().to_owned();
    assert!(placeholder.starts_with("strata-secret-TOKEN-") && placeholder.len() == 52, "{out}");
    assert!(out.contains("200\n200\n"), "{out}");
    let json = serde_json::to_string(outcome).expect("json");
    assert!(!json.contains(value), "the value leaked into the outcome: {json}");
    let entry = |port: u16| outcome.egress.iter().find(|e| e.port == port).expect("an entry per origin");
    assert_eq!(entry(bound).secrets_injected, ["TOKEN"]);
    assert_eq!(entry(other).secrets_withheld, ["TOKEN"]);
    assert!(entry(bound).secrets_withheld.is_empty() && entry(other).secrets_injected.is_empty());
    placeholder
}

#[test]
fn an_egress_secret_reaches_only_its_bound_host() {
    let Some(tier) = process_tier("an_egress_secret_reaches_only_its_bound_host") else { return };
    let (bound, other) = (HeadOrigin::start(), HeadOrigin::start());
    let value = unique_value();
    let caps = caps(&[bound.port, other.port], bound.port, &value);

    // A one-shot run.
    let outcome = tier.run(&job(&[bound.port, other.port]), &caps, &Limits::default(), ExecOptions::default());
    let outcome = outcome.expect("run");
    let placeholder = check_outcome(&outcome, &value, bound.port, other.port);
    assert!(bound.head().contains(&format!("\r\nAuthorization: Bearer {value}\r\n")));
    assert!(other.head().contains(&format!("\r\nAuthorization: Bearer {placeholder}\r\n")));

    // A sandbox: its own placeholder, the same on every job; a snapshot records the secret by name only.
    let sandbox = tier.start(&caps, &Limits::default()).expect("start");
    let first = sandbox.exec(&job(&[bound.port, other.port]), ExecOptions::default()).expect("exec");
    let mine = check_outcome(&first, &value, bound.port, other.port);
    assert_ne!(mine, placeholder, "a placeholder per sandbox");
    assert!(bound.head().contains(&format!("Bearer {value}\r\n")));
    assert!(other.head().contains(&format!("Bearer {mine}\r\n")));
    let again = sandbox.exec(&job(&[bound.port, other.port]), ExecOptions::default()).expect("exec");
    assert_eq!(check_outcome(&again, &value, bound.port, other.port), mine);
    let (_, _) = (bound.head(), other.head());

    let dir = tempfile::tempdir().expect("tempdir");
    let snapshot = sandbox.snapshot(&dir.path().join("snap")).expect("snapshot");
    let manifest = std::fs::read_to_string(snapshot.dir.join("manifest.json")).expect("manifest");
    assert!(!manifest.contains(&value) && !manifest.contains(&mine), "{manifest}");
    assert!(manifest.contains("egress_secret_names"), "{manifest}");
    let err = tier.fork(&snapshot).err().expect("a fork without the secret's value is refused");
    assert_eq!(err.code(), "unsupported", "{err}");
    assert!(err.to_string().contains("TOKEN") && !err.to_string().contains(&value), "{err}");
    let fork = tier.fork_with(&snapshot, &caps, &Limits::default()).expect("a fork given the secret");
    let forked = fork.exec(&job(&[bound.port]), ExecOptions::default()).expect("exec in the fork");
    assert_eq!(forked.exit_code(), 0, "{forked:?}");
    assert!(bound.head().contains(&format!("Bearer {value}\r\n")));
    sandbox.close().expect("close");
    fork.close().expect("close");
}

#[test]
fn egress_secrets_outside_the_allowlist_or_malformed_are_typed_errors() {
    let Some(tier) = process_tier("egress_secrets_outside_the_allowlist") else { return };
    let outside = caps(&[1000], 2000, "v");
    let err = tier.start(&outside, &Limits::default()).err().expect("a host outside the allowlist");
    assert!(
        matches!(err, TierError::Capability(CapsError::EgressSecret(EgressSecretError::OutsideAllowlist { .. }))),
        "{err}"
    );
    assert_eq!(err.code(), "invalid_capability");
    let no_net = Capabilities { net: Net::Deny, ..outside };
    assert!(tier.start(&no_net, &Limits::default()).is_err(), "no network, nothing to bind to");
    let mut bad = caps(&[1000], 1000, "v");
    bad.egress_secrets[0].name = "NOT-A-NAME".into();
    let err = tier.start(&bad, &Limits::default()).err().expect("a malformed name");
    assert!(matches!(err, TierError::Capability(CapsError::EgressSecret(EgressSecretError::Name(_)))), "{err}");
    bad.egress_secrets[0].name = "TOKEN".into();
    bad.egress_secrets[0].value = "a\r\nInjected: yes".into();
    let err = tier.start(&bad, &Limits::default()).err().expect("a value with CRLF");
    assert!(matches!(err, TierError::Capability(CapsError::EgressSecret(EgressSecretError::Value { .. }))), "{err}");
    assert!(!err.to_string().contains("Injected"), "{err}");
}
