//! Dispatch mode's lanes: one task per active agent with its own broker consumer. It takes one
//! message, hands it to the agent (`dispatch.command` with the message on stdin, or a POST to
//! `dispatch.http` through the ingress path), and acknowledges it only after success
//! (retries, then the dead-letter destination). A draining lane finishes its message first.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::Notify;
use torpor_core::{PoolName, SandboxId, TenantId};
use torpor_runtime::proto::ExecRequest;
use torpor_triggers::consume::Consumer;
use torpor_triggers::TriggerSpec;

use super::registry::Counters;
use super::spec::{DispatchSpec, HttpDispatch};
use crate::engine::Engine;

/// How long a lane waits on the broker before it looks at its drain flag again.
const LANE_WAIT: Duration = Duration::from_millis(500);

/// How long an HTTP dispatch keeps retrying a refused connection: an agent just started or
/// woken (or restored from a golden snapshot taken before its server listened) may not listen
/// yet, and a message must not fail an attempt, or go to the dead letter, for that.
const LISTEN_WAIT: Duration = Duration::from_secs(10);

/// A connection to the agent's port, retrying while nothing listens there yet (within
/// [`LISTEN_WAIT`]; the attempt's `timeout_s` bounds it too).
async fn connect_listening(
    target: &crate::engine::ProxyTarget,
) -> std::result::Result<torpor_runtime::node::PortStream, String> {
    let started = Instant::now();
    let mut pause = Duration::from_millis(20);
    loop {
        match target.connect().await {
            Err(e) if e.contains("refused") && started.elapsed() + pause < LISTEN_WAIT => {
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_millis(250));
            }
            r => return r,
        }
    }
}

pub(super) struct LaneWorker {
    pub(super) engine: Arc<Engine>,
    pub(super) tenant: TenantId,
    pub(super) sandbox: SandboxId,
    pub(super) trigger: TriggerSpec,
    pub(super) dispatch: DispatchSpec,
    pub(super) dead_letter: String,
    pub(super) consumer_name: String,
    pub(super) pool_name: PoolName,
    pub(super) drain: Arc<AtomicBool>,
    pub(super) busy: Arc<AtomicBool>,
    pub(super) counters: Arc<Counters>,
    pub(super) poke: Arc<Notify>,
}

