//! Boundaries on the wire: a header (value tree and tensor metadata) plus the tensors' raw
//! bytes, split into frames no larger than a chunk and reassembled with bounded memory.
//!
//! Everything decoded here comes from the network and is untrusted: every declared size is
//! checked against dtype x shape and against the payload limit before anything is allocated,
//! and every tensor the tree names must be in the header exactly once.

use std::collections::HashMap;

use bytes::Bytes;
use tch::Tensor;

use crate::pb;
use crate::spec::DType;
use crate::value::{Boundary, Value};

/// What can be wrong with a payload that arrived from the network.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum WireError {
    /// The first frame of a request or result has no header.
    #[error("the first frame of request {0} has no boundary header")]
    MissingHeader(u64),
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
    /// A declared byte length that is not dtype size x element count.
    #[error("tensor {name}: declared {declared} bytes, but {dtype}{shape:?} needs {expected}")]
    SizeMismatch {
        /// Tensor name.
        name: String,
        /// The dtype.
        dtype: String,
        /// The shape.
        shape: Vec<i64>,
        /// Bytes declared.
        declared: u64,
        /// Bytes dtype x shape needs.
        expected: u64,
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
    /// More bytes arrived than the header declared.
    #[error("payload overrun: more than the {expected} declared bytes arrived")]
    Overrun {
        /// Bytes declared.
        expected: u64,
    },
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
}

/// A boundary ready to send: its header and its tensors' bytes.
#[derive(Debug, Clone)]
pub struct EncodedBoundary {
    /// Value tree and tensor metadata.
    pub header: pb::BoundaryHeader,
    /// The tensors' bytes, concatenated in header order.
    pub data: Bytes,
}

/// Serialises a boundary (tensors are copied to the CPU and made contiguous).
pub fn encode_boundary(boundary: &Boundary) -> EncodedBoundary {
    let mut tensors = Vec::new();
    let mut data = Vec::with_capacity(boundary.tensor_bytes());
    let values = boundary
        .values
        .iter()
        .map(|(name, value)| pb::NamedValue { name: name.clone(), value: Some(encode_value(value, name, &mut tensors, &mut data)) })
        .collect();
    EncodedBoundary { header: pb::BoundaryHeader { values, tensors }, data: Bytes::from(data) }
}

fn encode_value(value: &Value, path: &str, tensors: &mut Vec<pb::TensorHeader>, data: &mut Vec<u8>) -> pb::ValueNode {
    use pb::value_node::Kind;
    let list = |items: &[Value], tensors: &mut Vec<pb::TensorHeader>, data: &mut Vec<u8>| pb::ValueList {
        items: items.iter().enumerate().map(|(i, v)| encode_value(v, &format!("{path}.{i}"), tensors, data)).collect(),
    };
    let kind = match value {
        Value::Tensor(t) => {
            let t = t.to_device(tch::Device::Cpu).contiguous();
            let dtype = DType::from_kind(t.kind()).map_or("unsupported", DType::name);
            let len = t.numel() * t.kind().elt_size_in_bytes();
            let start = data.len();
            data.resize(start + len, 0);
            t.copy_data_u8(&mut data[start..], t.numel());
            tensors.push(pb::TensorHeader { name: path.to_string(), dtype: dtype.to_string(), shape: t.size(), byte_len: len as u64 });
            Kind::Tensor(path.to_string())
        }
        Value::Int(i) => Kind::Int(*i),
        Value::Float(f) => Kind::Float(*f),
        Value::Bool(b) => Kind::Bool(*b),
        Value::Str(s) => Kind::Str(s.clone()),
        Value::None => Kind::None(true),
        Value::Tuple(items) => Kind::Tuple(list(items, tensors, data)),
        Value::List(items) => Kind::List(list(items, tensors, data)),
        Value::Dict(items) => Kind::Dict(pb::ValueDict {
            entries: items
                .iter()
                .map(|(k, v)| pb::DictEntry { key: k.clone(), value: Some(encode_value(v, &format!("{path}.{k}"), tensors, data)) })
                .collect(),
        }),
    };
    pb::ValueNode { kind: Some(kind) }
}

/// Checks a header's declared sizes against dtype x shape and `limit`; returns the total.
/// Call this before allocating anything for the payload.
pub fn declared_payload_bytes(header: &pb::BoundaryHeader, limit: u64) -> Result<u64, WireError> {
    let mut total: u64 = 0;
    for t in &header.tensors {
        let dtype = parse_dtype(t)?;
        let invalid = || WireError::InvalidShape { name: t.name.clone(), shape: t.shape.clone() };
        let mut expected = dtype.size() as u64;
        for &d in &t.shape {
            let d = u64::try_from(d).map_err(|_| invalid())?;
            expected = expected.checked_mul(d).ok_or_else(invalid)?;
        }
        if expected != t.byte_len {
            return Err(WireError::SizeMismatch {
                name: t.name.clone(),
                dtype: t.dtype.clone(),
                shape: t.shape.clone(),
                declared: t.byte_len,
                expected,
            });
        }
        total = total.checked_add(expected).ok_or(WireError::PayloadTooLarge { declared: u64::MAX, limit })?;
        if total > limit {
            return Err(WireError::PayloadTooLarge { declared: total, limit });
        }
    }
    Ok(total)
}

