//! Starting, using and dropping proxies leaves fds, threads and socket files as they were. A binary of its own so
//! no other test's threads or sockets move the counts.

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

mod common;

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::Shutdown;
use std::time::{Duration, Instant};

use common::{connect, echo_origin, read_all, read_head};
use strata_egress::{Allowlist, EgressConfig, EgressProxy};

fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").map(|d| d.count()).unwrap_or(0)
}

/// Every open descriptor and what it points at (`socket:[…]`, `anon_inode:[eventpoll]`, a path).
fn fds() -> BTreeMap<u32, String> {
    let mut out = BTreeMap::new();
    for e in std::fs::read_dir("/proc/self/fd").unwrap().flatten() {
        let Some(fd) = e.file_name().to_str().and_then(|n| n.parse().ok()) else { continue };
        if let Ok(target) = std::fs::read_link(e.path()) {
            out.insert(fd, target.display().to_string());
        }
    }
    out
}

/// The descriptors open now that were not open (to the same object) before and are of a kind the proxy makes:
/// sockets and anonymous inodes (epoll, eventfd, timerfd). The test harness's own files and pipes, which it may open
/// or close meanwhile, are not the proxy's.
fn new_proxy_fds(before: &BTreeMap<u32, String>) -> Vec<(u32, String)> {
    fds()
        .into_iter()
        .filter(|(fd, target)| before.get(fd) != Some(target))
        .filter(|(_, target)| target.starts_with("socket:") || target.starts_with("anon_inode:"))
        .collect()
}

fn settle(before_fds: &BTreeMap<u32, String>, before_threads: usize) -> (Vec<(u32, String)>, usize) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let now = (new_proxy_fds(before_fds), threads());
        if (now.0.is_empty() && now.1 <= before_threads) || Instant::now() > deadline {
            return now;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn dropping_the_handle_releases_everything() {
    let origin = echo_origin();
    let dir = tempfile::tempdir().unwrap();
    let (before_fds, before_threads) = (fds(), threads());

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

    let (leaked, after_threads) = settle(&before_fds, before_threads);
    assert!(leaked.is_empty(), "descriptors left open: {leaked:?} (open before: {before_fds:?})");
    assert!(after_threads <= before_threads, "threads before {before_threads} and after {after_threads}");
}
