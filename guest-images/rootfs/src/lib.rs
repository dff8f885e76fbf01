//! The Debian root filesystem: the read-only lower layer of the process tier's overlayfs jail, and later the
//! source of the microVM's disk image. One recipe serves both.
//!
//! [`DebianImage::ensure`] returns the installed tree, building it first when it is missing: `debootstrap`
//! (minbase, the packages `recipe.toml` names) into `$STRATA_HOME/images/.debian-<hash16>.tmp-<pid>/rootfs`,
//! then the [`POST_BUILD_STEPS`], then a hash of the whole tree written to `stamp.json` beside it, then one
//! rename to `$STRATA_HOME/images/debian-<hash16>/`. `<hash16>` starts the [recipe hash](DebianImage::recipe_hash):
//! the sha256 of `recipe.toml`, [`RECIPE_FORMAT`], [`POST_BUILD_VERSION`] and the files the post-build steps install. The package mirror is not part of
//! it (the mirror says where the packages come from, not what they are): it is read at build time from
//! `STRATA_DEBIAN_MIRROR` or else from the host's apt sources (the first `deb` entry for the recipe's suite).
//!
//! Builds take an exclusive lock per recipe hash, so concurrent `ensure` calls build once. A build that fails
//! or is interrupted leaves nothing mounted and no temporary tree behind (the next build removes what a killed
//! one left). Older installs (other recipe hashes) are kept; [`DebianImage::other_installs`] lists them.
//!
//! [`DebianImage::verify`] hashes the tree again and compares it with the stamp: any changed byte, mode or
//! owner, or any added or removed file, is reported as [`RootfsError::Corrupt`].

#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod build;
pub mod disk;
pub mod initramfs;
mod mirror;
mod mounts;
mod post_build;
mod tree;

use std::fs::{self, File};
use std::io;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

pub use mirror::MIRROR_ENV;
pub use post_build::{POST_BUILD_STEPS, POST_BUILD_VERSION, PostBuildStep};

/// `recipe.toml`, compiled in.
pub const RECIPE_TOML: &str = include_str!("../recipe.toml");

/// The version of the recipe's meaning: how this crate turns `recipe.toml` into debootstrap arguments. Bump it
/// when that changes, so images built the old way get a new hash.
pub const RECIPE_FORMAT: u32 = 1;

const STAMP_FILE: &str = "stamp.json";
const ROOTFS_DIR: &str = "rootfs";

/// What `recipe.toml` says to build.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Recipe {
    /// The Debian release, e.g. `bookworm`.
    pub suite: String,
    /// debootstrap's `--variant`, e.g. `minbase`.
    pub variant: String,
    /// debootstrap's `--arch`, e.g. `amd64`.
    pub arch: String,
    /// Archive components, e.g. `["main"]`.
    pub components: Vec<String>,
    /// Packages added to the variant's (`--include`).
    pub include: Vec<String>,
}

impl Recipe {
    /// The compiled-in recipe.
    pub fn pinned() -> Result<Recipe, RootfsError> {
        Recipe::parse(RECIPE_TOML)
    }

    /// Parses and checks a recipe: every name is a plain Debian name (no spaces, commas or options).
    pub fn parse(text: &str) -> Result<Recipe, RootfsError> {
        let recipe: Recipe = toml::from_str(text).map_err(|e| RootfsError::Recipe(e.to_string()))?;
        let plain = |what: &str, value: &str| {
            let ok = value.chars().next().is_some_and(|c| c.is_ascii_lowercase() || c.is_ascii_digit())
                && value.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || "+-.".contains(c));
            if ok { Ok(()) } else { Err(RootfsError::Recipe(format!("{what} {value:?} is not a plain Debian name"))) }
        };
        plain("suite", &recipe.suite)?;
        plain("variant", &recipe.variant)?;
        plain("arch", &recipe.arch)?;
        if recipe.components.is_empty() {
            return Err(RootfsError::Recipe("components is empty".into()));
        }
        for component in &recipe.components {
            plain("component", component)?;
        }
        for package in &recipe.include {
            plain("package", package)?;
        }
        Ok(recipe)
    }

    /// The hash of a recipe's text with the format and post-build versions and the files the post-build steps
    /// install (the `sudo` client), hex.
    fn hash(text: &str) -> String {
        let mut hasher = Sha256::new();
        hasher.update(text.as_bytes());
        hasher.update(format!("\0recipe-format {RECIPE_FORMAT}\0post-build {POST_BUILD_VERSION}\0").as_bytes());
        hasher.update(post_build::SUDO.as_bytes());
        hex(&hasher.finalize())
    }
}

