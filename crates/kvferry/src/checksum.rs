//! crc32c (Castagnoli), the checksum of every frame, bulk block and staged chunk:
//! computing it ([`checksum`], [`append`]) and combining partial checksums
//! ([`combine`]).
//!
//! A leaf: it depends on nothing else in the crate, so every layer may use it — `mem`
//! (region checksums), `copy` (checksums taken by the copy threads), `wire` (frames).
//!
//! Computing picks, once per process, the fastest of three implementations for the CPU
//! it runs on ([`backend`]):
//! - `crc-fast`, which folds with carry-less multiplication, where the CPU has the
//!   512-bit form (AVX-512 VL + VPCLMULQDQ): 72 GB/s on 128 KiB pieces on such a
//!   machine, four times the `crc32` instruction;
//! - where the CPU has the 256-bit form but not AVX-512 (AMD Zen 3, Intel client
//!   cores), our own [`fold_avx2`]: 256-bit folding beside three `crc32`-instruction
//!   streams. `crc-fast` falls back to 128-bit PCLMUL there (13.0 GB/s on 4 KiB pieces
//!   on an AMD EPYC), the `crc32c` crate reaches 14–17 GB/s, `fold_avx2` 21–27
//!   (measured 2026-12-04 with `cargo run --release -p kvferry --example
//!   checksum_speed`; the receive path checksums every landed byte once, in pieces as
//!   small as one layer's K or V of a block, so this is a tenth of the transfer phase's
//!   CPU there);
//! - elsewhere on x86-64 the `crc32c` crate's three-way interleaved `crc32` loop.
//!
//! All give the same value (the tests check each against the others and against the
//! standard check value); the choice only changes speed.
//!
//! Combining: the crc32c of `A ‖ B` from `crc(A)`, `crc(B)` and `len(B)`.
//!
//! `crc(A ‖ B) = crc(A) · x^(8·len(B)) mod P  ⊕  crc(B)` over GF(2), in the reflected
//! bit order crc32c uses. `x^(8·n) mod P` is built by square-and-multiply from a
//! compile-time table of `x^(2^k) mod P`, so a combination costs one or two dozen
//! 32-bit carry-less multiplications modulo P — microseconds less than the
//! matrix-squaring method, which matters when a chunk's checksum is assembled from the
//! partial checksums of the copy threads.

use std::sync::OnceLock;

use crc_fast::{CrcAlgorithm, Digest};

#[cfg(target_arch = "x86_64")]
mod fold_avx2;

/// Which implementation computes checksums in this process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// `crc-fast`: carry-less-multiplication folding (chosen where the CPU has
    /// AVX-512 VL and VPCLMULQDQ, and on non-x86 CPUs).
    FoldClmul,
    /// Our 256-bit VPCLMULQDQ fold ([`fold_avx2`]; chosen on x86-64 CPUs with AVX2 and
    /// VPCLMULQDQ but not AVX-512 VL).
    FoldAvx2,
    /// The `crc32c` crate: the hardware `crc32` instruction, three streams interleaved
    /// (chosen on x86-64 CPUs without any wide carry-less multiply).
    Crc32Instruction,
}

impl Backend {
    /// Every implementation, in the order [`Backend::name`] lists them.
    pub const ALL: [Backend; 3] = [Backend::FoldClmul, Backend::FoldAvx2, Backend::Crc32Instruction];

    /// The name `KVFERRY_CRC32C` takes and benchmarks report: `fold-clmul`,
    /// `fold-avx2` or `crc32-instruction`.
    pub fn name(self) -> &'static str {
        match self {
            Backend::FoldClmul => "fold-clmul",
            Backend::FoldAvx2 => "fold-avx2",
            Backend::Crc32Instruction => "crc32-instruction",
        }
    }
}

