//! A second process for the tests that need one: this test binary again, running one
//! of its own tests (which acts as the child when an environment variable is set), and
//! the line it announces itself with.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Lines};
use std::process::{Child, ChildStdout, Command, Stdio};

/// This test binary again, running only the test `test` (output not captured, one
/// thread) with `env_var=1`; its stdin and stdout are piped. Also returns its stdout
/// by lines, which the caller keeps for as long as the child may print.
pub fn spawn_self_test(test: &str, env_var: &str) -> (Child, Lines<BufReader<ChildStdout>>) {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", test, "--nocapture", "--test-threads", "1"])
        .env(env_var, "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let lines = BufReader::new(child.stdout.take().unwrap()).lines();
    (child, lines)
}

/// What follows `tag` on the first line of `lines` that carries it, trimmed (libtest
/// may print "test <name> ... " before it on the same line). Panics when the child's
/// output ends first, saying it exited before `what`.
pub fn line_after(lines: &mut Lines<BufReader<ChildStdout>>, tag: &str, what: &str) -> String {
    loop {
        let line = lines
            .next()
            .unwrap_or_else(|| panic!("the child exited before printing {what}"))
            .unwrap();
        if let Some((_, rest)) = line.split_once(tag) {
            return rest.trim().to_string();
        }
    }
}
