//! The code interpreter's contexts: each one kernel inside the sandbox for its whole life (`kernel.py`, run by the
//! sandbox's own `python3`: an IPython shell for `python`, one bash for `bash`), so a context is one interpreter
//! whose state carries from cell to cell, as in Jupyter.
//!
//! The kernel is a job of the sandbox that lives as long as its context: requests go to its stdin as JSON lines,
//! events come back on its stdout as JSON lines (its stderr is kept as a short tail for errors), read by a sink
//! that takes the whole stream ([`OutputSink::takes_all`]). What the kernel says is the guest's word: each line is
//! bounded ([`MAX_EVENT`]) and checked into a [`KernelEvent`] of known fields and types before anything is sent on;
//! events queue in a bounded channel, so a kernel that writes faster than its client reads waits. What a kernel
//! can make the host hold is bounded by these: a partial line ([`MAX_EVENT`]), eight queued events, and the
//! cell's response queue ([`CELL_QUEUE`] lines), at most about 100 MiB per context and [`MAX_CONTEXTS`] contexts.
//!
//! A cell runs on a thread of its own, one cell at a time per context. Its time limit is the sandbox's per-job
//! wall limit: past it (or when the client goes away) the kernel is interrupted (`KeyboardInterrupt`, the context
//! lives on); a kernel that does not stop within [`INTERRUPT_GRACE`] is killed and the next cell starts a new one
//! (its state lost, which the cell's error says).

use std::collections::BTreeMap;
use std::io::Write as _;
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, sync_channel};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use serde_json::{Map, Value, json};
use strata_core::{CancelToken, ExecOptions, Job, Limits, OutputSink, StdinStream, Stream};

use super::E2bError;
use super::rfc3339;
use crate::registry::{SandboxEntry, lock, new_id};

/// The kernel's program (see its header for the protocol).
const KERNEL_PY: &str = include_str!("kernel.py");

/// The most contexts a sandbox holds at once.
pub const MAX_CONTEXTS: usize = 8;

/// The longest event line a kernel may send (a large figure as base64 fits: a 1920×1080 PNG is well under it); a
/// longer one is dropped whole and reported as malformed.
pub const MAX_EVENT: usize = 8 << 20;

/// Events queued between the kernel and its cell's client; past this the kernel waits.
const EVENT_QUEUE: usize = 8;

/// Lines of a cell's answer queued for its client before the cell waits.
pub const CELL_QUEUE: usize = 4;

/// How long a kernel may take to say it is ready (importing IPython, on a cold page cache).
const START_TIMEOUT: Duration = Duration::from_secs(60);

/// How long a cell has to stop after an interrupt before its kernel is killed.
pub const INTERRUPT_GRACE: Duration = Duration::from_secs(5);

/// How often a silent cell looks whether its client is still there.
const CLIENT_CHECK: Duration = Duration::from_millis(100);

/// A kernel's own wall and CPU limit as a job: its context's life, which its sandbox's end bounds.
const KERNEL_LIFE: Duration = Duration::from_secs(30 * 24 * 3600);

/// The most of a kernel's stderr kept for its errors.
const STDERR_TAIL: usize = 4096;

/// A language a context runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Language {
    /// An IPython shell.
    Python,
    /// One bash.
    Bash,
}

impl Language {
    /// The language a request names (`None`: Python); one the sandbox cannot run is refused, never run as Python.
    pub fn parse(name: Option<&str>) -> Result<Language, E2bError> {
        match name.map(str::to_ascii_lowercase).as_deref() {
            None | Some("" | "python" | "python3") => Ok(Language::Python),
            Some("bash" | "sh") => Ok(Language::Bash),
            Some(other) => Err(E2bError::invalid_argument(format!(
                "language {other:?} is not available in this sandbox: its code interpreter runs python and bash"
            ))),
        }
    }

    /// Its name in the contexts API.
    pub fn as_str(self) -> &'static str {
        match self {
            Language::Python => "python",
            Language::Bash => "bash",
        }
    }
}

