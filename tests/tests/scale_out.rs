//! Several servers: `server` processes on 127.0.0.1 and a host given the list. Requests are
//! spread by p2c over what each server has outstanding; one killed with SIGKILL loses no
//! request and answers none twice; one draining is given no new requests; one added to the
//! list while the run goes gets its share.

use std::collections::HashMap;
use std::io::BufRead;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use cleave_client::{connect, Link, RetryPolicy};
use cleave_common::pb::{self, split_inference_client::SplitInferenceClient};
use cleave_common::wire::Codec;
use cleave_common::{Boundary, Bundle, DeviceSpec, LoadedStages, StageRange};
use cleave_host::client::{stream_balanced, RequestOutcome, Splits, StreamCounts, StreamPlan};
use cleave_host::config::{InputSource, Resilience};
use cleave_host::inputs::Inputs;
use cleave_tests::{bundle_dir, release_binary};
use tokio::sync::watch;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

/// One test at a time: each runs three or four server processes, and the load spread it
/// measures must not be another test's processes taking the cores.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A `server` process serving one bundle on an ephemeral port of 127.0.0.1.
struct ServerProcess {
    child: Child,
    url: String,
    /// The plaintext health listener's address, with `health_listen`.
    health: Option<String>,
}

impl ServerProcess {
    fn start(bundle: &Path, dir: &Path, name: &str) -> Self {
        Self::start_with(bundle, dir, name, "")
    }

    /// With `extra` lines of server.yaml.
    fn start_with(bundle: &Path, dir: &Path, name: &str, extra: &str) -> Self {
        let config = dir.join(format!("{name}.yaml"));
        let yaml = format!("listen: 127.0.0.1:0\ninsecure: true\nbundle: {}\ndevice: cpu\nthreads: 1\n{extra}", bundle.display());
        std::fs::write(&config, yaml).unwrap();
        let mut child = Command::new(release_binary("server"))
            .arg("--config")
            .arg(&config)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("the server starts");
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stdout).lines().map_while(Result::ok) {
                // "health (grpc.health.v1, plaintext) on ADDRESS", then
                // "serving ID on DEVICE on ADDRESS (plaintext, ...)"
                if let Some(address) = line.strip_prefix("health (grpc.health.v1, plaintext) on ") {
                    let _ = tx.send((true, format!("http://{address}")));
                }
                let address = line.strip_prefix("serving ").and_then(|rest| rest.split(" (").next()?.rsplit(" on ").next());
                if let Some(address) = address {
                    let _ = tx.send((false, format!("http://{address}")));
                }
            }
        });
        let mut health = None;
        loop {
            match rx.recv_timeout(Duration::from_secs(60)) {
                Ok((true, url)) => health = Some(url),
                Ok((false, url)) => return Self { child, url, health },
                Err(_) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    panic!("server {name} did not say where it listens within 60 s");
                }
            }
        }
    }

    fn signal(&self, signal: i32) {
        // Through kill(1): the tests crate does not link libc.
        let status = Command::new("kill").arg(format!("-{signal}")).arg(self.child.id().to_string()).status().unwrap();
        assert!(status.success(), "kill -{signal} {}", self.child.id());
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
}

fn plan(bundle: &Bundle, requests: u64) -> StreamPlan {
    StreamPlan {
        bundle: bundle.clone(),
        split: Splits::Fixed(4),
        device: DeviceSpec::Cpu,
        warm_stages: None,
        ids: (0..requests).collect(),
        in_flight: 8,
        inputs: Inputs::new(&InputSource::Synthetic { seed: 3 }, bundle, 2).unwrap(),
        codec: Codec::RAW.into(),
        key: None,
        resilience: Resilience { retry: RetryPolicy { max_attempts: 4, max_backoff: Duration::from_millis(200) }, ..Resilience::default() },
    }
}

/// The whole model run here on each request's input: what every answer must equal bit for bit.
fn local_outputs(bundle: &Bundle, plan: &StreamPlan) -> HashMap<u64, Boundary> {
    let all = StageRange::all(bundle);
    let stages = LoadedStages::load(bundle, all, DeviceSpec::Cpu).unwrap();
    plan.ids.iter().map(|&id| (id, stages.run(all, &plan.inputs.batch(id)).unwrap())).collect()
}

