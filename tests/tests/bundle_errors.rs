//! Bad bundles and bad boundaries get errors that name the problem.

use std::fs;

use cleave_common::spec::{BoundarySizes, Sizes};
use cleave_common::{Boundary, Bundle, BundleError, DeviceSpec, LoadedStages, StageRange, Value};
use cleave_tests::{bundle_copy, bundle_dir};
use tch::{Device, Kind, Tensor};

fn digits() -> Bundle {
    Bundle::open(bundle_dir("digits")).unwrap()
}

fn input(batch: i64, shape: &[i64], kind: Kind) -> Boundary {
    let mut dims = vec![batch];
    dims.extend_from_slice(shape);
    Boundary { values: vec![("x".into(), Value::Tensor(Tensor::zeros(dims.as_slice(), (kind, Device::Cpu))))] }
}

fn edit_manifest(dir: &std::path::Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let path = dir.join("manifest.json");
    let mut m: serde_json::Value = serde_json::from_slice(&fs::read(&path).unwrap()).unwrap();
    edit(&mut m);
    fs::write(&path, serde_json::to_vec_pretty(&m).unwrap()).unwrap();
}

#[test]
fn corrupted_stage_file_is_named() {
    let (_tmp, dir) = bundle_copy("digits");
    let path = dir.join("stage_002.pt");
    let mut bytes = fs::read(&path).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0xff;
    fs::write(&path, bytes).unwrap();
    let err = Bundle::open(&dir).unwrap_err();
    assert!(matches!(err, BundleError::HashMismatch { ref file, .. } if file == "stage_002.pt"), "{err}");
    assert!(err.to_string().contains("stage_002.pt is corrupted"), "{err}");
}

#[test]
fn missing_file_is_named() {
    let (_tmp, dir) = bundle_copy("digits");
    fs::remove_file(dir.join("reference_b3.safetensors")).unwrap();
    let err = Bundle::open(&dir).unwrap_err();
    assert!(matches!(err, BundleError::MissingFile { ref file, .. } if file == "reference_b3.safetensors"), "{err}");
}

#[test]
fn other_format_version_is_refused() {
    let (_tmp, dir) = bundle_copy("digits");
    edit_manifest(&dir, |m| m["format_version"] = 99.into());
    let err = Bundle::open(&dir).unwrap_err();
    assert!(matches!(err, BundleError::UnsupportedFormat { .. }), "{err}");
    assert!(err.to_string().contains("version 99"), "{err}");
}

#[test]
fn manifest_that_is_not_json_is_refused() {
    let (_tmp, dir) = bundle_copy("digits");
    fs::write(dir.join("manifest.json"), b"{ not json").unwrap();
    assert!(matches!(Bundle::open(&dir).unwrap_err(), BundleError::Manifest { .. }));
}

#[test]
fn manifest_with_inconsistent_cuts_is_refused() {
    let (_tmp, dir) = bundle_copy("digits");
    edit_manifest(&dir, |m| {
        m["cuts"].as_array_mut().unwrap().pop();
    });
    let err = Bundle::open(&dir).unwrap_err();
    assert!(err.to_string().contains("stages need"), "{err}");
}

#[test]
fn file_names_cannot_escape_the_bundle() {
    let (_tmp, dir) = bundle_copy("digits");
    edit_manifest(&dir, |m| {
        m["files"]["../../etc/passwd"] = "00".into();
    });
    let err = Bundle::open(&dir).unwrap_err();
    assert!(err.to_string().contains("not a plain name"), "{err}");
}

#[test]
fn wrong_shape_names_the_expected_one() {
    let bundle = digits();
    let stages = LoadedStages::load(&bundle, StageRange::all(&bundle), DeviceSpec::Cpu).unwrap();
    let err = stages.run(StageRange::all(&bundle), &input(2, &[1, 9, 8], Kind::Float)).unwrap_err();
    assert!(matches!(err, BundleError::BoundaryMismatch { cut: 0, .. }), "{err}");
    let text = err.to_string();
    assert!(text.contains("expected float32[B, 1, 8, 8], got float32[2, 1, 9, 8]"), "{text}");
}

#[test]
fn wrong_dtype_is_refused() {
    let bundle = digits();
    let stages = LoadedStages::load(&bundle, StageRange::all(&bundle), DeviceSpec::Cpu).unwrap();
    let err = stages.run(StageRange::all(&bundle), &input(2, &[1, 8, 8], Kind::Double)).unwrap_err();
    assert!(err.to_string().contains("got float64[2, 1, 8, 8] (dtype)"), "{err}");
}

