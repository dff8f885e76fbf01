//! OCI imports end to end: layouts and `docker save` archives built here, imported into a store, the layers'
//! trees checked (and mounted with overlayfs when the test runs as root), and hostile layers refused.

use std::cell::RefCell;
use std::ffi::CString;
use std::fs;
use std::io::Write;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail, ensure};
use serde_json::json;
use sha2::{Digest, Sha256};
use strata_core::ImageName;
use strata_image_store::layer_tar::{ImportLimits, apply_layer};
use strata_image_store::oci::{self, OciError};
use strata_image_store::{ImageStore, LayerKey};
use tar::EntryType;

const MTIME: u64 = 1_700_000_000;

fn sha256(bytes: &[u8]) -> String {
    format!("sha256:{}", Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect::<String>())
}

fn gzip(bytes: &[u8]) -> Result<Vec<u8>> {
    let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    encoder.write_all(bytes)?;
    Ok(encoder.finish()?)
}

fn is_root() -> bool {
    nix::unistd::geteuid().is_root()
}

/// A layer tar written entry by entry, names and link names as raw bytes (the `tar` crate's setters refuse `..`).
struct Layer {
    tar: tar::Builder<Vec<u8>>,
}

impl Layer {
    fn new() -> Layer {
        Layer { tar: tar::Builder::new(Vec::new()) }
    }

    fn header(name: &str, kind: EntryType, size: u64, mode: u32, link: Option<&str>) -> tar::Header {
        let mut header = tar::Header::new_ustar();
        let old = header.as_old_mut();
        old.name[..name.len()].copy_from_slice(name.as_bytes());
        if let Some(link) = link {
            old.linkname[..link.len()].copy_from_slice(link.as_bytes());
        }
        header.set_entry_type(kind);
        header.set_size(size);
        header.set_mode(mode);
        header.set_uid(0);
        header.set_gid(0);
        header.set_mtime(MTIME);
        header.set_cksum();
        header
    }

    fn raw(mut self, header: &tar::Header, data: &[u8]) -> Result<Layer> {
        self.tar.append(header, data)?;
        Ok(self)
    }

    fn dir(self, name: &str) -> Result<Layer> {
        self.raw(&Layer::header(name, EntryType::Directory, 0, 0o755, None), b"")
    }

    fn file(self, name: &str, data: &[u8]) -> Result<Layer> {
        self.file_as(name, data, 0o644, 0)
    }

    fn file_as(self, name: &str, data: &[u8], mode: u32, uid: u64) -> Result<Layer> {
        let mut header = Layer::header(name, EntryType::Regular, data.len() as u64, mode, None);
        header.set_uid(uid);
        header.set_gid(uid);
        header.set_cksum();
        self.raw(&header, data)
    }

    fn symlink(self, name: &str, target: &str) -> Result<Layer> {
        self.raw(&Layer::header(name, EntryType::Symlink, 0, 0o777, Some(target)), b"")
    }

    fn hard_link(self, name: &str, target: &str) -> Result<Layer> {
        self.raw(&Layer::header(name, EntryType::Link, 0, 0o644, Some(target)), b"")
    }

    fn fifo(self, name: &str) -> Result<Layer> {
        self.raw(&Layer::header(name, EntryType::Fifo, 0, 0o640, None), b"")
    }

    fn device(self, name: &str, kind: EntryType, major: u32, minor: u32) -> Result<Layer> {
        let mut header = Layer::header(name, kind, 0, 0o666, None);
        header.set_device_major(major)?;
        header.set_device_minor(minor)?;
        header.set_cksum();
        self.raw(&header, b"")
    }

    /// PAX records, applying to the next entry.
    fn pax(mut self, records: &[(&str, &[u8])]) -> Result<Layer> {
        self.tar.append_pax_extensions(records.iter().map(|(k, v)| (*k, *v)))?;
        Ok(self)
    }

    fn finish(self) -> Result<Vec<u8>> {
        Ok(self.tar.into_inner()?)
    }
}

