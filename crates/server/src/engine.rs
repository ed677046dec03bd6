//! The one place the server touches the engine's model, state and sampler API: the loaded model
//! ([`ModelHandle`], qwen2 or qwen4exp on the CPU backend), one sequence's state with its prefix
//! checkpoints ([`Seq`]), the sampler a request asks for ([`SamplingParams`]) and one generation
//! advanced a step at a time ([`Gen`]) so that the worker can interleave sequences fairly.
//!
//! Why a step machine rather than `generate::generate`: that loop runs a whole generation behind
//! a callback, and `--parallel N` needs N generations to take turns token by token on one model.
//! [`Gen::step`] is the guarded loop of `sampler::guard` (slop phrase rewinds, held-back
//! tokens) cut at its token boundary; with no slop stage it is `generate::generate` exactly.
//! When the engine's single loop with policies lands, this module is what gets re-pointed.
//!
//! Prefix reuse (issue 13 §7): a qwen2 sequence rolls back by truncating its K/V; a qwen4exp
//! sequence's recurrent states cannot be truncated, so checkpoints are taken at the end of
//! prefill, at the last user-message boundary and at the end of generation, and a rollback
//! restores the longest one at or below the common prefix (K/V truncated with it); the caller
//! replays the prompt from there.

use std::path::Path;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use strata_engine::qwen4exp::state::Checkpoint;
use strata_engine::sampler::dry::{self, DryParams};
use strata_engine::sampler::penalties::PenaltyParams;
use strata_engine::sampler::slop::{
    Accepted, DeadEnd, ListChoice, SlopConfig, SlopEntry, SlopState,
};
use strata_engine::sampler::{Pick, SampleContext, Sampled, Sampler, SamplerConfig, Stage};
use strata_engine::{qwen2, qwen4exp, CpuBackend, KvType};
use strata_gguf::GgufFile;
use strata_tokenizer::Tokenizer;

/// A loaded model of a supported architecture.
pub enum ModelHandle {
    Qwen2(Box<qwen2::Model<CpuBackend>>),
    Qwen4exp(Box<qwen4exp::Model<CpuBackend>>),
}

/// How to load a model.
#[derive(Clone, Debug)]
pub struct LoadSpec {
    pub threads: usize,
    pub kv_type: KvType,
}

impl Default for LoadSpec {
    fn default() -> Self {
        LoadSpec {
            threads: 0,
            kv_type: KvType::F16,
        }
    }
}

impl ModelHandle {
    /// Opens `path`, reads its tokenizer and binds the model for its architecture.
    pub fn load(path: &Path, spec: &LoadSpec) -> Result<(ModelHandle, Tokenizer)> {
        let file =
            Arc::new(GgufFile::open(path).with_context(|| format!("opening {}", path.display()))?);
        let tok = Tokenizer::from_gguf(&file)
            .with_context(|| format!("reading the tokenizer of {}", path.display()))?;
        let backend = CpuBackend::new(spec.threads)?;
        let arch = file.architecture()?.to_string();
        let model = match arch.as_str() {
            qwen2::ARCH => ModelHandle::Qwen2(Box::new(
                qwen2::Model::from_file(
                    file,
                    backend,
                    &qwen2::LoadOptions {
                        kv_type: spec.kv_type,
                    },
                )
                .with_context(|| format!("loading {}", path.display()))?,
            )),
            qwen4exp::config::ARCH => {
                let opts = qwen4exp::LoadOptions {
                    kv_type: spec.kv_type,
                    ..Default::default()
                };
                let m = qwen4exp::Model::from_file(file, backend, &opts)
                    .with_context(|| format!("loading {}", path.display()))?;
                for w in m.warnings() {
                    tracing::warn!("{w}");
                }
                ModelHandle::Qwen4exp(Box::new(m))
            }
            other => bail!(
                "{}: architecture '{other}' is not supported; expected qwen2 or qwen4exp",
                path.display()
            ),
        };
        Ok((model, tok))
    }

