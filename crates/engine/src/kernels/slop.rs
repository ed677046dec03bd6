//! `slop_pen`: slop penalties on the draft logits (DESIGN.md §5, the report's `mtp_slop_pen`).
//!
//! Inputs, all explicit (the CUDA kernel takes the same arrays):
//! - `logits`: the `nv` draft logits, changed in place; `inverse`: full-vocabulary id → draft
//!   index or −1 ([`SlopTables::inverse`]);
//! - the token penalty list (`pen_ids`, `pen_vals`: distinct full ids, a penalty each);
//! - the newline and blank token classes (full ids) and their run caps (0 = no cap);
//! - the phrase table: token sequences (`phrase_tokens`, offsets `phrase_start`, length ≥ 2)
//!   with a penalty each;
//! - the per-sequence state ([`STATE_LEN`] i32: newline run, blank run, match count, then
//!   `(phrase, matched)` pairs), the previous draft token `prev` (−1: none, the state is
//!   already current), and `banned` (ids forbidden at this position by a phrase rewind).
//!
//! Semantics per mode:
//! - **0**: nothing changes; `state_out = state_in`.
//! - **1**: advance the runs by `prev` (a run grows when `prev` is in its class, else restarts
//!   at 0); subtract each listed token's penalty; when a run has reached its cap, remove (−∞)
//!   every token of that class. Matches are cleared.
//! - **2**: as 1, and advance the phrase matches by `prev` (each match whose next token is
//!   `prev` moves on, in order; then every phrase that starts with `prev` opens a match, in
//!   phrase order; a match that would complete its phrase is dropped; at most [`MAX_MATCHES`]
//!   are kept). Then, match by match in order, the next token of each match is penalized by
//!   the phrase's penalty, or removed if it would complete the phrase; `banned` is removed.
//!
//! Float contract: each listed penalty is one rounded subtraction; a token hit by several
//! matches takes their penalties one after another in match order; −∞ absorbs.

use super::registry::{Op, Variant, BASELINE, OPTIMIZED};
use super::{check_len, invalid, KernelError};

/// Most phrase matches carried in the state.
pub const MAX_MATCHES: usize = 32;
/// Length of the state array.
pub const STATE_LEN: usize = 3 + 2 * MAX_MATCHES;
/// Runs stop counting here (no overflow on long runs).
pub const RUN_LIMIT: i32 = 1 << 30;

/// The tables of one slop configuration, over a full vocabulary of `inverse.len()` ids.
#[derive(Clone, Debug, Default)]
pub struct SlopTables {
    pub inverse: Vec<i32>,
    pub pen_ids: Vec<i32>,
    pub pen_vals: Vec<f32>,
    pub newline: Vec<i32>,
    pub blank: Vec<i32>,
    pub phrase_tokens: Vec<i32>,
    /// `n_phrases + 1` offsets into `phrase_tokens`.
    pub phrase_start: Vec<i32>,
    pub phrase_pen: Vec<f32>,
    pub cap_newline: i32,
    pub cap_blank: i32,
}

impl SlopTables {
    pub fn n_phrases(&self) -> usize {
        self.phrase_start.len().saturating_sub(1)
    }

    fn phrase(&self, p: usize) -> &[i32] {
        let a = self.phrase_start[p] as usize;
        let b = self.phrase_start[p + 1] as usize;
        &self.phrase_tokens[a..b]
    }

