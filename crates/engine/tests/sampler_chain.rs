//! The sampler chain's logit-editing stages on hand-computed cases (penalties, DRY), cases where
//! the order of two stages changes the result, the JSON form of the whole configuration, and
//! the greedy fast path (edits beside the raw logits) against the candidate-set path.

mod sampler_support;

use sampler_support::{Rng, ToyVocab};
use strata_engine::sampler::dry::DryParams;
use strata_engine::sampler::penalties::PenaltyParams;
use strata_engine::sampler::slop::{ListChoice, SlopConfig, SlopEntry};
use strata_engine::sampler::{
    apply, Candidates, Pick, SampleContext, Sampled, Sampler, SamplerConfig, Stage,
};

fn ctx(history: &[u32]) -> SampleContext<'_> {
    SampleContext {
        position: history.len() as u64,
        history,
    }
}

/// The logits after one stage, by id.
fn after(stage: &Stage, logits: &[f32], history: &[u32]) -> Vec<f32> {
    let mut c = Candidates::from_logits(logits).unwrap();
    apply(stage, &mut c, &ctx(history));
    let mut out = vec![f32::NAN; logits.len()];
    for x in &c.items {
        out[x.id as usize] = x.logit;
    }
    out
}

#[test]
fn penalties_by_hand() {
    let logits = [2.0, -1.0, 0.5, 3.0];
    let history = [0, 1, 0, 3];
    let p = |last_n| {
        Stage::Penalties(PenaltyParams {
            last_n,
            repeat: 2.0,
            frequency: 0.5,
            presence: 0.25,
        })
    };
    // Whole history: counts 0→2, 1→1, 3→1.
    // id 0: 2/2 − (2·0.5 + 0.25) = −0.25; id 1: −1·2 − 0.75 = −2.75; id 3: 3/2 − 0.75 = 0.75.
    assert_eq!(
        after(&p(-1), &logits, &history),
        vec![-0.25, -2.75, 0.5, 0.75]
    );
    // Last two tokens [0, 3]: id 0 once → 1 − 0.75 = 0.25; id 1 untouched.
    assert_eq!(after(&p(2), &logits, &history), vec![0.25, -1.0, 0.5, 0.75]);
    // Off: last_n 0, or every knob neutral.
    assert_eq!(after(&p(0), &logits, &history), logits.to_vec());
    let neutral = Stage::Penalties(PenaltyParams::default());
    assert_eq!(after(&neutral, &logits, &history), logits.to_vec());
}

#[test]
fn dry_by_hand() {
    // llama.cpp's worked example: a b c c b c y a b c. Emitting c would make "a b c" a
    // 4-token repeat (the 3 tokens before it already repeat), y would continue "b c" (2),
    // b would continue "c" (1, under the allowed length).
    let (a, b, c, y) = (0u32, 1, 2, 6);
    let history = [a, b, c, c, b, c, y, a, b, c];
    let logits = [0.0f32; 8];
    let dry = |breakers: Vec<u32>| -> Vec<f32> {
        let p = DryParams {
            multiplier: 0.8,
            base: 1.75,
            allowed_length: 2,
            last_n: -1,
            sequence_breakers: vec![],
        };
        let pens = strata_engine::sampler::dry::penalties(&p, &breakers, &history);
        let mut l = logits.to_vec();
        for (id, pen) in pens {
            l[id as usize] -= pen;
        }
        l
    };
    let l = dry(vec![]);
    // c: 0.8·1.75^(3−2) = 1.4; y: 0.8·1.75^0 = 0.8.
    assert_eq!(l[c as usize], -1.4);
    assert_eq!(l[y as usize], -0.8);
    assert_eq!(l[b as usize], 0.0);
    assert_eq!(l[a as usize], 0.0);
    // y a breaker: repeats reach back only to after the latest y (3 tokens), c keeps its
    // penalty and y, a breaker, is never penalized.
    let l = dry(vec![y]);
    assert_eq!((l[c as usize], l[y as usize]), (-1.4, 0.0));
    // b a breaker: the latest b is 1 token from the end, under the allowed length: no penalty.
    assert_eq!(dry(vec![b]), logits.to_vec());
    // Through the stage (no vocabulary, so no breakers), same numbers.
    let stage = Stage::Dry(DryParams {
        multiplier: 0.8,
        base: 1.75,
        allowed_length: 2,
        last_n: -1,
        sequence_breakers: vec![],
    });
    let l = after(&stage, &logits, &history);
    assert_eq!((l[c as usize], l[y as usize]), (-1.4, -0.8));
    // A window of the last 4 tokens (y a b c) holds no repeat.
    let stage = Stage::Dry(DryParams {
        multiplier: 0.8,
        base: 1.75,
        allowed_length: 2,
        last_n: 4,
        sequence_breakers: vec![],
    });
    assert_eq!(after(&stage, &logits, &history), logits.to_vec());
}

