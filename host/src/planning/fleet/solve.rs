//! The placement as an integer program, solved with `good_lp`'s pure-Rust `microlp`.
//!
//! Slices of one kind are alike, and so are GPUs with the same allowed layouts, so the
//! program counts them rather than naming each (naming each made a program of thousands of
//! binaries, mostly mirror images of one another, that `microlp` could not finish for ten
//! models on eight GPUs). A *pattern* is a set of models (at most `max_models_per_slice`,
//! each with its fastest choice there) whose memory fits one slice of a kind together.
//!
//! Variables: how many GPUs of each class take each layout (`gpus_in`); how many slices run
//! each pattern (`slices_of`); how many times its rate each model is planned for on each
//! pattern's slices together (`planned`), spread evenly over them; each model's planned
//! multiple of its rate `x = Σ planned >= 1`, so its headroom is `x - 1`.
//!
//! Constraints: the slices of a kind in use are at most those the layouts make; a pattern's
//! slices' load `Σ load_per_rate planned` stays within their number times the pattern's limit
//! (`max_utilisation`, and each member's `max_load`: their p95 targets through the queueing
//! model). Memory is the patterns' own.
//!
//! Objective: leximin over the models' headroom divided by their weights, as a sequence of
//! programs (Ogryczak and Śliwiński's ordered sums): the k-th maximises the sum of the k
//! smallest values, `k r - Σ max(0, r - v_m)`, with the sums found before held. It needs one
//! program a model; they share the time limit, and past it the best plan found so far is
//! kept and the plan says it is not proven optimal.

use std::time::{Duration, Instant};

use good_lp::{
    constraint, microlp, variable, Constraint, Expression, ProblemVariables, Solution, SolverModel, Variable, WithInitialSolution, WithMipGap,
    WithTimeLimit,
};

use super::choices::Choice;
use super::config::Fleet;
use super::queueing;

/// A model's choices per slice kind (empty where it cannot run there), best first.
pub type Choices = Vec<Vec<Option<Choice>>>;

/// The placement found.
#[derive(Debug, Clone)]
pub struct Placement {
    /// Each GPU's layout (an index into its allowed ones).
    pub layouts: Vec<usize>,
    /// Each slice the layouts make, with the models on it.
    pub slices: Vec<PlacedSlice>,
    /// Each model's headroom: how many times its rate it could take more (0.5: 50% more).
    pub headroom: Vec<f64>,
    /// Whether every program finished before the time limit (a proven leximin optimum).
    pub proven: bool,
    /// An upper bound on the smallest weighted headroom (the relaxation's, counts as
    /// fractions): how far from the best a plan cut short by the time limit may be.
    pub bound: f64,
    /// The solver's time, in all.
    pub solve_s: f64,
    /// How many programs were solved.
    pub programs: usize,
}

/// One slice and what runs on it.
#[derive(Debug, Clone, PartialEq)]
pub struct PlacedSlice {
    /// Its GPU (an index into the fleet's).
    pub gpu: usize,
    /// Its kind.
    pub kind: usize,
    /// The models on it.
    pub members: Vec<Member>,
}

/// A model on a slice.
#[derive(Debug, Clone, PartialEq)]
pub struct Member {
    /// The model (an index into the fleet's).
    pub model: usize,
    /// How it runs there.
    pub choice: Choice,
    /// The share of the model's requests this slice serves.
    pub share: f64,
}

/// Why no placement was found.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SolveError {
    /// No placement serves every model's rate.
    #[error("the GPUs cannot serve every model's rate within its target together")]
    Infeasible,
    /// The time limit passed before any placement was found.
    #[error("no placement found within the time limit of {0:?}")]
    TimedOut(Duration),
    /// The solver failed.
    #[error("the solver failed: {0}")]
    Solver(String),
}

/// Models that may share a slice of one kind.
#[derive(Debug, Clone)]
struct Pattern {
    kind: usize,
    models: Vec<usize>,
    /// The highest load its slices may take: the tightest of its members' targets.
    limit: f64,
}

