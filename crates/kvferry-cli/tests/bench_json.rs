//! `kvferry bench --json` (the main job, small): one object with the fields the
//! transfer issue names, consistent with each other, and a clean integrity record.

use std::process::Command;

/// `kvferry bench --json --quiet` on the tiny model, 64 blocks a chunk, `requests`
/// requests over `bytes` in all; the caller adds the rest.
fn small_bench_json(requests: &str, bytes: &str) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvferry"));
    cmd.args([
        "bench",
        "--json",
        "--quiet",
        "--model",
        "tiny",
        "--blocks-per-chunk",
        "64",
        "--requests",
        requests,
        "--bytes",
        bytes,
    ]);
    cmd
}

#[test]
fn bench_json_has_every_field_and_no_integrity_failure() {
    let out = small_bench_json("4", "16MiB").output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "bench failed: {stderr}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object on stdout");
    let num = |k: &str| {
        v.get(k)
            .and_then(|x| x.as_f64())
            .unwrap_or_else(|| panic!("missing numeric field {k}: {v}"))
    };
    for k in [
        "gbps",
        "tcp_limit_gbps",
        "tcp_hot_limit_gbps",
        "pipeline_limit_gbps",
        "memcpy_gbps",
        "p50_ms",
        "p99_ms",
    ] {
        assert!(num(k) > 0.0, "{k} must be a measured, positive figure: {v}");
    }
    // tiny: 2 layers × K/V × 4 tokens × 1 head × 64 dims × 2 bytes = 2 KiB per block.
    let chunk = num("chunk_bytes") as u64;
    assert_eq!(chunk, 64 * 2048, "{v}");
    assert_eq!(num("chunks") as u64, (16 << 20) / chunk, "{v}");
    assert_eq!(
        num("bytes") as u64,
        num("chunks") as u64 * chunk,
        "every chunk moved: {v}"
    );
    assert!(num("p99_ms") >= num("p50_ms"), "{v}");
    // three interleaved rounds; the ratio compares the best of them with the best raw-TCP run
    let rounds: Vec<f64> = v["round_gbps"]
        .as_array()
        .unwrap_or_else(|| panic!("round_gbps is a list: {v}"))
        .iter()
        .map(|x| x.as_f64().expect("a number"))
        .collect();
    assert_eq!(rounds.len(), 3, "{v}");
    assert!(rounds.iter().all(|g| *g > 0.0), "{v}");
    let best = rounds.iter().cloned().fold(0.0, f64::max);
    assert_eq!(num("best_round_gbps"), best, "{v}");
    assert!(
        best >= num("gbps") * 0.999,
        "the best round is at least the average: {v}"
    );
    assert!((num("ratio") - best / num("tcp_limit_gbps")).abs() < 1e-9, "{v}");
    assert!(
        (num("ratio_overall") - num("gbps") / num("tcp_limit_gbps")).abs() < 1e-9,
        "{v}"
    );
    assert_eq!(num("errors"), 0.0, "{v}");
    assert_eq!(num("corrupted_bytes"), 0.0, "{v}");
    assert_eq!(num("leaked_pages"), 0.0, "{v}");
}

