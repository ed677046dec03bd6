//! The backend boundary (DESIGN.md §2.1): the operations model code is written against, over
//! device-resident buffers. Model code never sees a device buffer's memory; host data that is
//! host data by nature (token ids, positions, n-gram row ids, draft rows) enters once per step
//! as device inputs ([`StepInputs`], [`Backend::upload_ids`]), and results come back with
//! [`Backend::download`] after the step.
//!
//! **Capturable steps.** A forward pass runs inside [`Backend::step`], keyed by its shape. Inside
//! a step nothing is read back to the host and the host's control flow depends only on the key,
//! so a GPU backend can capture the step once and replay it with only its inputs rewritten:
//! - caches are fixed-capacity [`RowStore`]s written at device-given positions
//!   ([`Backend::write_rows`]); truncation sets a length on the host and moves no data;
//! - recurrent states (GDN, conv histories) are fixed-size buffers updated in place, and
//!   checkpoints are pre-allocated buffers filled with [`Backend::copy_into`];
//! - temporaries are whatever the operations return: a backend that captures serves them from a
//!   per-step arena, whose addresses repeat for the same key because the model allocates the same
//!   sequence of buffers for the same shape.
//!
//! **Two layers.** This trait holds the core operations every model uses; a model family's own
//! operations live beside the model (`qwen4exp::ops::Qwen4expOps`), so a backend implements the
//! core once and each family's operations where it has kernels for them.
//!
//! The operations sit at the granularity of the spec's blocks (and of the report's kernels), so a
//! backend may fuse freely inside one. Every operation works on a batch of rows (tokens) and must
//! give each row exactly the bits it would get in a batch of one: that is what makes prefill equal
//! to token-by-token decode (DESIGN.md §3, determinism 2) and a verify window equal to single steps.

use std::sync::Arc;

use strata_gguf::{GgufFile, TensorInfo};
use strata_quant::GgmlType;

use crate::error::{EngineError, Result};

/// A 2-D f32 activation buffer on the device: `rows` tokens (or heads, or blocks) of `cols`.
pub trait DeviceBuf: Send + Sync {
    fn rows(&self) -> usize;
    fn cols(&self) -> usize;
}

/// A vector of u32 on the device: a step's token ids, positions, n-gram rows or draft rows.
pub trait DeviceIds: Send + Sync {
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// What a step is, for a backend that captures steps: host control flow inside a step depends
/// on nothing else, so one capture per key can be replayed for every step with the same key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct StepKey {
    pub kind: StepKind,
    /// Rows (tokens) of the step.
    pub rows: usize,
    /// What the step returns or keeps besides its state updates (a model-defined bit set: the
    /// same rows with other outputs run different operations).
    pub outputs: u32,
    /// The sequence state the step updates ([`sequence_id`]): buffers a step returns (hidden
    /// states, replay logs) may outlive it, so a backend that reuses a step's temporaries keeps
    /// them apart per sequence.
    pub seq: u64,
}

/// A fresh id for a sequence state (unique in the process).
pub fn sequence_id() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum StepKind {
    /// The trunk over a prefill chunk, a decode token or a verify window.
    Forward,
    /// The MTP head over draft positions (a draft step or a catch-up).
    Draft,
    /// Re-running logged recurrences over the kept rows of a verify window.
    Replay,
}

/// A fixed-capacity cache of rows (K, V, raw indexer keys, pooled blocks): `cap` rows reserved
/// at creation, rows written at device-given positions, `len` the rows that are valid. Rolling
/// back sets `len`; no data moves and the buffer's address never changes.
pub struct RowStore<B: Backend + ?Sized> {
    pub buf: B::Buf,
    cap: usize,
    len: usize,
    what: &'static str,
}

impl<B: Backend + ?Sized> RowStore<B> {
    /// A store of `cap` rows of `cols` values, none valid yet (`what` names it in errors).
    pub fn new(b: &B, what: &'static str, cap: usize, cols: usize) -> Result<Self> {
        Ok(RowStore {
            buf: b.store(cap, cols)?,
            cap,
            len: 0,
            what,
        })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn capacity(&self) -> usize {
        self.cap
    }

    /// Refuses, before a step runs, a step that would write past the capacity.
    pub fn check_room(&self, end: usize) -> Result<()> {
        if end > self.cap {
            return Err(EngineError::ContextFull {
                what: self.what,
                needed: end,
                capacity: self.cap,
            });
        }
        Ok(())
    }

    /// Marks rows `0..len` valid (after a step wrote them, or to roll back).
    pub fn set_len(&mut self, len: usize) -> Result<()> {
        self.check_room(len)?;
        self.len = len;
        Ok(())
    }
}

/// A step's integer inputs, uploaded once before the step: the token ids, their positions, and
/// for each QSA block size the blocks the rows complete ([`Blocks`]). Model-specific inputs
/// (n-gram rows, draft rows) are uploaded beside it.
pub struct StepInputs<B: Backend + ?Sized> {
    pub tokens: B::Ids,
    pub positions: B::Ids,
    blocks: Vec<(usize, Blocks<B>)>,
    /// Host copies of the positions (host data by nature: the controller chose them).
    host_positions: Vec<u32>,
}

impl<B: Backend + ?Sized> StepInputs<B> {
    /// Inputs for `tokens` at positions `start..`, with block starts for each of `ratios`.
    pub fn new(b: &B, tokens: &[u32], start: usize, ratios: &[usize]) -> Result<Self> {
        Self::build(b, start, tokens.len(), ratios, |b| b.upload_ids(tokens))
    }

