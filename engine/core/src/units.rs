//! Sizes and durations as users write them: `256MiB`, `1.5GiB`, `500ms`, `2s`.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A size in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct ByteSize(pub u64);

/// A size or duration that could not be parsed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UnitsError {
    /// The text is not a number followed by a known unit.
    #[error("invalid {what} {input:?}: {reason}")]
    Invalid {
        /// "size" or "duration".
        what: &'static str,
        /// The text as given.
        input: String,
        /// What was wrong with it.
        reason: String,
    },
}

impl UnitsError {
    fn invalid(what: &'static str, input: &str, reason: impl Into<String>) -> Self {
        UnitsError::Invalid { what, input: input.to_owned(), reason: reason.into() }
    }
}

/// Splits `"1.5GiB"` into `("1.5", "GiB")`.
fn split_number(input: &str) -> (&str, &str) {
    let end = input.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(input.len());
    (&input[..end], input[end..].trim_start())
}

/// Multiplies a decimal number written as text by an integer scale without going through floating point for
/// whole numbers, so `18446744073709551615` stays exact and `1.5GiB` is still accepted.
fn scale(what: &'static str, input: &str, number: &str, unit: u128) -> Result<u128, UnitsError> {
    let (whole, frac) = match number.split_once('.') {
        Some((w, f)) => (w, f),
        None => (number, ""),
    };
    if whole.is_empty() && frac.is_empty() {
        return Err(UnitsError::invalid(what, input, "expected a number"));
    }
    if frac.contains('.') {
        return Err(UnitsError::invalid(what, input, "more than one decimal point"));
    }
    if frac.len() > 9 {
        return Err(UnitsError::invalid(what, input, "more than 9 decimal places"));
    }
    let too_large = || UnitsError::invalid(what, input, "too large");
    let whole: u128 = if whole.is_empty() { 0 } else { whole.parse().map_err(|_| too_large())? };
    let frac_digits: u128 = if frac.is_empty() { 0 } else { frac.parse().map_err(|_| too_large())? };
    let frac_scale = 10u128.pow(frac.len() as u32);
    let whole_part = whole.checked_mul(unit).ok_or_else(too_large)?;
    let frac_part = frac_digits.checked_mul(unit).ok_or_else(too_large)? / frac_scale;
    whole_part.checked_add(frac_part).ok_or_else(too_large)
}

impl FromStr for ByteSize {
    type Err = UnitsError;

    fn from_str(input: &str) -> Result<Self, Self::Err> {
        let text = input.trim();
        let (number, unit) = split_number(text);
        let multiplier: u128 = match unit {
            "" | "B" => 1,
            "K" | "KiB" => 1 << 10,
            "M" | "MiB" => 1 << 20,
            "G" | "GiB" => 1 << 30,
            "T" | "TiB" => 1 << 40,
            "KB" | "kB" => 1_000,
            "MB" => 1_000_000,
            "GB" => 1_000_000_000,
            "TB" => 1_000_000_000_000,
            other => {
                return Err(UnitsError::invalid(
                    "size",
                    input,
                    format!("unknown unit {other:?} (use B, KiB, MiB, GiB, TiB, KB, MB, GB or TB)"),
                ));
            }
        };
        if unit.is_empty() && number.contains('.') {
            return Err(UnitsError::invalid("size", input, "a fractional number of bytes"));
        }
        let bytes = scale("size", input, number, multiplier)?;
        u64::try_from(bytes).map(ByteSize).map_err(|_| UnitsError::invalid("size", input, "too large"))
    }
}

impl fmt::Display for ByteSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const UNITS: [(&str, u64); 4] = [("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)];
        for (name, size) in UNITS {
            if self.0 >= size && self.0.is_multiple_of(size) {
                return write!(f, "{}{name}", self.0 / size);
            }
        }
        write!(f, "{}B", self.0)
    }
}

impl Serialize for ByteSize {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Bytes(u64),
            Text(String),
        }
        match Raw::deserialize(deserializer)? {
            Raw::Bytes(n) => Ok(ByteSize(n)),
            Raw::Text(text) => text.parse().map_err(serde::de::Error::custom),
        }
    }
}

