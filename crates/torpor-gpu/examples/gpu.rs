//! What `torpor gpu ls` and `torpor gpu plan` will do, runnable before the binary wires them:
//!
//! ```text
//! cargo run --example gpu -- ls --inventory FILE
//! cargo run --example gpu -- plan --inventory FILE --requests FILE.jsonl [--policy binpack|spread] [--json]
//! ```
//!
//! Argument parsing only; the work is `torpor_gpu::report`.

use std::path::PathBuf;
use std::process::ExitCode;

use torpor_gpu::inventory::Inventory;
use torpor_gpu::ledger::Ledger;
use torpor_gpu::planner::{Policy, Strategy};
use torpor_gpu::quota::QuotaBook;
use torpor_gpu::report::{inventory_table, plan_lines};

const USAGE: &str = "usage: gpu ls --inventory FILE\n       gpu plan --inventory FILE --requests FILE.jsonl [--policy binpack|spread] [--json]";

fn run(args: &[String]) -> Result<(), String> {
    let command = args.first().ok_or(USAGE)?;
    let mut inventory = None;
    let mut requests = None;
    let mut policy = Policy::default();
    let mut json = false;
    let mut rest = args[1..].iter();
    while let Some(flag) = rest.next() {
        match flag.as_str() {
            "--inventory" => inventory = rest.next().map(PathBuf::from),
            "--requests" => requests = rest.next().map(PathBuf::from),
            "--policy" => {
                let value = rest.next().ok_or("--policy needs a value")?;
                policy.strategy = value.parse::<Strategy>()?;
            }
            "--json" => json = true,
            other => return Err(format!("unknown argument {other:?}\n{USAGE}")),
        }
    }
    let inventory = inventory.ok_or(format!("--inventory is required\n{USAGE}"))?;
    let inventory = Inventory::load(&inventory).map_err(|e| e.to_string())?;
    let mut ledger = Ledger::new(&inventory);
    match command.as_str() {
        "ls" => print!("{}", inventory_table(&inventory, &ledger)),
        "plan" => {
            let path = requests.ok_or(format!("--requests is required\n{USAGE}"))?;
            let text =
                std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
            let lines = plan_lines(
                &inventory,
                &mut ledger,
                &text,
                &policy,
                &QuotaBook::unlimited(),
            );
            for line in lines {
                if json {
                    println!(
                        "{}",
                        serde_json::to_string(&line).map_err(|e| e.to_string())?
                    );
                } else if let Some(devices) = &line.devices {
                    let list: Vec<String> = devices
                        .iter()
                        .map(|d| match (&d.profile, d.start) {
                            (Some(p), Some(s)) => format!("GPU{} {} {p}@{s}", d.gpu_index, d.mode),
                            _ => format!("GPU{} {}", d.gpu_index, d.mode),
                        })
                        .collect();
                    println!("request {}: placed on {}", line.request, list.join(", "));
                } else if let Some(reason) = &line.reason {
                    println!(
                        "request {}: refused ({}): {}",
                        line.request, reason.code, reason.message
                    );
                }
            }
            if !json {
                print!("\n{}", inventory_table(&inventory, &ledger));
            }
        }
        other => return Err(format!("unknown command {other:?}\n{USAGE}")),
    }
    Ok(())
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("error: {message}");
            ExitCode::from(2)
        }
    }
}