fn parse_dtype(t: &pb::TensorHeader) -> Result<DType, WireError> {
    serde_json::from_value(serde_json::Value::String(t.dtype.clone()))
        .map_err(|_| WireError::UnknownDtype { name: t.name.clone(), dtype: t.dtype.clone() })
}

/// Rebuilds a boundary from a header and its complete payload.
pub fn decode_boundary(header: &pb::BoundaryHeader, data: &[u8], limit: u64) -> Result<Boundary, WireError> {
    let total = declared_payload_bytes(header, limit)?;
    if (data.len() as u64) < total {
        return Err(WireError::Truncated { expected: total, got: data.len() as u64 });
    }
    if (data.len() as u64) > total {
        return Err(WireError::Overrun { expected: total });
    }
    let mut tensors = HashMap::new();
    let mut offset = 0usize;
    for t in &header.tensors {
        let dtype = parse_dtype(t)?;
        let len = t.byte_len as usize;
        let tensor = Tensor::from_data_size(&data[offset..offset + len], &t.shape, dtype.kind());
        offset += len;
        if tensors.insert(t.name.clone(), tensor).is_some() {
            return Err(WireError::BadTree(format!("tensor {} appears twice in the header", t.name)));
        }
    }
    let values = header
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
    Ok(Boundary { values })
}

/// Deepest value tree accepted (a hostile tree must not exhaust the stack).
const MAX_TREE_DEPTH: usize = 32;

