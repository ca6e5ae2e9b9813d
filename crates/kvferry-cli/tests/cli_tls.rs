//! Real processes over mutual TLS: `kvferry serve --tls-*` with `kvferry put/get
//! --tls-*` round-trips a chunk byte for byte; a `get` without TLS, or with a
//! certificate from another CA, is refused with a clear message while the server keeps
//! serving; bad or incomplete TLS flags fail at start-up naming the file or flag.
//! Certificates are generated per test (rcgen) in a unique temp dir.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use common::{get_args, put_args, round_trip_bytes, Serve};
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair};

fn kvferry(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvferry"))
        .args(args)
        .env_remove("KVFERRY_SECRET")
        .output()
        .unwrap()
}

fn serve(extra: &[&str]) -> Serve {
    Serve::start(
        Serve::command()
            .args(["--blocks", "1024"])
            .args(["--arena", "8MiB", "--page-size", "64KiB"])
            .args(extra)
            .env_remove("KVFERRY_SECRET")
            .stderr(Stdio::null()),
        Duration::from_secs(10),
        false,
    )
}

/// Writes a CA and certificates signed by it (CN `names[i]`, valid for 127.0.0.1)
/// into `dir`: `ca.pem`, `NAME.pem`, `NAME.key`.
fn pki(dir: &Path, ca_name: &str, names: &[&str]) {
    let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    p.distinguished_name.push(DnType::CommonName, ca_name);
    let ca_key = KeyPair::generate().unwrap();
    let ca = p.self_signed(&ca_key).unwrap();
    std::fs::write(dir.join("ca.pem"), ca.pem()).unwrap();
    for n in names {
        let mut p = CertificateParams::new(vec!["127.0.0.1".to_string()]).unwrap();
        p.distinguished_name.push(DnType::CommonName, *n);
        let key = KeyPair::generate().unwrap();
        let cert = p.signed_by(&key, &ca, &ca_key).unwrap();
        std::fs::write(dir.join(format!("{n}.pem")), cert.pem()).unwrap();
        std::fs::write(dir.join(format!("{n}.key")), key.serialize_pem()).unwrap();
    }
}

fn temp_dir(tag: &str) -> PathBuf {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let d = std::env::temp_dir().join(format!("kvferry-cli-tls-{tag}-{}-{nanos:x}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn tls_flags(dir: &Path, name: &str) -> Vec<String> {
    let p = |f: String| dir.join(f).to_str().unwrap().to_string();
    vec![
        "--tls-cert".into(),
        p(format!("{name}.pem")),
        "--tls-key".into(),
        p(format!("{name}.key")),
        "--tls-ca".into(),
        p("ca.pem".into()),
    ]
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn serve_put_and_get_over_mutual_tls() {
    let dir = temp_dir("rt");
    pki(&dir, "fleet CA", &["server", "client"]);
    let rogue = dir.join("rogue");
    std::fs::create_dir_all(&rogue).unwrap();
    pki(&rogue, "rogue CA", &["client"]);
    let server_flags = tls_flags(&dir, "server");
    let s: Vec<&str> = server_flags.iter().map(String::as_str).collect();
    let p = serve(&s);
    let client_flags = tls_flags(&dir, "client");
    let c: Vec<&str> = client_flags.iter().map(String::as_str).collect();
    let input = dir.join("in.bin");
    let output = dir.join("out.bin");
    let data = round_trip_bytes();
    std::fs::write(&input, &data).unwrap();
    let put = [&put_args(&p.addr, "doc", input.to_str().unwrap())[..], &c].concat();
    let out = kvferry(&put);
    assert!(out.status.success(), "{}", stderr(&out));
    let get = [&get_args(&p.addr, "doc")[..], &["--out", output.to_str().unwrap()], &c].concat();
    let out = kvferry(&get);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(std::fs::read(&output).unwrap() == data, "bytes differ");
    // Without TLS: told the server requires it.
    let out = kvferry(&[&get_args(&p.addr, "doc")[..], &["--timeout", "3s"]].concat());
    assert!(!out.status.success());
    assert!(stderr(&out).contains("requires TLS"), "{}", stderr(&out));
    // A certificate from another CA: refused.
    let rogue_flags = tls_flags(&rogue, "client");
    let mut r: Vec<&str> = rogue_flags.iter().map(String::as_str).collect();
    r[5] = s[5]; // trusts the fleet CA, presents the rogue certificate
    let bad = [&get_args(&p.addr, "doc")[..], &["--timeout", "3s"], &r].concat();
    let out = kvferry(&bad);
    assert!(!out.status.success(), "a rogue certificate was accepted");
    // The server still serves good clients.
    std::fs::remove_file(&output).unwrap();
    let out = kvferry(&get);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(std::fs::read(&output).unwrap() == data);
    drop(p);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_tls_flags_fail_at_start_up_naming_the_file_or_flag() {
    let dir = temp_dir("bad");
    pki(&dir, "fleet CA", &["server"]);
    let mut flags = tls_flags(&dir, "server");
    flags[3] = dir.join("missing.key").to_str().unwrap().to_string();
    let f: Vec<&str> = flags.iter().map(String::as_str).collect();
    let out = kvferry(&[&["serve", "--listen", "127.0.0.1:0", "--model", "tiny"][..], &f].concat());
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("missing.key") && stderr(&out).contains("private key"),
        "{}",
        stderr(&out)
    );
    // --tls-cert alone is a usage error.
    let cert = dir.join("server.pem");
    let out = kvferry(&["serve", "--listen", "127.0.0.1:0", "--tls-cert", cert.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("--tls-key"), "{}", stderr(&out));
    let _ = std::fs::remove_dir_all(&dir);
}
