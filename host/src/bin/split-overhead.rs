//! Bench (not a test): what splitting costs beyond the compute it cannot avoid, measured in
//! one run, the configurations interleaved round by round:
//!
//! - (a) the whole model in this process, on every core;
//! - (b) the floor of a split: the same prefix on the edge's threads and cores, then the
//!   suffix on the server's, back to back in this process;
//! - (c) the split over loopback gRPC between this process (the edge) and a `server` process,
//!   each with its own threads (`threads:`) and, where the machine has two cores or more, its
//!   own cores.
//!
//! It prints, per batch size, cut and codec, (c)/(b) and the protocol's own time per request
//! at p50 (end to end minus making the input, edge compute and server compute) against its
//! budget, 0.3 ms plus the bytes at 2 GB/s, and where the compute went: the prefix and the
//! suffix in the floor against the split's (its prefix, the server's compute). A second table
//! says where the protocol's time went, medians of each part: encoding on the edge, the
//! server's queue, decode and encode, the network (the round trip less the server's time,
//! both ways on gRPC and h2), decoding the result, and the rest on the edge (hand-offs between
//! its tasks). With `--runs N`, every figure is the median of N whole runs (each with a
//! server of its own).
//!
//! Beside each row, tonic's floor for it, measured in the same rounds: after each round's
//! requests of a configuration, as many through a bare `Infer` stream from this process (the
//! edge's cores, the host's HTTP/2 settings) to `grpc-floor`'s echo (beside this binary; the
//! server's cores, config, HTTP/2 settings, TLS and allocator), as many bytes as the split's
//! request frames took on the wire, framed as the host frames them, and the output's bytes
//! back. Before each, a thread of the edge's computes (a busy loop) for the median prefix of
//! the round's split requests, the echo idling meanwhile; the echo lands the request's bytes
//! in one buffer, as the server does, and computes on a thread of its own for the server's
//! median compute time of those requests before it answers. `tonic ms` is the time from the
//! prefix's end to the answer less that compute, `over tonic` the protocol's time less it
//! (per run; with `--runs`, the median of the runs' differences). `--tls` runs the split and
//! its floor over TLS (development secrets).
//!
//! Its last lines: `worst over-tonic: X ms (batch B, cut C, codec K)` and `worst split/floor
//! ratio: X`.
//!
//!     cargo build --release
//!     target/release/split-overhead --bundle bundles/resnet18 --batches 1,8 --codecs raw,shuffle+lz4

mod support;

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context};
use clap::Parser;
use cleave_client::{Link, ServerSession};
use cleave_common::config::allowed_cores;
use cleave_common::pb::split_inference_client::SplitInferenceClient;
use cleave_common::pb::InferFrame;
use cleave_common::stats::median;
use cleave_common::wire::{Codec, Key};
use cleave_common::{Boundary, Bundle, DeviceSpec, LoadedStages, StageRange};
use cleave_host::client::{stream_requests, RequestMetrics, Splits, StreamPlan};
use cleave_host::config::InputSource;
use cleave_host::inputs::Inputs;
use cleave_tables::human_bytes;
use support::{connect_when_up, echo_frames, spawn_on, start_server, when_up, write_server_config, Children, EchoAsk, ServerOptions, Side};
use tonic::transport::Channel;

