//! The environment a job gets when its network goes through the egress proxy: one definition for every tier.

use crate::allow::{Allowlist, HostPattern};

/// The guest's own loopback names, which bypass the proxy unless the allowlist names one of them.
const LOOPBACK: [&str; 3] = ["localhost", "127.0.0.1", "::1"];

/// The variables that send a job's HTTP(S) clients through the proxy at `proxy_url` (the forwarder inside the
/// sandbox): `HTTP_PROXY`, `HTTPS_PROXY` and their lowercase spellings, and `NO_PROXY`/`no_proxy`.
///
/// `NO_PROXY` lists the sandbox's own loopback (`localhost,127.0.0.1,::1`), so a job that starts a server on its
/// loopback and requests it reaches its own server rather than a proxied `403`. When `allow` names a loopback
/// address or `localhost` itself (the *host's* loopback, for a server the operator runs beside Strata), those
/// requests must go through the proxy to leave the sandbox, and `NO_PROXY` is empty instead.
pub fn proxy_env(proxy_url: &str, allow: &Allowlist) -> Vec<(String, String)> {
    let names_loopback = allow.rules().iter().any(|rule| match &rule.host {
        HostPattern::Ip(ip) => ip.to_canonical().is_loopback(),
        HostPattern::Exact(name) => name == "localhost",
        HostPattern::Subdomains(_) => false,
    });
    let no_proxy = if names_loopback { String::new() } else { LOOPBACK.join(",") };
    let mut env: Vec<(String, String)> = ["HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"]
        .into_iter()
        .map(|name| (name.to_owned(), proxy_url.to_owned()))
        .collect();
    env.extend(["NO_PROXY", "no_proxy"].into_iter().map(|name| (name.to_owned(), no_proxy.clone())));
    env
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

    use super::*;

    fn no_proxy(specs: &[&str]) -> String {
        let env = proxy_env("http://127.0.0.1:3128", &Allowlist::parse(specs).unwrap());
        let proxies: Vec<_> = env.iter().filter(|(k, _)| k.ends_with("_PROXY") || k.ends_with("_proxy")).collect();
        assert_eq!(proxies.len(), 6, "{env:?}");
        for name in ["HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"] {
            assert!(env.contains(&(name.to_owned(), "http://127.0.0.1:3128".to_owned())), "{name}: {env:?}");
        }
        let upper = env.iter().find(|(k, _)| k == "NO_PROXY").unwrap().1.clone();
        assert_eq!(env.iter().find(|(k, _)| k == "no_proxy").unwrap().1, upper);
        upper
    }

    #[test]
    fn the_sandbox_loopback_bypasses_the_proxy_unless_the_allowlist_names_the_hosts() {
        assert_eq!(no_proxy(&["pypi.org:443", "*.example.com", "10.0.0.1"]), "localhost,127.0.0.1,::1");
        assert_eq!(no_proxy(&["127.0.0.1:8080"]), "");
        assert_eq!(no_proxy(&["127.1.2.3"]), "");
        assert_eq!(no_proxy(&["[::1]:80"]), "");
        assert_eq!(no_proxy(&["[::ffff:127.0.0.1]:80"]), "");
        assert_eq!(no_proxy(&["localhost:5000", "pypi.org"]), "");
        assert_eq!(no_proxy(&["*.localhost"]), "localhost,127.0.0.1,::1");
    }
}