    /// Checks every invariant the kernels rely on, for draft logits of `nv` values.
    pub fn validate(&self, nv: usize) -> Result<(), KernelError> {
        let k = "slop_pen";
        let vocab = self.inverse.len();
        let in_vocab = |what: &str, ids: &[i32]| -> Result<(), KernelError> {
            match ids.iter().find(|&&i| i < 0 || i as usize >= vocab) {
                Some(bad) => Err(invalid(
                    k,
                    format!("{what} holds token id {bad}, outside the vocabulary of {vocab}"),
                )),
                None => Ok(()),
            }
        };
        if let Some(bad) = self.inverse.iter().find(|&&d| d < -1 || d >= nv as i32) {
            return Err(invalid(
                k,
                format!("inverse map holds {bad}, expected -1 or a draft index below {nv}"),
            ));
        }
        // One token per draft slot: the parallel kernels rely on distinct ids hitting
        // distinct slots.
        let mut used = vec![false; nv];
        for &d in self.inverse.iter().filter(|&&d| d >= 0) {
            if std::mem::replace(&mut used[d as usize], true) {
                return Err(invalid(
                    k,
                    format!("inverse map sends two tokens to draft index {d}"),
                ));
            }
        }
        check_len(k, "penalty values", self.pen_vals.len(), self.pen_ids.len())?;
        in_vocab("the penalty list", &self.pen_ids)?;
        let mut seen = std::collections::HashSet::new();
        if let Some(dup) = self.pen_ids.iter().find(|&&i| !seen.insert(i)) {
            return Err(invalid(
                k,
                format!("the penalty list names token {dup} twice; merge its penalties"),
            ));
        }
        in_vocab("the newline class", &self.newline)?;
        in_vocab("the blank class", &self.blank)?;
        in_vocab("the phrase table", &self.phrase_tokens)?;
        if self.phrase_start.is_empty() || self.phrase_start[0] != 0 {
            return Err(invalid(k, "phrase offsets must start at 0"));
        }
        if *self.phrase_start.last().unwrap_or(&0) as usize != self.phrase_tokens.len() {
            return Err(invalid(
                k,
                "the last phrase offset must equal the number of phrase tokens",
            ));
        }
        if let Some(w) = self.phrase_start.windows(2).position(|w| w[1] - w[0] < 2) {
            return Err(invalid(k, format!("phrase {w} has fewer than 2 tokens")));
        }
        check_len(
            k,
            "phrase penalties",
            self.phrase_pen.len(),
            self.n_phrases(),
        )?;
        Ok(())
    }

    /// Validates the tables once for draft logits of `nv` values; the kernels take the result.
    pub fn checked(&self, nv: usize) -> Result<CheckedSlop<'_>, KernelError> {
        self.validate(nv)?;
        Ok(CheckedSlop { tables: self, nv })
    }

    /// Checks a state array against these tables.
    pub fn validate_state(&self, state: &[i32]) -> Result<(), KernelError> {
        let k = "slop_pen";
        check_len(k, "state", state.len(), STATE_LEN)?;
        let n = state[2];
        if n < 0 || n as usize > MAX_MATCHES {
            return Err(invalid(
                k,
                format!("state holds {n} matches, expected 0..={MAX_MATCHES}"),
            ));
        }
        if state[0] < 0 || state[1] < 0 {
            return Err(invalid(k, "state holds a negative run length"));
        }
        for i in 0..n as usize {
            let (p, m) = (state[3 + 2 * i], state[4 + 2 * i]);
            if p < 0 || p as usize >= self.n_phrases() {
                return Err(invalid(
                    k,
                    format!("match {i} names phrase {p} of {}", self.n_phrases()),
                ));
            }
            let len = self.phrase(p as usize).len() as i32;
            if m < 1 || m >= len {
                return Err(invalid(
                    k,
                    format!("match {i} has matched {m} of phrase {p}'s {len} tokens"),
                ));
            }
        }
        Ok(())
    }
}

/// Tables validated for a draft vocabulary of `nv`: make it with [`SlopTables::checked`] (the
/// fields are open so a caller that validated once can rebuild the view without a borrow).
#[derive(Clone, Copy)]
pub struct CheckedSlop<'a> {
    pub tables: &'a SlopTables,
    pub nv: usize,
}

/// Applies the penalties of `mode` (module doc).
pub type SlopFn = fn(
    t: &CheckedSlop<'_>,
    mode: u32,
    prev: i32,
    banned: &[i32],
    state_in: &[i32],
    state_out: &mut [i32],
    logits: &mut [f32],
) -> Result<(), KernelError>;

fn slop_check(
    c: &CheckedSlop<'_>,
    mode: u32,
    prev: i32,
    banned: &[i32],
    state_in: &[i32],
    state_out: &[i32],
    nv: usize,
) -> Result<(), KernelError> {
    if mode > 2 {
        return Err(invalid(
            "slop_pen",
            format!("mode {mode}, expected 0, 1 or 2"),
        ));
    }
    check_len("slop_pen", "logits", nv, c.nv)?;
    let t = c.tables;
    t.validate_state(state_in)?;
    check_len("slop_pen", "output state", state_out.len(), STATE_LEN)?;
    if prev >= t.inverse.len() as i32 || prev < -1 {
        return Err(invalid(
            "slop_pen",
            format!("previous token {prev} is outside the vocabulary"),
        ));
    }
    if let Some(b) = banned
        .iter()
        .find(|&&b| b < 0 || b as usize >= t.inverse.len())
    {
        return Err(invalid(
            "slop_pen",
            format!("banned token {b} is outside the vocabulary"),
        ));
    }
    Ok(())
}