#[derive(Parser)]
struct Args {
    /// Bundle directory.
    #[arg(long, default_value = "bundles/resnet18")]
    bundle: PathBuf,
    /// Samples per request, each measured on its own.
    #[arg(long, value_delimiter = ',', default_value = "1,8")]
    batches: Vec<i64>,
    /// Timed rounds (one warm-up round more); each runs every configuration.
    #[arg(long, default_value_t = 6)]
    rounds: usize,
    /// Whole runs, each with a server of its own; every figure printed is the median of the
    /// runs' medians (split/floor: of the runs' ratios), so one run's noisy floor counts once.
    #[arg(long, default_value_t = 1)]
    runs: usize,
    /// Requests per configuration in a round.
    #[arg(long, default_value_t = 5)]
    per_round: u64,
    /// Cuts to split at (default: a quarter, half and three quarters of the stages).
    #[arg(long, value_delimiter = ',')]
    splits: Vec<usize>,
    /// Codecs to compare at each cut.
    #[arg(long, value_delimiter = ',', default_value = "raw,shuffle+lz4")]
    codecs: Vec<Codec>,
    /// Also seal every payload with AES-256-GCM (a random key).
    #[arg(long)]
    encrypt: bool,
    /// Run the split and its tonic floor over TLS (a development CA and certificate).
    #[arg(long)]
    tls: bool,
    /// The server's `limits` other than the defaults, as YAML flow entries
    /// (`'stream_window_bytes: 8388608, connection_window_bytes: 8388608'`).
    #[arg(long, default_value = "")]
    server_limits: String,
    /// The edge's cores (default: the first half of the cores this process may use).
    #[arg(long, value_delimiter = ',')]
    edge_cores: Vec<usize>,
    /// The server's cores (default: the other half).
    #[arg(long, value_delimiter = ',')]
    server_cores: Vec<usize>,
    /// The edge's threads per operator (default: one per edge core).
    #[arg(long)]
    edge_threads: Option<usize>,
    /// The server's threads per operator (default: one per server core).
    #[arg(long)]
    server_threads: Option<usize>,
    /// The server binary (default: `server` beside this one).
    #[arg(long)]
    server_bin: Option<PathBuf>,
    /// The server's device (cpu, cuda:N); the floor's suffix runs there too.
    #[arg(long, default_value = "cpu")]
    server_device: DeviceSpec,
    /// Also write every row's figures to this file as JSON.
    #[arg(long)]
    json: Option<PathBuf>,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let bundle = Bundle::open(&args.bundle)?;
    let n = bundle.stage_count();
    let splits = if args.splits.is_empty() { vec![n / 4, n / 2, 3 * n / 4] } else { args.splits.clone() };
    let sides = Sides::of(&args)?;
    let server_bin = match &args.server_bin {
        Some(p) => p.clone(),
        None => std::env::current_exe()?.with_file_name("server"),
    };
    anyhow::ensure!(server_bin.exists(), "no server binary at {} (cargo build --release builds it)", server_bin.display());
    let echo_bin = std::env::current_exe()?.with_file_name("grpc-floor");
    anyhow::ensure!(echo_bin.exists(), "no grpc-floor binary at {} (cargo build --release builds it)", echo_bin.display());
    let key = args.encrypt.then(Key::random);
    print_header(&args, &bundle, &sides, key.is_some());
    let mut worst: f64 = 0.0;
    let mut worst_over_tonic: Option<(f64, i64, usize, Codec)> = None;
    let rt = tokio::runtime::Runtime::new()?;
    let mut parts = Vec::new();
    let mut json_rows = Vec::new();
    // Per batch: the first request of each run (a fresh server) against its configuration's median.
    let mut firsts_of_batch = Vec::new();
    for &batch in &args.batches {
        let (mut runs, mut firsts) = (Vec::new(), Vec::new());
        for _ in 0..args.runs.max(1) {
            let bins = Binaries { server: &server_bin, echo: &echo_bin };
            let (rows, first) = rt.block_on(measure_batch(&args, &bundle, &splits, batch, key.as_ref(), bins, &sides))?;
            runs.push(rows);
            firsts.push(first);
        }
        let rows = medians_of_runs(&runs)?;
        firsts_of_batch.push(FirstRequest {
            batch,
            cut: rows[0].cut,
            codec: rows[0].codec,
            first_ms: median(&firsts)?,
            median_ms: rows[0].split_ms,
            runs: firsts.len(),
        });
        for row in rows {
            worst = worst.max(row.split_per_floor);
            if worst_over_tonic.is_none_or(|(w, ..)| row.over_tonic_ms > w) {
                worst_over_tonic = Some((row.over_tonic_ms, batch, row.cut, row.codec));
            }
            json_rows.push(row.to_json(batch));
            print_row(batch, &row, &bundle);
            parts.push((batch, row.cut, row.codec, row.protocol_parts));
        }
    }
    print_protocol_parts(&parts);
    for first in &firsts_of_batch {
        println!("{first}");
    }
    if let Some(path) = &args.json {
        let all = serde_json::json!({
            "server_device": args.server_device.to_string(),
            "tls": args.tls,
            "rows": json_rows,
            "worst_split_per_floor": worst,
            "worst_over_tonic_ms": worst_over_tonic.map(|(w, ..)| w),
        });
        std::fs::write(path, serde_json::to_string_pretty(&all)?).with_context(|| format!("writing {}", path.display()))?;
    }
    if let Some((ms, batch, cut, codec)) = worst_over_tonic {
        println!("worst over-tonic: {ms:.3} ms (batch {batch}, cut {cut}, codec {codec})");
    }
    println!("worst split/floor ratio: {worst:.3}");
    Ok(())
}

