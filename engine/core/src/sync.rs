//! The lock every Strata crate on the host takes its mutexes with.

use std::sync::{Mutex, MutexGuard, PoisonError};

/// Locks `mutex` even when a thread panicked while holding it. What Strata keeps under its locks (captures, logs,
/// caches, counters, registries) stays consistent between statements, so the state a panic leaves is still valid
/// and the rest of the process keeps working rather than panicking in turn.
pub fn lock<T: ?Sized>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_poisoned_mutex_is_still_locked() {
        let mutex = std::sync::Arc::new(Mutex::new(1));
        let held = mutex.clone();
        let _ = std::thread::spawn(move || {
            let _guard = held.lock();
            panic!("poison it");
        })
        .join();
        assert!(mutex.is_poisoned());
        *lock(&mutex) += 1;
        assert_eq!(*lock(&mutex), 2);
    }
}
