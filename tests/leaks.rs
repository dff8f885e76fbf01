//! No fd, thread or mapping leaks after 1,000 wasm and Python jobs; no fd, thread, child process, cgroup or
//! mount leaks after 200 process-tier jobs and sessions (with jobs at once in them); none after 500 forks of a
//! snapshot on each tier, nor after 500 live forks of a process-tier zygote, nor after 100 microVM monitor
//! processes (stopped, dropped, killed by their filter, saved and forked). A binary of its own (no test harness),
//! so nothing else runs in the process while it counts.

use std::time::Instant;

use strata_core::{
    Capabilities, ExecOptions, Grant, GrantMode, Job, Limits, LimitsOverride, PythonSource, Snapshot, Status, TierKind,
};
use strata_engine::{Engine, EngineConfig, RunRequest, TierChoice};
use strata_test_programs as programs;

fn count(dir: &str) -> usize {
    std::fs::read_dir(dir).map(|d| d.count()).unwrap_or(0)
}

fn scratch_dirs() -> usize {
    std::fs::read_dir(std::env::temp_dir())
        .map(|d| {
            d.filter(|e| e.as_ref().is_ok_and(|e| e.file_name().to_string_lossy().starts_with("strata-scratch-")))
                .count()
        })
        .unwrap_or(0)
}

fn mappings() -> usize {
    std::fs::read_to_string("/proc/self/maps").map(|m| m.lines().count()).unwrap_or(0)
}

#[derive(Debug, PartialEq, Eq, Clone, Copy)]
struct Resources {
    fds: usize,
    threads: usize,
    mappings: usize,
    scratch_dirs: usize,
}

fn resources() -> Resources {
    Resources {
        fds: count("/proc/self/fd"),
        threads: count("/proc/self/task"),
        mappings: mappings(),
        scratch_dirs: scratch_dirs(),
    }
}

fn python(code: &str) -> Job {
    Job::Python { source: PythonSource::Code(code.into()), args: Vec::new() }
}

