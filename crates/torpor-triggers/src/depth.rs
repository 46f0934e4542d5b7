//! Queue-depth readers, one per broker, reading what KEDA's scalers read:
//!
//! | trigger | depth |
//! |---|---|
//! | redis-list | `LLEN key` |
//! | redis-stream | `XINFO GROUPS stream`: the group's `lag` + `pending` (`XPENDING` count when `lag` is unknown) |
//! | nats-jetstream | consumer info `num_pending + num_ack_pending` |
//! | rabbitmq | management API `messages` (ready + unacknowledged); AMQP passive declare (ready) as fallback |
//!
//! A reader keeps its connection and drops it on any error, so the next reading reconnects
//! (a broker restart costs one failed reading). Every reading is bounded by a timeout.

use std::time::Duration;

use crate::spec::{redact, TriggerError, TriggerSpec};

/// How long one reading may take, connection included.
pub const READ_TIMEOUT: Duration = Duration::from_secs(3);

enum Conn {
    None,
    Redis(redis::aio::MultiplexedConnection),
    Nats(async_nats::jetstream::Context),
    Amqp(lapin::Connection),
    #[cfg(feature = "kafka")]
    Kafka(Box<crate::kafka::LagReader>),
}

pub struct DepthReader {
    spec: TriggerSpec,
    conn: Conn,
    http: reqwest::Client,
}

impl DepthReader {
    pub fn new(spec: TriggerSpec) -> Self {
        // No redirects: the management URL was checked against the operator's allow-list,
        // and a redirect would make torpor fetch another address.
        let http = reqwest::Client::builder()
            .timeout(READ_TIMEOUT)
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .unwrap_or_default();
        DepthReader {
            spec,
            conn: Conn::None,
            http,
        }
    }

    pub fn spec(&self) -> &TriggerSpec {
        &self.spec
    }

    /// Reads the depth now.
    pub async fn read(&mut self) -> Result<u64, TriggerError> {
        let broker = self.spec.broker();
        let r = match tokio::time::timeout(READ_TIMEOUT, self.read_inner()).await {
            Ok(r) => r,
            Err(_) => Err(TriggerError::Timeout {
                broker,
                timeout_ms: READ_TIMEOUT.as_millis() as u64,
            }),
        };
        if r.is_err() {
            self.conn = Conn::None;
        }
        r
    }

    async fn read_inner(&mut self) -> Result<u64, TriggerError> {
        match self.spec.clone() {
            TriggerSpec::RedisList { url, key } => {
                let con = self.redis(&url).await?;
                redis::cmd("LLEN")
                    .arg(&key)
                    .query_async::<u64>(con)
                    .await
                    .map_err(|e| redis_err(&url, e))
            }
            TriggerSpec::RedisStream { url, stream, group } => {
                let con = self.redis(&url).await?;
                stream_depth(con, &url, &stream, &group).await
            }
            TriggerSpec::NatsJetstream {
                url,
                stream,
                consumer,
            } => {
                let js = self.nats(&url).await?;
                let mut c: async_nats::jetstream::consumer::Consumer<
                    async_nats::jetstream::consumer::pull::Config,
                > = js
                    .get_consumer_from_stream(&consumer, &stream)
                    .await
                    .map_err(|e| nats_consumer_err(&url, &stream, &consumer, e))?;
                let info = c.info().await.map_err(|e| TriggerError::Broker {
                    broker: "nats",
                    address: redact(&url),
                    reason: e.to_string(),
                })?;
                Ok(info.num_pending + info.num_ack_pending as u64)
            }
            TriggerSpec::Rabbitmq {
                url,
                management_url,
                queue,
            } => {
                let mgmt_err = match &management_url {
                    Some(m) => match self.management_depth(&url, m, &queue).await {
                        Ok(Some(n)) => return Ok(n),
                        Ok(None) => None,
                        Err(e) => Some(e),
                    },
                    None => None,
                };
                match self.passive_declare(&url, &queue).await {
                    Ok(n) => Ok(n),
                    Err(e) => Err(mgmt_err.unwrap_or(e)),
                }
            }
            #[cfg(feature = "kafka")]
            TriggerSpec::Kafka {
                brokers,
                topic,
                group,
                offset_reset,
            } => {
                if !matches!(self.conn, Conn::Kafka(_)) {
                    let reset =
                        crate::kafka::Reset::parse(offset_reset.as_deref()).unwrap_or_default();
                    self.conn = Conn::Kafka(Box::new(crate::kafka::LagReader::new(
                        &brokers, &topic, &group, reset,
                    )));
                }
                let Conn::Kafka(r) = &mut self.conn else {
                    unreachable!("set just above")
                };
                r.lag().await
            }
            #[cfg(not(feature = "kafka"))]
            TriggerSpec::Kafka { .. } => Err(TriggerError::FeatureDisabled {
                field: "triggers".into(),
                what: "the kafka trigger",
                feature: "kafka",
            }),
        }
    }

