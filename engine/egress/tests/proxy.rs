//! The proxy end to end, against local servers on 127.0.0.1.

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

mod common;

use std::io::{Read, Write};
use std::net::Shutdown;
use std::os::unix::net::UnixStream;
use std::time::Duration;

use common::{connect, echo_origin, http_echo_origin, http_origin, proxy, read_all, read_head, records};
use strata_egress::sni::testing::client_hello;
use strata_egress::{Allowlist, EgressConfig, EgressKind, EgressProxy, EgressVerdict};

#[test]
fn absolute_form_get_reaches_an_allowed_origin_without_hop_headers() {
    let origin = http_origin(b"hello from origin");
    let p = proxy(&[format!("127.0.0.1:{}", origin.addr.port())]);
    let mut c = connect(&p);
    let req = format!(
        "GET http://127.0.0.1:{}/hello?x=1 HTTP/1.1\r\nHost: wrong.example\r\nProxy-Authorization: Basic c2VjcmV0\r\n\
         Proxy-Connection: keep-alive\r\nConnection: keep-alive, X-Private\r\nX-Private: 1\r\nUser-Agent: t\r\n\r\n",
        origin.addr.port()
    );
    c.write_all(req.as_bytes()).unwrap();
    let resp = read_all(&mut c);
    let text = String::from_utf8_lossy(&resp);
    assert!(text.starts_with("HTTP/1.1 200 OK"), "{text}");
    assert!(text.ends_with("hello from origin"));

    let seen = String::from_utf8(origin.received.recv_timeout(Duration::from_secs(5)).unwrap()).unwrap();
    assert!(seen.starts_with("GET /hello?x=1 HTTP/1.1\r\n"), "{seen}");
    assert!(seen.contains(&format!("Host: 127.0.0.1:{}\r\n", origin.addr.port())));
    assert!(seen.contains("User-Agent: t\r\n"));
    assert!(seen.contains("Connection: close\r\n"));
    for gone in ["Proxy-Authorization", "Proxy-Connection", "keep-alive", "X-Private", "wrong.example"] {
        assert!(!seen.contains(gone), "{gone} forwarded: {seen}");
    }

    let r = records(&p, 1);
    assert_eq!(r.len(), 1);
    assert_eq!((r[0].host.as_str(), r[0].port, r[0].kind), ("127.0.0.1", origin.addr.port(), EgressKind::Http));
    assert_eq!(r[0].verdict, EgressVerdict::Allowed);
    assert_eq!(r[0].bytes_up, seen.len() as u64);
    assert_eq!(r[0].bytes_down, resp.len() as u64);
}

#[test]
fn post_body_is_forwarded_exactly_and_nothing_after_it() {
    let origin = http_echo_origin();
    let p = proxy(&[format!("127.0.0.1:{}", origin.addr.port())]);
    let mut c = connect(&p);
    let req = format!(
        "POST http://127.0.0.1:{}/ HTTP/1.1\r\nContent-Length: 5\r\n\r\nhelloGET http://127.0.0.1:{}/smuggled HTTP/1.1\r\n\r\n",
        origin.addr.port(),
        origin.addr.port()
    );
    c.write_all(req.as_bytes()).unwrap();
    let echoed = String::from_utf8(read_all(&mut c)).unwrap();
    assert!(echoed.starts_with("HTTP/1.1 200 OK"), "{echoed}");
    assert!(echoed.ends_with("Content-Length: 5\r\nConnection: close\r\n\r\nhello"), "{echoed}");
    assert!(!echoed.contains("smuggled"));
}

