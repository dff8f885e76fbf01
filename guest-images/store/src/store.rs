//! The store's directories, records and their invariants (see the crate docs).

use std::collections::BTreeSet;
use std::fs;
use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use strata_core::ImageName;

/// Bumped when the way an image's microVM disk is made changes (part of its key; see `disk`).
pub const IMAGE_DISK_FORMAT: u32 = 1;

/// The most layers an image may have (its base included): each is one read-only mount in a jail.
pub const MAX_LAYERS: usize = 63;

const LAYER_FILE: &str = "layer.json";
const TREE_DIR: &str = "tree";
/// Records larger than this are refused (an image record lists at most [`MAX_LAYERS`] keys and a config).
const MAX_RECORD: u64 = 1 << 20;

/// Why the store could not do something.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// No image of that name.
    #[error("no image named {0:?} (see `strata images list`)")]
    NotFound(String),
    /// An image names a layer (or base) that is not in the store.
    #[error("image {image:?} needs {what}, which is not in the store: build or import it again")]
    Missing {
        /// The image.
        image: String,
        /// The layer or base.
        what: String,
    },
    /// A record the store holds is not what it wrote.
    #[error("{}: {message}", path.display())]
    Corrupt {
        /// The record.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// Something that is not allowed (too many layers, a bad base name).
    #[error("{0}")]
    Invalid(String),
    /// A filesystem call failed.
    #[error("{what} {}: {source}", path.display())]
    Io {
        /// What the store was doing.
        what: &'static str,
        /// Where.
        path: PathBuf,
        /// The error.
        source: io::Error,
    },
}

fn io_error<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> StoreError + 'a {
    move |source| StoreError::Io { what, path: path.to_owned(), source }
}

/// A layer's key: 32 lowercase hex digits (the first half of a sha256).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct LayerKey(String);

impl LayerKey {
    /// The key of whatever `parts` describe, in order (each part length-prefixed, so no two lists collide).
    pub fn of(parts: &[&[u8]]) -> LayerKey {
        let mut hasher = Sha256::new();
        for part in parts {
            hasher.update((part.len() as u64).to_le_bytes());
            hasher.update(part);
        }
        let digest = hasher.finalize();
        LayerKey(digest[..16].iter().map(|b| format!("{b:02x}")).collect())
    }

    /// The key as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl TryFrom<String> for LayerKey {
    type Error = String;

    fn try_from(key: String) -> Result<LayerKey, String> {
        if key.len() == 32 && key.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) {
            Ok(LayerKey(key))
        } else {
            Err(format!("{key:?} is not a layer key (32 lowercase hex digits)"))
        }
    }
}

impl From<LayerKey> for String {
    fn from(key: LayerKey) -> String {
        key.0
    }
}

impl std::fmt::Display for LayerKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// What `layer.json` says.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LayerRecord {
    /// The layer's key (its directory's name).
    pub key: LayerKey,
    /// What made it, for people: `RUN apt-get install …`, `oci sha256:…`.
    pub source: String,
    /// Bytes of its files (regular files' sizes).
    pub size_bytes: u64,
    /// Entries in its tree.
    pub entries: u64,
    /// When it was made (RFC 3339).
    pub created: String,
}

/// The defaults a job takes from its image (a Dockerfile's `ENV`, `WORKDIR`, `USER`, `CMD` and Strata's start
/// and ready commands; an OCI image's `Env`, `WorkingDir`, `User`, `Cmd`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ImageConfig {
    /// Environment variables, in order (a later one of a name replaces the earlier).
    pub env: Vec<(String, String)>,
    /// The working directory of jobs (absolute), when the image sets one.
    pub workdir: Option<String>,
    /// The account jobs run as, when the image sets one (a name in its `/etc/passwd`, or a number).
    pub user: Option<String>,
    /// The image's command (`CMD`), for people and for runs that name none.
    pub cmd: Option<Vec<String>>,
    /// A command (run by `/bin/sh -c`) the sandbox's PID 1 starts and supervises when a sandbox starts.
    pub start: Option<String>,
    /// A command (run by `/bin/sh -c`) that exits 0 once the sandbox is ready; a create returns after it does.
    pub ready: Option<String>,
}

