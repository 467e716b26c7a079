//! The server's resident memory under hostile peers, measured on a separate `server`
//! process (`make hostile-rss`; not part of `make test`). It starts `server` on 127.0.0.1
//! with a memory budget, takes its idle RSS, then samples `/proc/PID/status` every 5 ms
//! while:
//!
//! 1. 20 streams, each on its own connection, declare a 64 MiB request at the bundle's cut
//!    with the most bytes per sample (raw), send half of it and stall;
//! 2. three streams send a zstd frame of 1 GiB of zeros, declared as one request (refused
//!    at the envelope: no cut allows it);
//! 3. three streams send the largest request the cut allows (its batch maximum), zeros
//!    compressed with zstd: decompressed, run and answered;
//! 4. 256 sockets from 127.0.0.2 connect and say nothing (as many as `max_connections`),
//!    while a caller on 127.0.0.1 asks for `Info`: it must be served;
//! 5. slow readers: 48 connections x 32 streams each send 8 requests at the batch maximum
//!    to the cut whose answer outweighs its request most, and never read an answer (their
//!    HTTP/2 windows stay closed), for `limits.answer_timeout` and 10 s more;
//! 6. partial messages: 400 `Infer` streams from 127.0.0.2 (13 connections) each send all but
//!    the last byte of an 8 MiB gRPC message, while a caller on 127.0.0.1 asks for `Info`;
//!    the RSS is taken again once `limits.request_timeout` has given the messages up;
//! 7. training graphs: two peers (127.0.0.2 and .3) each open their share of U-shaped
//!    training sessions (2) over all but the model's head and send one forward whose graph
//!    takes 80% of the peer's share of the budget between them, never its backward; the
//!    budget's `held` gauge (from the metrics endpoint) is set against the RSS both grew by.
//!
//! For each phase it prints the peak RSS over the idle RSS against the budget plus 10%; the
//! last also the RSS at its end, when the answers not taken should have been freed.
//!
//!     cargo run --release -p cleave-tests --example hostile_rss -- [--bundle bundles/resnet18] [--budget-mib 2048] [--phase N] [--slow 48x32x8] [--limits 'key: value, ...']

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use cleave_common::pb::split_inference_client::SplitInferenceClient;
use cleave_common::pb::{self, InferFrame, ResultFrame};
use cleave_common::protocol::BUNDLE_ID_METADATA;
use cleave_common::training::microbatch::Microbatch;
use cleave_common::wire::{Codec, Direction, PayloadMeta, PayloadSender};
use cleave_common::{Boundary, Bundle, DeviceSpec, LoadedStages, StageRange, Value};
use cleave_tests::ServerProcess;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::StreamExt;

const MIB: u64 = 1 << 20;
const FRAME: usize = 4 << 20;

struct Args {
    bundle: PathBuf,
    budget_mib: u64,
    server_bin: PathBuf,
    port: u16,
    /// Only this phase (1 to 7), or all.
    phase: Option<u32>,
    /// Phase 5's connections, streams per connection and requests per stream.
    slow: [usize; 3],
    /// More of the server's `limits`, as YAML flow entries (`answer_timeout: 10s`).
    limits: String,
}

impl Args {
    fn runs(&self, phase: u32) -> bool {
        self.phase.is_none_or(|p| p == phase)
    }
}

