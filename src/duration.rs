//! Durations as Go writes them (`1m0s`, `1h30m`, `300ms`), the form tensile-kube's flags
//! and manifests use: parsed from flags, printed in messages. A leaf module, imported by the
//! flag parsers and by whatever names a duration in an error.

use std::time::Duration;

/// A duration as Go writes it, or plain seconds: `10s`, `1m`, `500ms`, `30`, and Go's
/// compound forms (`1m0s`, `1h30m`, `1.5h`, `300ms`) that tensile-kube prints and its
/// manifests use. Units: `ns`, `us` (`µs`, `μs`), `ms`, `s`, `m`, `h`. Exact to the
/// nanosecond; negative and overflowing durations are refused.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let invalid = || format!("invalid duration {text:?} (e.g. 30s, 1m0s, 1h30m, 300ms)");
    let body = text.strip_prefix('+').unwrap_or(text);
    if body.is_empty() {
        return Err(invalid());
    }
    if body.bytes().all(|c| c.is_ascii_digit() || c == b'.') {
        return nanos_of(body, NANOS_PER_SECOND)
            .and_then(duration_of_nanos)
            .ok_or_else(invalid);
    }
    let mut rest = body;
    let mut total: u128 = 0;
    while !rest.is_empty() {
        let number_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let (number, tail) = rest.split_at(number_len);
        let unit_len = tail
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(tail.len());
        let (unit, tail) = tail.split_at(unit_len);
        let scale = match unit {
            "ns" => 1,
            "us" | "\u{b5}s" | "\u{3bc}s" => 1_000,
            "ms" => 1_000_000,
            "s" => NANOS_PER_SECOND,
            "m" => 60 * NANOS_PER_SECOND,
            "h" => 3600 * NANOS_PER_SECOND,
            "" => return Err(format!("{}: a unit is missing", invalid())),
            _ => return Err(format!("{}: unknown unit {unit:?}", invalid())),
        };
        let nanos = nanos_of(number, scale).ok_or_else(invalid)?;
        total = total.checked_add(nanos).ok_or_else(invalid)?;
        rest = tail;
    }
    duration_of_nanos(total).ok_or_else(invalid)
}

const NANOS_PER_SECOND: u128 = 1_000_000_000;

/// `number` (`12`, `1.5`, `.5`) times `scale` nanoseconds; digits finer than a nanosecond
/// are dropped, as Go does.
fn nanos_of(number: &str, scale: u128) -> Option<u128> {
    let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
    if whole.is_empty() && fraction.is_empty() {
        return None;
    }
    let digits = |s: &str| s.bytes().all(|c| c.is_ascii_digit());
    if !digits(whole) || !digits(fraction) {
        return None;
    }
    let whole: u128 = if whole.is_empty() {
        0
    } else {
        whole.parse().ok()?
    };
    let mut nanos = whole.checked_mul(scale)?;
    let mut step = scale;
    for digit in fraction.bytes() {
        step /= 10;
        nanos = nanos.checked_add(u128::from(digit - b'0') * step)?;
    }
    Some(nanos)
}

fn duration_of_nanos(nanos: u128) -> Option<Duration> {
    let seconds = u64::try_from(nanos / NANOS_PER_SECOND).ok()?;
    let rest = u32::try_from(nanos % NANOS_PER_SECOND).ok()?;
    Some(Duration::new(seconds, rest))
}

/// A duration in Go's form (`1h30m0s`, `500ms`), for messages.
pub fn format_duration(duration: Duration) -> String {
    if duration.is_zero() {
        return "0s".into();
    }
    if duration < Duration::from_secs(1) {
        return format!("{}ms", duration.as_millis());
    }
    let seconds = duration.as_secs();
    let (hours, minutes, seconds) = (seconds / 3600, seconds / 60 % 60, seconds % 60);
    match (hours, minutes) {
        (0, 0) => format!("{seconds}s"),
        (0, _) => format!("{minutes}m{seconds}s"),
        _ => format!("{hours}h{minutes}m{seconds}s"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        let cases = [
            ("10s", Some(10_000_000_000)),
            ("1m", Some(60_000_000_000)),
            ("1h", Some(3_600_000_000_000)),
            ("500ms", Some(500_000_000)),
            ("30", Some(30_000_000_000)),
            ("1.5s", Some(1_500_000_000)),
            ("5d", None),
            ("", None),
            ("s", None),
            (".s", None),
            ("1m0s", Some(60_000_000_000)),
            ("1h30m", Some(5_400_000_000_000)),
            ("1h0m0s", Some(3_600_000_000_000)),
            ("2h45m", Some(9_900_000_000_000)),
            ("1.5h", Some(5_400_000_000_000)),
            ("300ms", Some(300_000_000)),
            ("2m3.5s", Some(123_500_000_000)),
            (".5s", Some(500_000_000)),
            ("+5s", Some(5_000_000_000)),
            ("1.000000001s", Some(1_000_000_001)),
            ("1.0000000019s", Some(1_000_000_001)),
            ("10us", Some(10_000)),
            ("10\u{b5}s", Some(10_000)),
            ("10\u{3bc}s", Some(10_000)),
            ("7ns", Some(7)),
            ("0s", Some(0)),
            ("0", Some(0)),
            ("1m0", None),
            ("1x2s", None),
            ("1..5s", None),
            ("-1s", None),
            ("99999999999999999999999h", None),
        ];
        for (text, nanos) in cases {
            let got = parse_duration(text).ok().map(|d| d.as_nanos());
            assert_eq!(got, nanos, "{text:?}");
        }
    }

    #[test]
    fn formatted_durations() {
        let cases = [
            (Duration::ZERO, "0s"),
            (Duration::from_millis(300), "300ms"),
            (Duration::from_secs(1), "1s"),
            (Duration::from_secs(90), "1m30s"),
            (Duration::from_secs(3600), "1h0m0s"),
            (Duration::from_secs(365 * 24 * 3600), "8760h0m0s"),
        ];
        for (duration, want) in cases {
            assert_eq!(format_duration(duration), want);
            assert_eq!(parse_duration(want).unwrap(), duration, "round trip {want}");
        }
    }
}
