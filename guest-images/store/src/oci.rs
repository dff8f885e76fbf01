//! Importing an OCI image from local disk into the store: [`import`].
//!
//! # What is read
//!
//! - An **OCI image layout** directory (`oci-layout`, `index.json`, `blobs/sha256/…`), as `skopeo copy … oci:DIR`,
//!   `buildah push … oci:DIR` or `docker buildx build --output type=oci,tar=false` write it. The index names the
//!   manifest: its only entry, or its only `linux/amd64` one; an entry may be an image index (a multi-platform
//!   image) once, chosen from the same way.
//! - A **tar of an OCI layout** (`skopeo copy … oci-archive:FILE`), read in place.
//! - A **`docker save` archive**: a tar whose `manifest.json` lists one image's `Config` and `Layers` paths (every
//!   Docker version writes it, the ones that also write an OCI layout beside it included); its layers' symlinks
//!   (`layer.tar -> ../<id>/layer.tar`, an older Docker's way of not storing a layer twice) are followed within
//!   the archive. The same files unpacked into a directory are read too.
//!
//! Layers are tars, plain or gzip-compressed (known by the magic, whatever the media type says); zstd and encrypted
//! layers are refused. At most [`MAX_LAYERS`] layers.
//!
//! # What is trusted
//!
//! Nothing before it is checked. Every JSON document (index, manifest, config) is at most 4 MiB and, when a
//! digest names it, is hashed and compared before it is parsed. In an OCI layout every layer blob's sha256 is
//! checked against the manifest before it is extracted, and its uncompressed stream against the config's
//! `rootfs.diff_ids` while it is; in a `docker save` archive, which names layers by path, each layer's uncompressed
//! stream is checked against the `diff_ids` before it is extracted (and again while it is), and the config against
//! its file name when that is a digest (`<sha256>.json`, `blobs/sha256/<sha256>`). Only sha256 digests are taken.
//!
//! Each layer becomes a store layer keyed by its `diff_id` (`LayerKey::of(&[b"oci-layer", diff_id])`), so the two
//! forms of an image share their layers, and an import of an image whose layers the store has (a re-import, a
//! second tag, a sibling image) extracts only the ones it lacks. A layer an image repeats is kept once, at its
//! topmost place (its lower copies are all hidden by it, and overlayfs takes a directory once). The extraction itself is [`apply_layer`]: see
//! [`crate::layer_tar`] for the rules that keep a hostile layer inside its directory (no `..`, nothing created
//! through a symlink, hard links only within the layer, no device nodes but whiteouts, owners below 65536,
//! overlay attributes never taken from the tar) and the bounds ([`ImportLimits`]).
//!
//! # What the image keeps
//!
//! The config's `Env` (`KEY=VALUE`), `WorkingDir`, `User` (a name, or `name:group`'s name; root — `""`, `0`,
//! `root` — is the default and is not recorded; a numeric user other than 0 is not kept either, with a warning,
//! since jobs take an account by name) and `Entrypoint` followed by `Cmd` as the image's command. The record's
//! source is the manifest's digest (for a `docker save` archive, which holds no manifest blob, the config's: the
//! image ID Docker shows).

use std::collections::HashMap;
use std::fs::File;
use std::io::{self, BufReader, Read};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde::de::DeserializeOwned;
use sha2::{Digest, Sha256};
use strata_core::ImageName;

pub use crate::layer_tar::{ImportLimits, LayerStats, OciError, apply_layer};
use crate::layer_tar::{Meta, check_sum, components, layer_digest, parse_pax, trim_nul};
use crate::store::{ImageConfig, ImageRecord, ImageSource, ImageStore, LayerKey, MAX_LAYERS};

/// The largest JSON document (index, manifest, config, `manifest.json`) read.
pub const MAX_JSON: u64 = 4 << 20;
/// The most members an outer archive (`docker save`, OCI archive) may have.
const MAX_MEMBERS: usize = 1 << 20;
/// Symlinks between an archive's members are followed at most this deep.
const MAX_HOPS: usize = 8;

const OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
const DOCKER_LIST: &str = "application/vnd.docker.distribution.manifest.list.v2+json";

fn format_error(what: impl Into<String>) -> OciError {
    OciError::Format(what.into())
}

fn io_error<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> OciError + 'a {
    move |source| OciError::Io { what, path: path.to_owned(), source }
}

/// Imports the image at `source` (an OCI layout directory, an OCI archive or a `docker save` archive) as `name`,
/// with the default [`ImportLimits`]; see the module docs. `progress` gets a line per layer and warnings.
pub fn import(
    store: &ImageStore,
    source: &Path,
    name: &ImageName,
    progress: &dyn Fn(&str),
) -> Result<ImageRecord, OciError> {
    import_with_limits(store, source, name, &ImportLimits::default(), progress)
}

/// [`import`] within `limits`.
pub fn import_with_limits(
    store: &ImageStore,
    source: &Path,
    name: &ImageName,
    limits: &ImportLimits,
    progress: &dyn Fn(&str),
) -> Result<ImageRecord, OciError> {
    let meta = std::fs::metadata(source).map_err(io_error("reading", source))?;
    let src = if meta.is_dir() { Source::Dir(source.to_owned()) } else { Source::Archive(Archive::index(source)?) };
    let plan = if src.has("manifest.json") {
        docker_plan(&src)?
    } else if src.has("index.json") {
        oci_plan(&src)?
    } else {
        return Err(format_error(format!(
            "{} is neither an OCI image layout (no index.json) nor a `docker save` archive (no manifest.json)",
            source.display()
        )));
    };
    let config = image_config(&plan.config, progress);
    let mut layers = install_layers(store, &src, &plan, limits, progress)?;
    // A layer repeated (the empty layer is, in images of older Dockers) is all hidden by its topmost copy, and
    // overlayfs takes a directory once.
    let mut seen = std::collections::HashSet::new();
    layers.reverse();
    layers.retain(|key| seen.insert(key.clone()));
    layers.reverse();
    let record = ImageRecord {
        name: name.clone(),
        base: None,
        layers,
        config,
        source: ImageSource::Oci { manifest: plan.manifest },
        created: strata_image_util::rfc3339_now(),
    };
    store.put(&record)?;
    Ok(record)
}

/// What an import does: the layers in order (bottom first) and the config.
struct Plan {
    /// The manifest's digest (a `docker save` archive's: the config's).
    manifest: String,
    config: ConfigFile,
    layers: Vec<PlannedLayer>,
}

struct PlannedLayer {
    /// Its name in the source.
    member: String,
    /// The blob's digest, checked before extraction (an OCI layout's layers); `None` for a `docker save` layer,
    /// whose uncompressed stream is checked against `diff_id` first instead.
    digest: Option<String>,
    /// The blob's size the manifest declares.
    declared: Option<u64>,
    /// The uncompressed stream's digest.
    diff_id: String,
}

