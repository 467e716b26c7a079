//! The boundary codec and link security end to end: codecs over gRPC against local runs,
//! TLS with a bearer token (and the refusals without it), and every way a sealed payload
//! can be attacked, each refused with its own status while the stream keeps serving.

use cleave_client::{connect, connect_retrying, Link, LinkError, RetryPolicy};
use cleave_common::config::Limits;
use cleave_common::pb::split_inference_client::SplitInferenceClient;
use cleave_common::pb::{self, InferFrame};
use cleave_common::security::{ClientTls, EdgeSecurity, ServerSecurity, ServerTokens, TlsIdentity, Token};
use cleave_common::wire::{Codec, CodecPolicy, Direction, Key, KeyRing, PayloadMeta, PayloadSender};
use cleave_common::{Boundary, Bundle, DeviceSpec, LoadedStages, StageRange, Value};
use cleave_host::client::{stream_requests, Splits, StreamPlan};
use cleave_host::config::{EdgeConfig, InputSource};
use cleave_host::inputs::Inputs;
use cleave_host::{LoopbackServer, RequestFailure};
use cleave_server::write_dev_secrets;
use cleave_tests::{bundle_dir, Flood};
use prost::Message;
use tokio_stream::StreamExt;

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
}

/// One host run: `requests` batches of 3 at `split` with `codec`; every request's output.
async fn run_host(
    url: &str,
    bundle: &Bundle,
    split: usize,
    codec: Codec,
    security: &EdgeSecurity,
    requests: u64,
) -> anyhow::Result<Vec<(u64, Result<Boundary, RequestFailure>)>> {
    let session = connect(url, bundle, &Link::secured(security)).await?;
    let plan = StreamPlan {
        bundle: bundle.clone(),
        split: Splits::Fixed(split),
        device: DeviceSpec::Cpu,
        warm_stages: None,
        ids: (0..requests).collect(),
        resilience: Default::default(),
        in_flight: 2,
        inputs: Inputs::new(&InputSource::Synthetic { seed: 11 }, bundle, 3)?,
        codec: codec.into(),
        key: security.key.clone(),
    };
    let mut outcomes = Vec::new();
    stream_requests(&session, plan, |o| outcomes.push((o.request_id, o.output))).await?;
    Ok(outcomes)
}

fn local(bundle: &Bundle, stages: &LoadedStages, id: u64) -> Boundary {
    let inputs = Inputs::new(&InputSource::Synthetic { seed: 11 }, bundle, 3).unwrap();
    stages.run(StageRange::all(bundle), &inputs.batch(id)).unwrap()
}

fn only_tensor(b: &Boundary) -> &tch::Tensor {
    match &b.values[0].1 {
        Value::Tensor(t) => t,
        other => panic!("not a tensor: {}", other.describe()),
    }
}

#[test]
fn every_lossless_codec_sealed_or_not_gives_the_local_output_bit_for_bit() {
    let bundle = Bundle::open(bundle_dir("resnet18")).unwrap();
    let whole = LoadedStages::load(&bundle, StageRange::all(&bundle), DeviceSpec::Cpu).unwrap();
    let key = (7, Key::random());
    let ring = KeyRing::new([key.clone()]).unwrap();
    let split = bundle.stage_count() / 3;
    runtime().block_on(async {
        // The server holds the key but does not require it: both kinds of host are served.
        let security = ServerSecurity { keys: ring, ..Default::default() };
        let server = LoopbackServer::start_secured(bundle.dir(), DeviceSpec::Cpu, Limits::default(), security).await.unwrap();
        for codec in ["raw", "shuffle+lz4", "lz4", "shuffle+zstd-1", "zstd-3"] {
            for sealed in [false, true] {
                let edge = EdgeSecurity { key: sealed.then(|| key.clone()), ..Default::default() };
                let outcomes = run_host(&server.url, &bundle, split, codec.parse().unwrap(), &edge, 2).await.unwrap();
                assert_eq!(outcomes.len(), 2);
                for (id, output) in outcomes {
                    let output = output.unwrap_or_else(|e| panic!("{codec} sealed {sealed}: {e}"));
                    assert!(output.bit_identical(&local(&bundle, &whole, id)), "{codec} sealed {sealed} request {id}");
                }
            }
        }
        // Lossy precisions change the logits only a little (random weights, so no accuracy
        // here; the digits bench measures agreement on a trained model).
        for (codec, tolerance) in [("fp16+shuffle+lz4", 0.01), ("bf16+shuffle+lz4", 0.05), ("int8+lz4", 0.1)] {
            let outcomes = run_host(&server.url, &bundle, split, codec.parse().unwrap(), &EdgeSecurity::default(), 1).await.unwrap();
            let output = outcomes[0].1.as_ref().unwrap();
            let (got, want) = (only_tensor(output), only_tensor(&local(&bundle, &whole, 0)).shallow_clone());
            let err = (got - &want).abs().max().double_value(&[]) / want.abs().max().double_value(&[]);
            assert!(err < tolerance, "{codec}: relative error {err}");
            assert!(err > 0.0, "{codec} should be lossy");
        }
        server.shutdown().await.unwrap();
    });
}

