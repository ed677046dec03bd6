//! qwen4exp's own operations (the family layer of the backend boundary, DESIGN.md §2.1):
//! hyper-connection mix and combine, the GDN conv and recurrence, the QSA indexer's pooling and
//! selection and its sparse attention, and the PLE gate. The model calls them through this
//! trait; each backend implements them (the CPU's versions are the reference), and a backend's
//! fused or reordered version is a registered variant checked against the CPU's by the parity
//! harness.

use crate::backend::{AttnDims, Backend, ExpertWeights, KvType, StepInputs};
use crate::error::Result;
use crate::qwen4exp::weights::MoeW;

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

/// What a QSA layer's row preparation (spec §7.1–7.3) reads besides its rows: the q and k
/// norms (one head's values, shared by the heads), the indexer's when the layer selects, and
/// the RoPE geometry.
pub struct QsaPrepW<'a, W> {
    pub q_norm: &'a W,
    pub k_norm: &'a W,
    pub index: Option<QsaIndexW<'a, W>>,
    pub head_dim: usize,
    pub rot: usize,
    pub theta: f32,
    pub eps: f32,
}

/// The indexer's side of [`QsaPrepW`]: its norms, head size and block size (`ratio` tokens).
pub struct QsaIndexW<'a, W> {
    pub q_norm: &'a W,
    pub k_norm: &'a W,
    pub head_dim: usize,
    pub ratio: usize,
}

/// A QSA layer's projections of one sequence's rows: `[q | gate]` per head, keys, values, and
/// the indexer's queries and raw keys when the layer selects.
pub struct QsaRows<Buf> {
    pub qg: Buf,
    pub k: Buf,
    pub v: Buf,
    /// `(qi, kraw)`.
    pub index: Option<(Buf, Buf)>,
}

/// The stores a QSA layer's rows are written into: keys, values and, when the layer selects,
/// `(raw indexer keys, pooled blocks)`.
pub struct QsaCaches<'c, Buf> {
    pub k: &'c mut Buf,
    pub v: &'c mut Buf,
    pub index: Option<(&'c mut Buf, &'c mut Buf)>,
}

/// What the row preparation gives attention: the normed, rotated queries, the output gate (per
/// head, deinterleaved from `qg`) and, when the layer selects, the normed, rotated indexer
/// queries.
pub struct QsaPrepared<Buf> {
    pub q: Buf,
    pub gate: Buf,
    pub qi: Option<Buf>,
}

/// The operations only qwen4exp uses, over the core [`Backend`]'s buffers.
pub trait Qwen4expOps: Backend {
    /// QSA decisions: per row, the attended token positions.
    type Selection: Send + Sync;

    /// GatedResidual mix: the block input `u` and, when `hc.inject` is present, the stream
    /// weights `inj` (`2σ(W_inject·Xn / S)`).
    fn hc_mix(
        &self,
        hc: &HcWeights<'_, Self::Weight>,
        x: &Self::Buf,
    ) -> Result<(Self::Buf, Option<Self::Buf>)>;
    /// `X_s += inj_s · y` for every stream; with no `inj`, unit weights (`X_s += y`, the MTP
    /// head's `Y_s = fc_hidden·hn_s + e`).
    fn hc_combine(&self, x: &mut Self::Buf, y: &Self::Buf, inj: Option<&Self::Buf>) -> Result<()>;

    /// A block's combine and the next block's mix as one operation: [`Self::hc_combine`] of
    /// `y` into `x`, then [`Self::hc_mix`] of the updated `x` (this default). A backend may fuse
    /// them (the combine's output is the mix's norm input); the results keep the composed
    /// operations' bits.
    fn hc_combine_mix(
        &self,
        x: &mut Self::Buf,
        y: &Self::Buf,
        inj: Option<&Self::Buf>,
        hc: &HcWeights<'_, Self::Weight>,
    ) -> Result<(Self::Buf, Option<Self::Buf>)> {
        hc_combine_mix_composed(self, x, y, inj, hc)
    }
    /// The MoE block (spec §8) of the rows `u`: router logits → `route` (softmax, top
    /// `n_used`, renormalised) → the routed experts' weighted sum, plus the shared expert
    /// `down(silu(gate·u) ⊙ up·u)` gated by `σ(shexp_gate·u)`. This default is the composition
    /// of core operations; a backend may fuse it (one activation image for every product of
    /// `u`, the shared expert's add in the experts' epilogue) with the composed bits.
    fn moe_block(
        &self,
        mw: &MoeW<Self::Weight>,
        u: &Self::Buf,
        n_used: usize,
    ) -> Result<Self::Buf> {
        moe_block_composed(self, mw, u, n_used)
    }