/// GPUs with the same allowed layouts.
#[derive(Debug, Clone)]
struct Class {
    gpus: Vec<usize>,
}

/// The shape of the problem, shared by every program.
struct Shape<'a> {
    fleet: &'a Fleet,
    choices: &'a Choices,
    classes: Vec<Class>,
    patterns: Vec<Pattern>,
    /// Each model's highest possible rate multiple.
    most: Vec<f64>,
}

/// One program's variables.
struct Handles {
    gpus_in: Vec<Vec<Variable>>,
    slices_of: Vec<Variable>,
    /// `(pattern, model, variable)`.
    planned: Vec<(usize, usize, Variable)>,
    rate_multiple: Vec<Variable>,
    level: Vec<Variable>,
    shortfall: Vec<Vec<Variable>>,
}

/// The relative gap at which a program stops: its objective within 0.01% of the best possible.
const MIP_GAP: f32 = 1e-4;

/// What a program asks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// The ordered sum, counts as fractions: the relaxation, which bounds the program.
    Relaxed,
    /// Any placement at all, in whole counts: the start of the first program.
    Feasible,
    /// The ordered sum, in whole counts.
    Exact,
}

/// A placement's counts: GPUs in each layout, slices of each pattern.
#[derive(Debug, Clone)]
struct Counts {
    gpus_in: Vec<Vec<f64>>,
    slices_of: Vec<f64>,
}

/// The values of a program's placement.
#[derive(Debug, Clone)]
struct Values {
    gpus_in: Vec<Vec<f64>>,
    slices_of: Vec<f64>,
    /// `(pattern, model, planned)`.
    planned: Vec<(usize, usize, f64)>,
    rate_multiple: Vec<f64>,
}

/// Places the models: leximin over their weighted headroom.
pub fn solve(fleet: &Fleet, choices: &Choices) -> Result<Placement, SolveError> {
    let shape = Shape::new(fleet, choices);
    let started = Instant::now();
    let deadline = started + fleet.time_limit;
    // The relaxation (counts as fractions) bounds the smallest weighted headroom from above:
    // how far from the best a plan cut short by the time limit may be.
    let (bound, _) = shape.program(&[], None, fleet.time_limit, Mode::Relaxed)?;
    let models = fleet.models.len();
    let (mut sums, mut values, mut proven) = (Vec::new(), None::<Values>, true);
    let mut k = 1;
    while k <= models {
        // The first program finds the first plan, the hardest part: it may take half the time.
        let left = deadline.saturating_duration_since(Instant::now());
        let budget = if k == 1 { left / 2 } else { left / (models - k + 1) as u32 };
        let took = Instant::now();
        match shape.program(&sums, values.as_ref().map(Values::counts).as_ref(), budget, Mode::Exact) {
            Ok((sum, found)) => {
                proven &= took.elapsed() < budget.mul_f64(0.98);
                sums.push(sum);
                values = Some(found);
                k += 1;
            }
            // A later program out of time (or failing on its held sums' rounding), or the first
            // again: keep the plan found before.
            Err(_) if values.is_some() => {
                proven = false;
                break;
            }
            // No plan yet: any placement is quicker to find than a good one, so look for one
            // and start the first program again from it.
            Err(SolveError::TimedOut(_)) => {
                proven = false;
                let budget = deadline.saturating_duration_since(Instant::now()) / 2;
                let (_, found) = shape.program(&[], None, budget, Mode::Feasible).map_err(|e| match e {
                    SolveError::TimedOut(_) => SolveError::TimedOut(fleet.time_limit),
                    other => other,
                })?;
                values = Some(found);
            }
            Err(other) => return Err(other),
        }
    }
    let values = values.expect("at least one model");
    let mut placement = shape.placement(&values, proven, started.elapsed().as_secs_f64(), sums.len());
    placement.bound = bound;
    Ok(placement)
}

/// Whether any placement serves every model's rate, looked for within `budget`.
pub fn feasible(fleet: &Fleet, choices: &Choices, budget: Duration) -> Result<(), SolveError> {
    Shape::new(fleet, choices).program(&[], None, budget, Mode::Feasible).map(|_| ())
}

