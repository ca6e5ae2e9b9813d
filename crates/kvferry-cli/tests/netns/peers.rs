//! The directory as the tests see it: whether this `kvferry` has `--directory` at all,
//! the `kvferry peers --json` listing (parsed tolerantly: a JSON array, one object
//! per line, or an object holding a `peers` array; `id` or `peer_id`; an incarnation
//! as a number, a decimal string or a `0x` hex string), and waiting for the listing to
//! reach a condition (bounded).

use std::time::{Duration, Instant};

use serde_json::Value;

use super::net::Host;
use super::serve::kvferry;

/// True when `kvferry serve --help` lists `--directory` (the directory is built in).
pub fn kvferry_supports_directory() -> bool {
    std::process::Command::new(env!("CARGO_BIN_EXE_kvferry"))
        .args(["serve", "--help"])
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("--directory"))
}

/// One live peer in the directory.
#[derive(Clone, Debug, PartialEq)]
pub struct PeerRecord {
    /// Its peer id.
    pub id: String,
    /// Its advertised address.
    pub address: String,
    /// Its incarnation.
    pub incarnation: u64,
    /// Its role, when listed.
    pub role: Option<String>,
    /// Whether the listing is flagged stale (the directory could not be reached).
    pub stale: bool,
}

fn field<'a>(v: &'a Value, names: &[&str]) -> Option<&'a Value> {
    names.iter().find_map(|n| v.get(*n))
}

fn number(v: &Value) -> Option<u64> {
    match v {
        Value::Number(n) => n.as_u64(),
        Value::String(s) => match s.strip_prefix("0x") {
            Some(hex) => u64::from_str_radix(hex, 16).ok(),
            None => s.parse().ok(),
        },
        _ => None,
    }
}

/// `"stale": true`, `"fresh": false`, or `"state"`/`"freshness": "stale"`.
fn stale(v: &Value) -> bool {
    if let Some(b) = v.get("stale").and_then(Value::as_bool) {
        return b;
    }
    if let Some(b) = v.get("fresh").and_then(Value::as_bool) {
        return !b;
    }
    field(v, &["state", "freshness", "stale"])
        .and_then(Value::as_str)
        .is_some_and(|s| s.eq_ignore_ascii_case("stale"))
}

fn record(v: &Value) -> Option<PeerRecord> {
    Some(PeerRecord {
        id: field(v, &["id", "peer_id"])?.as_str()?.to_string(),
        address: field(v, &["address", "addr", "advertise"])
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string(),
        incarnation: field(v, &["incarnation"]).and_then(number)?,
        role: field(v, &["role"]).and_then(Value::as_str).map(str::to_string),
        stale: stale(v),
    })
}

/// Parses `kvferry peers --json` output.
pub fn parse_peers(text: &str) -> Result<Vec<PeerRecord>, String> {
    let values: Vec<Value> = match serde_json::from_str::<Value>(text.trim()) {
        Ok(Value::Array(a)) => a,
        Ok(v) => match v.get("peers") {
            Some(Value::Array(a)) => a.clone(),
            _ => vec![v],
        },
        Err(_) => text
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| serde_json::from_str(l).map_err(|e| format!("not JSON: {l:?}: {e}")))
            .collect::<Result<_, _>>()?,
    };
    values
        .iter()
        .map(|v| record(v).ok_or_else(|| format!("not a peer record: {v}")))
        .collect()
}

/// `kvferry peers` run in `host`: the listing, or the command's error. The command
/// itself must return within 15 s (it must never hang on the directory).
pub fn peers(host: &Host, url: &str, namespace: &str) -> Result<Vec<PeerRecord>, String> {
    let t = Instant::now();
    let out = kvferry(
        host,
        &["peers", "--directory", url, "--namespace", namespace, "--json"],
        Duration::from_secs(15),
    );
    assert!(
        t.elapsed() < Duration::from_secs(15),
        "`kvferry peers` hung for {:?}",
        t.elapsed()
    );
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    parse_peers(&String::from_utf8_lossy(&out.stdout))
}

/// Polls `peers` until `ok` holds for the listing, for at most `limit`; returns the
/// listing that satisfied it, or panics with the last one seen.
pub fn wait_peers(
    host: &Host,
    url: &str,
    namespace: &str,
    limit: Duration,
    what: &str,
    ok: impl Fn(&[PeerRecord]) -> bool,
) -> Vec<PeerRecord> {
    let t = Instant::now();
    loop {
        let last = peers(host, url, namespace);
        if let Ok(list) = &last {
            if ok(list) {
                return list.clone();
            }
        }
        assert!(
            t.elapsed() < limit,
            "{what}: not within {limit:?}; last listing: {last:?}"
        );
        std::thread::sleep(Duration::from_millis(250));
    }
}
