//! A fleet on one machine for tests and benches: a three-member etcd cluster (Debian's `etcd`, on loopback ports,
//! its data in a temporary directory) and `strata serve` nodes joined to it, as processes; plain HTTP/1.1 and a
//! WebSocket job over raw sockets, so that what is measured is the servers, not a client library. A fleet over
//! mutual TLS ([`Pki`], [`Etcd::start_tls`], [`Node::start_tls`]) is reached with `curl`.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

/// A free loopback port (bound and released: the process given it binds it next).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port()
}

/// The head of one HTTP/1.1 request with a JSON body of `len` bytes, on a connection it closes.
fn head(addr: &str, method: &str, path: &str, len: usize) -> String {
    format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {len}\r\n\
         Connection: close\r\n\r\n"
    )
}

/// A whole response's status, and its body as JSON (`null` when empty or not JSON).
fn parse(response: &[u8]) -> (u16, Value) {
    let response = String::from_utf8_lossy(response);
    let status = response.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    let body = response.split_once("\r\n\r\n").map(|(_, b)| b).unwrap_or_default();
    (status, serde_json::from_str(body).unwrap_or(Value::Null))
}

/// One HTTP/1.1 request on a fresh connection: the status and the body as JSON (`null` when empty or not JSON).
pub fn request(addr: &str, method: &str, path: &str, body: &Value) -> (u16, Value) {
    let body = if body.is_null() { String::new() } else { body.to_string() };
    let mut stream = TcpStream::connect(addr).unwrap_or_else(|e| panic!("connect {addr}: {e}"));
    stream.set_read_timeout(Some(Duration::from_secs(60))).expect("timeout");
    let head = head(addr, method, path, body.len());
    stream.write_all(head.as_bytes()).and_then(|()| stream.write_all(body.as_bytes())).expect("send");
    let mut response = Vec::new();
    let _ = stream.read_to_end(&mut response);
    parse(&response)
}

