//! The CUDA driver calls kvpool makes, as a trait: [`crate::CudarcDriver`] makes them through
//! cudarc; [`crate::fake::FakeDriver`] stands in for tests where no GPU is.

use crate::plan::Segment;

/// `CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED`: part of a range is page-locked already.
pub const HOST_MEMORY_ALREADY_REGISTERED: i32 = 712;

/// A failed driver call.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{call} failed: {name} ({code})")]
pub struct CudaError {
    /// The driver function.
    pub call: &'static str,
    /// Its `CUresult`.
    pub code: i32,
    /// The result's name (`CUDA_ERROR_...`).
    pub name: String,
}

impl CudaError {
    /// Whether the driver refused to page-lock memory that is page-locked already.
    pub fn is_already_registered(&self) -> bool {
        self.code == HOST_MEMORY_ALREADY_REGISTERED
    }
}

/// A stream handle as the driver gives it (`CUstream`; torch's `cuda_stream` is one). Zero is
/// the legacy default stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RawStream(pub usize);

/// An event handle as the driver gives it (`CUevent`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RawEvent(pub usize);

/// The driver calls kvpool's CUDA side makes, on one device's primary context (the one torch
/// and vLLM use). Each call makes that context current on the calling thread first.
pub trait CudaDriver: Send + Sync + 'static {
    /// The device and driver, for logs.
    fn describe(&self) -> String;
    /// Page-locks `len` bytes of host memory at `ptr` for DMA (`cuMemHostRegister`).
    ///
    /// # Safety
    /// The range is host memory that stays allocated until [`host_unregister`] ends this.
    ///
    /// [`host_unregister`]: CudaDriver::host_unregister
    unsafe fn host_register(&self, ptr: usize, len: usize) -> Result<(), CudaError>;
    /// Ends the page-locking of the range registered at `ptr`.
    fn host_unregister(&self, ptr: usize) -> Result<(), CudaError>;
    /// A new stream that does not wait for the legacy default stream.
    fn stream_create(&self) -> Result<RawStream, CudaError>;
    /// Destroys a stream from [`stream_create`](CudaDriver::stream_create).
    fn stream_destroy(&self, stream: RawStream);
    /// Waits on the host for everything queued on `stream`.
    fn stream_synchronize(&self, stream: RawStream) -> Result<(), CudaError>;
    /// Makes `stream` wait (on the device) for `event`'s last record.
    fn stream_wait_event(&self, stream: RawStream, event: RawEvent) -> Result<(), CudaError>;
    /// A new event without timing.
    fn event_create(&self) -> Result<RawEvent, CudaError>;
    /// Destroys an event from [`event_create`](CudaDriver::event_create).
    fn event_destroy(&self, event: RawEvent);
    /// Records `event` at the current end of `stream`.
    fn event_record(&self, event: RawEvent, stream: RawStream) -> Result<(), CudaError>;
    /// Whether the work before `event`'s last record has finished.
    fn event_query(&self, event: RawEvent) -> Result<bool, CudaError>;
    /// Waits on the host for `event`'s last record.
    fn event_synchronize(&self, event: RawEvent) -> Result<(), CudaError>;
    /// Whether the driver has `cuMemcpyBatchAsync` (CUDA 12.8+).
    fn batch_copy_available(&self) -> bool;
    /// Queues `segments` as one batch on `stream` (`cuMemcpyBatchAsync`, sources read in
    /// stream order), in no order among themselves.
    ///
    /// # Safety
    /// Each segment's source is readable and its destination writable for its length until
    /// `stream` has run the copy; no destination overlaps another segment's source or
    /// destination.
    unsafe fn copy_batch(&self, segments: &[Segment], stream: RawStream) -> Result<(), CudaError>;
    /// Queues one copy on `stream` (`cuMemcpyAsync`).
    ///
    /// # Safety
    /// As [`copy_batch`](CudaDriver::copy_batch), for one segment.
    unsafe fn copy_async(&self, segment: Segment, stream: RawStream) -> Result<(), CudaError>;
    /// Whether kvpool's copy kernel can run: its module loaded, and registered host memory is
    /// addressable from the device at its host address.
    fn kernel_copy_available(&self) -> bool;
    /// `bytes` of page-locked host memory the device reads at its host address
    /// (`cuMemHostAlloc`), for copy tables; freed with [`host_free`](CudaDriver::host_free).
    fn host_alloc(&self, bytes: usize) -> Result<usize, CudaError>;
    /// Frees memory from [`host_alloc`](CudaDriver::host_alloc).
    fn host_free(&self, ptr: usize);
    /// Launches kvpool's copy kernel on `stream`: one thread block per segment of the `count`
    /// segments ([`Segment`]'s layout) at `table`, each copied in 16-byte words.
    ///
    /// # Safety
    /// `table` is memory from [`host_alloc`](CudaDriver::host_alloc) holding `count` segments,
    /// unchanged until `stream` has run the kernel; the segments as for
    /// [`copy_batch`](CudaDriver::copy_batch), every address and length a multiple of 16,
    /// and each host address page-locked (registered) memory.
    unsafe fn copy_kernel(
        &self,
        table: usize,
        count: usize,
        stream: RawStream,
    ) -> Result<(), CudaError>;
}
