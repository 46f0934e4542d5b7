//! The engine's lifecycle over the fake node (`torpor_runtime::node::fake`): every rule of the
//! sleep ladder, every failure the node can have at every step, crashes of the daemon at every
//! transitional state, eviction, the parking lot and quotas under races, without root or runsc.
//! scripts/test.sh runs this binary as an unprivileged user.

mod props;
mod scenarios;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use torpor_control::{
    ControlError, CreateSandbox, Engine, EngineConfig, ExecResult, ImageRef, Quotas, SandboxRecord,
};
use torpor_core::{SandboxId, SandboxState, TemplateName, TenantId};
use torpor_runtime::node::fake::{FakeNode, IMAGE_FILE};
use torpor_runtime::proto::ExecRequest;

pub struct Rig {
    pub engine: Arc<Engine>,
    pub node: Arc<FakeNode>,
    pub dir: tempfile::TempDir,
    pub tenant: TenantId,
}

pub fn config(data_dir: &Path) -> EngineConfig {
    EngineConfig {
        data_dir: data_dir.to_path_buf(),
        workers: 4,
        runsc_binary: None,
        runsc_platform: None,
        agent_binary: "/nonexistent/torpor".into(),
        worker_wait: Duration::from_millis(400),
        lot_capacity: 16,
        reserved_workers: torpor_control::Reserve::Auto,
        memory_budget: None,
        // The idle policy runs only when a test calls policy_tick.
        tick: Duration::from_secs(3600),
        warm_pool: 0,
        live_restore: false,
        reencode_images: true,
        drain_timeout: Duration::from_secs(2),
        snapshots: Default::default(),
        import_dir: None,
        database: None,
        controller: None,
    }
}

/// An engine on a fresh fake node in a fresh data directory, with tenant `t1` (`quotas`).
pub async fn rig(quotas: Quotas, tune: impl FnOnce(&mut EngineConfig)) -> Rig {
    let dir = tempfile::tempdir().expect("temp dir");
    let mut cfg = config(dir.path());
    tune(&mut cfg);
    let node = Arc::new(FakeNode::new());
    let engine = Engine::start_on(cfg, Arc::new(node.clone()))
        .await
        .expect("engine starts on the fake node");
    let tenant = TenantId::new("t1").expect("tenant id");
    engine
        .create_tenant(tenant.clone(), quotas)
        .expect("tenant created");
    Rig {
        engine,
        node,
        dir,
        tenant,
    }
}

pub fn exec_req(cmd: &[&str]) -> ExecRequest {
    ExecRequest {
        cmd: cmd.iter().map(|s| s.to_string()).collect(),
        env: BTreeMap::new(),
        cwd: None,
        timeout_ms: None,
        detach: false,
        stream: false,
    }
}

/// A sandbox of the built-in host template.
pub async fn create_on(engine: &Engine, tenant: &TenantId) -> Result<SandboxRecord, ControlError> {
    engine
        .create_sandbox(
            tenant,
            CreateSandbox {
                template: TemplateName::host(),
                env: BTreeMap::new(),
                metadata: BTreeMap::new(),
                limits: Default::default(),
                gpu: None,
                layer_metadata: Default::default(),
                network: None,
            },
        )
        .await
}

impl Rig {
    pub async fn create(&self) -> Result<SandboxRecord, ControlError> {
        create_on(&self.engine, &self.tenant).await
    }

    pub async fn run(&self, id: &SandboxId, cmd: &[&str]) -> Result<ExecResult, ControlError> {
        self.engine
            .exec(&self.tenant, id, exec_req(cmd), Vec::new())
            .await
    }

    /// Runs `count` in the sandbox: its counter (memory state) after the increment.
    pub async fn count(&self, id: &SandboxId) -> Result<u64, ControlError> {
        let r = self.run(id, &["count"]).await?;
        assert_eq!(r.exit_code, Some(0), "count ran: {r:?}");
        Ok(r.stdout.trim().parse().expect("count prints a number"))
    }

    pub fn record(&self, id: &SandboxId) -> SandboxRecord {
        self.engine
            .sandbox(&self.tenant, id)
            .expect("sandbox exists")
    }

    /// The invariants that hold whenever no operation is in flight:
    /// - no sandbox is in a transitional state;
    /// - a resident sandbox (Running, Frozen) has exactly its current container on the node,
    ///   frozen exactly when it is Frozen; no other container runs;
    /// - a sleeping sandbox's committed image exists (a local image holds a whole checkpoint);
    /// - the node was never asked what it could not do (call a frozen container, ...).
    pub fn check_invariants(&self, ids: &[SandboxId]) {
        let mut expected = Vec::new();
        for id in ids {
            let Ok(rec) = self.engine.sandbox(&self.tenant, id) else {
                continue; // deleted
            };
            assert!(
                !rec.state.is_transitional(),
                "{id} is stuck in {}: {rec:?}",
                rec.state
            );
            let container = rec.container_id();
            match rec.state {
                SandboxState::Running | SandboxState::Frozen => {
                    assert_eq!(
                        self.node.is_frozen(&container),
                        rec.state == SandboxState::Frozen,
                        "{id} is {} but its container's freezer disagrees",
                        rec.state
                    );
                    expected.push(container);
                }
                _ => match &rec.image {
                    ImageRef::Local(p) => assert!(
                        p.join(IMAGE_FILE).is_file(),
                        "{id} ({}) points at a missing image {}",
                        rec.state,
                        p.display()
                    ),
                    ImageRef::Golden | ImageRef::Store(_) => {}
                    ImageRef::Worker { node, .. } => {
                        panic!("{id} points at an image on worker {node} on a single machine")
                    }
                },
            }
        }
        expected.sort();
        assert_eq!(
            self.node.running(),
            expected,
            "containers on the node differ from resident sandboxes"
        );
        assert_eq!(self.node.violations(), Vec::<String>::new());
    }
}

/// Waits until `cond` holds (a background transition landing), at most 5 s.
pub async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    for _ in 0..500 {
        if cond() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("timed out waiting for: {what}");
}

pub fn quotas() -> Quotas {
    Quotas::default()
}