fn args() -> Args {
    let mut a = Args {
        bundle: "bundles/resnet18".into(),
        budget_mib: 2048,
        server_bin: "target/release/server".into(),
        port: 50393,
        phase: None,
        slow: [48, 32, 8],
        limits: String::new(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().unwrap_or_else(|| panic!("{flag} needs a value"));
        match flag.as_str() {
            "--bundle" => a.bundle = value.into(),
            "--budget-mib" => a.budget_mib = value.parse().expect("--budget-mib: a number"),
            "--server-bin" => a.server_bin = value.into(),
            "--port" => a.port = value.parse().expect("--port: a number"),
            "--phase" => a.phase = Some(value.parse().expect("--phase: 1 to 7")),
            "--slow" => {
                let n: Vec<usize> = value.split('x').map(|n| n.parse().expect("--slow: CxSxR, as 48x32x8")).collect();
                a.slow = n.try_into().expect("--slow: CxSxR, as 48x32x8");
            }
            "--limits" => a.limits = value,
            other => {
                panic!("unknown option {other} (--bundle, --budget-mib, --server-bin, --port, --phase, --slow CxSxR, --limits 'key: value, ...')")
            }
        }
    }
    a
}

fn rss_bytes(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status.lines().find_map(|l| l.strip_prefix("VmRSS:")).and_then(|v| v.trim().trim_end_matches(" kB").trim().parse::<u64>().ok()).unwrap_or(0)
        * 1024
}

/// The peak RSS of `pid` since the last `take`.
struct Sampler {
    pid: u32,
    peak: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
}

impl Sampler {
    fn start(pid: u32) -> Self {
        let (peak, stop) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicBool::new(false)));
        let (p, s) = (Arc::clone(&peak), Arc::clone(&stop));
        std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                p.fetch_max(rss_bytes(pid), Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(5));
            }
        });
        Self { pid, peak, stop }
    }

    fn take(&self) -> u64 {
        self.peak.swap(0, Ordering::Relaxed)
    }
}

