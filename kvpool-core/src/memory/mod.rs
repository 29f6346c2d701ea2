//! Host memory: the bounded pool that every L1 chunk lives in, and the eviction policies that
//! decide what a bounded tier drops.

pub mod arena;
pub mod cgroup;
pub mod eviction;
pub mod guards;
pub mod pool;
pub mod shared;

pub use arena::{HeapAllocator, HostAllocator, HostArena};
pub use eviction::{EvictionKind, EvictionPolicy};
pub use guards::{MemoryGuard, MemoryGuards};
pub use pool::{MemoryObj, MemoryObjMut, MemoryPool};
pub use shared::{SharedMapping, SharedMemoryAllocator};
