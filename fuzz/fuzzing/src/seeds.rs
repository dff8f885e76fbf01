//! The real examples each target's committed corpus starts from (`fuzz/corpus/<target>/seed-*`): frames an agent
//! and a host send, control messages, proxy requests, ClientHellos, allowlists. `cargo run -p strata-fuzzing
//! --example seeds` writes them; the corpus test checks that each is committed, and replays it.

use strata_guest_proto::frame::encode;
use strata_guest_proto::{
    Bytes, EntryInfo, EntryKind, ExecLimits, ExecRequest, ExitStatus, FileType, GuestMessage, HostMessage,
    OutputStream, PROTOCOL_VERSION, RequestId, Rusage, TreeEntry, WatchEvent, WatchKind,
};
use strata_jail::proto::{self as jail, Bind, Exec, HostFrame, IdMap, JailFrame, Setup};

use strata_serve::e2b::fuzzing::{FileOperation, file_signature, gzip};

use crate::generate::{Script, frame};
pub use crate::seed::Seed;
use crate::seed::named;
use crate::targets::e2b_connect::{NOW, TOKEN};

/// The seeds of the target called `name` (none for a target without any).
pub fn of(name: &str) -> Vec<Seed> {
    match name {
        "agent_frames" => agent_frames(),
        "agent_client" => agent_client(),
        "jail_frames" => jail_frames(),
        "egress_request" => egress_request(),
        "egress_sni" => egress_sni(),
        "egress_allowlist" => egress_allowlist(),
        "egress_proxy" => egress_proxy(),
        "policy_toml" => policy_toml(),
        "virtio_mmio" => virtio_mmio(),
        "virtio_block" | "virtio_vsock" => generated(),
        "vmm_control" => vmm_control(),
        "fleet_records" => fleet_records(),
        "snapshot_transfer" => snapshot_transfer(),
        "e2b_connect" => e2b_connect(),
        "api_bodies" => api_bodies(),
        "wasm_cache_entry" => wasm_cache_entry(),
        "snapshot_open" => crate::snapshot_seeds::snapshot_open(),
        "snapshot_wasm" => crate::snapshot_seeds::snapshot_wasm(),
        "snapshot_vm_state" => crate::snapshot_seeds::snapshot_vm_state(),
        "snapshot_upper_tree" => crate::snapshot_seeds::snapshot_upper_tree(),
        "replay_recording" => replay_recording(),
        "kernel_events" => kernel_events(),
        "warm_requests" => warm_requests(),
        "port_routes" => port_routes(),
        "oci_layer" => crate::oci_seeds::oci_layer(),
        "dockerfile" => dockerfile(),
        _ => Vec::new(),
    }
}

fn wire<T: serde::Serialize>(messages: &[T]) -> Vec<u8> {
    messages.iter().flat_map(|m| frame(&encode(m).expect("a seed message encodes"))).collect()
}

fn hello() -> GuestMessage {
    GuestMessage::Hello { version: PROTOCOL_VERSION, agent_version: "0.1.0".into(), kernel: "6.1.0".into() }
}

fn exited(id: u64, stdout_bytes: u64) -> GuestMessage {
    GuestMessage::Exited {
        id: RequestId(id),
        status: ExitStatus::Code(0),
        rusage: Rusage { user_us: 1200, sys_us: 300, max_rss_kb: 2048 },
        oom_killed: false,
        stdout_bytes,
        stderr_bytes: 0,
    }
}

fn entry(path: &str, file_type: FileType) -> EntryInfo {
    EntryInfo {
        path: path.into(),
        file_type,
        size: 5,
        mode: 0o644,
        uid: 1000,
        gid: 1000,
        modified: Some((1_700_000_000, 5)),
        target: (file_type == FileType::Symlink).then(|| "../x".into()),
    }
}

fn watch_event(kind: WatchKind, path: &str) -> WatchEvent {
    WatchEvent { kind, path: path.into() }
}