/// Where each part runs: the edge, the server, and the whole model in this process.
struct Sides {
    edge: Side,
    server: Side,
    whole: Side,
}

impl Sides {
    /// The cores given, or the allowed cores halved between the edge and the server (both
    /// on all of them on one core); the whole model on every allowed core.
    fn of(args: &Args) -> anyhow::Result<Self> {
        let all_cores = allowed_cores()?;
        let (edge_cores, server_cores) = match (args.edge_cores.is_empty(), args.server_cores.is_empty()) {
            (true, true) if all_cores.len() >= 2 => {
                let half = all_cores.len() / 2;
                (all_cores[..half].to_vec(), all_cores[half..].to_vec())
            }
            (true, true) => (all_cores.clone(), all_cores.clone()),
            (false, false) => (args.edge_cores.clone(), args.server_cores.clone()),
            _ => bail!("give both --edge-cores and --server-cores, or neither"),
        };
        Ok(Self {
            edge: Side { threads: args.edge_threads.unwrap_or(edge_cores.len()), cores: edge_cores },
            server: Side { threads: args.server_threads.unwrap_or(server_cores.len()), cores: server_cores },
            whole: Side { cores: all_cores, threads: tch::get_num_threads() as usize },
        })
    }
}

/// The run's first line and the table's two header lines.
fn print_header(args: &Args, bundle: &Bundle, sides: &Sides, sealed: bool) {
    let Sides { edge, server: server_side, whole: whole_side } = sides;
    println!(
        "{}: edge on the CPU, server on {}, loopback gRPC, one request in flight; edge on cores {:?} with {} threads, server on cores {:?} with {} threads, \
         whole model on cores {:?} with {} threads{}{}; {} rounds of {} requests per configuration{}",
        bundle.manifest().model.source,
        args.server_device,
        edge.cores,
        edge.threads,
        server_side.cores,
        server_side.threads,
        whole_side.cores,
        whole_side.threads,
        if sealed { "; payloads sealed with AES-256-GCM" } else { "" },
        if args.tls { "; over TLS" } else { "" },
        args.rounds,
        args.per_round,
        if args.runs > 1 { format!("; medians of {} runs", args.runs) } else { String::new() },
    );
    println!(
        "{:<6} {:<26} {:<12} {:>9} {:>9} {:>9} {:>8} {:>8} {:>11} {:>11} {:>10} {:>15} {:>15} {:>9} {:>9}",
        "batch",
        "cut",
        "codec",
        "whole ms",
        "floor ms",
        "split ms",
        "split/",
        "split/",
        "protocol",
        "budget",
        "on the",
        "prefix ms",
        "suffix ms",
        "tonic",
        "over"
    );
    println!(
        "{:<6} {:<26} {:<12} {:>9} {:>9} {:>9} {:>8} {:>8} {:>11} {:>11} {:>10} {:>15} {:>15} {:>9} {:>9}",
        "", "", "", "(a)", "(b)", "(c)", "floor", "whole", "ms p50", "ms", "wire", "(b) / (c)", "(b) / (c)", "ms p50", "tonic ms"
    );
}

