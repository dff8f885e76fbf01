//! `strata images prune [--budget SIZE] [--dry-run]` and `strata images du`: the caches under `$STRATA_HOME`
//! (`strata_engine::cache`).

use std::io::Write;
use std::path::Path;
use std::time::SystemTime;

use clap::Args;
use strata_core::ByteSize;
use strata_engine::Engine;
use strata_engine::cache::{self, BUDGET_ENV, CacheItem, PrunePlan, Removal, human_age, human_size};

use crate::Failure;

/// `strata images prune`.
#[derive(Args)]
#[command(
    about = "Remove what is dead from the caches under $STRATA_HOME; with --budget, evict compiled modules LRU-first \
             too",
    long_about = "Remove what is dead from the caches under $STRATA_HOME, and with a budget evict compiled modules \
                  too.\n\n\
                  Always removed: Python runtimes of other versions than the pinned one; Debian installs of other \
                  recipes that no image is built on, and their microVM disks; kernels and initramfs archives of \
                  other keys; image-store layers no image uses (made more than a day ago); temporaries and build \
                  trees of processes that are gone; lock files without their entry.\n\n\
                  With a budget (--budget, else $STRATA_CACHE_BUDGET), compiled modules (modules/*.cwasm, and the \
                  Python memory images) are then evicted least recently used first until the caches fit; they are \
                  compiled again on their next use. A process that has a module loaded keeps using it.\n\n\
                  Never removed: the current Python runtime, Debian install, kernel and initramfs; the Debian \
                  installs and layers images use. Only these caches are counted (not run/, keys/ or anything else \
                  under $STRATA_HOME).\n\n\
                  Exit status 1 when an entry could not be removed (each is named on stderr); a budget the rest \
                  cannot meet is a warning."
)]
pub(crate) struct PruneArgs {
    /// Then evict compiled modules, least recently used first, until the caches hold at most SIZE (e.g. 10GiB).
    /// Default: $STRATA_CACHE_BUDGET when set, else no budget (only what is dead is removed).
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    budget: Option<ByteSize>,

    /// Print what would be removed and how much that frees; remove (and write) nothing.
    #[arg(long)]
    dry_run: bool,
}

/// `strata images du`.
#[derive(Args)]
#[command(
    about = "Show what the caches under $STRATA_HOME hold, by category and status (what prune would remove)",
    long_about = "How much the caches under $STRATA_HOME hold, by category (modules, python, debian, disks, \
                        kernels, initramfs, layers) and status: current, used by images, cached (evictable under a \
                        budget), in use, old, unreferenced, leftover (the last three are what `strata images prune` \
                        removes)."
)]
pub(crate) struct DuArgs {
    /// One line per entry (status, size, last use, path), after the summary.
    #[arg(long, short)]
    verbose: bool,
}

fn parse_size(text: &str) -> Result<ByteSize, String> {
    text.parse::<ByteSize>().map_err(|e| e.to_string())
}

/// The budget `$STRATA_CACHE_BUDGET` sets (unset or empty: none), for `prune` and `strata serve`.
pub(crate) fn budget_from_env() -> Result<Option<ByteSize>, Failure> {
    match std::env::var(BUDGET_ENV) {
        Ok(text) if !text.trim().is_empty() => {
            text.parse().map(Some).map_err(|err| Failure::new("usage", format!("{BUDGET_ENV}: {err}")))
        }
        _ => Ok(None),
    }
}

fn home(engine: &Engine) -> Result<&Path, Failure> {
    engine.home().ok_or_else(|| Failure::new("no_home", "no STRATA_HOME (nor HOME): there are no caches"))
}

fn cache_failure(err: cache::CacheError) -> Failure {
    Failure::new("cache", err.to_string())
}

/// `path` under `home` as `$STRATA_HOME/…`.
fn shown(home: &Path, path: &Path) -> String {
    match path.strip_prefix(home) {
        Ok(relative) => format!("$STRATA_HOME/{}", relative.display()),
        Err(_) => path.display().to_string(),
    }
}

