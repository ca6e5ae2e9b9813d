//! What the `kvferry` command says, and with which exit status, for the cases a
//! newcomer runs into first: listen addresses that do not parse or are taken, the
//! `serve` start-up line, chunks over the server's `--max-bulk` or the client's
//! `--max-blocks`, `--secret-file` on `put`/`get`, unknown presets and bad `chaos` flags
//! (status 2), `chaos --seed`'s help, the bench's summary and sweep, logs without
//! colour codes when stderr is not a terminal, the unpinned-staging note (once), and a
//! wrong secret (explained to the client, logged and counted by the server).
//!
//! Every test runs the real binary with the exact command line.

mod common;

use std::net::TcpListener;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::{get_args, put_args, text, Serve};

const EXE: &str = env!("CARGO_BIN_EXE_kvferry");

fn kvferry(args: &[&str]) -> Output {
    Command::new(EXE).args(args).output().expect("run kvferry")
}

/// `kvferry SUBCOMMAND --help`, which must succeed, with its white space folded to
/// single spaces.
fn help_of(subcommand: &str) -> String {
    let out = kvferry(&[subcommand, "--help"]);
    assert!(out.status.success());
    text(&out.stdout).split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Asserts the exit status and that stderr contains every needle; returns stderr.
fn expect_failure(out: &Output, code: i32, needles: &[&str]) -> String {
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(code), "stderr: {err}");
    for n in needles {
        assert!(err.contains(n), "missing {n:?} in stderr: {err}");
    }
    err
}

