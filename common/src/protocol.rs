//! The gRPC protocol `cleave.v1` at its edge: the generated types ([`pb`], used only by RPC
//! glue), the protocol constants, and the conversions between generated and domain types
//! (the server's `Info`, optimizers, the frames every stream carries).

use crate::config::Limits;
use crate::training::microbatch::Microbatch;
use crate::training::optim::OptimizerConfig;
use crate::training::schedule::{Decay, Schedule, Warmup};
use crate::training::{OptimizerError, ScheduleError, TrainError};
use crate::wire::{CodecPolicy, FramePart, PayloadFrame, Precision};

/// The generated gRPC types and service (from `proto/cleave/v1/cleave.proto`). Only the RPC
/// glue uses them; the rest of the code works with domain types and converts here.
#[allow(missing_docs, unreachable_pub, clippy::all)]
pub mod pb {
    tonic::include_proto!("cleave.v1");
    /// A message sealed whole: the codec's (payload.proto), which owns the sealing.
    pub use cleave_codec::pb::SealedMessage;
}

/// Version of `cleave.v1` this build speaks; a host refuses a server with another. Version 2:
/// compressed tensors travel in blocks (`TensorHeader.blocks`, decoded on several cores),
/// and a tensor may have its zeros elided or its own codec under `auto`. Payloads of
/// version 1 (each tensor compressed whole) are still read. Version 3: training sessions
/// take a learning-rate schedule and global gradient-norm clipping (`OpenSession.schedule`,
/// `clip_grad_norm`, `ClipStep`), which an older server would ignore. Version 4: several
/// edges train one server part together (`OpenSession.clients`, `EndRound`).
pub const PROTOCOL_VERSION: u32 = 4;

/// What a sealed generation step is authenticated as (`SealedMessage`'s kind): a step is
/// never taken for an answer, nor an answer for a step.
pub const SEALED_STEP_KIND: &str = "cleave.v1.GenerateStep";

/// What a sealed generation step's answer is authenticated as.
pub const SEALED_REPLY_KIND: &str = "cleave.v1.GenerateReply";

/// Metadata key carrying the bundle id the host expects on `Infer` and `Train` streams.
pub const BUNDLE_ID_METADATA: &str = "cleave-bundle-id";

/// Metadata key carrying the host's session id on `Infer` streams (1 to 64 letters, digits,
/// `-` or `_`, random per run): a request resent under the same session and request id is
/// answered from the server's window of recent results, not computed again.
pub const HOST_SESSION_METADATA: &str = "cleave-host-session";

/// What a server's refusal to continue a training session says, which a host matches on
/// (gRPC carries only a code and a message): the session may yet be continued once the
/// server notices that its old stream broke.
pub const SESSION_NOT_WAITING: &str = "is not waiting to be continued";

/// A server's `Info` that this host cannot work with.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtocolError {
    /// The server speaks another version of the protocol.
    #[error("the server speaks protocol version {server}, this host speaks version {host}")]
    VersionMismatch {
        /// This build's version.
        host: u32,
        /// The server's.
        server: u32,
    },
    /// The `Info` reply has no limits.
    #[error("the server's Info is invalid: no limits")]
    NoLimits,
    /// A limit in `Info` that cannot be right.
    #[error("the server's Info is invalid: {key} {0}", key = .0.key)]
    InvalidLimit(crate::config::LimitError),
    /// A model in `Info` without its bundle id.
    #[error("the server's Info is invalid: model {index} has no bundle id")]
    ModelWithoutId {
        /// Its place in the list.
        index: usize,
    },
    /// A bundle id listed twice in `Info`.
    #[error("the server's Info is invalid: bundle id {0} is listed twice")]
    ModelTwice(String),
}

/// What a server serves and accepts, from its `Info`.
#[derive(Debug, Clone, PartialEq)]
pub struct ServerInfo {
    /// The server's build.
    pub server_version: String,
    /// Every model it serves (at least one), each selected by its bundle id.
    pub models: Vec<ServedModel>,
    /// The limits it enforces; a host frames and accepts messages by them.
    pub limits: Limits,
    /// The codecs it accepts and whether payloads must be sealed.
    pub policy: CodecPolicy,
    /// The key ids it holds.
    pub key_ids: Vec<u32>,
}

