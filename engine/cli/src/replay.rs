//! `strata replay`.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

use clap::Args;
use strata_core::{Determinism, ExecOptions, Recording, ReplayError, Replayer, TierKind};
use strata_engine::{Engine, EngineConfig, RunRequest, TierChoice};

use crate::Failure;

/// Exit status of a replay that diverged from its recording.
const DIVERGED: i32 = 1;

#[derive(Args)]
pub(crate) struct ReplayArgs {
    /// A recording made by `strata run --record FILE`.
    #[arg(value_name = "FILE")]
    file: PathBuf,

    /// Print the replay's output once it ends (by default only the verdict is printed).
    #[arg(long)]
    show_output: bool,

    /// Print one JSON object: `{"identical":true}` or `{"identical":false,"divergence":"…"}`.
    #[arg(long)]
    pub(crate) json: bool,
}

fn failure(err: ReplayError) -> Failure {
    Failure::new(err.code(), err.to_string())
}

pub(crate) fn replay(args: ReplayArgs) -> Result<i32, Failure> {
    let recording = Recording::read(&args.file).map_err(failure)?;
    let job = recording.job().map_err(failure)?;
    let caps = recording.caps();
    let limits = recording.limits.clone();
    let stdin = recording.stdin.0.clone();
    let replayer = Arc::new(Replayer::new(recording));
    let engine = Engine::new(EngineConfig { max_wasm_instances: 4, ..EngineConfig::from_env()? })?;
    let opts = ExecOptions {
        stdin: Some(stdin),
        determinism: Some(Determinism::Replay(replayer.clone())),
        ..ExecOptions::default()
    };
    let request = RunRequest::new(&job).caps(&caps).limits(limits).tier(TierChoice::Tier(TierKind::Wasm)).options(opts);
    let outcome = engine.execute(request)?;
    if args.show_output && !args.json {
        let _ = std::io::stdout().write_all(&outcome.stdout);
        let _ = std::io::stderr().write_all(&outcome.stderr);
    }
    let verdict = replayer.verdict(&outcome);
    if args.json {
        let value = match &verdict {
            Ok(()) => serde_json::json!({"identical": true, "status": outcome.status}),
            Err(divergence) => serde_json::json!({"identical": false, "divergence": divergence.to_string()}),
        };
        crate::run::print_json(&value)?;
        return Ok(if verdict.is_ok() { 0 } else { DIVERGED });
    }
    match verdict {
        Ok(()) => {
            let _ = writeln!(
                std::io::stdout(),
                "replay identical: {} bytes of stdout, {} bytes of stderr, {}",
                outcome.stdout.len(),
                outcome.stderr.len(),
                outcome.status
            );
            Ok(0)
        }
        Err(divergence) => {
            let _ = writeln!(std::io::stderr(), "strata: replay diverged: {divergence}");
            Ok(DIVERGED)
        }
    }
}
