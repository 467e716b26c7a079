//! What a fleet plan says: a table, `fleet-plan.json`, each GPU's MIG commands (printed,
//! never run), a `server.yaml` per slice, and each model's split for its edges.

use std::path::{Path, PathBuf};

use serde::Serialize;

use super::config::Fleet;
use super::solve::Placement;

/// The plan, as `fleet-plan.json` holds it.
#[derive(Debug, Clone, Serialize)]
pub struct FleetPlan {
    /// Whether the solver proved the leximin optimum (false: the best found in the time limit).
    pub proven_optimal: bool,
    /// The solver's time, seconds.
    pub solve_s: f64,
    /// Programs solved (one a model).
    pub programs: usize,
    /// The smallest headroom divided by its model's weight.
    pub min_weighted_headroom: f64,
    /// An upper bound on it (the relaxation's).
    pub min_weighted_headroom_bound: f64,
    /// Each GPU.
    pub gpus: Vec<GpuPlan>,
    /// Each slice in use or made.
    pub slices: Vec<SlicePlan>,
    /// Each model.
    pub models: Vec<ModelPlan>,
}

/// A GPU's layout and the commands that would make it.
#[derive(Debug, Clone, Serialize)]
pub struct GpuPlan {
    /// Its name.
    pub name: String,
    /// Its `nvidia-smi` index.
    pub index: u32,
    /// Its slices' kinds.
    pub layout: Vec<String>,
    /// The `nvidia-smi` commands that would make the layout (never run by cleave).
    pub mig_commands: Vec<String>,
}

/// A slice and its models.
#[derive(Debug, Clone, Serialize)]
pub struct SlicePlan {
    /// `GPU/n-KIND`.
    pub name: String,
    /// Its kind.
    pub kind: String,
    /// The share of its time the models' rates take.
    pub load: f64,
    /// The memory they hold, GB (the process's own included).
    pub memory_gb: f64,
    /// Its server's config, when a model runs on it.
    pub server_config: Option<PathBuf>,
    /// The models on it.
    pub models: Vec<SliceModel>,
}

/// A model on a slice.
#[derive(Debug, Clone, Serialize)]
pub struct SliceModel {
    /// The model.
    pub model: String,
    /// Its split there.
    pub split: usize,
    /// The server's `batching.max_batch`.
    pub max_batch: u32,
    /// The server's `batching.max_wait_ms`.
    pub max_wait_ms: u64,
    /// The share of its requests sent here.
    pub share: f64,
    /// Its predicted p95 here, milliseconds (the queueing model).
    pub p95_ms: f64,
}

/// A model's place in the plan.
#[derive(Debug, Clone, Serialize)]
pub struct ModelPlan {
    /// Its name.
    pub name: String,
    /// Its rate, requests per second.
    pub rate: f64,
    /// Its target.
    pub p95_target_ms: f64,
    /// Its predicted p95 where it is slowest, milliseconds.
    pub p95_ms: f64,
    /// How many times its rate it could take more, within its target.
    pub headroom: f64,
    /// Its weight in the fairness.
    pub weight: f64,
    /// Where its edges send their requests.
    pub routes: Vec<Route>,
    /// Its latencies in the simulation of the plan (`--simulate`).
    pub simulated: Option<super::simulate::Simulated>,
}

/// Where some of a model's edges send: the slice's server and the split to use.
#[derive(Debug, Clone, Serialize)]
pub struct Route {
    /// The slice.
    pub slice: String,
    /// The split the edges use (`split:` in their edge.yaml).
    pub split: usize,
    /// The share of the model's requests.
    pub share: f64,
    /// The edges of each class sent here (the class's edges shared out by the shares).
    pub edges: Vec<(String, u32)>,
}

