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
use strata_engine::qwen4exp::{LoadOptions, Model, Want};
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

#[test]
fn greedy_speculative_decoding_equals_plain_on_cuda() {
    let Some(gpu) = gpu() else { return };
    let mut m = load(&tiny("model-f32.gguf"), gpu, &LoadOptions::default());
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
    let prompt = Golden::open(tiny("golden.safetensors")).ids("input_ids")[..30].to_vec();
    const NEW: usize = 40;
    let plain = {
        let mut d = SpecDecoder::new(
            &m,
            SpecConfig {
                window: 1,
                ..SpecConfig::default()
            },
        )
        .unwrap();
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
        let mut d = SpecDecoder::new(
            &m,
            SpecConfig {
                window,
                ..SpecConfig::default()
            },
        )
        .unwrap();
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

/// A random qwen2 model in the default model's formats (Q5_0 embedding and matrices, Q8_0
/// head and V, Q6_K and Q4_K feed-forward, F32 norms and biases), written in memory.
fn qwen2_mixed() -> Arc<GgufFile> {
    use strata_gguf::{GgufWriter, Value};
    use strata_quant::GgmlType as T;
    let (h, ff, nh, nkv, vocab, layers) = (256usize, 512usize, 4usize, 2usize, 1024usize, 2);
    let hd = h / nh;
    let mut seed = 0x9e3779b97f4a7c15u64;
    let mut rnd = |n: usize, scale: f32| -> Vec<f32> {
        (0..n)
            .map(|_| {
                seed = seed
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * scale
            })
            .collect()
    };
    let mut w = GgufWriter::new();
    let a = "qwen2";
    w.add_kv("general.architecture", Value::String(a.into()))
        .add_kv(format!("{a}.embedding_length"), Value::U32(h as u32))
        .add_kv(format!("{a}.block_count"), Value::U32(layers as u32))
        .add_kv(format!("{a}.feed_forward_length"), Value::U32(ff as u32))
        .add_kv(format!("{a}.attention.head_count"), Value::U32(nh as u32))
        .add_kv(
            format!("{a}.attention.head_count_kv"),
            Value::U32(nkv as u32),
        )
        .add_kv(format!("{a}.rope.freq_base"), Value::F32(1e6))
        .add_kv(
            format!("{a}.attention.layer_norm_rms_epsilon"),
            Value::F32(1e-6),
        )
        .add_kv(format!("{a}.context_length"), Value::U32(512));
    let mut add = |name: &str, dims: &[usize], ty: T, v: Vec<f32>| {
        let mut bytes = vec![0u8; ty.row_bytes(dims[0]).unwrap() * v.len() / dims[0]];
        if ty == T::F32 {
            bytes = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        } else {
            strata_quant::quantize(ty, &v, &mut bytes).unwrap();
        }
        let d: Vec<u64> = dims.iter().map(|&x| x as u64).collect();
        w.add_tensor_owned(name, &d, ty, bytes).unwrap();
    };
    add(
        "token_embd.weight",
        &[h, vocab],
        T::Q5_0,
        rnd(h * vocab, 2.0),
    );
    add("output.weight", &[h, vocab], T::Q8_0, rnd(h * vocab, 0.5));
    add(
        "output_norm.weight",
        &[h],
        T::F32,
        rnd(h, 0.2).iter().map(|x| x + 1.0).collect(),
    );
    for l in 0..layers {
        let p = |n: &str| format!("blk.{l}.{n}");
        let norm = |r: Vec<f32>| r.iter().map(|x| x + 1.0).collect::<Vec<f32>>();
        add(&p("attn_norm.weight"), &[h], T::F32, norm(rnd(h, 0.2)));
        add(&p("attn_q.weight"), &[h, h], T::Q5_0, rnd(h * h, 0.3));
        add(
            &p("attn_k.weight"),
            &[h, nkv * hd],
            T::Q5_0,
            rnd(h * nkv * hd, 0.3),
        );
        add(
            &p("attn_v.weight"),
            &[h, nkv * hd],
            T::Q8_0,
            rnd(h * nkv * hd, 0.3),
        );
        add(&p("attn_q.bias"), &[h], T::F32, rnd(h, 0.2));
        add(&p("attn_k.bias"), &[nkv * hd], T::F32, rnd(nkv * hd, 0.2));
        add(&p("attn_v.bias"), &[nkv * hd], T::F32, rnd(nkv * hd, 0.2));
        add(&p("attn_output.weight"), &[h, h], T::Q5_0, rnd(h * h, 0.3));
        add(&p("ffn_norm.weight"), &[h], T::F32, norm(rnd(h, 0.2)));
        add(&p("ffn_gate.weight"), &[h, ff], T::Q4_K, rnd(h * ff, 0.3));
        add(&p("ffn_up.weight"), &[h, ff], T::Q5_0, rnd(h * ff, 0.3));
        add(&p("ffn_down.weight"), &[ff, h], T::Q6_K, rnd(ff * h, 0.3));
    }
    Arc::new(GgufFile::from_bytes(w.to_bytes().unwrap(), "qwen2-mixed.gguf").unwrap())
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
