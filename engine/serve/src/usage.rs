//! A sandbox's resource use over time: samples of [`SandboxUsage`] taken every few seconds by the server (and at
//! each request for them), kept for the last hour, each with its CPU use as a share of the sandbox's CPUs since
//! the sample before. `GET /v1/sandboxes/{id}/metrics` and E2B's `get_metrics()` read them.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::{Duration, SystemTime};

use serde::Serialize;
use strata_core::SandboxUsage;
use strata_core::sync::lock;
use utoipa::ToSchema;

/// How often the server samples every sandbox.
pub const SAMPLE_INTERVAL: Duration = Duration::from_secs(5);

/// The most samples kept per sandbox (an hour at [`SAMPLE_INTERVAL`]).
pub const MAX_SAMPLES: usize = 720;

/// One sample.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, ToSchema)]
pub struct UsageSample {
    /// When it was taken, in seconds since the Unix epoch.
    pub timestamp: f64,
    /// CPUs its jobs may use at once.
    pub cpu_count: u32,
    /// CPU used since the sample before, in percent of `cpu_count` CPUs (0 for the first).
    pub cpu_used_pct: f64,
    /// CPU time used since the sandbox started, in milliseconds.
    pub cpu_time_ms: f64,
    /// Memory charged to it, in bytes (page cache included).
    pub memory_used: u64,
    /// Of that, page cache.
    pub memory_cache: u64,
    /// Its memory limit.
    pub memory_total: u64,
    /// Bytes its writable filesystem holds.
    pub disk_used: u64,
    /// The size of its writable filesystem.
    pub disk_total: u64,
}

/// A sandbox's samples, oldest first.
#[derive(Debug, Default)]
pub struct UsageLog(Mutex<VecDeque<(SystemTime, SandboxUsage, f64)>>);

impl UsageLog {
    /// Records `usage`, measured at `at`.
    pub fn record(&self, at: SystemTime, usage: SandboxUsage) {
        let mut samples = lock(&self.0);
        let pct = match samples.back() {
            Some((before, previous, _)) => {
                let wall =
                    at.duration_since(*before).unwrap_or_default().as_secs_f64() * f64::from(usage.cpu_count.max(1));
                let cpu = usage.cpu_time.saturating_sub(previous.cpu_time).as_secs_f64();
                if wall > 0.0 { (cpu / wall * 100.0).clamp(0.0, 100.0) } else { 0.0 }
            }
            None => 0.0,
        };
        samples.push_back((at, usage, pct));
        while samples.len() > MAX_SAMPLES {
            samples.pop_front();
        }
    }

    /// The last sample taken, if any.
    pub fn latest(&self) -> Option<UsageSample> {
        let now = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default().as_secs_f64();
        self.between(None, Some(now + 1.0)).pop()
    }

    /// The samples taken from `start` to `end` (seconds since the epoch; either open).
    pub fn between(&self, start: Option<f64>, end: Option<f64>) -> Vec<UsageSample> {
        lock(&self.0)
            .iter()
            .map(|(at, usage, pct)| {
                let timestamp = at.duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default().as_secs_f64();
                UsageSample {
                    timestamp,
                    cpu_count: usage.cpu_count,
                    cpu_used_pct: *pct,
                    cpu_time_ms: usage.cpu_time.as_secs_f64() * 1000.0,
                    memory_used: usage.memory_used,
                    memory_cache: usage.memory_cache,
                    memory_total: usage.memory_total,
                    disk_used: usage.disk_used,
                    disk_total: usage.disk_total,
                }
            })
            .filter(|s| start.is_none_or(|start| s.timestamp >= start) && end.is_none_or(|end| s.timestamp <= end))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_use_is_the_share_of_the_cpus_between_samples_and_old_samples_go() {
        let log = UsageLog::default();
        let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1000);
        let usage = |cpu_ms: u64| SandboxUsage {
            cpu_count: 2,
            cpu_time: Duration::from_millis(cpu_ms),
            ..SandboxUsage::default()
        };
        log.record(t0, usage(0));
        // One of two CPUs busy for the whole second: 50 %.
        log.record(t0 + Duration::from_secs(1), usage(1000));
        let samples = log.between(None, None);
        assert_eq!(samples.iter().map(|s| s.cpu_used_pct).collect::<Vec<_>>(), [0.0, 50.0]);
        assert_eq!(log.between(Some(1000.5), None).len(), 1);
        assert_eq!(log.between(None, Some(1000.5)).len(), 1);
        for i in 0..MAX_SAMPLES as u64 + 5 {
            log.record(t0 + Duration::from_secs(2 + i), usage(1000));
        }
        assert_eq!(log.between(None, None).len(), MAX_SAMPLES);
    }
}
