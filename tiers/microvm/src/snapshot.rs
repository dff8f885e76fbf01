//! microVM snapshots on disk: a machine saved into a sealed snapshot directory, opened and verified again, and
//! restored or forked from it.
//!
//! ```text
//! let mut machine = Machine::new(vm, memory, vcpus, devices);   // a VM the monitor built
//! machine.resume()?;                                             // vCPU threads run the guest
//! machine.pause()?;                                              // kicked out of KVM_RUN, pending I/O completed
//! let snap = VmSnapshot::save(&mut machine, dest, None, &trust)?;
//! let snap = VmSnapshot::open(dest, &trust)?;                    // seal, sha256 of every file, then the state checked
//! let again = snap.restore(RestoreArgs::default())?;             // RAM copied into a fresh memfd
//! let fork = snap.fork(RestoreArgs { guest_cid: Some(7), ..Default::default() })?; // RAM mapped MAP_PRIVATE
//! ```
//!
//! What the files hold, and how a machine is rebuilt from them, is the monitor's ([`strata_vmm::persist`]); this
//! module is the directory around them. It is strata-core's ([`strata_core::SnapshotWriter`]): written atomically
//! under a manifest with every file's sha256, sealed with the host's key ([`SnapshotTrust`]), which
//! [`VmSnapshot::open`] verifies; the state file is parsed from the bytes the manifest sealed (read and checked in
//! one pass, [`Snapshot::read_file`]) and the memory mapped or copied is the memory file's private copy
//! ([`Snapshot::private_copy`]: an unnamed file or a sealed memfd, checked against the manifest as it was filled,
//! which no other process can shrink or write), never the file or a path opened again. The host's key never
//! reaches a monitor: a monitor process writes the memory file into a descriptor it is handed and returns the
//! state; the engine seals them.
//!
//! **Restore and fork**: [`VmSnapshot::restore`] copies RAM into a fresh memfd: the machine owns its memory like a
//! booted one. [`VmSnapshot::fork`] maps the private copy `MAP_PRIVATE`: pages are shared with every other fork
//! until the guest writes them, so forks are cheap and independent, and whatever is done to the snapshot's files
//! while forks live reaches none of them (a mapped file truncated under a fork would raise `SIGBUS` in the
//! monitor). A booted Linux VM runs in a monitor process of its own ([`crate::builder::Microvm`]), which saves
//! itself the same way and forks by handing a new monitor the private copy.

use std::fs::File;
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use strata_core::{Persisted, Snapshot, SnapshotError, SnapshotTrust, SnapshotWriter, TierKind};
use strata_vmm::machine::{Machine, MachineError};
use strata_vmm::persist::{
    MAX_STATE_BYTES, MEMORY_FILE, MicrovmState, RestoreArgs, STATE_FILE, STATE_HEADER_LEN, STATE_VERSION,
    VirtioDeviceState,
};
use strata_vmm::vstate::memory::GuestMemory;

