//! The pinned Python artifacts: a tampered or truncated file is detected and fetched again, never used.

use std::path::Path;
use std::process::Command;

use strata_python_image::{EnsureOutcome, PythonImage};

fn copy_dir(from: &Path, to: &Path) {
    // A real copy (not hard links): tampering with it must not touch the shared install.
    let status = Command::new("cp").arg("-r").arg(from).arg(to).status().expect("cp");
    assert!(status.success());
}

#[test]
fn a_tampered_artifact_is_detected_and_fetched_again() {
    let shared = PythonImage::new(&strata_engine::strata_home().expect("home")).expect("image");
    let (installed, _) = shared.ensure(&|_| {}).expect("the shared runtime installs");

    let home = tempfile::tempdir().expect("tempdir");
    std::fs::create_dir_all(home.path().join("python")).expect("mkdir");
    let image = PythonImage::new(home.path()).expect("image");
    copy_dir(&installed.dir, &image.install_dir());

    // A copy has new inodes and times: its stamp no longer matches, so it is checked in full, and passes.
    let (copy, outcome) = image.ensure(&|_| {}).expect("verified");
    assert_eq!(outcome, EnsureOutcome::Reverified);
    assert_eq!(image.ensure(&|_| {}).expect("present").1, EnsureOutcome::Present);

    // Flip one byte in the middle of the stdlib zip, keeping its size.
    let zip = copy.stdlib_dir.join(&copy.stdlib_zip_name);
    let mut bytes = std::fs::read(&zip).expect("read");
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x5a;
    std::fs::write(&zip, &bytes).expect("tamper");
    let lines = std::sync::Mutex::new(Vec::new());
    let (_, outcome) = image.ensure(&|line| lines.lock().expect("lock").push(line.to_owned())).expect("refetched");
    assert_eq!(outcome, EnsureOutcome::Installed);
    let lines = lines.into_inner().expect("lines");
    assert!(lines.iter().any(|l| l.contains("not intact") && l.contains("sha256")), "{lines:?}");
    assert_ne!(std::fs::read(&zip).expect("read")[middle], bytes[middle], "the tampered byte is gone");
    image.verify().expect("every file matches its pinned sha256 again");

    // A truncated snapshot likewise.
    let file = std::fs::File::options().write(true).open(&copy.snapshot).expect("open");
    file.set_len(1000).expect("truncate");
    assert_eq!(image.ensure(&|_| {}).expect("refetched").1, EnsureOutcome::Installed);
    assert_eq!(std::fs::metadata(&copy.snapshot).expect("meta").len(), 104_517_748);
}
