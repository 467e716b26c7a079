//! Payloads: an envelope (the header as serialised bytes, and how it was sealed) and data
//! (each tensor's encoded bytes in header order, encrypted as a whole when sealed).
//!
//! Sending: [`encode_payload`]. Receiving is two steps, so that nothing is allocated on a
//! peer's word before it is checked: [`IncomingPayload::parse`] reads the envelope, checks
//! the direction, the codec, the key and nonce order, the header's tag, and every declared
//! size against dtype x shape, the codec's bounds and the limit; then
//! [`IncomingPayload::decode`] takes the data (exactly [`IncomingPayload::wire_len`] bytes),
//! authenticates and decrypts it, and decodes each tensor into a buffer of its declared size.

use bytes::Bytes;
use prost::Message;

use crate::codec::{Codec, CodecPolicy, Compression, Precision};
use crate::compress::{compress, decompress};
use crate::dtype::DType;
use crate::error::CodecError;
use crate::pb::{Direction, NamedValue, PayloadEnvelope, PayloadHeader, Seal, TensorHeader};
use crate::precision::{narrow, widen};
use crate::seal::{Opener, Sealer, TAG_BYTES};
use crate::shuffle::{shuffle, unshuffle};

/// A tensor as bytes: little-endian, contiguous, row-major.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorData {
    /// Its name in the value tree.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Shape.
    pub shape: Vec<i64>,
    /// `dtype.size() x numel` bytes.
    pub data: Vec<u8>,
}

/// What a payload is about (all of it authenticated when sealed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PayloadMeta {
    /// The request it belongs to.
    pub request_id: u64,
    /// The cut the boundary is at.
    pub split: u32,
    /// Which way it travels.
    pub direction: Direction,
}

/// A payload ready to send.
#[derive(Debug, Clone)]
pub struct EncodedPayload {
    /// The envelope, for the first frame's `header` field.
    pub envelope: Bytes,
    /// The data, to spread over the frames' `data` fields.
    pub data: Bytes,
    /// Tensor bytes before encoding.
    pub raw_bytes: u64,
}

/// Encodes tensors with `codec` and, when a sealer is given, encrypts and authenticates
/// the whole payload with it.
pub fn encode_payload(
    meta: PayloadMeta,
    values: Vec<NamedValue>,
    tensors: &[TensorData],
    codec: &Codec,
    sealer: Option<&mut Sealer>,
) -> Result<EncodedPayload, CodecError> {
    let raw_bytes: u64 = tensors.iter().map(|t| t.data.len() as u64).sum();
    let mut data = Vec::with_capacity(if codec.compression == Compression::None { raw_bytes as usize } else { raw_bytes as usize / 2 });
    let mut headers = Vec::with_capacity(tensors.len());
    let mut scratch = Vec::new();
    for t in tensors {
        let start = data.len();
        let quant = encode_tensor(t, codec, &mut scratch, &mut data)?;
        headers.push(TensorHeader {
            name: t.name.clone(),
            dtype: t.dtype.name().into(),
            shape: t.shape.clone(),
            byte_len: t.data.len() as u64,
            wire_len: (data.len() - start) as u64,
            quant,
        });
    }
    let sealed_len = data.len() as u64 + if sealer.is_some() { TAG_BYTES as u64 } else { 0 };
    let header = PayloadHeader {
        request_id: meta.request_id,
        split: meta.split,
        direction: meta.direction as i32,
        codec: codec.to_string(),
        values,
        tensors: headers,
        wire_len: sealed_len,
    };
    let header = Bytes::from(header.encode_to_vec());
    let envelope = match sealer {
        None => PayloadEnvelope { header, seal: None, header_tag: Bytes::new() },
        Some(sealer) => {
            let seal = sealer.next_seal()?;
            let header_tag = sealer.seal(&seal, &header, &mut data)?;
            PayloadEnvelope { header, seal: Some(seal), header_tag: header_tag.into() }
        }
    };
    Ok(EncodedPayload { envelope: envelope.encode_to_vec().into(), data: data.into(), raw_bytes })
}

/// Precision, shuffle, compression; appends the result to `out`.
fn encode_tensor(t: &TensorData, codec: &Codec, scratch: &mut Vec<u8>, out: &mut Vec<u8>) -> Result<Option<crate::pb::Quantization>, CodecError> {
    let fail = |reason: String| CodecError::Encode { name: t.name.clone(), reason };
    let expected = numel(&t.shape).map(|n| n * t.dtype.size() as u64);
    if expected != Some(t.data.len() as u64) {
        return Err(fail(format!("{} bytes for {}{:?}", t.data.len(), t.dtype, t.shape)));
    }
    let (carried, quant) = if codec.precision.casts(t.dtype) {
        let (bytes, quant) = narrow(codec.precision, t.dtype, &t.shape, &t.data).map_err(fail)?;
        (std::borrow::Cow::Owned(bytes), quant)
    } else {
        (std::borrow::Cow::Borrowed(&t.data[..]), None)
    };
    let size = codec.precision.carried_size(t.dtype);
    let shuffled = if codec.shuffle && size > 1 {
        shuffle(&carried, size, scratch);
        &scratch[..]
    } else {
        &carried[..]
    };
    compress(codec.compression, shuffled, out).map_err(fail)?;
    Ok(quant)
}