#[test]
fn batch_outside_the_exported_range_is_refused() {
    let bundle = digits();
    let stages = LoadedStages::load(&bundle, StageRange::all(&bundle), DeviceSpec::Cpu).unwrap();
    let err = stages.run(StageRange::all(&bundle), &input(17, &[1, 8, 8], Kind::Float)).unwrap_err();
    assert!(matches!(err, BundleError::BatchOutOfRange { got: 17, min: 1, max: 16 }), "{err}");
}

#[test]
fn boundary_for_another_cut_is_refused() {
    let bundle = digits();
    let stages = LoadedStages::load(&bundle, StageRange::all(&bundle), DeviceSpec::Cpu).unwrap();
    let (input, _) = bundle.reference(1).unwrap();
    let err = stages.run(StageRange::suffix(&bundle, 3), &input).unwrap_err();
    assert!(matches!(err, BundleError::BoundaryMismatch { cut: 3, .. }), "{err}");
    assert!(err.to_string().contains("expected values"), "{err}");
}

#[test]
fn batch_dimension_must_agree_across_tensors() {
    // The transformer's input cut has two tensors; their batch sizes must agree.
    let bundle = Bundle::open(bundle_dir("transformer")).unwrap();
    let tokens = Tensor::zeros([2, 12], (Kind::Int64, Device::Cpu));
    let mask = Tensor::zeros([3, 12], (Kind::Bool, Device::Cpu));
    let boundary = Boundary { values: vec![("tokens".into(), Value::Tensor(tokens)), ("mask".into(), Value::Tensor(mask))] };
    let err = bundle.check_boundary(0, &boundary).unwrap_err();
    assert!(err.to_string().contains("dimension 0 must be B = 2 for batch size 2"), "{err}");
}

#[test]
fn stage_ranges_outside_the_bundle_or_the_loaded_part_are_refused() {
    let bundle = digits();
    let n = bundle.stage_count();
    let err = LoadedStages::load(&bundle, StageRange::new(0, n + 1), DeviceSpec::Cpu).unwrap_err();
    assert!(matches!(err, BundleError::InvalidRange { .. }), "{err}");
    let edge = LoadedStages::load(&bundle, StageRange::prefix(2), DeviceSpec::Cpu).unwrap();
    let (input, _) = bundle.reference(1).unwrap();
    let err = edge.run(StageRange::prefix(3), &input).unwrap_err();
    assert!(err.to_string().contains("the loaded stages are [0, 2)"), "{err}");
}

#[test]
fn missing_reference_batch_lists_the_available_ones() {
    let err = digits().reference(5).unwrap_err();
    assert!(matches!(err, BundleError::NoReference { batch: 5, ref available } if available == &[1, 3, 8]), "{err}");
}

#[test]
fn cuda_where_there_is_none_is_an_error_not_a_cpu_run() {
    if tch::Cuda::is_available() {
        return; // Checked on a GPU machine by `server check --device cuda`.
    }
    let bundle = digits();
    let err = LoadedStages::load(&bundle, StageRange::all(&bundle), DeviceSpec::Cuda(0)).unwrap_err();
    assert!(matches!(err, BundleError::DeviceUnavailable { .. }), "{err}");
}

#[test]
fn split_points_list_every_cut_with_parameters_on_each_side() {
    let bundle = digits();
    let points = bundle.split_points();
    assert_eq!(points.len(), bundle.stage_count() + 1);
    let total = bundle.manifest().model.parameters;
    assert_eq!(points[0].params_before, 0);
    assert_eq!(points[0].params_after, total);
    assert_eq!(points.last().unwrap().params_before, total);
    assert_eq!(points[0].tensors, ["x: float32[B, 1, 8, 8]"]);
    assert_eq!(points[0].bytes_per_sample, 8 * 8 * 4);
    for p in &points {
        assert_eq!(p.params_before + p.params_after, total);
    }
}

