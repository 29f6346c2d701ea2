//! The bounded host memory pool: one arena up front, a coalescing free list, ref-counted handles.
//!
//! [`MemoryPool`] carves variable-size regions out of a single arena obtained from a
//! [`HostAllocator`] (committed anonymous memory by default; another allocator may supply
//! pinned memory). A region is first a unique, writable [`MemoryObjMut`]; `freeze` turns it into a
//! shared, read-only [`MemoryObj`] whose space returns to the pool when the last clone drops.
//! A full pool answers [`PoolError::OutOfMemory`]; the caller evicts or skips.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use parking_lot::Mutex;

use crate::error::PoolError;
use crate::memory::arena::{HeapAllocator, HostAllocator, HostArena};
use crate::memory::guards::{MemoryGuard, MemoryGuards};

/// Alignment of every region handed out (bytes). Keeps DMA and SIMD copies on fast paths.
pub const REGION_ALIGN: usize = 256;

#[derive(Debug, Default)]
struct FreeList {
    /// offset -> length of each free block, never adjacent (always coalesced).
    free: BTreeMap<usize, usize>,
    used: usize,
    regions: usize,
}

struct PoolInner {
    arena: Box<dyn HostArena>,
    allocator_name: String,
    capacity: usize,
    state: Mutex<FreeList>,
    /// What a device set up on the arena (its page-locking): ended before the arena is freed.
    guards: MemoryGuards,
}

impl Drop for PoolInner {
    fn drop(&mut self) {
        // Fields drop after this body: the guards end while the arena is still allocated.
        self.guards.release_all();
    }
}

impl PoolInner {
    fn release(&self, offset: usize, len: usize) {
        let mut st = self.state.lock();
        st.used -= len;
        st.regions -= 1;
        let mut start = offset;
        let mut size = len;
        if let Some((&prev_off, &prev_len)) = st.free.range(..offset).next_back()
            && prev_off + prev_len == offset
        {
            st.free.remove(&prev_off);
            start = prev_off;
            size += prev_len;
        }
        if let Some(next_len) = st.free.remove(&(offset + len)) {
            size += next_len;
        }
        st.free.insert(start, size);
    }
}

/// A snapshot of pool occupancy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PoolStats {
    /// Arena size.
    pub capacity: usize,
    /// Bytes in live regions (rounded to [`REGION_ALIGN`]).
    pub used: usize,
    /// Live regions.
    pub regions: usize,
    /// Largest contiguous free block.
    pub largest_free: usize,
}

/// A bounded pool of host memory. Cheap to clone (shared).
#[derive(Clone)]
pub struct MemoryPool {
    inner: Arc<PoolInner>,
}

impl fmt::Debug for MemoryPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryPool")
            .field("allocator", &self.inner.allocator_name)
            .field("stats", &self.stats())
            .finish()
    }
}

/// `len` rounded up to the region alignment; `None` when that does not fit a `usize`.
fn round_up(len: usize) -> Option<usize> {
    len.checked_next_multiple_of(REGION_ALIGN)
}

impl MemoryPool {
    /// A pool of `capacity` bytes of anonymous memory ([`HeapAllocator`]).
    pub fn new(capacity: usize) -> Result<Self, PoolError> {
        Self::with_allocator(capacity, &HeapAllocator)
    }

    /// A pool whose arena comes from `allocator` (e.g. pinned memory).
    pub fn with_allocator(
        capacity: usize,
        allocator: &dyn HostAllocator,
    ) -> Result<Self, PoolError> {
        let capacity = capacity / REGION_ALIGN * REGION_ALIGN;
        if capacity == 0 {
            return Err(PoolError::ZeroSize);
        }
        let arena = allocator.allocate_arena(capacity)?;
        let mut free = BTreeMap::new();
        free.insert(0, capacity);
        Ok(MemoryPool {
            inner: Arc::new(PoolInner {
                capacity,
                allocator_name: allocator.name().to_string(),
                arena,
                state: Mutex::new(FreeList {
                    free,
                    used: 0,
                    regions: 0,
                }),
                guards: MemoryGuards::default(),
            }),
        })
    }

    /// Arena size in bytes.
    pub fn capacity(&self) -> usize {
        self.inner.capacity
    }

    /// The arena's first byte and length (for a caller that registers it with a device, e.g.
    /// page-locks it for DMA).
    pub fn arena_region(&self) -> (usize, usize) {
        (
            self.inner.arena.as_ptr().as_ptr() as usize,
            self.inner.capacity,
        )
    }