/// CPU per GB over the transfer and raw-TCP phases, and `--contend N`: the same point
/// measured again beside N busy threads, in the same invocation.
#[test]
fn bench_json_reports_cpu_per_gb_and_the_contended_point() {
    let out = small_bench_json("4", "16MiB")
        .args(["--contend", "1"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "bench failed: {stderr}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object on stdout");
    let num = |o: &serde_json::Value, k: &str| {
        o.get(k)
            .and_then(|x| x.as_f64())
            .unwrap_or_else(|| panic!("missing numeric field {k}: {o}"))
    };
    let c = v.get("contended").unwrap_or_else(|| panic!("no contended point: {v}"));
    assert_eq!(num(&v, "contend"), 0.0);
    assert_eq!(num(c, "contend"), 1.0);
    assert!(c.get("contended").is_none(), "one level: {c}");
    for p in [&v, c] {
        for k in ["cpu_s_per_gb", "tcp_cpu_s_per_gb", "cpu_ratio"] {
            assert!(num(p, k) > 0.0, "{k} must be measured: {p}");
        }
        assert!((num(p, "cpu_ratio") - num(p, "cpu_s_per_gb") / num(p, "tcp_cpu_s_per_gb")).abs() < 1e-9);
        // Wake-ups per chunk are counted (a transfer blocks somewhere: never zero in
        // all), and the direct path verifies with the receive path's checksums.
        assert!(num(p, "wakeups_per_chunk") >= 0.0 && num(p, "preemptions_per_chunk") >= 0.0);
        assert!(num(p, "tcp_wakeups_per_chunk") >= 0.0);
        assert_eq!(p["verify"], "receive", "{p}");
        assert_eq!(num(p, "corrupted_bytes"), 0.0);
        assert_eq!(num(p, "leaked_pages"), 0.0);
    }
    // The busy thread's CPU is not the benchmark's: CPU per GB stays of the same order.
    assert!(num(c, "cpu_s_per_gb") < 10.0 * num(&v, "cpu_s_per_gb") + 1.0, "{v}");
}

/// `--verify reread` checksums every landed chunk again; `receive` (the default) uses
/// the receive path's checksums on the direct path and still re-reads on the staged
/// path, whose receive checksums are taken in staging pages. Both find nothing wrong
/// in a clean run.
#[test]
fn bench_verify_modes_are_reported_per_path() {
    for (path, verify, want) in [("direct", "reread", "reread"), ("staged", "receive", "reread")] {
        let out = small_bench_json("4", "8MiB")
            .args(["--path", path, "--verify", verify])
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v["verify"], want, "--path {path} --verify {verify}: {v}");
        assert_eq!(v["corrupted_bytes"], 0, "{v}");
        assert_eq!(v["errors"], 0, "{v}");
    }
}

/// The JSON names the crc32c implementation, and `KVFERRY_CRC32C` forces one (the
/// portable `crc32-instruction` runs on every x86-64 CPU of this project's kind; on
/// other CPUs the override is refused with a warning and detection decides).
#[test]
fn bench_json_names_the_checksum_implementation_and_the_override_takes_effect() {
    let run = |forced: Option<&str>| {
        let mut cmd = small_bench_json("2", "4MiB");
        cmd.env_remove("KVFERRY_CRC32C");
        if let Some(f) = forced {
            cmd.env("KVFERRY_CRC32C", f);
        }
        let out = cmd.output().unwrap();
        assert!(
            out.status.success(),
            "bench failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
        assert_eq!(v["corrupted_bytes"], 0, "{v}");
        (
            v["checksum_impl"]
                .as_str()
                .unwrap_or_else(|| panic!("no checksum_impl: {v}"))
                .to_string(),
            out.stderr,
        )
    };
    let (chosen, _) = run(None);
    assert!(
        ["fold-clmul", "fold-avx2", "crc32-instruction"].contains(&chosen.as_str()),
        "{chosen}"
    );
    if cfg!(target_arch = "x86_64") && std::arch::is_x86_feature_detected!("sse4.2") {
        assert_eq!(run(Some("crc32-instruction")).0, "crc32-instruction");
    }
    // an unknown name is not silently taken: a warning, and the detected one
    let (fallback, stderr) = run(Some("no-such-crc"));
    assert_eq!(fallback, chosen);
    assert!(
        String::from_utf8_lossy(&stderr).contains("KVFERRY_CRC32C=\"no-such-crc\""),
        "{}",
        String::from_utf8_lossy(&stderr)
    );
}

/// The mover: on one host (one boot id) `--transport auto` (the default) runs the
/// producers in a process of their own and the consumer reads their granted bytes with
/// `process_vm_readv` (`mover` "cma", with the one-copy limit measured in the same
/// run); `--transport tcp` (or its older spelling `--mover tcp`) keeps every byte on
/// the socket. Both land every byte right and leak nothing (the producer process
/// counts its own pages).
#[test]
fn bench_json_names_the_mover_cma_by_default_and_socket_with_transport_tcp() {
    for (extra, want) in [
        (None, "cma"),
        (Some(["--transport", "tcp"]), "socket"),
        (Some(["--mover", "tcp"]), "socket"),
    ] {
        let mut cmd = small_bench_json("4", "8MiB");
        if let Some(args) = extra {
            cmd.args(args);
        }
        let out = cmd.output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v["mover"], want, "{extra:?}: {v}");
        assert_eq!(v["corrupted_bytes"], 0, "{v}");
        assert_eq!(v["leaked_pages"], 0, "{v}");
        assert_eq!(v["errors"], 0, "{v}");
        let limit = v["cma_limit_gbps"]
            .as_f64()
            .unwrap_or_else(|| panic!("one-copy limit measured: {v}"));
        assert!(limit > 0.0, "{v}");
        let ratio = v["ratio_cma_limit"].as_f64().unwrap();
        assert!(
            (ratio - v["best_round_gbps"].as_f64().unwrap() / limit).abs() < 1e-9,
            "{v}"
        );
        // The same reads with every chunk's crc32c: measured beside the bare limit.
        let verified = v["cma_verified_limit_gbps"]
            .as_f64()
            .unwrap_or_else(|| panic!("verified one-copy limit measured: {v}"));
        assert!(verified > 0.0, "{v}");
        let ratio = v["ratio_cma_verified_limit"].as_f64().unwrap();
        assert!(
            (ratio - v["best_round_gbps"].as_f64().unwrap() / verified).abs() < 1e-9,
            "{v}"
        );
        if want == "cma" {
            assert_eq!(v["mover_fallback"], serde_json::Value::Null, "{v}");
            assert_eq!(v["producer_process"], true, "producers in a process of their own: {v}");
            assert_eq!(
                v["cma_bytes"], v["bytes"],
                "every byte read by the same-host mover: {v}"
            );
        } else {
            assert_eq!(v["producer_process"], false, "{v}");
            assert_eq!(v["cma_bytes"], 0, "{v}");
        }
    }
}

