//! The sandbox's file methods through the real agent (a host process here, so its "guest" paths lie in the
//! fixture's temporary guest root): what each answers, what each refuses, links never followed, the listing cap,
//! and watches, down to a file that lives for 10 ms.

use strata_core::{EntryInfo, FileType, GuestPath, WatchEvent, WatchEventKind, Watcher};

use super::*;

fn path(text: &str) -> GuestPath {
    GuestPath::new(text).expect("a guest path")
}

/// The path `name` in the fixture's guest root.
fn at(fixture: &Fixture, name: &str) -> GuestPath {
    path(&fixture.guest(name))
}

fn reason(err: TierError) -> String {
    match err {
        TierError::GuestPath { reason, .. } => reason,
        other => panic!("expected a guest_path error, got {other:?}"),
    }
}

fn names(entries: &[EntryInfo]) -> Vec<&str> {
    entries.iter().map(|e| e.path.as_str().rsplit_once("/work/").map_or("?", |(_, rel)| rel)).collect()
}

/// The watcher's events until `done` holds of them, or ten seconds pass.
fn events_until(watcher: &Watcher, done: impl Fn(&[WatchEvent]) -> bool) -> Vec<WatchEvent> {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut seen = Vec::new();
    while !done(&seen) && Instant::now() < deadline {
        seen.extend(watcher.next_timeout(Duration::from_millis(100)));
    }
    seen
}

fn saw(events: &[WatchEvent], kind: WatchEventKind, path: &GuestPath) -> bool {
    events.iter().any(|e| e.kind == kind && e.path == *path)
}

/// The agent's inotify instances (its open inotify descriptors).
fn inotify_instances(pid: u32) -> usize {
    let Ok(fds) = fs::read_dir(format!("/proc/{pid}/fd")) else { return 0 };
    fds.flatten()
        .filter(|fd| fs::read_link(fd.path()).is_ok_and(|target| target.as_os_str() == "anon_inode:inotify"))
        .count()
}

#[test]
fn stat_and_list_dir_describe_links_without_following_them() {
    let _shared = shared();
    let fixture = Fixture::new();
    let Some((mut session, _)) = fixture.session(&limits()) else { return };
    let setup = "mkdir -p tree/sub outside && echo hi > tree/f && echo deep > tree/sub/g && echo secret > outside/s \
                 && ln -s ../outside tree/link && chmod 640 tree/f";
    assert_eq!(exec(&mut session, setup).status, Status::Exited { code: 0 });

    let file = session.stat(&at(&fixture, "work/tree/f")).expect("stat");
    assert_eq!((file.name.as_str(), file.file_type, file.size, file.mode), ("f", FileType::File, 3, 0o640));
    assert!(file.modified.is_some());
    let link = session.stat(&at(&fixture, "work/tree/link")).expect("stat a link");
    assert_eq!((link.file_type, link.symlink_target.as_deref()), (FileType::Symlink, Some("../outside")));
    assert_eq!(session.stat(&at(&fixture, "work/tree")).expect("stat a dir").file_type, FileType::Dir);

    let tree = at(&fixture, "work/tree");
    assert_eq!(names(&session.list_dir(&tree, 1).expect("list")), ["tree/f", "tree/link", "tree/sub"]);
    let deep = session.list_dir(&tree, 2).expect("list deeper");
    assert_eq!(names(&deep), ["tree/f", "tree/link", "tree/sub", "tree/sub/g"], "the link was not entered");
    assert!(deep.iter().all(|e| e.path.is_within(&tree) && e.path != tree));

    let missing = at(&fixture, "work/missing");
    assert_eq!(reason(session.stat(&missing).expect_err("missing")), "does not exist");
    assert_eq!(reason(session.list_dir(&missing, 1).expect_err("missing")), "does not exist");
    let through_link = session.list_dir(&at(&fixture, "work/tree/link"), 1).expect_err("a link is not listed");
    assert_eq!(through_link.code(), "guest_path", "{through_link}");
    assert_eq!(session.stat(&path("/proc/self")).expect_err("proc").code(), "guest_path");
}

