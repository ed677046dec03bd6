//! x86 AVX2 / AVX-512 dot products for the `fp` family.

use crate::{DotFn, GgmlType, Isa};

pub(crate) fn dot(_ty: GgmlType, _isa: Isa) -> Option<DotFn> {
    None
}