#[test]
fn bytes_at_a_sequence_length_follow_the_specs() {
    let bundle = Bundle::open(bundle_dir("gpt2")).unwrap();
    // At the longest sequence, the exporter's own figures.
    for cut in &bundle.manifest().cuts {
        assert_eq!(cut.bytes_at(bundle.sizes_at(1)), Some(cut.bytes_per_sample + cut.bytes_fixed), "cut {}", cut.index);
    }
    // Cut 5 carries the hidden states (float32[B, S, 32]) and the attention mask
    // (bool[B, 1, S, S]): linear in S for one, quadratic for the other.
    let at = |batch, seq| bundle.cut(5).bytes_at(Sizes::batch_and_seq(batch, Some(seq))).unwrap();
    assert_eq!(at(1, 8), 8 * 32 * 4 + 8 * 8);
    assert_eq!(at(3, 8), 3 * at(1, 8));
    assert_eq!(bundle.cut(5).bytes_at(Sizes::batch(1)), None, "a sequence dimension needs a length");
    let short = bundle.split_points_at(Some(8));
    assert_eq!((short[5].bytes_per_sample, short[5].seq_len), (at(1, 8), Some(8)));
    assert_eq!(short[5].bytes_per_token, Some(at(1, 8) as f64 / 8.0));
    let longest = bundle.split_points();
    assert_eq!((longest[5].bytes_per_sample, longest[5].seq_len), (bundle.cut(5).bytes_per_sample, Some(32)));
    // Cut 3 holds position ids without a batch dimension (int64[1, S]): fixed bytes, counted
    // per token but not per sample.
    assert_eq!(short[3].bytes_per_sample, 8 * 32 * 4 + 8 * 8);
    assert_eq!(short[3].bytes_per_token, Some((8 * 32 * 4 + 8 * 8 + 8 * 8) as f64 / 8.0));
    // `host splits --seq 8` shows them, with a column per token; a bundle without a sequence
    // shows none.
    let table = cleave_tables::split_table(&bundle, Some(8)).to_string();
    assert!(table.contains("per token (S = 8)") && table.contains(&format!("{:.1} B", at(1, 8) as f64 / 8.0)), "{table}");
    let digits = digits();
    assert!(digits.split_points().iter().all(|p| p.seq_len.is_none() && p.bytes_per_token.is_none()));
    assert!(!cleave_tables::split_table(&digits, None).to_string().contains("per token"));
}

#[test]
fn host_splits_says_each_reason_a_cut_is_unusable_once_and_an_unknown_size_as_unknown() {
    let (_tmp, dir) = bundle_copy("digits");
    let reason = "its shapes depend on the data (a value read from a tensor decides them), so what crosses it is not known before a run";
    edit_manifest(&dir, |m| {
        for cut in [3, 4, 5] {
            m["cuts"][cut]["usable"] = false.into();
            m["cuts"][cut]["reason"] = reason.into();
        }
        // A size that depends on the data, which the exporter did not measure.
        m["cuts"][4]["values"][0]["spec"]["shape"][1] = "?".into();
        m["cuts"][4]["tensors"][0]["shape"][1] = "?".into();
        m["cuts"][4]["bytes_per_sample"] = 0.into();
    });
    let table = cleave_tables::split_table(&Bundle::open(&dir).unwrap(), None).to_string();
    assert_eq!(table.matches(reason).count(), 1, "{table}");
    assert!(table.ends_with(&format!("\n(1) {reason}")), "{table}");
    assert_eq!(table.matches("no (1)").count(), 3, "{table}");
    let row = |cut: &str| {
        table.lines().find(|l| l.split('┆').next().is_some_and(|c| c.trim_matches(['│', ' ']) == cut)).unwrap_or_else(|| panic!("{table}"))
    };
    assert!(row("4").contains(" ? ") && !row("4").contains("0 B"), "{}", row("4"));
    assert!(row("3").contains("4.0 KiB"), "{}", row("3"));
}

#[test]
fn a_sequence_length_to_plan_at_is_checked_against_the_bundle() {
    let gpt2 = Bundle::open(bundle_dir("gpt2")).unwrap();
    assert_eq!(gpt2.resolve_seq(None).unwrap(), Some(32));
    assert_eq!(gpt2.resolve_seq(Some(8)).unwrap(), Some(8));
    let err = gpt2.resolve_seq(Some(33)).unwrap_err();
    assert!(matches!(err, BundleError::SequenceOutOfRange { got: 33, min: 1, max: 32 }), "{err}");
    assert_eq!(digits().resolve_seq(None).unwrap(), None);
    let err = digits().resolve_seq(Some(8)).unwrap_err().to_string();
    assert!(err.contains("sequence length 8 asked for, but the bundle has no sequence dimension (S)"), "{err}");
}

#[test]
fn what_a_payload_declares_is_checked_against_its_cut() {
    use cleave_common::spec::DType;
    let bundle = Bundle::open(bundle_dir("digits")).unwrap();
    let n = bundle.stage_count();
    let x = [3i64, 1, 8, 8];
    assert_eq!(bundle.check_declared(0, [("x", DType::Float32, &x[..])]).unwrap(), BoundarySizes { batch: 3, seq: None });
    let err = |cut, declared: Vec<(&str, DType, &[i64])>| bundle.check_declared(cut, declared).unwrap_err().to_string();
    assert!(err(0, vec![("x", DType::Float32, &[3, 1, 9, 8])]).contains("expected float32[B, 1, 8, 8], got float32[3, 1, 9, 8]"));
    assert!(err(0, vec![("x", DType::Int64, &x)]).contains("(dtype)"));
    assert!(err(0, vec![("y", DType::Float32, &x)]).contains("no tensor \"y\" crosses this cut"));
    assert!(err(0, vec![("x", DType::Float32, &x), ("x", DType::Float32, &x)]).contains("declared twice"));
    assert!(err(0, vec![]).contains("tensor \"x\" is missing"));
    assert!(err(0, vec![("x", DType::Float32, &[17, 1, 8, 8])]).contains("batch size 17 is outside"));
    assert!(err(n + 1, vec![]).contains(&format!("split {} is out of range", n + 1)));
}

