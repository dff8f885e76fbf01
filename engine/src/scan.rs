//! Routing Python by content (docs/DESIGN.md §2, routing and escalation): a static scan of a job's imports, parsed with ruff's Python
//! parser, judged against what the wasm build of CPython has and can do.
//!
//! **What the scan finds.** `import a.b [as c]`, `from a import b [as c]`, `__import__("a")` and
//! `importlib.import_module("a")` with a literal name, wherever they are (module level, function bodies, `if`,
//! `with`, `try`), and attribute uses that resolve through those imports (`threading.Thread`, `cf.ProcessPoolExecutor`
//! after `import concurrent.futures as cf`, `os.fork`). Names are resolved flow-insensitively over the whole file:
//! a name bound by any import statement is taken to mean that module everywhere. Relative imports (`from . import
//! x`, `import_module(".x", pkg)`) name the job's own files and are ignored, as are imports under `if
//! TYPE_CHECKING:` (never executed).
//!
//! **Optional imports.** An import inside the body of a `try:` whose handlers catch `ImportError` (or
//! `ModuleNotFoundError`, `Exception`, `BaseException`, a bare `except:`) is *optional*: the script copes with the
//! module missing, so a module absent from the wasm build does not send it native. Optional or not, a module the
//! wasm build *has* but cannot use ([`NEEDS_NATIVE`]: `subprocess`, `multiprocessing`…) still does: it imports
//! fine there and fails only when used, so the `except ImportError` fallback never runs.
//!
//! **What wasm has.** [`WasmModules`] is generated from the installed runtime, never written by hand: the
//! top-level names in its stdlib zip (the stdlib and every bundled package) and `sys.builtin_module_names` of the
//! wasm interpreter itself (asked once), cached in a file beside the runtime keyed by the interpreter's digest.
//!
//! **A file that does not parse** stays on wasm: the interpreter there reports the `SyntaxError` with its real
//! traceback, which is what the user needs; a native tier would say the same thing more slowly.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::fmt::Write as _;
use std::io::{Read, Seek};
use std::path::{Path, PathBuf};

use ruff_python_ast::visitor::{self, Visitor};
use ruff_python_ast::{ExceptHandler, Expr, Stmt};
use ruff_text_size::Ranged;
use strata_core::PythonSource;

/// Why a module or name the wasm build has still cannot work there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Need {
    /// Starting or managing processes: WASI has none (`OSError: [Errno 58] wasi does not support processes`).
    Processes,
    /// Starting a thread: the wasm build has no threads (`RuntimeError: can't start new thread`).
    Threads,
    /// Opening sockets: the wasm build's `_socket` refuses (`OSError: [Errno 58] Not supported`).
    Sockets,
    /// TLS: `_ssl` is not in the wasm build.
    Tls,
    /// Loading native code: `ctypes` says "ctypes is unavailable on wasm32-wasi".
    NativeCode,
    /// Memory-mapping files: "mmap is unavailable on wasm32-wasi".
    MemoryMapping,
    /// A terminal: `termios` and `_curses` are not in the wasm build.
    Terminal,
    /// POSIX timer signals: `signal.alarm`, `signal.setitimer` do not exist there.
    Signals,
}

impl Need {
    /// The phrase used in route reasons: `"needs processes"`.
    pub fn as_str(self) -> &'static str {
        match self {
            Need::Processes => "needs processes",
            Need::Threads => "needs threads",
            Need::Sockets => "needs sockets",
            Need::Tls => "needs TLS",
            Need::NativeCode => "needs native code loading",
            Need::MemoryMapping => "needs mmap",
            Need::Terminal => "needs a terminal",
            Need::Signals => "needs timer signals",
        }
    }
}

/// A module or attribute the wasm build has (it imports) but that cannot work in WASI.
#[derive(Debug, Clone, Copy)]
pub struct NativeOnly {
    /// The dotted name: a module (`subprocess`, which covers its submodules) or a module attribute
    /// (`threading.Thread`, matched when imported by name or used through the module).
    pub name: &'static str,
    /// What it needs.
    pub need: Need,
    /// A Python statement that shows the failure on the wasm tier (it raises there); the integration tests run
    /// every probe on wasm, so an entry that starts working there is noticed.
    pub probe: &'static str,
}

