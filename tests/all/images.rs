//! Custom images: a Dockerfile built step by step in process-tier jails into the image store, run with
//! `Capabilities::image`; a rebuild after one changed line reuses every layer before it; what the builder must
//! refuse is refused with the line; snapshots and forks of an image's sandbox stand on its layers.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Instant;

use strata_core::{Capabilities, ExecOptions, ImageName, Job, Limits, Status, Tier};
use strata_engine::TierChoice;
use strata_engine::build::{BuildError, BuildRequest};

use strata_benches::images::{offline_context, offline_dockerfile};

use crate::util::{process_tier, python_engine};

fn sh(script: &str) -> Job {
    Job::Command { argv: vec!["/bin/sh".into(), "-c".into(), script.into()] }
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// A name of this run's own (the store is the real `$STRATA_HOME`'s).
fn unique(name: &str) -> ImageName {
    ImageName::new(format!("test-{name}-{}", std::process::id())).expect("a name")
}

fn request(name: &ImageName, context: &Path, dockerfile: String) -> BuildRequest {
    BuildRequest {
        dockerfile,
        context: context.to_owned(),
        name: name.clone(),
        build_args: BTreeMap::new(),
        allow_net: Vec::new(),
        no_cache: false,
        limits: BuildRequest::default_limits(),
    }
}

#[test]
fn a_dockerfile_with_a_deb_and_a_wheel_builds_runs_and_rebuilds_from_the_changed_line() {
    let test = "a_dockerfile_with_a_deb_and_a_wheel_builds_runs_and_rebuilds_from_the_changed_line";
    let Some(tier) = process_tier(test) else { return };
    let engine = python_engine();
    let context = tempfile::tempdir().expect("tempdir");
    offline_context(context.path());
    let name = unique("offline");
    let lines = std::sync::Mutex::new(Vec::<String>::new());
    let say = |line: &str| lines.lock().expect("lines").push(line.to_owned());

    let started = Instant::now();
    let first = engine.build_image(&request(&name, context.path(), offline_dockerfile("hi")), &say).expect("build");
    let cold = started.elapsed();
    let progress = lines.lock().expect("lines").join("\n");
    assert!(
        progress.contains("step 4/10: RUN dpkg -i") && progress.contains("  | Setting up strata-hello"),
        "{progress}"
    );
    assert_eq!(first.steps.len(), 10);
    // ARG, ENV, USER and CMD make no layer; COPY, RUN, WORKDIR, COPY, RUN, RUN one each.
    assert_eq!(first.image.layers.len(), 6, "{:?}", first.steps);

    let caps = Capabilities { image: Some(name.clone()), ..Capabilities::default() };
    let script = "strata-hello; python3 -c 'import stratawheel; print(stratawheel.answer())'; pwd; cat greeting.txt; \
                  id -un; echo $APP_HOME; ls /tmp; test -e /etc/issue || echo issue-deleted";
    let outcome = tier.run(&sh(script), &caps, &Limits::default(), ExecOptions::default()).expect("run");
    assert_eq!(outcome.status, Status::Exited { code: 0 }, "{}", text(&outcome.stderr));
    assert_eq!(text(&outcome.stdout), "hello from a deb\n42\n/opt/app\nhi\nuser\n/opt/app\nissue-deleted\n");
    // The router sends Python on an image to the native tier; the image's defaults hold there too.
    let python = Job::Python {
        source: strata_core::PythonSource::Code(
            "import os, stratawheel\nprint(stratawheel.answer(), os.getcwd())".into(),
        ),
        args: Vec::new(),
    };
    let outcome = engine
        .execute(strata_engine::RunRequest::new(&python).caps(&caps).tier(TierChoice::Auto))
        .expect("python on the image");
    assert_eq!(text(&outcome.stdout), "42 /opt/app\n", "{}", text(&outcome.stderr));
    assert_eq!(outcome.tier, strata_core::TierKind::Process);

    // One changed line: every step before it is found in the store.
    let started = Instant::now();
    let second =
        engine.build_image(&request(&name, context.path(), offline_dockerfile("hello")), &|_| {}).expect("rebuild");
    let warm = started.elapsed();
    let cached: Vec<bool> = second.steps.iter().filter(|s| s.layer.is_some()).map(|s| s.cached).collect();
    assert_eq!(cached, [true, true, true, true, true, false], "{:?}", second.steps);
    assert_eq!(second.image.layers[..5], first.image.layers[..5]);
    assert_ne!(second.image.layers[5], first.image.layers[5]);
    let outcome = tier.run(&sh("cat greeting.txt"), &caps, &Limits::default(), ExecOptions::default()).expect("run");
    assert_eq!(text(&outcome.stdout), "hello\n");
    eprintln!(
        "image build: cold {:.2} s, rebuild after one changed line {:.2} s",
        cold.as_secs_f64(),
        warm.as_secs_f64()
    );

    // A snapshot of a sandbox on the image forks onto the same layers.
    let sandbox = tier.start(&caps, &Limits::default()).expect("start");
    let wrote = sandbox.exec(&sh("echo mine > /home/user/mine.txt"), ExecOptions::default()).expect("write");
    assert_eq!(wrote.status, Status::Exited { code: 0 }, "{}", text(&wrote.stderr));
    let snapshots = tempfile::tempdir().expect("tempdir");
    let snapshot = sandbox.snapshot(&snapshots.path().join("s")).expect("snapshot");
    sandbox.close().expect("close");
    let fork = tier.fork(&snapshot).expect("fork");
    let outcome = fork.exec(&sh("cat ~/mine.txt greeting.txt; strata-hello"), ExecOptions::default()).expect("exec");
    assert_eq!(text(&outcome.stdout), "mine\nhello\nhello from a deb\n", "{}", text(&outcome.stderr));
    fork.close().expect("close");

    let store = engine.image_store().expect("store");
    store.remove(&name).expect("remove");
    let missing = tier.run(&sh("true"), &caps, &Limits::default(), ExecOptions::default());
    assert_eq!(missing.expect_err("no such image").code(), "image_not_found");
}

#[test]
fn a_build_refuses_what_it_must_with_the_line_and_records_nothing() {
    let Some(_) = process_tier("a_build_refuses_what_it_must_with_the_line_and_records_nothing") else { return };
    let engine = python_engine();
    let context = tempfile::tempdir().expect("tempdir");
    std::fs::write(context.path().join("ok.txt"), "ok").expect("write");
    let outside = tempfile::tempdir().expect("tempdir");
    std::fs::write(outside.path().join("secret"), "host secret").expect("write");
    std::os::unix::fs::symlink(outside.path(), context.path().join("link")).expect("symlink");
    let name = unique("refused");
    for (dockerfile, expect) in [
        ("FROM strata-debian\nCOPY ../secret /\n", "leaves the build context"),
        ("FROM strata-debian\nCOPY link/secret /\n", "links are not followed"),
        ("FROM strata-debian\nCOPY missing.txt /\n", "no such file"),
        ("FROM strata-debian\nADD https://example.com/x.tgz /\n", "ADD of a URL"),
        ("FROM ubuntu:22.04\nRUN true\n", "no registry is reached"),
        ("FROM strata-debian\nFROM strata-debian\n", "multi-stage"),
        ("FROM strata-debian\nRUN echo partial; exit 3\n", "exited with code 3"),
        ("FROM strata-debian\nUSER 1000\n", "numeric IDs"),
    ] {
        let err =
            engine.build_image(&request(&name, context.path(), dockerfile.into()), &|_| {}).expect_err(dockerfile);
        let message = err.to_string();
        assert!(message.contains(expect), "{dockerfile:?}: {message}");
        assert!(message.contains("line "), "{message}");
        if let BuildError::StepFailed { output, line, .. } = &err {
            assert_eq!((output.trim(), *line), ("partial", 2));
        }
    }
    let store = engine.image_store().expect("store");
    assert!(store.get(&name).is_err(), "a failed build records no image");
}
