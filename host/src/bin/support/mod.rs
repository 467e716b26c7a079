//! What the benches that drive a `server` process share: starting one on chosen cores and
//! threads, and waiting for it to answer.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use cleave_client::{connect, Link, ServerSession};
use cleave_common::config::pin_thread;
use cleave_common::pb::InferFrame;
use cleave_common::security::ClientTls;
use cleave_common::wire::{payload_frames, Key, PayloadData};
use cleave_common::{Bundle, DeviceSpec};

/// Where a side runs: its cores and libtorch's threads.
#[derive(Clone)]
pub(crate) struct Side {
    pub cores: Vec<usize>,
    pub threads: usize,
}

impl Side {
    /// Moves every thread of this process onto the side's cores and sets libtorch's threads.
    #[allow(dead_code)] // used by some of the benches that include this module
    pub(crate) fn enter(&self) -> anyhow::Result<()> {
        pin_threads(&self.cores)?;
        tch::set_num_threads(self.threads as i32);
        Ok(())
    }
}

/// What a bench's server runs with besides its bundle and cores.
pub(crate) struct ServerOptions<'a> {
    pub device: DeviceSpec,
    pub key: Option<&'a Key>,
    /// `limits` as YAML flow entries (`stream_window_bytes: 8388608`); empty for the defaults.
    pub limits: &'a str,
    /// The batch sizes its hosts will send, warmed before it answers (`warm_batches`).
    pub warm_batches: &'a [i64],
    /// Development secrets (`server dev-secrets`) whose certificate it serves TLS with
    /// (https://); plaintext where absent.
    pub tls: Option<&'a Path>,
}

impl ServerOptions<'_> {
    /// How an edge reaches such a server: trusting the development CA where it serves TLS.
    #[allow(dead_code)] // used by some of the benches that include this module
    pub(crate) fn link(&self) -> anyhow::Result<Link> {
        let mut link = Link::default();
        if let Some(dir) = self.tls {
            let ca_pem = std::fs::read(dir.join("ca.pem")).with_context(|| format!("reading {}", dir.join("ca.pem").display()))?;
            link.tls = Some(ClientTls { ca_pem, domain: Some("localhost".into()) });
        }
        Ok(link)
    }
}

/// The `server` process for `bundle` on `side`'s cores and threads, listening on a free port
/// of 127.0.0.1; its URL.
pub(crate) fn start_server(bin: &Path, bundle: &Bundle, side: &Side, options: &ServerOptions, dir: &Path) -> anyhow::Result<(Child, String)> {
    let (config, url) = write_server_config(bundle, side, options, &dir.join("server.yaml"))?;
    let child = spawn_on(side, Command::new(bin).arg("--config").arg(&config))?;
    Ok((child, url))
}

/// A `server` config for `bundle` on `side`'s cores and threads, listening on a free port of
/// 127.0.0.1, written to `path`; `path` and the URL it serves.
pub(crate) fn write_server_config(bundle: &Bundle, side: &Side, options: &ServerOptions, path: &Path) -> anyhow::Result<(PathBuf, String)> {
    let dir = path.parent().context("a config path has a directory")?;
    let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let cores: Vec<String> = side.cores.iter().map(usize::to_string).collect();
    let mut yaml = format!(
        "listen: 127.0.0.1:{port}\nbundle: {}\ndevice: {}\nthreads: {}\ncores: [{}]\nwarm_batches: {:?}\n",
        std::fs::canonicalize(bundle.dir())?.display(),
        options.device,
        side.threads,
        cores.join(", "),
        options.warm_batches,
    );
    if !options.limits.is_empty() {
        yaml.push_str(&format!("limits: {{{}}}\n", options.limits));
    }
    if let Some(key) = options.key {
        std::fs::write(dir.join("payload.key"), key.to_hex().as_bytes())?;
        yaml.push_str(&format!("encryption:\n  required: true\n  keys:\n    - id: 1\n      file: {}\n", dir.join("payload.key").display()));
    }
    let scheme = match options.tls {
        Some(secrets) => {
            let file = |name: &str| std::fs::canonicalize(secrets.join(name)).with_context(|| format!("{name} in {}", secrets.display()));
            yaml.push_str(&format!("tls:\n  cert: {}\n  key: {}\n", file("server.pem")?.display(), file("server.key")?.display()));
            "https"
        }
        None => "http",
    };
    std::fs::write(path, yaml)?;
    Ok((path.to_path_buf(), format!("{scheme}://127.0.0.1:{port}")))
}

