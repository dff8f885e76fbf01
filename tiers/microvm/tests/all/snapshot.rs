//! microVM snapshots on real KVM with tiny hand-assembled guests: pause mid-run, save, restore into a new monitor
//! that continues from exactly the saved state, fork twice over one memory file, refuse damaged snapshots, and
//! carry virtio-mmio device state across.
//!
//! Without `/dev/kvm` each test prints one `skip:` line and passes.

use std::fs::OpenOptions;
use std::io::Write;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::Path;
use std::time::Duration;

use strata_core::{Persisted, SnapshotError, SnapshotTrust, SnapshotWriter, TierKind};
use strata_tier_microvm::devices::serial::SerialLog;
use strata_tier_microvm::devices::virtio::block::persist::BlockConstructorArgs;
use strata_tier_microvm::machine::MachineError;
use strata_tier_microvm::machine::{Machine, VirtioTransport};
use strata_tier_microvm::persist::{MEMORY_FILE, MicrovmState, RestoreArgs, STATE_FILE};
use strata_tier_microvm::snapshot::{VmSnapshot, VmSnapshotError};
use strata_tier_microvm::vstate::vcpu::VcpuExit;
use strata_tier_microvm::vstate::vcpu::state::VcpuState;
use strata_vmm::test_utils::driver::{STATUS_LIVE, activate, write_reg};
use strata_vmm::test_utils::process::{Held, kvm};
use strata_vmm::test_utils::tiny::*;

/// What these tests seal and open snapshots with: a key of this process.
fn trust() -> SnapshotTrust {
    SnapshotTrust::process_local()
}

fn vcpu_state(machine: &Machine) -> VcpuState {
    machine.vcpus()[0].save_state().expect("vCPU state")
}

fn counter(machine: &Machine) -> u64 {
    u64::from_le_bytes(read_mem(machine.memory(), 0x4000, 8).try_into().expect("8 bytes"))
}

/// The counting guest's invariants at a pause, given everything it wrote to the console (`log`, from its first
/// byte): the console holds 1, 2, 3, ... (low bytes) without a gap or a repeat, and `rax` and `[0x4000]` agree
/// with the console and with where `rip` stopped. A pause that left an `out` half done would break them.
fn check_counter(log: &[u8], state: &VcpuState, memory_counter: u64) {
    for (i, byte) in log.iter().enumerate() {
        assert_eq!(*byte, (i as u64 + 1) as u8, "console byte {i} breaks the count (log of {} bytes)", log.len());
    }
    let written = log.len() as u64;
    let at = state.regs.rip - CODE;
    let (rax, mem) = match at {
        COUNTER_INC | COUNTER_JMP => (written, written),
        COUNTER_MOV => (written + 1, written),
        COUNTER_OUT => (written + 1, written + 1),
        other => panic!("rip stopped at {other:#x}, not on an instruction boundary of the loop"),
    };
    assert_eq!(state.regs.rax, rax, "rax at rip offset {at}, {written} bytes written");
    assert_eq!(memory_counter, mem, "[0x4000] at rip offset {at}, {written} bytes written");
}

