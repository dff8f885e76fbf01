//! `strata images build|list|verify`.

use std::io::Write;

use std::collections::BTreeMap;
use std::path::PathBuf;

use clap::{Args, Subcommand, ValueEnum};
use strata_core::ImageName;
use strata_core::{Fuel, Limits};
use strata_engine::build::BuildRequest;
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
    /// Build an image: a built-in one (fetch, verify and install it; for python, compile it for this machine;
    /// minutes, once), or with `-t NAME` a custom image from a Dockerfile and its build context directory.
    #[command(after_help = "Examples:\n  strata images build debian\n  strata images build -t myapp -f Dockerfile \
                            --allow-net deb.debian.org .")]
    Build {
        /// A built-in image (python, debian, kernel, initramfs, disk); with -t, the build context directory.
        target: Option<String>,
        /// Also compile the fuel-metered variant (used by jobs with --fuel); python only.
        #[arg(long)]
        metered: bool,
        /// Build a custom image from a Dockerfile under this name.
        #[arg(short = 't', long = "tag", value_name = "NAME")]
        tag: Option<ImageName>,
        /// The Dockerfile (default: CONTEXT/Dockerfile).
        #[arg(short = 'f', long = "file", value_name = "DOCKERFILE")]
        file: Option<PathBuf>,
        /// A host RUN steps may reach through the egress proxy (HOST, HOST:PORT, *.DOMAIN); repeatable.
        #[arg(long = "allow-net", value_name = "HOST")]
        allow_net: Vec<String>,
        /// A build argument, NAME=VALUE; repeatable.
        #[arg(long = "build-arg", value_name = "NAME=VALUE")]
        build_args: Vec<String>,
        /// Run every step again, even those whose layers the store has.
        #[arg(long)]
        no_cache: bool,
    },
    /// Import an OCI image layout directory or a `docker save` archive from local disk under a name.
    Import {
        /// The layout directory or archive.
        path: PathBuf,
        /// The image's name.
        #[arg(short = 't', long = "tag", value_name = "NAME")]
        tag: ImageName,
    },
    /// Build the microVM disk (squashfs) of a custom image: its layers flattened, as the process tier stacks them.
    Disk {
        /// The image.
        name: ImageName,
    },
    /// Remove custom images (their layers stay until `strata images prune`).
    Rm {
        /// The images.
        #[arg(required = true)]
        names: Vec<ImageName>,
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
    let action = match args.action {
        Action::Build { target, metered, tag: Some(name), file, allow_net, build_args, no_cache } => {
            if metered {
                return Err(Failure::new("usage", "--metered applies to the python image only"));
            }
            let context = PathBuf::from(target.unwrap_or_else(|| ".".into()));
            return build_dockerfile(&engine, name, context, file, allow_net, build_args, no_cache);
        }
        Action::Build { target, metered, tag: None, file, allow_net, build_args, no_cache } => {
            if file.is_some() || !allow_net.is_empty() || !build_args.is_empty() || no_cache {
                return Err(Failure::new(
                    "usage",
                    "-f, --allow-net, --build-arg and --no-cache build a Dockerfile: add -t NAME",
                ));
            }
            let image = match target {
                None => Image::Python,
                Some(name) => Image::from_str(&name, true).map_err(|_| {
                    Failure::new("usage", format!("{name:?} is not a built-in image (python, debian, kernel, initramfs, disk); a Dockerfile build needs -t NAME"))
                })?,
            };
            Action2::Build { image, metered }
        }
        Action::Import { path, tag } => return import(&engine, &path, &tag),
        Action::Rm { names } => return remove(&engine, &names),
        Action::Disk { name } => {
            let store = engine.image_store()?;
            let disk = store.ensure_disk(&name, &say).map_err(|e| Failure::new("storage", e.to_string()))?;
            say(&format!(
                "disk image {} ({}, sha256 {})",
                disk.path.display(),
                megabytes(disk.size_bytes),
                &disk.sha256[..16]
            ));
            return Ok(0);
        }
        Action::List => Action2::List,
        Action::Verify => Action2::Verify,
        Action::Prune(args) => Action2::Prune(args),
        Action::Du(args) => Action2::Du(args),
    };
    match action {
        Action2::Build { image: Image::Python, metered } => build_python(&engine, metered),
        Action2::Build { image: Image::Debian | Image::Kernel | Image::Initramfs | Image::Disk, metered: true } => {
            Err(Failure::new("usage", "--metered applies to the python image only"))
        }
        Action2::Build { image: Image::Debian, metered: false } => {
            let (installed, outcome) = engine.images().debian()?.ensure(&say).map_err(image_error)?;
            let verb = match outcome {
                EnsureOutcome::AlreadyInstalled => "already installed",
                EnsureOutcome::Built => "installed",
            };
            say(&format!("debian image {verb} in {} ({})", installed.dir.display(), megabytes(installed.size_bytes)));
            Ok(0)
        }
        Action2::Build { image: Image::Kernel, metered: false } => {
            let (installed, outcome) = engine.images().kernel()?.ensure(&say).map_err(image_error)?;
            let built = matches!(outcome, strata_kernel_image::EnsureOutcome::Built);
            let verb = if built { "installed" } else { "already installed" };
            say(&format!("kernel {} {verb} in {}", installed.release, installed.vmlinux.display()));
            Ok(0)
        }
        Action2::Build { image: Image::Initramfs, metered: false } => {
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
        Action2::Build { image: Image::Disk, metered: false } => {
            let (rootfs, _) = engine.images().debian()?.ensure(&say).map_err(image_error)?;
            let disk = strata_rootfs_image::disk::ensure_disk_image(&rootfs, &say).map_err(image_error)?;
            say(&format!("disk image {} ({})", disk.path.display(), megabytes(disk.size_bytes)));
            Ok(0)
        }
        Action2::List => list(&engine),
        Action2::Verify => verify(&engine),
        Action2::Prune(args) => crate::prune::prune(&engine, args),
        Action2::Du(args) => crate::prune::du(&engine, args),
    }
}

/// What is left to do once the custom-image actions are done.
enum Action2 {
    Build { image: Image, metered: bool },
    List,
    Verify,
    Prune(crate::prune::PruneArgs),
    Du(crate::prune::DuArgs),
}

fn build_dockerfile(
    engine: &Engine,
    name: ImageName,
    context: PathBuf,
    file: Option<PathBuf>,
    allow_net: Vec<String>,
    build_args: Vec<String>,
    no_cache: bool,
) -> Result<i32, Failure> {
    let file = file.unwrap_or_else(|| context.join("Dockerfile"));
    let dockerfile = std::fs::read_to_string(&file)
        .map_err(|e| Failure::new("input_unreadable", format!("{}: {e}", file.display())))?;
    let mut args = BTreeMap::new();
    for arg in build_args {
        let (k, v) = arg
            .split_once('=')
            .ok_or_else(|| Failure::new("usage", format!("--build-arg {arg:?} is not NAME=VALUE")))?;
        args.insert(k.to_owned(), v.to_owned());
    }
    let request =
        BuildRequest { build_args: args, allow_net, no_cache, ..BuildRequest::new(name, context, dockerfile) };
    let started = std::time::Instant::now();
    let report = engine.build_image(&request, &say).map_err(|e| Failure::new("build_failed", e.to_string()))?;
    let cached = report.steps.iter().filter(|s| s.cached).count();
    let made = report.steps.iter().filter(|s| s.layer.is_some() && !s.cached).count();
    say(&format!(
        "image {} built in {:.1} s: {} layers ({made} made, {cached} cached)",
        report.image.name,
        started.elapsed().as_secs_f64(),
        report.image.layers.len(),
    ));
    Ok(0)
}

fn import(engine: &Engine, path: &std::path::Path, name: &ImageName) -> Result<i32, Failure> {
    let store = engine.image_store()?;
    let started = std::time::Instant::now();
    let image = strata_image_store::oci::import(&store, path, name, &say)
        .map_err(|e| Failure::new("import_failed", e.to_string()))?;
    say(&format!(
        "image {} imported in {:.1} s: {} layers, {}",
        image.name,
        started.elapsed().as_secs_f64(),
        image.layers.len(),
        megabytes(store.image_size(&image))
    ));
    Ok(0)
}

fn remove(engine: &Engine, names: &[ImageName]) -> Result<i32, Failure> {
    let store = engine.image_store()?;
    for name in names {
        store.remove(name).map_err(|e| match e {
            strata_image_store::StoreError::NotFound(_) => Failure::new("image_not_found", e.to_string()),
            other => Failure::new("storage", other.to_string()),
        })?;
        say(&format!("removed image {name}"));
    }
    Ok(0)
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
    let store = engine.image_store()?;
    for image in store.list().map_err(|e| Failure::new("storage", e.to_string()))? {
        let from = match &image.base {
            Some(base) => format!("on {base}, {} layers", image.layers.len()),
            None => format!("oci, {} layers", image.layers.len()),
        };
        row(&mut out, image.name.as_str(), &from, "custom", &megabytes(store.image_size(&image)), &image.created);
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
