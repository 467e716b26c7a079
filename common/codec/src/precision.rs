//! Lossy precisions for float tensors: casts to fp16 or bf16, and affine int8 quantisation
//! with one scale and zero point per channel. Bytes are little-endian, as tensors are.

use half::{bf16, f16};

use crate::codec::Precision;
use crate::dtype::DType;
use crate::pb::Quantization;

#[cfg(target_endian = "big")]
compile_error!("cleave's payloads are little-endian and these casts assume a little-endian machine");

/// Why a tensor cannot be narrowed to, or widened from, its carried precision. Values are
/// kept as their bits, so that the error compares exactly.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PrecisionError {
    /// int8 has no code for NaN or infinity.
    #[error("int8 cannot carry the non-finite value {}", f32::from_bits(*bits))]
    NonFinite {
        /// The value's bits.
        bits: u32,
    },
    /// An int8 tensor sent without its scales and zero points.
    #[error("int8 tensor without quantisation parameters")]
    NoQuantisation,
    /// Quantisation parameters that do not fit the tensor's channels.
    #[error(
        "quantisation parameters for axis {axis} with {scales} scales and {zero_points} zero points do not fit shape {shape:?} \
         (axis {expected_axis}, {channels} channels)"
    )]
    QuantisationShape {
        /// The axis sent.
        axis: i32,
        /// Scales sent.
        scales: usize,
        /// Zero points sent.
        zero_points: usize,
        /// The tensor's shape.
        shape: Vec<i64>,
        /// The axis the shape has.
        expected_axis: i32,
        /// Its channels.
        channels: usize,
    },
    /// A scale that is zero, negative or not finite.
    #[error("quantisation scale {} is not a positive finite number", f32::from_bits(*bits))]
    Scale {
        /// The scale's bits.
        bits: u32,
    },
    /// A zero point outside int8's range.
    #[error("quantisation zero point {0} is outside -128..=127")]
    ZeroPoint(i32),
}

/// Casts a float tensor's bytes to `precision`; returns the carried bytes and, for int8, the
/// quantisation parameters. `shape` gives the channel axis for int8.
pub fn narrow(precision: Precision, dtype: DType, shape: &[i64], data: &[u8]) -> Result<(Vec<u8>, Option<Quantization>), PrecisionError> {
    Ok(match precision {
        Precision::Full => unreachable!("full precision is never narrowed"),
        Precision::Fp16 => (narrow_half::<f16>(dtype, data), None),
        Precision::Bf16 => (narrow_half::<bf16>(dtype, data), None),
        Precision::Int8 => {
            let (q, quant) = quantize(&to_f32(dtype, data), shape)?;
            (q, Some(quant))
        }
    })
}

/// Undoes [`narrow`] (up to its loss): carried bytes back to `dtype`'s bytes.
pub fn widen(precision: Precision, dtype: DType, shape: &[i64], carried: &[u8], quant: Option<&Quantization>) -> Result<Vec<u8>, PrecisionError> {
    Ok(match precision {
        Precision::Full => unreachable!("full precision is never widened"),
        Precision::Fp16 => widen_half::<f16>(dtype, carried),
        Precision::Bf16 => widen_half::<bf16>(dtype, carried),
        Precision::Int8 => from_f32(dtype, &dequantize(carried, shape, quant.ok_or(PrecisionError::NoQuantisation)?)?),
    })
}

/// Elements converted at a time: the half casts go through small buffers that stay in cache,
/// so the only full-size allocation is the result (fresh multi-megabyte buffers cost page
/// faults that dominated these casts).
const CHUNK: usize = 4096;

/// A 16-bit float type `half` converts slices of.
trait HalfFloat: bytemuck::Pod {
    fn from_f32s(src: &[f32], dst: &mut [Self]);
    fn to_f32s(src: &[Self], dst: &mut [f32]);
}

impl HalfFloat for f16 {
    fn from_f32s(src: &[f32], dst: &mut [Self]) {
        half::slice::HalfFloatSliceExt::convert_from_f32_slice(dst, src);
    }
    fn to_f32s(src: &[Self], dst: &mut [f32]) {
        half::slice::HalfFloatSliceExt::convert_to_f32_slice(src, dst);
    }
}

impl HalfFloat for bf16 {
    fn from_f32s(src: &[f32], dst: &mut [Self]) {
        half::slice::HalfFloatSliceExt::convert_from_f32_slice(dst, src);
    }
    fn to_f32s(src: &[Self], dst: &mut [f32]) {
        half::slice::HalfFloatSliceExt::convert_to_f32_slice(src, dst);
    }
}

