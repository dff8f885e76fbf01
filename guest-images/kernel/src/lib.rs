//! The microVM guest kernel: our Kconfig fragment (`strata.config`) applied to Debian's `linux-source-6.1`,
//! built to an uncompressed ELF `vmlinux` (PVH entry, no modules) and cached.
//!
//! [`KernelImage::ensure`] returns the installed kernel, building it first when it is missing: the Debian
//! packages the build needs are installed when missing (as root), the source tarball is extracted into
//! `$STRATA_HOME/images/.kernel-<hash16>.tmp-<pid>/`, configured with `make allnoconfig` and the fragment
//! (`KCONFIG_ALLCONFIG`), then `make olddefconfig`; every option of the fragment is checked in the final
//! `.config` (Kconfig silently drops an option whose dependencies are off: [`KernelError::OptionsDidNotStick`]
//! names them); `make vmlinux` runs with a progress line every [`PROGRESS_EVERY`] compiled files; then
//! `vmlinux`, the final `config`, `build.log` and `stamp.json` are renamed into
//! `$STRATA_HOME/images/kernel-<hash16>/` in one step and the source tree is removed.
//!
//! `<hash16>` starts the [key](KernelImage::key): the sha256 of the source package's version, the fragment's
//! bytes and [`BUILD_FORMAT`]. A new Debian kernel release (a new `linux-source-6.1` version) or any edit of the
//! fragment builds a new kernel beside the old one. Builds take an exclusive lock per key, so concurrent
//! `ensure` calls build once; a build that fails keeps the kernel's output in
//! `$STRATA_HOME/images/kernel-<hash16>.failed.log` and leaves no temporary tree behind (the next build removes
//! what a killed one left).
//!
//! [`KernelImage::verify`] hashes `vmlinux` again and compares it with the stamp.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod build;
mod fragment;

use std::fs::{self, File};
use std::io;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

pub use fragment::{DotConfig, Fragment, KconfigOption, OptionValue};

/// `strata.config`, compiled in.
pub const FRAGMENT: &str = include_str!("../strata.config");

/// The version of the build's meaning: how this crate turns the fragment and the source into `vmlinux`. Bump it
/// when that changes, so kernels built the old way get a new key.
pub const BUILD_FORMAT: u32 = 1;

/// The Debian package holding the kernel source (`/usr/src/linux-source-6.1.tar.xz`).
pub const SOURCE_PACKAGE: &str = "linux-source-6.1";

/// The Debian packages a build needs: the source, and the tools its Makefiles run (`make`, `gcc`, `bc`,
/// `bison`, `flex`, `perl`, `xz`, libelf and OpenSSL headers for the host tools).
pub const BUILD_PACKAGES: &[&str] = &[
    SOURCE_PACKAGE,
    "make",
    "gcc",
    "libc6-dev",
    "bc",
    "bison",
    "flex",
    "perl",
    "xz-utils",
    "libelf-dev",
    "libssl-dev",
];

/// A progress line is printed every this many compiled files.
pub const PROGRESS_EVERY: usize = 100;

const STAMP_FILE: &str = "stamp.json";
const VMLINUX_FILE: &str = "vmlinux";
const CONFIG_FILE: &str = "config";

/// Why the kernel could not be built, found or checked.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    /// The compiled-in fragment is malformed (a build defect).
    #[error("the kernel config fragment is invalid: {0}")]
    Fragment(String),
    /// The source package is not installed and no kernel of this fragment is built.
    #[error(
        "no kernel is built for this config and {SOURCE_PACKAGE} is not installed (run `strata images build kernel`)"
    )]
    SourceUnknown,
    /// The kernel is not built.
    #[error("the kernel is not installed in {} (run `strata images build kernel`)", dir.display())]
    NotInstalled {
        /// Where it would be.
        dir: PathBuf,
    },
    /// Packages the build needs are missing and this process cannot install them.
    #[error("building the kernel needs the Debian packages {} (as root: apt-get install -y {})", .0.join(", "), .0.join(" "))]
    MissingPackages(Vec<String>),
    /// `apt-get install` failed.
    #[error("apt-get install {packages} failed ({status}): {tail}")]
    AptGet {
        /// What was being installed.
        packages: String,
        /// Its exit status.
        status: String,
        /// Its last lines.
        tail: String,
    },
    /// The source package is installed but its tarball is not in `/usr/src`.
    #[error("{SOURCE_PACKAGE} is installed but /usr/src holds no {SOURCE_PACKAGE}.tar.xz")]
    NoSourceTarball,
    /// A step of the build failed.
    #[error("kernel build: {step} failed ({status}); the full log is in {}; it ended with: {tail}", log.display())]
    Step {
        /// The step, e.g. `make vmlinux`.
        step: String,
        /// Its exit status.
        status: String,
        /// Where the whole output was saved.
        log: PathBuf,
        /// Its last lines (errors first).
        tail: String,
    },
    /// Kconfig dropped options of the fragment (their dependencies are off) or set others it says are off.
    #[error(
        "Kconfig did not keep {} option(s) of the fragment: {}; the final .config is in {}",
        options.len(), options.join(", "), log.display()
    )]
    OptionsDidNotStick {
        /// Each as `CONFIG_X (wanted y, got not set)`.
        options: Vec<String>,
        /// The log holding the final `.config`.
        log: PathBuf,
    },
    /// The installed kernel does not match its stamp, or the stamp is unreadable.
    #[error("kernel image {} is corrupt: {detail}; remove it and run `strata images build kernel`", dir.display())]
    Corrupt {
        /// The install directory.
        dir: PathBuf,
        /// What differs.
        detail: String,
    },
    /// A file-system operation or a program run failed.
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

