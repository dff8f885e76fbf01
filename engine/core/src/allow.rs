//! The egress allowlist: `--allow-net HOST[:PORT]` specs parsed once, at the edge (a policy, a flag, a request
//! body), into the [`Allowlist`] that [`Net::Allow`](crate::Net::Allow) carries; every tier and the egress proxy
//! match requests against that one parse.
//!
//! A spec is one of
//! - an exact host name: `example.com` (matches `example.com` only, not its subdomains);
//! - a pattern `*.example.com`: one or more labels in front of `example.com` (`a.example.com`,
//!   `a.b.example.com`), never the bare apex `example.com` and never `evil-example.com`;
//! - an IP literal: `10.0.0.1`, `[::1]` (IPv6 always in brackets: `::1:443` would itself be an address);
//!
//! each optionally followed by `:PORT`. **No port means any port** (`example.com` allows `:80`, `:443`, `:22`, ...);
//! write `example.com:443` to allow one port. Names are ASCII, compared case-insensitively, and a trailing dot is
//! dropped (`Example.COM.` is `example.com`). Internationalised names are written in their punycode form
//! (`xn--bcher-kva.example`); a non-ASCII name is malformed, as is anything with userinfo (`user@host`), a path,
//! a scheme or whitespace. A bare `*` is malformed: there is no "allow everything" spec.
//!
//! IPv4-mapped IPv6 addresses (`[::ffff:10.0.0.1]`) are treated as the IPv4 address they map.

use std::fmt;
use std::net::{IpAddr, Ipv6Addr};
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A spec that is not a valid `HOST[:PORT]`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AllowlistError {
    /// The spec as a whole is malformed; `why` says how.
    #[error("--allow-net {spec:?} is malformed: {why}")]
    Malformed {
        /// The spec as given.
        spec: String,
        /// What is wrong with it.
        why: &'static str,
    },
}

/// A tier meets a malformed spec only when its caller skipped the parse-time check: a `wrong_format` error naming it.
impl From<AllowlistError> for crate::TierError {
    fn from(err: AllowlistError) -> Self {
        match err {
            AllowlistError::Malformed { spec, why } => crate::TierError::WrongFormat {
                what: format!("--allow-net {spec:?} ({why})"),
                expected: "a HOST[:PORT] allowlist entry",
            },
        }
    }
}

/// A host as the proxy sees it in a request or a spec: a normalised name or an IP address.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Host {
    /// A DNS name: lowercase ASCII labels, no trailing dot.
    Name(String),
    /// An IP literal (IPv4-mapped IPv6 addresses are stored as IPv4).
    Ip(IpAddr),
}

impl Host {
    /// Parses a host as written in a request or spec (`[v6]` brackets accepted), normalising it; `Err` says why
    /// it is not a host.
    pub fn parse(s: &str) -> Result<Host, &'static str> {
        if let Some(inner) = s.strip_prefix('[') {
            let inner = inner.strip_suffix(']').ok_or("unbalanced '['")?;
            let ip: Ipv6Addr = inner.parse().map_err(|_| "not an IPv6 address inside brackets")?;
            return Ok(Host::Ip(IpAddr::V6(ip).to_canonical()));
        }
        if let Ok(ip) = s.parse::<IpAddr>() {
            return Ok(Host::Ip(ip.to_canonical()));
        }
        normalise_name(s).map(Host::Name)
    }

    /// The host as it would appear in an authority (`[v6]` bracketed).
    pub fn to_authority(&self) -> String {
        match self {
            Host::Name(n) => n.clone(),
            Host::Ip(IpAddr::V6(ip)) => format!("[{ip}]"),
            Host::Ip(ip) => ip.to_string(),
        }
    }

    /// The name, if this host is a name.
    pub fn name(&self) -> Option<&str> {
        match self {
            Host::Name(n) => Some(n),
            Host::Ip(_) => None,
        }
    }
}

impl fmt::Display for Host {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Host::Name(n) => f.write_str(n),
            Host::Ip(ip) => write!(f, "{ip}"),
        }
    }
}

