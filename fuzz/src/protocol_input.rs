//! Fuzz input → a sequence of protocol [`Op`]s, and running one against a fresh
//! engine. Shared by the `protocol_sequence` fuzz target and the `protocol_replay`
//! binary (which needs no nightly).
//!
//! The driver and the accounting check are the ones the normal test suite runs
//! (`crates/kvferry/tests/common/protocol.rs`, included by path): only the choice of
//! ops differs. Every input decodes to some sequence (`arbitrary` fills missing bytes
//! with zeros), so the fuzzer never wastes an input on a parse error.

#[path = "../../crates/kvferry/tests/common/protocol.rs"]
pub mod protocol;

use std::sync::OnceLock;
use std::time::Duration;

use arbitrary::{Result, Unstructured};
use protocol::{Bulk, Fixture, LeaseRef, Op, PutLen, Ttl, KEYS, MAX_KEYS};

/// Ops per input at most.
const MAX_OPS: usize = 32;

fn ttl(u: &mut Unstructured) -> Result<Ttl> {
    Ok(match u.int_in_range(0..=2u8)? {
        0 => Ttl::Zero,
        1 => Ttl::Ms(u.arbitrary()?),
        _ => Ttl::Max,
    })
}

fn put_len(u: &mut Unstructured) -> Result<PutLen> {
    Ok(match u.int_in_range(0..=9u8)? {
        0 | 1 => PutLen::Byte,
        8 => PutLen::Whole,
        9 => PutLen::TooBig,
        _ => PutLen::Blocks(u.int_in_range(1..=8)?, u.arbitrary()?),
    })
}

fn keys(u: &mut Unstructured) -> Result<Vec<u8>> {
    let n = u.int_in_range(0..=4usize)?;
    (0..n).map(|_| u.int_in_range(0..=KEYS - 1)).collect()
}

fn lease(u: &mut Unstructured) -> Result<LeaseRef> {
    Ok(match u.int_in_range(0..=6u8)? {
        0..=3 => LeaseRef::Own(u.arbitrary()?),
        4 | 5 => LeaseRef::Foreign(u.arbitrary()?),
        _ => LeaseRef::Random(u.arbitrary()?),
    })
}

/// A request that must be answered and leave its connection open.
fn well_formed(u: &mut Unstructured) -> Result<Op> {
    let conn = u.arbitrary()?;
    Ok(match u.int_in_range(0..=6u8)? {
        0 => Op::Put {
            conn,
            key: u.int_in_range(0..=KEYS - 1)?,
            len: match put_len(u)? {
                PutLen::TooBig => PutLen::Byte,
                l => l,
            },
            bulk: Bulk::Valid,
        },
        1 => Op::Get {
            conn,
            keys: keys(u)?,
            ttl: ttl(u)?,
        },
        2 => Op::Stage {
            conn,
            keys: keys(u)?,
            ttl: ttl(u)?,
        },
        3 => Op::Pull {
            conn,
            lease: lease(u)?,
            stale: u.ratio(1, 5)?,
        },
        4 => Op::Done { conn, lease: lease(u)? },
        5 => Op::Lookup { conn, keys: keys(u)? },
        _ => Op::Ping { conn },
    })
}

fn op(u: &mut Unstructured) -> Result<Op> {
    let conn = u.arbitrary()?;
    Ok(match u.int_in_range(0..=15u8)? {
        0..=4 => well_formed(u)?,
        5 => Op::Pair(Box::new(well_formed(u)?), Box::new(well_formed(u)?)),
        6 => Op::Put {
            conn,
            key: u.int_in_range(0..=KEYS - 1)?,
            len: put_len(u)?,
            bulk: match u.int_in_range(0..=4u8)? {
                0 => Bulk::LenOff(u.arbitrary()?),
                1 => Bulk::WrongId,
                2 => Bulk::ControlInstead,
                3 => Bulk::BadChecksum,
                _ => Bulk::Valid,
            },
        },
        7 => Op::Repeated {
            conn,
            key: u.int_in_range(0..=KEYS - 1)?,
            count: match u.int_in_range(0..=3u8)? {
                0 => 1,
                1 => MAX_KEYS as u16,
                2 => MAX_KEYS as u16 + 1,
                _ => u.arbitrary()?,
            },
            stage: u.arbitrary()?,
            ttl: ttl(u)?,
        },
        8 => Op::Misplaced {
            conn,
            which: u.arbitrary()?,
        },
        9 => Op::StrayBulk {
            conn,
            len: u.int_in_range(0..=4096)?,
        },
        10 => {
            let n = u.int_in_range(0..=96usize)?;
            Op::Garbage {
                conn,
                bytes: u.bytes(n)?.to_vec(),
            }
        }
        11 => Op::Oversize {
            conn,
            bulk: u.arbitrary()?,
            over: u.arbitrary()?,
        },
        12 => Op::Cut {
            conn,
            at: u.arbitrary()?,
        },
        13 => Op::HalfBulk {
            conn,
            key: u.int_in_range(0..=KEYS - 1)?,
            len: put_len(u)?,
            sent: u.arbitrary()?,
        },
        14 => Op::Close { conn },
        _ => well_formed(u)?,
    })
}

/// The ops `data` decodes to (at least one, at most [`MAX_OPS`]).
pub fn ops(data: &[u8]) -> Vec<Op> {
    let mut u = Unstructured::new(data);
    let mut ops = Vec::new();
    while ops.len() < MAX_OPS && (ops.is_empty() || !u.is_empty()) {
        match op(&mut u) {
            Ok(o) => ops.push(o),
            Err(_) => break,
        }
    }
    ops
}

fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("a tokio runtime")
    })
}

/// Runs the sequence `data` decodes to against a fresh engine, then the accounting
/// check. Panics (a finding) on the first broken promise.
pub fn run(data: &[u8]) {
    let ops = ops(data);
    let r = runtime().block_on(async {
        let whole = async {
            let mut f = Fixture::start().await;
            f.run(&ops).await?;
            f.settle_and_check().await
        };
        tokio::time::timeout(Duration::from_secs(60), whole)
            .await
            .unwrap_or_else(|_| Err("the sequence and its check took over 60 s: something hangs".into()))
    });
    if let Err(e) = r {
        panic!("{e}\nops: {ops:#?}");
    }
}
