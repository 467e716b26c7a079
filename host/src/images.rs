//! Images as model inputs: decode, resize the shorter side, centre-crop, scale to [0, 1],
//! normalise per channel, stack as float32 [N, C, H, W].

use std::path::Path;

use cleave_common::bundle::Preprocess;
use cleave_common::spec::{DType, Dim, TensorSpec};
use image::imageops::FilterType;
use tch::Tensor;

use crate::error::{HostError, InputError, Result};

/// Every PNG/JPEG in `dir` (sorted by name) as one batch-first tensor shaped for `spec`, with
/// the file name of each row.
pub(crate) fn load_dir(dir: &Path, spec: &TensorSpec, preprocess: Option<&Preprocess>) -> Result<(Tensor, Vec<String>)> {
    let (c, h, w) = match spec.shape.as_slice() {
        [Dim::Batch(1), Dim::Fixed(c @ (1 | 3)), Dim::Fixed(h), Dim::Fixed(w)] if spec.dtype == DType::Float32 => (*c, *h as u32, *w as u32),
        _ => return Err(InputError::NotAnImageInput { spec: spec.to_string() }.into()),
    };
    let mut paths: Vec<_> = std::fs::read_dir(dir)
        .map_err(|error| HostError::Io { action: "image directory", path: dir.to_path_buf(), error })?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| matches!(p.extension().and_then(|e| e.to_str()).map(str::to_lowercase).as_deref(), Some("png" | "jpg" | "jpeg")))
        .collect();
    paths.sort();
    if paths.is_empty() {
        return Err(InputError::NoImages { dir: dir.to_path_buf() }.into());
    }
    let resize = preprocess.map_or(h.max(w), |p| p.resize.max(h.max(w)));
    let (mean, std) = match preprocess {
        Some(p) if p.mean.len() == c as usize && p.std.len() == c as usize => (p.mean.clone(), p.std.clone()),
        _ => (vec![0.0; c as usize], vec![1.0; c as usize]),
    };
    let mut batch = Vec::with_capacity(paths.len());
    for path in &paths {
        let img = image::open(path).map_err(|error| HostError::Image { path: path.clone(), error })?;
        // Resize so the shorter side is `resize`, then take the centre h x w.
        let (iw, ih) = (img.width(), img.height());
        let scale = resize as f64 / iw.min(ih) as f64;
        let (rw, rh) = (((iw as f64 * scale).round() as u32).max(w), ((ih as f64 * scale).round() as u32).max(h));
        let img = img.resize_exact(rw, rh, FilterType::Triangle).crop_imm((rw - w) / 2, (rh - h) / 2, w, h);
        let pixels: Vec<f32> =
            if c == 3 { img.to_rgb8().into_raw() } else { img.to_luma8().into_raw() }.into_iter().map(|p| f32::from(p) / 255.0).collect();
        // HWC -> CHW, then normalise each channel.
        let t = Tensor::from_slice(&pixels).view([h as i64, w as i64, c]).permute([2, 0, 1]);
        let mean = Tensor::from_slice(&mean).to_kind(tch::Kind::Float).view([c, 1, 1]);
        let std = Tensor::from_slice(&std).to_kind(tch::Kind::Float).view([c, 1, 1]);
        batch.push((t - mean) / std);
    }
    let names = paths.iter().map(|p| p.file_name().map_or_else(String::new, |n| n.to_string_lossy().into_owned())).collect();
    Ok((Tensor::stack(&batch, 0).contiguous(), names))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rgb(size: i64) -> TensorSpec {
        TensorSpec { dtype: DType::Float32, shape: vec![Dim::Batch(1), Dim::Fixed(3), Dim::Fixed(size), Dim::Fixed(size)] }
    }

    #[test]
    fn a_directory_that_cannot_be_read_keeps_its_io_error() {
        let err = load_dir(Path::new("/nonexistent/images"), &rgb(8), None).unwrap_err();
        assert!(matches!(&err, HostError::Io { error, .. } if error.kind() == std::io::ErrorKind::NotFound), "{err:?}");
        assert!(err.to_string().starts_with("image directory /nonexistent/images: "), "{err}");
    }

    #[test]
    fn an_image_that_does_not_decode_names_its_file_and_keeps_the_decoder_error() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("broken.png"), b"not a png").unwrap();
        let err = load_dir(dir.path(), &rgb(8), None).unwrap_err();
        assert!(matches!(&err, HostError::Image { path, .. } if path.ends_with("broken.png")), "{err:?}");
        assert!(err.to_string().contains("broken.png"), "{err}");
    }
}
