//! Unit tests per stage on small hand-computed cases.

use super::*;

const CTX: SampleContext<'static> = SampleContext {
    position: 0,
    history: &[],
};

fn ids(c: &Candidates) -> Vec<u32> {
    c.items.iter().map(|x| x.id).collect()
}

/// Logits whose softmax is exactly the given probabilities (up to f32 rounding of the logs).
fn logits_of(p: &[f32]) -> Vec<f32> {
    p.iter().map(|x| x.ln()).collect()
}

fn run(stage: Stage, logits: &[f32]) -> Vec<u32> {
    let mut c = Candidates::from_logits(logits).unwrap();
    apply(&stage, &mut c, &CTX);
    c.sort();
    ids(&c)
}

#[test]
fn greedy_takes_the_max_and_the_lower_id_on_ties() {
    assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]).unwrap(), 1);
    assert_eq!(argmax(&[-5.0, f32::NEG_INFINITY, -4.0]).unwrap(), 2);
    assert!(argmax(&[0.0, f32::NAN]).is_err());
    assert!(argmax(&[]).is_err());
    // The chained path (a greedy pick after stages) agrees.
    let mut s = Sampler::new(SamplerConfig {
        stages: vec![Stage::TopK { k: 3 }],
        pick: Pick::Greedy,
    })
    .unwrap();
    assert_eq!(s.sample(&[1.0, 3.0, 3.0, 2.0], &CTX).unwrap(), 1);
}

#[test]
fn top_k_keeps_the_k_best_with_ties_to_lower_ids() {
    assert_eq!(run(Stage::TopK { k: 2 }, &[1.0, 3.0, 3.0, 2.0]), vec![1, 2]);
    assert_eq!(
        run(Stage::TopK { k: 3 }, &[0.0, 0.0, 0.0, 0.0, 1.0]),
        vec![4, 0, 1]
    );
    // 0 is off; k beyond the vocabulary keeps everything.
    assert_eq!(run(Stage::TopK { k: 0 }, &[1.0, 2.0]), vec![1, 0]);
    assert_eq!(run(Stage::TopK { k: 9 }, &[1.0, 2.0]), vec![1, 0]);
}

#[test]
fn top_p_keeps_the_smallest_prefix_reaching_p() {
    // Probabilities 0.5, 0.3, 0.2 → cumulative 0.5, 0.8, 1.0.
    let l = logits_of(&[0.2, 0.5, 0.3]);
    let top_p = |p: f32, min_keep: usize| run(Stage::TopP { p, min_keep }, &l);
    assert_eq!(top_p(0.45, 1), vec![1]);
    assert_eq!(top_p(0.75, 1), vec![1, 2]);
    assert_eq!(top_p(0.85, 1), vec![1, 2, 0]);
    assert_eq!(top_p(0.1, 2), vec![1, 2]);
    assert_eq!(top_p(1.0, 1), vec![1, 2, 0]);
}

#[test]
fn min_p_keeps_tokens_above_a_fraction_of_the_best() {
    // Probabilities 0.5, 0.3, 0.2.
    let l = logits_of(&[0.3, 0.2, 0.5]);
    let min_p = |p: f32, min_keep: usize| run(Stage::MinP { p, min_keep }, &l);
    assert_eq!(min_p(0.7, 1), vec![2]); // threshold 0.35
    assert_eq!(min_p(0.5, 1), vec![2, 0]); // threshold 0.25
    assert_eq!(min_p(0.35, 1), vec![2, 0, 1]); // threshold 0.175
    assert_eq!(min_p(0.9, 3), vec![2, 0, 1]);
    assert_eq!(min_p(0.0, 1), vec![2, 0, 1]);
}

#[test]
fn temperature_scales_logits_and_zero_keeps_the_best() {
    let mut c = Candidates::from_logits(&[2.0, 4.0, -1.0]).unwrap();
    apply(&Stage::Temperature { t: 2.0 }, &mut c, &CTX);
    let got: Vec<f32> = c.items.iter().map(|x| x.logit).collect();
    assert_eq!(got, vec![1.0, 2.0, -0.5]);
    assert_eq!(
        run(Stage::Temperature { t: 0.0 }, &[2.0, 4.0, 4.0]),
        vec![1]
    );
}

