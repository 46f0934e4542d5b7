//! Golden files for what `torpor gpu plan --json` and `torpor gpu ls` print.
//! Regenerate with `UPDATE_GOLDEN=1 cargo test --test golden` and review the diff.

mod common;

use std::path::PathBuf;

use torpor_gpu::ledger::Ledger;
use torpor_gpu::planner::Policy;
use torpor_gpu::quota::QuotaBook;
use torpor_gpu::report::{inventory_table, plan_lines};

fn data(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(name)
}

fn check(name: &str, actual: &str) {
    let path = data(name);
    if std::env::var_os("UPDATE_GOLDEN").is_some() {
        std::fs::write(&path, actual).unwrap();
        return;
    }
    let expected = std::fs::read_to_string(&path).unwrap();
    assert_eq!(
        actual,
        expected,
        "{} differs; UPDATE_GOLDEN=1 rewrites it",
        path.display()
    );
}

fn plan_output(policy: &Policy) -> String {
    let inv = common::h200();
    let mut ledger = Ledger::new(&inv);
    let requests = std::fs::read_to_string(data("requests-h200.jsonl")).unwrap();
    let lines = plan_lines(
        &inv,
        &mut ledger,
        &requests,
        policy,
        &QuotaBook::unlimited(),
    );
    ledger.check(&inv).unwrap();
    lines
        .iter()
        .map(|l| serde_json::to_string(l).unwrap() + "\n")
        .collect()
}

#[test]
fn plan_binpack_matches_golden() {
    check("plan-h200.golden.jsonl", &plan_output(&Policy::default()));
}

#[test]
fn plan_spread_matches_golden() {
    check(
        "plan-h200-spread.golden.jsonl",
        &plan_output(&Policy::spread()),
    );
}

#[test]
fn ls_matches_golden() {
    let inv = common::a100();
    check(
        "ls-a100.golden.txt",
        &inventory_table(&inv, &Ledger::new(&inv)),
    );
}
