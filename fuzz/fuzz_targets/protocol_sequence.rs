//! Fuzz target: the input as a sequence of protocol requests (well-formed and not, on
//! up to three connections after a real handshake) against a fresh engine's server
//! over real loopback TCP; then, once the connections closed and the TTLs passed, every
//! staging page, store block, per-peer quota and connection task must have come back
//! (see `src/protocol_input.rs` and the driver it shares with the test suite).

#![no_main]

#[path = "../src/protocol_input.rs"]
mod protocol_input;

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    protocol_input::run(data);
});
