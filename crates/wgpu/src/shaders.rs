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
        spec: &[("SPEC_N", "u32"), ("SPEC_FMT", "u32"), ("SPEC_NORM", "bool")],
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

/// The full source of `module` with the specialization `spec` (constants not given are 1,
/// false for booleans: the baseline entry does not read them).
pub fn source(module: &str, spec: &[(&str, String)]) -> Result<String, WgpuError> {
    let m = find(module)?;
    let mut s = String::new();
    for (name, ty) in FORMATS {
        s.push_str(&format!("const {name}: u32 = {}u;\n", ty.id()));
    }
    for (name, ty) in m.spec {
        let v = spec.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str());
        let lit = match (*ty, v) {
            ("bool", Some(v)) => v.to_string(),
            ("bool", None) => "false".to_string(),
            (_, Some(v)) => format!("{v}u"),
            (_, None) => "1u".to_string(),
        };
        s.push_str(&format!("const {name}: {ty} = {lit};\n"));
    }
    if let Some((n, _)) = spec.iter().find(|(n, _)| !m.spec.iter().any(|(k, _)| k == n)) {
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
    use strata_quant::grids::{IQ3S_GRID, IQ3XXS_GRID, KSIGNS_IQ2XS, KVALUES_IQ4NL};
    let mut t = Vec::with_capacity(912);
    t.extend_from_slice(&IQ3S_GRID);
    t.extend_from_slice(&IQ3XXS_GRID);
    t.extend(KSIGNS_IQ2XS.iter().map(|&v| v as u32));
    t.extend(KVALUES_IQ4NL.iter().map(|&v| v as i32 as u32));
    t
}
