//! Recordings of reproducible runs (`engine/core/src/replay.rs`): the JSON file `strata replay FILE` reads,
//! which anyone may hand it.
//!
//! Input: the file's bytes. Oracles: [`Recording::from_slice`] never panics; an error is one line with a stable
//! code; a recording it accepts keeps its bounds, round-trips through [`Recording::to_json`] unchanged, and a
//! replay that reads exactly its inputs and ends as it ended is judged identical, while one more random byte is
//! a divergence.

use std::sync::Arc;

use strata_core::replay::{MAX_RANDOM_BYTES, MAX_READINGS, MAX_TOOL_EXCHANGES, ToolAnswer};
use strata_core::{
    Capabilities, Determinism, Divergence, Job, Limits, Outcome, PythonSource, Recording, Replayer, TierKind,
};

/// Parses `data` as a recording and replays its inputs.
pub fn run(data: &[u8]) {
    let recording = match Recording::from_slice(data) {
        Ok(recording) => recording,
        Err(err) => {
            let message = err.to_string();
            assert!(!message.contains('\n'), "a recording error over several lines: {message:?}");
            assert!(!err.code().is_empty());
            return;
        }
    };
    assert!(recording.wall_clock_ns.len() <= MAX_READINGS && recording.monotonic_clock_ns.len() <= MAX_READINGS);
    assert!(recording.random.0.len() <= MAX_RANDOM_BYTES && recording.tool_exchanges.len() <= MAX_TOOL_EXCHANGES);
    let again = Recording::from_slice(&recording.to_json()).expect("a recording written back parses");
    assert_eq!(again, recording, "a recording changed through JSON");

    let replayer = Arc::new(Replayer::new(recording.clone()));
    let job = Job::Python { source: PythonSource::Code(String::new()), args: Vec::new() };
    let inputs = Determinism::Replay(replayer.clone())
        .start(&job, &Capabilities::default(), &Limits::default(), None, false)
        .expect("a replay starts");
    for (i, want) in recording.wall_clock_ns.iter().enumerate() {
        assert_eq!(inputs.wall_clock_ns(), *want, "wall clock reading {i}");
    }
    for (i, want) in recording.monotonic_clock_ns.iter().enumerate() {
        assert_eq!(inputs.monotonic_ns(), *want, "monotonic clock reading {i}");
    }
    let mut random = vec![0u8; recording.random.0.len()];
    inputs.fill_random(&mut random);
    assert_eq!(random, recording.random.0);
    for exchange in &recording.tool_exchanges {
        assert_eq!(inputs.tool_answer(&exchange.request.0), ToolAnswer::Recorded(exchange.answer.0.clone()));
    }
    let expected = &recording.expected;
    let outcome = Outcome {
        stdout: expected.stdout.0.clone(),
        stderr: expected.stderr.0.clone(),
        ..Outcome::new(TierKind::Wasm, expected.status.clone())
    };
    assert_eq!(replayer.verdict(&outcome), Ok(()), "a faithful replay judged divergent");
    inputs.fill_random(&mut [0u8; 1]);
    assert!(
        matches!(replayer.verdict(&outcome), Err(Divergence::MissingInput { .. })),
        "a read past the recording not reported"
    );
}
