//! Custom images through the server: `"image"` in `POST /v1/sandboxes` and `/v1/run`, and E2B's `templateID` (an
//! image's name, or the server's alias for it) from both pinned SDKs. The image is built here from the offline
//! Dockerfile (a local `.deb` and a local wheel), into the server's own store.

use serde_json::json;
use strata_benches::images::{offline_context, offline_dockerfile};
use strata_core::ImageName;
use strata_engine::build::BuildRequest;

use crate::e2b::{SDK_KEY, both_sdks};
use crate::util::{TestServer, engine, process_tier};

const USES_BOTH: &str = "strata-hello; python3 -c 'import stratawheel; print(stratawheel.answer())'; pwd; id -un";

/// Builds the offline image under a name of this run's own (the store is the real `$STRATA_HOME`'s).
fn build(name: &str, greeting: &str) -> ImageName {
    build_from(name, &offline_dockerfile(greeting))
}

fn build_from(name: &str, dockerfile: &str) -> ImageName {
    let name = ImageName::new(format!("{name}-{}", std::process::id())).expect("a name");
    let context = tempfile::tempdir().expect("tempdir");
    offline_context(context.path());
    let request = BuildRequest::new(name.clone(), context.path(), dockerfile);
    engine().build_image(&request, &|_| {}).expect("the image builds");
    name
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn native_sandboxes_and_runs_start_from_an_image() {
    if !process_tier("native_sandboxes_and_runs_start_from_an_image") {
        return;
    }
    let image = tokio::task::spawn_blocking(|| build("serve-native", "native")).await.expect("build");
    let server = TestServer::start().await;
    let (status, created) = server.post("/v1/sandboxes", json!({"image": image.as_str()})).await;
    assert_eq!((status, created["tier"].as_str()), (201, Some("process")), "{created}");
    let id = created["id"].as_str().expect("id");
    let (status, outcome) =
        server.post(&format!("/v1/sandboxes/{id}/exec"), json!({"command": ["sh", "-c", USES_BOTH]})).await;
    assert_eq!(status, 200, "{outcome}");
    assert_eq!(outcome["stdout"], "hello from a deb\n42\n/opt/app\nuser\n", "{outcome}");
    assert_eq!(server.delete(&format!("/v1/sandboxes/{id}")).await, 204);

    let job = json!({"image": image.as_str(), "job": {"python": "import stratawheel, os\nprint(stratawheel.answer(), os.environ['APP_HOME'])"}});
    let (status, outcome) = server.post("/v1/run", job).await;
    assert_eq!((status, outcome["stdout"].as_str()), (200, Some("42 /opt/app\n")), "{outcome}");
    assert_eq!(outcome["tier"], "process", "{outcome}");

    let (status, error) = server.post("/v1/sandboxes", json!({"image": "no-such-image-here"})).await;
    assert_eq!((status, error["error"]["code"].as_str()), (404, Some("image_not_found")), "{error}");
    let (status, error) = server.post("/v1/sandboxes", json!({"image": "../etc"})).await;
    assert_eq!((status, error["error"]["code"].as_str()), (400, Some("invalid_image")), "{error}");
    server.stop().await;
    engine().image_store().expect("store").remove(&image).expect("remove");
}

/// An image `FROM` another with a start command (a web server over the working directory) and a ready command;
/// one whose start command fails at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_images_start_command_is_supervised_and_create_waits_for_ready() {
    if !process_tier("an_images_start_command_is_supervised_and_create_waits_for_ready") {
        return;
    }
    let (good, bad) = tokio::task::spawn_blocking(|| {
        let base = build("serve-base", "served");
        let good = build_from(
            "serve-start",
            &format!(
                "FROM {base}\n# strata: start=python3 -m http.server 8000 --bind 127.0.0.1 ready=python3 -c \
                 \"import urllib.request as u; u.urlopen('http://127.0.0.1:8000/greeting.txt')\"\n"
            ),
        );
        let bad =
            build_from("serve-broken", &format!("FROM {base}\n# strata: start=echo broken; exit 3 ready=false\n"));
        engine().image_store().expect("store").remove(&base).expect("remove");
        (good, bad)
    })
    .await
    .expect("build");
    let server = TestServer::start().await;
    let (status, created) = server.post("/v1/sandboxes", json!({"image": good.as_str()})).await;
    assert_eq!(status, 201, "{created}");
    let id = created["id"].as_str().expect("id");
    // Ready when create returns: the server answers at once.
    let fetch =
        "import urllib.request as u\nprint(u.urlopen('http://127.0.0.1:8000/greeting.txt').read().decode(), end='')";
    let (status, outcome) = server.post(&format!("/v1/sandboxes/{id}/exec"), json!({"python": fetch})).await;
    assert_eq!((status, outcome["stdout"].as_str()), (200, Some("served\n")), "{outcome}");
    let (_, info) = server.get(&format!("/v1/sandboxes/{id}")).await;
    assert!(matches!(info["service"]["state"].as_str(), Some("running" | "starting")), "{info}");
    assert_eq!(info["service"]["restarts"], 0, "{info}");
    assert!(info["service"]["pid"].is_u64(), "{info}");
    let (status, outcome) =
        server.post(&format!("/v1/sandboxes/{id}/exec"), json!({"command": ["pkill", "-f", "http.server"]})).await;
    assert_eq!(status, 200, "{outcome}");
    // Killed, it is started again (a second after it ended).
    let mut restarted = false;
    for _ in 0..50 {
        let (_, info) = server.get(&format!("/v1/sandboxes/{id}")).await;
        if info["service"]["restarts"] == 1 && info["service"]["state"] != "backoff" {
            restarted = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert!(restarted, "the start command was not restarted");
    assert_eq!(server.delete(&format!("/v1/sandboxes/{id}")).await, 204);

    let (status, error) = server.post("/v1/sandboxes", json!({"image": bad.as_str()})).await;
    assert_eq!((status, error["error"]["code"].as_str()), (503, Some("image_not_ready")), "{error}");
    let message = error["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("broken") && message.contains("failed"), "{message}");
    assert!(server.get("/v1/sandboxes").await.1["sandboxes"].as_array().is_some_and(Vec::is_empty));
    server.stop().await;
    let store = engine().image_store().expect("store");
    store.remove(&good).expect("remove");
    store.remove(&bad).expect("remove");
}

const PYTHON: &str = r#"
from e2b import Sandbox
for template in ("{IMAGE}", "my-alias"):
    sbx = Sandbox.create(template=template)
    out = sbx.commands.run("{USES_BOTH}")
    assert out.stdout == "hello from a deb\n42\n/home/user\nuser\n", out
    assert sbx.commands.run("cat /opt/app/greeting.txt").stdout == "e2b\n"
    sbx.kill()
try:
    Sandbox.create(template="no-such-template").kill()
    raise SystemExit("created from an unknown template")
except Exception as e:
    assert "no-such-template" in str(e), e
print("IMAGES OK")
"#;

const JS: &str = r#"
import { Sandbox } from 'e2b'
const check = (ok, what) => { if (!ok) { console.error(what); process.exit(1) } }
for (const template of ['{IMAGE}', 'my-alias']) {
  const sbx = await Sandbox.create(template)
  const out = await sbx.commands.run("{USES_BOTH}")
  check(out.stdout === 'hello from a deb\n42\n/home/user\nuser\n', JSON.stringify(out))
  await sbx.kill()
}
console.log('JS IMAGES OK')
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e2b_templates_name_images_from_both_sdks() {
    if !process_tier("e2b_templates_name_images_from_both_sdks") {
        return;
    }
    let image = tokio::task::spawn_blocking(|| build("serve-e2b", "e2b")).await.expect("build");
    let alias = image.clone();
    let server = TestServer::with(move |config| {
        config.keys = Some(strata_serve::KeyStore::from_keys([("sdk", SDK_KEY, None)]));
        config.templates.insert("my-alias".into(), alias);
    })
    .await;
    let fill = |script: &str| script.replace("{IMAGE}", image.as_str()).replace("{USES_BOTH}", USES_BOTH);
    both_sdks(&server, &fill(PYTHON), "IMAGES OK", &fill(JS), "images.mjs", "JS IMAGES OK").await;
    server.stop().await;
    engine().image_store().expect("store").remove(&image).expect("remove");
}
