//! The engine's KV caches as the worker's transfer path, picked by the device they live on:
//! host tensors (vLLM's CPU build) move as whole opaque blocks ([`BlockKvCache`]); CUDA
//! tensors (with the `cuda` feature) go through kvpool-cuda's `GpuTransferEngine`.

use kvpool_core::{BlockKvCache, KvLayout, LayerwiseTransfer};

use crate::ConnectorError;
pub use crate::engine_tensor::{EngineKvTensor, KvDevice};

/// The engine's registered KV caches, the worker's [`LayerwiseTransfer`].
#[derive(Debug)]
pub enum EngineKvCaches {
    /// Host tensors `[num_blocks, ...]`, each block moved as opaque bytes.
    Host(BlockKvCache),
    /// CUDA tensors, moved by the GPU transfer engine.
    #[cfg(feature = "cuda")]
    Gpu(Box<kvpool_cuda::GpuTransferEngine>),
}

fn reject(reason: String) -> ConnectorError {
    ConnectorError::Layout(reason)
}

impl EngineKvCaches {
    /// Wraps `tensors` (one per layer of `layout`, in order), picking the transfer by their
    /// device. Every tensor must be contiguous, of `layout.dtype`, on one device.
    ///
    /// - CPU: `[num_blocks, ...]` whose trailing dimensions hold exactly one block
    ///   (`block_size * bytes_per_token_per_layer` bytes, in whatever inner order the engine
    ///   uses): [`BlockKvCache`].
    /// - CUDA (feature `cuda`): vLLM's flash-attention `[2, num_blocks, block_size, kv_heads,
    ///   head_size]`, FlashInfer `[num_blocks, 2, ...]` or MLA `[num_blocks, block_size,
    ///   head_size]`, on a `GpuTransferEngine` whose stores wait for `compute_stream` (a raw
    ///   `CUstream`, e.g. `torch.cuda.current_stream().cuda_stream`; `None`: the whole device).
    ///   Without the feature this is an error that says so.
    ///
    /// # Safety
    ///
    /// Each `ptr` must address the whole tensor its shape describes, valid for reads and
    /// writes while the returned caches live, and `compute_stream` (if any) must be a live
    /// stream of that device's primary context for as long.
    pub unsafe fn register(
        layout: &KvLayout,
        tensors: &[EngineKvTensor],
        compute_stream: Option<usize>,
    ) -> Result<Self, ConnectorError> {
        let Some(first) = tensors.first() else {
            return Err(reject("no KV tensors to register".into()));
        };
        if tensors.len() != layout.num_layers {
            return Err(reject(format!(
                "{} KV tensors for a model of {} layers",
                tensors.len(),
                layout.num_layers
            )));
        }
        for (i, t) in tensors.iter().enumerate() {
            if t.device != first.device || t.shape != first.shape || t.dtype != layout.dtype {
                return Err(reject(format!(
                    "layer {i}: {:?} {:?} on {:?}; expected {:?} {:?} on {:?} like layer 0",
                    t.shape, t.dtype, t.device, first.shape, layout.dtype, first.device
                )));
            }
            if !t.is_contiguous() {
                return Err(reject(format!(
                    "layer {i}: strides {:?} for shape {:?} are not contiguous",
                    t.strides, t.shape
                )));
            }
        }
        match first.device {
            KvDevice::Cpu => {
                let block_bytes = layout.block_size * layout.bytes_per_token_per_layer();
                let per_block: usize =
                    first.shape.iter().skip(1).product::<usize>() * layout.dtype.size_bytes();
                if first.shape.len() < 2 || per_block != block_bytes {
                    return Err(reject(format!(
                        "host KV tensor {:?} does not hold blocks of {block_bytes} bytes \
                         ({} tokens x {} bytes per token and layer) along its first dimension",
                        first.shape,
                        layout.block_size,
                        layout.bytes_per_token_per_layer()
                    )));
                }
                let ptrs: Vec<*mut u8> = tensors.iter().map(|t| t.ptr as *mut u8).collect();
                // SAFETY: the caller vouched for each tensor; the shape check above makes
                // `num_blocks * block_bytes` exactly its size.
                let kv = unsafe { BlockKvCache::from_raw_parts(*layout, first.shape[0], &ptrs) }
                    .map_err(|e| reject(e.to_string()))?;
                Ok(EngineKvCaches::Host(kv))
            }
            #[cfg(feature = "cuda")]
            KvDevice::Cuda(ordinal) => {
                // SAFETY: as the caller promised.
                unsafe { crate::cuda::gpu_transfer(layout, ordinal, tensors, compute_stream) }
                    .map(|engine| EngineKvCaches::Gpu(Box::new(engine)))
            }
            #[cfg(not(feature = "cuda"))]
            KvDevice::Cuda(ordinal) => {
                let _ = compute_stream;
                Err(reject(format!(
                    "the KV caches are on CUDA device {ordinal}, but this kvpool was built \
                     without the `cuda` feature"
                )))
            }
        }
    }

