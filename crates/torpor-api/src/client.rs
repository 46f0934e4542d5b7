//! The Rust client of API v1, built on the same types as the server.

use std::time::Duration;

use futures::StreamExt;
use reqwest::Method;
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::types::{
    CreateSandboxBody, CreateTenantBody, ErrorBody, ExecBody, ExecEvent, ExecResult, FileEntry,
    Health, Sandbox, SuspendBody, Template, TemplateSpec, Tenant, TenantCreated,
};

mod snapshots;

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The server answered with an error in the API's shape.
    #[error("{message} ({code}, HTTP {status})")]
    Api {
        status: u16,
        code: String,
        message: String,
        details: Option<serde_json::Value>,
    },
    #[error("cannot reach torpor at {url}: {source}")]
    Connect {
        url: String,
        #[source]
        source: reqwest::Error,
    },
    #[error("unexpected answer from torpor (HTTP {status}): {body}")]
    Unexpected { status: u16, body: String },
    /// A local file the call sends (an upload) cannot be read.
    #[error("cannot read {path}")]
    LocalFile {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// What an uploaded archive holds (`?kind=` of `POST /v1/templates/{name}/image`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UploadKind {
    /// An OCI layout or archive, or a `docker save` tarball.
    Image,
    /// A tarball of a root filesystem.
    Rootfs,
}

impl UploadKind {
    pub fn as_str(self) -> &'static str {
        match self {
            UploadKind::Image => "image",
            UploadKind::Rootfs => "rootfs",
        }
    }
}

/// How much of an uploaded file is read at a time.
const UPLOAD_CHUNK: usize = 256 << 10;

impl ClientError {
    /// The API error code, if the server sent one.
    pub fn code(&self) -> Option<&str> {
        match self {
            ClientError::Api { code, .. } => Some(code),
            _ => None,
        }
    }
}

#[derive(Clone)]
pub struct Client {
    base: String,
    token: String,
    http: reqwest::Client,
}

type Result<T> = std::result::Result<T, ClientError>;

/// How long an idle connection is kept for reuse: well under the server's idle close (10 s by
/// default, `--header-read-timeout-ms`), so a request is never sent on a connection the server
/// is closing at that moment (a "cannot reach torpor ... error sending request" under load).
pub const POOL_IDLE: Duration = Duration::from_secs(4);

impl Client {
    pub fn new(base_url: &str, token: &str) -> Self {
        Client {
            base: base_url.trim_end_matches('/').to_string(),
            token: token.to_string(),
            http: reqwest::Client::builder()
                .pool_idle_timeout(POOL_IDLE)
                .build()
                .expect("HTTP client builds"),
        }
    }

    pub fn base_url(&self) -> &str {
        &self.base
    }

    fn request(&self, method: Method, path: &str) -> reqwest::RequestBuilder {
        self.http
            .request(method, format!("{}{}", self.base, path))
            .bearer_auth(&self.token)
    }

    async fn send(&self, rb: reqwest::RequestBuilder) -> Result<reqwest::Response> {
        let resp = rb.send().await.map_err(|e| ClientError::Connect {
            url: self.base.clone(),
            source: e,
        })?;
        if resp.status().is_success() {
            return Ok(resp);
        }
        let status = resp.status().as_u16();
        let text = resp.text().await.unwrap_or_default();
        match serde_json::from_str::<ErrorBody>(&text) {
            Ok(e) => Err(ClientError::Api {
                status,
                code: e.error.code,
                message: e.error.message,
                details: e.error.details,
            }),
            Err(_) => Err(ClientError::Unexpected { status, body: text }),
        }
    }

    async fn json<T: DeserializeOwned>(&self, rb: reqwest::RequestBuilder) -> Result<T> {
        let resp = self.send(rb).await?;
        let status = resp.status().as_u16();
        let bytes = resp.bytes().await.map_err(|e| ClientError::Connect {
            url: self.base.clone(),
            source: e,
        })?;
        serde_json::from_slice(&bytes).map_err(|_| ClientError::Unexpected {
            status,
            body: String::from_utf8_lossy(&bytes).chars().take(500).collect(),
        })
    }

