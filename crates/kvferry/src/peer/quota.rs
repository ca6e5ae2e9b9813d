//! Staging quotas: how many staging pages a holder may have leased at once, and the
//! [`Charge`] guard that keeps each lease's pages counted for exactly as long as it
//! lives.
//!
//! Every staged lease and every put's receive allocation owns one [`Charge`]; the
//! pages are uncharged when the charge drops, which is when its lease drops — on
//! `Done`, TTL expiry, release, a failed or aborted send, or a connection task torn
//! down mid-transfer. No call site uncharges by hand, so none can forget to.
//!
//! A request is charged to its [`Holder`] in four scopes, each with its own limit
//! ([`QuotaLimits`]):
//!
//! - **peer**: its authenticated identity (the TLS certificate's, else the claimed
//!   peer id);
//! - **connection**: the connection it came on (a lease staged for a later pull stays
//!   charged to it after the connection closed, until it ends);
//! - **source**, for unproven identities only (no TLS certificate: the peer id is a
//!   claim any holder of the secret can vary): the source address (IPv6: its /64), so
//!   one host cannot fill the arena under many claimed ids;
//! - **unproven**: all unproven identities together, so some staging is always left
//!   for certificate-holding peers and for local work.
//!
//! A charge is refused whole (nothing counted) when any scope would go over.
//!
//! # Cancellation
//!
//! Nothing here waits. Dropping a [`Charge`] (with the lease or future owning it)
//! uncharges it at once.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;

use parking_lot::Mutex;

/// Why a charge was refused.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum QuotaError {
    /// A scope's limit would be exceeded.
    #[error("staging quota of {scope} exceeded: holds {held} pages, asked {asked}, quota {quota}")]
    Exceeded {
        /// The scope refused: `peer P`, `connection N of P`, `source A`, `unproven peers`.
        scope: String,
        /// Pages the scope holds.
        held: usize,
        /// Pages asked for.
        asked: usize,
        /// The scope's limit.
        quota: usize,
    },
}

/// The limits of the four scopes, in pages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QuotaLimits {
    /// Per authenticated identity.
    pub per_peer: usize,
    /// Per connection.
    pub per_connection: usize,
    /// Per source address of unproven identities.
    pub per_source: usize,
    /// All unproven identities together.
    pub unproven: usize,
}

/// Who a charge is for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Holder {
    /// Its identity: the certificate's under TLS, else the claimed peer id.
    pub identity: String,
    /// The connection (`None`: a local call).
    pub conn: Option<u64>,
    /// Its source address, counted for unproven identities (`None`: local).
    pub source: Option<IpAddr>,
    /// True when the identity is proven (a TLS certificate) or local.
    pub proven: bool,
    /// Under TLS, the peer id the connection claimed when it differs from the
    /// certificate's identity: the name the peer directory knows it by, so that a peer
    /// the directory reports lost has its leases released (several peers may share one
    /// certificate). Not an authority: only the owner's own leases carry it.
    pub claimed: Option<String>,
}

impl Holder {
    /// A local caller (the embedder): counted per identity only.
    pub fn local(identity: &str) -> Holder {
        Holder {
            identity: identity.to_string(),
            conn: None,
            source: None,
            proven: true,
            claimed: None,
        }
    }
}

#[derive(Default)]
struct Held {
    by_peer: HashMap<String, usize>,
    by_conn: HashMap<u64, usize>,
    by_source: HashMap<IpAddr, usize>,
    unproven: usize,
    total: usize,
}

fn add<K: std::hash::Hash + Eq>(m: &mut HashMap<K, usize>, k: K, n: usize) {
    *m.entry(k).or_insert(0) += n;
}

fn sub<K: std::hash::Hash + Eq>(m: &mut HashMap<K, usize>, k: &K, n: usize) {
    if let Some(v) = m.get_mut(k) {
        *v = v.saturating_sub(n);
        if *v == 0 {
            m.remove(k);
        }
    }
}

/// The quota ledger of one producer.
pub struct Quotas {
    limits: QuotaLimits,
    held: Mutex<Held>,
}

/// The counted unit of a source address: an IPv4 address, or an IPv6 /64 (IPv4-mapped
/// addresses as IPv4).
pub fn source_unit(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(_) => ip,
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(std::net::Ipv6Addr::from(u128::from(v6) & !((1u128 << 64) - 1))),
        },
    }
}

impl Quotas {
    /// A ledger with `limits`.
    pub fn new(limits: QuotaLimits) -> Arc<Quotas> {
        Arc::new(Quotas {
            limits,
            held: Mutex::new(Held::default()),
        })
    }

    /// The limits.
    pub fn limits(&self) -> QuotaLimits {
        self.limits
    }

    /// The scopes of `h` with what each holds and its limit.
    fn scopes(&self, held: &Held, h: &Holder) -> Vec<(String, usize, usize)> {
        let l = &self.limits;
        let mut out = vec![(
            format!("peer {}", h.identity),
            held.by_peer.get(&h.identity).copied().unwrap_or(0),
            l.per_peer,
        )];
        if let Some(c) = h.conn {
            out.push((
                format!("connection {c} of {}", h.identity),
                held.by_conn.get(&c).copied().unwrap_or(0),
                l.per_connection,
            ));
        }
        if !h.proven {
            if let Some(s) = h.source.map(source_unit) {
                out.push((
                    format!("source {s}"),
                    held.by_source.get(&s).copied().unwrap_or(0),
                    l.per_source,
                ));
            }
            out.push(("unproven peers".to_string(), held.unproven, l.unproven));
        }
        out
    }

