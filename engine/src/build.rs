//! Building an image from a Dockerfile ([`Engine::build_image`]): each step that changes the filesystem (`RUN`,
//! `COPY`/`ADD`, a `WORKDIR` that does not exist yet) runs in a process-tier jail on the layers made so far — the
//! same isolation as a job, network only through the allowlist the build is given — and what it changed (the
//! overlay's upper layer, whiteouts and opaque directories included) becomes the next layer in the image store.
//!
//! Every step has a key: a hash of its parent's key and of its inputs (the instruction after substitution, the
//! environment and build arguments it sees, the working directory and account, a copied file's path, mode and
//! sha256). A step whose key has a layer in the store is not run again ("cached"), so a rebuild after changing one
//! line runs from that line on. Steps that change only the image's defaults (`ENV`, `USER`, `CMD`, `ARG`) make no
//! layer; their effect is part of the keys after them. The finished image is recorded under its name only when
//! every step succeeded; a failed step names its line and ends with the command's status and the end of its
//! output.
//!
//! `COPY` writes through the jail's own file calls (the jail resolves the destination inside the image, links
//! included, and owns what it makes to the `--chown` account); a symbolic link in the sources is made by `ln -s`
//! in the jail. The build context is read on the host without following links out of it.

use std::collections::BTreeMap;
use std::fs;
use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::path::{Component, Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};
use strata_core::{
    Allowlist, ByteSize, Capabilities, ExecOptions, ImageName, Job, Limits, Net, OutputSink, Sandbox, Status, Stream,
    UserName,
};
use strata_image_store::dockerfile::{self, CommandForm, Dockerfile, Instruction};
use strata_image_store::{ImageConfig, ImageRecord, ImageSource, ImageStore, LayerKey, StoreError};
use strata_tier_process::{ProcessSandbox, RootImage};

use crate::{Engine, EngineError};

/// Names `FROM` accepts for Strata's Debian image (bookworm minbase with python3 and pip).
pub const DEBIAN_BASE_NAMES: &[&str] = &["strata-debian", "debian:bookworm", "debian:12"];

/// The largest file `COPY` takes.
const MAX_COPY_FILE: u64 = 1 << 30;
/// The most files one `COPY` takes.
const MAX_COPY_FILES: usize = 100_000;

/// What to build.
#[derive(Debug, Clone)]
pub struct BuildRequest {
    /// The Dockerfile's text.
    pub dockerfile: String,
    /// The directory `COPY` reads from.
    pub context: PathBuf,
    /// The image's name.
    pub name: ImageName,
    /// `--build-arg NAME=VALUE`.
    pub build_args: BTreeMap<String, String>,
    /// Hosts `RUN` steps may reach (through the egress proxy); empty: no network.
    pub allow_net: Vec<String>,
    /// Run every step, even those whose layer the store has.
    pub no_cache: bool,
    /// Each step's limits (memory, disk for what it writes, wall time…).
    pub limits: Limits,
}

impl BuildRequest {
    /// `dockerfile` built from `context` under `name`: no build arguments, no network, the layers the store has
    /// reused, [`BuildRequest::default_limits`].
    pub fn new(name: ImageName, context: impl Into<PathBuf>, dockerfile: impl Into<String>) -> BuildRequest {
        BuildRequest {
            dockerfile: dockerfile.into(),
            context: context.into(),
            name,
            build_args: BTreeMap::new(),
            allow_net: Vec::new(),
            no_cache: false,
            limits: BuildRequest::default_limits(),
        }
    }

    /// The limits a build step gets unless the caller says otherwise: 4 GiB of memory, 16 GiB of writable layer, an
    /// hour of wall and CPU time, 4096 processes, 1 MiB of output kept (all of it is streamed).
    pub fn default_limits() -> Limits {
        Limits {
            memory: ByteSize(4 << 30),
            disk: ByteSize(16 << 30),
            wall: Duration::from_secs(3600),
            cpu: Duration::from_secs(3600),
            pids: 4096,
            output: ByteSize(1 << 20),
            ..Limits::default()
        }
    }
}

