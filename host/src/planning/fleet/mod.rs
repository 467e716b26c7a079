//! `host plan --fleet`: several models' server stages placed on GPUs and their MIG slices,
//! fair against each model's p95 target, from profiles.
//!
//! - [`config`]: `fleet.yaml`, checked.
//! - [`profile`]: the profile files (a model's server stages, an edge's stages).
//! - [`queueing`]: the latency model a target is checked with.
//! - [`choices`]: the ways one model can run on one slice kind, and why none is left.
//! - [`solve`]: the integer program and its leximin objective (`good_lp` + `microlp`).
//! - [`output`]: the table, `fleet-plan.json`, MIG commands, a `server.yaml` per slice.
//! - [`simulate`]: the planned servers simulated with the server's own scheduling rules.

pub mod choices;
pub mod config;
pub mod output;
pub mod profile;
pub mod queueing;
pub mod simulate;
pub mod solve;

use std::path::Path;

pub use config::Fleet;
pub use output::FleetPlan;

use choices::Unplaceable;
use solve::{Choices, Placement, SolveError};

/// Why a fleet has no plan.
#[derive(Debug, thiserror::Error)]
pub enum FleetError {
    /// The config or a profile is not valid.
    #[error(transparent)]
    Config(#[from] cleave_common::config::ConfigError),
    /// One model cannot run anywhere, whatever the others do.
    #[error("model {model:?} cannot be placed: {why}")]
    Unplaceable {
        /// The model.
        model: String,
        /// The check its nearest choice failed.
        why: Unplaceable,
    },
    /// Each model fits alone, but not all together.
    #[error("model {model:?} cannot be placed beside {beside:?}: capacity: the GPUs' slices have too little time or memory for all their rates within their targets")]
    Capacity {
        /// The first model, in the config's order, that does not fit beside those before.
        model: String,
        /// Those before it.
        beside: Vec<String>,
    },
    /// The solver gave no plan.
    #[error(transparent)]
    Solve(SolveError),
    /// The plan could not be written.
    #[error("cannot write the plan into {dir}: {error}")]
    Write {
        /// The output folder.
        dir: std::path::PathBuf,
        /// Why.
        error: std::io::Error,
    },
}

/// Plans `fleet`: each model's choices, then the placement.
pub fn place(fleet: &Fleet) -> Result<Placement, FleetError> {
    let choices = choices_of(fleet)?;
    match solve::solve(fleet, &choices) {
        Err(SolveError::Infeasible) => Err(binding_model(fleet, &choices)),
        other => other.map_err(FleetError::Solve),
    }
}

/// Virtual seconds of each slice's server that `--simulate` runs.
pub const SIMULATED_SECONDS: f64 = 60.0;

/// Reads `fleet.yaml`, plans it (and simulates the plan when asked), and writes the plan
/// into `output`.
pub fn plan_fleet(path: &Path, output: &Path, simulate: bool) -> Result<FleetPlan, FleetError> {
    let fleet = Fleet::load(path)?;
    let placement = place(&fleet)?;
    let mut plan = output::fleet_plan(&fleet, &placement);
    if simulate {
        let simulated = simulate::simulate(&fleet, &placement, SIMULATED_SECONDS, 0);
        plan.models.iter_mut().zip(simulated).for_each(|(m, s)| m.simulated = s);
    }
    output::write(&mut plan, &fleet, output).map_err(|error| FleetError::Write { dir: output.to_path_buf(), error })?;
    Ok(plan)
}

/// Each model's choices on each slice kind; a model with none anywhere is refused with the
/// nearest miss.
fn choices_of(fleet: &Fleet) -> Result<Choices, FleetError> {
    // Only the kinds some layout makes count.
    let made: std::collections::BTreeSet<usize> = fleet.gpus.iter().flat_map(|g| g.layouts.iter().flatten().copied()).collect();
    fleet
        .models
        .iter()
        .map(|model| {
            let per_kind: Vec<Option<Result<_, Unplaceable>>> =
                (0..fleet.slice_kinds.len()).map(|k| made.contains(&k).then(|| choices::best_choice(fleet, model, &fleet.slice_kinds[k]))).collect();
            if !per_kind.iter().flatten().any(Result::is_ok) {
                let why = per_kind.into_iter().flatten().filter_map(Result::err).reduce(Unplaceable::nearer).expect("some layout makes a slice");
                return Err(FleetError::Unplaceable { model: model.name.clone(), why });
            }
            let per_kind: Vec<_> = per_kind.into_iter().map(|c| c.and_then(Result::ok)).collect();
            let capacity = choices::fleet_capacity(fleet, &per_kind);
            if capacity < 1.0 {
                let why = Unplaceable::Throughput { capacity: capacity * model.rate, rate: model.rate };
                return Err(FleetError::Unplaceable { model: model.name.clone(), why });
            }
            Ok(per_kind)
        })
        .collect()
}

/// The first model, in the config's order, whose addition leaves no placement (each set of
/// models looked at within an equal part of the time limit).
fn binding_model(fleet: &Fleet, choices: &Choices) -> FleetError {
    let budget = fleet.time_limit / fleet.models.len() as u32;
    for n in 1..=fleet.models.len() {
        let fewer = Fleet { models: fleet.models[..n].to_vec(), ..fleet.clone() };
        if let Err(SolveError::Infeasible) = solve::feasible(&fewer, &choices[..n].to_vec(), budget) {
            let beside = fleet.models[..n - 1].iter().map(|m| m.name.clone()).collect();
            return FleetError::Capacity { model: fleet.models[n - 1].name.clone(), beside };
        }
    }
    FleetError::Solve(SolveError::Infeasible)
}

#[cfg(test)]
mod tests;
