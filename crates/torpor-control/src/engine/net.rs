//! The engine's side of sandbox networking: policies in the store, the worker's network made
//! ready before each restore, live policy changes, and the target of proxied requests.
//!
//! A sandbox is *networked* when it was created with a policy other than `none`: it then runs
//! with runsc's own network stack on its worker's namespaces (torpor_runtime::net) on every
//! wake, and its policy (`none`, `full` or an allowlist) can change at any time. A sandbox
//! created without a network never gets one (its checkpoints have no interface).

use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};

use torpor_core::{NetworkPolicy, SandboxId, TenantId};
use torpor_runtime::Resident;

use prometheus::{Encoder, IntCounterVec, IntGaugeVec, Opts, Registry, TextEncoder};

use super::{Engine, InUse, Slot};
use crate::error::{ControlError, Result};
use crate::store::{SandboxRecord, TemplateRecord};

/// A running sandbox borrowed for one proxied request, and where to connect. While this lives
/// the sandbox cannot be checkpointed: the sleep ladder waits for proxied requests to finish.
pub struct ProxyTarget {
    pub in_use: InUse,
    pub port: u16,
    /// What the sandbox's server is told it is called (`Host`) when the client names nothing.
    pub host: String,
    /// Whether this request woke the sandbox (it was not running).
    pub woke: bool,
}

impl ProxyTarget {
    /// A new connection to the port (from this machine's router namespace, or through the
    /// worker that runs the sandbox).
    pub async fn connect(&self) -> std::result::Result<torpor_runtime::node::PortStream, String> {
        tokio::time::timeout(
            std::time::Duration::from_secs(10),
            self.in_use.resident().connect_port(self.port),
        )
        .await
        .map_err(|_| "connect timed out".to_string())?
        .map_err(|e| e.to_string())
    }
}

/// Proxied requests by outcome: `served` (the sandbox was running), `woke` (it slept and this
/// request woke it), `rejected` (no worker, lot full, not found, no network...),
/// `upstream_error` (nothing answered on the port).
fn proxy_counter() -> &'static (Registry, IntCounterVec) {
    static C: OnceLock<(Registry, IntCounterVec)> = OnceLock::new();
    C.get_or_init(|| {
        let registry = Registry::new();
        let c = IntCounterVec::new(
            Opts::new(
                "torpor_proxy_requests_total",
                "Requests proxied to sandbox ports, by outcome.",
            ),
            &["outcome"],
        )
        .expect("valid metric");
        registry
            .register(Box::new(c.clone()))
            .expect("registers once");
        (registry, c)
    })
}

/// Counts one proxied request.
pub fn count_proxied(outcome: &str) {
    proxy_counter().1.with_label_values(&[outcome]).inc();
}

/// An HTTP/1 connection to a sandbox port made for one request (see [`sandbox_http`]).
pub type SandboxConn<B> = (
    hyper::client::conn::http1::SendRequest<B>,
    hyper::client::conn::http1::Connection<
        hyper_util::rt::TokioIo<torpor_runtime::node::PortStream>,
        B,
    >,
);

/// Does the HTTP/1 handshake on a connection to a sandbox port ([`ProxyTarget::connect`]: a
/// stream that answers the sandbox's close with a RST, torpor_runtime::relay, made from inside
/// the worker's router namespace, torpor_runtime::net::connect_ingress): nothing on the host
/// side reaches a sandbox's ports but this path, behind the proxy's checks.
pub async fn sandbox_handshake<B>(
    io: torpor_runtime::node::PortStream,
) -> std::result::Result<SandboxConn<B>, String>
where
    B: hyper::body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let io = hyper_util::rt::TokioIo::new(io);
    hyper::client::conn::http1::handshake(io)
        .await
        .map_err(|e| e.to_string())
}

