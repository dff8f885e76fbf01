//! The egress proxy's request head (`engine/egress/src/http.rs`, as `proxy.rs` uses it): the request line,
//! `CONNECT host:port` or an absolute-form `http://` request, and the header fields, as a job sends them.
//!
//! Oracles: [`head_end`] finds the first blank line; [`parse_head`] never panics, and a head it accepts names a
//! host in normal form (parsing its authority again gives the same host) and a token method; the head forwarded
//! to the origin ([`RequestHead::origin_head`]) is one well-formed request (a request line, header lines without
//! CR or LF inside them, exactly one `Host` naming the target, no hop-by-hop or `Proxy-Authorization` field, and
//! nothing after its blank line): no request can be smuggled past the allowlist.
//!
//! Egress secrets run on every parsed absolute-form head ([`EgressSecrets::apply`], with [`PLACEHOLDER`] for
//! `TOKEN`): a secret's value reaches the forwarded head only when the request goes to a host the secret is bound to
//! (or the job sent the value itself); toward other hosts the headers are unchanged; the request line never
//! changes; the header fields stay within the bound; and the forwarded head passes the same checks.

use strata_core::EgressSecret;
use strata_egress::http::{RequestHead, head_end, parse_head};
use strata_egress::{EgressSecrets, Host};

/// The placeholder the `TOKEN` secret has in this target (a seed carries it).
pub const PLACEHOLDER: &str = "strata-secret-TOKEN-00112233445566778899aabbccddeeff";
/// `TOKEN`'s value, bound to `api.example.com` and `127.0.0.1:8080`.
const TOKEN: &str = "tok-VALUE-9f8e7d";
/// `KEY`'s value, set as `X-Api-Key` toward `*.svc.test`.
const KEY: &str = "Bearer key-VALUE-1a2b3c";
/// The header bound ([`strata_egress::EgressConfig::max_header_bytes`]'s default).
const MAX: usize = 16 * 1024;

/// Headers the origin must never see.
const HOP_BY_HOP: &[&str] = &[
    "connection",
    "proxy-connection",
    "keep-alive",
    "proxy-authorization",
    "proxy-authenticate",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

/// Parses `data` as the start of a proxy connection.
pub fn run(data: &[u8]) {
    let Some(end) = head_end(data) else {
        assert!(!data.windows(4).any(|w| w == b"\r\n\r\n"), "head_end missed a blank line");
        return;
    };
    let head = &data[..end];
    assert!(head.ends_with(b"\r\n\r\n"));
    assert!(!head[..end - 1].windows(4).any(|w| w == b"\r\n\r\n"), "head_end skipped an earlier blank line");
    // The whole input too: the parser must refuse a head with bytes after its blank line, or parse it alike.
    let _ = parse_head(data);
    if let Ok(request) = parse_head(head) {
        check(&request);
        if !request.is_connect() {
            substitute(request, head);
        }
    }
}

fn secrets() -> EgressSecrets {
    let token = EgressSecret::new("TOKEN", TOKEN, ["api.example.com", "127.0.0.1:8080"]).expect("TOKEN");
    let key = EgressSecret::new("KEY", KEY, ["*.svc.test"]).and_then(|s| s.as_header("X-Api-Key")).expect("KEY");
    EgressSecrets::with_placeholders([(&token, PLACEHOLDER.to_owned()), (&key, String::new())])
}

fn substitute(mut request: RequestHead, head: &[u8]) {
    let before = request.clone();
    let Ok(used) = secrets().apply(&mut request.headers, &before.host, before.port, MAX) else {
        assert_eq!(request, before, "a refused substitution changed the head");
        return;
    };
    assert_eq!(
        (&request.method, &request.host, request.port, &request.path),
        (&before.method, &before.host, before.port, &before.path)
    );
    let size: usize = request.headers.iter().map(|(k, v)| k.len() + v.len() + 4).sum();
    assert!(size <= MAX, "header fields of {size} bytes after substitution");
    let contains = |hay: &[u8], needle: &str| hay.windows(needle.len()).any(|w| w == needle.as_bytes());
    let forwarded = request.origin_head();
    let token_bound = before.host == Host::Name("api.example.com".into())
        || (before.host == Host::Ip([127, 0, 0, 1].into()) && before.port == 8080);
    let key_bound = before.host.name().is_some_and(|n| n.ends_with(".svc.test"));
    for (value, bound) in [(TOKEN, token_bound), (KEY, key_bound)] {
        if contains(&forwarded, value) {
            assert!(bound || contains(head, value), "{value} went to {}:{}", before.host, before.port);
        }
    }
    if !token_bound && !key_bound {
        assert_eq!(request.headers, before.headers, "headers changed toward an unbound host");
        assert!(used.injected.is_empty());
    }
    if token_bound {
        let left = request.headers.iter().any(|(_, v)| v.contains(PLACEHOLDER));
        assert!(!left, "a placeholder left in a header toward its own host");
    }
    check(&request);
}

fn check(request: &RequestHead) {
    assert!(!request.method.is_empty() && request.method.bytes().all(|b| b.is_ascii_graphic()));
    let authority = request.host.to_authority();
    assert_eq!(Host::parse(&authority).as_ref(), Ok(&request.host), "the host is not in normal form");
    assert!(request.port != 0, "port 0");
    if request.is_connect() {
        return;
    }
    assert!(request.path.starts_with('/'), "origin-form target {:?}", request.path);
    let forwarded = request.origin_head();
    let text = std::str::from_utf8(&forwarded).expect("the forwarded head is text");
    let body = text.strip_suffix("\r\n\r\n").expect("the forwarded head ends with a blank line");
    assert!(!body.contains("\r\n\r\n"), "a blank line inside the forwarded head: {text:?}");
    let mut lines = body.split("\r\n");
    let request_line = lines.next().expect("a request line");
    assert_eq!(request_line, format!("{} {} HTTP/1.1", request.method, request.path));
    assert_eq!(request_line.split(' ').count(), 3, "the request line {request_line:?} has more than three parts");
    let mut hosts = Vec::new();
    for line in lines {
        assert!(!line.contains(['\r', '\n']), "CR or LF inside the forwarded line {line:?}");
        let (name, value) = line.split_once(": ").expect("a forwarded header line is NAME: VALUE");
        let lower = name.to_ascii_lowercase();
        if lower == "host" {
            hosts.push(value.to_owned());
        }
        if lower == "connection" {
            assert_eq!(value, "close");
            continue;
        }
        assert!(!HOP_BY_HOP.contains(&lower.as_str()), "the hop-by-hop field {name} was forwarded");
    }
    let expected = if request.port == 80 { authority } else { format!("{authority}:{}", request.port) };
    assert_eq!(hosts, vec![expected], "the forwarded Host fields");
}
