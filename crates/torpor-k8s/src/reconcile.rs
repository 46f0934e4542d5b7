//! The reconcile functions: one object in, torpor's API brought to what it says, its status
//! written, and when to look again out. Level-triggered: each run reads torpor's current
//! state, so an object deleted in torpor behind the operator's back is made again.
//!
//! Ownership: an object deletes in torpor only what it made (`status.managed`). One that finds
//! a torpor object of its name it did not make adopts it when torpor's copy says exactly what
//! its spec says (the case of a status write lost after a create), else it reports
//! `already_exists` and leaves it alone. torpor has no update of templates, tenants or pools:
//! a changed spec (`status.appliedDigest`) deletes and creates the object again, which torpor
//! refuses while something uses it (`template_in_use`, `tenant_in_use`), and the refusal is
//! the object's condition until it goes through.
//!
//! Tenants' tokens: torpor shows a tenant's token once, when the TenantQuota creates it; the
//! operator keeps it in the Secret `torpor-tenant-<name>` (key `token`) of its own namespace
//! and uses it for that tenant's templates and pools.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use k8s_openapi::ByteString;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::runtime::controller::Action;
use kube::runtime::finalizer::{finalizer, Event};
use kube::{Api, Resource, ResourceExt};
use serde::de::DeserializeOwned;
use serde::Serialize;
use torpor_api::Client;

use crate::body::{digest, pool_body, quotas, template_body, tenant_body};
use crate::crd::{
    SandboxTemplate, SandboxTemplateStatus, TenantQuota, TenantQuotaStatus, WorkerPool,
    WorkerPoolStatus, FINALIZER,
};
use crate::status::{is_not_found, set_ready, Outcome, RETRY_REFUSED, RETRY_UNAVAILABLE};

/// The key of the token in a tenant's Secret.
pub const TOKEN_KEY: &str = "token";

/// The Secret holding a tenant's token.
pub fn token_secret_name(tenant: &str) -> String {
    format!("torpor-tenant-{tenant}")
}

/// What every reconcile shares.
pub struct Context {
    pub kube: kube::Client,
    pub torpor_url: String,
    /// The operator's (admin) client.
    pub admin: Client,
    /// The operator's namespace: where tenants' token Secrets are kept.
    pub namespace: String,
}

impl Context {
    pub fn new(kube: kube::Client, torpor_url: &str, admin_token: &str, namespace: &str) -> Self {
        Context {
            kube,
            torpor_url: torpor_url.to_string(),
            admin: Client::new(torpor_url, admin_token),
            namespace: namespace.to_string(),
        }
    }

    fn secrets(&self) -> Api<Secret> {
        Api::namespaced(self.kube.clone(), &self.namespace)
    }

    /// The client acting for `tenant` (the operator's own without one). `Ok(None)`: the
    /// tenant's token Secret does not exist (its TenantQuota is missing or not reconciled).
    async fn client_for(&self, tenant: Option<&str>) -> Result<Option<Client>, Error> {
        let Some(tenant) = tenant else {
            return Ok(Some(self.admin.clone()));
        };
        let secret = self.secrets().get_opt(&token_secret_name(tenant)).await?;
        let token = secret
            .and_then(|s| s.data)
            .and_then(|d| d.get(TOKEN_KEY).cloned())
            .and_then(|b| String::from_utf8(b.0).ok());
        Ok(token.map(|t| Client::new(&self.torpor_url, t.trim())))
    }
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("Kubernetes API")]
    Kube(#[from] kube::Error),
    /// torpor refused or failed a call the object cannot go on without (written to its
    /// status too).
    #[error("{}", .0.message)]
    Torpor(Outcome),
    #[error("finalizer")]
    Finalizer(#[source] Box<kube::runtime::finalizer::Error<Error>>),
}

/// The controller's error policy: look again soon; the status already says why.
pub fn error_policy<K>(_obj: Arc<K>, err: &Error, _ctx: Arc<Context>) -> Action {
    tracing::warn!(error = %DisplayChain(err), "reconcile failed");
    match err {
        Error::Torpor(o) => Action::requeue(o.requeue.unwrap_or(RETRY_UNAVAILABLE)),
        _ => Action::requeue(RETRY_UNAVAILABLE),
    }
}

/// An error with its sources, for the log.
pub struct DisplayChain<'a>(pub &'a (dyn std::error::Error + 'static));

impl std::fmt::Display for DisplayChain<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)?;
        let mut src = self.0.source();
        while let Some(s) = src {
            write!(f, ": {s}")?;
            src = s.source();
        }
        Ok(())
    }
}

