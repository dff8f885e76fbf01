//! Throughput through a CONNECT tunnel, loopback client → proxy → loopback sink, against the same transfer sent
//! straight to the sink in the same run. Prints MB/s for both and the ratio (target: ≥ 500 MB/s through the proxy).
//!
//! `cargo bench -p strata-egress --bench throughput [-- MIB]` (default 2048 MiB per run, best of 3).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use strata_egress::{Allowlist, EgressConfig, EgressProxy};

const CHUNK: usize = 256 * 1024;

/// A sink that reads every connection to EOF, then replies with one byte (so the sender knows all arrived).
fn sink() -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind sink");
    let addr = l.local_addr().expect("sink addr");
    std::thread::spawn(move || {
        for s in l.incoming() {
            let Ok(mut s) = s else { continue };
            std::thread::spawn(move || {
                let mut buf = vec![0u8; CHUNK];
                while let Ok(n @ 1..) = s.read(&mut buf) {
                    let _ = n;
                }
                let _ = s.write_all(b"k");
            });
        }
    });
    addr
}

/// Sends `total` bytes on `s`, half-closes, waits for the sink's reply; returns MB/s (10^6 bytes).
fn send(mut s: TcpStream, total: u64) -> f64 {
    s.set_nodelay(true).expect("nodelay");
    let buf = vec![0x5au8; CHUNK];
    let start = Instant::now();
    let mut left = total;
    while left > 0 {
        let n = left.min(CHUNK as u64) as usize;
        s.write_all(&buf[..n]).expect("write");
        left -= n as u64;
    }
    s.shutdown(std::net::Shutdown::Write).expect("shutdown");
    let mut k = [0u8; 1];
    s.read_exact(&mut k).expect("sink reply");
    total as f64 / start.elapsed().as_secs_f64() / 1e6
}

fn through_proxy(proxy: SocketAddr, sink: SocketAddr) -> TcpStream {
    let mut s = TcpStream::connect(proxy).expect("connect proxy");
    write!(s, "CONNECT {sink} HTTP/1.1\r\n\r\n").expect("connect request");
    let mut head = Vec::new();
    let mut b = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        s.read_exact(&mut b).expect("proxy reply");
        head.push(b[0]);
    }
    assert!(head.starts_with(b"HTTP/1.1 200"), "{}", String::from_utf8_lossy(&head));
    s
}

fn main() {
    let mib: u64 = std::env::args().skip(1).find_map(|a| a.parse().ok()).unwrap_or(2048);
    let total = mib * 1024 * 1024;
    let sink = sink();
    let proxy = EgressProxy::start(
        EgressConfig::new(Allowlist::parse([sink.to_string()]).expect("allowlist"))
            .with_tcp("127.0.0.1:0".parse().expect("addr"))
            .with_idle_timeout(Duration::from_secs(30)),
    )
    .expect("start proxy");
    let paddr = proxy.tcp_addr().expect("tcp");

    let mut direct = Vec::new();
    let mut proxied = Vec::new();
    for _ in 0..3 {
        direct.push(send(TcpStream::connect(sink).expect("connect sink"), total));
        proxied.push(send(through_proxy(paddr, sink), total));
    }
    let best = |v: &[f64]| v.iter().copied().fold(0.0, f64::max);
    let (d, p) = (best(&direct), best(&proxied));
    println!("egress_connect_throughput  {mib} MiB x3, best run");
    println!("  direct loopback          {d:>9.0} MB/s   runs {direct:.0?}");
    println!("  through strata-egress    {p:>9.0} MB/s   runs {proxied:.0?}");
    println!(
        "  ratio strata/direct      {:.2}x  (target >= 500 MB/s: {})",
        p / d,
        if p >= 500.0 { "met" } else { "MISSED" }
    );
    let records = proxy.drain_records_settled(Duration::from_secs(5)).records;
    let up: u64 = records.iter().map(|r| r.bytes_up).sum();
    assert_eq!(up, 3 * total, "the log counts every byte");
}