/// A received envelope whose header passed every check; the data comes next.
#[derive(Debug)]
pub struct IncomingPayload {
    header: PayloadHeader,
    seal: Option<Seal>,
    codec: Codec,
    dtypes: Vec<DType>,
}

/// A decoded payload.
#[derive(Debug, Clone)]
pub struct DecodedPayload {
    /// Request, split and direction, as the (authenticated) header says.
    pub meta: PayloadMeta,
    /// The codec it travelled with.
    pub codec: Codec,
    /// The key id it was sealed with, if it was.
    pub key_id: Option<u32>,
    /// The boundary's value trees.
    pub values: Vec<NamedValue>,
    /// Its tensors, in header order.
    pub tensors: Vec<TensorData>,
}

fn numel(shape: &[i64]) -> Option<u64> {
    shape.iter().try_fold(1u64, |n, &d| n.checked_mul(u64::try_from(d).ok()?))
}

fn direction_name(d: Direction) -> &'static str {
    match d {
        Direction::Request => "request",
        Direction::Result => "result",
        Direction::Gradient => "gradient",
        Direction::Unspecified => "unspecified",
    }
}

/// The most bytes `compression` may turn `n` bytes into.
fn compressed_bound(compression: Compression, n: u64) -> u64 {
    match compression {
        Compression::None => n,
        Compression::Lz4 => lz4_flex::block::get_maximum_output_size(n as usize) as u64,
        Compression::Zstd(_) => zstd::zstd_safe::compress_bound(n as usize) as u64,
    }
}

impl IncomingPayload {
    /// Reads and checks an envelope: direction, codec against `policy`, sealing (key, nonce
    /// order, the header's tag), and every declared size against dtype x shape and `limit`
    /// (which bounds the tensor bytes rebuilt, and so what is allocated).
    pub fn parse(envelope: &[u8], expected: Direction, limit: u64, policy: &CodecPolicy, opener: &Opener) -> Result<Self, CodecError> {
        let envelope = PayloadEnvelope::decode(envelope).map_err(|e| CodecError::Malformed(format!("envelope: {e}")))?;
        match &envelope.seal {
            None if policy.require_encryption => return Err(CodecError::NotSealed),
            None => {}
            Some(seal) if !opener.has_keys() => return Err(CodecError::NoKeys { id: seal.key_id }),
            // Authenticate the header before believing anything it says.
            Some(seal) => opener.check_header(seal, &envelope.header, &envelope.header_tag)?,
        }
        let header = PayloadHeader::decode(&envelope.header[..]).map_err(|e| CodecError::Malformed(format!("header: {e}")))?;
        let direction = Direction::try_from(header.direction).unwrap_or(Direction::Unspecified);
        if direction != expected {
            return Err(CodecError::WrongDirection { expected: direction_name(expected), got: direction_name(direction).into() });
        }
        let refused = |reason: String| CodecError::CodecRefused { codec: header.codec.clone(), reason };
        let codec: Codec = header.codec.parse().map_err(refused)?;
        policy.check(&codec).map_err(refused)?;
        let mut raw_total = 0u64;
        let mut wire_total = 0u64;
        let mut dtypes = Vec::with_capacity(header.tensors.len());
        for t in &header.tensors {
            let dtype = DType::from_name(&t.dtype).ok_or_else(|| CodecError::UnknownDtype { name: t.name.clone(), dtype: t.dtype.clone() })?;
            let n = numel(&t.shape).ok_or_else(|| CodecError::InvalidShape { name: t.name.clone(), shape: t.shape.clone() })?;
            let raw = n.checked_mul(dtype.size() as u64).ok_or_else(|| CodecError::InvalidShape { name: t.name.clone(), shape: t.shape.clone() })?;
            if raw != t.byte_len {
                return Err(CodecError::SizeMismatch {
                    name: t.name.clone(),
                    declared: t.byte_len,
                    expected: format!("{dtype}{:?} needs {raw}", t.shape),
                });
            }
            raw_total = raw_total.saturating_add(raw);
            if raw_total > limit {
                return Err(CodecError::PayloadTooLarge { declared: raw_total, limit });
            }
            let carried = n * codec.precision.carried_size(dtype) as u64;
            let bound = compressed_bound(codec.compression, carried);
            if t.wire_len > bound {
                return Err(CodecError::SizeMismatch {
                    name: t.name.clone(),
                    declared: t.wire_len,
                    expected: format!("{} encodes {carried} bytes in at most {bound}", codec.compression.family()),
                });
            }
            if codec.compression == Compression::None && t.wire_len != carried {
                return Err(CodecError::SizeMismatch {
                    name: t.name.clone(),
                    declared: t.wire_len,
                    expected: format!("uncompressed it is {carried}"),
                });
            }
            let quantised = codec.precision == Precision::Int8 && codec.precision.casts(dtype);
            if quantised != t.quant.is_some() {
                let what = if quantised { "has no quantisation parameters" } else { "has quantisation parameters it does not use" };
                return Err(CodecError::Malformed(format!("tensor {} {what}", t.name)));
            }
            wire_total += t.wire_len;
            dtypes.push(dtype);
        }
        let tag = if envelope.seal.is_some() { TAG_BYTES as u64 } else { 0 };
        if wire_total + tag != header.wire_len {
            return Err(CodecError::Malformed(format!(
                "the tensors take {wire_total} bytes{}, but the payload declares {}",
                if tag > 0 { " plus a 16-byte tag" } else { "" },
                header.wire_len
            )));
        }
        Ok(Self { header, seal: envelope.seal, codec, dtypes })
    }

