//! Loading a model for `run`, `chat` and `logits`: opening the GGUF, the checks a damaged file
//! must fail at load rather than mid-generation (an end-of-generation id outside the
//! vocabulary, a NaN in a norm weight), binding it by architecture on the backend `--backend`
//! chooses, and the context limit every command applies the same way.

use std::path::Path;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use strata_cuda::CudaBackend;
use strata_engine::generate::{Qwen2Session, Qwen4expSession, Session};
use strata_engine::{qwen2, qwen4exp, CpuBackend, KvType, Qwen4expOps};
use strata_wgpu::WgpuBackend;

use crate::args::backend::{BackendChoice, BackendKind, PrefillMode};
use strata_gguf::GgufFile;
use strata_tokenizer::Tokenizer;

/// The architectures strata runs, for error messages.
pub const SUPPORTED: &str = "qwen2 or qwen4exp";

/// A loaded model of any supported architecture on either backend, and what was chosen.
pub struct Loaded {
    pub model: Bound,
    /// Which backend runs it and why (`-v` prints it).
    pub backend_note: String,
}

/// A model bound to a backend.
pub enum Bound {
    Qwen2(Box<qwen2::Model<CpuBackend>>),
    Qwen4exp(Box<qwen4exp::Model<CpuBackend>>),
    Qwen2Cuda(Box<qwen2::Model<CudaBackend>>),
    Qwen4expCuda(Box<qwen4exp::Model<CudaBackend>>),
    Qwen2Wgpu(Box<qwen2::Model<WgpuBackend>>),
    Qwen4expWgpu(Box<qwen4exp::Model<WgpuBackend>>),
}

/// `$body` with `$m` bound to the model of any [`Bound`] variant (the commands are generic over
/// the backend; this is the one place the variants are listed).
macro_rules! each_model {
    ($bound:expr, $m:ident => $body:expr) => {
        match $bound {
            $crate::load::Bound::Qwen2($m) => $body,
            $crate::load::Bound::Qwen4exp($m) => $body,
            $crate::load::Bound::Qwen2Cuda($m) => $body,
            $crate::load::Bound::Qwen4expCuda($m) => $body,
            $crate::load::Bound::Qwen2Wgpu($m) => $body,
            $crate::load::Bound::Qwen4expWgpu($m) => $body,
        }
    };
}
pub(crate) use each_model;

/// A backend, opened as `--backend` and `--device` say.
pub enum Chosen {
    Cpu(CpuBackend),
    Cuda(Box<CudaBackend>),
    Wgpu(Box<WgpuBackend>),
}

/// Opens the backend `b` asks for; with `auto`, CUDA when it opens, else the CPU (the note
/// says why). `--backend cuda` without a usable GPU is an error naming what is missing.
pub fn open_backend(b: &BackendChoice, threads: usize) -> Result<(Chosen, String)> {
    let cpu = |why: String| -> Result<(Chosen, String)> {
        let c = CpuBackend::new(threads)?;
        let note = format!("{}{why}", cpu_note(&c));
        Ok((Chosen::Cpu(c), note))
    };
    match b.kind {
        BackendKind::Cpu => cpu(String::new()),
        BackendKind::Cuda => match CudaBackend::new(b.device) {
            Ok(c) => {
                let why = set_prefill(&c, b)?;
                let note = cuda_note(&c, why);
                Ok((Chosen::Cuda(Box::new(c)), note))
            }
            Err(e) => bail!(
                "--backend cuda: {e}{}",
                match e {
                    strata_cuda::CudaError::DriverMissing(_) =>
                        "\n(use --backend cpu, or run on a machine with an NVIDIA GPU and its driver)",
                    _ => "",
                }
            ),
        },
        BackendKind::Wgpu => {
            let sel = (b.device > 0).then(|| b.device.to_string());
            match WgpuBackend::new(sel.as_deref()) {
                Ok(w) => {
                    let note = format!("wgpu: {}", w.device().describe());
                    Ok((Chosen::Wgpu(Box::new(w)), note))
                }
                Err(e) => bail!("--backend wgpu: {e}"),
            }
        }
        BackendKind::Auto => match CudaBackend::new(b.device) {
            Ok(c) => {
                let why = set_prefill(&c, b)?;
                let note = format!("{} (auto)", cuda_note(&c, why));
                Ok((Chosen::Cuda(Box::new(c)), note))
            }
            Err(e) => cpu(format!(" (auto: no usable GPU: {e})")),
        },
    }
}