impl Values {
    /// Its counts, to start the next program from.
    fn counts(&self) -> Counts {
        Counts { gpus_in: self.gpus_in.clone(), slices_of: self.slices_of.clone() }
    }
}

impl<'a> Shape<'a> {
    fn new(fleet: &'a Fleet, choices: &'a Choices) -> Self {
        let mut classes: Vec<Class> = Vec::new();
        for (g, gpu) in fleet.gpus.iter().enumerate() {
            match classes.iter_mut().find(|c| fleet.gpus[c.gpus[0]].layouts == gpu.layouts) {
                Some(class) => class.gpus.push(g),
                None => classes.push(Class { gpus: vec![g] }),
            }
        }
        let patterns = (0..fleet.slice_kinds.len()).flat_map(|kind| patterns_of(fleet, choices, kind)).collect();
        let most = choices.iter().map(|per_kind| super::choices::fleet_capacity(fleet, per_kind).max(1.0)).collect();
        Self { fleet, choices, classes, patterns, most }
    }

    fn choice(&self, model: usize, kind: usize) -> &Choice {
        self.choices[model][kind].as_ref().expect("a pattern's models have a choice on its kind")
    }

    /// Solves the k-th program (`k = held.len() + 1`): the sum of the k smallest weighted
    /// headrooms, with the sums `held` of the programs before.
    fn program(&self, held: &[f64], hint: std::option::Option<&Counts>, budget: Duration, mode: Mode) -> Result<(f64, Values), SolveError> {
        let k = held.len() + 1;
        let mut vars = ProblemVariables::new();
        let v = self.variables(&mut vars, k, mode);
        let mut constraints = self.placement_constraints(&v);
        let sums: Vec<Expression> = (0..k).map(|j| self.ordered_sum(&v, j, &mut constraints)).collect();
        for (j, &sum) in held.iter().enumerate() {
            let slack = 1e-6 * sum.abs().max(1.0);
            constraints.push(constraint!(sums[j].clone() >= sum - slack));
        }
        let objective = if mode == Mode::Feasible { Expression::from(0.0) } else { sums[k - 1].clone() };
        let mut problem = vars
            .maximise(objective.clone())
            .using(microlp)
            .with_time_limit(budget.as_secs_f64().max(0.01))
            .with_mip_gap(MIP_GAP)
            .map_err(|e| SolveError::Solver(e.to_string()))?;
        if let Some(hint) = hint {
            // The counts alone: the solver completes the rest.
            let counts = v.gpus_in.iter().flatten().zip(hint.gpus_in.iter().flatten()).chain(v.slices_of.iter().zip(&hint.slices_of));
            problem = problem.with_initial_solution(counts.map(|(&var, &n)| (var, n.round())));
        }
        for c in constraints {
            problem = problem.with(c);
        }
        let solution = problem.solve().map_err(|e| match e {
            good_lp::ResolutionError::Infeasible => SolveError::Infeasible,
            good_lp::ResolutionError::Other(_) => SolveError::TimedOut(budget),
            other => SolveError::Solver(other.to_string()),
        })?;
        Ok((solution.eval(&objective), self.values(&v, &solution)))
    }