/// One row of the first table.
fn print_row(batch: i64, row: &Row, bundle: &Bundle) {
    println!(
        "{:<6} {:<26} {:<12} {:>9.3} {:>9.3} {:>9.3} {:>8.3} {:>8.3} {:>11.3} {:>11.3} {:>10} {:>15} {:>15} {:>9.3} {:>9.3}",
        batch,
        format!("{} ({})", row.cut, bundle.cut(row.cut).name.trim_start_matches("after ")),
        row.codec.to_string(),
        row.whole_ms,
        row.floor_ms,
        row.split_ms,
        row.split_per_floor,
        row.split_ms / row.whole_ms,
        row.protocol_ms,
        budget_ms(row.wire_bytes),
        human_bytes(row.wire_bytes),
        format!("{:.2} / {:.2}", row.floor_parts.0, row.split_parts.0),
        format!("{:.2} / {:.2}", row.floor_parts.1, row.split_parts.1),
        row.tonic_ms,
        row.over_tonic_ms,
    );
}

/// The second table: where each row's protocol time went.
fn print_protocol_parts(rows: &[(i64, usize, Codec, ProtocolParts)]) {
    println!("where the protocol's time went, ms p50:");
    println!(
        "{:<6} {:<5} {:<12} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8}",
        "batch", "cut", "codec", "encode", "queue", "s.decode", "s.encode", "network", "decode", "edge rest"
    );
    for (batch, cut, codec, p) in rows {
        println!(
            "{:<6} {:<5} {:<12} {:>8.3} {:>8.3} {:>8.3} {:>8.3} {:>8.3} {:>8.3} {:>8.3}",
            batch,
            cut,
            codec.to_string(),
            p.encode,
            p.queue,
            p.server_decode,
            p.server_encode,
            p.network,
            p.decode,
            p.edge_rest
        );
    }
}

/// The median of `f` over `requests`.
fn median_of(requests: &[RequestMetrics], f: fn(&RequestMetrics) -> f64) -> anyhow::Result<f64> {
    Ok(median(&requests.iter().map(f).collect::<Vec<_>>())?)
}

/// A batch size's first request on a fresh server (the median over the runs) against its
/// first configuration's median request.
struct FirstRequest {
    batch: i64,
    cut: usize,
    codec: Codec,
    first_ms: f64,
    median_ms: f64,
    runs: usize,
}

impl std::fmt::Display for FirstRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let Self { batch, cut, codec, first_ms, median_ms, runs } = self;
        write!(
            f,
            "first request (batch {batch}, cut {cut}, {codec}, a fresh server): {first_ms:.3} ms (p50 of {runs} runs), median {median_ms:.3} ms, first/median {:.2}",
            first_ms / median_ms
        )
    }
}

/// Medians of the parts of the protocol's time, ms.
struct ProtocolParts {
    encode: f64,
    queue: f64,
    server_decode: f64,
    server_encode: f64,
    network: f64,
    decode: f64,
    /// End to end less making the input, the prefix, encoding, the round trip and decoding.
    edge_rest: f64,
}

impl ProtocolParts {
    /// The medians of each part over `requests`.
    fn of(requests: &[RequestMetrics]) -> anyhow::Result<Self> {
        let part = |f: fn(&RequestMetrics) -> f64| median_of(requests, f);
        Ok(ProtocolParts {
            encode: part(|m| m.encode_ms)?,
            queue: part(|m| m.server.queue_ms)?,
            server_decode: part(|m| m.server.decode_ms)?,
            server_encode: part(|m| m.server.encode_ms)?,
            network: part(|m| m.network_ms())?,
            decode: part(|m| m.decode_ms)?,
            edge_rest: part(|m| m.e2e_ms - m.input_ms - m.prefix_ms - m.encode_ms - m.round_trip_ms - m.decode_ms)?,
        })
    }
}

