//! The fleet protocol's design record: see the crate documentation for the summary; the full record follows with
//! the simulation that checks it.
