//! Jobs as an account of the sandbox's image (`Capabilities::user`, `ExecOptions::user`): the process tier looks
//! the name up in the jail's own `/etc/passwd`, the job has its IDs, groups, home and nothing of root's; `sudo`
//! reaches the jail's root through PID 1 for members of the `sudo` group only, with exit codes, stdin and signals
//! passed through, and dies with its job; the file calls create files the user owns; wasm refuses.

use std::time::{Duration, Instant};

use strata_core::{CancelToken, Capabilities, ExecOptions, Job, Limits, Status, Tier, TierError, TierKind, UserName};

use crate::util::{process_tier, python_engine};

fn sh(script: &str) -> Job {
    Job::Command { argv: vec!["/bin/sh".into(), "-c".into(), script.into()] }
}

fn user(name: &str) -> Option<UserName> {
    Some(UserName::new(name).expect("a valid name"))
}

fn as_user() -> Capabilities {
    Capabilities { user: user("user"), ..Capabilities::default() }
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn a_users_job_has_its_ids_groups_and_home_and_nothing_of_roots() {
    let Some(tier) = process_tier("a_users_job_has_its_ids_groups_and_home_and_nothing_of_roots") else { return };
    let script = "id -u; id -g; id -G; echo $HOME $USER $LOGNAME; pwd; \
                  touch /home/user/mine && stat -c '%u %g' /home/user/mine; \
                  touch /root/x 2>/dev/null || echo no-root-home; touch /etc/x 2>/dev/null || echo no-etc; \
                  cat /proc/self/status | grep -E '^(CapEff|NoNewPrivs)'";
    let outcome = tier.run(&sh(script), &as_user(), &Limits::default(), ExecOptions::default()).expect("run");
    assert_eq!(outcome.status, Status::Exited { code: 0 }, "{}", text(&outcome.stderr));
    let out = text(&outcome.stdout);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[..2], ["1000", "1000"], "{out}");
    let groups: Vec<&str> = lines[2].split(' ').collect();
    assert!(groups.contains(&"1000") && groups.contains(&"27"), "the user's group and sudo: {out}");
    assert_eq!(lines[3..6], ["/home/user user user", "/home/user", "1000 1000"], "{out}");
    assert_eq!(lines[6..8], ["no-root-home", "no-etc"], "{out}");
    assert!(out.contains("CapEff:\t0000000000000000") && out.contains("NoNewPrivs:\t1"), "{out}");
    // The job's option wins over the sandbox's user, both ways.
    let root = ExecOptions { user: Some(UserName::root()), ..ExecOptions::default() };
    let outcome = tier.run(&sh("id -u; pwd"), &as_user(), &Limits::default(), root).expect("run");
    assert_eq!(text(&outcome.stdout), "0\n/root\n");
    let named = ExecOptions { user: user("user"), ..ExecOptions::default() };
    let outcome = tier.run(&sh("id -un"), &Capabilities::default(), &Limits::default(), named).expect("run");
    assert_eq!(text(&outcome.stdout), "user\n");
}

#[test]
fn sudo_runs_as_the_jails_root_with_the_callers_streams_and_status() {
    let Some(tier) = process_tier("sudo_runs_as_the_jails_root_with_the_callers_streams_and_status") else { return };
    let script = "sudo id -u; sudo -i pwd; echo piped | sudo cat; sudo sh -c 'echo to-stderr >&2; exit 7'; \
                  echo status=$?; sudo touch /etc/made-by-sudo && stat -c %u /etc/made-by-sudo; \
                  sudo sh -c 'kill -TERM $$'; echo after-term=$?";
    let outcome = tier.run(&sh(script), &as_user(), &Limits::default(), ExecOptions::default()).expect("run");
    assert_eq!(outcome.status, Status::Exited { code: 0 }, "{}", text(&outcome.stderr));
    assert_eq!(text(&outcome.stdout), "0\n/root\npiped\nstatus=7\n0\nafter-term=143\n");
    assert!(text(&outcome.stderr).contains("to-stderr"), "{}", text(&outcome.stderr));
}

#[test]
fn only_root_and_the_sudo_group_may_use_sudo() {
    let Some(tier) = process_tier("only_root_and_the_sudo_group_may_use_sudo") else { return };
    let sandbox = tier.start(&Capabilities::default(), &Limits::default()).expect("start");
    let made = sandbox
        .exec(&sh("echo 'bob:x:1001:1001::/tmp:/bin/sh' >> /etc/passwd && echo made"), ExecOptions::default())
        .expect("useradd");
    assert_eq!(text(&made.stdout), "made\n", "{}", text(&made.stderr));
    let bob = ExecOptions { user: user("bob"), ..ExecOptions::default() };
    let outcome = sandbox.exec(&sh("sudo id -u; echo status=$?"), bob).expect("exec");
    assert_eq!(text(&outcome.stdout), "status=1\n");
    assert!(text(&outcome.stderr).contains("not in the sudoers"), "{}", text(&outcome.stderr));
    // Root may (nothing changes for it).
    let outcome = sandbox.exec(&sh("sudo id -u"), ExecOptions::default()).expect("exec");
    assert_eq!(text(&outcome.stdout), "0\n");
    // A user the image does not have is a typed refusal before anything runs.
    let ghost = ExecOptions { user: user("ghost"), ..ExecOptions::default() };
    let err = sandbox.exec(&sh("true"), ghost).expect_err("no such user");
    assert!(err.to_string().contains("no user \"ghost\""), "{err}");
    sandbox.close().expect("close");
}

