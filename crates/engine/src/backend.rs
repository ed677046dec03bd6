//! The backend boundary (DESIGN.md §2.1): the operations model code is written against, over
//! device-resident buffers. Model code never sees a device buffer's memory; it only moves host
//! data that is host data by nature (token ids, positions, n-gram row ids) across the boundary,
//! and reads results back with [`Backend::download`].
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

/// Geometry of a Gated DeltaNet layer (GGUF order: value heads tiled, head `h` uses key head
/// `h % n_k_heads`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GdnDims {
    pub n_k_heads: usize,
    pub n_v_heads: usize,
    pub head_k: usize,
    pub head_v: usize,
    pub conv_kernel: usize,
}

impl GdnDims {
    pub fn key_dim(&self) -> usize {
        self.n_k_heads * self.head_k
    }
    pub fn value_dim(&self) -> usize {
        self.n_v_heads * self.head_v
    }
    pub fn conv_dim(&self) -> usize {
        2 * self.key_dim() + self.value_dim()
    }
}

/// The per-head weights and constants a GDN step reads besides its projections.
pub struct GdnParams<'a, W> {
    /// `ssm_a` = −exp(A_log), one per value head.
    pub a: &'a W,
    /// `ssm_dt.bias`, one per value head.
    pub dt_bias: &'a W,
    /// Gated output norm weight (plain `w`), `head_v` values.
    pub norm: &'a W,
    pub dims: GdnDims,
    pub eps: f32,
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

/// Which tokens a QSA query attends to (DESIGN.md §3: the reference rule is the default).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum QsaRule {
    /// transformers / vLLM: the top `budget / ratio` complete blocks plus the incomplete tail.
    #[default]
    Reference,
    /// llama.cpp 0c1e570: every visible token takes its block's score, tail tokens +1e9, top
    /// `min(visible, budget + ratio − 1)` tokens by `std::partial_sort`.
    LlamaCpp,
}

impl std::str::FromStr for QsaRule {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "reference" => Ok(QsaRule::Reference),
            "llamacpp" | "llama.cpp" => Ok(QsaRule::LlamaCpp),
            _ => Err(format!(
                "unknown QSA rule '{s}'; expected 'reference' or 'llamacpp'"
            )),
        }
    }
}

/// How one QSA layer selects: block size, budget in tokens, rule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QsaSelect {
    pub ratio: usize,
    pub budget: usize,
    pub rule: QsaRule,
}

/// The four matrices of a hyper-connection module (the final mixer has no inject).
pub struct HcWeights<'a, W> {
    /// Grouped norm weight, `S·H` values, (1 + w) already folded by the converter.
    pub norm: &'a W,
    pub down: &'a W,
    pub up: &'a W,
    pub inject: Option<&'a W>,
    pub streams: usize,
    pub eps: f32,
}

/// The routed experts of one MoE layer: 3-D stacks, one `[rows, row_len]` slab per expert.
pub struct ExpertWeights<'a, W> {
    pub gate: &'a W,
    pub up: &'a W,
    pub down: &'a W,
}

/// The device operations of one forward step.
pub trait Backend: Send + Sync {
    type Buf: DeviceBuf;
    type Weight: DeviceWeight;
    /// Router decisions: per row, `(expert, weight)` in rank order.
    type Routes: Send + Sync;
    /// QSA decisions: per row, the attended token positions.
    type Selection: Send + Sync;

    fn name(&self) -> &'static str;
    fn supports(&self, ty: GgmlType, usage: Usage) -> bool;

    /// Make one tensor of the file device-resident (the file stays open while weights live).
    fn load_weight(&self, file: &Arc<GgufFile>, info: &TensorInfo) -> Result<Self::Weight>;

    // ---- buffers
    fn zeros(&self, rows: usize, cols: usize) -> Result<Self::Buf>;
    fn upload(&self, rows: usize, cols: usize, data: &[f32]) -> Result<Self::Buf>;
    fn download(&self, x: &Self::Buf) -> Result<Vec<f32>>;
    fn copy(&self, x: &Self::Buf) -> Result<Self::Buf>;
    /// Same elements, new row length (`rows·cols` unchanged).
    fn reshape(&self, x: Self::Buf, rows: usize, cols: usize) -> Result<Self::Buf>;
    fn append_rows(&self, dst: &mut Self::Buf, src: &Self::Buf) -> Result<()>;
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
    /// Split rows laid out as repeated `[part 0 (chunk) | part 1 (chunk) | ...]` into the parts
    /// (the per-head `[q | gate]` interleave of `attn_q`).
    fn deinterleave(&self, x: &Self::Buf, chunk: usize, parts: usize) -> Result<Vec<Self::Buf>>;
    fn add_assign(&self, x: &mut Self::Buf, y: &Self::Buf) -> Result<()>;

