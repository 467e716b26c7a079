//! The edge side of cleave.
//!
//! - [`run`]: `host --config edge.yaml [--loopback]`: run the prefix of each request, stream
//!   the boundaries to the server, write predictions, metrics, a summary and plots.
//! - [`run_options`]: [`RunOptions`], what `host --config` is given beside its config, for an
//!   inference run and a training run alike.
//! - The link to a server (connect, token, `Info`, protocol and bundle checks, retries) is the
//!   `cleave-client` crate's: runs, plans, `host load`, training and generation all use it.
//! - [`client`]: the streaming client (prefix thread, in-flight window, one outcome per request).
//! - [`planner`]: the split planner's model: from profiles, every cut's predicted latency
//!   and throughput, the best cut for an [`planner::Objective`], the re-planner; what each
//!   codec costs at a cut. It talks to no server and uses no other module.
//! - [`planning`]: what feeds and runs the planner: `host plan` (profiles of the edge, the
//!   server and the link), `split: auto` and `codec: auto` while running, the stage graph,
//!   the fleet planner.
//! - [`load`]: `host load`, a load generator: many edges' streams from one process against
//!   one or more models, closed or open loop; a table, `load.json`, `latency.csv`, a plot.
//! - [`training`]: `host --config train.yaml [--loopback]` (a `train:` section): split,
//!   U-shaped or monolithic training, evaluation, checkpoints, report files.
//! - [`generation`]: split generation: the edge's stages and caches, the server's session
//!   over a `Generate` stream.
//! - [`progress`]: what a long command tells while it works (events the binary prints).
//! - [`records`]: what a command keeps of what happened (an epoch of training, what `split:
//!   auto` planned and did, what `codec: auto` measured): made by training and planning, read
//!   by progress, the reports and the plots.
//! - [`report`]: a run's `predictions.jsonl`, `metrics.csv`, `summary.json` and table.
//! - [`plots`]: every SVG plot (a run's, a plan's, a training run's) and their chart helpers.
//! - [`config`]: `edge.yaml`, raw then validated.
//! - [`inputs`], `images`: synthetic tensors, tensor files (.safetensors, .npz, .npy) or images.
//! - [`files`]: the bundle opened off the runtime; a missing example named with its make
//!   target (`examples`, which knows the Makefile's targets).
//! - [`verify`]: `host splits` and `host verify`.
//! - `loopback`: `--loopback`, the server in this process (the `loopback` feature).
//! - [`error`]: the library's error type.

// Libraries return what they found and hand progress to their caller; binaries print.
#![warn(clippy::print_stdout, clippy::print_stderr)]

pub mod client;
pub mod config;
pub mod cpu_time;
pub mod error;
mod examples;
pub mod files;
pub mod generation;
mod images;
pub mod inputs;
pub mod load;
#[cfg(feature = "loopback")]
pub mod loopback;
#[cfg(not(feature = "loopback"))]
#[path = "no_loopback.rs"]
mod loopback;
pub mod planner;
pub mod planning;
pub mod plots;
pub mod progress;
pub mod records;
pub mod report;
pub mod run;
pub mod run_options;
pub mod training;
pub mod verify;

pub use error::{HostError, RequestFailure, Result};
#[cfg(feature = "loopback")]
pub use loopback::LoopbackServer;
pub use run::run;
pub use run_options::RunOptions;
pub use verify::{splits, verify, SplitsReport, VerifyOptions, VerifyRun};
