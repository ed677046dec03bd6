//! The slop stage at the token level and the phrase matcher, on hand-computed cases over a toy
//! vocabulary; the slop-list file format; the classes of the Qwen vocabulary; and the binding
//! to the draft-path kernel (`kernels::slop`, the report's `mtp_slop_pen`): the sampler's
//! penalties over the full vocabulary, seen through the inverse map, equal the kernel's over a
//! 40,525-id draft vocabulary, bit for bit.

mod sampler_support;

use std::sync::Arc;

use sampler_support::{draft_vocab, qwen_vocab, Rng, ToyVocab};
use strata_engine::kernels::slop::{slop_pen_baseline, slop_pen_optimized, STATE_LEN};
use strata_engine::sampler::slop::{
    parse_list, Accepted, CompiledSlop, ListChoice, SlopConfig, SlopEntry, SlopState, DEFAULT_LIST,
};
use strata_engine::sampler::view::{CandidateEdit, DenseEdit};
use strata_engine::sampler::vocab::SamplerVocab;
use strata_engine::sampler::Candidates;

fn cfg(mode: u8, entries: &[(&str, f32)]) -> SlopConfig {
    SlopConfig {
        mode,
        list: ListChoice::None,
        entries: entries
            .iter()
            .map(|&(p, v)| SlopEntry {
                phrase: p.into(),
                penalty: v,
            })
            .collect(),
        newline_run_cap: 2,
        blank_run_cap: 3,
        ..SlopConfig::default()
    }
}

fn compile(c: &SlopConfig, v: &dyn SamplerVocab) -> Arc<CompiledSlop> {
    Arc::new(CompiledSlop::compile(c, v).unwrap())
}

/// The logits after the state's penalties, from all zeros.
fn penalized(s: &SlopState, n: usize) -> Vec<f32> {
    let mut l = vec![0f32; n];
    s.penalize(&mut DenseEdit(&mut l));
    l
}

#[test]
fn classes_and_token_tables_by_hand() {
    let v = ToyVocab::new();
    let c = compile(&cfg(1, &[("delve", 2.0), ("the cat", 1.5)]), &v);
    let ids = |ps: &[&str]| {
        let mut x: Vec<u32> = ps.iter().map(|p| v.id(p)).collect();
        x.sort();
        x
    };
    let (nl, bl) = c.classes();
    assert_eq!(nl, ids(&["\n", "\n\n", " \n"]));
    assert_eq!(bl, ids(&[" ", "\n", "\n\n", "  ", " \n", "\t"]));
    // "delve" is one token in each spelling: four token penalties.
    let pen: Vec<(u32, f32)> = ids(&["delve", " delve", "Delve", " Delve"])
        .into_iter()
        .map(|i| (i, 2.0))
        .collect();
    assert_eq!(c.token_penalties(), &pen[..]);
    // "the cat" is two tokens in each spelling: four phrases.
    let ph: Vec<(Vec<u32>, f32)> = [
        ["the", " cat"],
        [" the", " cat"],
        ["The", " cat"],
        [" The", " cat"],
    ]
    .iter()
    .map(|p| (vec![v.id(p[0]), v.id(p[1])], 1.5))
    .collect();
    assert_eq!(c.token_phrases(), &ph[..]);
}

#[test]
fn mode_1_penalties_and_run_caps() {
    let v = ToyVocab::new();
    let n = v.pieces.len();
    let c = compile(&cfg(1, &[("delve", 2.0), ("the cat", 1.5)]), &v);
    let mut s = SlopState::new(c, 10);
    let l = penalized(&s, n);
    assert_eq!(l[v.id(" delve") as usize], -2.0);
    assert_eq!(l[v.id("Delve") as usize], -2.0);
    assert_eq!(l[v.id(" del") as usize], 0.0);
    // Mode 1 does not follow phrases: " cat" after " the" is untouched.
    s.push_token(v.id(" the"));
    assert_eq!(penalized(&s, n)[v.id(" cat") as usize], 0.0);
    // Newline cap 2: two newline tokens in a row remove the newline class, a third cannot come;
    // "\n\n" and " \n" are blank too, and the blank cap (3) is not reached yet.
    s.push_token(v.id("\n"));
    let l = penalized(&s, n);
    assert_eq!(l[v.id("\n") as usize], 0.0);
    s.push_token(v.id("\n\n"));
    let l = penalized(&s, n);
    for p in ["\n", "\n\n", " \n"] {
        assert_eq!(l[v.id(p) as usize], f32::NEG_INFINITY, "{p:?}");
    }
    assert_eq!(l[v.id(" ") as usize], 0.0);
    assert_eq!(s.token_state().newline_run, 2);
    assert_eq!(s.token_state().blank_run, 2);
    // A blank token that is not a newline ends the newline run; the blank run reaches 3.
    s.push_token(v.id("  "));
    let l = penalized(&s, n);
    assert_eq!(l[v.id("\n") as usize], f32::NEG_INFINITY); // blank class now
    assert_eq!(l[v.id(" ") as usize], f32::NEG_INFINITY);
    assert_eq!(l[v.id("a") as usize], 0.0);
    assert_eq!(
        (s.token_state().newline_run, s.token_state().blank_run),
        (0, 3)
    );
    s.push_token(v.id("a"));
    assert!(penalized(&s, n).iter().all(|&x| x > f32::NEG_INFINITY));
}