    pub fn arch(&self) -> &'static str {
        match self {
            ModelHandle::Qwen2(_) => qwen2::ARCH,
            ModelHandle::Qwen4exp(_) => qwen4exp::config::ARCH,
        }
    }

    pub fn n_vocab(&self) -> usize {
        match self {
            ModelHandle::Qwen2(m) => m.config().n_vocab,
            ModelHandle::Qwen4exp(m) => m.config().n_vocab,
        }
    }

    /// The context the model was trained for, when the file says.
    pub fn trained_ctx(&self) -> Option<usize> {
        match self {
            ModelHandle::Qwen2(m) => Some(m.config().n_ctx_train),
            ModelHandle::Qwen4exp(_) => None,
        }
    }

    /// Bytes one recurrent-state checkpoint holds (0 for a model that needs none).
    pub fn checkpoint_bytes(&self) -> usize {
        match self {
            ModelHandle::Qwen2(_) => 0,
            ModelHandle::Qwen4exp(m) => {
                let c = m.config();
                let g = c.gdn;
                let per_gdn =
                    (g.conv_kernel - 1) * g.conv_dim() + g.n_v_heads * g.head_k * g.head_v;
                let n_gdn = c
                    .layers
                    .iter()
                    .filter(|l| matches!(l, qwen4exp::config::LayerKind::Gdn))
                    .count();
                let ple = c.ple.as_ref().map_or(0, |p| p.history() * c.residual_dim());
                4 * (n_gdn * per_gdn + ple)
            }
        }
    }

    pub fn new_seq(&self) -> Result<Seq> {
        Ok(Seq {
            state: match self {
                ModelHandle::Qwen2(m) => SeqState::Qwen2(m.new_state()?),
                ModelHandle::Qwen4exp(m) => SeqState::Qwen4exp(m.new_state()?),
            },
            checkpoints: Vec::new(),
        })
    }
}

enum SeqState {
    Qwen2(qwen2::State<CpuBackend>),
    Qwen4exp(qwen4exp::State<CpuBackend>),
}

/// A recurrent-state checkpoint and when it was taken (for the cache's eviction order).
struct Saved {
    cp: Checkpoint<CpuBackend>,
    stamp: u64,
}

/// One sequence's state, kept in its slot between requests so that the next request can reuse
/// the prefix it shares.
pub struct Seq {
    state: SeqState,
    /// qwen4exp only, sorted by position.
    checkpoints: Vec<Saved>,
}

impl Seq {
    /// Tokens consumed so far.
    pub fn tokens(&self) -> &[u32] {
        match &self.state {
            SeqState::Qwen2(s) => s.tokens(),
            SeqState::Qwen4exp(s) => s.tokens(),
        }
    }

