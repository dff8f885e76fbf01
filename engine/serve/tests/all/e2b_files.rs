//! envd's `/files` beyond plain bytes: gzip both ways and signed URLs, through both pinned SDKs and by hand (a
//! tampered, misused or expired signature; a gzip bomb).

use std::io::Write as _;
use std::time::{SystemTime, UNIX_EPOCH};

use base64::Engine as _;
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::e2b::{both_sdks, create_e2b};
use crate::util::{TestServer, process_tier};

/// gzip through the SDKs: 1 MiB of binary and some text written with `gzip=True` and read back with and without
/// it (the bytes match what the sandbox itself sees).
const GZIP_SCRIPT: &str = r#"
import hashlib
from e2b import Sandbox
sbx = Sandbox.create()
data = bytes(range(256)) * 4096
info = sbx.files.write("/tmp/gz.bin", data, gzip=True)
assert info.path == "/tmp/gz.bin", info
assert bytes(sbx.files.read("/tmp/gz.bin", format="bytes", gzip=True)) == data
assert bytes(sbx.files.read("/tmp/gz.bin", format="bytes")) == data
assert sbx.commands.run("sha256sum /tmp/gz.bin").stdout.split()[0] == hashlib.sha256(data).hexdigest()
text = "héllo, gzip\n" * 1000
sbx.files.write("gz.txt", text, gzip=True)
assert sbx.files.read("/home/user/gz.txt", gzip=True) == text
assert b"".join(sbx.files.read("gz.txt", format="stream", gzip=True)) == text.encode()
sbx.kill()
print("GZIP OK")
"#;

const JS_GZIP_SCRIPT: &str = r#"
import { Sandbox } from 'e2b'
import { createHash } from 'node:crypto'
const check = (ok, what) => { if (!ok) { console.error(what); process.exit(1) } }
const sbx = await Sandbox.create()
const data = new Uint8Array(1 << 20).map((_, i) => i % 256)
const info = await sbx.files.write('/tmp/gz.bin', data, { gzip: true })
check(info.path === '/tmp/gz.bin', `write: ${JSON.stringify(info)}`)
const same = (got) => Buffer.from(got).equals(Buffer.from(data))
check(same(await sbx.files.read('/tmp/gz.bin', { format: 'bytes', gzip: true })), 'read with gzip')
check(same(await sbx.files.read('/tmp/gz.bin', { format: 'bytes' })), 'read without gzip')
const sum = (await sbx.commands.run('sha256sum /tmp/gz.bin')).stdout.split(' ')[0]
check(sum === createHash('sha256').update(data).digest('hex'), `the sandbox sees other bytes: ${sum}`)
const text = 'héllo, gzip\n'.repeat(1000)
await sbx.files.write('gz.txt', text, { gzip: true })
check((await sbx.files.read('/home/user/gz.txt', { gzip: true })) === text, 'text with gzip')
await sbx.kill()
console.log('JS GZIP OK')
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e2b_sdks_write_and_read_files_with_gzip() {
    if !process_tier("e2b_sdks_write_and_read_files_with_gzip") {
        return;
    }
    let server = TestServer::start().await;
    both_sdks(&server, GZIP_SCRIPT, "GZIP OK", JS_GZIP_SCRIPT, "gzip.mjs", "JS GZIP OK").await;
    server.stop().await;
}

/// Signed URLs through the SDKs: `upload_url`/`download_url` (with and without an expiration, as the default user
/// and as root with a relative path) used by a plain HTTP client that carries no token, only the routing header a
/// shared host needs; a read URL does not write, and a URL without its signature is refused.
const SIGNED_SCRIPT: &str = r#"
import os
import httpx
from e2b import Sandbox
sbx = Sandbox.create()
plain = httpx.Client(headers={"E2b-Sandbox-Id": sbx.sandbox_id})
up = sbx.upload_url("/tmp/signed.txt")
assert "signature=v1_" in up and "signature_expiration" not in up, up
r = plain.post(up, files={"file": ("signed.txt", b"signed body")})
assert r.status_code == 200, (r.status_code, r.text)
assert sbx.files.read("/tmp/signed.txt") == "signed body"
down = sbx.download_url("/tmp/signed.txt", use_signature_expiration=60)
assert "signature_expiration=" in down, down
r = plain.get(down)
assert (r.status_code, r.content) == (200, b"signed body"), (r.status_code, r.text)
up = sbx.upload_url("signed-root.txt", user="root", use_signature_expiration=60)
r = plain.post(up, content=b"root's", headers={"Content-Type": "application/octet-stream"})
assert r.status_code == 200 and r.json()[0]["path"] == "/root/signed-root.txt", (r.status_code, r.text)
down = sbx.download_url("signed-root.txt", user="root")
assert plain.get(down).content == b"root's"
r = plain.post(down, content=b"x", headers={"Content-Type": "application/octet-stream"})
assert r.status_code == 401 and r.json()["code"] == 401, (r.status_code, r.text)
r = plain.get(os.environ["E2B_SANDBOX_URL"] + "/files?path=/tmp/signed.txt")
assert r.status_code == 401, (r.status_code, r.text)
sbx.kill()
print("SIGNED OK")
"#;

