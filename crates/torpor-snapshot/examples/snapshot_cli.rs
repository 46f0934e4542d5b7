//! A thin operator tool over the library until `torpor snapshot ...` exists in the binary.
//!
//! ```text
//! snapshot_cli --store DIR <command>                     local store
//! snapshot_cli --s3 BUCKET [--endpoint URL] <command>    S3 (keys from AWS_ACCESS_KEY_ID /
//!                                                        AWS_SECRET_ACCESS_KEY, region from
//!                                                        AWS_REGION, default us-east-1)
//! commands: ls | inspect ID | verify ID | stats [--json] | gc [--keep-last N] [--dry-run]
//!           | put DIR [--parent ID] [--label K=V]... | get ID DEST | fork ID -n N | pin ID
//! ```
//!
//! Errors print their stable code and exit with status 1.

use std::path::Path;
use std::sync::Arc;

use torpor_snapshot::manifest::{ExtentData, FileKind};
use torpor_snapshot::{
    GcOptions, LocalBackend, PutOptions, S3Backend, S3Config, SnapshotId, Store, StoreConfig,
    StoreError,
};

#[derive(Debug)]
enum CliError {
    Usage(String),
    Store(StoreError),
}

impl From<StoreError> for CliError {
    fn from(e: StoreError) -> Self {
        CliError::Store(e)
    }
}

fn id(s: Option<&String>) -> Result<SnapshotId, CliError> {
    let s = s.ok_or_else(|| CliError::Usage("missing snapshot id".into()))?;
    SnapshotId::new(s.as_str()).map_err(|e| CliError::Usage(format!("{s:?}: {e}")))
}

fn flag_value<'a>(args: &'a [String], name: &str) -> Option<&'a String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
}

