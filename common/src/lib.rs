//! cleave's shared library: everything the `host` and the `server` both need, and nothing
//! only one of them does.
//!
//! - [`bundle`]: open an exported bundle (manifest, hashes, references), list its split
//!   points, and resolve a [`SplitSpec`] to a cut.
//! - [`spec`]: what the manifest says crosses a cut: dtypes, symbolic shapes, value trees.
//! - [`value`]: runtime values at a cut ([`Boundary`]): named tensors plus a value tree.
//! - [`stages`]: load a range of stages onto a device and run it on a boundary.
//! - [`generation`]: split generation's stages, which take their layers' key/value caches.
//! - [`training`]: stages in training mode, optimizers, losses, checkpoints, and the step
//!   math both sides of split training run.
//! - [`wire`]: boundaries to and from `cleave-codec` payloads, payloads in frames, and the one
//!   frame assembler every stream uses.
//! - [`protocol`]: the gRPC protocol at its edge: generated types ([`pb`]), constants, the
//!   server's `Info` as a domain type, conversions.
//! - [`config`]: what both sides' config files share: limits, secrets, TLS files, paths.
//! - [`security`]: secrets from files or variables, the bearer token, TLS material.
//! - [`device`]: `auto`, `cpu`, `cuda:N` and what they resolve to on this machine.
//! - [`verify`]: run every split point against the bundle's references.
//! - [`stats`]: the one percentile definition (medians, p95, p99).
//! - [`tensor_memory`]: a CPU tensor's memory as bytes without copying (the workspace's one
//!   `unsafe` module).
//! - [`error`]: the bundle runtime's error type, one variant per step that can fail.

// Libraries return what they found and hand progress to their caller; binaries print.
#![warn(clippy::print_stdout, clippy::print_stderr)]

pub mod bundle;
pub mod config;
pub mod device;
pub mod error;
pub mod generation;
pub mod logs;
pub mod protocol;
pub mod scheduling;
pub mod security;
pub mod spec;
pub mod stages;
pub mod stats;
pub mod telemetry;
pub mod tensor_memory;
pub mod training;
pub mod value;
pub mod verify;
pub mod wire;
mod yaml_errors;

pub use bundle::{Bundle, CutTensors, SplitPoint, SplitSpec};
pub use device::DeviceSpec;
pub use error::{BundleError, Result};
pub use protocol::pb;
pub use stages::{LoadedStages, StageRange};
pub use value::{Boundary, Value};
