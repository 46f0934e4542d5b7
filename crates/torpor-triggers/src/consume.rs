//! Consumers for dispatch mode: take one message, hand it over, and settle it only when told:
//! [`Consumer::ack`] after the agent succeeded, [`Consumer::dead_letter`] after the last failed
//! attempt. A message that is taken but never settled (torpor crashed, the broker connection
//! broke) goes back to the queue: at-least-once, never lost.
//!
//! | trigger | take (blocking, so a message is pushed to torpor) | ack | dead letter |
//! |---|---|---|---|
//! | redis-list | `BLMOVE key key:torpor:processing RIGHT LEFT` | `LREM processing` | `LPUSH dead_letter` |
//! | redis-stream | `XREADGROUP GROUP g c BLOCK … STREAMS s >` (own pending first) | `XACK` | `XADD dead_letter`, `XACK` |
//! | nats-jetstream | pull `fetch` with expiry | `ack` | publish to `dead_letter`, `ack` |
//! | rabbitmq | `basic.consume`, prefetch 1 | `basic.ack` | publish to queue `dead_letter`, `basic.ack` |
//! | kafka (feature `kafka`) | `Fetch` by a pool-wide simple consumer of every partition | `OffsetCommit` of the lowest unfinished offset | produce to topic `dead_letter`, then commit |
//!
//! Redis lists have no redelivery of their own: what is left in the processing list when a pool
//! starts is moved back to the queue ([`recover_redis_list`]).

use std::time::Duration;

use futures::StreamExt;

use crate::depth::{
    amqp_connect, amqp_err, amqp_queue_err, nats_connect, nats_consumer_err, redis_connect,
    redis_err,
};
use crate::spec::{redact, TriggerError, TriggerSpec};

/// A stream entry's fields, in order.
type Fields = Vec<(String, Vec<u8>)>;

/// One message taken from a broker.
pub struct Message {
    pub body: Vec<u8>,
    handle: Handle,
}

enum Handle {
    RedisList {
        raw: Vec<u8>,
    },
    RedisStream {
        id: String,
        fields: Fields,
    },
    Nats(Box<async_nats::jetstream::Message>),
    Amqp(Box<lapin::message::Delivery>),
    #[cfg(feature = "kafka")]
    Kafka {
        partition: i32,
        offset: i64,
    },
}

enum Inner {
    Redis(redis::aio::MultiplexedConnection),
    Nats(
        Box<async_nats::jetstream::consumer::PullConsumer>,
        async_nats::jetstream::Context,
    ),
    Amqp {
        _conn: lapin::Connection,
        channel: lapin::Channel,
        deliveries: lapin::Consumer,
    },
    /// The pool-wide simple consumer every lane shares (see [`crate::kafka`]).
    #[cfg(feature = "kafka")]
    Kafka(std::sync::Arc<tokio::sync::Mutex<crate::kafka::GroupConsumer>>),
}

pub struct Consumer {
    spec: TriggerSpec,
    name: String,
    dead_letter: String,
    inner: Inner,
    /// Redis streams: this consumer's own pending entries were read back.
    own_pending_done: bool,
}

/// The list a redis-list pool keeps taken-but-unfinished messages in.
pub fn processing_list(key: &str) -> String {
    format!("{key}:torpor:processing")
}

/// The default dead-letter destination for a trigger.
pub fn default_dead_letter(spec: &TriggerSpec, pool: &str) -> String {
    match spec {
        TriggerSpec::RedisList { key, .. } => format!("{key}:dead"),
        TriggerSpec::RedisStream { stream, .. } => format!("{stream}:dead"),
        TriggerSpec::NatsJetstream { .. } => format!("torpor.dead.{pool}"),
        TriggerSpec::Rabbitmq { queue, .. } => format!("{queue}.dead"),
        TriggerSpec::Kafka { topic, .. } => format!("{topic}.dead"),
    }
}

/// Whether torpor can dispatch from this trigger (take and settle messages itself).
pub fn can_dispatch(spec: &TriggerSpec) -> bool {
    !matches!(spec, TriggerSpec::Kafka { .. }) || cfg!(feature = "kafka")
}

/// Moves what a redis-list pool left in its processing list back to the queue's consumer end.
/// Returns how many messages went back. Call it only while no consumer of the pool runs.
pub async fn recover_redis_list(spec: &TriggerSpec) -> Result<u64, TriggerError> {
    let TriggerSpec::RedisList { url, key } = spec else {
        return Ok(0);
    };
    let mut con = redis_connect(url).await?;
    let mut moved = 0;
    loop {
        let v: Option<Vec<u8>> = redis::cmd("LMOVE")
            .arg(processing_list(key))
            .arg(key)
            .arg("LEFT")
            .arg("RIGHT")
            .query_async(&mut con)
            .await
            .map_err(|e| redis_err(url, e))?;
        if v.is_none() {
            return Ok(moved);
        }
        moved += 1;
    }
}

