//! The epoch ticker: one thread per wasmtime engine that advances the epoch while jobs run, so running guests
//! reach their epoch-deadline callback (wall, CPU and cancellation checks) every [`TICK`].
//!
//! The thread sleeps on a condition variable while no job is running and is joined when the ticker drops, so
//! an idle tier costs no CPU and a dropped tier leaves no thread.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use wasmtime::Engine;

use crate::error::lock;

/// How often running guests are interrupted to check their limits.
pub const TICK: Duration = Duration::from_millis(2);

#[derive(Default)]
struct State {
    active: usize,
    stop: bool,
    /// The thread is waiting for a job (not between ticks), so a starting job must wake it.
    parked: bool,
}

struct Shared {
    state: Mutex<State>,
    wake: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // The state is two plain fields updated atomically under the lock; a poisoned lock still holds a
        // consistent value.
        lock(&self.state)
    }
}

/// Advances an engine's epoch while at least one [`Running`] guard is alive.
pub(crate) struct EpochTicker {
    engine: Engine,
    shared: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

/// Keeps the ticker running; dropping it marks the job finished.
pub(crate) struct Running<'a> {
    ticker: &'a EpochTicker,
}

impl EpochTicker {
    pub(crate) fn new(engine: Engine) -> EpochTicker {
        EpochTicker {
            engine,
            shared: Arc::new(Shared { state: Mutex::new(State::default()), wake: Condvar::new() }),
            thread: Mutex::new(None),
        }
    }

    /// Marks a job as running, starting the thread on first use.
    pub(crate) fn enter(&self) -> std::io::Result<Running<'_>> {
        {
            let mut thread = lock(&self.thread);
            if thread.is_none() {
                let engine = self.engine.clone();
                let shared = self.shared.clone();
                *thread = Some(
                    std::thread::Builder::new().name("strata-epoch".into()).spawn(move || tick(&engine, &shared))?,
                );
            }
        }
        let mut state = self.shared.lock();
        state.active += 1;
        if state.parked {
            self.shared.wake.notify_one();
        }
        Ok(Running { ticker: self })
    }
}

impl Drop for Running<'_> {
    fn drop(&mut self) {
        let mut state = self.ticker.shared.lock();
        state.active = state.active.saturating_sub(1);
    }
}

impl Drop for EpochTicker {
    fn drop(&mut self) {
        self.shared.lock().stop = true;
        self.shared.wake.notify_all();
        if let Some(thread) = self.thread.get_mut().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = thread.join();
        }
    }
}

fn tick(engine: &Engine, shared: &Shared) {
    let mut state = shared.lock();
    loop {
        if state.stop {
            return;
        }
        if state.active == 0 {
            state.parked = true;
            state = shared.wake.wait(state).unwrap_or_else(|p| p.into_inner());
            state.parked = false;
            continue;
        }
        // A timed wait rather than a sleep, so that dropping the ticker wakes it at once.
        state = shared.wake.wait_timeout(state, TICK).unwrap_or_else(|p| p.into_inner()).0;
        if state.active > 0 && !state.stop {
            engine.increment_epoch();
        }
    }
}
