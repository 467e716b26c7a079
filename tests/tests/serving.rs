//! One server for many models and many edges: models selected by bundle id, requests of
//! several hosts merged into batches (at one cut and across cuts) with results equal to
//! running each alone, training between inference batches, and the Prometheus metrics.

use std::collections::HashMap;
use std::time::Duration;

use cleave_common::config::Limits;
use cleave_common::pb::split_inference_client::SplitInferenceClient;
use cleave_common::pb::{self, InferFrame};
use cleave_common::protocol::{ServerInfo, BUNDLE_ID_METADATA};
use cleave_common::wire::{payload_frames, Codec, CodecPolicy, Direction, FrameAssembler, KeyRing, PayloadMeta, PayloadReceiver, PayloadSender};
use cleave_common::{Boundary, Bundle, DeviceSpec, LoadedStages, StageRange, Value};
use cleave_host::LoopbackServer;
use cleave_server::{Batching, ModelConfig, PreparedServer, SchedulerConfig};
use cleave_tests::{bundle_dir, metric_sample as sample, parse_metrics as parse};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::StreamExt;

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
}

/// Rows `rows` of every tensor of `b` (a request of that many samples from a reference batch).
fn rows(b: &Boundary, rows: &[i64]) -> Boundary {
    let index = tch::Tensor::from_slice(rows);
    Boundary { values: b.values.iter().map(|(n, v)| (n.clone(), Value::Tensor(v.as_tensor().unwrap().index_select(0, &index)))).collect() }
}

/// Answers of one `Infer` stream: request id to the boundary at the last cut, or the error.
type Answers = HashMap<u64, Result<Boundary, (tonic::Code, String)>>;

/// Sends `requests` (id, cut, boundary) on one stream of `bundle`'s model and collects every answer.
async fn stream(url: String, bundle_id: String, requests: Vec<(u64, usize, Boundary)>) -> Answers {
    let mut client = SplitInferenceClient::connect(url).await.unwrap();
    let (tx, rx) = mpsc::channel::<InferFrame>(64);
    let mut call = tonic::Request::new(ReceiverStream::new(rx));
    call.metadata_mut().insert(BUNDLE_ID_METADATA, bundle_id.parse().unwrap());
    let mut results = client.infer(call).await.unwrap().into_inner();
    let count = requests.len();
    tokio::spawn(async move {
        let mut sender = PayloadSender::plain();
        for (id, cut, boundary) in requests {
            let meta = PayloadMeta { request_id: id, split: cut as u32, direction: Direction::Request };
            let e = sender.encode(meta, &Codec::RAW, &boundary).unwrap();
            for frame in payload_frames::<InferFrame>(id, e.envelope, &e.data, 1 << 20) {
                tx.send(frame).await.unwrap();
            }
        }
        // Keep the stream open until the answers are in.
        tokio::time::sleep(Duration::from_secs(120)).await;
    });
    let mut receiver = PayloadReceiver::new(Direction::Result, 1 << 30, CodecPolicy::default(), &KeyRing::default());
    let mut frames = FrameAssembler::<()>::default();
    let mut answers = Answers::new();
    while answers.len() < count {
        let frame = results.next().await.expect("an answer").expect("the stream goes on");
        if let Some(e) = &frame.error {
            answers.insert(frame.request_id, Err((tonic::Code::from(e.code), e.message.clone())));
            continue;
        }
        let done = frames
            .push(&frame, |f| receiver.start(f.request_id, &f.header).map(|a| (a, ())))
            .map_err(|(_, e): (u64, cleave_common::wire::WireError)| e);
        if let Some((assembly, ())) = done.unwrap() {
            answers.insert(frame.request_id, Ok(receiver.finish(assembly).unwrap().boundary));
        }
    }
    answers
}

/// A server of `models` on 127.0.0.1.
async fn serve(models: Vec<ModelConfig>, scheduler: SchedulerConfig) -> (LoopbackServer, cleave_server::Metrics) {
    let prepared =
        tokio::task::spawn_blocking(move || PreparedServer::prepare_models(&models, scheduler, Limits::default(), Default::default()).unwrap())
            .await
            .unwrap();
    let metrics = prepared.metrics();
    (LoopbackServer::serve(prepared).await.unwrap(), metrics)
}