impl Consumer {
    /// Connects; `name` identifies this consumer to the broker (Redis stream consumer name,
    /// AMQP consumer tag).
    pub async fn connect(
        spec: &TriggerSpec,
        name: &str,
        dead_letter: &str,
    ) -> Result<Consumer, TriggerError> {
        let inner = match spec {
            TriggerSpec::RedisList { url, .. } | TriggerSpec::RedisStream { url, .. } => {
                Inner::Redis(redis_connect(url).await?)
            }
            TriggerSpec::NatsJetstream {
                url,
                stream,
                consumer,
            } => {
                let js = nats_connect(url).await?;
                let c: async_nats::jetstream::consumer::PullConsumer = js
                    .get_consumer_from_stream(consumer, stream)
                    .await
                    .map_err(|e| nats_consumer_err(url, stream, consumer, e))?;
                Inner::Nats(Box::new(c), js)
            }
            TriggerSpec::Rabbitmq { url, queue, .. } => {
                let conn = amqp_connect(url).await?;
                let channel = conn.create_channel().await.map_err(|e| amqp_err(url, e))?;
                channel
                    .basic_qos(1, lapin::options::BasicQosOptions::default())
                    .await
                    .map_err(|e| amqp_err(url, e))?;
                channel
                    .queue_declare(
                        dead_letter,
                        lapin::options::QueueDeclareOptions {
                            durable: true,
                            ..Default::default()
                        },
                        lapin::types::FieldTable::default(),
                    )
                    .await
                    .map_err(|e| amqp_err(url, e))?;
                let deliveries = channel
                    .basic_consume(
                        queue,
                        name,
                        lapin::options::BasicConsumeOptions::default(),
                        lapin::types::FieldTable::default(),
                    )
                    .await
                    .map_err(|e| amqp_queue_err(url, queue, e))?;
                Inner::Amqp {
                    _conn: conn,
                    channel,
                    deliveries,
                }
            }
            #[cfg(feature = "kafka")]
            TriggerSpec::Kafka {
                brokers,
                topic,
                group,
                offset_reset,
            } => Inner::Kafka(crate::kafka::shared(
                brokers,
                topic,
                group,
                crate::kafka::Reset::parse(offset_reset.as_deref()).unwrap_or_default(),
            )),
            #[cfg(not(feature = "kafka"))]
            TriggerSpec::Kafka { .. } => {
                return Err(TriggerError::FeatureDisabled {
                    field: "triggers[0]".into(),
                    what: "dispatch from kafka",
                    feature: "kafka",
                })
            }
        };
        Ok(Consumer {
            spec: spec.clone(),
            name: name.to_string(),
            dead_letter: dead_letter.to_string(),
            inner,
            own_pending_done: false,
        })
    }

    /// Closes the connection; a message taken and not settled goes back to the queue.
    pub async fn close(self) {
        if let Inner::Amqp { _conn, channel, .. } = self.inner {
            let _ = channel.close(200, "torpor lane stopped").await;
            let _ = _conn.close(200, "torpor lane stopped").await;
        }
    }

    fn url(&self) -> &str {
        match &self.spec {
            TriggerSpec::RedisList { url, .. }
            | TriggerSpec::RedisStream { url, .. }
            | TriggerSpec::NatsJetstream { url, .. }
            | TriggerSpec::Rabbitmq { url, .. } => url,
            TriggerSpec::Kafka { brokers, .. } => brokers.first().map_or("", String::as_str),
        }
    }

    /// Waits up to `wait` for a message; `Ok(None)` when none came.
    pub async fn next(&mut self, wait: Duration) -> Result<Option<Message>, TriggerError> {
        let url = self.url().to_string();
        let broker = self.spec.broker();
        let bound = wait + Duration::from_secs(5);
        let r = tokio::time::timeout(bound, self.next_inner(wait)).await;
        match r {
            Ok(r) => r,
            Err(_) => {
                let _ = url;
                Err(TriggerError::Timeout {
                    broker,
                    timeout_ms: bound.as_millis() as u64,
                })
            }
        }
    }

