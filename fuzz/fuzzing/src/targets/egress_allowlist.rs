//! The egress allowlist (`engine/core/src/allow.rs`): `--allow-net` specs, as a client of `strata serve` sends
//! them in `allow_net`, and the hosts requests name.
//!
//! Input: lines; each is parsed as a spec, and each also as a host (with a port when it has one) checked
//! against the allowlist of every line that parsed.
//!
//! Oracles: nothing panics; a list parses when and only when each of its specs does, into the same rules (a spec
//! written twice counts once); a
//! host [`Host::parse`] accepts is in normal form (lowercase ASCII, no trailing dot, parsing it again changes
//! nothing); a `*.suffix` rule matches only names that end in `.suffix`, an exact rule only that name; an
//! IPv4-mapped IPv6 address is public exactly when its IPv4 address is.

use std::net::IpAddr;

use strata_egress::allow::is_public;
use strata_egress::{AllowRule, Allowlist, Host, HostPattern};

/// Parses `data` as specs and hosts.
pub fn run(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let lines: Vec<&str> = text.split('\n').take(64).collect();
    let mut unique: Vec<&str> = Vec::new();
    for line in &lines {
        if !unique.contains(line) {
            unique.push(line);
        }
    }
    let rules: Vec<AllowRule> = unique.iter().filter_map(|line| line.parse::<AllowRule>().ok()).collect();
    let all = Allowlist::parse(lines.iter().copied());
    match &all {
        Ok(list) => assert_eq!(list.rules(), rules.as_slice(), "a list parsed unlike its specs"),
        Err(_) => assert!(rules.len() < unique.len(), "a list of valid specs was refused"),
    }
    let allow = Allowlist::parse(lines.iter().copied().filter(|line| line.parse::<AllowRule>().is_ok()))
        .expect("valid specs make a list");
    for line in &lines {
        let (host, port) = match line.rsplit_once(':') {
            Some((host, port)) if !host.contains(':') || host.ends_with(']') => (host, port.parse().unwrap_or(443)),
            _ => (*line, 443),
        };
        let Ok(host) = Host::parse(host) else { continue };
        match &host {
            Host::Name(name) => {
                assert!(!name.ends_with('.') && !name.is_empty() && name.len() <= 253, "name {name:?}");
                assert!(!name.bytes().any(|b| b.is_ascii_uppercase() || !b.is_ascii()), "name {name:?}");
                assert_eq!(Host::parse(name).as_ref(), Ok(&host), "normalising {name:?} twice changed it");
            }
            Host::Ip(IpAddr::V4(v4)) => {
                let mapped = IpAddr::V6(v4.to_ipv6_mapped());
                assert_eq!(is_public(mapped), is_public(IpAddr::V4(*v4)), "{v4} and {mapped} differ");
                assert_eq!(Host::parse(&format!("[{mapped}]")), Ok(host.clone()), "{mapped} is not stored as {v4}");
            }
            Host::Ip(IpAddr::V6(_)) => {}
        }
        for rule in allow.rules() {
            if !rule.matches(&host, port) {
                continue;
            }
            assert!(rule.port.is_none_or(|p| p == port));
            match (&rule.host, &host) {
                (HostPattern::Exact(a), Host::Name(b)) => assert_eq!(a, b),
                (HostPattern::Subdomains(suffix), Host::Name(b)) => {
                    assert!(b.len() > suffix.len() + 1 && b.ends_with(&format!(".{suffix}")), "{b} under {suffix}")
                }
                (HostPattern::Ip(a), Host::Ip(b)) => assert_eq!(a, b),
                (pattern, host) => panic!("{pattern:?} matched {host:?}"),
            }
        }
    }
}