/// One step of a build, as it went.
#[derive(Debug, Clone)]
pub struct StepReport {
    /// Its Dockerfile line.
    pub line: usize,
    /// The instruction, for people.
    pub text: String,
    /// Its layer was in the store.
    pub cached: bool,
    /// The layer it made or found (none for steps that change only defaults).
    pub layer: Option<LayerKey>,
    /// How long it took.
    pub elapsed: Duration,
}

/// A finished build.
#[derive(Debug, Clone)]
pub struct BuildReport {
    /// The image as recorded.
    pub image: ImageRecord,
    /// Its steps.
    pub steps: Vec<StepReport>,
}

/// Why a build failed.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    /// The Dockerfile is refused.
    #[error(transparent)]
    Dockerfile(#[from] dockerfile::DockerfileError),
    /// An instruction's value is wrong (a bad substitution, path or name).
    #[error("Dockerfile line {line}: {message}")]
    Invalid {
        /// Its line.
        line: usize,
        /// What is wrong.
        message: String,
    },
    /// A `COPY` source is missing or not allowed.
    #[error("Dockerfile line {line}: COPY {path:?}: {message}")]
    Context {
        /// Its line.
        line: usize,
        /// The source.
        path: String,
        /// What is wrong.
        message: String,
    },
    /// A `RUN` failed.
    #[error("Dockerfile line {line}: `{command}` {status}{}", tail(.output))]
    StepFailed {
        /// Its line.
        line: usize,
        /// The command.
        command: String,
        /// How it ended.
        status: String,
        /// The end of its output.
        output: String,
    },
    /// The image store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The process tier failed (or is unavailable).
    #[error("Dockerfile line {line}: {source}")]
    Engine {
        /// Its line (0: before the first step).
        line: usize,
        /// The error.
        source: Box<EngineError>,
    },
}

fn tail(output: &str) -> String {
    if output.trim().is_empty() { String::new() } else { format!(":\n{}", output.trim_end()) }
}

/// Streams a step's output as progress lines and keeps its end for an error.
struct StepOutput {
    say: Box<dyn Fn(&str) + Send + Sync>,
    state: Mutex<(Vec<u8>, Vec<u8>)>,
}

impl OutputSink for StepOutput {
    fn output(&self, _stream: Stream, chunk: &[u8]) {
        let mut state = strata_core::sync::lock(&self.state);
        let (pending, kept) = &mut *state;
        pending.extend_from_slice(chunk);
        while let Some(end) = pending.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = pending.drain(..=end).collect();
            (self.say)(&format!("  | {}", String::from_utf8_lossy(&line[..line.len() - 1])));
        }
        kept.extend_from_slice(chunk);
        if kept.len() > 8192 {
            let cut = kept.len() - 4096;
            kept.drain(..cut);
        }
    }
}

/// A filesystem step: its key, its network, and whom its files belong to (`None`: the image's account).
struct Step<'n> {
    key: LayerKey,
    net: &'n Net,
    owner: Option<UserName>,
}

/// The state a build carries from step to step.
struct Stage {
    base: Option<String>,
    layers: Vec<LayerKey>,
    config: ImageConfig,
    chain: LayerKey,
    args: BTreeMap<String, String>,
}

impl Stage {
    fn vars(&self) -> BTreeMap<String, String> {
        let mut vars = self.args.clone();
        vars.extend(self.config.env.iter().cloned());
        vars
    }

    fn advance(&mut self, parts: &[&[u8]]) {
        let mut all: Vec<&[u8]> = vec![self.chain.as_str().as_bytes()];
        all.extend_from_slice(parts);
        self.chain = LayerKey::of(&all);
    }

    fn workdir(&self) -> String {
        self.config.workdir.clone().unwrap_or_else(|| "/".into())
    }
}

impl Engine {
    /// The image store under this engine's home.
    pub fn image_store(&self) -> Result<ImageStore, EngineError> {
        let home = self.config.home.as_deref().ok_or(EngineError::NoHome("images"))?;
        ImageStore::open(home).map_err(|e| EngineError::Image(e.to_string()))
    }

