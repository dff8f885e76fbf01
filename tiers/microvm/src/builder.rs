//! A microVM that boots Linux, in a monitor process of its own ([`crate::monitor`]), and reaching its guest agent:
//! `Microvm::boot` has the monitor put the pieces together (memfd memory, the VM with its irqchip, the kernel and
//! initramfs, the serial console, virtio-vsock for the agent, virtio-blk for an optional read-only root disk, the
//! vCPU threads: [`strata_vmm::monitor::build`]); `Microvm::connect_agent` waits for the agent over vsock;
//! dropping the `Microvm` ends the monitor and removes its directory.
//!
//! The kernel command line is the engine's (the monitor appends its devices: virtio-mmio slots of 4 KiB from the
//! start of the MMIO gap, GSIs from 5 up, vsock first, then the root disk). The guest reboots by triple fault
//! (`reboot=t`) and the agent's power-off is a restart (`strata.halt=restart`): without ACPI a halt would leave the
//! VM running; a triple fault ends the vCPU with a `Shutdown` exit.
//!
//! Built for hardware KVM. On a PVM host the kernel stops in KVM's instruction emulator; `boot` still succeeds (it
//! only starts the vCPUs) and `connect_agent` then reports the guest's crash with the console's last lines — fast,
//! typed, never a hang. The engine does not even try there (`strata doctor` says why).

use std::fs::File;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use strata_guest_proto::{AgentClient, ClientConfig, DEFAULT_AGENT_PORT};
use strata_vmm::persist::{MAX_STATE_BYTES, MEMORY_FILE, MicrovmState, STATE_HEADER_LEN};
use strata_vmm::proto::{BootImage, BootSpec, DiskSpec, MachineSpec, PROTOCOL_VERSION, Payload};

use crate::machine::MachineError;
use crate::monitor::{Monitor, MonitorConfig, MonitorError};
use crate::snapshot::{SnapshotExtra, VmSnapshot, VmSnapshotError};
use crate::vstate::vcpu::cpuid::CpuidProfile;
use strata_tier_process::jail::CgroupRoot;

/// The guest's vsock CID (one VM per vsock device, so it can be the same for every VM).
pub const GUEST_CID: u64 = 3;

/// The vsock socket's name in the VM's socket directory.
const VSOCK_SOCKET: &str = "vsock.sock";

/// The kernel command line, before the root disk's arguments and the monitor's devices.
pub const BASE_CMDLINE: &str = "console=ttyS0 reboot=t panic=-1 pci=off nokaslr i8042.noaux i8042.nomux \
                                i8042.dumbkbd strata.halt=restart";

/// What to boot.
#[derive(Debug, Clone)]
pub struct MicrovmConfig {
    /// An ELF `vmlinux`.
    pub kernel: PathBuf,
    /// The initramfs (the agent as `/init`).
    pub initramfs: PathBuf,
    /// A read-only root disk (squashfs) the agent moves onto, when given.
    pub root_disk: Option<PathBuf>,
    /// Guest RAM in bytes.
    pub memory_bytes: u64,
    /// vCPUs.
    pub vcpus: u8,
    /// CPUID mask.
    pub cpuid: CpuidProfile,
    /// A directory of Strata's own for this VM's sockets (must exist).
    pub run_dir: PathBuf,
}