#[test]
fn dry_breakers_come_from_token_text() {
    let v = ToyVocab::new();
    let p = DryParams {
        multiplier: 1.0,
        ..DryParams::default()
    };
    let ids = strata_engine::sampler::dry::breaker_ids(&p, v.pieces.len(), &|id| {
        v.pieces[id as usize].as_bytes().to_vec()
    });
    // Default breakers "\n", ":", "\"", "*": the toy vocabulary has "\n", "\n\n" and " \n".
    let want: Vec<u32> = ["\n", "\n\n", " \n"].iter().map(|s| v.id(s)).collect();
    let mut want = want;
    want.sort();
    assert_eq!(ids, want);
}

#[test]
fn order_of_stages_changes_the_result() {
    // Penalty before top-k: token 0 (3.0) is halved to 1.5, so top-1 keeps token 1 (2.9).
    // Top-k first keeps only token 0, and the penalty cannot bring token 1 back.
    let logits = [3.0f32, 2.9, 1.0];
    let history = [0u32];
    let pen = Stage::Penalties(PenaltyParams {
        last_n: -1,
        repeat: 2.0,
        frequency: 0.0,
        presence: 0.0,
    });
    let top1 = Stage::TopK { k: 1 };
    let run = |stages: Vec<Stage>| {
        let mut s = Sampler::new(SamplerConfig {
            stages,
            pick: Pick::Greedy,
        })
        .unwrap();
        s.sample(&logits, &ctx(&history)).unwrap()
    };
    assert_eq!(run(vec![pen.clone(), top1.clone()]), 1);
    assert_eq!(run(vec![top1, pen]), 0);

    // min_p 0.5 on probabilities 0.5 / 0.3 / 0.2 keeps {0, 1} (threshold 0.25); after
    // temperature 2 the probabilities are ∝ √p, relative 1 / 0.775 / 0.632, and all three
    // pass.
    let logits: Vec<f32> = [0.5f32, 0.3, 0.2].iter().map(|p| p.ln()).collect();
    let kept = |stages: &[Stage]| {
        let mut c = Candidates::from_logits(&logits).unwrap();
        for s in stages {
            apply(s, &mut c, &ctx(&[]));
        }
        c.sort();
        c.items.iter().map(|x| x.id).collect::<Vec<_>>()
    };
    let min_p = Stage::MinP {
        p: 0.5,
        min_keep: 1,
    };
    let temp = Stage::Temperature { t: 2.0 };
    assert_eq!(kept(&[min_p.clone(), temp.clone()]), vec![0, 1]);
    assert_eq!(kept(&[temp, min_p]), vec![0, 1, 2]);
}

fn full_config() -> SamplerConfig {
    SamplerConfig {
        stages: vec![
            Stage::Penalties(PenaltyParams {
                last_n: 64,
                repeat: 1.1,
                frequency: 0.1,
                presence: 0.2,
            }),
            Stage::Dry(DryParams {
                multiplier: 0.8,
                ..DryParams::default()
            }),
            Stage::Slop(SlopConfig {
                mode: 2,
                list: ListChoice::None,
                entries: vec![
                    SlopEntry {
                        phrase: "the cat".into(),
                        penalty: 2.5,
                    },
                    SlopEntry {
                        phrase: "tapestry".into(),
                        penalty: f32::INFINITY,
                    },
                ],
                ban: vec!["in conclusion".into()],
                newline_run_cap: 2,
                blank_run_cap: 0,
                max_rewinds: 8,
            }),
            Stage::TopK { k: 40 },
            Stage::TopP {
                p: 0.95,
                min_keep: 1,
            },
            Stage::MinP {
                p: 0.05,
                min_keep: 1,
            },
            Stage::Temperature { t: 0.8 },
        ],
        pick: Pick::Draw { seed: 7 },
    }
}

