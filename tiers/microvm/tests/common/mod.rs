//! Tiny hand-assembled guests for the snapshot tests and bench (copied in spirit from `tests/kvm.rs`): 2 MiB of
//! RAM, the boot module's GDT and identity page tables, COM1, code at [`CODE`], one vCPU about to run it in long
//! mode. On a PVM host every guest instruction goes through KVM's emulator, so the guests are a handful of
//! instructions each.

#![allow(dead_code)]

use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use strata_tier_microvm::boot::{self, BootProtocol, EntryPoint};
use strata_tier_microvm::devices::bus::{Bus, BusDevice};
use strata_tier_microvm::devices::serial::{SERIAL_GSI, SERIAL_PORT_BASE, SERIAL_PORT_LEN, SerialDevice};
use strata_tier_microvm::devices::virtio::Interrupt;
use strata_tier_microvm::devices::virtio::block::{BlockConfig, BlockDevice};
use strata_tier_microvm::devices::virtio::mmio::{BackendThread, MMIO_LEN, MmioTransport};
use strata_tier_microvm::devices::virtio::vsock::{VsockConfig, VsockDevice};
use strata_tier_microvm::machine::{Devices, Machine, VirtioSlot, VirtioTransport};
use strata_tier_microvm::vstate::memory::GuestMemory;
use strata_tier_microvm::vstate::vcpu::{Vcpu, VcpuConfig};
use strata_tier_microvm::vstate::vm::{Vm, VmConfig};
use vm_memory::GuestAddress;

/// Where the tiny guests' code goes (above the GDT, below the zero page and the page tables).
pub const CODE: u64 = 0x1000;
/// Guest RAM for the tiny guests.
pub const MEM_SIZE: u64 = 2 << 20;
/// An MMIO address inside the identity-mapped first GiB, above RAM: the first virtio window.
pub const MMIO_BASE: u64 = 0x1000_0000;
/// `hlt`.
pub const HLT: u8 = 0xf4;

/// KVM tests run one at a time (timings, fd and thread counts). `None`, after one `skip:` line, without `/dev/kvm`.
pub fn kvm() -> Option<MutexGuard<'static, ()>> {
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());
    if !Path::new("/dev/kvm").exists() {
        println!("skip: /dev/kvm is absent");
        return None;
    }
    Some(ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner()))
}

/// `mov dx, 0x3f8`, then `mov al, b; out dx, al` per byte of `text`.
pub fn print(text: &[u8]) -> Vec<u8> {
    let mut code = vec![0x66, 0xba, 0xf8, 0x03]; // mov dx, 0x3f8
    for &b in text {
        code.extend([0xb0, b]); // mov al, b
        code.push(0xee); // out dx, al
    }
    code
}

/// Counts forever: `rax` += 1, stored at `[0x4000]`, its low byte written to COM1. Offsets of the loop's
/// instructions from [`CODE`]: `inc` 7, `mov` 10, `out` 18, `jmp` 19.
pub fn counter_code() -> Vec<u8> {
    vec![
        0x48, 0x31, 0xc0, // xor rax, rax
        0x66, 0xba, 0xf8, 0x03, // mov dx, 0x3f8
        0x48, 0xff, 0xc0, // loop: inc rax
        0x48, 0x89, 0x04, 0x25, 0x00, 0x40, 0x00, 0x00, //       mov [0x4000], rax
        0xee, //       out dx, al
        0xeb, 0xf2, //       jmp loop
    ]
}

/// Where [`counter_code`]'s loop instructions start, relative to [`CODE`].
pub const COUNTER_INC: u64 = 7;
/// The `mov [0x4000], rax`.
pub const COUNTER_MOV: u64 = 10;
/// The `out dx, al`.
pub const COUNTER_OUT: u64 = 18;
/// The `jmp loop`.
pub const COUNTER_JMP: u64 = 19;

/// What a tiny machine is made of, before it becomes a [`Machine`].
pub struct Parts {
    /// The VM.
    pub vm: Vm,
    /// Its RAM, with the boot tables and the code.
    pub memory: GuestMemory,
    /// The port bus (COM1 on it).
    pub io: Bus,
    /// The MMIO bus.
    pub mmio: Bus,
    /// The devices registered so far.
    pub devices: Devices,
    /// Backend threads of the devices.
    pub backends: Vec<BackendThread>,
}

/// Memory with the boot tables and `code`, a VM, COM1 (irqfd on GSI 4 with the irqchip).
pub fn parts(code: &[u8], irqchip: bool) -> Parts {
    parts_with_memory(code, irqchip, MEM_SIZE)
}

/// As [`parts`], with `memory_bytes` of RAM.
pub fn parts_with_memory(code: &[u8], irqchip: bool, memory_bytes: u64) -> Parts {
    let memory = GuestMemory::new(memory_bytes).expect("memory");
    boot::write_boot_tables(&memory, BootProtocol::Linux64).expect("boot tables");
    memory.write(GuestAddress(CODE), code).expect("code");
    let mut vm = Vm::new(&VmConfig { irqchip }).expect("vm");
    vm.register_memory(&memory).expect("register memory");
    let serial = SerialDevice::new(64 * 1024).expect("serial");
    if irqchip {
        vm.register_irqfd(serial.interrupt_evt(), SERIAL_GSI).expect("irqfd");
    }
    let serial = Arc::new(Mutex::new(serial));
    let mut io = Bus::new();
    io.insert(serial.clone(), SERIAL_PORT_BASE, SERIAL_PORT_LEN).expect("serial on the bus");
    let devices = Devices { serial: Some(serial), virtio: Vec::new() };
    Parts { vm, memory, io, mmio: Bus::new(), devices, backends: Vec::new() }
}