    /// Pages `h` could be charged now (the least room over its scopes).
    pub fn room(&self, h: &Holder) -> usize {
        let held = self.held.lock();
        self.scopes(&held, h)
            .into_iter()
            .map(|(_, n, q)| q.saturating_sub(n))
            .min()
            .unwrap_or(0)
    }

    /// Charges `pages` to `h` in every scope, or refuses (charging nothing).
    pub fn charge(self: &Arc<Self>, h: &Holder, pages: usize) -> Result<Charge, QuotaError> {
        let mut held = self.held.lock();
        for (scope, n, quota) in self.scopes(&held, h) {
            if n + pages > quota {
                return Err(QuotaError::Exceeded {
                    scope,
                    held: n,
                    asked: pages,
                    quota,
                });
            }
        }
        let source = (!h.proven).then(|| h.source.map(source_unit)).flatten();
        add(&mut held.by_peer, h.identity.clone(), pages);
        if let Some(c) = h.conn {
            add(&mut held.by_conn, c, pages);
        }
        if let Some(s) = source {
            add(&mut held.by_source, s, pages);
        }
        if !h.proven {
            held.unproven += pages;
        }
        held.total += pages;
        Ok(Charge {
            quotas: self.clone(),
            identity: h.identity.clone(),
            conn: h.conn,
            source,
            unproven: !h.proven,
            pages,
        })
    }

    /// Pages charged now, in all.
    pub fn charged(&self) -> usize {
        self.held.lock().total
    }

    /// Pages charged now to identity `peer`.
    pub fn charged_to(&self, peer: &str) -> usize {
        self.held.lock().by_peer.get(peer).copied().unwrap_or(0)
    }
}

/// Pages charged to a holder; dropping it uncharges them.
pub struct Charge {
    quotas: Arc<Quotas>,
    identity: String,
    conn: Option<u64>,
    source: Option<IpAddr>,
    unproven: bool,
    pages: usize,
}

impl std::fmt::Debug for Charge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Charge")
            .field("identity", &self.identity)
            .field("pages", &self.pages)
            .finish()
    }
}

impl Charge {
    /// Pages it charges.
    pub fn pages(&self) -> usize {
        self.pages
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        let mut held = self.quotas.held.lock();
        let n = self.pages;
        sub(&mut held.by_peer, &self.identity, n);
        if let Some(c) = self.conn {
            sub(&mut held.by_conn, &c, n);
        }
        if let Some(s) = &self.source {
            sub(&mut held.by_source, s, n);
        }
        if self.unproven {
            held.unproven = held.unproven.saturating_sub(n);
        }
        held.total = held.total.saturating_sub(n);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> QuotaLimits {
        QuotaLimits {
            per_peer: 8,
            per_connection: 4,
            per_source: 10,
            unproven: 12,
        }
    }

    fn h(id: &str, conn: u64, ip: &str, proven: bool) -> Holder {
        Holder {
            identity: id.into(),
            conn: Some(conn),
            source: Some(ip.parse().unwrap()),
            proven,
            claimed: None,
        }
    }

    #[test]
    fn every_scope_bounds_and_drops_uncharge() {
        let q = Quotas::new(limits());
        let a = q.charge(&h("a", 1, "10.0.0.1", false), 4).unwrap();
        // Connection 1 is full, another connection of a is not.
        let e = q.charge(&h("a", 1, "10.0.0.1", false), 1).unwrap_err();
        assert!(e.to_string().contains("connection 1"), "{e}");
        let b = q.charge(&h("a", 2, "10.0.0.1", false), 4).unwrap();
        // Peer a is full (8).
        assert!(q
            .charge(&h("a", 3, "10.0.0.1", false), 1)
            .unwrap_err()
            .to_string()
            .contains("peer a"));
        // Another id from the same source: source holds 8 of 10.
        let c = q.charge(&h("a-1", 4, "10.0.0.1", false), 2).unwrap();
        let e = q.charge(&h("a-2", 5, "10.0.0.1", false), 1).unwrap_err();
        assert!(e.to_string().contains("source 10.0.0.1"), "{e}");
        assert_eq!(q.room(&h("a-2", 5, "10.0.0.1", false)), 0);
        // Another source: the unproven total (12) bounds it.
        let d = q.charge(&h("x", 6, "10.0.0.2", false), 2).unwrap();
        let e = q.charge(&h("y", 7, "10.0.0.3", false), 1).unwrap_err();
        assert!(e.to_string().contains("unproven"), "{e}");
        // A proven identity is outside the source and unproven scopes.
        let p = q.charge(&h("cert", 8, "10.0.0.1", true), 4).unwrap();
        assert_eq!(q.charged(), 16);
        drop((a, b, c, d, p));
        assert_eq!(q.charged(), 0);
        assert_eq!(q.charged_to("a"), 0);
        let held = q.held.lock();
        assert!(held.by_peer.is_empty() && held.by_conn.is_empty() && held.by_source.is_empty());
        assert_eq!(held.unproven, 0);
    }

    #[test]
    fn ipv6_sources_count_per_64() {
        let q = Quotas::new(limits());
        let _a = q.charge(&h("a", 1, "2001:db8::1", false), 4).unwrap();
        let _b = q.charge(&h("b", 2, "2001:db8::2", false), 4).unwrap();
        assert_eq!(q.room(&h("c", 3, "2001:db8::3", false)), 2);
        assert_eq!(q.room(&h("c", 3, "2001:db8:0:1::3", false)), 4);
    }
}
