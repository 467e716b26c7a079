//! One memory budget for the bytes every stream holds together. A request reserves what its
//! envelope declares (the data as received plus the tensors it decodes into), or the room its
//! answer will take where that is more, before anything is allocated for it (a result never
//! waits for room outside the budget); when it is answered, its reservation becomes its
//! answer's, which is
//! held until the answer is written to its connection (see [`crate::unsent`]), or dropped.
//!
//! Each peer (an address, see [`Peer`]) spends its own share of it
//! (`limits.memory_budget_bytes_per_peer`): a stream reserves through its peer's view of the
//! budget ([`MemoryBudget::for_peer`]), which takes the bytes from the peer's share as well as
//! from the whole. One reservation takes at most the share less one message (the largest a
//! call may send: what the call's own message buffer holds, see [`crate::inbound`]), or half
//! the share where that is more, so a peer that holds nothing else may still send the largest
//! request the limits allow.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::{timeout_at, Instant};

use crate::peer::Peer;

/// The budget counts in KiB so that one request of any allowed size fits a semaphore's `u32`.
const UNIT: u64 = 1024;

/// The budget, shared by every stream of a server; a peer's view of it
/// ([`Self::for_peer`]) also spends that peer's share.
#[derive(Debug, Clone)]
pub struct MemoryBudget {
    inner: Arc<Inner>,
    peer: Option<PeerShare>,
}

#[derive(Debug)]
struct Inner {
    units: Arc<Semaphore>,
    total_units: u64,
    wait: Duration,
    /// The most ever held at once, in units (what tests and benches read).
    peak_units: AtomicU64,
    /// Each peer's share, in units.
    share_units: u64,
    /// The most of it one reservation takes, in units.
    share_take_units: u64,
    /// The shares of the peers that hold a view or a reservation.
    shares: Mutex<HashMap<Peer, Weak<Semaphore>>>,
}

/// One peer's share of the budget.
#[derive(Debug, Clone)]
struct PeerShare {
    peer: Peer,
    units: Arc<Semaphore>,
}

/// Bytes held against the budget; dropping it gives them back. The default holds nothing.
#[derive(Debug, Default)]
pub struct Reservation {
    _permit: Option<OwnedSemaphorePermit>,
    /// What it takes of its peer's share: as many units, at most the share less one message.
    _share: Option<OwnedSemaphorePermit>,
    bytes: u64,
}

impl Reservation {
    /// Nothing reserved (what an answer of no size holds).
    pub fn none() -> Self {
        Self::default()
    }

    /// The bytes reserved.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Takes `bytes` (rounded up to whole units) out of this reservation into a new one;
    /// what this one lacks, the new one lacks too (it takes all there is).
    pub fn split_off(&mut self, bytes: u64) -> Self {
        let Some(permit) = &mut self._permit else { return Self::none() };
        let units = (bytes.div_ceil(UNIT) as usize).min(permit.num_permits());
        let Some(taken) = permit.split(units) else { return Self::none() };
        let share = self._share.as_mut().and_then(|share| share.split(units.min(share.num_permits())));
        let taken = Self { bytes: (units as u64 * UNIT).min(self.bytes), _permit: Some(taken), _share: share };
        self.bytes -= taken.bytes;
        taken
    }

    /// Adds `other`'s bytes to this reservation (both from one view of one budget).
    fn merge(&mut self, other: Self) {
        self.bytes += other.bytes;
        merge_permits(&mut self._permit, other._permit);
        merge_permits(&mut self._share, other._share);
    }

    /// Gives back what it holds beyond `bytes`.
    pub fn shrink_to(&mut self, bytes: u64) {
        let keep = self.split_off(bytes);
        *self = keep;
    }
}

fn merge_permits(mine: &mut Option<OwnedSemaphorePermit>, theirs: Option<OwnedSemaphorePermit>) {
    match (mine, theirs) {
        (Some(mine), Some(theirs)) => mine.merge(theirs),
        (mine @ None, theirs) => *mine = theirs,
        (Some(_), None) => {}
    }
}

