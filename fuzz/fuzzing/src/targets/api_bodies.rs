//! The native API's JSON bodies (`engine/serve/src/api.rs`) as its handlers check them before anything starts:
//! `POST /v1/sandboxes`, `/v1/run`, `/v1/sandboxes/{id}/exec`, `/timeout` and `/v1/snapshots/{id}/fork`,
//! against a server's real state (its policy's limits are the ceiling).
//!
//! Input: a selector byte, then the body.
//!
//! Oracles: nothing panics; a refusal is a 4xx, never a server error; what passes stays under the policy (every
//! limit at most the policy's, a TTL within the server's bounds), variables have valid names and no NUL, a
//! command names a program and carries no NUL.

use std::sync::{Arc, OnceLock};

use strata_core::{Fuel, Job};
use strata_serve::api::fuzzing::check_body;
use strata_serve::{AppState, ServeConfig, Server};

/// A server's state, built once per process (its listener on a loopback port, never served).
fn state() -> &'static Arc<AppState> {
    static STATE: OnceLock<Arc<AppState>> = OnceLock::new();
    STATE.get_or_init(|| {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a runtime");
        let mut config = ServeConfig::new(strata_engine::EngineConfig::default());
        config.listen = "127.0.0.1:0".parse().expect("an address");
        config.state_dir = Some(crate::scratch::dir().join("serve"));
        let server = runtime.block_on(Server::bind(config)).expect("a server state");
        let state = server.state();
        // The runtime (its reaper task) and the listener live as long as the process.
        std::mem::forget(server);
        std::mem::forget(runtime);
        state
    })
}

/// Checks `data` as one request body.
pub fn run(data: &[u8]) {
    let Some((&kind, body)) = data.split_first() else { return };
    let state = state();
    let checked = match check_body(state, kind, body) {
        Ok(checked) => checked,
        Err(err) => {
            assert!(err.status.is_client_error(), "{} {}: {}", err.status, err.code, err.message);
            return;
        }
    };
    let ceiling = &state.policy.limits;
    if let Some(limits) = &checked.limits {
        assert!(limits.wall <= ceiling.wall && limits.cpu <= ceiling.cpu, "time limits above the policy's");
        assert!(limits.memory.0 <= ceiling.memory.0 && limits.output.0 <= ceiling.output.0);
        assert!(limits.disk.0 <= ceiling.disk.0 && limits.vcpus <= ceiling.vcpus);
        assert!(limits.pids <= ceiling.pids && limits.files <= ceiling.files);
        if let (Fuel::Limited(asked), Fuel::Limited(max)) = (limits.fuel, ceiling.fuel) {
            assert!(asked <= max, "fuel above the policy's");
        }
    }
    if let Some(ttl) = checked.ttl {
        assert!(!ttl.is_zero() && ttl <= state.max_ttl, "ttl {ttl:?}");
    }
    if let Some(caps) = &checked.caps {
        for var in caps.env.iter().chain(&caps.secrets) {
            assert!(!var.name.is_empty() && !var.name.contains(['=', '\0']) && !var.value.contains('\0'));
        }
    }
    if let Some(Job::Command { argv }) = &checked.job {
        assert!(argv.first().is_some_and(|p| !p.is_empty()) && argv.iter().all(|a| !a.contains('\0')));
    }
}
