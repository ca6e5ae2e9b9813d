//! The options of `kvferry bench p2p` ([`P2pBenchArgs`]), and how KV moves
//! ([`BenchPath`]) and landed bytes are verified ([`Verify`]).

use clap::Args;
use kvferry::mem::ByteSize;
use serde::Serialize;

use crate::util::parse_model;

/// The largest destination `--slots` makes by default (NIXL's benchmark working set).
pub const DEFAULT_DESTINATION_CAP: usize = 1 << 30;

/// Parser of counts that must be at least 1 (zero is refused with exit status 2).
fn at_least_one(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}

/// Options for the transfer benchmark.
#[derive(Args, Debug, Clone)]
pub struct P2pBenchArgs {
    /// Model preset giving the KV layout (llama3-8b: 2 MiB per block; llama3-70b-tp8:
    /// 640 KiB per block).
    #[arg(long, default_value = "llama3-70b-tp8", value_parser = parse_model)]
    pub model: String,
    /// Blocks per chunk (chunk size = blocks × block size; 4 × 640 KiB = 2.5 MiB)
    /// [default: 4; under --sweep, when not given: 1, 2, 4 and 6].
    #[arg(long = "blocks-per-chunk", value_name = "BLOCKS", value_parser = clap::value_parser!(u32).range(1..))]
    pub blocks_per_chunk_arg: Option<u32>,
    /// `--blocks-per-chunk` as run (set from the flag by `run`, or by the sweep).
    #[arg(skip = 4u32)]
    pub blocks_per_chunk: u32,
    /// Requests (distinct byte patterns) held by the producers.
    #[arg(long, default_value_t = 32, value_parser = at_least_one)]
    pub requests: usize,
    /// Chunks per request.
    #[arg(long, default_value_t = 4, value_parser = at_least_one)]
    pub chunks_per_request: usize,
    /// Chunks each transfer gets (consecutive chunks of one request, one `get` of that
    /// many keys, landing in one destination slot of that many chunks; must divide
    /// --chunks-per-request). 1: one key per get, every chunk's control (grant,
    /// `Done`) paid per chunk; --chunks-per-request: whole requests, as a serving
    /// engine fetches a request's blocks and as NIXL posts its blocks in one transfer
    /// request.
    #[arg(long, default_value_t = 1, value_parser = at_least_one)]
    pub keys_per_get: usize,
    /// Destination slots the transfers rotate over, oldest free slot first (default:
    /// enough for a destination as large as the source's working set — requests ×
    /// chunks per request × chunk size — up to 1 GiB, and at least one per transfer in
    /// flight). A real KV cache does not sit in the last-level cache, so neither does
    /// the default destination; a few slots (e.g. `--slots 4`) stay in cache and
    /// measure landing into cache instead. The one-copy limit writes a destination of
    /// the same size.
    #[arg(long, value_name = "N", value_parser = at_least_one)]
    pub slots: Option<usize>,
    /// Total bytes to move (under --sweep: per point, at most 1GiB).
    #[arg(long, default_value = "4GiB")]
    pub bytes: ByteSize,
    /// Transfers in flight at once [default: 4; under --sweep, when not given: 1, 4
    /// and 16].
    #[arg(long = "in-flight", value_name = "N", value_parser = at_least_one)]
    pub in_flight_arg: Option<usize>,
    /// `--in-flight` as run (set from the flag by `run`, or by the sweep).
    #[arg(skip = 4usize)]
    pub in_flight: usize,
    /// Connections per producer (transfers are striped over them; used at every point
    /// of a sweep).
    #[arg(long, default_value_t = 4, value_parser = at_least_one)]
    pub connections: usize,
    /// Producer instances.
    #[arg(long, default_value_t = 1, value_parser = at_least_one)]
    pub producers: usize,
    /// Copy threads per engine (default: available cores).
    #[arg(long)]
    pub copy_threads: Option<usize>,
    /// How KV moves: `direct` (zero copy: producers publish blocks of their KV cache and
    /// the socket writes from them; the consumer's socket reads straight into its
    /// destination blocks), `staged` (producers copy chunks into staging pages before
    /// advertising them; the consumer receives into staging pages, then lands them), or
    /// `device-sim` (KV in simulated device memory on both sides: device-to-host gather
    /// into staging, socket, host-to-device scatter; every byte still verified).
    #[arg(long, default_value = "direct")]
    pub path: BenchPath,
    /// Run a sweep instead of one point: chunk sizes of 1, 2, 4 and 6 blocks × 1, 4 and
    /// 16 transfers in flight, up to 1GiB per point. --blocks-per-chunk or --in-flight,
    /// when given, fix that dimension and only the other is swept (both given: one
    /// point). --connections, --producers, --path and --model apply to every point. The
    /// summary reports the best point and the range over all points.
    #[arg(long)]
    pub sweep: bool,
    /// Draw throughput against chunk size and transfers in flight, with the measured
    /// TCP and memcpy limits, into this SVG file (implies --sweep).
    #[arg(long, value_name = "FILE.svg")]
    pub plot: Option<std::path::PathBuf>,
    /// Run every connection over mutual TLS (rustls with ring, TLS 1.3 AES-256-GCM),
    /// with a CA and certificates generated in memory for the run; compare with the
    /// same command without --tls.
    #[arg(long)]
    pub tls: bool,
    /// Contention mode: run the point twice in this invocation, first alone, then with
    /// N busy threads beside it (each computes crc32c over its own 256 KiB buffer in a
    /// loop, standing for the other work of an inference host; they stop when the
    /// point ends), and report both (JSON: the second under `contended`). Their CPU is
    /// left out of the benchmark's CPU per GB. With --sweep, every point runs with them.
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub contend: usize,
    /// How every landed byte is verified against its request's pattern: `receive`
    /// (direct path: the crc32c the receive path computed over the destination blocks
    /// as each piece arrived, combined, compared with the pattern's — no second pass
    /// over the bytes; staged and device-sim paths, whose receive checksums are taken
    /// in staging pages, re-read the landed chunk as with `reread`) or `reread`
    /// (checksum the landed chunk again after the transfer).
    #[arg(long, default_value = "receive")]
    pub verify: Verify,
    /// Which movers carry the bytes (the producer and consumer engines' `transport`;
    /// `--mover` is an older spelling, still accepted): `auto` lets the consumer read
    /// the producers' granted bytes itself with `process_vm_readv` when they run on
    /// this host (the same-host "CMA" mover, one copy, every chunk still verified),
    /// `tcp` keeps every byte on the socket (the path this benchmark measured before
    /// the same-host mover existed).
    #[arg(long, alias = "mover", default_value = "auto")]
    pub transport: kvferry::peer::Transport,
    /// Run the producers in a process of their own (this program re-run as a child),
    /// so that a same-host read crosses a process boundary as it does in production
    /// (a read inside one process proves nothing). Default: on with `--transport auto`,
    /// off with `--transport tcp`; `--producer-process false` keeps them in this process,
    /// `--producer-process` (or `true`) forces the child with `--transport tcp` too.
    #[arg(long, value_name = "BOOL", num_args = 0..=1, default_missing_value = "true")]
    pub producer_process: Option<bool>,
    /// Internal: run as the producer process of a parent benchmark (reads its setup
    /// from stdin, prints its addresses on one stdout line, serves until stdin closes).
    #[arg(long, hide = true)]
    pub serve_producers: bool,
    /// Print JSON (one object; an array with --sweep) instead of a table.
    #[arg(long)]
    pub json: bool,
    /// No progress bar.
    #[arg(long)]
    pub quiet: bool,
}