#[test]
fn a_paused_guest_continues_from_exactly_its_state_in_a_new_monitor() {
    let Some(_kvm) = kvm() else { return };
    let dir = tempfile::tempdir().expect("tempdir");
    let mut machine = tiny_machine(&counter_code(), false);
    let log = machine.serial_log().expect("serial");
    run_until(&mut machine, Duration::from_secs(10), |_| log.contents().len() >= 300);
    let exits = machine.pause().expect("pause");
    assert_eq!(exits, vec![VcpuExit::Stopped], "the counter never stops on its own");
    let saved = vcpu_state(&machine);
    let before = log.contents();
    check_counter(&before, &saved, counter(&machine));
    let original_memory = read_mem(machine.memory(), 0, MEM_SIZE as usize);

    let path = dir.path().join("snap");
    let snap = VmSnapshot::save(&mut machine, &path, None, &trust()).expect("snapshot");
    assert_eq!(snap.snapshot().tier, TierKind::Microvm);
    assert_eq!(snap.snapshot().manifest.persists, vec![Persisted::Memory, Persisted::Cpu, Persisted::Devices]);
    assert_eq!(std::fs::read(path.join(MEMORY_FILE)).expect("memory file"), original_memory);
    let allocated = std::fs::metadata(path.join(MEMORY_FILE)).expect("metadata").blocks() * 512;
    assert!(allocated < MEM_SIZE / 4, "the memory file is sparse: {allocated} bytes allocated");
    drop(machine);

    // Another monitor: opened from disk (checksums, state validation), rebuilt, nothing shared with the first.
    let snap = VmSnapshot::open(&path, &trust()).expect("open");
    assert_eq!(snap.state().vcpus[0].regs, saved.regs);
    let new_log = SerialLog::new(64 * 1024);
    let mut restored =
        snap.restore(RestoreArgs { serial_log: Some(new_log.clone()), ..Default::default() }).expect("restore");
    let state = vcpu_state(&restored);
    assert_eq!(state.regs, saved.regs, "registers");
    assert_eq!(state.sregs, saved.sregs, "special registers");
    assert_eq!(state.fpu, saved.fpu, "FPU");
    assert_eq!(state.debug_regs, saved.debug_regs, "debug registers");
    assert_eq!(read_mem(restored.memory(), 0, MEM_SIZE as usize), original_memory, "memory");
    assert!(new_log.contents().is_empty());

    run_until(&mut restored, Duration::from_secs(10), |_| new_log.contents().len() >= 100);
    assert_eq!(restored.pause().expect("pause"), vec![VcpuExit::Stopped]);
    let after = new_log.contents();
    let mut whole = before.clone();
    whole.extend_from_slice(&after);
    check_counter(&whole, &vcpu_state(&restored), counter(&restored));
    println!("counted {} before the snapshot and {} after the restore", before.len(), after.len());

    // The restored machine can be snapshotted again, and says where it came from.
    let again =
        VmSnapshot::save(&mut restored, &dir.path().join("again"), Some(snap.snapshot().manifest.id.clone()), &trust())
            .expect("snapshot");
    assert_eq!(again.snapshot().manifest.parent.as_deref(), Some(snap.snapshot().manifest.id.as_str()));
}

#[test]
fn a_vcpu_stopped_right_after_an_io_exit_is_settled_before_it_is_saved() {
    let Some(_kvm) = kvm() else { return };
    let dir = tempfile::tempdir().expect("tempdir");
    let mut machine = tiny_machine(&counter_code(), false);
    let log = machine.serial_log().expect("serial");
    // Driven on this thread: the fifth `out` was handed to COM1, and the vCPU has not been back in KVM_RUN since.
    let mut outs = 0;
    while outs < 5 {
        match machine.vcpus_mut()[0].run_once().expect("run") {
            VcpuExit::IoOut { port: 0x3f8, .. } => outs += 1,
            other => panic!("unexpected exit {other:?}"),
        }
    }
    assert_eq!(log.contents(), [1, 2, 3, 4, 5]);
    let snap = VmSnapshot::save(&mut machine, &dir.path().join("snap"), None, &trust()).expect("snapshot");
    check_counter(&log.contents(), &snap.state().vcpus[0], counter(&machine));
    let new_log = SerialLog::new(4096);
    let mut restored =
        snap.fork(RestoreArgs { serial_log: Some(new_log.clone()), ..Default::default() }).expect("fork");
    for _ in 0..3 {
        let exit = restored.vcpus_mut()[0].run_once().expect("run");
        assert!(matches!(exit, VcpuExit::IoOut { port: 0x3f8, .. }), "{exit:?}");
    }
    assert_eq!(new_log.contents(), [6, 7, 8], "the byte before the snapshot was neither repeated nor lost");

    // An `in` is only half done when KVM_RUN returns: the value reaches RAX (and RIP moves on) on the next entry.
    let code = [
        0x66, 0xba, 0xff, 0x03, // mov dx, 0x3ff       (COM1 scratch register)
        0xec, // in al, dx
        0x88, 0x04, 0x25, 0x00, 0x40, 0x00, 0x00, // mov [0x4000], al
        HLT,
    ];
    let mut machine = tiny_machine(&code, false);
    let serial = machine.devices().serial.clone().expect("serial");
    write_reg8(&mut *serial.lock().expect("lock"), 7, 0x5a);
    let exit = machine.vcpus_mut()[0].run_once().expect("run");
    assert!(matches!(exit, VcpuExit::IoIn { port: 0x3ff, .. }), "{exit:?}");
    let snap = VmSnapshot::save(&mut machine, &dir.path().join("in"), None, &trust()).expect("snapshot");
    let regs = snap.state().vcpus[0].regs;
    assert_eq!((regs.rip - CODE, regs.rax & 0xff), (5, 0x5a), "the `in` was completed before the save");
    let mut fork = snap.fork(RestoreArgs::default()).expect("fork");
    assert_eq!(fork.vcpus_mut()[0].run().expect("run"), VcpuExit::Hlt);
    assert_eq!(read_mem(fork.memory(), 0x4000, 1), [0x5a]);
}

