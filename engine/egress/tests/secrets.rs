//! Egress secrets end to end: a placeholder sent through the proxy reaches a bound origin as the value and any
//! other origin as itself; records name the secret, never its value.

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

mod common;

use std::io::Write;
use std::time::Duration;

use common::{connect, http_echo_origin, http_origin, read_all, records};
use strata_core::EgressSecret;
use strata_egress::{Allowlist, EgressConfig, EgressProxy, EgressSecrets, EgressVerdict};

const PLACEHOLDER: &str = "strata-secret-TOKEN-feedfacefeedfacefeedfacefeedface";

#[test]
fn the_value_goes_to_the_bound_origin_only() {
    let bound = http_echo_origin();
    let other = http_echo_origin();
    let (bp, op) = (bound.addr.port(), other.addr.port());
    let secret = EgressSecret::new("TOKEN", "hunter2", [format!("127.0.0.1:{bp}")]).unwrap();
    let allow = Allowlist::parse([format!("127.0.0.1:{bp}"), format!("127.0.0.1:{op}")]).unwrap();
    let config = EgressConfig::new(allow)
        .with_tcp("127.0.0.1:0".parse().unwrap())
        .with_secrets(EgressSecrets::with_placeholders([(&secret, PLACEHOLDER.to_owned())]));
    let p = EgressProxy::start(config).unwrap();
    assert_eq!(p.secret_env(), [("TOKEN".to_owned(), PLACEHOLDER.to_owned())]);

    for port in [bp, op] {
        let mut c = connect(&p);
        let body = format!("body {PLACEHOLDER}");
        let req = format!(
            "POST http://127.0.0.1:{port}/{PLACEHOLDER} HTTP/1.1\r\nauthorization: Bearer {PLACEHOLDER}\r\n\
             Content-Length: {}\r\n\r\n{body}",
            body.len()
        );
        c.write_all(req.as_bytes()).unwrap();
        assert!(String::from_utf8_lossy(&read_all(&mut c)).starts_with("HTTP/1.1 200 OK"));
    }
    let seen = String::from_utf8(bound.received.recv_timeout(Duration::from_secs(5)).unwrap()).unwrap();
    assert!(seen.contains("authorization: Bearer hunter2\r\n"), "{seen}");
    assert!(seen.starts_with(&format!("POST /{PLACEHOLDER} HTTP/1.1")), "the request line is untouched: {seen}");
    assert!(seen.ends_with(&format!("body {PLACEHOLDER}")), "the body is untouched: {seen}");
    let seen = String::from_utf8(other.received.recv_timeout(Duration::from_secs(5)).unwrap()).unwrap();
    assert!(seen.contains(&format!("authorization: Bearer {PLACEHOLDER}\r\n")), "{seen}");
    assert!(!seen.contains("hunter2"), "{seen}");

    let r = records(&p, 2);
    let of = |port: u16| r.iter().find(|r| r.port == port).unwrap();
    assert_eq!(of(bp).secrets.injected, ["TOKEN"]);
    assert_eq!(of(op).secrets.withheld, ["TOKEN"]);
    assert!(r.iter().all(|r| r.verdict == EgressVerdict::Allowed));
    let json = serde_json::to_string(&r).unwrap();
    assert!(json.contains(r#""secrets_withheld":["TOKEN"]"#) && !json.contains("hunter2"), "{json}");
}

#[test]
fn a_head_that_outgrows_the_bound_with_the_value_is_refused() {
    let origin = http_origin(b"ok");
    let port = origin.addr.port();
    let secret = EgressSecret::new("TOKEN", &"v".repeat(4000), [format!("127.0.0.1:{port}")]).unwrap();
    let config = EgressConfig::new(Allowlist::parse([format!("127.0.0.1:{port}")]).unwrap())
        .with_tcp("127.0.0.1:0".parse().unwrap())
        .with_max_header_bytes(4096)
        .with_secrets(EgressSecrets::with_placeholders([(&secret, PLACEHOLDER.to_owned())]));
    let p = EgressProxy::start(config).unwrap();
    let mut c = connect(&p);
    let req = format!("GET http://127.0.0.1:{port}/ HTTP/1.1\r\nA: {PLACEHOLDER}\r\nB: {PLACEHOLDER}\r\n\r\n");
    c.write_all(req.as_bytes()).unwrap();
    let resp = String::from_utf8_lossy(&read_all(&mut c)).into_owned();
    assert!(resp.starts_with("HTTP/1.1 431"), "{resp}");
    assert!(!resp.contains("vvvv"), "{resp}");
    let r = records(&p, 1);
    assert!(r[0].verdict.is_denied(), "{:?}", r[0]);
    assert!(origin.received.recv_timeout(Duration::from_millis(200)).is_err(), "nothing reached the origin");
}