/// One checked line of a kernel's output.
#[derive(Debug, Clone, PartialEq)]
pub enum KernelEvent {
    /// The kernel is up.
    Ready,
    /// The number the cell runs as.
    Count(u64),
    /// Output of the cell.
    Output {
        /// stderr rather than stdout.
        stderr: bool,
        /// The text.
        text: String,
    },
    /// A result: its known fields, checked (`is_main_result`, the formats, `data`, `extra`).
    Result(Map<String, Value>),
    /// The cell raised.
    Error {
        /// The exception's type.
        name: String,
        /// Its message.
        value: String,
        /// Its traceback.
        traceback: String,
    },
    /// The cell is done and its output drained.
    End,
    /// A line that is not an event of the protocol (the guest's word: reported, not trusted).
    Malformed(String),
    /// The kernel's job ended (said by the server, never by the kernel).
    Exited(String),
}

/// A result's string fields, as E2B names them.
const STRING_FIELDS: [&str; 10] =
    ["text", "html", "markdown", "svg", "png", "jpeg", "pdf", "latex", "javascript", "chart"];

/// A result's object fields.
const OBJECT_FIELDS: [&str; 3] = ["json", "data", "extra"];

/// Reads one line of a kernel's output. Never fails: what is not a well-formed event is [`KernelEvent::Malformed`].
pub fn parse_event(line: &[u8]) -> KernelEvent {
    let malformed = |why: &str| KernelEvent::Malformed(why.to_owned());
    if line.len() > MAX_EVENT {
        return malformed("an event longer than the most a kernel may send");
    }
    let Ok(Value::Object(mut event)) = serde_json::from_slice::<Value>(line) else {
        return malformed("a line that is not a JSON object");
    };
    let text = |event: &mut Map<String, Value>, key: &str| match event.remove(key) {
        Some(Value::String(text)) => Some(text),
        _ => None,
    };
    match event.get("type").and_then(Value::as_str) {
        Some("ready") => KernelEvent::Ready,
        Some("number_of_executions") => match event.get("execution_count").and_then(Value::as_u64) {
            Some(count) => KernelEvent::Count(count),
            None => malformed("an execution count that is not a number"),
        },
        Some(kind @ ("stdout" | "stderr")) => {
            let stderr = kind == "stderr";
            match text(&mut event, "text") {
                Some(text) => KernelEvent::Output { stderr, text },
                None => malformed("output without text"),
            }
        }
        Some("result") => {
            let mut result = Map::new();
            result
                .insert("is_main_result".into(), Value::Bool(event.get("is_main_result") == Some(&Value::Bool(true))));
            for key in STRING_FIELDS {
                if let Some(value) = text(&mut event, key) {
                    result.insert(key.into(), Value::String(value));
                }
            }
            for key in OBJECT_FIELDS {
                if let Some(value @ Value::Object(_)) = event.remove(key) {
                    result.insert(key.into(), value);
                }
            }
            KernelEvent::Result(result)
        }
        Some("error") => KernelEvent::Error {
            name: text(&mut event, "name").unwrap_or_else(|| "Error".to_owned()),
            value: text(&mut event, "value").unwrap_or_default(),
            traceback: text(&mut event, "traceback").unwrap_or_default(),
        },
        Some("end_of_execution") => KernelEvent::End,
        _ => malformed("an event of no known type"),
    }
}

impl KernelEvent {
    /// The NDJSON line E2B's SDKs read for it, if it is one they are sent.
    fn to_e2b(&self) -> Option<Value> {
        let now = || rfc3339(SystemTime::now());
        match self {
            KernelEvent::Count(count) => Some(json!({"type": "number_of_executions", "execution_count": count})),
            KernelEvent::Output { stderr, text } => {
                Some(json!({"type": if *stderr { "stderr" } else { "stdout" }, "text": text, "timestamp": now()}))
            }
            KernelEvent::Result(fields) => {
                let mut line = fields.clone();
                line.insert("type".into(), Value::String("result".into()));
                Some(Value::Object(line))
            }
            KernelEvent::Error { name, value, traceback } => {
                Some(json!({"type": "error", "name": name, "value": value, "traceback": traceback}))
            }
            KernelEvent::Malformed(why) => Some(json!({"type": "stderr",
                "text": format!("[strata] the kernel sent {why}; it was dropped\n"), "timestamp": now()})),
            KernelEvent::Ready | KernelEvent::End | KernelEvent::Exited(_) => None,
        }
    }
}

