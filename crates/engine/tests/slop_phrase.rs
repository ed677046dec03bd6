//! The phrase level's guarantees, as properties over random logits and random phrase lists (a
//! model-free trunk over a toy vocabulary that likes to write slop): a banned phrase never
//! appears in the output, streamed tokens are never taken back, rewinds stay within their
//! budget, and the two ways out (budget spent, every continuation banned) end the output
//! before the phrase.

mod sampler_support;

use proptest::prelude::*;
use sampler_support::{FakeSession, Rng, ToyVocab, Trunk, WORDS};
use strata_engine::generate::{GenOptions, Session, StopReason};
use strata_engine::sampler::guard::{self, GuardStop};
use strata_engine::sampler::slop::{ListChoice, SlopConfig, SlopEntry};
use strata_engine::sampler::{Pick, Sampler, SamplerConfig, Stage};
use strata_engine::Result;

const SCRIPT: &str = "The cat sat on the mat. She would delve into a rich tapestry of shivers \
    down her spine. In conclusion, it is important to note that the dog ran home, and the cat \
    sat on a mat in conclusion.\n\n";

/// The oracle, written apart from the engine's matcher: does `text` hold `phrase` (ASCII case
/// folded; a phrase starting with a word character only at the start of a word)?
fn holds(text: &str, phrase: &str) -> bool {
    let t = text.to_ascii_lowercase();
    let p = phrase.trim().to_ascii_lowercase();
    let word = |b: u8| b.is_ascii_alphanumeric() || b == b'_' || b >= 0x80;
    let needs_start = word(p.as_bytes()[0]);
    t.match_indices(&p)
        .any(|(s, _)| !needs_start || s == 0 || !word(t.as_bytes()[s - 1]))
}

fn slop_sampler(v: &ToyVocab, phrases: &[SlopEntry], max_rewinds: u32, pick: Pick) -> Sampler {
    let mut stages = vec![Stage::Slop(SlopConfig {
        mode: 2,
        list: ListChoice::None,
        entries: phrases.to_vec(),
        max_rewinds,
        ..SlopConfig::default()
    })];
    if let Pick::Draw { .. } = pick {
        stages.push(Stage::Temperature { t: 0.7 });
    }
    Sampler::with_vocab(SamplerConfig { stages, pick }, v).unwrap()
}

struct Run {
    tokens: Vec<u32>,
    streamed: Vec<u32>,
    stop: GuardStop,
    rewinds: u32,
}

fn run(session: &mut dyn Session, prompt: &[u32], sampler: &mut Sampler, n: usize) -> Run {
    let mut streamed = Vec::new();
    let g = guard::generate(
        session,
        prompt,
        sampler,
        &|t| t == 0,
        &GenOptions {
            max_tokens: n,
            prefill_chunk: 4,
        },
        &mut |t| {
            streamed.push(t);
            true
        },
    )
    .unwrap();
    Run {
        tokens: g.generation.tokens,
        streamed,
        stop: g.stop,
        rewinds: g.rewinds,
    }
}

