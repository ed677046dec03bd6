//! strata-quant: the ggml block formats. It owns the type table, dequantization, weight and
//! activation quantizers, and dot products: a scalar reference per weight type, with a
//! documented accumulation order, and x86 AVX2 / AVX-512 versions that are bitwise equal to it.
//!
//! Families live one per module (`fp`, `legacy`, `lowbit`, `kquants`, `iquants`); each exports
//! `fns(ty) -> Option<FormatFns>` for its types, and its SIMD code exports
//! `simd::<family>_x86::dot(ty, isa) -> Option<DotFn>`. This file only dispatches and checks
//! lengths, so a caller never hands a kernel a slice of the wrong size.

pub mod dot;
pub mod fp;
pub mod grids;
pub mod iquants;
pub mod kquants;
pub mod legacy;
pub mod lowbit;
pub mod simd;
pub mod synth;
pub mod types;

pub use simd::Isa;
pub use types::{GgmlType, TypeInfo, TYPES};

/// Dequantize whole blocks: `src` holds `dst.len() / block_size` blocks.
pub type DequantFn = fn(src: &[u8], dst: &mut [f32]);
/// Quantize `src` (a whole number of blocks) into `dst`.
pub type QuantFn = fn(src: &[f32], dst: &mut [u8]);
/// Dot product of `n` elements: a weight row `w` and an activation row `x` in the weight type's
/// `vec_dot_type`. Both slices hold exactly the bytes of `n` elements.
pub type DotFn = fn(n: usize, w: &[u8], x: &[u8]) -> f32;

