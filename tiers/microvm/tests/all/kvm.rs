//! The monitor core on real KVM: tiny hand-assembled 64-bit guests entered in long mode through the boot module's
//! GDT and page tables. On a PVM host every guest instruction goes through KVM's emulator (a few million per
//! second), so the guests are a handful of instructions each.
//!
//! Without `/dev/kvm` each test prints one `skip:` line and passes.

use std::io::Cursor;
use std::os::unix::fs::FileExt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use linux_loader::cmdline::Cmdline;
use strata_tier_microvm::boot::{self, BootProtocol, CMDLINE_MAX_SIZE};
use strata_tier_microvm::devices::bus::{Bus, BusDevice};
use strata_tier_microvm::vstate::memory::{GuestMemory, MMIO_GAP_START};
use strata_tier_microvm::vstate::vcpu::cpuid::CpuidProfile;
use strata_tier_microvm::vstate::vcpu::{InternalErrorKind, Vcpu, VcpuConfig, VcpuExit};
use strata_tier_microvm::vstate::vm::{Vm, VmConfig};
use strata_vmm::test_utils::process::{Held, kvm};
use strata_vmm::test_utils::tiny::*;
use vm_memory::GuestAddress;

#[test]
fn a_guest_prints_hello_on_the_serial_port() {
    let Some(_kvm) = kvm() else { return };
    let mut code = print(b"hello\n");
    code.push(HLT);
    for cpuid in [CpuidProfile::Standard, CpuidProfile::PvmCompat] {
        let guest = tiny_guest_with(&code, false, Bus::new(), &VcpuConfig { vcpu_count: 1, cpuid });
        let (_vcpu, exit) = run_with_deadline(guest.vcpu, Duration::from_secs(5));
        assert_eq!(exit, VcpuExit::Hlt);
        assert_eq!(guest.serial.contents(), b"hello\n");
        assert_eq!(guest.serial.dropped(), 0);
    }
}

#[test]
fn guest_writes_land_in_the_memfd() {
    let Some(_kvm) = kvm() else { return };
    let code = [
        0x48, 0xc7, 0xc7, 0x00, 0x50, 0x00, 0x00, // mov rdi, 0x5000
        0xb0, 0x5a, // mov al, 0x5a
        0xb9, 0x40, 0x00, 0x00, 0x00, // mov ecx, 64
        0xf3, 0xaa, // rep stosb          (0x5000..0x5040 = 0x5a, rdi ends at 0x5040)
        0x48, 0xb8, 0x88, 0x77, 0x66, 0x55, 0x44, 0x33, 0x22, 0x11, // mov rax, 0x1122334455667788
        0x48, 0x89, 0x07, // mov [rdi], rax
        HLT,
    ];
    let guest = tiny_guest(&code, false, Bus::new());
    let (_vcpu, exit) = run_with_deadline(guest.vcpu, Duration::from_secs(5));
    assert_eq!(exit, VcpuExit::Hlt);

    let mut through_the_file = [0u8; 72];
    guest.mem.file().read_exact_at(&mut through_the_file, 0x5000).expect("pread the memfd");
    assert_eq!(through_the_file[..64], [0x5a; 64]);
    assert_eq!(through_the_file[64..], 0x1122_3344_5566_7788u64.to_le_bytes());
    let mut through_the_mapping = [0u8; 72];
    guest.mem.read(GuestAddress(0x5000), &mut through_the_mapping).expect("read");
    assert_eq!(through_the_mapping, through_the_file);
}

/// The guest's MMIO writes as (offset, bytes).
type Writes = Arc<Mutex<Vec<(u64, Vec<u8>)>>>;

/// Answers the virtio-mmio magic at offset 0 and records writes.
struct MagicRegister {
    writes: Writes,
}

impl BusDevice for MagicRegister {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        let value: u32 = if offset == 0 { 0x7472_6976 } else { 0 };
        for (i, b) in data.iter_mut().enumerate() {
            *b = value.to_le_bytes().get(i).copied().unwrap_or(0);
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        self.writes.lock().expect("writes").push((offset, data.to_vec()));
    }
}

