//! The monitor's control loop: builds the machine [`Request::Start`] describes, puts the main thread under the VMM
//! filter, starts the vCPUs, then answers one request at a time until [`Request::Stop`] or the engine hangs up.

use std::fs::File;
use std::io::Write;
use std::os::fd::{AsFd, OwnedFd};

use super::build::{self, Built, chain};
use crate::machine::Machine;
use crate::proto::{self, Reply, Request, ThreadKind};
use crate::seccomp;
use crate::vstate::vcpu::VcpuExit;

fn reply(ctl: &OwnedFd, message: &Reply) {
    if let Err(e) = proto::send(ctl.as_fd(), message, &[]) {
        eprintln!("strata-vmm: {e}");
        std::process::exit(1);
    }
}

fn failed(stage: &str, message: impl Into<String>) -> Reply {
    Reply::Failed { stage: stage.into(), message: message.into() }
}

/// Serves the engine; never returns.
pub fn serve(ctl: OwnedFd) -> ! {
    let Built { mut machine, serial } = loop {
        match proto::recv::<Request>(ctl.as_fd()) {
            Ok(Some((Request::Start(spec), fds))) => match build::build(&spec, fds) {
                Ok(built) => break built,
                Err(message) => {
                    reply(&ctl, &failed("start", message));
                    std::process::exit(1);
                }
            },
            Ok(Some((Request::Stop, _))) | Ok(None) => std::process::exit(0),
            Ok(Some((Request::Probe(ThreadKind::Vmm), _))) => reply(&ctl, &probe()),
            Ok(Some((other, _))) => reply(&ctl, &failed("start", format!("{other:?} before the machine is built"))),
            Err(e) => {
                eprintln!("strata-vmm: {e}");
                std::process::exit(1);
            }
        }
    };
    // The largest file the monitor may write is a snapshot's memory file: a monitor taken over by its guest cannot
    // fill the engine's disk through the files it is handed.
    let largest =
        machine.memory().size().max(crate::persist::MAX_STATE_BYTES + crate::persist::STATE_HEADER_LEN as u64);
    let limit = libc::rlimit { rlim_cur: largest, rlim_max: largest };
    // SAFETY: setrlimit(2) with a valid rlimit struct; it only lowers this process's own limit.
    if unsafe { libc::setrlimit(libc::RLIMIT_FSIZE, &limit) } != 0 {
        reply(&ctl, &failed("limits", std::io::Error::last_os_error().to_string()));
        std::process::exit(1);
    }
    if let Err(e) = seccomp::enter_vmm() {
        reply(&ctl, &failed("seccomp", e.to_string()));
        std::process::exit(1);
    }
    if let Err(e) = machine.resume() {
        reply(&ctl, &failed("start", chain(&e)));
        std::process::exit(1);
    }
    reply(&ctl, &Reply::Started);
    let mut ended: Option<Vec<String>> = None;
    loop {
        let (request, fds) = match proto::recv::<Request>(ctl.as_fd()) {
            Ok(Some(message)) => message,
            Ok(None) => std::process::exit(0),
            Err(e) => {
                eprintln!("strata-vmm: {e}");
                std::process::exit(1);
            }
        };
        let answer = match request {
            Request::Status => {
                if ended.is_none() && machine.has_stopped() {
                    ended = Some(stop_all(&mut machine));
                }
                Reply::Status { stopped: ended.is_some(), exits: ended.clone().unwrap_or_default() }
            }
            Request::Console => {
                let text = String::from_utf8_lossy(&serial.contents()).into_owned();
                Reply::Console { text, dropped: serial.dropped() }
            }
            Request::Snapshot => snapshot(&mut machine, &mut ended, fds),
            Request::Probe(ThreadKind::Vmm) => probe(),
            Request::Probe(kind) => {
                failed("probe", format!("the {} thread's probe is the probe device (a guest write to it)", kind.name()))
            }
            Request::Stop => {
                drop(machine);
                reply(&ctl, &Reply::Done);
                std::process::exit(0);
            }
            Request::Jail(_) | Request::Start(_) => failed("request", "the machine is already built"),
        };
        reply(&ctl, &answer);
    }
}

/// Pauses every vCPU for good (the guest stopped on its own): how each ended.
fn stop_all(machine: &mut Machine) -> Vec<String> {
    match machine.pause() {
        Ok(exits) => exits.iter().map(|e| format!("{e:?}")).collect(),
        Err(e) => vec![chain(&e)],
    }
}

/// Pauses at a safe point, saves into the two files given (state, memory), resumes.
fn snapshot(machine: &mut Machine, ended: &mut Option<Vec<String>>, fds: Vec<OwnedFd>) -> Reply {
    if let Some(exits) = ended {
        return failed("snapshot", format!("the guest has stopped ({})", exits.join(", ")));
    }
    let [state, memory]: [OwnedFd; 2] = match fds.try_into() {
        Ok(files) => files,
        Err(fds) => return failed("snapshot", format!("{} descriptors (the state's and the memory's)", fds.len())),
    };
    let (mut state, memory) = (File::from(state), File::from(memory));
    let exits = match machine.pause() {
        Ok(exits) => exits,
        Err(e) => return failed("snapshot", chain(&e)),
    };
    if !exits.iter().all(|e| matches!(e, VcpuExit::Stopped)) {
        let exits: Vec<String> = exits.iter().map(|e| format!("{e:?}")).collect();
        let message = format!("the guest stopped on its own before the snapshot ({})", exits.join(", "));
        *ended = Some(exits);
        return failed("snapshot", message);
    }
    let saved = machine.save(&memory).map_err(|e| chain(&e)).and_then(|s| s.to_bytes().map_err(|e| chain(&e)));
    let written =
        saved.and_then(|bytes| state.write_all(&bytes).map(|()| bytes.len() as u64).map_err(|e| e.to_string()));
    if let Err(e) = machine.resume() {
        return failed("resume", chain(&e));
    }
    match written {
        Ok(state_bytes) => Reply::Saved { state_bytes },
        Err(message) => failed("snapshot", message),
    }
}

/// The VMM thread's probe: a call its filter refuses. Returns only when the filter let it through.
fn probe() -> Reply {
    // SAFETY: socket(2) with integer arguments; the descriptor, if any, is closed at once.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0) };
    if fd >= 0 {
        // SAFETY: `fd` was just returned by socket(2) and is ours alone.
        unsafe { libc::close(fd) };
    }
    failed("probe", "socket(AF_INET) was allowed: no filter on the VMM thread")
}