fn decode_value(node: &pb::ValueNode, tensors: &mut HashMap<String, Tensor>, depth: usize) -> Result<Value, WireError> {
    use pb::value_node::Kind;
    if depth > MAX_TREE_DEPTH {
        return Err(WireError::BadTree(format!("deeper than {MAX_TREE_DEPTH} levels")));
    }
    let items = |list: &pb::ValueList, tensors: &mut HashMap<String, Tensor>| {
        list.items.iter().map(|n| decode_value(n, tensors, depth + 1)).collect::<Result<Vec<_>, _>>()
    };
    Ok(match node.kind.as_ref().ok_or_else(|| WireError::BadTree("a node has no value".into()))? {
        Kind::Tensor(name) => Value::Tensor(
            tensors.remove(name).ok_or_else(|| WireError::BadTree(format!("tensor {name} is not in the header (or is named twice)")))?,
        ),
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

/// Tensor bytes per frame under a gRPC message limit (room is left for the header).
pub fn chunk_bytes_for(max_message_bytes: u64) -> usize {
    max_message_bytes.saturating_sub(64 << 10).max(4096) as usize
}

/// Splits a payload into chunks of at most `chunk_bytes` (at least one, possibly empty).
pub fn chunks(data: &Bytes, chunk_bytes: usize) -> Vec<Bytes> {
    if data.is_empty() {
        return vec![Bytes::new()];
    }
    (0..data.len()).step_by(chunk_bytes.max(1)).map(|start| data.slice(start..(start + chunk_bytes).min(data.len()))).collect()
}

/// Collects the frames of one payload. Memory is reserved once, for the size the header
/// declares (already checked against the limit), and never grows past it.
#[derive(Debug)]
pub struct Reassembly {
    /// The request the frames belong to.
    pub request_id: u64,
    /// The header from the first frame.
    pub header: pb::BoundaryHeader,
    expected: u64,
    limit: u64,
    data: Vec<u8>,
}

impl Reassembly {
    /// Starts from the first frame's header; checks declared sizes against `limit`.
    pub fn start(request_id: u64, header: Option<pb::BoundaryHeader>, limit: u64) -> Result<Self, WireError> {
        let header = header.ok_or(WireError::MissingHeader(request_id))?;
        let expected = declared_payload_bytes(&header, limit)?;
        Ok(Self { request_id, header, expected, limit, data: Vec::with_capacity(expected as usize) })
    }

    /// Adds a frame's bytes; a frame of another request is an error.
    pub fn push(&mut self, request_id: u64, bytes: &[u8]) -> Result<(), WireError> {
        if request_id != self.request_id {
            return Err(WireError::Interleaved { expected: self.request_id, got: request_id });
        }
        if self.data.len() as u64 + bytes.len() as u64 > self.expected {
            return Err(WireError::Overrun { expected: self.expected });
        }
        self.data.extend_from_slice(bytes);
        Ok(())
    }

    /// Decodes the complete payload.
    pub fn finish(self) -> Result<Boundary, WireError> {
        decode_boundary(&self.header, &self.data, self.limit)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
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

    #[test]
    fn round_trip_is_bit_exact_through_chunks() {
        let boundary = sample();
        let enc = encode_boundary(&boundary);
        let mut re = Reassembly::start(9, Some(enc.header.clone()), 1 << 20).unwrap();
        let parts = chunks(&enc.data, 7);
        assert!(parts.len() > 10);
        for part in &parts {
            re.push(9, part).unwrap();
        }
        let back = re.finish().unwrap();
        assert!(back.bit_identical(&boundary));
        let names: Vec<_> = back.values.iter().map(|(n, v)| format!("{n}:{}", v.describe())).collect();
        assert_eq!(names, ["x:float32[3, 4, 5]", "pair:tuple of 2", "d:dict of 2", "h:bfloat16[2, 3]", "e:float32[0, 7]", "s:list of 3"]);
        match &back.values[1].1 {
            Value::Tuple(items) => assert!(matches!(items[1], Value::Int(-7))),
            other => panic!("{}", other.describe()),
        }
    }

    #[test]
    fn declared_sizes_are_checked_before_allocation() {
        let mut enc = encode_boundary(&sample());
        enc.header.tensors[0].byte_len += 4;
        assert!(matches!(declared_payload_bytes(&enc.header, u64::MAX), Err(WireError::SizeMismatch { .. })));
        let mut enc = encode_boundary(&sample());
        enc.header.tensors[0].shape = vec![i64::MAX, i64::MAX];
        assert!(matches!(declared_payload_bytes(&enc.header, u64::MAX), Err(WireError::InvalidShape { .. })));
        let mut enc = encode_boundary(&sample());
        enc.header.tensors[0].shape[0] = -1;
        assert!(matches!(declared_payload_bytes(&enc.header, u64::MAX), Err(WireError::InvalidShape { .. })));
        let mut enc = encode_boundary(&sample());
        enc.header.tensors[0].dtype = "complex32".into();
        assert!(matches!(declared_payload_bytes(&enc.header, u64::MAX), Err(WireError::UnknownDtype { .. })));
        let enc = encode_boundary(&sample());
        let err = Reassembly::start(1, Some(enc.header), 100).unwrap_err();
        assert!(matches!(err, WireError::PayloadTooLarge { limit: 100, .. }), "{err}");
        assert_eq!(Reassembly::start(1, None, 100).unwrap_err(), WireError::MissingHeader(1));
    }

    #[test]
    fn truncated_overrun_and_interleaved_payloads_are_errors() {
        let enc = encode_boundary(&sample());
        let n = enc.data.len();
        let mut re = Reassembly::start(1, Some(enc.header.clone()), u64::MAX).unwrap();
        re.push(1, &enc.data[..n - 1]).unwrap();
        assert!(matches!(re.finish(), Err(WireError::Truncated { .. })));
        let mut re = Reassembly::start(1, Some(enc.header.clone()), u64::MAX).unwrap();
        re.push(1, &enc.data).unwrap();
        assert!(matches!(re.push(1, &[0]), Err(WireError::Overrun { .. })));
        let mut re = Reassembly::start(1, Some(enc.header), u64::MAX).unwrap();
        assert_eq!(re.push(2, &enc.data[..1]), Err(WireError::Interleaved { expected: 1, got: 2 }));
    }

    #[test]
    fn value_trees_must_name_each_tensor_once() {
        let mut enc = encode_boundary(&sample());
        enc.header.values[0].value = Some(pb::ValueNode { kind: Some(pb::value_node::Kind::Tensor("nope".into())) });
        let err = decode_boundary(&enc.header, &enc.data, u64::MAX).unwrap_err();
        assert!(err.to_string().contains("tensor nope is not in the header"), "{err}");
        let mut enc = encode_boundary(&sample());
        enc.header.values.remove(0);
        let err = decode_boundary(&enc.header, &enc.data, u64::MAX).unwrap_err();
        assert!(err.to_string().contains("tensor x is in the header but not in the value tree"), "{err}");
        let mut node = pb::ValueNode { kind: Some(pb::value_node::Kind::Int(1)) };
        for _ in 0..40 {
            node = pb::ValueNode { kind: Some(pb::value_node::Kind::List(pb::ValueList { items: vec![node] })) };
        }
        let header = pb::BoundaryHeader { values: vec![pb::NamedValue { name: "deep".into(), value: Some(node) }], tensors: vec![] };
        assert!(decode_boundary(&header, &[], 0).unwrap_err().to_string().contains("deeper than"));
    }
}
