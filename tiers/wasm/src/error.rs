//! The tier's own failures, made in one place: the internal error every module reports, and the lock that
//! takes no poisoning for one.

use std::sync::{Mutex, MutexGuard};

use strata_core::{TierError, TierKind};

/// A failure of the tier itself (not of the guest, the job or its input), in words.
pub(crate) fn internal(message: impl std::fmt::Display) -> TierError {
    TierError::internal(TierKind::Wasm, message.to_string())
}

/// A failure of the tier itself while doing `what`, caused by `source` (kept as the error's source).
pub(crate) fn internal_from(
    what: &str,
    source: impl Into<Box<dyn std::error::Error + Send + Sync + 'static>>,
) -> TierError {
    TierError::internal_from(TierKind::Wasm, what, source)
}

/// Locks `mutex` even if a thread panicked while holding it: what this tier keeps under locks (caches, logs,
/// counters) stays usable after such a panic.
pub(crate) fn lock<T: ?Sized>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}
