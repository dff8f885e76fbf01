//! Watches on a grant's directories: inotify, one instance and one thread per watch.
//!
//! Each watched directory is opened from the grant's [`Dir`] without following a link (as every file method
//! here does, see [`crate::grants`]) and watched through its descriptor (`/proc/self/fd/N`), so a link a guest
//! leaves or swaps in never makes the host watch a directory outside the grant. The thread waits in `poll(2)` on
//! the inotify descriptor, on the watch's stop pipe (closed when the [`Watcher`] is dropped, which also joins
//! the thread) and on the sandbox's closing pipe (closed when the sandbox closes); it maps each event's watch
//! descriptor back to the guest directory it stands for.
//!
//! Events: `IN_CREATE` and `IN_MOVED_TO` are `Create`, `IN_MODIFY` and `IN_CLOSE_WRITE` are `Write` (repeats of the
//! same path's write in a row are sent once), `IN_ATTRIB` is `Chmod`, `IN_MOVED_FROM` is `Rename` of the old path
//! and `IN_DELETE` is `Remove`. inotify queues every event in the kernel until it is read, so a file that lives for
//! a millisecond still arrives as its `Create` and its `Remove`. A recursive watch adds each directory created or
//! moved in later and announces what was already in it by then (`Create`s, one of which may repeat the event of its
//! own), so files made before its watch was added are not missed (their earlier writes are). The watch ends (its
//! [`Watcher`] sees no more events) when the watched directory itself is removed (`Remove` of it) or moved
//! (`Rename` of it: its paths would be stale).
//!
//! Bounds: at most [`MAX_WATCHES`] live watches per sandbox (inotify instances are a per-user resource of the
//! host), at most [`MAX_WATCHED_DIRS`] directories per watch (deeper trees are watched in part, with a warning
//! in the log), and the [`Watcher`]'s own capacity of waiting events.

use std::collections::HashMap;
use std::io::{PipeReader, PipeWriter};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use cap_std::fs::Dir;
use nix::errno::Errno;
use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify, InotifyEvent, WatchDescriptor};
use strata_core::fs::WATCH_CAPACITY;
use strata_core::{GuestPath, TierError, TierKind, WatchEvent, WatchEventKind, WatchSender, Watcher};

use crate::error::{internal_from, lock};
use crate::grants::walk;

/// The most watches one sandbox keeps live at once.
pub(crate) const MAX_WATCHES: usize = 8;

/// The most directories one (recursive) watch watches.
pub(crate) const MAX_WATCHED_DIRS: usize = 1024;

/// What inotify reports for each watched directory.
fn mask() -> AddWatchFlags {
    AddWatchFlags::IN_CREATE
        | AddWatchFlags::IN_MODIFY
        | AddWatchFlags::IN_CLOSE_WRITE
        | AddWatchFlags::IN_ATTRIB
        | AddWatchFlags::IN_MOVED_FROM
        | AddWatchFlags::IN_MOVED_TO
        | AddWatchFlags::IN_DELETE
        | AddWatchFlags::IN_DELETE_SELF
        | AddWatchFlags::IN_MOVE_SELF
        | AddWatchFlags::IN_ONLYDIR
}

/// The bounds of a sandbox's watches (smaller in tests).
#[derive(Debug, Clone, Copy)]
pub(crate) struct WatchLimits {
    /// Live watches per sandbox.
    pub(crate) watches: usize,
    /// Directories per watch.
    pub(crate) dirs: usize,
    /// Events waiting for the reader.
    pub(crate) capacity: usize,
}

impl Default for WatchLimits {
    fn default() -> WatchLimits {
        WatchLimits { watches: MAX_WATCHES, dirs: MAX_WATCHED_DIRS, capacity: WATCH_CAPACITY }
    }
}

