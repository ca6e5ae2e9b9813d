//! crc32c for x86-64 CPUs that have the 256-bit carry-less multiply (AVX2 +
//! VPCLMULQDQ) but not AVX-512 — AMD Zen 3, Intel Alder Lake and later client cores.
//! Neither well-kept crate is fast there: `crc-fast` takes its wide path only with
//! AVX-512, the `crc32c` crate uses only the `crc32` instruction (one 8-byte step per
//! cycle at best).
//!
//! # The method
//!
//! A crc is linear: the crc of a message depends only on the message as a polynomial
//! over GF(2) modulo P (the Castagnoli polynomial). Each block is cut in four parts
//! that run side by side, on different execution units:
//!
//! - the first part is shrunk by *folding* with carry-less multiplies: the running
//!   state is xored into its first four bytes (a crc from state `s` equals the crc from
//!   zero of the message with `s` xored into its head); [`ACCS`] 256-bit accumulators
//!   (two 128-bit lanes each) load the first [`VEC`] bytes, and each further `VEC`
//!   bytes are absorbed: a lane `L = A·x^64 + B` that `D` more bits follow is congruent
//!   to `A·(x^(64+D) mod P) + B·(x^D mod P)`, a 95-bit value, so it becomes two
//!   carry-less products xored into the lane `D` bits further on; at the end the
//!   accumulators fold into one 128-bit lane, which goes through the `crc32`
//!   instruction from state zero;
//! - the other three parts are equal streams run through the `crc32` instruction from
//!   state zero, [`WORDS`] words per stream per iteration;
//! - the four crcs are combined: `crc(A ‖ B) = crc(A)·x^(8·|B|) ⊕ crc(B)`, the shift
//!   being one carry-less product reduced by the `crc32` instruction ([`shift`]).
//!
//! Every constant `x^n mod P` is computed at compile time from P (`key`,
//! `SHIFT_KEYS`), none is written out. In the reflected bit order the carry-less
//! product of two 64-bit halves lands one bit higher than the polynomial product, so
//! each folding constant is `x^(n-1) mod P`.
//!
//! Speed (`cargo run --release -p kvferry --example checksum_speed`, the 2-core AMD
//! EPYC VM, 2026-12-04): 27–29 GB/s on 64 KiB–1 MiB pieces against 22–23 for the
//! folding alone and 17–21 for the `crc32c` crate; docs/benchmarks.md has the table.

use std::arch::x86_64::{
    __m128i, __m256i, _mm256_castsi256_si128, _mm256_clmulepi64_epi128, _mm256_extracti128_si256, _mm256_lddqu_si256,
    _mm256_set_epi64x, _mm256_setzero_si256, _mm256_xor_si256, _mm_clmulepi64_si128, _mm_crc32_u64, _mm_cvtsi128_si64,
    _mm_cvtsi32_si128, _mm_extract_epi64, _mm_set_epi64x, _mm_xor_si128,
};

/// 256-bit accumulators folded per iteration.
const ACCS: usize = 4;
/// Bytes folded per iteration.
const VEC: usize = ACCS * 32;
/// 8-byte words per `crc32` stream per iteration (three streams of 48 bytes balance
/// 128 folded bytes on Zen 3; 4/4, 4/5, 3/4 and 2/3 measured within noise of it).
const WORDS: usize = 6;
/// Bytes of one stream per iteration.
const STREAM: usize = WORDS * 8;
/// Bytes per iteration: folded part and three streams.
const ITER: usize = VEC + 3 * STREAM;
/// Most iterations per block (the combining constants are tabled up to it): 17 KiB.
const MAX_ITERS: usize = 64;

/// Whether this CPU can run [`append_raw`].
pub fn supported() -> bool {
    std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("vpclmulqdq")
        && std::arch::is_x86_feature_detected!("pclmulqdq")
        && std::arch::is_x86_feature_detected!("sse4.2")
}

/// `x^n mod P` as a 64-bit multiplier: bit `j` holds the coefficient of `x^(63-j)`
/// (the reflected order, in which a 32-bit crc's bit 31 is `x^0`).
const fn key(n: u32) -> u64 {
    (super::x_pow_mod_p(n as u64, 0) as u64) << 32
}

/// The two multipliers that fold a 128-bit lane `D = bits` bits forward: the lane's
/// low half (its high-degree terms) by `x^(64+D)`, its high half by `x^D`, each one
/// power lower for the reflected product's shift.
const fn fold_keys(bits: u32) -> (u64, u64) {
    (key(64 + bits - 1), key(bits - 1))
}

const KEYS_VEC: (u64, u64) = fold_keys(VEC as u32 * 8);
const KEYS_256: (u64, u64) = fold_keys(256);
const KEYS_128: (u64, u64) = fold_keys(128);

