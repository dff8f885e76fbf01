//! Signed `/files` URLs, as the SDKs' `download_url`/`upload_url` make them and envd checks them: a request that
//! carries no `X-Access-Token` may carry `signature` (and `signature_expiration`) in its query instead.
//!
//! The signature is `"v1_"` and the unpadded standard base64 of
//! `sha256("{path}:{operation}:{username}:{accessToken}")`, with `:{expiration}` appended when the URL expires.
//! `path` and `username` are the query's own values (the empty string when absent, which is how the SDKs sign for
//! the default user), `operation` is `read` for a `GET` and `write` for a `POST`, and `expiration` is a Unix time in
//! seconds: the URL is good up to and including that second. The comparison takes the same time wherever the
//! signatures differ.

use axum::extract::Query;
use axum::http::Uri;
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD_NO_PAD;
use serde::Deserialize;
use sha2::{Digest, Sha256};

use super::{ConnectCode, E2bError};

/// What a signed URL lets its holder do with the file it names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileOperation {
    /// `GET /files`: a download.
    Read,
    /// `POST /files`: an upload.
    Write,
}

impl FileOperation {
    /// Its name in the signed text.
    pub fn as_str(self) -> &'static str {
        match self {
            FileOperation::Read => "read",
            FileOperation::Write => "write",
        }
    }
}

/// Why a signed request is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SignatureError {
    /// No `signature` in the query.
    #[error("the request carries neither an X-Access-Token nor a signature")]
    Missing,
    /// `signature_expiration` is not a whole number of seconds.
    #[error("signature_expiration {0:?} is not a Unix time in seconds")]
    BadExpiration(String),
    /// The signature is not the one of this path, operation, user and expiration.
    #[error("invalid signature")]
    Invalid,
    /// The signature was good until `expiration`, which has passed.
    #[error("the signature expired at {expiration}")]
    Expired {
        /// Its `signature_expiration`.
        expiration: i64,
    },
}

impl From<SignatureError> for E2bError {
    /// A malformed expiration is `invalid_argument` (400); a missing, wrong or expired signature is
    /// `unauthenticated` (401), as envd answers.
    fn from(err: SignatureError) -> E2bError {
        match err {
            SignatureError::BadExpiration(_) => E2bError::invalid_argument(err.to_string()),
            _ => E2bError::new(ConnectCode::Unauthenticated, err.to_string()),
        }
    }
}

/// The query of a `/files` request, as far as its signature is concerned.
#[derive(Debug, Default, Deserialize)]
pub struct SignedQuery {
    /// The path, as given (the empty string when absent).
    #[serde(default)]
    pub path: String,
    /// The user, as given (the empty string when absent).
    #[serde(default)]
    pub username: String,
    /// `v1_…`, when the URL is signed.
    pub signature: Option<String>,
    /// The last second the signature is good for, when it expires (a string so that a bad one is reported, not
    /// taken for a missing one).
    pub signature_expiration: Option<String>,
}

/// The signature of `operation` on `path` as `user` for the sandbox whose access token is `token`, good until
/// `expiration` (forever when `None`).
pub fn file_signature(
    path: &str,
    operation: FileOperation,
    user: &str,
    token: &str,
    expiration: Option<i64>,
) -> String {
    let mut hasher = Sha256::new();
    hasher.update(format!("{path}:{}:{user}:{token}", operation.as_str()));
    if let Some(expiration) = expiration {
        hasher.update(format!(":{expiration}"));
    }
    format!("v1_{}", STANDARD_NO_PAD.encode(hasher.finalize()))
}

impl SignedQuery {
    /// The signature's fields of a request's query; a query that does not parse is `invalid_argument`.
    pub fn of_uri(uri: &Uri) -> Result<SignedQuery, E2bError> {
        Query::<SignedQuery>::try_from_uri(uri)
            .map(|Query(query)| query)
            .map_err(|e| E2bError::invalid_argument(e.body_text()))
    }

    /// Checks the query's signature of `operation` against the sandbox's access token `token` at Unix time `now`
    /// (seconds): a missing, malformed, wrong or expired signature is refused.
    pub fn check(&self, operation: FileOperation, token: &str, now: i64) -> Result<(), SignatureError> {
        let signature = self.signature.as_deref().ok_or(SignatureError::Missing)?;
        let expiration = match self.signature_expiration.as_deref() {
            None => None,
            Some(text) => Some(text.parse::<i64>().map_err(|_| SignatureError::BadExpiration(text.to_owned()))?),
        };
        let expected = file_signature(&self.path, operation, &self.username, token, expiration);
        if !same_secret(signature, &expected) {
            return Err(SignatureError::Invalid);
        }
        match expiration {
            Some(expiration) if expiration < now => Err(SignatureError::Expired { expiration }),
            _ => Ok(()),
        }
    }
}

