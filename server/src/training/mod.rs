//! Training sessions: the `Train` stream.
//!
//! A session is one stream. Its first frame opens it ([`admission`]: the request checked,
//! at most one session per bundle unless configured); the server then loads a fresh copy of
//! stages `[start, end)` in training mode on the session's own thread ([`session`]: autograd
//! state is per thread, and the inference worker keeps serving the exported weights
//! meanwhile), with the session's optimizer and, when `end` is the last cut, its loss. Every
//! later call is answered in order with exactly one reply or one error, and a failed call
//! leaves the session open ([`stream`]). Checkpoints go into a namespace the session holds
//! alone, within a count and a byte quota ([`checkpoints`]). The sessions of a client group
//! share one copy of their stages and take their steps in a fixed order ([`group`]).

pub(crate) mod admission;
pub(crate) mod checkpoints;
pub(crate) mod group;
pub(crate) mod parking;
pub(crate) mod session;
pub(crate) mod stream;
