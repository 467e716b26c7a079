//! What `host --config` is given beside its config, whichever job the config holds:
//! [`RunOptions`], taken by an inference run (`crate::run`) and a training run
//! (`crate::training`) alike, so that neither needs the other.

use std::path::PathBuf;

use cleave_common::bundle::SplitSpec;

use crate::files::OutputMode;
use crate::progress::Progress;

/// Command-line overrides of `edge.yaml`.
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    /// Start the server in this process on 127.0.0.1 (an ephemeral port) and use it.
    pub loopback: bool,
    /// Overrides `split`.
    pub split: Option<SplitSpec>,
    /// Overrides `output`.
    pub output: Option<PathBuf>,
    /// What to do when `output` holds an earlier run.
    pub output_mode: OutputMode,
    /// Where the run's events go (the cut it starts at, a resumed run, each epoch).
    pub progress: Progress,
}
