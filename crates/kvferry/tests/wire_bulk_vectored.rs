//! Vectored bulk frames over real loopback TCP: a payload written from many parts and
//! read into many differently cut parts arrives intact, with its checksum verified;
//! a wrong checksum is reported after the whole payload.

use kvferry::wire::{
    read_bulk_body_tcp, write_bulk, write_bulk_with_checksum, FrameHeader, Limits, WireError, HEADER_LEN,
};
use proptest::prelude::*;
use tokio::io::AsyncReadExt;
use tokio::net::{TcpListener, TcpStream};

fn cut(data: &[u8], cuts: &[usize]) -> Vec<(usize, usize)> {
    let mut points: Vec<usize> = cuts.iter().map(|c| c % (data.len() + 1)).collect();
    points.push(0);
    points.push(data.len());
    points.sort_unstable();
    points.windows(2).map(|w| (w[0], w[1] - w[0])).collect()
}

async fn pair() -> (TcpStream, TcpStream) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let a = TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
    let (b, _) = l.accept().await.unwrap();
    (a, b)
}

async fn roundtrip(data: Vec<u8>, wcuts: Vec<usize>, rcuts: Vec<usize>, corrupt: bool) -> Result<Vec<u8>, WireError> {
    let (mut a, mut b) = pair().await;
    let w = cut(&data, &wcuts);
    let d2 = data.clone();
    let writer = tokio::spawn(async move {
        let parts: Vec<&[u8]> = w.iter().map(|&(o, n)| &d2[o..o + n]).collect();
        if corrupt {
            write_bulk_with_checksum(&mut a, 7, &parts, 0xDEAD_BEEF).await.unwrap();
        } else {
            write_bulk(&mut a, 7, &parts).await.unwrap();
        }
        a
    });
    let mut hb = [0u8; HEADER_LEN];
    b.read_exact(&mut hb).await.unwrap();
    let header = FrameHeader::decode(&hb, &Limits::default()).unwrap();
    let mut out = vec![0u8; data.len()];
    let r = cut(&out, &rcuts);
    let result = {
        let mut rest: &mut [u8] = &mut out;
        let mut parts: Vec<&mut [u8]> = Vec::new();
        for &(_, n) in &r {
            let (p, tail) = rest.split_at_mut(n);
            parts.push(p);
            rest = tail;
        }
        read_bulk_body_tcp(&mut b, &header, &mut parts, std::time::Duration::from_secs(10)).await
    };
    drop(writer.await.unwrap());
    result.map(|_| out)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    #[test]
    fn vectored_payload_arrives_intact(
        len in 1usize..(3 << 20),
        wcuts in proptest::collection::vec(any::<usize>(), 0..1500),
        rcuts in proptest::collection::vec(any::<usize>(), 0..1500),
    ) {
        let data: Vec<u8> = (0..len).map(|i| (i.wrapping_mul(2654435761) >> 13) as u8).collect();
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let got = rt.block_on(roundtrip(data.clone(), wcuts, rcuts, false)).unwrap();
        prop_assert!(got == data);
    }
}

#[tokio::test]
async fn wrong_checksum_is_reported_after_the_payload() {
    let data = vec![5u8; 100_000];
    let e = roundtrip(data, vec![10, 5000, 70_000], vec![1, 2, 3, 40_000], true)
        .await
        .unwrap_err();
    assert!(
        matches!(
            e,
            WireError::ChecksumMismatch {
                expected: 0xDEAD_BEEF,
                ..
            }
        ),
        "{e}"
    );
}