#[test]
fn a_listing_over_its_cap_is_refused() {
    let _shared = shared();
    let fixture = Fixture::new();
    let Some((mut session, _)) = fixture.session(&limits()) else { return };
    assert_eq!(exec(&mut session, "mkdir many && cd many && touch a b c d e").status, Status::Exited { code: 0 });
    let many = at(&fixture, "work/many");
    assert_eq!(session.list_dir_at_most(&many, 1, 5).expect("at the cap").len(), 5);
    let err = session.list_dir_at_most(&many, 1, 4).expect_err("over the cap");
    assert_eq!(err.code(), "wrong_format", "{err}");
    assert_eq!(session.list_dir(&many, 1).expect("under the real cap").len(), 5);
}

#[test]
fn make_dir_rename_and_remove_change_the_guest_and_spare_what_links_point_to() {
    let _shared = shared();
    let fixture = Fixture::new();
    let Some((session, _)) = fixture.session(&limits()) else { return };
    let made = at(&fixture, "work/a/b/c");
    assert!(session.make_dir(&made).expect("make"));
    assert!(!session.make_dir(&made).expect("again"), "it was there already");
    assert!(fixture.guest_root.path().join("work/a/b/c").is_dir());
    session.write_file(&fixture.guest("work/a/file"), b"x").expect("write");
    assert_eq!(session.make_dir(&at(&fixture, "work/a/file")).expect_err("a file in the way").code(), "guest_path");

    let moved = session.rename(&at(&fixture, "work/a/file"), &at(&fixture, "work/a/moved")).expect("rename");
    assert_eq!((moved.path, moved.file_type, moved.size), (at(&fixture, "work/a/moved"), FileType::File, 1));
    assert_eq!(reason(session.stat(&at(&fixture, "work/a/file")).expect_err("moved away")), "does not exist");
    let gone = session.rename(&at(&fixture, "work/nothing"), &at(&fixture, "work/x")).expect_err("nothing to move");
    assert_eq!(reason(gone), "does not exist");

    let keep = fixture.guest_root.path().join("keep");
    fs::create_dir(&keep).expect("mkdir");
    fs::write(keep.join("precious"), b"keep me").expect("write");
    std::os::unix::fs::symlink(&keep, fixture.guest_root.path().join("work/a/b/link")).expect("symlink");
    std::os::unix::fs::symlink(&keep, fixture.guest_root.path().join("work/lone-link")).expect("symlink");
    session.remove(&at(&fixture, "work/lone-link")).expect("remove a link");
    session.remove(&at(&fixture, "work/a")).expect("remove a tree");
    assert!(!fixture.guest_root.path().join("work/a").exists());
    assert_eq!(fs::read(keep.join("precious")).expect("kept"), b"keep me", "a link was followed");
    assert_eq!(reason(session.remove(&at(&fixture, "work/a")).expect_err("gone")), "does not exist");

    // Read-only grants, and what holds them, are not changed; nor are the root and the kernel's filesystems.
    let ro = at(&fixture, "ro");
    assert!(reason(session.make_dir(&ro.join("x").expect("join")).expect_err("ro")).contains("read-only"));
    assert!(reason(session.remove(&ro).expect_err("ro")).contains("read-only"));
    let rw_file = at(&fixture, "rw/start.txt");
    assert!(reason(session.rename(&rw_file, &ro.join("x").expect("join")).expect_err("ro")).contains("read-only"));
    assert_eq!(session.remove(&GuestPath::root()).expect_err("root").code(), "guest_path");
    assert_eq!(session.make_dir(&path("/sys/x")).expect_err("sys").code(), "guest_path");
    assert!(fixture.ro_host.path().join("keep.txt").exists());
}

