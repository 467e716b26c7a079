//! Boundaries on the wire: a [`Boundary`] (libtorch tensors in value trees) to and from a
//! `cleave-codec` payload, and payloads to and from frames.
//!
//! A payload travels as frames of one request: the first carries the envelope (the header,
//! authenticated when sealed), every frame a slice of the data, the last is marked. The
//! receiver checks the envelope before reserving memory for the data, reserves exactly the
//! declared length (already bounded by the limit and the codec), and never grows past it.
//!
//! Each stream has a [`PayloadSender`] and a [`PayloadReceiver`] per direction: they hold
//! the nonce state that refuses replayed payloads and those past the replay window.
//!
//! Zero copy: a boundary given up to [`PayloadSender::encode_owned`] with the raw codec and no
//! key travels as its tensors' own memory (frames slice it), and a received raw payload is
//! copied from the frames straight into the tensors the stages will run on; other codecs
//! decode straight into them too.

use std::collections::HashMap;

use bytes::Bytes;
use cleave_codec::pb::{self, NamedValue, ValueNode};
use cleave_codec::{encode_payload, IncomingPayload, TensorData};
use tch::Tensor;

pub use cleave_codec::{
    Codec, CodecError, CodecPolicy, Direction, EncodedPayload, Key, KeyRing, Misuse, Opener, PayloadData, PayloadMeta, PolicyError, Precision,
    Sealer, REPLAY_WINDOW,
};

use crate::bundle::{Bundle, CutTensors};
use crate::error::{BundleError, Shared};
use crate::spec::{BoundarySizes, DType, TorchDType};
use crate::tensor_memory::{dense_strides, TensorBuf, TensorBytes};
use crate::value::{Boundary, Value};

/// What can be wrong with a payload or its frames.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum WireError {
    /// The payload itself: malformed, refused, tampered, replayed, too large...
    #[error(transparent)]
    Codec(#[from] CodecError),
    /// The first frame of a request or result has no payload header.
    #[error("the first frame of request {0} has no payload header")]
    MissingHeader(u64),
    /// The frame's request id is not the one its authenticated header names.
    #[error("a frame of request {frame} carries the header of request {header}")]
    RequestIdMismatch {
        /// The frame's id.
        frame: u64,
        /// The header's id.
        header: u64,
    },
    /// More bytes arrived than the header declared.
    #[error("payload overrun: more than the {expected} declared bytes arrived")]
    Overrun {
        /// Bytes declared.
        expected: u64,
    },
    /// A caller of [`FrameAssembler::push_started`] did not start the payload its first
    /// frame begins (a bug on this side, not the peer's).
    #[error("internal error: the payload of request {0} was not started from its first frame")]
    NotStarted(u64),
    /// A frame of another request arrived before the current one ended.
    #[error("frame of request {got} arrived while request {expected} was incomplete")]
    Interleaved {
        /// The request being reassembled.
        expected: u64,
        /// The request id of the stray frame.
        got: u64,
    },
    /// The value tree names a tensor the header does not have, or names one twice.
    #[error("value tree: {0}")]
    BadTree(String),
    /// The payload is at another cut than the stream takes.
    #[error("the payload is at cut {payload}, this stream takes cut {stream}")]
    WrongCut {
        /// The payload's cut.
        payload: usize,
        /// The stream's.
        stream: usize,
    },
    /// The payload declares tensors that do not fit the cut it names (checked before its data
    /// is reserved).
    #[error("{0}")]
    NotExpected(Shared<BundleError>),
    /// The payload declares other tensors than the exact ones expected (checked before its
    /// data is reserved).
    #[error("the payload's tensors are not the ones expected: {0}")]
    NotTheTensors(String),
    /// libtorch cannot build a tensor of this shape.
    #[error("tensor {name}: libtorch cannot build shape {shape:?}: {message}")]
    BadTensor {
        /// Tensor name.
        name: String,
        /// Its declared shape.
        shape: Vec<i64>,
        /// libtorch's message (first line).
        message: String,
    },
    /// A tensor whose dtype cannot travel.
    #[error("tensor {name}: libtorch kind {kind} cannot travel")]
    Unsupported {
        /// Tensor name.
        name: String,
        /// Its kind.
        kind: String,
    },
}

/// Encodes the payloads one side sends on one stream (and seals them when it has a key).
#[derive(Debug, Default)]
pub struct PayloadSender {
    sealer: Option<Sealer>,
}

impl PayloadSender {
    /// Sends in the clear.
    pub fn plain() -> Self {
        Self { sealer: None }
    }

    /// Seals every payload with `key_id` of `ring`.
    pub fn sealed(ring: &KeyRing, key_id: u32) -> Result<Self, CodecError> {
        Ok(Self { sealer: Some(ring.sealer(key_id)?) })
    }

    /// Encodes a boundary the caller keeps: tensors on the CPU and contiguous are copied, so
    /// that nothing the caller does to them later can change what is sent.
    pub fn encode(&mut self, meta: PayloadMeta, codec: &Codec, boundary: &Boundary) -> Result<EncodedPayload, WireError> {
        self.encode_flat(meta, codec, flatten(boundary, false, keeps_layout(codec))?)
    }

    /// Encodes a boundary given up to the wire: the encoding reads the tensors' memory where
    /// it lies, and a raw payload without a key is that memory (no copy).
    ///
    /// # Safety
    ///
    /// Nothing writes the memory of the boundary's tensors (through any handle that shares
    /// it: a view, a parameter a stage returned as it is) until the payload returned and
    /// every frame sliced from it are dropped. See [`TensorBytes::new`].
    #[allow(unsafe_code)]
    pub unsafe fn encode_owned(&mut self, meta: PayloadMeta, codec: &Codec, boundary: Boundary) -> Result<EncodedPayload, WireError> {
        self.encode_flat(meta, codec, flatten(&boundary, true, keeps_layout(codec))?)
    }

    fn encode_flat(&mut self, meta: PayloadMeta, codec: &Codec, flat: Flat) -> Result<EncodedPayload, WireError> {
        let mut encoded = encode_payload(meta, flat.values, &flat.tensors, codec, self.sealer.as_mut())?;
        encoded.copied_bytes += flat.copied_bytes;
        Ok(encoded)
    }
}

/// A boundary's tensors as bytes, and its value trees naming them.
struct Flat {
    values: Vec<NamedValue>,
    tensors: Vec<TensorData>,
    /// Bytes copied to get the tensors' bytes (see [`EncodedPayload::copied_bytes`]).
    copied_bytes: u64,
}

/// Whether tensors may travel in their own memory layout with `codec`: int8 quantises along a
/// dimension of the shape, so it takes row-major bytes.
fn keeps_layout(codec: &Codec) -> bool {
    codec.tensor_codecs().iter().all(|c| c.precision != Precision::Int8)
}

/// A boundary's tensors as bytes; `owned`: the boundary is given up, so its tensors' memory
/// may be used as it is; `keep_layout`: a tensor dense in another order of its dimensions
/// (channels_last) travels in that order.
fn flatten(boundary: &Boundary, owned: bool, keep_layout: bool) -> Result<Flat, WireError> {
    let mut flat = Flat { values: Vec::new(), tensors: Vec::new(), copied_bytes: 0 };
    for (name, value) in &boundary.values {
        let node = encode_value(value, name, (owned, keep_layout), &mut flat)?;
        flat.values.push(NamedValue { name: name.clone(), value: Some(node) });
    }
    Ok(flat)
}