/// Why the Debian image could not be built, found or checked.
#[derive(Debug, thiserror::Error)]
pub enum RootfsError {
    /// The compiled-in recipe is malformed (a build defect).
    #[error("the Debian image recipe is invalid: {0}")]
    Recipe(String),
    /// The image is not built.
    #[error("the Debian image is not installed in {} (run `strata images build debian`)", dir.display())]
    NotInstalled {
        /// Where it would be.
        dir: PathBuf,
    },
    /// Neither `STRATA_DEBIAN_MIRROR` nor the host's apt sources name a mirror for the suite.
    #[error("no `deb` source for {suite} in {searched}; set STRATA_DEBIAN_MIRROR to a Debian mirror URL")]
    NoMirror {
        /// The suite looked for.
        suite: String,
        /// The files read.
        searched: String,
    },
    /// `STRATA_DEBIAN_MIRROR` is not a URL debootstrap can fetch from.
    #[error("STRATA_DEBIAN_MIRROR={0:?} is not an http://, https:// or file:/ URL")]
    BadMirror(String),
    /// Building needs root: debootstrap creates device nodes, sets owners and chroots.
    #[error(
        "building the Debian image needs root (debootstrap chroots and sets file owners); the effective uid is {0}"
    )]
    NotRoot(u32),
    /// A program the build runs is not installed.
    #[error("{0} is not installed (apt-get install {0})")]
    MissingTool(&'static str),
    /// debootstrap failed.
    #[error("debootstrap failed ({status}); the full log is in {}; it ended with: {tail}", log.display())]
    Debootstrap {
        /// Its exit status.
        status: String,
        /// Where its whole output was saved.
        log: PathBuf,
        /// Its last lines.
        tail: String,
    },
    /// The installed tree does not match its stamp, or the stamp is unreadable.
    #[error("Debian image {} is corrupt: {detail}; remove it and run `strata images build debian`", dir.display())]
    Corrupt {
        /// The install directory.
        dir: PathBuf,
        /// What differs.
        detail: String,
    },
    /// A file system is still mounted inside a tree that was to be removed, and could not be unmounted.
    #[error("{} is still mounted and could not be unmounted; {} was left in place", mount.display(), tree.display())]
    StillMounted {
        /// The mount point.
        mount: PathBuf,
        /// The tree.
        tree: PathBuf,
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

pub(crate) fn io_err<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> RootfsError + 'a {
    move |source| RootfsError::Io { what, path: path.to_owned(), source }
}

pub(crate) use strata_image_util::hex;

/// The installed tree.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InstalledRootfs {
    /// The install directory, `$STRATA_HOME/images/debian-<hash16>`.
    pub dir: PathBuf,
    /// The root file system tree in it (`dir/rootfs`).
    pub rootfs: PathBuf,
    /// The recipe hash it was built from, hex.
    pub recipe_hash: String,
    /// The hash of the tree when it was built, hex (see [`DebianImage::verify`]).
    pub tree_hash: String,
    /// The total size of its regular files (each hard-linked file once), in bytes.
    pub size_bytes: u64,
}

/// What [`DebianImage::ensure`] did.
pub use strata_image_util::EnsureOutcome;

/// `stamp.json`, written last into the temporary tree before it is renamed into place.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Stamp {
    recipe_hash: String,
    tree_hash: String,
    size_bytes: u64,
    /// UTC, RFC 3339.
    built_at: String,
    debootstrap_version: String,
    /// Where the packages came from (provenance only; not part of the recipe hash).
    mirror: String,
}

/// The Debian image under `$STRATA_HOME/images`.
#[derive(Debug, Clone)]
pub struct DebianImage {
    images: PathBuf,
    recipe: Recipe,
    recipe_hash: String,
}

