//! Batching (issue 15): eight sequences stepped together, one forward pass per step over all
//! their rows (`forward_batch`), each get exactly their solo bits. The oracle is each
//! sequence's own run through the one decoding loop (`decode::run`, whole-prompt prefill then
//! one token per step). In the batch, sequences join at different steps and prefill in chunks
//! beside the others' decode rows (a step with a prefill chunk and decode rows is required to
//! happen); greedy and seeded; one sequence under slop mode 2 with a phrase that makes it
//! rewind (required). Every logits row each sequence was given is compared bit for bit, and the
//! tokens. On the tiny qwen4exp fixture (GDN, QSA with its indexer, PLE, MoE) and on the
//! default qwen2 model when it is cached (else a SKIP message).

mod common;

use common::{default_model, tiny_dir, Golden};
use strata_engine::decode::{self, DraftEdit, Judged, Lent, Policy, Progress, Stepper, Verified};
use strata_engine::generate::{GenOptions, Timings};
use strata_engine::sampler::guard::GuardStop;
use strata_engine::sampler::slop::{ListChoice, SlopConfig, SlopEntry};
use strata_engine::sampler::{Pick, Sampler, SamplerConfig, Stage};
use strata_engine::{qwen2, qwen4exp, CpuBackend};
use strata_gguf::GgufFile;
use strata_tokenizer::Tokenizer;

/// Tokens each sequence generates at most.
const NEW: usize = 24;
/// Prompt tokens per prefill chunk in the batch.
const CHUNK: usize = 4;

/// What the test needs of a model family.
trait Fam {
    type St;
    fn fresh(&self) -> Self::St;
    fn tokens<'a>(&self, st: &'a Self::St) -> &'a [u32];
    fn n_ctx(&self) -> usize;
    fn run(&self, st: &mut Self::St, tokens: &[u32], last_only: bool) -> Vec<f32>;
    fn batch(&self, items: Vec<(&mut Self::St, &[u32], bool)>) -> Vec<Vec<f32>>;
}

struct Q4(qwen4exp::Model<CpuBackend>);
struct Q2(qwen2::Model<CpuBackend>);

impl Fam for Q4 {
    type St = qwen4exp::State<CpuBackend>;
    fn fresh(&self) -> Self::St {
        self.0.new_state().unwrap()
    }
    fn tokens<'a>(&self, st: &'a Self::St) -> &'a [u32] {
        st.tokens()
    }
    fn n_ctx(&self) -> usize {
        self.0.config().n_ctx
    }
    fn run(&self, st: &mut Self::St, tokens: &[u32], last_only: bool) -> Vec<f32> {
        let want = qwen4exp::Want {
            last_only,
            ..Default::default()
        };
        self.0.forward_with(st, tokens, want).unwrap().logits
    }
    fn batch(&self, items: Vec<(&mut Self::St, &[u32], bool)>) -> Vec<Vec<f32>> {
        let mut items: Vec<_> = items
            .into_iter()
            .map(|(state, tokens, last_only)| qwen4exp::BatchItem::rows(state, tokens, last_only))
            .collect();
        let out = self.0.forward_batch(&mut items).unwrap();
        out.into_iter().map(|o| o.logits).collect()
    }
}

impl Fam for Q2 {
    type St = qwen2::State<CpuBackend>;
    fn fresh(&self) -> Self::St {
        self.0.new_state().unwrap()
    }
    fn tokens<'a>(&self, st: &'a Self::St) -> &'a [u32] {
        st.tokens()
    }
    fn n_ctx(&self) -> usize {
        self.0.config().n_ctx_train
    }
    fn run(&self, st: &mut Self::St, tokens: &[u32], last_only: bool) -> Vec<f32> {
        self.0.forward_with(st, tokens, last_only).unwrap().logits
    }
    fn batch(&self, items: Vec<(&mut Self::St, &[u32], bool)>) -> Vec<Vec<f32>> {
        let mut items: Vec<_> = items
            .into_iter()
            .map(|(state, tokens, last_only)| qwen2::BatchItem {
                state,
                tokens,
                last_only,
            })
            .collect();
        let out = self.0.forward_batch(&mut items).unwrap();
        out.into_iter().map(|o| o.logits).collect()
    }
}

/// A sequence as the decoding loop's stepper: windows of one token; a rewind rebuilds the
/// state from the kept tokens (a whole-prompt pass: the bits of decoding them one by one).
/// Records every logits row it hands the loop.
struct Seq<'a, F: Fam> {
    f: &'a F,
    st: F::St,
    seen: Vec<Vec<f32>>,
}

