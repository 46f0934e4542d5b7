//! `torpor pool create|ls|rm|status`: event-driven pools.

use std::path::PathBuf;

use clap::Subcommand;
use torpor_control::pools::PoolStatus;

use crate::common::{client, print_json, CliError, CliResult, Conn};

#[derive(Subcommand)]
#[allow(clippy::large_enum_variant)] // parsed once per process
pub enum PoolCmd {
    /// Create a pool from a JSON spec (`--file`, `-` for stdin) or from flags.
    Create {
        /// The pool spec as JSON (the body of POST /v1/pools); flags below override its fields.
        #[arg(long, short)]
        file: Option<PathBuf>,
        /// Pool name.
        #[arg(long)]
        name: Option<String>,
        #[arg(long)]
        template: Option<String>,
        #[arg(long)]
        min: Option<u32>,
        #[arg(long)]
        max: Option<u32>,
        /// Work (messages) per agent.
        #[arg(long)]
        target: Option<u64>,
        /// Active only while depth is strictly above this.
        #[arg(long)]
        activation: Option<u64>,
        #[arg(long)]
        cooldown_s: Option<u64>,
        #[arg(long)]
        poll_interval_ms: Option<u64>,
        /// Only poll; do not watch the broker for new work.
        #[arg(long)]
        no_push: bool,
        /// A trigger as JSON, e.g. '{"type":"redis-list","url":"redis://127.0.0.1:6379","key":"jobs"}'
        /// (repeatable; replaces the file's triggers).
        #[arg(long = "trigger")]
        triggers: Vec<String>,
        /// Dispatch mode: run this command in an agent with each message on stdin
        /// (everything after `--`).
        #[arg(last = true)]
        dispatch: Vec<String>,
        /// Dispatch mode over HTTP: POST each message to PORT[/PATH] of an agent
        /// (e.g. `8080/jobs`); a 2xx answer acknowledges it.
        #[arg(long, value_name = "PORT[/PATH]", conflicts_with = "dispatch")]
        dispatch_http: Option<String>,
        #[command(flatten)]
        conn: Conn,
    },
    /// List pools.
    Ls {
        #[command(flatten)]
        conn: Conn,
    },
    /// Show one pool: desired and running agents, depth, triggers, counters.
    Status {
        name: String,
        #[command(flatten)]
        conn: Conn,
    },
    /// Delete a pool (in-flight messages finish first) and its agents.
    Rm {
        name: String,
        #[command(flatten)]
        conn: Conn,
    },
}

