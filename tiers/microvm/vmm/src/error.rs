//! Why a machine could not be paused, saved, or rebuilt from a saved state: one error for the `machine` and
//! `persist` modules (re-exported as `machine::MachineError`).

use std::io;
use std::path::PathBuf;

use crate::devices::bus::BusError;
use crate::devices::serial::SerialError;
use crate::devices::virtio::block::persist::BlockPersistError;
use crate::devices::virtio::mmio::BackendThreadError;
use crate::devices::virtio::persist::MmioPersistError;
use crate::devices::virtio::vsock::persist::VsockPersistError;
use crate::vstate::memory::MemoryError;
use crate::vstate::vcpu::VcpuError;
use crate::vstate::vm::VmError;

/// Why a machine could not be paused, saved, or rebuilt from a saved state.
#[derive(Debug, thiserror::Error)]
pub enum MachineError {
    /// A file could not be read or written.
    #[error("cannot access {path}")]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// The state file does not start with [`STATE_MAGIC`](crate::persist::STATE_MAGIC) or is shorter than its header.
    #[error("{path} is not a microVM state file")]
    NotAState {
        /// The file.
        path: PathBuf,
    },
    /// The state file has another format version.
    #[error("the state file has format version {found}; this build reads version {supported}")]
    StateVersion {
        /// The file's.
        found: u32,
        /// [`STATE_VERSION`](crate::persist::STATE_VERSION).
        supported: u32,
    },
    /// The state body is larger than [`MAX_STATE_BYTES`](crate::persist::MAX_STATE_BYTES).
    #[error("the state body is {size} bytes, more than the {max} accepted")]
    StateTooLarge {
        /// Its size.
        size: u64,
        /// [`MAX_STATE_BYTES`](crate::persist::MAX_STATE_BYTES).
        max: u64,
    },
    /// The header's body length differs from what follows it (truncated or grown).
    #[error("the state header announces {expected} bytes of body, the file has {found}")]
    StateLength {
        /// The header's length.
        expected: u64,
        /// What follows the header.
        found: u64,
    },
    /// The body is not JSON of the expected shape.
    #[error("the state body is malformed: {0}")]
    StateFormat(String),
    /// The state is well-formed but describes something this monitor refuses to build.
    #[error("invalid microVM state: {0}")]
    InvalidState(String),
    /// The memory file's size differs from the state's memory size.
    #[error("the memory file is {found} bytes, the state says {expected}")]
    MemorySize {
        /// The state's.
        expected: u64,
        /// The file's.
        found: u64,
    },
    /// The machine's vCPUs are running: pause it first.
    #[error("the machine is running; pause it before taking a snapshot")]
    Running,
    /// The machine has no vCPU to save.
    #[error("the machine has no vCPUs")]
    NoVcpus,
    /// A vCPU could not be paused at a safe point.
    #[error("vCPU {index} did not settle after its pending I/O: {exit}")]
    NotQuiesced {
        /// The vCPU.
        index: u8,
        /// What it did instead.
        exit: String,
    },
    /// A vCPU's thread, state or creation failed.
    #[error("vCPU {index}")]
    Vcpu {
        /// The vCPU.
        index: u8,
        /// Why.
        #[source]
        source: VcpuError,
    },
    /// Creating or configuring the VM failed.
    #[error("VM")]
    Vm(#[from] VmError),
    /// Guest memory could not be created, mapped or copied.
    #[error("guest memory")]
    Memory(#[from] MemoryError),
    /// A device could not be placed on a bus.
    #[error("device placement")]
    Bus(#[from] BusError),
    /// The serial device could not be restored.
    #[error("serial device")]
    Serial(#[from] SerialError),
    /// A virtio transport's state was refused.
    #[error("virtio device {index} transport")]
    Transport {
        /// The device's position in the state.
        index: usize,
        /// Why.
        #[source]
        source: MmioPersistError,
    },
    /// A vsock device's state was refused.
    #[error("virtio device {index} (vsock)")]
    Vsock {
        /// The device's position in the state.
        index: usize,
        /// Why.
        #[source]
        source: VsockPersistError,
    },
    /// A block device's state was refused.
    #[error("virtio device {index} (block)")]
    Block {
        /// The device's position in the state.
        index: usize,
        /// Why.
        #[source]
        source: BlockPersistError,
    },
    /// A host resource a device needs was not given in [`RestoreArgs`](crate::persist::RestoreArgs).
    #[error("virtio device {index} needs {what} in the restore arguments")]
    MissingArg {
        /// The device's position in the state.
        index: usize,
        /// What is missing.
        what: &'static str,
    },
    /// A device's interrupt eventfd could not be created.
    #[error("cannot create an interrupt eventfd")]
    Interrupt(#[source] io::Error),
    /// A device's backend thread could not start.
    #[error("cannot start a device backend thread")]
    Backend(#[from] BackendThreadError),
}
