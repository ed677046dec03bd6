//! Apple: every kernel of the catalogue, in every specialization the report's shapes use,
//! parsed and validated by naga and translated to MSL the way wgpu's Metal backend does, so a
//! WGSL construct Metal cannot take is caught here, on a machine without a Mac. Needs no
//! adapter. (What this cannot show: Apple's compiler accepting the MSL, and the fast-math
//! rounding Metal compiles with; see docs.)

use naga::back::msl;
use naga::valid::{Capabilities, ValidationFlags, Validator};

#[test]
fn every_kernel_translates_to_msl() {
    let cat = strata_wgpu::shaders::catalogue();
    assert!(cat.len() > 90, "{} entries", cat.len());
    for module in strata_wgpu::shaders::modules() {
        assert!(
            cat.iter().any(|(m, _, _)| *m == module),
            "{module} not covered"
        );
    }
    let mut total = 0usize;
    for ((module, entry, spec), imm) in cat.iter().flat_map(|c| [(c, false), (c, true)]) {
        // Both parameter declarations: a uniform buffer, and immediates (what the device uses
        // where the adapter has them; setBytes on Metal).
        let src = strata_wgpu::shaders::source_for(module, spec, imm).unwrap();
        let m = naga::front::wgsl::parse_str(&src)
            .unwrap_or_else(|e| panic!("{module} {spec:?}: {}", e.emit_to_string(&src)));
        assert!(
            m.entry_points.iter().any(|e| e.name == *entry),
            "{module} has no entry {entry}"
        );
        let info = Validator::new(ValidationFlags::all(), Capabilities::all())
            .validate(&m)
            .unwrap_or_else(|e| panic!("{module} {spec:?}: {}", e.emit_to_string(&src)));
        let opts = msl::Options {
            lang_version: (2, 4),
            fake_missing_bindings: true,
            ..Default::default()
        };
        let popts = msl::PipelineOptions {
            entry_point: Some((naga::ShaderStage::Compute, entry.to_string())),
            ..Default::default()
        };
        let (out, _) = msl::write_string(&m, &info, &opts, &popts)
            .unwrap_or_else(|e| panic!("{module}::{entry} {spec:?} to MSL: {e}"));
        assert!(
            out.contains("kernel void"),
            "{module}::{entry}: no kernel in the MSL"
        );
        total += out.len();
    }
    eprintln!(
        "{} kernels, each with uniform and immediate parameters: {total} bytes of MSL",
        cat.len()
    );
}

#[test]
fn no_subgroup_operations() {
    // The bits must not depend on the subgroup size (8 on lavapipe, 32 on NVIDIA).
    for module in strata_wgpu::shaders::modules() {
        let src = strata_wgpu::shaders::source(module, &[]).unwrap();
        for w in ["subgroup", "quad"] {
            assert!(
                !src.lines()
                    .filter(|l| !l.trim_start().starts_with("//"))
                    .any(|l| l.contains(w)),
                "{module} uses {w} operations"
            );
        }
    }
}
