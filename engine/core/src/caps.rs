//! What a job may touch: file grants, environment, secrets, network, host tools. (What it reads on stdin is the
//! job's input, not a capability: [`crate::ExecOptions`] carries it, and no snapshot records it.)
//!
//! Everything is denied unless granted here. Each tier translates a `Capabilities` into its own enforcement in
//! one place (docs/DESIGN.md §3).

use std::collections::BTreeSet;
use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::allow::{Allowlist, AllowlistError};
use crate::guest_path::GuestPath;

/// Whether a grant may be written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum GrantMode {
    /// Read only: no file or directory in the grant can be created, changed, renamed or removed.
    #[default]
    Ro,
    /// Read and write.
    Rw,
}

/// A host directory made visible to the guest at `guest`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Grant {
    /// Directory on the host.
    pub host: PathBuf,
    /// Absolute, normalised path where the guest sees it.
    pub guest: String,
    /// Read only or read-write.
    pub mode: GrantMode,
}

/// A capability that is malformed or contradicts another.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CapsError {
    /// `--dir` text that is not `HOST:GUEST[:ro|:rw]`.
    #[error("invalid grant {spec:?}: {reason}")]
    GrantSpec {
        /// The text as given.
        spec: String,
        /// What was wrong.
        reason: String,
    },
    /// A guest path that is relative, contains `..` or is otherwise unusable.
    #[error("invalid guest path {path:?} for grant of {host}: {reason}")]
    GuestPath {
        /// The guest path.
        path: String,
        /// The host side of the grant.
        host: PathBuf,
        /// What was wrong.
        reason: &'static str,
    },
    /// Two grants at the same guest path.
    #[error("two grants at guest path {0}")]
    DuplicateGuestPath(String),
    /// The host side of a grant is missing.
    #[error("grant host path {0} does not exist")]
    GrantNotFound(PathBuf),
    /// The host side of a grant is not a directory.
    #[error("grant host path {0} is not a directory")]
    GrantNotDirectory(PathBuf),
    /// An egress secret that is malformed or not covered by the network allowlist.
    #[error(transparent)]
    EgressSecret(#[from] crate::egress_secret::EgressSecretError),
    /// `K=V` text without `=`, or an unusable name.
    #[error("invalid environment variable {spec:?}: {reason}")]
    EnvSpec {
        /// The text as given.
        spec: String,
        /// What was wrong.
        reason: &'static str,
    },
}

impl Grant {
    /// A grant of `host` at `guest`; the guest path is checked and normalised (`/data/` → `/data`).
    pub fn new(host: impl Into<PathBuf>, guest: &str, mode: GrantMode) -> Result<Grant, CapsError> {
        let host = host.into();
        let guest = normalise_guest_path(guest, &host)?;
        Ok(Grant { host, guest, mode })
    }

    /// Checks that the host side exists and is a directory.
    pub fn check_host(&self) -> Result<(), CapsError> {
        match std::fs::metadata(&self.host) {
            Ok(meta) if meta.is_dir() => Ok(()),
            Ok(_) => Err(CapsError::GrantNotDirectory(self.host.clone())),
            Err(_) => Err(CapsError::GrantNotFound(self.host.clone())),
        }
    }
}

/// A grant's guest path, by the rules of every guest path ([`GuestPath`]).
fn normalise_guest_path(path: &str, host: &Path) -> Result<String, CapsError> {
    match GuestPath::new(path) {
        Ok(path) => Ok(path.as_str().to_owned()),
        Err(err) => Err(CapsError::GuestPath { path: err.path, host: host.to_owned(), reason: err.reason }),
    }
}

/// Parses `HOST:GUEST[:ro|:rw]` (the CLI's `--dir`). The mode defaults to `ro` when omitted: nothing is writable
/// unless it says so. The host path may itself contain `:`; the guest path and mode are taken from the right.
impl FromStr for Grant {
    type Err = CapsError;

    fn from_str(spec: &str) -> Result<Self, Self::Err> {
        let bad = |reason: &str| CapsError::GrantSpec { spec: spec.to_owned(), reason: reason.to_owned() };
        let (rest, mode) = match spec.rsplit_once(':') {
            Some((rest, "ro")) => (rest, GrantMode::Ro),
            Some((rest, "rw")) => (rest, GrantMode::Rw),
            _ => (spec, GrantMode::Ro),
        };
        let (host, guest) = rest.rsplit_once(':').ok_or_else(|| bad("expected HOST:GUEST[:ro|:rw]"))?;
        if host.is_empty() {
            return Err(bad("empty host path"));
        }
        if guest.is_empty() {
            return Err(bad("empty guest path"));
        }
        Grant::new(host, guest, mode)
    }
}

