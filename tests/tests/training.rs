//! Split training over gRPC on 127.0.0.1 against training the whole model in one process:
//! after the same steps on the same data with the same seed, both sides' parameters and
//! buffers must equal the monolithic run's (at most 1e-5 apart), for SGD with momentum and
//! Adam, on the digits CNN and on a residual model with batch norm and dropout whose cut
//! carries two tensors, in the split and the U-shaped (labels stay on the edge) variants.
//! Also: resuming from checkpoints, trained weights written back into a bundle, one session
//! per bundle, the errors of a misused session, and checkpoint namespaces and quotas.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use cleave_client::{connect, Link};
use cleave_common::config::Limits;
use cleave_common::pb::{self, train_frame, TrainFrame};
use cleave_common::security::ServerSecurity;
use cleave_common::training::TrainableStages;
use cleave_common::wire::{Codec, Direction, PayloadMeta, PayloadSender};
use cleave_common::{Bundle, DeviceSpec, StageRange};
use cleave_host::config::EdgeConfig;
use cleave_host::report::OutputMode;
use cleave_host::training::{checkpoint_name, checkpoint_state, TrainingSummary, HOST_CHECKPOINT};
use cleave_host::{LoopbackServer, RunOptions};
use cleave_server::TrainingOptions;
use cleave_tests::{bundle_dir, test_file};
use tch::{Kind, Tensor};
use tokio_stream::StreamExt;

const SGD: &str = "{ kind: sgd, lr: 0.05, momentum: 0.9, weight_decay: 0.0005 }";
const ADAM: &str = "{ kind: adam, lr: 0.01, weight_decay: 0.0001 }";
const STEPS: u64 = 20;

/// One training run, written as an edge config.
struct Run<'a> {
    bundle: &'a str,
    mode: &'a str,
    split: usize,
    tail: Option<usize>,
    optimizer: &'a str,
    data: (PathBuf, PathBuf),
    max_steps: u64,
    resume: Option<String>,
    write_bundle: bool,
    /// The boundary codec (gradients come back with it too).
    codec: &'a str,
    /// A server of the test's own (otherwise a loopback one).
    server: Option<String>,
    /// `--force`, `--resume` or neither.
    output_mode: OutputMode,
    /// More lines of `train:` (a schedule, clipping).
    extra: &'a str,
    /// Micro-batches per step.
    microbatches: u64,
}

impl<'a> Run<'a> {
    fn new(bundle: &'a str, mode: &'a str, split: usize, optimizer: &'a str) -> Self {
        let data = match bundle {
            "digits" => (test_file("digits-train.safetensors"), test_file("digits-test.safetensors")),
            "bert" | "gpt2" => bert_data(),
            _ => bn_dropout_data(),
        };
        Self {
            bundle,
            mode,
            split,
            tail: None,
            optimizer,
            data,
            max_steps: STEPS,
            resume: None,
            write_bundle: false,
            codec: "raw",
            server: None,
            output_mode: OutputMode::Fresh,
            extra: "",
            microbatches: 1,
        }
    }

    fn u_shaped(mut self, tail: usize) -> Self {
        self.mode = "u-shaped";
        self.tail = Some(tail);
        self
    }

    /// Runs it (over a loopback server unless monolithic) with its output in `out`.
    fn train(&self, out: &Path) -> TrainingSummary {
        self.try_train(out, |yaml| yaml).unwrap_or_else(|e| panic!("{} {}: {e:#}", self.bundle, self.mode))
    }

    /// Runs it with its config text passed through `edit` first.
    fn try_train(&self, out: &Path, edit: impl FnOnce(String) -> String) -> anyhow::Result<TrainingSummary> {
        let tail = self.tail.map(|t| format!("  tail: {t}\n")).unwrap_or_default();
        let write_bundle = if self.write_bundle { "  write_bundle: true\n" } else { "" };
        let resume = self.resume.as_ref().map(|r| format!("  resume: {r}\n")).unwrap_or_default();
        let yaml = format!(
            "server: {server}\nbundle: {bundle}\nsplit: {split}\ndevice: cpu\noutput: {out}\ncodec: \"{codec}\"\nloopback: {{ device: cpu }}\n\
             train:\n  mode: {mode}\n{tail}  data: {{ train: {train}, test: {test}, targets: label }}\n  epochs: 5\n  batch_size: 16\n  \
             eval_batch_size: 16\n  shuffle_seed: 3\n  seed: 11\n  max_steps: {steps}\n  optimizer: {opt}\n  loss: cross-entropy\n{write_bundle}{resume}{extra}  microbatches: {microbatches}\n",
            server = self.server.as_deref().unwrap_or("http://127.0.0.1:1"),
            bundle = bundle_dir(self.bundle).display(),
            split = self.split,
            out = out.display(),
            mode = self.mode,
            train = self.data.0.display(),
            test = self.data.1.display(),
            steps = self.max_steps,
            opt = self.optimizer,
            codec = self.codec,
            extra = self.extra,
            microbatches = self.microbatches,
        );
        std::fs::create_dir_all(out).unwrap();
        let path = out.join("edge.yaml");
        std::fs::write(&path, edit(yaml)).unwrap();
        let config = EdgeConfig::load(&path)?;
        let opts =
            RunOptions { loopback: self.mode != "monolithic" && self.server.is_none(), output_mode: self.output_mode, ..RunOptions::default() };
        Ok(runtime().block_on(cleave_host::training::run(config, opts))?)
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
}

/// Deterministic noise in [0, 1) of `shape`, from `offset` on. Never libtorch's generator: it
/// is process-wide, and training seeds it for every stage's dropout under a lock that a test
/// drawing from it in parallel would not take (it changed another test's masks).
fn noise(shape: &[i64], offset: i64) -> Tensor {
    let n: i64 = shape.iter().product();
    let t = Tensor::arange_start(offset, offset + n, (Kind::Double, tch::Device::Cpu));
    let h = (t * 12.9898).sin() * 43758.5453;
    (&h - h.floor()).to_kind(Kind::Float).view(shape)
}

/// 96 random inputs for `tests.models:bn_dropout_residual` ([4, 6, 6]) with labels that
/// depend on them (3 classes), written once per test process.
fn bn_dropout_data() -> (PathBuf, PathBuf) {
    static DIR: std::sync::OnceLock<tempfile::TempDir> = std::sync::OnceLock::new();
    let dir = DIR.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        for (name, rows, offset) in [("train", 96, 0), ("test", 32, 96)] {
            let x = noise(&[rows, 4, 6, 6], offset * 144) * 3.4 - 1.7;
            let label = x.mean_dim(&[2i64, 3][..], false, Kind::Float).narrow(1, 0, 3).argmax(1, false);
            Tensor::write_safetensors(&[("x", &x), ("label", &label)], dir.path().join(format!("{name}.safetensors"))).unwrap();
        }
        dir
    });
    (dir.path().join("train.safetensors"), dir.path().join("test.safetensors"))
}

/// 96 token sequences of 12 for the small BERT-like classifier (`make test-bundles`: a
/// vocabulary of 500, 3 labels): ids, an attention mask with right padding, and labels that
/// depend on the ids, written once per test process.
fn bert_data() -> (PathBuf, PathBuf) {
    static DIR: std::sync::OnceLock<tempfile::TempDir> = std::sync::OnceLock::new();
    let dir = DIR.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        for (name, rows, offset) in [("train", 96, 0), ("test", 32, 96)] {
            let ids = (noise(&[rows, 12], offset * 12) * 500.0).to_kind(Kind::Int64);
            let lengths = (noise(&[rows, 1], 10_000 + offset) * 6.0).to_kind(Kind::Int64) + 7;
            let mask = Tensor::arange(12, (Kind::Int64, tch::Device::Cpu)).unsqueeze(0).lt_tensor(&lengths).to_kind(Kind::Int64);
            let label = (&ids * &mask).sum_dim_intlist(&[1i64][..], false, Kind::Int64).remainder(3);
            let tensors = [("input_ids", &ids), ("attention_mask", &mask), ("label", &label)];
            Tensor::write_safetensors(&tensors, dir.path().join(format!("{name}.safetensors"))).unwrap();
        }
        dir
    });
    (dir.path().join("train.safetensors"), dir.path().join("test.safetensors"))
}

/// The server's checkpoint `name` of a run's output: in the one namespace holding it.
fn server_checkpoint(out: &Path, name: &str) -> Option<PathBuf> {
    let namespaces = std::fs::read_dir(out.join("checkpoints/server")).ok()?;
    let found: Vec<PathBuf> = namespaces.map(|ns| ns.unwrap().path().join(format!("{name}.safetensors"))).filter(|p| p.is_file()).collect();
    assert!(found.len() <= 1, "{name} in several namespaces: {found:?}");
    found.into_iter().next()
}

/// The parameters and buffers after `step` steps: the host's checkpoint, plus the server's
/// for a split run.
fn trained_state(out: &Path, step: u64) -> HashMap<String, Tensor> {
    let name = checkpoint_name(step);
    let mut state = checkpoint_state(&out.join("checkpoints").join(&name).join(HOST_CHECKPOINT)).unwrap();
    if let Some(server) = server_checkpoint(out, &name) {
        let theirs = checkpoint_state(&server).unwrap();
        for key in theirs.keys().filter(|k| !k.starts_with("optim.")) {
            assert!(!state.contains_key(key), "{key} is in both sides' checkpoints");
        }
        state.extend(theirs);
    }
    state.retain(|k, _| k.starts_with("param.") || k.starts_with("buffer."));
    state
}

fn initial_state(bundle: &str) -> HashMap<String, Tensor> {
    let bundle = Bundle::open(bundle_dir(bundle)).unwrap();
    let stages = TrainableStages::load(&bundle, StageRange::all(&bundle), DeviceSpec::Cpu, 0).unwrap();
    stages.state().into_iter().map(|(k, t)| (k, t.copy())).collect()
}

/// The largest absolute difference over every tensor; the key sets must match.
fn max_abs_diff(a: &HashMap<String, Tensor>, b: &HashMap<String, Tensor>) -> f64 {
    let mut keys: Vec<&String> = a.keys().collect();
    keys.sort();
    let mut theirs: Vec<&String> = b.keys().collect();
    theirs.sort();
    assert_eq!(keys, theirs, "the same parameters and buffers on both sides");
    keys.iter().map(|k| (&a[*k].to_kind(Kind::Double) - &b[*k].to_kind(Kind::Double)).abs().max().double_value(&[])).fold(0.0, f64::max)
}

/// Split (or U-shaped) training equals monolithic training, and both moved the weights.
fn equals_monolithic(split_run: Run, label: &str) {
    let tmp = tempfile::tempdir().unwrap();
    let mono = Run {
        mode: "monolithic",
        tail: None,
        extra: split_run.extra,
        microbatches: split_run.microbatches,
        ..Run::new(split_run.bundle, "monolithic", 0, split_run.optimizer)
    };
    let mono_summary = mono.train(&tmp.path().join("mono"));
    let split_summary = split_run.train(&tmp.path().join("split"));
    assert_eq!((mono_summary.total_steps, split_summary.total_steps), (STEPS, STEPS), "{label}");
    let mono_state = trained_state(&tmp.path().join("mono"), STEPS);
    let split_state = trained_state(&tmp.path().join("split"), STEPS);
    let diff = max_abs_diff(&split_state, &mono_state);
    assert!(diff <= 1e-5, "{label}: split and monolithic parameters differ by {diff:e} after {STEPS} steps");
    let params = |state: &HashMap<String, Tensor>| -> HashMap<String, Tensor> {
        state.iter().filter(|(k, _)| k.starts_with("param.")).map(|(k, t)| (k.clone(), t.shallow_clone())).collect()
    };
    let moved = max_abs_diff(&params(&mono_state), &params(&initial_state(split_run.bundle)));
    assert!(moved > 1e-3, "{label}: training moved the weights by only {moved:e}");
    for (name, batches) in mono_state.iter().filter(|(k, _)| k.ends_with("num_batches_tracked")) {
        // Batch norm counts each micro-batch.
        assert_eq!(batches.int64_value(&[]), (STEPS * split_run.microbatches) as i64, "{label}: {name}");
    }
    // The same model evaluates alike on the held-out data.
    let (a, b) = (mono_summary.epochs.last().unwrap(), split_summary.epochs.last().unwrap());
    assert!((a.test_loss - b.test_loss).abs() < 1e-5, "{label}: test loss {} vs {}", a.test_loss, b.test_loss);
    eprintln!("{label}: max |split - monolithic| = {diff:e} after {STEPS} steps (weights moved up to {moved:.3})");
}

