//! Strata's process tier: Linux programs — a host ELF file, a command of the Debian image, the image's CPython —
//! in a jail built from the primitives containers and Firecracker's jailer use.
//!
//! Each sandbox is a [`jail::Jail`]: new mount, PID, network, IPC, UTS and cgroup namespaces; an overlayfs whose
//! read-only lower layer is the Debian rootfs (`strata images build debian`) and whose upper layer is a tmpfs
//! private to the jail (sized by `Limits::disk`); a private `/proc` with the kernel's knobs read-only, a minimal
//! `/dev`; grants bind-mounted at their guest paths (read-only ones read-only); loopback only. Jobs run as root *of
//! the jail* — in a user namespace whose root is host UID [`JAIL_IDS`] (the image and grants are mounted idmapped
//! through it) — with every capability dropped for good (bounding set, securebits locked), `no_new_privs`, a
//! seccomp allowlist, and rlimits; the jail's cgroup limits memory (no swap), processes and CPU bandwidth.
//!
//! Network: none by default ([`Net::Deny`]: loopback only, no proxy, no socket, no proxy variables). With
//! [`Net::Allow`] (its allowlist parsed where the job was made) each jail (one-shot run or sandbox) gets its own host egress proxy listening on a Unix
//! socket under [`ProcessTierConfig::egress_dir`]. The jail bind-mounts that socket at
//! `/run/strata/egress.sock`, and its PID 1 relays TCP connections to the jail's `127.0.0.1:3128` to it
//! (`strata_jail::forward`: part of PID 1's event loop, under the jail's seccomp filter, out of the jobs' reach).
//! Jobs get `HTTP_PROXY`, `HTTPS_PROXY`, `http_proxy`, `https_proxy` = [`EGRESS_PROXY_URL`] and `NO_PROXY`,
//! `no_proxy` as [`strata_egress::proxy_env`] sets them (the jail's own loopback bypasses the proxy unless the
//! allowlist names a loopback host). With egress secrets, jobs get each secret's placeholder (fresh per jail) as
//! its variable, and the jail's proxy puts the value into plain-HTTP requests to its hosts
//! ([`strata_egress::secrets`]). The proxy enforces the allowlist and the TLS SNI, and logs every request: each job's records
//! (drained when it ends, after its last connections close) are its Outcome's `egress`. The proxy stops with the
//! jail: its thread joined, its socket file removed.
//!
//! Limits and usage, per docs/DESIGN.md §3: wall by killing the job (a one-shot jail's PID 1, and with it its whole PID
//! namespace); CPU time from the cgroup, checked every 10 ms; memory from the cgroup's OOM kills
//! (`limit_exceeded`/`memory`, whatever ended: each job ranks itself first for the OOM killer, so that it, not the
//! jail's PID 1, is killed, and a session that its own files keep full after such a kill is ended); a fork refused
//! by the pids limit stops the job (`limit_exceeded`/`pids`); `Limits::disk` bounds the writable layer's bytes and
//! inodes, and a job that leaves it full is `limit_exceeded`/`disk`; output capped per stream; peak memory from the
//! cgroup. Nothing a job writes into a grant can be set-user-ID, set-group-ID or a device on the host (see
//! `strata_jail::seccomp`).
//!
//! Files: a sandbox's file methods (`read_file`, `write_file`, `list_dir`, `stat`, `make_dir`, `rename`,
//! `remove`, `watch`) take paths by `strata_core::GuestPath`'s rules and are frames the jail's PID 1 answers on
//! the jail's tree as the guest sees it, never following a guest's link out of the jail's root
//! (`strata_jail::files`); a watch is PID 1's inotify, bounded per jail (`strata_jail::watch`), its events read
//! by a thread of the watch's own.
//!
//! Jobs run on the caller's thread, which blocks until the job ends. The tier needs root (mounts, namespaces,
//! cgroups); [`ProcessTier::new`] says so in a typed error otherwise.

#![warn(missing_docs)]