/// The two layers of the test image: a bottom with a bit of everything, a top that deletes a file and replaces a
/// directory.
fn bottom_layer() -> Result<Vec<u8>> {
    Layer::new()
        .dir("./")?
        .dir("./etc/")?
        .file("./etc/keep", b"kept\n")?
        .file("./etc/gone", b"deleted above\n")?
        .dir("./opt/")?
        .file("./opt/old", b"hidden above\n")?
        .dir("./opt/sub/")?
        .file("./opt/sub/deep", b"hidden above\n")?
        .dir("./bin/")?
        .file_as("./bin/tool", b"#!/bin/sh\necho tool\n", 0o4755, 1000)?
        .hard_link("./bin/tool2", "./bin/tool")?
        .symlink("./bin/sh-link", "/bin/tool")?
        .fifo("./run/pipe")?
        .finish()
}

fn top_layer() -> Result<Vec<u8>> {
    Layer::new()
        .dir("./etc/")?
        .file("./etc/.wh.gone", b"")?
        .dir("./opt/")?
        .file("./opt/.wh..wh..opq", b"")?
        .file("./opt/new", b"only this\n")?
        .pax(&[("SCHILY.xattr.user.note", b"a\nnote"), ("path", b"etc/a-name-longer-than-the-ustar-field-holds-which-is-a-hundred-bytes-so-this-one-needs-the-pax-path-record")])?
        .file("placeholder", b"pax\n")?
        .finish()
}

fn image_config(diff_ids: &[String]) -> serde_json::Value {
    json!({
        "architecture": "amd64",
        "os": "linux",
        "config": {
            "Env": ["PATH=/usr/local/bin:/usr/bin:/bin", "LANG=C.UTF-8", "PATH=/opt/bin"],
            "WorkingDir": "/srv",
            "User": "app:app",
            "Entrypoint": ["/bin/tool"],
            "Cmd": ["--serve"]
        },
        "rootfs": {"type": "layers", "diff_ids": diff_ids}
    })
}

fn diff_id(blob: &[u8]) -> Result<String> {
    if blob.starts_with(&[0x1f, 0x8b]) {
        let mut plain = Vec::new();
        std::io::Read::read_to_end(&mut flate2::read::GzDecoder::new(blob), &mut plain)?;
        Ok(sha256(&plain))
    } else {
        Ok(sha256(blob))
    }
}

/// Writes an OCI layout of `blobs` (bottom first, as they go in the layout: plain or gzip); returns the manifest's
/// digest. With `multi`, index.json names an image index of an amd64 and an arm64 manifest.
fn write_layout(dir: &Path, blobs: &[Vec<u8>], multi: bool) -> Result<String> {
    let blob_dir = dir.join("blobs/sha256");
    fs::create_dir_all(&blob_dir)?;
    let put = |bytes: &[u8]| -> Result<serde_json::Value> {
        let digest = sha256(bytes);
        fs::write(blob_dir.join(&digest["sha256:".len()..]), bytes)?;
        Ok(json!({"digest": digest, "size": bytes.len()}))
    };
    let diff_ids = blobs.iter().map(|b| diff_id(b)).collect::<Result<Vec<_>>>()?;
    let config = serde_json::to_vec(&image_config(&diff_ids))?;
    let mut config_desc = put(&config)?;
    config_desc["mediaType"] = json!("application/vnd.oci.image.config.v1+json");
    let mut layers = Vec::new();
    for blob in blobs {
        let mut desc = put(blob)?;
        let gz = blob.starts_with(&[0x1f, 0x8b]);
        desc["mediaType"] = json!(if gz {
            "application/vnd.oci.image.layer.v1.tar+gzip"
        } else {
            "application/vnd.oci.image.layer.v1.tar"
        });
        layers.push(desc);
    }
    let manifest = serde_json::to_vec(&json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": config_desc,
        "layers": layers,
    }))?;
    let mut manifest_desc = put(&manifest)?;
    manifest_desc["mediaType"] = json!("application/vnd.oci.image.manifest.v1+json");
    let manifest_digest = manifest_desc["digest"].as_str().context("digest")?.to_owned();
    let top = if multi {
        let other = put(b"{\"not\": \"read\"}")?;
        let mut amd64 = manifest_desc.clone();
        amd64["platform"] = json!({"os": "linux", "architecture": "amd64"});
        let mut arm64 = other;
        arm64["mediaType"] = json!("application/vnd.oci.image.manifest.v1+json");
        arm64["platform"] = json!({"os": "linux", "architecture": "arm64"});
        let index = serde_json::to_vec(&json!({
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.index.v1+json",
            "manifests": [arm64, amd64],
        }))?;
        let mut desc = put(&index)?;
        desc["mediaType"] = json!("application/vnd.oci.image.index.v1+json");
        desc
    } else {
        manifest_desc
    };
    fs::write(dir.join("oci-layout"), br#"{"imageLayoutVersion": "1.0.0"}"#)?;
    fs::write(dir.join("index.json"), serde_json::to_vec(&json!({"schemaVersion": 2, "manifests": [top]}))?)?;
    Ok(manifest_digest)
}

