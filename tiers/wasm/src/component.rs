//! Running WASI 0.2 command components (`wasm32-wasip2`): a `wasi:cli/command` instantiated in a fresh store and
//! its `wasi:cli/run` called, with everything a preview1 command gets.
//!
//! - **Same capabilities**, built by the same code ([`crate::exec::wasi_ctx`]): grants as preopened directories
//!   (read-only grants refuse every change), env and secrets, argv (`argv[0]` the program's name), stdin.
//!   Host tools (`host.call`) are a preview1 import and are not linked for components.
//! - **Same limits and stop reasons**: linear memory through the store's `ResourceLimiter` (`memory`), the
//!   wall clock and CPU time through epochs and the guarded call (`wall`, `cpu`), output caps through the
//!   capture pipes. **Fuel** is metered too: the tier's fuel is wasmtime's own `consume_fuel` engine setting (a
//!   job with a fuel limit runs on the fuel-metered engine), which applies to every core module inside a
//!   component as it does to a module, so `--fuel` works and `usage.fuel` is reported.
//! - **Network**: the only jobs on this tier with sockets; see [`crate::net`] for what the allowlist allows and
//!   how each connect attempt is logged in the outcome's `egress`, with its connection's bytes.
//! - **Compiled once**: components are cached on disk like modules, under keys of their own.
//!
//! Exit status: a guest that returns from `run` exited with 0, or with 1 when `run` returned its error (Rust's
//! `main` returning `Err`); `wasi:cli/exit` reports its code. Rust's std on `wasm32-wasip2` (1.95) exits through
//! `exit(result)`, which carries success or failure only, so `std::process::exit(3)` is reported as code 1; a
//! guest that calls `exit-with-code` (WASI 0.2.12) reports its exact code.
//!
//! Sandboxes run components one-shot per `exec`, like preview1 commands: nothing of a component outlives its
//! job, so a snapshot of such a sandbox holds its capabilities only.

use strata_core::{Outcome, Status, TierError};

use crate::exec::{ArmedStore, Captures, JobContext, JobState, WasiSpec, arm_store, guarded, status_of, wasi_ctx};
use crate::net::NetPolicy;
use crate::runtime::{PreparedComponent, Runtime};

/// Runs a prepared command component to completion.
pub(crate) fn execute(
    runtime: &Runtime<JobState>,
    prepared: &PreparedComponent<JobState>,
    program: &str,
    args: &[String],
    job: JobContext<'_>,
) -> Result<Outcome, TierError> {
    let net = NetPolicy::for_caps(job.caps)?;
    let captures = Captures::new(job.caps, job.limits, job.sink.clone());
    let wasi = wasi_ctx(WasiSpec::command(program, args, &job, net.clone()), &captures)?;
    let ArmedStore { mut store, measured, wall_deadline, _running } =
        arm_store(runtime, wasi, job.limits, job.cancel.clone(), job.tools)?;
    store.data_mut().net = net.clone();

    let ended = guarded(
        async {
            let command = prepared.pre.instantiate_async(&mut store).await?;
            command.wasi_cli_run().call_run(&mut store).await
        },
        wall_deadline,
        job.cancel.as_ref(),
    )?;
    let status = status_of(ended, store.data().meter.stop, |ran| match ran {
        Ok(()) => Status::Exited { code: 0 },
        Err(()) => Status::Exited { code: 1 },
    })?;
    let mut outcome = measured.outcome(status, &mut store, &captures, Vec::new());
    if let Some(net) = net {
        let (entries, dropped) = net.take_entries();
        outcome.egress = entries;
        outcome.truncated.egress = dropped;
    }
    Ok(outcome)
}