/// A tensor's bytes on the CPU, dense: as they lie (row-major, or with `keep_layout` in the
/// order of its dimensions in memory, which is returned) or made contiguous. Its own memory
/// when it may be used as it is (the tensor is given up, or moving it to the CPU or making it
/// contiguous made a new one); and the bytes copied in the host's memory to get them (a
/// device's copy to the CPU is not counted).
fn tensor_bytes(t: &Tensor, owned: bool, keep_layout: bool) -> (Bytes, u64, Vec<u32>) {
    let len = (t.numel() * t.kind().elt_size_in_bytes()) as u64;
    let on_cpu = t.device() == tch::Device::Cpu;
    // (A second handle, not `to_device`: that goes through libtorch's dispatcher even when
    // the tensor is where it is asked to be.)
    let t = if on_cpu { t.shallow_clone() } else { t.to_device(tch::Device::Cpu) };
    // Most boundaries are row-major: their layout is looked into only when they are not.
    let order = if t.is_contiguous() || !keep_layout { None } else { memory_order(&t) };
    let (dense, dim_order, made) = match order {
        _ if t.is_contiguous() => (t, Vec::new(), 0),
        Some(order) => (t.permute(order.iter().map(|&d| i64::from(d)).collect::<Vec<_>>()), order, 0),
        None => (t.contiguous(), Vec::new(), len),
    };
    if owned || !on_cpu || made > 0 {
        // SAFETY: a tensor moved to the CPU or made contiguous here is new memory no one else
        // holds; an `owned` one was given up by `encode_owned`'s caller, who promised that
        // nothing writes it while the payload lives. A computed tensor's bytes are initialised.
        #[allow(unsafe_code)]
        let memory = unsafe { TensorBytes::new(dense) };
        match memory {
            Ok(memory) => return (memory.into_bytes(), made, dim_order),
            Err(dense) => return (copy_bytes(&dense), made + len, dim_order),
        }
    }
    (copy_bytes(&dense), len, dim_order)
}

/// The order of `t`'s dimensions in memory, outermost first, where its elements are dense in
/// an order that is not the shape's (channels_last: 0, 2, 3, 1): the view in that order is
/// contiguous. `None` for a row-major tensor or one with gaps or overlaps.
fn memory_order(t: &Tensor) -> Option<Vec<u32>> {
    let (size, strides) = (t.size(), t.stride());
    let mut order: Vec<u32> = (0..strides.len() as u32).collect();
    order.sort_by_key(|&d| std::cmp::Reverse(strides[d as usize]));
    if order.iter().enumerate().all(|(i, &d)| i == d as usize) {
        return None;
    }
    // Contiguous once viewed in `order`, as libtorch decides it (a dimension of size 1 may
    // have any stride, a tensor with no elements is): worked out from its strides rather than
    // by a view, which costs a trip through libtorch's dispatcher per tensor sent.
    let dense = dense_strides(&size, &order).ok()?;
    let contiguous = size.contains(&0) || (0..size.len()).all(|d| size[d] == 1 || strides[d] == dense[d]);
    contiguous.then_some(order)
}

fn copy_bytes(t: &Tensor) -> Bytes {
    let mut data = vec![0u8; t.numel() * t.kind().elt_size_in_bytes()];
    t.copy_data_u8(&mut data, t.numel());
    data.into()
}

/// `how`: (the boundary is given up, tensors may keep their layout), as [`flatten`] says.
fn encode_value(value: &Value, path: &str, how: (bool, bool), flat: &mut Flat) -> Result<ValueNode, WireError> {
    use pb::value_node::Kind;
    let list = |items: &[Value], flat: &mut Flat| -> Result<pb::ValueList, WireError> {
        Ok(pb::ValueList {
            items: items.iter().enumerate().map(|(i, v)| encode_value(v, &format!("{path}.{i}"), how, flat)).collect::<Result<_, _>>()?,
        })
    };
    let kind = match value {
        Value::Tensor(t) => {
            let dtype = DType::from_kind(t.kind()).ok_or_else(|| WireError::Unsupported { name: path.into(), kind: format!("{:?}", t.kind()) })?;
            let (data, copied, dim_order) = tensor_bytes(t, how.0, how.1);
            flat.copied_bytes += copied;
            flat.tensors.push(TensorData { name: path.to_string(), dtype, shape: t.size(), dim_order, data });
            Kind::Tensor(path.to_string())
        }
        Value::Int(i) => Kind::Int(*i),
        Value::Float(f) => Kind::Float(*f),
        Value::Bool(b) => Kind::Bool(*b),
        Value::Str(s) => Kind::Str(s.clone()),
        Value::None => Kind::None(true),
        Value::Tuple(items) => Kind::Tuple(list(items, flat)?),
        Value::List(items) => Kind::List(list(items, flat)?),
        Value::Dict(items) => Kind::Dict(pb::ValueDict {
            entries: items
                .iter()
                .map(|(k, v)| Ok(pb::DictEntry { key: k.clone(), value: Some(encode_value(v, &format!("{path}.{k}"), how, flat)?) }))
                .collect::<Result<_, WireError>>()?,
        }),
    };
    Ok(ValueNode { kind: Some(kind) })
}

/// Checks and decodes the payloads one side receives on one stream, in one direction.
#[derive(Debug)]
pub struct PayloadReceiver {
    direction: Direction,
    limit: u64,
    policy: CodecPolicy,
    opener: Opener,
    /// When set, what each payload declares is checked against it before its data is reserved.
    expected: Option<Expected>,
    /// The CUDA device received tensors go to, when they land in memory pinned for it.
    pinned_for: Option<tch::Device>,
}

/// What a receiver checks each payload's declared tensors against.
#[derive(Debug)]
enum Expected {
    /// A bundle's cut: the one the header names, or only this one, under this rule.
    Cut(Bundle, Option<usize>, CutTensors),
    /// Exactly these tensors, in any order.
    Tensors(std::sync::Arc<[TensorSpec]>),
}

/// A tensor a payload must declare: its name, type and shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    /// Its name in the payload.
    pub name: String,
    /// Its element type.
    pub dtype: DType,
    /// Its shape.
    pub shape: Vec<i64>,
}

impl TensorSpec {
    /// The spec of `tensor` under `name`; none for a type payloads do not carry.
    pub fn of(name: &str, tensor: &Tensor) -> Option<Self> {
        Some(Self { name: name.to_string(), dtype: DType::from_kind(tensor.kind())?, shape: tensor.size() })
    }
}

/// Checks that `declared` are exactly the tensors of `specs`.
fn check_tensors<'a>(specs: &[TensorSpec], declared: impl Iterator<Item = (&'a str, DType, &'a [i64])>) -> Result<(), WireError> {
    let mut seen = 0;
    for (name, dtype, shape) in declared {
        let spec = specs.iter().find(|s| s.name == name).ok_or_else(|| WireError::NotTheTensors(format!("{name} is not expected")))?;
        if spec.dtype != dtype || spec.shape != shape {
            return Err(WireError::NotTheTensors(format!("{name} is {dtype} {shape:?}, expected {} {:?}", spec.dtype, spec.shape)));
        }
        seen += 1;
    }
    if seen != specs.len() {
        return Err(WireError::NotTheTensors(format!("{seen} tensors declared, {} expected", specs.len())));
    }
    Ok(())
}

/// A payload received whole.
#[derive(Debug)]
pub struct Received {
    /// The request id (authenticated when sealed).
    pub request_id: u64,
    /// The cut the boundary is at.
    pub split: u32,
    /// The codec it travelled with.
    pub codec: Codec,
    /// The key id it was sealed with, if it was.
    pub key_id: Option<u32>,
    /// The boundary.
    pub boundary: Boundary,
    /// Bytes copied as they were to receive it: from the frames into the tensors (or the
    /// encoded data), and by decoding (see `cleave_codec`'s `DecodedHeader::copied_bytes`).
    pub copied_bytes: u64,
    /// Bytes of its tensors in pinned host memory (see [`PayloadReceiver::landing_for`]).
    pub pinned_bytes: u64,
}

impl PayloadReceiver {
    /// Expects `direction` payloads of at most `limit` tensor bytes that `policy` accepts;
    /// `ring` holds the keys to open sealed ones.
    pub fn new(direction: Direction, limit: u64, policy: CodecPolicy, ring: &KeyRing) -> Self {
        Self { direction, limit, policy, opener: ring.opener(), expected: None, pinned_for: None }
    }

