//! Token sampling: a configurable chain of stages that narrow and reshape the candidate set,
//! then a final pick. The chain is data (serde JSON), so a request, a config file or a test can
//! state exactly what runs, in what order.
//!
//! The default chain ([`SamplerConfig::standard`]) runs in llama.cpp's order:
//! `top_k → top_p → min_p → temperature → pick`. The filters look at the distribution the model
//! gave (temperature 1); temperature then reshapes what is left; the pick draws from it. A
//! temperature of 0 (or below) means greedy: the chain is empty and the pick is the argmax.
//!
//! Determinism (DESIGN.md §3): the greedy pick breaks ties toward the lower token id; a random
//! pick takes its uniform from Philox4x32-10 keyed by (seed, position), so the token drawn at a
//! position does not depend on batching or speculation, and candidates are always visited in one
//! canonical order (logit descending, id ascending) whatever the stages did before.
//!
//! Stages see a [`SampleContext`] with the position and the sequence's token history, which is
//! what the penalty stages planned next (repetition/frequency/presence, DRY, slop) will read.

pub mod bound;
pub mod dry;
pub mod guard;
pub mod penalties;
pub mod philox;
pub mod slop;
pub mod view;
pub mod vocab;

pub use bound::{DraftEdits, Sampled};

use serde::{Deserialize, Serialize};

use crate::error::{EngineError, Result};

/// One candidate token.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Candidate {
    pub id: u32,
    pub logit: f32,
}

/// The candidate set between stages.
#[derive(Clone, Debug, Default)]
pub struct Candidates {
    pub items: Vec<Candidate>,
    /// True when `items` is in canonical order (logit descending, id ascending).
    pub sorted: bool,
}

/// The canonical order: higher logit first, equal logits by lower id.
fn canonical(a: &Candidate, b: &Candidate) -> std::cmp::Ordering {
    b.logit.total_cmp(&a.logit).then(a.id.cmp(&b.id))
}

impl Candidates {
    /// Every token of `logits`, id = index. NaN logits are an error (a broken forward pass).
    pub fn from_logits(logits: &[f32]) -> Result<Candidates> {
        if logits.is_empty() {
            return Err(EngineError::Input("sampler: no logits".to_string()));
        }
        let mut items = Vec::with_capacity(logits.len());
        for (i, &l) in logits.iter().enumerate() {
            if l.is_nan() {
                return Err(EngineError::Input(format!(
                    "sampler: logit of token {i} is NaN"
                )));
            }
            items.push(Candidate {
                id: i as u32,
                logit: l,
            });
        }
        Ok(Candidates {
            items,
            sorted: false,
        })
    }

    pub fn sort(&mut self) {
        if !self.sorted {
            self.items.sort_unstable_by(canonical);
            self.sorted = true;
        }
    }

    /// Keeps the first `n` in canonical order, selecting before sorting so that a small `n`
    /// over a large vocabulary does not pay for a full sort.
    fn keep_best(&mut self, n: usize) {
        if n < self.items.len() {
            if !self.sorted && n > 0 {
                self.items.select_nth_unstable_by(n - 1, canonical);
            }
            self.items.truncate(n);
        }
        self.sort();
    }

    /// Probabilities of the (sorted) candidates: softmax in f64.
    fn probs(&self) -> Vec<f64> {
        let max = self.items.first().map(|c| c.logit).unwrap_or(0.0);
        let e: Vec<f64> = self
            .items
            .iter()
            .map(|c| f64::from(c.logit - max).exp())
            .collect();
        let z: f64 = e.iter().sum();
        e.into_iter().map(|x| x / z).collect()
    }
}

/// What a stage may read besides the candidates.
#[derive(Clone, Copy, Debug)]
pub struct SampleContext<'a> {
    /// Position of the token being chosen (the Philox counter).
    pub position: u64,
    /// Tokens of the sequence so far (prompt and generated).
    pub history: &'a [u32],
}

/// A stage of the chain. Each is a no-op at its neutral setting (top_k 0, top_p ≥ 1,
/// min_p ≤ 0, temperature 1).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum Stage {
    /// Keep the `k` highest logits (ties to the lower id).
    TopK { k: usize },
    /// Keep the smallest prefix (canonical order) whose probability mass reaches `p`, and at
    /// least `min_keep` tokens.
    TopP {
        p: f32,
        #[serde(default = "one")]
        min_keep: usize,
    },
    /// Keep tokens whose probability is at least `p` times the top one's, and at least
    /// `min_keep` tokens.
    MinP {
        p: f32,
        #[serde(default = "one")]
        min_keep: usize,
    },
    /// Divide logits by `t`; `t ≤ 0` keeps only the best token.
    Temperature { t: f32 },
    /// Repetition, frequency and presence penalties over the last n tokens ([`penalties`]).
    Penalties(penalties::PenaltyParams),
    /// DRY repeat penalty ([`dry`]).
    Dry(dry::DryParams),
    /// Slop penalties ([`slop`]); at most one per chain.
    Slop(slop::SlopConfig),
}

