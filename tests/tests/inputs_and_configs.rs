//! Input sources (images, .npy, .safetensors) and the example configs.

use std::path::Path;
use std::time::Duration;

use cleave_client::RetryPolicy;
use cleave_common::config::CpuUse;
use cleave_common::training::loss::LossKind;
use cleave_common::wire::{Codec, CodecPolicy, Direction, KeyRing, PayloadMeta, PayloadReceiver, PayloadSender};
use cleave_common::SplitSpec;
use cleave_common::{Bundle, DeviceSpec};
use cleave_host::config::{ClientMode, ClientsConfig, EdgeConfig, Fallback, InputSource, Job, Resilience, TrainMode};
use cleave_host::error::{HostError, InputError};
use cleave_host::inputs::Inputs;
use cleave_host::planning::fleet::Fleet;
use cleave_server::ServerConfig;
use cleave_tests::bundle_dir;
use tch::{Device, Kind, Tensor};

fn input_tensor(inputs: &Inputs, id: u64) -> Tensor {
    inputs.batch(id).values[0].1.as_tensor().unwrap().shallow_clone()
}

#[test]
fn images_are_resized_cropped_and_stacked() {
    let bundle = Bundle::open(bundle_dir("digits")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    // Five 16x12 grey images of levels 0, 51, 102, 153, 204 (digits has no normalisation).
    for i in 0..5u8 {
        image::GrayImage::from_pixel(16, 12, image::Luma([i * 51])).save(dir.path().join(format!("img{i}.png"))).unwrap();
    }
    std::fs::write(dir.path().join("notes.txt"), "not an image").unwrap();
    let inputs = Inputs::new(&InputSource::Images { dir: dir.path().into() }, &bundle, 3).unwrap();
    let first = input_tensor(&inputs, 0);
    assert_eq!(first.size(), [3, 1, 8, 8]);
    let means: Vec<f64> = (0..3).map(|i| first.get(i).mean(Kind::Double).double_value(&[])).collect();
    for (i, m) in means.iter().enumerate() {
        assert!((m - i as f64 * 51.0 / 255.0).abs() < 1e-6, "image {i}: mean {m}");
    }
    // The second request takes images 3, 4 and wraps around to 0.
    let second = input_tensor(&inputs, 1);
    let m: Vec<f64> = (0..3).map(|i| second.get(i).mean(Kind::Double).double_value(&[])).collect();
    assert!((m[0] - 153.0 / 255.0).abs() < 1e-6 && (m[2]).abs() < 1e-6, "{m:?}");
    // Each sample's file is known, and a run that reuses images says so.
    assert_eq!(inputs.sample_files().unwrap().of(1), ["img3.png", "img4.png", "img0.png"]);
    assert_eq!(inputs.reuse_note(1), None);
    let note = inputs.reuse_note(2).unwrap();
    assert!(note.contains("holds 5 samples and 2 requests of 3 need 6: they are used again"), "{note}");
}

#[test]
fn predictions_name_the_image_file_of_each_sample() {
    let images = tempfile::tempdir().unwrap();
    for i in 0..3u8 {
        image::GrayImage::from_pixel(8, 8, image::Luma([i * 80])).save(images.path().join(format!("digit{i}.png"))).unwrap();
    }
    let out = tempfile::tempdir().unwrap();
    let yaml = format!(
        "server: http://127.0.0.1:1\nbundle: {}\nsplit: 4\ndevice: cpu\nbatch_size: 2\nrequests: 2\n\
         input: {{kind: images, dir: {}}}\noutput: {}\nloopback: {{device: cpu}}\n",
        bundle_dir("digits").display(),
        images.path().display(),
        out.path().join("run").display()
    );
    let config = write_config(out.path(), "edge.yaml", &yaml);
    let opts = cleave_host::RunOptions { loopback: true, ..Default::default() };
    tokio::runtime::Runtime::new().unwrap().block_on(cleave_host::run(EdgeConfig::load(&config).unwrap(), opts)).unwrap();
    let mut lines: Vec<serde_json::Value> =
        std::fs::read_to_string(out.path().join("run/predictions.jsonl")).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    lines.sort_by_key(|l| l["request_id"].as_u64());
    assert_eq!(lines[0]["inputs"], serde_json::json!(["digit0.png", "digit1.png"]));
    assert_eq!(lines[1]["inputs"], serde_json::json!(["digit2.png", "digit0.png"]));
    assert_eq!(lines[1]["top_k"].as_array().unwrap().len(), 2, "one prediction per sample");
}

#[test]
fn images_for_a_bundle_that_is_not_an_image_model_are_refused() {
    let bundle = Bundle::open(bundle_dir("transformer")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let err = Inputs::new(&InputSource::Images { dir: dir.path().into() }, &bundle, 1).err().unwrap();
    assert!(matches!(err, HostError::Inputs(InputError::ImagesNeedOneInput { .. })), "{err}");
    assert!(err.to_string().contains("image inputs need a bundle with one input"), "{err}");
    let bundle = Bundle::open(bundle_dir("digits")).unwrap();
    let err = Inputs::new(&InputSource::Images { dir: dir.path().into() }, &bundle, 1).err().unwrap();
    assert!(matches!(&err, HostError::Inputs(InputError::NoImages { dir: d }) if d == dir.path()), "{err}");
    assert!(err.to_string().contains("has no .png, .jpg or .jpeg files"), "{err}");
}

#[test]
fn npy_and_safetensors_files_give_consecutive_batches() {
    let bundle = Bundle::open(bundle_dir("digits")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let data = Tensor::arange(5 * 64, (Kind::Float, Device::Cpu)).view([5, 1, 8, 8]);
    let npy = dir.path().join("x.npy");
    data.write_npy(&npy).unwrap();
    let st = dir.path().join("x.safetensors");
    Tensor::write_safetensors(&[("x", &data)], &st).unwrap();
    for path in [npy, st] {
        let inputs = Inputs::new(&InputSource::File { path: path.clone() }, &bundle, 2).unwrap();
        assert!(input_tensor(&inputs, 0).equal(&data.narrow(0, 0, 2)), "{}", path.display());
        assert!(input_tensor(&inputs, 1).equal(&data.narrow(0, 2, 2)));
        // Request 2 takes row 4 then wraps to row 0.
        assert!(input_tensor(&inputs, 2).equal(&Tensor::cat(&[data.narrow(0, 4, 1), data.narrow(0, 0, 1)], 0)));
    }
    let wrong = dir.path().join("wrong.safetensors");
    Tensor::write_safetensors(&[("y", &data)], &wrong).unwrap();
    let err = Inputs::new(&InputSource::File { path: wrong }, &bundle, 2).err().unwrap();
    assert!(matches!(&err, HostError::Inputs(InputError::MissingTensor { name, held, .. }) if name == "x" && held == &["y"]), "{err}");
    assert!(err.to_string().contains("has no tensor \"x\""), "{err}");
    let bad_shape = dir.path().join("bad.npy");
    Tensor::zeros([4, 1, 9, 8], (Kind::Float, Device::Cpu)).write_npy(&bad_shape).unwrap();
    let err = Inputs::new(&InputSource::File { path: bad_shape }, &bundle, 2).err().unwrap();
    assert!(matches!(err, HostError::Inputs(InputError::WrongTensor { .. })), "{err}");
    assert!(err.to_string().contains("the bundle expects float32[B, 1, 8, 8]"), "{err}");
}

fn config_dir() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../config"))
}

#[test]
fn a_config_copied_elsewhere_says_where_its_relative_paths_start() {
    let elsewhere = tempfile::tempdir().unwrap();
    let copy = elsewhere.path().join("demo.yaml");
    std::fs::copy(config_dir().join("demo.yaml"), &copy).unwrap();
    let config = EdgeConfig::load(&copy).unwrap();
    let err = tokio::runtime::Runtime::new().unwrap().block_on(cleave_host::run(config, Default::default())).unwrap_err().to_string();
    let expected = format!(
        "bundle {} does not exist (relative paths in {} start at {}: a config's own directory, or the project root for a config in a `config/` \
         directory): run `make bundles/resnet18/manifest.json`, which creates it",
        elsewhere.path().join("bundles/resnet18").display(),
        copy.display(),
        elsewhere.path().display()
    );
    assert_eq!(err, expected);
}

#[test]
fn the_inference_examples_run_as_the_readme_shows() {
    // A checkout's layout, with the bundle `make bundles/resnet18/manifest.json` makes (the
    // tests' export of resnet18 stands in for it) and fewer requests; the loopback server
    // stands in for the GPU machine of config/edge.yaml.
    let root = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(root.path().join("bundles")).unwrap();
    std::fs::create_dir(root.path().join("config")).unwrap();
    std::os::unix::fs::symlink(bundle_dir("resnet18"), root.path().join("bundles/resnet18")).unwrap();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    for name in ["demo.yaml", "edge.yaml"] {
        let text = std::fs::read_to_string(config_dir().join(name)).unwrap();
        let text: String = text.lines().map(|l| if l.starts_with("requests:") { "requests: 2\n".to_string() } else { format!("{l}\n") }).collect();
        let path = root.path().join("config").join(name);
        std::fs::write(&path, text).unwrap();
        let opts = cleave_host::RunOptions { loopback: true, output: Some(root.path().join("out").join(name)), ..Default::default() };
        let summary = runtime.block_on(cleave_host::run(EdgeConfig::load(&path).unwrap(), opts)).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!((summary.counts.answered, summary.errors), (2, 0), "{name}");
    }
}

#[test]
fn every_example_config_parses() {
    // The secured examples read development secrets from `.dev-secrets/` beside `config/`:
    // parse copies of the configs next to freshly written ones.
    let root = tempfile::tempdir().unwrap();
    cleave_server::write_dev_secrets(&root.path().join(".dev-secrets")).unwrap();
    std::fs::create_dir(root.path().join("config")).unwrap();
    for entry in std::fs::read_dir(config_dir()).unwrap() {
        let path = entry.unwrap().path();
        if path.is_file() {
            std::fs::copy(&path, root.path().join("config").join(path.file_name().unwrap())).unwrap();
        }
    }
    let mut seen = 0;
    for entry in std::fs::read_dir(root.path().join("config")).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        if name.starts_with("server") {
            let c = ServerConfig::load(&path).unwrap_or_else(|e| panic!("{e}"));
            let bundle = if name == "server-fed.yaml" { "bundles/digits-cnn" } else { "bundles/resnet18" };
            assert!(c.models[0].bundle.ends_with(bundle), "{name}");
            seen += 1;
        } else if name.starts_with("fleet") {
            // Its profiles are in config/fleet/: read it where it is.
            let fleet = Fleet::load(&config_dir().join(&name)).unwrap_or_else(|e| panic!("{e}"));
            assert!(fleet.models.len() >= 2 && fleet.gpus.len() >= 2, "{name}");
            seen += 1;
        } else if name.ends_with(".yaml") {
            EdgeConfig::load(&path).unwrap_or_else(|e| panic!("{e}"));
            seen += 1;
        }
    }
    assert!(seen >= 5, "config/ holds the demo, edge and server examples, plain and secured");
    let secure = EdgeConfig::load(&root.path().join("config/demo-secure.yaml")).unwrap();
    assert_eq!(secure.codec.to_string(), "shuffle+lz4");
    assert!(secure.security.key.is_some() && secure.security.tls.is_some() && secure.security.token.is_some());
    assert!(secure.loopback_security().tls.is_some() && secure.loopback_security().policy.require_encryption);
    let server = ServerConfig::load(&root.path().join("config/server-secure.yaml")).unwrap();
    assert_eq!(server.security.keys.ids(), [1]);
    assert!(server.security.policy.require_encryption && server.security.tls.is_some() && server.security.tokens.required());
    let demo = EdgeConfig::load(&config_dir().join("demo.yaml")).unwrap();
    assert_eq!(demo.split, SplitSpec::After("layer2".into()));
    assert_eq!(demo.job, Job::Infer(InputSource::Synthetic { seed: 0 }));
    assert_eq!(demo.device, DeviceSpec::Cpu);
    let train = EdgeConfig::load(&config_dir().join("train-digits.yaml")).unwrap().train().cloned().expect("a training config");
    assert_eq!(train.mode, TrainMode::Split);
    assert_eq!(train.optimizer.kind(), "adam");
    assert_eq!(train.loss, LossKind::CrossEntropy);
    assert!(train.train_data.ends_with("bundles/digits-train.safetensors"));
    let server = ServerConfig::load(&config_dir().join("server.yaml")).unwrap();
    assert!(server.training.checkpoint_dir.is_some() && !server.training.concurrent_sessions);
    let fed = EdgeConfig::load(&config_dir().join("train-fed.yaml")).unwrap().train().cloned().expect("a training config");
    assert_eq!(fed.clients, Some(ClientsConfig { mode: ClientMode::SplitFed, group: "digits".into(), edges: 4, edge: 0 }));
    assert_eq!(ServerConfig::load(&config_dir().join("server-fed.yaml")).unwrap().training.max_sessions, 4);
}

/// The fewest keys an inference edge.yaml takes.
const MINIMAL_EDGE: &str = "server: http://127.0.0.1:1\nbundle: b\nsplit: 3\ninput: {kind: synthetic}\noutput: out\n";

/// Writes config file `name` with `text` into `dir`; its path.
fn write_config(dir: &Path, name: &str, text: &str) -> std::path::PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

#[test]
fn config_errors_name_the_file_and_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, text: &str| write_config(dir.path(), name, text);
    let base = MINIMAL_EDGE;
    let p = write("typo.yaml", &format!("{base}batch_sise: 4\n"));
    let err = EdgeConfig::load(&p).unwrap_err().to_string();
    assert!(err.contains("typo.yaml") && err.contains("unknown field `batch_sise`"), "{err}");
    // Types said in words, with the key path and its line, inside a `kind:` section too.
    let lines = base.lines().count() + 1;
    for (text, expected) in [
        ("batch_size: \"8\"", "`batch_size` (line {L}): invalid type: string \"8\", expected an integer"),
        (
            "request_timeout: 30",
            "`request_timeout` (line {L}): invalid value: string \"30\", expected a duration with its unit, like 30s, 500ms or 2m",
        ),
    ] {
        let err = EdgeConfig::load(&write("types.yaml", &format!("{base}{text}\n"))).unwrap_err().to_string();
        assert!(err.ends_with(&expected.replace("{L}", &lines.to_string())), "{err}");
    }
    let seed = base.replace("input: {kind: synthetic}", "input: {kind: synthetic, seed: one}");
    let line = seed.lines().position(|l| l.contains("seed: one")).unwrap() + 1;
    let err = EdgeConfig::load(&write("seed.yaml", &seed)).unwrap_err().to_string();
    assert!(err.ends_with(&format!("`input.seed` (line {line}): invalid type: string \"one\", expected an integer")), "{err}");
    let p = write("split.yaml", &base.replace("split: 3", "split: middle"));
    let err = EdgeConfig::load(&p).unwrap_err().to_string();
    assert!(err.contains("`split`") && err.contains("not a cut index"), "{err}");
    let p = write("device.yaml", &format!("{base}device: gpu\n"));
    assert!(EdgeConfig::load(&p).unwrap_err().to_string().contains("`device`: invalid device \"gpu\""));
    let p = write("server.yaml", "listen: nowhere\nbundle: b\n");
    let err = ServerConfig::load(&p).unwrap_err().to_string();
    assert!(err.contains("`listen`") && err.contains("not an address"), "{err}");
    let p = write("limits.yaml", "listen: 127.0.0.1:0\nbundle: b\nlimits: {queue_depth: 0}\n");
    assert!(ServerConfig::load(&p).unwrap_err().to_string().contains("`limits.queue_depth`: must be positive"));

    // Training sections.
    let no_input = base.replace("input: {kind: synthetic}\n", "");
    let train = "train:\n  data: {train: a, test: b}\n  epochs: 2\n  batch_size: 8\n  optimizer: {kind: sgd, lr: 0.1}\n  loss: cross-entropy\n";
    let cases = [
        ("neither.yaml", no_input.clone(), "give `input` (inference) or `train` (training)"),
        ("both.yaml", format!("{base}{train}"), "give one"),
        ("mode.yaml", format!("{no_input}{}", train.replace("train:\n", "train:\n  mode: federated\n")), "`train.mode`"),
        ("tail.yaml", format!("{no_input}{}", train.replace("train:\n", "train:\n  mode: u-shaped\n")), "`train.tail`"),
        ("lr.yaml", format!("{no_input}{}", train.replace("lr: 0.1", "lr: -1")), "`train.optimizer`: lr must be"),
        ("loss.yaml", format!("{no_input}{}", train.replace("cross-entropy", "hinge")), "`train.loss`"),
        ("optim.yaml", format!("{no_input}{}", train.replace("kind: sgd", "kind: lamb")), "unknown variant `lamb`"),
        ("epochs.yaml", format!("{no_input}{}", train.replace("epochs: 2", "epochs: 0")), "`train.epochs`"),
        ("clip.yaml", format!("{no_input}{train}  clip_grad_norm: 0\n"), "`train.clip_grad_norm`: clip_grad_norm must be a finite number above 0"),
        ("warmup.yaml", format!("{no_input}{train}  schedule: {{warmup: {{steps: 0}}}}\n"), "`train.schedule`: warmup.steps must be at least 1"),
        ("micro.yaml", format!("{no_input}{train}  microbatches: 0\n"), "`train.microbatches`: must be at least 1"),
        ("decay.yaml", format!("{no_input}{train}  schedule: {{decay: {{kind: linear}}}}\n"), "unknown variant `linear`"),
        ("edges.yaml", format!("{no_input}{train}  clients: {{mode: splitfed, edges: 0, edge: 0}}\n"), "`train.clients.edges`: must be at least 1"),
        (
            "place.yaml",
            format!("{no_input}{train}  clients: {{mode: sequential, edges: 2, edge: 2}}\n"),
            "`train.clients.edge`: 2 is not a place among 2 edges",
        ),
        ("fed.yaml", format!("{no_input}{train}  clients: {{mode: fedprox, edges: 2, edge: 0}}\n"), "unknown variant `fedprox`"),
        (
            "mono.yaml",
            format!("{no_input}{}  clients: {{mode: sequential, edges: 2, edge: 0}}\n", train.replace("train:\n", "train:\n  mode: monolithic\n")),
            "`train.clients`: several edges train a server part together",
        ),
        (
            "gresume.yaml",
            format!("{no_input}{train}  resume: step-3\n  clients: {{mode: sequential, edges: 2, edge: 0}}\n"),
            "`train.resume`: a client group's run",
        ),
    ];
    for (name, text, expected) in cases {
        let err = EdgeConfig::load(&write(name, &text)).unwrap_err().to_string();
        assert!(err.contains(name) && err.contains(expected), "{name}: {err}");
    }
    let p = write("training.yaml", "listen: 127.0.0.1:0\nbundle: b\ntraining: {concurrent_sessions: true, checkpoint_dir: ck}\n");
    let training = ServerConfig::load(&p).unwrap().training;
    assert!(training.concurrent_sessions && training.checkpoint_dir == Some(dir.path().join("ck")));
    let group = format!("{no_input}{train}  clients: {{mode: splitfed, group: ward-3, edges: 4, edge: 1}}\n");
    let clients = EdgeConfig::load(&write("group.yaml", &group)).unwrap().train().unwrap().clients.clone().unwrap();
    assert_eq!(clients, ClientsConfig { mode: ClientMode::SplitFed, group: "ward-3".into(), edges: 4, edge: 1 });
}

