//! Helpers shared by the integration tests: the fixture inventories.
#![allow(dead_code)]

use std::path::PathBuf;

use torpor_gpu::inventory::Inventory;

pub fn fixtures_dir() -> PathBuf {
    // The fixtures sit beside the repository (`../shared`); a worktree may be deeper.
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .map(|d| d.join("shared/fixtures/gpu"))
        .find(|d| d.is_dir())
        .expect("shared/fixtures/gpu above the crate (../shared/fixtures/gpu of the repository)")
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
