//! One memory budget for the request bytes every stream holds together: a request reserves
//! what its envelope declares (the data as received plus the tensors it decodes into) before
//! anything is allocated for it, and gives it back when it is answered or dropped.

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

/// Bytes held against the budget; dropping it gives them back.
#[derive(Debug)]
pub struct Reservation {
    _permit: Option<OwnedSemaphorePermit>,
    bytes: u64,
}

impl Reservation {
    /// The bytes reserved.
    pub fn bytes(&self) -> u64 {
        self.bytes
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
}
