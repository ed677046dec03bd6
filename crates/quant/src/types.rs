//! The ggml type table: ids, names, block geometry and the activation type each weight type's
//! dot product pairs with (FORMATS.md, "Type ids" and "Activation pairing").

/// A ggml tensor element type. Discriminants are ggml's type ids (`ggml.h`).
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u32)]
pub enum GgmlType {
    F32 = 0,
    F16 = 1,
    Q4_0 = 2,
    Q4_1 = 3,
    Q5_0 = 6,
    Q5_1 = 7,
    Q8_0 = 8,
    Q8_1 = 9,
    Q2_K = 10,
    Q3_K = 11,
    Q4_K = 12,
    Q5_K = 13,
    Q6_K = 14,
    Q8_K = 15,
    IQ2_XXS = 16,
    IQ2_XS = 17,
    IQ3_XXS = 18,
    IQ1_S = 19,
    IQ4_NL = 20,
    IQ3_S = 21,
    IQ2_S = 22,
    IQ4_XS = 23,
    I8 = 24,
    I16 = 25,
    I32 = 26,
    I64 = 27,
    F64 = 28,
    IQ1_M = 29,
    BF16 = 30,
    TQ1_0 = 34,
    TQ2_0 = 35,
    MXFP4 = 39,
    NVFP4 = 40,
    Q1_0 = 41,
    Q2_0 = 42,
}

/// One row of the type table.
#[derive(Clone, Copy, Debug)]
pub struct TypeInfo {
    pub ty: GgmlType,
    pub name: &'static str,
    /// Elements per block (1 for scalar types).
    pub block_size: usize,
    /// Bytes per block.
    pub type_size: usize,
    /// The activation type this weight type's dot product takes (None: not a weight type).
    pub vec_dot_type: Option<GgmlType>,
}

use GgmlType::*;

const fn row(
    ty: GgmlType,
    name: &'static str,
    block_size: usize,
    type_size: usize,
    vec_dot_type: Option<GgmlType>,
) -> TypeInfo {
    TypeInfo {
        ty,
        name,
        block_size,
        type_size,
        vec_dot_type,
    }
}

/// Every known type, in id order.
pub static TYPES: &[TypeInfo] = &[
    row(F32, "F32", 1, 4, Some(F32)),
    row(F16, "F16", 1, 2, Some(F16)),
    row(Q4_0, "Q4_0", 32, 18, Some(Q8_0)),
    row(Q4_1, "Q4_1", 32, 20, Some(Q8_1)),
    row(Q5_0, "Q5_0", 32, 22, Some(Q8_0)),
    row(Q5_1, "Q5_1", 32, 24, Some(Q8_1)),
    row(Q8_0, "Q8_0", 32, 34, Some(Q8_0)),
    row(Q8_1, "Q8_1", 32, 36, None),
    row(Q2_K, "Q2_K", 256, 84, Some(Q8_K)),
    row(Q3_K, "Q3_K", 256, 110, Some(Q8_K)),
    row(Q4_K, "Q4_K", 256, 144, Some(Q8_K)),
    row(Q5_K, "Q5_K", 256, 176, Some(Q8_K)),
    row(Q6_K, "Q6_K", 256, 210, Some(Q8_K)),
    row(Q8_K, "Q8_K", 256, 292, None),
    row(IQ2_XXS, "IQ2_XXS", 256, 66, Some(Q8_K)),
    row(IQ2_XS, "IQ2_XS", 256, 74, Some(Q8_K)),
    row(IQ3_XXS, "IQ3_XXS", 256, 98, Some(Q8_K)),
    row(IQ1_S, "IQ1_S", 256, 50, Some(Q8_K)),
    row(IQ4_NL, "IQ4_NL", 32, 18, Some(Q8_0)),
    row(IQ3_S, "IQ3_S", 256, 110, Some(Q8_K)),
    row(IQ2_S, "IQ2_S", 256, 82, Some(Q8_K)),
    row(IQ4_XS, "IQ4_XS", 256, 136, Some(Q8_K)),
    row(I8, "I8", 1, 1, None),
    row(I16, "I16", 1, 2, None),
    row(I32, "I32", 1, 4, None),
    row(I64, "I64", 1, 8, None),
    row(F64, "F64", 1, 8, None),
    row(IQ1_M, "IQ1_M", 256, 56, Some(Q8_K)),
    row(BF16, "BF16", 1, 2, Some(BF16)),
    row(TQ1_0, "TQ1_0", 256, 54, Some(Q8_K)),
    row(TQ2_0, "TQ2_0", 256, 66, Some(Q8_K)),
    row(MXFP4, "MXFP4", 32, 17, Some(Q8_0)),
    row(NVFP4, "NVFP4", 64, 36, Some(Q8_0)),
    row(Q1_0, "Q1_0", 128, 18, Some(Q8_0)),
    row(Q2_0, "Q2_0", 64, 18, Some(Q8_0)),
];

impl GgmlType {
    /// The type with ggml id `id`, or None for removed or unknown ids.
    pub fn from_id(id: u32) -> Option<GgmlType> {
        TYPES.iter().find(|t| t.ty as u32 == id).map(|t| t.ty)
    }

    /// The type named `name` (case-insensitive, as ggml spells it: "Q4_K", "bf16").
    pub fn from_name(name: &str) -> Option<GgmlType> {
        TYPES
            .iter()
            .find(|t| t.name.eq_ignore_ascii_case(name))
            .map(|t| t.ty)
    }

    pub fn id(self) -> u32 {
        self as u32
    }

    pub fn info(self) -> &'static TypeInfo {
        // Every variant has a row; the table is checked by a unit test.
        TYPES
            .iter()
            .find(|t| t.ty == self)
            .expect("type table covers every variant")
    }

    pub fn name(self) -> &'static str {
        self.info().name
    }

    pub fn block_size(self) -> usize {
        self.info().block_size
    }

    pub fn type_size(self) -> usize {
        self.info().type_size
    }

    pub fn vec_dot_type(self) -> Option<GgmlType> {
        self.info().vec_dot_type
    }

    /// True for block-quantized types (block size above one).
    pub fn is_quantized(self) -> bool {
        self.block_size() > 1
    }

    /// Bytes taken by `n` elements, or None when `n` is not a whole number of blocks or the
    /// byte count overflows.
    pub fn row_bytes(self, n: usize) -> Option<usize> {
        let bs = self.block_size();
        if !n.is_multiple_of(bs) {
            return None;
        }
        (n / bs).checked_mul(self.type_size())
    }
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_is_consistent() {
        for t in TYPES {
            assert_eq!(GgmlType::from_id(t.ty as u32), Some(t.ty));
            assert_eq!(GgmlType::from_name(t.name), Some(t.ty));
            assert!(t.type_size > 0 && t.block_size > 0);
        }
        for removed in [4, 5, 31, 32, 33, 36, 37, 38, 43, 1000] {
            assert_eq!(GgmlType::from_id(removed), None);
        }
        assert_eq!(GgmlType::Q2_0.row_bytes(128), Some(36));
        assert_eq!(GgmlType::Q2_0.row_bytes(100), None);
    }
}
