//! Bench (not a test): median end-to-end latency of split inference over loopback gRPC at
//! three split points, divided by the median latency of the whole model in one process,
//! all measured in one run on the same inputs.
//!
//!     cargo run --release -p cleave-host --bin split-overhead -- --bundle bundles/resnet18

use std::path::PathBuf;
use std::time::Instant;

use clap::Parser;
use cleave_common::config::{InputSource, Limits};
use cleave_common::{Bundle, DeviceSpec, LoadedStages, StageRange};
use cleave_host::client::{connect, stream_requests, StreamPlan};
use cleave_host::inputs::Inputs;
use cleave_host::report::Percentiles;
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
    let local_p50 = Percentiles::of(&local).p50;
    println!(
        "{}: batch {}, {} timed requests each, CPU, loopback gRPC, one request in flight",
        bundle.manifest().model.source,
        args.batch,
        args.requests
    );
    println!("{:<30} {:>12} {:>8} {:>12}", "configuration", "p50 e2e ms", "ratio", "boundary");
    println!("{:<30} {:>12.2} {:>8.3} {:>12}", "whole model, in process", local_p50, 1.0, "-");

    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async {
        let server = LoopbackServer::start(bundle.dir(), DeviceSpec::Cpu, Limits::default()).await?;
        for split in splits {
            let (mut client, info) = connect(&server.url, &bundle, 8 << 20).await?;
            let plan = StreamPlan {
                bundle: bundle.clone(),
                split,
                device: DeviceSpec::Cpu,
                requests: warmup + args.requests,
                in_flight: 1,
                inputs: Inputs::new(&InputSource::Synthetic { seed: 0 }, &bundle, args.batch)?,
                max_payload_bytes: 1 << 30,
            };
            let mut e2e = Vec::new();
            let mut bytes = 0;
            stream_requests(&mut client, &info, plan, |o| {
                if o.request_id >= warmup && o.output.is_ok() {
                    e2e.push(o.metrics.e2e_ms);
                    bytes = o.metrics.bytes_raw;
                }
            })
            .await?;
            let p50 = Percentiles::of(&e2e).p50;
            println!(
                "{:<30} {:>12.2} {:>8.3} {:>12}",
                format!("split at cut {split} ({})", bundle.cut(split).name.trim_start_matches("after ")),
                p50,
                p50 / local_p50,
                cleave_common::tables::human_bytes(bytes)
            );
        }
        server.shutdown().await
    })
}
