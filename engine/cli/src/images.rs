//! `strata images build|list|verify`.

use std::io::Write;

use clap::{Args, Subcommand, ValueEnum};
use strata_core::{Fuel, Limits};
use strata_engine::{Engine, EngineConfig, EngineError};
use strata_kernel_image::KernelError;
use strata_rootfs_image::{EnsureOutcome, RootfsError};

use crate::Failure;

#[derive(Args)]
pub(crate) struct ImagesArgs {
    #[command(subcommand)]
    action: Action,
}

#[derive(Subcommand)]
enum Action {
    /// Build an image: fetch, verify and install it (and for python, compile it for this machine). Minutes, once.
    Build {
        /// The image.
        #[arg(value_enum, default_value = "python")]
        image: Image,
        /// Also compile the fuel-metered variant (used by jobs with --fuel); python only.
        #[arg(long)]
        metered: bool,
    },
    /// Show each image: whether it is installed, its size and where.
    List,
    /// Check every installed image against its pinned sha256 sums or its build stamp.
    Verify,
    // `prune` and `du`: their help is in prune.rs.
    Prune(crate::prune::PruneArgs),
    Du(crate::prune::DuArgs),
}

#[derive(Clone, Copy, ValueEnum)]
enum Image {
    /// CPython 3.15 for wasm32-wasip1 with numpy and pandas (the wasm tier's Python).
    Python,
    /// Debian bookworm minbase with python3 and pip (the process tier's root filesystem).
    Debian,
    /// The microVM guest kernel: strata.config on Debian's linux-source-6.1 (a few minutes, once).
    Kernel,
    /// The microVM initramfs: the guest agent as /init and a static busybox (seconds).
    Initramfs,
    /// The Debian image as a read-only squashfs disk for microVMs (builds the Debian image first if needed).
    Disk,
}

fn say(line: &str) {
    crate::progress::line(line, false);
}

fn image_error(err: impl std::fmt::Display) -> EngineError {
    EngineError::Image(err.to_string())
}

fn megabytes(bytes: u64) -> String {
    format!("{} MB", bytes.div_ceil(1_000_000))
}

pub(crate) fn images(args: ImagesArgs) -> Result<i32, Failure> {
    let engine = Engine::new(EngineConfig::from_env()?)?;
    match args.action {
        Action::Build { image: Image::Python, metered } => build_python(&engine, metered),
        Action::Build { image: Image::Debian | Image::Kernel | Image::Initramfs | Image::Disk, metered: true } => {
            Err(Failure::new("usage", "--metered applies to the python image only"))
        }
        Action::Build { image: Image::Debian, metered: false } => {
            let (installed, outcome) = engine.images().debian()?.ensure(&say).map_err(image_error)?;
            let verb = match outcome {
                EnsureOutcome::AlreadyInstalled => "already installed",
                EnsureOutcome::Built => "installed",
            };
            say(&format!("debian image {verb} in {} ({})", installed.dir.display(), megabytes(installed.size_bytes)));
            Ok(0)
        }
        Action::Build { image: Image::Kernel, metered: false } => {
            let (installed, outcome) = engine.images().kernel()?.ensure(&say).map_err(image_error)?;
            let built = matches!(outcome, strata_kernel_image::EnsureOutcome::Built);
            let verb = if built { "installed" } else { "already installed" };
            say(&format!("kernel {} {verb} in {}", installed.release, installed.vmlinux.display()));
            Ok(0)
        }
        Action::Build { image: Image::Initramfs, metered: false } => {
            let installed = engine.images().initramfs()?;
            let size = std::fs::metadata(&installed.path).map(|m| m.len()).unwrap_or(0);
            say(&format!(
                "initramfs in {} ({}, sha256 {})",
                installed.path.display(),
                megabytes(size),
                &installed.sha256[..16]
            ));
            Ok(0)
        }
        Action::Build { image: Image::Disk, metered: false } => {
            let (rootfs, _) = engine.images().debian()?.ensure(&say).map_err(image_error)?;
            let disk = strata_rootfs_image::disk::ensure_disk_image(&rootfs, &say).map_err(image_error)?;
            say(&format!("disk image {} ({})", disk.path.display(), megabytes(disk.size_bytes)));
            Ok(0)
        }
        Action::List => list(&engine),
        Action::Verify => verify(&engine),
        Action::Prune(args) => crate::prune::prune(&engine, args),
        Action::Du(args) => crate::prune::du(&engine, args),
    }
}

fn build_python(engine: &Engine, metered: bool) -> Result<i32, Failure> {
    let image = engine.images().python()?;
    let (installed, _) = image.ensure(&say).map_err(image_error)?;
    say(&format!("python runtime installed in {}", installed.dir.display()));
    let mut variants = vec![Limits::default()];
    if metered {
        variants.push(Limits { fuel: Fuel::Limited(u64::MAX), ..Limits::default() });
    }
    for limits in variants {
        let label = if limits.fuel.limit().is_some() { "fuel-metered" } else { "unmetered" };
        let outcome = engine.wasm().prepare_python(&limits).map_err(EngineError::from)?;
        let origin = outcome.map_or_else(|| "already loaded in this process".to_owned(), |o| o.to_string());
        say(&format!("python runtime ({label}): compiled code {origin}"));
        engine.wasm().prepare_python_sessions(&limits).map_err(EngineError::from)?;
        say(&format!("python runtime ({label}) for sessions and snapshots: ready"));
    }
    Ok(0)
}