async fn patch_status<K, S>(api: &Api<K>, name: &str, status: &S) -> Result<(), Error>
where
    K: Resource + Clone + DeserializeOwned + std::fmt::Debug,
    S: Serialize,
{
    api.patch_status(
        name,
        &PatchParams::default(),
        &Patch::Merge(serde_json::json!({ "status": status })),
    )
    .await?;
    Ok(())
}

fn requeue(o: &Outcome) -> Action {
    match o.requeue {
        Some(d) => Action::requeue(d),
        // Nothing changes until the object does.
        None => Action::await_change(),
    }
}

fn tenant_token_missing(tenant: &str, ns: &str) -> Outcome {
    Outcome::refused(
        "tenant_token_missing",
        format!(
            "no token for tenant {tenant:?}: its TenantQuota is missing or not ready (Secret {ns}/{})",
            token_secret_name(tenant)
        ),
        RETRY_REFUSED,
    )
}

// ---------------------------------------------------------------------------------------------
// SandboxTemplate

pub async fn reconcile_template(
    obj: Arc<SandboxTemplate>,
    ctx: Arc<Context>,
) -> Result<Action, Error> {
    let api: Api<SandboxTemplate> = Api::all(ctx.kube.clone());
    finalizer(&api, FINALIZER, obj, |event| async {
        match event {
            Event::Apply(o) => apply_template(&api, &o, &ctx).await,
            Event::Cleanup(o) => cleanup_template(&o, &ctx).await,
        }
    })
    .await
    .map_err(|e| Error::Finalizer(Box::new(e)))
}

fn template_name(obj: &SandboxTemplate) -> String {
    obj.spec.name.clone().unwrap_or_else(|| obj.name_any())
}

async fn apply_template(
    api: &Api<SandboxTemplate>,
    obj: &SandboxTemplate,
    ctx: &Context,
) -> Result<Action, Error> {
    let name = template_name(obj);
    let mut status = obj.status.clone().unwrap_or_default();
    let outcome = ensure_template(obj, &name, &mut status, ctx).await?;
    tracing::info!(template = %name, ready = outcome.ready, reason = %outcome.reason, "template reconciled");
    status.observed_generation = obj.metadata.generation;
    set_ready(&mut status.conditions, &outcome, obj.metadata.generation);
    patch_status(api, &obj.name_any(), &status).await?;
    Ok(requeue(&outcome))
}

