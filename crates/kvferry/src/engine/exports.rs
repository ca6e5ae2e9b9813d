//! What the engine's API takes and hands out, re-exported so that an embedder (the
//! Python binding among them) needs only [`kvferry::engine`](crate::engine): the
//! memory kinds and caches it registers (one [`KvCacheRef`] over host and device
//! caches), the destinations and results of transfers,
//! the device handles and fault rules of the sim device, the directory types, and the
//! errors those calls return.

pub use crate::checksum::checksum;
pub use crate::copy::DrainFence;
#[cfg(feature = "cuda")]
pub use crate::device::{cuda_pinned_arena, on_raw_event_complete, query_raw_event, raw_event_watch_stats, CudaDevice};
pub use crate::device::{
    Device, DeviceBuffer, DeviceError, DeviceKvCache, Fault, FaultRule, KvCacheRef, SimConfig, SimDevice, Trigger,
};
#[cfg(feature = "etcd")]
pub use crate::directory::etcd::{EtcdConfig, EtcdDirectory};
pub use crate::directory::{DirectoryError, LivePeers};
pub use crate::layout::{BlockMap, KvCache, Span};
pub use crate::mem::{Arena, Region};
pub use crate::net::TlsConfig;
pub use crate::peer::{Destination, GetFailure, Landed, PeerError, StagedHandle, TransferPath};
pub use crate::wire::ChunkKey;
pub use crate::ErrorCode;
