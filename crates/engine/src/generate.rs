//! The generation loop, written once over the [`Session`] trait that every model's sequence
//! state implements: reuse of a cached prefix, prefill in chunks, sample, stream each token to a
//! callback, stop at end-of-generation, a token budget or the context's end, and time it all.
//!
//! The loop follows llama.cpp's `simple` example step for step, so a greedy run gives the same
//! tokens: the prompt runs first (in chunks, which give the same bits as one batch on the CPU
//! backend), each sampled token is fed back before the next is chosen, the end-of-generation token is never fed, and the last token of the budget is not
//! decoded (nothing would read its logits).

use std::time::{Duration, Instant};

use crate::backend::{Backend, DevicePick};
use crate::decode::{self, DraftEdit, Judged, Policy, Stepper};
use crate::error::{EngineError, Result};
use crate::qwen4exp::ops::Qwen4expOps;
use crate::sampler::guard::GuardStop;
use crate::sampler::Sampler;
use crate::{qwen2, qwen4exp};

/// One sequence of a loaded model, as the generation loop sees it.
pub trait Session {
    fn n_vocab(&self) -> usize;
    /// Most positions the sequence may hold.
    fn n_ctx(&self) -> usize;
    /// Tokens consumed so far.
    fn tokens(&self) -> &[u32];
    /// Consumes `tokens` (at least one) and returns the logits that follow the last of them.
    fn feed(&mut self, tokens: &[u32]) -> Result<Vec<f32>>;
    /// Forgets every token from position `pos` on (`pos` ≤ the current position).
    fn rewind(&mut self, pos: usize) -> Result<()>;
    /// [`Session::feed`] with `pick`'s token after the last of them chosen where the logits
    /// are (the token at position `tokens().len()` after the call; only its id crosses the
    /// backend's boundary: `Backend::pick_rows`), for the decoding loop's plain windows.
    /// None: this session cannot, and nothing was consumed (the default).
    fn feed_picked(&mut self, tokens: &[u32], pick: DevicePick) -> Result<Option<u32>> {
        let _ = (tokens, pick);
        Ok(None)
    }
}

/// A qwen2 sequence: its KV caches roll back by truncation.
pub struct Qwen2Session<'m, B: Backend> {
    model: &'m qwen2::Model<B>,
    state: qwen2::State<B>,
}

impl<'m, B: Backend> Qwen2Session<'m, B> {
    pub fn new(model: &'m qwen2::Model<B>) -> Result<Self> {
        Ok(Qwen2Session {
            model,
            state: model.new_state()?,
        })
    }
}

impl<B: Backend> Session for Qwen2Session<'_, B> {
    fn n_vocab(&self) -> usize {
        self.model.config().n_vocab
    }
    fn n_ctx(&self) -> usize {
        self.model.config().n_ctx_train
    }
    fn tokens(&self) -> &[u32] {
        self.state.tokens()
    }
    fn feed(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        let pos = self.state.position();
        match self.model.forward_with(&mut self.state, tokens, true) {
            Ok(out) => Ok(out.logits),
            Err(e) => {
                // Leave the sequence as it was before the call, not part-way.
                self.model.truncate(&mut self.state, pos)?;
                Err(e)
            }
        }
    }
    fn feed_picked(&mut self, tokens: &[u32], pick: DevicePick) -> Result<Option<u32>> {
        let pos = self.state.position();
        match self.model.forward_picked(&mut self.state, tokens, pick) {
            Ok(id) => Ok(Some(id)),
            Err(e) => {
                self.model.truncate(&mut self.state, pos)?;
                Err(e)
            }
        }
    }
    fn rewind(&mut self, pos: usize) -> Result<()> {
        self.model.truncate(&mut self.state, pos)
    }
}

/// A qwen4exp sequence. Its recurrent layers cannot be truncated, so a rewind replays the kept
/// prefix into a fresh state (chat turns usually extend the sequence and need none).
pub struct Qwen4expSession<'m, B: Qwen4expOps> {
    model: &'m qwen4exp::Model<B>,
    state: qwen4exp::State<B>,
}

impl<'m, B: Qwen4expOps> Qwen4expSession<'m, B> {
    pub fn new(model: &'m qwen4exp::Model<B>) -> Result<Self> {
        Ok(Qwen4expSession {
            model,
            state: model.new_state()?,
        })
    }
}

