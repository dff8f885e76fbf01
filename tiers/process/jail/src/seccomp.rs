//! The jail's seccomp-bpf policy: an allowlist of the system calls ordinary Linux programs make.
//!
//! Everything not listed fails with `EPERM`. Left out on purpose: `mount` and the new mount API, `pivot_root`,
//! `chroot`, `ptrace` and `process_vm_*`, `kexec_*`, `bpf`, `perf_event_open`, module loading, the keyring calls,
//! `setns`, `userfaultfd`, `io_uring_*`, `open_by_handle_at`, swap, reboot, clock setting, `iopl`/`ioperm`,
//! `acct`, `quotactl`, `syslog`, `personality`. `unshare` and `clone` are allowed only without namespace flags,
//! `setns` only into a user namespace (which needs a capability a job no longer has: it is how the jail's PID 1,
//! which runs under this filter too, moves each job into the jail's user namespace).
//! `clone3` answers `ENOSYS` (its flags live in memory a filter cannot read), so the C library falls back to
//! `clone`, whose flags the filter checks. Calls made through another ABI (i386 `int 0x80`) kill the process:
//! seccompiler checks the architecture first.
//!
//! **No privileged files.** What a job writes into a read-write grant is a host file, and the jail's root writes
//! as host root through the idmapped grant: a set-user-ID or set-group-ID bit there would give any host user who
//! runs the file its owner's IDs. So no call may set either bit, checked on the mode argument itself: `chmod`,
//! `fchmod`, `fchmodat`, `fchmodat2`, `mkdir`, `mkdirat`, `creat`, and `open`/`openat` when they create (`O_CREAT`,
//! `O_TMPFILE`) are refused with `EPERM`; `mknod`/`mknodat` may make only regular files, FIFOs and sockets without
//! them; `openat2` answers `ENOSYS` (its mode is in memory a filter cannot read), so callers fall back to
//! `openat`. A filter cannot tell which file a call names, so this holds in the whole jail, where the bits would do
//! nothing anyway (`no_new_privs`); a program that insists on them (`cp -a` or `dpkg` copying a set-user-ID file)
//! gets the error and the file keeps its other bits. The rest is the kernel's, and a job holds no capability:
//! device nodes need `CAP_MKNOD`, file capabilities (`security.capability`) `CAP_SETFCAP`, and writing to a
//! set-user-ID file clears the bit without `CAP_FSETID`; a rename or hard link into a grant from another mount is
//! `EXDEV`; `io_uring` is refused. Mapping grants to an unprivileged host ID instead would not do: a set-user-ID
//! file of that ID still runs as that ID, with everything it owns, for whoever starts it. The check holds while
//! the job runs, not after it. The sticky bit is allowed.

use std::collections::BTreeMap;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter, SeccompRule, TargetArch,
};

/// Every namespace flag `unshare` accepts.
const NAMESPACE_FLAGS: u64 = (libc::CLONE_NEWNS
    | libc::CLONE_NEWCGROUP
    | libc::CLONE_NEWUTS
    | libc::CLONE_NEWIPC
    | libc::CLONE_NEWUSER
    | libc::CLONE_NEWPID
    | libc::CLONE_NEWNET
    | 0x80/* CLONE_NEWTIME */) as u64;

/// The namespace flags of `clone` (whose low byte is the exit signal, so `CLONE_NEWTIME` cannot appear).
const CLONE_NAMESPACE_FLAGS: u64 = NAMESPACE_FLAGS & !0xff;

