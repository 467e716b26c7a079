//! `grpc-floor`: what one request costs through tonic with no cleave code on it, the floor
//! under `split-overhead`'s network column between `bench/loopback-floor` (plain TCP) and
//! the protocol.
//!
//! Two processes on two cores, as `split-overhead` puts the edge and the server: this one
//! (the client) and a child serving `SplitInference::Infer` with an echo, on the server's
//! HTTP/2 settings (its default `limits`). The client opens one `Infer` stream with the
//! host's HTTP/2 settings and, for each size, idles 5 ms (as the server idles while the edge
//! runs its prefix), sends one request in frames of at most 16 KiB and waits for its answer.
//! The echo lands each request's bytes in one buffer (as the server lands a request in its
//! tensor) and answers with 4000 bytes (a classifier's logits).
//!
//!     grpc-floor [--sizes 2355,37632,75264,100352] [--cores 0,1] [--repeats 200] [--via-thread]
//!                [--compute-us 800]
//!
//! `--via-thread` answers from a thread of the server's own, as its compute worker does: the
//! cost of that hop and the one back. `--compute-us N` (implies `--via-thread`) keeps that
//! thread busy N µs before it answers, as a suffix would, while the client's core idles as
//! the edge's does: what the platform's wake-ups add once each side has been idle a while.
//!
//! Prints one line per size: `grpc floor: N bytes p50 X ms (p10 A, p90 B)`, times less the
//! compute.
//!
//! `split-overhead` starts the echo alone (`grpc-floor --serve-config FILE`: a `server` config
//! on a loopback address, whose HTTP/2 settings, TLS and message limit it serves with, with
//! the server's allocator settings) for the tonic floor beside each of its rows; each
//! request's first frame says how many bytes follow, how long to compute and how many bytes
//! to answer ([`support::EchoAsk`]): a request within the config's `max_payload_bytes`, an
//! answer within one message under its `max_message_bytes` (the echo answers in one frame),
//! and a minute.

#[allow(dead_code)] // the echo's ask, its frames, waiting for it and its guard are what this program uses
mod support;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Parser;
use cleave_common::config::pin_thread;
use cleave_common::pb::split_inference_client::SplitInferenceClient;
use cleave_common::pb::split_inference_server::{SplitInference, SplitInferenceServer};
use cleave_common::pb::{
    EchoReply, EchoRequest, InferFrame, InfoReply, InfoRequest, ProfileReply, ProfileRequest, ResultFrame, TrainFrame, TrainReply,
};
use cleave_common::security::TlsIdentity;
use cleave_server::{PeerLimits, ServerConfig};
use support::EchoAsk;
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status, Streaming};

#[derive(Parser)]
#[command(about = "One request's cost through tonic with no cleave code on it")]
struct Args {
    /// Request sizes in bytes.
    #[arg(long, value_delimiter = ',', default_values_t = [2355usize, 37632, 75264, 100352])]
    sizes: Vec<usize>,
    /// The client's core, then the server's.
    #[arg(long, value_delimiter = ',', default_values_t = [0usize, 1])]
    cores: Vec<usize>,
    /// Requests per size (after 20 not timed).
    #[arg(long, default_value_t = 200)]
    repeats: usize,
    /// Serve on this port (the child process).
    #[arg(long, hide = true)]
    serve: Option<u16>,
    /// Serve the echo alone as this `server` config says (its loopback `listen`, HTTP/2 and
    /// message limits, and `tls`), on the cores this process was started on.
    #[arg(long)]
    serve_config: Option<PathBuf>,
    /// The echo answers from a thread of its own, as the server's compute worker does.
    #[arg(long)]
    via_thread: bool,
    /// The echo's thread computes this long (a busy loop) before it answers; implies `--via-thread`.
    #[arg(long, default_value_t = 0)]
    compute_us: u64,
}