/// Reads `dst.len()` floats of `dtype` from little-endian `bytes` (float64 rounded to f32).
fn read_floats(dtype: DType, bytes: &[u8], dst: &mut [f32], wide: &mut [f64]) {
    match dtype {
        DType::Float64 => {
            let wide = &mut wide[..dst.len()];
            bytemuck::cast_slice_mut::<f64, u8>(wide).copy_from_slice(bytes);
            for (d, w) in dst.iter_mut().zip(wide.iter()) {
                *d = *w as f32;
            }
        }
        _ => bytemuck::cast_slice_mut::<f32, u8>(dst).copy_from_slice(bytes),
    }
}

fn narrow_half<H: HalfFloat>(dtype: DType, data: &[u8]) -> Vec<u8> {
    let size = dtype.size();
    let mut out = Vec::with_capacity(data.len() / size * 2);
    let (mut floats, mut wide, mut halves) = (vec![0f32; CHUNK], vec![0f64; CHUNK], vec![H::zeroed(); CHUNK]);
    for chunk in data.chunks(CHUNK * size) {
        let n = chunk.len() / size;
        read_floats(dtype, &chunk[..n * size], &mut floats[..n], &mut wide);
        H::from_f32s(&floats[..n], &mut halves[..n]);
        out.extend_from_slice(bytemuck::cast_slice(&halves[..n]));
    }
    out
}

fn widen_half<H: HalfFloat>(dtype: DType, carried: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(carried.len() / 2 * dtype.size());
    let (mut floats, mut wide, mut halves) = (vec![0f32; CHUNK], vec![0f64; CHUNK], vec![H::zeroed(); CHUNK]);
    for chunk in carried.chunks(CHUNK * 2) {
        let n = chunk.len() / 2;
        bytemuck::cast_slice_mut::<H, u8>(&mut halves[..n]).copy_from_slice(&chunk[..n * 2]);
        H::to_f32s(&halves[..n], &mut floats[..n]);
        match dtype {
            DType::Float64 => {
                for (w, f) in wide.iter_mut().zip(&floats[..n]) {
                    *w = f64::from(*f);
                }
                out.extend_from_slice(bytemuck::cast_slice(&wide[..n]));
            }
            _ => out.extend_from_slice(bytemuck::cast_slice(&floats[..n])),
        }
    }
    out
}

fn to_f32(dtype: DType, data: &[u8]) -> Vec<f32> {
    match dtype {
        DType::Float64 => data.chunks_exact(8).map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes")) as f32).collect(),
        _ => bytemuck::pod_collect_to_vec(data),
    }
}

fn from_f32(dtype: DType, values: &[f32]) -> Vec<u8> {
    match dtype {
        DType::Float64 => values.iter().flat_map(|&v| f64::from(v).to_le_bytes()).collect(),
        _ => bytemuck::cast_slice(values).to_vec(),
    }
}

/// The channel layout of a tensor for int8: (axis or -1, outer, channels, inner).
fn channel_layout(shape: &[i64]) -> (i32, usize, usize, usize) {
    if shape.len() < 2 {
        let n = shape.iter().product::<i64>().max(0) as usize;
        return (-1, 1, 1, n);
    }
    let outer = shape[0] as usize;
    let channels = shape[1] as usize;
    let inner = shape[2..].iter().product::<i64>() as usize;
    (1, outer, channels, inner)
}

