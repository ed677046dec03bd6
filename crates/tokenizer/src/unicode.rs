//! Code-point classes for the pre-tokenizers: the general-category bits and `\s`, looked up in
//! llama.cpp's tables (see `unicode_tables.rs`) so that splits agree with it exactly.

use crate::unicode_tables::{CATEGORY_RANGES, WHITESPACE};

/// Category bits of one code point (llama.cpp's layout), plus whitespace.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Flags(u16);

impl Flags {
    const UNDEFINED: u16 = 0x0001;
    const NUMBER: u16 = 0x0002;
    const LETTER: u16 = 0x0004;
    const MARK: u16 = 0x0010;
    const WHITESPACE: u16 = 0x0100;

    /// The flags of a position outside the fragment: no class at all, so every class test fails
    /// and the "any defined code point" test fails too.
    pub(crate) const NONE: Flags = Flags(0);

    pub(crate) fn of(cp: u32) -> Flags {
        let cat = if cp < 0x110000 {
            // The table starts at 0 and ends with the 0x110000 sentinel, so a code point below
            // the sentinel always has a range.
            let i = CATEGORY_RANGES.partition_point(|&(start, _)| start <= cp);
            CATEGORY_RANGES
                .get(i.wrapping_sub(1))
                .map_or(Self::UNDEFINED, |r| r.1 as u16)
        } else {
            Self::UNDEFINED
        };
        let ws = if WHITESPACE.binary_search(&cp).is_ok() {
            Self::WHITESPACE
        } else {
            0
        };
        Flags(cat | ws)
    }

    pub(crate) fn any(self) -> bool {
        self.0 != 0
    }
    pub(crate) fn number(self) -> bool {
        self.0 & Self::NUMBER != 0
    }
    pub(crate) fn letter(self) -> bool {
        self.0 & Self::LETTER != 0
    }
    pub(crate) fn mark(self) -> bool {
        self.0 & Self::MARK != 0
    }
    pub(crate) fn whitespace(self) -> bool {
        self.0 & Self::WHITESPACE != 0
    }
}

#[cfg(test)]
mod tests {
    use super::Flags;

    #[test]
    fn classes_of_known_code_points() {
        assert!(Flags::of('a' as u32).letter());
        assert!(Flags::of('Ж' as u32).letter());
        assert!(Flags::of('7' as u32).number());
        assert!(Flags::of('٣' as u32).number());
        assert!(Flags::of(' ' as u32).whitespace());
        assert!(Flags::of(0x3000).whitespace());
        assert!(Flags::of(0x0301).mark());
        assert!(!Flags::of('!' as u32).letter());
        assert!(Flags::of('!' as u32).any());
        assert!(Flags::of(0x10FFFF).any());
        assert!(!Flags::NONE.any());
    }
}