mod fs;
pub mod jail;
mod sandbox;
mod service;
pub mod snapshot;
pub mod zygote;

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use strata_core::OutputCapture;
use strata_core::outcome::EgressEntry;
use strata_core::{
    Capabilities, ExecOptions, GrantMode, GuestCommand, Job, Limits, Net, Outcome, Sandbox, Snapshot, SnapshotTrust,
    Status, StdinStream, Stream, Tier, TierError, TierKind, Truncated, Usage, UserName,
};
use strata_egress::{EgressConfig, EgressHandle, EgressProxy, EgressSecrets};
use strata_image_store::{ImageConfig, ImageStore, StoreError};
use strata_jail::proto::{Bind, Exec, IdMap};

pub use sandbox::ProcessSandbox;

use crate::jail::{CgroupLimits, CgroupRoot, Jail, JailConfig, JailError, JobEnd, JobIo, JobReport, JobWatch, Lanes};

/// Where programs and scripts from the host are copied in the jail.
pub use strata_core::guest_command::PROGRAM_DIR;

/// The environment every job starts from, before the capabilities' env and secrets.
const BASE_ENV: &[(&str, &str)] =
    &[("PATH", strata_jail::init::DEFAULT_PATH), ("HOME", "/root"), ("LANG", "C.UTF-8"), ("HOSTNAME", "strata")];

/// The proxy URL jobs get (`HTTP_PROXY` and friends) when the capabilities allow network: the jail's forwarder.
pub const EGRESS_PROXY_URL: &str = "http://127.0.0.1:3128";

/// How long the end of a job waits for its last proxied connections to finish before reading the egress log.
const EGRESS_SETTLE: Duration = Duration::from_millis(500);

/// A job's working directory.
const WORKDIR: &str = "/root";

/// Processes of the jail itself (the keeper and PID 1), added to the job's pids limit.
const JAIL_PROCESSES: u64 = 2;

/// The host IDs of a jail's user namespace: its root is host UID/GID 1,000,000,000, an ID no host account uses
/// (inside systemd's range for container IDs), with 65,536 IDs mapped.
pub const JAIL_IDS: IdMap = IdMap { base: 1_000_000_000, count: 65_536 };

/// Settings of the process tier.
#[derive(Debug, Clone)]
pub struct ProcessTierConfig {
    /// The root filesystem tree, the jail's read-only lower layer.
    pub rootfs: PathBuf,
    /// A directory of Strata's own (under `$STRATA_HOME/run`) over which jails mount their private tmpfs.
    pub run_dir: PathBuf,
    /// What seals this tier's snapshots and opens them for forks ([`SnapshotTrust`]).
    pub snapshots: SnapshotTrust,
    /// Where the images [`Capabilities::image`] names are (`None`: a sandbox naming one is refused).
    pub images: Option<ImageStore>,
}

impl ProcessTierConfig {
    /// Where the egress proxies' Unix sockets are created (`<run_dir>-egress`, beside the run directory: a jail
    /// covers its run directory with its own tmpfs, which would hide a socket in it).
    pub fn egress_dir(&self) -> PathBuf {
        egress_dir_beside(&self.run_dir)
    }
}