#[test]
fn the_hosts_deadlines_retries_and_fallback_are_keys_with_defaults() {
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, text: &str| write_config(dir.path(), name, text);
    let base = MINIMAL_EDGE;
    let c = EdgeConfig::load(&write("defaults.yaml", base)).unwrap();
    assert_eq!(c.resilience, Resilience::default());
    assert_eq!((c.resilience.retry.max_attempts, c.resilience.fallback), (10, Fallback::None));
    let keys = "connect_timeout: 2s\nrequest_timeout: 1500ms\nkeepalive_interval: 4s\nkeepalive_timeout: 3s\n\
                retry: {max_attempts: 7, max_backoff: 9s}\nfallback: edge\n";
    let c = EdgeConfig::load(&write("keys.yaml", &format!("{base}{keys}"))).unwrap();
    let want = Resilience {
        connect_timeout: Duration::from_secs(2),
        request_timeout: Duration::from_millis(1500),
        keepalive_interval: Duration::from_secs(4),
        keepalive_timeout: Duration::from_secs(3),
        retry: RetryPolicy { max_attempts: 7, max_backoff: Duration::from_secs(9) },
        fallback: Fallback::Edge,
    };
    assert_eq!(c.resilience, want);
    for (yaml, key) in [
        ("request_timeout: 0s", "`request_timeout`: must be positive"),
        ("connect_timeout: 0s", "`connect_timeout`: must be positive"),
        ("retry: {max_attempts: 0}", "`retry.max_attempts`: must be at least 1"),
        ("retry: {max_backoff: 0s}", "`retry.max_backoff`: must be positive"),
        ("fallback: cloud", "unknown variant `cloud`, expected `none` or `edge`"),
        ("retry: {tries: 3}", "unknown field `tries`"),
    ] {
        let err = EdgeConfig::load(&write("bad.yaml", &format!("{base}{yaml}\n"))).unwrap_err().to_string();
        assert!(err.contains(key), "{yaml}: {err}");
    }
}

