//! The rules a device's scheduler follows, without libtorch or threads, so that they are
//! tested alone and shared: the server's scheduler runs them on a device, the fleet planner's
//! simulation (`host plan --fleet --simulate`) in virtual time.
//!
//! Every entry has a *key*, the instant it would like to run by: its arrival (`fifo`), its
//! deadline (`edf`), or its arrival plus the scheduler's `max_age` (training steps, and
//! requests of models without a latency target): [`request_key`]. Smaller keys run first.
//! Because a key is fixed when the entry arrives and later arrivals get later keys, an
//! entry's priority rises as it ages: nothing waits forever.
//!
//! Requests of one model at one batchable cut (and of one sequence length, in bundles with
//! one: only tensors of equal lengths concatenate along the batch) form a *group* and run as
//! one batch, in key order, up to the model's batch limit. A group runs once it is full or
//! its oldest member has waited its `max_wait`; a group still filling lets a later group that
//! is ready run.

use std::time::{Duration, Instant};

/// What a device's scheduler runs first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// In arrival order.
    Fifo,
    /// Earliest deadline first: a request's deadline is its arrival plus its model's
    /// `slo_ms` divided by its `priority`.
    Edf,
}

/// When a request would like to run by: its arrival (`fifo`); its arrival plus its model's
/// `slo / priority` (`edf`), or plus `max_age` for a model without a target, which is also a
/// training turn's place under either policy.
pub fn request_key(policy: Policy, max_age: Duration, arrived: Instant, slo: Option<Duration>, priority: f64) -> Instant {
    match (policy, slo) {
        (Policy::Fifo, _) => arrived,
        (Policy::Edf, Some(slo)) => arrived + slo.div_f64(priority),
        (Policy::Edf, None) => arrived + max_age,
    }
}

/// The requests that may run as one batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Group {
    /// The model's index on its device.
    pub model: usize,
    /// The cut their boundaries are at.
    pub cut: usize,
    /// Their sequence length, in bundles with a sequence.
    pub seq: Option<i64>,
}

/// One waiting entry.
#[derive(Debug)]
pub struct Entry<T> {
    /// The group it merges with; `None`: it runs alone.
    pub group: Option<Group>,
    /// Samples it carries.
    pub samples: i64,
    /// When it would like to run by (smaller first).
    pub key: Instant,
    /// When it stops waiting for others to fill its batch.
    pub ready_at: Instant,
    /// What the caller runs.
    pub item: T,
}

/// What to do next.
#[derive(Debug)]
pub enum Pick<T> {
    /// Run these together (one entry, or a group's members in key order).
    Run(Vec<Entry<T>>),
    /// Nothing is ready before this instant (a group is filling).
    WaitUntil(Instant),
    /// Nothing waits.
    Idle,
}

/// The waiting entries of one device.
#[derive(Debug)]
pub struct Queue<T> {
    entries: Vec<Entry<T>>,
}

impl<T> Default for Queue<T> {
    fn default() -> Self {
        Self { entries: Vec::new() }
    }
}

impl<T> Queue<T> {
    /// How many entries wait.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether none waits.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Adds an entry.
    pub fn push(&mut self, entry: Entry<T>) {
        self.entries.push(entry);
    }

    /// Takes out every entry `unwanted` says, in arrival order.
    pub fn take_where(&mut self, mut unwanted: impl FnMut(&Entry<T>) -> bool) -> Vec<Entry<T>> {
        self.entries.extract_if(.., |e| unwanted(e)).collect()
    }

    /// The first cut after `group`'s where requests it could merge with (its model, its
    /// sequence length) wait, if any: a batch entering at its cut runs up to it and joins them.
    pub fn next_cut_waiting(&self, group: Group) -> Option<usize> {
        self.entries.iter().filter_map(|e| e.group).filter(|g| g.model == group.model && g.seq == group.seq && g.cut > group.cut).map(|g| g.cut).min()
    }