/// What one watch watches: a directory of a grant.
pub(crate) struct WatchTarget {
    /// The grant's host directory.
    pub(crate) grant: Dir,
    /// The watched directory's components below the grant.
    pub(crate) parts: Vec<String>,
    /// The watched directory's guest path.
    pub(crate) path: GuestPath,
    /// Whether directories below it are watched too.
    pub(crate) recursive: bool,
}

/// The watches of one sandbox: how many are live, and the pipe whose closing ends them all.
#[derive(Debug, Default)]
pub(crate) struct Watches {
    live: Arc<AtomicUsize>,
    /// The writer is dropped when the sandbox closes; each watch thread polls a clone of the reader.
    closing: Option<(PipeReader, PipeWriter)>,
    limits: WatchLimits,
}

impl Watches {
    /// Watches with these bounds.
    #[cfg(test)]
    pub(crate) fn with_limits(limits: WatchLimits) -> Watches {
        Watches { limits, ..Watches::default() }
    }

    /// How many watch threads are running.
    #[cfg(test)]
    pub(crate) fn live(&self) -> usize {
        self.live.load(Ordering::SeqCst)
    }

    /// Starts watching `target`: its directories are watched before this returns, so every change after it is
    /// seen.
    pub(crate) fn start(&mut self, target: WatchTarget) -> Result<Watcher, TierError> {
        let slot = Live::take(&self.live, self.limits.watches)?;
        let spawn_err = |what: &str, e: std::io::Error| internal_from(what, e);
        let closed = self.closed_reader().map_err(|e| spawn_err("making the closing pipe", e))?;
        let (stop, stop_writer) = std::io::pipe().map_err(|e| spawn_err("making a pipe", e))?;
        let inotify = Inotify::init(InitFlags::IN_NONBLOCK | InitFlags::IN_CLOEXEC)
            .map_err(|e| internal_from("starting inotify", e))?;
        let thread: Arc<Mutex<Option<JoinHandle<()>>>> = Arc::default();
        let joined = thread.clone();
        let (events, watcher) = Watcher::channel(self.limits.capacity, move || {
            drop(stop_writer);
            if let Some(handle) = lock(&joined).take() {
                let _ = handle.join();
            }
        });
        let top = target.path.clone();
        let mut watch = Watch {
            inotify,
            grant: target.grant,
            dirs: HashMap::new(),
            top: None,
            recursive: target.recursive,
            max_dirs: self.limits.dirs,
            events,
            last: None,
            warned: false,
        };
        watch.top = Some(watch.add(target.parts, top, false)?);
        let handle = std::thread::Builder::new()
            .name("strata-watch".into())
            .spawn(move || {
                let _slot = slot;
                watch.run(stop.as_fd(), closed.as_fd());
            })
            .map_err(|e| spawn_err("starting a watch thread", e))?;
        *lock(&thread) = Some(handle);
        Ok(watcher)
    }

    /// A reader of the pipe whose writer the sandbox drops when it closes.
    fn closed_reader(&mut self) -> std::io::Result<PipeReader> {
        let (reader, _) = match &mut self.closing {
            Some(pair) => pair,
            slot @ None => slot.insert(std::io::pipe()?),
        };
        reader.try_clone()
    }

    /// Ends every watch (the sandbox is closing).
    pub(crate) fn close(&mut self) {
        self.closing = None;
    }
}

/// One counted live watch; dropping it frees its place.
struct Live(Arc<AtomicUsize>);

impl Live {
    fn take(live: &Arc<AtomicUsize>, max: usize) -> Result<Live, TierError> {
        live.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| (n < max).then_some(n + 1)).map_err(|_| {
            TierError::Capacity {
                tier: TierKind::Wasm,
                reason: format!("the sandbox already has {max} watches, the most it keeps at once"),
            }
        })?;
        Ok(Live(live.clone()))
    }
}

