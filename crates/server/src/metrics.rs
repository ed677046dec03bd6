//! The server's counters and their Prometheus text form (`GET /metrics`): llama-server's metric
//! names under a `strata:` prefix, plus the prefix cache's and the checkpoints' own.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};

#[derive(Default)]
pub struct Metrics {
    /// Prompt tokens actually run (cached ones excluded).
    pub prompt_tokens: AtomicU64,
    pub prompt_us: AtomicU64,
    pub predicted_tokens: AtomicU64,
    pub predicted_us: AtomicU64,
    /// Decode steps (one sampled token each, slop rewinds included).
    pub decode_calls: AtomicU64,
    /// Jobs in a slot now.
    pub processing: AtomicU64,
    /// Jobs waiting in the queue now.
    pub deferred: AtomicU64,
    pub requests: AtomicU64,
    /// Requests refused with 429 (queue full).
    pub rejected: AtomicU64,
    /// Jobs dropped because their client went away.
    pub cancelled: AtomicU64,
    /// Jobs that started from a reused prefix, and the tokens reused.
    pub cache_hits: AtomicU64,
    pub cached_tokens: AtomicU64,
    /// Rollbacks that restored a recurrent-state checkpoint.
    pub checkpoint_restores: AtomicU64,
    pub checkpoint_evictions: AtomicU64,
    pub checkpoint_bytes: AtomicU64,
    /// Speculative decoding, per draft position (index 0 = the first draft of a window): drafts
    /// made and accepted, and the trunk's verify passes.
    pub spec_drafted: [AtomicU64; SPEC_POSITIONS],
    pub spec_accepted: [AtomicU64; SPEC_POSITIONS],
    pub spec_passes: AtomicU64,
    /// Batched forward passes (continuous batching), the sequences they ran in all, and the
    /// most sequences one of them ran.
    pub batch_steps: AtomicU64,
    pub batch_sequences: AtomicU64,
    pub batch_sequences_max: AtomicU64,
    /// Speculative verify windows run as rows of a batched forward pass beside other
    /// sequences' rows.
    pub batch_windows: AtomicU64,
    /// Speculative prompt chunks and prompt ends run as rows of a batched forward pass beside
    /// other sequences' decode rows or verify windows.
    pub batch_spec_prompts: AtomicU64,
}

/// Draft positions a window can hold (`speculative::MAX_WINDOW` − 1).
pub const SPEC_POSITIONS: usize = strata_engine::speculative::MAX_WINDOW - 1;

impl Metrics {
    /// Adds a finished speculative generation's counters.
    pub fn add_spec(&self, c: &crate::engine::SpecCounts) {
        for (j, (&d, &a)) in c.drafted.iter().zip(&c.accepted).enumerate() {
            if let (Some(md), Some(ma)) = (self.spec_drafted.get(j), self.spec_accepted.get(j)) {
                md.fetch_add(d, Ordering::Relaxed);
                ma.fetch_add(a, Ordering::Relaxed);
            }
        }
        self.spec_passes.fetch_add(c.passes, Ordering::Relaxed);
    }