impl Drop for Sampler {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// Zeros shaped like `boundary` with `batch` as the first dimension of every tensor.
fn zeros_at_batch(boundary: &Boundary, batch: i64) -> Boundary {
    let zeros = |v: &Value| match v {
        Value::Tensor(t) => {
            let mut shape = t.size();
            shape[0] = batch;
            Value::Tensor(tch::Tensor::zeros(shape, (t.kind(), tch::Device::Cpu)))
        }
        other => panic!("this bench takes cuts of tensors only, not {other:?}"),
    };
    Boundary { values: boundary.values.iter().map(|(n, v)| (n.clone(), zeros(v))).collect() }
}

/// An `Infer` stream on its own connection; the answers come back through the returned channel.
async fn open(url: &str, bundle: &Bundle) -> (mpsc::Sender<InferFrame>, tonic::Streaming<ResultFrame>) {
    let mut client = SplitInferenceClient::connect(url.to_string()).await.unwrap().max_decoding_message_size(64 << 20);
    let (tx, rx) = mpsc::channel(4);
    let mut request = tonic::Request::new(ReceiverStream::new(rx));
    request.metadata_mut().insert(BUNDLE_ID_METADATA, bundle.id().parse().unwrap());
    (tx, client.infer(request).await.unwrap().into_inner())
}

/// Sends `envelope` and the first `send` bytes of `data`, marked last when it is all of it.
async fn send(tx: &mpsc::Sender<InferFrame>, id: u64, envelope: Bytes, data: &Bytes, send: usize) {
    let mut header = envelope;
    let mut offset = 0;
    loop {
        let end = (offset + FRAME).min(send);
        let frame = InferFrame {
            request_id: id,
            header: std::mem::take(&mut header),
            data: data.slice(offset..end),
            last: end == data.len(),
            ..Default::default()
        };
        if tx.send(frame).await.is_err() {
            return;
        }
        offset = end;
        if offset >= send {
            return;
        }
    }
}

/// The first answer on a stream: its error code, or OK.
async fn answer(results: &mut tonic::Streaming<ResultFrame>) -> String {
    while let Some(frame) = results.next().await {
        match frame {
            Ok(f) if f.last => return f.error.map_or("OK".into(), |e| format!("{:?}", tonic::Code::from(e.code))),
            Ok(_) => {}
            Err(status) => return format!("stream {:?}", status.code()),
        }
    }
    "stream ended".into()
}

/// Sends the whole payload `e` as request `id` on three streams at once; their answers.
async fn three_at_once(url: &str, bundle: &Bundle, id: u64, e: &cleave_common::wire::EncodedPayload) -> Vec<String> {
    let mut opened = Vec::new();
    for _ in 0..3 {
        let (tx, results) = open(url, bundle).await;
        send(&tx, id, e.envelope.clone(), &Bytes::from(e.data.to_vec()), e.data.len()).await;
        opened.push((tx, results));
    }
    let mut codes = Vec::new();
    for (_, results) in &mut opened {
        codes.push(answer(results).await);
    }
    codes
}

fn verdict(peak: u64, idle: u64, budget: u64) -> String {
    let over = peak.saturating_sub(idle);
    let bound = budget + budget / 10;
    format!(
        "peak RSS {} MiB, +{} MiB over idle; budget + 10% = {} MiB: {}",
        peak / MIB,
        over / MIB,
        bound / MIB,
        if over <= bound { "within" } else { "OVER" }
    )
}

/// An HTTP/2 connection from `source` to the server on `port`.
async fn h2_from(source: &str, port: u16) -> h2::client::SendRequest<Bytes> {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind(format!("{source}:0").parse().unwrap()).unwrap();
    let tcp = socket.connect(format!("127.0.0.1:{port}").parse().unwrap()).await.unwrap();
    let (h2, connection) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(connection);
    h2
}

/// Phase 6: streams that each send all but the last byte of the largest message.
async fn partial_messages(port: u16, metrics: std::net::SocketAddr, bundle: &Bundle, sampler: &Sampler, idle: u64, budget: u64) {
    const STREAMS: usize = 400;
    let declared: u32 = (8 << 20) - 64;
    let mut message = vec![0u8];
    message.extend_from_slice(&declared.to_be_bytes());
    message.resize(5 + declared as usize - 1, 7);
    let message = Bytes::from(message);
    sampler.take();
    let mut begun = Vec::new();
    for connection in 0..STREAMS.div_ceil(32) {
        let h2 = h2_from("127.0.0.2", port).await;
        for _ in 0..32.min(STREAMS - connection * 32) {
            let request = http::Request::post(format!("http://127.0.0.1:{port}/cleave.v1.SplitInference/Infer"))
                .header("content-type", "application/grpc")
                .header("te", "trailers")
                .header(BUNDLE_ID_METADATA, bundle.id())
                .body(())
                .unwrap();
            let Ok(mut ready) = h2.clone().ready().await else { break };
            let Ok((response, mut body)) = ready.send_request(request, false) else { break };
            let _ = body.send_data(message.clone(), false);
            begun.push((response, body));
        }
    }
    tokio::time::sleep(Duration::from_secs(5)).await;
    let (held, rss) = (held_bytes(metrics).await, rss_bytes(sampler.pid).saturating_sub(idle));
    let asked = Instant::now();
    let served = async {
        let mut client = SplitInferenceClient::connect(format!("http://127.0.0.1:{port}")).await.map_err(|e| e.to_string())?;
        client.info(cleave_common::pb::InfoRequest {}).await.map(|_| ()).map_err(|e| e.to_string())
    };
    let served = tokio::time::timeout(Duration::from_secs(20), served).await.unwrap_or_else(|_| Err("no answer in 20 s".into()));
    let served_ms = asked.elapsed().as_millis();
    let during = sampler.take().max(idle);
    // The messages are given up at `request_timeout` (30 s by default).
    tokio::time::sleep(Duration::from_secs(35)).await;
    let after = rss_bytes(sampler.pid);
    println!(
        "{STREAMS} streams from 127.0.0.2, each all but the last byte of an 8 MiB message: a caller on 127.0.0.1 {} in {} ms; \
         budget held {} MiB, RSS +{} MiB over idle: {} within 20%; RSS {} MiB over idle 35 s later; {}",
        match &served {
            Ok(()) => "served".to_string(),
            Err(e) => format!("NOT served ({e})"),
        },
        served_ms,
        held / MIB,
        rss / MIB,
        if held.abs_diff(rss) <= rss / 5 { "agree" } else { "DISAGREE" },
        after.saturating_sub(idle) / MIB,
        verdict(during, idle, budget)
    );
    drop(begun);
}

/// The memory budget's `held` gauge, scraped from the metrics endpoint at `metrics`.
async fn held_bytes(metrics: std::net::SocketAddr) -> u64 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut socket = tokio::net::TcpStream::connect(metrics).await.expect("the metrics endpoint");
    socket.write_all(b"GET /metrics HTTP/1.1\r\nHost: cleave\r\nConnection: close\r\n\r\n").await.unwrap();
    let mut response = String::new();
    socket.read_to_string(&mut response).await.unwrap();
    let body = response.split_once("\r\n\r\n").map_or("", |(_, body)| body);
    cleave_tests::metric_sample(&cleave_tests::parse_metrics(body), "cleave_budget_held_bytes", &[("budget", "memory")]) as u64
}