/// Python sessions: started, a few turns, closed (or dropped).
fn sessions(engine: &Engine, caps: &Capabilities, count: usize) -> anyhow::Result<()> {
    for i in 0..count {
        let sandbox = engine.start(TierChoice::Auto, caps, &Limits::default())?;
        for turn in ["x = 1", "x += 1", "x"] {
            let outcome = sandbox.exec(&python(turn), ExecOptions::default())?;
            anyhow::ensure!(outcome.status == Status::Exited { code: 0 }, "{outcome:?}");
        }
        if i % 2 == 0 {
            sandbox.close()?;
        }
    }
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let data = tempfile::tempdir()?;
    std::fs::write(data.path().join("f.txt"), "data")?;
    // The shared home: the Python runtime is installed and compiled there once.
    let home = strata_engine::strata_home().ok_or_else(|| anyhow::anyhow!("no STRATA_HOME"))?;
    let engine = Engine::new(EngineConfig { home: Some(home), ..EngineConfig::default() })?;
    let caps =
        Capabilities { grants: vec![Grant::new(data.path(), "/data", GrantMode::Rw)?], ..Capabilities::default() };
    let fuel: LimitsOverride = toml::from_str("fuel = 2000000")?;
    let small_memory: LimitsOverride = toml::from_str("memory = \"4MiB\"")?;
    let jobs: Vec<(Job, Limits)> = vec![
        (Job::wasm_file(programs::HELLO, vec![]), Limits::default()),
        (Job::wasm_file(programs::ECHO, vec!["x".into()]), Limits::default()),
        (Job::wasm_file(programs::FS, vec!["read".into(), "/data/f.txt".into()]), Limits::default()),
        (Job::wasm_file(programs::FS, vec!["write".into(), "/data/g.txt".into(), "y".into()]), Limits::default()),
        (Job::wasm_file(programs::PANIC, vec![]), Limits::default()),
        (Job::wasm_file(programs::SPIN, vec![]), fuel.apply(&Limits::default())),
        (Job::wasm_file(programs::ALLOC, vec!["16".into()]), small_memory.apply(&Limits::default())),
        (Job::wasm_file(programs::TRIVIAL_WAT, vec![]), Limits::default()),
        (python("print(open('/data/f.txt').read())"), Limits::default()),
        (python("open('/tmp/x', 'w').write('y'); 1 / 0"), Limits::default()),
    ];
    let run_all = |rounds: usize| -> anyhow::Result<usize> {
        let mut done = 0;
        for _ in 0..rounds {
            for (job, limits) in &jobs {
                let outcome =
                    engine.execute(RunRequest::new(job).caps(&caps).limits(limits.clone()).stdin(b"input".to_vec()))?;
                anyhow::ensure!(!matches!(outcome.status, Status::Crashed { .. }), "{outcome:?}");
                done += 1;
            }
        }
        Ok(done)
    };
    // Warm up: engines, epoch threads, the executor, prepared modules, and a worker thread (whose stack and
    // malloc arena the C library keeps for the next thread).
    run_all(2)?;
    sessions(&engine, &caps, 2)?;
    std::thread::scope(|s| s.spawn(|| run_all(1)).join()).map_err(|_| anyhow::anyhow!("worker panicked"))??;
    let before = resources();
    let started = Instant::now();
    let rounds = 1000usize.div_ceil(jobs.len() * 2);
    let mut done = run_all(rounds)?;
    // The other half on a second thread, which must leave nothing behind when it ends.
    done += std::thread::scope(|s| s.spawn(|| run_all(rounds)).join())
        .map_err(|_| anyhow::anyhow!("worker thread panicked"))??;
    sessions(&engine, &caps, 20)?;
    let after = resources();
    println!("{done} jobs in {:.2?}; before {before:?}, after {after:?}", started.elapsed());
    anyhow::ensure!(done >= 1000, "ran only {done} jobs");
    anyhow::ensure!(before == after, "resources leaked: before {before:?}, after {after:?}");
    println!("leaks (wasm tier): ok");
    wasm_forks(&engine)?;
    process_tier(&engine, data.path())?;
    process_forks(&engine)?;
    zygote_forks(&engine)?;
    monitors(&engine)?;
    println!("leaks: ok");
    Ok(())
}

/// What a process-tier job could leave behind on the host.
#[derive(Debug, PartialEq, Eq, Clone, Copy)]
struct HostResources {
    fds: usize,
    threads: usize,
    children: usize,
    cgroups: usize,
    mounts: usize,
}

/// Processes whose parent is this one (a jail's keeper while it runs).
fn children() -> usize {
    let me = std::process::id().to_string();
    let Ok(entries) = std::fs::read_dir("/proc") else { return 0 };
    entries
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().bytes().all(|b| b.is_ascii_digit()))
        .filter_map(|e| std::fs::read_to_string(e.path().join("stat")).ok())
        .filter(|stat| stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().nth(1)) == Some(me.as_str()))
        .count()
}

fn host_resources(engine: &Engine) -> anyhow::Result<HostResources> {
    Ok(HostResources {
        fds: count("/proc/self/fd"),
        threads: count("/proc/self/task"),
        children: children(),
        cgroups: engine.process()?.cgroups().count(),
        mounts: std::fs::read_to_string("/proc/self/mountinfo")?.lines().count(),
    })
}