/// Lowercases and validates a DNS name: ASCII letters, digits, `-` and `_` in labels of 1–63 bytes, at most 253
/// bytes, one optional trailing dot dropped. A name whose last label is numeric (`2130706433`, `1.2.3.04`,
/// `0x7f.1`) is refused: resolvers would read it as an IP address in a form the allowlist cannot see.
pub fn normalise_name(s: &str) -> Result<String, &'static str> {
    let s = s.strip_suffix('.').unwrap_or(s);
    if s.is_empty() {
        return Err("empty host");
    }
    if s.len() > 253 {
        return Err("host longer than 253 bytes");
    }
    if s.contains('@') {
        return Err("userinfo ('@') is not allowed in a host");
    }
    if !s.is_ascii() {
        return Err("non-ASCII host (write internationalised names in punycode, xn--...)");
    }
    let lower = s.to_ascii_lowercase();
    let mut last = "";
    for label in lower.split('.') {
        if label.is_empty() {
            return Err("empty label in host");
        }
        if label.len() > 63 {
            return Err("label longer than 63 bytes");
        }
        if !label.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_') {
            return Err("invalid character in host");
        }
        if label.starts_with('-') || label.ends_with('-') {
            return Err("label starts or ends with '-'");
        }
        last = label;
    }
    let numeric = last.bytes().all(|b| b.is_ascii_digit())
        || (last.starts_with("0x") && last[2..].bytes().all(|b| b.is_ascii_hexdigit()));
    if numeric {
        return Err("numeric host that is not a dotted-quad IP address");
    }
    Ok(lower)
}

/// What a rule's host part matches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostPattern {
    /// This name exactly.
    Exact(String),
    /// Names with one or more labels in front of this suffix (stored without the `*.`).
    Subdomains(String),
    /// This IP address.
    Ip(IpAddr),
}

/// One parsed `HOST[:PORT]` spec.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllowRule {
    /// The host part.
    pub host: HostPattern,
    /// The port, or `None` for any port.
    pub port: Option<u16>,
}

impl AllowRule {
    /// Whether this rule allows `host:port`.
    pub fn matches(&self, host: &Host, port: u16) -> bool {
        if self.port.is_some_and(|p| p != port) {
            return false;
        }
        match (&self.host, host) {
            (HostPattern::Exact(a), Host::Name(b)) => a == b,
            (HostPattern::Subdomains(suffix), Host::Name(b)) => b
                .strip_suffix(suffix.as_str())
                .and_then(|front| front.strip_suffix('.'))
                .is_some_and(|front| !front.is_empty()),
            (HostPattern::Ip(a), Host::Ip(b)) => a == b,
            _ => false,
        }
    }
}

impl FromStr for AllowRule {
    type Err = AllowlistError;

    fn from_str(spec: &str) -> Result<AllowRule, AllowlistError> {
        let bad = |why| AllowlistError::Malformed { spec: spec.to_string(), why };
        if spec.is_empty() {
            return Err(bad("empty spec"));
        }
        if spec.contains("://") || spec.contains('/') {
            return Err(bad("a spec is HOST[:PORT], without scheme or path"));
        }
        if spec.contains('@') {
            return Err(bad("userinfo ('@') is not allowed"));
        }
        if spec.bytes().any(|b| b.is_ascii_whitespace() || b.is_ascii_control()) {
            return Err(bad("whitespace or control character"));
        }
        // `::1:443` is itself an IPv6 address: brackets keep address and port apart.
        if spec.parse::<Ipv6Addr>().is_ok() {
            return Err(bad("IPv6 addresses are written in brackets: [v6] or [v6]:port"));
        }
        let (host, port) = split_host_port(spec).map_err(bad)?;
        let port = match port {
            None => None,
            Some(p) => Some(parse_port(p).map_err(bad)?),
        };
        let host = if let Some(suffix) = host.strip_prefix("*.") {
            match Host::parse(suffix).map_err(bad)? {
                Host::Name(n) => HostPattern::Subdomains(n),
                Host::Ip(_) => return Err(bad("a '*.' pattern needs a domain, not an IP address")),
            }
        } else if host.contains('*') {
            return Err(bad("'*' is only allowed as a whole leading label ('*.example.com')"));
        } else {
            match Host::parse(host).map_err(bad)? {
                Host::Name(n) => HostPattern::Exact(n),
                Host::Ip(ip) => HostPattern::Ip(ip),
            }
        };
        Ok(AllowRule { host, port })
    }
}

