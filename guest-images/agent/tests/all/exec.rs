use std::time::{Duration, Instant};

use strata_guest_proto::{ClientError, ExecEvent, ExecLimits, ExitStatus, MAX_CHUNK, OutputStream, TtySize};

use crate::{argv, noise, run, sh, start};

#[test]
fn echo_prints_and_exits_zero() {
    let agent = start();
    let ran = run(agent.client(), &argv(&["echo", "hello", "world"]), b"");
    assert_eq!(ran.stdout, b"hello world\n");
    assert!(ran.stderr.is_empty());
    assert_eq!(ran.report.status, ExitStatus::Code(0));
    assert_eq!((ran.report.stdout_bytes, ran.report.stderr_bytes), (12, 0));
    assert!(!ran.report.oom_killed);
}

#[test]
fn exit_codes_are_reported() {
    let agent = start();
    for code in [0, 1, 3, 42, 255] {
        let ran = run(agent.client(), &sh(&format!("exit {code}")), b"");
        assert_eq!(ran.report.status, ExitStatus::Code(code));
    }
}

#[test]
fn stderr_is_its_own_stream() {
    let agent = start();
    let ran = run(agent.client(), &sh("echo out; echo err >&2; echo more >&2"), b"");
    assert_eq!(ran.stdout, b"out\n");
    assert_eq!(ran.stderr, b"err\nmore\n");
    assert_eq!(ran.report.stderr_bytes, 9);
}

#[test]
fn env_and_cwd_are_the_requests() {
    let agent = start();
    let mut request = sh("echo \"$GREETING\"; pwd; echo ${HOME:-unset}");
    request.env.push(("GREETING".into(), "hi there".into()));
    request.cwd = "/tmp".into();
    let ran = run(agent.client(), &request, b"");
    assert_eq!(String::from_utf8_lossy(&ran.stdout), "hi there\n/tmp\nunset\n");
}

#[test]
fn stdin_is_streamed_while_the_program_runs() {
    let agent = start();
    let input = noise(3 << 20, 7);
    let mut request = argv(&["cat"]);
    request.stdin = true;
    let ran = run(agent.client(), &request, &input);
    assert_eq!(ran.report.status, ExitStatus::Code(0));
    assert!(ran.stdout == input, "cat echoed {} of {} bytes", ran.stdout.len(), input.len());

    // Without stdin the program reads /dev/null.
    let ran = run(agent.client(), &argv(&["wc", "-c"]), b"");
    assert_eq!(String::from_utf8_lossy(&ran.stdout).trim(), "0");
}

#[test]
fn a_program_that_stops_reading_stdin_does_not_stall_the_agent() {
    let agent = start();
    let mut request = argv(&["head", "-c", "10"]);
    request.stdin = true;
    let ran = run(agent.client(), &request, &vec![b'x'; 8 << 20]);
    assert_eq!(ran.stdout, b"xxxxxxxxxx");
    assert_eq!(ran.report.status, ExitStatus::Code(0));
}

#[test]
fn stdin_is_interactive() {
    let agent = start();
    let mut request = sh("read line; echo \"got $line\"; read line; echo \"then $line\"");
    request.stdin = true;
    let mut handle = agent.client().start(&request).expect("start");
    let control = handle.control();
    control.write_stdin(b"one\n").expect("stdin");
    let first = handle.next_event(Some(Duration::from_secs(10))).expect("event");
    assert_eq!(first, ExecEvent::Output { stream: OutputStream::Stdout, data: b"got one\n".to_vec() });
    control.write_stdin(b"two\n").expect("stdin");
    control.close_stdin().expect("close");
    let mut rest = Vec::new();
    let report = handle.wait(|_, data| rest.extend_from_slice(data)).expect("wait");
    assert_eq!(rest, b"then two\n");
    assert_eq!(report.status, ExitStatus::Code(0));
}

#[test]
fn ten_mib_of_output_arrive_byte_exact_in_bounded_chunks() {
    let agent = start();
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("big");
    let data = noise(10 << 20, 99);
    std::fs::write(&path, &data).expect("write");
    let mut out = Vec::with_capacity(data.len());
    let mut largest = 0;
    let report = agent
        .client()
        .exec(&argv(&["cat", path.to_str().expect("utf-8")]), b"", |stream, chunk| {
            assert_eq!(stream, OutputStream::Stdout);
            largest = largest.max(chunk.len());
            out.extend_from_slice(chunk);
        })
        .expect("exec");
    assert_eq!(report.stdout_bytes, data.len() as u64);
    assert!(out == data, "received {} bytes, not the file's {}", out.len(), data.len());
    assert!(largest <= MAX_CHUNK);
}

