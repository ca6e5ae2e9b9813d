//! Frame-level tests of `kvferry::wire`: header encode/decode, control and bulk frames
//! over in-memory streams, and every typed error a malformed stream must produce
//! (never a panic, never an allocation sized by the peer).

use std::io::Cursor;
use std::pin::Pin;
use std::task::{Context, Poll};

use kvferry::wire::{
    read_bulk_body, read_control, read_control_body, read_frame_header, skip_body, write_bulk, write_control,
    FrameHeader, FrameKind, Limits, Message, WireError, HEADER_LEN, MAGIC, VERSION,
};
use proptest::prelude::*;
use tokio::io::{AsyncRead, ReadBuf};

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// Re-seals a hand-edited header: recomputes the header crc over bytes 0..28.
fn reseal(mut b: [u8; HEADER_LEN]) -> [u8; HEADER_LEN] {
    let crc = crc32c::crc32c(&b[..28]);
    b[28..].copy_from_slice(&crc.to_le_bytes());
    b
}

fn header(kind: FrameKind, len: u64) -> FrameHeader {
    FrameHeader {
        kind,
        request_id: 7,
        len,
        checksum: 0,
    }
}

/// An `AsyncRead` that yields at most one byte per poll, to exercise partial reads.
struct Trickle(Cursor<Vec<u8>>);

impl AsyncRead for Trickle {
    fn poll_read(mut self: Pin<&mut Self>, _cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        let pos = self.0.position() as usize;
        if let Some(&b) = self.0.get_ref().get(pos) {
            if buf.remaining() > 0 {
                buf.put_slice(&[b]);
                self.0.set_position(pos as u64 + 1);
            }
        }
        Poll::Ready(Ok(()))
    }
}

async fn control_bytes(request_id: u64, msg: &Message) -> Vec<u8> {
    let mut out = Vec::new();
    write_control(&mut out, request_id, msg).await.unwrap();
    out
}

#[test]
fn header_layout_is_stable() {
    let h = FrameHeader {
        kind: FrameKind::Bulk,
        request_id: 0x0102_0304_0506_0708,
        len: 0x0122_3344,
        checksum: 0xdead_beef,
    };
    let b = h.encode();
    assert_eq!(&b[0..4], b"KVF1");
    assert_eq!(b[4], VERSION);
    assert_eq!(b[5], 2);
    assert_eq!(&b[6..8], &[0, 0]);
    assert_eq!(&b[8..16], &0x0102_0304_0506_0708u64.to_le_bytes());
    assert_eq!(&b[16..24], &0x0122_3344u64.to_le_bytes());
    assert_eq!(&b[24..28], &0xdead_beefu32.to_le_bytes());
    assert_eq!(&b[28..32], &crc32c::crc32c(&b[..28]).to_le_bytes());
    assert_eq!(FrameHeader::decode(&b, &Limits::default()).unwrap(), h);
}

#[test]
fn header_typed_errors() {
    let limits = Limits::default();
    let good = header(FrameKind::Control, 10).encode();

    let mut b = good;
    b[0] = b'X';
    assert!(matches!(FrameHeader::decode(&reseal(b), &limits), Err(WireError::BadMagic(m)) if m == *b"XVF1"));

    let mut b = good;
    b[4] = 2;
    assert!(matches!(
        FrameHeader::decode(&reseal(b), &limits),
        Err(WireError::UnsupportedVersion {
            got: 2,
            supported: VERSION
        })
    ));

    for kind in [0u8, 3, 255] {
        let mut b = good;
        b[5] = kind;
        assert!(matches!(FrameHeader::decode(&reseal(b), &limits), Err(WireError::UnknownFrameKind(k)) if k == kind));
    }

    let mut b = good;
    b[7] = 1;
    assert!(matches!(
        FrameHeader::decode(&reseal(b), &limits),
        Err(WireError::BadHeader(_))
    ));

    // Any single bit flip in bytes 8..32 breaks the header crc.
    for byte in 8..HEADER_LEN {
        let mut b = good;
        b[byte] ^= 0x10;
        assert!(
            matches!(FrameHeader::decode(&b, &limits), Err(WireError::BadHeader(_))),
            "byte {byte}"
        );
    }
}