/// Splits a kernel's stdout into lines, checks each, and queues it; keeps the tail of its stderr.
struct KernelSink {
    events: SyncSender<KernelEvent>,
    line: Mutex<Line>,
    stderr: Arc<Mutex<Vec<u8>>>,
}

#[derive(Default)]
struct Line {
    bytes: Vec<u8>,
    /// Dropping a line that grew past [`MAX_EVENT`], up to its end.
    skipping: bool,
}

impl OutputSink for KernelSink {
    fn output(&self, stream: Stream, chunk: &[u8]) {
        if stream == Stream::Stderr {
            let mut tail = lock(&self.stderr);
            tail.extend_from_slice(chunk);
            let excess = tail.len().saturating_sub(STDERR_TAIL);
            tail.drain(..excess);
            return;
        }
        let mut ready = Vec::new();
        {
            let mut line = lock(&self.line);
            let mut rest = chunk;
            while !rest.is_empty() {
                let (part, done) = match rest.iter().position(|b| *b == b'\n') {
                    Some(at) => (&rest[..at], Some(at + 1)),
                    None => (rest, None),
                };
                if !line.skipping {
                    if line.bytes.len() + part.len() > MAX_EVENT {
                        line.bytes = Vec::new();
                        line.skipping = true;
                    } else {
                        line.bytes.extend_from_slice(part);
                    }
                }
                match done {
                    Some(end) => {
                        let event = if line.skipping {
                            KernelEvent::Malformed("an event longer than the most a kernel may send".into())
                        } else {
                            parse_event(&line.bytes)
                        };
                        ready.push(event);
                        line.bytes.clear();
                        line.skipping = false;
                        rest = &rest[end..];
                    }
                    None => rest = &[],
                }
            }
        }
        for event in ready {
            // A context that is gone has no reader: its kernel is being stopped.
            let _ = self.events.send(event);
        }
    }

    fn takes_all(&self) -> bool {
        true
    }
}

/// The events a kernel's stdout makes when written in these chunks, in order (for the fuzz target).
pub(super) fn events_of(chunks: &[&[u8]]) -> Vec<KernelEvent> {
    let lines = chunks.iter().map(|chunk| chunk.iter().filter(|b| **b == b'\n').count()).sum::<usize>();
    let (tx, rx) = sync_channel(lines + 1);
    let sink = KernelSink { events: tx, line: Mutex::default(), stderr: Arc::default() };
    for chunk in chunks {
        sink.output(Stream::Stdout, chunk);
    }
    drop(sink);
    rx.into_iter().collect()
}

/// The NDJSON line E2B's SDKs get for `event`, if any (for the fuzz target).
pub(super) fn e2b_line(event: &KernelEvent) -> Option<Value> {
    event.to_e2b()
}

/// A running kernel.
struct Kernel {
    stdin: std::io::PipeWriter,
    events: Receiver<KernelEvent>,
    cancel: CancelToken,
    stderr: Arc<Mutex<Vec<u8>>>,
}

