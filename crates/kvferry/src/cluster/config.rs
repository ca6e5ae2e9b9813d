//! Configuration of a [`Leader`](super::Leader) and of the worker processes it starts,
//! validated once at start-up.
//!
//! # Semantics
//!
//! Every timeout is configuration. [`LeaderConfig::validate`] rejects a zero, negative
//! (from [`parse_duration`]) or absurd (more than [`MAX_TIMEOUT`]) value with a typed
//! [`ClusterError::InvalidConfig`] naming the field, before any process is started;
//! nothing is re-checked per step.
//!
//! A worker's command line is produced by [`WorkerConfig::to_args`] and parsed back by
//! [`WorkerConfig::parse_args`]: the library owns both sides of that format, so the
//! `kvferry worker` subcommand only forwards its raw arguments.

use std::collections::BTreeMap;
use std::ffi::{OsStr, OsString};
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use super::ClusterError;

/// The largest accepted timeout: anything above an hour is a unit mistake, not a
/// deadline.
pub const MAX_TIMEOUT: Duration = Duration::from_secs(3600);

/// The largest accepted number of ranks.
pub const MAX_RANKS: u32 = 256;

/// Parses a duration such as `500ms`, `2s`, `1.5s`, `250us` or `1m`.
///
/// The number may have a fraction; the unit is required (`ns`, `us`, `ms`, `s`, `m`,
/// `h`). Negative values and bare numbers are errors that say so. Zero parses (to
/// [`Duration::ZERO`]); whether zero is acceptable is the caller's validation.
pub fn parse_duration(input: &str) -> Result<Duration, ClusterError> {
    let bad = |reason: &str| ClusterError::InvalidDuration {
        input: input.to_string(),
        reason: reason.to_string(),
    };
    let s = input.trim();
    if s.is_empty() {
        return Err(bad("empty duration; expected e.g. 500ms or 2s"));
    }
    if s.starts_with('-') {
        return Err(bad("negative durations are not allowed"));
    }
    let split = s.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(s.len());
    let (number, unit) = s.split_at(split);
    if number.is_empty() {
        return Err(bad("missing number; expected e.g. 500ms or 2s"));
    }
    let nanos_per_unit: f64 = match unit.trim() {
        "ns" => 1.0,
        "us" | "µs" => 1e3,
        "ms" => 1e6,
        "s" => 1e9,
        "m" | "min" => 60e9,
        "h" => 3600e9,
        "" => return Err(bad("missing unit (use ns, us, ms, s, m or h)")),
        _ => return Err(bad("unknown unit (use ns, us, ms, s, m or h)")),
    };
    let value: f64 = number.parse().map_err(|_| bad("not a number"))?;
    let nanos = value * nanos_per_unit;
    if !nanos.is_finite() || nanos > u64::MAX as f64 {
        return Err(bad("too large"));
    }
    Ok(Duration::from_nanos(nanos.round() as u64))
}

/// Formats a duration compactly for messages (`1.80s`, `250ms`, `12.3ms`, `40µs`).
pub fn format_duration(d: Duration) -> String {
    let s = d.as_secs_f64();
    if s >= 1.0 {
        format!("{s:.2}s")
    } else if s >= 0.1 {
        format!("{:.0}ms", s * 1e3)
    } else if s >= 1e-3 {
        format!("{:.1}ms", s * 1e3)
    } else {
        format!("{:.0}µs", s * 1e6)
    }
}

/// Checks that a timeout is positive and at most [`MAX_TIMEOUT`].
pub fn check_timeout(field: &'static str, value: Duration) -> Result<(), ClusterError> {
    if value.is_zero() {
        return Err(ClusterError::InvalidConfig {
            field,
            reason: "must be greater than zero".into(),
        });
    }
    if value > MAX_TIMEOUT {
        return Err(ClusterError::InvalidConfig {
            field,
            reason: format!(
                "{} is more than the maximum of {}",
                format_duration(value),
                format_duration(MAX_TIMEOUT)
            ),
        });
    }
    Ok(())
}

