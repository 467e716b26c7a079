//! Training sessions: the `Train` stream and the thread that owns each session's stages.
//!
//! A session is one stream. Its first frame opens it: the server loads a fresh copy of
//! stages `[start, end)` in training mode on its own thread (autograd state is per thread,
//! and the inference worker keeps serving the exported weights meanwhile), with the
//! session's optimizer and, when `end` is the last cut, its loss. Every later call is
//! answered in order with exactly one reply or one error; a failed call leaves the session
//! open. By default a bundle has at most one session at a time, so two hosts cannot train
//! the same weights unknowingly; `training.concurrent_sessions` lets each train its own copy.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cleave_common::config::{Limits, TrainingOptions};
use cleave_common::pb::{self, train_frame, Phase, TrainReply};
use cleave_common::security::ServerSecurity;
use cleave_common::training::checkpoint::{self, CheckpointMeta};
use cleave_common::training::loss::LossKind;
use cleave_common::training::optim::{Optimizer, OptimizerConfig};
use cleave_common::training::{
    gradient_boundary, gradients, take_targets, track_gradients, vjp_root, TrainError, TrainableStages,
};
use cleave_common::wire::{frame_parts, Codec, Direction, PayloadReceiver, Reassembly};
use cleave_common::{Boundary, Bundle, DeviceSpec, StageRange, Value};
use tch::Tensor;
use tokio::sync::{mpsc, oneshot};
use tokio_stream::StreamExt;
use tonic::{Status, Streaming};

use crate::service::{status_code, RequestError, ResultEncoder, ResultSpec};

/// The training side of the service: options and the sessions open now.
#[derive(Debug, Clone, Default)]
pub(crate) struct Training {
    pub(crate) options: TrainingOptions,
    sessions: Arc<Sessions>,
}

impl Training {
    pub(crate) fn new(options: TrainingOptions) -> Self {
        Self { options, sessions: Arc::default() }
    }
}

#[derive(Debug, Default)]
struct Sessions {
    open: Mutex<Vec<(String, Instant)>>,
    next: AtomicU64,
}

/// A session's place among the open ones; dropping it closes the session.
struct SessionSlot {
    sessions: Arc<Sessions>,
    id: String,
}

impl Drop for SessionSlot {
    fn drop(&mut self) {
        self.sessions.open.lock().unwrap_or_else(|p| p.into_inner()).retain(|(id, _)| id != &self.id);
        tracing::info!(session = %self.id, "training session closed");
    }
}

impl Training {
    fn admit(&self, bundle: &Bundle) -> Result<SessionSlot, RequestError> {
        let mut open = self.sessions.open.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((id, since)) = open.first().filter(|_| !self.options.concurrent_sessions) {
            return Err(RequestError::AlreadyTraining(format!(
                "bundle {} is already being trained (session {id}, open for {} s); this server allows one training session per \
                 bundle: close that one, or set `training.concurrent_sessions: true` in server.yaml to train separate copies",
                bundle.id(),
                since.elapsed().as_secs()
            )));
        }
        let id = format!("s{}", self.sessions.next.fetch_add(1, Ordering::Relaxed) + 1);
        open.push((id.clone(), Instant::now()));
        Ok(SessionSlot { sessions: Arc::clone(&self.sessions), id })
    }
}

/// What one `Train` stream needs.
pub(crate) struct StreamContext {
    pub(crate) bundle: Bundle,
    pub(crate) device: DeviceSpec,
    pub(crate) limits: Limits,
    pub(crate) security: Arc<ServerSecurity>,
    pub(crate) training: Training,
}

/// A validated `OpenSession`.
struct SessionSetup {
    bundle: Bundle,
    range: StageRange,
    device: DeviceSpec,
    optimizer: OptimizerConfig,
    loss: Option<LossKind>,
    seed: u64,
    resume: Option<PathBuf>,
}

fn optimizer_from_pb(o: &pb::Optimizer) -> Result<OptimizerConfig, String> {
    let config = match o.kind.as_str() {
        "sgd" => OptimizerConfig::Sgd { lr: o.lr, momentum: o.momentum, dampening: o.dampening, weight_decay: o.weight_decay, nesterov: o.nesterov },
        "adam" => OptimizerConfig::Adam { lr: o.lr, betas: [o.beta1, o.beta2], eps: o.eps, weight_decay: o.weight_decay },
        "adamw" => OptimizerConfig::Adamw { lr: o.lr, betas: [o.beta1, o.beta2], eps: o.eps, weight_decay: o.weight_decay },
        other => return Err(format!("optimizer {other:?} is not one of sgd, adam, adamw")),
    };
    config.validate().map(|()| config).map_err(|e| format!("optimizer: {e}"))
}