impl Kernel {
    /// Starts a kernel of `language` in `cwd` as a job of `entry`, and waits until it is ready.
    /// Its cancel token is put in `published` before it waits, so that a context stopped meanwhile stops it.
    fn start(
        entry: &Arc<SandboxEntry>,
        language: Language,
        cwd: &str,
        published: &Mutex<Option<CancelToken>>,
    ) -> Result<Kernel, String> {
        let (stdin_stream, stdin) = StdinStream::pipe().map_err(|e| format!("cannot make the kernel's stdin: {e}"))?;
        let (tx, events) = sync_channel(EVENT_QUEUE);
        let stderr = Arc::new(Mutex::new(Vec::new()));
        let sink = KernelSink { events: tx.clone(), line: Mutex::default(), stderr: stderr.clone() };
        let cancel = CancelToken::new();
        *lock(published) = Some(cancel.clone());
        let limits = Limits { wall: KERNEL_LIFE, cpu: KERNEL_LIFE, ..entry.limits.clone() };
        let argv = [
            "/usr/bin/env",
            "-C",
            cwd,
            "PYTHONUNBUFFERED=1",
            "MPLBACKEND=module://matplotlib_inline.backend_inline",
            "/usr/bin/python3",
            "-c",
            KERNEL_PY,
            language.as_str(),
        ];
        let job = Job::Command { argv: argv.iter().map(|s| (*s).to_owned()).collect() };
        let opts = ExecOptions {
            limits: Some(limits),
            stdin: None,
            stdin_stream: Some(stdin_stream),
            sink: Some(Arc::new(sink)),
            cancel: Some(cancel.clone()),
            ..ExecOptions::default()
        };
        let runner = entry.clone();
        let tail = stderr.clone();
        std::thread::Builder::new()
            .name("strata-kernel".into())
            .spawn(move || {
                let why = match runner.exec_service(&job, opts) {
                    Ok(outcome) => format!("the kernel {}", outcome.status),
                    Err(err) => format!("the kernel could not run: {err}"),
                };
                let tail = String::from_utf8_lossy(&lock(&tail)).trim().to_owned();
                let why = if tail.is_empty() { why } else { format!("{why}: {tail}") };
                let _ = tx.send(KernelEvent::Exited(why));
            })
            .map_err(|e| format!("cannot start the kernel's thread: {e}"))?;
        let kernel = Kernel { stdin, events, cancel, stderr };
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            match kernel.events.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                Ok(KernelEvent::Ready) => return Ok(kernel),
                Ok(KernelEvent::Exited(why)) => return Err(why),
                Ok(_) => {}
                Err(_) => {
                    kernel.stop();
                    return Err(format!("the kernel was not ready within {}s", START_TIMEOUT.as_secs()));
                }
            }
        }
    }

    fn send(&mut self, request: &Value) -> std::io::Result<()> {
        let mut line = request.to_string().into_bytes();
        line.push(b'\n');
        self.stdin.write_all(&line)
    }

    fn interrupt(&mut self) {
        let _ = self.send(&json!({"op": "interrupt"}));
    }

    fn stop(&self) {
        self.cancel.cancel();
    }

    /// Whether it was stopped (its job ends, or has ended).
    fn is_stopped(&self) -> bool {
        self.cancel.is_cancelled()
    }

    /// What its stderr said last, for an error.
    fn stderr_tail(&self) -> String {
        String::from_utf8_lossy(&lock(&self.stderr)).trim().to_owned()
    }
}

impl Drop for Kernel {
    fn drop(&mut self) {
        self.stop();
    }
}

/// One code context: a language, a directory, and the kernel that runs its cells (started on first use, and
/// again after it died).
pub struct Context {
    /// Its identifier.
    pub id: String,
    /// What it runs.
    pub language: Language,
    /// Its working directory.
    pub cwd: String,
    kernel: Mutex<Option<Kernel>>,
    /// The cancel token of its kernel, reachable while a cell holds the kernel: stopping never waits for a cell.
    cancel: Mutex<Option<CancelToken>>,
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context")
            .field("id", &self.id)
            .field("language", &self.language)
            .field("cwd", &self.cwd)
            .finish()
    }
}

impl Context {
    /// Its JSON in the contexts API.
    pub fn json(&self) -> Value {
        json!({"id": self.id, "language": self.language.as_str(), "cwd": self.cwd})
    }

    /// Starts its kernel now if it is not running (blocking).
    pub fn ensure_started(&self, entry: &Arc<SandboxEntry>) -> Result<(), String> {
        let mut kernel = lock(&self.kernel);
        if kernel.as_ref().is_none_or(Kernel::is_stopped) {
            *kernel = None;
            *kernel = Some(Kernel::start(entry, self.language, &self.cwd, &self.cancel)?);
        }
        Ok(())
    }

    /// Stops its kernel, without waiting for a cell that runs (it ends with its kernel); the next cell starts a
    /// fresh one.
    pub fn stop(&self) {
        if let Some(token) = lock(&self.cancel).take() {
            token.cancel();
        }
        let idle = match self.kernel.try_lock() {
            Ok(mut slot) => slot.take(),
            Err(std::sync::TryLockError::Poisoned(poisoned)) => poisoned.into_inner().take(),
            Err(std::sync::TryLockError::WouldBlock) => None,
        };
        drop(idle);
    }

