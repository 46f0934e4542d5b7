//! Controller to controller: the peer listener and the clients that reach it.
//!
//! A call that reaches controller B for a sandbox controller A holds is forwarded to A whole
//! (torpor_api's `forward` layer). It carries the caller's bearer token, so it travels over
//! HTTP/2 on mutual TLS, with the cluster's certificates:
//!
//! - **A's peer listener** (`torpor controller --peer-listen`) accepts only clients presenting
//!   a controller certificate of the trust domain ([`PeerAcceptor`]). Workers, tenants and
//!   anything without a certificate are refused at the handshake, logged and counted in
//!   `torpor_cluster_tls_refusals_total{side="controller"}`. Each accepted connection is watched
//!   like the cluster's others: a controller revoked or expired while connected is cut.
//! - **B's client** ([`PeerClients`]) checks that the server presents exactly
//!   `spiffe://<domain>/controller/<A>`, the holder the sandbox's row names: a call goes to
//!   that controller or nowhere, whoever answers at the address A advertised (a pod IP reused
//!   after A died, a spoofed route). One client per holder keeps its connections (one HTTP/2
//!   connection carries concurrent calls); it is replaced when the TLS material changes (a new
//!   CRL or CA, a renewed certificate) and at least every [`CLIENT_LIFETIME`], so connections
//!   are verified again against what is current.
//!
//! Host names play no part (as for workers): the identity is the name.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rustls::pki_types::CertificateDer;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_rustls::server::TlsStream;

use crate::ca::{Identity, Role};
use crate::tls::{refusal_reason, Direction, Expected, Revocable, TlsError, TlsSource};

/// The longest a client (and so a connection it pools) to one controller is reused.
pub const CLIENT_LIFETIME: Duration = Duration::from_secs(60);
/// How long a forwarded call may wait for the other controller's TCP and TLS handshake.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Idle pooled connections are closed after this long, below the peer listener's idle close
/// (its header-read timeout, 10 s by default) so a call never lands on a closing connection.
const POOL_IDLE: Duration = Duration::from_secs(4);

struct Cached {
    client: reqwest::Client,
    generation: u64,
    built: Instant,
}

/// HTTPS clients to the other controllers' peer listeners, one per controller name.
pub struct PeerClients {
    tls: Arc<TlsSource>,
    clients: Mutex<HashMap<String, Cached>>,
}

impl PeerClients {
    /// Clients presenting `tls`'s controller certificate.
    pub fn new(tls: Arc<TlsSource>) -> PeerClients {
        PeerClients {
            tls,
            clients: Mutex::default(),
        }
    }

    /// A client that reaches the controller `name` and no other (its certificate is checked
    /// for that identity at every handshake). Use `https://{its peer address}/…` with it.
    pub fn client_for(&self, name: &str) -> Result<reqwest::Client, TlsError> {
        let generation = self.tls.generation();
        let mut clients = self.clients.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = clients.get(name) {
            if c.generation == generation && c.built.elapsed() < CLIENT_LIFETIME {
                return Ok(c.client.clone());
            }
        }
        let client = reqwest::Client::builder()
            .use_preconfigured_tls(self.tls.peer_client_config(name)?)
            .redirect(reqwest::redirect::Policy::none())
            .connect_timeout(CONNECT_TIMEOUT)
            .pool_idle_timeout(POOL_IDLE)
            .http2_keep_alive_interval(Duration::from_secs(10))
            .http2_keep_alive_timeout(Duration::from_secs(20))
            .build()
            .map_err(|e| TlsError::Material {
                path: "peer client".into(),
                reason: e.to_string(),
            })?;
        clients.insert(
            name.to_string(),
            Cached {
                client: client.clone(),
                generation,
                built: Instant::now(),
            },
        );
        Ok(client)
    }
}

/// The peer listener's handshake: controllers of the trust domain only.
#[derive(Clone)]
pub struct PeerAcceptor {
    tls: Arc<TlsSource>,
    acceptor: tokio_rustls::TlsAcceptor,
}

impl PeerAcceptor {
    pub fn new(tls: Arc<TlsSource>) -> Result<PeerAcceptor, TlsError> {
        let acceptor = tokio_rustls::TlsAcceptor::from(tls.peer_server_config()?);
        Ok(PeerAcceptor { tls, acceptor })
    }