/// A certificate and its key, as files.
#[derive(Debug, Clone)]
pub struct Identity {
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// A CA in a temporary directory, made with `openssl` the way the README shows operators; it issues
/// certificates for loopback (`IP:127.0.0.1`, `DNS:localhost`) usable as server and client certificates.
#[derive(Debug)]
pub struct Pki {
    dir: tempfile::TempDir,
    issued: std::sync::atomic::AtomicU32,
}

fn openssl(args: &[&str], dir: &Path) {
    let out = Command::new("openssl").args(args).current_dir(dir).output().expect("run openssl");
    assert!(out.status.success(), "openssl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

impl Pki {
    /// A new CA named `name`.
    pub fn new(name: &str) -> Pki {
        let dir = tempfile::tempdir().expect("tempdir");
        let subject = format!("/CN={name}");
        openssl(
            &[
                "req",
                "-x509",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:P-256",
                "-nodes",
                "-keyout",
                "ca.key",
                "-out",
                "ca.pem",
                "-days",
                "30",
                "-subj",
                &subject,
            ],
            dir.path(),
        );
        Pki { dir, issued: std::sync::atomic::AtomicU32::new(0) }
    }

    /// The CA's certificate.
    pub fn ca(&self) -> PathBuf {
        self.dir.path().join("ca.pem")
    }

    /// A new certificate and key for `name` (each call a new key and serial, in new files).
    pub fn issue(&self, name: &str) -> Identity {
        let n = self.issued.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let dir = self.dir.path();
        let base = format!("{name}-{n}");
        let ext = format!("{base}.ext");
        std::fs::write(
            dir.join(&ext),
            "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n\
             basicConstraints=CA:FALSE\nkeyUsage=digitalSignature\n",
        )
        .expect("ext");
        let (key, csr, cert) = (format!("{base}.key"), format!("{base}.csr"), format!("{base}.pem"));
        openssl(
            &[
                "req",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:P-256",
                "-nodes",
                "-keyout",
                &key,
                "-out",
                &csr,
                "-subj",
                &format!("/CN={name}"),
            ],
            dir,
        );
        openssl(
            &[
                "x509",
                "-req",
                "-in",
                &csr,
                "-CA",
                "ca.pem",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-out",
                &cert,
                "-days",
                "30",
                "-extfile",
                &ext,
            ],
            dir,
        );
        Identity { cert: dir.join(cert), key: dir.join(key) }
    }
}

/// One HTTP/1.1 request over TLS on a fresh connection (the server's certificate verified against `ca`, for the
/// name `127.0.0.1`): the status and the body as JSON; status 0 when the handshake or the request failed.
pub fn request_tls(addr: &str, ca: &Path, method: &str, path: &str, body: &Value) -> (u16, Value) {
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls::pki_types::CertificateDer::pem_file_iter(ca).expect("the CA file") {
        roots.add(cert.expect("a CA certificate")).expect("a usable CA");
    }
    #[allow(deprecated)] // ring: the provider the tree already builds (see engine/serve/src/tls.rs)
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_root_certificates(roots)
        .with_no_client_auth();
    let name = rustls::pki_types::ServerName::try_from(addr.rsplit_once(':').map_or(addr, |(h, _)| h).to_owned())
        .expect("a server name");
    let connection = rustls::ClientConnection::new(std::sync::Arc::new(config), name).expect("a TLS client");
    let Ok(tcp) = TcpStream::connect(addr) else { return (0, Value::Null) };
    tcp.set_read_timeout(Some(Duration::from_secs(60))).expect("timeout");
    // The head and the body are two TLS records: without this, the second waits for the server's delayed ACK.
    tcp.set_nodelay(true).expect("nodelay");
    let mut stream = rustls::StreamOwned::new(connection, tcp);
    let body = if body.is_null() { String::new() } else { body.to_string() };
    let head = head(addr, method, path, body.len());
    if stream.write_all(head.as_bytes()).and_then(|()| stream.write_all(body.as_bytes())).is_err() {
        return (0, Value::Null);
    }
    let mut response = Vec::new();
    let _ = stream.read_to_end(&mut response);
    parse(&response)
}

/// A request with `curl` (for TLS): the status and the body as JSON; status 0 and curl's error as a JSON string
/// when no answer came (a refused handshake). `extra` adds curl arguments (`--cacert`, `--cert`, `-H`).
pub fn curl(url: &str, method: &str, body: &Value, extra: &[&str]) -> (u16, Value) {
    let mut command = Command::new("curl");
    command.args([
        "-sS",
        "--max-time",
        "60",
        "-X",
        method,
        "-w",
        "\n%{http_code}",
        "-H",
        "content-type: application/json",
    ]);
    if !body.is_null() {
        command.args(["--data-binary", &body.to_string()]);
    }
    let out = command.args(extra).arg(url).output().expect("run curl");
    let text = String::from_utf8_lossy(&out.stdout);
    let (body, status) = text.rsplit_once('\n').unwrap_or(("", &text));
    let status: u16 = status.trim().parse().unwrap_or(0);
    if status == 0 {
        return (0, Value::String(String::from_utf8_lossy(&out.stderr).into_owned()));
    }
    (status, serde_json::from_str(body).unwrap_or(Value::Null))
}

/// Whether `etcd` can run here; else the one skip line.
pub fn etcd_available() -> bool {
    let found = Command::new("etcd").arg("--version").stdout(Stdio::null()).stderr(Stdio::null()).status();
    if found.is_ok_and(|s| s.success()) {
        return true;
    }
    eprintln!("skip: no etcd on PATH (tests/run installs Debian's etcd-server)");
    false
}

/// A member of the test's etcd cluster.
#[derive(Debug)]
struct Member {
    name: String,
    client: u16,
    peer: u16,
    child: Option<Child>,
}

/// A three-member etcd cluster on loopback, its data in a temporary directory; killed when dropped.
#[derive(Debug)]
pub struct Etcd {
    dir: tempfile::TempDir,
    members: Vec<Member>,
    /// With mutual TLS: the members' certificate (server and peer) and the CA clients' certificates chain to.
    tls: Option<(Identity, PathBuf)>,
}

impl Etcd {
    pub fn start(size: usize) -> Etcd {
        Etcd::launch_all(size, None)
    }

    /// A cluster that serves clients and peers over mutual TLS with certificates of `pki`: a client must present
    /// a certificate of that CA.
    pub fn start_tls(size: usize, pki: &Pki) -> Etcd {
        Etcd::launch_all(size, Some((pki.issue("etcd"), pki.ca())))
    }

    fn scheme(&self) -> &'static str {
        if self.tls.is_some() { "https" } else { "http" }
    }

    /// etcdctl's TLS arguments (its client certificate is the members' own).
    fn ctl_args(&self) -> Vec<String> {
        match &self.tls {
            Some((identity, ca)) => vec![
                format!("--cacert={}", ca.display()),
                format!("--cert={}", identity.cert.display()),
                format!("--key={}", identity.key.display()),
            ],
            None => Vec::new(),
        }
    }

    fn launch_all(size: usize, tls: Option<(Identity, PathBuf)>) -> Etcd {
        let dir = tempfile::tempdir().expect("tempdir");
        let members: Vec<Member> = (0..size)
            .map(|i| Member { name: format!("etcd{i}"), client: free_port(), peer: free_port(), child: None })
            .collect();
        let mut etcd = Etcd { dir, members, tls };
        for i in 0..size {
            etcd.launch(i, "new");
        }
        etcd.wait_healthy(Duration::from_secs(30));
        etcd
    }

    fn initial_cluster(&self) -> String {
        let scheme = self.scheme();
        let each: Vec<String> =
            self.members.iter().map(|m| format!("{}={scheme}://127.0.0.1:{}", m.name, m.peer)).collect();
        each.join(",")
    }

    fn launch(&mut self, i: usize, state: &str) {
        let cluster = self.initial_cluster();
        let member = &self.members[i];
        let data = self.dir.path().join(&member.name);
        let log = std::fs::File::create(self.dir.path().join(format!("{}.log", member.name))).expect("log");
        let scheme = self.scheme();
        let mut command = Command::new("etcd");
        if let Some((identity, ca)) = &self.tls {
            let (cert, key, ca) = (identity.cert.display(), identity.key.display(), ca.display());
            command.args([
                format!("--cert-file={cert}"),
                format!("--key-file={key}"),
                format!("--trusted-ca-file={ca}"),
                "--client-cert-auth".into(),
                format!("--peer-cert-file={cert}"),
                format!("--peer-key-file={key}"),
                format!("--peer-trusted-ca-file={ca}"),
                "--peer-client-cert-auth".into(),
            ]);
        }
        let child = command
            .args(["--name", &member.name, "--data-dir"])
            .arg(&data)
            .args([
                "--listen-client-urls",
                &format!("{scheme}://127.0.0.1:{}", member.client),
                "--advertise-client-urls",
                &format!("{scheme}://127.0.0.1:{}", member.client),
                "--listen-peer-urls",
                &format!("{scheme}://127.0.0.1:{}", member.peer),
                "--initial-advertise-peer-urls",
                &format!("{scheme}://127.0.0.1:{}", member.peer),
                "--initial-cluster",
                &cluster,
                "--initial-cluster-state",
                state,
                "--initial-cluster-token",
                "strata-fleet-test",
                "--heartbeat-interval",
                "50",
                "--election-timeout",
                "500",
            ])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn etcd");
        self.members[i].child = Some(child);
    }

    pub fn endpoints(&self) -> String {
        let scheme = self.scheme();
        let each: Vec<String> = self.members.iter().map(|m| format!("{scheme}://127.0.0.1:{}", m.client)).collect();
        each.join(",")
    }

    /// Waits until a quorum answers a write.
    pub fn wait_healthy(&self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            let ok = Command::new("etcdctl")
                .env("ETCDCTL_API", "3")
                .args(["--endpoints", &self.endpoints(), "--command-timeout=1s"])
                .args(self.ctl_args())
                .args(["put", "/health-probe", "1"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success());
            if ok {
                return;
            }
            assert!(Instant::now() < deadline, "etcd did not become healthy: {}", self.logs());
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    pub fn kill(&mut self, i: usize) {
        if let Some(mut child) = self.members[i].child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    pub fn restart(&mut self, i: usize) {
        self.launch(i, "existing");
    }

    fn logs(&self) -> String {
        let mut out = String::new();
        for m in &self.members {
            let text = std::fs::read_to_string(self.dir.path().join(format!("{}.log", m.name))).unwrap_or_default();
            let tail: Vec<&str> = text.lines().rev().take(5).collect();
            out.push_str(&format!("\n{}: {}", m.name, tail.join("\n  ")));
        }
        out
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        for i in 0..self.members.len() {
            self.kill(i);
        }
    }
}

/// A `strata serve` node of the fleet.
#[derive(Debug)]
pub struct Node {
    /// `127.0.0.1:PORT`.
    pub addr: String,
    child: Option<Child>,
    log: Arc<Mutex<String>>,
    /// The CA its certificate chains to, when it serves over TLS (then reached with `curl`).
    ca: Option<PathBuf>,
}

impl Node {
    /// Starts node `name` of the fleet on `etcd`, running `strata` with `extra` arguments.
    pub fn start(strata: &Path, name: &str, etcd: &Etcd, extra: &[&str]) -> Node {
        Node::start_on(strata, name, etcd, free_port(), extra)
    }

    /// [`Node::start`] on `port`.
    pub fn start_on(strata: &Path, name: &str, etcd: &Etcd, port: u16, extra: &[&str]) -> Node {
        let addr = format!("127.0.0.1:{port}");
        let mut args: Vec<String> =
            ["--cluster", &etcd.endpoints(), "--node", name, "--advertise"].iter().map(|a| (*a).to_owned()).collect();
        args.push(format!("http://{addr}"));
        args.extend(extra.iter().map(|a| (*a).to_owned()));
        Node::spawn(strata, name, addr, &args)
    }

    /// Node `name` of a fleet over mutual TLS: its certificate from `pki` (the fleet CA), https:// URLs.
    pub fn start_tls(strata: &Path, name: &str, etcd: &Etcd, pki: &Pki, extra: &[&str]) -> Node {
        let identity = pki.issue(name);
        Node::start_with(strata, name, etcd, &identity, &pki.ca(), extra)
    }

    /// A node of a fleet over TLS with `identity` and `fleet_ca` as given (a rogue's, for one), on a free port.
    pub fn start_with(
        strata: &Path,
        name: &str,
        etcd: &Etcd,
        identity: &Identity,
        fleet_ca: &Path,
        extra: &[&str],
    ) -> Node {
        let addr = format!("127.0.0.1:{}", free_port());
        let mut args: Vec<String> = vec!["--cluster".into(), etcd.endpoints(), "--node".into(), name.into()];
        args.extend(["--advertise".into(), format!("https://{addr}")]);
        args.extend(["--tls-cert".into(), identity.cert.display().to_string()]);
        args.extend(["--tls-key".into(), identity.key.display().to_string()]);
        args.extend(["--fleet-ca".into(), fleet_ca.display().to_string()]);
        args.extend(extra.iter().map(|a| (*a).to_owned()));
        Node::spawn_tls(strata, name, addr, &args, Some(fleet_ca.to_owned()))
    }

    /// Runs `strata serve` with TLS arguments and returns as soon as it is up or has exited (a node that cannot
    /// join exits): `Err(log)` when it exited.
    pub fn try_start(strata: &Path, name: &str, args: &[String], ca: &Path) -> Result<Node, String> {
        let addr = format!("127.0.0.1:{}", free_port());
        let mut node = Node::launch(strata, addr, args, Some(ca.to_owned()));
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if node.healthy() {
                return Ok(node);
            }
            if let Some(child) = &mut node.child
                && child.try_wait().ok().flatten().is_some()
            {
                std::thread::sleep(Duration::from_millis(200));
                return Err(node.log());
            }
            assert!(Instant::now() < deadline, "node {name} neither started nor exited: {}", node.log());
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// A `strata serve` on its own (no fleet), with `extra` arguments: the peer of fleet figures.
    pub fn standalone(strata: &Path, extra: &[&str]) -> Node {
        let addr = format!("127.0.0.1:{}", free_port());
        let args: Vec<String> = extra.iter().map(|a| (*a).to_owned()).collect();
        Node::spawn(strata, "standalone", addr, &args)
    }

    fn spawn(strata: &Path, name: &str, addr: String, args: &[String]) -> Node {
        Node::spawn_tls(strata, name, addr, args, None)
    }

    fn spawn_tls(strata: &Path, name: &str, addr: String, args: &[String], ca: Option<PathBuf>) -> Node {
        let node = Node::launch(strata, addr, args, ca);
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if node.healthy() {
                return node;
            }
            assert!(Instant::now() < deadline, "node {name} did not start: {}", node.log());
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn healthy(&self) -> bool {
        TcpStream::connect(&self.addr).is_ok() && self.request("GET", "/health", &Value::Null).0 == 204
    }

    /// The node's base URL.
    pub fn url(&self) -> String {
        let scheme = if self.ca.is_some() { "https" } else { "http" };
        format!("{scheme}://{}", self.addr)
    }

    /// A request to the node (plain, or with `curl` trusting its CA); `extra` adds curl arguments over TLS.
    pub fn request_with(&self, method: &str, path: &str, body: &Value, extra: &[&str]) -> (u16, Value) {
        match &self.ca {
            None => request(&self.addr, method, path, body),
            Some(ca) if extra.is_empty() => request_tls(&self.addr, ca, method, path, body),
            Some(ca) => {
                let ca = ca.display().to_string();
                let mut args = vec!["--cacert", ca.as_str()];
                args.extend_from_slice(extra);
                curl(&format!("{}{path}", self.url()), method, body, &args)
            }
        }
    }

    /// A request to the node.
    pub fn request(&self, method: &str, path: &str, body: &Value) -> (u16, Value) {
        self.request_with(method, path, body, &[])
    }

    fn launch(strata: &Path, addr: String, args: &[String], ca: Option<PathBuf>) -> Node {
        let mut child = Command::new(strata)
            .args(["serve", "--listen", &addr])
            .args(args)
            .env_remove("RUST_LOG")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn strata serve");
        let log = Arc::new(Mutex::new(String::new()));
        let stderr = child.stderr.take().expect("stderr");
        let sink = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                sink.lock().expect("log").push_str(&format!("{line}\n"));
            }
        });
        Node { addr, child: Some(child), log, ca }
    }

    /// What the node logged so far.
    pub fn log(&self) -> String {
        self.log.lock().expect("log").clone()
    }

    /// Its port.
    pub fn port(&self) -> u16 {
        self.addr.rsplit_once(':').and_then(|(_, p)| p.parse().ok()).expect("port")
    }

    /// `GET path`.
    pub fn get(&self, path: &str) -> (u16, Value) {
        self.request("GET", path, &Value::Null)
    }

    /// `POST path` with a JSON body.
    pub fn post(&self, path: &str, body: Value) -> (u16, Value) {
        self.request("POST", path, &body)
    }

    /// Creates a wasm sandbox (TTL 120 s).
    pub fn create(&self) -> (u16, Value) {
        self.post("/v1/sandboxes", json!({"tier": "wasm", "ttl": 120}))
    }

    /// SIGKILLs the node.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        if let Some(child) = &self.child {
            let _ = Command::new("kill").args(["-TERM", &child.id().to_string()]).stderr(Stdio::null()).status();
        }
        if let Some(mut child) = self.child.take() {
            let deadline = Instant::now() + Duration::from_secs(20);
            while child.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Runs `code` in sandbox `id` over the exec WebSocket of the node at `addr`; every text message received.
pub fn websocket_job(addr: &str, id: &str, code: &str) -> String {
    let mut stream = TcpStream::connect(addr).expect("connect");
    stream.set_read_timeout(Some(Duration::from_secs(30))).expect("timeout");
    let head = format!(
        "GET /v1/sandboxes/{id}/exec/ws HTTP/1.1\r\nHost: {addr}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
         Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
    );
    stream.write_all(head.as_bytes()).expect("handshake");
    let mut reader = BufReader::new(stream.try_clone().expect("clone"));
    let mut status = String::new();
    reader.read_line(&mut status).expect("status");
    assert!(status.contains(" 101 "), "{status}");
    loop {
        let mut line = String::new();
        reader.read_line(&mut line).expect("header");
        if line == "\r\n" {
            break;
        }
    }
    // One masked text frame with the job.
    let payload = json!({"python": code}).to_string().into_bytes();
    let mut frame = vec![0x81u8];
    let mask = [1u8, 2, 3, 4];
    if payload.len() < 126 {
        frame.push(0x80 | payload.len() as u8);
    } else {
        frame.push(0x80 | 126);
        frame.extend_from_slice(&(payload.len() as u16).to_be_bytes());
    }
    frame.extend_from_slice(&mask);
    frame.extend(payload.iter().enumerate().map(|(i, b)| b ^ mask[i % 4]));
    stream.write_all(&frame).expect("send frame");
    let mut texts = String::new();
    loop {
        let mut head = [0u8; 2];
        if reader.read_exact(&mut head).is_err() {
            break;
        }
        let mut len = u64::from(head[1] & 0x7f);
        if len == 126 {
            let mut ext = [0u8; 2];
            reader.read_exact(&mut ext).expect("len");
            len = u64::from(u16::from_be_bytes(ext));
        } else if len == 127 {
            let mut ext = [0u8; 8];
            reader.read_exact(&mut ext).expect("len");
            len = u64::from_be_bytes(ext);
        }
        let mut data = vec![0u8; usize::try_from(len).expect("len")];
        reader.read_exact(&mut data).expect("payload");
        match head[0] & 0x0f {
            0x1 => texts.push_str(&format!("{}\n", String::from_utf8_lossy(&data))),
            0x8 => break,
            _ => {}
        }
    }
    texts
}