/// Frames of a request.
const FRAME_BYTES: usize = 16 << 10;
/// What the echo answers: about a classifier's logits.
const ANSWER_BYTES: u64 = 4000;
/// How long each side idles between requests.
const IDLE: Duration = Duration::from_millis(5);
/// The largest message, request and answer the standalone echo takes or makes.
const STANDALONE_MAX_BYTES: u64 = 64 << 20;
/// The longest an echo computes for one request.
const MAX_COMPUTE: Duration = Duration::from_secs(60);

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let [client_core, server_core] = args.cores[..] else { bail!("--cores takes two cores") };
    let compute = Duration::from_micros(args.compute_us);
    let via_thread = args.via_thread || !compute.is_zero();
    if let Some(path) = &args.serve_config {
        // As the server starts (its `main`): the same allocator, so that landing a request
        // costs what it costs there.
        if let Some(e) = cleave_server::allocator::set_up() {
            eprintln!("grpc-floor: could not start again with glibc's thread cache off, running with it: {e}");
        }
        let config = ServerConfig::load(path)?;
        anyhow::ensure!(config.listen.ip().is_loopback(), "the echo serves a loopback address only, not {}", config.listen);
        let echo = Echo::new(true, config.limits.max_message_bytes, config.limits.max_payload_bytes);
        return tokio::runtime::Runtime::new()?.block_on(serve(config.listen, &config.peers, config.security.tls.as_ref(), echo));
    }
    match args.serve {
        Some(port) => {
            pin_thread(0, &[server_core])?;
            let addr = SocketAddr::from(([127, 0, 0, 1], port));
            tokio::runtime::Runtime::new()?.block_on(serve(
                addr,
                &PeerLimits::default(),
                None,
                Echo::new(via_thread, STANDALONE_MAX_BYTES, STANDALONE_MAX_BYTES),
            ))
        }
        None => {
            let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
            let echo = std::process::Command::new(std::env::current_exe()?)
                .args(["--serve", &port.to_string(), "--cores", &format!("{client_core},{server_core}")])
                .args(via_thread.then_some("--via-thread"))
                .spawn()?;
            let mut echo = support::Children(vec![echo]);
            pin_thread(0, &[client_core])?;
            tokio::runtime::Runtime::new()?.block_on(measure(port, &mut echo.0[0], &args.sizes, args.repeats, compute))
        }
    }
}

async fn measure(port: u16, echo: &mut std::process::Child, sizes: &[usize], repeats: usize, compute: Duration) -> anyhow::Result<()> {
    let endpoint = cleave_client::endpoint(&format!("http://127.0.0.1:{port}"), &cleave_client::Link::default())?;
    let channel = support::when_up("the echo", echo, || endpoint.connect()).await?;
    let mut client = SplitInferenceClient::new(channel).max_decoding_message_size(STANDALONE_MAX_BYTES as usize);
    let (frames, outbound) = tokio::sync::mpsc::channel::<InferFrame>(64);
    let mut answers = client.infer(ReceiverStream::new(outbound)).await?.into_inner();
    let mut id = 0u64;
    for &size in sizes {
        let mut times = Vec::with_capacity(repeats);
        let ask = EchoAsk { request_bytes: size as u64, compute, answer_bytes: ANSWER_BYTES };
        let data = bytes::Bytes::from(vec![7u8; size]);
        for i in 0..repeats + 20 {
            tokio::time::sleep(IDLE).await;
            id += 1;
            // Framed before the clock starts, as `split-overhead`'s floor is: what is timed is
            // the exchange.
            let request = support::echo_frames(id, &ask, &data, FRAME_BYTES);
            let t = Instant::now();
            for frame in request {
                frames.send(frame).await.context("the stream closed")?;
            }
            let answer = answers.message().await?.context("the server hung up")?;
            if answer.request_id != id {
                bail!("answer {} for request {id}", answer.request_id);
            }
            if i >= 20 {
                times.push(t.elapsed().saturating_sub(compute).as_secs_f64() * 1e3);
            }
        }
        let at = |p: f64| cleave_common::stats::percentile(&times, p);
        println!("grpc floor: {size} bytes p50 {:.3} ms (p10 {:.3}, p90 {:.3})", at(0.5)?, at(0.1)?, at(0.9)?);
    }
    Ok(())
}

/// Serves the echo on `addr` with the server's HTTP/2 settings for `peers` and `tls`.
async fn serve(addr: SocketAddr, peers: &PeerLimits, tls: Option<&TlsIdentity>, echo: Echo) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let incoming = TcpListenerStream::new(listener).map(|s| {
        s.and_then(|s| {
            s.set_nodelay(true)?;
            Ok(s)
        })
    });
    let max_message = echo.max_message_bytes as usize;
    cleave_server::http2_server(peers, tls)?
        .add_service(SplitInferenceServer::new(echo).max_decoding_message_size(max_message).max_encoding_message_size(max_message))
        .serve_with_incoming(incoming)
        .await?;
    Ok(())
}

/// A request whose bytes are in, and where its answer goes.
struct Job {
    id: u64,
    ask: EchoAsk,
    landed: Vec<u8>,
    reply: tokio::sync::oneshot::Sender<ResultFrame>,
}

/// Answers each request once its last frame is in: on the stream's task, or with `worker`
/// from a thread of its own (one hop there and one back, as the server's compute worker).
struct Echo {
    worker: Option<std::sync::mpsc::Sender<Job>>,
    /// The largest gRPC message it takes or makes.
    max_message_bytes: u64,
    /// The largest request, in one or more messages.
    max_payload_bytes: u64,
    /// The largest answer: one frame's data under the message limit (and the payload limit).
    max_answer_bytes: u64,
}