    /// Attaches `guard` to the arena: it ends (is dropped) when the arena is freed, before the
    /// memory is: where a device's registration of the arena ([`arena_region`]) lives.
    ///
    /// [`arena_region`]: MemoryPool::arena_region
    pub fn attach_to_arena(&self, guard: MemoryGuard) {
        self.inner.guards.attach(guard);
    }

    /// Whether the arena is pinned memory.
    pub fn is_pinned(&self) -> bool {
        self.inner.arena.is_pinned()
    }

    /// Occupancy snapshot.
    pub fn stats(&self) -> PoolStats {
        let st = self.inner.state.lock();
        PoolStats {
            capacity: self.inner.capacity,
            used: st.used,
            regions: st.regions,
            largest_free: st.free.values().copied().max().unwrap_or(0),
        }
    }

    /// Whether `obj` lives in this pool's arena.
    pub fn owns(&self, obj: &MemoryObj) -> bool {
        matches!(&*obj.inner, Storage::Pooled(r) if Arc::ptr_eq(&r.pool, &self.inner))
    }

    /// Carves a region of `len` bytes (first fit). Fails with an error when full; never blocks.
    pub fn allocate(&self, len: usize) -> Result<MemoryObjMut, PoolError> {
        if len == 0 {
            return Err(PoolError::ZeroSize);
        }
        let alloc_len = round_up(len).unwrap_or(usize::MAX);
        if alloc_len > self.inner.capacity {
            return Err(PoolError::LargerThanPool {
                requested: len,
                capacity: self.inner.capacity,
            });
        }
        let mut st = self.inner.state.lock();
        let found = st
            .free
            .iter()
            .find(|&(_, &size)| size >= alloc_len)
            .map(|(&off, &size)| (off, size));
        let Some((offset, size)) = found else {
            return Err(PoolError::OutOfMemory {
                requested: len,
                free: self.inner.capacity - st.used,
                largest: st.free.values().copied().max().unwrap_or(0),
            });
        };
        st.free.remove(&offset);
        if size > alloc_len {
            st.free.insert(offset + alloc_len, size - alloc_len);
        }
        st.used += alloc_len;
        st.regions += 1;
        drop(st);
        Ok(MemoryObjMut {
            storage: Storage::Pooled(Region {
                pool: self.inner.clone(),
                offset,
                len,
                alloc_len,
            }),
        })
    }
}

/// A live region of a pool; returns its space on drop.
struct Region {
    pool: Arc<PoolInner>,
    offset: usize,
    len: usize,
    alloc_len: usize,
}

impl Drop for Region {
    fn drop(&mut self) {
        self.pool.release(self.offset, self.alloc_len);
    }
}

enum Storage {
    Pooled(Region),
    Heap(Box<[u8]>),
}

impl Storage {
    fn arena_offset(&self) -> Option<usize> {
        match self {
            Storage::Pooled(r) => Some(r.offset),
            Storage::Heap(_) => None,
        }
    }

    fn as_slice(&self) -> &[u8] {
        match self {
            // SAFETY: the region lies inside the arena (allocator invariant), is initialised
            // (arena contract), and no `&mut` to it exists while a shared `Storage` is alive.
            Storage::Pooled(r) => unsafe {
                std::slice::from_raw_parts(r.pool.arena.as_ptr().as_ptr().add(r.offset), r.len)
            },
            Storage::Heap(b) => b,
        }
    }
}

/// A unique, writable region. Fill it, then [`MemoryObjMut::freeze`] it to share.
pub struct MemoryObjMut {
    storage: Storage,
}

impl MemoryObjMut {
    /// A heap-backed buffer outside any pool (for tiers that do not use the L1 arena).
    pub fn heap(len: usize) -> Self {
        MemoryObjMut {
            storage: Storage::Heap(vec![0u8; len].into_boxed_slice()),
        }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.as_slice().len()
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Read access.
    pub fn as_slice(&self) -> &[u8] {
        self.storage.as_slice()
    }

    /// Write access.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        match &mut self.storage {
            // SAFETY: as in `Storage::as_slice`, and `MemoryObjMut` is the region's only handle
            // (not Clone), so this is the only reference.
            Storage::Pooled(r) => unsafe {
                std::slice::from_raw_parts_mut(r.pool.arena.as_ptr().as_ptr().add(r.offset), r.len)
            },
            Storage::Heap(b) => b,
        }
    }

    /// Where the region starts in its pool's arena (`None` for heap memory): the address
    /// another process that maps the same arena uses.
    pub fn arena_offset(&self) -> Option<usize> {
        self.storage.arena_offset()
    }

    /// Makes the region shared and read-only.
    pub fn freeze(self) -> MemoryObj {
        MemoryObj {
            inner: Arc::new(self.storage),
        }
    }
}

