//! Page-locked host memory owned by the memory it locks: a [`HostRegistration`] page-locks a
//! range for DMA and, when dropped, waits for the copy streams that use it and only then
//! unlocks it. The memory's owner holds it (`kvpool_core::memory::MemoryGuards`: L1's arena,
//! a mapping of the node daemon's arena) and drops it before freeing the memory, so no
//! registration outlives its memory. A range any part of which is page-locked already is
//! refused, never reused: CUDA would otherwise go on moving the old pages under the range.

use std::collections::BTreeMap;
use std::sync::Arc;

use parking_lot::Mutex;

use crate::driver::{CudaDriver, CudaError};
use crate::engine::CopyStream;

/// Ranges page-locked by this process through kvpool-cuda, `start -> (length, done)`: an entry
/// is reserved (`done` false) before the driver is asked, so no other registration of an
/// overlapping range starts meanwhile, without the lock held during the driver's call (which
/// takes seconds for a large arena, and every copy-kernel job looks the registry up).
static REGISTERED: Mutex<BTreeMap<usize, (usize, bool)>> = Mutex::new(BTreeMap::new());

/// Whether every `(address, length)` range of `ranges` lies within one range page-locked
/// through kvpool-cuda now (one look at the registry for all of them).
pub fn all_registered(ranges: impl IntoIterator<Item = (u64, u64)>) -> bool {
    let registered = REGISTERED.lock();
    // Consecutive ranges mostly fall in the same registration: try the last one found first.
    // Only finished registrations count.
    let mut last: Option<(usize, usize)> = None;
    ranges.into_iter().all(|(ptr, len)| {
        let (Ok(ptr), Ok(len)) = (usize::try_from(ptr), usize::try_from(len)) else {
            return false;
        };
        let Some(end) = ptr.checked_add(len) else {
            return false;
        };
        let within = |(start, l): (usize, usize)| ptr >= start && end <= start + l;
        if last.is_some_and(within) {
            return true;
        }
        let found = registered
            .range(..=ptr)
            .next_back()
            .filter(|(_, (_, done))| *done)
            .map(|(&start, &(l, _))| (start, l));
        last = found;
        found.is_some_and(within)
    })
}

/// Why a range was not page-locked.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RegisterError {
    /// An empty range or one at address 0.
    #[error("no host memory to page-lock ({len} bytes at {ptr:#x})")]
    Empty {
        /// The range's start.
        ptr: usize,
        /// Its length.
        len: usize,
    },
    /// Part of the range is page-locked already (by kvpool in this process, or by another
    /// library: the driver said so). Copies through it could move stale pages: refused.
    #[error(
        "{len} bytes at {ptr:#x} overlap memory page-locked earlier in this process and never \
         unlocked (memory freed while registered?); kvpool refuses to copy through it"
    )]
    AlreadyRegistered {
        /// The range's start.
        ptr: usize,
        /// Its length.
        len: usize,
    },
    /// The driver failed otherwise.
    #[error(transparent)]
    Driver(#[from] CudaError),
}

/// See the module docs.
pub struct HostRegistration {
    driver: Arc<dyn CudaDriver>,
    ptr: usize,
    len: usize,
    /// The streams whose copies read or write the range: waited for before it unlocks.
    users: Vec<Arc<CopyStream>>,
}

impl std::fmt::Debug for HostRegistration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HostRegistration({} bytes at {:#x})", self.len, self.ptr)
    }
}

impl HostRegistration {
    /// Page-locks `len` bytes at `ptr`, used by the copies of `users`' streams.
    ///
    /// # Safety
    /// The range is host memory that stays allocated and mapped until the returned guard is
    /// dropped (its owner attaches the guard to the memory).
    pub unsafe fn register(
        driver: Arc<dyn CudaDriver>,
        ptr: usize,
        len: usize,
        users: Vec<Arc<CopyStream>>,
    ) -> Result<Self, RegisterError> {
        if ptr == 0 || len == 0 {
            return Err(RegisterError::Empty { ptr, len });
        }
        {
            let mut registered = REGISTERED.lock();
            let overlaps = registered
                .range(..ptr.saturating_add(len))
                .next_back()
                .is_some_and(|(&start, &(l, _))| start + l > ptr);
            if overlaps {
                return Err(RegisterError::AlreadyRegistered { ptr, len });
            }
            registered.insert(ptr, (len, false));
        }
        // SAFETY: the caller keeps the range allocated until the guard drops, which
        // unregisters it.
        let result = unsafe { driver.host_register(ptr, len) };
        let mut registered = REGISTERED.lock();
        match result {
            Ok(()) => {
                registered.insert(ptr, (len, true));
            }
            Err(e) => {
                registered.remove(&ptr);
                return Err(if e.is_already_registered() {
                    RegisterError::AlreadyRegistered { ptr, len }
                } else {
                    e.into()
                });
            }
        }
        Ok(HostRegistration {
            driver,
            ptr,
            len,
            users,
        })
    }

    /// The range: `(start, length)`.
    pub fn range(&self) -> (usize, usize) {
        (self.ptr, self.len)
    }
}

impl Drop for HostRegistration {
    fn drop(&mut self) {
        // Copies still queued on the streams that use the range finish before it unlocks.
        for stream in &self.users {
            if let Err(e) = stream.synchronize() {
                tracing::warn!(
                    "kvpool-cuda: waiting for copies before unlocking {self:?}: {e}; unlocking anyway"
                );
            }
        }
        // Out of the registry first: no copy-kernel job may take the range as locked once
        // its unlocking starts.
        REGISTERED.lock().remove(&self.ptr);
        if let Err(e) = self.driver.host_unregister(self.ptr) {
            tracing::warn!("kvpool-cuda: unlocking {self:?}: {e}");
        }
    }
}
