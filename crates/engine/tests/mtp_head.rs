//! The MTP head against the fixtures' float64 spec reference (`mtp_specref_logits`,
//! `mtp_specref_hidden`): the head converted from the HF checkpoint (`convert_mtp`), fed the
//! golden trunk states or the engine's own; batch = single steps; draft-vocabulary rows equal
//! the full head's; the head inside the model file; named errors for broken inputs.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use common::{compare, small_dir, tiny_dir, Golden};
use strata_convert::{convert_mtp, ConvertOptions, OutType};
use strata_engine::qwen4exp::{LoadOptions, Model, Want};
use strata_engine::{CpuBackend, EngineError, FloatActivations};
use strata_gguf::{GgufFile, GgufWriter};

fn mtp_file(hf: &Path, ty: OutType, include_shared: bool) -> Arc<GgufFile> {
    let opts = ConvertOptions {
        out_type: ty,
        include_shared,
    };
    let (w, _) = convert_mtp(hf, &opts).unwrap_or_else(|e| panic!("{}: {e}", hf.display()));
    Arc::new(GgufFile::from_bytes(w.to_bytes().unwrap(), "mtp.gguf").unwrap())
}

fn tiny_model(backend: CpuBackend) -> Model<CpuBackend> {
    let path = tiny_dir().join("model-f32.gguf");
    Model::load(&path, backend, &LoadOptions::default()).unwrap()
}

fn tiny_with_mtp(ty: OutType) -> Model<CpuBackend> {
    let mut m = tiny_model(CpuBackend::new(2).unwrap());
    m.attach_mtp(mtp_file(&tiny_dir().join("hf"), ty, false))
        .unwrap();
    m
}

/// Rows `0..rows` of a `[_, cols]` matrix.
fn head_rows(v: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    v[..rows * cols].to_vec()
}

fn check_close(what: &str, got: &[f32], want: &[f32], cols: usize) {
    let d = compare(got, want, cols, 0.0);
    eprintln!(
        "{what}: max|Δ| {:.3e}, mean {:.3e}, max|ref| {:.3}, argmax mismatches {:?}",
        d.max_abs, d.mean_abs, d.max_ref, d.argmax_mismatch
    );
    assert!(
        d.max_abs <= 1e-4 * d.max_ref,
        "{what}: max|Δ| {:.3e} > 1e-4 × {:.3}",
        d.max_abs,
        d.max_ref
    );
}

#[test]
fn tiny_mtp_from_golden_states_matches_specref() {
    let model = tiny_with_mtp(OutType::F32);
    let g = Golden::open(tiny_dir().join("golden.safetensors"));
    let ids = g.ids("input_ids");
    let t = ids.len();
    let (hs, hidden) = g.f32("layer_out.3");
    let sh = hs[1];
    let mut st = model.new_mtp_state().unwrap();
    let out = model
        .mtp_forward(
            &mut st,
            &head_rows(&hidden, t - 1, sh),
            &ids[1..],
            false,
            None,
        )
        .unwrap();
    let (ls, want) = g.f32("mtp_specref_logits");
    assert_eq!(ls, vec![t - 1, out.cols]);
    check_close(
        "tiny MTP logits (golden trunk states)",
        &out.logits,
        &want,
        ls[1],
    );
    let (_, want_h) = g.f32("mtp_specref_hidden");
    check_close("tiny MTP pre-mixer output", &out.hidden, &want_h, sh);
    assert_eq!(st.position(), t - 1);
}

#[test]
fn tiny_mtp_from_engine_trunk_matches_specref() {
    let model = tiny_with_mtp(OutType::F32);
    let g = Golden::open(tiny_dir().join("golden.safetensors"));
    let ids = g.ids("input_ids");
    let t = ids.len();
    let mut st = model.new_state().unwrap();
    let out = model
        .forward_with(
            &mut st,
            &ids,
            Want {
                hidden: true,
                ..Want::default()
            },
        )
        .unwrap();
    let hidden = out.hidden.unwrap();
    let sh = hidden.len() / t;
    let mut ms = model.new_mtp_state().unwrap();
    let mtp = model
        .mtp_forward(&mut ms, &hidden[..(t - 1) * sh], &ids[1..], false, None)
        .unwrap();
    let (ls, want) = g.f32("mtp_specref_logits");
    check_close(
        "tiny MTP logits (engine trunk states)",
        &mtp.logits,
        &want,
        ls[1],
    );
}