impl Drop for Live {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A running watch, owned by its thread.
struct Watch {
    inotify: Inotify,
    grant: Dir,
    /// Each watched directory's guest path and components below the grant.
    dirs: HashMap<WatchDescriptor, (GuestPath, Vec<String>)>,
    /// The watched directory's own descriptor.
    top: Option<WatchDescriptor>,
    recursive: bool,
    max_dirs: usize,
    events: WatchSender,
    /// The last event sent, to send a run of one path's writes once.
    last: Option<WatchEvent>,
    /// Whether the directory bound was reported in the log.
    warned: bool,
}

impl Watch {
    /// Watches the directory `parts` (at `path`) and, when recursive, the directories below it; `announce`
    /// sends a `Create` for everything found in them (a directory that appeared after the watch started).
    /// Returns the descriptor of the directory itself.
    fn add(&mut self, parts: Vec<String>, path: GuestPath, announce: bool) -> Result<WatchDescriptor, TierError> {
        let first = self.add_one(&parts, &path)?;
        if !self.recursive {
            return Ok(first);
        }
        let mut pending = vec![(parts, path)];
        while let Some((parts, path)) = pending.pop() {
            let names: Vec<&str> = parts.iter().map(String::as_str).collect();
            let Ok(dir) = walk(&self.grant, &names, &path) else { continue };
            let Ok(entries) = dir.entries() else { continue };
            for item in entries.flatten() {
                let name = item.file_name().to_string_lossy().into_owned();
                let Ok(child) = path.join(&name) else { continue };
                if announce && !self.send(WatchEventKind::Create, child.clone()) {
                    return Ok(first);
                }
                let is_dir = dir.symlink_metadata(item.file_name()).is_ok_and(|md| md.is_dir());
                if !is_dir {
                    continue;
                }
                let mut child_parts = parts.clone();
                child_parts.push(name);
                if self.add_one(&child_parts, &child).is_ok() {
                    pending.push((child_parts, child));
                }
            }
        }
        Ok(first)
    }

    /// Watches the one directory `parts` (at `path`), opened without following a link.
    fn add_one(&mut self, parts: &[String], path: &GuestPath) -> Result<WatchDescriptor, TierError> {
        if self.dirs.len() >= self.max_dirs {
            if !self.warned {
                log::warn!("the watch of {path} reached {} directories; the ones below are not watched", self.max_dirs);
                self.warned = true;
                // Events below the unwatched directories are lost: the reader learns so.
                self.events.mark_overflowed();
            }
            return Err(TierError::Capacity {
                tier: TierKind::Wasm,
                reason: format!("a watch keeps at most {} directories", self.max_dirs),
            });
        }
        let names: Vec<&str> = parts.iter().map(String::as_str).collect();
        let dir = walk(&self.grant, &names, path)?;
        let by_fd = format!("/proc/self/fd/{}", dir.as_fd().as_raw_fd());
        let wd = self.inotify.add_watch(by_fd.as_str(), mask()).map_err(|e| internal_from("adding a watch", e))?;
        self.dirs.insert(wd, (path.clone(), parts.to_vec()));
        Ok(wd)
    }

    /// Reads events until the watch is stopped, the sandbox closes, the reader goes or the directory does.
    fn run(mut self, stop: BorrowedFd<'_>, closed: BorrowedFd<'_>) {
        use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
        loop {
            let mut fds = [
                PollFd::new(self.inotify.as_fd(), PollFlags::POLLIN),
                PollFd::new(stop, PollFlags::POLLIN),
                PollFd::new(closed, PollFlags::POLLIN),
            ];
            match poll(&mut fds, PollTimeout::NONE) {
                Ok(_) | Err(Errno::EINTR) => {}
                Err(_) => return,
            }
            let [ready, stop, closed] = fds.map(|fd| fd.revents().unwrap_or(PollFlags::empty()));
            if !stop.is_empty() || !closed.is_empty() || ready.intersects(PollFlags::POLLERR | PollFlags::POLLNVAL) {
                return;
            }
            loop {
                let batch = match self.inotify.read_events() {
                    Ok(batch) if !batch.is_empty() => batch,
                    Ok(_) | Err(Errno::EAGAIN) => break,
                    Err(Errno::EINTR) => continue,
                    Err(_) => return,
                };
                for event in batch {
                    if !self.handle(event) {
                        return;
                    }
                }
            }
        }
    }