    /// Inputs for `n` tokens already on the device (entries `from..from + n` of `tokens`:
    /// the previous draft's pick, which never reached the host) at positions `start..`, with
    /// block starts for each of `ratios`. The tokens are copied into the step's own inputs (a
    /// view where the backend has one), so a replaying backend reads them at the step's
    /// addresses.
    pub fn with_tokens(
        b: &B,
        tokens: &B::Ids,
        from: usize,
        n: usize,
        start: usize,
        ratios: &[usize],
    ) -> Result<Self> {
        Self::build(b, start, n, ratios, |b| b.ids_range(tokens, from, n))
    }

    fn build(
        b: &B,
        start: usize,
        n: usize,
        ratios: &[usize],
        tokens: impl FnOnce(&B) -> Result<B::Ids>,
    ) -> Result<Self> {
        let host_positions: Vec<u32> = (start..start + n)
            .map(|p| {
                u32::try_from(p)
                    .map_err(|_| EngineError::Input(format!("position {p} is too large")))
            })
            .collect::<Result<_>>()?;
        let mut blocks: Vec<(usize, Blocks<B>)> = Vec::new();
        for &r in ratios {
            if r == 0 || blocks.iter().any(|(q, _)| *q == r) {
                continue;
            }
            blocks.push((r, Blocks::new(b, &host_positions, r)?));
        }
        Ok(StepInputs {
            tokens: tokens(b)?,
            positions: b.upload_ids(&host_positions)?,
            blocks,
            host_positions,
        })
    }

    /// Inputs for `tokens` at the given positions, which need not be consecutive: the rows of
    /// several sequences in one step (`crate::batch`), each sequence's own positions in turn.
    pub fn at_positions(
        b: &B,
        tokens: &[u32],
        positions: &[usize],
        ratios: &[usize],
    ) -> Result<Self> {
        if tokens.len() != positions.len() {
            return Err(EngineError::shape(
                "step inputs",
                format!("{} tokens at {} positions", tokens.len(), positions.len()),
            ));
        }
        let host_positions: Vec<u32> = positions
            .iter()
            .map(|&p| {
                u32::try_from(p)
                    .map_err(|_| EngineError::Input(format!("position {p} is too large")))
            })
            .collect::<Result<_>>()?;
        let mut blocks: Vec<(usize, Blocks<B>)> = Vec::new();
        for &r in ratios {
            if r == 0 || blocks.iter().any(|(q, _)| *q == r) {
                continue;
            }
            blocks.push((r, Blocks::new(b, &host_positions, r)?));
        }
        Ok(StepInputs {
            tokens: b.upload_ids(tokens)?,
            positions: b.upload_ids(&host_positions)?,
            blocks,
            host_positions,
        })
    }

    pub fn rows(&self) -> usize {
        self.host_positions.len()
    }

    /// Rows `start..start + len` of these inputs (device views where the backend has them: a
    /// step that splits its rows stays capturable).
    pub fn range(&self, b: &B, start: usize, len: usize) -> Result<Self> {
        let host_positions = self
            .host_positions
            .get(start..start + len)
            .ok_or_else(|| {
                EngineError::shape(
                    "step inputs",
                    format!("rows {start}..{} of {}", start + len, self.rows()),
                )
            })?
            .to_vec();
        let blocks = self
            .blocks
            .iter()
            .map(|(r, blk)| {
                Ok((
                    *r,
                    Blocks {
                        starts: b.ids_range(&blk.starts, start, len)?,
                        slots: b.ids_range(&blk.slots, start, len)?,
                    },
                ))
            })
            .collect::<Result<_>>()?;
        Ok(StepInputs {
            tokens: b.ids_range(&self.tokens, start, len)?,
            positions: b.ids_range(&self.positions, start, len)?,
            blocks,
            host_positions,
        })
    }

    /// The blocks of `ratio` tokens that the rows complete.
    pub fn blocks(&self, ratio: usize) -> Result<&Blocks<B>> {
        self.blocks
            .iter()
            .find(|(r, _)| *r == ratio)
            .map(|(_, blk)| blk)
            .ok_or_else(|| EngineError::shape("step inputs", format!("no blocks of {ratio}")))
    }