impl<B: Qwen4expOps> Session for Qwen4expSession<'_, B> {
    fn n_vocab(&self) -> usize {
        self.model.config().n_vocab
    }
    fn n_ctx(&self) -> usize {
        // The capacity the caches were made with (`LoadOptions::ctx`).
        self.model.config().n_ctx
    }
    fn tokens(&self) -> &[u32] {
        self.state.tokens()
    }
    fn feed(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        let want = qwen4exp::Want {
            last_only: true,
            ..Default::default()
        };
        match self.model.forward_with(&mut self.state, tokens, want) {
            Ok(out) => Ok(out.logits),
            Err(e) => {
                // A failed call leaves the recurrent states part-way while the token history is
                // untouched (it grows only on success): rebuild from the history. Checkpointing
                // every call instead would copy megabytes of state per token.
                self.replay(self.state.tokens().len())?;
                Err(e)
            }
        }
    }
    fn feed_picked(&mut self, tokens: &[u32], pick: DevicePick) -> Result<Option<u32>> {
        // The step as `feed` runs it (a batch of one is that sequence's own step), then the
        // pick on the backend: a verify window's path (`crate::speculative::target`), so a
        // decode token moves one id instead of a row of logits (≈ 1 MB on the full model;
        // qwen2: `qwen2::Model::forward_picked`).
        let at = (self.state.tokens().len() + tokens.len()) as u64;
        let run = (|| {
            let mut items = [qwen4exp::BatchItem::rows(&mut self.state, tokens, true)];
            let out = self.model.forward_batch_dev(&mut items)?;
            let b = self.model.backend();
            let logits = &out
                .first()
                .ok_or_else(|| EngineError::shape("feed_picked", "no output for the sequence"))?
                .logits;
            b.download_ids(&b.pick_rows(logits, pick, at)?)
        })();
        match run {
            Ok(ids) if ids.len() == 1 => Ok(Some(ids[0])),
            Ok(ids) => Err(EngineError::shape(
                "feed_picked",
                format!("{} picks for one row", ids.len()),
            )),
            Err(e) => {
                // As `feed`: rebuild the recurrent states from the untouched history.
                self.replay(self.state.tokens().len())?;
                Err(e)
            }
        }
    }
    fn rewind(&mut self, pos: usize) -> Result<()> {
        let have = self.state.tokens().len();
        if pos > have {
            return Err(EngineError::Input(format!(
                "cannot rewind a sequence of {have} tokens to position {pos}"
            )));
        }
        if pos == have {
            return Ok(());
        }
        self.replay(pos)
    }
}

impl<B: Qwen4expOps> Qwen4expSession<'_, B> {
    /// A fresh state that has consumed the first `pos` tokens of the current history.
    fn replay(&mut self, pos: usize) -> Result<()> {
        let keep = self.state.tokens()[..pos.min(self.state.tokens().len())].to_vec();
        self.state = self.model.new_state()?;
        if !keep.is_empty() {
            self.model.forward_with(
                &mut self.state,
                &keep,
                qwen4exp::Want {
                    last_only: true,
                    ..Default::default()
                },
            )?;
        }
        Ok(())
    }
}

/// Limits of one generation.
#[derive(Clone, Debug)]
pub struct GenOptions {
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// Prompt tokens per forward call (bounds activation memory on long prompts).
    pub prefill_chunk: usize,
}

impl Default for GenOptions {
    fn default() -> Self {
        GenOptions {
            max_tokens: 256,
            prefill_chunk: 512,
        }
    }
}

/// Why generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopReason {
    /// The model produced an end-of-generation token (carried here; it was not fed).
    Eog(u32),
    MaxTokens,
    /// The sequence reached the model's context.
    ContextFull,
    /// The callback asked to stop.
    Stopped,
}

#[derive(Clone, Debug, Default)]
pub struct Timings {
    /// Prompt tokens actually run (after reusing a cached prefix).
    pub prompt_tokens: usize,
    /// Prompt tokens found already in the sequence.
    pub reused_tokens: usize,
    pub prompt: Duration,
    /// Tokens fed back one at a time.
    pub decoded_tokens: usize,
    pub decode: Duration,
    pub sampled_tokens: usize,
    pub sample: Duration,
}

impl Timings {
    pub fn prompt_tps(&self) -> f64 {
        self.prompt_tokens as f64 / self.prompt.as_secs_f64().max(1e-9)
    }
    pub fn decode_tps(&self) -> f64 {
        self.decoded_tokens as f64 / self.decode.as_secs_f64().max(1e-9)
    }
}