/// What the wasm build imports but cannot run, each with the probe that shows it (see [`NativeOnly::probe`]).
///
/// Left out on purpose, because they work on wasm: `select` and `selectors` (WASI `poll_oneoff`),
/// `signal.signal` (handlers install; only timers are missing), `threading` itself (locks, `local`, `Event`
/// work; only starting a thread fails, so `threading.Thread`/`Timer` are listed instead), `concurrent.futures`
/// itself (only its executors are listed), `urllib.parse`, `http.cookies`, `email` (no sockets involved).
pub const NEEDS_NATIVE: &[NativeOnly] = &[
    // Processes: WASI has no process model at all.
    NativeOnly { name: "subprocess", need: Need::Processes, probe: "subprocess.run(['true'])" },
    NativeOnly { name: "multiprocessing", need: Need::Processes, probe: "multiprocessing.Pool(2)" },
    NativeOnly {
        name: "concurrent.futures.ProcessPoolExecutor",
        need: Need::Processes,
        probe: "concurrent.futures.ProcessPoolExecutor(2).submit(print).result()",
    },
    NativeOnly {
        name: "concurrent.futures.process",
        need: Need::Processes,
        probe: "concurrent.futures.ProcessPoolExecutor(2).submit(print).result()",
    },
    NativeOnly { name: "os.fork", need: Need::Processes, probe: "os.fork()" },
    NativeOnly { name: "os.forkpty", need: Need::Processes, probe: "os.forkpty()" },
    NativeOnly { name: "os.system", need: Need::Processes, probe: "os.system('true')" },
    NativeOnly { name: "os.popen", need: Need::Processes, probe: "os.popen('true')" },
    NativeOnly { name: "os.posix_spawn", need: Need::Processes, probe: "os.posix_spawn('/bin/true', ['true'], {})" },
    NativeOnly { name: "os.posix_spawnp", need: Need::Processes, probe: "os.posix_spawnp('true', ['true'], {})" },
    NativeOnly { name: "os.spawnv", need: Need::Processes, probe: "os.spawnv(os.P_WAIT, '/bin/true', ['true'])" },
    NativeOnly { name: "os.spawnvp", need: Need::Processes, probe: "os.spawnvp(os.P_WAIT, 'true', ['true'])" },
    NativeOnly { name: "os.spawnl", need: Need::Processes, probe: "os.spawnl(os.P_WAIT, '/bin/true', 'true')" },
    NativeOnly { name: "os.spawnlp", need: Need::Processes, probe: "os.spawnlp(os.P_WAIT, 'true', 'true')" },
    NativeOnly { name: "os.execv", need: Need::Processes, probe: "os.execv('/bin/true', ['true'])" },
    NativeOnly { name: "os.execvp", need: Need::Processes, probe: "os.execvp('true', ['true'])" },
    NativeOnly { name: "os.execl", need: Need::Processes, probe: "os.execl('/bin/true', 'true')" },
    NativeOnly { name: "os.execlp", need: Need::Processes, probe: "os.execlp('true', 'true')" },
    NativeOnly { name: "os.wait", need: Need::Processes, probe: "os.wait()" },
    NativeOnly { name: "os.waitpid", need: Need::Processes, probe: "os.waitpid(-1, 0)" },
    NativeOnly { name: "os.kill", need: Need::Processes, probe: "os.kill(os.getpid(), 0)" },
    NativeOnly { name: "os.pipe", need: Need::Processes, probe: "os.pipe()" },
    // Threads: the interpreter is built without thread support at run time.
    NativeOnly { name: "threading.Thread", need: Need::Threads, probe: "threading.Thread(target=print).start()" },
    NativeOnly { name: "threading.Timer", need: Need::Threads, probe: "threading.Timer(0, print).start()" },
    NativeOnly { name: "_thread.start_new_thread", need: Need::Threads, probe: "_thread.start_new_thread(print, ())" },
    NativeOnly { name: "_thread.start_new", need: Need::Threads, probe: "_thread.start_new(print, ())" },
    NativeOnly {
        name: "concurrent.futures.ThreadPoolExecutor",
        need: Need::Threads,
        probe: "concurrent.futures.ThreadPoolExecutor(2).submit(print).result()",
    },
    NativeOnly {
        name: "concurrent.futures.thread",
        need: Need::Threads,
        probe: "concurrent.futures.ThreadPoolExecutor(2).submit(print).result()",
    },
    // Sockets: none can be opened (WASI 0.2 components have egress-checked sockets; preview1 Python does not).
    NativeOnly { name: "socket", need: Need::Sockets, probe: "socket.socket()" },
    NativeOnly { name: "socketserver", need: Need::Sockets, probe: "socketserver.TCPServer(('127.0.0.1', 0), None)" },
    NativeOnly { name: "asyncio", need: Need::Sockets, probe: "asyncio.new_event_loop()" },
    NativeOnly {
        name: "http.client",
        need: Need::Sockets,
        probe: "http.client.HTTPConnection('127.0.0.1', 9).connect()",
    },
    NativeOnly { name: "http.server", need: Need::Sockets, probe: "http.server.HTTPServer(('127.0.0.1', 0), None)" },
    NativeOnly { name: "urllib.request", need: Need::Sockets, probe: "urllib.request.urlopen('http://127.0.0.1:9/')" },
    NativeOnly { name: "ftplib", need: Need::Sockets, probe: "ftplib.FTP('127.0.0.1')" },
    NativeOnly { name: "smtplib", need: Need::Sockets, probe: "smtplib.SMTP('127.0.0.1', 9)" },
    NativeOnly { name: "poplib", need: Need::Sockets, probe: "poplib.POP3('127.0.0.1', 9)" },
    NativeOnly { name: "imaplib", need: Need::Sockets, probe: "imaplib.IMAP4('127.0.0.1', 9)" },
    NativeOnly {
        name: "xmlrpc.client",
        need: Need::Sockets,
        probe: "xmlrpc.client.ServerProxy('http://127.0.0.1:9/').f()",
    },
    NativeOnly {
        name: "xmlrpc.server",
        need: Need::Sockets,
        probe: "xmlrpc.server.SimpleXMLRPCServer(('127.0.0.1', 0))",
    },
    // The rest: facilities WASI lacks.
    NativeOnly { name: "ssl", need: Need::Tls, probe: "import ssl" },
    NativeOnly { name: "ctypes", need: Need::NativeCode, probe: "ctypes.CDLL(None)" },
    NativeOnly { name: "_ctypes", need: Need::NativeCode, probe: "import _ctypes" },
    NativeOnly { name: "mmap", need: Need::MemoryMapping, probe: "mmap.mmap(-1, 16)" },
    NativeOnly { name: "pty", need: Need::Terminal, probe: "import pty" },
    NativeOnly { name: "tty", need: Need::Terminal, probe: "import tty" },
    NativeOnly { name: "curses", need: Need::Terminal, probe: "import curses" },
    NativeOnly { name: "signal.alarm", need: Need::Signals, probe: "signal.alarm(1)" },
    NativeOnly { name: "signal.setitimer", need: Need::Signals, probe: "signal.setitimer(signal.ITIMER_REAL, 1)" },
];

