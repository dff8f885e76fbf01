//! `strata doctor`.

use std::io::Write;

use clap::Args;
use strata_engine::{Engine, EngineConfig};

use crate::Failure;

#[derive(Args)]
pub(crate) struct DoctorArgs {
    /// Print the report as one JSON object.
    #[arg(long)]
    json: bool,
}

pub(crate) fn doctor(args: DoctorArgs) -> Result<i32, Failure> {
    let engine = Engine::new(EngineConfig::from_env()?)?;
    let report = engine.doctor();
    let mut out = std::io::stdout();
    if args.json {
        let text = serde_json::to_string(&report).map_err(|e| Failure::new("internal", e.to_string()))?;
        let _ = writeln!(out, "{text}");
        return Ok(0);
    }
    let yes = |b: bool| if b { "yes" } else { "no" };
    let _ = writeln!(out, "kernel      {}", report.kernel);
    let _ = writeln!(out, "root        {}", yes(report.root));
    let _ = writeln!(out, "kvm         {}: {}", report.kvm.kind, report.kvm.detail);
    let _ = writeln!(out, "cgroups     {}", report.cgroups.detail);
    let _ = writeln!(out, "namespaces  {}", report.namespaces.join(" "));
    let _ = writeln!(out, "seccomp     {}", yes(report.seccomp));
    let _ = writeln!(out, "overlayfs   {}", yes(report.overlayfs));
    for tier in &report.tiers {
        let state = if tier.available { "available" } else { "unavailable" };
        let _ = writeln!(out, "tier {:<8}{state}: {}", tier.tier.as_str(), tier.detail);
    }
    Ok(0)
}
