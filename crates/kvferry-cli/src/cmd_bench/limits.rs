//! Limits measured in the same run as the transfer benchmark, in plain code that uses
//! nothing of kvferry's data path:
//!
//! - **raw TCP** ([`tcp_limit`]): plain loopback connections moving the same bytes, no
//!   framing, no checksums; the only copies are the kernel's. This is the limit.
//!   Measured twice: sending the producers' amount of memory chunk by chunk (the same
//!   bytes, as cold in cache as the transfers') and re-sending one hot 4 MiB buffer.
//! - **memcpy** ([`memcpy_limit`]): one thread copying a large buffer.
//! - **one-copy same-host** ([`cma_limit`]): plain `process_vm_readv` of the same
//!   chunks from the producer process, as many threads as the consumer copies with.
//! - **staged pipeline** ([`pipeline_limit`]): the per-byte work the design mandates and
//!   nothing else — per chunk the sender gathers the chunk's pieces from a source region
//!   into a staging buffer with `memcpy` and writes it to a plain socket; the receiver
//!   reads it into a staging buffer and scatters it into a destination with `memcpy`. No
//!   checksums, framing, leases, verification or runtime. It is a reference for what
//!   copy-before-advertise staging plus landing costs on this machine, not a proof of
//!   an upper bound (streaming it in sub-chunk pieces measured no different).

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Instant;

use std::sync::Arc;

use kvferry::layout::KvLayout;

/// Raw loopback TCP: `conns` plain connections moving `bytes` in total, no framing, no
/// checksums, no copies beyond the kernel's.
///
/// With `source: None` every writer sends one 4 MiB buffer over and over and every
/// reader reads into one 4 MiB buffer: both stay in cache, the most flattering limit.
/// With `source: Some((memory, piece, destination))` the writers send `memory` in turn,
/// `piece` bytes per write, and the readers fill `piece`-sized slots of a destination of
/// `destination` bytes in all (each its share, in huge pages like the consumer's
/// region, slot after slot): the same bytes as the transfers, landing in memory as
/// large as theirs.
pub async fn tcp_limit(conns: usize, bytes: u64, source: Option<(&Arc<Vec<u8>>, usize, usize)>) -> anyhow::Result<f64> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (data, piece, destination) = match source {
        Some((memory, piece, destination)) => (memory.clone(), piece, destination),
        None => (Arc::new(vec![0x5Au8; 4 << 20]), 4 << 20, 0),
    };
    // Each reader's slots (at least one), allocated and touched before the clock.
    let share = (destination / conns / piece.max(1)).max(1);
    let mut buffers: Vec<Vec<u8>> = (0..conns).map(|_| huge_source(share * piece)).collect();
    let source_len = data.len();
    anyhow::ensure!(
        piece >= 1 && source_len >= piece,
        "tcp limit: source smaller than a piece"
    );
    let pieces = source_len / piece;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let per = bytes / conns as u64;
    let server = tokio::spawn(async move {
        let mut readers = Vec::new();
        for _ in 0..conns {
            let (mut s, _) = listener.accept().await?;
            let mut buf = buffers.pop().expect("one buffer per connection");
            readers.push(tokio::spawn(async move {
                let (mut slot, mut filled, mut got) = (0usize, 0usize, 0u64);
                while got < per {
                    let at = slot * piece + filled;
                    let n = s.read(&mut buf[at..(slot + 1) * piece]).await?;
                    if n == 0 {
                        break;
                    }
                    got += n as u64;
                    filled += n;
                    if filled == piece {
                        (slot, filled) = ((slot + 1) % share, 0);
                    }
                }
                std::io::Result::Ok(got)
            }));
        }
        let mut total = 0;
        for r in readers {
            total += r.await??;
        }
        std::io::Result::Ok(total)
    });
    let t = Instant::now();
    let mut writers = Vec::new();
    for w in 0..conns {
        let data = data.clone();
        writers.push(tokio::spawn(async move {
            let mut s = tokio::net::TcpStream::connect(addr).await?;
            s.set_nodelay(true)?;
            let mut sent = 0u64;
            let mut i = w;
            while sent < per {
                let at = (i % pieces) * piece;
                let n = (per - sent).min(piece as u64) as usize;
                s.write_all(&data[at..at + n]).await?;
                sent += n as u64;
                i += conns;
            }
            std::io::Result::Ok(())
        }));
    }
    for w in writers {
        w.await??;
    }
    let total = server.await??;
    Ok(total as f64 / t.elapsed().as_secs_f64() / 1e9)
}

