//! Sampler cost per token, by slop mode, at the full vocabulary of qwen4exp (248,320 ids) and
//! at the 40,525-id draft vocabulary: the greedy pick, the usual seeded chain, the draft path
//! (penalties on draft logits through the inverse map, then the argmax) and the phrase
//! matcher's bookkeeping per accepted token. Medians over many calls on one core.
//!
//! The slop tables come from the Qwen2.5 vocabulary fixture (151,936 ids, padded with empty
//! tokens to 248,320) and the built-in list. Run:
//! `cargo run --release -p strata-engine --example sampler_cost`

use std::path::PathBuf;
use std::time::Instant;

use strata_engine::sampler::penalties::PenaltyParams;
use strata_engine::sampler::slop::{SlopConfig, SlopState};
use strata_engine::sampler::vocab::SamplerVocab;
use strata_engine::sampler::{Pick, SampleContext, Sampler, SamplerConfig, Stage};
use strata_engine::Result;
use strata_tokenizer::Tokenizer;

const FULL: usize = 248_320;
const DRAFT: usize = 40_525;

struct Padded(Tokenizer);

impl SamplerVocab for Padded {
    fn n_vocab(&self) -> usize {
        FULL
    }
    fn piece(&self, id: u32) -> Vec<u8> {
        if (id as usize) < self.0.n_vocab() {
            self.0.piece(id)
        } else {
            Vec::new()
        }
    }
    fn encode(&self, text: &str) -> Result<Vec<u32>> {
        SamplerVocab::encode(&self.0, text)
    }
}