    pub fn len(&self) -> usize {
        self.tokens().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Consumes `tokens` (at least one); returns the logits after the last. On an error the
    /// sequence is rolled back to where it was (qwen2) or emptied (qwen4exp, whose recurrent
    /// states are then part-way).
    pub fn feed(&mut self, model: &ModelHandle, tokens: &[u32]) -> Result<Vec<f32>> {
        match (model, &mut self.state) {
            (ModelHandle::Qwen2(m), SeqState::Qwen2(st)) => {
                let pos = st.position();
                match m.forward_with(st, tokens, true) {
                    Ok(out) => Ok(out.logits),
                    Err(e) => {
                        m.truncate(st, pos)?;
                        Err(e.into())
                    }
                }
            }
            (ModelHandle::Qwen4exp(m), SeqState::Qwen4exp(st)) => {
                let want = qwen4exp::Want {
                    last_only: true,
                    ..Default::default()
                };
                let m: &qwen4exp::Model<CpuBackend> = m;
                match m.forward_with(st, tokens, want) {
                    Ok(out) => Ok(out.logits),
                    Err(e) => {
                        *st = m.new_state()?;
                        self.checkpoints.clear();
                        Err(e.into())
                    }
                }
            }
            _ => bail!("a sequence of one model was used with another"),
        }
    }

    /// Rolls back to at most `pos` tokens, as cheaply as the model allows, and returns the
    /// length reached: `pos` for qwen2; for qwen4exp the longest checkpoint at or below `pos`
    /// (or 0). The caller replays whatever it needs beyond.
    pub fn rollback(&mut self, model: &ModelHandle, pos: usize) -> Result<usize> {
        let have = self.len();
        if pos >= have {
            return Ok(have);
        }
        match (model, &mut self.state) {
            (ModelHandle::Qwen2(m), SeqState::Qwen2(st)) => {
                m.truncate(st, pos)?;
                Ok(pos)
            }
            (ModelHandle::Qwen4exp(m), SeqState::Qwen4exp(st)) => {
                self.checkpoints.retain(|s| s.cp.position() <= pos);
                match self.checkpoints.last() {
                    Some(s) => {
                        m.restore(st, &s.cp)?;
                        Ok(s.cp.position())
                    }
                    None => {
                        *st = m.new_state()?;
                        Ok(0)
                    }
                }
            }
            _ => bail!("a sequence of one model was used with another"),
        }
    }

    /// Rolls back to exactly `pos` tokens: the cheapest rollback, then a replay of the tokens it
    /// had between there and `pos`.
    pub fn rewind(&mut self, model: &ModelHandle, pos: usize) -> Result<usize> {
        let keep: Vec<u32> = self.tokens()[..pos.min(self.len())].to_vec();
        let reached = self.rollback(model, pos)?;
        if reached < keep.len() {
            self.feed(model, &keep[reached..])?;
        }
        Ok(keep.len() - reached)
    }

    /// Saves the recurrent state at the current position (qwen4exp; a no-op for qwen2 and when
    /// one is already saved there). Returns the bytes added.
    pub fn checkpoint(&mut self, model: &ModelHandle, stamp: u64) -> Result<usize> {
        let (ModelHandle::Qwen4exp(m), SeqState::Qwen4exp(st)) = (model, &self.state) else {
            return Ok(0);
        };
        let pos = st.position();
        if pos == 0 || self.checkpoints.iter().any(|s| s.cp.position() == pos) {
            return Ok(0);
        }
        let cp = m.checkpoint(st)?;
        let at = self.checkpoints.partition_point(|s| s.cp.position() < pos);
        self.checkpoints.insert(at, Saved { cp, stamp });
        Ok(model.checkpoint_bytes())
    }

    pub fn n_checkpoints(&self) -> usize {
        self.checkpoints.len()
    }

    /// The stamp of this sequence's oldest checkpoint.
    pub fn oldest_checkpoint(&self) -> Option<u64> {
        self.checkpoints.iter().map(|s| s.stamp).min()
    }

    /// Drops the oldest checkpoint; returns whether there was one.
    pub fn drop_oldest_checkpoint(&mut self) -> bool {
        let Some((i, _)) = self
            .checkpoints
            .iter()
            .enumerate()
            .min_by_key(|(_, s)| s.stamp)
        else {
            return false;
        };
        self.checkpoints.remove(i);
        true
    }
}

/// The sampling knobs a request may set (OpenAI's and llama.cpp's names), with llama.cpp's
/// defaults. `build` turns them into the engine's chain in the CLI's default order
/// `penalties → dry → slop → top_k → top_p → min_p → temperature`.
#[derive(Clone, Debug)]
pub struct SamplingParams {
    pub temperature: f32,
    pub top_k: usize,
    pub top_p: f32,
    pub min_p: f32,
    pub seed: Option<u64>,
    pub repeat_penalty: f32,
    pub repeat_last_n: i64,
    pub frequency_penalty: f32,
    pub presence_penalty: f32,
    pub dry_multiplier: f32,
    pub dry_base: f32,
    pub dry_allowed_length: u32,
    pub dry_penalty_last_n: i64,
    pub dry_sequence_breakers: Option<Vec<String>>,
    /// None: 0, or 2 when phrases or a list are given (as the CLI).
    pub slop_mode: Option<u8>,
    pub slop_phrases: Vec<String>,
    /// None: the built-in list; Some(list): these entries replace it.
    pub slop_list: Option<Vec<(String, f32)>>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            seed: None,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            dry_multiplier: 0.0,
            dry_base: 1.75,
            dry_allowed_length: 2,
            dry_penalty_last_n: -1,
            dry_sequence_breakers: None,
            slop_mode: None,
            slop_phrases: Vec::new(),
            slop_list: None,
        }
    }
}