/// `len` bytes of a fixed pattern for the same-bytes limits, in transparent huge pages
/// where the kernel grants them — as the producers' regions are (kvferry's host memory
/// asks for them), so that the limits do not pay TLB misses the transfers do not.
pub fn huge_source(len: usize) -> Vec<u8> {
    // Zeroed: a fresh anonymous mapping for a large buffer, not yet faulted in.
    let mut v = vec![0u8; len];
    const HUGE: usize = 2 << 20;
    let start = (v.as_ptr() as usize).next_multiple_of(HUGE);
    let end = (v.as_ptr() as usize + len) / HUGE * HUGE;
    if end > start {
        // SAFETY: [start, end) lies inside `v`'s allocation, which outlives the call;
        // MADV_HUGEPAGE only changes how the kernel backs those pages, not their
        // contents or validity. Its failure (THP off) is harmless and ignored.
        unsafe {
            libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE);
        }
    }
    for (i, b) in v.iter_mut().enumerate() {
        *b = (i * 31 + 7) as u8;
    }
    v
}

/// Single-thread memcpy of `bytes` (best of 3).
pub fn memcpy_limit(bytes: usize) -> f64 {
    let src = vec![1u8; bytes];
    let mut dst = vec![2u8; bytes]; // touched now: no page faults in the timing
    let mut best = f64::MAX;
    for _ in 0..3 {
        let t = Instant::now();
        dst.copy_from_slice(&src);
        std::hint::black_box(&dst);
        best = best.min(t.elapsed().as_secs_f64());
    }
    bytes as f64 / best / 1e9
}

/// The staged pipeline in plain code (see the module docs): `conns` sender/receiver
/// thread pairs over loopback, moving chunks whose pieces are
/// `src_layout.chunk_ranges(blocks)` of `source` laid out by `src_layout` (all of its
/// chunks in turn, so the source is as cold as the benchmark's producer region) and land
/// contiguously. Returns GB/s of chunk bytes landed.
pub fn pipeline_limit(
    src_layout: KvLayout,
    source: &Arc<Vec<u8>>,
    blocks_per_chunk: u32,
    conns: usize,
    bytes: u64,
) -> anyhow::Result<f64> {
    anyhow::ensure!(
        conns >= 1 && blocks_per_chunk >= 1,
        "need a connection and a block per chunk"
    );
    anyhow::ensure!(
        source.len() >= src_layout.region_bytes(),
        "pipeline limit: source smaller than its layout"
    );
    let src_chunks = src_layout.blocks / blocks_per_chunk;
    anyhow::ensure!(src_chunks >= 1, "source layout too small for the pipeline limit");
    let ranges: Vec<Vec<(usize, usize)>> = (0..src_chunks)
        .map(|c| {
            let blocks: Vec<u32> = (0..blocks_per_chunk).map(|b| c * blocks_per_chunk + b).collect();
            src_layout.chunk_ranges(&blocks)
        })
        .collect::<Result<_, _>>()?;
    let chunk_bytes = src_layout.block_bytes() * blocks_per_chunk as usize;
    let chunks_per_conn = (bytes / chunk_bytes as u64 / conns as u64).max(1);
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;

    let mut pairs = Vec::new();
    for _ in 0..conns {
        let tx = TcpStream::connect(addr)?;
        let (rx, _) = listener.accept()?;
        tx.set_nodelay(true)?;
        pairs.push((tx, rx));
    }
    let start = Arc::new(std::sync::Barrier::new(2 * conns + 1));
    let mut threads = Vec::new();
    for (i, (mut tx, mut rx)) in pairs.into_iter().enumerate() {
        let (source, ranges, start_tx, start_rx) = (source.clone(), ranges.clone(), start.clone(), start.clone());
        threads.push(std::thread::spawn(move || -> std::io::Result<()> {
            let mut staging = vec![1u8; chunk_bytes]; // touched: no page faults in the timing
            start_tx.wait();
            for n in 0..chunks_per_conn {
                let mut at = 0;
                let c = (i as u64 + n * conns as u64) % ranges.len() as u64;
                for &(off, len) in &ranges[c as usize] {
                    staging[at..at + len].copy_from_slice(&source[off..off + len]);
                    at += len;
                }
                tx.write_all(&staging)?;
            }
            Ok(())
        }));
        threads.push(std::thread::spawn(move || -> std::io::Result<()> {
            let mut staging = vec![1u8; chunk_bytes];
            let mut destination = vec![1u8; chunk_bytes];
            start_rx.wait();
            for _ in 0..chunks_per_conn {
                rx.read_exact(&mut staging)?;
                destination.copy_from_slice(&staging);
                std::hint::black_box(&destination);
            }
            Ok(())
        }));
    }
    start.wait();
    let t = Instant::now();
    for th in threads {
        th.join()
            .map_err(|_| anyhow::anyhow!("pipeline-limit thread panicked"))??;
    }
    let secs = t.elapsed().as_secs_f64();
    Ok((chunks_per_conn * conns as u64 * chunk_bytes as u64) as f64 / secs / 1e9)
}