#[test]
fn warm_batches_must_be_sizes_the_bundle_takes() {
    // The digits test bundle takes batches of 1 to 16.
    let model = |warm: Vec<i64>| ModelConfig { warm_batches: warm, ..ModelConfig::new(bundle_dir("digits"), DeviceSpec::Cpu) };
    let prepare = |m: ModelConfig| PreparedServer::prepare_models(&[m], SchedulerConfig::default(), Limits::default(), Default::default());
    assert!(prepare(model(vec![3, 16])).is_ok());
    let Err(err) = prepare(model(vec![3, 17])) else { panic!("a batch of 17 was accepted") };
    let err = err.to_string();
    assert!(err.contains("`warm_batches`") && err.contains("takes batches of 1 to 16, not 17"), "{err}");
}

#[test]
fn requests_merged_across_hosts_and_cuts_get_their_unbatched_results() {
    let names = ["digits", "resnet18", "transformer", "mobilenet_v3_small"];
    let bundles: Vec<Bundle> = names.iter().map(|n| Bundle::open(bundle_dir(n)).unwrap()).collect();
    // Batches fill for up to a second, so that the requests sent at once all meet.
    let batching = Batching { max_batch: 16, max_wait: Duration::from_millis(1000), merge_cuts: true };
    let models = bundles.iter().map(|b| ModelConfig { batching, ..ModelConfig::new(b.dir(), DeviceSpec::Cpu) }).collect();
    runtime().block_on(async {
        let (server, metrics) = serve(models, SchedulerConfig::default()).await;
        let mut expected: HashMap<(usize, u64), Boundary> = HashMap::new();
        let mut streams = Vec::new();
        for (m, bundle) in bundles.iter().enumerate() {
            let stages = LoadedStages::load(bundle, StageRange::all(bundle), DeviceSpec::Cpu).unwrap();
            let n = bundle.stage_count();
            let batchable = bundle.batchable_cuts();
            // Four cuts: the input, two batchable ones between, and for the transformer one
            // that is not batchable (a plain value crosses it: its requests run alone).
            let mut cuts = vec![0, batchable[batchable.len() / 3], batchable[2 * batchable.len() / 3]];
            if let Some(alone) = (1..n).find(|c| bundle.cut(*c).usable && !batchable.contains(c)) {
                cuts.push(alone);
            } else {
                cuts.push(batchable[batchable.len() - 2]);
            }
            let (reference, _) = bundle.reference(8).unwrap();
            // Four hosts per model, each sending a request of 1 and one of 3 samples at its cut.
            for host in 0..4u64 {
                let cut = cuts[host as usize];
                let mut requests = Vec::new();
                for (k, size) in [1i64, 3].into_iter().enumerate() {
                    let id = host * 10 + k as u64;
                    let picked: Vec<i64> = (0..size).map(|r| (host as i64 * 2 + k as i64 + r) % 8).collect();
                    let input = rows(&reference, &picked);
                    let at_cut = stages.run(StageRange::new(0, cut), &input).unwrap();
                    expected.insert((m, id), stages.run(StageRange::new(cut, n), &at_cut).unwrap());
                    requests.push((id, cut, at_cut));
                }
                streams.push((m, tokio::spawn(stream(server.url.clone(), bundle.id().to_string(), requests))));
            }
        }
        for (m, handle) in streams {
            for (id, answer) in handle.await.unwrap() {
                let got = answer.unwrap_or_else(|e| panic!("{} request {id}: {e:?}", names[m]));
                let err = got.max_relative_error(&expected[&(m, id)]);
                assert!(err <= 1e-5, "{} request {id}: relative error {err:e} from its unbatched result", names[m]);
            }
        }
        let scrape = parse(&metrics.render());
        for bundle in &bundles {
            let model = [("model", bundle.id())];
            let answered = sample(&scrape, "cleave_requests_total", &[("model", bundle.id()), ("code", "Ok")]);
            let batches = sample(&scrape, "cleave_batch_samples_count", &model);
            assert_eq!(answered, 8.0);
            // Merged: fewer batches than requests (the 8 requests entered at 4 cuts, the one
            // at the unbatchable cut or the last alone).
            assert!(batches < answered, "{}: {batches} batches for {answered} requests", bundle.id());
            assert!(sample(&scrape, "cleave_cut_merges_total", &model) > 0.0, "{}: no request joined others at a later cut", bundle.id());
            assert_eq!(sample(&scrape, "cleave_queue_depth", &model), 0.0);
        }
    });
}