fn write_reg8(device: &mut dyn strata_tier_microvm::devices::bus::BusDevice, offset: u64, value: u8) {
    device.write(offset, &[value]);
}

/// Prints "ready", halts (the snapshot is taken there), then reads the vsock CID from the device's configuration
/// space, fills the page at 0x5000 with its low byte, stores it at `[0x4000]`, prints it and halts.
fn fork_code() -> Vec<u8> {
    let mut code = print(b"ready");
    code.push(HLT);
    code.extend([
        0x8b, 0x04, 0x25, 0x00, 0x01, 0x00, 0x10, // mov eax, [0x10000100]   (vsock config: guest_cid)
        0x48, 0xc7, 0xc7, 0x00, 0x50, 0x00, 0x00, // mov rdi, 0x5000
        0xb9, 0x00, 0x10, 0x00, 0x00, // mov ecx, 0x1000
        0xf3, 0xaa, // rep stosb
        0x89, 0x04, 0x25, 0x00, 0x40, 0x00, 0x00, // mov [0x4000], eax
        0xee, // out dx, al
        HLT,
    ]);
    code
}

#[test]
fn two_forks_of_one_snapshot_have_independent_memory() {
    let Some(_kvm) = kvm() else { return };
    let dir = tempfile::tempdir().expect("tempdir");
    let mut parts = parts(&fork_code(), false);
    let vsock = parts.add_vsock(MMIO_BASE, 5, 3, &dir.path().join("parent.sock"));
    activate(&mut *vsock.lock().expect("lock"), 3, 8, 0x40000);
    let mut machine = parts.machine();
    let log = machine.serial_log().expect("serial");
    run_until(&mut machine, Duration::from_secs(10), |_| false);
    assert_eq!(machine.pause().expect("pause"), vec![VcpuExit::Hlt]);
    assert_eq!(log.contents(), b"ready");
    let snap = VmSnapshot::save(&mut machine, &dir.path().join("snap"), None, &trust()).expect("snapshot");
    let memory_file = std::fs::read(snap.memory_path()).expect("memory file");

    let fork = |cid: u64, name: &str| {
        let args = RestoreArgs {
            vsock_uds: Some(dir.path().join(name)),
            guest_cid: Some(cid),
            serial_log: Some(SerialLog::new(4096)),
            ..Default::default()
        };
        snap.fork(args).expect("fork")
    };
    let mut a = fork(5, "a.sock");
    let mut b = fork(6, "b.sock");
    for (machine, cid) in [(&mut a, 5u8), (&mut b, 6u8)] {
        run_until(machine, Duration::from_secs(10), |_| false);
        assert_eq!(machine.pause().expect("pause"), vec![VcpuExit::Hlt]);
        assert_eq!(machine.serial_log().expect("serial").contents(), [cid]);
    }
    for (machine, cid) in [(&a, 5u8), (&b, 6u8)] {
        assert_eq!(read_mem(machine.memory(), 0x5000, 0x1000), vec![cid; 0x1000], "fork {cid}'s page");
        assert_eq!(counter(machine), u64::from(cid), "fork {cid}'s [0x4000]");
    }
    // Neither fork's writes reached the file, the parent, or a third fork.
    assert_eq!(std::fs::read(snap.memory_path()).expect("memory file"), memory_file);
    assert_eq!(read_mem(machine.memory(), 0x5000, 0x1000), vec![0; 0x1000]);
    let mut c = fork(7, "c.sock");
    assert_eq!(read_mem(c.memory(), 0x5000, 0x1000), vec![0; 0x1000]);
    assert_eq!(read_mem(c.memory(), 0, MEM_SIZE as usize), memory_file);
    // A fork's snapshot holds the fork's own writes (read through its private mapping).
    let of_a = VmSnapshot::save(&mut a, &dir.path().join("of-a"), Some(snap.snapshot().manifest.id.clone()), &trust())
        .expect("snapshot");
    let a_memory = read_mem(a.memory(), 0, MEM_SIZE as usize);
    assert_eq!(std::fs::read(of_a.memory_path()).expect("memory file"), a_memory);
    // Each fork carries the parent's transport, with its own identity.
    let parent_transport = machine.save_state().expect("state").devices.virtio[0].transport.clone();
    for fork in [&mut a, &mut b, &mut c] {
        assert_eq!(fork.save_state().expect("state").devices.virtio[0].transport, parent_transport);
    }
}