#[test]
fn mode_2_follows_phrases_token_by_token() {
    let v = ToyVocab::new();
    let n = v.pieces.len();
    let c = compile(&cfg(2, &[("a rich tapestry", 1.25), ("the cat", 1.5)]), &v);
    let mut s = SlopState::new(c, 0);
    s.push_token(v.id(" a"));
    let l = penalized(&s, n);
    // " a" opens "a rich tapestry" (spelled " a"," rich"," tapestry"): " rich" is lowered.
    assert_eq!(l[v.id(" rich") as usize], -1.25);
    assert_eq!(l[v.id(" cat") as usize], 0.0);
    s.push_token(v.id(" rich"));
    let l = penalized(&s, n);
    // " tapestry" would complete it: removed.
    assert_eq!(l[v.id(" tapestry") as usize], f32::NEG_INFINITY);
    assert_eq!(l[v.id(" rich") as usize], 0.0);
    s.push_token(v.id(" dog"));
    assert!(penalized(&s, n).iter().all(|&x| x == 0.0));
    s.push_token(v.id(" The"));
    assert_eq!(penalized(&s, n)[v.id(" cat") as usize], f32::NEG_INFINITY);
}

/// Feeds `text` token by token (as the toy encoder splits it) and returns the accept verdicts.
fn feed(s: &mut SlopState, v: &ToyVocab, text: &str) -> Vec<Accepted> {
    v.encode_str(text)
        .into_iter()
        .map(|t| s.accept(t))
        .collect()
}

#[test]
fn phrase_level_matches_text_however_tokenized() {
    let v = ToyVocab::new();
    let c = compile(&cfg(2, &[("delve", 1.0), ("in conclusion", 1.0)]), &v);
    // " delve" as one token: the rewind goes back to it and bans it there.
    let mut s = SlopState::new(c.clone(), 5);
    let r = feed(&mut s, &v, "She would delve");
    assert_eq!(
        r.last(),
        Some(&Accepted::Rewound {
            position: 7,
            banned: v.id(" delve")
        })
    );
    assert_eq!(s.position(), 7);
    assert_eq!(s.banned_here(), &[v.id(" delve")]);
    assert_eq!(s.rewinds(), 1);
    // The ban is in the logits at that position.
    let l = penalized(&s, v.pieces.len());
    assert_eq!(l[v.id(" delve") as usize], f32::NEG_INFINITY);
    // Another tokenization, in capitals (" ", "D", "e", "l", "ve"): the match completes on
    // "ve" and the rewind goes to "D", the token holding its first byte.
    let mut s = SlopState::new(c.clone(), 0);
    let toks = [v.id(" "), v.id("D"), v.id("e"), v.id("l"), v.id("ve")];
    let r: Vec<Accepted> = toks.iter().map(|&t| s.accept(t)).collect();
    assert_eq!(
        r[4],
        Accepted::Rewound {
            position: 1,
            banned: v.id("D")
        }
    );
    // Only at the start of a word: "undelve" and "xdelve" pass.
    let mut s = SlopState::new(c.clone(), 0);
    assert!(feed(&mut s, &v, "undelve xdelve")
        .iter()
        .all(|a| *a == Accepted::Kept));
    // A phrase of several words, split across tokens: the rewind goes to the token holding
    // its first byte (" in" holds " i...", so " in" is banned).
    let mut s = SlopState::new(c, 0);
    let r = feed(&mut s, &v, "and in conclusion");
    assert_eq!(
        r.last(),
        Some(&Accepted::Rewound {
            position: 1,
            banned: v.id(" in")
        })
    );
}

