//! What to run.

use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;

/// A job: what to run, independent of where it runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Job {
    /// A WebAssembly module (WASI preview1 command) or component (WASI preview2 command).
    Wasm {
        /// The module.
        module: ModuleSource,
        /// Arguments after the program name (`argv[1..]`).
        args: Vec<String>,
    },
    /// Python source.
    Python {
        /// What to run.
        source: PythonSource,
        /// Arguments after the script name (`sys.argv[1..]`).
        args: Vec<String>,
    },
    /// An ELF file from the host, copied into the guest.
    Native {
        /// The program on the host.
        program: PathBuf,
        /// Arguments after the program name.
        args: Vec<String>,
    },
    /// A program already in the guest image.
    Command {
        /// The full argument vector, program first.
        argv: Vec<String>,
    },
}

impl Job {
    /// A WebAssembly job from a file.
    pub fn wasm_file(path: impl Into<PathBuf>, args: Vec<String>) -> Job {
        Job::Wasm { module: ModuleSource::File(path.into()), args }
    }

    /// What kind of job this is, for messages.
    pub fn kind(&self) -> JobKind {
        match self {
            Job::Wasm { .. } => JobKind::Wasm,
            Job::Python { .. } => JobKind::Python,
            Job::Native { .. } => JobKind::Native,
            Job::Command { .. } => JobKind::Command,
        }
    }
}

/// The kind of a [`Job`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum JobKind {
    /// [`Job::Wasm`].
    Wasm,
    /// [`Job::Python`].
    Python,
    /// [`Job::Native`].
    Native,
    /// [`Job::Command`].
    Command,
}

impl fmt::Display for JobKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            JobKind::Wasm => "WebAssembly",
            JobKind::Python => "Python",
            JobKind::Native => "native",
            JobKind::Command => "command",
        })
    }
}

/// Where a WebAssembly module comes from.
#[derive(Clone, PartialEq, Eq)]
pub enum ModuleSource {
    /// A `.wasm` file on the host.
    File(PathBuf),
    /// Module bytes held by the embedder; `name` is the guest's `argv[0]`.
    Bytes {
        /// Program name shown to the guest.
        name: String,
        /// The module's binary encoding.
        bytes: Arc<[u8]>,
    },
}

impl ModuleSource {
    /// The name the guest sees as `argv[0]`: the file name, or the given name.
    pub fn program_name(&self) -> String {
        match self {
            ModuleSource::File(path) => {
                path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| path.display().to_string())
            }
            ModuleSource::Bytes { name, .. } => name.clone(),
        }
    }
}

impl fmt::Debug for ModuleSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ModuleSource::File(path) => f.debug_tuple("File").field(path).finish(),
            ModuleSource::Bytes { name, bytes } => {
                f.debug_struct("Bytes").field("name", name).field("len", &bytes.len()).finish()
            }
        }
    }
}

/// What Python runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PythonSource {
    /// `python -c CODE`.
    Code(String),
    /// `python FILE`.
    File(PathBuf),
    /// `python -m MODULE`.
    Module(String),
}