/// The process tier.
#[derive(Debug)]
pub struct ProcessTier {
    config: ProcessTierConfig,
    cgroups: CgroupRoot,
    /// Whether jails get a user namespace; cleared (with a warning) the first time the kernel refuses one or
    /// the idmapped image mount it needs.
    user_namespaces: AtomicBool,
    /// A one-shot jail built ahead of its job ([`ProcessTier::prestart`]), with the configuration it was built
    /// from: the next one-shot job whose jail would be built from the same configuration takes it.
    spare: std::sync::Mutex<Option<Spare>>,
    /// The thread closing a spare no job took ([`ProcessTier::discard_spare`]), joined when the tier is dropped.
    closing: std::sync::Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl Drop for ProcessTier {
    fn drop(&mut self) {
        let closing = self.closing.get_mut().unwrap_or_else(std::sync::PoisonError::into_inner).take();
        if let Some(closing) = closing {
            let _ = closing.join();
        }
    }
}

/// A jail built ahead of its job, and what it was built from.
#[derive(Debug)]
struct Spare {
    config: JailConfig,
    jail: Jail,
    _hold: Option<strata_image_store::LayerHold>,
}

impl ProcessTier {
    /// Checks the host (root, cgroups, the root filesystem), removes what killed engines left behind, and
    /// returns the tier.
    pub fn new(config: ProcessTierConfig) -> Result<ProcessTier, TierError> {
        if !nix::unistd::geteuid().is_root() {
            return Err(unsupported("running without root: the jail needs mount, namespace and cgroup privileges"));
        }
        // Every jail runs the embedded binary: its copy overlaps the checks below and what comes before the first
        // jail.
        jail::prepare_binary();
        let rootfs = config.rootfs.canonicalize().map_err(|source| TierError::Storage {
            what: "process tier root filesystem",
            path: config.rootfs.clone(),
            source,
        })?;
        for reserved in [',', ':'] {
            if rootfs.to_string_lossy().contains(reserved) {
                return Err(unsupported(&format!(
                    "a root filesystem path containing {reserved:?} ({}); overlayfs cannot name it",
                    rootfs.display()
                )));
            }
        }
        std::fs::create_dir_all(&config.run_dir).map_err(|source| TierError::Storage {
            what: "process tier run directory",
            path: config.run_dir.clone(),
            source,
        })?;
        let config = ProcessTierConfig { rootfs, ..config };
        let egress_dir = config.egress_dir();
        std::fs::create_dir_all(&egress_dir).map_err(|source| TierError::Storage {
            what: "process tier egress socket directory",
            path: egress_dir.clone(),
            source,
        })?;
        remove_stale_sockets(&egress_dir);
        let cgroups = CgroupRoot::detect().map_err(|e| unsupported(&e.to_string()))?;
        let stale = cgroups.remove_stale();
        if stale > 0 {
            log::info!("removed {stale} cgroups left by engines that were killed");
        }
        log::debug!("process tier: {}", cgroups.describe());
        Ok(ProcessTier {
            config,
            cgroups,
            user_namespaces: AtomicBool::new(true),
            spare: std::sync::Mutex::new(None),
            closing: std::sync::Mutex::new(None),
        })
    }

    /// Where the egress proxies' Unix sockets live while their jails run (see [`ProcessTierConfig::egress_dir`]).
    pub fn egress_dir(&self) -> PathBuf {
        self.config.egress_dir()
    }

    /// Holds the store's layers of `image` against a prune while the returned value lives (none to hold for the
    /// Debian image; a layer that cannot be held is logged, never fatal: it is only a guard).
    pub(crate) fn hold(&self, image: &RootImage) -> Option<strata_image_store::LayerHold> {
        let store = self.config.images.as_ref()?;
        match store.hold(&image.lowers) {
            Ok(hold) => Some(hold),
            Err(err) => {
                log::warn!("cannot hold the image's layers against a prune: {err}");
                None
            }
        }
    }

    /// The tier's own root filesystem (the Debian image's tree), the image of sandboxes that name none.
    pub fn rootfs(&self) -> &Path {
        &self.config.rootfs
    }

    /// Which cgroup hierarchy jails use, for `strata doctor` and logs.
    pub fn cgroups(&self) -> &CgroupRoot {
        &self.cgroups
    }

    /// The root filesystem `caps` names: its image's layers and defaults, or the tier's own Debian tree.
    pub(crate) fn root_image(&self, caps: &Capabilities) -> Result<RootImage, TierError> {
        let Some(name) = &caps.image else {
            return Ok(RootImage { lowers: vec![self.config.rootfs.clone()], config: ImageConfig::default() });
        };
        let store = self.config.images.as_ref().ok_or_else(|| unsupported("images (this tier has no image store)"))?;
        let resolved = store.resolve(name).map_err(|err| match err {
            StoreError::NotFound(name) => TierError::ImageNotFound { image: name },
            other => internal_from("resolving the image", other),
        })?;
        Ok(RootImage { lowers: resolved.lowers, config: resolved.config })
    }

