//! The WGSL sources: each module is a header (the format ids and the specialization constants
//! of the variant), `common.wgsl`, the block decoders where the module reads quantized bytes,
//! and the module's own file. A specialization is text (`const SPEC_N: u32 = 2560u;`), so the
//! same source that runs is the one the naga tests translate to MSL.

use strata_quant::GgmlType;

use crate::WgpuError;

const COMMON: &str = include_str!("../shaders/common.wgsl");
const QUANTS: &str = include_str!("../shaders/quants.wgsl");

/// (name, file, storage bindings after the parameter block, reads quantized bytes, the
/// specialization constants its optimized entry uses with their types).
struct Module {
    name: &'static str,
    src: &'static str,
    storage: usize,
    quants: bool,
    spec: &'static [(&'static str, &'static str)],
}

const MODULES: &[Module] = &[
    Module {
        name: "norm",
        src: include_str!("../shaders/norm.wgsl"),
        storage: 3,
        quants: false,
        spec: &[
            ("SPEC_N", "u32"),
            ("SPEC_FMT", "u32"),
            ("SPEC_NORM", "bool"),
        ],
    },
    Module {
        name: "combine",
        src: include_str!("../shaders/combine.wgsl"),
        storage: 5,
        quants: false,
        spec: &[("SPEC_N", "u32"), ("SPEC_S", "u32")],
    },
    Module {
        name: "embed",
        src: include_str!("../shaders/embed.wgsl"),
        storage: 4,
        quants: true,
        spec: &[
            ("SPEC_TY", "u32"),
            ("SPEC_N", "u32"),
            ("SPEC_RB", "u32"),
            ("SPEC_BS", "u32"),
            ("SPEC_TS", "u32"),
        ],
    },
    Module {
        name: "gemv",
        src: include_str!("../shaders/gemv.wgsl"),
        storage: 4,
        quants: true,
        spec: &[
            ("SPEC_TY", "u32"),
            ("SPEC_K", "u32"),
            ("SPEC_NT", "u32"),
            ("SPEC_WRB", "u32"),
            ("SPEC_XRB", "u32"),
            ("SPEC_BS", "u32"),
            ("SPEC_TS", "u32"),
            ("SPEC_XF", "u32"),
        ],
    },
    Module {
        name: "route",
        src: include_str!("../shaders/route.wgsl"),
        storage: 3,
        quants: false,
        spec: &[("SPEC_E", "u32"), ("SPEC_K", "u32")],
    },
    Module {
        name: "slop",
        src: include_str!("../shaders/slop.wgsl"),
        storage: 5,
        quants: false,
        spec: &[],
    },
    Module {
        name: "selftest",
        src: include_str!("../shaders/selftest.wgsl"),
        storage: 3,
        quants: false,
        spec: &[],
    },
    Module {
        name: "model",
        src: include_str!("../shaders/model.wgsl"),
        storage: 8,
        quants: false,
        spec: &[],
    },
    Module {
        name: "mq",
        src: include_str!("../shaders/mq.wgsl"),
        storage: 5,
        quants: true,
        spec: &[
            ("SPEC_TY", "u32"),
            ("SPEC_HWF16", "bool"),
            ("SPEC_R", "u32"),
            ("SPEC_BS", "u32"),
            ("SPEC_TS", "u32"),
        ],
    },
    Module {
        name: "pick",
        src: include_str!("../shaders/pick.wgsl"),
        storage: 4,
        quants: false,
        spec: &[],
    },
];

/// The module names, in catalogue order.
pub fn modules() -> Vec<&'static str> {
    MODULES.iter().map(|m| m.name).collect()
}

fn find(name: &str) -> Result<&'static Module, WgpuError> {
    MODULES
        .iter()
        .find(|m| m.name == name)
        .ok_or_else(|| WgpuError::Shader {
            module: name.into(),
            msg: "no such module".into(),
        })
}

