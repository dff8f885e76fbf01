//! Reproducible runs of wasm jobs: seeded clocks and randomness, and the record and replay of a job's inputs.
//!
//! A job run with a [`Determinism`] (in [`ExecOptions::determinism`](crate::ExecOptions)) reads every clock,
//! random byte and host-tool answer through one [`JobInputs`]:
//!
//! - [`Determinism::Seed`]: the wall clock starts at an instant derived from the seed and both clocks advance by
//!   [`CLOCK_STEP_NS`] per reading; random bytes come from ChaCha20 keyed by the seed. The same seed and the same
//!   inputs give byte-identical output.
//! - [`Determinism::Record`]: the job runs with real (or, with a seed, seeded) values, and the [`Recorder`] keeps
//!   them with the job, its args, env, grants, limits and stdin, and the output and status it ended with: a
//!   [`Recording`], a versioned JSON document.
//! - [`Determinism::Replay`]: the [`Replayer`] feeds a recording's values back and then judges the outcome
//!   ([`Replayer::verdict`]): identical, or the first [`Divergence`] (an input the recording does not have, a
//!   tool request that differs, a stream that differs at a byte offset, another status).
//!
//! A recording is untrusted input: it is read only under [`MAX_RECORDING_BYTES`], every list is bounded, and what
//! is wrong with it is a typed [`ReplayError`]. What a recording does not hold: the contents of granted
//! directories (a replay grants the same host paths again) and file timestamps; a change there shows as an output
//! divergence. Python's string hashing is fixed by its pre-initialised runtime, the same in every run.

use std::fmt;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use chacha20::ChaCha20Rng;
use rand_core::{Rng as _, SeedableRng as _};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use sha2::{Digest as _, Sha256};

use crate::caps::{Capabilities, EnvVar, Grant};
use crate::job::{Job, ModuleSource, PythonSource};
use crate::limits::Limits;
use crate::outcome::{Outcome, Status, Stream};

/// The `format` field of every recording.
pub const FORMAT: &str = "strata-recording";
/// The recording version this build writes and reads.
pub const VERSION: u32 = 1;
/// The largest recording file read.
pub const MAX_RECORDING_BYTES: u64 = 64 << 20;
/// The most readings of each clock a recording holds.
pub const MAX_READINGS: usize = 1 << 20;
/// The most random bytes a recording holds.
pub const MAX_RANDOM_BYTES: usize = 16 << 20;
/// The most host-tool exchanges a recording holds.
pub const MAX_TOOL_EXCHANGES: usize = 1024;
/// How far a seeded clock advances at each reading: 1 ms.
pub const CLOCK_STEP_NS: u64 = 1_000_000;
/// Where a seeded wall clock starts, before the seed's offset: 2024-01-01T00:00:00Z.
const SEED_EPOCH_S: u64 = 1_704_067_200;
/// How many bytes of a differing stream a divergence shows.
const SHOWN_BYTES: usize = 16;

/// How a job's clocks, randomness and tool answers are made reproducible.
#[derive(Clone)]
pub enum Determinism {
    /// Seeded clocks and randomness.
    Seed(u64),
    /// Real (or the recorder's seeded) values, kept by the recorder.
    Record(Arc<Recorder>),
    /// A recording's values, fed back.
    Replay(Arc<Replayer>),
}

impl fmt::Debug for Determinism {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Determinism::Seed(seed) => f.debug_tuple("Seed").field(seed).finish(),
            Determinism::Record(recorder) => f.debug_tuple("Record").field(&recorder.seed).finish(),
            Determinism::Replay(_) => f.write_str("Replay"),
        }
    }
}

impl Determinism {
    /// The inputs of one job run this way; a recorder takes the job's description here. `stdin` is the job's
    /// whole stdin (`None`: none); a recording cannot be made of a job reading a stream.
    pub fn start(
        &self,
        job: &Job,
        caps: &Capabilities,
        limits: &Limits,
        stdin: Option<&[u8]>,
        streamed_stdin: bool,
    ) -> Result<Arc<JobInputs>, ReplayError> {
        let source = match self {
            Determinism::Seed(seed) => Source::Generated(Generator::seeded(*seed)),
            Determinism::Record(recorder) => {
                if streamed_stdin {
                    return Err(ReplayError::StreamedStdin);
                }
                let header = Header::of(job, caps, limits, stdin.unwrap_or_default())?;
                let generator = match recorder.seed {
                    Some(seed) => Generator::seeded(seed),
                    None => Generator::real(),
                };
                let insecure_seed = generator.insecure_seed();
                *lock(&recorder.state) = Some(RecorderState { header, log: Log::new(insecure_seed) });
                Source::Record(recorder.clone(), generator)
            }
            Determinism::Replay(replayer) => {
                if streamed_stdin {
                    return Err(ReplayError::StreamedStdin);
                }
                *lock(&replayer.state) = ReplayState::default();
                Source::Replay(replayer.clone(), Generator::seeded(replayer.recording.seed.unwrap_or_default()))
            }
        };
        Ok(Arc::new(JobInputs { source: Mutex::new(source) }))
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Where values come from when no recording gives them.
enum Generator {
    Seeded { rng: Box<ChaCha20Rng>, wall_ns: u64, monotonic_ns: u64, seed: u64 },
    Real { rng: Box<ChaCha20Rng>, started: Instant },
}

impl Generator {
    fn seeded(seed: u64) -> Generator {
        let key: [u8; 32] = Sha256::digest([b"strata-seed:".as_slice(), &seed.to_le_bytes()].concat()).into();
        let wall_ns = (SEED_EPOCH_S + seed % (366 * 86_400)) * 1_000_000_000;
        Generator::Seeded { rng: Box::new(ChaCha20Rng::from_seed(key)), wall_ns, monotonic_ns: 0, seed }
    }

    fn real() -> Generator {
        let mut key = [0u8; 32];
        let filled = std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut key)).is_ok();
        if !filled {
            let nanos = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default().as_nanos();
            key = Sha256::digest([nanos.to_le_bytes(), u128::from(std::process::id()).to_le_bytes()].concat()).into();
        }
        Generator::Real { rng: Box::new(ChaCha20Rng::from_seed(key)), started: Instant::now() }
    }