fn one() -> usize {
    1
}

/// How the token is chosen from what the stages left.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum Pick {
    /// The highest logit; ties to the lower id.
    Greedy,
    /// A draw from the softmax of the remaining logits with Philox(seed, position).
    Draw { seed: u64 },
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SamplerConfig {
    #[serde(default)]
    pub stages: Vec<Stage>,
    pub pick: Pick,
}

impl SamplerConfig {
    pub fn greedy() -> SamplerConfig {
        SamplerConfig {
            stages: Vec::new(),
            pick: Pick::Greedy,
        }
    }

    /// The usual knobs in llama.cpp's order (see the module notes); `temperature ≤ 0` is greedy.
    pub fn standard(temperature: f32, top_k: usize, top_p: f32, min_p: f32, seed: u64) -> Self {
        if temperature <= 0.0 {
            return SamplerConfig::greedy();
        }
        let mut stages = Vec::new();
        if top_k > 0 {
            stages.push(Stage::TopK { k: top_k });
        }
        if top_p < 1.0 {
            stages.push(Stage::TopP {
                p: top_p,
                min_keep: 1,
            });
        }
        if min_p > 0.0 {
            stages.push(Stage::MinP {
                p: min_p,
                min_keep: 1,
            });
        }
        if temperature != 1.0 {
            stages.push(Stage::Temperature { t: temperature });
        }
        SamplerConfig {
            stages,
            pick: Pick::Draw { seed },
        }
    }

    pub fn from_json(s: &str) -> Result<SamplerConfig> {
        let c: SamplerConfig = serde_json::from_str(s)
            .map_err(|e| EngineError::Input(format!("sampler config: {e}")))?;
        c.validate()?;
        Ok(c)
    }

    pub fn to_json(&self) -> String {
        // A plain data enum and struct always serialize.
        serde_json::to_string(self).unwrap_or_default()
    }

    /// Rejects settings outside their documented ranges (docs/SAMPLING.md): NaN, top_p
    /// outside (0, 1], min_p outside [0, 1], a negative or infinite temperature.
    pub fn validate(&self) -> Result<()> {
        for (i, s) in self.stages.iter().enumerate() {
            let bad = |what: String| Err(EngineError::Input(format!("sampler stage {i}: {what}")));
            match *s {
                Stage::TopK { .. } => {}
                Stage::TopP { p, .. } if !(p > 0.0 && p <= 1.0) => {
                    return bad(format!("top_p {p}; expected a number in (0, 1]"));
                }
                Stage::MinP { p, .. } if !(0.0..=1.0).contains(&p) => {
                    return bad(format!("min_p {p}; expected a number in [0, 1]"));
                }
                Stage::Temperature { t } if !(t.is_finite() && t >= 0.0) => {
                    return bad(format!("temperature {t}; expected a finite number ≥ 0"));
                }
                ref e if e.is_edit() => bound::validate_stage(e)
                    .map_err(|w| EngineError::Input(format!("sampler stage {i}: {w}")))?,
                _ => {}
            }
        }
        bound::validate_chain(self)
    }
}

/// Runs a [`SamplerConfig`]'s chain and pick.
#[derive(Clone, Debug)]
pub struct Sampler {
    config: SamplerConfig,
    bound: bound::Bound,
}

impl Sampler {
    pub fn new(config: SamplerConfig) -> Result<Sampler> {
        config.validate()?;
        let bound = bound::Bound::without_vocab(&config)?;
        Ok(Sampler { config, bound })
    }

    pub fn config(&self) -> &SamplerConfig {
        &self.config
    }

    /// The token for `logits` at `ctx.position`. A slop stage reads a state the sampler keeps
    /// in line with `ctx.history` ([`Sampler::sample_with`] takes an explicit one).
    pub fn sample(&mut self, logits: &[f32], ctx: &SampleContext<'_>) -> Result<u32> {
        match self.sample_with(logits, ctx, None)? {
            Sampled::Token(t) => Ok(t),
            Sampled::DeadEnd => Err(EngineError::Input(format!(
                "sampler: the slop stage banned every token at position {}",
                ctx.position
            ))),
        }
    }
}