/// Makes (or finds) every layer of `plan` in the store; returns their keys.
fn install_layers(
    store: &ImageStore,
    src: &Source,
    plan: &Plan,
    limits: &ImportLimits,
    progress: &dyn Fn(&str),
) -> Result<Vec<LayerKey>, OciError> {
    let count = plan.layers.len();
    let mut keys = Vec::with_capacity(count);
    let mut image_bytes = 0u64;
    for (i, layer) in plan.layers.iter().enumerate() {
        let key = LayerKey::of(&[b"oci-layer", layer.diff_id.as_bytes()]);
        let shown_digest = short(layer.digest.as_deref().unwrap_or(&layer.diff_id));
        if let Some((_, record)) = store.layer(&key) {
            progress(&format!("layer {}/{count} {shown_digest} already in the store", i + 1));
            image_bytes = image_bytes.saturating_add(record.size_bytes);
            keys.push(key);
            continue;
        }
        let (_, size) = src.open(&layer.member)?;
        progress(&format!("layer {}/{count} {shown_digest} {}", i + 1, human(size)));
        let remaining = limits.max_image_bytes.saturating_sub(image_bytes);
        if remaining == 0 {
            return Err(OciError::TooLarge(format!("an image of more than {} bytes", limits.max_image_bytes)));
        }
        let layer_limits = ImportLimits { max_layer_bytes: limits.max_layer_bytes.min(remaining), ..*limits };
        // Checked before a byte of it is extracted.
        match &layer.digest {
            Some(digest) => {
                if let Some(declared) = layer.declared
                    && declared > layer_limits.max_layer_bytes
                {
                    return Err(OciError::TooLarge(format!(
                        "layer {digest} of {declared} bytes (at most {})",
                        layer_limits.max_layer_bytes
                    )));
                }
                verify_blob(src, &layer.member, digest, layer.declared)?;
            }
            None => {
                let (reader, _) = src.open(&layer.member)?;
                let (found, _) = layer_digest(reader, layer_limits.max_layer_bytes)?;
                if found != layer.diff_id {
                    return Err(OciError::Digest {
                        what: format!("layer {}", layer.member),
                        expected: layer.diff_id.clone(),
                        found,
                    });
                }
            }
        }
        let mut stats = None;
        store.add_layer(&key, &format!("oci {}", layer.diff_id), |tree| {
            let (reader, _) = src.open(&layer.member)?;
            let made = apply_layer(reader, tree, &layer_limits)?;
            if made.diff_id != layer.diff_id {
                return Err(OciError::Digest {
                    what: format!("layer {} uncompressed", layer.member),
                    expected: layer.diff_id.clone(),
                    found: made.diff_id,
                });
            }
            stats = Some(made);
            Ok(())
        })?;
        if let Some(stats) = stats {
            if stats.dropped_xattrs > 0 {
                progress(&format!(
                    "  left out {} extended attributes (only user.* and security.capability are kept)",
                    stats.dropped_xattrs
                ));
            }
            image_bytes = image_bytes.saturating_add(stats.stream_bytes);
        }
        keys.push(key);
    }
    Ok(keys)
}

/// `sha256:0123456789ab…`
fn short(digest: &str) -> String {
    match digest.get(..19) {
        Some(head) if digest.len() > 19 => format!("{head}…"),
        _ => digest.to_owned(),
    }
}

/// `12.3 MB`
fn human(bytes: u64) -> String {
    const UNITS: [&str; 4] = ["kB", "MB", "GB", "TB"];
    if bytes < 1000 {
        return format!("{bytes} B");
    }
    let mut value = bytes as f64 / 1000.0;
    let mut unit = 0;
    while value >= 1000.0 && unit + 1 < UNITS.len() {
        value /= 1000.0;
        unit += 1;
    }
    format!("{value:.1} {}", UNITS[unit])
}

// ---------------------------------------------------------------------------------------------------------------
// The documents.

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Descriptor {
    #[serde(default)]
    media_type: Option<String>,
    digest: String,
    #[serde(default)]
    size: Option<u64>,
    #[serde(default)]
    platform: Option<Platform>,
}

#[derive(Debug, Deserialize)]
struct Platform {
    #[serde(default)]
    architecture: String,
    #[serde(default)]
    os: String,
}

#[derive(Debug, Deserialize)]
struct Index {
    manifests: Vec<Descriptor>,
}

#[derive(Debug, Deserialize)]
struct Manifest {
    config: Descriptor,
    layers: Vec<Descriptor>,
}

#[derive(Debug, Deserialize)]
struct ConfigFile {
    #[serde(default)]
    config: Option<ContainerConfig>,
    rootfs: RootFs,
}

#[derive(Debug, Default, Deserialize)]
struct ContainerConfig {
    #[serde(rename = "Env", default)]
    env: Option<Vec<String>>,
    #[serde(rename = "WorkingDir", default)]
    working_dir: Option<String>,
    #[serde(rename = "User", default)]
    user: Option<String>,
    #[serde(rename = "Cmd", default)]
    cmd: Option<Vec<String>>,
    #[serde(rename = "Entrypoint", default)]
    entrypoint: Option<Vec<String>>,
}

