//! strata-engine
