//! cleave's shared library: everything the `host` and the `server` both need.
//!
//! - [`bundle`]: open an exported bundle (manifest, hashes, references) and list its split points.
//! - [`spec`]: what the manifest says crosses a cut: dtypes, symbolic shapes, value trees.
//! - [`value`]: runtime values at a cut ([`Boundary`]): named tensors plus a value tree.
//! - [`stages`]: load a range of stages onto a device and run it on a boundary.
//! - [`training`]: stages in training mode, optimizers, losses, checkpoints (split training).
//! - [`config`]: `server.yaml` and `edge.yaml`, raw then validated.
//! - [`device`]: `auto`, `cpu`, `cuda:N` and what they resolve to on this machine.
//! - [`graph`]: the stage graph as Graphviz DOT, folded to module level, the chosen cut marked.
//! - [`planner`]: predicted latency and throughput of every cut from profiles; the best cut.
//! - [`verify`]: run every split point against the bundle's references.
//! - [`tables`]: the tables printed for people (split points, verification runs).
//! - [`wire`]: boundaries to and from `cleave-codec` payloads, and payloads in frames.
//! - [`security`]: secrets from files or variables, the bearer token, TLS material, dev secrets.
//! - [`pb`]: the generated gRPC types.
//! - [`error`]: the error type, one variant per step that can fail.

pub mod bundle;
pub mod config;
pub mod device;
pub mod error;
pub mod graph;
pub mod planner;
pub mod security;
pub mod spec;
pub mod stages;
pub mod value;
pub mod tables;
pub mod training;
pub mod verify;
pub mod wire;

/// The generated gRPC types and service (from `proto/cleave/v1/cleave.proto`). Only the RPC
/// glue uses them; the rest of the code works with domain types and converts at the edge.
#[allow(missing_docs, unreachable_pub, clippy::all)]
pub mod pb {
    tonic::include_proto!("cleave.v1");
}

pub use bundle::{Bundle, SplitPoint};
pub use device::DeviceSpec;
pub use error::{BundleError, Result};
pub use stages::{LoadedStages, StageRange};
pub use value::{Boundary, Value};