/// System calls allowed without conditions.
const ALLOWED: &[libc::c_long] = &[
    libc::SYS_read,
    libc::SYS_write,
    libc::SYS_close,
    libc::SYS_stat,
    libc::SYS_fstat,
    libc::SYS_lstat,
    libc::SYS_poll,
    libc::SYS_lseek,
    libc::SYS_mmap,
    libc::SYS_mprotect,
    libc::SYS_munmap,
    libc::SYS_brk,
    libc::SYS_rt_sigaction,
    libc::SYS_rt_sigprocmask,
    libc::SYS_rt_sigreturn,
    libc::SYS_ioctl,
    libc::SYS_pread64,
    libc::SYS_pwrite64,
    libc::SYS_readv,
    libc::SYS_writev,
    libc::SYS_access,
    libc::SYS_pipe,
    libc::SYS_select,
    libc::SYS_sched_yield,
    libc::SYS_mremap,
    libc::SYS_msync,
    libc::SYS_mincore,
    libc::SYS_madvise,
    libc::SYS_shmget,
    libc::SYS_shmat,
    libc::SYS_shmctl,
    libc::SYS_dup,
    libc::SYS_dup2,
    libc::SYS_pause,
    libc::SYS_nanosleep,
    libc::SYS_getitimer,
    libc::SYS_alarm,
    libc::SYS_setitimer,
    libc::SYS_getpid,
    libc::SYS_sendfile,
    libc::SYS_socket,
    libc::SYS_connect,
    libc::SYS_accept,
    libc::SYS_sendto,
    libc::SYS_recvfrom,
    libc::SYS_sendmsg,
    libc::SYS_recvmsg,
    libc::SYS_shutdown,
    libc::SYS_bind,
    libc::SYS_listen,
    libc::SYS_getsockname,
    libc::SYS_getpeername,
    libc::SYS_socketpair,
    libc::SYS_setsockopt,
    libc::SYS_getsockopt,
    libc::SYS_fork,
    libc::SYS_vfork,
    libc::SYS_execve,
    libc::SYS_exit,
    libc::SYS_wait4,
    libc::SYS_kill,
    libc::SYS_uname,
    libc::SYS_semget,
    libc::SYS_semop,
    libc::SYS_semctl,
    libc::SYS_shmdt,
    libc::SYS_msgget,
    libc::SYS_msgsnd,
    libc::SYS_msgrcv,
    libc::SYS_msgctl,
    libc::SYS_fcntl,
    libc::SYS_flock,
    libc::SYS_fsync,
    libc::SYS_fdatasync,
    libc::SYS_truncate,
    libc::SYS_ftruncate,
    libc::SYS_getdents,
    libc::SYS_getcwd,
    libc::SYS_chdir,
    libc::SYS_fchdir,
    libc::SYS_rename,
    libc::SYS_rmdir,
    libc::SYS_link,
    libc::SYS_unlink,
    libc::SYS_symlink,
    libc::SYS_readlink,
    libc::SYS_chown,
    libc::SYS_fchown,
    libc::SYS_lchown,
    libc::SYS_umask,
    libc::SYS_gettimeofday,
    libc::SYS_getrlimit,
    libc::SYS_getrusage,
    libc::SYS_sysinfo,
    libc::SYS_times,
    libc::SYS_getuid,
    libc::SYS_getgid,
    libc::SYS_setuid,
    libc::SYS_setgid,
    libc::SYS_geteuid,
    libc::SYS_getegid,
    libc::SYS_setpgid,
    libc::SYS_getppid,
    libc::SYS_getpgrp,
    libc::SYS_setsid,
    libc::SYS_setreuid,
    libc::SYS_setregid,
    libc::SYS_getgroups,
    libc::SYS_setgroups,
    libc::SYS_setresuid,
    libc::SYS_getresuid,
    libc::SYS_setresgid,
    libc::SYS_getresgid,
    libc::SYS_getpgid,
    libc::SYS_setfsuid,
    libc::SYS_setfsgid,
    libc::SYS_getsid,
    libc::SYS_capget,
    libc::SYS_capset,
    libc::SYS_rt_sigpending,
    libc::SYS_rt_sigtimedwait,
    libc::SYS_rt_sigqueueinfo,
    libc::SYS_rt_sigsuspend,
    libc::SYS_sigaltstack,
    libc::SYS_utime,
    libc::SYS_statfs,
    libc::SYS_fstatfs,
    libc::SYS_getpriority,
    libc::SYS_setpriority,
    libc::SYS_sched_setparam,
    libc::SYS_sched_getparam,
    libc::SYS_sched_setscheduler,
    libc::SYS_sched_getscheduler,
    libc::SYS_sched_get_priority_max,
    libc::SYS_sched_get_priority_min,
    libc::SYS_sched_rr_get_interval,
    libc::SYS_mlock,
    libc::SYS_munlock,
    libc::SYS_mlockall,
    libc::SYS_munlockall,
    libc::SYS_prctl,
    libc::SYS_arch_prctl,
    libc::SYS_setrlimit,
    libc::SYS_sync,
    libc::SYS_gettid,
    libc::SYS_readahead,
    libc::SYS_setxattr,
    libc::SYS_lsetxattr,
    libc::SYS_fsetxattr,
    libc::SYS_getxattr,
    libc::SYS_lgetxattr,
    libc::SYS_fgetxattr,
    libc::SYS_listxattr,
    libc::SYS_llistxattr,
    libc::SYS_flistxattr,
    libc::SYS_removexattr,
    libc::SYS_lremovexattr,
    libc::SYS_fremovexattr,
    libc::SYS_tkill,
    libc::SYS_time,
    libc::SYS_futex,
    libc::SYS_sched_setaffinity,
    libc::SYS_sched_getaffinity,
    libc::SYS_io_setup,
    libc::SYS_io_destroy,
    libc::SYS_io_getevents,
    libc::SYS_io_submit,
    libc::SYS_io_cancel,
    libc::SYS_epoll_create,
    libc::SYS_getdents64,
    libc::SYS_set_tid_address,
    libc::SYS_restart_syscall,
    libc::SYS_semtimedop,
    libc::SYS_fadvise64,
    libc::SYS_timer_create,
    libc::SYS_timer_settime,
    libc::SYS_timer_gettime,
    libc::SYS_timer_getoverrun,
    libc::SYS_timer_delete,
    libc::SYS_clock_gettime,
    libc::SYS_clock_getres,
    libc::SYS_clock_nanosleep,
    libc::SYS_exit_group,
    libc::SYS_epoll_wait,
    libc::SYS_epoll_ctl,
    libc::SYS_tgkill,
    libc::SYS_utimes,
    libc::SYS_mbind,
    libc::SYS_set_mempolicy,
    libc::SYS_get_mempolicy,
    libc::SYS_mq_open,
    libc::SYS_mq_unlink,
    libc::SYS_mq_timedsend,
    libc::SYS_mq_timedreceive,
    libc::SYS_mq_notify,
    libc::SYS_mq_getsetattr,
    libc::SYS_waitid,
    libc::SYS_ioprio_set,
    libc::SYS_ioprio_get,
    libc::SYS_inotify_init,
    libc::SYS_inotify_add_watch,
    libc::SYS_inotify_rm_watch,
    libc::SYS_fchownat,
    libc::SYS_futimesat,
    libc::SYS_newfstatat,
    libc::SYS_unlinkat,
    libc::SYS_renameat,
    libc::SYS_linkat,
    libc::SYS_symlinkat,
    libc::SYS_readlinkat,
    libc::SYS_faccessat,
    libc::SYS_pselect6,
    libc::SYS_ppoll,
    libc::SYS_set_robust_list,
    libc::SYS_get_robust_list,
    libc::SYS_splice,
    libc::SYS_tee,
    libc::SYS_sync_file_range,
    libc::SYS_vmsplice,
    libc::SYS_move_pages,
    libc::SYS_utimensat,
    libc::SYS_epoll_pwait,
    libc::SYS_signalfd,
    libc::SYS_timerfd_create,
    libc::SYS_eventfd,
    libc::SYS_fallocate,
    libc::SYS_timerfd_settime,
    libc::SYS_timerfd_gettime,
    libc::SYS_accept4,
    libc::SYS_signalfd4,
    libc::SYS_eventfd2,
    libc::SYS_epoll_create1,
    libc::SYS_dup3,
    libc::SYS_pipe2,
    libc::SYS_inotify_init1,
    libc::SYS_preadv,
    libc::SYS_pwritev,
    libc::SYS_rt_tgsigqueueinfo,
    libc::SYS_recvmmsg,
    libc::SYS_prlimit64,
    libc::SYS_syncfs,
    libc::SYS_sendmmsg,
    libc::SYS_getcpu,
    libc::SYS_sched_setattr,
    libc::SYS_sched_getattr,
    libc::SYS_renameat2,
    libc::SYS_getrandom,
    libc::SYS_memfd_create,
    libc::SYS_execveat,
    libc::SYS_membarrier,
    libc::SYS_mlock2,
    libc::SYS_copy_file_range,
    libc::SYS_preadv2,
    libc::SYS_pwritev2,
    libc::SYS_pkey_mprotect,
    libc::SYS_pkey_alloc,
    libc::SYS_pkey_free,
    libc::SYS_statx,
    libc::SYS_rseq,
    libc::SYS_pidfd_send_signal,
    libc::SYS_pidfd_open,
    libc::SYS_close_range,
    libc::SYS_faccessat2,
    libc::SYS_process_madvise,
    libc::SYS_epoll_pwait2,
    libc::SYS_futex_waitv,
];