    /// A QSA layer's rows between its projections and attention (spec §7.1–7.3), for one
    /// sequence's rows at `inputs`' positions: queries deinterleaved from their gates, normed
    /// and rotated; keys normed, rotated and written with the values; with the indexer, raw
    /// keys written, the blocks the rows complete pooled, normed, rotated at their first token
    /// and written, and the indexer queries normed and rotated. This default is the
    /// composition ([`qsa_prepare_composed`]); a backend may do it in fewer launches with the
    /// composed bits.
    fn qsa_prepare(
        &self,
        w: &QsaPrepW<'_, Self::Weight>,
        x: QsaRows<Self::Buf>,
        inputs: &StepInputs<Self>,
        caches: QsaCaches<'_, Self::Buf>,
    ) -> Result<QsaPrepared<Self::Buf>> {
        qsa_prepare_composed(self, w, x, inputs, caches)
    }
    /// [`Self::attend`], then the output gate: `attend(q, …) ⊙ σ(gate)` (spec §7.4). This
    /// default composes the two; a backend may gate in attention's last pass with the same
    /// bits.
    #[allow(clippy::too_many_arguments)]
    fn attend_gated(
        &self,
        q: &Self::Buf,
        gate: &Self::Buf,
        k_cache: &Self::Buf,
        v_cache: &Self::Buf,
        sel: &Self::Selection,
        dims: AttnDims,
        kv: KvType,
    ) -> Result<Self::Buf> {
        let a = self.attend(q, k_cache, v_cache, sel, dims, kv)?;
        self.mul_sigmoid(&a, gate)
    }

    /// Causal depthwise conv over rows (kernel `w` is `[channels, K]`, tap K−1 on the current
    /// row, taps `dilation` rows apart) continuing from `history` (the last `(K−1)·dilation`
    /// input rows, updated in place), then silu.
    fn conv1d_silu(
        &self,
        x: &Self::Buf,
        w: &Self::Weight,
        history: &mut Self::Buf,
        dilation: usize,
    ) -> Result<Self::Buf>;
    /// Gated DeltaNet recurrence over the rows in order, from the convolved `[q | k | v]` rows,
    /// the gate `z` and the `a`/`b` projections; updates `state` in place and returns the
    /// gated-norm output (value dim).
    fn gdn_step(
        &self,
        p: &GdnParams<'_, Self::Weight>,
        qkv: &Self::Buf,
        z: &Self::Buf,
        a: &Self::Buf,
        b: &Self::Buf,
        state: &mut Self::Buf,
    ) -> Result<Self::Buf>;
    /// Per row `r`, the mean of the `ratio` raw indexer keys of the block that the row at
    /// `positions[r]` completes (`(positions[r] + 1) % ratio == 0`); rows that complete no block
    /// give a row that is never stored (zeros on the CPU). `kraw` is the raw-key store, already
    /// holding this step's rows.
    fn qsa_pool_blocks(
        &self,
        kraw: &Self::Buf,
        positions: &Self::Ids,
        ratio: usize,
    ) -> Result<Self::Buf>;
    /// Block scores `Σ_h relu(<q_h, kb_b>) / sqrt(d)` over the `(positions[r] + 1) / ratio`
    /// complete blocks of the pooled store, and the attended tokens of each query row.
    fn qsa_select(
        &self,
        qi: &Self::Buf,
        blocks: &Self::Buf,
        positions: &Self::Ids,
        sel: QsaSelect,
    ) -> Result<Self::Selection>;
    /// Dense causal selection (an attention layer without an indexer).
    fn select_causal(&self, positions: &Self::Ids) -> Result<Self::Selection>;
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
    /// PLE gate: per stream `γ_s = σ(sign(z)·sqrt(max(|z|, 1e-6)))` with `z = <K_s, Q_s>/sqrt(H)`,
    /// returns `[γ_0·V, …, γ_{S−1}·V]`.
    fn ple_gate(
        &self,
        k: &Self::Buf,
        q: &Self::Buf,
        v: &Self::Buf,
        streams: usize,
    ) -> Result<Self::Buf>;
}

/// [`Qwen4expOps::hc_combine_mix`] as the composition of [`Qwen4expOps::hc_combine`] and
/// [`Qwen4expOps::hc_mix`] (the default, and the baseline a fused version keeps the bits of).
pub fn hc_combine_mix_composed<B: Qwen4expOps + ?Sized>(
    b: &B,
    x: &mut B::Buf,
    y: &B::Buf,
    inj: Option<&B::Buf>,
    hc: &HcWeights<'_, B::Weight>,
) -> Result<(B::Buf, Option<B::Buf>)> {
    b.hc_combine(x, y, inj)?;
    b.hc_mix(hc, x)
}

