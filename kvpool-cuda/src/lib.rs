//! kvpool's CUDA side, on [cudarc]: the copies between an engine's paged KV and kvpool's host
//! chunks, and the page-locking of the host memory they go through.
//!
//! - [`plan`]: a job's copies as segments in ordered phases ([`CopyPlan`]), built in Rust from
//!   the job the worker plans, once, for every device: consecutive blocks merge into one
//!   segment; every engine-side address is checked against the planes.
//! - [`HostExecutor`]: runs plans with `memcpy` when the KV is in host memory (vLLM's CPU
//!   build): the plan a GPU runs is the plan CI's real-vLLM suite runs.
//! - [`CudaCopyEngine`]: runs plans on a GPU, one `cuMemcpyBatchAsync` per phase of a job
//!   (per-segment `cuMemcpyAsync` where the driver has none), or kvpool's copy kernel for
//!   small scattered pages ([`CopyMode`]), on kvpool's own stream ordered after the engine's
//!   compute stream with events, polled without a device-wide synchronize.
//! - [`HostRegistration`]: page-locked host memory owned by the memory it locks.
//!
//! The driver is loaded at run time ([`CudarcDriver`]): everything builds, and the CPU side
//! runs, where there is no CUDA; [`fake::FakeDriver`] stands in for it in tests.
//!
//! Where it has run: CPU (host executor, fake driver) in CI; the GPU path on the machines
//! docs/benchmarks.md names, and nowhere else.
//!
//! [cudarc]: https://docs.rs/cudarc

pub mod cudarc_driver;
pub mod driver;
pub mod engine;
pub mod fake;
pub mod host;
pub mod plan;
pub mod registration;

pub use cudarc_driver::CudarcDriver;
pub use driver::{CudaDriver, CudaError, RawEvent, RawStream};
pub use engine::{CopyError, CopyMode, CopyStream, CudaCopyEngine, KERNEL_BELOW, Submitted};
pub use host::HostExecutor;
pub use plan::{CopyPlan, Direction, JobSpec, KvPlanes, PlanError, PlanStats, Plane, Segment};
pub use registration::{HostRegistration, RegisterError, all_registered};