#[test]
fn a_watcher_sees_a_file_that_lives_for_10_ms() {
    let _shared = shared();
    let fixture = Fixture::new();
    let Some((mut session, _)) = fixture.session(&limits()) else { return };
    let watcher = session.watch(&at(&fixture, "work"), false).expect("watch");
    let started = Instant::now();
    let job = exec(&mut session, "echo data > brief && sleep 0.01 && rm brief");
    assert_eq!(job.status, Status::Exited { code: 0 });
    assert!(started.elapsed() < Duration::from_secs(5));
    let brief = at(&fixture, "work/brief");
    let events = events_until(&watcher, |e| saw(e, WatchEventKind::Remove, &brief));
    let kinds: Vec<WatchEventKind> = events.iter().filter(|e| e.path == brief).map(|e| e.kind).collect();
    assert_eq!(kinds.first(), Some(&WatchEventKind::Create), "{events:?}");
    assert_eq!(kinds.last(), Some(&WatchEventKind::Remove), "{events:?}");
    assert!(kinds.contains(&WatchEventKind::Write), "{events:?}");
    assert!(!watcher.overflowed());
}

#[test]
fn a_recursive_watch_sees_files_in_directories_made_after_it_started() {
    let _shared = shared();
    let fixture = Fixture::new();
    let Some((mut session, _)) = fixture.session(&limits()) else { return };
    let work = at(&fixture, "work");
    let flat = session.watch(&work, false).expect("watch");
    let recursive = session.watch(&work, true).expect("watch recursively");
    let job = exec(&mut session, "mkdir -p later/deeper && echo x > later/deeper/f && chmod 600 later/deeper/f");
    assert_eq!(job.status, Status::Exited { code: 0 });
    let f = at(&fixture, "work/later/deeper/f");
    let events = events_until(&recursive, |e| saw(e, WatchEventKind::Create, &f));
    assert!(saw(&events, WatchEventKind::Create, &at(&fixture, "work/later")), "{events:?}");
    assert!(saw(&events, WatchEventKind::Create, &f), "{events:?}");
    // A later change below is seen too, and the flat watch saw only its own directory's entries.
    assert_eq!(exec(&mut session, "mv later/deeper/f later/deeper/g").status, Status::Exited { code: 0 });
    let g = at(&fixture, "work/later/deeper/g");
    let events = events_until(&recursive, |e| saw(e, WatchEventKind::Create, &g));
    assert!(saw(&events, WatchEventKind::Rename, &f) && saw(&events, WatchEventKind::Create, &g), "{events:?}");
    let flat_events = flat.drain();
    assert!(saw(&flat_events, WatchEventKind::Create, &at(&fixture, "work/later")), "{flat_events:?}");
    assert!(flat_events.iter().all(|e| e.path.parent() == Some(work.clone())), "{flat_events:?}");

    let file = at(&fixture, "work/later/deeper/g");
    assert_eq!(session.watch(&file, false).expect_err("a file is not watched").code(), "guest_path");
    assert_eq!(reason(session.watch(&at(&fixture, "work/none"), true).expect_err("missing")), "does not exist");
}

#[test]
fn dropping_the_watcher_ends_the_agents_watch() {
    let _shared = shared();
    let fixture = Fixture::new();
    let Some((mut session, pid)) = fixture.session(&limits()) else { return };
    assert_eq!(inotify_instances(pid), 0);
    let watcher = session.watch(&at(&fixture, "work"), true).expect("watch");
    assert_eq!(inotify_instances(pid), 1, "the agent watches with one inotify instance");
    drop(watcher);
    let deadline = Instant::now() + Duration::from_secs(10);
    while inotify_instances(pid) > 0 {
        assert!(Instant::now() < deadline, "the agent still watches after the watcher was dropped");
        std::thread::sleep(Duration::from_millis(10));
    }
    // The session goes on, and a new watch works.
    let again = session.watch(&at(&fixture, "work"), false).expect("watch again");
    assert_eq!(exec(&mut session, "touch after").status, Status::Exited { code: 0 });
    let after = at(&fixture, "work/after");
    assert!(saw(&events_until(&again, |e| saw(e, WatchEventKind::Create, &after)), WatchEventKind::Create, &after));
    // Closing the session ends the watch for its reader too.
    session.close().expect("close");
    let ended = Instant::now();
    while again.next_timeout(Duration::from_secs(5)).is_some() {}
    assert!(ended.elapsed() < Duration::from_secs(5), "the watcher did not see its end");
}
