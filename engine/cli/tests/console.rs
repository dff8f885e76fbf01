//! The console (`/ui/`) in a real browser: Debian's Chromium, headless, driven by playwright-core
//! (`engine/serve/ui/tests/console.mjs`) against a `strata serve` with API keys started here. The page takes a
//! key once, lists a sandbox made through the API, types into its terminal, uploads a file, runs a job, shows
//! every page (a screenshot of each), and kills the sandbox; this test then checks through the API what the
//! page did. Screenshots go to `$CARGO_TARGET_TMPDIR/console/`; with `STRATA_UPDATE_SCREENSHOTS=1` the sandbox
//! page's also replaces `docs/console-sandbox.png`, which the README shows.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::{Value, json};
use strata_benches::fleet::Node;

const KEY: &str = "console-test-key-0123456789";

fn ui_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../serve/ui")
}

fn chromium() -> Option<PathBuf> {
    ["/usr/bin/chromium", "/usr/bin/chromium-browser"].iter().map(PathBuf::from).find(|p| p.exists())
}

/// `GET path` with the key; the status and body as text.
fn get(node: &Node, path: &str) -> (u16, String, Vec<(String, String)>) {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(&node.addr).expect("connect");
    let head = format!(
        "GET {path} HTTP/1.1\r\nHost: {}\r\nAuthorization: Bearer {KEY}\r\nConnection: close\r\n\r\n",
        node.addr
    );
    stream.write_all(head.as_bytes()).expect("send");
    let mut response = Vec::new();
    let _ = stream.read_to_end(&mut response);
    let response = String::from_utf8_lossy(&response).into_owned();
    let (head, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
    let status = head.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    let headers = head
        .lines()
        .skip(1)
        .filter_map(|l| l.split_once(": ").map(|(n, v)| (n.to_ascii_lowercase(), v.to_owned())))
        .collect();
    (status, body.to_owned(), headers)
}

fn post(node: &Node, path: &str, body: &Value) -> (u16, Value) {
    use std::io::{Read, Write};
    let body = body.to_string();
    let mut stream = std::net::TcpStream::connect(&node.addr).expect("connect");
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: {}\r\nAuthorization: Bearer {KEY}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        node.addr,
        body.len()
    );
    stream.write_all(head.as_bytes()).expect("send");
    let mut response = String::new();
    let _ = stream.read_to_string(&mut response);
    let status = response.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    let body = response.split_once("\r\n\r\n").map(|(_, b)| b).unwrap_or_default();
    (status, serde_json::from_str(body).unwrap_or(Value::Null))
}

#[test]
fn the_console_drives_a_sandbox_in_a_real_browser() {
    let Some(chromium) = chromium() else {
        eprintln!("skip: no Chromium (tests/run installs Debian's chromium)");
        return;
    };
    if !ui_dir().join("node_modules/playwright-core").exists() {
        eprintln!("skip: the console's npm packages are not installed (tests/run runs npm ci in engine/serve/ui)");
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let keys = dir.path().join("keys.toml");
    let hash = strata_serve::auth::hash_key(KEY);
    std::fs::write(&keys, format!("[[key]]\nname = \"console\"\nsha256 = \"{hash}\"\n")).expect("keys");
    let strata = Path::new(env!("CARGO_BIN_EXE_strata"));
    let node = Node::standalone(strata, &["--keys", keys.to_str().expect("path")]);

    // The console is built into this binary, with its policy.
    let (status, body, headers) = get(&node, "/ui/");
    assert_eq!(status, 200, "{body}");
    assert!(
        body.contains("app.js"),
        "the console is not built into this strata (npm run build in engine/serve/ui): {body}"
    );
    let csp = headers.iter().find(|(n, _)| n == "content-security-policy").map(|(_, v)| v.clone()).unwrap_or_default();
    assert!(csp.contains("script-src 'self';"), "{csp}");
    assert!(!body.contains("<script>"), "no inline script");

    let (status, created) = post(&node, "/v1/sandboxes", &json!({"tier": "process", "ttl": 600}));
    if status == 503 || created["error"]["code"] == "tier_unavailable" {
        eprintln!("skip: the process tier cannot run here: {created}");
        return;
    }
    assert_eq!(status, 201, "{created}");
    let id = created["id"].as_str().expect("id").to_owned();

    let shots = Path::new(env!("CARGO_TARGET_TMPDIR")).join("console");
    let _ = std::fs::remove_dir_all(&shots);
    let output = Command::new("node")
        .arg(ui_dir().join("tests/console.mjs"))
        .current_dir(ui_dir())
        .env("STRATA_URL", format!("http://{}", node.addr))
        .env("STRATA_KEY", KEY)
        .env("SANDBOX_ID", &id)
        .env("SCREENSHOTS", &shots)
        .env("CHROMIUM", &chromium)
        .output()
        .expect("run node");
    let (stdout, stderr) = (String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    assert!(
        output.status.success() && stdout.contains("CONSOLE OK"),
        "stdout: {stdout}\nstderr: {stderr}\nscreenshots in {}\nserver log:\n{}",
        shots.display(),
        node.log()
    );
    for page in ["sandboxes", "sandbox", "snapshots", "images", "nodes", "health"] {
        let shot = shots.join(format!("{page}.png"));
        assert!(std::fs::metadata(&shot).is_ok_and(|m| m.len() > 10_000), "{} missing", shot.display());
    }
    eprintln!("console screenshots: {}", shots.display());
    if std::env::var_os("STRATA_UPDATE_SCREENSHOTS").is_some() {
        let docs = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/console-sandbox.png");
        std::fs::copy(shots.join("sandbox.png"), &docs).expect("copy the screenshot");
    }

    // What the page did, through the API: the file it uploaded was in the sandbox (the job it ran printed it),
    // the terminal's command ran there, and the sandbox is gone.
    let log = node.log();
    assert!(log.contains("method=PUT path=/v1/sandboxes/") && log.contains("status=204"), "{log}");
    let (status, body, _) = get(&node, &format!("/v1/sandboxes/{id}"));
    assert_eq!(status, 404, "killed from the page: {body}");
}