    async fn next_inner(&mut self, wait: Duration) -> Result<Option<Message>, TriggerError> {
        let url = self.url().to_string();
        let secs = (wait.as_secs_f64()).max(0.01);
        match (&self.spec, &mut self.inner) {
            (TriggerSpec::RedisList { key, .. }, Inner::Redis(con)) => {
                let v: Option<Vec<u8>> = redis::cmd("BLMOVE")
                    .arg(key)
                    .arg(processing_list(key))
                    .arg("RIGHT")
                    .arg("LEFT")
                    .arg(secs)
                    .query_async(con)
                    .await
                    .map_err(|e| redis_err(&url, e))?;
                Ok(v.map(|raw| Message {
                    body: raw.clone(),
                    handle: Handle::RedisList { raw },
                }))
            }
            (TriggerSpec::RedisStream { stream, group, .. }, Inner::Redis(con)) => {
                // First this consumer's own pending entries (taken before a crash), then new ones.
                let (id, block) = if self.own_pending_done {
                    (">", Some(wait.as_millis().max(1) as u64))
                } else {
                    ("0", None)
                };
                let mut cmd = redis::cmd("XREADGROUP");
                cmd.arg("GROUP")
                    .arg(group)
                    .arg(&self.name)
                    .arg("COUNT")
                    .arg(1);
                if let Some(ms) = block {
                    cmd.arg("BLOCK").arg(ms);
                }
                cmd.arg("STREAMS").arg(stream).arg(id);
                let reply: redis::Value =
                    cmd.query_async(con).await.map_err(|e| redis_err(&url, e))?;
                let entry = first_stream_entry(&reply);
                if entry.is_none() && !self.own_pending_done {
                    self.own_pending_done = true;
                    return Ok(None);
                }
                Ok(entry.map(|(id, fields)| {
                    let body = if fields.len() == 1 {
                        fields[0].1.clone()
                    } else {
                        let map: serde_json::Map<String, serde_json::Value> = fields
                            .iter()
                            .map(|(k, v)| {
                                (k.clone(), String::from_utf8_lossy(v).into_owned().into())
                            })
                            .collect();
                        serde_json::to_vec(&map).unwrap_or_default()
                    };
                    Message {
                        body,
                        handle: Handle::RedisStream { id, fields },
                    }
                }))
            }
            (TriggerSpec::NatsJetstream { .. }, Inner::Nats(c, _)) => {
                let mut batch = c
                    .fetch()
                    .max_messages(1)
                    .expires(wait.max(Duration::from_millis(100)))
                    .messages()
                    .await
                    .map_err(|e| nats_err(&url, e))?;
                match batch.next().await {
                    Some(Ok(m)) => Ok(Some(Message {
                        body: m.payload.to_vec(),
                        handle: Handle::Nats(Box::new(m)),
                    })),
                    Some(Err(e)) => Err(nats_err(&url, e)),
                    None => Ok(None),
                }
            }
            (TriggerSpec::Rabbitmq { .. }, Inner::Amqp { deliveries, .. }) => {
                match tokio::time::timeout(wait, deliveries.next()).await {
                    Err(_) => Ok(None),
                    Ok(None) => Err(TriggerError::Broker {
                        broker: "rabbitmq",
                        address: redact(&url),
                        reason: "the consumer was cancelled".into(),
                    }),
                    Ok(Some(Err(e))) => Err(amqp_err(&url, e)),
                    Ok(Some(Ok(d))) => Ok(Some(Message {
                        body: d.data.clone(),
                        handle: Handle::Amqp(Box::new(d)),
                    })),
                }
            }
            #[cfg(feature = "kafka")]
            (TriggerSpec::Kafka { .. }, Inner::Kafka(shared)) => {
                let taken = shared.lock().await.next(wait).await?;
                Ok(taken.map(|t| Message {
                    body: t.value,
                    handle: Handle::Kafka {
                        partition: t.partition,
                        offset: t.offset,
                    },
                }))
            }
            _ => Err(TriggerError::Unsupported {
                what: "this consumer",
                reason: "connection and trigger do not match".into(),
            }),
        }
    }

    /// The agent succeeded: the message is done.
    pub async fn ack(&mut self, m: Message) -> Result<(), TriggerError> {
        let url = self.url().to_string();
        match (&self.spec, &mut self.inner, m.handle) {
            (TriggerSpec::RedisList { key, .. }, Inner::Redis(con), Handle::RedisList { raw }) => {
                redis::cmd("LREM")
                    .arg(processing_list(key))
                    .arg(1)
                    .arg(raw)
                    .query_async::<i64>(con)
                    .await
                    .map_err(|e| redis_err(&url, e))?;
                Ok(())
            }
            (
                TriggerSpec::RedisStream { stream, group, .. },
                Inner::Redis(con),
                Handle::RedisStream { id, .. },
            ) => {
                redis::cmd("XACK")
                    .arg(stream)
                    .arg(group)
                    .arg(id)
                    .query_async::<i64>(con)
                    .await
                    .map_err(|e| redis_err(&url, e))?;
                Ok(())
            }
            // Confirmed by the server: once this returns, the broker no longer counts it pending.
            (_, _, Handle::Nats(m)) => m.double_ack().await.map_err(|e| nats_err(&url, e)),
            (_, _, Handle::Amqp(d)) => d
                .acker
                .ack(lapin::options::BasicAckOptions::default())
                .await
                .map_err(|e| amqp_err(&url, e)),
            #[cfg(feature = "kafka")]
            (_, Inner::Kafka(shared), Handle::Kafka { partition, offset }) => {
                shared.lock().await.settle(partition, offset).await
            }
            _ => Err(TriggerError::Unsupported {
                what: "ack",
                reason: "message and consumer do not match".into(),
            }),
        }
    }

