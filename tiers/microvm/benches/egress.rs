//! Throughput of the microVM's network egress path (docs/DESIGN.md §3; the target is ≥ 100 MB/s through the vsock
//! tunnel): a client downloads from (then uploads to) a loopback HTTP origin through
//!
//! ```text
//! client → agent forwarder (127.0.0.1) → "guest kernel" → vsock device model → egress proxy → origin
//! ```
//!
//! — the agent's real forwarder (`strata_agent::egress`), the real vsock device and its muxer (which connects the
//! guest's stream to port 1028 to the proxy's Unix socket `<uds>_1028`), the real proxy. The guest kernel's vsock
//! stack is this bench's thread: it takes the forwarder's stream (a Unix socket, as when the agent runs as a host
//! process) and carries its bytes as vsock packets through the in-process guest driver of `strata_vmm::test_utils`,
//! giving credit as it writes them on. The peer, measured in the same run: the same transfer through the same
//! proxy reached directly over TCP (no tunnel). Both print MB/s and the ratio.
//!
//! `STRATA_BENCH_MB` sets the bytes per figure (default 512).

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::unix::net::UnixListener;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use strata_agent::egress::{EgressDial, Forwarder};
use strata_benches::bulk_origin;
use strata_egress::{Allowlist, EgressConfig, EgressProxy};
use strata_guest_proto::EGRESS_PORT;
use strata_tier_microvm::devices::virtio::vsock::{VsockConfig, VsockDevice};
use strata_vmm::test_utils::driver::*;

const GUEST_CID: u64 = 3;
const GUEST_PORT: u32 = 50_000;
const PACKET: u32 = 64 * 1024;
/// The guest's receive buffer for the connection (`buf_alloc`), as a Linux guest advertises it.
const GUEST_BUF: u32 = 4 << 20;
const TARGET_MB_S: f64 = 100.0;

fn mb_s(bytes: u64, elapsed: Duration) -> f64 {
    bytes as f64 / elapsed.as_secs_f64() / 1e6
}

/// Which way the payload goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Way {
    /// The origin answers `total` bytes.
    Download,
    /// The client sends `total` bytes (a POST body); the origin answers `200` once it has them all.
    Upload,
}

/// Fetches (or posts `total` bytes to) `http://127.0.0.1:<origin>/` through the HTTP proxy at `proxy`; returns
/// the bytes received (head included) and when the answer ended.
fn client(proxy: u16, origin: u16, total: u64, way: Way) -> JoinHandle<(u64, Instant)> {
    std::thread::spawn(move || {
        let mut s = TcpStream::connect(("127.0.0.1", proxy)).expect("connect to the proxy");
        let request = match way {
            Way::Download => format!("GET http://127.0.0.1:{origin}/ HTTP/1.1\r\nHost: 127.0.0.1:{origin}\r\n\r\n"),
            Way::Upload => format!(
                "POST http://127.0.0.1:{origin}/ HTTP/1.1\r\nHost: 127.0.0.1:{origin}\r\nContent-Length: {total}\r\n\r\n"
            ),
        };
        s.write_all(request.as_bytes()).expect("request");
        if way == Way::Upload {
            let chunk = vec![0xa5u8; 256 * 1024];
            let mut left = total;
            while left > 0 {
                let n = left.min(chunk.len() as u64) as usize;
                s.write_all(&chunk[..n]).expect("upload");
                left -= n as u64;
            }
        }
        let mut buf = vec![0u8; 1 << 20];
        let mut got = 0u64;
        loop {
            match s.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => got += n as u64,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => panic!("client: {e}"),
            }
        }
        (got, Instant::now())
    })
}

/// The client's received bytes must be the whole answer.
fn check(got: u64, total: u64, way: Way) {
    match way {
        Way::Download => assert!(got > total, "{got} bytes"),
        Way::Upload => assert!(got > 0 && got < 1024, "{got} bytes"),
    }
}

/// The peer: the proxy reached over TCP directly.
fn direct(total: u64, way: Way) -> f64 {
    let origin_port = bulk_origin(total).expect("origin");
    let allow = Allowlist::parse([format!("127.0.0.1:{origin_port}")]).expect("allowlist");
    let proxy =
        EgressProxy::start(EgressConfig::new(allow).with_tcp("127.0.0.1:0".parse().expect("addr"))).expect("proxy");
    let port = proxy.tcp_addr().expect("tcp").port();
    let start = Instant::now();
    let (got, end) = client(port, origin_port, total, way).join().expect("client");
    check(got, total, way);
    mb_s(total, end - start)
}

