//! Live forks on the process tier: a zygote — a setup job held stopped once it is ready — forked into a fresh
//! jail per job, its memory shared copy-on-write by the kernel (how the jail does it, and why it is sound, is in
//! [`strata_jail::zygote`]).
//!
//! ```no_run
//! # fn demo(tier: &strata_tier_process::ProcessTier) -> Result<(), strata_core::TierError> {
//! use strata_core::{Capabilities, ExecOptions, Limits};
//! let (zygote, setup) = tier.python_zygote("import json; x = 41", &Capabilities::default(), &Limits::default())?;
//! let outcome = zygote.fork_python("print(x + 1)", &ExecOptions::default())?; // prints 42
//! # Ok(()) }
//! ```
//!
//! What a fork gets: the zygote's memory (its heap, the modules it imported, its open state), its filesystem as
//! the setup left it (read through a private overlay: writes stay in the fork), its working directory; new PID,
//! mount, network, IPC, UTS and user namespaces, its own cgroup (limits and usage are the fork's), its own
//! standard streams. What it does not get: any descriptor above 2 (a socket or file the zygote held would be
//! shared by every fork), any other process (the zygote must be alone in its jail, and single-threaded), the
//! network (a zygote jail has none). Randomness: the kernel's (`os.urandom`, `/dev/urandom`) is fresh in each
//! fork, and the Python driver reseeds `random`; CPython's string-hash seed is the zygote's in every fork. A fork
//! runs one job: when its first process exits, its PID namespace, and everything in it, ends.
//!
//! Who may write the setup: the zygote never runs code of its own once held, so a fork's job cannot reach the
//! zygote or another fork; but the setup decides what every fork starts from, so a setup is as trusted as the
//! jobs forked from it are towards each other (as with any shared snapshot).

use std::fs::File;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Mutex;

use strata_core::OutputCapture;
use strata_core::{Capabilities, ExecOptions, Job, Limits, Net, Outcome, PythonSource, Status, TierError, TierKind};
use strata_jail::proto::Fork;

use crate::jail::{CgroupRoot, ForkHandle, Jail, JobIo, JobWatch, run_fork};
use crate::{PreparedJob, ProcessTier, cgroup_limits, internal, internal_from, jail_error, outcome};

/// The Python side of a zygote: runs the setup source (`argv[1]`) in a fresh `__main__` namespace, says it is
/// ready on descriptor 3, then reads an 8-byte little-endian length and that many bytes of source from stdin —
/// the zygote is held stopped in that first read, and every fork resumes it on its own stdin — reseeds `random`
/// and runs the source in the same namespace. What follows the source on stdin is the job's own stdin.
const PYTHON_DRIVER: &str = r#"import os as _strata_os, sys as _strata_sys
def _strata_read(n):
    b = b""
    while len(b) < n:
        c = _strata_os.read(0, n - len(b))
        if not c:
            raise SystemExit("strata: the job's source was cut short")
        b += c
    return b
_strata_g = {"__name__": "__main__", "__builtins__": __builtins__}
_strata_src = _strata_sys.argv.pop(1)
exec(compile(_strata_src, "<setup>", "exec"), _strata_g)
_strata_sys.stdout.flush()
_strata_sys.stderr.flush()
_strata_os.write(3, b"1")
_strata_n = int.from_bytes(_strata_read(8), "little")
import random as _strata_random
_strata_random.seed()
exec(compile(_strata_read(_strata_n).decode(), "<job>", "exec"), _strata_g)
"#;

/// Environment a Python zygote gets unless the caller sets it: numerical libraries single-threaded, since only a
/// single-threaded process can be forked whole.
const SINGLE_THREADED: &[(&str, &str)] =
    &[("OPENBLAS_NUM_THREADS", "1"), ("OMP_NUM_THREADS", "1"), ("MKL_NUM_THREADS", "1"), ("NUMEXPR_NUM_THREADS", "1")];

/// A zygote held by a process-tier jail, forked per job. Closing it (or dropping it) ends the jail, and every
/// fork still running with it.
#[derive(Debug)]
pub struct ProcessZygote {
    jail: Mutex<Jail>,
    cgroups: CgroupRoot,
    caps: Capabilities,
    limits: Limits,
    python: bool,
}