#[test]
fn streaming_holds_back_only_partial_matches() {
    let v = ToyVocab::new();
    let c = compile(&cfg(2, &[("in conclusion", 1.0)]), &v);
    let mut s = SlopState::new(c, 0);
    let mut streamed = Vec::new();
    let mut step = |s: &mut SlopState, piece: &str| {
        assert_eq!(s.accept(v.id(piece)), Accepted::Kept);
        streamed.extend(s.take_commits());
        streamed.len()
    };
    assert_eq!(step(&mut s, "The"), 1);
    assert_eq!(step(&mut s, " dog"), 2);
    // " in" may start the phrase: held back, and so is what follows while it still matches.
    assert_eq!(step(&mut s, " in"), 2);
    assert_eq!(step(&mut s, " con"), 2);
    // "clusion" would complete it, "cat" breaks the match: everything is released.
    assert_eq!(step(&mut s, " cat"), 5);
    // A partial match at the end is released by flush.
    step(&mut s, " in");
    assert_eq!(streamed, vec![0, 1, 2, 3, 4]);
    assert_eq!(s.take_commits(), 5..5);
    assert_eq!(s.flush(), 5..6);
}

#[test]
fn rewind_budget_and_dead_ends() {
    let v = ToyVocab::new();
    let mut c = cfg(2, &[("delve", 1.0)]);
    c.max_rewinds = 1;
    let c = compile(&c, &v);
    let mut s = SlopState::new(c, 0);
    s.accept(v.id("She"));
    assert!(matches!(s.accept(v.id(" delve")), Accepted::Rewound { .. }));
    // The second completion is over budget: cut back to the phrase start, stop.
    assert_eq!(
        s.accept(v.id(" delve")),
        Accepted::Exhausted { position: 1 }
    );
    assert_eq!(s.tokens(), &[v.id("She")]);

    // Dead end: the previous token is banned in turn while it is held back; once streamed,
    // generation stops instead.
    let c = compile(&cfg(2, &[("in conclusion", 1.0)]), &v);
    let mut s = SlopState::new(c.clone(), 3);
    s.accept(v.id("The"));
    s.accept(v.id(" in"));
    assert_eq!(s.take_commits(), 0..1); // " in" is held back
    assert_eq!(
        s.dead_end(),
        strata_engine::sampler::slop::DeadEnd::Rewound {
            position: 4,
            banned: v.id(" in")
        }
    );
    assert_eq!(s.banned_here(), &[v.id(" in")]);
    assert_eq!(s.dead_end(), strata_engine::sampler::slop::DeadEnd::Stop);
}

#[test]
fn slop_list_file_format() {
    let text = "# comment\n\n\"delve\" 2.5\n  \"a \\\"quoted\\\" one\"   inf\n\"x, y\" 0\n";
    let e = parse_list(text, "my.txt").unwrap();
    assert_eq!(
        e,
        vec![
            SlopEntry {
                phrase: "delve".into(),
                penalty: 2.5
            },
            SlopEntry {
                phrase: "a \"quoted\" one".into(),
                penalty: f32::INFINITY
            },
            SlopEntry {
                phrase: "x, y".into(),
                penalty: 0.0
            },
        ]
    );
    for (bad, line) in [
        ("delve 2\n", 1),
        ("\"delve\"\n", 1),
        ("# c\n\"delve\" lots\n", 2),
        ("\"delve\" -1\n", 1),
        ("\"\" 1\n", 1),
        ("\"unterminated 1\n", 1),
    ] {
        let err = parse_list(bad, "my.txt").unwrap_err().to_string();
        assert!(
            err.starts_with(&format!("my.txt:{line}:")),
            "{bad:?}: {err}"
        );
    }
    // The shipped list parses and compiles.
    let d = parse_list(DEFAULT_LIST, "default").unwrap();
    assert!(d.len() > 50);
    let c = CompiledSlop::compile(
        &SlopConfig {
            mode: 2,
            ..SlopConfig::default()
        },
        &ToyVocab::new(),
    )
    .unwrap();
    assert!(c.max_rewinds() > 0);
}

#[test]
fn qwen_vocabulary_classes() {
    let tok = qwen_vocab();
    let c = CompiledSlop::compile(
        &SlopConfig {
            mode: 1,
            ..SlopConfig::default()
        },
        &tok,
    )
    .unwrap();
    let (nl, bl) = c.classes();
    // Oracle: the classes through the detokenizer.
    let mut want_nl = Vec::new();
    let mut want_bl = Vec::new();
    for id in 0..tok.n_vocab() as u32 {
        let s = tok.decode(&[id], false).unwrap();
        let blank = !s.is_empty() && !s.contains('\u{FFFD}') && s.trim().is_empty();
        if blank && s.contains('\n') {
            want_nl.push(id);
        }
        if blank {
            want_bl.push(id);
        }
    }
    assert_eq!(nl, &want_nl[..]);
    assert_eq!(bl, &want_bl[..]);
    eprintln!(
        "Qwen2.5 vocabulary ({} ids): {} newline tokens, {} blank tokens; default list: {} token \
         penalties, {} token phrases",
        tok.n_vocab(),
        nl.len(),
        bl.len(),
        c.token_penalties().len(),
        c.token_phrases().len()
    );
}

