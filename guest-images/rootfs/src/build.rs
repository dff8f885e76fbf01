//! One build: debootstrap into a temporary tree, the post-build steps, the tree hash and the stamp, then one
//! rename into place. Whatever happens, nothing stays mounted under the temporary tree and it is removed.

use std::collections::HashSet;
use std::fs;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::{ROOTFS_DIR, Recipe, RootfsError, STAMP_FILE, Stamp, io_err, mounts, post_build, tree};

/// The PATH debootstrap runs with: it calls `chroot`, `mount` and `dpkg` from the sbin directories, which a
/// user's PATH may lack.
const BUILD_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// How many lines of debootstrap's log an error quotes (after its `E:` lines).
const TAIL_LINES: usize = 6;

/// Everything one build needs.
pub(crate) struct BuildPlan<'a> {
    pub recipe: &'a Recipe,
    pub recipe_hash: &'a str,
    pub images: &'a Path,
    pub hash16: &'a str,
    pub install_dir: &'a Path,
    pub debootstrap: &'a Path,
    pub mirror: &'a str,
}

/// An executable named `name` on PATH or in the sbin directories.
pub(crate) fn find_tool(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(std::env::split_paths(BUILD_PATH))
        .map(|dir| dir.join(name))
        .find(|candidate| fs::metadata(candidate).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0))
}

/// Builds the image and installs it at `plan.install_dir`; returns its stamp.
pub(crate) fn build(plan: &BuildPlan<'_>, progress: &dyn Fn(&str)) -> Result<Stamp, RootfsError> {
    let temp = plan.images.join(format!(".debian-{}.tmp-{}", plan.hash16, std::process::id()));
    let result = build_in(plan, &temp, progress);
    // After a success the tree has been renamed away and this does nothing.
    if let Err(err) = mounts::remove_build_tree(&temp) {
        progress(&format!("debian image: warning: {err}"));
        if result.is_ok() {
            return Err(err);
        }
    }
    result
}

fn build_in(plan: &BuildPlan<'_>, temp: &Path, progress: &dyn Fn(&str)) -> Result<Stamp, RootfsError> {
    let rootfs = temp.join(ROOTFS_DIR);
    for dir in [temp, &rootfs] {
        fs::DirBuilder::new().mode(0o755).create(dir).map_err(io_err("cannot create", dir))?;
        fs::set_permissions(dir, fs::Permissions::from_mode(0o755)).map_err(io_err("cannot chmod", dir))?;
    }
    let debootstrap_version = debootstrap_version(plan.debootstrap)?;
    let recipe = plan.recipe;
    progress(&format!(
        "debian image: debootstrap {} ({}, {}, {} extra packages) from {} (a minute or more)",
        recipe.suite,
        recipe.variant,
        recipe.arch,
        recipe.include.len(),
        plan.mirror
    ));
    run_debootstrap(plan, temp, &rootfs, progress)?;
    // debootstrap unmounts what it mounted when it exits; make sure.
    mounts::unmount_under(temp)?;
    post_build::apply_all(&rootfs, progress)?;
    progress("debian image: hashing the tree");
    let summary = tree::hash_tree(&rootfs)?;
    let stamp = Stamp {
        recipe_hash: plan.recipe_hash.to_owned(),
        tree_hash: summary.hash,
        size_bytes: summary.size_bytes,
        built_at: strata_image_util::rfc3339_now(),
        debootstrap_version,
        mirror: plan.mirror.to_owned(),
    };
    let stamp_path = temp.join(STAMP_FILE);
    let json = serde_json::to_string_pretty(&stamp).map_err(|e| RootfsError::Recipe(e.to_string()))?;
    let mut file = fs::File::create(&stamp_path).map_err(io_err("cannot create", &stamp_path))?;
    file.write_all(json.as_bytes())
        .and_then(|()| file.write_all(b"\n"))
        .and_then(|()| file.sync_all())
        .map_err(io_err("cannot write", &stamp_path))?;
    install(plan, temp)?;
    progress(&format!(
        "debian image: installed in {} ({} MB, tree hash {}; debootstrap's whole output is in {})",
        plan.install_dir.display(),
        stamp.size_bytes.div_ceil(1_000_000),
        stamp.tree_hash.get(..16).unwrap_or_default(),
        plan.install_dir.join("build.log").display()
    ));
    Ok(stamp)
}

/// Renames the finished tree into place, moving aside (then removing) an install that failed its stamp check.
fn install(plan: &BuildPlan<'_>, temp: &Path) -> Result<(), RootfsError> {
    let dir = plan.install_dir;
    let old = plan.images.join(format!(".debian-{}.old-{}", plan.hash16, std::process::id()));
    if fs::symlink_metadata(dir).is_ok() {
        fs::rename(dir, &old).map_err(io_err("cannot move aside", dir))?;
    }
    fs::rename(temp, dir).map_err(io_err("cannot install", dir))?;
    mounts::remove_build_tree(&old)
}