impl ProcessTier {
    /// Starts `setup` as a zygote in a new jail and waits until it is held ready to fork. `setup` is Python
    /// source ([`ProcessTier::python_zygote`] frames the forks' jobs for it) or a command that follows the
    /// zygote convention: write a byte to descriptor 3 when ready, then read descriptor 0 (each fork resumes that
    /// read on its own stdin). Returns the zygote and the setup's outcome (its output until it was ready; status
    /// `exited 0`). A setup that ends, fails or hits a limit before it is ready is an error carrying its status and
    /// the end of its stderr.
    pub fn zygote(
        &self,
        setup: &Job,
        caps: &Capabilities,
        limits: &Limits,
    ) -> Result<(ProcessZygote, Outcome), TierError> {
        if !matches!(caps.net, Net::Deny) {
            return Err(TierError::Unsupported {
                tier: TierKind::Process,
                what: "network access in a zygote (its forks have loopback only)".into(),
            });
        }
        let (job, python) = match setup {
            Job::Python { source: PythonSource::Code(code), args } => {
                let mut argv = vec!["python3".to_owned(), "-c".to_owned(), PYTHON_DRIVER.to_owned(), code.clone()];
                argv.extend(args.iter().cloned());
                (Job::Command { argv }, true)
            }
            Job::Command { .. } => (setup.clone(), false),
            other => {
                return Err(TierError::Unsupported {
                    tier: TierKind::Process,
                    what: format!("a {} job as a zygote (Python source or a command)", other.kind()),
                });
            }
        };
        let image = self.root_image(caps)?;
        let mut prepared = PreparedJob::new(&job, caps, limits, &ExecOptions::default(), &image)?;
        if python {
            for (name, value) in SINGLE_THREADED {
                if !prepared.exec.env.iter().any(|(k, _)| k == name) {
                    prepared.exec.env.push(((*name).to_owned(), (*value).to_owned()));
                }
            }
        }
        let mut config = self.jail_config(caps, limits, false, &image)?;
        config.zygote = true;
        let mut jail = self.start_jail_with(config, caps)?;
        let secrets = caps.secret_values();
        let stdout = OutputCapture::new(strata_core::Stream::Stdout, limits.output.0, secrets.clone(), None);
        let stderr = OutputCapture::new(strata_core::Stream::Stderr, limits.output.0, secrets, None);
        let io = JobIo { stdin: &[], stdin_stream: None, stdout: &stdout, stderr: &stderr, terminal: None };
        let watch = JobWatch { wall: limits.wall, cpu: limits.cpu, cancel: None };
        let report = jail.start_zygote(&prepared.exec, &io, &watch).map_err(jail_error)?;
        let ready = report.end == crate::jail::JobEnd::ZygoteReady;
        let setup_outcome = outcome(report, &stdout, &stderr, (Vec::new(), 0))?;
        if !ready {
            jail.close();
            let tail = String::from_utf8_lossy(&setup_outcome.stderr);
            let tail: String = tail.chars().rev().take(2000).collect::<Vec<_>>().into_iter().rev().collect();
            return Err(TierError::ExecFailed {
                message: format!(
                    "the zygote's setup ended before it was ready to fork ({}){}",
                    describe(&setup_outcome.status),
                    if tail.trim().is_empty() { String::new() } else { format!(": {}", tail.trim_end()) }
                ),
            });
        }
        let zygote = ProcessZygote {
            jail: Mutex::new(jail),
            cgroups: self.cgroups.clone(),
            caps: caps.clone(),
            limits: limits.clone(),
            python,
        };
        Ok((zygote, setup_outcome))
    }

    /// A Python zygote: `source` runs once; each [`ProcessZygote::fork_python`] runs more source in a fork of the
    /// interpreter it left, with its globals.
    pub fn python_zygote(
        &self,
        source: &str,
        caps: &Capabilities,
        limits: &Limits,
    ) -> Result<(ProcessZygote, Outcome), TierError> {
        let job = Job::Python { source: PythonSource::Code(source.to_owned()), args: Vec::new() };
        self.zygote(&job, caps, limits)
    }
}

/// Writes all of `data` into a fork's stdin pipe (which [`run_fork`] makes non-blocking), waiting for room; false
/// once the fork is gone (its end of the pipe closed).
fn feed(pipe: &OwnedFd, mut data: &[u8]) -> bool {
    use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
    while !data.is_empty() {
        match nix::unistd::write(pipe, data) {
            Ok(n) => data = data.get(n..).unwrap_or_default(),
            Err(nix::errno::Errno::EAGAIN) => {
                // Room, or an error once the reader is gone (the next write says EPIPE).
                let mut fds = [PollFd::new(pipe.as_fd(), PollFlags::POLLOUT)];
                match poll(&mut fds, PollTimeout::NONE) {
                    Ok(_) | Err(nix::errno::Errno::EINTR) => {}
                    Err(_) => return false,
                }
            }
            Err(nix::errno::Errno::EINTR) => {}
            Err(_) => return false,
        }
    }
    true
}

fn describe(status: &Status) -> String {
    match status {
        Status::Exited { code } => format!("exited with {code}"),
        Status::LimitExceeded { limit } => format!("{} limit exceeded", limit.as_str()),
        Status::Trapped { message } | Status::Crashed { message } => message.clone(),
    }
}

impl ProcessZygote {
    /// Whether the zygote runs the Python driver ([`ProcessZygote::fork_python`] works).
    pub fn is_python(&self) -> bool {
        self.python
    }

