//! Seeds of `oci_layer`: real layer tars (as `docker save` and OCI layouts hold them, plain and gzipped) and one
//! per kind of hostile entry, each refused when it comes.

use tar::{EntryType, Header};

use crate::seed::{Seed, named};

/// Entries written as raw header fields (the `tar` crate's setters refuse the hostile names).
struct Layer(tar::Builder<Vec<u8>>);

impl Layer {
    fn new() -> Layer {
        Layer(tar::Builder::new(Vec::new()))
    }

    fn entry(mut self, name: &str, kind: EntryType, data: &[u8], mode: u32, link: Option<&str>) -> Layer {
        let mut header = Header::new_ustar();
        let old = header.as_old_mut();
        old.name[..name.len()].copy_from_slice(name.as_bytes());
        if let Some(link) = link {
            old.linkname[..link.len()].copy_from_slice(link.as_bytes());
        }
        header.set_entry_type(kind);
        header.set_size(data.len() as u64);
        header.set_mode(mode);
        header.set_uid(if mode & 0o4000 != 0 { 1000 } else { 0 });
        header.set_gid(0);
        header.set_mtime(1_700_000_000);
        header.set_cksum();
        self.0.append(&header, data).expect("a seed entry");
        self
    }

    fn dir(self, name: &str) -> Layer {
        self.entry(name, EntryType::Directory, b"", 0o755, None)
    }

    fn file(self, name: &str, data: &[u8]) -> Layer {
        self.entry(name, EntryType::Regular, data, 0o644, None)
    }

    fn pax(mut self, records: &[(&str, &[u8])]) -> Layer {
        self.0.append_pax_extensions(records.iter().map(|(k, v)| (*k, *v))).expect("pax");
        self
    }

    fn device(self, name: &str, kind: EntryType, major: u32, minor: u32) -> Layer {
        let mut layer = self.entry(name, kind, b"", 0o666, None);
        // Rewrite the last header with the device numbers.
        let bytes = layer.0.get_mut();
        let at = bytes.len() - 512;
        let mut header = Header::from_byte_slice(&bytes[at..]).clone();
        header.set_device_major(major).expect("major");
        header.set_device_minor(minor).expect("minor");
        header.set_cksum();
        bytes[at..].copy_from_slice(header.as_bytes());
        layer
    }

    fn finish(self) -> Vec<u8> {
        self.0.into_inner().expect("a seed tar")
    }
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    use std::io::Write;
    let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    encoder.write_all(bytes).expect("gzip");
    encoder.finish().expect("gzip")
}

pub(crate) fn oci_layer() -> Vec<Seed> {
    let mut capability = vec![0u8; 20];
    capability[..4].copy_from_slice(&0x0200_0001u32.to_le_bytes());
    capability[4] = 1 << 5;
    let layer = Layer::new()
        .dir("./")
        .dir("./etc/")
        .pax(&[("SCHILY.xattr.user.origin", b"seed\n"), ("mtime", b"1700000000.5")])
        .file("./etc/os-release", b"ID=seed\n")
        .dir("./usr/bin/")
        .entry("./usr/bin/tool", EntryType::Regular, b"\x7fELF tool", 0o4755, None)
        .entry("./usr/bin/tool2", EntryType::Link, b"", 0o755, Some("./usr/bin/tool"))
        .entry("./usr/bin/sh", EntryType::Symlink, b"", 0o777, Some("/bin/busybox"))
        .pax(&[("SCHILY.xattr.security.capability", &capability)])
        .file("./usr/bin/ping", b"\x7fELF ping")
        .entry("./run/pipe", EntryType::Fifo, b"", 0o640, None)
        .pax(&[(
            "path",
            "./usr/share/a-path-longer-than-the-hundred-bytes-a-ustar-name-field-holds/so-it-is-a-pax-record"
                .as_bytes(),
        )])
        .file("placeholder", b"long\n")
        .finish();
    let upper = Layer::new()
        .dir("./etc/")
        .file("./etc/.wh.os-release", b"")
        .dir("./usr/bin/")
        .file("./usr/bin/.wh..wh..opq", b"")
        .file("./usr/bin/new", b"replaced the directory\n")
        .file("./usr/bin/new", b"and this one the file\n")
        .finish();
    named(vec![
        ("layer", layer.clone()),
        ("layer-gzip", gzip(&layer)),
        ("whiteouts", upper),
        ("escape", Layer::new().file("../escape", b"x").file("/abs/../../x", b"x").finish()),
        (
            "symlink-parent",
            Layer::new()
                .entry("link", EntryType::Symlink, b"", 0o777, Some("../../outside"))
                .file("link/planted", b"x")
                .finish(),
        ),
        (
            "hardlinks",
            Layer::new()
                .file("mine", b"x")
                .entry("ok", EntryType::Link, b"", 0o644, Some("mine"))
                .entry("passwd", EntryType::Link, b"", 0o644, Some("/etc/passwd"))
                .finish(),
        ),
        (
            "devices",
            Layer::new().device("dev/null", EntryType::Char, 1, 3).device("dev/sda", EntryType::Block, 8, 0).finish(),
        ),
        (
            "overlay-xattrs",
            Layer::new()
                .pax(&[("SCHILY.xattr.trusted.overlay.opaque", b"y"), ("SCHILY.xattr.user.overlay.redirect", b"/x")])
                .dir("d/")
                .finish(),
        ),
    ])
}
