//! Snapshots and forks of process-tier sandboxes.
//!
//! A snapshot of a [`ProcessSandbox`] is its filesystem: the overlay's upper layer (everything the jobs wrote,
//! `/tmp` included — it is part of the overlay, not a tmpfs of its own — and whiteouts for what they deleted from
//! the image), stored as one [`strata_jail::tree`] file, `upper.tree`, beside the manifest, whose meta records what
//! rebuilding the jail needs: the image it stood on, the capabilities (grants are host paths, recorded as such;
//! secrets and egress secrets by name only, their values are never written to disk), the limits and the user-namespace mapping the
//! owners were read through. `persists` is `["filesystem"]`: no process, no memory, no open descriptor is kept
//! (processes a job left running are paused while the layer is read, and go on in the sandbox afterwards, but not
//! in forks).
//!
//! A fork is a fresh jail — new namespaces, cgroup, tmpfs — whose PID 1 restores the tree into its empty upper
//! directory before it mounts the overlay: each fork has its own copy, so forks are independent of each other and
//! of the snapshot directory (which is only ever read). Randomness is the kernel's, so fresh in every fork; the
//! clock is the host's, so it only moves forward; the identity is the new jail's (PIDs, and a new
//! `/etc/machine-id` when the setup job had made one). The fork's capabilities are decided when it is made:
//! [`Tier::fork`](strata_core::Tier::fork) re-applies the recorded ones (grants re-resolved on the host, so a
//! grant that vanished is refused), [`ProcessTier::fork_with`] applies the caller's own — the way to fork a
//! snapshot taken with secrets, or to give a fork other grants or limits. Either way the snapshot is re-opened
//! with the tier's [`SnapshotTrust`] first: recorded capabilities are read only from a manifest sealed with the
//! host's key, and the layer the fork's PID 1 restores is the file the snapshot was verified with, handed over
//! open (never a path it would open again).
//!
//! Live forks that share memory — a zygote held stopped and `fork()`ed into fresh namespaces per job — are
//! [`crate::zygote`]: they live as long as the process that holds the zygote, and are not written to disk.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};

use serde_json::{Value, json};
use strata_core::{Capabilities, Limits, Persisted, Snapshot, SnapshotTrust, SnapshotWriter, TierError, TierKind};
use strata_jail::tree::{self, TreeError};

use crate::jail::Jail;
use crate::{ProcessSandbox, ProcessTier, internal, jail_error};

/// The upper layer's file in a snapshot directory.
pub const UPPER_FILE: &str = "upper.tree";

/// What the manifest says about processes.
const PROCESSES: &str = "not kept: a fork starts with no process but its jail's PID 1; processes the setup job \
                         left running are paused while the filesystem is read and go on only in the sandbox";

/// What the manifest says about memory.
const MEMORY: &str = "not kept: the process tier stores the filesystem only";

fn tree_error(err: TreeError) -> TierError {
    match err {
        TreeError::Unsupported { path, reason } => {
            TierError::Unsupported { tier: TierKind::Process, what: format!("snapshotting /{path}: {reason}") }
        }
        other => internal(format!("storing the upper layer: {other}")),
    }
}

fn invalid_meta(dir: &Path, message: impl Into<String>) -> TierError {
    TierError::Snapshot(strata_core::SnapshotError::InvalidManifest { dir: dir.to_owned(), message: message.into() })
}

/// What a sandbox's snapshots record besides its capabilities and limits, and what seals them.
#[derive(Debug, Clone)]
pub(crate) struct Origin {
    /// The image under the overlay (a fork must stand on the same one).
    pub(crate) image: crate::RootImage,
    /// The snapshot the sandbox was forked from.
    pub(crate) parent: Option<String>,
    /// The tier's trust: the key its snapshots are sealed with.
    pub(crate) trust: SnapshotTrust,
    /// Its image's layers, held against a prune for the sandbox's life.
    pub(crate) _hold: Option<std::sync::Arc<strata_image_store::LayerHold>>,
}

impl ProcessTier {
    /// The origin of a sandbox of this tier forked from `parent` (or not).
    pub(crate) fn snapshot_origin(&self, parent: Option<String>, image: crate::RootImage) -> Origin {
        let _hold = self.hold(&image).map(std::sync::Arc::new);
        Origin { image, parent, trust: self.config.snapshots.clone(), _hold }
    }
}

