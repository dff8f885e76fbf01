//! A process sandbox's filesystem methods: the paths checked by `strata_core::GuestPath`'s rules, the work
//! done by the jail's PID 1 inside the jail (see `strata_jail::files`, `strata_jail::watch`), its answers turned
//! into [`EntryInfo`] and [`WatchEvent`].

use std::sync::{Arc, Mutex, PoisonError};

use strata_core::fs::{MAX_LIST_DEPTH, MAX_LIST_ENTRIES, WATCH_CAPACITY};
use strata_core::{EntryInfo, FileType, GuestEntry, GuestPath, TierError, WatchEvent, WatchEventKind, Watcher};
use strata_jail::proto::{self, EntryKind, HostFrame, WatchKind};

use crate::jail::{FileAnswer, JailError, JailWatch, Lanes};
use crate::{internal, jail_error};

/// Checks a path a file method reads or changes (not the root, nothing in the kernel filesystems).
pub(crate) fn file_target(path: &str) -> Result<GuestPath, TierError> {
    Ok(GuestPath::file_target(path)?)
}

/// Checks a directory to list or watch: the root may be, the kernel filesystems may not.
fn readable_dir(path: &GuestPath) -> Result<(), TierError> {
    Ok(path.check_readable()?)
}

/// Maps a failed file request on `path` to the tier's error: the jail's reasons become `guest_path` errors.
pub(crate) fn file_error(path: &str, err: JailError) -> TierError {
    match err {
        JailError::File { message, .. } => TierError::GuestPath { path: path.to_owned(), reason: message },
        JailError::ListTooLarge { limit } => TierError::WrongFormat {
            what: format!("the listing of {path} (more than {limit} entries)"),
            expected: "within the listing limit",
        },
        other => jail_error(other),
    }
}

fn unexpected(answer: FileAnswer) -> TierError {
    internal(format!("the jail answered a file request with {answer:?}"))
}

pub(crate) fn list_dir(lanes: &Lanes, path: &GuestPath, depth: u32) -> Result<Vec<EntryInfo>, TierError> {
    list_dir_at_most(lanes, path, depth, MAX_LIST_ENTRIES)
}

/// [`list_dir`] refusing more than `max` entries.
pub(crate) fn list_dir_at_most(
    lanes: &Lanes,
    path: &GuestPath,
    depth: u32,
    max: usize,
) -> Result<Vec<EntryInfo>, TierError> {
    readable_dir(path)?;
    let frame = HostFrame::ListDir {
        path: path.as_str().to_owned(),
        depth: depth.clamp(1, MAX_LIST_DEPTH),
        max_entries: u32::try_from(max).unwrap_or(u32::MAX),
    };
    match lanes.file_request(&frame).map_err(|e| file_error(path.as_str(), e))? {
        FileAnswer::Entries(entries) => Ok(entries.into_iter().filter_map(entry_info).collect()),
        other => Err(unexpected(other)),
    }
}

pub(crate) fn stat(lanes: &Lanes, path: &GuestPath) -> Result<EntryInfo, TierError> {
    readable_dir(path)?;
    let frame = HostFrame::Stat { path: path.as_str().to_owned() };
    one_entry(lanes.file_request(&frame).map_err(|e| file_error(path.as_str(), e))?)
}

pub(crate) fn make_dir(lanes: &Lanes, path: &GuestPath) -> Result<bool, TierError> {
    path.check_file_target()?;
    let frame = HostFrame::MakeDir { path: path.as_str().to_owned() };
    match lanes.file_request(&frame).map_err(|e| file_error(path.as_str(), e))? {
        FileAnswer::DirMade(created) => Ok(created),
        other => Err(unexpected(other)),
    }
}

pub(crate) fn rename(lanes: &Lanes, from: &GuestPath, to: &GuestPath) -> Result<EntryInfo, TierError> {
    from.check_file_target()?;
    to.check_file_target()?;
    let frame = HostFrame::Rename { from: from.as_str().to_owned(), to: to.as_str().to_owned() };
    one_entry(lanes.file_request(&frame).map_err(|e| file_error(from.as_str(), e))?)
}

