//! A session's file methods: paths checked by [`GuestPath`]'s rules (the tier has none of its own), read-only
//! grants kept from change, the work done by the guest agent in the guest (see `strata_agent::entries` and
//! `strata_agent::watch`), and its answers checked and turned into [`EntryInfo`] and [`WatchEvent`].
//!
//! The agent is the guest's word: an entry whose path is not a guest path, or lies outside what was asked
//! about, is left out (a listing) or refused (a `stat`); a watch event outside the watched directory is dropped.
//! Its messages reach an error's reason cut to [`MAX_REASON`] bytes.

use std::sync::{Arc, Mutex, PoisonError};

use strata_core::fs::{MAX_LIST_DEPTH, WATCH_CAPACITY};
use strata_core::{
    Capabilities, EntryInfo, FileType, GrantMode, GuestEntry, GuestPath, TierError, TierKind, WatchEvent,
    WatchEventKind, Watcher,
};
use strata_guest_proto::{AgentClient, AgentWatch, ClientError};

/// The most bytes of an agent's message an error's reason carries.
pub const MAX_REASON: usize = 512;

/// Checks a path a file method reads or changes (not the root, nothing in the kernel filesystems).
pub(crate) fn file_target(path: &str) -> Result<GuestPath, TierError> {
    Ok(GuestPath::file_target(path)?)
}

/// Checks a path to describe, list or watch: the root may be, the kernel filesystems may not.
fn readable(path: &GuestPath) -> Result<(), TierError> {
    Ok(path.check_readable()?)
}

/// Refuses a change at `path` inside a read-only grant; with `tree` (a removal, a rename's source), also one
/// of a directory holding a read-only grant.
pub(crate) fn writable(caps: &Capabilities, path: &GuestPath, tree: bool) -> Result<(), TierError> {
    let read_only = caps.grants.iter().filter(|g| g.mode == GrantMode::Ro);
    for grant in read_only.filter_map(|g| GuestPath::new(&g.guest).ok()) {
        if path.is_within(&grant) || (tree && grant.is_within(path)) {
            let reason = if path.is_within(&grant) {
                format!("is inside the read-only grant {grant}")
            } else {
                format!("holds the read-only grant {grant}")
            };
            return Err(TierError::GuestPath { path: path.to_string(), reason });
        }
    }
    Ok(())
}

/// Maps a failed agent request about `path` to the tier's error: the guest's refusals are `guest_path` errors
/// saying what was wrong, a lost agent ends the session.
pub(crate) fn file_error(path: &GuestPath, err: ClientError) -> TierError {
    match err {
        ClientError::File { errno, message } => {
            TierError::GuestPath { path: path.to_string(), reason: reason(errno, &message) }
        }
        ClientError::Disconnected | ClientError::Frame(_) => {
            TierError::SessionEnded { reason: format!("the guest agent was lost ({err})") }
        }
        other => TierError::internal_from(TierKind::Microvm, "a file request to the guest agent", other),
    }
}

/// `errno` as a phrase about the path (`"does not exist"`), or the agent's own message, cut short.
fn reason(errno: i32, message: &str) -> String {
    let phrase = match errno {
        libc::ENOENT => "does not exist",
        libc::ENOTDIR => "is not a directory (or a path through it is not)",
        libc::EISDIR => "is a directory",
        libc::EEXIST => "already exists",
        libc::ENOTEMPTY => "is a directory that is not empty",
        libc::ELOOP => "is a symbolic link",
        libc::EACCES | libc::EPERM => "may not be changed in the guest (permission denied)",
        _ => {
            let mut end = message.len().min(MAX_REASON);
            while !message.is_char_boundary(end) {
                end -= 1;
            }
            return message[..end].to_owned();
        }
    };
    phrase.to_owned()
}

/// The directory `path`'s entries down to `depth` levels, refusing more than `max` of them.
pub(crate) fn list_dir(
    client: &AgentClient,
    path: &GuestPath,
    depth: u32,
    max: usize,
) -> Result<Vec<EntryInfo>, TierError> {
    readable(path)?;
    let depth = depth.clamp(1, MAX_LIST_DEPTH);
    let listing = client.list_dir(path.as_str(), depth, max as u64).map_err(|err| match err {
        ClientError::File { errno: libc::E2BIG, .. } => TierError::WrongFormat {
            what: format!("the listing of {path} (more than {max} entries)"),
            expected: "within the listing limit",
        },
        other => file_error(path, other),
    })?;
    let within = |entry: &EntryInfo| {
        entry.path.relative_to(path).is_some_and(|rel| !rel.is_empty() && rel.split('/').count() <= depth as usize)
    };
    Ok(listing.entries.into_iter().filter_map(entry_info).filter(within).collect())
}