#[test]
fn an_mmio_register_handshake_goes_through_the_bus() {
    let Some(_kvm) = kvm() else { return };
    let code = [
        0x8b, 0x04, 0x25, 0x00, 0x00, 0x00, 0x10, // mov eax, [0x10000000]    (the magic register)
        0x89, 0x04, 0x25, 0x00, 0x30, 0x00, 0x00, // mov [0x3000], eax         (into RAM)
        0xc7, 0x04, 0x25, 0x70, 0x00, 0x00, 0x10, 0x01, 0x00, 0x00,
        0x00, // mov dword [0x10000070], 1 (status: ack)
        HLT,
    ];
    let writes: Writes = Arc::default();
    let mut mmio = Bus::new();
    mmio.insert(Arc::new(Mutex::new(MagicRegister { writes: writes.clone() })), MMIO_BASE, 0x1000).expect("insert");
    let guest = tiny_guest(&code, false, mmio);
    let (_vcpu, exit) = run_with_deadline(guest.vcpu, Duration::from_secs(5));
    assert_eq!(exit, VcpuExit::Hlt);

    let mut magic = [0u8; 4];
    guest.mem.read(GuestAddress(0x3000), &mut magic).expect("read");
    assert_eq!(u32::from_le_bytes(magic), 0x7472_6976, "the guest read \"virt\"");
    assert_eq!(*writes.lock().expect("writes"), vec![(0x70, 1u32.to_le_bytes().to_vec())]);
}

#[test]
fn vcpu_state_moves_to_a_new_vm_over_the_same_memory() {
    let Some(_kvm) = kvm() else { return };
    let code = [
        0x48, 0x31, 0xc0, // xor rax, rax
        0x66, 0xba, 0x80, 0x00, // mov dx, 0x80
        0x48, 0xff, 0xc0, // loop: inc rax
        0xee, //       out dx, al          (an exit per iteration; nothing is on port 0x80)
        0x48, 0x83, 0xf8, 0x0a, //       cmp rax, 10
        0x75, 0xf6, //       jne loop
        0x48, 0x89, 0x04, 0x25, 0x00, 0x40, 0x00, 0x00, // mov [0x4000], rax
        HLT,
    ];
    let TinyGuest { vm, mem, mut vcpu, .. } = tiny_guest(&code, false, Bus::new());
    let mut outs = 0;
    while outs < 4 {
        match vcpu.run_once().expect("run") {
            VcpuExit::IoOut { port: 0x80, handled: false, .. } => outs += 1,
            other => panic!("unexpected exit {other:?}"),
        }
    }
    let state = vcpu.save_state().expect("save");
    assert_eq!(state.regs.rax, 4);
    assert!(!state.msrs.is_empty() && state.lapic.is_none(), "{state:?}");
    drop(vcpu);
    drop(vm);

    let mut vm = Vm::new(&VmConfig { irqchip: false }).expect("new vm");
    vm.register_memory(&mem).expect("same memory");
    let vcpu = Vcpu::new(&vm, 0, Bus::new(), Bus::new()).expect("new vcpu");
    vcpu.restore_state(&state).expect("restore");
    assert_eq!(vcpu.save_state().expect("save again").regs, state.regs);
    let (vcpu, exit) = run_with_deadline(vcpu, Duration::from_secs(5));
    assert_eq!(exit, VcpuExit::Hlt);
    assert_eq!(vcpu.save_state().expect("final state").regs.rax, 10);
    let mut counter = [0u8; 8];
    mem.read(GuestAddress(0x4000), &mut counter).expect("read");
    assert_eq!(u64::from_le_bytes(counter), 10);
}

#[test]
fn a_corrupt_vcpu_state_is_refused_before_any_ioctl() {
    let Some(_kvm) = kvm() else { return };
    let guest = tiny_guest(&[HLT], true, Bus::new());
    let mut state = guest.vcpu.save_state().expect("save");
    assert_eq!(state.lapic.as_ref().map(Vec::len), Some(1024));
    state.lapic = Some(vec![0; 3]);
    assert!(guest.vcpu.restore_state(&state).is_err());
    state.lapic = None;
    state.cpuid.clear();
    assert!(guest.vcpu.restore_state(&state).is_err());
    drop(guest.vm);
}