    pub fn render(&self, n_ctx: usize) -> String {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let mut s = String::new();
        let mut put = |name: &str, kind: &str, help: &str, v: f64| {
            let _ = writeln!(s, "# HELP strata:{name} {help}");
            let _ = writeln!(s, "# TYPE strata:{name} {kind}");
            let _ = writeln!(s, "strata:{name} {v}");
        };
        let secs = |us: u64| us as f64 / 1e6;
        let rate = |n: u64, us: u64| if us == 0 { 0.0 } else { n as f64 / secs(us) };
        let (pt, pu) = (g(&self.prompt_tokens), g(&self.prompt_us));
        let (gt, gu) = (g(&self.predicted_tokens), g(&self.predicted_us));
        put(
            "prompt_tokens_total",
            "counter",
            "Number of prompt tokens processed.",
            pt as f64,
        );
        put(
            "prompt_seconds_total",
            "counter",
            "Prompt process time.",
            secs(pu),
        );
        put(
            "tokens_predicted_total",
            "counter",
            "Number of generation tokens processed.",
            gt as f64,
        );
        put(
            "tokens_predicted_seconds_total",
            "counter",
            "Predict process time.",
            secs(gu),
        );
        put(
            "n_decode_total",
            "counter",
            "Total number of decode steps.",
            g(&self.decode_calls) as f64,
        );
        put(
            "prompt_tokens_seconds",
            "gauge",
            "Average prompt throughput in tokens/s.",
            rate(pt, pu),
        );
        put(
            "predicted_tokens_seconds",
            "gauge",
            "Average generation throughput in tokens/s.",
            rate(gt, gu),
        );
        put(
            "batch_steps_total",
            "counter",
            "Batched forward passes (each over the rows of one or more sequences).",
            g(&self.batch_steps) as f64,
        );
        put(
            "batch_sequences_total",
            "counter",
            "Sequences run by the batched forward passes, summed over the passes.",
            g(&self.batch_sequences) as f64,
        );
        put(
            "batch_sequences_max",
            "gauge",
            "Most sequences one batched forward pass ran.",
            g(&self.batch_sequences_max) as f64,
        );
        put(
            "batch_windows_total",
            "counter",
            "Speculative verify windows run as rows of a batched forward pass beside other sequences' rows.",
            g(&self.batch_windows) as f64,
        );
        put(
            "batch_spec_prompts_total",
            "counter",
            "Speculative prompt chunks (and prompt ends) run as rows of a batched forward pass beside other sequences' decode rows.",
            g(&self.batch_spec_prompts) as f64,
        );
        put(
            "requests_processing",
            "gauge",
            "Number of requests processing.",
            g(&self.processing) as f64,
        );
        put(
            "requests_deferred",
            "gauge",
            "Number of requests deferred.",
            g(&self.deferred) as f64,
        );
        put(
            "n_tokens_max",
            "gauge",
            "Context size of each sequence.",
            n_ctx as f64,
        );
        put(
            "requests_total",
            "counter",
            "Generation requests accepted.",
            g(&self.requests) as f64,
        );
        put(
            "requests_rejected_total",
            "counter",
            "Requests refused because the queue was full.",
            g(&self.rejected) as f64,
        );
        put(
            "requests_cancelled_total",
            "counter",
            "Generations stopped because the client went away.",
            g(&self.cancelled) as f64,
        );
        put(
            "prefix_cache_hits_total",
            "counter",
            "Requests that reused a cached prefix.",
            g(&self.cache_hits) as f64,
        );
        put(
            "prefix_cached_tokens_total",
            "counter",
            "Prompt tokens served from the cache.",
            g(&self.cached_tokens) as f64,
        );
        put(
            "checkpoint_restores_total",
            "counter",
            "Recurrent-state checkpoints restored.",
            g(&self.checkpoint_restores) as f64,
        );
        put(
            "checkpoint_evictions_total",
            "counter",
            "Checkpoints dropped to stay under --cache-ram.",
            g(&self.checkpoint_evictions) as f64,
        );
        put(
            "checkpoint_bytes",
            "gauge",
            "Bytes held by recurrent-state checkpoints.",
            g(&self.checkpoint_bytes) as f64,
        );
        let drafted: u64 = self.spec_drafted.iter().map(g).sum();
        let accepted: u64 = self.spec_accepted.iter().map(g).sum();
        put(
            "spec_passes_total",
            "counter",
            "Trunk verify passes of speculative generations.",
            g(&self.spec_passes) as f64,
        );
        put(
            "spec_drafted_total",
            "counter",
            "MTP drafts made.",
            drafted as f64,
        );
        put(
            "spec_accepted_total",
            "counter",
            "MTP drafts accepted.",
            accepted as f64,
        );
        // Per draft position: a label per line under one name.
        for (name, arr, help) in [
            (
                "spec_drafted_position_total",
                &self.spec_drafted,
                "MTP drafts made, by position in the window (1 = first draft).",
            ),
            (
                "spec_accepted_position_total",
                &self.spec_accepted,
                "MTP drafts accepted, by position in the window (1 = first draft).",
            ),
        ] {
            let _ = writeln!(s, "# HELP strata:{name} {help}");
            let _ = writeln!(s, "# TYPE strata:{name} counter");
            for (j, a) in arr.iter().enumerate() {
                let _ = writeln!(s, "strata:{name}{{position=\"{}\"}} {}", j + 1, g(a));
            }
        }
        s
    }
}
