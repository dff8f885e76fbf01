//! `strata images build|list|verify`.

use std::io::Write;

use clap::{Args, Subcommand, ValueEnum};
use strata_core::{Fuel, Limits};
use strata_engine::{Engine, EngineConfig, EngineError};

use crate::Failure;

#[derive(Args)]
pub(crate) struct ImagesArgs {
    #[command(subcommand)]
    action: Action,
}

#[derive(Subcommand)]
enum Action {
    /// Fetch, verify and install an image, and compile it for this machine (minutes, once).
    Build {
        /// The image.
        #[arg(value_enum, default_value = "python")]
        image: Image,
        /// Also compile the fuel-metered variant (used by jobs with --fuel).
        #[arg(long)]
        metered: bool,
    },
    /// Show what is installed.
    List,
    /// Check every installed file against its pinned sha256.
    Verify,
}

#[derive(Clone, Copy, ValueEnum)]
enum Image {
    /// CPython 3.15 for wasm32-wasip1 with numpy and pandas (the wasm tier's Python).
    Python,
}

fn say(line: &str) {
    let _ = writeln!(std::io::stderr(), "strata: {line}");
}

pub(crate) fn images(args: ImagesArgs) -> Result<i32, Failure> {
    let engine = Engine::new(EngineConfig::from_env()?)?;
    let image = engine.python_image()?;
    match args.action {
        Action::Build { image: Image::Python, metered } => {
            let (installed, _) = image.ensure(&say).map_err(|e| EngineError::Image(e.to_string()))?;
            say(&format!("python runtime installed in {}", installed.dir.display()));
            let mut variants = vec![Limits::default()];
            if metered {
                variants.push(Limits { fuel: Fuel::Limited(u64::MAX), ..Limits::default() });
            }
            for limits in variants {
                let label = if limits.fuel.limit().is_some() { "fuel-metered" } else { "unmetered" };
                let outcome = engine.wasm().prepare_python(&limits).map_err(EngineError::from)?;
                say(&format!("python runtime ({label}) compiled code: {outcome:?}"));
            }
            Ok(0)
        }
        Action::List => {
            let dir = image.install_dir();
            let package = &image.manifest().package;
            let state = if image.is_installed() { "installed" } else { "not installed" };
            let _ =
                writeln!(std::io::stdout(), "python  {} {}  {state}  {}", package.name, package.version, dir.display());
            Ok(0)
        }
        Action::Verify => match image.verify() {
            Ok(installed) => {
                let _ = writeln!(std::io::stdout(), "python  ok  {}", installed.dir.display());
                Ok(0)
            }
            Err(err) => Err(Failure::new("artifact", format!("python image: {err}"))),
        },
    }
}
