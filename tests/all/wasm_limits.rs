//! Every limit trips with its own kind.

use strata_core::{Capabilities, LimitKind, Status};
use strata_test_programs as programs;

use crate::util::{limits, run, stdout};

fn limit_of(status: &Status) -> Option<LimitKind> {
    match status {
        Status::LimitExceeded { limit } => Some(*limit),
        _ => None,
    }
}

#[test]
fn fuel_limit_stops_a_spinning_guest() {
    let outcome = run(programs::SPIN, &[], &Capabilities::default(), &limits("fuel = 5000000"));
    assert_eq!(limit_of(&outcome.status), Some(LimitKind::Fuel), "{outcome:?}");
    assert_eq!(outcome.usage.fuel, Some(5_000_000));
    assert_eq!(outcome.exit_code(), 124);
}

#[test]
fn wall_limit_stops_a_spinning_guest() {
    let outcome = run(programs::SPIN, &[], &Capabilities::default(), &limits("wall = \"200ms\""));
    assert_eq!(limit_of(&outcome.status), Some(LimitKind::Wall), "{outcome:?}");
    assert!(outcome.usage.wall >= std::time::Duration::from_millis(200));
}

#[test]
fn wall_limit_interrupts_a_guest_blocked_in_a_host_call() {
    let outcome = run(programs::SLEEP, &["20000"], &Capabilities::default(), &limits("wall = \"300ms\""));
    assert_eq!(limit_of(&outcome.status), Some(LimitKind::Wall), "{outcome:?}");
    assert!(!stdout(&outcome).contains("woke"), "the sleep must be cut short: {outcome:?}");
}

#[test]
fn a_short_sleep_within_the_limit_completes() {
    let outcome = run(programs::SLEEP, &["20"], &Capabilities::default(), &limits("wall = \"10s\""));
    assert_eq!(outcome.status, Status::Exited { code: 0 });
    assert_eq!(stdout(&outcome), "woke\n");
}

#[test]
fn cpu_limit_stops_a_spinning_guest_before_the_wall_limit() {
    let outcome = run(programs::SPIN, &[], &Capabilities::default(), &limits("cpu = \"200ms\"\nwall = \"60s\""));
    assert_eq!(limit_of(&outcome.status), Some(LimitKind::Cpu), "{outcome:?}");
    assert!(outcome.usage.cpu >= std::time::Duration::from_millis(200), "{:?}", outcome.usage);
}

#[test]
fn memory_limit_stops_a_guest_that_allocates_past_it() {
    let outcome = run(programs::ALLOC, &["64"], &Capabilities::default(), &limits("memory = \"16MiB\""));
    assert_eq!(limit_of(&outcome.status), Some(LimitKind::Memory), "{outcome:?}");
    assert!(outcome.usage.peak_memory <= 16 << 20, "{:?}", outcome.usage);
    assert!(outcome.usage.peak_memory > 8 << 20, "{:?}", outcome.usage);
}

#[test]
fn memory_limit_applies_to_the_initial_memory_too() {
    let outcome = run(programs::BIG_MEMORY_WAT, &[], &Capabilities::default(), &limits("memory = \"64MiB\""));
    assert_eq!(limit_of(&outcome.status), Some(LimitKind::Memory), "{outcome:?}");
    let outcome = run(programs::BIG_MEMORY_WAT, &[], &Capabilities::default(), &limits("memory = \"256MiB\""));
    assert_eq!(outcome.status, Status::Exited { code: 0 });
    assert_eq!(outcome.usage.peak_memory, 128 << 20);
}

#[test]
fn allocating_within_the_limit_succeeds_and_reports_peak_memory() {
    let outcome = run(programs::ALLOC, &["8"], &Capabilities::default(), &limits("memory = \"64MiB\""));
    assert_eq!(outcome.status, Status::Exited { code: 0 }, "{outcome:?}");
    assert_eq!(stdout(&outcome), "allocated 8 MiB\n");
    assert!(outcome.usage.peak_memory >= 8 << 20, "{:?}", outcome.usage);
}

#[test]
fn output_beyond_the_limit_is_truncated_and_counted() {
    let outcome = run(programs::FLOOD, &["100000"], &Capabilities::default(), &limits("output = \"1KiB\""));
    assert_eq!(outcome.status, Status::Exited { code: 0 }, "the guest must not be failed by the cap");
    assert!(outcome.truncated.stdout && outcome.truncated.stderr);
    assert_eq!((outcome.stdout.len(), outcome.stderr.len()), (1024, 1024));
    assert!(outcome.stdout.iter().all(|b| *b == b'x') && outcome.stderr.iter().all(|b| *b == b'y'));
    assert_eq!((outcome.usage.stdout_bytes, outcome.usage.stderr_bytes), (100_000, 100_000));
}

#[test]
fn an_output_flood_runs_to_completion_without_blocking() {
    let outcome = run(programs::FLOOD, &["67108864"], &Capabilities::default(), &limits("output = \"64KiB\""));
    assert_eq!(outcome.status, Status::Exited { code: 0 }, "{:?}", outcome.status);
    assert_eq!(outcome.usage.stdout_bytes, 64 << 20);
    assert!(outcome.truncated.stdout);
}

#[test]
fn output_exactly_at_the_limit_is_not_truncated() {
    let outcome = run(programs::FLOOD, &["4096"], &Capabilities::default(), &limits("output = \"4KiB\""));
    assert!(!outcome.truncated.stdout && !outcome.truncated.stderr, "{:?}", outcome.truncated);
}
