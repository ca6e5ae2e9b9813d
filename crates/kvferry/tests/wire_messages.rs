//! Control-message tests of `kvferry::wire`: every `Message` round-trips through a
//! control frame, `Message::validate` enforces the limits, and arbitrary bytes fed to
//! the control reader give a typed error or a message, never a panic.

use kvferry::wire::{
    read_control, read_message, write_control, ChunkKey, ChunkMeta, ErrorKind, FrameHeader, FrameKind, Limits, Message,
    SelectedShape, WireError, WireSelection,
};
use proptest::collection::vec;
use proptest::prelude::*;

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// Frames `payload` as a control frame with a correct checksum.
fn control_frame(payload: &[u8]) -> Vec<u8> {
    let h = FrameHeader {
        kind: FrameKind::Control,
        request_id: 1,
        len: payload.len() as u64,
        checksum: crc32c::crc32c(payload),
    };
    [&h.encode()[..], payload].concat()
}

fn decode(bytes: &[u8]) -> Result<(u64, Message), WireError> {
    rt().block_on(read_control::<_, Message>(&mut &bytes[..], &Limits::default()))
}

fn key() -> impl Strategy<Value = ChunkKey> {
    any::<[u8; 32]>().prop_map(ChunkKey)
}

fn keys() -> impl Strategy<Value = Vec<ChunkKey>> {
    vec(key(), 0..20)
}

fn error_kind() -> impl Strategy<Value = ErrorKind> {
    use ErrorKind::*;
    prop::sample::select(vec![
        AuthFailed,
        AuthRequired,
        UnknownLease,
        LeaseExpired,
        StaleIncarnation,
        Busy,
        TooLarge,
        BadRequest,
        Internal,
        NotFound,
        ShuttingDown,
        BadSelection,
    ])
}

fn selection() -> impl Strategy<Value = WireSelection> {
    (
        prop::option::of(vec(any::<u32>(), 0..20)),
        prop::option::of(vec((any::<u64>(), any::<u64>()), 0..20)),
        any::<Option<u32>>(),
        prop::option::of(vec(any::<u64>(), 0..20)),
    )
        .prop_map(|(blocks, ranges, expect_blocks, expect_pieces)| WireSelection {
            blocks,
            ranges,
            expect_blocks: expect_blocks.map(|n| n % 1000),
            expect_pieces,
        })
}

fn chunk_meta() -> impl Strategy<Value = ChunkMeta> {
    (key(), any::<u64>(), any::<u32>()).prop_map(|(key, len, checksum)| ChunkMeta { key, len, checksum })
}