/// One row of the table.
struct Row {
    cut: usize,
    codec: Codec,
    whole_ms: f64,
    floor_ms: f64,
    split_ms: f64,
    split_per_floor: f64,
    protocol_ms: f64,
    /// tonic's floor for the row's request and answer (the echo's round trip less the suffix).
    tonic_ms: f64,
    /// The protocol's time less tonic's floor (per run, then the median of the runs).
    over_tonic_ms: f64,
    wire_bytes: u64,
    /// Medians of the prefix and the suffix: in the floor, and as the split's request
    /// measured them (its prefix, the server's compute).
    floor_parts: (f64, f64),
    split_parts: (f64, f64),
    protocol_parts: ProtocolParts,
}

impl Row {
    /// Its figures for `--json` (milliseconds at p50; the budget as the table's).
    fn to_json(&self, batch: i64) -> serde_json::Value {
        let p = &self.protocol_parts;
        serde_json::json!({
            "batch": batch,
            "cut": self.cut,
            "codec": self.codec.to_string(),
            "whole_ms": self.whole_ms,
            "floor_ms": self.floor_ms,
            "split_ms": self.split_ms,
            "split_per_floor": self.split_per_floor,
            "protocol_ms": self.protocol_ms,
            "tonic_ms": self.tonic_ms,
            "over_tonic_ms": self.over_tonic_ms,
            "budget_ms": budget_ms(self.wire_bytes),
            "wire_bytes": self.wire_bytes,
            "floor_prefix_ms": self.floor_parts.0,
            "floor_suffix_ms": self.floor_parts.1,
            "prefix_ms": self.split_parts.0,
            "server_compute_ms": self.split_parts.1,
            "parts": {
                "encode": p.encode, "queue": p.queue, "server_decode": p.server_decode, "server_encode": p.server_encode,
                "network": p.network, "decode": p.decode, "edge_rest": p.edge_rest,
            },
        })
    }
}

/// The protocol's budget: 0.3 ms plus the bytes at 2 GB/s.
fn budget_ms(wire_bytes: u64) -> f64 {
    0.3 + wire_bytes as f64 / 2e9 * 1e3
}

/// Each row's figures as the median over `runs` (each run's rows in the same order).
fn medians_of_runs(runs: &[Vec<Row>]) -> anyhow::Result<Vec<Row>> {
    let first = runs.first().context("no run")?;
    let mut rows = Vec::new();
    for (k, row) in first.iter().enumerate() {
        let of = |f: &dyn Fn(&Row) -> f64| median(&runs.iter().map(|run| f(&run[k])).collect::<Vec<_>>());
        let parts = |f: fn(&ProtocolParts) -> f64| of(&|r: &Row| f(&r.protocol_parts));
        rows.push(Row {
            cut: row.cut,
            codec: row.codec,
            whole_ms: of(&|r| r.whole_ms)?,
            floor_ms: of(&|r| r.floor_ms)?,
            split_ms: of(&|r| r.split_ms)?,
            split_per_floor: of(&|r| r.split_per_floor)?,
            protocol_ms: of(&|r| r.protocol_ms)?,
            tonic_ms: of(&|r| r.tonic_ms)?,
            over_tonic_ms: of(&|r| r.over_tonic_ms)?,
            wire_bytes: row.wire_bytes,
            floor_parts: (of(&|r| r.floor_parts.0)?, of(&|r| r.floor_parts.1)?),
            split_parts: (of(&|r| r.split_parts.0)?, of(&|r| r.split_parts.1)?),
            protocol_parts: ProtocolParts {
                encode: parts(|p| p.encode)?,
                queue: parts(|p| p.queue)?,
                server_decode: parts(|p| p.server_decode)?,
                server_encode: parts(|p| p.server_encode)?,
                network: parts(|p| p.network)?,
                decode: parts(|p| p.decode)?,
                edge_rest: parts(|p| p.edge_rest)?,
            },
        });
    }
    Ok(rows)
}

/// The programs a run starts: the server, and `grpc-floor` for its echo.
#[derive(Clone, Copy)]
struct Binaries<'a> {
    server: &'a Path,
    echo: &'a Path,
}

