//! What a sandbox's filesystem methods answer: entries ([`EntryInfo`]) and watch events ([`Watcher`]).
//!
//! Every tier answers in these types from its own filesystem (wasm from its grants' host directories, the process
//! tier from its jail's PID 1, the microVM from its agent), so the server never runs a program to list a directory.
//! A watch is bounded: at most its capacity of events wait for the reader; past that, events are dropped and the
//! reader learns so ([`Watcher::overflowed`]), so a guest writing files in a loop costs the host a fixed amount.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};

use crate::guest_path::GuestPath;

/// The most entries one `list_dir` answers: a guest directory with more is refused, never read into host memory.
pub const MAX_LIST_ENTRIES: usize = 100_000;

/// The deepest `list_dir` goes (E2B's SDKs ask for 1 by default).
pub const MAX_LIST_DEPTH: u32 = 64;

/// The events a watch holds for its reader by default before it drops them.
pub const WATCH_CAPACITY: usize = 4096;

/// What kind of file an entry is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FileType {
    /// A regular file.
    File,
    /// A directory.
    Dir,
    /// A symbolic link (not followed).
    Symlink,
    /// Anything else (a FIFO, a socket, a device node).
    Other,
}

/// One file or directory, as `stat` and `list_dir` describe it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EntryInfo {
    /// Its last component (`""` for the root).
    pub name: String,
    /// Its guest path.
    pub path: GuestPath,
    /// What kind of file it is (links are not followed).
    pub file_type: FileType,
    /// Its size in bytes.
    pub size: u64,
    /// Its permission bits (`0o644`), without the file-type bits.
    pub mode: u32,
    /// Its owner's user ID, as the guest sees it.
    pub uid: u32,
    /// Its group ID, as the guest sees it.
    pub gid: u32,
    /// When its contents last changed.
    pub modified: Option<SystemTime>,
    /// Where a symbolic link points, as written in the link.
    pub symlink_target: Option<String>,
}

/// The longest link target an entry keeps (Linux's `PATH_MAX`); a longer one a guest reports is dropped.
pub const MAX_LINK_TARGET: usize = 4096;

/// An entry as a guest reports it (the process tier's PID 1, the microVM's agent), before it is checked.
#[derive(Debug, Clone)]
pub struct GuestEntry {
    /// Its path in the guest.
    pub path: String,
    /// What kind of file it is.
    pub file_type: FileType,
    /// Its size.
    pub size: u64,
    /// Its mode, file-type bits included.
    pub mode: u32,
    /// Its owner and group, as the guest sees them.
    pub owner: (u32, u32),
    /// Its modification time as seconds and nanoseconds since the epoch.
    pub modified: Option<(i64, u32)>,
    /// Where a link points.
    pub symlink_target: Option<String>,
}

impl EntryInfo {
    /// The entry a guest reported, checked as the host trusts nothing it sends: `None` when its path is not a
    /// guest path (a name that, made valid UTF-8, is longer than a component may be); the mode keeps its
    /// permission bits, a time no clock gives is no time, a link target longer than [`MAX_LINK_TARGET`] none.
    pub fn from_guest(entry: GuestEntry) -> Option<EntryInfo> {
        let path = GuestPath::new(&entry.path).ok()?;
        Some(EntryInfo {
            name: path.file_name().unwrap_or_default().to_owned(),
            path,
            file_type: entry.file_type,
            size: entry.size,
            mode: entry.mode & 0o7777,
            uid: entry.owner.0,
            gid: entry.owner.1,
            modified: entry.modified.and_then(|(secs, nanos)| epoch_time(secs, nanos)),
            symlink_target: entry.symlink_target.filter(|target| target.len() <= MAX_LINK_TARGET),
        })
    }
}

