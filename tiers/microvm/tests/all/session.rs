//! Sessions end to end with the real guest agent (the embedded static binary, run as a host process over a Unix
//! socket: its "guest" paths are temporary directories here): several jobs in turn, limits, grants copied back
//! after exit 0 only, the file rules, snapshot meta and fork refusals, the agent's side of a restore, and that
//! closing leaves no process behind. What needs a booted Linux (snapshot and fork of a real VM) runs on hardware
//! KVM only: elsewhere its test prints one skip line.

mod egress;
mod files;

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::{Duration, Instant};

use strata_core::{
    ByteSize, Capabilities, ExecOptions, Grant, GrantMode, Job, LimitKind, Limits, Outcome, Persisted, Sandbox,
    Snapshot, SnapshotWriter, Status, Tier, TierError, TierKind,
};
use strata_guest_proto::{AgentClient, ClientError, ExecLimits, ExecRequest};
use strata_tier_microvm::session::{AgentHost, EgressPath, Session};
use strata_tier_microvm::snapshot::SnapshotExtra;
use strata_tier_microvm::tier::{MicrovmTier, MicrovmTierConfig};
use strata_tier_microvm::vstate::vcpu::cpuid::CpuidProfile;
use strata_vmm::test_utils::process::{alone, shared};

use crate::{KvmKind, agent_process, kvm_kind, strata_home};

/// The agent as a host process: the session's guest in these tests.
#[derive(Debug)]
struct ProcessAgent {
    child: Child,
    workdir: String,
    /// Meta keys the fake snapshot adds (what the VM adds: its images).
    images: serde_json::Value,
    /// Where the agent's egress streams arrive (`<agent socket>_1028`, as the vsock device names a guest's
    /// connection to port 1028) and a free port for its forwarder (the host's loopback is shared by the tests).
    egress: EgressPath,
    /// The agent's socket: its streams to host port N arrive at `<socket>_N`.
    socket: PathBuf,
    _dir: tempfile::TempDir,
}

impl ProcessAgent {
    /// The agent and its client; `None` (after one skip line) when this build has no embedded agent.
    fn spawn(workdir: &Path) -> Option<(ProcessAgent, AgentClient)> {
        let agent_process::Spawned { child, client, dir } = agent_process::spawn()?;
        let workdir = workdir.to_str().expect("utf-8").to_owned();
        let socket = dir.path().join(format!("agent.sock_{}", strata_guest_proto::EGRESS_PORT));
        let listen_port = std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port();
        let egress = EgressPath { socket, listen_port };
        let images = serde_json::json!({"kernel": "none"});
        let socket = dir.path().join("agent.sock");
        Some((ProcessAgent { child, workdir, images, egress, socket, _dir: dir }, client))
    }
}

impl AgentHost for ProcessAgent {
    fn has_stopped(&self) -> bool {
        false
    }

    fn workdir(&self) -> &str {
        &self.workdir
    }

    fn egress_path(&self) -> Option<EgressPath> {
        Some(self.egress.clone())
    }

    fn dial_socket(&self, port: u32) -> Option<PathBuf> {
        let mut socket = self.socket.clone().into_os_string();
        socket.push(format!("_{port}"));
        Some(socket.into())
    }

    /// What the VM does, minus the VM: the manifest and meta of a microVM snapshot around a placeholder file.
    fn snapshot(
        &mut self,
        destination: &Path,
        parent: Option<String>,
        mut extra: SnapshotExtra,
    ) -> Result<Snapshot, TierError> {
        let writer = SnapshotWriter::create(destination, &strata_core::SnapshotTrust::process_local())?;
        fs::write(writer.dir().join("memory"), b"not a VM").expect("placeholder");
        extra.meta.insert("images".into(), self.images.clone());
        let mut persists = vec![Persisted::Memory, Persisted::Cpu, Persisted::Devices];
        persists.extend(extra.persists);
        Ok(writer.commit(TierKind::Microvm, parent, persists, serde_json::Value::Object(extra.meta))?)
    }

    fn shut_down(mut self) {
        // The agent exits on power-off; wait for it (no zombie).
        let _ = self.child.wait();
    }
}