/// The path that names an entry: its data, not its checksum, stamp or lock.
fn main_path(item: &CacheItem) -> Option<&Path> {
    let side = |p: &&std::path::PathBuf| {
        let name = p.file_name().map(|n| n.to_string_lossy()).unwrap_or_default();
        [".sum", ".lock", ".json", ".sha256"].iter().any(|s| name.ends_with(s))
    };
    item.paths.iter().find(|p| !side(p)).or(item.paths.first()).map(|p| p.as_path())
}

pub(crate) fn prune(engine: &Engine, args: PruneArgs) -> Result<i32, Failure> {
    let home = home(engine)?;
    let budget = match args.budget {
        Some(budget) => Some(budget),
        None => budget_from_env()?,
    };
    let plan = PrunePlan { budget: budget.map(|b| b.0), dry_run: args.dry_run };
    let report = cache::prune(home, &plan).map_err(cache_failure)?;
    let now = SystemTime::now();
    let mut out = std::io::stdout().lock();
    let verb = if report.dry_run { "would remove" } else { "removed" };
    for (item, why) in &report.removed {
        let why = match why {
            Removal::Dead => item.status.name().to_owned(),
            Removal::Evicted => format!("evicted (used {} ago)", human_age(item.last_used, now)),
        };
        let path = main_path(item).map(|p| shown(home, p)).unwrap_or_default();
        let _ = writeln!(out, "{verb}  {:<9} {why:<24} {:>10}  {path}", item.category.name(), human_size(item.bytes));
    }
    let budget_text = report.budget.map(|b| format!("; budget {}", human_size(b))).unwrap_or_default();
    let _ = writeln!(
        out,
        "{} {}: the caches hold {}, {} {}{budget_text}",
        if report.dry_run { "would free" } else { "freed" },
        human_size(report.freed()),
        human_size(report.before),
        if report.dry_run { "would hold" } else { "now" },
        human_size(report.after),
    );
    drop(out);
    if let Some(over) = report.over_budget() {
        crate::progress::line(
            &format!(
                "still {} over the budget: the rest is in use (current installs, images' layers) or being compiled \
                 (`strata images du` shows what)",
                human_size(over)
            ),
            true,
        );
    }
    for (item, error) in &report.failed {
        let path = main_path(item).map(|p| shown(home, p)).unwrap_or_default();
        crate::progress::line(&format!("could not remove {path}: {error}"), true);
    }
    Ok(if report.failed.is_empty() { 0 } else { 1 })
}

pub(crate) fn du(engine: &Engine, args: DuArgs) -> Result<i32, Failure> {
    let home = home(engine)?;
    let usage = cache::usage(home).map_err(cache_failure)?;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(
        out,
        "{}: the caches hold {}; `strata images prune` frees {} (dead), a budget may evict {} more (compiled modules)",
        home.display(),
        human_size(usage.total()),
        human_size(usage.dead()),
        human_size(usage.evictable()),
    );
    let _ = writeln!(out, "{:<10} {:<24} {:>7} {:>11}", "category", "status", "entries", "size");
    for line in usage.summary() {
        let _ = writeln!(
            out,
            "{:<10} {:<24} {:>7} {:>11}",
            line.category.name(),
            line.status.name(),
            line.items,
            human_size(line.bytes)
        );
    }
    if args.verbose {
        let now = SystemTime::now();
        let _ = writeln!(out);
        let _ = writeln!(out, "{:<10} {:<24} {:>11} {:>9}  path", "category", "status", "size", "last use");
        for item in &usage.items {
            let path = main_path(item).map(|p| shown(home, p)).unwrap_or_default();
            let users =
                if item.used_by.is_empty() { String::new() } else { format!(" (by {})", item.used_by.join(", ")) };
            let _ = writeln!(
                out,
                "{:<10} {:<24} {:>11} {:>9}  {path}{users}",
                item.category.name(),
                item.status.name(),
                human_size(item.bytes),
                human_age(item.last_used, now),
            );
        }
    }
    Ok(0)
}