pub(crate) fn io_err<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> KernelError + 'a {
    move |source| KernelError::Io { what, path: path.to_owned(), source }
}

pub(crate) use strata_image_util::hex;

pub(crate) fn sha256_file(path: &Path) -> Result<String, KernelError> {
    strata_image_util::sha256_file(path).map_err(io_err("cannot read", path))
}

/// The build key, hex: sha256 of the source version, the fragment's bytes and [`BUILD_FORMAT`].
pub fn build_key(source_version: &str, fragment: &str) -> String {
    let mut hasher = Sha256::new();
    hasher.update(format!("{SOURCE_PACKAGE} {source_version}\0build-format {BUILD_FORMAT}\0").as_bytes());
    hasher.update(fragment.as_bytes());
    hex(&hasher.finalize())
}

/// The installed kernel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InstalledKernel {
    /// The install directory, `$STRATA_HOME/images/kernel-<hash16>`.
    pub dir: PathBuf,
    /// The uncompressed ELF kernel with its PVH entry note (`dir/vmlinux`).
    pub vmlinux: PathBuf,
    /// The final `.config` it was built with (`dir/config`).
    pub config: PathBuf,
    /// The sha256 of `vmlinux`, hex (see [`KernelImage::verify`]).
    pub sha256: String,
    /// The size of `vmlinux` in bytes.
    pub size_bytes: u64,
    /// The build key, hex.
    pub key: String,
    /// The `linux-source-6.1` package version it was built from, e.g. `6.1.172-1`.
    pub source_version: String,
    /// What `uname -r` says in the guest, e.g. `6.1.172-strata`.
    pub release: String,
}

/// What [`KernelImage::ensure`] did.
pub use strata_image_util::EnsureOutcome;

/// `stamp.json`, written into the install directory before it is renamed into place.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Stamp {
    key: String,
    build_format: u32,
    source_package: String,
    source_version: String,
    fragment_sha256: String,
    release: String,
    vmlinux_sha256: String,
    vmlinux_size: u64,
    /// UTC, RFC 3339.
    built_at: String,
    build_seconds: u64,
    jobs: usize,
    /// The fragment's options that are on, as `.config` lines.
    enabled: Vec<String>,
    /// The fragment's options that are off.
    disabled: Vec<String>,
    /// How many symbols the final `.config` has at `y`.
    config_enabled_count: usize,
}

/// The kernel under `$STRATA_HOME/images`.
#[derive(Debug, Clone)]
pub struct KernelImage {
    images: PathBuf,
    fragment: Fragment,
    /// The source version the key is computed from: the installed package's, else that of a kernel already
    /// built from this fragment; `None` when neither exists.
    source_version: Option<String>,
}

impl KernelImage {
    /// The kernel under `home/images`, from the compiled-in fragment and the installed `linux-source-6.1`
    /// (`dpkg-query`; when it is not installed, the newest kernel already built from this fragment).
    pub fn new(home: &Path) -> Result<KernelImage, KernelError> {
        let fragment = Fragment::parse(FRAGMENT)?;
        let images = home.join("images");
        let source_version = installed_package_version(SOURCE_PACKAGE).or_else(|| newest_build_version(&images));
        Ok(KernelImage { images, fragment, source_version })
    }

