//! strata-engine: model definitions, the Backend trait and its CPU implementation, per-sequence
//! state, sampler, MTP head and speculative controller.

pub mod kernels;