    pub fn host_positions(&self) -> &[u32] {
        &self.host_positions
    }
}

/// Where a step's rows complete pooled blocks of `ratio` tokens: per row, the first position of
/// the row's block (the block is rotated there) and the block's slot in the pooled store, or
/// `u32::MAX` when the row completes no block. Host data: it follows from the positions.
pub struct Blocks<B: Backend + ?Sized> {
    pub starts: B::Ids,
    pub slots: B::Ids,
}

impl<B: Backend + ?Sized> Blocks<B> {
    fn new(b: &B, positions: &[u32], ratio: usize) -> Result<Self> {
        let r = u32::try_from(ratio)
            .map_err(|_| EngineError::Input(format!("block size {ratio} is too large")))?;
        let starts: Vec<u32> = positions.iter().map(|&p| p - p % r).collect();
        let slots: Vec<u32> = positions
            .iter()
            .map(|&p| if (p + 1) % r == 0 { p / r } else { u32::MAX })
            .collect();
        Ok(Blocks {
            starts: b.upload_ids(&starts)?,
            slots: b.upload_ids(&slots)?,
        })
    }
}

/// A weight tensor on the device, kept in its file format.
pub trait DeviceWeight: Send + Sync {
    fn name(&self) -> &str;
    fn ty(&self) -> GgmlType;
    /// ggml `ne` order: `dims[0]` is the row length.
    fn dims(&self) -> &[u64];
}

/// How a weight is used; a backend says which formats it supports for each use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Usage {
    /// Dot products against activations quantized to the weight's `vec_dot_type`.
    MatMul,
    /// Rows gathered and dequantized (embeddings, the n-gram table).
    Rows,
    /// Read as f32 values (norm weights, conv kernels, per-head constants).
    Values,
}

impl Usage {
    pub fn describe(self) -> &'static str {
        match self {
            Usage::MatMul => "matrix products",
            Usage::Rows => "row gathers",
            Usage::Values => "element-wise use",
        }
    }
}

/// Attention geometry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnDims {
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
}

/// The precision attention reads keys and values at.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum KvType {
    #[default]
    F32,
    /// As an F16 cache holds them (llama.cpp's default cache type): keys, values, and the query
    /// and probabilities that meet them in F16 dot products, take F16 values.
    F16,
}

impl std::str::FromStr for KvType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "f32" => Ok(KvType::F32),
            "f16" => Ok(KvType::F16),
            _ => Err(format!("unknown KV type '{s}'; expected 'f32' or 'f16'")),
        }
    }
}

/// A token choice a backend can make from logits on the device, so that a speculative window
/// moves only token ids across the boundary (DESIGN.md §3: the same tokens as the host
/// sampler's for the same chain; chains with other stages stay on the host).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum DevicePick {
    /// The largest logit, ties to the lower id; a NaN logit is an error (`sampler::argmax`).
    Greedy,
    /// A draw from `softmax(logits / temperature)` with Philox keyed by (seed, position): the
    /// sampler chain `[temperature] → draw` (`temperature` 1 has no stage).
    Draw { seed: u64, temperature: f32 },
}

/// The draft vocabulary's id table on the device (draft index → full-vocabulary token id),
/// uploaded once per drafter: the rows of the LM head a draft computes
/// ([`Backend::matmul_rows`]) and the map of a draft pick ([`Backend::pick_draft_mapped`]).
/// Generic over the id buffer (not the backend) so that a backend wrapping another (a test's
/// recording backend) can hand it on.
pub struct DraftMap<I> {
    /// The ids on the host (the default methods' map), as given.
    pub host: Vec<u32>,
    /// The same ids as the catalogue's `pick` takes them.
    pub host_i32: Vec<i32>,
    pub dev: I,
}

impl<I> DraftMap<I> {
    /// The map of `ids` (each below `n_vocab`: checked, so a mapped pick can only produce
    /// valid token ids).
    pub fn new<B: Backend<Ids = I> + ?Sized>(b: &B, ids: &[u32], n_vocab: usize) -> Result<Self> {
        if ids.is_empty() {
            return Err(EngineError::Input(
                "draft vocabulary: no ids to map".to_string(),
            ));
        }
        if let Some(&bad) = ids.iter().find(|&&t| t as usize >= n_vocab) {
            return Err(EngineError::Input(format!(
                "draft vocabulary: token {bad} is outside the vocabulary of {n_vocab}"
            )));
        }
        let host_i32 = ids
            .iter()
            .map(|&t| {
                i32::try_from(t).map_err(|_| {
                    EngineError::Input(format!("draft vocabulary: token {t} is too large"))
                })
            })
            .collect::<Result<Vec<i32>>>()?;
        Ok(DraftMap {
            host: ids.to_vec(),
            host_i32,
            dev: b.upload_ids(ids)?,
        })
    }

    pub fn len(&self) -> usize {
        self.host.len()
    }

    pub fn is_empty(&self) -> bool {
        self.host.is_empty()
    }
}

/// What [`Backend::pick_draft_mapped`] returns: per row, the token id and the picked logit's
/// bits (as u32 ids, so both stay on the device beside the chain's other ids).
pub struct DraftPick<I> {
    pub ids: I,
    pub values: I,
}

/// Whether a draft pick's logit (its bits) leaves a draft: any value above −∞ (the host chain
/// ends at a draft whose every logit the edits removed).
pub fn draft_alive(value_bits: u32) -> bool {
    f32::from_bits(value_bits) > f32::NEG_INFINITY
}