/// Why a reservation was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OverBudget {
    /// The whole budget had no room.
    #[error("{bytes} bytes do not fit in the server's memory budget of {budget} bytes (`limits.memory_budget_bytes`) within {waited:?}")]
    Server {
        /// What the request asked for.
        bytes: u64,
        /// The whole budget.
        budget: u64,
        /// How long it waited.
        waited: Duration,
    },
    /// What a peer would keep is more than its whole share: it can never fit.
    #[error(
        "{bytes} bytes are more than this peer's ({peer}) whole share of the memory budget, {share} bytes \
         (`limits.memory_budget_bytes_per_peer`): ask for less (a smaller batch), or raise the share"
    )]
    LargerThanShare {
        /// What was asked for.
        bytes: u64,
        /// The peer.
        peer: String,
        /// Its share.
        share: u64,
    },
    /// The peer's share had no room: it holds what it may already.
    #[error(
        "{bytes} bytes do not fit in this peer's ({peer}) share of the memory budget, {share} bytes \
         (`limits.memory_budget_bytes_per_peer`), within {waited:?}: it holds its share in requests, unread answers and training state"
    )]
    PeerShare {
        /// What the request asked for.
        bytes: u64,
        /// The peer.
        peer: String,
        /// Its share.
        share: u64,
        /// How long it waited.
        waited: Duration,
    },
}

impl MemoryBudget {
    /// A budget of `bytes`, of which each peer may hold `share_bytes` (one reservation at
    /// most the share less `message_bytes`, or half the share where that is more); a
    /// reservation waits at most `wait` for room.
    pub fn new(bytes: u64, share_bytes: u64, message_bytes: u64, wait: Duration) -> Self {
        let total_units = (bytes / UNIT).min(Semaphore::MAX_PERMITS as u64);
        let share_units = (share_bytes / UNIT).clamp(1, total_units.max(1));
        let share_take_units = share_units.saturating_sub(message_bytes.div_ceil(UNIT)).max(share_units / 2).max(1);
        let inner = Inner {
            units: Arc::new(Semaphore::new(total_units as usize)),
            total_units,
            wait,
            peak_units: AtomicU64::new(0),
            share_units,
            share_take_units,
            shares: Mutex::default(),
        };
        Self { inner: Arc::new(inner), peer: None }
    }

    /// `peer`'s view of the budget: what it reserves also comes out of its share. (Without a
    /// peer, or with shares as large as the budget, the budget itself.)
    pub(crate) fn for_peer(&self, peer: Option<Peer>) -> Self {
        let whole = Self { peer: None, ..self.clone() };
        let Some(peer) = peer.filter(|_| self.inner.share_units < self.inner.total_units) else { return whole };
        let mut shares = self.inner.shares.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let units = shares.get(&peer).and_then(Weak::upgrade).unwrap_or_else(|| {
            // (Shares no one holds any more are forgotten as others are made.)
            shares.retain(|_, share| share.strong_count() > 0);
            let units = Arc::new(Semaphore::new(self.inner.share_units as usize));
            shares.insert(peer.clone(), Arc::downgrade(&units));
            units
        });
        Self { inner: Arc::clone(&self.inner), peer: Some(PeerShare { peer, units }) }
    }

    /// Reserves `bytes`, waiting up to the budget's wait for others to give room back (the
    /// peer's own share first, then the whole budget).
    pub async fn reserve(&self, bytes: u64) -> Result<Reservation, OverBudget> {
        let units = bytes.div_ceil(UNIT);
        self.acquire(bytes, units, self.share_take(units)).await
    }

