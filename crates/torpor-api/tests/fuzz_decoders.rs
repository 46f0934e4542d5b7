//! The decoders of untrusted input the fuzz targets drive (`fuzz/fuzz_targets/connect_envelopes.rs`,
//! `e2b_bodies.rs`, `pool_specs.rs`), run on every `cargo test` with random and
//! structure-aware inputs for a fixed number of cases: Connect envelopes cut at random chunk
//! boundaries, envd request messages, E2B control-plane bodies under each kind of template
//! policy, list queries, `/files` multipart uploads and pool specs, each built from the real
//! field names with values of the right and of the wrong type. The entry points assert what
//! the decoders promise (chunking changes nothing, no path climbs out of `/`, an E2B body never
//! widens its template's policy, a valid pool's brokers are all checked); these tests add what
//! each well-formed input must decode to.

use proptest::prelude::*;
use serde_json::{json, Map, Value};
use torpor_api::fuzzing::{self, Framing};

/// Any JSON value, a few levels deep: the wrong type for most fields.
fn any_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        (-1e6f64..1e6).prop_map(Value::from),
        "\\PC{0,12}".prop_map(Value::from),
    ];
    leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::from),
            prop::collection::btree_map("[a-zA-Z_]{1,10}", inner, 0..4)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// An object whose keys are drawn from `fields` (each with its typed strategy, or now and then
/// any JSON), plus now and then a key nobody reads. The keys in `required` are there almost
/// always, the others six times in ten.
fn object_with(
    required: &'static [&'static str],
    fields: Vec<(&'static str, BoxedStrategy<Value>)>,
) -> BoxedStrategy<Value> {
    let per_field: Vec<_> = fields
        .into_iter()
        .map(|(k, typed)| {
            let p = if required.contains(&k) { 0.97 } else { 0.6 };
            prop::option::weighted(p, prop_oneof![40 => typed, 1 => any_json().boxed()])
                .prop_map(move |v| v.map(|v| (k.to_string(), v)))
                .boxed()
        })
        .collect();
    (
        per_field,
        prop::option::weighted(0.1, ("[a-z]{1,8}", any_json())),
    )
        .prop_map(|(kvs, extra)| {
            let mut m: Map<String, Value> = kvs.into_iter().flatten().collect();
            if let Some((k, v)) = extra {
                m.entry(k).or_insert(v);
            }
            Value::Object(m)
        })
        .boxed()
}

fn object_of(fields: Vec<(&'static str, BoxedStrategy<Value>)>) -> BoxedStrategy<Value> {
    object_with(&[], fields)
}

fn s(strategy: impl Strategy<Value = String> + 'static) -> BoxedStrategy<Value> {
    strategy.prop_map(Value::from).boxed()
}

fn strings(items: &'static [&'static str]) -> BoxedStrategy<Value> {
    prop::collection::vec(prop::sample::select(items), 0..4)
        .prop_map(|v| json!(v))
        .boxed()
}

fn envelope(flags: u8, msg: &[u8]) -> Vec<u8> {
    let mut out = vec![flags];
    out.extend_from_slice(&(msg.len() as u32).to_be_bytes());
    out.extend_from_slice(msg);
    out
}

/// A selector: a pid, a tag, both, or junk.
fn selector() -> BoxedStrategy<Value> {
    object_of(vec![
        ("pid", any::<u32>().prop_map(Value::from).boxed()),
        ("tag", s("[a-z]{0,6}")),
    ])
}

