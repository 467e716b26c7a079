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
//!
//! And the server runs with glibc's per-thread cache of small blocks off
//! ([`restart_without_thread_cache`]): a block in that cache is never merged with its free
//! neighbours, so a small block cut from a request's freed tensor and cached stays in the
//! middle of it, and the next request's tensor no longer fits there. While the result window
//! filled, every request's tensor came from fresh pages (`bench/protocol-cpu`, resnet18 cut 3:
//! 705 page faults a request for a 3.1 MiB boundary, against none without the cache, and a
//! quarter less of the runtime's processor time); small requests cost the same either way.
#![allow(unsafe_code)]

use std::ffi::{OsStr, OsString};
use std::time::Duration;

/// The allocator as the server runs with it: restarted without glibc's thread cache, then
/// freed memory kept (see the module's comment). Call it first in `main`, before any thread
/// starts; it returns only when it did not restart, with the error when it could not (for
/// the caller to say: logging is not set up yet).
pub fn set_up() -> Option<std::io::Error> {
    let not_restarted = restart_without_thread_cache();
    keep_freed_memory();
    not_restarted
}

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

/// The glibc tunable that turns its per-thread cache of small blocks off.
const NO_THREAD_CACHE: &str = "glibc.malloc.tcache_count=0";

/// Starts this program again with glibc's per-thread cache off (see the module's comment),
/// unless `GLIBC_TUNABLES` sets that cache already: the operator's choice, or this is the
/// second start. glibc reads its tunables only when a program starts, so call it first in
/// `main`. Returns only when it does not start again, with the error when it could not.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
pub fn restart_without_thread_cache() -> Option<std::io::Error> {
    use std::os::unix::process::CommandExt;
    let tunables = tunables_without_thread_cache(std::env::var_os("GLIBC_TUNABLES").as_deref())?;
    let mut args = std::env::args_os();
    let program = match std::env::current_exe() {
        Ok(program) => program,
        Err(e) => return Some(e),
    };
    let mut again = std::process::Command::new(program);
    again.arg0(args.next().unwrap_or_default()).args(args).env("GLIBC_TUNABLES", tunables);
    Some(again.exec())
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub fn restart_without_thread_cache() -> Option<std::io::Error> {
    None
}

/// `GLIBC_TUNABLES` with the per-thread cache off added, or None when it sets that cache.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn tunables_without_thread_cache(tunables: Option<&OsStr>) -> Option<OsString> {
    let Some(tunables) = tunables.filter(|t| !t.is_empty()) else { return Some(NO_THREAD_CACHE.into()) };
    if tunables.to_string_lossy().split(':').any(|t| t.starts_with("glibc.malloc.tcache_count=")) {
        return None;
    }
    let mut with = tunables.to_owned();
    with.push(":");
    with.push(NO_THREAD_CACHE);
    Some(with)
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

#[cfg(all(test, target_os = "linux", target_env = "gnu"))]
mod tests {
    use super::*;

    #[test]
    fn the_thread_cache_goes_off_unless_the_tunables_set_it() {
        let with = |t: &str| tunables_without_thread_cache(Some(OsStr::new(t))).map(|t| t.into_string().unwrap());
        assert_eq!(tunables_without_thread_cache(None).unwrap(), NO_THREAD_CACHE);
        assert_eq!(with("").as_deref(), Some(NO_THREAD_CACHE));
        assert_eq!(with("glibc.malloc.arena_max=2").as_deref(), Some("glibc.malloc.arena_max=2:glibc.malloc.tcache_count=0"));
        // The operator's value, and the second start, are kept as they are.
        assert_eq!(with("glibc.malloc.tcache_count=7"), None);
        assert_eq!(with("glibc.malloc.arena_max=2:glibc.malloc.tcache_count=0"), None);
        // A tunable that only begins alike is another one.
        assert_eq!(with("glibc.malloc.tcache_count_x=1").as_deref(), Some("glibc.malloc.tcache_count_x=1:glibc.malloc.tcache_count=0"));
    }
}