/// Slop mode 1 on the draft logits as device tables (DESIGN.md §5; the catalogue's
/// `kernels::slop`, the report's `mtp_slop_pen`), made once per drafter and slop
/// configuration: the compiled configuration (the host code the default runs), the kernel's
/// tables through the draft vocabulary's inverse map, and those tables on the device (ids as
/// u32 holding the kernel's i32 bits; −1 is `u32::MAX`). Generic over the buffers, as
/// [`DraftMap`].
pub struct DraftSlop<I, F> {
    pub compiled: std::sync::Arc<crate::sampler::slop::CompiledSlop>,
    pub tables: crate::kernels::slop::SlopTables,
    /// Draft logits per row (the draft vocabulary's size).
    pub n_draft: usize,
    pub inverse: I,
    pub pen_ids: I,
    pub pen_vals: F,
    pub newline: I,
    pub blank: I,
    pub phrase_tokens: I,
    pub phrase_start: I,
    pub phrase_pen: F,
    /// No ids (the banned list, which mode 1 never reads).
    pub none: I,
    /// One id, −1: "no previous draft" for a kernel that reads the previous token from the
    /// device.
    pub no_prev: I,
}

impl<I, F> DraftSlop<I, F> {
    /// The tables of `compiled` (slop mode 1) for draft logits of `n_draft` values, `inverse`
    /// mapping each full id to its draft index or −1. Checked once here (the kernel's
    /// `SlopTables::validate`), so the per-draft operation checks only its state.
    pub fn new<B: Backend<Ids = I, Buf = F> + ?Sized>(
        b: &B,
        compiled: std::sync::Arc<crate::sampler::slop::CompiledSlop>,
        inverse: Vec<i32>,
        n_draft: usize,
    ) -> Result<Self> {
        if compiled.mode() != 1 {
            return Err(EngineError::Input(format!(
                "slop mode {} on the device: only mode 1 is a device operation",
                compiled.mode()
            )));
        }
        let tables = compiled.kernel_tables(inverse);
        tables
            .validate(n_draft)
            .map_err(|e| EngineError::Input(e.to_string()))?;
        let bits = |v: &[i32]| -> Vec<u32> { v.iter().map(|&x| x as u32).collect() };
        let vals = |v: &[f32]| b.upload(1, v.len(), v);
        Ok(DraftSlop {
            inverse: b.upload_ids(&bits(&tables.inverse))?,
            pen_ids: b.upload_ids(&bits(&tables.pen_ids))?,
            pen_vals: vals(&tables.pen_vals)?,
            newline: b.upload_ids(&bits(&tables.newline))?,
            blank: b.upload_ids(&bits(&tables.blank))?,
            phrase_tokens: b.upload_ids(&bits(&tables.phrase_tokens))?,
            phrase_start: b.upload_ids(&bits(&tables.phrase_start))?,
            phrase_pen: vals(&tables.phrase_pen)?,
            none: b.upload_ids(&[])?,
            no_prev: b.upload_ids(&[u32::MAX])?,
            compiled,
            tables,
            n_draft,
        })
    }

    /// The kernel's state array of `s` as the device holds it (u32 holding i32 bits).
    pub fn state_ids(s: &crate::sampler::slop::TokenState) -> Vec<u32> {
        crate::sampler::slop::CompiledSlop::kernel_state(s)
            .into_iter()
            .map(|x| x as u32)
            .collect()
    }

    /// The token state a device state array holds (mode 1: the runs; a malformed array is
    /// an error naming what is wrong).
    pub fn token_state(&self, state: &[u32]) -> Result<crate::sampler::slop::TokenState> {
        let st: Vec<i32> = state.iter().map(|&x| x as i32).collect();
        self.tables
            .validate_state(&st)
            .map_err(|e| EngineError::Input(e.to_string()))?;
        Ok(crate::sampler::slop::TokenState {
            newline_run: st[0],
            blank_run: st[1],
            matches: (0..st[2] as usize)
                .map(|i| (st[3 + 2 * i] as u32, st[4 + 2 * i] as u32))
                .collect(),
        })
    }
}

/// The routed experts of one MoE layer: 3-D stacks, one `[rows, row_len]` slab per expert.
pub struct ExpertWeights<'a, W> {
    pub gate: &'a W,
    pub up: &'a W,
    pub down: &'a W,
}

/// Activation rows on their way into matrix products: the f32 rows and the backend's images of
/// them in the formats the products' weights pair with (FORMATS.md), made once by
/// [`Backend::prepare`] or by the norm that produced the rows ([`Backend::rms_norm_prepared`]),
/// then read by every product of those rows ([`Backend::matmul_prepared`],
/// [`Backend::matmuls_prepared`], [`Backend::moe_experts_prepared`]).
///
/// The images are a cache with no meaning of their own: a product whose format has no image
/// quantizes the rows as [`Backend::matmul`] would, so every product of a `Prepared` has the
/// bits of the same product of `rows`.
pub struct Prepared<B: Backend + ?Sized> {
    pub rows: B::Buf,
    pub images: B::Images,
}

/// The core device operations: memory, steps, and the operations every model uses. A model
/// family's own operations are a trait beside the model (`qwen4exp::ops::Qwen4expOps`).
pub trait Backend: Send + Sync {
    type Buf: DeviceBuf;
    type Weight: DeviceWeight;
    type Ids: DeviceIds;
    /// Router decisions: per row, `(expert, weight)` in rank order.
    type Routes: Send + Sync;
    /// A buffer's activation images, the backend's half of [`Prepared`] (`()` for a backend
    /// whose products quantize their own input: the default methods).
    type Images: Send + Sync + Default;

