//! `/metrics` in the Prometheus text format: jobs by tier and outcome, active sandboxes, admission rejections,
//! HTTP responses by status, and latency histograms per tier and operation kept in HDR histograms.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::sync::Mutex;
use std::time::Duration;

use hdrhistogram::Histogram;
use strata_core::{Outcome, Status, TierKind};

use crate::registry::lock;

/// Bucket bounds of the latency histograms, in seconds.
const BUCKETS: [f64; 14] = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0];

/// A latency series: an HDR histogram of microseconds and the exact sum.
struct Latency {
    histogram: Histogram<u64>,
    sum: Duration,
}

impl Latency {
    fn new() -> Option<Latency> {
        // 1 µs to 1 hour at 3 significant digits; values beyond are clamped.
        Histogram::new_with_bounds(1, 3_600_000_000, 3).ok().map(|histogram| Latency { histogram, sum: Duration::ZERO })
    }
}

/// The server's counters and histograms.
#[derive(Default)]
pub struct Metrics {
    jobs: Mutex<BTreeMap<(&'static str, &'static str), u64>>,
    rejections: Mutex<BTreeMap<&'static str, u64>>,
    responses: Mutex<BTreeMap<u16, u64>>,
    sandboxes_created: Mutex<BTreeMap<&'static str, u64>>,
    latency: Mutex<HashMap<(&'static str, &'static str), Latency>>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

/// The `outcome` label of a job's result.
pub fn outcome_label(outcome: &Outcome) -> &'static str {
    match outcome.status {
        Status::Exited { code: 0 } => "ok",
        Status::Exited { .. } => "nonzero",
        Status::LimitExceeded { .. } => "limit_exceeded",
        Status::Trapped { .. } => "trapped",
        Status::Crashed { .. } => "crashed",
    }
}

impl Metrics {
    /// Counts a job that ran on `tier` and ended as `outcome` (`ok`, `nonzero`, `limit_exceeded`, `trapped`,
    /// `crashed`, or `error` when it could not run).
    pub fn job(&self, tier: TierKind, outcome: &'static str) {
        *lock(&self.jobs).entry((tier.as_str(), outcome)).or_default() += 1;
    }

    /// Counts a sandbox created on `tier`.
    pub fn sandbox_created(&self, tier: TierKind) {
        *lock(&self.sandboxes_created).entry(tier.as_str()).or_default() += 1;
    }

    /// Counts an admission rejection (`quota`, `capacity`, `shutting_down`).
    pub fn rejected(&self, reason: &'static str) {
        *lock(&self.rejections).entry(reason).or_default() += 1;
    }

    /// Counts an HTTP response.
    pub fn response(&self, status: u16) {
        *lock(&self.responses).entry(status).or_default() += 1;
    }