fn temp_dir(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("kvferry-cli-messages-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A running `kvferry serve` (killed on drop) and the address it listens on.
/// Starts `serve` on a free loopback port with a small tiny-model store, and returns
/// once its "listening on" line arrived (which must come within 20 s).
fn serve(extra: &[&str]) -> Serve {
    Serve::start(
        Serve::command()
            .args(["--blocks", "1024"])
            .args(["--arena", "4MiB", "--page-size", "64KiB", "--copy-threads", "1"])
            .args(extra)
            .stderr(Stdio::null()),
        Duration::from_secs(20),
        false,
    )
}

#[test]
fn serve_refuses_an_unparsable_listen_address_with_status_2_and_no_secret_warning() {
    for (addr, why) in [
        ("notanaddress", "invalid socket address"),
        ("0.0.0.0:99999", "invalid port value"),
    ] {
        let out = kvferry(&["serve", "--listen", addr]);
        let err = expect_failure(&out, 2, &[&format!("error: cannot listen on {addr}: {why}")]);
        assert!(!err.contains("connect"), "{err}");
        assert!(
            !err.contains("without a shared secret"),
            "the warning comes only after the address parsed: {err}"
        );
        assert!(!text(&out.stdout).contains("listening"), "{addr}");
    }
}

#[test]
fn serve_on_a_port_in_use_says_address_in_use_with_status_1() {
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let out = kvferry(&[
        "serve",
        "--listen",
        &addr,
        "--model",
        "tiny",
        "--blocks",
        "8",
        "--arena",
        "1MiB",
        "--page-size",
        "64KiB",
    ]);
    expect_failure(&out, 1, &[&format!("error: cannot listen on {addr}: address in use")]);
    drop(taken);
}

#[test]
fn serve_prints_its_listening_line_at_once() {
    let t = Instant::now();
    let s = serve(&[]);
    assert!(s.addr.starts_with("127.0.0.1:"), "{}", s.addr);
    assert!(
        t.elapsed() < Duration::from_secs(10),
        "the listening line took {:?}",
        t.elapsed()
    );
}

#[test]
fn put_over_max_bulk_names_the_limit() {
    let dir = temp_dir("max-bulk");
    let big = dir.join("big.bin");
    std::fs::write(&big, vec![7u8; 2 << 20]).unwrap();
    let big = big.to_str().unwrap();

    // Checked up front against put's own --max-bulk: nothing is sent.
    let out = kvferry(&[
        "put",
        "--peer",
        "127.0.0.1:9",
        "--key",
        "k",
        "--file",
        big,
        "--max-bulk",
        "1MiB",
    ]);
    expect_failure(
        &out,
        1,
        &[
            "is 2097152 bytes",
            "more than --max-bulk 1MiB",
            "the server would refuse it",
        ],
    );

    // A server with a smaller --max-bulk than put assumes: the refusal (or the broken
    // pipe it causes on a large chunk) is reported as what it is.
    let s = serve(&["--max-bulk", "1MiB"]);
    let huge = dir.join("huge.bin");
    std::fs::write(&huge, vec![7u8; 48 << 20]).unwrap();
    for f in [big, huge.to_str().unwrap()] {
        let out = kvferry(&["put", "--peer", &s.addr, "--key", "k", "--file", f]);
        let err = expect_failure(
            &out,
            1,
            &["the server refused the chunk", "exceeds the server's --max-bulk"],
        );
        assert!(err.contains(&format!("put to {}", s.addr)), "{err}");
    }
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn get_of_a_chunk_over_max_blocks_points_at_max_blocks() {
    let dir = temp_dir("max-blocks");
    let f = dir.join("chunk.bin");
    std::fs::write(&f, vec![3u8; 100_000]).unwrap();
    let s = serve(&[]);
    let out = kvferry(&put_args(&s.addr, "mb", f.to_str().unwrap()));
    assert!(out.status.success(), "{}", text(&out.stderr));
    // tiny: 2 KiB per block; 100,000 bytes need 49 blocks.
    let out = kvferry(&[&get_args(&s.addr, "mb")[..], &["--max-blocks", "4"]].concat());
    expect_failure(
        &out,
        1,
        &[
            "the chunk is larger than --max-blocks 4 (8KiB of tiny)",
            "it is 100000 bytes",
            "49 blocks",
            "rerun with --max-blocks 49 or more",
        ],
    );
    let out = kvferry(&[&get_args(&s.addr, "mb")[..], &["--max-blocks", "49"]].concat());
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("got 100000 bytes"), "{}", text(&out.stdout));
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn put_and_get_take_a_secret_file() {
    let dir = temp_dir("secret");
    let secret = dir.join("secret");
    std::fs::write(&secret, "c2VjcmV0LWZvci1rdmZlcnJ5LWNsaS10ZXN0cy0xMjM0\n").unwrap();
    let wrong = dir.join("wrong");
    std::fs::write(&wrong, "d3JvbmctZm9yLWt2ZmVycnktY2xpLXRlc3RzLTU2Nzg5\n").unwrap();
    let data = dir.join("data.bin");
    std::fs::write(&data, b"hello kv").unwrap();
    let (secret, wrong, data) = (
        secret.to_str().unwrap(),
        wrong.to_str().unwrap(),
        data.to_str().unwrap(),
    );
    let s = serve(&["--secret-file", secret]);

    let put = |file: &str, extra: &[&str]| {
        let mut a = vec!["put", "--peer", &s.addr, "--key", "sec", "--file", file];
        a.extend_from_slice(extra);
        Command::new(EXE)
            .args(&a)
            .env_remove("KVFERRY_SECRET")
            .output()
            .unwrap()
    };
    let out = put(data, &["--secret-file", secret]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(!put(data, &["--secret-file", wrong]).status.success());
    assert!(!put(data, &[]).status.success());

    let out = Command::new(EXE)
        .args([
            "get",
            "--peer",
            &s.addr,
            "--key",
            "sec",
            "--model",
            "tiny",
            "--secret-file",
            secret,
        ])
        .env_remove("KVFERRY_SECRET")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("got 8 bytes"), "{}", text(&out.stdout));

    // One or the other.
    let out = kvferry(&["get", "--key", "x", "--secret", "a", "--secret-file", secret]);
    expect_failure(&out, 2, &["--secret-file"]);
    let out = kvferry(&[
        "put",
        "--key",
        "x",
        "--file",
        data,
        "--secret-file",
        "/nonexistent/kvferry-secret",
    ]);
    expect_failure(&out, 1, &["reading secret file /nonexistent/kvferry-secret"]);
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn unknown_model_presets_exit_2_naming_the_known_ones() {
    for cmd in [
        &["bench", "--model", "llama9"][..],
        &["bench", "p2p", "--model", "llama9"][..],
        &["serve", "--listen", "127.0.0.1:0", "--model", "llama9"][..],
        &["get", "--key", "x", "--model", "llama9"][..],
    ] {
        let out = kvferry(cmd);
        expect_failure(
            &out,
            2,
            &["unknown model preset \"llama9\"", "llama3-8b", "llama3-70b-tp8", "tiny"],
        );
    }
}

#[test]
fn bad_bench_counts_exit_2() {
    for flag in [
        "--in-flight",
        "--connections",
        "--producers",
        "--blocks-per-chunk",
        "--requests",
    ] {
        let out = kvferry(&["bench", flag, "0"]);
        expect_failure(&out, 2, &[flag]);
    }
}

#[test]
fn chaos_flag_errors_exit_2() {
    for (args, needle) in [
        (&["--transfers", "0"][..], "--transfers must be at least 1"),
        (&["--producers", "0"][..], "--producers must be 1..=16"),
        (&["--concurrency", "0"][..], "--concurrency must be 1..=256"),
        (&["--fault-rate", "11"][..], "--fault-rate must be between 0 and 10"),
        (&["--duration-cap", "0s"][..], "greater than zero"),
        (&["--transfers", "many"][..], "--transfers"),
    ] {
        let mut a = vec!["chaos"];
        a.extend_from_slice(args);
        let out = kvferry(&a);
        expect_failure(&out, 2, &[needle]);
        assert!(
            !text(&out.stderr).contains("kvferry chaos: seed"),
            "{args:?}: refused before starting"
        );
    }
}

#[test]
fn chaos_seed_help_says_it_fixes_the_schedule_not_the_timing() {
    let help = help_of("chaos");
    for n in [
        "The seed fixes which transfer gets which fault",
        "does not fix timing",
        "two runs with one seed can still differ",
    ] {
        assert!(help.contains(n), "missing {n:?}: {help}");
    }
}

#[test]
fn bench_help_says_what_sweep_does_with_in_flight_and_connections() {
    let help = help_of("bench");
    for n in [
        "--blocks-per-chunk or --in-flight, when given, fix that dimension and only the other is swept",
        "--connections, --producers, --path and --model apply to every point",
        "under --sweep, when not given: 1, 4 and 16",
    ] {
        assert!(help.contains(n), "missing {n:?}: {help}");
    }
}

/// Runs `args` with locked memory refused: `ulimit -l 0`, and as root (which may lock
/// regardless) without CAP_IPC_LOCK where `setpriv` can drop it.
fn without_mlock(args: &[&str]) -> Output {
    let script = r#"ulimit -l 0 2>/dev/null
if [ "$(id -u)" = 0 ] && command -v setpriv >/dev/null 2>&1; then
  exec setpriv --inh-caps=-ipc_lock --bounding-set=-ipc_lock "$@"
fi
exec "$@""#;
    Command::new("sh")
        .arg("-c")
        .arg(script)
        .arg("sh")
        .arg(EXE)
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .expect("run sh")
}

/// The common small bench: tiny model, 128 KiB chunks, 16 MiB.
const SMALL: &[&str] = &[
    "--quiet",
    "--model",
    "tiny",
    "--requests",
    "4",
    "--bytes",
    "16MiB",
    "--copy-threads",
    "1",
];

#[test]
fn bench_summary_names_the_limit_the_path_and_unpinned_staging_once_and_logs_are_plain() {
    let mut args = vec![
        "bench",
        "--blocks-per-chunk",
        "64",
        "--producers",
        "2",
        "--path",
        "staged",
    ];
    args.extend_from_slice(SMALL);
    let out = without_mlock(&args);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "{stderr}");
    for n in [
        "path staged",
        "of raw TCP moving the same bytes",
        "1.00 is the ceiling",
        "target >= 0.85:",
        "staged-pipeline limit",
        "every byte verified",
    ] {
        assert!(stdout.contains(n), "missing {n:?}: {stdout}");
    }
    assert!(stdout.contains("staging memory"), "{stdout}");
    assert!(
        !stderr.contains('\x1b'),
        "colour codes in a log that is not a terminal: {stderr:?}"
    );
    if stdout.contains("staging memory NOT pinned") {
        // Three arenas, all unpinned: one note.
        assert_eq!(
            stderr.matches("note: staging memory is not pinned").count(),
            1,
            "{stderr}"
        );
        assert!(stderr.contains("ulimit -l"), "{stderr}");
        assert!(stdout.contains("`ulimit -l unlimited` fixes it"), "{stdout}");
        // The library's own warning went through the log: plain text.
        assert!(stderr.contains("WARN"), "{stderr}");
    } else {
        eprintln!("memory could be locked despite ulimit -l 0: unpinned note not checked");
        assert!(stdout.contains("staging memory pinned"), "{stdout}");
    }
}

#[test]
fn bench_sweep_honours_in_flight_and_summarises_the_whole_sweep() {
    let mut args = vec![
        "bench",
        "--sweep",
        "--in-flight",
        "2",
        "--blocks-per-chunk",
        "64",
        "--connections",
        "2",
    ];
    args.extend_from_slice(SMALL);
    let out = kvferry(&args);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("sweep: 1 point: 64 blocks per chunk (given) x 2 in flight (given); 2 connection(s)"),
        "{stderr}"
    );
    // The table's row: chunk, in flight 2, 2 connections.
    assert!(
        stdout.lines().any(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            f.len() == 12 && f[0] == "128KiB" && f[1] == "2" && f[2] == "2"
        }),
        "{stdout}"
    );
    for n in [
        "sweep of 1 point;",
        "best point:",
        "at 128KiB chunks, 2 in flight",
        "of raw TCP moving the same bytes",
        "over all points:",
        "limits measured at each point:",
        "target >= 0.85: met at",
    ] {
        assert!(stdout.contains(n), "missing {n:?}: {stdout}");
    }
}

#[test]
fn bench_sweep_json_keeps_its_fields_and_adds_staging() {
    let mut args = vec![
        "bench",
        "--sweep",
        "--json",
        "--in-flight",
        "3",
        "--blocks-per-chunk",
        "64",
    ];
    args.extend_from_slice(SMALL);
    let out = kvferry(&args);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("a JSON array");
    let pts = v.as_array().expect("an array with --sweep");
    assert_eq!(pts.len(), 1, "{v:#}");
    let p = &pts[0];
    assert_eq!(p["in_flight"], 3, "--in-flight is not ignored under --sweep: {p:#}");
    assert_eq!(p["chunk_bytes"], 64 * 2048, "{p:#}");
    for k in [
        "gbps",
        "tcp_limit_gbps",
        "ratio",
        "pipeline_ratio",
        "path",
        "staging_backing",
        "staging_pinned",
    ] {
        assert!(p.get(k).is_some(), "missing {k}: {p:#}");
    }
}

/// A free loopback port (bound, then released) for `--metrics`.
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// `GET path` over plain HTTP/1.1; the body.
fn http_body(addr: &str, path: &str) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).expect("connect to metrics");
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    write!(s, "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").unwrap();
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out.split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default()
}

