//! Serving one connection: the handshake, then each host message in turn.
//!
//! The connection's thread reads frames and answers everything but execs and watches itself (file transfers
//! and methods, snapshot steps). Each exec runs on a thread of its own ([`crate::exec`]) that writes its output
//! and exit through the shared writer, so several execs run at once; so does each watch ([`crate::watch`]) with
//! its events. When the connection ends, every exec still running is killed (with its process group) and waited
//! for, every watch is stopped, and unfinished file writes are removed: the next connection starts clean.
//!
//! The host is trusted to mean well but not to be well-formed: a frame that does not decode is answered with
//! [`GuestMessage::Error`] (the stream is still in step), an oversize or truncated one ends the connection.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;

use strata_guest_proto::frame::{decode, peek_hello_version};
use strata_guest_proto::{
    ExecRequest, FrameError, FrameReader, FrameWriter, GuestMessage, HostMessage, PROTOCOL_VERSION, RequestId,
    Transport,
};

use crate::egress::{EgressDial, Forwarder, PortRelays};
use crate::entries;
use crate::exec::{self, ExecSink, Running, StdinQueue};
use crate::files::{self, FileError, Writes};
use crate::reap::Reaper;
use crate::system::{self, Halt};
use crate::tree;
use crate::watch::{self, Watch};

/// Where the agent runs, which decides what it may do to the system.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// In a guest: reseed randomness and set the clock after a restore, detect OOM kills, power off.
    Guest {
        /// How to end the guest.
        halt: Halt,
    },
    /// As an ordinary host process (tests): none of that.
    Host,
}

/// How the agent behaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AgentConfig {
    /// Guest or host.
    pub role: Role,
    /// Reap every child (PID 1, or a subreaper) rather than only the execs' own processes.
    pub reap_all: bool,
}

impl AgentConfig {
    /// An agent run as an ordinary host process.
    pub fn host() -> AgentConfig {
        AgentConfig { role: Role::Host, reap_all: false }
    }

    /// An agent in a guest (PID 1 or not).
    pub fn guest(halt: Halt) -> AgentConfig {
        AgentConfig { role: Role::Guest { halt }, reap_all: true }
    }
}

/// How a connection ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ServeEnd {
    /// The host closed it.
    Closed,
    /// The host asked for a power-off.
    PowerOff,
    /// The host speaks another protocol version (it was told ours).
    VersionMismatch {
        /// The host's version.
        host: u32,
    },
}