    /// The last attempt failed: move the message to the dead-letter destination, then settle it.
    pub async fn dead_letter(&mut self, m: Message) -> Result<(), TriggerError> {
        let url = self.url().to_string();
        let dl = self.dead_letter.clone();
        match (&self.spec, &mut self.inner, m.handle) {
            (TriggerSpec::RedisList { key, .. }, Inner::Redis(con), Handle::RedisList { raw }) => {
                redis::pipe()
                    .atomic()
                    .cmd("LPUSH")
                    .arg(&dl)
                    .arg(&raw)
                    .ignore()
                    .cmd("LREM")
                    .arg(processing_list(key))
                    .arg(1)
                    .arg(&raw)
                    .ignore()
                    .query_async::<()>(con)
                    .await
                    .map_err(|e| redis_err(&url, e))
            }
            (
                TriggerSpec::RedisStream { stream, group, .. },
                Inner::Redis(con),
                Handle::RedisStream { id, fields },
            ) => {
                let mut p = redis::pipe();
                p.atomic();
                let c = p.cmd("XADD").arg(&dl).arg("*");
                for (k, v) in &fields {
                    c.arg(k).arg(v);
                }
                c.ignore();
                p.cmd("XACK").arg(stream).arg(group).arg(&id).ignore();
                p.query_async::<()>(con)
                    .await
                    .map_err(|e| redis_err(&url, e))
            }
            (_, Inner::Nats(_, js), Handle::Nats(m)) => {
                js.publish(dl, m.payload.clone())
                    .await
                    .map_err(|e| nats_err(&url, e))?
                    .await
                    .map_err(|e| nats_err(&url, e))?;
                m.double_ack().await.map_err(|e| nats_err(&url, e))
            }
            (_, Inner::Amqp { channel, .. }, Handle::Amqp(d)) => {
                channel
                    .basic_publish(
                        "",
                        &dl,
                        lapin::options::BasicPublishOptions::default(),
                        &d.data,
                        lapin::BasicProperties::default().with_delivery_mode(2),
                    )
                    .await
                    .map_err(|e| amqp_err(&url, e))?;
                d.acker
                    .ack(lapin::options::BasicAckOptions::default())
                    .await
                    .map_err(|e| amqp_err(&url, e))
            }
            #[cfg(feature = "kafka")]
            (_, Inner::Kafka(shared), Handle::Kafka { partition, offset }) => {
                let mut c = shared.lock().await;
                c.produce(&dl, &m.body).await?;
                c.settle(partition, offset).await
            }
            _ => Err(TriggerError::Unsupported {
                what: "dead letter",
                reason: "message and consumer do not match".into(),
            }),
        }
    }
}

fn nats_err(url: &str, e: impl std::fmt::Display) -> TriggerError {
    TriggerError::Broker {
        broker: "nats",
        address: redact(url),
        reason: e.to_string(),
    }
}

/// The first entry of an XREADGROUP reply: `[[stream, [[id, [k, v, ...]], ...]]]` (RESP2) or a
/// map of stream to entries (RESP3).
fn first_stream_entry(v: &redis::Value) -> Option<(String, Fields)> {
    let entries = match v {
        redis::Value::Array(streams) => match streams.first()? {
            redis::Value::Array(s) => s.get(1)?.clone(),
            _ => return None,
        },
        redis::Value::Map(m) => m.first()?.1.clone(),
        _ => return None,
    };
    let redis::Value::Array(entries) = entries else {
        return None;
    };
    let redis::Value::Array(entry) = entries.first()? else {
        return None;
    };
    let id: String = redis::from_redis_value(entry.first()?).ok()?;
    let fields = match entry.get(1)? {
        redis::Value::Array(kv) => kv
            .chunks(2)
            .filter_map(|p| match p {
                [k, v] => Some((
                    redis::from_redis_value::<String>(k).ok()?,
                    redis::from_redis_value::<Vec<u8>>(v).ok()?,
                )),
                _ => None,
            })
            .collect(),
        // A pending entry deleted from the stream reads back as nil fields.
        _ => Vec::new(),
    };
    Some((id, fields))
}
