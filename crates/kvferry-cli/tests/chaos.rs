//! `kvferry chaos` end to end: a short soak under every fault reports zero corrupted
//! bytes, leaked pages and late returns (and really injected the faults), a run without
//! faults completes every transfer, each check catches a deliberate violation (exit
//! status 1 after the ledger), and bad arguments are refused.

mod common;

use std::process::Output;
use std::sync::Mutex;

use common::{run_subcommand, text};
use serde_json::Value;

/// One run at a time: concurrent soaks on a small machine would only measure each
/// other's scheduling delays.
static SERIAL: Mutex<()> = Mutex::new(());

fn chaos(args: &[&str]) -> Output {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    run_subcommand("chaos", args)
}

fn ledger(out: &Output) -> Value {
    let stdout = text(&out.stdout);
    serde_json::from_str(stdout.trim())
        .unwrap_or_else(|e| panic!("bad JSON ledger {stdout:?}: {e}; stderr: {}", text(&out.stderr)))
}

fn n(v: &Value, field: &str) -> u64 {
    v[field]
        .as_u64()
        .unwrap_or_else(|| panic!("{field} missing or not a count in {v}"))
}

#[test]
fn a_short_soak_under_every_fault_keeps_the_three_promises() {
    let out = chaos(&["--transfers", "300", "--seed", "1", "--json"]);
    let v = ledger(&out);
    assert!(out.status.success(), "{v:#}\n{}", text(&out.stderr));
    assert!(text(&out.stderr).contains("seed 1"), "the seed is printed");
    for zero in [
        "corrupted_bytes",
        "leaked_pages",
        "late_returns",
        "anomalies",
        "stuck_drains",
    ] {
        assert_eq!(n(&v, zero), 0, "{zero}: {v:#}");
    }
    assert_eq!(n(&v, "transfers"), 300);
    let ended = ["completed", "cancelled", "timed_out", "failed"].map(|f| n(&v, f));
    assert_eq!(ended.iter().sum::<u64>(), 300, "every transfer is booked once: {v:#}");
    assert!(n(&v, "completed") > 0, "{v:#}");
    assert!(n(&v, "cancelled") > 0 && n(&v, "timed_out") > 0, "{v:#}");
    assert!(n(&v, "peer_kills") >= 1, "{v:#}");
    assert!(n(&v, "faults_injected") > 0, "{v:#}");
    for kind in ["caller_drops", "short_deadlines", "peer_kills"] {
        assert!(v["faults"][kind].as_u64().unwrap_or(0) > 0, "no {kind}: {v:#}");
    }
    assert!(n(&v, "verified_bytes") > 0, "{v:#}");
    // The default transport: the device link copies device to device (device IPC),
    // whole chunks and selected halves, under the same faults.
    assert!(n(&v, "device_ipc_transfers") > 0, "{v:#}");
    assert!(v["max_overrun_ms"].as_f64().is_some(), "{v:#}");
    assert!(n(&v, "quarantined_pages") <= 256, "{v:#}");
    let arenas = v["arenas"].as_array().unwrap();
    let names: Vec<&str> = arenas.iter().filter_map(|a| a["name"].as_str()).collect();
    assert_eq!(
        names.len(),
        6,
        "consumer, sim offloads, the device link's two engines and two producers: {v:#}"
    );
    for name in [
        "consumer",
        "sim-offload",
        "device-link-producer",
        "device-link-consumer",
    ] {
        assert!(names.contains(&name), "no {name} arena: {v:#}");
    }
}

#[test]
fn without_faults_every_transfer_completes_and_the_text_ledger_says_ok() {
    let out = chaos(&["--transfers", "120", "--seed", "2", "--fault-rate", "0"]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    assert!(stdout.contains("kvferry chaos: 120 transfers"), "{stdout}");
    assert!(stdout.contains("result      OK"), "{stdout}");
    assert!(stdout.contains("0 injected"), "{stdout}");
    assert!(
        stdout.contains("completed 120 (misses 0, partial 0), cancelled 0, timed out 0, failed 0"),
        "{stdout}"
    );
}

#[test]
fn each_check_catches_a_deliberate_violation() {
    for (sabotage, field) in [
        ("corrupt", "corrupted_bytes"),
        ("leak", "leaked_pages"),
        ("late", "late_returns"),
    ] {
        let out = chaos(&[
            "--transfers",
            "40",
            "--seed",
            "3",
            "--fault-rate",
            "0",
            "--json",
            "--sabotage",
            sabotage,
        ]);
        let v = ledger(&out);
        assert_eq!(out.status.code(), Some(1), "{sabotage}: {v:#}");
        assert!(n(&v, field) > 0, "{sabotage}: {v:#}");
        assert_eq!(v["ok"], false, "{v:#}");
        assert!(
            text(&out.stderr).contains("error: chaos found"),
            "{}",
            text(&out.stderr)
        );
    }
}

#[test]
fn bad_arguments_are_refused() {
    for (args, needle) in [
        (&["--transfers", "0"][..], "--transfers must be at least 1"),
        (&["--producers", "0"][..], "--producers must be 1..=16"),
        (&["--fault-rate", "11"][..], "--fault-rate must be between 0 and 10"),
        (&["--duration-cap", "0s"][..], "greater than zero"),
    ] {
        let out = chaos(args);
        // Flag errors, found by the parser or after it, are usage errors: exit 2.
        assert_eq!(out.status.code(), Some(2));
        assert!(text(&out.stderr).contains(needle), "{args:?}: {}", text(&out.stderr));
    }
}
