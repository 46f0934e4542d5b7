//! Open connections checked again: a peer accepted at its handshake is not accepted forever.
//!
//! Every verified connection (accepted by a worker's Node service or a controller's Cluster
//! service, or dialled by either side) is registered with its side's [`TlsSource`] together
//! with the certificate chain its peer presented, and wrapped in a [`Revocable`] stream. Every
//! [`SWEEP_EVERY`] the source looks at its files (the same look a handshake makes); when the
//! material changed (a new `crl.pem`, `ca.pem`, or this side's own certificate), every open
//! peer's chain is verified again against it, as a new handshake would; otherwise only peers
//! whose certificate (or an intermediate it presented) is past its `notAfter` are. A peer that
//! no longer passes is refused: its connection is cut (reads and writes fail, the HTTP/2
//! connection ends and the socket closes), the refusal is logged (`cluster peer refused`, with
//! the peer's SPIFFE id) and counted in `torpor_cluster_tls_refusals_total{side, reason}`. Its
//! next connection is refused at the handshake like any other.

use std::collections::HashMap;
use std::fmt;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::task::{Context, Poll};
use std::time::Duration;

use futures::task::AtomicWaker;
use rustls::pki_types::{CertificateDer, UnixTime};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::{rustls_reason, Expected, Material, TlsSource};
use crate::ca::Identity;

/// How often open connections are looked at (changed files, expired peers).
pub const SWEEP_EVERY: Duration = super::RELOAD_CHECK;

/// Which end of the connection this side is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// This side accepted it (the peer presented a client certificate).
    Accepted,
    /// This side dialled it (the peer presented a server certificate).
    Dialled,
}

/// The switch that ends one connection.
#[derive(Default)]
pub(crate) struct Cut {
    done: AtomicBool,
    read: AtomicWaker,
    write: AtomicWaker,
}

impl Cut {
    fn cut(&self) {
        self.done.store(true, Ordering::SeqCst);
        self.read.wake();
        self.write.wake();
    }

    pub(crate) fn is_cut(&self) -> bool {
        self.done.load(Ordering::SeqCst)
    }

    /// Whether the connection is cut; if not, `waker` is woken when it is.
    fn poll(&self, waker: &AtomicWaker, cx: &Context<'_>) -> bool {
        if self.is_cut() {
            return true;
        }
        waker.register(cx.waker());
        self.is_cut()
    }
}

struct Open {
    direction: Direction,
    expected: Expected,
    peer: Option<SocketAddr>,
    /// The peer's SPIFFE id (for the log).
    identity: String,
    chain: Arc<[CertificateDer<'static>]>,
    /// The earliest `notAfter` of the presented chain (Unix seconds).
    not_after: u64,
    cut: Arc<Cut>,
}

/// An open connection to verify, taken out of the table (verified without its lock).
struct Candidate {
    direction: Direction,
    expected: Expected,
    peer: Option<SocketAddr>,
    identity: String,
    chain: Arc<[CertificateDer<'static>]>,
    cut: Arc<Cut>,
}

/// A source's open connections.
#[derive(Default)]
pub(super) struct OpenPeers {
    next: u64,
    open: HashMap<u64, Open>,
    /// The material generation open peers were last verified against.
    verified_generation: u64,
    sweeper: bool,
}

/// A peer refused on an open connection (what [`TlsSource::sweep`] did).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpenRefusal {
    pub identity: String,
    pub peer: Option<SocketAddr>,
    pub reason: &'static str,
}

fn not_after_of(der: &CertificateDer<'_>) -> Option<u64> {
    let (_, cert) = x509_parser::parse_x509_certificate(der).ok()?;
    u64::try_from(cert.validity().not_after.timestamp()).ok()
}

impl TlsSource {
    /// Registers a verified connection whose peer presented `chain` (end entity first) and
    /// wraps it so that it can be cut when the peer is no longer accepted.
    pub(crate) fn watch<S>(
        self: &Arc<Self>,
        io: S,
        direction: Direction,
        peer: Option<SocketAddr>,
        chain: Vec<CertificateDer<'static>>,
    ) -> Revocable<S> {
        let expected = self.expected_peer();
        self.watch_expecting(io, direction, peer, chain, expected)
    }

    /// [`TlsSource::watch`] for a peer checked against `expected` (another controller).
    pub(crate) fn watch_expecting<S>(
        self: &Arc<Self>,
        io: S,
        direction: Direction,
        peer: Option<SocketAddr>,
        chain: Vec<CertificateDer<'static>>,
        expected: Expected,
    ) -> Revocable<S> {
        let identity = chain
            .first()
            .and_then(|c| Identity::of_certificate(c).ok())
            .map_or_else(|| "unknown".to_string(), |i| i.to_string());
        let not_after = chain.iter().filter_map(not_after_of).min().unwrap_or(0);
        let cut = Arc::new(Cut::default());
        let (id, start) = {
            let mut o = self.open_peers();
            let id = o.next;
            o.next += 1;
            o.open.insert(
                id,
                Open {
                    direction,
                    expected,
                    peer,
                    identity,
                    chain: chain.into(),
                    not_after,
                    cut: cut.clone(),
                },
            );
            let start = !o.sweeper;
            o.sweeper = true;
            (id, start)
        };
        if start {
            self.start_sweeper();
        }
        Revocable {
            io,
            cut,
            _open: OpenGuard {
                src: Arc::downgrade(self),
                id,
            },
        }
    }