/// One run at `batch`: a fresh server and echo, then the rounds, every configuration in
/// each; the rows and the first request the server answered.
async fn measure_batch(
    args: &Args,
    bundle: &Bundle,
    splits: &[usize],
    batch: i64,
    key: Option<&Key>,
    bins: Binaries<'_>,
    sides: &Sides,
) -> anyhow::Result<(Vec<Row>, f64)> {
    let scratch = tempfile::tempdir()?;
    let secrets = scratch.path().join("secrets");
    if args.tls {
        cleave_server::write_dev_secrets(&secrets)?;
    }
    let options = ServerOptions {
        device: args.server_device,
        key,
        limits: &args.server_limits,
        warm_batches: &[batch],
        tls: args.tls.then_some(secrets.as_path()),
    };
    let link = options.link()?;
    let (server, url) = start_server(bins.server, bundle, &sides.server, &options, scratch.path())?;
    let mut children = Children(vec![server]);
    let (echo_config, echo_url) = write_server_config(bundle, &sides.server, &options, &scratch.path().join("echo.yaml"))?;
    children.0.push(spawn_on(&sides.server, std::process::Command::new(bins.echo).arg("--serve-config").arg(echo_config))?);
    let mut bench = Bench::new(args, bundle, splits, batch, key)?;
    let mut sessions = Vec::new();
    for _ in &bench.configs {
        sessions.push(connect_when_up(&url, bundle, &link, &mut children.0[0]).await?);
    }
    let mut floor = TonicFloor::connect(&echo_url, &link, &mut children.0[1]).await?;
    for round in 0..=args.rounds {
        let timed = round > 0;
        bench.whole_round(sides, timed)?;
        bench.floor_round(sides, timed)?;
        bench.split_round(&sides.edge, &mut sessions, &mut floor, timed).await?;
    }
    bench.rows()
}

/// tonic's floor beside the split: a bare `Infer` stream to `grpc-floor`'s echo.
struct TonicFloor {
    client: SplitInferenceClient<Channel>,
    next_id: u64,
}

impl TonicFloor {
    /// Connected to the echo at `url` as the host connects to a server, once it answers.
    async fn connect(url: &str, link: &Link, echo: &mut std::process::Child) -> anyhow::Result<Self> {
        let endpoint = cleave_client::endpoint(url, link)?;
        let channel = when_up(&format!("the echo at {url}"), echo, || endpoint.connect()).await?;
        Ok(Self { client: SplitInferenceClient::new(channel).max_decoding_message_size(usize::MAX), next_id: 0 })
    }

    /// `count` requests as `ask` says, on a stream of their own, each sent in frames of
    /// `chunk_bytes` (made beforehand) from a thread that first computes (a busy loop) for
    /// `prefix`, as the edge's prefix runs while the echo idles; each one's time from the
    /// prefix's end to its answer, less the echo's compute, ms.
    async fn round(&mut self, count: u64, ask: EchoAsk, prefix: std::time::Duration, chunk_bytes: usize) -> anyhow::Result<Vec<f64>> {
        let (frames, outbound) = tokio::sync::mpsc::channel::<InferFrame>(64);
        let mut answers = self.client.infer(tokio_stream::wrappers::ReceiverStream::new(outbound)).await?.into_inner();
        let data = bytes::Bytes::from(vec![7u8; ask.request_bytes as usize]);
        let mut times = Vec::new();
        for _ in 0..count {
            self.next_id += 1;
            let (id, sender) = (self.next_id, frames.clone());
            let request = echo_frames(id, &ask, &data, chunk_bytes);
            let sent = tokio::task::spawn_blocking(move || {
                let started = Instant::now();
                while started.elapsed() < prefix {
                    std::hint::spin_loop();
                }
                let t = Instant::now();
                let all_sent = request.into_iter().all(|frame| sender.blocking_send(frame).is_ok());
                (t, all_sent)
            });
            let (t, all_sent) = sent.await?;
            if !all_sent {
                // The echo ended the stream: its status says why.
                let why = answers.message().await.err().map_or_else(|| "the stream ended".to_string(), |status| status.to_string());
                bail!("the echo refused request {id}: {why}");
            }
            loop {
                let answer = answers.message().await?.context("the echo hung up")?;
                anyhow::ensure!(answer.request_id == id, "the echo answered {} for request {id}", answer.request_id);
                if answer.last {
                    break;
                }
            }
            times.push(t.elapsed().saturating_sub(ask.compute).as_secs_f64() * 1e3);
        }
        Ok(times)
    }
}