/// One model a server serves.
#[derive(Debug, Clone, PartialEq)]
pub struct ServedModel {
    /// The id of its bundle (hosts select the model by it).
    pub bundle_id: String,
    /// Where that bundle's model came from.
    pub model_source: String,
    /// Stages in the bundle.
    pub stage_count: usize,
    /// The device its stages run on (`cpu`, `cuda:0`).
    pub device: String,
    /// The largest batch one request may carry (the bundle's).
    pub max_batch: u32,
    /// The latency target the server schedules it by.
    pub slo_ms: Option<u32>,
    /// Samples the server merges into one batch across requests (1: none merged).
    pub batch_limit: u32,
    /// The cuts at which its requests are merged into batches.
    pub batchable_cuts: Vec<usize>,
    /// How its bundle was exported (none from a server that does not say).
    pub export: Option<ExportFacts>,
}

/// What tells two exports of one model apart.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportFacts {
    /// Seed of the random initialisation.
    pub seed: i64,
    /// The granularity the exporter cut at.
    pub granularity: String,
    /// Parameters of the whole model.
    pub parameters: u64,
    /// The exporter's version.
    pub exporter_version: String,
    /// The PyTorch version it exported with.
    pub torch_version: String,
}

impl ExportFacts {
    /// The facts of `bundle`.
    pub fn of(bundle: &crate::Bundle) -> Self {
        let m = bundle.manifest();
        Self {
            seed: m.model.seed,
            granularity: m.exporter.granularity.clone(),
            parameters: m.model.parameters,
            exporter_version: m.exporter.version.clone(),
            torch_version: m.exporter.torch.clone(),
        }
    }

    /// What differs from `other` (`seed 3 there, 0 here`), one entry per fact.
    pub fn differences(&self, here: &Self) -> Vec<String> {
        let facts = [
            ("seed", self.seed.to_string(), here.seed.to_string()),
            ("granularity", self.granularity.clone(), here.granularity.clone()),
            ("parameters", self.parameters.to_string(), here.parameters.to_string()),
            ("exporter", self.exporter_version.clone(), here.exporter_version.clone()),
            ("torch", self.torch_version.clone(), here.torch_version.clone()),
        ];
        facts.into_iter().filter(|(_, there, here)| there != here).map(|(name, there, here)| format!("{name} {there} there, {here} here")).collect()
    }
}

impl From<pb::ExportFacts> for ExportFacts {
    fn from(e: pb::ExportFacts) -> Self {
        Self {
            seed: e.seed,
            granularity: e.granularity,
            parameters: e.parameters,
            exporter_version: e.exporter_version,
            torch_version: e.torch_version,
        }
    }
}

impl From<&ExportFacts> for pb::ExportFacts {
    fn from(e: &ExportFacts) -> Self {
        Self {
            seed: e.seed,
            granularity: e.granularity.clone(),
            parameters: e.parameters,
            exporter_version: e.exporter_version.clone(),
            torch_version: e.torch_version.clone(),
        }
    }
}

impl ServerInfo {
    /// The model with bundle id `id`.
    pub fn model(&self, id: &str) -> Option<&ServedModel> {
        self.models.iter().find(|m| m.bundle_id == id)
    }

    /// The bundle ids served, for messages.
    pub fn model_ids(&self) -> Vec<&str> {
        self.models.iter().map(|m| m.bundle_id.as_str()).collect()
    }
}

impl From<pb::ModelInfo> for ServedModel {
    fn from(m: pb::ModelInfo) -> Self {
        Self {
            bundle_id: m.bundle_id,
            model_source: m.model_source,
            stage_count: m.stage_count as usize,
            device: m.device,
            max_batch: m.max_batch,
            slo_ms: (m.slo_ms > 0).then_some(m.slo_ms),
            batch_limit: m.batch_limit.max(1),
            batchable_cuts: m.batchable_cuts.into_iter().map(|c| c as usize).collect(),
            export: m.export.map(ExportFacts::from),
        }
    }
}

impl From<&ServedModel> for pb::ModelInfo {
    fn from(m: &ServedModel) -> Self {
        Self {
            bundle_id: m.bundle_id.clone(),
            model_source: m.model_source.clone(),
            stage_count: m.stage_count as u32,
            device: m.device.clone(),
            max_batch: m.max_batch,
            slo_ms: m.slo_ms.unwrap_or(0),
            batch_limit: m.batch_limit,
            batchable_cuts: m.batchable_cuts.iter().map(|&c| c as u32).collect(),
            export: m.export.as_ref().map(pb::ExportFacts::from),
        }
    }
}