impl DebianImage {
    /// The image under `home/images`, from the compiled-in recipe.
    pub fn new(home: &Path) -> Result<DebianImage, RootfsError> {
        Ok(DebianImage {
            images: home.join("images"),
            recipe: Recipe::pinned()?,
            recipe_hash: Recipe::hash(RECIPE_TOML),
        })
    }

    /// The recipe.
    pub fn recipe(&self) -> &Recipe {
        &self.recipe
    }

    /// The recipe hash, hex (64 digits): sha256 of `recipe.toml`, [`RECIPE_FORMAT`], [`POST_BUILD_VERSION`] and the
    /// files the post-build steps install.
    pub fn recipe_hash(&self) -> &str {
        &self.recipe_hash
    }

    fn hash16(&self) -> &str {
        self.recipe_hash.get(..16).unwrap_or(&self.recipe_hash)
    }

    /// Where the image is (or will be) installed: `$STRATA_HOME/images/debian-<hash16>`.
    pub fn install_dir(&self) -> PathBuf {
        self.images.join(format!("debian-{}", self.hash16()))
    }

    /// The root file system tree: `install_dir()/rootfs`.
    pub fn rootfs(&self) -> PathBuf {
        self.install_dir().join(ROOTFS_DIR)
    }

    /// The mirror a build would fetch from now: `STRATA_DEBIAN_MIRROR`, else the host's apt sources.
    pub fn mirror(&self) -> Result<String, RootfsError> {
        mirror::resolve(&self.recipe.suite, Path::new("/etc/apt"))
    }

    /// Whether the image is installed: its stamp is present and names this recipe (no hashing).
    pub fn is_installed(&self) -> bool {
        self.installed().is_ok()
    }

    /// The installed image, from its stamp (no hashing); [`RootfsError::NotInstalled`] when it is not built.
    pub fn installed(&self) -> Result<InstalledRootfs, RootfsError> {
        let dir = self.install_dir();
        let stamp = self.read_stamp(&dir)?;
        let rootfs = dir.join(ROOTFS_DIR);
        if !rootfs.is_dir() {
            return Err(RootfsError::Corrupt {
                dir,
                detail: "the stamp is there but the rootfs directory is not".into(),
            });
        }
        Ok(InstalledRootfs {
            dir,
            rootfs,
            recipe_hash: stamp.recipe_hash,
            tree_hash: stamp.tree_hash,
            size_bytes: stamp.size_bytes,
        })
    }

    fn read_stamp(&self, dir: &Path) -> Result<Stamp, RootfsError> {
        let path = dir.join(STAMP_FILE);
        let text = match fs::read_to_string(&path) {
            Ok(text) => text,
            Err(err) if err.kind() == io::ErrorKind::NotFound => {
                return Err(RootfsError::NotInstalled { dir: dir.to_owned() });
            }
            Err(err) => return Err(io_err("cannot read", &path)(err)),
        };
        let stamp: Stamp = serde_json::from_str(&text)
            .map_err(|e| RootfsError::Corrupt { dir: dir.to_owned(), detail: format!("{STAMP_FILE}: {e}") })?;
        if stamp.recipe_hash != self.recipe_hash {
            return Err(RootfsError::Corrupt {
                dir: dir.to_owned(),
                detail: format!("its stamp names recipe {}, expected {}", stamp.recipe_hash, self.recipe_hash),
            });
        }
        Ok(stamp)
    }