/// The token `pick` chooses from one row of logits for position `position`: exactly what a
/// [`Sampler`] with the chain `pick` names chooses (it is that sampler's code), so a backend's
/// device pick can be checked against it, and the default `Backend::pick_rows` is it.
pub fn pick_row(pick: crate::backend::DevicePick, logits: &[f32], position: u64) -> Result<u32> {
    match pick {
        crate::backend::DevicePick::Greedy => argmax(logits),
        crate::backend::DevicePick::Draw { seed, temperature } => {
            let mut stages = Vec::new();
            if temperature != 1.0 {
                stages.push(Stage::Temperature { t: temperature });
            }
            let mut s = Sampler::new(SamplerConfig {
                stages,
                pick: Pick::Draw { seed },
            })?;
            s.sample(
                logits,
                &SampleContext {
                    position,
                    history: &[],
                },
            )
        }
    }
}

impl SamplerConfig {
    /// The chain as a device pick, when it is one: greedy, or a draw after at most a
    /// temperature (no stage that edits or filters by the history or the vocabulary).
    pub fn device_pick(&self) -> Option<crate::backend::DevicePick> {
        use crate::backend::DevicePick;
        match (&self.pick, self.stages.as_slice()) {
            (Pick::Greedy, []) => Some(DevicePick::Greedy),
            (Pick::Draw { seed }, []) => Some(DevicePick::Draw {
                seed: *seed,
                temperature: 1.0,
            }),
            (Pick::Draw { seed }, [Stage::Temperature { t }]) if *t > 0.0 => {
                Some(DevicePick::Draw {
                    seed: *seed,
                    temperature: *t,
                })
            }
            _ => None,
        }
    }
}

/// The highest logit, ties to the lower id (the first in index order).
pub fn argmax(logits: &[f32]) -> Result<u32> {
    match view::first_max(logits) {
        Ok(Some((i, _))) => Ok(i as u32),
        Ok(None) => Err(EngineError::Input("sampler: no logits".to_string())),
        Err(i) => Err(EngineError::Input(format!(
            "sampler: logit of token {i} is NaN"
        ))),
    }
}

/// One stage on the candidate set. The stages that need a vocabulary run here without it
/// (DRY with no breaker tokens, slop not at all); a [`Sampler`] runs them in full.
pub fn apply(stage: &Stage, c: &mut Candidates, ctx: &SampleContext<'_>) {
    if c.items.is_empty() {
        return;
    }
    match *stage {
        Stage::Penalties(_) | Stage::Dry(_) | Stage::Slop(_) => bound::apply_unbound(stage, c, ctx),
        Stage::TopK { k } => {
            if k > 0 {
                c.keep_best(k);
            }
        }
        Stage::TopP { p, min_keep } => {
            if p >= 1.0 {
                return;
            }
            c.sort();
            let probs = c.probs();
            let mut cum = 0.0f64;
            let mut keep = c.items.len();
            for (i, &q) in probs.iter().enumerate() {
                cum += q;
                if cum >= f64::from(p) && i + 1 >= min_keep {
                    keep = i + 1;
                    break;
                }
            }
            c.items.truncate(keep);
        }
        Stage::MinP { p, min_keep } => {
            if p <= 0.0 {
                return;
            }
            c.sort();
            // p_i ≥ p·p_max  ⇔  logit_i ≥ logit_max + ln p.
            let threshold = c.items[0].logit + p.ln();
            let n_ok = c.items.iter().take_while(|x| x.logit >= threshold).count();
            c.items.truncate(n_ok.max(min_keep));
        }
        Stage::Temperature { t } => {
            if t <= 0.0 {
                c.keep_best(1);
            } else if t != 1.0 {
                for x in &mut c.items {
                    x.logit /= t;
                }
            }
        }
    }
}

/// The final choice.
pub fn pick(p: &Pick, c: &mut Candidates, ctx: &SampleContext<'_>) -> Result<u32> {
    if c.items.is_empty() {
        return Err(EngineError::Input(
            "sampler: every candidate was filtered out".to_string(),
        ));
    }
    match *p {
        Pick::Greedy => {
            c.keep_best(1);
            Ok(c.items[0].id)
        }
        Pick::Draw { seed } => {
            c.sort();
            if c.items[0].logit == f32::NEG_INFINITY {
                return Err(EngineError::Input(
                    "sampler: every candidate has probability 0".to_string(),
                ));
            }
            let probs = c.probs();
            let u = philox::uniform(seed, ctx.position, 0);
            let mut cum = 0.0f64;
            for (x, &q) in c.items.iter().zip(&probs) {
                cum += q;
                if u < cum {
                    return Ok(x.id);
                }
            }
            // Rounding left the total a hair under u: the last token with any mass.
            let last = c
                .items
                .iter()
                .zip(&probs)
                .rev()
                .find(|(_, &q)| q > 0.0)
                .map_or(c.items[0].id, |(x, _)| x.id);
            Ok(last)
        }
    }
}

#[cfg(test)]
mod tests;