    /// Every variable of the k-th program.
    fn variables(&self, vars: &mut ProblemVariables, k: usize, mode: Mode) -> Handles {
        let fleet = self.fleet;
        let count = |most: f64| {
            let v = variable().min(0).max(most);
            if mode == Mode::Relaxed {
                v
            } else {
                v.integer()
            }
        };
        let gpus_in =
            self.classes.iter().map(|c| fleet.gpus[c.gpus[0]].layouts.iter().map(|_| vars.add(count(c.gpus.len() as f64))).collect()).collect();
        let slices_of = self.patterns.iter().map(|p| vars.add(count(self.slices_made_at_most(p.kind)))).collect();
        let planned = self
            .patterns
            .iter()
            .enumerate()
            .flat_map(|(i, p)| p.models.iter().map(move |&m| (i, m)))
            .map(|(i, m)| (i, m, vars.add(variable().min(0.0).max(self.most[m]))))
            .collect();
        let rate_multiple = self.most.iter().map(|&most| vars.add(variable().min(1.0).max(most))).collect();
        let top = fleet.models.iter().zip(&self.most).map(|(m, most)| (most - 1.0) / m.weight).fold(0.0, f64::max);
        let level = (0..k).map(|_| vars.add(variable().min(0.0).max(top))).collect();
        let shortfall = (0..k).map(|_| fleet.models.iter().map(|_| vars.add(variable().min(0.0).max(top))).collect()).collect();
        Handles { gpus_in, slices_of, planned, rate_multiple, level, shortfall }
    }

    /// The most slices of `kind` the GPUs can make.
    fn slices_made_at_most(&self, kind: usize) -> f64 {
        self.fleet.gpus.iter().map(|g| g.layouts.iter().map(|l| l.iter().filter(|&&k| k == kind).count()).max().unwrap_or(0)).sum::<usize>() as f64
    }

    /// The placement's rules: layouts, slices in use, loads, rates.
    fn placement_constraints(&self, v: &Handles) -> Vec<Constraint> {
        let fleet = self.fleet;
        let mut c = Vec::new();
        for (class, counts) in self.classes.iter().zip(&v.gpus_in) {
            c.push(constraint!(counts.iter().copied().sum::<Expression>() == class.gpus.len() as f64));
        }
        for kind in 0..fleet.slice_kinds.len() {
            let made: Expression = self
                .classes
                .iter()
                .zip(&v.gpus_in)
                .flat_map(|(class, counts)| {
                    fleet.gpus[class.gpus[0]].layouts.iter().zip(counts).map(move |(l, &n)| l.iter().filter(|&&k| k == kind).count() as f64 * n)
                })
                .sum();
            let used: Expression = self.patterns.iter().zip(&v.slices_of).filter(|(p, _)| p.kind == kind).map(|(_, &n)| n).sum();
            c.push(constraint!(used <= made));
        }
        for (i, pattern) in self.patterns.iter().enumerate() {
            let load: Expression = v.planned.iter().filter(|(p, ..)| *p == i).map(|&(_, m, z)| self.choice(m, pattern.kind).load_per_rate * z).sum();
            c.push(constraint!(load <= pattern.limit * v.slices_of[i]));
        }
        for (m, &x) in v.rate_multiple.iter().enumerate() {
            let planned: Expression = v.planned.iter().filter(|(_, model, _)| *model == m).map(|&(.., z)| z).sum();
            c.push(constraint!(planned == x));
        }
        c
    }

    /// The j-th ordered sum (of the j+1 smallest weighted headrooms), with its constraints.
    fn ordered_sum(&self, v: &Handles, j: usize, c: &mut Vec<Constraint>) -> Expression {
        for (m, model) in self.fleet.models.iter().enumerate() {
            let value = (v.rate_multiple[m] - 1.0) / model.weight;
            c.push(constraint!(v.shortfall[j][m] >= v.level[j] - value));
        }
        (j + 1) as f64 * v.level[j] - v.shortfall[j].iter().copied().sum::<Expression>()
    }

    fn values(&self, v: &Handles, s: &impl Solution) -> Values {
        let all = |vs: &[Variable]| vs.iter().map(|&x| s.value(x)).collect::<Vec<f64>>();
        Values {
            gpus_in: v.gpus_in.iter().map(|n| all(n)).collect(),
            slices_of: all(&v.slices_of),
            planned: v.planned.iter().map(|&(p, m, z)| (p, m, s.value(z))).collect(),
            rate_multiple: all(&v.rate_multiple),
        }
    }