#[test]
fn digits_split_sgd_momentum_equals_monolithic() {
    equals_monolithic(Run::new("digits", "split", 7, SGD), "digits split at 7, SGD momentum");
}

#[test]
fn digits_split_adam_equals_monolithic() {
    // Boundaries and gradients through a lossless compressing codec change nothing.
    let run = Run { codec: "shuffle+zstd", ..Run::new("digits", "split", 4, ADAM) };
    equals_monolithic(run, "digits split at 4, Adam, shuffle+zstd");
}

#[test]
fn bn_dropout_split_sgd_momentum_equals_monolithic() {
    // Cut 3 carries two tensors (the skip and the main path), so two gradients come back.
    equals_monolithic(Run::new("bn_dropout", "split", 3, SGD), "bn_dropout split at 3, SGD momentum");
}

#[test]
fn bn_dropout_split_adam_equals_monolithic() {
    equals_monolithic(Run::new("bn_dropout", "split", 3, ADAM), "bn_dropout split at 3, Adam");
}

#[test]
fn bert_classifier_split_adam_equals_monolithic() {
    // A transformers model (torch.export's graph): token ids and a mask cross split 0's
    // boundary, the hidden states [B, S, 32] and the attention mask split 3's; dropout
    // (attention dropout included) in every stage.
    equals_monolithic(Run::new("bert", "split", 3, ADAM), "bert split at 3, Adam");
}

#[test]
fn tied_embedding_and_head_are_refused_naming_both_and_how_to_untie() {
    let tmp = tempfile::tempdir().unwrap();
    for (mode, split) in [("split", 4), ("monolithic", 0)] {
        let err = Run::new("gpt2", mode, split, ADAM).try_train(tmp.path(), |yaml| yaml).unwrap_err();
        let message = format!("{err:#}");
        assert!(
            message.contains("transformer.wte.weight and lm_head.weight are one tensor (tied weights) held by stages 1 and ")
                && message.contains("--hf-config tie_word_embeddings=false"),
            "{mode}: {message}"
        );
    }
}

#[test]
fn digits_u_shaped_adam_equals_monolithic() {
    // The edge keeps [0, 4) and [10, 12): the last dropout, the last linear layer and the loss.
    equals_monolithic(Run::new("digits", "split", 4, ADAM).u_shaped(10), "digits u-shaped 4..10, Adam");
}

#[test]
fn bn_dropout_u_shaped_sgd_momentum_equals_monolithic() {
    equals_monolithic(Run::new("bn_dropout", "split", 2, SGD).u_shaped(8), "bn_dropout u-shaped 2..8, SGD momentum");
}

/// A warm-up, a cosine decay and clipping that the digits model's gradients exceed on some
/// steps (their global norm is about 3 to 7 at these settings).
const SCHEDULED_AND_CLIPPED: &str =
    "  schedule: { warmup: { steps: 5, start_factor: 0.1 }, decay: { kind: cosine, total_steps: 15, min_lr: 0.001 } }\n  clip_grad_norm: 4.5\n";

#[test]
fn a_schedule_and_clipping_across_the_split_equal_monolithic() {
    // Adam turns a last-bit difference in the clipped gradients into a visible one: both
    // sides must scale by the very coefficient clip_grad_norm_ computes for the whole model.
    equals_monolithic(Run { extra: SCHEDULED_AND_CLIPPED, ..Run::new("digits", "split", 4, ADAM) }, "digits split at 4, Adam, scheduled, clipped");
    let u_shaped = Run { extra: SCHEDULED_AND_CLIPPED, ..Run::new("bn_dropout", "split", 2, SGD).u_shaped(8) };
    equals_monolithic(u_shaped, "bn_dropout u-shaped 2..8, SGD momentum, scheduled, clipped");
    // Both took effect: the same run without them ends elsewhere.
    let tmp = tempfile::tempdir().unwrap();
    Run { extra: SCHEDULED_AND_CLIPPED, ..Run::new("digits", "monolithic", 0, ADAM) }.train(&tmp.path().join("with"));
    Run { extra: "  clip_grad_norm: 4.5\n", ..Run::new("digits", "monolithic", 0, ADAM) }.train(&tmp.path().join("clipped"));
    Run::new("digits", "monolithic", 0, ADAM).train(&tmp.path().join("plain"));
    let [with, clipped, plain] = ["with", "clipped", "plain"].map(|d| trained_state(&tmp.path().join(d), STEPS));
    for (a, b, what) in [(&with, &clipped, "the schedule"), (&clipped, &plain, "clipping")] {
        let diff = max_abs_diff(a, b);
        assert!(diff > 1e-3, "{what} changed the weights by only {diff:e}");
    }
}

#[test]
fn micro_batches_across_the_split_equal_monolithic_gradient_accumulation() {
    // 16 samples a step in micro-batches of 6, 6 and 4 (torch.chunk), clipped by the norm of
    // the summed gradients; the U-shaped model has batch norm and dropout in both parts.
    let run = Run { extra: "  clip_grad_norm: 3.5\n", microbatches: 3, ..Run::new("digits", "split", 4, ADAM) };
    equals_monolithic(run, "digits split at 4, Adam, 3 micro-batches, clipped");
    let u_shaped = Run { microbatches: 4, ..Run::new("bn_dropout", "split", 2, SGD).u_shaped(8) };
    equals_monolithic(u_shaped, "bn_dropout u-shaped 2..8, SGD momentum, 4 micro-batches");
}

#[test]
fn resuming_from_checkpoints_gives_the_uninterrupted_parameters() {
    let tmp = tempfile::tempdir().unwrap();
    Run::new("digits", "split", 7, ADAM).train(&tmp.path().join("whole"));
    // 10 steps, then a new process-like run (new session, new optimizer objects) resumes
    // both sides from checkpoint step-10 in the same output directory.
    let interrupted = tmp.path().join("interrupted");
    Run { max_steps: 10, ..Run::new("digits", "split", 7, ADAM) }.train(&interrupted);
    let resumed = Run { resume: Some(checkpoint_name(10)), ..Run::new("digits", "split", 7, ADAM) }.train(&interrupted);
    assert_eq!(resumed.resumed_from_step, Some(10));
    // The server's side continued in the namespace it resumed from.
    assert_eq!(std::fs::read_dir(interrupted.join("checkpoints/server")).unwrap().count(), 1, "one namespace");
    assert_eq!(resumed.total_steps, STEPS);
    let whole = checkpoint_state(&tmp.path().join("whole/checkpoints/step-20").join(HOST_CHECKPOINT)).unwrap();
    let again = checkpoint_state(&interrupted.join("checkpoints/step-20").join(HOST_CHECKPOINT)).unwrap();
    // Optimizer state included: a resumed run is the same computation, bit for bit.
    assert_eq!(max_abs_diff(&whole, &again), 0.0, "host side");
    let diff = max_abs_diff(&trained_state(&tmp.path().join("whole"), STEPS), &trained_state(&interrupted, STEPS));
    assert_eq!(diff, 0.0, "both sides");
}

#[test]
fn an_earlier_training_run_is_refused_unless_forced_or_continued_from_its_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    let run = |max_steps, resume: Option<&str>, output_mode| Run {
        max_steps,
        resume: resume.map(String::from),
        output_mode,
        ..Run::new("digits", "monolithic", 0, SGD)
    };
    run(3, None, OutputMode::Fresh).train(&out);
    let first = std::fs::read_to_string(out.join("summary.json")).unwrap();
    let refused = |r: Run, expected: &[&str]| {
        let text = format!("{:#}", r.try_train(&out, |y| y).map(|_| ()).unwrap_err());
        assert!(expected.iter().all(|e| text.contains(e)), "{text}");
        assert_eq!(std::fs::read_to_string(out.join("summary.json")).unwrap(), first, "nothing overwritten: {text}");
    };
    refused(run(2, None, OutputMode::Fresh), &["holds an earlier training run (summary.json", "checkpoints)", "--force", "train.resume: step-N"]);
    refused(run(2, None, OutputMode::Resume), &["set `train.resume: step-N`"]);
    refused(run(4, Some("step-3"), OutputMode::Force), &["--force would remove the checkpoint"]);
    // `train.resume` continues the run in its own directory.
    let resumed = run(4, Some("step-3"), OutputMode::Fresh).train(&out);
    assert_eq!((resumed.resumed_from_step, resumed.total_steps), (Some(3), 4));
    // --force replaces it, checkpoints included.
    let forced = run(2, None, OutputMode::Force).train(&out);
    assert_eq!((forced.resumed_from_step, forced.total_steps), (None, 2));
    let mut left: Vec<String> = std::fs::read_dir(out.join("checkpoints")).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    left.sort();
    assert_eq!(left, [checkpoint_name(2)], "only the forced run's checkpoint");
}

#[test]
fn trained_weights_written_back_serve_split_inference() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    let written = out.join(cleave_host::training::TRAINED_BUNDLE);
    Run { write_bundle: true, ..Run::new("digits", "split", 7, SGD) }.train(&out);
    let original = Bundle::open(bundle_dir("digits")).unwrap();
    let trained = Bundle::open(&written).unwrap();
    assert_ne!(trained.id(), original.id());
    // The weights in the new stage files are the checkpoints' ...
    let stages = TrainableStages::load(&trained, StageRange::all(&trained), DeviceSpec::Cpu, 0).unwrap();
    let in_bundle: HashMap<String, Tensor> = stages.state().into_iter().collect();
    assert_eq!(max_abs_diff(&in_bundle, &trained_state(&out, STEPS)), 0.0);
    // ... and its references were recomputed: every split of the new bundle reproduces them.
    for batch in trained.reference_batches() {
        let report = cleave_common::verify::verify_splits(&trained, DeviceSpec::Cpu, batch).unwrap();
        assert!(report.passed(), "batch {batch}: {}", cleave_tables::verify_table(&report));
    }
}

/// An open `Train` stream: the frames going out, the replies coming in.
type TrainStream = (tokio::sync::mpsc::Sender<TrainFrame>, tonic::Streaming<pb::TrainReply>);

/// Opens a training session on `url` and returns the first reply (opened, or the error).
async fn open_session(url: &str, bundle: &Bundle, open: pb::OpenSession) -> (TrainStream, pb::TrainReply) {
    let mut session = connect(url, bundle, &Link::plain()).await.unwrap();
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tx.send(TrainFrame { kind: Some(train_frame::Kind::Open(open)) }).await.unwrap();
    let mut request = tonic::Request::new(tokio_stream::wrappers::ReceiverStream::new(rx));
    request.metadata_mut().insert(cleave_common::protocol::BUNDLE_ID_METADATA, bundle.id().parse().unwrap());
    let mut replies = session.client.train(request).await.unwrap().into_inner();
    let first = replies.next().await.unwrap().unwrap();
    ((tx, replies), first)
}

fn open_digits(start: u32, end: u32, loss: &str) -> pb::OpenSession {
    pb::OpenSession {
        start,
        end,
        optimizer: Some(pb::Optimizer { kind: "sgd".into(), lr: 0.1, ..Default::default() }),
        loss: loss.into(),
        seed: 1,
        resume: String::new(),
        ..Default::default()
    }
}

fn error_of(reply: &pb::TrainReply) -> (tonic::Code, String) {
    let e = reply.error.as_ref().unwrap_or_else(|| panic!("expected an error, got {reply:?}"));
    (tonic::Code::from_i32(e.code), e.message.clone())
}