impl TryFrom<pb::InfoReply> for ServerInfo {
    type Error = ProtocolError;

    /// Checks the protocol version first, then that the limits are ones a server could
    /// enforce (the host sizes its frames and buffers by them) and that it names its models.
    /// A server from before `models` describes its one model in the top-level fields.
    fn try_from(info: pb::InfoReply) -> Result<Self, ProtocolError> {
        if info.protocol_version != PROTOCOL_VERSION {
            return Err(ProtocolError::VersionMismatch { host: PROTOCOL_VERSION, server: info.protocol_version });
        }
        let l = info.limits.ok_or(ProtocolError::NoLimits)?;
        let limits = Limits { max_message_bytes: l.max_message_bytes, max_payload_bytes: l.max_payload_bytes, queue_depth: l.queue_depth };
        limits.validate().map_err(ProtocolError::InvalidLimit)?;
        let codecs = info.codecs.unwrap_or_default();
        let policy = CodecPolicy {
            precisions: Precision::ALL.into_iter().filter(|p| codecs.precisions.iter().any(|n| n == p.name())).collect(),
            compressions: codecs.compressions,
            require_encryption: codecs.encryption_required,
        };
        let models: Vec<ServedModel> = if info.models.is_empty() {
            vec![ServedModel {
                bundle_id: info.bundle_id,
                model_source: info.model_source,
                stage_count: info.stage_count as usize,
                device: info.device,
                max_batch: l.max_batch,
                slo_ms: None,
                batch_limit: 1,
                batchable_cuts: Vec::new(),
                export: None,
            }]
        } else {
            info.models.into_iter().map(ServedModel::from).collect()
        };
        for (i, m) in models.iter().enumerate() {
            if m.bundle_id.is_empty() {
                return Err(ProtocolError::ModelWithoutId { index: i });
            }
            if models[..i].iter().any(|other| other.bundle_id == m.bundle_id) {
                return Err(ProtocolError::ModelTwice(m.bundle_id.clone()));
            }
        }
        Ok(Self { server_version: info.server_version, models, limits, policy, key_ids: codecs.key_ids })
    }
}

impl From<&ServerInfo> for pb::InfoReply {
    fn from(info: &ServerInfo) -> Self {
        let first = info.models.first();
        pb::InfoReply {
            protocol_version: PROTOCOL_VERSION,
            server_version: info.server_version.clone(),
            bundle_id: first.map(|m| m.bundle_id.clone()).unwrap_or_default(),
            model_source: first.map(|m| m.model_source.clone()).unwrap_or_default(),
            stage_count: first.map_or(0, |m| m.stage_count as u32),
            device: first.map(|m| m.device.clone()).unwrap_or_default(),
            limits: Some(pb::Limits {
                max_message_bytes: info.limits.max_message_bytes,
                max_payload_bytes: info.limits.max_payload_bytes,
                queue_depth: info.limits.queue_depth,
                max_batch: first.map_or(0, |m| m.max_batch),
            }),
            codecs: Some(pb::CodecSupport {
                precisions: info.policy.precisions.iter().map(|p| p.name().to_string()).collect(),
                compressions: info.policy.compressions.clone(),
                encryption_required: info.policy.require_encryption,
                key_ids: info.key_ids.clone(),
            }),
            models: info.models.iter().map(pb::ModelInfo::from).collect(),
        }
    }
}

impl From<&OptimizerConfig> for pb::Optimizer {
    fn from(o: &OptimizerConfig) -> Self {
        match *o {
            OptimizerConfig::Sgd { lr, momentum, dampening, weight_decay, nesterov } => {
                pb::Optimizer { kind: "sgd".into(), lr, momentum, dampening, weight_decay, nesterov, ..Default::default() }
            }
            OptimizerConfig::Adam { lr, betas, eps, weight_decay } | OptimizerConfig::Adamw { lr, betas, eps, weight_decay } => {
                pb::Optimizer { kind: o.kind().into(), lr, weight_decay, beta1: betas[0], beta2: betas[1], eps, ..Default::default() }
            }
        }
    }
}

impl TryFrom<&pb::Optimizer> for OptimizerConfig {
    type Error = OptimizerError;