#[test]
fn requests_merge_only_with_those_of_their_sequence_length() {
    // GPT-2-like: cuts whose tensors follow the sequence length are batchable, and requests
    // of lengths 8 and 32 arrive at them together.
    let bundle = Bundle::open(bundle_dir("gpt2")).unwrap();
    let batchable = bundle.batchable_cuts();
    assert!(batchable.len() > 3 && batchable.contains(&0), "{batchable:?}");
    let later = batchable[batchable.len() / 2];
    let batching = Batching { max_batch: 16, max_wait: Duration::from_millis(1000), merge_cuts: true };
    let models = vec![ModelConfig { batching, ..ModelConfig::new(bundle.dir(), DeviceSpec::Cpu) }];
    let stages = LoadedStages::load(&bundle, StageRange::all(&bundle), DeviceSpec::Cpu).unwrap();
    let n = bundle.stage_count();
    runtime().block_on(async {
        let (server, metrics) = serve(models, SchedulerConfig::default()).await;
        let mut expected: HashMap<u64, Boundary> = HashMap::new();
        let mut streams = Vec::new();
        for info in bundle.references_at(3) {
            let seq = info.seq_len.expect("a reference per length");
            let (reference, _) = bundle.load_reference(info).unwrap();
            // Per length: two hosts at the input, one at a later cut (where the batch of the
            // input's requests of its length joins it), each with a request of 1 and of 2 samples.
            for (host, cut) in [(0u64, 0), (1, 0), (2, later)] {
                let mut requests = Vec::new();
                for (k, size) in [1i64, 2].into_iter().enumerate() {
                    let id = seq as u64 * 100 + host * 10 + k as u64;
                    let picked: Vec<i64> = (0..size).map(|r| (host as i64 + k as i64 + r) % 3).collect();
                    let at_cut = stages.run(StageRange::new(0, cut), &rows(&reference, &picked)).unwrap();
                    expected.insert(id, stages.run(StageRange::new(cut, n), &at_cut).unwrap());
                    requests.push((id, cut, at_cut));
                }
                streams.push(tokio::spawn(stream(server.url.clone(), bundle.id().to_string(), requests)));
            }
        }
        for handle in streams {
            for (id, answer) in handle.await.unwrap() {
                let got = answer.unwrap_or_else(|e| panic!("request {id}: {e:?}"));
                let err = got.max_relative_error(&expected[&id]);
                assert!(err <= 1e-5, "request {id}: relative error {err:e} from its unbatched result");
            }
        }
        let scrape = parse(&metrics.render());
        let model = [("model", bundle.id())];
        let answered = sample(&scrape, "cleave_requests_total", &[("model", bundle.id()), ("code", "Ok")]);
        assert_eq!(answered, 12.0);
        let batches = sample(&scrape, "cleave_batch_samples_count", &model);
        assert!(batches < answered, "{batches} batches for {answered} requests: none merged");
        assert!(sample(&scrape, "cleave_cut_merges_total", &model) > 0.0, "no request joined others at a later cut");
    });
}

#[test]
fn without_batching_results_are_bit_identical_to_running_alone_and_models_are_chosen_by_id() {
    let digits = Bundle::open(bundle_dir("digits")).unwrap();
    let resnet = Bundle::open(bundle_dir("resnet18")).unwrap();
    let models = vec![ModelConfig::new(digits.dir(), DeviceSpec::Cpu), ModelConfig::new(resnet.dir(), DeviceSpec::Cpu)];
    runtime().block_on(async {
        let (server, _) = serve(models, SchedulerConfig::default()).await;
        let mut client = SplitInferenceClient::connect(server.url.clone()).await.unwrap();
        let info = ServerInfo::try_from(client.info(pb::InfoRequest {}).await.unwrap().into_inner()).unwrap();
        assert_eq!(info.model_ids(), [digits.id(), resnet.id()]);
        assert_eq!(info.models[1].stage_count, resnet.stage_count());
        assert_eq!((info.models[0].batch_limit, info.models[0].batchable_cuts.len()), (1, 0));

        // An unknown id is refused, naming the ids served.
        let (_tx, rx) = mpsc::channel::<InferFrame>(1);
        let mut call = tonic::Request::new(ReceiverStream::new(rx));
        call.metadata_mut().insert(BUNDLE_ID_METADATA, "0123abcd".parse().unwrap());
        let refused = client.infer(call).await.unwrap_err();
        assert_eq!(refused.code(), tonic::Code::FailedPrecondition);
        assert!(refused.message().contains(digits.id()) && refused.message().contains(resnet.id()), "{}", refused.message());
        // A profile without an id names them too when the server has several models.
        let profile = client.profile(pb::ProfileRequest { batch_size: 1, repeats: 1 }).await.unwrap_err();
        assert_eq!(profile.code(), tonic::Code::FailedPrecondition);

        for bundle in [&digits, &resnet] {
            let stages = LoadedStages::load(bundle, StageRange::all(bundle), DeviceSpec::Cpu).unwrap();
            let (reference, _) = bundle.reference(3).unwrap();
            let cut = bundle.batchable_cuts()[1];
            let at_cut = stages.run(StageRange::new(0, cut), &reference).unwrap();
            let alone = stages.run(StageRange::suffix(bundle, cut), &at_cut).unwrap();
            let hosts: Vec<_> = (0..3u64)
                .map(|h| tokio::spawn(stream(server.url.clone(), bundle.id().to_string(), vec![(h, cut, at_cut.shallow_clone())])))
                .collect();
            for h in hosts {
                for (_, answer) in h.await.unwrap() {
                    assert!(answer.unwrap().bit_identical(&alone), "{}: max_batch 1 runs each request alone", bundle.id());
                }
            }
        }
    });
}

