//! `host plan` end to end: profiles from a real server over loopback, a prediction for every
//! cut, a usable best cut, and measured latencies beside the predictions.

use cleave_host::config::EdgeConfig;
use cleave_host::planner::Objective;
use cleave_host::planning::fleet::profile::{EdgeProfile, StageProfile};
use cleave_host::planning::{plan, PlanOptions};
use cleave_tests::bundle_dir;

/// `host plan` over loopback for the digits bundle at batch 4 with `codec`, `repeats` timed
/// passes and `measure` requests at every cut; its output directory is `out` in the first.
fn plan_digits(codec: &str, repeats: usize, measure: u64) -> (tempfile::TempDir, cleave_host::planning::PlanReport) {
    plan_digits_at(4, codec, repeats, measure, Vec::new())
}

/// The same at `batch`, profiling the server at `fleet_profile` batch sizes for a fleet.
fn plan_digits_at(
    batch: i64,
    codec: &str,
    repeats: usize,
    measure: u64,
    fleet_profile: Vec<u32>,
) -> (tempfile::TempDir, cleave_host::planning::PlanReport) {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("edge.yaml");
    let yaml = format!(
        "server: http://127.0.0.1:1\nbundle: {}\nsplit: 3\ndevice: cpu\nbatch_size: {batch}\ncodec: {codec}\ninput: {{kind: synthetic}}\noutput: {}\nloopback: {{device: cpu}}\n",
        bundle_dir("digits").display(),
        dir.path().join("out").display()
    );
    std::fs::write(&config, yaml).unwrap();
    let config = EdgeConfig::load(&config).unwrap();
    let opts = PlanOptions { loopback: true, objective: Objective::Latency, repeats, measure, output: None, fleet_profile };
    let report = tokio::runtime::Runtime::new().unwrap().block_on(plan(config, opts)).unwrap().report;
    (dir, report)
}

#[test]
fn plan_profiles_both_sides_and_the_link_and_predicts_every_cut() {
    let (dir, report) = plan_digits("shuffle+lz4", 2, 2);
    let n = report.profiles.stage_count();
    assert_eq!(n, 12);
    assert_eq!((report.predictions.len(), report.profiles.server_stage_ms.len()), (n + 1, n));
    assert!(report.profiles.edge_stage_ms.iter().chain(&report.profiles.server_stage_ms).all(|&t| t.is_finite() && t >= 0.0));
    assert!(report.profiles.link.bytes_per_s > 0.0 && report.profiles.link.rtt_ms > 0.0);
    // Every boundary was encoded: the input of 4 digits (4 x 64 floats) is at least its header away from empty.
    assert!(report.profiles.cut_wire_bytes.iter().all(|&b| b > 0), "{:?}", report.profiles.cut_wire_bytes);
    let best = report.best.expect("a best cut");
    assert!(report.predictions[best].usable);
    let min = report.predictions.iter().filter(|p| p.usable).map(|p| p.latency_ms).fold(f64::INFINITY, f64::min);
    assert_eq!(report.predictions[best].latency_ms, min);
    // Measured at every usable cut.
    for p in report.predictions.iter().filter(|p| p.usable) {
        assert!(report.measured_ms[p.cut].is_some_and(|m| m > 0.0), "cut {}", p.cut);
    }
    assert!(dir.path().join("out/plan.json").is_file());
    let dot = std::fs::read_to_string(dir.path().join("out").join(cleave_host::planning::graph::STAGE_GRAPH_DOT)).unwrap();
    assert_eq!(dot.matches("split here").count(), 1, "the chosen cut is marked once");
    let svg = std::fs::read_to_string(dir.path().join("out").join(cleave_host::plots::run::PREDICTED_VS_MEASURED)).unwrap();
    assert!(svg.contains("<polyline"));
    // The measured breakdown: one entry per usable cut, its parts adding up to no more than the whole.
    let usable = report.predictions.iter().filter(|p| p.usable).count();
    assert_eq!(report.measured.len(), usable);
    for m in &report.measured {
        assert_eq!(report.measured_ms[m.cut], Some(m.e2e_ms.p50));
        assert_eq!(m.e2e_samples.len(), 2, "cut {}: the warm-up round is left out", m.cut);
        if m.cut == n {
            assert_eq!((m.network_ms, m.server_ms), (0.0, 0.0), "the last cut never leaves the edge");
        } else {
            assert!(m.server_ms > 0.0, "cut {}", m.cut);
        }
    }
    let bars = std::fs::read_to_string(dir.path().join("out").join(cleave_host::plots::run::BREAKDOWN)).unwrap();
    assert!(bars.matches("<rect").count() >= usable, "a bar per cut");
    let cdf = std::fs::read_to_string(dir.path().join("out").join(cleave_host::plots::run::LATENCY_CDF)).unwrap();
    assert!(cdf.contains("<polyline") && cdf.contains(&format!("cut {best} (planned best")), "{cdf}");
}