    /// Builds `request` into the image store (see [`crate::build`]), saying what it does through `say`.
    pub fn build_image(&self, request: &BuildRequest, say: &dyn Fn(&str)) -> Result<BuildReport, BuildError> {
        let file = dockerfile::parse(&request.dockerfile)?;
        let store = self.image_store().map_err(|e| BuildError::Engine { line: 0, source: Box::new(e) })?;
        let tier = self.process().map_err(|e| BuildError::Engine { line: 0, source: Box::new(e) })?;
        let mut stage = self.stage_from(&file, request, &store, tier.rootfs())?;
        let allow = Allowlist::parse(&request.allow_net)
            .map_err(|e| BuildError::Invalid { line: 0, message: e.to_string() })?;
        let net = if request.allow_net.is_empty() { Net::Deny } else { Net::Allow(allow) };
        let total = file.instructions.len();
        let mut steps = Vec::with_capacity(total);
        for (index, (line, instruction)) in file.instructions.iter().enumerate() {
            let line = *line;
            let started = Instant::now();
            let invalid = |message: String| BuildError::Invalid { line, message };
            let vars = stage.vars();
            let expand = |text: &str| dockerfile::expand(text, &vars).map_err(invalid);
            let mut report =
                StepReport { line, text: describe(instruction), cached: false, layer: None, elapsed: Duration::ZERO };
            say(&format!("step {}/{total}: {}", index + 1, report.text));
            match instruction {
                Instruction::Env(pairs) => {
                    for (name, value) in pairs {
                        let value = expand(value)?;
                        stage.config.set_env(name, &value);
                        stage.advance(&[b"ENV", name.as_bytes(), value.as_bytes()]);
                    }
                }
                Instruction::Arg { name, default } => {
                    let value = match (request.build_args.get(name), default) {
                        (Some(value), _) => Some(value.clone()),
                        (None, Some(default)) => Some(expand(default)?),
                        (None, None) => None,
                    };
                    if let Some(value) = value {
                        stage.advance(&[b"ARG", name.as_bytes(), value.as_bytes()]);
                        stage.args.insert(name.clone(), value);
                    }
                }
                Instruction::User(user) => {
                    let user = expand(user)?;
                    let name = user.split(':').next().unwrap_or_default().to_owned();
                    UserName::new(&name).map_err(|e| invalid(format!("USER: {e} (numeric IDs are not supported)")))?;
                    stage.config.user = Some(name.clone());
                    stage.advance(&[b"USER", name.as_bytes()]);
                }
                Instruction::Cmd(command) => {
                    stage.config.cmd = Some(command.argv());
                    stage.advance(&[b"CMD", serde_json::to_string(&command.argv()).unwrap_or_default().as_bytes()]);
                }
                Instruction::Metadata(_) => {}
                Instruction::Workdir(dir) => {
                    let dir = absolute(&stage.workdir(), &expand(dir)?).map_err(invalid)?;
                    // Made (as root, as Docker does) from the directory before it, which exists.
                    let argv = vec!["mkdir".to_owned(), "-p".to_owned(), dir.clone()];
                    let key = self.step_key(&stage, b"WORKDIR", &[dir.as_bytes()]);
                    let step = Step { key, net: &Net::Deny, owner: Some(UserName::root()) };
                    self.run_step(&store, tier, &mut stage, &mut report, request, step, say, |sandbox| {
                        exec(sandbox, &argv, line, &request.limits, say)
                    })?;
                    stage.config.workdir = Some(dir.clone());
                    stage.advance(&[b"WORKDIR", dir.as_bytes()]);
                }
                Instruction::Run(command) => {
                    let argv = command.argv();
                    let argv_json = serde_json::to_string(&argv).unwrap_or_default();
                    let key = self.step_key(&stage, b"RUN", &[argv_json.as_bytes()]);
                    let step = Step { key, net: &net, owner: None };
                    self.run_step(&store, tier, &mut stage, &mut report, request, step, say, |sandbox| {
                        exec(sandbox, &argv, line, &request.limits, say)
                    })?;
                }
                Instruction::Copy { sources, dest, chown, chmod } => {
                    let dest = expand(dest)?;
                    let sources: Vec<String> = sources.iter().map(|s| expand(s)).collect::<Result<_, _>>()?;
                    let chown = chown.as_deref().map(expand).transpose()?;
                    let owner = match &chown {
                        Some(owner) => {
                            let name = owner.split(':').next().unwrap_or_default();
                            UserName::new(name).map_err(|e| invalid(format!("--chown: {e}")))?
                        }
                        None => UserName::root(),
                    };
                    let plan = CopyPlan::new(&request.context, &sources, &stage.workdir(), &dest, *chmod, line)?;
                    let mut parts: Vec<Vec<u8>> =
                        vec![dest.clone().into_bytes(), format!("{chown:?} {chmod:?}").into_bytes()];
                    parts.extend(plan.key_parts());
                    let parts: Vec<&[u8]> = parts.iter().map(Vec::as_slice).collect();
                    let key = self.step_key(&stage, b"COPY", &parts);
                    let step = Step { key, net: &Net::Deny, owner: Some(owner) };
                    self.run_step(&store, tier, &mut stage, &mut report, request, step, say, |sandbox| {
                        plan.apply(sandbox, line, say)
                    })?;
                }
            }
            report.elapsed = started.elapsed();
            if report.cached {
                say("  (cached)");
            } else if report.layer.is_some() {
                say(&format!("  done in {:.1} s", report.elapsed.as_secs_f64()));
            }
            steps.push(report);
        }
        stage.config.start = file.start.clone().or(stage.config.start.take());
        stage.config.ready = file.ready.clone().or(stage.config.ready.take());
        let image = ImageRecord {
            name: request.name.clone(),
            base: stage.base,
            layers: stage.layers,
            config: stage.config,
            source: ImageSource::Dockerfile {
                sha256: strata_image_util::hex(&Sha256::digest(request.dockerfile.as_bytes())),
            },
            created: strata_image_util::rfc3339_now(),
        };
        store.put(&image)?;
        Ok(BuildReport { image, steps })
    }

