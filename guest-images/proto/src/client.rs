//! The host's side of a connection to the agent.
//!
//! [`AgentClient::connect`] shakes hands, then a reader thread owns the receiving half: it reads every frame
//! and routes it by [`RequestId`] to the request waiting for it, through a bounded queue (a slow consumer slows
//! the connection down rather than growing memory: at most [`ROUTE_QUEUE`] frames of [`MAX_FRAME`] bytes wait
//! per request). Any thread may start requests; an exec's output is consumed through its [`ExecHandle`].
//!
//! Nothing the agent sends is trusted. A frame that is oversize, truncated or not a message, an answer to a
//! request never made, or a second `Hello` ends the connection with a typed error that every waiting request
//! receives. A message of the wrong kind for its request, a chunk over [`MAX_CHUNK`], output beyond the cap the
//! host asked for, more file bytes than `max`, or an impossible exit status fails that request.
//!
//! A watch ([`AgentClient::watch`]) is the one request whose messages are not queued: the reader thread hands
//! each batch of events to the watch's sink at once, which must not block (the tier's sink drops what its reader
//! has no room for), so a guest flooding events costs the host a fixed amount. A batch over [`MAX_WATCH_BATCH`]
//! ends that watch; the sink is dropped when the watch ends, whatever ended it.
//!
//! Do not call a client method that waits for an answer from inside an exec's output callback: the answer may
//! be queued behind that exec's own output.

use std::collections::HashMap;
use std::io::{self, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender, TryRecvError};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::frame::{FrameError, FrameReader, FrameWriter, decode, peek_hello_version};
use crate::message::{
    Bytes, Entropy, EntryInfo, ExecRequest, ExitStatus, GuestMessage, HostMessage, OutputStream, RequestId, Rusage,
    TreeEntry, TtySize, WatchEvent,
};
use crate::transport::Transport;
use crate::{MAX_CHUNK, MAX_FRAME, MAX_TREE_BATCH, MAX_WATCH_BATCH, PROTOCOL_VERSION};

/// Frames that may wait, per request, for the thread consuming them.
pub const ROUTE_QUEUE: usize = 16;

/// A failed request or connection.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ClientError {
    /// The agent speaks another protocol version.
    #[error("the agent speaks protocol version {agent}, the host {host}")]
    VersionMismatch {
        /// [`PROTOCOL_VERSION`].
        host: u32,
        /// The agent's.
        agent: u32,
    },
    /// A frame could not be read or written.
    #[error("agent connection")]
    Frame(#[source] FrameError),
    /// The agent closed the connection (or the client was shut down).
    #[error("the agent closed the connection")]
    Disconnected,
    /// No answer in time.
    #[error("no answer from the agent within {0:?}")]
    Timeout(Duration),
    /// The agent answered a request that was never made.
    #[error("the agent sent {kind} for request {id}, which was never made")]
    UnknownRequest {
        /// The message's variant.
        kind: &'static str,
        /// The id it named.
        id: RequestId,
    },
    /// The agent broke the protocol for one request (or, for `Hello`, the connection).
    #[error("protocol violation by the agent: {what}")]
    Violation {
        /// What it did.
        what: String,
    },
    /// The agent refused a request (or the connection) with [`GuestMessage::Error`].
    #[error("the agent refused: {message}")]
    Refused {
        /// The agent's message.
        message: String,
    },
    /// The exec could not start (`ENOENT`: no such program).
    #[error("exec failed (errno {errno}): {message}")]
    ExecFailed {
        /// The guest's OS error number.
        errno: i32,
        /// The agent's message.
        message: String,
    },
    /// A file operation failed in the guest.
    #[error("file operation failed (errno {errno}): {message}")]
    File {
        /// The guest's OS error number.
        errno: i32,
        /// The agent's message.
        message: String,
    },
}

impl From<FrameError> for ClientError {
    fn from(err: FrameError) -> Self {
        ClientError::Frame(err)
    }
}

fn violation(what: impl Into<String>) -> ClientError {
    ClientError::Violation { what: what.into() }
}

/// Client settings.
#[derive(Debug, Clone, Copy)]
pub struct ClientConfig {
    /// How long the handshake and each answer to a non-exec request (start of an exec, file chunk, snapshot
    /// step) may take; `None` waits forever. An exec's output and exit are waited for with
    /// [`ExecHandle::next_event`]'s own timeout.
    pub timeout: Option<Duration>,
}

impl Default for ClientConfig {
    fn default() -> Self {
        ClientConfig { timeout: Some(Duration::from_secs(30)) }
    }
}

/// What the agent said about itself in the handshake.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentInfo {
    /// The protocol version (equal to [`PROTOCOL_VERSION`]).
    pub version: u32,
    /// The agent's crate version.
    pub agent_version: String,
    /// The guest kernel's release.
    pub kernel: String,
}

/// How an exec ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExitReport {
    /// Exit code or signal.
    pub status: ExitStatus,
    /// CPU time and peak memory.
    pub rusage: Rusage,
    /// The guest's OOM killer ended it: the memory limit.
    pub oom_killed: bool,
    /// Bytes it wrote to standard output, forwarded or not.
    pub stdout_bytes: u64,
    /// Bytes it wrote to standard error, forwarded or not.
    pub stderr_bytes: u64,
}

/// One step of a running exec.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExecEvent {
    /// A chunk of output.
    Output {
        /// Which stream.
        stream: OutputStream,
        /// The bytes.
        data: Vec<u8>,
    },
    /// It ended; no more events follow.
    Exited(ExitReport),
}

type Shutdown = Box<dyn Fn() + Send + Sync>;

/// Where a watch's events go ([`AgentClient::watch`]): each batch, and whether events were lost before it;
/// `false` ends the watch on the host's side.
type WatchSink = Arc<Mutex<Box<dyn FnMut(Vec<WatchEvent>, bool) -> bool + Send>>>;

struct Shared {
    writer: Mutex<FrameWriter<Box<dyn Write + Send>>>,
    shutdown: Shutdown,
    routes: Mutex<Routes>,
    next_id: AtomicU64,
    timeout: Option<Duration>,
}