/// Through the tunnel.
fn tunnel(total: u64, way: Way) -> f64 {
    let origin_port = bulk_origin(total).expect("origin");
    let dir = tempfile::tempdir().expect("tempdir");
    let uds = dir.path().join("v.sock");
    let allow = Allowlist::parse([format!("127.0.0.1:{origin_port}")]).expect("allowlist");
    let proxy_socket = dir.path().join(format!("v.sock_{EGRESS_PORT}"));
    let _proxy = EgressProxy::start(EgressConfig::new(allow).with_unix_socket(&proxy_socket)).expect("proxy");

    // The forwarder dials `<agent.sock>_1028`: the bench's guest kernel takes that stream.
    let agent_socket = dir.path().join("agent.sock");
    let kernel_side = UnixListener::bind(dir.path().join(format!("agent.sock_{EGRESS_PORT}"))).expect("bind");
    let listen = TcpListener::bind("127.0.0.1:0").expect("free port").local_addr().expect("addr").port();
    let forwarder = Forwarder::start(EgressDial::Unix(agent_socket), listen, EGRESS_PORT, 64).expect("forwarder");

    let mem = memory();
    let device = VsockDevice::new(VsockConfig { guest_cid: GUEST_CID, uds_path: uds }).expect("vsock device");
    let mut d = Driver::new(&mem, device);
    d.init(3, 256);
    let mut guest = VsockGuest::new(GUEST_CID, PACKET);
    guest.post_rx(&mut d, 64);
    d.notify(RX);

    let start = Instant::now();
    let client = client(listen, origin_port, total, way);
    let (mut app, _) = kernel_side.accept().expect("the forwarder's stream");
    app.set_nonblocking(true).expect("nonblocking");

    // connect(2) to the host's port 1028: REQUEST, the muxer connects to the proxy, RESPONSE.
    let mut request = guest.hdr(OP_REQUEST, GUEST_PORT, EGRESS_PORT);
    request.buf_alloc = GUEST_BUF;
    guest.send(&mut d, request, &[]);
    let mut peer_alloc = 0u32;
    d.pump_until(|d| {
        guest.recv(d).iter().any(|p| {
            peer_alloc = p.hdr.buf_alloc;
            p.hdr.op == OP_RESPONSE
        })
    });

    let (mut sent, mut peer_fwd) = (0u32, 0u32);
    let (mut written, mut reported) = (0u64, 0u64);
    let mut pending: Vec<u8> = Vec::new();
    let mut app_eof = false;
    let mut buf = vec![0u8; PACKET as usize];
    while !client.is_finished() {
        let mut progress = false;
        // Application → host (the request): as much as the host's credit allows.
        let credit = peer_alloc.saturating_sub(sent.wrapping_sub(peer_fwd)).min(PACKET) as usize;
        if !app_eof && credit > 0 {
            match app.read(&mut buf[..credit]) {
                Ok(0) => {
                    app_eof = true;
                    let mut shutdown = guest.hdr(OP_SHUTDOWN, GUEST_PORT, EGRESS_PORT);
                    shutdown.flags = 2;
                    shutdown.buf_alloc = GUEST_BUF;
                    shutdown.fwd_cnt = written as u32;
                    guest.send(&mut d, shutdown, &[]);
                }
                Ok(n) => {
                    let mut hdr = guest.hdr(OP_RW, GUEST_PORT, EGRESS_PORT);
                    hdr.len = n as u32;
                    hdr.buf_alloc = GUEST_BUF;
                    hdr.fwd_cnt = written as u32;
                    guest.send(&mut d, hdr, &buf[..n]);
                    sent = sent.wrapping_add(n as u32);
                    progress = true;
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                Err(e) => panic!("forwarder stream: {e}"),
            }
            d.queues[TX as usize].take_used();
        }
        // Host → application (the download).
        d.transport().process_backend();
        for p in guest.recv(&mut d) {
            peer_fwd = p.hdr.fwd_cnt;
            peer_alloc = p.hdr.buf_alloc;
            match p.hdr.op {
                OP_RW => {
                    pending.extend_from_slice(&p.data);
                    progress = true;
                }
                OP_SHUTDOWN | OP_RST => {
                    // Deliver what is left, then end the application's stream.
                    app.set_nonblocking(false).expect("blocking");
                    app.write_all(&pending).expect("forwarder stream");
                    written += pending.len() as u64;
                    pending.clear();
                    let _ = app.shutdown(Shutdown::Write);
                    app.set_nonblocking(true).expect("nonblocking");
                }
                _ => {}
            }
        }
        while !pending.is_empty() {
            match app.write(&pending) {
                Ok(n) => {
                    pending.drain(..n);
                    written += n as u64;
                    progress = true;
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(_) => {
                    pending.clear();
                    break;
                }
            }
        }
        if written - reported >= 1 << 20 {
            reported = written;
            let mut update = guest.hdr(OP_CREDIT_UPDATE, GUEST_PORT, EGRESS_PORT);
            update.buf_alloc = GUEST_BUF;
            update.fwd_cnt = written as u32;
            guest.send(&mut d, update, &[]);
            d.queues[TX as usize].take_used();
        }
        if !progress {
            std::thread::yield_now();
        }
    }
    let (got, end) = client.join().expect("client");
    check(got, total, way);
    forwarder.stop();
    mb_s(total, end - start)
}

fn main() {
    let mb: u64 = std::env::var("STRATA_BENCH_MB").ok().and_then(|v| v.parse().ok()).unwrap_or(512);
    let total = mb << 20;
    println!("egress through the tunnel, {mb} MiB per figure (loopback origin; the guest kernel is this thread)");
    for (name, way) in [("download", Way::Download), ("upload", Way::Upload)] {
        tunnel(32 << 20, way);
        direct(32 << 20, way);
        let peer = direct(total, way);
        let strata = tunnel(total, way);
        let verdict = if strata >= TARGET_MB_S { "met" } else { "MISSED" };
        println!(
            "{:<44} {strata:>8.0} MB/s   {:<14} {peer:>8.0} MB/s   ratio {:>5.2}   target ≥ {TARGET_MB_S:.0} MB/s: {verdict}",
            format!("{name}: forwarder → vsock device → proxy"),
            "proxy direct",
            strata / peer
        );
    }
}
