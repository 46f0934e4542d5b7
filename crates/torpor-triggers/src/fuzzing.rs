//! Entry points for the `pool_specs` fuzz target (`fuzz/`) and the property tests in
//! `tests/fuzz_specs.rs`: a tenant's trigger settings and the operator's `--broker-allow` list
//! decoded from arbitrary input, with what the allow-list check relies on asserted. They must
//! never panic on any input; an assertion failing is a bug. Not part of the crate's API.

use crate::allow::BrokerAllowList;
use crate::spec::{redact, TriggerError, TriggerSpec};

/// A trigger's JSON (what `POST /v1/pools` carries in `triggers[i]`), decoded and validated.
///
/// Asserted: a trigger whose settings are valid (or valid but for a cargo feature) has the
/// broker addresses the allow-list checks; a list naming exactly those addresses lets it
/// through; the empty list refuses it naming its first address's field; the broker's URLs
/// redact without panicking.
pub fn trigger_spec(json: &[u8]) -> Result<TriggerSpec, TriggerError> {
    let spec: TriggerSpec = serde_json::from_slice(json).map_err(|e| TriggerError::Invalid {
        field: "triggers[0]".into(),
        reason: e.to_string(),
    })?;
    let checked = spec.validate("triggers[0]");
    if matches!(checked, Ok(()) | Err(TriggerError::FeatureDisabled { .. })) {
        let addresses = spec
            .broker_addresses("triggers[0]")
            .unwrap_or_else(|e| panic!("{spec:?} is valid but has no broker address: {e}"));
        assert!(!addresses.is_empty(), "{spec:?}: no address to check");
        let entries: Vec<String> = addresses
            .iter()
            .map(|a| format!("{}:{}", a.host, a.port))
            .collect();
        let list = BrokerAllowList::parse(&entries)
            .unwrap_or_else(|e| panic!("the addresses of {spec:?} are no allow-list: {e}"));
        for a in &addresses {
            assert!(list.allows(&a.host, a.port), "{entries:?} refuses {a:?}");
        }
        list.check(&spec, "triggers[0]")
            .unwrap_or_else(|e| panic!("{entries:?} refuses {spec:?}: {e}"));
        match BrokerAllowList::default().check(&spec, "triggers[0]") {
            Err(TriggerError::NotAllowed { field, .. }) => {
                assert_eq!(field, addresses[0].field, "{spec:?}")
            }
            other => panic!("the empty allow-list answered {other:?} for {spec:?}"),
        }
    }
    for url in urls(&spec) {
        let _ = redact(url);
    }
    let _ = (spec.broker(), spec.kind(), spec.depth_counts_in_flight());
    checked.map(|()| spec)
}

fn urls(spec: &TriggerSpec) -> Vec<&str> {
    match spec {
        TriggerSpec::RedisList { url, .. }
        | TriggerSpec::RedisStream { url, .. }
        | TriggerSpec::NatsJetstream { url, .. } => vec![url],
        TriggerSpec::Rabbitmq {
            url,
            management_url,
            ..
        } => std::iter::once(url.as_str())
            .chain(management_url.as_deref())
            .collect(),
        TriggerSpec::Kafka { .. } => Vec::new(),
    }
}

/// `torpor up --broker-allow` as the operator writes it (comma-separated `HOST[:PORT]`),
/// parsed; each entry that parses, asked about its own host and port, is allowed.
pub fn broker_allow(text: &str) -> Result<BrokerAllowList, crate::AllowListError> {
    let entries: Vec<&str> = text.split(',').collect();
    let list = BrokerAllowList::parse(&entries)?;
    for raw in entries.iter().map(|e| e.trim()).filter(|e| !e.is_empty()) {
        // `HOST:PORT` or `[IPv6]:PORT` (a bare IPv6 address has more colons and no port).
        if let Some((host, port)) = raw.rsplit_once(':') {
            if raw.matches(':').count() == 1 || host.ends_with(']') {
                if let Ok(port) = port.parse::<u16>() {
                    assert!(
                        list.allows(host, port),
                        "{text:?} refuses its entry {raw:?}"
                    );
                }
            }
        }
    }
    Ok(list)
}