impl<F: Fam> Stepper for Seq<'_, F> {
    fn n_ctx(&self) -> usize {
        self.f.n_ctx()
    }
    fn tokens(&self) -> &[u32] {
        self.f.tokens(&self.st)
    }
    fn prefill(
        &mut self,
        prompt: &[u32],
        _opts: &GenOptions,
        _t: &mut Timings,
    ) -> strata_engine::Result<Vec<f32>> {
        let have = self.tokens().len();
        let l = self.f.run(&mut self.st, &prompt[have..], true);
        self.seen.push(l.clone());
        Ok(l)
    }
    fn propose(
        &mut self,
        _pending: u32,
        _max: usize,
        _edit: &mut dyn DraftEdit,
    ) -> strata_engine::Result<Vec<u32>> {
        Ok(Vec::new())
    }
    fn verify(&mut self, window: &[u32]) -> strata_engine::Result<Vec<f32>> {
        let l = self.f.run(&mut self.st, window, false);
        self.seen.push(l.clone());
        Ok(l)
    }
    fn settle(&mut self, seq: &[u32], _judged: Judged) -> strata_engine::Result<()> {
        let want = &seq[..seq.len() - 1];
        if self.tokens() != want {
            self.st = self.f.fresh();
            self.f.run(&mut self.st, want, true);
        }
        Ok(())
    }
    fn settle_at_end(&self) -> bool {
        false
    }
}

struct Run {
    tokens: Vec<u32>,
    rewinds: u32,
    seen: Vec<Vec<f32>>,
}

fn sampler(tok: &Tokenizer, cfg: &SamplerConfig) -> Sampler {
    Sampler::with_vocab(cfg.clone(), tok).unwrap()
}

/// One sequence alone: the oracle.
fn solo<F: Fam>(f: &F, tok: &Tokenizer, cfg: &SamplerConfig, prompt: &[u32]) -> Run {
    let mut s = sampler(tok, cfg);
    let slop = s.new_slop_state(prompt.len());
    let mut seq = Seq {
        f,
        st: f.fresh(),
        seen: Vec::new(),
    };
    let is_eog = |t: u32| tok.is_eog(t);
    let mut streamed = Vec::new();
    let d = decode::run(
        &mut seq,
        prompt,
        Policy {
            pick: &mut s,
            slop,
            is_eog: &is_eog,
            window: 1,
        },
        &GenOptions {
            max_tokens: NEW,
            prefill_chunk: 4096,
        },
        &mut |t| {
            streamed.push(t);
            true
        },
    )
    .unwrap();
    assert_eq!(streamed, d.tokens);
    Run {
        tokens: d.tokens,
        rewinds: d.rewinds,
        seen: seq.seen,
    }
}

enum Phase {
    Waiting,
    Prefill(usize),
    Decode,
    Done,
}

