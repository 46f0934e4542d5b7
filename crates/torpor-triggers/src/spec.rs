//! Trigger settings: what a pool watches, checked strictly when the pool is created so that a
//! bad setting is refused with the field it is about, never discovered at run time.

use serde::{Deserialize, Serialize};

/// Longest key, stream, group, consumer, queue or topic name accepted.
const MAX_NAME: usize = 256;
const MAX_URL: usize = 2048;

/// One trigger. The JSON form is `{"type": "redis-list", "url": ..., "key": ...}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "kebab-case", deny_unknown_fields)]
pub enum TriggerSpec {
    /// Depth: `LLEN key`.
    RedisList { url: String, key: String },
    /// Depth: the consumer group's `lag` plus `pending` (`XINFO GROUPS`).
    RedisStream {
        url: String,
        stream: String,
        group: String,
    },
    /// Depth: the consumer's `num_pending + num_ack_pending`.
    NatsJetstream {
        url: String,
        stream: String,
        consumer: String,
    },
    /// Depth: the management API's `messages` (ready + unacknowledged); an AMQP passive
    /// declare (ready only) when there is no management URL or it fails.
    Rabbitmq {
        url: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        management_url: Option<String>,
        queue: String,
    },
    /// Depth: the consumer group's lag, summed over the topic's partitions (log end offset −
    /// committed offset). Needs the cargo feature `kafka`; refused at create without it.
    Kafka {
        brokers: Vec<String>,
        topic: String,
        group: String,
        /// Where a partition without a committed offset starts: `latest` (default, as KEDA's
        /// `offsetResetPolicy`; counts as lag 1 until a consumer commits) or `earliest`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        offset_reset: Option<String>,
    },
}

#[derive(Debug, thiserror::Error)]
pub enum TriggerError {
    /// A setting is wrong; `field` is its JSON path, e.g. `triggers[0].url`.
    #[error("{field}: {reason}")]
    Invalid { field: String, reason: String },
    /// The broker could not be reached or refused the call.
    #[error("{broker} at {address}: {reason}")]
    Broker {
        broker: &'static str,
        address: String,
        reason: String,
    },
    /// The queue, stream, group or consumer does not exist.
    #[error("{broker}: {what} not found")]
    Missing { broker: &'static str, what: String },
    #[error("{broker}: no answer within {timeout_ms} ms")]
    Timeout {
        broker: &'static str,
        timeout_ms: u64,
    },
    #[error("{what} is not supported: {reason}")]
    Unsupported { what: &'static str, reason: String },
    /// The trigger needs a cargo feature this build of torpor was made without.
    #[error("{field}: {what} needs torpor built with the cargo feature `{feature}` (cargo build -p torpor --features {feature})")]
    FeatureDisabled {
        field: String,
        what: &'static str,
        feature: &'static str,
    },
    /// A tenant's pool names a broker outside the operator's `--broker-allow` list. The message
    /// names the rule, never whether the address exists or answers.
    #[error("{field}: broker {address} is not in the operator's allow-list; a tenant's pool may name only the brokers listed with `torpor up --broker-allow HOST[:PORT],...` (the host exactly, and the port, the scheme's default when the URL has none; a listed host without a port allows every port)")]
    NotAllowed { field: String, address: String },
}

impl TriggerError {
    /// A stable code for API errors and status reports.
    pub fn code(&self) -> &'static str {
        match self {
            TriggerError::Invalid { .. } => "invalid_trigger",
            TriggerError::Broker { .. } => "broker_error",
            TriggerError::Missing { .. } => "broker_missing",
            TriggerError::Timeout { .. } => "broker_timeout",
            TriggerError::Unsupported { .. } => "unsupported",
            TriggerError::FeatureDisabled { .. } => "feature_disabled",
            TriggerError::NotAllowed { .. } => "broker_not_allowed",
        }
    }

    /// Whether this is a failure to reach or talk to the broker (refused, reset, timed out,
    /// an error answer) rather than a bad setting or a missing queue: what a tenant sees of it
    /// is one generic text, so that pool status is no port scanner.
    pub fn is_unreachable(&self) -> bool {
        matches!(
            self,
            TriggerError::Broker { .. } | TriggerError::Timeout { .. }
        )
    }
}

fn invalid(field: String, reason: impl Into<String>) -> TriggerError {
    TriggerError::Invalid {
        field,
        reason: reason.into(),
    }
}

impl TriggerSpec {
    /// The broker's name, for errors and metrics labels.
    pub fn broker(&self) -> &'static str {
        match self {
            TriggerSpec::RedisList { .. } | TriggerSpec::RedisStream { .. } => "redis",
            TriggerSpec::NatsJetstream { .. } => "nats",
            TriggerSpec::Rabbitmq { .. } => "rabbitmq",
            TriggerSpec::Kafka { .. } => "kafka",
        }
    }

