//! The prepared-activation operations on the CPU (`Backend::prepare`, `rms_norm_prepared`,
//! `matmul_prepared`, `matmuls_prepared`, `reshape_prepared`, `moe_experts_prepared`) against
//! the plain operations on the f32 rows, bit for bit: every activation pairing the models use
//! (Q8_0, Q8_K, BF16, F16 and F32 activations), one to nine rows, both float-activation modes.
//! The images must also be what the products read: a product of prepared rows runs no
//! activation quantizer (the registry's use count of `xprep` does not move), where the plain
//! product runs one. The F16 pairing goes through the registry's `xprep_pair` in the selected
//! variant. One test function: the use counts and the selection are process-wide.

use std::sync::Arc;

use strata_engine::backend::ExpertWeights;
use strata_engine::kernels::registry;
use strata_engine::{Backend, CpuBackend, DeviceWeight, FloatActivations};
use strata_gguf::{GgufFile, GgufWriter, Value};
use strata_quant::GgmlType;

const K: usize = 512;
/// Expert geometry: `E` experts of `F` hidden units.
const E: usize = 4;
const F: usize = 64;

fn values(seed: u64, n: usize) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2.0
        })
        .collect()
}

/// (name, type, dims in ggml order).
const WEIGHTS: [(&str, GgmlType, &[usize]); 12] = [
    ("q8_0", GgmlType::Q8_0, &[K, 24]),
    ("q4_k", GgmlType::Q4_K, &[K, 17]),
    ("q6_k", GgmlType::Q6_K, &[K, 9]),
    ("bf16", GgmlType::BF16, &[K, 12]),
    ("f16", GgmlType::F16, &[K, 7]),
    ("f32", GgmlType::F32, &[K, 5]),
    ("norm", GgmlType::F32, &[K]),
    ("q8_0_256", GgmlType::Q8_0, &[256, 6]),
    ("q4_k_256", GgmlType::Q4_K, &[256, 5]),
    ("gate_exps", GgmlType::Q8_0, &[K, F, E]),
    ("up_exps", GgmlType::Q4_K, &[K, F, E]),
    ("down_exps", GgmlType::Q8_0, &[F, K, E]),
];

