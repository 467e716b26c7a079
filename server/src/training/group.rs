//! Several edges training one server part together (`OpenSession.clients`): the sessions of
//! a group share one copy of the stages and its optimizer ([`SharedPart`]), and take their
//! steps in an order fixed by the edges' places, so that a run gives the same weights
//! whatever the timing:
//! - `sequential`: each edge in turn takes all its steps of a round (vanilla split learning);
//! - `splitfed`: one step each in turn; at the end of each round every edge sends its weights
//!   and gets back their average (FedAvg, each edge weighed by its samples, summed in the
//!   edges' order).
//!
//! A round ends when every edge still in the group has ended it; the next round's first step
//! waits until every edge has sent its next step (each evaluates in between, on the weights
//! the round left). An edge that leaves (its session closed) is skipped from then on. Waiting
//! happens on the session's own thread, never holding the device, and ends when the group has
//! made no progress (a step, an arrival, an end of round, an edge leaving) for
//! `training.client_wait_timeout`.

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use cleave_common::pb;
use cleave_common::training::optim::Optimizer;
use cleave_common::training::TrainableStages;
use cleave_common::wire::TensorSpec;
use cleave_common::{Boundary, Value};
use tch::Tensor;

use crate::error::{GroupError, RequestError};

/// The stages a session trains and their optimizer: its own, or its group's.
pub(crate) struct TrainedPart {
    pub(crate) stages: TrainableStages,
    pub(crate) optimizer: Optimizer,
}

/// A part shared by the sessions of a group (one session alone holds the only handle).
pub(crate) type SharedPart = Arc<Mutex<TrainedPart>>;

/// How the edges of a group take turns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ClientMode {
    /// Each edge in turn takes all its steps of a round.
    Sequential,
    /// One step each in turn.
    SplitFed,
}

/// The groups training now, by bundle and name; a group goes when its last session does.
#[derive(Debug, Default)]
pub(crate) struct Groups {
    open: Mutex<HashMap<(String, String), Weak<Group>>>,
}

/// What every session of a group must agree on: the first one's request, less what is each
/// edge's own (its place, seed, clipping, pipeline depth, resume).
#[derive(Debug, Clone, PartialEq)]
struct Terms {
    mode: ClientMode,
    edges: u32,
    start: u32,
    end: u32,
    optimizer: Option<pb::Optimizer>,
    loss: String,
    schedule: Option<pb::Schedule>,
}

impl Terms {
    fn of(open: &pb::OpenSession, clients: &pb::ClientGroup, mode: ClientMode) -> Self {
        Self {
            mode,
            edges: clients.edges,
            start: open.start,
            end: open.end,
            optimizer: open.optimizer.clone(),
            loss: open.loss.clone(),
            schedule: open.schedule.clone(),
        }
    }

    /// The first term another session's request differs in.
    fn differs_from(&self, other: &Self) -> Option<&'static str> {
        [
            (self.mode != other.mode, "mode"),
            (self.edges != other.edges, "edges"),
            ((self.start, self.end) != (other.start, other.end), "stages"),
            (self.optimizer != other.optimizer, "optimizer"),
            (self.loss != other.loss, "loss"),
            (self.schedule != other.schedule, "schedule"),
        ]
        .into_iter()
        .find_map(|(differs, term)| differs.then_some(term))
    }
}

impl Groups {
    /// Places session's edge in its group (made by the first to come), or says why not.
    pub(crate) fn join(&self, bundle: &str, open: &pb::OpenSession, max_edges: u32, wait: Duration) -> Result<Member, RequestError> {
        let clients = open.clients.as_ref().expect("a group session names its group");
        let mode = check(clients, max_edges)?;
        let terms = Terms::of(open, clients, mode);
        let mut groups = self.open.lock().unwrap_or_else(|p| p.into_inner());
        groups.retain(|_, group| group.strong_count() > 0);
        let key = (bundle.to_string(), clients.name.clone());
        let group = match groups.get(&key).and_then(Weak::upgrade) {
            Some(group) => group,
            None => {
                let group = Arc::new(Group::new(clients.name.clone(), terms.clone(), wait));
                groups.insert(key, Arc::downgrade(&group));
                group
            }
        };
        if let Some(term) = group.terms.differs_from(&terms) {
            return Err(GroupError::Differs { group: group.name.clone(), term }.into());
        }
        let edge = clients.edge as usize;
        group.order().join(edge).map_err(|()| GroupError::EdgeTaken { group: group.name.clone(), edge })?;
        group.changed.notify_all();
        Ok(Member { group, edge, samples: clients.samples })
    }
}

