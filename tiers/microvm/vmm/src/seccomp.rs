//! One seccomp filter per kind of monitor thread, as Firecracker has them: each lists the system calls that
//! thread makes — `ioctl`s by request number, `socket` by family, `mmap`/`mprotect` without `PROT_EXEC`,
//! `clone` only for threads — and anything else traps: the thread's `SIGSYS` handler reports the call on standard
//! error and the whole monitor exits with status [`SECCOMP_EXIT`] (the engine reports a crashed VM).
//!
//! - [`ThreadKind::Vmm`], the main thread once the machine is built: the control socket, pausing (`tgkill` of the
//!   vCPU threads, `KVM_RUN` with `immediate_exit` to finish pending I/O), saving (the vCPUs' and the VM's `GET`
//!   ioctls, `pread`/`pwrite`/`lseek`/`ftruncate` of the memory files), joining threads, and on stop removing the
//!   vsock socket (`unlink`, in `/run`, the only writable directory it sees).
//! - [`ThreadKind::Vcpu`]: `KVM_RUN`, and what the devices do on its exits: the serial console and interrupt
//!   eventfds (`write`), block reads (`pread64`), vsock's transmit path (an `AF_UNIX` stream `socket`, `connect`,
//!   `sendto`/`recvfrom`, `shutdown`, `epoll_ctl`, the muxer's timer).
//! - [`ThreadKind::Worker`]: a device backend (the vsock muxer): `poll`/`epoll_wait` on its host sockets,
//!   `accept4`, `recvfrom`/`sendto`, `FIONBIO`, `epoll_ctl`, its timer, the interrupt eventfd.
//!
//! A thread inherits its creator's filters, and filters only narrow. So no filtered thread creates another: one
//! **spawner** thread, started before anything is filtered, creates every vCPU and worker thread
//! ([`spawn`]); its own list is exactly the union of theirs plus what creating a thread takes (`clone` with
//! `CLONE_THREAD`, and a new thread's start-up: `set_robust_list`, `rseq`, `sched_getaffinity`, `prctl(PR_SET_NAME)`,
//! installing its filter), and it runs
//! no other code. Each new thread installs its own filter before its body runs, so its effective policy is its
//! own list. `clone3` answers `ENOSYS` (its flags are in memory a filter cannot read): the C library falls back to
//! `clone`, whose flags the filter checks. Calls through another ABI fail the architecture check and trap.
//!
//! Filters are only used by the monitor process ([`crate::monitor`]); a program that links this crate and runs a
//! machine in its own process (tests, benches) has none registered, and [`spawn`] is a plain thread spawn.

use std::collections::BTreeMap;
use std::io;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Mutex, OnceLock};
use std::thread::JoinHandle;

use kvm_bindings::{
    kvm_clock_data, kvm_cpuid2, kvm_debugregs, kvm_fpu, kvm_irqchip, kvm_lapic_state, kvm_mp_state, kvm_msrs,
    kvm_pit_state2, kvm_regs, kvm_sregs, kvm_vcpu_events, kvm_xcrs, kvm_xsave,
};
use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter, SeccompRule, TargetArch,
};
use serde::{Deserialize, Serialize};

/// The kinds of thread in a monitor, each under its own seccomp filter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ThreadKind {
    /// The main thread: the control loop, pausing, saving, stopping.
    Vmm,
    /// A vCPU thread: `KVM_RUN` and the device work its exits do.
    Vcpu,
    /// A device backend thread: the vsock muxer's host sockets.
    Worker,
}

impl ThreadKind {
    /// Its name in reports.
    pub fn name(self) -> &'static str {
        match self {
            ThreadKind::Vmm => "vmm",
            ThreadKind::Vcpu => "vcpu",
            ThreadKind::Worker => "worker",
        }
    }
}

/// The exit status of a monitor one of whose threads made a call outside its filter (128 + `SIGSYS`).
pub const SECCOMP_EXIT: i32 = 128 + libc::SIGSYS;

/// Why the filters could not be built or installed.
#[derive(Debug, thiserror::Error)]
#[error("seccomp: {0}")]
pub struct SeccompError(String);

fn err(e: impl std::fmt::Display) -> SeccompError {
    SeccompError(e.to_string())
}

