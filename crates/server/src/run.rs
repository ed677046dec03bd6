//! What every generating endpoint shares: the request's sampling fields (OpenAI's and
//! llama.cpp's names plus ours), checked with the field named in every error; submitting a
//! [`Job`]; and a [`Driver`] that turns the worker's token events into response pieces through
//! [`TextStream`] and [`Splitter`], the same way for streaming and non-streaming responses.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use serde::Deserialize;
use serde_json::Value;
use strata_tokenizer::Tokenizer;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use crate::engine::{
    Constraint, Finish, GrammarAfter, SamplingParams, SpecCounts, ThinkBudget, TokenLogprob,
};
use crate::error::ApiError;
use crate::grammar::Grammar;
use crate::output::{Piece, Splitter, TextStream};
use crate::worker::{Event, Job};
use crate::{Ready, Shared};

/// `stop` / `stop_sequences`: one string or several.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

impl Stop {
    pub fn into_vec(self) -> Vec<String> {
        match self {
            Stop::One(s) => vec![s],
            Stop::Many(v) => v,
        }
    }
}

#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum SlopPenalty {
    Number(f32),
    Word(String),
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SlopListEntry {
    pub phrase: String,
    pub penalty: SlopPenalty,
}

/// `slop_list`: `"default"`, `"none"`, or entries replacing the built-in list.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum SlopList {
    Name(String),
    Entries(Vec<SlopListEntry>),
}

/// The sampling fields every generating endpoint accepts (unknown fields are ignored, as
/// llama-server does, so that clients' vendor extras do not fail).
#[derive(Clone, Debug, Default, Deserialize)]
pub struct SamplingFields {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub seed: Option<u64>,
    pub repeat_penalty: Option<f32>,
    pub repeat_last_n: Option<i64>,
    pub frequency_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub dry_multiplier: Option<f32>,
    pub dry_base: Option<f32>,
    pub dry_allowed_length: Option<u32>,
    pub dry_penalty_last_n: Option<i64>,
    pub dry_sequence_breakers: Option<Vec<String>>,
    pub slop_mode: Option<u8>,
    pub slop_phrases: Option<Vec<String>>,
    pub slop_list: Option<SlopList>,
    /// Verify window for MTP speculative decoding (`--spec N`'s request form; 1: plain).
    pub spec: Option<usize>,
}

fn finite(name: &str, v: Option<f32>, lo: f32, hi: f32) -> Result<(), ApiError> {
    match v {
        Some(x) if !(x.is_finite() && x >= lo && x <= hi) => Err(ApiError::invalid(
            name,
            format!("{x}; expected a number in [{lo}, {hi}]"),
        )),
        _ => Ok(()),
    }
}