    // ---- the spec's blocks
    /// Embedding rows of `ids`, dequantized from any format, each repeated `copies` times along
    /// the row (the hyper-connection streams start as copies of the embedding).
    fn embed_rows(&self, table: &Self::Weight, ids: &[u32], copies: usize) -> Result<Self::Buf>;
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
    /// `matmul` restricted to the weight rows `rows` (output column `i` is row `rows[i]`), each
    /// entry bit-identical to the full product's: the draft vocabulary's rows of the LM head.
    fn matmul_rows(&self, w: &Self::Weight, rows: &[u32], x: &Self::Buf) -> Result<Self::Buf>;
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
        positions: &[u32],
    ) -> Result<()>;
    /// GatedResidual mix: the block input `u` and, when `hc.inject` is present, the stream
    /// weights `inj` (`2σ(W_inject·Xn / S)`).
    fn hc_mix(
        &self,
        hc: &HcWeights<'_, Self::Weight>,
        x: &Self::Buf,
    ) -> Result<(Self::Buf, Option<Self::Buf>)>;
    /// `X_s += inj_s · y` for every stream.
    fn hc_combine(&self, x: &mut Self::Buf, y: &Self::Buf, inj: &Self::Buf) -> Result<()>;
    /// Causal depthwise conv over rows (kernel `w` is `[channels, K]`, tap K−1 on the current
    /// row, taps `dilation` rows apart) continuing from `history` (the last `(K−1)·dilation`
    /// input rows, updated), then silu.
    fn conv1d_silu(
        &self,
        x: &Self::Buf,
        w: &Self::Weight,
        history: &mut Self::Buf,
        dilation: usize,
    ) -> Result<Self::Buf>;
    /// Gated DeltaNet recurrence over the rows in order, from the convolved `[q | k | v]` rows,
    /// the gate `z` and the `a`/`b` projections; returns the gated-norm output (value dim).
    fn gdn_step(
        &self,
        p: &GdnParams<'_, Self::Weight>,
        qkv: &Self::Buf,
        z: &Self::Buf,
        a: &Self::Buf,
        b: &Self::Buf,
        state: &mut Self::Buf,
    ) -> Result<Self::Buf>;
    /// Mean of `ratio` consecutive raw indexer keys for blocks `first..first + count`.
    fn qsa_pool_blocks(
        &self,
        kraw: &Self::Buf,
        first: usize,
        count: usize,
        ratio: usize,
    ) -> Result<Self::Buf>;
    /// Block scores `Σ_h relu(<q_h, kb_b>) / sqrt(d)` and the attended tokens of each query row.
    fn qsa_select(
        &self,
        qi: &Self::Buf,
        blocks: &Self::Buf,
        positions: &[u32],
        sel: QsaSelect,
    ) -> Result<Self::Selection>;
    /// Dense causal selection (an attention layer without an indexer).
    fn select_causal(&self, positions: &[u32]) -> Result<Self::Selection>;
    /// Softmax attention of each query row over its selected cached keys/values (GQA).
    fn attend(
        &self,
        q: &Self::Buf,
        k_cache: &Self::Buf,
        v_cache: &Self::Buf,
        sel: &Self::Selection,
        dims: AttnDims,
        kv: KvType,
    ) -> Result<Self::Buf>;
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
    /// `silu(g) ⊙ u`.
    fn swiglu(&self, g: &Self::Buf, u: &Self::Buf) -> Result<Self::Buf>;
    /// `y += σ(gate) · x`, `gate` one column per row.
    fn add_sigmoid_gated(&self, y: &mut Self::Buf, x: &Self::Buf, gate: &Self::Buf) -> Result<()>;
    /// PLE gate: per stream `γ_s = σ(sign(z)·sqrt(max(|z|, 1e-6)))` with `z = <K_s, Q_s>/sqrt(H)`,
    /// returns `[γ_0·V, …, γ_{S−1}·V]`.
    fn ple_gate(
        &self,
        k: &Self::Buf,
        q: &Self::Buf,
        v: &Self::Buf,
        streams: usize,
    ) -> Result<Self::Buf>;
    /// `x[r] += b` for every row: a projection's bias (`b` has `cols` values).
    fn add_bias(&self, x: &mut Self::Buf, b: &Self::Weight) -> Result<()>;
    /// Appends key or value rows to a dense cache, stored at the cache's precision (F16 rounds
    /// them once here, as an F16 cache holds them).
    fn append_kv(&self, cache: &mut Self::Buf, x: &Self::Buf, kv: KvType) -> Result<()>;
    /// Dense causal softmax attention (GQA): query row `r` attends to cache rows
    /// `0..=positions[r]`, which `append_kv` wrote at precision `kv` (with F16 the query and the
    /// probabilities take F16 values too).
    fn attend_causal(
        &self,
        q: &Self::Buf,
        k_cache: &Self::Buf,
        v_cache: &Self::Buf,
        positions: &[u32],
        dims: AttnDims,
        kv: KvType,
    ) -> Result<Self::Buf>;
    /// Runs `f`, a whole forward pass, with the backend's workers at hand: the CPU backend
    /// enters its thread pool once, so the operations inside do not each hand their work over
    /// to the pool and sleep until it is done.
    fn scoped<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        f()
    }
}