struct Fixture {
    guest_root: tempfile::TempDir,
    rw_host: tempfile::TempDir,
    ro_host: tempfile::TempDir,
}

impl Fixture {
    fn new() -> Fixture {
        let fixture = Fixture {
            guest_root: tempfile::tempdir().expect("tempdir"),
            rw_host: tempfile::tempdir().expect("tempdir"),
            ro_host: tempfile::tempdir().expect("tempdir"),
        };
        fs::write(fixture.rw_host.path().join("start.txt"), b"from the host").expect("write");
        fs::write(fixture.ro_host.path().join("keep.txt"), b"read me").expect("write");
        fixture
    }

    fn guest(&self, name: &str) -> String {
        self.guest_root.path().join(name).to_str().expect("utf-8").to_owned()
    }

    fn caps(&self) -> Capabilities {
        Capabilities {
            grants: vec![
                Grant { host: self.rw_host.path().to_owned(), guest: self.guest("rw"), mode: GrantMode::Rw },
                Grant { host: self.ro_host.path().to_owned(), guest: self.guest("ro"), mode: GrantMode::Ro },
            ],
            env: vec!["GREETING=hi".parse().expect("env")],
            secrets: vec!["TOKEN=hunter2-secret".parse().expect("secret")],
            ..Capabilities::default()
        }
    }

    /// A session over the real agent, grants copied in.
    fn session(&self, limits: &Limits) -> Option<(Session<ProcessAgent>, u32)> {
        self.session_with(&self.caps(), limits)
    }

    /// A session over the real agent with these capabilities.
    fn session_with(&self, caps: &Capabilities, limits: &Limits) -> Option<(Session<ProcessAgent>, u32)> {
        let work = self.guest_root.path().join("work");
        fs::create_dir_all(&work).expect("workdir");
        let (agent, client) = ProcessAgent::spawn(&work)?;
        let pid = agent.child.id();
        Some((Session::start(agent, client, caps, limits).expect("session"), pid))
    }
}

fn limits() -> Limits {
    Limits { wall: Duration::from_secs(10), output: ByteSize(1 << 20), ..Limits::default() }
}

fn sh(script: &str) -> Job {
    Job::Command { argv: vec!["/bin/sh".into(), "-c".into(), script.into()] }
}

fn exec(session: &mut Session<ProcessAgent>, script: &str) -> Outcome {
    session.exec(&sh(script), ExecOptions::default()).expect("exec")
}

fn alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

#[test]
fn several_jobs_run_in_turn_and_keep_their_files() {
    let _shared = shared();
    let fixture = Fixture::new();
    let Some((mut session, _)) = fixture.session(&limits()) else { return };
    let first = exec(&mut session, "echo 41 > state; echo \"$GREETING $TOKEN\"; pwd");
    assert_eq!(first.status, Status::Exited { code: 0 }, "{first:?}");
    let stdout = String::from_utf8_lossy(&first.stdout).into_owned();
    assert!(stdout.starts_with("hi "), "{stdout}");
    assert!(!stdout.contains("hunter2-secret"), "a secret reached the output: {stdout}");
    assert!(stdout.trim_end().ends_with("/work"), "jobs start in the host's workdir: {stdout}");
    let second = exec(&mut session, "echo $(( $(cat state) + 1 ))");
    assert_eq!(second.stdout, b"42\n");
    let third = exec(&mut session, &format!("cat {}/start.txt {}/keep.txt", fixture.guest("rw"), fixture.guest("ro")));
    assert_eq!(third.stdout, b"from the hostread me", "grants were copied in at start");
    assert_eq!(exec(&mut session, "exit 3").status, Status::Exited { code: 3 });
    assert!(matches!(exec(&mut session, "kill -9 $$").status, Status::Trapped { .. }));
    assert_eq!(session.tier(), TierKind::Microvm);
    session.close().expect("close");
}

