//! Payloads: an envelope (the header as serialised bytes, and how it was sealed) and data
//! (each tensor's encoded bytes in header order, encrypted as a whole when sealed).
//!
//! Sending: [`encode_payload`]. A raw payload that is not sealed is its tensors' bytes as
//! they are: its data is the tensors' own [`Bytes`] (no copy), which frames slice.
//!
//! Receiving is two steps, so that nothing is allocated on a peer's word before it is
//! checked: [`IncomingPayload::parse`] reads the envelope, checks the direction, the codec,
//! the key and nonce order, the header's tag, and every declared size against dtype x shape,
//! the codec's bounds and the limit; then [`IncomingPayload::decode_into`] takes the data
//! (exactly [`IncomingPayload::wire_len`] bytes), authenticates and decrypts it, and decodes
//! each tensor into the caller's buffer of its declared size. A verbatim payload (raw, not
//! sealed) needs no decoding: its receiver copies the data straight into those buffers and
//! checks them with [`IncomingPayload::check_verbatim`].

use bytes::Bytes;
use prost::Message;

use crate::codec::{Codec, CodecPolicy, Compression, Precision};
use crate::compress::{check_block, compress, compress_blocks, decompress_blocks, worth_compressing, BlockError};
use crate::dtype::DType;
use crate::error::{CodecError, Misuse, TensorError};
use crate::pb::{Block, Direction, NamedValue, PayloadEnvelope, PayloadHeader, Seal, TensorHeader};
use crate::precision::{narrow, widen};
use crate::seal::{Opener, Sealer, TAG_BYTES};
use crate::shuffle::{shuffle, unshuffle_into};
use crate::zeros;

/// A tensor as bytes: little-endian, dense, row-major or in the order `dim_order` says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorData {
    /// Its name in the value tree.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Shape.
    pub shape: Vec<i64>,
    /// The order of its dimensions in memory, outermost first, where it is not the shape's
    /// own (empty: row-major): a channels_last activation travels as it lies.
    pub dim_order: Vec<u32>,
    /// `dtype.size() x numel` bytes (a tensor's own memory, or a copy of it).
    pub data: Bytes,
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

/// A payload's data as one or more segments that follow each other: the tensors' own bytes
/// for a verbatim payload, one encoded buffer otherwise.
#[derive(Debug, Clone, Default)]
pub struct PayloadData {
    segments: Vec<Bytes>,
}

impl PayloadData {
    /// The segments, in order (none empty).
    pub fn segments(&self) -> &[Bytes] {
        &self.segments
    }

    /// Bytes in all.
    pub fn len(&self) -> usize {
        self.segments.iter().map(Bytes::len).sum()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.segments.is_empty()
    }

    /// The data in one buffer (a copy).
    pub fn to_vec(&self) -> Vec<u8> {
        self.segments.concat()
    }
}

impl From<Vec<u8>> for PayloadData {
    fn from(data: Vec<u8>) -> Self {
        vec![Bytes::from(data)].into()
    }
}

impl From<Vec<Bytes>> for PayloadData {
    fn from(segments: Vec<Bytes>) -> Self {
        Self { segments: segments.into_iter().filter(|s| !s.is_empty()).collect() }
    }
}

/// A payload ready to send.
#[derive(Debug, Clone)]
pub struct EncodedPayload {
    /// The envelope, for the first frame's `header` field.
    pub envelope: Bytes,
    /// The data, to spread over the frames' `data` fields.
    pub data: PayloadData,
    /// Tensor bytes before encoding.
    pub raw_bytes: u64,
    /// Bytes the encoder copied as they were: tensors gathered into the data uncompressed,
    /// blocks stored. A raw tensor sent from its own memory is not copied.
    pub copied_bytes: u64,
}

/// A raw tensor smaller than this is copied into the data before it rather than sent as a
/// segment of its own: a frame of its own would cost more than the copy.
const OWN_SEGMENT_BYTES: usize = 64 << 10;

/// Elements of a tensor that `auto` compresses to decide whether the rest is worth it.
const AUTO_SAMPLE_ELEMENTS: usize = 16 << 10;