/// Top-level modules of the wasm build whose results are numpy's: numpy itself and the packages that compute
/// through it. On wasm32 numpy's default integer (`np.intp`, C `long`) is `int32`, so integer sums, products,
/// powers and `cumsum` wrap where a 64-bit host's do not (`np.arange(10**6).sum()` is 1783293664 there and
/// 499999500000 natively), with no warning. A job that imports one of these is not run on wasm unless the user
/// accepts wasm32 numerics (`--tier wasm`, or `[tiers] python_wasm_numpy = true`).
///
/// The integration tests import every third-party module of the installed build in a fresh interpreter: each one
/// that loads numpy must be here or in [`NUMPY_ONLY_RECOGNISED`], and each listed one must load it (statsmodels
/// through `statsmodels.api`: its bare package imports lazily).
pub const WASM32_NUMERICS: &[&str] = &[
    "numpy",
    "pandas",
    "scipy",
    "sklearn",
    "statsmodels",
    "matplotlib",
    "pylab",
    "seaborn",
    "patsy",
    "formulaic",
    "contourpy",
];

/// Modules of the wasm build that load numpy only to recognise its types: what they compute and return are
/// Python values, so they stay on wasm (a job that computes with numpy itself imports it, and is judged by that).
pub const NUMPY_ONLY_RECOGNISED: &[&str] = &["joblib", "openpyxl"];

/// The entry of [`NEEDS_NATIVE`] that covers a dotted name: the name itself or one of its parents (`subprocess`
/// covers `subprocess.run`, `multiprocessing` covers `multiprocessing.pool`).
pub fn needs_native(name: &str) -> Option<&'static NativeOnly> {
    NEEDS_NATIVE.iter().find(|entry| {
        name == entry.name || (name.starts_with(entry.name) && name.as_bytes().get(entry.name.len()) == Some(&b'.'))
    })
}

/// How a module came into the job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ImportKind {
    /// `import a.b`.
    Import,
    /// `from a import b` (the reference names `a.b`; its module is `a`).
    From,
    /// `__import__("a")` or `importlib.import_module("a")`.
    Dynamic,
    /// An attribute used through an imported module (`os.fork`).
    Use,
    /// The module of `python -m MODULE`.
    Main,
}

/// One module (or module attribute) a job refers to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImportRef {
    /// The dotted name: the module of an `import`, `module.name` of a `from` import or of a use.
    pub name: String,
    /// The module that must be importable: `name`, or its parent for `From` and `Use`.
    pub module: String,
    /// How it came in.
    pub kind: ImportKind,
    /// Inside a `try:` that catches `ImportError` (see the module docs).
    pub optional: bool,
    /// 1-based line.
    pub line: u32,
}

impl ImportRef {
    /// The first component of its module: what must be in the wasm build.
    pub fn top_level(&self) -> &str {
        self.module.split('.').next().unwrap_or_default()
    }
}

/// A syntax error the parser found: wasm reports it with a real traceback.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScanError {
    /// 1-based line.
    pub line: u32,
    /// The parser's message.
    pub message: String,
}

/// Scans Python source for the modules it refers to (see the module docs for what counts).
pub fn scan_source(source: &str) -> Result<Vec<ImportRef>, ScanError> {
    let lines = LineIndex::new(source);
    let parsed = ruff_python_parser::parse_module(source)
        .map_err(|err| ScanError { line: lines.line(err.location.start().to_u32()), message: err.error.to_string() })?;
    let mut scanner =
        Scanner { lines: &lines, optional: 0, refs: Vec::new(), bindings: HashMap::new(), chains: Vec::new() };
    for stmt in &parsed.syntax().body {
        scanner.visit_stmt(stmt);
    }
    Ok(scanner.finish())
}

/// The references of `python -m MODULE`: the module itself.
pub fn scan_main_module(module: &str) -> Vec<ImportRef> {
    vec![ImportRef {
        name: module.to_owned(),
        module: module.to_owned(),
        kind: ImportKind::Main,
        optional: false,
        line: 0,
    }]
}

/// Byte offset → line.
struct LineIndex {
    starts: Vec<u32>,
}

impl LineIndex {
    fn new(source: &str) -> LineIndex {
        let mut starts = vec![0];
        starts.extend(source.bytes().enumerate().filter(|(_, b)| *b == b'\n').map(|(i, _)| i as u32 + 1));
        LineIndex { starts }
    }

