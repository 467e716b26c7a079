//! A host against servers that fail: fake servers that end the stream part-way, reset it,
//! send garbage or say nothing; a real server stopped and restarted in this process; the
//! server's window of recent results; a device whose scheduler thread dies; `fallback: edge`;
//! and an output directory that holds an earlier run. Whatever the server does, the host
//! ends, and every request id gets exactly one outcome.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use cleave_client::{connect, connect_retrying, Link, RetryPolicy};
use cleave_common::config::Limits;
use cleave_common::pb::split_inference_client::SplitInferenceClient;
use cleave_common::pb::split_inference_server::{SplitInference, SplitInferenceServer};
use cleave_common::pb::{self, InferFrame, ResultFrame};
use cleave_common::protocol::{ServedModel, ServerInfo, BUNDLE_ID_METADATA, HOST_SESSION_METADATA};
use cleave_common::wire::{payload_frames, Codec, CodecPolicy, Direction, KeyRing, PayloadMeta, PayloadReceiver, PayloadSender};
use cleave_common::{Boundary, Bundle, DeviceSpec, LoadedStages, StageRange, Value};
use cleave_host::client::{stream_requests, RequestOutcome, ServedBy, Splits, StreamCounts, StreamPlan};
use cleave_host::config::{EdgeConfig, Fallback, InputSource, Resilience};
use cleave_host::inputs::Inputs;
use cleave_host::report::OutputMode;
use cleave_host::{LoopbackServer, RequestFailure};
use cleave_server::{Batching, DeviceFailurePolicy, DeviceFaults, ModelConfig, PeerLimits, PreparedServer, SchedulerConfig};
use cleave_tests::bundle_dir;
use tokio::sync::mpsc;
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status, Streaming};
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::{health_check_response::ServingStatus, HealthCheckRequest};

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
}

/// Short deadlines, so that a failing server costs the tests little.
fn quick(max_attempts: u32, fallback: Fallback) -> Resilience {
    Resilience {
        connect_timeout: Duration::from_millis(500),
        request_timeout: Duration::from_millis(600),
        retry: RetryPolicy { max_attempts, max_backoff: Duration::from_millis(50) },
        fallback,
        ..Resilience::default()
    }
}

fn plan(bundle: &Bundle, split: usize, requests: u64, resilience: Resilience) -> StreamPlan {
    StreamPlan {
        bundle: bundle.clone(),
        split: Splits::Fixed(split),
        device: DeviceSpec::Cpu,
        warm_stages: None,
        ids: (0..requests).collect(),
        in_flight: 4,
        inputs: Inputs::new(&InputSource::Synthetic { seed: 3 }, bundle, 2).unwrap(),
        codec: Codec::RAW.into(),
        key: None,
        resilience,
    }
}

/// Streams `plan` on `session` and returns every outcome by id, checking there is exactly one
/// per id. A run that does not end within a minute is a deadlock.
async fn run_plan(session: &cleave_client::ServerSession, plan: StreamPlan) -> (HashMap<u64, RequestOutcome>, StreamCounts) {
    let mut outcomes = HashMap::new();
    let streamed = stream_requests(session, plan, |o| assert!(outcomes.insert(o.request_id, o).is_none(), "two outcomes for one id"));
    let counts = tokio::time::timeout(Duration::from_secs(60), streamed).await.expect("the host ended (no deadlock)").unwrap();
    (outcomes, counts)
}

// ---- Fake servers ---------------------------------------------------------------------

#[derive(Debug, Clone, Copy)]
enum Misbehaviour {
    /// Answers this many requests on each stream, then ends it cleanly.
    EndAfter(usize),
    /// Answers this many, then fails the stream.
    ResetAfter(usize),
    /// Answers with bytes that are no result.
    Garbage,
    /// Reads everything and answers nothing.
    Silent,
    /// Answers every request, and its health service says the model is NOT_SERVING.
    NeverServing,
}

struct Fake {
    info: pb::InfoReply,
    how: Misbehaviour,
    streams: Arc<AtomicUsize>,
}

/// A result that names its request: a tensor holding the id.
fn answer_for(id: u64) -> Vec<ResultFrame> {
    let b = Boundary { values: vec![("y".into(), Value::Tensor(tch::Tensor::from_slice(&[id as f32])))] };
    let meta = PayloadMeta { request_id: id, split: 3, direction: Direction::Result };
    let e = PayloadSender::plain().encode(meta, &Codec::RAW, &b).unwrap();
    payload_frames(id, e.envelope, &e.data, 1 << 20)
}

#[tonic::async_trait]
impl SplitInference for Fake {
    async fn info(&self, _: Request<pb::InfoRequest>) -> Result<Response<pb::InfoReply>, Status> {
        Ok(Response::new(self.info.clone()))
    }

    type InferStream = Pin<Box<dyn Stream<Item = Result<ResultFrame, Status>> + Send>>;