// ---------------------------------------------------------------------------------------------------------------
// ioctl request numbers (`_IOC(dir, KVMIO, nr, size)`), checked against the kernel's values in the tests.

const KVMIO: u32 = 0xae;
const IOC_NONE: u32 = 0;
const IOC_WRITE: u32 = 1;
const IOC_READ: u32 = 2;

const fn ioc(dir: u32, nr: u32, size: usize) -> u64 {
    ((dir << 30) | ((size as u32) << 16) | (KVMIO << 8) | nr) as u64
}

/// `KVM_RUN`.
pub const KVM_RUN: u64 = ioc(IOC_NONE, 0x80, 0);
const KVM_GET_REGS: u64 = ioc(IOC_READ, 0x81, size_of::<kvm_regs>());
const KVM_GET_SREGS: u64 = ioc(IOC_READ, 0x83, size_of::<kvm_sregs>());
const KVM_GET_MSRS: u64 = ioc(IOC_READ | IOC_WRITE, 0x88, size_of::<kvm_msrs>());
const KVM_GET_FPU: u64 = ioc(IOC_READ, 0x8c, size_of::<kvm_fpu>());
const KVM_GET_LAPIC: u64 = ioc(IOC_READ, 0x8e, size_of::<kvm_lapic_state>());
const KVM_GET_CPUID2: u64 = ioc(IOC_READ | IOC_WRITE, 0x91, size_of::<kvm_cpuid2>());
const KVM_GET_MP_STATE: u64 = ioc(IOC_READ, 0x98, size_of::<kvm_mp_state>());
const KVM_GET_VCPU_EVENTS: u64 = ioc(IOC_READ, 0x9f, size_of::<kvm_vcpu_events>());
const KVM_GET_DEBUGREGS: u64 = ioc(IOC_READ, 0xa1, size_of::<kvm_debugregs>());
const KVM_GET_TSC_KHZ: u64 = ioc(IOC_NONE, 0xa3, 0);
const KVM_GET_XSAVE: u64 = ioc(IOC_READ, 0xa4, size_of::<kvm_xsave>());
const KVM_GET_XCRS: u64 = ioc(IOC_READ, 0xa6, size_of::<kvm_xcrs>());
const KVM_GET_XSAVE2: u64 = ioc(IOC_READ, 0xcf, size_of::<kvm_xsave>());
const KVM_GET_CLOCK: u64 = ioc(IOC_READ, 0x7c, size_of::<kvm_clock_data>());
const KVM_GET_IRQCHIP: u64 = ioc(IOC_READ | IOC_WRITE, 0x62, size_of::<kvm_irqchip>());
const KVM_GET_PIT2: u64 = ioc(IOC_READ, 0x9f, size_of::<kvm_pit_state2>());

/// What saving a paused machine asks KVM: every vCPU's state, the VM's clock, irqchip and PIT, and `KVM_RUN` with
/// `immediate_exit` set to complete a vCPU's pending I/O first.
const SAVE_IOCTLS: &[u64] = &[
    KVM_RUN,
    KVM_GET_REGS,
    KVM_GET_SREGS,
    KVM_GET_MSRS,
    KVM_GET_FPU,
    KVM_GET_LAPIC,
    KVM_GET_CPUID2,
    KVM_GET_MP_STATE,
    KVM_GET_VCPU_EVENTS,
    KVM_GET_DEBUGREGS,
    KVM_GET_TSC_KHZ,
    KVM_GET_XSAVE,
    KVM_GET_XCRS,
    KVM_GET_XSAVE2,
    KVM_GET_CLOCK,
    KVM_GET_IRQCHIP,
    KVM_GET_PIT2,
];

// ---------------------------------------------------------------------------------------------------------------
// The lists.

/// One argument test: `(arg & mask) == value` on argument `arg` (`mask` all ones for plain equality).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct ArgTest {
    /// Argument index (0 to 5).
    pub arg: u8,
    /// Bits compared.
    pub mask: u64,
    /// What they must equal.
    pub value: u64,
}

/// When a listed call is allowed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Allow {
    /// Whatever its arguments.
    Always,
    /// When one of these holds (each a conjunction of tests).
    When(Vec<Vec<ArgTest>>),
}

/// A thread's list: call number → when it is allowed.
pub type Rules = BTreeMap<i64, Allow>;

