//! Assembling a microVM that boots Linux and reaching its guest agent: `Microvm::boot` puts the pieces together
//! (memfd memory, the VM with its irqchip, the kernel and initramfs, the serial console, virtio-vsock for the agent,
//! virtio-blk for an optional read-only root disk, the vCPU threads); `Microvm::connect_agent` waits for the agent
//! over vsock; dropping the `Microvm` stops and joins every thread and removes its socket.
//!
//! Device placement (what the kernel command line tells the guest): virtio-mmio slots of 4 KiB from the start of the
//! MMIO gap (0xd000_0000), GSIs from 5 up; the serial console on COM1 (GSI 4). The guest reboots by triple fault
//! (`reboot=t`) and the agent's power-off is a restart (`strata.halt=restart`): without ACPI a halt would leave the
//! VM running; a triple fault ends the vCPU with a `Shutdown` exit.
//!
//! Built for hardware KVM. On a PVM host the kernel stops in KVM's instruction emulator; `boot` still succeeds (it
//! only starts the vCPUs) and `connect_agent` then reports the guest's crash with the console's last lines — fast,
//! typed, never a hang. The engine does not even try there (`strata doctor` says why).

use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use linux_loader::cmdline::Cmdline;
use strata_guest_proto::{AgentClient, ClientConfig, DEFAULT_AGENT_PORT};

use crate::boot::{self, BootError, BootProtocol, CMDLINE_MAX_SIZE};
use crate::devices::bus::{Bus, BusError};
use crate::devices::serial::{SERIAL_GSI, SERIAL_PORT_BASE, SERIAL_PORT_LEN, SerialDevice, SerialLog};
use crate::devices::virtio::Interrupt;
use crate::devices::virtio::block::{BlockConfig, BlockDevice};
use crate::devices::virtio::mmio::{BackendThread, MMIO_LEN, MmioTransport, kernel_cmdline_device};
use crate::devices::virtio::vsock::{VsockConfig, VsockDevice};
use crate::machine::{Devices, Machine, VirtioSlot, VirtioTransport};
use crate::persist::RestoreArgs;
use crate::snapshot::{SnapshotExtra, VmSnapshot, VmSnapshotError};
use crate::vstate::memory::{GuestMemory, MMIO_GAP_START};
use crate::vstate::vcpu::cpuid::CpuidProfile;
use crate::vstate::vcpu::{Vcpu, VcpuConfig, VcpuExit};
use crate::vstate::vm::{Vm, VmConfig};

/// The guest's vsock CID (one VM per vsock device, so it can be the same for every VM).
pub const GUEST_CID: u64 = 3;

/// The first virtio device's GSI.
const FIRST_VIRTIO_GSI: u32 = 5;

/// The console's log kept per VM.
const SERIAL_LOG_BYTES: usize = 256 * 1024;

/// What to boot.
#[derive(Debug, Clone)]
pub struct MicrovmConfig {
    /// An ELF `vmlinux`.
    pub kernel: PathBuf,
    /// The initramfs (the agent as `/init`).
    pub initramfs: PathBuf,
    /// A read-only root disk (squashfs) the agent moves onto, when given.
    pub root_disk: Option<PathBuf>,
    /// Guest RAM in bytes.
    pub memory_bytes: u64,
    /// vCPUs.
    pub vcpus: u8,
    /// CPUID mask.
    pub cpuid: CpuidProfile,
    /// A directory of Strata's own for this VM's sockets (must exist).
    pub run_dir: PathBuf,
}

