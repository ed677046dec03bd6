//! The `kquants` family of block formats.

use crate::{FormatFns, GgmlType};

pub(crate) fn fns(_ty: GgmlType) -> Option<FormatFns> {
    None
}
