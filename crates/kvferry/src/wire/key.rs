//! Content keys naming KV-cache chunks.
//!
//! A [`ChunkKey`] is a 32-byte SHA-256 digest: of a human-readable name
//! ([`ChunkKey::from_name`]) or of a token prefix ([`ChunkKey::from_tokens`], the
//! little-endian bytes of the token ids). `Display` and `FromStr` use full lowercase
//! hex; `Debug` shows the first 8 hex digits only, to keep logs readable.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::WireError;

/// The 32-byte identity of a KV-cache chunk.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ChunkKey(pub [u8; 32]);

impl ChunkKey {
    /// The key of a named chunk: SHA-256 of the name's UTF-8 bytes.
    pub fn from_name(name: &str) -> ChunkKey {
        ChunkKey(Sha256::digest(name.as_bytes()).into())
    }

    /// The key of a token sequence: SHA-256 of the tokens as little-endian `u32`s.
    pub fn from_tokens(tokens: &[u32]) -> ChunkKey {
        let mut h = Sha256::new();
        for t in tokens {
            h.update(t.to_le_bytes());
        }
        ChunkKey(h.finalize().into())
    }
}

impl fmt::Display for ChunkKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for b in &self.0 {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for ChunkKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ChunkKey(")?;
        for b in &self.0[..4] {
            write!(f, "{b:02x}")?;
        }
        write!(f, "…)")
    }
}

impl FromStr for ChunkKey {
    type Err = WireError;

    /// Parses 64 hex digits (either case).
    fn from_str(s: &str) -> Result<ChunkKey, WireError> {
        let bad = || WireError::Decode(format!("chunk key must be 64 hex digits: {s:?}"));
        let s = s.as_bytes();
        if s.len() != 64 {
            return Err(bad());
        }
        let mut out = [0u8; 32];
        for (i, pair) in s.chunks_exact(2).enumerate() {
            let hi = hex_val(pair[0]).ok_or_else(bad)?;
            let lo = hex_val(pair[1]).ok_or_else(bad)?;
            out[i] = hi << 4 | lo;
        }
        Ok(ChunkKey(out))
    }
}

fn hex_val(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_parse_round_trip() {
        let k = ChunkKey::from_name("layer0/seq7");
        let s = k.to_string();
        assert_eq!(s.len(), 64);
        assert_eq!(s.parse::<ChunkKey>().unwrap(), k);
        assert_eq!(s.to_uppercase().parse::<ChunkKey>().unwrap(), k);
        assert!(s[..63].parse::<ChunkKey>().is_err());
        assert!(format!("{}g", &s[..63]).parse::<ChunkKey>().is_err());
    }

    #[test]
    fn known_digests() {
        // sha256("") and sha256 of no tokens are the same digest.
        let empty = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";
        assert_eq!(ChunkKey::from_name("").to_string(), empty);
        assert_eq!(ChunkKey::from_tokens(&[]).to_string(), empty);
        // Tokens hash as little-endian u32s.
        let t = ChunkKey::from_tokens(&[1, 0x0403_0201]);
        let mut h = Sha256::new();
        h.update([1, 0, 0, 0, 1, 2, 3, 4]);
        assert_eq!(t.0, <[u8; 32]>::from(h.finalize()));
    }

    #[test]
    fn debug_is_short() {
        let k = ChunkKey([0xab; 32]);
        assert_eq!(format!("{k:?}"), "ChunkKey(abababab…)");
    }
}