fn bump(run: i32, hit: bool) -> i32 {
    if hit {
        (run + 1).min(RUN_LIMIT)
    } else {
        0
    }
}

/// The new state after `prev` (shared by both variants: it is integer bookkeeping).
fn advance(
    t: &SlopTables,
    mode: u32,
    prev: i32,
    is_nl: bool,
    is_bl: bool,
    s: &[i32],
    out: &mut [i32],
) {
    out.fill(0);
    if prev < 0 {
        out[0] = s[0];
        out[1] = s[1];
    } else {
        out[0] = bump(s[0], is_nl);
        out[1] = bump(s[1], is_bl);
    }
    if mode < 2 {
        return;
    }
    if prev < 0 {
        out[2..].copy_from_slice(&s[2..]);
        return;
    }
    let mut n = 0usize;
    let mut push = |out: &mut [i32], p: usize, m: usize| {
        if n < MAX_MATCHES {
            out[3 + 2 * n] = p as i32;
            out[4 + 2 * n] = m as i32;
            n += 1;
        }
    };
    for i in 0..s[2] as usize {
        let (p, m) = (s[3 + 2 * i] as usize, s[4 + 2 * i] as usize);
        let ph = t.phrase(p);
        if ph[m] == prev && m + 1 < ph.len() {
            push(out, p, m + 1);
        }
    }
    for p in 0..t.n_phrases() {
        let ph = t.phrase(p);
        if ph[0] == prev && ph.len() > 1 {
            push(out, p, 1);
        }
    }
    out[2] = n as i32;
}

#[inline]
fn draft(t: &SlopTables, id: i32, nv: usize) -> Option<usize> {
    let d = t.inverse[id as usize];
    (d >= 0 && (d as usize) < nv).then_some(d as usize)
}

fn apply(t: &SlopTables, mode: u32, banned: &[i32], st: &[i32], logits: &mut [f32]) {
    let nv = logits.len();
    for (&id, &pv) in t.pen_ids.iter().zip(&t.pen_vals) {
        if let Some(d) = draft(t, id, nv) {
            logits[d] -= pv;
        }
    }
    for (run, cap, class) in [
        (st[0], t.cap_newline, &t.newline),
        (st[1], t.cap_blank, &t.blank),
    ] {
        if cap > 0 && run >= cap {
            for &id in class.iter() {
                if let Some(d) = draft(t, id, nv) {
                    logits[d] = f32::NEG_INFINITY;
                }
            }
        }
    }
    if mode < 2 {
        return;
    }
    for i in 0..st[2] as usize {
        let (p, m) = (st[3 + 2 * i] as usize, st[4 + 2 * i] as usize);
        let ph = t.phrase(p);
        if let Some(d) = draft(t, ph[m], nv) {
            if m + 1 == ph.len() {
                logits[d] = f32::NEG_INFINITY;
            } else {
                logits[d] -= t.phrase_pen[p];
            }
        }
    }
    for &b in banned {
        if let Some(d) = draft(t, b, nv) {
            logits[d] = f32::NEG_INFINITY;
        }
    }
}

/// Classifies `prev` with linear scans even in mode 0 (the report's baseline shape).
pub fn slop_pen_baseline(
    c: &CheckedSlop<'_>,
    mode: u32,
    prev: i32,
    banned: &[i32],
    state_in: &[i32],
    state_out: &mut [i32],
    logits: &mut [f32],
) -> Result<(), KernelError> {
    slop_check(c, mode, prev, banned, state_in, state_out, logits.len())?;
    let t = c.tables;
    let is_nl = t.newline.contains(&prev);
    let is_bl = t.blank.contains(&prev);
    if mode == 0 {
        state_out.copy_from_slice(state_in);
        return Ok(());
    }
    advance(t, mode, prev, is_nl, is_bl, state_in, state_out);
    apply(t, mode, banned, state_out, logits);
    Ok(())
}