impl Default for P2pBenchArgs {
    fn default() -> Self {
        P2pBenchArgs {
            model: "llama3-70b-tp8".into(),
            blocks_per_chunk_arg: None,
            blocks_per_chunk: 4,
            requests: 32,
            chunks_per_request: 4,
            keys_per_get: 1,
            slots: None,
            bytes: ByteSize(4 << 30),
            in_flight_arg: None,
            in_flight: 4,
            connections: 4,
            producers: 1,
            copy_threads: None,
            path: BenchPath::Direct,
            sweep: false,
            plot: None,
            tls: false,
            contend: 0,
            verify: Verify::Receive,
            transport: kvferry::peer::Transport::Auto,
            producer_process: None,
            serve_producers: false,
            json: false,
            quiet: false,
        }
    }
}

impl P2pBenchArgs {
    /// Whether the producers run in a child process (`--producer-process`, by default
    /// on with `--transport auto`).
    pub fn in_child(&self) -> bool {
        self.producer_process
            .unwrap_or(self.transport == kvferry::peer::Transport::Auto)
    }
}

/// How the benchmark verifies landed bytes (`--verify`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Verify {
    /// The receive path's checksums (direct path), combined.
    Receive,
    /// Checksum the landed chunk again.
    Reread,
}

/// How the benchmark's KV moves (`--path`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum BenchPath {
    /// Producers publish host blocks; sockets write from and read into KV blocks.
    Direct,
    /// Store chunks copied into staging pages; received into staging pages, landed.
    Staged,
    /// KV in (simulated) device memory on both sides: device-to-host gather into
    /// staging, socket, staging, host-to-device scatter.
    DeviceSim,
}

impl std::str::FromStr for BenchPath {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "direct" => Ok(BenchPath::Direct),
            "staged" => Ok(BenchPath::Staged),
            "device-sim" => Ok(BenchPath::DeviceSim),
            _ => Err(format!("unknown path {s:?} (expected direct, staged or device-sim)")),
        }
    }
}

impl std::fmt::Display for BenchPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            BenchPath::Direct => "direct",
            BenchPath::Staged => "staged",
            BenchPath::DeviceSim => "device-sim",
        })
    }
}

impl P2pBenchArgs {
    /// Destination slots for chunks of `chunk_bytes`: `--slots`, or as many as make
    /// the destination as large as the source's working set (at most
    /// [`DEFAULT_DESTINATION_CAP`]); at least one per transfer in flight.
    pub fn slot_count(&self, chunk_bytes: usize) -> usize {
        let slots = self.slots.unwrap_or_else(|| {
            let working_set = self.requests * self.chunks_per_request * chunk_bytes;
            let slot_bytes = (self.keys_per_get * chunk_bytes).max(1);
            working_set.min(DEFAULT_DESTINATION_CAP).div_ceil(slot_bytes)
        });
        slots.max(self.in_flight)
    }
}