#[test]
fn oversize_rejected_from_header_alone() {
    let limits = Limits::default();
    let cases = [
        (FrameKind::Control, limits.max_control_bytes + 1),
        (FrameKind::Bulk, limits.max_bulk_bytes + 1),
        (FrameKind::Control, 1 << 63),
        (FrameKind::Bulk, 1 << 63),
        (FrameKind::Control, u64::MAX),
    ];
    rt().block_on(async {
        for (kind, len) in cases {
            // The reader holds only the header: reading any body byte would be Truncated,
            // and allocating `len` bytes would abort the test process.
            let bytes = header(kind, len).encode();
            let got = read_frame_header(&mut &bytes[..], &limits).await;
            assert!(
                matches!(got, Err(WireError::Oversize { len: l, .. }) if l == len),
                "{got:?}"
            );
            let got = read_control::<_, Message>(&mut &bytes[..], &limits).await;
            assert!(matches!(got, Err(WireError::Oversize { .. })), "{got:?}");
            // A header built by hand (bypassing decode) is checked again by the body reader.
            let h = header(FrameKind::Control, len);
            let got = read_control_body::<_, Message>(&mut &b""[..], &h, &limits).await;
            assert!(matches!(got, Err(WireError::Oversize { .. })), "{got:?}");
        }
    });
    // At the limit is fine.
    let h = header(FrameKind::Bulk, limits.max_bulk_bytes);
    assert_eq!(FrameHeader::decode(&h.encode(), &limits).unwrap(), h);
}

#[test]
fn closed_and_truncated() {
    let limits = Limits::default();
    rt().block_on(async {
        let got = read_frame_header(&mut &b""[..], &limits).await;
        assert!(matches!(got, Err(WireError::Closed)), "{got:?}");
        let got = read_control::<_, Message>(&mut &b""[..], &limits).await;
        assert!(matches!(got, Err(WireError::Closed)), "{got:?}");

        let frame = control_bytes(
            1,
            &Message::Error {
                kind: kvferry::wire::ErrorKind::Busy,
                message: "try later".into(),
            },
        )
        .await;
        for cut in 1..frame.len() {
            let got = read_control::<_, Message>(&mut &frame[..cut], &limits).await;
            assert!(matches!(got, Err(WireError::Truncated)), "cut {cut}: {got:?}");
        }
        let mut bulk = Vec::new();
        write_bulk(&mut bulk, 1, &[b"0123456789"]).await.unwrap();
        let mut r = &bulk[..bulk.len() - 1];
        let h = read_frame_header(&mut r, &limits).await.unwrap();
        let mut dst = [0u8; 10];
        let got = read_bulk_body(&mut r, &h, &mut [&mut dst[..]]).await;
        assert!(matches!(got, Err(WireError::Truncated)), "{got:?}");
        let mut r = &bulk[..bulk.len() - 1];
        let h = read_frame_header(&mut r, &limits).await.unwrap();
        assert!(matches!(skip_body(&mut r, &h).await, Err(WireError::Truncated)));
    });
}

#[test]
fn control_checksum_and_trailing_bytes() {
    let limits = Limits::default();
    rt().block_on(async {
        let mut frame = control_bytes(
            3,
            &Message::Lookup {
                keys: vec![kvferry::wire::ChunkKey([9; 32])],
            },
        )
        .await;
        let last = frame.len() - 1;
        frame[last] ^= 1;
        let got = read_control::<_, Message>(&mut &frame[..], &limits).await;
        assert!(matches!(got, Err(WireError::ChecksumMismatch { .. })), "{got:?}");

        // A valid message followed by junk inside the same frame is a decode error.
        let mut payload = postcard::to_allocvec(&Message::Ping).unwrap();
        payload.push(0);
        let h = FrameHeader {
            kind: FrameKind::Control,
            request_id: 1,
            len: payload.len() as u64,
            checksum: crc32c::crc32c(&payload),
        };
        let mut frame = h.encode().to_vec();
        frame.extend_from_slice(&payload);
        let got = read_control::<_, Message>(&mut &frame[..], &limits).await;
        assert!(matches!(got, Err(WireError::Decode(_))), "{got:?}");
    });
}