    /// Sends what `event` means; `false` when the watch is over.
    fn handle(&mut self, event: InotifyEvent) -> bool {
        let mask = event.mask;
        if mask.contains(AddWatchFlags::IN_Q_OVERFLOW) {
            log::warn!("a watch fell behind the kernel's queue; some events were lost");
            self.events.mark_overflowed();
            return true;
        }
        let is_top = self.top == Some(event.wd);
        if mask.contains(AddWatchFlags::IN_IGNORED) {
            self.dirs.remove(&event.wd);
            return !is_top;
        }
        let Some((dir, parts)) = self.dirs.get(&event.wd).cloned() else { return true };
        let Some(name) = event.name else {
            // The directory itself: only the watched one's end is news (a subdirectory's is its parent's event).
            return match is_top {
                true if mask.contains(AddWatchFlags::IN_DELETE_SELF) => {
                    self.send(WatchEventKind::Remove, dir);
                    false
                }
                true if mask.contains(AddWatchFlags::IN_MOVE_SELF) => {
                    self.send(WatchEventKind::Rename, dir);
                    false
                }
                _ => true,
            };
        };
        let name = name.to_string_lossy().into_owned();
        let Ok(path) = dir.join(&name) else { return true };
        let is_dir = mask.contains(AddWatchFlags::IN_ISDIR);
        if mask.intersects(AddWatchFlags::IN_CREATE | AddWatchFlags::IN_MOVED_TO) {
            if !self.send(WatchEventKind::Create, path.clone()) {
                return false;
            }
            if is_dir && self.recursive {
                let mut child = parts;
                child.push(name);
                let _ = self.add(child, path, true);
            }
            return true;
        }
        let kind = if mask.intersects(AddWatchFlags::IN_MODIFY | AddWatchFlags::IN_CLOSE_WRITE) {
            WatchEventKind::Write
        } else if mask.contains(AddWatchFlags::IN_ATTRIB) {
            WatchEventKind::Chmod
        } else if mask.contains(AddWatchFlags::IN_MOVED_FROM) {
            if is_dir {
                self.forget(&path);
            }
            WatchEventKind::Rename
        } else if mask.contains(AddWatchFlags::IN_DELETE) {
            WatchEventKind::Remove
        } else {
            return true;
        };
        self.send(kind, path)
    }

    /// Stops watching the directories at and below `path` (moved away: their paths are stale).
    fn forget(&mut self, path: &GuestPath) {
        let gone: Vec<WatchDescriptor> =
            self.dirs.iter().filter(|(_, (dir, _))| dir.is_within(path)).map(|(wd, _)| *wd).collect();
        for wd in gone {
            self.dirs.remove(&wd);
            let _ = self.inotify.rm_watch(wd);
        }
    }

