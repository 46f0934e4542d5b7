//! Client calls of the snapshot store routes (operator token).

use reqwest::Method;
use torpor_control::snapshots::{
    GcResult, SnapshotDetail, SnapshotStats, SnapshotSummary, VerifyResult,
};

use super::{Client, Result};

impl Client {
    pub async fn snapshots(&self) -> Result<Vec<SnapshotSummary>> {
        self.json(self.request(Method::GET, "/v1/snapshots")).await
    }

    pub async fn snapshot(&self, id: &str) -> Result<SnapshotDetail> {
        self.json(self.request(Method::GET, &format!("/v1/snapshots/{}", encode(id))))
            .await
    }

    /// Verifies one snapshot, or all when `id` is `None`.
    pub async fn verify_snapshots(&self, id: Option<&str>) -> Result<VerifyResult> {
        let path = match id {
            Some(id) => format!("/v1/snapshots/{}/verify", encode(id)),
            None => "/v1/snapshots/verify".to_string(),
        };
        self.json(self.request(Method::POST, &path)).await
    }

    pub async fn gc_snapshots(&self, dry_run: bool) -> Result<GcResult> {
        self.json(self.request(Method::POST, &format!("/v1/snapshots/gc?dry_run={dry_run}")))
            .await
    }

    pub async fn snapshot_stats(&self) -> Result<SnapshotStats> {
        self.json(self.request(Method::GET, "/v1/snapshots/stats"))
            .await
    }
}

/// Percent-encodes a path segment (ids are plain, but a typo must not change the route).
fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}
