//! The host's agent client (`guest-images/proto/src/client.rs`), the model of a bounded hostile peer, against
//! an agent that says whatever the input says: a script of host requests, each answered with bytes of the
//! input's choosing, raw (any bytes on the wire) or generated (well-formed messages about the requests made, so
//! that the per-request checks are reached).
//!
//! Input ([`Cursor`]): the handshake's answer, then up to [`MAX_STEPS`] steps of `op, param, answer`; an answer
//! is `kind` then, for an even `kind`, a 2-byte length and that many raw bytes, and for an odd one the
//! generator's bytes (a 2-byte length, then [`arbitrary`] input for `kind / 2 % 8` messages: answers to the file
//! methods and watch events when `kind`'s top bit is set, any other message when it is not).
//!
//! The transport is in memory: a step's answer becomes readable once the host has sent that step's request (or
//! at the step's start when it sends none), so that answers never race the requests they answer. The host waits
//! for an answer at most [`WAIT`]; an agent that says too little costs a timeout, not a hang.
//!
//! Oracles: nothing the agent sends makes the client panic or hang; the bounds the client promises hold for
//! whatever it returns (a file never longer than `max`, a listing never longer than `max_entries`, output chunks
//! never over `MAX_CHUNK` nor beyond the cap per stream, one exit per exec, exit totals not below what was
//! forwarded; a watch's sink gets batches of at most `MAX_WATCH_BATCH` events, and none once it said stop);
//! every frame the host writes is one valid host message.

use std::io::{self, Read, Write};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use arbitrary::Unstructured;
use strata_guest_proto::frame::{decode, encode};
use strata_guest_proto::{
    AgentClient, AgentWatch, ClientConfig, EntryInfo, ExecEvent, ExecHandle, ExecLimits, ExecRequest, FileType,
    GuestMessage, HostMessage, MAX_CHUNK, MAX_FRAME, MAX_PATH, MAX_TREE_BATCH, MAX_WATCH_BATCH, RequestId, Transport,
    WatchEvent, WatchKind,
};

use crate::generate::{Cursor, edgy_u64, frame, guest_message};

/// The most steps of one script.
pub const MAX_STEPS: usize = 24;

/// How long the host waits for each answer.
pub const WAIT: Duration = Duration::from_millis(10);

/// The most execs running at once in a script.
const MAX_HANDLES: usize = 4;

/// The most watches running at once in a script.
const MAX_WATCHES: usize = 2;

/// Runs the script in `data`.
pub fn run(data: &[u8]) {
    let mut input = Cursor::new(data);
    let mut ids = Ids::default();
    let hello = answer(&mut input, &ids);
    let mut steps = Vec::new();
    while !input.is_empty() && steps.len() < MAX_STEPS {
        let op = Op::parse(input.u8(), input.u8());
        ids.issue(op.opens_route());
        steps.push((op, answer(&mut input, &ids)));
    }
    let agent = Agent::new(std::iter::once(hello).chain(steps.iter().map(|(_, a)| a.clone())).collect());
    let client = match AgentClient::connect(agent.end(), ClientConfig { timeout: Some(WAIT) }) {
        Ok(client) => client,
        Err(_) => {
            agent.host_frames_are_valid();
            return;
        }
    };
    let mut handles: Vec<Exec> = Vec::new();
    let mut watches: Vec<Watched> = Vec::new();
    for (index, (op, _)) in steps.iter().enumerate() {
        agent.begin_step(index + 1, op.sends());
        op.run(&client, &mut handles, &mut watches);
        agent.end_step();
    }
    drop(handles);
    drop(client);
    for watched in watches {
        watched.sink_kept_its_bounds();
    }
    agent.host_frames_are_valid();
}

/// The request ids the client will use, as it numbers them (from 1, one per request that awaits an answer), so
/// that generated answers name them.
#[derive(Debug, Default)]
struct Ids {
    issued: Vec<u64>,
}

impl Ids {
    fn issue(&mut self, opens_route: bool) {
        if opens_route {
            let next = self.issued.len() as u64 + 1;
            self.issued.push(next);
        }
    }
}