/// One run's configurations and what their rounds measured.
struct Bench<'a> {
    args: &'a Args,
    bundle: &'a Bundle,
    splits: &'a [usize],
    batch: i64,
    key: Option<&'a Key>,
    inputs: Inputs,
    stages: LoadedStages,
    /// The floor's suffix on the server's device (its output brought back, as the server
    /// does); none on the CPU, where `stages` serve.
    server_stages: Option<LoadedStages>,
    /// (index into `splits`, cut, codec)
    configs: Vec<(usize, usize, Codec)>,
    next_id: u64,
    whole: Vec<f64>,
    floor: Vec<Vec<f64>>,
    floor_prefix: Vec<Vec<f64>>,
    floor_suffix: Vec<Vec<f64>>,
    requests: Vec<Vec<RequestMetrics>>,
    /// tonic's floor for each configuration, ms.
    tonic: Vec<Vec<f64>>,
    wire: Vec<u64>,
    /// The output's bytes (what the server answers, raw).
    answer_bytes: u64,
    /// The split's first request: the first the fresh server answers.
    first_ms: Option<f64>,
}

impl<'a> Bench<'a> {
    fn new(args: &'a Args, bundle: &'a Bundle, splits: &'a [usize], batch: i64, key: Option<&'a Key>) -> anyhow::Result<Self> {
        let server_stages = match args.server_device {
            DeviceSpec::Cpu => None,
            device => Some(LoadedStages::load(bundle, StageRange::all(bundle), device)?),
        };
        let configs: Vec<(usize, usize, Codec)> = splits.iter().enumerate().flat_map(|(f, &s)| args.codecs.iter().map(move |&c| (f, s, c))).collect();
        Ok(Self {
            args,
            bundle,
            splits,
            batch,
            key,
            inputs: Inputs::new(&InputSource::Synthetic { seed: 0 }, bundle, batch)?,
            stages: LoadedStages::load(bundle, StageRange::all(bundle), DeviceSpec::Cpu)?,
            server_stages,
            next_id: 0,
            whole: Vec::new(),
            floor: vec![Vec::new(); splits.len()],
            floor_prefix: vec![Vec::new(); splits.len()],
            floor_suffix: vec![Vec::new(); splits.len()],
            requests: vec![Vec::new(); configs.len()],
            tonic: vec![Vec::new(); configs.len()],
            wire: vec![0; configs.len()],
            answer_bytes: 0,
            first_ms: None,
            configs,
        })
    }

    fn next_input(&mut self) -> Boundary {
        let input = self.inputs.batch(self.next_id);
        self.next_id += 1;
        input
    }

    /// (a) the whole model on every core.
    fn whole_round(&mut self, sides: &Sides, timed: bool) -> anyhow::Result<()> {
        sides.whole.enter()?;
        for _ in 0..self.args.per_round {
            let input = self.next_input();
            let t = Instant::now();
            self.stages.run(StageRange::all(self.bundle), &input)?;
            if timed {
                self.whole.push(ms(t));
            }
        }
        Ok(())
    }

    /// (b) the prefix on the edge's side, the suffix on the server's.
    fn floor_round(&mut self, sides: &Sides, timed: bool) -> anyhow::Result<()> {
        let n = self.bundle.stage_count();
        for (k, &s) in self.splits.iter().enumerate() {
            for _ in 0..self.args.per_round {
                let input = self.next_input();
                sides.edge.enter()?;
                let t = Instant::now();
                let boundary: Boundary = self.stages.run(StageRange::prefix(s), &input)?;
                let prefix = ms(t);
                sides.server.enter()?;
                let t = Instant::now();
                let output = self.server_stages.as_ref().unwrap_or(&self.stages).run(StageRange::new(s, n), &boundary)?.to_device(tch::Device::Cpu);
                self.answer_bytes = output.tensor_bytes() as u64;
                if timed {
                    let suffix = ms(t);
                    self.floor[k].push(prefix + suffix);
                    self.floor_prefix[k].push(prefix);
                    self.floor_suffix[k].push(suffix);
                }
            }
        }
        Ok(())
    }

