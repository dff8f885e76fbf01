//! The routing rule, as a pure function: given the policy's `[tiers]`, the job, what the Python scan says and
//! which tiers this host can start, which tier runs the job and why. It starts nothing and reads no file, so every
//! case is a unit test with fake tiers ([`TierSet`]); the [`Engine`](crate::Engine) supplies the real ones.

use strata_core::{Escalation, Job, JobKind, RouteDecision, TierError, TierKind};

use crate::EngineError;
use crate::TierChoice;
use crate::policy::TierPolicy;
use crate::scan::PythonVerdict;

/// Which tiers can run on this host: `Err(reason)` for one that cannot (no hardware KVM, not root, an image that
/// cannot be built). Asking may start the tier (the engine's tiers start on first use).
pub trait TierSet {
    /// Whether `tier` can run jobs here.
    fn available(&self, tier: TierKind) -> Result<(), EngineError>;
}

/// Where a job goes: the tier, the fallback taken on the way if any, and the decision the outcome reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoutePlan {
    /// The tier that runs it.
    pub tier: TierKind,
    /// Set when the preferred tier could not run here and the policy let the job fall back to `tier`.
    pub escalation: Option<Escalation>,
    /// The tier and why, as the outcome's `route` reports it.
    pub decision: RouteDecision,
}

/// The routing rule of one policy.
#[derive(Debug, Clone, Copy)]
pub struct Router<'p> {
    policy: &'p TierPolicy,
}

