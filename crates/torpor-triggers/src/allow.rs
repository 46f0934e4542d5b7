//! The operator's broker allow-list (`torpor up --broker-allow HOST[:PORT],...`): the only
//! brokers a tenant's pool may name. The daemon connects to a trigger's broker from the host
//! network, so without this list a tenant could point a pool at anything the host reaches (the
//! operator's own Redis, a metadata service, a port scan through status errors).
//!
//! Matching is on what the broker client will connect to, taken from the URL the same way the
//! client takes it (the `url` crate, which the Redis, NATS and AMQP clients and reqwest all use):
//! the host exactly (ASCII case-insensitive; IP addresses compared as addresses) and the port,
//! the scheme's default port when the URL has none. An entry without a port allows every port
//! of its host. Nothing is resolved at check time: an entry naming a host allows whatever that
//! name resolves to when the broker client connects, so list only names whose DNS the operator
//! controls (a name a tenant can re-point is a hole; see docs/OPERATIONS.md).

use std::net::IpAddr;

use crate::spec::{TriggerError, TriggerSpec};

/// An entry of `--broker-allow` that cannot be read.
#[derive(Debug, thiserror::Error)]
#[error("--broker-allow {entry:?}: {reason}")]
pub struct AllowListError {
    pub entry: String,
    pub reason: &'static str,
}

/// A host as compared: an IP address, or a lowercase DNS name.
#[derive(Debug, Clone, PartialEq, Eq)]
enum HostKey {
    Ip(IpAddr),
    Name(String),
}

