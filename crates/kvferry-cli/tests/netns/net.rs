//! A private network: a bridge in a "switch" namespace and N host namespaces, each with
//! one veth pair (`eth0` in the host, `pI` on the bridge) and an address on
//! 10.77.0.0/24 (host I is 10.77.0.(I+1)).
//!
//! Helpers shape a host's link with `tbf` (both directions), partition a host (an
//! nftables table in the host that drops everything on `eth0`: packets vanish, as on a
//! cut cable behind a switch), take its switch port down, and heal it. Every helper is
//! a bounded `ip`/`tc`/`nft` command; a failing command is reported with its stderr.
//!
//! Drop kills every process still inside the namespaces and deletes them (which
//! destroys the veths and the bridge). It never panics, so it is safe during unwinding.

use std::net::Ipv4Addr;
use std::os::fd::AsRawFd;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};

static NEXT: AtomicUsize = AtomicUsize::new(0);

const NETNS_DIR: &str = "/run/netns";

/// One host: a network namespace with `eth0` on the private subnet.
#[derive(Clone, Debug)]
pub struct Host {
    /// Index in the network (host I has address 10.77.0.(I+1)).
    pub index: usize,
    /// The namespace's name (`ip netns exec NAME ...`).
    pub ns: String,
    /// The host's address.
    pub ip: Ipv4Addr,
}

impl Host {
    /// `IP:PORT` of this host.
    pub fn addr(&self, port: u16) -> String {
        format!("{}:{port}", self.ip)
    }

    /// A command that runs `program` inside this host.
    pub fn command(&self, program: &str) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.ns, program]);
        c
    }

    /// Runs `f` on a new thread that has joined this host's network namespace and
    /// returns its result. Threads (and tokio workers) that `f` spawns are in the
    /// namespace too: a new thread inherits its creator's namespaces.
    pub fn run_in<R: Send + 'static>(&self, f: impl FnOnce() -> R + Send + 'static) -> R {
        let ns = self.ns.clone();
        std::thread::Builder::new()
            .name(format!("in-{ns}"))
            .spawn(move || {
                enter(&ns);
                f()
            })
            .expect("spawn namespace thread")
            .join()
            .unwrap_or_else(|p| std::panic::resume_unwind(p))
    }
}

/// Moves the calling thread into the network namespace `ns`; panics on failure.
pub fn enter(ns: &str) {
    let f = std::fs::File::open(format!("{NETNS_DIR}/{ns}")).unwrap_or_else(|e| panic!("open netns {ns}: {e}"));
    // SAFETY: setns(2) on a valid, open namespace fd; it changes only this thread's
    // network namespace (allowed in a multi-threaded process for CLONE_NEWNET).
    let rc = unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) };
    assert_eq!(rc, 0, "setns into {ns}: {}", std::io::Error::last_os_error());
}

/// The inode of the network namespace the calling thread is in (to check that code
/// runs where it should).
pub fn current_netns_inode() -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/thread-self/ns/net")
        .map(|m| m.ino())
        .unwrap_or(0)
}

/// The inode of the named namespace.
pub fn netns_inode(ns: &str) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(format!("{NETNS_DIR}/{ns}"))
        .map(|m| m.ino())
        .unwrap_or(0)
}

/// A private network of hosts; removed on drop.
pub struct Network {
    prefix: String,
    switch: String,
    hosts: Vec<Host>,
    created: Vec<String>,
}