    /// The optimizer a session asks for, validated as a config file's would be.
    fn try_from(o: &pb::Optimizer) -> Result<Self, OptimizerError> {
        let config = match o.kind.as_str() {
            "sgd" => {
                OptimizerConfig::Sgd { lr: o.lr, momentum: o.momentum, dampening: o.dampening, weight_decay: o.weight_decay, nesterov: o.nesterov }
            }
            "adam" => OptimizerConfig::Adam { lr: o.lr, betas: [o.beta1, o.beta2], eps: o.eps, weight_decay: o.weight_decay },
            "adamw" => OptimizerConfig::Adamw { lr: o.lr, betas: [o.beta1, o.beta2], eps: o.eps, weight_decay: o.weight_decay },
            other => return Err(OptimizerError::UnknownKind(other.into())),
        };
        config.validate().map(|()| config)
    }
}

impl From<&Schedule> for pb::Schedule {
    fn from(s: &Schedule) -> Self {
        let (warmup_steps, warmup_start_factor) = s.warmup.as_ref().map_or((0, 0.0), |w| (w.steps, w.start_factor));
        let warmup = pb::Schedule { warmup_steps, warmup_start_factor, ..Default::default() };
        match s.decay {
            Decay::Constant => pb::Schedule { decay: "constant".into(), ..warmup },
            Decay::Step { step_size, gamma } => pb::Schedule { decay: "step".into(), step_size, gamma, ..warmup },
            Decay::Cosine { total_steps, min_lr } => pb::Schedule { decay: "cosine".into(), total_steps, min_lr, ..warmup },
        }
    }
}

impl TryFrom<&pb::Schedule> for Schedule {
    type Error = ScheduleError;

    /// The schedule a session asks for, validated as a config file's would be.
    fn try_from(s: &pb::Schedule) -> Result<Self, ScheduleError> {
        let decay = match s.decay.as_str() {
            "constant" | "" => Decay::Constant,
            "step" => Decay::Step { step_size: s.step_size, gamma: s.gamma },
            "cosine" => Decay::Cosine { total_steps: s.total_steps, min_lr: s.min_lr },
            other => return Err(ScheduleError::UnknownDecay(other.into())),
        };
        let warmup = (s.warmup_steps > 0).then_some(Warmup { steps: s.warmup_steps, start_factor: s.warmup_start_factor });
        let schedule = Schedule { warmup, decay };
        schedule.validate().map(|()| schedule)
    }
}

impl pb::TrainPayloadFrame {
    /// The micro-batch a `PHASE_FORWARD` call's first frame says it is, checked.
    pub fn microbatch(&self) -> Result<Microbatch, TrainError> {
        let count = self.microbatches.max(1);
        let weight = if self.loss_weight == 0.0 { 1.0 } else { self.loss_weight };
        Microbatch::new(self.microbatch, count, weight)
    }

    /// Says on a call's first frame which micro-batch it is.
    pub fn set_microbatch(&mut self, microbatch: Microbatch) {
        (self.microbatch, self.microbatches, self.loss_weight) = (microbatch.index, microbatch.count, microbatch.weight);
    }
}

/// Every stream's payload frames: a request id, the envelope on the first, a slice of the
/// data, the last marked.
macro_rules! payload_frame {
    ($($frame:ty),*) => {$(
        impl PayloadFrame for $frame {
            fn request_id(&self) -> u64 {
                self.request_id
            }
            fn header(&self) -> &[u8] {
                &self.header
            }
            fn data(&self) -> &[u8] {
                &self.data
            }
            fn last(&self) -> bool {
                self.last
            }
            #[allow(clippy::needless_update)] // InferFrame has no other fields
            fn from_part(request_id: u64, part: FramePart) -> Self {
                Self { request_id, header: part.header, data: part.data, last: part.last, ..Default::default() }
            }
        }
    )*};
}

payload_frame!(pb::InferFrame, pb::ResultFrame, pb::TrainPayloadFrame, pb::TrainReply);

#[cfg(test)]
mod tests {
    use super::*;

