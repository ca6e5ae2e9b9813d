//! The consumer side of a point: one engine (over mutual TLS under `--tls`) and a
//! destination of `--slots` slots (default: one per transfer in flight) of `keys per
//! get × blocks per chunk` blocks each — a host KV cache made resident before the first
//! round, or sim device memory of the same shape on the `device-sim` path — and the path
//! transfers take (`staged` lands through staging pages, every other path is direct).

use std::sync::Arc;
use std::time::Duration;

use kvferry::device::{Device, DeviceBuffer, DeviceKvCache, SimConfig, SimDevice};
use kvferry::engine::Engine;
use kvferry::layout::{Arrangement, KvCache, KvLayout};
use kvferry::mem::{Arena, ByteSize, Region};
use kvferry::peer::TransferPath;

use super::args::P2pBenchArgs;
use super::Shape;
use crate::cmd_bench::tls::EphemeralCa;
use crate::engine_args::EngineArgs;

/// The consumer engine and the destination transfers land in.
pub(super) struct Consumer {
    pub(super) engine: Engine,
    /// The engine's staging arena (accounted for leaks when the point ends).
    pub(super) arena: Arena,
    /// The destination's layout: slot `s` is blocks `s * k * bpc .. (s + 1) * k * bpc`
    /// (`k`: `--keys-per-get`), chunk `i` of a transfer at `(s * k + i) * bpc`.
    pub(super) layout: KvLayout,
    /// The host destination's memory.
    pub(super) region: Arc<Region>,
    pub(super) cache: Arc<KvCache>,
    /// On the `device-sim` path, the destination instead: sim device memory.
    pub(super) device_dst: Option<(Arc<DeviceKvCache>, DeviceBuffer)>,
    pub(super) path: TransferPath,
}

/// Starts the consumer and allocates its destination.
pub(super) async fn start(args: &P2pBenchArgs, shape: &Shape, ca: Option<&EphemeralCa>) -> anyhow::Result<Consumer> {
    let Shape {
        bpc,
        chunk_bytes,
        staging_page,
        staged,
        on_device,
        ..
    } = *shape;
    let layout = KvLayout::preset(
        args.model.parse()?,
        (args.slot_count(chunk_bytes) * args.keys_per_get * bpc) as u32,
        Arrangement::FullyContiguous,
    )?;
    let region = Arc::new(Region::host("bench-consumer", layout.region_bytes())?);
    // Resident before the first round, like a serving engine's KV cache (else the first
    // round pays the page faults of first touch and the rounds are not alike).
    region.fill(0, region.len(), 0)?;
    let cache = Arc::new(KvCache::with_layout(region.clone(), &layout)?);
    // On the device-sim path the destination is sim device memory of the same shape.
    let device_dst: Option<(Arc<DeviceKvCache>, DeviceBuffer)> = if on_device {
        let dev: Arc<dyn Device> = SimDevice::new(SimConfig::new(99))?;
        let buf = dev.alloc(layout.region_bytes())?;
        let spans = kvferry::layout::BlockMap::from_layout(&layout).spans().to_vec();
        let c = DeviceKvCache::new(
            "bench-consumer",
            dev,
            vec![(buf.clone(), spans)],
            layout.blocks,
            Duration::from_secs(10),
        )?;
        Some((Arc::new(c), buf))
    } else {
        None
    };
    let consumer_pages = if staged || on_device {
        args.in_flight * args.keys_per_get * chunk_bytes.div_ceil(staging_page)
    } else {
        1
    };
    let cnode = EngineArgs {
        model: args.model.clone(),
        blocks: 1,
        arena: ByteSize((consumer_pages * staging_page) as u64),
        page_size: ByteSize(staging_page as u64),
        copy_threads: args.copy_threads,
        transport: args.transport,
        ..EngineArgs::default()
    };
    let mut ccfg = cnode.config(None, "bench-consumer")?;
    ccfg.net.connections_per_peer = args.connections;
    if let Some(ca) = ca {
        ccfg.net.tls = Some(ca.node("bench-consumer")?);
    }
    let consumer = Engine::start(ccfg).await?;
    let arena = consumer.arena().clone();
    let path = if staged {
        TransferPath::Staged
    } else {
        TransferPath::Direct
    };
    Ok(Consumer {
        engine: consumer,
        arena,
        layout,
        region,
        cache,
        device_dst,
        path,
    })
}