/// Writes a snapshot of `jail`'s filesystem to `destination`.
pub(crate) fn take(
    jail: &mut Jail,
    destination: &Path,
    caps: &Capabilities,
    limits: &Limits,
    origin: &Origin,
) -> Result<Snapshot, TierError> {
    let (lowers, parent) = (&origin.image.lowers, origin.parent.clone());
    let writer = SnapshotWriter::create(destination, &origin.trust)?;
    let upper = jail.open_upper().map_err(jail_error)?;
    let id_map = jail.id_map();
    let machine_id =
        jail.read_file("/etc/machine-id", 4096).map(|id| id.iter().any(|b| !b.is_ascii_whitespace())).unwrap_or(false);
    let path = writer.dir().join(UPPER_FILE);
    let file = File::create(&path).map_err(|source| TierError::Storage {
        what: "snapshot upper layer",
        path: path.clone(),
        source,
    })?;
    let stopped = jail.pause();
    let written = {
        let mut out = BufWriter::with_capacity(256 * 1024, &file);
        tree::write_tree(upper.as_fd(), &mut out, id_map).and_then(|stats| {
            out.flush()?;
            Ok(stats)
        })
    };
    jail.resume(stopped);
    let stats = written.map_err(tree_error)?;
    drop(file);

    let mut recorded = caps.clone();
    let secret_names: Vec<String> = recorded.secrets.drain(..).map(|s| s.name).collect();
    let egress_secret_names: Vec<String> = recorded.egress_secrets.drain(..).map(|s| s.name).collect();
    let skipped: Vec<Value> =
        stats.skipped.iter().map(|s| json!({"path": s.path, "what": s.what, "reason": s.reason})).collect();
    let meta = json!({
        "upper": {
            "file": UPPER_FILE,
            "format": tree::FORMAT,
            "entries": stats.entries,
            "data_bytes": stats.data_bytes,
            "whiteouts": stats.whiteouts,
            "skipped": skipped,
            "skipped_count": stats.skipped_count,
            "owners": "as the jail sees them (0 is the jail's root)",
        },
        "jail": {
            "lowers": lowers,
            "user_namespace": id_map.map(|m| json!({"base": m.base, "count": m.count})),
        },
        "caps": recorded,
        "secret_names": secret_names,
        "egress_secret_names": egress_secret_names,
        "limits": limits,
        "machine_id": if machine_id { "regenerated in every fork" } else { "none" },
        "processes": PROCESSES,
        "memory": MEMORY,
    });
    Ok(writer.commit(TierKind::Process, parent, vec![Persisted::Filesystem], meta)?)
}

/// What a fork needs from a snapshot's manifest.
#[derive(Debug)]
struct ForkPlan {
    snapshot: Snapshot,
    caps: Capabilities,
    limits: Limits,
    secret_names: Vec<String>,
    machine_id: bool,
    image: crate::RootImage,
}

impl ForkPlan {
    /// Re-opens the snapshot with the tier's trust (the same sealed manifest; its files hashed again only when
    /// one's identity, size or times moved since it was verified: forking a large snapshot many times reads it
    /// once) and reads its meta.
    fn read(tier: &ProcessTier, snapshot: &Snapshot) -> Result<ForkPlan, TierError> {
        let snapshot = tier.config.snapshots.reopen(snapshot)?;
        if snapshot.tier != TierKind::Process {
            return Err(strata_core::SnapshotError::WrongTier {
                dir: snapshot.dir.clone(),
                expected: TierKind::Process,
                found: snapshot.tier,
            }
            .into());
        }
        let dir = snapshot.dir.clone();
        let meta = &snapshot.manifest.meta;
        if !snapshot.manifest.persists.contains(&Persisted::Filesystem) {
            return Err(invalid_meta(&dir, "a process snapshot without its filesystem"));
        }
        let format = meta.pointer("/upper/format").and_then(Value::as_str);
        if format != Some(tree::FORMAT) {
            return Err(invalid_meta(
                &dir,
                format!("upper layer format {format:?}, this build reads {}", tree::FORMAT),
            ));
        }
        if meta.pointer("/upper/file").and_then(Value::as_str) != Some(UPPER_FILE)
            || !snapshot.manifest.files.iter().any(|f| f.path == UPPER_FILE)
        {
            return Err(invalid_meta(&dir, format!("no {UPPER_FILE}")));
        }
        let caps: Capabilities = serde_json::from_value(meta.get("caps").cloned().unwrap_or(Value::Null))
            .map_err(|e| invalid_meta(&dir, format!("caps: {e}")))?;
        let lowers: Option<Vec<PathBuf>> =
            meta.pointer("/jail/lowers").cloned().and_then(|v| serde_json::from_value(v).ok());
        let image = tier.root_image(&caps)?;
        if lowers.as_ref() != Some(&image.lowers) {
            return Err(TierError::Unsupported {
                tier: TierKind::Process,
                what: format!(
                    "forking a snapshot taken over other image layers ({:?}; its image now has {:?}: rebuilt or \
                     removed since)",
                    lowers.unwrap_or_default(),
                    image.lowers
                ),
            });
        }
        let limits: Limits = serde_json::from_value(meta.get("limits").cloned().unwrap_or(Value::Null))
            .map_err(|e| invalid_meta(&dir, format!("limits: {e}")))?;
        let names = |key: &str| -> Vec<String> {
            meta.get(key)
                .and_then(Value::as_array)
                .map(|names| names.iter().filter_map(Value::as_str).map(str::to_owned).collect())
                .unwrap_or_default()
        };
        // Egress secrets are refused alike: neither value was written down.
        let secret_names = [names("secret_names"), names("egress_secret_names")].concat();
        let machine_id = meta.get("machine_id").and_then(Value::as_str) == Some("regenerated in every fork");
        Ok(ForkPlan { snapshot, caps, limits, secret_names, machine_id, image })
    }
}

