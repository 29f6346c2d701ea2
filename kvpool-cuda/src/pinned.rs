//! Pinned host memory for the memory pool: one mmap'd arena registered with the driver.

use std::ptr::NonNull;
use std::sync::Arc;

use cudarc::driver::{CudaContext, sys};
use kvpool_core::{HeapAllocator, HostAllocator, HostArena, PoolError};
use tracing::{info, warn};

use crate::driver::open_context;
use crate::error::CudaError;

/// If registering the whole arena at once is refused, it is registered in pieces of this size.
const FALLBACK_SEGMENT_BYTES: usize = 1 << 30;

/// A [`HostAllocator`] whose arenas are page-locked and mapped for device access: anonymous
/// memory from `mmap`, registered with `cuMemHostRegister` (portable, device-mapped). Sizing
/// is per rank: one pool per GPU process.
///
/// Registering existing memory avoids the failure peers hit with a single huge
/// `cudaHostAlloc`; if the driver still refuses one registration of the whole arena, it is
/// registered in 1 GiB pieces. A copy that spans two pieces is still correct; the driver
/// splits it.
pub struct PinnedAllocator {
    ctx: Arc<CudaContext>,
}

impl PinnedAllocator {
    /// Pinned memory for device `ordinal`.
    pub fn new(ordinal: usize) -> Result<Self, CudaError> {
        Ok(PinnedAllocator {
            ctx: open_context(ordinal)?,
        })
    }
}

/// Pinned memory when CUDA is usable, else plain heap memory (with a warning): the pool then
/// works as before and GPU transfers take the slower pageable path.
pub fn pinned_or_heap_allocator(ordinal: usize) -> Box<dyn HostAllocator> {
    match PinnedAllocator::new(ordinal) {
        Ok(pinned) => Box::new(pinned),
        Err(e) => {
            warn!(error = %e, "using unpinned heap memory for the pool");
            Box::new(HeapAllocator)
        }
    }
}

struct PinnedArena {
    ptr: NonNull<u8>,
    len: usize,
    /// Start of each registered range.
    registered: Vec<*mut u8>,
    ctx: Arc<CudaContext>,
}

// SAFETY: the arena exclusively owns its mapping; the pool hands out disjoint regions.
unsafe impl Send for PinnedArena {}
// SAFETY: as above.
unsafe impl Sync for PinnedArena {}

// SAFETY: a private anonymous mapping of `len` zeroed bytes, owned until drop.
unsafe impl HostArena for PinnedArena {
    fn as_ptr(&self) -> NonNull<u8> {
        self.ptr
    }
    fn len(&self) -> usize {
        self.len
    }
    fn is_pinned(&self) -> bool {
        true
    }
}

impl Drop for PinnedArena {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        for &start in &self.registered {
            // SAFETY: each start was registered by this arena and not yet unregistered.
            unsafe { sys::cuMemHostUnregister(start.cast()) };
        }
        // SAFETY: the mapping was made by this arena with this length.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

fn register(ptr: *mut u8, len: usize) -> sys::CUresult {
    let flags = sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP;
    // SAFETY: `ptr..ptr+len` is a live mapping owned by the caller.
    unsafe { sys::cuMemHostRegister_v2(ptr.cast(), len, flags) }
}

impl HostAllocator for PinnedAllocator {
    fn name(&self) -> &str {
        "cuda-pinned"
    }

    fn allocate_arena(&self, bytes: usize) -> Result<Box<dyn HostArena>, PoolError> {
        let arena_error = |reason: String| PoolError::Arena { bytes, reason };
        self.ctx
            .bind_to_thread()
            .map_err(|e| arena_error(format!("cannot bind the CUDA context: {e:?}")))?;
        // SAFETY: a fresh private anonymous mapping; checked for failure below.
        let raw = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                bytes,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if raw == libc::MAP_FAILED {
            return Err(arena_error(format!(
                "mmap failed: {}",
                std::io::Error::last_os_error()
            )));
        }
        let ptr =
            NonNull::new(raw.cast::<u8>()).ok_or_else(|| arena_error("mmap gave null".into()))?;
        let mut arena = PinnedArena {
            ptr,
            len: bytes,
            registered: Vec::new(),
            ctx: self.ctx.clone(),
        };
        let whole = register(ptr.as_ptr(), bytes);
        if whole == sys::CUresult::CUDA_SUCCESS {
            arena.registered.push(ptr.as_ptr());
            info!(bytes, "pinned the pool arena in one registration");
            return Ok(Box::new(arena));
        }
        warn!(bytes, result = ?whole, "one registration of the whole arena was refused; pinning it in 1 GiB pieces");
        let mut offset = 0;
        while offset < bytes {
            let len = FALLBACK_SEGMENT_BYTES.min(bytes - offset);
            // SAFETY: within the mapping.
            let start = unsafe { ptr.as_ptr().add(offset) };
            let result = register(start, len);
            if result != sys::CUresult::CUDA_SUCCESS {
                // Dropping the arena unregisters the pieces done so far and unmaps it.
                return Err(arena_error(format!(
                    "cuMemHostRegister of {len} bytes at offset {offset} failed: {result:?}"
                )));
            }
            arena.registered.push(start);
            offset += len;
        }
        Ok(Box::new(arena))
    }
}
