//! `torpor`: the one binary. It parses arguments and hands them to a library: `up` runs the
//! daemon (engine + API), `sandbox-agent` is the init process inside every sandbox, and every
//! other command is a client of the HTTP API.

mod audit;
mod ca;
mod cli;
mod common;
mod controller;
mod daemon;
mod datadir;
mod demo;
mod finops;
mod gpu;
mod k8s;
mod nofile;
mod pool;
mod report;
mod serve;
mod snapshot;
mod telemetry;
mod tls_listen;
mod usage;
mod worker;
mod worker_gpu;

use clap::Parser;

fn main() {
    let args = cli::Cli::parse();
    // The agent runs inside gVisor: plain threads, no async runtime, nothing else started.
    if let cli::Command::SandboxAgent { main } = &args.command {
        if let Err(e) = torpor_runtime::agent::run(main.clone()) {
            eprintln!("torpor-agent: {e}");
            std::process::exit(1);
        }
        return;
    }
    // A container's supervisor: plain threads too, and it must outlive any daemon.
    if let cli::Command::Shim {
        dir,
        socket,
        command,
    } = args.command
    {
        match torpor_runtime::shim::run(dir, socket, command) {
            Ok(code) => std::process::exit(code),
            Err(e) => {
                eprintln!("torpor shim: {e}");
                std::process::exit(1);
            }
        }
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            std::process::exit(1);
        }
    };
    let code = runtime.block_on(cli::run(args));
    std::process::exit(code);
}
