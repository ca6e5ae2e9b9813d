//! A fault-injecting TCP forwarder of the tests' own, for what `tbf` cannot do here (the
//! kernel has no `netem`): it runs inside a host (its runtime is built in the host's
//! namespace), accepts on `IP:PORT` of that host and forwards every connection to a
//! target, adding
//! - a one-way delay to every segment (a delay line: throughput is not cut by it),
//! - an optional throttle (bytes per second, per direction),
//! - loss-like faults drawn from a seed for every window of `within` bytes of each
//!   direction of each connection: a cut (the connection is closed at a chosen byte,
//!   mid-frame) or a stall (no byte moves for a while from a chosen byte). Drawing per
//!   window, not once per connection, reaches long-lived pooled connections too.
//!
//! The same seed, the same order of connections and the same bytes give the same
//! faults.
//!
//! # Cancellation
//! Each connection is one task owning both sockets; a cut or the forwarder's drop
//! (which shuts its runtime down) drops them, closing both sides.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rand::{Rng, SeedableRng};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::runtime::Runtime;
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::net::Host;

/// What the forwarder does to traffic.
#[derive(Clone, Debug)]
pub struct Faults {
    /// Added to every segment, each direction.
    pub delay: Duration,
    /// Bytes per second per direction (`None`: unthrottled).
    pub rate: Option<u64>,
    /// Chance per window, in parts per million, of a cut.
    pub cut_ppm: u32,
    /// Chance per window, in parts per million, of a stall.
    pub stall_ppm: u32,
    /// How long a stall lasts.
    pub stall: Duration,
    /// The window: bytes of one direction over which one cut and one stall are drawn.
    pub within: u64,
    /// Seed of the fault choices.
    pub seed: u64,
}

impl Faults {
    /// Only a delay.
    pub fn delay(d: Duration) -> Faults {
        Faults {
            delay: d,
            rate: None,
            cut_ppm: 0,
            stall_ppm: 0,
            stall: Duration::ZERO,
            within: 1,
            seed: 0,
        }
    }
}

/// What the forwarder did.
#[derive(Default, Debug)]
pub struct Stats {
    /// Connections accepted.
    pub connections: AtomicU64,
    /// Connections cut.
    pub cuts: AtomicU64,
    /// Stalls injected.
    pub stalls: AtomicU64,
    /// Bytes forwarded (both directions).
    pub bytes: AtomicU64,
}

/// A running forwarder; stops when dropped.
pub struct Forwarder {
    rt: Option<Runtime>,
    /// `IP:PORT` it accepts on.
    pub addr: String,
    /// What it did so far.
    pub stats: Arc<Stats>,
}

/// The fault plan of one direction of one connection: the faults of the current
/// window, drawn from the direction's own generator.
struct Plan {
    rng: rand::rngs::StdRng,
    window: u64,
    start: u64,
    cut_at: Option<u64>,
    stall_at: Option<u64>,
}

impl Plan {
    fn new(seed: u64, f: &Faults) -> Plan {
        let mut p = Plan {
            rng: rand::rngs::StdRng::seed_from_u64(seed),
            window: f.within.max(1),
            start: 0,
            cut_at: None,
            stall_at: None,
        };
        p.draw(f);
        p
    }

    fn draw(&mut self, f: &Faults) {
        let (start, window) = (self.start, self.window);
        let mut at =
            |ppm: u32| (self.rng.gen_range(0..1_000_000u32) < ppm).then(|| start + self.rng.gen_range(0..window));
        self.cut_at = at(f.cut_ppm);
        self.stall_at = at(f.stall_ppm);
    }

    /// Moves to the window holding byte `sent`.
    fn advance(&mut self, sent: u64, f: &Faults) {
        while sent >= self.start + self.window {
            self.start += self.window;
            self.draw(f);
        }
    }
}