#[test]
fn a_wrong_secret_is_explained_on_both_sides_and_counted() {
    let dir = temp_dir("wrong-secret");
    let (secret, wrong, log) = (dir.join("secret"), dir.join("wrong"), dir.join("serve.log"));
    std::fs::write(&secret, "c2VjcmV0LWZvci1rdmZlcnJ5LWNsaS10ZXN0cy0xMjM0\n").unwrap();
    std::fs::write(&wrong, "d3JvbmctZm9yLWt2ZmVycnktY2xpLXRlc3RzLTU2Nzg5\n").unwrap();
    let metrics = format!("127.0.0.1:{}", free_port());
    let s = Serve::start(
        Serve::command()
            .args(["--arena", "4MiB"])
            .args(["--page-size", "64KiB", "--copy-threads", "1", "--metrics", &metrics])
            .arg("--secret-file")
            .arg(&secret)
            .env_remove("KVFERRY_SECRET")
            .env_remove("RUST_LOG")
            .stderr(std::fs::File::create(&log).unwrap()),
        Duration::from_secs(20),
        false,
    );

    let out = Command::new(EXE)
        .args([
            "get",
            "--peer",
            &s.addr,
            "--key",
            "k",
            "--model",
            "tiny",
            "--secret-file",
        ])
        .arg(&wrong)
        .env_remove("KVFERRY_SECRET")
        .output()
        .unwrap();
    // The client: status 1 and the reason, not a generic I/O error.
    expect_failure(&out, 1, &["authentication failed", "secret"]);

    // The server: a warning naming the failure and where it came from, and the counter.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let logged = std::fs::read_to_string(&log).unwrap_or_default();
        let body = http_body(&metrics, "/metrics");
        let counted = body
            .lines()
            .find(|l| l.starts_with("kvferry_auth_failures_total"))
            .and_then(|l| l.split_whitespace().last())
            .and_then(|v| v.parse::<f64>().ok());
        if logged.contains("authentication failed from 127.0.0.1") && counted == Some(1.0) {
            assert!(!logged.contains('\u{1b}'), "colour codes in a log file: {logged:?}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "server log: {logged:?}; auth failures counted: {counted:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    drop(s);
    std::fs::remove_dir_all(dir).unwrap();
}
