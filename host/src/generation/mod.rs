//! Split generation on the edge: the embedding and the first layers run here with their
//! caches, the server runs the middle layers with theirs over a `Generate` stream, and the
//! head runs on the server, or here with `tail_on_edge` (U-shaped: neither tokens nor logits
//! leave the edge). The edge keeps where each row stands and sends it with every step.
//! `split` holds a session (its stream is `cleave_client::GenerateLink`), `sampling` the
//! choice of each token and `run` `host generate`'s loop, `text` its tokenizer.

mod run;
mod sampling;
mod split;
mod text;

pub use run::{generate, generate_on, GenerateOptions, Generated, Servers, TokenTime};
pub use sampling::{Sampler, Sampling};
pub use split::{GenerationSplit, Scores, SplitGenerator};
pub use text::TextTokenizer;
