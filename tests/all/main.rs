//! Strata's integration tests: one binary, a module per area.

mod adversarial;
mod capabilities;
mod concurrent_jobs;
mod egress;
mod escalation;
mod layout;
mod native;
mod policy;
mod python;
mod python_image;
mod replay;
mod routing;
mod snapshot_process;
mod snapshot_wasm;
mod stdin_stream;
mod terminal;
mod usage;
mod users;
mod util;
mod wasm_basics;
mod wasm_cache;
mod wasm_components;
mod wasm_fs;
mod wasm_limits;
mod wasm_sandbox;
mod zygote_process;