/// Checks a request's group: a name, a known mode, a place among at most `max_edges` edges.
fn check(clients: &pb::ClientGroup, max_edges: u32) -> Result<ClientMode, GroupError> {
    let name = &clients.name;
    let name_ok = (1..=64).contains(&name.len()) && name.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c));
    if !name_ok {
        return Err(GroupError::Name(name.clone()));
    }
    let mode = match clients.mode.as_str() {
        "sequential" => ClientMode::Sequential,
        "splitfed" => ClientMode::SplitFed,
        other => return Err(GroupError::Mode(other.to_string())),
    };
    if clients.edges == 0 || clients.edges > max_edges {
        return Err(GroupError::Edges { edges: clients.edges, max: max_edges });
    }
    if clients.edge >= clients.edges {
        return Err(GroupError::Place { edge: clients.edge, edges: clients.edges });
    }
    if mode == ClientMode::SplitFed && !(1..=MAX_SAMPLES).contains(&clients.samples) {
        return Err(GroupError::Samples { samples: clients.samples, max: MAX_SAMPLES });
    }
    Ok(mode)
}

/// The most samples an edge may weigh: every count, and their sum over a group, stays exact
/// in a double.
const MAX_SAMPLES: u64 = 1 << 40;

/// A group: its part, once the first session has loaded it, and the order of its turns.
#[derive(Debug)]
pub(crate) struct Group {
    name: String,
    terms: Terms,
    part: Mutex<Option<SharedPart>>,
    /// `splitfed`: the edges' weights each round's average takes, by name, type and shape.
    weights: Mutex<Option<Arc<[TensorSpec]>>>,
    order: Mutex<Order>,
    changed: Condvar,
    wait: Duration,
}

impl std::fmt::Debug for TrainedPart {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TrainedPart").field("range", &self.stages.range()).finish_non_exhaustive()
    }
}

impl Group {
    fn new(name: String, terms: Terms, wait: Duration) -> Self {
        let order = Order::new(terms.edges as usize);
        Self { name, terms, part: Mutex::new(None), weights: Mutex::new(None), order: Mutex::new(order), changed: Condvar::new(), wait }
    }

    fn order(&self) -> MutexGuard<'_, Order> {
        self.order.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits, on the calling session's thread, until `ready` holds (`gone`: the caller has
    /// left, its call is dropped), or until the group has made no progress for
    /// `training.client_wait_timeout`. `mark` runs before each check: what the caller is
    /// waiting as (arrived at this round) is marked again in a round that began meanwhile.
    fn wait_until(
        &self,
        edge: usize,
        gone: &dyn Fn() -> bool,
        mark: impl Fn(&mut Order),
        ready: impl Fn(&Order) -> bool,
    ) -> Result<MutexGuard<'_, Order>, Waited> {
        let mut deadline = Instant::now() + self.wait;
        let mut order = self.order();
        let mut progress = order.progress;
        loop {
            mark(&mut order);
            if ready(&order) {
                return Ok(order);
            }
            if gone() {
                return Err(Waited::Gone);
            }
            let now = Instant::now();
            if order.progress != progress {
                (progress, deadline) = (order.progress, now + self.wait);
            }
            if now >= deadline {
                let waiting_for = order.holding_up(edge);
                return Err(Waited::Refused(GroupError::WaitedTooLong { group: self.name.clone(), waited: self.wait, waiting_for }));
            }
            // Woken by every change; the short bound notices a caller that left.
            let slice = (deadline - now).min(Duration::from_millis(100));
            order = self.changed.wait_timeout(order, slice).unwrap_or_else(|p| p.into_inner()).0;
        }
    }
}

/// What `slot` holds, made by `make` if it holds nothing yet (the first session of a group
/// makes it while the others wait for it; a failure leaves the slot for the next to try).
fn first_made<T: Clone>(slot: &Mutex<Option<T>>, make: impl FnOnce() -> Result<T, RequestError>) -> Result<T, RequestError> {
    let mut held = slot.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(made) = held.as_ref() {
        return Ok(made.clone());
    }
    let made = make()?;
    *held = Some(made.clone());
    Ok(made)
}

/// Why a wait ended without its turn.
pub(crate) enum Waited {
    /// The caller left: nobody reads the answer.
    Gone,
    /// Refused: the others did not come in time, or the call cannot wait.
    Refused(GroupError),
}

