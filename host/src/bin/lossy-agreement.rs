//! Bench (not a test): what each lossy boundary precision does to a model whose accuracy
//! means something. The digits CNN, trained to convergence, runs its held-out test split as
//! one batch, split at every usable inner cut; the boundary goes through the payload codec
//! (the same encoder and receiver the network path uses, in process, on the CPU) with each
//! codec, and the suffix finishes the forward pass on what came out. For each cut and codec
//! it prints the bytes on the wire, top-1 agreement with the fp32 (raw) predictions at that
//! cut, test accuracy, and the largest logit change; then a summary per codec over all cuts.
//!
//!     make digits-trained && cargo run --release -p cleave-host --bin lossy-agreement
//!
//! Options: `--bundle DIR`, `--test-set FILE` (tensors `x` and `label`), `--codecs a,b,...`.

use std::path::{Path, PathBuf};

use anyhow::{bail, ensure, Context};
use clap::Parser;
use cleave_common::stats::median;
use cleave_common::wire::{Codec, CodecPolicy, Direction, KeyRing, PayloadMeta, PayloadReceiver, PayloadSender};
use cleave_common::{Boundary, Bundle, DeviceSpec, LoadedStages, StageRange, Value};
use cleave_tables::thousands;
use tch::{Kind, Tensor};

#[derive(Parser)]
struct Args {
    /// Bundle directory (the trained digits CNN, batch up to at least the test set's size).
    #[arg(long, default_value = "bundles/digits-trained")]
    bundle: PathBuf,
    /// Held-out test split: safetensors with `x` (the model's input) and `label` (int64).
    #[arg(long, default_value = "bundles/digits-test.safetensors")]
    test_set: PathBuf,
    /// Codecs to compare at each cut; `raw` is the fp32 reference and is always computed.
    #[arg(long, value_delimiter = ',', default_value = "raw,shuffle+lz4,fp16+shuffle+lz4,bf16+shuffle+lz4,int8+shuffle+lz4")]
    codecs: Vec<Codec>,
}

/// The make target that creates the default inputs.
const MAKE_TARGET: &str = "make digits-trained";

/// The test split: inputs and their labels.
struct TestSet {
    /// The model's input, `[n, ...]`.
    x: Tensor,
    /// Class labels, `[n]`, int64.
    label: Tensor,
}

impl TestSet {
    fn load(path: &Path) -> anyhow::Result<Self> {
        let tensors = Tensor::read_safetensors(path).with_context(|| format!("reading the test set {}", path.display()))?;
        let take = |name: &str| {
            tensors
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, t)| t.shallow_clone())
                .with_context(|| format!("the test set {} has no tensor {name:?}", path.display()))
        };
        let (x, label) = (take("x")?, take("label")?);
        ensure!(
            label.dim() == 1 && label.size()[0] == x.size()[0],
            "the test set {}: label {:?} does not match x {:?} (one label per sample expected)",
            path.display(),
            label.size(),
            x.size()
        );
        Ok(Self { x, label: label.to_kind(Kind::Int64) })
    }

    fn len(&self) -> i64 {
        self.label.size()[0]
    }
}

/// What came out of one forward pass over the test set.
struct Outcome {
    /// Logits, `[n, classes]`.
    logits: Tensor,
    /// Top-1 class per sample.
    predictions: Tensor,
}

impl Outcome {
    /// Reads the logits from the boundary at the last cut, which holds exactly one tensor.
    fn from_last_cut(last: &Boundary) -> anyhow::Result<Self> {
        let tensors = last.tensors();
        let [(_, logits)] = tensors.as_slice() else {
            bail!("the last cut holds {} tensors; this bench expects one (the logits)", tensors.len());
        };
        ensure!(logits.dim() == 2, "the logits are {:?}, expected [batch, classes]", logits.size());
        Ok(Self { logits: logits.shallow_clone(), predictions: logits.argmax(1, false) })
    }

    /// Samples where the top-1 class equals `other`'s (a `[n]` int64 tensor).
    fn matches(&self, other: &Tensor) -> i64 {
        self.predictions.eq_tensor(other).sum(Kind::Int64).int64_value(&[])
    }

    /// The largest |logit - reference logit| over every sample and class.
    fn max_abs_diff(&self, reference: &Outcome) -> f64 {
        (&self.logits - &reference.logits).abs().max().double_value(&[])
    }

    /// The smallest gap between a sample's top-1 and top-2 logits: a perturbation of less
    /// than half of it in every logit cannot change any prediction.
    fn min_margin(&self) -> f64 {
        let (top, _) = self.logits.topk(2, 1, true, true);
        (top.select(1, 0) - top.select(1, 1)).min().double_value(&[])
    }
}

