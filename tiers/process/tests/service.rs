//! A sandbox's service (`Sandbox::start_service`, `Sandbox::service`): the jail's PID 1 runs the command, keeps
//! its output, restarts it until its burst is spent, and stops it gracefully when the sandbox closes — leaving no
//! process and no cgroup behind. Each test skips (with a note) where the host has no Debian image or cannot run
//! jails.
//!
//! The tests find the service from the host by a token in its command line (tests run in parallel, each with
//! its own sandbox), and its cgroup from `/proc/<pid>/cgroup`.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use strata_core::{
    Capabilities, ExecOptions, Grant, GrantMode, Job, Limits, Sandbox, ServiceExit, ServiceSpec, ServiceState,
    ServiceStatus, Status, Tier, TierError,
};
use strata_tier_process::{ProcessTier, ProcessTierConfig};

/// A process tier on the installed Debian image, or `None` (with a note) where this host has none.
fn tier(run: &Path) -> Option<ProcessTier> {
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

fn spec(command: &str) -> ServiceSpec {
    ServiceSpec { restart_delay: Duration::from_millis(50), ..ServiceSpec::new(command) }
}

fn status(sandbox: &dyn Sandbox) -> ServiceStatus {
    sandbox.service().expect("the service's status").expect("a service")
}

/// The service's status once `until` holds, or the last one after ten seconds.
fn wait_for(sandbox: &dyn Sandbox, until: impl Fn(&ServiceStatus) -> bool) -> ServiceStatus {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let status = status(sandbox);
        if until(&status) || Instant::now() > deadline {
            return status;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A job's standard output.
fn sh(sandbox: &dyn Sandbox, script: &str) -> String {
    let job = Job::Command { argv: vec!["sh".into(), "-c".into(), script.into()] };
    let outcome = sandbox.exec(&job, ExecOptions::default()).expect("the job runs");
    assert_eq!(outcome.status, Status::Exited { code: 0 }, "{}", String::from_utf8_lossy(&outcome.stderr));
    String::from_utf8_lossy(&outcome.stdout).into_owned()
}

/// The host PIDs of the processes whose command line holds `token`.
fn host_pids(token: &str) -> Vec<i32> {
    let Ok(entries) = std::fs::read_dir("/proc") else { return Vec::new() };
    entries
        .flatten()
        .filter_map(|entry| entry.file_name().to_str().and_then(|name| name.parse::<i32>().ok()))
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|cmdline| cmdline.windows(token.len()).any(|w| w == token.as_bytes()))
        })
        .collect()
}

/// The directory of the cgroup of `pid` in the hierarchy that has the pids controller (cgroup v1), or in the
/// unified one (v2).
fn pids_cgroup_dir(pid: i32) -> Option<PathBuf> {
    let membership = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    let mounts: Vec<(&str, &str, &str)> = mountinfo
        .lines()
        .filter_map(|line| {
            let (left, right) = line.split_once(" - ")?;
            let mount = left.split(' ').nth(4)?;
            let mut right = right.split(' ');
            let (kind, options) = (right.next()?, right.nth(1)?);
            Some((mount, kind, options))
        })
        .collect();
    let v1 = membership.lines().find_map(|line| {
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        controllers.split(',').any(|c| c == "pids").then_some(path)
    });
    let v1_mount =
        mounts.iter().find(|(_, kind, options)| *kind == "cgroup" && options.split(',').any(|o| o == "pids"));
    match (v1, v1_mount) {
        (Some(path), Some((mount, _, _))) => Some(Path::new(mount).join(path.trim_start_matches('/'))),
        _ => {
            let path = membership.lines().find_map(|line| line.strip_prefix("0::"))?;
            let (mount, _, _) = mounts.iter().find(|(_, kind, _)| *kind == "cgroup2")?;
            Some(Path::new(mount).join(path.trim_start_matches('/')))
        }
    }
}

/// The service's host PIDs (by `token`) and its cgroup, which must be the child `service` of the jail's.
fn service_on_host(token: &str) -> (Vec<i32>, PathBuf) {
    let pids = host_pids(token);
    let first = *pids.first().unwrap_or_else(|| panic!("no process has {token} in its command line"));
    let cgroup = pids_cgroup_dir(first).expect("the service's cgroup");
    assert_eq!(cgroup.file_name().and_then(|n| n.to_str()), Some("service"), "{}", cgroup.display());
    (pids, cgroup)
}

/// No process of `pids` is left, and neither the service's cgroup nor the jail's.
fn assert_nothing_left(pids: &[i32], service_cgroup: &Path) {
    for pid in pids {
        assert!(!Path::new(&format!("/proc/{pid}")).exists(), "process {pid} outlived its sandbox");
    }
    assert!(!service_cgroup.exists(), "{} outlived its sandbox", service_cgroup.display());
    let jail = service_cgroup.parent().expect("the jail's cgroup");
    assert!(!jail.exists(), "{} outlived its sandbox", jail.display());
}

