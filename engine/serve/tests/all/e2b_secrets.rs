//! Secrets that never enter the sandbox, through the server: E2B's `Secret.create` and `Secret.fill` in a
//! `network.rules` header transform (both SDKs), and the native API's `capabilities.egress_secrets`. Two origins on
//! the host's loopback record the request heads they get: the bound one sees the value, the other never does.

use std::sync::mpsc;

use serde_json::json;

use crate::e2b::{both_sdks, keyed_server};
use crate::util::{TestServer, head_origin, process_tier};

fn heads(rx: &mpsc::Receiver<String>) -> Vec<String> {
    rx.try_iter().collect()
}

/// `Secret.create`, then a sandbox whose rule for the bound origin sets `Authorization` from `Secret.fill`: a
/// command's request to it carries the value (the sandbox never held it), one to the other origin does not; reads
/// never return a value; an unknown secret and a rule on a host outside `allow_out` are refused.
const PYTHON: &str = r#"
from e2b import Sandbox, Secret
FETCH = '''
import os, sys, urllib.request as u
os.environ.pop("no_proxy", None); os.environ.pop("NO_PROXY", None)
o = u.build_opener(u.ProxyHandler({"http": "http://127.0.0.1:3128"}))
print(o.open(u.Request(f"http://127.0.0.1:{sys.argv[1]}/", headers={"Authorization": "mine"}), timeout=10).read().decode())
'''
info = Secret.create("api-token", "{VALUE}", metadata={"team": "a"})
assert info.version == 1 and info.metadata == {"team": "a"}, info
assert "{VALUE}" not in repr(Secret.get_info("api-token")) and Secret.exists("api-token")
assert [s.name for s in Secret.list().next_items()] == ["api-token"]
network = {
    "allow_out": ["127.0.0.1:{BOUND}", "127.0.0.1:{OTHER}"],
    "rules": {"127.0.0.1:{BOUND}": [{"transform": {"headers": {"Authorization": "Bearer " + Secret.fill("api-token")}}}]},
}
sbx = Sandbox.create(network=network)
sbx.files.write("/tmp/fetch.py", FETCH)
for port in ("{BOUND}", "{OTHER}"):
    assert sbx.commands.run(f"python3 /tmp/fetch.py {port}").stdout == "origin\n"
assert "{VALUE}" not in sbx.commands.run("env; cat /proc/1/environ 2>/dev/null; true").stdout
sbx.kill()
for bad in ({**network, "rules": {"127.0.0.1:{BOUND}": [{"transform": {"headers": {"A": Secret.fill("nope")}}}]}},
            {**network, "rules": {"elsewhere.example": [{"transform": {"headers": {"A": "x"}}}]}}):
    try:
        Sandbox.create(network=bad).kill()
        raise SystemExit(f"created with {bad}")
    except Exception as e:
        assert "nope" in str(e) or "allow_out" in str(e), e
assert Secret.update("api-token", "{VALUE}-2").version == 2
assert Secret.destroy("api-token") and not Secret.exists("api-token")
print("SECRETS OK")
"#;