    /// Received tensors bound for `device` land in host memory pinned for it when it is a CUDA
    /// device (the stages then copy them there without blocking); nothing changes for the CPU.
    pub fn landing_for(mut self, device: tch::Device) -> Self {
        self.pinned_for = device.is_cuda().then_some(device);
        self
    }

    /// Checks each payload's declared tensors against `bundle`'s cut at the split its header
    /// names (exactly the cut's tensors, one batch size within range) before reserving its
    /// data: nothing is allocated on a peer's word beyond what the manifest allows.
    pub fn checked_against(mut self, bundle: &Bundle) -> Self {
        self.expected = Some(Expected::Cut(bundle.clone(), None, CutTensors::All));
        self
    }

    /// Like [`PayloadReceiver::checked_against`] for a stream whose payloads all sit at one
    /// cut (a training session's boundaries at its start, gradients at its end): a payload
    /// naming another cut is refused, and `rule` says which of the cut's tensors it carries.
    pub fn checked_at(mut self, bundle: &Bundle, cut: usize, rule: CutTensors) -> Self {
        self.expected = Some(Expected::Cut(bundle.clone(), Some(cut), rule));
        self
    }

    /// Checks that each payload declares exactly `tensors` (names, types and shapes, none
    /// twice) before reserving its data: a client group's weights, say.
    pub fn checked_as(mut self, tensors: std::sync::Arc<[TensorSpec]>) -> Self {
        self.expected = Some(Expected::Tensors(tensors));
        self
    }

    /// Starts a payload from its first frame: checks the envelope (and its authentication)
    /// before reserving the declared data length.
    pub fn start(&self, request_id: u64, envelope: &[u8]) -> Result<Reassembly, WireError> {
        if envelope.is_empty() {
            return Err(WireError::MissingHeader(request_id));
        }
        let incoming = IncomingPayload::parse(envelope, self.direction, self.limit, &self.policy, &self.opener)?;
        if incoming.request_id() != request_id {
            return Err(WireError::RequestIdMismatch { frame: request_id, header: incoming.request_id() });
        }
        let mut checked = None;
        match &self.expected {
            Some(Expected::Cut(bundle, cut, rule)) => {
                let split = incoming.split() as usize;
                if let Some(stream) = cut.filter(|&cut| cut != split) {
                    return Err(WireError::WrongCut { payload: split, stream });
                }
                let sizes =
                    bundle.check_declared_as(split, *rule, incoming.declared_tensors()).map_err(|e| WireError::NotExpected(Shared::new(e)))?;
                checked = Some(sizes);
            }
            Some(Expected::Tensors(specs)) => check_tensors(specs, incoming.declared_tensors())?,
            None => {}
        }
        // The data is reserved by the first push, so that a caller may wait for room (in a
        // memory budget) between the checks and the reservation.
        Ok(Reassembly {
            request_id,
            expected: incoming.wire_len(),
            received: 0,
            sink: Sink::Unreserved,
            incoming,
            sizes: checked,
            pinned_for: self.pinned_for,
        })
    }

    /// Opens and decodes a complete payload.
    pub fn finish(&mut self, mut assembly: Reassembly) -> Result<Received, WireError> {
        assembly.reserve()?;
        if assembly.received != assembly.expected {
            return Err(CodecError::Truncated { expected: assembly.expected, got: assembly.received }.into());
        }
        let names: Vec<String> = assembly.incoming.declared_tensors().map(|(name, _, _)| name.to_string()).collect();
        let (decoded, buffers) = match assembly.sink {
            Sink::Verbatim { mut buffers, tag, .. } if assembly.incoming.opens_in_tensor() => {
                (assembly.incoming.open_verbatim(&mut self.opener, buffers[0].bytes_mut(), &tag)?, buffers)
            }
            Sink::Verbatim { buffers, .. } => {
                let bytes: Vec<&[u8]> = buffers.iter().map(TensorBuf::bytes).collect();
                (assembly.incoming.check_verbatim(&bytes)?, buffers)
            }
            Sink::Encoded(mut data) => {
                let mut buffers = tensor_buffers(&assembly.incoming, assembly.pinned_for)?;
                let mut outs: Vec<&mut [u8]> = buffers.iter_mut().map(TensorBuf::zero_rest_mut).collect();
                (assembly.incoming.decode_into(&mut data, &mut self.opener, &mut outs)?, buffers)
            }
            Sink::Unreserved => unreachable!("reserved above"),
        };
        let pinned_bytes = buffers.iter().filter(|b| b.is_pinned()).map(|b| b.len() as u64).sum();
        let mut tensors: HashMap<String, Tensor> = HashMap::with_capacity(names.len());
        // A tensor that travelled in another order of its dimensions landed laid out in it.
        for (name, buffer) in names.into_iter().zip(buffers) {
            if tensors.insert(name.clone(), buffer.into_tensor()).is_some() {
                return Err(WireError::BadTree(format!("tensor {name} appears twice in the header")));
            }
        }
        let values = decoded
            .values
            .iter()
            .map(|nv| {
                let node = nv.value.as_ref().ok_or_else(|| WireError::BadTree(format!("value {} is empty", nv.name)))?;
                Ok((nv.name.clone(), decode_value(node, &mut tensors, 0)?))
            })
            .collect::<Result<Vec<_>, WireError>>()?;
        if let Some(name) = tensors.keys().next() {
            return Err(WireError::BadTree(format!("tensor {name} is in the header but not in the value tree")));
        }
        Ok(Received {
            copied_bytes: assembly.received + decoded.copied_bytes,
            pinned_bytes,
            request_id: decoded.meta.request_id,
            split: decoded.meta.split,
            codec: decoded.codec,
            key_id: decoded.key_id,
            boundary: Boundary { values },
        })
    }
}

/// One buffer per declared tensor, to decode into, laid out in the order its dimensions
/// travel in, pinned for `pinned_for` where it is set. Fallible: a shape whose strides overflow
/// (an empty `[0, 2^32, 2^32]`) is an error for this payload, not a panic for the stream.
fn tensor_buffers(incoming: &IncomingPayload, pinned_for: Option<tch::Device>) -> Result<Vec<TensorBuf>, WireError> {
    incoming
        .declared_tensors()
        .zip(incoming.dim_orders())
        .map(|((name, dtype, shape), order)| {
            allocate(shape, order, dtype.kind(), pinned_for).map_err(|e| WireError::BadTensor {
                name: name.to_string(),
                shape: shape.to_vec(),
                message: first_line(&e.to_string()),
            })
        })
        .collect()
}

/// A buffer of `shape` dense in `order` (see [`TensorBuf::empty_in_order`]), pinned for
/// `pinned_for` where it is set and libtorch can pin it; in pageable memory otherwise (said
/// once: the copy to the device then blocks, nothing else changes).
fn allocate(shape: &[i64], order: &[u32], kind: tch::Kind, pinned_for: Option<tch::Device>) -> Result<TensorBuf, tch::TchError> {
    static WARNED: std::sync::Once = std::sync::Once::new();
    if let Some(device) = pinned_for {
        match TensorBuf::empty_pinned(shape, order, kind, device) {
            Ok(buffer) => return Ok(buffer),
            Err(e) => WARNED.call_once(
                || tracing::warn!(error = %first_line(&e.to_string()), "pinned host memory unavailable: received tensors land in pageable memory"),
            ),
        }
    }
    TensorBuf::empty_in_order(shape, order, kind)
}

/// The first non-empty line of libtorch's message (the rest is a C++ backtrace).
fn first_line(text: &str) -> String {
    text.lines().map(str::trim).find(|l| !l.is_empty()).unwrap_or(text).to_string()
}

/// Deepest value tree accepted (a hostile tree must not exhaust the stack).
const MAX_TREE_DEPTH: usize = 32;

