//! Per-sequence state (DESIGN.md §2.2): QSA layers' K/V (post-norm, post-RoPE), raw indexer keys
//! and pooled block keys; GDN layers' fp32 recurrent state and conv history; the PLE conv history;
//! the token history the n-gram hash reads. Caches are fixed-capacity stores written at each
//! token's position and rolled back by setting their length; recurrent states are fixed-size
//! buffers updated in place and rolled back by restoring a [`Checkpoint`].

use crate::backend::{Backend, RowStore};
use crate::error::Result;

pub(crate) struct AttnCache<B: Backend> {
    pub k: RowStore<B>,
    pub v: RowStore<B>,
    /// Raw indexer keys, one row per token (no norm, no RoPE).
    pub kraw: RowStore<B>,
    /// Pooled, normed, rotated block keys, one row per complete block.
    pub blocks: RowStore<B>,
}

impl<B: Backend> AttnCache<B> {
    /// Stores for `cap` positions of `kv`-wide keys/values and `di`-wide indexer keys.
    pub fn new(b: &B, cap: usize, kv: usize, di: usize) -> Result<Self> {
        Ok(AttnCache {
            k: RowStore::new(b, "the attention K cache", cap, kv)?,
            v: RowStore::new(b, "the attention V cache", cap, kv)?,
            kraw: RowStore::new(b, "the indexer key cache", cap, di)?,
            blocks: RowStore::new(b, "the pooled block cache", cap, di)?,
        })
    }

    /// The stores as [`super::ops::Qwen4expOps::qsa_prepare`] writes them.
    pub fn stores(&mut self) -> super::ops::QsaCaches<'_, B::Buf> {
        super::ops::QsaCaches {
            k: &mut self.k.buf,
            v: &mut self.v.buf,
            index: Some((&mut self.kraw.buf, &mut self.blocks.buf)),
        }
    }

    /// Refuses, before a step, a step that would end past the capacity.
    pub fn check_room(&self, end: usize) -> Result<()> {
        self.k.check_room(end)
    }

    /// Every store holds the first `pos` positions (and the blocks they complete).
    pub fn set_len(&mut self, pos: usize, ratio: Option<usize>) -> Result<()> {
        self.k.set_len(pos)?;
        self.v.set_len(pos)?;
        match ratio {
            Some(r) => {
                self.kraw.set_len(pos)?;
                self.blocks.set_len(pos / r)
            }
            None => Ok(()),
        }
    }
}

pub(crate) enum LayerState<B: Backend> {
    Gdn {
        /// The last `K − 1` raw `[q | k | v]` projection rows.
        conv: B::Buf,
        /// `[n_v_heads, head_k · head_v]`, fp32.
        s: B::Buf,
    },
    Attn(AttnCache<B>),
}

/// One sequence's state: create with `Model::new_state`, advance with `Model::forward`.
pub struct State<B: Backend> {
    /// The sequence's id in step keys (`backend::sequence_id`).
    pub(crate) id: u64,
    pub(crate) pos: usize,
    pub(crate) tokens: Vec<u32>,
    pub(crate) layers: Vec<LayerState<B>>,
    /// The last `(K − 1) · dilation` rows of the PLE conv input.
    pub(crate) ple_conv: Option<B::Buf>,
}

impl<B: Backend> State<B> {
    /// Tokens consumed so far (the position of the next token).
    pub fn position(&self) -> usize {
        self.pos
    }

    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }
}

/// What a roll-back needs: the position and copies of every recurrent state at that point.
pub struct Checkpoint<B: Backend> {
    pub(crate) pos: usize,
    /// Per layer: the GDN conv history and state (None for attention layers).
    pub(crate) recurrent: Vec<Option<(B::Buf, B::Buf)>>,
    pub(crate) ple_conv: Option<B::Buf>,
}

impl<B: Backend> Checkpoint<B> {
    pub fn position(&self) -> usize {
        self.pos
    }
}

/// Everything one GDN layer's recurrence read during a logged forward: the raw projection rows
/// (the conv history's input), the convolved `[q | k | v]`, the gate and the `a`/`b` rows.
pub(crate) struct GdnRecord<B: Backend> {
    pub raw: B::Buf,
    pub qkv: B::Buf,
    pub z: B::Buf,
    pub alpha: B::Buf,
    pub beta: B::Buf,
}

/// The inputs of every recurrent update of one forward call (a verify window), so that a prefix
/// of its tokens can be kept without running the trunk again: restore the checkpoint taken
/// before the window, then re-run only the recurrences over the kept rows (no matrix products).
/// The buffers are the ones the forward computed anyway, kept rather than copied.
pub struct ReplayLog<B: Backend> {
    pub(crate) gdn: Vec<Option<GdnRecord<B>>>,
    pub(crate) ple: Option<B::Buf>,
}

impl<B: Backend> Default for ReplayLog<B> {
    fn default() -> Self {
        ReplayLog {
            gdn: Vec::new(),
            ple: None,
        }
    }
}

impl<B: Backend> ReplayLog<B> {
    pub fn new() -> Self {
        Self::default()
    }

    pub(crate) fn reset(&mut self, n_layer: usize) {
        self.gdn.clear();
        self.gdn.resize_with(n_layer, || None);
        self.ple = None;
    }
}
