//! Every bundle the exporter makes, run split at every cut in Rust: stages [0, s) then
//! [s, N) on the reference input must give the reference output (relative error at most
//! 1e-5) and exactly the same bits whatever s is, at batch sizes 1, 3 and 8.

use cleave_common::error::{BundleError, StepProblem};
use cleave_common::generation::GenerationStages;
use cleave_common::spec::ValueSpec;
use cleave_common::verify::{verify_splits, TOLERANCE};
use cleave_common::{Bundle, DeviceSpec, LoadedStages, StageRange, Value};
use cleave_tests::bundle_dir;
use tch::{Device, Kind, Tensor};

/// Runs every split of `name` at batch 1, 3 and 8; returns the bundle for further checks.
fn every_split_matches_reference(name: &str, min_cuts: usize) -> Bundle {
    let bundle = Bundle::open(bundle_dir(name)).expect("open bundle");
    assert!(bundle.stage_count() + 1 >= min_cuts, "{name}: only {} cuts", bundle.stage_count() + 1);
    for batch in [1, 3, 8] {
        let report = verify_splits(&bundle, DeviceSpec::Cpu, batch).expect("verify");
        assert_eq!(report.splits.len(), bundle.stage_count() + 1, "{name}: one row per cut");
        for s in &report.splits {
            assert!(s.relative_error <= TOLERANCE, "{name} batch {batch} split {} ({}): relative error {:e}", s.split, s.name, s.relative_error);
            assert!(s.identical_to_first, "{name} batch {batch}: split {} differs from split 0", s.split);
        }
    }
    bundle
}

#[test]
fn digits_cnn_every_split() {
    every_split_matches_reference("digits", 12);
}

#[test]
fn resnet18_every_split_including_inside_residual_blocks() {
    let bundle = every_split_matches_reference("resnet18", 40);
    // Cuts inside a residual block carry the main path and the skip connection.
    let widest = bundle.manifest().cuts.iter().map(|c| c.tensors().len()).max().unwrap();
    assert_eq!(widest, 2, "resnet18 at layer granularity has two-tensor frontiers");
}

#[test]
fn mobilenet_v3_small_every_split() {
    every_split_matches_reference("mobilenet_v3_small", 20);
}

#[test]
fn efficientnet_b0_every_split() {
    every_split_matches_reference("efficientnet_b0", 20);
}

#[test]
fn hugging_face_models_every_split() {
    // Between every two layers, at batch 1, 3 and 8 and at both reference lengths.
    for (name, min_cuts) in [("gpt2", 12), ("llama", 8), ("bert", 7), ("vit", 8)] {
        every_split_matches_reference(name, min_cuts);
    }
}

/// Models as users write them: an image and a metadata branch called `meta` (a name
/// torch.fx's graph module uses itself, renamed in the graph); Whisper's encoder, which
/// takes log-mel features; wav2vec2, which takes a waveform of a symbolic length; a user's
/// module around GPT-2, cut at each of its layers.
#[test]
fn models_as_users_write_them_every_split() {
    let bundle = every_split_matches_reference("image_meta", 8);
    assert_eq!(bundle.manifest().inputs.len(), 2);
    let bundle = every_split_matches_reference("whisper_encoder", 8);
    let inputs: Vec<String> = bundle.manifest().inputs.iter().map(|i| format!("{}: {}", i.name, i.spec.describe())).collect();
    assert_eq!(inputs, ["input_features: float32[B, 16, 64]"]);
    // wav2vec2 takes a waveform of any length whose samples make whole frames: S counts them.
    let bundle = every_split_matches_reference("wav2vec2", 10);
    let inputs: Vec<String> = bundle.manifest().inputs.iter().map(|i| format!("{}: {}", i.name, i.spec.describe())).collect();
    assert_eq!(inputs, ["input_values: float32[B, 20*S+20]"]);
    let bundle = every_split_matches_reference("wrapped_gpt2", 12);
    let stages: Vec<&str> = bundle.manifest().stages.iter().map(|s| s.name.as_str()).collect();
    for layer in ["inner.transformer.h.0", "inner.transformer.h.1", "inner.transformer.h.2"] {
        assert!(stages.contains(&layer), "{layer} is a stage of its own: {stages:?}");
    }
    assert!(bundle.manifest().cuts.iter().all(|c| c.usable), "every cut of the wrapper is usable");
}

