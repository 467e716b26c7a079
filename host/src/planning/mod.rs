//! Where to split: everything that feeds the planner (`crate::planner`, the model) and runs it.
//!
//! - [`profile`]: the profiles measured: the edge's stages and boundaries, the server's
//!   stages (`Profile`), the link (`Echo`).
//! - [`plan`]: `host plan`: the table of every cut, `plan.json`, `--measure` and its plots.
//! - [`auto_split`]: `split: auto` while running: the plan at start-up, the estimate fed by
//!   every transfer, the re-planner's moves, upload probes while everything runs on the edge.
//! - [`codec_choice`]: `codec: auto`: each request's codec from the estimated rate and each
//!   codec's cost, measured on the first boundary at each cut (or by `split: auto`'s profile).
//! - [`graph`]: the stage graph as Graphviz DOT, folded to module level, the chosen cut marked.
//! - [`fleet`]: `host plan --fleet`: several models placed on GPUs and MIG slices.

pub mod auto_split;
pub mod codec_choice;
pub mod fleet;
pub mod graph;
pub mod plan;
pub mod profile;

pub use plan::{plan, MeasuredCut, PlanOptions, PlanReport, PlanRun};