#[test]
fn connect_tunnels_plain_bytes_both_ways_and_counts_them() {
    let origin = echo_origin();
    let p = proxy(&[format!("127.0.0.1:{}", origin.addr.port())]);
    let mut c = connect(&p);
    write!(c, "CONNECT 127.0.0.1:{} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", origin.addr.port()).unwrap();
    assert!(read_head(&mut c).starts_with("HTTP/1.1 200"));
    let payload: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
    let mut reader = c.try_clone().unwrap();
    let echo = std::thread::spawn(move || read_all(&mut reader));
    c.write_all(&payload).unwrap();
    c.shutdown(Shutdown::Write).unwrap();
    let back = echo.join().unwrap();
    assert_eq!(back, payload);

    let r = records(&p, 1);
    assert_eq!(r[0].kind, EgressKind::Connect);
    assert_eq!(r[0].verdict, EgressVerdict::Allowed);
    assert_eq!((r[0].bytes_up, r[0].bytes_down), (300_000, 300_000));
}

#[test]
fn requests_outside_the_allowlist_get_403_and_a_denied_record() {
    let origin = echo_origin();
    let p = proxy(&[format!("127.0.0.1:{}", origin.addr.port() ^ 1), "*.example.com".into()]);
    for req in [
        format!("CONNECT 127.0.0.1:{} HTTP/1.1\r\n\r\n", origin.addr.port()),
        format!("GET http://127.0.0.1:{}/ HTTP/1.1\r\n\r\n", origin.addr.port()),
        "CONNECT evil-example.com:443 HTTP/1.1\r\n\r\n".into(),
        "CONNECT example.com:443 HTTP/1.1\r\n\r\n".into(),
        "GET http://example.com.evil.org/ HTTP/1.1\r\n\r\n".into(),
    ] {
        let mut c = connect(&p);
        c.write_all(req.as_bytes()).unwrap();
        let resp = String::from_utf8(read_all(&mut c)).unwrap();
        assert!(resp.starts_with("HTTP/1.1 403 Forbidden"), "{req}: {resp}");
        assert!(resp.contains("not in the allowlist"), "{resp}");
    }
    let r = records(&p, 5);
    assert_eq!(r.len(), 5);
    assert!(r.iter().all(|r| r.verdict.is_denied() && r.bytes_up == 0 && r.bytes_down == 0), "{r:?}");
    assert_eq!(r[2].host, "evil-example.com");
    let json = serde_json::to_value(&r[0]).unwrap();
    assert_eq!(json["verdict"], "denied");
    assert!(json["reason"].as_str().unwrap().contains("allowlist"));
    assert!(origin.received.try_recv().is_err(), "the origin saw no connection");
}

/// CONNECT to `localhost:port` (allowed by name: loopback is fine because `localhost` is named).
fn connect_localhost(p: &strata_egress::EgressHandle, port: u16) -> std::net::TcpStream {
    let mut c = connect(p);
    write!(c, "CONNECT LocalHost.:{port} HTTP/1.1\r\n\r\n").unwrap();
    let head = read_head(&mut c);
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    c
}

#[test]
fn tls_client_hello_with_a_different_sni_is_refused() {
    let origin = echo_origin();
    let p = proxy(&[format!("localhost:{}", origin.addr.port())]);

    // Matching SNI: the ClientHello reaches the origin (echoed back).
    let mut c = connect_localhost(&p, origin.addr.port());
    let hello = client_hello(Some("localhost"));
    c.write_all(&hello).unwrap();
    c.shutdown(Shutdown::Write).unwrap();
    assert_eq!(read_all(&mut c), hello);
    assert_eq!(origin.received.recv_timeout(Duration::from_secs(5)).unwrap(), hello);

    // Mismatch: closed, nothing forwarded.
    let mut c = connect_localhost(&p, origin.addr.port());
    c.write_all(&client_hello(Some("evil.com"))).unwrap();
    assert!(read_all(&mut c).is_empty());
    // No SNI for a name: refused as well.
    let mut c = connect_localhost(&p, origin.addr.port());
    c.write_all(&client_hello(None)).unwrap();
    assert!(read_all(&mut c).is_empty());

    let r = records(&p, 3);
    assert_eq!(r[0].verdict, EgressVerdict::Allowed);
    assert_eq!(r[0].host, "localhost");
    let reason = r[1].verdict.reason().unwrap();
    assert!(r[1].verdict.is_denied() && reason.contains("evil.com"), "{reason}");
    assert_eq!(r[1].bytes_up, 0);
    assert!(r[2].verdict.is_denied());
    // Whatever the origin saw after the first connection was empty.
    for seen in origin.received.try_iter() {
        assert!(seen.is_empty());
    }
}