impl fmt::Display for Grant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mode = match self.mode {
            GrantMode::Ro => "ro",
            GrantMode::Rw => "rw",
        };
        write!(f, "{}:{}:{mode}", self.host.display(), self.guest)
    }
}

/// Network access.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Net {
    /// No network at all (the default).
    #[default]
    Deny,
    /// Egress to these `host[:port]` patterns only (`*.example.com` allowed), parsed once where they entered.
    Allow(Allowlist),
}

impl Net {
    /// Egress to these `HOST[:PORT]` specs, parsed here (the first malformed one is the error); no specs at all is
    /// [`Net::Deny`].
    pub fn allow<I, S>(specs: I) -> Result<Net, AllowlistError>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let list = Allowlist::parse(specs)?;
        Ok(if list.is_empty() { Net::Deny } else { Net::Allow(list) })
    }

    /// The allowlist, if any egress is allowed.
    pub fn allowlist(&self) -> Option<&Allowlist> {
        match self {
            Net::Deny => None,
            Net::Allow(list) => Some(list),
        }
    }
}

/// An environment variable `NAME=value`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EnvVar {
    /// Name; never empty, never contains `=` or NUL.
    pub name: String,
    /// Value; never contains NUL.
    pub value: String,
}

impl FromStr for EnvVar {
    type Err = CapsError;

    fn from_str(spec: &str) -> Result<Self, Self::Err> {
        let bad = |reason| CapsError::EnvSpec { spec: spec.to_owned(), reason };
        let (name, value) = spec.split_once('=').ok_or_else(|| bad("expected NAME=VALUE"))?;
        if name.is_empty() {
            return Err(bad("empty name"));
        }
        if name.contains('\0') || value.contains('\0') {
            return Err(bad("contains a NUL byte"));
        }
        Ok(EnvVar { name: name.to_owned(), value: value.to_owned() })
    }
}

/// Everything a job may touch. `Capabilities::default()` grants nothing.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Capabilities {
    /// Host directories visible to the guest.
    pub grants: Vec<Grant>,
    /// Environment variables.
    pub env: Vec<EnvVar>,
    /// Environment variables whose values are redacted from captured output.
    pub secrets: Vec<EnvVar>,
    /// Network egress.
    pub net: Net,
    /// Secrets the egress proxy puts into plain-HTTP request headers toward the hosts each is bound to; the guest
    /// sees a per-sandbox placeholder, never the value ([`crate::egress_secret`]). Not serialised when empty.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub egress_secrets: Vec<crate::EgressSecret>,
    /// Host functions the guest may call, by name.
    pub tools: Vec<String>,
    /// The account of the sandbox's image its jobs run as, unless a job names another
    /// ([`crate::ExecOptions::user`]), and who owns what the file calls create; `None` (or `root`): the
    /// sandbox's root. Only the process tier has accounts; the others refuse any but root
    /// ([`Capabilities::refuse_user`]).
    pub user: Option<crate::UserName>,
    /// The image the sandbox's filesystem starts from ([`crate::image`]); `None`: the tier's default. Only the
    /// process tier has images today; the others refuse any ([`Capabilities::refuse_image`]). Not serialised
    /// when `None`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<crate::ImageName>,
}

impl Capabilities {
    /// Checks what can be checked without a tier: guest paths are unique, every grant's host directory exists,
    /// and egress secrets are well formed, uniquely named and bound only to hosts the network allowlist covers.
    pub fn validate(&self) -> Result<(), CapsError> {
        crate::egress_secret::check_all(self)?;
        let mut seen = BTreeSet::new();
        for grant in &self.grants {
            if !seen.insert(grant.guest.as_str()) {
                return Err(CapsError::DuplicateGuestPath(grant.guest.clone()));
            }
            grant.check_host()?;
        }
        Ok(())
    }

    /// Refuses [`Capabilities::image`] on a tier that has no root filesystem to start from one.
    pub fn refuse_image(&self, tier: crate::TierKind) -> Result<(), crate::TierError> {
        match &self.image {
            Some(image) => Err(crate::TierError::Unsupported {
                tier,
                what: format!("starting from the image {image:?} (images are for the process tier)"),
            }),
            None => Ok(()),
        }
    }