#[test]
fn forks_survive_their_memory_file_truncated_or_rewritten() {
    let Some(_kvm) = kvm() else { return };
    let dir = tempfile::tempdir().expect("tempdir");
    let mut parts = parts(&fork_code(), false);
    let vsock = parts.add_vsock(MMIO_BASE, 5, 3, &dir.path().join("parent.sock"));
    activate(&mut *vsock.lock().expect("lock"), 3, 8, 0x40000);
    let mut machine = parts.machine();
    run_until(&mut machine, Duration::from_secs(10), |_| false);
    assert_eq!(machine.pause().expect("pause"), vec![VcpuExit::Hlt]);
    let snap = VmSnapshot::save(&mut machine, &dir.path().join("snap"), None, &trust()).expect("snapshot");
    let memory_file = std::fs::read(snap.memory_path()).expect("memory file");
    let fork = |cid: u64, name: &str| {
        let args = RestoreArgs {
            vsock_uds: Some(dir.path().join(name)),
            guest_cid: Some(cid),
            serial_log: Some(SerialLog::new(4096)),
            ..Default::default()
        };
        snap.fork(args).expect("fork")
    };
    let mut a = fork(5, "a.sock");
    // Truncated under the live fork: a mapping of the file would raise SIGBUS in this process at the next read
    // of a page the fork had not touched. The fork maps the private copy, so it runs on and reads every page.
    OpenOptions::new().write(true).open(snap.memory_path()).expect("open").set_len(0).expect("truncate");
    run_until(&mut a, Duration::from_secs(10), |_| false);
    assert_eq!(a.pause().expect("pause"), vec![VcpuExit::Hlt]);
    assert_eq!(a.serial_log().expect("serial").contents(), [5]);
    // Every page read (each one a SIGBUS before): the fork's own writes, the rest as it was.
    let all = read_mem(a.memory(), 0, MEM_SIZE as usize);
    assert_eq!(all[0x5000..0x6000], [5; 0x1000]);
    assert_eq!(counter(&a), 5);
    assert_eq!(all[..0x4000], memory_file[..0x4000]);
    // Rewritten with other bytes of the right size: a new fork of this verified snapshot still starts from the
    // bytes that were sealed, never from the file's new ones.
    std::fs::write(snap.memory_path(), vec![0xcc; memory_file.len()]).expect("rewrite");
    let b = fork(6, "b.sock");
    assert_eq!(read_mem(b.memory(), 0, MEM_SIZE as usize), memory_file);
    // Opened again from the directory, the rewritten snapshot is refused.
    assert!(VmSnapshot::open(&dir.path().join("snap"), &trust()).is_err());
}

/// Whether an error is the one a damaged snapshot should get.
type ErrorCheck = fn(&VmSnapshotError) -> bool;

fn damage(path: &Path, at: u64) {
    let file = OpenOptions::new().read(true).write(true).open(path).expect("open");
    let mut byte = [0u8];
    file.read_exact_at(&mut byte, at).expect("read");
    file.write_all_at(&[byte[0] ^ 0x40], at).expect("write");
}

/// A snapshot directory whose manifest is sound around a state file of our choosing.
fn sealed_snapshot(dest: &Path, state: &[u8], memory: &[u8]) {
    let writer = SnapshotWriter::create(dest, &trust()).expect("writer");
    std::fs::write(writer.dir().join(STATE_FILE), state).expect("state");
    std::fs::write(writer.dir().join(MEMORY_FILE), memory).expect("memory");
    writer.commit(TierKind::Microvm, None, vec![Persisted::Memory], serde_json::json!({})).expect("commit");
}

