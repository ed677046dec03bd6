//! strata-cuda