/// `--prefill` on an opened CUDA backend; fast without cuBLAS is an error naming it. Unset: the
/// backend's setting where `STRATA_CUDA_FAST_PREFILL` gives one, else fast where cuBLAS loads
/// and the backend does not batch sequences (a batch's rows equal their solo runs' only in the
/// exact mode), else exact, with the reason in the `-v` note.
fn set_prefill(c: &CudaBackend, b: &BackendChoice) -> Result<Option<String>> {
    use strata_engine::backend::Backend;
    if let Some(mode) = b.prefill {
        c.set_fast_prefill(mode == PrefillMode::Fast)
            .map_err(|e| anyhow::anyhow!("--prefill fast: {e}"))?;
        return Ok(None);
    }
    if strata_cuda::device::switch_given("STRATA_CUDA_FAST_PREFILL").is_some() {
        return Ok(None);
    }
    if c.batches_sequences() {
        return Ok(Some("exact prefill: sequences batch".into()));
    }
    Ok(match c.set_fast_prefill(true) {
        Ok(()) => None,
        Err(e) => Some(format!("exact prefill: the fast one needs cuBLAS ({e})")),
    })
}

fn cpu_note(c: &CpuBackend) -> String {
    // The catalogue variants chosen by STRATA_KERNELS, when any is not the default.
    let kernels = c
        .kernels()
        .non_default()
        .map(|k| format!(", kernels {k}"))
        .unwrap_or_default();
    format!("cpu ({} threads, {:?}{kernels})", c.threads(), c.isa())
}

fn cuda_note(c: &CudaBackend, why: Option<String>) -> String {
    let g = c.gpu();
    format!(
        "cuda:{} ({}, sm_{}{}, {} SMs{})",
        c.ordinal(),
        g.name,
        g.arch.0,
        g.arch.1,
        g.sms,
        if c.fast_prefill() {
            ", fast prefill (cuBLAS)".to_string()
        } else {
            format!(", {}", why.unwrap_or_else(|| "exact prefill".into()))
        }
    )
}

/// An opened model file that passed the load-time checks.
pub struct Opened {
    pub file: Arc<GgufFile>,
    pub arch: String,
}

/// Opens `path` and checks what can be checked without binding the model: a supported
/// architecture and finite norm weights.
pub fn open(path: &Path) -> Result<Opened> {
    crate::output::check_input("-m", path)?;
    let file = Arc::new(GgufFile::open(path)?);
    let arch = file.architecture()?.to_string();
    if arch != qwen2::ARCH && arch != qwen4exp::config::ARCH {
        bail!(
            "{}: architecture '{arch}' is not supported; expected {SUPPORTED}",
            path.display()
        );
    }
    check_norms(&file, path)?;
    Ok(Opened { file, arch })
}

/// A NaN or infinity in a norm weight turns every activation after it into NaN: the file is
/// damaged, and saying so at load beats a sampler error at the first token.
fn check_norms(file: &GgufFile, path: &Path) -> Result<()> {
    for t in file.tensors() {
        if !t.name.contains("norm") || t.dims.len() != 1 {
            continue;
        }
        let ty = file.tensor_type(t)?;
        let data = file.tensor_data(t)?;
        let mut v = vec![0f32; t.n_elements as usize];
        if strata_quant::dequantize(ty, data, &mut v).is_err() {
            continue; // a format problem: the model's own loader names it
        }
        if let Some(i) = v.iter().position(|x| !x.is_finite()) {
            bail!(
                "{}: tensor '{}' holds {} at element {i}: the file is damaged",
                path.display(),
                t.name,
                v[i]
            );
        }
    }
    Ok(())
}

