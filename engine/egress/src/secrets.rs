//! Egress secrets in the proxy: placeholders the guest holds, replaced by the value in the header values of
//! plain-HTTP requests to the hosts each secret is bound to ([`strata_core::egress_secret`]).
//!
//! [`EgressSecrets::bind`] gives each secret a fresh placeholder (one set per proxy, so per sandbox);
//! [`EgressSecrets::apply`] rewrites a request's header fields for its destination: toward a bound host every
//! occurrence of the placeholder in a header value becomes the value, and a secret with a header name sets that
//! header; toward any other host the placeholder is left as it is and the secret is reported as withheld. The
//! request line and the body are never touched, and the rewritten header fields must fit the proxy's head bound.

use std::fmt;

use strata_core::EgressSecret;

use crate::allow::{Allowlist, Host};

/// One secret as the proxy holds it.
#[derive(Clone)]
struct Binding {
    name: String,
    /// What the guest holds instead of the value (`None` for a secret that sets a header itself).
    placeholder: Option<String>,
    value: String,
    hosts: Allowlist,
    header: Option<String>,
}

impl fmt::Debug for Binding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Binding")
            .field("name", &self.name)
            .field("hosts", &self.hosts.specs())
            .field("header", &self.header)
            .finish_non_exhaustive()
    }
}

/// A proxy's egress secrets with their placeholders. `Debug` never shows a value or a placeholder.
#[derive(Debug, Clone, Default)]
pub struct EgressSecrets {
    bindings: Vec<Binding>,
}

/// Which secrets a request concerned, by name.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SecretUse {
    /// Put into the request (it went to a bound host).
    pub injected: Vec<String>,
    /// Its placeholder was in the request toward a host it is not bound to, and was left there.
    pub withheld: Vec<String>,
}

/// The header fields would outgrow the bound once the values are in.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("request header fields larger than {max} bytes with egress secrets put in")]
pub struct SecretsTooLarge {
    /// The bound.
    pub max: usize,
}

impl EgressSecrets {
    /// The secrets with a fresh placeholder each (those that set a header need none).
    pub fn bind(secrets: &[EgressSecret]) -> EgressSecrets {
        let bindings = secrets
            .iter()
            .map(|s| Binding {
                name: s.name.clone(),
                placeholder: s.header.is_none().then(|| strata_core::egress_secret::placeholder(&s.name)),
                value: s.value.clone(),
                hosts: s.hosts.clone(),
                header: s.header.clone(),
            })
            .collect();
        EgressSecrets { bindings }
    }

