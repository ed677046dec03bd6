//! What the sampler needs from a vocabulary: each token's text (for the slop classes, the
//! phrase matcher and DRY's breakers) and a way to turn a phrase into tokens. A trait, so the
//! tests can use a toy vocabulary and the engine does not care which tokenizer built it.

use crate::error::{EngineError, Result};

pub trait SamplerVocab {
    fn n_vocab(&self) -> usize;
    /// The bytes token `id` prints as (empty for control tokens and ids out of range).
    fn piece(&self, id: u32) -> Vec<u8>;
    /// The tokens of `text`, with no special tokens added or parsed.
    fn encode(&self, text: &str) -> Result<Vec<u32>>;
}

impl SamplerVocab for strata_tokenizer::Tokenizer {
    fn n_vocab(&self) -> usize {
        strata_tokenizer::Tokenizer::n_vocab(self)
    }

    fn piece(&self, id: u32) -> Vec<u8> {
        self.token_to_piece(id, false)
            .map(|p| p.to_vec())
            .unwrap_or_default()
    }

    fn encode(&self, text: &str) -> Result<Vec<u32>> {
        strata_tokenizer::Tokenizer::encode(self, text, false, false)
            .map_err(|e| EngineError::Input(format!("tokenizing {text:?}: {e}")))
    }
}