/// Writes a `docker save` archive of the uncompressed `layers` (bottom first): `manifest.json`, `<config>.json`,
/// `<n>/layer.tar`, the last layer reached through a symlink as an older Docker stores a repeated layer. Returns
/// the config's digest.
fn write_docker_save(path: &Path, layers: &[Vec<u8>], config_diff_ids: Option<Vec<String>>) -> Result<String> {
    let diff_ids = match config_diff_ids {
        Some(ids) => ids,
        None => layers.iter().map(|l| sha256(l)).collect(),
    };
    let config = serde_json::to_vec(&image_config(&diff_ids))?;
    let config_digest = sha256(&config);
    let config_name = format!("{}.json", &config_digest["sha256:".len()..]);
    let mut tar = tar::Builder::new(fs::File::create(path)?);
    let add = |tar: &mut tar::Builder<fs::File>, name: &str, bytes: &[u8]| -> Result<()> {
        let mut header = tar::Header::new_ustar();
        header.set_path(name)?;
        header.set_size(bytes.len() as u64);
        header.set_mode(0o644);
        header.set_entry_type(EntryType::Regular);
        header.set_cksum();
        tar.append(&header, bytes)?;
        Ok(())
    };
    add(&mut tar, &config_name, &config)?;
    let mut names = Vec::new();
    for (i, layer) in layers.iter().enumerate() {
        add(&mut tar, &format!("{i}/layer.tar"), layer)?;
        names.push(format!("{i}/layer.tar"));
    }
    let last = names.len() - 1;
    let mut link = tar::Header::new_ustar();
    link.set_path("again/layer.tar")?;
    link.set_entry_type(EntryType::Symlink);
    link.set_link_name(format!("../{last}/layer.tar"))?;
    link.set_size(0);
    link.set_cksum();
    tar.append(&link, &b""[..])?;
    names[last] = "again/layer.tar".into();
    let manifest = json!([{"Config": config_name, "RepoTags": ["t:latest"], "Layers": names}]);
    add(&mut tar, "manifest.json", &serde_json::to_vec(&manifest)?)?;
    add(&mut tar, "repositories", b"{}")?;
    tar.into_inner()?.sync_all()?;
    Ok(config_digest)
}

fn name(text: &str) -> Result<ImageName> {
    ImageName::new(text).map_err(|e| anyhow::anyhow!("{e:?}"))
}

/// Progress lines an import printed.
#[derive(Default)]
struct Lines(RefCell<Vec<String>>);

impl Lines {
    fn push(&self, line: &str) {
        self.0.borrow_mut().push(line.to_owned());
    }

    fn all(&self) -> Vec<String> {
        self.0.borrow().clone()
    }
}