/// 200 jobs of every kind on the process tier (limits tripped among them), and sessions, leave nothing behind.
fn process_tier(engine: &Engine, data: &std::path::Path) -> anyhow::Result<()> {
    if let Err(err) = engine.process() {
        println!("skip: process-tier leak check: the process tier cannot run on this host: {err}");
        return Ok(());
    }
    let caps = Capabilities { grants: vec![Grant::new(data, "/data", GrantMode::Rw)?], ..Capabilities::default() };
    let sh = |script: &str| Job::Command { argv: vec!["sh".into(), "-c".into(), script.into()] };
    let tight: LimitsOverride = toml::from_str("wall = \"200ms\"\nmemory = \"48MiB\"\npids = 16")?;
    let tight = tight.apply(&Limits::default());
    let jobs: Vec<(Job, Limits, bool)> = vec![
        (sh("cat; echo out; echo err >&2; ls /data > /dev/null"), Limits::default(), true),
        (sh("sleep 5 & sleep 6 & exit 3"), Limits::default(), true),
        (Job::Native { program: programs::NATIVE_HELLO.into(), args: vec!["x".into()] }, Limits::default(), true),
        (python("print(open('/data/f.txt').read())"), Limits::default(), true),
        (sh("sleep 30"), tight.clone(), false),
        (python("x = bytearray(200 << 20)"), tight.clone(), false),
        (Job::Command { argv: vec!["bash".into(), "-c".into(), ":(){ :|:& };:; sleep 5".into()] }, tight, false),
        (Job::Command { argv: vec!["no-such-program".into()] }, Limits::default(), true),
    ];
    let run_all = |rounds: usize| -> anyhow::Result<usize> {
        let mut done = 0;
        for _ in 0..rounds {
            for (job, limits, ok) in &jobs {
                let request = RunRequest::new(job).caps(&caps).limits(limits.clone()).stdin(b"input".to_vec());
                match engine.execute(request.tier(TierChoice::Tier(strata_core::TierKind::Process))) {
                    Ok(outcome) => {
                        let limited = matches!(outcome.status, Status::LimitExceeded { .. });
                        anyhow::ensure!(limited != *ok, "{job:?}: {outcome:?}");
                    }
                    Err(err) => anyhow::ensure!(err.code() == "program_not_found", "{job:?}: {err}"),
                }
                done += 1;
            }
        }
        Ok(done)
    };
    let session_rounds = |count: usize| -> anyhow::Result<()> {
        for i in 0..count {
            let sandbox = engine.start(TierChoice::Tier(strata_core::TierKind::Process), &caps, &Limits::default())?;
            sandbox.write_file("/tmp/in", b"x")?;
            for script in ["cat /tmp/in > /tmp/out", "sleep 9 &", "cat /tmp/out"] {
                let outcome = sandbox.exec(&sh(script), ExecOptions::default())?;
                anyhow::ensure!(outcome.status == Status::Exited { code: 0 }, "{outcome:?}");
            }
            anyhow::ensure!(sandbox.read_file("/tmp/out")? == b"x");
            // Jobs at once: one leaves a process behind (its cgroup lingers until the sandbox goes), one trips
            // its memory limit, one is plain; and a file call beside them.
            let handle = &sandbox;
            let tight: LimitsOverride = toml::from_str("memory = \"48MiB\"")?;
            let tight = ExecOptions { limits: Some(tight.apply(&Limits::default())), ..ExecOptions::default() };
            std::thread::scope(|scope| -> anyhow::Result<()> {
                let lingering =
                    scope.spawn(|| handle.exec(&sh("sleep 9 > /dev/null 2>&1 & echo"), ExecOptions::default()));
                let hungry = scope.spawn(|| handle.exec(&python("x = bytearray(200 << 20)"), tight));
                let plain = handle.exec(&sh("cat /tmp/out"), ExecOptions::default())?;
                anyhow::ensure!(plain.stdout == b"x", "{plain:?}");
                handle.write_file("/tmp/beside", b"y")?;
                let lingering = lingering.join().map_err(|_| anyhow::anyhow!("job thread"))??;
                anyhow::ensure!(lingering.status == Status::Exited { code: 0 }, "{lingering:?}");
                let hungry = hungry.join().map_err(|_| anyhow::anyhow!("job thread"))??;
                anyhow::ensure!(matches!(hungry.status, Status::LimitExceeded { .. }), "{hungry:?}");
                Ok(())
            })?;
            anyhow::ensure!(handle.read_file("/tmp/beside")? == b"y");
            if i % 2 == 0 {
                sandbox.close()?;
            }
        }
        Ok(())
    };
    run_all(1)?;
    session_rounds(1)?;
    let before = host_resources(engine)?;
    let started = Instant::now();
    let done = run_all(200usize.div_ceil(jobs.len()))?;
    session_rounds(20)?;
    let after = host_resources(engine)?;
    println!(
        "{done} process-tier jobs and 20 sessions in {:.2?}; before {before:?}, after {after:?}",
        started.elapsed()
    );
    anyhow::ensure!(done >= 200, "ran only {done} jobs");
    anyhow::ensure!(before == after, "process tier leaked: before {before:?}, after {after:?}");
    Ok(())
}

