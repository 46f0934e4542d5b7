//! GPU state an older torpor kept in JSON files beside the database: each sandbox's GPU request
//! (`gpu/requests/<id>.json`) and what its last checkpoint toggled with `cuda-checkpoint`
//! (`gpu/cuda-toggled/<id>.json`). At open each file is read, inserted into the store (unless
//! the store already has a record for that sandbox, which is newer) and removed; a file that
//! cannot be read is logged and left in place for the operator.

use std::io::Read as _;
use std::path::Path;

use serde::de::DeserializeOwned;
use torpor_core::SandboxId;

use super::{StateStore, StoreError};

/// Largest GPU state file read.
const MAX_FILE: u64 = 64 * 1024;

pub(super) const REQUESTS_DIR: &str = "gpu/requests";
pub(super) const TOGGLED_DIR: &str = "gpu/cuda-toggled";

/// Moves the GPU JSON files under `data_dir` into `store`.
pub(super) fn migrate(store: &dyn StateStore, data_dir: &Path) -> Result<(), StoreError> {
    migrate_dir(&data_dir.join(REQUESTS_DIR), "GPU request", |id, r| {
        if store.gpu_request(id)?.is_none() {
            store.put_gpu_request(id, &r)?;
        }
        Ok(())
    })?;
    migrate_dir(
        &data_dir.join(TOGGLED_DIR),
        "cuda-checkpoint record",
        |id, t| {
            if store.gpu_toggled(id)?.is_none() {
                store.put_gpu_toggled(id, &t)?;
            }
            Ok(())
        },
    )?;
    // Empty now (or holding only what could not be read, which stays).
    let _ = std::fs::remove_dir(data_dir.join(REQUESTS_DIR));
    let _ = std::fs::remove_dir(data_dir.join(TOGGLED_DIR));
    let _ = std::fs::remove_dir(data_dir.join("gpu"));
    Ok(())
}

fn migrate_dir<T: DeserializeOwned>(
    dir: &Path,
    what: &'static str,
    mut insert: impl FnMut(&SandboxId, T) -> Result<(), StoreError>,
) -> Result<(), StoreError> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Ok(());
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
            continue;
        };
        if name.ends_with(".json.tmp") {
            // A write that never completed: the older torpor never read these.
            let _ = std::fs::remove_file(&path);
            continue;
        }
        let Some(stem) = name.strip_suffix(".json") else {
            continue;
        };
        let parsed = SandboxId::new(stem)
            .map_err(|e| e.to_string())
            .and_then(|id| read_json::<T>(&path).map(|v| (id, v)));
        match parsed {
            Ok((id, value)) => {
                insert(&id, value)?;
                if let Err(e) = std::fs::remove_file(&path) {
                    tracing::warn!(path = %path.display(), error = %e, "cannot remove a migrated {what} file");
                }
                tracing::info!(sandbox = %id, "{what} moved from its file into the state store");
            }
            Err(error) => {
                tracing::error!(path = %path.display(), %error, "unreadable {what} file; left in place")
            }
        }
    }
    Ok(())
}

fn read_json<T: DeserializeOwned>(path: &Path) -> Result<T, String> {
    let file = std::fs::File::open(path).map_err(|e| e.to_string())?;
    let mut text = Vec::new();
    file.take(MAX_FILE)
        .read_to_end(&mut text)
        .map_err(|e| e.to_string())?;
    serde_json::from_slice(&text).map_err(|e| e.to_string())
}