#[derive(Debug, Deserialize)]
struct RootFs {
    #[serde(rename = "type")]
    kind: String,
    diff_ids: Vec<String>,
}

#[derive(Debug, Deserialize)]
struct DockerImage {
    #[serde(rename = "Config")]
    config: String,
    #[serde(rename = "Layers")]
    layers: Vec<String>,
}

/// The hex of a `sha256:<hex>` digest; other algorithms and malformed digests are refused.
fn sha256_hex(digest: &str) -> Result<&str, OciError> {
    let (algorithm, hex) = digest.split_once(':').ok_or_else(|| format_error(format!("{digest:?} is not a digest")))?;
    if algorithm != "sha256" {
        return Err(format_error(format!("digest {digest:?}: only sha256 digests are supported")));
    }
    if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) {
        return Err(format_error(format!("{digest:?} is not a sha256 digest (64 lowercase hex digits)")));
    }
    Ok(hex)
}

fn blob_path(digest: &str) -> Result<String, OciError> {
    Ok(format!("blobs/sha256/{}", sha256_hex(digest)?))
}

/// Reads the JSON document `name` (at most [`MAX_JSON`] bytes), checked against `digest` when one is given;
/// returns it parsed and its digest.
fn read_json<T: DeserializeOwned>(
    src: &Source,
    name: &str,
    digest: Option<&str>,
    declared: Option<u64>,
) -> Result<(T, String), OciError> {
    let (reader, size) = src.open(name)?;
    if size > MAX_JSON || declared.is_some_and(|d| d > MAX_JSON) {
        return Err(OciError::TooLarge(format!("{name} of {size} bytes (JSON documents are at most {MAX_JSON})")));
    }
    let mut bytes = Vec::new();
    reader.take(MAX_JSON + 1).read_to_end(&mut bytes).map_err(io_error("reading", &src.path_of(name)))?;
    if bytes.len() as u64 > MAX_JSON {
        return Err(OciError::TooLarge(format!("{name} (JSON documents are at most {MAX_JSON} bytes)")));
    }
    let found = format!("sha256:{}", strata_image_util::hex(&Sha256::digest(&bytes)));
    if let Some(expected) = digest
        && found != expected
    {
        return Err(OciError::Digest { what: name.to_owned(), expected: expected.to_owned(), found });
    }
    let parsed = serde_json::from_slice(&bytes).map_err(|e| format_error(format!("{name}: {e}")))?;
    Ok((parsed, found))
}

/// Hashes the blob `name` and compares it with `digest` (and its size with the declared one).
fn verify_blob(src: &Source, name: &str, digest: &str, declared: Option<u64>) -> Result<(), OciError> {
    let (mut reader, size) = src.open(name)?;
    if let Some(declared) = declared
        && declared != size
    {
        return Err(format_error(format!("{name} has {size} bytes, its manifest says {declared}")));
    }
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 256 * 1024];
    loop {
        let n = match reader.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(io_error("reading", &src.path_of(name))(e)),
        };
        hasher.update(&buf[..n]);
    }
    let found = format!("sha256:{}", strata_image_util::hex(&hasher.finalize()));
    if found != digest {
        return Err(OciError::Digest { what: name.to_owned(), expected: digest.to_owned(), found });
    }
    Ok(())
}

fn is_index(descriptor: &Descriptor) -> bool {
    matches!(descriptor.media_type.as_deref(), Some(OCI_INDEX | DOCKER_LIST))
}

/// The manifest an index names: its only one, or its only `linux/amd64` one.
fn choose<'a>(manifests: &'a [Descriptor], what: &str) -> Result<&'a Descriptor, OciError> {
    if let [only] = manifests {
        return Ok(only);
    }
    let amd64: Vec<&Descriptor> = manifests
        .iter()
        .filter(|d| d.platform.as_ref().is_some_and(|p| p.os == "linux" && p.architecture == "amd64"))
        .collect();
    match amd64.as_slice() {
        [one] => Ok(one),
        _ => Err(format_error(format!(
            "{what} lists {} manifests, {} of them for linux/amd64: it must name one image (copy just the one \
             wanted, e.g. `skopeo copy --override-arch amd64 …`)",
            manifests.len(),
            amd64.len()
        ))),
    }
}