#[test]
fn plan_writes_the_profiles_a_fleet_is_planned_from() {
    let (dir, report) = plan_digits_at(1, "shuffle+lz4", 2, 3, vec![4, 1, 2]);
    let stages = StageProfile::read(&dir.path().join("out/stage-profile.json")).unwrap();
    // The server's own time per request: its measured time less its stages', at the median cut.
    let n = report.profiles.stage_count();
    let own: Vec<f64> =
        report.measured.iter().filter(|m| m.cut < n).map(|m| m.server_ms - report.profiles.server_stage_ms[m.cut..].iter().sum::<f64>()).collect();
    let median = cleave_common::stats::median(&own).unwrap();
    assert!((stages.request_ms - median.max(0.0)).abs() < 1e-9, "{} {own:?}", stages.request_ms);
    assert_eq!((stages.batches.as_slice(), stages.stages.len(), stages.cuts.len()), ([1, 2, 4].as_slice(), n, n + 1));
    assert!(stages.stages.iter().all(|s| s.ms.len() == 3 && s.ms.iter().all(|&t| t >= 0.0)));
    let usable: Vec<bool> = stages.cuts.iter().map(|c| c.usable).collect();
    assert_eq!(usable, report.profiles.cut_usable);
    let wire: Vec<f64> = report.profiles.cut_wire_bytes.iter().map(|&b| b as f64).collect();
    assert_eq!(stages.cuts.iter().map(|c| c.wire_bytes).collect::<Vec<_>>(), wire);
    let edge = EdgeProfile::read(&dir.path().join("out/edge-profile.json")).unwrap();
    // JSON keeps a time to its last bit or so (serde_json parses floats fast, not exactly).
    assert_eq!(edge.stage_ms.len(), report.profiles.edge_stage_ms.len());
    assert!(edge.stage_ms.iter().zip(&report.profiles.edge_stage_ms).all(|(a, b)| (a - b).abs() <= 1e-12 * b.abs()));
    // A batch of 4 a request is refused: a fleet's rates count requests of one sample.
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("edge.yaml");
    let yaml = format!(
        "server: http://127.0.0.1:1\nbundle: {}\nsplit: 3\ndevice: cpu\nbatch_size: 4\ninput: {{kind: synthetic}}\noutput: {}\nloopback: {{device: cpu}}\n",
        bundle_dir("digits").display(),
        dir.path().join("out").display()
    );
    std::fs::write(&config, yaml).unwrap();
    let opts = PlanOptions { loopback: true, objective: Objective::Latency, repeats: 1, measure: 0, output: None, fleet_profile: vec![1] };
    let error = tokio::runtime::Runtime::new().unwrap().block_on(plan(EdgeConfig::load(&config).unwrap(), opts)).unwrap_err();
    assert!(error.to_string().contains("batch_size is 4: it must be 1"), "{error}");
}

#[test]
fn profile_and_echo_refuse_what_they_cannot_do() {
    use cleave_client::{connect, Link};
    use cleave_common::config::Limits;
    use cleave_common::pb;
    use cleave_common::{Bundle, DeviceSpec};
    let bundle = Bundle::open(bundle_dir("digits")).unwrap();
    tokio::runtime::Runtime::new().unwrap().block_on(async {
        let server = cleave_host::LoopbackServer::start(bundle.dir(), DeviceSpec::Cpu, Limits::default()).await.unwrap();
        let mut session = connect(&server.url, &bundle, &Link::plain()).await.unwrap();
        let err = session.client.profile(pb::ProfileRequest { batch_size: 17, repeats: 1 }).await.unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument);
        assert!(err.message().contains("outside the bundle's range 1..=16"), "{}", err.message());
        let err = session.client.profile(pb::ProfileRequest { batch_size: 2, repeats: 1000 }).await.unwrap_err();
        assert!(err.message().contains("at most 50"), "{}", err.message());
        let ok = session.client.profile(pb::ProfileRequest { batch_size: 2, repeats: 1 }).await.unwrap().into_inner();
        assert_eq!(ok.stage_ms.len(), bundle.stage_count());
        let err = session.client.echo(pb::EchoRequest { payload: Default::default(), reply_bytes: 1 << 40 }).await.unwrap_err();
        assert!(err.message().contains("message limit"), "{}", err.message());
        let back = session.client.echo(pb::EchoRequest { payload: vec![1u8; 1000].into(), reply_bytes: 5000 }).await.unwrap().into_inner();
        assert_eq!(back.payload.len(), 5000);
    });
}

