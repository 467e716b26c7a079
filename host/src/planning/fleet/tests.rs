//! Toy fleets whose optima are worked out by hand: targets loose enough that every slice may
//! be filled to `max_utilisation` (0.9), models of one stage (cut 0) whose load on a whole
//! GPU is `rate * ms / 1000`.

use std::time::Duration;

use super::config::{EdgeClass, Fleet, FleetModel, Gpu, SliceKind};
use super::profile::{Cut, EdgeProfile, Stage, StageProfile};
use super::*;

const GB: f64 = 1e9;

fn kind(name: &str, compute: f64, memory_gb: f64) -> SliceKind {
    SliceKind { name: name.into(), compute, memory_bytes: memory_gb * GB, mig: name != config::FULL }
}

/// A model of one stage taking `ms` a request on a whole GPU, holding `weight_gb`.
pub(super) fn model(name: &str, rate: f64, ms: f64, weight_gb: f64) -> FleetModel {
    let profile = StageProfile {
        format: "cleave-stage-profile/1".into(),
        device: "toy".into(),
        batches: vec![1],
        stages: vec![Stage { ms: vec![ms], weight_bytes: weight_gb * GB, activation_bytes: 0.0 }],
        cuts: vec![Cut { usable: true, batchable: true, wire_bytes: 1000.0 }, Cut { usable: false, batchable: true, wire_bytes: 10.0 }],
        request_ms: 0.0,
    };
    let edge = EdgeProfile { format: "cleave-edge-profile/1".into(), device: "toy".into(), stage_ms: vec![1.0] };
    FleetModel {
        name: name.into(),
        bundle: format!("bundles/{name}").into(),
        profile,
        rate,
        p95_ms: 10_000.0,
        weight: 1.0,
        edges: vec![EdgeClass { name: "edges".into(), count: 4, profile: edge, bytes_per_s: 1e9, rtt_ms: 1.0 }],
    }
}

/// One GPU that may be whole (7g) or cut into 4g + 3g.
pub(super) fn fleet(models: Vec<FleetModel>, layouts: Vec<Vec<usize>>) -> Fleet {
    Fleet {
        slice_kinds: vec![kind("7g.80gb", 1.0, 80.0), kind("4g.40gb", 4.0 / 7.0, 40.0), kind("3g.40gb", 3.0 / 7.0, 40.0)],
        gpus: vec![Gpu { name: "gpu0".into(), index: 0, layouts }],
        models,
        context_bytes: 0.5 * GB,
        max_utilisation: 0.9,
        max_link_utilisation: 0.7,
        time_limit: Duration::from_secs(20),
        max_models_per_slice: 3,
    }
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-4
}

#[test]
fn two_models_sharing_the_whole_gpu_beat_a_slice_each() {
    // Each takes 0.1 of a whole GPU. Shared: 0.1 x + 0.1 x <= 0.9, x = 4.5 (headroom 3.5).
    // Apart: on 3g, 0.1 x / (3/7) <= 0.9, x = 3.857 (headroom 2.857): the smaller is worse.
    let fleet = fleet(vec![model("a", 10.0, 10.0, 1.0), model("b", 10.0, 10.0, 1.0)], vec![vec![0], vec![1, 2]]);
    let placed = place(&fleet).expect("a placement");
    assert_eq!(placed.layouts, [0], "the whole GPU");
    let used: Vec<_> = placed.slices.iter().filter(|s| !s.members.is_empty()).collect();
    assert_eq!(used.len(), 1);
    assert_eq!(used[0].members.iter().map(|m| m.model).collect::<Vec<_>>(), [0, 1]);
    assert!(placed.headroom.iter().all(|&h| close(h, 3.5)), "{:?}", placed.headroom);
    assert!(placed.proven);
}

