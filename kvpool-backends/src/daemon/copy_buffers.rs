//! Reused buffers for the daemon's copies of committed values out of its arena: a copy lands
//! in memory an earlier copy has already faulted in, instead of pages fresh from the kernel.
//!
//! A value written behind is copied out of the arena, checked on that copy and handed to the
//! lower tiers as [`Bytes`]. Allocated anew each time, its buffer's pages are often fresh
//! from the kernel, each faulted in and zeroed before the copy: always for a value past
//! glibc's largest mmap threshold (32 MiB: a 256-token chunk of a model with 128 KiB or more
//! of KV per token), and for 2 MiB values on the daemon's low-priority threads in the
//! benchmark too. Fresh buffers made the whole write behind take 1.2-1.6× the CPU it takes
//! with reused ones (docs/benchmarks.md, "the daemon's copies in reused buffers"). Here the
//! buffer goes back to a free list when the last [`Bytes`] made from it is dropped (once
//! every tier has written it), and a later copy of a value at least half its size reuses it.
//! The free list holds at most [`CopyBuffers::new`]'s byte bound
//! (`DaemonOptions::copy_buffer_bytes`): a buffer coming back when the list is full pushes
//! out the buffers that have stayed unused longest (so buffers of sizes no longer written do
//! not keep out the sizes written now), and a buffer larger than the whole bound is freed.

use std::collections::VecDeque;
use std::sync::Arc;

use bytes::Bytes;
use parking_lot::Mutex;

/// A bounded free list of copy buffers, shared by every copy of one daemon.
#[derive(Clone)]
pub(super) struct CopyBuffers {
    free: Arc<Mutex<FreeList>>,
}

struct FreeList {
    /// Oldest returned first.
    buffers: VecDeque<Vec<u8>>,
    /// Sum of the free buffers' capacities.
    bytes: usize,
    /// Most bytes of capacity kept free.
    limit: usize,
}

impl FreeList {
    /// The smallest free buffer that holds `len` bytes and is at most twice that (a small
    /// value never holds a large buffer, which a tier that keeps values would keep too).
    fn take(&mut self, len: usize) -> Option<Vec<u8>> {
        let (position, _) = self
            .buffers
            .iter()
            .enumerate()
            .filter(|(_, buffer)| (len..=len.saturating_mul(2)).contains(&buffer.capacity()))
            .min_by_key(|(_, buffer)| buffer.capacity())?;
        let buffer = self.buffers.remove(position)?;
        self.bytes -= buffer.capacity();
        Some(buffer)
    }

    /// Keeps `buffer` for a later copy, pushing out the longest-unused buffers until it fits
    /// under the bound; returns what no longer stays (the pushed-out buffers, or `buffer`
    /// itself when it is empty or larger than the bound) for the caller to free once it has
    /// let go of the list.
    fn keep(&mut self, mut buffer: Vec<u8>) -> Vec<Vec<u8>> {
        let capacity = buffer.capacity();
        if capacity == 0 || capacity > self.limit {
            return vec![buffer];
        }
        let mut pushed_out = Vec::new();
        while self.bytes + capacity > self.limit {
            let Some(oldest) = self.buffers.pop_front() else {
                break;
            };
            self.bytes -= oldest.capacity();
            pushed_out.push(oldest);
        }
        buffer.clear();
        self.bytes += capacity;
        self.buffers.push_back(buffer);
        pushed_out
    }
}

/// The bytes of one copy; its buffer goes back to the free list when dropped.
struct RecycledBuffer {
    buffer: Vec<u8>,
    free: Arc<Mutex<FreeList>>,
}

impl AsRef<[u8]> for RecycledBuffer {
    fn as_ref(&self) -> &[u8] {
        &self.buffer
    }
}

impl Drop for RecycledBuffer {
    fn drop(&mut self) {
        let not_kept = self.free.lock().keep(std::mem::take(&mut self.buffer));
        // Freed (for a large buffer, unmapped) after the lock is released: a copy waiting to
        // take a buffer does not wait on it.
        drop(not_kept);
    }
}

impl CopyBuffers {
    /// A free list keeping at most `free_bytes` bytes of buffers between copies.
    pub(super) fn new(free_bytes: usize) -> Self {
        CopyBuffers {
            free: Arc::new(Mutex::new(FreeList {
                buffers: VecDeque::new(),
                bytes: 0,
                limit: free_bytes,
            })),
        }
    }

    /// A copy of `source`, in a kept buffer where one is large enough (a new one otherwise).
    pub(super) fn copy_of(&self, source: &[u8]) -> Bytes {
        let taken = self.free.lock().take(source.len());
        let mut buffer = taken.unwrap_or_else(|| Vec::with_capacity(source.len()));
        buffer.extend_from_slice(source);
        Bytes::from_owner(RecycledBuffer {
            buffer,
            free: self.free.clone(),
        })
    }

    /// Bytes of capacity kept free now.
    #[cfg(test)]
    pub(super) fn free_bytes(&self) -> usize {
        self.free.lock().bytes
    }