#[test]
fn split_auto_runs_at_the_planned_cut_and_records_it_per_request() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("edge.yaml");
    let out = dir.path().join("out");
    let yaml = format!(
        "server: http://127.0.0.1:1\nbundle: {}\nsplit: auto\nobjective: latency\ncodec: auto\ndevice: cpu\nbatch_size: 4\nrequests: 12\ninput: {{kind: synthetic}}\noutput: {}\nloopback: {{device: cpu}}\n",
        bundle_dir("digits").display(),
        out.display()
    );
    std::fs::write(&config, yaml).unwrap();
    let config = EdgeConfig::load(&config).unwrap();
    assert_eq!(config.split, cleave_common::SplitSpec::Auto);
    let opts = cleave_host::RunOptions { loopback: true, ..Default::default() };
    let summary = tokio::runtime::Runtime::new().unwrap().block_on(cleave_host::run(config, opts)).unwrap();
    assert_eq!((summary.requests, summary.errors), (12, 0));
    let bundle = cleave_common::Bundle::open(bundle_dir("digits")).unwrap();
    let csv = std::fs::read_to_string(out.join("metrics.csv")).unwrap();
    let mut lines = csv.lines();
    assert!(lines.next().unwrap().starts_with("request_id,split,"));
    let splits: Vec<usize> = lines.map(|l| l.split(',').nth(1).unwrap().parse().unwrap()).collect();
    assert_eq!(splits.len(), 12);
    assert_eq!(splits[0], summary.split, "the first request runs at the planned cut");
    assert!(splits.iter().all(|&s| s == bundle.stage_count() || bundle.cut(s).usable));
    // summary.json summarises every part of a request's time.
    let summary: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    for part in ["e2e_ms", "prefix_ms", "encode_ms", "round_trip_ms", "server_ms", "network_ms", "decode_ms"] {
        for q in ["p50", "p95", "p99"] {
            assert!(summary[part][q].as_f64().is_some_and(|v| v >= 0.0), "{part}.{q}: {}", summary[part]);
        }
    }
    assert!(summary["e2e_ms"]["p50"].as_f64().unwrap() >= summary["round_trip_ms"]["p50"].as_f64().unwrap());
    // What the planner chose and predicted is recorded beside what happened.
    assert_eq!(summary["planned"]["cut"].as_u64(), Some(splits[0] as u64));
    assert!(summary["planned"]["predicted_ms"].as_f64().is_some_and(|v| v > 0.0), "{}", summary["planned"]);
    assert_eq!(summary["planned"]["objective"], "latency");
    // Every cut's prediction is there, the chosen one's as predicted, and what profiling took.
    let predictions = summary["planned"]["predictions"].as_array().unwrap();
    assert_eq!(predictions.len(), bundle.stage_count() + 1);
    let chosen = &predictions[splits[0]];
    assert_eq!((chosen["cut"].as_u64(), chosen["latency_ms"].as_f64()), (Some(splits[0] as u64), summary["planned"]["predicted_ms"].as_f64()));
    for part in ["edge_s", "server_s", "link_s"] {
        assert!(summary["planned"]["profiling"][part].as_f64().is_some_and(|v| v > 0.0), "{}", summary["planned"]["profiling"]);
    }
    // Where the edge's processor time went: the start-up profiled every stage, and a request's
    // prefix is part of what the process spent per request (here with the server in it).
    let cpu = |key: &str| summary["edge_cpu"][key].as_f64().unwrap_or_else(|| panic!("edge_cpu.{key}: {}", summary["edge_cpu"]));
    assert!(cpu("startup_s") > 0.0 && cpu("startup_cpu_s") > 0.0, "{}", summary["edge_cpu"]);
    assert!(cpu("per_request_ms") > 0.0 && cpu("per_request_ms") >= cpu("prefix_per_request_ms"), "{}", summary["edge_cpu"]);
    assert!(summary["prefix_cpu_ms"]["p50"].as_f64().is_some_and(|v| v >= 0.0), "{}", summary["prefix_cpu_ms"]);
    assert!(summary["probes"]["count"].as_u64().is_some(), "{}", summary["probes"]);
    // The run's plots: a CDF line and a breakdown bar per cut used.
    let used: std::collections::BTreeSet<usize> = splits.iter().copied().collect();
    let cdf = std::fs::read_to_string(out.join(cleave_host::plots::run::LATENCY_CDF)).unwrap();
    for cut in &used {
        assert!(cdf.contains(&format!("split at cut {cut}")), "cut {cut}");
    }
    assert!(std::fs::read_to_string(out.join(cleave_host::plots::run::BREAKDOWN)).unwrap().contains("<rect"));
    // `codec: auto` chose each request's codec at the cut it ran at, from costs measured there.
    let codecs: Vec<String> = csv.lines().skip(1).map(|l| l.rsplit(',').next().unwrap().to_string()).collect();
    let sent: Vec<(usize, &String)> = splits.iter().copied().zip(&codecs).filter(|(cut, _)| *cut != bundle.stage_count()).collect();
    assert!(sent.iter().all(|(_, c)| ["raw", "shuffle+lz4", "shuffle+zstd-1"].contains(&c.as_str())), "{codecs:?}");
    assert!(splits.iter().zip(&codecs).all(|(&cut, c)| (cut == bundle.stage_count()) == c.is_empty()), "{codecs:?}");
    assert_eq!(summary["codec"], "auto");
    let counted: u64 = summary["codecs"].as_object().unwrap().values().map(|n| n.as_u64().unwrap()).sum();
    assert_eq!(counted, sent.len() as u64, "{}", summary["codecs"]);
    let costs = summary["codec_choice"]["costs"].as_object().unwrap();
    for (cut, _) in &sent {
        assert_eq!(costs[&cut.to_string()].as_array().unwrap().len(), 3, "cut {cut}: {}", summary["codec_choice"]);
    }
    // `auto` is not a cut a bundle can resolve by itself.
    let err = bundle.resolve_split(&cleave_common::SplitSpec::Auto).unwrap_err().to_string();
    assert!(err.contains("planner"), "{err}");
}

