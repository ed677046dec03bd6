//! Speculative decoding is exact: for every verify window N = 1..8 and every acceptance pattern
//! (the MTP's own drafts; drafts forced right, wrong, mixed; chains cut short; a stop in the
//! middle of a window) the emitted tokens equal plain decoding's, and the sequence state after
//! the run equals, buffer by buffer and bit for bit, the state of plain decoding of the same
//! tokens; the MTP state equals the head run once over the whole sequence. The oracle is a plain
//! loop of one-token forward calls.

mod common;

use common::{tiny_dir, Golden};
use strata_engine::qwen4exp::{LoadOptions, Model, State, Want};
use strata_engine::sampler::{SampleContext, Sampler, SamplerConfig};
use strata_engine::speculative::{
    generate_spec, run, DraftHook, DraftVocab, Picker, SpecConfig, SpecDecoder, SpecStats,
};
use strata_engine::CpuBackend;

type M = Model<CpuBackend>;

fn model() -> M {
    let m = Model::load(
        tiny_dir().join("model-f32.gguf"),
        CpuBackend::new(2).unwrap(),
        &LoadOptions::default(),
    )
    .unwrap();
    common::with_mtp_head(m, &tiny_dir().join("hf"), false)
}

/// The golden prompt up to and across its EOS (position 24), so the PLE reset is exercised.
fn prompt() -> Vec<u32> {
    Golden::open(tiny_dir().join("golden.safetensors")).ids("input_ids")[..30].to_vec()
}

const NEW: usize = 40;

/// The oracle: prefill, then one forward call per token, picking with `picker`.
fn plain(
    m: &M,
    prompt: &[u32],
    n: usize,
    picker: &mut dyn Picker,
) -> (Vec<u32>, State<CpuBackend>) {
    let mut st = m.new_state().unwrap();
    let want = Want {
        last_only: true,
        ..Want::default()
    };
    let mut logits = m.forward_with(&mut st, prompt, want).unwrap().logits;
    let mut out = Vec::new();
    loop {
        let pos = st.position();
        let t = picker.pick(&logits, pos, st.tokens()).unwrap();
        out.push(t);
        if out.len() == n {
            break;
        }
        logits = m.forward_with(&mut st, &[t], want).unwrap().logits;
    }
    (out, st)
}

fn greedy_plain(m: &M, n: usize) -> (Vec<u32>, State<CpuBackend>) {
    plain(m, &prompt(), n, &mut strata_engine::speculative::Greedy)
}