    fn stage_from(
        &self,
        file: &Dockerfile,
        request: &BuildRequest,
        store: &ImageStore,
        rootfs: &Path,
    ) -> Result<Stage, BuildError> {
        let mut args = BTreeMap::new();
        for (name, default) in &file.pre_from_args {
            if let Some(value) = request.build_args.get(name).cloned().or_else(|| default.clone()) {
                args.insert(name.clone(), value);
            }
        }
        let from = dockerfile::expand(&file.from, &args).map_err(|message| BuildError::Invalid { line: 1, message })?;
        if DEBIAN_BASE_NAMES.contains(&from.as_str()) {
            let base = rootfs
                .parent()
                .and_then(Path::file_name)
                .and_then(|name| name.to_str())
                .map(str::to_owned)
                .ok_or_else(|| BuildError::Invalid {
                    line: 1,
                    message: format!("the Debian image at {}", rootfs.display()),
                })?;
            let chain = LayerKey::of(&[b"FROM", base.as_bytes()]);
            return Ok(Stage {
                base: Some(base),
                layers: Vec::new(),
                config: ImageConfig::default(),
                chain,
                args: BTreeMap::new(),
            });
        }
        let name = ImageName::new(from.clone()).map_err(|_| BuildError::Invalid {
            line: 1,
            message: format!(
                "FROM {from:?}: not an image here (the Debian base is {}; others are built or imported first — no \
                 registry is reached)",
                DEBIAN_BASE_NAMES.join(", ")
            ),
        })?;
        let parent = store.get(&name)?;
        store.resolve_record(&parent)?;
        let mut parts: Vec<&[u8]> = vec![b"FROM", parent.base.as_deref().unwrap_or_default().as_bytes()];
        parts.extend(parent.layers.iter().map(|k| k.as_str().as_bytes()));
        let config_json = serde_json::to_string(&parent.config).unwrap_or_default();
        parts.push(config_json.as_bytes());
        let chain = LayerKey::of(&parts);
        Ok(Stage { base: parent.base, layers: parent.layers, config: parent.config, chain, args: BTreeMap::new() })
    }