    /// The `type` as written in JSON.
    pub fn kind(&self) -> &'static str {
        match self {
            TriggerSpec::RedisList { .. } => "redis-list",
            TriggerSpec::RedisStream { .. } => "redis-stream",
            TriggerSpec::NatsJetstream { .. } => "nats-jetstream",
            TriggerSpec::Rabbitmq { .. } => "rabbitmq",
            TriggerSpec::Kafka { .. } => "kafka",
        }
    }

    /// Whether the depth this trigger reads already counts messages taken but not yet
    /// acknowledged (so a dispatching pool must not add its own in-flight count again).
    pub fn depth_counts_in_flight(&self) -> bool {
        !matches!(self, TriggerSpec::RedisList { .. })
    }

    /// Every address this trigger makes torpor connect to (its broker, a RabbitMQ management
    /// API, each Kafka bootstrap server), with the port the client uses when the setting has
    /// none. `at` is the trigger's JSON path. Errors as [`TriggerSpec::validate`] for a setting
    /// that is not an address.
    pub fn broker_addresses(
        &self,
        at: &str,
    ) -> Result<Vec<crate::allow::BrokerAddress>, TriggerError> {
        let f = |name: &str| format!("{at}.{name}");
        let url = |field: String, v: &str| -> Result<crate::allow::BrokerAddress, TriggerError> {
            let u = reqwest::Url::parse(v)
                .map_err(|e| invalid(field.clone(), format!("not a URL ({e})")))?;
            let host = u
                .host_str()
                .filter(|h| crate::allow::plain_host(h))
                .ok_or_else(|| invalid(field.clone(), "has no plain host"))?
                .to_string();
            let port = u
                .port_or_known_default()
                .or_else(|| default_port(u.scheme()))
                .ok_or_else(|| invalid(field.clone(), "has no port"))?;
            Ok(crate::allow::BrokerAddress { field, host, port })
        };
        match self {
            TriggerSpec::RedisList { url: u, .. }
            | TriggerSpec::RedisStream { url: u, .. }
            | TriggerSpec::NatsJetstream { url: u, .. } => Ok(vec![url(f("url"), u)?]),
            TriggerSpec::Rabbitmq {
                url: u,
                management_url,
                ..
            } => {
                let mut v = vec![url(f("url"), u)?];
                if let Some(m) = management_url {
                    v.push(url(f("management_url"), m)?);
                }
                Ok(v)
            }
            TriggerSpec::Kafka { brokers, .. } => brokers
                .iter()
                .enumerate()
                .map(|(i, b)| {
                    let field = format!("{at}.brokers[{i}]");
                    let (host, port) = host_port(&field, b)?;
                    Ok(crate::allow::BrokerAddress {
                        field,
                        host: host.to_string(),
                        port,
                    })
                })
                .collect(),
        }
    }

    /// Checks every setting; `at` is the JSON path of this trigger, e.g. `triggers[0]`.
    pub fn validate(&self, at: &str) -> Result<(), TriggerError> {
        let f = |name: &str| format!("{at}.{name}");
        match self {
            TriggerSpec::RedisList { url, key } => {
                check_url(&f("url"), url, &["redis", "rediss"])?;
                check_name(&f("key"), key)
            }
            TriggerSpec::RedisStream { url, stream, group } => {
                check_url(&f("url"), url, &["redis", "rediss"])?;
                check_name(&f("stream"), stream)?;
                check_name(&f("group"), group)
            }
            TriggerSpec::NatsJetstream {
                url,
                stream,
                consumer,
            } => {
                check_url(&f("url"), url, &["nats", "tls"])?;
                check_nats_name(&f("stream"), stream)?;
                check_nats_name(&f("consumer"), consumer)
            }
            TriggerSpec::Rabbitmq {
                url,
                management_url,
                queue,
            } => {
                check_url(&f("url"), url, &["amqp"])?;
                if let Some(m) = management_url {
                    check_url(&f("management_url"), m, &["http", "https"])?;
                }
                check_name(&f("queue"), queue)
            }
            TriggerSpec::Kafka {
                brokers,
                topic,
                group,
                offset_reset,
            } => {
                if brokers.is_empty() {
                    return Err(invalid(f("brokers"), "needs at least one host:port"));
                }
                if brokers.len() > 32 {
                    return Err(invalid(f("brokers"), "at most 32 brokers"));
                }
                for (i, b) in brokers.iter().enumerate() {
                    check_host_port(&format!("{at}.brokers[{i}]"), b)?;
                }
                check_name(&f("topic"), topic)?;
                check_name(&f("group"), group)?;
                if !matches!(offset_reset.as_deref(), None | Some("latest" | "earliest")) {
                    return Err(invalid(
                        f("offset_reset"),
                        "must be \"latest\" or \"earliest\"",
                    ));
                }
                if cfg!(feature = "kafka") {
                    Ok(())
                } else {
                    Err(TriggerError::FeatureDisabled {
                        field: at.to_string(),
                        what: "the kafka trigger",
                        feature: "kafka",
                    })
                }
            }
        }
    }
}

