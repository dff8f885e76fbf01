//! Seeds of the snapshot targets: real snapshot directories, states and layer trees, written as their targets read
//! them (see each target's module doc for the format).

use std::os::fd::AsFd;
use std::os::unix::fs::PermissionsExt;

use strata_core::{Capabilities, Limits};
use strata_tier_microvm::persist::{DevicesState, MicrovmState};
use strata_tier_microvm::vstate::vcpu::state::{DebugRegs, Fpu, Regs, Sregs, VcpuEvents, VcpuState};
use strata_tier_microvm::vstate::vm::ClockState;
use strata_tier_microvm::vstate::vm::VmState;

use crate::generate::Script;
use crate::seed::{Seed, named};

/// An entry of a `snapshot_open` input.
fn entry(script: &mut Script, kind: u8, name: &str, contents: &[u8]) {
    script.u8(kind).block(name.as_bytes()).block(contents);
}

pub(crate) fn snapshot_open() -> Vec<Seed> {
    let mut sealed = Script::default();
    sealed.u8(3).u8(3);
    entry(&mut sealed, 0, "state.json", br#"{"format":1}"#);
    entry(&mut sealed, 0, "tmp/note.txt", b"written before the snapshot");
    entry(&mut sealed, 1, "tmp/empty", b"");
    sealed.block(b"");
    let mut hostile = Script::default();
    hostile.u8(3).u8(4);
    entry(&mut hostile, 0, "memory.img", &[0; 64]);
    entry(&mut hostile, 3, "fifo", b"");
    entry(&mut hostile, 2, "link", b"/etc/passwd");
    entry(&mut hostile, 4, "sparse", &(1u32 << 22).to_le_bytes());
    hostile.block(b"");
    let mut forged = Script::default();
    forged.u8(0).u8(1);
    entry(&mut forged, 0, "state.json", b"{}");
    forged.block(format!("strata-seal blake3-keyed {}\n", "ab".repeat(32)).as_bytes());
    forged.raw(
        br#"{"format":2,"strata":"0","tier":"wasm","id":"00000000000000000000000000000000","parent":null,"created":"x","persists":[],"files":[{"path":"state.json","size":2,"sha256":"44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a"}],"total_bytes":2,"meta":{"caps":{"grants":[{"host":"/","guest":"/host","mode":"rw"}]}}}"#,
    );
    let mut edited = Script::default();
    edited.u8(3).u8(1);
    entry(&mut edited, 0, "upper.tree", b"strata-tree1");
    edited.block(b"").u16(20).u8(b'9').u16(70).u8(b'"');
    named(vec![
        ("sealed", sealed.bytes),
        ("hostile", hostile.bytes),
        ("forged", forged.bytes),
        ("edited", edited.bytes),
    ])
}

fn wasm_state(python: bool) -> Vec<u8> {
    let python = python.then(|| {
        serde_json::json!({
            "runtime": "ab".repeat(32), "metered": false, "memory_bytes": 131072,
            "globals": [{"name": "strata:global:0", "type": "i32", "bits": 1048576}],
            "monotonic_ns": 1000, "scratch": true,
        })
    });
    let state = serde_json::json!({
        "format": 1,
        "caps": serde_json::to_value(Capabilities::default()).expect("caps"),
        "limits": serde_json::to_value(Limits::default()).expect("limits"),
        "python": python,
    });
    serde_json::to_vec_pretty(&state).expect("json")
}

pub(crate) fn snapshot_wasm() -> Vec<Seed> {
    let mut session = Script::default();
    session.block(&wasm_state(true)).u32(131072).u8(2);
    session.block(b"note.txt").block(b"hello");
    session.block(b"dir").block(b"");
    let mut plain = Script::default();
    plain.block(&wasm_state(false)).u32(0).u8(0);
    let mut mismatched = Script::default();
    mismatched.block(&wasm_state(true)).u32(65536).u8(0);
    named(vec![("session", session.bytes), ("plain", plain.bytes), ("mismatched", mismatched.bytes)])
}

pub(crate) fn snapshot_vm_state() -> Vec<Seed> {
    let vcpu = VcpuState {
        cpuid: vec![Default::default()],
        mp_state: 0,
        regs: Regs::default(),
        sregs: Sregs::default(),
        fpu: Fpu::default(),
        xsave: None,
        xcrs: None,
        debug_regs: DebugRegs::default(),
        lapic: None,
        msrs: Vec::new(),
        events: VcpuEvents::default(),
        tsc_khz: None,
    };
    let state = MicrovmState {
        memory_bytes: 2 << 20,
        vm: VmState { clock: ClockState { clock: 1, flags: 0 }, irqchip: None, pit: None },
        vcpus: vec![vcpu],
        devices: DevicesState::default(),
    };
    let mut bytes = state.to_bytes().expect("a state");
    let mut two = bytes.clone();
    bytes.extend_from_slice(&(2u32 << 20).to_le_bytes());
    two.extend_from_slice(&(4u32 << 20).to_le_bytes());
    named(vec![("one-vcpu", bytes), ("memory-mismatch", two)])
}

pub(crate) fn snapshot_upper_tree() -> Vec<Seed> {
    let dir = crate::targets::snapshot_open::scratch("tree-seed");
    let d = |name: &str| dir.join(name);
    std::fs::create_dir_all(d("etc/apt")).expect("mkdir");
    std::fs::write(d("etc/apt/only"), b"mine\n").expect("write");
    std::fs::write(d("notes"), b"work\n").expect("write");
    std::fs::set_permissions(d("notes"), std::fs::Permissions::from_mode(0o4750)).expect("chmod");
    std::fs::hard_link(d("notes"), d("hard")).expect("link");
    std::os::unix::fs::symlink("/etc/shadow", d("link")).expect("symlink");
    nix::unistd::mkfifo(&d("fifo"), nix::sys::stat::Mode::from_bits_truncate(0o640)).expect("mkfifo");
    std::fs::File::create(d("sparse")).and_then(|f| f.set_len(1 << 20)).expect("sparse");
    // The same bytes on every run: fixed times, children before their directories.
    let time = nix::sys::time::TimeSpec::new(1_700_000_000, 0);
    for name in ["etc/apt/only", "etc/apt", "etc", "notes", "link", "fifo", "sparse", ""] {
        let flag = nix::sys::stat::UtimensatFlags::NoFollowSymlink;
        nix::sys::stat::utimensat(nix::fcntl::AT_FDCWD, &d(name), &time, &time, flag).expect("times");
    }
    let root = std::fs::File::open(&dir).expect("open");
    let mut tree = Vec::new();
    strata_jail::tree::write_tree(root.as_fd(), &mut tree, None).expect("a tree");
    let _ = std::fs::remove_dir_all(&dir);
    named(vec![("layer", tree)])
}