fn answer(input: &mut Cursor<'_>, ids: &Ids) -> Vec<u8> {
    let kind = input.u8();
    let block = input.block();
    if kind.is_multiple_of(2) {
        return block.to_vec();
    }
    let mut u = Unstructured::new(block);
    let mut out = Vec::new();
    // Mostly the latest requests: an answer is usually about the request it answers.
    let recent: Vec<u64> = ids.issued.iter().rev().take(3).copied().collect();
    for _ in 0..(kind / 2 % 8) {
        let message = if kind & 0x80 != 0 { file_message(&mut u, &recent) } else { guest_message(&mut u, &recent) };
        let Ok(message) = message else { break };
        if let Ok(body) = encode(&message) {
            out.extend_from_slice(&frame(&body));
        }
    }
    out
}

/// An answer to a file method, or a watch's events or end, about one of `ids` (or any id).
fn file_message(u: &mut Unstructured<'_>, ids: &[u64]) -> arbitrary::Result<GuestMessage> {
    let id = if ids.is_empty() || u.ratio(1, 8)? { RequestId(u.arbitrary()?) } else { RequestId(*u.choose(ids)?) };
    // Mostly a few; now and then one past the batch limit, which the host must refuse.
    let count = |u: &mut Unstructured<'_>, limit: usize| -> arbitrary::Result<usize> {
        Ok(if u.ratio(1, 8)? { limit + 1 } else { u.int_in_range(0..=4)? })
    };
    Ok(match u.int_in_range(0u8..=5)? {
        0 => GuestMessage::Entry { id, entry: entry_info(u)? },
        1 => {
            let entries = (0..count(u, MAX_TREE_BATCH)?).map(|_| entry_info(u)).collect::<arbitrary::Result<_>>()?;
            GuestMessage::DirEntries { id, entries }
        }
        2 => GuestMessage::DirDone { id, count: edgy_u64(u, &[0, 1, 2, 4, u64::MAX])?, skipped: u.arbitrary()? },
        3 => GuestMessage::DirCreated { id, created: u.arbitrary()? },
        4 => {
            let kinds = [WatchKind::Create, WatchKind::Write, WatchKind::Chmod, WatchKind::Rename, WatchKind::Remove];
            let mut events = Vec::new();
            for _ in 0..count(u, MAX_WATCH_BATCH)? {
                events.push(WatchEvent { kind: *u.choose(&kinds)?, path: guest_path(u)? });
            }
            GuestMessage::WatchEvents { id, events, overflowed: u.arbitrary()? }
        }
        _ => GuestMessage::WatchEnded { id, reason: u.arbitrary()? },
    })
}

fn entry_info(u: &mut Unstructured<'_>) -> arbitrary::Result<EntryInfo> {
    Ok(EntryInfo {
        path: guest_path(u)?,
        file_type: *u.choose(&[FileType::File, FileType::Dir, FileType::Symlink, FileType::Other])?,
        size: u.arbitrary()?,
        mode: u.arbitrary()?,
        uid: u.arbitrary()?,
        gid: u.arbitrary()?,
        modified: u.arbitrary()?,
        target: if u.arbitrary()? { Some(guest_path(u)?) } else { None },
    })
}

/// A path as a hostile agent might name one: about the paths the script asks about, or not a guest path at all.
fn guest_path(u: &mut Unstructured<'_>) -> arbitrary::Result<String> {
    Ok(match u.int_in_range(0u8..=7)? {
        0 => format!("/data/{}", "p".repeat(MAX_PATH)),
        1 => "/data/../etc".to_owned(),
        2 => "relative".to_owned(),
        3 => "/data".to_owned(),
        _ => {
            let name: String = u.arbitrary()?;
            format!("/data/{}", name.chars().take(16).collect::<String>())
        }
    })
}

/// One host request.
#[derive(Debug, Clone, Copy)]
enum Op {
    Exec { cap: Option<u64>, stdin: bool },
    Next { handle: u8 },
    Signal { handle: u8 },
    DropHandle { handle: u8 },
    ReadFile { max: u64 },
    ListTree { max: u64 },
    MakeDir,
    MakeSymlink,
    Upload { len: usize },
    PrepareSnapshot,
    AfterRestore,
    StartEgress,
    Stat,
    ListDir { max: u64, depth: u32 },
    CreateDir,
    Rename,
    Remove,
    Watch { recursive: bool, stop_after: u8 },
    Unwatch { watch: u8 },
}