    /// A filesystem step's key: the chain so far, the instruction's inputs, and what the step's process sees.
    fn step_key(&self, stage: &Stage, kind: &[u8], inputs: &[&[u8]]) -> LayerKey {
        let seen = serde_json::to_string(&(&stage.config.env, &stage.args, &stage.config.workdir, &stage.config.user))
            .unwrap_or_default();
        let mut parts: Vec<&[u8]> = vec![stage.chain.as_str().as_bytes(), kind];
        parts.extend_from_slice(inputs);
        parts.push(seen.as_bytes());
        LayerKey::of(&parts)
    }

    /// Runs one filesystem step (or finds its layer) and adds its layer to the stage.
    #[allow(clippy::too_many_arguments)]
    fn run_step(
        &self,
        store: &ImageStore,
        tier: &strata_tier_process::ProcessTier,
        stage: &mut Stage,
        report: &mut StepReport,
        request: &BuildRequest,
        step: Step<'_>,
        say: &dyn Fn(&str),
        work: impl FnOnce(&ProcessSandbox) -> Result<(), BuildError>,
    ) -> Result<(), BuildError> {
        let line = report.line;
        let Step { mut key, net, owner } = step;
        if request.no_cache {
            // A layer of its own, whatever the store holds: the one it replaces stays until a prune.
            let nonce = format!("{:?} {}", std::time::SystemTime::now(), std::process::id());
            key = LayerKey::of(&[key.as_str().as_bytes(), nonce.as_bytes()]);
        }
        if store.layer(&key).is_some() {
            report.cached = true;
        } else {
            let mut lowers: Vec<PathBuf> = Vec::new();
            for layer in stage.layers.iter().rev() {
                let (tree, _) = store.layer(layer).ok_or_else(|| StoreError::Missing {
                    image: request.name.to_string(),
                    what: format!("layer {layer}"),
                })?;
                lowers.push(tree);
            }
            if let Some(base) = &stage.base {
                lowers.push(store.base_dir(base)?);
            }
            let mut config = stage.config.clone();
            for (name, value) in &stage.args {
                if !config.env.iter().any(|(n, _)| n == name) {
                    config.env.push((name.clone(), value.clone()));
                }
            }
            let caps = Capabilities { net: net.clone(), user: owner, ..Capabilities::default() };
            let engine_error = |e: strata_core::TierError| BuildError::Engine { line, source: Box::new(e.into()) };
            let sandbox = tier.start_on(RootImage { lowers, config }, &caps, &request.limits).map_err(engine_error)?;
            let result = work(&sandbox).and_then(|()| {
                store.add_layer(&key, &report.text, |tree| {
                    capture(&sandbox, tree).map_err(|message| BuildError::Invalid { line, message })
                })
            });
            let _ = sandbox.close();
            let record = result?;
            say(&format!("  layer {} ({})", &key.as_str()[..12], megabytes(record.size_bytes)));
        }
        stage.layers.push(key.clone());
        stage.chain = key.clone();
        report.layer = Some(key);
        Ok(())
    }
}

fn megabytes(bytes: u64) -> String {
    format!("{:.1} MB", bytes as f64 / 1e6)
}

/// Writes the sandbox's upper layer into `tree` (an empty host directory of the store), then removes what the
/// jail itself made there (`/run/strata`).
fn capture(sandbox: &ProcessSandbox, tree: &Path) -> Result<(), String> {
    let (reader, mut writer) = std::io::pipe().map_err(|e| format!("a pipe: {e}"))?;
    let root = fs::File::open(tree).map_err(|e| format!("opening {}: {e}", tree.display()))?;
    std::thread::scope(|scope| {
        let extract = scope.spawn(move || {
            let input = std::io::BufReader::with_capacity(256 * 1024, reader);
            strata_jail::tree::extract_tree(input, std::os::fd::AsFd::as_fd(&root), None).map_err(|e| e.to_string())
        });
        let written = sandbox.write_upper(&mut writer).map_err(|e| e.to_string());
        drop(writer);
        let extracted = extract.join().map_err(|_| "the layer's extraction panicked".to_owned())?;
        written?;
        extracted.map(|_| ())
    })?;
    let jail_own = tree.join("run/strata");
    if jail_own.exists() {
        fs::remove_dir_all(&jail_own).map_err(|e| format!("removing {}: {e}", jail_own.display()))?;
    }
    Ok(())
}

