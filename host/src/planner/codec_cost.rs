//! What each codec costs on this machine at a cut: its ratio on that cut's boundary and its
//! encoding and decoding speed, measured. `codec: auto` chooses each request's codec by it,
//! and with `split: auto` the planner chooses the cut and the codec together.

use std::time::Instant;

use cleave_common::stats::median;
use cleave_common::wire::{Codec, CodecPolicy, Direction, KeyRing, PayloadMeta, PayloadReceiver, PayloadSender, WireError};
use cleave_common::Boundary;
use serde::Serialize;

const MIB: f64 = (1u64 << 20) as f64;

/// The share of the bytes a compressing codec must save to be chosen: what it saves below
/// this is within the timing noise of its measured CPU cost, so data that does not compress
/// goes raw, not to whichever codec a busy machine happened to time as faster.
const MIN_SAVING: f64 = 0.01;

/// The costs `codec: auto` chooses among, and `split: auto` predicts with: raw and the codecs
/// that save at least [`MIN_SAVING`] of the bytes, or every one where none of them is left (a
/// server that refuses raw, data that does not compress).
pub fn eligible(costs: &[CodecCost]) -> Vec<&CodecCost> {
    let saving: Vec<&CodecCost> = costs.iter().filter(|c| c.codec == Codec::RAW || c.wire_ratio <= 1.0 - MIN_SAVING).collect();
    if saving.is_empty() {
        costs.iter().collect()
    } else {
        saving
    }
}

/// A codec's cost on this machine for the boundary at one cut.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct CodecCost {
    /// The codec.
    #[serde(serialize_with = "codec_text")]
    pub codec: Codec,
    /// Payload bytes per tensor byte.
    pub wire_ratio: f64,
    /// Encoding, milliseconds per MiB of tensors.
    pub encode_ms_per_mib: f64,
    /// Decoding, milliseconds per MiB of tensors.
    pub decode_ms_per_mib: f64,
}

/// A codec as its text (`shuffle+lz4`) in JSON.
pub(crate) fn codec_text<S: serde::Serializer>(codec: &Codec, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(codec)
}

impl CodecCost {
    /// Milliseconds to encode and decode `raw_bytes` of tensors.
    pub fn codec_ms(&self, raw_bytes: u64) -> f64 {
        raw_bytes as f64 / MIB * (self.encode_ms_per_mib + self.decode_ms_per_mib)
    }

    /// Bytes on the wire for `raw_bytes` of tensors.
    pub fn wire_bytes(&self, raw_bytes: u64) -> u64 {
        (raw_bytes as f64 * self.wire_ratio).round() as u64
    }

    /// Milliseconds to move `raw_bytes` of tensors at `bytes_per_s`: encoding, the transfer
    /// and decoding.
    pub fn ms(&self, raw_bytes: u64, bytes_per_s: f64) -> f64 {
        self.codec_ms(raw_bytes) + raw_bytes as f64 * self.wire_ratio / bytes_per_s * 1e3
    }

    /// Measures `codec` on `boundary` (the median of `repeats` passes): encoded as a request
    /// sends it (the boundary given up), decoded as the server receives it.
    pub fn measure(codec: Codec, boundary: &Boundary, repeats: usize) -> Result<Self, WireError> {
        let raw = boundary.tensor_bytes().max(1) as f64;
        let (mut encode, mut decode, mut wire) = (Vec::new(), Vec::new(), 0);
        for _ in 0..repeats.max(1) {
            let meta = PayloadMeta { request_id: 0, split: 0, direction: Direction::Request };
            let started = Instant::now();
            // SAFETY: `boundary` is only read while the payload lives (dropped in this pass).
            #[allow(unsafe_code)]
            let encoded = unsafe { PayloadSender::plain().encode_owned(meta, &codec, boundary.shallow_clone())? };
            encode.push(started.elapsed().as_secs_f64() * 1e3);
            wire = encoded.envelope.len() + encoded.data.len();
            let started = Instant::now();
            let mut receiver = PayloadReceiver::new(Direction::Request, u64::MAX, CodecPolicy::default(), &KeyRing::default());
            let mut assembly = receiver.start(0, &encoded.envelope)?;
            assembly.push_data(0, &encoded.data)?;
            receiver.finish(assembly)?;
            decode.push(started.elapsed().as_secs_f64() * 1e3);
        }
        let per_mib = |v: Vec<f64>| median(&v).unwrap_or(0.0) / (raw / MIB);
        Ok(Self { codec, wire_ratio: wire as f64 / raw, encode_ms_per_mib: per_mib(encode), decode_ms_per_mib: per_mib(decode) })
    }

    /// Each of `candidates` measured on `boundary`.
    pub fn measure_all(candidates: &[Codec], boundary: &Boundary, repeats: usize) -> Result<Vec<Self>, WireError> {
        candidates.iter().map(|&c| Self::measure(c, boundary, repeats)).collect()
    }
}

/// The codecs `codec: auto` chooses among at one cut, measured on its boundary.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CutCodecs {
    /// The boundary's tensor bytes (at the profiled batch size).
    pub tensor_bytes: u64,
    /// Each candidate's cost there.
    pub costs: Vec<CodecCost>,
}
