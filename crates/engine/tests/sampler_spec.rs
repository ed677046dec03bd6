//! Speculative decoding with the penalties on: a model-free trunk (logits a function of the
//! history, as a verify window row equals a decode step), a drafter over a shuffled draft
//! vocabulary (the trunk's logits plus noise, reached through the inverse map) and a reference
//! speculative loop written against the sampler's explicit-state API. With slop modes 1 and 2,
//! greedy and seeded, the speculative output equals the plain guarded loop's token for token;
//! and penalizing the drafts (`Sampler::penalize_draft`) makes them agree with the sampler more
//! often. A second loop drives the sampler the way a `Picker` does (no explicit state) and
//! matches the plain loop too.

mod sampler_support;

use sampler_support::{draft_vocab, unit, FakeSession, ToyVocab, Trunk};
use strata_engine::generate::{self, GenOptions};
use strata_engine::sampler::dry::DryParams;
use strata_engine::sampler::guard;
use strata_engine::sampler::penalties::PenaltyParams;
use strata_engine::sampler::slop::{Accepted, DeadEnd, ListChoice, SlopConfig, SlopEntry};
use strata_engine::sampler::{Pick, SampleContext, Sampled, Sampler, SamplerConfig, Stage};

const SCRIPT: &str = "The cat sat on the mat. She would delve into a rich tapestry of shivers \
    down her spine.\n\n\n In conclusion, it is important to note that the dog ran home, and the \
    cat sat on a mat in conclusion.\n\n\n\n";

fn config(mode: u8, pick: Pick) -> SamplerConfig {
    let entries = [
        ("delve", 2.0),
        ("a rich tapestry", 1.5),
        ("in conclusion", f32::INFINITY),
        ("it is important", 3.0),
        ("the cat", 1.0),
    ]
    .iter()
    .map(|&(p, v)| SlopEntry {
        phrase: p.into(),
        penalty: v,
    })
    .collect();
    let mut stages = vec![
        Stage::Penalties(PenaltyParams {
            last_n: 32,
            repeat: 1.1,
            frequency: 0.05,
            presence: 0.0,
        }),
        Stage::Dry(DryParams {
            multiplier: 0.5,
            ..DryParams::default()
        }),
        Stage::Slop(SlopConfig {
            mode,
            list: ListChoice::None,
            entries,
            newline_run_cap: 2,
            blank_run_cap: 3,
            max_rewinds: 32,
            ..SlopConfig::default()
        }),
    ];
    if let Pick::Draw { .. } = pick {
        stages.extend([Stage::TopK { k: 20 }, Stage::Temperature { t: 0.8 }]);
    }
    SamplerConfig { stages, pick }
}

struct Setup {
    v: ToyVocab,
    trunk: Trunk,
    prompt: Vec<u32>,
    ids: Vec<u32>,
    inverse: Vec<i32>,
}

/// `drop_every`: the draft vocabulary misses every id ≡ 1 (mod drop_every); 0 keeps them all.
fn setup(seed: u64, drop_every: usize) -> Setup {
    let v = ToyVocab::new();
    let prompt = v.encode_str("Once upon a time,");
    let trunk = Trunk {
        n_vocab: v.pieces.len(),
        prompt_len: prompt.len(),
        script: v.encode_str(SCRIPT),
        seed,
        bonus: 3.0,
        noise: 1.0,
    };
    let (ids, inverse) = draft_vocab(v.pieces.len(), seed, drop_every);
    Setup {
        v,
        trunk,
        prompt,
        ids,
        inverse,
    }
}

const N: usize = 80;
const K: usize = 4;

/// The plain guarded loop.
fn plain(s: &Setup, cfg: &SamplerConfig) -> Vec<u32> {
    let mut sampler = Sampler::with_vocab(cfg.clone(), &s.v).unwrap();
    guard::generate(
        &mut FakeSession::new(s.trunk.clone()),
        &s.prompt,
        &mut sampler,
        &|t| t == 0,
        &GenOptions {
            max_tokens: N,
            prefill_chunk: 512,
        },
        &mut |_| true,
    )
    .unwrap()
    .generation
    .tokens
}

/// The drafter: the trunk's logits on the draft rows plus noise, in draft order.
fn draft_logits(s: &Setup, history: &[u32]) -> Vec<f32> {
    let full = s.trunk.logits(history);
    s.ids
        .iter()
        .enumerate()
        .map(|(d, &id)| full[id as usize] + 0.05 * unit(history.len() as u64 * 7919 + d as u64))
        .collect()
}

fn argmax(v: &[f32]) -> usize {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best
}

struct SpecRun {
    tokens: Vec<u32>,
    /// Windows verified, and those whose first draft the sampler agreed with.
    windows: usize,
    first_agreed: usize,
}