/// Storage bindings (after the parameter block) of `module`.
pub fn storage_bindings(module: &str) -> Result<usize, WgpuError> {
    Ok(find(module)?.storage)
}

/// The format ids of the decoders.
pub const FORMATS: [(&str, GgmlType); 13] = [
    ("T_BF16", GgmlType::BF16),
    ("T_Q8_0", GgmlType::Q8_0),
    ("T_Q4_0", GgmlType::Q4_0),
    ("T_Q5_0", GgmlType::Q5_0),
    ("T_IQ4_NL", GgmlType::IQ4_NL),
    ("T_IQ4_XS", GgmlType::IQ4_XS),
    ("T_Q2_0", GgmlType::Q2_0),
    ("T_IQ3_S", GgmlType::IQ3_S),
    ("T_Q3_K", GgmlType::Q3_K),
    ("T_Q4_K", GgmlType::Q4_K),
    ("T_Q5_K", GgmlType::Q5_K),
    ("T_Q6_K", GgmlType::Q6_K),
    ("T_IQ3_XXS", GgmlType::IQ3_XXS),
];

/// The formats the model's decoders read besides the report's 13: floats as the file has
/// them, and the other formats of published quantizations (IQ2_XS, IQ2_S, MXFP4, NVFP4, and
/// since session 6 Q4_1, Q5_1, Q2_K, IQ2_XXS, IQ1_S, IQ1_M, TQ1_0, TQ2_0, Q1_0).
pub const FLOAT_FORMATS: [(&str, GgmlType); 15] = [
    ("T_F32", GgmlType::F32),
    ("T_F16", GgmlType::F16),
    ("T_IQ2_XS", GgmlType::IQ2_XS),
    ("T_IQ2_S", GgmlType::IQ2_S),
    ("T_MXFP4", GgmlType::MXFP4),
    ("T_NVFP4", GgmlType::NVFP4),
    ("T_Q4_1", GgmlType::Q4_1),
    ("T_Q5_1", GgmlType::Q5_1),
    ("T_Q2_K", GgmlType::Q2_K),
    ("T_IQ2_XXS", GgmlType::IQ2_XXS),
    ("T_IQ1_S", GgmlType::IQ1_S),
    ("T_IQ1_M", GgmlType::IQ1_M),
    ("T_TQ1_0", GgmlType::TQ1_0),
    ("T_TQ2_0", GgmlType::TQ2_0),
    ("T_Q1_0", GgmlType::Q1_0),
];

/// The full source of `module` with the specialization `spec` (constants not given are 1,
/// false for booleans: the baseline entry does not read them), parameters in a uniform buffer.
pub fn source(module: &str, spec: &[(&str, String)]) -> Result<String, WgpuError> {
    source_for(module, spec, false)
}

/// [`source`] with the parameter block as immediates (push constants) when `immediates`.
pub fn source_for(
    module: &str,
    spec: &[(&str, String)],
    immediates: bool,
) -> Result<String, WgpuError> {
    let m = find(module)?;
    let mut s = String::new();
    s.push_str(if immediates {
        "var<immediate> P: Params;\n"
    } else {
        "@group(0) @binding(0) var<uniform> P: Params;\n"
    });
    for (name, ty) in FORMATS.iter().chain(&FLOAT_FORMATS) {
        s.push_str(&format!("const {name}: u32 = {}u;\n", ty.id()));
    }
    for (name, ty) in m.spec {
        let v = spec
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str());
        let lit = match (*ty, v) {
            ("bool", Some(v)) => v.to_string(),
            ("bool", None) => "false".to_string(),
            (_, Some(v)) => format!("{v}u"),
            (_, None) => "1u".to_string(),
        };
        s.push_str(&format!("const {name}: {ty} = {lit};\n"));
    }
    if let Some((n, _)) = spec
        .iter()
        .find(|(n, _)| !m.spec.iter().any(|(k, _)| k == n))
    {
        return Err(WgpuError::Shader {
            module: module.into(),
            msg: format!("unknown specialization constant {n}"),
        });
    }
    s.push_str(COMMON);
    if m.quants {
        s.push_str(QUANTS);
    }
    s.push_str(m.src);
    Ok(s)
}