#[test]
fn small_mtp_from_golden_states_matches_specref() {
    let Some(dir) = small_dir() else { return };
    // The small fixture ships quantized trunks only; the head carries exact f32 copies of the
    // shared embedding and LM head (--include-shared), and reads the golden trunk states.
    let path = dir.join("q8_0.gguf");
    let mut model = Model::load(&path, CpuBackend::new(2).unwrap(), &LoadOptions::default())
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let tmp = std::env::temp_dir().join(format!("strata-mtp-small-{}.gguf", std::process::id()));
    let (w, report) = convert_mtp(
        &dir.join("hf"),
        &ConvertOptions {
            out_type: OutType::F32,
            include_shared: true,
        },
    )
    .unwrap();
    w.write_file(&tmp).unwrap();
    assert!(report
        .tensors
        .iter()
        .any(|(n, _, _)| n == "mtp.output.weight"));
    model.load_mtp(&tmp).unwrap();
    std::fs::remove_file(&tmp).ok();
    assert!(model.mtp_config().unwrap().dedicated_embeddings);
    let g = Golden::open(dir.join("golden.safetensors"));
    let ids = g.ids("input_ids");
    let t = ids.len();
    let (hs, hidden) = g.f32("layer_out.3");
    let mut st = model.new_mtp_state().unwrap();
    let out = model
        .mtp_forward(
            &mut st,
            &head_rows(&hidden, t - 1, hs[1]),
            &ids[1..],
            false,
            None,
        )
        .unwrap();
    let (ls, want) = g.f32("mtp_specref_logits");
    check_close(
        "small MTP logits (golden trunk states)",
        &out.logits,
        &want,
        ls[1],
    );
}

#[test]
fn mtp_batch_equals_single_steps_and_chains() {
    let model = tiny_with_mtp(OutType::F32);
    let g = Golden::open(tiny_dir().join("golden.safetensors"));
    let ids = g.ids("input_ids");
    let (hs, hidden) = g.f32("layer_out.3");
    let (sh, n) = (hs[1], 30);
    let mut a = model.new_mtp_state().unwrap();
    let all = model
        .mtp_forward(&mut a, &hidden[..n * sh], &ids[1..=n], false, None)
        .unwrap();
    let mut b = model.new_mtp_state().unwrap();
    let v = all.cols;
    for p in 0..n {
        let one = model
            .mtp_forward(
                &mut b,
                &hidden[p * sh..(p + 1) * sh],
                &[ids[p + 1]],
                false,
                None,
            )
            .unwrap();
        assert_eq!(one.logits, all.logits[p * v..(p + 1) * v], "logits row {p}");
        assert_eq!(
            one.hidden,
            all.hidden[p * sh..(p + 1) * sh],
            "hidden row {p}"
        );
    }
    assert_eq!(
        model.mtp_state_buffers(&a).unwrap(),
        model.mtp_state_buffers(&b).unwrap()
    );
    // last_only gives the last row's bits; truncation then re-running gives the same state.
    let mut c = model.new_mtp_state().unwrap();
    let last = model
        .mtp_forward(&mut c, &hidden[..n * sh], &ids[1..=n], true, None)
        .unwrap();
    assert_eq!(last.logits, all.logits[(n - 1) * v..]);
    // Only the last row's outputs are computed; the others only fill the caches, which must
    // be the full pass's.
    assert_eq!(last.hidden, all.hidden[(n - 1) * sh..]);
    assert_eq!(
        model.mtp_state_buffers(&a).unwrap(),
        model.mtp_state_buffers(&c).unwrap(),
        "last_only state"
    );
    model.mtp_truncate(&mut c, 13).unwrap();
    model
        .mtp_forward(&mut c, &hidden[13 * sh..n * sh], &ids[14..=n], false, None)
        .unwrap();
    assert_eq!(
        model.mtp_state_buffers(&a).unwrap(),
        model.mtp_state_buffers(&c).unwrap(),
        "truncate + replay"
    );
}

