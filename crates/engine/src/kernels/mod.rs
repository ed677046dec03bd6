//! CPU versions of the report's kernel catalogue (DESIGN.md §4): each kernel a baseline and optimized variants bound by parity tests.