impl ImageConfig {
    /// Sets `name` to `value`, replacing an earlier value of it.
    pub fn set_env(&mut self, name: &str, value: &str) {
        self.env.retain(|(n, _)| n != name);
        self.env.push((name.to_owned(), value.to_owned()));
    }
}

/// Where an image came from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum ImageSource {
    /// Built from a Dockerfile.
    Dockerfile {
        /// The Dockerfile's sha256 (hex).
        sha256: String,
    },
    /// Imported from an OCI image layout or a `docker save` archive.
    Oci {
        /// The image manifest's digest.
        manifest: String,
    },
}

/// What `images/<name>.json` says.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ImageRecord {
    /// The image's name.
    pub name: ImageName,
    /// The install directory (under `$STRATA_HOME/images`) of the Debian image it was built on, e.g.
    /// `debian-714b1474179f568f`; `None` for an image whose layers are all its own (an OCI import).
    pub base: Option<String>,
    /// Its layers, bottom first.
    pub layers: Vec<LayerKey>,
    /// What jobs take from it.
    pub config: ImageConfig,
    /// Where it came from.
    pub source: ImageSource,
    /// When it was made (RFC 3339).
    pub created: String,
}

/// An image ready to mount: its layers' directories (top first, as overlayfs's `lowerdir` lists them) and
/// its config.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResolvedImage {
    /// The image's name.
    pub name: ImageName,
    /// The directories, top first; the last is the base (or the bottom layer).
    pub lowers: Vec<PathBuf>,
    /// What jobs take from it.
    pub config: ImageConfig,
}

/// What [`ImageStore::prune`] removed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PruneReport {
    /// Layers no image used.
    pub layers: Vec<LayerKey>,
    /// Bytes they held.
    pub bytes: u64,
    /// Temporary directories of builds that are gone.
    pub temporary: usize,
    /// Unused layers kept because a sandbox stands on them ([`ImageStore::hold`]).
    pub held: usize,
    /// Disk files of images removed or rebuilt since.
    pub disks: usize,
}

/// Shared locks on the layers a sandbox stands on, released when dropped: [`ImageStore::prune`] leaves them.
#[derive(Debug, Default)]
pub struct LayerHold {
    _locks: Vec<nix::fcntl::Flock<fs::File>>,
}

/// The store under one `$STRATA_HOME`.
#[derive(Debug, Clone)]
pub struct ImageStore {
    /// `$STRATA_HOME/images`: where the Debian image's installs are (bases).
    images_dir: PathBuf,
    /// `$STRATA_HOME/images/store`.
    root: PathBuf,
}

impl ImageStore {
    /// The store of `home`, its directories made (mode 0700) when missing.
    pub fn open(home: &Path) -> Result<ImageStore, StoreError> {
        let images_dir = home.join("images");
        let root = images_dir.join("store");
        for dir in [root.clone(), root.join("layers"), root.join("images")] {
            fs::DirBuilder::new().recursive(true).mode(0o700).create(&dir).map_err(io_error("creating", &dir))?;
        }
        fs::set_permissions(&root, fs::Permissions::from_mode(0o700)).map_err(io_error("securing", &root))?;
        Ok(ImageStore { images_dir, root })
    }