const LIMITS: [u64; 8] = [0, 1, 5, 100, 4096, 65_536, 1 << 20, u64::MAX];

impl Op {
    fn parse(op: u8, param: u8) -> Op {
        let limit = LIMITS[usize::from(param) % LIMITS.len()];
        match op % 19 {
            0 => Op::Exec { cap: (param & 0x80 == 0).then_some(limit), stdin: param & 0x40 != 0 },
            1 => Op::Next { handle: param },
            2 => Op::Signal { handle: param },
            3 => Op::DropHandle { handle: param },
            4 => Op::ReadFile { max: limit },
            5 => Op::ListTree { max: limit },
            6 => Op::MakeDir,
            7 => Op::MakeSymlink,
            8 => Op::Upload { len: [0, 1, MAX_CHUNK, MAX_CHUNK + 1, 3 * MAX_CHUNK][usize::from(param) % 5] },
            9 => Op::PrepareSnapshot,
            10 => Op::AfterRestore,
            11 => Op::StartEgress,
            12 => Op::Stat,
            13 => Op::ListDir { max: limit, depth: u32::from(param >> 4) },
            14 => Op::CreateDir,
            15 => Op::Rename,
            16 => Op::Remove,
            17 => Op::Watch { recursive: param & 1 != 0, stop_after: param >> 1 },
            _ => Op::Unwatch { watch: param },
        }
    }

    /// Whether the client opens a route (takes a request id) for it.
    fn opens_route(self) -> bool {
        !matches!(self, Op::Next { .. } | Op::Signal { .. } | Op::DropHandle { .. } | Op::Unwatch { .. })
    }

    /// Whether it writes a frame (its answer is released at the first write).
    fn sends(self) -> bool {
        !matches!(self, Op::Next { .. } | Op::DropHandle { .. })
    }

    fn run(self, client: &AgentClient, handles: &mut Vec<Exec>, watches: &mut Vec<Watched>) {
        let pick = |handles: &Vec<Exec>, handle: u8| {
            if handles.is_empty() { None } else { Some(usize::from(handle) % handles.len()) }
        };
        match self {
            Op::Exec { cap, stdin } => {
                let request = ExecRequest {
                    argv: vec!["sh".into(), "-c".into(), "true".into()],
                    stdin,
                    limits: ExecLimits { output: cap, ..ExecLimits::default() },
                    ..ExecRequest::default()
                };
                if let Ok(handle) = client.start(&request) {
                    if handles.len() == MAX_HANDLES {
                        handles.remove(0);
                    }
                    handles.push(Exec { handle, cap, forwarded: [0, 0], exited: false });
                }
            }
            Op::Next { handle } => {
                if let Some(i) = pick(handles, handle) {
                    handles[i].next();
                }
            }
            Op::Signal { handle } => match pick(handles, handle) {
                Some(i) => {
                    let _ = handles[i].handle.control().signal(9);
                }
                None => {
                    let _ = client.signal(strata_guest_proto::RequestId(u64::from(handle)), 15);
                }
            },
            Op::DropHandle { handle } => {
                if let Some(i) = pick(handles, handle) {
                    handles.remove(i);
                }
            }
            Op::ReadFile { max } => {
                if let Ok(data) = client.read_file("/etc/hostname", max) {
                    assert!(data.len() as u64 <= max, "read_file returned {} bytes of at most {max}", data.len());
                }
            }
            Op::ListTree { max } => {
                if let Ok(listing) = client.list_tree("/data", max) {
                    assert!(listing.entries.len() as u64 <= max, "{} entries of at most {max}", listing.entries.len());
                }
            }
            Op::MakeDir => {
                let _ = client.make_dir("/data/sub", 0o755, true);
            }
            Op::MakeSymlink => {
                let _ = client.make_symlink("/data/link", "../x");
            }
            Op::Upload { len } => {
                let _ = client.write_file("/tmp/upload", 0o644, &vec![0x5a; len]);
            }
            Op::PrepareSnapshot => {
                let _ = client.prepare_snapshot();
            }
            Op::AfterRestore => {
                let _ = client.after_restore([7; 64], 1_700_000_000_000_000_000);
            }
            Op::StartEgress => {
                let _ = client.start_egress(3128, 1028, 64);
            }
            Op::Stat => {
                let _ = client.stat("/data/x");
            }
            Op::ListDir { max, depth } => {
                if let Ok(listing) = client.list_dir("/data", depth, max) {
                    assert!(listing.entries.len() as u64 <= max, "{} entries of at most {max}", listing.entries.len());
                }
            }
            Op::CreateDir => {
                let _ = client.create_dir("/data/a/b");
            }
            Op::Rename => {
                let _ = client.rename("/data/x", "/data/y");
            }
            Op::Remove => {
                let _ = client.remove("/data/y");
            }
            Op::Watch { recursive, stop_after } => {
                let record = Arc::new(Mutex::new(SinkRecord::default()));
                let seen = Arc::clone(&record);
                let sink = move |events: Vec<WatchEvent>, _overflowed: bool| {
                    let mut seen = seen.lock().unwrap_or_else(PoisonError::into_inner);
                    seen.after_stop |= seen.stopped;
                    seen.largest = seen.largest.max(events.len());
                    seen.batches += 1;
                    seen.stopped = seen.batches > usize::from(stop_after);
                    !seen.stopped
                };
                if let Ok(watch) = client.watch("/data", recursive, sink) {
                    if watches.len() == MAX_WATCHES {
                        watches.remove(0).sink_kept_its_bounds();
                    }
                    watches.push(Watched { _watch: watch, record });
                }
            }
            Op::Unwatch { watch } => {
                if !watches.is_empty() {
                    let index = usize::from(watch) % watches.len();
                    watches.remove(index).sink_kept_its_bounds();
                }
            }
        }
    }
}