/// `--keys-per-get 2`: each transfer gets two consecutive chunks of one request into a
/// two-chunk slot, on the same-host mover, the socket and the staged path, and over
/// more destination slots than transfers in flight (`--slots`); every chunk still moves
/// once, lands right and is verified, and nothing leaks; by default the destination
/// holds the whole working set. A count that does not divide
/// the chunks per request is refused by name.
#[test]
fn bench_json_keys_per_get_moves_whole_batches_and_refuses_a_bad_count() {
    for extra in [
        vec![],
        vec!["--transport", "tcp"],
        vec!["--path", "staged"],
        vec!["--slots", "16"],
    ] {
        let mut cmd = small_bench_json("4", "8MiB");
        cmd.args(["--keys-per-get", "2"]).args(&extra);
        let out = cmd.output().unwrap();
        assert!(
            out.status.success(),
            "{extra:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v["keys_per_get"], 2, "{extra:?}: {v}");
        // By default the destination is as large as the source's working set: 4
        // requests × 4 chunks, in slots of 2 chunks.
        let slots = if extra.contains(&"--slots") { 16 } else { 8 };
        assert_eq!(v["slots"], slots, "{extra:?}: {v}");
        let chunk = v["chunk_bytes"].as_u64().unwrap();
        assert_eq!(v["chunks"].as_u64().unwrap(), (8 << 20) / chunk, "{extra:?}: {v}");
        assert_eq!(
            v["bytes"].as_u64().unwrap(),
            (8 << 20) / chunk * chunk,
            "every chunk moved: {v}"
        );
        assert_eq!(v["errors"], 0, "{extra:?}: {v}");
        assert_eq!(v["corrupted_bytes"], 0, "{extra:?}: {v}");
        assert_eq!(v["leaked_pages"], 0, "{extra:?}: {v}");
    }
    let out = small_bench_json("4", "8MiB")
        .args(["--keys-per-get", "3"])
        .output()
        .unwrap();
    assert!(!out.status.success(), "3 does not divide 4 chunks per request");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("--keys-per-get (3) must divide --chunks-per-request (4)"),
        "{stderr}"
    );
}