#[test]
fn a_sequence_length_outside_the_bundle_s_range_is_refused_before_any_data() {
    use cleave_common::spec::DType;
    // The GPT-2-like test bundle takes sequences of 1 to 32 tokens.
    let bundle = Bundle::open(bundle_dir("gpt2")).unwrap();
    let declare = |ids: &[i64], mask: &[i64]| {
        bundle.check_declared(
            0,
            [("input_ids", DType::Int64, ids.to_vec()), ("attention_mask", DType::Int64, mask.to_vec())]
                .iter()
                .map(|(n, d, s)| (*n, *d, s.as_slice())),
        )
    };
    assert_eq!(declare(&[3, 32], &[3, 32]).unwrap(), BoundarySizes { batch: 3, seq: Some(32) });
    assert_eq!(declare(&[2, 1], &[2, 1]).unwrap(), BoundarySizes { batch: 2, seq: Some(1) });
    let err = declare(&[1, 33], &[1, 33]).unwrap_err();
    assert!(matches!(err, BundleError::SequenceOutOfRange { got: 33, min: 1, max: 32 }), "{err}");
    // A hostile length far past the range is refused the same way, before a byte is reserved.
    let err = declare(&[1, 1 << 40], &[1, 1 << 40]).unwrap_err();
    assert!(matches!(err, BundleError::SequenceOutOfRange { got, .. } if got == 1 << 40), "{err}");
    assert!(declare(&[1, 8], &[1, 9]).unwrap_err().to_string().contains("dimension 1 must be S = 8 for sequence length 8"));
    assert!(declare(&[1, 0], &[1, 0]).unwrap_err().to_string().contains("dimension 1 must be a positive multiple of 1"));
}

#[test]
fn token_ids_outside_the_vocabulary_are_refused_at_the_input() {
    // Vocabulary 500: an id of 500 would index past the embedding (on CUDA, a device-side
    // assert that ends every request on the GPU), so cut 0 is checked value by value.
    let bundle = Bundle::open(bundle_dir("gpt2")).unwrap();
    let boundary = |ids: Tensor, mask: Tensor| Boundary {
        values: vec![("input_ids".into(), Value::Tensor(ids)), ("attention_mask".into(), Value::Tensor(mask))],
    };
    let ones = || Tensor::ones([2, 8], (Kind::Int64, Device::Cpu));
    assert_eq!(bundle.check_boundary(0, &boundary(ones() * 499, ones())).unwrap(), BoundarySizes { batch: 2, seq: Some(8) });
    let err = bundle.check_boundary(0, &boundary(ones() * 500, ones())).unwrap_err().to_string();
    assert!(err.contains("input_ids: values must lie in 0..=499, got 500..=500"), "{err}");
    let err = bundle.check_boundary(0, &boundary(ones() - 2, ones())).unwrap_err().to_string();
    assert!(err.contains("input_ids: values must lie in 0..=499, got -1..=-1"), "{err}");
    let err = bundle.check_boundary(0, &boundary(ones(), ones() * 2)).unwrap_err().to_string();
    assert!(err.contains("attention_mask: values must lie in 0..=1, got 2..=2"), "{err}");
    // The stages refuse it too (the server runs them through the same check).
    let stages = LoadedStages::load(&bundle, StageRange::all(&bundle), DeviceSpec::Cpu).unwrap();
    assert!(stages.run(StageRange::all(&bundle), &boundary(ones() * 500, ones())).is_err());
}

#[test]
fn a_sequence_without_its_range_or_with_an_empty_one_is_refused_at_open() {
    for (edit, want) in [
        (
            Box::new(|m: &mut serde_json::Value| m.as_object_mut().unwrap().remove("sequence").map(drop).unwrap())
                as Box<dyn Fn(&mut serde_json::Value)>,
            "dimensions follow the sequence length (S) but the manifest gives no `sequence` range",
        ),
        (Box::new(|m: &mut serde_json::Value| m["sequence"]["min"] = 40.into()), "sequence range 40..=32 is empty"),
        (Box::new(|m: &mut serde_json::Value| m["inputs"][0]["range"] = serde_json::json!([5, 4])), "input input_ids has an empty value range"),
    ] {
        let (_tmp, dir) = bundle_copy("gpt2");
        edit_manifest(&dir, edit);
        let err = Bundle::open(&dir).unwrap_err().to_string();
        assert!(err.contains(want), "{err}");
    }
}