fn eq(arg: u8, value: u64) -> ArgTest {
    ArgTest { arg, mask: u64::MAX, value }
}

fn masked(arg: u8, mask: u64, value: u64) -> ArgTest {
    ArgTest { arg, mask, value }
}

fn always(rules: &mut Rules, calls: &[libc::c_long]) {
    for &call in calls {
        rules.insert(call, Allow::Always);
    }
}

fn when(rules: &mut Rules, call: libc::c_long, alternatives: Vec<Vec<ArgTest>>) {
    match rules.get_mut(&call) {
        Some(Allow::Always) => {}
        Some(Allow::When(existing)) => {
            for alternative in alternatives {
                if !existing.contains(&alternative) {
                    existing.push(alternative);
                }
            }
        }
        None => {
            rules.insert(call, Allow::When(alternatives));
        }
    }
}

fn ioctls(rules: &mut Rules, requests: &[u64]) {
    when(rules, libc::SYS_ioctl, requests.iter().map(|&r| vec![masked(1, 0xffff_ffff, r)]).collect());
}

/// Every thread: memory (never executable), futexes, signals' return, its own end, the clock, and `read`/`write`/
/// `close` on what it already holds.
fn base() -> Rules {
    let mut rules = Rules::new();
    always(
        &mut rules,
        &[
            libc::SYS_read,
            libc::SYS_write,
            libc::SYS_close,
            libc::SYS_futex,
            libc::SYS_rt_sigreturn,
            libc::SYS_rt_sigprocmask,
            libc::SYS_sigaltstack,
            libc::SYS_exit,
            libc::SYS_exit_group,
            libc::SYS_munmap,
            libc::SYS_madvise,
            libc::SYS_brk,
            libc::SYS_mremap,
            libc::SYS_sched_yield,
            libc::SYS_clock_gettime,
            libc::SYS_clock_nanosleep,
            libc::SYS_nanosleep,
            libc::SYS_getrandom,
            libc::SYS_gettid,
            libc::SYS_restart_syscall,
        ],
    );
    let no_exec = |arg| vec![vec![masked(arg, libc::PROT_EXEC as u64, 0)]];
    when(&mut rules, libc::SYS_mmap, no_exec(2));
    when(&mut rules, libc::SYS_mprotect, no_exec(2));
    rules
}

/// The main thread's list, once the machine is built.
pub fn vmm_rules() -> Rules {
    let mut rules = base();
    always(
        &mut rules,
        &[
            libc::SYS_recvmsg,
            libc::SYS_sendmsg,
            libc::SYS_tgkill,
            libc::SYS_getpid,
            libc::SYS_pread64,
            libc::SYS_pwrite64,
            libc::SYS_lseek,
            libc::SYS_ftruncate,
            // Stopping drops the vsock device, which removes its socket from /run.
            libc::SYS_unlink,
        ],
    );
    ioctls(&mut rules, SAVE_IOCTLS);
    rules
}

/// A vCPU thread's list.
pub fn vcpu_rules() -> Rules {
    let mut rules = base();
    always(
        &mut rules,
        &[
            libc::SYS_pread64,
            libc::SYS_connect,
            libc::SYS_recvfrom,
            libc::SYS_sendto,
            libc::SYS_shutdown,
            libc::SYS_epoll_ctl,
            libc::SYS_timerfd_settime,
        ],
    );
    ioctls(&mut rules, &[KVM_RUN]);
    when(&mut rules, libc::SYS_socket, vec![vec![eq(0, libc::AF_UNIX as u64)]]);
    rules
}

/// A device backend thread's list.
pub fn worker_rules() -> Rules {
    let mut rules = base();
    always(
        &mut rules,
        &[
            libc::SYS_poll,
            libc::SYS_ppoll,
            libc::SYS_epoll_wait,
            libc::SYS_epoll_pwait,
            libc::SYS_epoll_ctl,
            libc::SYS_accept4,
            libc::SYS_recvfrom,
            libc::SYS_sendto,
            libc::SYS_shutdown,
            libc::SYS_timerfd_settime,
        ],
    );
    ioctls(&mut rules, &[libc::FIONBIO]);
    rules
}

