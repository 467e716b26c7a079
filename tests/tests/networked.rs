//! End-to-end: a real server on an ephemeral port and real hosts streaming to it over gRPC.
//! The host's outputs must be exactly equal to running the whole bundle locally.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use cleave_client::{connect, Link, RetryPolicy};
use cleave_common::config::Limits;
use cleave_common::pb::split_inference_client::SplitInferenceClient;
use cleave_common::pb::{self, InferFrame};
use cleave_common::spec::DType;
use cleave_common::wire::{Codec, Direction, PayloadMeta, PayloadSender};
use cleave_common::{Boundary, Bundle, DeviceSpec, LoadedStages, StageRange};
use cleave_host::client::{stream_requests, Splits, StreamPlan};
use cleave_host::config::{InputSource, Resilience};
use cleave_host::inputs::Inputs;
use cleave_host::{LoopbackServer, RequestFailure};
use cleave_server::{ModelConfig, PreparedServer, SchedulerConfig};
use cleave_tests::{bundle_dir, metric_sample, parse_metrics};
use tokio_stream::StreamExt;

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
}

/// Sends `requests` batches of `batch` split at `split`; returns each request's output.
async fn run_host(url: &str, bundle: &Bundle, split: usize, batch: i64, seed: i64, requests: u64) -> Vec<(u64, Result<Boundary, RequestFailure>)> {
    let session = connect(url, bundle, &Link::plain()).await.unwrap();
    let plan = StreamPlan {
        bundle: bundle.clone(),
        split: Splits::Fixed(split),
        device: DeviceSpec::Cpu,
        warm_stages: None,
        ids: (0..requests).collect(),
        // A server that goes away is given up quickly (the shutdown test).
        resilience: Resilience { retry: RetryPolicy { max_attempts: 3, max_backoff: Duration::from_millis(200) }, ..Resilience::default() },
        in_flight: 3,
        inputs: Inputs::new(&InputSource::Synthetic { seed }, bundle, batch).unwrap(),
        codec: Codec::RAW.into(),
        key: None,
    };
    let mut outcomes = Vec::new();
    stream_requests(&session, plan, |o| outcomes.push((o.request_id, o.output))).await.unwrap();
    outcomes
}

/// The whole bundle run locally on the same inputs.
fn local(bundle: &Bundle, stages: &LoadedStages, batch: i64, seed: i64, id: u64) -> Boundary {
    let inputs = Inputs::new(&InputSource::Synthetic { seed }, bundle, batch).unwrap();
    stages.run(StageRange::all(bundle), &inputs.batch(id)).unwrap()
}

/// The first, middle and last cuts of `name` over gRPC equal the whole bundle run locally.
fn outputs_equal_local(name: &str) {
    outputs_equal_local_at(name, |n| vec![0, n / 2, n]);
}

/// The cuts `cuts(stage count)` of `name` over gRPC, at batch 1, 3 and 8, equal the whole
/// bundle run locally, bit for bit.
fn outputs_equal_local_at(name: &str, cuts: impl Fn(usize) -> Vec<usize>) {
    let bundle = Bundle::open(bundle_dir(name)).unwrap();
    let whole = LoadedStages::load(&bundle, StageRange::all(&bundle), DeviceSpec::Cpu).unwrap();
    let n = bundle.stage_count();
    let rt = runtime();
    rt.block_on(async {
        let server = LoopbackServer::start(bundle.dir(), DeviceSpec::Cpu, Limits::default()).await.unwrap();
        for split in cuts(n) {
            for batch in [1, 3, 8] {
                let outcomes = run_host(&server.url, &bundle, split, batch, 7, 2).await;
                assert_eq!(outcomes.iter().map(|(id, _)| *id).collect::<Vec<_>>(), [0, 1], "{name}: one answer per request");
                for (id, output) in outcomes {
                    let output = output.unwrap_or_else(|e| panic!("{name} split {split} batch {batch}: {e}"));
                    assert!(output.bit_identical(&local(&bundle, &whole, batch, 7, id)), "{name} split {split} batch {batch} request {id}");
                }
            }
        }
        server.shutdown().await.unwrap();
    });
}

#[test]
fn resnet18_over_grpc_equals_local() {
    outputs_equal_local("resnet18");
}

#[test]
fn mobilenet_v3_small_over_grpc_equals_local() {
    outputs_equal_local("mobilenet_v3_small");
}

#[test]
fn transformer_over_grpc_equals_local() {
    outputs_equal_local("transformer");
}

/// The transformers test bundles (token ids of any length within the bundle's range, a
/// padding mask, a dict output): at split 0 the server checks the ids against the vocabulary.
#[test]
fn hugging_face_models_over_grpc_equal_local() {
    for name in ["gpt2", "llama", "bert", "vit"] {
        outputs_equal_local(name);
    }
}

/// Models as users write them (a submodule named `meta`, audio transformers, one taking a
/// waveform of a symbolic length, a module around a transformers model), over gRPC at every cut.
#[test]
fn models_as_users_write_them_over_grpc_equal_local_at_every_cut() {
    for name in ["image_meta", "whisper_encoder", "wav2vec2", "wrapped_gpt2"] {
        outputs_equal_local_at(name, |n| (0..=n).collect());
    }
}

#[test]
fn a_split_that_changes_per_request_and_the_last_cut_give_exact_results() {
    let bundle = Bundle::open(bundle_dir("digits")).unwrap();
    let whole = LoadedStages::load(&bundle, StageRange::all(&bundle), DeviceSpec::Cpu).unwrap();
    let n = bundle.stage_count();
    let schedule = vec![n, 0, 5, n, 11];
    runtime().block_on(async {
        let server = LoopbackServer::start(bundle.dir(), DeviceSpec::Cpu, Limits::default()).await.unwrap();
        let session = connect(&server.url, &bundle, &Link::plain()).await.unwrap();
        let plan = StreamPlan {
            bundle: bundle.clone(),
            split: Splits::RoundRobin(schedule.clone()),
            device: DeviceSpec::Cpu,
            warm_stages: None,
            ids: (0..10).collect(),
            resilience: Default::default(),
            in_flight: 2,
            inputs: Inputs::new(&InputSource::Synthetic { seed: 5 }, &bundle, 3).unwrap(),
            codec: Codec::RAW.into(),
            key: None,
        };
        let mut outcomes = Vec::new();
        stream_requests(&session, plan, |o| outcomes.push(o)).await.unwrap();
        outcomes.sort_by_key(|o| o.request_id);
        assert_eq!(outcomes.iter().map(|o| o.request_id).collect::<Vec<_>>(), (0..10).collect::<Vec<_>>());
        for o in outcomes {
            let split = schedule[o.request_id as usize % schedule.len()];
            assert_eq!(o.metrics.split, split, "request {}", o.request_id);
            let output = o.output.unwrap_or_else(|e| panic!("request {} at cut {split}: {e}", o.request_id));
            assert!(output.bit_identical(&local(&bundle, &whole, 3, 5, o.request_id)), "request {} at cut {split}", o.request_id);
            // At the last cut everything ran on the edge: nothing crossed the network.
            let crossed = o.metrics.bytes_wire > 0 && o.metrics.round_trip_ms > 0.0;
            assert_eq!(crossed, split != n, "request {} at cut {split}: {:?}", o.request_id, o.metrics);
        }
        server.shutdown().await.unwrap();
    });
}

/// A raw boundary is copied at most once on each side outside gRPC: the host sends it from its
/// tensor's memory (channels_last, as it lies), the server copies it once from the frames into
/// the tensor its suffix runs on; the result (small enough to be gathered into the payload)
/// once each way.
#[test]
fn a_raw_boundary_is_copied_at_most_once_per_side() {
    let bundle = Bundle::open(bundle_dir("resnet18")).unwrap();
    let rt = runtime();
    rt.block_on(async {
        let model = ModelConfig::new(bundle.dir(), DeviceSpec::Cpu);
        let prepared = tokio::task::spawn_blocking(move || {
            PreparedServer::prepare_models(&[model], SchedulerConfig::default(), Limits::default(), Default::default()).unwrap()
        })
        .await
        .unwrap();
        let metrics = prepared.metrics();
        let server = LoopbackServer::serve(prepared).await.unwrap();
        let session = connect(&server.url, &bundle, &Link::plain()).await.unwrap();
        let plan = StreamPlan {
            bundle: bundle.clone(),
            split: Splits::Fixed(3),
            device: DeviceSpec::Cpu,
            warm_stages: None,
            ids: (0..4).collect(),
            resilience: Resilience::default(),
            in_flight: 2,
            inputs: Inputs::new(&InputSource::Synthetic { seed: 5 }, &bundle, 2).unwrap(),
            codec: Codec::RAW.into(),
            key: None,
        };
        let mut outcomes = Vec::new();
        stream_requests(&session, plan, |o| outcomes.push(o)).await.unwrap();
        let (mut boundaries, mut results) = (0, 0);
        for o in &outcomes {
            let result = o.output.as_ref().unwrap().tensor_bytes() as u64;
            let m = &o.metrics;
            assert!(m.bytes_raw >= 256 << 10, "a boundary of {} bytes", m.bytes_raw);
            // The inference stages' activations are channels_last: they travel as they lie.
            assert_eq!(m.copied_sent_bytes, 0, "request {}: the boundary is sent from its tensor's memory", o.request_id);
            assert!(
                m.copied_received_bytes > 0 && m.copied_received_bytes <= result,
                "request {}: {} bytes copied of a {result}-byte result",
                o.request_id,
                m.copied_received_bytes
            );
            (boundaries, results) = (boundaries + m.bytes_raw, results + result);
        }
        let scrape = parse_metrics(&metrics.render());
        let model = [("model", bundle.id())];
        assert_eq!(metric_sample(&scrape, "cleave_received_copied_bytes_total", &model), boundaries as f64, "once from the frames into the tensors");
        let sent = metric_sample(&scrape, "cleave_sent_copied_bytes_total", &model);
        assert!(sent > 0.0 && sent <= results as f64, "{sent} bytes copied to send {results} bytes of results");
    });
}