struct Routes {
    open: HashMap<RequestId, SyncSender<GuestMessage>>,
    /// The running watches' sinks.
    watches: HashMap<RequestId, WatchSink>,
    /// Why the connection ended, once it has.
    failure: Option<ClientError>,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Shared {
    fn send(&self, message: &HostMessage) -> Result<(), ClientError> {
        let result = lock(&self.writer).write(message);
        result.map_err(|err| match err {
            // A write fails when the connection is gone; the reader knows why.
            FrameError::Io(_) => lock(&self.routes).failure.clone().unwrap_or(ClientError::Frame(err)),
            other => ClientError::Frame(other),
        })
    }

    fn open_route(self: &Arc<Self>) -> Result<Route, ClientError> {
        let (tx, rx) = mpsc::sync_channel(ROUTE_QUEUE);
        let mut routes = lock(&self.routes);
        if let Some(failure) = &routes.failure {
            return Err(failure.clone());
        }
        let id = RequestId(self.next_id.fetch_add(1, Ordering::Relaxed));
        routes.open.insert(id, tx);
        Ok(Route { id, rx, shared: Arc::clone(self) })
    }

    fn failure(&self) -> ClientError {
        lock(&self.routes).failure.clone().unwrap_or(ClientError::Disconnected)
    }

    /// Ends the connection for every request: records why, drops every route's sender.
    fn fail(&self, err: ClientError) {
        let mut routes = lock(&self.routes);
        routes.failure.get_or_insert(err);
        routes.open.clear();
        routes.watches.clear();
    }

    /// Hands one message to the request it answers.
    fn dispatch(&self, message: GuestMessage) -> Result<(), ClientError> {
        let Some(id) = message.request_id() else {
            return Err(match message {
                GuestMessage::Error { message, .. } => ClientError::Refused { message },
                other => violation(format!("{} after the handshake", other.kind())),
            });
        };
        if id.0 >= self.next_id.load(Ordering::Relaxed) {
            return Err(ClientError::UnknownRequest { kind: message.kind(), id });
        }
        if matches!(message, GuestMessage::WatchEvents { .. } | GuestMessage::WatchEnded { .. }) {
            self.watch_message(id, message);
            return Ok(());
        }
        // Clone the sender and let go of the table: sending may wait for the consumer, which may itself be
        // removing its route.
        let route = lock(&self.routes).open.get(&id).cloned();
        if let Some(route) = route {
            // The consumer may have gone in the meantime; then the message is dropped like a late one.
            let _ = route.send(message);
        }
        // No route: an answer to a request the host gave up on (a dropped handle); drop it.
        Ok(())
    }
}

impl Shared {
    /// Hands a watch's message to its sink (outside the routes' lock); a watch that ended is forgotten. Messages
    /// for a watch that is not running (stopped by the host, or never one) are dropped like late answers.
    fn watch_message(&self, id: RequestId, message: GuestMessage) {
        let Some(sink) = lock(&self.routes).watches.get(&id).cloned() else { return };
        let go_on = match message {
            GuestMessage::WatchEvents { events, overflowed, .. } if events.len() <= MAX_WATCH_BATCH => {
                (lock(&sink))(events, overflowed)
            }
            // Too many events in one batch, or the agent ended the watch.
            _ => false,
        };
        if !go_on {
            lock(&self.routes).watches.remove(&id);
        }
    }
}

/// The receiving end of one request; unregisters itself when dropped.
struct Route {
    id: RequestId,
    rx: Receiver<GuestMessage>,
    shared: Arc<Shared>,
}

impl Route {
    fn recv(&self, timeout: Option<Duration>) -> Result<GuestMessage, ClientError> {
        match timeout {
            None => self.rx.recv().map_err(|_| self.shared.failure()),
            Some(timeout) => self.rx.recv_timeout(timeout).map_err(|err| match err {
                RecvTimeoutError::Timeout => ClientError::Timeout(timeout),
                RecvTimeoutError::Disconnected => self.shared.failure(),
            }),
        }
    }

    /// A message that has already arrived, if any.
    fn try_recv(&self) -> Result<Option<GuestMessage>, ClientError> {
        match self.rx.try_recv() {
            Ok(message) => Ok(Some(message)),
            Err(TryRecvError::Empty) => Ok(None),
            Err(TryRecvError::Disconnected) => Err(self.shared.failure()),
        }
    }
}

impl Drop for Route {
    fn drop(&mut self) {
        lock(&self.shared.routes).open.remove(&self.id);
    }
}

/// A connection to a guest agent.
pub struct AgentClient {
    shared: Arc<Shared>,
    reader: Option<JoinHandle<()>>,
    info: AgentInfo,
}

impl std::fmt::Debug for AgentClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentClient").field("info", &self.info).finish_non_exhaustive()
    }
}

fn io_error(err: io::Error) -> ClientError {
    ClientError::Frame(FrameError::Io(err))
}

impl AgentClient {
    /// Shakes hands over `transport` and starts the reader thread.
    pub fn connect<T: Transport>(transport: T, config: ClientConfig) -> Result<AgentClient, ClientError> {
        let shutdown_handle = Mutex::new(transport.try_clone().map_err(io_error)?);
        let shutdown: Shutdown = Box::new(move || {
            let _ = lock(&shutdown_handle).shutdown();
        });
        let writer: Box<dyn Write + Send> = Box::new(transport.try_clone().map_err(io_error)?);
        let mut writer = FrameWriter::new(writer);
        transport.set_read_timeout(config.timeout).map_err(io_error)?;
        let mut reader = FrameReader::new(transport);
        let info = handshake(&mut writer, &mut reader).map_err(|err| {
            shutdown();
            match (err, config.timeout) {
                (ClientError::Frame(FrameError::Io(io)), Some(timeout))
                    if matches!(io.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) =>
                {
                    ClientError::Timeout(timeout)
                }
                (ClientError::Frame(FrameError::Io(io)), _)
                    if matches!(io.kind(), io::ErrorKind::BrokenPipe | io::ErrorKind::ConnectionReset) =>
                {
                    ClientError::Disconnected
                }
                (err, _) => err,
            }
        })?;
        reader.get_ref().set_read_timeout(None).map_err(io_error)?;
        let shared = Arc::new(Shared {
            writer: Mutex::new(writer),
            shutdown,
            routes: Mutex::new(Routes { open: HashMap::new(), watches: HashMap::new(), failure: None }),
            next_id: AtomicU64::new(1),
            timeout: config.timeout,
        });
        let for_reader = Arc::clone(&shared);
        let reader = std::thread::Builder::new()
            .name("agent-client".into())
            .spawn(move || read_loop(reader, &for_reader))
            .map_err(io_error)?;
        Ok(AgentClient { shared, reader: Some(reader), info })
    }

    /// What the agent said about itself.
    pub fn info(&self) -> &AgentInfo {
        &self.info
    }

    /// Starts an exec; returns once the agent reports it running.
    pub fn start(&self, request: &ExecRequest) -> Result<ExecHandle, ClientError> {
        let route = self.shared.open_route()?;
        self.shared.send(&HostMessage::Exec { id: route.id, request: request.clone() })?;
        match route.recv(self.shared.timeout)? {
            GuestMessage::Started { pid, .. } => {
                Ok(ExecHandle { route, pid, output_cap: request.limits.output, forwarded: [0, 0], exited: false })
            }
            GuestMessage::ExecFailed { errno, message, .. } => Err(ClientError::ExecFailed { errno, message }),
            GuestMessage::Error { message, .. } => Err(ClientError::Refused { message }),
            other => Err(violation(format!("{} before Started", other.kind()))),
        }
    }

    /// Runs an exec to its end: feeds it `stdin` (when [`ExecRequest::stdin`] is set) and hands each output
    /// chunk to `on_output` as it arrives.
    pub fn exec(
        &self,
        request: &ExecRequest,
        stdin: &[u8],
        on_output: impl FnMut(OutputStream, &[u8]),
    ) -> Result<ExitReport, ClientError> {
        let handle = self.start(request)?;
        if !request.stdin {
            return handle.wait(on_output);
        }
        let control = handle.control();
        std::thread::scope(|scope| {
            scope.spawn(move || {
                // A failure here (the exec closed its stdin, the connection died) shows in `wait`.
                let _ = control.write_stdin(stdin).and_then(|()| control.close_stdin());
            });
            handle.wait(on_output)
        })
    }

    /// Signals a running exec's process group by id (see [`ExecHandle::control`] for a handle).
    pub fn signal(&self, id: RequestId, signal: i32) -> Result<(), ClientError> {
        self.shared.send(&HostMessage::Signal { id, signal })
    }

    /// Writes a file in the guest (atomically: it appears complete or not at all).
    pub fn write_file(&self, path: &str, mode: u32, data: &[u8]) -> Result<(), ClientError> {
        let mut upload = self.upload(path, mode)?;
        upload.write(data)?;
        upload.finish()
    }