    /// Hands an event to the reader (a run of one path's writes once); `false` once the reader is gone.
    fn send(&mut self, kind: WatchEventKind, path: GuestPath) -> bool {
        let event = WatchEvent { kind, path };
        if kind == WatchEventKind::Write && self.last.as_ref() == Some(&event) {
            return true;
        }
        self.last = Some(event.clone());
        self.events.send(event)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use std::os::unix::fs::symlink;
    use std::path::Path;
    use std::time::{Duration, Instant};

    use cap_std::ambient_authority;

    use super::*;

    const WAIT: Duration = Duration::from_secs(5);

    pub(crate) fn path(text: &str) -> GuestPath {
        GuestPath::new(text).expect("guest path")
    }

    /// A watch of `host/rest` as `/data/rest`.
    fn target(host: &Path, rest: &[&str], recursive: bool) -> WatchTarget {
        let grant = Dir::open_ambient_dir(host, ambient_authority()).expect("open");
        let guest = rest.iter().fold(path("/data"), |p, part| p.join(part).expect("join"));
        WatchTarget { grant, parts: rest.iter().map(|p| (*p).to_owned()).collect(), path: guest, recursive }
    }

    pub(crate) fn event(kind: WatchEventKind, text: &str) -> WatchEvent {
        WatchEvent { kind, path: path(text) }
    }

    /// Events until `last` arrives (or the wait runs out).
    pub(crate) fn until(watcher: &Watcher, last: &WatchEvent) -> Vec<WatchEvent> {
        let deadline = Instant::now() + WAIT;
        let mut seen = Vec::new();
        while let Some(event) = watcher.next_timeout(deadline.saturating_duration_since(Instant::now())) {
            let done = &event == last;
            seen.push(event);
            if done {
                break;
            }
        }
        seen
    }

    /// Whether the watch ended: no event, and sooner than a quiet watch would say so.
    pub(crate) fn ended(watcher: &Watcher) -> bool {
        let asked = Instant::now();
        watcher.next_timeout(WAIT).is_none() && asked.elapsed() < WAIT / 2
    }

    #[test]
    fn a_watcher_sees_a_file_that_lives_for_10_ms() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut watches = Watches::default();
        let watcher = watches.start(target(dir.path(), &[], false)).expect("watch");
        let file = dir.path().join("brief.txt");
        let born = Instant::now();
        std::fs::write(&file, "here and gone").expect("write");
        std::fs::remove_file(&file).expect("remove");
        let lived = born.elapsed();
        assert!(lived < Duration::from_millis(10), "the file lived {lived:?}");
        let seen = until(&watcher, &event(WatchEventKind::Remove, "/data/brief.txt"));
        assert_eq!(
            seen,
            [
                event(WatchEventKind::Create, "/data/brief.txt"),
                event(WatchEventKind::Write, "/data/brief.txt"),
                event(WatchEventKind::Remove, "/data/brief.txt"),
            ],
            "a write's IN_MODIFY and IN_CLOSE_WRITE are one Write"
        );
        assert!(!watcher.overflowed());
    }

