//! Directory watches ([`strata_guest_proto::HostMessage::Watch`]): inotify on a directory and, when recursive,
//! on every directory below it, those made later too, with events sent to the host as they happen.
//!
//! Each watch has its own inotify instance and thread, which waits on the instance and on a pipe whose writing
//! end the connection holds: dropping that end ([`Watch::stop`]) ends the thread. Directories are watched with
//! `IN_ONLYDIR | IN_DONT_FOLLOW`, so a link is never watched in a directory's place. A directory made (or moved)
//! into a recursive watch is watched at once, then read: what was made in it before its watch was added is
//! reported as created, so a short-lived file in a new directory is not missed. A directory moved within the
//! watch keeps its watches under its new path; one moved out of it loses them.
//!
//! Bounds: at most [`MAX_WATCHED_DIRS`] directories per watch (setting up a watch of more is `ENOSPC`; those
//! made later beyond it are not watched, and the next batch says events were lost), batches of at most
//! [`MAX_WATCH_BATCH`] events, paths of at most [`MAX_PATH`] bytes (a longer one is dropped as lost). Sending
//! blocks while the host does not read, so the kernel's queue fills and overflows (`IN_Q_OVERFLOW`, reported as
//! lost events) instead of the agent's memory growing.

use std::collections::{HashMap, VecDeque};
use std::fs;
use std::os::fd::{AsFd, OwnedFd};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::fcntl::OFlag;
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify, InotifyEvent, WatchDescriptor};
use strata_guest_proto::{GuestMessage, MAX_PATH, MAX_WATCH_BATCH, RequestId, WatchEvent, WatchKind};

use crate::entries::join;
use crate::files::{FileError, checked_dir_path};
use crate::tree::errno;

/// The most directories one watch holds.
pub const MAX_WATCHED_DIRS: usize = 8192;

/// The most watches one connection runs at once.
pub const MAX_WATCHES: usize = 64;

/// The most entries reported as created when a new directory is read.
const MAX_ANNOUNCED: usize = 4096;

const MASK: AddWatchFlags = AddWatchFlags::IN_CREATE
    .union(AddWatchFlags::IN_MODIFY)
    .union(AddWatchFlags::IN_CLOSE_WRITE)
    .union(AddWatchFlags::IN_ATTRIB)
    .union(AddWatchFlags::IN_MOVED_FROM)
    .union(AddWatchFlags::IN_MOVED_TO)
    .union(AddWatchFlags::IN_DELETE)
    .union(AddWatchFlags::IN_DELETE_SELF)
    .union(AddWatchFlags::IN_MOVE_SELF)
    .union(AddWatchFlags::IN_ONLYDIR)
    .union(AddWatchFlags::IN_DONT_FOLLOW);

/// A watch set up and not yet running ([`Prepared::start`]): the host is answered in between, so that its answer
/// comes before any event (which the kernel queues meanwhile).
#[derive(Debug)]
pub struct Prepared {
    tree: Tree,
}

/// A running watch.
#[derive(Debug)]
pub struct Watch {
    /// Dropped to stop the thread.
    stop: OwnedFd,
    thread: JoinHandle<()>,
}

/// Watches the directory `path` (and, when `recursive`, every directory below it): `ENOTDIR` for anything else,
/// a link too; `ENOSPC` beyond [`MAX_WATCHED_DIRS`] directories or the kernel's bound on watches.
pub fn prepare(path: &str, recursive: bool) -> Result<Prepared, FileError> {
    checked_dir_path(path)?;
    let root = match path.trim_end_matches('/') {
        "" => "/".to_owned(),
        trimmed => trimmed.to_owned(),
    };
    let inotify = Inotify::init(InitFlags::IN_NONBLOCK | InitFlags::IN_CLOEXEC).map_err(|e| errno(path, e))?;
    let mut tree =
        Tree { inotify, root: None, dirs: HashMap::new(), recursive, overflowed: false, moved: Vec::new(), last: None };
    let wd = match tree.add(&root, None) {
        Ok(wd) => wd,
        Err(Errno::ENOSPC) => {
            let message =
                format!("{path}: more directories to watch than the agent's {MAX_WATCHED_DIRS} or the kernel's bound");
            return Err(FileError::new(libc::ENOSPC, message));
        }
        Err(e) => return Err(errno(path, e)),
    };
    tree.root = Some(wd);
    Ok(Prepared { tree })
}