    /// Runs one cell (blocking): each E2B NDJSON line goes to `out` as the kernel produces it. Past `limit`, or when
    /// `out` is closed (the client went away), the cell is interrupted; a kernel that does not stop within
    /// [`INTERRUPT_GRACE`] is killed.
    pub fn run_cell(
        &self,
        entry: &Arc<SandboxEntry>,
        code: &str,
        env: &BTreeMap<String, String>,
        limit: Duration,
        out: &tokio::sync::mpsc::Sender<Value>,
    ) {
        let mut slot = lock(&self.kernel);
        if slot.as_ref().is_some_and(Kernel::is_stopped) {
            *slot = None;
        }
        let error = |name: &str, value: String| json!({"type": "error", "name": name, "value": value, "traceback": ""});
        // What a kernel that ended between cells left behind, then a running kernel.
        if let Some(kernel) = slot.as_ref() {
            loop {
                match kernel.events.try_recv() {
                    Ok(KernelEvent::Exited(_)) | Err(std::sync::mpsc::TryRecvError::Disconnected) => {
                        *slot = None;
                        break;
                    }
                    Ok(_) => {}
                    Err(std::sync::mpsc::TryRecvError::Empty) => break,
                }
            }
        }
        if slot.is_none() {
            match Kernel::start(entry, self.language, &self.cwd, &self.cancel) {
                Ok(kernel) => *slot = Some(kernel),
                Err(why) => {
                    let _ = out.blocking_send(error("KernelError", why));
                    return;
                }
            }
        }
        let Some(kernel) = slot.as_mut() else { return };
        if let Err(err) = kernel.send(&json!({"op": "execute", "code": code, "env": env})) {
            let why = format!("the kernel stopped reading ({err}): {}", kernel.stderr_tail());
            *slot = None;
            let _ = out.blocking_send(error("KernelError", why));
            return;
        }
        let started = Instant::now();
        let mut deadline = started + limit;
        // Why the cell is being stopped, once it is.
        let mut stopping: Option<String> = None;
        let mut client = true;
        loop {
            if client && out.is_closed() {
                // The client went away: the cell is interrupted, and drained to its end.
                client = false;
                if stopping.is_none() {
                    stopping = Some("the client went away".into());
                    kernel.interrupt();
                    deadline = Instant::now() + INTERRUPT_GRACE;
                }
            }
            // In slices, to see a client that goes away while the cell is silent.
            let wait = deadline.saturating_duration_since(Instant::now()).min(CLIENT_CHECK);
            let event = match kernel.events.recv_timeout(wait) {
                Ok(event) => event,
                Err(RecvTimeoutError::Timeout) if Instant::now() < deadline => continue,
                Err(RecvTimeoutError::Timeout) if stopping.is_none() => {
                    stopping =
                        Some(format!("the cell ran past its time limit of {}", strata_core::format_duration(limit)));
                    kernel.interrupt();
                    deadline = Instant::now() + INTERRUPT_GRACE;
                    continue;
                }
                Err(RecvTimeoutError::Timeout) => {
                    let why = stopping.unwrap_or_default();
                    *slot = None;
                    let value = format!(
                        "{why}; the kernel did not stop on interrupt within {}s and was restarted: the context's \
                         variables are gone",
                        INTERRUPT_GRACE.as_secs()
                    );
                    if client {
                        let _ = out.blocking_send(error("TimeoutError", value));
                    }
                    return;
                }
                Err(RecvTimeoutError::Disconnected) => KernelEvent::Exited("the kernel ended".into()),
            };
            match event {
                KernelEvent::End => {
                    if let Some(why) = stopping.filter(|_| client) {
                        let _ = out.blocking_send(error("TimeoutError", why));
                    }
                    return;
                }
                KernelEvent::Exited(why) => {
                    *slot = None;
                    if client {
                        let value =
                            format!("{why}; the next cell starts a new kernel (the context's variables are gone)");
                        let _ = out.blocking_send(error("KernelDied", value));
                    }
                    return;
                }
                other => {
                    if let Some(line) = other.to_e2b().filter(|_| client)
                        && out.blocking_send(line).is_err()
                    {
                        // The client went away: the cell is interrupted, and drained to its end.
                        client = false;
                        if stopping.is_none() {
                            stopping = Some("the client went away".into());
                            kernel.interrupt();
                            deadline = Instant::now() + INTERRUPT_GRACE;
                        }
                    }
                }
            }
        }
    }
}