impl ProcessTier {
    /// A fork of `snapshot` with the capabilities and limits it was taken with (its grants re-resolved on the
    /// host). Refused when the snapshot was taken with secrets, whose values were not stored.
    pub fn fork_recorded(&self, snapshot: &Snapshot) -> Result<ProcessSandbox, TierError> {
        let plan = ForkPlan::read(self, snapshot)?;
        if !plan.secret_names.is_empty() {
            return Err(TierError::Unsupported {
                tier: TierKind::Process,
                what: format!(
                    "forking a snapshot taken with secrets ({}) without them: their values are never written to \
                     disk; fork it with ProcessTier::fork_with and the capabilities",
                    plan.secret_names.join(", ")
                ),
            });
        }
        let (caps, limits) = (plan.caps.clone(), plan.limits.clone());
        self.fork_plan(plan, &caps, &limits)
    }

    /// A fork of `snapshot` with the caller's capabilities and limits instead of the recorded ones (the fork's
    /// filesystem is the snapshot's either way; `limits.disk` must hold it).
    pub fn fork_with(
        &self,
        snapshot: &Snapshot,
        caps: &Capabilities,
        limits: &Limits,
    ) -> Result<ProcessSandbox, TierError> {
        let plan = ForkPlan::read(self, snapshot)?;
        self.fork_plan(plan, caps, limits)
    }

    fn fork_plan(&self, plan: ForkPlan, caps: &Capabilities, limits: &Limits) -> Result<ProcessSandbox, TierError> {
        let data = plan.snapshot.manifest.meta.pointer("/upper/data_bytes").and_then(Value::as_u64).unwrap_or(0);
        if data > limits.disk.0 {
            return Err(TierError::Unsupported {
                tier: TierKind::Process,
                what: format!(
                    "forking a snapshot holding {data} bytes of files into a disk limit of {} bytes",
                    limits.disk.0
                ),
            });
        }
        let upper = std::sync::Arc::new(plan.snapshot.open_file(UPPER_FILE)?);
        // The fork's filesystem is the snapshot's: its image too, whatever the caller's capabilities name.
        let caps = &Capabilities { image: plan.caps.image.clone(), ..caps.clone() };
        let mut jail = self.start_jail(caps, limits, false, Some(upper), &plan.image)?;
        if plan.machine_id {
            let id = fresh_machine_id()?;
            jail.write_file("/etc/machine-id", id.as_bytes(), 0o444).map_err(jail_error)?;
        }
        let origin = self.snapshot_origin(Some(plan.snapshot.manifest.id.clone()), plan.image);
        ProcessSandbox::new(jail, caps.clone(), limits.clone(), origin)
    }
}

/// 32 random hex digits and a newline, as `/etc/machine-id` holds.
fn fresh_machine_id() -> Result<String, TierError> {
    let mut bytes = [0u8; 16];
    File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut bytes))
        .map_err(|source| TierError::Storage { what: "randomness", path: "/dev/urandom".into(), source })?;
    Ok(format!("{}\n", bytes.iter().map(|b| format!("{b:02x}")).collect::<String>()))
}