/// System calls that must answer `ENOSYS` rather than `EPERM`, so callers fall back to an older call.
const NOT_IMPLEMENTED: &[libc::c_long] = &[libc::SYS_clone3, libc::SYS_openat2];

/// The mode bits no job may give a file or directory: set-user-ID and set-group-ID.
const PRIVILEGE_BITS: u64 = (libc::S_ISUID | libc::S_ISGID) as u64;

/// Calls that take a mode, with the index of their mode argument: allowed only without [`PRIVILEGE_BITS`].
const MODE_ARGUMENT: &[(libc::c_long, u8)] = &[
    (libc::SYS_chmod, 1),
    (libc::SYS_fchmod, 1),
    (libc::SYS_fchmodat, 2),
    (libc::SYS_fchmodat2, 2),
    (libc::SYS_mkdir, 1),
    (libc::SYS_mkdirat, 2),
    (libc::SYS_creat, 1),
];

/// `open` and `openat`, with the indexes of their flags and mode arguments: the mode counts only when the flags
/// create a file.
const OPEN_ARGUMENTS: &[(libc::c_long, u8, u8)] = &[(libc::SYS_open, 1, 2), (libc::SYS_openat, 2, 3)];

/// The flags with which `open` creates a file (`O_TMPFILE` without the `O_DIRECTORY` it includes).
const CREATING_FLAGS: u64 = (libc::O_CREAT | (libc::O_TMPFILE & !libc::O_DIRECTORY)) as u64;