/// Sends one request to a sandbox port over its own connection and returns the answer, whose
/// body streams from the sandbox. `hold` (the sandbox's borrow) lives until the connection is
/// closed, so no checkpoint runs while the answer is read. Whoever closes, the sandbox's
/// stack keeps no endpoint that would block its checkpoint: a server that said it closes
/// (HTTP/1.0, `Connection: close`) is waited for and answered with a RST; otherwise torpor
/// closes first and waits (up to 1 s) for the server's close.
pub async fn sandbox_http<B>(
    io: torpor_runtime::node::PortStream,
    req: hyper::Request<B>,
    hold: impl Send + 'static,
) -> std::result::Result<hyper::Response<hyper::body::Incoming>, String>
where
    B: hyper::body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let (mut sender, conn) = sandbox_handshake::<B>(io).await?;
    let (closes_tx, closes_rx) = tokio::sync::oneshot::channel::<bool>();
    tokio::spawn(async move {
        let _hold = hold;
        if let Ok(parts) = conn.without_shutdown().await {
            let server_closes = closes_rx.await.unwrap_or(false);
            close_connection(parts.io.into_inner(), server_closes).await;
        }
    });
    let resp = sender.send_request(req).await;
    drop(sender);
    let resp = resp.map_err(|e| e.to_string())?;
    let closes = resp.version() < hyper::Version::HTTP_11
        || resp
            .headers()
            .get(hyper::header::CONNECTION)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.to_ascii_lowercase().contains("close"));
    let _ = closes_tx.send(closes);
    Ok(resp)
}

async fn close_connection(mut s: torpor_runtime::node::PortStream, server_closes: bool) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buf = [0u8; 1024];
    let mut drain = async |s: &mut torpor_runtime::node::PortStream| {
        let _ = tokio::time::timeout(std::time::Duration::from_secs(1), async {
            while matches!(s.read(&mut buf).await, Ok(n) if n > 0) {}
        })
        .await;
    };
    if server_closes || s.peer_closed_first() {
        drain(&mut s).await;
        s.reset_on_drop();
        return;
    }
    let _ = s.shutdown().await;
    drain(&mut s).await;
}

/// Refuses a policy wider than `tpl`'s (the operator's ceiling; a template without a network
/// allows ingress only): 400 `invalid_request` naming the template.
fn check_ceiling(policy: &NetworkPolicy, tpl: &TemplateRecord) -> Result<()> {
    let ceiling = tpl.spec.network.clone().unwrap_or_default();
    if torpor_core::network::narrows(policy, &ceiling) {
        return Ok(());
    }
    let shown = if ceiling.is_none() {
        "none: ingress only, no egress".to_string()
    } else {
        serde_json::to_string(&ceiling).unwrap_or_default()
    };
    Err(ControlError::Invalid(format!(
        "network: the policy is wider than template {:?} allows (its network policy is {shown}); \
         a sandbox's policy may only narrow its template's",
        tpl.name.to_string()
    )))
}

/// The policy a new sandbox of `tpl` gets: the requested one (validated, and no wider than the
/// template's), else the template's; `None` when it gets no network.
pub(super) fn check_policy(
    requested: Option<&NetworkPolicy>,
    tpl: &TemplateRecord,
) -> Result<Option<NetworkPolicy>> {
    let Some(p) = requested.or(tpl.spec.network.as_ref()) else {
        return Ok(None);
    };
    p.validate()
        .map_err(|e| ControlError::Invalid(e.to_string()))?;
    if requested.is_some() {
        check_ceiling(p, tpl)?;
    }
    if p.is_none() {
        return Ok(None);
    }
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    if !*AVAILABLE.get_or_init(torpor_runtime::net::available) {
        return Err(ControlError::Unsupported(
            "sandbox networking needs `ip` and `nft` on the host (scripts/deps.sh installs them)"
                .into(),
        ));
    }
    Ok(Some(p.clone()))
}

/// Points the sandbox's resolver at its gateway (torpor's DNS responder, through the router).
/// Written once, at create: the address is the same on every worker.
pub(super) async fn write_resolv_conf(c: &dyn Resident) -> Result<()> {
    c.call(
        &torpor_runtime::proto::Request::WriteFile {
            path: "/etc/resolv.conf".into(),
            mode: Some(0o644),
        },
        format!(
            "# written by torpor: names on the sandbox's allowlist resolve here\nnameserver {}\n",
            torpor_runtime::net::GATEWAY_ADDR
        )
        .as_bytes(),
    )
    .await?;
    Ok(())
}

impl Engine {
    /// The sandbox's network policy (`none` for a sandbox without network).
    pub fn network_policy(&self, tenant: &TenantId, id: &SandboxId) -> Result<NetworkPolicy> {
        self.sandbox(tenant, id)?;
        Ok(self.store.network(id)?.unwrap_or_else(NetworkPolicy::none))
    }