#[test]
fn several_hosts_at_once_each_get_their_own_results() {
    let bundle = Bundle::open(bundle_dir("digits")).unwrap();
    let whole = Arc::new(LoadedStages::load(&bundle, StageRange::all(&bundle), DeviceSpec::Cpu).unwrap());
    runtime().block_on(async {
        let server = LoopbackServer::start(bundle.dir(), DeviceSpec::Cpu, Limits::default()).await.unwrap();
        let hosts: Vec<_> = (0..4)
            .map(|h| {
                let (url, bundle) = (server.url.clone(), bundle.clone());
                tokio::spawn(async move { (h, run_host(&url, &bundle, 1 + h as usize * 3, 4, 100 + h, 10).await) })
            })
            .collect();
        for host in hosts {
            let (h, outcomes) = host.await.unwrap();
            assert_eq!(outcomes.len(), 10);
            for (id, output) in outcomes {
                assert!(output.unwrap().bit_identical(&local(&bundle, &whole, 4, 100 + h, id)), "host {h} request {id}");
            }
        }
        server.shutdown().await.unwrap();
    });
}

/// A raw client for sending hand-made (bad) frames.
async fn raw_client(url: &str) -> SplitInferenceClient<tonic::transport::Channel> {
    SplitInferenceClient::connect(url.to_string()).await.unwrap()
}

fn frames_for(id: u64, split: u32, boundary: &Boundary) -> Vec<InferFrame> {
    let meta = PayloadMeta { request_id: id, split, direction: Direction::Request };
    let enc = PayloadSender::plain().encode(meta, &Codec::RAW, boundary).unwrap();
    vec![InferFrame { request_id: id, header: enc.envelope, data: enc.data.to_vec().into(), last: true, ..Default::default() }]
}

/// Rewrites the (unsealed) payload header of a first frame.
fn edit_header(frame: &mut InferFrame, f: impl FnOnce(&mut cleave_codec::pb::PayloadHeader)) {
    use prost::Message;
    let mut envelope = cleave_codec::pb::PayloadEnvelope::decode(&frame.header[..]).unwrap();
    let mut header = cleave_codec::pb::PayloadHeader::decode(&envelope.header[..]).unwrap();
    f(&mut header);
    envelope.header = header.encode_to_vec().into();
    frame.header = envelope.encode_to_vec().into();
}

/// Sends the frames on one stream with the right bundle id; returns every result frame.
async fn send(url: &str, bundle: &Bundle, frames: Vec<InferFrame>) -> Vec<pb::ResultFrame> {
    let mut client = raw_client(url).await;
    let mut request = tonic::Request::new(tokio_stream::iter(frames));
    request.metadata_mut().insert(cleave_common::protocol::BUNDLE_ID_METADATA, bundle.id().parse().unwrap());
    let mut inbound = client.infer(request).await.unwrap().into_inner();
    let mut out = Vec::new();
    while let Some(frame) = inbound.next().await {
        out.push(frame.unwrap());
    }
    out
}

fn error_of(frames: &[pb::ResultFrame], id: u64) -> (tonic::Code, String) {
    let frame = frames.iter().find(|f| f.request_id == id).unwrap_or_else(|| panic!("no answer for request {id}"));
    let err = frame.error.as_ref().unwrap_or_else(|| panic!("request {id} succeeded"));
    (tonic::Code::from(err.code), err.message.clone())
}

#[test]
fn bad_requests_get_clear_errors_and_the_stream_keeps_serving() {
    let bundle = Bundle::open(bundle_dir("digits")).unwrap();
    let n = bundle.stage_count() as u32;
    let (input, _) = bundle.reference(3).unwrap();
    let limits = Limits { max_payload_bytes: 1 << 20, ..Limits::default() };
    runtime().block_on(async {
        let server = LoopbackServer::start(bundle.dir(), DeviceSpec::Cpu, limits).await.unwrap();
        let good = frames_for(0, 0, &input);

        // Wrong bundle id: refused at the handshake, naming both ids.
        let mut client = raw_client(&server.url).await;
        let mut request = tonic::Request::new(tokio_stream::iter(good.clone()));
        request.metadata_mut().insert(cleave_common::protocol::BUNDLE_ID_METADATA, "deadbeef".parse().unwrap());
        let status = client.infer(request).await.unwrap_err();
        assert_eq!(status.code(), tonic::Code::FailedPrecondition);
        assert!(status.message().contains("the host has bundle deadbeef") && status.message().contains(bundle.id()), "{status}");

        let mut frames = Vec::new();
        // 1: split out of range.
        frames.extend(frames_for(1, n + 1, &input));
        // 2: a shape that does not match the manifest.
        let wrong = Boundary {
            values: vec![("x".into(), cleave_common::Value::Tensor(tch::Tensor::zeros([3, 1, 9, 8], (tch::Kind::Float, tch::Device::Cpu))))],
        };
        frames.extend(frames_for(2, 0, &wrong));
        // 3: truncated payload (last frame ends early).
        let mut truncated = frames_for(3, 0, &input);
        truncated[0].data = truncated[0].data.slice(..truncated[0].data.len() - 4);
        frames.extend(truncated);
        // 4: a declared size over the server's payload limit, in two frames (the second is skipped).
        let mut big = frames_for(4, 0, &input);
        edit_header(&mut big[0], |h| {
            h.tensors[0].shape = vec![16, 1, 256, 256];
            h.tensors[0].byte_len = 16 * 256 * 256 * 4;
        });
        big[0].last = false;
        frames.extend(big);
        frames.push(InferFrame { request_id: 4, data: Bytes::from(vec![0u8; 16]), last: true, ..Default::default() });
        // 5: garbage in a tensor field (a dtype nobody knows).
        let mut garbage = frames_for(5, 0, &input);
        edit_header(&mut garbage[0], |h| h.tensors[0].dtype = "\u{1}garbage".into());
        frames.extend(garbage);
        // 6: a declared byte length that does not fit the shape.
        let mut lying = frames_for(6, 0, &input);
        edit_header(&mut lying[0], |h| h.tensors[0].byte_len += 1);
        frames.extend(lying);
        // 7: a good request after all of that.
        frames.extend(frames_for(7, 0, &input));
        let answers = send(&server.url, &bundle, frames).await;

        let ids: Vec<u64> = answers.iter().filter(|f| f.last).map(|f| f.request_id).collect();
        assert_eq!(ids, [1, 2, 3, 4, 5, 6, 7], "exactly one answer per request, in order");
        let (code, msg) = error_of(&answers, 1);
        assert_eq!(code, tonic::Code::InvalidArgument);
        assert!(msg.contains(&format!("split {} is out of range", n + 1)), "{msg}");
        let (code, msg) = error_of(&answers, 2);
        assert_eq!(code, tonic::Code::InvalidArgument);
        assert!(msg.contains("expected float32[B, 1, 8, 8], got float32[3, 1, 9, 8]"), "{msg}");
        let (code, msg) = error_of(&answers, 3);
        assert_eq!(code, tonic::Code::InvalidArgument);
        assert!(msg.contains("payload truncated"), "{msg}");
        let (code, msg) = error_of(&answers, 4);
        assert_eq!(code, tonic::Code::ResourceExhausted);
        assert!(msg.contains("exceeds the limit of 1048576 bytes"), "{msg}");
        let (code, msg) = error_of(&answers, 5);
        assert_eq!(code, tonic::Code::InvalidArgument);
        assert!(msg.contains("unknown dtype"), "{msg}");
        let (_, msg) = error_of(&answers, 6);
        assert!(msg.contains("declared 769 bytes"), "{msg}");
        let ok = answers.iter().find(|f| f.request_id == 7).unwrap();
        assert!(ok.error.is_none() && ok.timings.is_some());

        // The server still serves a fresh host.
        let outcomes = run_host(&server.url, &bundle, 2, 3, 1, 2).await;
        assert!(outcomes.iter().all(|(_, o)| o.is_ok()));
        server.shutdown().await.unwrap();
    });
}