/// Splits `host[:port]` / `[v6][:port]`; the host part keeps its brackets.
pub fn split_host_port(s: &str) -> Result<(&str, Option<&str>), &'static str> {
    if s.starts_with('[') {
        let end = s.find(']').ok_or("unbalanced '['")?;
        let (host, rest) = s.split_at(end + 1);
        return match rest {
            "" => Ok((host, None)),
            _ => rest.strip_prefix(':').map(|p| (host, Some(p))).ok_or("junk after ']'"),
        };
    }
    match s.split_once(':') {
        None => Ok((s, None)),
        Some((_, p)) if p.contains(':') => Err("IPv6 addresses with a port need brackets: [v6]:port"),
        Some((h, p)) => Ok((h, Some(p))),
    }
}

/// A decimal port 1–65535.
pub fn parse_port(p: &str) -> Result<u16, &'static str> {
    if p.is_empty() || p.len() > 5 || !p.bytes().all(|b| b.is_ascii_digit()) {
        return Err("port is not a number 1-65535");
    }
    match p.parse::<u16>() {
        Ok(0) | Err(_) => Err("port is not a number 1-65535"),
        Ok(n) => Ok(n),
    }
}

/// The parsed `--allow-net` specs. Empty means every request is denied (the default).
///
/// It keeps the specs as written beside their rules: they are what messages name and what serialises (a list of
/// strings, parsed again on the way in, so a manifest or a request body with a malformed spec is refused).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Allowlist {
    specs: Vec<String>,
    rules: Vec<AllowRule>,
}

impl Allowlist {
    /// An allowlist that denies everything.
    pub fn deny_all() -> Allowlist {
        Allowlist::default()
    }

    /// Parses every spec; the first malformed one is the error.
    pub fn parse<I, S>(specs: I) -> Result<Allowlist, AllowlistError>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let mut list = Allowlist::default();
        for spec in specs {
            list.push(spec.as_ref())?;
        }
        Ok(list)
    }

    /// Adds one spec, unless the list already has it as written.
    fn push(&mut self, spec: &str) -> Result<(), AllowlistError> {
        if !self.specs.iter().any(|s| s == spec) {
            self.rules.push(spec.parse()?);
            self.specs.push(spec.to_owned());
        }
        Ok(())
    }

    /// These specs, then those of `extra` that are not among them (a policy's list and a job's `--allow-net`).
    pub fn union(&self, extra: &Allowlist) -> Allowlist {
        let mut list = self.clone();
        for (spec, rule) in extra.specs.iter().zip(&extra.rules) {
            if !list.specs.contains(spec) {
                list.specs.push(spec.clone());
                list.rules.push(rule.clone());
            }
        }
        list
    }

    /// The specs as written, in order.
    pub fn specs(&self) -> &[String] {
        &self.specs
    }

    /// The rules, in the order given.
    pub fn rules(&self) -> &[AllowRule] {
        &self.rules
    }

    /// Whether no rule is present (everything is denied).
    pub fn is_empty(&self) -> bool {
        self.rules.is_empty()
    }

    /// Whether some rule allows `host:port`.
    pub fn allows(&self, host: &Host, port: u16) -> bool {
        self.rules.iter().any(|r| r.matches(host, port))
    }

    /// Whether the name `host` may connect to the resolved address `ip` (DNS-rebinding defence): a public address
    /// always may; a loopback, private, link-local, unique-local, shared (CGNAT), unspecified, multicast or
    /// documentation address only when the allowlist names that IP (for this port) explicitly, or when `host` is
    /// `localhost`, the allowlist names `localhost` and `ip` is a loopback address.
    pub fn permits_resolved(&self, host: &Host, ip: IpAddr, port: u16) -> bool {
        let ip = ip.to_canonical();
        if is_public(ip) {
            return true;
        }
        if self.allows(&Host::Ip(ip), port) {
            return true;
        }
        ip.is_loopback() && host.name() == Some("localhost") && self.allows(host, port)
    }
}