/// The tokenizer of `file`, with the special ids the file states checked against the
/// vocabulary: an end-of-generation id outside it is refused (generation could never stop),
/// any other (BOS, padding) is warned about.
pub fn tokenizer(file: &GgufFile, path: &Path, n_vocab: usize) -> Result<Tokenizer> {
    let tok = Tokenizer::from_gguf(file)
        .with_context(|| format!("reading the tokenizer of {}", path.display()))?;
    let n = n_vocab.min(tok.n_vocab());
    for (key, v) in file.metadata() {
        let Some(what) = key
            .strip_prefix("tokenizer.ggml.")
            .and_then(|k| k.strip_suffix("_token_id"))
        else {
            continue;
        };
        let Some(id) = v.as_i128() else { continue };
        if (0..n as i128).contains(&id) {
            continue;
        }
        if matches!(what, "eos" | "eot" | "eom") {
            bail!(
                "{}: {key} = {id} is outside the vocabulary of {n} tokens (generation could \
                 never stop at it): the file is damaged",
                path.display()
            );
        }
        eprintln!(
            "warning: {}: {key} = {id} is outside the vocabulary of {n} tokens; it is ignored",
            path.display()
        );
    }
    Ok(tok)
}

/// Opens `path` and binds it as `choice` says, without an MTP head: the model and its
/// tokenizer (what `chat` loads).
pub fn model(path: &Path, choice: &crate::args::model::ModelChoice) -> Result<(Loaded, Tokenizer)> {
    model_with_mtp(path, choice, None)
}

/// [`model`] with an MTP head attached to a qwen4exp trunk (what `serve --mtp` loads).
pub fn model_with_mtp(
    path: &Path,
    choice: &crate::args::model::ModelChoice,
    mtp: Option<&Path>,
) -> Result<(Loaded, Tokenizer)> {
    let opened = open(path)?;
    let loaded = Loaded::bind(
        &opened,
        path,
        choice.threads,
        choice.kv_type,
        mtp,
        choice.ctx_size,
        &choice.backend,
    )?;
    let tok = tokenizer(&opened.file, path, loaded.n_vocab())?;
    Ok((loaded, tok))
}

impl Loaded {
    /// Binds an opened file on the backend `backend` chooses; `mtp` loads an MTP head beside a
    /// qwen4exp trunk. With `auto`, a file whose formats the GPU cannot run falls back to the
    /// CPU (the note says so).
    pub fn bind(
        o: &Opened,
        path: &Path,
        threads: usize,
        kv_type: KvType,
        mtp: Option<&Path>,
        ctx_size: Option<usize>,
        backend: &BackendChoice,
    ) -> Result<Loaded> {
        let (chosen, note) = open_backend(backend, threads)?;
        match chosen {
            Chosen::Cpu(b) => Ok(Loaded {
                model: bind_on(
                    o,
                    path,
                    b,
                    kv_type,
                    mtp,
                    ctx_size,
                    Bound::Qwen2,
                    Bound::Qwen4exp,
                )?,
                backend_note: note,
            }),
            Chosen::Wgpu(b) => Ok(Loaded {
                model: bind_on(
                    o,
                    path,
                    *b,
                    kv_type,
                    mtp,
                    ctx_size,
                    Bound::Qwen2Wgpu,
                    Bound::Qwen4expWgpu,
                )?,
                backend_note: note,
            }),
            Chosen::Cuda(b) => {
                let mem0 = b.mem_info().ok();
                let need = weight_bytes(o, mtp)?;
                if let Some((free, total)) = mem0 {
                    if let Err(why) = fits(need, free, total) {
                        let what = format!(
                            "{}: {why} on cuda:{} (placing part of a model in host memory is \
                             not supported yet: use a smaller quantization, or --backend cpu)",
                            path.display(),
                            b.ordinal()
                        );
                        if backend.kind != BackendKind::Auto {
                            bail!(what);
                        }
                        let cpu = CpuBackend::new(threads)?;
                        let note = format!("{} (auto: {what})", cpu_note(&cpu));
                        return Ok(Loaded {
                            model: bind_on(
                                o,
                                path,
                                cpu,
                                kv_type,
                                mtp,
                                ctx_size,
                                Bound::Qwen2,
                                Bound::Qwen4exp,
                            )?,
                            backend_note: note,
                        });
                    }
                }
                // A progress bar over the weights' bytes (drawn only on a terminal).
                let bar = indicatif::ProgressBar::new(need as u64).with_style(
                    indicatif::ProgressStyle::with_template(
                        "uploading weights {bar:30} {bytes}/{total_bytes} {bytes_per_sec}",
                    )
                    .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
                );
                let tick = bar.clone();
                b.on_upload(Some(Box::new(move |n| tick.inc(n as u64))));
                let bound = bind_on(
                    o,
                    path,
                    *b,
                    kv_type,
                    mtp,
                    ctx_size,
                    Bound::Qwen2Cuda,
                    Bound::Qwen4expCuda,
                );
                bar.finish_and_clear();
                match &bound {
                    Ok(Bound::Qwen2Cuda(m)) => m.backend().on_upload(None),
                    Ok(Bound::Qwen4expCuda(m)) => m.backend().on_upload(None),
                    _ => {}
                }
                match bound {
                    Ok(model) => {
                        let note = format!("{note}; {}", vram_note(&model, mem0));
                        Ok(Loaded {
                            model,
                            backend_note: note,
                        })
                    }
                    Err(e)
                        if backend.kind == BackendKind::Auto
                            && e.chain().any(|c| {
                                matches!(
                                    c.downcast_ref::<strata_engine::EngineError>(),
                                    Some(strata_engine::EngineError::UnsupportedType { .. })
                                )
                            }) =>
                    {
                        let cpu = CpuBackend::new(threads)?;
                        let why = format!(
                            "{} (auto: the GPU cannot run this file: {e:#})",
                            cpu_note(&cpu)
                        );
                        Ok(Loaded {
                            model: bind_on(
                                o,
                                path,
                                cpu,
                                kv_type,
                                mtp,
                                ctx_size,
                                Bound::Qwen2,
                                Bound::Qwen4exp,
                            )?,
                            backend_note: why,
                        })
                    }
                    Err(e) => Err(e),
                }
            }
        }
    }

