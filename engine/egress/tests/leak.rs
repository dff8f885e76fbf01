//! Starting, using and dropping proxies leaves fds, threads and socket files as they were. A binary of its own so
//! no other test's threads or sockets move the counts.

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

mod common;

use std::collections::{BTreeMap, HashSet};
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

/// Where this test's own traffic is: the origin's port and every proxy's, and the proxies' socket directory.
struct Ours {
    ports: HashSet<u16>,
    dir: String,
}

/// The line of `/proc/net/{tcp,tcp6,unix}` for the socket `socket:[inode]`, and which table it is in.
fn socket_line(target: &str) -> Option<(&'static str, String)> {
    let inode = target.strip_prefix("socket:[")?.strip_suffix(']')?;
    for table in ["/proc/net/tcp", "/proc/net/tcp6", "/proc/net/unix"] {
        let text = std::fs::read_to_string(table).unwrap_or_default();
        for line in text.lines().skip(1) {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let at = if table.ends_with("unix") { 6 } else { 9 };
            if fields.get(at) == Some(&inode) {
                return Some((table, line.to_owned()));
            }
        }
    }
    None
}

impl Ours {
    /// Whether the descriptor `target` is the proxies' doing: an anonymous inode (their runtimes' epoll, eventfd),
    /// a TCP socket to or from one of our ports, a Unix socket under our directory. Other sockets (a harness's, a
    /// resolver's) are not.
    fn owns(&self, target: &str) -> bool {
        if target.starts_with("anon_inode:") {
            return true;
        }
        match socket_line(target) {
            Some((table, line)) if table.ends_with("unix") => line.contains(&self.dir),
            Some((_, line)) => {
                let fields: Vec<&str> = line.split_whitespace().collect();
                let port = |field: Option<&&str>| {
                    field.and_then(|a| a.rsplit_once(':')).and_then(|(_, p)| u16::from_str_radix(p, 16).ok())
                };
                [fields.get(1), fields.get(2)].into_iter().any(|f| port(f).is_some_and(|p| self.ports.contains(&p)))
            }
            // Closed meanwhile, or a kind of socket the proxy never makes.
            None => false,
        }
    }

    /// The descriptors open now that were not open (to the same object) before and are the proxies'.
    fn new_fds(&self, before: &BTreeMap<u32, String>) -> Vec<(u32, String)> {
        fds()
            .into_iter()
            .filter(|(fd, target)| before.get(fd) != Some(target))
            .filter(|(_, target)| target.starts_with("socket:") || target.starts_with("anon_inode:"))
            .filter(|(_, target)| self.owns(target))
            .collect()
    }

    fn settle(&self, before_fds: &BTreeMap<u32, String>, before_threads: usize) -> (Vec<(u32, String)>, usize) {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let now = (self.new_fds(before_fds), threads());
            if (now.0.is_empty() && now.1 <= before_threads) || Instant::now() > deadline {
                return now;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

#[test]
fn dropping_the_handle_releases_everything() {
    let origin = echo_origin();
    let dir = tempfile::tempdir().unwrap();
    let mut ours = Ours { ports: HashSet::from([origin.addr.port()]), dir: dir.path().display().to_string() };
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
        ours.ports.insert(p.tcp_addr().unwrap().port());
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

    let (leaked, after_threads) = ours.settle(&before_fds, before_threads);
    let describe =
        |target: &str| socket_line(target).map_or_else(|| target.to_owned(), |(t, line)| format!("{t}: {line}"));
    for (fd, target) in fds() {
        if before_fds.get(&fd) != Some(&target) && target.starts_with("socket:") && !ours.owns(&target) {
            eprintln!("note: descriptor {fd} is a socket this test did not make: {}", describe(&target));
        }
    }
    let described: Vec<String> = leaked.iter().map(|(fd, target)| format!("{fd}: {}", describe(target))).collect();
    assert!(leaked.is_empty(), "descriptors left open: {described:#?} (open before: {before_fds:?})");
    assert!(after_threads <= before_threads, "threads before {before_threads} and after {after_threads}");
}