pub(crate) fn remove(lanes: &Lanes, path: &GuestPath) -> Result<(), TierError> {
    path.check_file_target()?;
    let frame = HostFrame::Remove { path: path.as_str().to_owned() };
    match lanes.file_request(&frame).map_err(|e| file_error(path.as_str(), e))? {
        FileAnswer::Removed => Ok(()),
        other => Err(unexpected(other)),
    }
}

/// A watch of `path` by PID 1's inotify, on a lane of its own; dropping the [`Watcher`] stops it there.
pub(crate) fn watch(lanes: &Lanes, path: &GuestPath, recursive: bool) -> Result<Watcher, TierError> {
    readable_dir(path)?;
    let running: Arc<Mutex<Option<JailWatch>>> = Arc::new(Mutex::new(None));
    let slot = running.clone();
    let (sender, watcher) = Watcher::channel(WATCH_CAPACITY, move || {
        let watch = slot.lock().unwrap_or_else(PoisonError::into_inner).take();
        if let Some(watch) = watch {
            watch.stop();
        }
    });
    let watched = path.clone();
    let on_events = move |events: Vec<proto::WatchEvent>, overflowed: bool| {
        if overflowed {
            log::warn!("the watch of {watched} lost events in the jail (its queues overflowed)");
            sender.mark_overflowed();
        }
        events.into_iter().filter_map(|event| watch_event(event, &watched)).all(|event| sender.send(event))
    };
    let jail_watch = lanes.watch_dir(path.as_str(), recursive, on_events).map_err(|err| match err {
        // The jail's own bound on watches, or the kernel's on inotify instances and watches.
        JailError::File { errno: libc::EMFILE | libc::ENOSPC, message } => {
            TierError::Capacity { tier: strata_core::TierKind::Process, reason: format!("watching {path}: {message}") }
        }
        other => file_error(path.as_str(), other),
    })?;
    *running.lock().unwrap_or_else(PoisonError::into_inner) = Some(jail_watch);
    Ok(watcher)
}

fn one_entry(answer: FileAnswer) -> Result<EntryInfo, TierError> {
    match answer {
        FileAnswer::Entry(entry) => {
            let path = entry.path.clone();
            entry_info(entry).ok_or_else(|| internal(format!("the jail described an entry at {path:?}")))
        }
        other => Err(unexpected(other)),
    }
}

/// An entry as the core describes it, checked ([`EntryInfo::from_guest`]).
fn entry_info(entry: proto::Entry) -> Option<EntryInfo> {
    let file_type = match entry.kind {
        EntryKind::File => FileType::File,
        EntryKind::Dir => FileType::Dir,
        EntryKind::Symlink => FileType::Symlink,
        EntryKind::Other => FileType::Other,
    };
    EntryInfo::from_guest(GuestEntry {
        path: entry.path,
        file_type,
        size: entry.size,
        mode: entry.mode,
        owner: (entry.uid, entry.gid),
        modified: entry.modified,
        symlink_target: entry.link,
    })
}