/// An edge's place in a group, held by its session; dropping it leaves the group.
pub(crate) struct Member {
    group: Arc<Group>,
    edge: usize,
    /// `splitfed`: the samples the edge trains on each round, its weight in the average.
    samples: u64,
}

impl Member {
    /// The group's part, loaded by the first session to ask.
    pub(crate) fn part(&self, load: impl FnOnce() -> Result<TrainedPart, RequestError>) -> Result<SharedPart, RequestError> {
        first_made(&self.group.part, || Ok(Arc::new(Mutex::new(load()?))))
    }

    /// How the group's edges take turns.
    pub(crate) fn mode(&self) -> ClientMode {
        self.group.terms.mode
    }

    /// `splitfed`: the weights an edge sends at the end of a round, found by the first
    /// session to ask (`list` loads the edges' stages).
    pub(crate) fn weights(&self, list: impl FnOnce() -> Result<Vec<TensorSpec>, RequestError>) -> Result<Arc<[TensorSpec]>, RequestError> {
        first_made(&self.group.weights, || {
            let listed = list()?;
            if listed.is_empty() {
                return Err(GroupError::NothingToAverage.into());
            }
            Ok(listed.into())
        })
    }

    /// Waits for this edge's turn to start a step: every edge in the group has come to this
    /// round's steps, and the turn is this edge's.
    pub(crate) fn wait_for_step(&self, gone: &dyn Fn() -> bool) -> Result<(), Waited> {
        let edge = self.edge;
        let arrive = |order: &mut Order| {
            if order.arrive(edge) {
                self.group.changed.notify_all();
            }
        };
        self.group.wait_until(edge, gone, arrive, |order| order.may_step(edge)).map(drop)
    }

    /// This edge's step is taken: in `splitfed` the turn goes to the next edge.
    pub(crate) fn stepped(&self) {
        if self.group.terms.mode == ClientMode::SplitFed {
            self.group.order().pass_turn(self.edge);
            self.group.changed.notify_all();
        }
    }

    /// Ends this edge's round (`splitfed`: with its weights, checked, and samples) and waits
    /// until every edge still in the group has ended it, even when the caller has left: the
    /// answer is kept for the call resent on its next stream, which must not end a round
    /// again. Returns the rounds ended and, `splitfed`, the average of the edges' weights.
    pub(crate) fn end_round(&self, weights: Option<Boundary>) -> Result<(u64, Option<Boundary>), Waited> {
        if let Some(weights) = &weights {
            let specs = self.group.weights.lock().unwrap_or_else(|p| p.into_inner()).clone().unwrap_or_else(|| Arc::from([]));
            check_weights(weights, &specs).map_err(Waited::Refused)?;
        }
        let round = {
            let mut order = self.group.order();
            let round = order.round;
            order.contributions[self.edge] = weights.map(|w| (w, self.samples));
            order.end_round(self.edge);
            round
        };
        self.group.changed.notify_all();
        let edge = self.edge;
        let order = self.group.wait_until(edge, &|| false, |_| (), |order| order.round > round)?;
        Ok((order.round, order.averaged.as_ref().map(Boundary::shallow_clone)))
    }
}

impl Drop for Member {
    fn drop(&mut self) {
        self.group.order().leave(self.edge);
        self.group.changed.notify_all();
    }
}

/// Where each edge of a group is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Place {
    /// Not come yet: the group waits for it.
    Expected,
    /// Training, in the round `Order::round`.
    In { arrived: bool, ended: bool },
    /// Its session closed: skipped.
    Left,
}

/// The turns of a group's edges.
#[derive(Debug)]
struct Order {
    places: Vec<Place>,
    /// Rounds ended.
    round: u64,
    /// The edge whose step is next.
    turn: usize,
    /// `splitfed`: each edge's weights and samples, from its end of this round.
    contributions: Vec<Option<(Boundary, u64)>>,
    /// `splitfed`: the average the last round ended with.
    averaged: Option<Boundary>,
    /// Counts every change: a wait times out only after a while without one.
    progress: u64,
}

impl Order {
    fn new(edges: usize) -> Self {
        Self {
            places: vec![Place::Expected; edges],
            round: 0,
            turn: 0,
            contributions: (0..edges).map(|_| None).collect(),
            averaged: None,
            progress: 0,
        }
    }

    /// An edge comes (or comes back after a failed open); refused while its place is held.
    fn join(&mut self, edge: usize) -> Result<(), ()> {
        match self.places[edge] {
            Place::In { .. } => Err(()),
            Place::Expected | Place::Left => {
                self.places[edge] = Place::In { arrived: false, ended: false };
                self.progress += 1;
                Ok(())
            }
        }
    }