/// Forks of `snapshot`, each running `job` (which must print `expect`), half closed and half dropped.
fn forks(engine: &Engine, snapshot: &Snapshot, job: &Job, expect: &[u8], count: usize) -> anyhow::Result<()> {
    for i in 0..count {
        let fork = engine.fork(TierChoice::Auto, snapshot)?;
        let outcome = fork.exec(job, ExecOptions::default())?;
        anyhow::ensure!(outcome.status == Status::Exited { code: 0 } && outcome.stdout == expect, "{outcome:?}");
        if i % 2 == 0 {
            fork.close()?;
        }
    }
    Ok(())
}

/// 500 forks of a Python session's snapshot leave no fd, thread, mapping or scratch directory behind.
fn wasm_forks(engine: &Engine) -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let session = engine.start(TierChoice::Tier(TierKind::Wasm), &Capabilities::default(), &Limits::default())?;
    let setup = session.exec(&python("x = 41\nopen('/tmp/n', 'w').write('n')"), ExecOptions::default())?;
    anyhow::ensure!(setup.status == Status::Exited { code: 0 }, "{setup:?}");
    let snapshot = session.snapshot(&dir.path().join("snap"))?;
    session.close()?;
    let job = python("print(x + 1, open('/tmp/n').read())");
    forks(engine, &snapshot, &job, b"42 n\n", 2)?;
    let before = resources();
    let started = Instant::now();
    forks(engine, &snapshot, &job, b"42 n\n", 500)?;
    let after = resources();
    println!("500 wasm forks in {:.2?}; before {before:?}, after {after:?}", started.elapsed());
    anyhow::ensure!(before == after, "wasm forks leaked: before {before:?}, after {after:?}");
    Ok(())
}

/// 500 forks of a process-tier snapshot leave no fd, thread, child, cgroup or mount behind.
fn process_forks(engine: &Engine) -> anyhow::Result<()> {
    if let Err(err) = engine.process() {
        println!("skip: process-tier fork leak check: the process tier cannot run on this host: {err}");
        return Ok(());
    }
    let dir = tempfile::tempdir()?;
    let sh = |script: &str| Job::Command { argv: vec!["sh".into(), "-c".into(), script.into()] };
    let sandbox = engine.start(TierChoice::Tier(TierKind::Process), &Capabilities::default(), &Limits::default())?;
    let setup = sandbox.exec(&sh("echo 41 > /tmp/x"), ExecOptions::default())?;
    anyhow::ensure!(setup.status == Status::Exited { code: 0 }, "{setup:?}");
    let snapshot = sandbox.snapshot(&dir.path().join("snap"))?;
    sandbox.close()?;
    let job = sh("cat /tmp/x; echo 1 >> /tmp/x");
    forks(engine, &snapshot, &job, b"41\n", 2)?;
    let before = host_resources(engine)?;
    let started = Instant::now();
    forks(engine, &snapshot, &job, b"41\n", 500)?;
    let after = host_resources(engine)?;
    println!("500 process forks in {:.2?}; before {before:?}, after {after:?}", started.elapsed());
    anyhow::ensure!(before == after, "process forks leaked: before {before:?}, after {after:?}");
    Ok(())
}