    fn insecure_seed(&self) -> u128 {
        match self {
            Generator::Seeded { seed, .. } => {
                let digest = Sha256::digest([b"strata-insecure-seed:".as_slice(), &seed.to_le_bytes()].concat());
                let mut bytes = [0u8; 16];
                bytes.copy_from_slice(&digest[..16]);
                u128::from_le_bytes(bytes)
            }
            Generator::Real { .. } => {
                let mut bytes = [0u8; 16];
                Generator::real().fill(&mut bytes);
                u128::from_le_bytes(bytes)
            }
        }
    }

    fn wall_ns(&mut self) -> u64 {
        match self {
            Generator::Seeded { wall_ns, .. } => {
                *wall_ns = wall_ns.saturating_add(CLOCK_STEP_NS);
                *wall_ns
            }
            Generator::Real { .. } => {
                u64::try_from(SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default().as_nanos())
                    .unwrap_or(u64::MAX)
            }
        }
    }

    fn monotonic_ns(&mut self) -> u64 {
        match self {
            Generator::Seeded { monotonic_ns, .. } => {
                *monotonic_ns = monotonic_ns.saturating_add(CLOCK_STEP_NS);
                *monotonic_ns
            }
            Generator::Real { started, .. } => u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX),
        }
    }

    fn fill(&mut self, dst: &mut [u8]) {
        match self {
            Generator::Seeded { rng, .. } | Generator::Real { rng, .. } => rng.fill_bytes(dst),
        }
    }
}

enum Source {
    Generated(Generator),
    Record(Arc<Recorder>, Generator),
    Replay(Arc<Replayer>, Generator),
}

/// What a job reads through a tool call under a [`Determinism`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolAnswer {
    /// Call the tool and, when recording, note its answer with [`JobInputs::note_tool`].
    Live,
    /// The recorded answer frame.
    Recorded(Vec<u8>),
    /// The replay has no answer for this request (the divergence is kept); the guest gets this error message.
    Missing(String),
}

/// One job's clocks, randomness and tool answers under a [`Determinism`]. Shared by the tier's clocks, random
/// source and tool host; every method may be called from any of them.
pub struct JobInputs {
    source: Mutex<Source>,
}

impl fmt::Debug for JobInputs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("JobInputs").finish_non_exhaustive()
    }
}

impl JobInputs {
    /// A wall-clock reading, in nanoseconds since the Unix epoch.
    pub fn wall_clock_ns(&self) -> u64 {
        match &mut *lock(&self.source) {
            Source::Generated(generator) => generator.wall_ns(),
            Source::Record(recorder, generator) => {
                let value = generator.wall_ns();
                recorder.with_log(|log| log.push_reading(Clock::Wall, value));
                value
            }
            Source::Replay(replayer, generator) => {
                let fallback = generator.wall_ns();
                replayer.reading(Clock::Wall).unwrap_or(fallback)
            }
        }
    }

    /// A monotonic-clock reading, in nanoseconds.
    pub fn monotonic_ns(&self) -> u64 {
        match &mut *lock(&self.source) {
            Source::Generated(generator) => generator.monotonic_ns(),
            Source::Record(recorder, generator) => {
                let value = generator.monotonic_ns();
                recorder.with_log(|log| log.push_reading(Clock::Monotonic, value));
                value
            }
            Source::Replay(replayer, generator) => {
                let fallback = generator.monotonic_ns();
                replayer.reading(Clock::Monotonic).unwrap_or(fallback)
            }
        }
    }

    /// Fills `dst` with the job's next random bytes.
    pub fn fill_random(&self, dst: &mut [u8]) {
        match &mut *lock(&self.source) {
            Source::Generated(generator) => generator.fill(dst),
            Source::Record(recorder, generator) => {
                generator.fill(dst);
                recorder.with_log(|log| log.push_random(dst));
            }
            Source::Replay(replayer, generator) => {
                if !replayer.random(dst) {
                    generator.fill(dst);
                }
            }
        }
    }

    /// The seed of WASI's insecure random generator (`wasi:random/insecure-seed`).
    pub fn insecure_seed(&self) -> u128 {
        match &*lock(&self.source) {
            Source::Generated(generator) => generator.insecure_seed(),
            Source::Record(recorder, generator) => {
                lock(&recorder.state).as_ref().map_or_else(|| generator.insecure_seed(), |s| s.log.insecure_seed)
            }
            Source::Replay(replayer, generator) => {
                replayer.recording.insecure_seed.parse().unwrap_or_else(|_| generator.insecure_seed())
            }
        }
    }

    /// Whether the job has host tools (`offered`: whether it has them in this run); a replay answers as recorded.
    pub fn tools_offered(&self, offered: bool) -> bool {
        match &*lock(&self.source) {
            Source::Generated(_) => offered,
            Source::Record(recorder, _) => {
                recorder.with_log(|log| log.tools_offered = offered);
                offered
            }
            Source::Replay(replayer, _) => replayer.recording.tools_offered,
        }
    }