/// A running exec and what the oracle knows of it.
#[derive(Debug)]
struct Exec {
    handle: ExecHandle,
    cap: Option<u64>,
    forwarded: [u64; 2],
    exited: bool,
}

impl Exec {
    fn next(&mut self) {
        match self.handle.next_event(Some(WAIT)) {
            Ok(ExecEvent::Output { stream, data }) => {
                assert!(!self.exited, "output after the exit");
                assert!(data.len() <= MAX_CHUNK, "an output chunk of {} bytes", data.len());
                let index = usize::from(stream == strata_guest_proto::OutputStream::Stderr);
                self.forwarded[index] += data.len() as u64;
                if let Some(cap) = self.cap {
                    assert!(
                        self.forwarded[index] <= cap,
                        "{} bytes forwarded past the cap {cap}",
                        self.forwarded[index]
                    );
                }
            }
            Ok(ExecEvent::Exited(report)) => {
                assert!(!self.exited, "a second exit");
                assert!(report.status.is_valid(), "exit status {:?}", report.status);
                assert!(report.stdout_bytes >= self.forwarded[0] && report.stderr_bytes >= self.forwarded[1]);
                self.exited = true;
            }
            Err(_) => {}
        }
    }
}

/// What a watch's sink was handed.
#[derive(Debug, Default)]
struct SinkRecord {
    batches: usize,
    largest: usize,
    /// The sink said stop.
    stopped: bool,
    /// It was called after that.
    after_stop: bool,
}

/// A running watch and what its sink saw.
#[derive(Debug)]
struct Watched {
    _watch: AgentWatch,
    record: Arc<Mutex<SinkRecord>>,
}

impl Watched {
    /// Ends the watch (when it is the last handle) and checks what its sink was handed.
    fn sink_kept_its_bounds(self) {
        let record = self.record.lock().unwrap_or_else(PoisonError::into_inner);
        assert!(record.largest <= MAX_WATCH_BATCH, "a watch batch of {} events", record.largest);
        assert!(!record.after_stop, "a sink was called after it said stop");
    }
}