    /// Reserves `units` (for `bytes`), `share_units` of them from the peer's share.
    async fn acquire(&self, bytes: u64, units: u64, share_units: u32) -> Result<Reservation, OverBudget> {
        let wait = self.inner.wait;
        let refused = |waited| OverBudget::Server { bytes, budget: self.total_bytes(), waited };
        if units == 0 {
            return Ok(Reservation { bytes, ..Reservation::none() });
        }
        let units32 = u32::try_from(units).map_err(|_| refused(Duration::ZERO))?;
        if units > self.inner.total_units {
            return Err(refused(Duration::ZERO));
        }
        let deadline = Instant::now() + wait;
        let share = match &self.peer {
            None => None,
            Some(share) => {
                let acquire = Arc::clone(&share.units).acquire_many_owned(share_units);
                let refused = || self.share_refused(share, bytes);
                Some(timeout_at(deadline, acquire).await.map_err(|_| refused())?.map_err(|_| refused())?)
            }
        };
        let acquire = Arc::clone(&self.inner.units).acquire_many_owned(units32);
        let permit = timeout_at(deadline, acquire).await.map_err(|_| refused(wait))?.map_err(|_| refused(wait))?;
        Ok(self.held(permit, share, bytes))
    }

    /// Reserves `bytes` if there is room now, without waiting: for what can be done without
    /// them (a batch that can run request by request).
    pub fn try_reserve(&self, bytes: u64) -> Option<Reservation> {
        let units = bytes.div_ceil(UNIT);
        self.try_acquire(bytes, units, self.share_take(units))
    }

    /// Reserves `bytes` that a peer keeps beyond its requests (a training step's graph until
    /// its backward, the answers a session keeps for resends), waiting as [`Self::reserve`]
    /// does: all of them from the peer's share, so that what one peer keeps never takes
    /// others' room (a request may take more of the whole budget for the time it runs).
    pub async fn reserve_kept(&self, bytes: u64) -> Result<Reservation, OverBudget> {
        let units = bytes.div_ceil(UNIT);
        if let Some(share) = self.peer.as_ref().filter(|_| units > self.inner.share_units) {
            return Err(OverBudget::LargerThanShare { bytes, peer: share.peer.to_string(), share: self.share_bytes() });
        }
        self.acquire(bytes, units, u32::try_from(units).unwrap_or(u32::MAX)).await
    }

    /// [`Self::reserve_kept`] if there is room now, without waiting.
    pub fn try_reserve_kept(&self, bytes: u64) -> Option<Reservation> {
        let units = bytes.div_ceil(UNIT);
        self.try_acquire(bytes, units, u32::try_from(units).ok()?)
    }

    /// Reserves `units` (for `bytes`) if there is room now, `share_units` of them from the
    /// peer's share.
    fn try_acquire(&self, bytes: u64, units: u64, share_units: u32) -> Option<Reservation> {
        let units = u32::try_from(units).ok()?;
        if units == 0 {
            return Some(Reservation { bytes, ..Reservation::none() });
        }
        let share = match &self.peer {
            None => None,
            Some(share) => Some(Arc::clone(&share.units).try_acquire_many_owned(share_units).ok()?),
        };
        let permit = Arc::clone(&self.inner.units).try_acquire_many_owned(units).ok()?;
        Some(self.held(permit, share, bytes))
    }

    /// What `units` take of a peer's share: as many, at most the share less one message.
    fn share_take(&self, units: u64) -> u32 {
        u32::try_from(units.min(self.inner.share_take_units)).unwrap_or(u32::MAX)
    }

    fn share_refused(&self, share: &PeerShare, bytes: u64) -> OverBudget {
        OverBudget::PeerShare { bytes, peer: share.peer.to_string(), share: self.share_bytes(), waited: self.inner.wait }
    }

    fn held(&self, permit: OwnedSemaphorePermit, share: Option<OwnedSemaphorePermit>, bytes: u64) -> Reservation {
        let held = self.inner.total_units - self.inner.units.available_permits() as u64;
        self.inner.peak_units.fetch_max(held, Ordering::Relaxed);
        Reservation { _permit: Some(permit), _share: share, bytes }
    }

    /// Each peer's share in bytes.
    pub fn share_bytes(&self) -> u64 {
        self.inner.share_units * UNIT
    }