    /// How to answer the tool frame `request`.
    pub fn tool_answer(&self, request: &[u8]) -> ToolAnswer {
        match &*lock(&self.source) {
            Source::Generated(_) | Source::Record(..) => ToolAnswer::Live,
            Source::Replay(replayer, _) => replayer.tool_answer(request),
        }
    }

    /// Notes the answer a live tool frame got (kept when recording).
    pub fn note_tool(&self, request: &[u8], answer: &[u8]) {
        if let Source::Record(recorder, _) = &*lock(&self.source) {
            recorder.with_log(|log| log.push_tool(request, answer));
        }
    }

    /// The text of a Python job's program: a replay's recorded script (the file need not exist any more), else
    /// what `read` gives, noted when recording.
    pub fn python_source<E>(
        &self,
        source: &PythonSource,
        read: impl FnOnce() -> Result<Option<String>, E>,
    ) -> Result<Option<String>, E> {
        if let Source::Replay(replayer, _) = &*lock(&self.source)
            && let (PythonSource::File(_), RecordedJob::Python { source: RecordedPython::File { contents, .. }, .. }) =
                (source, &replayer.recording.job)
        {
            return Ok(Some(contents.clone()));
        }
        let text = read()?;
        if let (Source::Record(recorder, _), Some(text)) = (&*lock(&self.source), &text) {
            recorder.with_log(|log| log.script = Some(text.clone()));
        }
        Ok(text)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Clock {
    Wall,
    Monotonic,
}

/// What a recorder keeps while the job runs.
struct Log {
    wall: Vec<u64>,
    monotonic: Vec<u64>,
    random: Vec<u8>,
    random_calls: u64,
    insecure_seed: u128,
    tools_offered: bool,
    tools: Vec<ToolExchange>,
    script: Option<String>,
    /// The first cap the job went past: the recording cannot be made.
    overflow: Option<(&'static str, usize)>,
}

impl Log {
    fn new(insecure_seed: u128) -> Log {
        Log {
            wall: Vec::new(),
            monotonic: Vec::new(),
            random: Vec::new(),
            random_calls: 0,
            insecure_seed,
            tools_offered: false,
            tools: Vec::new(),
            script: None,
            overflow: None,
        }
    }

    fn push_reading(&mut self, clock: Clock, value: u64) {
        let (readings, what) = match clock {
            Clock::Wall => (&mut self.wall, "wall clock readings"),
            Clock::Monotonic => (&mut self.monotonic, "monotonic clock readings"),
        };
        if readings.len() >= MAX_READINGS {
            self.overflow.get_or_insert((what, MAX_READINGS));
            return;
        }
        readings.push(value);
    }

    fn push_random(&mut self, bytes: &[u8]) {
        if self.random.len().saturating_add(bytes.len()) > MAX_RANDOM_BYTES {
            self.overflow.get_or_insert(("random bytes", MAX_RANDOM_BYTES));
            return;
        }
        self.random_calls += 1;
        self.random.extend_from_slice(bytes);
    }

    fn push_tool(&mut self, request: &[u8], answer: &[u8]) {
        if self.tools.len() >= MAX_TOOL_EXCHANGES {
            self.overflow.get_or_insert(("tool exchanges", MAX_TOOL_EXCHANGES));
            return;
        }
        self.tools.push(ToolExchange { request: Bytes(request.to_vec()), answer: Bytes(answer.to_vec()) });
    }
}

/// The description of a recorded job, taken when it starts.
struct Header {
    job: RecordedJob,
    env: Vec<EnvVar>,
    grants: Vec<Grant>,
    tools: Vec<String>,
    limits: Limits,
    stdin: Vec<u8>,
}

impl Header {
    fn of(job: &Job, caps: &Capabilities, limits: &Limits, stdin: &[u8]) -> Result<Header, ReplayError> {
        if !caps.secrets.is_empty() {
            let names = caps.secrets.iter().map(|s| s.name.clone()).collect::<Vec<_>>().join(", ");
            return Err(ReplayError::Secrets(names));
        }
        if caps.net.allowlist().is_some() {
            return Err(ReplayError::Network);
        }
        let job = match job {
            Job::Python { source, args } => {
                let source = match source {
                    PythonSource::Code(code) => RecordedPython::Code { code: code.clone() },
                    // The contents are noted when the tier reads them ([`JobInputs::python_source`]).
                    PythonSource::File(path) => RecordedPython::File { path: path.clone(), contents: String::new() },
                    PythonSource::Module(module) => RecordedPython::Module { module: module.clone() },
                };
                RecordedJob::Python { source, args: args.clone() }
            }
            Job::Wasm { module, args } => {
                let (path, bytes) = match module {
                    ModuleSource::File(path) => {
                        let bytes = std::fs::read(path)
                            .map_err(|source| ReplayError::ReadModule { path: path.clone(), source })?;
                        (Some(std::fs::canonicalize(path).unwrap_or_else(|_| path.clone())), bytes)
                    }
                    ModuleSource::Bytes { bytes, .. } => (None, bytes.to_vec()),
                };
                let sha256 = hex(&Sha256::digest(&bytes));
                let embedded = if path.is_none() { Some(Bytes(bytes)) } else { None };
                RecordedJob::Wasm { name: module.program_name(), path, sha256, bytes: embedded, args: args.clone() }
            }
            other => return Err(ReplayError::JobKind(other.kind().to_string())),
        };
        Ok(Header {
            job,
            env: caps.env.clone(),
            grants: caps.grants.clone(),
            tools: caps.tools.clone(),
            limits: limits.clone(),
            stdin: stdin.to_vec(),
        })
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

struct RecorderState {
    header: Header,
    log: Log,
}

/// Keeps what one job read, to make a [`Recording`] of it once it ends ([`Recorder::finish`]).
pub struct Recorder {
    seed: Option<u64>,
    state: Mutex<Option<RecorderState>>,
}

impl fmt::Debug for Recorder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Recorder").field("seed", &self.seed).finish_non_exhaustive()
    }
}

impl Recorder {
    /// A recorder of real values, or (`seed`) of the seeded ones.
    pub fn new(seed: Option<u64>) -> Recorder {
        Recorder { seed, state: Mutex::new(None) }
    }

    fn with_log(&self, f: impl FnOnce(&mut Log)) {
        if let Some(state) = lock(&self.state).as_mut() {
            f(&mut state.log);
        }
    }

    /// The recording of the job that ended with `outcome`.
    pub fn finish(&self, outcome: &Outcome) -> Result<Recording, ReplayError> {
        let Some(RecorderState { header, log }) = lock(&self.state).take() else {
            return Err(ReplayError::NothingRecorded);
        };
        if let Some((what, max)) = log.overflow {
            return Err(ReplayError::Bounds { what, count: max + 1, max });
        }
        let job = match header.job {
            RecordedJob::Python { source: RecordedPython::File { path, .. }, args } => RecordedJob::Python {
                source: RecordedPython::File { path, contents: log.script.unwrap_or_default() },
                args,
            },
            other => other,
        };
        Ok(Recording {
            format: FORMAT.into(),
            version: VERSION,
            job,
            env: header.env,
            grants: header.grants,
            tools: header.tools,
            limits: header.limits,
            stdin: Bytes(header.stdin),
            seed: self.seed,
            insecure_seed: log.insecure_seed.to_string(),
            wall_clock_ns: log.wall,
            monotonic_clock_ns: log.monotonic,
            random: Bytes(log.random),
            random_calls: log.random_calls,
            tools_offered: log.tools_offered,
            tool_exchanges: log.tools,
            expected: Expected {
                status: outcome.status.clone(),
                stdout: Bytes(outcome.stdout.clone()),
                stderr: Bytes(outcome.stderr.clone()),
            },
        })
    }
}

/// Bytes, as base64 in JSON.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Bytes(pub Vec<u8>);

impl Serialize for Bytes {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&BASE64.encode(&self.0))
    }
}

impl<'de> Deserialize<'de> for Bytes {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        BASE64.decode(text).map(Bytes).map_err(serde::de::Error::custom)
    }
}

