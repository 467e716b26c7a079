//! cleave's client library: the link from a program to a cleave server, and nothing else.
//!
//! - [`Link`]: how to reach a server (TLS trust, bearer token, payload key, timeouts);
//!   [`RetryPolicy`]: how often and how patiently to try again.
//! - [`connect`] (once), [`connect_retrying`] (with backoff), [`connect_first`] (the first of
//!   several that answers): a [`ServerSession`] with a server that serves the caller's bundle,
//!   after its `Info` passed the protocol version and bundle checks.
//! - [`Connector`]: connecting again, written once ([`connect_retrying`], [`connect_first`] and
//!   each [`server_link::ServerLink`]'s task): servers in turn, backoff, giving up, the count in
//!   a [`LinkHealth`].
//! - [`InferSetup`] opens an [`InferStream`] on a session: send a boundary as tensors
//!   ([`InferStream::send_boundary`]) or a request's frames as encoded, receive each
//!   [`InferAnswer`] reassembled and decoded into a boundary (or the server's error for it).
//! - [`server_link::ServerLink`]: one server among several, as a tower service a balancer picks
//!   between; the task behind it connects, reconnects with backoff, follows the model on the
//!   server's health service, and hands back each answer, or the request to send elsewhere.
//! - [`GenerateLink`]: a `Generate` session on a server: one step at a time, each answered
//!   with the output tensor asked for (sealed whole with the link's key when it has one).
//! - [`TrainLink`]: a training session on a server, as blocking calls from a training
//!   thread (forward, backward, evaluate, save, ...), reattached and resent under the same
//!   ids when the connection breaks.
//! - [`LinkError`]: why a server cannot be reached or refuses, and whether trying again
//!   could help ([`LinkError::is_lasting`]).
//!
//! Architecture invariant: this crate and everything it depends on pull in no plotting, table,
//! progress-bar, tokenizer or CLI crate (`make lint` checks it); `cleave-host` keeps its CLI,
//! planning, reports and plots on top of it.
//!
//! A program that runs a bundle's first stages itself and the rest on a server (the bundle's
//! stages and values come from `cleave-common`, re-exported here as [`cleave_common`]):
//!
//! ```no_run
//! use std::time::Duration;
//!
//! use cleave_client::cleave_common::{Boundary, DeviceSpec, LoadedStages, StageRange};
//! use cleave_client::{connect, Bundle, Codec, InferSetup, Link, PayloadSender};
//!
//! # async fn run(inputs: Boundary) -> Result<(), Box<dyn std::error::Error>> {
//! let bundle = Bundle::open("bundles/resnet18")?;
//! let session = connect("http://127.0.0.1:50051", &bundle, &Link::plain()).await?;
//! let codec: Codec = "shuffle+lz4".parse()?;
//! let mut stream = InferSetup::new(vec![codec], None, Duration::from_secs(5)).open(&session).await?;
//!
//! let split = 3;
//! let edge = LoadedStages::load(&bundle, StageRange::prefix(split), DeviceSpec::Cpu)?;
//! let boundary = edge.run(StageRange::prefix(split), &inputs)?;
//! // One sender for every request of the run (with a key: `PayloadSender::sealed`).
//! let mut sender = PayloadSender::plain();
//! stream.send_boundary(&mut sender, 0, split as u32, &codec, &boundary)?;
//! let answer = stream.next_answer().await?;
//! let outputs: Boundary = answer.output?;
//! # let _ = outputs;
//! # Ok(())
//! # }
//! ```

pub mod connector;
pub mod error;
pub mod generate;
pub mod infer;
pub mod link;
pub mod server_link;
pub mod session;
pub mod times;
pub mod train;

pub use cleave_common;
pub use cleave_common::wire::{Codec, Key, PayloadSender};
pub use cleave_common::{Boundary, Bundle};
pub use connector::{connect_first, connect_retrying, Connector, LinkFailure, LinkHealth, LinkState};
pub use error::{Breach, BundleMismatch, ConnectFailure, LinkError, LinkLost, Refusal, StreamError};
pub use generate::{GenerateAnswer, GenerateLink};
pub use infer::{AnswerError, InferAnswer, InferSetup, InferStream};
pub use link::{Backoff, Link, RetryPolicy};
pub use session::{check_server_accepts, connect, endpoint, CallHeaders, Client, ServerSession};
pub use times::ServerTimes;
pub use train::{SessionRequest, TrainAnswer, TrainLink, TrainReconnect};
