//! Dockerfiles (`guest-images/store/src/dockerfile.rs`): the text `strata images build` parses, from whoever
//! wrote the build context, and the substitutions it makes in `ENV`, `WORKDIR`, `USER`, `COPY` and `ARG`.
//!
//! Oracles: [`dockerfile::parse`] never panics and bounds its work (text over `MAX_DOCKERFILE` is refused
//! before it is read); a file it accepts has a `FROM` and at most `MAX_INSTRUCTIONS` instructions, each with a
//! line inside the text; an error names a line inside the text. [`dockerfile::expand`] never panics, and its
//! result is bounded (a substitution cannot grow a value past the limit).

use std::collections::BTreeMap;

use strata_image_store::dockerfile::{self, DockerfileError, Instruction, MAX_DOCKERFILE, MAX_INSTRUCTIONS};

/// Parses `data` as a Dockerfile and expands every value it holds against variables of its own.
pub fn run(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let lines = text.lines().count().max(1);
    match dockerfile::parse(text) {
        Ok(file) => {
            assert!(text.len() <= MAX_DOCKERFILE);
            assert!(file.instructions.len() <= MAX_INSTRUCTIONS, "{} instructions", file.instructions.len());
            let mut vars: BTreeMap<String, String> = BTreeMap::new();
            for (name, default) in &file.pre_from_args {
                vars.insert(name.clone(), default.clone().unwrap_or_default());
            }
            let _ = dockerfile::expand(&file.from, &vars);
            for (line, instruction) in &file.instructions {
                assert!(*line >= 1 && *line <= lines, "line {line} of {lines}");
                let values: Vec<&str> = match instruction {
                    Instruction::Env(pairs) => pairs.iter().map(|(_, v)| v.as_str()).collect(),
                    Instruction::Workdir(v) | Instruction::User(v) => vec![v.as_str()],
                    Instruction::Copy { sources, dest, .. } => {
                        sources.iter().map(String::as_str).chain([dest.as_str()]).collect()
                    }
                    Instruction::Arg { default, .. } => default.iter().map(String::as_str).collect(),
                    _ => Vec::new(),
                };
                for value in values {
                    if let Ok(expanded) = dockerfile::expand(value, &vars) {
                        // Each `$` reference adds at most one value of at most the limit.
                        assert!(expanded.len() <= 64 * 1024 + value.len() * (64 * 1024 + 1), "{}", expanded.len());
                        vars.insert("LAST".into(), expanded.chars().take(1024).collect());
                    }
                }
                if let Instruction::Env(pairs) = instruction {
                    for (name, value) in pairs {
                        vars.insert(name.clone(), value.chars().take(1024).collect());
                    }
                }
            }
        }
        Err(DockerfileError::Syntax { line, .. } | DockerfileError::Unsupported { line, .. }) => {
            assert!(line >= 1 && line <= lines, "an error at line {line} of {lines}");
        }
        Err(DockerfileError::TooLarge(_)) => {}
    }
}