/// What is at `path`, a link itself rather than its target.
pub(crate) fn stat(client: &AgentClient, path: &GuestPath) -> Result<EntryInfo, TierError> {
    readable(path)?;
    let entry = client.stat(path.as_str()).map_err(|err| file_error(path, err))?;
    described(entry, path)
}

/// Makes the directory `path` and its parents; `false` when it was there.
pub(crate) fn make_dir(client: &AgentClient, caps: &Capabilities, path: &GuestPath) -> Result<bool, TierError> {
    path.check_file_target()?;
    writable(caps, path, false)?;
    client.create_dir(path.as_str()).map_err(|err| file_error(path, err))
}

/// Moves `from` to `to`; what is at `to` then.
pub(crate) fn rename(
    client: &AgentClient,
    caps: &Capabilities,
    from: &GuestPath,
    to: &GuestPath,
) -> Result<EntryInfo, TierError> {
    from.check_file_target()?;
    to.check_file_target()?;
    writable(caps, from, true)?;
    writable(caps, to, true)?;
    let entry = client.rename(from.as_str(), to.as_str()).map_err(|err| file_error(from, err))?;
    described(entry, to)
}

/// Removes the file or link at `path`, or the directory and all it holds.
pub(crate) fn remove(client: &AgentClient, caps: &Capabilities, path: &GuestPath) -> Result<(), TierError> {
    path.check_file_target()?;
    writable(caps, path, true)?;
    client.remove(path.as_str()).map_err(|err| file_error(path, err))
}

/// A watch of `path` by the agent's inotify; dropping the [`Watcher`] stops it in the guest.
pub(crate) fn watch(client: &AgentClient, path: &GuestPath, recursive: bool) -> Result<Watcher, TierError> {
    readable(path)?;
    let running: Arc<Mutex<Option<AgentWatch>>> = Arc::new(Mutex::new(None));
    let slot = Arc::clone(&running);
    let (sender, watcher) = Watcher::channel(WATCH_CAPACITY, move || {
        // Dropping the agent's watch forgets its sink and tells the agent to stop.
        let watch = slot.lock().unwrap_or_else(PoisonError::into_inner).take();
        drop(watch);
    });
    let watched = path.clone();
    let mut warned = false;
    let sink = move |events: Vec<strata_guest_proto::WatchEvent>, overflowed: bool| {
        if overflowed {
            sender.mark_overflowed();
            if !warned {
                log::warn!("the watch of {watched} lost events in the guest (its queue overflowed)");
                warned = true;
            }
        }
        events.into_iter().filter_map(|event| watch_event(event, &watched)).all(|event| sender.send(event))
    };
    let agent_watch = client.watch(path.as_str(), recursive, sink).map_err(|err| match err {
        ClientError::File { errno: libc::ENOSPC | libc::EMFILE, message } => {
            TierError::Capacity { tier: TierKind::Microvm, reason: format!("watching {path}: {}", reason(0, &message)) }
        }
        other => file_error(path, other),
    })?;
    *running.lock().unwrap_or_else(PoisonError::into_inner) = Some(agent_watch);
    Ok(watcher)
}

/// The agent's entry for `path`, which must be about `path`.
fn described(entry: strata_guest_proto::EntryInfo, path: &GuestPath) -> Result<EntryInfo, TierError> {
    match entry_info(entry) {
        Some(entry) if entry.path == *path => Ok(entry),
        _ => Err(TierError::internal(TierKind::Microvm, format!("the guest agent described another path than {path}"))),
    }
}

/// An entry as the core describes it, checked ([`EntryInfo::from_guest`]).
fn entry_info(entry: strata_guest_proto::EntryInfo) -> Option<EntryInfo> {
    use strata_guest_proto::FileType as Wire;
    let file_type = match entry.file_type {
        Wire::File => FileType::File,
        Wire::Dir => FileType::Dir,
        Wire::Symlink => FileType::Symlink,
        Wire::Other => FileType::Other,
    };
    EntryInfo::from_guest(GuestEntry {
        path: entry.path,
        file_type,
        size: entry.size,
        mode: entry.mode,
        owner: (entry.uid, entry.gid),
        modified: entry.modified,
        symlink_target: entry.target,
    })
}

