//! Human-readable byte sizes: `64MiB`, `2GiB`, `4096`, `1.5GiB`, `512k`.
//!
//! Binary (`KiB`, `MiB`, `GiB`, `TiB`, and the short forms `k`, `m`, `g`, `t`) and
//! decimal (`KB`, `MB`, `GB`, `TB`) suffixes are accepted, case-insensitively except
//! that `KB`/`MB`/… mean powers of 1000 and `KiB`/`MiB`/… powers of 1024. A bare
//! number is bytes.

use std::fmt;
use std::str::FromStr;

/// A byte count parsed from (and printed as) a human-readable size.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct ByteSize(pub u64);

/// Why a size string could not be parsed.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ByteSizeError {
    /// The string was empty.
    #[error("empty size")]
    Empty,
    /// The numeric part is not a non-negative number.
    #[error("invalid size number in {0:?} (expected e.g. 64MiB, 2GiB, 4096)")]
    BadNumber(String),
    /// The suffix is not one of the known units.
    #[error("unknown size unit {unit:?} in {input:?} (use B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)")]
    BadUnit {
        /// The whole input.
        input: String,
        /// The unit that was not recognised.
        unit: String,
    },
    /// The value does not fit in 64 bits.
    #[error("size {0:?} overflows 64 bits")]
    Overflow(String),
}

impl ByteSizeError {
    /// The stable code of this error (every variant is one).
    pub fn code(&self) -> crate::ErrorCode {
        crate::ErrorCode::InvalidArgument
    }
}

impl ByteSize {
    /// The size in bytes.
    pub fn bytes(self) -> u64 {
        self.0
    }
}

impl FromStr for ByteSize {
    type Err = ByteSizeError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let t = s.trim();
        if t.is_empty() {
            return Err(ByteSizeError::Empty);
        }
        let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
        let (num, unit) = t.split_at(split);
        let unit = unit.trim();
        let mult: u64 = match unit {
            "" | "b" | "B" => 1,
            "k" | "K" | "KiB" | "kib" | "Ki" => 1 << 10,
            "m" | "M" | "MiB" | "mib" | "Mi" => 1 << 20,
            "g" | "G" | "GiB" | "gib" | "Gi" => 1 << 30,
            "t" | "T" | "TiB" | "tib" | "Ti" => 1 << 40,
            "KB" | "kB" | "kb" => 1_000,
            "MB" | "mb" => 1_000_000,
            "GB" | "gb" => 1_000_000_000,
            "TB" | "tb" => 1_000_000_000_000,
            _ => {
                return Err(ByteSizeError::BadUnit {
                    input: s.to_string(),
                    unit: unit.to_string(),
                })
            }
        };
        if num.is_empty() {
            return Err(ByteSizeError::BadNumber(s.to_string()));
        }
        if num.contains('.') {
            let v: f64 = num.parse().map_err(|_| ByteSizeError::BadNumber(s.to_string()))?;
            let total = v * mult as f64;
            if !total.is_finite() || total >= u64::MAX as f64 {
                return Err(ByteSizeError::Overflow(s.to_string()));
            }
            Ok(ByteSize(total.round() as u64))
        } else {
            let v: u64 = num.parse().map_err(|_| ByteSizeError::Overflow(s.to_string()))?;
            v.checked_mul(mult)
                .map(ByteSize)
                .ok_or_else(|| ByteSizeError::Overflow(s.to_string()))
        }
    }
}

impl fmt::Display for ByteSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const UNITS: [(&str, u64); 4] = [("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)];
        for (name, size) in UNITS {
            if self.0 >= size && self.0.is_multiple_of(size) {
                return write!(f, "{}{}", self.0 / size, name);
            }
        }
        for (name, size) in UNITS {
            if self.0 >= size {
                return write!(f, "{:.1}{}", self.0 as f64 / size as f64, name);
            }
        }
        write!(f, "{}B", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_binary_and_decimal_units() {
        assert_eq!("64MiB".parse::<ByteSize>().unwrap().0, 64 << 20);
        assert_eq!("2GiB".parse::<ByteSize>().unwrap().0, 2 << 30);
        assert_eq!("4096".parse::<ByteSize>().unwrap().0, 4096);
        assert_eq!("1.5GiB".parse::<ByteSize>().unwrap().0, 3 << 29);
        assert_eq!("512k".parse::<ByteSize>().unwrap().0, 512 << 10);
        assert_eq!("1MB".parse::<ByteSize>().unwrap().0, 1_000_000);
    }

    #[test]
    fn rejects_garbage_with_typed_errors() {
        assert_eq!("".parse::<ByteSize>(), Err(ByteSizeError::Empty));
        assert!(matches!(
            "12 parsecs".parse::<ByteSize>(),
            Err(ByteSizeError::BadUnit { .. })
        ));
        assert!(matches!("MiB".parse::<ByteSize>(), Err(ByteSizeError::BadNumber(_))));
        assert!(matches!(
            "99999999999TiB".parse::<ByteSize>(),
            Err(ByteSizeError::Overflow(_))
        ));
        assert!(matches!(
            "-5MiB".parse::<ByteSize>(),
            Err(ByteSizeError::BadUnit { .. }) | Err(ByteSizeError::BadNumber(_))
        ));
    }

    #[test]
    fn displays_round_trip() {
        for s in ["64MiB", "2GiB", "4KiB", "17B"] {
            assert_eq!(s.parse::<ByteSize>().unwrap().to_string(), s);
        }
    }
}
