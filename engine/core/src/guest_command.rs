//! A job as a command line in a Linux guest: what the process and microVM tiers run for every job kind but wasm.
//!
//! `Command` runs its argv as given; `Native` copies its host program to `/run/strata/bin/<name>` and runs it;
//! `Python` runs the guest's `python3` with `-c CODE`, `-m MODULE`, or its script copied to
//! `/run/strata/scripts/<name>`. A host file is opened here, once, and must be a regular file (a device or a FIFO
//! would make the host read without end); its guest name is its file name with `/` and NUL replaced.

use std::fs::File;
use std::path::Path;

use crate::error::TierError;
use crate::job::{Job, PythonSource};
use crate::outcome::TierKind;

/// Where the guest keeps what Strata puts there (copied programs and scripts, the egress socket); no grant may
/// take it.
pub const PROGRAM_DIR: &str = "/run/strata";

/// A job as a command line in the guest.
#[derive(Debug)]
pub struct GuestCommand {
    /// The command line, program first.
    pub argv: Vec<String>,
    /// The host file the job needs in the guest before it runs, if any.
    pub copy_in: Option<CopyIn>,
}

/// A host file to copy into the guest before a job runs.
#[derive(Debug)]
pub struct CopyIn {
    /// The file, opened (a regular file).
    pub file: File,
    /// Its size when it was opened.
    pub size: u64,
    /// Where it goes in the guest (`argv` names it there).
    pub guest: String,
}

impl GuestCommand {
    /// Translates `job` for `tier`; a wasm job is [`TierError::WrongJob`], an empty argv
    /// [`TierError::WrongFormat`], a host file that cannot be opened [`TierError::ReadInput`].
    pub fn new(job: &Job, tier: TierKind) -> Result<GuestCommand, TierError> {
        match job {
            Job::Command { argv } if argv.first().is_some_and(|program| !program.is_empty()) => {
                Ok(GuestCommand { argv: argv.clone(), copy_in: None })
            }
            Job::Command { .. } => {
                Err(TierError::WrongFormat { what: "the command".into(), expected: "a non-empty argv" })
            }
            Job::Native { program, args } => {
                let copy = CopyIn::open(program, "bin")?;
                let mut argv = vec![copy.guest.clone()];
                argv.extend(args.iter().cloned());
                Ok(GuestCommand { argv, copy_in: Some(copy) })
            }
            Job::Python { source, args } => {
                let mut argv = vec!["python3".to_owned()];
                let mut copy_in = None;
                match source {
                    PythonSource::Code(code) => argv.extend(["-c".to_owned(), code.clone()]),
                    PythonSource::Module(module) => argv.extend(["-m".to_owned(), module.clone()]),
                    PythonSource::File(path) => {
                        let copy = CopyIn::open(path, "scripts")?;
                        argv.push(copy.guest.clone());
                        copy_in = Some(copy);
                    }
                }
                argv.extend(args.iter().cloned());
                Ok(GuestCommand { argv, copy_in })
            }
            Job::Wasm { .. } => Err(TierError::WrongJob { tier, job: job.kind() }),
        }
    }
}

impl CopyIn {
    /// Opens the host file `path`, bound for `PROGRAM_DIR/<dir>/<its name>`.
    fn open(path: &Path, dir: &str) -> Result<CopyIn, TierError> {
        let unreadable = |source| TierError::ReadInput { path: path.to_owned(), source };
        let file = File::open(path).map_err(unreadable)?;
        let meta = file.metadata().map_err(unreadable)?;
        if !meta.is_file() {
            return Err(TierError::WrongFormat { what: path.display().to_string(), expected: "a regular file" });
        }
        let name = path
            .file_name()
            .map(|name| name.to_string_lossy().replace(['/', '\0'], "_"))
            .filter(|name| !name.is_empty() && name != "." && name != "..")
            .unwrap_or_else(|| "program".into());
        Ok(CopyIn { file, size: meta.len(), guest: format!("{PROGRAM_DIR}/{dir}/{name}") })
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;

    fn python(source: PythonSource) -> Job {
        Job::Python { source, args: vec!["a".into()] }
    }

    #[test]
    fn each_job_kind_becomes_its_command_line() {
        let command = GuestCommand::new(&Job::Command { argv: vec!["ls".into(), "-l".into()] }, TierKind::Process);
        assert_eq!(command.expect("command").argv, ["ls", "-l"]);
        let code = GuestCommand::new(&python(PythonSource::Code("print(1)".into())), TierKind::Microvm);
        assert_eq!(code.expect("code").argv, ["python3", "-c", "print(1)", "a"]);
        let module = GuestCommand::new(&python(PythonSource::Module("http.server".into())), TierKind::Process);
        assert_eq!(module.expect("module").argv, ["python3", "-m", "http.server", "a"]);

        let mut script = tempfile::Builder::new().suffix(".py").tempfile().expect("tempfile");
        script.write_all(b"print(2)").expect("write");
        let name = script.path().file_name().expect("name").to_string_lossy().into_owned();
        let file = GuestCommand::new(&python(PythonSource::File(script.path().into())), TierKind::Process);
        let file = file.expect("script");
        let guest = format!("/run/strata/scripts/{name}");
        assert_eq!(file.argv, ["python3", guest.as_str(), "a"]);
        let copy = file.copy_in.expect("a copy");
        assert_eq!((copy.guest.as_str(), copy.size), (guest.as_str(), 8));

        let native = Job::Native { program: script.path().into(), args: vec!["x".into()] };
        let native = GuestCommand::new(&native, TierKind::Microvm).expect("native");
        assert_eq!(native.argv, [format!("/run/strata/bin/{name}").as_str(), "x"]);
    }

    #[test]
    fn what_no_guest_command_can_be_is_refused() {
        let empty = GuestCommand::new(&Job::Command { argv: Vec::new() }, TierKind::Process).expect_err("empty");
        assert_eq!(empty.code(), "wrong_format");
        let blank = GuestCommand::new(&Job::Command { argv: vec![String::new()] }, TierKind::Process);
        assert_eq!(blank.expect_err("blank").code(), "wrong_format");
        let wasm = GuestCommand::new(&Job::wasm_file("m.wasm", Vec::new()), TierKind::Microvm).expect_err("wasm");
        assert!(matches!(wasm, TierError::WrongJob { tier: TierKind::Microvm, .. }), "{wasm:?}");
        let missing = Job::Native { program: "/no/such/program".into(), args: Vec::new() };
        assert_eq!(GuestCommand::new(&missing, TierKind::Process).expect_err("missing").code(), "input_unreadable");
        // A device would be read without end: only regular files are copied.
        for odd in ["/dev/zero", "/tmp"] {
            let job = Job::Native { program: odd.into(), args: Vec::new() };
            assert_eq!(GuestCommand::new(&job, TierKind::Microvm).expect_err(odd).code(), "wrong_format", "{odd}");
        }
    }
}
