//! A path inside a sandbox, checked once by the one rule set every grant and every file method uses.
//!
//! A [`GuestPath`] is absolute, has no NUL byte and no `..` component, and is normalised: `.` components and
//! repeated or trailing slashes are dropped (`/data/./x//` is `/data/x`; the root is `/`). A component is at most
//! [`MAX_COMPONENT`] bytes and the whole path at most [`MAX_PATH`] bytes, Linux's own limits, so a path the guest
//! could not name is refused before any host work is done for it. File methods that change or read a file
//! additionally refuse the root and the guest's kernel filesystems ([`GuestPath::check_file_target`]).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// The longest component Linux accepts (`NAME_MAX`).
pub const MAX_COMPONENT: usize = 255;
/// The longest path Linux accepts (`PATH_MAX`, counting the NUL it does not store here).
pub const MAX_PATH: usize = 4095;

/// The guest's kernel filesystems: file methods never read or write inside them.
pub const KERNEL_PATHS: [&str; 3] = ["/proc", "/sys", "/dev"];

/// A guest path that breaks the rules, and which rule.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("guest path {path:?} {reason}")]
pub struct GuestPathError {
    /// The path as given.
    pub path: String,
    /// The rule it breaks, as a phrase (`"must be absolute"`).
    pub reason: &'static str,
}

/// A checked, normalised absolute path inside a sandbox.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct GuestPath(String);

impl GuestPath {
    /// Checks and normalises `path`.
    pub fn new(path: &str) -> Result<GuestPath, GuestPathError> {
        let err = |reason| GuestPathError { path: truncated(path), reason };
        if !path.starts_with('/') {
            return Err(err("must be absolute"));
        }
        if path.contains('\0') {
            return Err(err("contains a NUL byte"));
        }
        if path.len() > MAX_PATH {
            return Err(err("is longer than 4095 bytes"));
        }
        let mut normal = String::with_capacity(path.len());
        for part in path.split('/') {
            match part {
                "" | "." => {}
                ".." => return Err(err("must not contain `..`")),
                _ if part.len() > MAX_COMPONENT => return Err(err("has a component longer than 255 bytes")),
                _ => {
                    normal.push('/');
                    normal.push_str(part);
                }
            }
        }
        if normal.is_empty() {
            normal.push('/');
        }
        Ok(GuestPath(normal))
    }

    /// The root directory, `/`.
    pub fn root() -> GuestPath {
        GuestPath("/".into())
    }

    /// The normalised path.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Whether this is `/`.
    pub fn is_root(&self) -> bool {
        self.0 == "/"
    }

    /// Whether this path is `dir` or lies below it.
    pub fn is_within(&self, dir: &GuestPath) -> bool {
        self.relative_to(dir).is_some()
    }

    /// The part of this path below `dir` (`""` for `dir` itself, no leading slash), or `None` outside it.
    pub fn relative_to(&self, dir: &GuestPath) -> Option<&str> {
        if dir.is_root() {
            return Some(&self.0[1..]);
        }
        match self.0.strip_prefix(dir.as_str())? {
            "" => Some(""),
            rest => rest.strip_prefix('/'),
        }
    }

    /// This path with one more component, `name` (a single component: no `/`, not `.` or `..`).
    pub fn join(&self, name: &str) -> Result<GuestPath, GuestPathError> {
        if name.is_empty() || name.contains('/') || name == "." || name == ".." {
            return Err(GuestPathError { path: truncated(name), reason: "is not a single file name" });
        }
        let joined = if self.is_root() { format!("/{name}") } else { format!("{}/{name}", self.0) };
        GuestPath::new(&joined)
    }

    /// The directory holding this path (`None` for the root).
    pub fn parent(&self) -> Option<GuestPath> {
        if self.is_root() {
            return None;
        }
        let cut = self.0.rfind('/').unwrap_or(0);
        Some(if cut == 0 { GuestPath::root() } else { GuestPath(self.0[..cut].to_owned()) })
    }

    /// The last component (`None` for the root).
    pub fn file_name(&self) -> Option<&str> {
        (!self.is_root()).then(|| self.0.rsplit('/').next().unwrap_or_default())
    }

    /// `path` checked as the target of a file method that reads or changes one file ([`check_file_target`](Self::check_file_target)).
    pub fn file_target(path: &str) -> Result<GuestPath, GuestPathError> {
        let path = GuestPath::new(path)?;
        path.check_file_target()?;
        Ok(path)
    }

    /// Refuses a directory no method may describe, list or watch: anything in the guest's kernel filesystems (the
    /// root itself may be).
    pub fn check_readable(&self) -> Result<(), GuestPathError> {
        if self.is_root() { Ok(()) } else { self.check_file_target() }
    }

    /// Refuses what no file method may read or change: the root itself and anything in the guest's kernel
    /// filesystems (`/proc`, `/sys`, `/dev`).
    pub fn check_file_target(&self) -> Result<(), GuestPathError> {
        let err = |reason| GuestPathError { path: self.0.clone(), reason };
        if self.is_root() {
            return Err(err("is the root directory"));
        }
        if KERNEL_PATHS.iter().any(|k| self.is_within(&GuestPath((*k).to_owned()))) {
            return Err(err("is in the guest's kernel filesystems (/proc, /sys, /dev)"));
        }
        Ok(())
    }
}