/// A sandbox's contexts, with the default context of each language.
#[derive(Debug, Default)]
pub struct Contexts {
    all: Mutex<BTreeMap<String, Arc<Context>>>,
    defaults: Mutex<BTreeMap<Language, String>>,
}

impl Contexts {
    /// A new context (its kernel not started yet); refused past [`MAX_CONTEXTS`].
    pub fn create(&self, language: Language, cwd: &str) -> Result<Arc<Context>, E2bError> {
        if cwd.is_empty() || !cwd.starts_with('/') || cwd.contains('\0') || cwd.len() > 4096 {
            return Err(E2bError::invalid_argument(format!("cwd {cwd:?} is not an absolute path")));
        }
        let mut all = lock(&self.all);
        if all.len() >= MAX_CONTEXTS {
            return Err(E2bError::new(
                super::ConnectCode::ResourceExhausted,
                format!("this sandbox has {MAX_CONTEXTS} code contexts, the most it holds: remove one first"),
            ));
        }
        let uuid = new_id("");
        let id = format!("{}-{}-{}-{}", &uuid[..8], &uuid[8..12], &uuid[12..16], &uuid[16..20]);
        let context = Arc::new(Context {
            id: id.clone(),
            language,
            cwd: cwd.to_owned(),
            kernel: Mutex::new(None),
            cancel: Mutex::new(None),
        });
        all.insert(id, context.clone());
        Ok(context)
    }

    /// The default context of `language`, made on first use.
    pub fn default_for(&self, language: Language, cwd: &str) -> Result<Arc<Context>, E2bError> {
        let mut defaults = lock(&self.defaults);
        if let Some(context) = defaults.get(&language).and_then(|id| self.get(id)) {
            return Ok(context);
        }
        let context = self.create(language, cwd)?;
        defaults.insert(language, context.id.clone());
        Ok(context)
    }

    /// The context `id`.
    pub fn get(&self, id: &str) -> Option<Arc<Context>> {
        lock(&self.all).get(id).cloned()
    }

    /// Every context.
    pub fn list(&self) -> Vec<Arc<Context>> {
        lock(&self.all).values().cloned().collect()
    }

    /// Removes context `id` and stops its kernel; `false` when there is none.
    pub fn remove(&self, id: &str) -> bool {
        let removed = lock(&self.all).remove(id);
        lock(&self.defaults).retain(|_, default| default != id);
        match removed {
            Some(context) => {
                context.stop();
                true
            }
            None => false,
        }
    }