    fn line(&self, offset: u32) -> u32 {
        self.starts.partition_point(|start| *start <= offset) as u32
    }
}

/// A call or attribute chain seen during the walk, resolved once every import's binding is known.
struct Chain<'a> {
    /// `os` in `os.path.join`.
    base: &'a str,
    /// `path`, `join`.
    attrs: Vec<&'a str>,
    /// The literal first argument, when the chain is called with one (`import_module("x")`).
    literal: Option<&'a str>,
    optional: bool,
    offset: u32,
}

struct Scanner<'s, 'a> {
    lines: &'s LineIndex,
    /// Depth of `try:` bodies that catch `ImportError`.
    optional: u32,
    refs: Vec<ImportRef>,
    /// Local name → the dotted module or attribute an import bound it to.
    bindings: HashMap<&'a str, String>,
    chains: Vec<Chain<'a>>,
}

impl<'a> Scanner<'_, 'a> {
    fn push(&mut self, name: String, module: String, kind: ImportKind, offset: u32) {
        let line = self.lines.line(offset);
        self.refs.push(ImportRef { name, module, kind, optional: self.optional > 0, line });
    }

    /// Resolves attribute chains and dynamic imports through the bindings.
    fn finish(mut self) -> Vec<ImportRef> {
        for chain in std::mem::take(&mut self.chains) {
            let qualified = match self.bindings.get(chain.base) {
                Some(bound) => bound.clone(),
                None if chain.base == "__import__" || chain.base == "builtins" => chain.base.to_owned(),
                None => continue,
            };
            let mut name = qualified;
            for attr in &chain.attrs {
                name.push('.');
                name.push_str(attr);
            }
            let line = self.lines.line(chain.offset);
            let dynamic = matches!(name.as_str(), "__import__" | "builtins.__import__" | "importlib.import_module");
            match chain.literal {
                Some(literal) if dynamic => {
                    if !literal.starts_with('.') && !literal.is_empty() {
                        let module = literal.to_owned();
                        self.refs.push(ImportRef {
                            name: module.clone(),
                            module,
                            kind: ImportKind::Dynamic,
                            optional: chain.optional,
                            line,
                        });
                    }
                }
                _ if chain.attrs.is_empty() => {}
                _ => {
                    // Only uses that reach a listed attribute matter; anything else was covered by its import.
                    if needs_native(&name).is_some() {
                        let module = name.rsplit_once('.').map_or(name.as_str(), |(parent, _)| parent).to_owned();
                        self.refs.push(ImportRef {
                            name,
                            module,
                            kind: ImportKind::Use,
                            optional: chain.optional,
                            line,
                        });
                    }
                }
            }
        }
        self.refs
    }

    /// Records `expr` when it is a name or an attribute chain ending in a name; returns whether it was one.
    fn chain(&mut self, expr: &'a Expr, literal: Option<&'a str>) -> bool {
        let mut attrs = Vec::new();
        let mut cursor = expr;
        loop {
            match cursor {
                Expr::Attribute(attribute) => {
                    attrs.push(attribute.attr.id.as_str());
                    cursor = &attribute.value;
                }
                Expr::Name(name) => {
                    attrs.reverse();
                    self.chains.push(Chain {
                        base: name.id.as_str(),
                        attrs,
                        literal,
                        optional: self.optional > 0,
                        offset: expr.range().start().to_u32(),
                    });
                    return true;
                }
                _ => return false,
            }
        }
    }
}

/// Whether an `except` clause catches `ImportError`.
fn catches_import_error(handler: &ExceptHandler) -> bool {
    let ExceptHandler::ExceptHandler(handler) = handler;
    let Some(kind) = &handler.type_ else { return true };
    let names_it = |expr: &Expr| {
        let name = match expr {
            Expr::Name(name) => name.id.as_str(),
            Expr::Attribute(attribute) => attribute.attr.id.as_str(),
            _ => return false,
        };
        matches!(name, "ImportError" | "ModuleNotFoundError" | "Exception" | "BaseException")
    };
    match kind.as_ref() {
        Expr::Tuple(tuple) => tuple.elts.iter().any(names_it),
        other => names_it(other),
    }
}

/// `TYPE_CHECKING` or `typing.TYPE_CHECKING`.
fn is_type_checking(test: &Expr) -> bool {
    match test {
        Expr::Name(name) => name.id.as_str() == "TYPE_CHECKING",
        Expr::Attribute(attribute) => attribute.attr.id.as_str() == "TYPE_CHECKING",
        _ => false,
    }
}