/// The spawner's list: the union of the threads it starts, and starting them.
pub fn spawner_rules() -> Rules {
    let mut rules = base();
    for other in [vcpu_rules(), worker_rules()] {
        for (call, allow) in other {
            match allow {
                Allow::Always => always(&mut rules, &[call]),
                Allow::When(alternatives) => when(&mut rules, call, alternatives),
            }
        }
    }
    // `clone3` passes this list so that the filter installed before it ([`enosys_clone3`]) decides: ENOSYS.
    // A new thread's start-up runs under this list too (its own is installed by its first Rust code): the C
    // library's `set_robust_list` and `rseq`, and Rust's stack guard, whose `pthread_getattr_np` reads the
    // thread's CPU affinity.
    always(&mut rules, &[libc::SYS_set_robust_list, libc::SYS_rseq, libc::SYS_clone3, libc::SYS_sched_getaffinity]);
    // A thread shares everything with its creator; no namespace, no new process.
    let thread_flags =
        (libc::CLONE_VM | libc::CLONE_FS | libc::CLONE_FILES | libc::CLONE_SIGHAND | libc::CLONE_THREAD) as u64;
    when(&mut rules, libc::SYS_clone, vec![vec![masked(0, thread_flags, thread_flags)]]);
    when(
        &mut rules,
        libc::SYS_prctl,
        vec![vec![eq(0, libc::PR_SET_NAME as u64)], vec![eq(0, libc::PR_SET_NO_NEW_PRIVS as u64)]],
    );
    when(&mut rules, libc::SYS_seccomp, vec![vec![eq(0, u64::from(libc::SECCOMP_SET_MODE_FILTER))]]);
    rules
}

/// The keeper's list, once its monitor runs: it waits for it and exits with its status.
pub fn keeper_rules() -> Rules {
    let mut rules = Rules::new();
    always(
        &mut rules,
        &[
            libc::SYS_wait4,
            libc::SYS_exit,
            libc::SYS_exit_group,
            libc::SYS_rt_sigreturn,
            libc::SYS_restart_syscall,
            libc::SYS_write,
            libc::SYS_close,
            libc::SYS_munmap,
            libc::SYS_sigaltstack,
            libc::SYS_rt_sigprocmask,
            libc::SYS_futex,
        ],
    );
    rules
}

/// The rules of one kind of thread.
pub fn rules(kind: ThreadKind) -> Rules {
    match kind {
        ThreadKind::Vmm => vmm_rules(),
        ThreadKind::Vcpu => vcpu_rules(),
        ThreadKind::Worker => worker_rules(),
    }
}

/// Compiles a list: allowed calls pass, anything else traps (`SIGSYS`).
pub fn compile(rules: &Rules) -> Result<BpfProgram, SeccompError> {
    let arch = TargetArch::try_from(std::env::consts::ARCH).map_err(err)?;
    let mut map: BTreeMap<i64, Vec<SeccompRule>> = BTreeMap::new();
    for (&call, allow) in rules {
        let compiled = match allow {
            Allow::Always => Vec::new(),
            Allow::When(alternatives) => alternatives
                .iter()
                .map(|tests| {
                    let conditions = tests
                        .iter()
                        .map(|t| {
                            let op = if t.mask == u64::MAX { SeccompCmpOp::Eq } else { SeccompCmpOp::MaskedEq(t.mask) };
                            SeccompCondition::new(t.arg, SeccompCmpArgLen::Qword, op, t.value)
                        })
                        .collect::<Result<Vec<_>, _>>()
                        .map_err(err)?;
                    SeccompRule::new(conditions).map_err(err)
                })
                .collect::<Result<Vec<_>, _>>()?,
        };
        map.insert(call, compiled);
    }
    SeccompFilter::new(map, SeccompAction::Trap, SeccompAction::Allow, arch).map_err(err)?.try_into().map_err(err)
}

/// `clone3` answers `ENOSYS`, everything else passes (installed before a list that allows `clone`).
fn enosys_clone3() -> Result<BpfProgram, SeccompError> {
    let arch = TargetArch::try_from(std::env::consts::ARCH).map_err(err)?;
    let map = [(libc::SYS_clone3, Vec::new())].into_iter().collect();
    SeccompFilter::new(map, SeccompAction::Allow, SeccompAction::Errno(libc::ENOSYS as u32), arch)
        .map_err(err)?
        .try_into()
        .map_err(err)
}

