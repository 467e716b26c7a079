//! cleave's shared library: everything the `host` and the `server` both need.
//!
//! - [`bundle`]: open an exported bundle (manifest, hashes, references) and list its split points.
//! - [`spec`]: what the manifest says crosses a cut: dtypes, symbolic shapes, value trees.
//! - [`value`]: runtime values at a cut ([`Boundary`]): named tensors plus a value tree.
//! - [`stages`]: load a range of stages onto a device and run it on a boundary.
//! - [`device`]: `auto`, `cpu`, `cuda:N` and what they resolve to on this machine.
//! - [`verify`]: run every split point against the bundle's references.
//! - [`tables`]: the tables printed for people (split points, verification runs).
//! - [`error`]: the error type, one variant per step that can fail.

pub mod bundle;
pub mod device;
pub mod error;
pub mod spec;
pub mod stages;
pub mod value;
pub mod tables;
pub mod verify;

pub use bundle::{Bundle, SplitPoint};
pub use device::DeviceSpec;
pub use error::{BundleError, Result};
pub use stages::{LoadedStages, StageRange};
pub use value::{Boundary, Value};