    async fn redis(
        &mut self,
        url: &str,
    ) -> Result<&mut redis::aio::MultiplexedConnection, TriggerError> {
        if !matches!(self.conn, Conn::Redis(_)) {
            self.conn = Conn::Redis(redis_connect(url).await?);
        }
        match &mut self.conn {
            Conn::Redis(c) => Ok(c),
            _ => unreachable!("set just above"),
        }
    }

    async fn nats(&mut self, url: &str) -> Result<async_nats::jetstream::Context, TriggerError> {
        if let Conn::Nats(js) = &self.conn {
            return Ok(js.clone());
        }
        let js = nats_connect(url).await?;
        self.conn = Conn::Nats(js.clone());
        Ok(js)
    }

    /// `Ok(None)` when the management API has no figure yet (it answers `null` for a while
    /// after a queue is made).
    async fn management_depth(
        &self,
        amqp_url: &str,
        management_url: &str,
        queue: &str,
    ) -> Result<Option<u64>, TriggerError> {
        let m = reqwest::Url::parse(management_url).map_err(|e| TriggerError::Invalid {
            field: "management_url".into(),
            reason: e.to_string(),
        })?;
        let a = reqwest::Url::parse(amqp_url).map_err(|e| TriggerError::Invalid {
            field: "url".into(),
            reason: e.to_string(),
        })?;
        let vhost = amqp_vhost(&a);
        let (user, pass) = if !m.username().is_empty() {
            (
                m.username().to_string(),
                m.password().unwrap_or("").to_string(),
            )
        } else if !a.username().is_empty() {
            (
                a.username().to_string(),
                a.password().unwrap_or("").to_string(),
            )
        } else {
            ("guest".to_string(), "guest".to_string())
        };
        let mut api = m.clone();
        let _ = api.set_username("");
        let _ = api.set_password(None);
        api.path_segments_mut()
            .map_err(|_| TriggerError::Invalid {
                field: "management_url".into(),
                reason: "cannot be a base URL".into(),
            })?
            .pop_if_empty()
            .extend(["api", "queues", &vhost, queue]);
        let broker_err = |reason: String| TriggerError::Broker {
            broker: "rabbitmq",
            address: redact(management_url),
            reason,
        };
        let resp = self
            .http
            .get(api)
            .basic_auth(user, Some(pass))
            .send()
            .await
            .map_err(|e| broker_err(e.to_string()))?;
        match resp.status().as_u16() {
            200 => {}
            404 => {
                return Err(TriggerError::Missing {
                    broker: "rabbitmq",
                    what: format!("queue {queue:?} in vhost {vhost:?}"),
                })
            }
            401 => return Err(broker_err("management API refused the credentials".into())),
            s => return Err(broker_err(format!("management API answered {s}"))),
        }
        let v: serde_json::Value = resp.json().await.map_err(|e| broker_err(e.to_string()))?;
        Ok(v.get("messages").and_then(serde_json::Value::as_u64))
    }