    fn jail_config(
        &self,
        caps: &Capabilities,
        limits: &Limits,
        one_shot: bool,
        image: &RootImage,
    ) -> Result<JailConfig, TierError> {
        if !caps.tools.is_empty() {
            return Err(unsupported("host tools"));
        }
        caps.validate()?;
        let files_owner = image.user(caps, None).map(|user| user.as_str().to_owned());
        let id_map = self.user_namespaces.load(Ordering::Relaxed).then_some(JAIL_IDS);
        if id_map.is_none() && files_owner.is_some() {
            return Err(unsupported("running as a user other than root without user namespaces on this host"));
        }
        let mut binds = Vec::new();
        for grant in &caps.grants {
            let host =
                grant.host.canonicalize().map_err(|_| strata_core::CapsError::GrantNotFound(grant.host.clone()))?;
            if grant.guest == "/" || is_reserved_guest_path(&grant.guest) {
                return Err(TierError::GuestPath {
                    path: grant.guest.clone(),
                    reason: "is reserved by the jail (/, /proc, /dev, /run/strata)".into(),
                });
            }
            binds.push(Bind { host, guest: grant.guest.clone(), read_only: grant.mode == GrantMode::Ro });
        }
        Ok(JailConfig {
            lowers: image.lowers.clone(),
            scratch_mount: self.config.run_dir.clone(),
            scratch_bytes: limits.disk.0,
            binds,
            hostname: "strata".into(),
            one_shot,
            limits: cgroup_limits(limits),
            id_map,
            restore_upper: None,
            egress_socket: None,
            zygote: false,
            files_owner,
        })
    }

    /// Starts the egress proxy a jail with these capabilities needs: none for [`Net::Deny`]; for [`Net::Allow`],
    /// one proxy with that allowlist and the egress secrets (fresh placeholders: this jail's own) on a fresh Unix
    /// socket under [`ProcessTierConfig::egress_dir`].
    fn start_egress(&self, caps: &Capabilities) -> Result<Option<EgressHandle>, TierError> {
        let Net::Allow(allowlist) = &caps.net else {
            return Ok(None);
        };
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let name = format!("{}-{}.sock", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed));
        let socket = self.config.egress_dir().join(name);
        // A socket file left by a killed engine whose PID this process reused.
        let _ = std::fs::remove_file(&socket);
        let secrets = EgressSecrets::bind(&caps.egress_secrets);
        EgressProxy::start(EgressConfig::new(allowlist.clone()).with_unix_socket(socket).with_secrets(secrets))
            .map(Some)
            .map_err(|e| internal_from("egress proxy", e))
    }

    /// Builds, ahead of its job, the one-shot jail a job with these capabilities and limits would run in, and keeps
    /// it for that job: the next [`Tier::run`] whose jail would be built from exactly the same configuration
    /// (image layers, grants, limits, user mapping) takes it instead of building one, so the namespaces, overlay,
    /// cgroup and seccomp filter are off that job's path. A warm process that forks a copy of itself per command
    /// (`strata daemon`) prepares each copy this way before its command arrives. A job whose configuration differs
    /// builds its own jail, as without a spare; the spare is closed with the tier. Capabilities that need an
    /// egress proxy are not prepared (the proxy belongs to the job's jail alone).
    pub fn prestart(&self, caps: &Capabilities, limits: &Limits) -> Result<(), TierError> {
        if !matches!(caps.net, Net::Deny) {
            return Ok(());
        }
        let image = self.root_image(caps)?;
        let hold = self.hold(&image);
        let config = self.jail_config(caps, limits, true, &image)?;
        let jail = self.start_jail_with(config.clone(), caps)?;
        // The jail as started (the user mapping may have been turned off on the way): what a job must match.
        let config = JailConfig { id_map: jail.id_map(), ..config };
        *self.spare.lock().unwrap_or_else(std::sync::PoisonError::into_inner) =
            Some(Spare { config, jail, _hold: hold });
        Ok(())
    }

