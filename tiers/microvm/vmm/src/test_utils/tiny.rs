//! Tiny hand-assembled 64-bit guests: 2 MiB of RAM, the boot module's GDT and identity page tables, COM1, code at
//! [`CODE`], one vCPU about to run it in long mode. On a PVM host every guest instruction goes through KVM's
//! emulator (a few million a second), so the guests are a handful of instructions each.
//!
//! Two shapes: [`TinyGuest`] is the bare VM, memory and vCPU (for tests of the vCPU itself); [`Parts`] becomes a
//! paused [`Machine`], with virtio devices when asked ([`Parts::add_vsock`], [`Parts::add_block`]).

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use vm_memory::GuestAddress;

use crate::boot::{self, BootProtocol, EntryPoint};
use crate::devices::bus::Bus;
use crate::devices::serial::{SERIAL_GSI, SERIAL_PORT_BASE, SERIAL_PORT_LEN, SerialDevice, SerialLog};
use crate::devices::virtio::Interrupt;
use crate::devices::virtio::block::{BlockConfig, BlockDevice};
use crate::devices::virtio::mmio::{BackendThread, MMIO_LEN, MmioTransport};
use crate::devices::virtio::vsock::{VsockConfig, VsockDevice};
use crate::machine::{Devices, Machine, VirtioSlot, VirtioTransport};
use crate::vstate::memory::GuestMemory;
use crate::vstate::vcpu::{Vcpu, VcpuConfig, VcpuExit};
use crate::vstate::vm::{Vm, VmConfig};

/// Where the tiny guests' code goes (above the GDT, below the zero page and the page tables).
pub const CODE: u64 = 0x1000;
/// Guest RAM for the tiny guests.
pub const MEM_SIZE: u64 = 2 << 20;
/// An MMIO address inside the identity-mapped first GiB, above RAM: the first virtio window.
pub const MMIO_BASE: u64 = 0x1000_0000;
/// `hlt`.
pub const HLT: u8 = 0xf4;

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
/// instructions from [`CODE`]: [`COUNTER_INC`], [`COUNTER_MOV`], [`COUNTER_OUT`], [`COUNTER_JMP`].
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

/// Where [`counter_code`]'s loop instructions start, relative to [`CODE`]: the `inc rax`.
pub const COUNTER_INC: u64 = 7;
/// The `mov [0x4000], rax`.
pub const COUNTER_MOV: u64 = 10;
/// The `out dx, al`.
pub const COUNTER_OUT: u64 = 18;
/// The `jmp loop`.
pub const COUNTER_JMP: u64 = 19;

/// RAM of `memory_bytes` with the boot tables and `code` at [`CODE`].
fn memory_with(code: &[u8], memory_bytes: u64) -> GuestMemory {
    let memory = GuestMemory::new(memory_bytes).expect("guest memory");
    boot::write_boot_tables(&memory, BootProtocol::Linux64).expect("boot tables");
    memory.write(GuestAddress(CODE), code).expect("code inside guest memory");
    memory
}

/// A VM over `memory`.
fn vm_over(memory: &GuestMemory, irqchip: bool) -> Vm {
    let mut vm = Vm::new(&VmConfig { irqchip }).expect("vm");
    vm.register_memory(memory).expect("register memory");
    vm
}

/// A port bus with COM1, its interrupt wired to GSI 4 when the VM has an irqchip.
pub fn serial_bus(vm: &Vm) -> (Bus, Arc<Mutex<SerialDevice>>) {
    let serial = SerialDevice::new(64 * 1024).expect("serial");
    if vm.has_irqchip() {
        vm.register_irqfd(serial.interrupt_evt(), SERIAL_GSI).expect("serial irqfd");
    }
    let serial = Arc::new(Mutex::new(serial));
    let mut io = Bus::new();
    io.insert(serial.clone(), SERIAL_PORT_BASE, SERIAL_PORT_LEN).expect("serial on the bus");
    (io, serial)
}

/// A vCPU with these buses, configured with `config`, about to run [`CODE`] in long mode.
fn vcpu_at_code(vm: &Vm, io: Bus, mmio: Bus, config: &VcpuConfig) -> Vcpu {
    let vcpu = Vcpu::new(vm, 0, io, mmio).expect("vcpu");
    vcpu.configure(vm, config).expect("configure the vcpu");
    vcpu.set_entry(&EntryPoint::long_mode(GuestAddress(CODE))).expect("entry point");
    vcpu
}

/// A bare tiny guest: the VM, its RAM, its one vCPU and COM1's log.
#[derive(Debug)]
pub struct TinyGuest {
    /// The VM.
    pub vm: Vm,
    /// Its RAM.
    pub mem: GuestMemory,
    /// Its vCPU, about to run [`CODE`].
    pub vcpu: Vcpu,
    /// What the guest wrote to COM1.
    pub serial: SerialLog,
}

