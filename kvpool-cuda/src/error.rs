//! Errors of the CUDA transfer engine.

use kvpool_core::TransferError;
use thiserror::Error;

/// What went wrong on the device side.
#[derive(Debug, Error)]
pub enum CudaError {
    /// No CUDA driver (libcuda) or NVRTC library could be loaded, or no device exists. kvpool
    /// falls back to host memory and the host transfer path where it can.
    #[error("CUDA is unavailable: {0}")]
    CudaUnavailable(String),
    /// A driver call failed.
    #[error("CUDA driver call {call} failed: {reason}")]
    Driver {
        /// The call.
        call: &'static str,
        /// The driver's error.
        reason: String,
    },
    /// The kernels did not compile.
    #[error("NVRTC could not compile kvpool's kernels: {0}")]
    Compile(String),
    /// A registered KV cache contradicts the layout it was registered with.
    #[error("KV cache registration rejected: {0}")]
    Registration(String),
    /// A transfer was asked for with bad arguments.
    #[error(transparent)]
    Transfer(#[from] TransferError),
}

impl CudaError {
    pub(crate) fn driver(call: &'static str, e: impl std::fmt::Debug) -> Self {
        CudaError::Driver {
            call,
            reason: format!("{e:?}"),
        }
    }
}

impl From<CudaError> for TransferError {
    fn from(e: CudaError) -> Self {
        match e {
            CudaError::Transfer(t) => t,
            other => TransferError::Device(other.to_string()),
        }
    }
}
