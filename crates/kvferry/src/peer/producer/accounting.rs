//! Per-request accounting of the producer: which kind of request it was, how it ended
//! and how long it took, recorded into the producer's [`RequestStats`].
//!
//! [`measured`] runs one request's handler future with a task-local outcome slot;
//! the handler calls [`note`] where it decides its reply (a hit or a miss, a refusal
//! and its kind), and the last note wins. A handler that returns `Ok` without a note
//! answered as asked (`ok`); one that returns `Err` ended its connection (`error`),
//! whatever it noted. Calling [`note`] outside [`measured`] does nothing.
//!
//! # Cancellation
//!
//! A request future dropped before it finished (its connection or server torn down) is
//! not recorded: it has no outcome. Nothing else is held.

use std::cell::Cell;
use std::future::Future;

use tokio::time::Instant;

use crate::net::NetError;
use crate::stats::{RequestKind, RequestOutcome, RequestStats};
use crate::wire::{ErrorKind, Message};

tokio::task_local! {
    static OUTCOME: Cell<Option<RequestOutcome>>;
}

/// Notes how the request being handled ends (the last note wins).
pub(super) fn note(outcome: RequestOutcome) {
    let _ = OUTCOME.try_with(|c| c.set(Some(outcome)));
}

/// Notes a refusal with `kind`: `Busy` is a busy outcome, any other kind refused.
pub(super) fn note_refusal(kind: ErrorKind) {
    note(match kind {
        ErrorKind::Busy => RequestOutcome::Busy,
        _ => RequestOutcome::Refused,
    });
}

/// Notes a stage, get or lookup that found something (`hit`) or nothing (`miss`).
pub(super) fn note_found(found: bool) {
    note(if found {
        RequestOutcome::Hit
    } else {
        RequestOutcome::Miss
    });
}

/// The kind of a request message: every get-like request counts the same way,
/// whichever mover serves it (a socket get, a selected get, a same-host or device-IPC
/// mapped get are all `Get`; a delayed pull over the socket or mapped is `Pull`). The
/// match names every variant, so a new request cannot fall into `Other` unnoticed.
pub(super) fn kind_of(msg: &Message) -> RequestKind {
    match msg {
        Message::Ping | Message::MoverHello { .. } | Message::DeviceIpcHello { .. } => RequestKind::Ping,
        Message::Lookup { .. } | Message::AwaitPublished { .. } => RequestKind::Lookup,
        Message::Stage { .. } | Message::StageSelected { .. } => RequestKind::Stage,
        Message::Get { .. }
        | Message::GetSelected { .. }
        | Message::GetMapped { .. }
        | Message::GetDeviceMapped { .. } => RequestKind::Get,
        Message::Pull { .. } | Message::PullMapped { .. } => RequestKind::Pull,
        // A release without a pull frees publications as `Done` frees leases.
        Message::Done { .. } | Message::Release { .. } => RequestKind::Done,
        Message::Put { .. } => RequestKind::Put,
        // Handshake messages and replies: not requests a client may send here.
        Message::Hello { .. }
        | Message::Challenge { .. }
        | Message::Auth { .. }
        | Message::Welcome
        | Message::WelcomeAuth { .. }
        | Message::LookupReply { .. }
        | Message::Staged { .. }
        | Message::StagedSelected { .. }
        | Message::StagedMapped { .. }
        | Message::StagedDeviceMapped { .. }
        | Message::PullDone { .. }
        | Message::DoneAck
        | Message::PutAck { .. }
        | Message::ReleaseAck { .. }
        | Message::MoverOffer { .. }
        | Message::DeviceIpcOffer { .. }
        | Message::Error { .. }
        | Message::Pong => RequestKind::Other,
    }
}

/// Whether a request of `kind` takes new staging (a stage or a get of any mover):
/// what a producer that is refusing (no longer in the peer directory) turns away.
pub(super) fn takes_staging(kind: RequestKind) -> bool {
    matches!(kind, RequestKind::Stage | RequestKind::Get)
}

