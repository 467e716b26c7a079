//! A lone generator's decode rate beside generation floods from other peers, measured on a
//! separate `server` process (`make generation-floods`; not part of `make test`). It starts
//! `server` on 127.0.0.1 (its models on `--device`) with a generation bundle (by default `bench/generate`'s 4-layer GPT-2
//! of width 256), opens one session from 127.0.0.1 over every stage after the embedding (one
//! row; `top_k` 1, so each answer is a token) and takes its decode rate alone: a 16-token
//! prompt, then `--tokens` steps of one token or as many as `--seconds` allow, the median of
//! `--repeats` runs. Then again while
//! `--sessions` sessions from `--peers` other addresses (127.0.0.2, 127.0.0.3, ...; each peer
//! one connection) do one of:
//!
//! - decode: one row each, one token a step, as fast as the server answers;
//! - prefill: 8 rows x 256 tokens each, the whole prompt again at every step;
//! - nan: one row each, hidden states of NaN with `top_k` (refused before they run).
//!
//! The hidden states are zeros (NaN for the last flood): only the server's work is measured,
//! and every process shares this machine's cores. Lines, one a flood:
//!
//!     generation flood decode: a lone generator's 812.0 tokens/s alone, 250.1 beside 60 sessions from 4 peers: 0.31 of alone (goal 0.10)
//!
//! where the goal is half of 1/(peers + 1): the share of a device split evenly between every
//! active peer, halved.
//!
//!     cargo run --release -p cleave-tests --example generation_floods -- [--bundle target/bench-bundles/gpt2-gen] [--sessions 60] [--peers 4] [--tokens 200] [--seconds 15] [--repeats 3] [--floods decode,prefill,nan] [--device cpu] [--generation 'key: value, ...']

use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use cleave_client::{connect, GenerateLink, Link, ServerSession};
use cleave_common::pb;
use cleave_common::spec::DType;
use cleave_common::Bundle;
use cleave_tests::ServerProcess;

struct Args {
    bundle: PathBuf,
    server_bin: PathBuf,
    port: u16,
    sessions: usize,
    peers: usize,
    tokens: usize,
    /// A run of the lone generator stops after this long, whatever its tokens.
    seconds: f64,
    repeats: usize,
    floods: Vec<String>,
    /// The server's device (`cpu`, `cuda:0`).
    device: String,
    /// More of the server's `generation:`, as YAML flow entries (`max_batch: 8`).
    generation: String,
}