fn file() -> Arc<GgufFile> {
    let mut w = GgufWriter::new();
    w.add_kv("general.architecture", Value::String("test".into()));
    for (i, (name, ty, dims)) in WEIGHTS.iter().enumerate() {
        let n: usize = dims.iter().product();
        let row = dims[0];
        let x = values(i as u64 + 1, n);
        let rb = ty.row_bytes(row).unwrap();
        let mut bytes = vec![0u8; rb * n / row];
        for (src, dst) in x.chunks(row).zip(bytes.chunks_mut(rb)) {
            strata_quant::quantize(*ty, src, dst).unwrap();
        }
        let dims: Vec<u64> = dims.iter().map(|&d| d as u64).collect();
        w.add_tensor_owned(name, &dims, *ty, bytes).unwrap();
    }
    Arc::new(GgufFile::from_bytes(w.to_bytes().unwrap(), "prepared.gguf").unwrap())
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Activation quantizer calls so far (either variant).
fn xprep_uses() -> u64 {
    registry::use_count("xprep", "optimized") + registry::use_count("xprep", "baseline")
}

#[test]
fn prepared_products_equal_the_plain_products_and_read_the_images() {
    let f = file();
    for mode in [FloatActivations::Paired, FloatActivations::F32] {
        let b = CpuBackend::new(2).unwrap().with_float_activations(mode);
        let load = |name: &str| b.load_weight(&f, f.tensor(name).unwrap()).unwrap();
        let mats: Vec<_> = ["q8_0", "q4_k", "q6_k", "bf16", "f16", "f32"]
            .iter()
            .map(|n| load(n))
            .collect();
        let refs: Vec<_> = mats.iter().collect();
        let norm = load("norm");
        let narrow = [load("q8_0_256"), load("q4_k_256")];
        let (gate, up, down) = (load("gate_exps"), load("up_exps"), load("down_exps"));
        for rows in [1usize, 2, 3, 8, 9] {
            let what = format!("rows={rows} {mode:?}");
            let x = b
                .upload(rows, K, &values(100 + rows as u64, rows * K))
                .unwrap();
            let plain: Vec<Vec<f32>> = refs
                .iter()
                .map(|w| b.download(&b.matmul(w, &x).unwrap()).unwrap())
                .collect();

            // prepare → matmul_prepared / matmuls_prepared.
            let p = b.prepare(b.copy(&x).unwrap(), &refs).unwrap();
            let before = xprep_uses();
            for (w, want) in refs.iter().zip(&plain) {
                let got = b.download(&b.matmul_prepared(w, &p).unwrap()).unwrap();
                assert_eq!(bits(&got), bits(want), "{} {what}", w.name());
            }
            let many = b
                .matmuls_prepared([refs[0], refs[1], refs[3], refs[5]], &p)
                .unwrap();
            for (y, i) in many.iter().zip([0, 1, 3, 5]) {
                assert_eq!(bits(&b.download(y).unwrap()), bits(&plain[i]), "{what}");
            }
            // F16 pairs outside the catalogue's four formats but is prepared all the same.
            assert_eq!(
                xprep_uses(),
                before,
                "products of prepared rows quantized again ({what})"
            );
            if mode == FloatActivations::Paired {
                let before = xprep_uses();
                b.matmul(refs[0], &x).unwrap();
                assert!(xprep_uses() > before, "a plain Q8_0 product runs xprep");
            }

            // rms_norm_prepared: the norm's bits, and the products of its rows.
            let np = b
                .rms_norm_prepared(&x, &norm, K, 1e-6, &[refs[0], refs[2]])
                .unwrap();
            let n = b.rms_norm(&x, &norm, K, 1e-6).unwrap();
            assert_eq!(
                bits(&b.download(&np.rows).unwrap()),
                bits(&b.download(&n).unwrap()),
                "{what}"
            );
            for w in [refs[0], refs[2]] {
                assert_eq!(
                    bits(&b.download(&b.matmul_prepared(w, &np).unwrap()).unwrap()),
                    bits(&b.download(&b.matmul(w, &n).unwrap()).unwrap()),
                    "norm → {} {what}",
                    w.name()
                );
            }

            // reshape_prepared: rows of K prepared for products of rows of 256 (the MTP
            // head's norm over every stream, then one product per stream).
            let nr: Vec<&_> = narrow.iter().collect();
            let p = b.prepare(b.copy(&x).unwrap(), &nr).unwrap();
            let p = b.reshape_prepared(p, rows * 2, 256).unwrap();
            let xr = b.reshape(b.copy(&x).unwrap(), rows * 2, 256).unwrap();
            let before = xprep_uses();
            let got: Vec<Vec<f32>> = narrow
                .iter()
                .map(|w| b.download(&b.matmul_prepared(w, &p).unwrap()).unwrap())
                .collect();
            assert_eq!(
                xprep_uses(),
                before,
                "reshaped images were not read ({what})"
            );
            for (w, got) in narrow.iter().zip(&got) {
                let want = b.download(&b.matmul(w, &xr).unwrap()).unwrap();
                assert_eq!(bits(got), bits(&want), "reshaped {} {what}", w.name());
            }

            // moe_experts_prepared: each expert reads its rows of one image of x.
            let logits = b
                .upload(rows, E, &values(7 + rows as u64, rows * E))
                .unwrap();
            let routes = b.route(&logits, 2).unwrap();
            let ex = ExpertWeights {
                gate: &gate,
                up: &up,
                down: &down,
            };
            let before = xprep_uses();
            let want = b
                .download(&b.moe_experts(&ex, &x, &routes).unwrap())
                .unwrap();
            let plain_uses = xprep_uses() - before;
            let p = b.prepare(b.copy(&x).unwrap(), &[&gate, &up]).unwrap();
            let before = xprep_uses();
            let got = b
                .download(&b.moe_experts_prepared(&ex, &p, &routes).unwrap())
                .unwrap();
            let prepared_uses = xprep_uses() - before;
            assert_eq!(bits(&got), bits(&want), "moe_experts {what}");
            // Only the down products' inputs are quantized now.
            assert!(
                prepared_uses < plain_uses,
                "{prepared_uses} vs {plain_uses} ({what})"
            );
        }
        // The F16 pairing runs the registry's `xprep_pair` (no direct quantizer call): both
        // variants are taken when selected and give the same products.
        if mode == FloatActivations::Paired {
            let x = b.upload(3, K, &values(11, 3 * K)).unwrap();
            let want = bits(&b.download(&b.matmul(refs[4], &x).unwrap()).unwrap());
            for variant in [registry::BASELINE, registry::OPTIMIZED] {
                registry::select("xprep_pair", variant).unwrap();
                let bv = CpuBackend::new(2).unwrap();
                let w16 = bv.load_weight(&f, f.tensor("f16").unwrap()).unwrap();
                let before = registry::use_count("xprep_pair", variant);
                let got = bits(&bv.download(&bv.matmul(&w16, &x).unwrap()).unwrap());
                assert!(
                    registry::use_count("xprep_pair", variant) > before,
                    "{variant}"
                );
                assert_eq!(got, want, "xprep_pair={variant}");
            }
            registry::clear_selection();
        }
        // A weight whose rows do not divide the prepared rows is refused, naming it.
        let x = b.upload(2, K, &values(9, 2 * K)).unwrap();
        let xs = b.reshape(b.copy(&x).unwrap(), 4, 256).unwrap();
        let err = b.prepare(xs, &[refs[0]]).err().unwrap().to_string();
        assert!(err.contains("q8_0") && err.contains("256"), "{err}");
    }
}
