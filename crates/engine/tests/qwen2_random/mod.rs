//! A random qwen2 model in the default model's formats, written in memory: for the tests that
//! need a qwen2 model when the default model is not cached (the engine's, on the CPU) and for
//! the CUDA tests (`crates/cuda/tests/model_gpu.rs` includes this file by path).

/// A random qwen2 model in the default model's formats (Q5_0 embedding and matrices, Q8_0
/// head and V, Q6_K and Q4_K feed-forward, F32 norms and biases), written in memory.
pub fn qwen2_mixed() -> std::sync::Arc<strata_gguf::GgufFile> {
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
    std::sync::Arc::new(
        strata_gguf::GgufFile::from_bytes(w.to_bytes().unwrap(), "qwen2-mixed.gguf").unwrap(),
    )
}