impl SamplingParams {
    /// The engine's chain for these settings (validated).
    pub fn config(&self) -> Result<SamplerConfig> {
        let greedy = self.temperature <= 0.0;
        let mut stages = Vec::new();
        let pen = PenaltyParams {
            last_n: self.repeat_last_n,
            repeat: self.repeat_penalty,
            frequency: self.frequency_penalty,
            presence: self.presence_penalty,
        };
        if !pen.is_neutral() {
            stages.push(Stage::Penalties(pen));
        }
        let d = DryParams {
            multiplier: self.dry_multiplier,
            base: self.dry_base,
            allowed_length: self.dry_allowed_length,
            last_n: self.dry_penalty_last_n,
            sequence_breakers: self
                .dry_sequence_breakers
                .clone()
                .unwrap_or_else(dry::default_breakers),
        };
        if !d.is_neutral() {
            stages.push(Stage::Dry(d));
        }
        let mode = match self.slop_mode {
            Some(m) => m,
            None if self.slop_list.is_some() || !self.slop_phrases.is_empty() => 2,
            None => 0,
        };
        if mode > 0 {
            let (list, entries) = match &self.slop_list {
                Some(l) => (
                    ListChoice::None,
                    l.iter()
                        .map(|(p, x)| SlopEntry {
                            phrase: p.clone(),
                            penalty: *x,
                        })
                        .collect(),
                ),
                None => (ListChoice::Default, Vec::new()),
            };
            stages.push(Stage::Slop(SlopConfig {
                mode,
                list,
                entries,
                ban: self.slop_phrases.clone(),
                ..SlopConfig::default()
            }));
        }
        if !greedy {
            if self.top_k > 0 {
                stages.push(Stage::TopK { k: self.top_k });
            }
            if self.top_p < 1.0 {
                stages.push(Stage::TopP {
                    p: self.top_p,
                    min_keep: 1,
                });
            }
            if self.min_p > 0.0 {
                stages.push(Stage::MinP {
                    p: self.min_p,
                    min_keep: 1,
                });
            }
            if self.temperature != 1.0 {
                stages.push(Stage::Temperature {
                    t: self.temperature,
                });
            }
        }
        let pick = if greedy {
            Pick::Greedy
        } else {
            Pick::Draw {
                seed: self.seed.unwrap_or_else(clock_seed),
            }
        };
        let c = SamplerConfig { stages, pick };
        c.validate()?;
        Ok(c)
    }

    /// The sampler bound to the model's vocabulary (DRY breakers, slop phrases).
    pub fn build(&self, tok: &Tokenizer) -> Result<Sampler> {
        Ok(Sampler::with_vocab(self.config()?, tok)?)
    }
}

fn clock_seed() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

/// A token's log-probability under the model (raw logits, before any sampler stage) and the
/// most likely alternatives.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprob {
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

/// log-softmax of `logits` at `id`, and the `n` best tokens (ties to the lower id).
pub fn logprob_of(logits: &[f32], id: u32, n: usize) -> TokenLogprob {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let z: f64 = logits.iter().map(|&l| f64::from(l - max).exp()).sum();
    let lz = z.ln() as f32 + max;
    let lp = |l: f32| l - lz;
    let mut top: Vec<(u32, f32)> = Vec::new();
    if n > 0 {
        let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
        let cmp = |a: &u32, b: &u32| {
            logits[*b as usize]
                .total_cmp(&logits[*a as usize])
                .then(a.cmp(b))
        };
        let n = n.min(idx.len());
        if n < idx.len() {
            idx.select_nth_unstable_by(n - 1, cmp);
            idx.truncate(n);
        }
        idx.sort_unstable_by(cmp);
        top = idx
            .into_iter()
            .map(|i| (i, lp(logits[i as usize])))
            .collect();
    }
    TokenLogprob {
        logprob: logits
            .get(id as usize)
            .map_or(f32::NEG_INFINITY, |&l| lp(l)),
        top,
    }
}