#[test]
fn one_model_a_slice_gives_each_its_own() {
    // The first test's fleet with `max_models_per_slice: 1`: 4g + 3g, headroom 2.857 at worst.
    let mut fleet = fleet(vec![model("a", 10.0, 10.0, 1.0), model("b", 10.0, 10.0, 1.0)], vec![vec![0], vec![1, 2]]);
    fleet.max_models_per_slice = 1;
    let placed = place(&fleet).expect("a placement");
    assert_eq!(placed.layouts, [1]);
    assert!(placed.slices.iter().all(|s| s.members.len() == 1), "{:?}", placed.slices);
    assert!(close(placed.headroom.iter().copied().fold(f64::INFINITY, f64::min), 0.9 * 3.0 / 7.0 / 0.1 - 1.0), "{:?}", placed.headroom);
}

#[test]
fn a_model_whose_weights_fit_no_slice_is_refused_naming_memory() {
    let fleet = fleet(vec![model("small", 10.0, 10.0, 1.0), model("huge", 10.0, 10.0, 45.0)], vec![vec![1, 2]]);
    let error = place(&fleet).expect_err("45 GB fits no 40 GB slice");
    match &error {
        FleetError::Unplaceable { model, why: Unplaceable::Memory { needed_gb, have_gb, .. } } => {
            assert_eq!(model, "huge");
            assert!(close(*needed_gb, 45.0) && close(*have_gb, 39.5), "{error}");
        }
        other => panic!("expected a memory refusal, got {other}"),
    }
    assert!(error.to_string().contains("memory"), "{error}");
}

#[test]
fn a_memory_refusal_names_the_largest_slice() {
    // 85 GB: on each kind the same need; the whole GPU's 79.5 GB is the nearest miss.
    let fleet = fleet(vec![model("huge", 10.0, 10.0, 85.0)], vec![vec![0], vec![1, 2]]);
    match place(&fleet).expect_err("85 GB fits no slice") {
        FleetError::Unplaceable { why: Unplaceable::Memory { have_gb, .. }, .. } => assert!(close(have_gb, 79.5), "{have_gb}"),
        other => panic!("expected a memory refusal, got {other}"),
    }
}

#[test]
fn a_model_waiting_behind_long_batches_of_another_does_not_share_their_slice() {
    // a: 2 ms, target 15 ms (edge 1 ms, round trip 1 ms); b: 100 ms batches. Alone on the
    // whole GPU, a's p95 is within its target; behind b's batches it is not, so each gets
    // its own slice (4g + 3g) rather than sharing the whole GPU.
    let mut quick = model("a", 10.0, 2.0, 1.0);
    quick.p95_ms = 15.0;
    let fleet = fleet(vec![quick, model("b", 1.0, 100.0, 1.0)], vec![vec![0], vec![1, 2]]);
    let placed = place(&fleet).expect("a placement");
    assert_eq!(placed.layouts, [1]);
    assert!(placed.slices.iter().all(|s| s.members.len() == 1), "{:?}", placed.slices);
}

#[test]
fn models_that_fit_alone_but_not_together_name_the_one_that_does_not_fit() {
    // 45 GB each: either fits the whole GPU's 79.5 GB, not both.
    let fleet = fleet(vec![model("first", 10.0, 10.0, 45.0), model("second", 10.0, 10.0, 45.0)], vec![vec![0]]);
    match place(&fleet).expect_err("90 GB on 80") {
        FleetError::Capacity { model, beside } => {
            assert_eq!(model, "second");
            assert_eq!(beside, ["first"]);
        }
        other => panic!("expected a capacity refusal, got {other}"),
    }
}

#[test]
fn leximin_evens_out_the_headroom_where_the_max_sum_would_not() {
    // On one whole GPU: 0.1 xa + 0.3 xb <= 0.9. The largest sum of headroom puts it all on
    // the light model (xb = 1, xa = 6: headroom 5 and 0, sum 5); leximin evens them out:
    // 0.4 x = 0.9, headroom 1.25 each (sum 2.5).
    let fleet = fleet(vec![model("light", 10.0, 10.0, 1.0), model("heavy", 10.0, 30.0, 1.0)], vec![vec![0]]);
    let placed = place(&fleet).expect("a placement");
    assert!(close(placed.headroom[0], 1.25) && close(placed.headroom[1], 1.25), "{:?}", placed.headroom);
    let max_sum = [5.0, 0.0];
    assert!(placed.headroom.iter().sum::<f64>() < max_sum.iter().sum::<f64>());
}