    /// Closes the spare jail, if there is one, on a thread of its own: the caller knows no job of this process
    /// will take it (its job went to another tier), so its teardown overlaps that job instead of following it.
    /// Joined when the tier is dropped.
    pub fn discard_spare(&self) {
        let Some(spare) = self.spare.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take() else {
            return;
        };
        // Should the thread not start, the closure (and the spare with it) is dropped here, closing it now.
        let closing = std::thread::Builder::new().name("strata-spare-close".into()).spawn(move || drop(spare));
        if let Ok(closing) = closing {
            let previous = self.closing.lock().unwrap_or_else(std::sync::PoisonError::into_inner).replace(closing);
            if let Some(previous) = previous {
                let _ = previous.join();
            }
        }
    }

    /// The spare jail, when it was built from `config`.
    fn take_spare(&self, config: &JailConfig) -> Option<Jail> {
        let mut slot = self.spare.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if !slot.as_ref().is_some_and(|spare| spare.config.same_jail(config) && !spare.jail.has_ended()) {
            return None;
        }
        slot.take().map(|spare| spare.jail)
    }

    /// Whether jobs run in a user namespace (as an unprivileged host ID) rather than as host root.
    pub fn uses_user_namespaces(&self) -> bool {
        self.user_namespaces.load(Ordering::Relaxed)
    }

    fn start_jail(
        &self,
        caps: &Capabilities,
        limits: &Limits,
        one_shot: bool,
        restore_upper: Option<std::sync::Arc<std::fs::File>>,
        image: &RootImage,
    ) -> Result<Jail, TierError> {
        let mut config = self.jail_config(caps, limits, one_shot, image)?;
        config.restore_upper = restore_upper;
        self.start_jail_with(config, caps)
    }

    fn start_jail_with(&self, mut config: JailConfig, caps: &Capabilities) -> Result<Jail, TierError> {
        let egress = self.start_egress(caps)?;
        config.egress_socket = egress.as_ref().and_then(|proxy| proxy.unix_socket().map(Path::to_owned));
        let mut jail = match Jail::start(&self.cgroups, &config) {
            Err(JailError::Setup { stage, message })
                if config.id_map.is_some()
                    && (stage == "user namespace" || stage == "idmapped image")
                    && !kernel_lacks_nothing(&message) =>
            {
                log::warn!(
                    "jails run without a user namespace (jobs are host root with every capability dropped): \
                     {stage}: {message}"
                );
                self.user_namespaces.store(false, Ordering::Relaxed);
                config.id_map = None;
                Jail::start(&self.cgroups, &config).map_err(jail_error)
            }
            other => other.map_err(jail_error),
        }?;
        if let Some(proxy) = egress {
            jail.attach_egress(proxy);
        }
        Ok(jail)
    }
}

fn is_reserved_guest_path(guest: &str) -> bool {
    ["/proc", "/dev", PROGRAM_DIR].iter().any(|r| guest == *r || guest.starts_with(&format!("{r}/")))
}

/// `<run_dir>-egress`: where the egress proxies' sockets of jails under `run_dir` live.
fn egress_dir_beside(run_dir: &Path) -> PathBuf {
    let mut name = run_dir.file_name().unwrap_or_default().to_os_string();
    name.push("-egress");
    run_dir.with_file_name(name)
}

/// Removes what engines that are no longer running left behind — their jails' cgroups (killing whatever still
/// runs in them) and their egress proxies' sockets beside `run_dir` — without checking the host or starting the
/// tier: what [`ProcessTier::new`] sweeps first. A long-lived server calls it when it starts, so that a
/// predecessor killed mid-job leaves nothing past its successor's start, even when no job comes to this tier.
/// Returns how many cgroups it removed (none where this host has no cgroups Strata can use).
pub fn remove_stale(run_dir: &Path) -> usize {
    remove_stale_sockets(&egress_dir_beside(run_dir));
    CgroupRoot::detect().map(|cgroups| cgroups.remove_stale()).unwrap_or(0)
}

