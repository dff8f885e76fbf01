//! The microVM tier: each one-shot job boots a fresh microVM ([`Microvm`]), runs in it through the guest agent and
//! ends with it.
//!
//! Limits: `memory` is the guest's RAM (the guest's OOM killer ending the job is `limit_exceeded`/`memory`),
//! `vcpus` its vCPUs, `wall` covers boot and job (the job is killed, then the VM), `cpu` is the job's rusage checked
//! when it ends plus `RLIMIT_CPU` in the guest, `output` is capped by the agent and the host capture, `files` is
//! `RLIMIT_NOFILE` in the guest, `disk` bounds the grants' files both ways.
//!
//! Grants are copied in before the job and read-write ones copied back after it exits with 0 ([`crate::grants`]:
//! checked listings, file by file with atomic replace, nothing applied when the guest's answer fails a check, which
//! ends the job as `crashed`); read-only grants are never copied back. Not built yet on this tier: network egress,
//! host tools and sessions — each a typed `unsupported` error.
//!
//! It needs hardware KVM; the engine only builds it where `strata doctor` finds it.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use strata_core::{
    Capabilities, ExecOptions, GrantMode, Job, LimitKind, Limits, Net, Outcome, OutputSink, PythonSource, Sandbox,
    Status, Stream, Tier, TierError, TierKind, Truncated, Usage,
};
use strata_guest_proto::{AgentClient, ClientError, ExecEvent, ExecLimits, ExecRequest, ExitStatus, OutputStream};
use strata_wasi_shims::OutputCapture;

use crate::builder::{BuildError, Microvm, MicrovmConfig};
use crate::grants::{self, GrantError, HostTree};
use crate::vstate::vcpu::cpuid::CpuidProfile;

/// Where host programs and scripts are written in the guest.
const PROGRAM_DIR: &str = "/run/strata";

/// The environment every job starts from.
const BASE_ENV: &[(&str, &str)] =
    &[("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"), ("HOME", "/root"), ("LANG", "C.UTF-8")];

/// Settings of the microVM tier.
#[derive(Debug, Clone)]
pub struct MicrovmTierConfig {
    /// The guest kernel (ELF vmlinux).
    pub kernel: PathBuf,
    /// The initramfs with the agent.
    pub initramfs: PathBuf,
    /// The Debian disk (squashfs); jobs run on the initramfs's busybox without it.
    pub root_disk: Option<PathBuf>,
    /// A directory of Strata's own for the VMs' sockets.
    pub run_dir: PathBuf,
    /// CPUID mask.
    pub cpuid: CpuidProfile,
}

/// The microVM tier.
#[derive(Debug)]
pub struct MicrovmTier {
    config: MicrovmTierConfig,
}

impl MicrovmTier {
    /// The tier with these images.
    pub fn new(config: MicrovmTierConfig) -> MicrovmTier {
        MicrovmTier { config }
    }
}

fn unsupported(what: &str) -> TierError {
    TierError::Unsupported { tier: TierKind::Microvm, what: what.to_owned() }
}

fn internal(message: impl std::fmt::Display) -> TierError {
    TierError::Internal { tier: TierKind::Microvm, message: message.to_string() }
}

impl Tier for MicrovmTier {
    fn kind(&self) -> TierKind {
        TierKind::Microvm
    }