    /// Refuses [`Capabilities::user`] (other than root) on a tier whose guests have no accounts.
    pub fn refuse_user(&self, tier: crate::TierKind) -> Result<(), crate::TierError> {
        refuse_user(self.user.as_ref(), tier)
    }

    /// Refuses [`Capabilities::egress_secrets`] on a tier whose network does not go through the egress proxy's
    /// HTTP forwarding.
    pub fn refuse_egress_secrets(&self, tier: crate::TierKind) -> Result<(), crate::TierError> {
        if self.egress_secrets.is_empty() {
            return Ok(());
        }
        let names: Vec<&str> = self.egress_secrets.iter().map(|s| s.name.as_str()).collect();
        Err(crate::TierError::Unsupported {
            tier,
            what: format!("egress secrets ({}): only the process tier's egress proxy puts them in", names.join(", ")),
        })
    }

    /// Environment the guest sees: `env` then `secrets` (a later definition of a name wins).
    pub fn guest_env(&self) -> impl Iterator<Item = &EnvVar> {
        self.env.iter().chain(&self.secrets)
    }

    /// Secrets to redact from output, each replaced by `[REDACTED:NAME]` (empty values are skipped: they would
    /// match everywhere). Egress secrets are among them: the guest never has their values, but an origin could
    /// echo one back.
    pub fn secret_values(&self) -> Vec<crate::redact::Secret> {
        let egress = self.egress_secrets.iter().map(|s| (&s.name, &s.value));
        self.secrets
            .iter()
            .map(|s| (&s.name, &s.value))
            .chain(egress)
            .filter(|(_, value)| !value.is_empty())
            .map(|(name, value)| crate::redact::Secret { name: name.clone(), value: value.clone().into_bytes() })
            .collect()
    }
}

/// Refuses running as `user` (other than root) on `tier`, which has no accounts.
pub(crate) fn refuse_user(user: Option<&crate::UserName>, tier: crate::TierKind) -> Result<(), crate::TierError> {
    match user {
        Some(user) if !user.is_root() => Err(crate::TierError::Unsupported {
            tier,
            what: format!("running as the user {user:?} (only the process tier's sandboxes have accounts)"),
        }),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grant_spec_parses_host_guest_and_mode() {
        let g: Grant = "/srv/data:/data:ro".parse().expect("parses");
        assert_eq!((g.host.as_path(), g.guest.as_str(), g.mode), (Path::new("/srv/data"), "/data", GrantMode::Ro));
        let g: Grant = "./out:/out/".parse().expect("parses");
        assert_eq!((g.guest.as_str(), g.mode), ("/out", GrantMode::Ro));
        let g: Grant = "/a:b:/x:rw".parse().expect("colon in host path");
        assert_eq!(g.host, Path::new("/a:b"));
    }

    #[test]
    fn grant_with_dotdot_is_refused() {
        let err = "/tmp:/data/../etc".parse::<Grant>().expect_err("dotdot");
        assert!(err.to_string().contains(".."), "{err}");
    }

    #[test]
    fn grant_with_relative_guest_path_is_refused() {
        assert!(matches!("/tmp:data".parse::<Grant>(), Err(CapsError::GuestPath { .. })));
        assert!(matches!("/tmp".parse::<Grant>(), Err(CapsError::GrantSpec { .. })));
        assert!(matches!(":/x".parse::<Grant>(), Err(CapsError::GrantSpec { .. })));
    }

    #[test]
    fn missing_grant_host_is_reported_by_path() {
        let caps = Capabilities {
            grants: vec![Grant::new("/nonexistent/strata", "/x", GrantMode::Ro).expect("grant")],
            ..Capabilities::default()
        };
        assert_eq!(caps.validate(), Err(CapsError::GrantNotFound("/nonexistent/strata".into())));
    }

    #[test]
    fn duplicate_guest_paths_are_refused() {
        let g = Grant::new("/tmp", "/x", GrantMode::Ro).expect("grant");
        let caps = Capabilities { grants: vec![g.clone(), g], ..Capabilities::default() };
        assert_eq!(caps.validate(), Err(CapsError::DuplicateGuestPath("/x".into())));
    }

    #[test]
    fn env_spec_needs_a_name_and_equals() {
        assert_eq!("A=b=c".parse::<EnvVar>().map(|e| (e.name, e.value)), Ok(("A".into(), "b=c".into())));
        assert!("NOEQUALS".parse::<EnvVar>().is_err());
        assert!("=v".parse::<EnvVar>().is_err());
    }
}