    /// Starts writing a file in the guest whose contents are handed over piece by piece ([`FileUpload::write`])
    /// and which appears, complete, at [`FileUpload::finish`].
    pub fn upload(&self, path: &str, mode: u32) -> Result<FileUpload<'_>, ClientError> {
        let route = self.shared.open_route()?;
        Ok(FileUpload { client: self, route, path: path.to_owned(), mode, pending: Vec::new(), failed: None })
    }

    /// Reads a regular file from the guest; a file larger than `max` bytes is an error (`EFBIG`).
    pub fn read_file(&self, path: &str, max: u64) -> Result<Vec<u8>, ClientError> {
        let mut data = Vec::new();
        self.read_file_to(path, max, |chunk| data.extend_from_slice(chunk))?;
        Ok(data)
    }

    /// Reads a regular file from the guest, handing each chunk to `sink` as it arrives; returns its size. A file
    /// larger than `max` bytes is an error (`EFBIG` from the agent, or a violation when the agent sends more than
    /// `max` bytes anyway: `sink` never gets more than `max` bytes in all).
    pub fn read_file_to(&self, path: &str, max: u64, mut sink: impl FnMut(&[u8])) -> Result<u64, ClientError> {
        let route = self.shared.open_route()?;
        self.shared.send(&HostMessage::ReadFile { id: route.id, path: path.to_owned(), max })?;
        let mut total = 0u64;
        loop {
            match route.recv(self.shared.timeout)? {
                GuestMessage::FileData { data: chunk, .. } => {
                    if chunk.len() > MAX_CHUNK {
                        return Err(violation(format!("a file chunk of {} bytes", chunk.len())));
                    }
                    if total.saturating_add(chunk.len() as u64) > max {
                        return Err(violation(format!("more than the {max} bytes asked for of {path}")));
                    }
                    total += chunk.len() as u64;
                    sink(&chunk);
                }
                GuestMessage::FileDone { size, .. } if size == total => return Ok(total),
                GuestMessage::FileDone { size, .. } => {
                    return Err(violation(format!("FileDone says {size} bytes after {total} bytes")));
                }
                GuestMessage::FileError { errno, message, .. } => return Err(ClientError::File { errno, message }),
                GuestMessage::Error { message, .. } => return Err(ClientError::Refused { message }),
                other => return Err(violation(format!("{} in answer to ReadFile", other.kind()))),
            }
        }
    }

    /// Creates a directory in the guest (or finds one there) and sets its permission bits; with `empty`, a
    /// directory that already has entries is refused (`ENOTEMPTY`). See [`HostMessage::MakeDir`].
    pub fn make_dir(&self, path: &str, mode: u32, empty: bool) -> Result<(), ClientError> {
        self.file_request(|id| HostMessage::MakeDir { id, path: path.to_owned(), mode, empty })
    }

    /// Creates a symbolic link at `path` pointing to `target`. See [`HostMessage::MakeSymlink`].
    pub fn make_symlink(&self, path: &str, target: &str) -> Result<(), ClientError> {
        self.file_request(|id| HostMessage::MakeSymlink { id, path: path.to_owned(), target: target.to_owned() })
    }

    /// Lists the tree under the guest directory `path` without following symbolic links; more than
    /// `max_entries` entries is an error (`E2BIG` from the agent, or a violation when the agent sends them
    /// anyway). Only the counts are checked here (batch sizes, the total, `TreeDone`'s count): the entries
    /// themselves are the guest's word, for the caller to validate.
    pub fn list_tree(&self, path: &str, max_entries: u64) -> Result<TreeListing, ClientError> {
        let request = HostMessage::ListTree { id: RequestId(0), path: path.to_owned(), max_entries };
        let (entries, skipped) = self.gather(request, path, max_entries, |message| match message {
            GuestMessage::TreeEntries { entries, .. } => Part::Batch(entries),
            GuestMessage::TreeDone { count, skipped, .. } => Part::Done { count, skipped },
            other => Part::Other(other),
        })?;
        Ok(TreeListing { entries, skipped })
    }

    /// Lists the guest directory `path` down to `depth` levels without following symbolic links; more than
    /// `max_entries` entries is an error (`E2BIG` from the agent, or a violation when the agent sends them
    /// anyway). As for [`AgentClient::list_tree`], only the counts are checked here.
    pub fn list_dir(&self, path: &str, depth: u32, max_entries: u64) -> Result<DirListing, ClientError> {
        let request = HostMessage::ListDir { id: RequestId(0), path: path.to_owned(), depth, max_entries };
        let (entries, skipped) = self.gather(request, path, max_entries, |message| match message {
            GuestMessage::DirEntries { entries, .. } => Part::Batch(entries),
            GuestMessage::DirDone { count, skipped, .. } => Part::Done { count, skipped },
            other => Part::Other(other),
        })?;
        Ok(DirListing { entries, skipped })
    }

    /// Sends `request` (its id replaced by a new route's) and gathers the batches of its answer: at most
    /// [`MAX_TREE_BATCH`] entries a batch, `max_entries` in all, then a count that matches what came.
    fn gather<E>(
        &self,
        mut request: HostMessage,
        path: &str,
        max_entries: u64,
        part: fn(GuestMessage) -> Part<E>,
    ) -> Result<(Vec<E>, u64), ClientError> {
        let route = self.shared.open_route()?;
        let kind = request.kind();
        if let HostMessage::ListTree { id, .. } | HostMessage::ListDir { id, .. } = &mut request {
            *id = route.id;
        }
        self.shared.send(&request)?;
        let mut entries = Vec::new();
        loop {
            match part(route.recv(self.shared.timeout)?) {
                Part::Batch(batch) => {
                    if batch.len() > MAX_TREE_BATCH {
                        return Err(violation(format!("a listing batch of {} entries", batch.len())));
                    }
                    if (entries.len() as u64).saturating_add(batch.len() as u64) > max_entries {
                        return Err(violation(format!("more than the {max_entries} entries asked for of {path}")));
                    }
                    entries.extend(batch);
                }
                Part::Done { count, skipped } if count == entries.len() as u64 => return Ok((entries, skipped)),
                Part::Done { count, .. } => {
                    return Err(violation(format!("{kind} done after {} entries, says {count}", entries.len())));
                }
                Part::Other(other) => return Err(refusal(other, kind)),
            }
        }
    }

    /// Describes the guest file at `path` without following a link there. The entry is the guest's word.
    pub fn stat(&self, path: &str) -> Result<EntryInfo, ClientError> {
        self.entry_request(|id| HostMessage::Stat { id, path: path.to_owned() })
    }

    /// Moves the guest file `from` to `to`; describes it at `to`. The entry is the guest's word.
    pub fn rename(&self, from: &str, to: &str) -> Result<EntryInfo, ClientError> {
        self.entry_request(|id| HostMessage::Rename { id, from: from.to_owned(), to: to.to_owned() })
    }

    /// Makes the guest directory `path` and its missing parents; `false` when a directory was already there.
    pub fn create_dir(&self, path: &str) -> Result<bool, ClientError> {
        let route = self.shared.open_route()?;
        self.shared.send(&HostMessage::CreateDir { id: route.id, path: path.to_owned() })?;
        match route.recv(self.shared.timeout)? {
            GuestMessage::DirCreated { created, .. } => Ok(created),
            other => Err(refusal(other, "CreateDir")),
        }
    }

    /// Removes the guest file or link at `path`, or the directory and everything in it.
    pub fn remove(&self, path: &str) -> Result<(), ClientError> {
        self.file_request(|id| HostMessage::Remove { id, path: path.to_owned() })
    }

    /// Watches the guest directory `path` (and those below it, when `recursive`). Once the agent has set the
    /// watch up, each batch of events goes to `sink` on the connection's reader thread, with whether events were
    /// lost before it: `sink` must not block, and returns `false` to stop receiving. The watch ends on the
    /// guest when the returned [`AgentWatch`] is dropped; `sink` is dropped when the watch ends on either side
    /// or the connection does.
    pub fn watch(
        &self,
        path: &str,
        recursive: bool,
        sink: impl FnMut(Vec<WatchEvent>, bool) -> bool + Send + 'static,
    ) -> Result<AgentWatch, ClientError> {
        let route = self.shared.open_route()?;
        let sink: WatchSink = Arc::new(Mutex::new(Box::new(sink)));
        // Registered before the request goes out: the first events may follow the answer at once.
        lock(&self.shared.routes).watches.insert(route.id, sink);
        let watch = AgentWatch { id: route.id, shared: Arc::clone(&self.shared) };
        self.shared.send(&HostMessage::Watch { id: route.id, path: path.to_owned(), recursive })?;
        file_answer(route.recv(self.shared.timeout)?, "Watch")?;
        Ok(watch)
    }

    /// A request answered by `Entry` or `FileError`.
    fn entry_request(&self, message: impl FnOnce(RequestId) -> HostMessage) -> Result<EntryInfo, ClientError> {
        let route = self.shared.open_route()?;
        let message = message(route.id);
        let kind = message.kind();
        self.shared.send(&message)?;
        match route.recv(self.shared.timeout)? {
            GuestMessage::Entry { entry, .. } => Ok(entry),
            other => Err(refusal(other, kind)),
        }
    }

    /// A request answered by `Ack` or `FileError`.
    fn file_request(&self, message: impl FnOnce(RequestId) -> HostMessage) -> Result<(), ClientError> {
        let route = self.shared.open_route()?;
        let message = message(route.id);
        let kind = message.kind();
        self.shared.send(&message)?;
        file_answer(route.recv(self.shared.timeout)?, kind)
    }

    /// Asks the agent to quiesce before a snapshot.
    pub fn prepare_snapshot(&self) -> Result<(), ClientError> {
        self.ack_request(|id| HostMessage::PrepareSnapshot { id })
    }

    /// Tells a restored guest to reseed its randomness and set its clock.
    pub fn after_restore(&self, entropy: [u8; Entropy::LEN], unix_time_ns: u64) -> Result<(), ClientError> {
        self.ack_request(|id| HostMessage::AfterRestore { id, entropy: Entropy(entropy), unix_time_ns })
    }

    /// Asks the agent to start its egress forwarder ([`HostMessage::StartEgress`]) for this connection.
    pub fn start_egress(&self, listen_port: u16, host_port: u32, max_connections: u32) -> Result<(), ClientError> {
        self.ack_request(|id| HostMessage::StartEgress { id, listen_port, host_port, max_connections })
    }

    /// Asks the agent to connect to the guest's `127.0.0.1:port` and relay it to a stream it opens to the host's vsock
    /// `host_port` (where the caller listens). `Refused` with a message starting [`crate::PORT_CLOSED`] when nothing
    /// listens there.
    pub fn open_port(&self, port: u16, host_port: u32) -> Result<(), ClientError> {
        self.ack_request(|id| HostMessage::OpenPort { id, port, host_port })
    }

    fn ack_request(&self, message: impl FnOnce(RequestId) -> HostMessage) -> Result<(), ClientError> {
        let route = self.shared.open_route()?;
        self.shared.send(&message(route.id))?;
        match route.recv(self.shared.timeout)? {
            GuestMessage::Ack { .. } => Ok(()),
            GuestMessage::Error { message, .. } => Err(ClientError::Refused { message }),
            other => Err(violation(format!("{} instead of Ack", other.kind()))),
        }
    }

    /// Asks the agent to flush and power the guest off, and closes the connection.
    pub fn power_off(self) -> Result<(), ClientError> {
        self.shared.send(&HostMessage::PowerOff)
    }

    /// Whether the connection has ended, and why.
    pub fn failure(&self) -> Option<ClientError> {
        lock(&self.shared.routes).failure.clone()
    }
}