/// A VM with [`MEM_SIZE`] of RAM, COM1 on the port bus, `mmio` on the MMIO bus, `code` at [`CODE`], and one
/// configured vCPU about to execute it in long mode.
pub fn tiny_guest(code: &[u8], irqchip: bool, mmio: Bus) -> TinyGuest {
    tiny_guest_with(code, irqchip, mmio, &VcpuConfig::default())
}

/// As [`tiny_guest`], the vCPU configured with `config`.
pub fn tiny_guest_with(code: &[u8], irqchip: bool, mmio: Bus, config: &VcpuConfig) -> TinyGuest {
    let mem = memory_with(code, MEM_SIZE);
    let vm = vm_over(&mem, irqchip);
    let (io, serial) = serial_bus(&vm);
    let serial = serial.lock().expect("serial lock").log();
    let vcpu = vcpu_at_code(&vm, io, mmio, config);
    TinyGuest { vm, mem, vcpu, serial }
}

/// Runs the vCPU on its own thread and fails (after stopping it) if it takes longer than `limit`: a broken guest
/// must end in a typed exit, never hang the test.
pub fn run_with_deadline(vcpu: Vcpu, limit: Duration) -> (Vcpu, VcpuExit) {
    let thread = vcpu.start().expect("start the vcpu");
    let deadline = Instant::now() + limit;
    while !thread.is_finished() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
    let timed_out = !thread.is_finished();
    if timed_out {
        thread.kick().expect("kick");
    }
    let (vcpu, exit) = thread.join().expect("join the vcpu thread");
    assert!(!timed_out, "the vCPU ran past {limit:?} and had to be stopped");
    (vcpu, exit.expect("run"))
}

/// What a tiny machine is made of, before it becomes a [`Machine`].
#[derive(Debug)]
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
    let memory = memory_with(code, memory_bytes);
    let vm = vm_over(&memory, irqchip);
    let (io, serial) = serial_bus(&vm);
    let devices = Devices { serial: Some(serial), virtio: Vec::new() };
    Parts { vm, memory, io, mmio: Bus::new(), devices, backends: Vec::new() }
}

impl Parts {
    /// An interrupt line for a device at GSI `gsi` (an irqfd when the VM has an irqchip).
    fn interrupt(&self, gsi: u32) -> Interrupt {
        let interrupt = Interrupt::new().expect("interrupt eventfd");
        if self.vm.has_irqchip() {
            self.vm.register_irqfd(interrupt.irqfd(), gsi).expect("device irqfd");
        }
        interrupt
    }

    /// Adds a vsock device at `base` (GSI `gsi`) with its backend thread.
    pub fn add_vsock(&mut self, base: u64, gsi: u32, cid: u64, uds: &Path) -> Arc<Mutex<MmioTransport<VsockDevice>>> {
        let device = VsockDevice::new(VsockConfig { guest_cid: cid, uds_path: uds.to_path_buf() }).expect("vsock");
        let interrupt = self.interrupt(gsi);
        let transport = MmioTransport::new(self.memory.mmap().clone(), device, interrupt).expect("transport");
        let transport = Arc::new(Mutex::new(transport));
        self.mmio.insert(transport.clone(), base, MMIO_LEN).expect("vsock on the bus");
        self.backends.push(BackendThread::spawn(transport.clone()).expect("backend thread"));
        self.devices.virtio.push(VirtioSlot { base, gsi, transport: VirtioTransport::Vsock(transport.clone()) });
        transport
    }

    /// Adds a block device over `disk` at `base` (GSI `gsi`).
    pub fn add_block(&mut self, base: u64, gsi: u32, disk: &Path) -> Arc<Mutex<MmioTransport<BlockDevice>>> {
        let config = BlockConfig { path: disk.to_path_buf(), file: None, id: Some("snap-disk".into()) };
        let device = BlockDevice::new(config).expect("block");
        let interrupt = self.interrupt(gsi);
        let transport = MmioTransport::new(self.memory.mmap().clone(), device, interrupt).expect("transport");
        let transport = Arc::new(Mutex::new(transport));
        self.mmio.insert(transport.clone(), base, MMIO_LEN).expect("block on the bus");
        self.devices.virtio.push(VirtioSlot { base, gsi, transport: VirtioTransport::Block(transport.clone()) });
        transport
    }

    /// One vCPU about to run the code in long mode; the paused machine.
    pub fn machine(self) -> Machine {
        let Parts { vm, memory, io, mmio, devices, backends } = self;
        let vcpu = vcpu_at_code(&vm, io, mmio, &VcpuConfig::default());
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
    memory.read(GuestAddress(addr), &mut buf).expect("read inside guest memory");
    buf
}