/// Removes the egress sockets of engines that are no longer running (`<pid>-<n>.sock`).
fn remove_stale_sockets(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(|n| n.strip_suffix(".sock")).and_then(|n| n.split_once('-')) else {
            continue;
        };
        if pid.0.parse::<u32>().is_ok_and(|pid| !Path::new(&format!("/proc/{pid}")).exists()) {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

fn unsupported(what: &str) -> TierError {
    TierError::Unsupported { tier: TierKind::Process, what: what.to_owned() }
}

fn internal(message: impl std::fmt::Display) -> TierError {
    TierError::internal(TierKind::Process, message.to_string())
}

/// A failure of the tier itself while doing `what`, caused by `source` (kept as the error's source).
fn internal_from(what: &str, source: impl Into<Box<dyn std::error::Error + Send + Sync + 'static>>) -> TierError {
    TierError::internal_from(TierKind::Process, what, source)
}

/// Maps a jail failure to the tier's error.
fn jail_error(err: JailError) -> TierError {
    match err {
        JailError::NotStarted { stage, errno, message } if stage == "lookup" || errno == libc::ENOENT => {
            TierError::ProgramNotFound { program: message }
        }
        JailError::NotStarted { message, .. } => TierError::ExecFailed { message },
        // A fork whose PID 1 could not rebuild the snapshot's upper layer (a disk limit too small for it, a tree
        // that is not one).
        JailError::Setup { stage, message } if stage == "restore upper layer" => {
            TierError::Snapshot(strata_core::SnapshotError::Io {
                path: PathBuf::from(snapshot::UPPER_FILE),
                source: std::io::Error::other(message),
            })
        }
        JailError::Ended => TierError::SessionEnded { reason: "the jail has ended".into() },
        JailError::ZygoteRefused(message) => {
            TierError::Unsupported { tier: TierKind::Process, what: format!("this job as a zygote: {message}") }
        }
        other => internal(other),
    }
}

impl Tier for ProcessTier {
    fn kind(&self) -> TierKind {
        TierKind::Process
    }

    fn run(&self, job: &Job, caps: &Capabilities, limits: &Limits, opts: ExecOptions) -> Result<Outcome, TierError> {
        opts.refuse_determinism(TierKind::Process, "process-tier jobs")?;
        let limits = opts.limits.as_ref().unwrap_or(limits);
        let image = self.root_image(caps)?;
        let _hold = self.hold(&image);
        let mut prepared = PreparedJob::new(job, caps, limits, &opts, &image)?;
        let spare = match caps.net {
            Net::Deny => self.take_spare(&self.jail_config(caps, limits, true, &image)?),
            _ => None,
        };
        let mut jail = match spare {
            Some(jail) => jail,
            None => self.start_jail(caps, limits, true, None, &image)?,
        };
        prepared.add_env(jail.egress_secret_env());
        let stdin = opts.stdin.as_deref().unwrap_or_default();
        let outcome = run_in(Runner::Jail(&mut jail), prepared, caps, limits, stdin, &opts);
        jail.close();
        outcome
    }

    fn start(&self, caps: &Capabilities, limits: &Limits) -> Result<Box<dyn Sandbox>, TierError> {
        Ok(Box::new(self.start_sandbox(caps, limits)?))
    }

    /// A fork of a snapshot with the capabilities and limits it was taken with (see [`snapshot`] for what a fork
    /// gets). A snapshot taken with secrets is refused here, since their values are never written to disk: fork
    /// it with [`ProcessTier::fork_with`].
    fn fork(&self, snapshot: &Snapshot) -> Result<Box<dyn Sandbox>, TierError> {
        Ok(Box::new(self.fork_recorded(snapshot)?))
    }
}

impl ProcessTier {
    /// [`Tier::start`], typed: a sandbox on the image `caps` names (or the tier's own).
    pub fn start_sandbox(&self, caps: &Capabilities, limits: &Limits) -> Result<ProcessSandbox, TierError> {
        let image = self.root_image(caps)?;
        self.start_on(image, caps, limits)
    }

    /// A sandbox on an explicit stack of layers, whatever [`Capabilities::image`] says: an image build's steps
    /// run on the layers made so far. Its snapshots record these layers.
    pub fn start_on(
        &self,
        image: RootImage,
        caps: &Capabilities,
        limits: &Limits,
    ) -> Result<ProcessSandbox, TierError> {
        if image.lowers.is_empty() || image.lowers.len() > strata_jail::proto::MAX_LOWERS {
            return Err(unsupported(&format!("an image of {} layers", image.lowers.len())));
        }
        let jail = self.start_jail(caps, limits, false, None, &image)?;
        ProcessSandbox::new(jail, caps.clone(), limits.clone(), self.snapshot_origin(None, image))
    }
}

/// Whether a failed user-namespace step failed for want of a file (a layer removed under the jail, a path that
/// vanished) rather than for want of a kernel feature: only the latter turns user namespaces off for the tier.
fn kernel_lacks_nothing(message: &str) -> bool {
    ["ENOENT", "ENOTDIR", "No such file", "Not a directory"].iter().any(|m| message.contains(m))
}

/// A sandbox's root filesystem: the image's layers (top first, each a host directory overlayfs takes as a lower
/// layer) and what its jobs take from it (environment, working directory, account).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RootImage {
    /// The layers, top first.
    pub lowers: Vec<PathBuf>,
    /// The defaults of its jobs.
    pub config: ImageConfig,
}

impl RootImage {
    /// The account a job runs as: the job's own, else the sandbox's, else the image's; `None` for root.
    fn user(&self, caps: &Capabilities, job: Option<&UserName>) -> Option<UserName> {
        let image = self.config.user.as_deref().and_then(|user| UserName::new(user).ok());
        job.or(caps.user.as_ref()).cloned().or(image).filter(|user| !user.is_root())
    }
}

/// A job translated for the jail.
struct PreparedJob {
    exec: Exec,
    program: Option<File>,
}

impl PreparedJob {
    /// `job` for the jail, as the user `opts` or `caps` name (the jail's root when neither does; that user's home
    /// is then its directory).
    fn new(
        job: &Job,
        caps: &Capabilities,
        limits: &Limits,
        opts: &ExecOptions,
        image: &RootImage,
    ) -> Result<PreparedJob, TierError> {
        let user = image.user(caps, opts.user.as_ref());
        let GuestCommand { argv, copy_in } = GuestCommand::new(job, TierKind::Process)?;
        let (program_copy, program) = copy_in.map(|copy| (copy.guest, copy.file)).unzip();
        let mut env: Vec<(String, String)> = BASE_ENV.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
        for (name, value) in &image.config.env {
            env.retain(|(k, _)| k != name);
            env.push((name.clone(), value.clone()));
        }
        if let Net::Allow(allowlist) = &caps.net {
            env.extend(strata_egress::proxy_env(EGRESS_PROXY_URL, allowlist));
        }
        for var in caps.guest_env() {
            env.retain(|(k, _)| *k != var.name);
            env.push((var.name.clone(), var.value.clone()));
        }
        let cpu_seconds = limits.cpu.as_secs().saturating_add(u64::from(limits.cpu.subsec_nanos() > 0)).max(1);
        let exec = Exec {
            argv,
            env,
            // Empty: the user's home.
            cwd: match (&image.config.workdir, &user) {
                (Some(workdir), _) => workdir.clone(),
                (None, Some(_)) => String::new(),
                (None, None) => WORKDIR.into(),
            },
            program_copy,
            nofile: u64::from(limits.files).max(16),
            // The cgroup's CPU accounting stops the job; RLIMIT_CPU is a per-process backstop a second later.
            cpu_seconds: cpu_seconds.saturating_add(1),
            cgroup_files: 0,
            tty: None,
            user: user.map(|user| user.as_str().to_owned()),
        };
        Ok(PreparedJob { exec, program })
    }

    /// Adds variables the jail decides (egress secrets' placeholders), over any of the same name.
    fn add_env(&mut self, vars: Vec<(String, String)>) {
        for (name, value) in vars {
            self.exec.env.retain(|(k, _)| *k != name);
            self.exec.env.push((name, value));
        }
    }
}

/// Where a prepared job runs: the jail's own connection, one job at a time, or a lane of its own beside others.
enum Runner<'a> {
    Jail(&'a mut Jail),
    Lane(&'a Lanes),
}

/// Runs a prepared job in a jail and assembles its outcome.
fn run_in(
    runner: Runner<'_>,
    job: PreparedJob,
    caps: &Capabilities,
    limits: &Limits,
    stdin: &[u8],
    opts: &ExecOptions,
) -> Result<Outcome, TierError> {
    let secrets = caps.secret_values();
    let stdout = OutputCapture::new(Stream::Stdout, limits.output.0, secrets.clone(), opts.sink.clone());
    let stderr = OutputCapture::new(Stream::Stderr, limits.output.0, secrets, opts.sink.clone());
    // A stream is the job's stdin itself: the jail gets its descriptor, and the caller writes while the job runs.
    let stdin_stream = opts.stdin_stream.as_ref().map(StdinStream::as_fd);
    let io = JobIo { stdin, stdin_stream, stdout: &stdout, stderr: &stderr, terminal: opts.terminal.as_ref() };
    let watch = JobWatch { wall: limits.wall, cpu: limits.cpu, cancel: opts.cancel.clone() };
    let (report, egress) = match runner {
        Runner::Jail(jail) => {
            let report = jail.exec(&job.exec, job.program, &io, &watch, &cgroup_limits(limits)).map_err(jail_error)?;
            (report, jail.drain_egress(EGRESS_SETTLE))
        }
        Runner::Lane(lanes) => {
            let cgroup = cgroup_limits(limits);
            let report = lanes.exec(&job.exec, job.program, &io, &watch, &cgroup).map_err(jail_error)?;
            (report, lanes.drain_egress(EGRESS_SETTLE))
        }
    };
    outcome(report, &stdout, &stderr, egress.into_entries())
}

/// The cgroup limits of a jail, or of a job, with `limits`.
fn cgroup_limits(limits: &Limits) -> CgroupLimits {
    CgroupLimits { memory: limits.memory.0, pids: u64::from(limits.pids) + JAIL_PROCESSES, cpus: limits.vcpus }
}

fn outcome(
    report: JobReport,
    stdout: &OutputCapture,
    stderr: &OutputCapture,
    (egress, egress_dropped): (Vec<EgressEntry>, u64),
) -> Result<Outcome, TierError> {
    let status = match report.end {
        JobEnd::Exited(code) => Status::Exited { code },
        JobEnd::Signaled(signal) => {
            Status::Trapped { message: format!("killed by signal {signal} ({})", signal_name(signal)) }
        }
        JobEnd::Limit(limit) => Status::LimitExceeded { limit },
        JobEnd::Cancelled => return Err(TierError::Cancelled),
        JobEnd::ZygoteReady => Status::Exited { code: 0 },
        JobEnd::JailLost => Status::Crashed { message: "the jail's init process died".into() },
    };
    let (out, err) = (stdout.finish(), stderr.finish());
    Ok(Outcome {
        truncated: Truncated { stdout: out.truncated, stderr: err.truncated, egress: egress_dropped },
        usage: Usage {
            wall: report.wall,
            cpu: report.cpu,
            fuel: None,
            peak_memory: report.peak_memory,
            stdout_bytes: out.written,
            stderr_bytes: err.written,
        },
        stdout: out.bytes,
        stderr: err.bytes,
        egress,
        ..Outcome::new(TierKind::Process, status)
    })
}

fn signal_name(signal: i32) -> &'static str {
    nix::sys::signal::Signal::try_from(signal).map(|s| s.as_str()).unwrap_or("unknown")
}
