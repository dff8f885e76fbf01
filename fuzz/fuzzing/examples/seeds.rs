//! Writes every target's seeds into `fuzz/corpus/<target>/` (see `strata_fuzzing::seeds`).

fn main() -> std::io::Result<()> {
    let corpus = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../corpus");
    for target in strata_fuzzing::TARGETS {
        let dir = corpus.join(target.name);
        std::fs::create_dir_all(&dir)?;
        for (name, bytes) in strata_fuzzing::seeds::of(target.name) {
            std::fs::write(dir.join(name), bytes)?;
        }
    }
    Ok(())
}
