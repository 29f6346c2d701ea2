//! CUDA KV caches for the worker (feature `cuda`): vLLM's per-layer CUDA tensors, their order
//! recognised from the shape, registered with kvpool-cuda's `GpuTransferEngine`.

use kvpool_core::{KvKind, KvLayout};
use kvpool_cuda::{DeviceLayer, HostPath, RegisteredKvCaches};
pub use kvpool_cuda::{GpuTransferEngine, PagedOrder};

use crate::ConnectorError;
use crate::engine_tensor::EngineKvTensor;

/// The order of one of vLLM's CUDA KV tensors: flash-attention `[2, num_blocks, ...]`,
/// FlashInfer `[num_blocks, 2, ...]` (both 5-D) or MLA `[num_blocks, block_size, head_size]`.
/// A shape that fits both 5-D orders (two blocks) is refused rather than guessed.
pub fn paged_order_of(shape: &[usize], layout: &KvLayout) -> Result<PagedOrder, ConnectorError> {
    let order = match (layout.kind, shape) {
        (KvKind::MlaLatent, [_, _, _]) => Some(PagedOrder::Mla),
        (KvKind::KeyValue, [2, 2, _, _, _]) => {
            return Err(ConnectorError::Layout(format!(
                "KV tensor shape {shape:?} fits both flash-attention and FlashInfer order"
            )));
        }
        (KvKind::KeyValue, [2, _, _, _, _]) => Some(PagedOrder::FlashAttention),
        (KvKind::KeyValue, [_, 2, _, _, _]) => Some(PagedOrder::FlashInfer),
        _ => None,
    };
    order.ok_or_else(|| {
        ConnectorError::Layout(format!(
            "KV tensor shape {shape:?} is none of vLLM's CUDA layouts for {:?} \
             ([2, blocks, {bs}, heads, head], [blocks, 2, {bs}, heads, head], [blocks, {bs}, dim])",
            layout.kind,
            bs = layout.block_size
        ))
    })
}

/// The GPU transfer over `tensors` on device `ordinal` (see
/// [`EngineKvCaches::register`](crate::EngineKvCaches::register)).
///
/// # Safety
///
/// As [`EngineKvCaches::register`](crate::EngineKvCaches::register).
pub(crate) unsafe fn gpu_transfer(
    layout: &KvLayout,
    ordinal: usize,
    tensors: &[EngineKvTensor],
    compute_stream: Option<usize>,
) -> Result<GpuTransferEngine, ConnectorError> {
    let order = paged_order_of(&tensors[0].shape, layout)?;
    let layers: Vec<DeviceLayer> = tensors
        .iter()
        .map(|t| DeviceLayer {
            ptr: t.ptr as u64,
            shape: t.shape.clone(),
            dtype: t.dtype,
        })
        .collect();
    let device = |e: kvpool_cuda::CudaError| ConnectorError::Layout(e.to_string());
    let caches = RegisteredKvCaches::new(*layout, order, &layers).map_err(device)?;
    let engine = GpuTransferEngine::new(ordinal, caches, HostPath::Staged).map_err(device)?;
    if let Some(raw) = compute_stream {
        // SAFETY: the caller vouched for the stream.
        unsafe { engine.set_borrowed_compute_stream(raw) };
    }
    Ok(engine)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvpool_core::Dtype;

    #[test]
    fn vllm_cuda_shapes_map_to_their_order_and_ambiguity_is_refused() {
        let kv = KvLayout::new(2, 8, 128, Dtype::Bf16, KvKind::KeyValue, 16).unwrap();
        let mla = KvLayout::new(2, 1, 576, Dtype::Bf16, KvKind::MlaLatent, 16).unwrap();
        assert_eq!(
            paged_order_of(&[2, 100, 16, 8, 128], &kv).unwrap(),
            PagedOrder::FlashAttention
        );
        assert_eq!(
            paged_order_of(&[100, 2, 16, 8, 128], &kv).unwrap(),
            PagedOrder::FlashInfer
        );
        assert_eq!(
            paged_order_of(&[100, 16, 576], &mla).unwrap(),
            PagedOrder::Mla
        );
        assert!(paged_order_of(&[2, 2, 16, 8, 128], &kv).is_err());
        assert!(paged_order_of(&[100, 16, 8, 128], &kv).is_err());
        assert!(paged_order_of(&[100, 16, 576], &kv).is_err());
    }
}
