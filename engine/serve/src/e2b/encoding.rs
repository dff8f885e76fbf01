//! gzip on envd's `/files`, as envd has it: an upload's `Content-Encoding: gzip` covers the whole request body
//! (the SDKs' `gzip=True` / `gzip: true` sends octet-stream uploads so), and a download is gzipped when the
//! client's `Accept-Encoding` prefers gzip (`files.read(…, gzip=True)`).
//!
//! A compressed upload is held to the same limit as any other body twice: its compressed bytes as they arrive, and
//! its decompressed bytes, of which the decoder produces at most one more than the limit before the upload is
//! refused (413), so a small body that inflates to gigabytes costs no more than a body at the limit. Concatenated
//! gzip members are one body, as Go's reader (envd's) takes them.

use std::io::{Read, Write};

use flate2::Compression;
use flate2::read::MultiGzDecoder;
use flate2::write::GzEncoder;
use thiserror::Error;

use super::{ConnectCode, E2bError};

/// How a body is encoded: the codings envd supports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ContentCoding {
    /// As it is.
    Identity,
    /// gzip.
    Gzip,
}

/// Why a coding header or a compressed body is refused.
#[derive(Debug, Error)]
pub enum EncodingError {
    /// `Content-Encoding` names a coding other than gzip and identity.
    #[error("unsupported Content-Encoding {0:?} (gzip and identity are)")]
    Unsupported(String),
    /// `Accept-Encoding` refuses identity and accepts nothing this server has.
    #[error("Accept-Encoding {0:?} accepts neither gzip nor identity")]
    NotAcceptable(String),
    /// The body decompresses to more than the limit.
    #[error("the request body decompresses to over {max} bytes, the most this server accepts")]
    TooLarge {
        /// The limit, in bytes.
        max: usize,
    },
    /// The body is not gzip.
    #[error("the request body is not valid gzip: {0}")]
    Corrupt(std::io::Error),
}

impl From<EncodingError> for E2bError {
    /// A body over the limit is 413 (`resource_exhausted`), as any body over it is; the rest are
    /// `invalid_argument` (400), as envd answers them.
    fn from(err: EncodingError) -> E2bError {
        match err {
            EncodingError::TooLarge { .. } => E2bError {
                status: axum::http::StatusCode::PAYLOAD_TOO_LARGE,
                code: ConnectCode::ResourceExhausted,
                message: err.to_string(),
            },
            _ => E2bError::invalid_argument(err.to_string()),
        }
    }
}

impl ContentCoding {
    /// The coding a request's `Content-Encoding` header (if any) names; `identity` is none.
    pub fn of_content_encoding(header: Option<&str>) -> Result<ContentCoding, EncodingError> {
        let Some(header) = header else { return Ok(ContentCoding::Identity) };
        let name = header.split(';').next().unwrap_or_default().trim();
        if name.is_empty() || name.eq_ignore_ascii_case("identity") {
            Ok(ContentCoding::Identity)
        } else if name.eq_ignore_ascii_case("gzip") {
            Ok(ContentCoding::Gzip)
        } else {
            Err(EncodingError::Unsupported(header.to_owned()))
        }
    }

    /// The coding a response takes for a request's `Accept-Encoding` header (if any): the client's most preferred
    /// of gzip and identity (by `q`, the first listed among equals; `*` stands for identity unless identity is
    /// refused). Identity is acceptable unless refused with `q=0`; a header that refuses it and accepts no gzip is
    /// refused.
    pub fn accepted(header: Option<&str>) -> Result<ContentCoding, EncodingError> {
        let Some(header) = header else { return Ok(ContentCoding::Identity) };
        let mut offered: Vec<(String, f64)> = header.split(',').filter_map(coding_with_quality).collect();
        let identity_refused = offered.iter().any(|(name, q)| name == "identity" && *q == 0.0);
        // Stable: among equal qualities the client's order stands.
        offered.sort_by(|a, b| b.1.total_cmp(&a.1));
        for (name, q) in &offered {
            if *q == 0.0 {
                continue;
            }
            match name.as_str() {
                "identity" => return Ok(ContentCoding::Identity),
                "gzip" => return Ok(ContentCoding::Gzip),
                "*" if identity_refused => return Ok(ContentCoding::Gzip),
                "*" => return Ok(ContentCoding::Identity),
                _ => {}
            }
        }
        if identity_refused {
            return Err(EncodingError::NotAcceptable(header.to_owned()));
        }
        Ok(ContentCoding::Identity)
    }
}

