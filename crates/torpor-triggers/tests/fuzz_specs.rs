//! A tenant's trigger settings and the operator's `--broker-allow` list, decoded from random
//! and structure-aware input on every `cargo test` (the `pool_specs` fuzz target runs the same
//! entry points for as long as it is given). `torpor_triggers::fuzzing::trigger_spec` asserts
//! what the allow-list check relies on: a valid trigger has the addresses it connects to, a
//! list of exactly those lets it through and the empty list refuses it.

use proptest::prelude::*;
use serde_json::{json, Map, Value};
use torpor_triggers::fuzzing::{broker_allow, trigger_spec};
use torpor_triggers::{BrokerAllowList, TriggerError};

/// Hosts as a tenant might write them: mostly names and addresses that are fine, sometimes
/// what a client could read as something else (`,`, `%`, `@`, brackets left open).
fn host() -> impl Strategy<Value = String> {
    prop_oneof![
        6 => "[a-zA-Z0-9-]{1,8}(\\.[a-z0-9_-]{1,5}){0,2}\\.?",
        3 => "(25[0-5]|1?[0-9]{1,2})(\\.[0-9]{1,3}){0,3}",
        1 => Just("[::1]".to_string()),
        1 => Just("[::ffff:10.0.0.1]".to_string()),
        1 => Just("[fe80::1%25eth0]".to_string()),
        1 => Just("[::1".to_string()),
        1 => "[a-z]{1,3}[,%@ ][a-z]{1,3}",
        1 => Just(String::new()),
    ]
}

/// A port: mostly one that is fine, sometimes 0, too large or not a number.
fn port() -> impl Strategy<Value = String> {
    prop_oneof![
        8 => (1u32..65_536).prop_map(|p| p.to_string()),
        1 => Just("0".to_string()),
        1 => (65_536u32..100_000).prop_map(|p| p.to_string()),
        1 => Just("x".to_string()),
    ]
}

/// A URL, with the scheme `right` most of the time.
fn url(right: &'static [&'static str]) -> impl Strategy<Value = String> {
    (
        prop_oneof![
            4 => prop::sample::select(right),
            1 => prop::sample::select(vec![
                "redis", "rediss", "nats", "tls", "amqp", "amqps", "http", "https", "file", "x",
            ]),
        ],
        prop::option::weighted(0.2, "[a-z]{0,3}(:[a-z*]{0,3})?@"),
        host(),
        prop::option::weighted(0.5, port()),
        prop::option::weighted(0.2, "(/[a-z%]{0,4}){0,2}(\\?[a-z=&]{0,6})?"),
    )
        .prop_map(|(scheme, user, host, port, path)| {
            let port = port.map(|p| format!(":{p}")).unwrap_or_default();
            let (user, path) = (user.unwrap_or_default(), path.unwrap_or_default());
            format!("{scheme}://{user}{host}{port}{path}")
        })
}

/// A name: mostly fine, sometimes empty, long, with control characters, or with what NATS
/// refuses.
fn name() -> impl Strategy<Value = String> {
    prop_oneof![
        12 => "[a-z0-9_-]{1,12}",
        1 => "[a-z.*> /\\\\]{0,6}",
        1 => "[a-z]{0,3}[\\x00-\\x1f][a-z]{0,3}",
        1 => "[a]{250,260}",
    ]
}