const JS_SIGNED_SCRIPT: &str = r#"
import { Sandbox } from 'e2b'
const check = (ok, what) => { if (!ok) { console.error(what); process.exit(1) } }
const sbx = await Sandbox.create()
const headers = { 'E2b-Sandbox-Id': sbx.sandboxId }
const up = await sbx.uploadUrl('/tmp/signed.txt')
check(up.includes('signature=v1_') && !up.includes('signature_expiration'), `uploadUrl: ${up}`)
const form = new FormData()
form.append('file', new Blob(['signed body']), 'signed.txt')
let r = await fetch(up, { method: 'POST', body: form, headers })
check(r.status === 200, `upload: ${r.status} ${await r.text()}`)
check((await sbx.files.read('/tmp/signed.txt')) === 'signed body', 'uploaded bytes')
const down = await sbx.downloadUrl('/tmp/signed.txt', { useSignatureExpiration: 60 })
check(down.includes('signature_expiration='), `downloadUrl: ${down}`)
r = await fetch(down, { headers })
check(r.status === 200 && (await r.text()) === 'signed body', `download: ${r.status}`)
const rootUp = await sbx.uploadUrl('signed-root.txt', { user: 'root', useSignatureExpiration: 60 })
r = await fetch(rootUp, { method: 'POST', body: "root's", headers: { ...headers, 'Content-Type': 'application/octet-stream' } })
check(r.status === 200 && (await r.json())[0].path === '/root/signed-root.txt', `root upload: ${r.status}`)
const rootDown = await sbx.downloadUrl('signed-root.txt', { user: 'root' })
check((await (await fetch(rootDown, { headers })).text()) === "root's", 'root download')
r = await fetch(rootDown, { method: 'POST', body: 'x', headers: { ...headers, 'Content-Type': 'application/octet-stream' } })
check(r.status === 401, `a read URL wrote: ${r.status}`)
r = await fetch(process.env.E2B_SANDBOX_URL + '/files?path=/tmp/signed.txt', { headers })
check(r.status === 401, `no signature: ${r.status}`)
await sbx.kill()
console.log('JS SIGNED OK')
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e2b_sdk_signed_urls_work_without_a_token() {
    if !process_tier("e2b_sdk_signed_urls_work_without_a_token") {
        return;
    }
    let server = TestServer::start().await;
    both_sdks(&server, SIGNED_SCRIPT, "SIGNED OK", JS_SIGNED_SCRIPT, "signed.mjs", "JS SIGNED OK").await;
    server.stop().await;
}

/// envd's signature, computed here independently of the server: `v1_` and the unpadded standard base64 of the
/// SHA-256 of `path:operation:user:token[:expiration]`.
fn sign(path: &str, operation: &str, user: &str, token: &str, expiration: Option<u64>) -> String {
    let mut text = format!("{path}:{operation}:{user}:{token}");
    if let Some(expiration) = expiration {
        text += &format!(":{expiration}");
    }
    format!("v1_{}", base64::engine::general_purpose::STANDARD_NO_PAD.encode(Sha256::digest(text.as_bytes())))
}

/// A query string of these pairs, each value percent-encoded.
fn query(pairs: &[(&str, &str)]) -> String {
    let encode = |value: &str| {
        value
            .bytes()
            .map(|b| match b {
                b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => (b as char).to_string(),
                _ => format!("%{b:02X}"),
            })
            .collect::<String>()
    };
    pairs.iter().map(|(key, value)| format!("{key}={}", encode(value))).collect::<Vec<_>>().join("&")
}