/// Why a snapshot could not be taken, opened, restored or forked.
#[derive(Debug, thiserror::Error)]
pub enum VmSnapshotError {
    /// The snapshot store refused the directory (missing file, checksum, manifest) or could not write it.
    #[error(transparent)]
    Store(#[from] SnapshotError),
    /// The machine could not be saved or rebuilt, or the state file was refused.
    #[error(transparent)]
    Machine(#[from] MachineError),
    /// The monitor process failed to save or restore the machine, or died.
    #[error(transparent)]
    Monitor(#[from] crate::monitor::MonitorError),
    /// The snapshot's manifest lacks one of our files.
    #[error("the snapshot has no {0} file")]
    MissingFile(&'static str),
    /// A file of the snapshot could not be read or written.
    #[error("cannot access {path}")]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
}

fn io_error(path: &Path) -> impl FnOnce(io::Error) -> VmSnapshotError + '_ {
    move |source| VmSnapshotError::Io { path: path.to_owned(), source }
}

/// What a snapshot's caller adds to the machine's own description ([`VmSnapshot::save_with`]).
#[derive(Debug, Clone, Default)]
pub struct SnapshotExtra {
    /// Kinds of state the saved memory holds besides memory, CPU and devices.
    pub persists: Vec<Persisted>,
    /// More keys for the manifest's meta object.
    pub meta: serde_json::Map<String, serde_json::Value>,
}

/// A verified snapshot of a microVM: its directory (checked against its manifest) and its parsed, validated state.
/// Restoring or forking from it any number of times reads the state once.
#[derive(Debug, Clone)]
pub struct VmSnapshot {
    snapshot: Snapshot,
    state: MicrovmState,
}

impl VmSnapshot {
    /// Saves a paused machine into a new snapshot directory at `dest` (which must not exist): vCPU I/O in flight
    /// completed ([`strata_vmm::machine::complete_pending_io`]), then the state file and
    /// the memory file, written under the device locks, then sealed by [`SnapshotWriter::commit`] (sha256 of each
    /// file, the seal of `trust`'s key, fsync, atomic rename). `parent` is the snapshot the machine was forked from,
    /// if any.
    pub fn save(
        machine: &mut Machine,
        dest: &Path,
        parent: Option<String>,
        trust: &SnapshotTrust,
    ) -> Result<VmSnapshot, VmSnapshotError> {
        VmSnapshot::save_with(machine, dest, parent, SnapshotExtra::default(), trust)
    }

    /// [`VmSnapshot::save`], with what the caller knows about the guest beyond the machine: more kinds of state
    /// that the saved memory holds (a booted Linux keeps its files and processes in RAM) and more meta keys (the
    /// tier's capabilities and images). A key of `extra.meta` never replaces one of the machine's own.
    pub fn save_with(
        machine: &mut Machine,
        dest: &Path,
        parent: Option<String>,
        extra: SnapshotExtra,
        trust: &SnapshotTrust,
    ) -> Result<VmSnapshot, VmSnapshotError> {
        let writer = SnapshotWriter::create(dest, trust)?;
        let path = writer.dir().join(MEMORY_FILE);
        let memory = File::create(&path).map_err(io_error(&path))?;
        let state = machine.save(&memory)?;
        drop(memory);
        VmSnapshot::commit(writer, state, parent, extra)
    }

    /// Writes the state file beside the memory file already in `writer`'s directory and seals the snapshot.
    pub(crate) fn commit(
        writer: SnapshotWriter,
        state: MicrovmState,
        parent: Option<String>,
        extra: SnapshotExtra,
    ) -> Result<VmSnapshot, VmSnapshotError> {
        let path = writer.dir().join(STATE_FILE);
        let bytes = state.to_bytes()?;
        File::create(&path).and_then(|mut f| f.write_all(&bytes)).map_err(io_error(&path))?;
        let meta = serde_json::json!({
            "state_file": STATE_FILE,
            "state_version": STATE_VERSION,
            "memory_file": MEMORY_FILE,
            "memory_bytes": state.memory_bytes,
            "vcpus": state.vcpus.len(),
            "irqchip": state.vm.irqchip.is_some(),
            "serial": state.devices.serial.is_some(),
            "virtio": state.devices.virtio.iter().map(|slot| match slot.device {
                VirtioDeviceState::Vsock(_) => "vsock",
                VirtioDeviceState::Block(_) => "block",
            }).collect::<Vec<_>>(),
        });
        let mut meta = meta;
        if let Some(object) = meta.as_object_mut() {
            for (key, value) in extra.meta {
                object.entry(key).or_insert(value);
            }
        }
        let mut persists = vec![Persisted::Memory, Persisted::Cpu, Persisted::Devices];
        for kind in extra.persists {
            if !persists.contains(&kind) {
                persists.push(kind);
            }
        }
        persists.sort();
        let snapshot = writer.commit(TierKind::Microvm, parent, persists, meta)?;
        Ok(VmSnapshot { snapshot, state })
    }

    /// Opens a snapshot directory: the seal, the manifest and every file's sha256 ([`SnapshotTrust::open_for`]),
    /// then the state file (header, version, size cap, shape, [`MicrovmState::validate`]) and the memory file's size.
    pub fn open(dir: &Path, trust: &SnapshotTrust) -> Result<VmSnapshot, VmSnapshotError> {
        VmSnapshot::from_verified(trust.open_for(dir, TierKind::Microvm)?)
    }

    /// As [`VmSnapshot::open`], for a snapshot a [`SnapshotTrust`] has already verified (opened or re-opened).
    pub fn from_verified(snapshot: Snapshot) -> Result<VmSnapshot, VmSnapshotError> {
        if snapshot.tier != TierKind::Microvm {
            return Err(SnapshotError::WrongTier {
                dir: snapshot.dir.clone(),
                expected: TierKind::Microvm,
                found: snapshot.tier,
            }
            .into());
        }
        let listed = |name: &str| snapshot.manifest.files.iter().find(|f| f.path == name).map(|f| f.size);
        listed(STATE_FILE).ok_or(VmSnapshotError::MissingFile(STATE_FILE))?;
        let memory_size = listed(MEMORY_FILE).ok_or(VmSnapshotError::MissingFile(MEMORY_FILE))?;
        let bytes = snapshot.read_file(STATE_FILE, MAX_STATE_BYTES + STATE_HEADER_LEN as u64)?;
        let state = MicrovmState::from_bytes(&bytes, &snapshot.file(STATE_FILE))?;
        if memory_size != state.memory_bytes {
            return Err(MachineError::MemorySize { expected: state.memory_bytes, found: memory_size }.into());
        }
        Ok(VmSnapshot { snapshot, state })
    }

    /// The snapshot directory and manifest.
    pub fn snapshot(&self) -> &Snapshot {
        &self.snapshot
    }

    /// The saved state.
    pub fn state(&self) -> &MicrovmState {
        &self.state
    }

    /// The memory file.
    pub fn memory_path(&self) -> PathBuf {
        self.snapshot.file(MEMORY_FILE)
    }

    /// Rebuilds the machine with its own copy of RAM (a fresh memfd, the memory file's non-zero pages written
    /// into it): independent of the snapshot's files once it returns. The vCPUs are paused.
    pub fn restore(&self, args: RestoreArgs) -> Result<Machine, VmSnapshotError> {
        let memory = GuestMemory::new(self.state.memory_bytes).map_err(MachineError::from)?;
        let path = self.memory_path();
        // From the private copy, not the file: the bytes copied are the ones the manifest names, whatever happens
        // to the file meanwhile.
        let copy = self.snapshot.private_copy(MEMORY_FILE)?;
        let found = copy.len();
        if found != self.state.memory_bytes {
            return Err(MachineError::MemorySize { expected: self.state.memory_bytes, found }.into());
        }
        memory.fill_sparse_from(copy.file()).map_err(io_error(&path))?;
        Ok(Machine::restore(&self.state, memory, args)?)
    }

    /// Rebuilds the machine over the memory file's private copy ([`Snapshot::private_copy`], made once and
    /// checked against the manifest as it is made) mapped `MAP_PRIVATE`: it shares every page it has not written
    /// with every other fork, its writes reach no one else, and nothing done to the snapshot's file afterwards
    /// reaches it (a truncated mapped file would kill the monitor with `SIGBUS`). Give it a new identity in
    /// `args` (`guest_cid`). The vCPUs are paused.
    pub fn fork(&self, args: RestoreArgs) -> Result<Machine, VmSnapshotError> {
        let path = self.memory_path();
        let copy = self.snapshot.private_copy(MEMORY_FILE)?;
        let file = copy.file().try_clone().map_err(io_error(&path))?;
        let memory = GuestMemory::from_open_file_private(file, &path).map_err(MachineError::from)?;
        Ok(Machine::restore(&self.state, memory, args)?)
    }
}