impl Serialize for Allowlist {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.specs.serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for Allowlist {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Allowlist, D::Error> {
        let specs = Vec::<String>::deserialize(deserializer)?;
        Allowlist::parse(&specs).map_err(serde::de::Error::custom)
    }
}

/// Whether `ip` is an ordinary public unicast address.
pub fn is_public(ip: IpAddr) -> bool {
    match ip.to_canonical() {
        IpAddr::V4(v4) => {
            let o = v4.octets();
            !(v4.is_loopback()
                || v4.is_private()
                || v4.is_link_local()
                || v4.is_unspecified()
                || v4.is_broadcast()
                || v4.is_multicast()
                || v4.is_documentation()
                || o[0] == 0
                || (o[0] == 100 && (o[1] & 0xc0) == 64) // 100.64/10 shared address space
                || (o[0] == 192 && o[1] == 0 && o[2] == 0) // 192.0.0/24 protocol assignments
                || (o[0] == 198 && (o[1] & 0xfe) == 18) // 198.18/15 benchmarking
                || o[0] >= 240) // reserved
        }
        IpAddr::V6(v6) => {
            let s = v6.segments();
            !(v6.is_loopback()
                || v6.is_unspecified()
                || v6.is_multicast()
                || (s[0] & 0xfe00) == 0xfc00 // unique local
                || (s[0] & 0xffc0) == 0xfe80 // link local
                || (s[0] & 0xffc0) == 0xfec0 // site local (deprecated)
                || (s[0] == 0x2001 && s[1] == 0x0db8) // documentation
                || (s[0] == 0x0064 && s[1] == 0xff9b) // NAT64 (embeds an IPv4 address)
                || s[0] == 0x2002) // 6to4 (embeds an IPv4 address)
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn list(specs: &[&str]) -> Allowlist {
        Allowlist::parse(specs).expect("valid specs")
    }

    fn name(n: &str) -> Host {
        Host::parse(n).expect("valid host")
    }

    #[test]
    fn exact_host_matches_itself_only() {
        let a = list(&["example.com"]);
        assert!(a.allows(&name("example.com"), 443));
        assert!(a.allows(&name("example.com"), 22), "no port means any port");
        assert!(!a.allows(&name("www.example.com"), 443));
        assert!(!a.allows(&name("example.org"), 443));
    }

    #[test]
    fn wildcard_matches_subdomains_but_not_apex_or_lookalikes() {
        let a = list(&["*.example.com"]);
        assert!(a.allows(&name("a.example.com"), 443));
        assert!(a.allows(&name("a.b.example.com"), 443));
        assert!(!a.allows(&name("example.com"), 443), "bare apex");
        assert!(!a.allows(&name("evil-example.com"), 443));
        assert!(!a.allows(&name("evilexample.com"), 443));
        assert!(!a.allows(&name("example.com.evil.org"), 443));
        assert!(!a.allows(&name("a.example.com.evil.org"), 443));
    }

    #[test]
    fn exact_host_does_not_match_suffix_attacks() {
        let a = list(&["example.com"]);
        assert!(!a.allows(&name("example.com.evil.org"), 80));
        assert!(!a.allows(&name("evil-example.com"), 80));
        assert!(!a.allows(&name("xexample.com"), 80));
    }

    #[test]
    fn case_and_trailing_dot_are_normalised() {
        let a = list(&["Example.COM.", "*.Api.Example.Org"]);
        assert!(a.allows(&name("EXAMPLE.com"), 80));
        assert!(a.allows(&name("example.com."), 80));
        assert!(a.allows(&name("V1.API.example.org."), 80));
    }

    #[test]
    fn port_restricts_when_given() {
        let a = list(&["example.com:443", "*.svc.test:8080"]);
        assert!(a.allows(&name("example.com"), 443));
        assert!(!a.allows(&name("example.com"), 80));
        assert!(a.allows(&name("x.svc.test"), 8080));
        assert!(!a.allows(&name("x.svc.test"), 8081));
    }

    #[test]
    fn ip_literals_match_only_ip_rules() {
        let a = list(&["127.0.0.1:8080", "[::1]:9090", "[fe80::1]", "[2001:db8::2]"]);
        assert!(a.allows(&Host::parse("127.0.0.1").unwrap(), 8080));
        assert!(!a.allows(&Host::parse("127.0.0.1").unwrap(), 8081));
        assert!(a.allows(&Host::parse("[::1]").unwrap(), 9090));
        assert!(a.allows(&Host::parse("[FE80::1]").unwrap(), 1));
        assert!(a.allows(&Host::parse("2001:db8::2").unwrap(), 1));
        // IPv4-mapped IPv6 is the IPv4 address.
        assert!(a.allows(&Host::parse("[::ffff:127.0.0.1]").unwrap(), 8080));
        // A name never matches an IP rule, an IP never matches a name rule.
        assert!(!list(&["127.0.0.1"]).allows(&name("localhost"), 80));
    }

    #[test]
    fn punycode_is_kept_as_ascii_and_unicode_is_refused() {
        let a = list(&["xn--bcher-kva.example"]);
        assert!(a.allows(&name("XN--BCHER-KVA.example"), 443));
        assert!(Host::parse("bücher.example").is_err());
        assert!(matches!("bücher.example".parse::<AllowRule>(), Err(AllowlistError::Malformed { .. })));
    }

    #[test]
    fn userinfo_is_refused_in_specs_and_hosts() {
        for spec in ["user@example.com", "a:b@example.com", "example.com@evil.org", "@example.com"] {
            let err = spec.parse::<AllowRule>().unwrap_err();
            assert!(err.to_string().contains(spec), "{err} names the spec");
        }
        assert!(Host::parse("example.com@evil.org").is_err());
    }

    #[test]
    fn malformed_specs_are_typed_errors_naming_the_spec() {
        for spec in [
            "",
            "*",
            "*.",
            "*example.com",
            "a.*.example.com",
            "*.*.example.com",
            "example.com:",
            "example.com:0",
            "example.com:65536",
            "example.com:http",
            "http://example.com",
            "example.com/path",
            "exa mple.com",
            "example..com",
            ".example.com",
            "-example.com",
            "::1:443",
            "::1",
            "fe80::1",
            "[::1",
            "[::1]x",
            "[example.com]",
            "*.10.0.0.1",
            "2130706433",
            "0x7f.1",
            "1.2.3.04",
            &"a".repeat(64),
        ] {
            let err = Allowlist::parse([spec]).unwrap_err();
            let AllowlistError::Malformed { spec: named, .. } = &err;
            assert_eq!(named, spec, "{err}");
        }
    }

    #[test]
    fn empty_allowlist_denies_everything() {
        let a = Allowlist::deny_all();
        assert!(a.is_empty());
        assert!(!a.allows(&name("example.com"), 443));
    }

    #[test]
    fn private_addresses_need_an_explicit_ip_or_localhost() {
        let a = list(&["*.example.com", "localhost:8080", "10.1.2.3:443"]);
        let host = name("a.example.com");
        assert!(a.permits_resolved(&host, "93.184.216.34".parse().unwrap(), 443));
        for ip in ["127.0.0.1", "10.0.0.1", "192.168.1.1", "169.254.169.254", "::1", "fd00::1", "fe80::1", "0.0.0.0"] {
            assert!(!a.permits_resolved(&host, ip.parse().unwrap(), 443), "{ip}");
        }
        assert!(!a.permits_resolved(&host, "::ffff:127.0.0.1".parse().unwrap(), 443));
        // The IP named explicitly (for that port).
        assert!(a.permits_resolved(&host, "10.1.2.3".parse().unwrap(), 443));
        assert!(!a.permits_resolved(&host, "10.1.2.3".parse().unwrap(), 80));
        // localhost named explicitly may be loopback, not another private address.
        let lh = name("localhost");
        assert!(a.permits_resolved(&lh, "127.0.0.1".parse().unwrap(), 8080));
        assert!(a.permits_resolved(&lh, "::1".parse().unwrap(), 8080));
        assert!(!a.permits_resolved(&lh, "10.0.0.1".parse().unwrap(), 8080));
        assert!(!list(&["*.example.com"]).permits_resolved(&lh, "127.0.0.1".parse().unwrap(), 80));
    }

    #[test]
    fn union_keeps_order_and_drops_repeats() {
        let both = list(&["a.example", "b.example"]).union(&list(&["b.example", "c.example:443"]));
        assert_eq!(both.specs(), ["a.example", "b.example", "c.example:443"]);
        assert_eq!(both.rules().len(), 3);
        assert!(both.allows(&name("c.example"), 443));
    }

    #[test]
    fn serialises_as_written_and_refuses_a_malformed_spec_on_the_way_in() {
        let a = list(&["Example.COM", "*.x.org:443"]);
        let json = serde_json::to_string(&a).unwrap();
        assert_eq!(json, r#"["Example.COM","*.x.org:443"]"#);
        assert_eq!(serde_json::from_str::<Allowlist>(&json).unwrap(), a);
        let err = serde_json::from_str::<Allowlist>(r#"["ok.example","http://bad"]"#).unwrap_err();
        assert!(err.to_string().contains("http://bad"), "{err}");
    }
}
