//! Valid payloads, then mutated: the first input byte picks a codec, fixed tensors (every
//! kind of dtype, post-ReLU-like floats with exact zeros) are encoded with it, unsealed (a
//! sealed payload would stop at authentication), and the rest of the input is a list of
//! mutations of the header's fields (lengths, shapes, dtypes, the codec, quantisation
//! parameters, tensor order) and of the data. The result goes through
//! `IncomingPayload::parse` and `decode`, which must not panic; what decodes must have the
//! declared sizes; and an unmutated payload must decode, bit for bit when lossless.

#![no_main]

use std::sync::OnceLock;

use cleave_codec::pb::{PayloadEnvelope, PayloadHeader, Quantization};
use cleave_codec::{encode_payload, Codec, CodecPolicy, Compression, DType, Direction, EncodedPayload, IncomingPayload, KeyRing, PayloadMeta, Precision, TensorData};
use libfuzzer_sys::arbitrary::{Result, Unstructured};
use libfuzzer_sys::fuzz_target;
use prost::Message;

const LIMIT: u64 = 1 << 20;

fn codecs() -> Vec<Codec> {
    let mut codecs = Vec::new();
    for precision in Precision::ALL {
        for shuffle in [false, true] {
            for compression in [Compression::None, Compression::Lz4, Compression::Zstd(-1), Compression::Zstd(1), Compression::Zstd(3)] {
                codecs.push(Codec { precision, shuffle, compression, auto: false });
            }
        }
    }
    codecs
}

fn tensors() -> Vec<TensorData> {
    let floats: Vec<f32> = (0..2 * 3 * 4 * 5).map(|i| ((i as f32 * 0.37).sin() * 3.0).max(0.0)).collect();
    let doubles: Vec<f64> = (0..12).map(|i| (i as f64 - 5.5) * 1e3).collect();
    let halves: Vec<u8> = (0..6u16).flat_map(|i| (0x3C00 + i * 0x101).to_le_bytes()).collect();
    vec![
        TensorData { dim_order: Vec::new(), name: "x".into(), dtype: DType::Float32, shape: vec![2, 3, 4, 5], data: floats.iter().flat_map(|v| v.to_le_bytes()).collect() },
        TensorData { dim_order: Vec::new(), name: "idx".into(), dtype: DType::Int64, shape: vec![7], data: (0..7i64).flat_map(|v| (v * 1000 - 3).to_le_bytes()).collect() },
        TensorData { dim_order: Vec::new(), name: "mask".into(), dtype: DType::Bool, shape: vec![2, 5], data: (0..10).map(|i| (i % 3 == 0) as u8).collect() },
        TensorData { dim_order: Vec::new(), name: "d".into(), dtype: DType::Float64, shape: vec![3, 4], data: doubles.iter().flat_map(|v| v.to_le_bytes()).collect() },
        TensorData { dim_order: Vec::new(), name: "h".into(), dtype: DType::Float16, shape: vec![6], data: halves.into() },
        TensorData { dim_order: Vec::new(), name: "s".into(), dtype: DType::Float32, shape: vec![], data: 2.5f32.to_le_bytes().to_vec().into() },
    ]
}

/// Every codec's payload of the fixed tensors, encoded once.
fn payloads() -> &'static [(Codec, EncodedPayload)] {
    static PAYLOADS: OnceLock<Vec<(Codec, EncodedPayload)>> = OnceLock::new();
    PAYLOADS.get_or_init(|| {
        let meta = PayloadMeta { request_id: 1, split: 2, direction: Direction::Request };
        codecs().into_iter().map(|c| (c, encode_payload(meta, Vec::new(), &tensors(), &c, None).expect("the fixed tensors encode"))).collect()
    })
}

const DTYPE_NAMES: [&str; 11] = ["float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool", "complex64"];