/// `x^(8·n - 33) mod P` (reflected), the multiplier that shifts a crc register over
/// `n` zero bytes when the product is reduced through the `crc32` instruction.
const fn shift_key(n: usize) -> u32 {
    super::x_pow_mod_p(8 * n as u64 - 33, 0)
}

/// `SHIFT_KEYS[i - 1][k - 1]` shifts over `k` scalar streams of `i` iterations.
const SHIFT_KEYS: [[u32; 3]; MAX_ITERS] = {
    let mut t = [[0u32; 3]; MAX_ITERS];
    let mut i = 0;
    while i < MAX_ITERS {
        let mut k = 0;
        while k < 3 {
            t[i][k] = shift_key((i + 1) * STREAM * (k + 1));
            k += 1;
        }
        i += 1;
    }
    t
};

/// The crc32c register after `data`, starting from register `state` (no pre- or
/// post-inversion: the published crc32c of `A ‖ data` is `!append_raw(!crc32c(A), data)`).
///
/// Whole blocks of up to [`MAX_ITERS`] iterations go through [`block`]; what is left
/// (less than two iterations, 544 bytes) through the `crc32c` crate.
///
/// # Safety
///
/// The CPU must have AVX2, VPCLMULQDQ, PCLMULQDQ and SSE4.2 ([`supported`]).
#[target_feature(enable = "avx2,vpclmulqdq,pclmulqdq,sse4.2")]
pub unsafe fn append_raw(mut state: u32, data: &[u8]) -> u32 {
    let mut at = 0;
    while data.len() - at >= 2 * ITER {
        let iters = ((data.len() - at) / ITER).min(MAX_ITERS);
        let end = at + iters * ITER;
        state = block(state, &data[at..end], iters);
        at = end;
    }
    !crc32c::crc32c_append(!state, &data[at..])
}

/// One block of `iters` iterations (`block.len() == iters * ITER`): the first
/// `iters * VEC` bytes folded, the rest as three equal `crc32` streams; combined.
#[inline]
#[target_feature(enable = "avx2,vpclmulqdq,pclmulqdq,sse4.2")]
fn block(state: u32, block: &[u8], iters: usize) -> u32 {
    assert!((1..=MAX_ITERS).contains(&iters) && block.len() == iters * ITER);
    let p = block.as_ptr();
    let stream_len = iters * STREAM;
    macro_rules! load256 {
        ($at:expr) => {
            // SAFETY: offsets below the vector part's end (`iters * VEC`, inside
            // `block` by the assertion above) minus 32.
            unsafe { _mm256_lddqu_si256(p.add($at).cast::<__m256i>()) }
        };
    }
    let mut acc = [_mm256_setzero_si256(); ACCS];
    for (i, a) in acc.iter_mut().enumerate() {
        *a = load256!(32 * i);
    }
    acc[0] = _mm256_xor_si256(acc[0], _mm256_set_epi64x(0, 0, 0, i64::from(state)));
    let keys = ymm_keys(KEYS_VEC);
    // Safe slicing for the scalar streams: fixed-size chunks let the compiler drop
    // the bounds checks, and the loads carry none of `read_unaligned`'s debug checks.
    let (s0, rest) = block[iters * VEC..].split_at(stream_len);
    let (s1, s2) = rest.split_at(stream_len);
    let word = |c: &[u8], j: usize| u64::from_le_bytes(c[8 * j..8 * j + 8].try_into().expect("8 bytes"));
    let (mut c0, mut c1, mut c2) = (0u64, 0u64, 0u64);
    let streams = s0
        .chunks_exact(STREAM)
        .zip(s1.chunks_exact(STREAM))
        .zip(s2.chunks_exact(STREAM));
    for (it, ((w0, w1), w2)) in streams.enumerate() {
        if it > 0 {
            for (i, a) in acc.iter_mut().enumerate() {
                *a = fold256(*a, keys, load256!(it * VEC + 32 * i));
            }
        }
        for j in 0..WORDS {
            c0 = _mm_crc32_u64(c0, word(w0, j));
            c1 = _mm_crc32_u64(c1, word(w1, j));
            c2 = _mm_crc32_u64(c2, word(w2, j));
        }
    }
    let k256 = ymm_keys(KEYS_256);
    let mut whole = acc[0];
    for a in &acc[1..] {
        whole = fold256(whole, k256, *a);
    }
    let k128 = _mm_set_epi64x(KEYS_128.1 as i64, KEYS_128.0 as i64);
    let lane = fold128(
        _mm256_castsi256_si128(whole),
        k128,
        _mm256_extracti128_si256::<1>(whole),
    );
    let v = _mm_crc32_u64(0, _mm_cvtsi128_si64(lane) as u64);
    let v = _mm_crc32_u64(v, _mm_extract_epi64::<1>(lane) as u64) as u32;
    let keys = SHIFT_KEYS[iters - 1];
    shift(v, keys[2]) ^ shift(c0 as u32, keys[1]) ^ shift(c1 as u32, keys[0]) ^ c2 as u32
}

