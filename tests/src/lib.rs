//! Helpers for cleave's end-to-end tests: where the test bundles are, copies to tamper with,
//! and reading a scrape of the server's metrics.
//!
//! The bundles are exported by `make test-bundles` (which `make test` runs first) into
//! `target/test-bundles/NAME`, or into `$CLEAVE_TEST_BUNDLES/NAME`.

use std::path::{Path, PathBuf};

/// The directory of test bundle `name`; panics with the command to run when it is missing.
pub fn bundle_dir(name: &str) -> PathBuf {
    let root = std::env::var_os("CLEAVE_TEST_BUNDLES")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/test-bundles"));
    let dir = root.join(name);
    assert!(dir.join("manifest.json").is_file(), "test bundle {} is missing: run `make test-bundles` (or `make test`)", dir.display());
    dir
}

/// A copy of test bundle `name` in a fresh temporary directory, to corrupt at will.
pub fn bundle_copy(name: &str) -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().expect("temporary directory");
    let dest = tmp.path().join(name);
    std::fs::create_dir(&dest).expect("create bundle copy");
    for entry in std::fs::read_dir(bundle_dir(name)).expect("read bundle") {
        let entry = entry.expect("bundle entry");
        std::fs::copy(entry.path(), dest.join(entry.file_name())).expect("copy bundle file");
    }
    (tmp, dest)
}

/// A file beside the test bundles (the digits train and test splits); panics with the command
/// to run when it is missing.
pub fn test_file(name: &str) -> PathBuf {
    let root = std::env::var_os("CLEAVE_TEST_BUNDLES")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/test-bundles"));
    let path = root.join(name);
    assert!(path.is_file(), "test file {} is missing: run `make test-bundles` (or `make test`)", path.display());
    path
}

/// A scrape of the server's metrics (`Metrics::render`, or `GET /metrics`'s body).
pub fn parse_metrics(text: &str) -> prometheus_parse::Scrape {
    prometheus_parse::Scrape::parse(text.lines().map(|l| Ok(l.to_string()))).expect("the metrics parse")
}

/// The value of the sample `name` with these labels in a scrape, summed over the samples
/// that match (0 when there is none).
pub fn metric_sample(scrape: &prometheus_parse::Scrape, name: &str, labels: &[(&str, &str)]) -> f64 {
    scrape
        .samples
        .iter()
        .filter(|s| s.metric == name && labels.iter().all(|(k, v)| s.labels.get(k) == Some(*v)))
        .map(|s| match &s.value {
            prometheus_parse::Value::Counter(v) | prometheus_parse::Value::Gauge(v) | prometheus_parse::Value::Untyped(v) => *v,
            prometheus_parse::Value::Histogram(buckets) => buckets.iter().map(|b| b.count).fold(0.0, f64::max),
            prometheus_parse::Value::Summary(_) => f64::NAN,
        })
        .sum()
}

/// A release binary of the workspace (`server`, `host`), which `make test` builds before the
/// tests; panics with the command to run when it is missing.
pub fn release_binary(name: &str) -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../target"));
    let path = target.join("release").join(name);
    assert!(path.is_file(), "{} is missing: run `make build` (or `make test`)", path.display());
    path
}

/// A `server` process of its own (the benches' examples): its config and log in a directory
/// of their own, killed when dropped.
pub struct ServerProcess {
    child: std::process::Child,
    dir: tempfile::TempDir,
}

impl ServerProcess {
    /// Starts `server_bin` with `config` (server.yaml's text) and waits until it listens on
    /// 127.0.0.1:`port`; panics with its log when it exits or does not listen within 120 s.
    pub fn start(server_bin: &Path, config: &str, port: u16) -> Self {
        let dir = tempfile::tempdir().expect("a directory");
        let config_path = dir.path().join("server.yaml");
        std::fs::write(&config_path, config).expect("server.yaml written");
        let log = std::fs::File::create(dir.path().join("server.log")).expect("server.log");
        let mut child = std::process::Command::new(server_bin)
            .arg("--config")
            .arg(&config_path)
            .stdout(log.try_clone().expect("server.log"))
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("{}: {e} (make build)", server_bin.display()));
        let waited = std::time::Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            if let Ok(Some(status)) = child.try_wait() {
                panic!("the server exited ({status}): {}", std::fs::read_to_string(dir.path().join("server.log")).unwrap_or_default());
            }
            assert!(waited.elapsed() < std::time::Duration::from_secs(120), "the server did not listen");
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        Self { child, dir }
    }

    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Its log file.
    pub fn log(&self) -> PathBuf {
        self.dir.path().join("server.log")
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Sockets from `source` (an address of this machine, `127.0.0.2` say) to a server, each
/// saying nothing and opened again as soon as the server closes it, on a thread of their own.
pub struct Flood {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<u64>,
}

impl Flood {
    /// Starts `sockets` of them to `server`.
    pub fn start(server: std::net::SocketAddr, source: std::net::IpAddr, sockets: usize) -> Self {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let thread = reopen_flood(server, source, sockets, std::sync::Arc::clone(&stop));
        Self { stop, thread }
    }

    /// Stops it; how many sockets it opened in all.
    pub async fn stop(self) -> u64 {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let thread = self.thread;
        tokio::task::spawn_blocking(move || thread.join().expect("the flood's thread")).await.expect("joined")
    }
}

/// `sockets` sockets from `source` (an address of this machine, `127.0.0.2` say) to `server`,
/// each saying nothing and opened again as soon as the server closes it, on a thread of their
/// own until `stop`; the thread returns how many were opened in all.
fn reopen_flood(
    server: std::net::SocketAddr,
    source: std::net::IpAddr,
    sockets: usize,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> std::thread::JoinHandle<u64> {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;
    use std::time::Duration;
    use tokio::io::AsyncReadExt;
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a runtime");
        runtime.block_on(async move {
            let opened = Arc::new(AtomicU64::new(0));
            let tasks: Vec<_> = (0..sockets)
                .map(|_| {
                    let (stop, opened) = (Arc::clone(&stop), Arc::clone(&opened));
                    tokio::spawn(async move {
                        while !stop.load(Ordering::Relaxed) {
                            let socket = tokio::net::TcpSocket::new_v4().expect("a socket");
                            socket.bind(std::net::SocketAddr::new(source, 0)).expect("bound to the source address");
                            let Ok(mut stream) = socket.connect(server).await else {
                                tokio::time::sleep(Duration::from_millis(1)).await;
                                continue;
                            };
                            opened.fetch_add(1, Ordering::Relaxed);
                            let mut buf = [0u8; 256];
                            // Until the server closes it (or the flood stops).
                            while !stop.load(Ordering::Relaxed) {
                                if let Ok(Ok(0) | Err(_)) = tokio::time::timeout(Duration::from_millis(50), stream.read(&mut buf)).await {
                                    break;
                                }
                            }
                        }
                    })
                })
                .collect();
            for task in tasks {
                let _ = task.await;
            }
            opened.load(Ordering::Relaxed)
        })
    })
}