fn agent_frames() -> Vec<Seed> {
    let id = RequestId(1);
    let guest = vec![
        hello(),
        GuestMessage::Started { id, pid: 42 },
        GuestMessage::Output { id, stream: OutputStream::Stdout, data: Bytes(b"hello\n".to_vec()) },
        exited(1, 6),
        GuestMessage::TreeEntries {
            id: RequestId(2),
            entries: vec![TreeEntry {
                path: "sub/f".into(),
                kind: EntryKind::File,
                mode: 0o644,
                size: 5,
                target: None,
            }],
        },
        GuestMessage::TreeDone { id: RequestId(2), count: 1, skipped: 0 },
        GuestMessage::Error { id: None, message: "malformed frame".into() },
        GuestMessage::Entry { id: RequestId(5), entry: entry("/data/x", FileType::File) },
        GuestMessage::DirEntries {
            id: RequestId(6),
            entries: vec![entry("/data/x", FileType::File), entry("/data/link", FileType::Symlink)],
        },
        GuestMessage::DirDone { id: RequestId(6), count: 2, skipped: 0 },
        GuestMessage::DirCreated { id: RequestId(7), created: true },
        GuestMessage::WatchEvents {
            id: RequestId(8),
            events: vec![watch_event(WatchKind::Create, "/data/new"), watch_event(WatchKind::Remove, "/data/new")],
            overflowed: false,
        },
        GuestMessage::WatchEnded { id: RequestId(8), reason: "the watched directory is gone".into() },
    ];
    let host = vec![
        HostMessage::Hello { version: PROTOCOL_VERSION },
        HostMessage::Exec {
            id,
            request: ExecRequest {
                argv: vec!["sh".into(), "-c".into(), "echo hello".into()],
                env: vec![("PATH".into(), "/usr/bin:/bin".into())],
                cwd: "/".into(),
                stdin: true,
                limits: ExecLimits { output: Some(1 << 20), open_files: Some(256), cpu_seconds: Some(10) },
                tty: None,
            },
        },
        HostMessage::StdinData { id, data: Bytes(b"input".to_vec()) },
        HostMessage::WriteFile {
            id: RequestId(3),
            path: "/tmp/x".into(),
            mode: 0o644,
            data: Bytes(vec![7; 8]),
            last: true,
        },
        HostMessage::ListTree { id: RequestId(4), path: "/data".into(), max_entries: 100_000 },
        HostMessage::Stat { id: RequestId(5), path: "/data/x".into() },
        HostMessage::ListDir { id: RequestId(6), path: "/data".into(), depth: 2, max_entries: 100_000 },
        HostMessage::CreateDir { id: RequestId(7), path: "/data/a/b".into() },
        HostMessage::Rename { id: RequestId(9), from: "/data/x".into(), to: "/data/y".into() },
        HostMessage::Remove { id: RequestId(10), path: "/data/y".into() },
        HostMessage::Watch { id: RequestId(8), path: "/data".into(), recursive: true },
        HostMessage::Unwatch { id: RequestId(8) },
        HostMessage::Resize { id, size: strata_guest_proto::TtySize { rows: 40, cols: 120 } },
    ];
    named(vec![("agent-session", wire(&guest)), ("host-session", wire(&host))])
}

/// One step of an agent-client script answered by raw frames.
fn step(script: &mut Script, op: u8, param: u8, answer: &[GuestMessage]) {
    script.u8(op).u8(param).u8(0).block(&wire(answer));
}

fn agent_client() -> Vec<Seed> {
    let id = RequestId;
    let mut exec = Script::default();
    exec.u8(0).block(&wire(&[hello()]));
    step(&mut exec, 0, 4, &[GuestMessage::Started { id: id(1), pid: 7 }]);
    step(
        &mut exec,
        1,
        0,
        &[GuestMessage::Output { id: id(1), stream: OutputStream::Stdout, data: b"hi\n".as_slice().into() }],
    );
    step(&mut exec, 1, 0, &[exited(1, 3)]);
    step(&mut exec, 1, 0, &[]);

    let mut files = Script::default();
    files.u8(0).block(&wire(&[hello()]));
    step(
        &mut files,
        4,
        3,
        &[
            GuestMessage::FileData { id: id(1), data: b"sandbox\n".as_slice().into() },
            GuestMessage::FileDone { id: id(1), size: 8 },
        ],
    );
    step(
        &mut files,
        5,
        3,
        &[
            GuestMessage::TreeEntries {
                id: id(2),
                entries: vec![
                    TreeEntry { path: "sub".into(), kind: EntryKind::Dir, mode: 0o755, size: 0, target: None },
                    TreeEntry {
                        path: "sub/link".into(),
                        kind: EntryKind::Symlink,
                        mode: 0o777,
                        size: 2,
                        target: Some("..".into()),
                    },
                ],
            },
            GuestMessage::TreeDone { id: id(2), count: 2, skipped: 1 },
        ],
    );
    step(&mut files, 8, 1, &[GuestMessage::Ack { id: id(3) }]);
    step(&mut files, 6, 0, &[GuestMessage::FileError { id: id(4), errno: 39, message: "not empty".into() }]);
    step(&mut files, 9, 0, &[GuestMessage::Ack { id: id(5) }]);

    // Generated answers: the arbitrary bytes become well-formed messages about the latest requests.
    let mut generated = Script::default();
    generated.u8(0).block(&wire(&[hello()]));
    generated.u8(0).u8(0x84).u8(5).block(&[1, 0, 7, 0, 0, 0, 2, 2, 3, 0, 1, 9, 4, 0]);
    generated.u8(1).u8(0).u8(9).block(&[2, 0, 3, 1, 2, 4, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 3, 0]);

    // The file methods, then a watch whose sink stops after two batches (a third must not reach it), unwatched.
    let mut methods = Script::default();
    methods.u8(0).block(&wire(&[hello()]));
    step(&mut methods, 12, 0, &[GuestMessage::Entry { id: id(1), entry: entry("/data/x", FileType::File) }]);
    step(
        &mut methods,
        13,
        0x13,
        &[
            GuestMessage::DirEntries {
                id: id(2),
                entries: vec![entry("/data/x", FileType::File), entry("/data/link", FileType::Symlink)],
            },
            GuestMessage::DirDone { id: id(2), count: 2, skipped: 0 },
        ],
    );
    step(&mut methods, 14, 0, &[GuestMessage::DirCreated { id: id(3), created: true }]);
    step(&mut methods, 15, 0, &[GuestMessage::Entry { id: id(4), entry: entry("/data/y", FileType::File) }]);
    step(&mut methods, 16, 0, &[GuestMessage::Ack { id: id(5) }]);
    let batch = |kind| GuestMessage::WatchEvents {
        id: id(6),
        events: vec![watch_event(kind, "/data/brief")],
        overflowed: false,
    };
    step(
        &mut methods,
        17,
        3,
        &[GuestMessage::Ack { id: id(6) }, batch(WatchKind::Create), batch(WatchKind::Write), batch(WatchKind::Remove)],
    );
    step(&mut methods, 18, 0, &[]);

    // Generated answers to the file methods and a watch.
    let mut generated_files = Script::default();
    generated_files.u8(0).block(&wire(&[hello()]));
    generated_files.u8(17).u8(1).u8(0x85).block(&[4, 3, 0, 1, 2, 7, 7, 7, 7, 5, 0, 4, 0, 9]);
    generated_files.u8(13).u8(0x13).u8(0x87).block(&[1, 2, 4, 0, 0, 1, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 2, 0, 2]);

    named(vec![
        ("exec", exec.bytes),
        ("files", files.bytes),
        ("generated", generated.bytes),
        ("methods", methods.bytes),
        ("generated-files", generated_files.bytes),
    ])
}