/// A port the guest serves, through the agent: it connects to its `127.0.0.1:PORT` (the agent is a host process here,
/// so that is the host's loopback, where the test serves) and relays it to a stream it opens to the host, as over
/// vsock in a VM. Bytes go both ways and half-closes pass; a port nothing accepts on is `PortClosed`.
#[test]
fn a_port_the_guest_serves_is_reached_through_the_agent() {
    use std::io::{BufRead, BufReader, Read, Write};
    let _shared = shared();
    let fixture = Fixture::new();
    let Some((session, _)) = fixture.session(&limits()) else { return };
    let server = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = server.local_addr().expect("addr").port();
    let serving = std::thread::spawn(move || {
        for _ in 0..2 {
            let (stream, _) = server.accept().expect("accept");
            let mut line = String::new();
            BufReader::new(&stream).read_line(&mut line).expect("read");
            (&stream).write_all(format!("echo: {line}").as_bytes()).expect("write");
        }
    });
    for word in ["hello", "again"] {
        let strata_core::PortStream::Unix(mut stream) = session.connect_port(port).expect("open") else {
            panic!("the microVM's ports are streams the agent relays")
        };
        stream.write_all(format!("{word}\n").as_bytes()).expect("send");
        let mut answer = String::new();
        stream.read_to_string(&mut answer).expect("answer");
        assert_eq!(answer, format!("echo: {word}\n"));
    }
    serving.join().expect("server");
    let closed = std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port();
    let err = session.connect_port(closed).expect_err("nothing listens there");
    assert!(matches!(err, TierError::PortClosed { port, .. } if port == closed), "{err}");
    session.close().expect("close");
}

#[test]
fn a_jobs_limits_hold_and_the_session_goes_on() {
    let _shared = shared();
    let fixture = Fixture::new();
    let Some((mut session, _)) = fixture.session(&limits()) else { return };
    let short = Limits { wall: Duration::from_millis(300), ..limits() };
    let started = Instant::now();
    let outcome =
        session.exec(&sh("sleep 30"), ExecOptions { limits: Some(short), ..ExecOptions::default() }).expect("exec");
    assert_eq!(outcome.status, Status::LimitExceeded { limit: LimitKind::Wall });
    assert!(started.elapsed() < Duration::from_secs(5), "the job was not stopped at its wall limit");

    let capped = Limits { output: ByteSize(1000), ..limits() };
    let outcome = session
        .exec(
            &sh("head -c 100000 /dev/zero | tr '\\0' x"),
            ExecOptions { limits: Some(capped), ..ExecOptions::default() },
        )
        .expect("exec");
    assert_eq!(outcome.status, Status::Exited { code: 0 });
    assert_eq!(outcome.stdout.len(), 1000);
    assert!(outcome.truncated.stdout && !outcome.truncated.stderr);
    assert_eq!(outcome.usage.stdout_bytes, 100_000, "usage counts what the job wrote");

    let outcome = session
        .exec(
            &Job::Command { argv: vec!["cat".into()] },
            ExecOptions { stdin: Some(b"fed".to_vec()), ..ExecOptions::default() },
        )
        .expect("exec");
    assert_eq!(outcome.stdout, b"fed");

    let err = session.exec(&Job::Command { argv: vec!["/no/such/program".into()] }, ExecOptions::default());
    assert_eq!(err.expect_err("missing program").code(), "program_not_found");
    assert_eq!(exec(&mut session, "echo still here").stdout, b"still here\n", "the session survived all that");
}

#[test]
fn rw_grants_come_back_after_exit_0_only() {
    let _shared = shared();
    let fixture = Fixture::new();
    let Some((mut session, _)) = fixture.session(&limits()) else { return };
    let (rw, ro) = (fixture.guest("rw"), fixture.guest("ro"));
    let failed = exec(&mut session, &format!("echo lost > {rw}/fail.txt; echo changed > {ro}/keep.txt; exit 1"));
    assert_eq!(failed.status, Status::Exited { code: 1 });
    assert!(!fixture.rw_host.path().join("fail.txt").exists(), "copied back after a failed job");
    let ok = exec(&mut session, &format!("echo kept > {rw}/ok.txt"));
    assert_eq!(ok.status, Status::Exited { code: 0 });
    // The guest still had fail.txt: everything in the grant comes back with the next successful job.
    assert_eq!(fs::read(fixture.rw_host.path().join("ok.txt")).expect("ok.txt"), b"kept\n");
    assert_eq!(fs::read(fixture.rw_host.path().join("fail.txt")).expect("fail.txt"), b"lost\n");
    assert_eq!(fs::read(fixture.ro_host.path().join("keep.txt")).expect("keep"), b"read me", "ro copied back");
}

