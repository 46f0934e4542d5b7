//! From a custom resource's spec to the body torpor's API takes, built from the API's own
//! types (`torpor_core::TemplateSpec`, `torpor_api::types::CreateTenantBody`,
//! `torpor_control::pools::PoolSpec`) and checked with their own validation, so a bad spec is
//! refused on the object's status before any call and the two can never drift apart silently.

use torpor_api::types::CreateTenantBody;
use torpor_control::pools::PoolSpec;
use torpor_control::Quotas;
use torpor_core::network::{AllowList, AllowRule, NetworkMode, Verdict};
use torpor_core::{IdlePolicy, Limits, NetworkPolicy, TemplateName, TemplateSource, TemplateSpec};

use crate::crd::{
    AllowRuleSpec, NetworkModeSpec, NetworkSpec, SandboxTemplateSpec, SourceKind, TenantQuotaSpec,
    TriggerType, VerdictSpec, WorkerPoolSpec,
};

/// A spec torpor would refuse; `field` is its path in the object (`spec.limits.cpus`).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct InvalidSpec {
    pub field: String,
    pub message: String,
}

fn invalid(field: &str, message: impl ToString) -> InvalidSpec {
    InvalidSpec {
        field: field.to_string(),
        message: message.to_string(),
    }
}

/// The body of `POST /v1/templates` for this spec, named `name`.
pub fn template_body(name: &str, spec: &SandboxTemplateSpec) -> Result<TemplateSpec, InvalidSpec> {
    let name = TemplateName::new(name).map_err(|e| invalid("spec.name", e))?;
    let path = || {
        spec.source
            .path
            .clone()
            .ok_or_else(|| invalid("spec.source.path", "is required for this kind"))
    };
    if spec.source.kind != SourceKind::Image && spec.source.reference.is_some() {
        return Err(invalid("spec.source.reference", "is only for kind image"));
    }
    let source = match spec.source.kind {
        SourceKind::Host => {
            if spec.source.path.is_some() {
                return Err(invalid("spec.source.path", "kind host takes no path"));
            }
            TemplateSource::Host
        }
        SourceKind::Rootfs => TemplateSource::Rootfs { path: path()? },
        SourceKind::Image => TemplateSource::Image {
            path: path()?,
            reference: spec.source.reference.clone(),
        },
    };
    let defaults = Limits::default();
    let limits = spec.limits.unwrap_or_default();
    let idle = match spec.idle {
        None => IdlePolicy::default(),
        Some(i) => IdlePolicy {
            freeze_after_s: i.freeze_after_s,
            park_after_s: i.park_after_s,
            suspend_after_s: i.suspend_after_s,
        },
    };
    let gpu = spec.gpu.as_ref().map(|g| {
        // The API's snake_case object, checked by the node.
        let mut v = serde_json::json!({ "mode": g.mode });
        let o = v.as_object_mut().expect("an object");
        let mut put = |k: &str, val: serde_json::Value| {
            o.insert(k.to_string(), val);
        };
        if let Some(c) = g.count {
            put("count", c.into());
        }
        if let Some(p) = &g.profile {
            put("profile", p.clone().into());
        }
        if let Some(c) = g.compute_pct {
            put("compute_pct", c.into());
        }
        if let Some(m) = g.memory_mib {
            put("memory_mib", m.into());
        }
        if let Some(b) = g.same_nvlink_domain {
            put("same_nvlink_domain", b.into());
        }
        if let Some(b) = g.numa_local {
            put("numa_local", b.into());
        }
        v
    });
    let body = TemplateSpec {
        name,
        source,
        command: spec.command.clone(),
        env: spec.env.clone(),
        cwd: spec.cwd.clone(),
        limits: Limits {
            memory_mib: limits.memory_mib.unwrap_or(defaults.memory_mib),
            cpus: limits.cpus.unwrap_or(defaults.cpus),
            pids: limits.pids.unwrap_or(defaults.pids),
        },
        idle,
        warmup_ms: spec.warmup_ms.unwrap_or(0),
        gpu,
        network: spec.network.as_ref().map(network_policy).transpose()?,
    };
    body.validate().map_err(|e| invalid("spec", e))?;
    Ok(body)
}

