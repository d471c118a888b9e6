//! Human durations for flags: `30`, `30s`, `500ms`, `2m`, `1h`.
//!
//! A bare number means seconds, which keeps the original adapter's integer flags valid.

use std::time::Duration;

/// Parses a duration flag value; the error text is shown by clap next to the flag name.
pub fn parse_duration(raw: &str) -> Result<Duration, String> {
    let s = raw.trim();
    let split = s
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let value: f64 = num
        .parse()
        .map_err(|_| format!("{raw:?} is not a duration (use e.g. 30s, 500ms, 2m)"))?;
    let secs = match unit {
        "" | "s" => value,
        "ms" => value / 1000.0,
        "m" => value * 60.0,
        "h" => value * 3600.0,
        other => {
            return Err(format!(
                "unknown unit {other:?} in {raw:?} (use ms, s, m or h)"
            ));
        }
    };
    if !secs.is_finite() || !(0.0..=86_400.0 * 365.0).contains(&secs) {
        return Err(format!("{raw:?} is out of range"));
    }
    Ok(Duration::from_secs_f64(secs))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_units() {
        assert_eq!(parse_duration("30"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("1h"), Ok(Duration::from_secs(3600)));
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
    }

    #[test]
    fn rejects_garbage() {
        for bad in ["", "s", "ten", "5d", "-1s", "1e999"] {
            assert!(parse_duration(bad).is_err(), "{bad:?}");
        }
    }
}