/// One codec at one cut.
struct Row {
    cut: usize,
    codec: Codec,
    raw_bytes: u64,
    wire_bytes: u64,
    /// Percent of the test set whose top-1 class equals the raw codec's at this cut.
    agreement: f64,
    /// Percent of the test set classified correctly.
    accuracy: f64,
    max_logit_diff: f64,
}

impl Row {
    fn saved_percent(&self) -> f64 {
        100.0 * (1.0 - self.wire_bytes as f64 / self.raw_bytes as f64)
    }
}

/// Encodes `boundary` with `codec`, decodes it as a server would, and returns the decoded
/// boundary with the bytes before encoding and on the wire (envelope and data).
fn round_trip(boundary: &Boundary, cut: usize, codec: &Codec) -> anyhow::Result<(Boundary, u64, u64)> {
    let meta = PayloadMeta { request_id: 0, split: cut as u32, direction: Direction::Request };
    let enc = PayloadSender::plain().encode(meta, codec, boundary).with_context(|| format!("encoding cut {cut} with {codec}"))?;
    let mut receiver = PayloadReceiver::new(Direction::Request, u64::MAX, CodecPolicy::default(), &KeyRing::default());
    let mut decode = || -> Result<_, cleave_common::wire::WireError> {
        let mut assembly = receiver.start(0, &enc.envelope)?;
        assembly.push_data(0, &enc.data)?;
        receiver.finish(assembly)
    };
    let received = decode().with_context(|| format!("decoding cut {cut} with {codec}"))?;
    let wire = (enc.envelope.len() + enc.data.len()) as u64;
    Ok((received.boundary, enc.raw_bytes, wire))
}

fn percent(count: i64, of: i64) -> f64 {
    100.0 * count as f64 / of as f64
}

fn require_file(path: &Path, what: &str) -> anyhow::Result<()> {
    if !path.exists() {
        bail!("{what} {} is missing; `{MAKE_TARGET}` creates the default one", path.display());
    }
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    require_file(&args.bundle.join("manifest.json"), "the bundle manifest")?;
    require_file(&args.test_set, "the test set")?;
    let bundle = Bundle::open(&args.bundle)?;
    let test = TestSet::load(&args.test_set)?;
    let stages = LoadedStages::load(&bundle, StageRange::all(&bundle), DeviceSpec::Cpu)?;
    let inputs = &bundle.cut(0).values;
    let [input_spec] = inputs.as_slice() else {
        bail!("the bundle takes {} inputs; this bench feeds one (the test set's x)", inputs.len());
    };
    let input = Boundary { values: vec![(input_spec.name.clone(), Value::Tensor(test.x.shallow_clone()))] };
    // The reference of the sanity check: the whole model, unsplit, on the same batch.
    let unsplit = Outcome::from_last_cut(&stages.run(StageRange::all(&bundle), &input)?)?;
    print_header(&bundle, &test, &unsplit);
    let mut rows = Vec::new();
    // Cuts where the raw round trip changed a prediction, and where it changed any logit bit.
    let (mut raw_mismatches, mut raw_not_bit_exact) = (Vec::new(), Vec::new());
    for cut in (1..bundle.stage_count()).filter(|&s| bundle.cut(s).usable) {
        let at_cut = CutRun { bundle: &bundle, stages: &stages, test: &test, cut, prefix: stages.run(StageRange::new(0, cut), &input)? };
        // The fp32 reference at this cut is always the raw codec, listed or not.
        let reference = at_cut.through(&Codec::RAW)?.0;
        if !reference.predictions.equal(&unsplit.predictions) {
            raw_mismatches.push(cut);
        }
        if !reference.logits.equal(&unsplit.logits) {
            raw_not_bit_exact.push(cut);
        }
        for codec in &args.codecs {
            let row = at_cut.row(codec, &reference)?;
            print_row(&bundle, &row);
            rows.push(row);
        }
    }
    print_summary(&args.codecs, &rows)?;
    println!();
    let equal = raw_mismatches.is_empty();
    println!("raw round trip equals the unsplit model: {}", if equal { "yes" } else { "no" });
    if raw_not_bit_exact.is_empty() {
        println!("(its logits are bit-identical to the unsplit model's at every cut)");
    } else {
        println!("(its logits differ in some bits from the unsplit model's at cuts {raw_not_bit_exact:?})");
    }
    // A lossless codec that changes predictions is a bug in the path, not a property of the
    // model: every number above would be suspect, so the run fails.
    ensure!(equal, "the raw round trip changed the predictions at cuts {raw_mismatches:?}");
    Ok(())
}