/// All sequences together: sequence `i` joins at step `2i`, prefills `CHUNK` tokens per step
/// beside the decode rows of those already running; every step is one `forward_batch`.
/// Returns the runs and how many steps mixed a prefill chunk with decode rows.
fn together<F: Fam>(
    f: &F,
    tok: &Tokenizer,
    cfgs: &[SamplerConfig],
    prompts: &[Vec<u32>],
) -> (Vec<Run>, usize) {
    let n = prompts.len();
    let mut samplers: Vec<Sampler> = cfgs.iter().map(|c| sampler(tok, c)).collect();
    let mut seqs: Vec<Seq<'_, F>> = (0..n)
        .map(|_| Seq {
            f,
            st: f.fresh(),
            seen: Vec::new(),
        })
        .collect();
    let mut progs: Vec<Option<Progress>> = (0..n)
        .map(|i| {
            let slop = samplers[i].new_slop_state(prompts[i].len());
            Some(Progress::new(&mut seqs[i], slop, 1, NEW, prompts[i].len()))
        })
        .collect();
    let mut rewinds = vec![0u32; n];
    let mut phase: Vec<Phase> = (0..n).map(|_| Phase::Waiting).collect();
    let mut out: Vec<Vec<u32>> = vec![Vec::new(); n];
    let is_eog = |t: u32| tok.is_eog(t);
    let mut mixed = 0;
    for step in 0.. {
        if phase.iter().all(|p| matches!(p, Phase::Done)) {
            break;
        }
        assert!(step < 10_000, "the batch never finished");
        // Gather each running sequence's rows.
        let mut rows: Vec<(usize, Vec<u32>, bool)> = Vec::new();
        for i in 0..n {
            if matches!(phase[i], Phase::Waiting) && step >= 2 * i {
                phase[i] = Phase::Prefill(0);
            }
            match phase[i] {
                Phase::Prefill(next) => {
                    let end = (next + CHUNK).min(prompts[i].len());
                    rows.push((i, prompts[i][next..end].to_vec(), true));
                }
                Phase::Decode => {
                    let mut sink = |_t: u32| true;
                    let w = progs[i]
                        .as_mut()
                        .unwrap()
                        .begin_window(Lent {
                            stepper: &mut seqs[i],
                            pick: &mut samplers[i],
                            is_eog: &is_eog,
                            on_token: &mut sink,
                        })
                        .unwrap()
                        .to_vec();
                    rows.push((i, w, false));
                }
                _ => {}
            }
        }
        let prefilling = rows.iter().filter(|r| r.2).count();
        if prefilling > 0 && prefilling < rows.len() {
            mixed += 1;
        }
        // One forward pass over every row.
        let logits = {
            let mut states: Vec<Option<&mut F::St>> =
                seqs.iter_mut().map(|s| Some(&mut s.st)).collect();
            let items = rows
                .iter()
                .map(|(i, t, last)| (states[*i].take().unwrap(), &t[..], *last))
                .collect();
            f.batch(items)
        };
        // Hand each sequence its results.
        for ((i, t, _), l) in rows.iter().zip(logits) {
            let i = *i;
            if let Phase::Prefill(next) = phase[i] {
                let done = next + t.len();
                if done < prompts[i].len() {
                    phase[i] = Phase::Prefill(done);
                    continue;
                }
            }
            seqs[i].seen.push(l.clone());
            let mut sink = |t: u32| {
                out[i].push(t);
                true
            };
            let p = progs[i].as_mut().unwrap();
            let lent = Lent {
                stepper: &mut seqs[i],
                pick: &mut samplers[i],
                is_eog: &is_eog,
                on_token: &mut sink,
            };
            let end: Option<GuardStop> = match phase[i] {
                Phase::Prefill(_) => {
                    phase[i] = Phase::Decode;
                    p.prefilled(lent, &prompts[i], &l, &Timings::default())
                        .unwrap()
                }
                Phase::Decode => p.end_window(lent, Verified::Logits(l)).unwrap().1,
                _ => unreachable!(),
            };
            if let Some(stop) = end {
                let p = progs[i].take().unwrap();
                rewinds[i] = p.rewinds();
                let d = p.finish(&mut sink, stop);
                assert_eq!(d.tokens, out[i]);
                phase[i] = Phase::Done;
            }
        }
    }
    let runs = seqs
        .into_iter()
        .zip(rewinds)
        .zip(out)
        .map(|((s, rewinds), tokens)| Run {
            tokens,
            rewinds,
            seen: s.seen,
        })
        .collect();
    (runs, mixed)
}

/// The sampler chain: mode 0 or 2 slop with `phrases` banned, then the pick (a seeded draw
/// behind top-k and a temperature).
fn config(pick: &Pick, phrases: &[String]) -> SamplerConfig {
    let mut stages = Vec::new();
    if !phrases.is_empty() {
        stages.push(Stage::Slop(SlopConfig {
            mode: 2,
            list: ListChoice::None,
            entries: phrases
                .iter()
                .map(|p| SlopEntry {
                    phrase: p.clone(),
                    penalty: f32::INFINITY,
                })
                .collect(),
            max_rewinds: 16,
            ..SlopConfig::default()
        }));
    }
    if let Pick::Draw { .. } = pick {
        stages.extend([Stage::TopK { k: 20 }, Stage::Temperature { t: 0.9 }]);
    }
    SamplerConfig {
        stages,
        pick: pick.clone(),
    }
}

/// A phrase of the free output of `prompt` that starts inside one token (at a word start,
/// the matcher's rule) and ends in a later one, so only the text matcher sees it and mode 2
/// must rewind: the first candidate whose ban does make the solo run rewind.
fn rewinding_phrase<F: Fam>(f: &F, tok: &Tokenizer, pick: &Pick, prompt: &[u32]) -> String {
    let word = |b: u8| b.is_ascii_alphanumeric() || b == b'_' || b >= 0x80;
    let free = solo(f, tok, &config(pick, &[]), prompt);
    let ids = &free.tokens;
    let piece = |t: u32| tok.decode_bytes(&[t], false).unwrap().to_ascii_lowercase();
    for (k, span) in (1..ids.len().saturating_sub(2)).flat_map(|k| [(k, 2), (k, 3)]) {
        let a = piece(ids[k]);
        let rest: Vec<u8> = ids[k + 1..k + span]
            .iter()
            .flat_map(|&t| piece(t))
            .collect();
        let last = piece(ids[k + span - 1]).len();
        let ends = (rest.len() + 1 - last.min(rest.len())..=rest.len()).rev();
        for (cut, end) in (0..a.len()).flat_map(|c| ends.clone().map(move |e| (c, e))) {
            let mut bytes = a[cut..].to_vec();
            bytes.extend_from_slice(&rest[..end]);
            let Ok(ph) = String::from_utf8(bytes) else {
                continue;
            };
            if ph.len() < 2 || ph.trim() != ph || ph.chars().any(|c| c.is_control()) {
                continue;
            }
            let before = if cut > 0 {
                a.get(cut - 1).copied()
            } else {
                ids[..k]
                    .iter()
                    .rev()
                    .find_map(|&t| piece(t).last().copied())
            };
            if word(ph.as_bytes()[0]) && before.is_some_and(word) {
                continue;
            }
            if solo(f, tok, &config(pick, std::slice::from_ref(&ph)), prompt).rewinds > 0 {
                return ph;
            }
        }
    }
    panic!("no phrase of the free output makes mode 2 rewind: {ids:?}");
}

