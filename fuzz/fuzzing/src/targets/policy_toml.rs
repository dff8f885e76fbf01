//! Policy files (`engine/src/policy.rs`): `policies/*.toml` and any file passed to `--policy`, whose `[limits]`,
//! `[tiers]`, `[escalation]`, `[network]` and `[grants.NAME]` tables decide what every job may use.
//!
//! Oracles: [`Policy::from_toml`] never panics; a policy it accepts is coherent (some tier allowed, the native
//! tier is not wasm, escalation on only with a native tier to escalate to, the allowlist made of valid specs, no
//! grant set granting one guest path twice); an error is one line that names the file.

use std::path::Path;

use strata_core::TierKind;
use strata_egress::AllowRule;
use strata_engine::{Policy, PolicyError};

/// Parses `data` as a policy file.
pub fn run(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let path = Path::new("/etc/strata/fuzz.toml");
    match Policy::from_toml(text, path) {
        Ok(policy) => {
            let tiers = &policy.tiers;
            assert!(!tiers.allowed.is_empty(), "a policy with no tier allowed");
            assert!(tiers.allowed.windows(2).all(|w| w[0] < w[1]), "allowed tiers not sorted and unique");
            assert_ne!(tiers.native, TierKind::Wasm, "wasm as the native tier");
            let native_allowed = tiers.allows(TierKind::Process) || tiers.allows(TierKind::Microvm);
            assert!(!policy.escalation.allowed || native_allowed, "escalation with no native tier allowed");
            for spec in policy.network.specs() {
                assert!(spec.parse::<AllowRule>().is_ok(), "allowlist spec {spec:?} kept but invalid");
            }
            for (name, grants) in &policy.grant_sets {
                for (i, grant) in grants.iter().enumerate() {
                    assert!(
                        grants[..i].iter().all(|g| g.guest != grant.guest),
                        "[grants.{name}] twice {}",
                        grant.guest
                    );
                    assert!(grant.host.is_absolute(), "[grants.{name}] relative host path {}", grant.host.display());
                }
            }
        }
        Err(err) => {
            let message = err.to_string();
            assert!(!message.contains('\n'), "a policy error over several lines: {message:?}");
            assert!(matches!(err, PolicyError::Invalid { .. }), "{message}");
            assert!(message.contains("/etc/strata/fuzz.toml"), "an error that does not name the file: {message}");
        }
    }
}
