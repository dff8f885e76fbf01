//! The jail's filesystem methods, seen from the host: one request frame to PID 1 and its answer
//! ([`request_on`]), and watches, each on a lane of its own whose events a thread of its own reads
//! ([`JailWatch`]). PID 1 does the work inside the jail (see `strata_jail::files` and `strata_jail::watch`).

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;

use strata_jail::proto::{self, Entry, HostFrame, JailFrame, WatchEvent};

use super::{JailError, reply_on};

/// What PID 1 answered a filesystem request.
#[derive(Debug)]
pub enum FileAnswer {
    /// A listing's entries.
    Entries(Vec<Entry>),
    /// One entry (`Stat`, `Rename`).
    Entry(Entry),
    /// Whether `MakeDir` created a directory.
    DirMade(bool),
    /// `Remove` completed.
    Removed,
}

/// Sends a filesystem request (`ListDir`, `Stat`, `MakeDir`, `Rename`, `Remove`) on the connection `ctl` and
/// reads its answer. A listing is read chunk by chunk and never past the `max_entries` it asked for.
pub(super) fn request_on(ctl: BorrowedFd<'_>, frame: &HostFrame) -> Result<FileAnswer, JailError> {
    let max = match frame {
        HostFrame::ListDir { max_entries, .. } => *max_entries as usize,
        _ => 0,
    };
    proto::send(ctl, frame, &[])?;
    let mut listing = Vec::new();
    loop {
        match reply_on(ctl)? {
            (JailFrame::Entries { entries, done }, _) => {
                if listing.len() + entries.len() > max {
                    return Err(JailError::ListTooLarge { limit: max as u32 });
                }
                listing.extend(entries);
                if done {
                    return Ok(FileAnswer::Entries(listing));
                }
            }
            (JailFrame::ListTooLarge { limit }, _) => return Err(JailError::ListTooLarge { limit }),
            (JailFrame::Entry { entry }, _) => return Ok(FileAnswer::Entry(entry)),
            (JailFrame::DirMade { created }, _) => return Ok(FileAnswer::DirMade(created)),
            (JailFrame::Removed, _) => return Ok(FileAnswer::Removed),
            (JailFrame::FileError { errno, message }, _) => return Err(JailError::File { errno, message }),
            (other, _) => return Err(JailError::Protocol(format!("unexpected {other:?} for a file request"))),
        }
    }
}

/// A running watch of the jail: its lane, and the thread that reads the lane's event frames.
/// [`stop`](JailWatch::stop) (or dropping it) ends both, and PID 1's inotify watch with them.
#[derive(Debug)]
pub struct JailWatch {
    lane: Arc<OwnedFd>,
    reader: Mutex<Option<JoinHandle<()>>>,
}

/// The number every watch has on its own lane.
const WATCH_ID: u64 = 1;

impl JailWatch {
    /// Starts a watch of `path` on `lane` (a lane of its own) and hands its events to `on_events` from a thread
    /// of its own, with whether PID 1 lost events before them, until `on_events` answers false or the watch is
    /// stopped.
    pub(super) fn start(
        lane: OwnedFd,
        path: &str,
        recursive: bool,
        mut on_events: impl FnMut(Vec<WatchEvent>, bool) -> bool + Send + 'static,
    ) -> Result<JailWatch, JailError> {
        let frame = HostFrame::Watch { id: WATCH_ID, path: path.to_owned(), recursive };
        proto::send(lane.as_fd(), &frame, &[])?;
        match reply_on(lane.as_fd())? {
            (JailFrame::Watching { id: WATCH_ID }, _) => {}
            (JailFrame::FileError { errno, message }, _) => return Err(JailError::File { errno, message }),
            (other, _) => return Err(JailError::Protocol(format!("unexpected {other:?} for Watch"))),
        }
        let lane = Arc::new(lane);
        let socket = lane.clone();
        let reader = std::thread::Builder::new()
            .name("strata-jail-watch".into())
            .spawn(move || {
                while let Ok(Some((frame, _))) = proto::recv::<JailFrame>(socket.as_fd()) {
                    if let JailFrame::WatchEvents { events, overflowed, .. } = frame
                        && !on_events(events, overflowed)
                    {
                        return;
                    }
                }
            })
            .map_err(JailError::Spawn)?;
        Ok(JailWatch { lane, reader: Mutex::new(Some(reader)) })
    }

    /// Ends the watch: PID 1 is told to stop it, the lane is shut (which ends it too, should the frame not
    /// arrive), and the reader thread is joined.
    pub fn stop(&self) {
        let _ = proto::send_nowait(self.lane.as_fd(), &HostFrame::Unwatch { id: WATCH_ID });
        let _ =
            nix::sys::socket::shutdown(std::os::fd::AsRawFd::as_raw_fd(&*self.lane), nix::sys::socket::Shutdown::Both);
        let reader = self.reader.lock().unwrap_or_else(PoisonError::into_inner).take();
        if let Some(reader) = reader {
            let _ = reader.join();
        }
    }
}

impl Drop for JailWatch {
    fn drop(&mut self) {
        self.stop();
    }
}