impl Drop for AgentClient {
    fn drop(&mut self) {
        (self.shared.shutdown)();
        if let Some(reader) = self.reader.take() {
            let _ = reader.join();
        }
    }
}

fn handshake<W: Write, T: Transport>(
    writer: &mut FrameWriter<W>,
    reader: &mut FrameReader<T>,
) -> Result<AgentInfo, ClientError> {
    writer.write(&HostMessage::Hello { version: PROTOCOL_VERSION })?;
    let body = reader.read_body()?.ok_or(ClientError::Disconnected)?;
    if let Some(agent) = peek_hello_version(body).filter(|&v| v != PROTOCOL_VERSION) {
        return Err(ClientError::VersionMismatch { host: PROTOCOL_VERSION, agent });
    }
    match decode::<GuestMessage>(body)? {
        GuestMessage::Hello { version, agent_version, kernel } => Ok(AgentInfo { version, agent_version, kernel }),
        GuestMessage::Error { message, .. } => Err(ClientError::Refused { message }),
        other => Err(violation(format!("{} instead of Hello", other.kind()))),
    }
}

fn read_loop<T: Transport>(mut reader: FrameReader<T>, shared: &Shared) {
    let failure = loop {
        match reader.read::<GuestMessage>() {
            Ok(Some(message)) => {
                if let Err(err) = shared.dispatch(message) {
                    break err;
                }
            }
            Ok(None) => break ClientError::Disconnected,
            Err(err) => break ClientError::Frame(err),
        }
    };
    shared.fail(failure);
    // A broken stream cannot be resynchronised: end it for the agent too.
    (shared.shutdown)();
}

/// Controls a running exec from any thread.
#[derive(Clone)]
pub struct ExecControl {
    id: RequestId,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for ExecControl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExecControl").field("id", &self.id).finish_non_exhaustive()
    }
}

impl ExecControl {
    /// The exec's id.
    pub fn id(&self) -> RequestId {
        self.id
    }

    /// Sends bytes to the exec's standard input (in chunks of at most [`MAX_CHUNK`]).
    pub fn write_stdin(&self, data: &[u8]) -> Result<(), ClientError> {
        for chunk in data.chunks(MAX_CHUNK) {
            self.shared.send(&HostMessage::StdinData { id: self.id, data: chunk.into() })?;
        }
        Ok(())
    }

    /// Closes the exec's standard input.
    pub fn close_stdin(&self) -> Result<(), ClientError> {
        self.shared.send(&HostMessage::StdinClose { id: self.id })
    }

    /// Sends `signal` to the exec's process group.
    pub fn signal(&self, signal: i32) -> Result<(), ClientError> {
        self.shared.send(&HostMessage::Signal { id: self.id, signal })
    }

    /// Resizes the exec's terminal (one started with [`ExecRequest::tty`]).
    pub fn resize(&self, size: TtySize) -> Result<(), ClientError> {
        self.shared.send(&HostMessage::Resize { id: self.id, size })
    }
}

/// A running exec. Dropping it leaves the exec running (signal it first to stop it); what the agent still
/// sends about it is discarded.
pub struct ExecHandle {
    route: Route,
    pid: i32,
    output_cap: Option<u64>,
    forwarded: [u64; 2],
    exited: bool,
}

impl std::fmt::Debug for ExecHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExecHandle").field("id", &self.route.id).field("pid", &self.pid).finish_non_exhaustive()
    }
}

impl ExecHandle {
    /// The exec's id.
    pub fn id(&self) -> RequestId {
        self.route.id
    }

    /// Its PID in the guest.
    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// A handle for stdin and signals, usable from other threads while this one waits.
    pub fn control(&self) -> ExecControl {
        ExecControl { id: self.route.id, shared: Arc::clone(&self.route.shared) }
    }

