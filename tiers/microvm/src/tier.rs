//! The microVM tier: a one-shot job boots a fresh microVM ([`Microvm`]), runs in it through the guest agent and
//! ends with it; a sandbox ([`MicrovmSandbox`], from [`Tier::start`]) is a microVM booted once that runs jobs in
//! turn ([`crate::session`]: the one-shot path is a session of one job); a snapshot saves a sandbox's whole VM and
//! [`Tier::fork`] starts a new one from it.
//!
//! Limits: `memory` is the guest's RAM (the guest's OOM killer ending the job is `limit_exceeded`/`memory`),
//! `vcpus` its vCPUs, `wall` covers boot and job for a one-shot job (the job is killed, then the VM) and each job
//! alone in a sandbox (which boots within [`BOOT_TIMEOUT`]), `cpu` is the job's rusage checked when it ends plus
//! `RLIMIT_CPU` in the guest, `output` is capped by the agent and the host capture, `files` is `RLIMIT_NOFILE` in
//! the guest, `disk` bounds the grants' files both ways.
//!
//! Grants are copied in when the VM starts and read-write ones copied back after each job that exits with 0
//! ([`crate::grants`]: checked listings, file by file with atomic replace, nothing applied when the guest's answer
//! fails a check, which ends the job as `crashed`); read-only grants are never copied back.
//!
//! **Snapshots** ([`Sandbox::snapshot`] of a [`MicrovmSandbox`]): the agent quiesces (refused while a job runs;
//! it syncs the guest's filesystems), the vCPUs are paused at a safe point, the whole VM — vCPU, irqchip, clock and
//! device state and guest RAM, which holds the guest's files (its tmpfs overlay) and every process a job left
//! running — is saved by [`VmSnapshot::save_with`] into a snapshot directory of tier `microvm`, and the VM
//! resumes. The manifest's meta records the capabilities (secrets by name only), the limits and the images the VM
//! runs (kernel, initramfs, root disk: path and sha256). **Forks** ([`Tier::fork`]): the images must be this
//! tier's, byte for byte; the memory file is mapped copy-on-write into a new monitor with a new vsock socket and a
//! new guest CID; the guest's vsock connections were reset (as Firecracker does), so the host reconnects to the
//! agent, which accepts a new connection as it does after any; the agent then reseeds the guest's randomness from
//! the host's `getrandom` and sets its clock to the host's ([`AgentClient::after_restore`]). The fork runs with the
//! recorded capabilities and limits — read only from a manifest sealed with the tier's key, re-opened when the fork
//! is made ([`strata_core::SnapshotTrust::reopen`]) — and a snapshot taken with secrets is refused by
//! [`Tier::fork`] (their values were never written) and forked with [`MicrovmTier::fork_with`] and the
//! capabilities.
//!
//! Network egress: [`crate::session`] (a host egress proxy per sandbox on the vsock socket's `_1028` path, the
//! agent's forwarder on the guest's `127.0.0.1:3128`).
//!
//! Not built yet on this tier: host tools — a typed `unsupported` error.
//!
//! It needs hardware KVM; the engine only builds it where `strata doctor` finds it.

use std::collections::HashMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::{Value, json};
use strata_core::{
    Capabilities, ExecOptions, Job, LimitKind, Limits, Outcome, Sandbox, Snapshot, Status, Tier, TierError, TierKind,
};
use strata_guest_proto::{AgentClient, Entropy};

use crate::builder::{BuildError, GUEST_CID, Microvm, MicrovmConfig};
use crate::session::{
    AgentHost, EgressPath, PreparedJob, Session, ended, internal, internal_from, over_disk_limit, scan_grants,
    unsupported,
};
use crate::snapshot::{SnapshotExtra, VmSnapshot, VmSnapshotError};
use crate::vstate::vcpu::cpuid::CpuidProfile;

/// How long a sandbox's VM has to boot and answer.
pub const BOOT_TIMEOUT: Duration = Duration::from_secs(30);