#[test]
fn frame_kind_mismatch() {
    let limits = Limits::default();
    rt().block_on(async {
        let mut bulk = Vec::new();
        write_bulk(&mut bulk, 5, &[b"abc"]).await.unwrap();
        let got = read_control::<_, Message>(&mut &bulk[..], &limits).await;
        assert!(
            matches!(
                got,
                Err(WireError::UnexpectedFrame {
                    expected: FrameKind::Control,
                    got: FrameKind::Bulk
                })
            ),
            "{got:?}"
        );
        let ctl = control_bytes(5, &Message::Ping).await;
        let mut r = &ctl[..];
        let h = read_frame_header(&mut r, &limits).await.unwrap();
        let mut dst = [0u8; 1];
        let got = read_bulk_body(&mut r, &h, &mut [&mut dst[..]]).await;
        assert!(
            matches!(
                got,
                Err(WireError::UnexpectedFrame {
                    expected: FrameKind::Bulk,
                    got: FrameKind::Control
                })
            ),
            "{got:?}"
        );
    });
}

#[test]
fn bulk_scatter_checksum_and_length() {
    let limits = Limits::default();
    rt().block_on(async {
        let data: Vec<u8> = (0..=255u8).cycle().take(1000).collect();
        let mut frame = Vec::new();
        write_bulk(&mut frame, 11, &[&data[..100], &data[100..], &[]])
            .await
            .unwrap();
        assert_eq!(frame.len(), HEADER_LEN + 1000);
        assert_eq!(&frame[HEADER_LEN..], &data[..]);

        // Scatter into uneven parts, including an empty one.
        let mut r = &frame[..];
        let h = read_frame_header(&mut r, &limits).await.unwrap();
        assert_eq!((h.kind, h.request_id, h.len), (FrameKind::Bulk, 11, 1000));
        let (mut a, mut b, mut c) = (vec![0u8; 1], vec![0u8; 0], vec![0u8; 999]);
        read_bulk_body(&mut r, &h, &mut [&mut a, &mut b, &mut c]).await.unwrap();
        assert_eq!([a, c].concat(), data);
        assert!(r.is_empty());

        // Wrong total length: rejected before reading anything.
        let mut r = &frame[..];
        let h = read_frame_header(&mut r, &limits).await.unwrap();
        let mut short = vec![0u8; 999];
        let got = read_bulk_body(&mut r, &h, &mut [&mut short]).await;
        assert!(
            matches!(
                got,
                Err(WireError::LengthMismatch {
                    expected: 1000,
                    actual: 999
                })
            ),
            "{got:?}"
        );
        assert_eq!(r.len(), 1000);

        // A flipped payload byte is detected.
        for at in [HEADER_LEN, HEADER_LEN + 500, frame.len() - 1] {
            let mut bad = frame.clone();
            bad[at] ^= 0x80;
            let mut r = &bad[..];
            let h = read_frame_header(&mut r, &limits).await.unwrap();
            let mut dst = vec![0u8; 1000];
            let got = read_bulk_body(&mut r, &h, &mut [&mut dst]).await;
            assert!(matches!(got, Err(WireError::ChecksumMismatch { .. })), "{got:?}");
        }
    });
}

#[test]
fn skip_then_read_next_frame() {
    let limits = Limits::default();
    rt().block_on(async {
        let mut stream = Vec::new();
        let big = vec![0x5au8; 100_000];
        write_bulk(&mut stream, 1, &[&big]).await.unwrap();
        write_control(&mut stream, 2, &Message::Pong).await.unwrap();
        let mut r = &stream[..];
        let h = read_frame_header(&mut r, &limits).await.unwrap();
        skip_body(&mut r, &h).await.unwrap();
        let (id, msg) = read_control::<_, Message>(&mut r, &limits).await.unwrap();
        assert_eq!((id, msg), (2, Message::Pong));
        assert!(matches!(
            read_control::<_, Message>(&mut r, &limits).await,
            Err(WireError::Closed)
        ));
    });
}

