//! A training session's own thread: it owns a fresh copy of the session's stages in
//! training mode and its optimizer (or shares its client group's, taking its turns), and runs
//! the calls its stream hands it one at a time (forward, U-shaped backward, evaluation,
//! checkpoint, the end of a group's round). The step math is the one the edge
//! runs too (`cleave_common::training::step`). It remembers its last answers (as many as its
//! host may have calls in flight, within a byte bound), so that a call its host resends on a
//! new stream (the answer was lost with the old one) is answered again instead of run twice.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use cleave_common::training::checkpoint::{self, CheckpointMeta};
use cleave_common::training::loss::LossKind;
use cleave_common::training::microbatch::{accumulate, Microbatch};
use cleave_common::training::optim::{Optimizer, OptimizerConfig};
use cleave_common::training::schedule::{check_coefficient, scale, tensor_norms, Schedule};
use cleave_common::training::step::{backward, backward_from_boundary, step_loss, Grads, PartGradients};
use cleave_common::training::{float_leaves, track_gradients, StepError, TrainError, TrainableStages, TARGETS_VALUE};
use cleave_common::wire::TensorSpec;
use cleave_common::{Boundary, Bundle, DeviceSpec, StageRange};
use tch::Tensor;
use tokio::sync::{mpsc, oneshot};

use super::checkpoints::{CheckpointRef, CheckpointStore, Namespace};
use super::group::{ClientMode, Member, SharedPart, TrainedPart, Waited};
use crate::budget::{MemoryBudget, Reservation};
use crate::error::{GroupError, Internal, RequestError, SessionError};
use crate::metrics::Metrics;
use crate::scheduler::Turns;

/// A validated `OpenSession`: what the session thread loads.
pub(crate) struct SessionSetup {
    pub(crate) bundle: Bundle,
    pub(crate) range: StageRange,
    pub(crate) device: DeviceSpec,
    /// The scheduler of that device: each call runs in a turn it grants.
    pub(crate) turns: Turns,
    pub(crate) optimizer: OptimizerConfig,
    /// The learning rate of each step.
    pub(crate) schedule: Schedule,
    /// Global gradient-norm clipping across the split (the host computes the coefficient).
    pub(crate) clips: bool,
    /// Calls the host may have in flight: the answers kept for resent calls.
    pub(crate) pipeline_depth: u32,
    /// Tensor bytes the kept answers may hold besides the last one.
    pub(crate) max_kept_answer_bytes: u64,
    /// The memory budget (its opener's share) its graphs and kept answers are held in.
    pub(crate) budget: MemoryBudget,
    pub(crate) loss: Option<LossKind>,
    pub(crate) seed: u64,
    /// The checkpoint to resume from; the session continues in its namespace.
    pub(crate) resume: Option<CheckpointRef>,
    /// Where the session keeps its checkpoints; none: it cannot save.
    pub(crate) checkpoints: Option<CheckpointStore>,
    /// Its place in a client group, whose stages it trains (none: it trains its own).
    pub(crate) member: Option<Member>,
}

/// The floating-point parameters and buffers of the stages the session's edge trains
/// (`[0, start)` and `[end, N)`), as a `splitfed` edge sends them at the end of a round.
fn edge_weights(setup: &SessionSetup) -> Result<Vec<TensorSpec>, RequestError> {
    let (start, end, n) = (setup.range.start, setup.range.end, setup.bundle.stage_count());
    let mut weights = Vec::new();
    for (from, to) in [(0, start), (end, n)].into_iter().filter(|(from, to)| from < to) {
        let stages = TrainableStages::load(&setup.bundle, StageRange::new(from, to), DeviceSpec::Cpu, setup.seed)?;
        let floating = stages.parameters().iter().chain(stages.buffers()).filter(|(_, t)| t.is_floating_point());
        weights.extend(floating.filter_map(|(name, t)| TensorSpec::of(name, t)));
    }
    Ok(weights)
}

/// The refusal of a checkpoint call on a server without a checkpoint directory.
pub(crate) fn no_checkpoint_dir() -> RequestError {
    SessionError::NoCheckpointDir.into()
}