impl SamplingFields {
    pub fn params(&self) -> Result<SamplingParams, ApiError> {
        finite("temperature", self.temperature, 0.0, 100.0)?;
        finite("top_p", self.top_p, 0.0, 1.0)?;
        if self.top_p == Some(0.0) {
            return Err(ApiError::invalid("top_p", "0; expected a number in (0, 1]"));
        }
        finite("min_p", self.min_p, 0.0, 1.0)?;
        finite("repeat_penalty", self.repeat_penalty, 0.0, 100.0)?;
        finite("frequency_penalty", self.frequency_penalty, -2.0, 2.0)?;
        finite("presence_penalty", self.presence_penalty, -2.0, 2.0)?;
        finite("dry_multiplier", self.dry_multiplier, 0.0, 100.0)?;
        finite("dry_base", self.dry_base, 1.0, 100.0)?;
        if let Some(k) = self.top_k {
            if k < 0 {
                return Err(ApiError::invalid(
                    "top_k",
                    format!("{k}; expected 0 (off) or more"),
                ));
            }
        }
        for (name, n) in [
            ("repeat_last_n", self.repeat_last_n),
            ("dry_penalty_last_n", self.dry_penalty_last_n),
        ] {
            if let Some(n) = n {
                if n < -1 {
                    return Err(ApiError::invalid(
                        name,
                        format!("{n}; expected -1 (all), 0 (off) or more"),
                    ));
                }
            }
        }
        if let Some(m) = self.slop_mode {
            if m > 2 {
                return Err(ApiError::invalid(
                    "slop_mode",
                    format!("{m}; expected 0, 1 or 2"),
                ));
            }
        }
        let d = SamplingParams::default();
        let slop_list = match &self.slop_list {
            None => None,
            Some(SlopList::Name(n)) if n == "default" => None,
            Some(SlopList::Name(n)) if n == "none" => Some(Vec::new()),
            Some(SlopList::Name(n)) => {
                return Err(ApiError::invalid(
                    "slop_list",
                    format!("{n:?}; expected \"default\", \"none\" or a list of {{\"phrase\", \"penalty\"}}"),
                ))
            }
            Some(SlopList::Entries(v)) => {
                let mut out = Vec::new();
                for (i, e) in v.iter().enumerate() {
                    let p = match &e.penalty {
                        SlopPenalty::Number(x) => *x,
                        SlopPenalty::Word(w) if w == "inf" => f32::INFINITY,
                        SlopPenalty::Word(w) => {
                            return Err(ApiError::invalid(
                                format!("slop_list[{i}].penalty"),
                                format!("{w:?}; expected a number ≥ 0 or \"inf\""),
                            ))
                        }
                    };
                    out.push((e.phrase.clone(), p));
                }
                Some(out)
            }
        };
        let p = SamplingParams {
            temperature: self.temperature.unwrap_or(d.temperature),
            top_k: self.top_k.map_or(d.top_k, |k| k as usize),
            top_p: self.top_p.unwrap_or(d.top_p),
            min_p: self.min_p.unwrap_or(d.min_p),
            seed: self.seed,
            repeat_penalty: self.repeat_penalty.unwrap_or(d.repeat_penalty),
            repeat_last_n: self.repeat_last_n.unwrap_or(d.repeat_last_n),
            frequency_penalty: self.frequency_penalty.unwrap_or(d.frequency_penalty),
            presence_penalty: self.presence_penalty.unwrap_or(d.presence_penalty),
            dry_multiplier: self.dry_multiplier.unwrap_or(d.dry_multiplier),
            dry_base: self.dry_base.unwrap_or(d.dry_base),
            dry_allowed_length: self.dry_allowed_length.unwrap_or(d.dry_allowed_length),
            dry_penalty_last_n: self.dry_penalty_last_n.unwrap_or(d.dry_penalty_last_n),
            dry_sequence_breakers: self.dry_sequence_breakers.clone(),
            slop_mode: self.slop_mode,
            slop_phrases: self.slop_phrases.clone().unwrap_or_default(),
            slop_list,
        };
        // The engine checks the rest (slop phrases, DRY breakers) and names what is wrong.
        p.config().map_err(|e| {
            ApiError::invalid(
                slop_field(&self.slop_phrases, &self.slop_list),
                format!("{e:#}"),
            )
        })?;
        Ok(p)
    }
}

fn slop_field(ph: &Option<Vec<String>>, list: &Option<SlopList>) -> &'static str {
    match (ph, list) {
        (Some(_), _) => "slop_phrases",
        (_, Some(_)) => "slop_list",
        _ => "sampling",
    }
}

/// Parses one part of a request body (a struct of the fields it reads) from the body's JSON,
/// naming the field at fault.
pub fn fields<T: serde::de::DeserializeOwned>(v: &Value) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(v).map_err(|e| {
        let path = e.path().to_string();
        let path = if path == "." { String::new() } else { path };
        ApiError::invalid(path, e.into_inner().to_string())
    })
}

/// A unique enough id: a prefix, the time and a process counter.
pub fn new_id(prefix: &str) -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    let x = (t ^ n.wrapping_mul(0x9E37_79B9_7F4A_7C15)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    format!("{prefix}{x:016x}{n:04x}")
}

pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Everything a generation needs besides the prompt.
pub struct GenSpec {
    pub params: SamplingParams,
    /// None: until the context is full.
    pub max_tokens: Option<usize>,
    pub stops: Vec<String>,
    pub top_logprobs: Option<usize>,
    pub reasoning: bool,
    pub tools: bool,
    /// Tool names (a bare JSON reply calling one is a call).
    pub tool_names: Vec<String>,
    pub in_think: bool,
    pub user_boundary: Option<usize>,
    /// A grammar, and the request field that asked for it (named in a compile error).
    pub grammar: Option<(Grammar, &'static str)>,
    /// Most tokens inside `<think>` before `</think>` is written.
    pub reasoning_budget: Option<usize>,
    /// The request's verify window (None: the server's `--spec`).
    pub window: Option<usize>,
}

/// Why a response ended, in neutral terms; each API names it its own way.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EndReason {
    Eog,
    Stop(String),
    Length,
    Slop,
}

/// One update for the response.
pub enum Update {
    Pieces {
        /// Calls come as start / arguments / end ([`crate::output::expand_calls`]).
        pieces: Vec<Piece>,
        logprobs: Vec<(u32, TokenLogprob)>,
    },
    End(EndReason),
    Error(String),
}

/// Runs a job and hands out its response pieces.
pub struct Driver {
    rx: Option<UnboundedReceiver<Event>>,
    tok: Arc<Tokenizer>,
    text: TextStream,
    split: Splitter,
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    pub completion_tokens: usize,
    pub t0: Instant,
    /// A speculative generation's counters, once it has ended.
    pub spec: Option<SpecCounts>,
    /// When the first and the latest token came (the page's tokens/s, [`crate::web::timings`]).
    pub t_first: Option<Instant>,
    pub t_last: Option<Instant>,
    ended: bool,
    pending_end: Option<EndReason>,
}

impl Driver {
    /// Submits the job and waits for the worker to take it (so a queue-full or a failing
    /// rollback is an HTTP error, not a broken stream).
    pub async fn start(
        shared: &Shared,
        ready: &Ready,
        prompt: Vec<u32>,
        spec: GenSpec,
    ) -> Result<Driver, ApiError> {
        let sampler = spec
            .params
            .build(&ready.tok)
            .map_err(|e| ApiError::invalid("sampling", format!("{e:#}")))?;
        let constraint: Option<Box<dyn Constraint>> = match &spec.grammar {
            Some((g, param)) => {
                let c = ready.constrainer()?;
                let m = tokio::task::block_in_place(|| c.matcher(g)).map_err(|e| {
                    ApiError::invalid(*param, format!("the schema does not compile: {e}"))
                })?;
                Some(Box::new(m))
            }
            None => None,
        };
        let think = match spec.reasoning_budget {
            Some(b) => {
                let enc = |t: &str| ready.tok.encode(t, false, true).unwrap_or_default();
                Some(ThinkBudget::new(
                    b,
                    spec.in_think,
                    enc("<think>"),
                    enc("</think>"),
                    enc("\n</think>\n\n"),
                ))
            }
            None => None,
        };
        let max_window = strata_engine::speculative::MAX_WINDOW;
        let window = match spec.window {
            Some(n) if !(1..=max_window).contains(&n) => {
                return Err(ApiError::invalid(
                    "spec",
                    format!("{n}; expected a verify window of 1 to {max_window} rows"),
                ))
            }
            Some(n) if n > 1 && !ready.has_mtp => {
                return Err(ApiError::invalid(
                    "spec",
                    format!(
                        "{n}: speculative decoding needs an MTP head, and the model has none \
                         (strata serve --mtp MTP.gguf)"
                    ),
                ))
            }
            Some(n) => n,
            None => ready.spec_window,
        };
        // A prompt that opened a reasoning block: the model reasons freely, and the grammar
        // applies to what follows `</think>`.
        let enc = |t: &str| ready.tok.encode(t, false, true).unwrap_or_default();
        let grammar_after = (constraint.is_some() && spec.in_think).then(|| GrammarAfter {
            end: enc("</think>"),
            close: match spec.reasoning_budget {
                Some(_) => enc("\n</think>\n\n"),
                None => Vec::new(),
            },
        });
        let room = ready.n_ctx - prompt.len();
        let max_tokens = spec.max_tokens.unwrap_or(room);
        let (tx, mut rx) = unbounded_channel();
        let n_prompt = prompt.len();
        shared.submit(Job {
            prompt,
            sampler: Some(sampler),
            max_tokens,
            top_logprobs: spec.top_logprobs,
            checkpoint_at: spec.user_boundary.into_iter().collect(),
            constraint,
            grammar_after,
            think,
            window,
            events: tx,
            enqueued: Instant::now(),
        })?;
        let (prompt_tokens, cached_tokens) = match rx.recv().await {
            Some(Event::Started {
                prompt_tokens,
                cached_tokens,
            }) => (prompt_tokens, cached_tokens),
            Some(Event::Error(e)) => return Err(ApiError::internal(e)),
            _ => return Err(ApiError::unavailable("the model worker stopped")),
        };
        debug_assert_eq!(prompt_tokens, n_prompt);
        Ok(Driver {
            rx: Some(rx),
            tok: Arc::clone(&ready.tok),
            text: TextStream::new(spec.stops, Arc::clone(&ready.preserved)),
            split: Splitter::new(spec.in_think, spec.reasoning, spec.tools).with_bare_calls(
                if spec.tools {
                    spec.tool_names
                } else {
                    Vec::new()
                },
            ),
            prompt_tokens,
            cached_tokens,
            completion_tokens: 0,
            t0: Instant::now(),
            spec: None,
            t_first: None,
            t_last: None,
            ended: false,
            pending_end: None,
        })
    }

