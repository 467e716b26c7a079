//! What a request is to the streaming client: the plan of a run (`StreamPlan`, `Splits`), a
//! request's measurements and its one outcome, and what became of a run's requests.

use std::sync::Arc;
use std::time::Instant;

use cleave_client::ServerTimes;
use cleave_common::wire::{Codec, Key, WireError};
use cleave_common::{Boundary, Bundle, DeviceSpec, LoadedStages, StageRange};

use crate::config::Resilience;
use crate::error::RequestFailure;
use crate::inputs::Inputs;

/// What to send.
pub struct StreamPlan {
    /// The bundle (the server must serve the same id).
    pub bundle: Bundle,
    /// The cut each request is split at.
    pub split: Splits,
    /// Where the prefix runs.
    pub device: DeviceSpec,
    /// Stages already loaded on the edge and run (the profile's, with `split: auto`): used
    /// instead of loading and warming them again when they hold every stage needed.
    pub warm_stages: Option<LoadedStages>,
    /// The ids of the requests to send, in order (request `i` takes the inputs' batch `i`; a
    /// resumed run leaves out those already answered).
    pub ids: Vec<u64>,
    /// Requests in flight at once.
    pub in_flight: usize,
    /// Where the input batches come from.
    pub inputs: Inputs,
    /// How boundaries are encoded (results come back the same way).
    pub codec: Codecs,
    /// The key payloads are sealed with, if any.
    pub key: Option<(u32, Key)>,
    /// Deadlines, reconnects and fallback.
    pub resilience: Resilience,
}

/// How each request's boundary is encoded.
#[derive(Debug, Clone)]
pub enum Codecs {
    /// Always this codec.
    Fixed(Codec),
    /// Chosen for each boundary (`codec: auto`).
    Chosen(Arc<dyn ChoosesCodec>),
}

/// Chooses a codec for each boundary (`planning::codec_choice` for `codec: auto`).
pub trait ChoosesCodec: std::fmt::Debug + Send + Sync {
    /// The codec for `boundary`, split at `cut`.
    fn choose(&self, cut: usize, boundary: &Boundary) -> Result<Codec, WireError>;
    /// Every codec it may choose (the server must accept each).
    fn candidates(&self) -> &[Codec];
}

impl Codecs {
    /// The codec for `boundary`, split at `cut`.
    pub fn for_boundary(&self, cut: usize, boundary: &Boundary) -> Result<Codec, WireError> {
        match self {
            Codecs::Fixed(codec) => Ok(*codec),
            Codecs::Chosen(chooser) => chooser.choose(cut, boundary),
        }
    }

    /// Every codec a request may travel with.
    pub fn all(&self) -> Vec<Codec> {
        match self {
            Codecs::Fixed(codec) => vec![*codec],
            Codecs::Chosen(chooser) => chooser.candidates().to_vec(),
        }
    }
}

impl From<Codec> for Codecs {
    fn from(codec: Codec) -> Self {
        Codecs::Fixed(codec)
    }
}

/// Which cut each request is split at. A request split at the last cut runs wholly on the
/// edge and never crosses the network.
#[derive(Debug, Clone)]
pub enum Splits {
    /// Always this cut.
    Fixed(usize),
    /// Read when each request's prefix starts (`split: auto`: the planner moves it between
    /// requests on the same stream).
    Moving(tokio::sync::watch::Receiver<usize>),
    /// Request `i` at `cuts[i % cuts.len()]` (`host plan --measure`: every cut under the
    /// same conditions, interleaved).
    RoundRobin(Vec<usize>),
}

impl Splits {
    /// The cut of request `id`.
    pub fn for_request(&self, id: u64) -> usize {
        match self {
            Splits::Fixed(cut) => *cut,
            Splits::Moving(cut) => *cut.borrow(),
            Splits::RoundRobin(cuts) => cuts[(id % cuts.len().max(1) as u64) as usize],
        }
    }