/// Why a microVM could not be built, or its agent reached.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    /// The monitor could not be started, failed to build the machine, or died.
    #[error(transparent)]
    Monitor(#[from] MonitorError),
    /// A file (kernel, initramfs, disk).
    #[error("cannot open {}: {source}", path.display())]
    Open {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The guest stopped before its agent answered.
    #[error("the guest stopped before its agent was ready ({exit}); console:\n{console}")]
    GuestDied {
        /// How the vCPU ended.
        exit: String,
        /// The console's last lines.
        console: String,
    },
    /// The agent did not answer in time.
    #[error("the guest agent did not answer within {waited:?}; console:\n{console}")]
    AgentTimeout {
        /// How long it was waited for.
        waited: Duration,
        /// The console's last lines.
        console: String,
    },
}

/// A running microVM: its monitor process and the host path of its vsock device's socket.
#[derive(Debug)]
pub struct Microvm {
    monitor: Mutex<Monitor>,
    vsock_uds: PathBuf,
    started: Instant,
}

/// Where monitors run: the run directory, and this host's cgroups (looked up once per process).
fn monitor_config(run_dir: &Path) -> MonitorConfig {
    static CGROUPS: OnceLock<Option<CgroupRoot>> = OnceLock::new();
    MonitorConfig { run_dir: run_dir.to_owned(), cgroups: CGROUPS.get_or_init(|| CgroupRoot::detect().ok()).clone() }
}

fn open(path: &Path) -> Result<File, BuildError> {
    File::open(path).map_err(|source| BuildError::Open { path: path.to_owned(), source })
}

impl Microvm {
    /// Starts a monitor that builds the VM and starts its vCPUs.
    pub fn boot(config: &MicrovmConfig) -> Result<Microvm, BuildError> {
        let mut cmdline = format!("{BASE_CMDLINE} strata.port={DEFAULT_AGENT_PORT}");
        if config.cpuid == CpuidProfile::PvmCompat {
            cmdline.push_str(" noxsave");
        }
        let kernel = open(&config.kernel)?;
        let initramfs = open(&config.initramfs)?;
        let mut files = vec![kernel, initramfs];
        let mut disks = Vec::new();
        if let Some(disk) = &config.root_disk {
            files.push(open(disk)?);
            disks.push(DiskSpec { id: Some("strata-root".into()), name: "the root disk".into() });
            cmdline.push_str(" strata.root=/dev/vda strata.rootfstype=squashfs");
        }
        let vcpus = config.vcpus.max(1);
        let spec = MachineSpec {
            version: PROTOCOL_VERSION,
            payload: Payload::Boot(BootSpec {
                memory_bytes: config.memory_bytes,
                vcpus,
                cpuid: config.cpuid,
                irqchip: true,
                image: BootImage::Linux { cmdline, initramfs: true },
                probe: false,
            }),
            vsock_socket: Some(VSOCK_SOCKET.into()),
            guest_cid: Some(GUEST_CID),
            disks,
        };
        let fds: Vec<_> = files.iter().map(AsFd::as_fd).collect();
        let monitor = Monitor::start(&monitor_config(&config.run_dir), &spec, &fds, vcpus, config.memory_bytes)?;
        Ok(Microvm::around(monitor))
    }

    fn around(monitor: Monitor) -> Microvm {
        let vsock_uds = monitor.socket_dir().join(VSOCK_SOCKET);
        Microvm { monitor: Mutex::new(monitor), vsock_uds, started: Instant::now() }
    }

    /// A fork of `snapshot` in a new monitor: its memory file's private copy mapped copy-on-write there, a new
    /// vsock socket in a directory of its own under `run_dir`, the new guest CID `guest_cid` (the fork's
    /// identity), the root disk `root_disk` when the snapshot has one, and the vCPUs running. The guest's vsock
    /// connections were reset: reach the agent again with [`Microvm::connect_agent`].
    pub fn fork(
        snapshot: &VmSnapshot,
        run_dir: &Path,
        guest_cid: u64,
        root_disk: Option<PathBuf>,
    ) -> Result<Microvm, VmSnapshotError> {
        let state = snapshot.state();
        let mut state_file = memfd("strata-vmstate")?;
        state_file.write_all(&state.to_bytes()?).map_err(io_error("the state"))?;
        // The monitor reads it from where the descriptor stands.
        std::io::Seek::rewind(&mut state_file).map_err(io_error("the state"))?;
        let memory = snapshot.snapshot().private_copy(MEMORY_FILE)?;
        let mut files = vec![state_file, memory.file().try_clone().map_err(io_error("the memory copy"))?];
        let mut disks = Vec::new();
        if let Some(disk) = &root_disk {
            files.push(File::open(disk).map_err(|source| VmSnapshotError::Io { path: disk.clone(), source })?);
            disks.push(DiskSpec { id: None, name: "the root disk".into() });
        }
        let spec = MachineSpec {
            version: PROTOCOL_VERSION,
            payload: Payload::Restore { fork: true },
            vsock_socket: Some(VSOCK_SOCKET.into()),
            guest_cid: Some(guest_cid),
            disks,
        };
        let fds: Vec<_> = files.iter().map(AsFd::as_fd).collect();
        let vcpus = u8::try_from(state.vcpus.len()).unwrap_or(u8::MAX);
        let monitor = Monitor::start(&monitor_config(run_dir), &spec, &fds, vcpus, state.memory_bytes)
            .map_err(VmSnapshotError::Monitor)?;
        Ok(Microvm::around(monitor))
    }

    /// Has the monitor pause the vCPUs at a safe point and write the whole VM into a new snapshot directory at
    /// `destination` (the memory file straight into the directory; the state into a file of ours, which is parsed
    /// and checked like any state: the monitor is not trusted), seals it with `trust` here, and resumes it,
    /// whether the save worked or not. Quiesce the guest first (the agent's `PrepareSnapshot`).
    pub fn snapshot(
        &mut self,
        destination: &Path,
        parent: Option<String>,
        extra: SnapshotExtra,
        trust: &strata_core::SnapshotTrust,
    ) -> Result<VmSnapshot, VmSnapshotError> {
        let writer = strata_core::SnapshotWriter::create(destination, trust)?;
        let path = writer.dir().join(MEMORY_FILE);
        let memory = File::create(&path).map_err(|source| VmSnapshotError::Io { path: path.clone(), source })?;
        let state_file = memfd("strata-vmstate")?;
        let length = self.lock().snapshot(&state_file, &memory).map_err(VmSnapshotError::Monitor)?;
        let cap = MAX_STATE_BYTES + STATE_HEADER_LEN as u64;
        if length > cap {
            return Err(MachineError::StateTooLarge { size: length, max: MAX_STATE_BYTES }.into());
        }
        let mut bytes = Vec::new();
        let mut reader = &state_file;
        std::io::Seek::rewind(&mut reader).map_err(io_error("the state"))?;
        reader.take(cap + 1).read_to_end(&mut bytes).map_err(io_error("the state"))?;
        let state = MicrovmState::from_bytes(&bytes, Path::new("vmstate"))?;
        let written = memory.metadata().map_err(|source| VmSnapshotError::Io { path: path.clone(), source })?.len();
        if written != state.memory_bytes {
            return Err(MachineError::MemorySize { expected: state.memory_bytes, found: written }.into());
        }
        drop(memory);
        VmSnapshot::commit(writer, state, parent, extra)
    }

    fn lock(&self) -> MutexGuard<'_, Monitor> {
        self.monitor.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The monitor's process ID, as the host sees it.
    pub fn monitor_pid(&self) -> i32 {
        self.lock().pid()
    }

    /// The console's log (empty when the monitor is gone).
    pub fn console(&self) -> String {
        self.lock().console().map(|(text, _)| text).unwrap_or_default()
    }

    /// The host Unix socket of the VM's vsock device (host-initiated connections; guest connections to port `P`
    /// go to `<it>_<P>`).
    pub fn vsock_socket(&self) -> &Path {
        &self.vsock_uds
    }

    /// Whether the guest has stopped on its own (it rebooted or crashed) or its monitor is gone.
    pub fn has_stopped(&self) -> bool {
        !matches!(self.lock().status(), Ok(None))
    }

    /// Waits (up to `timeout`) for the guest agent on vsock and connects to it.
    pub fn connect_agent(&mut self, timeout: Duration) -> Result<AgentClient, BuildError> {
        let deadline = self.started + timeout;
        loop {
            let status = self.lock().status();
            match status {
                Ok(None) => {}
                Ok(Some(stopped)) => {
                    return Err(BuildError::GuestDied {
                        exit: stopped.exits.join(", "),
                        console: self.console_tail(20),
                    });
                }
                Err(e) => return Err(e.into()),
            }
            if let Some(client) = self.try_connect() {
                return Ok(client);
            }
            if Instant::now() >= deadline {
                return Err(BuildError::AgentTimeout { waited: timeout, console: self.console_tail(20) });
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// One attempt: the vsock muxer's `CONNECT <port>` handshake, then the agent's own.
    fn try_connect(&self) -> Option<AgentClient> {
        let mut stream = UnixStream::connect(&self.vsock_uds).ok()?;
        stream.set_read_timeout(Some(Duration::from_millis(500))).ok()?;
        stream.write_all(format!("CONNECT {DEFAULT_AGENT_PORT}\n").as_bytes()).ok()?;
        let mut line = String::new();
        let mut reader = BufReader::new(stream.try_clone().ok()?);
        reader.read_line(&mut line).ok()?;
        if !line.starts_with("OK ") {
            return None;
        }
        stream.set_read_timeout(None).ok()?;
        AgentClient::connect(stream, ClientConfig { timeout: Some(Duration::from_secs(10)) }).ok()
    }

    /// The console's last `lines` lines; when the monitor is gone, why (a crash, its seccomp report).
    pub fn console_tail(&self, lines: usize) -> String {
        let text = match self.lock().console() {
            Ok((text, _)) => text,
            Err(e) => return e.to_string(),
        };
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// Ends the monitor (stopping the vCPUs first) and removes its directory, as dropping it does.
    pub fn shutdown(self) {
        self.monitor.into_inner().unwrap_or_else(PoisonError::into_inner).stop();
    }
}

fn memfd(name: &str) -> Result<File, VmSnapshotError> {
    let fd = nix::sys::memfd::memfd_create(name, nix::sys::memfd::MFdFlags::MFD_CLOEXEC)
        .map_err(|e| VmSnapshotError::Io { path: PathBuf::from(name), source: e.into() })?;
    Ok(File::from(fd))
}

fn io_error(what: &'static str) -> impl FnOnce(std::io::Error) -> VmSnapshotError {
    move |source| VmSnapshotError::Io { path: PathBuf::from(what), source }
}