#[test]
fn codec_auto_records_each_requests_codec_and_what_it_measured() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("edge.yaml");
    let out = dir.path().join("out");
    let yaml = format!(
        "server: http://127.0.0.1:1\nbundle: {}\nsplit: 3\ncodec: auto\ndevice: cpu\nbatch_size: 2\nrequests: 6\ninput: {{kind: synthetic}}\noutput: {}\nloopback: {{device: cpu}}\n",
        bundle_dir("resnet18").display(),
        out.display()
    );
    std::fs::write(&config, yaml).unwrap();
    let config = EdgeConfig::load(&config).unwrap();
    assert!(config.codec_auto);
    let opts = cleave_host::RunOptions { loopback: true, ..Default::default() };
    let summary = tokio::runtime::Runtime::new().unwrap().block_on(cleave_host::run(config, opts)).unwrap();
    assert_eq!((summary.requests, summary.errors), (6, 0));
    // Which codec wins over loopback depends on this machine (gRPC's own pace is the link's
    // rate here); the unit tests of `codec_choice` hold the choice to links of known rates.
    let choice = summary.codec_choice.expect("codec: auto reports its choice");
    assert_eq!(choice.candidates, ["raw", "shuffle+lz4", "shuffle+zstd-1"]);
    assert!(choice.mbit_per_s > 0.0, "{}", choice.mbit_per_s);
    assert_eq!(choice.costs.keys().copied().collect::<Vec<_>>(), [3], "measured once, at the cut");
    let costs = &choice.costs[&3];
    assert!(costs.iter().all(|c| c.encode_ms_per_mib >= 0.0 && c.decode_ms_per_mib > 0.0 && c.wire_ratio > 0.0), "{costs:?}");
    assert!(costs[0].wire_ratio >= 1.0 && costs[1].wire_ratio < 1.0, "raw, then post-ReLU activations shuffled and compressed: {costs:?}");
    let csv = std::fs::read_to_string(out.join("metrics.csv")).unwrap();
    assert!(csv.lines().next().unwrap().ends_with(",codec"));
    let mut counted = std::collections::BTreeMap::new();
    for line in csv.lines().skip(1) {
        *counted.entry(line.rsplit(',').next().unwrap().to_string()).or_insert(0u64) += 1;
    }
    assert_eq!(summary.codecs, counted);
    assert_eq!(counted.values().sum::<u64>(), 6);
    assert!(counted.keys().all(|c| choice.candidates.contains(c)), "{counted:?}");
}