fn assert_bits_eq(what: &str, a: &[(String, Vec<f32>)], b: &[(String, Vec<f32>)]) {
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

/// The MTP state a sequence should have: the head run once over the consumed tokens' trunk
/// states, paired with the next tokens (the last one being the pending token).
fn mtp_reference(m: &M, consumed: &[u32], pending: u32) -> Vec<(String, Vec<f32>)> {
    let mut st = m.new_state().unwrap();
    let out = m
        .forward_with(
            &mut st,
            consumed,
            Want {
                hidden: true,
                last_only: true,
                ..Want::default()
            },
        )
        .unwrap();
    let mut next = consumed[1..].to_vec();
    next.push(pending);
    let mut ms = m.new_mtp_state().unwrap();
    m.mtp_forward(&mut ms, &out.hidden.unwrap(), &next, true, None)
        .unwrap();
    m.mtp_state_buffers(&ms).unwrap()
}

/// Checks a finished decoder against plain decoding of the same tokens.
fn check_states(
    m: &M,
    dec: &mut SpecDecoder<'_, CpuBackend>,
    plain_state: &State<CpuBackend>,
    what: &str,
) {
    assert_bits_eq(
        &format!("{what}: trunk state"),
        &m.state_buffers(dec.state()).unwrap(),
        &m.state_buffers(plain_state).unwrap(),
    );
    dec.sync_mtp().unwrap();
    if let Some(ms) = dec.mtp_state() {
        assert_eq!(
            ms.position(),
            dec.state().position(),
            "{what}: MTP position"
        );
        let want = mtp_reference(m, dec.state().tokens(), dec.pending().unwrap());
        assert_bits_eq(
            &format!("{what}: MTP state"),
            &m.mtp_state_buffers(ms).unwrap(),
            &want,
        );
    }
}

/// Drafts forced to the plain sequence's token (accepted) or to a wrong one, by position.
struct Forced {
    /// Prompt and plain output: the token at every absolute position.
    truth: Vec<u32>,
    n_vocab: u32,
    accept: fn(usize) -> Option<bool>,
}

impl DraftHook for Forced {
    fn draft(&mut self, position: usize, _proposed: u32) -> Option<u32> {
        let right = *self.truth.get(position)?;
        match (self.accept)(position)? {
            true => Some(right),
            false => Some((right + 1) % self.n_vocab),
        }
    }
}

fn spec_run(
    m: &M,
    cfg: SpecConfig,
    hook: Option<Forced>,
    n: usize,
) -> (Vec<u32>, SpecDecoder<'_, CpuBackend>) {
    let mut dec = SpecDecoder::new(m, cfg).unwrap();
    if let Some(h) = hook {
        dec = dec.with_draft_hook(h);
    }
    let out = run(&mut dec, &prompt(), n, &mut |_| true).unwrap();
    (out, dec)
}

fn cfg(window: usize) -> SpecConfig {
    SpecConfig {
        window,
        ..SpecConfig::default()
    }
}

#[test]
fn greedy_spec_equals_plain_for_every_window() {
    let m = model();
    let (want, plain_state) = greedy_plain(&m, NEW);
    for window in 1..=8 {
        let (got, mut dec) = spec_run(&m, cfg(window), None, NEW);
        assert_eq!(got, want, "window {window}");
        check_states(&m, &mut dec, &plain_state, &format!("window {window}"));
        let s = dec.stats();
        eprintln!(
            "window {window}: {} passes, {:.2} tokens/pass, acceptance {:?}",
            s.passes,
            s.tokens_per_pass(),
            s.acceptance_all()
        );
        assert_eq!(s.emitted as usize, NEW);
    }
}

/// The prompt in chunks of 7 rows (plain decoding's `prefill_chunk`, which a GPU's fast
/// prefill needs both loops to share): the same tokens and states as plain decoding, whose
/// oracle runs the prompt in one call.
#[test]
fn a_prompt_in_chunks_keeps_spec_equal_to_plain() {
    let m = model();
    let (want, plain_state) = greedy_plain(&m, NEW);
    for window in [2, 5] {
        let mut dec = SpecDecoder::new(&m, cfg(window)).unwrap();
        let opts = strata_engine::generate::GenOptions {
            max_tokens: NEW,
            prefill_chunk: 7,
        };
        let got = strata_engine::speculative::run_with(&mut dec, &prompt(), &opts, &mut |_| true)
            .unwrap();
        assert_eq!(got, want, "window {window}");
        assert_eq!(
            dec.stats().prompt_passes as usize,
            prompt().len().div_ceil(7),
            "window {window}: the prompt's passes"
        );
        check_states(
            &m,
            &mut dec,
            &plain_state,
            &format!("chunks, window {window}"),
        );
    }
}

#[test]
fn forced_acceptance_patterns_equal_plain() {
    let m = model();
    let (want, plain_state) = greedy_plain(&m, NEW);
    let mut truth = prompt();
    truth.extend_from_slice(&want);
    type Pattern = (&'static str, fn(usize) -> Option<bool>);
    let patterns: [Pattern; 5] = [
        ("all accepted", |_| Some(true)),
        ("all rejected", |_| Some(false)),
        ("mixed", |p| Some((p * 7 + 3) % 5 != 0)),
        ("alternating", |p| Some(p % 2 == 0)),
        ("chains cut", |p| {
            if p % 4 == 1 {
                None
            } else {
                Some(p % 3 != 2)
            }
        }),
    ];
    for (name, accept) in patterns {
        for window in 2..=8 {
            let hook = Forced {
                truth: truth.clone(),
                n_vocab: m.config().n_vocab as u32,
                accept,
            };
            let (got, mut dec) = spec_run(&m, cfg(window), Some(hook), NEW);
            let what = format!("{name}, window {window}");
            assert_eq!(got, want, "{what}");
            check_states(&m, &mut dec, &plain_state, &what);
            let s = dec.stats().clone();
            let offered: u64 = s.offered.iter().sum();
            let accepted: u64 = s.accepted.iter().sum();
            assert!(offered > 0, "{what}: no drafts offered");
            match name {
                "all accepted" => {
                    assert_eq!(accepted, offered, "{what}");
                    // Every pass but possibly the last emits a full window.
                    assert!(
                        s.passes as usize <= (NEW - 1).div_ceil(window),
                        "{what}: {} passes",
                        s.passes
                    );
                }
                "all rejected" => {
                    assert_eq!(accepted, 0, "{what}");
                    assert_eq!(s.passes as usize, NEW - 1, "{what}");
                }
                _ => assert!(
                    accepted > 0 && accepted < offered,
                    "{what}: {accepted}/{offered}"
                ),
            }
        }
    }
}

#[test]
fn stop_in_the_middle_of_a_window_leaves_the_plain_state() {
    let m = model();
    let (want, _) = greedy_plain(&m, NEW);
    let mut truth = prompt();
    truth.extend_from_slice(&want);
    for stop_after in [1usize, 2, 5, 9, 14] {
        let hook = Forced {
            truth: truth.clone(),
            n_vocab: m.config().n_vocab as u32,
            accept: |_| Some(true),
        };
        let mut dec = SpecDecoder::new(&m, cfg(8)).unwrap().with_draft_hook(hook);
        let mut seen = 0;
        let got = run(&mut dec, &prompt(), NEW, &mut |_| {
            seen += 1;
            seen < stop_after
        })
        .unwrap();
        assert_eq!(got, want[..stop_after], "stop after {stop_after}");
        let (_, plain_state) = greedy_plain(&m, stop_after);
        check_states(
            &m,
            &mut dec,
            &plain_state,
            &format!("stop after {stop_after}"),
        );
    }
}

#[test]
fn temperature_sampling_equals_plain_sampling() {
    let m = model();
    let sc = SamplerConfig::standard(0.9, 40, 0.95, 0.0, 1234);
    let (want, plain_state) = plain(&m, &prompt(), NEW, &mut Sampler::new(sc.clone()).unwrap());
    let (greedy, _) = greedy_plain(&m, NEW);
    assert_ne!(want, greedy, "the sampled run should not be the greedy one");
    let mut truth = prompt();
    truth.extend_from_slice(&want);
    for window in [1, 3, 8] {
        for forced in [false, true] {
            let mut dec = SpecDecoder::new(&m, cfg(window))
                .unwrap()
                .with_picker(Sampler::new(sc.clone()).unwrap());
            if forced {
                dec = dec.with_draft_hook(Forced {
                    truth: truth.clone(),
                    n_vocab: m.config().n_vocab as u32,
                    accept: |p| Some(p % 3 != 0),
                });
            }
            let got = run(&mut dec, &prompt(), NEW, &mut |_| true).unwrap();
            let what = format!("sampled, window {window}, forced {forced}");
            assert_eq!(got, want, "{what}");
            check_states(&m, &mut dec, &plain_state, &what);
        }
    }
    // The sampler is keyed by position, not by call order: drawing the same position twice
    // gives the same token.
    let mut s = Sampler::new(sc).unwrap();
    let logits: Vec<f32> = (0..320).map(|i| ((i * 37) % 101) as f32 / 50.0).collect();
    let ctx = SampleContext {
        position: 77,
        history: &[],
    };
    assert_eq!(
        s.sample(&logits, &ctx).unwrap(),
        s.sample(&logits, &ctx).unwrap()
    );
}

#[test]
fn draft_vocabulary_and_floor_keep_the_output_exact() {
    let m = model();
    let (want, plain_state) = greedy_plain(&m, NEW);
    let ids: Vec<u32> = (0..320).filter(|i| i % 3 != 1).collect();
    let vocab = DraftVocab::new(ids, 320, "test").unwrap();
    for (min_p, vocab) in [(0.0, Some(vocab.clone())), (0.05, Some(vocab)), (0.2, None)] {
        let c = SpecConfig {
            window: 5,
            min_p,
            draft_vocab: vocab.clone(),
        };
        let (got, mut dec) = spec_run(&m, c, None, NEW);
        let what = format!("min_p {min_p}, draft vocab {}", vocab.is_some());
        assert_eq!(got, want, "{what}");
        check_states(&m, &mut dec, &plain_state, &what);
    }
    // A floor of 1 admits no draft (no softmax over 320 logits puts all mass on one token).
    let c = SpecConfig {
        window: 5,
        min_p: 1.0,
        draft_vocab: None,
    };
    let (got, dec) = spec_run(&m, c, None, NEW);
    assert_eq!(got, want);
    let s: &SpecStats = dec.stats();
    assert_eq!(s.offered.iter().sum::<u64>(), 0);
    assert_eq!(s.passes as usize, NEW - 1);
}

#[test]
fn generate_spec_reports_and_refuses_bad_settings() {
    let m = model();
    let (want, _) = greedy_plain(&m, 12);
    let mut streamed = Vec::new();
    let (got, stats) = generate_spec(&m, &prompt(), 12, cfg(4), |t| {
        streamed.push(t);
        true
    })
    .unwrap();
    assert_eq!(got, want);
    assert_eq!(streamed, want);
    assert_eq!(stats.emitted, 12);
    assert!(stats.report().contains("tokens/pass"));
    for bad in [0, 9] {
        let err = SpecDecoder::new(&m, cfg(bad)).err().unwrap();
        assert!(err.to_string().contains("1..=8"), "{err}");
    }
    let err = SpecDecoder::new(
        &m,
        SpecConfig {
            min_p: 1.5,
            ..cfg(4)
        },
    )
    .err()
    .unwrap();
    assert!(err.to_string().contains("min-p"), "{err}");
    let bare = Model::load(
        tiny_dir().join("model-f32.gguf"),
        CpuBackend::new(1).unwrap(),
        &LoadOptions::default(),
    )
    .unwrap();
    let err = SpecDecoder::new(&bare, cfg(2)).err().unwrap();
    assert!(err.to_string().contains("no MTP head"), "{err}");
    // Window 1 is plain decoding and needs no head.
    let (got, _) = generate_spec(&bare, &prompt(), 12, cfg(1), |_| true).unwrap();
    assert_eq!(got, want);
}

#[test]
fn feeding_a_second_turn_continues_exactly() {
    // A chat: prompt A, a generation, then turn B appended after the last emitted token.
    let m = model();
    let p = prompt();
    let (a, b) = p.split_at(17);
    let (n1, n2) = (9, 15);
    // Oracle: plain one-token steps; turn B is consumed right after the first generation's
    // last token.
    let mut st = m.new_state().unwrap();
    let want = Want {
        last_only: true,
        ..Want::default()
    };
    let mut logits = m.forward_with(&mut st, a, want).unwrap().logits;
    let mut plain_out = Vec::new();
    for i in 0..n1 + n2 {
        let t = strata_engine::speculative::argmax(&logits) as u32;
        plain_out.push(t);
        let next: Vec<u32> = if i + 1 == n1 {
            std::iter::once(t).chain(b.iter().copied()).collect()
        } else {
            vec![t]
        };
        if i + 1 < n1 + n2 {
            logits = m.forward_with(&mut st, &next, want).unwrap().logits;
        }
    }
    for window in [1, 4, 8] {
        let mut dec = SpecDecoder::new(&m, cfg(window)).unwrap();
        let mut out = run(&mut dec, a, n1, &mut |_| true).unwrap();
        out.push(dec.feed(b).unwrap());
        while out.len() < n1 + n2 {
            dec.step(n1 + n2 - out.len(), &mut |t| {
                out.push(t);
                true
            })
            .unwrap();
        }
        assert_eq!(out, plain_out, "window {window}");
        check_states(&m, &mut dec, &st, &format!("two turns, window {window}"));
    }
}

/// A decoder resumed on a sequence that already holds a prefix of the prompt (a server's slot
/// reusing a cached prefix: the trunk and the head run over the prefix together) emits what a
/// fresh decoder emits, and gives back the states plain decoding reaches.
#[test]
fn a_resumed_decoder_continues_as_a_fresh_one() {
    let m = model();
    let p = prompt();
    let (want, plain_state) = greedy_plain(&m, NEW);
    for window in [2, 4, 8] {
        for k in [1, 7, p.len() - 1] {
            let mut st = m.new_state().unwrap();
            let mut head = m.new_mtp_state().unwrap();
            m.forward_with_head(&mut st, &mut head, &p[..k], p[k])
                .unwrap();
            assert_eq!((st.position(), head.position()), (k, k));
            let cfg = SpecConfig {
                window,
                ..SpecConfig::default()
            };
            let mut dec = SpecDecoder::resume(&m, cfg, st, Some(head)).unwrap();
            let got = run(&mut dec, &p, NEW, &mut |_| true).unwrap();
            let what = format!("window {window}, resumed after {k} tokens");
            assert_eq!(got, want, "{what}");
            // Bit for bit the states of plain decoding (the head: of one pass over it all).
            check_states(&m, &mut dec, &plain_state, &what);
            let (st, head) = dec.into_states();
            let head = head.unwrap();
            assert_eq!(st.position(), p.len() + NEW - 1);
            assert_eq!(head.position(), st.position());
        }
    }
    // A head that is not level with the trunk is refused, as is a started sequence without one.
    let mut st = m.new_state().unwrap();
    m.forward_with(&mut st, &p[..3], Want::default()).unwrap();
    let head = m.new_mtp_state().unwrap();
    let cfg = SpecConfig::default();
    let e = SpecDecoder::resume(&m, cfg.clone(), st, Some(head))
        .err()
        .unwrap();
    assert!(e.to_string().contains("MTP state holds 0 positions"), "{e}");
    let mut st = m.new_state().unwrap();
    m.forward_with(&mut st, &p[..3], Want::default()).unwrap();
    let e = SpecDecoder::resume(&m, cfg, st, None).err().unwrap();
    assert!(e.to_string().contains("needs its MTP state"), "{e}");
}