fn xattr(path: &Path, name: &str) -> Option<Vec<u8>> {
    let path = CString::new(path.as_os_str().as_bytes()).ok()?;
    let name = CString::new(name).ok()?;
    let mut buf = vec![0u8; 4096];
    // SAFETY: lgetxattr reads the two NUL-terminated strings and writes at most `buf.len()` bytes into `buf`.
    let n = unsafe { libc::lgetxattr(path.as_ptr(), name.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    if n < 0 {
        return None;
    }
    buf.truncate(n as usize);
    Some(buf)
}

fn layer_tree(store: &ImageStore, key: &LayerKey) -> Result<PathBuf> {
    Ok(store.layer(key).context("the layer is in the store")?.0)
}

/// The image of `bottom_layer` and `top_layer`, checked layer by layer and (as root) mounted.
fn check_image(store: &ImageStore, record: &strata_image_store::ImageRecord) -> Result<()> {
    ensure!(record.base.is_none() && record.layers.len() == 2, "{record:?}");
    let config = &record.config;
    ensure!(
        config.env == vec![("LANG".to_owned(), "C.UTF-8".to_owned()), ("PATH".to_owned(), "/opt/bin".to_owned())],
        "{:?}",
        config.env
    );
    ensure!(config.workdir.as_deref() == Some("/srv"));
    ensure!(config.user.as_deref() == Some("app"));
    ensure!(config.cmd == Some(vec!["/bin/tool".to_owned(), "--serve".to_owned()]));

    let bottom = layer_tree(store, &record.layers[0])?;
    let top = layer_tree(store, &record.layers[1])?;
    let tool = fs::symlink_metadata(bottom.join("bin/tool"))?;
    ensure!(tool.mode() & 0o7777 == 0o4755, "setuid kept: {:o}", tool.mode());
    ensure!(tool.uid() == 1000 && tool.gid() == 1000 && tool.nlink() == 2 && tool.mtime() == MTIME as i64);
    ensure!(fs::read_link(bottom.join("bin/sh-link"))? == Path::new("/bin/tool"));
    ensure!(fs::symlink_metadata(bottom.join("run/pipe"))?.file_type().is_fifo());
    ensure!(fs::symlink_metadata(bottom.join("run"))?.mode() & 0o777 == 0o755, "a missing parent is made 0755");

    let gone = fs::symlink_metadata(top.join("etc/gone"))?;
    ensure!(gone.file_type().is_char_device() && gone.rdev() == 0, "the whiteout is a 0/0 character device");
    ensure!(!top.join("etc/.wh.gone").exists() && !top.join("opt/.wh..wh..opq").exists());
    ensure!(xattr(&top.join("opt"), "trusted.overlay.opaque").as_deref() == Some(&b"y"[..]), "opt is opaque");
    ensure!(xattr(&top.join("etc"), "trusted.overlay.opaque").is_none());
    let long = top.join(
        "etc/a-name-longer-than-the-ustar-field-holds-which-is-a-hundred-bytes-so-this-one-needs-the-pax-path-record",
    );
    ensure!(fs::read(&long)? == b"pax\n");
    ensure!(xattr(&long, "user.note").as_deref() == Some(&b"a\nnote"[..]), "a PAX xattr with a newline is kept");

    if !is_root() {
        eprintln!("not root: the overlay mount is not tried");
        return Ok(());
    }
    let mnt = tempfile::tempdir()?;
    let lower = format!("lowerdir={}:{}", top.display(), bottom.display());
    let status = Command::new("mount").args(["-t", "overlay", "overlay", "-o", &lower]).arg(mnt.path()).status()?;
    ensure!(status.success(), "mount -t overlay -o {lower}");
    let merged = (|| -> Result<()> {
        let m = mnt.path();
        ensure!(fs::read(m.join("etc/keep"))? == b"kept\n");
        ensure!(!m.join("etc/gone").exists() && fs::symlink_metadata(m.join("etc/gone")).is_err(), "deleted file gone");
        let mut opt: Vec<_> =
            fs::read_dir(m.join("opt"))?.map(|e| e.map(|e| e.file_name())).collect::<Result<_, _>>()?;
        opt.sort();
        ensure!(opt == vec![std::ffi::OsString::from("new")], "the opaque dir shows only the upper's: {opt:?}");
        ensure!(fs::read(m.join("bin/tool2"))? == b"#!/bin/sh\necho tool\n");
        Ok(())
    })();
    let unmounted = Command::new("umount").arg(mnt.path()).status()?;
    merged?;
    ensure!(unmounted.success(), "umount");
    Ok(())
}

#[test]
fn an_oci_layout_with_a_whiteout_and_an_opaque_dir_imports_into_overlay_form() -> Result<()> {
    let home = tempfile::tempdir()?;
    let store = ImageStore::open(home.path())?;
    let layout = tempfile::tempdir()?;
    let manifest = write_layout(layout.path(), &[bottom_layer()?, gzip(&top_layer()?)?], false)?;
    let lines = Lines::default();
    let record = oci::import(&store, layout.path(), &name("oci-test")?, &|l| lines.push(l))?;
    check_image(&store, &record)?;
    ensure!(record.source == strata_image_store::ImageSource::Oci { manifest });
    let progress = lines.all();
    ensure!(progress.len() == 2, "{progress:?}");
    ensure!(progress[0].starts_with("layer 1/2 sha256:") && progress[0].ends_with(" kB"), "{progress:?}");
    ensure!(progress[1].starts_with("layer 2/2 sha256:"), "{progress:?}");
    ensure!(store.get(&name("oci-test")?)? == record);
    Ok(())
}

#[test]
fn a_multi_platform_index_imports_its_linux_amd64_image() -> Result<()> {
    let home = tempfile::tempdir()?;
    let store = ImageStore::open(home.path())?;
    let layout = tempfile::tempdir()?;
    let manifest = write_layout(layout.path(), &[gzip(&bottom_layer()?)?, top_layer()?], true)?;
    let record = oci::import(&store, layout.path(), &name("multi")?, &|_| {})?;
    ensure!(record.source == strata_image_store::ImageSource::Oci { manifest });
    check_image(&store, &record)
}

#[test]
fn a_docker_save_archive_imports_the_same_image_and_shares_its_layers() -> Result<()> {
    let home = tempfile::tempdir()?;
    let store = ImageStore::open(home.path())?;
    let layout = tempfile::tempdir()?;
    write_layout(layout.path(), &[bottom_layer()?, gzip(&top_layer()?)?], false)?;
    let from_oci = oci::import(&store, layout.path(), &name("from-oci")?, &|_| {})?;

    let other_home = tempfile::tempdir()?;
    let other = ImageStore::open(other_home.path())?;
    let archive = tempfile::NamedTempFile::new()?;
    let config = write_docker_save(archive.path(), &[bottom_layer()?, top_layer()?], None)?;
    let from_docker = oci::import(&other, archive.path(), &name("from-docker")?, &|_| {})?;
    check_image(&other, &from_docker)?;
    ensure!(from_docker.layers == from_oci.layers, "both forms key layers by diff_id");
    ensure!(from_docker.config == from_oci.config);
    ensure!(from_docker.source == strata_image_store::ImageSource::Oci { manifest: config });

    // Into the store that has the layers already: nothing extracted.
    let lines = Lines::default();
    oci::import(&store, archive.path(), &name("from-docker")?, &|l| lines.push(l))?;
    ensure!(lines.all().iter().all(|l| l.ends_with("already in the store")), "{:?}", lines.all());
    Ok(())
}

#[test]
fn a_reimport_reuses_the_layers_without_reading_them() -> Result<()> {
    let home = tempfile::tempdir()?;
    let store = ImageStore::open(home.path())?;
    let layout = tempfile::tempdir()?;
    let blobs = [bottom_layer()?, gzip(&top_layer()?)?];
    write_layout(layout.path(), &blobs, false)?;
    let first = oci::import(&store, layout.path(), &name("again")?, &|_| {})?;
    let inode = fs::metadata(layer_tree(&store, &first.layers[0])?)?.ino();
    // The layer blobs are not read again: garbage in their place changes nothing.
    for blob in &blobs {
        fs::write(layout.path().join("blobs/sha256").join(&sha256(blob)["sha256:".len()..]), b"garbage")?;
    }
    let lines = Lines::default();
    let second = oci::import(&store, layout.path(), &name("again")?, &|l| lines.push(l))?;
    ensure!(second.layers == first.layers);
    ensure!(fs::metadata(layer_tree(&store, &first.layers[0])?)?.ino() == inode, "the same layer directory");
    ensure!(lines.all().iter().all(|l| l.ends_with("already in the store")), "{:?}", lines.all());
    ensure!(store.layers()?.len() == 2);
    Ok(())
}

#[test]
fn a_repeated_layer_is_kept_once_at_its_topmost_place() -> Result<()> {
    let home = tempfile::tempdir()?;
    let store = ImageStore::open(home.path())?;
    let layout = tempfile::tempdir()?;
    let (bottom, top) = (bottom_layer()?, top_layer()?);
    write_layout(layout.path(), &[bottom.clone(), top.clone(), bottom.clone()], false)?;
    let record = oci::import(&store, layout.path(), &name("repeated")?, &|_| {})?;
    let key = |layer: &[u8]| LayerKey::of(&[b"oci-layer", sha256(layer).as_bytes()]);
    ensure!(record.layers == vec![key(&top), key(&bottom)], "{:?}", record.layers);
    Ok(())
}

#[test]
fn a_blob_that_is_not_its_digest_is_refused_and_leaves_nothing() -> Result<()> {
    let home = tempfile::tempdir()?;
    let store = ImageStore::open(home.path())?;
    let layout = tempfile::tempdir()?;
    let blobs = [bottom_layer()?, top_layer()?];
    write_layout(layout.path(), &blobs, false)?;
    let top = layout.path().join("blobs/sha256").join(&sha256(&blobs[1])["sha256:".len()..]);
    let mut tampered = blobs[1].clone();
    tampered[600] ^= 1;
    fs::write(&top, &tampered)?;
    let result = oci::import(&store, layout.path(), &name("bad")?, &|_| {});
    let Err(OciError::Digest { expected, found, .. }) = result else { bail!("{result:?}") };
    ensure!(expected == sha256(&blobs[1]) && found == sha256(&tampered));
    ensure!(store.list()?.is_empty(), "no image recorded");

    // A docker archive whose layer is not the config's diff_id.
    let archive = tempfile::NamedTempFile::new()?;
    let wrong = vec![sha256(&blobs[0]), sha256(b"something else")];
    write_docker_save(archive.path(), &[blobs[0].clone(), blobs[1].clone()], Some(wrong))?;
    let result = oci::import(&store, archive.path(), &name("bad")?, &|_| {});
    ensure!(matches!(result, Err(OciError::Digest { .. })), "{result:?}");
    ensure!(store.list()?.is_empty());
    let keys: Vec<_> = store.layers()?.into_iter().map(|l| l.key).collect();
    ensure!(!keys.contains(&LayerKey::of(&[b"oci-layer", sha256(b"something else").as_bytes()])));
    let leftovers = fs::read_dir(store.root().join("layers"))?
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with(".tmp-"))
        .count();
    ensure!(leftovers == 0, "no temporary layer left");
    Ok(())
}

/// A box for one hostile layer: `box/root` (where the layer goes), `box/sentinel`, and `outside/` (what a
/// symlink in the layer points at).
struct Jail {
    _dir: tempfile::TempDir,
    boxed: PathBuf,
    root: PathBuf,
    outside: PathBuf,
}

impl Jail {
    fn new() -> Result<Jail> {
        let dir = tempfile::tempdir()?;
        let boxed = dir.path().join("box");
        let root = boxed.join("root");
        let outside = dir.path().join("outside");
        fs::create_dir_all(&root)?;
        fs::create_dir_all(&outside)?;
        fs::write(boxed.join("sentinel"), b"s")?;
        Ok(Jail { boxed, root, outside, _dir: dir })
    }

    fn apply(&self, layer: &[u8]) -> Result<strata_image_store::layer_tar::LayerStats, OciError> {
        apply_layer(layer, &self.root, &ImportLimits::default())
    }

    /// Nothing beside the root, nothing in `outside/`.
    fn untouched(&self) -> Result<()> {
        let mut beside: Vec<_> =
            fs::read_dir(&self.boxed)?.map(|e| e.map(|e| e.file_name())).collect::<Result<_, _>>()?;
        beside.sort();
        ensure!(beside == vec![std::ffi::OsString::from("root"), "sentinel".into()], "{beside:?}");
        ensure!(fs::read(self.boxed.join("sentinel"))? == b"s");
        ensure!(fs::read_dir(&self.outside)?.next().is_none(), "something was made through a link");
        Ok(())
    }
}

fn refused(what: &str, layer: Layer) -> Result<()> {
    let jail = Jail::new()?;
    let result = jail.apply(&layer.finish()?);
    match &result {
        Err(OciError::Hostile { entry, reason }) => eprintln!("{what}: refused {entry:?}: {reason}"),
        other => bail!("{what}: {other:?}"),
    }
    jail.untouched().with_context(|| what.to_owned())
}

#[test]
fn hostile_entries_are_refused_and_reach_nothing_outside() -> Result<()> {
    let outside = Jail::new()?;
    let out = outside.outside.to_str().context("utf-8")?.to_owned();
    refused("a `..` path", Layer::new().file("../escape", b"x")?)?;
    refused("`..` after a leading /", Layer::new().file("/abs/../../x", b"x")?)?;
    refused("`..` in the middle", Layer::new().dir("a/")?.file("a/../../x", b"x")?)?;
    refused("a file through a symlink", Layer::new().symlink("link", "/etc")?.file("link/passwd", b"root::0:0")?)?;
    refused("a dir through a symlink", Layer::new().symlink("link", &out)?.dir("link/sub/")?)?;
    refused("a file through a relative symlink", Layer::new().dir("d/")?.symlink("d/up", "..")?.file("d/up/x", b"x")?)?;
    refused("a hard link to /etc/passwd", Layer::new().hard_link("passwd", "/etc/passwd")?)?;
    refused("a hard link up and out", Layer::new().hard_link("passwd", "../../../etc/passwd")?)?;
    refused("a hard link to a lower layer's file", Layer::new().hard_link("bin/tool2", "bin/tool")?)?;
    refused("a hard link to a directory", Layer::new().dir("d/")?.hard_link("d2", "d")?)?;
    refused("a hard link to a symlink", Layer::new().symlink("s", "/etc/passwd")?.hard_link("s2", "s")?)?;
    refused("a character device", Layer::new().device("dev/null", EntryType::Char, 1, 3)?)?;
    refused("a 0/0 device not named .wh.", Layer::new().device("fake-whiteout", EntryType::Char, 0, 0)?)?;
    refused("a block device", Layer::new().device("dev/sda", EntryType::Block, 8, 0)?)?;
    refused("a whiteout of `..`", Layer::new().dir("d/")?.file("d/.wh...", b"")?)?;
    refused("an aufs hard-link dir", Layer::new().file(".wh..wh.plnk/1234.5", b"")?)?;
    refused("an aufs name", Layer::new().file(".wh..wh.aufs", b"")?)?;
    refused("a whiteout that is a directory", Layer::new().dir(".wh.x/")?)?;
    refused("an owner outside the jail's mapping", Layer::new().file_as("f", b"x", 0o644, 70_000)?)?;
    refused("a replaced non-empty directory", Layer::new().dir("d/")?.file("d/f", b"x")?.file("d", b"file")?)?;
    refused("the root as a file", Layer::new().file("./", b"x")?)?;
    refused("an empty name", Layer::new().pax(&[("path", b"")])?.file("", b"x")?)?;
    refused("a NUL in a PAX path", Layer::new().pax(&[("path", b"a\0b")])?.file("x", b"x")?)?;
    refused("a 256-byte name", Layer::new().pax(&[("path", "n".repeat(256).as_bytes())])?.file("x", b"x")?)?;
    refused("a 4097-byte path", Layer::new().pax(&[("path", "d/".repeat(2049).as_bytes())])?.file("x", b"x")?)?;
    Ok(())
}

#[test]
fn overlay_attributes_from_the_tar_are_dropped_and_others_kept() -> Result<()> {
    let jail = Jail::new()?;
    let mut v2 = vec![0u8; 20];
    v2[..4].copy_from_slice(&0x0200_0001u32.to_le_bytes());
    v2[4] = 1 << 2; // CAP_DAC_READ_SEARCH permitted
    let layer = Layer::new()
        .pax(&[
            ("SCHILY.xattr.trusted.overlay.opaque", b"y"),
            ("SCHILY.xattr.user.overlay.opaque", b"y"),
            ("SCHILY.xattr.trusted.overlay.redirect", b"/elsewhere"),
            ("SCHILY.xattr.security.selinux", b"system_u:object_r:etc_t:s0"),
            ("SCHILY.xattr.user.kept", b"1"),
        ])?
        .dir("d/")?
        .pax(&[("SCHILY.xattr.security.capability", &v2)])?
        .file_as("ping", b"\x7fELF", 0o755, 0)?
        .finish()?;
    let stats = jail.apply(&layer)?;
    ensure!(stats.dropped_xattrs == 4, "{stats:?}");
    let d = jail.root.join("d");
    for name in ["trusted.overlay.opaque", "user.overlay.opaque", "trusted.overlay.redirect", "security.selinux"] {
        ensure!(xattr(&d, name).is_none(), "{name} was set");
    }
    ensure!(xattr(&d, "user.kept").as_deref() == Some(&b"1"[..]));
    if is_root() {
        ensure!(xattr(&jail.root.join("ping"), "security.capability").as_deref() == Some(&v2[..]));
    }
    jail.untouched()
}

#[test]
fn sizes_past_the_limits_are_refused_before_the_work() -> Result<()> {
    // An entry declaring 1 TiB (base-256 size field) with no data behind it.
    let jail = Jail::new()?;
    let mut header = Layer::header("big", EntryType::Regular, 0, 0o644, None);
    header.set_size(1 << 40);
    header.set_cksum();
    let mut bytes = header.as_bytes().to_vec();
    bytes.extend([0u8; 1024]);
    let result = jail.apply(&bytes);
    ensure!(matches!(result, Err(OciError::TooLarge(_))), "{result:?}");
    ensure!(!jail.root.join("big").exists(), "nothing written");
    jail.untouched()?;

    // A gzip bomb: past the layer limit while decompressing.
    let jail = Jail::new()?;
    let layer = gzip(&Layer::new().file("zeros", &vec![0u8; 4 << 20])?.finish()?)?;
    let limits = ImportLimits { max_layer_bytes: 1 << 20, ..ImportLimits::default() };
    let result = apply_layer(&layer[..], &jail.root, &limits);
    ensure!(matches!(result, Err(OciError::TooLarge(_))), "{result:?}");

    // Too many entries.
    let jail = Jail::new()?;
    let mut many = Layer::new();
    for i in 0..20 {
        many = many.file(&format!("f{i}"), b"")?;
    }
    let limits = ImportLimits { max_entries: 10, ..ImportLimits::default() };
    let result = apply_layer(&many.finish()?[..], &jail.root, &limits);
    ensure!(matches!(result, Err(OciError::TooLarge(_))), "{result:?}");

    // A layer blob the manifest declares past the limit is not read.
    let home = tempfile::tempdir()?;
    let store = ImageStore::open(home.path())?;
    let layout = tempfile::tempdir()?;
    write_layout(layout.path(), &[bottom_layer()?], false)?;
    let limits = ImportLimits { max_layer_bytes: 1000, ..ImportLimits::default() };
    let result = oci::import_with_limits(&store, layout.path(), &name("small")?, &limits, &|_| {});
    ensure!(matches!(result, Err(OciError::TooLarge(_))), "{result:?}");
    Ok(())
}

#[test]
fn replacing_entries_within_a_layer_and_a_truncated_tar() -> Result<()> {
    let jail = Jail::new()?;
    let layer = Layer::new()
        .file("x", b"first")?
        .file("x", b"second")?
        .symlink("s", "/a")?
        .dir("s/")?
        .dir("d/")?
        .file("d/in", b"1")?
        .dir("d/")?
        .file(".wh.gone", b"")?
        .file("gone", b"back")?
        .finish()?;
    let stats = jail.apply(&layer)?;
    ensure!(fs::read(jail.root.join("x"))? == b"second");
    ensure!(fs::symlink_metadata(jail.root.join("s"))?.is_dir(), "a directory replaces a symlink");
    ensure!(fs::read(jail.root.join("d/in"))? == b"1", "a directory merges into a directory");
    ensure!(fs::read(jail.root.join("gone"))? == b"back");
    ensure!(stats.diff_id == sha256(&layer) && stats.stream_bytes == layer.len() as u64);

    let jail = Jail::new()?;
    let cut = &layer[..layer.len() / 2 + 100];
    let result = jail.apply(cut);
    ensure!(matches!(result, Err(OciError::Format(_))), "{result:?}");
    let result = jail.apply(b"not a tar at all, but longer than one block? no.");
    ensure!(matches!(result, Err(OciError::Format(_))), "{result:?}");
    Ok(())
}