/// Runs `handler` (one request of `kind`) and records its outcome and latency.
pub(super) async fn measured<F>(stats: &RequestStats, kind: RequestKind, handler: F) -> Result<(), NetError>
where
    F: Future<Output = Result<(), NetError>>,
{
    let start = Instant::now();
    let (result, noted) = OUTCOME
        .scope(Cell::new(None), async {
            let r = handler.await;
            (r, OUTCOME.with(Cell::get))
        })
        .await;
    let outcome = match (&result, noted) {
        (Err(_), _) => RequestOutcome::Error,
        (Ok(()), Some(o)) => o,
        (Ok(()), None) => RequestOutcome::Ok,
    };
    stats.record(kind, outcome, start.elapsed());
    result
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// Issue 55: device-IPC gets and mapped pulls were counted as `other` (the kind of
    /// an unexpected message) while the handler served them as gets and pulls.
    #[test]
    fn every_get_like_request_counts_as_a_get_or_pull_whatever_its_mover() {
        let key = crate::wire::ChunkKey::from_name("k");
        let gets = [
            Message::Get {
                keys: vec![key],
                ttl_ms: 1,
            },
            Message::GetMapped {
                keys: vec![key],
                ttl_ms: 1,
                select: None,
            },
            Message::GetDeviceMapped {
                keys: vec![key],
                ttl_ms: 1,
                kind: "sim".into(),
                select: None,
            },
        ];
        for m in &gets {
            assert_eq!(kind_of(m), RequestKind::Get, "{}", m.name());
            assert!(takes_staging(kind_of(m)), "{}", m.name());
        }
        let pulls = [
            Message::Pull {
                lease_id: 1,
                incarnation: 2,
            },
            Message::PullMapped {
                lease_id: 1,
                incarnation: 2,
            },
        ];
        for m in &pulls {
            assert_eq!(kind_of(m), RequestKind::Pull, "{}", m.name());
            assert!(!takes_staging(kind_of(m)), "a granted lease is served while refusing");
        }
        let offer = Message::MoverHello { boot_id: String::new() };
        assert_eq!(kind_of(&offer), RequestKind::Ping);
        assert_eq!(kind_of(&Message::Pong), RequestKind::Other);
    }

    #[tokio::test]
    async fn the_last_note_wins_and_errors_override() {
        let s = RequestStats::default();
        measured(&s, RequestKind::Get, async {
            note_found(true);
            note_refusal(ErrorKind::Busy);
            Ok(())
        })
        .await
        .unwrap();
        measured(&s, RequestKind::Get, async {
            note_found(false);
            Ok(())
        })
        .await
        .unwrap();
        measured(&s, RequestKind::Done, async { Ok(()) }).await.unwrap();
        measured(&s, RequestKind::Pull, async {
            note_found(true);
            tokio::time::sleep(Duration::from_millis(2)).await;
            Err(NetError::Protocol("x".into()))
        })
        .await
        .unwrap_err();
        note(RequestOutcome::Hit); // outside a request: ignored
        let n = |k, o| s.counts().iter().find(|c| c.0 == k && c.1 == o).unwrap().2;
        assert_eq!(n(RequestKind::Get, RequestOutcome::Busy), 1);
        assert_eq!(n(RequestKind::Get, RequestOutcome::Hit), 0);
        assert_eq!(n(RequestKind::Get, RequestOutcome::Miss), 1);
        assert_eq!(n(RequestKind::Done, RequestOutcome::Ok), 1);
        assert_eq!(n(RequestKind::Pull, RequestOutcome::Error), 1);
        assert_eq!(s.total(), 4);
        let pull = s.latency().into_iter().find(|l| l.0 == RequestKind::Pull).unwrap().1;
        assert!(pull.sum >= 0.002, "{}", pull.sum);
    }
}