fn jail_frames() -> Vec<Seed> {
    let json = |v: &dyn erased::Json| v.json();
    let exec = Exec {
        argv: vec!["/bin/sh".into(), "-c".into(), "echo hi".into()],
        env: vec![("PATH".into(), "/usr/bin:/bin".into())],
        cwd: "/".into(),
        program_copy: None,
        nofile: 1024,
        cpu_seconds: 10,
        cgroup_files: 1,
        tty: None,
        user: Some("user".into()),
    };
    let setup = Setup {
        version: strata_jail::proto::PROTOCOL_VERSION,
        join_cgroup: vec!["/sys/fs/cgroup/strata/j1/cgroup.procs".into()],
        lowers: vec![
            "/root/.cache/strata/images/store/layers/0123456789abcdef0123456789abcdef/tree".into(),
            "/root/.cache/strata/images/debian".into(),
        ],
        scratch_mount: "/tmp/strata-scratch".into(),
        scratch_bytes: 64 << 20,
        binds: vec![Bind { host: "/srv/data".into(), guest: "/data".into(), read_only: true }],
        hostname: "sandbox".into(),
        one_shot: true,
        id_map: Some(IdMap { base: 100_000, count: 65_536 }),
        restore_upper: false,
        egress_socket: None,
        zygote: false,
        files_owner: Some("user".into()),
    };
    let service = jail::Service {
        exec: Exec {
            argv: vec!["/bin/sh".into(), "-c".into(), "python3 -m http.server 8080".into()],
            cpu_seconds: u64::MAX,
            cgroup_files: 4,
            ..exec.clone()
        },
        restart_delay_ms: 1000,
        burst: 5,
        burst_window_ms: 60_000,
        stop_grace_ms: 2000,
    };
    let entry = jail::Entry {
        path: "/work/link".into(),
        kind: jail::EntryKind::Symlink,
        size: 4,
        mode: 0o777,
        uid: 0,
        gid: 0,
        modified: Some((1_700_000_000, 5)),
        link: Some("/etc".into()),
    };
    let mut seeds = vec![
        ("ready", json(&JailFrame::Ready { host_pid: 4242, notes: vec!["grant /data bind-mounted plainly".into()] })),
        (
            "exec-failed",
            json(&JailFrame::ExecFailed { stage: "lookup".into(), errno: 2, message: "no such file".into() }),
        ),
        ("exited", json(&JailFrame::Exited { code: Some(0), signal: None })),
        ("file-opened", json(&JailFrame::FileOpened { size: 12 })),
        ("host-setup", json(&HostFrame::Setup(setup))),
        ("host-exec", json(&HostFrame::Exec(exec))),
        ("host-kill", json(&HostFrame::Kill)),
        ("host-list-dir", json(&HostFrame::ListDir { path: "/work".into(), depth: 2, max_entries: 100_000 })),
        ("host-rename", json(&HostFrame::Rename { from: "/work/a".into(), to: "/work/b".into() })),
        ("host-watch", json(&HostFrame::Watch { id: 1, path: "/work".into(), recursive: true })),
        ("host-unwatch", json(&HostFrame::Unwatch { id: 1 })),
        ("host-service", json(&HostFrame::Service(service))),
        ("host-service-status", json(&HostFrame::ServiceStatus)),
        ("host-stop-service", json(&HostFrame::StopService { grace_ms: Some(2000) })),
        (
            "service-status",
            json(&JailFrame::ServiceStatus {
                state: jail::ServiceState::Backoff,
                restarts: 2,
                pid: None,
                last_exit: Some(jail::ServiceExit::Code(3)),
                log_tail: "listening on :8080\nboom\n".into(),
            }),
        ),
        ("no-service", json(&JailFrame::NoService)),
        ("entries", json(&JailFrame::Entries { entries: vec![entry.clone()], done: true })),
        ("entry", json(&JailFrame::Entry { entry })),
        ("list-too-large", json(&JailFrame::ListTooLarge { limit: 100_000 })),
        (
            "watch-events",
            json(&JailFrame::WatchEvents {
                id: 1,
                events: vec![
                    jail::WatchEvent { kind: jail::WatchKind::Create, path: "/work/f".into() },
                    jail::WatchEvent { kind: jail::WatchKind::Remove, path: "/work/f".into() },
                ],
                overflowed: false,
            }),
        ),
    ];
    // Mode byte 0 (inline) before each, and one spilled with a descriptor beside it.
    let mut spilled = vec![3u8];
    spilled.extend_from_slice(&json(&JailFrame::Started { pid: 2 }));
    let mut out: Vec<(&str, Vec<u8>)> = seeds.drain(..).map(|(n, doc)| (n, [&[0u8][..], &doc].concat())).collect();
    out.push(("spilled", spilled));
    // The `sudo` client's messages: its request with its three streams beside it (bit 1 attaches one descriptor),
    // and a signal it forwards while the command runs (bit 3).
    let request = strata_jail::sudo::Request {
        argv: vec!["id".into(), "-u".into()],
        env: vec![("PATH".into(), "/usr/bin:/bin".into())],
        cwd: "/home/user".into(),
    };
    out.push(("sudo-request", [&[2u8][..], &json(&request)].concat()));
    out.push(("sudo-signal", [&[8u8][..], &json(&strata_jail::sudo::ClientFrame::Signal(2))].concat()));
    named(out)
}

