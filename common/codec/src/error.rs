//! What can be wrong with a payload, one variant per check. Every payload comes from the
//! network, so each of these is an answer to a peer, never a panic. A variant's message
//! includes its cause, so a printed chain names each cause once.

use crate::codec::PolicyError;
use crate::compress::BlockError;
use crate::dtype::DType;
use crate::precision::PrecisionError;
use crate::zeros::ZeroMaskError;

/// Why a payload cannot be encoded or was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CodecError {
    /// The envelope or header bytes are not what they claim to be.
    #[error("malformed payload: {0}")]
    Malformed(String),
    /// The payload was sent for another direction (a result where a request belongs).
    #[error("a {got} payload arrived where a {expected} was expected")]
    WrongDirection {
        /// The direction expected.
        expected: &'static str,
        /// The direction the header names.
        got: String,
    },
    /// The codec string does not parse.
    #[error("codec {codec:?}: {reason}")]
    CodecRefused {
        /// The codec as sent.
        codec: String,
        /// Why it does not parse.
        reason: String,
    },
    /// The receiver does not accept the codec.
    #[error("codec {codec:?}: {error}")]
    CodecNotAccepted {
        /// The codec as sent.
        codec: String,
        /// The part refused.
        error: PolicyError,
    },
    /// A tensor whose header is not what it claims to be.
    #[error("malformed payload: tensor {name}: {error}")]
    InvalidTensor {
        /// Tensor name.
        name: String,
        /// What is wrong with it.
        error: TensorError,
    },
    /// A dtype name this build does not know.
    #[error("tensor {name}: unknown dtype {dtype:?}")]
    UnknownDtype {
        /// Tensor name.
        name: String,
        /// The dtype sent.
        dtype: String,
    },
    /// A negative dimension or a shape whose size overflows.
    #[error("tensor {name}: invalid shape {shape:?}")]
    InvalidShape {
        /// Tensor name.
        name: String,
        /// The shape sent.
        shape: Vec<i64>,
    },
    /// A declared length that does not fit dtype x shape or the codec.
    #[error("tensor {name}: declared {declared} bytes, but {expected}")]
    SizeMismatch {
        /// Tensor name.
        name: String,
        /// Bytes declared.
        declared: u64,
        /// What dtype x shape (or the codec) allows.
        expected: String,
    },
    /// The payload declares more bytes than the limit.
    #[error("payload of {declared} bytes exceeds the limit of {limit} bytes")]
    PayloadTooLarge {
        /// Bytes declared.
        declared: u64,
        /// The limit.
        limit: u64,
    },
    /// Fewer bytes arrived than the header declared.
    #[error("payload truncated: {got} of {expected} bytes arrived")]
    Truncated {
        /// Bytes declared.
        expected: u64,
        /// Bytes received.
        got: u64,
    },
    /// A tensor's bytes do not decode to what its header declared.
    #[error("tensor {name}: cannot decode: {error}")]
    Corrupt {
        /// Tensor name.
        name: String,
        /// What failed.
        error: TensorError,
    },
    /// Encryption is required here and the payload is not sealed.
    #[error("this side requires encrypted payloads (AES-256-GCM) and this one is not encrypted")]
    NotSealed,
    /// A sealed payload arrived and this side holds no key.
    #[error("the payload is encrypted with key id {id} and this side holds no key")]
    NoKeys {
        /// The key id named.
        id: u32,
    },
    /// The key id is not held here.
    #[error("unknown key id {id} (this side holds ids {held:?})")]
    UnknownKeyId {
        /// The key id named.
        id: u32,
        /// The ids held.
        held: Vec<u32>,
    },
    /// The key with that id here is not the sender's.
    #[error("wrong key: key id {id} here is not the key the sender used")]
    WrongKey {
        /// The key id.
        id: u32,
    },
    /// The header failed authentication.
    #[error("authentication failed: the payload header was altered in flight")]
    HeaderTampered,
    /// The data failed authentication.
    #[error("authentication failed: the payload data was altered in flight")]
    DataTampered,
    /// A payload whose nonce was already used, or that came out of order.
    #[error("replayed or reordered payload refused: {detail}")]
    Replayed {
        /// Which check failed.
        detail: String,
    },
    /// A stream sent so many payloads that its next nonce would repeat.
    #[error("this stream has used every nonce of its prefix: open a new stream")]
    NoncesExhausted,
    /// Sealing failed (it cannot for payloads under 64 GiB).
    #[error("cannot encrypt the {0}")]
    Seal(String),
    /// A tensor that cannot be encoded with this codec.
    #[error("tensor {name}: cannot encode: {error}")]
    Encode {
        /// Tensor name.
        name: String,
        /// Why.
        error: TensorError,
    },
}

/// What is wrong with one tensor: its header, or its bytes on the way in or out.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TensorError {
    /// A `dim_order` that is not an order of the tensor's dimensions.
    #[error("dim_order {order:?} is not an order of its {rank} dimensions")]
    DimOrder {
        /// The order given.
        order: Vec<u32>,
        /// The tensor's rank.
        rank: usize,
    },
    /// Bytes that are not what the dtype and shape take.
    #[error("{bytes} bytes for {dtype}{shape:?}")]
    DataLength {
        /// Bytes given.
        bytes: usize,
        /// The dtype.
        dtype: DType,
        /// The shape.
        shape: Vec<i64>,
    },
    /// One of its blocks declares impossible sizes.
    #[error("block {index}: {error}")]
    Block {
        /// The block's place in the tensor.
        index: usize,
        /// What is wrong with it.
        error: BlockError,
    },
    /// Its blocks cannot be compressed or decompressed.
    #[error(transparent)]
    Blocks(#[from] BlockError),
    /// Its zero mask does not fit it.
    #[error(transparent)]
    ZeroMask(#[from] ZeroMaskError),
    /// It cannot be narrowed or widened.
    #[error(transparent)]
    Precision(#[from] PrecisionError),
    /// A bool element that is neither 0 nor 1.
    #[error("bool element {index} is {value}, not 0 or 1")]
    NotBool {
        /// The element's index.
        index: usize,
        /// Its byte.
        value: u8,
    },
}
