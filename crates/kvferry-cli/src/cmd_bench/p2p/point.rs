//! One measured point of the benchmark ([`Point`]): what was moved, how fast against
//! the limits measured in the same run, what it cost in CPU and wake-ups, and whether
//! every byte landed and every page came back. Printed by `report`, serialised with
//! `--json`, drawn by `plot`.

use serde::Serialize;

use super::args::{BenchPath, Verify};

/// One measured point.
#[derive(Serialize, Debug, Clone)]
pub struct Point {
    pub model: String,
    /// `direct` or `staged` (see `--path`).
    pub path: BenchPath,
    /// Whether connections ran over mutual TLS (`--tls`).
    pub tls: bool,
    pub chunk_bytes: usize,
    pub in_flight: usize,
    /// Chunks each transfer gets (`--keys-per-get`).
    pub keys_per_get: usize,
    /// Destination slots the transfers rotate over (`--slots`), each of
    /// `keys_per_get` chunks.
    pub slots: usize,
    pub connections: usize,
    pub producers: usize,
    pub chunks: u64,
    pub bytes: u64,
    /// Seconds the transfer rounds took together.
    pub elapsed_s: f64,
    /// Bytes landed and verified over `elapsed_s` (all rounds together).
    pub gbps: f64,
    /// Each transfer round's GB/s (a third of the chunks each, in order).
    pub round_gbps: Vec<f64>,
    /// The best round's GB/s: what `ratio` compares with the best raw-TCP run.
    pub best_round_gbps: f64,
    /// Raw loopback TCP moving the same bytes: plain sockets sending the producers'
    /// amount of memory chunk by chunk (as cold in cache as the transfers' data).
    pub tcp_limit_gbps: f64,
    /// Raw loopback TCP re-sending one 4 MiB buffer that stays in cache (for reference:
    /// the most flattering figure loopback gives).
    pub tcp_hot_limit_gbps: f64,
    /// `best_round_gbps / tcp_limit_gbps`: the best of 3 transfer rounds against the best
    /// of 3 raw-TCP runs, interleaved (round, run, round, run, …).
    pub ratio: f64,
    /// `gbps / tcp_limit_gbps`: all rounds together against the best raw-TCP run (the
    /// ratio as this benchmark defined it until 2026-12-03; lower by the noise).
    pub ratio_overall: f64,
    pub memcpy_gbps: f64,
    /// The staged pipeline's limit: the design's mandatory copies (gather, socket,
    /// landing) in plain code, same chunks and connections, no checksums.
    pub pipeline_limit_gbps: f64,
    /// `gbps / pipeline_limit_gbps`: what kvferry's own machinery costs.
    pub pipeline_ratio: f64,
    /// Latency of one transfer (a get of `keys_per_get` chunks), median and p99, ms.
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub errors: u64,
    pub corrupted_bytes: u64,
    pub leaked_pages: u64,
    /// Process resident memory after the first tenth of the transfers (warm-up), MiB.
    pub rss_warm_mib: f64,
    /// Process resident memory after the last transfer, MiB: flat against
    /// `rss_warm_mib` means nothing grows per transfer.
    pub rss_end_mib: f64,
    /// Backing of the staging arenas (consumer's and producers'), e.g.
    /// `mmap+mlock (pinned)`; the least pinned one when they differ.
    pub staging_backing: String,
    /// Whether every staging arena is pinned (page-locked).
    pub staging_pinned: bool,
    /// The crc32c implementation this process checksums with (`fold-clmul`,
    /// `fold-avx2` or `crc32-instruction`; chosen per CPU, `KVFERRY_CRC32C` forces one).
    pub checksum_impl: String,
    /// Why staging is not pinned, when it is not (e.g. `RLIMIT_MEMLOCK` too low).
    pub staging_fallback: Option<String>,
    /// CPU seconds (user + system, every thread of the benchmark, contention threads
    /// left out) per GB over the transfer phase.
    pub cpu_s_per_gb: f64,
    /// The same over the raw-TCP (same bytes) phase.
    pub tcp_cpu_s_per_gb: f64,
    /// `cpu_s_per_gb / tcp_cpu_s_per_gb`: what kvferry spends per byte beyond sockets.
    pub cpu_ratio: f64,
    /// Busy threads beside this point (`--contend`; 0: alone).
    pub contend: usize,
    /// How landed bytes were verified (`--verify`; `receive` on the staged and
    /// device-sim paths re-reads, see there).
    pub verify: Verify,
    /// Voluntary context switches (a benchmark thread blocked, then woken) per chunk
    /// over the transfer phase: the wake-ups and thread hand-offs a transfer costs,
    /// producer and consumer together.
    pub wakeups_per_chunk: f64,
    /// Involuntary context switches (a benchmark thread preempted) per chunk.
    pub preemptions_per_chunk: f64,
    /// Voluntary context switches of the raw-TCP phase per chunk-sized write.
    pub tcp_wakeups_per_chunk: f64,
    /// The mover the consumer's engine chose for the producers (`cma`: it read their
    /// granted bytes from their memory with `process_vm_readv`; `socket`; `mixed`
    /// when producers differ), from `Consumer::movers()`.
    pub mover: String,
    /// Why the socket carried bytes the same-host mover could have (null when it did
    /// not, or when `--mover tcp` asked for the socket).
    pub mover_fallback: Option<String>,
    /// Whether the producers ran in a process of their own (`--producer-process`):
    /// their CPU is then read from /proc and counted in `cpu_s_per_gb`, and their
    /// arenas' leaked pages are counted by that process and reported to this one.
    pub producer_process: bool,
    /// Bytes the consumer read with the same-host mover (0 on the socket).
    pub cma_bytes: u64,
    /// The one-copy same-host limit: plain `process_vm_readv` of the same chunks from
    /// the producer process, `cma_threads` threads, no protocol, no verification, best
    /// of one run after each round (null when the kernel refused the read).
    pub cma_limit_gbps: Option<f64>,
    /// Threads of the one-copy limit: the consumer's copy threads.
    pub cma_threads: usize,
    /// `best_round_gbps / cma_limit_gbps`.
    pub ratio_cma_limit: Option<f64>,
    /// The one-copy limit of a mover that verifies every byte: the same reads, each
    /// chunk's crc32c taken right after it was read (null with `cma_limit_gbps`).
    pub cma_verified_limit_gbps: Option<f64>,
    /// `best_round_gbps / cma_verified_limit_gbps`: how close the protocol comes to
    /// reading and verifying with nothing else.
    pub ratio_cma_verified_limit: Option<f64>,
    /// With `--contend N`: the same point measured again with N busy threads beside it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub contended: Option<Box<Point>>,
}