#[test]
fn triple_faults_are_reported_as_shutdown() {
    let Some(_kvm) = kvm() else { return };
    let non_canonical = [
        0x48, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0x80, // mov rax, 0x8000000000000000
        0xff, 0xe0, // jmp rax                    (#GP with an empty IDT → #DF → triple fault)
    ];
    let unmapped = [
        0x8b, 0x04, 0x25, 0x00, 0x00, 0x00, 0x40, // mov eax, [0x40000000]  (past the 1 GiB identity map: #PF)
        HLT,
    ];
    for code in [&non_canonical[..], &unmapped[..]] {
        let guest = tiny_guest(code, false, Bus::new());
        let (_vcpu, exit) = run_with_deadline(guest.vcpu, Duration::from_secs(5));
        assert_eq!(exit, VcpuExit::Shutdown, "code {code:x?}");
    }
}

#[test]
fn executing_memory_that_does_not_exist_is_an_emulation_error() {
    let Some(_kvm) = kvm() else { return };
    let code = [
        0x48, 0xc7, 0xc0, 0x00, 0x00, 0x00, 0x30, // mov rax, 0x30000000  (mapped by the page tables, no RAM)
        0xff, 0xe0, // jmp rax
    ];
    let guest = tiny_guest(&code, false, Bus::new());
    let (_vcpu, exit) = run_with_deadline(guest.vcpu, Duration::from_secs(5));
    match exit {
        VcpuExit::InternalError(e) => assert_eq!(e.kind, InternalErrorKind::Emulation, "{e}"),
        other => panic!("expected an emulation failure, got {other:?}"),
    }
}

#[test]
fn a_spinning_vcpu_is_stopped_from_another_thread() {
    let Some(_kvm) = kvm() else { return };
    let guest = tiny_guest(&[0xeb, 0xfe], false, Bus::new()); // jmp $
    let thread = guest.vcpu.start().expect("start");
    std::thread::sleep(Duration::from_millis(50));
    assert!(!thread.is_finished(), "jmp $ finished on its own");
    let kicked = Instant::now();
    thread.kick().expect("kick");
    let (_vcpu, exit) = thread.join().expect("join");
    let took = kicked.elapsed();
    assert_eq!(exit.expect("run"), VcpuExit::Stopped);
    assert!(took < Duration::from_millis(100), "stopping took {took:?}");
    println!("a spinning vCPU stopped {took:?} after the kick");
}

#[test]
fn a_vcpu_halted_on_the_irqchip_is_stopped_too() {
    let Some(_kvm) = kvm() else { return };
    let mut code = print(b"ok");
    code.extend([0xfa, HLT]); // cli; hlt: waits in the kernel forever
    let guest = tiny_guest(&code, true, Bus::new());
    let thread = guest.vcpu.start().expect("start");
    let deadline = Instant::now() + Duration::from_secs(5);
    while guest.serial.contents() != b"ok" && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
    std::thread::sleep(Duration::from_millis(20));
    assert!(!thread.is_finished(), "hlt returned to the monitor despite the irqchip");
    let kicked = Instant::now();
    thread.kick().expect("kick");
    let (_vcpu, exit) = thread.join().expect("join");
    let took = kicked.elapsed();
    assert_eq!(exit.expect("run"), VcpuExit::Stopped);
    assert!(took < Duration::from_millis(100), "stopping took {took:?}");
    assert_eq!(guest.serial.contents(), b"ok");
}

