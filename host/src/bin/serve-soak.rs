//! Bench (not a test): a fresh `server` process, then many split requests one after another
//! from a fresh edge. Shows whether either side starts cold (the first request against the
//! median) and whether the server grows (its resident memory, sampled as the requests go).
//!
//! It prints the server's RSS once it answers and every `--sample-every` requests, then:
//!
//!     first request: X ms, median Y ms, first/median Z
//!     server RSS: start A MiB (after the first request), end B MiB (after N requests), growth G%
//!
//!     cargo build --release
//!     target/release/serve-soak --bundle bundles/resnet18 --requests 10000

mod support;

use std::path::PathBuf;

use anyhow::bail;
use clap::Parser;
use cleave_client::Link;
use cleave_common::config::allowed_cores;
use cleave_common::stats::median;
use cleave_common::wire::Codec;
use cleave_common::{Bundle, DeviceSpec};
use cleave_host::client::{stream_requests, Splits, StreamPlan};
use cleave_host::config::InputSource;
use cleave_host::inputs::Inputs;
use support::{connect_when_up, rss_bytes, start_server, ServerOptions, Side};

#[derive(Parser)]
struct Args {
    /// Bundle directory.
    #[arg(long, default_value = "bundles/resnet18")]
    bundle: PathBuf,
    /// Requests, one in flight.
    #[arg(long, default_value_t = 10_000)]
    requests: u64,
    /// Samples per request.
    #[arg(long, default_value_t = 1)]
    batch: i64,
    /// The cut to split at (default: half of the stages).
    #[arg(long)]
    split: Option<usize>,
    /// The codec.
    #[arg(long, default_value = "raw")]
    codec: Codec,
    /// Requests between two samples of the server's RSS.
    #[arg(long, default_value_t = 1000)]
    sample_every: u64,
    /// The server binary (default: `server` beside this one).
    #[arg(long)]
    server_bin: Option<PathBuf>,
}

const MIB: f64 = 1024.0 * 1024.0;

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    anyhow::ensure!(args.requests >= 2 && args.sample_every >= 1, "--requests needs 2 or more and --sample-every 1 or more");
    let bundle = Bundle::open(&args.bundle)?;
    let split = args.split.unwrap_or(bundle.stage_count() / 2);
    let server_bin = match &args.server_bin {
        Some(p) => p.clone(),
        None => std::env::current_exe()?.with_file_name("server"),
    };
    anyhow::ensure!(server_bin.exists(), "no server binary at {} (cargo build --release builds it)", server_bin.display());
    let side = Side { cores: allowed_cores()?, threads: tch::get_num_threads() as usize };
    let scratch = tempfile::tempdir()?;
    let (mut server, url) = start_server(
        &server_bin,
        &bundle,
        &side,
        &ServerOptions { device: DeviceSpec::Cpu, key: None, limits: "", warm_batches: &[], tls: None },
        scratch.path(),
    )?;
    let pid = server.id();
    println!(
        "{}: CPU, loopback gRPC, one request in flight, batch {}, cut {split}, codec {}; {} requests",
        bundle.manifest().model.source,
        args.batch,
        args.codec,
        args.requests
    );
    let rt = tokio::runtime::Runtime::new()?;
    let result = rt.block_on(async {
        let session = connect_when_up(&url, &bundle, &Link::default(), &mut server).await?;
        println!("server RSS when it answers: {:.1} MiB", rss_bytes(pid)? as f64 / MIB);
        let plan = StreamPlan {
            bundle: bundle.clone(),
            split: Splits::Fixed(split),
            device: DeviceSpec::Cpu,
            warm_stages: None,
            ids: (0..args.requests).collect(),
            resilience: Default::default(),
            in_flight: 1,
            inputs: Inputs::new(&InputSource::Synthetic { seed: 0 }, &bundle, args.batch)?,
            codec: args.codec.into(),
            key: None,
        };
        let (mut latencies, mut errors, mut rss) = (Vec::new(), Vec::new(), Vec::new());
        stream_requests(&session, plan, |o| {
            match &o.output {
                Ok(_) => latencies.push(o.metrics.e2e_ms - o.metrics.input_ms),
                Err(e) => errors.push(e.clone()),
            }
            let done = (latencies.len() + errors.len()) as u64;
            if done == 1 || done.is_multiple_of(args.sample_every) || done == args.requests {
                if let Ok(bytes) = rss_bytes(pid) {
                    println!("server RSS after {done} requests: {:.1} MiB", bytes as f64 / MIB);
                    rss.push((done, bytes));
                }
            }
        })
        .await?;
        if let Some(e) = errors.first() {
            bail!("{} requests failed, first: {e}", errors.len());
        }
        Ok((latencies, rss))
    });
    let _ = server.kill();
    let _ = server.wait();
    let (latencies, rss) = result?;
    let rest = median(&latencies[1..])?;
    println!("first request: {:.3} ms, median {:.3} ms, first/median {:.2}", latencies[0], rest, latencies[0] / rest);
    let (Some(&(first_n, start)), Some(&(last_n, end))) = (rss.first(), rss.last()) else { bail!("the server's RSS could not be read") };
    println!(
        "server RSS: start {:.1} MiB (after {first_n} request), end {:.1} MiB (after {last_n} requests), growth {:+.1}%",
        start as f64 / MIB,
        end as f64 / MIB,
        (end as f64 / start as f64 - 1.0) * 100.0
    );
    Ok(())
}