impl HostKey {
    /// `host` as a URL or `host:port` carries it (IPv6 in brackets or not).
    fn of(host: &str) -> HostKey {
        let bare = host
            .strip_prefix('[')
            .and_then(|h| h.strip_suffix(']'))
            .unwrap_or(host);
        match bare.parse::<IpAddr>() {
            Ok(ip) => HostKey::Ip(ip),
            Err(_) => HostKey::Name(bare.to_ascii_lowercase()),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct AllowEntry {
    host: HostKey,
    /// `None`: every port of the host.
    port: Option<u16>,
}

/// One address a trigger makes torpor connect to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BrokerAddress {
    /// The JSON path of the setting, e.g. `triggers[0].management_url`.
    pub field: String,
    /// As written in the setting (IPv6 in brackets).
    pub host: String,
    pub port: u16,
}

/// The brokers tenants' pools may name. Empty: none (the admin's pools may name any).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BrokerAllowList {
    entries: Vec<AllowEntry>,
}

/// A host as a broker setting may hold it: letters, digits, `-`, `_` and `.`, or an IPv6
/// address in brackets. Anything else (`,` that some clients read as a second server, `%`,
/// `@`, spaces) is refused for every caller, so what is checked is what is connected to.
pub(crate) fn plain_host(host: &str) -> bool {
    if let Some(inner) = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        return inner.parse::<std::net::Ipv6Addr>().is_ok();
    }
    !host.is_empty()
        && host.len() <= 253
        && host
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

impl BrokerAllowList {
    /// Reads `HOST[:PORT]` entries (`[IPv6]:PORT` or a bare IPv6 address for IPv6).
    pub fn parse<S: AsRef<str>>(entries: &[S]) -> Result<Self, AllowListError> {
        let mut out = Vec::with_capacity(entries.len());
        for raw in entries {
            let raw = raw.as_ref().trim();
            let bad = |reason| AllowListError {
                entry: raw.to_string(),
                reason,
            };
            if raw.is_empty() {
                continue;
            }
            if raw.contains("://") {
                return Err(bad("expected HOST or HOST:PORT, not a URL"));
            }
            let (host, port) = if let Some(rest) = raw.strip_prefix('[') {
                let (inner, after) = rest
                    .split_once(']')
                    .ok_or_else(|| bad("an IPv6 address needs its closing ']'"))?;
                let port = match after {
                    "" => None,
                    p => Some(
                        p.strip_prefix(':')
                            .ok_or_else(|| bad("expected [IPv6]:PORT"))?,
                    ),
                };
                (format!("[{inner}]"), port)
            } else if raw.matches(':').count() > 1 {
                // A bare IPv6 address: no port.
                (format!("[{raw}]"), None)
            } else {
                match raw.split_once(':') {
                    Some((h, p)) => (h.to_string(), Some(p)),
                    None => (raw.to_string(), None),
                }
            };
            if !plain_host(&host) {
                return Err(bad(
                    "the host may hold only letters, digits, '-', '_' and '.' (or be an IP address)",
                ));
            }
            let port = match port {
                None => None,
                Some(p) => match p.parse::<u16>() {
                    Ok(p) if p != 0 => Some(p),
                    _ => return Err(bad("the port must be a number from 1 to 65535")),
                },
            };
            out.push(AllowEntry {
                host: HostKey::of(&host),
                port,
            });
        }
        Ok(BrokerAllowList { entries: out })
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Whether a connection to `host:port` is allowed.
    pub fn allows(&self, host: &str, port: u16) -> bool {
        let key = HostKey::of(host);
        self.entries
            .iter()
            .any(|e| e.host == key && e.port.is_none_or(|p| p == port))
    }

    /// Refuses the first address of `spec` outside the list, naming its field and the rule.
    /// `at` is the trigger's JSON path, e.g. `triggers[0]`. Call after [`TriggerSpec::validate`].
    pub fn check(&self, spec: &TriggerSpec, at: &str) -> Result<(), TriggerError> {
        for a in spec.broker_addresses(at)? {
            if !self.allows(&a.host, a.port) {
                return Err(TriggerError::NotAllowed {
                    field: a.field,
                    address: format!("{}:{}", a.host, a.port),
                });
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn list(entries: &[&str]) -> BrokerAllowList {
        BrokerAllowList::parse(entries).unwrap()
    }

    fn spec(v: serde_json::Value) -> TriggerSpec {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn entries_parse_with_and_without_ports() {
        let l = list(&["Redis.Internal:6379", "10.0.0.5", "[::1]:4222", "fe80::1"]);
        assert!(l.allows("redis.internal", 6379));
        assert!(
            l.allows("REDIS.INTERNAL", 6379),
            "host case does not matter"
        );
        assert!(!l.allows("redis.internal", 6380), "the port must match");
        assert!(l.allows("10.0.0.5", 1), "no port: every port");
        assert!(l.allows("[::1]", 4222));
        assert!(
            l.allows("[0:0:0:0:0:0:0:1]", 4222),
            "IPs compare as addresses"
        );
        assert!(!l.allows("[::1]", 4223));
        assert!(l.allows("[fe80::1]", 9));
        assert!(!l.allows("redis.internal.", 6379), "no trailing-dot alias");
        assert!(!l.allows("127.1", 6379));
        for bad in [
            "redis://h:1",
            "h:0",
            "h:x",
            "h:70000",
            "a,b",
            "h%2f",
            "[::1",
            "[::1]x",
        ] {
            assert!(BrokerAllowList::parse(&[bad]).is_err(), "{bad}");
        }
        assert!(list(&[]).is_empty());
    }

    #[test]
    fn default_ports_are_the_schemes() {
        let l = list(&["r:6379", "n:4222", "a:5672", "m:443", "h:80"]);
        let ok = [
            serde_json::json!({"type": "redis-list", "url": "redis://r", "key": "k"}),
            serde_json::json!({"type": "redis-stream", "url": "rediss://:pw@r/0", "stream": "s", "group": "g"}),
            serde_json::json!({"type": "nats-jetstream", "url": "nats://n", "stream": "s", "consumer": "c"}),
            serde_json::json!({"type": "rabbitmq", "url": "amqp://u:p@a/%2f", "management_url": "https://m/", "queue": "q"}),
            serde_json::json!({"type": "rabbitmq", "url": "amqp://a", "management_url": "http://h", "queue": "q"}),
        ];
        for v in ok {
            let t = spec(v.clone());
            t.validate("triggers[0]").unwrap();
            l.check(&t, "triggers[0]")
                .unwrap_or_else(|e| panic!("{v}: {e}"));
        }
    }

    #[test]
    fn addresses_outside_the_list_are_refused_naming_the_field_and_the_flag() {
        let l = list(&["r:6379", "a:5672"]);
        let cases = [
            (
                serde_json::json!({"type": "redis-list", "url": "redis://r:6380", "key": "k"}),
                "triggers[0].url",
            ),
            (
                serde_json::json!({"type": "redis-list", "url": "redis://127.0.0.1:6379", "key": "k"}),
                "triggers[0].url",
            ),
            (
                serde_json::json!({"type": "rabbitmq", "url": "amqp://a", "management_url": "http://169.254.169.254/latest", "queue": "q"}),
                "triggers[0].management_url",
            ),
            (
                serde_json::json!({"type": "rabbitmq", "url": "amqp://a:5673", "queue": "q"}),
                "triggers[0].url",
            ),
        ];
        for (v, field) in cases {
            let e = l.check(&spec(v.clone()), "triggers[0]").unwrap_err();
            let text = e.to_string();
            assert!(text.starts_with(field), "{v}: {text}");
            assert!(text.contains("--broker-allow"), "{text}");
            assert_eq!(e.code(), "broker_not_allowed");
        }
        // The special-scheme URL parser normalises what the client will connect to, and the
        // check sees the same: 127.1 is 127.0.0.1 for http(s).
        let l = list(&["127.0.0.1:80"]);
        let t = spec(
            serde_json::json!({"type": "rabbitmq", "url": "amqp://127.0.0.1:80", "management_url": "http://127.1", "queue": "q"}),
        );
        l.check(&t, "triggers[0]").unwrap();
    }

    #[test]
    fn kafka_brokers_are_each_checked() {
        let l = list(&["k1:9092"]);
        let t = spec(
            serde_json::json!({"type": "kafka", "brokers": ["k1:9092", "k2:9092"], "topic": "t", "group": "g"}),
        );
        let e = l.check(&t, "triggers[0]").unwrap_err();
        assert!(e.to_string().starts_with("triggers[0].brokers[1]"), "{e}");
    }

    #[test]
    fn hosts_a_client_would_read_as_several_servers_are_refused_for_everyone() {
        for v in [
            serde_json::json!({"type": "nats-jetstream", "url": "nats://ok,evil:4222", "stream": "s", "consumer": "c"}),
            serde_json::json!({"type": "kafka", "brokers": ["ok:9092,evil:6379"], "topic": "t", "group": "g"}),
            serde_json::json!({"type": "redis-list", "url": "redis://a%2cb:6379", "key": "k"}),
        ] {
            let e = spec(v.clone()).validate("triggers[0]").unwrap_err();
            assert_eq!(e.code(), "invalid_trigger", "{v}: {e}");
        }
    }
}
