//! The whole model on the CUDA backend (`qwen4exp::Model<CudaBackend>`, `qwen2::Model<CudaBackend>`):
//! logits against transformers' goldens within the CPU tests' bounds, the CUDA/CPU agreement,
//! prefill rows equal to single steps bit for bit, verify-window rows equal to single rows, and
//! greedy speculative decoding equal to plain decoding on the device.
//!
//! Without a GPU every test says so and passes (set `STRATA_REQUIRE_GPU=1` to make that a
//! failure, as the device runs do). Fixture paths: `STRATA_FIXTURES` (the repository's
//! `fixtures/`) and `STRATA_SMALL_FIXTURES` (`../shared/fixtures/qwen4exp/small`) override the
//! defaults, for runs on a machine where the checkout lives elsewhere.

use std::path::PathBuf;
use std::sync::Arc;

use safetensors::{Dtype, SafeTensors};
use strata_cuda::{CudaBackend, CudaError};
use strata_engine::qwen4exp::{BatchItem, LoadOptions, Model, Want};
use strata_engine::speculative::{run, SpecConfig, SpecDecoder};
use strata_engine::{CpuBackend, KvType, QsaRule, Qwen4expOps};
use strata_gguf::GgufFile;

fn gpu() -> Option<CudaBackend> {
    match CudaBackend::new(0) {
        Ok(b) => Some(b),
        Err(e @ (CudaError::DriverMissing(_) | CudaError::NvrtcMissing(_)))
            if std::env::var_os("STRATA_REQUIRE_GPU").is_none() =>
        {
            eprintln!("SKIP: no usable GPU here ({e})");
            None
        }
        Err(e) => panic!("CUDA backend: {e}"),
    }
}

fn fixtures() -> PathBuf {
    std::env::var_os("STRATA_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures"))
}

fn tiny(file: &str) -> PathBuf {
    fixtures().join("qwen4exp/tiny").join(file)
}

fn small_dir() -> Option<PathBuf> {
    let d = std::env::var_os("STRATA_SMALL_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("../../../shared/fixtures/qwen4exp/small")
        });
    if d.join("golden.safetensors").exists() {
        Some(d)
    } else {
        eprintln!("SKIP: {} not found (the small fixtures)", d.display());
        None
    }
}

struct Golden(Vec<u8>);

impl Golden {
    fn open(p: PathBuf) -> Golden {
        Golden(std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display())))
    }
    fn f32(&self, name: &str) -> (Vec<usize>, Vec<f32>) {
        let st = SafeTensors::deserialize(&self.0).unwrap();
        let t = st.tensor(name).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(t.dtype(), Dtype::F32);
        let v = t
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        (t.shape().to_vec(), v)
    }
    fn ids(&self, name: &str) -> Vec<u32> {
        let st = SafeTensors::deserialize(&self.0).unwrap();
        let t = st.tensor(name).unwrap();
        assert_eq!(t.dtype(), Dtype::I64);
        t.data()
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as u32)
            .collect()
    }
}

fn argmax(v: &[f32]) -> usize {
    let mut b = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[b] {
            b = i;
        }
    }
    b
}

/// (max |Δ|, mean |Δ|, max |want|, rows whose argmax differs).
fn diff(got: &[f32], want: &[f32], cols: usize) -> (f32, f32, f32, usize) {
    assert_eq!(got.len(), want.len());
    let mut mx = 0f32;
    let mut sum = 0f64;
    for (a, b) in got.iter().zip(want) {
        let d = (a - b).abs();
        assert!(d.is_finite(), "non-finite value");
        mx = mx.max(d);
        sum += d as f64;
    }
    let mref = want.iter().fold(0f32, |m, x| m.max(x.abs()));
    let rows = want.len() / cols;
    let mism = (0..rows)
        .filter(|&r| {
            argmax(&got[r * cols..(r + 1) * cols]) != argmax(&want[r * cols..(r + 1) * cols])
        })
        .count();
    (mx, (sum / want.len() as f64) as f32, mref, mism)
}

fn logits<B: Qwen4expOps>(m: &Model<B>, tokens: &[u32]) -> Vec<f32> {
    let mut st = m.new_state().unwrap();
    m.forward_with(&mut st, tokens, Want::default())
        .unwrap()
        .logits
}

