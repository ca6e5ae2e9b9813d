//! Checksum throughput of each crc32c implementation this CPU can run, over a 1 MiB
//! buffer cut into the piece sizes the receive path checksums (one layer's K or V of
//! a block up to a whole chunk), and which one `kvferry` picks here.
//!
//! `cargo run --release --example checksum_speed` — figures in docs/benchmarks.md.

use std::time::Instant;

use kvferry::checksum::{append_with, backend, Backend};

fn main() {
    let buf: Vec<u8> = (0..1u32 << 20)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 11) as u8)
        .collect();
    println!("chosen here: {:?}", backend());
    println!(
        "{:>8} {:>18} {:>18} {:>18}",
        "piece", "FoldClmul GB/s", "Crc32Instr GB/s", "FoldAvx2 GB/s"
    );
    for piece in [4096usize, 16 << 10, 64 << 10, 1 << 20] {
        let mut row = format!("{:>7}K", piece >> 10);
        for b in [Backend::FoldClmul, Backend::Crc32Instruction, Backend::FoldAvx2] {
            if append_with(b, 0, &buf[..piece]).is_none() {
                row += &format!(" {:>18}", "n/a");
                continue;
            }
            let mut best = f64::MAX;
            for _ in 0..7 {
                let t = Instant::now();
                let mut acc = 0u32;
                for _ in 0..64 {
                    for p in buf.chunks(piece) {
                        acc ^= append_with(b, acc, p).unwrap_or(0);
                    }
                }
                std::hint::black_box(acc);
                best = best.min(t.elapsed().as_secs_f64());
            }
            row += &format!(" {:>18.1}", 64.0 * buf.len() as f64 / best / 1e9);
        }
        println!("{row}");
    }
}