#[test]
fn json_form_of_the_whole_configuration() {
    let c = full_config();
    let json = c.to_json();
    // An infinite penalty is written as "inf"; the form reads back to the same value.
    assert!(json.contains(r#""penalty":"inf""#), "{json}");
    assert_eq!(SamplerConfig::from_json(&json).unwrap(), c);

    // Defaults fill what a request leaves out.
    let src = r#"{"stages":[{"type":"penalties","repeat":1.2},{"type":"dry","multiplier":0.5},
        {"type":"slop","mode":1}],"pick":{"type":"greedy"}}"#;
    let c = SamplerConfig::from_json(src).unwrap();
    assert_eq!(
        c.stages[0],
        Stage::Penalties(PenaltyParams {
            last_n: 64,
            repeat: 1.2,
            frequency: 0.0,
            presence: 0.0
        })
    );
    assert_eq!(
        c.stages[1],
        Stage::Dry(DryParams {
            multiplier: 0.5,
            base: 1.75,
            allowed_length: 2,
            last_n: -1,
            sequence_breakers: vec!["\n".into(), ":".into(), "\"".into(), "*".into()],
        })
    );
    assert_eq!(
        c.stages[2],
        Stage::Slop(SlopConfig {
            mode: 1,
            ..SlopConfig::default()
        })
    );

    // Nonsense is refused with the stage named.
    let bad = [
        r#"{"stages":[{"type":"slop","mode":3}],"pick":{"type":"greedy"}}"#,
        r#"{"stages":[{"type":"slop","mode":1,"mood":2}],"pick":{"type":"greedy"}}"#,
        r#"{"stages":[{"type":"slop","mode":1},{"type":"slop","mode":2}],"pick":{"type":"greedy"}}"#,
        r#"{"stages":[{"type":"slop","mode":1,"entries":[{"phrase":"x","penalty":-1}]}],"pick":{"type":"greedy"}}"#,
        r#"{"stages":[{"type":"slop","mode":1,"entries":[{"phrase":"x","penalty":"lots"}]}],"pick":{"type":"greedy"}}"#,
        r#"{"stages":[{"type":"slop","mode":1,"ban":["  "]}],"pick":{"type":"greedy"}}"#,
        r#"{"stages":[{"type":"penalties","repeat":0}],"pick":{"type":"greedy"}}"#,
        r#"{"stages":[{"type":"dry","multiplier":1,"base":0.5}],"pick":{"type":"greedy"}}"#,
        r#"{"stages":[{"type":"dry","multiplier":1,"last_n":-2}],"pick":{"type":"greedy"}}"#,
        // The base stages' ranges (docs/SAMPLING.md): top_p (0, 1], min_p [0, 1], t ≥ 0.
        r#"{"stages":[{"type":"top_p","p":2}],"pick":{"type":"greedy"}}"#,
        r#"{"stages":[{"type":"top_p","p":0}],"pick":{"type":"greedy"}}"#,
        r#"{"stages":[{"type":"min_p","p":-0.5}],"pick":{"type":"greedy"}}"#,
        r#"{"stages":[{"type":"temperature","t":-1}],"pick":{"type":"greedy"}}"#,
    ];
    for b in bad {
        assert!(SamplerConfig::from_json(b).is_err(), "accepted {b}");
    }
}

#[test]
fn stages_that_need_a_vocabulary_say_so() {
    let err = Sampler::new(full_config()).unwrap_err().to_string();
    assert!(err.contains("vocabulary"), "{err}");
    // With one, the sampler builds; slop mode 0 and DRY without breakers need none.
    Sampler::with_vocab(full_config(), &ToyVocab::new()).unwrap();
    let c = SamplerConfig {
        stages: vec![
            Stage::Slop(SlopConfig::default()),
            Stage::Dry(DryParams {
                multiplier: 1.0,
                sequence_breakers: vec![],
                ..DryParams::default()
            }),
        ],
        pick: Pick::Greedy,
    };
    Sampler::new(c).unwrap();
}

/// The greedy pick after edits (the overlay path) equals the candidate-set path (forced by a
/// neutral top-k stage) on random logits, histories and slop lists, including −∞ logits.
#[test]
fn greedy_overlay_path_equals_the_candidate_path() {
    let v = ToyVocab::new();
    let n = v.pieces.len();
    let mut r = Rng(5);
    for case in 0..300 {
        let history: Vec<u32> = (0..r.below(40))
            .map(|_| 1 + r.below(n - 1) as u32)
            .collect();
        let mut logits: Vec<f32> = (0..n).map(|_| 3.0 * r.unit()).collect();
        for _ in 0..r.below(4) {
            let i = r.below(n);
            logits[i] = f32::NEG_INFINITY;
        }
        // Ties, so the lower-id rule is exercised.
        let (i, j) = (r.below(n), r.below(n));
        logits[i] = logits[j];
        let phrases: Vec<SlopEntry> = (0..1 + r.below(4))
            .map(|_| SlopEntry {
                phrase: sampler_support::WORDS[r.below(sampler_support::WORDS.len())].into(),
                penalty: if r.below(4) == 0 {
                    f32::INFINITY
                } else {
                    4.0 * r.unit().abs()
                },
            })
            .collect();
        let edits = vec![
            Stage::Penalties(PenaltyParams {
                last_n: -1,
                repeat: 1.3,
                frequency: 0.2,
                presence: 0.1,
            }),
            Stage::Dry(DryParams {
                multiplier: 0.7,
                allowed_length: 1,
                ..DryParams::default()
            }),
            Stage::Slop(SlopConfig {
                mode: 1 + (case % 2) as u8,
                list: ListChoice::None,
                entries: phrases,
                newline_run_cap: 1,
                blank_run_cap: 2,
                ..SlopConfig::default()
            }),
        ];
        let mut fast = Sampler::with_vocab(
            SamplerConfig {
                stages: edits.clone(),
                pick: Pick::Greedy,
            },
            &v,
        )
        .unwrap();
        let mut slow_stages = edits;
        slow_stages.push(Stage::TopK { k: 0 });
        let mut slow = Sampler::with_vocab(
            SamplerConfig {
                stages: slow_stages,
                pick: Pick::Greedy,
            },
            &v,
        )
        .unwrap();
        let c = ctx(&history);
        let a = fast.sample_with(&logits, &c, None).unwrap();
        let b = slow.sample_with(&logits, &c, None).unwrap();
        assert_eq!(a, b, "case {case}");
        if let Sampled::Token(t) = a {
            assert!(logits[t as usize] > f32::NEG_INFINITY);
        }
    }
}