/// A connection that broke.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// A frame could not be read or written.
    #[error("agent connection")]
    Frame(#[source] FrameError),
    /// The host did not start with `Hello`.
    #[error("the host sent {kind} before Hello")]
    NoHello {
        /// What it sent.
        kind: &'static str,
    },
    /// A thread could not be started.
    #[error("starting a thread failed")]
    Thread(#[source] std::io::Error),
}

/// The agent: serves connections one at a time.
#[derive(Debug)]
pub struct Agent {
    config: AgentConfig,
    reaper: Reaper,
    /// How the egress forwarder reaches the host ([`crate::egress`]).
    egress_dial: EgressDial,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Agent {
    /// An agent; with [`AgentConfig::reap_all`] this starts the reaper thread.
    pub fn new(config: AgentConfig) -> std::io::Result<Agent> {
        let reaper = if config.reap_all { Reaper::all()? } else { Reaper::own() };
        Ok(Agent { config, reaper, egress_dial: EgressDial::Vsock })
    }

    /// Sets how the egress forwarder reaches the host (default: AF_VSOCK to the host).
    pub fn with_egress_dial(mut self, dial: EgressDial) -> Agent {
        self.egress_dial = dial;
        self
    }

    /// The configuration.
    pub fn config(&self) -> AgentConfig {
        self.config
    }

    /// Orphans reaped so far.
    pub fn orphans_reaped(&self) -> u64 {
        self.reaper.orphans_reaped()
    }

    /// Serves one connection until it closes or the host asks for a power-off.
    pub fn serve<T: Transport>(&self, transport: T) -> Result<ServeEnd, ServeError> {
        let io = |e| ServeError::Frame(FrameError::Io(e));
        let writer = transport.try_clone().map_err(io)?;
        let closer = transport.try_clone().map_err(io)?;
        let out = Arc::new(Out { writer: Mutex::new(FrameWriter::new(writer)) });
        let mut reader = FrameReader::new(transport);
        if let Some(end) = self.handshake(&mut reader, &out)? {
            return Ok(end);
        }
        let mut session = Session {
            agent: self,
            out,
            execs: Arc::new(Mutex::new(HashMap::new())),
            threads: Vec::new(),
            writes: Writes::default(),
            egress: None,
            ports: PortRelays::new(self.egress_dial.clone()),
            watches: HashMap::new(),
        };
        let end = session.run(&mut reader);
        // Exec threads blocked writing to a host that stopped reading get an error and finish.
        let _ = closer.shutdown();
        session.end();
        end
    }

    /// Answers `Hello`; `Some` when the connection ends here.
    fn handshake<T: Transport>(
        &self,
        reader: &mut FrameReader<T>,
        out: &Out<T>,
    ) -> Result<Option<ServeEnd>, ServeError> {
        let Some(body) = reader.read_body().map_err(ServeError::Frame)? else {
            return Ok(Some(ServeEnd::Closed));
        };
        let hello = GuestMessage::Hello {
            version: PROTOCOL_VERSION,
            agent_version: env!("CARGO_PKG_VERSION").to_owned(),
            kernel: system::kernel_release(),
        };
        if let Some(host) = peek_hello_version(body).filter(|&v| v != PROTOCOL_VERSION) {
            // Our Hello tells the host which version we speak; then we hang up.
            out.send(&hello).map_err(ServeError::Frame)?;
            return Ok(Some(ServeEnd::VersionMismatch { host }));
        }
        match decode::<HostMessage>(body) {
            Ok(HostMessage::Hello { .. }) => {
                out.send(&hello).map_err(ServeError::Frame)?;
                Ok(None)
            }
            Ok(other) => {
                let kind = other.kind();
                let _ = out.send(&GuestMessage::Error { id: None, message: format!("{kind} before Hello") });
                Err(ServeError::NoHello { kind })
            }
            Err(err) => {
                let _ = out.send(&GuestMessage::Error { id: None, message: err.to_string() });
                Err(ServeError::Frame(err))
            }
        }
    }
}

/// The connection's sending half, shared by the exec threads.
struct Out<T> {
    writer: Mutex<FrameWriter<T>>,
}

impl<T: Transport> Out<T> {
    fn send(&self, message: &GuestMessage) -> Result<(), FrameError> {
        lock(&self.writer).write(message)
    }
}

impl<T: Transport> ExecSink for (RequestId, &Out<T>) {
    fn output(&self, stream: strata_guest_proto::OutputStream, data: &[u8]) {
        // A failed write means the host is gone; the connection's thread notices and ends the exec.
        let _ = self.1.send(&GuestMessage::Output { id: self.0, stream, data: data.into() });
    }
}

/// A running exec, as the connection's thread knows it.
struct ExecEntry {
    /// Its process group (the main process's PID).
    pgid: i32,
    stdin: Option<Arc<StdinQueue>>,
    /// Its terminal's master, when it runs on one.
    terminal: Option<Arc<std::os::fd::OwnedFd>>,
}

type ExecTable = Arc<Mutex<HashMap<RequestId, ExecEntry>>>;

struct Session<'a, T: Transport> {
    agent: &'a Agent,
    out: Arc<Out<T>>,
    execs: ExecTable,
    threads: Vec<JoinHandle<()>>,
    writes: Writes,
    /// The egress forwarder, once the host asked for it; stopped when the connection ends.
    egress: Option<Forwarder>,
    /// The host's connections to the guest's servers; shut down when the connection ends.
    ports: PortRelays,
    /// The running watches, stopped when the connection ends.
    watches: HashMap<RequestId, Watch>,
}

/// The messages of one answer sent as they are made; the first failure to send is kept, and nothing more is sent.
struct Streamed<'a, T> {
    out: &'a Out<T>,
    failed: Option<FrameError>,
}