    /// The worker a sandbox is resident on, and in cluster mode the worker process (node)
    /// holding it, if it is resident. Waits a moment for a short hold of the sandbox (the
    /// bookkeeping of an upload, a policy write); not for a wake or checkpoint (`None`).
    pub async fn resident_worker(&self, id: &SandboxId) -> Option<(String, Option<String>)> {
        const WAIT: std::time::Duration = std::time::Duration::from_millis(250);
        let slot = self.slot(id);
        let guard = tokio::time::timeout(WAIT, slot.state.read()).await.ok()?;
        guard.live.as_ref().map(|l| {
            (
                l.resident.worker().to_string(),
                l.resident.node().map(str::to_string),
            )
        })
    }

    /// The address the proxy connects to for a resident networked sandbox (its worker's
    /// router); `None` while it sleeps or when it has no network.
    pub fn ingress_address(
        &self,
        tenant: &TenantId,
        id: &SandboxId,
    ) -> Result<Option<std::net::Ipv4Addr>> {
        self.sandbox(tenant, id)?;
        let slot = self.slot(id);
        let addr = slot
            .state
            .try_read()
            .ok()
            .and_then(|g| g.live.as_ref().and_then(|l| l.resident.ingress_addr()));
        Ok(addr)
    }

    /// Changes a networked sandbox's egress policy; a running sandbox gets it at once (new
    /// connections follow it; established ones stay), a sleeping one on its next wake.
    pub async fn set_network(
        &self,
        tenant: &TenantId,
        id: &SandboxId,
        policy: NetworkPolicy,
    ) -> Result<SandboxRecord> {
        let rec = self.sandbox(tenant, id)?;
        policy
            .validate()
            .map_err(|e| ControlError::Invalid(e.to_string()))?;
        // The template's policy bounds every change. A template is not removed while it has
        // sandboxes; should its record be gone, nothing but ingress is allowed.
        match self.store.template_for(&rec.tenant, &rec.template)? {
            Some(tpl) => check_ceiling(&policy, &tpl)?,
            None if !torpor_core::network::narrows(&policy, &NetworkPolicy::none()) => {
                return Err(ControlError::Invalid(format!(
                    "network: template {:?} is gone; only a policy without egress can be set",
                    rec.template.to_string()
                )));
            }
            None => {}
        }
        if self.store.network(id)?.is_none() {
            if policy.is_none() {
                return Ok(rec);
            }
            return Err(ControlError::Invalid(format!(
                "network: sandbox {id} was created without a network; create it with a `network` policy"
            )));
        }
        let slot = self.slot(id);
        // The read lock: a wake or checkpoint (write lock) does not run meanwhile, so the
        // stored policy and the live rules agree.
        let guard = slot.state.clone().read_owned().await;
        self.store.set_network(id, &policy)?;
        if let Some(live) = guard.live.as_ref() {
            live.resident.apply_policy(&policy).await?;
        }
        Ok(rec)
    }

    /// Network metrics in Prometheus text: proxied requests by outcome, and for every resident
    /// networked sandbox its bytes and connections by direction and its denied egress attempts
    /// by destination (read from its worker's nftables counters when scraped).
    pub fn network_metrics(&self) -> String {
        let registry = Registry::new();
        let gauge = |name: &str, help: &str, labels: &[&str]| {
            let g = IntGaugeVec::new(Opts::new(name, help), labels).expect("valid metric");
            registry.register(Box::new(g.clone())).expect("unique");
            g
        };
        let bytes = gauge(
            "torpor_sandbox_network_bytes",
            "Bytes through a resident sandbox's interface since its wake (tx: sent by it).",
            &["sandbox", "direction"],
        );
        let conns = gauge(
            "torpor_sandbox_network_connections",
            "Connections (flows) since its wake: egress (opened by it) and ingress (proxied).",
            &["sandbox", "direction"],
        );
        let limited = gauge(
            "torpor_sandbox_egress_limited_packets",
            "Packets a resident sandbox sent above its egress rate limits since its wake (dropped).",
            &["sandbox"],
        );
        let denied = gauge(
            "torpor_sandbox_egress_denied_packets",
            "Packets the egress policy dropped since its wake, by destination (addr:port).",
            &["sandbox", "destination"],
        );
        let slots: Vec<(SandboxId, Arc<Slot>)> = {
            let slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
            slots.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
        };
        for (id, slot) in slots {
            let Ok(guard) = slot.state.try_read() else {
                continue;
            };
            let Some(st) = guard.live.as_ref().and_then(|l| l.resident.net_stats()) else {
                continue;
            };
            let id = id.as_str();
            bytes.with_label_values(&[id, "tx"]).set(st.tx_bytes as i64);
            bytes.with_label_values(&[id, "rx"]).set(st.rx_bytes as i64);
            conns
                .with_label_values(&[id, "egress"])
                .set(st.egress_connections as i64);
            conns
                .with_label_values(&[id, "ingress"])
                .set(st.ingress_connections as i64);
            limited
                .with_label_values(&[id])
                .set(st.limited_packets as i64);
            for (dest, n) in denied_series(&st.denied_by_destination, st.denied_packets) {
                denied.with_label_values(&[id, &dest]).set(n as i64);
            }
        }
        let mut families = proxy_counter().0.gather();
        families.extend(registry.gather());
        let mut buf = Vec::new();
        TextEncoder::new()
            .encode(&families, &mut buf)
            .expect("text encoding cannot fail");
        String::from_utf8(buf).expect("prometheus text is UTF-8")
    }