/// Request messages of `process.Process/*` and `filesystem.Filesystem/*`.
fn rpc_message() -> BoxedStrategy<Value> {
    let size = object_of(vec![
        ("cols", (0u32..70_000).prop_map(Value::from).boxed()),
        ("rows", (0u32..70_000).prop_map(Value::from).boxed()),
    ]);
    let process = object_with(
        &["cmd"],
        vec![
            ("cmd", s("[a-z/]{0,8}")),
            ("args", strings(&["-c", "echo hi", "", "\u{0}"])),
            ("envs", any_json().boxed()),
            ("cwd", s("(/|~/|\\.\\./|[a-z]{1,3}/){0,5}")),
            ("pid", any::<u32>().prop_map(Value::from).boxed()),
            ("tag", s("[a-z]{0,6}")),
        ],
    );
    let input = object_of(vec![
        ("stdin", s("[A-Za-z0-9+/=]{0,16}")),
        ("pty", s("[A-Za-z0-9+/=!]{0,16}")),
    ]);
    object_of(vec![
        (
            "process",
            prop_oneof![2 => process, 1 => selector()].boxed(),
        ),
        ("pty", object_of(vec![("size", size)])),
        ("tag", s("[a-z]{0,6}")),
        ("stdin", any::<bool>().prop_map(Value::from).boxed()),
        ("input", input),
        (
            "signal",
            prop_oneof![
                s("SIGNAL_SIG(KILL|TERM|HUP)"),
                (-20i64..40).prop_map(Value::from)
            ]
            .boxed(),
        ),
        ("path", s("(/|~|\\.\\.|\\.|[a-z]{1,3}|//){0,6}")),
        ("source", s("(/|\\.\\.|[a-z]{1,3}){0,6}")),
        ("destination", s("(/|\\.\\.|[a-z]{1,3}){0,6}")),
        ("depth", (0u32..100).prop_map(Value::from).boxed()),
        ("recursive", any::<bool>().prop_map(Value::from).boxed()),
        ("watcherId", s("w[a-z0-9]{0,8}")),
        ("start", object_of(vec![("process", selector())])),
        ("data", object_of(vec![("input", any_json().boxed())])),
        ("keepalive", Just(json!({})).boxed()),
    ])
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    /// Arbitrary bytes through every entry point: no panic, no broken promise.
    #[test]
    fn arbitrary_bytes_never_panic_any_decoder(data in prop::collection::vec(any::<u8>(), 0..300)) {
        fuzzing::connect_envelopes(&data);
        fuzzing::e2b_bodies(&data);
        let _ = fuzzing::pool_spec(&data);
    }

    /// Envelopes with random flags, messages and announced lengths (some lying, some past the
    /// cap), the body cut short and fed in random chunks: the incremental decoder answers what
    /// the whole body answers; honest unflagged envelopes come back as sent.
    #[test]
    fn envelopes_split_at_random_boundaries_decode_as_the_whole_body(
        frames in prop::collection::vec((
            prop::sample::select(vec![0u8, 0, 0, 0, 1, 2, 3, 0x40, 0x80]),
            prop::collection::vec(any::<u8>(), 0..24),
            prop_oneof![8 => Just(None), 1 => (0u32..40).prop_map(Some), 1 => Just(Some(u32::MAX))],
        ), 0..6),
        cut in prop_oneof![4 => Just(0usize), 1 => 1usize..8],
        chunks in prop::collection::vec(1usize..12, 0..4),
    ) {
        let mut body = Vec::new();
        for (flags, msg, announced) in &frames {
            let mut e = envelope(*flags, msg);
            if let Some(n) = announced {
                e[1..5].copy_from_slice(&n.to_be_bytes());
            }
            body.extend_from_slice(&e);
        }
        body.truncate(body.len().saturating_sub(cut));
        let got = fuzzing::envelope_stream(&body, &chunks);
        let honest = cut == 0 && frames.iter().all(|(f, _, n)| *f == 0 && n.is_none());
        if honest {
            let msgs: Vec<&[u8]> = frames.iter().map(|(_, m, _)| &m[..]).collect();
            let got = got.expect("honest envelopes decode");
            prop_assert_eq!(got.iter().map(|b| &b[..]).collect::<Vec<_>>(), msgs);
        }
        let mut with_sel = vec![chunks.first().copied().unwrap_or(0) as u8];
        with_sel.extend_from_slice(&body);
        fuzzing::connect_envelopes(&with_sel);
    }

    /// Every served envd method with messages built from the real field names, unary and
    /// enveloped, and as a StreamInput client stream.
    #[test]
    fn envd_request_messages_never_panic(
        msgs in prop::collection::vec(rpc_message(), 1..4),
        chunks in prop::collection::vec(1usize..40, 0..3),
        user in prop::sample::select(vec![None, Some("root"), Some("user")]),
    ) {
        let first = serde_json::to_vec(&msgs[0]).unwrap();
        let framed = envelope(0, &first);
        for (body, framing) in [(&first, Framing::Unary), (&framed, Framing::Stream)] {
            for (m, _) in fuzzing::PROCESS_METHODS {
                let _ = fuzzing::process_message(m, framing, body, &chunks);
            }
            for (m, _) in fuzzing::FILESYSTEM_METHODS {
                let _ = fuzzing::path_message(m, framing, body, user);
            }
        }
        let stream: Vec<u8> = msgs
            .iter()
            .flat_map(|m| envelope(0, &serde_json::to_vec(m).unwrap()))
            .collect();
        let _ = fuzzing::process_message("StreamInput", Framing::Stream, &stream, &chunks);
    }

    /// envd paths made of `/`, `.`, `..`, `~` and names: what resolves stays under `/`
    /// (asserted by resolve_checked), and a path that climbs above `/` from it is refused.
    #[test]
    fn envd_paths_never_climb_out_of_the_root(
        segs in prop::collection::vec(prop::sample::select(vec!["", ".", "..", "~", "a", "bb", "\u{0}", "..."]), 0..10),
        absolute in any::<bool>(),
        user in prop::sample::select(vec![None, Some("root")]),
    ) {
        let path = format!("{}{}", if absolute { "/" } else { "" }, segs.join("/"));
        let got = fuzzing::resolve_checked(&path, user);
        if absolute && !path.contains('\0') {
            let mut depth = 0i32;
            let mut climbs = false;
            for seg in &segs {
                match *seg {
                    "" | "." => {}
                    ".." => { depth -= 1; climbs |= depth < 0; }
                    _ => depth += 1,
                }
            }
            prop_assert_eq!(got.is_err(), climbs, "{:?} -> {:?}", path, got);
        }
    }
}

