//! preview1's `poll_oneoff` with every wait asynchronous, so that a job's wall limit and cancel cut it short.
//!
//! wasmtime-wasi 48 answers a `poll_oneoff` of one relative clock subscription — Rust's `thread::sleep`, C's
//! `nanosleep`, Python's `time.sleep` — with `std::thread::sleep` on the calling thread when its context may block
//! that thread, which Strata allows so that file I/O runs inline rather than hopping to a thread pool. The job's
//! executor is then stuck inside the sleep: neither the wall deadline nor a cancel can end it, and the guest is
//! stopped only when it wakes (`thread::sleep(3600 s)` under a 1 s limit ran for an hour). [`add_to_linker`]
//! shadows `poll_oneoff` with a function that answers that case with an asynchronous sleep on the job's executor
//! instead, which the deadline and the cancel end as they end every other wait, and hands every other case to
//! wasmtime-wasi's own (whose clock and fd subscriptions are asynchronous already).
//!
//! A sleep of at most [`INLINE_SLEEP`] still sleeps on the thread: the executor's timer counts whole milliseconds,
//! and a guest looping on short sleeps is stopped at its next epoch check, in guest code between two of them.

use std::time::Duration;

use wasmtime::{AsContextMut, Caller, Extern, Linker};
use wasmtime_wasi::p1::wasi_snapshot_preview1::{self, WasiSnapshotPreview1 as _};
use wasmtime_wasi::p1::{WasiP1Ctx, types};
use wiggle::{GuestMemory, GuestPtr};

/// The longest sleep taken on the guest's thread.
pub const INLINE_SLEEP: Duration = Duration::from_millis(1);

/// Shadows `wasi_snapshot_preview1::poll_oneoff` in a linker that already holds wasmtime-wasi's preview1
/// (`wasmtime_wasi::p1::add_to_linker_async`); `get` projects the store's data to its preview1 context.
pub fn add_to_linker<T: Send + 'static>(
    linker: &mut Linker<T>,
    get: fn(&mut T) -> &mut WasiP1Ctx,
) -> wasmtime::Result<()> {
    linker.allow_shadowing(true);
    let linked = linker
        .func_wrap_async(
            "wasi_snapshot_preview1",
            "poll_oneoff",
            move |mut caller: Caller<'_, T>, (subs, events, n, nevents): (i32, i32, i32, i32)| {
                Box::new(async move { poll_oneoff(&mut caller, get, subs, events, n, nevents).await })
            },
        )
        .map(|_| ());
    linker.allow_shadowing(false);
    linked
}

/// `poll_oneoff(in, out, nsubscriptions, nevents_out) -> errno`.
async fn poll_oneoff<T>(
    caller: &mut Caller<'_, T>,
    get: fn(&mut T) -> &mut WasiP1Ctx,
    subs: i32,
    events: i32,
    n: i32,
    nevents: i32,
) -> wasmtime::Result<i32> {
    if let Some((userdata, timeout)) = with_memory(caller, |memory| lone_sleep(memory, subs, n))? {
        if timeout <= INLINE_SLEEP {
            std::thread::sleep(timeout);
        } else {
            tokio::time::sleep(timeout).await;
        }
        // As wasmtime-wasi's answer to the same call: one clock event; a pointer out of bounds traps.
        let event = types::Event {
            userdata,
            error: types::Errno::Success,
            type_: types::Eventtype::Clock,
            fd_readwrite: types::EventFdReadwrite { flags: types::Eventrwflags::empty(), nbytes: 1 },
        };
        with_memory(caller, |memory| {
            memory.write(GuestPtr::<types::Event>::new(events as u32), event)?;
            memory.write(GuestPtr::<u32>::new(nevents as u32), 1)
        })??;
        return Ok(types::Errno::Success as i32);
    }
    // Everything else is wasmtime-wasi's, called as its own linker entry calls it.
    let fuel = caller.as_context_mut().hostcall_fuel();
    let export = caller.get_export("memory");
    let (mut memory, ctx) = match &export {
        Some(Extern::Memory(m)) => {
            let (memory, data) = m.data_and_store_mut(&mut *caller);
            let ctx = get(data);
            ctx.set_hostcall_fuel(fuel);
            (GuestMemory::Unshared(memory), ctx)
        }
        Some(Extern::SharedMemory(m)) => {
            let ctx = get(caller.data_mut());
            ctx.set_hostcall_fuel(fuel);
            (GuestMemory::Shared(m.data()), ctx)
        }
        _ => wasmtime::bail!("missing required memory export"),
    };
    wasi_snapshot_preview1::poll_oneoff(ctx, &mut memory, subs, events, n, nevents).await
}

/// The user data and timeout of a call with one subscription, to a relative clock: the case wasmtime-wasi would
/// sleep through on the thread. Anything else, or a subscription that cannot be read, is `None` (wasmtime-wasi
/// then reports the error as it would).
fn lone_sleep(memory: &mut GuestMemory<'_>, subs: i32, n: i32) -> Option<(u64, Duration)> {
    if n != 1 {
        return None;
    }
    let sub = memory.read(GuestPtr::<types::Subscription>::new(subs as u32)).ok()?;
    match sub.u {
        types::SubscriptionU::Clock(clock)
            if !clock.flags.contains(types::Subclockflags::SUBSCRIPTION_CLOCK_ABSTIME) =>
        {
            Some((sub.userdata, Duration::from_nanos(clock.timeout)))
        }
        _ => None,
    }
}

/// Calls `f` with the guest's exported memory.
fn with_memory<T, R>(caller: &mut Caller<'_, T>, f: impl FnOnce(&mut GuestMemory<'_>) -> R) -> wasmtime::Result<R> {
    match caller.get_export("memory") {
        Some(Extern::Memory(m)) => Ok(f(&mut GuestMemory::Unshared(m.data_mut(&mut *caller)))),
        Some(Extern::SharedMemory(m)) => Ok(f(&mut GuestMemory::Shared(m.data()))),
        _ => wasmtime::bail!("missing required memory export"),
    }
}