#[test]
fn draft_rows_equal_full_head_rows() {
    let model = tiny_with_mtp(OutType::F32);
    let g = Golden::open(tiny_dir().join("golden.safetensors"));
    let ids = g.ids("input_ids");
    let (hs, hidden) = g.f32("layer_out.3");
    let (sh, n) = (hs[1], 12);
    let rows: Vec<u32> = vec![299, 3, 0, 17, 150, 42, 319, 100];
    let mut a = model.new_mtp_state().unwrap();
    let full = model
        .mtp_forward(&mut a, &hidden[..n * sh], &ids[1..=n], false, None)
        .unwrap();
    let mut b = model.new_mtp_state().unwrap();
    let part = model
        .mtp_forward(&mut b, &hidden[..n * sh], &ids[1..=n], false, Some(&rows))
        .unwrap();
    assert_eq!(part.cols, rows.len());
    for r in 0..n {
        for (i, &id) in rows.iter().enumerate() {
            assert_eq!(
                part.logits[r * rows.len() + i].to_bits(),
                full.logits[r * full.cols + id as usize].to_bits(),
                "row {r}, token {id}"
            );
        }
    }
    let mut c = model.new_mtp_state().unwrap();
    let err = model
        .mtp_forward(&mut c, &hidden[..sh], &ids[1..2], false, Some(&[320]))
        .unwrap_err();
    assert!(err.to_string().contains("row 320"), "{err}");
}

#[test]
fn bf16_head_equals_f32_head_with_f32_activations() {
    // The fixture's weights are BF16 values, so a BF16 head met by f32 activations computes the
    // very same products as the F32 head.
    let g = Golden::open(tiny_dir().join("golden.safetensors"));
    let ids = g.ids("input_ids");
    let (hs, hidden) = g.f32("layer_out.3");
    let (sh, n) = (hs[1], 20);
    let run = |ty: OutType| {
        let be = CpuBackend::new(2)
            .unwrap()
            .with_float_activations(FloatActivations::F32);
        let mut m = tiny_model(be);
        m.attach_mtp(mtp_file(&tiny_dir().join("hf"), ty, false))
            .unwrap();
        let mut st = m.new_mtp_state().unwrap();
        m.mtp_forward(&mut st, &hidden[..n * sh], &ids[1..=n], false, None)
            .unwrap()
    };
    let a = run(OutType::F32);
    let b = run(OutType::Bf16);
    assert_eq!(a.logits, b.logits);
    // Q8_0 weights: close, not equal (the fixture's hc_up rows of 16 fall back to BF16).
    let q = run(OutType::Q8_0);
    let d = compare(&q.logits, &a.logits, a.cols, 0.0);
    eprintln!(
        "tiny MTP q8_0 vs f32: max|Δ| {:.3e}, mean {:.3e}",
        d.max_abs, d.mean_abs
    );
    assert!(d.mean_abs < 2e-2 && d.max_abs > 0.0, "{d:?}");
}

#[test]
fn head_inside_the_model_file_is_attached() {
    let trunk = GgufFile::open(tiny_dir().join("model-f32.gguf")).unwrap();
    let head = mtp_file(&tiny_dir().join("hf"), OutType::F32, false);
    let mut w = GgufWriter::from_file(&trunk).unwrap();
    for t in head.tensors() {
        let ty = head.tensor_type(t).unwrap();
        w.add_tensor(&t.name, &t.dims, ty, head.tensor_data(t).unwrap())
            .unwrap();
    }
    let file = Arc::new(GgufFile::from_bytes(w.to_bytes().unwrap(), "combined.gguf").unwrap());
    let combined =
        Model::from_file(file, CpuBackend::new(2).unwrap(), &LoadOptions::default()).unwrap();
    assert!(combined.has_mtp());
    let separate = tiny_with_mtp(OutType::F32);
    let g = Golden::open(tiny_dir().join("golden.safetensors"));
    let ids = g.ids("input_ids");
    let (hs, hidden) = g.f32("layer_out.3");
    let n = 16;
    let mut a = combined.new_mtp_state().unwrap();
    let mut b = separate.new_mtp_state().unwrap();
    let x = combined
        .mtp_forward(&mut a, &hidden[..n * hs[1]], &ids[1..=n], false, None)
        .unwrap();
    let y = separate
        .mtp_forward(&mut b, &hidden[..n * hs[1]], &ids[1..=n], false, None)
        .unwrap();
    assert_eq!(x.logits, y.logits);
}

