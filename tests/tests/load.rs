//! `host load` against a real server on an ephemeral port: a short closed loop of three
//! edges, the files it writes, the last line benches parse, and the refusal to overwrite an
//! earlier run.

use std::path::Path;
use std::time::Duration;

use cleave_common::config::Limits;
use cleave_common::DeviceSpec;
use cleave_host::config::EdgeConfig;
use cleave_host::load::report::LATENCY_HEADER;
use cleave_host::load::{self, LoadMode, LoadOptions};
use cleave_host::LoopbackServer;
use cleave_server::{PeerLimits, PreparedServer};
use cleave_tests::bundle_dir;

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
}

/// An edge.yaml in `dir` for the digits bundle split at cut 3, sent to `url`.
fn edge_config(dir: &Path, url: &str) -> EdgeConfig {
    let yaml = format!(
        "server: {url}\nbundle: {}\nsplit: 3\ndevice: cpu\nbatch_size: 2\ninput: {{kind: synthetic}}\noutput: {}\n",
        bundle_dir("digits").display(),
        dir.join("unused").display()
    );
    let path = dir.join("edge.yaml");
    std::fs::write(&path, yaml).unwrap();
    EdgeConfig::load(&path).unwrap()
}

/// `load: R req/s, p50 X ms, p99 Y ms, errors E`, parsed: R with one decimal, X and Y with
/// two, E an integer.
fn parse_summary_line(line: &str) -> (f64, f64, f64, u64) {
    let rest = line.strip_prefix("load: ").unwrap_or_else(|| panic!("{line:?}"));
    let parts: Vec<&str> = rest.split(", ").collect();
    assert_eq!(parts.len(), 4, "{line:?}");
    let number = |part: &str, prefix: &str, suffix: &str, decimals: usize| -> f64 {
        let text = part.strip_prefix(prefix).and_then(|p| p.strip_suffix(suffix)).unwrap_or_else(|| panic!("{part:?} in {line:?}"));
        assert_eq!(text.split('.').nth(1).map(str::len), Some(decimals), "{text:?} in {line:?}");
        text.parse().unwrap()
    };
    let errors = parts[3].strip_prefix("errors ").unwrap_or_else(|| panic!("{line:?}")).parse().unwrap();
    (number(parts[0], "", " req/s", 1), number(parts[1], "p50 ", " ms", 2), number(parts[2], "p99 ", " ms", 2), errors)
}

