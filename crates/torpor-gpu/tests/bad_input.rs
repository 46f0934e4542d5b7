//! Decoders of untrusted input never panic, and refuse with a stable code.

mod common;

use proptest::prelude::*;
use torpor_gpu::extender::{pod_request, Extender, ExtenderArgs, ExtenderBindingArgs};
use torpor_gpu::inventory::Inventory;
use torpor_gpu::ledger::Ledger;
use torpor_gpu::planner::Policy;
use torpor_gpu::quota::QuotaBook;
use torpor_gpu::report::plan_lines;
use torpor_gpu::request::GpuRequest;
use torpor_gpu::topology::TopologyMatrix;

fn fixture_text(name: &str) -> String {
    std::fs::read_to_string(common::fixtures_dir().join(name)).unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn inventory_parser_survives_arbitrary_text(text in ".{0,400}") {
        if let Err(e) = Inventory::from_toml(&text, "fuzz.toml") {
            prop_assert!(e.code().starts_with("inventory_"));
            prop_assert!(e.to_string().starts_with("fuzz.toml"));
        }
    }

    #[test]
    fn inventory_parser_survives_damaged_fixtures(
        which in 0usize..3,
        cut in any::<prop::sample::Index>(),
        insert in "[ -~\n]{0,8}",
    ) {
        let name = ["hgx-h200-8.toml", "pcie-a100-4.toml", "l4-2.toml"][which];
        let text = fixture_text(name);
        let mut at = cut.index(text.len() + 1);
        while !text.is_char_boundary(at) {
            at -= 1;
        }
        let damaged = format!("{}{}{}", &text[..at], insert, &text[at..]);
        match Inventory::from_toml(&damaged, name) {
            Ok(inv) => prop_assert_eq!(inv.topology().size(), inv.gpus().len()),
            Err(e) => prop_assert!(e.to_string().starts_with(name), "{}", e),
        }
    }

    #[test]
    fn topology_parser_survives_arbitrary_text(text in "[GPUXNVSYPIHBODE0-9 \n]{0,200}") {
        if let Ok(m) = TopologyMatrix::parse(&text) {
            prop_assert_eq!(TopologyMatrix::parse(&m.render()).unwrap(), m);
        }
    }

    #[test]
    fn request_lines_never_panic(lines in prop::collection::vec(".{0,80}", 0..8)) {
        let inv = common::l4();
        let mut ledger = Ledger::new(&inv);
        let text = lines.join("\n");
        for line in plan_lines(&inv, &mut ledger, &text, &Policy::default(), &QuotaBook::unlimited()) {
            prop_assert!(line.placed || line.reason.is_some());
        }
        ledger.check(&inv).unwrap();
    }

    #[test]
    fn extender_bodies_never_panic(
        body in ".{0,200}",
        mode in "[a-z]{0,9}",
        pct in "[0-9a-z]{0,4}",
        gpus in "[0-9m-]{0,3}",
    ) {
        let pod_json = serde_json::json!({
            "metadata": {"annotations": {"torpor.dev/gpu-mode": mode, "torpor.dev/gpu-compute-pct": pct}},
            "spec": {"containers": [{"resources": {"limits": {"nvidia.com/gpu": gpus}}}]}
        });
        let mut ext = Extender::new(vec![common::l4()], Policy::default(), QuotaBook::unlimited());
        if let Ok(args) = serde_json::from_str::<ExtenderArgs>(&body) {
            let _ = ext.filter(&args);
            let _ = ext.prioritize(&args);
        }
        if let Ok(args) = serde_json::from_str::<ExtenderBindingArgs>(&body) {
            let _ = ext.bind(&args);
        }
        let pod = serde_json::from_value(pod_json).unwrap();
        match pod_request(&pod) {
            Ok(Some(r)) => prop_assert!(r.count >= 1),
            Ok(None) => {}
            Err(e) => prop_assert_eq!(e.code(), "extender_bad_value"),
        }
        let args = ExtenderArgs { pod: Some(pod), nodes: None, node_names: Some(vec!["l4-01".into(), "nowhere".into()]) };
        let result = ext.filter(&args);
        prop_assert!(!result.error.is_empty() || result.failed_and_unresolvable_nodes.len() + result.node_names.as_ref().map_or(0, |n| n.len()) + result.failed_nodes.len() == 2);
    }

    #[test]
    fn request_json_is_strict(json in "\\{\"mode\":\"(whole|mig|mps|timeslice|x)\"(,\"count\":(0|[1-9][0-9]{0,2}))?(,\"bogus\":1)?\\}") {
        match serde_json::from_str::<GpuRequest>(&json) {
            Ok(r) => prop_assert!(!json.contains("bogus") && !json.contains("\"x\"") && r.validate().map_or(true, |_| r.count >= 1)),
            Err(_) => prop_assert!(json.contains("bogus") || json.contains("\"x\"")),
        }
    }
}