/// Checks a checkpoint name: a file name, never a path.
pub(crate) fn checkpoint_path(dir: Option<&PathBuf>, name: &str) -> Result<PathBuf, RequestError> {
    let dir = dir.ok_or_else(|| RequestError::Session("this server has no checkpoint directory (`training.checkpoint_dir`)".into()))?;
    let valid = !name.is_empty()
        && name.len() <= 128
        && !name.starts_with('.')
        && name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if !valid {
        return Err(RequestError::Training(TrainError::Invalid(format!(
            "checkpoint name {name:?}: use letters, digits, '-', '_' and '.', not starting with '.'"
        ))));
    }
    Ok(dir.join(format!("{name}.safetensors")))
}

impl StreamContext {
    fn setup(&self, open: &pb::OpenSession) -> Result<SessionSetup, RequestError> {
        let n = self.bundle.stage_count();
        let (start, end) = (open.start as usize, open.end as usize);
        let invalid = |m: String| RequestError::Training(TrainError::Invalid(m));
        if !(start < end && end <= n) {
            return Err(invalid(format!("the server's stages [{start}, {end}) must be a non-empty range within [0, {n}]")));
        }
        for cut in [start, end] {
            let info = self.bundle.cut(cut);
            if !info.usable && cut != n {
                return Err(invalid(format!("cut {cut} ({}) cannot be split at: {}", info.name, info.reason.as_deref().unwrap_or("unusable"))));
            }
        }
        let optimizer = open.optimizer.as_ref().ok_or_else(|| invalid("no optimizer given".into()))?;
        let optimizer = optimizer_from_pb(optimizer).map_err(invalid)?;
        let loss = match (end == n, open.loss.as_str()) {
            (true, "") => return Err(invalid("the server holds the last stage, so it computes the loss: name it (cross-entropy, mse)".into())),
            (true, name) => Some(name.parse::<LossKind>().map_err(invalid)?),
            (false, "") => None,
            (false, name) => {
                return Err(invalid(format!("loss {name:?} given, but the server's part ends at cut {end} < {n}: the edge computes the loss")))
            }
        };
        let resume = match open.resume.as_str() {
            "" => None,
            name => Some(checkpoint_path(self.training.options.checkpoint_dir.as_ref(), name)?),
        };
        Ok(SessionSetup {
            bundle: self.bundle.clone(),
            range: StageRange::new(start, end),
            device: self.device,
            optimizer,
            loss,
            seed: open.seed,
            resume,
        })
    }
}

/// A call for the session thread.
enum Call {
    /// A step's boundary (and targets when the server holds the loss).
    Forward { input: Boundary, targets: Option<Tensor> },
    /// U-shaped: the gradient at `end` of the pending step.
    Backward { grads: Boundary },
    /// An evaluation batch.
    Evaluate { input: Boundary },
    /// Write a checkpoint.
    Save { path: PathBuf, name: String },
}

/// The session thread's answer.
enum Answer {
    /// The gradient at `start` (and the loss when the server computed it).
    Gradients { loss: Option<f64>, grads: Boundary },
    /// The boundary at `end` (U-shaped forward, or evaluation).
    Output(Boundary),
    /// A checkpoint was written.
    Saved { name: String, step: u64 },
}

struct CallJob {
    call: Call,
    reply: oneshot::Sender<Result<(Answer, Duration), TrainError>>,
}

/// What the session reports once its stages are loaded.
struct Opened {
    step: u64,
    parameters: u64,
    device: String,
}

/// Named tensors (boundary leaves, parameters).
type Named = Vec<(String, Tensor)>;
/// One gradient slot per tensor; `None` where the loss does not depend on it.
type Grads = Vec<Option<Tensor>>;

/// U-shaped: a step whose backward has not come yet.
struct PendingStep {
    /// The received boundary's floating-point leaves (their gradients go back).
    inputs: Named,
    /// The floating-point leaves of the boundary sent back (their gradients come in).
    outputs: Named,
}

