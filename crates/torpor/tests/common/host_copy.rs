//! Shared by tests and benchmarks (`#[path]`-included by both): a copy of the built-in `host`
//! template under another name with its idle policy off, for runs where requests bypass torpor
//! (so to torpor the sandbox looks idle) or where a sandbox parked mid-phase would hand its
//! worker back.

use torpor_api::types::TemplateSpec;
use torpor_core::{IdlePolicy, TemplateName};

/// Creates `name`: `host`'s source, command and limits, no environment, no warm-up, no GPU, no
/// network policy, and no idle policy.
pub async fn host_copy_without_idle(c: &torpor_api::Client, name: &str) {
    let host = c.template("host").await.expect("the host template");
    c.create_template(&TemplateSpec {
        name: TemplateName::new(name).expect("template name"),
        source: host.source,
        command: host.command,
        env: Default::default(),
        cwd: None,
        limits: host.limits,
        idle: IdlePolicy {
            freeze_after_s: None,
            park_after_s: None,
            suspend_after_s: None,
        },
        warmup_ms: 0,
        gpu: None,
        network: None,
    })
    .await
    .expect("create the template");
}