impl Prepared {
    /// Starts the watch's thread: each batch of events, and the end of a watch the guest ended, go to `send`,
    /// which returns `false` once the host is gone.
    pub fn start(
        self,
        id: RequestId,
        send: impl FnMut(GuestMessage) -> bool + Send + 'static,
    ) -> std::io::Result<Watch> {
        let (reader, stop) = nix::unistd::pipe2(OFlag::O_CLOEXEC)?;
        let mut tree = self.tree;
        let thread =
            std::thread::Builder::new().name(format!("watch-{}", id.0)).spawn(move || tree.run(id, &reader, send))?;
        Ok(Watch { stop, thread })
    }
}

impl Watch {
    /// Whether the watch ended on its own (its directory went away, or the host).
    pub fn is_finished(&self) -> bool {
        self.thread.is_finished()
    }

    /// Ends the watch and waits for its thread.
    pub fn stop(self) {
        drop(self.stop);
        let _ = self.thread.join();
    }
}

#[derive(Debug)]
struct Tree {
    inotify: Inotify,
    root: Option<WatchDescriptor>,
    /// Every watched directory, by its watch.
    dirs: HashMap<WatchDescriptor, String>,
    recursive: bool,
    /// Events were lost since the last batch.
    overflowed: bool,
    /// Directories moved away in this read, by the rename's cookie, until they show up in the watch again.
    moved: Vec<(u32, String)>,
    /// The last event sent and when: a write (or permission change) run split across two reads of the inotify
    /// queue (the kernel may deliver a file's `IN_MODIFY` and `IN_CLOSE_WRITE` in separate reads) stays one event.
    last: Option<(WatchEvent, Instant)>,
}

/// How close after the last event sent a repeat of it continues the same run.
const RUN_GAP: Duration = Duration::from_millis(50);

impl Tree {
    /// Watches `top` and, when recursive, the directories below it; with `announce`, a Create for each entry
    /// found in them. Directories below `top` that went away (or are no longer directories) are passed over.
    fn add(&mut self, top: &str, mut announce: Option<&mut Vec<WatchEvent>>) -> Result<WatchDescriptor, Errno> {
        let top_wd = self.watch_dir(top)?;
        let mut queue = VecDeque::from([top.to_owned()]);
        while let Some(dir) = queue.pop_front().filter(|_| self.recursive) {
            let Ok(entries) = fs::read_dir(&dir) else { continue };
            for entry in entries.flatten() {
                let child = join(&dir, &entry.file_name().to_string_lossy());
                if child.len() > MAX_PATH {
                    self.overflowed = true;
                    continue;
                }
                if let Some(events) = announce.as_deref_mut() {
                    if events.len() < MAX_ANNOUNCED {
                        events.push(WatchEvent { kind: WatchKind::Create, path: child.clone() });
                    } else {
                        self.overflowed = true;
                    }
                }
                if !entry.file_type().is_ok_and(|t| t.is_dir()) {
                    continue;
                }
                match self.watch_dir(&child) {
                    Ok(_) => queue.push_back(child),
                    Err(Errno::ENOENT | Errno::ENOTDIR | Errno::ELOOP | Errno::EACCES) => {}
                    Err(e) => return Err(e),
                }
            }
        }
        Ok(top_wd)
    }