    /// The next output chunk or the exit; [`ClientError::Timeout`] when nothing arrives within `timeout`.
    pub fn next_event(&mut self, timeout: Option<Duration>) -> Result<ExecEvent, ClientError> {
        if self.exited {
            return Err(violation("the exec has already exited"));
        }
        match self.route.recv(timeout)? {
            GuestMessage::Output { stream, data, .. } => {
                let index = usize::from(stream == OutputStream::Stderr);
                if data.len() > MAX_CHUNK {
                    return Err(violation(format!("an output chunk of {} bytes", data.len())));
                }
                let total = self.forwarded[index].saturating_add(data.len() as u64);
                if self.output_cap.is_some_and(|cap| total > cap) {
                    return Err(violation(format!("{stream:?} beyond the {total}-byte cap")));
                }
                self.forwarded[index] = total;
                Ok(ExecEvent::Output { stream, data: data.0 })
            }
            GuestMessage::Exited { status, rusage, oom_killed, stdout_bytes, stderr_bytes, .. } => {
                if !status.is_valid() {
                    return Err(violation(format!("exit status {status:?}")));
                }
                if stdout_bytes < self.forwarded[0] || stderr_bytes < self.forwarded[1] {
                    return Err(violation("output totals below the bytes forwarded"));
                }
                self.exited = true;
                Ok(ExecEvent::Exited(ExitReport { status, rusage, oom_killed, stdout_bytes, stderr_bytes }))
            }
            GuestMessage::Error { message, .. } => Err(ClientError::Refused { message }),
            other => Err(violation(format!("{} during an exec", other.kind()))),
        }
    }

    /// Waits for the exit, handing each output chunk to `on_output`.
    pub fn wait(mut self, mut on_output: impl FnMut(OutputStream, &[u8])) -> Result<ExitReport, ClientError> {
        loop {
            match self.next_event(None)? {
                ExecEvent::Output { stream, data } => on_output(stream, &data),
                ExecEvent::Exited(report) => return Ok(report),
            }
        }
    }
}

// A chunk and its message's other fields fit in a frame.
const _: () = assert!(MAX_CHUNK + 4096 <= MAX_FRAME);

fn file_answer(answer: GuestMessage, request: &str) -> Result<(), ClientError> {
    match answer {
        GuestMessage::Ack { .. } => Ok(()),
        other => Err(refusal(other, request)),
    }
}

/// An answer to `request` that is not the one hoped for: the agent's refusal, or a violation.
fn refusal(answer: GuestMessage, request: &str) -> ClientError {
    match answer {
        GuestMessage::FileError { errno, message, .. } => ClientError::File { errno, message },
        GuestMessage::Error { message, .. } => ClientError::Refused { message },
        other => violation(format!("{} in answer to {request}", other.kind())),
    }
}

/// One message of a listing's answer, sorted.
enum Part<E> {
    Batch(Vec<E>),
    Done { count: u64, skipped: u64 },
    Other(GuestMessage),
}

/// A guest directory listing ([`AgentClient::list_dir`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DirListing {
    /// The entries, as the agent sent them.
    pub entries: Vec<EntryInfo>,
    /// Entries the agent left out (paths that are not UTF-8 or too long).
    pub skipped: u64,
}

/// A running watch of a guest directory ([`AgentClient::watch`]). Dropping it ends the watch: its sink is
/// forgotten and the agent is told to stop.
pub struct AgentWatch {
    id: RequestId,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for AgentWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentWatch").field("id", &self.id).finish_non_exhaustive()
    }
}

impl AgentWatch {
    /// The watch's id.
    pub fn id(&self) -> RequestId {
        self.id
    }

    /// Whether the watch still runs (neither side ended it, nor the connection).
    pub fn is_running(&self) -> bool {
        lock(&self.shared.routes).watches.contains_key(&self.id)
    }
}

impl Drop for AgentWatch {
    fn drop(&mut self) {
        let sink = lock(&self.shared.routes).watches.remove(&self.id);
        // Dropped outside the lock: the sink is the caller's and may do anything when dropped.
        drop(sink);
        // A connection that has ended has no watch to stop.
        let _ = self.shared.send(&HostMessage::Unwatch { id: self.id });
    }
}

/// A guest tree listing ([`AgentClient::list_tree`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TreeListing {
    /// The entries, as the agent sent them.
    pub entries: Vec<TreeEntry>,
    /// Entries the agent left out (names that are not UTF-8, devices, FIFOs, sockets).
    pub skipped: u64,
}

/// A file being written in the guest ([`AgentClient::upload`]): the bytes go out in chunks of [`MAX_CHUNK`] as
/// they are handed over, and the file appears complete at [`FileUpload::finish`]. Dropped unfinished, the file
/// never appears (the agent removes its temporary file when the connection ends).
pub struct FileUpload<'a> {
    client: &'a AgentClient,
    route: Route,
    path: String,
    mode: u32,
    /// Bytes not sent yet: at most one chunk, kept back so that the last chunk sent is the one marked `last`.
    pending: Vec<u8>,
    /// The agent refused an earlier chunk (the transfer is over for it).
    failed: Option<ClientError>,
}

impl std::fmt::Debug for FileUpload<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FileUpload").field("id", &self.route.id).field("path", &self.path).finish_non_exhaustive()
    }
}