/// A loopback server with TLS, a token and a required key, and the matching host settings.
fn secured_pair(dir: &std::path::Path) -> (ServerSecurity, EdgeSecurity) {
    write_dev_secrets(dir).unwrap();
    let read = |name: &str| std::fs::read(dir.join(name)).unwrap();
    let key = (1, Key::parse(&read("payload.key")).unwrap());
    let token = Token::parse(&read("token")).unwrap();
    let server = ServerSecurity {
        policy: CodecPolicy { require_encryption: true, ..CodecPolicy::default() },
        keys: KeyRing::new([key.clone()]).unwrap(),
        tls: Some(TlsIdentity { cert_pem: read("server.pem"), key_pem: read("server.key").into() }),
        tokens: ServerTokens::Shared(token.clone()),
    };
    let edge = EdgeSecurity { key: Some(key), tls: Some(ClientTls { ca_pem: read("ca.pem"), domain: Some("localhost".into()) }), token: Some(token) };
    (server, edge)
}

#[test]
fn tls_with_a_token_serves_and_refuses_hosts_without_the_right_credentials() {
    let bundle = Bundle::open(bundle_dir("digits")).unwrap();
    let whole = LoadedStages::load(&bundle, StageRange::all(&bundle), DeviceSpec::Cpu).unwrap();
    let secrets = tempfile::tempdir().unwrap();
    let (server_security, edge) = secured_pair(secrets.path());
    runtime().block_on(async {
        let server = LoopbackServer::start_secured(bundle.dir(), DeviceSpec::Cpu, Limits::default(), server_security).await.unwrap();
        assert!(server.url.starts_with("https://127.0.0.1:"));
        let outcomes = run_host(&server.url, &bundle, 4, "shuffle+lz4".parse().unwrap(), &edge, 3).await.unwrap();
        for (id, output) in outcomes {
            assert!(output.unwrap().bit_identical(&local(&bundle, &whole, id)));
        }
        // No token: UNAUTHENTICATED before anything else.
        let no_token = EdgeSecurity { token: None, ..edge.clone() };
        let err = run_host(&server.url, &bundle, 4, Codec::RAW, &no_token, 1).await.unwrap_err().to_string();
        assert!(err.contains("Unauthenticated") && err.contains("requires a bearer token"), "{err}");
        let wrong = EdgeSecurity { token: Some(Token::parse(b"not-the-right-token-at-all").unwrap()), ..edge.clone() };
        let err = run_host(&server.url, &bundle, 4, Codec::RAW, &wrong, 1).await.unwrap_err().to_string();
        assert!(err.contains("Unauthenticated") && err.contains("wrong bearer token"), "{err}");
        // No payload key: refused at the handshake, naming the server's key ids.
        let unsealed = EdgeSecurity { key: None, ..edge.clone() };
        let err = run_host(&server.url, &bundle, 4, Codec::RAW, &unsealed, 1).await.unwrap_err().to_string();
        assert!(err.contains("requires AES-256-GCM payloads") && err.contains("[1]"), "{err}");
        let other_id = EdgeSecurity { key: Some((9, Key::random())), ..edge.clone() };
        let err = run_host(&server.url, &bundle, 4, Codec::RAW, &other_id, 1).await.unwrap_err().to_string();
        assert!(err.contains("holds key ids [1], not 9"), "{err}");
        // A CA that did not sign the server's certificate: the TLS handshake fails.
        let other_ca = tempfile::tempdir().unwrap();
        let (_, stranger) = secured_pair(other_ca.path());
        let untrusting = EdgeSecurity { tls: stranger.tls, ..edge.clone() };
        assert!(run_host(&server.url, &bundle, 4, Codec::RAW, &untrusting, 1).await.is_err());
        // Plaintext to a TLS server fails too.
        let plain_url = server.url.replace("https://", "http://");
        assert!(run_host(&plain_url, &bundle, 4, Codec::RAW, &EdgeSecurity { tls: None, ..edge.clone() }, 1).await.is_err());
        server.shutdown().await.unwrap();
    });
}

