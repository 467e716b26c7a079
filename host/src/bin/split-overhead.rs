//! Bench (not a test): median end-to-end latency of split inference over loopback gRPC at
//! three split points and for each codec, divided by the median latency of the whole model
//! in one process, all measured in one run on the same inputs.
//!
//!     cargo run --release -p cleave-host --bin split-overhead -- --bundle bundles/resnet18 \
//!         --codecs raw,shuffle+lz4 [--encrypt]

use std::path::PathBuf;
use std::time::Instant;

use clap::Parser;
use cleave_common::config::Limits;
use cleave_common::security::{EdgeSecurity, ServerSecurity};
use cleave_common::stats::median;
use cleave_common::wire::{Codec, CodecPolicy, Key, KeyRing};
use cleave_common::{Bundle, DeviceSpec, LoadedStages, StageRange};
use cleave_host::client::{stream_requests, Splits, StreamPlan};
use cleave_host::config::InputSource;
use cleave_host::inputs::Inputs;
use cleave_host::session::{connect, Link};
use cleave_host::LoopbackServer;

#[derive(Parser)]
struct Args {
    /// Bundle directory.
    #[arg(long, default_value = "bundles/resnet18")]
    bundle: PathBuf,
    /// Samples per request.
    #[arg(long, default_value_t = 8)]
    batch: i64,
    /// Timed requests per configuration (after warm-up).
    #[arg(long, default_value_t = 20)]
    requests: u64,
    /// Cuts to split at (default: a quarter, half and three quarters of the stages).
    #[arg(long, value_delimiter = ',')]
    splits: Vec<usize>,
    /// Codecs to compare at each split.
    #[arg(long, value_delimiter = ',', default_value = "raw,shuffle+lz4")]
    codecs: Vec<Codec>,
    /// Also seal every payload with AES-256-GCM (a random key).
    #[arg(long)]
    encrypt: bool,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let bundle = Bundle::open(&args.bundle)?;
    let n = bundle.stage_count();
    let splits = if args.splits.is_empty() { vec![n / 4, n / 2, 3 * n / 4] } else { args.splits.clone() };
    let inputs = Inputs::new(&InputSource::Synthetic { seed: 0 }, &bundle, args.batch)?;
    let warmup = 3;

    // The reference: the whole model in one process, one request at a time.
    let whole = LoadedStages::load(&bundle, StageRange::all(&bundle), DeviceSpec::Cpu)?;
    let mut local = Vec::new();
    for id in 0..warmup + args.requests {
        let input = inputs.batch(id);
        let t = Instant::now();
        whole.run(StageRange::all(&bundle), &input)?;
        if id >= warmup {
            local.push(t.elapsed().as_secs_f64() * 1e3);
        }
    }
    drop(whole);
    let local_p50 = median(&local)?;
    println!(
        "{}: batch {}, {} timed requests each, CPU, loopback gRPC, one request in flight{}",
        bundle.manifest().model.source,
        args.batch,
        args.requests,
        if args.encrypt { ", payloads sealed with AES-256-GCM" } else { "" }
    );
    println!("{:<30} {:<16} {:>11} {:>7} {:>11} {:>11}", "configuration", "codec", "p50 e2e ms", "ratio", "boundary", "on the wire");
    println!("{:<30} {:<16} {:>11.2} {:>7.3} {:>11} {:>11}", "whole model, in process", "-", local_p50, 1.0, "-", "-");
    let key = args.encrypt.then(|| (1u32, Key::random()));
    let ring = KeyRing::new(key.clone()).expect("one key");
    let security =
        ServerSecurity { policy: CodecPolicy { require_encryption: key.is_some(), ..CodecPolicy::default() }, keys: ring, ..Default::default() };

    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async {
        let server = LoopbackServer::start_secured(bundle.dir(), DeviceSpec::Cpu, Limits::default(), security).await?;
        let link = Link::secured(&EdgeSecurity { key: key.clone(), ..Default::default() });
        for (split, codec) in splits.iter().flat_map(|&s| args.codecs.iter().map(move |c| (s, *c))) {
            let mut session = connect(&server.url, &bundle, &link).await?;
            let plan = StreamPlan {
                bundle: bundle.clone(),
                split: Splits::Fixed(split),
                device: DeviceSpec::Cpu,
                ids: (0..warmup + args.requests).collect(),
                resilience: Default::default(),
                in_flight: 1,
                inputs: Inputs::new(&InputSource::Synthetic { seed: 0 }, &bundle, args.batch)?,
                codec,
                key: key.clone(),
            };
            let mut e2e = Vec::new();
            let (mut raw, mut wire) = (0, 0);
            let mut errors = Vec::new();
            stream_requests(&mut session, plan, |o| match &o.output {
                Ok(_) if o.request_id >= warmup => {
                    e2e.push(o.metrics.e2e_ms);
                    (raw, wire) = (o.metrics.bytes_raw, o.metrics.bytes_wire);
                }
                Ok(_) => {}
                Err(e) => errors.push(e.clone()),
            })
            .await?;
            if let Some(e) = errors.first() {
                anyhow::bail!("split {split} codec {codec}: {} requests failed, first: {e}", errors.len());
            }
            let p50 = median(&e2e)?;
            println!(
                "{:<30} {:<16} {:>11.2} {:>7.3} {:>11} {:>11}",
                format!("split at cut {split} ({})", bundle.cut(split).name.trim_start_matches("after ")),
                codec.to_string(),
                p50,
                p50 / local_p50,
                cleave_common::tables::human_bytes(raw),
                cleave_common::tables::human_bytes(wire)
            );
        }
        Ok(server.shutdown().await?)
    })
}