#[derive(Clone, Debug)]
pub struct Generation {
    /// The generated tokens (without the end-of-generation token).
    pub tokens: Vec<u32>,
    pub stop: StopReason,
    pub timings: Timings,
}

/// Runs `prompt` through `session`, keeping the longest prefix it already holds but always
/// running at least the last prompt token (its logits choose the first new token); returns
/// those logits and fills the prompt part of `t`.
pub(crate) fn prefill(
    session: &mut dyn Session,
    prompt: &[u32],
    opts: &GenOptions,
    t: &mut Timings,
) -> Result<Vec<f32>> {
    let common = session
        .tokens()
        .iter()
        .zip(prompt)
        .take_while(|(a, b)| a == b)
        .count()
        .min(prompt.len() - 1);
    session.rewind(common)?;
    t.reused_tokens = common;
    let t0 = Instant::now();
    let mut logits = Vec::new();
    for chunk in prompt[common..].chunks(opts.prefill_chunk.max(1)) {
        logits = session.feed(chunk)?;
    }
    t.prompt = t0.elapsed();
    t.prompt_tokens = prompt.len() - common;
    Ok(logits)
}

/// A [`Session`] as the decoding loop's [`Stepper`]: windows of one token, no drafter; a rewind
/// truncates or replays the session.
pub(crate) struct SessionStepper<'a>(pub &'a mut dyn Session);

impl Stepper for SessionStepper<'_> {
    fn n_ctx(&self) -> usize {
        self.0.n_ctx()
    }
    fn tokens(&self) -> &[u32] {
        self.0.tokens()
    }
    fn prefill(&mut self, prompt: &[u32], opts: &GenOptions, t: &mut Timings) -> Result<Vec<f32>> {
        prefill(self.0, prompt, opts, t)
    }
    fn propose(
        &mut self,
        _pending: u32,
        _max: usize,
        _edit: &mut dyn DraftEdit,
    ) -> Result<Vec<u32>> {
        Ok(Vec::new())
    }
    fn verify(&mut self, window: &[u32]) -> Result<Vec<f32>> {
        // A session returns the logits of its last token only: windows of one.
        if window.len() != 1 {
            return Err(EngineError::shape(
                "verify",
                "a session verifies one token at a time",
            ));
        }
        self.0.feed(window)
    }
    fn verify_picked(&mut self, window: &[u32], pick: DevicePick) -> Result<Option<Vec<u32>>> {
        if window.len() != 1 {
            return Ok(None);
        }
        Ok(self.0.feed_picked(window, pick)?.map(|t| vec![t]))
    }
    fn settle(&mut self, seq: &[u32], judged: Judged) -> Result<()> {
        let want = &seq[..seq.len().saturating_sub(1)];
        let have = self.0.tokens();
        // Without a rewind the session consumed exactly the judged tokens: no need to compare
        // the whole history every token.
        if have.len() == want.len() && (!judged.rewound || have == want) {
            return Ok(());
        }
        let common = have.iter().zip(want).take_while(|(a, b)| a == b).count();
        self.0.rewind(common)?;
        if common < want.len() {
            self.0.feed(&want[common..])?;
        }
        Ok(())
    }
    /// The last kept token stays consumed (the next turn of a chat extends from it).
    fn settle_at_end(&self) -> bool {
        false
    }
}

/// Runs `prompt` (reusing whatever prefix of it `session` already holds) and generates up to
/// `opts.max_tokens` tokens, handing each to `on_token` as soon as it is chosen; `on_token`
/// returns false to stop. `is_eog` says which tokens end generation. The decoding loop of
/// [`crate::decode`] with the sampler's own state and nothing held back.
pub fn generate(
    session: &mut dyn Session,
    prompt: &[u32],
    sampler: &mut Sampler,
    is_eog: &dyn Fn(u32) -> bool,
    opts: &GenOptions,
    on_token: &mut dyn FnMut(u32) -> bool,
) -> Result<Generation> {
    let policy = Policy {
        pick: sampler,
        slop: None,
        is_eog,
        window: 1,
    };
    let d = decode::run(&mut SessionStepper(session), prompt, policy, opts, on_token)?;
    Ok(Generation {
        tokens: d.tokens,
        stop: match d.stop {
            GuardStop::Plain(r) => r,
            _ => StopReason::Stopped,
        },
        timings: d.timings,
    })
}