    pub fn backend_name(&self) -> &'static str {
        each_model!(&self.model, m => strata_engine::Backend::name(m.backend()))
    }

    /// The CPU backend's thread count (None on a GPU).
    pub fn threads(&self) -> Option<usize> {
        match &self.model {
            Bound::Qwen2(m) => Some(m.backend().threads()),
            Bound::Qwen4exp(m) => Some(m.backend().threads()),
            _ => None,
        }
    }

    pub fn n_vocab(&self) -> usize {
        each_model!(&self.model, m => m.config().n_vocab)
    }

    /// The model's context: qwen2's trained length; for qwen4exp the capacity its caches were
    /// made with (`--ctx`, else the file's `context_length`, else 262,144).
    pub fn n_ctx_model(&self) -> usize {
        match &self.model {
            Bound::Qwen2(m) => m.config().n_ctx_train,
            Bound::Qwen2Cuda(m) => m.config().n_ctx_train,
            Bound::Qwen2Wgpu(m) => m.config().n_ctx_train,
            Bound::Qwen4exp(m) => m.config().n_ctx,
            Bound::Qwen4expCuda(m) => m.config().n_ctx,
            Bound::Qwen4expWgpu(m) => m.config().n_ctx,
        }
    }

    pub fn session(&self, n_ctx: usize) -> Result<Box<dyn Session + '_>> {
        let inner: Box<dyn Session + '_> = match &self.model {
            Bound::Qwen2(m) => Box::new(Qwen2Session::new(m)?),
            Bound::Qwen4exp(m) => Box::new(Qwen4expSession::new(m)?),
            Bound::Qwen2Cuda(m) => Box::new(Qwen2Session::new(m)?),
            Bound::Qwen4expCuda(m) => Box::new(Qwen4expSession::new(m)?),
            Bound::Qwen2Wgpu(m) => Box::new(Qwen2Session::new(m)?),
            Bound::Qwen4expWgpu(m) => Box::new(Qwen4expSession::new(m)?),
        };
        Ok(Box::new(Limited { inner, n_ctx }))
    }

    pub fn describe(&self) -> String {
        match &self.model {
            Bound::Qwen2(m) => describe_qwen2(m),
            Bound::Qwen2Cuda(m) => describe_qwen2(m),
            Bound::Qwen2Wgpu(m) => describe_qwen2(m),
            Bound::Qwen4exp(m) => describe_qwen4exp(m),
            Bound::Qwen4expCuda(m) => describe_qwen4exp(m),
            Bound::Qwen4expWgpu(m) => describe_qwen4exp(m),
        }
    }
}