    /// Forks the zygote and lets the fork resume its read of stdin, which gets `input` and then `opts.stdin` (or
    /// `opts.stdin_stream`, as it arrives);
    /// waits for the fork to end. Limits are `opts.limits` or the zygote's, enforced on the fork's own cgroup.
    pub fn fork(&self, input: &[u8], opts: &ExecOptions) -> Result<Outcome, TierError> {
        opts.refuse_terminal(TierKind::Process)?;
        let limits = opts.limits.as_ref().unwrap_or(&self.limits);
        let cgroup = self.cgroups.create(&cgroup_limits(limits)).map_err(|e| jail_error(e.into()))?;
        let cgroup_files = cgroup
            .self_join_files()
            .iter()
            .map(|path| File::options().write(true).open(path))
            .collect::<Result<Vec<File>, _>>();
        let cgroup_files = match cgroup_files {
            Ok(files) => files,
            Err(err) => {
                cgroup.remove();
                return Err(internal_from("opening the fork's cgroup", err));
            }
        };
        let pipe = || nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(|e| internal_from("pipe", e));
        let made = (|| Ok::<_, TierError>((pipe()?, pipe()?, pipe()?, pipe()?)))();
        let ((stdin_r, stdin_w), (stdout_r, stdout_w), (stderr_r, stderr_w), (status_r, status_w)) = match made {
            Ok(pipes) => pipes,
            Err(err) => {
                cgroup.remove();
                return Err(err);
            }
        };
        let request = Fork { scratch_bytes: limits.disk.0 };
        let forked = {
            let mut jail = self.jail.lock().map_err(|_| internal("the zygote's jail lock is poisoned"))?;
            jail.fork(&request, [stdin_r.as_fd(), stdout_w.as_fd(), stderr_w.as_fd()], status_w.as_fd(), &cgroup_files)
        };
        drop((stdin_r, stdout_w, stderr_w, status_w, cgroup_files));
        let (_, pidfd) = match forked {
            Ok(forked) => forked,
            Err(err) => {
                cgroup.kill_all();
                cgroup.remove();
                return Err(match err {
                    crate::jail::JailError::Fork { stage, message } => {
                        internal(format!("forking the zygote failed at {stage}: {message}"))
                    }
                    other => jail_error(other),
                });
            }
        };
        // A fork resumes the zygote's read of one buffer: its input, then the job's stdin. A stream is pumped in as it
        // arrives, after the input, until the fork ends (the pump stops with this function's return).
        let mut stdin = input.to_vec();
        let (stdin_w, _pump) = match &opts.stdin_stream {
            Some(stream) => {
                let read_err = |source| TierError::ReadInput { path: "stdin stream".into(), source };
                let feeder = stdin_w.try_clone().map_err(read_err)?;
                let pump = stream
                    .pump_after(std::mem::take(&mut stdin), 64 << 10, move |pumped| match pumped {
                        // Its end of input when this thread ends, with `feeder`.
                        strata_core::Pumped::Data(data) => feed(&feeder, data),
                        strata_core::Pumped::End | strata_core::Pumped::Failed(_) => false,
                    })
                    .map_err(read_err)?;
                (stdin_w, Some(pump))
            }
            None => {
                stdin.extend_from_slice(opts.stdin.as_deref().unwrap_or_default());
                (stdin_w, None)
            }
        };
        let secrets = self.caps.secret_values();
        let stdout =
            OutputCapture::new(strata_core::Stream::Stdout, limits.output.0, secrets.clone(), opts.sink.clone());
        let stderr = OutputCapture::new(strata_core::Stream::Stderr, limits.output.0, secrets, opts.sink.clone());
        let io = JobIo { stdin: &stdin, stdin_stream: None, stdout: &stdout, stderr: &stderr, terminal: None };
        let watch = JobWatch { wall: limits.wall, cpu: limits.cpu, cancel: opts.cancel.clone() };
        let handle = ForkHandle { stdin: stdin_w, stdout: stdout_r, stderr: stderr_r, status: status_r, pidfd, cgroup };
        let report = run_fork(handle, &io, &watch);
        outcome(report, &stdout, &stderr, (Vec::new(), 0))
    }

    /// Forks a Python zygote and runs `source` in the fork, with the setup's globals.
    pub fn fork_python(&self, source: &str, opts: &ExecOptions) -> Result<Outcome, TierError> {
        if !self.python {
            return Err(TierError::Unsupported {
                tier: TierKind::Process,
                what: "Python source in a fork of a command zygote (use `fork` with its own input)".into(),
            });
        }
        let mut input = (source.len() as u64).to_le_bytes().to_vec();
        input.extend_from_slice(source.as_bytes());
        self.fork(&input, opts)
    }

    /// Ends the zygote's jail, and every fork still running.
    pub fn close(self) {
        if let Ok(jail) = self.jail.into_inner() {
            jail.close();
        }
    }
}
