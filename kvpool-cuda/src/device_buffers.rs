//! Device memory the transfer engine owns: buffers freed on drop, a cache of layer-wise load
//! buffers reused across loads, and the grow-on-demand scratch of whole transfers.

use std::sync::Arc;

use cudarc::driver::{CudaContext, sys};
use parking_lot::Mutex;

use crate::error::CudaError;

/// Device memory owned by the engine, freed on drop.
pub(crate) struct DeviceBuffer {
    pub(crate) ptr: sys::CUdeviceptr,
    len: usize,
    ctx: Arc<CudaContext>,
}

impl DeviceBuffer {
    pub(crate) fn new(ctx: &Arc<CudaContext>, len: usize) -> Result<Self, CudaError> {
        ctx.bind_to_thread()
            .map_err(|e| CudaError::driver("cuCtxSetCurrent", e))?;
        let mut ptr = 0;
        // SAFETY: writes one device pointer.
        unsafe { sys::cuMemAlloc_v2(&mut ptr, len.max(16)) }
            .result()
            .map_err(|e| CudaError::driver("cuMemAlloc", e))?;
        Ok(DeviceBuffer {
            ptr,
            len,
            ctx: ctx.clone(),
        })
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: allocated by `new`, freed once; users synchronise their streams first.
        unsafe { sys::cuMemFree_v2(self.ptr) };
    }
}

/// Device buffers of finished layer-wise loads, kept for the next ones: in steady state a load
/// neither allocates nor frees (`cuMemFree` synchronises the whole device, so freeing after
/// every load would stall the engine's compute stream).
#[derive(Default)]
pub(crate) struct BufferCache {
    free: Mutex<Vec<DeviceBuffer>>,
}

/// Free buffers kept by [`BufferCache`]; two in-flight loads (the prefetch-two pattern) take
/// two each.
const CACHED_BUFFERS: usize = 4;

impl BufferCache {
    /// The smallest cached buffer of at least `len` bytes, or a new one.
    pub(crate) fn take(
        &self,
        ctx: &Arc<CudaContext>,
        len: usize,
    ) -> Result<DeviceBuffer, CudaError> {
        let mut free = self.free.lock();
        let best = free
            .iter()
            .enumerate()
            .filter(|(_, b)| b.len >= len)
            .min_by_key(|(_, b)| b.len)
            .map(|(i, _)| i);
        match best {
            Some(i) => Ok(free.swap_remove(i)),
            None => {
                drop(free);
                DeviceBuffer::new(ctx, buffer_size(len))
            }
        }
    }

    /// Frees every cached buffer (no work may still use them).
    pub(crate) fn clear(&self) {
        self.free.lock().clear();
    }

    /// Returns `buffers` (no work may still use them), keeping the largest.
    pub(crate) fn give(&self, buffers: impl IntoIterator<Item = DeviceBuffer>) {
        let mut free = self.free.lock();
        free.extend(buffers);
        if free.len() > CACHED_BUFFERS {
            free.sort_by_key(|b| std::cmp::Reverse(b.len));
            free.truncate(CACHED_BUFFERS);
        }
    }
}

/// The size to allocate for a buffer of `len` bytes: the next power of two up to 2 MiB (so
/// small buffers that grow are not reallocated often), whole 2 MiB pages above (so a large
/// staging buffer does not hold up to twice what it needs).
fn buffer_size(len: usize) -> usize {
    const PAGE: usize = 2 << 20;
    if len <= PAGE {
        len.next_power_of_two()
    } else {
        len.next_multiple_of(PAGE)
    }
}

/// Reusable device scratch: the slot mapping and the staging buffer, grown on demand.
#[derive(Default)]
pub(crate) struct Scratch {
    pub(crate) slots: Option<DeviceBuffer>,
    pub(crate) staging: Option<DeviceBuffer>,
}

/// The device pointer of `slot`, first (re)allocated when it is missing or under `len` bytes.
pub(crate) fn ensure(
    slot: &mut Option<DeviceBuffer>,
    ctx: &Arc<CudaContext>,
    len: usize,
) -> Result<sys::CUdeviceptr, CudaError> {
    if slot.as_ref().is_none_or(|b| b.len < len) {
        *slot = None;
        *slot = Some(DeviceBuffer::new(ctx, buffer_size(len))?);
    }
    Ok(slot.as_ref().map(|b| b.ptr).unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use super::buffer_size;

    #[test]
    fn buffers_round_to_powers_of_two_then_to_2_mib_pages() {
        const MIB: usize = 1 << 20;
        assert_eq!(buffer_size(0), 1);
        assert_eq!(buffer_size(3), 4);
        assert_eq!(buffer_size(1000), 1024);
        assert_eq!(buffer_size(2 * MIB), 2 * MIB);
        assert_eq!(buffer_size(2 * MIB + 1), 4 * MIB);
        // 256 MiB and a bit: not 512 MiB.
        assert_eq!(buffer_size(256 * MIB + 5), 258 * MIB);
    }
}