/// One `coding;q=0.5` of an `Accept-Encoding` list: its lowercased name and its quality (1 unless given; one that
/// does not parse as a number from 0 to 1 counts as 1, as envd takes it).
fn coding_with_quality(item: &str) -> Option<(String, f64)> {
    let mut parts = item.split(';');
    let name = parts.next()?.trim().to_ascii_lowercase();
    if name.is_empty() {
        return None;
    }
    let quality = parts
        .filter_map(|param| {
            let (key, value) = param.split_once('=')?;
            key.trim().eq_ignore_ascii_case("q").then(|| value.trim().parse::<f64>().ok()).flatten()
        })
        .find(|q| (0.0..=1.0).contains(q))
        .unwrap_or(1.0);
    Some((name, quality))
}

/// `compressed` (one or more gzip members) decompressed, if that is at most `max` bytes: the decoder stops at
/// `max + 1` bytes and the body is refused.
pub fn gunzip(compressed: &[u8], max: usize) -> Result<Vec<u8>, EncodingError> {
    let bound = u64::try_from(max).unwrap_or(u64::MAX).saturating_add(1);
    let mut plain = Vec::new();
    MultiGzDecoder::new(compressed).take(bound).read_to_end(&mut plain).map_err(EncodingError::Corrupt)?;
    if plain.len() > max {
        return Err(EncodingError::TooLarge { max });
    }
    Ok(plain)
}

/// `plain` as one gzip member.
pub fn gzip(plain: &[u8]) -> std::io::Result<Vec<u8>> {
    let mut encoder = GzEncoder::new(Vec::with_capacity(plain.len() / 2 + 64), Compression::default());
    encoder.write_all(plain)?;
    encoder.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_encoding_is_gzip_or_identity() {
        assert_eq!(ContentCoding::of_content_encoding(None).ok(), Some(ContentCoding::Identity));
        assert_eq!(ContentCoding::of_content_encoding(Some("identity")).ok(), Some(ContentCoding::Identity));
        assert_eq!(ContentCoding::of_content_encoding(Some("GZip")).ok(), Some(ContentCoding::Gzip));
        assert!(matches!(ContentCoding::of_content_encoding(Some("br")), Err(EncodingError::Unsupported(_))));
    }

    #[test]
    fn accept_encoding_picks_the_preferred_of_gzip_and_identity() {
        let accepted = |header| ContentCoding::accepted(header).ok();
        assert_eq!(accepted(None), Some(ContentCoding::Identity));
        assert_eq!(accepted(Some("gzip")), Some(ContentCoding::Gzip));
        assert_eq!(accepted(Some("gzip, deflate, br, zstd")), Some(ContentCoding::Gzip));
        assert_eq!(accepted(Some("br, GZIP;q=0.5")), Some(ContentCoding::Gzip));
        assert_eq!(accepted(Some("identity, gzip")), Some(ContentCoding::Identity));
        assert_eq!(accepted(Some("identity;q=0.5, gzip")), Some(ContentCoding::Gzip));
        assert_eq!(accepted(Some("gzip;q=0")), Some(ContentCoding::Identity));
        assert_eq!(accepted(Some("*")), Some(ContentCoding::Identity));
        assert_eq!(accepted(Some("*, identity;q=0")), Some(ContentCoding::Gzip));
        assert_eq!(accepted(Some("br")), Some(ContentCoding::Identity));
        assert_eq!(accepted(Some("gzip;q=nan")), Some(ContentCoding::Gzip));
        assert!(matches!(ContentCoding::accepted(Some("br, identity;q=0")), Err(EncodingError::NotAcceptable(_))));
    }

    #[test]
    fn gzip_round_trips_and_members_concatenate() {
        let text = b"hello, sandbox".repeat(100);
        assert_eq!(gunzip(&gzip(&text).expect("gzip"), text.len()).ok(), Some(text.clone()));
        let two = [gzip(b"one ").expect("gzip"), gzip(b"two").expect("gzip")].concat();
        assert_eq!(gunzip(&two, 7).ok(), Some(b"one two".to_vec()));
        assert!(matches!(gunzip(b"not gzip", 100), Err(EncodingError::Corrupt(_))));
        assert!(matches!(gunzip(&gzip(&text).expect("gzip")[..20], 10_000), Err(EncodingError::Corrupt(_))));
    }

    #[test]
    fn a_body_that_inflates_past_the_limit_is_refused() {
        let zeros = gzip(&vec![0; 8 << 20]).expect("gzip");
        assert!(zeros.len() < 64 << 10, "{}", zeros.len());
        assert!(matches!(gunzip(&zeros, 1 << 20), Err(EncodingError::TooLarge { max: 1_048_576 })));
        let exact = gzip(&[7; 4096]).expect("gzip");
        assert_eq!(gunzip(&exact, 4096).map(|p| p.len()).ok(), Some(4096));
        assert!(matches!(gunzip(&exact, 4095), Err(EncodingError::TooLarge { .. })));
    }
}
