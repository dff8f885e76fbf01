//! A file's stamp: what identifies its bytes without reading them, so that bytes checked once (hashed in full)
//! need not be hashed again while the stamp is unchanged.
//!
//! A stamp is the file's device, inode, size, modification time and change time. Replacing the file (a rename
//! over it, or a new file in its place) changes the inode or the change time; any write, truncation, `chmod`
//! or `utimensat` moves the change time to "now", which no user process can set (only the kernel does, and
//! only forward with the clock). So an unchanged stamp means unchanged bytes, with two conditions:
//!
//! - **Settled.** File times come from a coarse clock: a write in the same clock tick as the check may leave
//!   the change time where it was. A stamp vouches for the bytes only when the change time is older than the
//!   check by [`SETTLE`] ([`FileStamp::settled`]); a file changed more recently is hashed again next time.
//! - **No writer holding a mapping.** A process that mapped the file shared and writable, and dirtied a page
//!   before the check, can change that page's bytes again without any time moving until the kernel writes it
//!   back. Stamps cannot see that (only a full hash can); it takes write access to the file and a mapping made
//!   before the check, which whoever owns the file has.
//!
//! The same rule serves the snapshot verifier (a sealed record of the stamps its files were verified with) and
//! the wasm tier's module cache (the stamp of the `.cwasm` its digest was last checked against).

use std::fs::Metadata;
use std::os::unix::fs::MetadataExt;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use nix::sys::stat::FileStat;

/// How much older than a check a file's change time must be for its stamp to vouch for the bytes checked:
/// many times the coarsest clock tick file times use (10 ms at `HZ=100`).
pub const SETTLE: Duration = Duration::from_secs(1);

/// A file's device, inode, size and modification and change times (seconds and nanoseconds).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FileStamp {
    /// The device.
    pub dev: u64,
    /// The inode.
    pub ino: u64,
    /// The size in bytes.
    pub len: u64,
    /// The modification time.
    pub mtime: (i64, i64),
    /// The change time (set by the kernel only).
    pub ctime: (i64, i64),
}

impl FileStamp {
    /// The stamp of a `stat` result.
    pub fn of_stat(st: &FileStat) -> FileStamp {
        FileStamp {
            dev: st.st_dev,
            ino: st.st_ino,
            len: u64::try_from(st.st_size).unwrap_or(u64::MAX),
            mtime: (st.st_mtime, st.st_mtime_nsec),
            ctime: (st.st_ctime, st.st_ctime_nsec),
        }
    }

    /// The stamp of a file's metadata.
    pub fn of_metadata(meta: &Metadata) -> FileStamp {
        FileStamp {
            dev: meta.dev(),
            ino: meta.ino(),
            len: meta.len(),
            mtime: (meta.mtime(), meta.mtime_nsec()),
            ctime: (meta.ctime(), meta.ctime_nsec()),
        }
    }

    /// Whether the file last changed at least `settle` ([`SETTLE`] but in tests) before `checked` (when its
    /// bytes were read), so that any later change moves its change time.
    pub fn settled(&self, checked: SystemTime, settle: Duration) -> bool {
        let Some(limit) = checked.checked_sub(settle) else { return false };
        let Ok(limit) = limit.duration_since(UNIX_EPOCH) else { return false };
        let (secs, nanos) = self.ctime;
        match u64::try_from(secs) {
            Ok(secs) => (secs, nanos) < (limit.as_secs(), i64::from(limit.subsec_nanos())),
            Err(_) => true,
        }
    }

    /// The stamp as text: `DEV INO LEN MTIME.NS CTIME.NS` ([`FileStamp::parse`] reads it back).
    pub fn render(&self) -> String {
        let s = self;
        format!("{} {} {} {}.{} {}.{}", s.dev, s.ino, s.len, s.mtime.0, s.mtime.1, s.ctime.0, s.ctime.1)
    }

    /// A stamp [`FileStamp::render`] wrote; `None` for anything else.
    pub fn parse(text: &str) -> Option<FileStamp> {
        let time = |s: &str| -> Option<(i64, i64)> {
            let (secs, nanos) = s.split_once('.')?;
            let nanos: i64 = nanos.parse().ok()?;
            (0..1_000_000_000).contains(&nanos).then_some(())?;
            Some((secs.parse().ok()?, nanos))
        };
        let mut fields = text.split(' ');
        let stamp = FileStamp {
            dev: fields.next()?.parse().ok()?,
            ino: fields.next()?.parse().ok()?,
            len: fields.next()?.parse().ok()?,
            mtime: time(fields.next()?)?,
            ctime: time(fields.next()?)?,
        };
        fields.next().is_none().then_some(stamp)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stamp() -> FileStamp {
        FileStamp { dev: 2049, ino: 77, len: 4096, mtime: (1_700_000_000, 5), ctime: (1_700_000_001, 999_999_999) }
    }

    #[test]
    fn a_rendered_stamp_parses_back() {
        let text = stamp().render();
        assert_eq!(text, "2049 77 4096 1700000000.5 1700000001.999999999");
        assert_eq!(FileStamp::parse(&text), Some(stamp()));
    }

    #[test]
    fn anything_but_a_rendered_stamp_is_refused() {
        for bad in ["", "1 2 3 4.5", "1 2 3 4.5 6.7 8", "1 2 3 4.5 6.1000000000", "1 2 -3 4.5 6.7", "1  2 3 4.5 6.7"] {
            assert_eq!(FileStamp::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn a_stamp_changed_within_the_settling_time_is_not_settled() {
        let changed = UNIX_EPOCH + Duration::new(1_700_000_001, 999_999_999);
        assert!(!stamp().settled(changed, SETTLE));
        assert!(!stamp().settled(changed + SETTLE, SETTLE));
        assert!(stamp().settled(changed + SETTLE + Duration::from_nanos(1), SETTLE));
        assert!(stamp().settled(changed + Duration::from_nanos(1), Duration::ZERO));
    }

    #[test]
    fn the_stamp_of_a_file_is_its_metadata() {
        let file = tempfile::NamedTempFile::new().expect("temp");
        let meta = file.as_file().metadata().expect("meta");
        let st = nix::sys::stat::fstat(file.as_file()).expect("fstat");
        assert_eq!(FileStamp::of_stat(&st), FileStamp::of_metadata(&meta));
    }
}