#[test]
fn the_output_cap_forwards_only_so_much_but_counts_everything() {
    let agent = start();
    let mut request = sh("head -c 100000 /dev/zero; head -c 30 /dev/zero >&2");
    request.limits = ExecLimits { output: Some(1000), ..ExecLimits::default() };
    let ran = run(agent.client(), &request, b"");
    assert_eq!(ran.stdout.len(), 1000);
    assert_eq!(ran.stderr.len(), 30);
    assert_eq!(ran.report.stdout_bytes, 100_000);
    assert_eq!(ran.report.stderr_bytes, 30);
}

#[test]
fn sequential_execs_share_a_connection() {
    let agent = start();
    for i in 0..30 {
        let ran = run(agent.client(), &sh(&format!("echo {i}")), b"");
        assert_eq!(ran.stdout, format!("{i}\n").as_bytes());
    }
}

#[test]
fn concurrent_execs_run_at_once_and_keep_their_output_apart() {
    let agent = start();
    let began = Instant::now();
    std::thread::scope(|scope| {
        let runs: Vec<_> = (0..6)
            .map(|i| {
                let client = agent.client();
                scope.spawn(move || {
                    let script = format!("for n in 1 2 3; do echo {i}-$n; sleep 0.1; done; echo err{i} >&2; exit {i}");
                    run(client, &sh(&script), b"")
                })
            })
            .collect();
        for (i, handle) in runs.into_iter().enumerate() {
            let ran = handle.join().expect("thread");
            assert_eq!(String::from_utf8_lossy(&ran.stdout), format!("{i}-1\n{i}-2\n{i}-3\n"));
            assert_eq!(String::from_utf8_lossy(&ran.stderr), format!("err{i}\n"));
            assert_eq!(ran.report.status, ExitStatus::Code(i as i32));
        }
    });
    // Six runs of 0.3 s each, at once.
    assert!(began.elapsed() < Duration::from_millis(1500), "{:?}", began.elapsed());
}

#[test]
fn a_signal_kills_a_sleep_and_its_process_group() {
    let agent = start();
    let handle = agent.client().start(&argv(&["sleep", "100"])).expect("start");
    assert!(handle.pid() > 0);
    handle.control().signal(libc::SIGKILL).expect("signal");
    let report = handle.wait(|_, _| {}).expect("wait");
    assert_eq!(report.status, ExitStatus::Signal(libc::SIGKILL));
    assert!(!report.oom_killed, "a host-mode agent never reports OOM");

    // A shell waiting for its child: the group signal reaches both.
    let handle = agent.client().start(&sh("sleep 100; echo never")).expect("start");
    let id = handle.id();
    std::thread::sleep(Duration::from_millis(100));
    agent.client().signal(id, libc::SIGTERM).expect("signal");
    let began = Instant::now();
    let mut out = Vec::new();
    let report = handle.wait(|_, data| out.extend_from_slice(data)).expect("wait");
    assert_eq!(report.status, ExitStatus::Signal(libc::SIGTERM));
    assert!(out.is_empty());
    assert!(began.elapsed() < Duration::from_secs(5));
}

#[test]
fn a_missing_program_is_exec_failed() {
    let agent = start();
    let err = agent.client().start(&argv(&["no-such-program-strata"])).expect_err("missing");
    assert!(matches!(&err, ClientError::ExecFailed { errno, .. } if *errno == libc::ENOENT), "{err}");
    let err = agent.client().start(&argv(&["/no/such/path"])).expect_err("missing");
    assert!(matches!(&err, ClientError::ExecFailed { errno, .. } if *errno == libc::ENOENT), "{err}");
    let dir = tempfile::tempdir().expect("tempdir");
    let plain = dir.path().join("plain");
    std::fs::write(&plain, "#!/bin/sh\n").expect("write");
    let err = agent.client().start(&argv(&[plain.to_str().expect("utf-8")])).expect_err("not executable");
    assert!(matches!(&err, ClientError::ExecFailed { errno, .. } if *errno == libc::EACCES), "{err}");
    let mut request = argv(&["true"]);
    request.cwd = "/no/such/dir".into();
    let err = agent.client().start(&request).expect_err("bad cwd");
    assert!(
        matches!(&err, ClientError::ExecFailed { errno, message } if *errno == libc::ENOENT && message.contains("/no/such/dir")),
        "{err}"
    );
    let err = agent.client().start(&argv(&[])).expect_err("empty argv");
    assert!(matches!(&err, ClientError::ExecFailed { errno, .. } if *errno == libc::EINVAL), "{err}");
    // The connection is fine afterwards.
    assert_eq!(run(agent.client(), &argv(&["true"]), b"").report.status, ExitStatus::Code(0));
}