/// E2B's create body, from its real fields.
fn create_body() -> BoxedStrategy<Value> {
    let addresses: &'static [&'static str] = &[
        "1.2.3.4",
        "10.0.0.0/8",
        "0.0.0.0/0",
        "example.com",
        "*.example.org",
        "bad host",
        "300.1.1.1",
        "1.2.3.4/33",
        "::1",
        "",
        " 8.8.8.8 ",
    ];
    let network = object_of(vec![
        (
            "allowPublicTraffic",
            any::<bool>().prop_map(Value::from).boxed(),
        ),
        ("allowOut", strings(addresses)),
        ("denyOut", strings(addresses)),
        ("dnsServers", strings(&["8.8.8.8", "1.1.1.1", "x", "::1"])),
        (
            "maskRequestHost",
            s("(\\$\\{PORT\\}|[a-z]{1,5}|\\.|:|[0-9]{1,6}){0,4}"),
        ),
        (
            "egressProxy",
            prop_oneof![Just(Value::Null), Just(json!({})), Just(json!({"url":"x"}))].boxed(),
        ),
        (
            "rules",
            prop_oneof![Just(json!([])), Just(json!([{"host":"x"}]))].boxed(),
        ),
        (
            "httpsPorts",
            prop_oneof![Just(json!([])), Just(json!([443]))].boxed(),
        ),
    ]);
    let lifecycle = object_of(vec![(
        "onTimeout",
        prop_oneof![
            s("kill|pause|sleep"),
            object_of(vec![("action", s("kill|pause|x"))])
        ]
        .boxed(),
    )]);
    object_of(vec![
        ("templateID", s("(base|[a-z0-9-]{0,12}|\\PC{0,6})")),
        ("timeout", (-5i64..200_000).prop_map(Value::from).boxed()),
        ("autoPause", any::<bool>().prop_map(Value::from).boxed()),
        ("autoResume", any_json().boxed()),
        (
            "metadata",
            prop::collection::btree_map("(torpor\\.e2b\\.)?[a-z]{1,5}", "[a-z]{0,5}", 0..3)
                .prop_map(|m| json!(m))
                .boxed(),
        ),
        (
            "envVars",
            prop::collection::btree_map("[A-Z_=]{0,5}", "\\PC{0,5}", 0..3)
                .prop_map(|m| json!(m))
                .boxed(),
        ),
        ("lifecycle", lifecycle),
        ("network", network),
        (
            "allow_internet_access",
            any::<bool>().prop_map(Value::from).boxed(),
        ),
    ])
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    /// Create and network bodies under every kind of template policy (the entry points assert
    /// that none widens a policy that is not `full`).
    #[test]
    fn e2b_bodies_never_widen_their_template(body in create_body(), timeout in any_json()) {
        let bytes = serde_json::to_vec(&body).unwrap();
        for template in fuzzing::template_policies() {
            let _ = fuzzing::create_body(&bytes, template.as_ref());
            let net = serde_json::to_vec(body.get("network").unwrap_or(&Value::Null)).unwrap();
            let _ = fuzzing::network_body(&net, template.as_ref());
        }
        let t = serde_json::to_vec(&json!({"timeout": timeout})).unwrap();
        let _ = fuzzing::timeout_body(&t, true);
        let _ = fuzzing::timeout_body(&t, false);
    }

    /// Names in allowOut need a `full` template: under a restricting one they are refused
    /// with 400, whatever else the body holds.
    #[test]
    fn allow_out_under_a_restricting_template_is_refused(
        hosts in prop::collection::vec("[a-z]{1,8}\\.(com|org)", 1..3),
        dns in prop::option::of(Just(vec!["1.1.1.1"])),
    ) {
        let body = json!({"network": {"allowOut": hosts, "dnsServers": dns}});
        let bytes = serde_json::to_vec(&body).unwrap();
        let restricted = fuzzing::template_policies()[3].clone();
        let e = fuzzing::create_body(&bytes, restricted.as_ref()).unwrap_err();
        prop_assert_eq!(e.status.as_u16(), 400);
        let full = fuzzing::template_policies()[2].clone();
        prop_assert!(fuzzing::create_body(&bytes, full.as_ref()).is_ok());
    }

    /// List queries with states, doubly encoded metadata filters, limits and tokens.
    #[test]
    fn list_queries_parse_or_refuse(
        state in prop::option::of("(running|paused|x|,| ){0,4}"),
        metadata in prop::option::of("([a-z]{1,3}(%3D|=)[a-z]{0,3}(%26|&)?|%[0-9A-Fa-f]{0,2}|%E2%82|\\+){0,4}"),
        limit in prop::option::of("-?[0-9]{0,4}|x"),
        token in prop::option::of("[a-z0-9]{0,8}"),
        v2 in any::<bool>(),
    ) {
        let mut q = Vec::new();
        if let Some(s) = &state { q.push(format!("state={s}")); }
        if let Some(m) = &metadata { q.push(format!("metadata={m}")); }
        if let Some(l) = &limit { q.push(format!("limit={l}")); }
        if let Some(t) = &token { q.push(format!("nextToken={t}")); }
        let got = fuzzing::list_query(&q.join("&"), v2);
        if let Some(l) = limit.as_deref().and_then(|l| l.parse::<usize>().ok()) {
            if !(1..=100).contains(&l) {
                prop_assert!(got.is_err(), "limit {} accepted", l);
            }
        }
    }

    /// `/files` uploads: multipart bodies of random parts (names, filenames, data that holds
    /// CRLFs and dashes), some cut short, under random boundaries, queries and Basic users.
    #[test]
    fn files_uploads_parse_or_refuse(
        boundary in "[A-Za-z0-9'()+_,./:=?-]{1,20}",
        parts in prop::collection::vec((
            prop::option::of("[a-z]{0,4}"),
            prop::option::weighted(0.9, "(/|\\.\\.|[a-z]{1,3}){0,5}"),
            prop::collection::vec(prop::sample::select(vec![b'a', b'\r', b'\n', b'-', 0u8]), 0..20),
        ), 0..4),
        cut in prop_oneof![4 => Just(0usize), 1 => 1usize..30],
        path in prop::option::of("(/|~/|\\.\\./|[a-z]{1,3}/?){0,4}"),
        auth in prop::option::of("Basic (cm9vdDo=|dXNlcjo=|!!)"),
    ) {
        let mut body = Vec::new();
        for (name, filename, data) in &parts {
            body.extend_from_slice(format!("--{boundary}\r\nContent-Disposition: form-data").as_bytes());
            if let Some(n) = name { body.extend_from_slice(format!("; name=\"{n}\"").as_bytes()); }
            if let Some(f) = filename { body.extend_from_slice(format!("; filename=\"{f}\"").as_bytes()); }
            body.extend_from_slice(b"\r\n\r\n");
            body.extend_from_slice(data);
            body.extend_from_slice(b"\r\n");
        }
        body.extend_from_slice(format!("--{boundary}--\r\n").as_bytes());
        body.truncate(body.len().saturating_sub(cut));
        let query = path.as_ref().map(|p| format!("path={p}")).unwrap_or_default();
        let ct = format!("multipart/form-data; boundary={boundary}");
        let got = fuzzing::files_upload(&query, auth.as_deref().unwrap_or("").as_bytes(), &ct, &body);
        // A whole body whose data never holds the delimiter, each part naming a file, and no
        // path that climbs out: every part is a file to write.
        let delim = format!("\r\n--{boundary}");
        let clean = cut == 0
            && !parts.is_empty()
            && parts.iter().all(|(_, f, d)| {
                // The part's data ends where the delimiter after it starts, not before.
                let mut tail = d.clone();
                tail.extend_from_slice(delim.as_bytes());
                f.as_deref().is_some_and(|f| !f.is_empty() && !f.contains(".."))
                    && tail.windows(delim.len()).position(|w| w == delim.as_bytes()) == Some(d.len())
            })
            && path.as_deref().is_none_or(|p| !p.contains(".."));
        if clean {
            prop_assert_eq!(got, Ok(parts.len()));
        }
    }
}