/// The grid tables of the decoders as one u32 array (layout: quants.wgsl).
pub fn grid_table() -> Vec<u32> {
    use strata_quant::grids::{
        IQ1S_GRID, IQ2S_GRID, IQ2XS_GRID, IQ2XXS_GRID, IQ3S_GRID, IQ3XXS_GRID, KSIGNS_IQ2XS,
        KVALUES_IQ4NL,
    };
    let mut t = Vec::with_capacity(4496 + 4096);
    t.extend_from_slice(&IQ3S_GRID);
    t.extend_from_slice(&IQ3XXS_GRID);
    t.extend(KSIGNS_IQ2XS.iter().map(|&v| v as u32));
    t.extend(KVALUES_IQ4NL.iter().map(|&v| v as i32 as u32));
    // IQ2_XS's 8-byte entries as (low, high) words, at 912.
    t.extend(
        IQ2XS_GRID
            .iter()
            .flat_map(|&g| [g as u32, (g >> 32) as u32]),
    );
    // IQ2_S's 8-byte entries likewise, at 1936.
    t.extend(IQ2S_GRID.iter().flat_map(|&g| [g as u32, (g >> 32) as u32]));
    // IQ2_XXS's at 3984, IQ1_S's (signed bytes; IQ1_M shares it) at 4496.
    debug_assert_eq!(t.len(), 3984);
    t.extend(
        IQ2XXS_GRID
            .iter()
            .flat_map(|&g| [g as u32, (g >> 32) as u32]),
    );
    debug_assert_eq!(t.len(), 4496);
    t.extend(IQ1S_GRID.iter().flat_map(|&g| [g as u32, (g >> 32) as u32]));
    t
}