    /// Reserves what `held` lacks of `bytes` (waiting as [`Self::reserve`] does) and gives
    /// back what it holds beyond: a request's reservation becoming its answer's.
    pub async fn resize(&self, mut held: Reservation, bytes: u64) -> Result<Reservation, OverBudget> {
        self.grow(&mut held, bytes).await?;
        held.shrink_to(bytes);
        held.bytes = bytes;
        Ok(held)
    }

    /// Reserves what `held` lacks of `bytes` (waiting as [`Self::reserve`] does), keeping it
    /// as it was when refused.
    pub async fn grow(&self, held: &mut Reservation, bytes: u64) -> Result<(), OverBudget> {
        let (have, want) = (held.bytes.div_ceil(UNIT), bytes.div_ceil(UNIT));
        if have < want {
            let share_held = held._share.as_ref().map_or(0, |p| p.num_permits() as u32);
            let more = self.acquire((want - have) * UNIT, want - have, self.share_take(want).saturating_sub(share_held)).await?;
            held.merge(more);
        }
        Ok(())
    }

    /// The whole budget in bytes.
    pub fn total_bytes(&self) -> u64 {
        self.inner.total_units * UNIT
    }

    /// Bytes held now.
    pub fn held_bytes(&self) -> u64 {
        (self.inner.total_units - self.inner.units.available_permits() as u64) * UNIT
    }

