//! A scaled synthetic file (4 layers: three Gated DeltaNet and one QSA, 16 experts, the PLE
//! block, a 4,096-id vocabulary) written to disk and read back by the rest of the project: the
//! GGUF reader finds the plan's tensors at its shapes and types with valid values everywhere, the
//! tokenizer loads the vocabulary and round-trips text, the CPU engine loads the model and runs
//! a forward pass to finite, non-constant logits, and the MTP head (a separate file at the real
//! geometry) attaches and drafts. Writing twice gives the same bytes.

use std::path::PathBuf;
use std::sync::Arc;

use strata_engine::qwen4exp::{LoadOptions, Model, Want};
use strata_engine::CpuBackend;
use strata_gguf::GgufFile;
use strata_synth::{Fill, Options, WriteOptions};

struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        let d = std::env::temp_dir().join(format!("strata-synth-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        TempDir(d)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        std::fs::remove_dir_all(&self.0).ok();
    }
}

fn scaled() -> Options {
    Options {
        layers: 4,
        experts: 16,
        ple_rows_per_head: 4096,
        vocab: 4096,
        ctx: 4096,
        ..Options::default()
    }
}

fn write(plan: &strata_synth::Plan, path: &std::path::Path, seed: u64) {
    let wo = WriteOptions {
        seed,
        pool_bytes: 8 << 20,
        ..WriteOptions::default()
    };
    strata_synth::write(plan, path, &wo, &|_| {}).unwrap();
}

/// Every tensor as the reader sees it: the plan's shape and type, values finite, norms near 1,
/// decays negative.
fn check_file(file: &GgufFile, plan: &strata_synth::Plan) {
    assert_eq!(file.tensors().len(), plan.tensors.len());
    for (t, p) in file.tensors().iter().zip(&plan.tensors) {
        assert_eq!(t.name, p.name);
        assert_eq!(t.dims, p.ne, "{}", t.name);
        let ty = file.tensor_type(t).unwrap();
        assert_eq!(ty, p.ty, "{}", t.name);
        let data = file.tensor_data(t).unwrap();
        // The first and last 64 KiB of whole blocks (the whole tensor when smaller).
        let bs = ty.type_size();
        let k = (65_536 / bs).max(1) * bs;
        for part in [
            &data[..k.min(data.len())],
            &data[data.len() - k.min(data.len())..],
        ] {
            let mut v = vec![0f32; part.len() / bs * ty.block_size()];
            strata_quant::dequantize(ty, part, &mut v).unwrap();
            assert!(v.iter().all(|x| x.is_finite()), "{}: non-finite", t.name);
            match p.fill {
                Fill::Norm => assert!(v.iter().all(|x| (0.8..1.2).contains(x)), "{}", t.name),
                Fill::SsmA => assert!(v.iter().all(|&x| x < 0.0), "{}", t.name),
                Fill::Pool => {
                    let absmax = v.iter().fold(0f32, |a, &x| a.max(x.abs()));
                    assert!(absmax > 0.0 && absmax < 1.0, "{}: absmax {absmax}", t.name);
                }
                _ => {}
            }
        }
    }
}

#[test]
fn scaled_file_loads_runs_and_attaches_the_mtp_head() {
    let dir = TempDir::new("scaled");
    let o = scaled();
    let trunk = strata_synth::trunk_plan(&o).unwrap();
    let mtp = strata_synth::mtp_plan(&o).unwrap();
    let (tp, mp) = (dir.0.join("s.gguf"), dir.0.join("s-mtp.gguf"));
    write(&trunk, &tp, 5);
    write(&mtp, &mp, 5);

    let file = Arc::new(GgufFile::open(&tp).unwrap());
    check_file(&file, &trunk);
    check_file(&GgufFile::open(&mp).unwrap(), &mtp);
    assert!(trunk.tensor("per_layer_token_embd.weight").is_some());
    assert!(trunk.tensor("blk.3.indexer.q_proj.weight").is_some());

    let tok = strata_tokenizer::Tokenizer::from_gguf(&file).unwrap();
    let text = "Hello, synthetic world! 12345 <|im_start|>";
    let ids = tok.encode(text, false, true).unwrap();
    assert!(ids.len() < text.len(), "merges apply: {ids:?}");
    assert_eq!(tok.decode(&ids, true).unwrap(), text);
    assert_eq!(tok.token_id("<|im_end|>"), Some(4096 - 276 + 2));

    let mut model =
        Model::from_file(file, CpuBackend::new(2).unwrap(), &LoadOptions::default()).unwrap();
    assert_eq!(model.config().n_layer, 4);
    let mut st = model.new_state().unwrap();
    let want = Want {
        hidden: true,
        ..Want::default()
    };
    let out = model.forward_with(&mut st, &ids, want).unwrap();
    assert_eq!(out.rows(), ids.len());
    assert!(
        out.logits.iter().all(|x| x.is_finite()),
        "non-finite logits"
    );
    let row = out.row(ids.len() - 1).unwrap();
    let (lo, hi) = row
        .iter()
        .fold((f32::MAX, f32::MIN), |(a, b), &x| (a.min(x), b.max(x)));
    assert!(hi - lo > 1e-3, "constant logits: {lo}..{hi}");

    model.load_mtp(&mp).unwrap();
    assert!(model.has_mtp());
    let hidden = out.hidden.unwrap();
    let sh = model.config().residual_dim();
    let mut ms = model.new_mtp_state().unwrap();
    let next: Vec<u32> = ids[1..].to_vec();
    let m = model
        .mtp_forward(&mut ms, &hidden[..next.len() * sh], &next, true, None)
        .unwrap();
    assert!(!m.logits.is_empty() && m.logits.iter().all(|x| x.is_finite()));
}

#[test]
fn same_options_same_bytes_and_seed_changes_them() {
    let dir = TempDir::new("det");
    let o = Options {
        layers: 1,
        experts: 2,
        vocab: 1024,
        ..Options::default()
    };
    let plan = strata_synth::trunk_plan(&o).unwrap();
    let (a, b, c) = (dir.0.join("a"), dir.0.join("b"), dir.0.join("c"));
    write(&plan, &a, 9);
    write(&plan, &b, 9);
    write(&plan, &c, 10);
    let (a, b, c) = (
        std::fs::read(a).unwrap(),
        std::fs::read(b).unwrap(),
        std::fs::read(c).unwrap(),
    );
    assert!(a == b, "same seed, different bytes");
    assert_eq!(a.len(), c.len());
    assert!(a != c, "the seed changes nothing");
}

#[test]
fn an_existing_file_is_not_overwritten() {
    let dir = TempDir::new("exists");
    let p = dir.0.join("x.gguf");
    std::fs::write(&p, b"keep me").unwrap();
    let plan = strata_synth::trunk_plan(&Options {
        layers: 1,
        experts: 2,
        vocab: 1024,
        ..Options::default()
    })
    .unwrap();
    let e = strata_synth::write(&plan, &p, &WriteOptions::default(), &|_| {}).unwrap_err();
    assert!(e.to_string().contains("--force"), "{e}");
    assert_eq!(std::fs::read(&p).unwrap(), b"keep me");
}