/// Installs `program` on the calling thread (and sets `no_new_privs`, which the monitor has already).
pub fn install(program: &BpfProgram) -> Result<(), SeccompError> {
    seccompiler::apply_filter(program).map_err(err)
}

// ---------------------------------------------------------------------------------------------------------------
// Threads under their filters.

/// Every kind's compiled filter, registered once by the monitor ([`register`]).
struct Registered {
    vcpu: BpfProgram,
    worker: BpfProgram,
    spawner: Mutex<Sender<Job>>,
}

static REGISTERED: OnceLock<Registered> = OnceLock::new();

type Job = Box<dyn FnOnce() + Send>;

thread_local! {
    /// The kind of the current thread, for the `SIGSYS` report (a const-initialised cell: reading it is
    /// async-signal-safe).
    static KIND: std::cell::Cell<u8> = const { std::cell::Cell::new(0) };
}

/// The current thread's kind as [`kind_code`] encodes it (0 when unset), for the monitor's `SIGSYS` handler.
pub fn current_kind_code() -> u8 {
    KIND.with(std::cell::Cell::get)
}

/// A thread kind as a small number (0 is "not a monitor thread"; 4 is the spawner).
pub fn kind_code(kind: ThreadKind) -> u8 {
    match kind {
        ThreadKind::Vmm => 1,
        ThreadKind::Vcpu => 2,
        ThreadKind::Worker => 3,
    }
}

/// Compiles every filter and starts the spawner thread (under its own filter), so that from now on [`spawn`]
/// creates vCPU and worker threads that install theirs. Called once, by the monitor, before the machine is built;
/// the main thread installs its own later, with [`enter_vmm`].
pub fn register() -> Result<(), SeccompError> {
    if REGISTERED.get().is_some() {
        return Err(SeccompError("the filters are already registered".into()));
    }
    let vcpu = compile(&vcpu_rules())?;
    let worker = compile(&worker_rules())?;
    let spawner_filters = [enosys_clone3()?, compile(&spawner_rules())?];
    let (jobs, queue) = channel::<Job>();
    let (ready, started) = channel::<Result<(), String>>();
    std::thread::Builder::new()
        .name("spawner".into())
        .spawn(move || spawner(&spawner_filters, &queue, &ready))
        .map_err(err)?;
    started.recv().map_err(err)?.map_err(SeccompError)?;
    REGISTERED
        .set(Registered { vcpu, worker, spawner: Mutex::new(jobs) })
        .map_err(|_| SeccompError("the filters are already registered".into()))
}

fn spawner(filters: &[BpfProgram], queue: &Receiver<Job>, ready: &Sender<Result<(), String>>) {
    KIND.with(|k| k.set(4));
    for filter in filters {
        if let Err(e) = install(filter) {
            let _ = ready.send(Err(e.to_string()));
            return;
        }
    }
    let _ = ready.send(Ok(()));
    // Runs nothing but the closures `spawn` sends, each of which only spawns a thread.
    while let Ok(job) = queue.recv() {
        job();
    }
}

/// Installs the main thread's filter (the machine is built; from now on it only serves the control socket,
/// pauses, saves and stops).
pub fn enter_vmm() -> Result<(), SeccompError> {
    KIND.with(|k| k.set(kind_code(ThreadKind::Vmm)));
    install(&compile(&vmm_rules())?)
}

