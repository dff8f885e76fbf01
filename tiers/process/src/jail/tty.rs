//! The host's side of a job's terminal ([`strata_core::Terminal`]): PID 1 makes the terminal from the jail's
//! own `devpts` and hands its master over with `Started` ([`strata_jail::tty`]). Here the master is read for the
//! job's output and written with its input, and the handle's window sizes are applied to it while the job runs.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use nix::errno::Errno;
use nix::fcntl::OFlag;
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use strata_core::{PumpStop, Pumped, StdinStream, Terminal, WindowSize};
use strata_jail::proto::{self, Exec, HostFrame, JailFrame, TtySize};

use super::{JailError, set_nonblocking};

/// How much input is written to the terminal at once.
const INPUT_CHUNK: usize = 4096;

/// How long an input write waits for room before it looks again whether the job has ended.
const INPUT_RECHECK_MS: u8 = 100;

/// A running job's terminal, while its master is held here. Dropping it stops the input and detaches the
/// handle (later sizes are only kept).
pub(super) struct TtyLink {
    terminal: Terminal,
    done: Arc<AtomicBool>,
    _input: Option<PumpStop>,
}

impl Drop for TtyLink {
    fn drop(&mut self) {
        self.done.store(true, Ordering::SeqCst);
        self.terminal.detach();
    }
}

/// The three host ends a job's pump works with: stdin (written with the job's buffered input), stdout and
/// stderr. On a terminal the first two are the master, and stderr a pipe already at its end.
pub(super) type Ends = (OwnedFd, OwnedFd, OwnedFd);

fn tty_size(size: WindowSize) -> TtySize {
    TtySize { rows: size.rows, cols: size.cols }
}

/// Sends `exec` on `ctl` to run on a terminal of the jail's, with `fds` (its cgroup files and program) attached,
/// and waits for the job to start: its terminal's master arrives with `Started`. The terminal then takes
/// `terminal`'s sizes and `stdin_stream`'s bytes as they come.
pub(super) fn start(
    ctl: BorrowedFd<'_>,
    exec: &Exec,
    fds: &[BorrowedFd<'_>],
    terminal: &Terminal,
    stdin_stream: Option<BorrowedFd<'_>>,
) -> Result<(TtyLink, Ends), JailError> {
    let mut exec = exec.clone();
    let asked = terminal.size();
    exec.tty = Some(tty_size(asked));
    proto::send(ctl, &HostFrame::Exec(exec), fds)?;
    let master = match proto::recv::<JailFrame>(ctl) {
        Ok(Some((JailFrame::Started { .. }, mut fds))) if fds.len() == 1 => fds.remove(0),
        Ok(Some((JailFrame::ExecFailed { stage, errno, message }, _))) => {
            return Err(JailError::NotStarted { stage, errno, message });
        }
        Ok(Some((other, _))) => {
            return Err(JailError::Protocol(format!("unexpected {other:?} for a job on a terminal")));
        }
        Ok(None) => return Err(JailError::Ended),
        Err(err) => return Err(err.into()),
    };
    // The descriptor's flags live on the open file description, which every copy below shares.
    set_nonblocking(master.as_fd()).map_err(|e| JailError::Spawn(e.into()))?;
    let master = Arc::new(master);
    let resized = master.clone();
    let now = terminal.attach(move |size| {
        let _ = strata_jail::tty::set_size(&resized.as_fd(), tty_size(size));
    });
    // A resize that came while the job was starting.
    if now != asked {
        let _ = strata_jail::tty::set_size(&master.as_fd(), tty_size(now));
    }
    let done = Arc::new(AtomicBool::new(false));
    let input = match stdin_stream {
        Some(stream) => Some(pump_input(stream, master.clone(), done.clone())?),
        None => None,
    };
    let link = TtyLink { terminal: terminal.clone(), done, _input: input };
    let copy = || master.try_clone().map_err(JailError::Spawn);
    let (stderr, ended) = nix::unistd::pipe2(OFlag::O_CLOEXEC).map_err(|e| JailError::Spawn(e.into()))?;
    drop(ended);
    Ok((link, (copy()?, copy()?, stderr)))
}

/// Writes `stream`'s bytes into the terminal as they come, on a thread of the stream's (see
/// [`StdinStream::pump`]); a write that finds the terminal's input queue full waits for room, and gives up once
/// `done` is set (the job ended while nothing read its input).
fn pump_input(stream: BorrowedFd<'_>, master: Arc<OwnedFd>, done: Arc<AtomicBool>) -> Result<PumpStop, JailError> {
    let stream = StdinStream::new(stream.try_clone_to_owned().map_err(JailError::Spawn)?);
    stream
        .pump(INPUT_CHUNK, move |pumped| match pumped {
            Pumped::Data(bytes) => write_all(&master, bytes, &done),
            // The end of input is not a terminal's: a program reads end of file after `0x04` (Ctrl-D) at the
            // start of a line, which the writer sends like any other byte.
            Pumped::End | Pumped::Failed(_) => false,
        })
        .map_err(JailError::Spawn)
}

fn write_all(master: &OwnedFd, mut bytes: &[u8], done: &AtomicBool) -> bool {
    while !bytes.is_empty() {
        match nix::unistd::write(master, bytes) {
            Ok(n) => bytes = &bytes[n.min(bytes.len())..],
            Err(Errno::EINTR) => {}
            Err(Errno::EAGAIN) => {
                if done.load(Ordering::SeqCst) {
                    return false;
                }
                let mut fds = [PollFd::new(master.as_fd(), PollFlags::POLLOUT)];
                let _ = poll(&mut fds, PollTimeout::from(INPUT_RECHECK_MS));
            }
            Err(_) => return false,
        }
    }
    !done.load(Ordering::SeqCst)
}