#[test]
fn a_weight_of_two_gives_twice_the_headroom() {
    // 0.1 (1 + h) + 0.3 (1 + 2h) <= 0.9: h = 0.5 / 0.7.
    let mut heavy = model("heavy", 10.0, 30.0, 1.0);
    heavy.weight = 2.0;
    let placed = place(&fleet(vec![model("light", 10.0, 10.0, 1.0), heavy], vec![vec![0]])).expect("a placement");
    let h = 0.5 / 0.7;
    assert!(close(placed.headroom[0], h) && close(placed.headroom[1], 2.0 * h), "{:?}", placed.headroom);
}

#[test]
fn a_target_the_edge_alone_misses_is_refused_naming_the_latency() {
    let mut slow = model("slow", 10.0, 10.0, 1.0);
    slow.p95_ms = 5.0; // 10 ms on the whole GPU alone
    match place(&fleet(vec![slow], vec![vec![0]])).expect_err("10 ms > 5 ms") {
        FleetError::Unplaceable { model, why: Unplaceable::Latency { kind, best_ms, target_ms, .. } } => {
            assert_eq!((model.as_str(), kind.as_str()), ("slow", "7g.80gb"));
            // 1 ms round trip + 1 ms of transfers + 10 ms of service.
            assert!(close(best_ms, 1.0 + 1010.0 / 1e9 * 1000.0 + 10.0) && close(target_ms, 5.0), "{best_ms}");
        }
        other => panic!("expected a latency refusal, got {other}"),
    }
}

#[test]
fn a_rate_beyond_the_largest_slice_is_refused_naming_the_throughput() {
    // 100 requests/s of 10 ms: a whole GPU busy 90% serves 90.
    match place(&fleet(vec![model("busy", 100.0, 10.0, 1.0)], vec![vec![0], vec![1, 2]])).expect_err("100 > 90") {
        FleetError::Unplaceable { why: Unplaceable::Throughput { capacity, .. }, .. } => assert!(close(capacity, 90.0), "{capacity}"),
        other => panic!("expected a throughput refusal, got {other}"),
    }
}

#[test]
fn a_model_too_large_for_one_slice_s_time_is_served_by_two() {
    // 60 requests/s of 10 ms: 0.6 of a whole GPU's time, more than 4g serves (0.9 * 4/7 =
    // 0.514) or 3g. With the 4g + 3g layout alone both serve it: 0.6 x <= 0.9, x = 1.5.
    let placed = place(&fleet(vec![model("big", 60.0, 10.0, 1.0)], vec![vec![1, 2]])).expect("a placement");
    let on: Vec<_> = placed.slices.iter().filter(|s| !s.members.is_empty()).collect();
    assert_eq!(on.len(), 2);
    assert!(close(on.iter().map(|s| s.members[0].share).sum::<f64>(), 1.0));
    assert!(close(placed.headroom[0], 0.5), "{:?}", placed.headroom);
}

#[test]
fn the_example_fleet_plans_and_writes_a_server_config_per_slice_in_use() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../config/fleet.yaml");
    let dir = tempfile::tempdir().expect("a temporary folder");
    let plan = plan_fleet(&path, dir.path(), true).expect("the example fleet plans");
    assert!(!plan.models.is_empty());
    for m in &plan.models {
        assert!(m.headroom >= 0.0 && m.p95_ms <= m.p95_target_ms, "{m:?}");
        assert!(close(m.routes.iter().map(|r| r.share).sum::<f64>(), 1.0), "{m:?}");
        let simulated = m.simulated.as_ref().expect("simulated");
        assert!(simulated.requests as f64 > 0.9 * m.rate * SIMULATED_SECONDS && simulated.p50_ms <= simulated.p95_ms, "{m:?}");
        assert!(simulated.p95_ms <= m.p95_target_ms, "the simulation keeps the target: {m:?}");
    }
    for slice in plan.slices.iter().filter(|s| !s.models.is_empty()) {
        let config = slice.server_config.as_ref().expect("a server config");
        let text = std::fs::read_to_string(config).expect("written");
        let yaml: serde_yaml::Value = serde_yaml::from_str(&text).expect("YAML");
        assert_eq!(yaml["models"].as_sequence().map(Vec::len), Some(slice.models.len()), "{text}");
        for (entry, sm) in yaml["models"].as_sequence().into_iter().flatten().zip(&slice.models) {
            assert_eq!(entry["batching"]["max_batch"].as_u64(), Some(u64::from(sm.max_batch)));
        }
    }
    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.path().join("fleet-plan.json")).expect("written")).expect("JSON");
    assert_eq!(json["models"].as_array().map(Vec::len), Some(plan.models.len()));
    assert!(plan.gpus.iter().all(|g| !g.mig_commands.is_empty()));
}