    async fn passive_declare(&mut self, url: &str, queue: &str) -> Result<u64, TriggerError> {
        if !matches!(&self.conn, Conn::Amqp(c) if c.status().connected()) {
            self.conn = Conn::Amqp(amqp_connect(url).await?);
        }
        let Conn::Amqp(conn) = &self.conn else {
            unreachable!("set just above")
        };
        let ch = conn.create_channel().await.map_err(|e| amqp_err(url, e))?;
        let q = ch
            .queue_declare(
                queue,
                lapin::options::QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                lapin::types::FieldTable::default(),
            )
            .await
            .map_err(|e| amqp_queue_err(url, queue, e))?;
        let _ = ch.close(200, "ok").await;
        Ok(u64::from(q.message_count()))
    }
}

/// Push: waits for new work on a broker without taking it.
///
/// | trigger | watch |
/// |---|---|
/// | redis-list | `BLMOVE key key RIGHT RIGHT` (a blocking rotation of one element onto itself: a no-op) |
/// | redis-stream | `XREAD BLOCK … STREAMS stream $` |
/// | nats-jetstream | a core subscription on the stream's subjects |
/// | rabbitmq, kafka | none (`Unsupported`): such pools poll |
pub struct Watcher {
    spec: TriggerSpec,
    redis: Option<redis::aio::MultiplexedConnection>,
    nats: Option<async_nats::Subscriber>,
}

impl Watcher {
    pub fn new(spec: TriggerSpec) -> Self {
        Watcher {
            spec,
            redis: None,
            nats: None,
        }
    }

    /// `Ok(true)` when work arrived (or is there), `Ok(false)` when `wait` passed without any.
    pub async fn wait(&mut self, wait: Duration) -> Result<bool, TriggerError> {
        let bound = wait + READ_TIMEOUT;
        let broker = self.spec.broker();
        let r = match tokio::time::timeout(bound, self.wait_inner(wait)).await {
            Ok(r) => r,
            Err(_) => Err(TriggerError::Timeout {
                broker,
                timeout_ms: bound.as_millis() as u64,
            }),
        };
        if r.is_err() {
            self.redis = None;
            self.nats = None;
        }
        r
    }

    async fn wait_inner(&mut self, wait: Duration) -> Result<bool, TriggerError> {
        match self.spec.clone() {
            TriggerSpec::RedisList { url, key } => {
                if self.redis.is_none() {
                    self.redis = Some(redis_connect(&url).await?);
                }
                let con = self.redis.as_mut().expect("set just above");
                let v: Option<Vec<u8>> = redis::cmd("BLMOVE")
                    .arg(&key)
                    .arg(&key)
                    .arg("RIGHT")
                    .arg("RIGHT")
                    .arg(wait.as_secs_f64().max(0.01))
                    .query_async(con)
                    .await
                    .map_err(|e| redis_err(&url, e))?;
                Ok(v.is_some())
            }
            TriggerSpec::RedisStream { url, stream, .. } => {
                if self.redis.is_none() {
                    self.redis = Some(redis_connect(&url).await?);
                }
                let con = self.redis.as_mut().expect("set just above");
                let v: redis::Value = redis::cmd("XREAD")
                    .arg("COUNT")
                    .arg(1)
                    .arg("BLOCK")
                    .arg(wait.as_millis().max(1) as u64)
                    .arg("STREAMS")
                    .arg(&stream)
                    .arg("$")
                    .query_async(con)
                    .await
                    .map_err(|e| redis_err(&url, e))?;
                Ok(!matches!(v, redis::Value::Nil))
            }
            TriggerSpec::NatsJetstream { url, stream, .. } => {
                if self.nats.is_none() {
                    let client = nats_client(&url).await?;
                    let js = async_nats::jetstream::new(client.clone());
                    let mut st = js.get_stream(&stream).await.map_err(|e| {
                        if e.to_string().contains("not found") {
                            TriggerError::Missing {
                                broker: "nats",
                                what: format!("stream {stream:?}"),
                            }
                        } else {
                            TriggerError::Broker {
                                broker: "nats",
                                address: redact(&url),
                                reason: e.to_string(),
                            }
                        }
                    })?;
                    let subjects = st
                        .info()
                        .await
                        .map_err(|e| TriggerError::Broker {
                            broker: "nats",
                            address: redact(&url),
                            reason: e.to_string(),
                        })?
                        .config
                        .subjects
                        .clone();
                    let Some(subject) = subjects.first().cloned() else {
                        return Err(TriggerError::Unsupported {
                            what: "watching a stream without subjects",
                            reason: "the pool polls instead".into(),
                        });
                    };
                    // One subject covers the common case (`jobs.>`); more subjects are polled.
                    let sub =
                        client
                            .subscribe(subject)
                            .await
                            .map_err(|e| TriggerError::Broker {
                                broker: "nats",
                                address: redact(&url),
                                reason: e.to_string(),
                            })?;
                    self.nats = Some(sub);
                }
                let sub = self.nats.as_mut().expect("set just above");
                use futures::StreamExt;
                match tokio::time::timeout(wait, sub.next()).await {
                    Err(_) => Ok(false),
                    Ok(Some(_)) => Ok(true),
                    Ok(None) => Err(TriggerError::Broker {
                        broker: "nats",
                        address: redact(&url),
                        reason: "the subscription ended".into(),
                    }),
                }
            }
            TriggerSpec::Rabbitmq { .. } | TriggerSpec::Kafka { .. } => {
                Err(TriggerError::Unsupported {
                    what: "watching this broker",
                    reason: "it has no way to wait for a message without taking it".into(),
                })
            }
        }
    }
}