#[test]
fn a_tls_host_is_served_while_600_silent_sockets_from_one_address_are_reopened_as_fast_as_they_close() {
    let bundle = Bundle::open(bundle_dir("digits")).unwrap();
    let secrets = tempfile::tempdir().unwrap();
    let (server_security, edge) = secured_pair(secrets.path());
    runtime().block_on(async {
        let server = LoopbackServer::start_secured(bundle.dir(), DeviceSpec::Cpu, Limits::default(), server_security).await.unwrap();
        // Sockets that never start their TLS handshake, from 127.0.0.2.
        let flood = Flood::start(server.url.trim_start_matches("https://").parse().unwrap(), "127.0.0.2".parse().unwrap(), 600);
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        for run in 0..3 {
            let hosted = tokio::time::timeout(std::time::Duration::from_secs(20), run_host(&server.url, &bundle, 3, Codec::RAW, &edge, 2)).await;
            let outcomes = hosted.unwrap_or_else(|_| panic!("run {run} hung")).unwrap_or_else(|e| panic!("run {run} failed: {e}"));
            assert!(outcomes.iter().all(|(_, o)| o.is_ok()), "run {run}: {outcomes:?}");
        }
        let opened = flood.stop().await;
        assert!(opened > 600, "the flood opened its sockets again as they closed: {opened} in all");
        server.shutdown().await.unwrap();
    });
}

#[test]
fn a_link_that_cannot_work_fails_at_its_first_attempt_not_after_every_retry() {
    let bundle = Bundle::open(bundle_dir("digits")).unwrap();
    let secrets = tempfile::tempdir().unwrap();
    let (server_security, edge) = secured_pair(secrets.path());
    let other_ca = tempfile::tempdir().unwrap();
    let (_, stranger) = secured_pair(other_ca.path());
    runtime().block_on(async {
        let server = LoopbackServer::start_secured(bundle.dir(), DeviceSpec::Cpu, Limits::default(), server_security).await.unwrap();
        let tls = edge.tls.clone().unwrap();
        let cases = [
            (
                "a domain the certificate does not name",
                server.url.clone(),
                EdgeSecurity { tls: Some(ClientTls { domain: Some("elsewhere.example".into()), ..tls }), ..edge.clone() },
                "certificate not valid for name \"elsewhere.example\"",
            ),
            ("a CA that did not sign it", server.url.clone(), EdgeSecurity { tls: stranger.tls.clone(), ..edge.clone() }, "invalid peer certificate"),
            ("https with no tls:", server.url.clone(), EdgeSecurity { tls: None, ..edge.clone() }, "has no `tls:`"),
            ("tls: with http", server.url.replace("https://", "http://"), edge.clone(), "must start with https://"),
            ("a name that does not resolve", "http://no-such-host.invalid:50051".to_string(), EdgeSecurity::default(), "dns error"),
        ];
        // The defaults: 10 attempts, up to 5 s apart (about 30 s in all when each is retried).
        let retry = RetryPolicy::default();
        for (case, url, security, names) in cases {
            let link = Link::secured(&security);
            let attempt = connect_retrying(&url, &bundle, &link, &retry);
            let err = tokio::time::timeout(std::time::Duration::from_secs(60), attempt).await.expect("no hang").unwrap_err();
            assert!(matches!(err, LinkError::Unreachable { .. }) && err.is_lasting(), "{case}: {err:?}");
            let message = err.to_string();
            assert!(
                message.contains(names) && message.contains("trying again cannot fix this") && !message.contains("attempts"),
                "{case}: {message}"
            );
        }
        server.shutdown().await.unwrap();
    });
}