#[test]
fn host_with_another_bundle_is_refused_naming_both() {
    let digits = Bundle::open(bundle_dir("digits")).unwrap();
    let other = Bundle::open(bundle_dir("transformer")).unwrap();
    runtime().block_on(async {
        let server = LoopbackServer::start(digits.dir(), DeviceSpec::Cpu, Limits::default()).await.unwrap();
        let err = connect(&server.url, &other, &Link::plain()).await.expect_err("refused");
        let text = err.to_string();
        assert!(text.contains("bundle mismatch") && text.contains(other.id()) && text.contains(digits.id()), "{text}");
        assert!(!text.contains("another export"), "{text}");
        // Another export of the same model (another seed): what differs, and the fix.
        let (_tmp, copy) = cleave_tests::bundle_copy("digits");
        let manifest = copy.join("manifest.json");
        let mut m: serde_json::Value = serde_json::from_slice(&std::fs::read(&manifest).unwrap()).unwrap();
        m["model"]["seed"] = 7.into();
        std::fs::write(&manifest, serde_json::to_vec(&m).unwrap()).unwrap();
        let reseeded = Bundle::open(&copy).unwrap();
        let text = connect(&server.url, &reseeded, &Link::plain()).await.expect_err("refused").to_string();
        let expected =
            format!("; {} is another export of the same model (seed 0 there, 7 here): copy one bundle directory to both sides", &digits.id()[..16]);
        assert!(text.contains(reseeded.id()) && text.ends_with(&expected), "{text}");
        server.shutdown().await.unwrap();
    });
}

/// A program that embeds `cleave-client` (no host run; the host crate only makes the inputs
/// and starts the server): it connects, opens an `Infer` stream, sends boundaries it computed
/// as tensors, raw and lz4-compressed, and receives each result bit for bit the suffix run
/// locally; a request at a cut the bundle lacks gets the server's error for that request
/// alone, and the stream goes on serving.
#[test]
fn the_client_library_sends_boundaries_as_tensors_and_receives_exact_results() {
    use cleave_client::{AnswerError, InferSetup};
    let bundle = Bundle::open(bundle_dir("digits")).unwrap();
    let whole = LoadedStages::load(&bundle, StageRange::all(&bundle), DeviceSpec::Cpu).unwrap();
    let split = 2;
    let prefix = StageRange::prefix(split);
    runtime().block_on(async {
        let server = LoopbackServer::start(bundle.dir(), DeviceSpec::Cpu, Limits::default()).await.unwrap();
        let session = connect(&server.url, &bundle, &Link::plain()).await.unwrap();
        let codecs = ["raw", "lz4"].map(|c| c.parse::<Codec>().unwrap());
        let mut stream = InferSetup::new(codecs.to_vec(), None, Duration::from_secs(5)).open(&session).await.unwrap();
        let mut sender = PayloadSender::plain();
        let inputs = Inputs::new(&InputSource::Synthetic { seed: 5 }, &bundle, 4).unwrap();
        for (id, codec) in [(0u64, codecs[0]), (1, codecs[1])] {
            let boundary = whole.run(prefix, &inputs.batch(id)).unwrap();
            stream.send_boundary(&mut sender, id, split as u32, &codec, &boundary).unwrap();
            let answer = stream.next_answer().await.unwrap();
            assert_eq!(answer.id, id);
            let want = whole.run(StageRange::suffix(&bundle, split), &boundary).unwrap();
            assert!(answer.output.unwrap().bit_identical(&want), "{codec}: the result is the suffix run locally");
        }
        let boundary = whole.run(prefix, &inputs.batch(2)).unwrap();
        let beyond = bundle.stage_count() as u32 + 5;
        stream.send_boundary(&mut sender, 2, beyond, &Codec::RAW, &boundary).unwrap();
        let answer = stream.next_answer().await.unwrap();
        assert_eq!(answer.id, 2);
        match answer.output {
            Err(AnswerError::Refused { code, message }) => {
                assert!(code == tonic::Code::InvalidArgument && message.contains(&beyond.to_string()), "{code:?}: {message}")
            }
            other => panic!("a cut the bundle lacks is refused: {other:?}"),
        }
        stream.send_boundary(&mut sender, 3, split as u32, &Codec::RAW, &boundary).unwrap();
        let answer = stream.next_answer().await.unwrap();
        assert_eq!(answer.id, 3);
        assert!(answer.output.unwrap().bit_identical(&whole.run(StageRange::suffix(&bundle, split), &boundary).unwrap()));
        server.shutdown().await.unwrap();
    });
}

#[test]
fn large_boundaries_are_split_into_frames_and_reassembled() {
    // A 256 KiB message limit forces resnet18's boundaries over several frames each way.
    let bundle = Bundle::open(bundle_dir("resnet18")).unwrap();
    let whole = LoadedStages::load(&bundle, StageRange::all(&bundle), DeviceSpec::Cpu).unwrap();
    let limits = Limits { max_message_bytes: 256 << 10, ..Limits::default() };
    runtime().block_on(async {
        let server = LoopbackServer::start(bundle.dir(), DeviceSpec::Cpu, limits).await.unwrap();
        let outcomes = run_host(&server.url, &bundle, 1, 8, 3, 2).await;
        for (id, output) in outcomes {
            assert!(output.unwrap().bit_identical(&local(&bundle, &whole, 8, 3, id)));
        }
        server.shutdown().await.unwrap();
    });
}

#[test]
fn shutdown_answers_the_requests_received_then_ends_the_stream() {
    // The server stops reading when it drains: what it received is answered (exactly, in
    // order), the stream then ends, and the server stops while the host still has requests:
    // the host tries to reconnect `retry.max_attempts` (3) times, then gives every request it
    // sent and had no answer for an error (those it never sent get none).
    let bundle = Bundle::open(bundle_dir("resnet18")).unwrap();
    let whole = LoadedStages::load(&bundle, StageRange::all(&bundle), DeviceSpec::Cpu).unwrap();
    runtime().block_on(async {
        let server = LoopbackServer::start(bundle.dir(), DeviceSpec::Cpu, Limits::default()).await.unwrap();
        let (url, b) = (server.url.clone(), bundle.clone());
        // Many more requests than the host keeps in flight (3) or has answered by the time
        // the server is asked to stop: some are never received, whatever the machine's speed.
        let host = tokio::spawn(async move { run_host(&url, &b, 3, 8, 5, 40).await });
        // Ask the server to stop while the host is still streaming.
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        assert!(!host.is_finished(), "the host should still be streaming when shutdown starts");
        server.shutdown().await.unwrap();
        let outcomes = host.await.unwrap();
        let answered = outcomes.iter().take_while(|(_, o)| o.is_ok()).count();
        assert!(answered > 0 && answered < 40, "{answered} of 40 answered");
        for (i, (id, output)) in outcomes.into_iter().enumerate() {
            assert_eq!(id, i as u64, "outcomes come in order");
            match output {
                Ok(output) => assert!(i < answered && output.bit_identical(&local(&bundle, &whole, 8, 5, id)), "request {id} is answered exactly"),
                // Sent but never read by the draining server: an error, never a wrong result.
                Err(e) => assert!(i >= answered && e.to_string().contains("in 3 attempts in a row"), "request {id}: {e}"),
            }
        }
    });
}

#[test]
fn a_host_with_defaults_takes_its_message_limit_from_a_server_with_32_mib_messages() {
    // The host's own defaults allow 8 MiB messages; the server announces 32 MiB in `Info`,
    // and the host frames and accepts by the server's limit (a 20 MiB message both ways).
    let bundle = Bundle::open(bundle_dir("resnet18")).unwrap();
    let whole = LoadedStages::load(&bundle, StageRange::all(&bundle), DeviceSpec::Cpu).unwrap();
    let limits = Limits { max_message_bytes: 32 << 20, ..Limits::default() };
    assert!(limits.max_message_bytes > Limits::default().max_message_bytes);
    runtime().block_on(async {
        let server = LoopbackServer::start(bundle.dir(), DeviceSpec::Cpu, limits).await.unwrap();
        let mut session = connect(&server.url, &bundle, &Link::plain()).await.unwrap();
        assert_eq!(session.server.limits, limits);
        assert_eq!(session.chunk_bytes(), cleave_common::wire::chunk_bytes_for(32 << 20));
        let size = 20usize << 20;
        let echo = pb::EchoRequest { payload: Bytes::from(vec![7u8; size]), reply_bytes: size as u64 };
        let back = session.client.echo(echo).await.expect("a 20 MiB message each way fits the server's 32 MiB").into_inner();
        assert_eq!(back.payload.len(), size);
        let outcomes = run_host(&server.url, &bundle, 1, 8, 11, 2).await;
        for (id, output) in outcomes {
            assert!(output.unwrap().bit_identical(&local(&bundle, &whole, 8, 11, id)));
        }
        server.shutdown().await.unwrap();
    });
}