/// Encodes tensors with `codec` and, when a sealer is given, encrypts and authenticates
/// the whole payload with it. Not sealed, a tensor that travels raw is sent from its own
/// bytes (no copy): the data is then several segments.
pub fn encode_payload(
    meta: PayloadMeta,
    values: Vec<NamedValue>,
    tensors: &[TensorData],
    codec: &Codec,
    sealer: Option<&mut Sealer>,
) -> Result<EncodedPayload, CodecError> {
    let raw_bytes: u64 = tensors.iter().map(|t| t.data.len() as u64).sum();
    // Encoded bytes gather here; a raw tensor sent from its own memory ends the segment.
    let mut data = Vec::with_capacity(match codec.compression {
        _ if *codec == Codec::RAW && sealer.is_none() => 0,
        Compression::None => raw_bytes as usize,
        _ => raw_bytes as usize / 2,
    });
    let mut segments = Vec::new();
    let mut headers = Vec::with_capacity(tensors.len());
    let mut scratch: [Vec<u8>; 2] = Default::default();
    let mut copied_bytes = 0;
    for t in tensors {
        check_size(t)?;
        let chosen = if codec.auto && !sample_compresses(t, &mut scratch[0]) { Codec::RAW } else { Codec { auto: false, ..*codec } };
        let (encoded, wire_len) = if chosen == Codec::RAW && sealer.is_none() && t.data.len() >= OWN_SEGMENT_BYTES {
            segments.extend([std::mem::take(&mut data).into(), t.data.clone()]);
            (EncodedTensor::default(), t.data.len())
        } else {
            let start = data.len();
            let encoded = encode_tensor(t, &chosen, &mut scratch, &mut data)?;
            (encoded, data.len() - start)
        };
        let EncodedTensor { quant, blocks, zeros_elided, copied } = encoded;
        copied_bytes += copied;
        headers.push(TensorHeader {
            name: t.name.clone(),
            dtype: t.dtype.name().into(),
            shape: t.shape.clone(),
            byte_len: t.data.len() as u64,
            wire_len: wire_len as u64,
            quant,
            blocks,
            codec: if codec.auto { chosen.to_string() } else { String::new() },
            zeros_elided,
            dim_order: t.dim_order.clone(),
        });
    }
    let data_len: u64 = headers.iter().map(|h| h.wire_len).sum();
    let sealed_len = data_len + if sealer.is_some() { TAG_BYTES as u64 } else { 0 };
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
    segments.push(data.into());
    Ok(EncodedPayload { envelope: envelope.encode_to_vec().into(), data: segments.into(), raw_bytes, copied_bytes })
}

/// A tensor's `dim_order` is empty or an order of all of its `rank` dimensions.
fn check_dim_order(order: &[u32], rank: usize) -> Result<(), TensorError> {
    let mut seen = vec![false; rank];
    if order.is_empty() || (order.len() == rank && order.iter().all(|&d| (d as usize) < rank && !std::mem::replace(&mut seen[d as usize], true))) {
        Ok(())
    } else {
        Err(TensorError::DimOrder { order: order.to_vec(), rank })
    }
}

/// The one block of a tensor that protocol version 1 compressed whole (it had no blocks).
fn whole_block(carried: u64, wire_len: u64) -> Result<Block, BlockError> {
    match (u32::try_from(carried), u32::try_from(wire_len)) {
        (Ok(raw_len), Ok(wire_len)) => Ok(Block { raw_len, wire_len, stored: false }),
        _ => Err(BlockError::TooLargeForOne { raw: carried, wire: wire_len }),
    }
}

/// A tensor's bytes must be exactly what its dtype and shape take.
fn check_size(t: &TensorData) -> Result<(), CodecError> {
    let fail = |error| CodecError::Encode { name: t.name.clone(), error };
    check_dim_order(&t.dim_order, t.shape.len()).map_err(fail)?;
    let expected = numel(&t.shape).map(|n| n * t.dtype.size() as u64);
    if expected != Some(t.data.len() as u64) {
        return Err(fail(TensorError::DataLength { bytes: t.data.len(), dtype: t.dtype, shape: t.shape.clone() }));
    }
    Ok(())
}