    /// (c) the split, the edge on its side: each configuration's requests on its own session,
    /// then as many through tonic's floor, with the sizes, prefix and suffix they had.
    async fn split_round(&mut self, edge: &Side, sessions: &mut [ServerSession], floor: &mut TonicFloor, timed: bool) -> anyhow::Result<()> {
        edge.enter()?;
        for (k, (&(_, s, codec), session)) in self.configs.iter().zip(sessions).enumerate() {
            let ids: Vec<u64> = (self.next_id..self.next_id + self.args.per_round).collect();
            self.next_id += self.args.per_round;
            let plan = StreamPlan {
                bundle: self.bundle.clone(),
                split: Splits::Fixed(s),
                device: DeviceSpec::Cpu,
                warm_stages: None,
                ids,
                resilience: Default::default(),
                in_flight: 1,
                inputs: Inputs::new(&InputSource::Synthetic { seed: 0 }, self.bundle, self.batch)?,
                codec: codec.into(),
                key: self.key.map(|k| (1, k.clone())),
            };
            let mut errors = Vec::new();
            let mut answered = Vec::new();
            let (wire, first_ms) = (&mut self.wire[k], &mut self.first_ms);
            stream_requests(session, plan, |o| match &o.output {
                Ok(_) => {
                    let m = &o.metrics;
                    first_ms.get_or_insert(m.e2e_ms - m.input_ms);
                    answered.push(m.clone());
                    *wire = m.bytes_wire;
                }
                Err(e) => errors.push(e.clone()),
            })
            .await?;
            if let Some(e) = errors.first() {
                bail!("batch {}, cut {s}, codec {codec}: {} requests failed, first: {e}", self.batch, errors.len());
            }
            let ask = EchoAsk {
                request_bytes: self.wire[k],
                compute: seconds(median_of(&answered, |m| m.server.compute_ms)? / 1e3),
                answer_bytes: self.answer_bytes,
            };
            let prefix = seconds(median_of(&answered, |m| m.prefix_ms)? / 1e3);
            let tonic = floor.round(self.args.per_round, ask, prefix, session.chunk_bytes()).await?;
            if timed {
                self.requests[k].extend(answered);
                self.tonic[k].extend(tonic);
            }
        }
        Ok(())
    }

    /// The table's rows, one per configuration, and the first request.
    fn rows(&self) -> anyhow::Result<(Vec<Row>, f64)> {
        let whole_ms = median(&self.whole)?;
        let mut rows = Vec::new();
        for (k, &(f, cut, codec)) in self.configs.iter().enumerate() {
            let requests = &self.requests[k];
            let (floor_ms, split_ms) = (median(&self.floor[f])?, median_of(requests, |m| m.e2e_ms - m.input_ms)?);
            let protocol_ms = median_of(requests, |m| m.e2e_ms - m.input_ms - m.prefix_ms - m.server.compute_ms)?;
            let tonic_ms = median(&self.tonic[k])?;
            rows.push(Row {
                cut,
                codec,
                whole_ms,
                floor_ms,
                split_ms,
                split_per_floor: split_ms / floor_ms,
                protocol_ms,
                tonic_ms,
                over_tonic_ms: protocol_ms - tonic_ms,
                wire_bytes: self.wire[k],
                floor_parts: (median(&self.floor_prefix[f])?, median(&self.floor_suffix[f])?),
                split_parts: (median_of(requests, |m| m.prefix_ms)?, median_of(requests, |m| m.server.compute_ms)?),
                protocol_parts: ProtocolParts::of(requests)?,
            });
        }
        Ok((rows, self.first_ms.context("no request was answered")?))
    }
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

fn seconds(s: f64) -> std::time::Duration {
    std::time::Duration::from_secs_f64(s.max(0.0))
}