/// Starts a thread of `kind` named `name` running `body`: through the spawner, under its kind's filter, when the
/// filters are registered; a plain thread otherwise.
pub fn spawn<T, F>(kind: ThreadKind, name: String, body: F) -> io::Result<JoinHandle<T>>
where
    F: FnOnce() -> T + Send + 'static,
    T: Send + 'static,
{
    let Some(registered) = REGISTERED.get() else {
        return std::thread::Builder::new().name(name).spawn(body);
    };
    let program = match kind {
        ThreadKind::Vcpu => registered.vcpu.clone(),
        ThreadKind::Worker => registered.worker.clone(),
        ThreadKind::Vmm => return Err(io::Error::other("the VMM thread is the main thread; it is not spawned")),
    };
    let code = kind_code(kind);
    let (reply, handle) = channel();
    let job: Job = Box::new(move || {
        let spawned = std::thread::Builder::new().name(name).spawn(move || {
            KIND.with(|k| k.set(code));
            if let Err(e) = install(&program) {
                // Never run a thread's body without its filter.
                eprintln!("strata-vmm: {e}");
                std::process::exit(SECCOMP_EXIT);
            }
            body()
        });
        let _ = reply.send(spawned);
    });
    registered
        .spawner
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .send(job)
        .map_err(|_| io::Error::other("the spawner thread is gone"))?;
    handle.recv().map_err(|_| io::Error::other("the spawner thread is gone"))?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ioctl_numbers_are_the_kernels() {
        assert_eq!(KVM_RUN, 0xae80);
        assert_eq!(KVM_GET_REGS, 0x8090_ae81);
        assert_eq!(KVM_GET_SREGS, 0x8138_ae83);
        assert_eq!(KVM_GET_MSRS, 0xc008_ae88);
        assert_eq!(KVM_GET_FPU, 0x81a0_ae8c);
        assert_eq!(KVM_GET_LAPIC, 0x8400_ae8e);
        assert_eq!(KVM_GET_CPUID2, 0xc008_ae91);
        assert_eq!(KVM_GET_MP_STATE, 0x8004_ae98);
        assert_eq!(KVM_GET_VCPU_EVENTS, 0x8040_ae9f);
        assert_eq!(KVM_GET_DEBUGREGS, 0x8080_aea1);
        assert_eq!(KVM_GET_TSC_KHZ, 0xaea3);
        assert_eq!(KVM_GET_XSAVE, 0x9000_aea4);
        assert_eq!(KVM_GET_XCRS, 0x8188_aea6);
        assert_eq!(KVM_GET_XSAVE2, 0x9000_aecf);
        assert_eq!(KVM_GET_CLOCK, 0x8030_ae7c);
        assert_eq!(KVM_GET_IRQCHIP, 0xc208_ae62);
        assert_eq!(KVM_GET_PIT2, 0x8070_ae9f);
    }

    /// `inner` allows nothing `outer` refuses.
    fn within(inner: &Rules, outer: &Rules) -> Result<(), String> {
        for (call, allow) in inner {
            match (allow, outer.get(call)) {
                (_, None) => return Err(format!("call {call} is not in the outer list")),
                (_, Some(Allow::Always)) => {}
                (Allow::Always, Some(Allow::When(_))) => return Err(format!("call {call} is narrower outside")),
                (Allow::When(a), Some(Allow::When(b))) => {
                    if let Some(missing) = a.iter().find(|alt| !b.contains(alt)) {
                        return Err(format!("call {call}: {missing:?} is not allowed outside"));
                    }
                }
            }
        }
        Ok(())
    }

    #[test]
    fn the_spawner_allows_what_its_threads_need() {
        within(&vcpu_rules(), &spawner_rules()).expect("vcpu within spawner");
        within(&worker_rules(), &spawner_rules()).expect("worker within spawner");
    }

    #[test]
    fn dangerous_calls_are_on_no_list() {
        let lists = [vmm_rules(), vcpu_rules(), worker_rules(), spawner_rules(), keeper_rules()];
        for call in [
            libc::SYS_execve,
            libc::SYS_execveat,
            libc::SYS_fork,
            libc::SYS_vfork,
            libc::SYS_open,
            libc::SYS_openat,
            libc::SYS_openat2,
            libc::SYS_mount,
            libc::SYS_unshare,
            libc::SYS_setns,
            libc::SYS_ptrace,
            libc::SYS_bind,
            libc::SYS_listen,
            libc::SYS_kill,
            libc::SYS_memfd_create,
            libc::SYS_bpf,
            libc::SYS_io_uring_setup,
            libc::SYS_rt_sigaction,
        ] {
            for list in &lists {
                assert!(!list.contains_key(&call), "call {call} is allowed");
            }
        }
        // Only the spawner creates threads, and only threads (`clone3` is ENOSYS there, and nowhere else).
        for list in [vmm_rules(), vcpu_rules(), worker_rules(), keeper_rules()] {
            assert!(!list.contains_key(&libc::SYS_clone));
            assert!(!list.contains_key(&libc::SYS_clone3));
        }
    }

    #[test]
    fn every_list_compiles() {
        for rules in [vmm_rules(), vcpu_rules(), worker_rules(), spawner_rules(), keeper_rules()] {
            assert!(!compile(&rules).expect("compile").is_empty());
        }
    }
}
