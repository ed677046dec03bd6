//! Draft vocabularies (DESIGN.md §4): a subset of token ids whose rows of the shared LM head the
//! MTP draft computes, stored as raw little-endian i32 ids; `inverse` maps a full-vocabulary id
//! to its draft index or −1.

use std::path::Path;

use crate::error::{EngineError, Result};

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DraftVocab {
    ids: Vec<u32>,
    inverse: Vec<i32>,
}

impl DraftVocab {
    /// A draft vocabulary of `ids` (in the given order: draft index `i` is `ids[i]`) over a
    /// vocabulary of `n_vocab`; ids must be in range and distinct.
    pub fn new(ids: Vec<u32>, n_vocab: usize, what: &str) -> Result<DraftVocab> {
        if ids.is_empty() {
            return Err(EngineError::Input(format!(
                "{what}: the draft vocabulary is empty"
            )));
        }
        let mut inverse = vec![-1i32; n_vocab];
        for (i, &id) in ids.iter().enumerate() {
            let slot = inverse.get_mut(id as usize).ok_or_else(|| {
                EngineError::Input(format!(
                    "{what}: entry {i} is token {id}, outside the vocabulary of {n_vocab}"
                ))
            })?;
            if *slot >= 0 {
                return Err(EngineError::Input(format!(
                    "{what}: token {id} appears twice (entries {} and {i})",
                    *slot
                )));
            }
            *slot = i32::try_from(i)
                .map_err(|_| EngineError::Input(format!("{what}: more than 2^31 entries")))?;
        }
        Ok(DraftVocab { ids, inverse })
    }

    /// Reads a file of raw little-endian i32 token ids.
    pub fn load(path: impl AsRef<Path>, n_vocab: usize) -> Result<DraftVocab> {
        let path = path.as_ref();
        let what = path.display().to_string();
        let bytes = std::fs::read(path).map_err(|e| EngineError::Input(format!("{what}: {e}")))?;
        if bytes.len() % 4 != 0 {
            return Err(EngineError::Input(format!(
                "{what}: {} bytes is not a whole number of i32 ids",
                bytes.len()
            )));
        }
        let ids = bytes
            .chunks_exact(4)
            .enumerate()
            .map(|(i, c)| {
                let v = i32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                u32::try_from(v).map_err(|_| {
                    EngineError::Input(format!(
                        "{what}: entry {i} (offset {}) is {v}; expected a token id ≥ 0",
                        4 * i
                    ))
                })
            })
            .collect::<Result<Vec<u32>>>()?;
        DraftVocab::new(ids, n_vocab, &what)
    }

    /// The file image: raw little-endian i32 ids.
    pub fn to_bytes(&self) -> Vec<u8> {
        self.ids
            .iter()
            .flat_map(|&t| (t as i32).to_le_bytes())
            .collect()
    }

    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    pub fn len(&self) -> usize {
        self.ids.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// Draft index of full-vocabulary token `id`, or −1.
    pub fn inverse(&self, id: u32) -> i32 {
        self.inverse.get(id as usize).copied().unwrap_or(-1)
    }

    /// The whole inverse map (full-vocabulary id → draft index or −1), the form
    /// [`crate::sampler::Sampler::penalize_draft`] takes.
    pub fn inverse_map(&self) -> &[i32] {
        &self.inverse
    }

    /// A draft vocabulary of the `size` most frequent ids in `counts` (ties to the lower id),
    /// always including `always` (e.g. end-of-generation tokens), written in ascending id order
    /// so that a pick's ties go to the lower token id as over the full vocabulary.
    pub fn by_frequency(counts: &[u64], size: usize, always: &[u32]) -> Result<DraftVocab> {
        let n_vocab = counts.len();
        let mut order: Vec<u32> = (0..n_vocab as u32).collect();
        order.sort_by(|&a, &b| counts[b as usize].cmp(&counts[a as usize]).then(a.cmp(&b)));
        let mut chosen: Vec<u32> = always
            .iter()
            .copied()
            .filter(|&t| (t as usize) < n_vocab)
            .collect();
        chosen.sort_unstable();
        chosen.dedup();
        let mut taken = vec![false; n_vocab];
        for &t in &chosen {
            taken[t as usize] = true;
        }
        for t in order {
            if chosen.len() >= size.max(1) {
                break;
            }
            if !taken[t as usize] {
                taken[t as usize] = true;
                chosen.push(t);
            }
        }
        chosen.sort_unstable();
        DraftVocab::new(chosen, n_vocab, "draft vocabulary")
    }
}
