//! A stand-in CUDA driver for tests where no GPU is: "device" memory is host memory, copies
//! run when they are queued, and every call is recorded, so the copy engine's ordering
//! (which stream waits for which event) and the page-lock guards' lifetimes can be checked.

use std::collections::{BTreeMap, HashMap};

use parking_lot::Mutex;

use crate::driver::{CudaDriver, CudaError, HOST_MEMORY_ALREADY_REGISTERED, RawEvent, RawStream};
use crate::plan::Segment;

/// A driver call as [`FakeDriver`] recorded it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Call {
    /// `host_register(ptr, len)`.
    Register(usize, usize),
    /// `host_unregister(ptr)`.
    Unregister(usize),
    /// `stream_synchronize(stream)`.
    StreamSynchronize(RawStream),
    /// `stream_wait_event(stream, event)`.
    StreamWaitEvent(RawStream, RawEvent),
    /// `event_record(event, stream)`.
    EventRecord(RawEvent, RawStream),
    /// `event_synchronize(event)`.
    EventSynchronize(RawEvent),
    /// `copy_batch` of this many segments on a stream.
    CopyBatch(usize, RawStream),
    /// `copy_async` on a stream.
    CopyAsync(RawStream),
    /// `copy_kernel` of this many segments on a stream.
    CopyKernel(usize, RawStream),
}

#[derive(Debug, Default)]
struct State {
    calls: Vec<Call>,
    registered: BTreeMap<usize, usize>,
    next_handle: usize,
    /// Events recorded but not yet "finished" (while `hold_events` is set).
    unfinished: Vec<RawEvent>,
    hold_events: bool,
    fail_batches: u32,
    streams_alive: usize,
    events_alive: usize,
    /// `host_alloc`'s allocations: address -> layout.
    host_allocs: HashMap<usize, std::alloc::Layout>,
}

/// See the module docs.
#[derive(Debug)]
pub struct FakeDriver {
    batch: bool,
    kernel: bool,
    state: Mutex<State>,
}

impl FakeDriver {
    /// A fake driver, with `cuMemcpyBatchAsync` or without.
    pub fn new(batch: bool) -> Self {
        FakeDriver {
            batch,
            kernel: false,
            state: Mutex::new(State {
                next_handle: 0x100,
                ..State::default()
            }),
        }
    }

    /// The same driver with kvpool's copy kernel available.
    pub fn with_kernel(mut self) -> Self {
        self.kernel = true;
        self
    }

    /// Memory from `host_alloc` not yet freed (bytes).
    pub fn host_allocated(&self) -> usize {
        self.state
            .lock()
            .host_allocs
            .values()
            .map(|l| l.size())
            .sum()
    }

    /// The calls so far.
    pub fn calls(&self) -> Vec<Call> {
        self.state.lock().calls.clone()
    }

    /// Forgets the calls so far.
    pub fn clear_calls(&self) {
        self.state.lock().calls.clear();
    }

    /// While set, events recorded stay unfinished (queries answer "not yet") until
    /// [`finish_events`](Self::finish_events).
    pub fn hold_events(&self, hold: bool) {
        self.state.lock().hold_events = hold;
    }

    /// Finishes every event recorded so far.
    pub fn finish_events(&self) {
        self.state.lock().unfinished.clear();
    }

    /// The next `n` batches fail with `CUDA_ERROR_INVALID_VALUE`, queueing nothing.
    pub fn fail_next_batches(&self, n: u32) {
        self.state.lock().fail_batches = n;
    }

    /// Ranges page-locked now, `start -> length`.
    pub fn registered(&self) -> BTreeMap<usize, usize> {
        self.state.lock().registered.clone()
    }

    /// Streams and events created and not yet destroyed.
    pub fn alive(&self) -> (usize, usize) {
        let s = self.state.lock();
        (s.streams_alive, s.events_alive)
    }

    fn handle(&self) -> usize {
        let mut s = self.state.lock();
        s.next_handle += 0x10;
        s.next_handle
    }
}

impl CudaDriver for FakeDriver {
    fn describe(&self) -> String {
        format!(
            "fake driver (batched copies {}, copy kernel {})",
            self.batch, self.kernel
        )
    }

    unsafe fn host_register(&self, ptr: usize, len: usize) -> Result<(), CudaError> {
        let mut s = self.state.lock();
        s.calls.push(Call::Register(ptr, len));
        let overlaps = s
            .registered
            .range(..ptr + len)
            .next_back()
            .is_some_and(|(&start, &l)| start + l > ptr);
        if overlaps {
            return Err(CudaError {
                call: "cuMemHostRegister",
                code: HOST_MEMORY_ALREADY_REGISTERED,
                name: "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED".into(),
            });
        }
        s.registered.insert(ptr, len);
        Ok(())
    }

    fn host_unregister(&self, ptr: usize) -> Result<(), CudaError> {
        let mut s = self.state.lock();
        s.calls.push(Call::Unregister(ptr));
        match s.registered.remove(&ptr) {
            Some(_) => Ok(()),
            None => Err(CudaError {
                call: "cuMemHostUnregister",
                code: 713,
                name: "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED".into(),
            }),
        }
    }

