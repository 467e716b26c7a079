//! The trimmer gives a burst's freed memory back to the system and leaves steady reuse alone.
//! A test binary of its own: it reads the process's RSS, which other tests would move.

use cleave_server::allocator::Trimmer;

const MIB: usize = 1 << 20;

fn rss_bytes() -> usize {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("statm");
    let pages: usize = statm.split_whitespace().nth(1).expect("resident").parse().expect("pages");
    pages * 4096
}

/// Allocates `count` blocks of `size` bytes on a thread of its own (as a stream's buffers
/// are), writes them and frees them there. A small allocation after each stays alive (as
/// the server's long-lived ones do), so the freed blocks cannot merge into the heap's top,
/// which glibc gives back by itself.
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
fn a_burst_is_given_back_and_steady_reuse_is_not() {
    // A freed 8 MiB block raises glibc's adaptive mmap threshold above 1 MiB: the burst's
    // blocks then come from an arena and stay there once freed.
    drop(std::hint::black_box(vec![1u8; 8 * MIB]));
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