/// Which device backend a worker drives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum DeviceKind {
    /// The simulated accelerator, with fault injection.
    Sim,
    /// Host memory standing in for device memory.
    Host,
}

impl DeviceKind {
    /// The name used on command lines.
    pub fn as_str(self) -> &'static str {
        match self {
            DeviceKind::Sim => "sim",
            DeviceKind::Host => "host",
        }
    }
}

impl std::fmt::Display for DeviceKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for DeviceKind {
    type Err = ClusterError;
    fn from_str(s: &str) -> Result<Self, ClusterError> {
        match s {
            "sim" => Ok(DeviceKind::Sim),
            "host" => Ok(DeviceKind::Host),
            _ => Err(ClusterError::InvalidConfig {
                field: "device",
                reason: format!("unknown device {s:?} (expected sim or host)"),
            }),
        }
    }
}

/// A fault a worker injects into its own steps (for tests and the demo).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WorkerFault {
    /// The worker stops answering: the step never completes and no response is sent.
    Hang,
    /// The device event of an offload or land never completes; the worker's bounded
    /// wait turns it into a `DeviceTimeout` FAILURE.
    StuckEvent,
    /// Every device operation takes this much longer (a slow device).
    Slow(Duration),
}

impl std::fmt::Display for WorkerFault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WorkerFault::Hang => f.write_str("hang"),
            WorkerFault::StuckEvent => f.write_str("stuck-event"),
            WorkerFault::Slow(d) => write!(f, "slow:{}ms", d.as_millis()),
        }
    }
}

impl FromStr for WorkerFault {
    type Err = ClusterError;
    fn from_str(s: &str) -> Result<Self, ClusterError> {
        match s {
            "hang" => Ok(WorkerFault::Hang),
            "stuck-event" => Ok(WorkerFault::StuckEvent),
            _ => match s.strip_prefix("slow:") {
                Some(d) => Ok(WorkerFault::Slow(parse_duration(d)?)),
                None => Err(ClusterError::InvalidConfig {
                    field: "fault",
                    reason: format!("unknown fault {s:?} (expected hang, stuck-event or slow:DURATION)"),
                }),
            },
        }
    }
}

/// A fault and the first step (by step id, counting from 1) it applies to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FaultPlan {
    /// What goes wrong.
    pub fault: WorkerFault,
    /// The first step id affected; every later step is affected too.
    pub from_step: u64,
}

/// What each worker process simulates: its device, its KV blocks and staging arena.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkerSetup {
    /// Device backend.
    pub device: DeviceKind,
    /// Bytes per KV block.
    pub block_bytes: usize,
    /// KV blocks in the worker's device region.
    pub blocks: u32,
}

impl Default for WorkerSetup {
    fn default() -> Self {
        WorkerSetup {
            device: DeviceKind::Sim,
            block_bytes: 64 << 10,
            blocks: 64,
        }
    }
}

impl WorkerSetup {
    /// Rejects unusable sizes.
    pub fn validate(&self) -> Result<(), ClusterError> {
        if self.block_bytes == 0 || self.block_bytes > 64 << 20 {
            return Err(ClusterError::InvalidConfig {
                field: "block_bytes",
                reason: format!("{} is not in 1..=64 MiB", self.block_bytes),
            });
        }
        if self.blocks == 0 || self.blocks > 4096 {
            return Err(ClusterError::InvalidConfig {
                field: "blocks",
                reason: format!("{} is not in 1..=4096", self.blocks),
            });
        }
        if self.block_bytes.saturating_mul(self.blocks as usize) > 1 << 30 {
            return Err(ClusterError::InvalidConfig {
                field: "blocks",
                reason: "more than 1 GiB of device memory per worker".into(),
            });
        }
        Ok(())
    }
}