    fn info() -> pb::InfoReply {
        let model = |id: &str| ServedModel {
            bundle_id: id.into(),
            model_source: "m".into(),
            stage_count: 4,
            device: "cpu".into(),
            max_batch: 8,
            slo_ms: Some(20),
            batch_limit: 4,
            batchable_cuts: vec![0, 2, 4],
            export: Some(ExportFacts {
                seed: 3,
                granularity: "op".into(),
                parameters: 99,
                exporter_version: "0.1.0".into(),
                torch_version: "2.11.0".into(),
            }),
        };
        let info = ServerInfo {
            server_version: "0.1.0".into(),
            models: vec![model("abc"), ServedModel { slo_ms: None, ..model("def") }],
            limits: Limits { max_message_bytes: 32 << 20, ..Limits::default() },
            policy: CodecPolicy::default(),
            key_ids: vec![3],
        };
        pb::InfoReply::from(&info)
    }

    #[test]
    fn info_round_trips() {
        let back = ServerInfo::try_from(info()).unwrap();
        assert_eq!(back.limits.max_message_bytes, 32 << 20);
        assert_eq!(back.policy, CodecPolicy::default());
        assert_eq!(pb::InfoReply::from(&back), info());
        assert_eq!(back.model_ids(), ["abc", "def"]);
        assert_eq!((back.model("def").unwrap().slo_ms, back.model("abc").unwrap().batchable_cuts.len()), (None, 3));
    }

    #[test]
    fn a_server_of_one_model_from_before_the_list_is_read_from_the_top_level_fields() {
        let old = pb::InfoReply { models: Vec::new(), ..info() };
        let back = ServerInfo::try_from(old).unwrap();
        assert_eq!(back.model_ids(), ["abc"]);
        assert_eq!((back.models[0].max_batch, back.models[0].batch_limit, back.models[0].stage_count), (8, 1, 4));
    }

    #[test]
    fn a_model_list_without_ids_or_with_one_twice_is_refused() {
        let mut reply = info();
        reply.models[1].bundle_id = "abc".into();
        assert!(ServerInfo::try_from(reply.clone()).unwrap_err().to_string().contains("bundle id abc is listed twice"));
        reply.models[1].bundle_id = String::new();
        assert!(ServerInfo::try_from(reply).unwrap_err().to_string().contains("model 1 has no bundle id"));
    }

    #[test]
    fn another_protocol_version_is_refused_naming_both() {
        let err = ServerInfo::try_from(pb::InfoReply { protocol_version: 1, ..info() }).unwrap_err();
        assert_eq!(err, ProtocolError::VersionMismatch { host: 4, server: 1 });
        assert_eq!(err.to_string(), "the server speaks protocol version 1, this host speaks version 4");
    }

    #[test]
    fn impossible_limits_are_refused() {
        let mut reply = info();
        reply.limits.as_mut().unwrap().max_message_bytes = 100;
        assert!(ServerInfo::try_from(reply).unwrap_err().to_string().contains("max_message_bytes"));
        assert!(ServerInfo::try_from(pb::InfoReply { limits: None, ..info() }).unwrap_err().to_string().contains("no limits"));
    }

    #[test]
    fn optimizers_round_trip() {
        for o in [
            OptimizerConfig::Sgd { lr: 0.1, momentum: 0.9, dampening: 0.0, weight_decay: 1e-4, nesterov: true },
            OptimizerConfig::Adam { lr: 1e-3, betas: [0.9, 0.999], eps: 1e-8, weight_decay: 0.0 },
            OptimizerConfig::Adamw { lr: 1e-3, betas: [0.9, 0.99], eps: 1e-8, weight_decay: 0.01 },
        ] {
            assert_eq!(OptimizerConfig::try_from(&pb::Optimizer::from(&o)).unwrap(), o);
        }
        let bad = pb::Optimizer { kind: "lion".into(), ..Default::default() };
        assert!(OptimizerConfig::try_from(&bad).unwrap_err().to_string().contains("not one of"));
    }

    #[test]
    fn schedules_round_trip() {
        let warmup = Some(Warmup { steps: 10, start_factor: 0.25 });
        for s in [
            Schedule::default(),
            Schedule { warmup: warmup.clone(), decay: Decay::Constant },
            Schedule { warmup: None, decay: Decay::Step { step_size: 30, gamma: 0.1 } },
            Schedule { warmup, decay: Decay::Cosine { total_steps: 1000, min_lr: 1e-5 } },
        ] {
            assert_eq!(Schedule::try_from(&pb::Schedule::from(&s)).unwrap(), s);
        }
        let bad = pb::Schedule { decay: "cosine".into(), total_steps: 0, ..Default::default() };
        assert!(Schedule::try_from(&bad).unwrap_err().to_string().contains("decay.total_steps"));
    }
}