/// Runs `argv` in the step's sandbox, its output streamed through `say`.
fn exec(
    sandbox: &ProcessSandbox,
    argv: &[String],
    line: usize,
    limits: &Limits,
    say: &dyn Fn(&str),
) -> Result<(), BuildError> {
    let (sender, receiver) = std::sync::mpsc::channel::<String>();
    let sink = Arc::new(StepOutput {
        say: Box::new(move |text| {
            let _ = sender.send(text.to_owned());
        }),
        state: Mutex::new((Vec::new(), Vec::new())),
    });
    let opts = ExecOptions { sink: Some(sink.clone()), limits: Some(limits.clone()), ..ExecOptions::default() };
    let job = Job::Command { argv: argv.to_vec() };
    let outcome = std::thread::scope(|scope| {
        let running = scope.spawn(|| sandbox.exec(&job, opts));
        loop {
            match receiver.recv_timeout(Duration::from_millis(50)) {
                Ok(text) => say(&text),
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) if !running.is_finished() => {}
                Err(_) => break,
            }
        }
        while let Ok(text) = receiver.try_recv() {
            say(&text);
        }
        running.join()
    });
    let outcome = outcome
        .map_err(|_| BuildError::Invalid { line, message: "the step's thread panicked".into() })?
        .map_err(|e| BuildError::Engine { line, source: Box::new(e.into()) })?;
    if outcome.status == (Status::Exited { code: 0 }) {
        return Ok(());
    }
    let kept = strata_core::sync::lock(&sink.state).1.clone();
    Err(BuildError::StepFailed {
        line,
        command: argv.join(" "),
        status: outcome.status.to_string(),
        output: String::from_utf8_lossy(&kept).into_owned(),
    })
}

/// `path` made absolute against `workdir` and normalised (`..` may not climb above `/`).
fn absolute(workdir: &str, path: &str) -> Result<String, String> {
    let joined = if path.starts_with('/') { PathBuf::from(path) } else { Path::new(workdir).join(path) };
    let mut parts: Vec<String> = Vec::new();
    for component in joined.components() {
        match component {
            Component::Normal(name) => parts.push(name.to_string_lossy().into_owned()),
            Component::ParentDir => {
                parts.pop();
            }
            _ => {}
        }
    }
    Ok(format!("/{}", parts.join("/")))
}

fn describe(instruction: &Instruction) -> String {
    let text = match instruction {
        Instruction::Run(CommandForm::Shell(line)) => format!("RUN {line}"),
        Instruction::Run(CommandForm::Exec(argv)) => format!("RUN {argv:?}"),
        Instruction::Copy { sources, dest, .. } => format!("COPY {} {dest}", sources.join(" ")),
        Instruction::Env(pairs) => {
            format!("ENV {}", pairs.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(" "))
        }
        Instruction::Workdir(dir) => format!("WORKDIR {dir}"),
        Instruction::User(user) => format!("USER {user}"),
        Instruction::Arg { name, .. } => format!("ARG {name}"),
        Instruction::Cmd(command) => format!("CMD {:?}", command.argv()),
        Instruction::Metadata(keyword) => keyword.clone(),
    };
    let mut short: String = text.chars().take(120).collect();
    if short.len() < text.len() {
        short.push('…');
    }
    short
}

/// One thing a `COPY` puts into the image.
#[derive(Debug)]
enum CopyItem {
    File { host: PathBuf, guest: String, mode: u32, sha256: String },
    Dir { guest: String },
    Link { guest: String, target: String },
}

/// What a `COPY` takes from the context and where it puts it.
#[derive(Debug)]
struct CopyPlan {
    items: Vec<CopyItem>,
    chmod: Option<u32>,
}