#[test]
fn with_codec_auto_the_plan_chooses_the_cut_and_the_codec_together() {
    let (dir, report) = plan_digits("auto", 1, 0);
    let n = report.profiles.stage_count();
    // Every candidate measured at every cut, on that cut's boundary.
    let candidates = cleave_host::planning::codec_choice::CANDIDATES;
    assert_eq!(report.profiles.codec_choices.len(), n + 1);
    for (cut, choices) in report.profiles.codec_choices.iter().enumerate() {
        assert_eq!(choices.costs.iter().map(|c| c.codec).collect::<Vec<_>>(), candidates, "cut {cut}");
        assert!(choices.tensor_bytes > 0 && choices.costs.iter().all(|c| c.wire_ratio > 0.0), "cut {cut}: {choices:?}");
    }
    // Each cut that sends is predicted with the candidate that makes it quickest there.
    let link = report.profiles.link;
    for p in &report.predictions[..n] {
        let choices = &report.profiles.codec_choices[p.cut];
        let chosen = choices.costs.iter().find(|c| Some(c.codec) == p.codec).expect("a candidate");
        assert_eq!(p.upload_bytes, chosen.wire_bytes(choices.tensor_bytes), "cut {}", p.cut);
        let quickest = choices
            .costs
            .iter()
            .map(|c| c.codec_ms(choices.tensor_bytes) + link.transfer_ms(c.wire_bytes(choices.tensor_bytes)))
            .fold(f64::INFINITY, f64::min);
        let its = chosen.codec_ms(choices.tensor_bytes) + p.upload_ms;
        assert!((its - quickest).abs() < 1e-9, "cut {}: {its} against {quickest}", p.cut);
    }
    assert_eq!(report.predictions[n].codec, None, "the last cut sends nothing");
    let plan_json = std::fs::read_to_string(dir.path().join("out/plan.json")).unwrap();
    assert!(plan_json.contains("\"codec_choices\"") && plan_json.contains("\"shuffle+lz4\""), "{plan_json}");
}

#[test]
fn a_planned_fleet_s_server_configs_load_as_the_server_reads_them() {
    let dir = tempfile::tempdir().unwrap();
    let profiles = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../config/fleet");
    // A bundle path relative to fleet.yaml, which the server's configs (elsewhere) must find.
    std::fs::create_dir(dir.path().join("bundles")).unwrap();
    std::os::unix::fs::symlink(bundle_dir("digits"), dir.path().join("bundles/digits")).unwrap();
    let model = |name: &str, bundle: &str, rate: u32| {
        format!(
            "  - {{name: {name}, bundle: {bundle}, profile: {}, rate: {rate}, p95_ms: 60,\n     edges: [{{name: e, count: 4, profile: {}, bandwidth_mbps: 200, rtt_ms: 4}}]}}\n",
            profiles.join("resnet50.server.json").display(),
            profiles.join("resnet50.jetson.json").display()
        )
    };
    let yaml = format!(
        "slice_kinds: {{full: {{compute: 1.0, memory_gb: 80}}, 4g.40gb: {{compute: 0.571, memory_gb: 40}}, 3g.40gb: {{compute: 0.429, memory_gb: 40}}}}\n\
         gpus: [{{name: gpu0, layouts: [[full], [4g.40gb, 3g.40gb]]}}]\nmodels:\n{}{}",
        model("digits", "bundles/digits", 300),
        model("mobile", &bundle_dir("mobilenet_v3_small").display().to_string(), 200)
    );
    let fleet = dir.path().join("fleet.yaml");
    std::fs::write(&fleet, yaml).unwrap();
    let out = dir.path().join("plan");
    let plan = cleave_host::planning::fleet::plan_fleet(&fleet, &out, false).unwrap();
    // The configs name their secrets in secrets/ beside them.
    cleave_server::write_dev_secrets(&out.join("secrets")).unwrap();
    let mut loaded = 0;
    for slice in plan.slices.iter().filter(|s| !s.models.is_empty()) {
        let config = cleave_server::config::ServerConfig::load(slice.server_config.as_ref().unwrap()).unwrap_or_else(|e| panic!("{e}"));
        for (served, planned) in config.models.iter().zip(&slice.models) {
            let bundle = if planned.model == "digits" { dir.path().join("bundles/digits") } else { bundle_dir("mobilenet_v3_small") };
            assert_eq!(served.bundle, bundle);
            assert_eq!((served.batching.max_batch, served.batching.max_wait.as_millis() as u64), (planned.max_batch, planned.max_wait_ms));
            assert_eq!(served.slo, Some(std::time::Duration::from_millis(60)));
        }
        loaded += 1;
    }
    assert!(loaded >= 1);
}