fn args() -> Args {
    let mut a = Args {
        bundle: "target/bench-bundles/gpt2-gen".into(),
        server_bin: "target/release/server".into(),
        port: 50394,
        sessions: 60,
        peers: 4,
        tokens: 200,
        seconds: 15.0,
        repeats: 3,
        floods: vec!["decode".into(), "prefill".into(), "nan".into()],
        device: "cpu".into(),
        generation: String::new(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().unwrap_or_else(|| panic!("{flag} needs a value"));
        let number = |what: &str| value.parse().unwrap_or_else(|_| panic!("{what}: a number"));
        match flag.as_str() {
            "--bundle" => a.bundle = value.into(),
            "--server-bin" => a.server_bin = value.into(),
            "--port" => a.port = number("--port") as u16,
            "--sessions" => a.sessions = number("--sessions"),
            "--peers" => a.peers = number("--peers"),
            "--tokens" => a.tokens = number("--tokens"),
            "--seconds" => a.seconds = value.parse().expect("--seconds: a number"),
            "--repeats" => a.repeats = number("--repeats"),
            "--floods" => a.floods = value.split(',').map(str::to_string).collect(),
            "--device" => a.device = value,
            "--generation" => a.generation = value,
            other => panic!(
                "unknown option {other} (--bundle, --server-bin, --port, --sessions, --peers, --tokens, --seconds, --repeats, --floods decode,prefill,nan, --device, --generation 'key: value, ...')"
            ),
        }
    }
    assert!((1..=200).contains(&a.peers), "--peers: 1 to 200");
    a
}

/// What every session of the model needs to step.
#[derive(Clone)]
struct Model {
    stages: u32,
    width: usize,
    vocab_size: i64,
}

/// A session over every stage after the embedding, its rows' next position, and how it steps.
struct Generator {
    link: GenerateLink,
    model: Model,
    rows: u32,
    at: u32,
}

impl Generator {
    async fn open(session: &mut ServerSession, model: &Model, rows: u32, max_len: u32) -> Result<Self, cleave_client::LinkError> {
        let open = pb::OpenGeneration { start: 1, end: model.stages, batch: rows, max_len };
        Ok(Self { link: GenerateLink::open(session, open).await?, model: model.clone(), rows, at: 0 })
    }

    /// One step of `tokens` a row from where the rows stand (`restart`: from position 0),
    /// its hidden states all `value`; answered with the last token's most likely.
    async fn step(&mut self, tokens: u32, restart: bool, value: f32) -> Result<(), cleave_client::LinkError> {
        if restart {
            self.at = 0;
        }
        let count = self.rows as usize * tokens as usize * self.model.width;
        let hidden: Vec<u8> = std::iter::repeat_n(value.to_le_bytes(), count).flatten().collect();
        let step = pb::GenerateStep {
            tokens,
            hidden: Bytes::from(hidden),
            positions_from: vec![self.at; self.rows as usize],
            restart_rows: if restart { (0..self.rows).collect() } else { Vec::new() },
            last_token_only: true,
            top_k: 1,
            ..Default::default()
        };
        self.link.step(step, &[i64::from(self.rows), 1, 1], DType::Float32, self.model.vocab_size).await?;
        self.at += tokens;
        Ok(())
    }
}

/// A lone generator's decode rate: a 16-token prompt, then `tokens` steps of one token, or
/// as many as `seconds` allow.
async fn decode_rate(generator: &mut Generator, tokens: usize, seconds: f64) -> f64 {
    generator.step(16, true, 0.0).await.expect("the prompt's step");
    let started = Instant::now();
    let mut done = 0;
    while done < tokens && started.elapsed().as_secs_f64() < seconds {
        generator.step(1, false, 0.0).await.expect("a decode step");
        done += 1;
    }
    done as f64 / started.elapsed().as_secs_f64()
}

async fn median_rate(generator: &mut Generator, a: &Args) -> f64 {
    let mut rates = Vec::new();
    for _ in 0..a.repeats {
        rates.push(decode_rate(generator, a.tokens, a.seconds).await);
    }
    rates.sort_by(f64::total_cmp);
    rates[rates.len() / 2]
}

/// A flood's sessions, each stepping until `stop`; steps answered and steps refused.
struct Flood {
    stop: Arc<AtomicBool>,
    answered: Arc<AtomicU64>,
    refused: Arc<AtomicU64>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    opened: usize,
}

/// How a flood's sessions step: rows, tokens a step (every step from position 0 when more
/// than one), the hidden states' value.
fn flood_shape(kind: &str) -> (u32, u32, f32) {
    match kind {
        "decode" => (1, 1, 0.0),
        "prefill" => (8, 256, 0.0),
        "nan" => (1, 1, f32::NAN),
        other => panic!("unknown flood {other} (decode, prefill, nan)"),
    }
}

async fn start_flood(kind: &str, peers: &mut [ServerSession], sessions: usize, model: &Model) -> Flood {
    let (rows, tokens, value) = flood_shape(kind);
    let max_len = if tokens > 1 { tokens } else { 1024 };
    let mut flood = Flood {
        stop: Arc::new(AtomicBool::new(false)),
        answered: Arc::new(AtomicU64::new(0)),
        refused: Arc::new(AtomicU64::new(0)),
        tasks: Vec::new(),
        opened: 0,
    };
    let peer_count = peers.len();
    for i in 0..sessions {
        let mut generator = match Generator::open(&mut peers[i % peer_count], model, rows, max_len).await {
            Ok(g) => g,
            Err(e) => {
                eprintln!("  a {kind} session from peer {} was refused: {e}", i % peer_count);
                continue;
            }
        };
        flood.opened += 1;
        let (stop, answered, refused) = (Arc::clone(&flood.stop), Arc::clone(&flood.answered), Arc::clone(&flood.refused));
        let kind = kind.to_string();
        flood.tasks.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let restart = tokens > 1 || generator.at + tokens > max_len;
                match generator.step(tokens, restart, value).await {
                    Ok(()) => answered.fetch_add(1, Ordering::Relaxed),
                    Err(_) if value.is_nan() => refused.fetch_add(1, Ordering::Relaxed),
                    Err(e) => {
                        eprintln!("  a {kind} session ended: {e}");
                        return;
                    }
                };
            }
        }));
    }
    flood
}