    /// The request id, as the header says.
    pub fn request_id(&self) -> u64 {
        self.header.request_id
    }

    /// The split, as the header says.
    pub fn split(&self) -> u32 {
        self.header.split
    }

    /// The codec.
    pub fn codec(&self) -> Codec {
        self.codec
    }

    /// The key the payload is sealed with, if it is.
    pub fn key_id(&self) -> Option<u32> {
        self.seal.as_ref().map(|s| s.key_id)
    }

    /// Exactly how many data bytes must follow (checked against the codec's bounds).
    pub fn wire_len(&self) -> u64 {
        self.header.wire_len
    }

    /// What each tensor declares: its name, dtype and shape (sizes already checked against
    /// each other and the limit), for a receiver to check against what it expects before
    /// reserving the data.
    pub fn declared_tensors(&self) -> impl Iterator<Item = (&str, DType, &[i64])> {
        self.header.tensors.iter().zip(&self.dtypes).map(|(t, &dtype)| (t.name.as_str(), dtype, t.shape.as_slice()))
    }

    /// Tensor bytes the payload rebuilds.
    pub fn raw_len(&self) -> u64 {
        self.header.tensors.iter().map(|t| t.byte_len).sum()
    }

    /// Authenticates and decrypts `data` (when sealed) and decodes every tensor.
    pub fn decode(self, mut data: Vec<u8>, opener: &mut Opener) -> Result<DecodedPayload, CodecError> {
        if data.len() as u64 != self.header.wire_len {
            return Err(CodecError::Truncated { expected: self.header.wire_len, got: data.len() as u64 });
        }
        if let Some(seal) = &self.seal {
            opener.open(seal, &mut data)?;
        }
        let mut tensors = Vec::with_capacity(self.header.tensors.len());
        let (mut offset, mut scratch) = (0usize, Vec::new());
        for (t, &dtype) in self.header.tensors.iter().zip(&self.dtypes) {
            let end = offset + t.wire_len as usize;
            let bytes = decode_tensor(t, dtype, &self.codec, &data[offset..end], &mut scratch)
                .map_err(|reason| CodecError::Corrupt { name: t.name.clone(), reason })?;
            offset = end;
            tensors.push(TensorData { name: t.name.clone(), dtype, shape: t.shape.clone(), data: bytes });
        }
        let h = self.header;
        Ok(DecodedPayload {
            meta: PayloadMeta { request_id: h.request_id, split: h.split, direction: Direction::try_from(h.direction).unwrap_or_default() },
            codec: self.codec,
            key_id: self.seal.as_ref().map(|s| s.key_id),
            values: h.values,
            tensors,
        })
    }
}

/// Decompress, unshuffle, widen: the encoded bytes of one tensor back to its dtype.
fn decode_tensor(t: &TensorHeader, dtype: DType, codec: &Codec, encoded: &[u8], scratch: &mut Vec<u8>) -> Result<Vec<u8>, String> {
    let size = codec.precision.carried_size(dtype);
    let carried_len = (t.byte_len as usize / dtype.size()) * size;
    let mut carried = Vec::new();
    decompress(codec.compression, encoded, carried_len, &mut carried)?;
    if codec.shuffle && size > 1 {
        unshuffle(&carried, size, scratch);
        std::mem::swap(&mut carried, scratch);
    }
    let bytes = if codec.precision.casts(dtype) { widen(codec.precision, dtype, &t.shape, &carried, t.quant.as_ref())? } else { carried };
    if dtype == DType::Bool {
        if let Some(i) = bytes.iter().position(|&b| b > 1) {
            return Err(format!("bool element {i} is {}, not 0 or 1", bytes[i]));
        }
    }
    Ok(bytes)
}