#[test]
fn a_request_that_does_not_fit_its_cut_is_refused_from_its_first_frame() {
    // The envelope alone says the tensor is [4096, 1, 8, 8] (1 MiB, within the payload limit)
    // at a cut that takes batches up to 16: the server answers before any data arrives, so
    // nothing was reserved for it; the rest of its frames are skipped and the stream goes on.
    let bundle = Bundle::open(bundle_dir("digits")).unwrap();
    let (input, _) = bundle.reference(3).unwrap();
    runtime().block_on(async {
        let server = LoopbackServer::start(bundle.dir(), DeviceSpec::Cpu, Limits::default()).await.unwrap();
        let mut client = raw_client(&server.url).await;
        let (tx, rx) = tokio::sync::mpsc::channel::<InferFrame>(8);
        let mut request = tonic::Request::new(tokio_stream::wrappers::ReceiverStream::new(rx));
        request.metadata_mut().insert(cleave_common::protocol::BUNDLE_ID_METADATA, bundle.id().parse().unwrap());
        let mut inbound = client.infer(request).await.unwrap().into_inner();

        let mut first = frames_for(1, 0, &input).remove(0);
        let bytes = 4096 * 64 * 4;
        edit_header(&mut first, |h| {
            h.tensors[0].shape = vec![4096, 1, 8, 8];
            h.tensors[0].byte_len = bytes;
            h.tensors[0].wire_len = bytes;
            h.wire_len = bytes;
        });
        first.data = Bytes::new();
        first.last = false;
        tx.send(first).await.unwrap();
        let answer =
            tokio::time::timeout(std::time::Duration::from_secs(30), inbound.next()).await.expect("answered with no data sent").unwrap().unwrap();
        let (code, msg) = error_of(std::slice::from_ref(&answer), 1);
        assert_eq!(code, tonic::Code::InvalidArgument);
        assert!(msg.contains("batch size 4096 is outside the bundle's range 1..=16"), "{msg}");

        // Its remaining frames are skipped; the next request is served.
        tx.send(InferFrame { request_id: 1, data: Bytes::from(vec![0u8; 1024]), last: true, ..Default::default() }).await.unwrap();
        tx.send(frames_for(2, 0, &input).remove(0)).await.unwrap();
        drop(tx);
        let rest: Vec<pb::ResultFrame> = inbound.map(|f| f.unwrap()).collect().await;
        assert_eq!(rest.iter().filter(|f| f.last).map(|f| f.request_id).collect::<Vec<_>>(), [2]);
        assert!(rest.iter().all(|f| f.error.is_none()));
        server.shutdown().await.unwrap();
    });
}

/// The reference of a bundle exported with `--generation`: token ids [B, T] and
/// transformers' logits [B, T, vocab] with its own cache.
fn generation_reference(bundle: &Bundle) -> (tch::Tensor, tch::Tensor) {
    let info = bundle.manifest().generation.as_ref().expect("exported with --generation");
    let tensors = tch::Tensor::read_safetensors(bundle.dir().join(&info.reference.file)).unwrap();
    let get = |name: &str| tensors.iter().find(|(n, _)| n == name).expect(name).1.shallow_clone();
    (get("input_ids"), get("logits"))
}

/// The code and message of the server's refusal.
fn refusal<T>(result: Result<T, impl Into<cleave_host::HostError>>) -> (tonic::Code, String) {
    match result.map_err(Into::into) {
        Err(cleave_host::HostError::Link(cleave_client::LinkError::Rpc { code, message, .. })) => (code, message),
        Err(other) => panic!("expected a refusal, got {other}"),
        Ok(_) => panic!("expected a refusal"),
    }
}

fn relative_error(got: &tch::Tensor, want: &tch::Tensor) -> f64 {
    (got - want).abs().max().double_value(&[]) / want.abs().max().double_value(&[])
}

/// Split generation over gRPC (issue 40, item 4): the GPT-2 and Llama test bundles at every
/// cut the server may take, its range ending with the head or (`tail_on_edge`) before it,
/// teacher-forced (the prompt in one step, then one token at a time) give transformers'
/// logits with its cache within 1e-4 of their largest magnitude; and two rows at different
/// positions in one session (the second restarted part-way) each give their own.
#[test]
fn split_generation_over_grpc_gives_transformers_logits_at_every_cut() {
    use cleave_host::generation::{GenerationSplit, SplitGenerator};
    let rt = runtime();
    for name in ["gpt2", "llama"] {
        let bundle = Bundle::open(bundle_dir(name)).unwrap();
        let info = bundle.manifest().generation.clone().unwrap();
        let (ids, want) = generation_reference(&bundle);
        let (total, n, prompt, max_len) = (ids.size()[1], info.stages.len(), info.reference.prompt, info.reference.max_len);
        let ids = ids.narrow(0, 0, 1);
        let want = want.narrow(0, 0, 1);
        rt.block_on(async {
            let server = LoopbackServer::start(bundle.dir(), DeviceSpec::Cpu, Limits::default()).await.unwrap();
            let mut session = connect(&server.url, &bundle, &Link::plain()).await.unwrap();
            let splits = (1..n).map(|cut| (cut, false)).chain((1..n - 1).map(|cut| (cut, true)));
            for (cut, tail_on_edge) in splits {
                let split = GenerationSplit { cut, tail_on_edge, batch: 1, max_len };
                let mut generator = SplitGenerator::open(&bundle, &mut session, split).await.unwrap();
                let mut logits = vec![generator.step(&ids.narrow(1, 0, prompt), &[], false).await.unwrap()];
                for t in prompt..total {
                    logits.push(generator.step(&ids.narrow(1, t, 1), &[], true).await.unwrap());
                }
                assert_eq!(generator.lengths(), [total]);
                let error = relative_error(&tch::Tensor::cat(&logits, 1), &want);
                assert!(error <= 1e-4, "{name} cut {cut} tail on the edge {tail_on_edge}: relative error {error:e}");
            }
            // Two rows: the second restarts at position 0 five tokens after the prompt and is
            // fed the same tokens again, so each step holds two positions.
            let split = GenerationSplit { cut: n / 2, tail_on_edge: false, batch: 2, max_len };
            let mut generator = SplitGenerator::open(&bundle, &mut session, split).await.unwrap();
            let both = generator.step(&ids.narrow(1, 0, prompt).repeat([2, 1]), &[], true).await.unwrap();
            assert!(relative_error(&both, &want.narrow(1, prompt - 1, 1).repeat([2, 1, 1])) <= 1e-4, "{name}: the prompt");
            let restart = prompt + 5;
            for t in prompt..total {
                let other = if t < restart { t } else { t - restart };
                let step_ids = tch::Tensor::cat(&[ids.narrow(1, t, 1), ids.narrow(1, other, 1)], 0);
                let restarted: &[usize] = if t == restart { &[1] } else { &[] };
                let got = generator.step(&step_ids, restarted, true).await.unwrap();
                assert!(relative_error(&got.narrow(0, 0, 1), &want.narrow(1, t, 1)) <= 1e-4, "{name} row 0 at {t}");
                assert!(relative_error(&got.narrow(0, 1, 1), &want.narrow(1, other, 1)) <= 1e-4, "{name} row 1 at {other}");
            }
            assert_eq!(generator.lengths(), [total, total - restart]);
            drop((generator, session));
            server.shutdown().await.unwrap();
            // Under the smallest message limit, a step of a row's 500 logits fills a message:
            // the prompt goes one token a step (a chunked prefill) and gives the same logits.
            let limits = Limits { max_message_bytes: Limits::MIN_MESSAGE_BYTES + 1024, ..Limits::default() };
            let server = LoopbackServer::start(bundle.dir(), DeviceSpec::Cpu, limits).await.unwrap();
            let mut session = connect(&server.url, &bundle, &Link::plain()).await.unwrap();
            for last_only in [false, true] {
                let split = GenerationSplit { cut: n / 2, tail_on_edge: false, batch: 1, max_len };
                let mut generator = SplitGenerator::open(&bundle, &mut session, split).await.unwrap();
                let got = generator.step(&ids.narrow(1, 0, prompt), &[], last_only).await.unwrap();
                let want = if last_only { want.narrow(1, prompt - 1, 1) } else { want.narrow(1, 0, prompt) };
                assert!(relative_error(&got, &want) <= 1e-4, "{name}: a chunked prompt, last token only {last_only}");
                assert_eq!(generator.lengths(), [prompt]);
            }
            drop(session);
            server.shutdown().await.unwrap();
        });
    }
}