/// `mknod` and `mknodat`, with the index of their mode argument (file type and permission bits).
const MKNOD_ARGUMENT: &[(libc::c_long, u8)] = &[(libc::SYS_mknod, 1), (libc::SYS_mknodat, 2)];

/// The file types `mknod` may make: a regular file (type 0 is one too), a FIFO, a socket; no device, no directory.
const MKNOD_TYPES: [libc::mode_t; 4] = [0, libc::S_IFREG, libc::S_IFIFO, libc::S_IFSOCK];

/// Why the filter could not be built (a bug in this module, not the job's doing).
#[derive(Debug)]
pub struct SeccompBuildError(pub String);

impl std::fmt::Display for SeccompBuildError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "seccomp filter: {}", self.0)
    }
}

impl std::error::Error for SeccompBuildError {}

fn err(e: impl std::fmt::Display) -> SeccompBuildError {
    SeccompBuildError(e.to_string())
}

/// The compiled filters, in the order they must be installed.
#[derive(Debug, Clone)]
pub struct JailFilters {
    /// The allowlist.
    pub allow: BpfProgram,
    /// `ENOSYS` for calls whose fallback the filter can check.
    pub enosys: BpfProgram,
    /// A zygote jail's: `clone` with namespace flags goes to the tracer.
    pub trace: Option<BpfProgram>,
}

/// The most instructions a classic BPF program may have (the kernel's `BPF_MAXINSNS`).
const MAX_INSTRUCTIONS: usize = 4096;

impl JailFilters {
    /// Writes the filters to `out` as [`read_from`](JailFilters::read_from) reads them: for each of `allow`,
    /// `enosys` and `trace`, its length (`u32::MAX` for no `trace`) and its instructions, little-endian.
    pub fn write_to(&self, out: &mut impl std::io::Write) -> std::io::Result<()> {
        let mut bytes = Vec::new();
        for program in [Some(&self.allow), Some(&self.enosys), self.trace.as_ref()] {
            let len = program.map_or(u32::MAX, |program| program.len() as u32);
            bytes.extend_from_slice(&len.to_le_bytes());
            for insn in program.into_iter().flatten() {
                bytes.extend_from_slice(&insn.code.to_le_bytes());
                bytes.extend_from_slice(&[insn.jt, insn.jf]);
                bytes.extend_from_slice(&insn.k.to_le_bytes());
            }
        }
        out.write_all(&bytes)
    }

    /// Reads filters [`write_to`](JailFilters::write_to) wrote; a program longer than the kernel takes, or input
    /// that ends early, is an error.
    pub fn read_from(input: &mut impl std::io::Read) -> std::io::Result<JailFilters> {
        let mut read_program = || -> std::io::Result<Option<BpfProgram>> {
            let mut len = [0u8; 4];
            input.read_exact(&mut len)?;
            let len = u32::from_le_bytes(len);
            if len == u32::MAX {
                return Ok(None);
            }
            let len = usize::try_from(len).unwrap_or(usize::MAX);
            if len > MAX_INSTRUCTIONS {
                return Err(std::io::Error::other(format!("a filter of {len} instructions")));
            }
            let mut bytes = vec![0u8; len * 8];
            input.read_exact(&mut bytes)?;
            let program = bytes
                .chunks_exact(8)
                .map(|insn| seccompiler::sock_filter {
                    code: u16::from_le_bytes([insn[0], insn[1]]),
                    jt: insn[2],
                    jf: insn[3],
                    k: u32::from_le_bytes([insn[4], insn[5], insn[6], insn[7]]),
                })
                .collect();
            Ok(Some(program))
        };
        let missing = || std::io::Error::other("a filter is missing");
        let allow = read_program()?.ok_or_else(missing)?;
        let enosys = read_program()?.ok_or_else(missing)?;
        let trace = read_program()?;
        Ok(JailFilters { allow, enosys, trace })
    }
}