/// At most 256 bytes of a refused path, for its error message (a refused path can be megabytes).
fn truncated(path: &str) -> String {
    if path.len() <= 256 {
        return path.to_owned();
    }
    let mut end = 256;
    while !path.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &path[..end])
}

impl fmt::Display for GuestPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl AsRef<str> for GuestPath {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl FromStr for GuestPath {
    type Err = GuestPathError;

    fn from_str(path: &str) -> Result<GuestPath, GuestPathError> {
        GuestPath::new(path)
    }
}

impl PartialEq<str> for GuestPath {
    fn eq(&self, other: &str) -> bool {
        self.0 == other
    }
}

impl PartialEq<&str> for GuestPath {
    fn eq(&self, other: &&str) -> bool {
        self.0 == *other
    }
}

impl Serialize for GuestPath {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.0.serialize(serializer)
    }
}

/// Parsed by the same rules on the way in: a manifest or request with a bad path is refused.
impl<'de> Deserialize<'de> for GuestPath {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<GuestPath, D::Error> {
        let text = String::deserialize(deserializer)?;
        GuestPath::new(&text).map_err(serde::de::Error::custom)
    }
}

/// A tier error naming the path and the rule (`guest_path`).
impl From<GuestPathError> for crate::TierError {
    fn from(err: GuestPathError) -> crate::TierError {
        crate::TierError::GuestPath { path: err.path, reason: err.reason.to_owned() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn path(text: &str) -> GuestPath {
        GuestPath::new(text).unwrap_or_else(|err| panic!("{err}"))
    }

    #[test]
    fn paths_are_normalised() {
        assert_eq!(path("/data/./x//"), "/data/x");
        assert_eq!(path("/"), "/");
        assert_eq!(path("//"), "/");
        assert_eq!(path("/a/b/"), "/a/b");
    }

    #[test]
    fn relative_dotdot_nul_and_oversized_paths_are_refused() {
        for (bad, why) in [
            ("data", "must be absolute"),
            ("", "must be absolute"),
            ("/a/../b", "must not contain `..`"),
            ("/..", "must not contain `..`"),
            ("/a\0b", "contains a NUL byte"),
        ] {
            assert_eq!(GuestPath::new(bad).map_err(|e| e.reason), Err(why), "{bad:?}");
        }
        let long_name = format!("/{}", "x".repeat(256));
        assert_eq!(GuestPath::new(&long_name).map_err(|e| e.reason), Err("has a component longer than 255 bytes"));
        let long_path = "/abc".repeat(1100);
        let err = GuestPath::new(&long_path).expect_err("too long");
        assert_eq!(err.reason, "is longer than 4095 bytes");
        assert!(err.path.len() < 300, "the message carries a bounded copy of the path");
    }

    #[test]
    fn within_and_relative_respect_component_boundaries() {
        let dir = path("/data");
        assert_eq!(path("/data/x/y").relative_to(&dir), Some("x/y"));
        assert_eq!(path("/data").relative_to(&dir), Some(""));
        assert_eq!(path("/database").relative_to(&dir), None);
        assert_eq!(path("/x").relative_to(&GuestPath::root()), Some("x"));
        assert!(path("/data/x").is_within(&dir));
        assert!(!path("/dat").is_within(&dir));
    }

    #[test]
    fn join_parent_and_file_name() {
        let dir = path("/data");
        assert_eq!(dir.join("x").expect("join"), "/data/x");
        assert_eq!(GuestPath::root().join("x").expect("join"), "/x");
        for bad in ["", ".", "..", "a/b"] {
            assert!(dir.join(bad).is_err(), "{bad:?}");
        }
        assert_eq!(path("/data/x").parent(), Some(dir.clone()));
        assert_eq!(dir.parent(), Some(GuestPath::root()));
        assert_eq!(GuestPath::root().parent(), None);
        assert_eq!(path("/data/x").file_name(), Some("x"));
        assert_eq!(GuestPath::root().file_name(), None);
    }

    #[test]
    fn file_methods_never_target_the_root_or_kernel_filesystems() {
        assert!(path("/").check_file_target().is_err());
        for kernel in ["/proc", "/proc/self/mem", "/sys/kernel", "/dev/kvm"] {
            assert!(path(kernel).check_file_target().is_err(), "{kernel}");
        }
        for fine in ["/process", "/devices", "/tmp/x", "/home/user/sys"] {
            assert!(path(fine).check_file_target().is_ok(), "{fine}");
        }
        assert_eq!(GuestPath::file_target("/tmp//x").expect("fine"), "/tmp/x");
        assert!(GuestPath::file_target("/proc/1/mem").is_err());
        assert!(path("/").check_readable().is_ok() && path("/sys").check_readable().is_err());
    }

    #[test]
    fn serde_round_trips_and_refuses_a_bad_path() {
        let json = serde_json::to_string(&path("/a//b")).expect("encode");
        assert_eq!(json, r#""/a/b""#);
        assert_eq!(serde_json::from_str::<GuestPath>(&json).expect("decode"), "/a/b");
        assert!(serde_json::from_str::<GuestPath>(r#""/a/../etc""#).is_err());
    }
}