/// Applies one mutation chosen by the input.
fn mutate(u: &mut Unstructured<'_>, header: &mut PayloadHeader, data: &mut Vec<u8>) -> Result<()> {
    let op: u8 = u.arbitrary()?;
    let n = header.tensors.len();
    let pick = |u: &mut Unstructured<'_>| -> Result<Option<usize>> { Ok(if n == 0 { None } else { Some(u.choose_index(n)?) }) };
    match op % 18 {
        0 => {
            if let Some(i) = pick(u)? {
                let t = &mut header.tensors[i];
                t.wire_len = if u.arbitrary()? { u.arbitrary()? } else { t.wire_len.wrapping_add(i64::from(u.arbitrary::<i8>()?) as u64) };
            }
        }
        1 => {
            if let Some(i) = pick(u)? {
                header.tensors[i].byte_len = u.arbitrary()?;
            }
        }
        2 => {
            if let Some(i) = pick(u)? {
                let shape = &mut header.tensors[i].shape;
                match u.choose_index(4)? {
                    0 => shape.push(u.int_in_range(-2..=70)?),
                    1 => {
                        shape.pop();
                    }
                    2 if !shape.is_empty() => {
                        let j = u.choose_index(shape.len())?;
                        shape[j] = u.int_in_range(-2..=70)?;
                    }
                    _ => {
                        if let Some(d) = shape.first_mut() {
                            *d = u.arbitrary()?;
                        }
                    }
                }
            }
        }
        3 => {
            if let Some(i) = pick(u)? {
                header.tensors[i].dtype = u.choose(&DTYPE_NAMES)?.to_string();
            }
        }
        4 => header.codec = u.choose(&codecs())?.to_string(),
        5 => header.wire_len = if u.arbitrary()? { u.arbitrary()? } else { header.wire_len.wrapping_add(i64::from(u.arbitrary::<i8>()?) as u64) },
        6 => {
            if let Some(i) = pick(u)? {
                let t = &mut header.tensors[i];
                match u.choose_index(6)? {
                    0 => t.quant = None,
                    1 => t.quant = Some(Quantization { axis: u.int_in_range(-2..=3)?, scale: vec![1.0; u.int_in_range(0..=8)?], zero_point: vec![0; u.int_in_range(0..=8)?] }),
                    2 => {
                        if let Some(q) = t.quant.as_mut() {
                            q.axis = u.arbitrary()?;
                        }
                    }
                    3 => {
                        if let Some(q) = t.quant.as_mut().filter(|q| !q.scale.is_empty()) {
                            let j = u.choose_index(q.scale.len())?;
                            q.scale[j] = f32::from_bits(u.arbitrary()?);
                        }
                    }
                    4 => {
                        if let Some(q) = t.quant.as_mut().filter(|q| !q.zero_point.is_empty()) {
                            let j = u.choose_index(q.zero_point.len())?;
                            q.zero_point[j] = u.arbitrary()?;
                        }
                    }
                    _ => {
                        if let Some(q) = t.quant.as_mut() {
                            q.scale.push(u.arbitrary()?);
                            q.zero_point.push(u.int_in_range(-128..=127)?);
                        }
                    }
                }
            }
        }
        7 => {
            if !data.is_empty() {
                let j = u.choose_index(data.len())?;
                data[j] ^= u.arbitrary::<u8>()?.max(1);
            }
        }
        8 => {
            if !data.is_empty() {
                let j = u.choose_index(data.len())?;
                let len = u.int_in_range(1..=16)?.min(data.len() - j);
                let bytes = u.bytes(len)?;
                data[j..j + bytes.len()].copy_from_slice(bytes);
            }
        }
        9 => {
            let len = u.int_in_range(0..=data.len() + 64)?;
            data.resize(len, u.arbitrary()?);
        }
        10 => {
            if let Some(i) = pick(u)? {
                match u.choose_index(3)? {
                    0 => {
                        header.tensors.remove(i);
                    }
                    1 => {
                        let j = u.choose_index(n)?;
                        header.tensors.swap(i, j);
                    }
                    _ => header.tensors.push(header.tensors[i].clone()),
                }
            }
        }
        11 => header.direction = u.int_in_range(-1..=4)?,
        12 => {
            // Consistent totals: the payload's length is the data's, the last tensor takes the rest.
            header.wire_len = data.len() as u64;
            let others = header.tensors.iter().rev().skip(1).fold(0u64, |sum, t| sum.saturating_add(t.wire_len));
            if let Some(last) = header.tensors.last_mut() {
                last.wire_len = (data.len() as u64).saturating_sub(others);
            }
        }
        13 => {
            // A byte length that fits the (possibly mutated) dtype and shape.
            if let Some(i) = pick(u)? {
                let t = &mut header.tensors[i];
                let size = DType::from_name(&t.dtype).map_or(4, DType::size) as u64;
                t.byte_len = t.shape.iter().try_fold(size, |acc, &d| acc.checked_mul(u64::try_from(d).ok()?)).unwrap_or(0);
            }
        }
        14 => {
            let j = u.int_in_range(0..=data.len())?;
            let len = u.int_in_range(1..=16)?;
            let bytes = u.bytes(len)?.to_vec();
            data.splice(j..j, bytes);
        }
        15 => {
            if !data.is_empty() {
                let j = u.choose_index(data.len())?;
                let k = u.int_in_range(j..=data.len())?;
                data.drain(j..k);
            }
        }
        16 => header.tensors.iter_mut().for_each(|t| t.quant = None),
        _ => {
            // Another codec's data under this header: decode its bytes as if they were ours.
            let (_, other) = u.choose(payloads())?;
            *data = other.data.to_vec();
        }
    }
    Ok(())
}

fuzz_target!(|input: &[u8]| {
    let Some((&choice, rest)) = input.split_first() else { return };
    let (codec, enc) = &payloads()[usize::from(choice) % payloads().len()];
    let envelope = PayloadEnvelope::decode(&enc.envelope[..]).expect("our own envelope");
    let mut header = PayloadHeader::decode(&envelope.header[..]).expect("our own header");
    let mut data = enc.data.to_vec();
    let mut u = Unstructured::new(rest);
    let mut mutations = 0;
    while !u.is_empty() && mutate(&mut u, &mut header, &mut data).is_ok() {
        mutations += 1;
    }
    let envelope = PayloadEnvelope { header: header.encode_to_vec().into(), ..envelope };
    let mut opener = KeyRing::default().opener();
    let parsed = IncomingPayload::parse(&envelope.encode_to_vec(), Direction::Request, LIMIT, &CodecPolicy::default(), &opener);
    let decoded = parsed.and_then(|incoming| incoming.decode(data, &mut opener));
    if mutations == 0 {
        let decoded = decoded.unwrap_or_else(|e| panic!("an unmutated {codec} payload fails: {e}"));
        for (a, b) in tensors().iter().zip(&decoded.tensors) {
            assert_eq!((&a.name, a.dtype, &a.shape), (&b.name, b.dtype, &b.shape));
            if !codec.precision.casts(a.dtype) {
                assert_eq!(a.data, b.data, "{} changed under {codec}", a.name);
            }
        }
        return;
    }
    if let Ok(decoded) = decoded {
        for t in &decoded.tensors {
            let numel: u64 = t.shape.iter().map(|&d| u64::try_from(d).expect("a checked dimension")).product();
            assert_eq!(t.data.len() as u64, numel * t.dtype.size() as u64, "{} decoded to the wrong size", t.name);
            if t.dtype == DType::Bool {
                assert!(t.data.iter().all(|&b| b <= 1), "{}: a bool that is not 0 or 1", t.name);
            }
        }
    }
});