/// `crc · x^(8n) mod P`, `key` being [`shift_key`]`(n)`: one carry-less product,
/// reduced by the `crc32` instruction.
#[inline]
#[target_feature(enable = "pclmulqdq,sse4.2")]
fn shift(crc: u32, key: u32) -> u32 {
    let product = _mm_clmulepi64_si128::<0x00>(_mm_cvtsi32_si128(crc as i32), _mm_cvtsi32_si128(key as i32));
    _mm_crc32_u64(0, _mm_cvtsi128_si64(product) as u64) as u32
}

/// A fold's two multipliers in both 128-bit lanes (low half first in each).
#[inline]
#[target_feature(enable = "avx")]
fn ymm_keys((low, high): (u64, u64)) -> __m256i {
    _mm256_set_epi64x(high as i64, low as i64, high as i64, low as i64)
}

/// `acc` folded `keys`' distance forward and xored into `next`, per 128-bit lane.
#[inline]
#[target_feature(enable = "avx2,vpclmulqdq")]
fn fold256(acc: __m256i, keys: __m256i, next: __m256i) -> __m256i {
    let low = _mm256_clmulepi64_epi128::<0x00>(acc, keys);
    let high = _mm256_clmulepi64_epi128::<0x11>(acc, keys);
    _mm256_xor_si256(_mm256_xor_si256(low, high), next)
}

/// [`fold256`] for one 128-bit lane.
#[inline]
#[target_feature(enable = "pclmulqdq,sse2")]
fn fold128(acc: __m128i, keys: __m128i, next: __m128i) -> __m128i {
    let low = _mm_clmulepi64_si128::<0x00>(acc, keys);
    let high = _mm_clmulepi64_si128::<0x11>(acc, keys);
    _mm_xor_si128(_mm_xor_si128(low, high), next)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The published crc32c through this fold, or `None` where the CPU lacks it.
    fn published(seed: u32, data: &[u8]) -> Option<u32> {
        // SAFETY: only called after `supported()` said the CPU has every feature.
        supported().then(|| !unsafe { append_raw(!seed, data) })
    }

    fn skip_note() {
        eprintln!("SKIPPED: this CPU lacks AVX2 + VPCLMULQDQ; the 256-bit fold is not exercised here");
    }

    #[test]
    fn matches_the_oracle_at_every_boundary_length() {
        let data: Vec<u8> = (0..60_000u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        if !supported() {
            return skip_note();
        }
        assert_eq!(published(0, b"123456789"), Some(0xE306_9283));
        let mut lens: Vec<usize> = (0..=4 * ITER + 40).collect();
        lens.extend([
            4095,
            4096,
            4097,
            8192,
            MAX_ITERS * ITER,
            MAX_ITERS * ITER + 1,
            2 * MAX_ITERS * ITER + 2 * ITER - 1,
        ]);
        lens.extend([MAX_ITERS * ITER + 2 * ITER, 3 * MAX_ITERS * ITER + 7, 20_000]);
        // every tabled combining constant
        lens.extend((2..=MAX_ITERS).map(|i| i * ITER + i % 7));
        for n in lens {
            for seed in [0u32, 0xFFFF_FFFF, 0xDEAD_BEEF] {
                assert_eq!(
                    published(seed, &data[..n]),
                    Some(crc32c::crc32c_append(seed, &data[..n])),
                    "length {n}, seed {seed:#x}"
                );
            }
        }
    }

    #[test]
    fn unaligned_starts_give_the_oracle_value() {
        let data: Vec<u8> = (0..9000u32).map(|i| (i ^ (i >> 7)) as u8).collect();
        if !supported() {
            return skip_note();
        }
        for start in 0..64 {
            let piece = &data[start..start + 4096 + start * 3];
            assert_eq!(
                published(7, piece),
                Some(crc32c::crc32c_append(7, piece)),
                "start {start}"
            );
        }
    }

    proptest::proptest! {
        #[test]
        fn agrees_with_the_oracle_on_random_input(
            data in proptest::collection::vec(proptest::num::u8::ANY, 0..6000),
            skip in 0usize..64,
            seed: u32,
        ) {
            let piece = &data[skip.min(data.len())..];
            if let Some(got) = published(seed, piece) {
                proptest::prop_assert_eq!(got, crc32c::crc32c_append(seed, piece));
            }
        }
    }
}