/// A minimal ELF64 "kernel": one `PT_LOAD` of `code` at physical `paddr`, entry at the code.
fn tiny_elf(paddr: u64, code: &[u8]) -> Vec<u8> {
    const EHDR: u64 = 64;
    const PHDR: u64 = 56;
    let filesz = EHDR + PHDR + code.len() as u64;
    let mut elf = b"\x7fELF\x02\x01\x01\0\0\0\0\0\0\0\0\0".to_vec(); // ELF64, little endian
    elf.extend(2u16.to_le_bytes()); // e_type: EXEC
    elf.extend(0x3eu16.to_le_bytes()); // e_machine: x86-64
    elf.extend(1u32.to_le_bytes()); // e_version
    elf.extend((paddr + EHDR + PHDR).to_le_bytes()); // e_entry
    elf.extend(EHDR.to_le_bytes()); // e_phoff
    elf.extend(0u64.to_le_bytes()); // e_shoff
    elf.extend(0u32.to_le_bytes()); // e_flags
    elf.extend((EHDR as u16).to_le_bytes()); // e_ehsize
    elf.extend((PHDR as u16).to_le_bytes()); // e_phentsize
    elf.extend(1u16.to_le_bytes()); // e_phnum
    elf.extend([0; 6]); // no sections
    elf.extend(1u32.to_le_bytes()); // p_type: LOAD
    elf.extend(7u32.to_le_bytes()); // p_flags: RWX
    elf.extend(0u64.to_le_bytes()); // p_offset
    elf.extend(paddr.to_le_bytes()); // p_vaddr
    elf.extend(paddr.to_le_bytes()); // p_paddr
    elf.extend(filesz.to_le_bytes()); // p_filesz
    elf.extend(filesz.to_le_bytes()); // p_memsz
    elf.extend(0x1000u64.to_le_bytes()); // p_align
    elf.extend(code);
    elf
}

#[test]
fn a_kernel_booted_with_the_64_bit_protocol_finds_its_command_line() {
    let Some(_kvm) = kvm() else { return };
    let kernel_code = [
        0x8b, 0x9e, 0x28, 0x02, 0x00, 0x00, // mov ebx, [rsi + 0x228]  (boot_params.hdr.cmd_line_ptr)
        0x66, 0xba, 0xf8, 0x03, // mov dx, 0x3f8
        0x8a, 0x03, // loop: mov al, [rbx]
        0x84, 0xc0, //       test al, al
        0x74, 0x06, //       jz done
        0xee, //       out dx, al
        0x48, 0xff, 0xc3, //       inc rbx
        0xeb, 0xf4, //       jmp loop
        HLT,  // done: hlt
    ];
    let mem = GuestMemory::new(16 << 20).expect("memory");
    let mut cmdline = Cmdline::new(CMDLINE_MAX_SIZE).expect("cmdline");
    cmdline.insert_str("console=ttyS0 reboot=k").expect("cmdline");
    cmdline.add_virtio_mmio_device(0x1000, GuestAddress(MMIO_GAP_START), 5, None).expect("virtio device");
    let kernel = tiny_elf(0x20_0000, &kernel_code);
    let loaded =
        boot::load_kernel(&mem, &mut Cursor::new(kernel), &cmdline, None, BootProtocol::Linux64).expect("load");

    let mut vm = Vm::new(&VmConfig { irqchip: false }).expect("vm");
    vm.register_memory(&mem).expect("memory");
    let (io, serial) = serial_bus(&vm);
    let serial = serial.lock().expect("serial").log();
    let vcpu = Vcpu::new(&vm, 0, io, Bus::new()).expect("vcpu");
    vcpu.configure(&vm, &VcpuConfig::default()).expect("configure");
    vcpu.set_entry(&loaded.entry).expect("entry");
    let (_vcpu, exit) = run_with_deadline(vcpu, Duration::from_secs(5));
    assert_eq!(exit, VcpuExit::Hlt);
    assert_eq!(
        String::from_utf8_lossy(&serial.contents()),
        "console=ttyS0 reboot=k virtio_mmio.device=4K@0xd0000000:5"
    );
}

#[test]
fn a_torn_down_vm_leaves_no_fds_or_threads() {
    let Some(_kvm) = kvm() else { return };
    let before = Held::now();
    for _ in 0..20 {
        let mut code = print(b"x");
        code.push(HLT);
        let guest = tiny_guest(&code, true, Bus::new());
        let thread = guest.vcpu.start().expect("start");
        while guest.serial.contents().is_empty() {
            std::thread::sleep(Duration::from_millis(1));
        }
        thread.kick().expect("kick");
        drop(thread.join().expect("join"));
    }
    let left = Held::now().since(&before);
    assert!(left.is_empty(), "left behind: {left:?}");
}
