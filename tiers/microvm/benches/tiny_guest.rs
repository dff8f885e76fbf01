//! The monitor core's fixed cost, with a guest too small to matter (`cargo bench -p strata-tier-microvm --bench
//! tiny_guest`):
//!
//! | name                 | what one iteration does                                                          |
//! |----------------------|----------------------------------------------------------------------------------|
//! | `vm_create`          | open `/dev/kvm`, check capabilities, `KVM_CREATE_VM`, TSS/identity map, drop     |
//! | `vm_create_irqchip`  | the same with the in-kernel irqchip and PIT (nearly all of it the kernel's close) |
//! | `memory_2mib`        | memfd + seal + map 2 MiB, write GDT/IDT/page tables and the code, unmap         |
//! | `vcpu_setup`         | on a fresh VM: create the vCPU, CPUID/MSRs/FPU, entry registers                  |
//! | `hello_total`        | all of the above plus running the guest to `hlt` (6 `out`s to COM1), teardown    |
//! | `hello_vcpu_thread`  | `hello_total` with the guest run on its own vCPU thread, as the monitor does     |
//!
//! The target: `hello_total` ≤ 2 ms p50. On a PVM host guest instructions are emulated (a few million per
//! second, ~12 µs per port-I/O exit), which the hello guest's 20 instructions and 6 exits barely feel. Nothing here
//! asserts a time. Iterations per figure: `$STRATA_BENCH_ITERS`, else 500.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use anyhow::{Context, ensure};
use strata_benches::{Figures, latency};
use strata_tier_microvm::boot::{self, BootProtocol, EntryPoint};
use strata_tier_microvm::devices::bus::Bus;
use strata_tier_microvm::devices::serial::{SERIAL_PORT_BASE, SERIAL_PORT_LEN, SerialDevice, SerialLog};
use strata_tier_microvm::vstate::memory::GuestMemory;
use strata_tier_microvm::vstate::vcpu::{Vcpu, VcpuConfig, VcpuExit};
use strata_tier_microvm::vstate::vm::{Vm, VmConfig};
use vm_memory::GuestAddress;

const CODE: u64 = 0x1000;
const MEM_SIZE: u64 = 2 << 20;

/// `mov dx, 0x3f8`, then `mov al, b; out dx, al` for each byte of "hello\n", then `hlt`.
fn hello_code() -> Vec<u8> {
    let mut code = vec![0x66, 0xba, 0xf8, 0x03];
    for &b in b"hello\n" {
        code.extend([0xb0, b, 0xee]);
    }
    code.push(0xf4);
    code
}

fn memory() -> anyhow::Result<GuestMemory> {
    let mem = GuestMemory::new(MEM_SIZE)?;
    boot::write_boot_tables(&mem, BootProtocol::Linux64)?;
    mem.write(GuestAddress(CODE), &hello_code())?;
    Ok(mem)
}

struct Machine {
    _vm: Vm,
    vcpu: Vcpu,
    serial: SerialLog,
}

/// Memory, VM, COM1 and one vCPU about to run the hello guest.
fn machine() -> anyhow::Result<Machine> {
    let mem = memory()?;
    let mut vm = Vm::new(&VmConfig { irqchip: false })?;
    vm.register_memory(&mem)?;
    let device = SerialDevice::new(4096)?;
    let serial = device.log();
    let mut io = Bus::new();
    io.insert(Arc::new(Mutex::new(device)), SERIAL_PORT_BASE, SERIAL_PORT_LEN)?;
    let vcpu = Vcpu::new(&vm, 0, io, Bus::new())?;
    vcpu.configure(&vm, &VcpuConfig::default())?;
    vcpu.set_entry(&EntryPoint::long_mode(GuestAddress(CODE)))?;
    Ok(Machine { _vm: vm, vcpu, serial })
}

fn check(exit: VcpuExit, serial: &SerialLog) -> anyhow::Result<()> {
    ensure!(exit == VcpuExit::Hlt, "the guest ended with {exit:?}");
    ensure!(serial.contents() == b"hello\n", "the guest printed {:?}", serial.contents());
    Ok(())
}

fn main() -> anyhow::Result<()> {
    if !std::path::Path::new("/dev/kvm").exists() {
        println!("skip: /dev/kvm is absent");
        return Ok(());
    }
    let iters = std::env::var("STRATA_BENCH_ITERS").ok().and_then(|v| v.parse().ok()).unwrap_or(500);
    let kind = if std::path::Path::new("/sys/module/kvm_pvm").exists() { "PVM" } else { "hardware" };
    println!("KVM: {kind}; {iters} iterations per figure");

    let mut all: Vec<Figures> = Vec::new();
    all.push(latency("vm_create", iters, || Vm::new(&VmConfig { irqchip: false }).map(drop).map_err(Into::into))?);
    all.push(latency("vm_create_irqchip", iters, || {
        Vm::new(&VmConfig { irqchip: true }).map(drop).map_err(Into::into)
    })?);
    all.push(latency("memory_2mib", iters, || memory().map(drop))?);

    // Only the vCPU's creation and setup are timed; the VM is made and dropped around it.
    let mem = memory()?;
    let mut setup = Figures::new("vcpu_setup");
    for i in 0..iters + iters / 10 {
        let mut vm = Vm::new(&VmConfig { irqchip: false })?;
        vm.register_memory(&mem)?;
        let t = Instant::now();
        let vcpu = Vcpu::new(&vm, 0, Bus::new(), Bus::new())?;
        vcpu.configure(&vm, &VcpuConfig::default())?;
        vcpu.set_entry(&EntryPoint::long_mode(GuestAddress(CODE)))?;
        if i >= iters / 10 {
            setup.record(t.elapsed());
        }
    }
    all.push(setup);

    let total = latency("hello_total", iters, || {
        let mut m = machine()?;
        let exit = m.vcpu.run()?;
        check(exit, &m.serial)
    })?;
    let total_p50_ms = total.p_us(0.5) / 1000.0;
    all.push(total);
    all.push(latency("hello_vcpu_thread", iters, || {
        let m = machine()?;
        let (_vcpu, exit) = m.vcpu.start()?.join()?;
        check(exit.context("run")?, &m.serial)
    })?);

    for f in &all {
        f.print("strata-tier-microvm");
    }
    let verdict = if total_p50_ms <= 2.0 { "PASS" } else { "MISS" };
    println!("{:<26} hello_total p50 <= 2 ms: {total_p50_ms:.3} ms {verdict}", "target");
    Ok(())
}