/// Leaves at once in mode 0 and classifies only when there is a previous token.
pub fn slop_pen_optimized(
    c: &CheckedSlop<'_>,
    mode: u32,
    prev: i32,
    banned: &[i32],
    state_in: &[i32],
    state_out: &mut [i32],
    logits: &mut [f32],
) -> Result<(), KernelError> {
    slop_check(c, mode, prev, banned, state_in, state_out, logits.len())?;
    let t = c.tables;
    if mode == 0 {
        state_out.copy_from_slice(state_in);
        return Ok(());
    }
    let (is_nl, is_bl) = if prev >= 0 {
        (t.newline.contains(&prev), t.blank.contains(&prev))
    } else {
        (false, false)
    };
    advance(t, mode, prev, is_nl, is_bl, state_in, state_out);
    apply(t, mode, banned, state_out, logits);
    Ok(())
}

pub static SLOP_PEN: Op<SlopFn> = Op {
    name: "slop_pen",
    variants: &[
        Variant {
            name: BASELINE,
            f: slop_pen_baseline,
        },
        Variant {
            name: OPTIMIZED,
            f: slop_pen_optimized,
        },
    ],
};

/// A random but valid slop configuration and step, with the report's class sizes (200
/// newline and 222 blank tokens), for tests and the harness.
pub struct SlopCase {
    pub tables: SlopTables,
    pub mode: u32,
    pub prev: i32,
    pub banned: Vec<i32>,
    pub state: Vec<i32>,
    pub logits: Vec<f32>,
}