#[test]
fn files_follow_the_guest_path_rules() {
    let _shared = shared();
    let fixture = Fixture::new();
    let Some((mut session, _)) = fixture.session(&limits()) else { return };
    let note = format!("{}/note.txt", fixture.guest("rw"));
    session.write_file(&note, b"from write_file").expect("write in the rw grant");
    assert_eq!(session.read_file(&note).expect("read"), b"from write_file");
    assert_eq!(exec(&mut session, &format!("cat {note}")).stdout, b"from write_file");
    assert_eq!(fs::read(fixture.rw_host.path().join("note.txt")).expect("copied back"), b"from write_file");
    let scratch = format!("{}/scratch.txt", fixture.guest("work"));
    session.write_file(&scratch, b"anywhere in the guest").expect("write outside grants");
    assert_eq!(session.read_file(&scratch).expect("read"), b"anywhere in the guest");
    assert_eq!(session.read_file(&format!("{}/keep.txt", fixture.guest("ro"))).expect("read ro"), b"read me");

    let ro_file = format!("{}/keep.txt", fixture.guest("ro"));
    assert_eq!(session.write_file(&ro_file, b"no").expect_err("ro grant").code(), "guest_path");
    let dotdot = format!("{}/../ro/keep.txt", fixture.guest("rw"));
    assert_eq!(session.write_file(&dotdot, b"no").expect_err("dotdot").code(), "guest_path");
    assert_eq!(session.read_file("relative.txt").expect_err("relative").code(), "guest_path");
    assert_eq!(session.read_file("/proc/self/environ").expect_err("proc").code(), "guest_path");
    let absent = format!("{}/absent", fixture.guest("rw"));
    assert_eq!(session.read_file(&absent).expect_err("absent").code(), "guest_path");
}

#[test]
fn close_and_drop_end_the_agent() {
    let _shared = shared();
    let fixture = Fixture::new();
    let Some((session, pid)) = fixture.session(&limits()) else { return };
    assert!(alive(pid));
    session.close().expect("close");
    assert!(!alive(pid), "the agent process outlived close");

    let fixture = Fixture::new();
    let Some((session, pid)) = fixture.session(&limits()) else { return };
    drop(session);
    assert!(!alive(pid), "the agent process outlived drop");
}