    /// Stops every kernel (the sandbox ends).
    pub fn stop_all(&self) {
        for context in lock(&self.all).values() {
            context.stop();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_are_checked_field_by_field() {
        assert_eq!(parse_event(br#"{"type":"ready"}"#), KernelEvent::Ready);
        assert_eq!(parse_event(br#"{"type":"number_of_executions","execution_count":3}"#), KernelEvent::Count(3));
        assert_eq!(
            parse_event(br#"{"type":"stderr","text":"x"}"#),
            KernelEvent::Output { stderr: true, text: "x".into() }
        );
        let KernelEvent::Result(result) =
            parse_event(br#"{"type":"result","is_main_result":true,"text":"1","png":7,"json":{"a":1},"evil":"x"}"#)
        else {
            panic!("a result")
        };
        assert_eq!(Value::Object(result), json!({"is_main_result": true, "text": "1", "json": {"a": 1}}));
        for bad in [&b"not json"[..], b"[1]", br#"{"type":"stdout"}"#, br#"{"type":"exited"}"#, b""] {
            assert!(matches!(parse_event(bad), KernelEvent::Malformed(_)), "{:?}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn lines_are_split_across_chunks_and_an_oversized_one_is_dropped_whole() {
        let (tx, rx) = sync_channel(16);
        let sink = KernelSink { events: tx, line: Mutex::default(), stderr: Arc::default() };
        sink.output(Stream::Stdout, br#"{"type":"rea"#);
        sink.output(Stream::Stdout, b"dy\"}\n{\"type\":\"end_of_execution\"}\n");
        assert_eq!(rx.try_recv(), Ok(KernelEvent::Ready));
        assert_eq!(rx.try_recv(), Ok(KernelEvent::End));
        let big = vec![b'x'; MAX_EVENT / 2 + 1];
        sink.output(Stream::Stdout, &big);
        sink.output(Stream::Stdout, &big);
        sink.output(Stream::Stdout, b"\n{\"type\":\"ready\"}\n");
        assert!(matches!(rx.try_recv(), Ok(KernelEvent::Malformed(_))));
        assert_eq!(rx.try_recv(), Ok(KernelEvent::Ready));
        sink.output(Stream::Stderr, &vec![b'e'; STDERR_TAIL * 2]);
        assert_eq!(sink.stderr.lock().expect("lock").len(), STDERR_TAIL);
    }

    /// The server interrupts the cell it sent last; under load that interrupt can reach the kernel before the cell
    /// has started. It must still stop that cell (not be lost, leaving the cell to run out its time and the kernel
    /// to be restarted), and the kernel must go on. The bash kernel, run by the host's own `python3`.
    #[test]
    fn an_interrupt_that_comes_before_its_cell_runs_stops_it_and_the_kernel_goes_on() {
        use std::io::{BufRead, Write};
        let python = std::path::Path::new("/usr/bin/python3");
        if !python.exists() {
            eprintln!("skip: no /usr/bin/python3 on this host to run the kernel with");
            return;
        }
        let dir = tempfile::tempdir().expect("tempdir");
        let script = dir.path().join("kernel.py");
        std::fs::write(&script, KERNEL_PY).expect("write the kernel");
        let mut child = std::process::Command::new(python)
            .arg(&script)
            .arg("bash")
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("start the kernel");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send(serde_json::from_str::<Value>(&line).unwrap_or(Value::Null));
            }
        });
        // One write: the interrupt is read right behind its cell, usually before the cell runs.
        let requests = concat!(
            r#"{"op":"execute","code":"sleep 30; echo late"}"#,
            "\n",
            r#"{"op":"interrupt"}"#,
            "\n",
            r#"{"op":"execute","code":"echo ok"}"#,
            "\n"
        );
        child.stdin.as_mut().expect("stdin").write_all(requests.as_bytes()).expect("requests");
        let started = Instant::now();
        let mut events = Vec::new();
        while events.iter().filter(|e: &&Value| e["type"] == "end_of_execution").count() < 2 {
            match rx.recv_timeout(Duration::from_secs(20)) {
                Ok(event) => events.push(event),
                Err(_) => break,
            }
        }
        let _ = child.kill();
        let _ = child.wait();
        assert!(started.elapsed() < Duration::from_secs(20), "the interrupted cell ran on: {events:?}");
        let cells: Vec<&[Value]> =
            events.split_inclusive(|e| e["type"] == "end_of_execution").filter(|c| !c.is_empty()).collect();
        assert_eq!(cells.len(), 2, "{events:?}");
        assert!(cells[0].iter().any(|e| e["name"] == "KeyboardInterrupt"), "{:?}", cells[0]);
        assert!(cells[1].iter().any(|e| e["type"] == "stdout" && e["text"] == "ok\n"), "{:?}", cells[1]);
    }

    #[test]
    fn languages_the_sandbox_cannot_run_are_refused() {
        assert_eq!(Language::parse(None).ok(), Some(Language::Python));
        assert_eq!(Language::parse(Some("Bash")).ok(), Some(Language::Bash));
        for other in ["javascript", "r", "java", "typescript"] {
            assert!(Language::parse(Some(other)).is_err(), "{other}");
        }
    }
}
