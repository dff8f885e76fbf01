//! What the console (`/ui/`) stands on, without a browser: its files' policy, a sandbox's job log, the images
//! list, and a browser's WebSocket presenting its key as a subprotocol (`engine/cli/tests/console.rs` drives the
//! page itself in Chromium).

use base64::Engine as _;
use futures_util::{SinkExt, StreamExt};
use serde_json::json;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;

use crate::e2b::{SDK_KEY, keyed_server};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_is_served_under_its_policy_and_its_api_answers() {
    let server = keyed_server().await;
    // The page needs no key (it asks for one); its answer carries the policy whether or not it is built in.
    let page = server.client.get(server.url("/ui/")).send().await.expect("page");
    assert_eq!(page.status(), 200);
    let csp = page.headers()["content-security-policy"].to_str().expect("csp").to_owned();
    assert_eq!(csp, strata_serve::console::CSP);
    assert!(!page.text().await.expect("text").contains("<script>"), "no inline script");
    let redirect = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .expect("client")
        .get(server.url("/ui"))
        .send()
        .await
        .expect("redirect");
    assert_eq!(redirect.status(), 308);

    let keyed = |request: reqwest::RequestBuilder| request.header("X-API-Key", SDK_KEY);
    let created: serde_json::Value = keyed(server.client.post(server.url("/v1/sandboxes")))
        .json(&json!({"tier": "wasm"}))
        .send()
        .await
        .expect("create")
        .json()
        .await
        .expect("json");
    let id = created["id"].as_str().expect("id").to_owned();
    assert!(created["memory_limit"].as_u64().is_some_and(|m| m > 0), "{created}");
    for code in ["print('first')", "raise SystemExit(3)"] {
        let response = keyed(server.client.post(server.url(&format!("/v1/sandboxes/{id}/exec"))))
            .json(&json!({"python": code}))
            .send()
            .await
            .expect("exec");
        assert_eq!(response.status(), 200);
    }
    let jobs: serde_json::Value = keyed(server.client.get(server.url(&format!("/v1/sandboxes/{id}/jobs"))))
        .send()
        .await
        .expect("jobs")
        .json()
        .await
        .expect("json");
    let jobs = jobs["jobs"].as_array().expect("jobs").clone();
    assert_eq!(jobs.len(), 2, "{jobs:?}");
    assert_eq!(
        (jobs[0]["number"].as_u64(), jobs[0]["description"].as_str()),
        (Some(1), Some("python: print('first')"))
    );
    assert_eq!(jobs[0]["stdout_tail"], "first\n");
    assert_eq!(jobs[1]["status"], json!({"kind": "exited", "code": 3}));
    // Another key's sandbox is not found, its jobs neither; without a key, unauthorized.
    let anonymous = server.client.get(server.url(&format!("/v1/sandboxes/{id}/jobs"))).send().await.expect("jobs");
    assert_eq!(anonymous.status(), 401);
    let images = keyed(server.client.get(server.url("/v1/images"))).send().await.expect("images");
    assert_eq!(images.status(), 200);
    assert!(images.json::<serde_json::Value>().await.expect("json")["images"].is_array());

    // A browser's WebSocket: the key as `strata.key.BASE64URL` beside `strata`, which the server selects.
    let encoded = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(SDK_KEY);
    let url = format!("{}/v1/sandboxes/{id}/exec/ws", server.ws_base);
    let mut request = url.as_str().into_client_request().expect("request");
    request
        .headers_mut()
        .insert("sec-websocket-protocol", format!("strata, strata.key.{encoded}").parse().expect("header"));
    let (mut socket, response) =
        tokio_tungstenite::connect_async(request).await.expect("the key as a subprotocol is taken");
    assert_eq!(response.headers()["sec-websocket-protocol"], "strata");
    socket.send(Message::Text(json!({"python": "print(6 * 7)"}).to_string().into())).await.expect("job");
    let mut seen = String::new();
    while let Some(Ok(message)) = socket.next().await {
        if let Message::Text(text) = message {
            seen.push_str(&text);
        }
    }
    assert!(seen.contains("42"), "{seen}");
    // A wrong key in the subprotocol is refused before the upgrade.
    let wrong = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode("not-the-key");
    let mut request = url.as_str().into_client_request().expect("request");
    request
        .headers_mut()
        .insert("sec-websocket-protocol", format!("strata, strata.key.{wrong}").parse().expect("header"));
    assert!(tokio_tungstenite::connect_async(request).await.is_err(), "a wrong key is refused");
    server.stop().await;
}