/// Seconds and nanoseconds since the epoch (before it when negative) as a time; `None` for what no clock says.
pub fn epoch_time(secs: i64, nanos: u32) -> Option<SystemTime> {
    if nanos >= 1_000_000_000 {
        return None;
    }
    let whole = Duration::from_secs(secs.unsigned_abs());
    let at =
        if secs >= 0 { SystemTime::UNIX_EPOCH.checked_add(whole) } else { SystemTime::UNIX_EPOCH.checked_sub(whole) };
    at?.checked_add(Duration::from_nanos(u64::from(nanos)))
}

/// What happened to a watched path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WatchEventKind {
    /// A file or directory was created (or moved in).
    Create,
    /// A file was written.
    Write,
    /// Its permissions or ownership changed.
    Chmod,
    /// It was moved away (the event names its old path).
    Rename,
    /// It was removed.
    Remove,
}

/// One event of a [`Watcher`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WatchEvent {
    /// What happened.
    pub kind: WatchEventKind,
    /// The path it happened to.
    pub path: GuestPath,
}

impl WatchEvent {
    /// An event a guest reported on the watch of `watched`; `None` when its path is not a guest path within it.
    pub fn from_guest(kind: WatchEventKind, path: &str, watched: &GuestPath) -> Option<WatchEvent> {
        let path = GuestPath::new(path).ok().filter(|path| path.is_within(watched))?;
        Some(WatchEvent { kind, path })
    }
}

/// The tier's side of a watch: where it sends events. Sending never blocks the tier.
#[derive(Debug, Clone)]
pub struct WatchSender {
    events: SyncSender<WatchEvent>,
    overflowed: Arc<AtomicBool>,
}

impl WatchSender {
    /// Tells the reader that events were lost before they reached this sender (the tier's own queue, in the
    /// guest or its PID 1, overflowed).
    pub fn mark_overflowed(&self) {
        self.overflowed.store(true, Ordering::Relaxed);
    }

    /// Hands `event` to the reader; `false` once the reader is gone (the tier should stop watching). A full
    /// queue drops the event and marks the watch as overflowed.
    pub fn send(&self, event: WatchEvent) -> bool {
        match self.events.try_send(event) {
            Ok(()) => true,
            Err(TrySendError::Full(_)) => {
                self.overflowed.store(true, Ordering::Relaxed);
                true
            }
            Err(TrySendError::Disconnected(_)) => false,
        }
    }
}

/// A watch on a guest directory: its events in the order they happened. Dropping it stops the watch (the tier's
/// part ends with it).
pub struct Watcher {
    events: Receiver<WatchEvent>,
    overflowed: Arc<AtomicBool>,
    stop: Mutex<Option<Box<dyn FnOnce() + Send>>>,
}

impl std::fmt::Debug for Watcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watcher").field("overflowed", &self.overflowed()).finish_non_exhaustive()
    }
}

impl Watcher {
    /// A watch holding at most `capacity` events for its reader, and the sender the tier feeds it through.
    /// `stop` runs once, when the watcher is dropped.
    pub fn channel(capacity: usize, stop: impl FnOnce() + Send + 'static) -> (WatchSender, Watcher) {
        let (events, receiver) = sync_channel(capacity.max(1));
        let overflowed = Arc::new(AtomicBool::new(false));
        let sender = WatchSender { events, overflowed: overflowed.clone() };
        let stop: Box<dyn FnOnce() + Send> = Box::new(stop);
        (sender, Watcher { events: receiver, overflowed, stop: Mutex::new(Some(stop)) })
    }

    /// The next event, waiting at most `timeout`; `None` when none came, or the watch ended.
    pub fn next_timeout(&self, timeout: Duration) -> Option<WatchEvent> {
        self.events.recv_timeout(timeout).ok()
    }

    /// Every event waiting now, without blocking.
    pub fn drain(&self) -> Vec<WatchEvent> {
        self.events.try_iter().collect()
    }

    /// Whether events were dropped because the reader fell behind.
    pub fn overflowed(&self) -> bool {
        self.overflowed.load(Ordering::Relaxed)
    }
}

