//! What a failed wasm attempt says about itself, and whether it escalates: see the [parent module](super) for the rules.

use strata_core::{Outcome, Status};

use crate::policy::EscalationReason;
use crate::scan::WasmModules;
/// The longest exception text an escalation reason quotes.
const MAX_QUOTED: usize = 200;

/// Attributes of the wasm build's `os`, `signal` and `time` that Linux CPython has and WASI does not: a job that
/// reaches for one (`AttributeError: module 'os' has no attribute 'fork'`, `ImportError: cannot import name 'fork'
/// from 'os'`) made an unsupported call. Found by asking the wasm build (3.15) and Debian's CPython (3.11) for
/// each; the integration tests check every entry is still missing on wasm.
pub const UNSUPPORTED_ATTRIBUTES: &[(&str, &[&str])] = &[
    (
        "os",
        &[
            "fork",
            "forkpty",
            "system",
            "posix_spawn",
            "posix_spawnp",
            "spawnv",
            "spawnvp",
            "spawnl",
            "spawnlp",
            "spawnve",
            "spawnvpe",
            "spawnle",
            "spawnlpe",
            "execv",
            "execve",
            "wait",
            "wait3",
            "wait4",
            "waitpid",
            "waitid",
            "kill",
            "killpg",
            "pipe",
            "getppid",
            "chown",
            "lchown",
            "fchown",
            "setsid",
            "getsid",
            "getpgid",
            "setpgid",
            "getpgrp",
            "setpgrp",
            "nice",
            "setuid",
            "setgid",
            "seteuid",
            "setegid",
            "getuid",
            "getgid",
            "geteuid",
            "getegid",
            "getgroups",
            "setgroups",
            "umask",
            "chroot",
            "mkfifo",
            "mknod",
            "getlogin",
            "openpty",
            "ttyname",
            "tcgetpgrp",
            "register_at_fork",
            "sched_setaffinity",
            "sched_getaffinity",
            "getloadavg",
            "setpriority",
            "getpriority",
            "pidfd_open",
            "memfd_create",
            "eventfd",
            "splice",
            "sendfile",
            "fchmod",
            "get_terminal_size",
            "statvfs",
            "fstatvfs",
            "sync",
            "getrandom",
        ],
    ),
    (
        "signal",
        &[
            "alarm",
            "setitimer",
            "getitimer",
            "pause",
            "pthread_kill",
            "pthread_sigmask",
            "sigwait",
            "sigwaitinfo",
            "sigtimedwait",
            "sigpending",
            "siginterrupt",
        ],
    ),
    ("time", &["clock_settime", "tzset", "thread_time"]),
];

/// Why a wasm run may escalate: what [`diagnose`] found in it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WasmFailure {
    /// The policy's name for it (`[escalation] on`).
    pub reason: EscalationReason,
    /// What failed: `missing module 'resource'`, `unsupported call: os.fork`.
    pub what: String,
    /// The final exception line, as the guest printed it (at most 200 characters).
    pub exception: String,
}

impl WasmFailure {
    /// The escalation's reason, as the outcome's `escalations` records it: what failed, then what the wasm attempt
    /// printed and how it ended.
    pub fn describe(&self, attempt: &Outcome) -> String {
        let wall = attempt.usage.wall;
        let after = if wall.as_secs() == 0 {
            format!("{} ms", wall.as_millis())
        } else {
            format!("{:.1} s", wall.as_secs_f64())
        };
        format!("{} (the wasm attempt failed after {after}: {}; its output is discarded)", self.what, self.exception)
    }
}

/// Whether a wasm run of a Python job failed for a reason that may escalate (see the module docs); `modules` is the
/// wasm build's module list, without which a missing module is never taken for one.
pub fn diagnose(outcome: &Outcome, modules: Option<&WasmModules>) -> Option<WasmFailure> {
    if outcome.status != (Status::Exited { code: 1 }) || outcome.truncated.stderr {
        return None;
    }
    let stderr = String::from_utf8_lossy(&outcome.stderr);
    let line = final_exception(&stderr)?;
    let (reason, what) = match modules.and_then(|modules| missing_module(line, modules)) {
        Some(module) => (EscalationReason::MissingModule, format!("missing module '{module}'")),
        None => (EscalationReason::UnsupportedCall, format!("unsupported call: {}", unsupported_call(line)?)),
    };
    Some(WasmFailure { reason, what, exception: quote(line) })
}

fn quote(line: &str) -> String {
    let mut text: String = line.chars().take(MAX_QUOTED).collect();
    if line.chars().count() > MAX_QUOTED {
        text.push('…');
    }
    text
}

/// The exception line of the last traceback on stderr: the first unindented line after the last `Traceback (most
/// recent call last):` header.
fn final_exception(stderr: &str) -> Option<&str> {
    const HEADER: &str = "Traceback (most recent call last):";
    let mut lines = stderr.lines().collect::<Vec<_>>();
    let start = lines.iter().rposition(|line| *line == HEADER)?;
    lines.drain(..=start);
    lines.into_iter().find(|line| !line.is_empty() && !line.starts_with([' ', '\t']))
}

