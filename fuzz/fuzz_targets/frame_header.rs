//! Fuzz target: `FrameHeader::decode` on arbitrary 32 bytes.
//!
//! Must never panic; a header that decodes must re-encode to the same bytes and
//! respect the limits.

#![no_main]

use kvferry::wire::{FrameHeader, FrameKind, Limits, HEADER_LEN};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut buf = [0u8; HEADER_LEN];
    let n = data.len().min(HEADER_LEN);
    buf[..n].copy_from_slice(&data[..n]);
    let limits = Limits::default();
    if let Ok(h) = FrameHeader::decode(&buf, &limits) {
        assert_eq!(h.encode(), buf);
        let limit = match h.kind {
            FrameKind::Control => limits.max_control_bytes,
            FrameKind::Bulk => limits.max_bulk_bytes,
        };
        assert!(h.len <= limit);
    }
});