impl AsMut<[u8]> for MemoryObjMut {
    fn as_mut(&mut self) -> &mut [u8] {
        self.as_mut_slice()
    }
}

impl fmt::Debug for MemoryObjMut {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "MemoryObjMut({} bytes)", self.len())
    }
}

/// A shared, read-only, ref-counted region (pooled or heap). Space returns on the last drop.
#[derive(Clone)]
pub struct MemoryObj {
    inner: Arc<Storage>,
}

impl MemoryObj {
    /// Wraps heap bytes (not counted against any pool).
    pub fn from_vec(bytes: Vec<u8>) -> Self {
        MemoryObj {
            inner: Arc::new(Storage::Heap(bytes.into_boxed_slice())),
        }
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        self.inner.as_slice()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.as_slice().len()
    }

    /// Whether empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Live handles to this region (1 = only this one).
    pub fn ref_count(&self) -> usize {
        Arc::strong_count(&self.inner)
    }

    /// Where the region starts in its pool's arena (`None` for heap memory).
    pub fn arena_offset(&self) -> Option<usize> {
        self.inner.arena_offset()
    }

    /// Whether the bytes live in a pool arena (rather than the heap).
    pub fn is_pooled(&self) -> bool {
        matches!(&*self.inner, Storage::Pooled(_))
    }
}

impl fmt::Debug for MemoryObj {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "MemoryObj({} bytes, refs {})",
            self.len(),
            self.ref_count()
        )
    }
}

impl AsRef<[u8]> for MemoryObj {
    fn as_ref(&self) -> &[u8] {
        self.as_slice()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocation_is_bounded_and_space_returns_on_last_drop() {
        let pool = MemoryPool::new(4 * REGION_ALIGN).unwrap();
        let a = pool.allocate(REGION_ALIGN).unwrap();
        let b = pool.allocate(2 * REGION_ALIGN).unwrap();
        assert!(matches!(
            pool.allocate(2 * REGION_ALIGN),
            Err(PoolError::OutOfMemory { .. })
        ));
        let shared = b.freeze();
        let clone = shared.clone();
        drop(shared);
        assert_eq!(
            pool.stats().used,
            3 * REGION_ALIGN,
            "a clone still holds the region"
        );
        drop(clone);
        drop(a);
        let st = pool.stats();
        assert_eq!(
            (st.used, st.regions, st.largest_free),
            (0, 0, 4 * REGION_ALIGN)
        );
    }

    #[test]
    fn free_blocks_coalesce() {
        let pool = MemoryPool::new(3 * REGION_ALIGN).unwrap();
        let a = pool.allocate(1).unwrap();
        let b = pool.allocate(1).unwrap();
        let c = pool.allocate(1).unwrap();
        drop(a);
        drop(c);
        assert_eq!(pool.stats().largest_free, REGION_ALIGN);
        drop(b);
        assert_eq!(pool.stats().largest_free, 3 * REGION_ALIGN);
        assert!(pool.allocate(3 * REGION_ALIGN).is_ok());
    }

    #[test]
    fn writes_are_visible_after_freeze_and_regions_are_disjoint() {
        let pool = MemoryPool::new(1 << 16).unwrap();
        let mut objs = Vec::new();
        for i in 0..10u8 {
            let mut m = pool.allocate(1000).unwrap();
            m.as_mut_slice().fill(i);
            objs.push(m.freeze());
        }
        for (i, o) in objs.iter().enumerate() {
            assert!(o.as_slice().iter().all(|&b| b == i as u8));
            assert!(pool.owns(o));
        }
        assert!(!pool.owns(&MemoryObj::from_vec(vec![1, 2])));
    }

    #[test]
    fn impossible_requests_are_typed_errors() {
        let pool = MemoryPool::new(1024).unwrap();
        assert!(matches!(pool.allocate(0), Err(PoolError::ZeroSize)));
        assert!(matches!(
            pool.allocate(2048),
            Err(PoolError::LargerThanPool { .. })
        ));
        // Rounding these up to the region alignment overflows a usize.
        for len in [usize::MAX, usize::MAX - 1, usize::MAX - REGION_ALIGN + 2] {
            assert!(matches!(
                pool.allocate(len),
                Err(PoolError::LargerThanPool { .. })
            ));
        }
    }
}
