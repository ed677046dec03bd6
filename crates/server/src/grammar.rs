//! Constrained decoding through llguidance: the model's vocabulary as llguidance's token trie
//! (built once per model), request constraints compiled to a [`Grammar`] (a JSON schema:
//! `response_format` `json_object` / `json_schema`, Anthropic's `output_config.format`, and
//! forced tool calls), and the per-step mask the generation applies to the logits before the
//! sampler runs, so every sampler stage (slop included) sees only tokens the grammar allows.
//!
//! A forced tool call is constrained to the bare JSON form `{"name": ..., "arguments": {...}}`,
//! which the output splitter reads as a call (output.rs), so no template-specific tags are
//! needed in the grammar.

use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{InferenceCapabilities, TokEnv, TokRxInfo, TokTrie, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use serde_json::{json, Value};
use strata_tokenizer::Tokenizer;

use crate::engine::Constraint;

/// The vocabulary as llguidance sees it: each token's bytes (special tokens marked with 0xFF,
/// so the grammar never produces them as text) and our tokenizer for text it must tokenize.
struct Env {
    trie: TokTrie,
    tok: Arc<Tokenizer>,
}

impl TokenizerEnv for Env {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<u32> {
        // Grammar literals are text; bytes that are not UTF-8 cannot come from a JSON schema.
        self.tok
            .encode(&String::from_utf8_lossy(s), false, false)
            .unwrap_or_default()
    }
}

/// What the worker needs to constrain one model's generations.
pub struct Constrainer {
    factory: ParserFactory,
    /// End-of-generation ids besides the one llguidance knows as EOS: allowed exactly when it
    /// is.
    eog: Vec<u32>,
    eos: u32,
}

impl Constrainer {
    pub fn new(tok: Arc<Tokenizer>) -> anyhow::Result<Constrainer> {
        let n = tok.n_vocab();
        let words: Vec<Vec<u8>> = (0..n as u32)
            .map(|id| {
                let piece = tok.token_to_piece(id, false).unwrap_or(&[]);
                // Control and end tokens, and any token that prints nothing (which a grammar
                // would otherwise allow anywhere, forever), are special: never grammar text.
                if tok.is_control(id) || tok.is_eog(id) || piece.is_empty() {
                    let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    w.extend_from_slice(tok.token_text(id).unwrap_or("").as_bytes());
                    w
                } else {
                    piece.to_vec()
                }
            })
            .collect();
        let eog = tok.eog_ids();
        let eos = tok
            .eos()
            .or_else(|| eog.first().copied())
            .ok_or_else(|| anyhow::anyhow!("the vocabulary has no end-of-generation token"))?;
        let info = TokRxInfo {
            tok_bos: tok.bos(),
            tok_pad: tok.pad(),
            tok_unk: tok.unk(),
            tok_end_of_turn: tok.eot(),
            ..TokRxInfo::new(n as u32, eos)
        };
        let env: TokEnv = Arc::new(Env {
            trie: TokTrie::from(&info, &words),
            tok,
        });
        let mut factory = ParserFactory::new(
            &env,
            InferenceCapabilities::default(),
            &llguidance::earley::SlicedBiasComputer::general_slices(),
        )?;
        factory.set_stderr_log_level(0);
        Ok(Constrainer { factory, eog, eos })
    }

    /// A matcher for `g`; a schema llguidance cannot compile is the caller's 400.
    pub fn matcher(&self, g: &Grammar) -> Result<GrammarState, String> {
        // Fixed separators, as Python's json.dumps writes them: flexible whitespace lets a
        // model pad forever inside an object.
        let mut schema = g.schema.clone();
        if let Some(o) = schema.as_object_mut() {
            o.entry("x-guidance").or_insert(json!({
                "whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}));
        }
        let parser = self
            .factory
            .create_parser(TopLevelGrammar::from_json_schema(schema))
            .map_err(|e| format!("{e:#}"))?;
        let m = Matcher::new(Ok(parser));
        if let Some(e) = m.get_error() {
            return Err(e);
        }
        Ok(GrammarState {
            m,
            eog: self.eog.clone(),
            eos: self.eos,
            consumed: 0,
        })
    }
}

/// A constraint a request asked for.
#[derive(Clone, Debug)]
pub struct Grammar {
    pub schema: Value,
}

impl Grammar {
    /// Any JSON object.
    pub fn json_object() -> Grammar {
        Grammar {
            schema: json!({"type": "object"}),
        }
    }

    pub fn json_schema(schema: Value) -> Grammar {
        Grammar { schema }
    }

    /// One call `{"name": N, "arguments": {...}}` to one of `tools` (OpenAI form).
    pub fn tool_call(tools: &[Value]) -> Grammar {
        let one = |t: &Value| {
            let name = t.pointer("/function/name").cloned().unwrap_or(Value::Null);
            let params = t
                .pointer("/function/parameters")
                .cloned()
                .unwrap_or(json!({"type": "object"}));
            json!({"type": "object",
                   "properties": {"name": {"const": name}, "arguments": params},
                   "required": ["name", "arguments"], "additionalProperties": false})
        };
        let schema = match tools {
            [t] => one(t),
            ts => json!({"anyOf": ts.iter().map(one).collect::<Vec<_>>()}),
        };
        Grammar { schema }
    }
}

/// One generation's grammar state.
pub struct GrammarState {
    m: Matcher,
    eog: Vec<u32>,
    eos: u32,
    /// Tokens consumed (the generated tokens so far).
    consumed: usize,
}

impl Constraint for GrammarState {
    /// Sets every logit the grammar forbids to −∞ (end-of-generation tokens follow llguidance's
    /// EOS: allowed only where the grammar may end).
    fn mask(&mut self, logits: &mut [f32]) -> Result<(), String> {
        let mask = self.m.compute_mask_or_eos().map_err(|e| format!("{e:#}"))?;
        let eos_ok = mask.is_allowed(self.eos);
        for (i, l) in logits.iter_mut().enumerate() {
            let id = i as u32;
            let ok = if self.eog.contains(&id) {
                eos_ok
            } else {
                mask.is_allowed(id)
            };
            if !ok {
                *l = f32::NEG_INFINITY;
            }
        }
        Ok(())
    }

    fn mask_draft(&mut self, draft_logits: &mut [f32], inverse: &[i32]) -> Result<(), String> {
        let mask = self.m.compute_mask_or_eos().map_err(|e| format!("{e:#}"))?;
        let eos_ok = mask.is_allowed(self.eos);
        for (id, &row) in inverse.iter().enumerate() {
            let Some(l) = usize::try_from(row)
                .ok()
                .and_then(|r| draft_logits.get_mut(r))
            else {
                continue;
            };
            let id = id as u32;
            let ok = if self.eog.contains(&id) {
                eos_ok
            } else {
                mask.is_allowed(id)
            };
            if !ok {
                *l = f32::NEG_INFINITY;
            }
        }
        Ok(())
    }

    fn consume(&mut self, toks: &[u32]) -> Result<usize, String> {
        // Checked before each token, so a refused draft never puts the matcher in its error
        // state.
        let n = self
            .m
            .try_consume_tokens(toks)
            .map_err(|e| format!("{e:#}"))?;
        self.consumed += n;
        Ok(n)
    }

    fn truncate(&mut self, n: usize) -> Result<(), String> {
        if n < self.consumed {
            self.m
                .rollback(self.consumed - n)
                .map_err(|e| format!("{e:#}"))?;
            self.consumed = n;
        }
        Ok(())
    }
}