/// Continuous batching (issue 40, item 6): sessions decoding at once at one cut run their
/// decode steps as one batch on the server (the metric counts them), joining and leaving
/// between steps, each at its own positions and some of other cache lengths, while a session
/// at another cut runs beside them; every session's logits at every step are within 1e-5 of
/// the same session's run alone on the same server, where no step waited for company. GPT-2
/// waits up to 20 ms for a batch to fill; Llama takes what waits (`max_wait` 0) in batches of
/// at most 2 rows.
#[test]
fn sessions_decoding_together_are_batched_and_each_gives_its_logits_alone() {
    use cleave_host::generation::{GenerationSplit, SplitGenerator};
    use cleave_server::GenerationOptions;
    /// A session: its rows of the reference, cut, cache length, the rounds it joins and
    /// leaves at.
    struct Plan {
        rows: (i64, i64),
        cut: usize,
        tail_on_edge: bool,
        max_len: i64,
        joins: usize,
        leaves: usize,
    }
    let rt = runtime();
    for (name, max_batch, max_wait) in [("gpt2", 16, Duration::from_millis(20)), ("llama", 2, Duration::ZERO)] {
        let bundle = Bundle::open(bundle_dir(name)).unwrap();
        let info = bundle.manifest().generation.clone().unwrap();
        let (ids, _) = generation_reference(&bundle);
        let (total, n, prompt, max_len) = (ids.size()[1], info.stages.len(), info.reference.prompt, info.reference.max_len);
        let steps = (total - prompt + 1) as usize;
        let mid = n / 2;
        let plan = |rows, cut, joins, leaves| Plan { rows, cut, tail_on_edge: false, max_len, joins, leaves };
        let plans = [
            plan((0, 1), mid, 0, 20),
            plan((0, 2), mid, 0, steps),
            Plan { max_len: total + 1, ..plan((1, 1), mid, 5, 5 + steps) },
            // A short cache beside rows far past its end: padded in the batch.
            Plan { max_len: prompt + 5, ..plan((1, 1), mid, 15, 21) },
            Plan { tail_on_edge: true, ..plan((0, 1), 1, 2, 2 + steps) },
        ];
        // Step k of a session: the prompt, then one token at a time (teacher-forced).
        let step_ids = |plan: &Plan, k: usize| {
            let rows = ids.narrow(0, plan.rows.0, plan.rows.1);
            if k == 0 {
                rows.narrow(1, 0, prompt)
            } else {
                rows.narrow(1, prompt + k as i64 - 1, 1)
            }
        };
        rt.block_on(async {
            let dir = bundle.dir().to_path_buf();
            let prepared = tokio::task::spawn_blocking(move || {
                let options = GenerationOptions { max_batch, max_wait, ..GenerationOptions::default() };
                PreparedServer::prepare(&dir, DeviceSpec::Cpu, Limits::default(), Default::default()).unwrap().with_generation(options)
            })
            .await
            .unwrap();
            let metrics = prepared.metrics();
            let batched = || metric_sample(&parse_metrics(&metrics.render()), "cleave_generation_batched_steps_total", &[("model", bundle.id())]);
            let server = LoopbackServer::serve(prepared).await.unwrap();
            let mut session = connect(&server.url, &bundle, &Link::plain()).await.unwrap();
            let open = |plan: &Plan| GenerationSplit { cut: plan.cut, tail_on_edge: plan.tail_on_edge, batch: plan.rows.1, max_len: plan.max_len };
            // Each session alone, one after the other, beside an idle session of another
            // range, whose steps could never join its batches.
            let idle = GenerationSplit { cut: mid + 1, tail_on_edge: false, batch: 1, max_len };
            let idle = SplitGenerator::open(&bundle, &mut session, idle).await.unwrap();
            let (mut alone, mut queued_ms) = (Vec::new(), Vec::new());
            for plan in &plans {
                let mut generator = SplitGenerator::open(&bundle, &mut session, open(plan)).await.unwrap();
                let mut logits = Vec::new();
                for k in 0..plan.leaves - plan.joins {
                    logits.push(generator.step(&step_ids(plan, k), &[], true).await.unwrap());
                    queued_ms.push(generator.server_times().queue_ms);
                }
                alone.push(logits);
            }
            assert_eq!(batched(), 0.0, "{name}: a session alone is never batched");
            // Every step ran on the device's scheduler, one piece of its work each (counted
            // before its answer goes); no inference.
            let work = |kind| metric_sample(&parse_metrics(&metrics.render()), "cleave_device_work_total", &[("device", "cpu"), ("kind", kind)]);
            let steps: usize = plans.iter().map(|p| p.leaves - p.joins).sum();
            assert_eq!(work("generate"), steps as f64, "{name}: each step alone is one piece of the device's work");
            assert_eq!(work("infer"), 0.0, "{name}");
            // Nor does it wait for company: no other session of its range is open (the server
            // says how long each step waited; the median, one slow step is not the rule).
            drop(idle);
            queued_ms.sort_by(f64::total_cmp);
            let median = queued_ms[queued_ms.len() / 2];
            assert!(median < max_wait.as_secs_f64() * 1e3 / 2.0 || max_wait.is_zero(), "{name}: a lone session's steps waited {median} ms");
            // All together: each round, every open session's next step at once.
            let mut generators: Vec<Option<SplitGenerator>> = plans.iter().map(|_| None).collect();
            let last_round = plans.iter().map(|p| p.leaves).max().unwrap();
            for round in 0..last_round {
                for (plan, generator) in plans.iter().zip(&mut generators) {
                    if round == plan.joins {
                        *generator = Some(SplitGenerator::open(&bundle, &mut session, open(plan)).await.unwrap());
                    }
                    if round == plan.leaves {
                        *generator = None;
                    }
                }
                let stepping = plans.iter().zip(&mut generators).enumerate().filter_map(|(i, (plan, g))| g.as_mut().map(|g| (i, plan, g)));
                let outputs = futures_util::future::join_all(stepping.map(|(i, plan, g)| {
                    let k = round - plan.joins;
                    let input = step_ids(plan, k);
                    async move { (i, k, g.step(&input, &[], true).await.unwrap()) }
                }))
                .await;
                for (i, k, got) in outputs {
                    let error = relative_error(&got, &alone[i][k]);
                    assert!(error <= 1e-5, "{name}: session {i} step {k} (round {round}) is {error:e} from its run alone");
                }
            }
            // Where steps wait for a batch to fill, they are batched (the sessions' steps
            // come within a few ms); where they do not, whether they meet is up to timing.
            if !max_wait.is_zero() {
                assert!(batched() > 0.0, "{name}: no decode steps ran batched");
            }
            drop((generators, session));
            server.shutdown().await.unwrap();
        });
    }
}

/// Generation shares the device (issue 70, item 5). With `generation.prefill_chunk_tokens` 1,
/// a prompt's step runs one position a turn of the device (the work metric counts each part)
/// and gives transformers' logits with its cache; and while another peer (127.0.0.2) has four
/// sessions' prompts of 16 rows x 63 tokens running, a decode step from 127.0.0.1, sent once
/// their first part has run, is answered before any of them: their parts take turns, one of
/// that peer's in the device's queue at a time. (Whole, they queue as four turns, and a step
/// sent after the first ran is answered after the others.)
/// A server for `bundle` whose prompts run one position a part (its batches not waiting), and
/// the count of generation work its device has done.
async fn server_with_parts_of_one(bundle: &Bundle) -> (PreparedServer, impl Fn() -> f64) {
    use cleave_server::GenerationOptions;
    let dir = bundle.dir().to_path_buf();
    let prepared = tokio::task::spawn_blocking(move || {
        let options = GenerationOptions { prefill_chunk_tokens: 1, max_wait: Duration::ZERO, ..GenerationOptions::default() };
        PreparedServer::prepare(&dir, DeviceSpec::Cpu, Limits::default(), Default::default()).unwrap().with_generation(options)
    })
    .await
    .unwrap();
    let metrics = prepared.metrics();
    let work = move || metric_sample(&parse_metrics(&metrics.render()), "cleave_device_work_total", &[("device", "cpu"), ("kind", "generate")]);
    (prepared, work)
}

/// A prompt of `tokens` tokens for each of `rows` rows from their first position, its hidden
/// states `hidden`, answered with its last token's most likely.
fn whole_prompt(rows: u32, tokens: u32, hidden: Bytes) -> pb::GenerateStep {
    pb::GenerateStep { tokens, hidden, positions_from: vec![0; rows as usize], last_token_only: true, top_k: 1, ..Default::default() }
}

