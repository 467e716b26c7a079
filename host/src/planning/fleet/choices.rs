//! The ways one model can run on one slice kind: for each usable cut and measured batch size
//! that its edges' links, the slice's memory and the model's p95 target allow, what it costs
//! the slice. The solver picks among the best of them; when none is left on any kind, the
//! check that ruled out the nearest one is what the plan reports.

use super::config::{Fleet, FleetModel, SliceKind};
use super::queueing;

/// One way to run a model on a slice of one kind.
#[derive(Debug, Clone, PartialEq)]
pub struct Choice {
    /// The split: the edges run stages `[0, cut)`.
    pub cut: usize,
    /// The batch the server merges requests into.
    pub batch: u32,
    /// How long a request waits for its batch to fill, milliseconds (the server's
    /// `batching.max_wait_ms`): the time the model's rate takes to bring `batch` requests.
    pub max_wait_ms: u64,
    /// One batch on the slice, milliseconds.
    pub service_ms: f64,
    /// The slowest edge class's prefix, round trip and transfers, milliseconds.
    pub fixed_ms: f64,
    /// The share of the slice's time the model's whole rate takes.
    pub load_per_rate: f64,
    /// The slice's load at which the model's p95 reaches its target.
    pub max_load: f64,
    /// What it holds in the slice's memory, bytes.
    pub memory_bytes: f64,
}

impl Choice {
    /// How many times its rate the model could take alone on the slice.
    pub fn capacity(&self) -> f64 {
        self.max_load / self.load_per_rate
    }

    /// Its p95 on a slice busy `load` of the time with batches of residual time
    /// `residual_ms`, milliseconds.
    pub fn p95_ms(&self, residual_ms: f64, load: f64) -> f64 {
        queueing::p95_ms(self.fixed_ms, self.max_wait_ms as f64, self.service_ms, residual_ms, load)
    }

    /// Its highest load of a slice with batches of residual time `residual_ms`, within its
    /// target and `cap`.
    pub fn max_load_beside(&self, target_ms: f64, residual_ms: f64, cap: f64) -> Option<f64> {
        queueing::max_load(target_ms, self.fixed_ms, self.max_wait_ms as f64, self.service_ms, residual_ms, cap)
    }
}

/// Why a model cannot be placed, the check that ruled out its nearest choice first.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Unplaceable {
    /// No cut of its profile is usable.
    #[error("no usable cut in its profile")]
    NoUsableCut,
    /// Its edges' links are too slow for its rate at every cut.
    #[error(
        "link: edges {edges:?} would send {needed_mbps:.1} Mbit/s at the leanest cut ({cut}), above {max_mbps:.1} Mbit/s ({share:.0}% of their link)"
    )]
    Link {
        /// The edge class.
        edges: String,
        /// The leanest cut.
        cut: usize,
        /// What one edge would send.
        needed_mbps: f64,
        /// What it may send.
        max_mbps: f64,
        /// `max_link_utilisation`, percent.
        share: f64,
    },
    /// Its server stages fit no slice.
    #[error("memory: its server stages need at least {needed_gb:.2} GB (cut {cut}, batch 1), above the largest slice's {have_gb:.2} GB less the process's own")]
    Memory {
        /// The cut needing least.
        cut: usize,
        /// What it needs.
        needed_gb: f64,
        /// What the largest slice leaves.
        have_gb: f64,
    },
    /// Even on an idle slice the target is missed.
    #[error("p95: at best {best_ms:.1} ms on an idle {kind} (cut {cut}, batch {batch}), above its target of {target_ms:.1} ms")]
    Latency {
        /// The fastest slice kind.
        kind: String,
        /// The best cut.
        cut: usize,
        /// Its batch.
        batch: u32,
        /// The best p95.
        best_ms: f64,
        /// The target.
        target_ms: f64,
    },
    /// All the GPUs together cannot serve its rate within the target.
    #[error("throughput: at most {capacity:.1} requests/s on all the GPUs within its p95 target, below its rate of {rate:.1}")]
    Throughput {
        /// The most they serve.
        capacity: f64,
        /// Its rate.
        rate: f64,
    },
}

impl Unplaceable {
    /// How far a choice got through the checks (a later check is a nearer miss).
    fn rank(&self) -> u8 {
        match self {
            Self::NoUsableCut => 0,
            Self::Link { .. } => 1,
            Self::Memory { .. } => 2,
            Self::Latency { .. } => 3,
            Self::Throughput { .. } => 4,
        }
    }

    /// The nearer miss of two.
    pub fn nearer(self, other: Self) -> Self {
        let better = match (&self, &other) {
            (Self::Link { needed_mbps: a, .. }, Self::Link { needed_mbps: b, .. }) => a <= b,
            // The same model on another kind: the largest slice says how far it is.
            (Self::Memory { needed_gb: a, have_gb: x, .. }, Self::Memory { needed_gb: b, have_gb: y, .. }) => (a - x) <= (b - y),
            (Self::Latency { best_ms: a, .. }, Self::Latency { best_ms: b, .. }) => a <= b,
            (Self::Throughput { capacity: a, .. }, Self::Throughput { capacity: b, .. }) => a >= b,
            _ => self.rank() >= other.rank(),
        };
        if better {
            self
        } else {
            other
        }
    }
}