    /// `edge` has sent a step of this round; whether that is news.
    fn arrive(&mut self, edge: usize) -> bool {
        match self.places[edge] {
            Place::In { arrived: false, ended } => {
                self.places[edge] = Place::In { arrived: true, ended };
                self.progress += 1;
                true
            }
            _ => false,
        }
    }

    /// Whether `edge` may start a step: every edge has come to this round, and it is its turn.
    fn may_step(&self, edge: usize) -> bool {
        self.turn == edge && self.holding_up(edge).is_empty()
    }

    /// The edges a step of `edge` waits for to come to this round.
    fn holding_up(&self, edge: usize) -> Vec<usize> {
        let not_come = self.places.iter().enumerate().filter(|(_, p)| matches!(p, Place::Expected | Place::In { arrived: false, ended: false }));
        let mut waiting: Vec<usize> = not_come.map(|(e, _)| e).filter(|&e| e != edge).collect();
        if waiting.is_empty() && self.turn != edge {
            waiting.push(self.turn);
        }
        waiting
    }

    /// Whether `edge` still takes steps this round.
    fn stepping(&self, edge: usize) -> bool {
        matches!(self.places[edge], Place::Expected | Place::In { ended: false, .. })
    }

    /// The turn goes to the first edge after `edge` (cyclically, `edge` last) that still
    /// steps this round.
    fn pass_turn(&mut self, edge: usize) {
        let n = self.places.len();
        if let Some(next) = (1..=n).map(|k| (edge + k) % n).find(|&e| self.stepping(e)) {
            self.turn = next;
        }
        self.progress += 1;
    }

    fn end_round(&mut self, edge: usize) {
        self.places[edge] = Place::In { arrived: true, ended: true };
        self.after_leaving_the_round(edge);
    }

    fn leave(&mut self, edge: usize) {
        self.places[edge] = Place::Left;
        self.after_leaving_the_round(edge);
    }

    /// An edge took its last step of the round: the turn moves on, and once every edge has
    /// ended the round the next one begins with the first edge's turn.
    fn after_leaving_the_round(&mut self, edge: usize) {
        if self.turn == edge {
            self.pass_turn(edge);
        }
        let everyone_ended = self.places.iter().all(|p| matches!(p, Place::Left | Place::In { ended: true, .. }));
        if everyone_ended && self.places.iter().any(|p| matches!(p, Place::In { .. })) {
            let weights: Vec<(Boundary, u64)> = self.contributions.iter_mut().filter_map(Option::take).collect();
            self.averaged = average(&weights);
            self.round += 1;
            for place in &mut self.places {
                if let Place::In { .. } = place {
                    *place = Place::In { arrived: false, ended: false };
                }
            }
            self.turn = 0;
            self.pass_turn(self.places.len() - 1);
        }
    }
}

/// FedAvg: each tensor's average over the edges' weights, each weighed by its share of the
/// samples, summed in the edges' order (as `sum(t_i * (n_i / n))` in PyTorch); none without
/// weights. Every edge's weights hold the same tensors (the receiver checked them).
fn average(weights: &[(Boundary, u64)]) -> Option<Boundary> {
    let total = weights.iter().map(|(_, n)| u128::from(*n)).sum::<u128>() as f64;
    let (first, _) = weights.first()?;
    let tensor = |b: &Boundary, name: &str| b.values.iter().find(|(n, _)| n == name).and_then(|(_, v)| v.as_tensor()).map(Tensor::shallow_clone);
    let mut values = Vec::with_capacity(first.values.len());
    for (name, _) in &first.values {
        let mut sum: Option<Tensor> = None;
        for (b, n) in weights {
            let term = tensor(b, name)?.f_mul_scalar(*n as f64 / total).ok()?;
            sum = Some(match sum {
                None => term,
                Some(acc) => acc.f_add(&term).ok()?,
            });
        }
        values.push((name.clone(), Value::Tensor(sum?)));
    }
    Some(Boundary { values })
}