    /// The stages the edge must hold.
    pub(crate) fn edge_stages(&self, bundle: &Bundle) -> StageRange {
        match self {
            Splits::Fixed(cut) => StageRange::prefix(*cut),
            Splits::Moving(_) => StageRange::all(bundle),
            Splits::RoundRobin(cuts) => StageRange::prefix(cuts.iter().copied().max().unwrap_or(0)),
        }
    }
}

/// Measurements of one request.
#[derive(Debug, Clone, Default)]
pub struct RequestMetrics {
    /// The cut this request was split at.
    pub split: usize,
    /// Making the input (reading or generating it); part of `e2e_ms`.
    pub input_ms: f64,
    /// Running stages [0, split).
    pub prefix_ms: f64,
    /// Processor time the prefix took: below `prefix_ms` when the thread waited for the
    /// processor (another thread, or a capped edge's quota).
    pub prefix_cpu_ms: f64,
    /// Encoding the boundary.
    pub encode_ms: f64,
    /// Tensor bytes of the boundary.
    pub bytes_raw: u64,
    /// Bytes of the frames on the wire.
    pub bytes_wire: u64,
    /// The codec the boundary travelled with (none for a request that never left the edge).
    pub codec: Option<Codec>,
    /// Bytes of the boundary copied as they were to send it (none for a raw boundary sent
    /// from its tensors' memory; gRPC's own copies are not counted).
    pub copied_sent_bytes: u64,
    /// Bytes of the result copied as they were to receive it (from the frames into its
    /// tensors, or into a buffer to decode from, and by decoding).
    pub copied_received_bytes: u64,
    /// From handing the first frame to gRPC until the last result frame arrived.
    pub round_trip_ms: f64,
    /// The server's timings.
    pub server: ServerTimes,
    /// Decoding the result.
    pub decode_ms: f64,
    /// From making the input to having the output.
    pub e2e_ms: f64,
    /// Who ran the suffix.
    pub served_by: ServedBy,
    /// Running the suffix on the edge (`fallback: edge`), ms.
    pub suffix_on_edge_ms: f64,
    /// Times the request was sent to a server.
    pub attempts: u32,
    /// The server that answered, when the run had several (its URL).
    pub server_url: Option<std::sync::Arc<str>>,
}

impl RequestMetrics {
    /// The network's share: the round trip less the server's time (zero for a request that
    /// never left the edge).
    pub fn network_ms(&self) -> f64 {
        (self.round_trip_ms - self.server.total_ms()).max(0.0)
    }
}

/// Who ran a request's suffix.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ServedBy {
    /// The server.
    #[default]
    Server,
    /// The edge: the request was split at the last cut, or no server answered it
    /// (`fallback: edge`).
    Edge,
}

impl ServedBy {
    /// `server` or `edge`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Server => "server",
            Self::Edge => "edge",
        }
    }
}

/// What became of a run's requests (`summary.json`).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct StreamCounts {
    /// Requests sent to a server at least once.
    pub sent: u64,
    /// Requests answered with a result, by a server or the edge.
    pub answered: u64,
    /// Sends beyond a request's first (after a broken or stalled connection).
    pub retried: u64,
    /// Requests whose one outcome is an error.
    pub failed: u64,
    /// Requests never sent: the run stopped before their turn.
    pub never_sent: u64,
    /// Requests answered on the edge (split at the last cut, or `fallback: edge`).
    pub served_by_edge: u64,
    /// Connections opened after the first.
    pub reconnects: u64,
    /// Answers for a request that already had its outcome, dropped.
    pub duplicates_dropped: u64,
    /// Requests answered by each server, by URL, when the run had several.
    pub by_server: std::collections::BTreeMap<String, u64>,
    /// The run stopped early: its first requests all failed with one error that sending
    /// again cannot fix (a wrong key, say).
    pub stopped_early: bool,
}

/// The answer to one request.
pub struct RequestOutcome {
    /// The request id.
    pub request_id: u64,
    /// Its measurements.
    pub metrics: RequestMetrics,
    /// The boundary at the last cut, or the error.
    pub output: Result<Boundary, RequestFailure>,
}

/// Milliseconds since `since`.
pub(super) fn ms(since: Instant) -> f64 {
    since.elapsed().as_secs_f64() * 1e3
}