#[test]
fn a_snapshot_records_caps_by_name_and_refuses_a_fork_without_secrets() {
    let _shared = shared();
    let fixture = Fixture::new();
    let Some((mut session, _)) = fixture.session(&limits()) else { return };
    assert_eq!(exec(&mut session, "echo setup > state").status, Status::Exited { code: 0 });
    let store = tempfile::tempdir().expect("tempdir");
    let dest = store.path().join("snap");
    let snapshot = session.snapshot(&dest).expect("snapshot");
    assert_eq!(snapshot.manifest.tier, TierKind::Microvm);
    for kind in [Persisted::Memory, Persisted::Filesystem, Persisted::Processes] {
        assert!(snapshot.manifest.persists.contains(&kind), "{:?}", snapshot.manifest.persists);
    }
    let meta = &snapshot.manifest.meta;
    assert_eq!(meta["secret_names"], serde_json::json!(["TOKEN"]));
    assert_eq!(meta["caps"]["grants"].as_array().map(Vec::len), Some(2));
    assert_eq!(meta["caps"]["env"][0]["name"], "GREETING");
    for entry in fs::read_dir(&dest).expect("dir").flatten() {
        let bytes = fs::read(entry.path()).expect("read");
        assert!(!bytes.windows(14).any(|w| w == b"hunter2-secret"), "{:?} holds the secret", entry.path());
    }
    assert_eq!(exec(&mut session, "cat state").stdout, b"setup\n", "the session goes on after a snapshot");

    let tier = MicrovmTier::new(MicrovmTierConfig {
        kernel: fixture.guest_root.path().join("vmlinux"),
        initramfs: fixture.guest_root.path().join("initramfs"),
        root_disk: None,
        run_dir: store.path().to_owned(),
        cpuid: CpuidProfile::Standard,
        snapshots: strata_core::SnapshotTrust::process_local(),
    });
    let opened = strata_core::SnapshotTrust::process_local().open(&dest).expect("open");
    let Err(err) = tier.fork(&opened) else { panic!("a snapshot with secrets was forked without them") };
    assert_eq!(err.code(), "unsupported", "{err}");
    assert!(err.to_string().contains("TOKEN") && !err.to_string().contains("hunter2"), "{err}");

    // Without secrets the fork gets as far as the images, which must be this tier's byte for byte.
    fs::write(fixture.guest_root.path().join("vmlinux"), b"kernel").expect("write");
    fs::write(fixture.guest_root.path().join("initramfs"), b"initramfs").expect("write");
    let caps = Capabilities { secrets: Vec::new(), ..fixture.caps() };
    let err = tier.fork_with(&opened, &caps, &limits()).expect_err("other images");
    assert!(err.to_string().contains("other images"), "{err}");
}

#[test]
fn the_agent_refuses_to_quiesce_while_a_job_runs_and_acks_a_restore() {
    let _shared = shared();
    let dir = tempfile::tempdir().expect("tempdir");
    let Some((agent, client)) = ProcessAgent::spawn(dir.path()) else { return };
    let request = ExecRequest {
        argv: vec!["sleep".into(), "30".into()],
        env: vec![("PATH".into(), "/usr/bin:/bin".into())],
        cwd: "/".into(),
        stdin: false,
        limits: ExecLimits::default(),
        tty: None,
    };
    let handle = client.start(&request).expect("start");
    assert!(matches!(client.prepare_snapshot(), Err(ClientError::Refused { .. })));
    handle.control().signal(libc::SIGKILL).expect("kill");
    handle.wait(|_, _| {}).expect("exit");
    client.prepare_snapshot().expect("quiesced once idle");
    strata_tier_microvm::tier::after_restore(&client).expect("after_restore");
    let pid = agent.child.id();
    client.power_off().expect("power off");
    agent.shut_down();
    assert!(!alive(pid));
}

