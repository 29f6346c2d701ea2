//! kvpool-cuda: the GPU transfer engine on cudarc — pinned host memory, paged gather/scatter
//! kernels compiled at run time with NVRTC, a copy stream of its own, and layer-wise loads
//! with per-layer events.
//!
//! The crate builds without a CUDA toolkit: cudarc loads `libcuda` and `libnvrtc` at run time.
//! On a machine without them (or without a device) every constructor returns
//! [`CudaError::CudaUnavailable`]; [`pinned_or_heap_allocator`] then hands out heap memory
//! and [`kvpool_core::HostPagedKvCache`] is the host transfer path.
//!
//! | file | owns |
//! |---|---|
//! | [`driver`] | finding the driver and NVRTC without panicking; the device's primary context |
//! | [`pinned`] | [`PinnedAllocator`]: the pool's arena, mmap'd and registered with the driver |
//! | [`kv_caches`] | registering an engine's per-layer KV tensors (flash-attention, FlashInfer, MLA), validated against a layout |
//! | [`kernels`] | the gather/scatter kernels (`kernels.cu`), NVRTC compilation, access widths |
//! | [`transfer_engine`] | [`GpuTransferEngine`]: `KvTransfer` on the GPU, its copy stream and device buffers |
//! | [`layerwise_load`] | layer-wise loads that own their chunks, per-layer events, `LayerwiseTransfer` (submit, wait, fence) |
//!
//! ```no_run
//! use kvpool_core::{Dtype, KvKind, KvLayout, KvTransfer};
//! use kvpool_cuda::{DeviceLayer, GpuTransferEngine, HostPath, PagedOrder, RegisteredKvCaches};
//!
//! # fn demo(layer_ptrs: Vec<u64>) -> Result<(), kvpool_cuda::CudaError> {
//! let layout = KvLayout::new(32, 8, 128, Dtype::Bf16, KvKind::KeyValue, 16).unwrap();
//! // From vLLM: one tensor per layer, [2, num_blocks, 16, 8, 128] in bf16.
//! let layers: Vec<DeviceLayer> = layer_ptrs
//!     .into_iter()
//!     .map(|ptr| DeviceLayer { ptr, shape: vec![2, 4096, 16, 8, 128], dtype: Dtype::Bf16 })
//!     .collect();
//! let caches = RegisteredKvCaches::new(layout, PagedOrder::FlashAttention, &layers)?;
//! let gpu = GpuTransferEngine::new(0, caches, HostPath::Staged)?;
//! let slots: Vec<i64> = (0..256).collect();
//! let mut chunk = vec![0u8; layout.chunk_bytes(256)];
//! gpu.gather(&slots, &mut chunk)?; // the paged cache's rows, layer-major, in host memory
//! # Ok(()) }
//! ```

#![warn(missing_docs)]

mod device_buffers;
pub mod driver;
pub mod error;
pub mod kernels;
pub mod kv_caches;
pub mod layerwise_load;
pub mod pinned;
pub mod transfer_engine;

pub use error::CudaError;
pub use kernels::{AccessWidth, Direction, LaunchPlan};
pub use kv_caches::{DeviceLayer, PagedGeometry, PagedOrder, RegisteredKvCaches};
pub use layerwise_load::LayerwiseLoad;
pub use pinned::{PinnedAllocator, pinned_or_heap_allocator};
pub use transfer_engine::{GpuTransferEngine, HostPath};