/// A recorded job: what ran, and with what.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Recording {
    /// Always [`FORMAT`].
    pub format: String,
    /// [`VERSION`].
    pub version: u32,
    /// The program.
    pub job: RecordedJob,
    /// The guest's environment (a recording is never made with secrets).
    pub env: Vec<EnvVar>,
    /// The granted directories (their contents are not recorded).
    pub grants: Vec<Grant>,
    /// The host tools the capabilities named (their answers are in `tool_exchanges`).
    pub tools: Vec<String>,
    /// The job's limits.
    pub limits: Limits,
    /// Everything the job had on stdin.
    pub stdin: Bytes,
    /// The seed the values came from, or `None` for real ones.
    pub seed: Option<u64>,
    /// The seed of WASI's insecure generator, a decimal `u128`.
    pub insecure_seed: String,
    /// Wall-clock readings, nanoseconds since the Unix epoch, in the order the guest took them.
    pub wall_clock_ns: Vec<u64>,
    /// Monotonic-clock readings, nanoseconds.
    pub monotonic_clock_ns: Vec<u64>,
    /// Every random byte the guest read, in order.
    pub random: Bytes,
    /// How many reads of random bytes that was.
    pub random_calls: u64,
    /// Whether the job had host tools.
    pub tools_offered: bool,
    /// Each tool frame the guest sent and the answer it got, in order.
    pub tool_exchanges: Vec<ToolExchange>,
    /// How the job ended.
    pub expected: Expected,
}

/// A recorded program.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum RecordedJob {
    /// A WebAssembly command.
    Wasm {
        /// `argv[0]`.
        name: String,
        /// The module file (absolute), when it was one.
        path: Option<PathBuf>,
        /// The module's sha256, hex: a replay refuses a file that changed.
        sha256: String,
        /// The module itself, when it was given as bytes.
        bytes: Option<Bytes>,
        /// Its arguments.
        args: Vec<String>,
    },
    /// Python.
    Python {
        /// What Python ran.
        source: RecordedPython,
        /// Its arguments.
        args: Vec<String>,
    },
}

/// What a recorded Python job ran.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum RecordedPython {
    /// `-c CODE`.
    Code {
        /// The code.
        code: String,
    },
    /// A script: its path as given (the guest sees it) and its contents (a replay runs these).
    File {
        /// The path.
        path: PathBuf,
        /// The script.
        contents: String,
    },
    /// `-m MODULE`.
    Module {
        /// The module.
        module: String,
    },
}

/// One tool frame and its answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolExchange {
    /// The frame the guest sent.
    pub request: Bytes,
    /// The answer it got.
    pub answer: Bytes,
}

/// How a recorded job ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Expected {
    /// Its status.
    pub status: Status,
    /// Its captured stdout.
    pub stdout: Bytes,
    /// Its captured stderr.
    pub stderr: Bytes,
}