/// Whether a token presented equals the secret, compared in time that does not depend on where they differ.
pub fn same_secret(presented: &str, secret: &str) -> bool {
    presented.len() == secret.len()
        && presented.bytes().zip(secret.bytes()).fold(0u8, |diff, (a, b)| diff | (a ^ b)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    const TOKEN: &str = "tok_0123456789abcdef";

    fn query(path: &str, username: &str, signature: &str, expiration: Option<&str>) -> SignedQuery {
        SignedQuery {
            path: path.to_owned(),
            username: username.to_owned(),
            signature: Some(signature.to_owned()),
            signature_expiration: expiration.map(str::to_owned),
        }
    }

    /// The expected strings are what the pinned Python SDK (`e2b==2.63.0`) computes:
    /// `e2b.sandbox.signature.get_signature(path, operation, user, "tok_0123456789abcdef", seconds)`, the expiring
    /// one with `time.time` fixed at 1767225600.5 and `seconds=0`. They hold `+` and `/`: the standard alphabet.
    #[test]
    fn signatures_match_the_python_sdk() {
        assert_eq!(
            file_signature("/tmp/z", FileOperation::Read, "", TOKEN, None),
            "v1_9ufVTLXDgscM0HQWC/fnbnFk828PcjLqzAPRtYJ+src"
        );
        assert_eq!(
            file_signature("rel/ä.txt", FileOperation::Read, "", TOKEN, None),
            "v1_qnmuyl1z3CDlYiW9B4retbqziucrMkYWdFyE6SfcfCQ"
        );
        assert_eq!(
            file_signature("/home/user/a b.txt", FileOperation::Write, "root", TOKEN, Some(1_767_225_600)),
            "v1_Z342p8xj9JWG+Q7ybvAJ/SQ8BNP9sZYod4o68f+eqac"
        );
    }

    #[test]
    fn a_good_signature_passes_until_its_expiration_and_no_later() {
        let now = 1_767_225_600;
        let signed = file_signature("/tmp/z", FileOperation::Write, "user", TOKEN, Some(now));
        let good = query("/tmp/z", "user", &signed, Some("1767225600"));
        assert_eq!(good.check(FileOperation::Write, TOKEN, now), Ok(()));
        assert_eq!(good.check(FileOperation::Write, TOKEN, now + 1), Err(SignatureError::Expired { expiration: now }));
        let forever = query("/tmp/z", "", "v1_9ufVTLXDgscM0HQWC/fnbnFk828PcjLqzAPRtYJ+src", None);
        assert_eq!(forever.check(FileOperation::Read, TOKEN, i64::MAX), Ok(()));
    }

    #[test]
    fn a_signature_is_refused_for_another_operation_path_user_token_or_expiration() {
        let now = 1_767_225_600;
        let signed = file_signature("/tmp/z", FileOperation::Read, "", TOKEN, Some(now + 60));
        let expiration = (now + 60).to_string();
        let good = query("/tmp/z", "", &signed, Some(&expiration));
        assert_eq!(good.check(FileOperation::Read, TOKEN, now), Ok(()));
        assert_eq!(good.check(FileOperation::Write, TOKEN, now), Err(SignatureError::Invalid));
        assert_eq!(good.check(FileOperation::Read, "tok_other", now), Err(SignatureError::Invalid));
        let later = (now + 3600).to_string();
        for bad in [
            query("/tmp/y", "", &signed, Some(&expiration)),
            query("/tmp/z", "root", &signed, Some(&expiration)),
            query("/tmp/z", "", &signed, Some(&later)),
            query("/tmp/z", "", &signed, None),
            query("/tmp/z", "", &signed.replace("v1_", "v2_"), Some(&expiration)),
            query("/tmp/z", "", "", Some(&expiration)),
        ] {
            assert_eq!(bad.check(FileOperation::Read, TOKEN, now), Err(SignatureError::Invalid), "{bad:?}");
        }
        let malformed = query("/tmp/z", "", &signed, Some("soon"));
        assert_eq!(
            malformed.check(FileOperation::Read, TOKEN, now),
            Err(SignatureError::BadExpiration("soon".to_owned()))
        );
        assert_eq!(SignedQuery::default().check(FileOperation::Read, TOKEN, now), Err(SignatureError::Missing));
    }
}