    /// Watches the one directory `dir`.
    fn watch_dir(&mut self, dir: &str) -> Result<WatchDescriptor, Errno> {
        if self.dirs.len() >= MAX_WATCHED_DIRS {
            return Err(Errno::ENOSPC);
        }
        let wd = self.inotify.add_watch(dir, MASK)?;
        self.dirs.insert(wd, dir.to_owned());
        Ok(wd)
    }

    /// The directories at or below `dir`, by their watches.
    fn below(&self, dir: &str) -> Vec<WatchDescriptor> {
        let prefix = format!("{dir}/");
        self.dirs.iter().filter(|(_, d)| *d == dir || d.starts_with(&prefix)).map(|(wd, _)| *wd).collect()
    }

    /// Renames the watched directories at or below `from` to be at or below `to`.
    fn relabel(&mut self, from: &str, to: &str) {
        for wd in self.below(from) {
            if let Some(dir) = self.dirs.get_mut(&wd)
                && let Some(rest) = dir.strip_prefix(from)
            {
                *dir = format!("{to}{rest}");
            }
        }
    }

    /// Forgets the watches of `dir` and the directories below it.
    fn forget(&mut self, dir: &str) {
        for wd in self.below(dir) {
            self.dirs.remove(&wd);
            let _ = self.inotify.rm_watch(wd);
        }
    }

    /// Adds what `event` means to `events`; `Some(reason)` when the watch is over.
    fn translate(&mut self, event: InotifyEvent, events: &mut Vec<WatchEvent>) -> Option<String> {
        let mask = event.mask;
        if mask.contains(AddWatchFlags::IN_Q_OVERFLOW) {
            self.overflowed = true;
            return None;
        }
        let is_root = self.root == Some(event.wd);
        if mask.contains(AddWatchFlags::IN_IGNORED) {
            self.dirs.remove(&event.wd);
            return is_root.then(|| "the watched directory is gone".to_owned());
        }
        let dir = self.dirs.get(&event.wd)?.clone();
        let path = match &event.name {
            Some(name) => join(&dir, &name.to_string_lossy()),
            // About a watched directory itself: its parent's watch reports it, but nothing reports the root's.
            None if is_root => {
                if mask.intersects(AddWatchFlags::IN_DELETE_SELF | AddWatchFlags::IN_MOVE_SELF) {
                    return Some("the watched directory was removed or moved".to_owned());
                }
                dir
            }
            None => return None,
        };
        if path.len() > MAX_PATH {
            self.overflowed = true;
            return None;
        }
        let is_dir = mask.contains(AddWatchFlags::IN_ISDIR);
        if mask.intersects(AddWatchFlags::IN_CREATE | AddWatchFlags::IN_MOVED_TO) {
            push(events, WatchKind::Create, path.clone());
            let moved = self.moved.iter().position(|(cookie, _)| *cookie == event.cookie);
            match moved {
                // Moved within the watch: its watches hold on, under the new path.
                Some(index) if is_dir && mask.contains(AddWatchFlags::IN_MOVED_TO) => {
                    let (_, old) = self.moved.swap_remove(index);
                    self.relabel(&old, &path);
                }
                _ if is_dir && self.recursive => {
                    // What was made in a new directory before its watch existed is announced; a directory moved
                    // in brings its entries along without their being created.
                    let announce = mask.contains(AddWatchFlags::IN_CREATE).then_some(&mut *events);
                    if let Err(err) = self.add(&path, announce) {
                        self.overflowed |= err == Errno::ENOSPC || err == Errno::ENOMEM;
                    }
                }
                _ => {}
            }
        }
        if mask.intersects(AddWatchFlags::IN_MODIFY | AddWatchFlags::IN_CLOSE_WRITE) {
            push(events, WatchKind::Write, path.clone());
        }
        if mask.contains(AddWatchFlags::IN_ATTRIB) {
            push(events, WatchKind::Chmod, path.clone());
        }
        if mask.contains(AddWatchFlags::IN_MOVED_FROM) {
            push(events, WatchKind::Rename, path.clone());
            if is_dir {
                // Relabelled if it reappears in the watch (the kernel queues both halves of a rename together),
                // forgotten after this read if not.
                self.moved.push((event.cookie, path.clone()));
            }
        }
        if mask.contains(AddWatchFlags::IN_DELETE) {
            push(events, WatchKind::Remove, path);
        }
        None
    }