/// Why a microVM could not be built, or its agent reached.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    /// Guest memory.
    #[error(transparent)]
    Memory(#[from] crate::vstate::memory::MemoryError),
    /// The VM.
    #[error(transparent)]
    Vm(#[from] crate::vstate::vm::VmError),
    /// A vCPU.
    #[error(transparent)]
    Vcpu(#[from] crate::vstate::vcpu::VcpuError),
    /// Loading the kernel.
    #[error(transparent)]
    Boot(#[from] BootError),
    /// Placing a device.
    #[error(transparent)]
    Bus(#[from] BusError),
    /// A device.
    #[error("{what}: {message}")]
    Device {
        /// Which device.
        what: &'static str,
        /// The error.
        message: String,
    },
    /// A file (kernel, initramfs, disk).
    #[error("cannot open {}: {source}", path.display())]
    Open {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The guest stopped before its agent answered.
    #[error("the guest stopped before its agent was ready ({exit}); console:\n{console}")]
    GuestDied {
        /// How the vCPU ended.
        exit: String,
        /// The console's last lines.
        console: String,
    },
    /// The agent did not answer in time.
    #[error("the guest agent did not answer within {waited:?}; console:\n{console}")]
    AgentTimeout {
        /// How long it was waited for.
        waited: Duration,
        /// The console's last lines.
        console: String,
    },
}

fn cmdline_error(err: linux_loader::cmdline::Error) -> BuildError {
    BuildError::Device { what: "kernel command line", message: err.to_string() }
}

fn device_error(what: &'static str) -> impl FnOnce(std::io::Error) -> BuildError {
    move |err| BuildError::Device { what, message: err.to_string() }
}

/// A running microVM: a [`Machine`] (so it can be paused and snapshotted like any other), its console and the host
/// socket of its vsock device.
#[derive(Debug)]
pub struct Microvm {
    machine: Machine,
    serial: SerialLog,
    vsock_uds: PathBuf,
    started: Instant,
}

impl Microvm {
    /// Builds the VM and starts its vCPUs.
    pub fn boot(config: &MicrovmConfig) -> Result<Microvm, BuildError> {
        let memory = GuestMemory::new(config.memory_bytes)?;
        let mut vm = Vm::new(&VmConfig { irqchip: true })?;
        vm.register_memory(&memory)?;

        let mut io = Bus::new();
        let serial = SerialDevice::new(SERIAL_LOG_BYTES)
            .map_err(|e| BuildError::Device { what: "serial console", message: e.to_string() })?;
        vm.register_irqfd(serial.interrupt_evt(), SERIAL_GSI)?;
        let serial_log = serial.log();
        let serial = Arc::new(Mutex::new(serial));
        io.insert(serial.clone(), SERIAL_PORT_BASE, SERIAL_PORT_LEN)?;
        let mut devices = Devices { serial: Some(serial), virtio: Vec::new() };

        let mut mmio = Bus::new();
        let mut cmdline = Cmdline::new(CMDLINE_MAX_SIZE).map_err(cmdline_error)?;
        let mut args = format!(
            "console=ttyS0 reboot=t panic=-1 pci=off nokaslr i8042.noaux i8042.nomux i8042.dumbkbd \
             strata.halt=restart strata.port={DEFAULT_AGENT_PORT}"
        );
        if config.cpuid == CpuidProfile::PvmCompat {
            args.push_str(" noxsave");
        }
        let mut backends = Vec::new();
        let mut slot = 0u32;
        let mut place = |cmdline_args: &mut String| -> (u64, u32) {
            let base = MMIO_GAP_START + u64::from(slot) * MMIO_LEN;
            let gsi = FIRST_VIRTIO_GSI + slot;
            slot += 1;
            cmdline_args.push(' ');
            cmdline_args.push_str(&kernel_cmdline_device(base, gsi));
            (base, gsi)
        };

        let vsock_uds = config.run_dir.join(format!("vsock-{}-{}.sock", std::process::id(), unique()));
        let vsock = VsockDevice::new(VsockConfig { guest_cid: GUEST_CID, uds_path: vsock_uds.clone() })
            .map_err(|e| BuildError::Device { what: "vsock", message: e.to_string() })?;
        let interrupt = Interrupt::new().map_err(device_error("vsock interrupt"))?;
        let (base, gsi) = place(&mut args);
        vm.register_irqfd(interrupt.irqfd(), gsi)?;
        let transport = Arc::new(Mutex::new(
            MmioTransport::new(memory.mmap().clone(), vsock, interrupt)
                .map_err(|e| BuildError::Device { what: "vsock transport", message: e.to_string() })?,
        ));
        mmio.insert(transport.clone(), base, MMIO_LEN)?;
        let backend = BackendThread::spawn(transport.clone())
            .map_err(|e| BuildError::Device { what: "vsock backend", message: e.to_string() })?;
        backends.push(backend);
        devices.virtio.push(VirtioSlot { base, gsi, transport: VirtioTransport::Vsock(transport) });

        if let Some(disk) = &config.root_disk {
            let block =
                BlockDevice::new(BlockConfig { path: disk.clone(), file: None, id: Some("strata-root".into()) })
                    .map_err(|e| BuildError::Device { what: "root disk", message: e.to_string() })?;
            let interrupt = Interrupt::new().map_err(device_error("root disk interrupt"))?;
            let (base, gsi) = place(&mut args);
            vm.register_irqfd(interrupt.irqfd(), gsi)?;
            let transport = MmioTransport::new(memory.mmap().clone(), block, interrupt)
                .map_err(|e| BuildError::Device { what: "root disk transport", message: e.to_string() })?;
            let transport = Arc::new(Mutex::new(transport));
            mmio.insert(transport.clone(), base, MMIO_LEN)?;
            devices.virtio.push(VirtioSlot { base, gsi, transport: VirtioTransport::Block(transport) });
            args.push_str(" strata.root=/dev/vda strata.rootfstype=squashfs");
        }
        cmdline.insert_str(&args).map_err(cmdline_error)?;

        let mut kernel =
            File::open(&config.kernel).map_err(|source| BuildError::Open { path: config.kernel.clone(), source })?;
        let mut initrd = File::open(&config.initramfs)
            .map_err(|source| BuildError::Open { path: config.initramfs.clone(), source })?;
        let loaded = boot::load_kernel(&memory, &mut kernel, &cmdline, Some(&mut initrd), BootProtocol::Linux64)?;

        let vcpu_config = VcpuConfig { vcpu_count: config.vcpus.max(1), cpuid: config.cpuid };
        let mut vcpus = Vec::new();
        for index in 0..vcpu_config.vcpu_count {
            let vcpu = Vcpu::new(&vm, index, io.clone(), mmio.clone())?;
            vcpu.configure(&vm, &vcpu_config)?;
            if index == 0 {
                vcpu.set_entry(&loaded.entry)?;
            }
            vcpus.push(vcpu);
        }
        let mut machine = Machine::new(vm, memory, vcpus, devices);
        for backend in backends {
            machine.add_backend(backend);
        }
        let started = Instant::now();
        machine.resume().map_err(|e| BuildError::Device { what: "vCPU threads", message: e.to_string() })?;
        Ok(Microvm { machine, serial: serial_log, vsock_uds, started })
    }

    /// A fork of `snapshot` in a new monitor: its memory file mapped copy-on-write ([`VmSnapshot::fork`]), a new
    /// vsock socket in `run_dir`, the new guest CID `guest_cid` (the fork's identity), the root disk `root_disk`
    /// when the snapshot has one, and the vCPUs running. The guest's vsock connections were reset: reach the agent
    /// again with [`Microvm::connect_agent`].
    pub fn fork(
        snapshot: &VmSnapshot,
        run_dir: &std::path::Path,
        guest_cid: u64,
        root_disk: Option<PathBuf>,
    ) -> Result<Microvm, VmSnapshotError> {
        let vsock_uds = run_dir.join(format!("vsock-{}-{}.sock", std::process::id(), unique()));
        let serial = SerialLog::new(SERIAL_LOG_BYTES);
        let args = RestoreArgs {
            vsock_uds: Some(vsock_uds.clone()),
            guest_cid: Some(guest_cid),
            disks: root_disk
                .into_iter()
                .map(crate::devices::virtio::block::persist::BlockConstructorArgs::at)
                .collect(),
            serial_log: Some(serial.clone()),
            ..RestoreArgs::default()
        };
        let machine = snapshot.fork(args)?;
        let mut vm = Microvm { machine, serial, vsock_uds, started: Instant::now() };
        vm.machine.resume().map_err(VmSnapshotError::from)?;
        Ok(vm)
    }

    /// Pauses the vCPUs at a safe point, saves the whole VM into a new snapshot directory at `destination`
    /// ([`VmSnapshot::save_with`]) and resumes it, whether the save worked or not. Quiesce the guest first (the
    /// agent's `PrepareSnapshot`).
    pub fn snapshot(
        &mut self,
        destination: &std::path::Path,
        parent: Option<String>,
        extra: SnapshotExtra,
        trust: &strata_core::SnapshotTrust,
    ) -> Result<VmSnapshot, VmSnapshotError> {
        let exits = self.machine.pause();
        let saved = match exits {
            Ok(exits) if exits.iter().all(|e| matches!(e, VcpuExit::Stopped)) => {
                VmSnapshot::save_with(&mut self.machine, destination, parent, extra, trust)
            }
            Ok(exits) => Err(crate::machine::MachineError::InvalidState(format!(
                "the guest stopped on its own before the snapshot ({})",
                exits.iter().map(describe).collect::<Vec<_>>().join(", ")
            ))
            .into()),
            Err(err) => Err(err.into()),
        };
        self.machine.resume()?;
        saved
    }

    /// The machine: VM, memory, devices, vCPUs.
    pub fn machine(&self) -> &Machine {
        &self.machine
    }

    /// The console log.
    pub fn serial(&self) -> &SerialLog {
        &self.serial
    }

    /// The host Unix socket of the VM's vsock device (host-initiated connections; guest connections to port `P`
    /// go to `<it>_<P>`).
    pub fn vsock_socket(&self) -> &Path {
        &self.vsock_uds
    }

    /// Whether a vCPU has stopped on its own (the guest rebooted or crashed).
    pub fn has_stopped(&self) -> bool {
        self.machine.has_stopped()
    }

    /// Waits (up to `timeout`) for the guest agent on vsock and connects to it.
    pub fn connect_agent(&mut self, timeout: Duration) -> Result<AgentClient, BuildError> {
        let deadline = self.started + timeout;
        loop {
            if self.has_stopped() {
                let exit = match self.machine.pause() {
                    Ok(exits) => exits.iter().map(describe).collect::<Vec<_>>().join(", "),
                    Err(err) => err.to_string(),
                };
                return Err(BuildError::GuestDied { exit, console: self.console_tail(20) });
            }
            if let Some(client) = self.try_connect() {
                return Ok(client);
            }
            if Instant::now() >= deadline {
                return Err(BuildError::AgentTimeout { waited: timeout, console: self.console_tail(20) });
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// One attempt: the vsock muxer's `CONNECT <port>` handshake, then the agent's own.
    fn try_connect(&self) -> Option<AgentClient> {
        let mut stream = UnixStream::connect(&self.vsock_uds).ok()?;
        stream.set_read_timeout(Some(Duration::from_millis(500))).ok()?;
        stream.write_all(format!("CONNECT {DEFAULT_AGENT_PORT}\n").as_bytes()).ok()?;
        let mut line = String::new();
        let mut reader = BufReader::new(stream.try_clone().ok()?);
        reader.read_line(&mut line).ok()?;
        if !line.starts_with("OK ") {
            return None;
        }
        stream.set_read_timeout(None).ok()?;
        AgentClient::connect(stream, ClientConfig { timeout: Some(Duration::from_secs(10)) }).ok()
    }

    /// The console's last `lines` lines.
    pub fn console_tail(&self, lines: usize) -> String {
        let text = String::from_utf8_lossy(&self.serial.contents()).into_owned();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// Stops every vCPU and device thread and removes the socket (as dropping it does).
    pub fn shutdown(self) {
        drop(self);
    }
}

impl Drop for Microvm {
    fn drop(&mut self) {
        // The machine stops and joins its vCPU and backend threads when it is dropped, after this.
        let _ = std::fs::remove_file(&self.vsock_uds);
    }
}

fn describe(exit: &VcpuExit) -> String {
    format!("{exit:?}")
}

fn unique() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}
