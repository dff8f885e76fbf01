//! Custom images: a Dockerfile built step by step in process-tier jails into the image store, run with
//! `Capabilities::image`; a rebuild after one changed line reuses every layer before it; what the builder must
//! refuse is refused with the line; snapshots and forks of an image's sandbox stand on its layers.

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
    BuildRequest::new(name.clone(), context, dockerfile)
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

/// Writes an OCI image layout of two layers into `dir` with Python's `tarfile`: a bottom with the host's static
/// busybox as `/bin/sh` (and a few applets), `/etc/motd` and `/opt/old/{a,b}`; a top that deletes `/etc/motd`
/// (a whiteout) and replaces `/opt/old` (an opaque directory holding only `c`). `hostile` adds `../escape` to the
/// top layer.
fn oci_layout(dir: &Path, hostile: bool) {
    let script = r#"
import hashlib, io, json, os, sys, tarfile
out, hostile = sys.argv[1], sys.argv[2] == "1"
os.makedirs(f"{out}/blobs/sha256", exist_ok=True)
def put(data):
    digest = hashlib.sha256(data).hexdigest()
    open(f"{out}/blobs/sha256/{digest}", "wb").write(data)
    return {"digest": "sha256:" + digest, "size": len(data)}
def layer(entries):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, kind, value, mode in entries:
            info = tarfile.TarInfo(name)
            info.mode, info.mtime = mode, 1700000000
            if kind == "dir":
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            elif kind == "link":
                info.type, info.linkname = tarfile.SYMTYPE, value
                tar.addfile(info)
            else:
                info.size = len(value)
                tar.addfile(info, io.BytesIO(value))
    return buf.getvalue()
busybox = open("/bin/busybox", "rb").read()
bottom = [(d, "dir", None, 0o755) for d in ("bin", "etc", "opt", "opt/old", "proc", "dev", "tmp", "run", "root")]
bottom += [("bin/busybox", "file", busybox, 0o755), ("etc/motd", "file", b"base\n", 0o644),
           ("opt/old/a", "file", b"a\n", 0o644), ("opt/old/b", "file", b"b\n", 0o644)]
bottom += [(f"bin/{a}", "link", "busybox", 0o777) for a in ("sh", "cat", "ls", "echo", "rm", "mkdir", "pwd", "test")]
top = [("etc", "dir", None, 0o755), ("etc/.wh.motd", "file", b"", 0o644), ("opt/old", "dir", None, 0o755),
       ("opt/old/.wh..wh..opq", "file", b"", 0o644), ("opt/old/c", "file", b"c\n", 0o644)]
if hostile:
    top.append(("../escape", "file", b"out\n", 0o644))
blobs = [layer(bottom), layer(top)]
diff_ids = ["sha256:" + hashlib.sha256(b).hexdigest() for b in blobs]
config = {"architecture": "amd64", "os": "linux", "rootfs": {"type": "layers", "diff_ids": diff_ids},
          "config": {"Env": ["PATH=/bin", "FROM_OCI=yes"], "WorkingDir": "/opt", "Cmd": ["/bin/sh"]}}
manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {**put(json.dumps(config).encode()), "mediaType": "application/vnd.oci.image.config.v1+json"},
            "layers": [{**put(b), "mediaType": "application/vnd.oci.image.layer.v1.tar"} for b in blobs]}
desc = {**put(json.dumps(manifest).encode()), "mediaType": "application/vnd.oci.image.manifest.v1+json"}
open(f"{out}/oci-layout", "w").write('{"imageLayoutVersion": "1.0.0"}')
open(f"{out}/index.json", "w").write(json.dumps({"schemaVersion": 2, "manifests": [desc]}))
"#;
    let made = std::process::Command::new("python3")
        .args(["-c", script])
        .arg(dir)
        .arg(if hostile { "1" } else { "0" })
        .output()
        .expect("python3");
    assert!(made.status.success(), "{}", text(&made.stderr));
}

/// An OCI layout made here imports (whiteout and opaque directory honoured, its Env and WorkingDir kept) and runs
/// on the process tier; a Dockerfile builds `FROM` it; the microVM disk of that image holds the same merged tree
/// (checked by listing it: no guest boots on this host without hardware KVM); a layout with a hostile entry is
/// refused and records nothing.
#[test]
fn an_oci_image_imports_runs_builds_on_and_becomes_a_disk() {
    let Some(tier) = process_tier("an_oci_image_imports_runs_builds_on_and_becomes_a_disk") else { return };
    let engine = python_engine();
    let store = engine.image_store().expect("store");
    let layout = tempfile::tempdir().expect("tempdir");
    oci_layout(layout.path(), false);
    let imported = unique("oci");
    let record = strata_image_store::oci::import(&store, layout.path(), &imported, &|_| {}).expect("import");
    assert_eq!((record.layers.len(), record.base.as_deref()), (2, None));
    let caps = Capabilities { image: Some(imported.clone()), ..Capabilities::default() };
    let script = "test -e /etc/motd || echo motd-deleted; ls /opt/old; echo $FROM_OCI; pwd";
    let outcome = tier.run(&sh(script), &caps, &Limits::default(), ExecOptions::default()).expect("run");
    assert_eq!(text(&outcome.stdout), "motd-deleted\nc\nyes\n/opt\n", "{}", text(&outcome.stderr));

    let built = unique("on-oci");
    let context = tempfile::tempdir().expect("tempdir");
    let dockerfile = format!("FROM {imported}\nRUN echo built > /opt/built.txt && rm /opt/old/c\n");
    engine.build_image(&request(&built, context.path(), dockerfile), &|_| {}).expect("build on the import");
    let caps = Capabilities { image: Some(built.clone()), ..Capabilities::default() };
    let outcome =
        tier.run(&sh("cat built.txt; ls /opt/old | wc -l"), &caps, &Limits::default(), ExecOptions::default());
    assert_eq!(text(&outcome.expect("run").stdout), "built\n0\n");

    let disk = store.ensure_disk(&built, &|_| {}).expect("the disk");
    let listing = strata_image_store::disk::disk_listing(&disk.path).expect("listing");
    for present in ["bin/busybox", "opt/built.txt"] {
        assert!(listing.iter().any(|p| p == present), "{present} missing from {listing:?}");
    }
    for absent in ["etc/motd", "opt/old/a", "opt/old/b", "opt/old/c"] {
        assert!(!listing.iter().any(|p| p == absent), "{absent} in {listing:?}");
    }
    assert!(!listing.iter().any(|p| p.contains(".wh.")), "a whiteout file on the disk: {listing:?}");
    let again = store.ensure_disk(&built, &|_| {}).expect("the cached disk");
    assert_eq!(again, disk);

    let hostile = tempfile::tempdir().expect("tempdir");
    oci_layout(hostile.path(), true);
    let refused = unique("hostile");
    let err = strata_image_store::oci::import(&store, hostile.path(), &refused, &|_| {}).expect_err("hostile");
    assert!(err.to_string().contains("escape"), "{err}");
    assert!(store.get(&refused).is_err());
    assert!(!hostile.path().parent().expect("parent").join("escape").exists());
    for name in [&imported, &built] {
        store.remove(name).expect("remove");
    }
    let _ = std::fs::remove_file(&disk.path);
}