impl<'a> Visitor<'a> for Scanner<'_, 'a> {
    fn visit_stmt(&mut self, stmt: &'a Stmt) {
        match stmt {
            Stmt::Import(import) => {
                for alias in &import.names {
                    let module = alias.name.id.as_str();
                    match &alias.asname {
                        Some(asname) => self.bindings.insert(asname.id.as_str(), module.to_owned()),
                        None => {
                            let top = module.split('.').next().unwrap_or(module);
                            self.bindings.insert(top, top.to_owned())
                        }
                    };
                    self.push(module.to_owned(), module.to_owned(), ImportKind::Import, alias.range().start().to_u32());
                }
            }
            Stmt::ImportFrom(import) => {
                let Some(module) = import.module.as_ref().filter(|_| import.level == 0) else { return };
                let module = module.id.as_str();
                for alias in &import.names {
                    let name = alias.name.id.as_str();
                    if name == "*" {
                        self.push(
                            module.to_owned(),
                            module.to_owned(),
                            ImportKind::From,
                            alias.range().start().to_u32(),
                        );
                        continue;
                    }
                    let qualified = format!("{module}.{name}");
                    let local = alias.asname.as_ref().map_or(name, |asname| asname.id.as_str());
                    self.bindings.insert(local, qualified.clone());
                    self.push(qualified, module.to_owned(), ImportKind::From, alias.range().start().to_u32());
                }
            }
            Stmt::Try(try_stmt) => {
                let optional = try_stmt.handlers.iter().any(catches_import_error);
                self.optional += u32::from(optional);
                self.visit_body(&try_stmt.body);
                self.optional -= u32::from(optional);
                for handler in &try_stmt.handlers {
                    self.visit_except_handler(handler);
                }
                self.visit_body(&try_stmt.orelse);
                self.visit_body(&try_stmt.finalbody);
            }
            Stmt::If(if_stmt) if is_type_checking(&if_stmt.test) => {
                for clause in &if_stmt.elif_else_clauses {
                    self.visit_body(&clause.body);
                }
            }
            _ => visitor::walk_stmt(self, stmt),
        }
    }

    fn visit_expr(&mut self, expr: &'a Expr) {
        match expr {
            Expr::Call(call) => {
                let literal = match call.arguments.args.first() {
                    Some(Expr::StringLiteral(literal)) => Some(literal.value.to_str()),
                    _ => None,
                };
                if !(literal.is_some() && self.chain(&call.func, literal)) {
                    self.visit_expr(&call.func);
                }
                for arg in &call.arguments.args {
                    self.visit_expr(arg);
                }
                for keyword in &call.arguments.keywords {
                    self.visit_expr(&keyword.value);
                }
            }
            Expr::Attribute(_) => {
                if !self.chain(expr, None) {
                    visitor::walk_expr(self, expr);
                }
            }
            _ => visitor::walk_expr(self, expr),
        }
    }
}

/// The modules the wasm build of CPython can import: the top-level names of its stdlib zip (stdlib and bundled
/// packages) and of `sys.builtin_module_names`. Generated from the installed runtime ([`WasmModules::load_or_generate`]).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct WasmModules {
    zip: BTreeSet<String>,
    builtin: BTreeSet<String>,
}

/// Why the list of the wasm build's modules could not be made.
#[derive(Debug, thiserror::Error)]
pub enum WasmModulesError {
    /// The stdlib zip could not be read.
    #[error("cannot read the stdlib zip {}: {message}", path.display())]
    Zip {
        /// The zip.
        path: PathBuf,
        /// Why.
        message: String,
    },
    /// The interpreter could not list its builtin modules.
    #[error("cannot list the wasm interpreter's builtin modules: {0}")]
    Builtins(String),
}

const CACHE_HEADER: &str = "# strata: modules the wasm Python build can import (generated; delete to regenerate)";

impl WasmModules {
    /// From the names in a stdlib zip and the interpreter's builtin module names.
    pub fn new<'n>(zip_names: impl IntoIterator<Item = &'n str>, builtins: impl IntoIterator<Item = &'n str>) -> Self {
        let zip = zip_names.into_iter().filter_map(top_level_of_zip_entry).map(str::to_owned).collect();
        let builtin = builtins
            .into_iter()
            .filter_map(|name| name.trim().split('.').next())
            .filter(|name| is_identifier(name))
            .map(str::to_owned)
            .collect();
        WasmModules { zip, builtin }
    }

    /// Whether a top-level module is in the build.
    pub fn has(&self, top_level: &str) -> bool {
        self.zip.contains(top_level) || self.builtin.contains(top_level)
    }

    /// Its top-level names, each once, in order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.zip.union(&self.builtin).map(String::as_str)
    }

    /// How many top-level names it has.
    pub fn len(&self) -> usize {
        self.zip.union(&self.builtin).count()
    }

    /// Whether it has none (an empty zip and no builtins: not a usable build).
    pub fn is_empty(&self) -> bool {
        self.zip.is_empty() && self.builtin.is_empty()
    }

    /// The names in a stdlib zip, read from its central directory.
    pub fn zip_names(path: &Path) -> Result<Vec<String>, WasmModulesError> {
        let zip_error = |message: String| WasmModulesError::Zip { path: path.to_owned(), message };
        let file = std::fs::File::open(path).map_err(|e| zip_error(e.to_string()))?;
        names_in_zip(std::io::BufReader::new(file)).map_err(zip_error)
    }

    /// The list cached at `cache`, or generated from `zip` and `builtins()` (run only on a cache miss: it starts
    /// the interpreter) and written there atomically. A cache that cannot be written is only logged.
    pub fn load_or_generate(
        cache: &Path,
        zip: &Path,
        builtins: impl FnOnce() -> Result<Vec<String>, String>,
    ) -> Result<WasmModules, WasmModulesError> {
        if let Ok(text) = std::fs::read_to_string(cache)
            && let Some(modules) = WasmModules::parse_cache(&text)
        {
            return Ok(modules);
        }
        let names = WasmModules::zip_names(zip)?;
        let builtins = builtins().map_err(WasmModulesError::Builtins)?;
        let modules = WasmModules::new(names.iter().map(String::as_str), builtins.iter().map(String::as_str));
        if let Err(err) = write_atomically(cache, &modules.to_cache()) {
            log::warn!("cannot cache the wasm build's module list at {}: {err}", cache.display());
        }
        Ok(modules)
    }

    fn to_cache(&self) -> String {
        let mut text = format!("{CACHE_HEADER}\n");
        for name in &self.zip {
            let _ = writeln!(text, "zip {name}");
        }
        for name in &self.builtin {
            let _ = writeln!(text, "builtin {name}");
        }
        text
    }

    fn parse_cache(text: &str) -> Option<WasmModules> {
        let mut lines = text.lines();
        if lines.next() != Some(CACHE_HEADER) {
            return None;
        }
        let mut modules = WasmModules::default();
        for line in lines {
            match line.split_once(' ')? {
                ("zip", name) => modules.zip.insert(name.to_owned()),
                ("builtin", name) => modules.builtin.insert(name.to_owned()),
                _ => return None,
            };
        }
        (!modules.is_empty()).then_some(modules)
    }
}

