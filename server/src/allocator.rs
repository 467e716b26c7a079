//! glibc's allocator, set to give freed memory back to the system at once.
//!
//! Frames, tensors and answers of 128 KiB and more are allocated on one thread and freed on
//! another. With glibc's default, adaptive mmap threshold (it rises to the largest block
//! freed, up to 32 MiB) such blocks come from the arenas and stay there once freed, so the
//! server's RSS stays near its peak long after a burst is answered (`make hostile-rss`: +3.2
//! GiB still held after a slow-reader attack ended, +0.3 GiB with the fixed thresholds). A
//! fixed threshold of 128 KiB maps each large block on its own and unmaps it when freed.
//!
//! `MALLOC_MMAP_THRESHOLD_` or `MALLOC_TRIM_THRESHOLD_` in the environment win: the
//! operator's choice is kept.
#![allow(unsafe_code)]

/// The block size from which glibc maps each block on its own (and the free top of the
/// heap it keeps): glibc's own default before it adapts.
const THRESHOLD_BYTES: i32 = 128 << 10;

/// Fixes glibc's mmap and trim thresholds at [`THRESHOLD_BYTES`] for this process, unless
/// the environment sets either. Returns whether they were set. Call it first in `main`.
pub fn give_back_freed_memory() -> bool {
    let operator_set = ["MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"].iter().any(|name| std::env::var_os(name).is_some());
    !operator_set && set_thresholds()
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn set_thresholds() -> bool {
    // SAFETY: `mallopt` takes plain integers and sets allocator parameters under the main
    // arena's lock; glibc marks it MT-unsafe only for initializing malloc on a first call,
    // which Rust's runtime has done (it allocates before `main`). The `server` binary calls
    // this first, before any thread of its own starts.
    unsafe { libc::mallopt(libc::M_MMAP_THRESHOLD, THRESHOLD_BYTES) == 1 && libc::mallopt(libc::M_TRIM_THRESHOLD, THRESHOLD_BYTES) == 1 }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn set_thresholds() -> bool {
    false
}