async fn ensure_template(
    obj: &SandboxTemplate,
    name: &str,
    status: &mut SandboxTemplateStatus,
    ctx: &Context,
) -> Result<Outcome, Error> {
    let body = match template_body(name, &obj.spec) {
        Ok(b) => b,
        Err(e) => return Ok(Outcome::invalid_spec(e)),
    };
    let tenant = obj.spec.tenant.as_deref();
    let Some(client) = ctx.client_for(tenant).await? else {
        return Ok(tenant_token_missing(
            tenant.unwrap_or_default(),
            &ctx.namespace,
        ));
    };
    let want = digest(&body);
    let existing = match owned_template(&client, name, tenant).await {
        Ok(t) => t,
        Err(e) => {
            return Ok(Outcome::from_torpor(
                &format!("reading template {name}"),
                &e,
            ))
        }
    };
    if let Some(t) = existing {
        let same = t.source == body.source
            && t.command == body.command
            && t.limits == body.limits
            && t.idle == body.idle;
        if !status.managed {
            if !same {
                return Ok(Outcome::refused(
                    "already_exists",
                    format!("a template {name:?} exists in torpor with another spec and was not made by this object; it is left alone"),
                    RETRY_REFUSED,
                ));
            }
            // Ours from a create whose status was lost, or identical: adopt it.
            status.managed = true;
            status.applied_digest = Some(want.clone());
        }
        if status.applied_digest.as_deref() == Some(&want) && same {
            status.state = Some(t.status.clone());
            status.golden_snapshot_bytes = Some(t.golden_snapshot_bytes);
            return Ok(Outcome::ready(format!("template {name} is {}", t.status)));
        }
        // The spec changed: torpor has no update, so register it again.
        if let Err(e) = client.delete_template(name).await {
            if !is_not_found(&e) {
                return Ok(Outcome::from_torpor(
                    &format!("replacing template {name} (delete)"),
                    &e,
                ));
            }
        }
        status.managed = false;
        status.applied_digest = None;
    }
    match client.create_template(&body).await {
        Ok(t) => {
            status.managed = true;
            status.applied_digest = Some(want);
            status.state = Some(t.status.clone());
            status.golden_snapshot_bytes = Some(t.golden_snapshot_bytes);
            Ok(Outcome::ready(format!("template {name} is {}", t.status)))
        }
        Err(e) => Ok(Outcome::from_torpor(
            &format!("registering template {name}"),
            &e,
        )),
    }
}

/// The template `name` of `tenant` (the operator's without one), if torpor has it. As the
/// admin, torpor answers a name the admin lacks with the one tenant's template of that name:
/// that one is not the operator's.
async fn owned_template(
    client: &Client,
    name: &str,
    tenant: Option<&str>,
) -> Result<Option<torpor_api::types::Template>, torpor_api::ClientError> {
    let owner = tenant.unwrap_or(ADMIN);
    match client.template(name).await {
        Ok(t) if t.tenant == owner => Ok(Some(t)),
        Ok(_) => Ok(None),
        Err(e) if is_not_found(&e) => Ok(None),
        Err(e) => Err(e),
    }
}

/// The operator's own tenant in torpor.
const ADMIN: &str = "admin";

async fn cleanup_template(obj: &SandboxTemplate, ctx: &Context) -> Result<Action, Error> {
    let name = template_name(obj);
    if !obj.status.as_ref().is_some_and(|s| s.managed) {
        return Ok(Action::await_change());
    }
    let tenant = obj.spec.tenant.as_deref();
    let Some(client) = ctx.client_for(tenant).await? else {
        // Without the tenant's token: if the tenant is gone, so is its template.
        return tenant_gone_or(tenant.unwrap_or_default(), ctx).await;
    };
    // Only the owner's own: the admin's lookup of a name it lacks finds a tenant's.
    let deleted = match owned_template(&client, &name, tenant).await {
        Ok(None) => Ok(()),
        Ok(Some(_)) => client.delete_template(&name).await,
        Err(e) => Err(e),
    };
    match deleted {
        Ok(()) => Ok(Action::await_change()),
        Err(e) if is_not_found(&e) => Ok(Action::await_change()),
        Err(e) => {
            let o = Outcome::from_torpor(&format!("deleting template {name}"), &e);
            let api: Api<SandboxTemplate> = Api::all(ctx.kube.clone());
            let mut status = obj.status.clone().unwrap_or_default();
            set_ready(&mut status.conditions, &o, obj.metadata.generation);
            patch_status(&api, &obj.name_any(), &status).await?;
            Err(Error::Torpor(o))
        }
    }
}

/// Cleanup of a tenant's object without its token: done when torpor has no such tenant.
async fn tenant_gone_or(tenant: &str, ctx: &Context) -> Result<Action, Error> {
    match ctx.admin.tenants().await {
        Ok(list) if list.iter().all(|t| t.name != tenant) => Ok(Action::await_change()),
        Ok(_) => Err(Error::Torpor(tenant_token_missing(tenant, &ctx.namespace))),
        Err(e) => Err(Error::Torpor(Outcome::from_torpor("listing tenants", &e))),
    }
}