impl Flood {
    async fn stop(self) {
        self.stop.store(true, Ordering::Relaxed);
        for task in self.tasks {
            let _ = task.await;
        }
    }
}

fn main() {
    let a = args();
    let bundle = Bundle::open(&a.bundle).unwrap_or_else(|e| panic!("{e} (make bench-generate exports target/bench-bundles/gpt2-gen)"));
    let info = bundle.manifest().generation.clone().expect("a bundle exported with --generation");
    let model = Model { stages: info.stages.len() as u32, width: info.hidden_width() as usize, vocab_size: info.vocab_size };
    let generation = if a.generation.is_empty() { String::new() } else { format!("generation: {{{}}}\n", a.generation) };
    let bundle_path = std::fs::canonicalize(&a.bundle).unwrap();
    let config = format!("listen: 127.0.0.1:{}\nbundle: {}\ndevice: {}\n{generation}", a.port, bundle_path.display(), a.device);
    let server = ServerProcess::start(&a.server_bin, &config, a.port);
    let url = format!("http://127.0.0.1:{}", a.port);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        // Beside a flood, a step may wait long: the lone generator waits for it.
        let patient = Link { request_timeout: Duration::from_secs(300), ..Link::plain() };
        let mut own = connect(&url, &bundle, &patient).await.expect("the lone generator connects");
        let max_len = (16 + a.tokens) as u32;
        let mut generator = Generator::open(&mut own, &model, 1, max_len).await.expect("the lone generator's session");
        let mut peers = Vec::new();
        for p in 0..a.peers {
            let address: IpAddr = format!("127.0.0.{}", p + 2).parse().unwrap();
            let link = Link { local_address: Some(address), ..Link::plain() };
            peers.push(connect(&url, &bundle, &link).await.unwrap_or_else(|e| panic!("peer {address} connects: {e}")));
        }
        let goal = 0.5 / (a.peers as f64 + 1.0);
        for kind in &a.floods {
            let alone = median_rate(&mut generator, &a).await;
            let flood = start_flood(kind, &mut peers, a.sessions, &model).await;
            tokio::time::sleep(Duration::from_secs(1)).await;
            let before = (flood.answered.load(Ordering::Relaxed), flood.refused.load(Ordering::Relaxed), Instant::now());
            let beside = median_rate(&mut generator, &a).await;
            let seconds = before.2.elapsed().as_secs_f64();
            let flood_steps = (flood.answered.load(Ordering::Relaxed) - before.0) as f64 / seconds;
            let flood_refused = (flood.refused.load(Ordering::Relaxed) - before.1) as f64 / seconds;
            let opened = flood.opened;
            flood.stop().await;
            // The flood's sessions close as their streams end.
            tokio::time::sleep(Duration::from_secs(2)).await;
            println!(
                "  the flood's {opened} sessions: {flood_steps:.1} steps/s answered, {flood_refused:.1} steps/s refused, while the lone generator decoded"
            );
            println!(
                "generation flood {kind}: a lone generator's {alone:.1} tokens/s alone, {beside:.1} beside {opened} sessions from {} peers: {:.2} of alone (goal {goal:.2})",
                a.peers,
                beside / alone
            );
        }
    });
    drop(server);
}