impl<'a, T: Transport> Streamed<'a, T> {
    fn new(out: &'a Out<T>) -> Self {
        Streamed { out, failed: None }
    }

    fn send(&mut self, message: GuestMessage) {
        if self.failed.is_none()
            && let Err(err) = self.out.send(&message)
        {
            self.failed = Some(err);
        }
    }

    fn finish(self) -> Result<(), ServeError> {
        self.failed.map_or(Ok(()), |err| Err(ServeError::Frame(err)))
    }
}

impl<T: Transport> Session<'_, T> {
    fn run(&mut self, reader: &mut FrameReader<T>) -> Result<ServeEnd, ServeError> {
        loop {
            let body = match reader.read_body() {
                Ok(Some(body)) => body,
                Ok(None) => return Ok(ServeEnd::Closed),
                Err(err) => {
                    // Out of step with the stream (oversize, truncated) or the connection failed: tell the host
                    // if it still listens, and hang up.
                    let _ = self.out.send(&GuestMessage::Error { id: None, message: err.to_string() });
                    return Err(ServeError::Frame(err));
                }
            };
            let message = match decode::<HostMessage>(body) {
                Ok(message) => message,
                Err(err) => {
                    self.send(GuestMessage::Error { id: None, message: err.to_string() })?;
                    continue;
                }
            };
            if let Some(end) = self.handle(message)? {
                return Ok(end);
            }
        }
    }

    fn send(&self, message: GuestMessage) -> Result<(), ServeError> {
        self.out.send(&message).map_err(ServeError::Frame)
    }

    fn handle(&mut self, message: HostMessage) -> Result<Option<ServeEnd>, ServeError> {
        match message {
            HostMessage::Hello { .. } => {
                self.send(GuestMessage::Error { id: None, message: "a second Hello".into() })?;
            }
            HostMessage::Exec { id, request } => self.exec(id, &request)?,
            HostMessage::StdinData { id, data } => {
                if let Some(queue) = self.stdin_of(id) {
                    queue.push(data.0);
                }
            }
            HostMessage::StdinClose { id } => {
                if let Some(queue) = self.stdin_of(id) {
                    queue.close();
                }
            }
            HostMessage::Signal { id, signal } => {
                if let Some(entry) = lock(&self.execs).get(&id) {
                    // SAFETY: kill() takes no pointers. The group is that of an exec whose thread has not yet
                    // seen its main process exit; an out-of-range signal fails with EINVAL.
                    unsafe { libc::kill(-entry.pgid, signal) };
                }
            }
            HostMessage::OpenPort { id, port, host_port } => {
                let answer = match self.ports.open(port, host_port) {
                    Ok(()) => GuestMessage::Ack { id },
                    Err(err) => GuestMessage::Error { id: Some(id), message: error_chain(&err) },
                };
                self.send(answer)?;
            }
            HostMessage::Resize { id, size } => {
                if let Some(terminal) = lock(&self.execs).get(&id).and_then(|entry| entry.terminal.clone()) {
                    let _ = exec::resize(&terminal, size);
                }
            }
            HostMessage::WriteFile { id, path, mode, data, last } => {
                if let Some(answer) = self.writes.chunk(id, &path, mode, &data, last) {
                    self.send(answer)?;
                }
            }
            HostMessage::ReadFile { id, path, max } => {
                let mut stream = Streamed::new(&self.out);
                let result =
                    files::read(&path, max, |chunk| stream.send(GuestMessage::FileData { id, data: chunk.into() }));
                stream.finish()?;
                self.send(match result {
                    Ok(size) => GuestMessage::FileDone { id, size },
                    Err(err) => err.answer(id),
                })?;
            }
            HostMessage::PrepareSnapshot { id } => {
                let running = lock(&self.execs).len();
                self.send(if running > 0 {
                    GuestMessage::Error { id: Some(id), message: format!("{running} execs are running") }
                } else {
                    system::sync();
                    GuestMessage::Ack { id }
                })?;
            }
            HostMessage::AfterRestore { id, entropy, unix_time_ns } => {
                let result = match self.agent.config.role {
                    Role::Guest { .. } => system::reseed(&entropy).and_then(|()| system::set_clock(unix_time_ns)),
                    Role::Host => Ok(()),
                };
                self.send(match result {
                    Ok(()) => GuestMessage::Ack { id },
                    Err(err) => GuestMessage::Error { id: Some(id), message: error_chain(&err) },
                })?;
            }
            HostMessage::MakeDir { id, path, mode, empty } => {
                self.send(match files::make_dir(&path, mode, empty) {
                    Ok(()) => GuestMessage::Ack { id },
                    Err(err) => err.answer(id),
                })?;
            }
            HostMessage::MakeSymlink { id, path, target } => {
                self.send(match files::make_symlink(&path, &target) {
                    Ok(()) => GuestMessage::Ack { id },
                    Err(err) => err.answer(id),
                })?;
            }
            HostMessage::ListTree { id, path, max_entries } => {
                let mut stream = Streamed::new(&self.out);
                let result =
                    tree::list(&path, max_entries, |entries| stream.send(GuestMessage::TreeEntries { id, entries }));
                stream.finish()?;
                self.send(match result {
                    Ok(listed) => GuestMessage::TreeDone { id, count: listed.count, skipped: listed.skipped },
                    Err(err) => err.answer(id),
                })?;
            }
            HostMessage::StartEgress { id, listen_port, host_port, max_connections } => {
                let answer = if self.egress.is_some() {
                    GuestMessage::Error { id: Some(id), message: "the egress forwarder is already running".into() }
                } else {
                    match Forwarder::start(self.agent.egress_dial.clone(), listen_port, host_port, max_connections) {
                        Ok(forwarder) => {
                            self.egress = Some(forwarder);
                            GuestMessage::Ack { id }
                        }
                        Err(err) => GuestMessage::Error { id: Some(id), message: error_chain(&err) },
                    }
                };
                self.send(answer)?;
            }
            HostMessage::Stat { id, path } => self.send(match entries::stat(&path) {
                Ok(entry) => GuestMessage::Entry { id, entry },
                Err(err) => err.answer(id),
            })?,
            HostMessage::ListDir { id, path, depth, max_entries } => {
                let mut stream = Streamed::new(&self.out);
                let result = entries::list_dir(&path, depth, max_entries, |entries| {
                    stream.send(GuestMessage::DirEntries { id, entries })
                });
                stream.finish()?;
                self.send(match result {
                    Ok(listed) => GuestMessage::DirDone { id, count: listed.count, skipped: listed.skipped },
                    Err(err) => err.answer(id),
                })?;
            }
            HostMessage::CreateDir { id, path } => self.send(match entries::create_dir(&path) {
                Ok(created) => GuestMessage::DirCreated { id, created },
                Err(err) => err.answer(id),
            })?,
            HostMessage::Rename { id, from, to } => self.send(match entries::rename(&from, &to) {
                Ok(entry) => GuestMessage::Entry { id, entry },
                Err(err) => err.answer(id),
            })?,
            HostMessage::Remove { id, path } => self.send(match entries::remove(&path) {
                Ok(()) => GuestMessage::Ack { id },
                Err(err) => err.answer(id),
            })?,
            HostMessage::Watch { id, path, recursive } => self.watch(id, &path, recursive)?,
            HostMessage::Unwatch { id } => {
                if let Some(watch) = self.watches.remove(&id) {
                    watch.stop();
                }
            }
            HostMessage::PowerOff => return Ok(Some(ServeEnd::PowerOff)),
        }
        Ok(None)
    }

    /// Sets up a watch, answers, then starts it (so that the answer comes before its first events).
    fn watch(&mut self, id: RequestId, path: &str, recursive: bool) -> Result<(), ServeError> {
        self.watches.retain(|_, watch| !watch.is_finished());
        let refused = if self.watches.contains_key(&id) {
            Some(FileError::new(libc::EBUSY, format!("watch {id} is already running")))
        } else if self.watches.len() >= watch::MAX_WATCHES {
            Some(FileError::new(libc::ENOSPC, format!("{} watches are running already", watch::MAX_WATCHES)))
        } else {
            None
        };
        let prepared = match refused.map_or_else(|| watch::prepare(path, recursive), Err) {
            Ok(prepared) => prepared,
            Err(err) => return self.send(err.answer(id)),
        };
        self.send(GuestMessage::Ack { id })?;
        let out = Arc::clone(&self.out);
        let watch = prepared.start(id, move |message| out.send(&message).is_ok()).map_err(ServeError::Thread)?;
        self.watches.insert(id, watch);
        Ok(())
    }

    fn stdin_of(&self, id: RequestId) -> Option<Arc<StdinQueue>> {
        lock(&self.execs).get(&id).and_then(|entry| entry.stdin.clone())
    }

    fn exec(&mut self, id: RequestId, request: &ExecRequest) -> Result<(), ServeError> {
        self.threads.retain(|thread| !thread.is_finished());
        if lock(&self.execs).contains_key(&id) {
            let message = format!("request {id} is already running");
            return self.send(GuestMessage::ExecFailed { id, errno: libc::EBUSY, message });
        }
        let guest = matches!(self.agent.config.role, Role::Guest { .. });
        let oom_before = if guest { system::oom_kills() } else { None };
        let running = match exec::spawn(request, &self.agent.reaper)
            .and_then(|spawned| Running::new(spawned, request.limits.output))
        {
            Ok(running) => running,
            Err(err) => return self.send(GuestMessage::ExecFailed { id, errno: err.errno, message: err.message }),
        };
        let pid = running.pid();
        let entry = ExecEntry { pgid: pid, stdin: running.stdin_queue(), terminal: running.terminal() };
        lock(&self.execs).insert(id, entry);
        self.send(GuestMessage::Started { id, pid })?;
        let out = Arc::clone(&self.out);
        let execs = Arc::clone(&self.execs);
        let thread = std::thread::Builder::new().name(format!("exec-{}", id.0)).spawn(move || {
            let sink = (id, &*out);
            let finished = running.run(&sink, || {
                lock(&execs).remove(&id);
            });
            let oom_after = if guest { system::oom_kills() } else { None };
            let status = finished.exit.status;
            let _ = out.send(&GuestMessage::Exited {
                id,
                status,
                rusage: finished.exit.rusage,
                oom_killed: exec::oom_killed(status, oom_before, oom_after),
                stdout_bytes: finished.bytes[0],
                stderr_bytes: finished.bytes[1],
            });
        });
        match thread {
            Ok(thread) => self.threads.push(thread),
            Err(err) => {
                // SAFETY: kill() takes no pointers; the group is the exec's own, just started.
                unsafe { libc::kill(-pid, libc::SIGKILL) };
                lock(&self.execs).remove(&id);
                return Err(ServeError::Thread(err));
            }
        }
        Ok(())
    }

    /// Kills what is still running and waits for it; drops unfinished writes; stops the egress forwarder and the
    /// watches.
    fn end(&mut self) {
        for (_, watch) in self.watches.drain() {
            watch.stop();
        }
        if let Some(forwarder) = self.egress.take() {
            forwarder.stop();
        }
        self.ports.stop();
        for entry in lock(&self.execs).values() {
            // SAFETY: kill() takes no pointers; the group is a running exec's.
            unsafe { libc::kill(-entry.pgid, libc::SIGKILL) };
        }
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
        self.writes.abandon();
    }
}

pub use strata_guest_proto::error_chain;