/// A call for the session thread.
pub(crate) enum Call {
    /// A step's boundary (and targets when the server holds the loss): the whole batch, or
    /// one of its micro-batches.
    Forward { input: Boundary, targets: Option<Tensor>, microbatch: Microbatch, batch: i64 },
    /// U-shaped: the gradient at `end` of the pending step.
    Backward { grads: Boundary },
    /// An evaluation batch.
    Evaluate { input: Boundary },
    /// Write a checkpoint into the session's namespace.
    Save { name: String },
    /// With clipping: what the gradients of the step answered last are multiplied by.
    Clip { coefficient: f32 },
    /// In a client group: this edge's steps of the round are taken.
    EndRound,
    /// In a `splitfed` group: [`Call::EndRound`] with the edge's weights, answered with
    /// the average.
    Average { weights: Boundary },
}

/// The session thread's answer.
pub(crate) enum Answer {
    /// The gradient at `start` (and the loss when the server computed it); with clipping,
    /// the norm of each of the session's parameter gradients.
    Gradients { loss: Option<f64>, grads: Boundary, norms: Option<Vec<f32>> },
    /// The boundary at `end` (U-shaped forward, or evaluation), or a `splitfed` round's
    /// average of the edges' weights.
    Output(Boundary),
    /// A checkpoint was written.
    Saved { name: String, step: u64 },
    /// A clipped step was taken (`step` steps in all).
    Stepped { step: u64 },
    /// Every edge of the group has ended the round (`round` rounds in all).
    RoundEnded { round: u64 },
}

impl Answer {
    /// The bytes of its tensors.
    fn tensor_bytes(&self) -> u64 {
        match self {
            Self::Gradients { grads: b, .. } | Self::Output(b) => b.tensor_bytes() as u64,
            Self::Saved { .. } | Self::Stepped { .. } | Self::RoundEnded { .. } => 0,
        }
    }

    /// The same answer, its tensors shared.
    fn shallow_clone(&self) -> Self {
        match self {
            Self::Gradients { loss, grads, norms } => Self::Gradients { loss: *loss, grads: grads.shallow_clone(), norms: norms.clone() },
            Self::Output(out) => Self::Output(out.shallow_clone()),
            Self::Saved { name, step } => Self::Saved { name: name.clone(), step: *step },
            Self::Stepped { step } => Self::Stepped { step: *step },
            Self::RoundEnded { round } => Self::RoundEnded { round: *round },
        }
    }
}

type Reply = oneshot::Sender<Result<(Answer, Duration), RequestError>>;

struct CallJob {
    /// The host's id for the call: a resent call has the id it had.
    id: u64,
    call: Call,
    reply: Reply,
}

/// What the session reports once its stages are loaded.
pub(crate) struct Opened {
    pub(crate) step: u64,
    pub(crate) parameters: u64,
    pub(crate) device: String,
    /// The session's checkpoint namespace (empty without a checkpoint directory).
    pub(crate) namespace: String,
    /// In a `splitfed` group: the weights its edge sends at the end of a round.
    pub(crate) weights: Option<Arc<[TensorSpec]>>,
}

/// U-shaped: a step whose backward has not come yet.
struct PendingStep {
    /// Which of its step's micro-batches it is.
    microbatch: Microbatch,
    /// The received boundary's floating-point leaves (their gradients go back).
    inputs: Vec<(String, Tensor)>,
    /// The floating-point leaves of the boundary sent back (their gradients come in).
    outputs: Vec<(String, Tensor)>,
    /// Its graph's bytes in the memory budget, held until the backward.
    _graph: Reservation,
}

/// An answer kept for a resend of its call.
struct KeptAnswer {
    /// Its call's id.
    id: u64,
    answer: Answer,
    /// Its tensors' bytes.
    bytes: u64,
    /// Those bytes in the memory budget (none for a last answer the budget had no room for).
    _held: Reservation,
}

