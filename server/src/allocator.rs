//! Freed memory given back to the system after a burst, without slowing the stages.
//!
//! Frames, tensors and answers are allocated on one thread and freed on another. With
//! glibc's adaptive mmap threshold (it rises to the largest block freed, up to 32 MiB) such
//! blocks come from the arenas and stay there once freed, so after a burst of peers' buffers
//! the server's RSS stays near its peak (`make hostile-rss`: +3.2 GiB held after a
//! slow-reader attack ended). Fixing the thresholds at 128 KiB gave those back at once, but
//! every activation of 128 KiB or more was then mapped and unmapped on each request: a third
//! of the CPU stages' time went to page faults (`split-overhead`: the server's suffix 1.2-1.7x
//! the same stages in one process).
//!
//! So the thresholds stay adaptive (the stages reuse their activations' memory), and a
//! [`Trimmer`] thread gives the freed memory back (`malloc_trim`) once the allocator holds
//! `limits.free_memory_kept_bytes` more of it than at its low point since the last trim: a
//! burst, not the stages' steady reuse. The environment's `MALLOC_*_` settings still apply.
#![allow(unsafe_code)]

use std::time::Duration;

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