#[test]
fn splits_resolve_by_index_module_and_cost() {
    let bundle = Bundle::open(bundle_dir("resnet18")).unwrap();
    assert_eq!(bundle.resolve_split(&SplitSpec::Cut(0)).unwrap(), 0);
    let after = bundle.resolve_split(&SplitSpec::After("layer2".into())).unwrap();
    assert_eq!(bundle.cut(after).name, "after layer2.1.relu");
    assert_eq!(bundle.resolve_split(&SplitSpec::CostPercent(0.0)).unwrap(), 0);
    assert_eq!(
        bundle.resolve_split(&SplitSpec::CostPercent(100.0)).unwrap(),
        bundle.split_points().iter().find(|p| p.edge_cost_share >= 1.0 - 1e-12).unwrap().index
    );
    let err = bundle.resolve_split(&SplitSpec::Cut(999)).unwrap_err().to_string();
    assert!(err.contains("out of range"), "{err}");
    let err = bundle.resolve_split(&SplitSpec::After("layer9".into())).unwrap_err().to_string();
    assert!(err.contains("no stage holds module \"layer9\""), "{err}");
}

#[test]
fn synthetic_inputs_are_reproducible_from_any_thread() {
    let bundle = Bundle::open(bundle_dir("transformer")).unwrap();
    let inputs = Inputs::new(&InputSource::Synthetic { seed: 3 }, &bundle, 4).unwrap();
    let here = inputs.batch(5);
    let dir = bundle.dir().to_path_buf();
    let there = std::thread::spawn(move || {
        // Another thread drawing from libtorch's global generator must not matter.
        tch::manual_seed(99);
        let _ = Tensor::randn([100], (Kind::Float, Device::Cpu));
        let bundle = Bundle::open(dir).unwrap();
        let inputs = Inputs::new(&InputSource::Synthetic { seed: 3 }, &bundle, 4).unwrap();
        let b = inputs.batch(5);
        let meta = PayloadMeta { request_id: 0, split: 0, direction: Direction::Request };
        PayloadSender::plain().encode(meta, &Codec::RAW, &b).unwrap()
    })
    .join()
    .unwrap();
    // Tensors cannot cross threads here, so they travel as a payload.
    let mut receiver = PayloadReceiver::new(Direction::Request, u64::MAX, CodecPolicy::default(), &KeyRing::default());
    let mut assembly = receiver.start(0, &there.envelope).unwrap();
    assembly.push_data(0, &there.data).unwrap();
    let there = receiver.finish(assembly).unwrap().boundary;
    assert!(here.bit_identical(&there));
    assert!(!here.bit_identical(&inputs.batch(6)), "each request gets its own batch");
    let tokens = here.values[0].1.as_tensor().unwrap();
    assert_eq!(tokens.kind(), Kind::Int64);
    assert!(tokens.max().int64_value(&[]) < 10 && tokens.min().int64_value(&[]) >= 0);
}