/// The state the session thread owns.
struct Session {
    stages: TrainableStages,
    optimizer: Optimizer,
    loss: Option<LossKind>,
    seed: u64,
    step: u64,
    /// U-shaped: the step whose backward has not come yet.
    pending: Option<PendingStep>,
}

impl Session {
    fn open(setup: SessionSetup) -> Result<Self, TrainError> {
        let stages = TrainableStages::load(&setup.bundle, setup.range, setup.device, setup.seed)?;
        let mut optimizer = Optimizer::new(setup.optimizer);
        let mut step = 0;
        if let Some(path) = &setup.resume {
            let meta = checkpoint::restore(path, &[&stages], &mut optimizer)?;
            if meta.seed != setup.seed {
                return Err(TrainError::Checkpoint {
                    path: path.clone(),
                    message: format!("it was trained with seed {}, this session has seed {}: resume with the same seed", meta.seed, setup.seed),
                });
            }
            step = meta.step;
        }
        Ok(Self { stages, optimizer, loss: setup.loss, seed: setup.seed, step, pending: None })
    }

    fn params(&self) -> Vec<Tensor> {
        self.stages.parameters().iter().map(|(_, p)| p.shallow_clone()).collect()
    }

    /// Runs a call; answers through `reply` as soon as the answer exists, so that the
    /// optimizer step overlaps with sending the gradient back.
    fn handle(&mut self, call: Call, started: Instant, reply: oneshot::Sender<Result<(Answer, Duration), TrainError>>) {
        let answer = |r: Result<Answer, TrainError>| {
            let _ = reply.send(r.map(|a| (a, started.elapsed())));
        };
        match call {
            Call::Forward { input, targets } => match self.forward(input, targets) {
                Ok((answer_now, Some(param_grads))) => {
                    answer(Ok(answer_now));
                    self.finish_step(param_grads);
                }
                Ok((answer_now, None)) => answer(Ok(answer_now)),
                Err(e) => answer(Err(e)),
            },
            Call::Backward { grads } => match self.backward(&grads) {
                Ok((answer_now, param_grads)) => {
                    answer(Ok(answer_now));
                    self.finish_step(param_grads);
                }
                Err(e) => answer(Err(e)),
            },
            Call::Evaluate { input } => answer(self.stages.evaluate(&input).map(|out| Answer::Output(out.detached()))),
            Call::Save { path, name } => {
                let meta = CheckpointMeta {
                    bundle_id: self.stages.bundle().id().to_string(),
                    ranges: vec![[self.stages.range().start, self.stages.range().end]],
                    step: self.step,
                    optimizer: self.optimizer.config().clone(),
                    seed: self.seed,
                    extra: Default::default(),
                };
                answer(checkpoint::save(&path, &meta, &[&self.stages], &self.optimizer).map(|()| Answer::Saved { name, step: self.step }))
            }
        }
    }

    /// A training forward. With the loss here: backward too, returning the gradient answer
    /// and the parameters' gradients (the step is finished after answering); U-shaped:
    /// keeps the graph pending and answers with the boundary at `end`.
    fn forward(&mut self, input: Boundary, targets: Option<Tensor>) -> Result<(Answer, Option<Grads>), TrainError> {
        if self.pending.take().is_some() {
            return Err(TrainError::Invalid(format!(
                "step {} is still waiting for its gradient (PHASE_BACKWARD); it is dropped, and this step refused",
                self.step + 1
            )));
        }
        let leaves = track_gradients(&input);
        let output = self.stages.forward(self.step, &input)?;
        let Some(loss_kind) = self.loss else {
            if targets.is_some() {
                return Err(TrainError::Invalid("this session ends before the loss (U-shaped): targets stay on the edge".into()));
            }
            self.pending = Some(PendingStep { inputs: leaves, outputs: cleave_common::training::float_leaves(&output) });
            return Ok((Answer::Output(output.detached()), None));
        };
        let targets = targets.ok_or_else(|| {
            TrainError::Invalid(format!("this session computes the loss: each step carries the targets as value {}", cleave_common::training::TARGETS_VALUE))
        })?;
        let output = match self.stages.bundle().assemble_output(output)? {
            Value::Tensor(t) => t,
            other => return Err(TrainError::Loss(format!("the model's output is {}, the loss needs one tensor", other.describe()))),
        };
        let loss = loss_kind.compute(&output, &targets)?;
        let (param_grads, leaf_grads) = self.backward_from(&loss, &leaves)?;
        let value = loss.double_value(&[]);
        Ok((Answer::Gradients { loss: Some(value), grads: gradient_boundary(&leaves, leaf_grads) }, Some(param_grads)))
    }