/// The functions a family provides for one type.
#[derive(Clone, Copy, Default)]
pub struct FormatFns {
    pub dequantize: Option<DequantFn>,
    pub quantize: Option<QuantFn>,
    /// The scalar reference dot product (the accumulation order every SIMD version reproduces).
    pub dot: Option<DotFn>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum QuantError {
    #[error("{ty}: {what} is not implemented for this type")]
    Unsupported { ty: GgmlType, what: &'static str },
    #[error("{ty}: {n} elements is not a whole number of {block}-element blocks")]
    NotWholeBlocks {
        ty: GgmlType,
        n: usize,
        block: usize,
    },
    #[error("{ty}: {what} holds {got} bytes/elements, expected {expected}")]
    Length {
        ty: GgmlType,
        what: &'static str,
        got: usize,
        expected: usize,
    },
}

/// The functions for `ty`, from whichever family owns it.
pub fn format_fns(ty: GgmlType) -> FormatFns {
    fp::fns(ty)
        .or_else(|| legacy::fns(ty))
        .or_else(|| lowbit::fns(ty))
        .or_else(|| kquants::fns(ty))
        .or_else(|| iquants::fns(ty))
        .unwrap_or_default()
}

fn check_bytes(ty: GgmlType, n: usize, bytes: usize, what: &'static str) -> Result<(), QuantError> {
    let expected = ty.row_bytes(n).ok_or(QuantError::NotWholeBlocks {
        ty,
        n,
        block: ty.block_size(),
    })?;
    if bytes != expected {
        return Err(QuantError::Length {
            ty,
            what,
            got: bytes,
            expected,
        });
    }
    Ok(())
}

/// Dequantize `src` (whole blocks of `ty`) into `dst` (f32, `dst.len()` elements).
pub fn dequantize(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<(), QuantError> {
    check_bytes(ty, dst.len(), src.len(), "source")?;
    let f = format_fns(ty).dequantize.ok_or(QuantError::Unsupported {
        ty,
        what: "dequantize",
    })?;
    f(src, dst);
    Ok(())
}

/// Quantize `src` into `dst` (ggml's reference quantizer for `ty`, bit-exact where ggml is
/// deterministic; for Q8_0/Q8_1/Q8_K the activation quantizers of the CPU backend).
pub fn quantize(ty: GgmlType, src: &[f32], dst: &mut [u8]) -> Result<(), QuantError> {
    quantize_isa(ty, Isa::Scalar, src, dst)
}

/// The quantizer of `quantize(ty, ..)` on `isa`: a SIMD version where there is one (Q8_0
/// activations) and the CPU supports it, bitwise equal to the scalar reference; else the
/// reference. None when the type has no quantizer. The caller checks lengths as `quantize` does.
pub fn quantize_fn(ty: GgmlType, isa: Isa) -> Option<QuantFn> {
    if isa != Isa::Scalar && simd::supported(isa) {
        if let Some(f) = simd::quantize_x86::quantize(ty, isa) {
            return Some(f);
        }
    }
    format_fns(ty).quantize
}

/// `quantize` through [`quantize_fn`]'s kernel for `isa`.
pub fn quantize_isa(ty: GgmlType, isa: Isa, src: &[f32], dst: &mut [u8]) -> Result<(), QuantError> {
    check_bytes(ty, src.len(), dst.len(), "destination")?;
    let f = quantize_fn(ty, isa).ok_or(QuantError::Unsupported {
        ty,
        what: "quantize",
    })?;
    f(src, dst);
    Ok(())
}

/// The dot-product kernel for weight type `ty` on `isa`: the SIMD version when that ISA has one
/// (and the CPU supports it), else the scalar reference. None when the type has no dot product.
pub fn dot_fn(ty: GgmlType, isa: Isa) -> Option<DotFn> {
    if isa != Isa::Scalar && simd::supported(isa) {
        if let Some(f) = simd::dot(ty, isa) {
            return Some(f);
        }
    }
    format_fns(ty).dot
}

/// True when `isa` has its own (non-scalar) kernel for `ty` on this CPU.
pub fn has_simd_dot(ty: GgmlType, isa: Isa) -> bool {
    isa != Isa::Scalar && simd::supported(isa) && simd::dot(ty, isa).is_some()
}

/// Dot product of weight row `w` (type `ty`) and activation row `x` (type `ty.vec_dot_type()`),
/// `n` elements, using the best ISA of this CPU.
pub fn vec_dot(ty: GgmlType, n: usize, w: &[u8], x: &[u8]) -> Result<f32, QuantError> {
    vec_dot_isa(ty, simd::best(), n, w, x)
}

/// As [`vec_dot`] on a chosen ISA (`Isa::Scalar` is the reference).
pub fn vec_dot_isa(
    ty: GgmlType,
    isa: Isa,
    n: usize,
    w: &[u8],
    x: &[u8],
) -> Result<f32, QuantError> {
    let xty = ty.vec_dot_type().ok_or(QuantError::Unsupported {
        ty,
        what: "dot product",
    })?;
    check_bytes(ty, n, w.len(), "weight row")?;
    check_bytes(xty, n, x.len(), "activation row")?;
    let f = dot_fn(ty, isa).ok_or(QuantError::Unsupported {
        ty,
        what: "dot product",
    })?;
    Ok(f(n, w, x))
}

/// Dot products of one weight row against several activation rows (a verify window or a small
/// prefill batch): `out[r] = dot(w, xs[r])`. A multi-row kernel reads the weight row once for
/// all rows; every result is bitwise equal to the single-row kernel's on the same ISA.
pub type DotRowsFn = fn(n: usize, w: &[u8], xs: &[&[u8]], out: &mut [f32]);

/// The multi-row kernel for `ty` on `isa`, falling back to calling the single-row kernel per row.
pub fn dot_rows_fn(ty: GgmlType, isa: Isa) -> Option<DotRowsFn> {
    if isa != Isa::Scalar && simd::supported(isa) {
        if let Some(f) = simd::dot_rows(ty, isa) {
            return Some(f);
        }
    }
    None
}

/// [`DotRowsFn`] semantics with length checks; uses a multi-row kernel when one exists.
pub fn vec_dot_rows_isa(
    ty: GgmlType,
    isa: Isa,
    n: usize,
    w: &[u8],
    xs: &[&[u8]],
    out: &mut [f32],
) -> Result<(), QuantError> {
    let xty = ty.vec_dot_type().ok_or(QuantError::Unsupported {
        ty,
        what: "dot product",
    })?;
    check_bytes(ty, n, w.len(), "weight row")?;
    if out.len() != xs.len() {
        return Err(QuantError::Length {
            ty,
            what: "output rows",
            got: out.len(),
            expected: xs.len(),
        });
    }
    for x in xs {
        check_bytes(xty, n, x.len(), "activation row")?;
    }
    if let Some(f) = dot_rows_fn(ty, isa) {
        f(n, w, xs, out);
        return Ok(());
    }
    let f = dot_fn(ty, isa).ok_or(QuantError::Unsupported {
        ty,
        what: "dot product",
    })?;
    for (o, x) in out.iter_mut().zip(xs) {
        *o = f(n, w, x);
    }
    Ok(())
}