#[test]
fn threads_and_cores_are_keys_of_both_configs() {
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, text: &str| write_config(dir.path(), name, text);
    let edge = MINIMAL_EDGE;
    let server = "listen: 127.0.0.1:0\nbundle: b\n";
    assert_eq!(EdgeConfig::load(&write("e.yaml", edge)).unwrap().cpu, CpuUse::default());
    assert_eq!(ServerConfig::load(&write("s.yaml", server)).unwrap().cpu, CpuUse::default());
    let want = CpuUse { threads: Some(3), cores: Some(vec![0, 2]) };
    assert_eq!(EdgeConfig::load(&write("e.yaml", &format!("{edge}threads: 3\ncores: [0, 2]\n"))).unwrap().cpu, want);
    assert_eq!(ServerConfig::load(&write("s.yaml", &format!("{server}threads: 3\ncores: [0, 2]\n"))).unwrap().cpu, want);
    for (bad, key, message) in [
        ("threads: 0", "`threads`", "expected 1 to 1024"),
        ("threads: 1025", "`threads`", "expected 1 to 1024"),
        ("cores: []", "`cores`", "an empty list"),
        ("cores: [1, 4096]", "`cores`", "core 4096: expected 0 to 1023"),
    ] {
        let err = EdgeConfig::load(&write("e.yaml", &format!("{edge}{bad}\n"))).unwrap_err().to_string();
        assert!(err.contains(key) && err.contains(message), "{bad}: {err}");
        let err = ServerConfig::load(&write("s.yaml", &format!("{server}{bad}\n"))).unwrap_err().to_string();
        assert!(err.contains(key) && err.contains(message), "{bad}: {err}");
    }
}