/// A trigger of each kind with its own fields (the trigger decoders are fuzzed on their own in
/// torpor-triggers); some with a host or name that is refused.
fn trigger() -> BoxedStrategy<Value> {
    let host = "(localhost|10\\.0\\.0\\.1|\\[::1\\]|redis-[a-z]{1,4}|a,b|h%41|)(:[0-9]{1,5})?";
    let url = |schemes: &str| {
        let pattern = format!("({schemes})://(u:p@)?{host}(/[a-z]{{0,3}})?");
        s(proptest::string::string_regex(&pattern).expect("a regex"))
    };
    let name = || s("[a-z0-9_-]{1,8}|[a-z.*> ]{0,3}");
    prop_oneof![
        object_with(
            &["type", "url", "key"],
            vec![
                ("type", Just(json!("redis-list")).boxed()),
                ("url", url("redis|rediss")),
                ("key", name()),
            ]
        ),
        object_with(
            &["type", "url", "stream", "group"],
            vec![
                ("type", Just(json!("redis-stream")).boxed()),
                ("url", url("redis|rediss")),
                ("stream", name()),
                ("group", name()),
            ]
        ),
        object_with(
            &["type", "url", "stream", "consumer"],
            vec![
                ("type", Just(json!("nats-jetstream")).boxed()),
                ("url", url("nats|tls")),
                ("stream", name()),
                ("consumer", name()),
            ]
        ),
        object_with(
            &["type", "url", "queue"],
            vec![
                ("type", Just(json!("rabbitmq")).boxed()),
                ("url", url("amqp|http")),
                ("management_url", url("http|https|amqp")),
                ("queue", name()),
            ]
        ),
        object_with(
            &["type", "brokers", "topic", "group"],
            vec![
                ("type", Just(json!("kafka")).boxed()),
                (
                    "brokers",
                    strings(&["localhost:9092", "[::1]:9092", "h:0", "a,b:1", "h"])
                ),
                ("topic", name()),
                ("group", name()),
                ("offset_reset", s("latest|earliest|x")),
            ]
        ),
    ]
    .boxed()
}