/// A trigger object with the fields of its kind; now and then one missing, of the wrong type,
/// or not a field of the kind at all.
fn trigger() -> impl Strategy<Value = Value> {
    let kind = prop::sample::select(vec![
        "redis-list",
        "redis-stream",
        "nats-jetstream",
        "rabbitmq",
        "kafka",
        "sqs",
    ]);
    let brokers = prop::collection::vec(
        prop_oneof![
            8 => (host(), port()).prop_map(|(h, p)| format!("{h}:{p}")),
            1 => host(),
        ],
        0..4,
    );
    (
        kind,
        (
            url(&["redis", "rediss"]),
            url(&["nats", "tls"]),
            url(&["amqp"]),
            prop::option::of(url(&["http", "https"])),
        ),
        (name(), name(), name()),
        brokers,
        prop::option::of(prop_oneof![3 => Just("latest"), 3 => Just("earliest"), 1 => Just("x")]),
        prop::collection::vec(
            (
                "[a-z_]{1,10}",
                prop_oneof![
                    Just(Value::Null),
                    Just(json!(1)),
                    Just(json!([])),
                    Just(json!("x"))
                ],
            ),
            0..2,
        ),
        prop::option::weighted(
            0.1,
            prop::sample::select(vec!["url", "key", "stream", "queue", "brokers"]),
        ),
        prop::bool::weighted(0.1),
    )
        .prop_map(
            |(kind, (redis, nats, amqp, mgmt), (a, b, c), brokers, reset, extra, drop, add)| {
                let mut m = Map::new();
                m.insert("type".into(), kind.into());
                match kind {
                    "redis-list" => {
                        m.insert("url".into(), redis.into());
                        m.insert("key".into(), a.into());
                    }
                    "redis-stream" => {
                        m.insert("url".into(), redis.into());
                        m.insert("stream".into(), a.into());
                        m.insert("group".into(), b.into());
                    }
                    "nats-jetstream" => {
                        m.insert("url".into(), nats.into());
                        m.insert("stream".into(), a.into());
                        m.insert("consumer".into(), b.into());
                    }
                    "rabbitmq" => {
                        m.insert("url".into(), amqp.into());
                        m.insert("queue".into(), c.into());
                        if let Some(u) = mgmt {
                            m.insert("management_url".into(), u.into());
                        }
                    }
                    _ => {
                        m.insert("brokers".into(), json!(brokers));
                        m.insert("topic".into(), a.into());
                        m.insert("group".into(), b.into());
                        if let Some(r) = reset {
                            m.insert("offset_reset".into(), r.into());
                        }
                    }
                }
                if add {
                    for (k, v) in extra {
                        m.insert(k, v);
                    }
                }
                if let Some(k) = drop {
                    m.remove(k);
                }
                Value::Object(m)
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes_never_panic_the_spec_decoders(data in prop::collection::vec(any::<u8>(), 0..200)) {
        let _ = trigger_spec(&data);
        let _ = broker_allow(&String::from_utf8_lossy(&data));
    }

    /// Triggers built from the real fields of each kind (the entry point asserts the
    /// allow-list's promises); a host a client could read as two (`,`), or that is not plain,
    /// is refused for every kind.
    #[test]
    fn trigger_specs_validate_or_refuse(t in trigger()) {
        let got = trigger_spec(&serde_json::to_vec(&t).unwrap());
        let hosts: Vec<&str> = ["url", "management_url"]
            .iter()
            .filter_map(|k| t.get(*k).and_then(Value::as_str))
            .chain(t.get("brokers").and_then(Value::as_array).into_iter().flatten().filter_map(Value::as_str))
            .collect();
        if hosts.iter().any(|h| h.contains(',')) {
            prop_assert!(got.is_err(), "{} accepted", t);
        }
        if let Err(e) = &got {
            prop_assert!(!matches!(e, TriggerError::NotAllowed { .. }), "{e}");
        }
    }

    /// `--broker-allow` lists of names, addresses, ports and junk (each entry that parses
    /// allows its own host and port: asserted by the entry point).
    #[test]
    fn broker_allow_lists_parse_or_refuse(
        entries in prop::collection::vec(
            (host(), prop::option::of(port())),
            0..5,
        ),
        url_entry in any::<bool>(),
    ) {
        let mut entries: Vec<String> = entries
            .into_iter()
            .map(|(h, p)| p.map_or(h.clone(), |p| format!("{h}:{p}")))
            .collect();
        if url_entry {
            entries.push("redis://h:1".into());
        }
        let got = broker_allow(&entries.join(","));
        if url_entry {
            prop_assert!(got.is_err(), "a URL entry was accepted");
        }
    }
}

#[test]
fn a_valid_trigger_is_allowed_only_by_a_list_naming_its_broker() {
    let t = br#"{"type":"rabbitmq","url":"amqp://u:p@10.0.0.1","queue":"q","management_url":"http://10.0.0.1:15672"}"#;
    let spec = trigger_spec(t).unwrap();
    let list = BrokerAllowList::parse(&["10.0.0.1:5672", "10.0.0.1:15672"]).unwrap();
    list.check(&spec, "triggers[0]").unwrap();
    let narrower = BrokerAllowList::parse(&["10.0.0.1:5672"]).unwrap();
    match narrower.check(&spec, "triggers[0]") {
        Err(TriggerError::NotAllowed { field, .. }) => {
            assert_eq!(field, "triggers[0].management_url")
        }
        other => panic!("{other:?}"),
    }
    assert!(trigger_spec(br#"{"type":"redis-list","url":"redis://a,b:6379","key":"k"}"#).is_err());
    // Found by trigger_specs_validate_or_refuse: port 0 passed validation, though no
    // allow-list entry can name it and no client can connect to it.
    match trigger_spec(
        br#"{"type":"nats-jetstream","url":"nats://a:0","stream":"s","consumer":"c"}"#,
    ) {
        Err(TriggerError::Invalid { field, .. }) => assert_eq!(field, "triggers[0].url"),
        other => panic!("{other:?}"),
    }
    assert!(broker_allow("redis.internal:6379, [::1]:4222,10.0.0.5").is_ok());
    assert!(broker_allow("h:0").is_err());
}

/// The generated triggers reach every outcome (so the properties above test the accepting
/// path too, not only refusals): some valid, some refused for each reason.
#[test]
fn generated_triggers_are_both_accepted_and_refused() {
    use proptest::strategy::ValueTree;
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let (mut valid, mut feature, mut invalid) = (0, 0, 0);
    for _ in 0..2000 {
        let t = trigger().new_tree(&mut runner).unwrap().current();
        match trigger_spec(&serde_json::to_vec(&t).unwrap()) {
            Ok(_) => valid += 1,
            Err(TriggerError::FeatureDisabled { .. }) => feature += 1,
            Err(_) => invalid += 1,
        }
    }
    eprintln!("valid {valid}, feature-disabled {feature}, invalid {invalid}");
    assert!(
        valid >= 50 && invalid >= 50,
        "valid {valid}, invalid {invalid}"
    );
}
