//! The server's own times for a request or a step, as it reports them with each answer.

/// The server's own timings for one request, in milliseconds.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct ServerTimes {
    /// Waiting for the compute worker.
    pub queue_ms: f64,
    /// Decoding the boundary.
    pub decode_ms: f64,
    /// Running the suffix.
    pub compute_ms: f64,
    /// Encoding the result.
    pub encode_ms: f64,
}

impl ServerTimes {
    /// Everything the server spent.
    pub fn total_ms(&self) -> f64 {
        self.queue_ms + self.decode_ms + self.compute_ms + self.encode_ms
    }
}

impl From<cleave_common::pb::ServerTimings> for ServerTimes {
    fn from(t: cleave_common::pb::ServerTimings) -> Self {
        let ms = |us: u64| us as f64 / 1e3;
        Self { queue_ms: ms(t.queue_us), decode_ms: ms(t.decode_us), compute_ms: ms(t.compute_us), encode_ms: ms(t.encode_us) }
    }
}

/// The times of a step sent in several messages.
impl std::ops::Add for ServerTimes {
    type Output = Self;

    fn add(self, other: Self) -> Self {
        Self {
            queue_ms: self.queue_ms + other.queue_ms,
            decode_ms: self.decode_ms + other.decode_ms,
            compute_ms: self.compute_ms + other.compute_ms,
            encode_ms: self.encode_ms + other.encode_ms,
        }
    }
}