/// A copy of the tiny HF directory whose safetensors file went through `edit`.
fn edited_checkpoint(tag: &str, edit: impl Fn(&str, &[usize]) -> Option<Vec<usize>>) -> PathBuf {
    use safetensors::tensor::TensorView;
    let src = tiny_dir().join("hf");
    let dir = std::env::temp_dir().join(format!("strata-mtp-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(src.join("config.json"), dir.join("config.json")).unwrap();
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut kept: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, t) in st.tensors() {
        let Some(shape) = edit(&name, t.shape()) else {
            continue;
        };
        let per: usize = t.shape().iter().product::<usize>().max(1);
        let width = t.data().len() / per;
        let n: usize = shape.iter().product();
        let mut data = t.data().to_vec();
        data.resize(n * width, 0);
        kept.push((name, t.dtype(), shape, data));
    }
    let views: Vec<(String, TensorView<'_>)> = kept
        .iter()
        .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::tensor::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
    dir
}

#[test]
fn converter_names_missing_and_misshaped_tensors() {
    let opts = ConvertOptions {
        out_type: OutType::F32,
        include_shared: false,
    };
    let dir = edited_checkpoint("missing", |n, s| {
        (n != "mtp.layers.0.self_attn.k_norm.weight").then(|| s.to_vec())
    });
    let err = convert_mtp(&dir, &opts)
        .err()
        .expect("conversion must fail");
    std::fs::remove_dir_all(&dir).ok();
    assert!(matches!(err, EngineError::MissingTensor { .. }), "{err}");
    assert!(
        err.to_string()
            .contains("mtp.layers.0.self_attn.k_norm.weight"),
        "{err}"
    );

    let dir = edited_checkpoint("shape", |n, s| {
        Some(if n == "mtp.fc_hidden.weight" {
            vec![64, 32]
        } else {
            s.to_vec()
        })
    });
    let err = convert_mtp(&dir, &opts)
        .err()
        .expect("conversion must fail");
    std::fs::remove_dir_all(&dir).ok();
    assert!(matches!(err, EngineError::TensorShape { .. }), "{err}");
    assert!(err.to_string().contains("mtp.fc_hidden.weight"), "{err}");
    assert!(err.to_string().contains("[64, 64]"), "{err}");

    let dir = edited_checkpoint("nomtp", |n, s| (!n.starts_with("mtp.")).then(|| s.to_vec()));
    let err = convert_mtp(&dir, &opts)
        .err()
        .expect("conversion must fail");
    std::fs::remove_dir_all(&dir).ok();
    assert!(err.to_string().contains("mtp."), "{err}");
}

#[test]
fn head_of_another_model_is_refused() {
    let Some(dir) = small_dir() else { return };
    let mut tiny = tiny_model(CpuBackend::new(2).unwrap());
    let err = tiny
        .attach_mtp(mtp_file(&dir.join("hf"), OutType::F32, false))
        .expect_err("a small head on the tiny trunk must be refused");
    let msg = err.to_string();
    assert!(msg.contains("qwen4exp_mtp.embedding_length"), "{msg}");
    assert!(!tiny.has_mtp());
    // Without a head, MTP calls say so.
    let err = tiny.new_mtp_state().err().unwrap();
    assert!(err.to_string().contains("no MTP head"), "{err}");
}

#[test]
fn sharded_checkpoint_converts_to_the_same_file() {
    use safetensors::tensor::TensorView;
    let src = tiny_dir().join("hf");
    let dir = std::env::temp_dir().join(format!("strata-mtp-shards-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(src.join("config.json"), dir.join("config.json")).unwrap();
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    // Two shards, the MTP layer's tensors split between them, and an index naming each.
    let mut shards: [Vec<(String, TensorView<'_>)>; 2] = [Vec::new(), Vec::new()];
    let mut map = serde_json::Map::new();
    for (i, (name, t)) in st.tensors().into_iter().enumerate() {
        let s = i % 2;
        let file = format!("model-0000{}-of-00002.safetensors", s + 1);
        map.insert(name.clone(), serde_json::Value::String(file));
        shards[s].push((name, t));
    }
    for (s, views) in shards.into_iter().enumerate() {
        let path = dir.join(format!("model-0000{}-of-00002.safetensors", s + 1));
        safetensors::tensor::serialize_to_file(views, None, &path).unwrap();
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": map});
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        serde_json::to_string(&index).unwrap(),
    )
    .unwrap();
    let opts = ConvertOptions {
        out_type: OutType::Q8_0,
        include_shared: true,
    };
    let (a, _) = convert_mtp(&dir, &opts).unwrap();
    let (b, _) = convert_mtp(&src, &opts).unwrap();
    std::fs::remove_dir_all(&dir).ok();
    let a = GgufFile::from_bytes(a.to_bytes().unwrap(), "sharded").unwrap();
    let b = GgufFile::from_bytes(b.to_bytes().unwrap(), "single").unwrap();
    assert_eq!(a.tensors().len(), b.tensors().len());
    for (x, y) in a.tensors().iter().zip(b.tensors()) {
        assert_eq!((&x.name, &x.dims, x.ty), (&y.name, &y.dims, y.ty));
        assert!(
            a.tensor_data(x).unwrap() == b.tensor_data(y).unwrap(),
            "{}: data differs",
            x.name
        );
    }
}

#[test]
fn converted_layout_follows_the_trunk_conventions() {
    // Norms carry 1 + w, the indexer projection is split, experts are split gate/up; every
    // matrix of the head has the shape the trunk's QSA layer has.
    let head = mtp_file(&tiny_dir().join("hf"), OutType::F32, false);
    let trunk = GgufFile::open(tiny_dir().join("model-f32.gguf")).unwrap();
    for t in head.tensors() {
        if let Some(rest) = t.name.strip_prefix("mtp.blk.0.") {
            let twin = trunk
                .tensor(&format!("blk.3.{rest}"))
                .unwrap_or_else(|| panic!("{} has no trunk counterpart", t.name));
            assert_eq!(t.dims, twin.dims, "{}", t.name);
        }
    }
    let f32s = |f: &GgufFile, n: &str| -> Vec<f32> {
        f.tensor_bytes(n)
            .unwrap()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    };
    let bytes = std::fs::read(tiny_dir().join("hf/model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let hf = |n: &str| -> Vec<f32> {
        st.tensor(n)
            .unwrap()
            .data()
            .chunks_exact(2)
            .map(|c| f32::from_bits(u32::from(u16::from_le_bytes([c[0], c[1]])) << 16))
            .collect()
    };
    let norm = f32s(&head, "mtp.pre_fc_norm_hidden.weight");
    let raw = hf("mtp.pre_fc_norm_hidden.weight");
    assert!(norm.iter().zip(&raw).all(|(a, b)| *a == 1.0 + b));
    let qk = hf("mtp.layers.0.self_attn.indexer.index_qk_proj.weight");
    let q = f32s(&head, "mtp.blk.0.indexer.q_proj.weight");
    let k = f32s(&head, "mtp.blk.0.indexer.k_proj.weight");
    assert_eq!([q.as_slice(), k.as_slice()].concat(), qk);
    let gu = hf("mtp.layers.0.mlp.experts.gate_up_proj"); // [8, 48, 64]
    let up = f32s(&head, "mtp.blk.0.ffn_up_exps.weight"); // {64, 24, 8}
    assert_eq!(up[..24 * 64], gu[24 * 64..48 * 64], "expert 0 up rows");
    assert_eq!(
        up[7 * 24 * 64..],
        gu[(7 * 48 + 24) * 64..8 * 48 * 64],
        "expert 7 up rows"
    );
    assert_eq!(
        head.get_str("general.architecture").unwrap(),
        "qwen4exp_mtp"
    );
}