/// What PID 1 of a zygote jail may do besides what every job may: trace the zygote and its forks, join the
/// forks' namespaces and build their filesystems, and stack the zygote's own filter.
const ZYGOTE_PID1: &[libc::c_long] = &[
    libc::SYS_ptrace,
    libc::SYS_mount,
    libc::SYS_umount2,
    libc::SYS_pivot_root,
    libc::SYS_fsopen,
    libc::SYS_fsconfig,
    libc::SYS_fsmount,
    libc::SYS_move_mount,
    libc::SYS_seccomp,
    libc::SYS_sethostname,
];

/// What the zygote's own filter takes away again: everything [`ZYGOTE_PID1`] adds, and `setns`.
const ZYGOTE_DENIED: &[libc::c_long] = &[
    libc::SYS_ptrace,
    libc::SYS_mount,
    libc::SYS_umount2,
    libc::SYS_pivot_root,
    libc::SYS_fsopen,
    libc::SYS_fsconfig,
    libc::SYS_fsmount,
    libc::SYS_move_mount,
    libc::SYS_sethostname,
    libc::SYS_setns,
    libc::SYS_process_vm_readv,
    libc::SYS_process_vm_writev,
];

/// Compiles the jail's filters for this machine's architecture.
pub fn filters() -> Result<JailFilters, SeccompBuildError> {
    build(false)
}

/// The filters of a zygote jail's PID 1 (every process of the jail inherits them): the jail's allowlist plus
/// `ZYGOTE_PID1`, `setns` into any namespace, and `clone` with namespace flags answered by
/// `SECCOMP_RET_TRACE` — which, with no tracer, fails with `ENOSYS`, and which PID 1 allows only for the `clone`
/// it injects into the zygote to fork it. The zygote adds [`zygote_filter`] on top.
pub fn zygote_pid1_filters() -> Result<JailFilters, SeccompBuildError> {
    build(true)
}

/// The zygote's own filter (stacked on [`zygote_pid1_filters`], inherited by every fork): `EPERM` for
/// `ZYGOTE_DENIED`.
pub fn zygote_filter() -> Result<BpfProgram, SeccompBuildError> {
    let arch = TargetArch::try_from(std::env::consts::ARCH).map_err(err)?;
    let rules = ZYGOTE_DENIED.iter().map(|&call| (call, Vec::new())).collect();
    SeccompFilter::new(rules, SeccompAction::Allow, SeccompAction::Errno(libc::EPERM as u32), arch)
        .map_err(err)?
        .try_into()
        .map_err(err)
}

/// Installs one more filter on the calling thread (`no_new_privs` is already set by [`install`]).
pub fn install_one(filter: &BpfProgram) -> Result<(), SeccompBuildError> {
    seccompiler::apply_filter(filter).map_err(err)
}

fn build(zygote: bool) -> Result<JailFilters, SeccompBuildError> {
    let arch = TargetArch::try_from(std::env::consts::ARCH).map_err(err)?;
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> = BTreeMap::new();
    for &call in ALLOWED.iter().chain(NOT_IMPLEMENTED) {
        rules.insert(call, Vec::new());
    }
    let no_namespaces = |mask: u64| -> Result<Vec<SeccompRule>, SeccompBuildError> {
        let cond = SeccompCondition::new(0, SeccompCmpArgLen::Qword, SeccompCmpOp::MaskedEq(mask), 0).map_err(err)?;
        Ok(vec![SeccompRule::new(vec![cond]).map_err(err)?])
    };
    rules.insert(libc::SYS_unshare, no_namespaces(NAMESPACE_FLAGS)?);
    for (call, rule) in file_mode_rules()? {
        rules.insert(call, rule);
    }
    if zygote {
        // `clone` is checked by the trace filter below; `setns` and the rest are PID 1's to build forks with.
        for &call in ZYGOTE_PID1.iter().chain([&libc::SYS_clone, &libc::SYS_setns]) {
            rules.insert(call, Vec::new());
        }
    } else {
        rules.insert(libc::SYS_clone, no_namespaces(CLONE_NAMESPACE_FLAGS)?);
        let user_ns = SeccompCondition::new(1, SeccompCmpArgLen::Dword, SeccompCmpOp::Eq, libc::CLONE_NEWUSER as u64)
            .map_err(err)?;
        rules.insert(libc::SYS_setns, vec![SeccompRule::new(vec![user_ns]).map_err(err)?]);
    }
    let allow = SeccompFilter::new(rules, SeccompAction::Errno(libc::EPERM as u32), SeccompAction::Allow, arch)
        .map_err(err)?
        .try_into()
        .map_err(err)?;
    let trace = if zygote {
        // One rule per namespace bit: `clone` with any of them set goes to the tracer.
        let mut any_namespace = Vec::new();
        for bit in (0..64).map(|b| 1u64 << b).filter(|bit| CLONE_NAMESPACE_FLAGS & bit != 0) {
            let cond =
                SeccompCondition::new(0, SeccompCmpArgLen::Qword, SeccompCmpOp::MaskedEq(bit), bit).map_err(err)?;
            any_namespace.push(SeccompRule::new(vec![cond]).map_err(err)?);
        }
        let rules = [(libc::SYS_clone, any_namespace)].into_iter().collect();
        Some(
            SeccompFilter::new(rules, SeccompAction::Allow, SeccompAction::Trace(0), arch)
                .map_err(err)?
                .try_into()
                .map_err(err)?,
        )
    } else {
        None
    };

    let enosys_rules = NOT_IMPLEMENTED.iter().map(|&call| (call, Vec::new())).collect();
    let enosys =
        SeccompFilter::new(enosys_rules, SeccompAction::Allow, SeccompAction::Errno(libc::ENOSYS as u32), arch)
            .map_err(err)?
            .try_into()
            .map_err(err)?;
    Ok(JailFilters { allow, enosys, trace })
}

