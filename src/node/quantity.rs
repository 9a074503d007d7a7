//! Kubernetes resource quantities as exact integers of milli-units, enough for capacity
//! arithmetic (sums, differences, clamping) without floating point.

use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

/// Parses a quantity (`100m`, `1.5Gi`, `2e3`, `128974848`) into milli-units, rounding a
/// fraction of a milli-unit up as Kubernetes does. `None` if it is not a quantity.
pub fn parse_milli(text: &str) -> Option<i128> {
    parse_scaled(text, 3)
}

/// Parses a quantity into nano-units (CPU usage in nanocores), a fraction rounded up.
pub fn parse_nano(text: &str) -> Option<i128> {
    parse_scaled(text, 9)
}

/// The largest magnitude a parsed quantity may have, in the units it is parsed into
/// (milli- or nano-units): far past any real one (Kubernetes counts whole units in an
/// `int64`, under 2^83 nano-units), and 2^27 of them still add up inside an `i128`, so
/// sums of capacities cannot overflow. A lower Node's allocatable is whatever its writer
/// put there.
pub const MAX_SCALED: i128 = 1 << 100;

/// Parses a quantity into units of 10^-`scale`, rounding a fraction of one up. `None`
/// when it is not a quantity or its magnitude is past [`MAX_SCALED`] (`9e999999999`,
/// `99999999999999999999999999999999999999999Ei`): every step is checked.
fn parse_scaled(text: &str, scale: i32) -> Option<i128> {
    let text = text.trim();
    let (negative, text) = match text.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, text.strip_prefix('+').unwrap_or(text)),
    };
    let number_end = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(text.len());
    let (number, suffix) = text.split_at(number_end);
    let (int_part, frac_part) = number.split_once('.').unwrap_or((number, ""));
    if int_part.is_empty() && frac_part.is_empty() {
        return None;
    }
    // Trailing zeros of a fraction say nothing, and would only make the mantissa overflow.
    let frac_part = frac_part.trim_end_matches('0');
    let digits = format!("{int_part}{frac_part}");
    let mantissa: i128 = digits.parse().ok()?;
    let frac_len = i32::try_from(frac_part.len()).ok()?;

    // value = mantissa * 10^(exp10 - frac_len) * 2^exp2, in units of 10^-scale.
    let (exp10, exp2): (i32, u32) = match suffix {
        "" => (0, 0),
        "n" => (-9, 0),
        "u" => (-6, 0),
        "m" => (-3, 0),
        "k" => (3, 0),
        "M" => (6, 0),
        "G" => (9, 0),
        "T" => (12, 0),
        "P" => (15, 0),
        "E" => (18, 0),
        "Ki" => (0, 10),
        "Mi" => (0, 20),
        "Gi" => (0, 30),
        "Ti" => (0, 40),
        "Pi" => (0, 50),
        "Ei" => (0, 60),
        exp => {
            let exp = exp.strip_prefix(['e', 'E'])?;
            (exp.parse().ok()?, 0)
        }
    };
    let scaled = mantissa.checked_mul(1i128.checked_shl(exp2)?)?;
    let power = exp10.checked_add(scale)?.checked_sub(frac_len)?;
    let value = if power >= 0 {
        scaled.checked_mul(10i128.checked_pow(power.unsigned_abs())?)?
    } else {
        match 10i128.checked_pow(power.unsigned_abs()) {
            // Rounded up, without the addition that could overflow.
            Some(divisor) => scaled / divisor + i128::from(scaled % divisor != 0),
            // A divisor past i128 is past any mantissa: a fraction of one unit.
            None => i128::from(scaled != 0),
        }
    };
    if value > MAX_SCALED {
        return None;
    }
    Some(if negative { -value } else { value })
}

/// Parses a [`Quantity`]; an unparsable one counts as zero (and is logged by the caller's
/// context, never a panic).
pub fn milli(quantity: &Quantity) -> i128 {
    parse_milli(&quantity.0).unwrap_or(0)
}

/// Formats milli-units back: whole units when exact (`8`, `34359738368`), else `<n>m`.
pub fn format_milli(milli: i128) -> Quantity {
    if milli % 1000 == 0 {
        Quantity((milli / 1000).to_string())
    } else {
        Quantity(format!("{milli}m"))
    }
}