#[derive(Debug, Default)]
struct State {
    /// The agent's answers: chunk 0 to the handshake, chunk `i` to step `i`.
    chunks: Vec<Vec<u8>>,
    /// Chunks readable so far.
    released: usize,
    /// Reading position: chunk, offset.
    chunk: usize,
    offset: usize,
    /// The step whose chunk the next write releases.
    release_on_write: Option<usize>,
    /// Everything the host wrote.
    written: Vec<u8>,
    closed: bool,
    read_timeout: Option<Duration>,
}

/// The agent's side of the in-memory connection.
#[derive(Debug, Clone)]
struct Agent {
    shared: Arc<(Mutex<State>, Condvar)>,
}

impl Agent {
    fn new(chunks: Vec<Vec<u8>>) -> Agent {
        let state = State { chunks, release_on_write: Some(0), ..State::default() };
        Agent { shared: Arc::new((Mutex::new(state), Condvar::new())) }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.shared.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn end(&self) -> End {
        End(self.clone())
    }

    fn release(&self, state: &mut State, step: usize) {
        state.released = state.released.max(step + 1).min(state.chunks.len());
        self.shared.1.notify_all();
    }

    fn begin_step(&self, step: usize, sends: bool) {
        let mut state = self.state();
        if sends {
            state.release_on_write = Some(step);
        } else {
            self.release(&mut state, step);
        }
    }

    fn end_step(&self) {
        let mut state = self.state();
        if let Some(step) = state.release_on_write.take() {
            // A request that never went out (the connection had failed): its answer still follows.
            self.release(&mut state, step);
        }
    }

    /// Every frame the host wrote decodes as one host message within the frame limit.
    fn host_frames_are_valid(&self) {
        let state = self.state();
        let mut rest = state.written.as_slice();
        while !rest.is_empty() {
            let (header, body) = rest.split_at_checked(4).expect("the host wrote half a frame header");
            let len = u32::from_le_bytes(header.try_into().expect("4 bytes")) as usize;
            assert!(len <= MAX_FRAME, "the host wrote a frame of {len} bytes");
            let (body, tail) = body.split_at_checked(len).expect("the host wrote half a frame");
            decode::<HostMessage>(body).expect("the host wrote a frame that is not a host message");
            rest = tail;
        }
    }
}

/// One handle on the connection, as the client holds it.
#[derive(Debug)]
struct End(Agent);

impl Read for End {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let agent = &self.0;
        let mut state = agent.state();
        let deadline = state.read_timeout.map(|t| Instant::now() + t);
        loop {
            if state.closed || buf.is_empty() {
                return Ok(0);
            }
            if state.chunk < state.released {
                let (chunk, offset) = (state.chunk, state.offset);
                let available = state.chunks[chunk].len() - offset;
                if available == 0 {
                    state.chunk += 1;
                    state.offset = 0;
                    continue;
                }
                let n = available.min(buf.len());
                buf[..n].copy_from_slice(&state.chunks[chunk][offset..offset + n]);
                state.offset += n;
                return Ok(n);
            }
            if state.chunk >= state.chunks.len() {
                // The script is over: the agent closes its end.
                return Ok(0);
            }
            state = match deadline {
                None => agent.shared.1.wait(state).unwrap_or_else(PoisonError::into_inner),
                Some(deadline) => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Err(io::ErrorKind::WouldBlock.into());
                    }
                    agent.shared.1.wait_timeout(state, left).unwrap_or_else(PoisonError::into_inner).0
                }
            };
        }
    }
}

impl Write for End {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let agent = &self.0;
        let mut state = agent.state();
        if state.closed {
            return Err(io::ErrorKind::BrokenPipe.into());
        }
        state.written.extend_from_slice(buf);
        if let Some(step) = state.release_on_write.take() {
            agent.release(&mut state, step);
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Transport for End {
    fn try_clone(&self) -> io::Result<Self> {
        Ok(End(self.0.clone()))
    }

    fn shutdown(&self) -> io::Result<()> {
        let mut state = self.0.state();
        state.closed = true;
        self.0.shared.1.notify_all();
        Ok(())
    }

    fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        self.0.state().read_timeout = timeout;
        Ok(())
    }
}
