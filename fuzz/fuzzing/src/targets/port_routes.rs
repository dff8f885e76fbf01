//! How a request names a sandbox's port (`engine/serve/src/ports.rs`): a Host name `{port}-{id}.{domain}` and a port
//! number from a path segment or header, as any client of the server sends them.
//!
//! Input: a byte splitting the rest into a domain and a text; the text is judged as a Host name of that domain and
//! as a port.
//!
//! Oracles: nothing panics; a Host name is accepted only as `{port}-{id}.{domain}` (an optional `:port` of the
//! server after it) with a port of 1–65535 written as that number and an id without dots; a port is 1–65535 and
//! is the text's number.

use strata_serve::ports::{from_host, parse_port};

/// Judges one text.
pub fn run(data: &[u8]) {
    let Some((&split, rest)) = data.split_first() else { return };
    let split = usize::from(split).min(rest.len());
    let (domain, text) = rest.split_at(split);
    let (Ok(domain), Ok(text)) = (std::str::from_utf8(domain), std::str::from_utf8(text)) else { return };
    if let Some((id, port)) = from_host(text, domain) {
        let name = text.split(':').next().unwrap_or("");
        assert!(port != 0 && !id.is_empty() && !id.contains('.'), "{text:?} in {domain:?}: {id:?} {port}");
        assert!(name.ends_with(&format!(".{domain}")), "{text:?} is not of {domain:?}");
        let label = &name[..name.len() - domain.len() - 1];
        let (written, named) = label.split_once('-').expect("a port and an id");
        assert_eq!((written.parse::<u16>().ok(), named), (Some(port), id), "{text:?}");
    }
    if let Ok(port) = parse_port(text) {
        assert!(port != 0 && text.parse::<u16>().ok() == Some(port), "{text:?} -> {port}");
    }
}