fn decode_value(node: &ValueNode, tensors: &mut HashMap<String, Tensor>, depth: usize) -> Result<Value, WireError> {
    use pb::value_node::Kind;
    if depth > MAX_TREE_DEPTH {
        return Err(WireError::BadTree(format!("deeper than {MAX_TREE_DEPTH} levels")));
    }
    let items = |list: &pb::ValueList, tensors: &mut HashMap<String, Tensor>| {
        list.items.iter().map(|n| decode_value(n, tensors, depth + 1)).collect::<Result<Vec<_>, _>>()
    };
    Ok(match node.kind.as_ref().ok_or_else(|| WireError::BadTree("a node has no value".into()))? {
        Kind::Tensor(name) => {
            Value::Tensor(tensors.remove(name).ok_or_else(|| WireError::BadTree(format!("tensor {name} is not in the header (or is named twice)")))?)
        }
        Kind::Int(i) => Value::Int(*i),
        Kind::Float(f) => Value::Float(*f),
        Kind::Bool(b) => Value::Bool(*b),
        Kind::Str(s) => Value::Str(s.clone()),
        Kind::None(_) => Value::None,
        Kind::Tuple(list) => Value::Tuple(items(list, tensors)?),
        Kind::List(list) => Value::List(items(list, tensors)?),
        Kind::Dict(dict) => Value::Dict(
            dict.entries
                .iter()
                .map(|e| {
                    let v = e.value.as_ref().ok_or_else(|| WireError::BadTree(format!("dict entry {} is empty", e.key)))?;
                    Ok((e.key.clone(), decode_value(v, tensors, depth + 1)?))
                })
                .collect::<Result<Vec<_>, WireError>>()?,
        ),
    })
}

/// Data bytes per frame under a gRPC message limit (room is left for the envelope).
pub fn chunk_bytes_for(max_message_bytes: u64) -> usize {
    max_message_bytes.saturating_sub(64 << 10).max(4096) as usize
}

/// One frame's share of an encoded payload.
#[derive(Debug, Clone)]
pub struct FramePart {
    /// The envelope on the first frame, empty on the others.
    pub header: Bytes,
    /// At most `chunk_bytes` of the payload's data.
    pub data: Bytes,
    /// Whether this is the payload's first frame.
    pub first: bool,
    /// Whether this is its last.
    pub last: bool,
}

/// Splits an encoded payload into frames of at most `chunk_bytes` data each (at least one;
/// none spans two segments of the data, so none copies): the envelope rides on the first,
/// `last` marks the end. Every stream, both ways, frames its payloads this way.
pub fn frame_parts(envelope: Bytes, data: &PayloadData, chunk_bytes: usize) -> Vec<FramePart> {
    let parts = chunks(data, chunk_bytes);
    let last = parts.len() - 1;
    let mut header = Some(envelope);
    parts
        .into_iter()
        .enumerate()
        .map(|(i, data)| FramePart { header: header.take().unwrap_or_default(), data, first: i == 0, last: i == last })
        .collect()
}

/// Splits a payload's segments into chunks of at most `chunk_bytes` (at least one, possibly
/// empty).
fn chunks(data: &PayloadData, chunk_bytes: usize) -> Vec<Bytes> {
    let step = chunk_bytes.max(1);
    let chunks: Vec<Bytes> = data
        .segments()
        .iter()
        .flat_map(|segment| (0..segment.len()).step_by(step).map(move |start| segment.slice(start..(start + step).min(segment.len()))))
        .collect();
    if chunks.is_empty() {
        return vec![Bytes::new()];
    }
    chunks
}

/// Collects the frames of one payload into exactly the declared length: a verbatim payload
/// (raw, no key) straight into the memory of its tensors, as does a sealed one of one raw
/// tensor (its tag aside, opened there), any other into one buffer that is decoded into them.
#[derive(Debug)]
pub struct Reassembly {
    /// The request the frames belong to.
    pub request_id: u64,
    expected: u64,
    received: u64,
    sink: Sink,
    incoming: IncomingPayload,
    /// Its sizes, when its envelope was checked against a bundle's cut.
    sizes: Option<BoundarySizes>,
    /// Where its tensors go, when they land pinned (see [`PayloadReceiver::landing_for`]).
    pinned_for: Option<tch::Device>,
}

/// Where a payload's bytes go.
#[derive(Debug)]
enum Sink {
    /// Nothing reserved yet (before the first frame's data).
    Unreserved,
    /// The encoded data, to decode once whole.
    Encoded(Vec<u8>),
    /// The tensors themselves, filled in order (tensor `index` is the one being written); a
    /// sealed payload's tag after them.
    Verbatim { buffers: Vec<TensorBuf>, index: usize, tag: Vec<u8> },
}

impl Reassembly {
    /// Its batch size and sequence length, when its envelope was checked against a
    /// bundle's cut (see [`PayloadReceiver::checked_against`]).
    pub fn sizes(&self) -> Option<BoundarySizes> {
        self.sizes
    }

    /// The split the (checked) header names.
    pub fn split(&self) -> u32 {
        self.incoming.split()
    }

    /// The codec it travels with.
    pub fn codec(&self) -> Codec {
        self.incoming.codec()
    }

    /// The key it is sealed with, if it is.
    pub fn key_id(&self) -> Option<u32> {
        self.incoming.key_id()
    }

    /// The most memory the payload holds (as its checked envelope declares it): the tensors
    /// it fills, and for a payload that is not verbatim its data as received.
    pub fn held_bytes(&self) -> u64 {
        let raw = self.incoming.raw_len();
        if self.goes_to_tensors() {
            raw
        } else {
            self.expected.saturating_add(raw)
        }
    }

    /// The bytes [`PayloadReceiver::finish`] works through: none for a verbatim payload (its
    /// bytes are in its tensors as received, and only checked), the tensors' otherwise
    /// (opened, or decoded from the data).
    pub fn finish_work_bytes(&self) -> u64 {
        if self.incoming.is_verbatim() {
            0
        } else {
            self.held_bytes()
        }
    }

    /// Adds a frame's bytes; a frame of another request is an error.
    pub fn push(&mut self, request_id: u64, mut bytes: &[u8]) -> Result<(), WireError> {
        if request_id != self.request_id {
            return Err(WireError::Interleaved { expected: self.request_id, got: request_id });
        }
        if self.received + bytes.len() as u64 > self.expected {
            return Err(WireError::Overrun { expected: self.expected });
        }
        self.reserve()?;
        self.received += bytes.len() as u64;
        match &mut self.sink {
            Sink::Encoded(data) => data.extend_from_slice(bytes),
            Sink::Verbatim { buffers, index, tag } => {
                // The sizes add up (checked in `parse` and above), so the tensors take every
                // byte but a sealed payload's tag, which comes after them (`expected` bounds it).
                while !bytes.is_empty() && *index < buffers.len() {
                    bytes = &bytes[buffers[*index].write(bytes)..];
                    if buffers[*index].is_full() {
                        *index = next_to_fill(buffers, *index + 1);
                    }
                }
                tag.extend_from_slice(bytes);
            }
            Sink::Unreserved => unreachable!("reserved above"),
        }
        Ok(())
    }

    /// Adds every segment of a payload's data (a payload that never went through frames: a
    /// profile's round trip, say).
    pub fn push_data(&mut self, request_id: u64, data: &PayloadData) -> Result<(), WireError> {
        data.segments().iter().try_for_each(|segment| self.push(request_id, segment))
    }

    /// Whether the frames' bytes go straight into the tensors' memory.
    fn goes_to_tensors(&self) -> bool {
        self.incoming.is_verbatim() || self.incoming.opens_in_tensor()
    }

