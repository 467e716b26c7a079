//! Split generation (`Generate`): sessions whose key/value caches the server keeps while
//! the host keeps the tokens. `admission` holds the places and the cache budget, `session`
//! one session's caches and rows, `queue` a model's steps (batched across sessions),
//! `stream` a stream's frames, `sealing` its sealed steps and answers.

pub(crate) mod admission;
pub(crate) mod queue;
mod sealing;
mod session;
pub(crate) mod stream;