impl SlopCase {
    /// `vocab` full ids, `nv` of them in the draft vocabulary.
    pub fn random(rng: &mut super::testdata::Rng, vocab: usize, nv: usize, mode: u32) -> SlopCase {
        let mut inverse = vec![-1i32; vocab];
        let draft_ids = rng.distinct(nv, vocab);
        for (d, &id) in draft_ids.iter().enumerate() {
            inverse[id as usize] = d as i32;
        }
        // Draw classes mostly from draft tokens so the caps bite.
        let pick_draft = |rng: &mut super::testdata::Rng, n: usize| -> Vec<i32> {
            let idx = rng.distinct(n, nv);
            idx.iter().map(|&i| draft_ids[i as usize]).collect()
        };
        let newline = pick_draft(rng, 200.min(nv));
        let mut blank = pick_draft(rng, 222.min(nv));
        // Some tokens are both (a "\n " token is newline and blank).
        let shared = 10.min(blank.len()).min(newline.len());
        blank[..shared].copy_from_slice(&newline[..shared]);
        blank.sort_unstable();
        blank.dedup();
        let pen_ids = rng.distinct(512.min(vocab), vocab);
        let pen_vals: Vec<f32> = (0..pen_ids.len()).map(|_| 0.5 + 4.0 * rng.unit()).collect();
        let n_ph = 256;
        let mut phrase_tokens = Vec::new();
        let mut phrase_start = vec![0i32];
        for _ in 0..n_ph {
            let len = 2 + rng.below(4);
            for _ in 0..len {
                // Small alphabet of draft tokens so phrases share prefixes.
                let id = draft_ids[rng.below(64.min(nv))];
                phrase_tokens.push(id);
            }
            phrase_start.push(phrase_tokens.len() as i32);
        }
        let phrase_pen: Vec<f32> = (0..n_ph).map(|_| 0.25 + 2.0 * rng.unit()).collect();
        let tables = SlopTables {
            inverse,
            pen_ids,
            pen_vals,
            newline,
            blank,
            phrase_tokens,
            phrase_start,
            phrase_pen,
            cap_newline: 2,
            cap_blank: 3,
        };
        let mut state = vec![0i32; STATE_LEN];
        state[0] = rng.below(4) as i32;
        state[1] = rng.below(5) as i32;
        let n_m = rng.below(MAX_MATCHES + 1);
        for i in 0..n_m {
            let p = rng.below(n_ph);
            let len = tables.phrase(p).len();
            state[3 + 2 * i] = p as i32;
            state[4 + 2 * i] = 1 + rng.below(len - 1) as i32;
        }
        state[2] = n_m as i32;
        // prev: the next token of a match, a class token, a phrase start or anything.
        let prev = match rng.below(5) {
            0 if n_m > 0 => {
                let i = rng.below(n_m);
                let (p, m) = (state[3 + 2 * i] as usize, state[4 + 2 * i] as usize);
                tables.phrase(p)[m]
            }
            1 => tables.newline[rng.below(tables.newline.len())],
            2 => tables.blank[rng.below(tables.blank.len())],
            3 => draft_ids[rng.below(64.min(nv))],
            _ => rng.below(vocab) as i32,
        };
        let banned: Vec<i32> = (0..rng.below(4))
            .map(|_| draft_ids[rng.below(nv)])
            .collect();
        let logits = rng.f32_vec_special(nv, 4.0);
        SlopCase {
            tables,
            mode,
            prev,
            banned,
            state,
            logits,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testdata::Rng;

    #[test]
    fn variants_bitwise_all_modes() {
        let mut rng = Rng::new(61);
        for &(vocab, nv) in &[(248_320usize, 40_525usize), (5000, 5000)] {
            for mode in 0..3 {
                for _ in 0..4 {
                    let c = SlopCase::random(&mut rng, vocab, nv, mode);
                    let mut l1 = c.logits.clone();
                    let mut l2 = c.logits.clone();
                    let mut s1 = vec![-7; STATE_LEN];
                    let mut s2 = vec![-9; STATE_LEN];
                    let ck = c.tables.checked(nv).unwrap();
                    slop_pen_baseline(&ck, mode, c.prev, &c.banned, &c.state, &mut s1, &mut l1)
                        .unwrap();
                    slop_pen_optimized(&ck, mode, c.prev, &c.banned, &c.state, &mut s2, &mut l2)
                        .unwrap();
                    assert_eq!(s1, s2);
                    assert!(l1.iter().zip(&l2).all(|(a, b)| a.to_bits() == b.to_bits()));
                    if mode == 0 {
                        assert_eq!(s1, c.state);
                        assert!(l1
                            .iter()
                            .zip(&c.logits)
                            .all(|(a, b)| a.to_bits() == b.to_bits()));
                    }
                    c.tables.validate_state(&s1).unwrap();
                }
            }
        }
    }

    #[test]
    fn semantics_by_hand() {
        // vocab 10, draft = ids 0..8 (id i → draft i), phrases [5,6,7] and [5,8].
        let mut inverse: Vec<i32> = (0..10).collect();
        inverse[9] = -1;
        let t = SlopTables {
            inverse,
            pen_ids: vec![1, 9],
            pen_vals: vec![1.5, 2.0],
            newline: vec![2],
            blank: vec![3, 2],
            phrase_tokens: vec![5, 6, 7, 5, 8],
            phrase_start: vec![0, 3, 5],
            phrase_pen: vec![0.5, 0.25],
            cap_newline: 2,
            cap_blank: 0,
        };
        let nv = 9;
        let ck = t.checked(nv).unwrap();
        let mut state = vec![0i32; STATE_LEN];
        state[0] = 1; // one newline so far
        let mut out = vec![0i32; STATE_LEN];
        let mut l = vec![0f32; nv];
        // prev = 2 (newline): run reaches the cap of 2, so token 2 is removed.
        slop_pen_optimized(&ck, 1, 2, &[], &state, &mut out, &mut l).unwrap();
        assert_eq!(&out[..3], &[2, 1, 0]);
        assert_eq!(l[1], -1.5);
        assert_eq!(l[2], f32::NEG_INFINITY);
        assert_eq!(l[3], 0.0);
        // Mode 2, prev = 5 opens both phrases: 6 is penalized 0.5; 8 would complete [5,8]: removed.
        let mut l = vec![0f32; nv];
        slop_pen_optimized(&ck, 2, 5, &[4], &state, &mut out, &mut l).unwrap();
        assert_eq!(&out[..7], &[0, 0, 2, 0, 1, 1, 1]);
        assert_eq!(l[6], -0.5);
        assert_eq!(l[8], f32::NEG_INFINITY);
        assert_eq!(l[4], f32::NEG_INFINITY);
        // Then prev = 6 advances phrase 0 to its last token: 7 is removed.
        let st = out.clone();
        let mut l = vec![0f32; nv];
        slop_pen_baseline(&ck, 2, 6, &[], &st, &mut out, &mut l).unwrap();
        assert_eq!(&out[..5], &[0, 0, 1, 0, 2]);
        assert_eq!(l[7], f32::NEG_INFINITY);
        // Invalid tables are refused.
        let mut bad = t.clone();
        bad.pen_ids = vec![1, 1];
        assert!(bad.checked(nv).is_err());
        let mut bad = t.clone();
        bad.inverse[9] = 3;
        assert!(bad.checked(nv).is_err());
        assert!(slop_pen_baseline(&ck, 1, 2, &[], &state, &mut out, &mut l[..5]).is_err());
        assert!(slop_pen_baseline(&ck, 3, 2, &[], &state, &mut out, &mut l).is_err());
    }
}