fn debootstrap_version(debootstrap: &Path) -> Result<String, RootfsError> {
    let output = Command::new(debootstrap)
        .arg("--version")
        .stdin(Stdio::null())
        .output()
        .map_err(io_err("cannot run", debootstrap))?;
    let text = String::from_utf8_lossy(&output.stdout);
    Ok(text.trim().trim_start_matches("debootstrap").trim().to_owned())
}

/// debootstrap's arguments for `recipe`, building into `target` from `mirror`.
fn debootstrap_args(recipe: &Recipe, target: &Path, mirror: &str) -> Vec<String> {
    let mut args = vec![
        format!("--variant={}", recipe.variant),
        format!("--arch={}", recipe.arch),
        format!("--components={}", recipe.components.join(",")),
        "--merged-usr".to_owned(),
    ];
    if !recipe.include.is_empty() {
        args.push(format!("--include={}", recipe.include.join(",")));
    }
    args.push(recipe.suite.clone());
    args.push(target.display().to_string());
    args.push(mirror.to_owned());
    args
}

/// Runs debootstrap, turning its messages into progress lines. Its whole output goes to `build.log` beside the
/// tree; when it fails, with its own detailed log, to `$STRATA_HOME/images/debian-<hash16>.failed.log`.
fn run_debootstrap(
    plan: &BuildPlan<'_>,
    temp: &Path,
    rootfs: &Path,
    progress: &dyn Fn(&str),
) -> Result<(), RootfsError> {
    let pipe_err = |e| io_err("cannot create a pipe for", plan.debootstrap)(e);
    let (reader, writer) = std::io::pipe().map_err(pipe_err)?;
    let mut command = Command::new(plan.debootstrap);
    command
        .args(debootstrap_args(plan.recipe, rootfs, plan.mirror))
        .env("PATH", BUILD_PATH)
        .env("LC_ALL", "C")
        .env("DEBIAN_FRONTEND", "noninteractive")
        .stdin(Stdio::null())
        .stdout(writer.try_clone().map_err(pipe_err)?)
        .stderr(writer);
    let mut child = command.spawn().map_err(io_err("cannot run", plan.debootstrap))?;
    // The command holds the pipe's write ends: drop them so the read ends when debootstrap exits.
    drop(command);
    let mut tracker = Tracker::default();
    let mut log = Vec::new();
    for line in BufReader::new(reader).split(b'\n') {
        let Ok(line) = line else { break };
        let line = String::from_utf8_lossy(&line).trim_end().to_owned();
        if let Some(message) = tracker.line(&line) {
            progress(&format!("debian image: {message}"));
        }
        log.push(line);
    }
    let status = child.wait().map_err(io_err("cannot wait for", plan.debootstrap))?;
    let mut text = log.join("\n");
    text.push('\n');
    if status.success() {
        let path = temp.join("build.log");
        return fs::write(&path, text).map_err(io_err("cannot write", &path));
    }
    // debootstrap keeps its detailed log in the target until it succeeds.
    let detailed = fs::read_to_string(rootfs.join("debootstrap/debootstrap.log")).unwrap_or_default();
    let tail = failure_tail(&log, &detailed);
    let log_path = plan.images.join(format!("debian-{}.failed.log", plan.hash16));
    let _ = fs::write(&log_path, format!("{text}\n---- debootstrap.log ----\n{detailed}"));
    Err(RootfsError::Debootstrap { status: status.to_string(), log: log_path, tail })
}

/// What an error quotes: debootstrap's `E:` lines, then the last lines of its detailed log (or of its output).
fn failure_tail(output: &[String], detailed: &str) -> String {
    let mut tail: Vec<&str> = output.iter().map(String::as_str).filter(|l| l.starts_with("E: ")).collect();
    let source: Vec<&str> = if detailed.trim().is_empty() {
        output.iter().map(String::as_str).collect()
    } else {
        detailed.lines().collect()
    };
    let source: Vec<&str> = source.into_iter().filter(|l| !l.trim().is_empty() && !tail.contains(l)).collect();
    tail.extend(&source[source.len().saturating_sub(TAIL_LINES)..]);
    tail.join(" | ")
}

/// Condenses debootstrap's `I:` lines: per-package lines become one line with a counter, validation lines
/// are dropped, everything else passes. The counters are approximate: debootstrap installs a few packages
/// (the core set) without a line each, so unpacking and configuring end a few short of the total.
#[derive(Debug, Default)]
struct Tracker {
    retrieved: HashSet<String>,
    extracting: bool,
    unpacked: HashSet<String>,
    configured: HashSet<String>,
}