/// An OCI layout's plan: index → (index →) manifest → config and layers.
fn oci_plan(src: &Source) -> Result<Plan, OciError> {
    if src.has("oci-layout") {
        let (layout, _): (serde_json::Value, String) = read_json(src, "oci-layout", None, None)?;
        if layout.get("imageLayoutVersion").and_then(|v| v.as_str()).is_none() {
            return Err(format_error("oci-layout has no imageLayoutVersion"));
        }
    }
    let (index, _): (Index, String) = read_json(src, "index.json", None, None)?;
    let mut chosen = choose(&index.manifests, "index.json")?;
    let nested: Index;
    if is_index(chosen) {
        let name = blob_path(&chosen.digest)?;
        (nested, _) = read_json(src, &name, Some(&chosen.digest), chosen.size)?;
        chosen = choose(&nested.manifests, &format!("the image index {}", chosen.digest))?;
        if is_index(chosen) {
            return Err(format_error("an image index inside an image index inside index.json (one level is read)"));
        }
    }
    let manifest_digest = chosen.digest.clone();
    let (manifest, _): (Manifest, String) =
        read_json(src, &blob_path(&chosen.digest)?, Some(&chosen.digest), chosen.size)?;
    let (config, _): (ConfigFile, String) =
        read_json(src, &blob_path(&manifest.config.digest)?, Some(&manifest.config.digest), manifest.config.size)?;
    check_layer_count(manifest.layers.len(), &config)?;
    let mut layers = Vec::with_capacity(manifest.layers.len());
    for (descriptor, diff_id) in manifest.layers.iter().zip(&config.rootfs.diff_ids) {
        check_media_type(descriptor)?;
        sha256_hex(diff_id)?;
        layers.push(PlannedLayer {
            member: blob_path(&descriptor.digest)?,
            digest: Some(descriptor.digest.clone()),
            declared: descriptor.size,
            diff_id: diff_id.clone(),
        });
    }
    Ok(Plan { manifest: manifest_digest, config, layers })
}

fn check_layer_count(layers: usize, config: &ConfigFile) -> Result<(), OciError> {
    if config.rootfs.kind != "layers" {
        return Err(format_error(format!("the config's rootfs is of type {:?}, not \"layers\"", config.rootfs.kind)));
    }
    if layers == 0 {
        return Err(format_error("an image of no layers"));
    }
    if layers > MAX_LAYERS {
        return Err(OciError::TooLarge(format!("an image of {layers} layers (at most {MAX_LAYERS})")));
    }
    if config.rootfs.diff_ids.len() != layers {
        return Err(format_error(format!(
            "{layers} layers but {} diff_ids in the config",
            config.rootfs.diff_ids.len()
        )));
    }
    Ok(())
}

fn check_media_type(descriptor: &Descriptor) -> Result<(), OciError> {
    let Some(media_type) = descriptor.media_type.as_deref() else { return Ok(()) };
    if media_type.contains("zstd") || media_type.contains("encrypted") {
        return Err(format_error(format!(
            "layer {} is {media_type}: only plain and gzip tar layers are supported",
            descriptor.digest
        )));
    }
    if !media_type.contains("tar") {
        return Err(format_error(format!("layer {} has media type {media_type:?}, not a tar", descriptor.digest)));
    }
    Ok(())
}