#[test]
fn cpu_use_applied_sets_the_threads_and_pins_the_calling_thread() {
    // On a thread of its own: the pinning stays with it.
    std::thread::spawn(|| {
        let cores = cleave_common::config::allowed_cores().unwrap();
        let before = tch::get_num_threads();
        CpuUse { threads: Some(1), cores: Some(vec![cores[0]]) }.apply().unwrap();
        assert_eq!(tch::get_num_threads(), 1);
        // A thread started now inherits the one core.
        let seen = std::thread::spawn(|| cleave_common::config::allowed_cores().unwrap()).join().unwrap();
        assert_eq!(seen, vec![cores[0]]);
        CpuUse::default().apply().unwrap();
        assert_eq!(tch::get_num_threads(), 1, "absent: left as it is");
        tch::set_num_threads(before);
        // A core the process may not use is an error that names it and the cores it may
        // use, also beside one it may (the kernel would take that set and ignore the rest).
        for asked in [vec![1023], vec![cores[0], 1023]] {
            let err = CpuUse { threads: None, cores: Some(asked.clone()) }.apply().unwrap_err().to_string();
            assert!(err.contains("core 1023 is not one this process may run on: it may use cores "), "{asked:?}: {err}");
        }
        assert_eq!(cleave_common::config::allowed_cores().unwrap(), vec![cores[0]], "a refused set pins nothing");
    })
    .join()
    .unwrap();
}