pub async fn run(cmd: PoolCmd) -> CliResult {
    match cmd {
        PoolCmd::Create {
            file,
            name,
            template,
            min,
            max,
            target,
            activation,
            cooldown_s,
            poll_interval_ms,
            no_push,
            triggers,
            dispatch,
            dispatch_http,
            conn,
        } => {
            let mut spec = match &file {
                Some(p) => {
                    let text = if p.as_os_str() == "-" {
                        std::io::read_to_string(std::io::stdin())?
                    } else {
                        std::fs::read_to_string(p)
                            .map_err(|e| CliError(format!("cannot read {}: {e}", p.display())))?
                    };
                    serde_json::from_str::<serde_json::Value>(&text)
                        .map_err(|e| CliError(format!("{}: not JSON: {e}", p.display())))?
                }
                None => serde_json::json!({}),
            };
            let Some(obj) = spec.as_object_mut() else {
                return Err(CliError("the pool spec must be a JSON object".into()));
            };
            let mut set = |k: &str, v: Option<serde_json::Value>| {
                if let Some(v) = v {
                    obj.insert(k.into(), v);
                }
            };
            set("name", name.map(Into::into));
            set("template", template.map(Into::into));
            set("min", min.map(Into::into));
            set("max", max.map(Into::into));
            set("target", target.map(Into::into));
            set("activation", activation.map(Into::into));
            set("cooldown_s", cooldown_s.map(Into::into));
            set("poll_interval_ms", poll_interval_ms.map(Into::into));
            if no_push {
                set("push", Some(false.into()));
            }
            if !triggers.is_empty() {
                let parsed = triggers
                    .iter()
                    .enumerate()
                    .map(|(i, t)| {
                        serde_json::from_str::<serde_json::Value>(t)
                            .map_err(|e| CliError(format!("--trigger #{}: not JSON: {e}", i + 1)))
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                set("triggers", Some(parsed.into()));
            }
            if !dispatch.is_empty() {
                set("dispatch", Some(serde_json::json!({ "command": dispatch })));
            }
            if let Some(h) = dispatch_http {
                let (port, path) = match h.split_once('/') {
                    Some((port, path)) => (port, format!("/{path}")),
                    None => (h.as_str(), "/".to_string()),
                };
                let port: u16 = port.parse().map_err(|_| {
                    CliError(format!("--dispatch-http {h:?}: expected PORT[/PATH]"))
                })?;
                set(
                    "dispatch",
                    Some(serde_json::json!({ "http": {"port": port, "path": path} })),
                );
            }
            let status = client(&conn)?.create_pool(&spec).await?;
            if conn.json {
                print_json(&status);
            } else {
                println!("{}", status.name);
            }
            Ok(0)
        }
        PoolCmd::Ls { conn } => {
            let all = client(&conn)?.pools().await?;
            if conn.json {
                print_json(&all);
            } else {
                println!(
                    "{:<24} {:<16} {:<12} {:>7} {:>7} {:>8}  TRIGGERS",
                    "NAME", "TEMPLATE", "MODE", "DESIRED", "RUNNING", "DEPTH"
                );
                for p in &all {
                    println!(
                        "{:<24} {:<16} {:<12} {:>7} {:>7} {:>8}  {}",
                        p.name,
                        p.template,
                        p.mode,
                        p.desired,
                        p.running,
                        p.depth.map_or("-".into(), |d| d.to_string()),
                        trigger_summary(p)
                    );
                }
            }
            Ok(0)
        }
        PoolCmd::Status { name, conn } => {
            let p = client(&conn)?.pool(&name).await?;
            if conn.json {
                print_json(&p);
            } else {
                println!("pool      {} (template {}, {})", p.name, p.template, p.mode);
                println!(
                    "agents    desired {}, running {}, starting {}, draining {} (min {}, max {})",
                    p.desired, p.running, p.starting, p.draining, p.spec.min, p.spec.max
                );
                println!(
                    "depth     {}{}{}",
                    p.depth.map_or("-".into(), |d| d.to_string()),
                    if p.active { " (active)" } else { "" },
                    if p.fallback { " (fallback)" } else { "" }
                );
                println!(
                    "messages  in flight {}, processed {}, failed attempts {}, dead-lettered {}",
                    p.in_flight, p.processed, p.failed_attempts, p.dead_lettered
                );
                for (i, t) in p.triggers.iter().enumerate() {
                    match &t.error {
                        Some(e) => println!(
                            "trigger   [{i}] {}: error {} ({}), {} in a row",
                            t.kind, e.code, e.message, t.consecutive_errors
                        ),
                        None => println!(
                            "trigger   [{i}] {}: depth {}",
                            t.kind,
                            t.depth.map_or("-".into(), |d| d.to_string())
                        ),
                    }
                }
                if let Some(e) = &p.last_error {
                    println!("error     {e}");
                }
                for s in &p.sandboxes {
                    println!("sandbox   {s}");
                }
            }
            Ok(0)
        }
        PoolCmd::Rm { name, conn } => {
            client(&conn)?.delete_pool(&name).await?;
            if !conn.json {
                eprintln!("pool {name} deleted");
            }
            Ok(0)
        }
    }
}

fn trigger_summary(p: &PoolStatus) -> String {
    p.triggers
        .iter()
        .map(|t| match &t.error {
            Some(e) => format!("{}!{}", t.kind, e.code),
            None => t.kind.clone(),
        })
        .collect::<Vec<_>>()
        .join(",")
}
