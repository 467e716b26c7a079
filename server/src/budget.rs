//! One memory budget for the bytes every stream holds together. A request reserves what its
//! envelope declares (the data as received plus the tensors it decodes into), or the room its
//! answer will take where that is more, before anything is allocated for it (a result never
//! waits for room outside the budget); when it is answered, its reservation becomes its
//! answer's, which is
//! held until the answer is written to its connection (see [`crate::unsent`]), or dropped.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// The budget counts in KiB so that one request of any allowed size fits a semaphore's `u32`.
const UNIT: u64 = 1024;

/// The budget, shared by every stream of a server.
#[derive(Debug, Clone)]
pub struct MemoryBudget {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    units: Arc<Semaphore>,
    total_units: u64,
    wait: Duration,
    /// The most ever held at once, in units (what tests and benches read).
    peak_units: AtomicU64,
}

/// Bytes held against the budget; dropping it gives them back. The default holds nothing.
#[derive(Debug, Default)]
pub struct Reservation {
    _permit: Option<OwnedSemaphorePermit>,
    bytes: u64,
}

impl Reservation {
    /// Nothing reserved (what an answer of no size holds).
    pub fn none() -> Self {
        Self { _permit: None, bytes: 0 }
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
        let taken = permit.split(units).map(|p| Self { bytes: (units as u64 * UNIT).min(self.bytes), _permit: Some(p) });
        let taken = taken.unwrap_or_else(Self::none);
        self.bytes -= taken.bytes;
        taken
    }

    /// Adds `other`'s bytes to this reservation (both from one budget).
    pub fn merge(&mut self, other: Self) {
        self.bytes += other.bytes;
        match (&mut self._permit, other._permit) {
            (Some(mine), Some(theirs)) => mine.merge(theirs),
            (mine @ None, theirs) => *mine = theirs,
            (Some(_), None) => {}
        }
    }

    /// Gives back what it holds beyond `bytes`.
    pub fn shrink_to(&mut self, bytes: u64) {
        let keep = self.split_off(bytes);
        *self = keep;
    }
}

/// Why a reservation was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{bytes} request bytes do not fit in the server's memory budget of {budget} bytes (`limits.memory_budget_bytes`) within {waited:?}")]
pub struct OverBudget {
    /// What the request asked for.
    pub bytes: u64,
    /// The whole budget.
    pub budget: u64,
    /// How long it waited.
    pub waited: Duration,
}

impl MemoryBudget {
    /// A budget of `bytes`; a reservation waits at most `wait` for room.
    pub fn new(bytes: u64, wait: Duration) -> Self {
        let total_units = (bytes / UNIT).min(Semaphore::MAX_PERMITS as u64);
        Self { inner: Arc::new(Inner { units: Arc::new(Semaphore::new(total_units as usize)), total_units, wait, peak_units: AtomicU64::new(0) }) }
    }

    /// Reserves `bytes`, waiting up to the budget's wait for others to give room back.
    pub async fn reserve(&self, bytes: u64) -> Result<Reservation, OverBudget> {
        let units = bytes.div_ceil(UNIT);
        let refused = || OverBudget { bytes, budget: self.total_bytes(), waited: self.inner.wait };
        if units == 0 {
            return Ok(Reservation { _permit: None, bytes });
        }
        if units > self.inner.total_units {
            return Err(OverBudget { waited: Duration::ZERO, ..refused() });
        }
        let units32 = u32::try_from(units).map_err(|_| refused())?;
        let acquire = Arc::clone(&self.inner.units).acquire_many_owned(units32);
        let permit = tokio::time::timeout(self.inner.wait, acquire).await.map_err(|_| refused())?.map_err(|_| refused())?;
        let held = self.inner.total_units - self.inner.units.available_permits() as u64;
        self.inner.peak_units.fetch_max(held, Ordering::Relaxed);
        Ok(Reservation { _permit: Some(permit), bytes })
    }

    /// Reserves `bytes` if there is room now, without waiting: for what can be done without
    /// them (a batch that can run request by request).
    pub fn try_reserve(&self, bytes: u64) -> Option<Reservation> {
        let units = u32::try_from(bytes.div_ceil(UNIT)).ok()?;
        if units == 0 {
            return Some(Reservation { _permit: None, bytes });
        }
        let permit = Arc::clone(&self.inner.units).try_acquire_many_owned(units).ok()?;
        let held = self.inner.total_units - self.inner.units.available_permits() as u64;
        self.inner.peak_units.fetch_max(held, Ordering::Relaxed);
        Some(Reservation { _permit: Some(permit), bytes })
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
    /// as it was when refused: a stream's read buffer growing to its largest frame.
    pub async fn grow(&self, held: &mut Reservation, bytes: u64) -> Result<(), OverBudget> {
        let units = |b: u64| b.div_ceil(UNIT);
        if units(held.bytes) < units(bytes) {
            held.merge(self.reserve((units(bytes) - units(held.bytes)) * UNIT).await?);
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
        let budget = MemoryBudget::new(10 << 10, Duration::from_secs(2));
        let a = budget.reserve(6 << 10).await.unwrap();
        assert_eq!(budget.held_bytes(), 6 << 10);
        // 6 + 6 KiB do not fit in 10: the second waits the budget's wait, then is refused.
        let refused = budget.reserve(6 << 10).await.unwrap_err();
        assert_eq!(refused, OverBudget { bytes: 6 << 10, budget: 10 << 10, waited: Duration::from_secs(2) });
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
        assert_eq!(budget.reserve(11 << 10).await.unwrap_err().waited, Duration::ZERO);
        // Bytes count in whole KiB, rounded up.
        let r = budget.reserve(1).await.unwrap();
        assert_eq!((r.bytes(), budget.held_bytes()), (1, 1 << 10));
    }

    #[test]
    fn a_reservation_tried_is_taken_only_where_there_is_room_now() {
        let budget = MemoryBudget::new(10 << 10, Duration::from_secs(2));
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
    async fn a_reservation_splits_merges_and_resizes_without_losing_a_unit() {
        let budget = MemoryBudget::new(10 << 10, Duration::from_secs(1));
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
