//! A stateful protocol fuzzer in the normal suite: proptest chooses sequences of
//! requests — well-formed and not, on one to three real TCP connections after a real
//! handshake — and `common/protocol.rs` drives them against a real engine's server,
//! checking every reply as it comes and, once the connections closed and the TTLs
//! passed, that every staging page and store block came back, no connection task was
//! left behind, and a fresh honest client is served.
//!
//! 24 cases by default (a few seconds); `PROPTEST_CASES=500 cargo test -p kvferry
//! --test protocol_fuzz` runs more. The cargo-fuzz target `protocol_sequence` (see
//! `fuzz/README.md`) drives the same code with coverage-guided inputs.

#[path = "common/protocol.rs"]
mod protocol;

use std::time::Duration;

use proptest::prelude::*;
use protocol::*;

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(24)
}

fn conn() -> impl Strategy<Value = u8> {
    0u8..CONNS as u8
}

fn keys() -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(0u8..KEYS, 0..5)
}

fn ttl() -> impl Strategy<Value = Ttl> {
    prop_oneof![Just(Ttl::Zero), any::<u16>().prop_map(Ttl::Ms), Just(Ttl::Max)]
}

fn put_len() -> impl Strategy<Value = PutLen> {
    prop_oneof![
        2 => Just(PutLen::Byte),
        6 => (1u8..=8, any::<bool>()).prop_map(|(n, r)| PutLen::Blocks(n, r)),
        1 => Just(PutLen::Whole),
        1 => Just(PutLen::TooBig),
    ]
}

fn lease() -> impl Strategy<Value = LeaseRef> {
    prop_oneof![
        4 => any::<u8>().prop_map(LeaseRef::Own),
        2 => any::<u8>().prop_map(LeaseRef::Foreign),
        1 => any::<u128>().prop_map(LeaseRef::Random),
    ]
}

/// Requests that must be answered and leave their connection open.
fn well_formed() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (conn(), 0u8..KEYS, put_len()).prop_filter_map("a storable length", |(conn, key, len)| {
            (!matches!(len, PutLen::TooBig)).then_some(Op::Put { conn, key, len, bulk: Bulk::Valid })
        }),
        3 => (conn(), keys(), ttl()).prop_map(|(conn, keys, ttl)| Op::Get { conn, keys, ttl }),
        3 => (conn(), keys(), ttl()).prop_map(|(conn, keys, ttl)| Op::Stage { conn, keys, ttl }),
        3 => (conn(), lease(), prop::bool::weighted(0.2)).prop_map(|(conn, lease, stale)| Op::Pull { conn, lease, stale }),
        3 => (conn(), lease()).prop_map(|(conn, lease)| Op::Done { conn, lease }),
        1 => (conn(), keys()).prop_map(|(conn, keys)| Op::Lookup { conn, keys }),
        1 => conn().prop_map(|conn| Op::Ping { conn }),
    ]
}

fn bulk() -> impl Strategy<Value = Bulk> {
    prop_oneof![
        any::<i8>().prop_map(Bulk::LenOff),
        Just(Bulk::WrongId),
        Just(Bulk::ControlInstead),
        Just(Bulk::BadChecksum),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        12 => well_formed(),
        3 => (well_formed(), well_formed()).prop_map(|(a, b)| Op::Pair(Box::new(a), Box::new(b))),
        2 => (conn(), 0u8..KEYS, put_len(), bulk()).prop_map(|(conn, key, len, bulk)| Op::Put { conn, key, len, bulk }),
        1 => (conn(), 0u8..KEYS, put_len()).prop_map(|(conn, key, len)| Op::Put { conn, key, len, bulk: Bulk::Valid }),
        2 => (conn(), 0u8..KEYS, prop_oneof![Just(0u16), Just(1), 2u16..64, Just(MAX_KEYS as u16), Just(MAX_KEYS as u16 + 1)], any::<bool>(), ttl())
            .prop_map(|(conn, key, count, stage, ttl)| Op::Repeated { conn, key, count, stage, ttl }),
        1 => (conn(), any::<u8>()).prop_map(|(conn, which)| Op::Misplaced { conn, which }),
        1 => (conn(), any::<u16>()).prop_map(|(conn, len)| Op::StrayBulk { conn, len: len % 4096 }),
        1 => (conn(), prop::collection::vec(any::<u8>(), 0..96)).prop_map(|(conn, bytes)| Op::Garbage { conn, bytes }),
        1 => (conn(), any::<bool>(), prop_oneof![Just(1u64), any::<u64>()]).prop_map(|(conn, bulk, over)| Op::Oversize { conn, bulk, over }),
        1 => (conn(), any::<u16>()).prop_map(|(conn, at)| Op::Cut { conn, at }),
        1 => (conn(), 0u8..KEYS, put_len(), any::<u32>()).prop_map(|(conn, key, len, sent)| Op::HalfBulk { conn, key, len, sent }),
        1 => conn().prop_map(|conn| Op::Close { conn }),
    ]
}

/// Runs `ops` against a fresh engine, then the accounting check; bounded.
fn run(ops: &[Op]) -> Result<(), String> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let whole = async {
            let mut f = Fixture::start().await;
            f.run(ops).await?;
            f.settle_and_check().await
        };
        tokio::time::timeout(Duration::from_secs(60), whole)
            .await
            .unwrap_or_else(|_| Err("the sequence and its check took over 60 s: something hangs".into()))
    })
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: cases(),
        max_shrink_iters: 200,
        ..ProptestConfig::default()
    })]

    #[test]
    fn arbitrary_message_sequences_leave_every_page_and_block_accounted(ops in prop::collection::vec(op(), 1..24)) {
        if let Err(e) = run(&ops) {
            prop_assert!(false, "{e}");
        }
    }
}