/// [`PYTHON`] with the JS SDK, up to the requests.
const JS: &str = r#"
import { Sandbox, Secret } from 'e2b'
const check = (ok, what) => { if (!ok) { console.error(what); process.exit(1) } }
const info = await Secret.create('js-token', '{VALUE}')
check(info.version === 1 && !JSON.stringify(info).includes('{VALUE}'), JSON.stringify(info))
const sbx = await Sandbox.create({ network: {
  allowOut: ['127.0.0.1:{BOUND}', '127.0.0.1:{OTHER}'],
  rules: { '127.0.0.1:{BOUND}': [{ transform: { headers: { Authorization: `Bearer ${Secret.fill('js-token')}` } } }] },
} })
const fetch = `import os, sys, urllib.request as u
os.environ.pop("no_proxy", None); os.environ.pop("NO_PROXY", None)
o = u.build_opener(u.ProxyHandler({"http": "http://127.0.0.1:3128"}))
print(o.open(f"http://127.0.0.1:{sys.argv[1]}/", timeout=10).read().decode())
`
await sbx.files.write('/tmp/fetch.py', fetch)
for (const port of ['{BOUND}', '{OTHER}']) {
  const out = (await sbx.commands.run(`python3 /tmp/fetch.py ${port}`)).stdout
  check(out === 'origin\n', out)
}
await sbx.kill()
check(await Secret.destroy('js-token'), 'destroyed')
console.log('JS SECRETS OK')
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e2b_secret_fill_rules_put_the_value_only_toward_their_host() {
    if !process_tier("e2b_secret_fill_rules_put_the_value_only_toward_their_host") {
        return;
    }
    let ((bound, bound_heads), (other, other_heads)) = (head_origin(), head_origin());
    let value = format!("s3cr3t-{}", std::process::id());
    let fill = |script: &str| {
        script.replace("{VALUE}", &value).replace("{BOUND}", &bound.to_string()).replace("{OTHER}", &other.to_string())
    };
    let server = keyed_server().await;
    both_sdks(&server, &fill(PYTHON), "SECRETS OK", &fill(JS), "secrets.mjs", "JS SECRETS OK").await;
    let (bound_seen, other_seen) = (heads(&bound_heads), heads(&other_heads));
    assert!(!bound_seen.is_empty() && !other_seen.is_empty(), "{bound_seen:?} {other_seen:?}");
    for head in &bound_seen {
        assert!(head.contains(&format!("\r\nAuthorization: Bearer {value}\r\n")), "{head}");
        assert!(!head.contains("mine"), "the rule replaces the guest's own header: {head}");
    }
    for head in &other_seen {
        assert!(!head.contains(&value), "{head}");
    }
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn native_egress_secrets_give_the_job_a_placeholder_only() {
    if !process_tier("native_egress_secrets_give_the_job_a_placeholder_only") {
        return;
    }
    let ((bound, bound_heads), (other, other_heads)) = (head_origin(), head_origin());
    let server = TestServer::start().await;
    let code = format!(
        "import os, urllib.request as u\n\
         for port in ({bound}, {other}):\n\
         \x20   print(u.urlopen(u.Request(f'http://127.0.0.1:{{port}}/', headers={{'X-Key': os.environ['KEY']}}), timeout=10).read().decode())\n\
         print(os.environ['KEY'])\n"
    );
    let caps = json!({
        "allow_net": [format!("127.0.0.1:{bound}"), format!("127.0.0.1:{other}")],
        "egress_secrets": {"KEY": {"value": "v4lue-native", "hosts": [format!("127.0.0.1:{bound}")]}},
    });
    let body = json!({"tier": "process", "job": {"python": code}, "capabilities": caps});
    let (status, outcome) = server.post("/v1/run", body.clone()).await;
    assert_eq!(status, 200, "{outcome}");
    let text = outcome.to_string();
    assert!(!text.contains("v4lue-native"), "{text}");
    assert_eq!(outcome["stdout"].as_str().map(|s| s.starts_with("origin\norigin\nstrata-secret-KEY-")), Some(true));
    // The log records a connection when it closes: find each by its port, not by its place.
    let entry = |port: u16| {
        let log = outcome["egress"].as_array().into_iter().flatten();
        log.filter(|e| e["port"] == json!(port)).cloned().collect::<Vec<_>>()
    };
    assert_eq!(entry(bound).len(), 1, "{outcome}");
    assert_eq!(entry(bound)[0]["secrets_injected"], json!(["KEY"]), "{outcome}");
    assert_eq!(entry(other).len(), 1, "{outcome}");
    assert_eq!(entry(other)[0]["secrets_withheld"], json!(["KEY"]), "{outcome}");
    assert!(heads(&bound_heads).iter().all(|h| h.contains("\r\nX-Key: v4lue-native\r\n")));
    assert!(heads(&other_heads).iter().all(|h| h.contains("\r\nX-Key: strata-secret-KEY-")));

    let mut outside = body;
    outside["capabilities"]["egress_secrets"]["KEY"]["hosts"] = json!(["elsewhere.example"]);
    let (status, error) = server.post("/v1/run", outside).await;
    assert_eq!((status, error["error"]["code"].as_str()), (400, Some("invalid_capability")), "{error}");
    server.stop().await;
}