impl Recording {
    /// Parses and checks a recording.
    pub fn from_slice(bytes: &[u8]) -> Result<Recording, ReplayError> {
        let size = bytes.len() as u64;
        if size > MAX_RECORDING_BYTES {
            return Err(ReplayError::TooLarge { size, max: MAX_RECORDING_BYTES });
        }
        // The envelope first, so another format or version is named as such rather than as a field error.
        #[derive(Deserialize)]
        struct Envelope {
            format: Option<String>,
            version: Option<u32>,
        }
        let envelope: Envelope = serde_json::from_slice(bytes).map_err(malformed)?;
        if envelope.format.as_deref() != Some(FORMAT) {
            return Err(ReplayError::Format(envelope.format.unwrap_or_default()));
        }
        if envelope.version != Some(VERSION) {
            return Err(ReplayError::Version(envelope.version.unwrap_or_default()));
        }
        let recording: Recording = serde_json::from_slice(bytes).map_err(malformed)?;
        recording.check()?;
        Ok(recording)
    }

    /// Reads a recording file, refusing one over [`MAX_RECORDING_BYTES`] before reading it.
    pub fn read(path: &Path) -> Result<Recording, ReplayError> {
        let unreadable = |source| ReplayError::Read { path: path.to_owned(), source };
        let file = std::fs::File::open(path).map_err(unreadable)?;
        let size = file.metadata().map_err(unreadable)?.len();
        if size > MAX_RECORDING_BYTES {
            return Err(ReplayError::TooLarge { size, max: MAX_RECORDING_BYTES });
        }
        let mut bytes = Vec::new();
        file.take(MAX_RECORDING_BYTES + 1).read_to_end(&mut bytes).map_err(unreadable)?;
        Recording::from_slice(&bytes)
    }

    /// The recording as JSON.
    pub fn to_json(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// Writes the recording to `path` atomically (a temporary file beside it, then a rename).
    pub fn write(&self, path: &Path) -> Result<(), ReplayError> {
        let failed = |source| ReplayError::Write { path: path.to_owned(), source };
        let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let temp = dir.join(format!(".{name}.{}.tmp", std::process::id()));
        std::fs::write(&temp, self.to_json()).map_err(failed)?;
        std::fs::rename(&temp, path).map_err(|err| {
            let _ = std::fs::remove_file(&temp);
            failed(err)
        })
    }

    /// Checks what serde cannot: the bounds and the values a replay relies on.
    fn check(&self) -> Result<(), ReplayError> {
        let bounded = |what: &'static str, count: usize, max: usize| {
            if count > max { Err(ReplayError::Bounds { what, count, max }) } else { Ok(()) }
        };
        bounded("wall clock readings", self.wall_clock_ns.len(), MAX_READINGS)?;
        bounded("monotonic clock readings", self.monotonic_clock_ns.len(), MAX_READINGS)?;
        bounded("random bytes", self.random.0.len(), MAX_RANDOM_BYTES)?;
        bounded("tool exchanges", self.tool_exchanges.len(), MAX_TOOL_EXCHANGES)?;
        bounded("stdin bytes", self.stdin.0.len(), crate::limits::MAX_BUFFERED_STDIN)?;
        if self.random_calls > self.random.0.len() as u64 + 1 {
            return Err(ReplayError::Invalid(format!(
                "random_calls {} is more than there are random bytes ({})",
                self.random_calls,
                self.random.0.len()
            )));
        }
        if self.insecure_seed.parse::<u128>().is_err() {
            return Err(ReplayError::Invalid(format!("insecure_seed {:?} is not a u128", self.insecure_seed)));
        }
        for var in &self.env {
            if var.name.is_empty() || var.name.contains(['=', '\0']) || var.value.contains('\0') {
                return Err(ReplayError::Invalid(format!("environment variable {:?} is malformed", var.name)));
            }
        }
        if let RecordedJob::Wasm { path, sha256, bytes, .. } = &self.job {
            if path.is_some() == bytes.is_some() {
                return Err(ReplayError::Invalid("a wasm job has either a module path or its bytes".into()));
            }
            if sha256.len() != 64 || !sha256.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(ReplayError::Invalid(format!("sha256 {sha256:?} is not 64 hex digits")));
            }
        }
        Ok(())
    }

    /// The job to replay: a module file must still have its recorded sha256.
    pub fn job(&self) -> Result<Job, ReplayError> {
        match &self.job {
            RecordedJob::Python { source, args } => {
                let source = match source {
                    RecordedPython::Code { code } => PythonSource::Code(code.clone()),
                    RecordedPython::File { path, .. } => PythonSource::File(path.clone()),
                    RecordedPython::Module { module } => PythonSource::Module(module.clone()),
                };
                Ok(Job::Python { source, args: args.clone() })
            }
            RecordedJob::Wasm { name, path, sha256, bytes, args } => {
                let (module, actual) = match (path, bytes) {
                    (Some(path), _) => {
                        let read = std::fs::read(path)
                            .map_err(|source| ReplayError::ReadModule { path: path.clone(), source })?;
                        (ModuleSource::File(path.clone()), hex(&Sha256::digest(&read)))
                    }
                    (None, Some(bytes)) => (
                        ModuleSource::Bytes { name: name.clone(), bytes: bytes.0.clone().into() },
                        hex(&Sha256::digest(&bytes.0)),
                    ),
                    (None, None) => return Err(ReplayError::Invalid("a wasm job without a module".into())),
                };
                if !actual.eq_ignore_ascii_case(sha256) {
                    let what = path.as_ref().map_or_else(|| name.clone(), |p| p.display().to_string());
                    return Err(ReplayError::ModuleChanged { module: what, expected: sha256.clone(), actual });
                }
                Ok(Job::Wasm { module, args: args.clone() })
            }
        }
    }

    /// The capabilities to replay with: the recorded env and grants (and no tools: their answers are recorded).
    pub fn caps(&self) -> Capabilities {
        Capabilities { grants: self.grants.clone(), env: self.env.clone(), ..Capabilities::default() }
    }
}