#[test]
fn background_processes_holding_the_pipes_do_not_delay_the_exit() {
    let agent = start();
    let began = Instant::now();
    let ran = run(agent.client(), &sh("sleep 3 & echo done"), b"");
    assert_eq!(ran.stdout, b"done\n");
    assert!(began.elapsed() < Duration::from_secs(2), "{:?}", began.elapsed());
}

#[test]
fn rusage_and_rlimits() {
    let agent = start();
    let ran = run(agent.client(), &sh("i=0; while [ $i -lt 200000 ]; do i=$((i+1)); done"), b"");
    let usage = ran.report.rusage;
    assert!(usage.user_us + usage.sys_us > 0, "{usage:?}");
    assert!(usage.max_rss_kb > 0, "{usage:?}");

    let mut request = sh("ulimit -n; ulimit -t");
    request.limits = ExecLimits { open_files: Some(64), cpu_seconds: Some(7), ..ExecLimits::default() };
    let ran = run(agent.client(), &request, b"");
    assert_eq!(String::from_utf8_lossy(&ran.stdout), "64\n7\n");
}

#[test]
fn the_job_gets_default_signal_handling_and_no_stray_descriptors() {
    let agent = start();
    // SIGPIPE kills the writer quietly (the Rust runtime ignores it in the agent itself, and `yes` would
    // complain of a broken pipe if the job inherited that).
    let ran = run(agent.client(), &sh("yes | head -c 3 >/dev/null"), b"");
    assert_eq!(ran.report.status, ExitStatus::Code(0));
    assert!(ran.stderr.is_empty(), "{}", String::from_utf8_lossy(&ran.stderr));
    let ran = run(agent.client(), &sh("ls /proc/self/fd | wc -l"), b"");
    // 0, 1, 2 and the directory ls has open.
    assert_eq!(String::from_utf8_lossy(&ran.stdout).trim(), "4");
    let ran = run(agent.client(), &sh("grep -E '^Sig(Ign|Blk)' /proc/self/status"), b"");
    assert_eq!(String::from_utf8_lossy(&ran.stdout), "SigBlk:\t0000000000000000\nSigIgn:\t0000000000000000\n");
}

#[test]
fn an_exec_on_a_terminal_is_typed_into_resized_and_reports_its_exit() {
    let agent = start();
    let script = "trap 'stty size' WINCH; tty; stty size; echo ready; \
                  while :; do read -t 0.1 line && break; done; echo \"got:$line\"; exit 4";
    let mut request = argv(&["/bin/bash", "-c", script]);
    request.tty = Some(TtySize { rows: 33, cols: 101 });
    let mut handle = agent.client().start(&request).expect("start");
    let control = handle.control();
    let mut screen = String::new();
    let mut until = |handle: &mut strata_guest_proto::ExecHandle, text: &str| {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !screen.contains(text) {
            assert!(Instant::now() < deadline, "no {text:?} in {screen:?}");
            match handle.next_event(Some(Duration::from_secs(30))).expect("event") {
                ExecEvent::Output { stream, data } => {
                    assert_eq!(stream, OutputStream::Stdout, "a terminal is one stream");
                    screen.push_str(&String::from_utf8_lossy(&data));
                }
                other => panic!("{other:?} before {text:?}: {screen:?}"),
            }
        }
        screen.clone()
    };
    let first = until(&mut handle, "ready\r\n");
    assert!(first.starts_with("/dev/pts/") && first.contains("\r\n33 101\r\n"), "{first:?}");
    control.resize(TtySize { rows: 40, cols: 120 }).expect("resize");
    until(&mut handle, "40 120\r\n");
    control.write_stdin(b"hi\n").expect("type");
    let mut rest = Vec::new();
    let report = handle.wait(|_, data| rest.extend_from_slice(data)).expect("wait");
    let rest = String::from_utf8_lossy(&rest);
    assert!(format!("{screen}{rest}").contains("hi\r\ngot:hi\r\n"), "{screen:?} {rest:?}");
    assert_eq!(report.status, ExitStatus::Code(4));
}