/// What the run is, the unsplit model's accuracy and margin, and the table's header.
fn print_header(bundle: &Bundle, test: &TestSet, unsplit: &Outcome) {
    let samples = test.len();
    println!("{}: {} held-out test images as one batch, CPU, in process through the payload codec", bundle.manifest().model.source, samples);
    println!("unsplit fp32 model: test accuracy {:.2}%", percent(unsplit.matches(&test.label), samples));
    println!(
        "smallest fp32 top-1/top-2 logit margin on the test set: {:.4} (a logit change under half of it cannot flip a prediction)",
        unsplit.min_margin()
    );
    println!("agreement and logit diff are against the raw (fp32) codec at the same cut");
    println!();
    println!(
        "{:<24} {:<16} {:>11} {:>11} {:>7} {:>10} {:>9} {:>12}",
        "cut", "codec", "raw bytes", "wire bytes", "saved", "agreement", "accuracy", "max |dlogit|"
    );
}

/// The test set split at one cut: its boundary there, to send through each codec.
struct CutRun<'a> {
    bundle: &'a Bundle,
    stages: &'a LoadedStages,
    test: &'a TestSet,
    cut: usize,
    prefix: Boundary,
}

impl CutRun<'_> {
    /// The outcome of the boundary through `codec` and the suffix, with its raw and wire bytes.
    fn through(&self, codec: &Codec) -> anyhow::Result<(Outcome, u64, u64)> {
        let (decoded, raw_bytes, wire_bytes) = round_trip(&self.prefix, self.cut, codec)?;
        let output = self.stages.run(StageRange::new(self.cut, self.bundle.stage_count()), &decoded)?;
        Ok((Outcome::from_last_cut(&output)?, raw_bytes, wire_bytes))
    }

    /// The table's row for `codec`, against the raw codec's outcome at this cut.
    fn row(&self, codec: &Codec, reference: &Outcome) -> anyhow::Result<Row> {
        let (outcome, raw_bytes, wire_bytes) = self.through(codec)?;
        let samples = self.test.len();
        Ok(Row {
            cut: self.cut,
            codec: *codec,
            raw_bytes,
            wire_bytes,
            agreement: percent(outcome.matches(&reference.predictions), samples),
            accuracy: percent(outcome.matches(&self.test.label), samples),
            max_logit_diff: outcome.max_abs_diff(reference),
        })
    }
}

fn print_row(bundle: &Bundle, row: &Row) {
    println!(
        "{:<24} {:<16} {:>11} {:>11} {:>6.1}% {:>9.2}% {:>8.2}% {:>12.4}",
        format!("{} {}", row.cut, bundle.cut(row.cut).name.trim_start_matches("after ")),
        row.codec.to_string(),
        thousands(row.raw_bytes),
        thousands(row.wire_bytes),
        row.saved_percent(),
        row.agreement,
        row.accuracy,
        row.max_logit_diff
    );
}

/// The summary per codec over all cuts.
fn print_summary(codecs: &[Codec], rows: &[Row]) -> anyhow::Result<()> {
    println!();
    println!(
        "{:<16} {:>6} {:>15} {:>10} {:>13} {:>13} {:>13}",
        "codec", "cuts", "min agreement", "worst cut", "min accuracy", "max |dlogit|", "median saved"
    );
    for codec in codecs {
        let of: Vec<&Row> = rows.iter().filter(|r| r.codec == *codec).collect();
        // The worst cut: the lowest agreement, then (when they all agree) the largest logit change.
        let Some(worst) = of.iter().min_by(|a, b| a.agreement.total_cmp(&b.agreement).then(b.max_logit_diff.total_cmp(&a.max_logit_diff))) else {
            continue;
        };
        let min_accuracy = of.iter().map(|r| r.accuracy).fold(f64::INFINITY, f64::min);
        let max_logit_diff = of.iter().map(|r| r.max_logit_diff).fold(0.0, f64::max);
        let saved: Vec<f64> = of.iter().map(|r| r.saved_percent()).collect();
        println!(
            "{:<16} {:>6} {:>14.2}% {:>10} {:>12.2}% {:>13.4} {:>12.1}%",
            codec.to_string(),
            of.len(),
            worst.agreement,
            worst.cut,
            min_accuracy,
            max_logit_diff,
            median(&saved)?
        );
    }
    Ok(())
}
