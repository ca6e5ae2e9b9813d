//! The schedule: each transfer's [`Plan`] (kind, producer, request set, deadline, when
//! its caller gives up, arena hog) drawn from the run's seed and its index, so a seed
//! fixes the schedule (not the timing).

use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::device::{OffloadPlan, SimRig};
use super::device_link::{DeviceLink, LinkPlan};
use super::workload::mix;

/// A deadline that is not meant to expire.
pub(super) const GENEROUS: Duration = Duration::from_secs(2);

/// Delayed-pull variants.
#[derive(Clone, Copy, Debug)]
pub enum PullMode {
    /// Resolve with a generous deadline.
    Resolve,
    /// Resolve with a short deadline.
    ResolveShort,
    /// Resolve, and drop the future at a random point.
    ResolveDrop,
    /// Release the lease without pulling.
    Release,
    /// Forget the handle: the producer's TTL must release the pages.
    Abandon,
}

/// What a transfer does.
#[derive(Clone, Copy, Debug)]
pub enum Kind {
    /// Eager get, generous deadline.
    Get,
    /// Eager get, short deadline.
    GetShort,
    /// Eager get dropped by its caller.
    GetDrop,
    /// `get_blocking`, generous timeout.
    Blocking,
    /// `get_blocking`, short timeout.
    BlockingShort,
    /// Stage, then something.
    Pull(PullMode),
    /// A sim-device D2H copy.
    Offload(OffloadPlan),
    /// Device KV → peer → device KV, with device faults on either side.
    DeviceTransfer(LinkPlan),
}

/// One transfer, drawn from the seed.
#[derive(Clone, Copy, Debug)]
pub struct Plan {
    /// Its number.
    pub index: u64,
    /// The producer asked.
    pub producer: usize,
    /// The request set asked for.
    pub set: usize,
    /// What it does.
    pub kind: Kind,
    /// Its deadline (from the call).
    pub deadline: Duration,
    /// When a dropping caller gives up.
    pub drop_after: Duration,
    /// Hog this fraction of the consumer's free staging pages for this long, first.
    pub hog: Option<(f64, Duration)>,
}

fn short(rng: &mut StdRng) -> Duration {
    if rng.gen_bool(0.7) {
        Duration::from_micros(rng.gen_range(300..=3_000))
    } else {
        Duration::from_millis(rng.gen_range(5..=40))
    }
}

fn pick<T: Copy>(rng: &mut StdRng, options: &[(f64, T)]) -> T {
    let total: f64 = options.iter().map(|o| o.0).sum();
    let mut x = rng.gen_range(0.0..total);
    for (w, t) in options {
        if x < *w {
            return *t;
        }
        x -= w;
    }
    options.last().expect("options").1
}

impl Plan {
    /// Transfer `index` of the run seeded with `seed`; `rate` scales every fault.
    pub fn draw(seed: u64, index: u64, producers: usize, sets: usize, rate: f64) -> Plan {
        let mut rng = StdRng::seed_from_u64(mix(seed, &[2, index]));
        let producer = rng.gen_range(0..producers);
        let set = rng.gen_range(0..sets);
        #[derive(Clone, Copy)]
        enum K {
            Get,
            GetShort,
            GetDrop,
            Blocking,
            BlockingShort,
            Pull,
            Offload,
            DeviceTransfer,
        }
        let k = pick(
            &mut rng,
            &[
                (30.0, K::Get),
                (15.0 * rate, K::GetShort),
                (12.0 * rate, K::GetDrop),
                (12.0, K::Blocking),
                (6.0 * rate, K::BlockingShort),
                (15.0, K::Pull),
                (8.0, K::Offload),
                (10.0, K::DeviceTransfer),
            ],
        );
        let mut deadline = GENEROUS;
        let kind = match k {
            K::Get => Kind::Get,
            K::GetShort => {
                deadline = short(&mut rng);
                Kind::GetShort
            }
            K::GetDrop => Kind::GetDrop,
            K::Blocking => Kind::Blocking,
            K::BlockingShort => {
                deadline = short(&mut rng);
                Kind::BlockingShort
            }
            K::Pull => {
                let mode = pick(
                    &mut rng,
                    &[
                        (70.0, PullMode::Resolve),
                        (10.0 * rate, PullMode::ResolveShort),
                        (10.0 * rate, PullMode::ResolveDrop),
                        (7.0, PullMode::Release),
                        (3.0 * rate, PullMode::Abandon),
                    ],
                );
                if let PullMode::ResolveShort = mode {
                    deadline = short(&mut rng);
                }
                Kind::Pull(mode)
            }
            K::Offload => Kind::Offload(SimRig::plan(&mut rng, rate)),
            K::DeviceTransfer => Kind::DeviceTransfer(DeviceLink::plan(&mut rng, rate)),
        };
        let drop_after = Duration::from_micros(rng.gen_range(0..=5_000));
        let hog = rng
            .gen_bool((0.01 * rate).min(1.0))
            .then(|| (rng.gen_range(0.6..=1.0), Duration::from_millis(rng.gen_range(10..=60))));
        Plan {
            index,
            producer,
            set,
            kind,
            deadline,
            drop_after,
            hog,
        }
    }
}
