//! PID 1's watches: inotify on a directory of the jail (and, recursively, on every directory below it,
//! including those made later), turned into [`WatchEvent`] frames sent to the host as things happen.
//!
//! Everything is bounded, so a guest that floods the tree costs a fixed amount: at most [`MAX_WATCHES`] watches
//! per jail and [`MAX_WATCHED_DIRS`] watched directories among them; at most [`MAX_PENDING`] events wait in PID 1
//! per watch; at most one frame per [`FRAME_INTERVAL`] per watch, sent without waiting for the host (a full
//! socket keeps the events waiting). Past any bound, events are dropped and the next frame says `overflowed`;
//! the kernel's own queue overflowing (`IN_Q_OVERFLOW`) does the same. Directories are added by the descriptor
//! of a walk that never follows a link ([`Files`]), through `/proc/self/fd`, so a link the guest swaps in
//! cannot point a watch elsewhere.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::os::unix::ffi::OsStrExt;
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::poll::{PollFd, PollFlags};
use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify, WatchDescriptor};

use crate::files::{FileFailure, Files, names};
use crate::proto::{self, JailFrame, MAX_INLINE, WatchEvent, WatchKind};

/// The most watches one jail runs at once.
pub const MAX_WATCHES: usize = 8;

/// The most directories all of a jail's watches hold together.
pub const MAX_WATCHED_DIRS: usize = 8192;

/// The most events one watch holds for the host.
pub const MAX_PENDING: usize = 4096;

/// The least time between two frames of one watch.
pub const FRAME_INTERVAL: Duration = Duration::from_millis(5);

/// The events each watched directory reports.
fn mask() -> AddWatchFlags {
    AddWatchFlags::IN_CREATE
        | AddWatchFlags::IN_DELETE
        | AddWatchFlags::IN_MODIFY
        | AddWatchFlags::IN_CLOSE_WRITE
        | AddWatchFlags::IN_ATTRIB
        | AddWatchFlags::IN_MOVED_FROM
        | AddWatchFlags::IN_MOVED_TO
        | AddWatchFlags::IN_DELETE_SELF
        | AddWatchFlags::IN_MOVE_SELF
        | AddWatchFlags::from_bits_retain(libc::IN_EXCL_UNLINK)
        | AddWatchFlags::IN_ONLYDIR
}

/// Which connection a watch reports on: the first (`None`) or a lane, by its serial number.
pub type Owner = Option<u64>;

/// One watch.
#[derive(Debug)]
struct Watch {
    owner: Owner,
    id: u64,
    inotify: Inotify,
    recursive: bool,
    /// The root's descriptor.
    root: Option<WatchDescriptor>,
    /// The guest path of each watched directory.
    dirs: HashMap<WatchDescriptor, String>,
    pending: Vec<WatchEvent>,
    overflowed: bool,
    next_frame: Instant,
}

/// Every watch of a jail.
#[derive(Debug, Default)]
pub struct Watches {
    list: Vec<Watch>,
}

impl Watches {
    /// Starts watch `id` of `owner` on `path`.
    pub fn start(&mut self, files: &Files, owner: Owner, id: u64, path: &str, recursive: bool) -> JailFrame {
        if self.list.iter().any(|w| w.owner == owner && w.id == id) {
            return JailFrame::FileError { errno: libc::EEXIST, message: format!("watch {id} is already running") };
        }
        if self.list.len() >= MAX_WATCHES {
            return JailFrame::FileError {
                errno: libc::EMFILE,
                message: format!("the jail already runs {MAX_WATCHES} watches"),
            };
        }
        let dir = match files.open_watched(path) {
            Ok(dir) => dir,
            Err(failure) => return failure.frame(),
        };
        let inotify = match Inotify::init(InitFlags::IN_CLOEXEC | InitFlags::IN_NONBLOCK) {
            Ok(inotify) => inotify,
            Err(errno) => return FileFailure::frame_of(errno),
        };
        let base = match path.trim_end_matches('/') {
            "" => "/".to_owned(),
            trimmed => trimmed.to_owned(),
        };
        let mut watch = Watch {
            owner,
            id,
            inotify,
            recursive,
            root: None,
            dirs: HashMap::new(),
            pending: Vec::new(),
            overflowed: false,
            next_frame: Instant::now(),
        };
        let budget = MAX_WATCHED_DIRS.saturating_sub(self.dirs());
        match watch.add(dir.as_fd(), base.clone(), budget) {
            Ok(wd) => watch.root = Some(wd),
            Err(errno) => return FileFailure::frame_of(errno),
        }
        if recursive {
            let budget = MAX_WATCHED_DIRS.saturating_sub(self.dirs());
            watch.add_below(files, dir.as_fd(), &base, budget, false);
        }
        self.list.push(watch);
        JailFrame::Watching { id }
    }

