//! Who a job runs as: a Linux account of the sandbox's own image, by name.
//!
//! The name is looked up *inside* the sandbox (its `/etc/passwd`, `/etc/group`) when the job starts, never on the
//! host: the account `user` of one image need not be the `user` of another, and no host account is ever named.
//! Only tiers whose guests have accounts honour it (the process tier; see [`UserName`] for the others).

use std::fmt;

use serde::{Deserialize, Serialize};

/// The longest account name (`useradd`'s limit).
pub const MAX_USER_NAME: usize = 32;

/// The name of an account in the sandbox's image, as `useradd` accepts one: 1 to [`MAX_USER_NAME`] characters,
/// a lowercase letter or `_` first, then lowercase letters, digits, `_` and `-`. `root` is the sandbox's root (the
/// jail's, never the host's).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct UserName(String);

/// A string that is not an account name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid user name {0:?}: 1 to 32 characters, a lowercase letter or '_' first, then [a-z0-9_-]")]
pub struct UserNameError(pub String);

impl UserName {
    /// Checks `name`.
    pub fn new(name: impl Into<String>) -> Result<UserName, UserNameError> {
        let name = name.into();
        let bytes = name.as_bytes();
        let first_ok = bytes.first().is_some_and(|b| b.is_ascii_lowercase() || *b == b'_');
        let rest_ok = bytes.iter().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'_' | b'-'));
        if !first_ok || !rest_ok || bytes.len() > MAX_USER_NAME {
            return Err(UserNameError(name));
        }
        Ok(UserName(name))
    }

    /// The sandbox's root.
    pub fn root() -> UserName {
        UserName("root".to_owned())
    }

    /// The name.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Whether it names the sandbox's root (what a job runs as when no user is given).
    pub fn is_root(&self) -> bool {
        self.0 == "root"
    }
}

impl TryFrom<String> for UserName {
    type Error = UserNameError;

    fn try_from(name: String) -> Result<UserName, UserNameError> {
        UserName::new(name)
    }
}

impl From<UserName> for String {
    fn from(name: UserName) -> String {
        name.0
    }
}

impl std::str::FromStr for UserName {
    type Err = UserNameError;

    fn from_str(name: &str) -> Result<UserName, UserNameError> {
        UserName::new(name)
    }
}

impl fmt::Display for UserName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_checked_as_useradd_checks_them() {
        for good in ["user", "root", "_apt", "www-data", "u1", "a".repeat(32).as_str()] {
            assert_eq!(UserName::new(good).map(|n| n.to_string()), Ok(good.to_owned()));
        }
        for bad in ["", "User", "1user", "-x", "a b", "../etc", "a:b", "a\0", &"a".repeat(33), "é"] {
            assert!(UserName::new(bad).is_err(), "{bad:?}");
        }
        assert!(UserName::root().is_root() && !UserName::new("user").expect("valid").is_root());
        let parsed: Result<UserName, _> = serde_json::from_str("\"Root\"");
        assert!(parsed.is_err(), "deserialising checks too");
    }
}
