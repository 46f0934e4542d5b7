//! Helpers shared by the integration tests: the fixture inventories.
#![allow(dead_code)]

use std::path::PathBuf;

use torpor_gpu::inventory::Inventory;

pub fn fixtures_dir() -> PathBuf {
    // The fixtures are the repository's `fixtures/gpu` (copied from the shared reference data).
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .map(|d| d.join("fixtures/gpu"))
        .find(|d| d.is_dir())
        .expect("fixtures/gpu of the repository above the crate")
}

pub fn load(name: &str) -> Inventory {
    let path = fixtures_dir().join(name);
    Inventory::load(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

pub fn h200() -> Inventory {
    load("hgx-h200-8.toml")
}

pub fn a100() -> Inventory {
    load("pcie-a100-4.toml")
}

pub fn l4() -> Inventory {
    load("l4-2.toml")
}