    /// Stops watch `id` of `owner` (closing its inotify descriptor removes its kernel watches).
    pub fn stop(&mut self, owner: Owner, id: u64) {
        self.list.retain(|w| !(w.owner == owner && w.id == id));
    }

    /// Stops every watch of a connection that closed.
    pub fn stop_owner(&mut self, owner: Owner) {
        self.list.retain(|w| w.owner != owner);
    }

    fn dirs(&self) -> usize {
        self.list.iter().map(|w| w.dirs.len()).sum()
    }

    /// The inotify descriptors to poll: those of watches with room for more events.
    pub fn poll_fds<'a>(&'a self, fds: &mut Vec<PollFd<'a>>) -> Vec<usize> {
        let mut which = Vec::new();
        for (index, watch) in self.list.iter().enumerate() {
            if watch.pending.len() < MAX_PENDING {
                fds.push(PollFd::new(watch.inotify.as_fd(), PollFlags::POLLIN));
                which.push(index);
            }
        }
        which
    }

    /// How long until a watch may send its waiting events, if one has any.
    pub fn next_wake(&self) -> Option<Duration> {
        let now = Instant::now();
        self.list.iter().filter(|w| !w.pending.is_empty()).map(|w| w.next_frame.saturating_duration_since(now)).min()
    }

    /// Reads the events of the watches at `ready` (indices [`poll_fds`](Self::poll_fds) returned).
    pub fn read(&mut self, files: &Files, ready: &[usize]) {
        for &index in ready {
            let budget = MAX_WATCHED_DIRS.saturating_sub(self.dirs());
            if let Some(watch) = self.list.get_mut(index) {
                watch.read(files, budget);
            }
        }
    }

    /// Sends each watch's waiting events that may go now, on its connection (`socket(owner)`); a watch whose
    /// connection is gone is stopped.
    pub fn flush<'a>(&mut self, socket: impl Fn(Owner) -> Option<BorrowedFd<'a>>) {
        let now = Instant::now();
        self.list.retain_mut(|watch| {
            if watch.pending.is_empty() || now < watch.next_frame {
                return true;
            }
            let Some(fd) = socket(watch.owner) else { return false };
            watch.send(fd, now)
        });
    }
}

impl Watch {
    /// Adds the directory `dir` (at guest path `path`) to the watch.
    fn add(&mut self, dir: BorrowedFd<'_>, path: String, budget: usize) -> Result<WatchDescriptor, Errno> {
        if budget == 0 {
            return Err(Errno::ENOSPC);
        }
        let proc_path = format!("/proc/self/fd/{}", dir.as_raw_fd());
        let wd = self.inotify.add_watch(proc_path.as_str(), mask())?;
        self.dirs.insert(wd, path);
        Ok(wd)
    }

    /// Adds every directory below `dir` (at `path`); with `report`, each entry found is reported as created
    /// (a directory made after the watch began, whose contents may have been written before it was added).
    fn add_below(&mut self, files: &Files, dir: BorrowedFd<'_>, path: &str, mut budget: usize, report: bool) -> usize {
        let mut stack = vec![(files.open_child_dir(dir, OsStr::new(".")), path.to_owned())];
        let mut added = 0;
        while let Some((Some(fd), path)) = stack.pop() {
            let Ok(children) = names(fd.as_fd()) else { continue };
            for name in children {
                let child = join(&path, &name);
                if report {
                    self.push(WatchKind::Create, child.clone());
                }
                let Some(sub) = files.open_child_dir(fd.as_fd(), &name) else { continue };
                if budget == 0 || self.add(sub.as_fd(), child.clone(), budget).is_err() {
                    self.overflowed = true;
                    continue;
                }
                budget -= 1;
                added += 1;
                stack.push((Some(sub), child));
            }
        }
        added
    }

    fn push(&mut self, kind: WatchKind, path: String) {
        if self.pending.len() >= MAX_PENDING {
            self.overflowed = true;
            return;
        }
        // Repeated writes (or mode changes) of one file in a row are one event.
        if matches!(kind, WatchKind::Write | WatchKind::Chmod)
            && self.pending.last().is_some_and(|last| last.kind == kind && last.path == path)
        {
            return;
        }
        self.pending.push(WatchEvent { kind, path });
    }