#[test]
fn a_wrong_payload_key_stops_the_run_after_its_first_requests_and_each_error_is_named_once() {
    let bundle = Bundle::open(bundle_dir("digits")).unwrap();
    let (server_secrets, edge_secrets) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    write_dev_secrets(server_secrets.path()).unwrap();
    write_dev_secrets(edge_secrets.path()).unwrap();
    let server_key = Key::parse(&std::fs::read(server_secrets.path().join("payload.key")).unwrap()).unwrap();
    let security = ServerSecurity {
        policy: CodecPolicy { require_encryption: true, ..CodecPolicy::default() },
        keys: KeyRing::new([(1, server_key)]).unwrap(),
        ..Default::default()
    };
    runtime().block_on(async {
        let server = LoopbackServer::start_secured(bundle.dir(), DeviceSpec::Cpu, Limits::default(), security).await.unwrap();
        // Key id 1 on both sides, another key on each.
        let yaml = format!(
            "server: {}\nbundle: {}\nsplit: 4\ndevice: cpu\nbatch_size: 2\nrequests: 40\nin_flight: 2\ninput: {{kind: synthetic, seed: 3}}\n\
             output: {}\nencryption: {{key_id: 1, file: {}}}\n",
            server.url,
            bundle.dir().display(),
            edge_secrets.path().join("out").display(),
            edge_secrets.path().join("payload.key").display()
        );
        let path = edge_secrets.path().join("edge.yaml");
        std::fs::write(&path, yaml).unwrap();
        let summary = cleave_host::run(EdgeConfig::load(&path).unwrap(), Default::default()).await.unwrap();
        let c = &summary.counts;
        assert!(c.stopped_early, "{c:?}");
        assert_eq!(c.answered, 0);
        assert_eq!(summary.errors + c.never_sent, 40);
        assert!(c.never_sent >= 40 - 3 - 2, "at most in_flight requests beyond the first 3 were sent: {c:?}");
        let wrong_key = &summary.failures[0];
        assert_eq!(wrong_key.requests, 3, "{:?}", summary.failures);
        assert!(
            wrong_key.error.starts_with("Unauthenticated: ") && wrong_key.error.ends_with("wrong key: key id 1 here is not the key the sender used"),
            "{wrong_key:?}"
        );
        assert!(summary.failures[1..].iter().all(|f| f.error.starts_with("Cancelled: the run stopped")), "{:?}", summary.failures);
        let text = cleave_host::report::summary_text(&summary);
        assert_eq!(text.matches("wrong key").count(), 1, "{text}");
        assert!(
            text.contains("     3 x Unauthenticated: decode: wrong key") && text.contains("stopped early") && text.contains("no request succeeded"),
            "{text}"
        );
        server.shutdown().await.unwrap();
    });
}

/// Frames of one sealed request from `sender`.
fn sealed_frames(sender: &mut PayloadSender, id: u64, boundary: &Boundary) -> Vec<InferFrame> {
    let meta = PayloadMeta { request_id: id, split: 0, direction: Direction::Request };
    let enc = sender.encode(meta, &"shuffle+lz4".parse().unwrap(), boundary).unwrap();
    vec![InferFrame { request_id: id, header: enc.envelope, data: enc.data.to_vec().into(), last: true, ..Default::default() }]
}