/// Histories that exercise the slop tables of the default list over the Qwen vocabulary.
const TEXTS: &[&str] = &[
    "She felt shivers down her spine.\n\n\n\n  In conclusion, it's important to note that",
    "Certainly! Let's dive in.\n\n\n\nIn today's fast-paced world, a rich tapestry of",
    "As an AI language model, I can't help but delve into the intricate",
    "    \n    \n    \n      \t\t\n\n\nbarely above a whisper, her voice barely above",
];

#[test]
fn sampler_slop_equals_the_draft_kernel_through_the_inverse_map() {
    let tok = qwen_vocab();
    let n = tok.n_vocab();
    let mut r = Rng(2024);
    let mut checked_steps = 0;
    let (mut removed, mut lowered) = (0, 0);
    for mode in [1u8, 2] {
        let c = compile(
            &SlopConfig {
                mode,
                ..SlopConfig::default()
            },
            &tok,
        );
        // The report's draft size; every 4th id is dropped, so some listed tokens are missing.
        let (ids, _) = draft_vocab(n, 7 + mode as u64, 4);
        let ids = &ids[..40_525.min(ids.len())];
        let mut inverse = vec![-1i32; n];
        for (d, &id) in ids.iter().enumerate() {
            inverse[id as usize] = d as i32;
        }
        let nv = ids.len();
        let tables = c.kernel_tables(inverse.clone());
        let ck = tables.checked(nv).unwrap();
        for text in TEXTS {
            let mut toks = tok.encode(text, false, false).unwrap();
            // Runs of class tokens (a run of newlines usually tokenizes as one token).
            let (nl, bl) = c.classes();
            toks.extend([nl[3], nl[40], nl[7], bl[9], bl[1], bl[30], bl[2], bl[5]]);
            toks.extend(tok.encode(" the end", false, false).unwrap());
            let mut s = SlopState::new(c.clone(), 100);
            for (k, &t) in toks.iter().enumerate() {
                let before = CompiledSlop::kernel_state(s.token_state());
                // Mode 2 states also carry bans (accept rewinds on completed phrases).
                let kept = s.accept(t) == Accepted::Kept;
                let full: Vec<f32> = (0..n).map(|_| 4.0 * r.unit()).collect();
                // The sampler's path: the candidate set over the full vocabulary.
                let mut cands = Candidates::from_logits(&full).unwrap();
                s.penalize(&mut CandidateEdit::new(&mut cands));
                // The kernel over the draft rows, state already current (prev −1) ...
                let draft: Vec<f32> = ids.iter().map(|&id| full[id as usize]).collect();
                let banned: Vec<i32> = s.banned_here().iter().map(|&b| b as i32).collect();
                let st = CompiledSlop::kernel_state(s.token_state());
                let mut k1 = draft.clone();
                let mut out = vec![0i32; STATE_LEN];
                slop_pen_optimized(&ck, mode as u32, -1, &banned, &st, &mut out, &mut k1).unwrap();
                assert_eq!(out, st);
                // ... and advancing from the previous state by the previous token itself.
                if kept {
                    assert!(banned.is_empty());
                    let mut k2 = draft.clone();
                    slop_pen_baseline(&ck, mode as u32, t as i32, &[], &before, &mut out, &mut k2)
                        .unwrap();
                    assert_eq!(out, st, "{text:?} token {k}: kernel advance");
                    assert!(k1.iter().zip(&k2).all(|(a, b)| a.to_bits() == b.to_bits()));
                }
                // The sampler's own draft entry point.
                let mut k3 = draft.clone();
                s.penalize_draft(&mut k3, &inverse);
                for (d, &id) in ids.iter().enumerate() {
                    let want = k1[d].to_bits();
                    let got = cands.items[id as usize].logit.to_bits();
                    assert_eq!(got, want, "{text:?} token {k}, id {id}: sampler vs kernel");
                    assert_eq!(
                        k3[d].to_bits(),
                        want,
                        "{text:?} token {k}, id {id}: draft API"
                    );
                }
                for (a, b) in draft.iter().zip(&k1) {
                    if *b == f32::NEG_INFINITY && *a != *b {
                        removed += 1;
                    } else if a != b {
                        lowered += 1;
                    }
                }
                checked_steps += 1;
            }
        }
    }
    assert!(checked_steps > 50);
    // The cases penalize and remove tokens (caps, phrase continuations), not nothing.
    assert!(
        removed > 1000 && lowered > 100,
        "{removed} draft logits removed, {lowered} lowered"
    );
}
