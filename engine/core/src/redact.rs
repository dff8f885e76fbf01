//! Streaming redaction of secret values from guest output.

/// A secret to redact: its name, shown in the marker that replaces it (`[REDACTED:NAME]`), and its value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Secret {
    /// The name (the environment variable's).
    pub name: String,
    /// The value.
    pub value: Vec<u8>,
}

/// What a secret named `name` is replaced with: `[REDACTED:name]`.
pub fn marker(name: &str) -> Vec<u8> {
    format!("[REDACTED:{name}]").into_bytes()
}

/// Replaces every occurrence of any secret in a byte stream with its [`marker`], also when an occurrence is split
/// across writes. It holds back at most `longest secret - 1` bytes until the next write or [`finish`].
///
/// [`finish`]: Redactor::finish
#[derive(Debug, Clone, Default)]
pub struct Redactor {
    /// (value, marker), longest value first.
    secrets: Vec<(Vec<u8>, Vec<u8>)>,
    holdback: usize,
    pending: Vec<u8>,
}

impl Redactor {
    /// A redactor for these secrets; empty secrets are ignored.
    pub fn new(secrets: Vec<Secret>) -> Redactor {
        let mut secrets: Vec<(Vec<u8>, Vec<u8>)> =
            secrets.into_iter().filter(|s| !s.value.is_empty()).map(|s| (s.value, marker(&s.name))).collect();
        // Longest first, so a secret that contains another is replaced whole.
        secrets.sort_by_key(|(value, _)| std::cmp::Reverse(value.len()));
        let holdback = secrets.first().map_or(0, |(value, _)| value.len() - 1);
        Redactor { secrets, holdback, pending: Vec::new() }
    }

    /// True when there is nothing to redact, so callers may skip the copy.
    pub fn is_empty(&self) -> bool {
        self.secrets.is_empty()
    }

    /// Feeds `input` and returns the bytes that are now safe to emit.
    pub fn push(&mut self, input: &[u8]) -> Vec<u8> {
        if self.secrets.is_empty() {
            return input.to_vec();
        }
        self.pending.extend_from_slice(input);
        let mut out = Vec::with_capacity(self.pending.len());
        let mut i = 0;
        while i < self.pending.len() {
            let rest = &self.pending[i..];
            if let Some((value, marker)) = self.secrets.iter().find(|(value, _)| rest.starts_with(value)) {
                out.extend_from_slice(marker);
                i += value.len();
                continue;
            }
            // Keep a tail that may be the start of a secret completed by the next write.
            if rest.len() <= self.holdback && self.secrets.iter().any(|(value, _)| value.starts_with(rest)) {
                break;
            }
            out.push(rest[0]);
            i += 1;
        }
        self.pending.drain(..i);
        out
    }

    /// Returns the bytes still held back; the stream has ended.
    pub fn finish(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.pending)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(secrets: &[&str], chunks: &[&str]) -> String {
        let named = secrets.iter().enumerate();
        let mut r =
            Redactor::new(named.map(|(i, s)| Secret { name: format!("S{i}"), value: s.as_bytes().to_vec() }).collect());
        let mut out = Vec::new();
        for chunk in chunks {
            out.extend(r.push(chunk.as_bytes()));
        }
        out.extend(r.finish());
        String::from_utf8(out).expect("utf8")
    }

    #[test]
    fn secret_in_one_write_is_redacted() {
        assert_eq!(run(&["hunter2"], &["pw=hunter2!\n"]), "pw=[REDACTED:S0]!\n");
    }

    #[test]
    fn secret_split_across_writes_is_redacted() {
        assert_eq!(run(&["hunter2"], &["pw=hun", "te", "r2 ok"]), "pw=[REDACTED:S0] ok");
    }

    #[test]
    fn partial_secret_at_end_of_stream_is_kept() {
        assert_eq!(run(&["hunter2"], &["hunt"]), "hunt");
    }

    #[test]
    fn longest_secret_wins_and_empty_secrets_are_ignored() {
        assert_eq!(run(&["abc", "abcdef", ""], &["xabcdefx abc"]), "x[REDACTED:S1]x [REDACTED:S0]");
        assert_eq!(run(&[], &["plain"]), "plain");
    }
}
