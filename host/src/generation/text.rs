//! Text in and out of `host generate`: a `tokenizer.json` (Hugging Face's format, read by
//! the `tokenizers` crate) turns the prompt into ids and the new ids back into text, on the
//! edge: the text never leaves it.

use std::path::{Path, PathBuf};

use crate::error::{HostError, Result};

/// A tokenizer read from a `tokenizer.json`.
pub struct TextTokenizer {
    inner: tokenizers::Tokenizer,
    path: PathBuf,
}

impl TextTokenizer {
    /// Reads `path`.
    pub fn load(path: &Path) -> Result<Self> {
        let inner = tokenizers::Tokenizer::from_file(path).map_err(|e| HostError::Generation(format!("tokenizer {}: {e}", path.display())))?;
        Ok(Self { inner, path: path.to_path_buf() })
    }

    /// `text`'s token ids (without special tokens added).
    pub fn encode(&self, text: &str) -> Result<Vec<i64>> {
        let encoding = self.inner.encode(text, false).map_err(|e| self.failed("cannot encode the prompt", e))?;
        Ok(encoding.get_ids().iter().map(|&id| i64::from(id)).collect())
    }

    /// The text of `ids` (special tokens skipped).
    pub fn decode(&self, ids: &[i64]) -> Result<String> {
        let ids: Vec<u32> = ids.iter().map(|&id| u32::try_from(id).unwrap_or(u32::MAX)).collect();
        self.inner.decode(&ids, true).map_err(|e| self.failed("cannot decode the tokens", e))
    }

    /// The id of `token` (a stop token given as text, `<|endoftext|>`), if the vocabulary has it.
    pub fn token_id(&self, token: &str) -> Option<i64> {
        self.inner.token_to_id(token).map(i64::from)
    }

    fn failed(&self, what: &str, e: tokenizers::Error) -> HostError {
        HostError::Generation(format!("{what} with {}: {e}", self.path.display()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A byte-level BPE of 500 tokens (tests/data/bpe-500.json, trained with Python's
    /// `tokenizers` 0.23 on ARCHITECTURE.md; `<|endoftext|>` is id 0).
    fn fixture() -> TextTokenizer {
        TextTokenizer::load(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/data/bpe-500.json")).unwrap()
    }

    #[test]
    fn a_tokenizer_json_gives_python_s_ids_and_the_text_back() {
        let tokenizer = fixture();
        let text = "The server keeps each session's cache.";
        // What Python's tokenizers gave for this text with the same file.
        assert_eq!(tokenizer.encode(text).unwrap(), [52, 261, 369, 427, 337, 83, 382, 415, 302, 274, 65, 361, 14]);
        assert_eq!(tokenizer.decode(&tokenizer.encode(text).unwrap()).unwrap(), text);
        assert_eq!(tokenizer.token_id("<|endoftext|>"), Some(0));
        assert_eq!(tokenizer.decode(&[0, 52]).unwrap(), "T", "special tokens are skipped");
        let missing = TextTokenizer::load(Path::new("/nonexistent/tokenizer.json")).err().unwrap();
        assert!(missing.to_string().contains("/nonexistent/tokenizer.json"), "{missing}");
    }
}
