//! One build: the Debian packages, the source tree extracted into a temporary directory, the configuration and
//! its check, `make vmlinux`, then one rename of the finished image into place. Whatever happens the temporary
//! directory (with the source tree) is removed; a failure keeps the whole output in `kernel-<hash16>.failed.log`.

use std::collections::VecDeque;
use std::fs;
use std::io::{self, BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

use crate::{
    BUILD_FORMAT, BUILD_PACKAGES, CONFIG_FILE, DotConfig, FRAGMENT, Fragment, KernelError, OptionValue, PROGRESS_EVERY,
    SOURCE_PACKAGE, STAMP_FILE, Stamp, VMLINUX_FILE, hex, installed_package_versions, io_err, sha256_file,
};

/// The PATH the build's programs run with.
const BUILD_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// Where Debian's linux-source packages put their tarball.
const SOURCE_DIR: &str = "/usr/src";

/// About how many files `make vmlinux` compiles for the fragment (944 for 6.1.172): the progress lines' total.
const EXPECTED_COMPILED: usize = 950;

/// How many lines of a failed step's output an error quotes (after its error lines).
const TAIL_LINES: usize = 6;

/// Everything one build needs.
pub(crate) struct BuildPlan<'a> {
    pub fragment: &'a Fragment,
    pub images: &'a Path,
    pub key: &'a str,
    pub hash16: &'a str,
    pub install_dir: &'a Path,
    pub source_version: &'a str,
}

impl BuildPlan<'_> {
    fn temp_dir(&self) -> PathBuf {
        self.images.join(format!(".kernel-{}.tmp-{}", self.hash16, std::process::id()))
    }

    fn failed_log(&self) -> PathBuf {
        self.images.join(format!("kernel-{}.failed.log", self.hash16))
    }
}

/// Installs the [`BUILD_PACKAGES`] that are missing (`apt-get install`, refreshing the package lists once if
/// that fails); [`KernelError::MissingPackages`] when some are missing and this process is not root.
pub(crate) fn install_packages(progress: &dyn Fn(&str)) -> Result<(), KernelError> {
    let installed = installed_package_versions(BUILD_PACKAGES);
    let missing: Vec<&str> =
        BUILD_PACKAGES.iter().copied().filter(|p| !installed.iter().any(|(name, _)| name == p)).collect();
    if missing.is_empty() {
        return Ok(());
    }
    if !nix::unistd::geteuid().is_root() {
        return Err(KernelError::MissingPackages(missing.iter().map(|p| (*p).to_owned()).collect()));
    }
    progress(&format!("kernel: installing Debian packages: {}", missing.join(" ")));
    let apt = |args: &[&str]| -> Result<(), KernelError> {
        let output = Command::new("apt-get")
            .args(args)
            .env("DEBIAN_FRONTEND", "noninteractive")
            .env("PATH", BUILD_PATH)
            .stdin(Stdio::null())
            .output()
            .map_err(io_err("cannot run", Path::new("apt-get")))?;
        if output.status.success() {
            return Ok(());
        }
        let text = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
        let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
        Err(KernelError::AptGet {
            packages: missing.join(" "),
            status: output.status.to_string(),
            tail: lines[lines.len().saturating_sub(TAIL_LINES)..].join(" | "),
        })
    };
    let install: Vec<&str> = ["install", "-y", "-qq"].into_iter().chain(missing.iter().copied()).collect();
    if apt(&install).is_err() {
        progress("kernel: apt-get install failed; refreshing the package lists and trying again");
        apt(&["update", "-qq"])?;
        apt(&install)?;
    }
    Ok(())
}

/// Removes temporary trees left by builds that did not finish ([`strata_image_util::stale_build_dirs`]).
pub(crate) fn remove_stale_temp_dirs(images: &Path, hash16: &str) -> Result<(), KernelError> {
    for dir in strata_image_util::stale_build_dirs(images, "kernel", hash16).map_err(io_err("cannot read", images))? {
        remove_tree(&dir)?;
    }
    Ok(())
}

fn remove_tree(path: &Path) -> Result<(), KernelError> {
    match fs::remove_dir_all(path) {
        Err(err) if err.kind() != io::ErrorKind::NotFound => Err(io_err("cannot remove", path)(err)),
        _ => Ok(()),
    }
}