    fn name(&self) -> &'static str;
    fn supports(&self, ty: GgmlType, usage: Usage) -> bool;
    /// Device memory in use (bytes), for a backend with memory of its own; None for the CPU.
    fn device_memory_used(&self) -> Option<u64> {
        None
    }

    /// Make one tensor of the file device-resident (the file stays open while weights live).
    fn load_weight(&self, file: &Arc<GgufFile>, info: &TensorInfo) -> Result<Self::Weight>;

    // ---- memory
    fn zeros(&self, rows: usize, cols: usize) -> Result<Self::Buf>;
    /// The buffer of a [`RowStore`]: `cap` rows of `cols` that [`Backend::write_rows`] fills. A
    /// backend may commit memory lazily (the CPU grows it as rows are written), but the rows
    /// it returns stay where they are.
    fn store(&self, cap: usize, cols: usize) -> Result<Self::Buf> {
        self.zeros(cap, cols)
    }
    fn upload(&self, rows: usize, cols: usize, data: &[f32]) -> Result<Self::Buf>;
    fn upload_ids(&self, ids: &[u32]) -> Result<Self::Ids>;
    /// Entries `start..start + len` of `ids` (a view where the device allows one).
    fn ids_range(&self, ids: &Self::Ids, start: usize, len: usize) -> Result<Self::Ids>;
    fn download(&self, x: &Self::Buf) -> Result<Vec<f32>>;
    fn download_ids(&self, ids: &Self::Ids) -> Result<Vec<u32>>;
    fn copy(&self, x: &Self::Buf) -> Result<Self::Buf>;
    /// `dst = src` (same shape): fills a pre-allocated checkpoint or restores from one.
    fn copy_into(&self, dst: &mut Self::Buf, src: &Self::Buf) -> Result<()>;
    /// Same elements, new row length (`rows·cols` unchanged).
    fn reshape(&self, x: Self::Buf, rows: usize, cols: usize) -> Result<Self::Buf>;
    /// The first `rows` rows of `x` (a temporary; stores are never truncated, see [`RowStore`]).
    fn truncate_rows(&self, dst: &mut Self::Buf, rows: usize) -> Result<()>;
    /// Columns `[start, start + len)` of every row.
    fn slice_cols(&self, x: &Self::Buf, start: usize, len: usize) -> Result<Self::Buf>;
    /// The last row as a buffer of its own (`x` itself when it has at most one row): the batch
    /// viewed as one long row, sliced.
    fn last_row(&self, x: Self::Buf) -> Result<Self::Buf> {
        let (n, cols) = (x.rows(), x.cols());
        if n <= 1 {
            return Ok(x);
        }
        let flat = self.reshape(x, 1, n * cols)?;
        self.slice_cols(&flat, (n - 1) * cols, cols)
    }
    /// `x`'s rows cut into consecutive parts of `lens` rows (summing to its rows): a batch's
    /// rows handed to each sequence's own work (`crate::batch`). The default views the rows
    /// as one long row and slices it, which copies each part once.
    fn split_rows(&self, x: Self::Buf, lens: &[usize]) -> Result<Vec<Self::Buf>> {
        let (n, cols) = (x.rows(), x.cols());
        if lens.iter().sum::<usize>() != n {
            return Err(EngineError::shape(
                "split_rows",
                format!("parts of {lens:?} rows of a buffer of {n}"),
            ));
        }
        if lens.len() == 1 {
            return Ok(vec![x]);
        }
        let flat = self.reshape(x, 1, n * cols)?;
        let mut start = 0;
        lens.iter()
            .map(|&len| {
                let part = self.slice_cols(&flat, start * cols, len * cols)?;
                start += len;
                self.reshape(part, len, cols)
            })
            .collect()
    }
    /// Split rows laid out as repeated `[part 0 (chunk) | part 1 (chunk) | ...]` into the parts
    /// (the per-head `[q | gate]` interleave of `attn_q`).
    fn deinterleave(&self, x: &Self::Buf, chunk: usize, parts: usize) -> Result<Vec<Self::Buf>>;
    /// Row `r` of `x` into row `at[r]` of a store's buffer; rows with `at[r]` = `u32::MAX` are
    /// skipped (a step's rows that complete no pooled block).
    fn write_rows(&self, store: &mut Self::Buf, x: &Self::Buf, at: &Self::Ids) -> Result<()>;
    /// [`Backend::write_rows`] of key or value rows into a dense cache, stored at the cache's
    /// precision (F16 rounds them once here, as an F16 cache holds them).
    fn write_kv(
        &self,
        cache: &mut Self::Buf,
        x: &Self::Buf,
        at: &Self::Ids,
        kv: KvType,
    ) -> Result<()>;

    /// Runs `f`, the body of one step (a forward pass, a draft step, a replay), keyed by its
    /// shape. The CPU runs it inside its thread pool (the operations inside do not each hand
    /// their work to the pool and sleep until it is done); a capturing backend records the body
    /// once per key and replays it; a re-encoding backend encodes it into one command stream.
    ///
    /// Step inputs (token ids, positions, n-gram rows) are uploaded inside the body, so a
    /// backend that replays a step knows them as the step's own.
    fn step<R: Send>(&self, key: StepKey, f: impl FnOnce() -> Result<R> + Send) -> Result<R> {
        let _ = key;
        f()
    }

