//! Small parsing helpers shared by subcommands.

use std::time::Duration;

/// Parses `500ms`, `2s`, `1.5s`, `3m`, `250us`; a bare number is seconds. Zero and
/// negative values are rejected: every wait in kvferry must be a real bound.
pub fn parse_timeout(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    if t.starts_with('-') {
        return Err(format!("{s:?}: a timeout cannot be negative"));
    }
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let v: f64 = num
        .parse()
        .map_err(|_| format!("{s:?}: expected a duration like 500ms, 2s, 1m"))?;
    let secs = match unit.trim() {
        "" | "s" => v,
        "ms" => v / 1e3,
        "us" | "µs" => v / 1e6,
        "m" | "min" => v * 60.0,
        "h" => v * 3600.0,
        u => return Err(format!("{s:?}: unknown unit {u:?} (use us, ms, s, m, h)")),
    };
    if !secs.is_finite() || secs <= 0.0 {
        return Err(format!("{s:?}: a timeout must be greater than zero"));
    }
    if secs > 24.0 * 3600.0 {
        return Err(format!("{s:?}: absurdly long (max 24h)"));
    }
    Ok(Duration::from_secs_f64(secs))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_timeout("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_timeout("2").unwrap(), Duration::from_secs(2));
        assert_eq!(parse_timeout("1.5s").unwrap(), Duration::from_millis(1500));
        assert!(parse_timeout("0s").unwrap_err().contains("greater than zero"));
        assert!(parse_timeout("-1s").unwrap_err().contains("negative"));
        assert!(parse_timeout("5 fortnights").is_err());
        assert!(parse_timeout("48h").is_err());
    }
}