    /// Takes what runs next at `now`; `limit(model)` is the samples one batch of that model
    /// may hold; entries for which `may_run` is false are held back (a profile runs waiting
    /// requests between its stages, not training steps).
    pub fn pick(&mut self, now: Instant, limit: impl Fn(usize) -> i64, may_run: impl Fn(&Entry<T>) -> bool) -> Pick<T> {
        let mut order: Vec<usize> = (0..self.entries.len()).collect();
        // Stable: equal keys keep their arrival order.
        order.sort_by_key(|&i| self.entries[i].key);
        let mut wake: Option<Instant> = None;
        let mut seen: Vec<Group> = Vec::new();
        for &i in &order {
            let head = &self.entries[i];
            if !may_run(head) {
                continue;
            }
            let Some(group) = head.group else {
                return Pick::Run(vec![self.entries.remove(i)]);
            };
            if seen.contains(&group) {
                continue;
            }
            seen.push(group);
            let members: Vec<usize> = order.iter().copied().filter(|&j| self.entries[j].group == Some(group)).collect();
            let limit = limit(group.model).max(1);
            let (mut taken, mut samples) = (Vec::new(), 0);
            for &j in &members {
                let s = self.entries[j].samples;
                if taken.is_empty() || samples + s <= limit {
                    taken.push(j);
                    samples += s;
                } else {
                    break;
                }
            }
            let full = taken.len() < members.len() || samples >= limit;
            let ready_at = members.iter().map(|&j| self.entries[j].ready_at).min().unwrap_or(now);
            if full || ready_at <= now {
                return Pick::Run(self.take(taken));
            }
            wake = Some(wake.map_or(ready_at, |w| w.min(ready_at)));
        }
        wake.map_or(Pick::Idle, Pick::WaitUntil)
    }