    /// Holds the store's layers among `lowers` (an image's directories, as [`ResolvedImage::lowers`] lists them)
    /// for as long as the hold lives; directories that are not layers of this store (a base) are skipped.
    pub fn hold(&self, lowers: &[PathBuf]) -> Result<LayerHold, StoreError> {
        let layers = self.root.join("layers");
        let mut locks = Vec::new();
        for lower in lowers {
            let Some(dir) = lower.parent().filter(|dir| dir.parent() == Some(layers.as_path())) else { continue };
            let record = dir.join(LAYER_FILE);
            let file = fs::File::open(&record).map_err(io_error("holding", &record))?;
            let lock = nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockShared)
                .map_err(|(_, errno)| StoreError::Io { what: "holding", path: record.clone(), source: errno.into() })?;
            locks.push(lock);
        }
        Ok(LayerHold { _locks: locks })
    }

    /// The store's directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    fn layer_dir(&self, key: &LayerKey) -> PathBuf {
        self.root.join("layers").join(key.as_str())
    }

    fn image_file(&self, name: &ImageName) -> PathBuf {
        self.root.join("images").join(format!("{name}.json"))
    }

    /// The tree of the layer `key`, when the store has the whole layer.
    pub fn layer(&self, key: &LayerKey) -> Option<(PathBuf, LayerRecord)> {
        let dir = self.layer_dir(key);
        let record: LayerRecord = read_record(&dir.join(LAYER_FILE)).ok()?;
        (record.key == *key && dir.join(TREE_DIR).is_dir()).then(|| (dir.join(TREE_DIR), record))
    }

    /// Makes the layer `key`: `fill` writes its tree into the empty directory it is given; then its size is
    /// counted, `layer.json` written, and the directory renamed into place. A layer already there is kept (and
    /// `fill` not called). A failed `fill` leaves nothing.
    pub fn add_layer<E: From<StoreError>>(
        &self,
        key: &LayerKey,
        source: &str,
        fill: impl FnOnce(&Path) -> Result<(), E>,
    ) -> Result<LayerRecord, E> {
        if let Some((_, record)) = self.layer(key) {
            return Ok(record);
        }
        // Its own temporary directory, even beside another build of the same key in this process.
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let nth = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let temporary = self.root.join("layers").join(format!(".tmp-{key}.{nth}-{}", std::process::id()));
        remove_tree(&temporary)?;
        fs::DirBuilder::new().mode(0o700).create(&temporary).map_err(io_error("creating", &temporary))?;
        let tree = temporary.join(TREE_DIR);
        fs::DirBuilder::new().mode(0o755).create(&tree).map_err(io_error("creating", &tree))?;
        let filled = fill(&tree).and_then(|()| {
            let (size_bytes, entries) = tree_size(&tree)?;
            let record =
                LayerRecord { key: key.clone(), source: source.to_owned(), size_bytes, entries, created: now() };
            write_record(&temporary.join(LAYER_FILE), &record)?;
            Ok(record)
        });
        let record = match filled {
            Ok(record) => record,
            Err(err) => {
                let _ = remove_tree(&temporary);
                return Err(err);
            }
        };
        let dir = self.layer_dir(key);
        match fs::rename(&temporary, &dir) {
            Ok(()) => Ok(record),
            Err(_) if self.layer(key).is_some() => {
                // Another build made it meanwhile: the same inputs, so the same layer.
                remove_tree(&temporary)?;
                Ok(self.layer(key).map(|(_, r)| r).unwrap_or(record))
            }
            Err(source) => {
                let _ = remove_tree(&temporary);
                Err(StoreError::Io { what: "installing layer", path: dir, source }.into())
            }
        }
    }

    /// Records `image` (replacing an image of its name), after checking every layer and its base are there.
    pub fn put(&self, image: &ImageRecord) -> Result<(), StoreError> {
        self.resolve_record(image)?;
        write_record(&self.image_file(&image.name), image)
    }

    /// The image `name`.
    pub fn get(&self, name: &ImageName) -> Result<ImageRecord, StoreError> {
        let path = self.image_file(name);
        if !path.exists() {
            return Err(StoreError::NotFound(name.to_string()));
        }
        let record: ImageRecord = read_record(&path)?;
        if record.name != *name {
            return Err(StoreError::Corrupt { path, message: format!("names {:?}", record.name.as_str()) });
        }
        Ok(record)
    }

    /// Every image, by name.
    pub fn list(&self) -> Result<Vec<ImageRecord>, StoreError> {
        let dir = self.root.join("images");
        let mut images = Vec::new();
        for entry in fs::read_dir(&dir).map_err(io_error("listing", &dir))? {
            let entry = entry.map_err(io_error("listing", &dir))?;
            let file = entry.file_name();
            let Some(name) = file.to_str().and_then(|f| f.strip_suffix(".json")) else { continue };
            let Ok(name) = ImageName::new(name) else { continue };
            images.push(self.get(&name)?);
        }
        images.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(images)
    }

    /// Removes the image `name` (its layers stay until [`ImageStore::prune`] finds them unused).
    pub fn remove(&self, name: &ImageName) -> Result<(), StoreError> {
        let path = self.image_file(name);
        match fs::remove_file(&path) {
            Ok(()) => Ok(()),
            Err(err) if err.kind() == io::ErrorKind::NotFound => Err(StoreError::NotFound(name.to_string())),
            Err(source) => Err(StoreError::Io { what: "removing", path, source }),
        }
    }

    /// The image `name`, ready to mount.
    pub fn resolve(&self, name: &ImageName) -> Result<ResolvedImage, StoreError> {
        self.resolve_record(&self.get(name)?)
    }

    /// The directories of a base (a Debian install's tree) by its install directory's name.
    pub fn base_dir(&self, base: &str) -> Result<PathBuf, StoreError> {
        let plain = base.strip_prefix("debian-").is_some_and(|hash| {
            hash.len() == 16 && hash.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        });
        if !plain {
            return Err(StoreError::Invalid(format!("{base:?} is not a Debian image install (debian-<16 hex>)")));
        }
        Ok(self.images_dir.join(base).join("rootfs"))
    }

    /// An image record's layers as directories, checked (every one present, at most [`MAX_LAYERS`]).
    pub fn resolve_record(&self, image: &ImageRecord) -> Result<ResolvedImage, StoreError> {
        let count = image.layers.len() + usize::from(image.base.is_some());
        if count == 0 || count > MAX_LAYERS {
            return Err(StoreError::Invalid(format!(
                "image {:?} has {count} layers (1 to {MAX_LAYERS})",
                image.name.as_str()
            )));
        }
        let mut lowers = Vec::with_capacity(count);
        for key in image.layers.iter().rev() {
            let (tree, _) = self
                .layer(key)
                .ok_or_else(|| StoreError::Missing { image: image.name.to_string(), what: format!("layer {key}") })?;
            lowers.push(tree);
        }
        if let Some(base) = &image.base {
            let dir = self.base_dir(base)?;
            if !dir.is_dir() {
                return Err(StoreError::Missing {
                    image: image.name.to_string(),
                    what: format!("the Debian image {base} (`strata images build debian` builds the current one)"),
                });
            }
            lowers.push(dir);
        }
        Ok(ResolvedImage { name: image.name.clone(), lowers, config: image.config.clone() })
    }

    /// Every layer in the store: key, record.
    pub fn layers(&self) -> Result<Vec<LayerRecord>, StoreError> {
        let dir = self.root.join("layers");
        let mut layers = Vec::new();
        for entry in fs::read_dir(&dir).map_err(io_error("listing", &dir))? {
            let entry = entry.map_err(io_error("listing", &dir))?;
            let Some(key) = entry.file_name().to_str().and_then(|k| LayerKey::try_from(k.to_owned()).ok()) else {
                continue;
            };
            if let Some((_, record)) = self.layer(&key) {
                layers.push(record);
            }
        }
        layers.sort_by(|a, b| a.key.cmp(&b.key));
        Ok(layers)
    }

    /// Removes the layers no image uses, except `keep` (a build in progress holds its steps' layers), and the
    /// temporary directories of builds whose process is gone.
    pub fn prune(&self, keep: &BTreeSet<LayerKey>) -> Result<PruneReport, StoreError> {
        let used: BTreeSet<LayerKey> = self.list()?.into_iter().flat_map(|image| image.layers).collect();
        let mut report = PruneReport::default();
        for layer in self.layers()? {
            if used.contains(&layer.key) || keep.contains(&layer.key) {
                continue;
            }
            // A layer a sandbox stands on (its image removed meanwhile) is held: removing its files would take
            // them from under the sandbox.
            let record = self.layer_dir(&layer.key).join(LAYER_FILE);
            let Ok(_exclusive) = fs::File::open(&record).map_err(|_| ()).and_then(|file| {
                nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusiveNonblock).map_err(|_| ())
            }) else {
                report.held += 1;
                continue;
            };
            remove_tree(&self.layer_dir(&layer.key))?;
            report.bytes += layer.size_bytes;
            report.layers.push(layer.key);
        }
        // Disks of images removed or rebuilt since (a disk a microVM has open stays readable until it closes it).
        let disks = self.root.join("disks");
        if disks.is_dir() {
            let wanted: BTreeSet<String> =
                self.list()?.iter().map(|image| disk_key(image).as_str().to_owned()).collect();
            for entry in fs::read_dir(&disks).map_err(io_error("listing", &disks))? {
                let entry = entry.map_err(io_error("listing", &disks))?;
                let name = entry.file_name().to_string_lossy().into_owned();
                // A build's temporary file or merged view (dot-named) is its own to remove.
                let key = name.split('.').next().unwrap_or_default().to_owned();
                if !name.starts_with('.') && !wanted.contains(&key) {
                    report.bytes += entry.metadata().map(|m| m.len()).unwrap_or(0);
                    report.disks += 1;
                    fs::remove_file(entry.path()).map_err(io_error("removing", &entry.path()))?;
                }
            }
        }
        let dir = self.root.join("layers");
        for entry in fs::read_dir(&dir).map_err(io_error("listing", &dir))? {
            let entry = entry.map_err(io_error("listing", &dir))?;
            let name = entry.file_name();
            let Some(pid) = name.to_str().and_then(|n| n.strip_prefix(".tmp-")).and_then(|n| n.rsplit_once('-')) else {
                continue;
            };
            let alive = pid.1.parse::<u32>().is_ok_and(|pid| Path::new(&format!("/proc/{pid}")).exists());
            if !alive {
                remove_tree(&entry.path())?;
                report.temporary += 1;
            }
        }
        Ok(report)
    }

    /// Bytes the images' own layers hold (shared layers counted once per image that uses them).
    pub fn image_size(&self, image: &ImageRecord) -> u64 {
        image.layers.iter().filter_map(|key| self.layer(key)).map(|(_, record)| record.size_bytes).sum()
    }
}