#[test]
fn damaged_snapshots_are_refused_with_typed_errors() {
    let Some(_kvm) = kvm() else { return };
    let dir = tempfile::tempdir().expect("tempdir");
    let mut machine = tiny_machine(&counter_code(), false);
    run_until(&mut machine, Duration::from_secs(10), |m| counter(m) >= 10);
    machine.pause().expect("pause");
    let good = dir.path().join("good");
    let snap = VmSnapshot::save(&mut machine, &good, None, &trust()).expect("snapshot");
    let state_bytes = std::fs::read(good.join(STATE_FILE)).expect("state");
    let memory = std::fs::read(good.join(MEMORY_FILE)).expect("memory");

    let copy = |name: &str| {
        let to = dir.path().join(name);
        std::fs::create_dir(&to).expect("mkdir");
        for entry in std::fs::read_dir(&good).expect("read dir") {
            let entry = entry.expect("entry");
            std::fs::copy(entry.path(), to.join(entry.file_name())).expect("copy");
        }
        to
    };

    // The store's checks: a flipped memory byte, a truncated memory file, a flipped state byte.
    let flipped = copy("flipped");
    damage(&flipped.join(MEMORY_FILE), 0x1234);
    assert!(matches!(VmSnapshot::open(&flipped, &trust()), Err(VmSnapshotError::Store(SnapshotError::Checksum(_)))));
    let truncated = copy("truncated");
    OpenOptions::new().write(true).open(truncated.join(MEMORY_FILE)).expect("open").set_len(4096).expect("truncate");
    assert!(matches!(
        VmSnapshot::open(&truncated, &trust()),
        Err(VmSnapshotError::Store(SnapshotError::SizeMismatch { .. }))
    ));
    let state_flip = copy("state-flip");
    damage(&state_flip.join(STATE_FILE), 30);
    assert!(matches!(VmSnapshot::open(&state_flip, &trust()), Err(VmSnapshotError::Store(SnapshotError::Checksum(_)))));
    let appended = copy("appended");
    OpenOptions::new().append(true).open(appended.join(STATE_FILE)).expect("open").write_all(b"x").expect("append");
    assert!(matches!(
        VmSnapshot::open(&appended, &trust()),
        Err(VmSnapshotError::Store(SnapshotError::SizeMismatch { .. }))
    ));

    // Our own checks, behind a sound manifest: the state file's header, length, shape and contents.
    let cases: Vec<(&str, Vec<u8>, ErrorCheck)> = vec![
        ("truncated state", state_bytes[..state_bytes.len() / 2].to_vec(), |e| {
            matches!(e, VmSnapshotError::Machine(MachineError::StateLength { .. }))
        }),
        ("short header", state_bytes[..7].to_vec(), |e| {
            matches!(e, VmSnapshotError::Machine(MachineError::NotAState { .. }))
        }),
        ("other version", [&state_bytes[..8], &7u32.to_le_bytes(), &state_bytes[12..]].concat(), |e| {
            matches!(e, VmSnapshotError::Machine(MachineError::StateVersion { found: 7, .. }))
        }),
        ("huge length", [&state_bytes[..12], &u64::MAX.to_le_bytes(), &state_bytes[20..]].concat(), |e| {
            matches!(e, VmSnapshotError::Machine(MachineError::StateTooLarge { .. }))
        }),
        (
            "body garbage",
            {
                let mut bytes = state_bytes.clone();
                let at = bytes.len() / 2;
                bytes[at] = b'}';
                bytes
            },
            |e| matches!(e, VmSnapshotError::Machine(MachineError::StateFormat(_))),
        ),
        (
            "no vCPUs",
            {
                let mut state = snap.state().clone();
                state.vcpus.clear();
                state.to_bytes().expect("bytes")
            },
            |e| matches!(e, VmSnapshotError::Machine(MachineError::InvalidState(_))),
        ),
        (
            "a 3-byte LAPIC",
            {
                let mut state = snap.state().clone();
                state.vcpus[0].lapic = Some(vec![0; 3]);
                state.to_bytes().expect("bytes")
            },
            |e| {
                matches!(
                    e,
                    VmSnapshotError::Machine(MachineError::Vcpu { .. })
                        | VmSnapshotError::Machine(MachineError::InvalidState(_))
                )
            },
        ),
        (
            "memory size disagrees",
            {
                let mut state = snap.state().clone();
                state.memory_bytes *= 2;
                state.to_bytes().expect("bytes")
            },
            |e| matches!(e, VmSnapshotError::Machine(MachineError::MemorySize { .. })),
        ),
    ];
    for (i, (what, bytes, expected)) in cases.into_iter().enumerate() {
        let dest = dir.path().join(format!("case-{i}"));
        sealed_snapshot(&dest, &bytes, &memory);
        match VmSnapshot::open(&dest, &trust()) {
            Err(e) if expected(&e) => println!("{what}: {e}"),
            Err(e) => panic!("{what}: unexpected error {e:?}"),
            Ok(_) => panic!("{what} was accepted"),
        }
    }
    // A snapshot of another tier.
    let other = dir.path().join("process");
    let writer = SnapshotWriter::create(&other, &trust()).expect("writer");
    std::fs::write(writer.dir().join("upper.tar"), b"x").expect("write");
    writer.commit(TierKind::Process, None, vec![Persisted::Filesystem], serde_json::json!({})).expect("commit");
    assert!(matches!(VmSnapshot::open(&other, &trust()), Err(VmSnapshotError::Store(SnapshotError::WrongTier { .. }))));
    // The good one still opens.
    VmSnapshot::open(&good, &trust()).expect("the undamaged snapshot");
}

