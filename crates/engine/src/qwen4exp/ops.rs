//! qwen4exp's own operations (the family layer of the backend boundary, DESIGN.md §2.1):
//! hyper-connection mix and combine, the GDN conv and recurrence, the QSA indexer's pooling and
//! selection and its sparse attention, and the PLE gate. The model calls them through this
//! trait; each backend implements them (the CPU's versions are the reference), and a backend's
//! fused or reordered version is a registered variant checked against the CPU's by the parity
//! harness.

use crate::backend::{AttnDims, Backend, ExpertWeights, KvType};
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