/// How long a fork's agent has to answer again.
pub const RECONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Settings of the microVM tier.
#[derive(Debug, Clone)]
pub struct MicrovmTierConfig {
    /// The guest kernel (ELF vmlinux).
    pub kernel: PathBuf,
    /// The initramfs with the agent.
    pub initramfs: PathBuf,
    /// The Debian disk (squashfs); jobs run on the initramfs's busybox without it.
    pub root_disk: Option<PathBuf>,
    /// A directory of Strata's own for the VMs' sockets.
    pub run_dir: PathBuf,
    /// CPUID mask.
    pub cpuid: CpuidProfile,
    /// What seals this tier's snapshots and opens them for forks.
    pub snapshots: strata_core::SnapshotTrust,
}

/// A file's identity, size and times: unchanged stamps mean unchanged contents (images are replaced, never edited).
type Stamp = (u64, u64, u64, i64, i64, i64, i64);

/// The microVM tier.
#[derive(Debug)]
pub struct MicrovmTier {
    config: MicrovmTierConfig,
    /// Where the images [`Capabilities::image`] names are ([`MicrovmTier::with_images`]); their disks are built
    /// on first use.
    images: Option<strata_image_store::ImageStore>,
    /// sha256 of the images, by path, with the stamp they were hashed at.
    hashes: Mutex<HashMap<PathBuf, (Stamp, String)>>,
}

/// A sandbox on the microVM tier: a booted (or forked) microVM running jobs in turn.
pub type MicrovmSandbox = Session<MicrovmGuest>;

/// A microVM as the home of a session's agent, with the images it runs (recorded in its snapshots).
#[derive(Debug)]
pub struct MicrovmGuest {
    vm: Microvm,
    images: Value,
    /// What its snapshots are sealed with.
    snapshots: strata_core::SnapshotTrust,
}

impl MicrovmGuest {
    /// The VM.
    pub fn vm(&self) -> &Microvm {
        &self.vm
    }
}

impl AgentHost for MicrovmGuest {
    fn has_stopped(&self) -> bool {
        self.vm.has_stopped()
    }

    fn console_tail(&self) -> String {
        self.vm.console_tail(20)
    }

    fn egress_path(&self) -> Option<EgressPath> {
        let mut socket = self.vm.vsock_socket().as_os_str().to_owned();
        socket.push(format!("_{}", strata_guest_proto::EGRESS_PORT));
        Some(EgressPath { socket: socket.into(), listen_port: strata_guest_proto::EGRESS_LISTEN_PORT })
    }

    fn dial_socket(&self, port: u32) -> Option<PathBuf> {
        let mut socket = self.vm.vsock_socket().as_os_str().to_owned();
        socket.push(format!("_{port}"));
        Some(socket.into())
    }

    fn snapshot(
        &mut self,
        destination: &Path,
        parent: Option<String>,
        mut extra: SnapshotExtra,
    ) -> Result<Snapshot, TierError> {
        extra.meta.insert("images".into(), self.images.clone());
        let snapshot = self.vm.snapshot(destination, parent, extra, &self.snapshots).map_err(snapshot_error)?;
        Ok(snapshot.snapshot().clone())
    }

    fn shut_down(self) {
        self.vm.shutdown();
    }
}

fn snapshot_error(err: VmSnapshotError) -> TierError {
    match err {
        VmSnapshotError::Store(err) => TierError::Snapshot(err),
        other => internal(strata_guest_proto::error_chain(&other)),
    }
}

fn stamp(path: &Path) -> std::io::Result<Stamp> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(path)?;
    Ok((m.dev(), m.ino(), m.len(), m.mtime(), m.mtime_nsec(), m.ctime(), m.ctime_nsec()))
}

impl MicrovmTier {
    /// The tier with these images.
    pub fn new(config: MicrovmTierConfig) -> MicrovmTier {
        // The directories of monitors whose engine was killed.
        crate::monitor::remove_stale(&config.run_dir);
        MicrovmTier { config, images: None, hashes: Mutex::new(HashMap::new()) }
    }

    /// sha256 of an image, hashed once per version of the file.
    fn sha256(&self, path: &Path) -> Result<String, TierError> {
        let read_error = |source| TierError::ReadInput { path: path.to_owned(), source };
        let now = stamp(path).map_err(read_error)?;
        let mut hashes = self.hashes.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some((at, sum)) = hashes.get(path)
            && *at == now
        {
            return Ok(sum.clone());
        }
        let sum = strata_image_util::sha256_file(path).map_err(read_error)?;
        hashes.insert(path.to_owned(), (now, sum.clone()));
        Ok(sum)
    }