/// The state the session thread owns.
struct Session {
    /// The stages and their optimizer: the session's own, or its group's.
    part: SharedPart,
    /// Its place in a client group.
    member: Option<Member>,
    /// In a `splitfed` group: the weights its edge sends at the end of a round.
    weights: Option<Arc<[TensorSpec]>>,
    schedule: Schedule,
    /// Whether the session clips (the host computes the coefficient).
    clips: bool,
    /// With clipping: the answered step's parameter gradients, waiting for the coefficient.
    unclipped: Option<Grads>,
    /// A step cut into micro-batches: the next one due (of how many) and the sum of the
    /// earlier ones' parameter gradients.
    microbatches: Option<(u32, u32, Grads)>,
    loss: Option<LossKind>,
    seed: u64,
    step: u64,
    /// U-shaped: the step whose backward has not come yet.
    pending: Option<PendingStep>,
    /// Where it saves, held while the session lives.
    namespace: Option<Namespace>,
    /// The ids of the last calls answered (as many as the host may have in flight, within
    /// `max_kept_answer_bytes` besides the last, and what the memory budget has room for),
    /// their answers and their bytes in the budget, oldest first.
    answered: VecDeque<KeptAnswer>,
    /// The highest id answered: a call resent under a lower one whose answer was let go is
    /// refused, never run again.
    last_answered: u64,
    pipeline_depth: usize,
    max_kept_answer_bytes: u64,
    /// Where its graphs and kept answers are held (its opener's share).
    budget: MemoryBudget,
    /// Bytes per sample a forward keeps for its backward (`Bundle::graph_bytes_per_sample`).
    graph_bytes_per_sample: u64,
    /// `step`, for the streams (a continued session reports it).
    shared_step: Arc<AtomicU64>,
}

impl Session {
    /// Takes the session's checkpoint namespace (before loading anything, so a taken one is
    /// refused at once), loads its stages and restores the checkpoint it resumes from.
    fn open(setup: SessionSetup, id: &str) -> Result<Self, RequestError> {
        let namespace = match (&setup.checkpoints, &setup.resume) {
            (Some(store), resume) => Some(store.claim(id, resume.as_ref().map(|r| r.namespace.as_str()))?),
            (None, Some(_)) => return Err(no_checkpoint_dir()),
            (None, None) => None,
        };
        let load = || -> Result<TrainedPart, RequestError> {
            let stages = TrainableStages::load(&setup.bundle, setup.range, setup.device, setup.seed)?;
            Ok(TrainedPart { stages, optimizer: Optimizer::new(setup.optimizer.clone()) })
        };
        let weights = match &setup.member {
            Some(member) if member.mode() == ClientMode::SplitFed => Some(member.weights(|| edge_weights(&setup))?),
            _ => None,
        };
        let (part, step) = match &setup.member {
            // A group's session starts afresh (resuming is refused when it opens).
            Some(member) => (member.part(load)?, 0),
            None => {
                let mut part = load()?;
                let step = Self::resume(&setup, namespace.as_ref(), &mut part)?;
                (Arc::new(Mutex::new(part)), step)
            }
        };
        let shared_step = Arc::new(AtomicU64::new(step));
        Ok(Self {
            part,
            member: setup.member,
            weights,
            schedule: setup.schedule,
            clips: setup.clips,
            unclipped: None,
            microbatches: None,
            loss: setup.loss,
            seed: setup.seed,
            step,
            pending: None,
            namespace,
            answered: VecDeque::new(),
            last_answered: 0,
            pipeline_depth: setup.pipeline_depth as usize,
            max_kept_answer_bytes: setup.max_kept_answer_bytes,
            budget: setup.budget,
            graph_bytes_per_sample: setup.bundle.graph_bytes_per_sample(setup.range.start..setup.range.end),
            shared_step,
        })
    }

    /// Restores the checkpoint the session resumes from into `part`; returns its step (0
    /// without one).
    fn resume(setup: &SessionSetup, namespace: Option<&Namespace>, part: &mut TrainedPart) -> Result<u64, RequestError> {
        let mut step = 0;
        if let (Some(resume), Some(namespace)) = (&setup.resume, namespace) {
            let path = namespace.path(&resume.name)?;
            let meta = checkpoint::restore(&path, &[&part.stages], &mut part.optimizer)?;
            if meta.seed != setup.seed {
                return Err(RequestError::Training(TrainError::Checkpoint {
                    path,
                    message: format!("it was trained with seed {}, this session has seed {}: resume with the same seed", meta.seed, setup.seed),
                }));
            }
            step = meta.step;
        }
        Ok(step)
    }

    /// The stages and optimizer, held for a call (a group's sessions take turns with them).
    fn part(&self) -> MutexGuard<'_, TrainedPart> {
        self.part.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether a step has begun and not been taken.
    fn step_under_way(&self) -> bool {
        self.pending.is_some() || self.unclipped.is_some() || self.microbatches.is_some()
    }