/// The vhost an AMQP URL names: its path without the leading `/`, percent-decoded; `/` when empty.
pub(crate) fn amqp_vhost(a: &reqwest::Url) -> String {
    let p = a.path().trim_start_matches('/');
    if p.is_empty() {
        return "/".into();
    }
    percent_decode(p)
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 2 < b.len() {
            let hex = std::str::from_utf8(&b[i + 1..i + 3]).unwrap_or("");
            if let Ok(v) = u8::from_str_radix(hex, 16) {
                out.push(v);
                i += 3;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

pub(crate) async fn redis_connect(
    url: &str,
) -> Result<redis::aio::MultiplexedConnection, TriggerError> {
    let client = redis::Client::open(url).map_err(|e| redis_err(url, e))?;
    match tokio::time::timeout(READ_TIMEOUT, client.get_multiplexed_async_connection()).await {
        Ok(r) => r.map_err(|e| redis_err(url, e)),
        Err(_) => Err(TriggerError::Timeout {
            broker: "redis",
            timeout_ms: READ_TIMEOUT.as_millis() as u64,
        }),
    }
}

pub(crate) async fn nats_connect(
    url: &str,
) -> Result<async_nats::jetstream::Context, TriggerError> {
    Ok(async_nats::jetstream::new(nats_client(url).await?))
}

pub(crate) async fn nats_client(url: &str) -> Result<async_nats::Client, TriggerError> {
    async_nats::ConnectOptions::new()
        .connection_timeout(READ_TIMEOUT)
        .request_timeout(Some(READ_TIMEOUT))
        .connect(url)
        .await
        .map_err(|e| TriggerError::Broker {
            broker: "nats",
            address: redact(url),
            reason: e.to_string(),
        })
}

pub(crate) async fn amqp_connect(url: &str) -> Result<lapin::Connection, TriggerError> {
    match tokio::time::timeout(
        READ_TIMEOUT,
        lapin::Connection::connect(url, lapin::ConnectionProperties::default()),
    )
    .await
    {
        Ok(r) => r.map_err(|e| amqp_err(url, e)),
        Err(_) => Err(TriggerError::Timeout {
            broker: "rabbitmq",
            timeout_ms: READ_TIMEOUT.as_millis() as u64,
        }),
    }
}

pub(crate) fn redis_err(url: &str, e: redis::RedisError) -> TriggerError {
    TriggerError::Broker {
        broker: "redis",
        address: redact(url),
        reason: e.to_string(),
    }
}

pub(crate) fn amqp_err(url: &str, e: lapin::Error) -> TriggerError {
    TriggerError::Broker {
        broker: "rabbitmq",
        address: redact(url),
        reason: e.to_string(),
    }
}

pub(crate) fn amqp_queue_err(url: &str, queue: &str, e: lapin::Error) -> TriggerError {
    let text = e.to_string();
    if text.contains("NOT_FOUND") || text.contains("NotFound") || text.contains("404") {
        TriggerError::Missing {
            broker: "rabbitmq",
            what: format!("queue {queue:?}"),
        }
    } else {
        amqp_err(url, e)
    }
}

pub(crate) fn nats_consumer_err(
    url: &str,
    stream: &str,
    consumer: &str,
    e: impl std::fmt::Display,
) -> TriggerError {
    let text = e.to_string();
    if text.contains("not found") {
        TriggerError::Missing {
            broker: "nats",
            what: format!("consumer {consumer:?} of stream {stream:?}"),
        }
    } else {
        TriggerError::Broker {
            broker: "nats",
            address: redact(url),
            reason: text,
        }
    }
}

async fn stream_depth(
    con: &mut redis::aio::MultiplexedConnection,
    url: &str,
    stream: &str,
    group: &str,
) -> Result<u64, TriggerError> {
    let groups: redis::Value = redis::cmd("XINFO")
        .arg("GROUPS")
        .arg(stream)
        .query_async(con)
        .await
        .map_err(|e| {
            if e.to_string().contains("no such key") {
                TriggerError::Missing {
                    broker: "redis",
                    what: format!("stream {stream:?}"),
                }
            } else {
                redis_err(url, e)
            }
        })?;
    let redis::Value::Array(groups) = groups else {
        return Err(TriggerError::Broker {
            broker: "redis",
            address: redact(url),
            reason: "XINFO GROUPS answered something other than an array".into(),
        });
    };
    for g in &groups {
        let fields = pairs(g);
        let name = fields
            .iter()
            .find(|(k, _)| k == "name")
            .and_then(|(_, v)| redis::from_redis_value::<String>(v).ok());
        if name.as_deref() != Some(group) {
            continue;
        }
        let num = |key: &str| {
            fields
                .iter()
                .find(|(k, _)| k == key)
                .and_then(|(_, v)| redis::from_redis_value::<i64>(v).ok())
        };
        let pending = num("pending").unwrap_or(0).max(0) as u64;
        return match num("lag") {
            Some(lag) => Ok(lag.max(0) as u64 + pending),
            None => {
                // Lag unknown (entries deleted, or Redis < 7): count the pending entries and what
                // XLEN says is beyond them, like KEDA's pendingEntriesCount fallback.
                let xpending: redis::Value = redis::cmd("XPENDING")
                    .arg(stream)
                    .arg(group)
                    .query_async(con)
                    .await
                    .map_err(|e| redis_err(url, e))?;
                let count = match &xpending {
                    redis::Value::Array(a) => a
                        .first()
                        .and_then(|v| redis::from_redis_value::<u64>(v).ok())
                        .unwrap_or(0),
                    _ => 0,
                };
                Ok(count.max(pending))
            }
        };
    }
    Err(TriggerError::Missing {
        broker: "redis",
        what: format!("group {group:?} of stream {stream:?}"),
    })
}

/// Key-value pairs of a RESP2 flat array or a RESP3 map.
fn pairs(v: &redis::Value) -> Vec<(String, redis::Value)> {
    match v {
        redis::Value::Array(a) => a
            .chunks(2)
            .filter_map(|kv| match kv {
                [k, v] => redis::from_redis_value::<String>(k)
                    .ok()
                    .map(|k| (k, v.clone())),
                _ => None,
            })
            .collect(),
        redis::Value::Map(m) => m
            .iter()
            .filter_map(|(k, v)| {
                redis::from_redis_value::<String>(k)
                    .ok()
                    .map(|k| (k, v.clone()))
            })
            .collect(),
        _ => Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vhost_from_url() {
        let u = |s: &str| reqwest::Url::parse(s).unwrap();
        assert_eq!(amqp_vhost(&u("amqp://h:5672")), "/");
        assert_eq!(amqp_vhost(&u("amqp://h:5672/")), "/");
        assert_eq!(amqp_vhost(&u("amqp://h:5672/%2f")), "/");
        assert_eq!(amqp_vhost(&u("amqp://h/prod")), "prod");
    }
}