    /// Lets sandboxes name images of `store`: each boots from its image's squashfs disk (the layers flattened),
    /// with the image's environment.
    pub fn with_images(mut self, store: strata_image_store::ImageStore) -> MicrovmTier {
        self.images = Some(store);
        self
    }

    /// The root disk a sandbox with `caps` boots, and `caps` with its image's environment under its own: the
    /// tier's Debian disk, or the disk of the image `caps` names. An image whose account is not root is refused
    /// (the microVM's jobs run as the guest's root).
    fn root_disk_for(&self, caps: &Capabilities) -> Result<(Option<PathBuf>, Capabilities), TierError> {
        let Some(name) = &caps.image else {
            return Ok((self.config.root_disk.clone(), caps.clone()));
        };
        let store = self.images.as_ref().ok_or_else(|| unsupported("images (this tier has no image store)"))?;
        let image = store.get(name).map_err(|err| match err {
            strata_image_store::StoreError::NotFound(image) => TierError::ImageNotFound { image },
            other => internal(other),
        })?;
        if image.config.user.as_deref().is_some_and(|user| user != "root") {
            return Err(unsupported(&format!(
                "the image {name}'s account {:?} (microVM jobs run as the guest's root)",
                image.config.user.as_deref().unwrap_or_default()
            )));
        }
        let disk = store.ensure_disk(name, &|line| log::info!("{line}")).map_err(internal)?;
        let mut caps = caps.clone();
        let mut env: Vec<strata_core::EnvVar> = Vec::new();
        for (key, value) in &image.config.env {
            if !caps.env.iter().any(|var| &var.name == key) {
                env.push(strata_core::EnvVar { name: key.clone(), value: value.clone() });
            }
        }
        env.append(&mut caps.env);
        caps.env = env;
        Ok((Some(disk.path), caps))
    }

    /// The images this tier boots with `root_disk`, as a snapshot's meta records them.
    fn images(&self, root_disk: Option<&Path>) -> Result<Value, TierError> {
        let image =
            |path: &Path| -> Result<Value, TierError> { Ok(json!({"path": path, "sha256": self.sha256(path)?})) };
        let root_disk = match root_disk {
            Some(disk) => image(disk)?,
            None => Value::Null,
        };
        Ok(json!({
            "kernel": image(&self.config.kernel)?,
            "initramfs": image(&self.config.initramfs)?,
            "root_disk": root_disk,
        }))
    }

    fn check_caps(caps: &Capabilities) -> Result<(), TierError> {
        if !caps.tools.is_empty() {
            return Err(unsupported("host tools"));
        }
        Ok(())
    }

    fn vm_config(&self, limits: &Limits, root_disk: Option<PathBuf>) -> MicrovmConfig {
        MicrovmConfig {
            kernel: self.config.kernel.clone(),
            initramfs: self.config.initramfs.clone(),
            root_disk,
            memory_bytes: limits.memory.0.max(64 << 20),
            vcpus: u8::try_from(limits.vcpus.clamp(1, 32)).unwrap_or(1),
            cpuid: self.config.cpuid,
            run_dir: self.config.run_dir.clone(),
        }
    }

    /// Boots a VM, reaches its agent within `timeout` and copies the grants in: the session, or how the start
    /// ended when the guest never got there.
    fn boot_session(
        &self,
        caps: &Capabilities,
        limits: &Limits,
        timeout: Duration,
        started: Instant,
    ) -> Result<Result<MicrovmSandbox, Outcome>, TierError> {
        Self::check_caps(caps)?;
        let (root_disk, caps) = &self.root_disk_for(caps)?;
        let Some(trees) = scan_grants(caps, limits)? else {
            return Ok(Err(ended(Status::LimitExceeded { limit: LimitKind::Disk }, started)));
        };
        let images = self.images(root_disk.as_deref())?;
        let mut vm = Microvm::boot(&self.vm_config(limits, root_disk.clone())).map_err(internal)?;
        let client = match vm.connect_agent(timeout) {
            Ok(client) => client,
            Err(BuildError::AgentTimeout { .. }) => {
                return Ok(Err(ended(Status::LimitExceeded { limit: LimitKind::Wall }, started)));
            }
            Err(BuildError::GuestDied { exit, console }) => {
                let message = format!("the guest stopped before its agent was ready ({exit})");
                let mut outcome = ended(Status::Crashed { message }, started);
                outcome.stderr = console.into_bytes();
                return Ok(Err(outcome));
            }
            Err(err) => return Err(internal(err)),
        };
        let guest = MicrovmGuest { vm, images, snapshots: self.config.snapshots.clone() };
        Session::with_trees(guest, client, caps, limits, &trees).map(Ok)
    }