fn urls(servers: &[ServerProcess]) -> Vec<String> {
    servers.iter().map(|s| s.url.clone()).collect()
}

/// Streams `plan` over the servers `listed` lists, calling `during` after each outcome with
/// it; checks one outcome per id, each a result bit-identical to `want`. Returns the counts
/// and the server each request was answered by, in the order they came.
fn run_over(
    listed: watch::Receiver<Vec<String>>,
    bundle: &Bundle,
    plan: StreamPlan,
    want: &HashMap<u64, Boundary>,
    mut during: impl FnMut(&RequestOutcome),
) -> (StreamCounts, Vec<String>) {
    let first = listed.borrow()[0].clone();
    let requests = plan.ids.len();
    let mut outcomes: HashMap<u64, RequestOutcome> = HashMap::new();
    let mut answered_by = Vec::new();
    let counts = runtime().block_on(async {
        let session = connect(&first, bundle, &Link::plain()).await.unwrap();
        let streamed = stream_balanced(&session, listed, plan, |o| {
            answered_by.push(o.metrics.server_url.as_deref().unwrap_or("none").to_string());
            during(&o);
            assert!(outcomes.insert(o.request_id, o).is_none(), "two outcomes for one id");
        });
        tokio::time::timeout(Duration::from_secs(120), streamed).await.expect("the host ended (no deadlock)").unwrap()
    });
    assert_eq!(outcomes.len(), requests, "every request has its outcome");
    for (id, expected) in want {
        let got = outcomes[id].output.as_ref().unwrap_or_else(|e| panic!("request {id}: {e}"));
        assert!(got.bit_identical(expected), "request {id} differs from the whole model run here");
    }
    println!("{counts:?}");
    assert_eq!(counts.answered, requests as u64);
    assert_eq!(counts.by_server.values().sum::<u64>(), requests as u64, "{:?}", counts.by_server);
    (counts, answered_by)
}

/// One server process of `bundle` per name, their files under `dir`.
fn start_servers(bundle: &Bundle, dir: &Path, names: &[&str]) -> Vec<ServerProcess> {
    names.iter().map(|n| ServerProcess::start(bundle.dir(), dir, n)).collect()
}

/// A list of servers that does not change.
fn fixed(servers: &[ServerProcess]) -> watch::Receiver<Vec<String>> {
    watch::channel(urls(servers)).1
}

#[test]
fn three_healthy_servers_share_the_requests_within_20_percent() {
    let _serial = one_at_a_time();
    let bundle = Bundle::open(bundle_dir("digits")).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let servers = start_servers(&bundle, tmp.path(), &["a", "b", "c"]);
    let plan = plan(&bundle, 300);
    let want = local_outputs(&bundle, &plan);
    let (counts, _) = run_over(fixed(&servers), &bundle, plan, &want, |_| {});
    assert_eq!(counts.by_server.len(), 3, "{:?}", counts.by_server);
    let mean = 300.0 / 3.0;
    for (url, &n) in &counts.by_server {
        assert!((n as f64 - mean).abs() <= 0.2 * mean, "{url} answered {n} of 300, more than 20% off {mean}: {:?}", counts.by_server);
    }
    assert_eq!(counts.retried, 0, "nothing was lost");
}

#[test]
fn a_server_killed_mid_run_loses_no_request_and_answers_none_twice() {
    let _serial = one_at_a_time();
    let bundle = Bundle::open(bundle_dir("digits")).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let servers = start_servers(&bundle, tmp.path(), &["a", "b", "c"]);
    let plan = plan(&bundle, 200);
    let want = local_outputs(&bundle, &plan);
    let victim = &servers[1];
    // Stopped first, the victim holds the requests it was given (the balancer then gives it
    // no more: they stay outstanding); then killed, it takes them down with it.
    let mut answered = 0;
    let (counts, _) = run_over(fixed(&servers), &bundle, plan, &want, |_| {
        answered += 1;
        match answered {
            40 => victim.signal(19), // SIGSTOP
            80 => victim.signal(9),  // SIGKILL
            _ => {}
        }
    });
    assert!(counts.retried >= 1, "the killed server's outstanding requests were sent again: {counts:?}");
    assert_eq!(counts.failed, 0);
    assert_eq!(counts.by_server.len(), 3, "{:?}", counts.by_server);
}

