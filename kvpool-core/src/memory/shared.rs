//! Shared host memory: a pool arena in a memory file (`memfd`), mapped `MAP_SHARED`, so a
//! process handed the file descriptor maps the same bytes (the node-wide pool's L1;
//! docs/design/pool-daemon.md).

use std::ffi::CString;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::Arc;

use parking_lot::Mutex;

use super::arena::{HostAllocator, HostArena};
use super::guards::{MemoryGuard, MemoryGuards};
use crate::error::PoolError;

/// How much of an arena [`SharedMapping::map_all_pages_behind`] maps ahead at a time, holding
/// the mapping.
const MAP_AHEAD_STEP: usize = 64 << 20;

/// A `MAP_SHARED`, read-write mapping of a whole memory file: a pool's arena in the process
/// that created it, or another process's view of it. Unmapped on drop; the memory lives while
/// any process maps it or holds its descriptor.
pub struct SharedMapping {
    ptr: NonNull<u8>,
    len: usize,
    fd: OwnedFd,
    /// What a device set up on this mapping (its page-locking): ended before it is unmapped.
    guards: MemoryGuards,
}

// SAFETY: the mapping is a plain range of process memory; `SharedMapping` hands out only its
// address (callers that read or write through it coordinate, as with any arena).
unsafe impl Send for SharedMapping {}
// SAFETY: as above; no method mutates through `&self`.
unsafe impl Sync for SharedMapping {}