    /// Before the device, in a client group: a step's first call waits for the edge's turn,
    /// and the end of a round for the other edges (answered here). Returns the job when it
    /// goes on.
    fn wait_in_group(&mut self, job: CallJob) -> Option<CallJob> {
        let starts_step = matches!(&job.call, Call::Forward { microbatch, .. } if microbatch.index == 0) && !self.step_under_way();
        let ends_round = matches!(job.call, Call::EndRound | Call::Average { .. });
        if !(starts_step || ends_round) {
            return Some(job);
        }
        let Some(member) = &self.member else {
            if ends_round {
                let _ = job.reply.send(Err(GroupError::NotInAGroup.into()));
                return None;
            }
            return Some(job);
        };
        let CallJob { id, call, reply } = job;
        let gone = || reply.is_closed();
        let answered = if starts_step {
            match member.wait_for_step(&gone) {
                Ok(()) => return Some(CallJob { id, call, reply }),
                Err(waited) => Err(waited),
            }
        } else {
            self.end_round(member, call)
        };
        match answered {
            Ok(answer) => {
                self.keep_answer(id, answer.shallow_clone());
                let _ = reply.send(Ok((answer, Duration::ZERO)));
            }
            Err(Waited::Gone) => {}
            Err(Waited::Refused(e)) => {
                let _ = reply.send(Err(e.into()));
            }
        }
        None
    }

    /// Ends the edge's round in its group once no step is under way, as the group's mode
    /// ends one: `EndRound`, or `splitfed`'s weights, answered with their average.
    fn end_round(&self, member: &Member, call: Call) -> Result<Answer, Waited> {
        if self.step_under_way() {
            return Err(Waited::Refused(GroupError::StepUnderWay { step: self.step + 1 }));
        }
        let weights = match (member.mode(), call) {
            (ClientMode::Sequential, Call::EndRound) => None,
            (ClientMode::SplitFed, Call::Average { weights }) => Some(weights),
            (ClientMode::SplitFed, _) => {
                return Err(Waited::Refused(GroupError::RoundEndsOtherwise { mode: "splitfed", expected: "the edge's weights" }))
            }
            (ClientMode::Sequential, _) => return Err(Waited::Refused(GroupError::RoundEndsOtherwise { mode: "sequential", expected: "EndRound" })),
        };
        Ok(match member.end_round(weights)? {
            (_, Some(averaged)) => Answer::Output(averaged),
            (round, None) => Answer::RoundEnded { round },
        })
    }

