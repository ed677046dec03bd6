//! strata-engine: model definitions, the Backend trait and its CPU implementation, per-sequence
//! state, sampler, MTP head and speculative controller.

pub mod backend;
pub mod batch;
pub mod cpu;
pub mod decode;
pub mod error;
pub mod generate;
pub mod kernels;
pub mod qwen2;
pub mod qwen4exp;
pub mod sampler;
pub mod speculative;

pub use backend::{
    Backend, DeviceBuf, DeviceIds, DeviceWeight, KvType, RowStore, StepInputs, StepKey, Usage,
};
pub use cpu::{CpuBackend, CpuBuf, CpuWeight, FloatActivations};
pub use error::{EngineError, Result};
pub use qwen4exp::ops::{QsaRule, Qwen4expOps};
pub use qwen4exp::{LoadOptions, Model, Outputs, State, Want};