/// The text between the first pair of single quotes after `prefix` in `text`.
fn quoted_after<'t>(text: &'t str, prefix: &str) -> Option<(&'t str, &'t str)> {
    let rest = text.strip_prefix(prefix)?.strip_prefix('\'')?;
    let end = rest.find('\'')?;
    Some((&rest[..end], &rest[end + 1..]))
}

fn is_dotted_name(name: &str) -> bool {
    !name.is_empty()
        && name.split('.').all(|part| {
            let mut chars = part.chars();
            chars.next().is_some_and(|c| c == '_' || c.is_alphabetic())
                && chars.all(|c| c == '_' || c.is_alphanumeric())
        })
}

/// The module a `ModuleNotFoundError`/`ImportError` line says is missing, when its top level is absent from wasm.
fn missing_module<'l>(line: &'l str, modules: &WasmModules) -> Option<&'l str> {
    let (kind, message) = line.split_once(": ")?;
    if kind != "ModuleNotFoundError" && kind != "ImportError" {
        return None;
    }
    let module = [
        ("No module named ", ""),
        ("Unsupported platform for standard library module ", ""),
        ("Standard library module ", " was not found"),
    ]
    .into_iter()
    .find_map(|(prefix, suffix)| {
        let (name, rest) = quoted_after(message, prefix)?;
        rest.starts_with(suffix).then_some(name)
    })?;
    let top = module.split('.').next()?;
    (is_dotted_name(module) && !modules.has(top)).then_some(module)
}

/// What unsupported call an exception line reports, if any.
fn unsupported_call(line: &str) -> Option<String> {
    let (kind, message) = line.split_once(": ")?;
    match kind {
        "OSError" => {
            for (errno, name) in [("[Errno 58] ", "ENOTSUP"), ("[Errno 52] ", "ENOSYS")] {
                if let Some(text) = message.strip_prefix(errno) {
                    return Some(format!("{} ({name})", text.trim_end_matches('.')));
                }
            }
            message.ends_with(" is unavailable on wasm32-wasi").then(|| message.to_owned())
        }
        "RuntimeError" => (message == "can't start new thread").then(|| "starting a thread".to_owned()),
        "NotImplementedError" => {
            message.starts_with("This Python build lacks ").then(|| message.trim_end_matches('.').to_owned())
        }
        "AttributeError" => {
            let (module, rest) = quoted_after(message, "module ")?;
            let (attribute, _) = quoted_after(rest, " has no attribute ")?;
            unsupported_attribute(module, attribute)
        }
        "ImportError" => {
            let (attribute, rest) = quoted_after(message, "cannot import name ")?;
            let (module, _) = quoted_after(rest, " from ")?;
            unsupported_attribute(module, attribute)
        }
        _ => None,
    }
}

fn unsupported_attribute(module: &str, attribute: &str) -> Option<String> {
    UNSUPPORTED_ATTRIBUTES
        .iter()
        .any(|(name, attributes)| *name == module && attributes.contains(&attribute))
        .then(|| format!("{module}.{attribute}"))
}

#[cfg(test)]
mod tests {
    use strata_core::TierKind;

    use super::*;

    fn failed(stderr: &str) -> Outcome {
        Outcome { stderr: stderr.as_bytes().to_vec(), ..Outcome::new(TierKind::Wasm, Status::Exited { code: 1 }) }
    }

    fn traceback(line: &str) -> String {
        format!("Traceback (most recent call last):\n  File \"<string>\", line 1, in <module>\n    import x\n{line}\n")
    }

    fn modules() -> WasmModules {
        WasmModules::new(["json.pyc", "numpy/__init__.pyc", "os.pyc"], ["sys", "_io"])
    }

    fn what(line: &str) -> Option<(EscalationReason, String)> {
        diagnose(&failed(&traceback(line)), Some(&modules())).map(|f| (f.reason, f.what))
    }

    #[test]
    fn a_module_absent_from_wasm_is_a_missing_module() {
        use EscalationReason::MissingModule;
        for line in [
            "ModuleNotFoundError: No module named 'resource'",
            "ModuleNotFoundError: Unsupported platform for standard library module 'resource'",
            "ImportError: No module named 'resource'",
        ] {
            assert_eq!(what(line), Some((MissingModule, "missing module 'resource'".into())), "{line}");
        }
        assert_eq!(
            what("ModuleNotFoundError: Standard library module '_ssl' was not found"),
            Some((MissingModule, "missing module '_ssl'".into()))
        );
        assert_eq!(
            what("ModuleNotFoundError: No module named 'lxml.etree'"),
            Some((MissingModule, "missing module 'lxml.etree'".into()))
        );
    }

