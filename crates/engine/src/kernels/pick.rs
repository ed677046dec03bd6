//! `pick`: greedy choice over the draft logits (the report's `mtp_pick`): the index of the
//! largest value, ties to the lower index (−0.0 ties +0.0), NaN never chosen unless every value
//! is NaN (then index 0), mapped back to a full-vocabulary token id through `draft_ids`.

use super::registry::{Op, Variant, BASELINE, OPTIMIZED};
use super::{check_len, KernelError};

/// The pick of one row: draft index, full-vocabulary token id, and the value.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Picked {
    pub index: usize,
    pub token: i32,
    pub value: f32,
}

/// `logits`: `nv` draft logits; `draft_ids`: `nv` token ids, or none (the index is the token:
/// a pick over the full vocabulary, the trunk's greedy).
pub type PickFn = fn(logits: &[f32], draft_ids: &[i32]) -> Result<Picked, KernelError>;

fn done(logits: &[f32], draft_ids: &[i32], index: usize) -> Picked {
    let token = if draft_ids.is_empty() {
        i32::try_from(index).unwrap_or(-1)
    } else {
        draft_ids.get(index).copied().unwrap_or(-1)
    };
    Picked {
        index,
        token,
        value: logits.get(index).copied().unwrap_or(f32::NAN),
    }
}

/// The index the pick chooses (the baseline's loop): the draft chain's choice over draft-row
/// logits, before the map back to token ids.
pub fn argmax(logits: &[f32]) -> usize {
    let mut best = f32::NEG_INFINITY;
    let mut bi = usize::MAX;
    for (i, &v) in logits.iter().enumerate() {
        if v > best || (v == best && bi == usize::MAX) {
            best = v;
            bi = i;
        }
    }
    if bi == usize::MAX {
        0
    } else {
        bi
    }
}

fn check_ids(logits: &[f32], draft_ids: &[i32]) -> Result<(), KernelError> {
    if draft_ids.is_empty() {
        return Ok(());
    }
    check_len("pick", "draft ids", draft_ids.len(), logits.len())
}

pub fn pick_baseline(logits: &[f32], draft_ids: &[i32]) -> Result<Picked, KernelError> {
    check_ids(logits, draft_ids)?;
    Ok(done(logits, draft_ids, argmax(logits)))
}

/// Sixteen independent lanes with branch-free updates (each lane keeps its first maximum,
/// strict `>`), merged by (value, lower index). A maximum of −∞ (every value −∞ or NaN) takes
/// the baseline's path, which settles that case.
pub fn pick_optimized(logits: &[f32], draft_ids: &[i32]) -> Result<Picked, KernelError> {
    check_ids(logits, draft_ids)?;
    if logits.len() >= u32::MAX as usize {
        return pick_baseline(logits, draft_ids);
    }
    const L: usize = 16;
    let mut bv = [f32::NEG_INFINITY; L];
    let mut bi = [u32::MAX; L];
    let mut chunks = logits.chunks_exact(L);
    let mut base = 0u32;
    for c in &mut chunks {
        for j in 0..L {
            let gt = c[j] > bv[j];
            bv[j] = if gt { c[j] } else { bv[j] };
            bi[j] = if gt { base + j as u32 } else { bi[j] };
        }
        base += L as u32;
    }
    for (j, &v) in chunks.remainder().iter().enumerate() {
        if v > bv[j] {
            bv[j] = v;
            bi[j] = base + j as u32;
        }
    }
    let (mut v, mut i) = (f32::NEG_INFINITY, u32::MAX);
    for j in 0..L {
        if bv[j] > v || (bv[j] == v && bi[j] < i) {
            v = bv[j];
            i = bi[j];
        }
    }
    if i == u32::MAX || v == f32::NEG_INFINITY {
        return pick_baseline(logits, draft_ids);
    }
    Ok(done(logits, draft_ids, i as usize))
}

pub static PICK: Op<PickFn> = Op {
    name: "pick",
    variants: &[
        Variant {
            name: BASELINE,
            f: pick_baseline,
        },
        Variant {
            name: OPTIMIZED,
            f: pick_optimized,
        },
    ],
};

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testdata::Rng;

    #[test]
    fn variants_agree_with_ties_and_specials() {
        let mut rng = Rng::new(51);
        for &nv in &[40525usize, 1000, 17, 1] {
            for trial in 0..6 {
                let mut l = rng.f32_vec_special(nv, 3.0);
                let ids: Vec<i32> = (0..nv as i32).map(|i| i * 3 + 1).collect();
                if trial == 1 && nv > 10 {
                    let m = l.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                    l[nv - 1] = m;
                    l[nv / 2] = m; // tie: the lower index must win
                }
                if trial == 2 {
                    l.iter_mut().for_each(|v| *v = -0.0);
                    l[nv - 1] = 0.0;
                }
                if trial == 3 {
                    l.iter_mut().for_each(|v| *v = f32::NEG_INFINITY);
                }
                if trial == 4 && nv > 3 {
                    l[2] = f32::NAN;
                }
                let a = pick_baseline(&l, &ids).unwrap();
                let b = pick_optimized(&l, &ids).unwrap();
                assert_eq!(a.index, b.index, "nv={nv} trial={trial}");
                assert_eq!(a.token, ids[a.index]);
                // The chosen value is a maximum, and no earlier index holds an equal value.
                let m = l
                    .iter()
                    .cloned()
                    .filter(|v| !v.is_nan())
                    .fold(f32::NEG_INFINITY, f32::max);
                assert!(a.value == m, "nv={nv} trial={trial}");
                assert!(l[..a.index].iter().all(|&v| v.is_nan() || v < m));
            }
        }
    }

    #[test]
    fn no_draft_ids_means_the_index_is_the_token() {
        let l = [0.5f32, 3.0, -1.0, 3.0];
        for f in [pick_baseline, pick_optimized] {
            let p = f(&l, &[]).unwrap();
            assert_eq!((p.index, p.token, p.value), (1, 1, 3.0));
        }
        // A map of the wrong length is still refused.
        assert!(pick_baseline(&l, &[7, 8]).is_err());
    }
}