/// A booted Linux sandbox snapshotted with a process left running, forked twice: state and the process carried
/// into both forks, forks independent, fresh randomness in each, the clock never back. Hardware KVM only.
#[test]
fn a_booted_sandbox_snapshots_and_forks_on_hardware_kvm() {
    let _alone = alone();
    if kvm_kind() != KvmKind::Hardware {
        eprintln!("skip: snapshot and fork of a booted Linux guest: needs hardware KVM (this host: {})", kvm_kind());
        return;
    }
    let Some(home) = strata_home() else {
        eprintln!("skip: no STRATA_HOME or HOME");
        return;
    };
    let Some(kernel) = strata_kernel_image::KernelImage::new(&home).ok().and_then(|k| k.installed().ok()) else {
        eprintln!("skip: the guest kernel is not built (strata images build kernel)");
        return;
    };
    let Ok(agent) = strata_tier_microvm::guest::agent_binary() else {
        eprintln!("skip: this build has no guest agent");
        return;
    };
    let scratch = tempfile::tempdir().expect("tempdir");
    let busybox = Path::new(strata_rootfs_image::initramfs::BUSYBOX_STATIC);
    let Ok(initramfs) = strata_rootfs_image::initramfs::ensure_initramfs(scratch.path(), agent, busybox) else {
        eprintln!("skip: no static busybox for the initramfs");
        return;
    };
    let tier = MicrovmTier::new(MicrovmTierConfig {
        kernel: kernel.vmlinux,
        initramfs: initramfs.path,
        root_disk: None,
        run_dir: scratch.path().to_owned(),
        cpuid: CpuidProfile::Standard,
        snapshots: strata_core::SnapshotTrust::process_local(),
    });
    let limits = Limits { memory: ByteSize(256 << 20), wall: Duration::from_secs(20), ..Limits::default() };
    let sandbox = tier.start(&Capabilities::default(), &limits).expect("start");
    let setup = sandbox
        .exec(&sh("echo 41 > /tmp/x; sleep 1000 > /dev/null 2>&1 & echo $! > /tmp/pid"), ExecOptions::default())
        .expect("setup");
    assert_eq!(setup.status, Status::Exited { code: 0 }, "{setup:?}");
    let before = sandbox.exec(&sh("date +%s"), ExecOptions::default()).expect("date");
    let dest = scratch.path().join("snap");
    let snapshot = sandbox.snapshot(&dest).expect("snapshot");
    assert!(snapshot.manifest.persists.contains(&Persisted::Processes));
    let snapshot = strata_core::SnapshotTrust::process_local().open(&dest).expect("open");
    let mut forks: Vec<Box<dyn Sandbox>> = (0..2).map(|_| tier.fork(&snapshot).expect("fork")).collect();
    let mut random = Vec::new();
    for (index, fork) in forks.iter_mut().enumerate() {
        let run =
            |fork: &mut Box<dyn Sandbox>, script: &str| fork.exec(&sh(script), ExecOptions::default()).expect(script);
        assert_eq!(run(fork, "cat /tmp/x").stdout, b"41\n");
        assert_eq!(run(fork, "kill -0 $(cat /tmp/pid)").status, Status::Exited { code: 0 }, "the process died");
        run(fork, &format!("echo {index} > /tmp/mine"));
        random.push(run(fork, "head -c 16 /dev/urandom | od -An -tx1").stdout);
        let now = run(fork, "date +%s").stdout;
        let as_secs = |b: &[u8]| String::from_utf8_lossy(b).trim().parse::<u64>().unwrap_or(0);
        assert!(as_secs(&now) >= as_secs(&before.stdout), "the clock went back");
    }
    assert_ne!(random[0], random[1], "two forks read the same random bytes");
    assert_eq!(forks[0].read_file("/tmp/mine").expect("mine"), b"0\n", "a sibling's write leaked");
    assert_eq!(sandbox.read_file("/tmp/x").expect("parent"), b"41\n");
    assert_eq!(sandbox.read_file("/tmp/mine").expect_err("the parent sees no fork's write").code(), "guest_path");
    for fork in forks {
        fork.close().expect("close fork");
    }
    sandbox.close().expect("close");
}

