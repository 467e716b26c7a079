//! Dropout masks as a function of (session seed, step, stage index): before stage `i` runs in
//! training step `t`, libtorch's generator is seeded with [`stage_seed`], under one lock, so
//! masks do not depend on where the model is split or on which process runs a stage.

use std::sync::{Mutex, MutexGuard};

/// The seed of stage `stage`'s random draws (dropout) in training step `step` of a session
/// seeded with `seed` (SplitMix64 over the three, so nearby inputs give unrelated seeds).
pub fn stage_seed(seed: u64, step: u64, stage: usize) -> i64 {
    let mut z = seed ^ step.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (stage as u64).wrapping_mul(0xD1B5_4A32_D192_ED03);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    ((z ^ (z >> 31)) >> 1) as i64
}

/// The session seed of micro-batch `index` of a step: the session's own for the first, so
/// a step of one batch draws the masks it always drew.
pub(crate) fn microbatch_seed(seed: u64, index: u32) -> u64 {
    seed ^ u64::from(index).wrapping_mul(0xA24B_AED4_963E_E407)
}

/// libtorch's default generator is process-wide: a training stage holds this lock from
/// seeding it to the end of its forward pass, so that two parts training in one process
/// (`--loopback`) cannot interleave their draws.
static GENERATOR: Mutex<()> = Mutex::new(());

pub(crate) fn seeded_generator(seed: i64) -> MutexGuard<'static, ()> {
    let guard = GENERATOR.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    tch::manual_seed(seed);
    guard
}
