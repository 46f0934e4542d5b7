//! Compiles the controller-worker protocol (`proto/node.proto`) with protox (pure Rust, no
//! system `protoc`) into both the worker's server and the controller's client.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = "proto/node.proto";
    println!("cargo:rerun-if-changed={proto}");
    let fds = protox::compile([proto], ["proto"])?;
    tonic_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_fds(fds)?;
    Ok(())
}
