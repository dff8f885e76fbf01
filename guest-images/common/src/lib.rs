//! What every guest-image builder (`strata-python-image`, `strata-rootfs-image`, `strata-kernel-image`) shares:
//! an exclusive lock file so one process builds an image at a time, the names of build trees and which of them no
//! build uses any more, sha256 of files, hex, and the RFC 3339 time recorded in stamps. Each builder maps the
//! `io::Error`s into its own typed error with the path. [`nested`] runs the cargo builds of what Strata embeds
//! and feeds to guests, from build scripts.

#![forbid(unsafe_code)]

pub mod nested;

use std::fs::File;
use std::io::{self, Read};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use sha2::{Digest, Sha256};

/// What an image builder's `ensure` did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EnsureOutcome {
    /// The image was installed already.
    AlreadyInstalled,
    /// The image was built.
    Built,
}

/// An exclusive lock on `path` (created if missing), released when dropped: one builder at a time across processes.
pub fn lock_exclusive(path: &Path) -> io::Result<nix::fcntl::Flock<File>> {
    let file = File::options().create(true).truncate(false).write(true).open(path)?;
    nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusive).map_err(|(_, errno)| errno.into())
}

/// A build tree's key and process from its name: `.<image>-<hash16>.tmp-<pid>` (a build in progress) or
/// `.<image>-<hash16>.old-<pid>` (an install being replaced) → (hash16, pid).
pub fn build_dir_owner<'n>(image: &str, name: &'n str) -> Option<(&'n str, u32)> {
    let rest = name.strip_prefix('.')?.strip_prefix(image)?.strip_prefix('-')?;
    let (hash, pid) = rest.split_once(".tmp-").or_else(|| rest.split_once(".old-"))?;
    Some((hash, pid.parse().ok()?))
}

/// The build trees of `image` in `images` that no build uses: every one for `hash16` made by another process
/// (the caller holds that key's lock, so no other build of it runs) and those of other keys whose process is gone.
/// A missing `images` directory has none.
pub fn stale_build_dirs(images: &Path, image: &str, hash16: &str) -> io::Result<Vec<PathBuf>> {
    let entries = match std::fs::read_dir(images) {
        Ok(entries) => entries,
        Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(err) => return Err(err),
    };
    let me = std::process::id();
    let mut stale = Vec::new();
    for entry in entries {
        let entry = entry?;
        let name = entry.file_name();
        let Some((hash, pid)) = name.to_str().and_then(|name| build_dir_owner(image, name)) else { continue };
        let alive = Path::new("/proc").join(pid.to_string()).exists();
        if if hash == hash16 { pid != me } else { !alive } {
            stale.push(entry.path());
        }
    }
    Ok(stale)
}

/// Lower-case hex of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The sha256 of a file's contents, hex, read in 1 MiB blocks.
pub fn sha256_file(path: &Path) -> io::Result<String> {
    let mut file = File::open(path)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hex(&hasher.finalize()))
}

/// Now, as `YYYY-MM-DDTHH:MM:SSZ`.
pub fn rfc3339_now() -> String {
    rfc3339(SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0))
}

/// Seconds since the epoch as `YYYY-MM-DDTHH:MM:SSZ` (proleptic Gregorian calendar, UTC).
pub fn rfc3339(secs: u64) -> String {
    let (date, rem) = civil(secs);
    format!("{date}T{:02}:{:02}:{:02}Z", rem / 3600, rem % 3600 / 60, rem % 60)
}

/// A time as `YYYY-MM-DDTHH:MM:SS.ffffffZ` (microseconds; UTC; times before the epoch as the epoch).
pub fn rfc3339_micros(time: SystemTime) -> String {
    let since = time.duration_since(UNIX_EPOCH).unwrap_or_default();
    let (date, rem) = civil(since.as_secs());
    format!("{date}T{:02}:{:02}:{:02}.{:06}Z", rem / 3600, rem % 3600 / 60, rem % 60, since.subsec_micros())
}

/// Seconds since the epoch as the date `YYYY-MM-DD` and the seconds into that day.
fn civil(secs: u64) -> (String, u64) {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (format!("{year:04}-{month:02}-{day:02}"), rem)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_dates() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339(1_747_699_199), "2025-05-19T23:59:59Z");
        let time = UNIX_EPOCH + std::time::Duration::from_micros(951_782_400_000_123);
        assert_eq!(rfc3339_micros(time), "2000-02-29T00:00:00.000123Z");
    }

    #[test]
    fn build_dir_names_give_their_key_and_process() {
        assert_eq!(build_dir_owner("kernel", ".kernel-0123456789abcdef.tmp-42"), Some(("0123456789abcdef", 42)));
        assert_eq!(build_dir_owner("debian", ".debian-0123456789abcdef.old-7"), Some(("0123456789abcdef", 7)));
        assert_eq!(build_dir_owner("kernel", ".debian-0123456789abcdef.old-7"), None);
        assert_eq!(build_dir_owner("kernel", "kernel-0123456789abcdef"), None);
        assert_eq!(build_dir_owner("kernel", ".kernel-0123.tmp-x"), None);
    }

    #[test]
    fn stale_build_dirs_are_other_builders_of_the_key_and_dead_ones() {
        let images = std::env::temp_dir().join(format!("strata-image-util-stale-{}", std::process::id()));
        let me = std::process::id();
        let mine = images.join(format!(".kernel-aaaaaaaaaaaaaaaa.tmp-{me}"));
        let same_key = images.join(".kernel-aaaaaaaaaaaaaaaa.tmp-1");
        let other_live = images.join(format!(".kernel-bbbbbbbbbbbbbbbb.tmp-{me}"));
        // pid_max is at most 2^22: no process has this id.
        let other_dead = images.join(".kernel-cccccccccccccccc.old-99999999");
        let other_image = images.join(".debian-cccccccccccccccc.tmp-99999999");
        for dir in [&mine, &same_key, &other_live, &other_dead, &other_image] {
            std::fs::create_dir_all(dir).expect("mkdir");
        }
        let mut stale = stale_build_dirs(&images, "kernel", "aaaaaaaaaaaaaaaa").expect("listed");
        stale.sort();
        assert_eq!(stale, [same_key, other_dead]);
        std::fs::remove_dir_all(&images).expect("cleanup");
        assert!(stale_build_dirs(&images, "kernel", "a").expect("no directory").is_empty());
    }

    #[test]
    fn file_hash_and_lock() {
        let dir = std::env::temp_dir().join(format!("strata-image-util-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let file = dir.join("f");
        std::fs::write(&file, b"abc").expect("write");
        assert_eq!(
            sha256_file(&file).expect("hash"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        let lock = lock_exclusive(&dir.join("l")).expect("lock");
        drop(lock);
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }
}