#[test]
fn a_fleet_config_s_errors_name_the_key() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let profile = root.join("config/fleet/resnet50.server.json");
    let edge = root.join("config/fleet/resnet50.jetson.json");
    let fleet = |gpus: &str, extra: &str| {
        format!(
            "slice_kinds: {{full: {{compute: 1.0, memory_gb: 80}}, 3g.40gb: {{compute: 0.429, memory_gb: 40}}}}\n\
             gpus: [{gpus}]\n\
             models:\n  - {{name: r, bundle: b, profile: {}, rate: 10, p95_ms: 50,\n     edges: [{{name: e, count: 1, profile: {}, bandwidth_mbps: 100, rtt_ms: 1}}]}}\n{extra}",
            profile.display(),
            edge.display()
        )
    };
    let dir = tempfile::tempdir().expect("a temporary folder");
    let error_of = |text: String| {
        let path = dir.path().join("fleet.yaml");
        std::fs::write(&path, text).expect("written");
        Fleet::load(&path).expect_err("refused").to_string()
    };
    let ok = dir.path().join("ok.yaml");
    std::fs::write(&ok, fleet("{name: g, layouts: [[full], [3g.40gb, 3g.40gb]]}", "")).expect("written");
    let valid = Fleet::load(&ok).expect("valid");
    let names: Vec<Vec<&str>> = valid.gpus[0].layouts.iter().map(|l| l.iter().map(|&k| valid.slice_kinds[k].name.as_str()).collect()).collect();
    assert_eq!(names, [vec!["full"], vec!["3g.40gb", "3g.40gb"]]);
    let unknown = error_of(fleet("{name: g, layouts: [[full], [4g.40gb]]}", ""));
    assert!(unknown.contains("`gpus[0].layouts[1]`") && unknown.contains("\"4g.40gb\" is not one of slice_kinds"), "{unknown}");
    let too_much = error_of(fleet("{name: g, layouts: [[3g.40gb, 3g.40gb, 3g.40gb]]}", ""));
    assert!(too_much.contains("`gpus[0].layouts[0]`") && too_much.contains("1.287"), "{too_much}");
    let mixed = error_of(fleet("{name: g, layouts: [[full, 3g.40gb]]}", ""));
    assert!(mixed.contains("`full` (no MIG) is a layout of its own"), "{mixed}");
    let share = error_of(fleet("{name: g, layouts: [[full]]}", "max_utilisation: 1.5\n"));
    assert!(share.contains("`max_utilisation`"), "{share}");
    let twice = error_of(fleet("{name: g, layouts: [[full]]}, {name: g, layouts: [[full]]}", ""));
    assert!(twice.contains("`gpus`") && twice.contains("named twice"), "{twice}");
    for (key, extra) in
        [("time_limit", "time_limit: 0s\n"), ("time_limit", "time_limit: 2h\n"), ("max_models_per_slice", "max_models_per_slice: 0\n")]
    {
        let refused = error_of(fleet("{name: g, layouts: [[full]]}", extra));
        assert!(refused.contains(&format!("`{key}`")), "{refused}");
    }
    let stray = error_of(fleet("{name: g, layouts: [[full]], mig: true}", ""));
    assert!(stray.contains("mig"), "{stray}");
}