fn message() -> impl Strategy<Value = Message> {
    let meta = chunk_meta();
    prop_oneof![
        (".{0,40}", any::<u64>(), any::<[u8; 32]>(), any::<bool>()).prop_map(
            |(peer_id, incarnation, nonce, wants_auth)| Message::Hello {
                peer_id,
                incarnation,
                nonce,
                wants_auth
            }
        ),
        (".{0,40}", any::<u64>(), any::<[u8; 32]>(), any::<Option<[u8; 32]>>()).prop_map(
            |(peer_id, incarnation, nonce, proof)| Message::Challenge {
                peer_id,
                incarnation,
                nonce,
                proof
            }
        ),
        any::<Option<[u8; 32]>>().prop_map(|proof| Message::Auth { proof }),
        Just(Message::Welcome),
        keys().prop_map(|keys| Message::Lookup { keys }),
        any::<u32>().prop_map(|hits| Message::LookupReply { hits }),
        (keys(), any::<u32>()).prop_map(|(keys, ttl_ms)| Message::Stage { keys, ttl_ms }),
        (any::<u128>(), any::<u64>(), vec(meta, 0..10), any::<u32>()).prop_map(
            |(lease_id, incarnation, chunks, ttl_ms)| Message::Staged {
                lease_id,
                incarnation,
                chunks,
                ttl_ms
            }
        ),
        (any::<u128>(), any::<u64>()).prop_map(|(lease_id, incarnation)| Message::Pull { lease_id, incarnation }),
        any::<u128>().prop_map(|lease_id| Message::PullDone { lease_id }),
        (keys(), any::<u32>()).prop_map(|(keys, ttl_ms)| Message::Get { keys, ttl_ms }),
        any::<u128>().prop_map(|lease_id| Message::Done { lease_id }),
        Just(Message::DoneAck),
        (key(), any::<u64>()).prop_map(|(key, len)| Message::Put { key, len }),
        key().prop_map(|key| Message::PutAck { key }),
        (error_kind(), ".{0,80}").prop_map(|(kind, message)| Message::Error { kind, message }),
        Just(Message::Ping),
        Just(Message::Pong),
        (keys(), any::<u64>()).prop_map(|(keys, incarnation)| Message::Release { keys, incarnation }),
        vec(any::<bool>(), 0..10).prop_map(|released| Message::ReleaseAck { released }),
        (keys(), any::<u32>(), selection()).prop_map(|(keys, ttl_ms, select)| Message::GetSelected {
            keys,
            ttl_ms,
            select
        }),
        (keys(), any::<u32>(), selection()).prop_map(|(keys, ttl_ms, select)| Message::StageSelected {
            keys,
            ttl_ms,
            select
        }),
        (
            any::<u128>(),
            any::<u64>(),
            vec(chunk_meta(), 0..10),
            any::<u32>(),
            (0u32..1000, vec(any::<u64>(), 0..20))
        )
            .prop_map(|(lease_id, incarnation, chunks, ttl_ms, (blocks, pieces))| {
                Message::StagedSelected {
                    lease_id,
                    incarnation,
                    chunks,
                    ttl_ms,
                    shape: SelectedShape { blocks, pieces },
                }
            }),
        "[0-9a-f-]{0,36}".prop_map(|boot_id| Message::MoverHello { boot_id }),
        (
            any::<u64>(),
            proptest::option::of((any::<u32>(), any::<u64>(), any::<[u8; 32]>())),
            ".{0,40}"
        )
            .prop_map(|(incarnation, cma, refused)| Message::MoverOffer {
                incarnation,
                cma: cma.map(|(pid, probe_addr, probe)| kvferry::wire::CmaOffer { pid, probe_addr, probe }),
                refused,
            }),
        (keys(), any::<u32>(), proptest::option::of(selection()))
            .prop_map(|(keys, ttl_ms, select)| { Message::GetMapped { keys, ttl_ms, select } }),
        (
            any::<u128>(),
            any::<u64>(),
            vec(chunk_meta(), 0..10),
            proptest::option::of((0u32..1000, vec(any::<u64>(), 0..20))),
            vec((any::<u64>(), any::<u64>()), 0..20)
        )
            .prop_map(|(lease_id, incarnation, chunks, shape, runs)| Message::StagedMapped {
                lease_id,
                incarnation,
                chunks,
                shape: shape.map(|(blocks, pieces)| SelectedShape { blocks, pieces }),
                runs,
            }),
        (any::<u128>(), any::<u64>()).prop_map(|(lease_id, incarnation)| Message::PullMapped { lease_id, incarnation }),
        (keys(), any::<u32>(), "[a-z-]{0,12}", proptest::option::of(selection())).prop_map(
            |(keys, ttl_ms, kind, select)| Message::GetDeviceMapped {
                keys,
                ttl_ms,
                kind,
                select
            }
        ),
        (
            (any::<u128>(), any::<u64>(), vec(chunk_meta(), 0..10)),
            (
                any::<u64>(),
                "[a-z-]{0,12}",
                vec((vec(any::<u8>(), 0..16), any::<u64>()), 0..4)
            ),
            proptest::option::of((0u32..1000, vec(any::<u64>(), 0..20))),
            vec((any::<u32>(), any::<u64>(), any::<u64>()), 0..20)
        )
            .prop_map(
                |((lease_id, incarnation, chunks), (export_id, kind, buffers), shape, runs)| {
                    Message::StagedDeviceMapped {
                        lease_id,
                        incarnation,
                        chunks,
                        export_id,
                        kind,
                        buffers,
                        shape: shape.map(|(blocks, pieces)| SelectedShape { blocks, pieces }),
                        runs,
                    }
                }
            ),
        (key(), any::<u32>()).prop_map(|(key, wait_ms)| Message::AwaitPublished { key, wait_ms }),
    ]
}

proptest! {
    #[test]
    fn every_message_round_trips(msg in message(), request_id: u64) {
        let got = rt().block_on(async {
            let mut out = Vec::new();
            write_control(&mut out, request_id, &msg).await.unwrap();
            read_control::<_, Message>(&mut &out[..], &Limits::default()).await
        });
        prop_assert_eq!(got.unwrap(), (request_id, msg));
    }

    #[test]
    fn over_duplex(msgs in vec(message(), 1..8)) {
        let got = rt().block_on(async {
            let (mut a, mut b) = tokio::io::duplex(64);
            let sent = msgs.clone();
            let writer = tokio::spawn(async move {
                for (i, m) in sent.iter().enumerate() {
                    write_control(&mut a, i as u64, m).await.unwrap();
                }
            });
            let mut got = Vec::new();
            loop {
                match read_control::<_, Message>(&mut b, &Limits::default()).await {
                    Ok((_, m)) => got.push(m),
                    Err(WireError::Closed) => break,
                    Err(e) => panic!("{e}"),
                }
            }
            writer.await.unwrap();
            got
        });
        prop_assert_eq!(got, msgs);
    }

    /// Arbitrary bytes behind a valid control header reach the decoder: a typed error or
    /// a message, never a panic.
    #[test]
    fn garbage_payload(payload in vec(any::<u8>(), 0..512)) {
        match decode(&control_frame(&payload)) {
            Ok((_, m)) => { let _ = m.validate(&Limits::default()); }
            Err(WireError::Decode(_)) => {}
            Err(e) => prop_assert!(false, "unexpected error {e:?}"),
        }
    }

    /// Fully arbitrary streams: typed errors only.
    #[test]
    fn garbage_stream(bytes in vec(any::<u8>(), 0..256)) {
        let _ = decode(&bytes);
    }

    /// Corrupting any byte of a valid frame never yields a different message silently.
    #[test]
    fn single_byte_corruption(msg in message(), at: prop::sample::Index, flip in 1u8..=255) {
        let mut frame = rt().block_on(async {
            let mut out = Vec::new();
            write_control(&mut out, 1, &msg).await.unwrap();
            out
        });
        let at = at.index(frame.len());
        frame[at] ^= flip;
        prop_assert!(decode(&frame).is_err());
    }
}