#[test]
fn a_sudo_command_ends_with_the_job_that_started_it() {
    let Some(tier) = process_tier("a_sudo_command_ends_with_the_job_that_started_it") else { return };
    let sandbox = tier.start(&as_user(), &Limits::default()).expect("start");
    let cancel = CancelToken::new();
    let opts = ExecOptions { cancel: Some(cancel.clone()), ..ExecOptions::default() };
    std::thread::scope(|scope| {
        let job = scope.spawn(|| sandbox.exec(&sh("sudo sleep 1234"), opts));
        let deadline = Instant::now() + Duration::from_secs(30);
        let root = || ExecOptions { user: Some(UserName::root()), ..ExecOptions::default() };
        loop {
            let ps = sandbox.exec(&sh("pgrep -x -u 0 sleep || true"), root()).expect("pgrep");
            if !ps.stdout.is_empty() {
                break;
            }
            assert!(Instant::now() < deadline, "the sudo command never ran");
            std::thread::sleep(Duration::from_millis(20));
        }
        cancel.cancel();
        let err = job.join().expect("join").expect_err("cancelled");
        assert!(matches!(err, TierError::Cancelled), "{err}");
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let ps = sandbox.exec(&sh("pgrep -x sleep || echo gone"), root()).expect("pgrep");
            if text(&ps.stdout) == "gone\n" {
                break;
            }
            assert!(Instant::now() < deadline, "the sudo command outlived its job: {}", text(&ps.stdout));
            std::thread::sleep(Duration::from_millis(20));
        }
    });
    sandbox.close().expect("close");
}

#[test]
fn the_file_calls_of_a_users_sandbox_create_what_the_user_owns() {
    let Some(tier) = process_tier("the_file_calls_of_a_users_sandbox_create_what_the_user_owns") else { return };
    let sandbox = tier.start(&as_user(), &Limits::default()).expect("start");
    sandbox.write_file("/home/user/new/dir/f.txt", b"one\n").expect("write");
    let outcome = sandbox
        .exec(
            &sh("stat -c '%u %g %n' /home/user/new /home/user/new/dir/f.txt; echo two >> /home/user/new/dir/f.txt"),
            ExecOptions::default(),
        )
        .expect("exec");
    assert_eq!(outcome.status, Status::Exited { code: 0 }, "{}", text(&outcome.stderr));
    assert_eq!(text(&outcome.stdout), "1000 1000 /home/user/new\n1000 1000 /home/user/new/dir/f.txt\n");
    assert_eq!(sandbox.read_file("/home/user/new/dir/f.txt").expect("read"), b"one\ntwo\n");
    sandbox.close().expect("close");
    // A sandbox whose user the image lacks does not start.
    let caps = Capabilities { user: user("ghost"), ..Capabilities::default() };
    let err = tier.start(&caps, &Limits::default()).err().expect("no such user");
    assert!(err.to_string().contains("ghost"), "{err}");
}

#[test]
fn tiers_without_accounts_refuse_a_user_and_python_for_a_user_goes_native() {
    let engine = python_engine();
    let wasm = engine.wasm();
    let job = Job::Python { source: strata_core::PythonSource::Code("print(1)".into()), args: Vec::new() };
    let err = wasm.start(&as_user(), &Limits::default()).err().expect("refused");
    assert!(matches!(err, TierError::Unsupported { tier: TierKind::Wasm, .. }), "{err}");
    let opts = ExecOptions { user: user("user"), ..ExecOptions::default() };
    let err = wasm.run(&job, &Capabilities::default(), &Limits::default(), opts).expect_err("refused");
    assert!(err.to_string().contains("accounts"), "{err}");
    // Root is no account of its own: wasm takes it.
    let root = ExecOptions { user: Some(UserName::root()), ..ExecOptions::default() };
    wasm.run(&job, &Capabilities::default(), &Limits::default(), root).expect("root is the default");
    if process_tier("tiers_without_accounts_refuse_a_user_and_python_for_a_user_goes_native").is_none() {
        return;
    }
    let code = "import os; print(os.getuid(), os.getcwd())";
    let job = Job::Python { source: strata_core::PythonSource::Code(code.into()), args: Vec::new() };
    let caps = as_user();
    let request = strata_engine::RunRequest::new(&job).caps(&caps);
    let outcome = engine.execute(request).expect("run");
    assert_eq!(text(&outcome.stdout), "1000 /home/user\n", "{}", text(&outcome.stderr));
    let route = outcome.route.expect("routed");
    assert_eq!(route.tier, TierKind::Process);
    assert!(route.reason.contains("user"), "{}", route.reason);
}