#[test]
fn a_prompt_runs_in_parts_with_its_logits_and_another_peer_s_steps_run_between_them() {
    use cleave_client::GenerateLink;
    use cleave_host::generation::{GenerationSplit, SplitGenerator};
    let bundle = Bundle::open(bundle_dir("gpt2")).unwrap();
    let info = bundle.manifest().generation.clone().unwrap();
    let (ids, want) = generation_reference(&bundle);
    let (total, n, prompt, max_len) = (ids.size()[1], info.stages.len(), info.reference.prompt, info.reference.max_len);
    let (ids, want) = (ids.narrow(0, 0, 1), want.narrow(0, 0, 1));
    runtime().block_on(async {
        let (prepared, work) = server_with_parts_of_one(&bundle).await;
        let server = LoopbackServer::serve(prepared).await.unwrap();
        let mut session = connect(&server.url, &bundle, &Link::plain()).await.unwrap();
        let split = GenerationSplit { cut: n / 2, tail_on_edge: false, batch: 1, max_len };
        let mut generator = SplitGenerator::open(&bundle, &mut session, split).await.unwrap();
        let before = work();
        let mut logits = vec![generator.step(&ids.narrow(1, 0, prompt), &[], false).await.unwrap()];
        assert_eq!(work() - before, prompt as f64, "the prompt ran one position a part");
        for t in prompt..total {
            logits.push(generator.step(&ids.narrow(1, t, 1), &[], true).await.unwrap());
        }
        let error = relative_error(&tch::Tensor::cat(&logits, 1), &want);
        assert!(error <= 1e-4, "a prompt run in parts: relative error {error:e}");
        // Its last token's alone: the parts before the last run no head.
        let mut last_only = SplitGenerator::open(&bundle, &mut session, split).await.unwrap();
        let got = last_only.step(&ids.narrow(1, 0, prompt), &[], true).await.unwrap();
        let error = relative_error(&got, &want.narrow(1, prompt - 1, 1));
        assert!(error <= 1e-4, "a prompt run in parts, its last token's logits: relative error {error:e}");
        drop(last_only);
        // Each token's five most likely, kept part by part: the reference's five.
        let mut top = SplitGenerator::open(&bundle, &mut session, split).await.unwrap();
        let scores = top.step_scores(&ids.narrow(1, 0, prompt), &[], false, 5).await.unwrap();
        let (values, want_ids) = want.narrow(1, 0, prompt).topk(5, -1, true, true);
        let got_ids: Vec<i64> = Vec::try_from(scores.token_ids.expect("the head is the server's").flatten(0, -1)).unwrap();
        assert_eq!(got_ids, Vec::<i64>::try_from(want_ids.flatten(0, -1)).unwrap(), "each token's five most likely, in parts");
        let error = relative_error(&scores.logits, &values);
        assert!(error <= 1e-4, "a prompt run in parts, each token's top 5: relative error {error:e}");
        drop(top);

        let hog_link = Link { local_address: Some("127.0.0.2".parse().unwrap()), ..Link::plain() };
        let mut hog = connect(&server.url, &bundle, &hog_link).await.unwrap();
        let (rows, tokens, width) = (16u32, 63u32, info.hidden_width() as usize);
        let hidden = Bytes::from(vec![0u8; rows as usize * tokens as usize * width * 4]);
        // Four sessions' prompts, sent at once (in a task) once their first part has run.
        let prompts = async |hog: &mut cleave_client::ServerSession| {
            let mut prompts = Vec::new();
            for _ in 0..4 {
                let open = pb::OpenGeneration { start: 1, end: n as u32, batch: rows, max_len: tokens };
                let mut link = GenerateLink::open(hog, open).await.unwrap();
                let step = whole_prompt(rows, tokens, hidden.clone());
                prompts.push(async move {
                    link.step(step, &[i64::from(rows), 1, 1], DType::Float32, info.vocab_size).await.map(|_| std::time::Instant::now())
                });
            }
            let before = work();
            let running = tokio::spawn(futures_util::future::join_all(prompts));
            let first_part = async {
                while work() == before {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            };
            tokio::time::timeout(Duration::from_secs(60), first_part).await.expect("a part of the other peer's prompts ran");
            (before, running)
        };
        let (_, prompts_running) = prompts(&mut hog).await;
        let _next = generator.step(&ids.narrow(1, 0, 1), &[], true).await.unwrap();
        let decoded = std::time::Instant::now();
        let answered: Vec<std::time::Instant> = prompts_running.await.unwrap().into_iter().map(|done| done.unwrap()).collect();
        let first_prompt = answered.iter().min().unwrap();
        assert!(decoded < *first_prompt, "the decode step was answered {:?} after the first of the other peer's prompts", decoded - *first_prompt);
        // Callers that go stop their prompts between two parts: four more, dropped once their
        // first part has run, run far fewer than their 4 x 63 parts (all of them, before).
        let (before, running) = prompts(&mut hog).await;
        running.abort();
        let _ = running.await;
        let mut ran = work() - before;
        loop {
            tokio::time::sleep(Duration::from_millis(300)).await;
            let now = work() - before;
            if now == ran {
                break;
            }
            ran = now;
        }
        assert!(ran < f64::from(4 * tokens) / 2.0, "{ran} of the {} parts ran after their callers went", 4 * tokens);
        drop((generator, session, hog));
        server.shutdown().await.unwrap();
    });
}

#[test]
fn a_prompt_s_hidden_states_are_held_in_the_memory_budget_while_it_runs_in_parts() {
    // Beside the call's message (counted as it arrives), the tensor a step's hidden states are
    // decoded into is held in the budget while the step runs, here one position a part.
    use cleave_client::GenerateLink;
    let bundle = Bundle::open(bundle_dir("gpt2")).unwrap();
    let info = bundle.manifest().generation.clone().unwrap();
    let n = info.stages.len() as u32;
    let (rows, tokens, width) = (16u32, 63u32, info.hidden_width() as usize);
    let hidden = Bytes::from(vec![0u8; rows as usize * tokens as usize * width * 4]);
    runtime().block_on(async {
        let (prepared, work) = server_with_parts_of_one(&bundle).await;
        let budget = prepared.memory_budget();
        let server = LoopbackServer::serve(prepared).await.unwrap();
        let mut session = connect(&server.url, &bundle, &Link::plain()).await.unwrap();
        let open = pb::OpenGeneration { start: 1, end: n, batch: rows, max_len: tokens };
        let mut link = GenerateLink::open(&mut session, open).await.unwrap();
        let step = whole_prompt(rows, tokens, hidden.clone());
        let before = work();
        let running = tokio::spawn(async move { link.step(step, &[i64::from(rows), 1, 1], DType::Float32, info.vocab_size).await.map(drop) });
        // The most held while its parts run (sampled from before the first to after the last).
        let mut most = 0;
        let watch = async {
            while !running.is_finished() {
                most = most.max(budget.held_bytes());
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(60), watch).await.expect("the prompt is answered");
        running.await.unwrap().unwrap();
        assert_eq!(work() - before, f64::from(tokens), "the prompt ran one position a part");
        assert!(most >= 2 * hidden.len() as u64, "at most {most} bytes held while {} bytes of hidden states ran in parts", hidden.len());
        drop(session);
        server.shutdown().await.unwrap();
    });
}

/// A generation session's refusals are precise and leave it as it was: a step at positions
/// the server's rows do not stand at, hidden states of the wrong size, a step past the cache,
/// an answer over the message limit; sessions past `generation.max_sessions` or caches past
/// Only a step that runs keeps a generation session: steps that run more often than
/// `generation.session_idle_timeout` keep it, refused steps sent as often do not, and it is
/// closed (its host told why, or its stream ended) once none has run for that long.
#[test]
fn refused_steps_do_not_keep_a_generation_session() {
    use cleave_client::GenerateLink;
    use cleave_server::GenerationOptions;
    let bundle = Bundle::open(bundle_dir("gpt2")).unwrap();
    let info = bundle.manifest().generation.clone().unwrap();
    let (n, width) = (info.stages.len() as u32, info.hidden_width());
    runtime().block_on(async {
        let dir = bundle.dir().to_path_buf();
        let idle = Duration::from_millis(1500);
        let prepared = tokio::task::spawn_blocking(move || {
            let options = GenerationOptions { session_idle_timeout: idle, ..GenerationOptions::default() };
            PreparedServer::prepare(&dir, DeviceSpec::Cpu, Limits::default(), Default::default()).unwrap().with_generation(options)
        })
        .await
        .unwrap();
        let server = LoopbackServer::serve(prepared).await.unwrap();
        let mut session = connect(&server.url, &bundle, &Link::plain()).await.unwrap();
        let mut link = GenerateLink::open(&mut session, pb::OpenGeneration { start: 1, end: n, batch: 1, max_len: 16 }).await.unwrap();
        let hidden = bytes::Bytes::from(vec![0u8; (width * 4) as usize]);
        let shape = [1, 1, info.vocab_size];
        let step = |at: u32| pb::GenerateStep { tokens: 1, hidden: hidden.clone(), positions_from: vec![at], ..Default::default() };
        // Six steps that run, 300 ms apart: the session outlives its 1.5 s idle timeout.
        for at in 0..6 {
            tokio::time::sleep(Duration::from_millis(300)).await;
            link.step(step(at), &shape, DType::Float32, info.vocab_size).await.unwrap();
        }
        // Steps refused (the row stands at 6, not 9), 200 ms apart, do not keep it.
        let started = std::time::Instant::now();
        let (code, message) = loop {
            tokio::time::sleep(Duration::from_millis(200)).await;
            let (code, message) = refusal(link.step(step(9), &shape, DType::Float32, info.vocab_size).await);
            if code != tonic::Code::InvalidArgument {
                break (code, message);
            }
            assert!(message.contains("stands at position 6"), "{message}");
            assert!(started.elapsed() < Duration::from_secs(10), "refused steps kept the session open");
        };
        let told = code == tonic::Code::DeadlineExceeded && message.contains("`generation.session_idle_timeout`");
        let ended = code == tonic::Code::Unavailable && message.contains("closed the stream");
        assert!(told || ended, "{code:?}: {message}");
        server.shutdown().await.unwrap();
    });
}

/// One peer (here 127.0.0.1) holds at most its share of the generation places; the place a
/// closed session held comes back to it.
#[test]
fn a_peer_holds_at_most_its_share_of_generation_sessions() {
    use cleave_client::GenerateLink;
    use cleave_server::GenerationOptions;
    let bundle = Bundle::open(bundle_dir("gpt2")).unwrap();
    let n = bundle.manifest().generation.as_ref().unwrap().stages.len() as u32;
    runtime().block_on(async {
        let dir = bundle.dir().to_path_buf();
        let prepared = tokio::task::spawn_blocking(move || {
            let options = GenerationOptions { max_sessions: 8, max_sessions_per_peer: 1, ..GenerationOptions::default() };
            PreparedServer::prepare(&dir, DeviceSpec::Cpu, Limits::default(), Default::default()).unwrap().with_generation(options)
        })
        .await
        .unwrap();
        let server = LoopbackServer::serve(prepared).await.unwrap();
        let mut session = connect(&server.url, &bundle, &Link::plain()).await.unwrap();
        let open = pb::OpenGeneration { start: 1, end: n, batch: 1, max_len: 16 };
        let first = GenerateLink::open(&mut session, open).await.unwrap();
        let (c, m) = refusal(GenerateLink::open(&mut session, open).await);
        assert!(c == tonic::Code::ResourceExhausted && m.contains("127.0.0.1") && m.contains("generation.max_sessions_per_peer"), "{m}");
        drop(first);
        let mut reopened = None;
        for _ in 0..100 {
            if let Ok(link) = GenerateLink::open(&mut session, open).await {
                reopened = Some(link);
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        assert!(reopened.is_some(), "the place of a closed session comes back to its peer");
        server.shutdown().await.unwrap();
    });
}

/// With a token for each client (`auth.tokens`), what a client may hold is counted by its
/// token, not its address (issue 70, item 3): two clients on 127.0.0.1 with their own tokens
/// each hold the one generation place a peer has; a second of either is refused naming that
/// client; a caller without a token of the server's is refused UNAUTHENTICATED.
#[test]
fn with_named_tokens_each_client_holds_its_own_share_wherever_it_connects_from() {
    use cleave_client::GenerateLink;
    use cleave_common::security::{ServerSecurity, ServerTokens, Token};
    use cleave_server::GenerationOptions;
    let bundle = Bundle::open(bundle_dir("gpt2")).unwrap();
    let n = bundle.manifest().generation.as_ref().unwrap().stages.len() as u32;
    let token = |client: &str| Token::parse(format!("the-token-of-{client}-0123456789").as_bytes()).unwrap();
    let tokens = ServerTokens::Named(vec![("edge-a".into(), token("edge-a")), ("edge-b".into(), token("edge-b"))]);
    runtime().block_on(async {
        let dir = bundle.dir().to_path_buf();
        let prepared = tokio::task::spawn_blocking(move || {
            let options = GenerationOptions { max_sessions: 8, max_sessions_per_peer: 1, ..GenerationOptions::default() };
            let security = ServerSecurity { tokens, ..ServerSecurity::default() };
            PreparedServer::prepare(&dir, DeviceSpec::Cpu, Limits::default(), security).unwrap().with_generation(options)
        })
        .await
        .unwrap();
        let server = LoopbackServer::serve(prepared).await.unwrap();
        let open = pb::OpenGeneration { start: 1, end: n, batch: 1, max_len: 16 };
        let mut held = Vec::new();
        for client in ["edge-a", "edge-b"] {
            let link = Link { token: Some(token(client)), ..Link::plain() };
            let mut session = connect(&server.url, &bundle, &link).await.unwrap();
            held.push(GenerateLink::open(&mut session, open).await.unwrap_or_else(|e| panic!("{client}'s first session: {e}")));
            let (c, m) = refusal(GenerateLink::open(&mut session, open).await);
            let named = format!("client `{client}`");
            assert!(c == tonic::Code::ResourceExhausted && m.contains(&named) && m.contains("generation.max_sessions_per_peer"), "{m}");
        }
        let (c, m) = refusal(connect(&server.url, &bundle, &Link::plain()).await);
        assert_eq!(c, tonic::Code::Unauthenticated, "{m}");
        drop(held);
        server.shutdown().await.unwrap();
    });
}

/// `limits.kv_cache_bytes` are refused, the embedding is never the server's, and what a
/// session held is given back when its stream ends (metrics).
#[test]
fn generation_sessions_are_held_to_their_budgets_and_a_bad_step_changes_nothing() {
    use cleave_client::GenerateLink;
    use cleave_server::{GenerationOptions, PeerLimits};
    let bundle = Bundle::open(bundle_dir("gpt2")).unwrap();
    let info = bundle.manifest().generation.clone().unwrap();
    let (n, width) = (info.stages.len() as u32, info.hidden_width());
    // One session of [1, n) at 16 positions takes 4 layers x 256 bytes x 16.
    let per_session = info.cache_bytes(1..n as usize, 1, 16);
    let rt = runtime();
    rt.block_on(async {
        let dir = bundle.dir().to_path_buf();
        let prepared = tokio::task::spawn_blocking(move || {
            let peers = PeerLimits { kv_cache_bytes: 2 * per_session, ..PeerLimits::default() };
            let options = GenerationOptions { max_sessions: 3, ..GenerationOptions::default() };
            PreparedServer::prepare(&dir, DeviceSpec::Cpu, Limits::default(), Default::default())
                .unwrap()
                .with_peer_limits(peers)
                .unwrap()
                .with_generation(options)
        })
        .await
        .unwrap();
        let metrics = prepared.metrics();
        let held = |metrics: &cleave_server::Metrics| {
            metric_sample(&parse_metrics(&metrics.render()), "cleave_budget_held_bytes", &[("budget", "kv_cache")])
        };
        let server = LoopbackServer::serve(prepared).await.unwrap();
        let mut session = connect(&server.url, &bundle, &Link::plain()).await.unwrap();
        let open = |start: u32, batch: u32, max_len: u32| pb::OpenGeneration { start, end: n, batch, max_len };
        let (c, m) = refusal(GenerateLink::open(&mut session, open(0, 1, 16)).await);
        assert!(c == tonic::Code::InvalidArgument && m.contains("embedding"), "{m}");
        let (c, m) = refusal(GenerateLink::open(&mut session, open(1, 1, 65)).await);
        assert!(c == tonic::Code::InvalidArgument && m.contains("max_len 65"), "{m}");
        let mut first = GenerateLink::open(&mut session, open(1, 1, 16)).await.unwrap();
        assert_eq!(first.opened.cache_bytes, per_session);
        let second = GenerateLink::open(&mut session, open(1, 1, 16)).await.unwrap();
        let (c, m) = refusal(GenerateLink::open(&mut session, open(1, 1, 16)).await);
        assert!(c == tonic::Code::ResourceExhausted && m.contains("limits.kv_cache_bytes"), "{m}");
        assert_eq!(held(&metrics), (2 * per_session) as f64);
        // Sessions of the head alone hold no cache: the third place is the last.
        let head_only = pb::OpenGeneration { start: n - 1, end: n, batch: 1, max_len: 16 };
        let mut third = GenerateLink::open(&mut session, head_only).await.unwrap();
        let (c, m) = refusal(GenerateLink::open(&mut session, head_only).await);
        assert!(c == tonic::Code::ResourceExhausted && m.contains("generation.max_sessions"), "{m}");

        let hidden = |tokens: i64| bytes::Bytes::from(vec![0u8; (tokens * width * 4) as usize]);
        let step =
            |tokens: u32, from: u32| pb::GenerateStep { tokens, hidden: hidden(tokens.into()), positions_from: vec![from], ..Default::default() };
        let shape = |tokens: i64| [1, tokens, info.vocab_size];
        let (c, m) = refusal(first.step(step(2, 3), &shape(2), DType::Float32, info.vocab_size).await);
        assert!(c == tonic::Code::InvalidArgument && m.contains("stands at position 0"), "{m}");
        let (c, m) = refusal(first.step(pb::GenerateStep { hidden: hidden(1), ..step(2, 0) }, &shape(2), DType::Float32, info.vocab_size).await);
        assert!(c == tonic::Code::InvalidArgument && m.contains("hidden states"), "{m}");
        let (c, m) = refusal(first.step(step(17, 0), &shape(17), DType::Float32, info.vocab_size).await);
        assert!(c == tonic::Code::OutOfRange && m.contains("16 positions"), "{m}");
        let (c, m) =
            refusal(first.step(pb::GenerateStep { restart_rows: vec![0; 1 << 20], ..step(2, 0) }, &shape(2), DType::Float32, info.vocab_size).await);
        assert!(c == tonic::Code::InvalidArgument && m.contains("1048576 restart rows"), "{m}");
        let (c, m) = refusal(first.step(pb::GenerateStep { top_k: 501, ..step(2, 0) }, &[1, 2, 501], DType::Float32, info.vocab_size).await);
        assert!(c == tonic::Code::InvalidArgument && m.contains("top_k 501: the vocabulary has 500 tokens"), "{m}");
        // A step of a top_k answers its tokens' most likely next tokens: the whole vocabulary
        // ranked, the lower id first among equal logits (the head alone: no position matters).
        tch::manual_seed(5);
        let random = tch::Tensor::randn([1, 1, width], (tch::Kind::Float, tch::Device::Cpu));
        let random = bytes::Bytes::from(Vec::<u8>::try_from(random.flatten(0, -1).view_dtype(tch::Kind::Uint8)).unwrap());
        for (at, hidden) in [hidden(1), random].into_iter().enumerate() {
            let at = 2 * at as u32;
            let one = |top_k: u32, at: u32| pb::GenerateStep { top_k, hidden: hidden.clone(), ..step(1, at) };
            let whole = third.step(one(0, at), &shape(1), DType::Float32, info.vocab_size).await.unwrap();
            assert!(whole.token_ids.is_none());
            let logits: Vec<f32> = Vec::try_from(whole.output.flatten(0, -1)).unwrap();
            let mut ranked: Vec<(u32, f32)> = (0..).zip(logits).collect();
            ranked.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            let top = third.step(one(7, at + 1), &[1, 1, 7], DType::Float32, info.vocab_size).await.unwrap();
            let values: Vec<f32> = Vec::try_from(top.output.flatten(0, -1)).unwrap();
            assert_eq!(top.token_ids.unwrap().into_iter().zip(values).collect::<Vec<_>>(), ranked[..7], "hidden states {at}");
        }
        // Hidden states that are not finite are refused before they run, with a top_k or
        // without, and the row stays where it stood.
        for bad in [f32::NAN, f32::INFINITY] {
            let values: Vec<u8> = (0..2 * width).flat_map(|i| if i == 3 { bad } else { 0.0f32 }.to_le_bytes()).collect();
            for top_k in [0u32, 3] {
                let asked = if top_k == 0 { shape(2) } else { [1, 2, 3] };
                let bad_step = pb::GenerateStep { top_k, hidden: values.clone().into(), ..step(2, 0) };
                let (c, m) = refusal(first.step(bad_step, &asked, DType::Float32, info.vocab_size).await);
                assert!(c == tonic::Code::InvalidArgument && m.contains("not finite"), "{bad} top_k {top_k}: {m}");
            }
        }
        // Finite hidden states whose logits rank nothing (1e30 everywhere: the layer norms
        // overflow) fail without moving the row, alone or in a batch.
        let huge: Vec<u8> = (0..2 * width).flat_map(|_| 1e30f32.to_le_bytes()).collect();
        let (c, m) =
            refusal(first.step(pb::GenerateStep { top_k: 3, hidden: huge.into(), ..step(2, 0) }, &[1, 2, 3], DType::Float32, info.vocab_size).await);
        assert!(c != tonic::Code::Ok && m.contains("NaN"), "{c:?}: {m}");
        // None of those moved the row: a prompt of 2 then a token run from position 0.
        assert_eq!(first.step(step(2, 0), &shape(2), DType::Float32, info.vocab_size).await.unwrap().output.size(), shape(2));
        assert_eq!(
            first
                .step(pb::GenerateStep { last_token_only: true, ..step(1, 2) }, &shape(1), DType::Float32, info.vocab_size)
                .await
                .unwrap()
                .output
                .size(),
            shape(1)
        );
        drop((first, second));
        let freed = || async {
            while held(&metrics) > 0.0 {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(10), freed()).await.expect("the caches of ended streams are freed");
        // A session that ends before the head answers hidden states: it has no top_k.
        let mut layers = GenerateLink::open(&mut session, pb::OpenGeneration { end: n - 1, ..open(1, 1, 16) }).await.unwrap();
        let hidden_shape = [1, 1, width];
        let (c, m) = refusal(layers.step(pb::GenerateStep { top_k: 3, ..step(1, 0) }, &hidden_shape, DType::Float32, info.vocab_size).await);
        assert!(c == tonic::Code::InvalidArgument && m.contains("end before the head"), "{m}");
        assert_eq!(layers.step(step(1, 0), &hidden_shape, DType::Float32, info.vocab_size).await.unwrap().output.size(), hidden_shape);
        drop(layers);
        tokio::time::timeout(Duration::from_secs(10), freed()).await.expect("the caches of ended streams are freed");
        let mut two = GenerateLink::open(&mut session, open(1, 2, 16)).await.expect("two rows fit once the others closed");
        let both = pb::GenerateStep { tokens: 1, hidden: hidden(2), positions_from: vec![0, 0], restart_rows: vec![1, 1], ..Default::default() };
        let (c, m) = refusal(two.step(both.clone(), &[2, 1, info.vocab_size], DType::Float32, info.vocab_size).await);
        assert!(c == tonic::Code::InvalidArgument && m.contains("restart row 1 is given twice"), "{m}");
        assert_eq!(
            two.step(pb::GenerateStep { restart_rows: vec![1], ..both }, &[2, 1, info.vocab_size], DType::Float32, info.vocab_size)
                .await
                .unwrap()
                .output
                .size(),
            [2, 1, 500]
        );
        drop(session);
        server.shutdown().await.unwrap();
    });
}

/// `host generate` (issue 40, item 3): greedy tokens over a loopback server, the head on the
/// server or on the edge, are the whole model's greedy tokens in one process, wherever its
/// top two logits differ by more than 1e-4 (random weights have near ties); a seeded draw
/// gives the same tokens again, top-k 1 is greedy, and a stop token ends the generation.
#[test]
fn host_generate_s_greedy_tokens_are_the_whole_model_s_in_one_process() {
    use cleave_common::generation::GenerationStages;
    use cleave_host::generation::{generate, GenerateOptions, Sampling};
    let bundle = Bundle::open(bundle_dir("gpt2")).unwrap();
    let (prompt, new) = (vec![3i64, 141, 59, 26, 5], 24);
    // The whole model here, greedy, up to the first near tie.
    let whole =
        GenerationStages::load(&bundle, StageRange::new(0, bundle.manifest().generation.as_ref().unwrap().stages.len()), DeviceSpec::Cpu).unwrap();
    let mut caches = whole.new_caches(1, (prompt.len() + new) as i64).unwrap();
    let (mut want, mut input, mut at) = (Vec::new(), tch::Tensor::from_slice(&prompt).unsqueeze(0), 0);
    while want.len() < new {
        let s = input.size()[1];
        let positions = tch::Tensor::arange_start(at, at + s, (tch::Kind::Int64, tch::Device::Cpu)).unsqueeze(0);
        let logits = whole.step(&input, &positions, &mut caches).unwrap().select(1, s - 1).squeeze();
        let (top, index) = logits.topk(2, 0, true, true);
        if top.double_value(&[0]) - top.double_value(&[1]) <= 1e-4 {
            break;
        }
        want.push(index.int64_value(&[0]));
        (input, at) = (tch::Tensor::from_slice(&[want[want.len() - 1]]).unsqueeze(0), at + s);
    }
    assert!(want.len() >= 8, "the chain compares at least 8 tokens, {} before a near tie", want.len());

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("edge.yaml");
    let yaml = format!(
        "server: http://127.0.0.1:1\nbundle: {}\nsplit: 1\ndevice: cpu\ninput: {{kind: synthetic}}\noutput: {}\nloopback: {{device: cpu}}\n",
        bundle.dir().display(),
        dir.path().join("out").display()
    );
    std::fs::write(&path, yaml).unwrap();
    let config = cleave_host::config::EdgeConfig::load(&path).unwrap();
    let greedy = GenerateOptions {
        loopback: true,
        cut: None,
        tail_on_edge: false,
        prompt: prompt.clone(),
        max_new_tokens: want.len(),
        stop: Vec::new(),
        sampling: Sampling::default(),
    };
    let rt = runtime();
    let run = |options: &GenerateOptions| rt.block_on(generate(&config, options, |_| {})).unwrap();
    for (cut, tail_on_edge) in [(None, false), (Some(1), true), (Some(4), false)] {
        let generated = run(&GenerateOptions { cut, tail_on_edge, ..greedy.clone() });
        assert_eq!(generated.tokens, want, "cut {cut:?}, tail on the edge {tail_on_edge}");
        assert_eq!(generated.times.iter().map(|t| t.position).collect::<Vec<_>>(), (prompt.len() as i64..).take(want.len()).collect::<Vec<_>>());
        assert!(!generated.stopped && generated.times.iter().all(|t| t.ms > 0.0));
        // The server's own times of each step come with it, within the host's time of it.
        let within = |t: &cleave_host::generation::TokenTime| t.server_compute_ms > 0.0 && t.server_queue_ms + t.server_compute_ms <= t.ms;
        assert!(generated.times.iter().all(within), "{:?}", generated.times.first());
        let csv = generated.timings_csv();
        assert_eq!(csv.lines().next(), Some("position,token,ms,unix_ms,server_queue_ms,server_compute_ms"));
        assert!(csv.lines().skip(1).all(|line| line.split(',').count() == 6) && csv.lines().count() == want.len() + 1);
    }
    let drawn = Sampling { temperature: 0.8, top_k: 20, top_p: 0.95, seed: 3 };
    let first = run(&GenerateOptions { sampling: drawn, ..greedy.clone() });
    assert_eq!(run(&GenerateOptions { sampling: drawn, ..greedy.clone() }).tokens, first.tokens, "the same seed, the same tokens");
    assert_eq!(run(&GenerateOptions { sampling: Sampling { top_k: 1, ..drawn }, ..greedy.clone() }).tokens, want, "top-k 1 is greedy");
    // The head on the server answers the draw's 20 most likely tokens only; on the edge the
    // draw is from the whole vocabulary's logits: the same tokens.
    assert_eq!(
        run(&GenerateOptions { sampling: drawn, tail_on_edge: true, ..greedy.clone() }).tokens,
        first.tokens,
        "top-k from the server's candidates"
    );
    let stopped = run(&GenerateOptions { stop: vec![want[2]], ..greedy.clone() });
    let first_stop = want.iter().position(|&t| t == want[2]).unwrap();
    assert!(stopped.stopped && stopped.tokens == want[..=first_stop], "{:?}", stopped.tokens);
    let too_long = rt.block_on(generate(&config, &GenerateOptions { max_new_tokens: 64, ..greedy.clone() }, |_| {}));
    assert!(too_long.unwrap_err().to_string().contains("64 positions"));
}