    /// Waits for events until `stop` is readable (or closed), sending them in batches.
    fn run(&mut self, id: RequestId, stop: &OwnedFd, mut send: impl FnMut(GuestMessage) -> bool) {
        loop {
            let mut fds =
                [PollFd::new(self.inotify.as_fd(), PollFlags::POLLIN), PollFd::new(stop.as_fd(), PollFlags::POLLIN)];
            match poll(&mut fds, PollTimeout::NONE) {
                Ok(_) | Err(Errno::EINTR) => {}
                Err(e) => {
                    send(GuestMessage::WatchEnded { id, reason: format!("waiting for events: {}", e.desc()) });
                    return;
                }
            }
            if fds[1].revents().is_some_and(|r| !r.is_empty()) {
                return;
            }
            let read = match self.inotify.read_events() {
                Ok(read) => read,
                Err(Errno::EAGAIN | Errno::EINTR) => continue,
                Err(e) => {
                    send(GuestMessage::WatchEnded { id, reason: format!("reading events: {}", e.desc()) });
                    return;
                }
            };
            let mut events = Vec::new();
            let mut ended = None;
            for event in read {
                ended = self.translate(event, &mut events);
                if ended.is_some() {
                    break;
                }
            }
            // Directories moved out of the watch.
            for (_, old) in std::mem::take(&mut self.moved) {
                self.forget(&old);
            }
            if let (Some(first), Some((last, at))) = (events.first(), &self.last)
                && matches!(first.kind, WatchKind::Write | WatchKind::Chmod)
                && first == last
                && at.elapsed() < RUN_GAP
            {
                events.remove(0);
            }
            if let Some(last) = events.last() {
                self.last = Some((last.clone(), Instant::now()));
            }
            for batch in events.chunks(MAX_WATCH_BATCH) {
                let overflowed = std::mem::take(&mut self.overflowed);
                if !send(GuestMessage::WatchEvents { id, events: batch.to_vec(), overflowed }) {
                    return;
                }
            }
            if let Some(reason) = ended {
                send(GuestMessage::WatchEnded { id, reason });
                return;
            }
        }
    }
}

