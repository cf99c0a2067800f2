//! Parsing of human durations such as `"1s"`, `"250ms"`, `"1m"`, `"1h"`.
//!
//! Invariant: a parsed duration is a whole number of nanoseconds that fits in
//! `u64`; the caller decides whether zero is acceptable.

/// Nanoseconds in one millisecond, second, minute and hour.
pub const NS_PER_MS: u64 = 1_000_000;
pub const NS_PER_S: u64 = 1_000_000_000;

/// Parses `<digits><unit>` with unit one of `ms`, `s`, `m`, `h` into
/// nanoseconds. Returns a human-readable problem on failure.
pub fn parse_duration(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .ok_or_else(|| format!("`{text}` has no unit (write e.g. \"1s\", \"500ms\", \"1m\")"))?;
    let (digits, unit) = text.split_at(split);
    if digits.is_empty() {
        return Err(format!("`{text}` does not start with a whole number"));
    }
    let value: u64 = digits
        .parse()
        .map_err(|_| format!("`{text}`: the number is too large"))?;
    let scale = match unit {
        "ms" => NS_PER_MS,
        "s" => NS_PER_S,
        "m" => 60 * NS_PER_S,
        "h" => 3_600 * NS_PER_S,
        _ => {
            return Err(format!(
                "`{text}` has unknown unit `{unit}` (use ms, s, m or h)"
            ))
        }
    };
    value
        .checked_mul(scale)
        .ok_or_else(|| format!("`{text}` is too long"))
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn parses_each_unit() {
        assert_eq!(parse_duration("250ms"), Ok(250 * NS_PER_MS));
        assert_eq!(parse_duration("1s"), Ok(NS_PER_S));
        assert_eq!(parse_duration("2m"), Ok(120 * NS_PER_S));
        assert_eq!(parse_duration("1h"), Ok(3_600 * NS_PER_S));
        assert_eq!(parse_duration(" 0s "), Ok(0));
    }

    #[test]
    fn refuses_malformed_durations_with_a_reason() {
        for bad in [
            "",
            "s",
            "1",
            "1d",
            "-1s",
            "1.5s",
            "99999999999999999999s",
            "1 s",
        ] {
            let err = parse_duration(bad).expect_err(bad);
            assert!(err.contains('`'), "{bad}: {err}");
        }
        assert!(parse_duration("99999999999h").is_err());
    }
}