    /// The placement the counts describe: each class's GPUs take their layouts in order, each
    /// pattern's slices are the next free slices of its kind.
    fn placement(&self, v: &Values, proven: bool, solve_s: f64, programs: usize) -> Placement {
        let fleet = self.fleet;
        let mut layouts = vec![0; fleet.gpus.len()];
        for (class, counts) in self.classes.iter().zip(&v.gpus_in) {
            let mut gpus = class.gpus.iter();
            for (l, &n) in counts.iter().enumerate() {
                gpus.by_ref().take(n.round() as usize).for_each(|&g| layouts[g] = l);
            }
        }
        let mut slices: Vec<PlacedSlice> = fleet
            .gpus
            .iter()
            .zip(&layouts)
            .enumerate()
            .flat_map(|(g, (gpu, &l))| gpu.layouts[l].iter().map(move |&kind| PlacedSlice { gpu: g, kind, members: Vec::new() }))
            .collect();
        let planned = &v.planned;
        for (i, pattern) in self.patterns.iter().enumerate() {
            let count = v.slices_of[i].round() as usize;
            let free = slices.iter_mut().filter(|s| s.kind == pattern.kind && s.members.is_empty());
            for slice in free.take(count) {
                slice.members = planned
                    .iter()
                    .filter(|&&(p, m, z)| p == i && z > 1e-6 * v.rate_multiple[m])
                    .map(|&(_, m, z)| Member { model: m, choice: self.choice(m, pattern.kind).clone(), share: z / count as f64 / v.rate_multiple[m] })
                    .collect();
            }
        }
        let headroom = v.rate_multiple.iter().map(|x| x - 1.0).collect();
        Placement { layouts, slices, headroom, proven, bound: f64::INFINITY, solve_s, programs }
    }
}

/// Every set of at most `max_models_per_slice` models with a choice on `kind` whose memory
/// fits one slice, each within its target behind the others' batches, and, for two or more,
/// whose whole rates fit it together: sharing is for models too small to fill a slice (a
/// larger one takes slices of its own, and shares only through them), and leaving out the
/// sets that cannot even carry their rates keeps the program small.
fn patterns_of(fleet: &Fleet, choices: &Choices, kind: usize) -> Vec<Pattern> {
    let slice = &fleet.slice_kinds[kind];
    let room = slice.memory_bytes - fleet.context_bytes;
    let here: Vec<(usize, &Choice)> = (0..fleet.models.len()).filter_map(|m| choices[m][kind].as_ref().map(|c| (m, c))).collect();
    let mut patterns = Vec::new();
    let mut stack: Vec<(Vec<(usize, &Choice)>, usize)> = vec![(Vec::new(), 0)];
    while let Some((members, next)) = stack.pop() {
        if let Some(limit) = pattern_limit(fleet, &members).filter(|_| !members.is_empty()) {
            patterns.push(Pattern { kind, models: members.iter().map(|&(m, _)| m).collect(), limit });
        }
        if members.len() == fleet.max_models_per_slice {
            continue;
        }
        let memory: f64 = members.iter().map(|(_, c)| c.memory_bytes).sum();
        for (i, &(m, c)) in here.iter().enumerate().skip(next) {
            let more = [members.as_slice(), &[(m, c)]].concat();
            let load: f64 = more.iter().map(|(_, c)| c.load_per_rate).sum();
            let carried = members.is_empty() || pattern_limit(fleet, &more).is_some_and(|limit| load <= limit);
            if memory + c.memory_bytes <= room && carried {
                stack.push((more, i + 1));
            }
        }
    }
    patterns
}

/// The highest load a slice running `members` may take: within `max_utilisation` and every
/// member's target, each waiting behind the mix of all their batches (at their whole rates);
/// `None` when some member misses its target even on an idle slice.
fn pattern_limit(fleet: &Fleet, members: &[(usize, &Choice)]) -> Option<f64> {
    let batches = members.iter().map(|&(m, c)| (c.service_ms, fleet.models[m].rate / f64::from(c.batch)));
    let residual = queueing::residual_ms(batches);
    members.iter().try_fold(fleet.max_utilisation, |limit, &(m, c)| c.max_load_beside(fleet.models[m].p95_ms, residual, limit))
}