mod erased {
    /// A frame as JSON, whatever its type.
    pub trait Json {
        fn json(&self) -> Vec<u8>;
    }
    impl<T: serde::Serialize> Json for T {
        fn json(&self) -> Vec<u8> {
            serde_json::to_vec(self).expect("a seed frame serializes")
        }
    }
}

fn egress_request() -> Vec<Seed> {
    use crate::targets::egress_request::PLACEHOLDER;
    let secret = |target: &str| {
        format!(
            "GET {target} HTTP/1.1\r\nAuthorization: Bearer {PLACEHOLDER}\r\nx-api-key: mine\r\n\
             X-Twice: {PLACEHOLDER};{PLACEHOLDER}\r\n\r\n"
        )
        .into_bytes()
    };
    named(vec![
        ("secret-bound", secret("http://API.example.com/v1")),
        ("secret-bound-port", secret("http://127.0.0.1:8080/")),
        ("secret-other-host", secret("http://evil.example/")),
        ("secret-header", secret("http://a.svc.test:81/")),
        ("connect", b"CONNECT pypi.org:443 HTTP/1.1\r\nHost: pypi.org:443\r\nUser-Agent: pip/24.0\r\n\r\n".to_vec()),
        ("connect-v6", b"CONNECT [::1]:8443 HTTP/1.0\r\n\r\n".to_vec()),
        (
            "get",
            b"GET http://Example.COM./simple/?q=1 HTTP/1.1\r\nHost: evil.test\r\nConnection: keep-alive, X-Trace\r\n\
              X-Trace: 1\r\nProxy-Authorization: Basic Zm9vOmJhcg==\r\nAccept: */*\r\n\r\n"
                .to_vec(),
        ),
        (
            "post",
            b"POST http://10.0.0.1:8080/upload HTTP/1.1\r\nContent-Type: text/plain\r\nContent-Length: 5\r\n\r\nhello"
                .to_vec(),
        ),
        (
            "chunked",
            b"PUT http://a.example/x HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n".to_vec(),
        ),
    ])
}

fn egress_sni() -> Vec<Seed> {
    use strata_egress::sni::testing::client_hello;
    let hello = client_hello(Some("files.pythonhosted.org"));
    let handshake = &hello[5..];
    let (a, b) = handshake.split_at(20);
    let mut fragmented = Vec::new();
    for part in [a, b] {
        fragmented.extend_from_slice(&[0x16, 0x03, 0x01]);
        fragmented.extend_from_slice(&u16::try_from(part.len()).expect("small").to_be_bytes());
        fragmented.extend_from_slice(part);
    }
    let mut with_data = client_hello(Some("Example.COM."));
    with_data.extend_from_slice(&[0x17, 0x03, 0x03, 0x00, 0x02, 0xaa, 0xbb]);
    named(vec![
        ("sni", hello.clone()),
        ("no-sni", client_hello(None)),
        ("fragmented", fragmented),
        ("trailing-data", with_data),
    ])
}