fn wild_pool_spec() -> BoxedStrategy<Value> {
    let fallback = object_with(
        &["failure_threshold", "replicas"],
        vec![
            ("failure_threshold", (0u32..5).prop_map(Value::from).boxed()),
            ("replicas", (0u32..10).prop_map(Value::from).boxed()),
        ],
    );
    let http = object_with(
        &["port"],
        vec![
            ("port", (0u32..70_000).prop_map(Value::from).boxed()),
            ("path", s("(/|\\.\\.|\\?|[a-z]{1,3}| ){0,5}")),
            (
                "headers",
                prop::collection::btree_map("[a-zA-Z-]{0,8}|host", "[ -~]{0,6}", 0..3)
                    .prop_map(|m| json!(m))
                    .boxed(),
            ),
        ],
    );
    let dispatch = object_of(vec![
        ("command", strings(&["sh", "-c", "", "\u{0}"])),
        ("http", http),
        (
            "env",
            prop::collection::btree_map("[A-Z_=]{0,5}", "[a-z]{0,3}", 0..3)
                .prop_map(|m| json!(m))
                .boxed(),
        ),
        ("timeout_s", (0u64..100_000).prop_map(Value::from).boxed()),
        ("max_attempts", (0u32..200).prop_map(Value::from).boxed()),
        (
            "retry_backoff_ms",
            (0u64..100_000).prop_map(Value::from).boxed(),
        ),
        ("dead_letter", s("[a-z\\x00]{0,5}")),
    ]);
    object_with(&["name", "template", "max", "triggers"], vec![
        ("name", prop_oneof![9 => s("[a-z0-9][a-z0-9_-]{0,9}"), 1 => s("\\PC{0,5}")].boxed()),
        ("template", prop_oneof![9 => s("[a-z0-9][a-z0-9_-]{0,9}"), 1 => s("-?")].boxed()),
        ("min", (0u32..20).prop_map(Value::from).boxed()),
        ("max", prop_oneof![9 => 1u32..20, 1 => 0u32..2000].prop_map(Value::from).boxed()),
        ("target", (0u64..10).prop_map(Value::from).boxed()),
        ("activation", any::<u64>().prop_map(Value::from).boxed()),
        ("cooldown_s", (0u64..100_000).prop_map(Value::from).boxed()),
        ("poll_interval_ms", (0u64..4_000_000).prop_map(Value::from).boxed()),
        ("push", any::<bool>().prop_map(Value::from).boxed()),
        ("fallback", fallback),
        ("drain_grace_s", (0u64..4000).prop_map(Value::from).boxed()),
        ("triggers", prop_oneof![9 => prop::collection::vec(trigger(), 1..3), 1 => prop::collection::vec(trigger(), 0..10)].prop_map(Value::from).boxed()),
        ("dispatch", dispatch),
    ])
}