#[test]
fn virtio_mmio_device_state_round_trips() {
    let Some(_kvm) = kvm() else { return };
    let dir = tempfile::tempdir().expect("tempdir");
    let disk = dir.path().join("disk.img");
    std::fs::write(&disk, vec![7u8; 16 * 512]).expect("disk");
    // After the restore, the guest reads the vsock's Status and config (CID) and the block device's config
    // (capacity) through the MMIO bus and stores them at 0x3000.
    let code = [
        0x8b, 0x04, 0x25, 0x70, 0x00, 0x00, 0x10, // mov eax, [0x10000070]   vsock Status
        0x89, 0x04, 0x25, 0x00, 0x30, 0x00, 0x00, // mov [0x3000], eax
        0x8b, 0x04, 0x25, 0x00, 0x01, 0x00, 0x10, // mov eax, [0x10000100]   vsock guest_cid
        0x89, 0x04, 0x25, 0x04, 0x30, 0x00, 0x00, // mov [0x3004], eax
        0x8b, 0x04, 0x25, 0x00, 0x11, 0x00, 0x10, // mov eax, [0x10001100]   blk capacity (sectors)
        0x89, 0x04, 0x25, 0x08, 0x30, 0x00, 0x00, // mov [0x3008], eax
        0x8b, 0x04, 0x25, 0x70, 0x10, 0x00, 0x10, // mov eax, [0x10001070]   blk Status
        0x89, 0x04, 0x25, 0x0c, 0x30, 0x00, 0x00, // mov [0x300c], eax
        HLT,
    ];
    let mut parts = parts(&code, true);
    let vsock = parts.add_vsock(MMIO_BASE, 5, 9, &dir.path().join("parent.sock"));
    let block = parts.add_block(MMIO_BASE + 0x1000, 6, &disk);
    activate(&mut *vsock.lock().expect("lock"), 3, 8, 0x40000);
    {
        // The block driver got as far as FEATURES_OK and queue 0's size; the device is not live yet.
        let mut t = block.lock().expect("lock");
        for status in [0, 1, 3] {
            write_reg(&mut *t, 0x70, status);
        }
        write_reg(&mut *t, 0x24, 1);
        write_reg(&mut *t, 0x20, 1);
        write_reg(&mut *t, 0x70, 0xb);
        write_reg(&mut *t, 0x30, 0);
        write_reg(&mut *t, 0x38, 16);
        write_reg(&mut *t, 0x80, 0x60000);
    }
    let mut machine = parts.machine();
    let saved = machine.save_state().expect("state");
    assert_eq!(saved.devices.virtio.len(), 2);
    assert!(saved.vm.irqchip.is_some() && saved.vm.pit.is_some() && saved.vcpus[0].lapic.is_some());
    let snap = VmSnapshot::save(&mut machine, &dir.path().join("snap"), None, &trust()).expect("snapshot");

    let reopened = VmSnapshot::open(snap.snapshot().dir.as_path(), &trust()).expect("open");
    assert!(reopened.state() == snap.state(), "the state file round-trips");
    let mut restored = reopened
        .restore(RestoreArgs {
            vsock_uds: Some(dir.path().join("restored.sock")),
            disks: vec![BlockConstructorArgs::at(disk.clone())],
            ..Default::default()
        })
        .expect("restore");
    let state = restored.save_state().expect("state");
    assert_eq!(state.devices, saved.devices, "devices");
    assert_eq!(state.vm.irqchip, saved.vm.irqchip, "PICs and IOAPIC");
    assert_eq!(
        state.vm.pit.map(|p| p.channels.map(|c| (c.mode, c.count))),
        saved.vm.pit.map(|p| p.channels.map(|c| (c.mode, c.count)))
    );
    assert_eq!(state.vcpus[0].lapic, saved.vcpus[0].lapic, "LAPIC");
    match &restored.devices().virtio[0].transport {
        VirtioTransport::Vsock(t) => {
            let t = t.lock().expect("lock");
            assert!(t.is_activated());
            assert!(t.device().transport_reset_pending(), "the guest is told its connections are gone");
        }
        other => panic!("slot 0 is {other:?}"),
    }

    // What the guest sees through the bus after the restore.
    run_until(&mut restored, Duration::from_secs(10), |m| read_mem(m.memory(), 0x300c, 4) != [0; 4]);
    let seen = read_mem(restored.memory(), 0x3000, 16);
    let word = |i: usize| u32::from_le_bytes(seen[i * 4..i * 4 + 4].try_into().expect("4 bytes"));
    assert_eq!((word(0), word(1), word(2), word(3)), (STATUS_LIVE, 9, 16, 0xb));
    restored.pause().expect("pause");

    // Missing host resources are typed errors.
    assert!(matches!(
        reopened.fork(RestoreArgs { disks: vec![BlockConstructorArgs::at(disk)], ..Default::default() }),
        Err(VmSnapshotError::Machine(MachineError::MissingArg { index: 0, .. }))
    ));
    let resized = dir.path().join("resized.img");
    std::fs::write(&resized, vec![0u8; 512]).expect("disk");
    assert!(matches!(
        reopened.fork(RestoreArgs {
            vsock_uds: Some(dir.path().join("x.sock")),
            disks: vec![BlockConstructorArgs::at(resized)],
            ..Default::default()
        }),
        Err(VmSnapshotError::Machine(MachineError::Block { index: 1, .. }))
    ));
}