fn egress_allowlist() -> Vec<Seed> {
    named(vec![
        ("specs", b"pypi.org:443\n*.pythonhosted.org\n10.0.0.1\n[::1]:8080\nlocalhost:3000\nExample.COM.".to_vec()),
        ("hosts", b"a.b.pythonhosted.org:443\nevil-pythonhosted.org\n[::ffff:10.0.0.1]\n127.0.0.1:3000\nxn--bcher-kva.example".to_vec()),
        ("refused", b"*\nhttp://x.org/\nuser@host\n::1:443\n2130706433\n0x7f.1\na..b\n*.10.0.0.1".to_vec()),
    ])
}

fn policy_toml() -> Vec<Seed> {
    let policies = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../policies");
    let read = |name: &str| std::fs::read(policies.join(name)).expect("a policy of policies/");
    let grants = b"[tiers]\nallowed = [\"wasm\", \"process\"]\nnative = \"process\"\npython_native_above = \"30s\"\n\n\
                   [escalation]\nallowed = true\non = [\"missing_module\"]\n\n[network]\nallow = [\"pypi.org:443\"]\n\n\
                   [grants.data]\ndirs = [\"/srv/data:/data:ro\", \"out:/out:rw\"]\n\n[limits]\nwall = \"10s\"\n\
                   memory = \"512MiB\"\nfuel = \"unlimited\"\n";
    named(vec![("default", read("default.toml")), ("strict", read("strict.toml")), ("grants", grants.to_vec())])
}

/// Dockerfiles: the README's, the offline test's (a local `.deb` and wheel), and one of everything the parser
/// knows, refusals included.
fn dockerfile() -> Vec<Seed> {
    let readme = b"FROM strata-debian\nRUN echo \"a custom image\" > /etc/motd-demo\nCOPY --chmod=755 hello.sh \
                   /usr/local/bin/hello\nENV GREETING=hi\nWORKDIR /srv\n";
    let offline = offline_dockerfile();
    let all = b"# syntax=docker/dockerfile:1\nARG BASE=strata-debian\nFROM ${BASE} AS build\n\
                # strata: start=python3 -m http.server 8000 ready=curl -sf localhost:8000\n\
                ENV A=1 B=\"two words\" C=${A:-x}${B:+y}\nENV OLD old style\nRUN apt-get update && \\\n  \
                # inside\n  apt-get install -y jq\nRUN [\"echo\", \"hi\"]\nCOPY --chown=user:user --chmod=644 \
                a* b? /opt/\nADD local.txt /srv/\nWORKDIR rel/../dir\nUSER user:user\nARG V\nCMD [\"x\"]\n\
                LABEL a=b\nEXPOSE 80\nENTRYPOINT x\nFROM second\n";
    named(vec![("readme", readme.to_vec()), ("offline", offline.into_bytes()), ("everything", all.to_vec())])
}

/// The offline image test's Dockerfile (as `strata_benches::images::offline_dockerfile` writes it).
fn offline_dockerfile() -> String {
    "FROM strata-debian\nARG WHEEL=stratawheel-1.0-py3-none-any.whl\nENV APP_HOME=/opt/app\nCOPY *.deb /tmp/\n\
     RUN dpkg -i /tmp/strata-hello_1.0_all.deb && rm /tmp/strata-hello_1.0_all.deb\nCOPY $WHEEL /tmp/\n\
     RUN pip install --no-index --break-system-packages /tmp/$WHEEL && rm /tmp/$WHEEL && rm /etc/issue\n\
     WORKDIR $APP_HOME\nRUN echo hi > greeting.txt\nUSER user\nCMD [\"strata-hello\"]\n"
        .to_owned()
}

