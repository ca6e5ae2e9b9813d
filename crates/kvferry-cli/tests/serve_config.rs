//! `kvferry serve --config FILE.toml` on the real binary: the file's settings are used,
//! flags on the command line win, and unknown keys or bad values stop the server before
//! it listens, naming the problem.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

fn temp_file(name: &str, text: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("kvferry-serve-config-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let f = dir.join("serve.toml");
    std::fs::write(&f, text).unwrap();
    f
}

#[test]
fn file_settings_apply_and_flags_win() {
    let f = temp_file(
        "ok",
        "model = \"tiny\"\nblocks = 32\narena = \"4MiB\"\npage_size = \"64KiB\"\nlisten = \"127.0.0.1:0\"\n",
    );
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvferry"))
        .args(["serve", "--config", f.to_str().unwrap(), "--blocks", "48"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let _ = child.kill();
    let _ = child.wait();
    assert!(line.contains("listening on 127.0.0.1:"), "{line}");
    assert!(line.contains("model tiny"), "model from the file: {line}");
    assert!(line.contains("48 blocks"), "--blocks beats the file's 32: {line}");
    assert!(
        line.contains("arena 64 x 64KiB"),
        "arena and page size from the file: {line}"
    );
    std::fs::remove_dir_all(f.parent().unwrap()).unwrap();
}

#[test]
fn unknown_keys_and_bad_values_are_refused_before_listening() {
    for (name, text, expect) in [
        ("typo", "arean = \"1GiB\"\n", "unknown key `arean`"),
        ("zero-timeout", "io-timeout = \"0s\"\n", "greater than zero"),
        ("bad-size", "arena = \"lots\"\n", "config file"),
        ("not-toml", "arena = \n", "not valid TOML"),
    ] {
        let f = temp_file(name, text);
        let out = Command::new(env!("CARGO_BIN_EXE_kvferry"))
            .args(["serve", "--listen", "127.0.0.1:0", "--config", f.to_str().unwrap()])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{name}: {stderr}");
        assert!(stderr.contains(expect), "{name}: {stderr}");
        assert!(stderr.contains("config file"), "{name}: the file is named: {stderr}");
        assert!(
            !String::from_utf8_lossy(&out.stdout).contains("listening"),
            "{name}: must not start serving"
        );
        std::fs::remove_dir_all(f.parent().unwrap()).unwrap();
    }
}
