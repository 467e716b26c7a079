//! Freed memory is kept for reuse, and the trimmer gives a burst of it back while leaving
//! steady reuse alone. A test binary of its own: it reads the process's RSS, which other
//! tests would move.

use cleave_server::allocator::{keep_freed_memory, Trimmer};

const MIB: usize = 1 << 20;

fn rss_bytes() -> usize {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("statm");
    let pages: usize = statm.split_whitespace().nth(1).expect("resident").parse().expect("pages");
    pages * 4096
}

/// Allocates `count` blocks of `size` bytes on a thread of its own (as a stream's buffers
/// are), writes them and frees them there. A small allocation after each stays alive (as
/// the server's long-lived ones do): glibc unmaps by itself a 64 MiB heap of a thread's
/// arena once all of it is free.
fn burst(count: usize, size: usize) -> Vec<Vec<u8>> {
    std::thread::spawn(move || {
        let (blocks, pins): (Vec<Vec<u8>>, Vec<Vec<u8>>) = (0..count).map(|i| (vec![i as u8 | 1; size], vec![1u8; 64])).unzip();
        std::hint::black_box(&blocks);
        pins
    })
    .join()
    .unwrap()
}

#[test]
fn freed_memory_is_kept_for_reuse_until_a_burst_is_given_back() {
    assert!(keep_freed_memory(), "the server's thresholds are set (no MALLOC_*_THRESHOLD_ in the environment)");
    // A freed block of a few MiB (a request's boundary) stays, for the next one to reuse
    // without faulting its pages in again; glibc's defaults would unmap it.
    let before = rss_bytes();
    drop(std::hint::black_box(vec![1u8; 8 * MIB]));
    let after = rss_bytes();
    assert!(after >= before + 7 * MIB, "the freed 8 MiB stays in the process: RSS {before} then {after}");

    let mut trimmer = Trimmer::new(64 * MIB as u64);
    // Less than the trimmer keeps, freed again and again: left alone.
    let mut pins = Vec::new();
    for _ in 0..3 {
        pins.push(burst(16, MIB));
        assert!(!trimmer.tick(), "16 MiB freed is within the 64 MiB kept");
    }

    let before = rss_bytes();
    pins.push(burst(256, MIB));
    let held = rss_bytes();
    assert!(held >= before + 200 * MIB, "the freed burst stays in the process: RSS {before} then {held}");
    assert!(trimmer.tick(), "256 MiB freed is more than the 64 MiB kept");
    let after = rss_bytes();
    assert!(after + 200 * MIB <= held, "trimmed, the burst is given back: RSS {held} then {after}");
    // What was given back is the new low point: nothing more to do.
    assert!(!trimmer.tick());
}