/// Whether a sample of `t` (its first elements, shuffled) compresses with lz4 in any of its
/// planes, as `auto` asks.
fn sample_compresses(t: &TensorData, scratch: &mut Vec<u8>) -> bool {
    let size = t.dtype.size();
    let k = (t.data.len() / size).min(AUTO_SAMPLE_ELEMENTS);
    shuffle(&t.data[..k * size], size, scratch);
    let mut packed = Vec::new();
    scratch.chunks(k.max(1)).any(|plane| {
        packed.clear();
        compress(Compression::Lz4, plane, &mut packed).is_ok() && worth_compressing(plane.len(), packed.len())
    })
}

/// What a tensor's header says about how it was encoded.
#[derive(Default)]
struct EncodedTensor {
    quant: Option<crate::pb::Quantization>,
    blocks: Vec<Block>,
    zeros_elided: bool,
    /// Bytes copied as they were (see [`EncodedPayload::copied_bytes`]).
    copied: u64,
}

/// Precision, zero elision (where it pays), shuffle, compression (in blocks); appends the
/// result to `out`.
fn encode_tensor(t: &TensorData, codec: &Codec, scratch: &mut [Vec<u8>; 2], out: &mut Vec<u8>) -> Result<EncodedTensor, CodecError> {
    let fail = |error: TensorError| CodecError::Encode { name: t.name.clone(), error };
    let (carried, quant) = if codec.precision.casts(t.dtype) {
        let (bytes, quant) = narrow(codec.precision, t.dtype, &t.shape, &t.data).map_err(|e| fail(e.into()))?;
        (std::borrow::Cow::Owned(bytes), quant)
    } else {
        (std::borrow::Cow::Borrowed(&t.data[..]), None)
    };
    let size = codec.precision.carried_size(t.dtype);
    let [shuffled, kept] = scratch;
    if codec.shuffle && size > 1 && codec.compression != Compression::None && zeros::worth_eliding(&carried, size) {
        let mut mask = Vec::new();
        kept.clear();
        zeros::elide(&carried, size, &mut mask, kept);
        shuffle(kept, size, shuffled);
        let mut blocks = compress_blocks(codec.compression, &mask, 1, out).map_err(|e| fail(e.into()))?;
        blocks.extend(compress_blocks(codec.compression, shuffled, size, out).map_err(|e| fail(e.into()))?);
        return Ok(EncodedTensor { quant, copied: stored_bytes(&blocks), blocks, zeros_elided: true });
    }
    let (carried, planes) = if codec.shuffle && size > 1 {
        shuffle(&carried, size, shuffled);
        (&shuffled[..], size)
    } else {
        (&carried[..], 1)
    };
    if codec.compression == Compression::None {
        out.extend_from_slice(carried);
        return Ok(EncodedTensor { quant, copied: carried.len() as u64, ..Default::default() });
    }
    let blocks = compress_blocks(codec.compression, carried, planes, out).map_err(|e| fail(e.into()))?;
    Ok(EncodedTensor { quant, copied: stored_bytes(&blocks), blocks, zeros_elided: false })
}

/// Bytes of the blocks stored as they were.
fn stored_bytes(blocks: &[Block]) -> u64 {
    blocks.iter().filter(|b| b.stored).map(|b| u64::from(b.raw_len)).sum()
}

/// A received envelope whose header passed every check; the data comes next.
#[derive(Debug)]
pub struct IncomingPayload {
    header: PayloadHeader,
    seal: Option<Seal>,
    codec: Codec,
    dtypes: Vec<DType>,
    /// The codec each tensor travels with (the payload's, or what `auto` picked).
    codecs: Vec<Codec>,
}

/// What a decoded payload says about itself; its tensors are in the caller's buffers.
#[derive(Debug, Clone)]
pub struct DecodedHeader {
    /// Request, split and direction, as the (authenticated) header says.
    pub meta: PayloadMeta,
    /// The codec it travelled with.
    pub codec: Codec,
    /// The key id it was sealed with, if it was.
    pub key_id: Option<u32>,
    /// The boundary's value trees.
    pub values: Vec<NamedValue>,
    /// Bytes decoding copied as they were (stored blocks, tensors carried uncompressed).
    pub copied_bytes: u64,
}