#[test]
fn attacks_on_sealed_payloads_are_each_refused_with_their_own_error() {
    let bundle = Bundle::open(bundle_dir("digits")).unwrap();
    let (input, _) = bundle.reference(3).unwrap();
    let ring = KeyRing::new([(1, Key::random())]).unwrap();
    let impostor = KeyRing::new([(1, Key::random())]).unwrap();
    let security =
        ServerSecurity { policy: CodecPolicy { require_encryption: true, ..CodecPolicy::default() }, keys: ring.clone(), ..Default::default() };
    runtime().block_on(async {
        let server = LoopbackServer::start_secured(bundle.dir(), DeviceSpec::Cpu, Limits::default(), security).await.unwrap();
        let mut host = PayloadSender::sealed(&ring, 1).unwrap();
        let mut frames = Vec::new();
        // 0: a good request.
        let good = sealed_frames(&mut host, 0, &input);
        frames.extend(good.clone());
        // 1: sealed with another key under the same id.
        frames.extend(sealed_frames(&mut PayloadSender::sealed(&impostor, 1).unwrap(), 1, &input));
        // 2: one bit of ciphertext flipped.
        let mut tampered = sealed_frames(&mut host, 2, &input);
        let mut data = tampered[0].data.to_vec();
        data[10] ^= 0x40;
        tampered[0].data = data.into();
        frames.extend(tampered);
        // 3: the header changed (the split moved), the tag left as it was.
        let mut moved = sealed_frames(&mut host, 3, &input);
        let mut envelope = cleave_codec::pb::PayloadEnvelope::decode(&moved[0].header[..]).unwrap();
        let mut header = cleave_codec::pb::PayloadHeader::decode(&envelope.header[..]).unwrap();
        header.split = 2;
        envelope.header = header.encode_to_vec().into();
        moved[0].header = envelope.encode_to_vec().into();
        frames.extend(moved);
        // 4: request 0 replayed under a new request id cannot be made (the id is
        // authenticated), so it is replayed as it was, after later payloads.
        let mut replay = good.clone();
        replay[0].request_id = 0;
        frames.extend(replay);
        // 5: an unsealed payload where sealing is required.
        let meta = PayloadMeta { request_id: 5, split: 0, direction: Direction::Request };
        let plain = PayloadSender::plain().encode(meta, &Codec::RAW, &input).unwrap();
        frames.push(InferFrame { request_id: 5, header: plain.envelope, data: plain.data.to_vec().into(), last: true, ..Default::default() });
        // 6: a good request after all of that.
        frames.extend(sealed_frames(&mut host, 6, &input));

        let mut client = SplitInferenceClient::connect(server.url.clone()).await.unwrap();
        let mut request = tonic::Request::new(tokio_stream::iter(frames));
        request.metadata_mut().insert(cleave_common::protocol::BUNDLE_ID_METADATA, bundle.id().parse().unwrap());
        let mut inbound = client.infer(request).await.unwrap().into_inner();
        let mut answers: Vec<pb::ResultFrame> = Vec::new();
        while let Some(frame) = inbound.next().await {
            answers.push(frame.unwrap());
        }
        let last: Vec<u64> = answers.iter().filter(|f| f.last).map(|f| f.request_id).collect();
        assert_eq!(last, [0, 1, 2, 3, 0, 5, 6], "one answer per request, in order");
        let finals: Vec<&pb::ResultFrame> = answers.iter().filter(|f| f.last).collect();
        let error = |i: usize| {
            let e = finals[i].error.as_ref().unwrap_or_else(|| panic!("answer {i} succeeded"));
            (tonic::Code::from(e.code), e.message.clone())
        };
        assert!(finals[0].error.is_none());
        let expected = [
            (1, "wrong key: key id 1 here is not the key the sender used"),
            (2, "the payload data was altered in flight"),
            (3, "the payload header was altered in flight"),
            (4, "replayed or reordered payload refused: counter 0 was accepted before"),
            (5, "this side requires encrypted payloads"),
        ];
        for (i, text) in expected {
            let (code, message) = error(i);
            assert_eq!(code, tonic::Code::Unauthenticated, "{message}");
            assert!(message.contains(text), "answer {i}: {message}");
        }
        assert!(finals[6].error.is_none(), "the stream keeps serving after refusals");
        server.shutdown().await.unwrap();
    });
}

#[test]
fn secret_config_errors_name_the_key_and_never_the_secret() {
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, text: &str| {
        let p = dir.path().join(name);
        std::fs::write(&p, text).unwrap();
        p
    };
    let base = "server: http://h:1\nbundle: b\nsplit: 1\ninput: {kind: synthetic}\noutput: o\n";
    let secret = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdeX";
    write("bad.key", secret);
    let err = EdgeConfig::load(&write("e1.yaml", &format!("{base}encryption: {{key_id: 1, file: bad.key}}\n"))).unwrap_err().to_string();
    assert!(err.contains("`encryption`") && err.contains("not all hex digits") && !err.contains(secret), "{err}");
    let err = EdgeConfig::load(&write("e2.yaml", &format!("{base}encryption: {{key_id: 1, key: {secret}}}\n"))).unwrap_err().to_string();
    assert!(err.contains("unknown field `key`"), "{err}");
    let err = EdgeConfig::load(&write("e3.yaml", &format!("{base}encryption: {{key_id: 1, env: CLEAVE_TEST_NO_SUCH_VARIABLE}}\n")))
        .unwrap_err()
        .to_string();
    assert!(err.contains("environment variable CLEAVE_TEST_NO_SUCH_VARIABLE is not set"), "{err}");
    let err = EdgeConfig::load(&write("e4.yaml", &format!("{base}codec: lz4+gzip\n"))).unwrap_err().to_string();
    assert!(err.contains("`codec`") && err.contains("unknown part \"gzip\""), "{err}");
    let err = EdgeConfig::load(&write("e5.yaml", &format!("{base}tls: {{ca: nowhere.pem}}\n"))).unwrap_err().to_string();
    assert!(err.contains("`tls.ca`") && err.contains("nowhere.pem"), "{err}");
}