/// Why a generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    /// An end-of-generation token (not emitted).
    Eog,
    MaxTokens,
    /// The sequence filled the context.
    ContextFull,
    /// Slop's phrase level ended the reply before a listed phrase (rewind budget or dead end).
    Slop,
}

/// What one [`Gen::step`] produced.
#[derive(Debug, Default)]
pub struct StepOut {
    /// Tokens that became final, with their log-probabilities when asked for.
    pub tokens: Vec<(u32, Option<TokenLogprob>)>,
    /// Set when the generation is over (the tokens above still belong to it).
    pub finish: Option<Finish>,
    /// Forward calls this step ran over already-generated positions (slop rewinds).
    pub replayed: usize,
}

/// A constraint on the generated tokens (a grammar): applied to the logits before the sampler.
pub trait Constraint: Send {
    /// Sets the logits of forbidden tokens to −∞.
    fn mask(&mut self, logits: &mut [f32]) -> std::result::Result<(), String>;
    /// Records a generated token.
    fn consume(&mut self, tok: u32) -> std::result::Result<(), String>;
    /// Forgets generated tokens past the first `n` (slop rewinds).
    fn truncate(&mut self, n: usize) -> std::result::Result<(), String>;
}

/// One generation after its prefill: the logits of the next position and the guarded loop's
/// state.
pub struct Gen {
    logits: Vec<f32>,
    /// Position of the first generated token (the prompt's length).
    start: usize,
    slop: Option<SlopState>,
    gen: Vec<u32>,
    lps: Vec<Option<TokenLogprob>>,
    emitted: usize,
    max_tokens: usize,
    n_ctx: usize,
    top_logprobs: Option<usize>,
    constraint: Option<Box<dyn Constraint>>,
    think: Option<ThinkBudget>,
    forced: std::collections::VecDeque<u32>,
    pub rewinds: u32,
}

/// A cap on the tokens generated inside `<think>…</think>`: when it is reached, `close` is
/// written into the sequence (as llama.cpp's reasoning budget does), and the answer follows.
#[derive(Clone, Debug)]
pub struct ThinkBudget {
    pub budget: usize,
    /// The prompt opened the block already.
    pub in_think: bool,
    /// Token forms of `<think>` and `</think>`, and what is forced to close (`\n</think>\n\n`).
    pub open: Vec<u32>,
    pub end: Vec<u32>,
    pub close: Vec<u32>,
    count: usize,
    forcing: bool,
}

impl ThinkBudget {
    pub fn new(
        budget: usize,
        in_think: bool,
        open: Vec<u32>,
        end: Vec<u32>,
        close: Vec<u32>,
    ) -> Self {
        ThinkBudget {
            budget,
            in_think,
            open,
            end,
            close,
            count: 0,
            forcing: false,
        }
    }

    /// Follows the generated tokens; true when the budget has just run out.
    fn observe(&mut self, gen: &[u32]) -> bool {
        if !self.end.is_empty() && gen.ends_with(&self.end) {
            self.in_think = false;
            self.forcing = false;
            return false;
        }
        if !self.open.is_empty() && gen.ends_with(&self.open) {
            self.in_think = true;
            self.count = 0;
            return false;
        }
        if self.in_think && !self.forcing {
            self.count += 1;
            if self.count >= self.budget {
                self.forcing = true;
                return true;
            }
        }
        false
    }
}

/// What shapes one generation besides its sampler.
pub struct GenRules {
    pub max_tokens: usize,
    /// The sequence's context (generation stops when it is full).
    pub n_ctx: usize,
    /// Log-probabilities with this many alternatives (None: none).
    pub top_logprobs: Option<usize>,
    pub constraint: Option<Box<dyn Constraint>>,
    pub think: Option<ThinkBudget>,
}