/// How a [`Leader`](super::Leader) starts and drives its workers.
#[derive(Clone, Debug)]
pub struct LeaderConfig {
    /// Number of worker processes (ranks `0..ranks`).
    pub ranks: u32,
    /// The program to execute for each worker (normally the `kvferry` binary).
    pub program: PathBuf,
    /// Arguments placed before the worker flags (normally `["worker"]`).
    pub args: Vec<OsString>,
    /// Deadline of each step, from dispatch to the last rank's answer.
    pub step_timeout: Duration,
    /// Deadline for all workers to start and connect.
    pub startup_timeout: Duration,
    /// How long [`Leader::shutdown`](super::Leader::shutdown) lets workers exit before
    /// killing them.
    pub shutdown_grace: Duration,
    /// What the workers simulate.
    pub worker: WorkerSetup,
    /// Faults to inject, by rank.
    pub faults: BTreeMap<u32, FaultPlan>,
    /// Whether workers inherit the leader's stderr (else it is discarded).
    pub worker_stderr: bool,
}

impl LeaderConfig {
    /// `ranks` workers running `program worker ...`, with default timeouts (2 s per
    /// step, 10 s to start).
    pub fn new(program: impl Into<PathBuf>, ranks: u32) -> LeaderConfig {
        LeaderConfig {
            ranks,
            program: program.into(),
            args: vec!["worker".into()],
            step_timeout: Duration::from_secs(2),
            startup_timeout: Duration::from_secs(10),
            shutdown_grace: Duration::from_millis(500),
            worker: WorkerSetup::default(),
            faults: BTreeMap::new(),
            worker_stderr: true,
        }
    }

    /// Sets the step timeout.
    pub fn step_timeout(mut self, d: Duration) -> Self {
        self.step_timeout = d;
        self
    }

    /// Adds a fault on `rank` from step `from_step` on.
    pub fn fault(mut self, rank: u32, fault: WorkerFault, from_step: u64) -> Self {
        self.faults.insert(rank, FaultPlan { fault, from_step });
        self
    }

    /// Checks every value; the first problem is returned as
    /// [`ClusterError::InvalidConfig`] naming the field.
    pub fn validate(&self) -> Result<(), ClusterError> {
        if self.ranks == 0 || self.ranks > MAX_RANKS {
            return Err(ClusterError::InvalidConfig {
                field: "ranks",
                reason: format!("{} is not in 1..={MAX_RANKS}", self.ranks),
            });
        }
        if self.program.as_os_str().is_empty() {
            return Err(ClusterError::InvalidConfig {
                field: "program",
                reason: "empty worker program path".into(),
            });
        }
        check_timeout("step_timeout", self.step_timeout)?;
        if self.step_timeout < Duration::from_millis(1) {
            return Err(ClusterError::InvalidConfig {
                field: "step_timeout",
                reason: "must be at least 1ms".into(),
            });
        }
        check_timeout("startup_timeout", self.startup_timeout)?;
        check_timeout("shutdown_grace", self.shutdown_grace)?;
        self.worker.validate()?;
        for (rank, plan) in &self.faults {
            if *rank >= self.ranks {
                return Err(ClusterError::InvalidConfig {
                    field: "faults",
                    reason: format!("fault on rank {rank}, but ranks are 0..{}", self.ranks),
                });
            }
            if plan.from_step == 0 {
                return Err(ClusterError::InvalidConfig {
                    field: "faults",
                    reason: "steps count from 1".into(),
                });
            }
            if let WorkerFault::Slow(d) = plan.fault {
                check_timeout("faults (slow)", d)?;
            }
        }
        Ok(())
    }

    /// The time budget a worker gets for its own bounded waits within a step: the step
    /// timeout less a margin, so that a worker-side timeout (with its details) reaches
    /// the leader before the leader's own deadline fires.
    pub fn worker_budget(&self) -> Duration {
        let margin = (self.step_timeout / 10).clamp(Duration::from_millis(1), Duration::from_millis(200));
        self.step_timeout.saturating_sub(margin)
    }
}

/// Everything a worker process needs, as passed on its command line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkerConfig {
    /// The leader's Unix socket.
    pub socket: PathBuf,
    /// This worker's rank.
    pub rank: u32,
    /// Number of ranks.
    pub ranks: u32,
    /// The leader's process id: if the worker's parent is not (or no longer) this
    /// process, the worker exits.
    pub leader_pid: u32,
    /// What the worker simulates.
    pub setup: WorkerSetup,
    /// A fault to inject, if any.
    pub fault: Option<FaultPlan>,
}

