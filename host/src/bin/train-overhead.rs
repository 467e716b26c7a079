//! Bench (not a test): median time per training step of split training over loopback gRPC
//! divided by the median time per step of training the whole model in one process, with the
//! same stages, optimizer, seed and batches, measured in one run (runs alternate so that
//! drift on a shared machine hits both alike).
//!
//!     cargo run --release -p cleave-host --bin train-overhead -- --bundle bundles/resnet18 \
//!         --batch 16 --steps 12 --split after:layer2

use std::path::{Path, PathBuf};

use clap::Parser;
use cleave_common::stats::median;
use cleave_host::config::EdgeConfig;
use cleave_host::RunOptions;
use tch::{Kind, Tensor};

#[derive(Parser)]
struct Args {
    /// Bundle directory (an image model with one input).
    #[arg(long, default_value = "bundles/resnet18")]
    bundle: PathBuf,
    /// Samples per step.
    #[arg(long, default_value_t = 16)]
    batch: i64,
    /// Steps per run (the first is left out of the medians as warm-up).
    #[arg(long, default_value_t = 12)]
    steps: u64,
    /// Runs of each mode, alternating.
    #[arg(long, default_value_t = 2)]
    rounds: usize,
    /// Where the edge's part ends.
    #[arg(long, default_value = "after:layer2")]
    split: String,
    /// Optimizer (YAML flow mapping).
    #[arg(long, default_value = "{ kind: sgd, lr: 0.01, momentum: 0.9, weight_decay: 0.0001 }")]
    optimizer: String,
    /// Boundary codec.
    #[arg(long, default_value = "raw")]
    codec: String,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let bundle = cleave_common::Bundle::open(&args.bundle)?;
    let [input] = bundle.manifest().inputs.as_slice() else { anyhow::bail!("the bench needs a bundle with one input") };
    let cleave_common::spec::ValueSpec::Tensor(spec) = &input.spec else { anyhow::bail!("the input is not a tensor") };
    let classes = match &bundle.cut(bundle.stage_count()).tensors().first() {
        Some((_, t)) => match t.shape.last() {
            Some(cleave_common::spec::Dim::Fixed(c)) => *c,
            _ => anyhow::bail!("the output's last dimension is not fixed"),
        },
        None => anyhow::bail!("no output tensor"),
    };
    let tmp = tempfile::tempdir()?;
    // Random images and labels, enough rows for every step and one evaluation batch.
    let rows = args.batch * args.steps as i64;
    let mut shape = vec![rows];
    for d in &spec.shape[1..] {
        match d {
            cleave_common::spec::Dim::Fixed(n) => shape.push(*n),
            other => anyhow::bail!("input dimension {other:?} is not fixed"),
        }
    }
    tch::manual_seed(0);
    let x = Tensor::randn(&shape, (Kind::Float, tch::Device::Cpu));
    let label = Tensor::randint(classes, [rows], (Kind::Int64, tch::Device::Cpu));
    Tensor::write_safetensors(&[(input.name.as_str(), &x), ("label", &label)], tmp.path().join("train.safetensors"))?;
    let test_x = x.narrow(0, 0, args.batch);
    let test_label = label.narrow(0, 0, args.batch);
    Tensor::write_safetensors(&[(input.name.as_str(), &test_x), ("label", &test_label)], tmp.path().join("test.safetensors"))?;

    let runtime = tokio::runtime::Runtime::new()?;
    let mut medians: Vec<(&str, f64)> = Vec::new();
    for round in 0..args.rounds {
        for mode in ["monolithic", "split"] {
            let out = tmp.path().join(format!("{mode}-{round}"));
            let config = write_config(&args, tmp.path(), &out, mode)?;
            let summary = runtime.block_on(cleave_host::training::run(config, RunOptions { loopback: mode == "split", ..Default::default() }))?;
            let _ = summary;
            let steps = read_step_ms(&out)?;
            let step_median =
                median(&steps[1..]).map_err(|_| anyhow::anyhow!("round {round} {mode}: no step past the warm-up (use --steps 2 or more)"))?;
            medians.push((mode, step_median));
            eprintln!("round {round} {mode}: median step {step_median:.1} ms over {} steps", steps.len() - 1);
        }
    }
    let of = |mode: &str| median(&medians.iter().filter(|(m, _)| *m == mode).map(|(_, v)| *v).collect::<Vec<_>>());
    let (mono, split) = (of("monolithic")?, of("split")?);
    println!(
        "{} batch {} on {}, split {}, codec {}: median step monolithic {:.1} ms, split over loopback {:.1} ms, ratio {:.3}",
        bundle.manifest().model.source,
        args.batch,
        cleave_common::device::device_name(tch::Device::Cpu),
        args.split,
        args.codec,
        mono,
        split,
        split / mono
    );
    Ok(())
}

fn write_config(args: &Args, data: &Path, out: &Path, mode: &str) -> anyhow::Result<EdgeConfig> {
    std::fs::create_dir_all(out)?;
    let yaml = format!(
        "server: http://127.0.0.1:1\nbundle: {bundle}\nsplit: \"{split}\"\ndevice: cpu\noutput: {out}\ncodec: \"{codec}\"\nloopback: {{ device: cpu }}\n\
         train:\n  mode: {mode}\n  data: {{ train: {data}/train.safetensors, test: {data}/test.safetensors }}\n  epochs: 1\n  \
         batch_size: {batch}\n  seed: 0\n  optimizer: {opt}\n  loss: cross-entropy\n",
        bundle = std::fs::canonicalize(&args.bundle)?.display(),
        split = args.split,
        out = out.display(),
        codec = args.codec,
        data = data.display(),
        batch = args.batch,
        opt = args.optimizer,
    );
    let path = out.join("edge.yaml");
    std::fs::write(&path, yaml)?;
    Ok(EdgeConfig::load(&path)?)
}

/// Every step's time, from the run's step log.
fn read_step_ms(out: &Path) -> anyhow::Result<Vec<f64>> {
    let text = std::fs::read_to_string(out.join(cleave_host::training::STEPS_CSV))?;
    text.lines().skip(1).map(|l| Ok(l.split(',').nth(2).unwrap_or_default().parse::<f64>()?)).collect()
}
