//! Building the machine a [`MachineSpec`] describes, from the descriptors beside it.
//!
//! Device placement (what the kernel command line tells a Linux guest): virtio-mmio slots of 4 KiB from the start
//! of the MMIO gap (0xd000_0000), GSIs from 5 up, vsock first, then the disks in order; the serial console on COM1
//! (GSI 4). The spec's command line gets a `virtio_mmio.device=` entry per slot.

use std::fs::File;
use std::io::Read;
use std::os::fd::{FromRawFd, IntoRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use kvm_ioctls::Kvm;
use linux_loader::cmdline::Cmdline;
use vm_memory::GuestAddress;

use super::probe::ProbeDevice;
use crate::boot::{self, BootProtocol, CMDLINE_MAX_SIZE, EntryPoint};
use crate::devices::bus::Bus;
use crate::devices::serial::{SERIAL_GSI, SERIAL_PORT_BASE, SERIAL_PORT_LEN, SerialDevice, SerialLog};
use crate::devices::virtio::Interrupt;
use crate::devices::virtio::block::persist::BlockConstructorArgs;
use crate::devices::virtio::block::{BlockConfig, BlockDevice};
use crate::devices::virtio::mmio::{BackendThread, MMIO_LEN, MmioTransport, kernel_cmdline_device};
use crate::devices::virtio::vsock::{VsockConfig, VsockDevice};
use crate::machine::{Devices, Machine, VirtioSlot, VirtioTransport};
use crate::persist::{MAX_STATE_BYTES, MicrovmState, RestoreArgs, STATE_HEADER_LEN};
use crate::proto::{BootImage, BootSpec, MachineSpec, PROBE_ADDRESS, PROTOCOL_VERSION, Payload, RUN_DIR};
use crate::vstate::memory::{GuestMemory, MMIO_GAP_START};
use crate::vstate::vcpu::{Vcpu, VcpuConfig};
use crate::vstate::vm::{Vm, VmConfig};

/// The vsock CID of a new machine when the spec names none.
pub const DEFAULT_GUEST_CID: u64 = 3;
/// The first virtio device's GSI.
const FIRST_VIRTIO_GSI: u32 = 5;
/// The console's log kept per VM.
pub const SERIAL_LOG_BYTES: usize = 256 * 1024;

/// A machine built and paused, with its console.
#[derive(Debug)]
pub struct Built {
    /// The machine.
    pub machine: Machine,
    /// Its console log.
    pub serial: SerialLog,
}

/// Why a machine could not be built (a message for [`crate::proto::Reply::Failed`]).
pub type BuildError = String;

fn error(what: &str) -> impl FnOnce(String) -> BuildError + '_ {
    move |message| format!("{what}: {message}")
}

/// The descriptors beside a Start, taken in order.
struct Files {
    fds: std::vec::IntoIter<OwnedFd>,
}

impl Files {
    fn next(&mut self, what: &str) -> Result<OwnedFd, BuildError> {
        self.fds.next().ok_or_else(|| format!("the descriptor for {what} is missing"))
    }

    fn file(&mut self, what: &str) -> Result<File, BuildError> {
        Ok(File::from(self.next(what)?))
    }
}

/// Builds what `spec` describes from `fds` (`/dev/kvm`, then the payload's files, then the disks).
pub fn build(spec: &MachineSpec, fds: Vec<OwnedFd>) -> Result<Built, BuildError> {
    if spec.version != PROTOCOL_VERSION {
        return Err(format!("protocol version {} (this monitor speaks {PROTOCOL_VERSION})", spec.version));
    }
    let mut files = Files { fds: fds.into_iter() };
    let kvm = files.next("/dev/kvm")?;
    // SAFETY: the descriptor is /dev/kvm as the engine opened it, owned by us alone (received with SCM_RIGHTS);
    // into_raw_fd hands its ownership to the Kvm object.
    let kvm = unsafe { Kvm::from_raw_fd(kvm.into_raw_fd()) };
    let vsock_uds = spec.vsock_socket.as_deref().map(socket_path).transpose()?;
    match &spec.payload {
        Payload::Boot(boot) => build_new(kvm, boot, spec, vsock_uds, files),
        Payload::Restore { fork } => restore(kvm, *fork, spec, vsock_uds, files),
    }
}