    /// A point inside a step's body (the models call it after each layer) where a recording
    /// backend may hand the device what the body has recorded so far, so that the device runs
    /// it while the host records the rest. Changes nothing the step computes; the default does
    /// nothing.
    fn submit_part(&self) -> Result<()> {
        Ok(())
    }

    /// Whether a batch of sequences (`crate::batch`) runs as ONE step on this backend. A
    /// capturing backend keys its graphs by a step's shape, and a batch's shape changes as
    /// sequences join and leave, so the default is false: `forward_batch` then runs each
    /// sequence's rows as a step of its own (the same bits, the solo keys). The CPU says true.
    fn batches_sequences(&self) -> bool {
        false
    }

    // ---- operations
    fn add_assign(&self, x: &mut Self::Buf, y: &Self::Buf) -> Result<()>;
    /// Embedding rows of `ids`, dequantized from any format, each repeated `copies` times along
    /// the row (the hyper-connection streams start as copies of the embedding).
    fn embed_rows(&self, table: &Self::Weight, ids: &Self::Ids, copies: usize)
        -> Result<Self::Buf>;
    /// `y = W·x` per row; each activation row is quantized to the weight's `vec_dot_type` first.
    fn matmul(&self, w: &Self::Weight, x: &Self::Buf) -> Result<Self::Buf>;
    /// `[W_0·x, W_1·x, …]`: several products of one input, each bit-identical to `matmul(W_i,
    /// x)`. A backend may share work between them (the CPU backend quantizes `x` once per
    /// activation format instead of once per weight).
    fn matmuls<const N: usize>(
        &self,
        ws: [&Self::Weight; N],
        x: &Self::Buf,
    ) -> Result<[Self::Buf; N]> {
        let ys = ws
            .iter()
            .map(|w| self.matmul(w, x))
            .collect::<Result<Vec<_>>>()?;
        ys.try_into()
            .map_err(|_| EngineError::shape("matmuls", "product count"))
    }
    /// The images of `x`'s rows that products with the weights `ws` read (one per activation
    /// format among them). The default makes none: each product then quantizes its input.
    fn prepare_images(&self, x: &Self::Buf, ws: &[&Self::Weight]) -> Result<Self::Images> {
        let _ = (x, ws);
        Ok(Self::Images::default())
    }
    /// `x` with its images for products with `ws` ([`Backend::prepare_images`]).
    fn prepare(&self, x: Self::Buf, ws: &[&Self::Weight]) -> Result<Prepared<Self>> {
        let images = self.prepare_images(&x, ws)?;
        Ok(Prepared { rows: x, images })
    }
    /// [`Backend::rms_norm`] that also emits the images of its output for products with `ws`
    /// (the report's `rms_xprep`: a GPU writes the norm and the next product's quantized input
    /// in one pass). The default is the norm, then [`Backend::prepare`]
    /// ([`rms_norm_prepared_composed`]); the rows keep the norm's bits either way.
    fn rms_norm_prepared(
        &self,
        x: &Self::Buf,
        w: &Self::Weight,
        group: usize,
        eps: f32,
        ws: &[&Self::Weight],
    ) -> Result<Prepared<Self>> {
        rms_norm_prepared_composed(self, x, w, group, eps, ws)
    }
    /// The same rows viewed as `rows × cols` (as [`Backend::reshape`]); images the backend can
    /// view the same way come along, the others are dropped (the default drops them all).
    fn reshape_prepared(
        &self,
        x: Prepared<Self>,
        rows: usize,
        cols: usize,
    ) -> Result<Prepared<Self>> {
        Ok(Prepared {
            rows: self.reshape(x.rows, rows, cols)?,
            images: Self::Images::default(),
        })
    }
    /// `matmul(w, x.rows)`, bit for bit, reading the image of `w`'s format when `x` has one
    /// (the default ignores the images).
    fn matmul_prepared(&self, w: &Self::Weight, x: &Prepared<Self>) -> Result<Self::Buf> {
        self.matmul(w, &x.rows)
    }
    /// `matmuls(ws, x.rows)`, bit for bit, reading `x`'s images (the default ignores them).
    fn matmuls_prepared<const N: usize>(
        &self,
        ws: [&Self::Weight; N],
        x: &Prepared<Self>,
    ) -> Result<[Self::Buf; N]> {
        self.matmuls(ws, &x.rows)
    }
    /// `matmul` restricted to the weight rows `rows` (output column `i` is row `rows[i]`), each
    /// entry bit-identical to the full product's: the draft vocabulary's rows of the LM head.
    fn matmul_rows(&self, w: &Self::Weight, rows: &Self::Ids, x: &Self::Buf) -> Result<Self::Buf>;
    /// RMS norm over groups of `group` columns, then × `w` (either `cols` values, or `group`
    /// values broadcast over the groups, as for per-head norms).
    fn rms_norm(
        &self,
        x: &Self::Buf,
        w: &Self::Weight,
        group: usize,
        eps: f32,
    ) -> Result<Self::Buf>;
    /// NeoX rotation of the first `rot` dims of every `head_dim` head, row `r` at `positions[r]`.
    fn rope_neox(
        &self,
        x: &mut Self::Buf,
        head_dim: usize,
        rot: usize,
        theta: f32,
        positions: &Self::Ids,
    ) -> Result<()>;
    /// `x ⊙ σ(gate)`.
    fn mul_sigmoid(&self, x: &Self::Buf, gate: &Self::Buf) -> Result<Self::Buf>;
    /// Router body: fp32 softmax over the logits, top-k (ties to the lower index), renormalised.
    fn route(&self, logits: &Self::Buf, k: usize) -> Result<Self::Routes>;
    /// Σ_k w_k · down_e(silu(gate_e·x) ⊙ up_e·x) over each row's routed experts.
    fn moe_experts(
        &self,
        experts: &ExpertWeights<'_, Self::Weight>,
        x: &Self::Buf,
        routes: &Self::Routes,
    ) -> Result<Self::Buf>;
    /// `moe_experts(experts, x.rows, routes)`, bit for bit, the experts' gate and up products
    /// reading `x`'s images (the default ignores them).
    fn moe_experts_prepared(
        &self,
        experts: &ExpertWeights<'_, Self::Weight>,
        x: &Prepared<Self>,
        routes: &Self::Routes,
    ) -> Result<Self::Buf> {
        self.moe_experts(experts, &x.rows, routes)
    }
    /// `silu(g) ⊙ u`.
    fn swiglu(&self, g: &Self::Buf, u: &Self::Buf) -> Result<Self::Buf>;
    /// `y += σ(gate) · x`, `gate` one column per row.
    fn add_sigmoid_gated(&self, y: &mut Self::Buf, x: &Self::Buf, gate: &Self::Buf) -> Result<()>;
    /// `x[r] += b` for every row: a projection's bias (`b` has `cols` values).
    fn add_bias(&self, x: &mut Self::Buf, b: &Self::Weight) -> Result<()>;
    /// One token per row of `logits` chosen by `pick`, row `r` being the token at position
    /// `first_position + r` (the draw's Philox key): the speculative target's picks, so a
    /// verify window returns ids, not `rows × n_vocab` floats. The default downloads the logits
    /// and picks on the host (`sampler::pick_row`); a backend with a pick kernel overrides it.
    fn pick_rows(
        &self,
        logits: &Self::Buf,
        pick: DevicePick,
        first_position: u64,
    ) -> Result<Self::Ids> {
        pick_rows_on_host(self, logits, pick, first_position)
    }

