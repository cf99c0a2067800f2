//! Parsing of durations as sluice's docs and Envoy's users write them:
//! `"250ms"`, `"1s"`, `"1m"`, `"1h"`, and decimals such as `"0.25s"` or
//! `"1.5m"` (protobuf's JSON form of a Duration is decimal seconds, `"0.25s"`).
//!
//! Invariant: a parsed duration is a whole number of nanoseconds that fits in
//! `u64`; the caller decides whether zero is acceptable.

/// Nanoseconds in one millisecond, second, minute and hour.
pub const NS_PER_MS: u64 = 1_000_000;
pub const NS_PER_S: u64 = 1_000_000_000;

/// Parses `<number><unit>` with unit one of `ms`, `s`, `m`, `h` and a whole
/// or decimal number into nanoseconds. Returns a human-readable problem on
/// failure.
pub fn parse_duration(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .ok_or_else(|| format!("`{text}` has no unit (write e.g. \"1s\", \"500ms\", \"0.25s\")"))?;
    let (number, unit) = text.split_at(split);
    if number.is_empty() {
        // Nothing before the unit: say what is wrong with the number.
        return Err(if text.starts_with('-') {
            format!("`{text}` is negative: a duration is 0 or more")
        } else {
            format!("`{text}` does not start with a number such as 1 or 0.25")
        });
    }
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
    let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
    if whole.is_empty() || (number.contains('.') && fraction.is_empty()) || fraction.contains('.') {
        return Err(format!(
            "`{text}` does not start with a number such as 1 or 0.25"
        ));
    }
    let too_long = || format!("`{text}` is too long");
    let whole: u64 = whole.parse().map_err(|_| too_long())?;
    let mut ns = whole.checked_mul(scale).ok_or_else(too_long)?;
    if !fraction.is_empty() {
        // fraction / 10^digits of the unit, exactly, in nanoseconds.
        let digits = u32::try_from(fraction.len()).unwrap_or(u32::MAX);
        let denominator = 10u128.checked_pow(digits).ok_or_else(too_long)?;
        let numerator: u128 = fraction.parse().map_err(|_| too_long())?;
        let scaled = numerator
            .checked_mul(u128::from(scale))
            .ok_or_else(too_long)?;
        if scaled % denominator != 0 {
            return Err(format!("`{text}` is finer than a nanosecond"));
        }
        let part = u64::try_from(scaled / denominator).map_err(|_| too_long())?;
        ns = ns.checked_add(part).ok_or_else(too_long)?;
    }
    Ok(ns)
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
    fn a_negative_or_unsigned_number_is_named_as_such_not_as_a_unit() {
        for (bad, says) in [
            ("-1s", "is negative"),
            ("-0.5ms", "is negative"),
            (" -1h", "is negative"),
            ("+1s", "does not start with a number"),
            ("ms", "does not start with a number"),
            ("1d", "unknown unit `d`"),
        ] {
            let e = parse_duration(bad).expect_err(bad);
            assert!(e.contains(says), "{bad}: {e}");
        }
    }

    #[test]
    fn parses_decimals_as_envoy_users_write_durations() {
        assert_eq!(parse_duration("0.25s"), Ok(250 * NS_PER_MS));
        assert_eq!(parse_duration("1.5s"), Ok(1_500 * NS_PER_MS));
        assert_eq!(parse_duration("0.000000001s"), Ok(1));
        assert_eq!(parse_duration("1.5m"), Ok(90 * NS_PER_S));
        assert_eq!(parse_duration("2.500ms"), Ok(2_500_000));
        for bad in [
            "0.0000000001s",
            ".5s",
            "1.s",
            "1.2.3s",
            "0.5",
            "1..5s",
            "-1s",
            "+1s",
            "s",
        ] {
            assert!(parse_duration(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn refuses_malformed_durations_with_a_reason() {
        for bad in ["", "s", "1", "1d", "-1s", "99999999999999999999s", "1 s"] {
            let err = parse_duration(bad).expect_err(bad);
            assert!(err.contains('`'), "{bad}: {err}");
        }
        assert!(parse_duration("99999999999h").is_err());
    }

    /// A fraction of 38 digits times the unit's nanoseconds does not fit
    /// in a u128: refused, not an overflow (an input of the `config` fuzz
    /// target, `fuzz/seeds/config/duration-overflow.json`).
    #[test]
    fn a_fraction_too_long_to_scale_is_refused_as_too_long() {
        for long in [
            "0.99999999999999999999999999999999999999h",
            "0.10000000000000000000000000000000000000h",
            "1.99999999999999999999999999999999999999ms",
        ] {
            let e = parse_duration(long).expect_err(long);
            assert!(e.contains("is too long"), "{long}: {e}");
        }
    }
}