#[test]
fn the_handshake_refuses_a_codec_or_key_the_server_does_not_accept_naming_what_it_does() {
    use cleave_client::check_server_accepts;
    use cleave_common::protocol::{ServerInfo, PROTOCOL_VERSION};
    let support = pb::CodecSupport {
        precisions: vec!["full".into(), "fp16".into()],
        compressions: vec!["none".into(), "lz4".into()],
        encryption_required: true,
        key_ids: vec![1, 2],
    };
    let limits = pb::Limits { max_message_bytes: 8 << 20, max_payload_bytes: 1 << 30, queue_depth: 64, max_batch: 8 };
    let reply = pb::InfoReply {
        protocol_version: PROTOCOL_VERSION,
        bundle_id: "abc".into(),
        codecs: Some(support),
        limits: Some(limits),
        ..Default::default()
    };
    let info = ServerInfo::try_from(reply).unwrap();
    let check = |codec: &str, key: Option<u32>| check_server_accepts(&info, &codec.parse().unwrap(), key).map_err(|e| e.to_string());
    assert!(check("fp16+shuffle+lz4", Some(2)).is_ok());
    let err = check("int8+lz4", Some(1)).unwrap_err();
    assert!(err.contains("precision int8 is not accepted (accepted: full, fp16)"), "{err}");
    let err = check("shuffle+zstd", Some(1)).unwrap_err();
    assert!(err.contains("compression zstd is not accepted (accepted: none, lz4)"), "{err}");
    assert!(check("lz4", None).unwrap_err().contains("requires AES-256-GCM payloads"));
    assert!(check("lz4", Some(3)).unwrap_err().contains("holds key ids [1, 2], not 3"));
}