/// `numpy/__init__.pyc` → `numpy`, `json.pyc` → `json`; metadata (`numpy-2.5.dist-info/…`) and data files → none.
fn top_level_of_zip_entry(entry: &str) -> Option<&str> {
    let name = match entry.split_once('/') {
        Some((dir, _)) => dir,
        None => entry.strip_suffix(".pyc").or_else(|| entry.strip_suffix(".py"))?,
    };
    is_identifier(name).then_some(name)
}

fn is_identifier(name: &str) -> bool {
    let mut chars = name.chars();
    chars.next().is_some_and(|c| c == '_' || c.is_alphabetic()) && chars.all(|c| c == '_' || c.is_alphanumeric())
}

fn names_in_zip(reader: impl Read + Seek) -> Result<Vec<String>, String> {
    let archive = zip::ZipArchive::new(reader).map_err(|e| e.to_string())?;
    Ok(archive.file_names().map(str::to_owned).collect())
}

fn write_atomically(path: &Path, text: &str) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let temp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&temp, text)?;
    std::fs::rename(&temp, path).inspect_err(|_| {
        let _ = std::fs::remove_file(&temp);
    })
}

/// Where [`route_python`] sends a Python job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PythonVerdict {
    /// Wasm can run it; the reason lists what it imports.
    Wasm(String),
    /// It needs the native tier; the reason says what for.
    Native(String),
    /// Wasm could run it, but its numbers could differ from a 64-bit host's ([`WASM32_NUMERICS`]): the native
    /// tier, and never wasm in its place unless the user accepts wasm32 numerics.
    Numerics(String),
}

/// Whether a Python job may compute with numpy on wasm32 ([`WASM32_NUMERICS`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wasm32Numerics {
    /// Such a job goes native (the default).
    Refused,
    /// The user accepted wasm32 numerics (`[tiers] python_wasm_numpy = true`): such a job may run on wasm.
    Accepted,
}

/// The import-based part of the router's decision for a Python job: native when a reference needs what WASI
/// lacks ([`NEEDS_NATIVE`]) or a non-optional import is absent from `modules`; [`PythonVerdict::Numerics`] when
/// it imports a module whose numbers differ on wasm32 ([`WASM32_NUMERICS`], optional imports included: a module
/// that imports is used) and `numerics` refuses them; wasm otherwise. `modules` is `None` when the list could not
/// be made (the absence check is then skipped and the reason says so).
pub fn route_python(refs: &[ImportRef], modules: Option<&WasmModules>, numerics: Wasm32Numerics) -> PythonVerdict {
    let mut needs: Vec<String> = Vec::new();
    let mut covered: Vec<&str> = Vec::new();
    let mut absent: Vec<&str> = Vec::new();
    let mut present: Vec<&str> = Vec::new();
    for import in refs {
        if let Some(entry) = needs_native(&import.name) {
            // One mention per entry: `import subprocess` then `subprocess.run(...)` is one reason.
            if !covered.contains(&entry.name) {
                covered.push(entry.name);
                let verb = if import.kind == ImportKind::Use { "uses" } else { "imports" };
                needs.push(format!("{verb} {} ({})", import.name, entry.need.as_str()));
            }
            continue;
        }
        let top = import.top_level();
        if import.kind == ImportKind::Use || top.is_empty() {
            continue;
        }
        match modules {
            Some(modules) if !modules.has(top) => {
                if !import.optional && !absent.contains(&top) {
                    absent.push(top);
                }
            }
            _ => {
                if !present.contains(&top) {
                    present.push(top);
                }
            }
        }
    }
    if !needs.is_empty() || !absent.is_empty() {
        let mut parts = needs;
        if !absent.is_empty() {
            parts.push(format!("imports {}, absent from the wasm build", list(&absent)));
        }
        return PythonVerdict::Native(format!("python: {}", parts.join("; ")));
    }
    let numeric: Vec<&str> = present.iter().copied().filter(|top| WASM32_NUMERICS.contains(top)).collect();
    if !numeric.is_empty() && numerics == Wasm32Numerics::Refused {
        return PythonVerdict::Numerics(format!(
            "python: imports {}, whose integer results on wasm32 (numpy's default int is int32) could differ from \
             native Python's",
            list(&numeric)
        ));
    }
    if present.is_empty() {
        // Nothing imported (or only what is covered above): no module list is needed to say so.
        return PythonVerdict::Wasm("python: imports nothing the wasm build lacks".to_owned());
    }
    if modules.is_none() {
        return PythonVerdict::Wasm(format!(
            "python: imports {} (the wasm build's module list is unavailable, so not checked)",
            list(&present)
        ));
    }
    PythonVerdict::Wasm(format!("python: imports only modules the wasm build has ({})", list(&present)))
}