/// Builds the kernel and installs it at `plan.install_dir`.
pub(crate) fn build(plan: &BuildPlan<'_>, progress: &dyn Fn(&str)) -> Result<(), KernelError> {
    let temp = plan.temp_dir();
    let result = build_in(plan, &temp, progress);
    let failed_log = plan.failed_log();
    match &result {
        // The log went into the install directory.
        Ok(()) => {
            let _ = fs::remove_file(&failed_log);
        }
        Err(_) => {
            if let Err(err) = fs::copy(temp.join("build.log"), &failed_log) {
                progress(&format!("kernel: warning: cannot keep the build log in {}: {err}", failed_log.display()));
            }
        }
    }
    // After a success the image has been renamed away and this removes the source tree.
    if let Err(err) = remove_tree(&temp) {
        progress(&format!("kernel: warning: {err}"));
        if result.is_ok() {
            return Err(err);
        }
    }
    result
}

/// The build's log: every command's output, in order, in `build.log` in the temporary tree.
struct BuildLog {
    path: PathBuf,
    file: fs::File,
}

impl BuildLog {
    fn line(&mut self, line: &str) -> Result<(), KernelError> {
        writeln!(self.file, "{line}").map_err(io_err("cannot write", &self.path))
    }
}

fn build_in(plan: &BuildPlan<'_>, temp: &Path, progress: &dyn Fn(&str)) -> Result<(), KernelError> {
    let started = Instant::now();
    fs::create_dir(temp).map_err(io_err("cannot create", temp))?;
    let log_path = temp.join("build.log");
    let file = fs::File::create(&log_path).map_err(io_err("cannot create", &log_path))?;
    let mut log = BuildLog { path: log_path, file };
    let failed_log = plan.failed_log();

    let tarball = source_tarball()?;
    let size = fs::metadata(&tarball).map(|m| m.len()).unwrap_or(0);
    progress(&format!(
        "kernel: extracting {SOURCE_PACKAGE} {} ({}, {} MB)",
        plan.source_version,
        tarball.display(),
        size.div_ceil(1_000_000)
    ));
    let mut tar = Command::new("tar");
    tar.arg("-xf").arg(&tarball).arg("-C").arg(temp);
    run_step("extracting the source", tar, &mut log, &failed_log, &mut |_| None, progress)?;
    let src = source_tree(temp)?;

    let fragment_path = temp.join("strata.config");
    fs::write(&fragment_path, FRAGMENT).map_err(io_err("cannot write", &fragment_path))?;
    progress(&format!("kernel: configuring (allnoconfig + {} options of strata.config)", plan.fragment.options.len()));
    let mut allnoconfig = make(&src);
    allnoconfig.arg(format!("KCONFIG_ALLCONFIG={}", fragment_path.display())).arg("allnoconfig");
    run_step("make allnoconfig", allnoconfig, &mut log, &failed_log, &mut |_| None, progress)?;
    let mut olddefconfig = make(&src);
    olddefconfig.arg("olddefconfig");
    run_step("make olddefconfig", olddefconfig, &mut log, &failed_log, &mut |_| None, progress)?;
    let config_path = src.join(".config");
    let config_text = fs::read_to_string(&config_path).map_err(io_err("cannot read", &config_path))?;
    let config = DotConfig::parse(&config_text);
    let mismatches = plan.fragment.mismatches(&config);
    if !mismatches.is_empty() {
        log.line("---- the final .config ----")?;
        log.line(&config_text)?;
        return Err(KernelError::OptionsDidNotStick { options: mismatches, log: failed_log });
    }

    let jobs = std::thread::available_parallelism().map(usize::from).unwrap_or(1);
    progress(&format!(
        "kernel: all {} options of the fragment are set as asked ({} symbols on); compiling with make -j{jobs} \
         vmlinux (a few minutes)",
        plan.fragment.options.len(),
        config.enabled_count()
    ));
    let mut vmlinux = make(&src);
    vmlinux.arg(format!("-j{jobs}")).arg("vmlinux");
    let mut tracker = MakeTracker { compiled: 0, started: Instant::now() };
    run_step("make vmlinux", vmlinux, &mut log, &failed_log, &mut |line| tracker.line(line), progress)?;

    let release_path = src.join("include/config/kernel.release");
    let release = fs::read_to_string(&release_path).map_err(io_err("cannot read", &release_path))?.trim().to_owned();
    let image = temp.join("image");
    fs::create_dir(&image).map_err(io_err("cannot create", &image))?;
    let vmlinux = image.join(VMLINUX_FILE);
    fs::rename(src.join("vmlinux"), &vmlinux).map_err(io_err("cannot move", &vmlinux))?;
    let config_copy = image.join(CONFIG_FILE);
    fs::write(&config_copy, &config_text).map_err(io_err("cannot write", &config_copy))?;
    let vmlinux_size = fs::metadata(&vmlinux).map_err(io_err("cannot stat", &vmlinux))?.len();
    let vmlinux_sha256 = sha256_file(&vmlinux)?;
    let options = &plan.fragment.options;
    let stamp = Stamp {
        key: plan.key.to_owned(),
        build_format: BUILD_FORMAT,
        source_package: SOURCE_PACKAGE.to_owned(),
        source_version: plan.source_version.to_owned(),
        fragment_sha256: hex(&Sha256::digest(FRAGMENT.as_bytes())),
        release,
        vmlinux_sha256,
        vmlinux_size,
        built_at: strata_image_util::rfc3339_now(),
        build_seconds: started.elapsed().as_secs(),
        jobs,
        enabled: options.iter().filter(|o| o.value != OptionValue::No).map(ToString::to_string).collect(),
        disabled: options.iter().filter(|o| o.value == OptionValue::No).map(|o| o.name.clone()).collect(),
        config_enabled_count: config.enabled_count(),
    };
    let json = serde_json::to_string_pretty(&stamp).map_err(|e| KernelError::Fragment(e.to_string()))?;
    let stamp_path = image.join(STAMP_FILE);
    let mut file = fs::File::create(&stamp_path).map_err(io_err("cannot create", &stamp_path))?;
    file.write_all(json.as_bytes())
        .and_then(|()| file.write_all(b"\n"))
        .and_then(|()| file.sync_all())
        .map_err(io_err("cannot write", &stamp_path))?;
    drop(log);
    let kept_log = image.join("build.log");
    fs::rename(temp.join("build.log"), &kept_log).map_err(io_err("cannot move", &kept_log))?;
    install(plan, &image)?;
    progress(&format!(
        "kernel: installed {} in {} ({} MB, sha256 {}) after {}",
        stamp.release,
        plan.install_dir.display(),
        stamp.vmlinux_size.div_ceil(1_000_000),
        stamp.vmlinux_sha256.get(..16).unwrap_or_default(),
        minutes(started.elapsed())
    ));
    Ok(())
}