#[test]
fn a_service_runs_and_its_output_is_kept() {
    let run = tempfile::tempdir().expect("tempdir");
    let Some(tier) = tier(run.path()) else { return };
    let sandbox = tier.start(&Capabilities::default(), &Limits::default()).expect("a sandbox");
    assert_eq!(sandbox.service().expect("status"), None, "no service yet");
    let token = "svc-token-ticks";
    sandbox.start_service(&spec(&format!(": {token}; while true; do echo tick; sleep 0.2; done"))).expect("started");
    let running = wait_for(sandbox.as_ref(), |s| s.state == ServiceState::Running && s.log_tail.contains("tick"));
    assert_eq!(running.state, ServiceState::Running, "{running:?}");
    assert!(running.log_tail.starts_with("tick\n"), "{running:?}");
    assert!(running.pid.is_some_and(|pid| pid > 1), "{running:?}");
    assert_eq!((running.restarts, running.last_exit), (0, None));
    // Jobs read the same output from the log file.
    assert!(sh(sandbox.as_ref(), "cat /run/strata/start.log").starts_with("tick\ntick\n"));
    let (pids, cgroup) = service_on_host(token);

    // A job killed for its wall-clock limit takes nothing of the service with it.
    let limits = Limits { wall: Duration::from_millis(300), ..Limits::default() };
    let job = Job::Command { argv: vec!["sleep".into(), "10".into()] };
    let opts = ExecOptions { limits: Some(limits), ..ExecOptions::default() };
    let outcome = sandbox.exec(&job, opts).expect("the job runs");
    assert!(matches!(outcome.status, Status::LimitExceeded { .. }), "{:?}", outcome.status);
    let after = status(sandbox.as_ref());
    assert_eq!((after.state, after.pid, after.restarts), (ServiceState::Running, running.pid, 0), "{after:?}");

    sandbox.close().expect("close");
    assert_nothing_left(&pids, &cgroup);
    assert!(matches!(sandbox.service(), Err(TierError::SessionEnded { .. })));
}

#[test]
fn a_service_that_exits_at_once_is_restarted_until_its_burst_is_spent() {
    let run = tempfile::tempdir().expect("tempdir");
    let Some(tier) = tier(run.path()) else { return };
    let sandbox = tier.start(&Capabilities::default(), &Limits::default()).expect("a sandbox");
    let spec = ServiceSpec { burst: 3, ..spec("echo boom; exit 3") };
    sandbox.start_service(&spec).expect("started");
    let failed = wait_for(sandbox.as_ref(), |s| s.state == ServiceState::Failed);
    assert_eq!(failed.state, ServiceState::Failed, "{failed:?}");
    assert_eq!((failed.restarts, failed.last_exit, failed.pid), (2, Some(ServiceExit::Code(3)), None), "{failed:?}");
    assert_eq!(failed.log_tail, "boom\nboom\nboom\n");
    // It stays down.
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(status(sandbox.as_ref()), failed);
    sandbox.close().expect("close");
}

#[test]
fn a_stopped_service_gets_sigterm_before_the_jail_ends() {
    let run = tempfile::tempdir().expect("tempdir");
    let Some(tier) = tier(run.path()) else { return };
    let out = tempfile::tempdir().expect("tempdir");
    let caps = Capabilities {
        grants: vec![Grant::new(out.path(), "/out", GrantMode::Rw).expect("grant")],
        ..Capabilities::default()
    };
    let sandbox = tier.start(&caps, &Limits::default()).expect("a sandbox");
    let token = "svc-token-term";
    let command =
        format!(": {token}; trap 'echo terminated > /out/term; exit 0' TERM; echo up; while :; do sleep 0.05; done");
    sandbox.start_service(&spec(&command)).expect("started");
    let up = wait_for(sandbox.as_ref(), |s| s.log_tail.contains("up"));
    assert!(up.pid.is_some(), "{up:?}");
    let (pids, cgroup) = service_on_host(token);
    let started = Instant::now();
    sandbox.close().expect("close");
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "the service ended at once on SIGTERM: {:?}",
        started.elapsed()
    );
    assert_eq!(std::fs::read_to_string(out.path().join("term")).expect("the TERM trap ran"), "terminated\n");
    assert_nothing_left(&pids, &cgroup);
}

