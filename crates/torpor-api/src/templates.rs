//! Routes of `/v1/templates`: register (build) a template from a spec, list, inspect and
//! delete a tenant's templates. Uploaded images are crate::uploads.

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::{Extension, Json};
use torpor_core::{TemplateSpec, TenantId};

use crate::body::{parse_json, RawBody};
use crate::errors::ApiResult;
use crate::params::template_name;
use crate::state::ApiState;
use crate::types::Template;

pub(crate) async fn create_template(
    State(state): State<Arc<ApiState>>,
    Extension(tenant): Extension<TenantId>,
    RawBody(body): RawBody,
) -> ApiResult<(StatusCode, Json<Template>)> {
    let spec: TemplateSpec = parse_json(&body)?;
    let rec = state
        .engine
        .register_template(&tenant, spec, &|step| {
            tracing::info!(step, "template build")
        })
        .await?;
    Ok((StatusCode::CREATED, Json(Template::from(&rec))))
}

pub(crate) async fn list_templates(
    State(state): State<Arc<ApiState>>,
    Extension(tenant): Extension<TenantId>,
) -> ApiResult<Json<Vec<Template>>> {
    let all = state.engine.templates(&tenant)?;
    Ok(Json(all.iter().map(Template::from).collect()))
}

pub(crate) async fn get_template(
    State(state): State<Arc<ApiState>>,
    Extension(tenant): Extension<TenantId>,
    Path(name): Path<String>,
) -> ApiResult<Json<Template>> {
    let t = state.engine.template(&tenant, &template_name(&name)?)?;
    Ok(Json(Template::from(&t)))
}

pub(crate) async fn delete_template(
    State(state): State<Arc<ApiState>>,
    Extension(tenant): Extension<TenantId>,
    Path(name): Path<String>,
) -> ApiResult<StatusCode> {
    state
        .engine
        .delete_template(&tenant, &template_name(&name)?)
        .await?;
    Ok(StatusCode::NO_CONTENT)
}