    /// Reserves where the data goes, once.
    fn reserve(&mut self) -> Result<(), WireError> {
        if matches!(self.sink, Sink::Unreserved) {
            self.sink = if self.goes_to_tensors() {
                let buffers = tensor_buffers(&self.incoming, self.pinned_for)?;
                Sink::Verbatim { index: next_to_fill(&buffers, 0), buffers, tag: Vec::new() }
            } else {
                Sink::Encoded(Vec::with_capacity(self.expected as usize))
            };
        }
        Ok(())
    }
}

/// The first tensor from `from` on that takes bytes (empty ones take none).
fn next_to_fill(buffers: &[TensorBuf], from: usize) -> usize {
    (from..buffers.len()).find(|&i| !buffers[i].is_full()).unwrap_or(buffers.len())
}

/// A frame of some stream's payloads, as [`frame_parts`] made it: the request id, the
/// envelope on the first frame, a slice of the data, the last marked.
pub trait PayloadFrame {
    /// The request (or call) the frame belongs to.
    fn request_id(&self) -> u64;
    /// The envelope: on the first frame only.
    fn header(&self) -> &[u8];
    /// Its slice of the payload data.
    fn data(&self) -> &[u8];
    /// Whether it ends the payload.
    fn last(&self) -> bool;
    /// The frame carrying `part` of request `request_id`'s payload, its other fields empty.
    fn from_part(request_id: u64, part: FramePart) -> Self
    where
        Self: Sized;
}

/// An encoded payload as one stream's frames ([`frame_parts`], each made an `F`). What a
/// stream adds to them (the timings on the last, the phase on the first) is the caller's.
pub fn payload_frames<F: PayloadFrame>(request_id: u64, envelope: Bytes, data: &PayloadData, chunk_bytes: usize) -> Vec<F> {
    frame_parts(envelope, data, chunk_bytes).into_iter().map(|part| F::from_part(request_id, part)).collect()
}

/// Reassembles one stream's payloads from their frames; every stream (requests, results,
/// training calls and answers) uses it. `Tag` travels with a payload from its first frame to
/// its completion (the training stream's phase, say).
///
/// When a payload fails (a bad envelope, a frame of another request, an overrun), the error
/// names the request that failed, and the rest of the offending frames are skipped up to
/// and including the one marked last, so that one bad request costs one answer and the
/// stream carries on with the next.
#[derive(Debug)]
pub struct FrameAssembler<Tag = ()> {
    current: Option<(Reassembly, Tag)>,
    /// A request already answered with an error whose remaining frames are skipped.
    skipping: Option<u64>,
}

impl<Tag> Default for FrameAssembler<Tag> {
    fn default() -> Self {
        Self { current: None, skipping: None }
    }
}

impl<Tag> FrameAssembler<Tag> {
    /// Takes one frame. `start` is called on a payload's first frame: it checks the envelope
    /// and reserves the payload (see [`PayloadReceiver::start`]). Returns the payload once its
    /// last frame is in, `None` while more are to come or the frame is skipped, and on an
    /// error the id of the request that failed.
    pub fn push<F: PayloadFrame, E: From<WireError>>(
        &mut self,
        frame: &F,
        start: impl FnOnce(&F) -> Result<(Reassembly, Tag), E>,
    ) -> Result<Option<(Reassembly, Tag)>, (u64, E)> {
        let started = self.starts_payload(frame).then(|| start(frame));
        self.push_started(frame, started)
    }

    /// Whether `frame` starts a payload: [`FrameAssembler::push_started`] then needs the
    /// payload started from it (a caller that must wait before reserving, for room in a
    /// memory budget, say, starts it itself).
    pub fn starts_payload(&self, frame: &impl PayloadFrame) -> bool {
        self.current.is_none() && self.skipping != Some(frame.request_id())
    }

    /// Whether a payload is part-way in.
    pub fn in_progress(&self) -> bool {
        self.current.is_some()
    }

    /// Like [`FrameAssembler::push`], with the payload already started from this frame when
    /// [`FrameAssembler::starts_payload`] says it starts one (`None` otherwise).
    pub fn push_started<F: PayloadFrame, E: From<WireError>>(
        &mut self,
        frame: &F,
        started: Option<Result<(Reassembly, Tag), E>>,
    ) -> Result<Option<(Reassembly, Tag)>, (u64, E)> {
        let id = frame.request_id();
        if self.skipping == Some(id) {
            if frame.last() {
                self.skipping = None;
            }
            return Ok(None);
        }
        self.skipping = None;
        let (mut assembly, tag) = match (self.current.take(), started) {
            (Some(current), _) => current,
            (None, Some(started)) => started.map_err(|e| {
                self.skip_rest_of(frame);
                (id, e)
            })?,
            (None, None) => return Err((id, WireError::NotStarted(id).into())),
        };
        if let Err(e) = assembly.push(id, frame.data()) {
            // An interleaved frame fails the incomplete request; a stray frame of another
            // request cannot be trusted either, so that one is skipped to its end too.
            self.skip_rest_of(frame);
            return Err((assembly.request_id, e.into()));
        }
        if !frame.last() {
            self.current = Some((assembly, tag));
            return Ok(None);
        }
        Ok(Some((assembly, tag)))
    }

    /// Gives up the payload part-way in (its request was too slow): drops it and skips the
    /// rest of its frames; returns its request id.
    pub fn give_up(&mut self) -> Option<u64> {
        let (assembly, _) = self.current.take()?;
        self.skipping = Some(assembly.request_id);
        Some(assembly.request_id)
    }

    /// Skips the payload `frame` starts, to its last frame: its request was answered from
    /// this first frame (from the server's window of recent results, say).
    pub fn skip_payload(&mut self, frame: &impl PayloadFrame) {
        self.current = None;
        self.skip_rest_of(frame);
    }

    /// Drops the payload being reassembled (its request was answered otherwise, with an
    /// error frame, say).
    pub fn abandon(&mut self) {
        self.current = None;
    }

