//! cleave's boundary payload codec: what crosses the network for a request, a result or a
//! gradient, as bytes. No libtorch here: tensors are dtype, shape and little-endian bytes, so
//! the codec is tested, fuzzed and benchmarked on its own.
//!
//! - [`codec`]: [`Codec`] (precision, shuffle, compression) and its text form; [`CodecPolicy`],
//!   what a receiver accepts.
//! - [`precision`], [`shuffle`], [`compress`]: the per-tensor steps, in pipeline order.
//! - [`seal`]: AES-256-GCM keys, key rings, the per-stream [`seal::Sealer`] and
//!   [`seal::Opener`] (nonces, replay refusal).
//! - [`payload`]: [`payload::encode_payload`] and [`payload::IncomingPayload`]: the envelope,
//!   the authenticated header and the data, with every size checked before allocation.
//! - [`pb`]: the payload messages generated from `proto/cleave/v1/payload.proto`.

// Libraries return what they found and hand progress to their caller; binaries print.
#![warn(clippy::print_stdout, clippy::print_stderr)]

pub mod codec;
pub mod compress;
pub mod dtype;
pub mod error;
pub mod payload;
#[allow(missing_docs, unreachable_pub, clippy::all)]
pub mod pb;
pub mod precision;
pub mod seal;
pub mod shuffle;
pub mod zeros;

pub use codec::{Codec, CodecPolicy, Compression, PolicyError, Precision};
pub use dtype::DType;
pub use error::{CodecError, Misuse};
pub use payload::{encode_payload, DecodedHeader, DecodedPayload, EncodedPayload, IncomingPayload, PayloadData, PayloadMeta, TensorData};
pub use pb::Direction;
pub use seal::{Key, KeyError, KeyRing, Opener, Sealer, REPLAY_WINDOW};
