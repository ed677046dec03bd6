//! Run-time ISA selection. Each family's x86 kernels live in `<family>_x86.rs` and export
//! `dot(ty, isa) -> Option<DotFn>`; kernels are `#[target_feature]` functions behind safe
//! wrappers that are only handed out after `supported(isa)` said yes. Multi-row kernels (one
//! pass over a weight row for up to 8 activation rows, bitwise equal per row to `dot`'s) live
//! in `legacy_x86`, `lowbit_x86` and `rows_{iquants,kquants,fp}.rs`, handed out by
//! `dot_rows`; `tests/dot_rows.rs` holds them to the single-row kernels and benches them.

use crate::{DotFn, GgmlType};

/// Runs a multi-row kernel over `$xs` in groups of at most 8 rows: a group of `R` rows goes to
/// `$kernel::<R>(nb, w, [x; R]) -> [f32; R]`, a lone row to `$one(nb, w, x) -> f32` (raw
/// pointers). The expansion is unsafe code: the caller must have checked the kernels' CPU
/// features and that `$w` and every row hold `$nb` blocks ([`rows_blocks`]).
#[allow(unused_macros)]
macro_rules! rows_in_groups {
    ($kernel:ident, $one:expr, $nb:expr, $w:expr, $xs:expr, $out:expr) => {
        for (xc, oc) in $xs.chunks(8).zip($out.chunks_mut(8)) {
            macro_rules! go {
                ($r:literal) => {{
                    let p: [*const u8; $r] = core::array::from_fn(|i| xc[i].as_ptr());
                    // SAFETY: the caller of `rows_in_groups!` checked the CPU features and
                    // that every slice holds `nb` blocks.
                    oc.copy_from_slice(&unsafe { $kernel::<$r>($nb, $w.as_ptr(), p) });
                }};
            }
            match xc.len() {
                // SAFETY: as for `go!`.
                1 => oc[0] = unsafe { $one($nb, $w.as_ptr(), xc[0].as_ptr()) },
                2 => go!(2),
                3 => go!(3),
                4 => go!(4),
                5 => go!(5),
                6 => go!(6),
                7 => go!(7),
                _ => go!(8),
            }
        }
    };
}

/// Rows a multi-row call may touch and the blocks of `qk` elements that the weight row (blocks
/// of `wsize` bytes) and every activation row (`xsize`) hold: never more than the slices, so a
/// caller that breaks the length contract gets short sums, not out-of-bounds reads.
#[allow(dead_code)]
pub(crate) fn rows_blocks(
    n: usize,
    qk: usize,
    wsize: usize,
    xsize: usize,
    w: &[u8],
    xs: &[&[u8]],
    out: &[f32],
) -> (usize, usize) {
    let rows = xs.len().min(out.len());
    let nb = xs[..rows]
        .iter()
        .fold((n / qk).min(w.len() / wsize), |nb, x| {
            nb.min(x.len() / xsize)
        });
    (rows, nb)
}

pub mod fp_x86;
pub mod iquants_x86;
pub mod kquants_x86;
pub mod legacy_x86;
pub mod lowbit_x86;
pub mod quantize_x86;
pub mod rows_fp;
pub mod rows_iquants;
pub mod rows_kquants;

/// Instruction-set levels a kernel can target.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Isa {
    /// The scalar reference.
    Scalar,
    /// x86-64 AVX2 + FMA (+ F16C).
    Avx2,
    /// x86-64 AVX-512 F/BW/VL (+ VNNI, BF16 where the kernel says so).
    Avx512,
}

impl Isa {
    pub const ALL: [Isa; 3] = [Isa::Scalar, Isa::Avx2, Isa::Avx512];

    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
        }
    }
}

/// Whether this CPU can run kernels for `isa`.
pub fn supported(isa: Isa) -> bool {
    match isa {
        Isa::Scalar => true,
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => {
            is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c")
        }
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => {
            supported(Isa::Avx2)
                && is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vl")
                && is_x86_feature_detected!("avx512vnni")
                && is_x86_feature_detected!("avx512bf16")
        }
        #[cfg(not(target_arch = "x86_64"))]
        _ => false,
    }
}

/// The best ISA this CPU supports (overridable with `STRATA_ISA=scalar|avx2|avx512`).
pub fn best() -> Isa {
    static BEST: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
    *BEST.get_or_init(|| {
        let wanted = std::env::var("STRATA_ISA").ok();
        let order = [Isa::Avx512, Isa::Avx2, Isa::Scalar];
        if let Some(w) = wanted {
            if let Some(i) = order.iter().find(|i| i.name() == w) {
                if supported(*i) {
                    return *i;
                }
            }
        }
        order
            .into_iter()
            .find(|i| supported(*i))
            .unwrap_or(Isa::Scalar)
    })
}

/// The SIMD kernel for `ty` on `isa`, if a family has one. Callers check `supported(isa)`.
pub(crate) fn dot(ty: GgmlType, isa: Isa) -> Option<DotFn> {
    if isa == Isa::Scalar {
        return None;
    }
    fp_x86::dot(ty, isa)
        .or_else(|| legacy_x86::dot(ty, isa))
        .or_else(|| lowbit_x86::dot(ty, isa))
        .or_else(|| kquants_x86::dot(ty, isa))
        .or_else(|| iquants_x86::dot(ty, isa))
}

/// Multi-row kernels (one weight row against up to 8 activation rows per pass; callers may hand
/// any number of rows, the kernels loop in groups of 8). Each gives, per row, the bits of
/// [`dot`]'s kernel for the same `ty` and `isa`. Callers check `supported(isa)`.
pub(crate) fn dot_rows(ty: GgmlType, isa: Isa) -> Option<crate::DotRowsFn> {
    if isa == Isa::Scalar {
        return None;
    }
    legacy_x86::dot_rows(ty, isa)
        .or_else(|| lowbit_x86::dot_rows(ty, isa))
        .or_else(|| rows_iquants::dot_rows(ty, isa))
        .or_else(|| rows_kquants::dot_rows(ty, isa))
        .or_else(|| rows_fp::dot_rows(ty, isa))
}