/// A specialization: constant names and their WGSL values.
pub type Spec = Vec<(&'static str, String)>;

pub fn spec_norm(n: usize, fmt: strata_engine::kernels::ActFmt, norm: bool) -> Spec {
    vec![
        ("SPEC_N", n.to_string()),
        ("SPEC_FMT", fmt.code().to_string()),
        ("SPEC_NORM", norm.to_string()),
    ]
}

pub fn spec_combine(n: usize, streams: usize) -> Spec {
    vec![("SPEC_N", n.to_string()), ("SPEC_S", streams.to_string())]
}

/// `None` when the row length is not whole blocks.
pub fn spec_embed(ty: GgmlType, n: usize) -> Option<Spec> {
    let rb = ty.row_bytes(n)?;
    Some(vec![
        ("SPEC_TY", ty.id().to_string()),
        ("SPEC_N", n.to_string()),
        ("SPEC_RB", rb.to_string()),
        ("SPEC_BS", ty.block_size().to_string()),
        ("SPEC_TS", ty.type_size().to_string()),
    ])
}

/// `None` when the shapes are not whole blocks or the weight has no paired activation.
pub fn spec_gemv(ty: GgmlType, k: usize, nt: usize) -> Option<Spec> {
    let fmt = strata_engine::kernels::ActFmt::for_weight(ty)?;
    Some(vec![
        ("SPEC_TY", ty.id().to_string()),
        ("SPEC_K", k.to_string()),
        ("SPEC_NT", nt.to_string()),
        ("SPEC_WRB", ty.row_bytes(k)?.to_string()),
        ("SPEC_XRB", fmt.row_bytes(k)?.to_string()),
        ("SPEC_BS", ty.block_size().to_string()),
        ("SPEC_TS", ty.type_size().to_string()),
        ("SPEC_XF", fmt.code().to_string()),
    ])
}

/// `mq::mmr`'s specialization: the weight format, its block shape and `rows` outputs per
/// workgroup.
pub fn spec_mmr(ty: GgmlType, hw_f16: bool, rows: usize) -> Spec {
    vec![
        ("SPEC_TY", ty.id().to_string()),
        ("SPEC_HWF16", hw_f16.to_string()),
        ("SPEC_R", rows.to_string()),
        ("SPEC_BS", ty.block_size().to_string()),
        ("SPEC_TS", ty.type_size().to_string()),
    ]
}

pub fn spec_route(n_exp: usize, k: usize) -> Spec {
    vec![("SPEC_E", n_exp.to_string()), ("SPEC_K", k.to_string())]
}

/// The entries of `model.wgsl` (the whole-model backend's f32 operations).
pub const MODEL_ENTRIES: [&str; 21] = [
    "copy_rows",
    "write_rows",
    "eltwise",
    "rms_norm",
    "rms_norm_lanes1",
    "rms_norm_wg",
    "rope",
    "attend",
    "attend_wg",
    "hc_u",
    "hc_combine",
    "conv_silu",
    "conv_tail",
    "gdn_gates",
    "gdn",
    "gdn_wg",
    "qsa_pool",
    "qsa_score",
    "qsa_select",
    "ple_gate",
    "moe_sum",
];

/// Every (module, entry, specialization) the catalogue's report shapes compile: what the
/// MSL translation test covers.
pub fn catalogue() -> Vec<(&'static str, &'static str, Spec)> {
    use strata_engine::kernels::ActFmt;
    let mut v: Vec<(&'static str, &'static str, Spec)> = vec![
        ("norm", "rms_xprep_base", vec![]),
        ("combine", "combine_gnorm_base", vec![]),
        ("combine", "combine_gnorm_opt", spec_combine(2560, 4)),
        ("embed", "embed_base", vec![]),
        ("gemv", "gemv_base", vec![]),
        ("route", "route_base", vec![]),
        ("route", "route_opt", spec_route(512, 10)),
        ("route", "route_opt", spec_route(256, 8)),
        ("slop", "slop_pen_base", vec![]),
        ("slop", "slop_pen_opt", vec![]),
        ("pick", "pick_base", vec![]),
        ("pick", "pick_opt1", vec![]),
        ("pick", "pick_opt2", vec![]),
        ("selftest", "arith", vec![]),
    ];
    for entry in MODEL_ENTRIES {
        v.push(("model", entry, vec![]));
    }
    for (_, ty) in FORMATS.iter().chain(&FLOAT_FORMATS) {
        for entry in ["mm", "mm1", "gather"] {
            for hw in [false, true] {
                v.push((
                    "mq",
                    entry,
                    vec![
                        ("SPEC_TY", ty.id().to_string()),
                        ("SPEC_HWF16", hw.to_string()),
                    ],
                ));
            }
        }
    }
    for (_, ty) in FORMATS.iter().chain(&FLOAT_FORMATS) {
        v.push(("mq", "mmr", spec_mmr(*ty, true, 8)));
        v.push(("mq", "mmb", spec_mmr(*ty, true, 8)));
        v.push(("mq", "mmt", spec_mmr(*ty, true, 8)));
    }
    for n in [2560usize, 10240] {
        for fmt in ActFmt::ALL {
            for norm in [true, false] {
                v.push(("norm", "rms_xprep_opt", spec_norm(n, fmt, norm)));
            }
        }
    }
    for ty in strata_engine::kernels::embed::REPORT_FORMATS {
        if let Some(s) = spec_embed(ty, 2560) {
            v.push(("embed", "embed_opt", s));
        }
    }
    for ty in strata_engine::kernels::gemv::GEMV_FORMATS {
        for nt in 1..=8 {
            if let Some(s) = spec_gemv(ty, 2560, nt) {
                v.push(("gemv", "gemv_opt", s));
            }
        }
    }
    v
}
