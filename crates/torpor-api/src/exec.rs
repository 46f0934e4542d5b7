//! `POST /v1/sandboxes/{id}/exec`: runs a command in a sandbox (waking it when it sleeps),
//! answered whole (JSON) or streamed as server-sent events (`stdout`, `stderr`, `exit`,
//! `error`).

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, State};
use axum::http::{header, HeaderMap};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use torpor_control::ExecEvent;
use torpor_core::TenantId;
use torpor_runtime::proto::ExecRequest;

use crate::body::{parse_json, RawBody};
use crate::errors::ApiResult;
use crate::params::sandbox_id;
use crate::state::ApiState;
use crate::types::ExecBody;

pub(crate) async fn exec(
    State(state): State<Arc<ApiState>>,
    Extension(tenant): Extension<TenantId>,
    Path(id): Path<String>,
    headers: HeaderMap,
    RawBody(body): RawBody,
) -> ApiResult<Response> {
    let id = sandbox_id(&id)?;
    let body: ExecBody = parse_json(&body)?;
    let stream = body.stream
        || headers
            .get(header::ACCEPT)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.contains("text/event-stream"));
    let stdin = body.stdin.unwrap_or_default().into_bytes();
    let req = ExecRequest {
        cmd: body.cmd,
        env: body.env,
        cwd: body.cwd,
        timeout_ms: body.timeout_ms,
        detach: body.detach,
        stream,
    };
    if !stream {
        let result = state.engine.exec(&tenant, &id, req, stdin).await?;
        return Ok(Json(result).into_response());
    }
    let mut rx = state.engine.exec_stream(&tenant, &id, req, stdin).await?;
    let events = async_stream(move |tx| async move {
        while let Some(ev) = rx.recv().await {
            let name = match &ev {
                ExecEvent::Stdout { .. } => "stdout",
                ExecEvent::Stderr { .. } => "stderr",
                ExecEvent::Exit(_) => "exit",
                ExecEvent::Error { .. } => "error",
            };
            let data = serde_json::to_string(&ev).expect("events serialise");
            if tx
                .send(Ok::<_, Infallible>(Event::default().event(name).data(data)))
                .await
                .is_err()
            {
                break;
            }
        }
    });
    Ok(Sse::new(events)
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
        .into_response())
}

/// A stream fed by a task through a bounded channel.
fn async_stream<T, F, Fut>(f: F) -> impl futures::Stream<Item = T>
where
    T: Send + 'static,
    F: FnOnce(tokio::sync::mpsc::Sender<T>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, mut rx) = tokio::sync::mpsc::channel(16);
    tokio::spawn(f(tx));
    futures::stream::poll_fn(move |cx| rx.poll_recv(cx))
}