/// Formats milli-units for a person: binary suffixes where exact (`4Gi`, `512Mi`), else
/// as [`format_milli`] (`6`, `500m`).
pub fn format_readable(milli: i128) -> String {
    if milli % 1000 == 0 {
        let whole = milli / 1000;
        for (suffix, unit) in [
            ("Ti", 1i128 << 40),
            ("Gi", 1 << 30),
            ("Mi", 1 << 20),
            ("Ki", 1 << 10),
        ] {
            if whole != 0 && whole % unit == 0 {
                return format!("{}{suffix}", whole / unit);
            }
        }
    }
    format_milli(milli).0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_forms_kubernetes_writes() {
        let cases: &[(&str, Option<i128>)] = &[
            ("0", Some(0)),
            ("1", Some(1_000)),
            ("100m", Some(100)),
            ("1.5", Some(1_500)),
            ("0.1", Some(100)),
            (".5", Some(500)),
            ("1Ki", Some(1_024_000)),
            ("1Gi", Some(1_073_741_824_000)),
            ("32Gi", Some(34_359_738_368_000)),
            ("1.5Gi", Some(1_610_612_736_000)),
            ("1k", Some(1_000_000)),
            ("129M", Some(129_000_000_000)),
            ("2e3", Some(2_000_000)),
            ("1E3", Some(1_000_000)),
            ("1u", Some(1)), // a fraction of a milli-unit rounds up
            ("1n", Some(1)),
            ("-1", Some(-1_000)),
            ("", None),
            ("abc", None),
            ("1Xi", None),
            ("1.2.3", None),
            // Past what any i128 step holds, or past MAX_SCALED: refused, never a panic.
            ("9e999999999", None),
            ("9e2147483647", None),
            ("9e99999999999", None),
            ("1.2345e-2147483648", None),
            ("1.5e-2147483648", Some(1)),
            ("99999999999999999999999999999999999999999Ei", None),
            ("9999999999999999999999999999Ei", None),
            ("99999999999999999999999999999999999999n", None),
            ("170141183460469231731687303715884105727m", None),
            ("-170141183460469231731687303715884105727m", None),
            ("1e30", None),
            ("1e27", Some(1_000_000_000_000_000_000_000_000_000_000)),
            ("1267650600228229401496703205376m", Some(MAX_SCALED)),
            ("1267650600228229401496703205377m", None),
            // Tiny and long forms are still quantities.
            ("1e-50", Some(1)),
            ("0e-50", Some(0)),
            ("1.0000000000000000000000000000000000000000000", Some(1_000)),
            ("99999999999999999999999999999999999999999m", None),
        ];
        for (text, want) in cases {
            assert_eq!(parse_milli(text), *want, "{text:?}");
        }
        assert_eq!(parse_nano("9e2147483647"), None);
        assert_eq!(parse_nano("1e-2147483648"), Some(1));
    }

    #[test]
    fn parses_nano_units_as_metrics_write_cpu() {
        let cases: &[(&str, Option<i128>)] = &[
            ("1500000n", Some(1_500_000)),
            ("250m", Some(250_000_000)),
            ("2", Some(2_000_000_000)),
            ("3u", Some(3_000)),
            ("x", None),
        ];
        for (text, want) in cases {
            assert_eq!(parse_nano(text), *want, "{text:?}");
        }
    }

    #[test]
    fn formats_whole_units_plainly() {
        assert_eq!(format_milli(8_000).0, "8");
        assert_eq!(format_milli(7_500).0, "7500m");
        assert_eq!(format_milli(0).0, "0");
        assert_eq!(format_milli(34_359_738_368_000).0, "34359738368");
    }

    #[test]
    fn formats_readably() {
        assert_eq!(format_readable(6_000), "6");
        assert_eq!(format_readable(500), "500m");
        assert_eq!(format_readable(34_359_738_368_000), "32Gi");
        assert_eq!(format_readable(536_870_912_000), "512Mi");
        assert_eq!(format_readable(0), "0");
    }
}