impl Echo {
    fn new(via_thread: bool, max_message_bytes: u64, max_payload_bytes: u64) -> Self {
        let max_answer_bytes = max_payload_bytes.min(cleave_common::wire::chunk_bytes_for(max_message_bytes) as u64);
        Self { worker: via_thread.then(spawn_worker), max_message_bytes, max_payload_bytes, max_answer_bytes }
    }
}

/// The worker: computes (a busy loop) as long as each job asks, then answers it.
fn spawn_worker() -> std::sync::mpsc::Sender<Job> {
    let (jobs, rx) = std::sync::mpsc::channel::<Job>();
    std::thread::spawn(move || {
        while let Ok(job) = rx.recv() {
            let started = Instant::now();
            while started.elapsed() < job.ask.compute {
                std::hint::spin_loop();
            }
            drop(job.landed);
            let _ = job.reply.send(answer(job.id, &job.ask));
        }
    });
    jobs
}

fn answer(request_id: u64, ask: &EchoAsk) -> ResultFrame {
    ResultFrame { request_id, data: vec![1u8; ask.answer_bytes as usize].into(), last: true, ..Default::default() }
}

/// A request being landed: its ask and the bytes so far.
struct Landing {
    id: u64,
    ask: EchoAsk,
    landed: Vec<u8>,
}

impl Landing {
    /// Lands `frame` (a new request's first frame opens one; its ask within `max_bytes`, its
    /// answer within `max_answer_bytes`, and [`MAX_COMPUTE`]); the request once its last frame
    /// is in, with every byte its ask said.
    fn land(current: &mut Option<Landing>, frame: InferFrame, max_bytes: u64, max_answer_bytes: u64) -> Result<Option<Landing>, Status> {
        let refuse = |why: String| Err(Status::invalid_argument(why));
        match current {
            Some(landing) if landing.id != frame.request_id => {
                return refuse(format!("request {} began before request {} ended", frame.request_id, landing.id));
            }
            Some(_) => {}
            None => {
                let Some(ask) = EchoAsk::read(&frame.header) else { return refuse("a request's first frame carries the echo's 24-byte ask".into()) };
                if ask.request_bytes.max(ask.answer_bytes) > max_bytes || ask.compute > MAX_COMPUTE {
                    return refuse(format!("{ask:?} is over the echo's {max_bytes} bytes or {MAX_COMPUTE:?}"));
                }
                if ask.answer_bytes > max_answer_bytes {
                    return refuse(format!("{ask:?} is over the echo's {max_answer_bytes} answer bytes, one message"));
                }
                *current = Some(Landing { id: frame.request_id, ask, landed: Vec::with_capacity(ask.request_bytes as usize) });
            }
        }
        let landing = current.as_mut().expect("opened above");
        let landed = (landing.landed.len() + frame.data.len()) as u64;
        if landed > landing.ask.request_bytes {
            return refuse(format!("request {} is longer than its ask's {} bytes", landing.id, landing.ask.request_bytes));
        }
        if frame.last && landed < landing.ask.request_bytes {
            return refuse(format!("request {} ended at {landed} bytes, short of its ask's {}", landing.id, landing.ask.request_bytes));
        }
        landing.landed.extend_from_slice(&frame.data);
        Ok(if frame.last { current.take() } else { None })
    }
}

type Results = Pin<Box<dyn Stream<Item = Result<ResultFrame, Status>> + Send>>;
type TrainReplies = Pin<Box<dyn Stream<Item = Result<TrainReply, Status>> + Send>>;
type GenerateReplies = Pin<Box<dyn Stream<Item = Result<cleave_common::pb::GenerateReply, Status>> + Send>>;

#[tonic::async_trait]
impl SplitInference for Echo {
    type InferStream = Results;
    type TrainStream = TrainReplies;
    type GenerateStream = GenerateReplies;

    async fn info(&self, _: Request<InfoRequest>) -> Result<Response<InfoReply>, Status> {
        Err(Status::unimplemented("echo only"))
    }