fn network_policy(n: &NetworkSpec) -> Result<NetworkPolicy, InvalidSpec> {
    let has_rules =
        !n.allow.is_empty() || !n.hosts.is_empty() || !n.deny.is_empty() || n.default.is_some();
    let policy = match (n.mode, has_rules) {
        (Some(_), true) => {
            return Err(invalid(
                "spec.network",
                "either mode or rules (allow, hosts, deny, default), not both",
            ))
        }
        (Some(NetworkModeSpec::None), false) => NetworkPolicy::Mode(NetworkMode::None),
        (Some(NetworkModeSpec::Full), false) => NetworkPolicy::Mode(NetworkMode::Full),
        (None, _) => {
            let rule = |r: &AllowRuleSpec| AllowRule {
                cidr: r.cidr.clone(),
                ports: r.ports.clone(),
            };
            NetworkPolicy::Allow(AllowList {
                allow: n.allow.iter().map(rule).collect(),
                hosts: n.hosts.clone(),
                deny: n.deny.iter().map(rule).collect(),
                default: match n.default {
                    Some(VerdictSpec::Allow) => Verdict::Allow,
                    Some(VerdictSpec::Deny) | None => Verdict::Deny,
                },
            })
        }
    };
    policy.validate().map_err(|e| invalid("spec", e))?;
    Ok(policy)
}

/// The body of `POST /v1/tenants` for the tenant `name`.
pub fn tenant_body(name: &str, spec: &TenantQuotaSpec) -> Result<CreateTenantBody, InvalidSpec> {
    torpor_core::TenantId::new(name).map_err(|e| invalid("metadata.name", e))?;
    if name == torpor_core::TenantId::admin().as_str() {
        return Err(invalid("metadata.name", "names the operator itself"));
    }
    Ok(CreateTenantBody {
        name: name.to_string(),
        quotas: Some(quotas(spec)),
    })
}

/// The quotas a TenantQuota asks for, as torpor shows them.
pub fn quotas(spec: &TenantQuotaSpec) -> Quotas {
    Quotas {
        max_sandboxes: spec.max_sandboxes,
        max_running: spec.max_running,
        max_memory_mib: spec.max_memory_mib,
        max_cpus: spec.max_cpus,
        max_templates: spec.max_templates,
        max_pools: spec.max_pools,
        max_disk_mib: spec.max_disk_mib,
        requests_per_s: spec.requests_per_s,
    }
}