impl Tracker {
    fn line(&mut self, line: &str) -> Option<String> {
        if let Some(warning) = line.strip_prefix("W: ") {
            return Some(format!("warning: {warning}"));
        }
        if let Some(error) = line.strip_prefix("E: ") {
            return Some(format!("error: {error}"));
        }
        let Some(info) = line.strip_prefix("I: ") else {
            return (!line.trim().is_empty()).then(|| line.to_owned());
        };
        let words: Vec<&str> = info.split_whitespace().collect();
        let package = |verb: &str| match words.as_slice() {
            // dpkg names multi-arch packages `name:arch`.
            [v, name] if *v == verb => {
                name.strip_suffix("...").and_then(|n| n.split(':').next()).filter(|n| !n.is_empty())
            }
            _ => None,
        };
        match words.as_slice() {
            ["Retrieving", name, _version] => {
                self.retrieved.insert((*name).to_owned());
                return Some(format!("retrieving {name} ({})", self.retrieved.len()));
            }
            ["Validating", ..] => return None,
            _ => {}
        }
        if package("Extracting").is_some() {
            if self.extracting {
                return None;
            }
            self.extracting = true;
            return Some("extracting the required packages".to_owned());
        }
        let total = self.retrieved.len();
        if let Some(name) = package("Unpacking") {
            self.unpacked.insert(name.to_owned());
            return Some(format!("unpacking {name} ({}/{total})", self.unpacked.len().min(total)));
        }
        if let Some(name) = package("Configuring") {
            self.configured.insert(name.to_owned());
            return Some(format!("configuring {name} ({}/{total})", self.configured.len().min(total)));
        }
        if info.starts_with("Base system installed successfully") {
            return Some(format!("base system installed ({total} packages)"));
        }
        Some(info.trim_end().to_owned())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debootstrap_lines_become_counted_progress() {
        let mut tracker = Tracker::default();
        let lines = [
            "I: Retrieving InRelease ",
            "I: Checking Release signature",
            "I: Retrieving adduser 3.134",
            "I: Validating adduser 3.134",
            "I: Retrieving python3 3.11.2-1+b1",
            "I: Extracting adduser...",
            "I: Extracting python3...",
            "I: Unpacking required packages...",
            "I: Unpacking adduser...",
            "I: Unpacking python3:amd64...",
            "I: Configuring python3...",
            "W: Failure trying to run: chroot x",
            "I: Base system installed successfully.",
        ];
        let out: Vec<Option<String>> = lines.iter().map(|l| tracker.line(l)).collect();
        let expected = [
            Some("Retrieving InRelease"),
            Some("Checking Release signature"),
            Some("retrieving adduser (1)"),
            None,
            Some("retrieving python3 (2)"),
            Some("extracting the required packages"),
            None,
            Some("Unpacking required packages..."),
            Some("unpacking adduser (1/2)"),
            Some("unpacking python3 (2/2)"),
            Some("configuring python3 (1/2)"),
            Some("warning: Failure trying to run: chroot x"),
            Some("base system installed (2 packages)"),
        ];
        let out: Vec<Option<&str>> = out.iter().map(Option::as_deref).collect();
        assert_eq!(out, expected);
    }

    #[test]
    fn debootstrap_gets_the_recipe_as_arguments() {
        let recipe = Recipe::pinned().expect("recipe");
        let args = debootstrap_args(&recipe, Path::new("/h/t/rootfs"), "http://mirror.example.org/debian");
        assert_eq!(&args[..4], ["--variant=minbase", "--arch=amd64", "--components=main", "--merged-usr"]);
        assert!(args[4].starts_with("--include=python3,python3-pip,"), "{}", args[4]);
        assert_eq!(&args[5..], ["bookworm", "/h/t/rootfs", "http://mirror.example.org/debian"]);
    }

    #[test]
    fn timestamps_are_rfc3339_utc() {}

    #[test]
    fn a_failed_build_leaves_no_temporary_tree() {
        let home = tempfile::tempdir().expect("tempdir");
        let images = home.path().join("images");
        fs::create_dir_all(&images).expect("mkdir");
        let recipe = Recipe::pinned().expect("recipe");
        let plan = BuildPlan {
            recipe: &recipe,
            recipe_hash: "0123456789abcdef0123",
            images: &images,
            hash16: "0123456789abcdef",
            install_dir: &images.join("debian-0123456789abcdef"),
            // `false` stands in for a debootstrap that fails.
            debootstrap: &find_tool("false").expect("false(1) exists"),
            mirror: "file:/nonexistent",
        };
        let err = build(&plan, &|_| {}).expect_err("fails");
        assert!(matches!(err, RootfsError::Debootstrap { .. }), "{err}");
        let left: Vec<_> = fs::read_dir(&images).expect("read").map(|e| e.expect("entry").file_name()).collect();
        assert_eq!(left, vec![std::ffi::OsString::from("debian-0123456789abcdef.failed.log")]);
    }
}
