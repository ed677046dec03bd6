//! strata-parity