/// Where a replay stands in the recording.
#[derive(Default)]
struct ReplayState {
    wall: usize,
    monotonic: usize,
    random: usize,
    random_calls: u64,
    tools: usize,
    /// The first input the recording did not have, or a tool request that differed.
    diverged: Option<Divergence>,
}

/// Feeds a [`Recording`] back into a job and judges its outcome.
pub struct Replayer {
    recording: Recording,
    state: Mutex<ReplayState>,
}

impl fmt::Debug for Replayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Replayer").field("job", &self.recording.job).finish_non_exhaustive()
    }
}

impl Replayer {
    /// A replayer of `recording`.
    pub fn new(recording: Recording) -> Replayer {
        Replayer { recording, state: Mutex::new(ReplayState::default()) }
    }

    /// The recording.
    pub fn recording(&self) -> &Recording {
        &self.recording
    }

    fn diverge(state: &mut ReplayState, divergence: Divergence) {
        state.diverged.get_or_insert(divergence);
    }

    fn reading(&self, clock: Clock) -> Option<u64> {
        let mut state = lock(&self.state);
        let (readings, at) = match clock {
            Clock::Wall => (&self.recording.wall_clock_ns, state.wall),
            Clock::Monotonic => (&self.recording.monotonic_clock_ns, state.monotonic),
        };
        let value = readings.get(at).copied();
        match clock {
            Clock::Wall => state.wall += 1,
            Clock::Monotonic => state.monotonic += 1,
        }
        if value.is_none() {
            let input = match clock {
                Clock::Wall => Input::WallClock,
                Clock::Monotonic => Input::MonotonicClock,
            };
            Self::diverge(
                &mut state,
                Divergence::MissingInput { input, call: at as u64 + 1, recorded: readings.len() },
            );
        }
        value
    }

    fn random(&self, dst: &mut [u8]) -> bool {
        let mut state = lock(&self.state);
        state.random_calls += 1;
        let start = state.random;
        let end = start.saturating_add(dst.len());
        match self.recording.random.0.get(start..end) {
            Some(bytes) => {
                dst.copy_from_slice(bytes);
                state.random = end;
                true
            }
            None => {
                let call = state.random_calls;
                state.random = self.recording.random.0.len();
                let recorded = self.recording.random.0.len();
                Self::diverge(&mut state, Divergence::MissingInput { input: Input::RandomBytes, call, recorded });
                false
            }
        }
    }

    fn tool_answer(&self, request: &[u8]) -> ToolAnswer {
        let mut state = lock(&self.state);
        let at = state.tools;
        state.tools += 1;
        let call = at as u64 + 1;
        match self.recording.tool_exchanges.get(at) {
            Some(exchange) if exchange.request.0 == request => ToolAnswer::Recorded(exchange.answer.0.clone()),
            Some(exchange) => {
                let divergence = Divergence::ToolRequest {
                    call,
                    expected: escaped(&exchange.request.0, 0, 200),
                    actual: escaped(request, 0, 200),
                };
                let message = divergence.to_string();
                Self::diverge(&mut state, divergence);
                ToolAnswer::Missing(message)
            }
            None => {
                let recorded = self.recording.tool_exchanges.len();
                let divergence = Divergence::MissingInput { input: Input::ToolAnswer, call, recorded };
                let message = divergence.to_string();
                Self::diverge(&mut state, divergence);
                ToolAnswer::Missing(message)
            }
        }
    }

    /// Judges the replayed job's `outcome` against the recording: the first input it lacked, else the first
    /// differing byte of stdout then stderr, else another status, else inputs recorded but never read.
    pub fn verdict(&self, outcome: &Outcome) -> Result<(), Divergence> {
        let state = lock(&self.state);
        if let Some(divergence) = &state.diverged {
            return Err(divergence.clone());
        }
        let expected = &self.recording.expected;
        for (stream, want, got) in [
            (Stream::Stdout, &expected.stdout.0, &outcome.stdout),
            (Stream::Stderr, &expected.stderr.0, &outcome.stderr),
        ] {
            if let Some(offset) = first_difference(want, got) {
                return Err(Divergence::Output {
                    stream,
                    offset: offset as u64,
                    expected: escaped(want, offset, SHOWN_BYTES),
                    actual: escaped(got, offset, SHOWN_BYTES),
                });
            }
        }
        if outcome.status != expected.status {
            return Err(Divergence::Status { expected: expected.status.clone(), actual: outcome.status.clone() });
        }
        let r = &self.recording;
        for (input, used, recorded) in [
            (Input::WallClock, state.wall, r.wall_clock_ns.len()),
            (Input::MonotonicClock, state.monotonic, r.monotonic_clock_ns.len()),
            (Input::RandomBytes, state.random, r.random.0.len()),
            (Input::ToolAnswer, state.tools, r.tool_exchanges.len()),
        ] {
            if used < recorded {
                return Err(Divergence::Unused { input, used: used as u64, recorded: recorded as u64 });
            }
        }
        Ok(())
    }
}

/// The offset of the first byte where `a` and `b` differ (one ending before the other included).
fn first_difference(a: &[u8], b: &[u8]) -> Option<usize> {
    match a.iter().zip(b).position(|(x, y)| x != y) {
        Some(at) => Some(at),
        None if a.len() != b.len() => Some(a.len().min(b.len())),
        None => None,
    }
}