    async fn json_body<B: Serialize, T: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        body: &B,
    ) -> Result<T> {
        self.json(self.request(method, path).json(body)).await
    }

    pub async fn health(&self) -> Result<Health> {
        self.json(self.http.get(format!("{}/healthz", self.base)))
            .await
    }

    /// `GET /metrics`, with this client's token (the admin or the metrics token).
    pub async fn metrics(&self) -> Result<String> {
        let resp = self
            .send(
                self.http
                    .get(format!("{}/metrics", self.base))
                    .bearer_auth(&self.token),
            )
            .await?;
        resp.text().await.map_err(|e| ClientError::Connect {
            url: self.base.clone(),
            source: e,
        })
    }

    /// `GET /v1/usage` with `query` (`?tenant=..&from=..`, already encoded, or empty).
    pub async fn usage(&self, query: &str) -> Result<torpor_control::usage::UsageReport> {
        self.json(self.request(Method::GET, &format!("/v1/usage{query}")))
            .await
    }

    pub async fn workers(&self) -> Result<torpor_control::WorkerStats> {
        self.json(self.request(Method::GET, "/v1/workers")).await
    }

    /// `GET /v1/gpus`: the node's GPUs and the caller's GPU shares (`GpuStatus` in the
    /// OpenAPI document).
    pub async fn gpus(&self) -> Result<serde_json::Value> {
        self.json(self.request(Method::GET, "/v1/gpus")).await
    }

    pub async fn create_tenant(&self, body: &CreateTenantBody) -> Result<TenantCreated> {
        self.json_body(Method::POST, "/v1/tenants", body).await
    }

    pub async fn tenants(&self) -> Result<Vec<Tenant>> {
        self.json(self.request(Method::GET, "/v1/tenants")).await
    }

    pub async fn delete_tenant(&self, name: &str) -> Result<()> {
        self.send(self.request(Method::DELETE, &format!("/v1/tenants/{name}")))
            .await
            .map(|_| ())
    }

    pub async fn create_template(&self, spec: &TemplateSpec) -> Result<Template> {
        self.json_body(Method::POST, "/v1/templates", spec).await
    }

    /// `POST /v1/templates/{name}/image`: registers a template from an archive on this machine,
    /// streamed (never read into memory) as the `image` part of a multipart body, after a `spec`
    /// part holding the template's other fields (`command`, `env`, `limits`, ...; no `name` or
    /// `source`). `kind`: the archive is an image (OCI layout/archive or `docker save`) or a
    /// root-filesystem tarball; `reference` picks an image of a multi-image archive.
    pub async fn upload_template_image(
        &self,
        name: &str,
        spec_json: &serde_json::Value,
        file_path: &std::path::Path,
        kind: UploadKind,
        reference: Option<&str>,
    ) -> Result<Template> {
        let local = |source: std::io::Error| ClientError::LocalFile {
            path: file_path.to_path_buf(),
            source,
        };
        let file = tokio::fs::File::open(file_path).await.map_err(local)?;
        let len = file.metadata().await.map_err(local)?.len();
        let chunks = futures::stream::try_unfold(file, |mut f| async move {
            use tokio::io::AsyncReadExt;
            let mut buf = vec![0u8; UPLOAD_CHUNK];
            let n = f.read(&mut buf).await?;
            if n == 0 {
                return Ok::<_, std::io::Error>(None);
            }
            buf.truncate(n);
            Ok(Some((bytes::Bytes::from(buf), f)))
        });
        let file_name = file_path
            .file_name()
            .map_or_else(|| "image".into(), |n| n.to_string_lossy().into_owned());
        let spec = reqwest::multipart::Part::text(spec_json.to_string())
            .mime_str("application/json")
            .expect("a valid MIME type");
        let image =
            reqwest::multipart::Part::stream_with_length(reqwest::Body::wrap_stream(chunks), len)
                .file_name(file_name)
                .mime_str("application/octet-stream")
                .expect("a valid MIME type");
        let form = reqwest::multipart::Form::new()
            .part("spec", spec)
            .part("image", image);
        let mut query = vec![("kind", kind.as_str())];
        if let Some(r) = reference {
            query.push(("reference", r));
        }
        self.json(
            self.request(Method::POST, &format!("/v1/templates/{name}/image"))
                .query(&query)
                .multipart(form),
        )
        .await
    }

    pub async fn templates(&self) -> Result<Vec<Template>> {
        self.json(self.request(Method::GET, "/v1/templates")).await
    }

    pub async fn template(&self, name: &str) -> Result<Template> {
        self.json(self.request(Method::GET, &format!("/v1/templates/{name}")))
            .await
    }

    pub async fn delete_template(&self, name: &str) -> Result<()> {
        self.send(self.request(Method::DELETE, &format!("/v1/templates/{name}")))
            .await
            .map(|_| ())
    }

    pub async fn create_sandbox(&self, body: &CreateSandboxBody) -> Result<Sandbox> {
        self.json_body(Method::POST, "/v1/sandboxes", body).await
    }

    /// Every sandbox the caller sees (of state or tier `state` when given), following the
    /// pages of `GET /v1/sandboxes` to the last.
    pub async fn sandboxes(&self, state: Option<&str>) -> Result<Vec<Sandbox>> {
        let mut all = Vec::new();
        let mut cursor = None;
        loop {
            let (page, next) = self.sandboxes_page(state, None, cursor.as_deref()).await?;
            all.extend(page);
            match next {
                Some(n) => cursor = Some(n),
                None => return Ok(all),
            }
        }
    }

    /// One page of `GET /v1/sandboxes` (`limit`: the server's default when `None`; `cursor`:
    /// the previous page's) and the next page's cursor (`None` on the last page).
    pub async fn sandboxes_page(
        &self,
        state: Option<&str>,
        limit: Option<usize>,
        cursor: Option<&str>,
    ) -> Result<(Vec<Sandbox>, Option<String>)> {
        let mut query: Vec<(&str, String)> = Vec::new();
        if let Some(s) = state {
            query.push(("state", s.to_string()));
        }
        if let Some(l) = limit {
            query.push(("limit", l.to_string()));
        }
        if let Some(c) = cursor {
            query.push(("cursor", c.to_string()));
        }
        let resp = self
            .send(self.request(Method::GET, "/v1/sandboxes").query(&query))
            .await?;
        let next = resp
            .headers()
            .get(crate::sandboxes::NEXT_CURSOR)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        let status = resp.status().as_u16();
        let bytes = resp.bytes().await.map_err(|e| ClientError::Connect {
            url: self.base.clone(),
            source: e,
        })?;
        let page = serde_json::from_slice(&bytes).map_err(|_| ClientError::Unexpected {
            status,
            body: String::from_utf8_lossy(&bytes).chars().take(500).collect(),
        })?;
        Ok((page, next))
    }

    pub async fn sandbox(&self, id: &str) -> Result<Sandbox> {
        self.json(self.request(Method::GET, &format!("/v1/sandboxes/{id}")))
            .await
    }

    pub async fn delete_sandbox(&self, id: &str) -> Result<()> {
        self.send(self.request(Method::DELETE, &format!("/v1/sandboxes/{id}")))
            .await
            .map(|_| ())
    }

    pub async fn exec(&self, id: &str, body: &ExecBody) -> Result<ExecResult> {
        self.json_body(Method::POST, &format!("/v1/sandboxes/{id}/exec"), body)
            .await
    }

    /// Runs a command and calls `on_event` for each event as it arrives; returns the exit.
    pub async fn exec_stream(
        &self,
        id: &str,
        body: &ExecBody,
        mut on_event: impl FnMut(&ExecEvent),
    ) -> Result<ExecResult> {
        let mut body = body.clone();
        body.stream = true;
        let resp = self
            .send(
                self.request(Method::POST, &format!("/v1/sandboxes/{id}/exec"))
                    .json(&body),
            )
            .await?;
        let mut stream = resp.bytes_stream();
        let mut buf = String::new();
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| ClientError::Connect {
                url: self.base.clone(),
                source: e,
            })?;
            buf.push_str(&String::from_utf8_lossy(&chunk));
            while let Some(end) = buf.find("\n\n") {
                let block: String = buf.drain(..end + 2).collect();
                let data: String = block
                    .lines()
                    .filter_map(|l| l.strip_prefix("data:"))
                    .map(str::trim_start)
                    .collect::<Vec<_>>()
                    .join("\n");
                if data.is_empty() {
                    continue;
                }
                let Ok(ev) = serde_json::from_str::<ExecEvent>(&data) else {
                    continue;
                };
                on_event(&ev);
                match ev {
                    ExecEvent::Exit(r) => return Ok(r),
                    ExecEvent::Error { code, message } => {
                        return Err(ClientError::Api {
                            status: 200,
                            code,
                            message,
                            details: None,
                        })
                    }
                    _ => {}
                }
            }
        }
        Err(ClientError::Unexpected {
            status: 200,
            body: "the event stream ended without an exit event".into(),
        })
    }

    pub async fn read_file(&self, id: &str, path: &str) -> Result<Vec<u8>> {
        let resp = self
            .send(
                self.request(Method::GET, &format!("/v1/sandboxes/{id}/files"))
                    .query(&[("path", path)]),
            )
            .await?;
        resp.bytes()
            .await
            .map(|b| b.to_vec())
            .map_err(|e| ClientError::Connect {
                url: self.base.clone(),
                source: e,
            })
    }

    pub async fn write_file(
        &self,
        id: &str,
        path: &str,
        data: Vec<u8>,
        mode: Option<u32>,
    ) -> Result<()> {
        let mut q = vec![("path", path.to_string())];
        if let Some(m) = mode {
            q.push(("mode", format!("{m:o}")));
        }
        self.send(
            self.request(Method::PUT, &format!("/v1/sandboxes/{id}/files"))
                .query(&q)
                .body(data),
        )
        .await
        .map(|_| ())
    }

    pub async fn list_files(&self, id: &str, path: &str) -> Result<Vec<FileEntry>> {
        self.json(
            self.request(Method::GET, &format!("/v1/sandboxes/{id}/files"))
                .query(&[("path", path), ("list", "true")]),
        )
        .await
    }

    pub async fn remove_file(&self, id: &str, path: &str, recursive: bool) -> Result<()> {
        self.send(
            self.request(Method::DELETE, &format!("/v1/sandboxes/{id}/files"))
                .query(&[
                    ("path", path),
                    ("recursive", if recursive { "true" } else { "false" }),
                ]),
        )
        .await
        .map(|_| ())
    }

    pub async fn suspend(&self, id: &str, tier: Option<torpor_core::Tier>) -> Result<Sandbox> {
        self.json_body(
            Method::POST,
            &format!("/v1/sandboxes/{id}/suspend"),
            &SuspendBody { tier, cause: None },
        )
        .await
    }

    pub async fn fork(&self, id: &str, count: usize) -> Result<Vec<Sandbox>> {
        self.json_body(
            Method::POST,
            &format!("/v1/sandboxes/{id}/fork"),
            &crate::types::ForkBody { count: Some(count) },
        )
        .await
    }

    /// Changes a networked sandbox's egress policy (applied at once when it runs).
    pub async fn set_network(
        &self,
        id: &str,
        network: &torpor_core::NetworkPolicy,
    ) -> Result<crate::proxy::SandboxNetwork> {
        self.json_body(
            Method::PATCH,
            &format!("/v1/sandboxes/{id}"),
            &crate::proxy::SandboxPatch {
                network: network.clone(),
            },
        )
        .await
    }

    /// A sandbox's network policy and, while resident, its address.
    pub async fn network(&self, id: &str) -> Result<crate::proxy::SandboxNetwork> {
        self.json(self.request(Method::GET, &format!("/v1/sandboxes/{id}/network")))
            .await
    }

    pub async fn resume(&self, id: &str) -> Result<Sandbox> {
        self.json(self.request(Method::POST, &format!("/v1/sandboxes/{id}/resume")))
            .await
    }

    /// Whether the server answers at all.
    /// `POST /v1/pools`; the body is a pool spec (kept as JSON so the CLI can pass a file as is).
    pub async fn create_pool(
        &self,
        spec: &serde_json::Value,
    ) -> Result<torpor_control::pools::PoolStatus> {
        self.json_body(Method::POST, "/v1/pools", spec).await
    }

    pub async fn pools(&self) -> Result<Vec<torpor_control::pools::PoolStatus>> {
        self.json(self.request(Method::GET, "/v1/pools")).await
    }

    pub async fn pool(&self, name: &str) -> Result<torpor_control::pools::PoolStatus> {
        self.json(self.request(Method::GET, &format!("/v1/pools/{name}")))
            .await
    }

    pub async fn delete_pool(&self, name: &str) -> Result<()> {
        self.send(self.request(Method::DELETE, &format!("/v1/pools/{name}")))
            .await
            .map(|_| ())
    }

    pub async fn is_up(&self) -> bool {
        self.health().await.is_ok()
    }
}
