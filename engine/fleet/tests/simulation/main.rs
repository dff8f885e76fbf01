//! Deterministic simulation of the fleet protocol: many seeded schedules of nodes, placers, a lossy network,
//! crashes, partitions and lease expiry over the etcd model, each checked after every step (`sim.rs` says what
//! is checked).
//!
//! `cargo test -p strata-fleet --test simulation` runs [`SCHEDULES`] schedules (seeds 0, 1, …; set
//! `STRATA_SIM_SCHEDULES` for more or fewer, `STRATA_SIM_FIRST` to start elsewhere); a failure prints its seed
//! and the trace of its steps, and `STRATA_SIM_SEED=N` reruns that one seed with its trace.

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

mod rng;
mod sim;

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

use sim::{Config, Failure, Stats};

/// Schedules per run unless `STRATA_SIM_SCHEDULES` says otherwise.
const SCHEDULES: u64 = 100_000;

fn env(name: &str) -> Option<u64> {
    std::env::var(name).ok().map(|v| v.trim().parse().unwrap_or_else(|_| panic!("{name}={v} is not a number")))
}

fn report(seed: u64, failure: &Failure) -> String {
    let trace = sim::run(seed, Config { trace: true, ..config_of(failure) }).err().map_or_else(Vec::new, |f| f.trace);
    let shown = trace.len().saturating_sub(400);
    let mut text = format!("seed {seed} fails at {} ms: {}\n", failure.at_ms, failure.message);
    if shown > 0 {
        text += &format!("(the first {shown} steps of the trace are left out)\n");
    }
    for line in &trace[shown..] {
        text += line;
        text.push('\n');
    }
    text += &format!(
        "seed {seed} fails: {}\nrerun it alone: STRATA_SIM_SEED={seed} cargo test -p strata-fleet --test simulation\n",
        failure.message
    );
    text
}

fn config_of(_failure: &Failure) -> Config {
    Config::default()
}

/// Runs seeds `first..first + count` over every core; the first failure found, or the totals.
fn run_many(first: u64, count: u64, cfg: Config) -> Result<Stats, (u64, Failure)> {
    let threads = std::thread::available_parallelism().map_or(1, usize::from).min(8) as u64;
    let next = AtomicU64::new(first);
    let stop = AtomicBool::new(false);
    let failed: Mutex<Option<(u64, Failure)>> = Mutex::new(None);
    let total = Mutex::new(Stats::default());
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| {
                let mut stats = Stats::default();
                while !stop.load(Ordering::Relaxed) {
                    let seed = next.fetch_add(1, Ordering::Relaxed);
                    if seed >= first + count {
                        break;
                    }
                    match sim::run(seed, cfg) {
                        Ok(s) => stats.add(&s),
                        Err(failure) => {
                            stop.store(true, Ordering::Relaxed);
                            let mut failed = failed.lock().unwrap();
                            if failed.as_ref().is_none_or(|(s, _)| seed < *s) {
                                *failed = Some((seed, failure));
                            }
                        }
                    }
                }
                total.lock().unwrap().add(&stats);
            });
        }
    });
    match failed.into_inner().unwrap() {
        Some(failure) => Err(failure),
        None => Ok(total.into_inner().unwrap()),
    }
}

#[test]
fn no_schedule_overcommits_a_node_or_gives_a_sandbox_two_owners() {
    if let Some(seed) = env("STRATA_SIM_SEED") {
        match sim::run(seed, Config { trace: true, ..Config::default() }) {
            Ok(stats) => println!("seed {seed} passes: {stats:?}"),
            Err(failure) => panic!("{}", report(seed, &failure)),
        }
        return;
    }
    let first = env("STRATA_SIM_FIRST").unwrap_or(0);
    let count = env("STRATA_SIM_SCHEDULES").unwrap_or(SCHEDULES);
    let started = Instant::now();
    match run_many(first, count, Config::default()) {
        Ok(s) => println!(
            "{} schedules (seeds {first}..{}) in {:.1} s: {} steps, {} create requests ({} succeeded, {} of them \
             after the placer's release found them confirmed; {} failed, {} of them for want of room), {} sandboxes \
             started, {} crashes, {} partitions, {} leases lost, {} stale reservations swept, {} lookups",
            s.schedules,
            first + count,
            started.elapsed().as_secs_f64(),
            s.steps,
            s.requests,
            s.successes,
            s.taken,
            s.failures,
            s.no_room,
            s.started,
            s.crashes,
            s.partitions,
            s.leases_lost,
            s.swept,
            s.lookups
        ),
        Err((seed, failure)) => panic!("{}", report(seed, &failure)),
    }
}

/// The first seed below `within` on which the broken `cfg` fails a check, and how.
fn first_failure(cfg: Config, within: u64) -> Option<(u64, Failure)> {
    (0..within).find_map(|seed| sim::run(seed, cfg).err().map(|f| (seed, f)))
}

#[test]
fn the_checker_catches_a_placer_that_skips_the_fencing_revision() {
    let broken = Config { skip_fencing: true, ..Config::default() };
    let (seed, failure) =
        first_failure(broken, 100).expect("a placer without the fencing compare passed 100 schedules");
    println!("without the fencing compare, seed {seed} fails: {}", failure.message);
    // The properties alone catch it too: two placers fill one node past its capacity.
    let (seed, failure) = first_failure(Config { properties_only: true, ..broken }, 2_000)
        .expect("without the alloc check, a placer without the fencing compare passed 2,000 schedules");
    println!("without the fencing compare, by the properties alone, seed {seed} fails: {}", failure.message);
    assert!(failure.message.contains("over-committed"), "{}", failure.message);
}

#[test]
fn the_checker_catches_a_node_that_confirms_for_another_incarnation() {
    let broken = Config { confirm_any_incarnation: true, properties_only: true, ..Config::default() };
    let (seed, failure) = first_failure(broken, 5_000).expect("passed 5,000 schedules");
    println!("confirming any incarnation, seed {seed} fails: {}", failure.message);
}

#[test]
fn the_checker_catches_a_placer_that_places_forwarded_ids_again() {
    let broken = Config { reuse_forwarded_ids: true, ..Config::default() };
    let (seed, failure) = first_failure(broken, 50_000).expect("passed 50,000 schedules");
    println!("placing forwarded ids again, seed {seed} fails: {}", failure.message);
}