    fn backward(&mut self, grads: &Boundary) -> Result<(Answer, Grads), TrainError> {
        let PendingStep { inputs: leaves, outputs } = self
            .pending
            .take()
            .ok_or_else(|| TrainError::Invalid("a gradient arrived without a pending forward (PHASE_FORWARD comes first)".into()))?;
        let root = vjp_root(&outputs, grads)?;
        let (param_grads, leaf_grads) = match root {
            Some(root) => self.backward_from(&root, &leaves)?,
            None => (self.params().iter().map(|_| None).collect(), leaves.iter().map(|_| None).collect()),
        };
        Ok((Answer::Gradients { loss: None, grads: gradient_boundary(&leaves, leaf_grads) }, param_grads))
    }

    /// Gradients of `root` for the parameters and for the input leaves.
    fn backward_from(&self, root: &Tensor, leaves: &[(String, Tensor)]) -> Result<(Grads, Grads), TrainError> {
        let mut inputs = self.params();
        let n_params = inputs.len();
        inputs.extend(leaves.iter().map(|(_, t)| t.shallow_clone()));
        let mut grads = gradients(root, &inputs)?;
        let leaf_grads = grads.split_off(n_params);
        Ok((grads, leaf_grads))
    }

    fn finish_step(&mut self, param_grads: Grads) {
        self.optimizer.step(self.stages.parameters(), &param_grads);
        self.step += 1;
    }
}

/// Loads the session on its own thread; returns the channel to it once it is ready.
async fn spawn_session(setup: SessionSetup) -> Result<(mpsc::Sender<CallJob>, Opened), RequestError> {
    let (tx, mut rx) = mpsc::channel::<CallJob>(2);
    // Calls come one at a time per stream; the channel only hands them over.
    let (opened_tx, opened_rx) = oneshot::channel();
    std::thread::Builder::new()
        .name("cleave-train".into())
        .spawn(move || {
            let mut session = match Session::open(setup) {
                Ok(s) => {
                    let device = cleave_common::device::device_name(s.stages.device());
                    let _ = opened_tx.send(Ok(Opened { step: s.step, parameters: s.stages.parameter_count(), device }));
                    s
                }
                Err(e) => {
                    let _ = opened_tx.send(Err(e));
                    return;
                }
            };
            while let Some(job) = rx.blocking_recv() {
                session.handle(job.call, Instant::now(), job.reply);
            }
        })
        .map_err(|e| RequestError::Session(format!("cannot start the session thread: {e}")))?;
    let opened = opened_rx.await.map_err(|_| RequestError::Unavailable)??;
    Ok((tx, opened))
}

fn error_reply(request_id: u64, e: &RequestError) -> TrainReply {
    TrainReply { request_id, last: true, error: Some(pb::Error { code: status_code(e) as i32, message: e.to_string() }), ..Default::default() }
}

/// A payload being received, with the phase its first frame named.
struct Incoming {
    phase: Phase,
    assembly: Reassembly,
}