/// A seeded recording of a Python job with stdin, as `strata run --seed 7 --record FILE` writes one: clock
/// readings, random bytes, a tool exchange and the expected output.
fn replay_recording() -> Vec<Seed> {
    use std::sync::Arc;

    use strata_core::{Capabilities, Determinism, Job, Limits, Outcome, PythonSource, Recorder, Status, TierKind};

    let recorder = Arc::new(Recorder::new(Some(7)));
    let job = Job::Python { source: PythonSource::Code("import time; print(time.time())".into()), args: vec![] };
    let caps = Capabilities { env: vec!["K=v".parse().expect("env")], ..Capabilities::default() };
    let inputs = Determinism::Record(recorder.clone())
        .start(&job, &caps, &Limits::default(), Some(b"input"), false)
        .expect("a recording starts");
    inputs.wall_clock_ns();
    inputs.monotonic_ns();
    inputs.monotonic_ns();
    inputs.fill_random(&mut [0u8; 24]);
    inputs.note_tool(br#"{"v":1,"id":1,"op":"list"}"#, br#"{"v":1,"id":1,"ok":true,"tools":[]}"#);
    let outcome =
        Outcome { stdout: b"1704067207.001\n".to_vec(), ..Outcome::new(TierKind::Wasm, Status::Exited { code: 0 }) };
    let recording = recorder.finish(&outcome).expect("a recording");
    named(vec![("python", recording.to_json())])
}

/// Register accesses of a driver's setup: write the status steps, the features, a queue, DRIVER_OK, notify.
fn virtio_mmio() -> Vec<Seed> {
    let mut setup = Script::default();
    setup.u8(0);
    let write = |s: &mut Script, register: u8, value: u32| {
        s.u8(register / 4).u32(value);
    };
    for (register, value) in [
        (0x70, 0),
        (0x70, 1),
        (0x70, 3),
        (0x24, 0),
        (0x20, 0x0000_0260),
        (0x24, 1),
        (0x20, 1),
        (0x70, 11),
        (0x30, 0),
        (0x38, 8),
        (0x80, 0x1000),
        (0x90, 0x2000),
        (0xa0, 0x3000),
        (0x44, 1),
        (0x70, 15),
        (0x50, 0),
    ] {
        write(&mut setup, register, value);
    }
    // Reads of a few registers, 4 bytes each (bit 6 of the op).
    let mut probe = Script::default();
    probe.u8(1);
    for register in [0x00u8, 0x04, 0x08, 0x10, 0x34, 0x60, 0x70, 0xfc] {
        probe.u8(0x40 | (register / 4)).u32(0);
    }
    named(vec![("block-setup", setup.bytes), ("vsock-probe", probe.bytes)])
}

/// Inputs for the generator-driven targets: the generator makes well-formed requests of most bytes.
fn vmm_control() -> Vec<Seed> {
    use strata_vmm::proto::{
        BootImage, BootSpec, DiskSpec, JailSpec, MachineSpec, Payload, Reply, Request, ThreadKind,
    };
    use strata_vmm::vstate::vcpu::cpuid::CpuidProfile;
    let doc = |v: &dyn erased::Json| {
        let mut out = vec![0u8];
        out.extend(v.json());
        out
    };
    let start = Request::Start(MachineSpec {
        version: strata_vmm::proto::PROTOCOL_VERSION,
        payload: Payload::Boot(BootSpec {
            memory_bytes: 2 << 20,
            vcpus: 1,
            cpuid: CpuidProfile::Standard,
            irqchip: true,
            image: BootImage::Linux { cmdline: "console=ttyS0".into(), initramfs: true },
            probe: false,
        }),
        vsock_socket: Some("vsock.sock".into()),
        guest_cid: Some(3),
        disks: vec![DiskSpec { id: Some("strata-root".into()), name: "root".into() }],
    });
    let jail = Request::Jail(JailSpec {
        version: strata_vmm::proto::PROTOCOL_VERSION,
        join_cgroup: vec!["/sys/fs/cgroup/strata/x/cgroup.procs".into()],
        root_dir: "/run/strata/vm/root".into(),
        socket_dir: "/run/strata/vm/sock".into(),
        uid: 0x5354_0001,
        gid: 0x5354_0001,
    });
    named(vec![
        ("start", doc(&start)),
        ("jail", doc(&jail)),
        ("probe", doc(&Request::Probe(ThreadKind::Vcpu))),
        ("status", doc(&Reply::Status { stopped: true, exits: vec!["Hlt".into()] })),
        ("console", doc(&Reply::Console { text: "hello\n".into(), dropped: 0 })),
        ("saved", doc(&Reply::Saved { state_bytes: 4096 })),
        ("failed", doc(&Reply::Failed { stage: "start".into(), message: "no".into() })),
        ("jailed", doc(&Reply::Jailed { host_pid: 42 })),
    ])
}

fn generated() -> Vec<Seed> {
    named(vec![("zeros", vec![0; 96]), ("counting", (0u8..=255).collect()), ("ones", vec![0xff; 96])])
}

fn envelope(message: &str) -> Vec<u8> {
    let mut out = vec![0u8];
    out.extend_from_slice(&u32::try_from(message.len()).expect("small").to_be_bytes());
    out.extend_from_slice(message.as_bytes());
    out
}

fn e2b_connect() -> Vec<Seed> {
    let with = |selector: u8, body: &[u8]| [&[selector][..], body].concat();
    let start = envelope(
        r#"{"process":{"cmd":"/bin/bash","args":["-l","-c","echo hi"],"envs":{"LANG":"C.UTF-8"},"cwd":"/home/user"},"stdin":true}"#,
    );
    named(vec![
        ("start", with(0, &start)),
        ("send-input", with(1, br#"{"process":{"pid":12},"input":{"stdin":"aGVsbG8K"}}"#)),
        ("list-dir", with(2 + 4, br#"{"path":"/home/user","depth":2}"#)),
        ("move", with(2 + 4 * 3, br#"{"source":"/home/user/a","destination":"/home/user/b"}"#)),
        ("create", with(3, br#"{"templateID":"base","timeout":300,"metadata":{"k":"v"},"envVars":{"A":"1"}}"#)),
        ("execute", with(3, br#"{"code":"import math\nmath.pi"}"#)),
        ("signed-read", with(11, signed_query("/tmp/z", FileOperation::Read, "", None).as_bytes())),
        (
            "signed-write-expiring",
            with(59, signed_query("a b.txt", FileOperation::Write, "root", Some(NOW + 60)).as_bytes()),
        ),
        ("gzip-upload", with(27, &gzip(b"hello from a gzipped upload\n"))),
        ("gzip-bomb", with(27, &gzip(&[0; 64 << 10]))),
        ("codings", with(43, b"gzip\nbr;q=1, gzip;q=0.5, identity;q=0")),
    ])
}

/// A `/files` query the SDKs' `download_url`/`upload_url` would make, signed with the target's token.
fn signed_query(path: &str, operation: FileOperation, user: &str, expiration: Option<i64>) -> String {
    let signature = file_signature(path, operation, user, TOKEN, expiration);
    let encode = |text: &str| {
        text.bytes()
            .map(|b| match b {
                b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => char::from(b).to_string(),
                _ => format!("%{b:02X}"),
            })
            .collect::<String>()
    };
    let mut query = format!("path={}&signature={}", encode(path), encode(&signature));
    if !user.is_empty() {
        query += &format!("&username={}", encode(user));
    }
    if let Some(expiration) = expiration {
        query += &format!("&signature_expiration={expiration}");
    }
    query
}

fn kernel_events() -> Vec<Seed> {
    let head = concat!(
        r#"{"type": "ready"}"#,
        "\n",
        r#"{"type": "number_of_executions", "execution_count": 1}"#,
        "\n",
        r#"{"type": "stdout", "text": "hel"#,
    );
    let tail = concat!(
        r#"lo\n"}"#,
        "\n",
        r#"{"type": "result", "is_main_result": true, "text": "42", "html": "<b>42</b>", "data": {"columns": ["a"]}}"#,
        "\n",
        r#"{"type": "result", "is_main_result": false, "png": "iVBORw0KGgo=", "extra": {"image/gif": "R0lG"}}"#,
        "\n",
        r#"{"type": "error", "name": "ZeroDivisionError", "value": "division by zero", "traceback": "..."}"#,
        "\n",
        r#"{"type": "end_of_execution"}"#,
        "\n",
    );
    // 0xff ends a chunk: the stdout line arrives in two writes.
    let cell = [head.as_bytes(), &[0xff], tail.as_bytes()].concat();
    let forged = b"{\"type\": \"result\", \"png\": 7, \"evil\": 1}\nnot json\n[1]\n{\"type\": \"exited\"}\n".to_vec();
    named(vec![("cell", cell), ("forged", forged)])
}

fn port_routes() -> Vec<Seed> {
    let with = |domain: &str, text: &str| [&[domain.len() as u8][..], domain.as_bytes(), text.as_bytes()].concat();
    named(vec![
        ("host", with("strata.test", "8000-sb_abc.strata.test")),
        ("host-with-port", with("strata.test", "8000-sb_abc.strata.test:3000")),
        ("other-domain", with("strata.test", "8000-sb_abc.evil.test")),
        ("nested", with("strata.test", "8000-a.b.strata.test")),
        ("port", with("", "65535")),
        ("port-zero", with("", "0")),
    ])
}

fn warm_requests() -> Vec<Seed> {
    use crate::targets::warm_requests::{IDENTITY, environment};
    use strata_engine::warm::{PROTOCOL, Request, RunRequest};
    let run = Request::Run(RunRequest {
        protocol: PROTOCOL,
        identity: IDENTITY.into(),
        argv: ["strata", "run", "--python", "-c", "print(1)"].map(String::from).to_vec(),
        cwd: "/home/user/project".into(),
        env: [environment(), vec![("PWD".into(), "/home/user/project".into())]].concat(),
        umask: 0o022,
    });
    let doc = |request: &Request| serde_json::to_vec(request).expect("a seed request serializes");
    let mut other = run.clone();
    if let Request::Run(r) = &mut other {
        r.env.push(("LD_PRELOAD".into(), "/tmp/evil.so".into()));
        r.argv[1] = "serve".into();
    }
    named(vec![
        ("run", [&[3u8][..], &doc(&run)].concat()),
        ("run-without-streams", [&[0u8][..], &doc(&run)].concat()),
        ("other", [&[3u8][..], &doc(&other)].concat()),
        ("signal", [&[0u8][..], &doc(&Request::Signal { signal: 2 })].concat()),
        ("status", [&[0u8][..], br#"{"kind":"status"}"#].concat()),
        ("forged", [&[1u8][..], br#"{"kind":"run","protocol":1,"argv":7}"#].concat()),
    ])
}

fn api_bodies() -> Vec<Seed> {
    let with = |kind: u8, body: &[u8]| [&[kind][..], body].concat();
    named(vec![
        (
            "create",
            with(
                0,
                br#"{"tier":"process","capabilities":{"env":{"A":"1"},"secrets":{"TOKEN":"s3cret"},"allow_net":["pypi.org:443"]},"limits":{"wall":"2s","memory":"256MiB"},"ttl":60}"#,
            ),
        ),
        ("run", with(1, br#"{"tier":"auto","job":{"python":"print(1)","args":["a"],"stdin":"x"},"capabilities":{}}"#)),
        ("exec", with(2, br#"{"command":["ls","-l","/"],"limits":{"wall":"1s","output":"1MiB","fuel":1000000}}"#)),
        ("timeout", with(3, br#"{"timeout":30}"#)),
        ("fork", with(4, br#"{"count":3,"ttl":60}"#)),
    ])
}

fn wasm_cache_entry() -> Vec<Seed> {
    let mut forged = Script::default();
    forged
        .u8(0)
        .block(format!("blake3 {} 12\nstamp 64769 1234 12 1700000000.5 1700000000.5\n", "ab".repeat(32)).as_bytes());
    forged.raw(b"not a module");
    let mut flipped = Script::default();
    flipped.u8(1).u16(100).u8(2).u8(0x40).u16(7).u8(0);
    let mut edited = Script::default();
    edited.u8(2).raw(b"+stamp 1 2 3 4.5 6.7\n");
    named(vec![("forged", forged.bytes), ("flipped", flipped.bytes), ("stamped", edited.bytes)])
}

/// Requests to the origin the target's allowlist names (`ORIGIN`, see the target) and one elsewhere.
fn egress_proxy() -> Vec<Seed> {
    use strata_egress::sni::testing::client_hello;
    let mut tls = b"CONNECT ORIGIN HTTP/1.1\r\n\r\n".to_vec();
    tls.extend_from_slice(&client_hello(Some("example.com")));
    named(vec![
        ("get", b"GET http://ORIGIN/x HTTP/1.1\r\nContent-Length: 3\r\n\r\nabcdef".to_vec()),
        ("connect-tls", tls),
        ("connect-plain", b"CONNECT ORIGIN HTTP/1.1\r\nHost: x\r\n\r\nSSH-2.0-x\r\n".to_vec()),
        ("refused", b"CONNECT pypi.org:443 HTTP/1.1\r\n\r\n".to_vec()),
    ])
}

fn fleet_records() -> Vec<Seed> {
    use strata_fleet::{Alloc, AllocEntry, CatalogEntry, NodeRecord, SandboxState};
    let record = |name: &str, draining: bool| NodeRecord {
        name: name.into(),
        advertise: format!("http://127.0.0.1:300{}", name.len()),
        incarnation: 7,
        cpus: 2,
        slots: 2,
        memory: 1 << 30,
        draining,
    };
    let alloc = Alloc {
        incarnation: 7,
        entries: vec![AllocEntry { id: "sb_a".into(), vcpus: 1, memory: 1 << 20, cpus: vec![0] }],
    };
    let entry = CatalogEntry { node: "n1".into(), incarnation: 7, state: SandboxState::Active };
    let mut fleet = Script::default();
    fleet.u8(6);
    for (kind, name, value) in [
        (0u8, "n1", record("n1", false).to_json()),
        (1, "n1", alloc.to_json()),
        (0, "n2", record("n2", true).to_json()),
        (1, "n2", Alloc { incarnation: 7, entries: vec![] }.to_json()),
        (2, "sb_a", entry.to_json()),
        (3, "snap_a", entry.to_json()),
    ] {
        fleet.u8(kind).block(name.as_bytes()).block(&value).u8(3);
    }
    fleet.u8(1).u8(1).u32(1 << 20).u8(0).block(b"sb_a");
    let mut garbage = Script::default();
    garbage.u8(3);
    for (kind, name, value) in [(0u8, "n1", &b"{\"name\":1}"[..]), (1, "n1", b"[]"), (2, "../x", b"{\"node\":\"n1\"}")]
    {
        garbage.u8(kind).block(name.as_bytes()).block(value).u8(0);
    }
    named(vec![("fleet", fleet.bytes), ("garbage", garbage.bytes)])
}

fn snapshot_transfer() -> Vec<Seed> {
    let real = |script: &mut Script| {
        script.u8(2).block(b"memory").block(&[7u8; 300]).block(b"fs/upper.tree").block(b"tree bytes");
    };
    // The real snapshot sent whole.
    let mut whole = Script::default();
    whole.u8(0);
    real(&mut whole);
    whole.u8(0);
    // The real manifest with a file altered in transit (same size) and one left out.
    let mut altered = Script::default();
    altered.u8(2);
    real(&mut altered);
    altered.u8(0).u8(2).block(b"memory").block(&[8u8; 300]).block(b"fs/upper.tree").block(b"tree bytez");
    let mut missing = Script::default();
    missing.u8(2);
    real(&mut missing);
    missing.u8(0).u8(1).block(b"memory").block(&[7u8; 300]);
    // A manifest edited in transit: a byte of a size, a byte of a path.
    let mut edited = Script::default();
    edited.u8(0);
    real(&mut edited);
    edited.u8(2).u16(120).u8(b'9').u16(60).u8(b'.');
    named(vec![
        ("whole", whole.bytes),
        ("altered", altered.bytes),
        ("missing", missing.bytes),
        ("edited", edited.bytes),
    ])
}