fn describe_qwen2<B: strata_engine::Backend>(m: &qwen2::Model<B>) -> String {
    let c = m.config();
    format!(
        "qwen2, {} layers, {} embd, {} heads / {} kv heads, vocab {}{}",
        c.n_layer,
        c.n_embd,
        c.attn.n_head,
        c.attn.n_head_kv,
        c.n_vocab,
        if m.tied_output() { ", tied head" } else { "" }
    )
}

fn describe_qwen4exp<B: Qwen4expOps>(m: &qwen4exp::Model<B>) -> String {
    let c = m.config();
    format!(
        "qwen4exp, {} layers, {} embd, vocab {}",
        c.n_layer, c.n_embd, c.n_vocab
    )
}

/// The weights' bytes of a file (and of an MTP head file beside it): what a GPU load uploads.
fn weight_bytes(o: &Opened, mtp: Option<&Path>) -> Result<usize> {
    let mut n: u64 = o.file.tensors().iter().map(|t| t.n_bytes).sum();
    if let Some(p) = mtp {
        let f = strata_gguf::GgufFile::open(p)
            .with_context(|| format!("opening the MTP head {}", p.display()))?;
        n += f.tensors().iter().map(|t| t.n_bytes).sum::<u64>();
    }
    Ok(n as usize)
}

/// Whether weights of `need` bytes fit a device with `free` of `total` bytes free, with room
/// left for the caches and scratch (1 GiB, or 5 % of the device): else the numbers, as words.
fn fits(need: usize, free: usize, total: usize) -> std::result::Result<(), String> {
    let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
    let reserve = (1usize << 30).max(total / 20);
    if need.saturating_add(reserve) <= free {
        return Ok(());
    }
    Err(format!(
        "the weights need {:.2} GiB and the caches and scratch about {:.2} GiB more; the \
         device has {:.2} GiB free of {:.2} GiB",
        gib(need),
        gib(reserve),
        gib(free),
        gib(total)
    ))
}

/// What a CUDA model holds on the device: its weights, and what the load took of the memory.
fn vram_note(model: &Bound, before: Option<(usize, usize)>) -> String {
    let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
    let size = |b: usize| {
        if b >= 1 << 30 {
            format!("{:.2} GiB", gib(b))
        } else {
            format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64)
        }
    };
    let (weights, host, after) = match model {
        Bound::Qwen2Cuda(m) => {
            let b = m.backend();
            (b.weight_bytes(), b.host_weight_bytes(), b.mem_info().ok())
        }
        Bound::Qwen4expCuda(m) => {
            let b = m.backend();
            (b.weight_bytes(), b.host_weight_bytes(), b.mem_info().ok())
        }
        _ => return String::new(),
    };
    let host = if host > 0 {
        format!("; the PLE table ({}) in mapped host memory", size(host))
    } else {
        String::new()
    };
    let note = match (before, after) {
        (Some((f0, total)), Some((f1, _))) => format!(
            "weights {} on the device (the load took {}; {:.1} of {:.1} GiB free)",
            size(weights),
            size(f0.saturating_sub(f1)),
            gib(f1),
            gib(total)
        ),
        _ => format!("weights {} on the device", size(weights)),
    };
    format!("{note}{host}")
}