#[test]
fn huge_declared_lengths_inside_a_small_frame() {
    // Variant index of Lookup, then a sequence length of u32::MAX in a 6-byte frame.
    let lookup = postcard::to_allocvec(&Message::Lookup { keys: vec![] }).unwrap();
    let mut payload = lookup[..1].to_vec();
    payload.extend_from_slice(&[0xff, 0xff, 0xff, 0xff, 0x0f]);
    assert!(matches!(decode(&control_frame(&payload)), Err(WireError::Decode(_))));
    // Same for a string length (Error message).
    let err = postcard::to_allocvec(&Message::Error {
        kind: ErrorKind::Busy,
        message: String::new(),
    })
    .unwrap();
    let mut payload = err[..2].to_vec();
    payload.extend_from_slice(&[0xff, 0xff, 0xff, 0xff, 0x0f]);
    assert!(matches!(decode(&control_frame(&payload)), Err(WireError::Decode(_))));
}

#[test]
fn validate_enforces_limits() {
    let limits = Limits {
        max_keys: 4,
        max_bulk_bytes: 1000,
        ..Limits::default()
    };
    let oversize = |m: Message| matches!(m.validate(&limits), Err(WireError::Oversize { .. }));
    let ok = |m: Message| m.validate(&limits).is_ok();
    let k = ChunkKey::from_name("k");

    assert!(ok(Message::Lookup { keys: vec![k; 4] }));
    assert!(oversize(Message::Lookup { keys: vec![k; 5] }));
    assert!(oversize(Message::Stage {
        keys: vec![k; 5],
        ttl_ms: 1
    }));
    assert!(oversize(Message::Get {
        keys: vec![k; 5],
        ttl_ms: 1
    }));

    let hello = |peer_id: String| Message::Hello {
        peer_id,
        incarnation: 1,
        nonce: [0; 32],
        wants_auth: false,
    };
    assert!(ok(hello("p".repeat(256))));
    assert!(oversize(hello("p".repeat(257))));
    assert!(oversize(Message::Challenge {
        peer_id: "p".repeat(257),
        incarnation: 1,
        nonce: [0; 32],
        proof: None
    }));

    let error = |message: String| Message::Error {
        kind: ErrorKind::Internal,
        message,
    };
    assert!(ok(error("e".repeat(4096))));
    assert!(oversize(error("e".repeat(4097))));

    let meta = |len| ChunkMeta {
        key: k,
        len,
        checksum: 0,
    };
    let staged = |chunks| Message::Staged {
        lease_id: 1,
        incarnation: 1,
        chunks,
        ttl_ms: 1,
    };
    assert!(ok(staged(vec![meta(1000); 4])));
    assert!(oversize(staged(vec![meta(1000); 5])));
    assert!(oversize(staged(vec![meta(1), meta(1001)])));
    assert!(ok(Message::Put { key: k, len: 1000 }));
    assert!(oversize(Message::Put { key: k, len: 1001 }));
    assert!(oversize(Message::Put { key: k, len: u64::MAX }));
}

#[test]
fn read_message_validates() {
    let limits = Limits {
        max_keys: 2,
        ..Limits::default()
    };
    let k = ChunkKey::from_tokens(&[1, 2, 3]);
    rt().block_on(async {
        let mut stream = Vec::new();
        write_control(&mut stream, 1, &Message::Lookup { keys: vec![k; 3] })
            .await
            .unwrap();
        write_control(&mut stream, 2, &Message::Lookup { keys: vec![k; 2] })
            .await
            .unwrap();
        let mut r = &stream[..];
        let got = read_message(&mut r, &limits).await;
        assert!(
            matches!(
                got,
                Err(WireError::Oversize {
                    what: "key list",
                    len: 3,
                    limit: 2
                })
            ),
            "{got:?}"
        );
        // The rejected frame was consumed: the next one reads fine.
        let (id, msg) = read_message(&mut r, &limits).await.unwrap();
        assert_eq!((id, msg), (2, Message::Lookup { keys: vec![k; 2] }));
    });
}

#[test]
fn names_are_variant_names() {
    assert_eq!(Message::Ping.name(), "Ping");
    assert_eq!(Message::Done { lease_id: 3 }.name(), "Done");
    assert_eq!(
        format!("{:?}", Message::Done { lease_id: 3 }).split_whitespace().next(),
        Some("Done")
    );
}