#[test]
fn ip_literal_connect_allows_a_client_hello_without_sni_only() {
    let origin = echo_origin();
    let p = proxy(&[format!("127.0.0.1:{}", origin.addr.port())]);
    let go = |hello: &[u8]| {
        let mut c = connect(&p);
        write!(c, "CONNECT 127.0.0.1:{} HTTP/1.1\r\n\r\n", origin.addr.port()).unwrap();
        assert!(read_head(&mut c).starts_with("HTTP/1.1 200"));
        c.write_all(hello).unwrap();
        c.shutdown(Shutdown::Write).unwrap();
        read_all(&mut c)
    };
    let no_sni = client_hello(None);
    assert_eq!(go(&no_sni), no_sni);
    assert!(go(&client_hello(Some("example.com"))).is_empty());
}

#[test]
fn hostile_client_hellos_are_refused_without_harm() {
    let origin = echo_origin();
    let p = proxy(&[format!("localhost:{}", origin.addr.port())]);
    let good = client_hello(Some("localhost"));
    let mut hostile: Vec<Vec<u8>> = vec![
        vec![0x16],
        vec![0x16, 0x03, 0x01, 0x00, 0x00],
        vec![0x16, 0x03, 0x01, 0xff, 0xff, 0x01],
        vec![0x16, 0x03, 0x01, 0x00, 0x04, 0x01, 0xff, 0xff, 0xff],
        good[..good.len() - 3].to_vec(),
    ];
    // Every length field inflated or zeroed.
    for i in [3, 4, 6, 7, 8, 43, 44, 45, 48, 50, 51, 52, 53, 54, 55, 56] {
        for v in [0x00, 0xff] {
            let mut h = good.clone();
            if i < h.len() && h[i] != v {
                h[i] = v;
                hostile.push(h);
            }
        }
    }
    let n = hostile.len();
    for h in &hostile {
        let mut c = connect_localhost(&p, origin.addr.port());
        c.write_all(h).unwrap();
        c.shutdown(Shutdown::Write).unwrap();
        assert!(read_all(&mut c).is_empty(), "{h:02x?} was relayed");
    }
    let r = records(&p, n);
    assert!(r.iter().all(|r| r.verdict.is_denied() && r.bytes_up == 0), "{r:?}");
    // Still serving.
    let mut c = connect_localhost(&p, origin.addr.port());
    c.write_all(&good).unwrap();
    c.shutdown(Shutdown::Write).unwrap();
    assert_eq!(read_all(&mut c), good);
}

#[test]
fn malformed_and_oversized_heads_are_refused() {
    let p = proxy(&["127.0.0.1".into()]);
    let huge = format!("GET http://127.0.0.1/ HTTP/1.1\r\nX-Big: {}\r\n\r\n", "a".repeat(20 * 1024));
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (huge.into_bytes(), "431"),
        (b"GET /relative HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".to_vec(), "400"),
        (b"CONNECT 127.0.0.1 HTTP/1.1\r\n\r\n".to_vec(), "400"),
        (b"CONNECT user@127.0.0.1:80 HTTP/1.1\r\n\r\n".to_vec(), "400"),
        (b"GET http://127.0.0.1/ HTTP/1.1\r\n folded: x\r\n\r\n".to_vec(), "400"),
        (b"GET https://127.0.0.1/ HTTP/1.1\r\n\r\n".to_vec(), "501"),
        (b"POST http://127.0.0.1/ HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec(), "501"),
        (b"\x16\x03\x01\x00\x05hello\r\n\r\n".to_vec(), "400"),
    ];
    for (req, status) in &cases {
        let mut c = connect(&p);
        c.write_all(req).unwrap();
        let resp = String::from_utf8_lossy(&read_all(&mut c)).into_owned();
        assert!(resp.starts_with(&format!("HTTP/1.1 {status}")), "{status}: {resp}");
    }
    // A huge head with no end at all.
    let mut c = connect(&p);
    let _ = c.write_all(&vec![b'A'; 64 * 1024]);
    let resp = String::from_utf8_lossy(&read_all(&mut c)).into_owned();
    assert!(resp.starts_with("HTTP/1.1 431"), "{resp}");

    let r = records(&p, cases.len() + 1);
    assert!(r.iter().all(|r| r.verdict.is_denied()), "{r:?}");
    assert!(r[0].verdict.reason().unwrap().contains("larger than 16384"));
}

