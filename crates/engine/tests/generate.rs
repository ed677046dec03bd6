//! The generation loop on the tiny qwen4exp fixture (always present): its tokens against a plain
//! forward-and-argmax loop, its stop conditions, prefix reuse and the replay that rolls a
//! recurrent model back.

use std::path::PathBuf;

use strata_engine::generate::{self, GenOptions, Qwen4expSession, Session, StopReason};
use strata_engine::qwen4exp::{LoadOptions, Model};
use strata_engine::sampler::{argmax, Sampler, SamplerConfig};
use strata_engine::CpuBackend;

mod qwen2_random;

fn tiny() -> Model<CpuBackend> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures/qwen4exp/tiny/model-f32.gguf");
    Model::load(&path, CpuBackend::new(2).unwrap(), &LoadOptions::default()).unwrap()
}

const PROMPT: [u32; 6] = [84, 104, 101, 32, 114, 105];

/// Greedy tokens by hand: the whole prompt, then one token at a time.
fn by_hand(model: &Model<CpuBackend>, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut st = model.new_state().unwrap();
    let out = model.forward(&mut st, prompt).unwrap();
    let mut next = argmax(out.row(out.rows() - 1).unwrap()).unwrap();
    let mut toks = vec![next];
    while toks.len() < n {
        let out = model.forward(&mut st, &[next]).unwrap();
        next = argmax(out.row(0).unwrap()).unwrap();
        toks.push(next);
    }
    toks
}

fn greedy(
    s: &mut dyn Session,
    prompt: &[u32],
    max: usize,
    chunk: usize,
    eog: &dyn Fn(u32) -> bool,
) -> generate::Generation {
    let mut sampler = Sampler::new(SamplerConfig::greedy()).unwrap();
    let opts = GenOptions {
        max_tokens: max,
        prefill_chunk: chunk,
    };
    let mut streamed = Vec::new();
    let g = generate::generate(s, prompt, &mut sampler, eog, &opts, &mut |t| {
        streamed.push(t);
        true
    })
    .unwrap();
    assert_eq!(
        streamed, g.tokens,
        "every kept token was streamed, in order"
    );
    g
}

#[test]
fn greedy_generation_matches_a_hand_loop() {
    let model = tiny();
    let want = by_hand(&model, &PROMPT, 8);
    for chunk in [512, 4, 1] {
        let mut s = Qwen4expSession::new(&model).unwrap();
        let g = greedy(&mut s, &PROMPT, 8, chunk, &|_| false);
        assert_eq!(g.tokens, want, "prefill in chunks of {chunk}");
        assert_eq!(g.stop, StopReason::MaxTokens);
        // The last token of the budget is not fed: nothing would read its logits.
        assert_eq!(s.tokens().len(), PROMPT.len() + 7);
        assert_eq!(g.timings.decoded_tokens, 7);
        assert_eq!(g.timings.sampled_tokens, 8);
    }
}

#[test]
fn stops_at_end_of_generation_and_on_request() {
    let model = tiny();
    let want = by_hand(&model, &PROMPT, 3);
    let mut s = Qwen4expSession::new(&model).unwrap();
    let eog = want[2];
    let g = greedy(&mut s, &PROMPT, 10, 512, &|t| t == eog);
    assert_eq!(g.stop, StopReason::Eog(eog));
    assert_eq!(g.tokens, want[..2]);
    // The end token is not fed to the sequence.
    assert_eq!(s.tokens().len(), PROMPT.len() + 2);

    let mut s = Qwen4expSession::new(&model).unwrap();
    let mut sampler = Sampler::new(SamplerConfig::greedy()).unwrap();
    let g = generate::generate(
        &mut s,
        &PROMPT,
        &mut sampler,
        &|_| false,
        &GenOptions::default(),
        &mut |_| false,
    )
    .unwrap();
    assert_eq!(g.stop, StopReason::Stopped);
    assert_eq!(g.tokens, want[..1]);

    let mut sampler = Sampler::new(SamplerConfig::greedy()).unwrap();
    assert!(generate::generate(
        &mut s,
        &[],
        &mut sampler,
        &|_| false,
        &GenOptions::default(),
        &mut |_| true
    )
    .is_err());
}

#[test]
fn a_diverging_prompt_replays_the_shared_prefix() {
    let model = tiny();
    let mut s = Qwen4expSession::new(&model).unwrap();
    greedy(&mut s, &PROMPT, 5, 512, &|_| false);
    // Shares three tokens with what the session holds; the recurrent state must be rebuilt.
    let other = [84u32, 104, 101, 200, 7, 9];
    let g = greedy(&mut s, &other, 6, 512, &|_| false);
    assert_eq!(g.timings.reused_tokens, 3);
    assert_eq!(g.timings.prompt_tokens, 3);
    assert_eq!(g.tokens, by_hand(&model, &other, 6));
    // Extending what the session holds runs only the new tokens.
    let mut longer = other.to_vec();
    longer.extend_from_slice(&g.tokens);
    let h = greedy(&mut s, &longer, 4, 512, &|_| false);
    assert_eq!(h.timings.reused_tokens, other.len() + 5);
    assert_eq!(h.tokens, by_hand(&model, &longer, 4));
    // An out-of-range token fails and leaves the session usable and unchanged.
    let before = s.tokens().to_vec();
    assert!(s.feed(&[1, 100_000]).is_err());
    assert_eq!(s.tokens(), &before[..]);
    let again = greedy(&mut s, &longer, 4, 512, &|_| false);
    assert_eq!(again.tokens, h.tokens);
}