    async fn infer(&self, request: Request<Streaming<InferFrame>>) -> Result<Response<Self::InferStream>, Status> {
        self.streams.fetch_add(1, Ordering::SeqCst);
        let (how, mut inbound) = (self.how, request.into_inner());
        let (tx, rx) = mpsc::channel(64);
        tokio::spawn(async move {
            let mut answered = 0;
            while let Some(Ok(frame)) = inbound.next().await {
                if !frame.last {
                    continue;
                }
                let id = frame.request_id;
                match how {
                    Misbehaviour::EndAfter(n) if answered == n => return,
                    Misbehaviour::ResetAfter(n) if answered == n => {
                        let _ = tx.send(Err(Status::internal("the fake server resets the stream"))).await;
                        return;
                    }
                    Misbehaviour::Garbage => {
                        let garbage = ResultFrame {
                            request_id: id,
                            header: Bytes::from_static(&[0xff; 9]),
                            data: Bytes::from_static(b"??"),
                            last: true,
                            ..Default::default()
                        };
                        let _ = tx.send(Ok(garbage)).await;
                    }
                    Misbehaviour::Silent => {}
                    _ => {
                        for f in answer_for(id) {
                            let _ = tx.send(Ok(f)).await;
                        }
                        answered += 1;
                    }
                }
            }
            // Silent: hold the stream open until the host drops it.
            tx.closed().await;
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    type TrainStream = Pin<Box<dyn Stream<Item = Result<pb::TrainReply, Status>> + Send>>;

    async fn train(&self, _: Request<Streaming<pb::TrainFrame>>) -> Result<Response<Self::TrainStream>, Status> {
        Err(Status::unimplemented("fake"))
    }

    type GenerateStream = Pin<Box<dyn Stream<Item = Result<pb::GenerateReply, Status>> + Send>>;

    /// Silent: opens every session, then never answers a step.
    async fn generate(&self, request: Request<Streaming<pb::GenerateFrame>>) -> Result<Response<Self::GenerateStream>, Status> {
        if !matches!(self.how, Misbehaviour::Silent) {
            return Err(Status::unimplemented("fake"));
        }
        self.streams.fetch_add(1, Ordering::SeqCst);
        let (tx, rx) = mpsc::channel(4);
        let mut inbound = request.into_inner();
        tokio::spawn(async move {
            if let Ok(Some(_open)) = inbound.message().await {
                let opened = pb::GenerationOpened { session_id: "fake".into(), device: "cpu".into(), cache_bytes: 0 };
                let _ = tx.send(Ok(pb::GenerateReply { opened: Some(opened), ..Default::default() })).await;
            }
            while let Ok(Some(_step)) = inbound.message().await {}
            tx.closed().await;
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn profile(&self, _: Request<pb::ProfileRequest>) -> Result<Response<pb::ProfileReply>, Status> {
        Err(Status::unimplemented("fake"))
    }

    async fn echo(&self, _: Request<pb::EchoRequest>) -> Result<Response<pb::EchoReply>, Status> {
        Err(Status::unimplemented("fake"))
    }
}

/// A fake server for `bundle` on 127.0.0.1; its URL and how many streams it was opened.
async fn serve_fake(bundle: &Bundle, how: Misbehaviour) -> (String, Arc<AtomicUsize>) {
    let info = ServerInfo {
        server_version: "fake".into(),
        models: vec![ServedModel {
            bundle_id: bundle.id().into(),
            model_source: bundle.manifest().model.source.clone(),
            stage_count: bundle.stage_count(),
            device: "cpu".into(),
            max_batch: bundle.manifest().batch.max as u32,
            slo_ms: None,
            batch_limit: 1,
            batchable_cuts: Vec::new(),
            export: None,
        }],
        limits: Limits::default(),
        policy: CodecPolicy::default(),
        key_ids: Vec::new(),
    };
    let streams = Arc::new(AtomicUsize::new(0));
    let fake = Fake { info: pb::InfoReply::from(&info), how, streams: Arc::clone(&streams) };
    let health = match how {
        Misbehaviour::NeverServing => {
            let (reporter, health) = tonic_health::server::health_reporter();
            reporter.set_service_status(bundle.id(), tonic_health::ServingStatus::NotServing).await;
            Some(health)
        }
        _ => None,
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(SplitInferenceServer::new(fake))
            .add_optional_service(health)
            .serve_with_incoming(TcpListenerStream::new(listener)),
    );
    (url, streams)
}

fn answered_id(o: &RequestOutcome) -> f32 {
    let y = o.output.as_ref().expect("answered").values[0].1.as_tensor().unwrap().shallow_clone();
    y.double_value(&[0]) as f32
}

#[test]
fn a_server_that_ends_the_stream_part_way_has_every_request_resent_and_answered_once() {
    let bundle = Bundle::open(bundle_dir("digits")).unwrap();
    runtime().block_on(async {
        let (url, streams) = serve_fake(&bundle, Misbehaviour::EndAfter(3)).await;
        let session = connect(&url, &bundle, &Link::plain()).await.unwrap();
        let (outcomes, counts) = run_plan(&session, plan(&bundle, 3, 20, quick(5, Fallback::None))).await;
        assert_eq!(outcomes.len(), 20);
        for (id, o) in &outcomes {
            assert_eq!(answered_id(o), *id as f32, "request {id} got another request's answer");
        }
        assert_eq!((counts.sent, counts.answered, counts.failed, counts.never_sent), (20, 20, 0, 0));
        assert!(counts.reconnects >= 6 && streams.load(Ordering::SeqCst) >= 7, "{counts:?}");
        assert!(counts.retried > 0, "requests in flight when a stream ended were resent: {counts:?}");
    });
}

#[test]
fn a_server_that_resets_the_stream_has_every_request_resent_and_answered_once() {
    let bundle = Bundle::open(bundle_dir("digits")).unwrap();
    runtime().block_on(async {
        let (url, _) = serve_fake(&bundle, Misbehaviour::ResetAfter(2)).await;
        let session = connect(&url, &bundle, &Link::plain()).await.unwrap();
        let (outcomes, counts) = run_plan(&session, plan(&bundle, 3, 12, quick(5, Fallback::None))).await;
        assert!(outcomes.iter().all(|(id, o)| answered_id(o) == *id as f32));
        assert_eq!((counts.answered, counts.failed, counts.never_sent), (12, 0, 0), "{counts:?}");
        assert!(counts.reconnects >= 5, "{counts:?}");
    });
}

#[test]
fn a_server_that_sends_garbage_is_given_up_after_max_attempts_connections_that_answer_nothing() {
    let bundle = Bundle::open(bundle_dir("digits")).unwrap();
    runtime().block_on(async {
        let (url, streams) = serve_fake(&bundle, Misbehaviour::Garbage).await;
        let session = connect(&url, &bundle, &Link::plain()).await.unwrap();
        let (outcomes, counts) = run_plan(&session, plan(&bundle, 3, 6, quick(3, Fallback::None))).await;
        // The four in flight are sent on three connections that answer nothing, then the run
        // stops: they fail, the last two are never sent.
        assert_eq!(outcomes.len(), 4);
        for o in outcomes.values() {
            let failure = o.output.as_ref().expect_err("garbage is no answer");
            assert!(matches!(failure, RequestFailure::Unavailable { .. }), "{failure:?}");
            let e = failure.to_string();
            assert!(e.contains("no connection to the server answered in 3 attempts in a row (`retry.max_attempts`)"), "{e}");
            // One still in its prefix when the first connection broke went out on a later one.
            assert!((1..=3).contains(&o.metrics.attempts), "{}", o.metrics.attempts);
        }
        let sends: u64 = outcomes.values().map(|o| u64::from(o.metrics.attempts)).sum();
        assert_eq!((counts.sent, counts.answered, counts.failed, counts.retried, counts.never_sent), (4, 0, 4, sends - 4, 2), "{counts:?}");
        assert_eq!(streams.load(Ordering::SeqCst), 3);
    });
}

#[test]
fn a_silent_server_gives_errors_after_the_request_deadline_never_a_hang() {
    let bundle = Bundle::open(bundle_dir("digits")).unwrap();
    runtime().block_on(async {
        let (url, streams) = serve_fake(&bundle, Misbehaviour::Silent).await;
        let session = connect(&url, &bundle, &Link::plain()).await.unwrap();
        let (outcomes, counts) = run_plan(&session, plan(&bundle, 3, 5, quick(2, Fallback::None))).await;
        assert_eq!((outcomes.len() as u64, counts.failed, counts.retried, counts.never_sent), (4, 4, 4, 1), "{counts:?}");
        assert!(outcomes
            .values()
            .all(|o| o.output.as_ref().is_err_and(|e| e.to_string().contains("request_timeout") && e.to_string().contains("in 2 attempts"))));
        assert_eq!(streams.load(Ordering::SeqCst), 2);
    });
}

#[test]
fn a_server_whose_model_is_never_serving_is_left_after_max_attempts_request_timeouts_with_nothing_sent() {
    let bundle = Bundle::open(bundle_dir("digits")).unwrap();
    runtime().block_on(async {
        let (url, streams) = serve_fake(&bundle, Misbehaviour::NeverServing).await;
        let session = connect(&url, &bundle, &Link::plain()).await.unwrap();
        let (outcomes, counts) = run_plan(&session, plan(&bundle, 3, 6, quick(2, Fallback::None))).await;
        // The four from the prefix wait for a server that takes requests; none is sent. Each
        // stream is given up after `request_timeout` not SERVING, and the run after two.
        assert_eq!((outcomes.len() as u64, counts.sent, counts.failed, counts.never_sent), (4, 0, 4, 2), "{counts:?}");
        for o in outcomes.values() {
            let e = o.output.as_ref().expect_err("never served").to_string();
            assert!(e.contains("in 2 attempts") && e.contains("did not serve the model for 600ms (`request_timeout`)"), "{e}");
        }
        assert_eq!(streams.load(Ordering::SeqCst), 2);
    });
}

#[test]
fn a_server_that_accepts_and_never_speaks_is_refused_after_the_connect_timeout() {
    let bundle = Bundle::open(bundle_dir("digits")).unwrap();
    runtime().block_on(async {
        // A socket that accepts (the kernel does) and never answers: a stopped process.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let link = Link { connect_timeout: Duration::from_millis(300), ..Link::plain() };
        let retry = RetryPolicy { max_attempts: 2, max_backoff: Duration::from_millis(50) };
        let err = tokio::time::timeout(Duration::from_secs(30), connect_retrying(&url, &bundle, &link, &retry)).await.expect("no hang").unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("connect_timeout") && msg.contains("2 attempts"), "{msg}");
        drop(listener);
    });
}

#[test]
fn a_connector_counts_failed_attempts_in_its_health_and_gives_up_only_when_told_to() {
    use cleave_client::{Connector, LinkHealth};
    let bundle = Bundle::open(bundle_dir("digits")).unwrap();
    // A port nobody listens on: each attempt is refused, which may pass.
    let url = format!("http://{}", std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap());
    let retry = RetryPolicy { max_attempts: 3, max_backoff: Duration::from_millis(5) };
    let connector = |url: &str, health: &Arc<LinkHealth>| {
        Connector::new(vec![url.to_string()], bundle.clone(), Link::plain(), retry).reporting(Arc::clone(health), Arc::default())
    };
    runtime().block_on(async {
        let health = Arc::new(LinkHealth::default());
        let err = connector(&url, &health).connect().await.unwrap_err();
        assert!(err.to_string().contains("3 attempts"), "{err}");
        assert_eq!((health.now().failed_attempts, health.now().given_up), (3, true));
        // One that cannot pass (https:// without `tls:`) gives up at once, counted as all.
        let health = Arc::new(LinkHealth::default());
        let err = connector("https://127.0.0.1:1", &health).connect().await.unwrap_err();
        assert!(err.to_string().contains("trying again cannot fix this"), "{err}");
        assert_eq!((health.now().failed_attempts, health.now().given_up), (3, true));
        // A stream that failed on a connection made counts too; an answer starts the count over.
        let health = Arc::new(LinkHealth::default());
        let mut streams = connector(&url, &health);
        let lost = || cleave_client::LinkError::Lost(cleave_client::LinkLost::Closed);
        assert_eq!([streams.failed(&lost()), streams.failed(&lost())], [false, false]);
        streams.succeeded();
        assert_eq!(health.now().failed_attempts, 0);
        assert_eq!([streams.failed(&lost()), streams.failed(&lost()), streams.failed(&lost())], [false, false, true]);
        // One told to go on does, past `max_attempts`, until dropped.
        let health = Arc::new(LinkHealth::default());
        let mut going_on = connector(&url, &health).giving_up(false);
        let trying = tokio::spawn(async move { going_on.connect().await.map(drop) });
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while health.now().failed_attempts < 6 && std::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(health.now().failed_attempts >= 6 && !health.now().given_up, "{:?}", health.now());
        assert!(!trying.is_finished());
        trying.abort();
    });
}

// ---- A real server, stopped and restarted ---------------------------------------------

/// A server on `addr` (`127.0.0.1:0`: any port) that drains quickly when stopped.
async fn real_server(bundle: &Bundle, addr: &str, peers: PeerLimits) -> LoopbackServer {
    let dir = bundle.dir().to_path_buf();
    let prepared = tokio::task::spawn_blocking(move || {
        PreparedServer::prepare(&dir, DeviceSpec::Cpu, Limits::default(), Default::default()).unwrap().with_peer_limits(peers).unwrap()
    })
    .await
    .unwrap();
    LoopbackServer::serve_at(prepared, addr).await.unwrap()
}

fn quick_drain() -> PeerLimits {
    PeerLimits { drain_timeout: Duration::from_millis(100), ..PeerLimits::default() }
}

/// The whole model on the edge: what every answer must equal.
fn local_outputs(bundle: &Bundle, requests: u64) -> Vec<Boundary> {
    let whole = LoadedStages::load(bundle, StageRange::all(bundle), DeviceSpec::Cpu).unwrap();
    let inputs = Inputs::new(&InputSource::Synthetic { seed: 3 }, bundle, 2).unwrap();
    (0..requests).map(|id| whole.run(StageRange::all(bundle), &inputs.batch(id)).unwrap()).collect()
}

/// Runs `requests` against `url` while a chaos task (told each outcome as it comes) stops and
/// starts servers; `pace` per outcome (a slow consumer) keeps the run going while it does.
async fn run_with(
    url: &str,
    bundle: &Bundle,
    requests: u64,
    resilience: Resilience,
    outcome_seen: mpsc::UnboundedSender<u64>,
    pace: Duration,
) -> (HashMap<u64, RequestOutcome>, StreamCounts) {
    let session = connect(url, bundle, &Link::plain()).await.unwrap();
    let mut p = plan(bundle, 4, requests, resilience);
    p.in_flight = 2;
    let mut outcomes = HashMap::new();
    let streamed = stream_requests(&session, p, |o| {
        let _ = outcome_seen.send(o.request_id);
        std::thread::sleep(pace);
        assert!(outcomes.insert(o.request_id, o).is_none(), "two outcomes for one id");
    });
    let counts = tokio::time::timeout(Duration::from_secs(120), streamed).await.expect("no deadlock").unwrap();
    (outcomes, counts)
}

#[test]
fn a_server_stopped_and_restarted_mid_run_answers_every_request_exactly_once_and_bit_identically() {
    let bundle = Bundle::open(bundle_dir("digits")).unwrap();
    let requests = 60;
    let want = local_outputs(&bundle, requests);
    runtime().block_on(async {
        let first = real_server(&bundle, "127.0.0.1:0", quick_drain()).await;
        let (url, addr) = (first.url.clone(), first.url.trim_start_matches("http://").to_string());
        let (seen_tx, mut seen) = mpsc::unbounded_channel();
        let chaos = {
            let bundle = bundle.clone();
            tokio::spawn(async move {
                for _ in 0..10 {
                    seen.recv().await;
                }
                first.shutdown().await.unwrap();
                tokio::time::sleep(Duration::from_millis(300)).await;
                let second = real_server(&bundle, &addr, quick_drain()).await;
                while seen.recv().await.is_some() {}
                second
            })
        };
        let (outcomes, counts) = run_with(&url, &bundle, requests, quick(10, Fallback::None), seen_tx, Duration::ZERO).await;
        let _second = chaos.await.unwrap();
        assert_eq!(outcomes.len() as u64, requests);
        for (id, o) in &outcomes {
            let got = o.output.as_ref().unwrap_or_else(|e| panic!("request {id}: {e}"));
            assert!(got.bit_identical(&want[*id as usize]), "request {id} differs from the whole model run locally");
            assert_eq!(o.metrics.served_by, ServedBy::Server);
        }
        assert_eq!((counts.answered, counts.failed, counts.never_sent, counts.duplicates_dropped), (requests, 0, 0, 0), "{counts:?}");
        assert!(counts.reconnects >= 1, "{counts:?}");
    });
}

#[test]
fn a_host_whose_stream_the_server_ends_for_idling_opens_another_when_it_next_sends_and_loses_nothing() {
    let bundle = Bundle::open(bundle_dir("digits")).unwrap();
    let requests = 6;
    let want = local_outputs(&bundle, requests);
    runtime().block_on(async {
        let peers = PeerLimits { idle_stream_timeout: Duration::from_millis(150), ..quick_drain() };
        let server = real_server(&bundle, "127.0.0.1:0", peers).await;
        // A slow consumer: 500 ms between outcomes, long enough for the server to end a stream
        // idle twice over (each would count as a failed attempt if the host reopened at once).
        let (seen_tx, _seen) = mpsc::unbounded_channel();
        let (outcomes, counts) = run_with(&server.url, &bundle, requests, quick(2, Fallback::None), seen_tx, Duration::from_millis(500)).await;
        assert_eq!(outcomes.len() as u64, requests);
        for (id, o) in &outcomes {
            let got = o.output.as_ref().unwrap_or_else(|e| panic!("request {id}: {e}"));
            assert!(got.bit_identical(&want[*id as usize]));
        }
        assert_eq!((counts.answered, counts.failed, counts.reconnects), (requests, 0, 0), "{counts:?}");
        server.shutdown().await.unwrap();
    });
}

#[test]
fn with_fallback_edge_requests_run_on_the_edge_while_no_server_answers_and_return_to_the_split_after() {
    let bundle = Bundle::open(bundle_dir("digits")).unwrap();
    let requests = 120;
    let want = local_outputs(&bundle, requests);
    runtime().block_on(async {
        let first = real_server(&bundle, "127.0.0.1:0", quick_drain()).await;
        let (url, addr) = (first.url.clone(), first.url.trim_start_matches("http://").to_string());
        let dir = bundle.dir().to_path_buf();
        let second = tokio::task::spawn_blocking(move || {
            PreparedServer::prepare(&dir, DeviceSpec::Cpu, Limits::default(), Default::default()).unwrap().with_peer_limits(quick_drain()).unwrap()
        })
        .await
        .unwrap();
        let (seen_tx, mut seen) = mpsc::unbounded_channel();
        let chaos = tokio::spawn(async move {
            for _ in 0..10 {
                seen.recv().await;
            }
            first.shutdown().await.unwrap();
            // Down long enough for requests to fall back to the edge.
            for _ in 0..20 {
                seen.recv().await;
            }
            let second = LoopbackServer::serve_at(second, &addr).await.unwrap();
            while seen.recv().await.is_some() {}
            second
        });
        let (outcomes, counts) = run_with(&url, &bundle, requests, quick(3, Fallback::Edge), seen_tx, Duration::from_millis(5)).await;
        let _second = chaos.await.unwrap();
        assert_eq!(outcomes.len() as u64, requests);
        for (id, o) in &outcomes {
            let got = o.output.as_ref().unwrap_or_else(|e| panic!("request {id}: {e}"));
            assert!(got.bit_identical(&want[*id as usize]), "request {id} ({:?}) differs from the whole model", o.metrics.served_by);
        }
        let on_edge: Vec<u64> = outcomes.values().filter(|o| o.metrics.served_by == ServedBy::Edge).map(|o| o.request_id).collect();
        let last_on_edge = *on_edge.iter().max().expect("some requests ran on the edge");
        assert!(
            outcomes.values().any(|o| o.metrics.served_by == ServedBy::Server && o.request_id > last_on_edge),
            "the run went back to the split once the server was back"
        );
        assert_eq!((counts.answered, counts.failed, counts.served_by_edge), (requests, 0, on_edge.len() as u64), "{counts:?}");
    });
}

/// Split generation survives its server (issue 40, item 5): the server stopped after the
/// eighth new token and a new one started where it was, the host reconnects with its retry
/// rules, gives the new server the session's tokens again and sends the step again; the
/// tokens (drawn with a seed) are those of an uninterrupted run.
#[test]
fn a_generation_whose_server_stops_and_restarts_gives_the_tokens_of_an_uninterrupted_run() {
    use cleave_host::generation::{generate_on, GenerateOptions, Sampling, Servers};
    let bundle = Bundle::open(bundle_dir("gpt2")).unwrap();
    let prompt = vec![3i64, 141, 59, 26, 5];
    let options = GenerateOptions {
        loopback: false,
        cut: Some(2),
        tail_on_edge: false,
        prompt: prompt.clone(),
        max_new_tokens: 24,
        stop: Vec::new(),
        sampling: Sampling { temperature: 0.8, top_k: 20, top_p: 0.95, seed: 3 },
    };
    runtime().block_on(async {
        let first = real_server(&bundle, "127.0.0.1:0", quick_drain()).await;
        let (url, addr) = (first.url.clone(), first.url.trim_start_matches("http://").to_string());
        let servers =
            Servers { urls: vec![url], link: Link::plain(), retry: RetryPolicy { max_attempts: 50, max_backoff: Duration::from_millis(200) } };
        let want = generate_on(&bundle, &servers, &options, |_| {}).await.unwrap();
        let (stop, stopping) = std::sync::mpsc::channel();
        let (down, is_down) = std::sync::mpsc::channel();
        let restarted = bundle.clone();
        let chaos = tokio::spawn(async move {
            tokio::task::spawn_blocking(move || stopping.recv()).await.unwrap().unwrap();
            first.shutdown().await.unwrap();
            down.send(()).unwrap();
            tokio::time::sleep(Duration::from_millis(300)).await;
            real_server(&restarted, &addr, quick_drain()).await
        });
        let eighth = prompt.len() as i64 + 8;
        let got = generate_on(&bundle, &servers, &options, |t| {
            if t.position == eighth {
                stop.send(()).unwrap();
                // Blocks this worker until the server is down: the next step meets it gone.
                is_down.recv().unwrap();
            }
        })
        .await
        .unwrap();
        let second = chaos.await.unwrap();
        assert_eq!(got.tokens, want.tokens, "the tokens of an uninterrupted run");
        assert_eq!(got.tokens.len(), 24);
        second.shutdown().await.unwrap();
    });
}

/// A server that opens a generation session, then never answers a step (its connection
/// alive: PINGs answered) is left after `resilience.request_timeout` as one that went away:
/// the session is given to a server again by the retry rules, then `generate` fails naming
/// the timeout; it never hangs.
#[test]
fn a_generation_server_that_never_answers_a_step_is_left_after_the_request_timeout() {
    use cleave_host::generation::{generate_on, GenerateOptions, Sampling, Servers};
    let bundle = Bundle::open(bundle_dir("gpt2")).unwrap();
    let options = GenerateOptions {
        loopback: false,
        cut: Some(2),
        tail_on_edge: false,
        prompt: vec![3, 141, 59],
        max_new_tokens: 4,
        stop: Vec::new(),
        sampling: Sampling::default(),
    };
    runtime().block_on(async {
        let (url, streams) = serve_fake(&bundle, Misbehaviour::Silent).await;
        let link = Link { request_timeout: Duration::from_millis(300), ..Link::plain() };
        let servers = Servers { urls: vec![url], link, retry: RetryPolicy { max_attempts: 3, max_backoff: Duration::from_millis(50) } };
        let run = generate_on(&bundle, &servers, &options, |_| {});
        let e = tokio::time::timeout(Duration::from_secs(120), run).await.expect("a silent server never hangs generate").unwrap_err();
        assert!(e.to_string().contains("no answer within 300ms (`resilience.request_timeout`)"), "{e}");
        // The step is sent at most retry.max_attempts times (RetryPolicy), as a training call is.
        assert_eq!(streams.load(Ordering::SeqCst), 3, "opened, then given to the server again until the step was sent retry.max_attempts times");
    });
}

// ---- The server's window of recent results --------------------------------------------

/// Sends request `id` on a new stream under `session` and returns its decoded answer.
async fn ask(url: &str, bundle: &Bundle, session: &str, id: u64, input: &Boundary) -> Boundary {
    let mut client = SplitInferenceClient::connect(url.to_string()).await.unwrap();
    let meta = PayloadMeta { request_id: id, split: 0, direction: Direction::Request };
    let e = PayloadSender::plain().encode(meta, &Codec::RAW, input).unwrap();
    let frames: Vec<InferFrame> = payload_frames(id, e.envelope, &e.data, 1 << 20);
    let mut request = Request::new(tokio_stream::iter(frames));
    request.metadata_mut().insert(BUNDLE_ID_METADATA, bundle.id().parse().unwrap());
    request.metadata_mut().insert(HOST_SESSION_METADATA, session.parse().unwrap());
    let mut results = client.infer(request).await.unwrap().into_inner();
    let mut rx = PayloadReceiver::new(Direction::Result, 1 << 30, CodecPolicy::default(), &KeyRing::default());
    let mut assembler = cleave_common::wire::FrameAssembler::default();
    while let Some(frame) = results.next().await {
        let frame = frame.unwrap();
        assert!(frame.error.is_none(), "{:?}", frame.error);
        if let Some((done, ())) = assembler.push(&frame, |f| rx.start(f.request_id, &f.header).map(|a| (a, ()))).map_err(|(_, e)| e).unwrap() {
            return rx.finish(done).unwrap().boundary;
        }
    }
    panic!("no answer to request {id}");
}

#[test]
fn a_request_resent_under_its_session_is_answered_from_the_window_and_the_window_is_bounded() {
    let bundle = Bundle::open(bundle_dir("digits")).unwrap();
    let inputs = Inputs::new(&InputSource::Synthetic { seed: 9 }, &bundle, 2).unwrap();
    runtime().block_on(async {
        let peers = PeerLimits { dedup_window_requests: 2, ..PeerLimits::default() };
        let dir = bundle.dir().to_path_buf();
        let prepared = tokio::task::spawn_blocking(move || {
            PreparedServer::prepare(&dir, DeviceSpec::Cpu, Limits::default(), Default::default()).unwrap().with_peer_limits(peers).unwrap()
        })
        .await
        .unwrap();
        let window = prepared.result_window();
        let server = LoopbackServer::serve(prepared).await.unwrap();
        let first = ask(&server.url, &bundle, "host-a", 7, &inputs.batch(7)).await;
        assert_eq!((window.hits(), window.len()), (0, 1));
        // Resent on a new stream (its connection broke): from the window, the same answer.
        let again = ask(&server.url, &bundle, "host-a", 7, &inputs.batch(7)).await;
        assert!(again.bit_identical(&first));
        assert_eq!(window.hits(), 1);
        // Another host's request 7 is its own: computed, on its own input.
        let other = ask(&server.url, &bundle, "host-b", 7, &inputs.batch(8)).await;
        assert_eq!(window.hits(), 1);
        assert!(!other.bit_identical(&first));
        // Two results at most: host-a's request 7 was the least recently used and is gone.
        ask(&server.url, &bundle, "host-a", 8, &inputs.batch(8)).await;
        assert_eq!(window.len(), 2);
        ask(&server.url, &bundle, "host-a", 7, &inputs.batch(7)).await;
        assert_eq!(window.hits(), 1, "an evicted result is computed again");
    });
}

// ---- A device whose scheduler thread dies ----------------------------------------------

/// A digits server on the CPU whose requests wait up to 10 s for a batch of 16 samples to
/// fill, so that requests of fewer samples are all queued when the device fails; it drains
/// quickly. With the hook that kills its device's scheduler thread, and its metrics.
async fn failing_device_server(policy: DeviceFailurePolicy) -> (LoopbackServer, DeviceFaults, cleave_server::Metrics) {
    let batching = Batching { max_batch: 16, max_wait: Duration::from_secs(10), merge_cuts: true };
    let model = ModelConfig { batching, ..ModelConfig::new(bundle_dir("digits"), DeviceSpec::Cpu) };
    let scheduler = SchedulerConfig { on_device_failure: policy, ..SchedulerConfig::default() };
    let prepared = tokio::task::spawn_blocking(move || {
        PreparedServer::prepare_models(&[model], scheduler, Limits::default(), Default::default()).unwrap().with_peer_limits(quick_drain()).unwrap()
    })
    .await
    .unwrap();
    let (faults, metrics) = (prepared.device_faults(), prepared.metrics());
    (LoopbackServer::serve(prepared).await.unwrap(), faults, metrics)
}

/// Requests `ids` of `samples` each, whole on the server (cut 0), all in flight at once.
fn device_plan(bundle: &Bundle, ids: std::ops::Range<u64>, samples: i64) -> StreamPlan {
    let mut p =
        plan(bundle, 0, 0, Resilience { retry: RetryPolicy { max_attempts: 2, max_backoff: Duration::from_millis(50) }, ..Resilience::default() });
    p.in_flight = ids.clone().count();
    p.ids = ids.collect();
    p.inputs = Inputs::new(&InputSource::Synthetic { seed: 3 }, bundle, samples).unwrap();
    p
}

fn sample(metrics: &cleave_server::Metrics, name: &str, labels: &[(&str, &str)]) -> f64 {
    cleave_tests::metric_sample(&cleave_tests::parse_metrics(&metrics.render()), name, labels)
}

/// Waits until the CPU's count `name` reads `want` (the watch counts a failure after the
/// thread has answered its requests and ended, a restart once the models are reloaded).
async fn device_count_reaches(metrics: &cleave_server::Metrics, name: &str, want: f64) {
    let counted = async {
        while sample(metrics, name, &[("device", "cpu")]) != want {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(30), counted).await.unwrap_or_else(|_| panic!("{name} reaches {want}"));
}

/// Runs six one-sample requests, which wait in the device's queue for their batch to fill,
/// kills the device's scheduler thread, and returns their outcomes.
async fn six_requests_when_the_device_dies(
    url: &str,
    bundle: &Bundle,
    faults: &DeviceFaults,
    metrics: &cleave_server::Metrics,
) -> HashMap<u64, RequestOutcome> {
    let session = connect(url, bundle, &Link::plain()).await.unwrap();
    let queued = {
        let metrics = metrics.clone();
        let id = bundle.id().to_string();
        async move {
            while sample(&metrics, "cleave_queue_depth", &[("model", &id)]) < 6.0 {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    let running = run_plan(&session, device_plan(bundle, 0..6, 1));
    let kill = async {
        tokio::time::timeout(Duration::from_secs(8), queued).await.expect("the six requests are queued");
        faults.crash("cpu", "injected: the scheduler dies");
    };
    let ((outcomes, _), ()) = tokio::join!(running, kill);
    outcomes
}

fn assert_each_failed_once_naming_the_device(outcomes: &HashMap<u64, RequestOutcome>) {
    assert_eq!(outcomes.len(), 6);
    for (id, outcome) in outcomes {
        let failure = outcome.output.as_ref().expect_err("a request the failed device held has no result");
        assert_eq!(failure.server_code(), Some(tonic::Code::Internal), "request {id}: {failure:?}");
        let err = failure.to_string();
        assert!(
            err.starts_with("Internal:") && err.contains("device cpu failed (its scheduler panicked: injected: the scheduler dies)"),
            "request {id}: {err}"
        );
        assert_eq!(outcome.metrics.attempts, 1, "request {id} was not resent");
    }
}

#[test]
fn a_device_that_dies_under_on_device_failure_exit_answers_its_requests_internal_once_and_the_server_exits_with_the_cause() {
    let bundle = Bundle::open(bundle_dir("digits")).unwrap();
    runtime().block_on(async {
        let (server, faults, metrics) = failing_device_server(DeviceFailurePolicy::Exit).await;
        let channel = tonic::transport::Channel::from_shared(server.url.clone()).unwrap().connect().await.unwrap();
        let mut health = HealthClient::new(channel);
        let mut watch = health.watch(HealthCheckRequest { service: bundle.id().to_string() }).await.unwrap().into_inner();
        assert_eq!(watch.next().await.unwrap().unwrap().status, ServingStatus::Serving as i32);

        let outcomes = six_requests_when_the_device_dies(&server.url, &bundle, &faults, &metrics).await;
        assert_each_failed_once_naming_the_device(&outcomes);
        assert_eq!(watch.next().await.unwrap().unwrap().status, ServingStatus::NotServing as i32);
        device_count_reaches(&metrics, "cleave_device_failures_total", 1.0).await;
        // The server ends by itself (for a supervisor to restart it), with the cause: its
        // listener is closed once it has.
        let addr = server.url.trim_start_matches("http://").to_string();
        let closed = async {
            while tokio::net::TcpStream::connect(&addr).await.is_ok() {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(10), closed).await.expect("the server exits");
        let ended = tokio::time::timeout(Duration::from_secs(10), server.shutdown()).await.expect("its task has ended");
        let err = ended.expect_err("the server exits with an error").to_string();
        assert!(err.contains("device cpu failed: its scheduler panicked: injected: the scheduler dies (`on_device_failure: exit`)"), "{err}");
        assert_eq!(sample(&metrics, "cleave_device_restarts_total", &[("device", "cpu")]), 0.0);
    });
}

#[test]
fn a_device_that_dies_under_on_device_failure_restart_answers_its_requests_internal_once_then_serves_bit_identically() {
    let bundle = Bundle::open(bundle_dir("digits")).unwrap();
    // Sixteen samples fill a batch at once: the answers come from batches of one request.
    let whole = LoadedStages::load(&bundle, StageRange::all(&bundle), DeviceSpec::Cpu).unwrap();
    let inputs = Inputs::new(&InputSource::Synthetic { seed: 3 }, &bundle, 16).unwrap();
    let want: Vec<Boundary> = (10..14).map(|id| whole.run(StageRange::all(&bundle), &inputs.batch(id)).unwrap()).collect();
    runtime().block_on(async {
        let (server, faults, metrics) = failing_device_server(DeviceFailurePolicy::Restart).await;
        let outcomes = six_requests_when_the_device_dies(&server.url, &bundle, &faults, &metrics).await;
        assert_each_failed_once_naming_the_device(&outcomes);
        device_count_reaches(&metrics, "cleave_device_failures_total", 1.0).await;

        // Reloaded: SERVING again, for the server and the model.
        device_count_reaches(&metrics, "cleave_device_restarts_total", 1.0).await;
        let channel = tonic::transport::Channel::from_shared(server.url.clone()).unwrap().connect().await.unwrap();
        let mut health = HealthClient::new(channel);
        for service in [String::new(), bundle.id().to_string()] {
            let mut watch = health.watch(HealthCheckRequest { service: service.clone() }).await.unwrap().into_inner();
            let serving = async { while watch.next().await.unwrap().unwrap().status != ServingStatus::Serving as i32 {} };
            tokio::time::timeout(Duration::from_secs(30), serving).await.unwrap_or_else(|_| panic!("{service:?} is SERVING again"));
        }
        let session = connect(&server.url, &bundle, &Link::plain()).await.unwrap();
        let (after, _) = run_plan(&session, device_plan(&bundle, 10..14, 16)).await;
        for (id, expected) in (10..14).zip(&want) {
            let got = after[&id].output.as_ref().unwrap_or_else(|e| panic!("request {id} after the restart: {e}"));
            assert!(got.bit_identical(expected), "request {id} after the restart differs from the whole model on the edge");
        }
        server.shutdown().await.unwrap();
    });
}

// ---- Output directories ----------------------------------------------------------------

fn edge_config(dir: &std::path::Path, requests: u64) -> EdgeConfig {
    let yaml = format!(
        "server: http://127.0.0.1:1\nbundle: {}\nsplit: 4\ndevice: cpu\nbatch_size: 2\nrequests: {requests}\nin_flight: 2\n\
         input: {{kind: synthetic, seed: 3}}\noutput: {}\nloopback: {{device: cpu}}\n",
        bundle_dir("digits").display(),
        dir.join("out").display()
    );
    let path = dir.join("edge.yaml");
    std::fs::write(&path, yaml).unwrap();
    EdgeConfig::load(&path).unwrap()
}

fn prediction_ids(out: &std::path::Path) -> Vec<u64> {
    std::fs::read_to_string(out.join("predictions.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["request_id"].as_u64().unwrap())
        .collect()
}

#[test]
fn an_earlier_run_is_refused_unless_forced_and_resume_sends_only_what_has_no_outcome() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let rt = runtime();
    let run = |requests, output_mode| {
        let opts = cleave_host::RunOptions { loopback: true, output_mode, ..Default::default() };
        rt.block_on(cleave_host::run(edge_config(tmp.path(), requests), opts))
    };
    let first = run(6, OutputMode::Fresh).unwrap();
    assert_eq!((first.counts.sent, first.counts.answered, first.resumed), (6, 6, 0));
    let before = std::fs::read_to_string(out.join("predictions.jsonl")).unwrap();

    let err = run(6, OutputMode::Fresh).unwrap_err().to_string();
    assert!(err.contains("holds an earlier run") && err.contains("--force") && err.contains("--resume"), "{err}");
    assert_eq!(std::fs::read_to_string(out.join("predictions.jsonl")).unwrap(), before, "nothing was overwritten");

    // A run killed part-way: whole lines for requests 0-3, half a line for 4, and metrics
    // for 0-2 only; request 0 failed. Resuming keeps 1-2 and sends the rest, 0 again.
    let lines: Vec<&str> = before.lines().collect();
    let mut by_id: Vec<(u64, &str)> =
        lines.iter().map(|l| (serde_json::from_str::<serde_json::Value>(l).unwrap()["request_id"].as_u64().unwrap(), *l)).collect();
    by_id.sort();
    by_id[0].1 = r#"{"request_id":0,"error":"Unavailable: the server went away"}"#;
    let mut torn: String = by_id[..4].iter().map(|(_, l)| format!("{l}\n")).collect();
    torn.push_str(&by_id[4].1[..10]);
    std::fs::write(out.join("predictions.jsonl"), torn).unwrap();
    let metrics = std::fs::read_to_string(out.join("metrics.csv")).unwrap();
    let mut rows: Vec<&str> = metrics.lines().skip(1).collect();
    rows.sort_by_key(|r| r.split(',').next().unwrap().parse::<u64>().unwrap());
    let failed_row = rows[0].replacen(",true,", ",false,", 1);
    rows[0] = &failed_row;
    let kept: String = std::iter::once(metrics.lines().next().unwrap()).chain(rows[..3].iter().copied()).map(|l| format!("{l}\n")).collect();
    std::fs::write(out.join("metrics.csv"), kept).unwrap();

    let resumed = run(8, OutputMode::Resume).unwrap();
    assert_eq!((resumed.resumed, resumed.counts.sent, resumed.counts.answered, resumed.requests), (2, 6, 6, 8));
    assert_eq!(resumed.errors, 0, "the request that had failed was sent again");
    let mut ids = prediction_ids(&out);
    ids.sort();
    assert_eq!(ids, (0..8).collect::<Vec<_>>(), "each request once");
    let metric_rows = std::fs::read_to_string(out.join("metrics.csv")).unwrap().lines().count();
    assert_eq!(metric_rows, 1 + 8);

    let forced = run(2, OutputMode::Force).unwrap();
    assert_eq!((forced.requests, forced.resumed), (2, 0));
    assert_eq!(prediction_ids(&out).len(), 2);
}