#[test]
fn unreachable_origin_is_502_and_failed() {
    // A port nothing listens on.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let p = proxy(&[format!("127.0.0.1:{port}")]);
    let mut c = connect(&p);
    write!(c, "CONNECT 127.0.0.1:{port} HTTP/1.1\r\n\r\n").unwrap();
    let resp = String::from_utf8(read_all(&mut c)).unwrap();
    assert!(resp.starts_with("HTTP/1.1 502"), "{resp}");
    let r = records(&p, 1);
    assert!(matches!(r[0].verdict, EgressVerdict::Failed { .. }), "{r:?}");
}

#[test]
fn unix_socket_listener_serves_and_is_removed_on_drop() {
    let origin = http_origin(b"over unix");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("egress.sock");
    let allow = Allowlist::parse([format!("127.0.0.1:{}", origin.addr.port())]).unwrap();
    let p = EgressProxy::start(EgressConfig::new(allow).with_unix_socket(&path)).unwrap();
    assert!(p.tcp_addr().is_none());
    assert_eq!(p.unix_socket(), Some(path.as_path()));

    // A second proxy cannot take the same path.
    let again = EgressProxy::start(EgressConfig::new(Allowlist::deny_all()).with_unix_socket(&path));
    assert!(matches!(again, Err(strata_egress::EgressError::SocketExists(_))));

    let mut c = UnixStream::connect(&path).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(c, "GET http://127.0.0.1:{}/ HTTP/1.1\r\n\r\n", origin.addr.port()).unwrap();
    let resp = String::from_utf8(read_all(&mut c)).unwrap();
    assert!(resp.ends_with("over unix"), "{resp}");
    let r = records(&p, 1);
    assert_eq!(r[0].verdict, EgressVerdict::Allowed);
    assert_eq!(p.drain_records().len(), 1);
    assert!(p.records().is_empty());
    drop(p);
    assert!(!path.exists());
}

#[test]
fn connections_beyond_the_limit_get_503() {
    let origin = echo_origin();
    let allow = Allowlist::parse([format!("127.0.0.1:{}", origin.addr.port())]).unwrap();
    let p =
        EgressProxy::start(EgressConfig::new(allow).with_tcp("127.0.0.1:0".parse().unwrap()).with_max_connections(1))
            .unwrap();
    let mut held = connect(&p);
    write!(held, "CONNECT 127.0.0.1:{} HTTP/1.1\r\n\r\n", origin.addr.port()).unwrap();
    assert!(read_head(&mut held).starts_with("HTTP/1.1 200"));
    let mut c = connect(&p);
    let resp = String::from_utf8(read_all(&mut c)).unwrap();
    assert!(resp.starts_with("HTTP/1.1 503"), "{resp}");
    drop(held);
    // The slot frees once the tunnel ends.
    records(&p, 1);
    let mut c = connect(&p);
    write!(c, "CONNECT 127.0.0.1:{} HTTP/1.1\r\n\r\n", origin.addr.port()).unwrap();
    assert!(read_head(&mut c).starts_with("HTTP/1.1 200"));
}

