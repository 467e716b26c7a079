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
//! (`malloc_trim`) once the allocator holds `limits.free_memory_kept_bytes` more of it than
//! at its low point since the last trim: after a burst of peers' buffers (`make
//! hostile-rss`), not while the stages reuse theirs. `MALLOC_MMAP_THRESHOLD_` or
//! `MALLOC_TRIM_THRESHOLD_` in the environment win: the operator's choice is kept.
#![allow(unsafe_code)]

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

/// Gives freed memory back to the system after bursts (see the module's comment).
#[derive(Debug)]
pub struct Trimmer {
    kept_bytes: u64,
    /// The least freed memory seen since the last trim.
    low_bytes: u64,
}

impl Trimmer {
    /// A trimmer that lets the allocator keep `kept_bytes` of freed memory above its low point.
    pub fn new(kept_bytes: u64) -> Self {
        Self { kept_bytes, low_bytes: free_bytes() }
    }

    /// Looks once: trims when more than `kept_bytes` was freed since the low point. Returns
    /// whether it trimmed.
    pub fn tick(&mut self) -> bool {
        let free = free_bytes();
        self.low_bytes = self.low_bytes.min(free);
        if free - self.low_bytes <= self.kept_bytes {
            return false;
        }
        give_back();
        // Trimmed chunks stay free chunks (their pages unmapped), so the count barely moves:
        // it is the new low point.
        self.low_bytes = free_bytes();
        true
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
