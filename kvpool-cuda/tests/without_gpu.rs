//! What the crate does on a machine without CUDA (CI's case): clear errors, never a panic, and
//! a heap fallback for the pool.

use kvpool_core::{Dtype, KvKind, KvLayout, MemoryPool};
use kvpool_cuda::driver::{device_count, driver_library_present, open_context};
use kvpool_cuda::{
    CudaError, DeviceLayer, GpuTransferEngine, HostPath, PagedOrder, PinnedAllocator,
    RegisteredKvCaches, pinned_or_heap_allocator,
};

#[test]
fn without_a_driver_every_constructor_says_cuda_unavailable() {
    if driver_library_present() && device_count().is_ok_and(|n| n > 0) {
        println!("SKIP: this machine has CUDA; tests/gpu.rs covers it");
        return;
    }
    assert!(matches!(
        open_context(0),
        Err(CudaError::CudaUnavailable(_))
    ));
    assert!(matches!(
        PinnedAllocator::new(0),
        Err(CudaError::CudaUnavailable(_))
    ));
    let layout = KvLayout::new(2, 1, 8, Dtype::F16, KvKind::KeyValue, 4).unwrap();
    let layers: Vec<DeviceLayer> = (0..2)
        .map(|i| DeviceLayer {
            ptr: 0x1000 * (i + 1),
            shape: vec![2, 3, 4, 1, 8],
            dtype: Dtype::F16,
        })
        .collect();
    let caches = RegisteredKvCaches::new(layout, PagedOrder::FlashAttention, &layers).unwrap();
    let err =
        GpuTransferEngine::new(0, caches, HostPath::Staged).expect_err("no engine without CUDA");
    assert!(matches!(err, CudaError::CudaUnavailable(_)), "{err}");
    assert!(err.to_string().contains("CUDA is unavailable"), "{err}");

    // The pool still works, on heap memory.
    let allocator = pinned_or_heap_allocator(0);
    assert_eq!(allocator.name(), "heap");
    let pool = MemoryPool::with_allocator(1 << 20, allocator.as_ref()).unwrap();
    assert!(!pool.is_pinned());
    let mut buf = pool.allocate(4096).unwrap();
    buf.as_mut_slice().fill(7);
    assert!(buf.freeze().as_slice().iter().all(|&b| b == 7));
}