/// The plan of a placement.
pub fn fleet_plan(fleet: &Fleet, placement: &Placement) -> FleetPlan {
    let gpus = fleet
        .gpus
        .iter()
        .zip(&placement.layouts)
        .map(|(gpu, &l)| {
            let layout: Vec<String> = gpu.layouts[l].iter().map(|&k| fleet.slice_kinds[k].name.clone()).collect();
            let mig = gpu.layouts[l].iter().all(|&k| fleet.slice_kinds[k].mig);
            GpuPlan { name: gpu.name.clone(), index: gpu.index, mig_commands: mig_commands(gpu.index, mig, &layout), layout }
        })
        .collect();
    let slices = slice_plans(fleet, placement);
    let models = fleet
        .models
        .iter()
        .enumerate()
        .map(|(m, model)| {
            let here: Vec<(&SlicePlan, &SliceModel)> =
                slices.iter().flat_map(|s| s.models.iter().filter(|sm| sm.model == model.name).map(move |sm| (s, sm))).collect();
            let routes = routes(model, &here);
            ModelPlan {
                name: model.name.clone(),
                rate: model.rate,
                p95_target_ms: model.p95_ms,
                p95_ms: here.iter().map(|(_, sm)| sm.p95_ms).fold(0.0, f64::max),
                headroom: placement.headroom[m],
                weight: model.weight,
                routes,
                simulated: None,
            }
        })
        .collect();
    let min_weighted_headroom = fleet.models.iter().zip(&placement.headroom).map(|(m, h)| h / m.weight).fold(f64::INFINITY, f64::min);
    FleetPlan {
        proven_optimal: placement.proven,
        solve_s: placement.solve_s,
        programs: placement.programs,
        min_weighted_headroom,
        min_weighted_headroom_bound: placement.bound,
        gpus,
        slices,
        models,
    }
}

/// The commands that would give GPU `index` its layout: MIG off for a whole GPU; else MIG
/// on, its instances removed, and the new ones made with their compute instances.
fn mig_commands(index: u32, mig: bool, layout: &[String]) -> Vec<String> {
    if !mig {
        return vec![format!("nvidia-smi -i {index} -mig 0")];
    }
    vec![
        format!("nvidia-smi -i {index} -mig 1"),
        format!("nvidia-smi mig -i {index} -dci"),
        format!("nvidia-smi mig -i {index} -dgi"),
        format!("nvidia-smi mig -i {index} -cgi {} -C", layout.join(",")),
    ]
}

fn slice_plans(fleet: &Fleet, placement: &Placement) -> Vec<SlicePlan> {
    let mut nth = vec![0usize; fleet.gpus.len()];
    placement
        .slices
        .iter()
        .map(|slice| {
            let kind = &fleet.slice_kinds[slice.kind];
            let name = format!("{}/{}-{}", fleet.gpus[slice.gpu].name, nth[slice.gpu], kind.name);
            nth[slice.gpu] += 1;
            let load: f64 = slice.members.iter().map(|m| m.choice.load_per_rate * m.share).sum();
            let batches = slice.members.iter().map(|m| (m.choice.service_ms, fleet.models[m.model].rate * m.share / f64::from(m.choice.batch)));
            let residual = super::queueing::residual_ms(batches);
            let memory = fleet.context_bytes + slice.members.iter().map(|m| m.choice.memory_bytes).sum::<f64>();
            let models = slice
                .members
                .iter()
                .map(|m| SliceModel {
                    model: fleet.models[m.model].name.clone(),
                    split: m.choice.cut,
                    max_batch: m.choice.batch,
                    max_wait_ms: m.choice.max_wait_ms,
                    share: m.share,
                    p95_ms: m.choice.p95_ms(residual, load),
                })
                .collect();
            SlicePlan { name, kind: kind.name.clone(), load, memory_gb: memory / 1e9, server_config: None, models }
        })
        .collect()
}

/// The model's routes, its edges shared out by the routes' shares (largest remainders).
fn routes(model: &super::config::FleetModel, here: &[(&SlicePlan, &SliceModel)]) -> Vec<Route> {
    let mut routes: Vec<Route> =
        here.iter().map(|(s, sm)| Route { slice: s.name.clone(), split: sm.split, share: sm.share, edges: Vec::new() }).collect();
    for class in &model.edges {
        let exact: Vec<f64> = routes.iter().map(|r| r.share * f64::from(class.count)).collect();
        let mut given: Vec<u32> = exact.iter().map(|e| e.floor() as u32).collect();
        let mut order: Vec<usize> = (0..routes.len()).collect();
        order.sort_by(|&a, &b| (exact[b] - exact[b].floor()).total_cmp(&(exact[a] - exact[a].floor())));
        let left = class.count - given.iter().sum::<u32>();
        for &r in order.iter().take(left as usize) {
            given[r] += 1;
        }
        for (route, n) in routes.iter_mut().zip(given) {
            if n > 0 {
                route.edges.push((class.name.clone(), n));
            }
        }
    }
    routes
}