/// 500 live forks of a Python zygote (and the zygote itself, closed) leave no fd, thread, child, cgroup or mount
/// behind.
fn zygote_forks(engine: &Engine) -> anyhow::Result<()> {
    let tier = match engine.process() {
        Ok(tier) => tier,
        Err(err) => {
            println!("skip: zygote fork leak check: the process tier cannot run on this host: {err}");
            return Ok(());
        }
    };
    let run = |zygote: &strata_tier_process::zygote::ProcessZygote, count: usize| -> anyhow::Result<()> {
        for i in 0..count {
            let outcome = zygote.fork_python(&format!("print(x + {i})"), &ExecOptions::default())?;
            anyhow::ensure!(outcome.stdout == format!("{}\n", 41 + i).as_bytes(), "{outcome:?}");
        }
        Ok(())
    };
    let (caps, limits) = (Capabilities::default(), Limits::default());
    let (warm, _) = tier.python_zygote("x = 41", &caps, &limits)?;
    run(&warm, 2)?;
    warm.close();
    let before = host_resources(engine)?;
    let started = Instant::now();
    let (zygote, _) = tier.python_zygote("x = 41", &caps, &limits)?;
    run(&zygote, 500)?;
    zygote.close();
    let after = host_resources(engine)?;
    println!("500 zygote forks in {:.2?}; before {before:?}, after {after:?}", started.elapsed());
    anyhow::ensure!(before == after, "zygote forks leaked: before {before:?}, after {after:?}");
    Ok(())
}

/// 100 microVM monitor processes (tiny guests: stopped, dropped, killed by their seccomp filter, saved and forked)
/// leave no fd, thread, child, cgroup or mount behind.
fn monitors(engine: &Engine) -> anyhow::Result<()> {
    use std::os::fd::AsFd;
    use strata_tier_microvm::monitor::{Monitor, MonitorConfig};
    use strata_vmm::proto::{MachineSpec, ThreadKind};
    if !std::path::Path::new("/dev/kvm").exists() {
        println!("skip: monitors: /dev/kvm is absent");
        return Ok(());
    }
    let run = tempfile::tempdir()?;
    let config = MonitorConfig::new(run.path().join("run"));
    let spin = || MachineSpec::code(vec![0xeb, 0xfe], 0x1000, 2 << 20).with_vsock("vsock.sock");
    let fork = MachineSpec { guest_cid: Some(7), ..MachineSpec::fork().with_vsock("vsock.sock") };
    let one = |i: usize| -> anyhow::Result<()> {
        let mut monitor = Monitor::start(&config, &spin(), &[], 1, 2 << 20)?;
        match i % 4 {
            0 => monitor.stop(),
            1 => drop(monitor),
            2 => anyhow::ensure!(monitor.probe(ThreadKind::Vmm).is_err(), "the probe did not end the monitor"),
            _ => {
                let (state, memory) = (tempfile::tempfile()?, tempfile::tempfile()?);
                monitor.snapshot(&state, &memory)?;
                let mut reader = &state;
                std::io::Seek::rewind(&mut reader)?;
                Monitor::start(&config, &fork, &[state.as_fd(), memory.as_fd()], 1, 2 << 20)?.stop();
                monitor.stop();
            }
        }
        Ok(())
    };
    // Warm up: the embedded binary's memfd, the cgroup root.
    one(0)?;
    let before = host_resources(engine)?;
    let started = Instant::now();
    for i in 0..100 {
        one(i)?;
    }
    let after = host_resources(engine)?;
    println!("100 monitors in {:.2?}; before {before:?}, after {after:?}", started.elapsed());
    anyhow::ensure!(before == after, "monitors leaked: before {before:?}, after {after:?}");
    let left: Vec<_> = std::fs::read_dir(&config.run_dir)?.collect();
    anyhow::ensure!(left.is_empty(), "VM directories left: {left:?}");
    println!("leaks (microVM monitors): ok");
    Ok(())
}