impl Parts {
    /// Adds a vsock device at `base` (GSI `gsi`) with its backend thread.
    pub fn add_vsock(&mut self, base: u64, gsi: u32, cid: u64, uds: &Path) -> Arc<Mutex<MmioTransport<VsockDevice>>> {
        let device = VsockDevice::new(VsockConfig { guest_cid: cid, uds_path: uds.to_path_buf() }).expect("vsock");
        let interrupt = Interrupt::new().expect("interrupt");
        if self.vm.has_irqchip() {
            self.vm.register_irqfd(interrupt.irqfd(), gsi).expect("irqfd");
        }
        let transport =
            Arc::new(Mutex::new(MmioTransport::new(self.memory.mmap().clone(), device, interrupt).expect("transport")));
        self.mmio.insert(transport.clone(), base, MMIO_LEN).expect("vsock on the bus");
        self.backends.push(BackendThread::spawn(transport.clone()).expect("backend"));
        self.devices.virtio.push(VirtioSlot { base, gsi, transport: VirtioTransport::Vsock(transport.clone()) });
        transport
    }

    /// Adds a block device over `disk` at `base` (GSI `gsi`).
    pub fn add_block(&mut self, base: u64, gsi: u32, disk: &Path) -> Arc<Mutex<MmioTransport<BlockDevice>>> {
        let device =
            BlockDevice::new(BlockConfig { path: disk.to_path_buf(), file: None, id: Some("snap-disk".into()) })
                .expect("block");
        let interrupt = Interrupt::new().expect("interrupt");
        if self.vm.has_irqchip() {
            self.vm.register_irqfd(interrupt.irqfd(), gsi).expect("irqfd");
        }
        let transport =
            Arc::new(Mutex::new(MmioTransport::new(self.memory.mmap().clone(), device, interrupt).expect("transport")));
        self.mmio.insert(transport.clone(), base, MMIO_LEN).expect("block on the bus");
        self.devices.virtio.push(VirtioSlot { base, gsi, transport: VirtioTransport::Block(transport.clone()) });
        transport
    }

    /// One vCPU about to run the code in long mode; the paused machine.
    pub fn machine(self) -> Machine {
        let Parts { vm, memory, io, mmio, devices, backends } = self;
        let vcpu = Vcpu::new(&vm, 0, io, mmio).expect("vcpu");
        vcpu.configure(&vm, &VcpuConfig::default()).expect("configure");
        vcpu.set_entry(&EntryPoint::long_mode(GuestAddress(CODE))).expect("entry");
        let mut machine = Machine::new(vm, memory, vec![vcpu], devices);
        for backend in backends {
            machine.add_backend(backend);
        }
        machine
    }
}

/// A paused tiny machine running `code`, with COM1 only.
pub fn tiny_machine(code: &[u8], irqchip: bool) -> Machine {
    parts(code, irqchip).machine()
}

/// A 32-bit little-endian register write, as a driver makes it.
pub fn write_reg(device: &mut dyn BusDevice, offset: u64, value: u32) {
    device.write(offset, &value.to_le_bytes());
}

/// A 32-bit register read.
pub fn read_reg(device: &mut dyn BusDevice, offset: u64) -> u32 {
    let mut data = [0u8; 4];
    device.read(offset, &mut data);
    u32::from_le_bytes(data)
}

/// ACKNOWLEDGE | DRIVER | FEATURES_OK | DRIVER_OK.
pub const STATUS_LIVE: u32 = 0xf;

/// Drives a transport through the virtio-mmio handshake from the host, as a guest driver would: every queue set up
/// with `size` entries in guest RAM from `rings` on, then DRIVER_OK.
pub fn activate(device: &mut dyn BusDevice, queues: u32, size: u32, rings: u64) {
    for status in [0, 1, 3] {
        write_reg(device, 0x70, status);
    }
    write_reg(device, 0x24, 1); // DriverFeaturesSel: page 1
    write_reg(device, 0x20, 1); // VIRTIO_F_VERSION_1
    write_reg(device, 0x70, 0xb); // FEATURES_OK
    for q in 0..queues {
        let base = rings + u64::from(q) * 0x3000;
        write_reg(device, 0x30, q);
        write_reg(device, 0x38, size);
        write_reg(device, 0x80, base as u32);
        write_reg(device, 0x90, (base + 0x1000) as u32);
        write_reg(device, 0xa0, (base + 0x2000) as u32);
        write_reg(device, 0x44, 1);
    }
    write_reg(device, 0x70, STATUS_LIVE);
}

/// Resumes `machine` and waits until `done` holds or the vCPU's thread ends, failing after `limit`.
pub fn run_until(machine: &mut Machine, limit: Duration, mut done: impl FnMut(&Machine) -> bool) {
    machine.resume().expect("resume");
    let deadline = Instant::now() + limit;
    while !done(machine) && !machine.has_stopped() {
        assert!(Instant::now() < deadline, "the guest did not get there within {limit:?}");
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// Reads `len` bytes of guest RAM at `addr`.
pub fn read_mem(memory: &GuestMemory, addr: u64, len: usize) -> Vec<u8> {
    let mut buf = vec![0u8; len];
    memory.read(GuestAddress(addr), &mut buf).expect("read guest memory");
    buf
}

/// The process's open fds.
pub fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").expect("fds").count()
}

/// This process's vCPU and device threads (`strata-*`; the test harness's own threads come and go).
pub fn threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .expect("tasks")
        .filter_map(|task| std::fs::read_to_string(task.ok()?.path().join("comm")).ok())
        .filter(|comm| comm.starts_with("strata-"))
        .count()
}