/// The implementation [`checksum`] and [`append`] use, detected once per process from
/// the CPU's features. `KVFERRY_CRC32C=fold-clmul|fold-avx2|crc32-instruction` forces
/// one (for A/B measurements); a name this CPU cannot run, or an unknown one, is
/// ignored with a warning on stderr and detection decides.
pub fn backend() -> Backend {
    static CHOSEN: OnceLock<Backend> = OnceLock::new();
    *CHOSEN.get_or_init(|| {
        if let Ok(name) = std::env::var("KVFERRY_CRC32C") {
            let forced = Backend::ALL.into_iter().find(|b| b.name() == name);
            match forced {
                Some(b) if append_with(b, 0, b"123456789") == Some(0xE306_9283) => return b,
                _ => eprintln!(
                    "kvferry: KVFERRY_CRC32C={name:?} is not one of fold-clmul, fold-avx2, \
                     crc32-instruction that this CPU runs; detecting instead"
                ),
            }
        }
        detect()
    })
}

/// The fastest implementation for this CPU.
fn detect() -> Backend {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512vl") && std::arch::is_x86_feature_detected!("vpclmulqdq") {
            Backend::FoldClmul
        } else if fold_avx2::supported() {
            Backend::FoldAvx2
        } else if std::arch::is_x86_feature_detected!("sse4.2") {
            Backend::Crc32Instruction
        } else {
            Backend::FoldClmul
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        Backend::FoldClmul
    }
}

/// The crc32c of `data`.
#[inline]
pub fn checksum(data: &[u8]) -> u32 {
    match backend() {
        Backend::FoldClmul => crc_fast::crc32_iscsi(data),
        Backend::Crc32Instruction => crc32c::crc32c(data),
        Backend::FoldAvx2 => avx2_append(0, data),
    }
}

/// The crc32c of `A ‖ data`, given `crc = crc32c(A)` (`append(0, d) == checksum(d)`).
#[inline]
pub fn append(crc: u32, data: &[u8]) -> u32 {
    if data.is_empty() {
        return crc;
    }
    match backend() {
        Backend::FoldClmul => fold_append(crc, data),
        Backend::Crc32Instruction => crc32c::crc32c_append(crc, data),
        Backend::FoldAvx2 => avx2_append(crc, data),
    }
}

/// [`append`] through a named implementation, or `None` where this CPU cannot run it:
/// for benchmarks and tests that compare them (`cargo run --release --example
/// checksum_speed`).
pub fn append_with(backend: Backend, crc: u32, data: &[u8]) -> Option<u32> {
    match backend {
        Backend::FoldClmul => Some(fold_append(crc, data)),
        Backend::Crc32Instruction => Some(crc32c::crc32c_append(crc, data)),
        #[cfg(target_arch = "x86_64")]
        Backend::FoldAvx2 => fold_avx2::supported().then(|| {
            // SAFETY: `supported()` just confirmed every CPU feature `append_raw` is
            // compiled for.
            !unsafe { fold_avx2::append_raw(!crc, data) }
        }),
        #[cfg(not(target_arch = "x86_64"))]
        Backend::FoldAvx2 => None,
    }
}

/// [`append`] through [`fold_avx2`]; only reached where [`backend`] chose it.
#[inline]
fn avx2_append(crc: u32, data: &[u8]) -> u32 {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: `backend()` returns `FoldAvx2` only after `fold_avx2::supported()`
        // confirmed every CPU feature `append_raw` is compiled for.
        !unsafe { fold_avx2::append_raw(!crc, data) }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        crc32c::crc32c_append(crc, data)
    }
}

/// [`append`] through `crc-fast`.
fn fold_append(crc: u32, data: &[u8]) -> u32 {
    // crc32c's register is the complement of the published value (init and xorout are
    // both all ones), so resuming from `crc` starts from `!crc`.
    let mut d = Digest::new_with_init_state(CrcAlgorithm::Crc32Iscsi, u64::from(!crc));
    d.update(data);
    d.finalize() as u32
}

/// The crc32c polynomial, reflected.
const POLY: u32 = 0x82F6_3B78;

/// `a · b mod P` in the reflected representation (bit 31 is x^0).
const fn mul_mod_p(a: u32, mut b: u32) -> u32 {
    let mut m: u32 = 1 << 31;
    let mut p: u32 = 0;
    while m != 0 {
        if a & m != 0 {
            p ^= b;
        }
        m >>= 1;
        b = if b & 1 != 0 { (b >> 1) ^ POLY } else { b >> 1 };
    }
    p
}