    /// The most bytes ever held at once.
    pub fn peak_bytes(&self) -> u64 {
        self.inner.peak_units.load(Ordering::Relaxed) * UNIT
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_reservation_waits_for_room_then_is_refused_and_every_byte_comes_back() {
        let budget = MemoryBudget::new(10 << 10, 10 << 10, 1 << 10, Duration::from_secs(2));
        let a = budget.reserve(6 << 10).await.unwrap();
        assert_eq!(budget.held_bytes(), 6 << 10);
        // 6 + 6 KiB do not fit in 10: the second waits the budget's wait, then is refused.
        let refused = budget.reserve(6 << 10).await.unwrap_err();
        assert_eq!(refused, OverBudget::Server { bytes: 6 << 10, budget: 10 << 10, waited: Duration::from_secs(2) });
        // Room given back while one waits lets it in.
        let waiting = tokio::spawn({
            let budget = budget.clone();
            async move { budget.reserve(6 << 10).await.map(|r| r.bytes()) }
        });
        tokio::task::yield_now().await;
        drop(a);
        assert_eq!(waiting.await.unwrap(), Ok(6 << 10));
        assert_eq!(budget.held_bytes(), 0, "a dropped reservation gives its bytes back");
        assert_eq!(budget.peak_bytes(), 6 << 10);
        // More than the whole budget is refused at once, without waiting.
        assert_eq!(budget.reserve(11 << 10).await.unwrap_err(), OverBudget::Server { bytes: 11 << 10, budget: 10 << 10, waited: Duration::ZERO });
        // Bytes count in whole KiB, rounded up.
        let r = budget.reserve(1).await.unwrap();
        assert_eq!((r.bytes(), budget.held_bytes()), (1, 1 << 10));
    }

    #[test]
    fn a_reservation_tried_is_taken_only_where_there_is_room_now() {
        let budget = MemoryBudget::new(10 << 10, 10 << 10, 1 << 10, Duration::from_secs(2));
        let a = budget.try_reserve(6 << 10).unwrap();
        assert!(budget.try_reserve(5 << 10).is_none(), "4 KiB are left");
        let b = budget.try_reserve(4 << 10).unwrap();
        assert_eq!(budget.held_bytes(), 10 << 10);
        drop((a, b));
        assert!(budget.try_reserve(11 << 10).is_none(), "more than the whole budget");
        assert_eq!(budget.try_reserve(0).unwrap().bytes(), 0);
        assert_eq!(budget.held_bytes(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_peer_spends_its_own_share_and_may_take_all_of_it_at_once_when_it_holds_nothing() {
        let budget = MemoryBudget::new(16 << 10, 4 << 10, 1 << 10, Duration::from_secs(2));
        let peer = |ip: &str| Some(Peer::Address(crate::peer::PeerGroup::of(ip.parse().unwrap())));
        let (greedy, other) = (budget.for_peer(peer("192.0.2.7")), budget.for_peer(peer("192.0.2.8")));
        let a = greedy.reserve(3 << 10).await.unwrap();
        // Past its share, the peer waits the budget's wait and is refused, naming itself...
        let refused = greedy.reserve(2 << 10).await.unwrap_err();
        let share = OverBudget::PeerShare { bytes: 2 << 10, peer: "192.0.2.7".into(), share: 4 << 10, waited: Duration::from_secs(2) };
        assert_eq!(refused, share);
        assert!(refused.to_string().contains("`limits.memory_budget_bytes_per_peer`"), "{refused}");
        assert!(greedy.try_reserve(2 << 10).is_none());
        // ... while another peer, and a stream of no known address, are let in.
        let b = other.reserve(4 << 10).await.unwrap();
        let c = budget.for_peer(None).reserve(8 << 10).await.unwrap();
        assert_eq!(budget.held_bytes(), 15 << 10);
        drop((b, c));
        // A view of the same peer spends the same share; what is given back comes back to it.
        assert!(budget.for_peer(peer("192.0.2.7")).try_reserve(2 << 10).is_none(), "one share per peer");
        let mut a = a;
        drop(a.split_off(2 << 10));
        let d = greedy.reserve(3 << 10).await.unwrap();
        drop((a, d));
        // A request larger than the share takes all of it but one message (its call's own
        // message buffer): only when the peer holds no more than that.
        let message = greedy.reserve(1 << 10).await.unwrap();
        let mut big = greedy.reserve(12 << 10).await.unwrap();
        assert_eq!(budget.held_bytes(), 13 << 10);
        assert!(greedy.try_reserve(1).is_none(), "the share is taken");
        assert!(other.try_reserve(3 << 10).is_some(), "the rest of the budget is not");
        // Grown, a reservation takes no more of the share than one of that size.
        drop(message);
        budget.grow(&mut big, 14 << 10).await.unwrap();
        assert_eq!(budget.held_bytes(), 14 << 10);
        assert!(greedy.try_reserve(1 << 10).is_some(), "one message's room is left in the share");
        drop(big);
        assert_eq!(budget.held_bytes(), 0);
        assert!(greedy.try_reserve(4 << 10).is_some(), "the whole share is back");
    }

    #[tokio::test(start_paused = true)]
    async fn a_reservation_splits_merges_and_resizes_without_losing_a_unit() {
        let budget = MemoryBudget::new(10 << 10, 10 << 10, 1 << 10, Duration::from_secs(1));
        let mut a = budget.reserve(6 << 10).await.unwrap();
        let b = a.split_off(2 << 10);
        assert_eq!((a.bytes(), b.bytes(), budget.held_bytes()), (4 << 10, 2 << 10, 6 << 10));
        drop(b);
        assert_eq!(budget.held_bytes(), 4 << 10, "a split-off part gives its bytes back alone");
        // Splitting more than it holds takes what there is.
        let all = a.split_off(9 << 10);
        assert_eq!((a.bytes(), all.bytes()), (0, 4 << 10));
        a.merge(all);
        assert_eq!((a.bytes(), budget.held_bytes()), (4 << 10, 4 << 10));
        // Growing reserves the difference; shrinking gives the surplus back.
        let a = budget.resize(a, 9 << 10).await.unwrap();
        assert_eq!((a.bytes(), budget.held_bytes()), (9 << 10, 9 << 10));
        let a = budget.resize(a, 1500).await.unwrap();
        assert_eq!((a.bytes(), budget.held_bytes()), (1500, 2 << 10));
        // Growing past the budget is refused, and what it held is given back.
        assert!(budget.resize(a, 11 << 10).await.is_err());
        assert_eq!(budget.held_bytes(), 0);
        let mut none = Reservation::none();
        assert_eq!(none.split_off(5).bytes(), 0);
    }
}
