//! kvpool-cuda: the GPU transfer engine (pinned host memory, paged gather/scatter on cudarc).
//!
//! Not implemented yet: this crate currently exports nothing. The GPU engine will implement
//! [`kvpool_core::KvTransfer`] over device KV caches and supply pinned memory through
//! [`kvpool_core::HostAllocator`]; until then, use [`kvpool_core::HostPagedKvCache`] for host
//! caches and [`kvpool_core::HeapAllocator`] for pool memory.
