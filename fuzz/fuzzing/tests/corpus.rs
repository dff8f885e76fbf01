//! Every target's committed corpus (`fuzz/corpus/<target>/`: seeds and the inputs of crashes found and fixed)
//! replayed through its entry point: the regressions run on every `cargo test`, without libFuzzer.

use std::fs;
use std::path::{Path, PathBuf};

use strata_fuzzing::TARGETS;

fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| entry.expect("a directory entry").path())
        .collect();
    files.sort();
    files
}

#[test]
fn every_corpus_input_replays_without_failing_an_oracle() {
    for target in TARGETS {
        let inputs = files(&fuzz_dir().join("corpus").join(target.name));
        assert!(!inputs.is_empty(), "{} has no corpus", target.name);
        for input in inputs {
            let data = fs::read(&input).expect("a corpus file");
            let result = std::panic::catch_unwind(|| (target.run)(&data));
            assert!(result.is_ok(), "{} fails on {}", target.name, input.display());
        }
    }
}

#[test]
fn the_committed_seeds_are_the_generated_ones() {
    for target in TARGETS {
        for (name, bytes) in strata_fuzzing::seeds::of(target.name) {
            let path = fuzz_dir().join("corpus").join(target.name).join(&name);
            let committed = fs::read(&path).unwrap_or_default();
            assert!(
                committed == bytes,
                "{} differs from its seed: cargo run -p strata-fuzzing --example seeds",
                path.display()
            );
        }
    }
}

#[test]
fn every_target_has_its_libfuzzer_binary_and_no_corpus_lacks_a_target() {
    let manifest = fs::read_to_string(fuzz_dir().join("Cargo.toml")).expect("fuzz/Cargo.toml");
    for target in TARGETS {
        let source = fuzz_dir().join("fuzz_targets").join(format!("{}.rs", target.name));
        let text = fs::read_to_string(&source).unwrap_or_else(|e| panic!("{}: {e}", source.display()));
        assert!(text.contains(&format!("targets::{}::run", target.name)), "{} calls another target", source.display());
        assert!(
            manifest.contains(&format!("name = \"{}\"", target.name)),
            "fuzz/Cargo.toml lacks a [[bin]] {}",
            target.name
        );
    }
    for dir in files(&fuzz_dir().join("corpus")) {
        let name = dir.file_name().and_then(|n| n.to_str()).unwrap_or_default().to_owned();
        assert!(strata_fuzzing::target(&name).is_some(), "corpus folder {name} has no target");
    }
}