fn now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).expect("after 1970").as_secs()
}

/// A gzip body that inflates to `members` MiB of zeros: one member compressed from 64 KiB chunks, repeated (gzip
/// members concatenate), so neither side of the test holds the inflated bytes.
fn gzip_bomb(members: usize) -> Vec<u8> {
    let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
    let chunk = [0u8; 64 << 10];
    for _ in 0..16 {
        encoder.write_all(&chunk).expect("compress");
    }
    let member = encoder.finish().expect("gzip");
    member.repeat(members)
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    encoder.write_all(bytes).expect("compress");
    encoder.finish().expect("gzip")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e2b_files_signatures_and_gzip_by_hand() {
    if !process_tier("e2b_files_signatures_and_gzip_by_hand") {
        return;
    }
    let server = TestServer::with(|config| {
        config.connections.max_body = 8 << 20;
        config.domain = Some("strata.test".into());
    })
    .await;
    let (id, token) = create_e2b(&server).await;
    let files = |method: reqwest::Method, query: &str| {
        server.client.request(method, server.url(&format!("/files?{query}"))).header("E2b-Sandbox-Id", &id)
    };
    let status_json = |response: reqwest::Response| async move {
        let status = response.status().as_u16();
        (status, response.json::<Value>().await.expect("json"))
    };

    // With the token: a gzipped upload, read back gzipped when asked for and plain otherwise.
    let text = b"gzip by hand\n".repeat(500);
    let response = files(reqwest::Method::POST, "path=%2Ftmp%2Fhand.txt")
        .header("X-Access-Token", &token)
        .header("Content-Type", "application/octet-stream")
        .header("Content-Encoding", "gzip")
        .body(gzip(&text))
        .send()
        .await
        .expect("upload");
    assert_eq!(response.status().as_u16(), 200, "{:?}", response.text().await);
    let read = |accept: Option<&str>| {
        let request = files(reqwest::Method::GET, "path=%2Ftmp%2Fhand.txt").header("X-Access-Token", &token);
        match accept {
            Some(accept) => request.header("Accept-Encoding", accept.to_owned()),
            None => request,
        }
        .send()
    };
    let gzipped = read(Some("gzip")).await.expect("read");
    assert_eq!(gzipped.headers().get("content-encoding").map(|v| v.as_bytes()), Some(&b"gzip"[..]));
    let body = gzipped.bytes().await.expect("body");
    assert!(body.len() < text.len() / 10, "{} bytes", body.len());
    let mut plain = Vec::new();
    std::io::Read::read_to_end(&mut flate2::read::GzDecoder::new(&body[..]), &mut plain).expect("gunzip");
    assert_eq!(plain, text);
    let identity = read(None).await.expect("read");
    assert!(identity.headers().get("content-encoding").is_none());
    assert_eq!(identity.bytes().await.expect("body"), text);
    let refused = read(Some("br, identity;q=0")).await.expect("read");
    assert_eq!(refused.status().as_u16(), 400);

    // Signed, without a token: good ones pass (by the header, or by a Host name of the server's domain).
    let path = "/tmp/hand.txt";
    let signed_read = sign(path, "read", "", &token, None);
    let response = files(reqwest::Method::GET, &query(&[("path", path), ("signature", &signed_read)]));
    assert_eq!(response.send().await.expect("read").bytes().await.expect("body"), text);
    let response = server
        .client
        .get(server.url(&format!("/files?{}", query(&[("path", path), ("signature", &signed_read)]))))
        .header("Host", format!("49983-{id}.strata.test"))
        .send()
        .await
        .expect("read by host");
    assert_eq!(response.status().as_u16(), 200);
    let expires = (now() + 60).to_string();
    let signed_write = sign("up.txt", "write", "root", &token, Some(now() + 60));
    let response = files(
        reqwest::Method::POST,
        &query(&[
            ("path", "up.txt"),
            ("username", "root"),
            ("signature", &signed_write),
            ("signature_expiration", &expires),
        ]),
    )
    .header("Content-Type", "application/octet-stream")
    .body("signed");
    let (status, written) = status_json(response.send().await.expect("write")).await;
    assert_eq!((status, &written[0]["path"]), (200, &Value::from("/root/up.txt")), "{written}");

    // Refused with E2B's 401: a tampered signature, a read signature used to write, an expired one, a good one
    // beside a wrong token, and neither token nor signature.
    let mut tampered = signed_read.clone().into_bytes();
    let last = tampered.len() - 1;
    tampered[last] = if tampered[last] == b'A' { b'B' } else { b'A' };
    let tampered = String::from_utf8(tampered).expect("ascii");
    let past = now() - 10;
    let expired = sign(path, "read", "", &token, Some(past));
    let refusals = [
        (reqwest::Method::GET, query(&[("path", path), ("signature", &tampered)]), None, "invalid signature"),
        (reqwest::Method::POST, query(&[("path", path), ("signature", &signed_read)]), None, "invalid signature"),
        (
            reqwest::Method::GET,
            query(&[("path", path), ("signature", &expired), ("signature_expiration", &past.to_string())]),
            None,
            "expired",
        ),
        (reqwest::Method::GET, query(&[("path", path), ("signature", &signed_read)]), Some("wrong"), "X-Access-Token"),
        (reqwest::Method::GET, query(&[("path", path)]), None, "neither"),
        (reqwest::Method::POST, query(&[("path", path)]), None, "neither"),
    ];
    for (method, query, token, says) in refusals {
        let request = files(method.clone(), &query).header("Content-Type", "application/octet-stream").body("no");
        let request = match token {
            Some(token) => request.header("X-Access-Token", token),
            None => request,
        };
        let (status, body) = status_json(request.send().await.expect("request")).await;
        assert_eq!((status, &body["code"]), (401, &Value::from(401)), "{method} {query}: {body}");
        assert!(body["message"].as_str().is_some_and(|m| m.contains(says)), "{method} {query}: {body}");
    }
    let expiration = query(&[("path", path), ("signature", &signed_read), ("signature_expiration", "soon")]);
    let (status, body) = status_json(files(reqwest::Method::GET, &expiration).send().await.expect("read")).await;
    assert_eq!((status, &body["code"]), (400, &Value::from(400)), "{body}");
    // Other envd calls take no signature.
    let response = server
        .client
        .post(
            server
                .url(&format!("/filesystem.Filesystem/Stat?{}", query(&[("path", path), ("signature", &signed_read)]))),
        )
        .header("E2b-Sandbox-Id", &id)
        .json(&serde_json::json!({"path": path}))
        .send()
        .await
        .expect("stat");
    assert_eq!(response.status().as_u16(), 401);
    assert_eq!(
        files(reqwest::Method::GET, "path=%2Ftmp%2Fhand.txt")
            .header("X-Access-Token", &token)
            .send()
            .await
            .expect("read")
            .bytes()
            .await
            .expect("body"),
        text,
        "nothing a refused request sent was written"
    );

    // A gzip bomb (1 GiB of zeros in about 1 MiB) is refused as a body over the limit, having inflated no further
    // than the limit; an unknown coding and a body that is not gzip are refused as invalid.
    let bomb = gzip_bomb(1024);
    assert!(bomb.len() < 2 << 20, "{} bytes", bomb.len());
    let upload = |coding: &str, body: Vec<u8>| {
        files(reqwest::Method::POST, "path=%2Ftmp%2Fbomb")
            .header("X-Access-Token", &token)
            .header("Content-Type", "application/octet-stream")
            .header("Content-Encoding", coding.to_owned())
            .body(body)
            .send()
    };
    let (status, body) = status_json(upload("gzip", bomb).await.expect("bomb")).await;
    assert_eq!((status, &body["code"]), (413, &Value::from(413)), "{body}");
    assert!(body["message"].as_str().is_some_and(|m| m.contains("decompresses")), "{body}");
    let (status, _) = status_json(upload("br", b"x".to_vec()).await.expect("br")).await;
    assert_eq!(status, 400);
    let (status, _) = status_json(upload("gzip", b"not gzip".to_vec()).await.expect("corrupt")).await;
    assert_eq!(status, 400);
    let missing = files(reqwest::Method::GET, "path=%2Ftmp%2Fbomb").header("X-Access-Token", &token);
    assert_eq!(missing.send().await.expect("read").status().as_u16(), 404, "no refused upload was written");
    server.stop().await;
}