impl SharedMapping {
    /// Creates a zero-filled memory file of `len` bytes named `name` (for `/proc/*/fd`
    /// listings only) and maps it. The file's size is sealed: no process it is passed to can
    /// shrink it (which would make every mapping's accesses past the new end fault).
    pub fn create(name: &str, len: usize) -> io::Result<Self> {
        if len == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "zero-length mapping",
            ));
        }
        let name = CString::new(name)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a NUL in the name"))?;
        // SAFETY: `name` is a valid C string; the flags are valid for memfd_create.
        let raw = unsafe {
            libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)
        };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: memfd_create returned a new descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let size = libc::off_t::try_from(len)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "mapping too large"))?;
        // SAFETY: `fd` is a valid memfd; growing it zero-fills.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), size) } != 0 {
            return Err(io::Error::last_os_error());
        }
        let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
        // SAFETY: `fd` is a memfd created with MFD_ALLOW_SEALING.
        if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Self::map(fd, len)
    }

    /// Maps the first `len` bytes of memory file `fd` (one received from the process that
    /// created it). Fails when the file is shorter than `len`.
    pub fn map(fd: OwnedFd, len: usize) -> io::Result<Self> {
        if len == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "zero-length mapping",
            ));
        }
        // SAFETY: fstat writes into the zeroed struct we own.
        let mut stat: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: `fd` is an open descriptor and `stat` is a valid out-pointer.
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut stat) } != 0 {
            return Err(io::Error::last_os_error());
        }
        if usize::try_from(stat.st_size).unwrap_or(0) < len {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("the memory file holds {} bytes, not {len}", stat.st_size),
            ));
        }
        // SAFETY: a fresh shared mapping of an open file; the kernel picks the address.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let ptr = NonNull::new(ptr.cast::<u8>())
            .ok_or_else(|| io::Error::other("mmap returned a null address"))?;
        Ok(SharedMapping {
            ptr,
            len,
            fd,
            guards: MemoryGuards::default(),
        })
    }

    /// Allocates every page of the memory file now, through this mapping (which must be the
    /// only one: it rewrites what it touches when the kernel cannot populate pages itself).
    /// A pool's owner calls it once, before handing the file out, so the pool's memory is
    /// taken at start instead of page by page under load, and every process that maps the
    /// file finds each page present.
    pub fn commit_pages(&self) -> io::Result<()> {
        self.commit_pages_in(0, self.len)
    }

    /// [`SharedMapping::commit_pages`] for the `len` bytes from `offset` only (clipped to the
    /// mapping; `offset` a multiple of the page size), so an owner can take its memory in
    /// steps and stop before a memory limit.
    pub fn commit_pages_in(&self, offset: usize, len: usize) -> io::Result<()> {
        let offset = offset.min(self.len);
        let len = len.min(self.len - offset);
        self.populate(offset, len, libc::MADV_POPULATE_WRITE, |page| {
            // SAFETY: `page` lies inside the mapping, which no other process maps yet (the
            // caller's contract), so writing back the byte just read changes nothing.
            unsafe { page.write_volatile(page.read_volatile()) }
        })
    }

    /// Maps every page of the file into this process's page tables, reading nothing, so the
    /// first copy out of a page another process wrote does not stop on a page fault per 4 KiB
    /// (a copy out of a freshly mapped arena took about twice as long as one out of pages
    /// already mapped). Costs about as much as those faults, once per mapping, so engines
    /// run it on a thread of its own after attaching.
    pub fn map_all_pages(&self) -> io::Result<()> {
        self.map_pages_in(0, self.len)
    }

    /// [`SharedMapping::map_all_pages`] for the `len` bytes from `offset` (inside the mapping).
    fn map_pages_in(&self, offset: usize, len: usize) -> io::Result<()> {
        self.populate(offset, len, libc::MADV_POPULATE_READ, |page| {
            // SAFETY: `page` lies inside the mapping; a volatile read of one byte is a plain
            // load the compiler keeps.
            unsafe {
                page.read_volatile();
            }
        })
    }

    /// [`SharedMapping::map_all_pages`] on a thread of its own, for a process that has just
    /// mapped another's arena and should not wait for it. The thread holds the mapping only
    /// while it maps one step (64 MiB): a mapping let go meanwhile (its
    /// daemon died) is unmapped then, not once the whole arena is mapped ahead. A failure is
    /// logged: pages are then mapped on first touch, as without it.
    pub fn map_all_pages_behind(self: &Arc<Self>) {
        let mapping = Arc::downgrade(self);
        let spawned = std::thread::Builder::new()
            .name("kvpool-map-arena".into())
            .spawn(move || {
                let started = std::time::Instant::now();
                let mut offset = 0;
                while let Some(mapping) = mapping.upgrade() {
                    if offset >= mapping.len {
                        tracing::debug!(
                            bytes = mapping.len,
                            elapsed_ms = started.elapsed().as_millis() as u64,
                            "mapped a shared arena ahead of use"
                        );
                        return;
                    }
                    let len = MAP_AHEAD_STEP.min(mapping.len - offset);
                    if let Err(e) = mapping.map_pages_in(offset, len) {
                        tracing::warn!(
                            "could not map a shared arena ahead of use ({e}); its pages are \
                             mapped on first touch instead"
                        );
                        return;
                    }
                    offset += len;
                }
                tracing::debug!("a shared arena was let go before it was mapped ahead");
            });
        if let Err(e) = spawned {
            tracing::warn!("no thread to map a shared arena ahead of use: {e}");
        }
    }

    /// `madvise(advice)` over `len` bytes from `offset` of the mapping (both inside it), or
    /// `touch` on one byte of each of their pages where the kernel does not know `advice`
    /// (before Linux 5.14).
    fn populate(
        &self,
        offset: usize,
        len: usize,
        advice: libc::c_int,
        touch: impl Fn(*mut u8),
    ) -> io::Result<()> {
        debug_assert!(offset.checked_add(len).is_some_and(|end| end <= self.len));
        if len == 0 {
            return Ok(());
        }
        // SAFETY: the range lies inside this mapping (the callers clip it).
        let start = unsafe { self.ptr.as_ptr().add(offset) };
        // SAFETY: advises a range inside this mapping.
        let rc = unsafe { libc::madvise(start.cast(), len, advice) };
        if rc == 0 {
            return Ok(());
        }
        let err = io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::EINVAL) {
            return Err(err);
        }
        // SAFETY: sysconf has no preconditions.
        let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096);
        for at in (0..len).step_by(page.max(1)) {
            // SAFETY: `at < len`, inside the range, inside the mapping.
            touch(unsafe { start.add(at) });
        }
        Ok(())
    }

    /// The memory file, to pass to another process (e.g. with `SCM_RIGHTS`).
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// The mapping's first byte in this process.
    pub fn as_ptr(&self) -> NonNull<u8> {
        self.ptr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Attaches `guard` to this mapping: it ends (is dropped) when the mapping is unmapped,
    /// before it is: where a device's registration of the mapping for DMA lives.
    pub fn attach(&self, guard: MemoryGuard) {
        self.guards.attach(guard);
    }

    /// How many guards [`attach`](Self::attach) attached (and have not ended).
    pub fn guards(&self) -> usize {
        self.guards.len()
    }

    /// Whether the mapping is empty (never: creating one of zero bytes fails).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for SharedMapping {
    fn drop(&mut self) {
        // A device's registration of these pages ends while they are still mapped.
        self.guards.release_all();
        // SAFETY: unmaps exactly the range `map` mapped; no reference into it outlives `self`
        // (arenas and their regions hold an `Arc` to it).
        unsafe {
            libc::munmap(self.ptr.as_ptr().cast(), self.len);
        }
    }
}

