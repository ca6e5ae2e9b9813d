//! Raw protocol clients for the suites that speak to a server byte by byte over
//! loopback (`net_handshake`, `net_progress`, `net_bad_input`): connect, one control
//! frame out or in within [`WAIT`], a close within [`WAIT`], and the reply a test
//! handler gives to what it does not serve.
#![allow(dead_code)]

use std::time::{Duration, Instant};

use kvferry::wire::{self, ErrorKind, Limits, Message};
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;

/// How long a reply or a close may take (generous: the server answers at once).
pub const WAIT: Duration = Duration::from_secs(5);

/// `d` from now.
pub fn deadline(d: Duration) -> tokio::time::Instant {
    tokio::time::Instant::now() + d
}

/// Polls `cond` until it holds (or panics after [`WAIT`]).
pub async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(start.elapsed() < WAIT, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A raw TCP connection to `addr` (no Nagle delay, so split writes go out at once).
pub async fn connect(addr: &str) -> TcpStream {
    let s = TcpStream::connect(addr).await.unwrap();
    s.set_nodelay(true).unwrap();
    s
}

/// Writes `msg` as one control frame with request id `id`.
pub async fn send(s: &mut TcpStream, id: u64, msg: &Message) {
    wire::write_control(s, id, msg).await.unwrap();
}

/// Reads one control frame within [`WAIT`].
pub async fn recv(s: &mut TcpStream) -> (u64, Message) {
    match tokio::time::timeout(WAIT, wire::read_control::<_, Message>(s, &Limits::default())).await {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => panic!("reading a reply: {e}"),
        Err(_) => panic!("no reply within {WAIT:?}"),
    }
}

/// The peer closed the connection (end of stream or reset) within [`WAIT`], whatever
/// was still in flight before.
pub async fn expect_closed(s: &mut TcpStream) {
    let mut buf = [0u8; 256];
    loop {
        match tokio::time::timeout(WAIT, s.read(&mut buf)).await {
            Err(_) => panic!("connection still open after {WAIT:?}"),
            Ok(Ok(0)) | Ok(Err(_)) => return,
            Ok(Ok(_)) => {} // whatever was in flight
        }
    }
}

/// A test handler's answer to a request it does not serve: `BadRequest` naming it.
pub fn unexpected(msg: &Message) -> Message {
    Message::Error {
        kind: ErrorKind::BadRequest,
        message: format!("unexpected {}", msg.name()),
    }
}
