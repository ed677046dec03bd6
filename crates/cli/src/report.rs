//! What `run` and `chat` say on stderr about a generation: the `--verbose` timing report, the
//! slop line, and — always, not only with `--verbose` — that the context limit ended it.

use std::time::Duration;

use strata_engine::generate::{Generation, StopReason};
use strata_engine::sampler::guard::{GuardStop, GuardedGeneration};
use strata_engine::sampler::Sampler;

pub fn stop_text(s: GuardStop) -> String {
    match s {
        GuardStop::Plain(StopReason::Eog(id)) => format!("end of generation (token {id})"),
        GuardStop::Plain(StopReason::MaxTokens) => "token budget".to_string(),
        GuardStop::Plain(StopReason::ContextFull) => "context full".to_string(),
        GuardStop::Plain(StopReason::Stopped) => "output closed".to_string(),
        GuardStop::RewindBudget => {
            "slop rewind budget spent (the reply ends before a listed phrase)".to_string()
        }
        GuardStop::DeadEnd => "slop: every continuation was banned".to_string(),
    }
}

/// The line every generation that hit the context limit prints on stderr.
pub fn context_full(n_ctx: usize) {
    eprintln!(
        "note: generation stopped at the context limit ({n_ctx} positions); \
         a larger --ctx or a shorter prompt leaves more room"
    );
}

/// The `--verbose` report.
pub fn verbose(load: Duration, g: &Generation, backend: &str, sampler: &Sampler) {
    let t = &g.timings;
    eprintln!(
        "prompt: {} tokens in {:.3} s ({:.2} tokens/s){}",
        t.prompt_tokens,
        t.prompt.as_secs_f64(),
        t.prompt_tps(),
        if t.reused_tokens > 0 {
            format!(", {} reused from the cache", t.reused_tokens)
        } else {
            String::new()
        }
    );
    eprintln!(
        "decode: {} tokens in {:.3} s ({:.2} tokens/s, {:.2} ms/token); sampling {:.3} s for {} tokens",
        t.decoded_tokens,
        t.decode.as_secs_f64(),
        t.decode_tps(),
        1e3 * t.decode.as_secs_f64() / t.decoded_tokens.max(1) as f64,
        t.sample.as_secs_f64(),
        t.sampled_tokens
    );
    eprintln!(
        "load {:.2} s on {backend}; stop: {}; sampler {}",
        load.as_secs_f64(),
        stop_text(GuardStop::Plain(g.stop)),
        sampler.config().to_json()
    );
}

/// The `--verbose` line about slop's phrase level, when it acted.
pub fn slop(g: &GuardedGeneration) {
    match g.stop {
        GuardStop::RewindBudget => eprintln!(
            "slop: {} rewinds; the rewind budget ran out, the reply ends before a listed phrase",
            g.rewinds
        ),
        GuardStop::DeadEnd => eprintln!(
            "slop: {} rewinds; every continuation was banned, the reply ends there",
            g.rewinds
        ),
        GuardStop::Plain(_) if g.rewinds > 0 => eprintln!("slop: {} rewinds", g.rewinds),
        GuardStop::Plain(_) => {}
    }
}