/// The key of an image's disk: its base and layers (a rebuilt image has another disk).
pub(crate) fn disk_key(record: &ImageRecord) -> LayerKey {
    let mut parts: Vec<Vec<u8>> = vec![format!("disk {IMAGE_DISK_FORMAT}").into_bytes()];
    parts.push(record.base.clone().unwrap_or_default().into_bytes());
    parts.extend(record.layers.iter().map(|k| k.as_str().as_bytes().to_vec()));
    LayerKey::of(&parts.iter().map(Vec::as_slice).collect::<Vec<_>>())
}

/// Removes `path` and everything under it; a missing path is fine. Never follows a symlink (a tree a guest
/// made holds any).
pub fn remove_tree(path: &Path) -> Result<(), StoreError> {
    match fs::remove_dir_all(path) {
        Ok(()) => Ok(()),
        Err(err) if err.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(StoreError::Io { what: "removing", path: path.to_owned(), source }),
    }
}

/// Bytes of regular files and entries under `root`, walked without following links.
fn tree_size(root: &Path) -> Result<(u64, u64), StoreError> {
    let (mut bytes, mut entries) = (0u64, 0u64);
    let mut stack = vec![root.to_owned()];
    while let Some(dir) = stack.pop() {
        for entry in fs::read_dir(&dir).map_err(io_error("measuring", &dir))? {
            let entry = entry.map_err(io_error("measuring", &dir))?;
            let meta = entry.metadata().map_err(io_error("measuring", &entry.path()))?;
            entries += 1;
            if meta.is_dir() {
                stack.push(entry.path());
            } else if meta.is_file() {
                bytes += meta.blocks() * 512;
            }
        }
    }
    Ok((bytes, entries))
}

