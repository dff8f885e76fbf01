//! Embeds the console (`ui/dist/`, built by `npm run build` in `ui/`) into the server: each file becomes an entry
//! of `console_assets.rs` in `OUT_DIR`. Without a built console the list is empty and the server says how to
//! build it at `/ui/`.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

fn files(dir: &Path, base: &Path, out: &mut Vec<(String, PathBuf)>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    let mut entries: Vec<_> = entries.flatten().collect();
    entries.sort_by_key(|e| e.file_name());
    for entry in entries {
        let path = entry.path();
        let Ok(kind) = entry.file_type() else { continue };
        if kind.is_dir() {
            files(&path, base, out);
        } else if kind.is_file()
            && let Ok(relative) = path.strip_prefix(base)
            && let Some(name) = relative.to_str()
        {
            out.push((name.to_owned(), path.clone()));
        }
    }
}

fn main() {
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let dist = manifest.join("ui").join("dist");
    println!("cargo:rerun-if-changed={}", dist.display());
    let mut found = Vec::new();
    files(&dist, &dist, &mut found);
    let mut code =
        String::from("/// The console's files: path below `/ui/`, bytes.\npub static ASSETS: &[(&str, &[u8])] = &[\n");
    for (name, path) in &found {
        let _ = writeln!(code, "    ({name:?}, include_bytes!({:?})),", path.display().to_string());
    }
    code.push_str("];\n");
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR")).join("console_assets.rs");
    std::fs::write(out, code).expect("write console_assets.rs");
}