/// The verdict for source that does not parse: wasm, whose interpreter reports the `SyntaxError` with a real
/// traceback.
pub fn unparsable(err: &ScanError) -> PythonVerdict {
    PythonVerdict::Wasm(format!(
        "python: does not parse as Python 3 (line {}: {}); wasm reports the SyntaxError",
        err.line, err.message
    ))
}

/// What the import scan says of a Python source: where it can run by what it imports, with `numerics` deciding
/// whether numpy on wasm32 is acceptable. `modules` is asked for the wasm build's module list only when the source
/// imports something. A file that cannot be read or is not UTF-8 is left to wasm, which reports it.
pub fn judge_source<'m>(
    source: &PythonSource,
    numerics: Wasm32Numerics,
    modules: impl FnOnce() -> Option<&'m WasmModules>,
) -> PythonVerdict {
    let refs = match source {
        PythonSource::Module(module) => scan_main_module(module),
        PythonSource::Code(code) => match scan_source(code) {
            Ok(refs) => refs,
            Err(err) => return unparsable(&err),
        },
        PythonSource::File(path) => {
            let text = match std::fs::read(path) {
                Ok(bytes) => bytes,
                Err(err) => {
                    return PythonVerdict::Wasm(format!(
                        "python: cannot read {} ({err}); the wasm tier reports it",
                        path.display()
                    ));
                }
            };
            match std::str::from_utf8(&text) {
                Ok(text) => match scan_source(text) {
                    Ok(refs) => refs,
                    Err(err) => return unparsable(&err),
                },
                Err(_) => {
                    return PythonVerdict::Wasm(
                        "python: the script is not UTF-8; wasm reports the SyntaxError".to_owned(),
                    );
                }
            }
        }
    };
    if refs.is_empty() {
        return route_python(&refs, None, numerics);
    }
    route_python(&refs, modules(), numerics)
}

/// `a, b, c` — at most eight names, then `and N more`.
fn list(names: &[&str]) -> String {
    const SHOWN: usize = 8;
    let mut text = names.iter().take(SHOWN).copied().collect::<Vec<_>>().join(", ");
    if names.len() > SHOWN {
        let _ = write!(text, " and {} more", names.len() - SHOWN);
    }
    text
}