fn quantize(values: &[f32], shape: &[i64]) -> Result<(Vec<u8>, Quantization), PrecisionError> {
    if let Some(bad) = values.iter().find(|v| !v.is_finite()) {
        return Err(PrecisionError::NonFinite { bits: bad.to_bits() });
    }
    let (axis, outer, channels, inner) = channel_layout(shape);
    let (mut lo, mut hi) = (vec![f32::INFINITY; channels], vec![f32::NEG_INFINITY; channels]);
    for block in values.chunks_exact(inner.max(1)).take(outer * channels).enumerate() {
        let c = block.0 % channels;
        for &v in block.1 {
            lo[c] = lo[c].min(v);
            hi[c] = hi[c].max(v);
        }
    }
    let mut scale = Vec::with_capacity(channels);
    let mut zero_point = Vec::with_capacity(channels);
    for c in 0..channels {
        // The range always includes 0, so that zeros (ReLU outputs, padding) stay exact.
        let (l, h) = (lo[c].min(0.0), hi[c].max(0.0));
        // 254 steps, not 255: rounding the zero point then never pushes an end of the
        // range past -128..=127, so every value is within half a step.
        let s = if h > l { (h - l) / 254.0 } else { 1.0 };
        scale.push(s);
        zero_point.push((-128.0 - l / s).round().clamp(-128.0, 127.0) as i32);
    }
    let mut q = vec![0u8; values.len()];
    for (i, (block, out)) in values.chunks_exact(inner.max(1)).zip(q.chunks_exact_mut(inner.max(1))).enumerate() {
        let c = i % channels;
        let (s, z) = (scale[c], zero_point[c] as f32);
        for (o, &v) in out.iter_mut().zip(block) {
            *o = ((v / s).round() + z).clamp(-128.0, 127.0) as i8 as u8;
        }
    }
    Ok((q, Quantization { axis, scale, zero_point }))
}

fn dequantize(q: &[u8], shape: &[i64], quant: &Quantization) -> Result<Vec<f32>, PrecisionError> {
    let (axis, _, channels, inner) = channel_layout(shape);
    if quant.axis != axis || quant.scale.len() != channels || quant.zero_point.len() != channels {
        return Err(PrecisionError::QuantisationShape {
            axis: quant.axis,
            scales: quant.scale.len(),
            zero_points: quant.zero_point.len(),
            shape: shape.to_vec(),
            expected_axis: axis,
            channels,
        });
    }
    if let Some(bad) = quant.scale.iter().find(|s| !(s.is_finite() && **s > 0.0)) {
        return Err(PrecisionError::Scale { bits: bad.to_bits() });
    }
    if let Some(bad) = quant.zero_point.iter().find(|z| !(-128..=127).contains(*z)) {
        return Err(PrecisionError::ZeroPoint(*bad));
    }
    let mut out = vec![0f32; q.len()];
    for (i, (block, o)) in q.chunks_exact(inner.max(1)).zip(out.chunks_exact_mut(inner.max(1))).enumerate() {
        let c = i % channels;
        let (s, z) = (quant.scale[c], quant.zero_point[c] as f32);
        for (v, &b) in o.iter_mut().zip(block) {
            *v = (f32::from(b as i8) - z) * s;
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn int8_error_is_at_most_half_a_step_per_channel_and_zero_is_exact() {
        // Two channels with very different ranges: per-channel scales keep both precise.
        let shape = [2i64, 2, 3];
        let values: Vec<f32> = vec![0.0, 0.5, 1.0, -100.0, 0.0, 100.0, 0.25, 0.75, -1.0, 50.0, -50.0, 3.0];
        let bytes = from_f32(DType::Float32, &values);
        let (q, quant) = narrow(Precision::Int8, DType::Float32, &shape, &bytes).unwrap();
        let quant = quant.unwrap();
        assert_eq!(quant.axis, 1);
        let back = to_f32(DType::Float32, &widen(Precision::Int8, DType::Float32, &shape, &q, Some(&quant)).unwrap());
        for (i, (a, b)) in values.iter().zip(&back).enumerate() {
            let step = quant.scale[(i / 3) % 2];
            assert!((a - b).abs() <= step / 2.0 * (1.0 + 1e-5), "{a} vs {b} (step {step})");
            if *a == 0.0 {
                assert_eq!(*b, 0.0);
            }
        }
        assert!(narrow(Precision::Int8, DType::Float32, &[1], &from_f32(DType::Float32, &[f32::NAN]))
            .unwrap_err()
            .to_string()
            .contains("non-finite value NaN"));
    }

    #[test]
    fn bad_quantisation_parameters_are_errors() {
        let bad = Quantization { axis: 1, scale: vec![1.0], zero_point: vec![0] };
        assert!(widen(Precision::Int8, DType::Float32, &[1, 2], &[0, 0], Some(&bad)).unwrap_err().to_string().contains("do not fit"));
        let bad = Quantization { axis: -1, scale: vec![-1.0], zero_point: vec![0] };
        assert!(widen(Precision::Int8, DType::Float32, &[2], &[0, 0], Some(&bad)).unwrap_err().to_string().contains("positive"));
        assert_eq!(widen(Precision::Int8, DType::Float32, &[2], &[0, 0], None).unwrap_err(), PrecisionError::NoQuantisation);
    }
}