/// A session that only feeds (the default `feed_picked`: None), so the decoding loop picks on
/// the host from each token's logits.
struct LogitsOnly<'a>(&'a mut dyn Session);

impl Session for LogitsOnly<'_> {
    fn n_vocab(&self) -> usize {
        self.0.n_vocab()
    }
    fn n_ctx(&self) -> usize {
        self.0.n_ctx()
    }
    fn tokens(&self) -> &[u32] {
        self.0.tokens()
    }
    fn feed(&mut self, tokens: &[u32]) -> strata_engine::Result<Vec<f32>> {
        self.0.feed(tokens)
    }
    fn rewind(&mut self, pos: usize) -> strata_engine::Result<()> {
        self.0.rewind(pos)
    }
}

/// Generates `max` tokens after `prompt` with `cfg` twice, through `picked` (the backend's
/// pick) and through `plain` wrapped in [`LogitsOnly`], both fresh sessions of one model: the
/// tokens, the stop and the sequences left behind must be equal.
fn picks_equal_the_logits_path(
    picked: &mut dyn Session,
    plain: &mut dyn Session,
    prompt: &[u32],
    cfg: &SamplerConfig,
    opts: &GenOptions,
) {
    assert!(cfg.device_pick().is_some(), "{cfg:?} is a device pick");
    let run = |s: &mut dyn Session| {
        let mut sampler = Sampler::new(cfg.clone()).unwrap();
        generate::generate(s, prompt, &mut sampler, &|_| false, opts, &mut |_| true).unwrap()
    };
    let a = run(picked);
    let b = run(&mut LogitsOnly(plain));
    assert_eq!(a.tokens, b.tokens, "{cfg:?}");
    assert_eq!(a.stop, b.stop, "{cfg:?}");
    assert_eq!(picked.tokens(), plain.tokens(), "{cfg:?}");
    assert_eq!(a.tokens.len(), opts.max_tokens);
}

/// Plain decoding's windows take the backend's pick (`Session::feed_picked`, only ids cross)
/// where the sampler is one (greedy, or a seeded draw with at most a temperature): the tokens,
/// the stop and the sequence equal the host's picks from the logits, and a direct call picks
/// what `sampler::pick_row` picks at the next token's position.
#[test]
fn plain_decoding_with_the_backends_pick_equals_picking_from_the_logits() {
    use strata_engine::backend::DevicePick;
    use strata_engine::sampler::{pick_row, Pick, Stage};
    let model = tiny();
    let opts = GenOptions {
        max_tokens: 12,
        prefill_chunk: 4,
    };
    for cfg in [
        SamplerConfig::greedy(),
        SamplerConfig {
            stages: vec![Stage::Temperature { t: 0.7 }],
            pick: Pick::Draw { seed: 42 },
        },
        SamplerConfig {
            stages: Vec::new(),
            pick: Pick::Draw { seed: 7 },
        },
    ] {
        picks_equal_the_logits_path(
            &mut Qwen4expSession::new(&model).unwrap(),
            &mut Qwen4expSession::new(&model).unwrap(),
            &PROMPT,
            &cfg,
            &opts,
        );
    }
    // One call: the pick of the token after the fed one, at its position.
    let mut s = Qwen4expSession::new(&model).unwrap();
    let mut t = Qwen4expSession::new(&model).unwrap();
    s.feed(&PROMPT).unwrap();
    t.feed(&PROMPT).unwrap();
    for pick in [
        DevicePick::Greedy,
        DevicePick::Draw {
            seed: 3,
            temperature: 0.9,
        },
    ] {
        let got = s.feed_picked(&[PROMPT[0]], pick).unwrap();
        let logits = t.feed(&[PROMPT[0]]).unwrap();
        let want = pick_row(pick, &logits, t.tokens().len() as u64).unwrap();
        assert_eq!(got, Some(want), "{pick:?}");
        assert_eq!(s.tokens(), t.tokens());
    }
}

/// The same for qwen2 (`qwen2::Model::forward_picked`), on the random model in the default
/// model's formats: greedy and a seeded draw against picking from the logits.
#[test]
fn qwen2_plain_decoding_with_the_backends_pick_equals_picking_from_the_logits() {
    use strata_engine::generate::Qwen2Session;
    use strata_engine::qwen2::{LoadOptions as Q2, Model as M2};
    use strata_engine::sampler::{Pick, Stage};
    let model = M2::from_file(
        qwen2_random::qwen2_mixed(),
        CpuBackend::new(2).unwrap(),
        &Q2 {
            kv_type: strata_engine::KvType::F32,
        },
    )
    .unwrap();
    let prompt: Vec<u32> = (0..12).map(|i| (i * 37 + 5) % 1024).collect();
    let opts = GenOptions {
        max_tokens: 16,
        prefill_chunk: 5,
    };
    for cfg in [
        SamplerConfig::greedy(),
        SamplerConfig {
            stages: vec![Stage::Temperature { t: 0.8 }],
            pick: Pick::Draw { seed: 11 },
        },
    ] {
        picks_equal_the_logits_path(
            &mut Qwen2Session::new(&model).unwrap(),
            &mut Qwen2Session::new(&model).unwrap(),
            &prompt,
            &cfg,
            &opts,
        );
    }
}