/// A valid pool spec with, half of the time, one field replaced by (or removed in favour of)
/// what [`wild_pool_spec`] draws for it: each refusal is then about one field.
fn pool_spec() -> BoxedStrategy<Value> {
    let name = || proptest::string::string_regex("[a-z0-9][a-z0-9_-]{0,9}").expect("a regex");
    let valid_trigger = prop_oneof![
        (name(), name()).prop_map(|(h, k)| json!({"type": "redis-list", "url": format!("redis://{h}:6379"), "key": k})),
        (name(), name()).prop_map(|(h, k)| json!({"type": "redis-stream", "url": format!("rediss://{h}"), "stream": k, "group": "g"})),
        (name(), name()).prop_map(|(h, k)| json!({"type": "nats-jetstream", "url": format!("nats://{h}:4222"), "stream": k, "consumer": "c"})),
        (name(), name()).prop_map(|(h, k)| json!({"type": "rabbitmq", "url": format!("amqp://u:p@{h}"), "management_url": format!("http://{h}:15672"), "queue": k})),
    ];
    let base = (name(), name(), 1u32..20, prop::collection::vec(valid_trigger, 1..3))
        .prop_map(|(name, template, max, triggers)| {
            json!({"name": name, "template": template, "min": max / 2, "max": max, "triggers": triggers})
        });
    let fields = vec![
        "name",
        "template",
        "min",
        "max",
        "target",
        "activation",
        "cooldown_s",
        "poll_interval_ms",
        "push",
        "fallback",
        "drain_grace_s",
        "triggers",
        "dispatch",
    ];
    (
        base,
        prop::option::weighted(0.5, (wild_pool_spec(), prop::sample::select(fields))),
    )
        .prop_map(|(mut spec, mutation)| {
            if let Some((wild, key)) = mutation {
                match wild.get(key) {
                    Some(v) => spec[key] = v.clone(),
                    None => {
                        spec.as_object_mut().expect("an object").remove(key);
                    }
                }
            }
            spec
        })
        .boxed()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    /// Pool specs built from the real fields (the entry point asserts a valid pool's brokers
    /// are all checkable and that it reads back as itself).
    #[test]
    fn pool_specs_validate_or_refuse(spec in pool_spec(), wild in wild_pool_spec()) {
        let _ = fuzzing::pool_spec(&serde_json::to_vec(&spec).unwrap());
        let _ = fuzzing::pool_spec(&serde_json::to_vec(&wild).unwrap());
    }
}

