//! Freed memory kept for reuse while the server works, given back after a burst.
//!
//! Frames, tensors and answers are allocated on one thread and freed on another, and the
//! stages allocate and free their activations on every request. glibc gives a freed block
//! back to the system at once when it was mapped on its own (128 KiB or more, until its
//! adaptive threshold rises) or when it leaves more than the trim threshold free at the top
//! of its heap: then the next request faults the same memory in again, page by page. With
//! the thresholds fixed at 128 KiB (9be833c) a third of the CPU stages' time went to page
//! faults (`split-overhead`: the server's suffix 1.2-1.7x the same stages in one process);
//! with glibc's adaptive defaults each request's 3 MiB boundary still went back and came
//! again (an `madvise` per request).
//!
//! So [`keep_freed_memory`] maps on their own only blocks of 32 MiB or more (glibc's largest
//! threshold) and never trims on free, and a [`Trimmer`] thread gives the freed memory back
//! (`malloc_trim`) once the allocator has held `limits.free_memory_kept_bytes` more of it than
//! at its low point since the last trim, at every look for [`QUIET_LOOKS`] looks in a row:
//! after a burst of peers' buffers (`make hostile-rss`), not while the stages reuse theirs.
//! A rise alone is not enough: requests whose working set is larger than what is kept (a
//! resnet18 batch of 8 frees some 200 MiB each) would be trimmed between any two of them,
//! and each would fault its memory in again (a quarter of the server's receiving time at
//! batch 8). `MALLOC_MMAP_THRESHOLD_` or `MALLOC_TRIM_THRESHOLD_` in the environment win:
//! the operator's choice is kept.
#![allow(unsafe_code)]

use std::collections::VecDeque;
use std::time::Duration;

/// Blocks this large or larger are mapped on their own, and unmapped when freed (glibc's
/// largest mmap threshold on 64 bits).
const MAP_ON_THEIR_OWN_BYTES: i32 = 32 << 20;

/// Keeps freed blocks under 32 MiB in the allocator for reuse (they are given back by a
/// [`Trimmer`]), unless the environment sets glibc's thresholds. Returns whether it set
/// them. Call it first in `main`.
pub fn keep_freed_memory() -> bool {
    let operator_set = ["MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"].iter().any(|name| std::env::var_os(name).is_some());
    !operator_set && set_thresholds()
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn set_thresholds() -> bool {
    // SAFETY: `mallopt` takes plain integers and sets allocator parameters under the main
    // arena's lock; glibc marks it MT-unsafe only for initializing malloc on a first call,
    // which Rust's runtime has done (it allocates before `main`), and a later call only
    // changes what the next allocations and frees do.
    unsafe { libc::mallopt(libc::M_MMAP_THRESHOLD, MAP_ON_THEIR_OWN_BYTES) == 1 && libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX) == 1 }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn set_thresholds() -> bool {
    false
}

/// How often the trimmer looks at the allocator.
pub const TRIM_EVERY: Duration = Duration::from_millis(250);

/// Looks in a row at which freed memory must stay above what is kept before it is given
/// back: 2 s.
pub const QUIET_LOOKS: usize = 8;

/// Gives freed memory back to the system after bursts (see the module's comment).
#[derive(Debug)]
pub struct Trimmer {
    kept_bytes: u64,
    /// The least freed memory seen since the last trim.
    low_bytes: u64,
    /// Freed memory at the last [`QUIET_LOOKS`] looks, the newest last.
    recent: VecDeque<u64>,
}

impl Trimmer {
    /// A trimmer that lets the allocator keep `kept_bytes` of freed memory above its low point.
    pub fn new(kept_bytes: u64) -> Self {
        Self::starting_at(kept_bytes, free_bytes())
    }

    fn starting_at(kept_bytes: u64, free: u64) -> Self {
        Self { kept_bytes, low_bytes: free, recent: VecDeque::with_capacity(QUIET_LOOKS) }
    }

    /// Looks once: trims when more than `kept_bytes` has stayed freed beyond the low point
    /// for [`QUIET_LOOKS`] looks. Returns whether it trimmed.
    pub fn tick(&mut self) -> bool {
        if !self.look(free_bytes()) {
            return false;
        }
        give_back();
        // Trimmed chunks stay free chunks (their pages unmapped), so the count barely moves:
        // it is the new low point.
        self.low_bytes = free_bytes();
        true
    }

    /// Takes the freed memory seen at one look; returns whether to trim.
    fn look(&mut self, free: u64) -> bool {
        self.low_bytes = self.low_bytes.min(free);
        if self.recent.len() == QUIET_LOOKS {
            self.recent.pop_front();
        }
        self.recent.push_back(free);
        let stayed_free = self.recent.iter().copied().min().unwrap_or(free);
        let trim = self.recent.len() == QUIET_LOOKS && stayed_free - self.low_bytes > self.kept_bytes;
        if trim {
            self.recent.clear();
        }
        trim
    }

    /// Runs the trimmer on a thread of its own (`cleave-trim`), every [`TRIM_EVERY`].
    pub fn spawn(mut self) -> std::io::Result<()> {
        std::thread::Builder::new().name("cleave-trim".into()).spawn(move || loop {
            std::thread::sleep(TRIM_EVERY);
            if self.tick() {
                tracing::debug!(free_bytes = free_bytes(), "freed memory given back to the system");
            }
        })?;
        Ok(())
    }
}

/// Bytes the allocator holds freed, in every arena (given back or not).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
pub fn free_bytes() -> u64 {
    // SAFETY: `mallinfo2` only reads the allocator's statistics, under each arena's lock, and
    // returns them by value.
    unsafe { libc::mallinfo2() }.fordblks as u64
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn give_back() {
    // SAFETY: `malloc_trim` takes a plain integer (the top pad to keep) and returns the free
    // pages of every arena to the system under each arena's lock; nothing is moved or freed
    // that a caller holds.
    unsafe { libc::malloc_trim(0) };
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub fn free_bytes() -> u64 {
    0
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn give_back() {}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn requests_larger_than_what_is_kept_are_not_trimmed_between_them() {
        // 200 MiB in use during each request, freed between them; some looks fall inside.
        let mut trimmer = Trimmer::starting_at(64 * MIB, 10 * MIB);
        for look in 0..100 {
            let free = if look % 3 == 0 { 10 * MIB } else { 210 * MIB };
            assert!(!trimmer.look(free), "look {look}: trimmed while requests reuse their memory");
        }
    }

    #[test]
    fn a_burst_that_stays_freed_is_given_back_once() {
        let mut trimmer = Trimmer::starting_at(64 * MIB, 10 * MIB);
        for look in 1..QUIET_LOOKS {
            assert!(!trimmer.look(266 * MIB), "look {look}: not yet {QUIET_LOOKS} looks");
        }
        assert!(trimmer.look(266 * MIB), "256 MiB freed for {QUIET_LOOKS} looks is more than the 64 MiB kept");
        // As `tick` does: what was trimmed still counts as freed, and is the new low point.
        trimmer.low_bytes = 266 * MIB;
        assert!((0..3 * QUIET_LOOKS).all(|_| !trimmer.look(266 * MIB)), "nothing more to give back");
        // Within what is kept, however long it stays: left alone.
        let mut trimmer = Trimmer::starting_at(64 * MIB, 10 * MIB);
        assert!((0..3 * QUIET_LOOKS).all(|_| !trimmer.look(60 * MIB)));
    }
}
