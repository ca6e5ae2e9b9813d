//! `kvferry cluster-demo` end to end: exit status, printed failures (kind, rank, time to
//! surface), start-up rejection of bad configuration, `--help`, and workers exiting on
//! their own when the leader process is SIGKILLed.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::{run_subcommand, text};
use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_kvferry");

fn demo(args: &[&str]) -> Output {
    run_subcommand("cluster-demo", args)
}

fn events(out: &Output) -> Vec<Value> {
    text(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("bad JSON line {l:?}: {e}")))
        .collect()
}

fn event<'a>(events: &'a [Value], name: &str) -> Vec<&'a Value> {
    events.iter().filter(|e| e["event"] == name).collect()
}

/// Whether `pid` is a live (not zombie) process.
fn alive(pid: u64) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => {
            let state = stat.rsplit(')').next().unwrap_or("").trim_start().chars().next();
            !matches!(state, Some('Z') | Some('X'))
        }
        Err(_) => false,
    }
}

#[test]
fn a_clean_run_succeeds_and_lands_what_it_offloaded() {
    let out = demo(&["--ranks", "3", "--steps", "4", "--json"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let ev = events(&out);
    let steps = event(&ev, "step");
    assert_eq!(steps.len(), 4);
    for s in &steps {
        assert_eq!(s["outcome"], "ok", "{s}");
        assert_eq!(s["ranks"], 3);
    }
    assert_eq!(steps[1]["checksums_match"], true);
    assert_eq!(event(&ev, "summary")[0]["ok"], true);
}

#[test]
fn a_killed_rank_is_reported_as_worker_died_naming_it() {
    let out = demo(&["--ranks", "3", "--inject-kill", "1", "--json"]);
    assert!(!out.status.success());
    let ev = events(&out);
    let failed: Vec<_> = event(&ev, "step")
        .into_iter()
        .filter(|s| s["outcome"] == "failed")
        .collect();
    assert_eq!(failed.len(), 1, "{ev:?}");
    let f = failed[0];
    assert_eq!(f["step"], 2);
    assert_eq!(f["kind"], "WorkerDied");
    assert_eq!(f["rank"], 1);
    assert!(f["after_kill_ms"].as_f64().unwrap() < 1000.0, "{f}");
    let health = event(&ev, "health")[0];
    assert_eq!(health["healthy"], false);
    assert_eq!(health["problems"][0]["state"], "dead");
    assert!(
        text(&out.stderr).contains("WorkerDied on rank 1"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn a_stuck_event_is_reported_as_device_timeout_naming_the_rank_on_time() {
    let out = demo(&["--ranks", "8", "--inject-stuck-event", "3", "--step-timeout", "500ms"]);
    assert!(!out.status.success());
    let stdout = text(&out.stdout);
    assert!(stdout.contains("FAILED  DeviceTimeout on rank 3"), "{stdout}");
    assert!(stdout.contains("health: unhealthy: rank 3"), "{stdout}");
    assert!(text(&out.stderr).contains("step 2 failed: DeviceTimeout on rank 3"));
}

#[test]
fn a_hung_rank_is_reported_as_timeout_and_stuck() {
    let out = demo(&[
        "--ranks",
        "2",
        "--inject-hang",
        "1",
        "--step-timeout",
        "300ms",
        "--json",
    ]);
    assert!(!out.status.success());
    let ev = events(&out);
    let f = event(&ev, "step")[1];
    assert_eq!(
        (f["kind"].as_str(), f["rank"].as_u64()),
        (Some("Timeout"), Some(1)),
        "{f}"
    );
    let elapsed = f["elapsed_ms"].as_f64().unwrap();
    assert!((300.0..550.0).contains(&elapsed), "{f}");
    let health = event(&ev, "health")[0];
    assert_eq!(health["problems"][0]["state"], "stuck", "{health}");
    assert_eq!(health["problems"][0]["rank"], 1, "{health}");
}

#[test]
fn bad_configuration_fails_at_start_up_with_a_clear_message() {
    for (args, expected) in [
        (&["--step-timeout", "0s"][..], "step_timeout: must be greater than zero"),
        (&["--step-timeout", "-5s"], "negative durations are not allowed"),
        (&["--step-timeout", "2h"], "more than the maximum of 3600"),
        (&["--step-timeout", "5"], "missing unit"),
        (&["--startup-timeout", "soon"], "invalid --startup-timeout"),
        (&["--ranks", "0"], "ranks"),
        (&["--ranks", "4", "--inject-hang", "9"], "ranks are 0..4"),
        (
            &["--steps", "2", "--fault-step", "3", "--inject-hang", "0"],
            "fault_step",
        ),
    ] {
        let out = demo(args);
        let stderr = text(&out.stderr);
        assert!(!out.status.success(), "{args:?} was accepted");
        assert!(stderr.contains(expected), "{args:?}: {stderr}");
        assert!(!text(&out.stdout).contains("workers up"), "{args:?} started workers");
    }
}

#[test]
fn help_explains_every_flag_and_hides_the_worker_command() {
    let out = demo(&["--help"]);
    assert!(out.status.success());
    let help = text(&out.stdout);
    for flag in [
        "--ranks",
        "--steps",
        "--step-timeout",
        "--startup-timeout",
        "--inject-hang",
        "--inject-kill",
        "--inject-stuck-event",
        "--fault-step",
        "--json",
        "WorkerDied",
        "DeviceTimeout",
        "Timeout",
    ] {
        assert!(help.contains(flag), "--help does not mention {flag}:\n{help}");
    }
    let top = Command::new(BIN).arg("--help").output().unwrap();
    let top = text(&top.stdout);
    assert!(top.contains("cluster-demo"), "{top}");
    assert!(
        !top.lines().any(|l| l.trim_start().starts_with("worker")),
        "the worker subcommand should be hidden:\n{top}"
    );
}

#[test]
fn workers_exit_on_their_own_when_the_leader_is_killed() {
    let mut leader = Command::new(BIN)
        .args([
            "cluster-demo",
            "--ranks",
            "4",
            "--inject-hang",
            "2",
            "--step-timeout",
            "30s",
            "--json",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(leader.stdout.take().unwrap()).lines();
    let started: Value = serde_json::from_str(&lines.next().unwrap().unwrap()).unwrap();
    assert_eq!(started["event"], "started");
    let pids: Vec<u64> = started["worker_pids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p.as_u64().unwrap())
        .collect();
    let dir = std::path::PathBuf::from(started["socket_dir"].as_str().unwrap());
    // Step 1 succeeds; step 2 hangs on rank 2 for up to 30 s.
    let step1: Value = serde_json::from_str(&lines.next().unwrap().unwrap()).unwrap();
    assert_eq!(step1["outcome"], "ok");
    std::thread::sleep(Duration::from_millis(100));
    assert!(pids.iter().all(|p| alive(*p)));

    leader.kill().unwrap();
    leader.wait().unwrap();
    let t0 = Instant::now();
    while pids.iter().any(|p| alive(*p)) {
        assert!(
            t0.elapsed() < Duration::from_millis(1500),
            "workers still alive 1.5 s after the leader died: {:?}",
            pids.iter().filter(|p| alive(**p)).collect::<Vec<_>>()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    // A killed leader cannot remove its socket directory; the next leader sweeps it.
    assert!(dir.exists());
    let out = demo(&["--ranks", "1", "--steps", "1"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(!dir.exists(), "{} left behind", dir.display());
}

#[test]
fn a_worker_whose_parent_is_not_its_leader_exits_at_once() {
    let t0 = Instant::now();
    let out = Command::new(BIN)
        .args([
            "worker",
            "--socket",
            "/nonexistent/leader.sock",
            "--rank",
            "0",
            "--ranks",
            "1",
        ])
        .args(["--leader-pid", "1"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(3), "{}", text(&out.stderr));
    assert!(t0.elapsed() < Duration::from_secs(1));

    let out = Command::new(BIN).args(["worker", "--rank", "x"]).output().unwrap();
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("rank"), "{}", text(&out.stderr));
}