// ---------------------------------------------------------------------------------------------
// TenantQuota

pub async fn reconcile_tenant(obj: Arc<TenantQuota>, ctx: Arc<Context>) -> Result<Action, Error> {
    let api: Api<TenantQuota> = Api::all(ctx.kube.clone());
    finalizer(&api, FINALIZER, obj, |event| async {
        match event {
            Event::Apply(o) => apply_tenant(&api, &o, &ctx).await,
            Event::Cleanup(o) => cleanup_tenant(&api, &o, &ctx).await,
        }
    })
    .await
    .map_err(|e| Error::Finalizer(Box::new(e)))
}

async fn apply_tenant(
    api: &Api<TenantQuota>,
    obj: &TenantQuota,
    ctx: &Context,
) -> Result<Action, Error> {
    let name = obj.name_any();
    let mut status = obj.status.clone().unwrap_or_default();
    let outcome = ensure_tenant(obj, &name, &mut status, ctx).await?;
    tracing::info!(tenant = %name, ready = outcome.ready, reason = %outcome.reason, "tenant reconciled");
    status.observed_generation = obj.metadata.generation;
    set_ready(&mut status.conditions, &outcome, obj.metadata.generation);
    patch_status(api, &name, &status).await?;
    Ok(requeue(&outcome))
}

async fn ensure_tenant(
    obj: &TenantQuota,
    name: &str,
    status: &mut TenantQuotaStatus,
    ctx: &Context,
) -> Result<Outcome, Error> {
    let body = match tenant_body(name, &obj.spec) {
        Ok(b) => b,
        Err(e) => return Ok(Outcome::invalid_spec(e)),
    };
    let want = digest(&body);
    let secret_name = token_secret_name(name);
    let existing = match ctx.admin.tenants().await {
        Ok(list) => list.into_iter().find(|t| t.name == name),
        Err(e) => return Ok(Outcome::from_torpor("listing tenants", &e)),
    };
    let has_token = ctx.client_for(Some(name)).await?.is_some();
    if let Some(t) = existing {
        let same = t.quotas == quotas(&obj.spec);
        if !status.managed {
            if !(same && has_token) {
                return Ok(Outcome::refused(
                    "already_exists",
                    format!("tenant {name:?} exists in torpor and was not made by this object (its token is not known); it is left alone"),
                    RETRY_REFUSED,
                ));
            }
            status.managed = true;
            status.applied_digest = Some(want.clone());
        }
        if status.applied_digest.as_deref() == Some(&want) && same {
            if !has_token {
                return Ok(Outcome::refused(
                    "token_lost",
                    format!("the Secret {}/{secret_name} holding the tenant's token is gone, and torpor shows a token only once: delete and re-create this TenantQuota", ctx.namespace),
                    RETRY_REFUSED,
                ));
            }
            status.token_secret = Some(secret_name);
            return Ok(Outcome::ready(format!("tenant {name} exists")));
        }
        // Quotas changed: torpor has no update, so the tenant is made again (a new token).
        if let Err(e) = ctx.admin.delete_tenant(name).await {
            if !is_not_found(&e) {
                return Ok(Outcome::from_torpor(
                    &format!("changing the quotas of tenant {name} (delete)"),
                    &e,
                ));
            }
        }
        status.managed = false;
        status.applied_digest = None;
    }
    match ctx.admin.create_tenant(&body).await {
        Ok(created) => {
            status.managed = true;
            status.applied_digest = Some(want);
            write_token(obj, &secret_name, &created.token, ctx).await?;
            status.token_secret = Some(secret_name);
            Ok(Outcome::ready(format!("tenant {name} exists")))
        }
        Err(e) => Ok(Outcome::from_torpor(&format!("creating tenant {name}"), &e)),
    }
}