fn check_name(field: &str, v: &str) -> Result<(), TriggerError> {
    if v.is_empty() {
        return Err(invalid(field.into(), "must not be empty"));
    }
    if v.len() > MAX_NAME {
        return Err(invalid(
            field.into(),
            format!("longer than {MAX_NAME} bytes"),
        ));
    }
    if v.chars().any(|c| c.is_control()) {
        return Err(invalid(field.into(), "contains a control character"));
    }
    Ok(())
}

/// JetStream stream and consumer names may not hold spaces, `.`, `*`, `>` or path separators.
fn check_nats_name(field: &str, v: &str) -> Result<(), TriggerError> {
    check_name(field, v)?;
    if v.chars()
        .any(|c| c.is_whitespace() || matches!(c, '.' | '*' | '>' | '/' | '\\'))
    {
        return Err(invalid(
            field.into(),
            "may not contain whitespace, '.', '*', '>', '/' or '\\'",
        ));
    }
    Ok(())
}

fn check_url(field: &str, v: &str, schemes: &[&str]) -> Result<(), TriggerError> {
    if v.len() > MAX_URL {
        return Err(invalid(
            field.into(),
            format!("longer than {MAX_URL} bytes"),
        ));
    }
    let url = reqwest::Url::parse(v)
        .map_err(|e| invalid(field.into(), format!("{v:?} is not a URL ({e})")))?;
    if !schemes.contains(&url.scheme()) {
        return Err(invalid(
            field.into(),
            format!(
                "scheme {:?} is not one of {}",
                url.scheme(),
                schemes
                    .iter()
                    .map(|s| format!("{s}://"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        ));
    }
    if url.port() == Some(0) {
        return Err(invalid(
            field.into(),
            format!("{v:?}: the port must be a number from 1 to 65535"),
        ));
    }
    match url.host_str() {
        None | Some("") => Err(invalid(field.into(), format!("{v:?} has no host"))),
        Some(h) if !crate::allow::plain_host(h) => Err(invalid(
            field.into(),
            format!("{v:?}: the host may hold only letters, digits, '-', '_' and '.' (or be an IP address)"),
        )),
        Some(_) => Ok(()),
    }
}

/// The port a broker client uses for a URL of `scheme` without one.
fn default_port(scheme: &str) -> Option<u16> {
    match scheme {
        "redis" | "rediss" => Some(6379),
        "nats" | "tls" => Some(4222),
        "amqp" => Some(5672),
        "amqps" => Some(5671),
        "http" => Some(80),
        "https" => Some(443),
        _ => None,
    }
}

/// `host:port` (`[IPv6]:port`), the host plain (see [`crate::allow::plain_host`]): a comma
/// would make a Kafka client read two servers.
fn host_port<'a>(field: &str, v: &'a str) -> Result<(&'a str, u16), TriggerError> {
    let not = || invalid(field.into(), format!("{v:?} is not host:port"));
    let (host, port) = v.rsplit_once(':').ok_or_else(not)?;
    let port = port
        .parse::<u16>()
        .ok()
        .filter(|p| *p != 0)
        .ok_or_else(not)?;
    if !crate::allow::plain_host(host) {
        return Err(invalid(
            field.into(),
            format!("{v:?}: the host may hold only letters, digits, '-', '_' and '.' (or be an IP address in brackets)"),
        ));
    }
    Ok((host, port))
}

fn check_host_port(field: &str, v: &str) -> Result<(), TriggerError> {
    host_port(field, v).map(|_| ())
}

/// Redacts the password of a URL for logs and status.
pub fn redact(url: &str) -> String {
    match reqwest::Url::parse(url) {
        Ok(mut u) if u.password().is_some() => {
            let _ = u.set_password(Some("***"));
            u.to_string()
        }
        Ok(u) => u.to_string(),
        Err(_) => "<invalid url>".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(v: serde_json::Value) -> Result<TriggerSpec, String> {
        let t: TriggerSpec = serde_json::from_value(v).map_err(|e| e.to_string())?;
        t.validate("triggers[0]").map_err(|e| e.to_string())?;
        Ok(t)
    }

    #[test]
    fn good_specs_parse() {
        let t = parse(serde_json::json!({"type": "redis-list", "url": "redis://127.0.0.1:6379", "key": "jobs"})).unwrap();
        assert_eq!(t.kind(), "redis-list");
        parse(serde_json::json!({"type": "redis-stream", "url": "redis://h/0", "stream": "s", "group": "g"})).unwrap();
        parse(serde_json::json!({"type": "nats-jetstream", "url": "nats://127.0.0.1:4222", "stream": "JOBS", "consumer": "w"})).unwrap();
        parse(serde_json::json!({"type": "rabbitmq", "url": "amqp://guest:guest@127.0.0.1:5672/%2f", "management_url": "http://127.0.0.1:15672", "queue": "jobs"})).unwrap();
        parse(serde_json::json!({"type": "rabbitmq", "url": "amqp://127.0.0.1", "queue": "jobs"}))
            .unwrap();
    }

    #[test]
    fn bad_specs_name_the_field() {
        let cases = [
            (
                serde_json::json!({"type": "redis-list", "url": "http://x", "key": "k"}),
                "triggers[0].url",
            ),
            (
                serde_json::json!({"type": "redis-list", "url": "redis://x", "key": ""}),
                "triggers[0].key",
            ),
            (
                serde_json::json!({"type": "redis-list", "url": "not a url", "key": "k"}),
                "triggers[0].url",
            ),
            (
                serde_json::json!({"type": "redis-stream", "url": "redis://x", "stream": "s", "group": ""}),
                "triggers[0].group",
            ),
            (
                serde_json::json!({"type": "nats-jetstream", "url": "nats://x", "stream": "a.b", "consumer": "c"}),
                "triggers[0].stream",
            ),
            (
                serde_json::json!({"type": "rabbitmq", "url": "amqp://x", "management_url": "ftp://x", "queue": "q"}),
                "triggers[0].management_url",
            ),
            (
                serde_json::json!({"type": "kafka", "brokers": [], "topic": "t", "group": "g"}),
                "triggers[0].brokers",
            ),
            (
                serde_json::json!({"type": "kafka", "brokers": ["h"], "topic": "t", "group": "g"}),
                "triggers[0].brokers[0]",
            ),
        ];
        for (v, field) in cases {
            let e = parse(v.clone()).unwrap_err();
            assert!(e.starts_with(field), "{v}: {e}");
        }
        // Unknown fields and types are refused by the parser.
        assert!(parse(
            serde_json::json!({"type": "redis-list", "url": "redis://x", "key": "k", "extra": 1})
        )
        .is_err());
        assert!(parse(serde_json::json!({"type": "sqs", "url": "redis://x"})).is_err());
    }

    #[test]
    fn kafka_needs_its_feature() {
        let v = serde_json::json!({"type": "kafka", "brokers": ["127.0.0.1:9092"], "topic": "t", "group": "g"});
        let t: TriggerSpec = serde_json::from_value(v).unwrap();
        let r = t.validate("triggers[0]");
        if cfg!(feature = "kafka") {
            r.unwrap();
        } else {
            let e = r.unwrap_err();
            assert_eq!(e.code(), "feature_disabled");
            assert!(e.to_string().contains("`kafka`"), "{e}");
        }
        let bad = serde_json::json!({"type": "kafka", "brokers": ["h:1"], "topic": "t", "group": "g", "offset_reset": "middle"});
        let e = parse(bad).unwrap_err();
        assert!(e.starts_with("triggers[0].offset_reset"), "{e}");
    }

    #[test]
    fn redacts_passwords() {
        assert_eq!(
            redact("amqp://u:secret@h:5672/%2f"),
            "amqp://u:***@h:5672/%2f"
        );
        assert!(!redact("redis://:pw@h/0").contains("pw"));
    }
}
