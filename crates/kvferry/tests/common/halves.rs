//! Checking a selected get that took the second half of every piece (a decode rank's
//! share of the heads) of some source blocks into half-size destination pieces.

/// `got` is a layer-separate destination of `blocks` blocks whose piece `p` of block
/// `b` lies at `(p * blocks + b) * piece / 2`, `src` the source of the same
/// arrangement with `piece`-byte pieces. Asserts that for every `(source block,
/// destination block)` in `pairs` each of the `pieces` destination pieces holds the
/// second half of its source piece, and that every other destination block is still
/// zero.
pub fn assert_second_halves_landed(
    got: &[u8],
    src: &[u8],
    pairs: &[(usize, usize)],
    pieces: usize,
    blocks: usize,
    piece: usize,
    context: &str,
) {
    let half = piece / 2;
    for &(sb, db) in pairs {
        for p in 0..pieces {
            let s_at = (p * blocks + sb) * piece + half;
            let d_at = (p * blocks + db) * half;
            assert_eq!(
                &got[d_at..d_at + half],
                &src[s_at..s_at + half],
                "{context}: block {sb} piece {p}"
            );
        }
    }
    for db in (0..blocks).filter(|b| !pairs.iter().any(|&(_, d)| d == *b)) {
        for p in 0..pieces {
            let d_at = (p * blocks + db) * half;
            assert!(
                got[d_at..d_at + half].iter().all(|b| *b == 0),
                "{context}: block {db} piece {p} untouched"
            );
        }
    }
}