#[test]
fn a_service_that_ignores_sigterm_is_killed_after_its_grace() {
    let run = tempfile::tempdir().expect("tempdir");
    let Some(tier) = tier(run.path()) else { return };
    let sandbox = tier.start(&Capabilities::default(), &Limits::default()).expect("a sandbox");
    let token = "svc-token-stubborn";
    // A child of its own too, in its process group: both ignore TERM (an ignored signal stays ignored in them).
    let command = format!(": {token}; trap '' TERM; sleep 1000 & echo up; while :; do sleep 0.05; done");
    let grace = Duration::from_millis(500);
    sandbox.start_service(&ServiceSpec { stop_grace: grace, ..spec(&command) }).expect("started");
    wait_for(sandbox.as_ref(), |s| s.log_tail.contains("up"));
    let (pids, cgroup) = service_on_host(token);
    let started = Instant::now();
    sandbox.close().expect("close");
    let took = started.elapsed();
    assert!(took >= grace, "the service was given its grace: {took:?}");
    // Its grace, the margin the host allows, and the close itself.
    assert!(took < grace + strata_tier_process::jail::STOP_MARGIN + Duration::from_secs(1), "{took:?}");
    assert_nothing_left(&pids, &cgroup);
}

#[test]
fn a_second_service_is_refused_and_a_bad_one_leaves_none() {
    let run = tempfile::tempdir().expect("tempdir");
    let Some(tier) = tier(run.path()) else { return };
    let sandbox = tier.start(&Capabilities::default(), &Limits::default()).expect("a sandbox");
    let empty = sandbox.start_service(&spec(" ")).expect_err("an empty command");
    assert!(matches!(empty, TierError::WrongFormat { .. }), "{empty:?}");
    assert_eq!(sandbox.service().expect("status"), None);
    sandbox.start_service(&spec("sleep 1000")).expect("the first");
    let second = sandbox.start_service(&spec("sleep 1000")).expect_err("a second");
    assert!(matches!(second, TierError::Busy { .. }), "{second:?}");
    assert_eq!(second.code(), "sandbox_busy");
    assert_eq!(status(sandbox.as_ref()).restarts, 0, "the first runs on");
    sandbox.close().expect("close");
}

#[test]
fn a_service_runs_as_the_sandboxs_jobs_do() {
    let run = tempfile::tempdir().expect("tempdir");
    let Some(tier) = tier(run.path()) else { return };
    let caps = Capabilities {
        user: Some(strata_core::UserName::new("user").expect("a user name")),
        env: vec!["GREETING=hello".parse().expect("a variable")],
        ..Capabilities::default()
    };
    let sandbox = tier.start(&caps, &Limits::default()).expect("a sandbox");
    let probe = "echo \"$(id -un) $(pwd) $HOME $GREETING $(ulimit -t)\"";
    let job = sh(sandbox.as_ref(), probe);
    sandbox.start_service(&spec(&format!("{probe}; sleep 1000"))).expect("started");
    let status = wait_for(sandbox.as_ref(), |s| s.log_tail.ends_with('\n'));
    let job = job.trim_end().rsplit_once(' ').map(|(rest, _)| rest.to_owned()).expect("five words");
    assert_eq!(job, "user /home/user /home/user hello");
    assert_eq!(status.log_tail, format!("{job} unlimited\n"), "the job's account and environment, no CPU-time limit");
    // What the service writes belongs to the sandbox's user.
    assert_eq!(sh(sandbox.as_ref(), "stat -c %U /run/strata/start.log"), "user\n");
    sandbox.close().expect("close");
}

#[test]
fn the_log_file_is_rotated_once_full_and_the_tail_stays_bounded() {
    let run = tempfile::tempdir().expect("tempdir");
    let Some(tier) = tier(run.path()) else { return };
    let sandbox = tier.start(&Capabilities::default(), &Limits::default()).expect("a sandbox");
    // 1.5 MiB of output, then a last line.
    let command = "head -c 1572864 /dev/zero | tr '\\0' x; echo; echo done; sleep 1000";
    sandbox.start_service(&spec(command)).expect("started");
    let status = wait_for(sandbox.as_ref(), |s| s.log_tail.ends_with("done\n"));
    assert!(status.log_tail.ends_with("xxx\ndone\n"), "{:?}", &status.log_tail[status.log_tail.len() - 16..]);
    assert_eq!(status.log_tail.len(), 16 * 1024);
    let sizes = sh(sandbox.as_ref(), "stat -c %s /run/strata/start.log.1 /run/strata/start.log");
    let sizes: Vec<u64> = sizes.lines().map(|size| size.parse().expect("a size")).collect();
    assert!(sizes[0] <= 1 << 20 && sizes[0] > (1 << 20) - 64 * 1024, "{sizes:?}");
    assert_eq!(sizes[0] + sizes[1], 1_572_864 + 6, "{sizes:?}");
    sandbox.close().expect("close");
}