/// A job's stdin as a stream goes to the guest as it is written (the agent queues it for the job): each line is
/// answered before the next is written, and closing the writer is the job's end of input. A job waiting on a stream
/// held open is stopped by its wall limit and by a cancel, within a sanity bound.
#[test]
fn a_stdin_stream_reaches_the_job_as_written_and_one_held_open_is_stopped() {
    use std::io::Write;
    use std::sync::Mutex;
    let _shared = shared();

    #[derive(Default)]
    struct Collect(Mutex<Vec<u8>>);
    impl strata_core::OutputSink for Collect {
        fn output(&self, stream: strata_core::Stream, chunk: &[u8]) {
            if stream == strata_core::Stream::Stdout {
                self.0.lock().expect("lock").extend_from_slice(chunk);
            }
        }
    }
    let wait_for = |sink: &Collect, text: &str| {
        let deadline = Instant::now() + Duration::from_secs(20);
        while !String::from_utf8_lossy(&sink.0.lock().expect("lock")).contains(text) {
            assert!(Instant::now() < deadline, "no {text:?} from the job");
            std::thread::sleep(Duration::from_millis(10));
        }
    };
    let fixture = Fixture::new();
    let Some((session, _)) = fixture.session(&limits()) else { return };

    let (stream, mut writer) = strata_core::StdinStream::pipe().expect("pipe");
    let sink = std::sync::Arc::new(Collect::default());
    let opts = ExecOptions { stdin_stream: Some(stream), sink: Some(sink.clone()), ..ExecOptions::default() };
    let echo = sh("while read line; do echo \"got $line\"; done; echo eof");
    let outcome = std::thread::scope(|scope| {
        let job = scope.spawn(|| session.exec(&echo, opts));
        writer.write_all(b"one\n").expect("write");
        wait_for(&sink, "got one\n");
        writer.write_all(b"two\n").expect("write");
        wait_for(&sink, "got two\n");
        drop(writer);
        job.join().expect("job thread")
    })
    .expect("exec");
    assert_eq!((outcome.status, outcome.stdout), (Status::Exited { code: 0 }, b"got one\ngot two\neof\n".to_vec()));

    for cancelled in [false, true] {
        let (stream, writer) = strata_core::StdinStream::pipe().expect("pipe");
        let cancel = strata_core::CancelToken::new();
        let wall = if cancelled { Duration::from_secs(3600) } else { Duration::from_secs(1) };
        let opts = ExecOptions {
            stdin_stream: Some(stream),
            limits: Some(Limits { wall, ..limits() }),
            cancel: Some(cancel.clone()),
            ..ExecOptions::default()
        };
        if cancelled {
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(300));
                cancel.cancel();
            });
        }
        let started = Instant::now();
        let result = session.exec(&Job::Command { argv: vec!["cat".into()] }, opts);
        assert!(started.elapsed() < Duration::from_secs(10), "took {:?}", started.elapsed());
        match (cancelled, result) {
            (false, Ok(outcome)) => assert_eq!(outcome.status, Status::LimitExceeded { limit: LimitKind::Wall }),
            (true, Err(err)) => assert_eq!(err.code(), "cancelled", "{err}"),
            (_, other) => panic!("cancelled {cancelled}: {other:?}"),
        }
        drop(writer);
    }
    session.close().expect("close");
}

/// What a terminal printed, as it comes.
#[derive(Default)]
struct Screen(std::sync::Mutex<Vec<u8>>);

impl strata_core::OutputSink for Screen {
    fn output(&self, stream: strata_core::Stream, chunk: &[u8]) {
        assert_eq!(stream, strata_core::Stream::Stdout, "a terminal's output is one stream");
        self.0.lock().expect("lock").extend_from_slice(chunk);
    }
}

impl Screen {
    fn wait_for(&self, text: &str) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let now = String::from_utf8_lossy(&self.0.lock().expect("lock")).into_owned();
            if now.contains(text) {
                return;
            }
            assert!(Instant::now() < deadline, "no {text:?} on the terminal: {now:?}");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

#[test]
fn a_job_on_a_terminal_gets_the_agents_terminal_typed_input_and_resizes() {
    use std::io::Write;
    use strata_core::{StdinStream, Terminal, WindowSize};
    let _shared = shared();
    let fixture = Fixture::new();
    let Some((session, _)) = fixture.session(&limits()) else { return };
    let screen = std::sync::Arc::new(Screen::default());
    let terminal = Terminal::new(WindowSize { rows: 33, cols: 101 });
    let (stream, mut keys) = StdinStream::pipe().expect("pipe");
    let opts = ExecOptions {
        terminal: Some(terminal.clone()),
        stdin_stream: Some(stream),
        sink: Some(screen.clone()),
        ..ExecOptions::default()
    };
    let script = "trap 'stty size' WINCH; stty size; echo ready; \
                  while :; do read -t 0.1 line && break; done; echo \"got:$line\"; exit 6";
    let job = Job::Command { argv: vec!["/bin/bash".into(), "-c".into(), script.into()] };
    std::thread::scope(|scope| {
        let running = scope.spawn(|| session.exec(&job, opts));
        screen.wait_for("33 101\r\nready\r\n");
        terminal.resize(WindowSize { rows: 40, cols: 120 });
        screen.wait_for("40 120\r\n");
        keys.write_all(b"hi\n").expect("type");
        let outcome = running.join().expect("job").expect("exec");
        assert_eq!(outcome.status, Status::Exited { code: 6 });
        screen.wait_for("hi\r\ngot:hi\r\n");
    });
    session.close().expect("close");
}