/// A `docker save` archive's plan: `manifest.json` → config and layers.
fn docker_plan(src: &Source) -> Result<Plan, OciError> {
    let (images, _): (Vec<DockerImage>, String) = read_json(src, "manifest.json", None, None)?;
    let image = match images.as_slice() {
        [one] => one,
        _ => {
            return Err(format_error(format!(
                "manifest.json lists {} images: save one image per archive",
                images.len()
            )));
        }
    };
    let config_name = plain_member(&image.config)?;
    // The config's name is its digest in every Docker since 1.10: `<sha256>.json` or `blobs/sha256/<sha256>`.
    let named = config_name
        .strip_suffix(".json")
        .or_else(|| config_name.strip_prefix("blobs/sha256/"))
        .filter(|hex| sha256_hex(&format!("sha256:{hex}")).is_ok())
        .map(|hex| format!("sha256:{hex}"));
    let (config, found): (ConfigFile, String) = read_json(src, &config_name, named.as_deref(), None)?;
    check_layer_count(image.layers.len(), &config)?;
    let mut layers = Vec::with_capacity(image.layers.len());
    for (member, diff_id) in image.layers.iter().zip(&config.rootfs.diff_ids) {
        sha256_hex(diff_id)?;
        layers.push(PlannedLayer {
            member: plain_member(member)?,
            digest: None,
            declared: None,
            diff_id: diff_id.clone(),
        });
    }
    Ok(Plan { manifest: found, config, layers })
}

/// A member name from `manifest.json`, normalised as the archive's index keeps them.
fn plain_member(name: &str) -> Result<String, OciError> {
    let parts = components(name.as_bytes())
        .map_err(|reason| format_error(format!("manifest.json names {name:?}, with {reason}")))?;
    String::from_utf8(parts.join(&b'/')).map_err(|_| format_error(format!("manifest.json names {name:?}")))
}

/// What jobs take from the image's config.
fn image_config(config: &ConfigFile, progress: &dyn Fn(&str)) -> ImageConfig {
    let mut out = ImageConfig::default();
    let Some(c) = &config.config else { return out };
    for pair in c.env.iter().flatten() {
        match pair.split_once('=') {
            Some((key, value)) if !key.is_empty() => out.set_env(key, value),
            _ => progress(&format!("warning: the image's Env entry {pair:?} is not KEY=VALUE; left out")),
        }
    }
    out.workdir = c
        .working_dir
        .as_deref()
        .filter(|w| !w.is_empty())
        .map(|w| if w.starts_with('/') { w.to_owned() } else { format!("/{w}") });
    out.user = c.user.as_deref().and_then(|user| image_user(user, progress));
    let command: Vec<String> = c.entrypoint.iter().flatten().chain(c.cmd.iter().flatten()).cloned().collect();
    out.cmd = (!command.is_empty()).then_some(command);
    out
}