#[test]
fn transformer_with_two_inputs_and_dict_output_every_split() {
    let bundle = every_split_matches_reference("transformer", 10);
    let m = bundle.manifest();
    let inputs: Vec<String> = m.inputs.iter().map(|i| format!("{}: {}", i.name, i.spec.describe())).collect();
    assert_eq!(inputs, ["tokens: int64[B, 12]", "mask: bool[B, 12]"]);
    // Its sequence length (an int) crosses no cut: each stage computes it from its inputs.
    assert!(!m.cuts.iter().any(|c| c.values.iter().any(|v| v.spec == ValueSpec::Int)));
    assert_eq!(m.exporter.kept_whole, ["guard"]);

    // The output is rebuilt as the model's own dict.
    let stages = LoadedStages::load(&bundle, StageRange::all(&bundle), DeviceSpec::Cpu).unwrap();
    let (input, reference) = bundle.reference(3).unwrap();
    let last = stages.run(StageRange::all(&bundle), &input).unwrap();
    assert!(last.max_relative_error(&reference) <= TOLERANCE);
    match bundle.assemble_output(last).unwrap() {
        Value::Dict(items) => {
            let keys: Vec<&str> = items.iter().map(|(k, _)| k.as_str()).collect();
            assert_eq!(keys, ["logits", "hidden"]);
            assert_eq!(items[0].1.as_tensor().unwrap().size(), [3, 5]);
            assert_eq!(items[1].1.as_tensor().unwrap().size(), [3, 12, 32]);
        }
        other => panic!("expected a dict output, got {}", other.describe()),
    }
}

#[test]
fn prefix_and_suffix_loaded_separately_match_the_whole_chain() {
    // As the host and the server will: each side loads only its own stages.
    let bundle = Bundle::open(bundle_dir("resnet18")).unwrap();
    let n = bundle.stage_count();
    let (input, reference) = bundle.reference(3).unwrap();
    let whole = LoadedStages::load(&bundle, StageRange::all(&bundle), DeviceSpec::Cpu).unwrap();
    let expected = whole.run(StageRange::all(&bundle), &input).unwrap();
    for split in [0, 1, n / 3, n / 2, n - 1, n] {
        let edge = LoadedStages::load(&bundle, StageRange::prefix(split), DeviceSpec::Cpu).unwrap();
        let server = LoadedStages::load(&bundle, StageRange::suffix(&bundle, split), DeviceSpec::Cpu).unwrap();
        let middle = edge.run(StageRange::prefix(split), &input).unwrap();
        // A deep copy stands in for the trip over the wire.
        let middle = cleave_common::Boundary { values: middle.values.iter().map(|(n, v)| (n.clone(), deep_copy(v))).collect() };
        let output = server.run(StageRange::suffix(&bundle, split), &middle).unwrap();
        assert!(output.bit_identical(&expected), "split {split}");
        assert!(output.max_relative_error(&reference) <= TOLERANCE, "split {split}");
    }
}

fn deep_copy(v: &Value) -> Value {
    match v {
        Value::Tensor(t) => Value::Tensor(t.copy()),
        Value::Int(i) => Value::Int(*i),
        Value::Tuple(items) => Value::Tuple(items.iter().map(deep_copy).collect()),
        Value::List(items) => Value::List(items.iter().map(deep_copy).collect()),
        other => other.shallow_clone(),
    }
}

