//! Policy files (`policies/*.toml`): today their `[limits]` table, applied over the defaults of
//! `policies/default.toml`.

use std::path::{Path, PathBuf};

use serde::Deserialize;
use strata_core::{Limits, LimitsOverride};

/// A policy: what jobs may use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    /// Limits every job starts from.
    pub limits: Limits,
}

impl Default for Policy {
    /// `policies/default.toml`, compiled in.
    fn default() -> Self {
        Policy { limits: Limits::default() }
    }
}

/// A policy file that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    /// The file could not be read.
    #[error("cannot read policy {}: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The file is not a valid policy; the message names the line and the key.
    #[error("invalid policy {}: {message}", path.display())]
    Invalid {
        /// The file.
        path: PathBuf,
        /// The parser's message, with line, column and key.
        message: String,
    },
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PolicyFile {
    #[serde(default)]
    limits: LimitsOverride,
}

impl Policy {
    /// Reads a policy file. Keys it leaves out keep the defaults of `policies/default.toml`.
    pub fn from_file(path: &Path) -> Result<Policy, PolicyError> {
        let text =
            std::fs::read_to_string(path).map_err(|source| PolicyError::Read { path: path.to_owned(), source })?;
        Policy::from_toml(&text, path)
    }

    /// Parses a policy's text; `path` names it in errors.
    pub fn from_toml(text: &str, path: &Path) -> Result<Policy, PolicyError> {
        let file: PolicyFile = toml::from_str(text)
            .map_err(|err| PolicyError::Invalid { path: path.to_owned(), message: one_line(&err.to_string()) })?;
        Ok(Policy { limits: file.limits.apply(&Limits::default()) })
    }
}

/// toml's messages span several lines (the offending source line and a caret); keep them on one.
fn one_line(message: &str) -> String {
    message
        .lines()
        .map(str::trim)
        .filter(|line| !line.is_empty() && !line.chars().all(|c| c == '|' || c == '^' || c.is_whitespace()))
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partial_policy_keeps_other_defaults() {
        let policy = Policy::from_toml("[limits]\nwall = \"5s\"\n", Path::new("p.toml")).expect("valid");
        assert_eq!(policy.limits.wall, std::time::Duration::from_secs(5));
        assert_eq!(policy.limits.memory, Limits::default().memory);
    }

    #[test]
    fn unknown_key_is_named_with_its_line() {
        let err =
            Policy::from_toml("[limits]\nwall = \"5s\"\nmemroy = \"1GiB\"\n", Path::new("p.toml")).expect_err("typo");
        let message = err.to_string();
        assert!(message.contains("p.toml") && message.contains("memroy") && message.contains("line 3"), "{message}");
        assert!(!message.contains('\n'), "{message}");
    }

    #[test]
    fn unknown_table_is_refused() {
        assert!(Policy::from_toml("[limitz]\n", Path::new("p.toml")).is_err());
    }

    #[test]
    fn the_default_policy_file_is_a_valid_policy() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../policies/default.toml");
        assert_eq!(Policy::from_file(&path).expect("valid"), Policy::default());
    }
}
