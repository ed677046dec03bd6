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

use super::Candidates;
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