/// The set of distinct top-level modules a scan found (for tests and the bench).
pub fn top_levels(refs: &[ImportRef]) -> HashSet<&str> {
    refs.iter().map(ImportRef::top_level).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(source: &str) -> Vec<(String, ImportKind, bool)> {
        scan_source(source).expect("parses").into_iter().map(|r| (r.name, r.kind, r.optional)).collect()
    }

    fn modules() -> WasmModules {
        WasmModules::new(
            ["numpy/__init__.pyc", "json/__init__.pyc", "os.pyc", "subprocess.pyc", "numpy-2.5.dist-info/METADATA"],
            ["sys", "math", "lxml.etree"],
        )
    }

    #[test]
    fn every_import_form_is_found_and_relative_ones_are_ignored() {
        let found = names(
            "import os, numpy.linalg as la\nfrom json import dumps as d\nfrom . import sibling\nfrom .pkg import x\n\
             __import__('math')\nimport importlib\nimportlib.import_module('lxml.etree')\n\
             importlib.import_module('.rel', 'pkg')\n",
        );
        let found: Vec<&str> = found.iter().map(|(name, _, _)| name.as_str()).collect();
        assert_eq!(found, ["os", "numpy.linalg", "json.dumps", "importlib", "math", "lxml.etree"]);
    }

    #[test]
    fn imports_inside_functions_count_and_try_import_error_is_optional() {
        let found = names(
            "def f():\n    import subprocess\n\ntry:\n    import yaml\nexcept ImportError:\n    yaml = None\n\
             try:\n    import toml\nexcept (OSError, ModuleNotFoundError):\n    pass\n\
             try:\n    import zlib\nexcept ValueError:\n    pass\n",
        );
        assert_eq!(
            found,
            [
                ("subprocess".into(), ImportKind::Import, false),
                ("yaml".into(), ImportKind::Import, true),
                ("toml".into(), ImportKind::Import, true),
                ("zlib".into(), ImportKind::Import, false),
            ]
        );
    }

    #[test]
    fn uses_resolve_through_aliases() {
        let found = names(
            "import concurrent.futures as cf\nimport threading\nimport os\nfrom os import path\n\
             def g():\n    return cf.ProcessPoolExecutor(2), threading.Thread(target=g), threading.Lock(), \
             os.path.join('a'), os.fork\n",
        );
        let uses: Vec<&str> =
            found.iter().filter(|(_, kind, _)| *kind == ImportKind::Use).map(|(n, _, _)| n.as_str()).collect();
        assert_eq!(uses, ["concurrent.futures.ProcessPoolExecutor", "threading.Thread", "os.fork"]);
    }

    #[test]
    fn type_checking_imports_are_ignored() {
        assert_eq!(names("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import lxml\n").len(), 1);
    }

    #[test]
    fn syntax_errors_name_their_line() {
        let err = scan_source("import os\nprint 'hi'\n").expect_err("python 2");
        assert_eq!(err.line, 2, "{err:?}");
    }

    #[test]
    fn the_verdict_says_why() {
        let route = |source: &str| {
            route_python(&scan_source(source).expect("parses"), Some(&modules()), Wasm32Numerics::Refused)
        };
        let accepting = |source: &str| {
            route_python(&scan_source(source).expect("parses"), Some(&modules()), Wasm32Numerics::Accepted)
        };
        assert_eq!(
            accepting("import numpy as np, json, sys\n"),
            PythonVerdict::Wasm("python: imports only modules the wasm build has (numpy, json, sys)".into())
        );
        assert_eq!(route("x = 1\n"), PythonVerdict::Wasm("python: imports nothing the wasm build lacks".into()));
        // Without the module list (it is made only when something is imported), a script that imports nothing
        // says only that; one that imports says what was not checked.
        let unlisted =
            |source: &str| route_python(&scan_source(source).expect("parses"), None, Wasm32Numerics::Refused);
        assert_eq!(unlisted("print(1)\n"), PythonVerdict::Wasm("python: imports nothing the wasm build lacks".into()));
        assert_eq!(
            unlisted("import json\n"),
            PythonVerdict::Wasm(
                "python: imports json (the wasm build's module list is unavailable, so not checked)".into()
            )
        );
        assert_eq!(
            route("import subprocess\nsubprocess.run(['ls'])\n"),
            PythonVerdict::Native("python: imports subprocess (needs processes)".into())
        );
        assert_eq!(
            route("from multiprocessing import Pool\n"),
            PythonVerdict::Native("python: imports multiprocessing.Pool (needs processes)".into())
        );
        assert_eq!(
            route("import requests\n"),
            PythonVerdict::Native("python: imports requests, absent from the wasm build".into())
        );
        assert_eq!(route("try:\n    import requests\nexcept ImportError:\n    pass\n"), route("pass\n"));
        assert_eq!(
            route("import os\nos.system('ls')\n"),
            PythonVerdict::Native("python: uses os.system (needs processes)".into())
        );
    }

    #[test]
    fn numpy_goes_native_unless_wasm32_numerics_are_accepted() {
        let route =
            |source: &str, numerics| route_python(&scan_source(source).expect("parses"), Some(&modules()), numerics);
        let numerics = PythonVerdict::Numerics(
            "python: imports numpy, whose integer results on wasm32 (numpy's default int is int32) could differ \
             from native Python's"
                .into(),
        );
        for source in [
            "import numpy as np\nprint(np.arange(10**6).sum())\n",
            "from numpy import arange\n",
            "import numpy.linalg\n",
            "import json\nnp = __import__('numpy')\n",
            // A job that copes without numpy still computes with it where it imports.
            "try:\n    import numpy\nexcept ImportError:\n    numpy = None\n",
        ] {
            assert_eq!(route(source, Wasm32Numerics::Refused), numerics, "{source}");
            assert!(matches!(route(source, Wasm32Numerics::Accepted), PythonVerdict::Wasm(_)), "{source}");
        }
        // What needs native anyway says so first.
        assert_eq!(
            route("import numpy, subprocess\n", Wasm32Numerics::Refused),
            PythonVerdict::Native("python: imports subprocess (needs processes)".into())
        );
        // Only computing modules count: json is not numpy's.
        assert!(matches!(route("import json\n", Wasm32Numerics::Refused), PythonVerdict::Wasm(_)));
        assert!(WASM32_NUMERICS.iter().all(|m| !NUMPY_ONLY_RECOGNISED.contains(m)));
    }

    #[test]
    fn zip_entries_give_top_level_names() {
        let modules = modules();
        assert!(modules.has("numpy") && modules.has("os") && modules.has("lxml") && modules.has("sys"));
        assert!(!modules.has("numpy-2.5.dist-info") && !modules.has("requests"));
        assert_eq!(modules.len(), 7);
    }

    #[test]
    fn the_cache_round_trips_and_a_foreign_file_is_ignored() {
        let modules = modules();
        assert_eq!(WasmModules::parse_cache(&modules.to_cache()), Some(modules));
        assert_eq!(WasmModules::parse_cache("numpy\n"), None);
    }

    #[test]
    fn needs_native_matches_names_and_their_children_only() {
        assert_eq!(needs_native("multiprocessing.pool").map(|e| e.name), Some("multiprocessing"));
        assert_eq!(needs_native("subprocess").map(|e| e.need), Some(Need::Processes));
        assert!(needs_native("subprocessing").is_none());
        assert!(needs_native("threading").is_none() && needs_native("threading.Lock").is_none());
        assert!(needs_native("concurrent.futures").is_none());
        assert!(needs_native("urllib.parse").is_none());
    }
}