    /// How many connections are open (and watched) now.
    pub fn open_connections(&self) -> usize {
        self.open_peers().open.len()
    }

    fn open_peers(&self) -> std::sync::MutexGuard<'_, OpenPeers> {
        self.open.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Sweeps every [`SWEEP_EVERY`] while the source lives (needs a Tokio runtime; without
    /// one, whoever registered connections sweeps by hand).
    fn start_sweeper(self: &Arc<Self>) {
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            self.open_peers().sweeper = false;
            return;
        };
        let src = Arc::downgrade(self);
        rt.spawn(async move {
            let mut tick = tokio::time::interval(SWEEP_EVERY);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let Some(src) = src.upgrade() else { return };
                // Re-verifying every open peer after a change is CPU work (a chain and a CRL
                // lookup each): off the runtime's threads.
                let _ = tokio::task::spawn_blocking(move || src.sweep(UnixTime::now())).await;
            }
        });
    }

    /// Checks the open connections as of `now`: all of them when the material changed since
    /// the last sweep (it is re-read here if its files changed), else those whose chain
    /// expired. Cuts, logs and counts the refused ones, and returns them.
    pub fn sweep(&self, now: UnixTime) -> Vec<OpenRefusal> {
        let (m, generation) = self.current_generation();
        let candidates: Vec<Candidate> = {
            let mut o = self.open_peers();
            let all = o.verified_generation != generation;
            o.verified_generation = generation;
            o.open
                .values()
                .filter(|c| !c.cut.is_cut() && (all || c.not_after <= now.as_secs()))
                .map(|c| Candidate {
                    direction: c.direction,
                    expected: c.expected.clone(),
                    peer: c.peer,
                    identity: c.identity.clone(),
                    chain: c.chain.clone(),
                    cut: c.cut.clone(),
                })
                .collect()
        };
        let mut refused = Vec::new();
        for Candidate {
            direction,
            expected,
            peer,
            identity,
            chain,
            cut,
        } in candidates
        {
            let Err(e) = self.verify_open(&m, direction, &expected, &chain, now) else {
                continue;
            };
            cut.cut();
            let reason = rustls_reason(&e);
            self.refused_open(peer, &identity, reason, &e);
            refused.push(OpenRefusal {
                identity,
                peer,
                reason,
            });
        }
        refused
    }

    /// Verifies an open connection's peer as its handshake would now.
    fn verify_open(
        &self,
        m: &Material,
        direction: Direction,
        expected: &Expected,
        chain: &[CertificateDer<'static>],
        now: UnixTime,
    ) -> Result<(), rustls::Error> {
        let Some((end_entity, intermediates)) = chain.split_first() else {
            return Err(rustls::Error::NoCertificatesPresented);
        };
        match direction {
            Direction::Accepted => {
                self.verify_client_with(m, end_entity, intermediates, now, expected)
            }
            Direction::Dialled => {
                self.verify_server_with(m, end_entity, intermediates, now, expected)
            }
        }
    }

    /// Counts and logs a peer refused on an open connection.
    fn refused_open(
        &self,
        peer: Option<SocketAddr>,
        identity: &str,
        reason: &str,
        error: &dyn fmt::Display,
    ) {
        self.metrics
            .refusals
            .with_label_values(&[self.side.as_str(), reason])
            .inc();
        tracing::warn!(side = self.side.as_str(), peer = ?peer, peer_id = identity, reason,
            error = %error, connection = "open", "cluster peer refused; its open connection is closed");
    }
}

/// Takes a connection out of its source's table when it ends.
struct OpenGuard {
    src: Weak<TlsSource>,
    id: u64,
}

impl Drop for OpenGuard {
    fn drop(&mut self) {
        if let Some(src) = self.src.upgrade() {
            src.open_peers().open.remove(&self.id);
        }
    }
}

/// A verified connection that fails its reads and writes once its peer is refused.
pub struct Revocable<S> {
    io: S,
    cut: Arc<Cut>,
    _open: OpenGuard,
}

impl<S> Revocable<S> {
    /// Whether its peer was refused (the connection fails from then on).
    pub fn is_cut(&self) -> bool {
        self.cut.is_cut()
    }
}

fn refused_io() -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::ConnectionAborted,
        "the peer's certificate is no longer accepted (revoked, expired or no longer trusted)",
    )
}

impl<S: AsyncRead + Unpin> AsyncRead for Revocable<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        if self.cut.poll(&self.cut.read, cx) {
            return Poll::Ready(Err(refused_io()));
        }
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Revocable<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        if self.cut.poll(&self.cut.write, cx) {
            return Poll::Ready(Err(refused_io()));
        }
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        if self.cut.poll(&self.cut.write, cx) {
            return Poll::Ready(Err(refused_io()));
        }
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        if self.cut.poll(&self.cut.write, cx) {
            return Poll::Ready(Err(refused_io()));
        }
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}