/// `/run/<name>` for a plain file name.
fn socket_path(name: &str) -> Result<PathBuf, BuildError> {
    let plain = !name.is_empty()
        && name.len() <= 64
        && name != "."
        && name != ".."
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
    if !plain {
        return Err(format!("socket name {name:?} is not a plain file name"));
    }
    Ok(Path::new(RUN_DIR).join(name))
}

fn build_new(
    kvm: Kvm,
    boot_spec: &BootSpec,
    spec: &MachineSpec,
    vsock_uds: Option<PathBuf>,
    mut files: Files,
) -> Result<Built, BuildError> {
    if boot_spec.probe && boot_spec.memory_bytes > PROBE_ADDRESS {
        return Err(format!("a machine with the probe has at most {PROBE_ADDRESS:#x} bytes of RAM"));
    }
    let memory = GuestMemory::new(boot_spec.memory_bytes).map_err(|e| e.to_string()).map_err(error("memory"))?;
    let mut vm = Vm::with_kvm(kvm, &VmConfig { irqchip: boot_spec.irqchip }).map_err(|e| format!("VM: {e}"))?;
    vm.register_memory(&memory).map_err(|e| format!("memory slots: {e}"))?;

    let mut io = Bus::new();
    let serial = SerialDevice::new(SERIAL_LOG_BYTES).map_err(|e| format!("serial console: {e}"))?;
    if boot_spec.irqchip {
        vm.register_irqfd(serial.interrupt_evt(), SERIAL_GSI).map_err(|e| format!("serial interrupt: {e}"))?;
    }
    let serial_log = serial.log();
    let serial = Arc::new(Mutex::new(serial));
    io.insert(serial.clone(), SERIAL_PORT_BASE, SERIAL_PORT_LEN).map_err(|e| format!("serial console: {e}"))?;
    let mut devices = Devices { serial: Some(serial), virtio: Vec::new() };

    let mut mmio = Bus::new();
    if boot_spec.probe {
        mmio.insert(Arc::new(Mutex::new(ProbeDevice)), PROBE_ADDRESS, 0x1000).map_err(|e| format!("probe: {e}"))?;
    }
    let mut device_args = String::new();
    let mut slot = 0u32;
    let mut place = |args: &mut String| -> (u64, u32) {
        let base = MMIO_GAP_START + u64::from(slot) * MMIO_LEN;
        let gsi = FIRST_VIRTIO_GSI + slot;
        slot += 1;
        args.push(' ');
        args.push_str(&kernel_cmdline_device(base, gsi));
        (base, gsi)
    };
    let mut backends = Vec::new();
    if let Some(uds_path) = vsock_uds {
        let guest_cid = spec.guest_cid.unwrap_or(DEFAULT_GUEST_CID);
        let vsock = VsockDevice::new(VsockConfig { guest_cid, uds_path }).map_err(|e| format!("vsock: {e}"))?;
        let interrupt = Interrupt::new().map_err(|e| format!("vsock interrupt: {e}"))?;
        let (base, gsi) = place(&mut device_args);
        if boot_spec.irqchip {
            vm.register_irqfd(interrupt.irqfd(), gsi).map_err(|e| format!("vsock interrupt: {e}"))?;
        }
        let transport =
            MmioTransport::new(memory.mmap().clone(), vsock, interrupt).map_err(|e| format!("vsock transport: {e}"))?;
        let transport = Arc::new(Mutex::new(transport));
        mmio.insert(transport.clone(), base, MMIO_LEN).map_err(|e| format!("vsock: {e}"))?;
        backends.push(BackendThread::spawn(transport.clone()).map_err(|e| format!("vsock backend: {e}"))?);
        devices.virtio.push(VirtioSlot { base, gsi, transport: VirtioTransport::Vsock(transport) });
    }
    // The image's files come before the disks' (see `Request::Start`).
    let (kernel, initramfs) = match &boot_spec.image {
        BootImage::Linux { initramfs, .. } => {
            let kernel = files.file("the kernel")?;
            let initramfs = if *initramfs { Some(files.file("the initramfs")?) } else { None };
            (Some(kernel), initramfs)
        }
        BootImage::Code { .. } => (None, None),
    };
    for disk in &spec.disks {
        let file = files.file(&disk.name)?;
        let config = BlockConfig { path: PathBuf::from(&disk.name), file: Some(file), id: disk.id.clone() };
        let block = BlockDevice::new(config).map_err(|e| format!("disk {}: {e}", disk.name))?;
        let interrupt = Interrupt::new().map_err(|e| format!("disk interrupt: {e}"))?;
        let (base, gsi) = place(&mut device_args);
        if boot_spec.irqchip {
            vm.register_irqfd(interrupt.irqfd(), gsi).map_err(|e| format!("disk interrupt: {e}"))?;
        }
        let transport =
            MmioTransport::new(memory.mmap().clone(), block, interrupt).map_err(|e| format!("disk transport: {e}"))?;
        let transport = Arc::new(Mutex::new(transport));
        mmio.insert(transport.clone(), base, MMIO_LEN).map_err(|e| format!("disk: {e}"))?;
        devices.virtio.push(VirtioSlot { base, gsi, transport: VirtioTransport::Block(transport) });
    }

    let entry = match &boot_spec.image {
        BootImage::Linux { cmdline, .. } => {
            let mut line = Cmdline::new(CMDLINE_MAX_SIZE).map_err(|e| format!("command line: {e}"))?;
            line.insert_str(format!("{cmdline}{device_args}")).map_err(|e| format!("command line: {e}"))?;
            let mut kernel = kernel.ok_or("the kernel is missing")?;
            let mut initramfs = initramfs;
            let loaded = boot::load_kernel(&memory, &mut kernel, &line, initramfs.as_mut(), BootProtocol::Linux64)
                .map_err(|e| format!("kernel: {e}"))?;
            loaded.entry
        }
        BootImage::Code { code, at } => {
            boot::write_boot_tables(&memory, BootProtocol::Linux64).map_err(|e| format!("boot tables: {e}"))?;
            memory.write(GuestAddress(*at), code).map_err(|e| format!("code: {e}"))?;
            EntryPoint::long_mode(GuestAddress(*at))
        }
    };
    if files.fds.next().is_some() {
        return Err("more descriptors than the spec names".into());
    }

    let vcpu_config = VcpuConfig { vcpu_count: boot_spec.vcpus.max(1), cpuid: boot_spec.cpuid };
    let mut vcpus = Vec::new();
    for index in 0..vcpu_config.vcpu_count {
        let vcpu = Vcpu::new(&vm, index, io.clone(), mmio.clone()).map_err(|e| format!("vCPU {index}: {e}"))?;
        vcpu.configure(&vm, &vcpu_config).map_err(|e| format!("vCPU {index}: {e}"))?;
        if index == 0 {
            vcpu.set_entry(&entry).map_err(|e| format!("vCPU {index}: {e}"))?;
        }
        vcpus.push(vcpu);
    }
    let mut machine = Machine::new(vm, memory, vcpus, devices);
    for backend in backends {
        machine.add_backend(backend);
    }
    Ok(Built { machine, serial: serial_log })
}