    /// Removes the entries at `indices` and returns them in that order.
    fn take(&mut self, indices: Vec<usize>) -> Vec<Entry<T>> {
        let mut slots: Vec<Option<Entry<T>>> = std::mem::take(&mut self.entries).into_iter().map(Some).collect();
        let taken = indices.iter().map(|&i| slots[i].take().expect("each index taken once")).collect();
        self.entries = slots.into_iter().flatten().collect();
        taken
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn at(t0: Instant, ms: u64) -> Instant {
        t0 + Duration::from_millis(ms)
    }

    /// A request of `model` at `cut` arriving at `ms`, keyed by `key_ms`, ready at once.
    fn request(t0: Instant, name: &'static str, model: usize, cut: usize, samples: i64, key_ms: u64) -> Entry<&'static str> {
        Entry { group: Some(Group { model, cut, seq: None }), samples, key: at(t0, key_ms), ready_at: t0, item: name }
    }

    /// The same at sequence length `seq`.
    fn request_of_length(t0: Instant, name: &'static str, cut: usize, seq: i64, key_ms: u64) -> Entry<&'static str> {
        Entry { group: Some(Group { model: 0, cut, seq: Some(seq) }), ..request(t0, name, 0, cut, 1, key_ms) }
    }

    fn group(model: usize, cut: usize) -> Group {
        Group { model, cut, seq: None }
    }

    fn names(pick: Pick<&'static str>) -> Vec<&'static str> {
        match pick {
            Pick::Run(entries) => entries.into_iter().map(|e| e.item).collect(),
            other => panic!("expected a batch, got {other:?}"),
        }
    }

    #[test]
    fn a_group_runs_in_key_order_up_to_the_limit_and_the_rest_waits() {
        let t0 = Instant::now();
        let mut q = Queue::default();
        for (name, samples, key) in [("c", 1, 30), ("a", 1, 10), ("b", 3, 20), ("d", 1, 40)] {
            q.push(request(t0, name, 0, 5, samples, key));
        }
        assert_eq!(names(q.pick(t0, |_| 4, |_| true)), ["a", "b"]);
        assert_eq!(names(q.pick(t0, |_| 4, |_| true)), ["c", "d"]);
        assert!(matches!(q.pick(t0, |_| 4, |_| true), Pick::Idle));
    }

    #[test]
    fn a_request_larger_than_the_limit_runs_alone() {
        let t0 = Instant::now();
        let mut q = Queue::default();
        q.push(request(t0, "big", 0, 0, 8, 1));
        q.push(request(t0, "small", 0, 0, 1, 2));
        assert_eq!(names(q.pick(t0, |_| 4, |_| true)), ["big"]);
        assert_eq!(names(q.pick(t0, |_| 4, |_| true)), ["small"]);
    }

    #[test]
    fn other_cuts_and_models_do_not_merge() {
        let t0 = Instant::now();
        let mut q = Queue::default();
        q.push(request(t0, "m0c3", 0, 3, 1, 1));
        q.push(request(t0, "m1c3", 1, 3, 1, 2));
        q.push(request(t0, "m0c7", 0, 7, 1, 3));
        q.push(request(t0, "m0c3b", 0, 3, 1, 4));
        assert_eq!(q.next_cut_waiting(group(0, 3)), Some(7));
        assert_eq!(q.next_cut_waiting(group(0, 7)), None);
        assert_eq!(q.next_cut_waiting(group(1, 0)), Some(3));
        assert_eq!(names(q.pick(t0, |_| 16, |_| true)), ["m0c3", "m0c3b"]);
        assert_eq!(names(q.pick(t0, |_| 16, |_| true)), ["m1c3"]);
        assert_eq!(names(q.pick(t0, |_| 16, |_| true)), ["m0c7"]);
    }

    #[test]
    fn only_requests_of_one_sequence_length_merge() {
        let t0 = Instant::now();
        let mut q = Queue::default();
        q.push(request_of_length(t0, "s8", 2, 8, 1));
        q.push(request_of_length(t0, "s16", 2, 16, 2));
        q.push(request_of_length(t0, "s8b", 2, 8, 3));
        q.push(request_of_length(t0, "s16 later", 5, 16, 4));
        // A batch of length 8 entering at cut 2 runs to the end: the requests waiting at cut 5
        // are of another length. One of length 16 stops at cut 5 to join them.
        assert_eq!(q.next_cut_waiting(Group { model: 0, cut: 2, seq: Some(8) }), None);
        assert_eq!(q.next_cut_waiting(Group { model: 0, cut: 2, seq: Some(16) }), Some(5));
        assert_eq!(names(q.pick(t0, |_| 16, |_| true)), ["s8", "s8b"]);
        assert_eq!(names(q.pick(t0, |_| 16, |_| true)), ["s16"]);
        assert_eq!(names(q.pick(t0, |_| 16, |_| true)), ["s16 later"]);
    }

    #[test]
    fn a_filling_group_waits_until_its_oldest_is_due_and_lets_a_ready_one_by() {
        let t0 = Instant::now();
        let mut q = Queue::default();
        q.push(Entry { ready_at: at(t0, 5), ..request(t0, "filling", 0, 1, 1, 1) });
        assert!(matches!(q.pick(t0, |_| 4, |_| true), Pick::WaitUntil(t) if t == at(t0, 5)));
        q.push(Entry { group: None, ..request(t0, "alone", 1, 0, 1, 9) });
        assert_eq!(names(q.pick(t0, |_| 4, |_| true)), ["alone"]);
        q.push(Entry { ready_at: at(t0, 8), ..request(t0, "joins", 0, 1, 1, 2) });
        assert!(matches!(q.pick(at(t0, 4), |_| 4, |_| true), Pick::WaitUntil(t) if t == at(t0, 5)));
        assert_eq!(names(q.pick(at(t0, 5), |_| 4, |_| true)), ["filling", "joins"]);
        // A full group does not wait.
        for name in ["w", "x", "y", "z"] {
            q.push(Entry { ready_at: at(t0, 100), ..request(t0, name, 0, 1, 1, 3) });
        }
        assert_eq!(names(q.pick(t0, |_| 4, |_| true)), ["w", "x", "y", "z"]);
    }

    #[test]
    fn entries_the_caller_holds_back_are_skipped() {
        let t0 = Instant::now();
        let mut q = Queue::default();
        q.push(Entry { group: None, ..request(t0, "turn", 0, 0, 0, 1) });
        q.push(request(t0, "req", 0, 2, 1, 2));
        assert_eq!(names(q.pick(t0, |_| 4, |e| e.item != "turn")), ["req"]);
        assert!(matches!(q.pick(t0, |_| 4, |e| e.item != "turn"), Pick::Idle));
        assert_eq!(names(q.pick(t0, |_| 4, |_| true)), ["turn"]);
        assert_eq!(q.len(), 0);
    }
}
