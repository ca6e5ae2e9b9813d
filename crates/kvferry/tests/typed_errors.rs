//! A reply of the wrong kind is a typed error that names the message kinds and never
//! dumps the message: a hand-written server answers every request with a `Staged` of
//! 4096 chunks (or a `LookupReply`), and the consumer's lookup, stage and put fail with
//! `NetError::Unexpected` and a short message.

mod common;

use std::time::Duration;

use common::p2p::consumer_node;
use kvferry::net::NetError;
use kvferry::peer::PeerError;
use kvferry::wire::{self, ChunkKey, ChunkMeta, Limits, Message};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;

/// The wrong reply to each request: `Staged` (4096 chunks) to a lookup, `LookupReply`
/// to anything else.
fn wrong_reply(req: &Message) -> Message {
    match req {
        Message::Lookup { .. } => Message::Staged {
            lease_id: 7,
            incarnation: 1,
            chunks: (0..4096u32)
                .map(|i| ChunkMeta {
                    key: ChunkKey::from_name(&format!("k{i}")),
                    len: 1 << 20,
                    checksum: i,
                })
                .collect(),
            ttl_ms: 1000,
        },
        _ => Message::LookupReply { hits: 0 },
    }
}

/// Serves one connection: a handshake without a secret, then wrong replies. A put's
/// bulk frame is read and ignored.
async fn serve(mut s: TcpStream) {
    let limits = Limits::default();
    let Ok((id, Message::Hello { .. })) = wire::read_control::<_, Message>(&mut s, &limits).await else {
        return;
    };
    let challenge = Message::Challenge {
        peer_id: "wrong-replies".into(),
        incarnation: 1,
        nonce: [5; 32],
        proof: None,
    };
    wire::write_control(&mut s, id, &challenge).await.unwrap();
    let Ok((id, Message::Auth { .. })) = wire::read_control::<_, Message>(&mut s, &limits).await else {
        return;
    };
    wire::write_control(&mut s, id, &Message::Welcome).await.unwrap();
    while let Ok(h) = wire::read_frame_header(&mut s, &limits).await {
        if h.kind == wire::FrameKind::Bulk {
            wire::skip_body(&mut s, &h).await.unwrap();
            continue;
        }
        let Ok(req) = wire::read_control_body::<_, Message>(&mut s, &h, &limits).await else {
            return;
        };
        if matches!(req, Message::Put { .. }) {
            // The reply follows the bulk frame.
            let b = wire::read_frame_header(&mut s, &limits).await.unwrap();
            wire::skip_body(&mut s, &b).await.unwrap();
        }
        if wire::write_control(&mut s, h.request_id, &wrong_reply(&req))
            .await
            .is_err()
        {
            return;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_reply_is_typed_and_names_kinds_without_dumping_the_message() {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        while let Ok((s, _)) = l.accept().await {
            tokio::spawn(serve(s));
        }
    });
    let c = consumer_node(16, 16);
    let deadline = || Instant::now() + Duration::from_secs(10);
    let keys = [ChunkKey::from_name("a")];
    let results = [
        (
            "LookupReply",
            "Staged",
            c.consumer.lookup(&addr, &keys, deadline()).await.map(drop),
        ),
        (
            "Staged",
            "LookupReply",
            c.consumer.stage(&addr, &keys, deadline()).await.map(drop),
        ),
        (
            "PutAck",
            "LookupReply",
            c.consumer.put(&addr, keys[0], &[1; 100], deadline()).await,
        ),
    ];
    for (expected, got, r) in results {
        let e = r.expect_err("a wrong reply must fail");
        match &e {
            PeerError::Net(NetError::Unexpected { expected: x, got: g }) => {
                assert_eq!((*x, *g), (expected, got), "{e}");
            }
            other => panic!("expected NetError::Unexpected, got {other:?}"),
        }
        let m = e.to_string();
        assert!(m.contains(expected) && m.contains(got), "{m}");
        assert!(
            m.len() < 200,
            "the error dumps the message ({} bytes): {}",
            m.len(),
            &m[..200]
        );
    }
}