/// Up to `len` bytes of `bytes` from `offset`, escaped as a quoted ASCII string (`"<end>"` past the end).
fn escaped(bytes: &[u8], offset: usize, len: usize) -> String {
    let Some(rest) = bytes.get(offset..).filter(|rest| !rest.is_empty()) else { return "<end>".into() };
    let shown = &rest[..rest.len().min(len)];
    let more = if rest.len() > len { "..." } else { "" };
    format!("\"{}\"{more}", shown.escape_ascii())
}

/// An input a guest reads from the recording.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Input {
    /// A wall-clock reading.
    WallClock,
    /// A monotonic-clock reading.
    MonotonicClock,
    /// Random bytes.
    RandomBytes,
    /// A host tool's answer.
    ToolAnswer,
}

impl fmt::Display for Input {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Input::WallClock => "wall clock readings",
            Input::MonotonicClock => "monotonic clock readings",
            Input::RandomBytes => "random bytes",
            Input::ToolAnswer => "tool answers",
        })
    }
}

/// Where a replay first differed from its recording.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Divergence {
    /// The guest asked for more of an input than the recording has.
    #[error("the guest asked for more {input} than the recording has (at call #{call}; {recorded} recorded)")]
    MissingInput {
        /// Which input.
        input: Input,
        /// The guest's call that found none, from 1.
        call: u64,
        /// How many the recording has (bytes, for random bytes).
        recorded: usize,
    },
    /// A tool frame differs from the recorded one.
    #[error("tool call #{call} differs from the recording: it sent {actual}, the recording has {expected}")]
    ToolRequest {
        /// The call, from 1.
        call: u64,
        /// The recorded frame, escaped.
        expected: String,
        /// The frame sent, escaped.
        actual: String,
    },
    /// A stream differs.
    #[error("{} differs at byte {offset}: expected {expected}, got {actual}", stream_name(*.stream))]
    Output {
        /// Which stream.
        stream: Stream,
        /// The first differing byte's offset.
        offset: u64,
        /// The recording's bytes from there, escaped.
        expected: String,
        /// The replay's bytes from there, escaped.
        actual: String,
    },
    /// The job ended otherwise.
    #[error("the job ended with {actual}; the recording ended with {expected}")]
    Status {
        /// The recorded status.
        expected: Status,
        /// The replay's.
        actual: Status,
    },
    /// The guest read less of an input than was recorded.
    #[error("the guest read {used} of the {recorded} recorded {input}")]
    Unused {
        /// Which input.
        input: Input,
        /// How many it read.
        used: u64,
        /// How many were recorded.
        recorded: u64,
    },
}

fn stream_name(stream: Stream) -> &'static str {
    match stream {
        Stream::Stdout => "stdout",
        Stream::Stderr => "stderr",
    }
}

/// A parser's complaint as one line: what it quotes of the file (a field name, a string) is the file's, and may
/// hold line breaks or other control characters, which are escaped.
fn malformed(err: serde_json::Error) -> ReplayError {
    let mut line = String::new();
    for c in err.to_string().chars() {
        if c.is_control() {
            line.extend(c.escape_debug());
        } else {
            line.push(c);
        }
    }
    ReplayError::Malformed(line)
}