#[test]
fn metrics_are_served_over_http_and_count_by_model_and_code() {
    let digits = Bundle::open(bundle_dir("digits")).unwrap();
    let slo = ModelConfig { slo: Some(Duration::from_millis(60_000)), ..ModelConfig::new(digits.dir(), DeviceSpec::Cpu) };
    runtime().block_on(async {
        let (server, metrics) = serve(vec![slo], SchedulerConfig::default()).await;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(cleave_server::metrics::serve(listener, metrics, Default::default(), std::future::pending()));
        let (reference, _) = digits.reference(3).unwrap();
        // Two good requests and one at a cut that does not exist.
        let answers = stream(
            server.url.clone(),
            digits.id().to_string(),
            vec![(1, 0, reference.shallow_clone()), (2, 0, reference.shallow_clone()), (3, 99, reference)],
        )
        .await;
        assert_eq!(answers[&3].as_ref().unwrap_err().0, tonic::Code::InvalidArgument);

        // GET /metrics, as Prometheus scrapes it.
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut socket = tokio::net::TcpStream::connect(addr).await.unwrap();
        socket.write_all(b"GET /metrics HTTP/1.1\r\nHost: cleave\r\nConnection: close\r\n\r\n").await.unwrap();
        let mut response = String::new();
        socket.read_to_string(&mut response).await.unwrap();
        let (head, body) = response.split_once("\r\n\r\n").unwrap();
        assert!(head.starts_with("HTTP/1.1 200"), "{head}");
        assert!(head.to_ascii_lowercase().contains("content-type: application/openmetrics-text"), "{head}");
        let scrape = parse(body);
        let model = digits.id();
        assert_eq!(sample(&scrape, "cleave_requests_total", &[("model", model), ("code", "Ok")]), 2.0);
        assert_eq!(sample(&scrape, "cleave_requests_total", &[("model", model), ("code", "InvalidArgument")]), 1.0);
        assert_eq!(sample(&scrape, "cleave_batch_samples_count", &[("model", model)]), 2.0);
        assert_eq!(sample(&scrape, "cleave_batch_samples_sum", &[("model", model)]), 6.0);
        assert_eq!(sample(&scrape, "cleave_request_seconds_count", &[("model", model)]), 3.0);
        assert_eq!(sample(&scrape, "cleave_compute_seconds_count", &[("model", model)]), 2.0);
        assert_eq!(sample(&scrape, "cleave_slo_misses_total", &[("model", model)]), 0.0);
        assert!(sample(&scrape, "cleave_received_bytes_total", &[("model", model)]) > 3.0 * 3.0 * 64.0 * 4.0);
        assert!(sample(&scrape, "cleave_sent_bytes_total", &[("model", model)]) > 2.0 * 3.0 * 10.0 * 4.0);
        assert_eq!(sample(&scrape, "cleave_queue_depth", &[("model", model)]), 0.0);
        // On the CPU there is no device memory to report (CUDA devices get one sample each).
        assert!(!scrape.samples.iter().any(|s| s.metric == "cleave_device_memory_used_bytes"));
        assert!(body.contains("# TYPE cleave_open_streams gauge") && body.trim_end().ends_with("# EOF"), "{body}");
    });
}