    fn read(&mut self, files: &Files, mut budget: usize) {
        while self.pending.len() < MAX_PENDING {
            let events = match self.inotify.read_events() {
                Ok(events) if !events.is_empty() => events,
                _ => return,
            };
            for event in events {
                if event.mask.contains(AddWatchFlags::IN_Q_OVERFLOW) {
                    self.overflowed = true;
                    continue;
                }
                let Some(dir) = self.dirs.get(&event.wd).cloned() else { continue };
                if event.mask.contains(AddWatchFlags::IN_IGNORED) {
                    self.dirs.remove(&event.wd);
                    continue;
                }
                let Some(name) = event.name.as_deref() else {
                    self.on_self(event.wd, event.mask, dir);
                    continue;
                };
                let path = join(&dir, name);
                let is_dir = event.mask.contains(AddWatchFlags::IN_ISDIR);
                if event.mask.intersects(AddWatchFlags::IN_CREATE | AddWatchFlags::IN_MOVED_TO) {
                    self.push(WatchKind::Create, path.clone());
                    if is_dir && self.recursive {
                        budget = budget.saturating_sub(self.add_new_dir(files, &dir, name, path, budget));
                    }
                } else if event.mask.contains(AddWatchFlags::IN_MOVED_FROM) {
                    self.push(WatchKind::Rename, path);
                } else if event.mask.contains(AddWatchFlags::IN_DELETE) {
                    self.push(WatchKind::Remove, path);
                } else if event.mask.intersects(AddWatchFlags::IN_MODIFY | AddWatchFlags::IN_CLOSE_WRITE) {
                    self.push(WatchKind::Write, path);
                } else if event.mask.contains(AddWatchFlags::IN_ATTRIB) {
                    self.push(WatchKind::Chmod, path);
                }
            }
        }
    }

    /// An event of a watched directory itself.
    fn on_self(&mut self, wd: WatchDescriptor, mask: AddWatchFlags, path: String) {
        if Some(wd) == self.root {
            if mask.contains(AddWatchFlags::IN_DELETE_SELF) {
                self.push(WatchKind::Remove, path);
            }
            return;
        }
        if mask.contains(AddWatchFlags::IN_MOVE_SELF) {
            // Moved away: its path (and those below it) no longer hold; where it went is watched anew if that
            // is inside the watch.
            let below = format!("{path}/");
            let stale: Vec<WatchDescriptor> =
                self.dirs.iter().filter(|(_, p)| **p == path || p.starts_with(&below)).map(|(wd, _)| *wd).collect();
            for wd in stale {
                let _ = self.inotify.rm_watch(wd);
                self.dirs.remove(&wd);
            }
        }
    }

    /// Watches a directory that appeared in `dir`, and whatever is in it already. Returns how many
    /// directories were added.
    fn add_new_dir(&mut self, files: &Files, dir: &str, name: &OsStr, path: String, budget: usize) -> usize {
        let Ok(parent) = files.open_watched(dir) else { return 0 };
        let Some(sub) = files.open_child_dir(parent.as_fd(), name) else { return 0 };
        if budget == 0 || self.add(sub.as_fd(), path.clone(), budget).is_err() {
            self.overflowed = true;
            return 0;
        }
        1 + self.add_below(files, sub.as_fd(), &path, budget - 1, true)
    }

    /// Sends one frame of waiting events; false when the connection is gone.
    fn send(&mut self, fd: BorrowedFd<'_>, now: Instant) -> bool {
        let mut bytes = 0;
        let mut count = 0;
        for event in &self.pending {
            bytes += event.path.len() * 6 + 40;
            if bytes > MAX_INLINE / 2 {
                break;
            }
            count += 1;
        }
        let count = count.max(1);
        let events: Vec<WatchEvent> = self.pending.iter().take(count).cloned().collect();
        let frame = JailFrame::WatchEvents { id: self.id, events, overflowed: self.overflowed };
        self.next_frame = now + FRAME_INTERVAL;
        match proto::send_nowait(fd, &frame) {
            Ok(()) => {
                self.pending.drain(..count);
                self.overflowed = false;
                true
            }
            // The host is behind: the events wait (while there is room for them).
            Err(proto::ProtoError::Io(err)) if err.raw_os_error() == Some(libc::EAGAIN) => true,
            Err(_) => false,
        }
    }
}