impl CopyPlan {
    fn new(
        context: &Path,
        sources: &[String],
        workdir: &str,
        dest: &str,
        chmod: Option<u32>,
        line: usize,
    ) -> Result<CopyPlan, BuildError> {
        let context = context.canonicalize().map_err(|e| BuildError::Context {
            line,
            path: context.display().to_string(),
            message: format!("the build context: {e}"),
        })?;
        let dest_abs = absolute(workdir, dest).map_err(|message| BuildError::Invalid { line, message })?;
        let mut matched: Vec<(String, PathBuf)> = Vec::new();
        for source in sources {
            let error = |message: String| BuildError::Context { line, path: source.clone(), message };
            let rel = context_relative(source).map_err(error)?;
            let found = glob(&context, &rel).map_err(error)?;
            if found.is_empty() {
                return Err(error("no such file in the build context".into()));
            }
            matched.extend(found.into_iter().map(|path| (source.clone(), path)));
        }
        let into_dir = dest.ends_with('/') || matched.len() > 1 || matched.iter().any(|(_, p)| p.is_dir());
        let mut items = Vec::new();
        for (source, host) in matched {
            let error = |message: String| BuildError::Context { line, path: source.clone(), message };
            let meta = fs::symlink_metadata(&host).map_err(|e| error(e.to_string()))?;
            if meta.is_dir() {
                items.push(CopyItem::Dir { guest: dest_abs.clone() });
                walk(&host, &dest_abs, &mut items).map_err(error)?;
            } else {
                let name = host.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
                let guest =
                    if into_dir { format!("{}/{name}", dest_abs.trim_end_matches('/')) } else { dest_abs.clone() };
                items.push(item(&host, guest, &meta).map_err(error)?);
            }
            if items.len() > MAX_COPY_FILES {
                return Err(error(format!("more than {MAX_COPY_FILES} files")));
            }
        }
        Ok(CopyPlan { items, chmod })
    }

    fn key_parts(&self) -> Vec<Vec<u8>> {
        self.items
            .iter()
            .map(|item| match item {
                CopyItem::File { guest, mode, sha256, .. } => format!("F {guest} {mode:o} {sha256}").into_bytes(),
                CopyItem::Dir { guest } => format!("D {guest}").into_bytes(),
                CopyItem::Link { guest, target } => format!("L {guest} {target}").into_bytes(),
            })
            .collect()
    }

    fn apply(&self, sandbox: &ProcessSandbox, line: usize, say: &dyn Fn(&str)) -> Result<(), BuildError> {
        let tier_error = |e: strata_core::TierError| BuildError::Engine { line, source: Box::new(e.into()) };
        let mut links = Vec::new();
        for item in &self.items {
            match item {
                CopyItem::Dir { guest } => {
                    let path = strata_core::GuestPath::new(guest)
                        .map_err(|e| BuildError::Invalid { line, message: e.to_string() })?;
                    sandbox.make_dir(&path).map_err(tier_error)?;
                }
                CopyItem::File { host, guest, mode, .. } => {
                    let mut contents = Vec::new();
                    fs::File::open(host)
                        .and_then(|file| file.take(MAX_COPY_FILE + 1).read_to_end(&mut contents))
                        .map_err(|e| BuildError::Context {
                            line,
                            path: host.display().to_string(),
                            message: e.to_string(),
                        })?;
                    sandbox.write_file_mode(guest, &contents, self.chmod.unwrap_or(*mode)).map_err(tier_error)?;
                }
                CopyItem::Link { guest, target } => links.push((guest.clone(), target.clone())),
            }
        }
        // Links are made by the jail root's `ln` (a link's owner means nothing to the kernel's permission checks).
        for (guest, target) in links {
            exec(sandbox, &["ln".into(), "-sfn".into(), target, guest], line, &Limits::default(), say)?;
        }
        Ok(())
    }
}

/// A `COPY` source as a path inside the context: a leading `/` is the context's root; `..` may not leave it.
fn context_relative(source: &str) -> Result<PathBuf, String> {
    let mut parts = PathBuf::new();
    for component in Path::new(source).components() {
        match component {
            Component::Normal(name) => parts.push(name),
            Component::ParentDir if !parts.pop() => return Err("leaves the build context".into()),
            _ => {}
        }
    }
    Ok(parts)
}

