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
    /// The envelope's bytes are not a payload envelope.
    #[error("malformed payload: envelope: {0}")]
    Envelope(prost::DecodeError),
    /// The header's bytes are not a payload header.
    #[error("malformed payload: header: {0}")]
    Header(prost::DecodeError),
    /// The tensors' wire bytes do not add up to the payload's.
    #[error("malformed payload: the tensors take {tensors} bytes{}, but the payload declares {declared}", if *tagged { " plus a 16-byte tag" } else { "" })]
    WireLength {
        /// What the tensors declare.
        tensors: u64,
        /// Whether a seal's tag follows them.
        tagged: bool,
        /// What the payload declares.
        declared: u64,
    },
    /// A seal whose nonce prefix is not 8 bytes.
    #[error("malformed payload: nonce prefix of {0} bytes, expected 8")]
    NoncePrefix(usize),
    /// A seal's counter past the last one a stream may use.
    #[error("malformed payload: counter {0} is out of range")]
    Counter(u32),
    /// A payload finished in a way its form does not allow (a bug on the receiving side,
    /// never the peer's: the sizes and forms were checked in `parse`).
    #[error("internal error: {0}")]
    Misused(Misuse),
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

/// A payload finished in a way its form does not allow.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Misuse {
    /// Finished as verbatim, and it is not.
    #[error("a {codec} payload{} is not verbatim", if *sealed { " (sealed)" } else { "" })]
    NotVerbatim {
        /// Its codec.
        codec: String,
        /// Whether it is sealed.
        sealed: bool,
    },
    /// Opened in its tensor, and it does not.
    #[error("a {codec} payload of {tensors} tensors does not open in its tensor")]
    NotInItsTensor {
        /// Its codec.
        codec: String,
        /// Its tensors.
        tensors: usize,
    },
    /// Buffers that are not one per tensor of its declared size.
    #[error("buffers of {given:?} bytes for tensors of {declared:?}")]
    Buffers {
        /// The buffers' sizes.
        given: Vec<usize>,
        /// The tensors' declared sizes.
        declared: Vec<usize>,
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
    /// A codec of its own in a payload whose codec is not `auto`.
    #[error("codec {own:?} of its own in a {payload} payload")]
    OwnCodec {
        /// The tensor's codec.
        own: String,
        /// The payload's.
        payload: String,
    },
    /// A codec that `auto` does not pick.
    #[error("codec {0:?} is not one `auto` picks (raw, shuffle+lz4)")]
    NotAutoPick(String),
    /// int8 quantisation of a tensor with a layout of its own.
    #[error("int8 quantisation of a tensor that is not row-major")]
    Int8NotRowMajor,
    /// Zeros elided with a codec that does not elide them.
    #[error("zeros elided with codec {0}")]
    ZerosElided(String),
    /// Blocks in a payload without compression.
    #[error("blocks without compression")]
    BlocksWithoutCompression,
    /// Blocks whose sizes are not what the tensor carries.
    #[error("its blocks hold {raw} bytes in {wire}, where it carries {carries} in {wire_len}")]
    BlocksDoNotFit {
        /// Raw bytes the blocks hold.
        raw: u64,
        /// Their wire bytes.
        wire: u64,
        /// What the tensor carries, in words.
        carries: String,
        /// The tensor's wire bytes.
        wire_len: u64,
    },
    /// Quantisation parameters missing for int8, or sent for another precision.
    #[error("{}", if *expected { "it has no quantisation parameters" } else { "it has quantisation parameters it does not use" })]
    Quantisation {
        /// Whether its precision needs them.
        expected: bool,
    },
    /// A bool element that is neither 0 nor 1.
    #[error("bool element {index} is {value}, not 0 or 1")]
    NotBool {
        /// The element's index.
        index: usize,
        /// Its byte.
        value: u8,
    },
}