/// Parses a duration such as `2s`, `500ms`, `1.5s`, `2m`, `100us`. A bare number is refused: `--timeout 2`
/// could mean seconds or milliseconds, and guessing wrong is worse than asking.
pub fn parse_duration(input: &str) -> Result<Duration, UnitsError> {
    let text = input.trim();
    let (number, unit) = split_number(text);
    let nanos_per_unit: u128 = match unit {
        "ns" => 1,
        "us" | "µs" => 1_000,
        "ms" => 1_000_000,
        "s" => 1_000_000_000,
        "m" | "min" => 60_000_000_000,
        "h" => 3_600_000_000_000,
        "" => {
            return Err(UnitsError::invalid("duration", input, "missing unit (use ns, us, ms, s, m or h)"));
        }
        other => {
            return Err(UnitsError::invalid(
                "duration",
                input,
                format!("unknown unit {other:?} (use ns, us, ms, s, m or h)"),
            ));
        }
    };
    let nanos = scale("duration", input, number, nanos_per_unit)?;
    let secs = u64::try_from(nanos / 1_000_000_000).map_err(|_| UnitsError::invalid("duration", input, "too large"))?;
    Ok(Duration::new(secs, (nanos % 1_000_000_000) as u32))
}

/// Formats a duration the way [`parse_duration`] reads it back (`2s`, `1500ms`, `250us`).
pub fn format_duration(duration: Duration) -> String {
    let nanos = duration.as_nanos();
    const UNITS: [(&str, u128); 5] =
        [("h", 3_600_000_000_000), ("m", 60_000_000_000), ("s", 1_000_000_000), ("ms", 1_000_000), ("us", 1_000)];
    for (name, size) in UNITS {
        if nanos >= size && nanos.is_multiple_of(size) {
            return format!("{}{name}", nanos / size);
        }
    }
    format!("{nanos}ns")
}

/// Serde adapter for durations written as text (`"30s"`).
pub mod duration_text {
    use super::*;

    /// Serializes as text, e.g. `"30s"`.
    pub fn serialize<S: Serializer>(value: &Duration, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(&format_duration(*value))
    }

    /// Deserializes text such as `"30s"` or `"500ms"`.
    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Duration, D::Error> {
        let text = String::deserialize(deserializer)?;
        parse_duration(&text).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_with_binary_and_decimal_units_parse() {
        assert_eq!("256MiB".parse::<ByteSize>(), Ok(ByteSize(256 << 20)));
        assert_eq!("1.5GiB".parse::<ByteSize>(), Ok(ByteSize(3 << 29)));
        assert_eq!("100MB".parse::<ByteSize>(), Ok(ByteSize(100_000_000)));
        assert_eq!("4096".parse::<ByteSize>(), Ok(ByteSize(4096)));
        assert_eq!(" 1 KiB ".parse::<ByteSize>(), Ok(ByteSize(1024)));
        assert_eq!("18446744073709551615".parse::<ByteSize>(), Ok(ByteSize(u64::MAX)));
    }

    #[test]
    fn bad_sizes_say_what_is_wrong() {
        for bad in ["", "MiB", "12XB", "1.2.3MiB", "1.5", "-1MiB", "99999999999TiB", "18446744073709551616"] {
            let err = bad.parse::<ByteSize>().expect_err(bad);
            assert!(err.to_string().contains("invalid size"), "{bad}: {err}");
        }
    }

    #[test]
    fn sizes_display_in_the_largest_exact_unit() {
        assert_eq!(ByteSize(1 << 20).to_string(), "1MiB");
        assert_eq!(ByteSize(1536).to_string(), "1536B");
        assert_eq!(ByteSize(3 << 30).to_string(), "3GiB");
    }

    #[test]
    fn durations_parse_with_units() {
        assert_eq!(parse_duration("2s"), Ok(Duration::from_secs(2)));
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("100us"), Ok(Duration::from_micros(100)));
    }

    #[test]
    fn durations_without_a_unit_are_refused() {
        let err = parse_duration("2").expect_err("bare number");
        assert!(err.to_string().contains("missing unit"), "{err}");
        assert!(parse_duration("2 fortnights").is_err());
        assert!(parse_duration("s").is_err());
    }

    #[test]
    fn durations_round_trip_through_text() {
        for d in [Duration::from_secs(30), Duration::from_millis(1500), Duration::from_micros(7), Duration::ZERO] {
            assert_eq!(parse_duration(&format_duration(d)), Ok(d));
        }
    }
}