    /// The draft chain's greedy pick of each row: the index of the largest draft logit (the
    /// catalogue's `pick`, the report's `mtp_pick`: ties to the lower index, NaN never chosen).
    /// The caller maps the index to a token through the draft vocabulary it holds on the host
    /// (so the default moves no draft-vocabulary table). The default downloads the logits and
    /// runs `kernels::pick::argmax` on the host.
    fn pick_draft(&self, logits: &Self::Buf) -> Result<Self::Ids> {
        let v = self.download(logits)?;
        let cols = logits.cols();
        if cols == 0 {
            return Err(EngineError::Input("pick: no draft logits".to_string()));
        }
        let ids: Vec<u32> = v
            .chunks(cols)
            .map(|row| crate::kernels::pick::argmax(row) as u32)
            .collect();
        self.upload_ids(&ids)
    }

    /// [`Backend::pick_draft`] mapped to full-vocabulary token ids on the device: through the
    /// draft vocabulary's table `map`, or the index itself (the full vocabulary), with the
    /// picked logit's bits beside each id (−∞ or NaN: every draft logit was removed, where the
    /// host chain stops). Every id it returns is a valid token by construction (the pick's
    /// index is below the row length, the map's entries were checked against the vocabulary
    /// when it was made: [`DraftMap::new`]), so the ids can feed the next draft step without
    /// reaching the host. The default downloads the logits and runs the catalogue's pick on
    /// the host ([`pick_draft_mapped_on_host`]).
    fn pick_draft_mapped(
        &self,
        logits: &Self::Buf,
        map: Option<&DraftMap<Self::Ids>>,
    ) -> Result<DraftPick<Self::Ids>> {
        pick_draft_mapped_on_host(self, logits, map)
    }

    /// Slop mode 1 on one row of draft logits, in place (the report's `mtp_slop_pen`; the
    /// catalogue's `kernels::slop` has the contract): the state array `state` (the kernel's,
    /// [`DraftSlop::state_ids`]) is first advanced by `prev`, the previous draft's token (a
    /// one-id buffer; None: the state is already current), then the penalties of the advanced
    /// state are applied through the inverse map; returns the advanced state. The default is
    /// the sampler's own host code (`CompiledSlop::advance`, then `DraftCursor::penalize_draft`:
    /// `Sampler::penalize_draft`'s semantics): the logits, the state and `prev` downloaded,
    /// edited, uploaded.
    fn slop_pen_draft(
        &self,
        logits: &mut Self::Buf,
        slop: &DraftSlop<Self::Ids, Self::Buf>,
        prev: Option<&Self::Ids>,
        state: &Self::Ids,
    ) -> Result<Self::Ids> {
        slop_pen_draft_on_host(self, logits, slop, prev, state)
    }