impl Gen {
    /// Starts generating after a prefill of `start` tokens whose last logits are `logits`.
    pub fn new(sampler: &Sampler, logits: Vec<f32>, start: usize, rules: GenRules) -> Gen {
        let GenRules {
            max_tokens,
            n_ctx,
            top_logprobs,
            constraint,
            think,
        } = rules;
        let mut forced = std::collections::VecDeque::new();
        let mut think = think;
        if let Some(b) = think.as_mut() {
            // A budget of 0 closes the block at once.
            if b.in_think && b.budget == 0 {
                b.forcing = true;
                forced.extend(b.close.iter().copied());
            }
        }
        Gen {
            logits,
            start,
            slop: sampler.new_slop_state(start),
            gen: Vec::new(),
            lps: Vec::new(),
            emitted: 0,
            max_tokens,
            n_ctx,
            top_logprobs,
            constraint,
            think,
            forced,
            rewinds: 0,
        }
    }

    /// Generated tokens so far (emitted or held back).
    pub fn generated(&self) -> usize {
        self.gen.len()
    }

    /// Rolls `seq` back so that it holds `pos` tokens and returns the logits there.
    fn roll(&mut self, seq: &mut Seq, model: &ModelHandle, pos: usize) -> Result<usize> {
        let replayed = seq.rewind(model, pos - 1)?;
        let last = seq_token(seq, &self.gen, self.start, pos - 1);
        self.logits = seq.feed(model, &[last])?;
        Ok(replayed + 1)
    }

    /// Samples one token, feeds it, and reports what became final.
    pub fn step(
        &mut self,
        seq: &mut Seq,
        model: &ModelHandle,
        sampler: &mut Sampler,
        is_eog: &dyn Fn(u32) -> bool,
    ) -> Result<StepOut> {
        let mut out = StepOut::default();
        if self.max_tokens == 0 {
            out.finish = Some(Finish::MaxTokens);
            return Ok(out);
        }
        let pos = seq.len();
        // A token the reasoning budget forces is written, not sampled.
        let forced = self.forced.pop_front();
        let tok = match forced {
            Some(t) => t,
            None => {
                let masked = match self.constraint.as_mut() {
                    Some(c) => {
                        c.truncate(self.gen.len()).map_err(anyhow::Error::msg)?;
                        let mut l = self.logits.clone();
                        c.mask(&mut l).map_err(anyhow::Error::msg)?;
                        Some(l)
                    }
                    None => None,
                };
                let sampled = sampler.sample_with(
                    masked.as_deref().unwrap_or(&self.logits),
                    &SampleContext {
                        position: pos as u64,
                        history: seq.tokens(),
                    },
                    self.slop.as_ref(),
                )?;
                let tok = match (sampled, self.slop.as_mut()) {
                    (Sampled::Token(t), _) => t,
                    (Sampled::DeadEnd, Some(s)) => match s.dead_end() {
                        DeadEnd::Rewound { position, .. } => {
                            self.rewinds += 1;
                            self.gen.truncate(position - self.start);
                            self.lps.truncate(position - self.start);
                            out.replayed = self.roll(seq, model, position)?;
                            return Ok(out);
                        }
                        DeadEnd::Stop => return Ok(self.finish(out, Finish::Slop)),
                    },
                    (Sampled::DeadEnd, None) => {
                        bail!("sampler: every token was banned at position {pos}")
                    }
                };
                tok
            }
        };
        if forced.is_none() && is_eog(tok) {
            return Ok(self.finish(out, Finish::Eog));
        }
        let lp = self.top_logprobs.map(|n| logprob_of(&self.logits, tok, n));
        match self.slop.as_mut() {
            Some(s) if forced.is_some() => {
                if let Some(c) = self.constraint.as_mut() {
                    c.consume(tok).map_err(anyhow::Error::msg)?;
                }
                s.push_token(tok);
                self.gen.push(tok);
                self.lps.push(None);
                for i in s.take_commits() {
                    out.tokens.push((self.gen[i], self.lps[i].take()));
                    self.emitted = i + 1;
                }
            }
            Some(s) => match s.accept(tok) {
                Accepted::Kept => {
                    if let Some(c) = self.constraint.as_mut() {
                        c.consume(tok).map_err(anyhow::Error::msg)?;
                    }
                    self.gen.push(tok);
                    self.lps.push(lp);
                    for i in s.take_commits() {
                        out.tokens.push((self.gen[i], self.lps[i].take()));
                        self.emitted = i + 1;
                    }
                }
                Accepted::Rewound { position, .. } => {
                    self.rewinds += 1;
                    self.gen.truncate(position - self.start);
                    self.lps.truncate(position - self.start);
                    out.replayed = self.roll(seq, model, position)?;
                    return Ok(out);
                }
                Accepted::Exhausted { position } => {
                    self.gen.truncate(position - self.start);
                    self.lps.truncate(position - self.start);
                    return Ok(self.finish(out, Finish::Slop));
                }
            },
            None => {
                if let Some(c) = self.constraint.as_mut() {
                    c.consume(tok).map_err(anyhow::Error::msg)?;
                }
                self.gen.push(tok);
                self.lps.push(None);
                self.emitted = self.gen.len();
                out.tokens.push((tok, lp));
            }
        }
        if let Some(b) = self.think.as_mut() {
            if b.observe(&self.gen) {
                self.forced.extend(b.close.iter().copied());
            }
        }
        if self.gen.len() >= self.max_tokens {
            return Ok(self.finish(out, Finish::MaxTokens));
        }
        if pos + 1 >= self.n_ctx {
            return Ok(self.finish(out, Finish::ContextFull));
        }
        self.logits = seq.feed(model, &[tok])?;
        Ok(out)
    }