    /// The kernel under `home/images` for a given source version (what `new` finds on this host).
    pub fn with_source_version(home: &Path, source_version: &str) -> Result<KernelImage, KernelError> {
        Ok(KernelImage {
            images: home.join("images"),
            fragment: Fragment::parse(FRAGMENT)?,
            source_version: Some(source_version.to_owned()),
        })
    }

    /// The parsed fragment.
    pub fn fragment(&self) -> &Fragment {
        &self.fragment
    }

    /// The `linux-source-6.1` version the kernel is (or would be) built from; `None` when the package is not
    /// installed and no kernel of this fragment is built.
    pub fn source_version(&self) -> Option<&str> {
        self.source_version.as_deref()
    }

    /// The build key, hex (64 digits), when the source version is known: see [`build_key`].
    pub fn key(&self) -> Option<String> {
        self.source_version.as_deref().map(|version| build_key(version, FRAGMENT))
    }

    /// Where the kernel is (or will be) installed: `$STRATA_HOME/images/kernel-<hash16>`; `None` when the source
    /// version is unknown.
    pub fn install_dir(&self) -> Option<PathBuf> {
        self.key().map(|key| self.images.join(format!("kernel-{}", hash16(&key))))
    }

    /// Whether the kernel is installed: its stamp is present and names this key (no hashing).
    pub fn is_installed(&self) -> bool {
        self.installed().is_ok()
    }

    /// The installed kernel, from its stamp (no hashing); [`KernelError::NotInstalled`] when it is not built.
    pub fn installed(&self) -> Result<InstalledKernel, KernelError> {
        let key = self.key().ok_or(KernelError::SourceUnknown)?;
        read_install(&self.images.join(format!("kernel-{}", hash16(&key))), &key)
    }

    /// The installed kernel, building it first when it is missing. `progress` receives a line per step of a
    /// build (about ten minutes on two cores); nothing when it is installed. Installing missing packages needs
    /// root; the build itself does not.
    pub fn ensure(&self, progress: &dyn Fn(&str)) -> Result<(InstalledKernel, EnsureOutcome), KernelError> {
        if let Ok(installed) = self.installed() {
            return Ok((installed, EnsureOutcome::AlreadyInstalled));
        }
        build::install_packages(progress)?;
        // The installed package decides the key (it may have been installed or upgraded just now).
        let version = installed_package_version(SOURCE_PACKAGE).ok_or(KernelError::SourceUnknown)?;
        let key = build_key(&version, FRAGMENT);
        let dir = self.images.join(format!("kernel-{}", hash16(&key)));
        fs::create_dir_all(&self.images).map_err(io_err("cannot create", &self.images))?;
        let _lock = lock(&self.images.join(format!("kernel-{}.lock", hash16(&key))))?;
        // Another process may have built it while this one waited for the lock.
        if let Ok(installed) = read_install(&dir, &key) {
            return Ok((installed, EnsureOutcome::AlreadyInstalled));
        }
        build::remove_stale_temp_dirs(&self.images, hash16(&key))?;
        build::build(
            &build::BuildPlan {
                fragment: &self.fragment,
                images: &self.images,
                key: &key,
                hash16: hash16(&key),
                install_dir: &dir,
                source_version: &version,
            },
            progress,
        )?;
        Ok((read_install(&dir, &key)?, EnsureOutcome::Built))
    }

    /// Hashes the installed `vmlinux` again and compares it with the stamp.
    pub fn verify(&self) -> Result<InstalledKernel, KernelError> {
        let installed = self.installed()?;
        let sha256 = sha256_file(&installed.vmlinux)?;
        if sha256 != installed.sha256 {
            return Err(KernelError::Corrupt {
                dir: installed.dir,
                detail: format!("vmlinux hashes to {sha256}, its stamp says {}", installed.sha256),
            });
        }
        if !installed.config.is_file() {
            return Err(KernelError::Corrupt { dir: installed.dir, detail: "its config file is missing".into() });
        }
        Ok(installed)
    }

    /// Install directories of other keys (`$STRATA_HOME/images/kernel-*` but this one): kept, never removed by
    /// a build.
    pub fn other_installs(&self) -> Vec<PathBuf> {
        let current = self.install_dir();
        let mut found: Vec<PathBuf> =
            install_dirs(&self.images).into_iter().filter(|p| Some(p) != current.as_ref()).collect();
        found.sort();
        found
    }
}

fn hash16(key: &str) -> &str {
    key.get(..16).unwrap_or(key)
}