/// [`Qwen4expOps::moe_block`] as the composition of core operations (the default, and the
/// baseline a fused version keeps the bits of): every product of `u` (router, shared expert,
/// shared gate, the routed experts' gate and up) reads one prepared set of images of `u`.
pub fn moe_block_composed<B: Backend + ?Sized>(
    b: &B,
    mw: &MoeW<B::Weight>,
    u: &B::Buf,
    n_used: usize,
) -> Result<B::Buf> {
    let ux = b.prepare(
        b.copy(u)?,
        &[
            &mw.router,
            &mw.gate_shexp,
            &mw.up_shexp,
            &mw.shexp_gate,
            &mw.gate_exps,
            &mw.up_exps,
        ],
    )?;
    let [logits, g, up, gate] = b.matmuls_prepared(
        [&mw.router, &mw.gate_shexp, &mw.up_shexp, &mw.shexp_gate],
        &ux,
    )?;
    let routes = b.route(&logits, n_used)?;
    let experts = ExpertWeights {
        gate: &mw.gate_exps,
        up: &mw.up_exps,
        down: &mw.down_exps,
    };
    let mut y = b.moe_experts_prepared(&experts, &ux, &routes)?;
    let shared = b.matmul(&mw.down_shexp, &b.swiglu(&g, &up)?)?;
    b.add_sigmoid_gated(&mut y, &shared, &gate)?;
    Ok(y)
}

/// [`Qwen4expOps::qsa_prepare`] as the composition of operations (the default, and the baseline
/// a fused version keeps the bits of).
pub fn qsa_prepare_composed<B: Qwen4expOps + ?Sized>(
    b: &B,
    w: &QsaPrepW<'_, B::Weight>,
    x: QsaRows<B::Buf>,
    inputs: &StepInputs<B>,
    caches: QsaCaches<'_, B::Buf>,
) -> Result<QsaPrepared<B::Buf>> {
    let (hd, eps) = (w.head_dim, w.eps);
    let positions = &inputs.positions;
    let mut parts = b.deinterleave(&x.qg, hd, 2)?.into_iter();
    let (Some(q), Some(gate)) = (parts.next(), parts.next()) else {
        return Err(crate::error::EngineError::shape("qsa", "q/gate split"));
    };
    let mut q = b.rms_norm(&q, w.q_norm, hd, eps)?;
    b.rope_neox(&mut q, hd, w.rot, w.theta, positions)?;
    let (kraw, qi) = match x.index {
        Some((qi, kraw)) => (Some(kraw), Some(qi)),
        None => (None, None),
    };
    qsa_write_keys_composed(b, w, x.k, x.v, kraw, inputs, caches)?;
    let qi = match (qi, &w.index) {
        (Some(qi), Some(ix)) => {
            let mut qi = b.rms_norm(&qi, ix.q_norm, ix.head_dim, eps)?;
            b.rope_neox(&mut qi, ix.head_dim, w.rot, w.theta, positions)?;
            Some(qi)
        }
        _ => None,
    };
    Ok(QsaPrepared { q, gate, qi })
}

/// The cache side of [`qsa_prepare_composed`] (spec §7.1–7.3): keys normed, rotated and written
/// with the values at the rows' positions; with the indexer, raw keys written and the blocks
/// the rows complete pooled, normed, rotated at their first token and written at their slots.
/// What a row leaves in the caches depends on that row alone (and the raw keys before it).
pub fn qsa_write_keys_composed<B: Qwen4expOps + ?Sized>(
    b: &B,
    w: &QsaPrepW<'_, B::Weight>,
    k: B::Buf,
    v: B::Buf,
    kraw: Option<B::Buf>,
    inputs: &StepInputs<B>,
    caches: QsaCaches<'_, B::Buf>,
) -> Result<()> {
    let (hd, eps) = (w.head_dim, w.eps);
    let positions = &inputs.positions;
    let mut k = b.rms_norm(&k, w.k_norm, hd, eps)?;
    b.rope_neox(&mut k, hd, w.rot, w.theta, positions)?;
    b.write_rows(caches.k, &k, positions)?;
    b.write_rows(caches.v, &v, positions)?;
    let (Some(ix), Some(kraw), Some((kraw_store, block_store))) = (&w.index, kraw, caches.index)
    else {
        return Ok(());
    };
    let di = ix.head_dim;
    b.write_rows(kraw_store, &kraw, positions)?;
    let blocks = inputs.blocks(ix.ratio)?;
    let pooled = b.qsa_pool_blocks(kraw_store, positions, ix.ratio)?;
    let mut kb = b.rms_norm(&pooled, ix.k_norm, di, eps)?;
    b.rope_neox(&mut kb, di, w.rot, w.theta, &blocks.starts)?;
    b.write_rows(block_store, &kb, &blocks.slots)
}