/// Checks that `weights` are exactly the tensors of `specs` (their names, types and shapes):
/// what the payload's header declared was checked before its data; this checks what its
/// values name.
fn check_weights(weights: &Boundary, specs: &[TensorSpec]) -> Result<(), GroupError> {
    let refused = |why: String| Err(GroupError::Weights(why));
    if weights.values.len() != specs.len() {
        return refused(format!("{} values, expected {}", weights.values.len(), specs.len()));
    }
    for (name, value) in &weights.values {
        let Some(spec) = specs.iter().find(|s| &s.name == name) else { return refused(format!("{name} is not expected")) };
        let matches = value.as_tensor().is_some_and(|t| TensorSpec::of(name, t).as_ref() == Some(spec));
        if !matches {
            return refused(format!("{name} is not a {} tensor of shape {:?}", spec.dtype, spec.shape));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn joined(edges: usize) -> Order {
        let mut order = Order::new(edges);
        (0..edges).for_each(|e| order.join(e).unwrap());
        order
    }

    #[test]
    fn splitfed_turns_go_round_the_edges_once_all_have_come() {
        let mut order = joined(3);
        order.arrive(0);
        assert!(!order.may_step(0), "edges 1 and 2 have not come");
        assert_eq!(order.holding_up(0), vec![1, 2]);
        order.arrive(1);
        order.arrive(2);
        assert!(order.may_step(0) && !order.may_step(1));
        order.pass_turn(0);
        assert!(order.may_step(1));
        order.pass_turn(1);
        order.pass_turn(2);
        assert!(order.may_step(0));
    }

    #[test]
    fn an_edge_that_ended_its_round_or_left_is_skipped_and_the_next_round_waits_for_all() {
        let mut order = joined(3);
        (0..3).for_each(|e| assert!(order.arrive(e)));
        order.end_round(1);
        order.pass_turn(0);
        assert!(order.may_step(2), "edge 1 ended its round");
        order.leave(2);
        assert!(order.may_step(0));
        order.end_round(0);
        assert_eq!(order.round, 1);
        order.arrive(1);
        assert!(!order.may_step(1), "edge 0 has not come to round 1, and the turn is its");
        assert_eq!(order.holding_up(1), vec![0]);
        order.arrive(0);
        assert!(order.may_step(0), "round 1 starts with the first edge still in the group");
    }

    #[test]
    fn a_place_is_held_by_one_session_and_an_unfilled_one_is_waited_for() {
        let mut order = Order::new(2);
        order.join(0).unwrap();
        assert!(order.join(0).is_err());
        order.arrive(0);
        assert_eq!(order.holding_up(0), vec![1]);
        order.leave(0);
        order.join(0).unwrap();
    }
}

#[cfg(test)]
mod average_tests {
    use super::*;

    #[test]
    fn fedavg_weighs_each_edge_by_its_samples() {
        let weights = |w: &[f32], b: f32| Boundary {
            values: vec![("w".into(), Value::Tensor(Tensor::from_slice(w))), ("b".into(), Value::Tensor(Tensor::from_slice(&[b])))],
        };
        let averaged = average(&[(weights(&[1.0, 2.0], 4.0), 1), (weights(&[5.0, 6.0], 8.0), 3)]).unwrap();
        let get = |name: &str| Vec::<f32>::try_from(averaged.values.iter().find(|(n, _)| n == name).unwrap().1.as_tensor().unwrap()).unwrap();
        assert_eq!(get("w"), vec![4.0, 5.0]);
        assert_eq!(get("b"), vec![7.0]);
        assert!(average(&[]).is_none());
    }
}

#[cfg(test)]
mod weight_tests {
    use super::*;

    #[test]
    fn an_edge_s_weights_must_be_exactly_its_stages_tensors() {
        let t = |shape: &[i64]| Value::Tensor(Tensor::zeros(shape, (tch::Kind::Float, tch::Device::Cpu)));
        let specs: Vec<TensorSpec> = [("w", vec![2, 3]), ("b", vec![3])]
            .into_iter()
            .map(|(n, shape)| TensorSpec { name: n.into(), dtype: cleave_common::spec::DType::Float32, shape })
            .collect();
        let weights = |values: Vec<(&str, Value)>| Boundary { values: values.into_iter().map(|(n, v)| (n.to_string(), v)).collect() };
        assert!(check_weights(&weights(vec![("b", t(&[3])), ("w", t(&[2, 3]))]), &specs).is_ok());
        for (values, says) in [
            (vec![("w", t(&[2, 3]))], "1 values, expected 2"),
            (vec![("w", t(&[2, 3])), ("x", t(&[3]))], "x is not expected"),
            (vec![("w", t(&[3, 2])), ("b", t(&[3]))], "w is not a float32 tensor of shape [2, 3]"),
            (vec![("w", t(&[2, 3])), ("b", Value::Int(3))], "b is not a float32 tensor"),
        ] {
            let err = check_weights(&weights(values), &specs).unwrap_err().to_string();
            assert!(err.contains(says), "{says}: {err}");
        }
    }
}