/// Creates or replaces the tenant's token Secret, owned by the TenantQuota (so that it goes
/// with it even if the operator is not running).
async fn write_token(
    obj: &TenantQuota,
    name: &str,
    token: &str,
    ctx: &Context,
) -> Result<(), Error> {
    let owner = OwnerReference {
        api_version: TenantQuota::api_version(&()).to_string(),
        kind: TenantQuota::kind(&()).to_string(),
        name: obj.name_any(),
        uid: obj.metadata.uid.clone().unwrap_or_default(),
        controller: Some(true),
        block_owner_deletion: None,
    };
    let secret = Secret {
        metadata: kube::api::ObjectMeta {
            name: Some(name.to_string()),
            namespace: Some(ctx.namespace.clone()),
            labels: Some(BTreeMap::from([
                (
                    "app.kubernetes.io/managed-by".to_string(),
                    "torpor-operator".to_string(),
                ),
                ("torpor.dev/tenant".to_string(), obj.name_any()),
            ])),
            owner_references: Some(vec![owner]),
            ..Default::default()
        },
        type_: Some("Opaque".into()),
        data: Some(BTreeMap::from([(
            TOKEN_KEY.to_string(),
            ByteString(token.as_bytes().to_vec()),
        )])),
        ..Default::default()
    };
    let secrets = ctx.secrets();
    match secrets.get_opt(name).await? {
        None => {
            secrets.create(&PostParams::default(), &secret).await?;
        }
        Some(old) => {
            let mut s = secret;
            s.metadata.resource_version = old.metadata.resource_version;
            secrets.replace(name, &PostParams::default(), &s).await?;
        }
    }
    Ok(())
}

async fn cleanup_tenant(
    api: &Api<TenantQuota>,
    obj: &TenantQuota,
    ctx: &Context,
) -> Result<Action, Error> {
    let name = obj.name_any();
    if !obj.status.as_ref().is_some_and(|s| s.managed) {
        return Ok(Action::await_change());
    }
    match ctx.admin.delete_tenant(&name).await {
        Ok(()) => {}
        Err(e) if is_not_found(&e) => {}
        Err(e) => {
            let o = Outcome::from_torpor(&format!("deleting tenant {name}"), &e);
            let mut status = obj.status.clone().unwrap_or_default();
            set_ready(&mut status.conditions, &o, obj.metadata.generation);
            patch_status(api, &name, &status).await?;
            return Err(Error::Torpor(o));
        }
    }
    match ctx
        .secrets()
        .delete(&token_secret_name(&name), &DeleteParams::default())
        .await
    {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.code == 404 => {}
        Err(e) => return Err(e.into()),
    }
    Ok(Action::await_change())
}

// ---------------------------------------------------------------------------------------------
// WorkerPool

/// Pools change by themselves (agents, depth): their status is read this often.
const POOL_STATUS_EVERY: Duration = Duration::from_secs(30);

pub async fn reconcile_pool(obj: Arc<WorkerPool>, ctx: Arc<Context>) -> Result<Action, Error> {
    let api: Api<WorkerPool> = Api::all(ctx.kube.clone());
    finalizer(&api, FINALIZER, obj, |event| async {
        match event {
            Event::Apply(o) => apply_pool(&api, &o, &ctx).await,
            Event::Cleanup(o) => cleanup_pool(&api, &o, &ctx).await,
        }
    })
    .await
    .map_err(|e| Error::Finalizer(Box::new(e)))
}

fn pool_name(obj: &WorkerPool) -> String {
    obj.spec.name.clone().unwrap_or_else(|| obj.name_any())
}