    fn stream_create(&self) -> Result<RawStream, CudaError> {
        let h = self.handle();
        self.state.lock().streams_alive += 1;
        Ok(RawStream(h))
    }

    fn stream_destroy(&self, _stream: RawStream) {
        self.state.lock().streams_alive -= 1;
    }

    fn stream_synchronize(&self, stream: RawStream) -> Result<(), CudaError> {
        let mut s = self.state.lock();
        s.calls.push(Call::StreamSynchronize(stream));
        s.unfinished.clear();
        Ok(())
    }

    fn stream_wait_event(&self, stream: RawStream, event: RawEvent) -> Result<(), CudaError> {
        self.state
            .lock()
            .calls
            .push(Call::StreamWaitEvent(stream, event));
        Ok(())
    }

    fn event_create(&self) -> Result<RawEvent, CudaError> {
        let h = self.handle();
        self.state.lock().events_alive += 1;
        Ok(RawEvent(h))
    }

    fn event_destroy(&self, _event: RawEvent) {
        self.state.lock().events_alive -= 1;
    }

    fn event_record(&self, event: RawEvent, stream: RawStream) -> Result<(), CudaError> {
        let mut s = self.state.lock();
        s.calls.push(Call::EventRecord(event, stream));
        if s.hold_events {
            s.unfinished.push(event);
        }
        Ok(())
    }

    fn event_query(&self, event: RawEvent) -> Result<bool, CudaError> {
        Ok(!self.state.lock().unfinished.contains(&event))
    }

    fn event_synchronize(&self, event: RawEvent) -> Result<(), CudaError> {
        let mut s = self.state.lock();
        s.calls.push(Call::EventSynchronize(event));
        s.unfinished.retain(|&e| e != event);
        Ok(())
    }

    fn batch_copy_available(&self) -> bool {
        self.batch
    }

    unsafe fn copy_batch(&self, segments: &[Segment], stream: RawStream) -> Result<(), CudaError> {
        assert!(self.batch, "copy_batch called on a driver without it");
        {
            let mut s = self.state.lock();
            if s.fail_batches > 0 {
                s.fail_batches -= 1;
                return Err(CudaError {
                    call: "cuMemcpyBatchAsync",
                    code: 1,
                    name: "CUDA_ERROR_INVALID_VALUE".into(),
                });
            }
            s.calls.push(Call::CopyBatch(segments.len(), stream));
        }
        for s in segments {
            // SAFETY: the caller's contract (addresses are host memory in this fake).
            unsafe {
                std::ptr::copy_nonoverlapping(
                    s.src as usize as *const u8,
                    s.dst as usize as *mut u8,
                    s.len as usize,
                )
            };
        }
        Ok(())
    }

    unsafe fn copy_async(&self, segment: Segment, stream: RawStream) -> Result<(), CudaError> {
        self.state.lock().calls.push(Call::CopyAsync(stream));
        // SAFETY: the caller's contract (addresses are host memory in this fake).
        unsafe {
            std::ptr::copy_nonoverlapping(
                segment.src as usize as *const u8,
                segment.dst as usize as *mut u8,
                segment.len as usize,
            )
        };
        Ok(())
    }

    fn kernel_copy_available(&self) -> bool {
        self.kernel
    }

    fn host_alloc(&self, bytes: usize) -> Result<usize, CudaError> {
        let layout =
            std::alloc::Layout::from_size_align(bytes.max(1), 64).map_err(|e| CudaError {
                call: "cuMemHostAlloc",
                code: 1,
                name: e.to_string(),
            })?;
        // SAFETY: a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) } as usize;
        if ptr == 0 {
            return Err(CudaError {
                call: "cuMemHostAlloc",
                code: 2,
                name: "CUDA_ERROR_OUT_OF_MEMORY".into(),
            });
        }
        self.state.lock().host_allocs.insert(ptr, layout);
        Ok(ptr)
    }

    fn host_free(&self, ptr: usize) {
        if let Some(layout) = self.state.lock().host_allocs.remove(&ptr) {
            // SAFETY: allocated by `host_alloc` with this layout.
            unsafe { std::alloc::dealloc(ptr as *mut u8, layout) };
        }
    }

    unsafe fn copy_kernel(
        &self,
        table: usize,
        count: usize,
        stream: RawStream,
    ) -> Result<(), CudaError> {
        assert!(self.kernel, "copy_kernel called on a driver without it");
        self.state
            .lock()
            .calls
            .push(Call::CopyKernel(count, stream));
        // SAFETY: the caller's contract: `count` segments at `table`.
        let segments = unsafe { std::slice::from_raw_parts(table as *const Segment, count) };
        for s in segments {
            assert!(
                s.src % 16 == 0 && s.dst % 16 == 0 && s.len % 16 == 0,
                "the copy kernel moves 16-byte words: {s:?}"
            );
            // SAFETY: the caller's contract (addresses are host memory in this fake).
            unsafe {
                std::ptr::copy_nonoverlapping(
                    s.src as usize as *const u8,
                    s.dst as usize as *mut u8,
                    s.len as usize,
                )
            };
        }
        Ok(())
    }
}