/// The body of `POST /v1/pools` for this spec, named `name`.
pub fn pool_body(name: &str, spec: &WorkerPoolSpec) -> Result<PoolSpec, InvalidSpec> {
    use serde_json::{json, Map, Value};
    let mut o = Map::new();
    let mut put = |k: &str, v: Option<Value>| {
        if let Some(v) = v {
            o.insert(k.to_string(), v);
        }
    };
    put("name", Some(name.into()));
    put("template", Some(spec.template.clone().into()));
    put("min", spec.min.map(Into::into));
    put("max", Some(spec.max.into()));
    put("target", spec.target.map(Into::into));
    put("activation", spec.activation.map(Into::into));
    put("cooldown_s", spec.cooldown_s.map(Into::into));
    put("poll_interval_ms", spec.poll_interval_ms.map(Into::into));
    put("push", spec.push.map(Into::into));
    put(
        "fallback",
        spec.fallback
            .map(|f| json!({"failure_threshold": f.failure_threshold, "replicas": f.replicas})),
    );
    put("drain_grace_s", spec.drain_grace_s.map(Into::into));
    let triggers: Vec<Value> = spec
        .triggers
        .iter()
        .map(|t| {
            let mut m = Map::new();
            let kind = match t.type_ {
                TriggerType::RedisList => "redis-list",
                TriggerType::RedisStream => "redis-stream",
                TriggerType::NatsJetstream => "nats-jetstream",
                TriggerType::Rabbitmq => "rabbitmq",
                TriggerType::Kafka => "kafka",
            };
            m.insert("type".into(), kind.into());
            for (k, v) in [
                ("url", &t.url),
                ("key", &t.key),
                ("stream", &t.stream),
                ("group", &t.group),
                ("consumer", &t.consumer),
                ("queue", &t.queue),
                ("management_url", &t.management_url),
                ("topic", &t.topic),
                ("offset_reset", &t.offset_reset),
            ] {
                if let Some(v) = v {
                    m.insert(k.into(), v.clone().into());
                }
            }
            if !t.brokers.is_empty() {
                m.insert("brokers".into(), t.brokers.clone().into());
            }
            Value::Object(m)
        })
        .collect();
    put("triggers", Some(triggers.into()));
    put(
        "dispatch",
        spec.dispatch.as_ref().map(|d| {
            let mut m = Map::new();
            if let Some(c) = &d.command {
                m.insert("command".into(), c.clone().into());
            }
            if let Some(h) = &d.http {
                let mut hm = Map::new();
                hm.insert("port".into(), h.port.into());
                if let Some(p) = &h.path {
                    hm.insert("path".into(), p.clone().into());
                }
                if !h.headers.is_empty() {
                    hm.insert("headers".into(), json!(h.headers));
                }
                m.insert("http".into(), Value::Object(hm));
            }
            if !d.env.is_empty() {
                m.insert("env".into(), json!(d.env));
            }
            for (k, v) in [
                ("timeout_s", d.timeout_s),
                ("retry_backoff_ms", d.retry_backoff_ms),
            ] {
                if let Some(v) = v {
                    m.insert(k.into(), v.into());
                }
            }
            if let Some(a) = d.max_attempts {
                m.insert("max_attempts".into(), a.into());
            }
            if let Some(dl) = &d.dead_letter {
                m.insert("dead_letter".into(), dl.clone().into());
            }
            Value::Object(m)
        }),
    );
    // The API's own parser names the field that is wrong, as it would in a 400.
    let pool: PoolSpec =
        serde_json::from_value(Value::Object(o)).map_err(|e| invalid("spec", e))?;
    pool.validate().map_err(|e| invalid("spec", e))?;
    Ok(pool)
}