/// The choice the solver is given for `model` on slices of `kind`: the one that takes the
/// most of the model's rate (even less than all of it: several slices may share the rate).
pub fn best_choice(fleet: &Fleet, model: &FleetModel, kind: &SliceKind) -> Result<Choice, Unplaceable> {
    let mut miss = Unplaceable::NoUsableCut;
    let mut feasible = Vec::new();
    let profile = &model.profile;
    for cut in cuts_within_links(fleet, model, &mut miss) {
        // The server merges requests only at a batchable cut (a batch-first boundary and
        // output): elsewhere each runs alone.
        let batches = if profile.cuts[cut].batchable { profile.batches.len() } else { 1 };
        for batch in 0..batches {
            match choice(fleet, model, kind, cut, batch) {
                Ok(c) => feasible.push(c),
                Err(why) => miss = miss.nearer(why),
            }
        }
    }
    feasible.into_iter().max_by(|a, b| a.capacity().total_cmp(&b.capacity())).ok_or(miss)
}

/// The usable cuts (the server running at least one stage) whose bytes every edge's link
/// carries at the model's rate; the leanest cut's excess noted in `miss` when one does not.
fn cuts_within_links(fleet: &Fleet, model: &FleetModel, miss: &mut Unplaceable) -> Vec<usize> {
    let profile = &model.profile;
    let per_edge_rate = model.rate / f64::from(model.edge_count());
    let mut cuts = Vec::new();
    for cut in (0..profile.stages.len()).filter(|&c| profile.cuts[c].usable) {
        let bytes = profile.cuts[cut].wire_bytes.max(profile.result_bytes());
        let over = model.edges.iter().find(|e| per_edge_rate * bytes > fleet.max_link_utilisation * e.bytes_per_s);
        match over {
            None => cuts.push(cut),
            Some(edges) => {
                let why = Unplaceable::Link {
                    edges: edges.name.clone(),
                    cut,
                    needed_mbps: per_edge_rate * bytes * 8.0 / 1e6,
                    max_mbps: fleet.max_link_utilisation * edges.bytes_per_s * 8.0 / 1e6,
                    share: fleet.max_link_utilisation * 100.0,
                };
                *miss = std::mem::replace(miss, Unplaceable::NoUsableCut).nearer(why);
            }
        }
    }
    cuts
}

/// The longest `batching.max_wait_ms` the server takes.
const MAX_WAIT_MS: u64 = 10_000;

/// How long `rate` requests a second take to bring a batch of `samples`, in the server's
/// whole milliseconds: a batch's `max_wait_ms`. (A slice given part of a model's rate gets
/// the same wait, so that the target holds; its batches then fill less on average.)
fn fill_ms(samples: u32, rate: f64) -> u64 {
    (f64::from(samples - 1) / rate * 1000.0).ceil() as u64
}

/// The model at `cut` with the `batch`-th measured batch size on a slice of `kind`.
fn choice(fleet: &Fleet, model: &FleetModel, kind: &SliceKind, cut: usize, batch: usize) -> Result<Choice, Unplaceable> {
    let profile = &model.profile;
    let samples = profile.batches[batch];
    let memory_bytes = profile.server_bytes(cut, samples);
    let room = kind.memory_bytes - fleet.context_bytes;
    if memory_bytes > room {
        return Err(Unplaceable::Memory { cut, needed_gb: profile.server_bytes(cut, 1) / 1e9, have_gb: room / 1e9 });
    }
    let service_ms = profile.batch_ms(cut, samples, kind.compute);
    let fixed_ms = model.edges.iter().map(|e| fixed_ms(model, e, cut)).fold(0.0, f64::max);
    let max_wait_ms = fill_ms(samples, model.rate);
    let within = max_wait_ms <= MAX_WAIT_MS;
    let Some(max_load) =
        queueing::max_load(model.p95_ms, fixed_ms, max_wait_ms as f64, service_ms, service_ms, fleet.max_utilisation).filter(|_| within)
    else {
        let best_ms = queueing::p95_ms(fixed_ms, max_wait_ms as f64, service_ms, service_ms, 0.0);
        return Err(Unplaceable::Latency { kind: kind.name.clone(), cut, batch: samples, best_ms, target_ms: model.p95_ms });
    };
    let load_per_rate = model.rate * service_ms / 1000.0 / f64::from(samples);
    Ok(Choice { cut, batch: samples, max_wait_ms, service_ms, fixed_ms, load_per_rate, max_load, memory_bytes })
}

/// The most times its rate a model could take on all the GPUs, alone: each GPU in its best
/// layout for it, each slice with its best choice.
pub fn fleet_capacity(fleet: &Fleet, per_kind: &[Option<Choice>]) -> f64 {
    let best = |kind: usize| per_kind[kind].as_ref().map_or(0.0, Choice::capacity);
    fleet.gpus.iter().map(|gpu| gpu.layouts.iter().map(|l| l.iter().map(|&k| best(k)).sum::<f64>()).fold(0.0, f64::max)).sum()
}

/// An edge's part of a request's latency at `cut`: its prefix, a round trip, the boundary up
/// and the result down.
fn fixed_ms(model: &FleetModel, edges: &super::config::EdgeClass, cut: usize) -> f64 {
    let bytes = model.profile.cuts[cut].wire_bytes + model.profile.result_bytes();
    edges.profile.prefix_ms(cut) + edges.rtt_ms + bytes / edges.bytes_per_s * 1000.0
}