/// A seeded chain with edit stages draws the same token at a position whatever the order in
/// which positions are visited (the draw is keyed by position; the edits read the history).
#[test]
fn seeded_chain_with_edits_is_a_function_of_position_and_history() {
    let v = ToyVocab::new();
    let n = v.pieces.len();
    let cfg = full_config();
    let mut a = Sampler::with_vocab(cfg.clone(), &v).unwrap();
    let mut b = Sampler::with_vocab(cfg, &v).unwrap();
    let mut r = Rng(11);
    let cases: Vec<(Vec<u32>, Vec<f32>)> = (0..50)
        .map(|_| {
            let h: Vec<u32> = (0..1 + r.below(30))
                .map(|_| 1 + r.below(n - 1) as u32)
                .collect();
            let l: Vec<f32> = (0..n).map(|_| 2.0 * r.unit()).collect();
            (h, l)
        })
        .collect();
    let fwd: Vec<u32> = cases
        .iter()
        .map(|(h, l)| {
            a.reset_sequence();
            a.sample(l, &ctx(h)).unwrap()
        })
        .collect();
    let mut bwd: Vec<u32> = cases
        .iter()
        .rev()
        .map(|(h, l)| {
            b.reset_sequence();
            b.sample(l, &ctx(h)).unwrap()
        })
        .collect();
    bwd.reverse();
    assert_eq!(fwd, bwd);
    assert!(fwd.iter().any(|&t| t != fwd[0]));
}

/// The vectorized argmax equals a scalar scan that keeps the first maximum, on random data
/// with ties, ±0, −∞ and lengths around the 16-lane chunking; a NaN is reported at its index.
#[test]
fn vectorized_argmax_equals_the_scalar_scan() {
    use strata_engine::sampler::view::first_max;
    let mut r = Rng(77);
    for case in 0..2000 {
        let n = match case % 4 {
            0 => r.below(40),
            1 => 16 * (1 + r.below(8)),
            _ => r.below(3000),
        };
        let pool = [0.0f32, -0.0, 1.5, -2.0, f32::NEG_INFINITY, 7.25];
        let v: Vec<f32> = (0..n)
            .map(|_| match r.below(3) {
                0 => pool[r.below(pool.len())],
                _ => 4.0 * r.unit(),
            })
            .collect();
        let mut want: Option<(usize, f32)> = None;
        for (i, &x) in v.iter().enumerate() {
            if want.is_none_or(|(_, b)| x > b) {
                want = Some((i, x));
            }
        }
        let got = first_max(&v).unwrap();
        assert_eq!(got.map(|g| g.0), want.map(|w| w.0), "case {case}: {v:?}");
        if n > 0 {
            let mut w = v.clone();
            let k = r.below(n);
            w[k] = f32::NAN;
            let first = w.iter().position(|x| x.is_nan()).unwrap();
            assert_eq!(first_max(&w), Err(first));
            assert!(strata_engine::sampler::argmax(&w).is_err());
        }
    }
}

/// docs/SAMPLING.md's examples are valid: its JSON configuration parses and builds, and its
/// slop-list excerpt parses.
#[test]
fn the_documented_examples_parse() {
    let doc = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/SAMPLING.md"),
    )
    .unwrap();
    let block = |lang: &str| -> String {
        let start = doc.find(&format!("```{lang}\n")).unwrap() + lang.len() + 4;
        let end = start + doc[start..].find("```").unwrap();
        doc[start..end].to_string()
    };
    let c = SamplerConfig::from_json(&block("json")).unwrap();
    assert_eq!(c.stages.len(), 7);
    Sampler::with_vocab(c, &ToyVocab::new()).unwrap();
    let list = strata_engine::sampler::slop::parse_list(&block("slop"), "SAMPLING.md").unwrap();
    assert_eq!(list.len(), 3);
    assert_eq!(list[2].penalty, f32::INFINITY);
}