impl LaneWorker {
    pub(super) async fn run(self) {
        let mut consumer: Option<Consumer> = None;
        while !self.drain.load(Ordering::Relaxed) {
            let c = match &mut consumer {
                Some(c) => c,
                None => {
                    match Consumer::connect(&self.trigger, &self.consumer_name, &self.dead_letter)
                        .await
                    {
                        Ok(c) => consumer.insert(c),
                        Err(e) => {
                            tracing::warn!(sandbox = %self.sandbox, code = e.code(), error = %e, "lane cannot reach the broker");
                            tokio::time::sleep(Duration::from_secs(1)).await;
                            continue;
                        }
                    }
                }
            };
            match c.next(LANE_WAIT).await {
                Ok(None) => {}
                Ok(Some(msg)) => {
                    self.busy.store(true, Ordering::Relaxed);
                    self.counters.in_flight.fetch_add(1, Ordering::Relaxed);
                    self.process(c, msg).await;
                    self.counters.in_flight.fetch_sub(1, Ordering::Relaxed);
                    self.busy.store(false, Ordering::Relaxed);
                    self.poke.notify_one();
                }
                Err(e) => {
                    tracing::warn!(sandbox = %self.sandbox, code = e.code(), error = %e, "lane lost the broker; reconnecting");
                    if let Some(c) = consumer.take() {
                        c.close().await;
                    }
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
            }
        }
        if let Some(c) = consumer.take() {
            c.close().await;
        }
    }

    /// Runs `dispatch.command` with the message on stdin; exit 0 is success.
    async fn run_command(&self, cmd: &[String], body: &[u8]) -> std::result::Result<(), String> {
        let d = &self.dispatch;
        let req = ExecRequest {
            cmd: cmd.to_vec(),
            env: d.env.clone(),
            cwd: None,
            timeout_ms: Some(d.timeout_s * 1000),
            detach: false,
            stream: false,
        };
        match self
            .engine
            .exec(&self.tenant, &self.sandbox, req, body.to_vec())
            .await
        {
            Ok(r) if r.exit_code == Some(0) => Ok(()),
            Ok(r) => Err(format!(
                "exit {:?} signal {:?}: {}",
                r.exit_code,
                r.signal,
                r.stderr.chars().take(500).collect::<String>()
            )),
            Err(e) => Err(e.to_string()),
        }
    }

    /// POSTs the message to `dispatch.http` in the agent through the same path as the ingress
    /// proxy (the agent is woken if it sleeps and stays borrowed, so not checkpointed, until
    /// the answer has been read); a 2xx answer is success.
    async fn post(
        &self,
        h: &HttpDispatch,
        body: &[u8],
        attempt: u32,
    ) -> std::result::Result<(), String> {
        let target = self
            .engine
            .proxy_target(&self.tenant, &self.sandbox, h.port)
            .await
            .map_err(|e| e.to_string())?;
        let mut req = hyper::Request::post(h.path.as_str())
            .header(hyper::header::HOST, target.host.clone())
            .header("x-torpor-pool", self.pool_name.as_str())
            .header("x-torpor-attempt", attempt.to_string());
        if !h
            .headers
            .keys()
            .any(|k| k.eq_ignore_ascii_case("content-type"))
        {
            req = req.header("content-type", "application/octet-stream");
        }
        for (k, v) in &h.headers {
            req = req.header(k.as_str(), v.as_str());
        }
        let req = req
            .body(http_body_util::Full::new(bytes::Bytes::copy_from_slice(
                body,
            )))
            .map_err(|e| format!("POST port {} {}: {e}", h.port, h.path))?;
        let woke = target.woke;
        let exchange = async {
            let io = connect_listening(&target).await.map_err(|e| {
                crate::engine::count_proxied("upstream_error");
                format!("POST port {} {}: {e}", h.port, h.path)
            })?;
            // The borrow lives until the connection is closed: the whole answer is read
            // before the agent can be checkpointed.
            let resp = crate::engine::sandbox_http(io, req, target.in_use)
                .await
                .map_err(|e| {
                    crate::engine::count_proxied("upstream_error");
                    format!("POST port {} {}: {e}", h.port, h.path)
                })?;
            crate::engine::count_proxied(if woke { "woke" } else { "served" });
            let status = resp.status();
            let text = http_body_util::BodyExt::collect(resp.into_body())
                .await
                .map(|b| b.to_bytes())
                .unwrap_or_default();
            Ok::<_, String>((status, text))
        };
        let (status, text) =
            tokio::time::timeout(Duration::from_secs(self.dispatch.timeout_s), exchange)
                .await
                .map_err(|_| {
                    format!(
                        "POST port {} {}: no answer within {} s",
                        h.port, h.path, self.dispatch.timeout_s
                    )
                })??;
        if status.is_success() {
            Ok(())
        } else {
            Err(format!(
                "HTTP {status}: {}",
                String::from_utf8_lossy(&text[..text.len().min(500)])
            ))
        }
    }

    async fn process(&self, c: &mut Consumer, msg: torpor_triggers::Message) {
        let d = &self.dispatch;
        let started = Instant::now();
        for attempt in 1..=d.max_attempts {
            let failure = match (&d.command, &d.http) {
                (_, Some(h)) => self.post(h, &msg.body, attempt).await.err(),
                (Some(cmd), None) => self.run_command(cmd, &msg.body).await.err(),
                (None, None) => Some("no dispatch target".to_string()),
            };
            match failure {
                None => {
                    if let Err(e) = c.ack(msg).await {
                        // Not acknowledged: the broker hands it out again (at least once).
                        tracing::warn!(sandbox = %self.sandbox, error = %e, "ack failed; the message will be redelivered");
                    }
                    self.counters.processed.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(sandbox = %self.sandbox, ms = started.elapsed().as_millis() as u64, attempt, "message processed");
                    return;
                }
                Some(why) => {
                    self.counters
                        .failed_attempts
                        .fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(sandbox = %self.sandbox, attempt, error = %why, "dispatch attempt failed");
                    if attempt < d.max_attempts {
                        tokio::time::sleep(Duration::from_millis(d.retry_backoff_ms)).await;
                    }
                }
            }
        }
        match c.dead_letter(msg).await {
            Ok(()) => {
                self.counters.dead_lettered.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => {
                tracing::warn!(sandbox = %self.sandbox, error = %e, "dead-lettering failed; the message will be redelivered")
            }
        }
    }
}