/// A decoded payload, its tensors in buffers of their own.
#[derive(Debug, Clone)]
pub struct DecodedPayload {
    /// What it says about itself.
    pub header: DecodedHeader,
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

/// Checks what a tensor's header says of it, the payload's codec being `codec`: its own
/// codec (under `auto`), dtype, shape, dimension order and bytes; with its codec, its dtype
/// and its elements.
fn check_tensor_header(t: &TensorHeader, codec: Codec) -> Result<(Codec, DType, u64), CodecError> {
    let invalid = |error: TensorError| CodecError::InvalidTensor { name: t.name.clone(), error };
    let codec = match (codec.auto, t.codec.as_str()) {
        (false, "") => codec,
        (false, own) => return Err(invalid(TensorError::OwnCodec { own: own.into(), payload: codec.to_string() })),
        (true, own) => match own.parse::<Codec>() {
            Ok(c) if codec.tensor_codecs().contains(&c) => c,
            _ => return Err(invalid(TensorError::NotAutoPick(own.into()))),
        },
    };
    let dtype = DType::from_name(&t.dtype).ok_or_else(|| CodecError::UnknownDtype { name: t.name.clone(), dtype: t.dtype.clone() })?;
    let invalid_shape = || CodecError::InvalidShape { name: t.name.clone(), shape: t.shape.clone() };
    let n = numel(&t.shape).ok_or_else(invalid_shape)?;
    let raw = n.checked_mul(dtype.size() as u64).ok_or_else(invalid_shape)?;
    check_dim_order(&t.dim_order, t.shape.len()).map_err(invalid)?;
    if !t.dim_order.is_empty() && codec.precision == Precision::Int8 && codec.precision.casts(dtype) {
        return Err(invalid(TensorError::Int8NotRowMajor));
    }
    if raw != t.byte_len {
        return Err(CodecError::SizeMismatch { name: t.name.clone(), declared: t.byte_len, expected: format!("{dtype}{:?} needs {raw}", t.shape) });
    }
    Ok((codec, dtype, n))
}

/// Checks how a tensor's data travels with `codec`: zero elision, its compressed blocks (one
/// made for a single unsplit block) or its uncompressed bytes, and its quantisation.
fn check_tensor_data(t: &mut TensorHeader, codec: Codec, dtype: DType, n: u64) -> Result<(), CodecError> {
    let invalid = |error: TensorError| CodecError::InvalidTensor { name: t.name.clone(), error };
    let size = codec.precision.carried_size(dtype) as u64;
    let carried = n * size;
    if t.zeros_elided && !(codec.shuffle && size > 1 && codec.compression != Compression::None) {
        return Err(invalid(TensorError::ZerosElided(codec.to_string())));
    }
    if codec.compression == Compression::None {
        if !t.blocks.is_empty() {
            return Err(invalid(TensorError::BlocksWithoutCompression));
        }
        if t.wire_len != carried {
            return Err(CodecError::SizeMismatch { name: t.name.clone(), declared: t.wire_len, expected: format!("uncompressed it is {carried}") });
        }
    } else {
        if t.blocks.is_empty() && !t.zeros_elided && carried > 0 {
            let block = whole_block(carried, t.wire_len).map_err(|e| invalid(e.into()))?;
            t.blocks.push(block);
        }
        for (i, block) in t.blocks.iter().enumerate() {
            check_block(codec.compression, block).map_err(|error| invalid(TensorError::Block { index: i, error }))?;
        }
        let raw: u64 = t.blocks.iter().map(|b| u64::from(b.raw_len)).sum();
        let wire: u64 = t.blocks.iter().map(|b| u64::from(b.wire_len)).sum();
        // Zeros elided, the carried bytes are a mask and some of the elements.
        let mask = zeros::mask_len(n as usize) as u64;
        let fits = if t.zeros_elided { raw >= mask && raw - mask <= carried && (raw - mask).is_multiple_of(size) } else { raw == carried };
        if !fits || wire != t.wire_len {
            let carries = if t.zeros_elided { format!("a {mask}-byte mask and at most {carried} bytes") } else { format!("{carried} bytes") };
            return Err(invalid(TensorError::BlocksDoNotFit { raw, wire, carries, wire_len: t.wire_len }));
        }
    }
    let quantised = codec.precision == Precision::Int8 && codec.precision.casts(dtype);
    if quantised != t.quant.is_some() {
        return Err(invalid(TensorError::Quantisation { expected: quantised }));
    }
    Ok(())
}

impl IncomingPayload {
    /// Reads and checks an envelope: direction, codec against `policy`, sealing (key, nonce
    /// order, the header's tag), and every declared size against dtype x shape and `limit`
    /// (which bounds the tensor bytes rebuilt, and so what is allocated).
    pub fn parse(envelope: &[u8], expected: Direction, limit: u64, policy: &CodecPolicy, opener: &Opener) -> Result<Self, CodecError> {
        let envelope = PayloadEnvelope::decode(envelope).map_err(CodecError::Envelope)?;
        match &envelope.seal {
            None if policy.require_encryption => return Err(CodecError::NotSealed),
            None => {}
            Some(seal) if !opener.has_keys() => return Err(CodecError::NoKeys { id: seal.key_id }),
            // Authenticate the header before believing anything it says.
            Some(seal) => opener.check_header(seal, &envelope.header, &envelope.header_tag)?,
        }
        let mut header = PayloadHeader::decode(&envelope.header[..]).map_err(CodecError::Header)?;
        let direction = Direction::try_from(header.direction).unwrap_or(Direction::Unspecified);
        if direction != expected {
            return Err(CodecError::WrongDirection { expected: direction_name(expected), got: direction_name(direction).into() });
        }
        let codec: Codec = header.codec.parse().map_err(|reason| CodecError::CodecRefused { codec: header.codec.clone(), reason })?;
        policy.check(&codec).map_err(|error| CodecError::CodecNotAccepted { codec: header.codec.clone(), error })?;
        let mut raw_total = 0u64;
        let mut wire_total = 0u64;
        let mut dtypes = Vec::with_capacity(header.tensors.len());
        let mut codecs = Vec::with_capacity(header.tensors.len());
        for t in &mut header.tensors {
            let (codec, dtype, n) = check_tensor_header(t, codec)?;
            // The header checked, its bytes are its elements' (`t.byte_len`).
            raw_total = raw_total.saturating_add(t.byte_len);
            if raw_total > limit {
                return Err(CodecError::PayloadTooLarge { declared: raw_total, limit });
            }
            check_tensor_data(t, codec, dtype, n)?;
            wire_total += t.wire_len;
            dtypes.push(dtype);
            codecs.push(codec);
        }
        let tag = if envelope.seal.is_some() { TAG_BYTES as u64 } else { 0 };
        if wire_total + tag != header.wire_len {
            return Err(CodecError::WireLength { tensors: wire_total, tagged: tag > 0, declared: header.wire_len });
        }
        Ok(Self { header, seal: envelope.seal, codec, dtypes, codecs })
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

    /// Each declared tensor's order of dimensions in memory (empty: row-major), in header order.
    pub fn dim_orders(&self) -> impl Iterator<Item = &[u32]> {
        self.header.tensors.iter().map(|t| t.dim_order.as_slice())
    }

    /// Tensor bytes the payload rebuilds.
    pub fn raw_len(&self) -> u64 {
        self.header.tensors.iter().map(|t| t.byte_len).sum()
    }

    /// Whether the data is the tensors' bytes as they are (every tensor raw, not sealed): its
    /// receiver may copy it straight into the tensors' buffers, then call
    /// [`IncomingPayload::check_verbatim`].
    pub fn is_verbatim(&self) -> bool {
        self.seal.is_none() && self.codecs.iter().all(|c| *c == Codec::RAW)
    }

    /// Finishes a verbatim payload whose data the caller copied into `tensors` (one buffer
    /// per tensor, in header order, each of its declared size): checks what the bytes of each
    /// dtype may hold.
    pub fn check_verbatim(self, tensors: &[&[u8]]) -> Result<DecodedHeader, CodecError> {
        if !self.is_verbatim() {
            return Err(CodecError::Misused(Misuse::NotVerbatim { codec: self.codec.to_string(), sealed: self.seal.is_some() }));
        }
        self.check_buffers(tensors.iter().map(|b| b.len()))?;
        for ((t, &dtype), bytes) in self.header.tensors.iter().zip(&self.dtypes).zip(tensors) {
            check_values(dtype, bytes).map_err(|error| CodecError::Corrupt { name: t.name.clone(), error })?;
        }
        Ok(self.into_header())
    }

    /// Whether the data is one raw tensor's bytes, sealed, then the seal's tag: its receiver
    /// may copy the ciphertext straight into the tensor's buffer and the tag aside, then call
    /// [`IncomingPayload::open_verbatim`]. (AES-GCM opens one contiguous buffer, so a sealed
    /// payload of several tensors is opened in a buffer of its own and decoded from there.)
    pub fn opens_in_tensor(&self) -> bool {
        self.seal.is_some() && self.codecs == [Codec::RAW]
    }

    /// Finishes a payload that [opens in its tensor](IncomingPayload::opens_in_tensor): the
    /// caller copied the ciphertext into `tensor` (of its declared size) and the last
    /// [`TAG_BYTES`] of the data into `tag`. Authenticates and decrypts it in place, then
    /// checks what the bytes of its dtype may hold.
    pub fn open_verbatim(self, opener: &mut Opener, tensor: &mut [u8], tag: &[u8]) -> Result<DecodedHeader, CodecError> {
        let Some(seal) = self.seal.as_ref().filter(|_| self.opens_in_tensor()) else {
            return Err(CodecError::Misused(Misuse::NotInItsTensor { codec: self.codec.to_string(), tensors: self.codecs.len() }));
        };
        self.check_buffers(std::iter::once(tensor.len()))?;
        opener.open_detached(seal, tensor, tag)?;
        check_values(self.dtypes[0], tensor).map_err(|error| CodecError::Corrupt { name: self.header.tensors[0].name.clone(), error })?;
        Ok(self.into_header())
    }

    /// Authenticates and decrypts `data` (when sealed, in place) and decodes every tensor into
    /// its buffer in `tensors` (one per tensor, in header order, each of its declared size).
    pub fn decode_into(self, data: &mut [u8], opener: &mut Opener, tensors: &mut [&mut [u8]]) -> Result<DecodedHeader, CodecError> {
        if data.len() as u64 != self.header.wire_len {
            return Err(CodecError::Truncated { expected: self.header.wire_len, got: data.len() as u64 });
        }
        self.check_buffers(tensors.iter().map(|b| b.len()))?;
        if let Some(seal) = &self.seal {
            opener.open_in_place(seal, data)?;
        }
        let (mut offset, mut scratch, mut copied) = (0usize, Default::default(), 0);
        for (((t, &dtype), codec), out) in self.header.tensors.iter().zip(&self.dtypes).zip(&self.codecs).zip(tensors.iter_mut()) {
            let end = offset + t.wire_len as usize;
            copied += decode_tensor(t, dtype, codec, &data[offset..end], &mut scratch, out)
                .map_err(|error| CodecError::Corrupt { name: t.name.clone(), error })?;
            offset = end;
        }
        Ok(DecodedHeader { copied_bytes: copied, ..self.into_header() })
    }

    /// [`IncomingPayload::decode_into`] buffers of its own.
    pub fn decode(self, mut data: Vec<u8>, opener: &mut Opener) -> Result<DecodedPayload, CodecError> {
        let mut buffers: Vec<Vec<u8>> = self.header.tensors.iter().map(|t| vec![0; t.byte_len as usize]).collect();
        let names: Vec<(String, DType, Vec<i64>, Vec<u32>)> =
            self.header.tensors.iter().zip(&self.dtypes).map(|(t, &dtype)| (t.name.clone(), dtype, t.shape.clone(), t.dim_order.clone())).collect();
        let header = self.decode_into(&mut data, opener, &mut buffers.iter_mut().map(Vec::as_mut_slice).collect::<Vec<_>>())?;
        let tensors = names
            .into_iter()
            .zip(buffers)
            .map(|((name, dtype, shape, dim_order), data)| TensorData { name, dtype, shape, dim_order, data: data.into() })
            .collect();
        Ok(DecodedPayload { header, tensors })
    }

    /// The caller's buffers must be one per tensor, each of its declared size (a bug on the
    /// receiving side otherwise, never the peer's: the sizes were checked in `parse`).
    fn check_buffers(&self, lens: impl ExactSizeIterator<Item = usize>) -> Result<(), CodecError> {
        let declared: Vec<usize> = self.header.tensors.iter().map(|t| t.byte_len as usize).collect();
        let given: Vec<usize> = lens.collect();
        if given != declared {
            return Err(CodecError::Misused(Misuse::Buffers { given, declared }));
        }
        Ok(())
    }

    fn into_header(self) -> DecodedHeader {
        let h = self.header;
        DecodedHeader {
            meta: PayloadMeta { request_id: h.request_id, split: h.split, direction: Direction::try_from(h.direction).unwrap_or_default() },
            codec: self.codec,
            key_id: self.seal.as_ref().map(|s| s.key_id),
            values: h.values,
            copied_bytes: 0,
        }
    }
}

/// What decoded bytes of `dtype` may hold: a bool is 0 or 1.
fn check_values(dtype: DType, bytes: &[u8]) -> Result<(), TensorError> {
    if dtype == DType::Bool {
        if let Some(index) = bytes.iter().position(|&b| b > 1) {
            return Err(TensorError::NotBool { index, value: bytes[index] });
        }
    }
    Ok(())
}

/// Decompress, unshuffle, restore zeros, widen: the encoded bytes of one tensor (sizes
/// checked in `parse`) back to its dtype, in `out`. The last step writes into `out`, earlier
/// ones into `scratch`. Returns the bytes it copied as they were: stored blocks, and the
/// bytes of a tensor carried uncompressed or widened in a buffer of its own.
fn decode_tensor(
    t: &TensorHeader,
    dtype: DType,
    codec: &Codec,
    encoded: &[u8],
    scratch: &mut [Vec<u8>; 3],
    out: &mut [u8],
) -> Result<u64, TensorError> {
    let stored = stored_bytes(&t.blocks);
    let size = codec.precision.carried_size(dtype);
    let n = t.byte_len as usize / dtype.size();
    let carried_len = n * size;
    let (shuffled, casts) = (codec.shuffle && size > 1, codec.precision.casts(dtype));
    let [a, b, c] = scratch;
    if t.zeros_elided {
        let packed_len = t.blocks.iter().map(|b| b.raw_len as usize).sum();
        decompress_blocks(codec.compression, &t.blocks, encoded, sized(a, packed_len))?;
        let (mask, kept) = a.split_at(zeros::mask_len(n));
        unshuffle_into(kept, size, sized(b, kept.len()));
        if !casts {
            zeros::restore(mask, b, size, out)?;
            return check_values(dtype, out).map(|()| stored);
        }
        zeros::restore(mask, b, size, sized(c, carried_len))?;
        out.copy_from_slice(&widen(codec.precision, dtype, &t.shape, c, t.quant.as_ref())?);
        return check_values(dtype, out).map(|()| stored + out.len() as u64);
    }
    let mut carried = encoded;
    if codec.compression != Compression::None {
        if !shuffled && !casts {
            decompress_blocks(codec.compression, &t.blocks, encoded, out)?;
            return check_values(dtype, out).map(|()| stored);
        }
        decompress_blocks(codec.compression, &t.blocks, encoded, sized(a, carried_len))?;
        carried = a;
    }
    if shuffled {
        if !casts {
            unshuffle_into(carried, size, out);
            return check_values(dtype, out).map(|()| stored);
        }
        unshuffle_into(carried, size, sized(b, carried_len));
        carried = b;
    }
    if casts {
        out.copy_from_slice(&widen(codec.precision, dtype, &t.shape, carried, t.quant.as_ref())?);
    } else {
        out.copy_from_slice(carried);
    }
    check_values(dtype, out).map(|()| stored + out.len() as u64)
}

/// `buffer` as `len` bytes (stale contents kept where it was already that long).
fn sized(buffer: &mut Vec<u8>, len: usize) -> &mut [u8] {
    buffer.resize(len, 0);
    &mut buffer[..len]
}