    /// The secrets with the given placeholders (tests and fuzzing, where they must be known in advance).
    pub fn with_placeholders<'a>(secrets: impl IntoIterator<Item = (&'a EgressSecret, String)>) -> EgressSecrets {
        let bindings = secrets
            .into_iter()
            .map(|(s, placeholder)| Binding {
                name: s.name.clone(),
                placeholder: s.header.is_none().then_some(placeholder),
                value: s.value.clone(),
                hosts: s.hosts.clone(),
                header: s.header.clone(),
            })
            .collect();
        EgressSecrets { bindings }
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.bindings.is_empty()
    }

    /// The guest's environment for them: `NAME` = its placeholder.
    pub fn guest_env(&self) -> Vec<(String, String)> {
        self.bindings.iter().filter_map(|b| Some((b.name.clone(), b.placeholder.clone()?))).collect()
    }

    /// Rewrites `headers` for a request to `host:port`: see the module docs. `max_bytes` bounds the header fields
    /// as they would be written (`name: value\r\n` each); on `Err` the headers are as they were.
    pub fn apply(
        &self,
        headers: &mut Vec<(String, String)>,
        host: &Host,
        port: u16,
        max_bytes: usize,
    ) -> Result<SecretUse, SecretsTooLarge> {
        let mut used = SecretUse::default();
        if self.bindings.is_empty() {
            return Ok(used);
        }
        let too_large = SecretsTooLarge { max: max_bytes };
        let mut out = headers.clone();
        for b in &self.bindings {
            let bound = b.hosts.allows(host, port);
            if let Some(header) = &b.header {
                if bound {
                    out.retain(|(name, _)| !name.eq_ignore_ascii_case(header));
                    out.push((header.clone(), b.value.clone()));
                    used.injected.push(b.name.clone());
                }
                continue;
            }
            let Some(placeholder) = &b.placeholder else { continue };
            let mut seen = false;
            for (_, value) in out.iter_mut() {
                let count = value.matches(placeholder.as_str()).count();
                if count == 0 {
                    continue;
                }
                seen = true;
                if bound {
                    // Bounded before anything is allocated: the new length, then the replacement.
                    let grown = b.value.len().saturating_sub(placeholder.len()).saturating_mul(count);
                    if value.len().saturating_add(grown) > max_bytes {
                        return Err(too_large);
                    }
                    *value = value.replace(placeholder.as_str(), &b.value);
                }
            }
            if seen {
                if bound { &mut used.injected } else { &mut used.withheld }.push(b.name.clone());
            }
        }
        let size = out.iter().fold(0usize, |n, (k, v)| n.saturating_add(k.len() + v.len() + 4));
        if size > max_bytes {
            return Err(too_large);
        }
        *headers = out;
        Ok(used)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    const P: &str = "strata-secret-TOKEN-0123456789abcdef0123456789abcdef";

    fn secrets() -> EgressSecrets {
        let token = EgressSecret::new("TOKEN", "hunter2", ["api.example.com", "127.0.0.1:8080"]).unwrap();
        let key = EgressSecret::new("KEY", "Bearer k3y", ["other.example"]).unwrap().as_header("X-Api-Key").unwrap();
        EgressSecrets::with_placeholders([(&token, P.to_owned()), (&key, String::new())])
    }

    fn headers(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()
    }

    fn host(h: &str) -> Host {
        Host::parse(h).unwrap()
    }

    #[test]
    fn placeholders_become_the_value_in_every_header_toward_a_bound_host() {
        let mut h = headers(&[
            ("Authorization", &format!("Bearer {P}")),
            ("x-both", &format!("{P},{P}")),
            ("Accept", "*/*"),
            ("X-Near", "strata-secret-TOKEN-0123"),
        ]);
        let used = secrets().apply(&mut h, &host("API.example.com"), 80, 16 * 1024).unwrap();
        assert_eq!(used, SecretUse { injected: vec!["TOKEN".into()], withheld: vec![] });
        assert_eq!(
            h,
            headers(&[
                ("Authorization", "Bearer hunter2"),
                ("x-both", "hunter2,hunter2"),
                ("Accept", "*/*"),
                ("X-Near", "strata-secret-TOKEN-0123"),
            ])
        );
    }

    #[test]
    fn toward_another_host_or_port_the_placeholder_stays_and_is_withheld() {
        for (h, port) in [("evil.example", 80), ("127.0.0.1", 8081), ("sub.api.example.com", 80)] {
            let mut hs = headers(&[("Authorization", &format!("Bearer {P}"))]);
            let used = secrets().apply(&mut hs, &host(h), port, 16 * 1024).unwrap();
            assert_eq!(used, SecretUse { injected: vec![], withheld: vec!["TOKEN".into()] }, "{h}:{port}");
            assert_eq!(hs, headers(&[("Authorization", &format!("Bearer {P}"))]));
        }
        let mut hs = headers(&[("Accept", "*/*")]);
        assert_eq!(secrets().apply(&mut hs, &host("evil.example"), 80, 1024).unwrap(), SecretUse::default());
    }

    #[test]
    fn a_header_secret_replaces_the_header_whatever_its_case() {
        let mut h = headers(&[("x-api-KEY", "guest's own"), ("Accept", "*/*")]);
        let used = secrets().apply(&mut h, &host("other.example"), 8080, 1024).unwrap();
        assert_eq!(used.injected, ["KEY"]);
        assert_eq!(h, headers(&[("Accept", "*/*"), ("X-Api-Key", "Bearer k3y")]));
        let mut h = headers(&[("x-api-key", "guest's own")]);
        secrets().apply(&mut h, &host("api.example.com"), 80, 1024).unwrap();
        assert_eq!(h, headers(&[("x-api-key", "guest's own")]), "not bound there: untouched");
    }

    #[test]
    fn headers_growing_past_the_bound_are_refused_and_left_as_they_were() {
        let long = EgressSecret::new("TOKEN", &"v".repeat(4096), ["api.example.com"]).unwrap();
        let s = EgressSecrets::with_placeholders([(&long, P.to_owned())]);
        let original = headers(&[("A", &[P; 8].join(""))]);
        let mut h = original.clone();
        assert_eq!(s.apply(&mut h, &host("api.example.com"), 80, 16 * 1024), Err(SecretsTooLarge { max: 16 * 1024 }));
        assert_eq!(h, original);
        let mut h = headers(&[("A", P), ("B", P), ("C", P), ("D", P), ("E", P)]);
        assert!(s.apply(&mut h, &host("api.example.com"), 80, 16 * 1024).is_err(), "the sum of the fields");
        let mut h = headers(&[("A", P)]);
        assert!(s.apply(&mut h, &host("api.example.com"), 80, 16 * 1024).is_ok());
    }

    #[test]
    fn debug_shows_neither_values_nor_placeholders() {
        let shown = format!("{:?}", secrets());
        assert!(!shown.contains("hunter2") && !shown.contains(P) && !shown.contains("k3y"), "{shown}");
        let env = secrets().guest_env();
        assert_eq!(env, [("TOKEN".to_owned(), P.to_owned())], "a header secret gives the guest nothing");
        let fresh = EgressSecrets::bind(&[EgressSecret::new("TOKEN", "hunter2", ["x.example"]).unwrap()]);
        assert!(fresh.guest_env()[0].1.starts_with("strata-secret-TOKEN-"));
    }
}