impl Forwarder {
    /// Starts a forwarder in `host` accepting on `host:port`, forwarding to `target`.
    pub fn start(host: &Host, port: u16, target: &str, faults: Faults) -> Forwarder {
        let addr = host.addr(port);
        let bind = addr.clone();
        let (rt, listener) = host.run_in(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .expect("forwarder runtime");
            let l = std::net::TcpListener::bind(&bind).unwrap_or_else(|e| panic!("forwarder bind {bind}: {e}"));
            l.set_nonblocking(true).unwrap();
            (rt, l)
        });
        let stats = Arc::new(Stats::default());
        let (st, target) = (stats.clone(), target.to_string());
        rt.spawn(async move {
            let listener = TcpListener::from_std(listener).unwrap();
            let mut rng = rand::rngs::StdRng::seed_from_u64(faults.seed);
            loop {
                let Ok((inbound, _)) = listener.accept().await else {
                    continue;
                };
                st.connections.fetch_add(1, Ordering::Relaxed);
                let (up, down) = (Plan::new(rng.gen(), &faults), Plan::new(rng.gen(), &faults));
                let (f, st, target) = (faults.clone(), st.clone(), target.clone());
                tokio::spawn(async move {
                    let Ok(outbound) = TcpStream::connect(&target).await else {
                        return;
                    };
                    let _ = inbound.set_nodelay(true);
                    let _ = outbound.set_nodelay(true);
                    let (ir, iw) = inbound.into_split();
                    let (or, ow) = outbound.into_split();
                    let a = pump(ir, ow, up, f.clone(), st.clone());
                    let b = pump(or, iw, down, f, st.clone());
                    tokio::pin!(a, b);
                    let (mut a_done, mut b_done) = (false, false);
                    while !(a_done && b_done) {
                        let cut = tokio::select! {
                            r = &mut a, if !a_done => { a_done = true; r }
                            r = &mut b, if !b_done => { b_done = true; r }
                        };
                        if cut {
                            st.cuts.fetch_add(1, Ordering::Relaxed);
                            return; // drops both sockets: both sides see the close
                        }
                    }
                });
            }
        });
        Forwarder {
            rt: Some(rt),
            addr,
            stats,
        }
    }

    /// Connections accepted so far.
    pub fn connections(&self) -> u64 {
        self.stats.connections.load(Ordering::Relaxed)
    }
}

impl Drop for Forwarder {
    fn drop(&mut self) {
        if let Some(rt) = self.rt.take() {
            rt.shutdown_timeout(Duration::from_secs(1));
        }
    }
}

/// Moves bytes from `r` to `w` through a delay line, applying `plan`. Returns true
/// when it cut the connection, false at the end of the stream (or an I/O error).
async fn pump(mut r: OwnedReadHalf, mut w: OwnedWriteHalf, mut plan: Plan, f: Faults, st: Arc<Stats>) -> bool {
    let (tx, mut rx) = mpsc::channel::<(Instant, Vec<u8>)>(256);
    let delay = f.delay;
    let _reader = AbortOnDrop(tokio::spawn(async move {
        loop {
            let mut buf = vec![0u8; 64 << 10];
            match r.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    buf.truncate(n);
                    if tx.send((Instant::now() + delay, buf)).await.is_err() {
                        return;
                    }
                }
            }
        }
    }));
    let start = Instant::now();
    let mut sent: u64 = 0;
    let cut = loop {
        let Some((due, mut buf)) = rx.recv().await else {
            break false;
        };
        tokio::time::sleep_until(due).await;
        plan.advance(sent, &f);
        // A fault drawn for a window that this segment entered part-way may lie
        // behind `sent`: it happens at once.
        if let Some(at) = plan.cut_at {
            if sent + buf.len() as u64 > at {
                buf.truncate(at.saturating_sub(sent) as usize);
                let _ = w.write_all(&buf).await;
                break true;
            }
        }
        if let Some(at) = plan.stall_at {
            if sent + buf.len() as u64 > at {
                plan.stall_at = None;
                st.stalls.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(f.stall).await;
            }
        }
        if w.write_all(&buf).await.is_err() {
            break false;
        }
        sent += buf.len() as u64;
        st.bytes.fetch_add(buf.len() as u64, Ordering::Relaxed);
        if let Some(rate) = f.rate {
            let due = start + Duration::from_secs_f64(sent as f64 / rate as f64);
            tokio::time::sleep_until(due).await;
        }
    };
    if !cut {
        let _ = w.shutdown().await;
    }
    cut
}

/// Aborts a task when dropped: a pump's reader never outlives its pump.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}
