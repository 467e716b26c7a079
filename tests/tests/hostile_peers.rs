//! A server nothing can exhaust: the limits on what peers make it hold (memory, requests per
//! stream, connections, `Echo` replies, profiles, training sessions) and its drain. Memory is
//! checked through the budget's own accounting, never through timings.

use std::time::Duration;

use bytes::Bytes;
use cleave_common::config::Limits;
use cleave_common::pb::split_inference_client::SplitInferenceClient;
use cleave_common::pb::{self, train_frame, InferFrame, TrainFrame};
use cleave_common::wire::{Codec, Direction, PayloadMeta, PayloadSender};
use cleave_common::{Boundary, Bundle, DeviceSpec};
use cleave_host::LoopbackServer;
use cleave_server::{PeerLimits, PreparedServer, TrainingOptions};
use cleave_tests::{bundle_dir, metric_sample, parse_metrics, Flood};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::StreamExt;

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
}

/// A server on `bundle` with these limits, and its memory budget.
async fn serve(bundle: &Bundle, limits: Limits, peers: PeerLimits, training: TrainingOptions) -> (LoopbackServer, cleave_server::MemoryBudget) {
    let dir = bundle.dir().to_path_buf();
    let prepared = tokio::task::spawn_blocking(move || {
        PreparedServer::prepare(&dir, DeviceSpec::Cpu, limits, Default::default()).unwrap().with_training(training).with_peer_limits(peers).unwrap()
    })
    .await
    .unwrap();
    let budget = prepared.memory_budget();
    (LoopbackServer::serve(prepared).await.unwrap(), budget)
}

/// An `Infer` stream whose frames the test sends one at a time.
struct RawStream {
    frames: mpsc::Sender<InferFrame>,
    results: tonic::Streaming<pb::ResultFrame>,
}

async fn open_stream(url: &str, bundle: &Bundle) -> RawStream {
    let mut client = SplitInferenceClient::connect(url.to_string()).await.unwrap();
    let (frames, rx) = mpsc::channel(16);
    let mut request = tonic::Request::new(ReceiverStream::new(rx));
    request.metadata_mut().insert(cleave_common::protocol::BUNDLE_ID_METADATA, bundle.id().parse().unwrap());
    let results = client.infer(request).await.unwrap().into_inner();
    RawStream { frames, results }
}

/// A request at cut 0 in `parts` frames.
fn request_frames(id: u64, boundary: &Boundary, parts: usize) -> Vec<InferFrame> {
    request_frames_at(id, 0, boundary, parts)
}

/// A request at `split` in `parts` frames.
fn request_frames_at(id: u64, split: u32, boundary: &Boundary, parts: usize) -> Vec<InferFrame> {
    let meta = PayloadMeta { request_id: id, split, direction: Direction::Request };
    let encoded = PayloadSender::plain().encode(meta, &Codec::RAW, boundary).unwrap();
    let data = Bytes::from(encoded.data.to_vec());
    let chunk = data.len().div_ceil(parts);
    (0..parts)
        .map(|i| {
            let data = data.slice(i * chunk..((i + 1) * chunk).min(data.len()));
            let header = if i == 0 { encoded.envelope.clone() } else { Bytes::new() };
            InferFrame { request_id: id, header, data, last: i + 1 == parts, ..Default::default() }
        })
        .collect()
}

impl RawStream {
    /// Sends a request in `parts` frames, or only the first `sent` of them.
    async fn send(&self, id: u64, boundary: &Boundary, parts: usize, sent: usize) {
        self.send_at(id, 0, boundary, parts, sent).await;
    }

    /// [`Self::send`] for a request at `split`.
    async fn send_at(&self, id: u64, split: u32, boundary: &Boundary, parts: usize, sent: usize) {
        for frame in request_frames_at(id, split, boundary, parts).into_iter().take(sent) {
            self.frames.send(frame).await.unwrap();
        }
    }

    /// The next complete answer: its request id and its error (code and message), if any.
    async fn answer(&mut self) -> (u64, Option<(tonic::Code, String)>) {
        loop {
            let frame = self.results.next().await.expect("an answer").expect("the stream goes on");
            if frame.last {
                return (frame.request_id, frame.error.map(|e| (tonic::Code::from(e.code), e.message)));
            }
        }
    }
}

/// The (small) resnet18 test bundle's input at batch 32: 1.5 MB of tensor data.
fn resnet_input(bundle: &Bundle) -> Boundary {
    cleave_common::value::synthetic_inputs(&bundle.manifest().inputs, bundle.sizes_at(32)).unwrap()
}

#[test]
fn a_request_reserves_the_room_its_answer_will_take_from_its_first_frame() {
    let bundle = Bundle::open(bundle_dir("resnet18")).unwrap();
    // The last cut before the output: 2 KiB a sample in, 4 KB a sample out.
    let last = bundle.stage_count();
    let cut = (0..last).rev().find(|&c| bundle.cut(c).usable).unwrap();
    let sizes = bundle.sizes_at(32);
    let boundary = cleave_common::value::synthetic_inputs(&bundle.cut(cut).values, sizes).unwrap();
    let request = boundary.tensor_bytes() as u64;
    let answer = bundle.cut(last).bytes_at(sizes).unwrap();
    assert!(answer > request, "the answer ({answer} bytes) outweighs the request ({request})");
    let limits = Limits { max_payload_bytes: answer, ..Limits::default() };
    let peers = PeerLimits { request_timeout: Duration::from_secs(2), ..PeerLimits::fitting(&limits) };
    runtime().block_on(async {
        let (server, budget) = serve(&bundle, limits, peers, TrainingOptions::default()).await;
        // Half of the request, then nothing: what it holds is what it reserved at its first frame.
        let s = open_stream(&server.url, &bundle).await;
        s.send_at(1, cut as u32, &boundary, 2, 1).await;
        // The answer's room, on the wire (a codec's worst case and 64 KiB of frame headers), in
        // whole KiB; and the stream's read buffer, which holds the frame.
        let room = (answer + answer / 64 + (64 << 10)).div_ceil(1024) * 1024;
        let frame = &request_frames_at(1, cut as u32, &boundary, 2)[0];
        held_until("the request's reservation", || budget.held_bytes() >= room).await;
        assert_eq!(budget.held_bytes(), room + read_buffer_bytes(frame), "a request of {request} bytes whose answer takes {answer}");
    });
}

/// Waits until `reached` says so, failing the test after 10 s.
async fn held_until(what: &str, reached: impl Fn() -> bool) {
    let waiting = async {
        while !reached() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), waiting).await.unwrap_or_else(|_| panic!("waited 10 s for {what}"));
}