/// The rules of the calls that give a file its mode (see the module docs): each allowed only when the mode
/// holds no [`PRIVILEGE_BITS`] (rules of one call are alternatives; the conditions of one rule all hold).
fn file_mode_rules() -> Result<Vec<(libc::c_long, Vec<SeccompRule>)>, SeccompBuildError> {
    let masked = |arg: u8, mask: u64, value: u64| -> Result<SeccompRule, SeccompBuildError> {
        let cond =
            SeccompCondition::new(arg, SeccompCmpArgLen::Dword, SeccompCmpOp::MaskedEq(mask), value).map_err(err)?;
        SeccompRule::new(vec![cond]).map_err(err)
    };
    let mut rules = Vec::new();
    for &(call, mode) in MODE_ARGUMENT {
        rules.push((call, vec![masked(mode, PRIVILEGE_BITS, 0)?]));
    }
    for &(call, flags, mode) in OPEN_ARGUMENTS {
        // Either it creates nothing, or what it creates has no privilege bit.
        rules.push((call, vec![masked(flags, CREATING_FLAGS, 0)?, masked(mode, PRIVILEGE_BITS, 0)?]));
    }
    let type_and_bits = u64::from(libc::S_IFMT) | PRIVILEGE_BITS;
    for &(call, mode) in MKNOD_ARGUMENT {
        let allowed = MKNOD_TYPES.iter().map(|&kind| masked(mode, type_and_bits, u64::from(kind)));
        rules.push((call, allowed.collect::<Result<_, _>>()?));
    }
    Ok(rules)
}