/// Renames the finished image into place, moving aside (then removing) an install that failed its stamp check.
fn install(plan: &BuildPlan<'_>, image: &Path) -> Result<(), KernelError> {
    let dir = plan.install_dir;
    let old = plan.images.join(format!(".kernel-{}.old-{}", plan.hash16, std::process::id()));
    if fs::symlink_metadata(dir).is_ok() {
        fs::rename(dir, &old).map_err(io_err("cannot move aside", dir))?;
    }
    fs::rename(image, dir).map_err(io_err("cannot install", dir))?;
    remove_tree(&old)
}

/// `/usr/src/linux-source-6.1.tar.xz` (or another compression, should Debian change it).
fn source_tarball() -> Result<PathBuf, KernelError> {
    let prefix = format!("{SOURCE_PACKAGE}.tar.");
    let entries = fs::read_dir(SOURCE_DIR).map_err(|_| KernelError::NoSourceTarball)?;
    let mut found: Vec<PathBuf> = entries
        .filter_map(Result::ok)
        .filter(|e| e.file_name().to_str().is_some_and(|n| n.starts_with(&prefix)))
        .map(|e| e.path())
        .collect();
    found.sort();
    found.into_iter().next().ok_or(KernelError::NoSourceTarball)
}

/// The one directory the tarball extracted to (`linux-source-6.1`).
fn source_tree(temp: &Path) -> Result<PathBuf, KernelError> {
    let tree = temp.join(SOURCE_PACKAGE);
    if tree.join("Makefile").is_file() {
        Ok(tree)
    } else {
        Err(KernelError::Corrupt {
            dir: temp.to_owned(),
            detail: format!("the source tarball did not extract to {SOURCE_PACKAGE}/ with a Makefile"),
        })
    }
}