#[test]
fn well_formed_inputs_are_accepted() {
    let start = br#"{"process":{"cmd":"/bin/sh","args":["-c","echo hi"],"cwd":"~/x"},"pty":{"size":{"cols":80,"rows":24}}}"#;
    let framed = envelope(0, start);
    fuzzing::process_message("Start", Framing::Stream, &framed, &[]).unwrap();
    assert_eq!(
        fuzzing::process_message("Start", Framing::Unary, start, &[])
            .unwrap_err()
            .code,
        torpor_api::e2b::connect::Code::InvalidArgument,
        "Start is a stream"
    );
    let input = br#"{"process":{"pid":7},"input":{"stdin":"aGk="}}"#;
    fuzzing::process_message("SendInput", Framing::Unary, input, &[]).unwrap();
    let stream = [
        envelope(0, br#"{"start":{"process":{"tag":"t"}}}"#),
        envelope(0, br#"{"data":{"input":{"stdin":"aGk="}}}"#),
        envelope(0, br#"{"keepalive":{}}"#),
        envelope(2, b"{}"),
    ]
    .concat();
    for step in 1..stream.len() {
        fuzzing::process_message("StreamInput", Framing::Stream, &stream, &[step]).unwrap();
    }
    fuzzing::path_message(
        "Move",
        Framing::Unary,
        br#"{"source":"a","destination":"/tmp/b"}"#,
        None,
    )
    .unwrap();
    assert!(fuzzing::path_message("Stat", Framing::Unary, br#"{"path":"/../etc"}"#, None).is_err());
    fuzzing::create_body(
        br#"{"templateID":"base","timeout":60,"metadata":{"k":"v"}}"#,
        None,
    )
    .unwrap();
    assert_eq!(
        fuzzing::timeout_body(b"{}", true)
            .unwrap_err()
            .status
            .as_u16(),
        400
    );
    assert_eq!(
        fuzzing::files_upload(
            "path=/tmp/x",
            b"",
            "multipart/form-data; boundary=XyZ",
            b"--XyZ\r\nContent-Disposition: form-data; name=\"file\"\r\n\r\nhi\r\n--XyZ--\r\n"
        ),
        Ok(1)
    );
    let pool = json!({
        "name": "p", "template": "t", "max": 2,
        "triggers": [{"type": "redis-list", "url": "redis://10.0.0.1", "key": "jobs"}],
    });
    fuzzing::pool_spec(&serde_json::to_vec(&pool).unwrap()).unwrap();
}

/// The structured strategies reach the accepting paths too (so the properties above test more
/// than refusals): a share of each kind of generated input is accepted, and a share refused.
#[test]
fn generated_inputs_are_both_accepted_and_refused() {
    use proptest::strategy::ValueTree;
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let mut sample = |s: &BoxedStrategy<Value>| s.new_tree(&mut runner).unwrap().current();
    let count = |name: &str, ok: usize, n: usize| {
        eprintln!("{name}: {ok} of {n} accepted");
        assert!(
            ok >= n / 20 && ok <= n - n / 20,
            "{name}: {ok} of {n} accepted"
        );
    };
    let n = 1000;
    let (bodies, messages, pools) = (create_body(), rpc_message(), pool_spec());
    let full = fuzzing::template_policies()[2].clone();
    let ok = (0..n)
        .filter(|_| {
            fuzzing::create_body(
                &serde_json::to_vec(&sample(&bodies)).unwrap(),
                full.as_ref(),
            )
            .is_ok()
        })
        .count();
    count("create bodies", ok, n);
    let ok = (0..n)
        .filter(|_| {
            let m = envelope(0, &serde_json::to_vec(&sample(&messages)).unwrap());
            fuzzing::process_message("Start", Framing::Stream, &m, &[]).is_ok()
        })
        .count();
    count("Start messages", ok, n);
    let ok = (0..n)
        .filter(|_| {
            let m = serde_json::to_vec(&sample(&messages)).unwrap();
            fuzzing::process_message("SendInput", Framing::Unary, &m, &[]).is_ok()
        })
        .count();
    count("SendInput messages", ok, n);
    let ok = (0..n)
        .filter(|_| fuzzing::pool_spec(&serde_json::to_vec(&sample(&pools)).unwrap()).is_ok())
        .count();
    count("pool specs", ok, n);
}

/// The fuzz targets' seeds (`fuzz/seeds/`) are what their decoders accept, so a fuzz run starts
/// from inputs that reach past the parsers.
#[test]
fn fuzz_seeds_are_accepted_by_their_decoders() {
    let seed = |target: &str, name: &str| {
        let path = format!(
            "{}/../../fuzz/seeds/{target}/{name}",
            env!("CARGO_MANIFEST_DIR")
        );
        std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
    };
    // connect_envelopes: the first byte picks the chunking and the user; the rest is the body.
    let body = |name: &str| seed("connect_envelopes", name)[1..].to_vec();
    fuzzing::process_message("Start", Framing::Stream, &body("start"), &[]).unwrap();
    fuzzing::process_message("StreamInput", Framing::Stream, &body("stream_input"), &[3]).unwrap();
    fuzzing::process_message("SendSignal", Framing::Unary, &body("send_signal"), &[]).unwrap();
    fuzzing::process_message("Update", Framing::Unary, &body("update"), &[]).unwrap();
    fuzzing::path_message("Move", Framing::Unary, &body("fs_move"), None).unwrap();
    fuzzing::path_message("WatchDir", Framing::Stream, &body("fs_watch"), None).unwrap();
    // e2b_bodies: the first byte picks the template policy (2: full) and the list's version.
    let body = |name: &str| seed("e2b_bodies", name)[1..].to_vec();
    let full = fuzzing::template_policies()[2].clone();
    fuzzing::create_body(&body("create"), full.as_ref()).unwrap();
    fuzzing::network_body(&body("network"), full.as_ref()).unwrap();
    assert_eq!(fuzzing::timeout_body(&body("timeout"), true).unwrap(), 60);
    let list = fuzzing::list_query(std::str::from_utf8(&body("list")).unwrap(), true).unwrap();
    assert_eq!((list.limit, list.metadata.len()), (10, 2));
    let files = body("files");
    let mut fields = files.splitn(4, |b| *b == b'\n');
    let (query, auth, ct, upload) = (
        fields.next().unwrap(),
        fields.next().unwrap(),
        fields.next().unwrap(),
        fields.next().unwrap(),
    );
    let (query, ct) = (
        std::str::from_utf8(query).unwrap(),
        std::str::from_utf8(ct).unwrap(),
    );
    assert_eq!(fuzzing::files_upload(query, auth, ct, upload), Ok(2));
    fuzzing::pool_spec(&seed("pool_specs", "pool")).unwrap();
}