impl<'p> Router<'p> {
    /// The router of this `[tiers]` policy.
    pub fn new(policy: &'p TierPolicy) -> Router<'p> {
        Router { policy }
    }

    /// Where `job` goes when the user chose `choice`. `python` is asked only for a Python job under `Auto` on a
    /// policy that allows wasm (it runs the import scan); `tiers` only for the tier chosen and its fallback.
    ///
    /// `Auto` sends WebAssembly to wasm; Linux programs and commands to the policy's native tier; Python where
    /// `python` says, except that a Python job the scan sends native stays on wasm when the policy allows no
    /// native tier or the native tier cannot run here (and no fallback applies), and goes native when wasm is not
    /// allowed. When the native tier is the microVM and it cannot run here, a policy with `fallback` sends the job
    /// to the process tier and says so in the plan's [`Escalation`]. An explicit tier that cannot run the job's
    /// kind is `wrong_job`; a tier the policy does not allow is `tier_not_allowed`.
    pub fn plan(
        &self,
        choice: TierChoice,
        job: &Job,
        python: impl FnOnce() -> PythonVerdict,
        tiers: &dyn TierSet,
    ) -> Result<RoutePlan, EngineError> {
        let policy = self.policy;
        let allowed = |tier: TierKind| {
            if policy.allows(tier) { Ok(tier) } else { Err(EngineError::TierNotAllowed { tier }) }
        };
        let native_reason = |what: &str| format!("{what} → the policy's native tier");
        let (tier, why) = match choice {
            TierChoice::Tier(tier) => {
                let runs = match tier {
                    TierKind::Wasm => matches!(job.kind(), JobKind::Wasm | JobKind::Python),
                    TierKind::Process | TierKind::Microvm => job.kind() != JobKind::Wasm,
                };
                if !runs {
                    return Err(TierError::WrongJob { tier, job: job.kind() }.into());
                }
                (allowed(tier)?, format!("explicit --tier {tier}"))
            }
            TierChoice::Auto => match job {
                Job::Wasm { .. } => (allowed(TierKind::Wasm)?, "wasm module".to_owned()),
                Job::Native { .. } => (allowed(policy.native)?, native_reason("ELF program")),
                Job::Command { .. } => (allowed(policy.native)?, native_reason("command")),
                Job::Python { .. } if !policy.allows(TierKind::Wasm) => {
                    (allowed(policy.native)?, native_reason("python: the policy does not allow wasm"))
                }
                Job::Python { .. } => match python() {
                    PythonVerdict::Wasm(reason) => (TierKind::Wasm, reason),
                    PythonVerdict::Native(reason) if !policy.allows(policy.native) => {
                        (TierKind::Wasm, format!("{reason}, but the policy allows only wasm"))
                    }
                    PythonVerdict::Native(reason) => return self.python_native(reason, tiers),
                    PythonVerdict::Numerics(reason) if !policy.allows(policy.native) => {
                        let native = format!("the policy allows no native tier ({})", policy.native);
                        return Err(EngineError::Wasm32Numerics { reason, native });
                    }
                    PythonVerdict::Numerics(reason) => {
                        let why = format!("{reason} → the policy's native tier");
                        return match self.resolve(TierChoice::Auto, policy.native, why, tiers) {
                            Err(unavailable @ EngineError::TierUnavailable { .. }) => {
                                Err(EngineError::Wasm32Numerics { reason, native: unavailable_phrase(&unavailable) })
                            }
                            other => other,
                        };
                    }
                },
            },
        };
        self.resolve(choice, tier, why, tiers)
    }

    /// Where a job escalated from wasm goes: the policy's native tier, or the process tier when the microVM
    /// cannot run here and the policy falls back.
    pub fn escalation(&self, tiers: &dyn TierSet) -> Result<RoutePlan, EngineError> {
        let native = self.policy.native;
        if !self.policy.allows(native) {
            return Err(EngineError::TierNotAllowed { tier: native });
        }
        self.resolve(TierChoice::Auto, native, "escalation".to_owned(), tiers)
    }

    /// `tier`, falling back from an unavailable microVM to the process tier when the policy says so.
    fn resolve(
        &self,
        choice: TierChoice,
        tier: TierKind,
        why: String,
        tiers: &dyn TierSet,
    ) -> Result<RoutePlan, EngineError> {
        let policy = self.policy;
        let fallback = choice == TierChoice::Auto && policy.fallback && policy.allows(TierKind::Process);
        let native = tier != TierKind::Wasm && choice == TierChoice::Auto;
        match tiers.available(tier) {
            Ok(()) => {
                let reason = if native { format!("{why} ({tier})") } else { why };
                Ok(RoutePlan { tier, escalation: None, decision: RouteDecision { tier, reason } })
            }
            Err(EngineError::TierUnavailable { tier: TierKind::Microvm, reason, cause }) if fallback => {
                tiers.available(TierKind::Process)?;
                let reason = match cause {
                    Some(cause) => format!("the microVM tier cannot run here: {reason}: {cause}"),
                    None => format!("the microVM tier cannot run here: {reason}"),
                };
                Ok(RoutePlan {
                    tier: TierKind::Process,
                    decision: RouteDecision { tier: TierKind::Process, reason: format!("{why} (process: {reason})") },
                    escalation: Some(Escalation { from: TierKind::Microvm, to: TierKind::Process, reason }),
                })
            }
            Err(err) => Err(err),
        }
    }

    /// A Python job the scan sends native; when the native tier cannot run here (and no fallback applies), it
    /// stays on wasm, saying why.
    fn python_native(&self, reason: String, tiers: &dyn TierSet) -> Result<RoutePlan, EngineError> {
        let native = self.policy.native;
        match self.resolve(TierChoice::Auto, native, format!("{reason} → the policy's native tier"), tiers) {
            Err(unavailable @ EngineError::TierUnavailable { .. }) => Ok(RoutePlan {
                tier: TierKind::Wasm,
                escalation: None,
                decision: RouteDecision {
                    tier: TierKind::Wasm,
                    reason: format!("{reason}, but {}", unavailable_phrase(&unavailable)),
                },
            }),
            other => other,
        }
    }
}

/// "the microvm tier is not available (why)", from a `TierUnavailable`.
fn unavailable_phrase(err: &EngineError) -> String {
    match err {
        EngineError::TierUnavailable { tier, reason, cause: Some(cause) } => {
            format!("the {tier} tier is not available ({reason}: {cause})")
        }
        EngineError::TierUnavailable { tier, reason, cause: None } => {
            format!("the {tier} tier is not available ({reason})")
        }
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;

    use strata_core::PythonSource;

    use super::*;

    /// Tiers that are available or not as the test says, recording which were asked.
    struct FakeTiers {
        down: Vec<(TierKind, &'static str)>,
        asked: RefCell<Vec<TierKind>>,
    }

    impl FakeTiers {
        fn all_up() -> FakeTiers {
            FakeTiers { down: Vec::new(), asked: RefCell::new(Vec::new()) }
        }

        fn without(down: &[(TierKind, &'static str)]) -> FakeTiers {
            FakeTiers { down: down.to_vec(), asked: RefCell::new(Vec::new()) }
        }
    }

    impl TierSet for FakeTiers {
        fn available(&self, tier: TierKind) -> Result<(), EngineError> {
            self.asked.borrow_mut().push(tier);
            match self.down.iter().find(|(down, _)| *down == tier) {
                Some((_, why)) => Err(EngineError::TierUnavailable { tier, reason: (*why).to_owned(), cause: None }),
                None => Ok(()),
            }
        }
    }

    fn python() -> Job {
        Job::Python { source: PythonSource::Code("print(1)".into()), args: Vec::new() }
    }

    fn command() -> Job {
        Job::Command { argv: vec!["true".into()] }
    }

    fn wasm() -> Job {
        Job::wasm_file("/x.wasm", Vec::new())
    }

    fn to_wasm() -> PythonVerdict {
        PythonVerdict::Wasm("python: pure compute".into())
    }

    fn to_native() -> PythonVerdict {
        PythonVerdict::Native("python: imports subprocess".into())
    }

    fn no_scan() -> PythonVerdict {
        panic!("the scan must not run for this job")
    }

    #[test]
    fn auto_sends_wasm_to_wasm_and_commands_to_the_native_tier() {
        let policy = TierPolicy::default();
        let router = Router::new(&policy);
        let tiers = FakeTiers::all_up();
        let plan = router.plan(TierChoice::Auto, &wasm(), no_scan, &tiers).expect("routes");
        assert_eq!((plan.tier, plan.escalation), (TierKind::Wasm, None));
        let plan = router.plan(TierChoice::Auto, &command(), no_scan, &tiers).expect("routes");
        assert_eq!(plan.tier, TierKind::Microvm);
        assert_eq!(plan.decision.reason, "command → the policy's native tier (microvm)");
    }

    #[test]
    fn an_unavailable_microvm_falls_back_to_process_and_says_so() {
        let policy = TierPolicy::default();
        let tiers = FakeTiers::without(&[(TierKind::Microvm, "no hardware KVM")]);
        let plan = Router::new(&policy).plan(TierChoice::Auto, &command(), no_scan, &tiers).expect("routes");
        assert_eq!(plan.tier, TierKind::Process);
        let escalation = plan.escalation.expect("an escalation");
        assert_eq!((escalation.from, escalation.to), (TierKind::Microvm, TierKind::Process));
        assert!(escalation.reason.contains("no hardware KVM"), "{}", escalation.reason);
        assert_eq!(*tiers.asked.borrow(), [TierKind::Microvm, TierKind::Process]);
    }

    #[test]
    fn without_fallback_an_unavailable_native_tier_is_an_error() {
        let policy = TierPolicy { fallback: false, ..TierPolicy::default() };
        let tiers = FakeTiers::without(&[(TierKind::Microvm, "no hardware KVM")]);
        let err = Router::new(&policy).plan(TierChoice::Auto, &command(), no_scan, &tiers).expect_err("no tier");
        assert!(matches!(err, EngineError::TierUnavailable { tier: TierKind::Microvm, .. }), "{err}");
    }

    #[test]
    fn an_explicit_tier_never_falls_back() {
        let policy = TierPolicy::default();
        let tiers = FakeTiers::without(&[(TierKind::Microvm, "no hardware KVM")]);
        let choice = TierChoice::Tier(TierKind::Microvm);
        let err = Router::new(&policy).plan(choice, &command(), no_scan, &tiers).expect_err("no tier");
        assert!(matches!(err, EngineError::TierUnavailable { .. }), "{err}");
    }

    #[test]
    fn an_explicit_tier_that_cannot_run_the_job_is_wrong_job_before_any_tier_starts() {
        let policy = TierPolicy::default();
        let tiers = FakeTiers::all_up();
        let router = Router::new(&policy);
        let err = router.plan(TierChoice::Tier(TierKind::Process), &wasm(), no_scan, &tiers).expect_err("wrong");
        assert_eq!(err.code(), "wrong_job");
        let err = router.plan(TierChoice::Tier(TierKind::Wasm), &command(), no_scan, &tiers).expect_err("wrong");
        assert_eq!(err.code(), "wrong_job");
        assert!(tiers.asked.borrow().is_empty(), "no tier was asked");
    }

    #[test]
    fn python_goes_where_the_scan_says() {
        let policy = TierPolicy::default();
        let tiers = FakeTiers::without(&[(TierKind::Microvm, "no hardware KVM")]);
        let router = Router::new(&policy);
        assert_eq!(router.plan(TierChoice::Auto, &python(), to_wasm, &tiers).expect("routes").tier, TierKind::Wasm);
        let native = router.plan(TierChoice::Auto, &python(), to_native, &tiers).expect("routes");
        assert_eq!(native.tier, TierKind::Process, "the microVM falls back to process");
        assert!(native.decision.reason.starts_with("python: imports subprocess"), "{}", native.decision.reason);
    }

    #[test]
    fn python_the_scan_sends_native_stays_on_wasm_when_no_native_tier_can_run() {
        let policy = TierPolicy { fallback: false, ..TierPolicy::default() };
        let tiers = FakeTiers::without(&[(TierKind::Microvm, "no hardware KVM")]);
        let plan = Router::new(&policy).plan(TierChoice::Auto, &python(), to_native, &tiers).expect("routes");
        assert_eq!(plan.tier, TierKind::Wasm);
        assert!(plan.decision.reason.contains("the microvm tier is not available"), "{}", plan.decision.reason);
        let wasm_only = TierPolicy { allowed: vec![TierKind::Wasm], ..TierPolicy::default() };
        let plan = Router::new(&wasm_only).plan(TierChoice::Auto, &python(), to_native, &tiers).expect("routes");
        assert_eq!(plan.tier, TierKind::Wasm);
        assert!(plan.decision.reason.ends_with("but the policy allows only wasm"), "{}", plan.decision.reason);
    }

    fn to_numerics() -> PythonVerdict {
        PythonVerdict::Numerics("python: imports numpy, whose integer results on wasm32 could differ".into())
    }

    #[test]
    fn numpy_goes_native_and_never_quietly_back_to_wasm() {
        let policy = TierPolicy::default();
        let tiers = FakeTiers::without(&[(TierKind::Microvm, "no hardware KVM")]);
        let plan = Router::new(&policy).plan(TierChoice::Auto, &python(), to_numerics, &tiers).expect("routes");
        assert_eq!(plan.tier, TierKind::Process, "the microVM falls back to process");
        assert!(plan.decision.reason.starts_with("python: imports numpy"), "{}", plan.decision.reason);
        // Where a Python job that needs processes would stay on wasm, one that computes with numpy is refused.
        let no_fallback = TierPolicy { fallback: false, ..TierPolicy::default() };
        let err = Router::new(&no_fallback).plan(TierChoice::Auto, &python(), to_numerics, &tiers).expect_err("no");
        assert_eq!(err.code(), "wasm32_numerics");
        assert!(err.to_string().contains("the microvm tier is not available (no hardware KVM)"), "{err}");
        assert!(err.to_string().contains("--tier wasm"), "{err}");
        let wasm_only = TierPolicy { allowed: vec![TierKind::Wasm], ..TierPolicy::default() };
        let err = Router::new(&wasm_only).plan(TierChoice::Auto, &python(), to_numerics, &tiers).expect_err("no");
        assert_eq!(err.code(), "wasm32_numerics");
        assert!(err.to_string().contains("the policy allows no native tier"), "{err}");
        // Asked for by name, wasm runs it.
        let plan = Router::new(&policy).plan(TierChoice::Tier(TierKind::Wasm), &python(), no_scan, &tiers);
        assert_eq!(plan.expect("routes").tier, TierKind::Wasm);
    }

    #[test]
    fn python_goes_native_without_a_scan_when_the_policy_forbids_wasm() {
        let policy =
            TierPolicy { allowed: vec![TierKind::Process], native: TierKind::Process, ..TierPolicy::default() };
        let plan = Router::new(&policy).plan(TierChoice::Auto, &python(), no_scan, &FakeTiers::all_up()).expect("ok");
        assert_eq!(plan.tier, TierKind::Process);
    }

    #[test]
    fn a_tier_the_policy_does_not_allow_is_refused_whoever_chose_it() {
        let policy = TierPolicy { allowed: vec![TierKind::Wasm], ..TierPolicy::default() };
        let router = Router::new(&policy);
        let tiers = FakeTiers::all_up();
        for choice in [TierChoice::Auto, TierChoice::Tier(TierKind::Process)] {
            let err = router.plan(choice, &command(), no_scan, &tiers).expect_err("not allowed");
            assert_eq!(err.code(), "tier_not_allowed", "{choice}");
        }
    }

    #[test]
    fn an_escalation_goes_to_the_native_tier_or_its_fallback() {
        let policy = TierPolicy::default();
        let tiers = FakeTiers::without(&[(TierKind::Microvm, "no hardware KVM")]);
        let plan = Router::new(&policy).escalation(&tiers).expect("routes");
        assert_eq!(plan.tier, TierKind::Process);
        assert!(plan.escalation.is_some());
        let wasm_only = TierPolicy { allowed: vec![TierKind::Wasm], ..TierPolicy::default() };
        let err = Router::new(&wasm_only).escalation(&tiers).expect_err("not allowed");
        assert_eq!(err.code(), "tier_not_allowed");
    }

    #[test]
    fn the_fallback_needs_the_process_tier_allowed_and_available() {
        let no_process = TierPolicy { allowed: vec![TierKind::Wasm, TierKind::Microvm], ..TierPolicy::default() };
        let tiers = FakeTiers::without(&[(TierKind::Microvm, "no hardware KVM")]);
        let err = Router::new(&no_process).plan(TierChoice::Auto, &command(), no_scan, &tiers).expect_err("none");
        assert!(matches!(err, EngineError::TierUnavailable { tier: TierKind::Microvm, .. }), "{err}");
        let both_down = FakeTiers::without(&[(TierKind::Microvm, "no KVM"), (TierKind::Process, "not root")]);
        let policy = TierPolicy::default();
        let err = Router::new(&policy).plan(TierChoice::Auto, &command(), no_scan, &both_down).expect_err("none");
        assert!(matches!(err, EngineError::TierUnavailable { tier: TierKind::Process, .. }), "{err}");
    }
}