fn restore(
    kvm: Kvm,
    fork: bool,
    spec: &MachineSpec,
    vsock_uds: Option<PathBuf>,
    mut files: Files,
) -> Result<Built, BuildError> {
    let state_file = files.file("the state")?;
    let cap = MAX_STATE_BYTES + STATE_HEADER_LEN as u64;
    let mut bytes = Vec::new();
    state_file.take(cap + 1).read_to_end(&mut bytes).map_err(|e| format!("state: {e}"))?;
    let state = MicrovmState::from_bytes(&bytes, Path::new("vmstate")).map_err(|e| format!("state: {e}"))?;
    let memory_file = files.file("the memory")?;
    let memory = if fork {
        GuestMemory::from_open_file_private(memory_file, Path::new("memory")).map_err(|e| format!("memory: {e}"))?
    } else {
        let memory = GuestMemory::new(state.memory_bytes).map_err(|e| format!("memory: {e}"))?;
        memory.fill_sparse_from(&memory_file).map_err(|e| format!("memory: {e}"))?;
        memory
    };
    let mut disks = Vec::new();
    for disk in &spec.disks {
        disks.push(BlockConstructorArgs { path: PathBuf::from(&disk.name), file: Some(files.file(&disk.name)?) });
    }
    if files.fds.next().is_some() {
        return Err("more descriptors than the spec names".into());
    }
    let serial = SerialLog::new(SERIAL_LOG_BYTES);
    let args = RestoreArgs {
        kvm: Some(kvm),
        vsock_uds,
        guest_cid: spec.guest_cid,
        disks,
        serial_log: Some(serial.clone()),
        ..RestoreArgs::default()
    };
    let machine = Machine::restore(&state, memory, args).map_err(|e| format!("restore: {}", chain(&e)))?;
    Ok(Built { machine, serial })
}

/// An error and its sources, on one line.
pub fn chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}