/// The context's paths matching `rel`, whose last component may hold `*` and `?`; never through a link.
fn glob(context: &Path, rel: &Path) -> Result<Vec<PathBuf>, String> {
    let (parent, pattern) = match (rel.parent(), rel.file_name()) {
        (Some(parent), Some(name)) => (parent.to_owned(), name.to_string_lossy().into_owned()),
        _ => return Ok(vec![context.to_owned()]),
    };
    let mut dir = context.to_owned();
    for component in parent.components() {
        dir.push(component);
        let meta = fs::symlink_metadata(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        if !meta.is_dir() {
            return Err(format!("{} is not a directory of the context (links are not followed)", dir.display()));
        }
    }
    if !pattern.contains(['*', '?']) {
        let path = dir.join(&pattern);
        return Ok(if fs::symlink_metadata(&path).is_ok() { vec![path] } else { Vec::new() });
    }
    let mut found = Vec::new();
    for entry in fs::read_dir(&dir).map_err(|e| format!("{}: {e}", dir.display()))? {
        let entry = entry.map_err(|e| e.to_string())?;
        if wildcard(&pattern, &entry.file_name().to_string_lossy()) {
            found.push(entry.path());
        }
    }
    found.sort();
    Ok(found)
}

fn wildcard(pattern: &str, name: &str) -> bool {
    fn go(p: &[char], n: &[char]) -> bool {
        match (p.first(), n.first()) {
            (None, None) => true,
            (Some('*'), _) => go(&p[1..], n) || (!n.is_empty() && go(p, &n[1..])),
            (Some('?'), Some(_)) => go(&p[1..], &n[1..]),
            (Some(a), Some(b)) if a == b => go(&p[1..], &n[1..]),
            _ => false,
        }
    }
    let (p, n): (Vec<char>, Vec<char>) = (pattern.chars().collect(), name.chars().collect());
    go(&p, &n)
}

fn item(host: &Path, guest: String, meta: &fs::Metadata) -> Result<CopyItem, String> {
    if meta.file_type().is_symlink() {
        let target = fs::read_link(host).map_err(|e| e.to_string())?;
        return Ok(CopyItem::Link { guest, target: target.to_string_lossy().into_owned() });
    }
    if !meta.is_file() {
        return Err(format!("{} is not a regular file, directory or link", host.display()));
    }
    if meta.len() > MAX_COPY_FILE {
        return Err(format!("{} is larger than {MAX_COPY_FILE} bytes", host.display()));
    }
    let sha256 = strata_image_util::sha256_file(host).map_err(|e| e.to_string())?;
    Ok(CopyItem::File { host: host.to_owned(), guest, mode: meta.permissions().mode() & 0o777, sha256 })
}

fn walk(dir: &Path, guest: &str, items: &mut Vec<CopyItem>) -> Result<(), String> {
    let mut entries: Vec<_> = fs::read_dir(dir)
        .map_err(|e| format!("{}: {e}", dir.display()))?
        .collect::<Result<_, _>>()
        .map_err(|e| e.to_string())?;
    entries.sort_by_key(|e| e.file_name());
    for entry in entries {
        if items.len() > MAX_COPY_FILES {
            return Err(format!("more than {MAX_COPY_FILES} files"));
        }
        let host = entry.path();
        let name = entry.file_name().to_string_lossy().into_owned();
        let guest = format!("{}/{name}", guest.trim_end_matches('/'));
        let meta = fs::symlink_metadata(&host).map_err(|e| e.to_string())?;
        if meta.is_dir() {
            items.push(CopyItem::Dir { guest: guest.clone() });
            walk(&host, &guest, items)?;
        } else {
            items.push(item(&host, guest, &meta)?);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_and_wildcards() {
        assert_eq!(absolute("/opt", "a/../b").expect("x"), "/opt/b");
        assert_eq!(absolute("/opt", "/../../x").expect("x"), "/x");
        assert!(context_relative("../x").is_err());
        assert_eq!(context_relative("/a/./b").expect("x"), PathBuf::from("a/b"));
        assert!(wildcard("*.deb", "x_1.0_all.deb"));
        assert!(!wildcard("*.deb", "x.whl"));
        assert!(wildcard("a?c", "abc"));
    }
}