/// `X2N[k] = x^(2^k) mod P`.
const X2N: [u32; 32] = {
    let mut t = [0u32; 32];
    let mut p: u32 = 1 << 30; // x^1
    let mut k = 0;
    while k < 32 {
        t[k] = p;
        p = mul_mod_p(p, p);
        k += 1;
    }
    t
};

/// `x^(n · 2^k) mod P` (reflected); `const` for `fold_avx2`'s compile-time constants.
const fn x_pow_mod_p(mut n: u64, mut k: usize) -> u32 {
    let mut p: u32 = 1 << 31; // x^0
    while n != 0 {
        if n & 1 != 0 {
            p = mul_mod_p(X2N[k & 31], p);
        }
        n >>= 1;
        k += 1;
    }
    p
}

/// The crc32c of `A ‖ B`, given `crc1 = crc32c(A)`, `crc2 = crc32c(B)` and `len2 = |B|`.
pub fn combine(crc1: u32, crc2: u32, len2: usize) -> u32 {
    mul_mod_p(x_pow_mod_p(len2 as u64, 3), crc1) ^ crc2
}

/// [`combine`] for one fixed `len2`, by four table lookups instead of a bitwise
/// multiply: for folding many crcs of equal-length parts (a few ns each). The tables
/// (4 KiB) are computed at compile time: `T[j][v] = x^(8·len2) · (v << 8j) mod P`,
/// which sums over the four bytes of `crc1` to `x^(8·len2) · crc1` since the product
/// is linear in `crc1`.
pub struct FixedCombine {
    tables: [[u32; 256]; 4],
}

impl FixedCombine {
    /// The combiner for parts of `len2` bytes.
    pub const fn new(len2: usize) -> FixedCombine {
        let k = x_pow_mod_p(len2 as u64, 3);
        let mut tables = [[0u32; 256]; 4];
        let mut j = 0;
        while j < 4 {
            let mut v = 0;
            while v < 256 {
                tables[j][v] = mul_mod_p(k, (v as u32) << (8 * j));
                v += 1;
            }
            j += 1;
        }
        FixedCombine { tables }
    }

    /// `combine(crc1, crc2, len2)` for this combiner's `len2`.
    #[inline]
    pub fn combine(&self, crc1: u32, crc2: u32) -> u32 {
        let t = &self.tables;
        t[0][(crc1 & 0xFF) as usize]
            ^ t[1][((crc1 >> 8) & 0xFF) as usize]
            ^ t[2][((crc1 >> 16) & 0xFF) as usize]
            ^ t[3][(crc1 >> 24) as usize]
            ^ crc2
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(n: usize) -> Vec<u8> {
        (0..n as u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 11) as u8)
            .collect()
    }

    #[test]
    fn fixed_combine_equals_combine() {
        let data = sample(3 * 4096 + 100);
        for len in [1usize, 7, 64, 4096, 3 * 4096 + 100] {
            let fixed = FixedCombine::new(len);
            for crc1 in [0u32, 1, 0xDEAD_BEEF, 0xFFFF_FFFF, 0x8000_0001] {
                let crc2 = checksum(&data[..len]);
                assert_eq!(
                    fixed.combine(crc1, crc2),
                    combine(crc1, crc2, len),
                    "len {len} crc1 {crc1:#x}"
                );
            }
        }
        // Folding equal parts gives the crc of their concatenation.
        let unit = FixedCombine::new(4096);
        let folded = data[..3 * 4096]
            .chunks(4096)
            .fold(0u32, |acc, part| unit.combine(acc, checksum(part)));
        assert_eq!(folded, checksum(&data[..3 * 4096]));
    }

