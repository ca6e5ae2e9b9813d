//! Small parsing helpers shared by subcommands, and the usage-error type that makes
//! the command exit with status 2.

use std::fmt;
use std::path::Path;
use std::time::Duration;

use anyhow::Context;

/// An error in what the user asked for (a flag's value, a combination of flags), found
/// after parsing: `main` prints it like any error but exits with status 2, the status
/// the parser uses for invalid flags.
#[derive(Debug)]
pub struct UsageError(pub String);

impl fmt::Display for UsageError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for UsageError {}

/// A [`UsageError`] as an `anyhow::Error`.
pub fn usage(msg: impl Into<String>) -> anyhow::Error {
    anyhow::Error::new(UsageError(msg.into()))
}

/// Whether `e` (or anything in its context chain) is a [`UsageError`].
pub fn is_usage(e: &anyhow::Error) -> bool {
    e.chain().any(|c| c.is::<UsageError>())
}

/// Parser of `--model`: a known preset's name (`tiny`, `llama3-8b`, `llama3-70b-tp8`),
/// so an unknown one is refused by the parser (exit status 2) with the known names.
pub fn parse_model(s: &str) -> Result<String, String> {
    s.parse::<kvferry::layout::Preset>()
        .map(|_| s.to_string())
        .map_err(|e| e.to_string())
}

/// Reads a shared secret from a file (surrounding whitespace trimmed; empty refused).
pub fn read_secret_file(f: &Path) -> anyhow::Result<Vec<u8>> {
    let s = std::fs::read(f).with_context(|| format!("reading secret file {}", f.display()))?;
    let s: Vec<u8> = s.trim_ascii().to_vec();
    anyhow::ensure!(!s.is_empty(), "secret file {} is empty", f.display());
    Ok(s)
}

/// Checks the form of a listen address without resolving names: an IP socket address
/// (`127.0.0.1:7070`, `[::1]:7070`) or `HOST:PORT` with a port that is a number
/// (`localhost:7070`). Returns the address when it is an IP one. The error reads
/// `cannot listen on ADDR: invalid socket address` (or `invalid port value`).
pub fn check_listen_address(addr: &str) -> Result<Option<std::net::SocketAddr>, UsageError> {
    if let Ok(a) = addr.parse::<std::net::SocketAddr>() {
        return Ok(Some(a));
    }
    let why = match addr.rsplit_once(':') {
        None => "invalid socket address",
        Some((host, _)) if host.is_empty() || host.contains(':') => "invalid socket address",
        Some((_, port)) if port.parse::<u16>().is_err() => "invalid port value",
        Some(_) => return Ok(None),
    };
    Err(UsageError(format!("cannot listen on {addr}: {why}")))
}

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

    #[test]
    fn listen_addresses() {
        assert!(check_listen_address("127.0.0.1:0").unwrap().is_some());
        assert!(check_listen_address("[::1]:7070").unwrap().is_some());
        assert!(check_listen_address("localhost:7070").unwrap().is_none());
        let e = check_listen_address("notanaddress").unwrap_err().to_string();
        assert_eq!(e, "cannot listen on notanaddress: invalid socket address");
        let e = check_listen_address("0.0.0.0:99999").unwrap_err().to_string();
        assert_eq!(e, "cannot listen on 0.0.0.0:99999: invalid port value");
        assert!(check_listen_address(":7070").is_err());
        assert!(check_listen_address("::1:7070").is_err());
    }
}