async fn run(args: Vec<String>) -> Result<(), CliError> {
    let backend: Arc<dyn torpor_snapshot::Backend> = if let Some(dir) = flag_value(&args, "--store")
    {
        Arc::new(LocalBackend::open(dir).map_err(StoreError::from)?)
    } else if let Some(bucket) = flag_value(&args, "--s3") {
        let cfg = S3Config {
            endpoint: flag_value(&args, "--endpoint").cloned(),
            allow_http: flag_value(&args, "--endpoint").is_some_and(|e| e.starts_with("http:")),
            access_key_id: std::env::var("AWS_ACCESS_KEY_ID").unwrap_or_default(),
            secret_access_key: std::env::var("AWS_SECRET_ACCESS_KEY").unwrap_or_default(),
            region: std::env::var("AWS_REGION").unwrap_or_else(|_| "us-east-1".into()),
            ..S3Config::new(bucket)
        };
        Arc::new(S3Backend::new(&cfg).map_err(StoreError::from)?)
    } else {
        return Err(CliError::Usage("give --store DIR or --s3 BUCKET".into()));
    };
    let store = Store::new(backend, StoreConfig::default())?;
    let skip = |a: &String| a.starts_with("--") || a.starts_with('-');
    // Positional words: skip flags and their values.
    let mut words = Vec::new();
    let mut i = 1;
    while i < args.len() {
        if skip(&args[i]) {
            i += if matches!(args[i].as_str(), "--json" | "--dry-run") {
                1
            } else {
                2
            };
        } else {
            words.push(args[i].clone());
            i += 1;
        }
    }
    match words.first().map(String::as_str) {
        Some("ls") => {
            let mut ids = store.list_snapshots().await?;
            ids.sort();
            for id in ids {
                let m = store.load_manifest(&id).await?;
                let parent = m
                    .parent
                    .as_ref()
                    .map(|p| p.to_string())
                    .unwrap_or_else(|| "-".into());
                println!(
                    "{id}\t{}\tparent={parent}\tbytes={}",
                    m.created_unix_ms,
                    m.logical_bytes()
                );
            }
        }
        Some("inspect") => {
            let m = store.load_manifest(&id(words.get(1))?).await?;
            println!(
                "id: {}\nparent: {:?}\ncreated_unix_ms: {}\nlabels: {:?}",
                m.id, m.parent, m.created_unix_ms, m.labels
            );
            for f in &m.files {
                match &f.kind {
                    FileKind::Dir => println!("dir     {:o} {}", f.mode, f.path),
                    FileKind::Symlink { target } => println!("symlink {} -> {target}", f.path),
                    FileKind::Content {
                        size,
                        image,
                        extents,
                    } => {
                        let chunks = extents
                            .iter()
                            .filter(|e| matches!(e.data, ExtentData::Chunk(_)))
                            .count();
                        let kind = if image.is_some() {
                            "gvisor "
                        } else {
                            "file   "
                        };
                        println!(
                            "{kind} {:o} {} size={size} chunks={chunks} extents={}",
                            f.mode,
                            f.path,
                            extents.len()
                        );
                    }
                }
            }
        }
        Some("verify") => {
            let r = store.verify(&id(words.get(1))?).await?;
            println!(
                "{} chunks checked, {} problems",
                r.chunks_checked,
                r.problems.len()
            );
            for p in &r.problems {
                println!("{}: {p}", p.code());
            }
            if !r.problems.is_empty() {
                std::process::exit(1);
            }
        }
        Some("stats") => {
            let s = store.stats().await?;
            if args.iter().any(|a| a == "--json") {
                println!("{}", s.to_json());
            } else {
                println!(
                    "snapshots {}\nchunks {}\nlogical_bytes {}\nstored_bytes {}",
                    s.snapshots, s.chunks, s.logical_bytes, s.stored_bytes
                );
            }
        }
        Some("gc") => {
            let keep = flag_value(&args, "--keep-last")
                .map(|v| {
                    v.parse()
                        .map_err(|_| CliError::Usage("--keep-last takes a number".into()))
                })
                .transpose()?;
            let r = store
                .gc(&GcOptions {
                    keep_last_per_sandbox: keep,
                    dry_run: args.iter().any(|a| a == "--dry-run"),
                    ..Default::default()
                })
                .await?;
            println!("{r:?}");
        }
        Some("put") => {
            let dir = words
                .get(1)
                .ok_or_else(|| CliError::Usage("put DIR".into()))?;
            let parent = flag_value(&args, "--parent")
                .map(|p| id(Some(p)))
                .transpose()?;
            let labels = args
                .iter()
                .enumerate()
                .filter(|(_, a)| *a == "--label")
                .filter_map(|(i, _)| args.get(i + 1))
                .filter_map(|kv| {
                    kv.split_once('=')
                        .map(|(k, v)| (k.to_string(), v.to_string()))
                })
                .collect();
            let r = store
                .put_dir_with(
                    Path::new(dir),
                    PutOptions {
                        parent,
                        labels,
                        id: None,
                    },
                )
                .await?;
            println!("{}\n{:?}", r.id, r.stats);
        }
        Some("get") => {
            let dest = words
                .get(2)
                .ok_or_else(|| CliError::Usage("get ID DEST".into()))?;
            let s = store.get_dir(&id(words.get(1))?, Path::new(dest)).await?;
            println!("{s:?}");
        }
        Some("fork") => {
            let n = flag_value(&args, "-n")
                .and_then(|v| v.parse().ok())
                .unwrap_or(1);
            for f in store.fork(&id(words.get(1))?, n).await? {
                println!("{f}");
            }
        }
        Some("pin") => store.pin(&id(words.get(1))?).await?,
        other => return Err(CliError::Usage(format!("unknown command {other:?}"))),
    }
    Ok(())
}

#[tokio::main]
async fn main() {
    match run(std::env::args().collect()).await {
        Ok(()) => {}
        Err(CliError::Usage(m)) => {
            eprintln!("usage error: {m}");
            std::process::exit(2);
        }
        Err(CliError::Store(e)) => {
            let mut msg = e.to_string();
            let mut src = std::error::Error::source(&e);
            while let Some(s) = src {
                msg.push_str(&format!(": {s}"));
                src = s.source();
            }
            eprintln!("error [{}]: {msg}", e.code());
            std::process::exit(1);
        }
    }
}