/// Serves one `Train` stream: opens the session, then answers its calls in order.
pub(crate) async fn serve_stream(mut inbound: Streaming<pb::TrainFrame>, ctx: StreamContext, out: mpsc::Sender<Result<TrainReply, Status>>) {
    let open = match inbound.next().await {
        Some(Ok(pb::TrainFrame { kind: Some(train_frame::Kind::Open(open)) })) => open,
        Some(Ok(_)) => {
            let _ = out.send(Ok(error_reply(0, &RequestError::Session("the first frame of a Train stream opens the session".into())))).await;
            return;
        }
        _ => return,
    };
    let opened = async {
        let setup = ctx.setup(&open)?;
        let slot = ctx.training.admit(&ctx.bundle)?;
        let (calls, opened) = spawn_session(setup).await?;
        Ok::<_, RequestError>((slot, calls, opened))
    }
    .await;
    let (slot, calls, opened) = match opened {
        Ok(x) => x,
        Err(e) => {
            tracing::info!(error = %e, "training session refused");
            let _ = out.send(Ok(error_reply(0, &e))).await;
            return;
        }
    };
    tracing::info!(session = %slot.id, start = open.start, end = open.end, step = opened.step, device = %opened.device, "training session open");
    let reply = pb::SessionOpened { session_id: slot.id.clone(), step: opened.step, parameters: opened.parameters, device: opened.device };
    if out.send(Ok(TrainReply { opened: Some(reply), last: true, ..Default::default() })).await.is_err() {
        return;
    }
    let mut stream = CallStream::new(&ctx, open.start, open.end);
    while let Some(frame) = inbound.next().await {
        let Ok(frame) = frame else { return };
        let replies = match frame.kind {
            Some(train_frame::Kind::Save(save)) => {
                let answer = match checkpoint_path(ctx.training.options.checkpoint_dir.as_ref(), &save.name) {
                    Ok(path) => call(&calls, Call::Save { path, name: save.name }).await,
                    Err(e) => Err(e),
                };
                vec![match answer {
                    Ok((Answer::Saved { name, step }, _)) => TrainReply { request_id: save.request_id, last: true, saved: Some(pb::CheckpointSaved { name, step }), ..Default::default() },
                    Ok(_) => error_reply(save.request_id, &RequestError::Unavailable),
                    Err(e) => error_reply(save.request_id, &e),
                }]
            }
            Some(train_frame::Kind::Payload(p)) => match stream.push(p) {
                Ok(None) => continue,
                Ok(Some((id, phase, received))) => stream.answer(id, phase, received, &calls).await,
                Err((id, e)) => vec![error_reply(id, &e)],
            },
            Some(train_frame::Kind::Open(_)) => vec![error_reply(0, &RequestError::Session("this stream already has a session open".into()))],
            None => vec![error_reply(0, &RequestError::Session("an empty frame".into()))],
        };
        for r in replies {
            if out.send(Ok(r)).await.is_err() {
                return; // The host is gone; dropping `calls` ends the session thread.
            }
        }
    }
    drop(slot);
}

async fn call(calls: &mpsc::Sender<CallJob>, call: Call) -> Result<(Answer, Duration), RequestError> {
    let (tx, rx) = oneshot::channel();
    calls.send(CallJob { call, reply: tx }).await.map_err(|_| RequestError::Unavailable)?;
    Ok(rx.await.map_err(|_| RequestError::Unavailable)??)
}

/// A payload received whole: its call id, phase and data (not yet decoded).
type Complete = (u64, Phase, Reassembly);

/// The payload side of a stream: reassembly, decoding and encoding answers.
struct CallStream {
    start: u32,
    end: u32,
    /// Boundaries in (steps and evaluations) and gradients in (U-shaped backward), each with
    /// its own replay window; shared with the blocking pool.
    requests: Arc<Mutex<PayloadReceiver>>,
    gradients: Arc<Mutex<PayloadReceiver>>,
    encoder: Arc<Mutex<ResultEncoder>>,
    chunk_bytes: usize,
    current: Option<Incoming>,
    /// A call already answered with an error whose remaining frames are skipped.
    skipping: Option<u64>,
}

impl CallStream {
    fn new(ctx: &StreamContext, start: u32, end: u32) -> Self {
        let receiver = |d| Arc::new(Mutex::new(PayloadReceiver::new(d, ctx.limits.max_payload_bytes, ctx.security.policy.clone(), &ctx.security.keys)));
        Self {
            start,
            end,
            requests: receiver(Direction::Request),
            gradients: receiver(Direction::Gradient),
            encoder: Arc::new(Mutex::new(ResultEncoder::new(Arc::clone(&ctx.security)))),
            chunk_bytes: ctx.limits.chunk_bytes(),
            current: None,
            skipping: None,
        }
    }

