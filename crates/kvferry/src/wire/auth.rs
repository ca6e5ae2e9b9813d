//! Key derivation and HMAC-SHA256 proofs for the peer handshake.
//!
//! The shared secret is never used as a MAC key directly. [`Keys::derive`] runs
//! HKDF-SHA256 (RFC 5869, built from HMAC-SHA256): *extract* with the fixed salt
//! [`KDF_SALT`], then *expand* once per role with the labels [`CLIENT_LABEL`] and
//! [`SERVER_LABEL`], giving two independent 32-byte proof keys. A proof is
//! `HMAC(role key, transcript)` where the [`Transcript`] binds everything the handshake
//! exchanged: both peer ids, both incarnations and **both nonces** (each side chose
//! one). Because the two roles use different keys, a proof reflected back at its sender
//! does not verify; because both nonces are in every proof, a proof is useless outside
//! the handshake it was made for, and neither side ever proves anything over values
//! chosen by the other side alone. Verification is constant-time.
//!
//! Which side proves first, and why, is described in `net::handshake`.

use hmac::{Hmac, Mac};
use rand::RngCore;
use sha2::Sha256;
use subtle::ConstantTimeEq;

/// Shortest accepted shared secret, in bytes: 256 bits, so that a proof observed by
/// whoever the client connected to cannot be used to guess the secret offline.
pub const MIN_SECRET_BYTES: usize = 32;

/// HKDF salt of the key derivation (domain separation from any other use of the secret).
pub const KDF_SALT: &[u8] = b"kvferry handshake v2 salt";
/// HKDF info of the client's proof key.
pub const CLIENT_LABEL: &str = "kvferry v2 client proof";
/// HKDF info of the server's proof key.
pub const SERVER_LABEL: &str = "kvferry v2 server proof";
/// Prefix of every transcript (domain separation of the proofs themselves).
const TRANSCRIPT_LABEL: &[u8] = b"kvferry handshake v2 transcript";

type HmacSha256 = Hmac<Sha256>;

fn hmac(key: &[u8], parts: &[&[u8]]) -> [u8; 32] {
    // HMAC is defined for keys of any length: this cannot fail.
    let mut mac = <HmacSha256 as Mac>::new_from_slice(key).expect("HMAC accepts any key length");
    for p in parts {
        mac.update(p);
    }
    mac.finalize().into_bytes().into()
}

/// HKDF-Extract (RFC 5869 §2.2) with HMAC-SHA256: a pseudorandom key from `ikm`.
pub fn hkdf_extract(salt: &[u8], ikm: &[u8]) -> [u8; 32] {
    hmac(salt, &[ikm])
}

/// HKDF-Expand (RFC 5869 §2.3) with HMAC-SHA256 for one 32-byte output block.
pub fn hkdf_expand(prk: &[u8; 32], info: &[u8]) -> [u8; 32] {
    hmac(prk, &[info, &[1]])
}

/// Which side of the handshake makes (or made) a proof.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// The connecting side.
    Client,
    /// The accepting side.
    Server,
}

/// Everything a proof binds: both identities and both nonces.
#[derive(Clone, Copy, Debug)]
pub struct Transcript<'a> {
    /// The client's peer id, from its `Hello`.
    pub client_id: &'a str,
    /// The client's incarnation, from its `Hello`.
    pub client_incarnation: u64,
    /// The client's nonce, from its `Hello`.
    pub client_nonce: &'a [u8; 32],
    /// The server's peer id, from its `Challenge`.
    pub server_id: &'a str,
    /// The server's incarnation, from its `Challenge`.
    pub server_incarnation: u64,
    /// The server's nonce, from its `Challenge`.
    pub server_nonce: &'a [u8; 32],
}

impl Transcript<'_> {
    /// An unambiguous encoding: fixed-size fields, and strings prefixed by their length.
    fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(TRANSCRIPT_LABEL.len() + 96 + self.client_id.len() + self.server_id.len());
        b.extend_from_slice(TRANSCRIPT_LABEL);
        for (id, inc, nonce) in [
            (self.client_id, self.client_incarnation, self.client_nonce),
            (self.server_id, self.server_incarnation, self.server_nonce),
        ] {
            b.extend_from_slice(&(id.len() as u64).to_le_bytes());
            b.extend_from_slice(id.as_bytes());
            b.extend_from_slice(&inc.to_le_bytes());
            b.extend_from_slice(nonce);
        }
        b
    }
}

/// The two proof keys derived from a shared secret.
#[derive(Clone)]
pub struct Keys {
    client: [u8; 32],
    server: [u8; 32],
}

impl std::fmt::Debug for Keys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Keys(<redacted>)")
    }
}

