//! The CUDA backend (cargo feature `cuda`): the CUDA driver API through `cudarc`'s raw
//! bindings with dynamic loading — building needs no CUDA, and on a machine without a
//! driver library or GPU [`CudaDevice::open`] returns
//! [`DeviceError::NoDevice`](crate::device::DeviceError::NoDevice) and never panics
//! (every driver symbol used is looked up before the first call).
//!
//! - Each device uses its primary context; streams are created non-blocking (no implicit
//!   synchronisation with the legacy default stream).
//! - Every operation creates a fresh `CUevent` (timing disabled), recorded after the
//!   operation's work.
//! - Waiting polls `cuEventQuery` with exponential backoff, 20 µs doubling to 1 ms
//!   (`tokio::time::sleep` in async waits, `std::thread::sleep` in blocking ones), so a
//!   waiter costs a driver call per backoff step — well under 1% of a core — and
//!   resumes within about a millisecond of completion.
//! - A copy's lease pages and device buffers are held by its event until a query sees it
//!   complete; that first query also runs the settle callbacks (releasing quarantined
//!   pages) before it returns. An abandoned copy (timed out, dropped) is watched by a
//!   per-device reaper thread, which exists only while there is something to watch,
//!   polls with backoff up to 100 ms, and so releases the quarantined pages soon after
//!   the event completes. Device memory is freed on that thread too, so dropping a
//!   buffer never blocks the caller on a busy device.
//! - A stream can wait on a CUDA event (`cuStreamWaitEvent`) or on a host-side event
//!   such as [`Event::manual`](crate::device::Event::manual): then a host function
//!   enqueued with `cuLaunchHostFunc` holds the stream until the event settles. It
//!   occupies the driver's callback thread meanwhile, so gate only on conditions that
//!   do not need other host functions of the same context to run first.
//! - Events of other libraries (torch's `CUevent`s) can be queried
//!   ([`query_raw_event`]) or watched without polling ([`on_raw_event_complete`]: a
//!   private stream waits on the event and runs a host function that calls back; a
//!   stream is reused only after its host function ran).
//! - An error from `cuEventQuery` (a sticky context error) settles the event as
//!   [`EventStatus::Faulted`](crate::device::EventStatus::Faulted): its memory stays
//!   quarantined.
//! - Device memory is ours (`Device::alloc`: `cuMemAlloc`, freed on the reaper thread
//!   when the last holder drops it) or **external** ([`CudaDevice::wrap_external`]:
//!   memory another library allocated, e.g. a torch tensor). External memory is never
//!   freed here: the buffer holds an `owner` that keeps it alive, and dropping the
//!   buffer (after every operation that targets it has settled) drops the owner.
//!   Wrapping checks with the driver that every byte of the range is device memory of
//!   this device (`cuPointerGetAttribute`, `cuMemGetAddressRange`) and refuses anything
//!   else (host memory, another GPU, another context) with
//!   [`DeviceError::InvalidArgument`](crate::device::DeviceError::InvalidArgument).
//! - Pinned host memory for an arena comes from `cuMemHostAlloc` with
//!   `CU_MEMHOSTALLOC_PORTABLE` and **without** write-combining (the CPU reads these
//!   pages back for checksums and socket writes): [`cuda_pinned_backing`],
//!   [`cuda_pinned_arena`].
//!
//! # Cancellation
//!
//! Dropping an async wait stops polling at once; the operation continues on the GPU.
//!
//! # Files
//!
//! - `driver`: loading and checking the driver library, the result helpers, the
//!   retained primary context, and the context-free queries (`cuda_device_count`,
//!   `query_raw_event`).
//! - `device`: `CudaDevice` (opening a GPU, wrapping external memory, allocating).
//! - `buffer`: device memory, ours or external.
//! - `stream`: streams, their copies, and waits on other events.
//! - `event`: an event in flight and its signal (polling with backoff).
//! - `reaper`: the thread that watches abandoned events and frees device memory.
//! - `pinned`: pinned host memory for arenas.
//! - `watch`: notification when a raw `CUevent` completes, without polling.

mod buffer;
mod device;
mod driver;
mod event;
mod ipc;
mod pinned;
mod reaper;
mod stream;
mod watch;

pub use device::CudaDevice;
pub use driver::{cuda_device_count, query_raw_event};
pub use ipc::CUDA_IPC;
pub use pinned::{cuda_pinned_arena, cuda_pinned_backing};
pub use watch::{on_raw_event_complete, raw_event_watch_stats, MAX_BUSY_WATCH_STREAMS};
