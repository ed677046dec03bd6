//! Where the logit-editing stages (penalties, DRY, slop) write: one trait over the three layouts
//! they meet, so each stage is written once and gives the same bits on all of them.
//! - the candidate set of the chain ([`CandidateEdit`]), in the identity layout it has before
//!   any filter (item `i` is token `i`) or in any order after one;
//! - a draft vocabulary's logits reached through the inverse map ([`DraftEdit`]);
//! - a sparse overlay over read-only full-vocabulary logits ([`Overlay`]), which lets a greedy
//!   pick after penalties skip copying the vocabulary.
//!
//! A stage only ever edits a few hundred ids, so the trait is "edit this id if present".

use std::collections::HashMap;

use super::{canonical, Candidate, Candidates};
use crate::error::{EngineError, Result};

pub trait LogitEdit {
    /// Runs `f` on the logit of token `id` when this view holds that token.
    fn edit(&mut self, id: u32, f: &mut dyn FnMut(&mut f32));
}

/// The chain's candidate set.
pub struct CandidateEdit<'a> {
    c: &'a mut Candidates,
    /// Whether item `i` is token `i` for every `i` (checked on the first miss): then a token
    /// not at its own index is simply absent.
    identity: Option<bool>,
    /// id → item index, built on first need when the set is not in the identity layout.
    index: Option<HashMap<u32, usize>>,
}

impl<'a> CandidateEdit<'a> {
    pub fn new(c: &'a mut Candidates) -> Self {
        CandidateEdit {
            c,
            identity: None,
            index: None,
        }
    }
}

impl LogitEdit for CandidateEdit<'_> {
    fn edit(&mut self, id: u32, f: &mut dyn FnMut(&mut f32)) {
        let items = &mut self.c.items;
        if let Some(x) = items.get_mut(id as usize).filter(|x| x.id == id) {
            f(&mut x.logit);
            self.c.sorted = false;
            return;
        }
        let identity = *self
            .identity
            .get_or_insert_with(|| items.iter().enumerate().all(|(i, x)| x.id as usize == i));
        if identity {
            return;
        }
        let index = self
            .index
            .get_or_insert_with(|| items.iter().enumerate().map(|(i, x)| (x.id, i)).collect());
        if let Some(&i) = index.get(&id) {
            f(&mut items[i].logit);
            self.c.sorted = false;
        }
    }
}

/// Draft logits in draft order; `inverse[id]` is the draft index of full id `id`, or −1.
pub struct DraftEdit<'a> {
    pub logits: &'a mut [f32],
    pub inverse: &'a [i32],
}

impl LogitEdit for DraftEdit<'_> {
    fn edit(&mut self, id: u32, f: &mut dyn FnMut(&mut f32)) {
        if let Some(&d) = self.inverse.get(id as usize) {
            if d >= 0 {
                if let Some(x) = self.logits.get_mut(d as usize) {
                    f(x);
                }
            }
        }
    }
}

/// Full-vocabulary logits indexed by id, edited in place.
pub struct DenseEdit<'a>(pub &'a mut [f32]);

impl LogitEdit for DenseEdit<'_> {
    fn edit(&mut self, id: u32, f: &mut dyn FnMut(&mut f32)) {
        if let Some(x) = self.0.get_mut(id as usize) {
            f(x);
        }
    }
}

/// Edits recorded beside read-only logits: an edited id's value starts from its base logit
/// and takes the edits in order, exactly as [`DenseEdit`] would.
pub struct Overlay<'a> {
    base: &'a [f32],
    edits: Vec<(u32, f32)>,
    at: HashMap<u32, usize>,
}

impl<'a> Overlay<'a> {
    pub fn new(base: &'a [f32]) -> Self {
        Overlay {
            base,
            edits: Vec::new(),
            at: HashMap::new(),
        }
    }

    /// The highest logit after the edits, ties to the lower id: the same answer as
    /// [`super::argmax`] over an edited copy, found without the copy. `None` when every logit
    /// is −∞ (nothing is left to pick).
    pub fn argmax(mut self) -> Result<Option<u32>> {
        if self.base.is_empty() {
            return Err(EngineError::Input("sampler: no logits".to_string()));
        }
        self.edits.sort_unstable_by_key(|e| e.0);
        let nan = |i: usize| EngineError::Input(format!("sampler: logit of token {i} is NaN"));
        // Better = larger, or equal with a lower id; segments and edits come in id order.
        let mut best: Option<(usize, f32)> = None;
        let take = |c: Option<(usize, f32)>, best: &mut Option<(usize, f32)>| {
            if let Some((i, l)) = c {
                if best.is_none_or(|(_, b)| l > b) {
                    *best = Some((i, l));
                }
            }
        };
        let mut from = 0usize;
        for &(id, v) in &self.edits {
            let id = id as usize;
            let seg = first_max(&self.base[from..id]).map_err(|k| nan(from + k))?;
            take(seg.map(|(k, l)| (from + k, l)), &mut best);
            if v.is_nan() || self.base[id].is_nan() {
                return Err(nan(id));
            }
            take(Some((id, v)), &mut best);
            from = id + 1;
        }
        let seg = first_max(&self.base[from..]).map_err(|k| nan(from + k))?;
        take(seg.map(|(k, l)| (from + k, l)), &mut best);
        Ok(best
            .filter(|&(_, l)| l > f32::NEG_INFINITY)
            .map(|(i, _)| i as u32))
    }
}