impl Drop for Watcher {
    fn drop(&mut self) {
        let stop = self.stop.get_mut().unwrap_or_else(|poisoned| poisoned.into_inner()).take();
        if let Some(stop) = stop {
            stop();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(path: &str) -> GuestEntry {
        GuestEntry {
            path: path.into(),
            file_type: FileType::File,
            size: 3,
            mode: 0o100_644,
            owner: (1000, 1000),
            modified: Some((1, 5)),
            symlink_target: None,
        }
    }

    #[test]
    fn a_guests_entry_is_checked_before_it_is_kept() {
        let kept = EntryInfo::from_guest(entry("/tmp/a")).expect("a guest path");
        assert_eq!((kept.name.as_str(), kept.mode, kept.uid), ("a", 0o644, 1000));
        assert_eq!(kept.modified, SystemTime::UNIX_EPOCH.checked_add(Duration::new(1, 5)));
        for bad in ["tmp/a", "/tmp/../etc", "/tmp/a\0b"] {
            assert!(EntryInfo::from_guest(entry(bad)).is_none(), "{bad}");
        }
        let odd_time = EntryInfo::from_guest(GuestEntry { modified: Some((1, 1_000_000_000)), ..entry("/a") });
        assert_eq!(odd_time.expect("kept").modified, None);
        let before = EntryInfo::from_guest(GuestEntry { modified: Some((-1, 0)), ..entry("/a") }).expect("kept");
        assert_eq!(before.modified, SystemTime::UNIX_EPOCH.checked_sub(Duration::from_secs(1)));
        // At the ends of the range: a time or none, never a panic.
        let _ = (epoch_time(i64::MAX, 999_999_999), epoch_time(i64::MIN, 0));
        let long = GuestEntry { symlink_target: Some("x".repeat(MAX_LINK_TARGET + 1)), ..entry("/l") };
        assert_eq!(EntryInfo::from_guest(long).expect("kept").symlink_target, None);
    }

    #[test]
    fn a_guests_event_outside_the_watched_directory_is_dropped() {
        let watched = GuestPath::new("/work").expect("path");
        assert!(WatchEvent::from_guest(WatchEventKind::Create, "/work/a/b", &watched).is_some());
        assert!(WatchEvent::from_guest(WatchEventKind::Create, "/etc/passwd", &watched).is_none());
        assert!(WatchEvent::from_guest(WatchEventKind::Create, "/work/../etc", &watched).is_none());
    }

    fn event(path: &str) -> WatchEvent {
        WatchEvent { kind: WatchEventKind::Create, path: GuestPath::new(path).expect("path") }
    }

    #[test]
    fn events_arrive_in_order_and_a_full_queue_drops_and_says_so() {
        let (tx, watcher) = Watcher::channel(2, || {});
        assert!(tx.send(event("/a")) && tx.send(event("/b")) && tx.send(event("/c")));
        assert_eq!(watcher.drain(), [event("/a"), event("/b")]);
        assert!(watcher.overflowed());
        assert_eq!(watcher.next_timeout(Duration::from_millis(1)), None);
    }

    #[test]
    fn a_loss_upstream_of_the_sender_is_reported_too() {
        let (tx, watcher) = Watcher::channel(8, || {});
        assert!(!watcher.overflowed());
        tx.mark_overflowed();
        assert!(watcher.overflowed());
    }

    #[test]
    fn dropping_the_watcher_stops_the_tier_side() {
        let stopped = Arc::new(AtomicBool::new(false));
        let flag = stopped.clone();
        let (tx, watcher) = Watcher::channel(4, move || flag.store(true, Ordering::Relaxed));
        drop(watcher);
        assert!(stopped.load(Ordering::Relaxed));
        assert!(!tx.send(event("/late")), "the sender learns the reader is gone");
    }
}