#[test]
fn idle_connections_are_closed() {
    let origin = echo_origin();
    let allow = Allowlist::parse([format!("127.0.0.1:{}", origin.addr.port())]).unwrap();
    let p = EgressProxy::start(
        EgressConfig::new(allow).with_tcp("127.0.0.1:0".parse().unwrap()).with_idle_timeout(Duration::from_millis(300)),
    )
    .unwrap();
    // Silent before the head: closed, no record.
    let mut c = connect(&p);
    let t = std::time::Instant::now();
    assert!(read_all(&mut c).is_empty());
    assert!(t.elapsed() < Duration::from_secs(5));
    // Half a head, then silence: 408.
    let mut c = connect(&p);
    c.write_all(b"CONNECT 127.0.0.1:1").unwrap();
    assert!(String::from_utf8(read_all(&mut c)).unwrap().starts_with("HTTP/1.1 408"));
    // An idle tunnel: closed after some traffic.
    let mut c = connect(&p);
    write!(c, "CONNECT 127.0.0.1:{} HTTP/1.1\r\n\r\n", origin.addr.port()).unwrap();
    assert!(read_head(&mut c).starts_with("HTTP/1.1 200"));
    c.write_all(b"ping").unwrap();
    let mut four = [0u8; 4];
    c.read_exact(&mut four).unwrap();
    assert!(read_all(&mut c).is_empty());
    let r = records(&p, 2);
    assert_eq!(r.len(), 2, "{r:?}");
    assert!(r[0].verdict.is_denied());
    assert_eq!((r[1].bytes_up, r[1].bytes_down, &r[1].verdict), (4, 4, &EgressVerdict::Allowed));
}

#[test]
fn shutdown_records_cancelled_tunnels() {
    let origin = echo_origin();
    let p = proxy(&[format!("127.0.0.1:{}", origin.addr.port())]);
    let mut c = connect(&p);
    write!(c, "CONNECT 127.0.0.1:{} HTTP/1.1\r\n\r\n", origin.addr.port()).unwrap();
    assert!(read_head(&mut c).starts_with("HTTP/1.1 200"));
    c.write_all(b"abc").unwrap();
    let mut three = [0u8; 3];
    c.read_exact(&mut three).unwrap();
    assert_eq!(p.active_connections(), 1);
    let r = p.shutdown();
    assert_eq!(r.len(), 1);
    assert_eq!((r[0].bytes_up, r[0].bytes_down), (3, 3));
    assert!(read_all(&mut c).is_empty(), "the client sees the tunnel close");
}

#[test]
fn start_needs_a_listener() {
    let e = EgressProxy::start(EgressConfig::new(Allowlist::deny_all())).unwrap_err();
    assert!(matches!(e, strata_egress::EgressError::NoListener));
}

#[test]
fn records_past_the_cap_are_counted_and_the_count_is_drained_with_them() {
    let mut config =
        EgressConfig::new(Allowlist::parse(["*.example.com"]).unwrap()).with_tcp("127.0.0.1:0".parse().unwrap());
    config.max_records = 2;
    let p = EgressProxy::start(config).unwrap();
    let deny = |n: usize| {
        for _ in 0..n {
            let mut c = connect(&p);
            c.write_all(b"CONNECT evil.org:443 HTTP/1.1\r\n\r\n").unwrap();
            assert!(String::from_utf8(read_all(&mut c)).unwrap().starts_with("HTTP/1.1 403"));
        }
    };
    deny(5);
    let drained = p.drain_records_settled(Duration::from_secs(5));
    assert_eq!((drained.records.len(), drained.dropped), (2, 3));
    let (entries, dropped) = drained.into_entries();
    assert_eq!((entries[0].verdict.as_str(), dropped), ("denied", 3));
    assert_eq!(p.records_dropped(), 0, "the count went with the drain");
    deny(1);
    let drained = p.drain_records_settled(Duration::from_secs(5));
    assert_eq!((drained.records.len(), drained.dropped), (1, 0));
}