/// A short digest of a body (BLAKE3 of its JSON, 16 hex digits): what `status.appliedDigest`
/// holds, so that a changed spec is applied again without the body (env values) being shown.
pub fn digest<T: serde::Serialize>(body: &T) -> String {
    let bytes = serde_json::to_vec(body).unwrap_or_default();
    blake3::hash(&bytes).to_hex()[..16].to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::*;

    fn host_template() -> SandboxTemplateSpec {
        SandboxTemplateSpec {
            name: None,
            tenant: None,
            source: TemplateSourceSpec {
                kind: SourceKind::Host,
                path: None,
                reference: None,
            },
            command: vec!["python3".into(), "/app/agent.py".into()],
            env: [("MODE".to_string(), "prod".to_string())].into(),
            cwd: Some("/work".into()),
            limits: Some(LimitsSpec {
                memory_mib: Some(1024),
                cpus: None,
                pids: None,
            }),
            idle: Some(IdleSpec {
                freeze_after_s: None,
                park_after_s: Some(300.0),
                suspend_after_s: None,
            }),
            warmup_ms: Some(500),
            gpu: None,
            network: Some(NetworkSpec {
                allow: vec![AllowRuleSpec {
                    cidr: "10.0.0.0/8".into(),
                    ports: vec![443],
                }],
                ..Default::default()
            }),
        }
    }

    #[test]
    fn a_template_spec_becomes_the_api_body_with_torpor_defaults_for_what_it_leaves_out() {
        let body = template_body("py", &host_template()).unwrap();
        let json = serde_json::to_value(&body).unwrap();
        assert_eq!(json["name"], "py");
        assert_eq!(json["source"], serde_json::json!({"kind": "host"}));
        assert_eq!(
            json["limits"],
            serde_json::json!({"memory_mib": 1024, "cpus": 1.0, "pids": 256})
        );
        // A field left out of `idle` disables that step, as in the API.
        assert_eq!(
            json["idle"],
            serde_json::json!({"freeze_after_s": null, "park_after_s": 300.0, "suspend_after_s": null})
        );
        assert_eq!(
            json["network"],
            serde_json::json!({"allow": [{"cidr": "10.0.0.0/8", "ports": [443]}], "hosts": []})
        );
        // What the server parses is what we built.
        let back: TemplateSpec = serde_json::from_value(json).unwrap();
        assert_eq!(back, body);
    }

    #[test]
    fn a_template_spec_torpor_would_refuse_is_refused_naming_the_field() {
        let mut t = host_template();
        t.limits = Some(LimitsSpec {
            cpus: Some(0.0),
            ..Default::default()
        });
        let e = template_body("py", &t).unwrap_err();
        assert!(e.to_string().contains("limits.cpus"), "{e}");
        let mut t = host_template();
        t.source.kind = SourceKind::Rootfs;
        assert_eq!(
            template_body("py", &t).unwrap_err().field,
            "spec.source.path"
        );
        let mut t = host_template();
        t.network = Some(NetworkSpec {
            mode: Some(NetworkModeSpec::Full),
            hosts: vec!["example.com".into()],
            ..Default::default()
        });
        assert_eq!(template_body("py", &t).unwrap_err().field, "spec.network");
        assert_eq!(
            template_body("Not A Name", &host_template())
                .unwrap_err()
                .field,
            "spec.name"
        );
    }

    #[test]
    fn a_pool_spec_becomes_the_api_body_and_bad_triggers_are_named() {
        let spec = WorkerPoolSpec {
            name: None,
            tenant: None,
            template: "py".into(),
            min: None,
            max: 4,
            target: Some(2),
            activation: None,
            cooldown_s: None,
            poll_interval_ms: None,
            push: Some(false),
            fallback: Some(FallbackSpec {
                failure_threshold: 3,
                replicas: 1,
            }),
            drain_grace_s: None,
            triggers: vec![TriggerSpec {
                type_: TriggerType::RedisList,
                url: Some("redis://redis:6379".into()),
                key: Some("jobs".into()),
                stream: None,
                group: None,
                consumer: None,
                queue: None,
                management_url: None,
                brokers: vec![],
                topic: None,
                offset_reset: None,
            }],
            dispatch: Some(DispatchSpec {
                command: Some(vec!["python3".into(), "/app/handle.py".into()]),
                max_attempts: Some(5),
                ..Default::default()
            }),
        };
        let pool = pool_body("jobs", &spec).unwrap();
        let json = serde_json::to_value(&pool).unwrap();
        assert_eq!(json["name"], "jobs");
        assert_eq!(json["max"], 4);
        assert_eq!(json["target"], 2);
        assert_eq!(json["push"], false);
        assert_eq!(json["cooldown_s"], 30, "torpor's default");
        assert_eq!(
            json["triggers"][0],
            serde_json::json!({"type": "redis-list", "url": "redis://redis:6379", "key": "jobs"})
        );
        assert_eq!(json["dispatch"]["max_attempts"], 5);

        let mut bad = spec.clone();
        bad.triggers[0].url = Some("http://redis:6379".into());
        let e = pool_body("jobs", &bad).unwrap_err();
        assert!(e.to_string().contains("triggers[0].url"), "{e}");
        let mut bad = spec;
        bad.triggers[0].key = None;
        assert!(pool_body("jobs", &bad).is_err());
    }

    #[test]
    fn a_tenant_quota_becomes_the_api_body_and_the_admin_name_is_refused() {
        let spec = TenantQuotaSpec {
            max_sandboxes: Some(100),
            max_running: Some(10),
            requests_per_s: Some(50),
            ..Default::default()
        };
        let body = tenant_body("team-a", &spec).unwrap();
        assert_eq!(
            serde_json::to_value(&body).unwrap(),
            serde_json::json!({"name": "team-a", "quotas": {"max_sandboxes": 100, "max_running": 10, "requests_per_s": 50}})
        );
        assert!(tenant_body(torpor_core::TenantId::admin().as_str(), &spec).is_err());
        assert!(tenant_body("Team A", &spec).is_err());
    }

    #[test]
    fn the_digest_changes_with_the_body_only() {
        let a = template_body("py", &host_template()).unwrap();
        let mut t = host_template();
        assert_eq!(digest(&a), digest(&template_body("py", &t).unwrap()));
        t.env.insert("MODE".into(), "dev".into());
        assert_ne!(digest(&a), digest(&template_body("py", &t).unwrap()));
    }
}