/// Writes `fleet-plan.json` and a `server.yaml` per slice with models into `dir`.
pub fn write(plan: &mut FleetPlan, fleet: &Fleet, dir: &Path) -> std::io::Result<PathBuf> {
    std::fs::create_dir_all(dir)?;
    for (n, slice) in plan.slices.iter_mut().enumerate().filter(|(_, s)| !s.models.is_empty()) {
        let path = dir.join(format!("server-{}.yaml", slice.name.replace('/', "-")));
        std::fs::write(&path, server_yaml(fleet, slice, 50051 + n as u32))?;
        slice.server_config = Some(path);
    }
    let path = dir.join("fleet-plan.json");
    std::fs::write(&path, serde_json::to_vec_pretty(plan).map_err(std::io::Error::other)?)?;
    Ok(path)
}

/// A slice's server config: its models, batched as planned, with their targets.
fn server_yaml(fleet: &Fleet, slice: &SlicePlan, port: u32) -> String {
    let mut text = format!(
        "# Planned by `host plan --fleet`: slice {} ({}).\n\
         # Start it with CUDA_VISIBLE_DEVICES set to this slice's MIG device (`nvidia-smi -L` lists them).\n\
         # Edges on other machines reach it: TLS and a token, from files in secrets/ beside this\n\
         # file (a Kubernetes Secret, say; `server dev-secrets secrets` writes ones for trying it).\n\
         listen: 0.0.0.0:{port}\n\
         tls: {{cert: secrets/server.pem, key: secrets/server.key}}\n\
         auth: {{token: {{file: secrets/token}}}}\n\
         models:\n",
        slice.name, slice.kind
    );
    for sm in &slice.models {
        let model = fleet.models.iter().find(|m| m.name == sm.model).expect("a planned model is the fleet's");
        text += &format!(
            "  - bundle: {}\n    device: cuda:0\n    batching: {{max_batch: {}, max_wait_ms: {}}}\n    slo_ms: {}\n",
            // Absolute and quoted: the server reads paths relative to its config's folder.
            serde_json::Value::from(std::path::absolute(&model.bundle).unwrap_or_else(|_| model.bundle.clone()).display().to_string()),
            sm.max_batch,
            sm.max_wait_ms,
            model.p95_ms.ceil() as u64
        );
    }
    text + "scheduler: {policy: edf, max_age_ms: 2000}\n"
}

impl std::fmt::Display for FleetPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut table = comfy_table::Table::new();
        table.load_preset(comfy_table::presets::UTF8_FULL_CONDENSED);
        let simulated = self.models.iter().any(|m| m.simulated.is_some());
        let mut header = vec!["model", "rate/s", "p95 target ms", "p95 predicted ms", "headroom", "slices (split, batch, share)"];
        if simulated {
            header.extend(["simulated p50 ms", "simulated p95 ms"]);
        }
        table.set_header(header);
        for m in &self.models {
            let routes: Vec<String> = self
                .slices
                .iter()
                .flat_map(|s| {
                    s.models
                        .iter()
                        .filter(|sm| sm.model == m.name)
                        .map(move |sm| format!("{} (split {}, batch {}, {:.0}%)", s.name, sm.split, sm.max_batch, sm.share * 100.0))
                })
                .collect();
            let mut row = vec![
                m.name.clone(),
                format!("{:.1}", m.rate),
                format!("{:.1}", m.p95_target_ms),
                format!("{:.1}", m.p95_ms),
                format!("{:+.0}%", m.headroom * 100.0),
                routes.join("\n"),
            ];
            if simulated {
                let (p50, p95) = m.simulated.as_ref().map_or(("-".into(), "-".into()), |s| (format!("{:.1}", s.p50_ms), format!("{:.1}", s.p95_ms)));
                row.extend([p50, p95]);
            }
            table.add_row(row);
        }
        writeln!(f, "{table}")?;
        for gpu in &self.gpus {
            writeln!(f, "{}: {}", gpu.name, gpu.layout.join(" + "))?;
            for command in &gpu.mig_commands {
                writeln!(f, "    {command}")?;
            }
        }
        let how = if self.proven_optimal { "leximin optimum" } else { "best found within the time limit, not proven optimal" };
        write!(
            f,
            "fleet: {} models on {} GPUs, {how}, smallest weighted headroom {:.3} (at most {:.3}), solved in {:.2} s ({} programs)",
            self.models.len(),
            self.gpus.len(),
            self.min_weighted_headroom,
            self.min_weighted_headroom_bound,
            self.solve_s,
            self.programs
        )
    }
}