#[test]
fn draw_follows_the_philox_uniform() {
    // Probabilities 0.25 (id 0) and 0.75 (id 1): canonical order visits id 1 first, so the draw
    // is id 1 exactly when u < 0.75.
    let l = logits_of(&[0.25, 0.75]);
    let mut s = Sampler::new(SamplerConfig {
        stages: vec![],
        pick: Pick::Draw { seed: 1234 },
    })
    .unwrap();
    let mut ones = 0;
    for pos in 0..4000u64 {
        let u = philox::uniform(1234, pos, 0);
        let got = s
            .sample(
                &l,
                &SampleContext {
                    position: pos,
                    history: &[],
                },
            )
            .unwrap();
        assert_eq!(got, if u < 0.75 { 1 } else { 0 }, "position {pos}, u {u}");
        ones += got as usize;
    }
    // 3000 ± 27 expected (binomial σ); 5σ bounds.
    assert!((2865..=3135).contains(&ones), "{ones} of 4000");
}

#[test]
fn temperature_before_the_draw_sharpens_it() {
    // Probabilities 0.25 / 0.75 at t = 0.5 become 1/10 / 9/10.
    let l = logits_of(&[0.25, 0.75]);
    let mut s = Sampler::new(SamplerConfig {
        stages: vec![Stage::Temperature { t: 0.5 }],
        pick: Pick::Draw { seed: 9 },
    })
    .unwrap();
    for pos in 0..2000u64 {
        let u = philox::uniform(9, pos, 0);
        if (u - 0.9).abs() < 1e-6 {
            continue;
        }
        let got = s
            .sample(
                &l,
                &SampleContext {
                    position: pos,
                    history: &[],
                },
            )
            .unwrap();
        assert_eq!(got, if u < 0.9 { 1 } else { 0 }, "position {pos}, u {u}");
    }
}

#[test]
fn a_draw_depends_only_on_seed_and_position() {
    let l: Vec<f32> = (0..50).map(|i| ((i * 37) % 11) as f32 * 0.3).collect();
    let cfg = SamplerConfig::standard(0.9, 20, 0.95, 0.02, 77);
    let mut a = Sampler::new(cfg.clone()).unwrap();
    let mut b = Sampler::new(cfg).unwrap();
    let at = |s: &mut Sampler, p: u64| {
        s.sample(
            &l,
            &SampleContext {
                position: p,
                history: &[],
            },
        )
        .unwrap()
    };
    let forward: Vec<u32> = (0..40).map(|p| at(&mut a, p)).collect();
    let backward: Vec<u32> = (0..40).rev().map(|p| at(&mut b, p)).collect();
    let backward: Vec<u32> = backward.into_iter().rev().collect();
    assert_eq!(forward, backward);
    // More than one token is drawn at all (the distribution is not degenerate).
    assert!(forward.iter().any(|&t| t != forward[0]));
}

#[test]
fn standard_chain_is_in_llama_cpp_order() {
    assert_eq!(
        SamplerConfig::standard(0.0, 40, 0.9, 0.1, 1),
        SamplerConfig::greedy()
    );
    let c = SamplerConfig::standard(0.8, 40, 0.95, 0.05, 7);
    assert_eq!(
        c.stages,
        vec![
            Stage::TopK { k: 40 },
            Stage::TopP {
                p: 0.95,
                min_keep: 1
            },
            Stage::MinP {
                p: 0.05,
                min_keep: 1
            },
            Stage::Temperature { t: 0.8 },
        ]
    );
    assert_eq!(c.pick, Pick::Draw { seed: 7 });
    // Neutral settings add no stages.
    assert!(SamplerConfig::standard(1.0, 0, 1.0, 0.0, 7)
        .stages
        .is_empty());
}