/// The `kernel-*` directories under `images`.
fn install_dirs(images: &Path) -> Vec<PathBuf> {
    let Ok(entries) = fs::read_dir(images) else { return Vec::new() };
    entries
        .filter_map(Result::ok)
        .filter(|e| e.file_name().to_str().is_some_and(|n| n.starts_with("kernel-") && !n.contains('.')))
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .map(|e| e.path())
        .collect()
}

/// The source version of the newest kernel built from this fragment and build format, if any.
fn newest_build_version(images: &Path) -> Option<String> {
    install_dirs(images)
        .iter()
        .filter_map(|dir| read_stamp(dir).ok())
        .filter(|stamp| stamp.key == build_key(&stamp.source_version, FRAGMENT))
        .max_by(|a, b| a.built_at.cmp(&b.built_at))
        .map(|stamp| stamp.source_version)
}

fn read_stamp(dir: &Path) -> Result<Stamp, KernelError> {
    let path = dir.join(STAMP_FILE);
    let text = match fs::read_to_string(&path) {
        Ok(text) => text,
        Err(err) if err.kind() == io::ErrorKind::NotFound => {
            return Err(KernelError::NotInstalled { dir: dir.to_owned() });
        }
        Err(err) => return Err(io_err("cannot read", &path)(err)),
    };
    serde_json::from_str(&text)
        .map_err(|e| KernelError::Corrupt { dir: dir.to_owned(), detail: format!("{STAMP_FILE}: {e}") })
}

/// The install in `dir`, checked against `key` and against the size of its `vmlinux` (no hashing).
fn read_install(dir: &Path, key: &str) -> Result<InstalledKernel, KernelError> {
    let stamp = read_stamp(dir)?;
    let corrupt = |detail: String| KernelError::Corrupt { dir: dir.to_owned(), detail };
    if stamp.key != key {
        return Err(corrupt(format!("its stamp names key {}, expected {key}", stamp.key)));
    }
    let vmlinux = dir.join(VMLINUX_FILE);
    let size = fs::metadata(&vmlinux).map(|m| m.len()).map_err(|e| corrupt(format!("vmlinux: {e}")))?;
    if size != stamp.vmlinux_size {
        return Err(corrupt(format!("vmlinux holds {size} bytes, its stamp says {}", stamp.vmlinux_size)));
    }
    Ok(InstalledKernel {
        dir: dir.to_owned(),
        vmlinux,
        config: dir.join(CONFIG_FILE),
        sha256: stamp.vmlinux_sha256,
        size_bytes: stamp.vmlinux_size,
        key: stamp.key,
        source_version: stamp.source_version,
        release: stamp.release,
    })
}

/// The installed version of a Debian package (`dpkg-query`), `None` when it is not installed.
pub(crate) fn installed_package_version(package: &str) -> Option<String> {
    installed_package_versions(&[package]).into_iter().next().map(|(_, version)| version)
}

/// (package, version) of each of `packages` that is installed.
pub(crate) fn installed_package_versions(packages: &[&str]) -> Vec<(String, String)> {
    let Ok(output) = Command::new("dpkg-query")
        .args(["-W", "-f", "${Package} ${db:Status-Abbrev} ${Version}\\n"])
        .args(packages)
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
    else {
        return Vec::new();
    };
    parse_dpkg_query(&String::from_utf8_lossy(&output.stdout))
}

/// `name ii  version` lines → (name, version) for the installed ones (status `ii`).
fn parse_dpkg_query(text: &str) -> Vec<(String, String)> {
    text.lines()
        .filter_map(|line| {
            let mut words = line.split_whitespace();
            let (name, status, version) = (words.next()?, words.next()?, words.next()?);
            let name = name.split(':').next().unwrap_or(name);
            (status == "ii").then(|| (name.to_owned(), version.to_owned()))
        })
        .collect()
}