/// PID 1's event as the core's, if it is about a guest path within the watched directory.
fn watch_event(event: proto::WatchEvent, watched: &GuestPath) -> Option<WatchEvent> {
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
    use std::time::{Duration, Instant};

    use strata_core::{Capabilities, ExecOptions, Job, Limits, Sandbox, Status};

    use super::*;
    use crate::{ProcessSandbox, ProcessTier, ProcessTierConfig};

    /// A process tier on the installed Debian image, or `None` (with a note) where this host has none.
    fn tier(run: &std::path::Path) -> Option<ProcessTier> {
        let home = strata_benches::strata_home();
        let installed = match strata_rootfs_image::DebianImage::new(&home).and_then(|image| image.installed()) {
            Ok(installed) => installed,
            Err(err) => {
                eprintln!("skipped: no Debian image under {}: {err}", home.display());
                return None;
            }
        };
        let config = ProcessTierConfig {
            rootfs: installed.rootfs,
            run_dir: run.join("jail"),
            snapshots: strata_core::SnapshotTrust::process_local(),
            images: None,
        };
        match ProcessTier::new(config) {
            Ok(tier) => Some(tier),
            Err(err) => {
                eprintln!("skipped: {err}");
                None
            }
        }
    }

    fn sandbox(tier: &ProcessTier) -> Arc<ProcessSandbox> {
        let (caps, limits) = (Capabilities::default(), Limits::default());
        let image = tier.root_image(&caps).expect("the image");
        let jail = tier.start_jail(&caps, &limits, false, None, &image).expect("a jail");
        Arc::new(ProcessSandbox::new(jail, caps, limits, tier.snapshot_origin(None, image)).expect("a sandbox"))
    }

    fn path(text: &str) -> GuestPath {
        GuestPath::new(text).expect("a guest path")
    }

    fn sh(sandbox: &dyn Sandbox, script: &str) {
        let job = Job::Command { argv: vec!["sh".into(), "-c".into(), script.into()] };
        let outcome = sandbox.exec(&job, ExecOptions::default()).expect("the job runs");
        assert_eq!(outcome.status, Status::Exited { code: 0 }, "{}", String::from_utf8_lossy(&outcome.stderr));
    }

    fn reason(err: TierError) -> String {
        match err {
            TierError::GuestPath { reason, .. } => reason,
            other => panic!("expected a guest_path error, got {other:?}"),
        }
    }

    /// Events until one matches `until`, or five seconds pass.
    fn events_until(watcher: &Watcher, until: impl Fn(&WatchEvent) -> bool) -> Vec<WatchEvent> {
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut seen = Vec::new();
        while let Some(event) = watcher.next_timeout(deadline.saturating_duration_since(Instant::now())) {
            let done = until(&event);
            seen.push(event);
            if done {
                break;
            }
        }
        seen
    }

    fn event(kind: WatchEventKind, at: &str) -> WatchEvent {
        WatchEvent { kind, path: path(at) }
    }

    #[test]
    fn each_method_works_and_a_missing_path_says_so() {
        let run = tempfile::tempdir().expect("tempdir");
        let Some(tier) = tier(run.path()) else { return };
        let sandbox = sandbox(&tier);
        assert!(sandbox.make_dir(&path("/work/a/b")).expect("mkdir -p"));
        assert!(!sandbox.make_dir(&path("/work/a/b")).expect("again"), "it existed already");
        sandbox.write_file("/work/a/f", b"hi").expect("write");
        let stat = sandbox.stat(&path("/work/a/f")).expect("stat");
        assert_eq!((stat.file_type, stat.size, stat.name.as_str(), stat.uid), (FileType::File, 2, "f", 0));
        assert_eq!(stat.mode, 0o644);
        assert!(stat.modified.is_some_and(|t| t.elapsed().is_ok_and(|age| age < Duration::from_secs(600))));

        let names = |list: Vec<EntryInfo>| {
            let mut names: Vec<String> = list.into_iter().map(|e| e.path.as_str().to_owned()).collect();
            names.sort();
            names
        };
        assert_eq!(names(sandbox.list_dir(&path("/work"), 1).expect("list")), ["/work/a"]);
        assert_eq!(names(sandbox.list_dir(&path("/work"), 2).expect("list")), ["/work/a", "/work/a/b", "/work/a/f"]);
        assert!(sandbox.list_dir(&GuestPath::root(), 1).expect("the root").iter().any(|e| e.path == "/usr"));

        let moved = sandbox.rename(&path("/work/a/f"), &path("/work/g")).expect("rename");
        assert_eq!((moved.path.as_str(), moved.size), ("/work/g", 2));
        assert_eq!(sandbox.read_file("/work/g").expect("read"), b"hi");
        assert_eq!(reason(sandbox.stat(&path("/work/a/f")).expect_err("moved")), "does not exist");

        sandbox.remove(&path("/work/a")).expect("remove a tree");
        assert_eq!(reason(sandbox.stat(&path("/work/a")).expect_err("removed")), "does not exist");
        assert_eq!(reason(sandbox.remove(&path("/work/a")).expect_err("gone")), "does not exist");
        assert_eq!(reason(sandbox.list_dir(&path("/nowhere"), 1).expect_err("missing")), "does not exist");
        assert!(reason(sandbox.rename(&path("/nowhere"), &path("/work/x")).expect_err("missing")).contains("exist"));
        assert!(reason(sandbox.make_dir(&path("/work/g/sub")).expect_err("a file in the way")).contains("directory"));
        assert!(reason(sandbox.list_dir(&path("/work/g"), 1).expect_err("a file")).contains("directory"));
        for kernel in ["/proc", "/proc/1", "/sys/kernel", "/dev"] {
            sandbox.list_dir(&path(kernel), 1).expect_err(kernel);
        }
        sandbox.remove(&GuestPath::root()).expect_err("the root");
        sandbox.write_file("/proc/x", b"x").expect_err("the kernel filesystems");
        assert!(reason(sandbox.read_file("/a/../etc/passwd").expect_err("dotdot")).contains(".."));
    }

    #[test]
    fn symlinks_are_listed_never_followed_out_of_the_jail() {
        let run = tempfile::tempdir().expect("tempdir");
        let Some(tier) = tier(run.path()) else { return };
        // A host directory the jail does not have: a link naming it must reach nothing on the host.
        let host = tempfile::tempdir().expect("tempdir");
        std::fs::write(host.path().join("victim"), b"host").expect("host file");
        let sandbox = sandbox(&tier);
        let script = format!(
            "mkdir -p /work/d && ln -s {host} /work/host && ln -s /proc /work/kern && ln -s /proc/1/root /work/pid1 \
             && ln -s ../../../../../etc /work/up && ln -s /etc/passwd /work/d/pw",
            host = host.path().display()
        );
        sh(sandbox.as_ref(), &script);
        let listing = sandbox.list_dir(&path("/work"), 2).expect("list");
        let link = |name: &str| listing.iter().find(|e| e.path == name).unwrap_or_else(|| panic!("{name}"));
        assert_eq!(link("/work/host").file_type, FileType::Symlink);
        assert_eq!(link("/work/host").symlink_target.as_deref(), Some(host.path().to_str().expect("utf-8")));
        assert_eq!(link("/work/kern").symlink_target.as_deref(), Some("/proc"));
        assert_eq!(link("/work/d/pw").file_type, FileType::Symlink);
        assert!(!listing.iter().any(|e| e.path.as_str().starts_with("/work/kern/")), "links are not descended");
        assert_eq!(sandbox.stat(&path("/work/pid1")).expect("stat").file_type, FileType::Symlink);

        let victim = "/work/host/victim";
        assert_eq!(reason(sandbox.remove(&path(victim)).expect_err("not in the jail")), "does not exist");
        assert_eq!(reason(sandbox.stat(&path(victim)).expect_err("not in the jail")), "does not exist");
        assert!(host.path().join("victim").exists());
        assert!(reason(sandbox.list_dir(&path("/work/kern"), 1).expect_err("kernel")).contains("kernel"));
        assert!(reason(sandbox.stat(&path("/work/kern/self/environ")).expect_err("kernel")).contains("kernel"));
        // `..` stops at the jail's root: the link names the jail's /etc.
        assert!(
            sandbox.list_dir(&path("/work/up"), 1).expect("in the jail").iter().any(|e| e.path == "/work/up/passwd")
        );

        // read_file and write_file follow a link as the guest would, inside the jail, never into /proc.
        sh(
            sandbox.as_ref(),
            "ln -s /proc/1/environ /work/env && ln -s /etc/hostname /work/hn && ln -s /work/t /work/to",
        );
        assert!(reason(sandbox.read_file("/work/env").expect_err("kernel")).contains("kernel"));
        assert!(reason(sandbox.write_file("/work/kern/sys/kernel/x", b"x").expect_err("kernel")).contains("kernel"));
        assert_eq!(
            sandbox.read_file("/work/hn").expect("through a link"),
            sandbox.read_file("/etc/hostname").expect("read")
        );
        sh(sandbox.as_ref(), "touch /work/t");
        sandbox.write_file("/work/to", b"via").expect("through a link");
        assert_eq!(sandbox.read_file("/work/t").expect("the target"), b"via");
        assert_eq!(sandbox.stat(&path("/work/to")).expect("stat").file_type, FileType::Symlink);
        assert!(reason(sandbox.read_file("/work").expect_err("a directory")).contains("regular file"));

        sandbox.remove(&path("/work/pid1")).expect("remove the link");
        sandbox.remove(&path("/work/d")).expect("remove a tree holding a link");
        assert!(sandbox.stat(&path("/etc/passwd")).is_ok_and(|e| e.file_type == FileType::File), "the target stays");
        assert!(sandbox.list_dir(&GuestPath::root(), 1).is_ok_and(|l| l.iter().any(|e| e.path == "/etc")));
    }

    #[test]
    fn read_only_grants_fifos_and_links_hold_for_every_method() {
        let run = tempfile::tempdir().expect("tempdir");
        let Some(tier) = tier(run.path()) else { return };
        let ro = tempfile::tempdir().expect("tempdir");
        std::fs::write(ro.path().join("keep.txt"), "original").expect("write");
        let caps = Capabilities {
            grants: vec![strata_core::Grant::new(ro.path(), "/ro", strata_core::GrantMode::Ro).expect("grant")],
            ..Capabilities::default()
        };
        let image = tier.root_image(&caps).expect("the image");
        let jail = tier.start_jail(&caps, &Limits::default(), false, None, &image).expect("a jail");
        let origin = tier.snapshot_origin(None, image);
        let sandbox = ProcessSandbox::new(jail, caps, Limits::default(), origin).expect("sandbox");
        sh(&sandbox, "ln -s / /tmp/root-link; ln -s /ro/keep.txt /tmp/ro-link; mkfifo /tmp/fifo");
        let code = |err: TierError| err.code();
        assert_eq!(code(sandbox.write_file("/ro/keep.txt", b"changed").expect_err("ro grant")), "guest_path");
        assert_eq!(code(sandbox.write_file("/tmp/ro-link", b"changed").expect_err("link to ro")), "guest_path");
        assert_eq!(code(sandbox.remove(&path("/ro/keep.txt")).expect_err("ro grant")), "guest_path");
        assert_eq!(code(sandbox.make_dir(&path("/ro/new")).expect_err("ro grant")), "guest_path");
        assert_eq!(code(sandbox.rename(&path("/ro/keep.txt"), &path("/tmp/k")).expect_err("ro")), "guest_path");
        assert_eq!(std::fs::read_to_string(ro.path().join("keep.txt")).expect("read"), "original");
        assert_eq!(sandbox.list_dir(&path("/ro"), 1).expect("list a grant").len(), 1);
        assert_eq!(code(sandbox.read_file("/tmp/fifo").expect_err("fifo")), "guest_path");
        assert_eq!(sandbox.stat(&path("/tmp/fifo")).expect("stat").file_type, FileType::Other);
        assert_eq!(sandbox.read_file("/tmp/root-link/etc/hostname").expect("jail file"), b"strata\n");
        sandbox.write_file("/tmp/root-link/tmp/through-link", b"x").expect("write through a link inside the jail");
        assert!(!std::path::Path::new("/tmp/through-link").exists(), "a write escaped to the host");
        assert_eq!(sandbox.read_file("/tmp/through-link").expect("in the jail"), b"x");
    }

    #[test]
    fn a_listing_above_the_cap_is_refused() {
        let run = tempfile::tempdir().expect("tempdir");
        let Some(tier) = tier(run.path()) else { return };
        let sandbox = sandbox(&tier);
        sh(sandbox.as_ref(), "mkdir -p /work/many && cd /work/many && touch $(seq 1 20)");
        let lanes = sandbox.lanes_for_tests();
        let err = list_dir_at_most(lanes, &path("/work/many"), 1, 10).expect_err("too many");
        assert!(matches!(err, TierError::WrongFormat { .. }), "{err:?}");
        assert_eq!(list_dir_at_most(lanes, &path("/work/many"), 1, 20).expect("at the cap").len(), 20);
        assert_eq!(sandbox.list_dir(&path("/work"), 2).expect("under the default cap").len(), 21);
    }

    #[test]
    fn file_methods_run_while_a_job_runs() {
        let run = tempfile::tempdir().expect("tempdir");
        let Some(tier) = tier(run.path()) else { return };
        let handle = sandbox(&tier);
        let job_handle = handle.clone();
        let job = std::thread::spawn(move || {
            let job = Job::Command { argv: vec!["sh".into(), "-c".into(), "mkdir -p /work/slow && sleep 2".into()] };
            job_handle.exec(&job, ExecOptions::default())
        });
        let started = Instant::now();
        let deadline = started + Duration::from_secs(1);
        while handle.stat(&path("/work/slow")).is_err() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        let workers: Vec<_> = (0..4)
            .map(|i| {
                let handle = handle.clone();
                std::thread::spawn(move || {
                    let dir = path(&format!("/work/slow/{i}"));
                    assert!(handle.make_dir(&dir).expect("mkdir"));
                    handle.write_file(&format!("{dir}/f"), b"x").expect("write");
                    assert_eq!(handle.list_dir(&dir, 1).expect("list").len(), 1);
                    handle.rename(&dir.join("f").expect("join"), &dir.join("g").expect("join")).expect("rename");
                    handle.remove(&dir).expect("remove");
                })
            })
            .collect();
        for worker in workers {
            worker.join().expect("a worker");
        }
        assert!(started.elapsed() < Duration::from_millis(1900), "the file methods waited for the job");
        assert!(handle.list_dir(&path("/work/slow"), 1).expect("list").is_empty());
        let outcome = job.join().expect("the job thread").expect("the job");
        assert_eq!(outcome.status, Status::Exited { code: 0 });
    }

    #[test]
    fn a_watcher_sees_a_file_that_lives_for_10_ms() {
        let run = tempfile::tempdir().expect("tempdir");
        let Some(tier) = tier(run.path()) else { return };
        let sandbox = sandbox(&tier);
        sandbox.make_dir(&path("/work/w")).expect("mkdir");
        let watcher = sandbox.watch(&path("/work/w"), false).expect("watch");
        sh(
            sandbox.as_ref(),
            "python3 -c \"import os, time\nt = time.monotonic()\nwith open('/work/w/brief', 'w') as f: f.write('x')\n\
             time.sleep(0.002)\nos.remove('/work/w/brief')\nassert time.monotonic() - t < 0.010\"",
        );
        let seen = events_until(&watcher, |e| e.kind == WatchEventKind::Remove);
        let brief = "/work/w/brief";
        assert_eq!(seen.first(), Some(&event(WatchEventKind::Create, brief)), "{seen:?}");
        assert!(seen.contains(&event(WatchEventKind::Write, brief)), "{seen:?}");
        assert_eq!(seen.last(), Some(&event(WatchEventKind::Remove, brief)), "{seen:?}");
    }

    #[test]
    fn a_recursive_watch_sees_files_in_directories_made_after_it_started() {
        let run = tempfile::tempdir().expect("tempdir");
        let Some(tier) = tier(run.path()) else { return };
        let handle = sandbox(&tier);
        handle.make_dir(&path("/work/r/old")).expect("mkdir");
        let watcher = handle.watch(&path("/work/r"), true).expect("watch");
        let job = Job::Command {
            argv: vec![
                "sh".into(),
                "-c".into(),
                "echo x > /work/r/old/a && mkdir -p /work/r/new/deeper && echo y > /work/r/new/deeper/b \
                 && sleep 0.2 && echo z > /work/r/new/deeper/c && mv /work/r/new/deeper/c /work/r/d && chmod 600 /work/r/d"
                    .into(),
            ],
        };
        assert_eq!(handle.exec(&job, ExecOptions::default()).expect("job").status, Status::Exited { code: 0 });
        let seen = events_until(&watcher, |e| e.kind == WatchEventKind::Chmod);
        for expected in [
            event(WatchEventKind::Create, "/work/r/old/a"),
            event(WatchEventKind::Write, "/work/r/old/a"),
            event(WatchEventKind::Create, "/work/r/new"),
            event(WatchEventKind::Create, "/work/r/new/deeper/b"),
            event(WatchEventKind::Create, "/work/r/new/deeper/c"),
            event(WatchEventKind::Rename, "/work/r/new/deeper/c"),
            event(WatchEventKind::Create, "/work/r/d"),
            event(WatchEventKind::Chmod, "/work/r/d"),
        ] {
            assert!(seen.contains(&expected), "{expected:?} not in {seen:?}");
        }
        assert!(!watcher.overflowed());
    }

    #[test]
    fn a_flood_of_events_costs_the_host_a_fixed_amount() {
        let run = tempfile::tempdir().expect("tempdir");
        let Some(tier) = tier(run.path()) else { return };
        let sandbox = sandbox(&tier);
        sandbox.make_dir(&path("/work/flood")).expect("mkdir");
        let watcher = sandbox.watch(&path("/work/flood"), true).expect("watch");
        sh(
            sandbox.as_ref(),
            "cd /work/flood && seq 1 20000 | xargs touch && mkdir d && cd d && seq 1 2000 | xargs touch",
        );
        // The jail goes on serving while its watch drains.
        let started = Instant::now();
        assert_eq!(sandbox.stat(&path("/work/flood/d")).expect("stat").file_type, FileType::Dir);
        assert!(started.elapsed() < Duration::from_secs(2));
        std::thread::sleep(Duration::from_millis(500));
        let held = watcher.drain();
        assert!(held.len() <= WATCH_CAPACITY, "{} events held", held.len());
        assert!(watcher.overflowed(), "the reader learns events were dropped");
        drop(watcher);
        assert!(sandbox.list_dir(&path("/work/flood"), 1).expect("list").len() > 20_000);
    }

    /// The inotify descriptors PID 1 holds.
    fn inotify_fds(pid1: nix::unistd::Pid) -> usize {
        let Ok(fds) = std::fs::read_dir(format!("/proc/{pid1}/fd")) else { return 0 };
        fds.flatten()
            .filter(|fd| std::fs::read_link(fd.path()).is_ok_and(|l| l.as_os_str() == "anon_inode:inotify"))
            .count()
    }

    #[test]
    fn dropping_the_watcher_ends_the_jails_watch() {
        let run = tempfile::tempdir().expect("tempdir");
        let Some(tier) = tier(run.path()) else { return };
        let sandbox = sandbox(&tier);
        let pid1 = sandbox.pid1().expect("the jail runs");
        assert_eq!(inotify_fds(pid1), 0);
        let handle = sandbox.clone();
        let watchers: Vec<Watcher> = (0..3).map(|_| handle.watch(&GuestPath::root(), false).expect("watch")).collect();
        let own = sandbox.watch(&path("/tmp"), true).expect("watch");
        assert_eq!(inotify_fds(pid1), 4);
        drop(watchers);
        drop(own);
        let deadline = Instant::now() + Duration::from_secs(2);
        while inotify_fds(pid1) > 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(inotify_fds(pid1), 0, "PID 1 closed every watch's inotify descriptor");
        // The jail still serves.
        assert!(handle.stat(&path("/tmp")).is_ok());
        let watchers: Vec<Watcher> =
            (0..strata_jail::watch::MAX_WATCHES).map(|_| handle.watch(&path("/tmp"), false).expect("watch")).collect();
        let refused = handle.watch(&path("/tmp"), false).expect_err("past the jail's watches");
        assert!(matches!(refused, TierError::Capacity { .. }), "{refused:?}");
        drop(watchers);
    }
}