    /// Ends the generation: whatever slop still held back is a partial match that never
    /// completed, so it is plain text.
    fn finish(&mut self, mut out: StepOut, why: Finish) -> StepOut {
        let rest = match self.slop.as_mut() {
            Some(s) => s.flush(),
            None => self.emitted..self.gen.len(),
        };
        for i in rest {
            if i < self.gen.len() {
                out.tokens.push((self.gen[i], self.lps[i].take()));
                self.emitted = i + 1;
            }
        }
        out.finish = Some(why);
        out
    }
}

/// The token at `pos` of a sequence whose prompt is `seq`'s first `start` tokens, followed by
/// `gen`.
fn seq_token(seq: &Seq, gen: &[u32], start: usize, pos: usize) -> u32 {
    if pos < start {
        seq.tokens()[pos]
    } else {
        gen[pos - start]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logprobs_are_a_log_softmax_with_ordered_alternatives() {
        // softmax([0, ln 3]) = [1/4, 3/4]; a tie goes to the lower id.
        let l = [0.0f32, 3f32.ln(), 3f32.ln()];
        let r = logprob_of(&l, 0, 2);
        let z = 1.0 + 3.0 + 3.0;
        assert!((r.logprob - (1.0f32 / z).ln()).abs() < 1e-6);
        assert_eq!(r.top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![1, 2]);
        assert!((r.top[0].1 - (3.0f32 / z).ln()).abs() < 1e-6);
    }

    #[test]
    fn sampling_params_make_the_cli_chain() {
        let p = SamplingParams {
            temperature: 0.0,
            repeat_penalty: 1.1,
            ..Default::default()
        };
        let c = p.config().unwrap();
        assert_eq!(c.pick, Pick::Greedy);
        assert_eq!(c.stages.len(), 1, "greedy keeps only the edits: {c:?}");
        let p = SamplingParams {
            seed: Some(3),
            slop_phrases: vec!["delve".into()],
            ..Default::default()
        };
        let c = p.config().unwrap();
        assert!(matches!(&c.stages[0], Stage::Slop(s) if s.mode == 2 && s.ban == ["delve"]));
        assert_eq!(c.pick, Pick::Draw { seed: 3 });
        let bad = SamplingParams {
            top_p: -0.5,
            ..Default::default()
        };
        assert!(bad.config().is_err());
    }
}
