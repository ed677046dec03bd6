//! The batching harness (issue 15), shared by `crates/engine/tests/batch.rs` (the CPU) and
//! `crates/cuda/tests/model_gpu.rs` (CUDA, by `#[path]`): sequences stepped together through
//! one forward pass per step, each against its own run alone, generic over the backend. What
//! it checks is `batch.rs`'s module doc; the tests that call it say what they load.
#![allow(dead_code)]

use strata_engine::backend::DevicePick;
use strata_engine::decode::{self, DraftEdit, Judged, Lent, Policy, Progress, Stepper, Verified};
use strata_engine::generate::{GenOptions, Timings};
use strata_engine::sampler::guard::GuardStop;
use strata_engine::sampler::slop::{ListChoice, SlopConfig, SlopEntry};
use strata_engine::sampler::{Pick, Sampler, SamplerConfig, Stage};
use strata_engine::speculative::{DraftHook, SpecConfig, SpecDecoder};
use strata_engine::{qwen4exp, Qwen4expOps};
use strata_tokenizer::Tokenizer;

/// Tokens each sequence generates at most.
pub const NEW: usize = 24;
/// Prompt tokens per prefill chunk in the batch.
pub const CHUNK: usize = 4;

/// What the test needs of a model family.
pub trait Fam {
    type St;
    fn fresh(&self) -> Self::St;
    fn tokens<'a>(&self, st: &'a Self::St) -> &'a [u32];
    fn n_ctx(&self) -> usize;
    fn run(&self, st: &mut Self::St, tokens: &[u32], last_only: bool) -> Vec<f32>;
    fn batch(&self, items: Vec<(&mut Self::St, &[u32], bool)>) -> Vec<Vec<f32>>;
}

pub struct Q4<B: Qwen4expOps>(pub qwen4exp::Model<B>);