#[test]
fn json_form_round_trips_and_rejects_nonsense() {
    let src = r#"{"stages":[{"type":"top_k","k":5},{"type":"min_p","p":0.1},
                 {"type":"temperature","t":0.5}],"pick":{"type":"draw","seed":3}}"#;
    let c = SamplerConfig::from_json(src).unwrap();
    assert_eq!(
        c.stages,
        vec![
            Stage::TopK { k: 5 },
            Stage::MinP {
                p: 0.1,
                min_keep: 1
            },
            Stage::Temperature { t: 0.5 }
        ]
    );
    assert_eq!(SamplerConfig::from_json(&c.to_json()).unwrap(), c);
    assert!(SamplerConfig::from_json(r#"{"pick":{"type":"greedy"}}"#).is_ok());
    assert!(
        SamplerConfig::from_json(r#"{"stages":[{"type":"top_q"}],"pick":{"type":"greedy"}}"#)
            .is_err()
    );
    assert!(SamplerConfig::from_json(
        r#"{"stages":[{"type":"top_p","p":-1}],"pick":{"type":"greedy"}}"#
    )
    .is_err());
}

#[test]
fn masked_and_bad_logits() {
    let mut s = Sampler::new(SamplerConfig::standard(1.0, 0, 1.0, 0.0, 5)).unwrap();
    // Only token 2 has mass.
    let l = [f32::NEG_INFINITY, f32::NEG_INFINITY, 0.0];
    for p in 0..20 {
        let ctx = SampleContext {
            position: p,
            history: &[],
        };
        assert_eq!(s.sample(&l, &ctx).unwrap(), 2);
    }
    assert!(s.sample(&[f32::NEG_INFINITY; 3], &CTX).is_err());
    assert!(s.sample(&[0.0, f32::NAN], &CTX).is_err());
}

mod overlay_top_k {
    use super::super::view::{CandidateEdit, LogitEdit, Overlay};
    use super::*;
    use proptest::prelude::*;

    /// Values with many ties, both zeros and both infinities.
    fn value() -> impl Strategy<Value = f32> {
        prop_oneof![
            (-6i32..6).prop_map(|v| v as f32 * 0.5),
            Just(0.0f32),
            Just(-0.0f32),
            Just(f32::NEG_INFINITY),
            Just(f32::INFINITY),
            any::<f32>().prop_filter("finite", |v| v.is_finite()),
        ]
    }

    /// The reference: every candidate built, the edits applied through the chain's own view,
    /// the best `k` kept.
    fn reference(base: &[f32], edits: &[(u32, f32)], k: usize) -> Result<Vec<(u32, u32)>> {
        let mut c = Candidates::from_logits(base)?;
        {
            let mut e = CandidateEdit::new(&mut c);
            for &(id, d) in edits {
                e.edit(id, &mut |x| *x -= d);
            }
        }
        c.keep_best(k);
        Ok(c.items.iter().map(|x| (x.id, x.logit.to_bits())).collect())
    }

    fn fast(base: &[f32], edits: &[(u32, f32)], k: usize) -> Result<Vec<(u32, u32)>> {
        let mut ov = Overlay::new(base);
        for &(id, d) in edits {
            ov.edit(id, &mut |x| *x -= d);
        }
        let c = ov.top_k(k)?;
        assert!(c.sorted);
        Ok(c.items.iter().map(|x| (x.id, x.logit.to_bits())).collect())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(600))]
        /// `Overlay::top_k` keeps exactly the reference's candidates, in its order, with its
        /// bits, for any k (below, at and above the vocabulary), repeated edits of one id,
        /// edits that remove tokens (+∞ subtracted) and ties everywhere.
        #[test]
        fn top_k_equals_building_every_candidate(
            base in prop::collection::vec(value(), 1..300),
            edits in prop::collection::vec(
                (0u32..320, prop_oneof![Just(f32::INFINITY), (-3i32..4).prop_map(|v| v as f32)]),
                0..12,
            ),
            k in 1usize..320,
        ) {
            prop_assert_eq!(fast(&base, &edits, k).unwrap(), reference(&base, &edits, k).unwrap());
        }

        /// A NaN logit is the same error, naming the first NaN, edited or not.
        #[test]
        fn nan_is_the_same_error(
            mut base in prop::collection::vec(value(), 1..100),
            at in prop::collection::vec(0usize..100, 1..3),
            edits in prop::collection::vec((0u32..100, -2i32..3), 0..5),
            k in 1usize..50,
        ) {
            for &i in &at {
                let i = i % base.len();
                base[i] = f32::NAN;
            }
            let edits: Vec<(u32, f32)> = edits.into_iter().map(|(i, d)| (i, d as f32)).collect();
            let a = fast(&base, &edits, k).unwrap_err().to_string();
            let b = reference(&base, &edits, k).unwrap_err().to_string();
            prop_assert_eq!(a, b);
        }
    }
}