#[test]
fn log_format_is_a_key_of_both_configs() {
    use cleave_common::logs::LogFormat;
    let dir = tempfile::tempdir().unwrap();
    let edge = |extra: &str| EdgeConfig::load(&write_config(dir.path(), "e.yaml", &format!("{MINIMAL_EDGE}{extra}")));
    let server = |extra: &str| ServerConfig::load(&write_config(dir.path(), "s.yaml", &format!("listen: 127.0.0.1:0\nbundle: b\n{extra}")));
    assert_eq!(edge("").unwrap().log_format, LogFormat::Text);
    assert_eq!(edge("log_format: json\n").unwrap().log_format, LogFormat::Json);
    assert_eq!(server("").unwrap().log_format, LogFormat::Text);
    assert_eq!(server("log_format: json\n").unwrap().log_format, LogFormat::Json);
    let err = edge("log_format: xml\n").unwrap_err().to_string();
    assert!(err.contains("`log_format`") && err.contains("unknown variant `xml`, expected `text` or `json`"), "{err}");
    let err = server("log_format: xml\n").unwrap_err().to_string();
    assert!(err.contains("`log_format`") && err.contains("expected `text` or `json`"), "{err}");
}

#[test]
fn server_takes_one_url_or_a_list_each_checked() {
    let dir = tempfile::tempdir().unwrap();
    let rest = "bundle: b\nsplit: 3\ninput: {kind: synthetic}\noutput: out\n";
    let load = |server: &str| EdgeConfig::load(&write_config(dir.path(), "edge.yaml", &format!("server: {server}\n{rest}")));
    let one = load("http://a:1").unwrap();
    assert_eq!((one.server.as_str(), one.servers.clone()), ("http://a:1", vec!["http://a:1".to_string()]));
    let many = load("[http://a:1, http://b:2, http://c:3]").unwrap();
    assert_eq!(many.server, "http://a:1");
    assert_eq!(many.servers, ["http://a:1", "http://b:2", "http://c:3"]);
    for (server, expected) in [
        ("[]", "give at least one server URL"),
        ("[http://a:1, http://a:1]", "\"http://a:1\" is listed twice"),
        ("[http://a:1, b:2]", "\"b:2\": expected a URL like http://gpu-host:50051"),
    ] {
        let err = load(server).unwrap_err().to_string();
        assert!(err.contains("`server`") && err.contains(expected), "{server}: {err}");
    }
    // `resolve_every`: names resolved again and again; with TLS, the certificate's name is the
    // URL's host unless `tls.domain` says otherwise.
    std::fs::write(dir.path().join("ca.pem"), "not read here").unwrap();
    let load_with = |server: &str, extra: &str| EdgeConfig::load(&write_config(dir.path(), "edge.yaml", &format!("server: {server}\n{rest}{extra}")));
    assert_eq!(load_with("http://a:1", "resolve_every: 10s\n").unwrap().resolve_every, Some(std::time::Duration::from_secs(10)));
    assert_eq!(load("http://a:1").unwrap().resolve_every, None);
    let tls = load_with("https://cleave-server.ml.svc:50051", "resolve_every: 10s\ntls: {ca: ca.pem}\n").unwrap();
    assert_eq!(tls.link().tls.unwrap().domain.as_deref(), Some("cleave-server.ml.svc"));
    let named = load_with("https://cleave-server.ml.svc:50051", "resolve_every: 10s\ntls: {ca: ca.pem, domain: gpu.example}\n").unwrap();
    assert_eq!(named.link().tls.unwrap().domain.as_deref(), Some("gpu.example"));
    for (server, extra, expected) in [
        ("http://a:1", "resolve_every: 100ms\n", "at least 1s"),
        ("[https://a:1, https://b:1]", "resolve_every: 10s\ntls: {ca: ca.pem}\n", "set `tls.domain`"),
    ] {
        let err = load_with(server, extra).unwrap_err().to_string();
        assert!(err.contains("`resolve_every`") && err.contains(expected), "{server} {extra}: {err}");
    }
}
