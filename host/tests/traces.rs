//! One trace per request across both processes: a `server` and a `host` run, each exporting
//! its spans over OTLP to a collector in this test (tonic serving OpenTelemetry's trace
//! service), and each request's spans on the server join the host's trace under the attempt
//! that carried it; a training step's calls likewise, and the unary calls (`Info`, `Profile`,
//! `Echo`) that carry their caller's trace in their metadata.

use std::collections::HashMap;
use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{TraceService, TraceServiceServer};
use opentelemetry_proto::tonic::collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse};
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use opentelemetry_proto::tonic::common::v1::KeyValue;
use tokio_stream::wrappers::TcpListenerStream;

/// A span as the collector received it, with the service that sent it.
#[derive(Debug, Clone)]
struct Received {
    service: String,
    name: String,
    trace_id: Vec<u8>,
    span_id: Vec<u8>,
    parent: Vec<u8>,
    links: Vec<Vec<u8>>,
    attributes: HashMap<String, String>,
}

#[derive(Default, Clone)]
struct Collector {
    spans: Arc<Mutex<Vec<Received>>>,
}

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(&self, request: tonic::Request<ExportTraceServiceRequest>) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut spans = self.spans.lock().unwrap();
        for resource_spans in request.into_inner().resource_spans {
            let resource = resource_spans.resource.map(|r| texts(&r.attributes)).unwrap_or_default();
            let service = resource.get("service.name").cloned().unwrap_or_default();
            for span in resource_spans.scope_spans.into_iter().flat_map(|s| s.spans) {
                spans.push(Received {
                    service: service.clone(),
                    name: span.name,
                    trace_id: span.trace_id,
                    span_id: span.span_id,
                    parent: span.parent_span_id,
                    links: span.links.into_iter().map(|l| l.span_id).collect(),
                    attributes: texts(&span.attributes),
                });
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

/// Attributes as text (numbers too).
fn texts(attributes: &[KeyValue]) -> HashMap<String, String> {
    attributes
        .iter()
        .filter_map(|kv| {
            let value = match kv.value.as_ref()?.value.as_ref()? {
                AnyValue::StringValue(s) => s.clone(),
                AnyValue::IntValue(i) => i.to_string(),
                AnyValue::BoolValue(b) => b.to_string(),
                AnyValue::DoubleValue(d) => d.to_string(),
                _ => return None,
            };
            Some((kv.key.clone(), value))
        })
        .collect()
}

fn test_bundle(name: &str) -> PathBuf {
    let bundles = PathBuf::from(std::env::var("CLEAVE_TEST_BUNDLES").unwrap_or_else(|_| "../target/test-bundles".into()));
    std::fs::canonicalize(bundles.join(name)).expect("the test bundles (make test-bundles)")
}

/// The `server` binary, built beside `host` (`make test` builds the workspace first).
fn server_binary() -> PathBuf {
    let server = Path::new(env!("CARGO_BIN_EXE_host")).with_file_name("server");
    assert!(server.is_file(), "{} is missing: build the workspace (cargo build --release --workspace)", server.display());
    server
}

/// Stops the server on drop, as an operator would (SIGTERM: it drains, exports its last
/// spans and exits).
struct Server(Child);

impl Server {
    /// Starts one with `config` and waits until it says where it listens (it loads its bundle
    /// first). It listens on a port of its own choosing: a port picked here and given to it
    /// can be taken in between, and a connect loop on a free ephemeral port can connect to
    /// itself (TCP simultaneous open) before the server listens.
    fn start(config: &Path) -> (Self, String) {
        let mut child = Command::new(server_binary()).arg("--config").arg(config).stdout(Stdio::piped()).spawn().expect("start server");
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stdout).lines().map_while(Result::ok) {
                // "serving ID on DEVICE on ADDRESS (plaintext, ...)"
                if let Some(address) = line.strip_prefix("serving ").and_then(|rest| rest.split(" (").next()?.rsplit(" on ").next()) {
                    let _ = tx.send(address.to_string());
                }
            }
        });
        let mut server = Self(child);
        match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(address) => (server, format!("http://{address}")),
            Err(_) => {
                let exited = server.0.try_wait().unwrap();
                server.stop();
                panic!("the server did not say where it listens within 60 s (exit: {exited:?})");
            }
        }
    }

    fn stop(&mut self) {
        if self.0.try_wait().unwrap().is_some() {
            return;
        }
        let _ = Command::new("kill").args(["-TERM", &self.0.id().to_string()]).status();
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if self.0.try_wait().unwrap().is_some() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Runs a `server` and a `host` (with `edge` after the server and bundle lines of its
/// config), both exporting to a collector here; the spans it received.
fn traced_run(edge: &str) -> Vec<Received> {
    traced(edge, &[])
}

/// [`traced_run`] with `host_args` before the host's `--config` (a subcommand and its flags).
fn traced(edge: &str, host_args: &[&str]) -> Vec<Received> {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let collector = Collector::default();
    let listener = runtime.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    let service = TraceServiceServer::new(collector.clone());
    runtime.spawn(tonic::transport::Server::builder().add_service(service).serve_with_incoming(TcpListenerStream::new(listener)));

    let tmp = tempfile::tempdir().unwrap();
    let bundle = test_bundle("digits");
    let telemetry = format!("telemetry: {{otlp_endpoint: \"{endpoint}\"}}\n");
    let server_yaml = tmp.path().join("server.yaml");
    std::fs::write(&server_yaml, format!("listen: 127.0.0.1:0\nbundle: {}\ndevice: cpu\n{telemetry}", bundle.display())).unwrap();
    let (mut server, url) = Server::start(&server_yaml);

    let edge_yaml = tmp.path().join("edge.yaml");
    let out = tmp.path().join("out");
    let yaml = format!("server: {url}\nbundle: {}\ndevice: cpu\noutput: {}\n{telemetry}{edge}", bundle.display(), out.display());
    std::fs::write(&edge_yaml, yaml).unwrap();
    let host = Command::new(env!("CARGO_BIN_EXE_host")).args(host_args).arg("--config").arg(&edge_yaml).output().expect("run host");
    assert!(host.status.success(), "{}{}", String::from_utf8_lossy(&host.stdout), String::from_utf8_lossy(&host.stderr));
    server.stop();
    // Both processes exported their last spans before exiting.
    let spans = collector.spans.lock().unwrap().clone();
    spans
}

fn named(spans: &[Received], service: &str, name: &str) -> Vec<Received> {
    spans.iter().filter(|s| s.service == service && s.name == name).cloned().collect()
}

/// Asserts that each of `steps` has a span of the service under `parent`.
fn has_children(spans: &[Received], service: &str, parent: &Received, steps: &[&str]) {
    for step in steps {
        assert!(
            named(spans, service, step).iter().any(|c| c.parent == parent.span_id && c.trace_id == parent.trace_id),
            "no {step} span of {service} under {} {:?}",
            parent.name,
            parent.attributes
        );
    }
}

#[test]
fn one_request_s_spans_on_the_host_and_the_server_share_its_trace() {
    let requests = 3;
    let spans = traced_run(&format!("split: 4\nbatch_size: 2\nrequests: {requests}\ninput: {{kind: synthetic, seed: 3}}\n"));
    let host_requests = named(&spans, "cleave-host", "request");
    let server_requests = named(&spans, "cleave-server", "request");
    assert_eq!(host_requests.len(), requests, "{spans:#?}");
    assert_eq!(server_requests.len(), requests, "{spans:#?}");
    let attempts = named(&spans, "cleave-host", "attempt");
    let batches = named(&spans, "cleave-server", "batch");
    for on_server in &server_requests {
        let id = &on_server.attributes["request_id"];
        let on_host = host_requests.iter().find(|s| &s.attributes["request_id"] == id).expect("the host's span of the request");
        assert_eq!(on_server.trace_id, on_host.trace_id, "request {id}: one trace on both sides");
        let attempt = attempts.iter().find(|a| a.span_id == on_server.parent).expect("the server's request span is under a host attempt");
        assert_eq!(attempt.parent, on_host.span_id, "request {id}: the attempt is the host request's");
        assert_eq!(on_server.attributes["cut"], "4");
        // Every step on either side is under its request, and its batch links to it.
        has_children(&spans, "cleave-server", on_server, &["read", "decode", "queue", "compute", "encode", "answer"]);
        has_children(&spans, "cleave-host", on_host, &["prefix", "encode"]);
        assert!(batches.iter().any(|b| b.links.contains(&on_server.span_id)), "request {id}: no batch links to it");
    }
    // Distinct requests, distinct traces.
    let mut traces: Vec<_> = host_requests.iter().map(|s| s.trace_id.clone()).collect();
    traces.sort();
    traces.dedup();
    assert_eq!(traces.len(), requests);
}

#[test]
fn a_load_run_s_requests_on_the_server_join_their_trace() {
    let spans = traced("split: 4\nbatch_size: 2\ninput: {kind: synthetic, seed: 3}\n", &["load", "--edges", "2", "--closed", "--duration", "300ms"]);
    let host_requests = named(&spans, "cleave-host", "request");
    let server_requests = named(&spans, "cleave-server", "request");
    assert!(!host_requests.is_empty(), "{spans:#?}");
    assert_eq!(server_requests.len(), host_requests.len(), "every request sent was answered");
    let edges: std::collections::BTreeSet<_> = host_requests.iter().map(|s| s.attributes["edge"].clone()).collect();
    assert_eq!(edges.len(), 2, "both edges' requests are traced");
    for on_server in &server_requests {
        // Edges number their requests alike: the parent tells whose request it is.
        let on_host = host_requests.iter().find(|s| s.span_id == on_server.parent).expect("the server's request span is under a host request");
        assert_eq!(on_server.trace_id, on_host.trace_id);
        assert_eq!(on_server.attributes["request_id"], on_host.attributes["request_id"]);
        assert_eq!((on_host.attributes["cut"].as_str(), on_host.attributes["codec"].as_str()), ("4", "raw"));
        has_children(&spans, "cleave-server", on_server, &["read", "queue", "compute", "answer"]);
    }
}

#[test]
fn a_training_step_s_calls_on_the_server_join_the_step_s_trace() {
    let data = |name: &str| test_bundle("").join(name).display().to_string();
    let steps = 2;
    let spans = traced_run(&format!(
        "split: 4\ntrain:\n  mode: split\n  data: {{train: {}, test: {}, targets: label}}\n  epochs: 1\n  batch_size: 16\n  \
         eval_batch_size: 16\n  max_steps: {steps}\n  optimizer: {{kind: sgd, lr: 0.01}}\n  loss: cross-entropy\n",
        data("digits-train.safetensors"),
        data("digits-test.safetensors"),
    ));
    let host_steps = named(&spans, "cleave-host", "train_step");
    assert_eq!(host_steps.len(), steps, "{spans:#?}");
    let host_calls = named(&spans, "cleave-host", "train_call");
    let server_calls = named(&spans, "cleave-server", "train_call");
    for step in &host_steps {
        let calls: Vec<_> = host_calls.iter().filter(|c| c.parent == step.span_id).collect();
        let phases: Vec<_> = calls.iter().map(|c| c.attributes["phase"].as_str()).collect();
        // The server computes the loss: a step is one call, answered with the gradient.
        assert_eq!(phases, ["Forward"], "step {:?}", step.attributes);
        for call in calls {
            let on_server = server_calls.iter().find(|s| s.parent == call.span_id).expect("the server's span of the call");
            assert_eq!(on_server.trace_id, step.trace_id);
            assert_eq!(on_server.attributes["phase"], call.attributes["phase"]);
            has_children(&spans, "cleave-server", on_server, &["decode", "compute", "encode"]);
        }
    }
}

#[test]
fn unary_calls_on_the_server_join_the_caller_s_trace() {
    // `split: auto` asks the server for its info, profiles it and probes the link before the
    // first request.
    let spans = traced_run("split: auto\nbatch_size: 2\nrequests: 2\ninput: {kind: synthetic, seed: 3}\n");
    for (caller, rpc) in [("server_info", "Info"), ("server_profile", "Profile"), ("link_probe", "Echo")] {
        let callers = named(&spans, "cleave-host", caller);
        assert!(!callers.is_empty(), "no {caller} span on the host: {spans:#?}");
        for call in &callers {
            let on_server: Vec<_> = named(&spans, "cleave-server", rpc).into_iter().filter(|s| s.parent == call.span_id).collect();
            assert_eq!(on_server.len(), 1, "{rpc}: one span on the server under each {caller} of the host");
            assert_eq!(on_server[0].trace_id, call.trace_id, "{rpc}: one trace on both sides");
        }
    }
}