    /// Adds a frame; a complete payload comes back with its phase (not yet decoded).
    fn push(&mut self, frame: pb::TrainPayloadFrame) -> Result<Option<Complete>, (u64, RequestError)> {
        let id = frame.request_id;
        if self.skipping == Some(id) {
            if frame.last {
                self.skipping = None;
            }
            return Ok(None);
        }
        self.skipping = None;
        let mut incoming = match self.current.take() {
            Some(incoming) => incoming,
            None => {
                let phase = Phase::try_from(frame.phase).unwrap_or(Phase::Unspecified);
                let receiver = match phase {
                    Phase::Forward | Phase::Evaluate => &self.requests,
                    Phase::Backward => &self.gradients,
                    Phase::Unspecified => {
                        self.skip_rest(&frame);
                        return Err((id, RequestError::Session("a payload's first frame names its phase (forward, backward, evaluate)".into())));
                    }
                };
                let started = receiver.lock().expect("payload receiver").start(id, &frame.header);
                match started {
                    Ok(assembly) => Incoming { phase, assembly },
                    Err(e) => {
                        self.skip_rest(&frame);
                        return Err((id, e.into()));
                    }
                }
            }
        };
        if let Err(e) = incoming.assembly.push(id, &frame.data) {
            self.skip_rest(&frame);
            return Err((incoming.assembly.request_id, e.into()));
        }
        if !frame.last {
            self.current = Some(incoming);
            return Ok(None);
        }
        Ok(Some((id, incoming.phase, incoming.assembly)))
    }

    fn skip_rest(&mut self, frame: &pb::TrainPayloadFrame) {
        self.skipping = (!frame.last).then_some(frame.request_id);
    }

    /// Decodes a complete payload, runs its call and encodes the answer (decoding and
    /// encoding on the blocking pool, the call on the session thread).
    async fn answer(&mut self, id: u64, phase: Phase, assembly: Reassembly, calls: &mpsc::Sender<CallJob>) -> Vec<TrainReply> {
        let receiver = Arc::clone(if phase == Phase::Backward { &self.gradients } else { &self.requests });
        let decode_started = Instant::now();
        let received = match tokio::task::spawn_blocking(move || receiver.lock().expect("payload receiver").finish(assembly)).await {
            Ok(r) => r.map_err(RequestError::from),
            Err(_) => Err(RequestError::Unavailable),
        };
        let decode_us = decode_started.elapsed().as_micros() as u64;
        let received = match received {
            Ok(r) => r,
            Err(e) => return vec![error_reply(id, &e)],
        };
        let expected_cut = if phase == Phase::Backward { self.end } else { self.start };
        if received.split != expected_cut {
            let e = RequestError::Session(format!("the payload is at cut {}, this session expects cut {expected_cut} for {phase:?}", received.split));
            return vec![error_reply(id, &e)];
        }
        let (codec, key_id) = (received.codec, received.key_id);
        let mut boundary = received.boundary;
        let job = match phase {
            Phase::Forward => {
                let targets = take_targets(&mut boundary);
                Call::Forward { input: boundary, targets }
            }
            Phase::Backward => Call::Backward { grads: boundary },
            _ => Call::Evaluate { input: boundary },
        };
        let (answer, compute) = match call(calls, job).await {
            Ok(a) => a,
            Err(e) => return vec![error_reply(id, &e)],
        };
        let (loss, boundary, spec) = match answer {
            Answer::Gradients { loss, grads } => (loss, grads, self.spec(id, self.start, codec, key_id, Direction::Gradient)),
            Answer::Output(out) => (None, out, self.spec(id, self.end, codec, key_id, Direction::Result)),
            Answer::Saved { .. } => return vec![error_reply(id, &RequestError::Unavailable)],
        };
        let encoder = Arc::clone(&self.encoder);
        let encoded = tokio::task::spawn_blocking(move || {
            let started = Instant::now();
            let encoded = encoder.lock().expect("result encoder").encode(spec, &boundary);
            (encoded, started.elapsed())
        })
        .await;
        let (encoded, encode_time) = match encoded {
            Ok((Ok(e), t)) => (e, t),
            Ok((Err(e), _)) => return vec![error_reply(id, &e)],
            Err(_) => return vec![error_reply(id, &RequestError::Unavailable)],
        };
        let timings = pb::ServerTimings { queue_us: 0, decode_us, compute_us: compute.as_micros() as u64, encode_us: encode_time.as_micros() as u64 };
        frame_parts(encoded.envelope, &encoded.data, self.chunk_bytes)
            .into_iter()
            .map(|part| TrainReply {
                request_id: id,
                header: part.header,
                data: part.data,
                last: part.last,
                loss: if part.last { loss } else { None },
                timings: part.last.then_some(timings),
                ..Default::default()
            })
            .collect()
    }

    fn spec(&self, request_id: u64, split: u32, codec: Codec, key_id: Option<u32>, direction: Direction) -> ResultSpec {
        ResultSpec { request_id, split, codec, key_id, direction }
    }
}