/// `make -C src ARCH=x86_64` with a clean environment: no make flags inherited from a parent make or cargo
/// (a jobserver we do not own), the C locale, and a build user and host that do not name this machine.
fn make(src: &Path) -> Command {
    let mut command = Command::new("make");
    command.arg("-C").arg(src).arg("ARCH=x86_64");
    for var in ["MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES", "CARGO_MAKEFLAGS", "ARCH", "CROSS_COMPILE"] {
        command.env_remove(var);
    }
    command.env("PATH", BUILD_PATH).env("LC_ALL", "C").env("KBUILD_BUILD_USER", "strata");
    command.env("KBUILD_BUILD_HOST", "strata");
    command
}

/// Runs one step with its stdout and stderr on one pipe: every line goes to the log and through `tracker`,
/// which may turn it into a progress line.
fn run_step(
    step: &str,
    mut command: Command,
    log: &mut BuildLog,
    failed_log: &Path,
    tracker: &mut dyn FnMut(&str) -> Option<String>,
    progress: &dyn Fn(&str),
) -> Result<(), KernelError> {
    let program = PathBuf::from(command.get_program());
    let pipe_err = |e| io_err("cannot create a pipe for", &program)(e);
    let (reader, writer) = io::pipe().map_err(pipe_err)?;
    command.stdin(Stdio::null()).stdout(writer.try_clone().map_err(pipe_err)?).stderr(writer);
    log.line(&format!("---- {step} ----"))?;
    let mut child = command.spawn().map_err(io_err("cannot run", &program))?;
    // The command holds the pipe's write ends: drop them so the read ends when the step exits.
    drop(command);
    let mut last: VecDeque<String> = VecDeque::new();
    let mut errors: Vec<String> = Vec::new();
    let mut write_failed = None;
    for line in BufReader::new(reader).split(b'\n') {
        let Ok(line) = line else { break };
        let line = String::from_utf8_lossy(&line).trim_end().to_owned();
        if let Some(message) = tracker(&line) {
            progress(&format!("kernel: {message}"));
        }
        if is_error_line(&line) && errors.len() < TAIL_LINES {
            errors.push(line.clone());
        }
        if write_failed.is_none()
            && let Err(err) = log.line(&line)
        {
            write_failed = Some(err);
        }
        last.push_back(line);
        if last.len() > TAIL_LINES {
            last.pop_front();
        }
    }
    let status = child.wait().map_err(io_err("cannot wait for", &program))?;
    if let Some(err) = write_failed {
        return Err(err);
    }
    if status.success() {
        return Ok(());
    }
    let mut tail = errors;
    tail.extend(last.into_iter().filter(|l| !l.trim().is_empty()));
    tail.dedup();
    Err(KernelError::Step {
        step: step.to_owned(),
        status: status.to_string(),
        log: failed_log.to_owned(),
        tail: tail.join(" | "),
    })
}

/// A compiler or make error line.
fn is_error_line(line: &str) -> bool {
    line.contains("error:") || line.contains("*** ") || line.starts_with("Error ")
}

/// Condenses kbuild's quiet output (`  CC      kernel/fork.o`): one progress line every [`PROGRESS_EVERY`]
/// compiled files, one when `vmlinux` is linked, and compiler errors as they come.
#[derive(Debug)]
struct MakeTracker {
    compiled: usize,
    started: Instant,
}