/// Adds an event, but a run of writes (or of permission changes) to one file is one event.
fn push(events: &mut Vec<WatchEvent>, kind: WatchKind, path: String) {
    let repeat = matches!(kind, WatchKind::Write | WatchKind::Chmod)
        && events.last().is_some_and(|last| last.kind == kind && last.path == path);
    if !repeat {
        events.push(WatchEvent { kind, path });
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;
    use std::time::{Duration, Instant};

    use super::*;

    /// A running watch of `dir` and the messages it sends.
    fn watching(dir: &str, recursive: bool) -> (Watch, mpsc::Receiver<GuestMessage>) {
        let (tx, rx) = mpsc::channel();
        let watch =
            prepare(dir, recursive).expect("prepare").start(RequestId(1), move |m| tx.send(m).is_ok()).expect("start");
        (watch, rx)
    }

    /// The events received until `done` holds of them (or a deadline passes).
    fn until(rx: &mpsc::Receiver<GuestMessage>, done: impl Fn(&[WatchEvent]) -> bool) -> Vec<WatchEvent> {
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut seen = Vec::new();
        while !done(&seen) && Instant::now() < deadline {
            match rx.recv_timeout(Duration::from_millis(100)) {
                Ok(GuestMessage::WatchEvents { events, .. }) => seen.extend(events),
                Ok(other) => panic!("unexpected {other:?}"),
                Err(_) => {}
            }
        }
        seen
    }

    fn has(events: &[WatchEvent], kind: WatchKind, path: &str) -> bool {
        events.iter().any(|e| e.kind == kind && e.path == path)
    }

    #[test]
    fn a_short_lived_file_is_created_written_and_removed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path().to_str().expect("utf-8");
        let (watch, rx) = watching(root, false);
        let file = format!("{root}/brief");
        fs::write(&file, b"x").expect("write");
        fs::remove_file(&file).expect("remove");
        let events = until(&rx, |e| has(e, WatchKind::Remove, &file));
        let kinds: Vec<WatchKind> = events.iter().filter(|e| e.path == file).map(|e| e.kind).collect();
        assert_eq!(kinds, [WatchKind::Create, WatchKind::Write, WatchKind::Remove], "{events:?}");
        watch.stop();
    }

    #[test]
    fn writes_apart_in_time_are_each_reported() {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path().to_str().expect("utf-8");
        let file = format!("{root}/twice");
        fs::write(&file, b"0").expect("write");
        let (watch, rx) = watching(root, false);
        fs::write(&file, b"1").expect("write");
        std::thread::sleep(RUN_GAP * 4);
        fs::write(&file, b"2").expect("write");
        fs::remove_file(&file).expect("remove");
        let events = until(&rx, |e| has(e, WatchKind::Remove, &file));
        let writes = events.iter().filter(|e| e.path == file && e.kind == WatchKind::Write).count();
        assert_eq!(writes, 2, "{events:?}");
        watch.stop();
    }

    #[test]
    fn a_recursive_watch_follows_new_directories_and_moves() {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path().to_str().expect("utf-8");
        let (watch, rx) = watching(root, true);
        fs::create_dir_all(dir.path().join("new/deeper")).expect("mkdir");
        fs::write(dir.path().join("new/deeper/f"), b"x").expect("write");
        let f = format!("{root}/new/deeper/f");
        let events = until(&rx, |e| has(e, WatchKind::Create, &f));
        assert!(has(&events, WatchKind::Create, &format!("{root}/new")), "{events:?}");
        fs::rename(dir.path().join("new"), dir.path().join("renamed")).expect("rename");
        fs::write(dir.path().join("renamed/deeper/g"), b"x").expect("write");
        let g = format!("{root}/renamed/deeper/g");
        let events = until(&rx, |e| has(e, WatchKind::Create, &g));
        assert!(has(&events, WatchKind::Create, &g), "a directory moved within the watch is still watched: {events:?}");
        assert!(has(&events, WatchKind::Rename, &format!("{root}/new")), "{events:?}");
        assert!(has(&events, WatchKind::Create, &format!("{root}/renamed")), "{events:?}");
        watch.stop();
    }

    #[test]
    fn a_link_or_a_file_is_not_watched_and_a_removed_root_ends_the_watch() {
        let dir = tempfile::tempdir().expect("tempdir");
        let outside = tempfile::tempdir().expect("tempdir");
        std::os::unix::fs::symlink(outside.path(), dir.path().join("link")).expect("symlink");
        fs::write(dir.path().join("file"), b"").expect("write");
        let at = |name: &str| dir.path().join(name).to_str().expect("utf-8").to_owned();
        assert_eq!(prepare(&at("link"), false).err().map(|e| e.errno), Some(libc::ENOTDIR));
        assert_eq!(prepare(&at("file"), false).err().map(|e| e.errno), Some(libc::ENOTDIR));
        assert_eq!(prepare(&at("missing"), false).err().map(|e| e.errno), Some(libc::ENOENT));

        fs::create_dir(dir.path().join("doomed")).expect("mkdir");
        let (watch, rx) = watching(&at("doomed"), true);
        fs::remove_dir(dir.path().join("doomed")).expect("rmdir");
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                Ok(GuestMessage::WatchEnded { .. }) => break,
                Ok(_) => {}
                Err(err) => panic!("the watch did not end: {err}"),
            }
        }
        watch.stop();
    }
}