fn read_record<T: for<'de> Deserialize<'de>>(path: &Path) -> Result<T, StoreError> {
    let meta = fs::symlink_metadata(path).map_err(io_error("reading", path))?;
    if !meta.is_file() || meta.len() > MAX_RECORD {
        let message = format!("not a regular file of at most {MAX_RECORD} bytes");
        return Err(StoreError::Corrupt { path: path.to_owned(), message });
    }
    let text = fs::read(path).map_err(io_error("reading", path))?;
    serde_json::from_slice(&text).map_err(|e| StoreError::Corrupt { path: path.to_owned(), message: e.to_string() })
}

fn write_record<T: Serialize>(path: &Path, record: &T) -> Result<(), StoreError> {
    let text = serde_json::to_vec_pretty(record).map_err(|e| StoreError::Invalid(e.to_string()))?;
    let temporary = path.with_extension(format!("tmp-{}", std::process::id()));
    fs::write(&temporary, text).map_err(io_error("writing", &temporary))?;
    fs::rename(&temporary, path).map_err(io_error("installing", path))
}

fn now() -> String {
    strata_image_util::rfc3339_now()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn image(store: &ImageStore, name: &str, layers: Vec<LayerKey>) -> ImageRecord {
        let _ = store;
        ImageRecord {
            name: ImageName::new(name).expect("name"),
            base: None,
            layers,
            config: ImageConfig::default(),
            source: ImageSource::Oci { manifest: "sha256:x".into() },
            created: now(),
        }
    }

    #[test]
    fn layers_are_installed_whole_resolved_top_first_and_pruned_when_unused() {
        let home = tempfile::tempdir().expect("tempdir");
        let store = ImageStore::open(home.path()).expect("store");
        let (a, b) = (LayerKey::of(&[b"a"]), LayerKey::of(&[b"b"]));
        for key in [&a, &b] {
            store
                .add_layer::<StoreError>(key, "test", |tree| {
                    fs::write(tree.join("file"), key.as_str()).map_err(io_error("writing", tree))
                })
                .expect("layer");
        }
        let failed = store.add_layer(&LayerKey::of(&[b"c"]), "test", |_| Err(StoreError::Invalid("no".into())));
        assert!(failed.is_err());
        assert_eq!(store.layers().expect("layers").len(), 2, "a failed fill leaves nothing");

        store.put(&image(&store, "two", vec![a.clone(), b.clone()])).expect("put");
        let resolved = store.resolve(&ImageName::new("two").expect("name")).expect("resolve");
        assert_eq!(resolved.lowers, vec![store.layer(&b).expect("b").0, store.layer(&a).expect("a").0]);

        let missing = image(&store, "gap", vec![LayerKey::of(&[b"absent"])]);
        assert!(matches!(store.put(&missing), Err(StoreError::Missing { .. })));
        store.put(&image(&store, "one", vec![a.clone()])).expect("put");
        store.remove(&ImageName::new("two").expect("name")).expect("remove");
        // Held by a sandbox, an unused layer survives a prune until the hold ends.
        let hold = store.hold(&resolved.lowers).expect("hold");
        let report = store.prune(&BTreeSet::new()).expect("prune");
        assert_eq!((report.layers.len(), report.held), (0, 1), "{report:?}");
        drop(hold);
        let report = store.prune(&BTreeSet::new()).expect("prune");
        assert_eq!(report.layers, vec![b]);
        assert!(store.layer(&a).is_some());
        assert!(matches!(store.get(&ImageName::new("two").expect("n")), Err(StoreError::NotFound(_))));
        let mode = fs::metadata(store.root()).expect("meta").permissions().mode() & 0o777;
        assert_eq!(mode, 0o700);
    }
}
