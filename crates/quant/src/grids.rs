//! Lookup tables of the I-quants (grids, sign tables, kvalues), transcribed from ggml-common.h.