/// An agent's event as the core's, if it is about a guest path within the watched directory.
fn watch_event(event: strata_guest_proto::WatchEvent, watched: &GuestPath) -> Option<WatchEvent> {
    use strata_guest_proto::WatchKind;
    let kind = match event.kind {
        WatchKind::Create => WatchEventKind::Create,
        WatchKind::Write => WatchEventKind::Write,
        WatchKind::Chmod => WatchEventKind::Chmod,
        WatchKind::Rename => WatchEventKind::Rename,
        WatchKind::Remove => WatchEventKind::Remove,
    };
    WatchEvent::from_guest(kind, &event.path, watched)
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, UNIX_EPOCH};

    use strata_core::Grant;

    use super::*;

    fn path(text: &str) -> GuestPath {
        GuestPath::new(text).expect("a guest path")
    }

    #[test]
    fn file_targets_follow_the_guest_path_rules() {
        for bad in ["relative", "/a/../b", "/", "/proc/self/mem", "/dev/sda", "/sys", "/a\0b"] {
            assert_eq!(file_target(bad).expect_err(bad).code(), "guest_path", "{bad}");
        }
        for (good, normal) in [("/tmp/x", "/tmp/x"), ("/a/./b//", "/a/b"), ("/procfs/x", "/procfs/x")] {
            assert_eq!(file_target(good).expect(good), normal);
        }
        assert!(readable(&GuestPath::root()).is_ok());
        assert!(readable(&path("/proc/1")).is_err());
    }

    #[test]
    fn read_only_grants_and_what_holds_them_are_not_changed() {
        let grant = |guest: &str, mode| Grant { host: "/h".into(), guest: guest.into(), mode };
        let caps = Capabilities {
            grants: vec![grant("/data/ro", GrantMode::Ro), grant("/data/rw", GrantMode::Rw)],
            ..Capabilities::default()
        };
        assert!(writable(&caps, &path("/data/ro/x"), false).is_err());
        assert!(writable(&caps, &path("/data/ro"), false).is_err());
        assert!(writable(&caps, &path("/data"), false).is_ok(), "a directory may be made beside the grant");
        assert!(writable(&caps, &path("/data"), true).is_err(), "removing /data removes the grant");
        assert!(writable(&caps, &path("/data/rw/x"), true).is_ok());
        assert!(writable(&caps, &path("/data/rox"), true).is_ok());
    }

    #[test]
    fn the_agents_word_is_checked() {
        let wire = |path: &str, nanos| strata_guest_proto::EntryInfo {
            path: path.into(),
            file_type: strata_guest_proto::FileType::File,
            size: 1,
            mode: 0o100644,
            uid: 1,
            gid: 2,
            modified: Some((-5, nanos)),
            target: Some("t".repeat(strata_guest_proto::MAX_PATH + 1)),
        };
        let entry = entry_info(wire("/a/b", 0)).expect("an entry");
        assert_eq!((entry.name.as_str(), entry.mode, entry.symlink_target), ("b", 0o644, None));
        assert_eq!(entry.modified, UNIX_EPOCH.checked_sub(Duration::from_secs(5)));
        assert_eq!(entry_info(wire("/a/b", 1_000_000_000)).expect("an entry").modified, None);
        for bad in ["relative", "/a/../b", ""] {
            assert!(entry_info(wire(bad, 0)).is_none(), "{bad}");
        }
        assert!(described(wire("/a/c", 0), &path("/a/b")).is_err());
        let event =
            |p: &str| strata_guest_proto::WatchEvent { kind: strata_guest_proto::WatchKind::Write, path: p.into() };
        assert!(watch_event(event("/w/x"), &path("/w")).is_some());
        assert!(watch_event(event("/elsewhere"), &path("/w")).is_none());
    }

    #[test]
    fn the_agents_messages_are_cut_short() {
        assert_eq!(reason(libc::ENOENT, "whatever"), "does not exist");
        let long = "é".repeat(1000);
        let cut = reason(libc::EIO, &long);
        assert!(cut.len() <= MAX_REASON && long.starts_with(&cut));
    }
}