#[test]
fn a_server_added_to_the_list_mid_run_gets_requests() {
    let _serial = one_at_a_time();
    let bundle = Bundle::open(bundle_dir("digits")).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let servers = start_servers(&bundle, tmp.path(), &["a", "b", "c", "d"]);
    let plan = plan(&bundle, 240);
    let want = local_outputs(&bundle, &plan);
    let (list, listed) = watch::channel(urls(&servers[..3]));
    let added = servers[3].url.clone();
    let mut answered = 0;
    let (counts, answered_by) = run_over(listed, &bundle, plan, &want, |_| {
        answered += 1;
        if answered == 60 {
            list.send_replace(urls(&servers));
        }
    });
    let before = answered_by[..60].iter().filter(|url| **url == added).count();
    assert_eq!(before, 0, "the fourth server was not listed yet");
    let after = answered_by[60..].iter().filter(|url| **url == added).count();
    assert!(after >= 20, "the fourth server answered {after} of the last 180 requests: {:?}", counts.by_server);
}

#[test]
fn a_draining_server_is_given_no_new_requests_and_none_is_sent_twice() {
    let _serial = one_at_a_time();
    let bundle = Bundle::open(bundle_dir("digits")).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    // On SIGTERM each says NOT_SERVING for 3 s before it refuses anything.
    let servers: Vec<ServerProcess> =
        ["a", "b", "c"].iter().map(|n| ServerProcess::start_with(bundle.dir(), tmp.path(), n, "limits:\n  drain_notice: 3s\n")).collect();
    let plan = plan(&bundle, 240);
    let in_flight = plan.in_flight;
    let want = local_outputs(&bundle, &plan);
    let victim = &servers[1];
    let mut answered = 0;
    let (counts, answered_by) = run_over(fixed(&servers), &bundle, plan, &want, |_| {
        answered += 1;
        if answered == 60 {
            victim.signal(15); // SIGTERM
        }
    });
    let before = answered_by[..60].iter().filter(|url| **url == victim.url).count();
    let after = answered_by[60..].iter().filter(|url| **url == victim.url).count();
    assert!(before > 0, "the victim served before its drain: {:?}", counts.by_server);
    assert!(after <= in_flight, "after SIGTERM the victim answered {after}: more than the {in_flight} it could hold then");
    assert_eq!(counts.retried, 0, "no request was refused by the draining server and sent again");
}

/// What the health service at `url` says of `service` (an error's code when it says nothing).
async fn health_of(url: &str, service: &str) -> Result<i32, tonic::Code> {
    let channel = tonic::transport::Channel::from_shared(url.to_string()).unwrap().connect().await.unwrap();
    let reply = HealthClient::new(channel).check(HealthCheckRequest { service: service.into() }).await;
    reply.map(|r| r.into_inner().status).map_err(|s| s.code())
}

#[test]
fn the_health_listener_serves_readiness_and_liveness_apart_in_plaintext_and_nothing_else() {
    let _serial = one_at_a_time();
    let bundle = Bundle::open(bundle_dir("digits")).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let extra = "health_listen: 127.0.0.1:0\nlimits:\n  drain_notice: 5s\n";
    let server = ServerProcess::start_with(bundle.dir(), tmp.path(), "a", extra);
    let health = server.health.clone().expect("the server says where its health listener is");
    let (serving, not_serving) = (ServingStatus::Serving as i32, ServingStatus::NotServing as i32);
    runtime().block_on(async {
        assert_eq!(health_of(&health, "").await, Ok(serving), "ready: the models are loaded and warmed");
        assert_eq!(health_of(&health, bundle.id()).await, Ok(serving));
        assert_eq!(health_of(&health, cleave_server::LIVENESS).await, Ok(serving));
        // The health listener serves nothing of cleave's.
        let channel = tonic::transport::Channel::from_shared(health.clone()).unwrap().connect().await.unwrap();
        let info = SplitInferenceClient::new(channel).info(pb::InfoRequest {}).await.unwrap_err();
        assert_eq!(info.code(), tonic::Code::Unimplemented, "{info:?}");
        // Draining: not ready, still alive.
        server.signal(15);
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while health_of(&health, "").await != Ok(not_serving) {
            assert!(std::time::Instant::now() < deadline, "NOT_SERVING within 5 s of SIGTERM");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(health_of(&health, cleave_server::LIVENESS).await, Ok(serving), "a draining server is alive");
    });
}