    async fn infer(&self, request: Request<Streaming<InferFrame>>) -> Result<Response<Results>, Status> {
        let mut frames = request.into_inner();
        let (worker, max_bytes, max_answer_bytes) = (self.worker.clone(), self.max_payload_bytes, self.max_answer_bytes);
        let (answers, out) = tokio::sync::mpsc::channel(16);
        tokio::spawn(async move {
            let mut current = None;
            while let Some(Ok(frame)) = frames.next().await {
                let request = match Landing::land(&mut current, frame, max_bytes, max_answer_bytes) {
                    Ok(Some(request)) => request,
                    Ok(None) => continue,
                    Err(status) => {
                        let _ = answers.send(Err(status)).await;
                        break;
                    }
                };
                let reply = match &worker {
                    None => answer(request.id, &request.ask),
                    Some(worker) => {
                        let (reply, answered) = tokio::sync::oneshot::channel();
                        let job = Job { id: request.id, ask: request.ask, landed: request.landed, reply };
                        let reply = match worker.send(job) {
                            Ok(()) => answered.await.ok(),
                            Err(_) => None,
                        };
                        let Some(reply) = reply else {
                            let _ = answers.send(Err(Status::internal("the echo's worker is gone"))).await;
                            break;
                        };
                        reply
                    }
                };
                if answers.send(Ok(reply)).await.is_err() {
                    break;
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(out))))
    }

    async fn train(&self, _: Request<Streaming<TrainFrame>>) -> Result<Response<TrainReplies>, Status> {
        Err(Status::unimplemented("echo only"))
    }

    async fn generate(&self, _: Request<Streaming<cleave_common::pb::GenerateFrame>>) -> Result<Response<GenerateReplies>, Status> {
        Err(Status::unimplemented("echo only"))
    }

    async fn profile(&self, _: Request<ProfileRequest>) -> Result<Response<ProfileReply>, Status> {
        Err(Status::unimplemented("echo only"))
    }

    async fn echo(&self, _: Request<EchoRequest>) -> Result<Response<EchoReply>, Status> {
        Err(Status::unimplemented("echo only"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(id: u64, ask: Option<&EchoAsk>, bytes: usize, last: bool) -> InferFrame {
        let header = ask.map(EchoAsk::header).unwrap_or_default();
        InferFrame { request_id: id, header, data: vec![7u8; bytes].into(), last, ..Default::default() }
    }

    fn ask(request_bytes: u64) -> EchoAsk {
        EchoAsk { request_bytes, compute: Duration::from_micros(850), answer_bytes: 4000 }
    }

    #[test]
    fn an_ask_travels_in_its_header() {
        let ask = ask(100_352);
        assert_eq!(EchoAsk::read(&ask.header()), Some(ask));
        assert_eq!(EchoAsk::read(&ask.header()[..23]), None);
    }

    #[test]
    fn a_request_lands_whole_in_one_buffer_once_its_last_frame_is_in() {
        let mut current = None;
        let first = Landing::land(&mut current, frame(1, Some(&ask(10)), 6, false), 1 << 20, 1 << 20).unwrap();
        assert!(first.is_none());
        let landed = Landing::land(&mut current, frame(1, None, 4, true), 1 << 20, 1 << 20).unwrap().expect("complete");
        assert_eq!((landed.id, landed.ask, landed.landed), (1, ask(10), vec![7u8; 10]));
        assert!(current.is_none());
    }

    #[test]
    fn the_echo_refuses_what_its_ask_does_not_allow() {
        let refused = |frames: Vec<InferFrame>, max_bytes: u64| -> String {
            let mut current = None;
            for f in frames {
                if let Err(status) = Landing::land(&mut current, f, max_bytes, 8 << 10) {
                    return status.message().to_string();
                }
            }
            panic!("every frame was taken")
        };
        let too_long = EchoAsk { compute: MAX_COMPUTE + Duration::from_secs(1), ..ask(10) };
        let cases = [
            (vec![frame(1, None, 10, true)], 1 << 20, "carries the echo's 24-byte ask"),
            (vec![frame(1, Some(&ask(2 << 20)), 10, true)], 1 << 20, "is over the echo's 1048576 bytes"),
            (vec![frame(1, Some(&too_long), 10, true)], 1 << 20, "or 60s"),
            (vec![frame(1, Some(&ask(10)), 11, true)], 1 << 20, "request 1 is longer than its ask's 10 bytes"),
            (vec![frame(1, Some(&ask(10)), 9, true)], 1 << 20, "request 1 ended at 9 bytes, short of its ask's 10"),
            (vec![frame(1, Some(&ask(10)), 5, false), frame(2, Some(&ask(10)), 10, true)], 1 << 20, "request 2 began before request 1 ended"),
            (vec![frame(1, Some(&EchoAsk { answer_bytes: 16 << 10, ..ask(10) }), 10, true)], 1 << 20, "over the echo's 8192 answer bytes"),
        ];
        for (frames, max_bytes, why) in cases {
            let message = refused(frames, max_bytes);
            assert!(message.contains(why), "{message:?} does not say {why:?}");
        }
    }
}