/// The reference of the GPT-2 test bundle's generation stages: token ids and transformers'
/// logits for them with its own cache.
fn generation_reference(bundle: &Bundle) -> (Tensor, Tensor) {
    let info = bundle.manifest().generation.as_ref().expect("exported with --generation");
    let tensors = Tensor::read_safetensors(bundle.dir().join(&info.reference.file)).unwrap();
    let get = |name: &str| tensors.iter().find(|(n, _)| n == name).expect(name).1.shallow_clone();
    (get("input_ids"), get("logits"))
}

/// Split generation (`--generation`): the GPT-2 and Llama test bundles' generation stages
/// split at every cut, the edge's range then the server's, each side keeping its own layers'
/// caches, a prompt in one step then one token at a time, give transformers' logits with its
/// own cache within 1e-4 (relative to their largest magnitude).
#[test]
fn generation_stages_split_at_every_cut_give_transformers_logits_with_its_cache() {
    for (name, layers) in [("gpt2", 4), ("llama", 2)] {
        let bundle = Bundle::open(bundle_dir(name)).unwrap();
        let info = bundle.manifest().generation.clone().unwrap();
        let (ids, want) = generation_reference(&bundle);
        let (batch, total, n) = (ids.size()[0], ids.size()[1], info.stages.len());
        assert_eq!(n, layers + 2, "{name}: the embedding, {layers} layers, the head");
        let (prompt, max_len) = (info.reference.prompt, info.reference.max_len);
        for cut in 0..=n {
            let edge = GenerationStages::load(&bundle, StageRange::new(0, cut), DeviceSpec::Cpu).unwrap();
            let server = GenerationStages::load(&bundle, StageRange::new(cut, n), DeviceSpec::Cpu).unwrap();
            // Warmed as the host and the server warm theirs: every range (empty, the head
            // alone, from the embedding) runs its warm-up, which leaves the results exact.
            edge.warm_up().unwrap();
            server.warm_up().unwrap();
            let (mut edge_caches, mut server_caches) = (edge.new_caches(batch, max_len).unwrap(), server.new_caches(batch, max_len).unwrap());
            assert_eq!(edge_caches.len() + server_caches.len(), layers, "one cache per layer, on one side");
            let steps = std::iter::once((0, prompt)).chain((prompt..total).map(|t| (t, t + 1)));
            let logits: Vec<Tensor> = steps
                .map(|(start, end)| {
                    let positions = Tensor::arange_start(start, end, (Kind::Int64, Device::Cpu)).unsqueeze(0).repeat([batch, 1]);
                    let hidden = edge.step(&ids.narrow(1, start, end - start), &positions, &mut edge_caches).unwrap();
                    server.step(&hidden, &positions, &mut server_caches).unwrap()
                })
                .collect();
            let got = Tensor::cat(&logits, 1);
            let error = (&got - &want).abs().max().double_value(&[]) / want.abs().max().double_value(&[]);
            assert!(error <= 1e-4, "{name} cut {cut}: relative error {error:e}");
        }
    }
}

