//! The HTTP/1.1 request head a proxy client sends: `CONNECT host:port` or an absolute-form `http://` request.
//!
//! The parser is strict on purpose: lines end in CRLF, header names are tokens, no obsolete line folding, one
//! `Content-Length` at most and never beside `Transfer-Encoding` (request smuggling), no userinfo in the authority.

use crate::allow::{Host, parse_port, split_host_port};

/// Why a request head is refused; each maps to an HTTP status.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    /// Syntax the proxy does not accept (400).
    #[error("bad request: {0}")]
    Malformed(&'static str),
    /// Valid HTTP the proxy does not implement (501).
    #[error("not supported: {0}")]
    Unsupported(&'static str),
}

impl RequestError {
    /// The status line this error is answered with.
    pub fn status(&self) -> &'static str {
        match self {
            RequestError::Malformed(_) => "400 Bad Request",
            RequestError::Unsupported(_) => "501 Not Implemented",
        }
    }
}

/// A parsed request head.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestHead {
    /// The method, as sent (`CONNECT`, `GET`, ...).
    pub method: String,
    /// The target host.
    pub host: Host,
    /// The target port (80 when an `http://` URI names none).
    pub port: u16,
    /// For absolute-form requests: the origin-form target (`/path?query`); empty for CONNECT.
    pub path: String,
    /// The HTTP version's minor digit (`HTTP/1.x`).
    pub minor: u8,
    /// Header fields, in order, as sent.
    pub headers: Vec<(String, String)>,
    /// The request body's length (absolute-form only; 0 when absent).
    pub content_length: u64,
}

impl RequestHead {
    /// Whether this is a `CONNECT`.
    pub fn is_connect(&self) -> bool {
        self.method == "CONNECT"
    }

    /// The head to send to the origin: origin-form target, `Host` set to the target, hop-by-hop headers and
    /// `Proxy-Authorization` removed, `Connection: close` added.
    pub fn origin_head(&self) -> Vec<u8> {
        let listed: Vec<String> = self
            .headers
            .iter()
            .filter(|(n, _)| n.eq_ignore_ascii_case("connection") || n.eq_ignore_ascii_case("proxy-connection"))
            .flat_map(|(_, v)| v.split(',').map(|t| t.trim().to_ascii_lowercase()).collect::<Vec<_>>())
            .collect();
        let mut out = format!("{} {} HTTP/1.1\r\n", self.method, self.path);
        let authority = match (self.port, &self.host) {
            (80, h) => h.to_authority(),
            (p, h) => format!("{}:{p}", h.to_authority()),
        };
        out.push_str(&format!("Host: {authority}\r\n"));
        for (name, value) in &self.headers {
            let lower = name.to_ascii_lowercase();
            if HOP_BY_HOP.contains(&lower.as_str()) || lower == "host" || listed.contains(&lower) {
                continue;
            }
            out.push_str(name);
            out.push_str(": ");
            out.push_str(value);
            out.push_str("\r\n");
        }
        out.push_str("Connection: close\r\n\r\n");
        out.into_bytes()
    }
}