    #[test]
    fn checksum_and_append_match_the_crc32c_crate() {
        let data = sample(70_000);
        assert_eq!(checksum(b"123456789"), 0xE306_9283, "the crc32c check value");
        assert_eq!(checksum(b""), 0);
        for n in [0, 1, 15, 16, 63, 64, 65, 255, 256, 257, 4095, 4096, 65_537, 70_000] {
            assert_eq!(checksum(&data[..n]), crc32c::crc32c(&data[..n]), "length {n}");
        }
        for split in [0, 1, 7, 63, 64, 65, 4096, 33_333, 69_999, 70_000] {
            let (a, b) = data.split_at(split);
            assert_eq!(append(checksum(a), b), crc32c::crc32c(&data), "split {split}");
            assert_eq!(
                append(0xDEAD_BEEF, b),
                crc32c::crc32c_append(0xDEAD_BEEF, b),
                "split {split}"
            );
        }
    }

    /// Both implementations, whichever this CPU uses, give the standard values.
    #[test]
    fn both_backends_agree_on_any_length_and_split() {
        let data = sample(70_000);
        assert_eq!(crc_fast::crc32_iscsi(b"123456789"), 0xE306_9283);
        assert_eq!(crc32c::crc32c(b"123456789"), 0xE306_9283);
        for n in [0, 1, 15, 16, 63, 64, 65, 255, 256, 257, 4095, 4096, 65_537, 70_000] {
            assert_eq!(
                crc_fast::crc32_iscsi(&data[..n]),
                crc32c::crc32c(&data[..n]),
                "length {n}"
            );
        }
        for split in [1, 7, 64, 4096, 33_333, 69_999] {
            let (a, b) = data.split_at(split);
            let seed = crc32c::crc32c(a);
            assert_eq!(fold_append(seed, b), crc32c::crc32c_append(seed, b), "split {split}");
            assert_eq!(fold_append(seed, b), crc32c::crc32c(&data), "split {split}");
        }
        // the chosen one is stable for the process
        assert_eq!(backend(), backend());
    }

    proptest::proptest! {
        #[test]
        fn append_agrees_with_the_oracle_on_any_split(
            data in proptest::collection::vec(proptest::num::u8::ANY, 0..5000),
            cut in 0usize..5000,
            seed: u32,
        ) {
            let cut = cut.min(data.len());
            let (a, b) = data.split_at(cut);
            proptest::prop_assert_eq!(append(append(seed, a), b), crc32c::crc32c_append(seed, &data));
        }
    }

    #[test]
    fn combine_matches_the_checksum_of_the_concatenation() {
        let data: Vec<u8> = (0..100_000u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 11) as u8)
            .collect();
        for split in [0, 1, 7, 4096, 33_333, 99_999, 100_000] {
            let (a, b) = data.split_at(split);
            assert_eq!(
                combine(crc32c::crc32c(a), crc32c::crc32c(b), b.len()),
                crc32c::crc32c(&data),
                "split {split}"
            );
            assert_eq!(
                combine(crc32c::crc32c(a), crc32c::crc32c(b), b.len()),
                crc32c::crc32c_combine(crc32c::crc32c(a), crc32c::crc32c(b), b.len())
            );
        }
        // Folding many pieces from 0 equals the whole.
        let mut acc = 0;
        for piece in data.chunks(3000) {
            acc = combine(acc, crc32c::crc32c(piece), piece.len());
        }
        assert_eq!(acc, crc32c::crc32c(&data));
    }

    /// What the benchmark's verification relies on: a checksum combined from the
    /// pieces' checksums (as the receive path takes them) tells a chunk with one
    /// damaged byte, wherever it is, from the intact one.
    #[test]
    fn a_combined_checksum_detects_one_corrupted_byte_in_any_piece() {
        let data = sample(3 * 4096 + 100);
        let want = checksum(&data);
        let combined = |d: &[u8]| d.chunks(4096).fold(0, |acc, p| combine(acc, checksum(p), p.len()));
        assert_eq!(combined(&data), want);
        for at in [0, 1, 4095, 4096, 8191, 9000, data.len() - 1] {
            for flip in [0x01u8, 0x80, 0xFF] {
                let mut bad = data.clone();
                bad[at] ^= flip;
                assert_ne!(combined(&bad), want, "byte {at} xor {flip:#x} went unnoticed");
            }
        }
    }
}
