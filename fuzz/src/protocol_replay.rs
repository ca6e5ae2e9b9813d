//! Replays `protocol_sequence` inputs without libFuzzer (no nightly needed): every file
//! named, or every file in every directory named, runs through the same driver and
//! accounting check as the fuzz target. Exits non-zero on the first failure.
//!
//! ```sh
//! cd fuzz && cargo run --release --bin protocol_replay -- seeds/protocol_sequence
//! ```

mod protocol_input;

use std::path::PathBuf;

fn main() {
    let mut files: Vec<PathBuf> = Vec::new();
    for arg in std::env::args_os().skip(1) {
        let p = PathBuf::from(arg);
        if p.is_dir() {
            let mut entries: Vec<PathBuf> = std::fs::read_dir(&p)
                .unwrap_or_else(|e| panic!("reading {}: {e}", p.display()))
                .map(|e| e.expect("a directory entry").path())
                .filter(|p| p.is_file())
                .collect();
            entries.sort();
            files.extend(entries);
        } else {
            files.push(p);
        }
    }
    if files.is_empty() {
        eprintln!("usage: protocol_replay <input file or corpus directory>...");
        std::process::exit(2);
    }
    for f in &files {
        let data = std::fs::read(f).unwrap_or_else(|e| panic!("reading {}: {e}", f.display()));
        let t = std::time::Instant::now();
        protocol_input::run(&data);
        println!(
            "ok  {} ({} ops, {:?})",
            f.display(),
            protocol_input::ops(&data).len(),
            t.elapsed()
        );
    }
    println!("{} inputs replayed, all accounted", files.len());
}
