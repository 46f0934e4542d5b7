//! A backend on S3-compatible object storage through the `object_store` crate. Retries with
//! exponential backoff are object_store's; this module bounds them and turns the final failure
//! into a [`BackendError::Remote`] naming the key.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use object_store::aws::AmazonS3Builder;
use object_store::path::Path;
use object_store::{BackoffConfig, ClientOptions, ObjectStore, PutPayload, RetryConfig};

use super::{Backend, BackendError, ObjectInfo, ObjectKey};

/// How to reach the bucket. `endpoint` is for S3-compatible servers (MinIO, moto, Ceph...);
/// leave it `None` for AWS.
#[derive(Debug, Clone)]
pub struct S3Config {
    pub bucket: String,
    pub region: String,
    pub endpoint: Option<String>,
    pub access_key_id: String,
    pub secret_access_key: String,
    /// Prefix inside the bucket, so several stores can share one bucket.
    pub prefix: Option<String>,
    pub allow_http: bool,
    pub max_retries: usize,
    /// Total time one request may spend retrying.
    pub retry_timeout: Duration,
    pub request_timeout: Duration,
    /// Parallel HEAD requests per existence batch.
    pub head_parallelism: usize,
}

impl S3Config {
    pub fn new(bucket: impl Into<String>) -> Self {
        S3Config {
            bucket: bucket.into(),
            region: "us-east-1".into(),
            endpoint: None,
            access_key_id: String::new(),
            secret_access_key: String::new(),
            prefix: None,
            allow_http: false,
            max_retries: 5,
            retry_timeout: Duration::from_secs(60),
            request_timeout: Duration::from_secs(30),
            head_parallelism: 32,
        }
    }
}

#[derive(Debug, Clone)]
pub struct S3Backend {
    store: Arc<dyn ObjectStore>,
    prefix: Option<String>,
    head_parallelism: usize,
}

impl S3Backend {
    pub fn new(cfg: &S3Config) -> Result<Self, BackendError> {
        let mut b = AmazonS3Builder::new()
            .with_bucket_name(&cfg.bucket)
            .with_region(&cfg.region)
            .with_access_key_id(&cfg.access_key_id)
            .with_secret_access_key(&cfg.secret_access_key)
            .with_allow_http(cfg.allow_http)
            .with_retry(RetryConfig {
                backoff: BackoffConfig {
                    init_backoff: Duration::from_millis(100),
                    max_backoff: Duration::from_secs(5),
                    base: 2.0,
                },
                max_retries: cfg.max_retries,
                retry_timeout: cfg.retry_timeout,
            })
            .with_client_options(
                ClientOptions::new()
                    .with_allow_http(cfg.allow_http)
                    .with_timeout(cfg.request_timeout)
                    .with_connect_timeout(Duration::from_secs(5)),
            );
        if let Some(ep) = &cfg.endpoint {
            b = b.with_endpoint(ep).with_virtual_hosted_style_request(false);
        }
        let store = b.build().map_err(BackendError::Config)?;
        Ok(S3Backend {
            store: Arc::new(store),
            prefix: cfg
                .prefix
                .as_ref()
                .map(|p| p.trim_matches('/').to_string())
                .filter(|p| !p.is_empty()),
            head_parallelism: cfg.head_parallelism.max(1),
        })
    }

    fn path(&self, key: &str) -> Path {
        match &self.prefix {
            Some(p) => Path::from(format!("{p}/{key}")),
            None => Path::from(key),
        }
    }

    fn remote(key: &str, source: object_store::Error) -> BackendError {
        BackendError::Remote {
            key: key.to_string(),
            source,
        }
    }
}

#[async_trait]
impl Backend for S3Backend {
    async fn put(&self, key: &ObjectKey, data: Bytes) -> Result<(), BackendError> {
        self.store
            .put(&self.path(key.as_str()), PutPayload::from(data))
            .await
            .map(|_| ())
            .map_err(|e| Self::remote(key.as_str(), e))
    }

    async fn get(&self, key: &ObjectKey) -> Result<Option<Bytes>, BackendError> {
        let path = self.path(key.as_str());
        match self.store.get(&path).await {
            Ok(r) => r
                .bytes()
                .await
                .map(Some)
                .map_err(|e| Self::remote(key.as_str(), e)),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(Self::remote(key.as_str(), e)),
        }
    }

    async fn get_ranges(
        &self,
        key: &ObjectKey,
        ranges: &[std::ops::Range<u64>],
    ) -> Result<Option<Vec<Bytes>>, BackendError> {
        // object_store merges ranges less than 1 MiB apart into one request.
        match self
            .store
            .get_ranges(&self.path(key.as_str()), ranges)
            .await
        {
            Ok(parts) => Ok(Some(parts)),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(Self::remote(key.as_str(), e)),
        }
    }

    async fn exists_many(&self, keys: &[ObjectKey]) -> Result<Vec<bool>, BackendError> {
        let requests: Vec<_> = keys
            .iter()
            .map(|k| {
                let store = Arc::clone(&self.store);
                let path = self.path(k.as_str());
                let key = k.as_str().to_string();
                async move {
                    match store.head(&path).await {
                        Ok(_) => Ok(true),
                        Err(object_store::Error::NotFound { .. }) => Ok(false),
                        Err(e) => Err(Self::remote(&key, e)),
                    }
                }
            })
            .collect();
        futures::stream::iter(requests)
            .buffered(self.head_parallelism)
            .try_collect()
            .await
    }

    async fn delete(&self, key: &ObjectKey) -> Result<(), BackendError> {
        match self.store.delete(&self.path(key.as_str())).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(Self::remote(key.as_str(), e)),
        }
    }

    async fn list(&self, prefix: &str) -> Result<Vec<ObjectInfo>, BackendError> {
        let prefix_key = ObjectKey::new(prefix)?;
        let full = self.path(prefix_key.as_str());
        let strip = self.prefix.as_ref().map(|p| format!("{p}/"));
        let metas: Vec<_> = self
            .store
            .list(Some(&full))
            .try_collect()
            .await
            .map_err(|e| Self::remote(prefix, e))?;
        let mut out = Vec::with_capacity(metas.len());
        for m in metas {
            let loc = m.location.as_ref();
            let rel = match &strip {
                Some(s) => loc.strip_prefix(s.as_str()).unwrap_or(loc),
                None => loc,
            };
            if let Ok(key) = ObjectKey::new(rel) {
                out.push(ObjectInfo {
                    key,
                    size: m.size,
                    modified: Some(SystemTime::from(m.last_modified)),
                });
            }
        }
        out.sort_by(|a, b| a.key.cmp(&b.key));
        Ok(out)
    }
}