/// The one-copy same-host limit: `threads` plain threads reading `bytes` in all from
/// process `pid` with `process_vm_readv`, chunk by chunk (`chunks[i]` is chunk `i`'s
/// `(remote address, length)` runs, all of them in turn, thread `t` taking chunks `t`,
/// `t + threads`, …), into `slots` chunk-sized destination slots in all (as large as
/// the consumer's destination — a slot per chunk of every transfer in flight — and,
/// like its region, in memory that asks for huge pages), each thread rotating over its
/// share. No protocol: what the kernel's one copy costs on this machine.
/// With `verify`, each thread also takes the crc32c of every chunk it read right
/// after reading it (kvferry's own checksum, as the consumer verifies what landed):
/// the one-copy limit of a mover that verifies every byte. Returns GB/s.
pub fn cma_limit(
    pid: u32,
    chunks: &Arc<Vec<Vec<(usize, usize)>>>,
    threads: usize,
    slots: usize,
    bytes: u64,
    verify: bool,
) -> anyhow::Result<f64> {
    anyhow::ensure!(!chunks.is_empty() && threads >= 1, "cma limit: no chunks or threads");
    let chunk_bytes: usize = chunks[0].iter().map(|r| r.1).sum();
    anyhow::ensure!(chunk_bytes > 0, "cma limit: empty chunks");
    let per_thread = (bytes / chunk_bytes as u64 / threads as u64).max(1);
    let start = Arc::new(std::sync::Barrier::new(threads + 1));
    let mut handles = Vec::new();
    for t in 0..threads {
        let (chunks, start) = (chunks.clone(), start.clone());
        handles.push(std::thread::spawn(move || -> anyhow::Result<u64> {
            let share = (slots / threads).max(1);
            // Huge pages, as the consumer's destination region asks for, and touched:
            // no page faults in the timing.
            let mut slots = huge_source(share * chunk_bytes);
            start.wait();
            let mut moved = 0u64;
            for n in 0..per_thread {
                let s = n as usize % share;
                let dst = &mut slots[s * chunk_bytes..(s + 1) * chunk_bytes];
                let runs = &chunks[(t as u64 + n * threads as u64) as usize % chunks.len()];
                let mut at = 0usize;
                for batch in runs.chunks(1024) {
                    let len: usize = batch.iter().map(|r| r.1).sum();
                    let remote: Vec<libc::iovec> = batch
                        .iter()
                        .map(|&(addr, len)| libc::iovec {
                            iov_base: addr as *mut libc::c_void,
                            iov_len: len,
                        })
                        .collect();
                    anyhow::ensure!(at + len <= dst.len(), "cma limit: chunks of different sizes");
                    let local = libc::iovec {
                        iov_base: dst[at..].as_mut_ptr().cast(),
                        iov_len: len,
                    };
                    // SAFETY: `local` names `len` bytes of `dst`, ours and unshared for
                    // the call; `remote` names the other process's memory, which the
                    // kernel checks and reads on our behalf (never dereferenced here);
                    // both arrays outlive the call, `remote` holds at most IOV_MAX.
                    let n = unsafe {
                        libc::process_vm_readv(
                            pid as libc::pid_t,
                            &local,
                            1,
                            remote.as_ptr(),
                            remote.len() as libc::c_ulong,
                            0,
                        )
                    };
                    if n < 0 {
                        anyhow::bail!(
                            "process_vm_readv from process {pid}: {}",
                            std::io::Error::last_os_error()
                        );
                    }
                    anyhow::ensure!(n as usize == len, "process_vm_readv from process {pid}: short read");
                    at += len;
                }
                if verify {
                    std::hint::black_box(kvferry::checksum::checksum(dst));
                }
                std::hint::black_box(&*dst);
                moved += at as u64;
            }
            Ok(moved)
        }));
    }
    start.wait();
    let t = Instant::now();
    let mut moved = 0u64;
    for h in handles {
        moved += h.join().map_err(|_| anyhow::anyhow!("cma-limit thread panicked"))??;
    }
    Ok(moved as f64 / t.elapsed().as_secs_f64() / 1e9)
}