#[test]
fn a_closed_loop_of_three_edges_is_answered_and_its_files_agree() {
    let dir = tempfile::tempdir().unwrap();
    let output = dir.path().join("load");
    let prepared = PreparedServer::prepare(&bundle_dir("digits"), DeviceSpec::Cpu, Limits::default(), Default::default()).unwrap();
    runtime().block_on(async {
        let server = LoopbackServer::serve(prepared).await.unwrap();
        let config = edge_config(dir.path(), &server.url);
        let opts =
            LoadOptions { edges: 3, mode: LoadMode::Closed, duration: Duration::from_secs(2), output: output.clone(), ..LoadOptions::default() };
        let report = load::run(vec![config.clone()], opts.clone()).await.unwrap();
        assert!(report.overall.requests > 0, "{:?}", report.overall);
        assert_eq!(report.overall.errors, 0, "{:?}", report.overall.errors_by_code);
        assert_eq!(report.models.len(), 1);
        assert_eq!((report.models[0].edges, report.models[0].splits.as_slice()), (3, &[3][..]));

        // load.json: per model, as many answered as latency.csv has ok lines for it.
        let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(output.join("load.json")).unwrap()).unwrap();
        assert_eq!(json["mode"], "closed");
        assert_eq!(json["edges"], 3);
        let model = &json["models"][0];
        let name = model["name"].as_str().unwrap();
        let answered = model["answered"].as_u64().unwrap();
        assert_eq!(answered, report.overall.answered);
        assert_eq!(model["errors"], 0);
        assert!(model["p50_ms"].as_f64().unwrap() > 0.0 && model["p99_ms"].as_f64().unwrap() >= model["p50_ms"].as_f64().unwrap());
        let csv = std::fs::read_to_string(output.join("latency.csv")).unwrap();
        let mut lines = csv.lines();
        assert_eq!(lines.next(), Some(LATENCY_HEADER));
        let rows: Vec<Vec<&str>> = lines.map(|l| l.split(',').collect()).collect();
        assert_eq!(rows.len() as u64, report.overall.requests);
        let ok = rows.iter().filter(|r| r[1] == name && r[5] == "ok").count() as u64;
        assert_eq!(ok, answered);
        assert!(rows.iter().all(|r| r[3] == "3" && r[4].parse::<f64>().unwrap() > 0.0), "every request at cut 3, with a latency");
        let mut edges: Vec<&str> = rows.iter().map(|r| r[2]).collect();
        edges.sort_unstable();
        edges.dedup();
        assert_eq!(edges, ["0", "1", "2"], "every edge sent");
        assert!(std::fs::read_to_string(output.join("latency.svg")).unwrap().starts_with("<svg"));

        let (rps, p50, p99, errors) = parse_summary_line(&report.summary_line());
        assert_eq!(errors, 0);
        assert!(rps > 0.0 && p50 > 0.0 && p99 >= p50, "{}", report.summary_line());

        // An earlier run is refused without --force, before anything is sent.
        let err = load::run(vec![config], opts).await.unwrap_err().to_string();
        assert!(err.contains("--force"), "{err}");
        server.shutdown().await.unwrap();
    });
}

/// A server that drains quickly when stopped.
fn quick_drain_server() -> PreparedServer {
    let peers = PeerLimits { drain_timeout: Duration::from_millis(100), ..PeerLimits::default() };
    PreparedServer::prepare(&bundle_dir("digits"), DeviceSpec::Cpu, Limits::default(), Default::default()).unwrap().with_peer_limits(peers).unwrap()
}

#[test]
fn load_edges_reconnect_when_their_server_restarts_and_go_on_sending() {
    let dir = tempfile::tempdir().unwrap();
    let output = dir.path().join("load");
    let (first, second) = (quick_drain_server(), quick_drain_server());
    runtime().block_on(async {
        let server = LoopbackServer::serve(first).await.unwrap();
        let (url, addr) = (server.url.clone(), server.url.trim_start_matches("http://").to_string());
        let config = edge_config(dir.path(), &url);
        // Stopped half a second in, back 200 ms after it is gone, at the same address.
        let chaos = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(500)).await;
            server.shutdown().await.unwrap();
            tokio::time::sleep(Duration::from_millis(200)).await;
            LoopbackServer::serve_at(second, &addr).await.unwrap()
        });
        let opts =
            LoadOptions { edges: 2, mode: LoadMode::Closed, duration: Duration::from_secs(3), output: output.clone(), ..LoadOptions::default() };
        let report = load::run(vec![config], opts).await.unwrap();
        let restarted = chaos.await.unwrap();
        // Any error is a request that was on a stream when it broke.
        let lost = report.overall.errors_by_code.get("stream_lost").copied().unwrap_or(0);
        assert_eq!(report.overall.errors, lost, "{:?}", report.overall.errors_by_code);
        let csv = std::fs::read_to_string(output.join("latency.csv")).unwrap();
        let rows: Vec<Vec<&str>> = csv.lines().skip(1).map(|l| l.split(',').collect()).collect();
        let answered_late = rows.iter().filter(|r| r[0].parse::<f64>().unwrap() >= 2.0 && r[5] == "ok");
        let mut edges_after: Vec<&str> = answered_late.map(|r| r[2]).collect();
        edges_after.sort_unstable();
        edges_after.dedup();
        assert_eq!(edges_after, ["0", "1"], "both edges sent on their new streams in the last second");
        restarted.shutdown().await.unwrap();
    });
}