    /// A fork of `snapshot` with the caller's capabilities and limits instead of the recorded ones (the guest's
    /// memory, vCPUs and files are the snapshot's either way; the grants' guest copies too). The way to fork a
    /// snapshot taken with secrets.
    pub fn fork_with(
        &self,
        snapshot: &Snapshot,
        caps: &Capabilities,
        limits: &Limits,
    ) -> Result<MicrovmSandbox, TierError> {
        caps.refuse_egress_secrets(TierKind::Microvm)?;
        let snapshot = &self.config.snapshots.reopen(snapshot)?;
        let plan = ForkPlan::read(snapshot)?;
        self.fork_plan(snapshot, &plan, caps, limits)
    }

    fn fork_plan(
        &self,
        snapshot: &Snapshot,
        plan: &ForkPlan,
        caps: &Capabilities,
        limits: &Limits,
    ) -> Result<MicrovmSandbox, TierError> {
        Self::check_caps(caps)?;
        for grant in &caps.grants {
            if !grant.host.is_dir() {
                return Err(strata_core::CapsError::GrantNotFound(grant.host.clone()).into());
            }
        }
        let (root_disk, _) = self.root_disk_for(caps)?;
        let images = self.images(root_disk.as_deref())?;
        if images != plan.images {
            return Err(unsupported(&format!(
                "forking a snapshot taken over other images ({}; this tier runs {})",
                plan.images, images
            )));
        }
        let vm_snapshot = VmSnapshot::from_verified(snapshot.clone()).map_err(snapshot_error)?;
        let vm =
            Microvm::fork(&vm_snapshot, &self.config.run_dir, fresh_guest_cid()?, root_disk).map_err(snapshot_error)?;
        let mut guest = MicrovmGuest { vm, images, snapshots: self.config.snapshots.clone() };
        let client = guest.vm.connect_agent(RECONNECT_TIMEOUT).map_err(internal)?;
        after_restore(&client)?;
        let parent = Some(snapshot.manifest.id.clone());
        Session::resumed(guest, client, caps, limits, parent)
    }
}

/// Tells a restored guest's agent to reseed its randomness (64 bytes of the host's `getrandom`) and to set its
/// clock to the host's.
pub fn after_restore(client: &AgentClient) -> Result<(), TierError> {
    let mut entropy = [0u8; Entropy::LEN];
    host_random(&mut entropy)?;
    let now = SystemTime::now().duration_since(UNIX_EPOCH).map_err(internal)?;
    let now = u64::try_from(now.as_nanos()).map_err(internal)?;
    client.after_restore(entropy, now).map_err(|err| internal_from("reseeding the restored guest", err))
}

fn host_random(buf: &mut [u8]) -> Result<(), TierError> {
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(buf))
        .map_err(|err| internal_from("reading host randomness", err))
}

/// A guest CID for a fork: random, above the reserved ones (0-2) and the booted VMs' [`GUEST_CID`], below
/// `VMADDR_CID_ANY`.
fn fresh_guest_cid() -> Result<u64, TierError> {
    let mut bytes = [0u8; 4];
    host_random(&mut bytes)?;
    let span = u64::from(u32::MAX - 1) - (GUEST_CID + 1);
    Ok(GUEST_CID + 1 + u64::from(u32::from_le_bytes(bytes)) % span)
}

/// What a fork needs from a snapshot's meta.
#[derive(Debug)]
struct ForkPlan {
    caps: Capabilities,
    limits: Limits,
    secret_names: Vec<String>,
    images: Value,
}

