//! Compiles KEDA's externalscaler.proto with protox (pure Rust, no system `protoc`) and
//! generates both the server (served by torpor) and the client (used by the tests).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = "proto/externalscaler.proto";
    println!("cargo:rerun-if-changed={proto}");
    let fds = protox::compile([proto], ["proto"])?;
    tonic_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_fds(fds)?;
    Ok(())
}