impl Overlay<'_> {
    /// The `k` best tokens after the edits (`k > 0`), in canonical order: the same set, order
    /// and bits as building every candidate, applying the edits and keeping the best `k`
    /// (`Candidates::from_logits` + `keep_best`), found without building them. Values below the
    /// current k-th best are rejected 16 at a time; a NaN base logit is an error naming the
    /// first one, as `from_logits` does.
    pub fn top_k(mut self, k: usize) -> Result<Candidates> {
        if self.base.is_empty() {
            return Err(EngineError::Input("sampler: no logits".to_string()));
        }
        let k = k.max(1);
        self.edits.sort_unstable_by_key(|e| e.0);
        let nan = |i: usize| EngineError::Input(format!("sampler: logit of token {i} is NaN"));
        let mut best = TopK::new(k);
        let mut from = 0usize;
        for &(id, v) in &self.edits {
            let id = id as usize;
            best.scan(&self.base[from..id], from).map_err(nan)?;
            if self.base[id].is_nan() {
                return Err(nan(id));
            }
            best.offer(Candidate {
                id: id as u32,
                logit: v,
            });
            from = id + 1;
        }
        best.scan(&self.base[from..], from).map_err(nan)?;
        Ok(best.finish())
    }
}

/// The `k` best candidates seen so far, kept in a buffer of up to `2k` that is cut back to the
/// best `k` when full; `floor` is then the k-th best, and only a better candidate can enter.
struct TopK {
    k: usize,
    buf: Vec<Candidate>,
    floor: Option<Candidate>,
}

impl TopK {
    fn new(k: usize) -> TopK {
        TopK {
            k,
            buf: Vec::with_capacity(2 * k),
            floor: None,
        }
    }

    fn offer(&mut self, c: Candidate) {
        if let Some(f) = &self.floor {
            // Canonical order: higher logit (total order, so −0.0 < 0.0), then lower id.
            if canonical(&c, f) != std::cmp::Ordering::Less {
                return;
            }
        }
        self.buf.push(c);
        if self.buf.len() == 2 * self.k {
            self.buf.select_nth_unstable_by(self.k - 1, canonical);
            self.buf.truncate(self.k);
            self.floor = Some(self.buf[self.k - 1]);
        }
    }

    /// Offers `v[i]` as token `first + i`, in order; `Err(token)` at the first NaN.
    fn scan(&mut self, v: &[f32], first: usize) -> std::result::Result<(), usize> {
        const L: usize = 16;
        for (ci, chunk) in v.chunks(L).enumerate() {
            // `x < floor` is false for NaN and for values the floor does not exclude, so a
            // chunk that holds neither is skipped whole (a comparison the compiler vectorizes).
            if let Some(f) = self.floor {
                if chunk.iter().fold(true, |all, &x| all & (x < f.logit)) {
                    continue;
                }
            }
            for (j, &x) in chunk.iter().enumerate() {
                let id = first + ci * L + j;
                if x.is_nan() {
                    return Err(id);
                }
                self.offer(Candidate {
                    id: id as u32,
                    logit: x,
                });
            }
        }
        Ok(())
    }

    fn finish(mut self) -> Candidates {
        self.buf.sort_unstable_by(canonical);
        self.buf.truncate(self.k);
        Candidates {
            items: self.buf,
            sorted: true,
        }
    }
}

/// The first maximum of `v` as (index, value), None when empty; `Err(i)`: `v[i]` is the first
/// NaN. Two passes the compiler vectorizes (a max over 16 lanes, then the first 16-value chunk
/// holding it), several times faster than a scalar scan that keeps the index; the same answer,
/// since ties go to the first index either way (and −0.0 equals 0.0 in both).
pub fn first_max(v: &[f32]) -> std::result::Result<Option<(usize, f32)>, usize> {
    const L: usize = 16;
    if v.is_empty() {
        return Ok(None);
    }
    let mut m = [f32::NEG_INFINITY; L];
    let mut bad = [false; L];
    let chunks = v.chunks_exact(L);
    let rem = chunks.remainder();
    for c in chunks {
        for j in 0..L {
            let x = c[j];
            bad[j] |= x.is_nan();
            m[j] = if x > m[j] { x } else { m[j] };
        }
    }
    for (j, &x) in rem.iter().enumerate() {
        bad[j] |= x.is_nan();
        m[j] = if x > m[j] { x } else { m[j] };
    }
    if bad.iter().any(|&b| b) {
        return Err(v.iter().position(|x| x.is_nan()).unwrap_or(0));
    }
    let mx = m
        .iter()
        .copied()
        .fold(f32::NEG_INFINITY, |a, b| if b > a { b } else { a });
    // No NaN, so the maximum is one of the values (−∞ when all are −∞). Whole chunks are
    // tested without early exit inside (that vectorizes), then the hit chunk is searched.
    let mut base = 0;
    for c in v.chunks(L) {
        if c.iter().fold(false, |a, &x| a | (x == mx)) {
            let k = c.iter().position(|&x| x == mx).unwrap_or(0);
            return Ok(Some((base + k, c[k])));
        }
        base += c.len();
    }
    Ok(Some((0, v[0])))
}

impl LogitEdit for Overlay<'_> {
    fn edit(&mut self, id: u32, f: &mut dyn FnMut(&mut f32)) {
        let Some(&b) = self.base.get(id as usize) else {
            return;
        };
        let edits = &mut self.edits;
        let i = *self.at.entry(id).or_insert_with(|| {
            edits.push((id, b));
            edits.len() - 1
        });
        f(&mut self.edits[i].1);
    }
}