    /// The installed image, building it first when it is missing. `progress` receives a line per step of a
    /// build (about a minute: debootstrap fetches and configures about 130 packages); nothing when it is
    /// installed. Building needs root and `debootstrap`.
    pub fn ensure(&self, progress: &dyn Fn(&str)) -> Result<(InstalledRootfs, EnsureOutcome), RootfsError> {
        if let Ok(installed) = self.installed() {
            return Ok((installed, EnsureOutcome::AlreadyInstalled));
        }
        let uid = nix::unistd::geteuid();
        if !uid.is_root() {
            return Err(RootfsError::NotRoot(uid.as_raw()));
        }
        let debootstrap = build::find_tool("debootstrap").ok_or(RootfsError::MissingTool("debootstrap"))?;
        let mirror = self.mirror()?;
        fs::create_dir_all(&self.images).map_err(io_err("cannot create", &self.images))?;
        let _lock = lock(&self.images.join(format!("debian-{}.lock", self.hash16())))?;
        // Another process may have built it while this one waited for the lock.
        if let Ok(installed) = self.installed() {
            return Ok((installed, EnsureOutcome::AlreadyInstalled));
        }
        mounts::remove_stale_temp_dirs(&self.images, self.hash16())?;
        let stamp = build::build(
            &build::BuildPlan {
                recipe: &self.recipe,
                recipe_hash: &self.recipe_hash,
                images: &self.images,
                hash16: self.hash16(),
                install_dir: &self.install_dir(),
                debootstrap: &debootstrap,
                mirror: &mirror,
            },
            progress,
        )?;
        let dir = self.install_dir();
        Ok((
            InstalledRootfs {
                rootfs: dir.join(ROOTFS_DIR),
                dir,
                recipe_hash: stamp.recipe_hash,
                tree_hash: stamp.tree_hash,
                size_bytes: stamp.size_bytes,
            },
            EnsureOutcome::Built,
        ))
    }

    /// Hashes the installed tree again and compares it with the stamp (seconds: it reads every file).
    pub fn verify(&self) -> Result<InstalledRootfs, RootfsError> {
        let installed = self.installed()?;
        let summary = tree::hash_tree(&installed.rootfs)?;
        if summary.hash != installed.tree_hash {
            return Err(RootfsError::Corrupt {
                dir: installed.dir,
                detail: format!("the tree hashes to {}, its stamp says {}", summary.hash, installed.tree_hash),
            });
        }
        if summary.size_bytes != installed.size_bytes {
            return Err(RootfsError::Corrupt {
                dir: installed.dir,
                detail: format!("the tree holds {} bytes, its stamp says {}", summary.size_bytes, installed.size_bytes),
            });
        }
        Ok(installed)
    }

    /// Install directories of other recipes (`$STRATA_HOME/images/debian-*` but this one): kept, never removed
    /// by a build.
    pub fn other_installs(&self) -> Vec<PathBuf> {
        let current = self.install_dir();
        let Ok(entries) = fs::read_dir(&self.images) else { return Vec::new() };
        let mut found: Vec<PathBuf> = entries
            .filter_map(Result::ok)
            .filter(|e| e.file_name().to_str().is_some_and(|n| n.starts_with("debian-") && !n.ends_with(".lock")))
            .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
            .map(|e| e.path())
            .filter(|p| *p != current)
            .collect();
        found.sort();
        found
    }
}