impl MakeTracker {
    fn line(&mut self, line: &str) -> Option<String> {
        if !line.starts_with("  ") {
            return line.contains("error:").then(|| line.to_owned());
        }
        let mut words = line.split_whitespace();
        let (tag, target) = (words.next()?, words.next()?);
        match tag {
            "CC" | "AS" => {
                self.compiled += 1;
                self.compiled.is_multiple_of(PROGRESS_EVERY).then(|| {
                    let of = if self.compiled < EXPECTED_COMPILED {
                        format!(" of about {EXPECTED_COMPILED}")
                    } else {
                        String::new()
                    };
                    format!("compiled {}{of} files ({target}), {}", self.compiled, minutes(self.started.elapsed()))
                })
            }
            "LD" if target == "vmlinux" => {
                Some(format!("linking vmlinux ({} files compiled), {}", self.compiled, minutes(self.started.elapsed())))
            }
            _ => None,
        }
    }
}

/// `2m05s`.
fn minutes(elapsed: Duration) -> String {
    let secs = elapsed.as_secs();
    format!("{}m{:02}s", secs / 60, secs % 60)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kbuild_lines_become_counted_progress() {
        let mut tracker = MakeTracker { compiled: PROGRESS_EVERY - 2, started: Instant::now() };
        let lines = [
            "  HOSTCC  scripts/basic/fixdep",
            "  CC      init/main.o",
            "  AS      arch/x86/entry/entry_64.o",
            "  AR      init/built-in.a",
            "fs/ext4/inode.c:12:1: error: expected ';'",
            "  LD      vmlinux.o",
            "  LD      vmlinux",
        ];
        let out: Vec<Option<String>> = lines.iter().map(|l| tracker.line(l)).collect();
        assert_eq!(out[0], None);
        assert_eq!(out[1], None);
        let every = out[2].as_deref().expect("a line at the hundredth file");
        assert!(every.starts_with("compiled 100 of about 950 files (arch/x86/entry/entry_64.o), 0m0"), "{every}");
        assert_eq!(out[3], None);
        assert_eq!(out[4].as_deref(), Some("fs/ext4/inode.c:12:1: error: expected ';'"));
        assert_eq!(out[5], None);
        assert!(out[6].as_deref().is_some_and(|l| l.starts_with("linking vmlinux (100 files compiled)")), "{out:?}");
    }

    #[test]
    fn stale_temp_dirs_go_and_live_ones_of_other_keys_stay() {
        let home = tempfile::tempdir().expect("tempdir");
        let images = home.path();
        let me = std::process::id();
        let mine_stale = images.join(".kernel-aaaaaaaaaaaaaaaa.tmp-1");
        let other_live = images.join(format!(".kernel-bbbbbbbbbbbbbbbb.tmp-{me}"));
        let other_dead = images.join(".kernel-cccccccccccccccc.tmp-4194999");
        for dir in [&mine_stale, &other_live, &other_dead] {
            fs::create_dir_all(dir.join("linux-source-6.1")).expect("mkdir");
        }
        remove_stale_temp_dirs(images, "aaaaaaaaaaaaaaaa").expect("cleanup");
        assert!(!mine_stale.exists());
        assert!(other_live.exists());
        assert!(!other_dead.exists());
    }

    #[test]
    fn a_failed_step_keeps_its_log_and_names_its_errors() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("build.log");
        let file = fs::File::create(&path).expect("log");
        let mut log = BuildLog { path: path.clone(), file };
        let mut command = Command::new("sh");
        command.args(["-c", "echo '  CC      a.o'; echo 'a.c:1:1: error: nope' >&2; echo done; exit 2"]);
        let failed = dir.path().join("kernel-x.failed.log");
        let lines = std::cell::RefCell::new(Vec::new());
        let err = run_step("make vmlinux", command, &mut log, &failed, &mut |l| Some(l.to_owned()), &|l| {
            lines.borrow_mut().push(l.to_owned())
        })
        .expect_err("fails");
        let message = err.to_string();
        assert!(message.starts_with("kernel build: make vmlinux failed (exit status: 2)"), "{message}");
        assert!(message.contains("a.c:1:1: error: nope | "), "{message}");
        assert!(message.contains(&failed.display().to_string()), "{message}");
        let text = fs::read_to_string(&path).expect("log");
        assert!(text.starts_with("---- make vmlinux ----\n  CC      a.o\n"), "{text}");
        assert_eq!(lines.borrow().len(), 3);
    }

    #[test]
    fn timestamps_are_rfc3339_utc() {}
}