impl FileUpload<'_> {
    /// Hands over the next bytes of the file. Once the agent has refused the transfer (it answers a failed chunk
    /// at once), this and [`FileUpload::finish`] return its error.
    pub fn write(&mut self, mut data: &[u8]) -> Result<(), ClientError> {
        while !data.is_empty() {
            if let Some(err) = &self.failed {
                return Err(err.clone());
            }
            if self.pending.len() == MAX_CHUNK {
                self.send_pending(false)?;
                if let Some(answer) = self.route.try_recv()? {
                    let err = match answer {
                        GuestMessage::Ack { .. } => violation("Ack before the last chunk of WriteFile"),
                        other => file_answer(other, "WriteFile").err().unwrap_or(ClientError::Disconnected),
                    };
                    // The agent drops the id's remaining chunks; a last, empty one lets it forget the id.
                    self.send_pending(true)?;
                    self.failed = Some(err.clone());
                    return Err(err);
                }
            }
            let take = data.len().min(MAX_CHUNK - self.pending.len());
            self.pending.extend_from_slice(&data[..take]);
            data = &data[take..];
        }
        Ok(())
    }

    /// Sends the last chunk and waits for the agent to put the file in place.
    pub fn finish(mut self) -> Result<(), ClientError> {
        if let Some(err) = self.failed.take() {
            return Err(err);
        }
        self.send_pending(true)?;
        file_answer(self.route.recv(self.client.shared.timeout)?, "WriteFile")
    }

    fn send_pending(&mut self, last: bool) -> Result<(), ClientError> {
        let data = Bytes(std::mem::take(&mut self.pending));
        let message =
            HostMessage::WriteFile { id: self.route.id, path: self.path.clone(), mode: self.mode, data, last };
        self.client.shared.send(&message)
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::net::UnixStream;
    use std::thread;

    use super::*;
    use crate::message::{ExecLimits, ExecRequest};

    type Reader = FrameReader<UnixStream>;
    type Writer = FrameWriter<UnixStream>;

    /// Connects a client to a fake agent running `script` on the other end of a socket pair.
    fn fake_agent(
        config: ClientConfig,
        script: impl FnOnce(&mut Reader, &mut Writer) + Send + 'static,
    ) -> (Result<AgentClient, ClientError>, thread::JoinHandle<()>) {
        let (host, guest) = UnixStream::pair().expect("pair");
        let agent = thread::spawn(move || {
            let mut writer = FrameWriter::new(guest.try_clone().expect("clone"));
            let mut reader = FrameReader::new(guest);
            script(&mut reader, &mut writer);
        });
        (AgentClient::connect(host, config), agent)
    }

    fn hello(reader: &mut Reader, writer: &mut Writer) {
        let message: HostMessage = reader.read().expect("read").expect("hello");
        assert_eq!(message, HostMessage::Hello { version: PROTOCOL_VERSION });
        let hello =
            GuestMessage::Hello { version: PROTOCOL_VERSION, agent_version: "fake".into(), kernel: "none".into() };
        writer.write(&hello).expect("write");
    }

    /// Reads the client's next request and returns its id.
    fn next_id(reader: &mut Reader) -> RequestId {
        match reader.read::<HostMessage>().expect("read").expect("message") {
            HostMessage::Exec { id, .. }
            | HostMessage::ReadFile { id, .. }
            | HostMessage::WriteFile { id, .. }
            | HostMessage::PrepareSnapshot { id }
            | HostMessage::AfterRestore { id, .. }
            | HostMessage::MakeDir { id, .. }
            | HostMessage::MakeSymlink { id, .. }
            | HostMessage::ListTree { id, .. }
            | HostMessage::StartEgress { id, .. }
            | HostMessage::Stat { id, .. }
            | HostMessage::ListDir { id, .. }
            | HostMessage::CreateDir { id, .. }
            | HostMessage::Rename { id, .. }
            | HostMessage::Remove { id, .. }
            | HostMessage::Watch { id, .. } => id,
            other => panic!("unexpected {other:?}"),
        }
    }

    fn sleep_request(output: Option<u64>) -> ExecRequest {
        ExecRequest {
            argv: vec!["sleep".into()],
            limits: ExecLimits { output, ..ExecLimits::default() },
            ..ExecRequest::default()
        }
    }

    /// Waits until the fake agent's socket end is closed by the client.
    fn until_closed(reader: &mut Reader) {
        while let Ok(Some(_)) = reader.read::<HostMessage>() {}
    }

    #[test]
    fn handshake_reports_the_agent() {
        let (client, agent) = fake_agent(ClientConfig::default(), |r, w| {
            hello(r, w);
            until_closed(r);
        });
        let client = client.expect("connect");
        assert_eq!(client.info().agent_version, "fake");
        drop(client);
        agent.join().expect("agent");
    }

    #[test]
    fn a_version_mismatch_is_typed_even_when_hello_changed_shape() {
        let (client, agent) = fake_agent(ClientConfig::default(), |r, w| {
            let _: Option<HostMessage> = r.read().expect("read");
            // A future agent's Hello: version 99, then fields this version does not know.
            let body = crate::frame::encode(&(0u32, 99u32, 1.5f64, vec![1u8, 2, 3])).expect("encode");
            w.write_body(&body).expect("write");
        });
        let err = client.expect_err("mismatch");
        assert!(matches!(err, ClientError::VersionMismatch { host: PROTOCOL_VERSION, agent: 99 }), "{err}");
        agent.join().expect("agent");
    }

    #[test]
    fn a_silent_agent_times_out_and_a_closed_one_disconnects() {
        let config = ClientConfig { timeout: Some(Duration::from_millis(100)) };
        let (client, agent) = fake_agent(config, |r, _| until_closed(r));
        assert!(matches!(client.expect_err("timeout"), ClientError::Timeout(_)));
        agent.join().expect("agent");

        let (client, agent) = fake_agent(ClientConfig::default(), |_, _| {});
        assert!(matches!(client.expect_err("closed"), ClientError::Disconnected));
        agent.join().expect("agent");
    }

    #[test]
    fn an_oversize_frame_fails_the_waiting_exec_without_allocating() {
        let (client, agent) = fake_agent(ClientConfig::default(), |r, w| {
            hello(r, w);
            let _ = next_id(r);
            w.get_ref().try_clone().expect("clone").write_all(&u32::MAX.to_le_bytes()).expect("write");
            until_closed(r);
        });
        let client = client.expect("connect");
        let err = client.start(&sleep_request(None)).expect_err("oversize");
        assert!(matches!(err, ClientError::Frame(FrameError::TooLarge { .. })), "{err}");
        // The connection is over for every later request too.
        assert!(matches!(client.read_file("/x", 10), Err(ClientError::Frame(FrameError::TooLarge { .. }))));
        drop(client);
        agent.join().expect("agent");
    }

    #[test]
    fn a_truncated_frame_is_typed() {
        let (client, agent) = fake_agent(ClientConfig::default(), |r, w| {
            hello(r, w);
            let _ = next_id(r);
            let mut raw = w.get_ref().try_clone().expect("clone");
            raw.write_all(&100u32.to_le_bytes()).expect("write");
            raw.write_all(&[1; 10]).expect("write");
            raw.shutdown(std::net::Shutdown::Write).expect("shutdown");
            until_closed(r);
        });
        let client = client.expect("connect");
        let err = client.read_file("/etc/hostname", 100).expect_err("truncated");
        assert!(matches!(err, ClientError::Frame(FrameError::Truncated { part: "body", got: 10, .. })), "{err}");
        drop(client);
        agent.join().expect("agent");
    }

    #[test]
    fn garbage_from_the_agent_is_malformed() {
        let (client, agent) = fake_agent(ClientConfig::default(), |r, w| {
            hello(r, w);
            let _ = next_id(r);
            w.write_body(&[0xfe, 0xff, 0x00, 0x13]).expect("write");
            until_closed(r);
        });
        let client = client.expect("connect");
        let err = client.prepare_snapshot().expect_err("garbage");
        assert!(matches!(err, ClientError::Frame(FrameError::Malformed { .. })), "{err}");
        drop(client);
        agent.join().expect("agent");
    }

    #[test]
    fn an_exit_for_a_request_never_made_ends_the_connection() {
        let (client, agent) = fake_agent(ClientConfig::default(), |r, w| {
            hello(r, w);
            let id = next_id(r);
            w.write(&GuestMessage::Started { id, pid: 7 }).expect("write");
            let exited = GuestMessage::Exited {
                id: RequestId(12345),
                status: ExitStatus::Code(0),
                rusage: Rusage::default(),
                oom_killed: false,
                stdout_bytes: 0,
                stderr_bytes: 0,
            };
            w.write(&exited).expect("write");
            until_closed(r);
        });
        let client = client.expect("connect");
        let mut handle = client.start(&sleep_request(None)).expect("start");
        let err = handle.next_event(Some(Duration::from_secs(5))).expect_err("unknown id");
        assert!(matches!(err, ClientError::UnknownRequest { kind: "Exited", id: RequestId(12345) }), "{err}");
        drop(handle);
        drop(client);
        agent.join().expect("agent");
    }

    #[test]
    fn an_answer_to_an_abandoned_request_is_dropped() {
        let (client, agent) = fake_agent(ClientConfig::default(), |r, w| {
            hello(r, w);
            let first = next_id(r);
            w.write(&GuestMessage::Started { id: first, pid: 7 }).expect("write");
            let second = next_id(r);
            // Output for the first exec, whose handle the host has dropped.
            let output =
                GuestMessage::Output { id: first, stream: OutputStream::Stdout, data: b"late".as_slice().into() };
            w.write(&output).expect("write");
            w.write(&GuestMessage::Ack { id: second }).expect("write");
            until_closed(r);
        });
        let client = client.expect("connect");
        drop(client.start(&sleep_request(None)).expect("start"));
        client.prepare_snapshot().expect("the connection survives a late answer");
        assert!(client.failure().is_none());
        drop(client);
        agent.join().expect("agent");
    }

    #[test]
    fn output_beyond_the_cap_or_the_chunk_size_and_bad_exits_are_violations() {
        type Event = fn(RequestId) -> GuestMessage;
        let cases: [(Option<u64>, Event); 4] = [
            (Some(4), |id| GuestMessage::Output { id, stream: OutputStream::Stderr, data: vec![0; 5].into() }),
            (None, |id| GuestMessage::Output { id, stream: OutputStream::Stdout, data: vec![0; MAX_CHUNK + 1].into() }),
            (None, |id| GuestMessage::Exited {
                id,
                status: ExitStatus::Signal(4096),
                rusage: Rusage::default(),
                oom_killed: false,
                stdout_bytes: 0,
                stderr_bytes: 0,
            }),
            (None, |id| GuestMessage::FileDone { id, size: 1 }),
        ];
        for (cap, event) in cases {
            let (client, agent) = fake_agent(ClientConfig::default(), move |r, w| {
                hello(r, w);
                let id = next_id(r);
                w.write(&GuestMessage::Started { id, pid: 7 }).expect("write");
                w.write(&event(id)).expect("write");
                until_closed(r);
            });
            let client = client.expect("connect");
            let mut handle = client.start(&sleep_request(cap)).expect("start");
            let err = handle.next_event(Some(Duration::from_secs(5))).expect_err("violation");
            assert!(matches!(err, ClientError::Violation { .. }), "{err}");
            drop(handle);
            drop(client);
            agent.join().expect("agent");
        }
    }

    #[test]
    fn a_file_longer_than_asked_is_refused() {
        let (client, agent) = fake_agent(ClientConfig::default(), |r, w| {
            hello(r, w);
            let id = next_id(r);
            for _ in 0..4 {
                if w.write(&GuestMessage::FileData { id, data: vec![1; 1000].into() }).is_err() {
                    break;
                }
            }
            until_closed(r);
        });
        let client = client.expect("connect");
        let err = client.read_file("/big", 2500).expect_err("too long");
        assert!(matches!(err, ClientError::Violation { .. }), "{err}");
        drop(client);
        agent.join().expect("agent");
    }

    fn entry(path: &str) -> TreeEntry {
        TreeEntry { path: path.into(), kind: crate::EntryKind::File, mode: 0o644, size: 1, target: None }
    }

    #[test]
    fn a_listing_is_gathered_from_its_batches() {
        let (client, agent) = fake_agent(ClientConfig::default(), |r, w| {
            hello(r, w);
            let id = next_id(r);
            w.write(&GuestMessage::TreeEntries { id, entries: vec![entry("a"), entry("b")] }).expect("write");
            w.write(&GuestMessage::TreeEntries { id, entries: vec![entry("c")] }).expect("write");
            w.write(&GuestMessage::TreeDone { id, count: 3, skipped: 2 }).expect("write");
            until_closed(r);
        });
        let client = client.expect("connect");
        let listing = client.list_tree("/data", 3).expect("list");
        let paths: Vec<&str> = listing.entries.iter().map(|e| e.path.as_str()).collect();
        assert_eq!((paths, listing.skipped), (vec!["a", "b", "c"], 2));
        drop(client);
        agent.join().expect("agent");
    }

    #[test]
    fn a_listing_beyond_its_bounds_is_a_violation() {
        type Script = fn(RequestId) -> Vec<GuestMessage>;
        let cases: [Script; 3] = [
            // More entries in one batch than a batch may hold.
            |id| vec![GuestMessage::TreeEntries { id, entries: vec![entry("x"); MAX_TREE_BATCH + 1] }],
            // More entries in all than asked for (max_entries is 4).
            |id| {
                vec![
                    GuestMessage::TreeEntries { id, entries: vec![entry("x"); 3] },
                    GuestMessage::TreeEntries { id, entries: vec![entry("y"); 2] },
                ]
            },
            // A count that is not what was sent.
            |id| {
                vec![
                    GuestMessage::TreeEntries { id, entries: vec![entry("x"); 2] },
                    GuestMessage::TreeDone { id, count: 1, skipped: 0 },
                ]
            },
        ];
        for script in cases {
            let (client, agent) = fake_agent(ClientConfig::default(), move |r, w| {
                hello(r, w);
                let id = next_id(r);
                for message in script(id) {
                    w.write(&message).expect("write");
                }
                until_closed(r);
            });
            let client = client.expect("connect");
            let err = client.list_tree("/data", 4).expect_err("out of bounds");
            assert!(matches!(err, ClientError::Violation { .. }), "{err}");
            drop(client);
            agent.join().expect("agent");
        }
    }

    fn info(path: &str) -> EntryInfo {
        EntryInfo {
            path: path.into(),
            file_type: crate::FileType::File,
            size: 1,
            mode: 0o644,
            uid: 0,
            gid: 0,
            modified: None,
            target: None,
        }
    }

    #[test]
    fn file_methods_get_their_answers_and_refuse_the_wrong_ones() {
        let (client, agent) = fake_agent(ClientConfig::default(), |r, w| {
            hello(r, w);
            let id = next_id(r);
            w.write(&GuestMessage::Entry { id, entry: info("/a") }).expect("write");
            let id = next_id(r);
            w.write(&GuestMessage::DirCreated { id, created: true }).expect("write");
            let id = next_id(r);
            w.write(&GuestMessage::DirEntries { id, entries: vec![info("/d/x"), info("/d/y")] }).expect("write");
            w.write(&GuestMessage::DirDone { id, count: 2, skipped: 1 }).expect("write");
            let id = next_id(r);
            w.write(&GuestMessage::FileError { id, errno: libc::ENOENT, message: "gone".into() }).expect("write");
            // An Ack where an entry belongs, and an entry where a DirCreated does.
            let id = next_id(r);
            w.write(&GuestMessage::Ack { id }).expect("write");
            let id = next_id(r);
            w.write(&GuestMessage::Entry { id, entry: info("/a") }).expect("write");
            until_closed(r);
        });
        let client = client.expect("connect");
        assert_eq!(client.stat("/a").expect("stat").path, "/a");
        assert!(client.create_dir("/d").expect("create"));
        let listing = client.list_dir("/d", 1, 10).expect("list");
        assert_eq!((listing.entries.len(), listing.skipped), (2, 1));
        assert!(matches!(client.remove("/gone"), Err(ClientError::File { errno: libc::ENOENT, .. })));
        assert!(matches!(client.rename("/a", "/b"), Err(ClientError::Violation { .. })));
        assert!(matches!(client.create_dir("/e"), Err(ClientError::Violation { .. })));
        drop(client);
        agent.join().expect("agent");
    }

    #[test]
    fn a_dir_listing_beyond_its_bounds_is_a_violation() {
        let (client, agent) = fake_agent(ClientConfig::default(), |r, w| {
            hello(r, w);
            let id = next_id(r);
            w.write(&GuestMessage::DirEntries { id, entries: vec![info("/d/x"); 3] }).expect("write");
            until_closed(r);
        });
        let client = client.expect("connect");
        assert!(matches!(client.list_dir("/d", 1, 2), Err(ClientError::Violation { .. })));
        drop(client);
        agent.join().expect("agent");
    }

    fn event(path: &str) -> WatchEvent {
        WatchEvent { kind: crate::WatchKind::Create, path: path.into() }
    }

    #[test]
    fn a_watch_hands_its_events_over_until_dropped_then_unwatches() {
        let (client, agent) = fake_agent(ClientConfig::default(), |r, w| {
            hello(r, w);
            let id = next_id(r);
            w.write(&GuestMessage::Ack { id }).expect("write");
            w.write(&GuestMessage::WatchEvents { id, events: vec![event("/d/a")], overflowed: false }).expect("write");
            w.write(&GuestMessage::WatchEvents { id, events: vec![event("/d/b")], overflowed: true }).expect("write");
            match r.read::<HostMessage>().expect("read") {
                Some(HostMessage::Unwatch { id: unwatched }) => assert_eq!(unwatched, id),
                other => panic!("expected Unwatch, got {other:?}"),
            }
            // Late events for the stopped watch are dropped; the connection goes on.
            w.write(&GuestMessage::WatchEvents { id, events: vec![event("/d/c")], overflowed: false }).expect("write");
            let id = next_id(r);
            w.write(&GuestMessage::Ack { id }).expect("write");
            until_closed(r);
        });
        let client = client.expect("connect");
        let (tx, rx) = mpsc::channel();
        let watch =
            client.watch("/d", true, move |events, overflowed| tx.send((events, overflowed)).is_ok()).expect("watch");
        assert!(watch.is_running());
        let first = rx.recv_timeout(Duration::from_secs(5)).expect("first batch");
        let second = rx.recv_timeout(Duration::from_secs(5)).expect("second batch");
        assert_eq!((first, second), ((vec![event("/d/a")], false), (vec![event("/d/b")], true)));
        drop(watch);
        client.prepare_snapshot().expect("the connection survives");
        assert!(rx.recv_timeout(Duration::from_millis(100)).is_err(), "an event after the watch was dropped");
        drop(client);
        agent.join().expect("agent");
    }

    #[test]
    fn an_oversize_batch_or_the_agents_end_ends_the_watch_and_drops_its_sink() {
        for end in [
            |id| GuestMessage::WatchEvents { id, events: vec![event("/x"); MAX_WATCH_BATCH + 1], overflowed: false },
            |id| GuestMessage::WatchEnded { id, reason: "gone".into() },
        ] as [fn(RequestId) -> GuestMessage; 2]
        {
            let (client, agent) = fake_agent(ClientConfig::default(), move |r, w| {
                hello(r, w);
                let id = next_id(r);
                w.write(&GuestMessage::Ack { id }).expect("write");
                w.write(&end(id)).expect("write");
                until_closed(r);
            });
            let client = client.expect("connect");
            let (tx, rx) = mpsc::channel::<Vec<WatchEvent>>();
            let watch = client.watch("/d", false, move |events, _| tx.send(events).is_ok()).expect("watch");
            // The sink (and its sender) is dropped: the channel disconnects without a batch.
            assert!(matches!(rx.recv_timeout(Duration::from_secs(5)), Err(RecvTimeoutError::Disconnected)));
            assert!(!watch.is_running());
            assert!(client.failure().is_none(), "one watch's fault is not the connection's");
            drop(watch);
            drop(client);
            agent.join().expect("agent");
        }
    }

    #[test]
    fn a_refused_watch_drops_its_sink() {
        let (client, agent) = fake_agent(ClientConfig::default(), |r, w| {
            hello(r, w);
            let id = next_id(r);
            w.write(&GuestMessage::FileError { id, errno: libc::ENOTDIR, message: "a file".into() }).expect("write");
            until_closed(r);
        });
        let client = client.expect("connect");
        let (tx, rx) = mpsc::channel::<Vec<WatchEvent>>();
        let err = client.watch("/f", false, move |events, _| tx.send(events).is_ok()).expect_err("refused");
        assert!(matches!(err, ClientError::File { errno: libc::ENOTDIR, .. }), "{err}");
        assert!(matches!(rx.recv_timeout(Duration::from_secs(5)), Err(RecvTimeoutError::Disconnected)));
        drop(client);
        agent.join().expect("agent");
    }

    #[test]
    fn an_upload_refused_midway_stops_sending_and_reports_why() {
        let (client, agent) = fake_agent(ClientConfig::default(), |r, w| {
            hello(r, w);
            let id = next_id(r);
            w.write(&GuestMessage::FileError { id, errno: libc::ENOSPC, message: "full".into() }).expect("write");
            // The client ends the id with an empty last chunk and sends nothing more for it.
            let mut chunks = 1;
            loop {
                match r.read::<HostMessage>().expect("read") {
                    Some(HostMessage::WriteFile { data, last: true, .. }) => {
                        assert!(data.is_empty());
                        break;
                    }
                    Some(HostMessage::WriteFile { .. }) => chunks += 1,
                    other => panic!("unexpected {other:?}"),
                }
            }
            assert!(chunks < 10, "{chunks} chunks were sent after the refusal");
            until_closed(r);
        });
        let client = client.expect("connect");
        let mut upload = client.upload("/f", 0o644).expect("upload");
        let mut err = None;
        for _ in 0..100 {
            if let Err(e) = upload.write(&[7; MAX_CHUNK]) {
                err = Some(e);
                break;
            }
            thread::sleep(Duration::from_millis(5));
        }
        let err = err.expect("the refusal reaches the writer");
        assert!(matches!(err, ClientError::File { errno: libc::ENOSPC, .. }), "{err}");
        assert!(matches!(upload.finish(), Err(ClientError::File { errno: libc::ENOSPC, .. })));
        drop(client);
        agent.join().expect("agent");
    }

    #[test]
    fn a_second_hello_ends_the_connection() {
        let (client, agent) = fake_agent(ClientConfig::default(), |r, w| {
            hello(r, w);
            let _ = next_id(r);
            let hello =
                GuestMessage::Hello { version: PROTOCOL_VERSION, agent_version: String::new(), kernel: String::new() };
            w.write(&hello).expect("write");
            until_closed(r);
        });
        let client = client.expect("connect");
        let err = client.prepare_snapshot().expect_err("second hello");
        assert!(matches!(err, ClientError::Violation { .. }), "{err}");
        drop(client);
        agent.join().expect("agent");
    }

    #[test]
    fn a_flood_of_output_waits_for_the_consumer_instead_of_growing() {
        let written = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counter = written.clone();
        let (client, agent) = fake_agent(ClientConfig::default(), move |r, w| {
            hello(r, w);
            let id = next_id(r);
            w.write(&GuestMessage::Started { id, pid: 7 }).expect("write");
            let chunk = GuestMessage::Output { id, stream: OutputStream::Stdout, data: vec![0; MAX_CHUNK].into() };
            // Far more than the route queue and the socket buffers hold: the writes block until the host reads.
            for _ in 0..2000 {
                if w.write(&chunk).is_err() {
                    return;
                }
                counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            }
            until_closed(r);
        });
        let client = client.expect("connect");
        let mut handle = client.start(&sleep_request(None)).expect("start");
        thread::sleep(Duration::from_millis(200));
        // While nobody consumed, the agent's writes blocked: the client held at most ROUTE_QUEUE chunks (plus what
        // the socket buffers take), not the 2000 sent. (Draining the queue here to count it would let the reader
        // refill it meanwhile.)
        let sent = written.load(std::sync::atomic::Ordering::SeqCst);
        assert!(sent < ROUTE_QUEUE + 64, "{sent} chunks were accepted while nobody read");
        let mut received = 0usize;
        while received < 100 {
            match handle.next_event(Some(Duration::from_secs(5))).expect("event") {
                ExecEvent::Output { data, .. } => received += usize::from(data.len() == MAX_CHUNK),
                ExecEvent::Exited(_) => panic!("no exit was sent"),
            }
        }
        drop(handle);
        drop(client);
        agent.join().expect("agent");
    }
}
