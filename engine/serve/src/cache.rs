//! The server's cache budget (`strata serve --cache-budget SIZE`, [`crate::ServeConfig::cache_budget`]): the home's
//! caches are pruned ([`strata_engine::cache::prune`]) when the server starts and every [`PRUNE_INTERVAL`] after, on
//! a blocking thread, one run at a time (the next waits for the last to end), each logged with what it removed.
//! Compiled modules the server's own engine has loaded stay usable when they are evicted (their pages are mapped);
//! other processes compile them again.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use strata_engine::cache::{self, PrunePlan, PruneReport, Removal, human_size};

use crate::AppState;

/// How often a server with a cache budget prunes its home's caches.
pub const PRUNE_INTERVAL: Duration = Duration::from_secs(600);

/// Starts pruning the engine's home to `budget` (nothing without one, or without a home).
pub(crate) fn spawn(state: &Arc<AppState>, budget: Option<u64>) {
    let Some(budget) = budget else { return };
    let Some(home) = state.engine.home().map(Path::to_owned) else {
        tracing::warn!("a cache budget without a STRATA_HOME: there are no caches to prune");
        return;
    };
    tracing::info!(
        home = %home.display(),
        budget = %human_size(budget),
        every_s = PRUNE_INTERVAL.as_secs(),
        "cache budget: pruning the caches now and periodically"
    );
    crate::every(state, PRUNE_INTERVAL, move |_| {
        let home = home.clone();
        async move {
            let plan = PrunePlan { budget: Some(budget), dry_run: false };
            match tokio::task::spawn_blocking(move || cache::prune(&home, &plan)).await {
                Ok(Ok(report)) => log(&report),
                Ok(Err(err)) => tracing::warn!(error = %err, "cache prune failed"),
                Err(err) => tracing::error!(error = %err, "cache prune panicked"),
            }
        }
    });
}

/// One line per entry removed or left, and one for the whole run.
fn log(report: &PruneReport) {
    for (item, why) in &report.removed {
        let why = match why {
            Removal::Dead => item.status.name(),
            Removal::Evicted => "evicted (least recently used)",
        };
        let path = item.paths.first().map(|p| p.display().to_string()).unwrap_or_default();
        tracing::info!(category = %item.category, why, size = %human_size(item.bytes), path, "cache prune: removed");
    }
    for (item, error) in &report.failed {
        let path = item.paths.first().map(|p| p.display().to_string()).unwrap_or_default();
        tracing::warn!(category = %item.category, path, error, "cache prune: could not remove");
    }
    if !report.removed.is_empty() || report.over_budget().is_some() {
        tracing::info!(
            freed = %human_size(report.freed()),
            now = %human_size(report.after),
            budget = %report.budget.map(human_size).unwrap_or_default(),
            "cache prune done"
        );
    }
    if let Some(over) = report.over_budget() {
        tracing::warn!(
            over = %human_size(over),
            "the caches stay over the budget: the rest is in use (current installs, images' layers) or being compiled"
        );
    }
}