    /// The next update; None after the end.
    pub async fn next(&mut self) -> Option<Update> {
        if let Some(r) = self.pending_end.take() {
            self.ended = true;
            return Some(Update::End(r));
        }
        if self.ended {
            return None;
        }
        let Some(rx) = self.rx.as_mut() else {
            self.ended = true;
            return None;
        };
        let ev = rx.recv().await;
        Some(match self.update(ev) {
            Update::Pieces { pieces, logprobs } => Update::Pieces {
                pieces: crate::output::expand_calls(pieces),
                logprobs,
            },
            u => u,
        })
    }

    fn update(&mut self, ev: Option<Event>) -> Update {
        let Some(ev) = ev else {
            return self.fail("the model worker stopped".into());
        };
        match Some(ev) {
            Some(Event::Token { id, logprob }) => {
                self.completion_tokens += 1;
                let now = Instant::now();
                self.t_first.get_or_insert(now);
                self.t_last = Some(now);
                let text = match self.text.push(&self.tok, id) {
                    Ok(t) => t,
                    Err(e) => return self.fail(e),
                };
                let mut pieces = self.split.push(&text);
                let logprobs = logprob.map(|l| vec![(id, l)]).unwrap_or_default();
                if let Some(st) = self.text.stopped.clone() {
                    // Closing the channel cancels the generation.
                    self.rx = None;
                    pieces.extend(self.split.finish());
                    self.pending_end = Some(EndReason::Stop(st));
                }
                Update::Pieces { pieces, logprobs }
            }
            Some(Event::Done { finish, spec }) => {
                self.spec = spec;
                let rest = self.text.finish();
                let mut pieces = self.split.push(&rest);
                pieces.extend(self.split.finish());
                self.rx = None;
                self.pending_end = Some(match finish {
                    Finish::Eog => EndReason::Eog,
                    Finish::MaxTokens | Finish::ContextFull => EndReason::Length,
                    Finish::Slop => EndReason::Slop,
                    // The worker ends a closed channel's job without a Done event.
                    Finish::Closed => EndReason::Eog,
                });
                Update::Pieces {
                    pieces,
                    logprobs: Vec::new(),
                }
            }
            Some(Event::Error(e)) => self.fail(e),
            Some(Event::Started { .. }) => Update::Pieces {
                pieces: Vec::new(),
                logprobs: Vec::new(),
            },
            None => self.fail("the model worker stopped".into()),
        }
    }

    /// Malformed tool calls passed on as text so far.
    pub fn malformed_calls(&self) -> usize {
        self.split.malformed
    }

    fn fail(&mut self, e: String) -> Update {
        self.ended = true;
        self.rx = None;
        Update::Error(e)
    }
}