/// Random phrases: 1–3 consecutive words of the script (so the trunk would write them) or a
/// random vocabulary word; random penalties, some infinite.
fn phrases(r: &mut Rng, n: usize) -> Vec<SlopEntry> {
    let words: Vec<&str> = SCRIPT.split_whitespace().collect();
    (0..n)
        .map(|_| {
            let phrase = if r.below(4) == 0 {
                WORDS[r.below(WORDS.len())].to_string()
            } else {
                let a = r.below(words.len() - 3);
                words[a..a + 1 + r.below(3)].join(" ")
            };
            let penalty = match r.below(3) {
                0 => f32::INFINITY,
                _ => 3.0 * r.unit().abs(),
            };
            SlopEntry { phrase, penalty }
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn banned_phrases_never_appear_and_nothing_is_retracted(
        seed in any::<u64>(),
        n_phrases in 1usize..6,
        greedy in any::<bool>(),
        bonus in 0.5f32..6.0,
        noise in 0.5f32..3.0,
    ) {
        let v = ToyVocab::new();
        let mut r = Rng(seed);
        let list = phrases(&mut r, n_phrases);
        let prompt = v.encode_str("Once upon a time");
        let trunk = Trunk {
            n_vocab: v.pieces.len(),
            prompt_len: prompt.len(),
            script: v.encode_str(SCRIPT),
            seed,
            bonus,
            noise,
        };
        let pick = if greedy { Pick::Greedy } else { Pick::Draw { seed: seed ^ 1 } };
        let mut s = slop_sampler(&v, &list, 64, pick);
        let out = run(&mut FakeSession::new(trunk), &prompt, &mut s, 48);
        let text = v.text(&out.tokens);
        for p in &list {
            prop_assert!(!holds(&text, &p.phrase), "{:?} in {text:?}", p.phrase);
        }
        // Every token handed out is in the output, in order, once.
        prop_assert_eq!(&out.streamed, &out.tokens);
        prop_assert!(out.rewinds <= 64);
        match out.stop {
            GuardStop::Plain(StopReason::MaxTokens) => prop_assert_eq!(out.tokens.len(), 48),
            GuardStop::Plain(StopReason::Eog(_)) => {}
            GuardStop::RewindBudget | GuardStop::DeadEnd => prop_assert!(out.tokens.len() < 48),
            other => prop_assert!(false, "stop {other:?}"),
        }
    }
}

/// The property is not vacuous: the same runs without the ban write the phrases.
#[test]
fn the_trunk_writes_the_phrases_when_they_are_not_banned() {
    let v = ToyVocab::new();
    let prompt = v.encode_str("Once upon a time");
    let mut hits = 0;
    let mut rewound = 0;
    for seed in 0..40u64 {
        let mut r = Rng(seed);
        let list = phrases(&mut r, 3);
        let trunk = Trunk {
            n_vocab: v.pieces.len(),
            prompt_len: prompt.len(),
            script: v.encode_str(SCRIPT),
            seed,
            bonus: 4.0,
            noise: 1.5,
        };
        let mut plain = Sampler::with_vocab(SamplerConfig::greedy(), &v).unwrap();
        let free = run(
            &mut FakeSession::new(trunk.clone()),
            &prompt,
            &mut plain,
            48,
        );
        let text = v.text(&free.tokens);
        if list.iter().any(|p| holds(&text, &p.phrase)) {
            hits += 1;
            let mut s = slop_sampler(&v, &list, 64, Pick::Greedy);
            let out = run(&mut FakeSession::new(trunk), &prompt, &mut s, 48);
            if out.rewinds > 0 {
                rewound += 1;
            }
        }
    }
    assert!(hits >= 30, "{hits} of 40 free runs wrote a listed phrase");
    assert!(rewound >= 10, "{rewound} banned runs rewound");
}

#[test]
fn a_spent_budget_ends_the_output_before_the_phrase() {
    let v = ToyVocab::new();
    let prompt = v.encode_str("Once upon a time");
    let trunk = Trunk {
        n_vocab: v.pieces.len(),
        prompt_len: prompt.len(),
        script: v.encode_str(SCRIPT),
        seed: 3,
        bonus: 20.0,
        noise: 0.1,
    };
    // The trunk writes the script verbatim. " delve" is one token, so the token level only
    // subtracts its penalty: with penalty 0 the trunk still writes it and the rewind must act.
    let list = [SlopEntry {
        phrase: "delve".into(),
        penalty: 0.0,
    }];
    let mut s = slop_sampler(&v, &list, 0, Pick::Greedy);
    let out = run(&mut FakeSession::new(trunk.clone()), &prompt, &mut s, 48);
    assert_eq!(out.stop, GuardStop::RewindBudget);
    assert_eq!(v.text(&out.tokens), "The cat sat on the mat. She would");
    assert_eq!(out.streamed, out.tokens);
    // With a budget, the rewind bans " delve" there and the script goes on without it.
    let mut s = slop_sampler(&v, &list, 4, Pick::Greedy);
    let out = run(&mut FakeSession::new(trunk), &prompt, &mut s, 48);
    assert_eq!(out.rewinds, 1);
    let text = v.text(&out.tokens);
    assert!(
        text.starts_with("The cat sat on the mat. She would"),
        "{text}"
    );
    assert!(!holds(&text, "delve"), "{text}");
    assert_eq!(out.tokens.len(), 48);
}

/// A session whose only finite logits are the script's next token and one alternative: banning
/// both leaves nothing to sample.
struct Narrow {
    tokens: Vec<u32>,
    prompt_len: usize,
    script: Vec<u32>,
    alt: u32,
    n_vocab: usize,
}

impl Session for Narrow {
    fn n_vocab(&self) -> usize {
        self.n_vocab
    }
    fn n_ctx(&self) -> usize {
        1000
    }
    fn tokens(&self) -> &[u32] {
        &self.tokens
    }
    fn feed(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        self.tokens.extend_from_slice(tokens);
        let mut l = vec![f32::NEG_INFINITY; self.n_vocab];
        let k = (self.tokens.len() - self.prompt_len) % self.script.len();
        l[self.script[k] as usize] = 1.0;
        l[self.alt as usize] = 0.0;
        Ok(l)
    }
    fn rewind(&mut self, pos: usize) -> Result<()> {
        self.tokens.truncate(pos);
        Ok(())
    }
}

#[test]
fn when_every_continuation_is_banned_the_output_stops_before_the_phrase() {
    let v = ToyVocab::new();
    let prompt = v.encode_str("Once");
    let script = v.encode_str(" the cat sat on the mat");
    let mk = || Narrow {
        tokens: Vec::new(),
        prompt_len: prompt.len(),
        script: script.clone(),
        alt: v.id(" dog"),
        n_vocab: v.pieces.len(),
    };
    // After " the", both " cat" and " dog" would complete a listed phrase: nothing is left.
    // " the" is still held back (it may start "the cat"), so it is banned in turn, and at its
    // position the trunk's other token, " dog", goes on.
    let list: Vec<SlopEntry> = ["the cat", "the dog"]
        .iter()
        .map(|p| SlopEntry {
            phrase: p.to_string(),
            penalty: 1.0,
        })
        .collect();
    let mut s = slop_sampler(&v, &list, 64, Pick::Greedy);
    let out = run(&mut mk(), &prompt, &mut s, 6);
    let text = v.text(&out.tokens);
    assert!(
        !holds(&text, "the cat") && !holds(&text, "the dog"),
        "{text}"
    );
    assert_eq!(out.streamed, out.tokens);
    assert!(out.rewinds >= 1);
    // Ban " dog" as a word too: after " the" is banned at the first position, nothing is left
    // there and nothing before it can be taken back (it is the prompt): the output ends empty.
    let mut list2 = list.clone();
    list2.push(SlopEntry {
        phrase: "dog".into(),
        penalty: 1.0,
    });
    // Both picks find the dead end (greedy reads the edits beside the logits; a draw goes
    // through the candidate set).
    for pick in [Pick::Greedy, Pick::Draw { seed: 4 }] {
        let mut s = slop_sampler(&v, &list2, 64, pick);
        let out = run(&mut mk(), &prompt, &mut s, 6);
        assert_eq!(out.stop, GuardStop::DeadEnd);
        assert!(out.tokens.is_empty(), "{:?}", v.text(&out.tokens));
    }
}