#[test]
fn a_state_moves_between_monitors_in_memory_too() {
    let Some(_kvm) = kvm() else { return };
    let mut machine = tiny_machine(&counter_code(), true);
    run_until(&mut machine, Duration::from_secs(10), |m| counter(m) >= 5);
    machine.pause().expect("pause");
    let state = machine.save_state().expect("state");
    let bytes = state.to_bytes().expect("bytes");
    assert_eq!(MicrovmState::from_bytes(&bytes, Path::new("mem")).expect("parse"), state);
}

#[test]
fn snapshots_restores_and_forks_leave_nothing_behind() {
    let Some(_kvm) = kvm() else { return };
    let dir = tempfile::tempdir().expect("tempdir");
    // Warm up process-wide caches (the MSR list, the kick handler) before counting.
    {
        let mut m = tiny_machine(&counter_code(), false);
        run_until(&mut m, Duration::from_secs(10), |m| counter(m) >= 3);
        m.pause().expect("pause");
        let snap = VmSnapshot::save(&mut m, &dir.path().join("warm"), None, &trust()).expect("snapshot");
        drop(snap.fork(RestoreArgs::default()).expect("fork"));
    }
    let before = Held::now();
    for i in 0..5 {
        let mut m = tiny_machine(&counter_code(), true);
        run_until(&mut m, Duration::from_secs(10), |m| counter(m) >= 3);
        m.pause().expect("pause");
        let snap = VmSnapshot::save(&mut m, &dir.path().join(format!("s{i}")), None, &trust()).expect("snapshot");
        let mut restored = snap.restore(RestoreArgs::default()).expect("restore");
        let mut fork = snap.fork(RestoreArgs::default()).expect("fork");
        restored.resume().expect("resume");
        fork.resume().expect("resume");
        // Dropped while running: the machine stops and joins its threads.
    }
    let left = Held::now().since(&before);
    assert!(left.is_empty(), "left behind: {left:?}");
}