fn join(dir: &str, name: &OsStr) -> String {
    let name = String::from_utf8_lossy(name.as_bytes());
    if dir == "/" { format!("/{name}") } else { format!("{dir}/{name}") }
}

#[cfg(test)]
mod tests {
    use std::os::fd::OwnedFd;

    use nix::sys::socket::{AddressFamily, SockFlag, SockType, socketpair};

    use super::*;

    /// Everything the watch reports within about half a second, as (kind, path below `base`).
    fn collect(watches: &mut Watches, files: &Files, base: &str) -> Vec<(WatchKind, String)> {
        let (host, jail): (OwnedFd, OwnedFd) =
            socketpair(AddressFamily::Unix, SockType::SeqPacket, None, SockFlag::SOCK_CLOEXEC).expect("pair");
        let mut seen = Vec::new();
        for _ in 0..50 {
            watches.read(files, &[0]);
            std::thread::sleep(FRAME_INTERVAL);
            watches.flush(|_| Some(jail.as_fd()));
            let mut fds = [PollFd::new(host.as_fd(), PollFlags::POLLIN)];
            while nix::poll::poll(&mut fds, nix::poll::PollTimeout::ZERO).is_ok_and(|n| n > 0) {
                let Ok(Some((JailFrame::WatchEvents { events, .. }, _))) = proto::recv::<JailFrame>(host.as_fd())
                else {
                    panic!("not an event frame")
                };
                seen.extend(events.into_iter().map(|e| (e.kind, e.path.replacen(base, "", 1))));
            }
        }
        seen
    }

    #[test]
    fn a_recursive_watch_follows_new_directories_and_stops() {
        let dir = tempfile::tempdir().expect("tempdir");
        let base = dir.path().to_str().expect("utf-8").to_owned();
        let files = Files::open(None).expect("the root");
        let mut watches = Watches::default();
        assert_eq!(watches.start(&files, None, 7, &base, true), JailFrame::Watching { id: 7 });
        assert!(matches!(watches.start(&files, None, 7, &base, true), JailFrame::FileError { .. }), "same id");
        std::fs::create_dir_all(dir.path().join("n/m")).expect("mkdir");
        std::fs::write(dir.path().join("n/m/early"), "x").expect("write");
        let mut seen = collect(&mut watches, &files, &base);
        std::fs::write(dir.path().join("n/m/f"), "x").expect("write");
        std::fs::rename(dir.path().join("n/m/f"), dir.path().join("g")).expect("rename");
        std::fs::remove_file(dir.path().join("g")).expect("remove");
        seen.extend(collect(&mut watches, &files, &base));
        for expected in [
            (WatchKind::Create, "/n"),
            (WatchKind::Create, "/n/m"),
            (WatchKind::Create, "/n/m/early"),
            (WatchKind::Create, "/n/m/f"),
            (WatchKind::Rename, "/n/m/f"),
            (WatchKind::Create, "/g"),
            (WatchKind::Remove, "/g"),
        ] {
            assert!(seen.contains(&(expected.0, expected.1.to_owned())), "{expected:?} not in {seen:?}");
        }
        watches.stop(None, 7);
        assert!(watches.list.is_empty());
    }

    #[test]
    fn the_jail_runs_a_bounded_number_of_watches() {
        let dir = tempfile::tempdir().expect("tempdir");
        let base = dir.path().to_str().expect("utf-8");
        let files = Files::open(None).expect("the root");
        let mut watches = Watches::default();
        for id in 0..MAX_WATCHES as u64 {
            assert_eq!(watches.start(&files, Some(id), id, base, false), JailFrame::Watching { id });
        }
        let refused = watches.start(&files, None, 99, base, false);
        assert!(matches!(refused, JailFrame::FileError { errno: libc::EMFILE, .. }), "{refused:?}");
        watches.stop_owner(Some(0));
        assert_eq!(watches.start(&files, None, 99, base, false), JailFrame::Watching { id: 99 });
        watches.stop(None, 99);
        let file = dir.path().join("file");
        std::fs::write(&file, "x").expect("write");
        let refused = watches.start(&files, None, 100, file.to_str().expect("utf-8"), false);
        assert!(matches!(refused, JailFrame::FileError { errno: libc::ENOTDIR, .. }), "{refused:?}");
    }
}