impl std::fmt::Debug for SharedMapping {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "SharedMapping({} bytes, fd {})",
            self.len,
            self.fd.as_raw_fd()
        )
    }
}

struct SharedArena(Arc<SharedMapping>);

// SAFETY: the mapping is `len` zero-initialised bytes, valid and unmoved until the last `Arc`
// drops. Other processes that map the file write only into regions the pool's owner handed
// them (the owner's protocol), which is the "anyone else" the pool coordinates with.
unsafe impl HostArena for SharedArena {
    fn as_ptr(&self) -> NonNull<u8> {
        self.0.as_ptr()
    }
    fn len(&self) -> usize {
        self.0.len()
    }
}

/// Allocates pool arenas in memory files, keeping each mapping so its owner can hand the file
/// to other processes ([`SharedMemoryAllocator::arena`]).
#[derive(Default)]
pub struct SharedMemoryAllocator {
    arena: Mutex<Option<Arc<SharedMapping>>>,
}

impl SharedMemoryAllocator {
    /// An allocator that has made no arena yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// The last arena allocated, if any.
    pub fn arena(&self) -> Option<Arc<SharedMapping>> {
        self.arena.lock().clone()
    }
}

impl HostAllocator for SharedMemoryAllocator {
    fn name(&self) -> &str {
        "shared"
    }

