//! One layer's KV tensor as the engine describes it (address, shape, strides, dtype, device).

use kvpool_core::Dtype;

/// Where a KV tensor lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KvDevice {
    /// Host memory.
    Cpu,
    /// CUDA device `n`.
    Cuda(usize),
}

/// One layer's KV tensor as the engine reports it (for PyTorch: `data_ptr()`, `shape`,
/// `stride()`, `dtype`, `device`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineKvTensor {
    /// Address of element 0.
    pub ptr: usize,
    /// The tensor's shape.
    pub shape: Vec<usize>,
    /// Strides in elements, one per dimension.
    pub strides: Vec<usize>,
    /// The element type.
    pub dtype: Dtype,
    /// Where it lives.
    pub device: KvDevice,
}

impl EngineKvTensor {
    pub(crate) fn is_contiguous(&self) -> bool {
        let mut expected = 1;
        for (dim, stride) in self.shape.iter().zip(&self.strides).rev() {
            if *dim != 1 && *stride != expected {
                return false;
            }
            expected *= dim;
        }
        self.shape.len() == self.strides.len()
    }
}