fn invalid_meta(snapshot: &Snapshot, message: impl Into<String>) -> TierError {
    TierError::Snapshot(strata_core::SnapshotError::InvalidManifest {
        dir: snapshot.dir.clone(),
        message: message.into(),
    })
}

impl ForkPlan {
    fn read(snapshot: &Snapshot) -> Result<ForkPlan, TierError> {
        if snapshot.manifest.tier != TierKind::Microvm {
            return Err(strata_core::SnapshotError::WrongTier {
                dir: snapshot.dir.clone(),
                expected: TierKind::Microvm,
                found: snapshot.manifest.tier,
            }
            .into());
        }
        let meta = &snapshot.manifest.meta;
        let caps: Capabilities = serde_json::from_value(meta.get("caps").cloned().unwrap_or(Value::Null))
            .map_err(|e| invalid_meta(snapshot, format!("caps: {e}")))?;
        let limits: Limits = serde_json::from_value(meta.get("limits").cloned().unwrap_or(Value::Null))
            .map_err(|e| invalid_meta(snapshot, format!("limits: {e}")))?;
        let secret_names = match meta.get("secret_names") {
            Some(Value::Array(names)) => names
                .iter()
                .map(|n| n.as_str().map(str::to_owned))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| invalid_meta(snapshot, "secret_names holds a non-string"))?,
            _ => return Err(invalid_meta(snapshot, "no secret_names list")),
        };
        let images = meta.get("images").cloned().ok_or_else(|| invalid_meta(snapshot, "no images"))?;
        Ok(ForkPlan { caps, limits, secret_names, images })
    }
}

impl Tier for MicrovmTier {
    fn kind(&self) -> TierKind {
        TierKind::Microvm
    }

    fn run(&self, job: &Job, caps: &Capabilities, limits: &Limits, opts: ExecOptions) -> Result<Outcome, TierError> {
        opts.refuse_determinism(TierKind::Microvm, "microVM jobs")?;
        opts.refuse_user(TierKind::Microvm)?;
        caps.refuse_user(TierKind::Microvm)?;
        caps.refuse_egress_secrets(TierKind::Microvm)?;
        let limits = opts.limits.as_ref().unwrap_or(limits);
        let started = Instant::now();
        let prepared = PreparedJob::new(job)?;
        let session = match self.boot_session(caps, limits, limits.wall, started)? {
            Ok(session) => session,
            Err(outcome) => return Ok(outcome),
        };
        let outcome = session.exec_prepared(prepared, &opts, started);
        session.close()?;
        outcome
    }

    fn start(&self, caps: &Capabilities, limits: &Limits) -> Result<Box<dyn Sandbox>, TierError> {
        caps.refuse_user(TierKind::Microvm)?;
        caps.refuse_egress_secrets(TierKind::Microvm)?;
        match self.boot_session(caps, limits, BOOT_TIMEOUT, Instant::now())? {
            Ok(session) => Ok(Box::new(session)),
            Err(outcome) => Err(match outcome.status {
                Status::LimitExceeded { limit: LimitKind::Disk } => over_disk_limit(limits),
                Status::LimitExceeded { .. } => {
                    internal(format!("the guest agent did not answer within {BOOT_TIMEOUT:?}"))
                }
                Status::Crashed { message } => {
                    internal(format!("{message}; console:\n{}", String::from_utf8_lossy(&outcome.stderr)))
                }
                other => internal(format!("the microVM did not start: {other:?}")),
            }),
        }
    }

    fn fork(&self, snapshot: &Snapshot) -> Result<Box<dyn Sandbox>, TierError> {
        // The capabilities below come from a manifest sealed with this tier's key, as the directory holds it now.
        let snapshot = &self.config.snapshots.reopen(snapshot)?;
        let plan = ForkPlan::read(snapshot)?;
        if !plan.secret_names.is_empty() {
            return Err(unsupported(&format!(
                "forking a snapshot taken with secrets ({}) without them: their values are never written to disk; \
                 fork it with MicrovmTier::fork_with and the capabilities",
                plan.secret_names.join(", ")
            )));
        }
        let (caps, limits) = (plan.caps.clone(), plan.limits.clone());
        Ok(Box::new(self.fork_plan(snapshot, &plan, &caps, &limits)?))
    }
}