    /// What a forward keeps for its backward, its batch times the stages' bytes per sample,
    /// reserved in the opener's share of the memory budget before the call takes the device
    /// (waiting as a payload does); nothing for other calls, or for a forward that will be
    /// refused because a step's backward is still awaited (its graph is then let go).
    fn reserve_graph(&self, call: &Call, runtime: &tokio::runtime::Handle) -> Result<Reservation, RequestError> {
        let Call::Forward { batch, .. } = *call else { return Ok(Reservation::none()) };
        if self.pending.is_some() {
            return Ok(Reservation::none());
        }
        let bytes = self.graph_bytes_per_sample.saturating_mul(batch.max(0) as u64);
        let reserved = match self.budget.try_reserve_kept(bytes) {
            Some(graph) => Ok(graph),
            // (A runtime shutting down while this waits panics its timer: the call is refused.)
            None => std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| runtime.block_on(self.budget.reserve_kept(bytes))))
                .map_err(|_| RequestError::Internal(Internal::SessionGone))?,
        };
        reserved.map_err(|over| SessionError::GraphOverBudget { batch, over }.into())
    }

    /// Runs a call; answers through `reply` as soon as the answer exists, so that the
    /// optimizer step overlaps with sending the gradient back.
    /// `reply` is taken when answered; a caller that catches a panic answers it if not.
    fn handle(&mut self, id: u64, (call, graph): (Call, Reservation), started: Instant, reply: &mut Option<Reply>) {
        // What was answered, remembered once the call is done (its step included).
        let mut answered = None;
        let mut answer = |r: Result<Answer, RequestError>| {
            if let Ok(a) = &r {
                answered = Some(a.shallow_clone());
            }
            if let Some(reply) = reply.take() {
                let _ = reply.send(r.map(|a| (a, started.elapsed())));
            }
        };
        match self.run(call, graph) {
            Ok((answer_now, Some(param_grads))) => {
                self.count_answered_step();
                answer(Ok(answer_now));
                self.finish_step(param_grads);
            }
            Ok((answer_now, None)) => answer(Ok(answer_now)),
            Err(e) => answer(Err(e)),
        }
        if let Some(answer) = answered {
            self.keep_answer(id, answer);
        }
    }

    /// Runs a call: its answer, and the parameters' gradients when it completes a step (the
    /// optimizer update is taken once the answer is out).
    fn run(&mut self, call: Call, graph: Reservation) -> Result<(Answer, Option<Grads>), RequestError> {
        Ok(match call {
            Call::Forward { input, targets, microbatch, .. } => self.forward(input, targets, microbatch, graph)?,
            Call::Backward { grads } => self.backward(&grads)?,
            Call::Clip { coefficient } => self.clip_step(coefficient)?,
            Call::Evaluate { input } => (Answer::Output(self.part().stages.evaluate(&input)?.detached()), None),
            Call::Save { name } => (self.save(name)?, None),
            // Answered before the device (`wait_in_group`).
            Call::EndRound | Call::Average { .. } => return Err(Internal::WrongAnswer("EndRound").into()),
        })
    }

    fn save(&mut self, name: String) -> Result<Answer, RequestError> {
        let part = self.part();
        let meta = CheckpointMeta {
            bundle_id: part.stages.bundle().id().to_string(),
            ranges: vec![[part.stages.range().start, part.stages.range().end]],
            step: self.step,
            optimizer: part.optimizer.config().clone(),
            seed: self.seed,
            extra: Default::default(),
        };
        let saved = match &self.namespace {
            Some(namespace) => namespace.save(&name, &meta, &[&part.stages], &part.optimizer),
            None => Err(no_checkpoint_dir()),
        };
        if let Err(e) = &saved {
            tracing::info!(namespace = self.namespace.as_ref().map_or("", |n| n.name()), checkpoint = %name, error = %e, "checkpoint refused");
        }
        saved.map(|_bytes| Answer::Saved { name, step: self.step })
    }

    /// A training forward. With the loss here: backward too, returning the gradient answer
    /// (and the parameters' gradients, unless they wait for clipping); U-shaped: keeps the
    /// graph pending, with its bytes in the budget (`graph`), and answers with the boundary
    /// at `end`.
    fn forward(
        &mut self,
        input: Boundary,
        targets: Option<Tensor>,
        microbatch: Microbatch,
        graph: Reservation,
    ) -> Result<(Answer, Option<Grads>), TrainError> {
        if self.pending.take().is_some() {
            return Err(StepError::StillWaiting { step: self.step + 1 }.into());
        }
        if self.unclipped.is_some() {
            return Err(StepError::WaitingForClip { step: self.step + 1 }.into());
        }
        self.check_order(microbatch)?;
        let leaves = track_gradients(&input);
        let part = Arc::clone(&self.part);
        let mut part = part.lock().unwrap_or_else(|p| p.into_inner());
        let output = part.stages.forward_seeded(self.seed, self.step, microbatch, &input)?;
        let Some(loss_kind) = self.loss else {
            if targets.is_some() {
                return Err(StepError::TargetsPastTheLoss.into());
            }
            self.pending = Some(PendingStep { microbatch, inputs: leaves, outputs: float_leaves(&output), _graph: graph });
            return Ok((Answer::Output(output.detached()), None));
        };
        let targets = targets.ok_or(StepError::NoTargets { value: TARGETS_VALUE })?;
        let loss = microbatch.weigh(&step_loss(part.stages.bundle(), loss_kind, output, &targets)?);
        let grads = backward(Some(&loss), part.stages.parameters(), &leaves)?;
        drop(part);
        Ok(self.gradient_answer(Some(loss.double_value(&[])), grads, microbatch))
    }

    /// U-shaped: continues the pending step's backward pass from the gradient at `end`.
    fn backward(&mut self, grads: &Boundary) -> Result<(Answer, Option<Grads>), TrainError> {
        let PendingStep { microbatch, inputs: leaves, outputs, _graph: graph } = self.pending.take().ok_or(StepError::NoPendingForward)?;
        let grads = backward_from_boundary(&outputs, grads, self.part().stages.parameters(), &leaves)?;
        // (The graph is freed with `outputs`; its bytes go back with it.)
        drop((outputs, graph));
        Ok(self.gradient_answer(None, grads, microbatch))
    }

    /// Refuses a micro-batch out of its step's order (the step under way is kept).
    fn check_order(&self, microbatch: Microbatch) -> Result<(), StepError> {
        let (expected, expected_count) = match &self.microbatches {
            Some((next, count, _)) => (*next, *count),
            None => (0, microbatch.count),
        };
        if microbatch.index == expected && microbatch.count == expected_count {
            Ok(())
        } else {
            Err(StepError::MicrobatchOrder { expected, expected_count, got: microbatch.index, count: microbatch.count })
        }
    }

    /// A micro-batch's gradient answer. Before the last of a step, its parameters' gradients
    /// are added to the step's; with the last they are complete: with clipping they wait
    /// for the host's coefficient and the answer carries their norms, without they are
    /// stepped on at once.
    fn gradient_answer(&mut self, loss: Option<f64>, grads: PartGradients, microbatch: Microbatch) -> (Answer, Option<Grads>) {
        let mut sum = self.microbatches.take().map(|(_, _, sum)| sum);
        accumulate(&mut sum, grads.parameters);
        let sum = sum.unwrap_or_default();
        if !microbatch.is_last() {
            self.microbatches = Some((microbatch.index + 1, microbatch.count, sum));
            return (Answer::Gradients { loss, grads: grads.boundary, norms: None }, None);
        }
        if !self.clips {
            return (Answer::Gradients { loss, grads: grads.boundary, norms: None }, Some(sum));
        }
        let norms = tensor_norms(&sum);
        self.unclipped = Some(sum);
        (Answer::Gradients { loss, grads: grads.boundary, norms: Some(norms) }, None)
    }

    /// Scales the waiting step's gradients by the host's coefficient and returns them to
    /// be stepped on.
    fn clip_step(&mut self, coefficient: f32) -> Result<(Answer, Option<Grads>), TrainError> {
        if !self.clips {
            return Err(StepError::NotClipping.into());
        }
        let coefficient = check_coefficient(coefficient)?;
        let grads = self.unclipped.take().ok_or(StepError::NothingToClip)?;
        scale(&grads, coefficient);
        Ok((Answer::Stepped { step: self.step + 1 }, Some(grads)))
    }

    /// Counts the step a call finishes as taken before its answer goes out: a host that has
    /// the answer and continues the session on another stream is told so, though the step's
    /// optimizer update may still be running here (the session's next call waits for it).
    fn count_answered_step(&self) {
        self.shared_step.store(self.step + 1, Ordering::Relaxed);
    }

    fn finish_step(&mut self, param_grads: Grads) {
        {
            let mut part = self.part();
            let TrainedPart { stages, optimizer } = &mut *part;
            let lr = self.schedule.lr(optimizer.config().lr(), self.step);
            optimizer.step(stages.parameters(), &param_grads, lr);
        }
        self.step += 1;
        self.shared_step.store(self.step, Ordering::Relaxed);
        if let Some(member) = &self.member {
            member.stepped();
        }
    }

    /// Keeps an answer for a resend of its call: the last `pipeline_depth`, those before the
    /// newest within `max_kept_answer_bytes`, each held in the memory budget. Older answers
    /// are let go to make room; the newest is kept even where the budget has none left (one
    /// answer a session, within `max_payload_bytes`: a resend of the last call must find it).
    fn keep_answer(&mut self, id: u64, answer: Answer) {
        let bytes = answer.tensor_bytes();
        self.last_answered = self.last_answered.max(id);
        let _held = loop {
            match self.budget.try_reserve_kept(bytes) {
                Some(held) => break held,
                None if self.answered.is_empty() => break Reservation::none(),
                None => drop(self.answered.pop_front()),
            }
        };
        self.answered.push_back(KeptAnswer { id, answer, bytes, _held });
        let mut older: u64 = self.answered.iter().rev().skip(1).map(|kept| kept.bytes).sum();
        while self.answered.len() > self.pipeline_depth.max(1) || (self.answered.len() > 1 && older > self.max_kept_answer_bytes) {
            if let Some(kept) = self.answered.pop_front() {
                older -= kept.bytes;
            }
        }
    }

    /// The answer to call `id` when it is among the last calls answered (a resend).
    fn answered(&self, id: u64) -> Option<Answer> {
        self.answered.iter().find(|kept| kept.id == id).map(|kept| kept.answer.shallow_clone())
    }
}

