//! HMAC-SHA256 challenge-response for the peer handshake.
//!
//! Each side sends a fresh random [`nonce`]. With a shared secret configured, each side
//! proves knowledge of it by sending `HMAC(secret, label || 0 || prover_nonce ||
//! verifier_nonce)`. The server uses [`SERVER_LABEL`], the client [`CLIENT_LABEL`], so a
//! proof reflected back at its sender does not verify; binding both nonces makes a proof
//! useless outside the handshake it was made for. Verification is constant-time.

use hmac::{Hmac, Mac};
use rand::RngCore;
use sha2::Sha256;
use subtle::ConstantTimeEq;

/// Label of proofs made by the accepting (server) side.
pub const SERVER_LABEL: &str = "kvferry-server";
/// Label of proofs made by the connecting (client) side.
pub const CLIENT_LABEL: &str = "kvferry-client";

/// A fresh 32-byte random nonce from the OS-seeded thread RNG.
pub fn nonce() -> [u8; 32] {
    let mut n = [0u8; 32];
    rand::thread_rng().fill_bytes(&mut n);
    n
}

/// The proof the prover sends: `ours` is the prover's nonce, `theirs` the verifier's.
pub fn proof(secret: &[u8], label: &str, ours: &[u8; 32], theirs: &[u8; 32]) -> [u8; 32] {
    // HMAC is defined for keys of any length: this cannot fail.
    let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(secret).expect("HMAC accepts any key length");
    mac.update(label.as_bytes());
    mac.update(&[0]);
    mac.update(ours);
    mac.update(theirs);
    mac.finalize().into_bytes().into()
}

/// Checks a proof in constant time. `ours` and `theirs` are from the *prover's* point
/// of view, exactly as passed to [`proof`]: the verifier passes the peer's nonce as
/// `ours` and its own as `theirs`.
pub fn verify(secret: &[u8], label: &str, ours: &[u8; 32], theirs: &[u8; 32], proof_bytes: &[u8; 32]) -> bool {
    proof(secret, label, ours, theirs).ct_eq(proof_bytes).into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn right_secret_verifies() {
        let (c, s) = (nonce(), nonce());
        let p = proof(b"secret", SERVER_LABEL, &s, &c);
        assert!(verify(b"secret", SERVER_LABEL, &s, &c, &p));
    }

    #[test]
    fn wrong_secret_fails() {
        let (c, s) = (nonce(), nonce());
        let p = proof(b"secret", SERVER_LABEL, &s, &c);
        assert!(!verify(b"Secret", SERVER_LABEL, &s, &c, &p));
        assert!(!verify(b"", SERVER_LABEL, &s, &c, &p));
    }

    #[test]
    fn reflected_proof_fails() {
        let (c, s) = (nonce(), nonce());
        // A client proof replayed as a server proof (swapped label) fails.
        let p = proof(b"secret", CLIENT_LABEL, &c, &s);
        assert!(!verify(b"secret", SERVER_LABEL, &c, &s, &p));
        // Swapping the nonces fails too.
        assert!(!verify(b"secret", CLIENT_LABEL, &s, &c, &p));
        assert!(verify(b"secret", CLIENT_LABEL, &c, &s, &p));
    }

    #[test]
    fn nonces_differ() {
        assert_ne!(nonce(), nonce());
    }
}