#[test]
fn one_training_session_per_bundle_unless_configured() {
    let bundle = Bundle::open(bundle_dir("digits")).unwrap();
    runtime().block_on(async {
        let server = LoopbackServer::start(bundle.dir(), DeviceSpec::Cpu, Limits::default()).await.unwrap();
        let (first, opened) = open_session(&server.url, &bundle, open_digits(7, 12, "cross-entropy")).await;
        assert!(opened.opened.is_some(), "{opened:?}");
        let (_second, refused) = open_session(&server.url, &bundle, open_digits(7, 12, "cross-entropy")).await;
        let (code, message) = error_of(&refused);
        assert_eq!(code, tonic::Code::ResourceExhausted);
        for says in
            ["already being trained by session s1", "its host last heard from", "600 s, `training.session_idle_timeout`", "concurrent_sessions"]
        {
            assert!(message.contains(says), "{says:?} in {message}");
        }
        // Closing the first session frees the bundle.
        drop(first);
        let mut reopened = None;
        for _ in 0..50 {
            let (tx, reply) = open_session(&server.url, &bundle, open_digits(7, 12, "cross-entropy")).await;
            if reply.opened.is_some() {
                reopened = Some(tx);
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        assert!(reopened.is_some(), "a new session opens once the first is closed");
        // Shutting down waits for open streams: close the session first.
        drop(reopened);
        server.shutdown().await.unwrap();

        let options = TrainingOptions { checkpoint_dir: None, concurrent_sessions: true, ..TrainingOptions::default() };
        let server =
            LoopbackServer::start_configured(bundle.dir(), DeviceSpec::Cpu, Limits::default(), ServerSecurity::default(), options).await.unwrap();
        let (_a, a) = open_session(&server.url, &bundle, open_digits(7, 12, "cross-entropy")).await;
        let (_b, b) = open_session(&server.url, &bundle, open_digits(4, 12, "cross-entropy")).await;
        assert!(a.opened.is_some() && b.opened.is_some(), "separate copies: {a:?} {b:?}");
        assert_ne!(a.opened.unwrap().session_id, b.opened.unwrap().session_id);
    });
}

#[test]
fn a_session_that_cannot_work_is_refused_with_the_reason() {
    let bundle = Bundle::open(bundle_dir("digits")).unwrap();
    let options = TrainingOptions { checkpoint_dir: None, concurrent_sessions: true, ..TrainingOptions::default() };
    runtime().block_on(async {
        let server =
            LoopbackServer::start_configured(bundle.dir(), DeviceSpec::Cpu, Limits::default(), ServerSecurity::default(), options).await.unwrap();
        let cases = [
            (open_digits(7, 7, "cross-entropy"), "non-empty range"),
            (open_digits(7, 13, "cross-entropy"), "within [0, 12]"),
            (open_digits(7, 12, ""), "computes the loss"),
            (open_digits(4, 10, "cross-entropy"), "the edge computes the loss"),
            (open_digits(7, 12, "hinge"), "not a loss"),
            (
                pb::OpenSession {
                    optimizer: Some(pb::Optimizer { kind: "adam".into(), lr: 0.1, beta1: 0.9, beta2: 1.5, ..Default::default() }),
                    ..open_digits(7, 12, "mse")
                },
                "betas[1]",
            ),
            (pb::OpenSession { optimizer: None, ..open_digits(7, 12, "mse") }, "no optimizer"),
            (pb::OpenSession { clip_grad_norm: -1.0, ..open_digits(7, 12, "mse") }, "clip_grad_norm must be a finite number above 0"),
            (pb::OpenSession { clip_grad_norm: f64::NAN, ..open_digits(7, 12, "mse") }, "clip_grad_norm must be"),
            (
                pb::OpenSession { schedule: Some(pb::Schedule { decay: "exponential".into(), ..Default::default() }), ..open_digits(7, 12, "mse") },
                "decay \"exponential\" is not one of",
            ),
            (
                pb::OpenSession {
                    schedule: Some(pb::Schedule { decay: "step".into(), gamma: 0.5, ..Default::default() }),
                    ..open_digits(7, 12, "mse")
                },
                "decay.step_size must be at least 1",
            ),
            (
                pb::OpenSession {
                    schedule: Some(pb::Schedule { warmup_steps: 3, warmup_start_factor: 0.0, ..Default::default() }),
                    ..open_digits(7, 12, "mse")
                },
                "warmup.start_factor",
            ),
            (pb::OpenSession { resume: "step-3".into(), ..open_digits(7, 12, "mse") }, "no checkpoint directory"),
        ];
        for (open, expected) in cases {
            let (_tx, reply) = open_session(&server.url, &bundle, open.clone()).await;
            let (code, message) = error_of(&reply);
            assert!(message.contains(expected), "{open:?}: {code:?} {message}");
        }
    });
}

/// Sends one payload call and returns its reply frames (up to the last, or an error).
async fn call(
    stream: &mut TrainStream,
    id: u64,
    phase: pb::Phase,
    meta: (u32, Direction),
    boundary: &cleave_common::Boundary,
) -> Vec<pb::TrainReply> {
    call_with(stream, id, (phase, meta), boundary, |_| ()).await
}

/// [`call`] with its frame passed through `edit` before it is sent.
async fn call_with(
    stream: &mut TrainStream,
    id: u64,
    (phase, meta): (pb::Phase, (u32, Direction)),
    boundary: &cleave_common::Boundary,
    edit: impl FnOnce(&mut pb::TrainPayloadFrame),
) -> Vec<pb::TrainReply> {
    let meta = PayloadMeta { request_id: id, split: meta.0, direction: meta.1 };
    let encoded = PayloadSender::plain().encode(meta, &Codec::RAW, boundary).unwrap();
    let mut frame = pb::TrainPayloadFrame {
        request_id: id,
        phase: phase as i32,
        header: encoded.envelope,
        data: encoded.data.to_vec().into(),
        last: true,
        ..Default::default()
    };
    edit(&mut frame);
    stream.0.send(TrainFrame { kind: Some(train_frame::Kind::Payload(frame)) }).await.unwrap();
    let mut replies = Vec::new();
    loop {
        let reply = stream.1.next().await.unwrap().unwrap();
        let last = reply.last;
        assert_eq!(reply.request_id, id);
        replies.push(reply);
        if last {
            return replies;
        }
    }
}

#[test]
fn a_misused_call_gets_its_error_and_the_session_goes_on() {
    use cleave_common::{Boundary, Value};
    let bundle = Bundle::open(bundle_dir("digits")).unwrap();
    let at_cut7 = |with_targets: Option<&[i64]>| {
        let mut values = vec![("features_6".to_string(), Value::Tensor(Tensor::ones([2, 32, 4, 4], (Kind::Float, tch::Device::Cpu))))];
        if let Some(t) = with_targets {
            values.push((cleave_common::training::TARGETS_VALUE.to_string(), Value::Tensor(Tensor::from_slice(t))));
        }
        Boundary { values }
    };
    let message = |replies: &[pb::TrainReply]| error_of(replies.last().unwrap()).1;
    runtime().block_on(async {
        let server = LoopbackServer::start(bundle.dir(), DeviceSpec::Cpu, Limits::default()).await.unwrap();
        let (mut stream, opened) = open_session(&server.url, &bundle, open_digits(7, 12, "cross-entropy")).await;
        assert!(opened.opened.is_some(), "{opened:?}");
        let forward = (7, Direction::Request);
        let replies = call(&mut stream, 1, pb::Phase::Forward, forward, &at_cut7(None)).await;
        assert!(message(&replies).contains("@targets"), "{}", message(&replies));
        let replies = call(&mut stream, 2, pb::Phase::Forward, forward, &at_cut7(Some(&[3, 10]))).await;
        assert!(message(&replies).contains("class indices must be in 0..10"), "{}", message(&replies));
        let grads = Boundary { values: vec![("classifier_4".into(), Value::Tensor(Tensor::ones([2, 10], (Kind::Float, tch::Device::Cpu))))] };
        let replies = call(&mut stream, 3, pb::Phase::Backward, (12, Direction::Gradient), &grads).await;
        assert!(message(&replies).contains("without a pending forward"), "{}", message(&replies));
        let replies = call(&mut stream, 4, pb::Phase::Forward, (5, Direction::Request), &at_cut7(Some(&[3, 4]))).await;
        assert!(message(&replies).contains("the payload is at cut 5, this stream takes cut 7"), "{}", message(&replies));
        // The session is still open: a valid step gets the loss and the boundary's gradient.
        let replies = call(&mut stream, 5, pb::Phase::Forward, forward, &at_cut7(Some(&[3, 4]))).await;
        let last = replies.last().unwrap();
        assert!(last.error.is_none(), "{last:?}");
        assert!(last.loss.is_some_and(|l| l.is_finite() && l > 0.0), "{last:?}");
        let save = |id: u64, name: &str| TrainFrame { kind: Some(train_frame::Kind::Save(pb::SaveCheckpoint { request_id: id, name: name.into() })) };
        stream.0.send(save(6, "../elsewhere")).await.unwrap();
        let reply = stream.1.next().await.unwrap().unwrap();
        let (_, text) = error_of(&reply);
        assert!(text.contains("no checkpoint directory") || text.contains("checkpoint name"), "{text}");
    });
}

#[test]
fn a_clipping_session_steps_only_on_the_host_s_coefficient_after_its_last_micro_batch() {
    use cleave_common::{Boundary, Value};
    let bundle = Bundle::open(bundle_dir("digits")).unwrap();
    let step_input = Boundary {
        values: vec![
            ("features_6".to_string(), Value::Tensor(Tensor::ones([2, 32, 4, 4], (Kind::Float, tch::Device::Cpu)))),
            (cleave_common::training::TARGETS_VALUE.to_string(), Value::Tensor(Tensor::from_slice(&[3i64, 4]))),
        ],
    };
    let clip = |id: u64, coefficient: f32| TrainFrame { kind: Some(train_frame::Kind::Clip(pb::ClipStep { request_id: id, coefficient })) };
    let forward = (7, Direction::Request);
    runtime().block_on(async {
        let server = LoopbackServer::start(bundle.dir(), DeviceSpec::Cpu, Limits::default()).await.unwrap();
        // Without clipping, the server steps on its own and a coefficient has no use.
        let (mut plain, _) = open_session(&server.url, &bundle, open_digits(7, 12, "cross-entropy")).await;
        let replies = call(&mut plain, 1, pb::Phase::Forward, forward, &step_input).await;
        assert!(replies.last().unwrap().grad_norms.is_empty(), "{:?}", replies.last());
        plain.0.send(clip(2, 0.5)).await.unwrap();
        let (code, text) = error_of(&plain.1.next().await.unwrap().unwrap());
        assert!(text.contains("does not clip"), "{code:?} {text}");
        drop(plain);

        let open = pb::OpenSession { clip_grad_norm: 1.0, ..open_digits(7, 12, "cross-entropy") };
        let (mut stream, _) = open_when_free(&server.url, &bundle, open).await;
        stream.0.send(clip(1, 0.5)).await.unwrap();
        let (_, text) = error_of(&stream.1.next().await.unwrap().unwrap());
        assert!(text.contains("no step waiting"), "{text}");
        // A step's answer carries one norm per parameter gradient of stages [7, 12).
        let replies = call(&mut stream, 2, pb::Phase::Forward, forward, &step_input).await;
        let norms = &replies.last().unwrap().grad_norms;
        let parameters: usize = (7..12).map(|i| bundle.manifest().stages[i].parameter_names.as_ref().map_or(0, Vec::len)).sum();
        assert!(parameters > 0 && norms.len() == parameters && norms.iter().all(|n| n.is_finite() && *n >= 0.0), "{norms:?}");
        // The next step waits for the coefficient; one outside [0, 1] is refused and the step
        // still waits.
        let replies = call(&mut stream, 3, pb::Phase::Forward, forward, &step_input).await;
        assert!(error_of(replies.last().unwrap()).1.contains("waiting for the host's gradient norm"), "{replies:?}");
        for (id, bad) in [(4, -0.5), (5, 1.5), (6, f32::NAN)] {
            stream.0.send(clip(id, bad)).await.unwrap();
            let (code, text) = error_of(&stream.1.next().await.unwrap().unwrap());
            assert!(code == tonic::Code::InvalidArgument && text.contains("coefficient must be in [0, 1]"), "{bad}: {code:?} {text}");
        }
        stream.0.send(clip(7, 0.5)).await.unwrap();
        let reply = stream.1.next().await.unwrap().unwrap();
        assert_eq!(reply.stepped, Some(pb::StepTaken { step: 1 }), "{reply:?}");

        // Micro-batches come in order, each within its count and weighed in (0, 1]; the
        // step's norms come with its last, and only then does it wait for the coefficient.
        let part = |index: u32, count: u32, weight: f64| {
            move |f: &mut pb::TrainPayloadFrame| (f.microbatch, f.microbatches, f.loss_weight) = (index, count, weight)
        };
        for (id, (index, count, weight), expected) in [
            (8, (1, 2, 0.5), "micro-batch 1 of 2 arrived where micro-batch 0 of 2 was due"),
            (9, (2, 2, 0.5), "micro-batch 2 of 2: the index must be below the count"),
            (10, (0, 2, 1.5), "loss weight must be in (0, 1]"),
        ] {
            let replies = call_with(&mut stream, id, (pb::Phase::Forward, forward), &step_input, part(index, count, weight)).await;
            assert!(error_of(replies.last().unwrap()).1.contains(expected), "{expected}: {replies:?}");
        }
        let replies = call_with(&mut stream, 11, (pb::Phase::Forward, forward), &step_input, part(0, 2, 0.5)).await;
        assert!(replies.last().unwrap().error.is_none() && replies.last().unwrap().grad_norms.is_empty(), "{replies:?}");
        let replies = call_with(&mut stream, 12, (pb::Phase::Forward, forward), &step_input, part(0, 3, 0.5)).await;
        assert!(error_of(replies.last().unwrap()).1.contains("micro-batch 0 of 3 arrived where micro-batch 1 of 2 was due"), "{replies:?}");
        let replies = call_with(&mut stream, 13, (pb::Phase::Forward, forward), &step_input, part(1, 2, 0.5)).await;
        assert_eq!(replies.last().unwrap().grad_norms.len(), parameters, "{replies:?}");
        stream.0.send(clip(14, 1.0)).await.unwrap();
        let reply = stream.1.next().await.unwrap().unwrap();
        assert_eq!(reply.stepped, Some(pb::StepTaken { step: 2 }), "{reply:?}");
        let replies = call(&mut stream, 15, pb::Phase::Forward, forward, &step_input).await;
        assert!(replies.last().unwrap().error.is_none(), "the next step goes on: {:?}", replies.last());
    });
}

#[test]
fn checkpoint_names_are_file_names() {
    let bundle = Bundle::open(bundle_dir("digits")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let options = TrainingOptions { checkpoint_dir: Some(dir.path().to_path_buf()), concurrent_sessions: false, ..TrainingOptions::default() };
    runtime().block_on(async {
        let server =
            LoopbackServer::start_configured(bundle.dir(), DeviceSpec::Cpu, Limits::default(), ServerSecurity::default(), options).await.unwrap();
        let (mut stream, opened) = open_session(&server.url, &bundle, open_digits(7, 12, "cross-entropy")).await;
        let namespace = opened.opened.unwrap().namespace;
        for (id, name) in [(1, "../elsewhere"), (2, ".hidden"), (3, "a/b"), (4, "")] {
            stream
                .0
                .send(TrainFrame { kind: Some(train_frame::Kind::Save(pb::SaveCheckpoint { request_id: id, name: name.into() })) })
                .await
                .unwrap();
            let reply = stream.1.next().await.unwrap().unwrap();
            let (code, text) = error_of(&reply);
            assert_eq!(code, tonic::Code::InvalidArgument, "{name}: {text}");
            assert!(text.contains("checkpoint name"), "{name}: {text}");
        }
        stream.0.send(TrainFrame { kind: Some(train_frame::Kind::Save(pb::SaveCheckpoint { request_id: 5, name: "ok-1".into() })) }).await.unwrap();
        let reply = stream.1.next().await.unwrap().unwrap();
        assert_eq!(reply.saved.map(|s| s.step), Some(0), "{:?}", reply.error);
        assert!(dir.path().join(&namespace).join("ok-1.safetensors").is_file());
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1, "nothing written outside the namespace");
        assert_eq!(std::fs::read_dir(dir.path().join(&namespace)).unwrap().count(), 1, "nothing written outside the name");
    });
}

#[test]
fn a_run_that_cannot_work_stops_before_training_and_says_why() {
    let tmp = tempfile::tempdir().unwrap();
    let split = Run::new("digits", "split", 7, SGD);
    type Edit = Box<dyn Fn(String) -> String>;
    let cases: Vec<(&str, Edit, &str)> = vec![
        ("targets", Box::new(|y: String| y.replace("targets: label", "targets: labels")), "no tensor \"labels\""),
        ("batch", Box::new(|y: String| y.replace("batch_size: 16\n  eval", "batch_size: 32\n  eval")), "above the bundle's largest batch 16"),
        ("resume", Box::new(|y: String| format!("{y}  resume: step-5\n")), "step-5/host.safetensors"),
        ("split", Box::new(|y: String| y.replace("split: 7", "split: 12")), "are empty"),
    ];
    for (name, edit, expected) in cases {
        let err = split.try_train(&tmp.path().join(name), edit).map(|_| ()).unwrap_err();
        let text = format!("{err:#}");
        assert!(text.contains(expected), "{name}: {text}");
        assert!(!tmp.path().join(name).join("checkpoints").exists(), "{name}: nothing trained, nothing written");
    }
    let u = Run::new("digits", "split", 7, SGD).u_shaped(7);
    let text = format!("{:#}", u.try_train(&tmp.path().join("u"), |y| y).map(|_| ()).unwrap_err());
    assert!(text.contains("[7, 7) are empty"), "{text}");
}

#[test]
fn a_missing_example_bundle_names_the_make_target_and_each_cause_once() {
    // The example training config, as on a fresh clone: its bundle and datasets not made yet.
    let root = tempfile::tempdir().unwrap();
    std::fs::create_dir(root.path().join("config")).unwrap();
    let config = root.path().join("config").join("train-digits.yaml");
    std::fs::copy(Path::new(env!("CARGO_MANIFEST_DIR")).join("../config/train-digits.yaml"), &config).unwrap();
    let config = EdgeConfig::load(&config).unwrap();
    let opts = RunOptions { loopback: true, ..RunOptions::default() };
    let err = runtime().block_on(cleave_host::training::run(config, opts)).unwrap_err();
    let expected = format!(
        "bundle {} does not exist (relative paths in {} start at {}: a config's own directory, or the project root for a config in a `config/` \
         directory): run `make digits-cnn`, which creates it",
        root.path().join("bundles/digits-cnn").display(),
        root.path().join("config/train-digits.yaml").display(),
        root.path().display()
    );
    assert_eq!(err.to_string(), expected);
    // As `host` prints it: the chain of causes adds nothing the message already says.
    assert_eq!(format!("{:#}", anyhow::Error::from(err)), expected);
}

#[test]
fn an_answer_above_the_payload_limit_is_refused_and_the_session_goes_on() {
    // The host accepts answers up to the server's `max_payload_bytes` (from `Info`), so the
    // server holds its answers to the same limit: a U-shaped forward whose boundary at `end`
    // is larger than the limit gets RESOURCE_EXHAUSTED, not a frame the host must refuse.
    let bundle = Bundle::open(bundle_dir("digits")).unwrap();
    let batch = 4;
    let input = cleave_common::value::synthetic_inputs(&bundle.manifest().inputs, bundle.sizes_at(batch)).unwrap();
    let limit = 2 * input.tensor_bytes() as u64;
    let n = bundle.stage_count();
    let end = (1..n)
        .find(|&k| bundle.cut(k).usable && bundle.cut(k).bytes_per_sample * batch as u64 > limit)
        .expect("a cut whose boundary outgrows twice the input");
    let limits = Limits { max_payload_bytes: limit, ..Limits::default() };
    runtime().block_on(async {
        let server = LoopbackServer::start(bundle.dir(), DeviceSpec::Cpu, limits).await.unwrap();
        let (mut stream, opened) = open_session(&server.url, &bundle, open_digits(0, end as u32, "")).await;
        assert!(opened.opened.is_some(), "{opened:?}");
        let replies = call(&mut stream, 1, pb::Phase::Evaluate, (0, Direction::Request), &input).await;
        let (code, message) = error_of(replies.last().unwrap());
        assert_eq!(code, tonic::Code::ResourceExhausted, "{message}");
        assert!(message.contains("max_payload_bytes") && message.contains(&limit.to_string()), "{message}");
        // The session goes on: the next call is answered (its answer is too large as well).
        let replies = call(&mut stream, 2, pb::Phase::Evaluate, (0, Direction::Request), &input).await;
        assert_eq!(error_of(replies.last().unwrap()).0, tonic::Code::ResourceExhausted);
    });
}

/// A server for `bundle` whose memory budget the test reads (and sizes with `peers`).
async fn budgeted_server(bundle: &Bundle, limits: Limits, peers: cleave_server::PeerLimits) -> (LoopbackServer, cleave_server::MemoryBudget) {
    let dir = bundle.dir().to_path_buf();
    let prepared = tokio::task::spawn_blocking(move || {
        cleave_server::PreparedServer::prepare(&dir, DeviceSpec::Cpu, limits, Default::default()).unwrap().with_peer_limits(peers).unwrap()
    })
    .await
    .unwrap();
    let budget = prepared.memory_budget();
    (LoopbackServer::serve(prepared).await.unwrap(), budget)
}

/// What the budget holds once the session has done with every call before (a `ClipStep` of
/// id `id`, refused by a session that does not clip, comes back only after them) and the
/// budget has stopped changing (answers are given back as written).
async fn settled_after(stream: &mut TrainStream, id: u64, budget: &cleave_server::MemoryBudget) -> u64 {
    let clip = TrainFrame { kind: Some(train_frame::Kind::Clip(pb::ClipStep { request_id: id, coefficient: 1.0 })) };
    stream.0.send(clip).await.unwrap();
    let reply = stream.1.next().await.unwrap().unwrap();
    assert!(error_of(&reply).1.contains("clip"), "{reply:?}");
    settled(budget).await
}

/// What the budget holds once it has stopped changing (answers are given back as written).
async fn settled(budget: &cleave_server::MemoryBudget) -> u64 {
    let mut last = budget.held_bytes();
    for _ in 0..500 {
        tokio::time::sleep(std::time::Duration::from_millis(30)).await;
        let now = budget.held_bytes();
        if now == last {
            return now;
        }
        last = now;
    }
    panic!("the budget never settled")
}

#[test]
fn a_u_shaped_forward_holds_its_graph_in_the_memory_budget_until_its_backward() {
    // What a forward leaves for its backward (the stages' saved tensors, from the manifest)
    // is reserved from the forward and given back with the backward.
    let bundle = Bundle::open(bundle_dir("digits")).unwrap();
    let (start, end, batch) = (2, 9, 16);
    let graph = bundle.graph_bytes_per_sample(start..end) * batch as u64;
    let input = cleave_common::value::synthetic_inputs(&bundle.cut(start).values, bundle.sizes_at(batch)).unwrap();
    let grads = cleave_common::value::synthetic_inputs(&bundle.cut(end).values, bundle.sizes_at(batch)).unwrap();
    runtime().block_on(async {
        let (server, budget) = budgeted_server(&bundle, Limits::default(), cleave_server::PeerLimits::default()).await;
        let (mut stream, opened) = open_session(&server.url, &bundle, open_digits(start as u32, end as u32, "")).await;
        assert!(opened.opened.is_some(), "{opened:?}");
        let replies = call(&mut stream, 1, pb::Phase::Forward, (start as u32, Direction::Request), &input).await;
        assert!(replies.last().unwrap().error.is_none(), "{replies:?}");
        let pending = settled_after(&mut stream, 10, &budget).await;
        let replies = call(&mut stream, 2, pb::Phase::Backward, (end as u32, Direction::Gradient), &grads).await;
        assert!(replies.last().unwrap().error.is_none(), "{replies:?}");
        let after = settled_after(&mut stream, 11, &budget).await;
        // With the graph pending the session keeps the forward's answer (the boundary at
        // `end`) for a resend; after the backward, the backward's (the gradient at `start`)
        // in its place. (The budget counts whole KiB.)
        let kib = |bytes: u64| bytes.div_ceil(1024) * 1024;
        let answers = |cut: usize| kib(bundle.cut(cut).bytes_per_sample * batch as u64);
        assert_eq!(pending + answers(start) - after, kib(graph) + answers(end), "{pending} held with the graph pending, {after} after its backward");
    });
}

#[test]
fn the_answers_a_session_keeps_for_resent_calls_are_held_in_the_memory_budget() {
    // A session keeps its last `pipeline_depth` answers for a host that resends a call; each
    // is held in the memory budget while kept. Here, with the loss on the server, each answer
    // is the gradient at cut 7: 16 x 2048 bytes.
    use cleave_common::{training::TARGETS_VALUE, Value};
    let bundle = Bundle::open(bundle_dir("digits")).unwrap();
    let (start, batch, depth) = (7, 16, 3);
    let answer = bundle.cut(start).bytes_per_sample * batch as u64;
    let mut input = cleave_common::value::synthetic_inputs(&bundle.cut(start).values, bundle.sizes_at(batch)).unwrap();
    input.values.push((TARGETS_VALUE.to_string(), Value::Tensor(Tensor::from_slice(&[3i64; 16]))));
    runtime().block_on(async {
        let (server, budget) = budgeted_server(&bundle, Limits::default(), cleave_server::PeerLimits::default()).await;
        let open = pb::OpenSession { pipeline_depth: depth, ..open_digits(start as u32, 12, "cross-entropy") };
        let (mut stream, opened) = open_session(&server.url, &bundle, open).await;
        assert!(opened.opened.is_some(), "{opened:?}");
        let mut held = vec![0];
        for id in 1..=5 {
            let replies = call(&mut stream, 2 * id, pb::Phase::Forward, (start as u32, Direction::Request), &input).await;
            assert!(replies.last().unwrap().error.is_none(), "{:?}", replies.last().unwrap().error);
            held.push(settled_after(&mut stream, 2 * id + 1, &budget).await);
        }
        // (The budget counts whole KiB.)
        let kept = answer.div_ceil(1024) * 1024;
        assert_eq!(held[3] - held[1], 2 * kept, "held after each step: {held:?}");
        assert_eq!(held[5], held[3], "no more than {depth} kept: {held:?}");
    });
}

#[test]
fn a_forward_whose_graph_does_not_fit_its_peer_s_share_is_refused_before_it_runs() {
    // resnet18 U-shaped over all but its head at batch 16: its graph (about 41 MiB) fits the
    // 64 MiB budget but not the peer's 16 MiB share, which is all a peer may keep; its 768 KiB
    // boundary fits.
    let bundle = Bundle::open(bundle_dir("resnet18")).unwrap();
    let (end, batch) = (64, 16);
    let graph = bundle.graph_bytes_per_sample(0..end) * batch as u64;
    let limits = Limits { max_payload_bytes: 8 << 20, ..Limits::default() };
    let (budget_bytes, share) = (64 << 20, 16 << 20);
    assert!(share < graph && graph < budget_bytes, "{graph}");
    let peers = cleave_server::PeerLimits { memory_budget_bytes: budget_bytes, memory_budget_bytes_per_peer: share, ..Default::default() };
    let input = cleave_common::value::synthetic_inputs(&bundle.manifest().inputs, bundle.sizes_at(batch)).unwrap();
    runtime().block_on(async {
        let (server, budget) = budgeted_server(&bundle, limits, peers).await;
        let (mut stream, opened) = open_session(&server.url, &bundle, open_digits(0, end as u32, "")).await;
        assert!(opened.opened.is_some(), "{opened:?}");
        let replies = call(&mut stream, 1, pb::Phase::Forward, (0, Direction::Request), &input).await;
        let (code, message) = error_of(replies.last().unwrap());
        assert_eq!(code, tonic::Code::ResourceExhausted, "{message}");
        assert!(message.contains("graph at batch 16") && message.contains("limits.memory_budget_bytes_per_peer"), "{message}");
        // Nothing stays held for it, and the session goes on: an evaluation is answered.
        let replies = call(&mut stream, 2, pb::Phase::Evaluate, (0, Direction::Request), &input).await;
        assert!(replies.last().unwrap().error.is_none(), "{:?}", replies.last().unwrap().error);
        assert!(settled(&budget).await < share, "{} held", budget.held_bytes());
    });
}

#[test]
fn a_training_payload_that_does_not_fit_its_session_s_cuts_is_refused_before_its_data() {
    // Boundaries come at the session's start (cut 7, plus the targets when the server holds
    // the loss), gradients at its end as floating-point tensors of that cut: what a payload
    // declares is checked from its first frame, and the session goes on.
    use cleave_common::{Boundary, Value};
    let bundle = Bundle::open(bundle_dir("digits")).unwrap();
    let cpu = (Kind::Float, tch::Device::Cpu);
    let boundary = |values: Vec<(&str, Tensor)>| Boundary { values: values.into_iter().map(|(n, t)| (n.to_string(), Value::Tensor(t))).collect() };
    let targets = || Tensor::from_slice(&[3i64, 4]);
    let forward = (7, Direction::Request);
    runtime().block_on(async {
        let server = LoopbackServer::start(bundle.dir(), DeviceSpec::Cpu, Limits::default()).await.unwrap();
        let (mut stream, opened) = open_session(&server.url, &bundle, open_digits(7, 12, "cross-entropy")).await;
        assert!(opened.opened.is_some(), "{opened:?}");
        let refusals = [
            (boundary(vec![("features_6", Tensor::ones([2, 32, 4, 5], cpu)), ("@targets", targets())]), forward, "features_6: expected"),
            (
                boundary(vec![("features_6", Tensor::ones([2, 32, 4, 4], cpu)), ("@targets", targets()), ("junk", Tensor::ones([2], cpu))]),
                forward,
                "no tensor \"junk\" crosses this cut",
            ),
            (
                boundary(vec![("features_6", Tensor::ones([2, 32, 4, 4], cpu)), ("@targets", Tensor::from_slice(&[1i64, 2, 3]))]),
                forward,
                "the batch is 2",
            ),
            (boundary(vec![("features_6", Tensor::ones([2, 32, 4, 4], cpu))]), (5, Direction::Request), "this stream takes cut 7"),
        ];
        for (id, (payload, meta, says)) in refusals.into_iter().enumerate() {
            let replies = call(&mut stream, id as u64, pb::Phase::Forward, meta, &payload).await;
            let (code, message) = error_of(replies.last().unwrap());
            assert_eq!(code, tonic::Code::InvalidArgument, "{message}");
            assert!(message.contains(says), "{says}: {message}");
        }
        let int_gradient = boundary(vec![("classifier_4", Tensor::ones([2, 10], (Kind::Int64, tch::Device::Cpu)))]);
        let replies = call(&mut stream, 10, pb::Phase::Backward, (12, Direction::Gradient), &int_gradient).await;
        let (_, message) = error_of(replies.last().unwrap());
        assert!(message.contains("a gradient is floating-point"), "{message}");
        // A valid step still trains.
        let step = boundary(vec![("features_6", Tensor::ones([2, 32, 4, 4], cpu)), ("@targets", targets())]);
        let replies = call(&mut stream, 11, pb::Phase::Forward, forward, &step).await;
        let last = replies.last().unwrap();
        assert!(last.error.is_none() && last.loss.is_some(), "{last:?}");
        server.shutdown().await.unwrap();
    });
}

/// A server training the digits bundle with checkpoints in `dir`, with `options`' quotas.
async fn checkpointing_server(bundle: &Bundle, dir: &Path, options: TrainingOptions) -> LoopbackServer {
    let options = TrainingOptions { checkpoint_dir: Some(dir.to_path_buf()), ..options };
    LoopbackServer::start_configured(bundle.dir(), DeviceSpec::Cpu, Limits::default(), ServerSecurity::default(), options).await.unwrap()
}

/// Asks the session to save checkpoint `name`; returns the reply.
async fn save(stream: &mut TrainStream, id: u64, name: &str) -> pb::TrainReply {
    let frame = TrainFrame { kind: Some(train_frame::Kind::Save(pb::SaveCheckpoint { request_id: id, name: name.into() })) };
    stream.0.send(frame).await.unwrap();
    let reply = stream.1.next().await.unwrap().unwrap();
    assert_eq!(reply.request_id, id);
    reply
}

/// One training step of a digits session over [7, 12); panics unless it trained.
async fn train_step(stream: &mut TrainStream, id: u64) {
    let replies = call(stream, id, pb::Phase::Forward, (7, Direction::Request), &digits_step(id)).await;
    let last = replies.last().unwrap();
    assert!(last.error.is_none() && last.loss.is_some(), "{last:?}");
}

/// Waits (up to 30 s) until the server has `streams` `Train` streams open.
async fn train_streams_fall_to(metrics: &cleave_server::Metrics, streams: f64) {
    let open = || cleave_tests::metric_sample(&cleave_tests::parse_metrics(&metrics.render()), "cleave_open_streams", &[("kind", "train")]);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while open() > streams {
        assert!(std::time::Instant::now() < deadline, "{} Train streams still open after 30 s", open());
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
}

/// Opens a session, retrying while the one before it is still closing.
async fn open_when_free(url: &str, bundle: &Bundle, open: pb::OpenSession) -> (TrainStream, pb::SessionOpened) {
    // The server frees a session (or keeps a broken one) once it sees its stream go, which
    // on a loaded machine can take a while: wait generously, and say what it last answered.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let (stream, reply) = open_session(url, bundle, open.clone()).await;
        if let Some(opened) = reply.opened {
            return (stream, opened);
        }
        assert!(std::time::Instant::now() < deadline, "no session opened in 30 s; the last answer: {reply:?}");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

#[test]
fn a_session_cannot_overwrite_another_session_s_checkpoints() {
    let bundle = Bundle::open(bundle_dir("digits")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    runtime().block_on(async {
        // Three sessions from this one address.
        let options = TrainingOptions { concurrent_sessions: true, max_sessions_per_peer: 3, ..TrainingOptions::default() };
        let server = checkpointing_server(&bundle, dir.path(), options).await;
        let (mut a, opened_a) = open_session(&server.url, &bundle, open_digits(7, 12, "cross-entropy")).await;
        let ns_a = opened_a.opened.unwrap().namespace;
        train_step(&mut a, 1).await;
        assert!(save(&mut a, 2, "step-1").await.saved.is_some());
        let theirs = dir.path().join(&ns_a).join("step-1.safetensors");
        let before = std::fs::read(&theirs).unwrap();

        // A second session saves the same name into its own namespace.
        let (mut b, opened_b) = open_session(&server.url, &bundle, pb::OpenSession { seed: 2, ..open_digits(7, 12, "cross-entropy") }).await;
        let ns_b = opened_b.opened.unwrap().namespace;
        assert_ne!(ns_a, ns_b, "two sessions never share a namespace");
        train_step(&mut b, 1).await;
        assert!(save(&mut b, 2, "step-1").await.saved.is_some());
        assert!(dir.path().join(&ns_b).join("step-1.safetensors").is_file());
        assert_eq!(std::fs::read(&theirs).unwrap(), before, "the first session's checkpoint is untouched");
        // A name cannot reach into another namespace.
        let (code, message) = error_of(&save(&mut b, 3, &format!("../{ns_a}/step-1")).await);
        assert_eq!(code, tonic::Code::InvalidArgument, "{message}");

        // Nor can a third session take the first one's namespace while it is open ...
        let resume = pb::OpenSession { resume: format!("{ns_a}/step-1"), ..open_digits(7, 12, "cross-entropy") };
        let (_c, refused) = open_session(&server.url, &bundle, resume.clone()).await;
        let (code, message) = error_of(&refused);
        assert_eq!(code, tonic::Code::FailedPrecondition, "{message}");
        assert!(message.contains(&ns_a) && message.contains("held by session"), "{message}");
        assert_eq!(std::fs::read(&theirs).unwrap(), before);
        // ... only continue it, by resuming, once that session has closed.
        drop(a);
        let (_c, opened_c) = open_when_free(&server.url, &bundle, resume).await;
        assert_eq!((opened_c.namespace.as_str(), opened_c.step), (ns_a.as_str(), 1));
    });
}

#[test]
fn a_session_resumes_from_its_namespace_and_saves_there() {
    let bundle = Bundle::open(bundle_dir("digits")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    runtime().block_on(async {
        let server = checkpointing_server(&bundle, dir.path(), TrainingOptions::default()).await;
        let (mut first, opened) = open_session(&server.url, &bundle, open_digits(7, 12, "cross-entropy")).await;
        let namespace = opened.opened.unwrap().namespace;
        for id in 1..=2 {
            train_step(&mut first, id).await;
        }
        assert_eq!(save(&mut first, 3, "step-2").await.saved.map(|s| s.step), Some(2));
        drop(first);

        // A resume names the namespace: a bare name is refused before anything loads.
        let (_refused, reply) =
            open_session(&server.url, &bundle, pb::OpenSession { resume: "step-2".into(), ..open_digits(7, 12, "cross-entropy") }).await;
        let (code, message) = error_of(&reply);
        assert_eq!(code, tonic::Code::InvalidArgument, "{message}");
        assert!(message.contains("NAMESPACE/NAME"), "{message}");

        let resume = pb::OpenSession { resume: format!("{namespace}/step-2"), ..open_digits(7, 12, "cross-entropy") };
        let (mut second, opened) = open_when_free(&server.url, &bundle, resume).await;
        assert_eq!((opened.namespace.as_str(), opened.step), (namespace.as_str(), 2));
        train_step(&mut second, 1).await;
        assert_eq!(save(&mut second, 2, "step-3").await.saved.map(|s| s.step), Some(3));
        let mut files: Vec<String> =
            std::fs::read_dir(dir.path().join(&namespace)).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        files.sort();
        assert_eq!(files, ["step-2.safetensors", "step-3.safetensors"]);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1, "no other namespace");
    });
}

#[test]
fn the_checkpoint_count_quota_refuses_one_more_and_the_session_goes_on() {
    let bundle = Bundle::open(bundle_dir("digits")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    runtime().block_on(async {
        let server = checkpointing_server(&bundle, dir.path(), TrainingOptions { max_checkpoints: 2, ..TrainingOptions::default() }).await;
        let (mut stream, opened) = open_session(&server.url, &bundle, open_digits(7, 12, "cross-entropy")).await;
        let namespace = dir.path().join(opened.opened.unwrap().namespace);
        assert!(save(&mut stream, 1, "a").await.saved.is_some());
        assert!(save(&mut stream, 2, "b").await.saved.is_some());
        let (code, message) = error_of(&save(&mut stream, 3, "c").await);
        assert_eq!(code, tonic::Code::ResourceExhausted, "{message}");
        assert!(message.contains("`training.max_checkpoints` (2)") && message.contains("holds 2 checkpoints"), "{message}");
        assert!(!namespace.join("c.safetensors").exists());
        // The session goes on: it trains, and replacing a checkpoint counts once.
        train_step(&mut stream, 4).await;
        assert_eq!(save(&mut stream, 5, "a").await.saved.map(|s| s.step), Some(1));
        assert_eq!(std::fs::read_dir(&namespace).unwrap().count(), 2, "a and b, nothing half written");
    });
}

#[test]
fn the_checkpoint_byte_quota_refuses_a_save_that_would_go_over() {
    let bundle = Bundle::open(bundle_dir("digits")).unwrap();
    // The size of one checkpoint of this session (SGD without momentum keeps no state).
    let probe = tempfile::tempdir().unwrap();
    let size = runtime().block_on(async {
        let server = checkpointing_server(&bundle, probe.path(), TrainingOptions::default()).await;
        let (mut stream, opened) = open_session(&server.url, &bundle, open_digits(7, 12, "cross-entropy")).await;
        assert!(save(&mut stream, 1, "probe").await.saved.is_some());
        std::fs::metadata(probe.path().join(opened.opened.unwrap().namespace).join("probe.safetensors")).unwrap().len()
    });
    for (quota, refused) in [(size - 1, true), (size, false)] {
        let dir = tempfile::tempdir().unwrap();
        runtime().block_on(async {
            let options = TrainingOptions { max_checkpoint_bytes: quota, ..TrainingOptions::default() };
            let server = checkpointing_server(&bundle, dir.path(), options).await;
            let (mut stream, opened) = open_session(&server.url, &bundle, open_digits(7, 12, "cross-entropy")).await;
            let namespace = dir.path().join(opened.opened.unwrap().namespace);
            let reply = save(&mut stream, 1, "first").await;
            if refused {
                // Its tensors fit, its file (with its header) does not: refused once written,
                // and the temporary file is gone.
                let (code, message) = error_of(&reply);
                assert_eq!(code, tonic::Code::ResourceExhausted, "{message}");
                assert!(message.contains(&format!("`training.max_checkpoint_bytes` ({quota})")) && message.contains(&size.to_string()), "{message}");
                assert!(std::fs::read_dir(&namespace).map_or(true, |mut d| d.next().is_none()), "nothing left on disk");
                train_step(&mut stream, 2).await;
                return;
            }
            assert!(reply.saved.is_some(), "{reply:?}");
            // One more checkpoint would go over: refused before anything is written.
            let (code, message) = error_of(&save(&mut stream, 2, "second").await);
            assert_eq!(code, tonic::Code::ResourceExhausted, "{message}");
            assert!(message.contains("would hold at least") && message.contains(&format!("other checkpoints hold {size}")), "{message}");
            // Replacing the first one fits, and the session goes on.
            train_step(&mut stream, 3).await;
            assert_eq!(save(&mut stream, 4, "first").await.saved.map(|s| s.step), Some(1));
            assert_eq!(std::fs::read_dir(&namespace).unwrap().count(), 1);
        });
    }
}

#[test]
fn the_server_wide_checkpoint_quota_spans_every_namespace_and_deletes_nothing() {
    let bundle = Bundle::open(bundle_dir("digits")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    runtime().block_on(async {
        // Room for one checkpoint of this session, not two: each session has a namespace of
        // its own, so only the server-wide quota can refuse the second session's.
        let probe = checkpointing_server(&bundle, dir.path(), TrainingOptions::default()).await;
        let (mut stream, opened) = open_session(&probe.url, &bundle, open_digits(7, 12, "cross-entropy")).await;
        let first = dir.path().join(opened.opened.unwrap().namespace);
        assert!(save(&mut stream, 1, "a").await.saved.is_some());
        drop((stream, probe));
        let size = std::fs::metadata(first.join("a.safetensors")).unwrap().len();
        let total = 2 * size - 1;
        let server =
            checkpointing_server(&bundle, dir.path(), TrainingOptions { max_checkpoint_bytes_total: total, ..TrainingOptions::default() }).await;
        let (mut stream, opened) = open_when_free(&server.url, &bundle, open_digits(7, 12, "cross-entropy")).await;
        let second = dir.path().join(&opened.namespace);
        let (code, message) = error_of(&save(&mut stream, 1, "b").await);
        assert_eq!(code, tonic::Code::ResourceExhausted, "{message}");
        assert!(message.contains(&format!("`training.max_checkpoint_bytes_total` ({total})")) && message.contains(&size.to_string()), "{message}");
        assert!(std::fs::read_dir(&second).map_or(true, |mut d| d.next().is_none()), "nothing of it left on disk");
        assert!(first.join("a.safetensors").exists(), "the first session's checkpoint is not deleted");
        // The session goes on.
        train_step(&mut stream, 2).await;
    });
}

/// Relays bytes from `from` to `to` until either side closes or `budget` bytes have passed.
async fn pump(from: &tokio::net::TcpStream, to: &tokio::net::TcpStream, mut budget: usize) {
    use std::io::ErrorKind::WouldBlock;
    let mut buf = vec![0u8; 16 * 1024];
    while budget > 0 {
        let n = match from.readable().await.and_then(|()| from.try_read(&mut buf)) {
            Ok(0) => return,
            Ok(n) => n.min(budget),
            Err(e) if e.kind() == WouldBlock => continue,
            Err(_) => return,
        };
        budget -= n;
        let mut sent = 0;
        while sent < n {
            match to.writable().await.and_then(|()| to.try_write(&buf[sent..n])) {
                Ok(k) => sent += k,
                Err(e) if e.kind() == WouldBlock => continue,
                Err(_) => return,
            }
        }
    }
}

/// A TCP relay to `server_url` for one connection, as a network path the test can cut (by
/// aborting the task): the server then sees the connection lost, as when a host's link fails.
async fn relay(server_url: &str) -> (String, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let target = server_url.trim_start_matches("http://").to_string();
    let task = tokio::spawn(async move {
        let (host_side, _) = listener.accept().await.unwrap();
        let server_side = tokio::net::TcpStream::connect(target).await.unwrap();
        tokio::join!(pump(&host_side, &server_side, usize::MAX), pump(&server_side, &host_side, usize::MAX));
    });
    (url, task)
}

/// Asks to continue `opened`'s session on a new stream, while the server may not yet have
/// noticed that the old one broke; returns the stream and the first reply.
async fn reattach(url: &str, bundle: &Bundle, session_id: &str, token: &str) -> (TrainStream, pb::TrainReply) {
    let reattach = pb::OpenSession { reattach: Some(pb::Reattach { session_id: session_id.into(), token: token.into() }), ..Default::default() };
    for _ in 0..100 {
        let (stream, reply) = open_session(url, bundle, reattach.clone()).await;
        let waiting = reply.error.as_ref().is_some_and(|e| e.message.contains("not waiting to be continued"));
        if !waiting {
            return (stream, reply);
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    open_session(url, bundle, reattach).await
}

/// A digits step at cut 7 with its targets (the same for the same `id`).
fn digits_step(id: u64) -> cleave_common::Boundary {
    use cleave_common::{Boundary, Value};
    let features = noise(&[2, 32, 4, 4], id as i64 * 1024);
    Boundary { values: vec![("features_6".into(), Value::Tensor(features)), ("@targets".into(), Value::Tensor(Tensor::from_slice(&[3i64, 4])))] }
}

#[test]
fn a_reattachable_session_outlives_its_broken_stream_and_a_resent_step_is_answered_not_taken_twice() {
    let bundle = Bundle::open(bundle_dir("digits")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let forward = (7, Direction::Request);
    runtime().block_on(async {
        // Kept for 5 s: long enough for the checks below on a busy machine.
        let options = TrainingOptions { session_idle_timeout: std::time::Duration::from_secs(5), ..TrainingOptions::default() };
        let server = checkpointing_server(&bundle, dir.path(), options).await;
        let (path, cut) = relay(&server.url).await;
        let (mut first, reply) = open_session(&path, &bundle, pb::OpenSession { reattachable: true, ..open_digits(7, 12, "cross-entropy") }).await;
        let opened = reply.opened.expect("opened");
        assert_eq!(opened.reattach_token.len(), 64, "a 256-bit token");
        train_step(&mut first, 1).await;
        let step2 = call(&mut first, 2, pb::Phase::Forward, forward, &digits_step(2)).await;

        // The connection is lost after the last answer came: the session is kept...
        cut.abort();
        // ... holding its bundle: a second trainer hears of it, and of the idle timeout.
        let (_, refused) = open_session(&server.url, &bundle, open_digits(7, 12, "cross-entropy")).await;
        let (code, message) = error_of(&refused);
        assert_eq!(code, tonic::Code::ResourceExhausted, "{message}");
        assert!(message.contains(&format!("session {}", opened.session_id)) && message.contains("session_idle_timeout"), "{message}");
        // Only its token continues it.
        let (_, wrong) = reattach(&server.url, &bundle, &opened.session_id, "not-the-token").await;
        assert_eq!(error_of(&wrong).0, tonic::Code::Unauthenticated, "{wrong:?}");
        let (path, cut) = relay(&server.url).await;
        let (mut second, reply) = reattach(&path, &bundle, &opened.session_id, &opened.reattach_token).await;
        let continued = reply.opened.clone().unwrap_or_else(|| panic!("continued: {reply:?}"));
        assert_eq!(
            (continued.session_id.as_str(), continued.step, continued.namespace.as_str()),
            (opened.session_id.as_str(), 2, opened.namespace.as_str())
        );
        drop(first);

        // Step 2 resent (its answer lost, as far as the host knows): answered as it was, not run again.
        let resent = call(&mut second, 2, pb::Phase::Forward, forward, &digits_step(2)).await;
        let (was, again) = (step2.last().unwrap(), resent.last().unwrap());
        assert_eq!((again.loss, &again.data), (was.loss, &was.data), "the resent step's answer is the first one's");
        assert_eq!(save(&mut second, 3, "after-resend").await.saved.expect("saved").step, 2, "step 2 was taken once");
        train_step(&mut second, 4).await;
        assert_eq!(save(&mut second, 5, "later").await.saved.expect("saved").step, 3);

        // Broken again and not continued within `session_idle_timeout`: closed, the bundle free.
        cut.abort();
        tokio::time::sleep(std::time::Duration::from_secs(6)).await;
        let reattach_once = pb::OpenSession {
            reattach: Some(pb::Reattach { session_id: opened.session_id.clone(), token: opened.reattach_token.clone() }),
            ..Default::default()
        };
        let (_, gone) = open_session(&server.url, &bundle, reattach_once).await;
        let (code, message) = error_of(&gone);
        assert_eq!(code, tonic::Code::FailedPrecondition, "{message}");
        assert!(message.contains("not waiting to be continued"), "{message}");
        drop(second);

        // A host that ends its stream cleanly closes its session at once, reattachable or not.
        let (third, _) = open_when_free(&server.url, &bundle, pb::OpenSession { reattachable: true, ..open_digits(7, 12, "cross-entropy") }).await;
        let (frames, mut replies) = third;
        drop(frames);
        assert!(replies.next().await.is_none(), "the server ends its side");
        let (_, reopened) = open_session(&server.url, &bundle, open_digits(7, 12, "cross-entropy")).await;
        assert!(reopened.opened.is_some(), "the bundle is free at once: {reopened:?}");
        server.shutdown().await.unwrap();
    });
}

/// A reattachable session outlives its stream reset between calls, on a connection that stays
/// (the host dropped the call), as `OpenSession.reattachable` promises; its token continues it
/// at the step it had reached. (A host that ends its side and reads on closes it: the test above.)
#[test]
fn a_reattachable_session_outlives_its_stream_reset_between_calls() {
    let bundle = Bundle::open(bundle_dir("digits")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    runtime().block_on(async {
        let options = TrainingOptions { session_idle_timeout: std::time::Duration::from_secs(30), ..TrainingOptions::default() };
        let server = checkpointing_server(&bundle, dir.path(), options).await;
        let (mut first, reply) =
            open_session(&server.url, &bundle, pb::OpenSession { reattachable: true, ..open_digits(7, 12, "cross-entropy") }).await;
        let opened = reply.opened.expect("opened");
        train_step(&mut first, 1).await;
        // The host drops the call between calls: its request side ends (END_STREAM) and, as it
        // reads no more, the stream is reset (RST_STREAM) right after.
        let (frames, replies) = first;
        drop(replies);
        drop(frames);
        let (mut second, reply) = reattach(&server.url, &bundle, &opened.session_id, &opened.reattach_token).await;
        let continued = reply.opened.clone().unwrap_or_else(|| panic!("continued after a reset: {reply:?}"));
        assert_eq!((continued.session_id.as_str(), continued.step), (opened.session_id.as_str(), 1));
        train_step(&mut second, 2).await;
        server.shutdown().await.unwrap();
    });
}

#[test]
fn pipelined_micro_batches_resent_after_a_break_are_all_answered_from_memory() {
    let bundle = Bundle::open(bundle_dir("digits")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let forward = (pb::Phase::Forward, (7, Direction::Request));
    let part = |index: u32| move |f: &mut pb::TrainPayloadFrame| (f.microbatch, f.microbatches, f.loss_weight) = (index, 2, 0.5);
    runtime().block_on(async {
        let options = TrainingOptions { session_idle_timeout: std::time::Duration::from_secs(5), ..TrainingOptions::default() };
        let server = checkpointing_server(&bundle, dir.path(), options).await;
        // More calls in flight than the server keeps answers for is refused, naming its key.
        let (_, refused) = open_session(&server.url, &bundle, pb::OpenSession { pipeline_depth: 9, ..open_digits(7, 12, "cross-entropy") }).await;
        assert!(error_of(&refused).1.contains("over this server's training.max_pipeline_depth (8)"), "{refused:?}");

        let (path, cut) = relay(&server.url).await;
        let open = pb::OpenSession { reattachable: true, pipeline_depth: 2, ..open_digits(7, 12, "cross-entropy") };
        let (mut first, reply) = open_when_free(&path, &bundle, open).await;
        let first_answers =
            [call_with(&mut first, 1, forward, &digits_step(1), part(0)).await, call_with(&mut first, 2, forward, &digits_step(2), part(1)).await];
        // Both answers lost, as far as the host knows: it continues the session and sends both
        // again; the server ran them, so it answers both from memory and the step is taken once.
        cut.abort();
        let (mut second, continued) = reattach(&server.url, &bundle, &reply.session_id, &reply.reattach_token).await;
        assert_eq!(continued.opened.as_ref().map(|o| o.step), Some(1), "{continued:?}");
        drop(first);
        for (id, was) in [(1u64, &first_answers[0]), (2, &first_answers[1])] {
            let again = call_with(&mut second, id, forward, &digits_step(id), part(id as u32 - 1)).await;
            let (was, again) = (was.last().unwrap(), again.last().unwrap());
            assert!(again.error.is_none(), "call {id} resent: {again:?}");
            assert!(again.loss == was.loss && again.data == was.data, "call {id} is answered as it was, not run again");
        }
        assert_eq!(save(&mut second, 3, "after-resend").await.saved.expect("saved").step, 1, "one step taken");
        server.shutdown().await.unwrap();

        // A server that keeps no answer but the last lets the first go: resent, it is refused,
        // not run again (it would start another step), and the last is still answered.
        let options = TrainingOptions { max_kept_answer_bytes: 0, ..TrainingOptions::default() };
        let server = checkpointing_server(&bundle, &dir.path().join("lean"), options).await;
        let (path, cut) = relay(&server.url).await;
        let open = pb::OpenSession { reattachable: true, pipeline_depth: 2, ..open_digits(7, 12, "cross-entropy") };
        let (mut first, reply) = open_when_free(&path, &bundle, open).await;
        call_with(&mut first, 1, forward, &digits_step(1), part(0)).await;
        let last = call_with(&mut first, 2, forward, &digits_step(2), part(1)).await;
        cut.abort();
        let (mut second, _) = reattach(&server.url, &bundle, &reply.session_id, &reply.reattach_token).await;
        drop(first);
        let again = call_with(&mut second, 1, forward, &digits_step(1), part(0)).await;
        assert!(error_of(again.last().unwrap()).1.contains("call 1 was answered before and its answer is no longer kept"), "{again:?}");
        let again = call_with(&mut second, 2, forward, &digits_step(2), part(1)).await;
        assert!(again.last().unwrap().data == last.last().unwrap().data, "the last answer is kept");
        assert_eq!(save(&mut second, 3, "lean").await.saved.expect("saved").step, 1, "one step taken");
        server.shutdown().await.unwrap();
    });
}

/// A TCP relay to `server_url` for any number of connections, whose first connection is cut
/// once the server has sent `cut_after` bytes on it, as a failing network would cut it;
/// counts the connections made.
async fn flaky_relay(server_url: &str, cut_after: usize) -> (String, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tokio::net::{TcpListener, TcpStream};
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let target = server_url.trim_start_matches("http://").to_string();
    let connections = std::sync::Arc::new(AtomicUsize::new(0));
    let counted = std::sync::Arc::clone(&connections);
    tokio::spawn(async move {
        while let Ok((host_side, _)) = listener.accept().await {
            let first = counted.fetch_add(1, Ordering::SeqCst) == 0;
            let target = target.clone();
            tokio::spawn(async move {
                let server_side = TcpStream::connect(target).await.unwrap();
                let down = if first { cut_after } else { usize::MAX };
                // Either direction ending ends the connection: both sockets are dropped.
                tokio::select! {
                    () = pump(&host_side, &server_side, usize::MAX) => {}
                    () = pump(&server_side, &host_side, down) => {}
                }
            });
        }
    });
    (url, connections)
}

#[test]
fn a_split_run_whose_connection_is_cut_continues_its_session_and_trains_exactly_as_an_uncut_run() {
    cut_run_trains_as_uncut(|| Run::new("digits", "split", 7, SGD));
    // With micro-batches and clipping a step is several calls, each resent or answered from
    // memory on its own.
    cut_run_trains_as_uncut(|| Run { extra: "  clip_grad_norm: 3.5\n", microbatches: 2, ..Run::new("digits", "split", 7, SGD) });
}

#[test]
fn a_training_run_given_several_servers_sticks_to_the_first_that_answers_across_a_cut() {
    // The first server listed is not there: the run trains on the second, and after the cut
    // continues its session there (a session lives on one server).
    cut_run_trains_as_uncut_over(|| Run::new("digits", "split", 7, SGD), |relay| format!("[http://127.0.0.1:1, {relay}]"));
}

fn cut_run_trains_as_uncut(run: impl Fn() -> Run<'static>) {
    cut_run_trains_as_uncut_over(run, |relay| relay.to_string());
}

/// As [`cut_run_trains_as_uncut`], with `server:` made from the relay's URL by `servers`.
fn cut_run_trains_as_uncut_over(run: impl Fn() -> Run<'static>, servers: impl Fn(&str) -> String) {
    let tmp = tempfile::tempdir().unwrap();
    let uncut = run();
    assert_eq!(uncut.train(&tmp.path().join("uncut")).total_steps, STEPS);
    let out = tmp.path().join("cut");
    let bundle = Bundle::open(bundle_dir("digits")).unwrap();
    // The server and the relay run on a runtime of their own, beside the host's.
    let serving = runtime();
    let (server, relay, connections) = serving.block_on(async {
        let options = TrainingOptions { checkpoint_dir: Some(out.join("checkpoints/server")), ..TrainingOptions::default() };
        let server =
            LoopbackServer::start_configured(bundle.dir(), DeviceSpec::Cpu, Limits::default(), ServerSecurity::default(), options).await.unwrap();
        // About six steps' answers (a 16 x 32 x 4 x 4 gradient each) pass before the cut.
        let (relay, connections) = flaky_relay(&server.url, 200_000).await;
        (server, relay, connections)
    });
    let cut = Run { server: Some(servers(&relay)), ..run() };
    assert_eq!(cut.train(&out).total_steps, STEPS);
    let reconnected = connections.load(std::sync::atomic::Ordering::SeqCst);
    assert!(reconnected >= 2, "the host connected again after the cut ({reconnected} connections)");
    let diff = max_abs_diff(&trained_state(&out, STEPS), &trained_state(&tmp.path().join("uncut"), STEPS));
    assert_eq!(diff, 0.0, "a run whose link was cut differs from an uncut one by {diff:e}: a step taken twice or lost");
    serving.block_on(server.shutdown()).unwrap();
}

/// A digits session over [7, 12) in client group `g` of `edges`, at place `edge`.
fn open_in_group(mode: &str, edges: u32, edge: u32) -> pb::OpenSession {
    pb::OpenSession {
        clients: Some(pb::ClientGroup { name: "g".into(), mode: mode.into(), edges, edge, samples: 1 }),
        ..open_digits(7, 12, "cross-entropy")
    }
}

/// Sends `EndRound` and returns the reply.
async fn end_round(stream: &mut TrainStream, id: u64) -> pb::TrainReply {
    stream.0.send(TrainFrame { kind: Some(train_frame::Kind::EndRound(pb::EndRound { request_id: id })) }).await.unwrap();
    let reply = stream.1.next().await.unwrap().unwrap();
    assert_eq!(reply.request_id, id);
    reply
}

#[test]
fn a_client_group_s_sessions_are_checked_share_the_bundle_and_wait_for_each_other_s_turns() {
    let bundle = Bundle::open(bundle_dir("digits")).unwrap();
    runtime().block_on(async {
        let wait = std::time::Duration::from_secs(2);
        // Both edges are on one address, whose share is one place: a group's sessions take one.
        let options = TrainingOptions {
            checkpoint_dir: None,
            max_sessions: 2,
            max_sessions_per_peer: 1,
            client_wait_timeout: wait,
            ..TrainingOptions::default()
        };
        let server =
            LoopbackServer::start_configured(bundle.dir(), DeviceSpec::Cpu, Limits::default(), ServerSecurity::default(), options).await.unwrap();
        let (mut a, opened) = open_session(&server.url, &bundle, open_in_group("sequential", 2, 0)).await;
        assert!(opened.opened.is_some(), "{opened:?}");

        // Refused: more edges than sessions, a place taken, other terms, a resume, no group.
        let differs = pb::OpenSession {
            optimizer: Some(pb::Optimizer { kind: "sgd".into(), lr: 0.2, ..Default::default() }),
            ..open_in_group("sequential", 2, 1)
        };
        let resumes = pb::OpenSession { resume: "ns/step-1".into(), ..open_in_group("sequential", 2, 1) };
        for (open, code, says) in [
            (
                open_in_group("sequential", 3, 1),
                tonic::Code::InvalidArgument,
                "a group of 3 edges: this server trains 1 to 2 at once (`training.max_sessions`)",
            ),
            (open_in_group("sequential", 2, 2), tonic::Code::InvalidArgument, "edge 2 of a group of 2"),
            (open_in_group("fedavg", 2, 1), tonic::Code::InvalidArgument, "unknown mode \"fedavg\""),
            (open_in_group("sequential", 2, 0), tonic::Code::AlreadyExists, "edge 0's place in group g is held by an open session"),
            (open_in_group("splitfed", 2, 1), tonic::Code::FailedPrecondition, "group g trains with another mode"),
            (differs, tonic::Code::FailedPrecondition, "group g trains with another optimizer"),
            (resumes, tonic::Code::FailedPrecondition, "cannot resume a checkpoint"),
            (open_digits(7, 12, "cross-entropy"), tonic::Code::ResourceExhausted, "already being trained by session s1"),
        ] {
            let (_stream, refused) = open_session(&server.url, &bundle, open).await;
            let (got, message) = error_of(&refused);
            assert!(got == code && message.contains(says), "{says:?}: {got:?} {message}");
        }

        // Edge 1 has not come: edge 0's step waits for it, then is refused naming it.
        let replies = call(&mut a, 1, pb::Phase::Forward, (7, Direction::Request), &digits_step(0)).await;
        let (code, message) = error_of(replies.last().unwrap());
        assert_eq!(code, tonic::Code::DeadlineExceeded);
        assert!(message.contains("(`training.client_wait_timeout`) in group g for edges [1]"), "{message}");

        // Sequential: edge 1's step waits until edge 0 has ended its round.
        let (mut b, opened) = open_session(&server.url, &bundle, open_in_group("sequential", 2, 1)).await;
        assert!(opened.opened.is_some(), "{opened:?}");
        // Tensors are not `Sync`: edge 1 runs as a task on this thread.
        let local = tokio::task::LocalSet::new();
        let edge_1 = local.spawn_local(async move {
            let stepped = call(&mut b, 1, pb::Phase::Forward, (7, Direction::Request), &digits_step(1)).await;
            let round = end_round(&mut b, 2).await;
            (b, stepped, round)
        });
        let (a, (b, stepped, round)) = local
            .run_until(async move {
                train_step(&mut a, 2).await;
                // Edge 1's step is still waiting for the turn edge 0 holds.
                tokio::time::sleep(wait / 4).await;
                assert!(!edge_1.is_finished());
                let round = end_round(&mut a, 3).await;
                assert_eq!(round.round_ended, Some(pb::RoundEnded { round: 1 }), "{round:?}");
                (a, edge_1.await.unwrap())
            })
            .await;
        assert!(stepped.last().unwrap().loss.is_some(), "{stepped:?}");
        assert_eq!(round.round_ended, Some(pb::RoundEnded { round: 1 }), "{round:?}");

        // EndRound outside a group is refused, and the session goes on.
        drop((a, b));
        let (mut alone, _) = open_when_free(&server.url, &bundle, open_digits(7, 12, "cross-entropy")).await;
        let (code, message) = error_of(&end_round(&mut alone, 1).await);
        assert!(code == tonic::Code::FailedPrecondition && message.contains("not in a client group"), "{code:?} {message}");
        train_step(&mut alone, 2).await;
    });
}

#[test]
fn a_splitfed_round_ends_with_the_edges_checked_weights_and_answers_their_average() {
    use cleave_common::{Boundary, Value};
    let bundle = Bundle::open(bundle_dir("digits")).unwrap();
    // The weights a splitfed edge of a [7, 12) session sends: its stages' floating-point
    // parameters and buffers.
    let prefix = TrainableStages::load(&bundle, StageRange::new(0, 7), DeviceSpec::Cpu, 0).unwrap();
    let weights = |shift: f64| Boundary {
        values: prefix
            .parameters()
            .iter()
            .chain(prefix.buffers())
            .filter(|(_, t)| t.is_floating_point())
            .map(|(n, t)| (n.clone(), Value::Tensor(t.detach() + shift)))
            .collect(),
    };
    let splitfed = |edge, samples| pb::OpenSession {
        clients: Some(pb::ClientGroup { name: "g".into(), mode: "splitfed".into(), edges: 2, edge, samples }),
        ..open_digits(7, 12, "cross-entropy")
    };
    let average = (7, Direction::Request);
    runtime().block_on(async {
        let options = TrainingOptions { checkpoint_dir: None, max_sessions: 2, ..TrainingOptions::default() };
        let server =
            LoopbackServer::start_configured(bundle.dir(), DeviceSpec::Cpu, Limits::default(), ServerSecurity::default(), options).await.unwrap();
        let (_stream, refused) = open_session(&server.url, &bundle, splitfed(0, 0)).await;
        let (code, message) = error_of(&refused);
        assert!(code == tonic::Code::InvalidArgument && message.contains("`ClientGroup.samples`"), "{message}");
        let (mut a, opened) = open_session(&server.url, &bundle, splitfed(0, 1)).await;
        assert!(opened.opened.is_some(), "{opened:?}");
        let (mut b, opened) = open_session(&server.url, &bundle, splitfed(1, 3)).await;
        assert!(opened.opened.is_some(), "{opened:?}");

        // A splitfed round ends with the edge's weights, exactly its stages' tensors.
        let (code, message) = error_of(&end_round(&mut a, 1).await);
        assert!(code == tonic::Code::FailedPrecondition && message.contains("a splitfed group's round ends with the edge's weights"), "{message}");
        let mut short = weights(0.0);
        short.values.pop();
        let replies = call(&mut a, 2, pb::Phase::Average, average, &short).await;
        let (code, message) = error_of(replies.last().unwrap());
        assert!(code == tonic::Code::InvalidArgument && message.contains("tensors declared"), "{message}");

        // Both edges end the round: each gets the average, edge b weighing 3 to a's 1.
        let local = tokio::task::LocalSet::new();
        let b_weights = weights(4.0);
        let edge_b = local.spawn_local(async move { call(&mut b, 1, pb::Phase::Average, average, &b_weights).await });
        let (answer_a, answer_b) = local
            .run_until(async move {
                let answer_a = call(&mut a, 3, pb::Phase::Average, average, &weights(0.0)).await;
                (answer_a, edge_b.await.unwrap())
            })
            .await;
        for answer in [&answer_a, &answer_b] {
            let last = answer.last().unwrap();
            assert!(last.error.is_none() && !answer[0].header.is_empty(), "{last:?}");
        }
        let received = |replies: &[pb::TrainReply]| {
            let mut receiver = cleave_common::wire::PayloadReceiver::new(
                Direction::Result,
                u64::MAX,
                Default::default(),
                &cleave_common::wire::KeyRing::new(None::<(u32, cleave_common::wire::Key)>).unwrap(),
            );
            let mut assembly = receiver.start(replies[0].request_id, &replies[0].header).unwrap();
            for r in replies {
                assembly.push(r.request_id, &r.data).unwrap();
            }
            receiver.finish(assembly).unwrap().boundary
        };
        let (got_a, got_b) = (received(&answer_a), received(&answer_b));
        for (name, value) in &got_a.values {
            let original = prefix.parameters().iter().chain(prefix.buffers()).find(|(n, _)| n == name).unwrap().1.detach();
            let expected = &original * 0.25 + (&original + 4.0) * 0.75;
            assert!(value.as_tensor().unwrap().equal(&expected), "{name}");
            let (_, in_b) = got_b.values.iter().find(|(n, _)| n == name).unwrap();
            assert!(in_b.as_tensor().unwrap().equal(&expected), "{name} in b's answer");
        }
        assert_eq!(got_a.values.len(), weights(0.0).values.len());
    });
}

#[test]
fn an_end_of_round_resent_after_its_host_left_is_answered_from_memory_and_ends_no_second_round() {
    let bundle = Bundle::open(bundle_dir("digits")).unwrap();
    runtime().block_on(async {
        let options = TrainingOptions { checkpoint_dir: None, max_sessions: 2, ..TrainingOptions::default() };
        let dir = bundle.dir().to_path_buf();
        let prepared = tokio::task::spawn_blocking(move || {
            cleave_server::PreparedServer::prepare(&dir, DeviceSpec::Cpu, Limits::default(), ServerSecurity::default()).unwrap()
        })
        .await
        .unwrap()
        .with_training(options);
        let metrics = prepared.metrics();
        let server = LoopbackServer::serve(prepared).await.unwrap();
        let reattachable = pb::OpenSession { reattachable: true, ..open_in_group("sequential", 2, 0) };
        let (a, opened) = open_session(&server.url, &bundle, reattachable).await;
        let opened = opened.opened.expect("edge 0 opened");
        let (mut b, _) = open_session(&server.url, &bundle, open_in_group("sequential", 2, 1)).await;

        // Edge 0 ends its round and leaves while it waits for edge 1.
        a.0.send(TrainFrame { kind: Some(train_frame::Kind::EndRound(pb::EndRound { request_id: 1 })) }).await.unwrap();
        // (Long enough for the server to be waiting in the call: a stream that ends before
        // the call is read closes its session instead.)
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
        drop(a);
        // Edge 1 ends the round only once the server has seen edge 0 go: an answer ready
        // before that is handed to the half-closed stream, which then ends as a clean
        // close (the request's end reaches the server before the reset) and closes the session.
        train_streams_fall_to(&metrics, 1.0).await;
        let round = end_round(&mut b, 1).await;
        assert_eq!(round.round_ended, Some(pb::RoundEnded { round: 1 }), "{round:?}");

        // Its host continues the session and resends the call: the answer it missed.
        let reattach = pb::Reattach { session_id: opened.session_id, token: opened.reattach_token };
        let (mut a, _) = open_when_free(&server.url, &bundle, pb::OpenSession { reattach: Some(reattach), ..Default::default() }).await;
        let round = end_round(&mut a, 1).await;
        assert_eq!(round.round_ended, Some(pb::RoundEnded { round: 1 }), "{round:?}");

        // The group is in round 1 with both edges: edge 1's end of it waits for edge 0's.
        let local = tokio::task::LocalSet::new();
        let edge_1 = local.spawn_local(async move { end_round(&mut b, 2).await });
        let round = local
            .run_until(async move {
                tokio::time::sleep(std::time::Duration::from_millis(300)).await;
                assert!(!edge_1.is_finished(), "one call ended no second round");
                let mine = end_round(&mut a, 2).await;
                assert_eq!(mine.round_ended, Some(pb::RoundEnded { round: 2 }), "{mine:?}");
                edge_1.await.unwrap()
            })
            .await;
        assert_eq!(round.round_ended, Some(pb::RoundEnded { round: 2 }), "{round:?}");
    });
}