    fn run(&self, job: &Job, caps: &Capabilities, limits: &Limits, opts: ExecOptions) -> Result<Outcome, TierError> {
        let limits = opts.limits.as_ref().unwrap_or(limits);
        if let Net::Allow(_) = caps.net {
            return Err(unsupported("network egress (the vsock egress tunnel is not built yet)"));
        }
        if !caps.tools.is_empty() {
            return Err(unsupported("host tools"));
        }
        let started = Instant::now();
        let Some(trees) = scan_grants(caps, limits)? else {
            return Ok(ended(Status::LimitExceeded { limit: LimitKind::Disk }, started));
        };
        let (argv, upload) = translate(job)?;
        let vcpus = u8::try_from(limits.vcpus.clamp(1, 32)).unwrap_or(1);
        let config = MicrovmConfig {
            kernel: self.config.kernel.clone(),
            initramfs: self.config.initramfs.clone(),
            root_disk: self.config.root_disk.clone(),
            memory_bytes: limits.memory.0.max(64 << 20),
            vcpus,
            cpuid: self.config.cpuid,
            run_dir: self.config.run_dir.clone(),
        };
        let mut vm = Microvm::boot(&config).map_err(internal)?;
        let client = match vm.connect_agent(limits.wall) {
            Ok(client) => client,
            Err(BuildError::AgentTimeout { .. }) => {
                return Ok(ended(Status::LimitExceeded { limit: LimitKind::Wall }, started));
            }
            Err(BuildError::GuestDied { exit, console }) => {
                let message = format!("the guest stopped before its agent was ready ({exit})");
                let mut outcome = ended(Status::Crashed { message }, started);
                outcome.stderr = console.into_bytes();
                return Ok(outcome);
            }
            Err(err) => return Err(internal(err)),
        };
        for (grant, tree) in caps.grants.iter().zip(&trees) {
            grants::copy_in(&client, tree, &grant.guest).map_err(grant_error)?;
        }
        if let Some((path, bytes)) = &upload {
            client.write_file(path, 0o755, bytes).map_err(internal)?;
        }
        let secrets = caps.secret_values();
        let sink: Option<Arc<dyn OutputSink>> = opts.sink.clone();
        let stdout = OutputCapture::new(Stream::Stdout, limits.output.0, secrets.clone(), sink.clone());
        let stderr = OutputCapture::new(Stream::Stderr, limits.output.0, secrets, sink);
        let mut env: Vec<(String, String)> = BASE_ENV.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
        for var in caps.guest_env() {
            env.retain(|(k, _)| *k != var.name);
            env.push((var.name.clone(), var.value.clone()));
        }
        let stdin = opts.stdin.as_deref().unwrap_or(&caps.stdin);
        let request = ExecRequest {
            argv,
            env,
            cwd: "/root".into(),
            stdin: !stdin.is_empty(),
            limits: ExecLimits {
                output: Some(limits.output.0),
                open_files: Some(u64::from(limits.files)),
                cpu_seconds: Some(limits.cpu.as_secs().saturating_add(1)),
            },
        };
        let mut handle = client.start(&request).map_err(|err| match err {
            ClientError::ExecFailed { errno, message } if errno == libc::ENOENT => {
                TierError::ProgramNotFound { program: message }
            }
            ClientError::ExecFailed { message, .. } => TierError::ExecFailed { message },
            other => internal(other),
        })?;
        let control = handle.control();
        if !stdin.is_empty() {
            control.write_stdin(stdin).map_err(internal)?;
            control.close_stdin().map_err(internal)?;
        }
        let deadline = started + limits.wall;
        let mut stopped: Option<LimitKind> = None;
        let report = loop {
            if opts.cancel.as_ref().is_some_and(strata_core::CancelToken::is_cancelled) {
                let _ = control.signal(libc::SIGKILL);
                return Err(TierError::Cancelled);
            }
            let left = deadline.saturating_duration_since(Instant::now()).min(Duration::from_millis(50));
            match handle.next_event(Some(left.max(Duration::from_millis(1)))) {
                Ok(ExecEvent::Output { stream: OutputStream::Stdout, data }) => stdout.write(&data),
                Ok(ExecEvent::Output { stream: OutputStream::Stderr, data }) => stderr.write(&data),
                Ok(ExecEvent::Exited(report)) => break Some(report),
                Err(ClientError::Timeout(_)) => {
                    if Instant::now() >= deadline && stopped.is_none() {
                        stopped = Some(LimitKind::Wall);
                        let _ = control.signal(libc::SIGKILL);
                    } else if stopped.is_some() && Instant::now() >= deadline + Duration::from_secs(2) {
                        break None;
                    }
                }
                Err(err) => return Err(internal(err)),
            }
        };
        let wall = started.elapsed();
        let (status, cpu, peak) = match report {
            None => (Status::LimitExceeded { limit: LimitKind::Wall }, Duration::ZERO, 0),
            Some(report) => {
                let cpu = Duration::from_micros(report.rusage.user_us.saturating_add(report.rusage.sys_us));
                let status = match (stopped, report.status) {
                    (Some(limit), _) => Status::LimitExceeded { limit },
                    (None, _) if report.oom_killed => Status::LimitExceeded { limit: LimitKind::Memory },
                    (None, ExitStatus::Signal(_)) if cpu > limits.cpu => {
                        Status::LimitExceeded { limit: LimitKind::Cpu }
                    }
                    (None, ExitStatus::Code(code)) => Status::Exited { code },
                    (None, ExitStatus::Signal(signal)) => {
                        Status::Trapped { message: format!("killed by signal {signal}") }
                    }
                };
                (status, cpu, report.rusage.max_rss_kb.saturating_mul(1024))
            }
        };
        let status =
            if status == (Status::Exited { code: 0 }) { copy_back(&client, caps, limits, status)? } else { status };
        let _ = client.power_off();
        vm.shutdown();
        let (out, err) = (stdout.finish(), stderr.finish());
        Ok(Outcome {
            tier: TierKind::Microvm,
            status,
            truncated: Truncated { stdout: out.truncated, stderr: err.truncated },
            usage: Usage {
                wall,
                cpu,
                fuel: None,
                peak_memory: peak,
                stdout_bytes: out.written,
                stderr_bytes: err.written,
            },
            stdout: out.bytes,
            stderr: err.bytes,
            escalations: Vec::new(),
            tools: Vec::new(),
        })
    }

    fn start(&self, _caps: &Capabilities, _limits: &Limits) -> Result<Box<dyn Sandbox>, TierError> {
        Err(unsupported("sessions (one VM per job today)"))
    }
}

/// Guest paths a grant may not take: the guest's kernel filesystems and where Strata puts programs.
const RESERVED_GUEST_PATHS: &[&str] = &["/proc", "/sys", "/dev", PROGRAM_DIR];