    fn skip_rest_of(&mut self, frame: &impl PayloadFrame) {
        self.skipping = (!frame.last()).then_some(frame.request_id());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `encode_owned` of a boundary a test made and gives up.
    #[allow(unsafe_code)]
    fn encode_given_up(sender: &mut PayloadSender, meta: PayloadMeta, codec: &Codec, boundary: Boundary) -> Result<EncodedPayload, WireError> {
        // SAFETY: the tests never write a boundary after giving it up.
        unsafe { sender.encode_owned(meta, codec, boundary) }
    }
    // The frames of the `Infer` stream, as every stream's frames are assembled alike.
    use crate::pb::InferFrame;
    use cleave_codec::Key;
    use prost::Message;
    use tch::{Device, Kind};

    fn sample() -> Boundary {
        let f = Tensor::randn([3, 4, 5], (Kind::Float, Device::Cpu));
        // A non-contiguous view travels as its logical contents.
        let t = Tensor::arange(12, (Kind::Int64, Device::Cpu)).view([3, 4]).transpose(0, 1);
        let b = Tensor::from_slice(&[true, false, true]);
        let h = Tensor::randn([2, 3], (Kind::Float, Device::Cpu)).to_kind(Kind::BFloat16);
        let empty = Tensor::zeros([0, 7], (Kind::Float, Device::Cpu));
        Boundary {
            values: vec![
                ("x".into(), Value::Tensor(f)),
                ("pair".into(), Value::Tuple(vec![Value::Tensor(t), Value::Int(-7)])),
                ("d".into(), Value::Dict(vec![("mask".into(), Value::Tensor(b)), ("none".into(), Value::None)])),
                ("h".into(), Value::Tensor(h)),
                ("e".into(), Value::Tensor(empty)),
                ("s".into(), Value::List(vec![Value::Float(1.5), Value::Str("a".into()), Value::Bool(true)])),
            ],
        }
    }

    fn meta(request_id: u64) -> PayloadMeta {
        PayloadMeta { request_id, split: 2, direction: Direction::Request }
    }

    fn receiver(ring: &KeyRing) -> PayloadReceiver {
        PayloadReceiver::new(Direction::Request, 1 << 20, CodecPolicy::default(), ring)
    }

    fn send_through_chunks(rx: &mut PayloadReceiver, enc: &EncodedPayload, id: u64, chunk: usize) -> Result<Received, WireError> {
        let parts = frame_parts(enc.envelope.clone(), &enc.data, chunk);
        // The envelope rides on the first frame alone; only the last is marked last.
        assert!(parts.iter().all(|p| p.first != p.header.is_empty()));
        assert_eq!(parts.iter().filter(|p| p.last).count(), 1);
        assert!(parts.last().unwrap().last && parts[0].first);
        let mut assembler = FrameAssembler::default();
        for part in &parts {
            let frame = InferFrame { request_id: id, header: part.header.clone(), data: part.data.clone(), last: part.last, ..Default::default() };
            if let Some((done, ())) = assembler.push(&frame, |f| rx.start(f.request_id, &f.header).map(|a| (a, ()))).map_err(|(_, e)| e)? {
                return rx.finish(done);
            }
        }
        unreachable!("the last part is marked last")
    }

    #[test]
    fn a_tensor_dense_in_another_order_is_found_in_it_and_one_with_gaps_is_not() {
        let nchw = Tensor::zeros([2, 3, 4, 5], (Kind::Float, Device::Cpu));
        assert_eq!(memory_order(&nchw.permute([0, 2, 3, 1]).contiguous().permute([0, 3, 1, 2])), Some(vec![0, 2, 3, 1]));
        assert_eq!(memory_order(&Tensor::zeros([3, 4], (Kind::Float, Device::Cpu)).tr()), Some(vec![1, 0]));
        assert_eq!(memory_order(&nchw), None, "row-major");
        assert_eq!(memory_order(&nchw.slice(3, 0, 5, 2).permute([0, 2, 3, 1])), None, "every other column: gaps");
        // A dimension of size 1 may have any stride, as libtorch's `is_contiguous` has it.
        let one = Tensor::zeros([6], (Kind::Float, Device::Cpu)).as_strided([2, 1, 3], [1, 99, 2], None);
        assert_eq!(memory_order(&one), Some(vec![1, 2, 0]));
        assert!(one.permute([1, 2, 0]).is_contiguous(), "libtorch agrees");
    }

    #[test]
    fn a_channels_last_tensor_travels_as_it_lies_and_arrives_laid_out_alike() {
        // Shape [2, 16, 32, 32] (128 KiB, a segment of its own), laid out channels last (as the
        // inference stages' activations).
        let t = Tensor::randn([2, 32, 32, 16], (Kind::Float, Device::Cpu)).permute([0, 3, 1, 2]);
        assert!(!t.is_contiguous());
        let expected = t.contiguous();
        for codec in ["raw", "shuffle+lz4", "fp16", "int8"] {
            let codec: Codec = codec.parse().unwrap();
            let boundary = Boundary { values: vec![("x".into(), Value::Tensor(t.shallow_clone()))] };
            let encoded = encode_given_up(&mut PayloadSender::plain(), meta(1), &codec, boundary).unwrap();
            let header =
                cleave_codec::pb::PayloadHeader::decode(&cleave_codec::pb::PayloadEnvelope::decode(&encoded.envelope[..]).unwrap().header[..])
                    .unwrap();
            let int8 = codec.precision == Precision::Int8;
            assert_eq!(header.tensors[0].dim_order, if int8 { vec![] } else { vec![0, 2, 3, 1] }, "{codec}");
            if codec == Codec::RAW {
                assert_eq!(encoded.copied_bytes, 0, "sent from the tensor's memory as it lies");
            }
            let mut rx = receiver(&KeyRing::default());
            let got = send_through_chunks(&mut rx, &encoded, 1, 1000).unwrap().boundary;
            let Value::Tensor(r) = &got.values[0].1 else { panic!("a tensor") };
            assert_eq!(r.size(), [2, 16, 32, 32]);
            if !int8 {
                assert_eq!(r.stride(), t.stride(), "{codec}: laid out as it was sent");
            }
            let error = (r - &expected).abs().max().double_value(&[]);
            assert!(
                error
                    <= if int8 {
                        0.1
                    } else if codec.precision == Precision::Fp16 {
                        1e-2
                    } else {
                        0.0
                    },
                "{codec}: {error}"
            );
        }
    }

    #[test]
    fn copies_are_counted_and_a_raw_boundary_given_up_is_copied_once_received() {
        // 256 KiB of floats: large enough to travel as a segment of its own.
        let boundary = || Boundary { values: vec![("x".into(), Value::Tensor(Tensor::randn([256, 256], (Kind::Float, Device::Cpu))))] };
        let bytes = 256 * 256 * 4;
        let mut rx = PayloadReceiver::new(Direction::Request, 1 << 20, CodecPolicy::default(), &KeyRing::default());
        let given_up = encode_given_up(&mut PayloadSender::plain(), meta(1), &Codec::RAW, boundary()).unwrap();
        assert_eq!(given_up.copied_bytes, 0, "sent from the tensor's memory");
        assert_eq!(send_through_chunks(&mut rx, &given_up, 1, 100_000).unwrap().copied_bytes, bytes, "once, from the frames into the tensor");
        let kept = PayloadSender::plain().encode(meta(2), &Codec::RAW, &boundary()).unwrap();
        assert_eq!(kept.copied_bytes, bytes, "a boundary the caller keeps is copied");
        // Sealed, the data is copied into the payload, and received into the tensor's memory
        // (the tag aside), where it is decrypted.
        let ring = KeyRing::new([(1, Key::from_bytes([9; 32]))]).unwrap();
        let sealed = encode_given_up(&mut PayloadSender::sealed(&ring, 1).unwrap(), meta(3), &Codec::RAW, boundary()).unwrap();
        assert_eq!(sealed.copied_bytes, bytes);
        let mut rx = PayloadReceiver::new(Direction::Request, 1 << 20, CodecPolicy::default(), &ring);
        let wire = sealed.data.len() as u64;
        assert_eq!(wire, bytes + 16, "the tensor and the tag");
        let back = send_through_chunks(&mut rx, &sealed, 3, 100_000).unwrap();
        assert_eq!(back.copied_bytes, wire, "once, from the frames into the tensor");
        assert_eq!(back.key_id, Some(1));
    }

    #[test]
    fn a_boundary_bound_for_cuda_lands_pinned_where_libtorch_can_pin_and_arrives_whole_either_way() {
        // Without a CUDA device libtorch cannot pin: the tensors land in pageable memory instead,
        // the payload unchanged. With one, every byte of a raw or compressed one lands pinned.
        let t = Tensor::randn([256, 256], (Kind::Float, Device::Cpu));
        let bytes = 256 * 256 * 4;
        let pinned = if tch::Cuda::is_available() { bytes } else { 0 };
        for codec in ["raw", "shuffle+lz4"] {
            let boundary = Boundary { values: vec![("x".into(), Value::Tensor(t.copy()))] };
            let encoded = encode_given_up(&mut PayloadSender::plain(), meta(1), &codec.parse().unwrap(), boundary).unwrap();
            let mut rx = PayloadReceiver::new(Direction::Request, 1 << 20, CodecPolicy::default(), &KeyRing::default()).landing_for(Device::Cuda(0));
            let back = send_through_chunks(&mut rx, &encoded, 1, 100_000).unwrap();
            assert_eq!(back.pinned_bytes, pinned, "{codec}");
            let Value::Tensor(r) = &back.boundary.values[0].1 else { panic!("a tensor") };
            assert!(r.equal(&t), "{codec}: arrived whole");
            // Bound for the CPU, nothing is pinned.
            let boundary = Boundary { values: vec![("x".into(), Value::Tensor(t.copy()))] };
            let encoded = encode_given_up(&mut PayloadSender::plain(), meta(2), &codec.parse().unwrap(), boundary).unwrap();
            let mut rx = PayloadReceiver::new(Direction::Request, 1 << 20, CodecPolicy::default(), &KeyRing::default()).landing_for(Device::Cpu);
            assert_eq!(send_through_chunks(&mut rx, &encoded, 2, 100_000).unwrap().pinned_bytes, 0);
        }
    }

    #[test]
    fn a_sealed_tensor_is_opened_in_its_own_memory_and_a_tampered_or_replayed_one_refused() {
        let ring = KeyRing::new([(1, Key::from_bytes([9; 32]))]).unwrap();
        let boundary = Boundary { values: vec![("x".into(), Value::Tensor(Tensor::randn([64, 64], (Kind::Float, Device::Cpu))))] };
        let mut tx = PayloadSender::sealed(&ring, 1).unwrap();
        let mut rx = PayloadReceiver::new(Direction::Request, 1 << 20, CodecPolicy::default(), &ring);
        let sealed = |tx: &mut PayloadSender, id| tx.encode(meta(id), &Codec::RAW, &boundary).unwrap();
        let first = sealed(&mut tx, 1);
        let back = send_through_chunks(&mut rx, &first, 1, 1000).unwrap();
        assert!(back.boundary.bit_identical(&boundary));
        assert_eq!((back.key_id, back.copied_bytes), (Some(1), 64 * 64 * 4 + 16));
        let replayed = send_through_chunks(&mut rx, &first, 1, 1000).unwrap_err();
        assert!(replayed.to_string().contains("replay"), "{replayed}");
        // One bit flipped in the ciphertext (in the tensor's memory) or in the tag (aside).
        let whole: Vec<u8> = sealed(&mut tx, 2).data.segments().concat();
        for at in [0, 64 * 64 * 4 - 1, 64 * 64 * 4, whole.len() - 1] {
            let mut tampered = sealed(&mut tx, 3 + at as u64);
            let mut bytes: Vec<u8> = tampered.data.segments().concat();
            bytes[at] ^= 1;
            tampered.data = bytes.into();
            let err = send_through_chunks(&mut rx, &tampered, 3 + at as u64, 1000).unwrap_err();
            assert!(matches!(err, WireError::Codec(CodecError::DataTampered)), "byte {at}: {err}");
        }
        // The stream goes on with the next payload.
        let next = sealed(&mut tx, 99);
        assert!(send_through_chunks(&mut rx, &next, 99, 1000).unwrap().boundary.bit_identical(&boundary));
        // A sealed payload of two tensors is opened in a buffer of its own and decoded from it.
        let two = Boundary {
            values: vec![
                ("a".into(), Value::Tensor(Tensor::ones([8], (Kind::Float, Device::Cpu)))),
                ("b".into(), Value::Tensor(Tensor::zeros([3], (Kind::Int64, Device::Cpu)))),
            ],
        };
        let both = tx.encode(meta(100), &Codec::RAW, &two).unwrap();
        assert!(send_through_chunks(&mut rx, &both, 100, 7).unwrap().boundary.bit_identical(&two));
    }

    #[test]
    fn a_failed_request_is_skipped_to_its_last_frame_and_the_next_one_assembles() {
        let rx = receiver(&KeyRing::default());
        let enc = |id| PayloadSender::plain().encode(meta(id), &Codec::RAW, &sample()).unwrap();
        let (one, two) = (enc(1), enc(2));
        let frames = |id: u64, e: &EncodedPayload, header: Vec<u8>| -> Vec<InferFrame> { payload_frames(id, header.into(), &e.data, 64) };
        // Request 1 has a garbled envelope: its first frame fails, the rest are skipped.
        let bad = frames(1, &one, vec![0xff; 9]);
        assert!(bad.len() > 2);
        let mut assembler = FrameAssembler::default();
        let start = |f: &InferFrame| rx.start(f.request_id, &f.header).map(|a| (a, ()));
        let (failed, _) = assembler.push(&bad[0], start).unwrap_err();
        assert_eq!(failed, 1);
        for frame in &bad[1..] {
            assert!(assembler.push(frame, start).unwrap().is_none());
        }
        // Request 2 then assembles whole.
        let good = frames(2, &two, two.envelope.to_vec());
        let mut done = None;
        for frame in &good {
            done = assembler.push(frame, start).unwrap();
        }
        let (assembly, ()) = done.expect("the last frame completes it");
        assert_eq!(assembly.request_id, 2);
        // A frame of another request inside request 2 fails request 2 and is skipped to its end.
        let mut assembler = FrameAssembler::default();
        assert!(assembler.push(&good[0], start).unwrap().is_none());
        let stray = InferFrame { request_id: 7, header: Bytes::new(), data: Bytes::from_static(&[0]), last: false, ..Default::default() };
        let (failed, e): (u64, WireError) = assembler.push(&stray, start).unwrap_err();
        assert_eq!((failed, e), (2, WireError::Interleaved { expected: 2, got: 7 }));
        assert!(assembler.push(&InferFrame { last: true, ..stray }, start).unwrap().is_none());
    }

    #[test]
    fn lossless_round_trips_are_bit_exact_through_chunks_for_every_codec() {
        let boundary = sample();
        let ring = KeyRing::new([(1, Key::random())]).unwrap();
        for codec in ["raw", "shuffle", "lz4", "shuffle+lz4", "auto", "zstd-1", "shuffle+zstd-3"] {
            let codec: Codec = codec.parse().unwrap();
            for sealed in [false, true] {
                let mut tx = if sealed { PayloadSender::sealed(&ring, 1).unwrap() } else { PayloadSender::plain() };
                let mut rx = receiver(&ring);
                for id in 0..2 {
                    let enc = tx.encode(meta(id), &codec, &boundary).unwrap();
                    let back = send_through_chunks(&mut rx, &enc, id, 7).unwrap();
                    assert!(back.boundary.bit_identical(&boundary), "{codec} sealed {sealed}");
                    assert_eq!((back.request_id, back.split, back.codec, back.key_id), (id, 2, codec, sealed.then_some(1)));
                }
            }
        }
        let back =
            send_through_chunks(&mut receiver(&ring), &PayloadSender::plain().encode(meta(0), &Codec::RAW, &boundary).unwrap(), 0, 1 << 20).unwrap();
        let names: Vec<_> = back.boundary.values.iter().map(|(n, v)| format!("{n}:{}", v.describe())).collect();
        assert_eq!(names, ["x:float32[3, 4, 5]", "pair:tuple of 2", "d:dict of 2", "h:bfloat16[2, 3]", "e:float32[0, 7]", "s:list of 3"]);
    }

    #[test]
    fn lossy_precisions_rebuild_float32_within_their_error() {
        let x = Tensor::randn([4, 8, 5, 5], (Kind::Float, Device::Cpu));
        let boundary = Boundary { values: vec![("x".into(), Value::Tensor(x.shallow_clone()))] };
        for (codec, tolerance) in [("fp16+shuffle+lz4", 1e-3), ("bf16+zstd", 8e-3), ("int8+shuffle+lz4", 0.05)] {
            let enc = PayloadSender::plain().encode(meta(0), &codec.parse().unwrap(), &boundary).unwrap();
            let back = send_through_chunks(&mut receiver(&KeyRing::default()), &enc, 0, 4096).unwrap();
            let Value::Tensor(y) = &back.boundary.values[0].1 else { panic!("not a tensor") };
            assert_eq!(y.kind(), Kind::Float);
            let err = (&x - y).abs().max().double_value(&[]) / x.abs().max().double_value(&[]);
            assert!(err <= tolerance, "{codec}: relative error {err}");
        }
    }

    #[test]
    fn a_boundary_given_up_travels_as_its_tensors_memory_and_one_kept_is_copied() {
        // Two large tensors (128 KiB each) and a small one, which is cheaper copied together
        // with the others' headers than sent as a segment of its own.
        let x = Tensor::arange(1 << 15, (Kind::Float, Device::Cpu)).reshape([8, 64, 64]);
        let y = Tensor::arange(1 << 15, (Kind::Int, Device::Cpu));
        let mask = Tensor::from_slice(&[true, false, true]);
        let boundary = || Boundary {
            values: vec![
                ("x".into(), Value::Tensor(x.shallow_clone())),
                ("m".into(), Value::Tensor(mask.shallow_clone())),
                ("y".into(), Value::Tensor(y.shallow_clone())),
            ],
        };
        let pointers = [x.data_ptr() as usize, y.data_ptr() as usize];
        let given = encode_given_up(&mut PayloadSender::plain(), meta(1), &Codec::RAW, boundary()).unwrap();
        let segments: Vec<usize> = given.data.segments().iter().map(|s| s.as_ptr() as usize).collect();
        assert_eq!(segments.len(), 3, "x, then m's copy, then y: {segments:?}");
        assert_eq!([segments[0], segments[2]], pointers, "each large tensor is a segment of its own memory");
        assert_ne!(segments[1], mask.data_ptr() as usize, "a small tensor is copied");
        let kept = PayloadSender::plain().encode(meta(1), &Codec::RAW, &boundary()).unwrap();
        assert!(kept.data.segments().iter().all(|s| !pointers.contains(&(s.as_ptr() as usize))), "a kept boundary is copied");
        let before = kept.data.to_vec();
        let _ = x.shallow_clone().relu_().f_add_(&Tensor::from(1.0f32)).unwrap();
        assert_eq!(kept.data.to_vec(), before, "writing the kept tensor changes nothing sent");
        // Frames slice the segments (never across two), and the receiver fills tensors from them.
        for chunk in [1, 7, 64, 240, 1 << 20] {
            let parts = frame_parts(given.envelope.clone(), &given.data, chunk);
            assert!(parts.iter().all(|p| given.data.segments().iter().any(|s| s.as_ptr_range().contains(&p.data.as_ptr()) || p.data.is_empty())));
            let back = send_through_chunks(&mut receiver(&KeyRing::default()), &given, 1, chunk).unwrap();
            assert!(back.boundary.bit_identical(&boundary()), "chunk {chunk}");
        }
        // A tensor that must be made contiguous is a new one, used as it is.
        let transposed = Boundary { values: vec![("t".into(), Value::Tensor(x.reshape([512, 64]).tr()))] };
        let enc = PayloadSender::plain().encode(meta(1), &Codec::RAW, &transposed).unwrap();
        assert!(send_through_chunks(&mut receiver(&KeyRing::default()), &enc, 1, 16).unwrap().boundary.bit_identical(&transposed));
    }

    #[test]
    fn a_raw_payload_is_checked_as_it_fills_its_tensors() {
        let mask = Boundary { values: vec![("m".into(), Value::Tensor(Tensor::from_slice(&[true, false, true])))] };
        let enc = PayloadSender::plain().encode(meta(1), &Codec::RAW, &mask).unwrap();
        let mut rx = receiver(&KeyRing::default());
        let mut re = rx.start(1, &enc.envelope).unwrap();
        assert_eq!(re.held_bytes(), 3, "a verbatim payload holds its tensors only");
        assert_eq!(re.finish_work_bytes(), 0, "a verbatim payload is in its tensors as received");
        re.push(1, &[1, 7, 0]).unwrap();
        let err = rx.finish(re).unwrap_err();
        assert!(err.to_string().contains("bool element 1 is 7"), "{err}");
        let mut re = rx.start(1, &enc.envelope).unwrap();
        re.push(1, &[1, 0]).unwrap();
        assert_eq!(rx.finish(re).unwrap_err(), WireError::Codec(CodecError::Truncated { expected: 3, got: 2 }));
        // Encoded payloads hold their data as received and the tensors it decodes into.
        let enc = PayloadSender::plain().encode(meta(1), &"lz4".parse().unwrap(), &mask).unwrap();
        let re = receiver(&KeyRing::default()).start(1, &enc.envelope).unwrap();
        assert_eq!(re.held_bytes(), enc.data.len() as u64 + 3);
        assert_eq!(re.finish_work_bytes(), re.held_bytes(), "an encoded payload is decoded whole");
    }

    #[test]
    fn frames_must_match_their_header_and_stay_within_it() {
        let enc = PayloadSender::plain().encode(meta(1), &Codec::RAW, &sample()).unwrap();
        let rx = receiver(&KeyRing::default());
        assert_eq!(rx.start(2, &enc.envelope).unwrap_err(), WireError::RequestIdMismatch { frame: 2, header: 1 });
        assert_eq!(rx.start(1, &[]).unwrap_err(), WireError::MissingHeader(1));
        let mut re = rx.start(1, &enc.envelope).unwrap();
        assert_eq!(re.push(3, &enc.data.to_vec()[..1]), Err(WireError::Interleaved { expected: 1, got: 3 }));
        re.push_data(1, &enc.data).unwrap();
        assert!(matches!(re.push(1, &[0]), Err(WireError::Overrun { .. })));
        let mut rx = receiver(&KeyRing::default());
        let mut re = rx.start(1, &enc.envelope).unwrap();
        re.push(1, &enc.data.to_vec()[..enc.data.len() - 1]).unwrap();
        assert!(matches!(rx.finish(re), Err(WireError::Codec(CodecError::Truncated { .. }))));
    }

    #[test]
    fn a_shape_libtorch_cannot_build_is_an_error_not_a_panic() {
        use prost::Message;
        let empty = Boundary { values: vec![("e".into(), Value::Tensor(Tensor::zeros([0, 7], (Kind::Float, Device::Cpu))))] };
        let enc = PayloadSender::plain().encode(meta(1), &Codec::RAW, &empty).unwrap();
        let mut envelope = pb::PayloadEnvelope::decode(&enc.envelope[..]).unwrap();
        let mut header = pb::PayloadHeader::decode(&envelope.header[..]).unwrap();
        // No bytes, but strides of 2^64 elements.
        header.tensors[0].shape = vec![0, 1 << 32, 1 << 32];
        envelope.header = header.encode_to_vec().into();
        let mut rx = receiver(&KeyRing::default());
        let mut re = rx.start(1, &envelope.encode_to_vec()).unwrap();
        re.push_data(1, &enc.data).unwrap();
        let err = rx.finish(re).unwrap_err();
        assert!(matches!(&err, WireError::BadTensor { name, .. } if name == "e"), "{err}");
    }

    #[test]
    fn value_trees_must_name_each_tensor_once() {
        use prost::Message;
        let enc = PayloadSender::plain().encode(meta(1), &Codec::RAW, &sample()).unwrap();
        let retree = |f: &dyn Fn(&mut pb::PayloadHeader)| {
            let mut envelope = pb::PayloadEnvelope::decode(&enc.envelope[..]).unwrap();
            let mut header = pb::PayloadHeader::decode(&envelope.header[..]).unwrap();
            f(&mut header);
            envelope.header = header.encode_to_vec().into();
            let mut rx = receiver(&KeyRing::default());
            let mut re = rx.start(1, &envelope.encode_to_vec()).unwrap();
            re.push_data(1, &enc.data).unwrap();
            rx.finish(re).unwrap_err().to_string()
        };
        let err = retree(&|h| h.values[0].value = Some(ValueNode { kind: Some(pb::value_node::Kind::Tensor("nope".into())) }));
        assert!(err.contains("tensor nope is not in the header"), "{err}");
        let err = retree(&|h| {
            h.values.remove(0);
        });
        assert!(err.contains("tensor x is in the header but not in the value tree"), "{err}");
        let err = retree(&|h| {
            let mut node = ValueNode { kind: Some(pb::value_node::Kind::Int(1)) };
            for _ in 0..40 {
                node = ValueNode { kind: Some(pb::value_node::Kind::List(pb::ValueList { items: vec![node] })) };
            }
            h.values.push(NamedValue { name: "deep".into(), value: Some(node) });
        });
        assert!(err.contains("deeper than"), "{err}");
    }
}