    fn allocate_arena(&self, bytes: usize) -> Result<Box<dyn HostArena>, PoolError> {
        if bytes == 0 {
            return Err(PoolError::ZeroSize);
        }
        let mapping = SharedMapping::create("kvpool-l1", bytes).map_err(|e| PoolError::Arena {
            bytes,
            reason: e.to_string(),
        })?;
        let mapping = Arc::new(mapping);
        *self.arena.lock() = Some(mapping.clone());
        Ok(Box::new(SharedArena(mapping)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::{MemoryObj, MemoryObjMut, MemoryPool};

    #[test]
    fn no_process_can_resize_the_memory_file() {
        let mapping = SharedMapping::create("kvpool-test-sealed", 1 << 16).unwrap();
        let fd = mapping.fd().as_raw_fd();
        // SAFETY: a valid descriptor; the call is expected to fail.
        let shrunk = unsafe { libc::ftruncate(fd, 4096) };
        // SAFETY: as above.
        let grown = unsafe { libc::ftruncate(fd, 1 << 20) };
        // SAFETY: as above.
        let resealed = unsafe { libc::fcntl(fd, libc::F_ADD_SEALS, 0) };
        assert_ne!(shrunk, 0, "shrunk");
        assert_ne!(grown, 0, "grown");
        assert_ne!(resealed, 0, "seals changed");
    }

    #[test]
    fn a_second_mapping_of_the_file_sees_the_pools_bytes_and_writes_back() {
        let alloc = SharedMemoryAllocator::new();
        let pool = MemoryPool::with_allocator(1 << 20, &alloc).unwrap();
        let arena = alloc.arena().unwrap();
        let mut a = pool.allocate(1000).unwrap();
        let mut b = pool.allocate(1000).unwrap();
        a.as_mut_slice().fill(7);
        b.as_mut_slice().fill(9);
        let (a_off, b_off) = (a.arena_offset().unwrap(), b.arena_offset().unwrap());
        assert_ne!(a_off, b_off);

        let other =
            SharedMapping::map(arena.fd().try_clone_to_owned().unwrap(), pool.capacity()).unwrap();
        assert_ne!(other.as_ptr(), arena.as_ptr(), "a mapping of its own");
        // SAFETY: both regions lie inside the 1 MiB mapping; nothing else writes them here.
        let view = |off: usize| unsafe {
            std::slice::from_raw_parts_mut(other.as_ptr().as_ptr().add(off), 1000)
        };
        assert!(view(a_off).iter().all(|&x| x == 7));
        assert!(view(b_off).iter().all(|&x| x == 9));
        view(b_off).fill(3);
        assert!(b.as_slice().iter().all(|&x| x == 3));
        assert_eq!(b.freeze().arena_offset(), Some(b_off));
    }

    #[test]
    fn a_file_shorter_than_asked_is_refused() {
        let m = SharedMapping::create("t", 4096).unwrap();
        let err = SharedMapping::map(m.fd().try_clone_to_owned().unwrap(), 8192).unwrap_err();
        assert!(err.to_string().contains("holds 4096 bytes"), "{err}");
        assert!(SharedMapping::create("t", 0).is_err());
    }

    /// Bytes of `mapping` present in this process's page tables (`Rss` in /proc/self/smaps).
    fn mapped_bytes(mapping: &SharedMapping) -> usize {
        let start = format!("{:x}-", mapping.as_ptr().as_ptr() as usize);
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let entry = smaps
            .split_inclusive('\n')
            .skip_while(|line| !line.starts_with(&start))
            .skip(1)
            .find(|line| line.starts_with("Rss:"))
            .expect("the mapping's Rss line");
        let kib: usize = entry.split_whitespace().nth(1).unwrap().parse().unwrap();
        kib * 1024
    }

    #[test]
    fn a_committed_file_is_mapped_whole_in_a_second_process_view_only_once_asked() {
        const LEN: usize = 8 << 20;
        let owner = SharedMapping::create("kvpool-test-commit", LEN).unwrap();
        assert!(mapped_bytes(&owner) < LEN / 2, "nothing touched yet");
        owner.commit_pages().unwrap();
        assert_eq!(mapped_bytes(&owner), LEN, "every page allocated and mapped");

        let engine = SharedMapping::map(owner.fd().try_clone_to_owned().unwrap(), LEN).unwrap();
        assert!(
            mapped_bytes(&engine) < LEN / 2,
            "a fresh view maps pages on first touch"
        );
        engine.map_all_pages().unwrap();
        assert_eq!(
            mapped_bytes(&engine),
            LEN,
            "every page mapped without a fault"
        );
        // SAFETY: both offsets lie inside the mapping; nothing else writes it.
        unsafe {
            owner.as_ptr().as_ptr().add(LEN - 1).write(5);
            assert_eq!(engine.as_ptr().as_ptr().add(LEN - 1).read(), 5);
        }
    }

    #[test]
    fn heap_memory_has_no_arena_offset() {
        assert_eq!(MemoryObjMut::heap(8).arena_offset(), None);
        assert_eq!(MemoryObj::from_vec(vec![1]).arena_offset(), None);
    }
}
