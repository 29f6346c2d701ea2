//! What backs a pool: the arena traits ([`HostArena`], [`HostAllocator`]) and the default
//! arena, committed anonymous memory ([`HeapAllocator`]).

use std::ptr::NonNull;

use crate::error::PoolError;

/// A block of host memory that backs a pool for its whole life.
///
/// # Safety
/// `as_ptr()` must point to `len()` bytes that are readable and writable, initialised (e.g.
/// zeroed), valid and not moved until the arena is dropped, and not accessed by anyone else.
pub unsafe trait HostArena: Send + Sync {
    /// Start of the arena.
    fn as_ptr(&self) -> NonNull<u8>;
    /// Size in bytes.
    fn len(&self) -> usize;
    /// Whether the memory is page-locked (pinned) for fast device DMA.
    fn is_pinned(&self) -> bool {
        false
    }
    /// Whether the arena is empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Supplies arenas: the hook through which a caller provides pinned (or shared) memory.
pub trait HostAllocator: Send + Sync {
    /// Short name for logs ("heap", "cuda-pinned").
    fn name(&self) -> &str;
    /// Allocates an arena of `bytes` bytes.
    fn allocate_arena(&self, bytes: usize) -> Result<Box<dyn HostArena>, PoolError>;
}

/// Page-aligned, zero-initialised memory from an anonymous private mapping, every page
/// committed when the arena is made: the pool's capacity is resident from the start, and the
/// first chunks written into it (a fresh engine's first loads) take no page faults. On
/// Linux the mapping asks for transparent huge pages and is populated in one call, which
/// takes a quarter of the time of touching it page by page (92 against 347 ms for 512 MiB on
/// the 2-vCPU VM of docs/benchmarks.md).
#[derive(Debug, Default, Clone, Copy)]
pub struct HeapAllocator;

struct HeapArena {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the arena exclusively owns its mapping; the pool hands out disjoint regions.
unsafe impl Send for HeapArena {}
// SAFETY: as above; the arena itself is never mutated through `&self`.
unsafe impl Sync for HeapArena {}

// SAFETY: a private anonymous mapping of `len` bytes (zero-filled by the kernel, readable
// and writable), owned until drop.
unsafe impl HostArena for HeapArena {
    fn as_ptr(&self) -> NonNull<u8> {
        self.ptr
    }
    fn len(&self) -> usize {
        self.len
    }
}

impl Drop for HeapArena {
    fn drop(&mut self) {
        // SAFETY: mapped in `HeapAllocator::allocate_arena` with this address and length;
        // the pool's regions borrow the arena, so none outlives it.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// Commits every page of the fresh mapping at `ptr`: on Linux transparent huge pages
/// (advisory) populated with `MADV_POPULATE_WRITE`; where that is refused (kernels before
/// 5.14, other systems), one write per page.
fn commit_pages(ptr: NonNull<u8>, len: usize) {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: advice over a mapping of `len` bytes just made and owned by the caller; it
        // changes no contents. A kernel without transparent huge pages refuses it, harmlessly.
        unsafe { libc::madvise(ptr.as_ptr().cast(), len, libc::MADV_HUGEPAGE) };
        // SAFETY: as above; populating a private anonymous mapping writes nothing visible.
        if unsafe { libc::madvise(ptr.as_ptr().cast(), len, libc::MADV_POPULATE_WRITE) } == 0 {
            return;
        }
    }
    let page = 4096;
    for offset in (0..len).step_by(page) {
        // SAFETY: `offset < len`, inside the writable mapping; writing the zero it already
        // holds changes nothing but commits the page.
        unsafe { ptr.as_ptr().add(offset).write_volatile(0) };
    }
}

impl HostAllocator for HeapAllocator {
    fn name(&self) -> &str {
        "heap"
    }

    fn allocate_arena(&self, bytes: usize) -> Result<Box<dyn HostArena>, PoolError> {
        if bytes == 0 {
            return Err(PoolError::ZeroSize);
        }
        // Not `alloc_zeroed`: at a page's alignment it zeroes the block with `memset`, one
        // fault per 4 KiB page; the kernel zero-fills a fresh mapping already.
        // SAFETY: a fresh private anonymous mapping; no existing memory is affected.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                bytes,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(PoolError::Arena {
                bytes,
                reason: format!(
                    "cannot map anonymous memory: {}",
                    std::io::Error::last_os_error()
                ),
            });
        }
        let ptr = NonNull::new(ptr.cast::<u8>()).ok_or_else(|| PoolError::Arena {
            bytes,
            reason: "mmap returned a null address".into(),
        })?;
        commit_pages(ptr, bytes);
        Ok(Box::new(HeapArena { ptr, len: bytes }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_heap_arena_is_zeroed_and_every_page_is_resident_from_the_start() {
        let len = 8 << 20;
        let arena = HeapAllocator.allocate_arena(len).unwrap();
        assert_eq!(arena.as_ptr().as_ptr() as usize % 4096, 0);
        let mut resident = vec![0u8; len / 4096];
        // SAFETY: `resident` has one byte per page of the mapping, as mincore requires.
        let rc =
            unsafe { libc::mincore(arena.as_ptr().as_ptr().cast(), len, resident.as_mut_ptr()) };
        assert_eq!(rc, 0, "{}", std::io::Error::last_os_error());
        let absent = resident.iter().filter(|&&r| r & 1 == 0).count();
        assert_eq!(
            absent,
            0,
            "{absent} of {} pages not resident",
            resident.len()
        );
    }
}
