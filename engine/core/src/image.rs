//! Which image a sandbox's filesystem starts from, by name.
//!
//! An image is a root filesystem the host keeps under `$STRATA_HOME` (built from a Dockerfile or imported from an
//! OCI image; see the `strata-image-store` crate): a stack of read-only layers plus its defaults (environment,
//! working directory, account, start command). [`crate::Capabilities::image`] names one; `None` is the tier's
//! own default (the Debian image on the process tier). Only tiers with a root filesystem honour it; the wasm tier
//! refuses any.

use std::fmt;

use serde::{Deserialize, Serialize};

/// The longest image name.
pub const MAX_IMAGE_NAME: usize = 128;

/// An image's name: 1 to [`MAX_IMAGE_NAME`] characters, an ASCII letter or digit first, then letters, digits,
/// `.`, `_` and `-` (no `/`, no `..`: the name is also a file name in the host's image store).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct ImageName(String);

/// A string that is not an image name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid image name {0:?}: 1 to 128 characters, a letter or digit first, then [A-Za-z0-9._-]")]
pub struct ImageNameError(pub String);

impl ImageName {
    /// Checks `name`.
    pub fn new(name: impl Into<String>) -> Result<ImageName, ImageNameError> {
        let name = name.into();
        let bytes = name.as_bytes();
        let first_ok = bytes.first().is_some_and(u8::is_ascii_alphanumeric);
        let rest_ok = bytes.iter().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
        if !first_ok || !rest_ok || bytes.len() > MAX_IMAGE_NAME {
            return Err(ImageNameError(name));
        }
        Ok(ImageName(name))
    }

    /// The name.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl TryFrom<String> for ImageName {
    type Error = ImageNameError;

    fn try_from(name: String) -> Result<ImageName, ImageNameError> {
        ImageName::new(name)
    }
}

impl From<ImageName> for String {
    fn from(name: ImageName) -> String {
        name.0
    }
}

impl std::str::FromStr for ImageName {
    type Err = ImageNameError;

    fn from_str(name: &str) -> Result<ImageName, ImageNameError> {
        ImageName::new(name)
    }
}

impl fmt::Display for ImageName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_plain_file_names() {
        for good in ["py", "my-image", "v1.2_x", "A9"] {
            assert!(ImageName::new(good).is_ok(), "{good}");
        }
        for bad in ["", ".hidden", "-x", "a/b", "..", "a b", "x:latest", &"a".repeat(129)] {
            assert!(ImageName::new(bad).is_err(), "{bad}");
        }
        assert!(serde_json::from_str::<ImageName>("\"../etc\"").is_err());
    }
}