/// Installs the filters on the calling thread (which also sets `no_new_privs`); its children inherit them. The
/// `ENOSYS` filter goes first: once the allowlist is in, `seccomp` itself is refused.
pub fn install(filters: &JailFilters) -> Result<(), SeccompBuildError> {
    seccompiler::apply_filter(&filters.enosys).map_err(err)?;
    if let Some(trace) = &filters.trace {
        seccompiler::apply_filter(trace).map_err(err)?;
    }
    seccompiler::apply_filter(&filters.allow).map_err(err)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filters_compile() {
        let f = filters().expect("filters");
        assert!(f.allow.len() > ALLOWED.len());
        assert!(!f.enosys.is_empty());
    }

    #[test]
    fn filters_read_back_as_written() {
        for filters in [filters().expect("filters"), zygote_pid1_filters().expect("zygote filters")] {
            let mut bytes = Vec::new();
            filters.write_to(&mut bytes).expect("write");
            let read = JailFilters::read_from(&mut bytes.as_slice()).expect("read");
            assert_eq!((read.allow, read.enosys, read.trace), (filters.allow, filters.enosys, filters.trace));
        }
    }

    #[test]
    fn filters_cut_short_or_too_long_are_refused() {
        let mut bytes = Vec::new();
        filters().expect("filters").write_to(&mut bytes).expect("write");
        assert!(JailFilters::read_from(&mut &bytes[..bytes.len() - 1]).is_err());
        assert!(JailFilters::read_from(&mut &(MAX_INSTRUCTIONS as u32 + 1).to_le_bytes()[..]).is_err());
    }

    #[test]
    fn dangerous_calls_are_not_allowed() {
        for call in [
            libc::SYS_mount,
            libc::SYS_umount2,
            libc::SYS_pivot_root,
            libc::SYS_ptrace,
            libc::SYS_kexec_load,
            libc::SYS_bpf,
            libc::SYS_perf_event_open,
            libc::SYS_init_module,
            libc::SYS_finit_module,
            libc::SYS_keyctl,
            libc::SYS_add_key,
            libc::SYS_userfaultfd,
            libc::SYS_io_uring_setup,
            libc::SYS_open_by_handle_at,
            libc::SYS_process_vm_readv,
            libc::SYS_fsopen,
            libc::SYS_move_mount,
            libc::SYS_chroot,
        ] {
            assert!(!ALLOWED.contains(&call), "syscall {call} is allowed");
        }
    }

    #[test]
    fn calls_that_set_a_mode_are_only_allowed_with_conditions() {
        let conditional =
            MODE_ARGUMENT.iter().map(|(call, _)| call).chain(OPEN_ARGUMENTS.iter().map(|(call, ..)| call));
        for call in conditional.chain(MKNOD_ARGUMENT.iter().map(|(call, _)| call)) {
            assert!(!ALLOWED.contains(call), "syscall {call} is allowed without conditions");
        }
        assert!(!ALLOWED.contains(&libc::SYS_openat2));
    }

    /// One system call tried under a filter, and the errno it must fail with (0: it must succeed).
    struct Try {
        what: &'static str,
        call: libc::c_long,
        args: [u64; 4],
        errno: i32,
    }

    /// Runs each of `tries` in a child that first runs `install`; returns what each call got (0 or an errno).
    fn under_filter(install: impl Fn() -> bool, tries: &[Try]) -> Vec<i32> {
        let (read, write) = nix::unistd::pipe().expect("pipe");
        let mut results = vec![0i32; tries.len()];
        // SAFETY: the child makes system calls only (all it uses was allocated before the fork) and _exits.
        match unsafe { nix::unistd::fork() }.expect("fork") {
            nix::unistd::ForkResult::Child => {
                let installed = install();
                for (slot, t) in results.iter_mut().zip(tries) {
                    let [a, b, c, d] = t.args;
                    // SAFETY: the arguments are integers or pointers to NUL-terminated paths the parent keeps.
                    let rc = unsafe { libc::syscall(t.call, a, b, c, d) };
                    *slot = match (installed, rc) {
                        (false, _) => -1,
                        (true, 0..) => 0,
                        (true, _) => std::io::Error::last_os_error().raw_os_error().unwrap_or(-2),
                    };
                }
                let mut bytes = [0u8; 4 * 64];
                for (chunk, result) in bytes.chunks_mut(4).zip(&results) {
                    chunk.copy_from_slice(&result.to_ne_bytes());
                }
                let _ = nix::unistd::write(&write, &bytes[..4 * results.len().min(64)]);
                // SAFETY: _exit ends the forked child without running the test harness's exit handlers.
                unsafe { libc::_exit(0) }
            }
            nix::unistd::ForkResult::Parent { child } => {
                drop(write);
                let mut bytes = Vec::new();
                std::io::Read::read_to_end(&mut std::fs::File::from(read), &mut bytes).expect("read");
                nix::sys::wait::waitpid(child, None).expect("wait");
                assert_eq!(bytes.len(), 4 * tries.len(), "the child reported nothing");
                bytes.chunks(4).map(|c| i32::from_ne_bytes([c[0], c[1], c[2], c[3]])).collect()
            }
        }
    }

    /// Every way of giving a file a mode, with and without privilege bits, in `dir`; `paths` keeps the names the
    /// calls point to alive.
    fn mode_tries(dir: &std::path::Path, paths: &mut Vec<std::ffi::CString>) -> Vec<Try> {
        std::fs::write(dir.join("file"), b"x").expect("file");
        let file = std::fs::File::open(dir.join("file")).expect("open");
        let fd = std::os::fd::IntoRawFd::into_raw_fd(file) as u64;
        let mut path = |name: &str| {
            let c = std::ffi::CString::new(dir.join(name).into_os_string().into_encoded_bytes()).expect("path");
            let ptr = c.as_ptr() as u64;
            paths.push(c);
            ptr
        };
        let (file, here) = (path("file"), path(""));
        let cwd = libc::AT_FDCWD as u64;
        let (creat, wronly) = (libc::O_CREAT as u64, libc::O_WRONLY as u64);
        let (reg, chr, blk, fifo) =
            (libc::S_IFREG as u64, libc::S_IFCHR as u64, libc::S_IFBLK as u64, libc::S_IFIFO as u64);
        let t = |what, call, args, errno| Try { what, call, args, errno };
        let eperm = libc::EPERM;
        vec![
            t("chmod 4755", libc::SYS_chmod, [file, 0o4755, 0, 0], eperm),
            t("chmod 2755", libc::SYS_chmod, [file, 0o2755, 0, 0], eperm),
            t("chmod 1777", libc::SYS_chmod, [file, 0o1777, 0, 0], 0),
            t("chmod 755", libc::SYS_chmod, [file, 0o755, 0, 0], 0),
            t("fchmod 4755", libc::SYS_fchmod, [fd, 0o4755, 0, 0], eperm),
            t("fchmod 644", libc::SYS_fchmod, [fd, 0o644, 0, 0], 0),
            t("fchmodat 6755", libc::SYS_fchmodat, [cwd, file, 0o6755, 0], eperm),
            t("fchmodat2 4755", libc::SYS_fchmodat2, [cwd, file, 0o4755, 0], eperm),
            t("open O_CREAT 4755", libc::SYS_open, [path("o1"), creat | wronly, 0o4755, 0], eperm),
            t("openat O_CREAT 2755", libc::SYS_openat, [cwd, path("o2"), creat | wronly, 0o2755], eperm),
            t("openat O_TMPFILE 4755", libc::SYS_openat, [cwd, here, libc::O_TMPFILE as u64 | wronly, 0o4755], eperm),
            t("openat O_CREAT 755", libc::SYS_openat, [cwd, path("o3"), creat | wronly, 0o755], 0),
            t("openat of a file, a stray mode", libc::SYS_openat, [cwd, file, libc::O_RDONLY as u64, 0o4755], 0),
            t("creat 4755", libc::SYS_creat, [path("o4"), 0o4755, 0, 0], eperm),
            t("creat 644", libc::SYS_creat, [path("o5"), 0o644, 0, 0], 0),
            t("openat2", libc::SYS_openat2, [cwd, path("o6"), 0, 0], libc::ENOSYS),
            t("mkdir 2755", libc::SYS_mkdir, [path("d1"), 0o2755, 0, 0], eperm),
            t("mkdirat 4755", libc::SYS_mkdirat, [cwd, path("d2"), 0o4755, 0], eperm),
            t("mkdir 1777", libc::SYS_mkdir, [path("d3"), 0o1777, 0, 0], 0),
            t("mknod S_IFREG 4755", libc::SYS_mknod, [path("m1"), reg | 0o4755, 0, 0], eperm),
            t("mknod S_IFCHR 1:3", libc::SYS_mknod, [path("m2"), chr | 0o666, libc::makedev(1, 3), 0], eperm),
            t("mknodat S_IFBLK 7:0", libc::SYS_mknodat, [cwd, path("m3"), blk | 0o600, libc::makedev(7, 0)], eperm),
            t("mknodat S_IFIFO 2600", libc::SYS_mknodat, [cwd, path("m4"), fifo | 0o2600, 0], eperm),
            t("mknodat S_IFIFO 600", libc::SYS_mknodat, [cwd, path("m5"), fifo | 0o600, 0], 0),
            t("mknod type 0, 644", libc::SYS_mknod, [path("m6"), 0o644, 0, 0], 0),
        ]
    }

    /// Asserts that every try got what it must, and that nothing in `dir` has a privilege bit.
    fn check(dir: &std::path::Path, tries: &[Try], got: &[i32]) {
        let wrong: Vec<String> = tries
            .iter()
            .zip(got)
            .filter(|(t, got)| t.errno != **got)
            .map(|(t, got)| format!("{}: errno {got}, expected {}", t.what, t.errno))
            .collect();
        assert!(wrong.is_empty(), "{wrong:#?}");
        for entry in std::fs::read_dir(dir).expect("dir") {
            let meta = entry.expect("entry").metadata().expect("meta");
            assert_eq!(std::os::unix::fs::PermissionsExt::mode(&meta.permissions()) & 0o6000, 0, "{meta:?}");
        }
    }

    #[test]
    fn no_call_gives_a_file_a_privilege_bit() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut paths = Vec::new();
        let tries = mode_tries(dir.path(), &mut paths);
        let jail = filters().expect("filters");
        let got = under_filter(|| install(&jail).is_ok(), &tries);
        check(dir.path(), &tries, &got);
    }

    #[test]
    fn no_call_of_a_zygote_fork_gives_a_file_a_privilege_bit() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut paths = Vec::new();
        let tries = mode_tries(dir.path(), &mut paths);
        let (pid1, zygote) = (zygote_pid1_filters().expect("filters"), zygote_filter().expect("zygote filter"));
        let got = under_filter(|| install(&pid1).is_ok() && install_one(&zygote).is_ok(), &tries);
        check(dir.path(), &tries, &got);
    }
}