#[test]
fn a_generation_step_s_hostile_inputs_are_refused_before_a_stage_sees_them() {
    let bundle = Bundle::open(bundle_dir("gpt2")).unwrap();
    let all = GenerationStages::load(&bundle, StageRange::new(0, 6), DeviceSpec::Cpu).unwrap();
    let mut caches = all.new_caches(1, 8).unwrap();
    let ids = |v: &[i64]| Tensor::from_slice(v).unsqueeze(0);
    let refused = |tokens: &Tensor, positions: &Tensor, caches: &mut [Tensor]| match all.step(tokens, positions, caches) {
        Err(BundleError::GenerationStep { problem }) => problem,
        other => panic!("expected a refusal, got {:?}", other.map(|t| t.size())),
    };
    assert_eq!(refused(&ids(&[1, 500]), &ids(&[0, 1]), &mut caches), StepProblem::TokenId { min: 1, max: 500, vocab_size: 500 });
    assert_eq!(refused(&ids(&[1, 2]), &ids(&[7, 8]), &mut caches), StepProblem::Position { min: 7, max: 8, max_len: 8 });
    assert_eq!(refused(&ids(&[1, 2]), &ids(&[-1, 0]), &mut caches), StepProblem::Position { min: -1, max: 0, max_len: 64 });
    assert!(matches!(refused(&ids(&[1, 2]), &ids(&[0]), &mut caches), StepProblem::Shape(_)));
    assert!(matches!(refused(&ids(&[1, 2]), &ids(&[0, 1]), &mut caches[..3]), StepProblem::Shape(_)));
    assert!(matches!(refused(&ids(&[1, 2]).repeat([2, 1]), &ids(&[0, 1]).repeat([2, 1]), &mut caches), StepProblem::Shape(_)));
    let mut other_heads: Vec<Tensor> = caches.iter().map(|c| c.narrow(2, 0, 2).contiguous()).collect();
    assert!(matches!(refused(&ids(&[1, 2]), &ids(&[0, 1]), &mut other_heads), StepProblem::Shape(_)), "the manifest's heads");
    assert_eq!(caches.iter().map(|c| c.abs().sum(Kind::Double).double_value(&[])).sum::<f64>(), 0.0, "no cache was written");
    // Without a cache in the range, positions are still held to the model's (an embedding
    // index out of range would be a device-side assert on CUDA).
    let embedding = GenerationStages::load(&bundle, StageRange::new(0, 1), DeviceSpec::Cpu).unwrap();
    match embedding.step(&ids(&[1]), &ids(&[64]), &mut []) {
        Err(BundleError::GenerationStep { problem }) => assert_eq!(problem, StepProblem::Position { min: 64, max: 64, max_len: 64 }),
        other => panic!("expected a refusal, got {:?}", other.map(|t| t.size())),
    }
    // Caches longer than the model's positions, or of no sequence, are not made.
    assert!(all.new_caches(1, 65).is_err() && all.new_caches(0, 8).is_err() && all.new_caches(1, 0).is_err());
    // Within the cache, a step runs: logits for each new token.
    assert_eq!(all.step(&ids(&[1, 2]), &ids(&[6, 7]), &mut caches).unwrap().size(), [1, 2, 500]);
    // A bundle exported without --generation has none.
    let digits = Bundle::open(bundle_dir("digits")).unwrap();
    assert!(matches!(GenerationStages::load(&digits, StageRange::new(0, 1), DeviceSpec::Cpu), Err(BundleError::NoGeneration)));
}

/// `server check` of a `--generation` bundle also runs its generation stages whole on the
/// device, with their caches there, teacher-forced over the reference: on the CPU within
/// 1e-4 of transformers' logits, every decode step of the reference timed; a bundle without
/// them has no such row.
#[test]
fn server_check_runs_the_generation_stages_on_the_device_against_their_reference() {
    use cleave_server::{check, CheckOptions};
    let bundle = Bundle::open(bundle_dir("llama")).unwrap();
    let reference = bundle.manifest().generation.as_ref().unwrap().reference.clone();
    let report = check(&CheckOptions { bundle: bundle.dir().to_path_buf(), device: DeviceSpec::Cpu }).unwrap();
    let generation = report.generation.as_ref().expect("a --generation bundle");
    assert!(generation.relative_error <= 1e-4 && report.passed(), "{generation:?}");
    assert_eq!((generation.prompt, generation.steps), (reference.prompt, reference.steps));
    assert!(generation.step_ms > 0.0);
    let line = format!("generation on cpu: a {}-token prompt then {} decode steps, teacher-forced", reference.prompt, reference.steps);
    assert!(report.to_string().contains(&line), "{report}");
    let plain = check(&CheckOptions { bundle: bundle_dir("digits"), device: DeviceSpec::Cpu }).unwrap();
    assert!(plain.generation.is_none() && !plain.to_string().contains("generation on"));
}