#[test]
fn one_byte_reads_and_duplex() {
    let limits = Limits::default();
    rt().block_on(async {
        let mut stream = control_bytes(
            9,
            &Message::Stage {
                keys: vec![kvferry::wire::ChunkKey([1; 32]); 3],
                ttl_ms: 500,
            },
        )
        .await;
        write_bulk(&mut stream, 9, &[b"hello ", b"world"]).await.unwrap();
        let mut r = Trickle(Cursor::new(stream));
        let (id, msg) = read_control::<_, Message>(&mut r, &limits).await.unwrap();
        assert_eq!(id, 9);
        assert!(matches!(msg, Message::Stage { ttl_ms: 500, .. }));
        let h = read_frame_header(&mut r, &limits).await.unwrap();
        let mut dst = [0u8; 11];
        let (hello, world) = dst.split_at_mut(5);
        read_bulk_body(&mut r, &h, &mut [hello, world]).await.unwrap();
        assert_eq!(&dst, b"hello world");

        // Through a tiny duplex pipe, writer and reader interleaved.
        let (mut a, mut b) = tokio::io::duplex(7);
        let payload = vec![0xa5u8; 10_000];
        let p2 = payload.clone();
        let writer = tokio::spawn(async move {
            for i in 0..10u64 {
                write_control(&mut a, i, &Message::Ping).await.unwrap();
                write_bulk(&mut a, i, &[&p2[..3], &p2[3..]]).await.unwrap();
            }
        });
        for i in 0..10u64 {
            let (id, msg) = read_control::<_, Message>(&mut b, &limits).await.unwrap();
            assert_eq!((id, msg), (i, Message::Ping));
            let h = read_frame_header(&mut b, &limits).await.unwrap();
            let mut dst = vec![0u8; 10_000];
            read_bulk_body(&mut b, &h, &mut [&mut dst]).await.unwrap();
            assert_eq!(dst, payload);
        }
        writer.await.unwrap();
        assert!(matches!(
            read_frame_header(&mut b, &limits).await,
            Err(WireError::Closed)
        ));
    });
}

fn kind() -> impl Strategy<Value = FrameKind> {
    prop_oneof![Just(FrameKind::Control), Just(FrameKind::Bulk)]
}

proptest! {
    #[test]
    fn header_round_trip(kind in kind(), request_id: u64, len: u64, checksum: u32) {
        let h = FrameHeader { kind, request_id, len, checksum };
        let limits = Limits { max_control_bytes: u64::MAX, max_bulk_bytes: u64::MAX, max_keys: 0, ..Limits::default() };
        prop_assert_eq!(FrameHeader::decode(&h.encode(), &limits).unwrap(), h);
        let got = FrameHeader::decode(&h.encode(), &Limits::default());
        let limit = match kind {
            FrameKind::Control => Limits::default().max_control_bytes,
            FrameKind::Bulk => Limits::default().max_bulk_bytes,
        };
        if len <= limit {
            prop_assert_eq!(got.unwrap(), h);
        } else {
            let is_oversize = matches!(got, Err(WireError::Oversize { .. }));
            prop_assert!(is_oversize);
        }
    }

    #[test]
    fn header_garbage_never_panics(bytes: [u8; 32]) {
        let _ = FrameHeader::decode(&bytes, &Limits::default());
    }

    /// Garbage past the magic/version/crc gates: only typed errors or a valid header.
    #[test]
    fn sealed_header_garbage(mut bytes: [u8; 32]) {
        bytes[..4].copy_from_slice(&MAGIC);
        bytes[4] = VERSION;
        match FrameHeader::decode(&reseal(bytes), &Limits::default()) {
            Ok(h) => prop_assert_eq!(h.encode(), reseal(bytes)),
            Err(WireError::UnknownFrameKind(_) | WireError::BadHeader(_) | WireError::Oversize { .. }) => {}
            Err(e) => prop_assert!(false, "unexpected error {e:?}"),
        }
    }

    #[test]
    fn bulk_round_trip(data in proptest::collection::vec(any::<u8>(), 0..2048), cuts in proptest::collection::vec(any::<prop::sample::Index>(), 0..4)) {
        let mut points: Vec<usize> = cuts.iter().map(|c| c.index(data.len() + 1)).collect();
        points.sort_unstable();
        let limits = Limits::default();
        rt().block_on(async {
            let mut frame = Vec::new();
            // Gather from one split, scatter into another.
            write_bulk(&mut frame, 4, &[&data[..data.len() / 2], &data[data.len() / 2..]]).await.unwrap();
            let mut out = data.iter().map(|_| 0u8).collect::<Vec<_>>();
            let mut parts: Vec<&mut [u8]> = Vec::new();
            let mut rest = &mut out[..];
            let mut at = 0;
            for p in &points {
                let (a, b) = rest.split_at_mut(p - at);
                parts.push(a);
                rest = b;
                at = *p;
            }
            parts.push(rest);
            let mut r = &frame[..];
            let h = read_frame_header(&mut r, &limits).await.unwrap();
            read_bulk_body(&mut r, &h, &mut parts).await.unwrap();
            assert_eq!(out, data);
        });
    }
}