/// A recording that cannot be made, read or replayed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ReplayError {
    /// The file is over the size cap.
    #[error("the recording is {size} bytes; at most {max} are read")]
    TooLarge {
        /// Its size.
        size: u64,
        /// The cap.
        max: u64,
    },
    /// The file cannot be read.
    #[error("cannot read the recording {}: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The file cannot be written.
    #[error("cannot write the recording {}: {source}", path.display())]
    Write {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Not JSON, or not a recording's fields.
    #[error("the recording is malformed: {0}")]
    Malformed(String),
    /// Another format.
    #[error("not a Strata recording (format {0:?}, expected {FORMAT:?})")]
    Format(String),
    /// Another version.
    #[error("recording version {0} is not supported (this build reads version {VERSION})")]
    Version(u32),
    /// A list over its cap.
    #[error("the recording holds {count} {what}; at most {max}")]
    Bounds {
        /// What.
        what: &'static str,
        /// How many.
        count: usize,
        /// The cap.
        max: usize,
    },
    /// A value a replay cannot use.
    #[error("the recording is invalid: {0}")]
    Invalid(String),
    /// The recorded module file cannot be read.
    #[error("cannot read the module {}: {source}", path.display())]
    ReadModule {
        /// The module file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The module is not the one recorded.
    #[error("the module {module} changed since it was recorded (sha256 {actual}, recorded {expected})")]
    ModuleChanged {
        /// The module.
        module: String,
        /// The recorded sha256.
        expected: String,
        /// Its sha256 now.
        actual: String,
    },
    /// Secrets would be written into the recording.
    #[error("a job with secrets ({0}) cannot be recorded: the recording would hold their values")]
    Secrets(String),
    /// Network egress is not an input a recording holds.
    #[error("a job with network egress cannot be recorded or replayed")]
    Network,
    /// Only wasm modules and Python are recorded.
    #[error("{0} jobs cannot be recorded (only wasm modules and Python)")]
    JobKind(String),
    /// A stdin stream is not kept.
    #[error("a job reading a stdin stream cannot be recorded or replayed; give its stdin as bytes")]
    StreamedStdin,
    /// `finish` before any job started.
    #[error("the recorder recorded no job")]
    NothingRecorded,
}

impl ReplayError {
    /// A stable, machine-readable code.
    pub fn code(&self) -> &'static str {
        match self {
            ReplayError::TooLarge { .. }
            | ReplayError::Malformed(_)
            | ReplayError::Format(_)
            | ReplayError::Version(_)
            | ReplayError::Bounds { .. }
            | ReplayError::Invalid(_) => "invalid_recording",
            ReplayError::Read { .. } | ReplayError::ReadModule { .. } => "input_unreadable",
            ReplayError::Write { .. } => "storage",
            ReplayError::ModuleChanged { .. } => "module_changed",
            ReplayError::Secrets(_)
            | ReplayError::Network
            | ReplayError::JobKind(_)
            | ReplayError::StreamedStdin
            | ReplayError::NothingRecorded => "unsupported",
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

    use super::*;
    use crate::outcome::TierKind;

    fn python(code: &str) -> Job {
        Job::Python { source: PythonSource::Code(code.into()), args: vec!["a".into()] }
    }

    fn outcome(stdout: &[u8]) -> Outcome {
        Outcome { stdout: stdout.to_vec(), ..Outcome::new(TierKind::Wasm, Status::Exited { code: 0 }) }
    }

    fn recorded(seed: Option<u64>) -> Recording {
        let recorder = Arc::new(Recorder::new(seed));
        let inputs = Determinism::Record(recorder.clone())
            .start(&python("print(1)"), &Capabilities::default(), &Limits::default(), Some(b"in"), false)
            .unwrap();
        inputs.wall_clock_ns();
        inputs.monotonic_ns();
        let mut buf = [0u8; 8];
        inputs.fill_random(&mut buf);
        recorder.finish(&outcome(b"hello\n")).unwrap()
    }

    #[test]
    fn a_seed_gives_the_same_values_and_another_seed_others() {
        let values = |seed| {
            let inputs = Determinism::Seed(seed)
                .start(&python(""), &Capabilities::default(), &Limits::default(), None, false)
                .unwrap();
            let mut buf = [0u8; 16];
            inputs.fill_random(&mut buf);
            (inputs.wall_clock_ns(), inputs.wall_clock_ns(), inputs.monotonic_ns(), buf)
        };
        assert_eq!(values(7), values(7));
        assert_ne!(values(7).3, values(8).3);
        let (first, second, monotonic, _) = values(7);
        assert_eq!((second - first, monotonic), (CLOCK_STEP_NS, CLOCK_STEP_NS));
    }

    #[test]
    fn a_recording_round_trips_through_json_and_replays_identical() {
        let recording = recorded(Some(3));
        let parsed = Recording::from_slice(&recording.to_json()).unwrap();
        assert_eq!(parsed, recording);
        assert_eq!(parsed.stdin.0, b"in");
        let replayer = Arc::new(Replayer::new(parsed));
        let inputs = Determinism::Replay(replayer.clone())
            .start(&python("print(1)"), &Capabilities::default(), &Limits::default(), None, false)
            .unwrap();
        assert_eq!(inputs.wall_clock_ns(), recording.wall_clock_ns[0]);
        assert_eq!(inputs.monotonic_ns(), recording.monotonic_clock_ns[0]);
        let mut buf = [0u8; 8];
        inputs.fill_random(&mut buf);
        assert_eq!(&buf[..], &recording.random.0[..]);
        replayer.verdict(&outcome(b"hello\n")).unwrap();
        let diverged = replayer.verdict(&outcome(b"help\n")).unwrap_err();
        assert_eq!(diverged.to_string(), r#"stdout differs at byte 3: expected "lo\n", got "p\n""#);
    }

    #[test]
    fn asking_for_more_random_bytes_than_recorded_is_a_divergence() {
        let replayer = Arc::new(Replayer::new(recorded(None)));
        let inputs = Determinism::Replay(replayer.clone())
            .start(&python(""), &Capabilities::default(), &Limits::default(), None, false)
            .unwrap();
        let mut buf = [0u8; 16];
        inputs.fill_random(&mut buf);
        let diverged = replayer.verdict(&outcome(b"hello\n")).unwrap_err();
        assert!(matches!(diverged, Divergence::MissingInput { input: Input::RandomBytes, call: 1, recorded: 8 }));
        assert!(diverged.to_string().contains("asked for more random bytes"), "{diverged}");
    }

    #[test]
    fn malformed_and_oversized_recordings_are_typed_errors() {
        assert!(matches!(Recording::from_slice(b"{"), Err(ReplayError::Malformed(_))));
        // What the parser quotes of the file stays on one line (a fuzzer's finding: a field name with a newline).
        let bad = format!(r#"{{"format":"{FORMAT}","version":1,"a\nb":1}}"#);
        let quoted = Recording::from_slice(bad.as_bytes()).expect_err("malformed").to_string();
        assert!(!quoted.contains('\n') && quoted.contains("a\\nb"), "{quoted}");
        assert!(matches!(Recording::from_slice(br#"{"format":"x","version":1}"#), Err(ReplayError::Format(_))));
        let other = format!(r#"{{"format":"{FORMAT}","version":99}}"#);
        assert!(matches!(Recording::from_slice(other.as_bytes()), Err(ReplayError::Version(99))));
        let huge = vec![b' '; MAX_RECORDING_BYTES as usize + 1];
        assert!(matches!(Recording::from_slice(&huge), Err(ReplayError::TooLarge { .. })));
        let mut recording = recorded(None);
        recording.insecure_seed = "x".into();
        assert!(matches!(Recording::from_slice(&recording.to_json()), Err(ReplayError::Invalid(_))));
    }

    #[test]
    fn secrets_are_never_recorded() {
        let caps = Capabilities { secrets: vec!["K=v".parse().unwrap()], ..Capabilities::default() };
        let err = Determinism::Record(Arc::new(Recorder::new(None)))
            .start(&python(""), &caps, &Limits::default(), None, false)
            .unwrap_err();
        assert!(matches!(err, ReplayError::Secrets(_)), "{err}");
    }
}