/// Runs a command to completion; the error carries the command line and its stderr.
pub fn run(program: &str, args: &[&str]) -> Result<String, String> {
    let out = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("{program} {}: {e}", args.join(" ")))?;
    if !out.status.success() {
        return Err(format!(
            "{program} {} failed ({}): {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Like [`run`], feeding `input` on stdin.
fn run_stdin(program: &str, args: &[&str], input: &str) -> Result<(), String> {
    use std::io::Write;
    let mut child = Command::new(program)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("{program}: {e}"))?;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .map_err(|e| e.to_string())?;
    let out = child.wait_with_output().map_err(|e| e.to_string())?;
    if !out.status.success() {
        return Err(format!(
            "{program} {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(())
}

impl Network {
    /// A network of `n` hosts, or the reason none can be made here.
    pub fn new(n: usize) -> Result<Network, String> {
        assert!((1..=200).contains(&n), "1..=200 hosts");
        // SAFETY: geteuid(2) has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return Err("not root: network namespaces need CAP_SYS_ADMIN/CAP_NET_ADMIN".into());
        }
        run("ip", &["-V"]).map_err(|e| format!("no usable `ip` command, install iproute2 ({e})"))?;
        // `partition` and `heal` cut links with nftables: a host without `nft` cannot
        // run these tests (scripts/install-test-deps.sh installs it).
        run("nft", &["--version"]).map_err(|e| format!("no usable `nft` command, install nftables ({e})"))?;
        sweep_stale();
        let pid = std::process::id();
        let prefix = format!("kf{pid}-{}", NEXT.fetch_add(1, Ordering::Relaxed));
        let mut net = Network {
            switch: format!("{prefix}-sw"),
            prefix,
            hosts: Vec::new(),
            created: Vec::new(),
        };
        net.build(n)?;
        Ok(net)
    }

    /// [`Network::new`], or `None` after printing why the test is skipped. With
    /// `CI=true` a network that cannot be made is a failure, not a skip.
    pub fn or_skip(n: usize, test: &str) -> Option<Network> {
        match Network::new(n) {
            Ok(net) => Some(net),
            Err(why) => {
                if std::env::var("CI").is_ok_and(|v| v == "true") {
                    panic!("{test}: cannot create network namespaces in CI: {why}");
                }
                super::skip(test, &format!("cannot create network namespaces here: {why}"));
                None
            }
        }
    }

    fn build(&mut self, n: usize) -> Result<(), String> {
        let sw = self.switch.clone();
        run("ip", &["netns", "add", &sw])?;
        self.created.push(sw.clone());
        run("ip", &["-n", &sw, "link", "add", "br0", "type", "bridge"])?;
        run("ip", &["-n", &sw, "link", "set", "br0", "up"])?;
        run("ip", &["-n", &sw, "link", "set", "lo", "up"])?;
        for i in 0..n {
            let ns = format!("{}-h{i}", self.prefix);
            run("ip", &["netns", "add", &ns])?;
            self.created.push(ns.clone());
            let port = format!("p{i}");
            run(
                "ip",
                &[
                    "link", "add", "eth0", "netns", &ns, "type", "veth", "peer", "name", &port, "netns", &sw,
                ],
            )?;
            run("ip", &["-n", &sw, "link", "set", &port, "master", "br0", "up"])?;
            let ip = Ipv4Addr::new(10, 77, 0, i as u8 + 1);
            run("ip", &["-n", &ns, "addr", "add", &format!("{ip}/24"), "dev", "eth0"])?;
            run("ip", &["-n", &ns, "link", "set", "eth0", "up"])?;
            run("ip", &["-n", &ns, "link", "set", "lo", "up"])?;
            self.hosts.push(Host { index: i, ns, ip });
        }
        Ok(())
    }

    /// Host `i`.
    pub fn host(&self, i: usize) -> &Host {
        &self.hosts[i]
    }

    /// All hosts.
    pub fn hosts(&self) -> &[Host] {
        &self.hosts
    }

    /// Shapes host `h`'s link to `rate` (a `tc` rate, e.g. "1gbit", "200mbit") in both
    /// directions with a token bucket filter.
    pub fn shape(&self, h: &Host, rate: &str) -> Result<(), String> {
        let tbf = |ns: &str, dev: &str| {
            run(
                "tc",
                &[
                    "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst", "256kb", "latency",
                    "200ms",
                ],
            )
        };
        tbf(&h.ns, "eth0")?;
        tbf(&self.switch, &format!("p{}", h.index)).map(|_| ())
    }

    /// Cuts host `h` off: every packet in or out of its `eth0` is dropped silently (an
    /// nftables table in the host), so peers see silence, not resets.
    pub fn partition(&self, h: &Host) -> Result<(), String> {
        let rules = "table inet kvferry_partition {\n\
             chain input_drop { type filter hook input priority -300; policy accept; iifname \"eth0\" drop; }\n\
             chain output_drop { type filter hook output priority -300; policy accept; oifname \"eth0\" drop; }\n\
             }\n";
        run_stdin("ip", &["netns", "exec", &h.ns, "nft", "-f", "-"], rules)
    }

    /// Undoes [`Network::partition`].
    pub fn heal(&self, h: &Host) -> Result<(), String> {
        run(
            "ip",
            &[
                "netns",
                "exec",
                &h.ns,
                "nft",
                "delete",
                "table",
                "inet",
                "kvferry_partition",
            ],
        )
        .map(|_| ())
    }

    /// Takes host `h`'s switch port down (`up == false`) or up again.
    pub fn set_link(&self, h: &Host, up: bool) -> Result<(), String> {
        let port = format!("p{}", h.index);
        run(
            "ip",
            &["-n", &self.switch, "link", "set", &port, if up { "up" } else { "down" }],
        )
        .map(|_| ())
    }
}

impl Drop for Network {
    fn drop(&mut self) {
        for ns in self.created.iter().rev() {
            kill_all_in(ns);
            let _ = run("ip", &["netns", "del", ns]);
        }
    }
}

/// SIGKILLs every process in namespace `ns` and waits (bounded) for them to go.
fn kill_all_in(ns: &str) {
    let pids = |ns: &str| -> Vec<i32> {
        run("ip", &["netns", "pids", ns])
            .unwrap_or_default()
            .split_whitespace()
            .filter_map(|p| p.parse().ok())
            .collect()
    };
    for _ in 0..50 {
        let list = pids(ns);
        if list.is_empty() {
            return;
        }
        for p in list {
            // SAFETY: kill(2) with a pid listed as living in our test namespace.
            unsafe { libc::kill(p, libc::SIGKILL) };
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// Deletes namespaces left by test processes that no longer run (killed before their
/// `Drop`): names are `kf<pid>-...`.
fn sweep_stale() {
    let Ok(dir) = std::fs::read_dir(NETNS_DIR) else { return };
    for e in dir.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(pid) = name
            .strip_prefix("kf")
            .and_then(|r| r.split('-').next())
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            kill_all_in(&name);
            let _ = run("ip", &["netns", "del", &name]);
        }
    }
}