    /// The capacities of the buffers kept free now, smallest first.
    #[cfg(test)]
    fn kept_capacities(&self) -> Vec<usize> {
        let mut capacities: Vec<usize> =
            self.free.lock().buffers.iter().map(Vec::capacity).collect();
        capacities.sort_unstable();
        capacities
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dropped_copy_gives_its_buffer_to_the_next_copy() {
        let buffers = CopyBuffers::new(1 << 20);
        let first = buffers.copy_of(&[7u8; 4096]);
        let first_address = first.as_ptr();
        assert_eq!(&first[..], &[7u8; 4096][..]);
        assert_eq!(buffers.free_bytes(), 0, "a buffer in use is not free");
        drop(first);
        assert_eq!(buffers.free_bytes(), 4096);
        // A smaller value (at least half its size) reuses the kept buffer and reads back as
        // itself, none of the old bytes.
        let second = buffers.copy_of(&[9u8; 2500]);
        assert_eq!(second.as_ptr(), first_address, "the kept buffer is reused");
        assert_eq!(&second[..], &[9u8; 2500][..]);
        assert_eq!(buffers.free_bytes(), 0);
    }

    #[test]
    fn a_buffer_lives_until_its_last_clone_is_dropped() {
        let buffers = CopyBuffers::new(1 << 20);
        let copy = buffers.copy_of(b"value");
        let clone = copy.clone(); // one per tier written
        drop(copy);
        assert_eq!(buffers.free_bytes(), 0, "still read by a tier");
        assert_eq!(&clone[..], b"value");
        drop(clone);
        assert_eq!(buffers.free_bytes(), 5);
    }

    #[test]
    fn a_small_value_never_takes_a_buffer_more_than_twice_its_size() {
        let buffers = CopyBuffers::new(1 << 20);
        let large = buffers.copy_of(&[1u8; 4000]);
        let large_address = large.as_ptr();
        drop(large);
        let small = buffers.copy_of(&[2u8; 100]);
        assert_ne!(
            small.as_ptr(),
            large_address,
            "a 100-byte value holds no 4,000-byte buffer"
        );
        assert_eq!(buffers.free_bytes(), 4000, "the large buffer stays free");
        let half = buffers.copy_of(&[3u8; 2000]);
        assert_eq!(
            half.as_ptr(),
            large_address,
            "a value of half its size reuses it"
        );
    }

    #[test]
    fn the_free_list_picks_the_smallest_fit() {
        let buffers = CopyBuffers::new(1 << 20);
        let small = buffers.copy_of(&[1u8; 1000]);
        let larger = buffers.copy_of(&[2u8; 1500]);
        let (small_address, larger_address) = (small.as_ptr(), larger.as_ptr());
        drop(larger); // kept first: a first fit would take it
        drop(small);
        let fits_both = buffers.copy_of(&[4u8; 900]);
        assert_eq!(
            fits_both.as_ptr(),
            small_address,
            "900 bytes fit 1,000 and 1,500: the smaller is taken"
        );
        let fits_larger = buffers.copy_of(&[5u8; 1200]);
        assert_eq!(fits_larger.as_ptr(), larger_address);
        let too_large = buffers.copy_of(&[6u8; 4000]);
        assert_eq!(
            &too_large[..],
            &[6u8; 4000][..],
            "a new buffer when none fits"
        );
    }

    #[test]
    fn a_full_free_list_pushes_out_its_longest_unused_buffers_and_never_passes_its_bound() {
        let buffers = CopyBuffers::new(3000);
        let oldest = buffers.copy_of(&[1u8; 1000]);
        let newer = buffers.copy_of(&[2u8; 1000]);
        let newest = buffers.copy_of(&[3u8; 1500]);
        let (newer_address, newest_address) = (newer.as_ptr(), newest.as_ptr());
        drop(oldest);
        drop(newer);
        assert_eq!(buffers.free_bytes(), 2000);
        drop(newest); // 3,500 bytes would pass the bound: the oldest goes
        assert_eq!(buffers.free_bytes(), 2500);
        let first = buffers.copy_of(&[4u8; 1400]);
        let second = buffers.copy_of(&[5u8; 900]);
        assert_eq!(first.as_ptr(), newest_address);
        assert_eq!(second.as_ptr(), newer_address);
        drop((first, second));
        let larger_than_the_bound = buffers.copy_of(&[6u8; 4000]);
        drop(larger_than_the_bound);
        assert_eq!(
            buffers.free_bytes(),
            2500,
            "a buffer larger than the whole bound is freed, and pushes nothing out"
        );
    }

    #[test]
    fn buffers_of_sizes_no_longer_written_do_not_keep_out_the_sizes_written_now() {
        let buffers = CopyBuffers::new(4000);
        let stale: Vec<Bytes> = (0..4).map(|_| buffers.copy_of(&[1u8; 1000])).collect();
        drop(stale);
        assert_eq!(
            buffers.free_bytes(),
            4000,
            "the list is full of 1,000-byte buffers"
        );
        // The values written now are 3,000 bytes: none of the kept buffers fits them.
        let first = buffers.copy_of(&[2u8; 3000]);
        let first_address = first.as_ptr();
        drop(first);
        assert_eq!(
            buffers.kept_capacities(),
            [1000, 3000],
            "the three longest unused make room for the buffer of the size written now"
        );
        let second = buffers.copy_of(&[3u8; 3000]);
        assert_eq!(
            second.as_ptr(),
            first_address,
            "the buffer of the size written now is kept and reused"
        );
        assert_eq!(&second[..], &[3u8; 3000][..]);
    }
}