fn same_bits(a: &[Vec<f32>], b: &[Vec<f32>]) -> bool {
    a.len() == b.len()
        && a.iter().zip(b).all(|(x, y)| {
            x.len() == y.len() && x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits())
        })
}

/// Eight prompts together and alone, greedy and seeded, sequence 3 under slop mode 2.
fn batch_equals_solo<F: Fam>(f: &F, tok: &Tokenizer, prompts: &[Vec<u32>]) {
    assert_eq!(prompts.len(), 8);
    for pick in [Pick::Greedy, Pick::Draw { seed: 1234 }] {
        // Each sequence its own seed.
        let picks: Vec<Pick> = (0..prompts.len() as u64)
            .map(|i| match pick {
                Pick::Draw { seed } => Pick::Draw { seed: seed + i },
                ref p => p.clone(),
            })
            .collect();
        let phrase = rewinding_phrase(f, tok, &picks[3], &prompts[3]);
        let cfgs: Vec<SamplerConfig> = picks
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let phrases = if i == 3 {
                    vec![phrase.clone()]
                } else {
                    Vec::new()
                };
                config(p, &phrases)
            })
            .collect();
        let alone: Vec<Run> = cfgs
            .iter()
            .zip(prompts)
            .map(|(c, p)| solo(f, tok, c, p))
            .collect();
        let (both, mixed) = together(f, tok, &cfgs, prompts);
        assert!(
            mixed > 0,
            "{pick:?}: no step mixed a prefill chunk with decode rows"
        );
        assert!(alone[3].rewinds > 0, "{pick:?}: sequence 3 never rewound");
        for (i, (a, b)) in alone.iter().zip(&both).enumerate() {
            assert!(
                !a.tokens.is_empty(),
                "{pick:?} sequence {i}: nothing generated"
            );
            assert_eq!(a.tokens, b.tokens, "{pick:?} sequence {i}: tokens");
            assert_eq!(a.rewinds, b.rewinds, "{pick:?} sequence {i}: rewinds");
            assert!(
                same_bits(&a.seen, &b.seen),
                "{pick:?} sequence {i}: the logits differ from the solo run's"
            );
        }
        // The sequences really differ (a batch of copies would prove less).
        for i in 1..both.len() {
            assert_ne!(
                both[0].tokens, both[i].tokens,
                "{pick:?}: sequences 0 and {i}"
            );
        }
    }
}

#[test]
fn eight_sequences_in_a_batch_get_their_solo_bits_qwen4exp_tiny() {
    let path = tiny_dir().join("model-f32.gguf");
    let m = qwen4exp::Model::load(&path, CpuBackend::new(2).unwrap(), &Default::default()).unwrap();
    let tok = Tokenizer::from_gguf(&GgufFile::open(&path).unwrap()).unwrap();
    let ids = Golden::open(tiny_dir().join("golden.safetensors")).ids("input_ids");
    // Different starts and lengths (3 to 17 tokens), so the sequences sit at different
    // positions and complete QSA blocks at different steps.
    let prompts: Vec<Vec<u32>> = (0..8)
        .map(|i| ids[i * 7..i * 7 + 3 + 2 * i].to_vec())
        .collect();
    batch_equals_solo(&Q4(m), &tok, &prompts);
}

#[test]
fn eight_sequences_in_a_batch_get_their_solo_bits_qwen2_default() {
    let Some(path) = default_model() else { return };
    let m = qwen2::Model::load(&path, CpuBackend::new(2).unwrap(), &Default::default()).unwrap();
    let tok = Tokenizer::from_gguf(&GgufFile::open(&path).unwrap()).unwrap();
    let texts = [
        "def fibonacci(n):",
        "The capital of France is",
        "// A linked list in C\nstruct node {",
        "SELECT name, count(*) FROM users",
        "Once upon a time, in a small village by the sea,",
        "import numpy as np\nx = np.",
        "fn main() {\n    let v: Vec<u32> =",
        "Q: What is 17 times 23?\nA:",
    ];
    let prompts: Vec<Vec<u32>> = texts
        .iter()
        .map(|t| tok.encode(t, false, false).unwrap())
        .collect();
    batch_equals_solo(&Q2(m), &tok, &prompts);
}
