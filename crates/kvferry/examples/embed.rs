//! Embedding kvferry in an inference engine: a **prefill** engine publishes blocks of
//! its KV cache; a **decode** engine fetches them into blocks of its own cache, once
//! with the async `get` and once with the synchronous `get_blocking` from a plain
//! thread (as a scheduler loop that is not async would). Both engines live in this
//! one process and talk over real loopback sockets.
//!
//! ```sh
//! cargo run -p kvferry --example embed
//! ```
//!
//! It verifies every landed byte and exits non-zero if anything mismatches, or if an
//! engine reports something still outstanding when it is closed.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use kvferry::engine::{Engine, EngineConfig};
use kvferry::layout::KvCache;
use kvferry::mem::Region;
use kvferry::peer::{Destination, ReleaseReason};
use kvferry::wire::ChunkKey;
use tokio::time::Instant;

/// Bytes per KV block (a real engine: tokens_per_block x layers x K/V x heads x dim x
/// element size; kvferry only needs the block size and where blocks live).
const BLOCK_BYTES: usize = 16 << 10;
/// Blocks in each engine's cache.
const BLOCKS: usize = 64;

/// A small engine: loopback on an ephemeral port, an 8 MiB staging arena (the direct
/// path used here needs no staging; staged gets and `put` would).
fn config(name: &str) -> EngineConfig {
    EngineConfig::default().peer_id(name).arena(8 << 20, 256 << 10)
}

/// Recognisable content for block `b` of the prefill cache.
fn block_bytes(b: usize) -> Vec<u8> {
    (0..BLOCK_BYTES).map(|i| (b * 131 + i * 7 + i / 251) as u8).collect()
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> ExitCode {
    match run().await {
        Ok(()) => {
            println!("embed: ok");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("embed: FAILED: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run() -> Result<(), Box<dyn std::error::Error>> {
    // 1. Two engines. `Engine::start` must run inside a tokio runtime: its server,
    //    TTL sweeper and transfer tasks run there.
    let prefill = Engine::start(config("prefill")).await?;
    let decode = Engine::start(config("decode")).await?;
    let prefill_addr = prefill.address().ok_or("prefill engine does not listen")?.to_string();
    println!("prefill serving on {prefill_addr}; decode is {}", decode.peer_id());

    // 2. The prefill side's KV cache: one buffer of BLOCKS consecutive blocks. A real
    //    engine registers its own memory (`Region::from_raw`), or several per-layer
    //    tensors with `KvCache::new`; here it is a host buffer we fill ourselves.
    let src_mem = Arc::new(Region::host("prefill-kv", BLOCKS * BLOCK_BYTES)?);
    for b in 0..BLOCKS {
        src_mem.write(b * BLOCK_BYTES, &block_bytes(b))?;
    }
    let src = prefill.register(KvCache::contiguous(src_mem.clone(), BLOCK_BYTES)?)?;

    // 3. "Prefill finished" for two requests: publish their blocks under chunk keys
    //    (zero copy: nothing is copied now, the blocks are sent straight from the
    //    cache). `once`: released by the first consumer's Done. The engine must not
    //    overwrite these blocks until `take_released` reports them.
    let req_a = ChunkKey::from_name("request-a/prefix-0");
    let req_b = ChunkKey::from_name("request-b/prefix-0");
    let (blocks_a, blocks_b) = ([3u32, 4, 5], [10u32, 11]);
    prefill.publish(req_a, &src, &blocks_a, Duration::from_secs(5), true)?;
    prefill.publish(req_b, &src, &blocks_b, Duration::from_secs(5), true)?;

    // 4. The decode side's cache, into which the blocks land (at other block ids).
    let dst_mem = Arc::new(Region::host("decode-kv", BLOCKS * BLOCK_BYTES)?);
    let dst = decode.register(KvCache::contiguous(dst_mem.clone(), BLOCK_BYTES)?)?;

    // 5a. Async get, on the direct path: the socket reads straight into blocks 20..23
    //     of the decode cache, every chunk's checksum verified as it arrives.
    let deadline = Instant::now() + Duration::from_secs(5);
    let landed = decode
        .get(
            &prefill_addr,
            &[req_a],
            Destination::new(dst.cache.clone(), vec![vec![20, 21, 22]]),
            deadline,
        )
        .await
        .map_err(|f| format!("get failed: {f} (dirty: {})", f.dirty))?;
    println!("get: {} chunk(s), {} bytes", landed.chunks, landed.bytes);

    // 5b. The blocking get, from a plain thread outside the runtime (calling it from
    //     an async task is refused). It returns within its timeout, always.
    let (engine, addr, dst_cache) = (decode.clone(), prefill_addr.clone(), dst.cache.clone());
    let landed_b = std::thread::spawn(move || {
        engine.get_blocking(
            &addr,
            &[req_b],
            Destination::new(dst_cache, vec![vec![40, 41]]),
            Duration::from_secs(5),
        )
    })
    .join()
    .map_err(|_| "get_blocking thread panicked")?
    .map_err(|f| format!("get_blocking failed: {f}"))?;
    println!("get_blocking: {} chunk(s), {} bytes", landed_b.chunks, landed_b.bytes);

    // 6. Verify every byte.
    let mut bad = 0;
    for (src_blocks, dst_blocks) in [(&blocks_a[..], &[20usize, 21, 22][..]), (&blocks_b[..], &[40, 41][..])] {
        for (&s, &d) in src_blocks.iter().zip(dst_blocks) {
            if dst_mem.to_vec(d * BLOCK_BYTES, BLOCK_BYTES)? != block_bytes(s as usize) {
                eprintln!("block {s} did not land intact in block {d}");
                bad += 1;
            }
        }
    }
    if landed.chunks != 1 || landed_b.chunks != 1 || bad > 0 {
        return Err(format!("{bad} block(s) mismatched; landed {landed:?} and {landed_b:?}").into());
    }

    // 7. The prefill side learns its blocks are free again (the consumer's Done).
    let mut released = Vec::new();
    let until = Instant::now() + Duration::from_secs(2);
    while released.len() < 2 && Instant::now() < until {
        prefill.wait_released(until).await;
        released.extend(prefill.take_released());
    }
    for r in &released {
        println!("released {} ({:?}): its blocks may be reused", r.key, r.reason);
    }
    if released.len() != 2 || released.iter().any(|r| r.reason != ReleaseReason::Done) {
        return Err(format!("expected two releases by Done, got {released:?}").into());
    }

    // 8. Counters, then close both: drain everything and check nothing is left out.
    let (p, d) = (prefill.stats(), decode.stats());
    println!(
        "prefill: {} chunks / {} bytes sent, {} published now",
        p.producer.chunks_sent, p.producer.bytes_sent, p.producer.published_now
    );
    println!(
        "decode: {} transfers completed, {} failed, {} bytes landed, staging {}/{} pages free",
        d.consumer.completed, d.consumer.failed, d.consumer.bytes, d.arena.free_pages, d.arena.total_pages
    );
    let close_by = Instant::now() + Duration::from_secs(5);
    let (rp, rd) = (prefill.close(close_by).await, decode.close(close_by).await);
    if !rp.is_clean() || !rd.is_clean() {
        return Err(format!("engines closed with work outstanding: prefill {rp:?}, decode {rd:?}").into());
    }
    Ok(())
}