/// With a key, each generation step and its answer travel sealed whole: the tokens are a
/// plaintext run's, with the head on the server (top-k answers) and on the edge (hidden
/// states). A server that requires sealing refuses a host without the key before any step,
/// and refuses each plain, replayed, altered or reflected step on its own, the session
/// unchanged: the next sealed step is answered at the position the refused ones would take.
#[test]
fn sealed_generation_gives_the_plain_tokens_and_each_step_that_does_not_authenticate_is_refused() {
    use cleave_common::protocol::{SEALED_REPLY_KIND, SEALED_STEP_KIND};
    use cleave_host::generation::{generate_on, GenerateOptions, Sampling, Servers};
    use pb::generate_frame::Kind;
    let bundle = Bundle::open(bundle_dir("gpt2")).unwrap();
    let info = bundle.manifest().generation.clone().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (server_security, edge) = secured_pair(dir.path());
    let rt = runtime();
    rt.block_on(async {
        let secured = LoopbackServer::start_secured(bundle.dir(), DeviceSpec::Cpu, Limits::default(), server_security).await.unwrap();
        let plain = LoopbackServer::start(bundle.dir(), DeviceSpec::Cpu, Limits::default()).await.unwrap();
        let retry = RetryPolicy { max_attempts: 1, max_backoff: std::time::Duration::from_millis(10) };
        let servers = |url: &str, link: Link| Servers { urls: vec![url.to_string()], link, retry };
        let drawn = Sampling { temperature: 0.8, top_k: 20, top_p: 0.95, seed: 3 };
        let options = GenerateOptions {
            loopback: false,
            cut: None,
            tail_on_edge: false,
            prompt: vec![3, 141, 59, 26, 5],
            max_new_tokens: 12,
            stop: Vec::new(),
            sampling: drawn,
        };
        for tail_on_edge in [false, true] {
            let options = GenerateOptions { tail_on_edge, ..options.clone() };
            let want = generate_on(&bundle, &servers(&plain.url, Link::plain()), &options, |_| {}).await.unwrap().tokens;
            let got = generate_on(&bundle, &servers(&secured.url, Link::secured(&edge)), &options, |_| {}).await.unwrap().tokens;
            assert_eq!(got, want, "tail on the edge: {tail_on_edge}");
        }
        let no_key = EdgeSecurity { key: None, ..edge.clone() };
        let refused = generate_on(&bundle, &servers(&secured.url, Link::secured(&no_key)), &options, |_| {}).await.unwrap_err();
        assert!(refused.to_string().contains("requires AES-256-GCM"), "{refused}");

        // Frames by hand, past the host's own checks.
        let mut session = connect(&secured.url, &bundle, &Link::secured(&no_key)).await.unwrap();
        let (frames, rx) = tokio::sync::mpsc::channel(8);
        let n = info.stages.len() as u32;
        frames.send(pb::GenerateFrame { kind: Some(Kind::Open(pb::OpenGeneration { start: 1, end: n, batch: 1, max_len: 8 })) }).await.unwrap();
        let call = session.model_request(tokio_stream::wrappers::ReceiverStream::new(rx));
        let mut replies = session.client.generate(call).await.unwrap().into_inner();
        assert!(replies.message().await.unwrap().unwrap().opened.is_some());
        let step = |request_id: u64, at: u32| pb::GenerateStep {
            request_id,
            tokens: 1,
            hidden: vec![0u8; (info.hidden_width() * 4) as usize].into(),
            positions_from: vec![at],
            last_token_only: true,
            top_k: 2,
            ..Default::default()
        };
        let ring = KeyRing::new([edge.key.clone().unwrap()]).unwrap();
        let (mut sealer, mut opener) = (ring.sealer(1).unwrap(), ring.opener());
        let refusal = |reply: &pb::GenerateReply| reply.error.as_ref().map(|e| (tonic::Code::from_i32(e.code), e.message.clone())).unwrap();

        let reply = exchange(&frames, &mut replies, Kind::Step(step(1, 0))).await;
        let (code, message) = refusal(&reply);
        assert!(code == tonic::Code::Unauthenticated && message.contains("requires encrypted payloads") && reply.request_id == 1, "{message}");
        let first = sealer.seal_message(SEALED_STEP_KIND, step(2, 0).encode_to_vec()).unwrap();
        let reply = exchange(&frames, &mut replies, Kind::SealedStep(first.clone())).await;
        assert!(reply.error.is_none() && reply.output.is_empty() && reply.request_id == 2, "only the request id beside the sealed answer");
        let opened = pb::GenerateReply::decode(opener.open_message(SEALED_REPLY_KIND, reply.sealed.unwrap()).unwrap().as_slice()).unwrap();
        assert!(opened.request_id == 2 && opened.shape == [1, 1, 2] && opened.token_ids.len() == 8, "{opened:?}");

        let replayed = exchange(&frames, &mut replies, Kind::SealedStep(first)).await;
        let mut altered = sealer.seal_message(SEALED_STEP_KIND, step(3, 1).encode_to_vec()).unwrap();
        altered.data[0] ^= 1;
        let altered = exchange(&frames, &mut replies, Kind::SealedStep(altered)).await;
        // A step sealed as an answer: a server's answer sent back to it is not a step.
        let reflected =
            exchange(&frames, &mut replies, Kind::SealedStep(sealer.seal_message(SEALED_REPLY_KIND, step(4, 1).encode_to_vec()).unwrap())).await;
        for (reply, why) in [(replayed, "replayed"), (altered, "data was altered"), (reflected, "header was altered")] {
            let (code, message) = refusal(&reply);
            assert!(code == tonic::Code::Unauthenticated && message.contains(why), "{why}: {message}");
        }
        let next =
            exchange(&frames, &mut replies, Kind::SealedStep(sealer.seal_message(SEALED_STEP_KIND, step(5, 1).encode_to_vec()).unwrap())).await;
        assert!(next.error.is_none(), "{:?}", next.error);
        let opened = pb::GenerateReply::decode(opener.open_message(SEALED_REPLY_KIND, next.sealed.unwrap()).unwrap().as_slice()).unwrap();
        assert_eq!(opened.request_id, 5);
    });
}

/// Sends one frame of `kind` on a `Generate` stream and waits for its reply.
async fn exchange(
    frames: &tokio::sync::mpsc::Sender<pb::GenerateFrame>,
    replies: &mut tonic::Streaming<pb::GenerateReply>,
    kind: pb::generate_frame::Kind,
) -> pb::GenerateReply {
    frames.send(pb::GenerateFrame { kind: Some(kind) }).await.unwrap();
    replies.message().await.unwrap().unwrap()
}
