//! What the sequences' states cost and how many fit (issue 15 §5). A sequence's state is a
//! fixed part (qwen4exp's recurrent GDN and PLE states) plus rows per position (every K/V
//! cache, the indexer's raw keys and pooled blocks, the MTP head's cache); both are known from
//! the model's shapes at start, so the number of sequences that fit at the configured context
//! is computed up front ([`Budget::fits`]) and printed. The worker admits a job only while the
//! positions it may reach fit beside those of the running jobs and the prefixes the idle slots
//! hold (it frees idle prefixes first, else the job waits in the queue), and a job that cannot
//! fit even alone is refused with a 429 at submission ([`Budget::refuse`]): a request never
//! grows the states past the budget, so it never ends in an out-of-memory crash.

use strata_engine::backend::Backend;
use strata_engine::qwen4exp::config::LayerKind;
use strata_engine::Qwen4expOps;

use crate::engine::ModelHandle;

/// The bytes of one sequence's state: `fixed` plus `per_position` for each position held.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StateSize {
    pub fixed: u64,
    pub per_position: u64,
}

impl StateSize {
    /// Of a sequence of the model as the CPU holds it (f32 rows; a cache's rows are
    /// committed as they are written).
    pub fn of<Q2: Backend, Q4: Qwen4expOps>(model: &ModelHandle<Q2, Q4>) -> StateSize {
        match model {
            ModelHandle::Qwen2(m) => {
                let c = m.config();
                StateSize {
                    fixed: 0,
                    per_position: 4 * (c.n_layer * 2 * c.kv_dim()) as u64,
                }
            }
            ModelHandle::Qwen4exp(m) => {
                let c = m.config();
                let kv = c.attn.n_head_kv * c.attn.head_dim;
                let di = c.indexer.head_dim;
                // Per position, in units of f32 ×ratio (a pooled block is one row per `ratio`).
                let mut per = 0f64;
                for l in &c.layers {
                    if let LayerKind::Attention { ratio } = l {
                        per += (2 * kv) as f64;
                        if let Some(r) = ratio {
                            per += di as f64 + di as f64 / *r as f64;
                        }
                    }
                }
                if m.has_mtp() {
                    per += (2 * kv + di) as f64 + di as f64;
                }
                StateSize {
                    fixed: model.checkpoint_bytes() as u64,
                    per_position: (4.0 * per).ceil() as u64,
                }
            }
        }
    }

    /// The bytes at `positions` positions.
    pub fn at(&self, positions: usize) -> u64 {
        self.fixed
            .saturating_add(self.per_position.saturating_mul(positions as u64))
    }
}

/// What the sequences' states may hold in all, and what one costs.
#[derive(Clone, Copy, Debug)]
pub struct Budget {
    /// Bytes for every sequence's state together.
    pub limit: u64,
    pub size: StateSize,
    /// Positions per sequence (the server's context).
    pub n_ctx: usize,
}

/// Memory kept free beside the states for the step's activations and the server itself.
const HEADROOM: u64 = 512 << 20;

impl Budget {
    /// `limit` bytes when given; else what the system has available now (after the model's
    /// weights were mapped: `weights` bytes of them stay resident), less a headroom. With no
    /// way to tell (not Linux), no limit.
    pub fn new(size: StateSize, n_ctx: usize, limit: Option<u64>, weights: u64) -> Budget {
        let limit = limit.unwrap_or_else(|| match available_memory() {
            Some(avail) => avail.saturating_sub(weights).saturating_sub(HEADROOM),
            None => u64::MAX,
        });
        Budget { limit, size, n_ctx }
    }

    /// Sequences that fit at the full context.
    pub fn fits(&self) -> u64 {
        self.limit / self.size.at(self.n_ctx).max(1)
    }

    /// The bytes a job of `prompt` tokens generating up to `max_tokens` may reach.
    pub fn need(&self, prompt: usize, max_tokens: usize) -> u64 {
        self.size
            .at(prompt.saturating_add(max_tokens).min(self.n_ctx))
    }

    /// Why a job can never run (its state alone exceeds the budget), if it cannot.
    pub fn refuse(&self, prompt: usize, max_tokens: usize) -> Option<String> {
        let need = self.need(prompt, max_tokens);
        (need > self.limit).then(|| {
            format!(
                "this request may reach {} positions, whose sequence state needs {}; the server's state memory is {} in all — send a shorter prompt or a smaller max_tokens",
                prompt.saturating_add(max_tokens).min(self.n_ctx),
                mib(need),
                mib(self.limit)
            )
        })
    }

    /// The startup line: per-sequence sizes and how many sequences fit.
    pub fn describe(&self, parallel: usize) -> String {
        let limit = if self.limit == u64::MAX {
            "no limit known".to_string()
        } else {
            format!(
                "{} for states: {} fit at that context",
                mib(self.limit),
                self.fits()
            )
        };
        let mut s = format!(
            "sequence state {} + {} per position = {} at context {}; {limit}",
            bytes(self.size.fixed),
            bytes(self.size.per_position),
            mib(self.size.at(self.n_ctx)),
            self.n_ctx,
        );
        if self.limit != u64::MAX && (self.fits() as usize) < parallel {
            s.push_str(&format!(
                " (fewer than --parallel {parallel}: requests wait until their positions fit)"
            ));
        }
        s
    }
}

fn mib(b: u64) -> String {
    format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64)
}

fn bytes(b: u64) -> String {
    if b >= 1 << 20 {
        mib(b)
    } else if b >= 1 << 10 {
        format!("{:.1} KiB", b as f64 / 1024.0)
    } else {
        format!("{b} B")
    }
}

/// `MemAvailable` from /proc/meminfo, in bytes.
fn available_memory() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_budget_counts_sequences_at_the_context() {
        // 1 KiB fixed + 100 B per position; context 1000: 101,024 B a sequence.
        let size = StateSize {
            fixed: 1024,
            per_position: 100,
        };
        let b = Budget::new(size, 1000, Some(3 * 101_024 + 5), 0);
        assert_eq!(b.fits(), 3);
        assert_eq!(b.need(10, 5), 1024 + 1500);
        // Positions are capped at the context.
        assert_eq!(b.need(900, 10_000), 101_024);
        assert!(b.refuse(900, 10_000).is_none());
        let tiny = Budget::new(size, 1000, Some(2000), 0);
        let why = tiny.refuse(10, 10).unwrap();
        assert!(why.contains("20 positions"), "{why}");
        assert!(tiny.describe(4).contains("0 fit"), "{}", tiny.describe(4));
    }
}