    /// Records how long `op` took on `tier` (`tier` is `none` for operations before a tier is known).
    pub fn latency(&self, tier: &'static str, op: &'static str, took: Duration) {
        let mut map = lock(&self.latency);
        let series = match map.entry((tier, op)) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(v) => match Latency::new() {
                Some(latency) => v.insert(latency),
                None => return,
            },
        };
        let micros = u64::try_from(took.as_micros()).unwrap_or(u64::MAX).clamp(1, series.histogram.high());
        series.histogram.saturating_record(micros);
        series.sum += took;
    }

    /// The text exposition, with `active` live sandboxes per tier, the `memory` bytes and `vcpus` they commit, and
    /// the host's vCPU slots (used, in all) when admission packs sandboxes onto its CPUs.
    pub fn render(
        &self,
        active: &HashMap<TierKind, usize>,
        memory: u64,
        vcpus: u64,
        host_slots: Option<(u64, u64)>,
    ) -> String {
        let mut out = String::new();
        out.push_str("# HELP strata_jobs_total Jobs run, by tier and outcome.\n# TYPE strata_jobs_total counter\n");
        for ((tier, outcome), n) in lock(&self.jobs).iter() {
            let _ = writeln!(out, "strata_jobs_total{{tier=\"{tier}\",outcome=\"{outcome}\"}} {n}");
        }
        out.push_str("# HELP strata_sandboxes_active Live sandboxes, by tier.\n# TYPE strata_sandboxes_active gauge\n");
        for tier in [TierKind::Wasm, TierKind::Process, TierKind::Microvm] {
            let n = active.get(&tier).copied().unwrap_or(0);
            let _ = writeln!(out, "strata_sandboxes_active{{tier=\"{tier}\"}} {n}");
        }
        out.push_str(
            "# HELP strata_memory_committed_bytes The sum of live sandboxes' memory limits.\n\
             # TYPE strata_memory_committed_bytes gauge\n",
        );
        let _ = writeln!(out, "strata_memory_committed_bytes {memory}");
        out.push_str(
            "# HELP strata_vcpus_committed The sum of live sandboxes' vcpus limits.\n\
             # TYPE strata_vcpus_committed gauge\n",
        );
        let _ = writeln!(out, "strata_vcpus_committed {vcpus}");
        if let Some((used, total)) = host_slots {
            out.push_str(
                "# HELP strata_host_vcpu_slots Host vCPU slots admission packs sandboxes into, by state.\n\
                 # TYPE strata_host_vcpu_slots gauge\n",
            );
            let _ = writeln!(out, "strata_host_vcpu_slots{{state=\"used\"}} {used}");
            let _ = writeln!(out, "strata_host_vcpu_slots{{state=\"total\"}} {total}");
        }
        out.push_str(
            "# HELP strata_sandboxes_created_total Sandboxes created, by tier.\n\
             # TYPE strata_sandboxes_created_total counter\n",
        );
        for (tier, n) in lock(&self.sandboxes_created).iter() {
            let _ = writeln!(out, "strata_sandboxes_created_total{{tier=\"{tier}\"}} {n}");
        }
        out.push_str(
            "# HELP strata_admission_rejections_total Requests refused admission, by reason.\n\
             # TYPE strata_admission_rejections_total counter\n",
        );
        for (reason, n) in lock(&self.rejections).iter() {
            let _ = writeln!(out, "strata_admission_rejections_total{{reason=\"{reason}\"}} {n}");
        }
        out.push_str(
            "# HELP strata_http_responses_total HTTP responses, by status.\n\
             # TYPE strata_http_responses_total counter\n",
        );
        for (status, n) in lock(&self.responses).iter() {
            let _ = writeln!(out, "strata_http_responses_total{{status=\"{status}\"}} {n}");
        }
        out.push_str(
            "# HELP strata_operation_duration_seconds Latency of API operations, by tier and operation.\n\
             # TYPE strata_operation_duration_seconds histogram\n",
        );
        let latency = lock(&self.latency);
        let mut keys: Vec<_> = latency.keys().copied().collect();
        keys.sort_unstable();
        for key @ (tier, op) in keys {
            let Some(series) = latency.get(&key) else { continue };
            let labels = format!("tier=\"{tier}\",op=\"{op}\"");
            for bound in BUCKETS {
                let micros = (bound * 1e6) as u64;
                let count = series.histogram.count_between(0, micros);
                let _ = writeln!(out, "strata_operation_duration_seconds_bucket{{{labels},le=\"{bound}\"}} {count}");
            }
            let total = series.histogram.len();
            let _ = writeln!(out, "strata_operation_duration_seconds_bucket{{{labels},le=\"+Inf\"}} {total}");
            let _ = writeln!(out, "strata_operation_duration_seconds_sum{{{labels}}} {}", series.sum.as_secs_f64());
            let _ = writeln!(out, "strata_operation_duration_seconds_count{{{labels}}} {total}");
        }
        out
    }

    /// `(p50, p99)` of `op` on `tier`, for logs and benchmarks.
    pub fn percentiles(&self, tier: &'static str, op: &'static str) -> Option<(Duration, Duration)> {
        let latency = lock(&self.latency);
        let series = latency.get(&(tier, op))?;
        let at = |q| Duration::from_micros(series.histogram.value_at_quantile(q));
        Some((at(0.5), at(0.99)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative_and_end_in_the_count() {
        let metrics = Metrics::default();
        metrics.latency("wasm", "exec", Duration::from_micros(300));
        metrics.latency("wasm", "exec", Duration::from_millis(3));
        metrics.latency("wasm", "exec", Duration::from_secs(20));
        let text = metrics.render(&HashMap::new(), 0, 0, Some((3, 256)));
        assert!(text.contains("strata_operation_duration_seconds_bucket{tier=\"wasm\",op=\"exec\",le=\"0.0005\"} 1"));
        assert!(text.contains("strata_operation_duration_seconds_bucket{tier=\"wasm\",op=\"exec\",le=\"0.005\"} 2"));
        assert!(text.contains("strata_operation_duration_seconds_bucket{tier=\"wasm\",op=\"exec\",le=\"10\"} 2"));
        assert!(text.contains("strata_operation_duration_seconds_bucket{tier=\"wasm\",op=\"exec\",le=\"+Inf\"} 3"));
        assert!(text.contains("strata_operation_duration_seconds_count{tier=\"wasm\",op=\"exec\"} 3"));
        assert!(text.contains("strata_sandboxes_active{tier=\"process\"} 0"));
        assert!(
            text.contains("strata_host_vcpu_slots{state=\"used\"} 3\nstrata_host_vcpu_slots{state=\"total\"} 256\n")
        );
    }
}
