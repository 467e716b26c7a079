//! Processor time, as a weak or capped edge device spends it: a thread's own and the whole
//! process's (every thread, those that ended included). On a capped edge a request's wall
//! time is its processor time stretched by the cap, so these tell slower work from waiting.

use std::time::Duration;

use nix::time::{clock_gettime, ClockId};

/// Processor time the calling thread has used so far.
pub fn thread() -> Duration {
    read(ClockId::CLOCK_THREAD_CPUTIME_ID)
}

/// Processor time the process has used so far, all its threads together.
pub fn process() -> Duration {
    read(ClockId::CLOCK_PROCESS_CPUTIME_ID)
}

/// Zero where the clock cannot be read (never on Linux: both clocks always exist).
fn read(clock: ClockId) -> Duration {
    clock_gettime(clock).map(Duration::from).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    #[test]
    fn a_thread_clock_counts_its_work_and_not_its_sleep() {
        // The process clock is read first and last, so its span holds the thread's.
        let process = super::process();
        let thread = super::thread();
        // Ends only because the thread clock moves while this thread works.
        while super::thread() - thread < Duration::from_millis(20) {
            std::hint::black_box(0u64);
        }
        let worked = super::thread() - thread;
        // The process clock may leave out the running thread's time since the last
        // scheduler tick (a few ms).
        let counted = super::process() - process;
        assert!(counted + Duration::from_millis(10) >= worked, "the process clock counts this thread's time too: {counted:?} of {worked:?}");
        let before = super::thread();
        std::thread::sleep(Duration::from_millis(50));
        assert!(super::thread() - before < Duration::from_millis(10), "sleeping is not processor time");
    }
}