fn load<B: Qwen4expOps>(path: &std::path::Path, b: B, opts: &LoadOptions) -> Model<B> {
    Model::load(path, b, opts).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Attaches the tiny fixture's real MTP head (converted from the checkpoint beside it).
fn attach_tiny_head<B: Qwen4expOps>(m: &mut Model<B>) {
    let (w, _) = strata_convert::convert_mtp(
        &tiny("hf"),
        &strata_convert::ConvertOptions {
            out_type: strata_convert::OutType::F32,
            include_shared: false,
        },
    )
    .unwrap();
    m.attach_mtp(Arc::new(
        GgufFile::from_bytes(w.to_bytes().unwrap(), "mtp.gguf").unwrap(),
    ))
    .unwrap();
}

fn bits_eq(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

#[test]
fn without_a_gpu_the_backend_is_a_named_error_not_a_panic() {
    // On a machine with a GPU this opens it; without one it must say what is missing.
    match std::panic::catch_unwind(|| CudaBackend::new(0).map(|_| ())) {
        Ok(Ok(())) => eprintln!("a GPU is present: nothing to refuse"),
        Ok(Err(e)) => {
            let msg = e.to_string();
            eprintln!("refused: {msg}");
            assert!(
                msg.contains("driver") || msg.contains("NVRTC") || msg.contains("CUDA"),
                "{msg}"
            );
        }
        Err(_) => panic!("CudaBackend::new panicked"),
    }
}

#[test]
fn tiny_f32_on_cuda_matches_transformers_and_the_cpu() {
    let Some(gpu) = gpu() else { return };
    let g = Golden::open(tiny("golden.safetensors"));
    let tokens = g.ids("input_ids");
    let m = load(&tiny("model-f32.gguf"), gpu, &LoadOptions::default());
    let mut st = m.new_state().unwrap();
    let out = m
        .forward_with(
            &mut st,
            &tokens,
            Want {
                layer_out: true,
                ..Want::default()
            },
        )
        .unwrap();
    for (i, got) in out.layer_out.iter().enumerate() {
        let (shape, want) = g.f32(&format!("layer_out.{i}"));
        let (mx, _, mref, _) = diff(got, &want, shape[1]);
        eprintln!("cuda tiny f32 layer_out.{i}: max|Δ| {mx:.3e} (max|ref| {mref:.3})");
        assert!(
            mx <= 1e-4 * mref,
            "layer {i}: max|Δ| {mx:.3e} > 1e-4 × {mref}"
        );
    }
    let (shape, want) = g.f32("logits");
    let (mx, mean, mref, mism) = diff(&out.logits, &want, shape[1]);
    eprintln!("cuda tiny f32 logits vs transformers: max|Δ| {mx:.3e}, mean {mean:.3e}");
    assert!(
        mx <= 1e-4 * mref && mism == 0,
        "max|Δ| {mx:.3e}, {mism} argmax"
    );
    let cpu = load(
        &tiny("model-f32.gguf"),
        CpuBackend::new(2).unwrap(),
        &LoadOptions::default(),
    );
    let c = logits(&cpu, &tokens);
    let (mx, mean, mref, mism) = diff(&out.logits, &c, shape[1]);
    eprintln!("cuda vs cpu, tiny f32: max|Δ| {mx:.3e}, mean {mean:.3e}, max|ref| {mref:.3}");
    assert!(
        mx <= 1e-4 * mref && mism == 0,
        "cuda vs cpu max|Δ| {mx:.3e}"
    );
}

#[test]
fn tiny_bf16_on_cuda_matches_transformers_within_the_cpu_bounds() {
    let Some(gpu) = gpu() else { return };
    let g = Golden::open(tiny("golden.safetensors"));
    let tokens = g.ids("input_ids");
    let m = load(&tiny("model-bf16.gguf"), gpu, &LoadOptions::default());
    let got = logits(&m, &tokens);
    let (shape, want) = g.f32("logits");
    let v = shape[1];
    let (mx, mean, _, _) = diff(&got, &want, v);
    let over = (0..shape[0])
        .filter(|&r| diff(&got[r * v..(r + 1) * v], &want[r * v..(r + 1) * v], v).0 > 2e-2)
        .count();
    eprintln!("cuda tiny bf16 (paired): max|Δ| {mx:.3e}, mean {mean:.3e}, rows over 2e-2: {over}");
    assert!(mean <= 5e-3, "mean|Δ| {mean:.3e}");
    assert!(
        over * 20 <= shape[0],
        "{over} of {} rows over 2e-2",
        shape[0]
    );
    let cpu = load(
        &tiny("model-bf16.gguf"),
        CpuBackend::new(2).unwrap(),
        &LoadOptions::default(),
    );
    let c = logits(&cpu, &tokens);
    let (mx, mean, mref, mism) = diff(&got, &c, v);
    eprintln!("cuda vs cpu, tiny bf16: max|Δ| {mx:.3e}, mean {mean:.3e}, max|ref| {mref:.3}, argmax {mism}");
    assert!(mean <= 1e-3, "cuda vs cpu mean|Δ| {mean:.3e}");
}

#[test]
fn small_files_on_cuda_match_transformers_within_the_cpu_bounds() {
    let Some(dir) = small_dir() else { return };
    let Some(_) = gpu() else { return };
    let tokens = Golden::open(dir.join("golden.safetensors")).ids("input_ids");
    let g = Golden::open(dir.join("golden_llamacpp.safetensors"));
    let mut failures = vec![];
    for v in ["q8_0", "q2_0-mix", "iq-mix"] {
        let path = dir.join(format!("{v}.gguf"));
        let m = match Model::load(&path, gpu().unwrap(), &LoadOptions::default()) {
            Ok(m) => m,
            Err(e) => {
                // Formats without CUDA products are refused at load with a named error.
                eprintln!("small {v}: not on CUDA: {e}");
                assert!(e.to_string().contains("cannot use"), "{e}");
                continue;
            }
        };
        let got = logits(&m, &tokens);
        let (shape, want) = g.f32(&format!("{v}.hf_dequant_logits"));
        let (mx, mean, _, mism) = diff(&got, &want, shape[1]);
        let agree = 1.0 - mism as f32 / shape[0] as f32;
        eprintln!(
            "cuda small {v} vs transformers: max|Δ| {mx:.3e}, mean {mean:.3e}, argmax {:.1}%",
            100.0 * agree
        );
        if mean > 1e-2 || agree < 0.95 {
            failures.push(format!("{v}: mean {mean:.3e}, argmax {agree}"));
        }
        let cpu = load(&path, CpuBackend::new(2).unwrap(), &LoadOptions::default());
        let c = logits(&cpu, &tokens);
        let (mx, mean, mref, mism) = diff(&got, &c, shape[1]);
        eprintln!("cuda vs cpu, small {v}: max|Δ| {mx:.3e}, mean {mean:.3e}, max|ref| {mref:.3}, argmax {mism}");
        if mean > 5e-3 || mism > 0 {
            failures.push(format!("{v}: cuda vs cpu mean {mean:.3e}"));
        }
    }
    assert!(failures.is_empty(), "{failures:?}");
}

/// Prefill in one pass, one token at a time, and in uneven chunks (1..8-row windows and larger
/// batches take different kernels) give the same bits; so does a last-logits prefill.
fn prefill_equals_steps<B: Qwen4expOps>(m: &Model<B>, tokens: &[u32], what: &str) {
    let all = logits(m, tokens);
    let mut st = m.new_state().unwrap();
    let mut one = Vec::new();
    for &t in tokens {
        one.extend(m.forward(&mut st, &[t]).unwrap().logits);
    }
    assert!(bits_eq(&all, &one), "{what}: prefill != steps");
    let mut st = m.new_state().unwrap();
    let mut chunked = Vec::new();
    let mut at = 0;
    for len in [7usize, 1, 16, 3, 8, 5, 2].iter().cycle() {
        if at >= tokens.len() {
            break;
        }
        let end = (at + len).min(tokens.len());
        chunked.extend(m.forward(&mut st, &tokens[at..end]).unwrap().logits);
        at = end;
    }
    assert!(bits_eq(&all, &chunked), "{what}: windows != one pass");
    let mut st = m.new_state().unwrap();
    let last = m
        .forward_with(
            &mut st,
            tokens,
            Want {
                last_only: true,
                ..Want::default()
            },
        )
        .unwrap();
    let v = all.len() / tokens.len();
    assert!(
        bits_eq(&last.logits, &all[(tokens.len() - 1) * v..]),
        "{what}: last-logits prefill"
    );
    eprintln!(
        "{what}: prefill = steps = windows, bit for bit ({} tokens)",
        tokens.len()
    );
}

#[test]
fn prefill_and_windows_equal_single_steps_bitwise_on_cuda() {
    let Some(_) = gpu() else { return };
    let tokens = Golden::open(tiny("golden.safetensors")).ids("input_ids");
    for f in ["model-f32.gguf", "model-bf16.gguf"] {
        let m = load(&tiny(f), gpu().unwrap(), &LoadOptions::default());
        prefill_equals_steps(&m, &tokens, &format!("cuda tiny {f}"));
        let opts = LoadOptions {
            qsa_rule: QsaRule::LlamaCpp,
            kv_type: KvType::F16,
            ..LoadOptions::default()
        };
        let m = load(&tiny(f), gpu().unwrap(), &opts);
        prefill_equals_steps(
            &m,
            &tokens,
            &format!("cuda tiny {f} (llama.cpp rule, F16 KV)"),
        );
    }
    if let Some(dir) = small_dir() {
        let tokens = Golden::open(dir.join("golden.safetensors")).ids("input_ids");
        for v in ["q8_0", "q2_0-mix"] {
            let m = load(
                &dir.join(format!("{v}.gguf")),
                gpu().unwrap(),
                &LoadOptions::default(),
            );
            prefill_equals_steps(&m, &tokens, &format!("cuda small {v}"));
        }
    }
}

/// A speculative decoder of `window` rows with the default settings.
fn decoder<B: Qwen4expOps>(m: &Model<B>, window: usize) -> SpecDecoder<'_, B> {
    SpecDecoder::new(
        m,
        SpecConfig {
            window,
            ..SpecConfig::default()
        },
    )
    .unwrap()
}

#[test]
fn greedy_speculative_decoding_equals_plain_on_cuda() {
    let Some(gpu) = gpu() else { return };
    let mut m = load(&tiny("model-f32.gguf"), gpu, &LoadOptions::default());
    attach_tiny_head(&mut m);
    let prompt = Golden::open(tiny("golden.safetensors")).ids("input_ids")[..30].to_vec();
    const NEW: usize = 40;
    let plain = {
        let mut d = decoder(&m, 1);
        run(&mut d, &prompt, NEW, &mut |_| true).unwrap()
    };
    // The plain oracle: one forward call a token, greedy.
    let mut st = m.new_state().unwrap();
    let want = Want {
        last_only: true,
        ..Want::default()
    };
    let mut l = m.forward_with(&mut st, &prompt, want).unwrap().logits;
    let mut oracle = Vec::new();
    while oracle.len() < NEW {
        let t = strata_engine::speculative::argmax(&l) as u32;
        oracle.push(t);
        l = m.forward_with(&mut st, &[t], want).unwrap().logits;
    }
    assert_eq!(plain, oracle, "window 1 != plain");
    for window in 2..=8 {
        let mut d = decoder(&m, window);
        let got = run(&mut d, &prompt, NEW, &mut |_| true).unwrap();
        let s = d.stats();
        eprintln!(
            "cuda spec window {window}: {} passes, acceptance {:?}",
            s.passes,
            s.acceptance_all()
        );
        assert_eq!(got, oracle, "window {window}");
    }
}

/// With the fast prefill on (cuBLAS from 10 rows here, so the tiny prompt's chunks of 11 take
/// it), greedy speculative decoding equals plain decoding when both run the prompt in the same
/// chunks (`GenOptions::prefill_chunk`, as the CLI's loops do): the fast rows depend on a
/// chunk's row count, not on which loop ran it.
#[test]
fn greedy_spec_equals_plain_with_the_fast_prefill_on_cuda() {
    use strata_engine::generate::{generate, GenOptions, Qwen4expSession};
    use strata_engine::sampler::{Sampler, SamplerConfig};
    let Some(gpu) = gpu() else { return };
    strata_cuda::model::set_blas_min_rows(Some(9));
    gpu.set_fast_prefill(true)
        .expect("cuBLAS on the GPU machine");
    let mut m = load(&tiny("model-bf16.gguf"), gpu, &LoadOptions::default());
    attach_tiny_head(&mut m);
    let prompt = Golden::open(tiny("golden.safetensors")).ids("input_ids")[..30].to_vec();
    const NEW: usize = 24;
    let opts = GenOptions {
        max_tokens: NEW,
        prefill_chunk: 11,
    };
    // The fast path ran: its prompt logits are not the exact mode's.
    let fast = logits(&m, &prompt);
    m.backend().set_fast_prefill(false).unwrap();
    let exact = logits(&m, &prompt);
    m.backend().set_fast_prefill(true).unwrap();
    assert!(
        !bits_eq(&fast, &exact),
        "the tiny prompt did not take the fast prefill"
    );
    let mut session = Qwen4expSession::new(&m).unwrap();
    let mut sampler = Sampler::new(SamplerConfig::greedy()).unwrap();
    let plain = generate(
        &mut session,
        &prompt,
        &mut sampler,
        &|_| false,
        &opts,
        &mut |_| true,
    )
    .unwrap()
    .tokens;
    assert_eq!(plain.len(), NEW);
    for window in [2, 4, 8] {
        let mut d = decoder(&m, window);
        let got =
            strata_engine::speculative::run_with(&mut d, &prompt, &opts, &mut |_| true).unwrap();
        assert_eq!(got, plain, "fast prefill, window {window}");
    }
    strata_cuda::model::set_blas_min_rows(None);
}

fn greedy_qwen2<B: strata_engine::Backend>(
    m: &strata_engine::qwen2::Model<B>,
    prompt: &[u32],
    n: usize,
) -> (Vec<f32>, Vec<u32>) {
    let mut st = m.new_state().unwrap();
    let first = m.forward(&mut st, prompt).unwrap().logits;
    let v = first.len() / prompt.len();
    let mut t = strata_engine::speculative::argmax(&first[(prompt.len() - 1) * v..]) as u32;
    let mut out = vec![t];
    while out.len() < n {
        let l = m.forward(&mut st, &[t]).unwrap().logits;
        t = strata_engine::speculative::argmax(&l) as u32;
        out.push(t);
    }
    (first, out)
}

#[test]
fn qwen2_in_the_default_models_formats_on_cuda_matches_the_cpu() {
    let Some(gpu) = gpu() else { return };
    use strata_engine::qwen2::{LoadOptions as Q2, Model as M2};
    let file = qwen2_mixed();
    let opts = Q2 {
        kv_type: KvType::F32,
    };
    let cuda = M2::from_file(Arc::clone(&file), gpu, &opts).unwrap();
    let cpu = M2::from_file(file, CpuBackend::new(2).unwrap(), &opts).unwrap();
    let prompt: Vec<u32> = (0..24).map(|i| (i * 37 + 5) % 1024).collect();
    let (lg, tg) = greedy_qwen2(&cuda, &prompt, 64);
    let (lc, tc) = greedy_qwen2(&cpu, &prompt, 64);
    let (mx, mean, mref, mism) = diff(&lg, &lc, 1024);
    eprintln!(
        "qwen2 mixed formats, CUDA vs CPU prefill logits: max|Δ| {mx:.3e}, mean {mean:.3e}, max|ref| {mref:.3}, argmax {mism}"
    );
    assert!(mean <= 5e-3 * mref.max(1.0) && mism == 0, "mean {mean:.3e}");
    let same = tg.iter().zip(&tc).take_while(|(a, b)| a == b).count();
    eprintln!("qwen2 mixed formats, greedy: {same} of 64 tokens equal before the first difference");
    assert_eq!(tg, tc, "greedy tokens differ from position {same}");
}

/// A toy vocabulary over `n` ids for the slop tables (the CUDA tests carry no tokenizer):
/// every 37th id prints as a newline, every 41st (from 1) as a space, the rest as `t<id>`,
/// which is also how a phrase names a token.
struct ToyVocab(usize);

impl strata_engine::sampler::vocab::SamplerVocab for ToyVocab {
    fn n_vocab(&self) -> usize {
        self.0
    }
    fn piece(&self, id: u32) -> Vec<u8> {
        if id.is_multiple_of(37) {
            b"\n".to_vec()
        } else if id % 41 == 1 {
            b" ".to_vec()
        } else {
            format!("t{id}").into_bytes()
        }
    }
    fn encode(&self, text: &str) -> strata_engine::Result<Vec<u32>> {
        Ok(text
            .strip_prefix('t')
            .and_then(|d| d.parse::<u32>().ok())
            .filter(|&t| (t as usize) < self.0)
            .into_iter()
            .collect())
    }
}

/// Greedy with slop mode 1 alone over the toy vocabulary: `tokens` penalized (the first
/// banned), run caps 1 and 2.
fn slop_mode_1(tokens: &[u32]) -> strata_engine::sampler::SamplerConfig {
    use strata_engine::sampler::slop::{ListChoice, SlopConfig, SlopEntry};
    strata_engine::sampler::SamplerConfig {
        stages: vec![strata_engine::sampler::Stage::Slop(SlopConfig {
            mode: 1,
            list: ListChoice::None,
            entries: tokens
                .iter()
                .enumerate()
                .map(|(i, t)| SlopEntry {
                    phrase: format!("t{t}"),
                    penalty: if i == 0 {
                        f32::INFINITY
                    } else {
                        3.0 + i as f32
                    },
                })
                .collect(),
            newline_run_cap: 1,
            blank_run_cap: 2,
            ..SlopConfig::default()
        })],
        pick: strata_engine::sampler::Pick::Greedy,
    }
}

/// Records the head's proposals and keeps them.
struct Proposals(Arc<std::sync::Mutex<Vec<u32>>>);

impl strata_engine::speculative::DraftHook for Proposals {
    fn draft(&mut self, _position: usize, proposed: u32) -> Option<u32> {
        self.0.lock().unwrap().push(proposed);
        Some(proposed)
    }
}

/// The draft chain's device operations on CUDA (issue "CUDA MTP", point 1): `slop_pen_draft`
/// (sample.cu `slop_pen_chain`, the previous draft read on the device) gives bit for bit the
/// CPU's draft logits and states over a walk through newline, blank, penalized and other
/// tokens (full vocabulary and a draft vocabulary of every third id); `pick_draft_mapped`
/// gives the CPU's token ids; `write_ids` gathers ids.
#[test]
fn draft_chain_ops_on_cuda_equal_the_cpu() {
    use strata_engine::backend::{DraftMap, DraftSlop};
    use strata_engine::Backend;
    let Some(gpu) = gpu() else { return };
    let cpu = CpuBackend::new(1).unwrap();
    let n = 5000usize;
    let sampler = strata_engine::sampler::Sampler::with_vocab(
        slop_mode_1(&[7, 9, 300, 301, 4000]),
        &ToyVocab(n),
    )
    .unwrap();
    let compiled = Arc::clone(sampler.slop().unwrap());
    let mut seed = 17u64;
    let mut next = move || {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (seed >> 33) as u32
    };
    let walk: Vec<u32> = (0..40)
        .map(|i| match i % 5 {
            0 | 1 => 37 * (1 + next() % 100),
            2 => 41 * (next() % 100) + 1,
            3 => [7u32, 9, 300, 301, 4000][next() as usize % 5],
            _ => next() % n as u32,
        })
        .collect();
    let full: Vec<i32> = (0..n as i32).collect();
    let mut third = vec![-1i32; n];
    let mut ids = Vec::new();
    for t in (0..n).step_by(3) {
        third[t] = ids.len() as i32;
        ids.push(t as u32);
    }
    for inverse in [&full, &third] {
        let nv = inverse.iter().filter(|&&d| d >= 0).count();
        let dg = DraftSlop::new(&gpu, Arc::clone(&compiled), inverse.clone(), nv).unwrap();
        let dc = DraftSlop::new(&cpu, Arc::clone(&compiled), inverse.clone(), nv).unwrap();
        let s0 = DraftSlop::<strata_engine::cpu::CpuIds, strata_engine::CpuBuf>::state_ids(
            &Default::default(),
        );
        let (mut sg, mut sc) = (gpu.upload_ids(&s0).unwrap(), cpu.upload_ids(&s0).unwrap());
        let mut removed = 0;
        for (k, t) in std::iter::once(None)
            .chain(walk.iter().copied().map(Some))
            .enumerate()
        {
            let raw: Vec<f32> = (0..nv)
                .map(|_| (next() % 2000) as f32 / 100.0 - 10.0)
                .collect();
            let mut lg = gpu.upload(1, nv, &raw).unwrap();
            let mut lc = cpu.upload(1, nv, &raw).unwrap();
            let pg = t.map(|t| gpu.upload_ids(&[t]).unwrap());
            let pc = t.map(|t| cpu.upload_ids(&[t]).unwrap());
            sg = gpu.slop_pen_draft(&mut lg, &dg, pg.as_ref(), &sg).unwrap();
            sc = cpu.slop_pen_draft(&mut lc, &dc, pc.as_ref(), &sc).unwrap();
            let (vg, vc) = (gpu.download(&lg).unwrap(), cpu.download(&lc).unwrap());
            assert!(bits_eq(&vg, &vc), "{nv} draft ids, step {k}: logits");
            assert_eq!(
                gpu.download_ids(&sg).unwrap(),
                cpu.download_ids(&sc).unwrap(),
                "step {k}"
            );
            removed += vc.iter().filter(|x| x.is_infinite()).count();
        }
        assert!(removed > 0, "the caps never bit");
        // The mapped pick over three rows (one all −∞), gathered into one buffer.
        let map_g = DraftMap::new(&gpu, &ids, n).unwrap();
        let map_c = DraftMap::new(&cpu, &ids, n).unwrap();
        let mut rows: Vec<f32> = (0..3 * nv).map(|_| (next() % 999) as f32).collect();
        rows[..nv].iter_mut().for_each(|x| *x = f32::NEG_INFINITY);
        let (lg, lc) = (
            gpu.upload(3, nv, &rows).unwrap(),
            cpu.upload(3, nv, &rows).unwrap(),
        );
        let (mg, mc) = if nv == n {
            (None, None)
        } else {
            (Some(&map_g), Some(&map_c))
        };
        let pg = gpu.pick_draft_mapped(&lg, mg).unwrap();
        let pc = cpu.pick_draft_mapped(&lc, mc).unwrap();
        let mut chain = gpu.upload_ids(&[0; 8]).unwrap();
        gpu.write_ids(&mut chain, 2, &pg.ids).unwrap();
        let got = gpu.download_ids(&chain).unwrap();
        assert_eq!(&got[2..5], &pc.ids.0[..], "{nv} draft ids: picks");
        assert_eq!(
            (got[..2].to_vec(), got[5..].to_vec()),
            (vec![0; 2], vec![0; 3])
        );
        assert_eq!(
            gpu.download_ids(&pg.values).unwrap(),
            pc.values.0,
            "{nv}: values"
        );
        assert_eq!(pc.values.0[0], f32::NEG_INFINITY.to_bits(), "the −∞ row");
    }
}

/// Speculative decoding under slop mode 1 on CUDA (issue "CUDA MTP", point 2): the tiny
/// fixture with its head, windows 2..8, the draft chain on the device (edited by
/// `slop_pen_chain`, picked by `pick_draft_map`, nothing read between drafts) emits the plain
/// guarded loop's tokens and stop on CUDA; the drafts of the device chain read draft by
/// draft equal those of the host chain (logits downloaded and edited by the sampler).
#[test]
fn slop_mode_1_speculative_equals_plain_on_cuda() {
    use strata_engine::generate::{GenOptions, Qwen4expSession};
    use strata_engine::sampler::{guard, Sampler, SamplerConfig};
    use strata_engine::speculative::guarded;
    let Some(gpu) = gpu() else { return };
    let mut m = load(&tiny("model-f32.gguf"), gpu, &LoadOptions::default());
    attach_tiny_head(&mut m);
    let vocab = ToyVocab(m.config().n_vocab);
    let prompt = Golden::open(tiny("golden.safetensors")).ids("input_ids")[..30].to_vec();
    const NEW: usize = 40;
    let plain = |cfg: &SamplerConfig| {
        let mut s = Sampler::with_vocab(cfg.clone(), &vocab).unwrap();
        let g = guard::generate(
            &mut Qwen4expSession::new(&m).unwrap(),
            &prompt,
            &mut s,
            &|_| false,
            &GenOptions {
                max_tokens: NEW,
                prefill_chunk: 512,
            },
            &mut |_| true,
        )
        .unwrap();
        (g.generation.tokens, g.stop)
    };
    let free = plain(&SamplerConfig::greedy()).0;
    // A speculative run of `cfg`: (tokens, stop) and, with a hook, the drafts proposed.
    let spec = |cfg: &SamplerConfig, window: usize, min_p: f32, hook: bool, penalize: bool| {
        let mut s = Sampler::with_vocab(cfg.clone(), &vocab).unwrap();
        let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
        let mut d = SpecDecoder::new(
            &m,
            SpecConfig {
                window,
                min_p,
                ..SpecConfig::default()
            },
        )
        .unwrap()
        .with_draft_penalties(penalize);
        if hook {
            d = d.with_draft_hook(Proposals(Arc::clone(&seen)));
        }
        let g = guarded::generate(&mut d, &prompt, &mut s, &|_| false, NEW, &mut |_| true).unwrap();
        let drafts = seen.lock().unwrap().clone();
        ((g.tokens, g.stop), drafts)
    };
    // Penalize trunk tokens and tokens the head drafts (its drafts are seldom the trunk's).
    let probe = slop_mode_1(&free[2..6]);
    let (_, drafted) = spec(&probe, 4, 0.0, true, false);
    let mut listed: Vec<u32> = free[2..6].to_vec();
    for t in drafted {
        if listed.len() < 8 && !listed.contains(&t) {
            listed.push(t);
        }
    }
    let cfg = slop_mode_1(&listed);
    let want = plain(&cfg);
    assert_ne!(want.0, free, "the penalties changed nothing");
    for window in 2..=8 {
        let run = |min_p: f32, hook: bool| spec(&cfg, window, min_p, hook, true);
        let (device, _) = run(0.0, false);
        let (hooked, dev_drafts) = run(0.0, true);
        let (host, host_drafts) = run(1e-30, true);
        for (what, got) in [("device", &device), ("hooked", &hooked), ("host", &host)] {
            assert_eq!(got, &want, "window {window}, {what} chain: not plain");
        }
        assert!(!dev_drafts.is_empty());
        assert_eq!(
            dev_drafts, host_drafts,
            "window {window}: device vs host drafts"
        );
        // The edits changed drafts, so the equality says something.
        let (free_run, free_drafts) = spec(&cfg, window, 0.0, true, false);
        assert_eq!(
            free_run, want,
            "window {window}, unedited drafts: not plain"
        );
        assert_ne!(
            free_drafts, host_drafts,
            "window {window}: the edits changed no draft"
        );
    }
}

/// The PLE n-gram table in mapped host memory (`STRATA_CUDA_PLE_HOST=1`: the gather reads it
/// over the bus) gives the logits of the table on the device bit for bit, prefill and steps.
#[test]
fn the_ple_table_in_host_memory_gives_the_same_bits() {
    let Some(gpu0) = gpu() else { return };
    let tokens: Vec<u32> = (0..12u32).map(|i| (i * 37 + 5) % 200).collect();
    let run = |host: bool, b: CudaBackend| {
        strata_cuda::backend::set_ple_host(Some(host));
        let m = load(&tiny("model-f32.gguf"), b, &LoadOptions::default());
        strata_cuda::backend::set_ple_host(None);
        let placed = m.backend().host_weight_bytes();
        assert_eq!(placed > 0, host, "PLE table in host memory: {placed} bytes");
        let mut st = m.new_state().unwrap();
        let mut out = logits(&m, &tokens[..8]);
        m.forward(&mut st, &tokens[..8]).unwrap();
        for &t in &tokens[8..] {
            out.extend(m.forward(&mut st, &[t]).unwrap().logits);
        }
        out
    };
    let on_device = run(false, gpu0);
    let Some(gpu1) = gpu() else { return };
    let in_host = run(true, gpu1);
    assert!(!on_device.is_empty());
    assert!(
        bits_eq(&in_host, &on_device),
        "the host-memory table changed the logits"
    );
}

/// The fast prefill (`--prefill fast`: the large dense products by cuBLAS on BF16 images, the
/// routed experts and everything else as before) against the goldens within the CPU tests'
/// bounds, on the tiny bf16 file and the small quantized files; its distance from the exact
/// prefill is printed (docs/CUDA.md states it). The row thresholds are lowered to 9 so that the
/// fixtures' short prompts take it; the exact prefill of the same backend is unchanged by it.
#[test]
fn fast_prefill_stays_within_the_cpu_bounds_of_the_goldens() {
    let Some(_) = gpu() else { return };
    strata_cuda::model::set_blas_min_rows(Some(9));
    let run = |path: &std::path::Path, tokens: &[u32]| {
        let b = gpu().unwrap();
        b.set_fast_prefill(true).expect("cuBLAS on the GPU machine");
        let m = load(path, b, &LoadOptions::default());
        let fast = logits(&m, tokens);
        m.backend().set_fast_prefill(false).unwrap();
        let exact = logits(&m, tokens);
        m.backend().set_fast_prefill(true).unwrap();
        let again = logits(&m, tokens);
        assert!(
            bits_eq(&fast, &again),
            "{}: the fast prefill is not repeatable",
            path.display()
        );
        (fast, exact)
    };
    let mut failures = vec![];
    // tiny bf16: the BF16 products themselves go to cuBLAS.
    let g = Golden::open(tiny("golden.safetensors"));
    let tokens = g.ids("input_ids");
    assert!(tokens.len() >= 9, "the tiny prompt takes the fast path");
    let (fast, exact) = run(&tiny("model-bf16.gguf"), &tokens);
    let (shape, want) = g.f32("logits");
    let v = shape[1];
    let (mx, mean, _, _) = diff(&fast, &want, v);
    let over = (0..shape[0])
        .filter(|&r| diff(&fast[r * v..(r + 1) * v], &want[r * v..(r + 1) * v], v).0 > 2e-2)
        .count();
    let (emx, emean, _, emism) = diff(&fast, &exact, v);
    eprintln!(
        "fast prefill, tiny bf16 vs transformers: max|Δ| {mx:.3e}, mean {mean:.3e}, rows over \
         2e-2: {over}; vs the exact prefill: max|Δ| {emx:.3e}, mean {emean:.3e}, argmax {emism}"
    );
    if mean > 5e-3 || over * 20 > shape[0] {
        failures.push(format!("tiny bf16: mean {mean:.3e}, {over} rows over 2e-2"));
    }
    assert!(
        !bits_eq(&fast, &exact),
        "tiny bf16: the fast path was not taken"
    );
    if let Some(dir) = small_dir() {
        let tokens = Golden::open(dir.join("golden.safetensors")).ids("input_ids");
        let g = Golden::open(dir.join("golden_llamacpp.safetensors"));
        for f in ["q8_0", "q2_0-mix"] {
            let (fast, exact) = run(&dir.join(format!("{f}.gguf")), &tokens);
            let (shape, want) = g.f32(&format!("{f}.hf_dequant_logits"));
            let (mx, mean, _, mism) = diff(&fast, &want, shape[1]);
            let agree = 1.0 - mism as f32 / shape[0] as f32;
            let (emx, emean, _, emism) = diff(&fast, &exact, shape[1]);
            eprintln!(
                "fast prefill, small {f} vs transformers: max|Δ| {mx:.3e}, mean {mean:.3e}, \
                 argmax {:.1}%; vs the exact prefill: max|Δ| {emx:.3e}, mean {emean:.3e}, \
                 argmax differs on {emism} of {} rows",
                100.0 * agree,
                shape[0]
            );
            if mean > 1e-2 || agree < 0.95 {
                failures.push(format!("small {f}: mean {mean:.3e}, argmax {agree}"));
            }
            assert!(
                !bits_eq(&fast, &exact),
                "small {f}: the fast path was not taken"
            );
        }
    }
    strata_cuda::model::set_blas_min_rows(None);
    assert!(failures.is_empty(), "{failures:?}");
}

/// Greedy runs of `prompts`, sequence i joining at step `joins[i]`: each step is ONE
/// `forward_batch` call over every active sequence (a prompt as a last-logits chunk, then one
/// decode row a step) until each has `gen` + 1 logits rows; returns each sequence's rows as bits.
fn batched_greedy<B: Qwen4expOps>(
    m: &Model<B>,
    prompts: &[Vec<u32>],
    joins: &[usize],
    gen: usize,
) -> (Vec<Vec<Vec<u32>>>, usize) {
    let n = prompts.len();
    let mut states: Vec<_> = (0..n).map(|_| m.new_state().unwrap()).collect();
    let mut seen: Vec<Vec<Vec<u32>>> = vec![Vec::new(); n];
    let mut next: Vec<Option<u32>> = vec![None; n];
    let (mut step, mut mixed) = (0usize, 0usize);
    while seen.iter().any(|s| s.len() <= gen) {
        let active: Vec<usize> = (0..n)
            .filter(|&i| joins[i] <= step && seen[i].len() <= gen)
            .collect();
        let toks: Vec<Vec<u32>> = active
            .iter()
            .map(|&i| next[i].map_or_else(|| prompts[i].clone(), |t| vec![t]))
            .collect();
        if toks.iter().any(|t| t.len() > 1) && toks.iter().any(|t| t.len() == 1) {
            mixed += 1;
        }
        let outs = {
            let mut items: Vec<BatchItem<'_, B>> = states
                .iter_mut()
                .enumerate()
                .filter(|(i, _)| active.contains(i))
                .zip(&toks)
                .map(|((_, st), t)| BatchItem::rows(st, t, true))
                .collect();
            m.forward_batch(&mut items).unwrap()
        };
        for (k, &i) in active.iter().enumerate() {
            let l = &outs[k].logits;
            seen[i].push(l.iter().map(|x| x.to_bits()).collect());
            next[i] = Some(argmax(l) as u32);
        }
        step += 1;
    }
    (seen, mixed)
}

#[path = "../../engine/tests/batch_harness/mod.rs"]
mod batch_harness;
#[path = "../../engine/tests/qwen2_random/mod.rs"]
mod qwen2_random;
use qwen2_random::qwen2_mixed;

/// Issue 15 on CUDA with speculation: the CPU's `batch.rs` test of the same shape through the
/// shared harness (`crates/engine/tests/batch_harness`) on the tiny f32 file with its real MTP
/// head, the backend running every batch as one step (`set_batches_sequences`). Three
/// speculative sequences (windows 4, 3 and 8; one under slop mode 2 with a phrase that makes it
/// rewind, one with drafts forced along its output) and three plain ones join at different
/// steps; every verify window and speculative prompt chunk runs as rows of the step's one
/// forward pass beside the others' rows. Each sequence's verify results, tokens, rewinds and
/// trunk and MTP states after the run equal its solo run's bit for bit, greedy and seeded,
/// and speculative output equals plain decoding's.
#[test]
fn speculative_and_plain_sequences_in_a_batch_get_their_solo_bits_on_cuda() {
    let Some(b) = gpu() else { return };
    b.set_batches_sequences(true);
    let path = tiny("model-f32.gguf");
    let mut m = load(&path, b, &LoadOptions::default());
    attach_tiny_head(&mut m);
    let tok = strata_tokenizer::Tokenizer::from_gguf(&GgufFile::open(&path).unwrap()).unwrap();
    let ids = Golden::open(tiny("golden.safetensors")).ids("input_ids");
    batch_harness::speculative_and_plain_in_a_batch_equal_solo(&batch_harness::Q4(m), &tok, &ids);
}

/// Issue 15 on CUDA (`STRATA_CUDA_BATCH=1`, here `set_batches_sequences`): eight sequences with
/// different prompts (3..17 tokens) joining at different steps, prefill chunks beside the
/// others' decode rows (eager passes) and batches of up to eight decode rows (recorded graphs),
/// each step one forward pass: every sequence's logits equal its solo run's bit for bit, on the
/// tiny f32 and bf16 files and the small q2_0-mix file.
#[test]
fn eight_sequences_in_one_batch_step_get_their_solo_bits_on_cuda() {
    let Some(_) = gpu() else { return };
    let mut files = vec![
        (tiny("model-f32.gguf"), tiny("golden.safetensors")),
        (tiny("model-bf16.gguf"), tiny("golden.safetensors")),
    ];
    if let Some(d) = small_dir() {
        files.push((d.join("q2_0-mix.gguf"), d.join("golden.safetensors")));
    }
    let joins = [0usize, 0, 1, 1, 2, 3, 5, 8];
    let gen = 6;
    for (path, golden) in files {
        let ids = Golden::open(golden).ids("input_ids");
        let prompts: Vec<Vec<u32>> = (0..8)
            .map(|i| ids[i * 7..i * 7 + 3 + 2 * i].to_vec())
            .collect();
        let b = gpu().unwrap();
        b.set_batches_sequences(true);
        let m = load(&path, b, &LoadOptions::default());
        let (together, mixed) = batched_greedy(&m, &prompts, &joins, gen);
        assert!(
            mixed > 0,
            "{}: no step mixed prompts with decode rows",
            path.display()
        );
        for (i, p) in prompts.iter().enumerate() {
            let (alone, _) = batched_greedy(&m, std::slice::from_ref(p), &[0], gen);
            assert_eq!(together[i].len(), gen + 1);
            assert!(
                together[i] == alone[0],
                "{}: sequence {i}'s logits in the batch differ from its solo run's",
                path.display()
            );
        }
        let picks = |s: &Vec<Vec<u32>>| -> Vec<usize> {
            s.iter()
                .map(|r| argmax(&r.iter().map(|&b| f32::from_bits(b)).collect::<Vec<_>>()))
                .collect()
        };
        assert!(
            (1..8).any(|i| picks(&together[i]) != picks(&together[0])),
            "{}: the sequences do not differ",
            path.display()
        );
        eprintln!(
            "cuda batch of 8, {}: every sequence's {} logits rows equal its solo run's \
             ({mixed} steps mixed prompts with decode rows)",
            path.display(),
            gen + 1
        );
    }
}