/// Headers that describe one hop and are never forwarded (RFC 9110 §7.6.1, plus the proxy's own).
const HOP_BY_HOP: &[&str] = &[
    "connection",
    "proxy-connection",
    "keep-alive",
    "proxy-authorization",
    "proxy-authenticate",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

/// The index just past the `\r\n\r\n` ending the head, if `buf` holds one.
pub fn head_end(buf: &[u8]) -> Option<usize> {
    buf.windows(4).position(|w| w == b"\r\n\r\n").map(|i| i + 4)
}

fn is_token(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

/// Parses `host:port` (port required for CONNECT) or `host[:port]` with `default_port`.
fn parse_authority(s: &str, default_port: Option<u16>) -> Result<(Host, u16), RequestError> {
    if s.contains('@') {
        return Err(RequestError::Malformed("userinfo in the authority"));
    }
    let (host, port) = split_host_port(s).map_err(RequestError::Malformed)?;
    let port = match (port, default_port) {
        (Some(p), _) => parse_port(p).map_err(RequestError::Malformed)?,
        (None, Some(d)) => d,
        (None, None) => return Err(RequestError::Malformed("CONNECT target needs a port")),
    };
    let host = Host::parse(host).map_err(RequestError::Malformed)?;
    Ok((host, port))
}

/// Parses a complete request head (`head` ends with the blank line).
pub fn parse_head(head: &[u8]) -> Result<RequestHead, RequestError> {
    let text = std::str::from_utf8(head).map_err(|_| RequestError::Malformed("request head is not UTF-8"))?;
    let text = text.strip_suffix("\r\n\r\n").ok_or(RequestError::Malformed("request head is not terminated"))?;
    let mut lines = text.split("\r\n");
    let request_line = lines.next().unwrap_or_default();
    let mut parts = request_line.split(' ');
    let (Some(method), Some(target), Some(version), None) = (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(RequestError::Malformed("request line is not METHOD TARGET VERSION"));
    };
    if !is_token(method) {
        return Err(RequestError::Malformed("method is not a token"));
    }
    let minor = match version {
        "HTTP/1.1" => 1,
        "HTTP/1.0" => 0,
        _ => return Err(RequestError::Unsupported("only HTTP/1.0 and HTTP/1.1")),
    };
    let mut headers = Vec::new();
    for line in lines {
        if line.contains('\n') || line.contains('\r') {
            return Err(RequestError::Malformed("bare CR or LF in the head"));
        }
        if line.starts_with([' ', '\t']) {
            return Err(RequestError::Malformed("obsolete header line folding"));
        }
        let (name, value) = line.split_once(':').ok_or(RequestError::Malformed("header line without ':'"))?;
        if !is_token(name) {
            return Err(RequestError::Malformed("header name is not a token"));
        }
        let value = value.trim_matches([' ', '\t']);
        if value.bytes().any(|b| b.is_ascii_control() && b != b'\t') {
            return Err(RequestError::Malformed("control character in a header value"));
        }
        headers.push((name.to_string(), value.to_string()));
    }
    if request_line.contains('\n') || request_line.contains('\r') {
        return Err(RequestError::Malformed("bare CR or LF in the head"));
    }

    if method == "CONNECT" {
        let (host, port) = parse_authority(target, None)?;
        return Ok(RequestHead {
            method: method.into(),
            host,
            port,
            path: String::new(),
            minor,
            headers,
            content_length: 0,
        });
    }

    let Some((scheme, rest)) = target.split_once("://") else {
        return Err(RequestError::Malformed("a proxy request needs an absolute http:// URI"));
    };
    if !scheme.eq_ignore_ascii_case("http") {
        return Err(RequestError::Unsupported("only http:// URIs (use CONNECT for https)"));
    }
    let (authority, path) = match rest.find(['/', '?']) {
        Some(i) => rest.split_at(i),
        None => (rest, "/"),
    };
    let path = if path.starts_with('?') { format!("/{path}") } else { path.to_string() };
    if path.contains('#') {
        return Err(RequestError::Malformed("fragment in the request target"));
    }
    let (host, port) = parse_authority(authority, Some(80))?;

    let mut content_length = None;
    for (name, value) in &headers {
        if name.eq_ignore_ascii_case("transfer-encoding") {
            return Err(RequestError::Unsupported("request bodies with Transfer-Encoding"));
        }
        if name.eq_ignore_ascii_case("content-length") {
            if content_length.is_some() {
                return Err(RequestError::Malformed("more than one Content-Length"));
            }
            if value.is_empty() || value.len() > 19 || !value.bytes().all(|b| b.is_ascii_digit()) {
                return Err(RequestError::Malformed("Content-Length is not a number"));
            }
            content_length = Some(value.parse::<u64>().map_err(|_| RequestError::Malformed("Content-Length"))?);
        }
    }
    Ok(RequestHead {
        method: method.into(),
        host,
        port,
        path,
        minor,
        headers,
        content_length: content_length.unwrap_or(0),
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn connect_needs_host_and_port() {
        let h = parse_head(b"CONNECT Example.com.:443 HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
        assert!(h.is_connect());
        assert_eq!((h.host, h.port), (Host::Name("example.com".into()), 443));
        let h = parse_head(b"CONNECT [::1]:8443 HTTP/1.1\r\n\r\n").unwrap();
        assert_eq!(h.host, Host::Ip("::1".parse().unwrap()));
        assert!(parse_head(b"CONNECT example.com HTTP/1.1\r\n\r\n").is_err());
        assert!(parse_head(b"CONNECT user@example.com:443 HTTP/1.1\r\n\r\n").is_err());
    }

    #[test]
    fn absolute_form_is_rewritten_for_the_origin() {
        let h = parse_head(
            b"GET http://Example.com:8080/a?b=1 HTTP/1.1\r\nHost: wrong\r\nProxy-Authorization: Basic eA==\r\n\
              Connection: keep-alive, X-Hop\r\nX-Hop: 1\r\nKeep-Alive: 5\r\nAccept: */*\r\n\r\n",
        )
        .unwrap();
        assert_eq!((h.port, h.path.as_str()), (8080, "/a?b=1"));
        let out = String::from_utf8(h.origin_head()).unwrap();
        assert_eq!(out, "GET /a?b=1 HTTP/1.1\r\nHost: example.com:8080\r\nAccept: */*\r\nConnection: close\r\n\r\n");
        let h = parse_head(b"GET http://example.com HTTP/1.0\r\n\r\n").unwrap();
        assert_eq!((h.port, h.path.as_str(), h.minor), (80, "/", 0));
    }

    #[test]
    fn smuggling_shapes_are_refused() {
        for head in [
            &b"GET /path HTTP/1.1\r\nHost: example.com\r\n\r\n"[..],
            b"GET https://example.com/ HTTP/1.1\r\n\r\n",
            b"GET http://user:pw@example.com/ HTTP/1.1\r\n\r\n",
            b"GET http://example.com/ HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 1\r\n\r\n",
            b"POST http://example.com/ HTTP/1.1\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n",
            b"POST http://example.com/ HTTP/1.1\r\nContent-Length: -1\r\n\r\n",
            b"GET http://example.com/ HTTP/1.1\r\n folded\r\n\r\n",
            b"GET http://example.com/ HTTP/1.1\r\nBad Name: x\r\n\r\n",
            b"GET http://example.com/ HTTP/1.1\r\nX: a\nY: b\r\n\r\n",
            b"GET  http://example.com/ HTTP/1.1\r\n\r\n",
            b"GET http://example.com/ HTTP/2\r\n\r\n",
            b"GET http://example.com/ HTTP/1.1 extra\r\n\r\n",
            b"\xff\xfe http://example.com/ HTTP/1.1\r\n\r\n",
        ] {
            assert!(parse_head(head).is_err(), "{}", String::from_utf8_lossy(head));
        }
    }

    #[test]
    fn head_end_finds_the_blank_line() {
        assert_eq!(head_end(b"GET / HTTP/1.1\r\n\r\nbody"), Some(18));
        assert_eq!(head_end(b"GET / HTTP/1.1\r\n"), None);
    }
}
