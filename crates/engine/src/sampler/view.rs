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
    /// id → item index, built on first need when the set is not in the identity layout.
    index: Option<HashMap<u32, usize>>,
}

impl<'a> CandidateEdit<'a> {
    pub fn new(c: &'a mut Candidates) -> Self {
        CandidateEdit { c, index: None }
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
        // Candidates are visited in id order, so `>` keeps the lowest id among equals.
        let mut best: Option<(usize, f32)> = None;
        let consider = |i: usize, l: f32, best: &mut Option<(usize, f32)>| {
            if best.is_none_or(|(_, b)| l > b) {
                *best = Some((i, l));
            }
        };
        let mut from = 0usize;
        for &(id, v) in &self.edits {
            let id = id as usize;
            for (k, &l) in self.base[from..id].iter().enumerate() {
                if l.is_nan() {
                    return Err(nan(from + k));
                }
                consider(from + k, l, &mut best);
            }
            if v.is_nan() || self.base[id].is_nan() {
                return Err(nan(id));
            }
            consider(id, v, &mut best);
            from = id + 1;
        }
        for (k, &l) in self.base[from..].iter().enumerate() {
            if l.is_nan() {
                return Err(nan(from + k));
            }
            consider(from + k, l, &mut best);
        }
        Ok(best
            .filter(|&(_, l)| l > f32::NEG_INFINITY)
            .map(|(i, _)| i as u32))
    }
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