    /// Borrows the sandbox for one proxied request to `port`, waking it (parked when no worker
    /// is free) if it sleeps.
    pub async fn proxy_target(
        &self,
        tenant: &TenantId,
        id: &SandboxId,
        port: u16,
    ) -> Result<ProxyTarget> {
        let result = self.proxy_target_inner(tenant, id, port).await;
        if result.is_err() {
            count_proxied("rejected");
        }
        result
    }

    async fn proxy_target_inner(
        &self,
        tenant: &TenantId,
        id: &SandboxId,
        port: u16,
    ) -> Result<ProxyTarget> {
        self.sandbox(tenant, id)?;
        if self.store.network(id)?.is_none() {
            return Err(ControlError::Invalid(format!(
                "sandbox {id} has no network; create it with a `network` policy to reach its ports"
            )));
        }
        let running = self
            .slot(id)
            .state
            .try_read()
            .is_ok_and(|g| g.live.as_ref().is_some_and(|l| !l.frozen));
        let in_use = self.use_sandbox(tenant, id).await?;
        let host = match in_use.ingress_addr() {
            Some(addr) => SocketAddr::from((addr, port)).to_string(),
            // On a worker of the cluster: reached through it.
            None => format!("localhost:{port}"),
        };
        Ok(ProxyTarget {
            in_use,
            port,
            host,
            woke: !running,
        })
    }
}

/// Destinations a sandbox's denied-egress metric names one by one; the rest are summed into
/// `other`, so one sandbox adds at most this many plus one series however many addresses it
/// tries (the nftables set holds up to 4096).
const DENIED_SERIES: usize = 16;

/// The denied-egress series of one sandbox: the [`DENIED_SERIES`] destinations with the most
/// packets (ties by name), then `other` with every packet not listed (unlisted destinations and
/// drops the set did not record).
fn denied_series(by_destination: &[(String, u64)], total: u64) -> Vec<(String, u64)> {
    let mut top: Vec<(String, u64)> = by_destination.to_vec();
    top.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    top.truncate(DENIED_SERIES);
    let listed: u64 = top.iter().map(|(_, n)| n).sum();
    if total > listed {
        top.push(("other".into(), total - listed));
    }
    top
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn denied_egress_names_the_top_destinations_and_sums_the_rest() {
        let many: Vec<(String, u64)> = (0..100u64)
            .map(|i| (format!("10.0.0.{i}:80"), i + 1))
            .collect();
        let total: u64 = many.iter().map(|(_, n)| n).sum::<u64>() + 7;
        let series = denied_series(&many, total);
        assert_eq!(series.len(), DENIED_SERIES + 1);
        assert_eq!(series[0], ("10.0.0.99:80".to_string(), 100));
        assert_eq!(series.last().unwrap().0, "other");
        assert_eq!(series.iter().map(|(_, n)| n).sum::<u64>(), total);
        // Few destinations, all recorded: no `other`.
        let few = vec![("1.1.1.1:53".to_string(), 3)];
        assert_eq!(denied_series(&few, 3), few);
    }
}