impl Keys {
    /// Derives the proof keys from `secret` (HKDF-SHA256, see the module docs).
    pub fn derive(secret: &[u8]) -> Keys {
        let prk = hkdf_extract(KDF_SALT, secret);
        Keys {
            client: hkdf_expand(&prk, CLIENT_LABEL.as_bytes()),
            server: hkdf_expand(&prk, SERVER_LABEL.as_bytes()),
        }
    }

    fn key(&self, role: Role) -> &[u8; 32] {
        match role {
            Role::Client => &self.client,
            Role::Server => &self.server,
        }
    }

    /// The proof `role` sends for the handshake described by `t`.
    pub fn proof(&self, role: Role, t: &Transcript<'_>) -> [u8; 32] {
        hmac(self.key(role), &[&t.encode()])
    }

    /// Checks, in constant time, a proof made by `role` for the handshake `t`.
    pub fn verify(&self, role: Role, t: &Transcript<'_>, proof: &[u8; 32]) -> bool {
        self.proof(role, t).ct_eq(proof).into()
    }
}

/// A fresh 32-byte random nonce from the OS-seeded thread RNG.
pub fn nonce() -> [u8; 32] {
    let mut n = [0u8; 32];
    rand::thread_rng().fill_bytes(&mut n);
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECRET: &[u8] = b"0123456789abcdef0123456789abcdef";

    fn transcript<'a>(c: &'a [u8; 32], s: &'a [u8; 32]) -> Transcript<'a> {
        Transcript {
            client_id: "consumer",
            client_incarnation: 7,
            client_nonce: c,
            server_id: "producer",
            server_incarnation: 9,
            server_nonce: s,
        }
    }

    #[test]
    fn hkdf_matches_rfc5869_test_case_1() {
        let ikm = [0x0bu8; 22];
        let salt: Vec<u8> = (0x00..=0x0c).collect();
        let info: Vec<u8> = (0xf0..=0xf9).collect();
        let prk = hkdf_extract(&salt, &ikm);
        let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
        assert_eq!(
            hex(&prk),
            "077709362c2e32df0ddc3f0dc47bba6390b6c73bb50f9c3122ec844ad7c2b3e5"
        );
        // The first 32 bytes of OKM.
        assert_eq!(
            hex(&hkdf_expand(&prk, &info)),
            "3cb25f25faacd57a90434f64d0362f2a2d2d0a90cf1a5a4c5db02d56ecc4c5bf"
        );
    }

    #[test]
    fn right_secret_verifies() {
        let (c, s) = (nonce(), nonce());
        let k = Keys::derive(SECRET);
        let t = transcript(&c, &s);
        assert!(k.verify(Role::Client, &t, &k.proof(Role::Client, &t)));
        assert!(Keys::derive(SECRET).verify(Role::Server, &t, &k.proof(Role::Server, &t)));
    }

    #[test]
    fn wrong_secret_fails() {
        let (c, s) = (nonce(), nonce());
        let t = transcript(&c, &s);
        let p = Keys::derive(SECRET).proof(Role::Client, &t);
        assert!(!Keys::derive(b"0123456789abcdef0123456789abcdeF").verify(Role::Client, &t, &p));
        assert!(!Keys::derive(b"").verify(Role::Client, &t, &p));
    }

    #[test]
    fn reflected_or_transplanted_proofs_fail() {
        let (c, s) = (nonce(), nonce());
        let k = Keys::derive(SECRET);
        let t = transcript(&c, &s);
        // A server proof replayed as a client proof (and vice versa) fails.
        assert!(!k.verify(Role::Client, &t, &k.proof(Role::Server, &t)));
        assert!(!k.verify(Role::Server, &t, &k.proof(Role::Client, &t)));
        let p = k.proof(Role::Client, &t);
        // Swapped nonces, another nonce, another identity or incarnation: all fail.
        assert!(!k.verify(Role::Client, &transcript(&s, &c), &p));
        assert!(!k.verify(Role::Client, &transcript(&c, &nonce()), &p));
        assert!(!k.verify(
            Role::Client,
            &Transcript {
                client_id: "mallory",
                ..t
            },
            &p
        ));
        assert!(!k.verify(
            Role::Client,
            &Transcript {
                server_incarnation: 10,
                ..t
            },
            &p
        ));
        // Identity bytes cannot slide between fields.
        let a = Transcript {
            client_id: "ab",
            server_id: "c",
            ..t
        };
        let b = Transcript {
            client_id: "a",
            server_id: "bc",
            ..t
        };
        assert!(!k.verify(Role::Client, &b, &k.proof(Role::Client, &a)));
    }

    #[test]
    fn keys_are_not_the_secret_and_differ_per_role() {
        let k = Keys::derive(SECRET);
        assert_ne!(k.client, k.server);
        assert_ne!(&k.client[..], SECRET);
        assert_eq!(format!("{k:?}"), "Keys(<redacted>)");
    }

    #[test]
    fn nonces_differ() {
        assert_ne!(nonce(), nonce());
    }
}