    /// `dst[at..at + src.len()] = src` (a draft chain's ids gathered for one download). The
    /// default goes through the host.
    fn write_ids(&self, dst: &mut Self::Ids, at: usize, src: &Self::Ids) -> Result<()> {
        let mut d = self.download_ids(dst)?;
        let s = self.download_ids(src)?;
        let slot = d.get_mut(at..at + s.len()).ok_or_else(|| {
            EngineError::shape(
                "write_ids",
                format!("{} ids at {at} of {}", s.len(), dst.len()),
            )
        })?;
        slot.copy_from_slice(&s);
        *dst = self.upload_ids(&d)?;
        Ok(())
    }

    /// Dense causal softmax attention (GQA): query row `r` attends to cache rows
    /// `0..=positions[r]`, which `write_kv` wrote at precision `kv` (with F16 the query and the
    /// probabilities take F16 values too).
    fn attend_causal(
        &self,
        q: &Self::Buf,
        k_cache: &Self::Buf,
        v_cache: &Self::Buf,
        positions: &Self::Ids,
        dims: AttnDims,
        kv: KvType,
    ) -> Result<Self::Buf>;
}

/// [`Backend::pick_rows`] on the host: the logits downloaded, each row picked by the host
/// sampler's code (`sampler::pick_row`), the ids uploaded (the default, and the path of a
/// backend for the picks it has no kernel for).
pub fn pick_rows_on_host<B: Backend + ?Sized>(
    b: &B,
    logits: &B::Buf,
    pick: DevicePick,
    first_position: u64,
) -> Result<B::Ids> {
    let v = b.download(logits)?;
    let cols = logits.cols();
    if cols == 0 {
        return Err(EngineError::Input("pick: no logits".to_string()));
    }
    let ids = v
        .chunks(cols)
        .enumerate()
        .map(|(r, row)| crate::sampler::pick_row(pick, row, first_position + r as u64))
        .collect::<Result<Vec<u32>>>()?;
    b.upload_ids(&ids)
}

/// [`Backend::pick_draft_mapped`] through the host: the logits downloaded, each row picked by
/// the catalogue's `pick` (`kernels::pick::pick_baseline`) with the map's host ids, the ids and
/// values uploaded (the default).
pub fn pick_draft_mapped_on_host<B: Backend + ?Sized>(
    b: &B,
    logits: &B::Buf,
    map: Option<&DraftMap<B::Ids>>,
) -> Result<DraftPick<B::Ids>> {
    let cols = logits.cols();
    if cols == 0 {
        return Err(EngineError::Input("pick: no draft logits".to_string()));
    }
    let v = b.download(logits)?;
    let table: &[i32] = map.map_or(&[], |m| &m.host_i32);
    let (mut ids, mut values) = (Vec::new(), Vec::new());
    for row in v.chunks(cols) {
        let p = crate::kernels::pick::pick_baseline(row, table)?;
        ids.push(
            u32::try_from(p.token).map_err(|_| {
                EngineError::shape("pick_draft_mapped", format!("index {}", p.index))
            })?,
        );
        values.push(p.value.to_bits());
    }
    Ok(DraftPick {
        ids: b.upload_ids(&ids)?,
        values: b.upload_ids(&values)?,
    })
}

/// [`Backend::slop_pen_draft`] on the host: the sampler's code on downloaded logits and state
/// (the default, and the reference a backend's kernel keeps the bits of).
pub fn slop_pen_draft_on_host<B: Backend + ?Sized>(
    b: &B,
    logits: &mut B::Buf,
    slop: &DraftSlop<B::Ids, B::Buf>,
    prev: Option<&B::Ids>,
    state: &B::Ids,
) -> Result<B::Ids> {
    if logits.rows() != 1 || logits.cols() != slop.n_draft {
        return Err(EngineError::shape(
            "slop_pen_draft",
            format!(
                "logits {}×{} for one row of {} draft logits",
                logits.rows(),
                logits.cols(),
                slop.n_draft
            ),
        ));
    }
    let mut s = slop.token_state(&b.download_ids(state)?)?;
    if let Some(p) = prev {
        let p = b.download_ids(p)?;
        let &[tok] = p.as_slice() else {
            return Err(EngineError::shape(
                "slop_pen_draft",
                format!("{} previous tokens, expected one", p.len()),
            ));
        };
        if tok as usize >= slop.tables.inverse.len() {
            return Err(EngineError::Input(format!(
                "slop_pen_draft: previous token {tok} is outside the vocabulary"
            )));
        }
        s = slop.compiled.advance(&s, tok);
    }
    let mut v = b.download(logits)?;
    crate::sampler::slop::DraftCursor::new(&slop.compiled, s.clone(), &[])
        .penalize_draft(&mut v, &slop.tables.inverse);
    *logits = b.upload(1, v.len(), &v)?;
    b.upload_ids(&DraftSlop::<B::Ids, B::Buf>::state_ids(&s))
}

/// [`Backend::rms_norm_prepared`] as the composition of [`Backend::rms_norm`] and
/// [`Backend::prepare`] (the default, and the baseline an override keeps the bits of).
pub fn rms_norm_prepared_composed<B: Backend + ?Sized>(
    b: &B,
    x: &B::Buf,
    w: &B::Weight,
    group: usize,
    eps: f32,
    ws: &[&B::Weight],
) -> Result<Prepared<B>> {
    let y = b.rms_norm(x, w, group, eps)?;
    b.prepare(y, ws)
}