async fn apply_pool(
    api: &Api<WorkerPool>,
    obj: &WorkerPool,
    ctx: &Context,
) -> Result<Action, Error> {
    let name = pool_name(obj);
    let mut status = obj.status.clone().unwrap_or_default();
    let mut outcome = ensure_pool(obj, &name, &mut status, ctx).await?;
    if outcome.ready {
        outcome.requeue = Some(POOL_STATUS_EVERY);
    }
    tracing::info!(pool = %name, ready = outcome.ready, reason = %outcome.reason, "pool reconciled");
    status.observed_generation = obj.metadata.generation;
    set_ready(&mut status.conditions, &outcome, obj.metadata.generation);
    patch_status(api, &obj.name_any(), &status).await?;
    Ok(requeue(&outcome))
}

fn pool_outcome(
    name: &str,
    p: &torpor_control::pools::PoolStatus,
    status: &mut WorkerPoolStatus,
) -> Outcome {
    status.desired = Some(p.desired);
    status.running = Some(p.running);
    status.depth = p.depth;
    match &p.last_error {
        Some(e) => Outcome::ready(format!("pool {name} runs; last scaling error: {e}")),
        None => Outcome::ready(format!("pool {name} runs")),
    }
}

async fn ensure_pool(
    obj: &WorkerPool,
    name: &str,
    status: &mut WorkerPoolStatus,
    ctx: &Context,
) -> Result<Outcome, Error> {
    let body = match pool_body(name, &obj.spec) {
        Ok(b) => b,
        Err(e) => return Ok(Outcome::invalid_spec(e)),
    };
    let tenant = obj.spec.tenant.as_deref();
    let Some(client) = ctx.client_for(tenant).await? else {
        return Ok(tenant_token_missing(
            tenant.unwrap_or_default(),
            &ctx.namespace,
        ));
    };
    let want = digest(&body);
    let existing = match client.pool(name).await {
        Ok(p) => Some(p),
        Err(e) if is_not_found(&e) => None,
        Err(e) => return Ok(Outcome::from_torpor(&format!("reading pool {name}"), &e)),
    };
    if let Some(p) = existing {
        // torpor shows the whole spec it runs: compare all of it.
        let same = p.spec == body;
        if !status.managed {
            if !same {
                return Ok(Outcome::refused(
                    "already_exists",
                    format!("a pool {name:?} exists in torpor with another spec and was not made by this object; it is left alone"),
                    RETRY_REFUSED,
                ));
            }
            status.managed = true;
        }
        if same {
            status.applied_digest = Some(want);
            return Ok(pool_outcome(name, &p, status));
        }
        if let Err(e) = client.delete_pool(name).await {
            if !is_not_found(&e) {
                return Ok(Outcome::from_torpor(
                    &format!("replacing pool {name} (delete)"),
                    &e,
                ));
            }
        }
        status.managed = false;
        status.applied_digest = None;
    }
    let json = serde_json::to_value(&body).unwrap_or_default();
    match client.create_pool(&json).await {
        Ok(p) => {
            status.managed = true;
            status.applied_digest = Some(want);
            Ok(pool_outcome(name, &p, status))
        }
        Err(e) => Ok(Outcome::from_torpor(&format!("creating pool {name}"), &e)),
    }
}

async fn cleanup_pool(
    api: &Api<WorkerPool>,
    obj: &WorkerPool,
    ctx: &Context,
) -> Result<Action, Error> {
    let name = pool_name(obj);
    if !obj.status.as_ref().is_some_and(|s| s.managed) {
        return Ok(Action::await_change());
    }
    let tenant = obj.spec.tenant.as_deref();
    let Some(client) = ctx.client_for(tenant).await? else {
        return tenant_gone_or(tenant.unwrap_or_default(), ctx).await;
    };
    match client.delete_pool(&name).await {
        Ok(()) => Ok(Action::await_change()),
        Err(e) if is_not_found(&e) => Ok(Action::await_change()),
        Err(e) => {
            let o = Outcome::from_torpor(&format!("deleting pool {name}"), &e);
            let mut status = obj.status.clone().unwrap_or_default();
            set_ready(&mut status.conditions, &o, obj.metadata.generation);
            patch_status(api, &obj.name_any(), &status).await?;
            Err(Error::Torpor(o))
        }
    }
}