impl WorkerConfig {
    /// The worker's command-line flags (what follows `kvferry worker`).
    pub fn to_args(&self) -> Vec<OsString> {
        let mut a: Vec<OsString> = vec![
            "--socket".into(),
            self.socket.clone().into_os_string(),
            "--rank".into(),
            self.rank.to_string().into(),
            "--ranks".into(),
            self.ranks.to_string().into(),
            "--leader-pid".into(),
            self.leader_pid.to_string().into(),
            "--device".into(),
            self.setup.device.as_str().into(),
            "--block-bytes".into(),
            self.setup.block_bytes.to_string().into(),
            "--blocks".into(),
            self.setup.blocks.to_string().into(),
        ];
        if let Some(plan) = self.fault {
            a.push("--fault".into());
            a.push(plan.fault.to_string().into());
            a.push("--fault-from-step".into());
            a.push(plan.from_step.to_string().into());
        }
        a
    }

    /// Parses what [`WorkerConfig::to_args`] produced.
    pub fn parse_args<I, S>(args: I) -> Result<WorkerConfig, ClusterError>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        fn num<T: FromStr>(field: &'static str, v: &str) -> Result<T, ClusterError> {
            v.parse().map_err(|_| ClusterError::InvalidConfig {
                field,
                reason: format!("{v:?} is not a valid number"),
            })
        }
        let missing = |field: &'static str| ClusterError::InvalidConfig {
            field,
            reason: "missing".into(),
        };
        let mut socket = None;
        let (mut rank, mut ranks, mut leader_pid) = (None, None, None);
        let mut setup = WorkerSetup::default();
        let (mut fault, mut from_step) = (None, 1u64);
        let mut it = args.into_iter();
        while let Some(flag) = it.next() {
            let flag = flag.as_ref().to_string_lossy().into_owned();
            let value = it.next().ok_or_else(|| ClusterError::InvalidConfig {
                field: "worker arguments",
                reason: format!("{flag} needs a value"),
            })?;
            let value = value.as_ref();
            let text = value.to_string_lossy();
            match flag.as_str() {
                "--socket" => socket = Some(PathBuf::from(value)),
                "--rank" => rank = Some(num("rank", &text)?),
                "--ranks" => ranks = Some(num("ranks", &text)?),
                "--leader-pid" => leader_pid = Some(num("leader_pid", &text)?),
                "--device" => setup.device = text.parse()?,
                "--block-bytes" => setup.block_bytes = num("block_bytes", &text)?,
                "--blocks" => setup.blocks = num("blocks", &text)?,
                "--fault" => fault = Some(text.parse::<WorkerFault>()?),
                "--fault-from-step" => from_step = num("fault_from_step", &text)?,
                _ => {
                    return Err(ClusterError::InvalidConfig {
                        field: "worker arguments",
                        reason: format!("unknown flag {flag}"),
                    })
                }
            }
        }
        let config = WorkerConfig {
            socket: socket.ok_or_else(|| missing("socket"))?,
            rank: rank.ok_or_else(|| missing("rank"))?,
            ranks: ranks.ok_or_else(|| missing("ranks"))?,
            leader_pid: leader_pid.ok_or_else(|| missing("leader_pid"))?,
            setup,
            fault: fault.map(|fault| FaultPlan { fault, from_step }),
        };
        if config.rank >= config.ranks {
            return Err(ClusterError::InvalidConfig {
                field: "rank",
                reason: format!("rank {} is not below ranks {}", config.rank, config.ranks),
            });
        }
        config.setup.validate()?;
        Ok(config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn durations_parse() {
        assert_eq!(parse_duration("500ms").unwrap(), ms(500));
        assert_eq!(parse_duration("2s").unwrap(), ms(2000));
        assert_eq!(parse_duration("1.5s").unwrap(), ms(1500));
        assert_eq!(parse_duration("250us").unwrap(), Duration::from_micros(250));
        assert_eq!(parse_duration("1m").unwrap(), ms(60_000));
        assert_eq!(parse_duration(" 3h ").unwrap(), Duration::from_secs(3 * 3600));
        assert_eq!(parse_duration("0s").unwrap(), Duration::ZERO);
    }

    #[test]
    fn bad_durations_say_why() {
        for (input, why) in [
            ("-1s", "negative"),
            ("", "empty"),
            ("5", "missing unit"),
            ("ms", "missing number"),
            ("5 parsecs", "unknown unit"),
            ("1.2.3s", "not a number"),
            ("99999999999999999999999h", "too large"),
        ] {
            let err = parse_duration(input).unwrap_err();
            assert!(
                matches!(&err, ClusterError::InvalidDuration { reason, .. } if reason.contains(why)),
                "{input:?}: {err}"
            );
        }
    }

    #[test]
    fn timeouts_are_validated_once_at_start() {
        let ok = LeaderConfig::new("/bin/true", 8);
        ok.validate().unwrap();
        for (config, field) in [
            (ok.clone().step_timeout(Duration::ZERO), "step_timeout"),
            (ok.clone().step_timeout(Duration::from_secs(3601)), "step_timeout"),
            (ok.clone().step_timeout(Duration::from_micros(10)), "step_timeout"),
            (
                LeaderConfig {
                    startup_timeout: Duration::ZERO,
                    ..ok.clone()
                },
                "startup_timeout",
            ),
            (LeaderConfig { ranks: 0, ..ok.clone() }, "ranks"),
            (
                LeaderConfig {
                    ranks: 100_000,
                    ..ok.clone()
                },
                "ranks",
            ),
            (ok.clone().fault(8, WorkerFault::Hang, 1), "faults"),
            (ok.clone().fault(1, WorkerFault::Hang, 0), "faults"),
        ] {
            let err = config.validate().unwrap_err();
            assert!(
                matches!(&err, ClusterError::InvalidConfig { field: f, .. } if *f == field),
                "{field}: {err}"
            );
        }
        let msg = ok
            .clone()
            .step_timeout(Duration::from_secs(7200))
            .validate()
            .unwrap_err()
            .to_string();
        assert!(msg.contains("step_timeout") && msg.contains("maximum"), "{msg}");
    }

    #[test]
    fn worker_budget_leaves_a_margin() {
        let c = LeaderConfig::new("x", 1).step_timeout(Duration::from_secs(2));
        assert_eq!(c.worker_budget(), ms(1800));
        let c = c.step_timeout(ms(100));
        assert_eq!(c.worker_budget(), ms(90));
    }

    #[test]
    fn worker_args_round_trip() {
        let c = WorkerConfig {
            socket: "/tmp/x/leader.sock".into(),
            rank: 3,
            ranks: 8,
            leader_pid: 42,
            setup: WorkerSetup {
                device: DeviceKind::Host,
                block_bytes: 4096,
                blocks: 7,
            },
            fault: Some(FaultPlan {
                fault: WorkerFault::Slow(ms(250)),
                from_step: 2,
            }),
        };
        assert_eq!(WorkerConfig::parse_args(c.to_args()).unwrap(), c);
        let c = WorkerConfig { fault: None, ..c };
        assert_eq!(WorkerConfig::parse_args(c.to_args()).unwrap(), c);
        for f in [WorkerFault::Hang, WorkerFault::StuckEvent] {
            assert_eq!(f.to_string().parse::<WorkerFault>().unwrap(), f);
        }
    }

    #[test]
    fn bad_worker_args_are_rejected() {
        assert!(WorkerConfig::parse_args(["--rank", "1"]).is_err());
        assert!(WorkerConfig::parse_args(["--bogus", "1"]).is_err());
        assert!(WorkerConfig::parse_args(["--rank"]).is_err());
        let err = WorkerConfig::parse_args(["--socket", "/s", "--rank", "8", "--ranks", "8", "--leader-pid", "1"])
            .unwrap_err();
        assert!(
            matches!(err, ClusterError::InvalidConfig { field: "rank", .. }),
            "{err}"
        );
    }
}
