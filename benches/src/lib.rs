//! Strata benchmarks live in `benches/` (run `benches/run.sh`); this library is empty.
#![forbid(unsafe_code)]