/// Checks every grant and walks its host tree; `None` when their files are over the disk limit.
fn scan_grants(caps: &Capabilities, limits: &Limits) -> Result<Option<Vec<HostTree>>, TierError> {
    let mut left = limits.disk.0;
    let mut trees = Vec::with_capacity(caps.grants.len());
    for grant in &caps.grants {
        let reserved = |r: &&str| grant.guest == *r || grant.guest.starts_with(&format!("{r}/"));
        if grant.guest == "/" || RESERVED_GUEST_PATHS.iter().any(reserved) {
            return Err(TierError::GuestPath {
                path: grant.guest.clone(),
                reason: "is reserved in the microVM (/, /proc, /sys, /dev, /run/strata)".into(),
            });
        }
        let host = grant.host.canonicalize().map_err(|_| strata_core::CapsError::GrantNotFound(grant.host.clone()))?;
        match grants::scan(&host, left) {
            Ok(tree) => {
                left -= tree.bytes;
                trees.push(tree);
            }
            Err(GrantError::TooLarge { .. }) => return Ok(None),
            Err(err) => return Err(grant_error(err)),
        }
    }
    Ok(Some(trees))
}

/// Copies the read-write grants back after a job that exited with 0; the status that the job ends with.
fn copy_back(client: &AgentClient, caps: &Capabilities, limits: &Limits, status: Status) -> Result<Status, TierError> {
    let mut left = limits.disk.0;
    for grant in caps.grants.iter().filter(|g| g.mode == GrantMode::Rw) {
        let host =
            grant.host.canonicalize().map_err(|source| TierError::ReadInput { path: grant.host.clone(), source })?;
        match grants::copy_out(client, &grant.guest, &host, left) {
            Ok(copied) => left = left.saturating_sub(copied.bytes),
            Err(GrantError::TooLarge { .. } | GrantError::TooManyEntries { .. }) => {
                return Ok(Status::LimitExceeded { limit: LimitKind::Disk });
            }
            Err(err @ GrantError::Refused { .. }) => return Ok(Status::Crashed { message: err.to_string() }),
            Err(err) => return Err(grant_error(err)),
        }
    }
    Ok(status)
}

fn grant_error(err: GrantError) -> TierError {
    match err {
        GrantError::Host { path, source } => TierError::ReadInput { path, source },
        GrantError::NotEmpty { guest } => TierError::GuestPath {
            path: guest,
            reason: "a microVM grant needs a guest path that is absent or empty in the image".into(),
        },
        GrantError::Agent(err) => internal(err),
        other => TierError::Unsupported { tier: TierKind::Microvm, what: other.to_string() },
    }
}

/// An outcome for a job that never ran.
fn ended(status: Status, started: Instant) -> Outcome {
    Outcome {
        tier: TierKind::Microvm,
        status,
        stdout: Vec::new(),
        stderr: Vec::new(),
        truncated: Truncated::default(),
        usage: Usage { wall: started.elapsed(), ..Usage::default() },
        escalations: Vec::new(),
        tools: Vec::new(),
    }
}

/// A host file to write into the guest before the job: guest path and contents.
type Upload = (String, Vec<u8>);

/// The job's argv, and a host file to write into the guest first.
fn translate(job: &Job) -> Result<(Vec<String>, Option<Upload>), TierError> {
    let upload = |path: &std::path::Path, dir: &str| -> Result<Upload, TierError> {
        let bytes = std::fs::read(path).map_err(|source| TierError::ReadInput { path: path.to_owned(), source })?;
        let name = path.file_name().map(|n| n.to_string_lossy().replace('/', "_")).unwrap_or_else(|| "program".into());
        Ok((format!("{PROGRAM_DIR}/{dir}/{name}"), bytes))
    };
    match job {
        Job::Command { argv } if argv.first().is_some_and(|a| !a.is_empty()) => Ok((argv.clone(), None)),
        Job::Command { .. } => Err(TierError::WrongFormat { what: "the command".into(), expected: "a non-empty argv" }),
        Job::Native { program, args } => {
            let (path, bytes) = upload(program, "bin")?;
            let mut argv = vec![path.clone()];
            argv.extend(args.iter().cloned());
            Ok((argv, Some((path, bytes))))
        }
        Job::Python { source, args } => {
            let mut argv = vec!["python3".to_owned()];
            let mut file = None;
            match source {
                PythonSource::Code(code) => argv.extend(["-c".to_owned(), code.clone()]),
                PythonSource::Module(module) => argv.extend(["-m".to_owned(), module.clone()]),
                PythonSource::File(path) => {
                    let (guest, bytes) = upload(path, "scripts")?;
                    argv.push(guest.clone());
                    file = Some((guest, bytes));
                }
            }
            argv.extend(args.iter().cloned());
            Ok((argv, file))
        }
        Job::Wasm { .. } => Err(TierError::WrongJob { tier: TierKind::Microvm, job: job.kind() }),
    }
}
