//! The CPU's catalogue kernels are its live implementation (issue "Boundary", point 3): `route`,
//! `embed` (the dequantizers), `xprep` (the activation quantizers) and `rms_norm` run through
//! the variant registry, resolved once when the backend is created (point 4: a forward pass
//! makes no registry lookup). Selecting another variant changes what the model executes — the
//! registry's use counts show the switch is taken — and the same-bits variants give
//! bit-identical logits. `rms_norm`'s `lanes` variant (the GPU's summation order) is taken too
//! and stays within rounding of the CPU's order.
//!
//! One test in this binary, so no other test's backend creation races the selection or the
//! lookup counter.

mod common;

use std::path::PathBuf;

use common::{small_dir, tiny_dir};
use strata_engine::kernels::norm::LANES_VARIANT;
use strata_engine::kernels::registry::{self, BASELINE, OPTIMIZED};
use strata_engine::qwen4exp::{LoadOptions, Model};
use strata_engine::CpuBackend;

/// Logits of a 19-token prompt (prefill) and one decode step after it, on a backend created
/// under the current selection; also the registry lookups the forward passes made.
fn logits(path: &PathBuf) -> (Vec<f32>, u64) {
    let model = Model::load(path, CpuBackend::new(1).unwrap(), &LoadOptions::default())
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut st = model.new_state().unwrap();
    let prompt: Vec<u32> = (1..20).collect();
    let lookups = registry::lookups();
    let mut out = model.forward(&mut st, &prompt).unwrap().logits;
    out.extend(model.forward(&mut st, &[7]).unwrap().logits);
    (out, registry::lookups() - lookups)
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn catalogue_ops_are_the_cpu_path_resolved_once_and_switchable() {
    let mut models = vec![tiny_dir().join("model-f32.gguf")];
    if let Some(d) = small_dir() {
        // Quantized weights: Q8_0 and Q8_K activation images, quantized embedding tables.
        models.push(d.join("q8_0.gguf"));
        models.push(d.join("q2_0-mix.gguf"));
    }
    let ops = ["route", "embed", "xprep", "rms_norm"];
    for path in &models {
        registry::clear_selection();
        let (reference, lookups) = logits(path);
        assert_eq!(
            lookups,
            0,
            "{}: the forward passes looked the registry up",
            path.display()
        );
        for variant in [BASELINE, OPTIMIZED] {
            registry::select("*", variant).unwrap();
            let before: Vec<u64> = ops
                .iter()
                .map(|op| registry::use_count(op, variant))
                .collect();
            let (got, _) = logits(path);
            for (op, b) in ops.iter().zip(&before) {
                assert!(
                    registry::use_count(op, variant) > *b,
                    "{}: {op}={variant} selected but not run by the model",
                    path.display()
                );
            }
            assert_eq!(
                bits(&got),
                bits(&reference),
                "{}: *={variant} changed the logits",
                path.display()
            );
        }
        // The GPU's summation order for the RMS norm: taken, other bits, within rounding.
        registry::clear_selection();
        registry::select("rms_norm", LANES_VARIANT).unwrap();
        let before = registry::use_count("rms_norm", LANES_VARIANT);
        let (lanes, _) = logits(path);
        assert!(registry::use_count("rms_norm", LANES_VARIANT) > before);
        let scale = reference.iter().fold(0f32, |m, v| m.max(v.abs()));
        let worst = lanes
            .iter()
            .zip(&reference)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        eprintln!(
            "{}: rms_norm=lanes: worst {worst}, max |logit| {scale}",
            path.display()
        );
        // F32 weights: f32 rounding of the norms, carried through the layers. Quantized
        // activations: the other order moves some values across a Q8 rounding step, which
        // the products amplify (the size of the CUDA-vs-CPU agreement, docs/CUDA.md).
        let bound = if path.ends_with("model-f32.gguf") {
            1e-4
        } else {
            5e-2
        };
        assert!(
            worst <= bound * scale.max(1.0),
            "{}: rms_norm=lanes moved a logit by {worst} (max |logit| {scale})",
            path.display()
        );
    }
    registry::clear_selection();
}