    /// Runs the handshake on `io` from `remote`. A verified controller's connection comes
    /// back watched (cut if the controller is revoked or expires while it is open) with its
    /// identity; a refused peer is logged and counted, and `None` comes back.
    pub async fn accept<S>(
        &self,
        io: S,
        remote: SocketAddr,
    ) -> Option<(Revocable<TlsStream<S>>, Identity)>
    where
        S: AsyncRead + AsyncWrite + Unpin,
    {
        let stream = match self.acceptor.accept(io).await {
            Ok(s) => s,
            Err(e) => {
                self.tls.refused(Some(remote), refusal_reason(&e), &e);
                return None;
            }
        };
        let chain: Vec<CertificateDer<'static>> = stream
            .get_ref()
            .1
            .peer_certificates()
            .map(|c| c.iter().map(|c| c.clone().into_owned()).collect())
            .unwrap_or_default();
        let Some(identity) = crate::tls::peer_identity(Some(chain.as_slice())) else {
            self.tls.refused(
                Some(remote),
                "wrong_identity",
                &"no identity after the handshake",
            );
            return None;
        };
        let stream = self.tls.watch_expecting(
            stream,
            Direction::Accepted,
            Some(remote),
            chain,
            Expected::any(Role::Controller),
        );
        Some((stream, identity))
    }

    /// Counts and logs a peer whose handshake did not finish in time.
    pub fn timed_out(&self, remote: SocketAddr) {
        self.tls
            .refused(Some(remote), "timeout", &"no TLS handshake in time");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tls::tests::Pki;
    use crate::tls::Side;
    use std::convert::Infallible;

    /// Serves every connection `acceptor` lets through with `200 {name}` (HTTP/2); tells
    /// `accepted` whether each handshake passed.
    async fn listener(
        acceptor: PeerAcceptor,
        name: &'static str,
    ) -> (SocketAddr, tokio::sync::mpsc::UnboundedReceiver<bool>) {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(async move {
            loop {
                let (tcp, remote) = l.accept().await.unwrap();
                let (acceptor, tx) = (acceptor.clone(), tx.clone());
                tokio::spawn(async move {
                    let Some((io, _who)) = acceptor.accept(tcp, remote).await else {
                        let _ = tx.send(false);
                        return;
                    };
                    let _ = tx.send(true);
                    // Answers its name and the Host the caller sent (host-based routing to
                    // sandbox ports must survive the hop).
                    let svc =
                        hyper::service::service_fn(move |req: hyper::Request<_>| async move {
                            let host = req
                                .headers()
                                .get("host")
                                .and_then(|h| h.to_str().ok())
                                .unwrap_or("-")
                                .to_string();
                            Ok::<_, Infallible>(hyper::Response::new(format!("{name} {host}")))
                        });
                    let _ = hyper::server::conn::http2::Builder::new(
                        hyper_util::rt::TokioExecutor::new(),
                    )
                    .serve_connection(hyper_util::rt::TokioIo::new(io), svc)
                    .await;
                });
            }
        });
        (addr, rx)
    }

    #[tokio::test]
    async fn a_forwarded_call_reaches_the_named_controller_over_http2_and_never_an_impostor() {
        let pki = Pki::new();
        pki.issue(Role::Controller, "c2");
        pki.issue(Role::Controller, "c3");
        let c2 = PeerClients::new(pki.source("c2", Side::Controller));
        let (c1_addr, mut c1_seen) = listener(
            PeerAcceptor::new(pki.source("c1", Side::Controller)).unwrap(),
            "c1",
        )
        .await;
        let (c3_addr, mut c3_seen) = listener(
            PeerAcceptor::new(pki.source("c3", Side::Controller)).unwrap(),
            "c3",
        )
        .await;

        let to_c1 = c2.client_for("c1").unwrap();
        let resp = to_c1
            .get(format!("https://{c1_addr}/v1/sandboxes/x"))
            .header("host", "8080-sb-x.sandbox.example")
            .send()
            .await
            .unwrap();
        assert_eq!(resp.version(), reqwest::Version::HTTP_2);
        assert_eq!(resp.text().await.unwrap(), "c1 8080-sb-x.sandbox.example");
        assert_eq!(c1_seen.recv().await, Some(true));

        // c3 answers at the address c2 believes is c1's: no request leaves c2.
        let err = to_c1
            .get(format!("https://{c3_addr}/v1/sandboxes/x"))
            .bearer_auth("a-tenant-token")
            .send()
            .await
            .unwrap_err();
        assert!(err.is_connect(), "{err:?}");
        assert_eq!(
            c3_seen.recv().await,
            Some(false),
            "c3 finished no handshake"
        );

        // A worker's certificate is refused by the peer listener.
        let worker = pki.source("w1", Side::Worker);
        let cfg = worker.client_config().unwrap();
        let tcp = tokio::net::TcpStream::connect(c1_addr).await.unwrap();
        let name = rustls::pki_types::ServerName::try_from("torpor-peer").unwrap();
        let _ = tokio_rustls::TlsConnector::from(cfg)
            .connect(name, tcp)
            .await;
        assert_eq!(c1_seen.recv().await, Some(false), "a worker was served");

        // Asked again (cached while the TLS material stands), the client still reaches c1.
        let again = c2.client_for("c1").unwrap();
        let text = again
            .get(format!("https://{c1_addr}/"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        assert!(text.starts_with("c1 "), "{text}");
    }
}