/// The account of an image's `User`: a name (of `name` or `name:group`); root (`""`, `0`, `root`) is `None`, and
/// so is another number, with a warning.
fn image_user(user: &str, progress: &dyn Fn(&str)) -> Option<String> {
    let name = user.split_once(':').map_or(user, |(name, _)| name);
    match name {
        "" | "0" | "root" => None,
        n if n.bytes().all(|b| b.is_ascii_digit()) => {
            progress(&format!(
                "warning: the image's user is the number {user:?}, which names no account: jobs run as root \
                 unless they name a user"
            ));
            None
        }
        n => Some(n.to_owned()),
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Where the blobs are.

/// An OCI layout directory, or an archive read in place.
enum Source {
    Dir(PathBuf),
    Archive(Archive),
}

impl Source {
    fn path_of(&self, name: &str) -> PathBuf {
        match self {
            Source::Dir(dir) => dir.join(name),
            Source::Archive(archive) => archive.path.join(name),
        }
    }

    fn has(&self, name: &str) -> bool {
        match self {
            Source::Dir(dir) => dir.join(name).is_file(),
            Source::Archive(archive) => archive.members.contains_key(name),
        }
    }

    /// The member `name` (a plain relative path) and its size.
    fn open(&self, name: &str) -> Result<(Box<dyn Read + '_>, u64), OciError> {
        match self {
            Source::Dir(dir) => {
                let parts = components(name.as_bytes())
                    .map_err(|reason| format_error(format!("{name:?} is not a plain name: {reason}")))?;
                let path = dir.join(String::from_utf8_lossy(&parts.join(&b'/')).as_ref());
                let file = File::open(&path).map_err(io_error("opening", &path))?;
                let meta = file.metadata().map_err(io_error("reading", &path))?;
                if !meta.is_file() {
                    return Err(format_error(format!("{} is not a regular file", path.display())));
                }
                Ok((Box::new(BufReader::with_capacity(256 * 1024, file)), meta.len()))
            }
            Source::Archive(archive) => {
                let member = archive
                    .members
                    .get(name)
                    .copied()
                    .ok_or_else(|| format_error(format!("{} has no member {name}", archive.path.display())))?;
                let reader = MemberReader { file: &archive.file, pos: member.offset, end: member.offset + member.size };
                Ok((Box::new(BufReader::with_capacity(256 * 1024, reader)), member.size))
            }
        }
    }
}

/// A tar read in place: where each member's data is.
struct Archive {
    path: PathBuf,
    file: File,
    members: HashMap<String, Member>,
}

#[derive(Debug, Clone, Copy)]
struct Member {
    offset: u64,
    size: u64,
}

impl Archive {
    /// Lists the regular files of the tar at `path` (names normalised: no leading `./` or `/`), its symlinks and
    /// hard links resolved to the files they name within it.
    fn index(path: &Path) -> Result<Archive, OciError> {
        let file = File::open(path).map_err(io_error("opening", path))?;
        let len = file.metadata().map_err(io_error("reading", path))?.len();
        let mut members = HashMap::new();
        let mut links: Vec<(String, String)> = Vec::new();
        let mut pos = 0u64;
        let mut meta = Meta::default();
        let mut count = 0usize;
        let not_tar = |what: &str| format_error(format!("{}: not an image archive ({what})", path.display()));
        loop {
            let mut block = [0u8; 512];
            match read_at_full(&file, &mut block, pos).map_err(io_error("reading", path))? {
                0 => break,
                512 => {}
                _ => return Err(not_tar("it ends inside a header")),
            }
            if block.iter().all(|b| *b == 0) {
                break;
            }
            if pos == 0 && block.starts_with(&[0x1f, 0x8b]) {
                return Err(not_tar("it is gzip-compressed: decompress it first, an archive is read in place"));
            }
            check_sum(&block).map_err(|_| not_tar("a header checksum is wrong"))?;
            count += 1;
            if count > MAX_MEMBERS {
                return Err(OciError::TooLarge(format!("an archive of more than {MAX_MEMBERS} members")));
            }
            pos += 512;
            let header = tar::Header::from_byte_slice(&block);
            let header_size = header.entry_size().map_err(|_| not_tar("a size field is malformed"))?;
            let kind = header.entry_type().as_byte();
            if matches!(kind, b'x' | b'g' | b'L' | b'K') {
                if header_size > MAX_JSON {
                    return Err(OciError::TooLarge(format!("{}: a {header_size}-byte tar record", path.display())));
                }
                let mut data = vec![0u8; header_size as usize];
                if read_at_full(&file, &mut data, pos).map_err(io_error("reading", path))? < data.len() {
                    return Err(not_tar("it ends inside a record"));
                }
                pos += header_size.next_multiple_of(512);
                match kind {
                    b'x' => parse_pax(&data, &mut meta)?,
                    b'L' => meta.path = Some(trim_nul(data)),
                    b'K' => meta.link = Some(trim_nul(data)),
                    _ => {}
                }
                continue;
            }
            let taken = std::mem::take(&mut meta);
            let size = taken.size.unwrap_or(header_size);
            let raw = taken.path.unwrap_or_else(|| header.path_bytes().into_owned());
            let name = components(&raw).ok().and_then(|p| String::from_utf8(p.join(&b'/')).ok());
            let link = taken.link.or_else(|| header.link_name_bytes().map(|l| l.into_owned()));
            if let Some(name) = name.filter(|n| !n.is_empty()) {
                match kind {
                    b'0' | b'7' | 0 => {
                        members.insert(name, Member { offset: pos, size });
                    }
                    b'1' => {
                        if let Some(target) = link.as_deref().and_then(|l| resolve(&[], l)) {
                            links.push((name, target));
                        }
                    }
                    b'2' => {
                        let dir: Vec<&str> = name.split('/').collect();
                        let parent = &dir[..dir.len() - 1];
                        if let Some(target) = link.as_deref().and_then(|l| resolve(parent, l)) {
                            links.push((name, target));
                        }
                    }
                    _ => {}
                }
            }
            pos = pos
                .checked_add(size.checked_next_multiple_of(512).ok_or_else(|| not_tar("a size is too large"))?)
                .ok_or_else(|| not_tar("a size is too large"))?;
            if pos > len {
                return Err(not_tar("it ends inside a member"));
            }
        }
        for _ in 0..MAX_HOPS {
            let mut changed = false;
            for (name, target) in &links {
                if let Some(member) = members.get(target).copied()
                    && !members.contains_key(name)
                {
                    members.insert(name.clone(), member);
                    changed = true;
                }
            }
            if !changed {
                break;
            }
        }
        Ok(Archive { path: path.to_owned(), file, members })
    }
}

/// A link target within an archive, from the directory `parent` (`..` may climb, not above the archive's root).
fn resolve(parent: &[&str], target: &[u8]) -> Option<String> {
    let target = std::str::from_utf8(target).ok()?;
    let mut parts: Vec<&str> = if target.starts_with('/') { Vec::new() } else { parent.to_vec() };
    for part in target.split('/') {
        match part {
            "" | "." => {}
            ".." => {
                parts.pop()?;
            }
            part => parts.push(part),
        }
    }
    (!parts.is_empty()).then(|| parts.join("/"))
}

fn read_at_full(file: &File, buf: &mut [u8], offset: u64) -> io::Result<usize> {
    let mut got = 0;
    while got < buf.len() {
        match file.read_at(&mut buf[got..], offset + got as u64) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(got)
}

/// One member's bytes, read in place.
struct MemberReader<'a> {
    file: &'a File,
    pos: u64,
    end: u64,
}

impl Read for MemberReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let left = self.end.saturating_sub(self.pos);
        if left == 0 || buf.is_empty() {
            return Ok(0);
        }
        let want = usize::try_from(left).map_or(buf.len(), |l| l.min(buf.len()));
        let n = self.file.read_at(&mut buf[..want], self.pos)?;
        if n == 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the archive is shorter than its member"));
        }
        self.pos += n as u64;
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn users_are_names_or_root() {
        let warned = std::cell::Cell::new(0);
        let progress = |_: &str| warned.set(warned.get() + 1);
        assert_eq!(image_user("", &progress), None);
        assert_eq!(image_user("0:0", &progress), None);
        assert_eq!(image_user("root", &progress), None);
        assert_eq!(image_user("app:staff", &progress), Some("app".into()));
        assert_eq!(image_user("nobody", &progress), Some("nobody".into()));
        assert_eq!(warned.get(), 0);
        assert_eq!(image_user("1000:1000", &progress), None);
        assert_eq!(warned.get(), 1);
    }

    #[test]
    fn digests_are_sha256_only() {
        assert!(sha256_hex(&format!("sha256:{}", "a".repeat(64))).is_ok());
        assert!(sha256_hex(&format!("sha512:{}", "a".repeat(128))).is_err());
        assert!(sha256_hex(&format!("sha256:{}", "A".repeat(64))).is_err());
        assert!(sha256_hex("sha256:../../etc").is_err());
    }

    #[test]
    fn archive_links_resolve_within_the_archive() {
        assert_eq!(resolve(&["abc"], b"../def/layer.tar").as_deref(), Some("def/layer.tar"));
        assert_eq!(resolve(&["abc"], b"../../x"), None);
        assert_eq!(resolve(&[], b"/x/./y").as_deref(), Some("x/y"));
    }

    #[test]
    fn sizes_read_as_people_write_them() {
        assert_eq!(human(999), "999 B");
        assert_eq!(human(12_300_000), "12.3 MB");
        assert_eq!(short(&format!("sha256:{}", "ab".repeat(32))), "sha256:abababababab…");
    }
}
