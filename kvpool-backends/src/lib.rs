//! kvpool-backends: storage tiers, one cargo feature each, and the pool builder.
//!
//! | feature | module | tier |
//! |---|---|---|
//! | (always) | [`cpu`] | L1: bounded local CPU memory with LRU / FIFO / S3-FIFO eviction |
//! | `disk` | `disk` | `file:///path`: local RocksDB, byte capacity with LRU eviction, optional admission filter |
//! | `redis` | `redis` | `redis://`, `rediss://`, `redis+cluster://`: pipelined batches, TTL, AUTH, TLS, reconnects |
//! | `s3` | `s3` | `s3://bucket/prefix`: S3 and S3-compatible servers through object_store |
//! | `mooncake` | `mooncake` (folder; the Python client in `mooncake/python.rs`) | `mooncakestore://master:port`: Mooncake Store through its Python client, embedded |
//! | (always) | [`memory`] | `memory://`: a process-local `RemoteConnector` |
//! | `testkit` | `conformance`, `faults`, `InMemoryNodeMemory` | for tests, not for production: the conformance kit every backend runs, a fault wrapper over any connector, the in-memory store with a node-memory side |
//!
//! [`registry`] maps URL schemes to backends: each backend module registers its own schemes
//! and parses its own `[[tier]]` options, and a third-party crate adds a backend the same way
//! ([`register_scheme`]).
//!
//! Cross-cutting concerns are wrappers implementing the same trait: [`timeout`] bounds every
//! call of any `RemoteConnector`; [`deferred`] stands in for a tier that could not be reached
//! at start-up (a miss) and opens it in the background once it can. [`metrics_endpoint`] serves every metric kvpool records to
//! Prometheus (`[metrics] listen`). [`allocator_trim`] hands the C allocator's free pages back
//! to the operating system now and then (`[allocator] release_free_pages_secs`).
//! [`background`] is the runtime of low-priority threads that write-behind to disk tiers runs
//! on (`[write_behind] low_priority`).

#![warn(missing_docs)]

pub mod allocator_trim;
pub mod backend_factory;
pub mod background;
#[cfg(feature = "testkit")]
pub mod conformance;
pub mod cpu;
mod cpu_pressure;
pub mod daemon;
pub mod deferred;
#[cfg(feature = "disk")]
pub mod disk;
#[cfg(feature = "testkit")]
pub mod faults;
pub mod memory;
pub mod metrics_endpoint;
#[cfg(feature = "mooncake")]
pub mod mooncake;
pub mod pool_builder;
#[cfg(feature = "redis")]
pub mod redis;
pub mod registry;
#[cfg(feature = "s3")]
pub mod s3;
pub mod telemetry;
pub mod timeout;
#[cfg(any(feature = "redis", feature = "s3"))]
mod tls;

pub use backend_factory::{BackendFactory, TierRequest};
pub use cpu::LocalCpuBackend;
#[cfg(feature = "testkit")]
pub use faults::{ControlledFaults, FaultSwitches};
pub use memory::InMemoryConnector;
#[cfg(feature = "testkit")]
pub use memory::InMemoryNodeMemory;
pub use metrics_endpoint::{metrics_address, serve_metrics};
pub use pool_builder::{Pool, build_pool, build_pool_with_allocator};
pub use registry::{open_tier, register_scheme};
pub use timeout::TimeoutConnector;