    /// The transfer path, to load into.
    pub fn transfer(&mut self) -> &mut dyn LayerwiseTransfer {
        match self {
            EngineKvCaches::Host(kv) => kv,
            #[cfg(feature = "cuda")]
            EngineKvCaches::Gpu(gpu) => gpu.as_mut(),
        }
    }

    /// The transfer path, to store from.
    pub fn transfer_ref(&self) -> &dyn LayerwiseTransfer {
        match self {
            EngineKvCaches::Host(kv) => kv,
            #[cfg(feature = "cuda")]
            EngineKvCaches::Gpu(gpu) => gpu.as_ref(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvpool_core::{Dtype, KvKind};

    fn layout() -> KvLayout {
        KvLayout::new(2, 2, 4, Dtype::F16, KvKind::KeyValue, 4).unwrap()
    }

    fn tensor(ptr: usize, shape: &[usize], device: KvDevice) -> EngineKvTensor {
        let mut strides = vec![1; shape.len()];
        for i in (0..shape.len().saturating_sub(1)).rev() {
            strides[i] = strides[i + 1] * shape[i + 1];
        }
        EngineKvTensor {
            ptr,
            shape: shape.to_vec(),
            strides,
            dtype: Dtype::F16,
            device,
        }
    }

    #[test]
    fn host_tensors_become_a_block_cache_that_round_trips() {
        let l = layout();
        // vLLM CPU: [num_blocks, 2, kv_heads, block_size, head_size].
        let shape = [3, 2, 2, 4, 4];
        let mut layers: Vec<Vec<u8>> = (0..2)
            .map(|i| vec![i as u8 + 1; 3 * 2 * 2 * 4 * 4 * 2])
            .collect();
        let tensors: Vec<EngineKvTensor> = layers
            .iter_mut()
            .map(|b| tensor(b.as_mut_ptr() as usize, &shape, KvDevice::Cpu))
            .collect();
        // SAFETY: each tensor is a live Vec of exactly its shape's size, outliving `caches`.
        let mut caches = unsafe { EngineKvCaches::register(&l, &tensors, None) }.unwrap();
        assert!(matches!(caches, EngineKvCaches::Host(_)));
        let slots: Vec<i64> = (4..8).collect();
        let mut chunk = vec![0u8; l.chunk_bytes(4)];
        caches.transfer_ref().gather(&slots, &mut chunk).unwrap();
        let block_bytes = 4 * l.bytes_per_token_per_layer();
        assert!(chunk[..block_bytes].iter().all(|&b| b == 1));
        assert!(chunk[block_bytes..].iter().all(|&b| b == 2));
        caches.transfer().fence_before_store().unwrap();
    }

    #[test]
    fn mismatched_or_strided_or_misplaced_tensors_are_refused_with_a_reason() {
        let l = layout();
        let mut buf = vec![0u8; 4096];
        let p = buf.as_mut_ptr() as usize;
        let ok = tensor(p, &[3, 2, 2, 4, 4], KvDevice::Cpu);
        let err = |tensors: &[EngineKvTensor]| {
            // SAFETY: every call below is refused before it touches memory.
            unsafe { EngineKvCaches::register(&l, tensors, None) }
                .unwrap_err()
                .to_string()
        };
        assert!(err(std::slice::from_ref(&ok)).contains("1 KV tensors for a model of 2 layers"));
        let mut strided = ok.clone();
        strided.strides[0] *= 2;
        assert!(err(&[ok.clone(), strided]).contains("not contiguous"));
        let wrong_block = tensor(p, &[3, 2, 2, 4, 2], KvDevice::Cpu);
        assert!(err(&[wrong_block.clone(), wrong_block]).contains("blocks of"));
        let mut other_device = ok.clone();
        other_device.device = KvDevice::Cuda(0);
        assert!(err(&[ok.clone(), other_device]).contains("like layer 0"));
        #[cfg(not(feature = "cuda"))]
        {
            let gpu = tensor(p, &[2, 3, 4, 2, 4], KvDevice::Cuda(0));
            assert!(err(&[gpu.clone(), gpu]).contains("without the `cuda` feature"));
        }
    }

    #[cfg(feature = "cuda")]
    #[test]
    fn without_a_gpu_registration_is_a_clear_error_not_a_crash() {
        if kvpool_cuda::driver::device_count().is_ok_and(|n| n > 0) {
            println!("SKIP: a GPU is present; the GPU tests cover registration");
            return;
        }
        let layout = KvLayout::new(2, 8, 128, Dtype::Bf16, KvKind::KeyValue, 16).unwrap();
        let t = EngineKvTensor {
            ptr: 0x1000,
            shape: vec![2, 100, 16, 8, 128],
            strides: vec![100 * 16 * 8 * 128, 16 * 8 * 128, 8 * 128, 128, 1],
            dtype: Dtype::Bf16,
            device: KvDevice::Cuda(0),
        };
        // SAFETY: registration fails before any access: there is no driver to open.
        let err = unsafe { EngineKvCaches::register(&layout, &[t.clone(), t], None) }.unwrap_err();
        assert!(err.to_string().contains("CUDA"), "{err}");
    }
}
