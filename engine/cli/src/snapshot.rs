//! `strata snapshot create` and `strata snapshot inspect`.

use std::io::Write;
use std::path::PathBuf;

use clap::{Args, Subcommand};
use strata_core::{Outcome, Snapshot};

use crate::Failure;
use crate::run::{AsOutcome, Prepared, RunArgs, execute, prepare, print_json};

#[derive(Args)]
pub(crate) struct SnapshotArgs {
    #[command(subcommand)]
    command: SnapshotCommand,
}

#[derive(Subcommand)]
enum SnapshotCommand {
    /// Run a setup job in a fresh sandbox (or a fork of --snapshot) and snapshot the sandbox when the job exits
    /// with 0: `strata snapshot create [RUN OPTIONS] -o DIR FILE | -c CODE | -- COMMAND...`.
    Create(Box<CreateArgs>),
    /// Verify a snapshot (its seal by this home's key, format, every file's size and sha256) and print its
    /// manifest as JSON.
    Inspect(InspectArgs),
}

#[derive(Args)]
struct CreateArgs {
    /// The snapshot directory to write (it must not exist; it appears complete or not at all).
    #[arg(short = 'o', long = "output", value_name = "DIR")]
    output: PathBuf,

    #[command(flatten)]
    run: RunArgs,
}

#[derive(Args)]
struct InspectArgs {
    /// The snapshot directory.
    #[arg(value_name = "DIR")]
    dir: PathBuf,
}

/// The setup's outcome and the snapshot made from it.
struct Created {
    outcome: Outcome,
    snapshot: Option<Snapshot>,
}

impl AsOutcome for Created {
    fn outcome(&self) -> &Outcome {
        &self.outcome
    }
}

/// Whether `--json` was asked for (errors are JSON then too).
pub(crate) fn wants_json(args: &SnapshotArgs) -> bool {
    match &args.command {
        SnapshotCommand::Create(create) => create.run.json,
        SnapshotCommand::Inspect(_) => false,
    }
}

pub(crate) fn snapshot(args: SnapshotArgs) -> Result<i32, Failure> {
    match args.command {
        SnapshotCommand::Create(create) => self::create(*create),
        SnapshotCommand::Inspect(inspect) => {
            let engine = strata_engine::Engine::new(strata_engine::EngineConfig::from_env()?)?;
            let snapshot = engine.open_snapshot(&inspect.dir)?;
            let text = serde_json::to_string_pretty(&snapshot.manifest)
                .map_err(|e| Failure::new("internal", format!("cannot encode the manifest: {e}")))?;
            let _ = writeln!(std::io::stdout(), "{text}");
            Ok(0)
        }
    }
}

fn create(args: CreateArgs) -> Result<i32, Failure> {
    let output = args.output;
    let prepared = prepare(args.run, None)?;
    let Prepared { engine, limits, json, .. } = &prepared;
    let created = execute(*json, limits, prepared.request(), |request| {
        let (outcome, snapshot) = engine.snapshot(request, &output)?;
        Ok(Created { outcome, snapshot })
    })?;
    if *json {
        let manifest = created.snapshot.as_ref().map(|s| &s.manifest);
        print_json(&serde_json::json!({"outcome": created.outcome, "snapshot": manifest}))?;
    } else {
        let mut err = std::io::stderr();
        match &created.snapshot {
            Some(snapshot) => {
                let persists: Vec<String> =
                    snapshot.manifest.persists.iter().map(|p| format!("{p:?}").to_lowercase()).collect();
                let _ = writeln!(
                    err,
                    "strata: snapshot {} ({} tier, {}, keeps {})",
                    snapshot.dir.display(),
                    snapshot.tier,
                    human(snapshot.manifest.total_bytes),
                    persists.join(", ")
                );
            }
            None => {
                let _ = writeln!(err, "strata: the setup job did not succeed; no snapshot was written");
            }
        }
    }
    Ok(match created.snapshot {
        Some(_) => 0,
        None => match created.outcome.exit_code() {
            0 => 1,
            code => code,
        },
    })
}

/// `41943705` → `40.0 MiB`.
fn human(bytes: u64) -> String {
    const UNITS: [&str; 4] = ["KiB", "MiB", "GiB", "TiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut value = bytes as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.1} {}", UNITS[unit])
}
