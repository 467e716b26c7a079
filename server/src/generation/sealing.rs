//! A `Generate` stream's sealed steps and answers (`encryption`): a step may come sealed
//! whole with one of the server's keys, and its answer goes back sealed whole with the key
//! of the stream's first sealed step, one nonce sequence each way. Where sealing is
//! required, a plain step is refused; the opening frame carries no model data and stays plain.

use cleave_common::pb::{self, SealedMessage};
use cleave_common::protocol::{SEALED_REPLY_KIND, SEALED_STEP_KIND};
use cleave_common::wire::{CodecError, KeyRing, Opener, Sealer, WireError};
use prost::Message;

use crate::error::{GenerationError, RequestError};

/// One stream's seals: its opener, and its answers' sealer once a sealed step came.
pub(crate) struct StreamSeals {
    keys: KeyRing,
    required: bool,
    opener: Opener,
    sealer: Option<Sealer>,
}

impl StreamSeals {
    pub(crate) fn new(keys: KeyRing, required: bool) -> Self {
        Self { opener: keys.opener(), keys, required, sealer: None }
    }

    /// A plain step, refused where sealing is required.
    pub(crate) fn plain(&self, step: pb::GenerateStep) -> Result<pb::GenerateStep, RequestError> {
        if self.required {
            return Err(WireError::Codec(CodecError::NotSealed).into());
        }
        Ok(step)
    }

    /// A sealed step, opened: its key, its place in the stream's nonce sequence and its
    /// bytes checked before it is decoded.
    pub(crate) fn open(&mut self, sealed: SealedMessage) -> Result<pb::GenerateStep, RequestError> {
        let key_id = sealed.seal.as_ref().map(|seal| seal.key_id);
        let bytes = self.opener.open_message(SEALED_STEP_KIND, sealed).map_err(WireError::Codec)?;
        let step =
            pb::GenerateStep::decode(bytes.as_slice()).map_err(|e| GenerationError::Step(format!("a sealed step that does not decode: {e}")))?;
        if let (None, Some(id)) = (&self.sealer, key_id) {
            self.sealer = Some(self.keys.sealer(id).map_err(|e| RequestError::Encode(WireError::Codec(e)))?);
        }
        Ok(step)
    }

    /// `reply` sealed whole, only its request id beside it.
    pub(crate) fn seal(&mut self, reply: &pb::GenerateReply) -> Result<pb::GenerateReply, RequestError> {
        let sealer = self.sealer.as_mut().ok_or(RequestError::Encode(WireError::Codec(CodecError::NotSealed)))?;
        let sealed = sealer.seal_message(SEALED_REPLY_KIND, reply.encode_to_vec()).map_err(|e| RequestError::Encode(WireError::Codec(e)))?;
        Ok(pb::GenerateReply { request_id: reply.request_id, sealed: Some(sealed), ..Default::default() })
    }
}