/// One line per image: name, version or recipe hash, state, size, path.
fn list(engine: &Engine) -> Result<i32, Failure> {
    let mut out = std::io::stdout().lock();
    let row = |out: &mut std::io::StdoutLock<'_>, name: &str, id: &str, state: &str, size: &str, path: &str| {
        let _ = writeln!(out, "{name:<9} {id:<24} {state:<14} {size:>8}  {path}");
    };
    let python = engine.images().python()?;
    let package = &python.manifest().package;
    let size: u64 = python.manifest().artifacts.iter().map(|a| a.size).sum();
    let state = if python.is_installed() { "installed" } else { "not installed" };
    let id = format!("{} {}", package.name, package.version);
    row(&mut out, "python", &id, state, &megabytes(size), &python.install_dir().display().to_string());
    let debian = engine.images().debian()?;
    let id = format!("recipe {}", debian.recipe_hash().get(..16).unwrap_or_default());
    let dir = debian.install_dir().display().to_string();
    match debian.installed() {
        Ok(installed) => row(&mut out, "debian", &id, "installed", &megabytes(installed.size_bytes), &dir),
        Err(RootfsError::NotInstalled { .. }) => row(&mut out, "debian", &id, "not installed", "-", &dir),
        Err(err) => row(&mut out, "debian", &id, "broken", "-", &format!("{dir} ({err})")),
    }
    // The microVM's disk is the Debian tree as squashfs: it can only exist for an installed tree.
    match debian.installed() {
        Ok(installed) => {
            let path = strata_rootfs_image::disk::disk_image_path(&installed).display().to_string();
            match strata_rootfs_image::disk::installed_disk_image(&installed) {
                Some(disk) => {
                    row(&mut out, "disk", "squashfs of debian", "installed", &megabytes(disk.size_bytes), &path)
                }
                None => row(&mut out, "disk", "squashfs of debian", "not built", "-", &path),
            }
        }
        Err(_) => row(&mut out, "disk", "squashfs of debian", "not built", "-", "- (needs the debian image)"),
    }
    for old in debian.other_installs() {
        row(&mut out, "debian", "(an older recipe)", "kept", "-", &old.display().to_string());
    }
    let kernel = engine.images().kernel()?;
    let id = kernel.source_version().map_or("-".to_owned(), |v| format!("linux-source {v}"));
    let dir = kernel.install_dir().map_or("-".to_owned(), |d| d.display().to_string());
    match kernel.installed() {
        Ok(installed) => row(&mut out, "kernel", &id, "installed", &megabytes(installed.size_bytes), &dir),
        Err(KernelError::NotInstalled { .. } | KernelError::SourceUnknown) => {
            row(&mut out, "kernel", &id, "not installed", "-", &dir)
        }
        Err(err) => row(&mut out, "kernel", &id, "broken", "-", &format!("{dir} ({err})")),
    }
    for old in kernel.other_installs() {
        row(&mut out, "kernel", "(other source/config)", "kept", "-", &old.display().to_string());
    }
    match engine.images().installed_initramfs() {
        Ok(Some(initramfs)) => {
            let size = std::fs::metadata(&initramfs.path).map_or("-".to_owned(), |m| megabytes(m.len()));
            let id = format!("sha256 {}", initramfs.sha256.get(..16).unwrap_or_default());
            row(&mut out, "initramfs", &id, "installed", &size, &initramfs.path.display().to_string());
        }
        Ok(None) => row(&mut out, "initramfs", "agent + busybox", "not built", "-", "-"),
        Err(err) => row(&mut out, "initramfs", "agent + busybox", "cannot build", "-", &err.to_string()),
    }
    Ok(0)
}

/// Verifies each installed image; an image that is not installed is reported, not a failure.
fn verify(engine: &Engine) -> Result<i32, Failure> {
    let mut out = std::io::stdout().lock();
    let mut failures = Vec::new();
    let python = engine.images().python()?;
    let dir = python.install_dir();
    if !dir.exists() {
        let _ = writeln!(out, "python  not installed  {}", dir.display());
    } else {
        match python.verify() {
            Ok(installed) => {
                let _ = writeln!(out, "python  ok  {}", installed.dir.display());
            }
            Err(err) => failures.push(format!("python image: {err}")),
        }
    }
    let debian = engine.images().debian()?;
    match debian.verify() {
        Ok(installed) => {
            let tree = installed.tree_hash.get(..16).unwrap_or_default();
            let _ = writeln!(out, "debian  ok  tree {tree}  {}", installed.dir.display());
        }
        Err(RootfsError::NotInstalled { dir }) => {
            let _ = writeln!(out, "debian  not installed  {}", dir.display());
        }
        Err(err) => failures.push(format!("debian image: {err}")),
    }
    match engine.images().kernel()?.verify() {
        Ok(installed) => {
            let _ = writeln!(
                out,
                "kernel  ok  sha256 {}  {}",
                installed.sha256.get(..16).unwrap_or_default(),
                installed.vmlinux.display()
            );
        }
        Err(KernelError::NotInstalled { .. } | KernelError::SourceUnknown) => {
            let _ = writeln!(out, "kernel  not installed");
        }
        Err(err) => failures.push(format!("kernel image: {err}")),
    }
    if failures.is_empty() { Ok(0) } else { Err(Failure::new("artifact", failures.join("; "))) }
}
