//! The operator's console at `/ui/`: a TypeScript app (`engine/serve/ui/`) built with npm and embedded at build
//! time (`build.rs`). It is a client of the same API, with the same keys: the page asks for a key once and keeps
//! it in the browser's session storage; it holds no privilege of its own. Every file is served with a strict
//! Content-Security-Policy: scripts only from `/ui/` itself (no inline script, no `eval`), connections only to
//! this server. Styles allow inline style elements, which the terminal (xterm.js) creates for its theme.
//!
//! A server built without the console (no `ui/dist/`) still serves the API, and `/ui/` says how to build it.

use axum::Router;
use axum::extract::Path;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::get;

mod assets {
    include!(concat!(env!("OUT_DIR"), "/console_assets.rs"));
}

/// The Content-Security-Policy of every console response.
pub const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; \
    font-src 'self'; connect-src 'self' ws: wss:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

/// Whether the console was built into this server.
pub fn built() -> bool {
    !assets::ASSETS.is_empty()
}

/// What `/ui/` answers when the console was not built.
const NOT_BUILT: &str = "<!doctype html><meta charset=utf-8><title>Strata console</title>\
<h1>The console is not built into this server</h1>\
<p>The API works as usual. To build the console, run <code>npm ci &amp;&amp; npm run build</code> in \
<code>engine/serve/ui</code> (Node.js 18 or later), then build <code>strata</code> again: the files in \
<code>engine/serve/ui/dist</code> are embedded. <code>tests/run</code> does both.</p>";

fn content_type(path: &str) -> &'static str {
    match path.rsplit_once('.').map(|(_, ext)| ext) {
        Some("html") => "text/html; charset=utf-8",
        Some("js") => "text/javascript; charset=utf-8",
        Some("css") => "text/css; charset=utf-8",
        Some("svg") => "image/svg+xml",
        Some("png") => "image/png",
        Some("json") => "application/json",
        Some("woff2") => "font/woff2",
        _ => "application/octet-stream",
    }
}

fn with_policy(mut response: Response) -> Response {
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_SECURITY_POLICY, HeaderValue::from_static(CSP));
    headers.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    headers.insert(header::REFERRER_POLICY, HeaderValue::from_static("no-referrer"));
    headers.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    response
}

fn asset(path: &str) -> Response {
    let path = if path.is_empty() { "index.html" } else { path };
    if !built() {
        let status = if path == "index.html" { StatusCode::OK } else { StatusCode::NOT_FOUND };
        return with_policy((status, [(header::CONTENT_TYPE, "text/html; charset=utf-8")], NOT_BUILT).into_response());
    }
    match assets::ASSETS.iter().find(|(name, _)| *name == path) {
        Some((name, bytes)) => with_policy(([(header::CONTENT_TYPE, content_type(name))], *bytes).into_response()),
        None => with_policy((StatusCode::NOT_FOUND, "no such file in the console").into_response()),
    }
}

/// `/ui`, `/ui/` and the console's files, without authentication (the page asks for a key).
pub fn routes<S: Clone + Send + Sync + 'static>() -> Router<S> {
    Router::new()
        .route("/ui", get(|| async { Redirect::permanent("/ui/") }))
        .route("/ui/", get(|| async { asset("") }))
        .route("/ui/{*path}", get(|Path(path): Path<String>| async move { asset(&path) }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_answer_carries_the_policy_and_no_script_may_be_inline() {
        let response = asset("");
        assert_eq!(response.headers()[header::CONTENT_SECURITY_POLICY], CSP);
        assert!(CSP.contains("script-src 'self';") && !CSP.contains("unsafe-eval"));
        let script = CSP.split(';').find(|d| d.trim().starts_with("script-src")).expect("script-src");
        assert!(!script.contains("unsafe-inline"), "{script}");
        assert_eq!(asset("nope/../../etc/passwd").status(), StatusCode::NOT_FOUND);
    }
}