/// Waits up to 10 s for `held` to read `want`, then asserts it: a request's bytes go back
/// once its answer is written, a moment after the peer reads it.
async fn settles_at(what: &str, want: u64, held: impl Fn() -> u64) {
    let _ = tokio::time::timeout(Duration::from_secs(10), async {
        while held() != want {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    assert_eq!(held(), want, "{what}");
}

/// What `frame` holds in the budget while its call lives (the call's message buffer, counted
/// from its gRPC prefix, is at least that large): its bytes on the wire, in whole KiB.
fn read_buffer_bytes(frame: &impl prost::Message) -> u64 {
    (5 + prost::Message::encoded_len(frame) as u64).div_ceil(1024) * 1024
}

#[test]
fn stalled_requests_hold_only_the_budget_then_are_answered_deadline_exceeded_and_freed() {
    let bundle = Bundle::open(bundle_dir("resnet18")).unwrap();
    let input = resnet_input(&bundle);
    // A raw request is received straight into its tensors and holds their 1.5 MB; its
    // stream's read buffer holds its largest frame. Two stalled streams with half a request
    // each fit in the budget; a third with a whole request in one frame reads it, and its
    // request misses by one KiB.
    let raw = (input.tensor_bytes() as u64).div_ceil(1024) * 1024;
    let half = read_buffer_bytes(&request_frames(1, &input, 2)[0]);
    let whole = read_buffer_bytes(&request_frames(3, &input, 1)[0]);
    let limits = Limits { max_payload_bytes: raw, ..Limits::default() };
    let peers = PeerLimits {
        memory_budget_bytes: 2 * (half + raw) + whole + raw - 1024,
        budget_wait: Duration::from_millis(300),
        request_timeout: Duration::from_secs(2),
        ..PeerLimits::default()
    };
    assert!(peers.validate(&limits).is_ok(), "a budget allowed: {:?}", peers.validate(&limits));
    runtime().block_on(async {
        let (server, budget) = serve(&bundle, limits, peers, TrainingOptions::default()).await;
        // Two streams each send half of a request and stall.
        let mut stalled = Vec::new();
        for id in [1u64, 2] {
            let s = open_stream(&server.url, &bundle).await;
            s.send(id, &input, 2, 1).await;
            // In order: the third must come after both hold their bytes.
            held_until("the stalled requests' reservations", || budget.held_bytes() >= id * (half + raw)).await;
            stalled.push(s);
        }
        assert_eq!(budget.held_bytes(), 2 * (half + raw));
        // A third finds no room for its request: it waits the budget's wait, then
        // RESOURCE_EXHAUSTED, while the budget holds the two stalled requests and the three
        // streams' read buffers.
        let mut third = open_stream(&server.url, &bundle).await;
        third.send(3, &input, 1, 1).await;
        let (id, error) = third.answer().await;
        let (code, message) = error.expect("refused");
        assert_eq!((id, code), (3, tonic::Code::ResourceExhausted), "{message}");
        assert!(message.contains("`limits.memory_budget_bytes`"), "{message}");
        assert_eq!(budget.held_bytes(), 2 * (half + raw) + whole);
        assert!(budget.peak_bytes() <= budget.total_bytes());
        // The stalled ones are answered DEADLINE_EXCEEDED and give their request bytes back.
        for (s, id) in stalled.iter_mut().zip([1, 2]) {
            let (got, error) = s.answer().await;
            let (code, message) = error.expect("stalled");
            assert_eq!((got, code), (id, tonic::Code::DeadlineExceeded), "{message}");
            assert!(message.contains("`limits.request_timeout`"), "{message}");
        }
        settles_at("the streams' read buffers only", 2 * half + whole, || budget.held_bytes()).await;
        // The rest of a given-up request's frames are skipped; the stream serves the next.
        let s = &mut stalled[0];
        s.send(1, &input, 2, 2).await;
        s.send(4, &input, 1, 1).await;
        assert_eq!(s.answer().await, (4, None));
        settles_at("the first stream's buffer grew to a whole request", half + 2 * whole, || budget.held_bytes()).await;
        // Streams that end give their read buffers back.
        drop((stalled, third));
        held_until("ended streams giving their read buffers back", || budget.held_bytes() == 0).await;
        server.shutdown().await.unwrap();
    });
}

#[test]
fn a_stream_holds_at_most_max_requests_per_stream() {
    // Eight requests sent at once on one stream: with one allowed in flight, the stream is not
    // read further until each is answered, so the budget never holds two.
    let bundle = Bundle::open(bundle_dir("resnet18")).unwrap();
    let input = resnet_input(&bundle);
    // A raw request is received straight into its tensors: it holds their bytes only.
    let one = input.tensor_bytes() as u64;
    let peers = PeerLimits { max_requests_per_stream: 1, ..PeerLimits::default() };
    runtime().block_on(async {
        let (server, budget) = serve(&bundle, Limits::default(), peers, TrainingOptions::default()).await;
        let mut s = open_stream(&server.url, &bundle).await;
        let frames: Vec<InferFrame> = (0..8).flat_map(|id| request_frames(id, &input, 1)).collect();
        let sender = s.frames.clone();
        let sending = tokio::spawn(async move {
            for frame in frames {
                sender.send(frame).await.unwrap();
            }
        });
        for id in 0..8 {
            assert_eq!(s.answer().await, (id, None));
        }
        sending.await.unwrap();
        // And the stream's read buffer, as large as one request's frame.
        let buffer = read_buffer_bytes(&request_frames(0, &input, 1)[0]);
        let peak = budget.peak_bytes();
        assert!(peak >= one + buffer && peak < 2 * one + buffer, "peak {peak} bytes held; one request holds {one}, the read buffer {buffer}");
        server.shutdown().await.unwrap();
    });
}

#[test]
fn connections_past_the_limit_are_closed_and_idle_ones_time_out() {
    let bundle = Bundle::open(bundle_dir("digits")).unwrap();
    let peers = PeerLimits { max_connections: 2, idle_connection_timeout: Duration::from_secs(1), ..PeerLimits::default() };
    runtime().block_on(async {
        let (server, _) = serve(&bundle, Limits::default(), peers, TrainingOptions::default()).await;
        let info = |url: String| async move {
            let mut client = SplitInferenceClient::connect(url).await.map_err(|e| e.to_string())?;
            client.info(pb::InfoRequest {}).await.map(|_| client).map_err(|e| e.to_string())
        };
        let first = info(server.url.clone()).await.expect("the first connection is served");
        let second = info(server.url.clone()).await.expect("the second connection is served");
        // A third's first call is refused at once, naming the limit, instead of hanging.
        let third = tokio::time::timeout(Duration::from_secs(20), info(server.url.clone())).await.expect("refused at once, not left hanging");
        let refused = third.expect_err("a third connection past `max_connections: 2` is served");
        assert!(refused.contains("limits.max_connections"), "{refused}");
        // Idle connections (no call open) are closed after the idle timeout, freeing their places.
        tokio::time::sleep(Duration::from_millis(2500)).await;
        info(server.url.clone()).await.expect("a place is free once the idle connections are closed");
        drop((first, second));
        server.shutdown().await.unwrap();
    });
}

/// `SplitInfo` over a fresh connection: the client on success, the error as text.
async fn info_call(url: String) -> Result<SplitInferenceClient<tonic::transport::Channel>, String> {
    let mut client = SplitInferenceClient::connect(url).await.map_err(|e| e.to_string())?;
    client.info(pb::InfoRequest {}).await.map(|_| client).map_err(|e| e.to_string())
}

/// `n` sockets to the server from `source` that never send a byte.
async fn silent_sockets(url: &str, source: &str, n: u32) -> Vec<tokio::net::TcpStream> {
    let server: std::net::SocketAddr = url.trim_start_matches("http://").parse().unwrap();
    let mut sockets = Vec::new();
    for _ in 0..n {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind(format!("{source}:0").parse().unwrap()).unwrap();
        sockets.push(socket.connect(server).await.unwrap());
    }
    sockets
}

/// Whether the server closes `socket` within `within` (reading whatever it writes first, its
/// HTTP/2 SETTINGS say).
async fn closed_within(socket: &mut tokio::net::TcpStream, within: Duration) -> bool {
    use tokio::io::AsyncReadExt;
    let mut buf = [0u8; 256];
    tokio::time::timeout(within, async {
        while let Ok(n) = socket.read(&mut buf).await {
            if n == 0 {
                break;
            }
        }
    })
    .await
    .is_ok()
}

/// The HTTP/2 frames a server writes to `socket` until it closes it (or 5 s pass): (type,
/// payload).
async fn read_h2_frames(socket: &mut tokio::net::TcpStream) -> Vec<(u8, Vec<u8>)> {
    use tokio::io::AsyncReadExt;
    let mut bytes = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), socket.read_to_end(&mut bytes)).await;
    let mut frames = Vec::new();
    let mut rest = &bytes[..];
    while rest.len() >= 9 {
        let len = u32::from_be_bytes([0, rest[0], rest[1], rest[2]]) as usize;
        let Some(payload) = rest.get(9..9 + len) else { break };
        frames.push((rest[3], payload.to_vec()));
        rest = &rest[9 + len..];
    }
    frames
}

#[test]
fn the_server_announces_its_largest_frame_and_closes_a_connection_that_sends_a_larger_one() {
    use tokio::io::AsyncWriteExt;
    const SETTINGS: u8 = 0x4;
    const GOAWAY: u8 = 0x7;
    const SETTINGS_MAX_FRAME_SIZE: u16 = 0x5;
    const FRAME_SIZE_ERROR: u32 = 0x6;
    let bundle = Bundle::open(bundle_dir("digits")).unwrap();
    let max_frame_bytes = 65_536;
    let peers = PeerLimits { max_frame_bytes, ..PeerLimits::default() };
    runtime().block_on(async {
        let (server, _) = serve(&bundle, Limits::default(), peers, TrainingOptions::default()).await;
        let addr = server.url.trim_start_matches("http://").to_string();
        let mut socket = tokio::net::TcpStream::connect(&addr).await.unwrap();
        let mut hello = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        hello.extend_from_slice(&[0, 0, 0, SETTINGS, 0, 0, 0, 0, 0]);
        // The head of a DATA frame one byte over the limit, on stream 1.
        let over = (max_frame_bytes + 1).to_be_bytes();
        hello.extend_from_slice(&[over[1], over[2], over[3], 0x0, 0, 0, 0, 0, 1]);
        socket.write_all(&hello).await.unwrap();
        let frames = read_h2_frames(&mut socket).await;
        let (_, settings) = frames.iter().find(|(kind, _)| *kind == SETTINGS).expect("the server's SETTINGS");
        let announced = settings
            .chunks(6)
            .find(|p| u16::from_be_bytes([p[0], p[1]]) == SETTINGS_MAX_FRAME_SIZE)
            .map(|p| u32::from_be_bytes([p[2], p[3], p[4], p[5]]));
        assert_eq!(announced, Some(max_frame_bytes), "SETTINGS_MAX_FRAME_SIZE in {settings:?}");
        let (_, goaway) = frames.iter().find(|(kind, _)| *kind == GOAWAY).expect("a GOAWAY before the connection closed");
        assert_eq!(u32::from_be_bytes([goaway[4], goaway[5], goaway[6], goaway[7]]), FRAME_SIZE_ERROR);
    });
}

#[test]
fn silent_sockets_neither_lock_callers_out_nor_outlive_the_handshake_timeout() {
    let bundle = Bundle::open(bundle_dir("digits")).unwrap();
    let peers = PeerLimits { handshake_timeout: Duration::from_secs(2), ..PeerLimits::default() };
    runtime().block_on(async {
        let (server, _) = serve(&bundle, Limits::default(), peers, TrainingOptions::default()).await;
        // As many silent sockets from 127.0.0.2 as `max_connections` (256): none of them counts.
        let mut silent = silent_sockets(&server.url, "127.0.0.2", peers.max_connections).await;
        let caller = info_call(server.url.clone()).await.expect("a caller on 127.0.0.1 is served beside 256 silent sockets");
        // Each is closed once `handshake_timeout` has passed, while the caller's stays open.
        for socket in &mut silent {
            assert!(closed_within(socket, Duration::from_secs(20)).await, "a silent socket is still open 20 s after its handshake timeout");
        }
        let mut caller = caller;
        caller.info(pb::InfoRequest {}).await.expect("the caller's connection is still served");
        server.shutdown().await.unwrap();
    });
}

#[test]
fn one_address_holds_at_most_its_share_of_connections() {
    let bundle = Bundle::open(bundle_dir("digits")).unwrap();
    let peers = PeerLimits { max_connections_per_address: 3, handshake_timeout: Duration::from_secs(30), ..PeerLimits::default() };
    runtime().block_on(async {
        let (server, _) = serve(&bundle, Limits::default(), peers, TrainingOptions::default()).await;
        let mut silent = silent_sockets(&server.url, "127.0.0.2", 4).await;
        // The fourth from 127.0.0.2 is closed at once, long before the handshake timeout; the
        // first three stay open.
        assert!(closed_within(&mut silent[3], Duration::from_secs(10)).await, "a fourth socket from one address is kept");
        for socket in &mut silent[..3] {
            assert!(!closed_within(socket, Duration::from_millis(300)).await, "a socket within its address's share is closed");
        }
        info_call(server.url.clone()).await.expect("another address is served");
        // Once they are gone, their address has its share again.
        drop(silent);
        tokio::time::sleep(Duration::from_millis(300)).await;
        for socket in &mut silent_sockets(&server.url, "127.0.0.2", 3).await {
            assert!(!closed_within(socket, Duration::from_millis(300)).await, "an address's share is not given back");
        }
        server.shutdown().await.unwrap();
    });
}

/// A connection from `source` with an `Infer` stream opened on it and nothing sent; the error
/// when the server closed the socket at once or refused the call.
async fn silent_stream_from(source: &str, url: &str, bundle: &Bundle) -> Result<RawStream, String> {
    let endpoint = tonic::transport::Endpoint::from_shared(url.to_string()).unwrap().local_address(Some(source.parse().unwrap()));
    let channel = endpoint.connect().await.map_err(|e| e.to_string())?;
    let mut client = SplitInferenceClient::new(channel);
    let (frames, rx) = mpsc::channel(16);
    let mut request = tonic::Request::new(ReceiverStream::new(rx));
    request.metadata_mut().insert(cleave_common::protocol::BUNDLE_ID_METADATA, bundle.id().parse().unwrap());
    let results = client.infer(request).await.map_err(|e| e.to_string())?.into_inner();
    Ok(RawStream { frames, results })
}

#[test]
fn connections_holding_silent_streams_from_one_address_take_only_its_share_and_callers_elsewhere_are_served() {
    let bundle = Bundle::open(bundle_dir("digits")).unwrap();
    let peers = PeerLimits::default();
    runtime().block_on(async {
        let server = prepared(&bundle, Limits::default(), peers).await;
        let metrics = server.metrics();
        let server = LoopbackServer::serve(server).await.unwrap();
        // As many connections from 127.0.0.2 as `max_connections` (256), each holding an
        // `Infer` stream that sends nothing: its share (a quarter) is held, the rest closed.
        let mut held = Vec::new();
        for _ in 0..peers.max_connections {
            if let Ok(stream) = silent_stream_from("127.0.0.2", &server.url, &bundle).await {
                held.push(stream);
            }
        }
        assert_eq!((held.len() as u32, peers.max_connections_per_address), (peers.max_connections / 4, 64));
        // Each connection refused (a client may try its socket more than once) is counted.
        let refused = metric(&metrics, "cleave_connections_refused_total", &[("reason", "address_share")]);
        assert!(refused >= 192.0, "{refused} refusals counted for 192 connections refused");
        for _ in 0..3 {
            info_call(server.url.clone()).await.expect("a caller on 127.0.0.1 is served beside them");
        }
        drop(held);
        server.shutdown().await.unwrap();
    });
}

#[test]
fn a_caller_is_served_while_600_silent_sockets_from_one_address_are_reopened_as_fast_as_they_close() {
    let bundle = Bundle::open(bundle_dir("digits")).unwrap();
    runtime().block_on(async {
        let (server, _) = serve(&bundle, Limits::default(), PeerLimits::default(), TrainingOptions::default()).await;
        let flood = Flood::start(server.url.trim_start_matches("http://").parse().unwrap(), "127.0.0.2".parse().unwrap(), 600);
        tokio::time::sleep(Duration::from_millis(300)).await;
        for call in 0..5 {
            let served = tokio::time::timeout(Duration::from_secs(10), info_call(server.url.clone())).await;
            served.unwrap_or_else(|_| panic!("call {call} hung")).unwrap_or_else(|e| panic!("call {call} refused: {e}"));
        }
        let opened = flood.stop().await;
        assert!(opened > 600, "the flood opened its sockets again as they closed: {opened} in all");
        server.shutdown().await.unwrap();
    });
}

#[test]
fn with_every_handshaking_place_taken_the_oldest_socket_gives_way_to_a_caller() {
    let bundle = Bundle::open(bundle_dir("digits")).unwrap();
    let peers = PeerLimits { max_handshaking_connections: 4, handshake_timeout: Duration::from_secs(30), ..PeerLimits::default() };
    runtime().block_on(async {
        let server = prepared(&bundle, Limits::default(), peers).await;
        let metrics = server.metrics();
        let server = LoopbackServer::serve(server).await.unwrap();
        let mut silent = silent_sockets(&server.url, "127.0.0.2", 4).await;
        info_call(server.url.clone()).await.expect("a caller gets the oldest silent socket's handshaking place");
        assert!(closed_within(&mut silent[0], Duration::from_secs(10)).await, "the oldest silent socket is kept");
        for socket in &mut silent[1..] {
            assert!(!closed_within(socket, Duration::from_millis(300)).await, "a newer silent socket is closed");
        }
        assert_eq!(metric(&metrics, "cleave_handshakes_given_way_total", &[]), 1.0);
        server.shutdown().await.unwrap();
    });
}

#[test]
fn an_infer_stream_ends_once_no_request_is_in_progress_for_the_idle_stream_timeout() {
    let bundle = Bundle::open(bundle_dir("resnet18")).unwrap();
    let input = resnet_input(&bundle);
    let peers = PeerLimits { idle_stream_timeout: Duration::from_millis(150), ..PeerLimits::default() };
    runtime().block_on(async {
        let (server, _) = serve(&bundle, Limits::default(), peers, TrainingOptions::default()).await;
        // A stream that sends nothing ends, cleanly, after the timeout (the guard turns a
        // stream kept for ever into a failure).
        let mut silent = open_stream(&server.url, &bundle).await;
        let end = tokio::time::timeout(Duration::from_secs(10), silent.results.next()).await.expect("a stream that does nothing ends");
        assert!(end.is_none(), "it ends cleanly: {end:?}");
        // Requests in progress keep a stream, however long they take: four at batch 32, and
        // one more sent once they are answered.
        let mut busy = open_stream(&server.url, &bundle).await;
        for id in 0..4 {
            busy.send(id, &input, 1, 1).await;
        }
        for id in 0..4 {
            assert_eq!(busy.answer().await, (id, None));
        }
        busy.send(4, &input, 1, 1).await;
        assert_eq!(busy.answer().await, (4, None), "a request sent after the others' answers is read and answered");
        let end = tokio::time::timeout(Duration::from_secs(10), busy.results.next()).await.expect("then the stream ends");
        assert!(end.is_none(), "{end:?}");
        server.shutdown().await.unwrap();
    });
}

#[test]
fn shutdown_closes_every_connection_within_the_drain_timeout_whatever_peers_do() {
    // A stream stalled mid-request and a health watch keep their connections open; the drain
    // answers the stalled request UNAVAILABLE, says NOT_SERVING, and closes everything after
    // `drain_timeout`.
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::{health_check_response::ServingStatus, HealthCheckRequest};
    let bundle = Bundle::open(bundle_dir("resnet18")).unwrap();
    let input = resnet_input(&bundle);
    let peers = PeerLimits { drain_timeout: Duration::from_secs(1), ..PeerLimits::default() };
    runtime().block_on(async {
        let server = prepared(&bundle, Limits::default(), peers).await;
        let (budget, metrics) = (server.memory_budget(), server.metrics());
        let server = LoopbackServer::serve(server).await.unwrap();
        let mut health = HealthClient::new(tonic::transport::Channel::from_shared(server.url.clone()).unwrap().connect().await.unwrap());
        let mut watch = health.watch(HealthCheckRequest { service: String::new() }).await.unwrap().into_inner();
        assert_eq!(watch.next().await.unwrap().unwrap().status(), ServingStatus::Serving);
        let mut stalled = open_stream(&server.url, &bundle).await;
        stalled.send(7, &input, 2, 1).await;
        // Its first frame read by the stream (not just its bytes counted as they came in):
        // the request is in progress when the drain starts.
        let received = || metric(&metrics, "cleave_received_bytes_total", &[("model", bundle.id())]) > 0.0;
        assert!(eventually(Duration::from_secs(20), received).await, "the first frame was read");
        let stopping = tokio::spawn(server.shutdown());
        assert_eq!(watch.next().await.unwrap().unwrap().status(), ServingStatus::NotServing);
        let (id, error) = stalled.answer().await;
        let (code, message) = error.expect("given up");
        assert_eq!((id, code), (7, tonic::Code::Unavailable), "{message}");
        assert!(message.contains("resend it"), "{message}");
        // The guard only turns a hang into a failure: the drain itself is 1 s.
        tokio::time::timeout(Duration::from_secs(30), stopping).await.expect("the server stops within its drain timeout").unwrap().unwrap();
        assert_eq!(budget.held_bytes(), 0);
    });
}

#[test]
fn profiles_run_one_at_a_time_let_inference_by_and_stop_when_their_caller_goes() {
    let bundle = Bundle::open(bundle_dir("resnet18")).unwrap();
    let input = resnet_input(&bundle);
    runtime().block_on(async {
        let (server, _) = serve(&bundle, Limits::default(), PeerLimits::default(), TrainingOptions::default()).await;
        let mut client = SplitInferenceClient::connect(server.url.clone()).await.unwrap();
        // A long profile: 50 passes at batch 64 (retried if a probe below holds the worker).
        let long = {
            let mut client = client.clone();
            tokio::spawn(async move {
                loop {
                    match client.profile(pb::ProfileRequest { batch_size: 64, repeats: 50 }).await {
                        Err(status) if status.code() == tonic::Code::ResourceExhausted => tokio::time::sleep(Duration::from_millis(5)).await,
                        done => return done,
                    }
                }
            })
        };
        // A second is refused while it runs (the guard turns a hang into a failure).
        let busy = tokio::time::timeout(Duration::from_secs(60), async {
            loop {
                match client.profile(pb::ProfileRequest { batch_size: 1, repeats: 1 }).await {
                    Err(status) => break status,
                    Ok(_) => tokio::time::sleep(Duration::from_millis(20)).await,
                }
            }
        })
        .await
        .expect("the long profile starts");
        assert_eq!(busy.code(), tonic::Code::ResourceExhausted, "{busy}");
        assert!(busy.message().contains("one at a time"), "{busy}");
        // Inference is answered between the profile's stages, long before it ends.
        let mut s = open_stream(&server.url, &bundle).await;
        s.send(0, &input, 1, 1).await;
        assert_eq!(s.answer().await, (0, None));
        assert!(!long.is_finished(), "the request was answered while the profile ran");
        // Its caller goes: the profile stops, and the next one runs.
        long.abort();
        let quick = tokio::time::timeout(Duration::from_secs(60), async {
            loop {
                match client.profile(pb::ProfileRequest { batch_size: 1, repeats: 1 }).await {
                    Ok(reply) => break reply.into_inner(),
                    Err(status) if status.code() == tonic::Code::ResourceExhausted => tokio::time::sleep(Duration::from_millis(20)).await,
                    Err(status) => panic!("{status}"),
                }
            }
        })
        .await
        .expect("a cancelled profile stops");
        assert_eq!(quick.stage_ms.len(), bundle.stage_count());
        server.shutdown().await.unwrap();
    });
}

type TrainStream = (mpsc::Sender<TrainFrame>, tonic::Streaming<pb::TrainReply>);

async fn open_session(url: &str, bundle: &Bundle) -> (TrainStream, pb::TrainReply) {
    open_session_from("127.0.0.1", url, bundle).await
}

/// [`open_session`] from the address `source`.
async fn open_session_from(source: &str, url: &str, bundle: &Bundle) -> (TrainStream, pb::TrainReply) {
    let endpoint = tonic::transport::Endpoint::from_shared(url.to_string()).unwrap().local_address(Some(source.parse().unwrap()));
    let mut client = SplitInferenceClient::new(endpoint.connect().await.unwrap());
    let open = pb::OpenSession {
        start: 7,
        end: 12,
        optimizer: Some(pb::Optimizer { kind: "sgd".into(), lr: 0.1, ..Default::default() }),
        loss: "cross-entropy".into(),
        seed: 1,
        resume: String::new(),
        ..Default::default()
    };
    let (tx, rx) = mpsc::channel(4);
    tx.send(TrainFrame { kind: Some(train_frame::Kind::Open(open)) }).await.unwrap();
    let mut request = tonic::Request::new(ReceiverStream::new(rx));
    request.metadata_mut().insert(cleave_common::protocol::BUNDLE_ID_METADATA, bundle.id().parse().unwrap());
    let mut replies = client.train(request).await.unwrap().into_inner();
    let first = replies.next().await.unwrap().unwrap();
    ((tx, replies), first)
}

#[test]
fn an_idle_training_session_is_closed_and_sessions_are_capped() {
    let bundle = Bundle::open(bundle_dir("digits")).unwrap();
    let options = TrainingOptions {
        concurrent_sessions: true,
        max_sessions: 3,
        max_sessions_per_peer: 2,
        session_idle_timeout: Duration::from_secs(1),
        ..TrainingOptions::default()
    };
    runtime().block_on(async {
        let (server, _) = serve(&bundle, Limits::default(), PeerLimits::default(), options).await;
        let (mut a, opened) = open_session(&server.url, &bundle).await;
        assert!(opened.opened.is_some(), "{opened:?}");
        let (_b, opened) = open_session(&server.url, &bundle).await;
        assert!(opened.opened.is_some(), "{opened:?}");
        // A third from the same address is past its share; one from elsewhere takes the last place.
        let (_, refused) = open_session(&server.url, &bundle).await;
        let e = refused.error.expect("refused");
        assert_eq!(tonic::Code::from(e.code), tonic::Code::ResourceExhausted, "{}", e.message);
        assert!(e.message.contains("(127.0.0.1)") && e.message.contains("`training.max_sessions_per_peer`"), "{}", e.message);
        let (_elsewhere, opened) = open_session_from("127.0.0.2", &server.url, &bundle).await;
        assert!(opened.opened.is_some(), "{opened:?}");
        // A fourth is refused while three are open.
        let (_, refused) = open_session_from("127.0.0.3", &server.url, &bundle).await;
        let e = refused.error.expect("refused");
        assert_eq!(tonic::Code::from(e.code), tonic::Code::ResourceExhausted, "{}", e.message);
        assert!(e.message.contains("`training.max_sessions`"), "{}", e.message);
        // The host of `a` vanishes (sends nothing): the server closes its session...
        let closed = a.1.next().await.unwrap().unwrap().error.expect("closed by the server");
        assert!(closed.message.contains("`training.session_idle_timeout`"), "{}", closed.message);
        assert!(a.1.next().await.is_none(), "its stream ends");
        // ... and its place is free.
        let (_c, opened) = tokio::time::timeout(Duration::from_secs(30), async {
            loop {
                let (c, opened) = open_session(&server.url, &bundle).await;
                if opened.opened.is_some() {
                    break (c, opened);
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await
        .expect("a place frees up");
        assert!(opened.opened.is_some());
        server.shutdown().await.unwrap();
    });
}

#[test]
fn a_training_stream_s_read_buffer_is_held_in_the_budget_while_it_lives() {
    // tonic keeps a stream's read buffer as large as its largest message: a Train stream's is
    // counted in the memory budget as an Infer stream's is, and given back when it ends.
    let bundle = Bundle::open(bundle_dir("digits")).unwrap();
    runtime().block_on(async {
        let (server, budget) = serve(&bundle, Limits::default(), PeerLimits::default(), TrainingOptions::default()).await;
        let ((tx, mut replies), opened) = open_session(&server.url, &bundle).await;
        assert!(opened.opened.is_some(), "{opened:?}");
        let held_open = budget.held_bytes();
        // A checkpoint call with a 1 MiB name: refused, but its message grew the read buffer.
        let name = "x".repeat(1 << 20);
        let save = TrainFrame { kind: Some(train_frame::Kind::Save(pb::SaveCheckpoint { request_id: 1, name })) };
        let grown = read_buffer_bytes(&save);
        tx.send(save).await.unwrap();
        let refused = replies.next().await.unwrap().unwrap();
        assert_eq!(refused.request_id, 1);
        assert!(refused.error.is_some(), "{refused:?}");
        held_until("the stream's read buffer", || budget.held_bytes() >= grown).await;
        assert_eq!(budget.held_bytes(), held_open.max(grown), "the read buffer's share, grown to its largest message");
        drop((tx, replies));
        held_until("the ended stream giving its read buffer back", || budget.held_bytes() == 0).await;
        server.shutdown().await.unwrap();
    });
}

/// A gRPC message as it goes on the wire: its 5-byte prefix, then the message.
fn grpc_message(message: &impl prost::Message) -> Bytes {
    let encoded = message.encode_to_vec();
    let mut framed = vec![0u8];
    framed.extend_from_slice(&(encoded.len() as u32).to_be_bytes());
    framed.extend_from_slice(&encoded);
    Bytes::from(framed)
}

/// A raw HTTP/2 connection whose receive window is 0: it reads nothing the server sends.
async fn never_reading(addr: &str) -> h2::client::SendRequest<Bytes> {
    never_reading_from("127.0.0.1", addr).await
}

/// [`never_reading`] from the address `source`.
async fn never_reading_from(source: &str, addr: &str) -> h2::client::SendRequest<Bytes> {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind(format!("{source}:0").parse().unwrap()).unwrap();
    let tcp = socket.connect(addr.parse().unwrap()).await.unwrap();
    let (h2, connection) = h2::client::Builder::new().initial_window_size(0).handshake::<_, Bytes>(tcp).await.unwrap();
    tokio::spawn(connection);
    h2
}

/// Calls `method` with `body` (whole) on `h2`; the response's headers (its body is never read).
async fn call_raw(
    h2: h2::client::SendRequest<Bytes>,
    addr: &str,
    method: &str,
    bundle: &Bundle,
    body: Bytes,
    end: bool,
) -> http::Response<h2::RecvStream> {
    let request = http::Request::post(format!("http://{addr}/cleave.v1.SplitInference/{method}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .header(cleave_common::protocol::BUNDLE_ID_METADATA, bundle.id())
        .body(())
        .unwrap();
    let mut h2 = h2.ready().await.unwrap();
    let (response, mut send) = h2.send_request(request, false).unwrap();
    send.send_data(body, end).unwrap();
    std::mem::forget(send); // An Infer stream stays open.
    response.await.unwrap()
}

async fn prepared(bundle: &Bundle, limits: Limits, peers: PeerLimits) -> PreparedServer {
    let dir = bundle.dir().to_path_buf();
    tokio::task::spawn_blocking(move || {
        PreparedServer::prepare(&dir, DeviceSpec::Cpu, limits, Default::default()).unwrap().with_peer_limits(peers).unwrap()
    })
    .await
    .unwrap()
}

#[test]
fn echo_replies_nobody_reads_hold_the_one_memory_budget_until_the_answer_timeout_closes_their_connection() {
    // A raw HTTP/2 peer with a zero receive window asks for Echo replies and never reads
    // them: they hold the server's memory budget (one for every connection), so a third is
    // refused on any connection, until `answer_timeout` closes the peer's connection.
    let bundle = Bundle::open(bundle_dir("digits")).unwrap();
    let limits = Limits { max_payload_bytes: 4 << 20, ..Limits::default() };
    let reply_bytes = limits.max_message_bytes - 4096;
    let peers = PeerLimits {
        memory_budget_bytes: 2 * reply_bytes + (1 << 20),
        budget_wait: Duration::from_millis(200),
        answer_timeout: Duration::from_secs(2),
        ..PeerLimits::default()
    };
    runtime().block_on(async {
        let server = prepared(&bundle, limits, peers).await;
        let (budget, metrics) = (server.memory_budget(), server.metrics());
        let server = LoopbackServer::serve(server).await.unwrap();
        let addr = server.url.trim_start_matches("http://").to_string();
        let ask = grpc_message(&pb::EchoRequest { payload: Bytes::new(), reply_bytes });
        let h2 = never_reading(&addr).await;
        let mut unread = Vec::new();
        for _ in 0..2 {
            let response = call_raw(h2.clone(), &addr, "Echo", &bundle, ask.clone(), true).await;
            assert_eq!(response.headers().get("grpc-status"), None, "a reply that fits is sent");
            unread.push(response);
        }
        assert!(budget.held_bytes() >= 2 * reply_bytes, "unsent replies hold the budget: {}", budget.held_bytes());
        // Another connection is refused too: the bound is the server's, not a connection's.
        let mut client = SplitInferenceClient::connect(server.url.clone()).await.unwrap().max_decoding_message_size(16 << 20);
        let refused = client.echo(pb::EchoRequest { payload: Bytes::new(), reply_bytes }).await.unwrap_err();
        assert_eq!(refused.code(), tonic::Code::ResourceExhausted, "{refused:?}");
        assert!(refused.message().contains("limits.memory_budget_bytes"), "{}", refused.message());
        // The peer takes nothing for `answer_timeout`: its connection is closed, everything freed.
        let freed = eventually(Duration::from_secs(10), || budget.held_bytes() == 0).await;
        assert!(freed, "still held after the answer timeout: {}", budget.held_bytes());
        assert_eq!(metric(&metrics, "cleave_answer_timeouts_total", &[]), 1.0);
        let back = client.echo(pb::EchoRequest { payload: Bytes::new(), reply_bytes }).await.unwrap().into_inner();
        assert_eq!(back.payload.len() as u64, reply_bytes);
        assert_eq!(budget.held_bytes(), 0, "a reply written gives its bytes back");
        drop(unread);
        server.shutdown().await.unwrap();
    });
}

/// Echo replies of `reply_bytes` asked for by a peer at `source` that never reads them, until
/// one is refused: how many were sent, and the refusal's `grpc-message`.
async fn unread_echoes_from(source: &str, addr: &str, bundle: &Bundle, reply_bytes: u64) -> (Vec<http::Response<h2::RecvStream>>, String) {
    let h2 = never_reading_from(source, addr).await;
    let ask = grpc_message(&pb::EchoRequest { payload: Bytes::new(), reply_bytes });
    let mut unread = Vec::new();
    for _ in 0..31 {
        let response = call_raw(h2.clone(), addr, "Echo", bundle, ask.clone(), true).await;
        if let Some(status) = response.headers().get("grpc-status") {
            assert_eq!(status, "8", "RESOURCE_EXHAUSTED");
            let message = response.headers().get("grpc-message").map(|m| m.to_str().unwrap().to_string()).unwrap_or_default();
            return (unread, message);
        }
        unread.push(response);
    }
    panic!("31 replies of {reply_bytes} bytes held for a peer that reads none");
}

#[test]
fn slow_readers_and_stalled_requests_of_other_peers_hold_only_their_shares_and_a_caller_is_served() {
    // Two peers spend the memory budget: 127.0.0.2 asks for Echo replies and never reads
    // them, 127.0.0.3 opens streams that each send half a request and stall (their read
    // buffers and reservations held). Each holds only its share (`memory_budget_bytes_per_peer`),
    // so a host on 127.0.0.1 has every request answered. With a share as large as the
    // budget, the slow reader alone takes all of it and the host is refused.
    let bundle = Bundle::open(bundle_dir("resnet18")).unwrap();
    let input = resnet_input(&bundle);
    let raw = (input.tensor_bytes() as u64).div_ceil(1024) * 1024;
    let limits = Limits { max_payload_bytes: raw, ..Limits::default() };
    let reply_bytes = 1 << 20;
    let share = 8 << 20;
    let peers = PeerLimits {
        memory_budget_bytes: 3 * share,
        memory_budget_bytes_per_peer: share,
        budget_wait: Duration::from_millis(300),
        ..PeerLimits::default()
    };
    runtime().block_on(async {
        let (server, budget) = serve(&bundle, limits, peers, TrainingOptions::default()).await;
        let addr = server.url.trim_start_matches("http://").to_string();
        let (unread, refusal) = unread_echoes_from("127.0.0.2", &addr, &bundle, reply_bytes).await;
        assert_eq!(unread.len() as u64, share / reply_bytes, "its share of unread replies");
        assert!(refusal.contains("127.0.0.2") && refusal.contains("memory_budget_bytes_per_peer"), "{refusal}");
        let mut stalled = Vec::new();
        for id in 0..8 {
            let s = silent_stream_from("127.0.0.3", &server.url, &bundle).await.unwrap();
            s.send(id, &input, 2, 1).await;
            stalled.push(s);
        }
        // The stalled requests past 127.0.0.3's share wait the budget's wait, then are refused.
        tokio::time::sleep(Duration::from_secs(1)).await;
        let held = budget.held_bytes();
        assert!(held > share + raw && held <= 2 * share, "{held} bytes held by two peers of {share}-byte shares");
        let mut caller = open_stream(&server.url, &bundle).await;
        for id in 1..=4 {
            caller.send(id, &input, 1, 1).await;
            assert_eq!(caller.answer().await, (id, None), "the caller's request {id} is answered");
        }
        let mut client = SplitInferenceClient::connect(server.url.clone()).await.unwrap();
        for _ in 0..3 {
            let echoed = client.echo(pb::EchoRequest { payload: Bytes::new(), reply_bytes }).await.expect("the caller's echo is answered");
            assert_eq!(echoed.into_inner().payload.len() as u64, reply_bytes);
        }
        drop((unread, stalled, caller));
        server.shutdown().await.unwrap();

        let one_share = PeerLimits { memory_budget_bytes_per_peer: 3 * share, ..peers };
        let (server, _) = serve(&bundle, limits, one_share, TrainingOptions::default()).await;
        let addr = server.url.trim_start_matches("http://").to_string();
        let (unread, _) = unread_echoes_from("127.0.0.2", &addr, &bundle, reply_bytes).await;
        assert_eq!(unread.len() as u64, 3 * share / reply_bytes, "the whole budget");
        let mut client = SplitInferenceClient::connect(server.url.clone()).await.unwrap();
        let refused = client.echo(pb::EchoRequest { payload: Bytes::new(), reply_bytes }).await.unwrap_err();
        assert!(refused.message().contains("`limits.memory_budget_bytes`"), "{}", refused.message());
        drop(unread);
        server.shutdown().await.unwrap();
    });
}

/// An HTTP/2 connection from `source` that reads what it is sent.
async fn h2_from(source: &str, addr: &str) -> h2::client::SendRequest<Bytes> {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind(format!("{source}:0").parse().unwrap()).unwrap();
    let tcp = socket.connect(addr.parse().unwrap()).await.unwrap();
    let (h2, connection) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(connection);
    h2
}

#[test]
fn a_message_begun_is_held_in_the_budget_from_its_prefix_and_given_up_after_the_request_timeout() {
    // A peer opens `Infer` calls that each declare a 4 MiB message and send a little of it
    // (tonic reserves the declared length and holds what comes). Each message is counted in
    // the peer's share from its prefix on: three fit, the next waits and its call fails; a
    // caller elsewhere is served; at `request_timeout` the messages are given up and every
    // byte comes back.
    let bundle = Bundle::open(bundle_dir("digits")).unwrap();
    let limits = Limits { max_payload_bytes: 4 << 20, ..Limits::default() };
    let declared: u32 = 4 << 20;
    let share = 16 << 20;
    let peers = PeerLimits {
        memory_budget_bytes: 3 * share,
        memory_budget_bytes_per_peer: share,
        budget_wait: Duration::from_millis(300),
        request_timeout: Duration::from_secs(3),
        ..PeerLimits::default()
    };
    runtime().block_on(async {
        let (server, budget) = serve(&bundle, limits, peers, TrainingOptions::default()).await;
        let addr = server.url.trim_start_matches("http://").to_string();
        let h2 = h2_from("127.0.0.2", &addr).await;
        let mut begun = Vec::new();
        // (The last a `Train` call, whose opening message is the one refused.)
        for method in ["Infer", "Infer", "Infer", "Infer", "Infer", "Train"] {
            let mut start = vec![0u8];
            start.extend_from_slice(&declared.to_be_bytes());
            start.extend(std::iter::repeat_n(1u8, 64 << 10));
            begun.push(call_raw(h2.clone(), &addr, method, &bundle, start.into(), false).await);
        }
        let message = u64::from(declared) + 5;
        let counted = eventually(Duration::from_secs(5), || budget.held_bytes() >= 3 * message).await;
        assert!(counted, "3 messages begun are held from their prefixes: {} bytes held", budget.held_bytes());
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(budget.held_bytes() <= share, "{} bytes held for one peer of a {share}-byte share", budget.held_bytes());
        // A caller on 127.0.0.1 is served beside them.
        let mut caller = open_stream(&server.url, &bundle).await;
        let input = cleave_common::value::synthetic_inputs(&bundle.manifest().inputs, bundle.sizes_at(2)).unwrap();
        caller.send(1, &input, 1, 1).await;
        assert_eq!(caller.answer().await, (1, None));
        drop(caller);
        // Past `request_timeout` the messages are given up: their calls end, their bytes come back.
        let freed = eventually(Duration::from_secs(10), || budget.held_bytes() == 0).await;
        assert!(freed, "still held after the request timeout: {}", budget.held_bytes());
        // Each call ends with why: no room in the peer's share, or its message given up.
        let mut ended = Vec::new();
        for response in begun {
            let mut body = response.into_body();
            let trailers = tokio::time::timeout(Duration::from_secs(5), async {
                while body.data().await.is_some() {}
                body.trailers().await.unwrap().unwrap()
            })
            .await
            .expect("the call ends");
            let field = |name: &str| trailers.get(name).map(|v| v.to_str().unwrap().to_string()).unwrap_or_default();
            ended.push((field("grpc-status"), field("grpc-message")));
        }
        ended.sort();
        let codes: Vec<&str> = ended.iter().map(|(code, _)| code.as_str()).collect();
        assert_eq!(codes, ["4", "4", "4", "8", "8", "8"], "{ended:?}");
        assert!(ended[0].1.contains("request_timeout") && ended[5].1.contains("memory_budget_bytes_per_peer"), "{ended:?}");
        server.shutdown().await.unwrap();
    });
}

#[test]
fn a_result_nobody_reads_holds_the_budget_as_its_request_did_until_the_answer_timeout() {
    // An Infer stream whose peer never reads: the result's bytes stay held in the budget
    // after the request is done (they used to be freed as soon as the result was framed),
    // and the connection is closed at `answer_timeout`, which frees them.
    let bundle = Bundle::open(bundle_dir("resnet18")).unwrap();
    let input = resnet_input(&bundle);
    let output_bytes = (bundle.cut(bundle.stage_count()).bytes_per_sample * 32) as u64;
    let peers = PeerLimits { answer_timeout: Duration::from_secs(2), ..PeerLimits::default() };
    runtime().block_on(async {
        let server = prepared(&bundle, Limits::default(), peers).await;
        let (budget, metrics) = (server.memory_budget(), server.metrics());
        let server = LoopbackServer::serve(server).await.unwrap();
        let addr = server.url.trim_start_matches("http://").to_string();
        let frames: Vec<Bytes> = request_frames(1, &input, 1).iter().map(grpc_message).collect();
        let response = call_raw(never_reading(&addr).await, &addr, "Infer", &bundle, frames.concat().into(), false).await;
        assert_eq!(response.headers().get("grpc-status"), None);
        // Answered (computed and framed), not taken: its answer's bytes stay held.
        let held =
            eventually(Duration::from_secs(20), || metric(&metrics, "cleave_requests_total", &[("model", bundle.id()), ("code", "Ok")]) == 1.0).await;
        assert!(held, "the request was answered");
        assert!(budget.held_bytes() >= output_bytes, "{} held for a {output_bytes}-byte answer", budget.held_bytes());
        let freed = eventually(Duration::from_secs(10), || budget.held_bytes() == 0).await;
        assert!(freed, "still held after the answer timeout: {}", budget.held_bytes());
        assert_eq!(metric(&metrics, "cleave_answer_timeouts_total", &[]), 1.0);
        drop(response);
        server.shutdown().await.unwrap();
    });
}

/// The metrics endpoint with `limits`, on a port of its own.
async fn metrics_endpoint(limits: cleave_server::metrics::EndpointLimits) -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(cleave_server::metrics::serve(listener, cleave_server::Metrics::new(vec![]), limits, std::future::pending()));
    addr
}

/// `GET path` on a fresh connection: the response's status line and body.
async fn http_get(addr: std::net::SocketAddr, path: &str) -> (String, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut socket = tokio::net::TcpStream::connect(addr).await.unwrap();
    socket.write_all(format!("GET {path} HTTP/1.1\r\nHost: cleave\r\n\r\n").as_bytes()).await.unwrap();
    let mut response = String::new();
    tokio::time::timeout(Duration::from_secs(10), socket.read_to_string(&mut response)).await.expect("answered and closed").unwrap();
    let (head, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
    (head.lines().next().unwrap_or("").to_string(), body.to_string())
}

#[test]
fn the_metrics_endpoint_caps_its_connections_and_closes_slow_ones() {
    use cleave_server::metrics::EndpointLimits;
    use tokio::io::AsyncWriteExt;
    runtime().block_on(async {
        // Past its connections: the next is closed at once, long before its timeout.
        let capped = metrics_endpoint(EndpointLimits { max_connections: 2, timeout: Duration::from_secs(60) }).await;
        let mut held = Vec::new();
        for _ in 0..2 {
            held.push(tokio::net::TcpStream::connect(capped).await.unwrap());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        let mut third = tokio::net::TcpStream::connect(capped).await.unwrap();
        assert!(closed_within(&mut third, Duration::from_secs(10)).await, "a third metrics connection past `metrics_max_connections: 2` is kept");
        drop(held);
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(http_get(capped, "/metrics").await.0, "HTTP/1.1 200 OK", "a scrape once the places are free");

        // A scraper that sends half a request and stalls (slowloris), or sends nothing, is
        // closed after the timeout; a scrape and a 404 meanwhile.
        let timed = metrics_endpoint(EndpointLimits { max_connections: 8, timeout: Duration::from_secs(1) }).await;
        let mut slow = tokio::net::TcpStream::connect(timed).await.unwrap();
        slow.write_all(b"GET /metrics HTTP/1.1\r\nHost: cl").await.unwrap();
        let mut silent = tokio::net::TcpStream::connect(timed).await.unwrap();
        let (status, body) = http_get(timed, "/metrics").await;
        assert_eq!(status, "HTTP/1.1 200 OK");
        assert!(body.contains("# TYPE cleave_training_sessions gauge") && body.trim_end().ends_with("# EOF"), "{body}");
        assert_eq!(http_get(timed, "/other").await.0, "HTTP/1.1 404 Not Found");
        assert!(closed_within(&mut slow, Duration::from_secs(10)).await, "a stalled request is kept past `metrics_timeout`");
        assert!(closed_within(&mut silent, Duration::from_secs(10)).await, "a silent connection is kept past `metrics_timeout`");
    });
}

/// A metric's value in a scrape of `metrics` (0 when it has no sample yet).
fn metric(metrics: &cleave_server::Metrics, name: &str, labels: &[(&str, &str)]) -> f64 {
    metric_sample(&parse_metrics(&metrics.render()), name, labels)
}

/// Polls `done` every 20 ms for at most `within`.
async fn eventually(within: Duration, mut done: impl FnMut() -> bool) -> bool {
    let deadline = std::time::Instant::now() + within;
    while std::time::Instant::now() < deadline {
        if done() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    done()
}

#[test]
fn requests_of_a_stream_reset_by_its_peer_are_dropped_not_computed() {
    let bundle = Bundle::open(bundle_dir("resnet18")).unwrap();
    let input = resnet_input(&bundle);
    runtime().block_on(async {
        let dir = bundle.dir().to_path_buf();
        let prepared =
            tokio::task::spawn_blocking(move || PreparedServer::prepare(&dir, DeviceSpec::Cpu, Limits::default(), Default::default()).unwrap())
                .await
                .unwrap();
        let metrics = prepared.metrics();
        let server = LoopbackServer::serve(prepared).await.unwrap();
        let model = bundle.id().to_string();
        let started = || metric(&metrics, "cleave_batch_samples_count", &[("model", &model)]);
        let queued = || metric(&metrics, "cleave_queue_depth", &[("model", &model)]);
        let dropped = || metric(&metrics, "cleave_abandoned_requests_total", &[("model", &model), ("at", "queued")]);
        // 20 requests at batch 32, one device running them one at a time: all received and
        // waiting (or running) before the peer resets the stream.
        let stream = open_stream(&server.url, &bundle).await;
        for id in 1..=20 {
            stream.send(id, &input, 1, 1).await;
        }
        assert!(eventually(Duration::from_secs(30), || started() + queued() == 20.0).await, "the 20 requests are queued");
        drop(stream);
        // Every request either started before the reset came through or is dropped unstarted.
        assert!(eventually(Duration::from_secs(60), || started() + dropped() == 20.0).await, "started {} dropped {}", started(), dropped());
        let computed = started();
        println!("of 20 requests of a reset stream: {computed} started, {} dropped unstarted", dropped());
        assert!(computed <= 3.0, "{computed} of 20 requests of a reset stream were computed");
        assert_eq!(queued(), 0.0);
        server.shutdown().await.unwrap();
    });
}

#[test]
fn a_training_call_whose_stream_is_reset_while_it_waits_for_its_device_is_never_run() {
    use cleave_server::{ModelConfig, SchedulerConfig};
    let resnet = Bundle::open(bundle_dir("resnet18")).unwrap();
    let digits = Bundle::open(bundle_dir("digits")).unwrap();
    runtime().block_on(async {
        // Both models on the CPU: one scheduler, where a training turn waits for a profile's end.
        let models = vec![ModelConfig::new(resnet.dir(), DeviceSpec::Cpu), ModelConfig::new(digits.dir(), DeviceSpec::Cpu)];
        let prepared = tokio::task::spawn_blocking(move || {
            PreparedServer::prepare_models(&models, SchedulerConfig::default(), Limits::default(), Default::default()).unwrap()
        })
        .await
        .unwrap();
        let metrics = prepared.metrics();
        let server = LoopbackServer::serve(prepared).await.unwrap();
        let (session, opened) = open_session(&server.url, &digits).await;
        assert!(opened.opened.is_some(), "{opened:?}");

        // resnet18's long profile holds the device; a second profile refused shows it runs.
        let client = SplitInferenceClient::connect(server.url.clone()).await.unwrap();
        let profile = |batch_size: u32, repeats: u32| {
            let mut client = client.clone();
            let mut request = tonic::Request::new(pb::ProfileRequest { batch_size, repeats });
            request.metadata_mut().insert(cleave_common::protocol::BUNDLE_ID_METADATA, resnet.id().parse().unwrap());
            async move { client.profile(request).await }
        };
        let mut long = tokio::spawn(profile(32, 50));
        let running = tokio::time::timeout(Duration::from_secs(60), async {
            while profile(1, 1).await.is_ok() {
                if long.is_finished() {
                    // Refused: it came while a short one held the server's one profile.
                    long = tokio::spawn(profile(32, 50));
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        });
        running.await.expect("the long profile starts");

        // A training step waits for its turn; its stream is reset meanwhile.
        let step = Boundary {
            values: vec![
                ("features_6".into(), cleave_common::Value::Tensor(tch::Tensor::ones([2, 32, 4, 4], (tch::Kind::Float, tch::Device::Cpu)))),
                (cleave_common::training::TARGETS_VALUE.into(), cleave_common::Value::Tensor(tch::Tensor::from_slice(&[3i64, 4]))),
            ],
        };
        let meta = PayloadMeta { request_id: 1, split: 7, direction: Direction::Request };
        let encoded = PayloadSender::plain().encode(meta, &Codec::RAW, &step).unwrap();
        let frame = pb::TrainPayloadFrame {
            request_id: 1,
            phase: pb::Phase::Forward as i32,
            header: encoded.envelope,
            data: encoded.data.to_vec().into(),
            last: true,
            ..Default::default()
        };
        session.0.send(TrainFrame { kind: Some(train_frame::Kind::Payload(frame)) }).await.unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await;
        drop(session);

        // When the device is free the call is dropped, not run.
        let model = digits.id().to_string();
        let dropped = || metric(&metrics, "cleave_abandoned_requests_total", &[("model", &model), ("at", "queued")]);
        assert!(eventually(Duration::from_secs(120), || dropped() == 1.0).await, "the reset stream's training call is dropped");
        let profiled = long.await.unwrap().expect("the profile ran to its end");
        assert_eq!(profiled.into_inner().stage_ms.len(), resnet.stage_count());
        server.shutdown().await.unwrap();
    });
}