    #[test]
    fn chmod_rename_and_directories_are_reported() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("f"), "x").expect("write");
        let mut watches = Watches::default();
        let watcher = watches.start(target(dir.path(), &[], false)).expect("watch");
        let perms = std::os::unix::fs::PermissionsExt::from_mode(0o600);
        std::fs::set_permissions(dir.path().join("f"), perms).expect("chmod");
        std::fs::rename(dir.path().join("f"), dir.path().join("g")).expect("rename");
        std::fs::create_dir(dir.path().join("d")).expect("mkdir");
        std::fs::remove_dir(dir.path().join("d")).expect("rmdir");
        let seen = until(&watcher, &event(WatchEventKind::Remove, "/data/d"));
        assert_eq!(
            seen,
            [
                event(WatchEventKind::Chmod, "/data/f"),
                event(WatchEventKind::Rename, "/data/f"),
                event(WatchEventKind::Create, "/data/g"),
                event(WatchEventKind::Create, "/data/d"),
                event(WatchEventKind::Remove, "/data/d"),
            ]
        );
    }

    #[test]
    fn a_recursive_watch_sees_files_in_a_directory_made_after_it_started() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir_all(dir.path().join("old/deep")).expect("mkdir");
        let mut watches = Watches::default();
        let watcher = watches.start(target(dir.path(), &[], true)).expect("watch");
        std::fs::write(dir.path().join("old/deep/a"), "a").expect("write");
        std::fs::create_dir_all(dir.path().join("new/inner")).expect("mkdir");
        std::fs::write(dir.path().join("new/inner/b"), "b").expect("write");
        // `b` may be written before `inner` is watched: it is announced when the watch finds it.
        let mut seen = until(&watcher, &event(WatchEventKind::Create, "/data/new/inner/b"));
        std::fs::write(dir.path().join("new/inner/c"), "c").expect("write");
        seen.extend(until(&watcher, &event(WatchEventKind::Write, "/data/new/inner/c")));
        for expected in [
            event(WatchEventKind::Create, "/data/old/deep/a"),
            event(WatchEventKind::Write, "/data/old/deep/a"),
            event(WatchEventKind::Create, "/data/new"),
            event(WatchEventKind::Create, "/data/new/inner"),
            event(WatchEventKind::Create, "/data/new/inner/b"),
            event(WatchEventKind::Create, "/data/new/inner/c"),
            event(WatchEventKind::Write, "/data/new/inner/c"),
        ] {
            assert!(seen.contains(&expected), "{expected:?} missing from {seen:?}");
        }
    }

    #[test]
    fn a_watch_never_follows_a_link_out_of_the_grant() {
        let root = tempfile::tempdir().expect("tempdir");
        let grant = root.path().join("grant");
        let outside = root.path().join("outside");
        std::fs::create_dir_all(&grant).expect("mkdir");
        std::fs::create_dir_all(&outside).expect("mkdir");
        symlink(&outside, grant.join("out")).expect("symlink");
        let mut watches = Watches::default();
        let err = watches.start(target(&grant, &["out"], false)).expect_err("a link is not watched");
        assert_eq!(err.code(), "guest_path", "{err}");
        let watcher = watches.start(target(&grant, &[], true)).expect("watch");
        std::fs::write(outside.join("secret"), "s").expect("write");
        std::fs::write(grant.join("inside"), "i").expect("write");
        let seen = until(&watcher, &event(WatchEventKind::Write, "/data/inside"));
        assert!(!seen.iter().any(|e| e.path.as_str().starts_with("/data/out")), "{seen:?}");
    }

    #[test]
    fn dropping_the_watcher_or_closing_the_sandbox_ends_the_thread() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut watches = Watches::default();
        let watcher = watches.start(target(dir.path(), &[], true)).expect("watch");
        assert_eq!(watches.live(), 1);
        drop(watcher);
        assert_eq!(watches.live(), 0, "the drop joins the thread");

        let watcher = watches.start(target(dir.path(), &[], false)).expect("watch");
        watches.close();
        assert!(ended(&watcher), "the watch ends with the sandbox");
        let deadline = Instant::now() + WAIT;
        while watches.live() > 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(watches.live(), 0);
    }

    #[test]
    fn the_watched_directory_going_ends_the_watch() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir(dir.path().join("w")).expect("mkdir");
        let mut watches = Watches::default();
        let watcher = watches.start(target(dir.path(), &["w"], false)).expect("watch");
        std::fs::remove_dir(dir.path().join("w")).expect("rmdir");
        assert_eq!(watcher.next_timeout(WAIT), Some(event(WatchEventKind::Remove, "/data/w")));
        assert!(ended(&watcher));
    }

    #[test]
    fn watches_and_their_directories_are_bounded() {
        let dir = tempfile::tempdir().expect("tempdir");
        for sub in ["a", "b", "c"] {
            std::fs::create_dir(dir.path().join(sub)).expect("mkdir");
        }
        let mut watches = Watches::with_limits(WatchLimits { watches: 1, dirs: 2, capacity: 2 });
        let watcher = watches.start(target(dir.path(), &[], true)).expect("watch");
        let err = watches.start(target(dir.path(), &[], false)).expect_err("one watch at most");
        assert_eq!(err.code(), "capacity", "{err}");
        for n in 0..10 {
            std::fs::write(dir.path().join(format!("f{n}")), "x").expect("write");
        }
        // The directory bound (two) leaves a subdirectory unwatched: the reader learns that events are lost.
        assert!(watcher.overflowed(), "a watch past its directory bound says so");
        // Ten writes into a queue of two: it holds two events, the rest are dropped.
        std::thread::sleep(Duration::from_millis(300));
        assert_eq!(watcher.drain().len(), 2);
        drop(watcher);
        watches.start(target(dir.path(), &[], false)).expect("the place is free again");
    }
}