/// `command` started on `side`'s cores (so that a server's `cores:` are ones it may use), its
/// logs at `warn`, its output dropped.
pub(crate) fn spawn_on(side: &Side, command: &mut Command) -> anyhow::Result<Child> {
    // The child starts with this thread's cores (this thread may have been moved to the edge's
    // by an earlier `enter`).
    pin_thread(0, &side.cores)?;
    let program = command.get_program().to_owned();
    command.env("RUST_LOG", "warn").stdout(Stdio::null()).spawn().with_context(|| format!("starting {}", program.to_string_lossy()))
}

/// What `grpc-floor`'s echo does with a request, told in the header of its first frame: how
/// many bytes will follow (landed in one buffer, as the server lands a request in its
/// tensor), how long to compute before answering (on a thread of its own, as the server's
/// compute worker), and how many bytes to answer with.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct EchoAsk {
    pub request_bytes: u64,
    pub compute: Duration,
    pub answer_bytes: u64,
}

impl EchoAsk {
    const HEADER_BYTES: usize = 24;

    /// Its header: the three numbers, little-endian u64s (the compute in nanoseconds).
    #[allow(dead_code)] // used by some of the benches that include this module
    pub(crate) fn header(&self) -> bytes::Bytes {
        let numbers = [self.request_bytes, self.compute.as_nanos() as u64, self.answer_bytes];
        numbers.iter().flat_map(|n| n.to_le_bytes()).collect::<Vec<u8>>().into()
    }

    /// The ask a header carries; none where it is not one.
    #[allow(dead_code)] // used by some of the benches that include this module
    pub(crate) fn read(header: &[u8]) -> Option<Self> {
        let header: &[u8; Self::HEADER_BYTES] = header.try_into().ok()?;
        let number = |k: usize| u64::from_le_bytes(header[8 * k..8 * k + 8].try_into().expect("8 bytes"));
        Some(Self { request_bytes: number(0), compute: Duration::from_nanos(number(1)), answer_bytes: number(2) })
    }
}

/// A request of `ask.request_bytes` bytes (`data`'s first) as the host frames a payload
/// ([`payload_frames`]): in frames of at most `chunk_bytes`, the ask's header on the first.
#[allow(dead_code)] // used by some of the benches that include this module
pub(crate) fn echo_frames(id: u64, ask: &EchoAsk, data: &bytes::Bytes, chunk_bytes: usize) -> Vec<InferFrame> {
    let data = PayloadData::from(vec![data.slice(..ask.request_bytes as usize)]);
    payload_frames(id, ask.header(), &data, chunk_bytes)
}

/// A session once the server answers (it loads its stages first), or the server's exit.
pub(crate) async fn connect_when_up(url: &str, bundle: &Bundle, link: &Link, server: &mut Child) -> anyhow::Result<ServerSession> {
    when_up(&format!("the server at {url}"), server, || connect(url, bundle, link)).await
}

/// What `connect` gives once it succeeds, tried every 100 ms for 60 s while `child` (`what`
/// is it) runs.
pub(crate) async fn when_up<T, E: std::fmt::Display, F: std::future::Future<Output = Result<T, E>>>(
    what: &str,
    child: &mut Child,
    mut connect: impl FnMut() -> F,
) -> anyhow::Result<T> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match connect().await {
            Ok(connected) => return Ok(connected),
            Err(e) if Instant::now() > deadline => bail!("{what} did not answer in 60 s: {e}"),
            Err(_) => {
                if let Some(status) = child.try_wait()? {
                    bail!("{what} exited ({status}) before answering");
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// Child processes, killed and waited for when this drops, however a run ends.
#[allow(dead_code)] // used by some of the benches that include this module
pub(crate) struct Children(pub Vec<Child>);

impl Drop for Children {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// The resident memory of process `pid`, in bytes (`VmRSS` of /proc/PID/status).
#[allow(dead_code)] // used by some of the benches that include this module
pub(crate) fn rss_bytes(pid: u32) -> anyhow::Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).context("no VmRSS line")?;
    let kib: u64 = line.split_whitespace().nth(1).context("VmRSS without a value")?.parse()?;
    Ok(kib * 1024)
}

/// Restricts every thread of this process (libtorch's pool and tokio's included) to `cores`;
/// threads started later inherit it from their parent.
fn pin_threads(cores: &[usize]) -> anyhow::Result<()> {
    for task in std::fs::read_dir("/proc/self/task")? {
        let Some(tid) = task?.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else { continue };
        // A thread may have ended since the listing.
        if let Err(e) = pin_thread(tid, cores) {
            if std::fs::metadata(format!("/proc/self/task/{tid}")).is_ok() {
                return Err(e.into());
            }
        }
    }
    Ok(())
}