/// Phase 7: U-shaped training sessions from two peers (each its share of sessions), each a
/// forward whose graph is kept, its backward never sent.
async fn training_graphs(url: &str, metrics: std::net::SocketAddr, bundle: &Bundle, sampler: &Sampler, idle: u64, budget: u64) {
    use cleave_client::{connect, Link, RetryPolicy, SessionRequest, TrainLink, TrainReconnect};
    const PEERS: [&str; 2] = ["127.0.0.2", "127.0.0.3"];
    const SESSIONS_PER_PEER: usize = 2;
    let end = bundle.stage_count() - 1;
    let per_sample = bundle.graph_bytes_per_sample(0..end) + bundle.cut(end).bytes_per_sample;
    // A peer's graphs take 80% of its share (a quarter of the budget).
    let batch = (budget / 4 * 8 / 10 / SESSIONS_PER_PEER as u64 / per_sample).clamp(1, bundle.manifest().batch.max as u64) as i64;
    let mut links = Vec::new();
    for peer in PEERS {
        for _ in 0..SESSIONS_PER_PEER {
            let link = Link { local_address: Some(peer.parse().unwrap()), ..Link::plain() };
            let session = connect(url, bundle, &link).await.expect("a connection");
            let open = pb::OpenSession {
                start: 0,
                end: end as u32,
                optimizer: Some(pb::Optimizer { kind: "sgd".into(), lr: 0.1, ..Default::default() }),
                seed: 1,
                ..Default::default()
            };
            let request = SessionRequest { open, codec: Codec::RAW, key: None };
            let reconnect = TrainReconnect { bundle: bundle.clone(), retry: RetryPolicy::default() };
            links.push(TrainLink::open(session, request, reconnect).await.expect("a training session").0);
        }
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (rss_open, held_open) = (rss_bytes(sampler.pid), held_bytes(metrics).await);
    sampler.take();
    let forwards: Vec<_> = links
        .into_iter()
        .map(|mut link| {
            let bundle = bundle.clone();
            tokio::task::spawn_blocking(move || {
                let input = cleave_common::value::synthetic_inputs(&bundle.manifest().inputs, bundle.sizes_at(batch)).unwrap();
                let answered = link.forward(&input, Microbatch::WHOLE).map(drop).map_err(|e| e.to_string());
                (link, answered)
            })
        })
        .collect();
    let mut kept = Vec::new();
    let mut answered = 0;
    for forward in forwards {
        let (link, outcome) = forward.await.unwrap();
        match outcome {
            Ok(()) => answered += 1,
            Err(e) => println!("  a forward was refused: {e}"),
        }
        kept.push(link);
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (rss_pending, held_pending) = (rss_bytes(sampler.pid), held_bytes(metrics).await);
    let (rss_grew, held_grew) = (rss_pending.saturating_sub(rss_open), held_pending.saturating_sub(held_open));
    let agree = rss_grew.abs_diff(held_grew) <= rss_grew / 5;
    println!(
        "{} U-shaped training sessions from {} peers, each a forward at batch {batch} kept pending ({} MiB of graph each by \
         the manifest): {answered} answered; budget held +{} MiB, RSS +{} MiB since the sessions opened: {} within 20%; {}",
        kept.len(),
        PEERS.len(),
        per_sample * batch as u64 / MIB,
        held_grew / MIB,
        rss_grew / MIB,
        if agree { "agree" } else { "DISAGREE" },
        verdict(sampler.take().max(idle), idle, budget)
    );
    // The sessions close with their links (the server frees their graphs).
    drop(kept);
}

/// Phase 5: streams that send requests and never read their answers.
async fn slow_readers(url: &str, bundle: &Bundle, sampler: &Sampler, idle: u64, budget: u64, server_log: &std::path::Path, slow: [usize; 3]) {
    let [connections, streams, requests] = slow;
    const ANSWER_TIMEOUT: Duration = Duration::from_secs(30);
    let last = bundle.stage_count();
    let answer_bytes = bundle.cut(last).bytes_per_sample;
    // The cut whose answer outweighs its request most: small requests, big answers.
    let cut = (0..last).filter(|&c| bundle.cut(c).usable).min_by_key(|&c| bundle.cut(c).bytes_per_sample).expect("a usable cut");
    let batch = bundle.manifest().batch.max;
    let prefix = LoadedStages::load(bundle, StageRange::prefix(cut), DeviceSpec::Cpu).unwrap();
    let inputs = cleave_host::inputs::Inputs::new(&cleave_host::config::InputSource::Synthetic { seed: 0 }, bundle, 1).unwrap();
    let request = zeros_at_batch(&prefix.run(StageRange::prefix(cut), &inputs.batch(0)).unwrap(), batch);
    drop(prefix);
    let encoded: Vec<(Bytes, Bytes)> = (1..=requests as u64)
        .map(|id| {
            let e = PayloadSender::plain()
                .encode(PayloadMeta { request_id: id, split: cut as u32, direction: Direction::Request }, &Codec::RAW, &request)
                .unwrap();
            (e.envelope, Bytes::from(e.data.to_vec()))
        })
        .collect();
    sampler.take();
    let mut held = Vec::new();
    for _ in 0..connections {
        // The smallest windows HTTP/2 allows, never opened further: nothing is read.
        let channel = tonic::transport::Endpoint::from_shared(url.to_string())
            .unwrap()
            .initial_stream_window_size(65_535)
            .initial_connection_window_size(65_535)
            .connect()
            .await
            .unwrap();
        for _ in 0..streams {
            let mut client = SplitInferenceClient::new(channel.clone());
            let (tx, rx) = mpsc::channel(1);
            let mut call = tonic::Request::new(ReceiverStream::new(rx));
            call.metadata_mut().insert(BUNDLE_ID_METADATA, bundle.id().parse().unwrap());
            let feed = encoded.clone();
            tokio::spawn(async move {
                for (id, (envelope, data)) in (1..).zip(feed) {
                    send(&tx, id, envelope, &data, data.len()).await;
                }
                // Kept open: the stream's requests are all sent, its answers never read.
                std::future::pending::<()>().await;
            });
            let answers = tokio::spawn(async move { client.infer(call).await.map(tonic::Response::into_inner) });
            held.push(answers);
        }
    }
    tokio::time::sleep(ANSWER_TIMEOUT + Duration::from_secs(10)).await;
    let at_end = rss_bytes(sampler.pid);
    let log = std::fs::read_to_string(server_log).unwrap_or_default();
    let closed = log.lines().filter(|l| l.contains("took no answer")).count();
    println!(
        "{connections} connections x {streams} streams x {requests} requests at cut {cut}, batch {batch} ({} KiB each, answers {} KiB), never read: \
         {closed} connections closed at the answer timeout, RSS {} MiB over idle after {} s; {}",
        (encoded[0].0.len() + encoded[0].1.len()) / 1024,
        answer_bytes * batch as u64 / 1024,
        at_end.saturating_sub(idle) / MIB,
        (ANSWER_TIMEOUT + Duration::from_secs(10)).as_secs(),
        verdict(sampler.take().max(idle), idle, budget)
    );
    for h in held {
        h.abort();
    }
}

fn main() {
    let a = args();
    let bundle = Bundle::open(&a.bundle).unwrap_or_else(|e| panic!("{e} (make demo writes bundles/resnet18)"));
    let budget = a.budget_mib * MIB;
    // The cut with the most bytes per sample, and the boundary's shape there.
    let cut = bundle.manifest().cuts.iter().filter(|c| c.usable && c.index > 0).max_by_key(|c| c.bytes_per_sample).expect("a usable cut").index;
    let per_sample = bundle.cut(cut).bytes_per_sample;
    let max_batch = bundle.manifest().batch.max;
    let prefix = LoadedStages::load(&bundle, StageRange::prefix(cut), DeviceSpec::Cpu).unwrap();
    let inputs = cleave_host::inputs::Inputs::new(&cleave_host::config::InputSource::Synthetic { seed: 0 }, &bundle, 1).unwrap();
    let sample = prefix.run(StageRange::prefix(cut), &inputs.batch(0)).unwrap();
    drop(prefix);

    // The largest payload the budget holds (as received, up to 110% with lz4, and decoded,
    // with its stream's read buffer of one 8 MiB frame).
    let max_payload = (budget - 10 * MIB) * 10 / 21;
    let metrics: std::net::SocketAddr = format!("127.0.0.1:{}", a.port + 1).parse().unwrap();
    let config = format!(
        "listen: 127.0.0.1:{}\nmetrics_listen: {metrics}\nbundle: {}\ndevice: cpu\ntraining: {{concurrent_sessions: true}}\n\
         limits: {{memory_budget_bytes: {budget}, max_payload_bytes: {max_payload}{}}}\n",
        a.port,
        std::fs::canonicalize(&a.bundle).unwrap().display(),
        if a.limits.is_empty() { String::new() } else { format!(", {}", a.limits) }
    );
    let server = ServerProcess::start(&a.server_bin, &config, a.port);
    let url = format!("http://127.0.0.1:{}", a.port);
    let rt = tokio::runtime::Runtime::new().unwrap();
    std::thread::sleep(Duration::from_secs(2));
    let pid = server.pid();
    let idle = rss_bytes(pid);
    println!(
        "hostile-rss: {} cut {cut} ({} per sample, batch max {max_batch}); budget {} MiB; idle RSS {} MiB",
        bundle.manifest().model.source,
        per_sample,
        budget / MIB,
        idle / MIB
    );
    let sampler = Sampler::start(pid);

    rt.block_on(async {
        if a.runs(1) {
            // 1. 20 streams declare 64 MiB each, send half and stall.
            let batch = (64 * MIB).div_ceil(per_sample).min(max_batch as u64) as i64;
            let big = zeros_at_batch(&sample, batch);
            let e = PayloadSender::plain()
                .encode(PayloadMeta { request_id: 1, split: cut as u32, direction: Direction::Request }, &Codec::RAW, &big)
                .unwrap();
            sampler.take();
            let mut streams = Vec::new();
            for _ in 0..20 {
                let (tx, results) = open(&url, &bundle).await;
                send(&tx, 1, e.envelope.clone(), &Bytes::from(e.data.to_vec()), e.data.len() / 2).await;
                streams.push((tx, results));
            }
            // The budget's wait (2 s) has passed for those that did not fit.
            tokio::time::sleep(Duration::from_secs(4)).await;
            let mut refused = 0;
            for (_, results) in &mut streams {
                if let Ok(a) = tokio::time::timeout(Duration::from_millis(50), answer(results)).await {
                    refused += usize::from(a == "ResourceExhausted");
                }
            }
            println!(
                "20 stalled streams, {} MiB declared each (batch {batch}), half sent: {refused} refused RESOURCE_EXHAUSTED; {}",
                e.data.len() as u64 / MIB,
                verdict(sampler.take().max(idle), idle, budget)
            );
            drop(streams);
            tokio::time::sleep(Duration::from_secs(2)).await;
        }

        if a.runs(2) {
            // 2. Three zstd frames of 1 GiB of zeros, each declared as one request.
            let gib_batch = (1u64 << 30).div_ceil(per_sample) as i64;
            let bomb = zeros_at_batch(&sample, gib_batch);
            let zstd: Codec = "zstd".parse().unwrap();
            let e =
                PayloadSender::plain().encode(PayloadMeta { request_id: 2, split: cut as u32, direction: Direction::Request }, &zstd, &bomb).unwrap();
            drop(bomb);
            sampler.take();
            let codes = three_at_once(&url, &bundle, 2, &e).await;
            println!(
                "3 zstd bombs of 1 GiB (batch {gib_batch}, {} KiB on the wire each): answered {codes:?}; {}",
                e.data.len() / 1024,
                verdict(sampler.take().max(idle), idle, budget)
            );
        }

        if a.runs(3) {
            // 3. Three zstd frames of zeros as large as the cut allows: decompressed and run.
            let largest = zeros_at_batch(&sample, max_batch);
            let zstd: Codec = "zstd".parse().unwrap();
            let e = PayloadSender::plain()
                .encode(PayloadMeta { request_id: 3, split: cut as u32, direction: Direction::Request }, &zstd, &largest)
                .unwrap();
            drop(largest);
            sampler.take();
            let codes = three_at_once(&url, &bundle, 3, &e).await;
            println!(
                "3 zstd frames of zeros at the batch maximum ({} MiB declared each, {} KiB on the wire): answered {codes:?}; {} \
             (the budget holds request bytes; the suffix's activations at the batch maximum come on top)",
                (max_batch as u64 * per_sample) / MIB,
                e.data.len() / 1024,
                verdict(sampler.take().max(idle), idle, budget)
            );
        }

        if a.runs(4) {
            // 4. Silent sockets from another address, and a caller beside them.
            sampler.take();
            let mut silent = Vec::new();
            for _ in 0..256 {
                let socket = tokio::net::TcpSocket::new_v4().unwrap();
                socket.bind("127.0.0.2:0".parse().unwrap()).unwrap();
                silent.push(socket.connect(format!("127.0.0.1:{}", a.port).parse().unwrap()).await.unwrap());
            }
            let asked = Instant::now();
            let served = async {
                let mut client = SplitInferenceClient::connect(url.clone()).await.map_err(|e| e.to_string())?;
                client.info(cleave_common::pb::InfoRequest {}).await.map(|_| ()).map_err(|e| e.to_string())
            };
            let served = tokio::time::timeout(Duration::from_secs(20), served).await.unwrap_or_else(|_| Err("no answer in 20 s".into()));
            println!(
                "256 silent sockets from 127.0.0.2: a caller on 127.0.0.1 {} in {} ms; {}",
                match &served {
                    Ok(()) => "served".to_string(),
                    Err(e) => format!("NOT served ({e})"),
                },
                asked.elapsed().as_millis(),
                verdict(sampler.take().max(idle), idle, budget)
            );
            drop(silent);
        }

        if a.runs(5) {
            // 5. Slow readers.
            slow_readers(&url, &bundle, &sampler, idle, budget, &server.log(), a.slow).await;
        }

        if a.runs(6) {
            partial_messages(a.port, metrics, &bundle, &sampler, idle, budget).await;
        }

        if a.runs(7) {
            training_graphs(&url, metrics, &bundle, &sampler, idle, budget).await;
        }
    });
    drop(sampler);
    drop(server);
}