/// The channel to a session's thread.
pub(crate) struct SessionHandle {
    calls: mpsc::Sender<CallJob>,
    /// The steps the session has taken, each from when its answer was sent.
    step: Arc<AtomicU64>,
}

impl SessionHandle {
    /// Loads session `id` on its own thread; returns once it is ready (or failed to load).
    /// A call whose stream has gone by the time the device is the session's is not run
    /// (counted in `metrics` as abandoned while queued).
    pub(crate) async fn spawn(setup: SessionSetup, id: &str, metrics: Metrics) -> Result<(Self, Opened), RequestError> {
        // Calls come one at a time per stream; the channel only hands them over.
        let (tx, mut rx) = mpsc::channel::<CallJob>(2);
        let (opened_tx, opened_rx) = oneshot::channel::<Result<(Opened, Arc<AtomicU64>), RequestError>>();
        let id = id.to_string();
        let turns = setup.turns.clone();
        let model = setup.bundle.id().to_string();
        let abandoned = move |job: &CallJob| {
            let gone = job.reply.is_closed();
            if gone {
                metrics.abandoned(&model, "queued");
            }
            gone
        };
        let runtime = tokio::runtime::Handle::current();
        std::thread::Builder::new()
            .name("cleave-train".into())
            .spawn(move || {
                let mut session = match Session::open(setup, &id) {
                    Ok(s) => {
                        let (device, parameters) = {
                            let part = s.part();
                            (cleave_common::device::device_name(part.stages.device()), part.stages.parameter_count())
                        };
                        let namespace = s.namespace.as_ref().map(|n| n.name().to_string()).unwrap_or_default();
                        let opened = Opened { step: s.step, parameters, device, namespace, weights: s.weights.clone() };
                        let _ = opened_tx.send(Ok((opened, Arc::clone(&s.shared_step))));
                        s
                    }
                    Err(e) => {
                        let _ = opened_tx.send(Err(e));
                        return;
                    }
                };
                while let Some(job) = rx.blocking_recv() {
                    if let Some(answer) = session.answered(job.id) {
                        let _ = job.reply.send(Ok((answer, Duration::ZERO)));
                        continue;
                    }
                    if job.id <= session.last_answered {
                        let _ = job.reply.send(Err(TrainError::from(StepError::AnswerNotKept { id: job.id }).into()));
                        continue;
                    }
                    if abandoned(&job) {
                        continue;
                    }
                    let Some(job) = session.wait_in_group(job) else { continue };
                    let graph = match session.reserve_graph(&job.call, &runtime) {
                        Ok(graph) => graph,
                        Err(e) => {
                            let _ = job.reply.send(Err(e));
                            continue;
                        }
                    };
                    // The device runs this call between inference batches; it is given back
                    // when the call is done (the optimizer step included).
                    let _turn = match turns.turn() {
                        Ok(turn) => turn,
                        Err(e) => {
                            let _ = job.reply.send(Err(e));
                            continue;
                        }
                    };
                    // The stream may have gone while the call waited for the device.
                    if abandoned(&job) {
                        continue;
                    }
                    let mut reply = Some(job.reply);
                    let handled = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        session.handle(job.id, (job.call, graph), Instant::now(), &mut reply)
                    }));
                    if let Err(panic) = handled {
                        // The call is answered INTERNAL; a step it left half done is dropped,
                        // and the session goes on with the next call.
                        let message = crate::error::panic_message(panic.as_ref());
                        tracing::error!(panic = %message, "a training call panicked");
                        session.pending = None;
                        session.unclipped = None;
                        session.microbatches = None;
                        if let Some(reply) = reply.take() {
                            let _ = reply.send(Err(RequestError::Panicked(format!("a training call panicked: {message}"))));
                        }
                    }
                }
            })
            .map_err(|e| Internal::SessionThread(cleave_common::error::Shared::new(e)))?;
        let (opened, step) = opened_rx.await.map_err(|_| Internal::SessionGone)??;
        Ok((Self { calls: tx, step }, opened))
    }

    /// Runs call `id` on the session thread (or answers it again, when it is among the last
    /// calls answered); returns the answer and the time it took there.
    pub(crate) async fn call(&self, id: u64, call: Call) -> Result<(Answer, Duration), RequestError> {
        let (tx, rx) = oneshot::channel();
        self.calls.send(CallJob { id, call, reply: tx }).await.map_err(|_| Internal::SessionGone)?;
        rx.await.map_err(|_| Internal::SessionGone)?
    }

    /// The steps the session has taken.
    pub(crate) fn step(&self) -> u64 {
        self.step.load(Ordering::Relaxed)
    }
}
