//! Paths of the guest programs Strata's tests and benchmarks run. `build.rs` compiles `guests/` for
//! wasm32-wasip1 and `components/` for wasm32-wasip2 (`COMPONENT_*`), and assembles `wat/`; each constant is the
//! absolute path of one artifact.

#![forbid(unsafe_code)]

include!(concat!(env!("OUT_DIR"), "/programs.rs"));