fn median_us(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn time<F: FnMut()>(reps: usize, mut f: F) -> f64 {
    for _ in 0..5 {
        f();
    }
    median_us(
        (0..reps)
            .map(|_| {
                let t = Instant::now();
                f();
                t.elapsed().as_secs_f64() * 1e6
            })
            .collect(),
    )
}

fn main() {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures/tokenizer/qwen25-coder-vocab.gguf");
    let file = strata_gguf::GgufFile::open(&p).expect("the Qwen2.5 vocabulary fixture");
    let vocab = Padded(Tokenizer::from_gguf(&file).expect("tokenizer"));
    let history_text = "Once upon a time, in a bustling harbor town, the old keeper would \
        often delve into his memories. She felt shivers down her";
    let prompt: Vec<u32> = SamplerVocab::encode(&vocab, "Tell me a story.").unwrap();
    let gen: Vec<u32> = SamplerVocab::encode(&vocab, history_text).unwrap();
    let mut history = prompt.clone();
    history.extend(&gen);
    let mut x = 0x1234_5678_9abc_def0u64;
    let mut rnd = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x >> 40) as f32 / (1u64 << 24) as f32 * 8.0 - 4.0
    };
    let full: Vec<f32> = (0..FULL).map(|_| rnd()).collect();
    let draft: Vec<f32> = (0..DRAFT).map(|_| rnd()).collect();
    // Draft ids: every sixth id, so that about a sixth of the listed tokens are in it.
    let mut inverse = vec![-1i32; FULL];
    for d in 0..DRAFT {
        inverse[d * 6] = d as i32;
    }
    let reps = 400;
    println!("| path | vocab | mode 0 (µs) | mode 1 (µs) | mode 2 (µs) |");
    println!("|---|---|---|---|---|");
    let chain = |mode: u8, pick: Pick, draw_stages: bool| {
        let mut stages = Vec::new();
        if mode > 0 {
            stages.push(Stage::Slop(SlopConfig {
                mode,
                ..SlopConfig::default()
            }));
        }
        if draw_stages {
            stages.extend([
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
            ]);
        }
        SamplerConfig { stages, pick }
    };
    // Two states: mid-sentence with phrase matches open, and after four blank tokens (the
    // blank cap of 4 is hit: 437 class tokens are removed).
    let blanks: Vec<u32> = ["\n", "    ", "\n", "    "]
        .iter()
        .flat_map(|t| SamplerVocab::encode(&vocab, t).unwrap())
        .collect();
    let mut gen_caps = gen.clone();
    gen_caps.extend(&blanks);
    let state_for = |s: &Sampler, g: &[u32]| -> Option<SlopState> {
        let mut st = s.new_slop_state(prompt.len())?;
        for &t in g {
            st.push_token(t);
        }
        Some(st)
    };
    let full_151k = &full[..151_936];
    for (name, pick, draw) in [
        ("greedy", Pick::Greedy, false),
        (
            "seeded chain (top-k 40, top-p 0.95, min-p 0.05, t 0.8)",
            Pick::Draw { seed: 1 },
            true,
        ),
    ] {
        for (n, logits) in [(FULL, &full[..]), (151_936, full_151k)] {
            for (when, g) in [("mid-phrase", &gen), ("blank cap hit", &gen_caps)] {
                let mut row = format!("| {name}, {when} | {n} |");
                let mut h = prompt.clone();
                h.extend(g.iter());
                for mode in 0..3u8 {
                    let mut s =
                        Sampler::with_vocab(chain(mode, pick.clone(), draw), &vocab).unwrap();
                    let st = state_for(&s, g);
                    let ctx = SampleContext {
                        position: h.len() as u64,
                        history: &h,
                    };
                    let us = time(reps, || {
                        std::hint::black_box(s.sample_with(logits, &ctx, st.as_ref()).unwrap());
                    });
                    row += &format!(" {us:.1} |");
                }
                println!("{row}");
            }
        }
    }
    // The draft path: penalize the 40,525 draft logits through the inverse map, then argmax.
    for (when, g) in [("mid-phrase", &gen), ("blank cap hit", &gen_caps)] {
        let mut row = format!("| draft: penalize_draft + argmax, {when} | {DRAFT} of {FULL} |");
        let mut h = prompt.clone();
        h.extend(g.iter());
        for mode in 0..3u8 {
            let s = Sampler::with_vocab(chain(mode, Pick::Greedy, false), &vocab).unwrap();
            let st = state_for(&s, g);
            let ctx = SampleContext {
                position: h.len() as u64,
                history: &h,
            };
            let mut buf = draft.clone();
            let us = time(reps, || {
                buf.copy_from_slice(&draft);
                s.penalize_draft(&mut buf, &inverse, &ctx, st.as_ref());
                std::hint::black_box(strata_engine::sampler::argmax(&buf).unwrap());
            });
            row += &format!(" {us:.1} |");
        }
        println!("{row}");
    }
    // Per accepted token: the state's bookkeeping (runs, matches; text matching in mode 2).
    let mut row =
        format!("| state: accept one token (SlopState::accept + take_commits) | {FULL} |");
    row += " 0 |";
    for mode in 1..3u8 {
        let s = Sampler::with_vocab(chain(mode, Pick::Greedy, false), &vocab).unwrap();
        let mut st = state_for(&s, &gen).unwrap();
        let toks: Vec<u32> = SamplerVocab::encode(&vocab, " spine and the sea").unwrap();
        let mut i = 0;
        let us = time(reps, || {
            let t = toks[i % toks.len()];
            i += 1;
            std::hint::black_box(st.accept(t));
            std::hint::black_box(st.take_commits());
        });
        row += &format!(" {us:.2} |");
    }
    println!("{row}");
    // Reference points: the plain argmax, and the penalties stage alone.
    let us = time(reps, || {
        std::hint::black_box(strata_engine::sampler::argmax(&full).unwrap());
    });
    println!("\nplain argmax over {FULL}: {us:.1} µs");
    let mut s = Sampler::with_vocab(
        SamplerConfig {
            stages: vec![Stage::Penalties(PenaltyParams {
                repeat: 1.1,
                ..PenaltyParams::default()
            })],
            pick: Pick::Greedy,
        },
        &vocab,
    )
    .unwrap();
    let ctx = SampleContext {
        position: history.len() as u64,
        history: &history,
    };
    let us = time(reps, || {
        std::hint::black_box(s.sample(&full, &ctx).unwrap());
    });
    println!("greedy after repetition penalties (last 64) over {FULL}: {us:.1} µs");
    // Building a sampler (what a server does per request unless it caches): the vocabulary
    // scan for the classes, the list's spellings tokenized, the lower-cased pieces in mode 2.
    for mode in 1..3u8 {
        let t = Instant::now();
        let n = 5;
        for _ in 0..n {
            std::hint::black_box(
                Sampler::with_vocab(chain(mode, Pick::Greedy, false), &vocab).unwrap(),
            );
        }
        println!(
            "Sampler::with_vocab, slop mode {mode}, built-in list, {FULL} ids: {:.1} ms",
            t.elapsed().as_secs_f64() * 1e3 / n as f64
        );
    }
}
