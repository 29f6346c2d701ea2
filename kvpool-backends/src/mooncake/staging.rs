//! The staging arena: memory registered with Mooncake's transfer engine, handed out as `Bytes`.

use std::sync::Arc;

use bytes::Bytes;
use tracing::warn;

use kvpool_core::{HeapAllocator, HostAllocator, HostArena, MemoryObjMut, PoolError};

use super::client::{MooncakeStoreClient, OK, RawBuffer};

/// Heap arenas registered with the client as they are made, so every staging buffer is
/// transferable.
pub(super) struct RegisteringAllocator {
    pub(super) client: Arc<dyn MooncakeStoreClient>,
}

impl HostAllocator for RegisteringAllocator {
    fn name(&self) -> &str {
        "mooncake-registered"
    }

    fn allocate_arena(&self, bytes: usize) -> Result<Box<dyn HostArena>, PoolError> {
        let arena = HeapAllocator.allocate_arena(bytes)?;
        let buffer = RawBuffer {
            ptr: arena.as_ptr().as_ptr(),
            len: bytes,
        };
        // SAFETY: the arena lives as long as the pool, which the connector keeps as long as
        // the client.
        let code = unsafe { self.client.register_buffer(buffer) };
        match code {
            Ok(OK) => Ok(arena),
            other => {
                warn!(result = ?other, "Mooncake refused to register the staging arena");
                Err(PoolError::OutOfMemory {
                    requested: bytes,
                    free: 0,
                    largest: 0,
                })
            }
        }
    }
}

/// A staging buffer holding a value: zero-copy into [`Bytes`].
pub(super) fn staged_bytes(slot: MemoryObjMut, len: usize) -> Bytes {
    Bytes::from_owner(slot.freeze()).slice(..len)
}

/// Copies staged results to the heap, freeing their staging; false if there was none.
pub(super) fn spill_to_heap(out: &mut [Option<Bytes>]) -> bool {
    let mut freed = false;
    for value in out.iter_mut().flatten() {
        *value = Bytes::copy_from_slice(value);
        freed = true;
    }
    freed
}