/// An exclusive lock on `path`, released when dropped: one build per key at a time across processes.
fn lock(path: &Path) -> Result<nix::fcntl::Flock<File>, KernelError> {
    strata_image_util::lock_exclusive(path).map_err(io_err("cannot lock", path))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_key_follows_the_source_version_the_fragment_and_names_the_install_dir() {
        let key = build_key("6.1.172-1", FRAGMENT);
        assert_eq!(key.len(), 64);
        assert_ne!(build_key("6.1.173-1", FRAGMENT), key);
        assert_ne!(build_key("6.1.172-1", &format!("{FRAGMENT}\n")), key);
        let edited = FRAGMENT.replace("CONFIG_SMP=y", "# CONFIG_SMP is not set");
        assert_ne!(build_key("6.1.172-1", &edited), key);
        let home = tempfile::tempdir().expect("tempdir");
        let image = KernelImage::with_source_version(home.path(), "6.1.172-1").expect("image");
        assert_eq!(image.key().as_deref(), Some(key.as_str()));
        assert_eq!(image.install_dir(), Some(home.path().join("images").join(format!("kernel-{}", &key[..16]))));
    }

    #[test]
    fn dpkg_query_lines_give_installed_versions_only() {
        let text = "linux-source-6.1 ii  6.1.172-1\nbison un  \nlibelf-dev:amd64 ii  0.188-2.1\nflex rc  2.6.4-8\n";
        assert_eq!(
            parse_dpkg_query(text),
            [
                ("linux-source-6.1".to_owned(), "6.1.172-1".to_owned()),
                ("libelf-dev".to_owned(), "0.188-2.1".to_owned())
            ]
        );
    }

    #[test]
    fn a_missing_kernel_is_not_installed_and_says_how_to_build_it() {
        let home = tempfile::tempdir().expect("tempdir");
        let image = KernelImage::with_source_version(home.path(), "6.1.172-1").expect("image");
        assert!(!image.is_installed());
        let err = image.installed().expect_err("not built");
        assert!(matches!(err, KernelError::NotInstalled { .. }), "{err}");
        assert!(err.to_string().contains("strata images build kernel"), "{err}");
        assert!(matches!(image.verify(), Err(KernelError::NotInstalled { .. })));
    }

    /// A stamped directory made by hand stands in for a build.
    fn fake_install(image: &KernelImage) -> PathBuf {
        let dir = image.install_dir().expect("known version");
        fs::create_dir_all(&dir).expect("mkdir");
        fs::write(dir.join(VMLINUX_FILE), b"\x7fELF not really").expect("vmlinux");
        fs::write(dir.join(CONFIG_FILE), "CONFIG_64BIT=y\n").expect("config");
        let stamp = Stamp {
            key: image.key().expect("key"),
            build_format: BUILD_FORMAT,
            source_package: SOURCE_PACKAGE.into(),
            source_version: image.source_version().expect("version").into(),
            fragment_sha256: hex(&Sha256::digest(FRAGMENT)),
            release: "6.1.172-strata".into(),
            vmlinux_sha256: sha256_file(&dir.join(VMLINUX_FILE)).expect("hash"),
            vmlinux_size: 15,
            built_at: strata_image_util::rfc3339_now(),
            build_seconds: 1,
            jobs: 1,
            enabled: vec!["CONFIG_64BIT=y".into()],
            disabled: vec![],
            config_enabled_count: 1,
        };
        fs::write(dir.join(STAMP_FILE), serde_json::to_string(&stamp).expect("json")).expect("stamp");
        dir
    }

    #[test]
    fn verify_accepts_the_stamped_kernel_and_reports_a_changed_one() {
        let home = tempfile::tempdir().expect("tempdir");
        let image = KernelImage::with_source_version(home.path(), "6.1.172-1").expect("image");
        let dir = fake_install(&image);
        assert!(image.is_installed());
        let installed = image.verify().expect("intact");
        assert_eq!((installed.size_bytes, installed.release.as_str()), (15, "6.1.172-strata"));
        let started = std::time::Instant::now();
        let (again, outcome) = image.ensure(&|line| panic!("no progress expected: {line}")).expect("installed");
        assert_eq!((again, outcome), (installed, EnsureOutcome::AlreadyInstalled));
        assert!(started.elapsed().as_millis() < 100, "{:?}", started.elapsed());
        fs::write(dir.join(VMLINUX_FILE), b"\x7fELF not reallY").expect("tamper");
        let err = image.verify().expect_err("tampered");
        assert!(matches!(err, KernelError::Corrupt { .. }), "{err}");
        fs::write(dir.join(VMLINUX_FILE), b"short").expect("truncate");
        assert!(matches!(image.installed(), Err(KernelError::Corrupt { .. })));
    }

    #[test]
    fn an_install_of_another_version_is_found_when_the_source_package_is_gone() {
        let home = tempfile::tempdir().expect("tempdir");
        let built = KernelImage::with_source_version(home.path(), "6.1.999-1").expect("image");
        let dir = fake_install(&built);
        assert_eq!(newest_build_version(&home.path().join("images")).as_deref(), Some("6.1.999-1"));
        let other = KernelImage::with_source_version(home.path(), "6.1.172-1").expect("image");
        assert_eq!(other.other_installs(), vec![dir]);
        assert!(!other.is_installed());
    }
}
