//! Starting, using and dropping proxies leaves fds, threads and socket files as they were. A binary of its own so
//! no other test's threads or sockets move the counts.

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

mod common;

use std::io::{Read, Write};
use std::net::Shutdown;
use std::time::{Duration, Instant};

use common::{connect, echo_origin, read_all, read_head};
use strata_egress::{Allowlist, EgressConfig, EgressProxy};

fn count(dir: &str) -> usize {
    std::fs::read_dir(dir).map(|d| d.count()).unwrap_or(0)
}

fn settle(want_fds: usize, want_threads: usize) -> (usize, usize) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let now = (count("/proc/self/fd"), count("/proc/self/task"));
        if now == (want_fds, want_threads) || Instant::now() > deadline {
            return now;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn dropping_the_handle_releases_everything() {
    let origin = echo_origin();
    let dir = tempfile::tempdir().unwrap();
    let before = (count("/proc/self/fd"), count("/proc/self/task"));

    for round in 0..5 {
        let path = dir.path().join(format!("egress-{round}.sock"));
        let allow = Allowlist::parse([format!("127.0.0.1:{}", origin.addr.port()), "localhost".into()]).unwrap();
        let workers = if round % 2 == 0 { 1 } else { 2 };
        let p = EgressProxy::start(
            EgressConfig::new(allow)
                .with_tcp("127.0.0.1:0".parse().unwrap())
                .with_unix_socket(&path)
                .with_worker_threads(workers),
        )
        .unwrap();
        // A finished tunnel, a name resolved through the blocking pool, a denied request, and a tunnel still open
        // when the handle is dropped.
        let mut c = connect(&p);
        write!(c, "CONNECT 127.0.0.1:{} HTTP/1.1\r\n\r\n", origin.addr.port()).unwrap();
        assert!(read_head(&mut c).starts_with("HTTP/1.1 200"));
        c.write_all(b"ping").unwrap();
        c.shutdown(Shutdown::Write).unwrap();
        assert_eq!(read_all(&mut c), b"ping");
        drop(c);

        let mut c = connect(&p);
        write!(c, "CONNECT localhost:{} HTTP/1.1\r\n\r\n", origin.addr.port()).unwrap();
        assert!(read_head(&mut c).starts_with("HTTP/1.1 200"));
        drop(c);

        let mut c = connect(&p);
        c.write_all(b"CONNECT example.org:443 HTTP/1.1\r\n\r\n").unwrap();
        assert!(String::from_utf8(read_all(&mut c)).unwrap().starts_with("HTTP/1.1 403"));
        drop(c);

        let mut open = connect(&p);
        write!(open, "CONNECT 127.0.0.1:{} HTTP/1.1\r\n\r\n", origin.addr.port()).unwrap();
        assert!(read_head(&mut open).starts_with("HTTP/1.1 200"));
        open.write_all(b"x").unwrap();
        let mut one = [0u8; 1];
        open.read_exact(&mut one).unwrap();

        let records = p.shutdown();
        assert_eq!(records.len(), 4, "{records:?}");
        assert!(!path.exists(), "socket file removed");
        assert!(read_all(&mut open).is_empty());
        drop(open);
    }

    let after = settle(before.0, before.1);
    // Nothing more than before: a descriptor the test harness itself had open at the start may have closed since.
    assert!(after.0 <= before.0 && after.1 <= before.1, "(fds, threads) before {before:?} and after {after:?}");
}
