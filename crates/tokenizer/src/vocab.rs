//! The tokenizer's input: the vocabulary and settings as a GGUF file stores them under
//! `tokenizer.*`, in a plain struct so that tests and tools can build one without a file.

use strata_gguf::{GgufFile, Value};

use crate::{Result, TokenizerError};

/// `tokenizer.ggml.token_type` values (llama.cpp's `llama_token_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(i32)]
pub enum TokenType {
    Undefined = 0,
    Normal = 1,
    Unknown = 2,
    Control = 3,
    UserDefined = 4,
    Unused = 5,
    Byte = 6,
}

impl TokenType {
    pub fn from_i32(v: i32) -> TokenType {
        match v {
            1 => TokenType::Normal,
            2 => TokenType::Unknown,
            3 => TokenType::Control,
            4 => TokenType::UserDefined,
            5 => TokenType::Unused,
            6 => TokenType::Byte,
            _ => TokenType::Undefined,
        }
    }
}

/// Everything a [`crate::Tokenizer`] is built from. Ids are `None` when the file does not set
/// them; the tokenizer then applies llama.cpp's per-model defaults.
#[derive(Clone, Debug, Default)]
pub struct TokenizerData {
    /// `tokenizer.ggml.model`: `gpt2` (byte-level BPE) or `llama` (SentencePiece).
    pub model: String,
    /// `tokenizer.ggml.pre`: the pre-tokenizer of a BPE vocabulary.
    pub pre: Option<String>,
    pub tokens: Vec<String>,
    /// One per token (`TokenType` values); empty means all normal.
    pub token_types: Vec<i32>,
    /// SentencePiece scores, one per token; empty means all zero.
    pub scores: Vec<f32>,
    /// BPE merges, `"left right"`, highest priority first.
    pub merges: Vec<String>,
    pub bos_id: Option<u32>,
    pub eos_id: Option<u32>,
    pub eot_id: Option<u32>,
    pub eom_id: Option<u32>,
    pub unk_id: Option<u32>,
    pub sep_id: Option<u32>,
    pub pad_id: Option<u32>,
    pub mask_id: Option<u32>,
    /// FIM ids; the deprecated `prefix/suffix/middle_token_id` keys win over the new ones, as
    /// in llama.cpp.
    pub fim_pre_id: Option<u32>,
    pub fim_suf_id: Option<u32>,
    pub fim_mid_id: Option<u32>,
    pub fim_pad_id: Option<u32>,
    pub fim_rep_id: Option<u32>,
    pub fim_sep_id: Option<u32>,
    pub add_bos: Option<bool>,
    pub add_eos: Option<bool>,
    pub add_space_prefix: Option<bool>,
    /// `general.name`: a few per-model token rules key on it (Phi-3).
    pub model_name: Option<String>,
    /// `tokenizer.chat_template`.
    pub chat_template: Option<String>,
}

impl TokenizerData {
    /// Reads the `tokenizer.*` keys of a GGUF file. Types are checked; a key with the wrong type
    /// is an error naming the file and the key.
    pub fn from_gguf(f: &GgufFile) -> Result<TokenizerData> {
        let opt_id = |key: &str| -> Result<Option<u32>> {
            match f.get(key) {
                None => Ok(None),
                Some(_) => Ok(Some(f.get_u32(key)?)),
            }
        };
        let opt_bool = |key: &str| -> Result<Option<bool>> {
            match f.get(key) {
                None => Ok(None),
                Some(_) => Ok(Some(f.get_bool(key)?)),
            }
        };
        let opt_str = |key: &str| -> Result<Option<String>> {
            match f.get(key) {
                None => Ok(None),
                Some(_) => Ok(Some(f.get_str(key)?.to_string())),
            }
        };
        let model = f.get_str("tokenizer.ggml.model")?.to_string();
        let tokens = f.get_array_strings("tokenizer.ggml.tokens")?.to_vec();
        let n = tokens.len();
        let token_types = match f.get("tokenizer.ggml.token_type") {
            None => Vec::new(),
            Some(_) => f.get_array_i32("tokenizer.ggml.token_type")?,
        };
        let scores = match f.get("tokenizer.ggml.scores") {
            None => Vec::new(),
            Some(Value::Array(strata_gguf::Array::I32(v))) => v.iter().map(|&x| x as f32).collect(),
            Some(_) => f.get_array_f32("tokenizer.ggml.scores")?,
        };
        let check_len = |key: &str, len: usize| -> Result<()> {
            if len != 0 && len < n {
                return Err(TokenizerError::Metadata {
                    file: f.name().to_string(),
                    key: key.to_string(),
                    what: format!("{len} entries for {n} tokens"),
                });
            }
            Ok(())
        };
        check_len("tokenizer.ggml.token_type", token_types.len())?;
        check_len("tokenizer.ggml.scores", scores.len())?;
        let merges = match f.get("tokenizer.ggml.merges") {
            None => Vec::new(),
            Some(_) => f.get_array_strings("tokenizer.ggml.merges")?.to_vec(),
        };
        Ok(TokenizerData {
            model,
            pre: opt_str("tokenizer.ggml.pre")?,
            tokens,
            token_types,
            scores,
            merges,
            bos_id: opt_id("tokenizer.ggml.bos_token_id")?,
            eos_id: opt_id("tokenizer.ggml.eos_token_id")?,
            eot_id: opt_id("tokenizer.ggml.eot_token_id")?,
            eom_id: opt_id("tokenizer.ggml.eom_token_id")?,
            unk_id: opt_id("tokenizer.ggml.unknown_token_id")?,
            sep_id: opt_id("tokenizer.ggml.seperator_token_id")?,
            pad_id: opt_id("tokenizer.ggml.padding_token_id")?,
            mask_id: opt_id("tokenizer.ggml.mask_token_id")?,
            fim_pre_id: opt_id("tokenizer.ggml.prefix_token_id")?
                .or(opt_id("tokenizer.ggml.fim_pre_token_id")?),
            fim_suf_id: opt_id("tokenizer.ggml.suffix_token_id")?
                .or(opt_id("tokenizer.ggml.fim_suf_token_id")?),
            fim_mid_id: opt_id("tokenizer.ggml.middle_token_id")?
                .or(opt_id("tokenizer.ggml.fim_mid_token_id")?),
            fim_pad_id: opt_id("tokenizer.ggml.fim_pad_token_id")?,
            fim_rep_id: opt_id("tokenizer.ggml.fim_rep_token_id")?,
            fim_sep_id: opt_id("tokenizer.ggml.fim_sep_token_id")?,
            add_bos: opt_bool("tokenizer.ggml.add_bos_token")?,
            add_eos: opt_bool("tokenizer.ggml.add_eos_token")?,
            add_space_prefix: opt_bool("tokenizer.ggml.add_space_prefix")?,
            model_name: opt_str("general.name")?,
            chat_template: opt_str("tokenizer.chat_template")?,
        })
    }
}