/// What an attacker who can write where snapshots live does, without the key: rewrite the manifest (capabilities
/// for every fork, a file's sha256 recomputed to match a swapped file), carry one over from another home, or swap
/// the memory file for a link to a host file after the snapshot was opened. None of it is ever restored.
#[test]
fn rewritten_swapped_and_foreign_snapshots_are_refused() {
    let Some(_kvm) = kvm() else { return };
    let dir = tempfile::tempdir().expect("tempdir");
    let mut machine = tiny_machine(&counter_code(), false);
    run_until(&mut machine, Duration::from_secs(10), |m| counter(m) >= 10);
    machine.pause().expect("pause");
    let good = dir.path().join("good");
    VmSnapshot::save(&mut machine, &good, None, &trust()).expect("snapshot");
    let manifest_path = good.join("manifest.json");
    let original = std::fs::read(&manifest_path).expect("manifest");

    // Capabilities added to the manifest's meta: refused at the seal.
    let mut manifest: serde_json::Value = serde_json::from_slice(&original).expect("json");
    manifest["meta"]["caps"] = serde_json::json!({"grants": [{"host": "/", "guest": "/host", "mode": "rw"}]});
    std::fs::write(&manifest_path, serde_json::to_vec_pretty(&manifest).expect("json")).expect("rewrite");
    assert!(matches!(VmSnapshot::open(&good, &trust()), Err(VmSnapshotError::Store(SnapshotError::Seal(_)))));
    // Another state file with its sha256 and size fixed up in the manifest: refused at the seal too.
    std::fs::write(&manifest_path, &original).expect("restore");
    let mut manifest: serde_json::Value = serde_json::from_slice(&original).expect("json");
    for file in manifest["files"].as_array_mut().expect("files") {
        if file["path"] == STATE_FILE {
            file["sha256"] = serde_json::json!("0".repeat(64));
        }
    }
    std::fs::write(&manifest_path, serde_json::to_vec_pretty(&manifest).expect("json")).expect("rewrite");
    assert!(matches!(VmSnapshot::open(&good, &trust()), Err(VmSnapshotError::Store(SnapshotError::Seal(_)))));
    std::fs::write(&manifest_path, &original).expect("restore");
    // Sealed in another home (another key).
    let other = SnapshotTrust::new(strata_core::SnapshotKey::from_bytes([3; 32]));
    assert!(matches!(VmSnapshot::open(&good, &other), Err(VmSnapshotError::Store(SnapshotError::Seal(_)))));

    // Opened while whole, then its memory swapped for a link to a host file of the same size: the fork is refused
    // (it would otherwise map the host file as the guest's RAM).
    let snap = VmSnapshot::open(&good, &trust()).expect("whole");
    let host_file = dir.path().join("host-file");
    std::fs::write(&host_file, vec![0x77u8; snap.state().memory_bytes as usize]).expect("host file");
    let memory = good.join(MEMORY_FILE);
    let saved = dir.path().join("memory.saved");
    std::fs::rename(&memory, &saved).expect("mv");
    std::os::unix::fs::symlink(&host_file, &memory).expect("symlink");
    let refused = |what: &str, result: Result<Machine, VmSnapshotError>| match result {
        Err(VmSnapshotError::Store(err)) => assert_eq!(err.code(), "snapshot_invalid", "{what}: {err}"),
        Err(other) => panic!("{what}: unexpected error {other:?}"),
        Ok(machine) => panic!("{what}: restored; its RAM starts {:x?}", &read_mem(machine.memory(), 0, 4)),
    };
    refused("fork over a link", snap.fork(RestoreArgs::default()));
    refused("restore over a link", snap.restore(RestoreArgs::default()));
    // The same bytes in a file of its own in place (a new inode): not the file that was verified.
    std::fs::remove_file(&memory).expect("rm");
    std::fs::copy(&host_file, &memory).expect("copy");
    refused("fork of a replaced file", snap.fork(RestoreArgs::default()));
    std::fs::remove_file(&memory).expect("rm");
    std::fs::rename(&saved, &memory).expect("mv back");
    // Moved out and back its change time moved: verified again (hashed), then it forks.
    assert!(matches!(snap.fork(RestoreArgs::default()), Err(VmSnapshotError::Store(SnapshotError::Changed(_)))));
    let again = VmSnapshot::from_verified(trust().reopen(snap.snapshot()).expect("verified again")).expect("state");
    again.fork(RestoreArgs::default()).expect("the verified file forks");
}
