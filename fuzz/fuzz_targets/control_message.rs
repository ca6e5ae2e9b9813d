//! Fuzz target: a stream of arbitrary bytes fed to `read_control::<Message>`.
//!
//! Reads frames until the first error, validating every decoded message. Must never
//! panic, hang, or allocate beyond the limits. The reader is an in-memory slice, so
//! every future completes without waiting.

#![no_main]

use kvferry::wire::{read_control, Limits, Message};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let limits = Limits::default();
    let mut r = data;
    futures::executor::block_on(async {
        while let Ok((_, msg)) = read_control::<_, Message>(&mut r, &limits).await {
            let _ = msg.validate(&limits);
        }
    });
});