    #[test]
    fn a_module_wasm_has_or_a_malformed_name_is_not_a_missing_module() {
        assert_eq!(what("ModuleNotFoundError: No module named 'numpy.nothing'"), None);
        assert_eq!(what("ModuleNotFoundError: No module named 'json'"), None);
        assert_eq!(what("ModuleNotFoundError: No module named 'a b'"), None);
        assert_eq!(what("ModuleNotFoundError: No module named ''"), None);
        assert_eq!(what("ModuleNotFoundError: no quotes"), None);
        // Without the module list, only unsupported calls are recognised.
        let outcome = failed(&traceback("ModuleNotFoundError: No module named 'resource'"));
        assert_eq!(diagnose(&outcome, None), None);
        let outcome = failed(&traceback("RuntimeError: can't start new thread"));
        let call = Some((EscalationReason::UnsupportedCall, "unsupported call: starting a thread".to_owned()));
        assert_eq!(diagnose(&outcome, None).map(|f| (f.reason, f.what)), call);
    }

    #[test]
    fn what_wasi_cannot_do_is_an_unsupported_call() {
        use EscalationReason::UnsupportedCall;
        for (line, expected) in [
            ("OSError: [Errno 58] wasi does not support processes.", "wasi does not support processes (ENOTSUP)"),
            ("OSError: [Errno 58] Not supported", "Not supported (ENOTSUP)"),
            ("OSError: [Errno 52] Function not implemented", "Function not implemented (ENOSYS)"),
            ("OSError: ctypes is unavailable on wasm32-wasi", "ctypes is unavailable on wasm32-wasi"),
            ("RuntimeError: can't start new thread", "starting a thread"),
            ("AttributeError: module 'os' has no attribute 'fork'", "os.fork"),
            (
                "AttributeError: module 'os' has no attribute 'pipe'. Did you mean '.pipe2' instead of '.pipe'?",
                "os.pipe",
            ),
            ("ImportError: cannot import name 'alarm' from 'signal' (unknown location)", "signal.alarm"),
            (
                "NotImplementedError: This Python build lacks multiprocessing.synchronize, usually due to named \
                 semaphores being unavailable on this platform.",
                "This Python build lacks multiprocessing.synchronize, usually due to named semaphores being \
                 unavailable on this platform",
            ),
        ] {
            assert_eq!(what(line), Some((UnsupportedCall, format!("unsupported call: {expected}"))), "{line}");
        }
    }

    #[test]
    fn ordinary_failures_do_not_escalate() {
        for line in [
            "ValueError: x",
            "OSError: [Errno 2] No such file or directory: 'x'",
            "AttributeError: module 'os' has no attribute 'frok'",
            "AttributeError: 'NoneType' object has no attribute 'fork'",
            "RuntimeError: something else",
            "ImportError: cannot import name 'dumps' from 'json'",
            "SyntaxError: invalid syntax",
        ] {
            assert_eq!(what(line), None, "{line}");
        }
        // Only the final traceback counts, and only its exception line (not a chained cause, not a note).
        let chained = format!(
            "{}\nDuring handling of the above exception, another exception occurred:\n\n{}",
            traceback("ModuleNotFoundError: No module named 'resource'"),
            traceback("ValueError: fallback failed")
        );
        assert_eq!(diagnose(&failed(&chained), Some(&modules())), None);
        let fixed = format!("{}ModuleNotFoundError: No module named 'resource'\n", traceback("KeyError: 'k'"));
        assert_eq!(diagnose(&failed(&fixed), Some(&modules())), None);
        // Printed without a traceback, or with another exit status, or cut off: no.
        let line = "ModuleNotFoundError: No module named 'resource'\n";
        assert_eq!(diagnose(&failed(line), Some(&modules())), None);
        let mut outcome = failed(&traceback(line.trim_end()));
        assert!(diagnose(&outcome, Some(&modules())).is_some());
        outcome.status = Status::Exited { code: 2 };
        assert_eq!(diagnose(&outcome, Some(&modules())), None);
        outcome.status = Status::Exited { code: 1 };
        outcome.truncated.stderr = true;
        assert_eq!(diagnose(&outcome, Some(&modules())), None);
    }

    #[test]
    fn the_reason_says_what_the_wasm_attempt_did() {
        let mut outcome = failed(&traceback("ModuleNotFoundError: No module named 'resource'"));
        outcome.usage.wall = std::time::Duration::from_micros(31_500);
        let failure = diagnose(&outcome, Some(&modules())).expect("escalates");
        assert_eq!(
            failure.describe(&outcome),
            "missing module 'resource' (the wasm attempt failed after 31 ms: ModuleNotFoundError: No module named \
             'resource'; its output is discarded)"
        );
        outcome.usage.wall = std::time::Duration::from_millis(2_300);
        assert!(failure.describe(&outcome).contains(" failed after 2.3 s: "), "{}", failure.describe(&outcome));
    }
}