/// An exclusive lock on `path`, released when dropped: one build per recipe at a time across processes.
fn lock(path: &Path) -> Result<nix::fcntl::Flock<File>, RootfsError> {
    strata_image_util::lock_exclusive(path).map_err(io_err("cannot lock", path))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pinned_recipe_parses_and_includes_python() {
        let recipe = Recipe::pinned().expect("valid");
        assert_eq!(recipe.suite, "bookworm");
        assert_eq!(recipe.variant, "minbase");
        assert_eq!(recipe.arch, "amd64");
        for package in ["python3", "python3-pip", "python3-venv", "busybox", "ca-certificates", "procps", "bash"] {
            assert!(recipe.include.iter().any(|p| p == package), "{package} missing");
        }
    }

    #[test]
    fn a_recipe_with_an_unknown_field_or_an_option_in_a_name_is_refused() {
        let base = "suite = \"bookworm\"\nvariant = \"minbase\"\narch = \"amd64\"\ncomponents = [\"main\"]\n";
        assert!(Recipe::parse(&format!("{base}include = [\"python3\"]\n")).is_ok());
        let unknown = Recipe::parse(&format!("{base}include = []\nmirror = \"x\"\n")).expect_err("unknown field");
        assert!(matches!(unknown, RootfsError::Recipe(_)), "{unknown}");
        let comma = Recipe::parse(&format!("{base}include = [\"a,b\"]\n")).expect_err("comma");
        assert!(comma.to_string().contains("\"a,b\""), "{comma}");
        assert!(Recipe::parse(&format!("{base}include = [\"--foo\"]\n")).is_err());
    }

    #[test]
    fn the_recipe_hash_names_the_install_dir_and_follows_the_recipe_text() {
        let home = tempfile::tempdir().expect("tempdir");
        let image = DebianImage::new(home.path()).expect("image");
        assert_eq!(image.recipe_hash().len(), 64);
        let dir = image.install_dir();
        assert_eq!(dir, home.path().join("images").join(format!("debian-{}", &image.recipe_hash()[..16])));
        assert_eq!(image.rootfs(), dir.join("rootfs"));
        assert_eq!(Recipe::hash(RECIPE_TOML), image.recipe_hash());
        assert_ne!(Recipe::hash(&format!("{RECIPE_TOML} ")), image.recipe_hash());
    }

    #[test]
    fn a_missing_image_is_not_installed_and_says_how_to_build_it() {
        let home = tempfile::tempdir().expect("tempdir");
        let image = DebianImage::new(home.path()).expect("image");
        assert!(!image.is_installed());
        let err = image.installed().expect_err("not built");
        assert!(matches!(err, RootfsError::NotInstalled { .. }), "{err}");
        assert!(err.to_string().contains("strata images build debian"), "{err}");
        assert!(matches!(image.verify(), Err(RootfsError::NotInstalled { .. })));
    }

    /// A stamped tree made by hand stands in for a debootstrap build.
    fn fake_install(image: &DebianImage) -> PathBuf {
        let rootfs = image.rootfs();
        fs::create_dir_all(rootfs.join("etc")).expect("mkdir");
        fs::write(rootfs.join("etc/hostname"), "strata\n").expect("write");
        let summary = tree::hash_tree(&rootfs).expect("hash");
        let stamp = Stamp {
            recipe_hash: image.recipe_hash().to_owned(),
            tree_hash: summary.hash,
            size_bytes: summary.size_bytes,
            built_at: strata_image_util::rfc3339_now(),
            debootstrap_version: "test".into(),
            mirror: "file:/nowhere".into(),
        };
        fs::write(image.install_dir().join(STAMP_FILE), serde_json::to_string(&stamp).expect("json")).expect("stamp");
        rootfs
    }

    #[test]
    fn verify_accepts_the_stamped_tree_and_reports_a_changed_file() {
        let home = tempfile::tempdir().expect("tempdir");
        let image = DebianImage::new(home.path()).expect("image");
        let rootfs = fake_install(&image);
        assert!(image.is_installed());
        let installed = image.verify().expect("intact");
        assert_eq!(installed.size_bytes, 7);
        let (again, outcome) = image.ensure(&|line| panic!("no progress expected: {line}")).expect("installed");
        assert_eq!((again, outcome), (installed, EnsureOutcome::AlreadyInstalled));
        fs::write(rootfs.join("etc/hostname"), "strat4\n").expect("tamper");
        let err = image.verify().expect_err("tampered");
        assert!(matches!(err, RootfsError::Corrupt { .. }), "{err}");
    }

    #[test]
    fn a_stamp_from_another_recipe_is_not_this_image() {
        let home = tempfile::tempdir().expect("tempdir");
        let image = DebianImage::new(home.path()).expect("image");
        fake_install(&image);
        let path = image.install_dir().join(STAMP_FILE);
        let text = fs::read_to_string(&path).expect("read").replace(image.recipe_hash(), &"0".repeat(64));
        fs::write(&path, text).expect("write");
        assert!(!image.is_installed());
        assert!(matches!(image.installed(), Err(RootfsError::Corrupt { .. })));
    }

    #[test]
    fn other_installs_lists_older_recipes_but_not_this_one() {
        let home = tempfile::tempdir().expect("tempdir");
        let image = DebianImage::new(home.path()).expect("image");
        fake_install(&image);
        let old = home.path().join("images/debian-0123456789abcdef");
        fs::create_dir_all(&old).expect("mkdir");
        fs::write(home.path().join("images/debian-0123456789abcdef.lock"), "").expect("lock");
        assert_eq!(image.other_installs(), vec![old]);
    }
}
