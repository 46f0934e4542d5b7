//! Attacks on this boundary: see main.rs and docs/SECURITY.md.
#[allow(unused_imports)] use crate::common;