/// A reference speculative loop over the explicit-state API: draft K tokens (penalized or
/// not), verify them row by row with the sampler, keep the agreeing prefix and the sampler's
/// own token, follow the slop state's rewinds.
fn speculative(s: &Setup, cfg: &SamplerConfig, penalize_drafts: bool) -> SpecRun {
    let mut sampler = Sampler::with_vocab(cfg.clone(), &s.v).unwrap();
    let start = s.prompt.len();
    let mut st = sampler.new_slop_state(start).unwrap();
    let mut hist = s.prompt.clone();
    let (mut windows, mut first_agreed) = (0, 0);
    'outer: loop {
        // Draft.
        let mut drafts = Vec::new();
        let mut h = hist.clone();
        for _ in 0..K {
            let mut dl = draft_logits(s, &h);
            if penalize_drafts {
                let ctx = SampleContext {
                    position: h.len() as u64,
                    history: &h,
                };
                sampler.penalize_draft(&mut dl, &s.inverse, &ctx, Some(&st));
            }
            let t = s.ids[argmax(&dl)];
            drafts.push(t);
            h.push(t);
        }
        windows += 1;
        // Verify: row i is the trunk on hist + drafts[..i].
        for i in 0..=K {
            let logits = s.trunk.logits(&hist);
            let ctx = SampleContext {
                position: hist.len() as u64,
                history: &hist,
            };
            let tok = match sampler.sample_with(&logits, &ctx, Some(&st)).unwrap() {
                Sampled::Token(t) => t,
                Sampled::DeadEnd => match st.dead_end() {
                    DeadEnd::Rewound { position, .. } => {
                        hist.truncate(position);
                        continue 'outer;
                    }
                    DeadEnd::Stop => break 'outer,
                },
            };
            if tok == 0 {
                break 'outer;
            }
            match st.accept(tok) {
                Accepted::Kept => hist.push(tok),
                Accepted::Rewound { position, .. } => {
                    hist.truncate(position);
                    continue 'outer;
                }
                Accepted::Exhausted { position } => {
                    hist.truncate(position);
                    break 'outer;
                }
            }
            if hist.len() - start >= N {
                break 'outer;
            }
            if drafts.get(i) != Some(&tok) {
                continue 'outer;
            }
            if i == 0 {
                first_agreed += 1;
            }
        }
    }
    SpecRun {
        tokens: hist[start..].to_vec(),
        windows,
        first_agreed,
    }
}

#[test]
fn speculative_equals_plain_with_slop_modes_1_and_2() {
    let mut acc_with = (0, 0);
    let mut acc_without = (0, 0);
    let mut rewinding_runs = 0;
    for seed in 0..12u64 {
        // Odd seeds: a draft vocabulary with holes; even: every id, shuffled (the agreement
        // figure is taken there, where only the penalties and the noise separate the drafter
        // from the sampler).
        let s = setup(seed, if seed % 2 == 1 { 5 } else { 0 });
        for mode in [1u8, 2] {
            for pick in [Pick::Greedy, Pick::Draw { seed: 99 + seed }] {
                let cfg = config(mode, pick.clone());
                let want = plain(&s, &cfg);
                assert_eq!(want.len(), N, "seed {seed} mode {mode} {pick:?}");
                for pen in [true, false] {
                    let got = speculative(&s, &cfg, pen);
                    assert_eq!(
                        got.tokens,
                        want,
                        "seed {seed} mode {mode} {pick:?} drafts penalized {pen}:\n{:?}\n{:?}",
                        s.v.text(&got.tokens),
                        s.v.text(&want)
                    );
                    if mode == 2 && pick == Pick::Greedy && seed % 2 == 0 {
                        let a = if pen { &mut acc_with } else { &mut acc_without };
                        a.0 += got.first_agreed;
                        a.1 += got.windows;
                    }
                }
                // The phrase level acted in some runs (the comparison covers rewinds).
                if mode == 2 && !s.v.text(&want).to_lowercase().contains("delve") {
                    let free = plain(&s, &config(0, pick));
                    if s.v.text(&free).to_lowercase().contains("delve") {
                        rewinding_runs += 1;
                    }
                }
            }
        }
    }
    let rate = |a: (usize, usize)| a.0 as f64 / a.1 as f64;
    eprintln!(
        "first-draft agreement, mode 2 greedy: {:.3} with penalized drafts, {:.3} without",
        rate(acc_with),
        rate(acc_without)
    );
    assert!(rate(acc_with) > rate(acc_without) + 0.03);
    assert!(rewinding_runs > 5, "{rewinding_runs}");
}

/// A speculative loop that, like the spec controller's `Picker`, calls `Sampler::sample` with
/// the history only: the sampler's own state follows it (token level) and the output equals
/// the plain loop's (which also passes no state).
#[test]
fn implicit_state_follows_a_speculative_history() {
    for seed in 0..8u64 {
        let s = setup(seed, 5);
        for mode in [1u8, 2] {
            for pick in [Pick::Greedy, Pick::Draw { seed: 5 + seed }] {
                let cfg = config(mode, pick.clone());
                let mut a = Sampler::with_vocab(cfg.clone(), &s.v).unwrap();
                let want = generate::generate(
                    &mut FakeSession::new(s.trunk.clone()),
                    &s.prompt,
                    &mut a,
                    &|t| t == 0,
                    &GenOptions {
                        max_tokens: N,
                        prefill_chunk: 512,
                    },
                    &mut |_| true,
                )
                .unwrap()
                .tokens;
                let mut b = Sampler::with_vocab(cfg, &s.v).unwrap();
                let mut hist = s.prompt.clone();
                while hist.len() - s.prompt.len() < N {
                    let mut drafts = Vec::new();
                    let mut h = hist.clone();
                    for _ in 0..K {
                        let mut dl = draft_logits(&s, &h);
                        let ctx = SampleContext {
                            position: h.len() as u64,
                            history: &h,
                        };
                        b.penalize_draft(&mut dl, &s.inverse, &ctx, None);
                        let t = s.ids[argmax(&dl)];
                        drafts.push(t);
                        h.push(t);
                    }
                    for i in 0..=K {
                        let logits = s.trunk.logits(&hist);
                        let ctx = SampleContext {
                            position: hist.len() as u64,
                            history: &hist,
                        };
                        let tok = b.sample(&logits, &ctx).unwrap();
                        hist.push(tok);
                        if drafts.get(i) != Some(&tok) || hist.len() - s.prompt.len() >= N {
                            break;
                        }
                    }
                }
                assert_eq!(
                    &hist[s.prompt.len()..],
                    &want[..],
                    "seed {seed} mode {mode}"
                );
            }
        }
    }
}