impl<B: Qwen4expOps> Fam for Q4<B> {
    type St = qwen4exp::State<B>;
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

/// A sequence as the decoding loop's stepper: windows of one token; a rewind rebuilds the
/// state from the kept tokens (a whole-prompt pass: the bits of decoding them one by one).
/// Records every logits row it hands the loop.
pub struct Seq<'a, F: Fam> {
    pub f: &'a F,
    pub st: F::St,
    pub seen: Vec<Vec<f32>>,
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

pub struct Run {
    tokens: Vec<u32>,
    rewinds: u32,
    seen: Vec<Vec<f32>>,
}

pub fn sampler(tok: &Tokenizer, cfg: &SamplerConfig) -> Sampler {
    Sampler::with_vocab(cfg.clone(), tok).unwrap()
}

/// One sequence alone: the oracle.
pub fn solo<F: Fam>(f: &F, tok: &Tokenizer, cfg: &SamplerConfig, prompt: &[u32]) -> Run {
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

#[derive(Clone, Copy)]
pub enum Phase {
    Waiting,
    Prefill(usize),
    Decode,
    Done,
}

/// All sequences together: sequence `i` joins at step `2i`, prefills `CHUNK` tokens per step
/// beside the decode rows of those already running; every step is one `forward_batch`.
/// Returns the runs and how many steps mixed a prefill chunk with decode rows.
pub fn together<F: Fam>(
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
pub fn config(pick: &Pick, phrases: &[String]) -> SamplerConfig {
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
pub fn rewinding_phrase<F: Fam>(f: &F, tok: &Tokenizer, pick: &Pick, prompt: &[u32]) -> String {
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

pub fn same_bits(a: &[Vec<f32>], b: &[Vec<f32>]) -> bool {
    a.len() == b.len()
        && a.iter().zip(b).all(|(x, y)| {
            x.len() == y.len() && x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits())
        })
}

/// Eight prompts together and alone, greedy and seeded, sequence 3 under slop mode 2.
pub fn batch_equals_solo<F: Fam>(f: &F, tok: &Tokenizer, prompts: &[Vec<u32>]) {
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

// ---- speculative sequences in the batch

/// What a verify pass (or the prefill) gave the judge: logits bits, or the device's picks.
#[derive(Debug, PartialEq, Eq)]
enum Seen {
    Logits(Vec<u32>),
    Ids(Vec<u32>),
}

fn seen_logits(l: &[f32]) -> Seen {
    Seen::Logits(l.iter().map(|x| x.to_bits()).collect())
}

fn seen(v: &Verified) -> Seen {
    match v {
        Verified::Logits(l) => seen_logits(l),
        Verified::Ids(ids) => Seen::Ids(ids.clone()),
    }
}

/// A speculative decoder as the loop's stepper, recording what each pass gave the judge.
pub struct Spec<'m, B: Qwen4expOps> {
    dec: SpecDecoder<'m, B>,
    seen: Vec<Seen>,
}

impl<B: Qwen4expOps> Stepper for Spec<'_, B> {
    fn n_ctx(&self) -> usize {
        Stepper::n_ctx(&self.dec)
    }
    fn tokens(&self) -> &[u32] {
        Stepper::tokens(&self.dec)
    }
    fn prefill(
        &mut self,
        prompt: &[u32],
        opts: &GenOptions,
        t: &mut Timings,
    ) -> strata_engine::Result<Vec<f32>> {
        let l = Stepper::prefill(&mut self.dec, prompt, opts, t)?;
        self.seen.push(seen_logits(&l));
        Ok(l)
    }
    fn propose(
        &mut self,
        pending: u32,
        max: usize,
        edit: &mut dyn DraftEdit,
    ) -> strata_engine::Result<Vec<u32>> {
        Stepper::propose(&mut self.dec, pending, max, edit)
    }
    fn verify(&mut self, window: &[u32]) -> strata_engine::Result<Vec<f32>> {
        let l = Stepper::verify(&mut self.dec, window)?;
        self.seen.push(seen_logits(&l));
        Ok(l)
    }
    fn verify_picked(
        &mut self,
        window: &[u32],
        pick: DevicePick,
    ) -> strata_engine::Result<Option<Vec<u32>>> {
        let ids = Stepper::verify_picked(&mut self.dec, window, pick)?;
        if let Some(ids) = &ids {
            self.seen.push(Seen::Ids(ids.clone()));
        }
        Ok(ids)
    }
    fn settle(&mut self, seq: &[u32], judged: Judged) -> strata_engine::Result<()> {
        Stepper::settle(&mut self.dec, seq, judged)
    }
    fn settle_at_end(&self) -> bool {
        Stepper::settle_at_end(&self.dec)
    }
    fn may_rewind(&mut self, yes: bool) {
        Stepper::may_rewind(&mut self.dec, yes)
    }
}

/// One sequence of the mixed batch: its prompt, sampler chain, verify window (1: plain
/// decoding) and the step it joins at.
struct Plan {
    prompt: Vec<u32>,
    cfg: SamplerConfig,
    window: usize,
    join: usize,
    /// Drafts forced along this sequence (prompt and output), wrong where `position % 4 == 0`:
    /// windows then keep prefixes of several rows.
    forced: Option<Vec<u32>>,
}

/// Drafts forced to the sequence's own tokens, or wrong, by position (a hook on both the
/// solo and the batched decoder, so both see the same drafts).
struct Forced {
    truth: Vec<u32>,
    n_vocab: u32,
}

impl DraftHook for Forced {
    fn draft(&mut self, position: usize, _proposed: u32) -> Option<u32> {
        let right = *self.truth.get(position)?;
        Some(match position % 4 {
            0 => (right + 1) % self.n_vocab,
            _ => right,
        })
    }
}

/// A finished sequence of the mixed runs: what it emitted, the rewinds, what each pass gave
/// the judge, its trunk state's buffers and (speculative) its MTP state's, and the verify
/// passes its decoder counted.
struct Ended {
    tokens: Vec<u32>,
    rewinds: u32,
    seen: Vec<Seen>,
    state: Vec<(String, Vec<f32>)>,
    mtp: Option<Vec<(String, Vec<f32>)>>,
    passes: u64,
    /// Drafts the judge accepted.
    accepted: u64,
    /// Trunk passes over the prompt (speculative; its chunks).
    prompt_passes: u64,
}

fn spec_decoder<'m, B: Qwen4expOps>(m: &'m Q4<B>, plan: &Plan) -> Spec<'m, B> {
    let cfg = SpecConfig {
        window: plan.window,
        ..SpecConfig::default()
    };
    let mut dec = SpecDecoder::new(&m.0, cfg).unwrap();
    if let Some(truth) = &plan.forced {
        dec = dec.with_draft_hook(Forced {
            truth: truth.clone(),
            n_vocab: m.0.config().n_vocab as u32,
        });
    }
    Spec {
        dec,
        seen: Vec::new(),
    }
}

/// The end of a speculative sequence: its states (the head brought level first).
fn spec_ended<B: Qwen4expOps>(
    m: &Q4<B>,
    mut s: Spec<'_, B>,
    tokens: Vec<u32>,
    rewinds: u32,
) -> Ended {
    s.dec.sync_mtp().unwrap();
    let mtp = s.dec.mtp_state().map(|h| m.0.mtp_state_buffers(h).unwrap());
    Ended {
        tokens,
        rewinds,
        state: m.0.state_buffers(s.dec.state()).unwrap(),
        mtp,
        passes: s.dec.stats().passes,
        accepted: s.dec.stats().accepted.iter().sum(),
        prompt_passes: s.dec.stats().prompt_passes,
        seen: s.seen,
    }
}

/// A speculative sequence alone: the oracle.
fn spec_solo<B: Qwen4expOps>(m: &Q4<B>, tok: &Tokenizer, plan: &Plan) -> Ended {
    let mut s = sampler(tok, &plan.cfg);
    let slop = s.new_slop_state(plan.prompt.len());
    let mut spec = spec_decoder(m, plan);
    let is_eog = |t: u32| tok.is_eog(t);
    let mut streamed = Vec::new();
    let d = decode::run(
        &mut spec,
        &plan.prompt,
        Policy {
            pick: &mut s,
            slop,
            is_eog: &is_eog,
            window: plan.window,
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
    spec_ended(m, spec, d.tokens, d.rewinds)
}

/// A plain sequence alone: the oracle, with its state after the run.
fn plain_solo<B: Qwen4expOps>(m: &Q4<B>, tok: &Tokenizer, plan: &Plan) -> Ended {
    let mut s = sampler(tok, &plan.cfg);
    let slop = s.new_slop_state(plan.prompt.len());
    let mut seq = Seq {
        f: m,
        st: m.fresh(),
        seen: Vec::new(),
    };
    let is_eog = |t: u32| tok.is_eog(t);
    let d = decode::run(
        &mut seq,
        &plan.prompt,
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
        &mut |_| true,
    )
    .unwrap();
    Ended {
        tokens: d.tokens,
        rewinds: d.rewinds,
        seen: seq.seen.iter().map(|l| seen_logits(l)).collect(),
        state: m.0.state_buffers(&seq.st).unwrap(),
        mtp: None,
        passes: 0,
        accepted: 0,
        prompt_passes: 0,
    }
}

/// A sequence of the mixed batch.
enum Member<'m, B: Qwen4expOps> {
    Plain(Seq<'m, Q4<B>>),
    Spec(Box<Spec<'m, B>>),
}

impl<'m, B: Qwen4expOps> Member<'m, B> {
    fn stepper(&mut self) -> &mut dyn Stepper {
        match self {
            Member::Plain(s) => s,
            Member::Spec(s) => &mut **s,
        }
    }
}

/// What the mixed runs counted: steps whose one forward pass held a speculative window of
/// several rows beside another sequence's rows, and those that held a window beside a
/// prefill chunk; per sequence, its speculative prompt chunks run in the batch, and those
/// whose pass held another sequence's decode row or verify window.
#[derive(Debug, Default)]
struct Shared {
    windows: usize,
    with_prefill: usize,
    prompt_chunks: Vec<u64>,
    prompt_beside_decode: Vec<u64>,
}

/// All sequences together: each joins at its step and prefills `CHUNK` tokens per step in
/// the batch (a speculative one through its decoder's `prompt_item`, the head following each
/// chunk's rows after the pass); then every decode row and verify window of a step runs in
/// ONE `forward_batch_dev` too.
fn together_spec<B: Qwen4expOps>(
    m: &Q4<B>,
    tok: &Tokenizer,
    plans: &[Plan],
) -> (Vec<Ended>, Shared) {
    let n = plans.len();
    let mut samplers: Vec<Sampler> = plans.iter().map(|p| sampler(tok, &p.cfg)).collect();
    let mut members: Vec<Member<'_, B>> = plans
        .iter()
        .map(|p| match p.window {
            1 => Member::Plain(Seq {
                f: m,
                st: m.fresh(),
                seen: Vec::new(),
            }),
            _ => Member::Spec(Box::new(spec_decoder(m, p))),
        })
        .collect();
    let mut progs: Vec<Option<Progress>> = (0..n)
        .map(|i| {
            let slop = samplers[i].new_slop_state(plans[i].prompt.len());
            let (w, len) = (plans[i].window, plans[i].prompt.len());
            Some(Progress::new(members[i].stepper(), slop, w, NEW, len))
        })
        .collect();
    let mut rewinds = vec![0u32; n];
    let mut phase: Vec<Phase> = (0..n).map(|_| Phase::Waiting).collect();
    let mut out: Vec<Vec<u32>> = vec![Vec::new(); n];
    let mut windows_run = vec![0u64; n];
    let is_eog = |t: u32| tok.is_eog(t);
    let mut shared = Shared {
        prompt_chunks: vec![0; n],
        prompt_beside_decode: vec![0; n],
        ..Shared::default()
    };
    let b = m.0.backend();
    for step in 0.. {
        if phase.iter().all(|p| matches!(p, Phase::Done)) {
            break;
        }
        assert!(step < 10_000, "the batch never finished");
        for i in 0..n {
            if matches!(phase[i], Phase::Waiting) && step >= plans[i].join {
                phase[i] = Phase::Prefill(0);
            }
        }
        // Each running sequence's rows: (sequence, tokens, a prefill chunk).
        let mut rows: Vec<(usize, Vec<u32>, bool)> = Vec::new();
        for i in 0..n {
            match phase[i] {
                Phase::Prefill(next) => {
                    let end = (next + CHUNK).min(plans[i].prompt.len());
                    rows.push((i, plans[i].prompt[next..end].to_vec(), true));
                }
                Phase::Decode => {
                    let mut sink = |_t: u32| true;
                    let w = progs[i]
                        .as_mut()
                        .unwrap()
                        .begin_window(Lent {
                            stepper: members[i].stepper(),
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
        if rows.is_empty() {
            continue;
        }
        let is_spec = |i: usize| plans[i].window > 1;
        let window = |r: &(usize, Vec<u32>, bool)| is_spec(r.0) && !r.2 && r.1.len() > 1;
        if rows.len() > 1 && rows.iter().any(window) {
            shared.windows += 1;
            if rows.iter().any(|r| r.2) {
                shared.with_prefill += 1;
            }
        }
        for (i, _, prefill) in &rows {
            if *prefill && is_spec(*i) {
                shared.prompt_chunks[*i] += 1;
                if rows.iter().any(|(j, _, p)| j != i && !p) {
                    shared.prompt_beside_decode[*i] += 1;
                }
            }
        }
        // One forward pass over every row, the windows with their replay logs.
        let outs = {
            let mut who: Vec<Option<&mut Member<'_, B>>> = members.iter_mut().map(Some).collect();
            let mut items = Vec::with_capacity(rows.len());
            for (i, t, prefill) in &rows {
                items.push(match (who[*i].take().unwrap(), phase[*i]) {
                    (Member::Plain(s), _) => qwen4exp::BatchItem::rows(&mut s.st, t, *prefill),
                    (Member::Spec(s), Phase::Prefill(next)) => {
                        let prompt = &plans[*i].prompt;
                        s.dec.prompt_item(prompt, next + t.len()).unwrap()
                    }
                    (Member::Spec(s), _) => s.dec.window_item(t).unwrap(),
                });
            }
            m.0.forward_batch_dev(&mut items).unwrap()
        };
        assert_eq!(outs.len(), rows.len());
        // Hand each sequence its results.
        for ((i, t, _), o) in rows.iter().zip(outs) {
            let i = *i;
            let p = progs[i].as_mut().unwrap();
            let got = match (&mut members[i], phase[i]) {
                // A chunk before the prompt's end: no logits read; a speculative sequence's
                // head follows the chunk's rows.
                (Member::Plain(_), Phase::Prefill(next))
                    if next + t.len() < plans[i].prompt.len() =>
                {
                    phase[i] = Phase::Prefill(next + t.len());
                    continue;
                }
                (Member::Plain(s), _) => {
                    let l = b.download(&o.logits).unwrap();
                    s.seen.push(l.clone());
                    Verified::Logits(l)
                }
                (Member::Spec(s), Phase::Prefill(next)) => match s.dec.prompt_ran(o).unwrap() {
                    None => {
                        phase[i] = Phase::Prefill(next + t.len());
                        continue;
                    }
                    Some(l) => {
                        s.seen.push(seen_logits(&l));
                        Verified::Logits(l)
                    }
                },
                (Member::Spec(s), _) => {
                    let v = s.dec.window_ran(o, p.device_pick(&samplers[i])).unwrap();
                    s.seen.push(seen(&v));
                    windows_run[i] += 1;
                    v
                }
            };
            let mut sink = |t: u32| {
                out[i].push(t);
                true
            };
            let lent = Lent {
                stepper: members[i].stepper(),
                pick: &mut samplers[i],
                is_eog: &is_eog,
                on_token: &mut sink,
            };
            let end: Option<GuardStop> = match (&phase[i], got) {
                (Phase::Prefill(_), Verified::Logits(l)) => {
                    phase[i] = Phase::Decode;
                    p.prefilled(lent, &plans[i].prompt, &l, &Timings::default())
                        .unwrap()
                }
                (Phase::Decode, rows) => p.end_window(lent, rows).unwrap().1,
                _ => unreachable!(),
            };
            if let Some(stop) = end {
                let p = progs[i].take().unwrap();
                rewinds[i] = p.rewinds();
                assert_eq!(p.finish(&mut sink, stop).tokens, out[i]);
                phase[i] = Phase::Done;
            }
        }
    }
    let ended = members
        .into_iter()
        .zip(rewinds)
        .zip(out)
        .zip(windows_run)
        .zip(shared.prompt_chunks.clone())
        .map(|((((mb, rewinds), tokens), windows), chunks)| match mb {
            Member::Plain(s) => Ended {
                tokens,
                rewinds,
                seen: s.seen.iter().map(|l| seen_logits(l)).collect(),
                state: m.0.state_buffers(&s.st).unwrap(),
                mtp: None,
                passes: 0,
                accepted: 0,
                prompt_passes: 0,
            },
            Member::Spec(s) => {
                let e = spec_ended(m, *s, tokens, rewinds);
                // Every verify pass of the decoder was a window of the batch, and every pass
                // over its prompt a chunk of the batch.
                assert_eq!(e.passes, windows, "verify passes outside the batch");
                assert_eq!(e.prompt_passes, chunks, "prompt passes outside the batch");
                e
            }
        })
        .collect();
    (ended, shared)
}

fn assert_buffers_eq(what: &str, a: &[(String, Vec<f32>)], b: &[(String, Vec<f32>)]) {
    assert_eq!(a.len(), b.len(), "{what}: buffer count");
    for ((na, va), (nb, vb)) in a.iter().zip(b) {
        assert_eq!(na, nb, "{what}");
        assert_eq!(va.len(), vb.len(), "{what}: {na} length");
        if let Some(i) = va
            .iter()
            .zip(vb)
            .position(|(x, y)| x.to_bits() != y.to_bits())
        {
            panic!("{what}: {na}[{i}] differs: {} vs {}", va[i], vb[i]);
        }
    }
}

/// Speculative (MTP) and plain sequences in one batch against each alone (the module's
/// doc): `m` is the tiny fixture with its real MTP head on a backend that runs a batch as one
/// step, `ids` the golden prompt ids the sequences' prompts are cut from.
pub fn speculative_and_plain_in_a_batch_equal_solo<B: Qwen4expOps>(
    m: &Q4<B>,
    tok: &Tokenizer,
    ids: &[u32],
) {
    assert!(m.0.backend().batches_sequences());
    // (start, length, window, join step); sequence 2 (speculative) runs under slop mode 2.
    let shape = [
        (0, 11, 4, 0),
        (7, 5, 1, 0),
        (12, 13, 3, 2),
        (3, 17, 1, 3),
        (21, 6, 8, 5),
        (10, 9, 1, 8),
    ];
    for pick in [Pick::Greedy, Pick::Draw { seed: 77 }] {
        let picks: Vec<Pick> = (0..shape.len() as u64)
            .map(|i| match pick {
                Pick::Draw { seed } => Pick::Draw { seed: seed + i },
                ref p => p.clone(),
            })
            .collect();
        let prompts: Vec<Vec<u32>> = shape
            .iter()
            .map(|&(s, len, _, _)| ids[s..s + len].to_vec())
            .collect();
        let phrase = rewinding_phrase(m, tok, &picks[2], &prompts[2]);
        let plans: Vec<Plan> = shape
            .iter()
            .zip(prompts)
            .enumerate()
            .map(|(i, (&(_, _, window, join), prompt))| {
                let phrases = if i == 2 {
                    vec![phrase.clone()]
                } else {
                    Vec::new()
                };
                Plan {
                    prompt,
                    cfg: config(&picks[i], &phrases),
                    window,
                    join,
                    forced: None,
                }
            })
            .collect();
        // Sequence 4's drafts forced along its plain output: windows keep several rows.
        let mut plans = plans;
        let truth = [
            plans[4].prompt.clone(),
            plain_solo(m, tok, &plans[4]).tokens,
        ]
        .concat();
        plans[4].forced = Some(truth);
        let alone: Vec<Ended> = plans
            .iter()
            .map(|p| match p.window {
                1 => plain_solo(m, tok, p),
                _ => spec_solo(m, tok, p),
            })
            .collect();
        let (both, shared) = together_spec(m, tok, &plans);
        assert!(
            shared.windows > 0,
            "{pick:?}: no verify window of several rows shared a forward pass ({shared:?})"
        );
        assert!(
            shared.with_prefill > 0,
            "{pick:?}: no verify window shared a pass with a prefill chunk ({shared:?})"
        );
        // Every speculative prompt ran in chunks of the batch, and one in several chunks
        // each beside other sequences' decode rows (alone it is one pass).
        for (i, p) in plans.iter().enumerate().filter(|(_, p)| p.window > 1) {
            let chunks = p.prompt.len().div_ceil(CHUNK) as u64;
            assert_eq!(alone[i].prompt_passes, 1, "{pick:?}: sequence {i} alone");
            assert_eq!(
                shared.prompt_chunks[i], chunks,
                "{pick:?}: sequence {i}'s prompt chunks in the batch ({shared:?})"
            );
        }
        assert!(
            shared.prompt_beside_decode[2] >= 3,
            "{pick:?}: sequence 2's prompt chunks did not share passes with decode rows \
             ({shared:?})"
        );
        assert!(alone[2].rewinds > 0, "{pick:?}: sequence 2 never rewound");
        assert!(
            both[4].accepted > both[4].passes,
            "{pick:?}: sequence 4's windows kept too few drafts ({} in {} passes)",
            both[4].accepted,
            both[4].passes
        );
        for (i, (a, b)) in alone.iter().zip(&both).enumerate() {
            let what = format!("{pick:?} sequence {i} (window {})", plans[i].window);
            assert!(!a.tokens.is_empty(), "{what}: nothing generated");
            assert_eq!(a.tokens, b.tokens, "{what}: tokens");
            assert_eq!(a.rewinds, b.rewinds, "{what}: rewinds");
            assert_eq!(a.passes, b.passes, "{what}: verify passes");
            assert_eq!(a.accepted, b.accepted, "{what}: accepted drafts");
            assert!(a.seen == b.seen, "{what}: what the passes gave the judge");
            assert_buffers_eq(&format!("{what}: trunk state"), &a.state, &b.state);
            match (&a.mtp, &b.mtp) {
                (Some(x), Some(y)) => assert_buffers_eq(&format!("{what}: MTP state"), x, y),
                (None, None) => {}
                _ => panic!("{what}: an MTP state on one side only"),
            }
            if plans[i].window > 1 {
                // Speculation is exact: the same tokens as plain decoding.
                assert_eq!(
                    plain_solo(m, tok, &plans[i]).tokens,
                    a.tokens,
                    "{what}: speculative and plain decoding differ"
                );
                assert!(a.passes > 0, "{what}: no verify pass");
            }
        }
    }
}