/// Binds `o` on backend `b` as its architecture says (`q2`/`q4` wrap the model).
#[allow(clippy::too_many_arguments)]
fn bind_on<B: Qwen4expOps>(
    o: &Opened,
    path: &Path,
    backend: B,
    kv_type: KvType,
    mtp: Option<&Path>,
    ctx_size: Option<usize>,
    q2: impl FnOnce(Box<qwen2::Model<B>>) -> Bound,
    q4: impl FnOnce(Box<qwen4exp::Model<B>>) -> Bound,
) -> Result<Bound> {
    Ok(match o.arch.as_str() {
        qwen2::ARCH => {
            if mtp.is_some() {
                bail!(
                    "MTP speculation needs a qwen4exp model; {} is qwen2",
                    path.display()
                );
            }
            q2(Box::new(
                qwen2::Model::from_file(o.file.clone(), backend, &qwen2::LoadOptions { kv_type })
                    .with_context(|| format!("loading {}", path.display()))?,
            ))
        }
        _ => {
            // qwen4exp caches are sized at load: `--ctx` sets their capacity.
            let opts = qwen4exp::LoadOptions {
                kv_type,
                ctx: ctx_size,
                ..Default::default()
            };
            let mut model = qwen4exp::Model::from_file(o.file.clone(), backend, &opts)
                .with_context(|| format!("loading {}", path.display()))?;
            for w in model.warnings() {
                eprintln!("warning: {w}");
            }
            if let Some(p) = mtp {
                model
                    .load_mtp(p)
                    .with_context(|| format!("loading the MTP head {}", p.display()))?;
            }
            q4(Box::new(model))
        }
    })
}

/// A session whose context is `--ctx-size` (at most the model's): the generation loop stops
/// at it as at the model's own.
struct Limited<'m> {
    inner: Box<dyn Session + 'm>,
    n_ctx: usize,
}

impl Session for Limited<'_> {
    fn n_vocab(&self) -> usize {
        self.inner.n_vocab()
    }
    fn n_ctx(&self) -> usize {
        self.n_ctx.min(self.inner.n_ctx())
    }
    fn tokens(&self) -> &[u32] {
        self.inner.tokens()
    }
    fn feed(&mut self, tokens: &[u32]) -> strata_engine::Result<Vec<f32>> {
        self.inner.feed(tokens)
    }
    fn rewind(&mut self, pos: usize) -> strata_engine::Result<()> {
        self.inner.rewind(pos)
    }
    fn feed_picked(
        &mut self,
        tokens: &[u32],
        pick: strata_engine::backend::DevicePick,
    ) -> strata_engine::Result<Option<u32>> {
        self.inner.feed_picked(tokens, pick)
    }
}

/// The context a command runs in: `--ctx`, at most the model's.
pub fn n_ctx(requested: Option<usize>, model: usize) -> Result<usize> {
    match requested {
        Some(n) if n > model => {
            bail!("--ctx {n}: out of range; the model's context holds {model} positions")
        }
        Some(n) => Ok(n),
        None => Ok(model),
    }
}

/// One rule for every command (`run`, `chat`, `logits`): a prompt must leave at least one
/// position of the context free, for the token that follows it.
pub fn check_context(what: &str, n_tokens: usize, n_ctx: usize) -> Result<()> {
    if n_tokens == 0 {
        bail!("{what} has no tokens");
    }
    if n_tokens >= n_ctx {
        bail!(
            "{what} has {n_tokens} tokens; the context holds {n_ctx} positions, so a prompt may \
             have at most {} (one is left for the next token)",
            n_ctx - 1
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::fits;

    const GIB: usize = 1 << 30;

    /// A model fits when its weights and the reserve for caches and scratch fit the free
    /// memory; otherwise the refusal gives the numbers (need, reserve, free, total).
    #[test]
    fn a_model_that_does_not_fit_is_refused_with_the_numbers() {
        assert!(fits(35 * GIB, 104 * GIB, 140 * GIB).is_ok());
        // 38 GiB of weights on a 40 GiB card with 39 GiB free: 2 GiB (5 %) kept for caches.
        let e = fits(38 * GIB, 39 * GIB, 40 * GIB).unwrap_err();
        assert!(e.contains("38.00 GiB"), "{e}");
        assert!(e.contains("2.00 GiB"), "{e}");
        assert!(e.contains("39.00 GiB free of 40.00 GiB"), "{e}");
        // A small card: the reserve is at least 1 GiB.
        assert!(fits(7 * GIB + 1, 8 * GIB, 8 * GIB).is_err());
        assert!(fits(7 * GIB, 8 * GIB, 8 * GIB).is_ok());
        assert!(fits(6 * GIB, 8 * GIB - 1, 8 * GIB).is_ok());
        assert!(fits(usize::MAX, 8 * GIB, 8 * GIB).is_err());
    }
}
