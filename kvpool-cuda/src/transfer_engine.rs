//! `GpuTransferEngine`: moves KV between an engine's paged GPU caches and kvpool's host chunks,
//! on a copy stream of its own, whole or layer by layer.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaEvent, CudaStream, LaunchConfig, PushKernelArg, sys};
use kvpool_core::{KvLayout, KvTransfer, TransferError, transfer::check_chunk_window};
use parking_lot::Mutex;

use crate::device_buffers::{BufferCache, DeviceBuffer, Scratch, ensure};
use crate::driver::open_context;
use crate::error::CudaError;
use crate::kernels::{Direction, Kernels, LaunchPlan};
use crate::kv_caches::RegisteredKvCaches;

/// How gathered bytes reach host memory (and scattered bytes leave it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HostPath {
    /// The kernel works on a device staging buffer; one large DMA moves it to or from the host.
    Staged,
    /// The kernel reads or writes pinned, device-mapped host memory directly. Falls back to
    /// [`HostPath::Staged`] for a buffer that is not pinned.
    Mapped,
}

/// One kernel launch's worth of rows.
pub(crate) struct RowCopy {
    pub(crate) direction: Direction,
    pub(crate) first_layer: usize,
    pub(crate) layers: usize,
    pub(crate) slots: sys::CUdeviceptr,
    pub(crate) tokens: usize,
    pub(crate) chunk: sys::CUdeviceptr,
    pub(crate) chunk_tokens: usize,
    pub(crate) token_offset: usize,
}

/// Moves KV between registered paged device caches and host chunk buffers. Implements
/// [`KvTransfer`], so a [`kvpool_core::CacheEngine`] can store from and retrieve into GPU memory;
/// the host transfer ([`kvpool_core::HostPagedKvCache`]) is its byte-for-byte oracle.
///
/// All work runs on the engine's own copy stream. [`GpuTransferEngine::wait_for`] makes that
/// stream wait for an event from the engine's compute stream (store after the layer's KV was
/// written); [`GpuTransferEngine::retrieve_layerwise`] returns per-layer events the compute
/// stream can wait on, so layer `i + 1` loads while layer `i` computes.
///
/// Device memory the engine holds besides the caches it was given: staging for the largest
/// single transfer so far, and the buffers of up to two finished layer-wise loads (their
/// chunks' bytes), kept for reuse. [`GpuTransferEngine::release_cached_buffers`] frees them,
/// e.g. before the inference engine sizes its own caches.
pub struct GpuTransferEngine {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    kernels: Kernels,
    caches: RegisteredKvCaches,
    layer_ptrs: DeviceBuffer,
    scratch: Mutex<Scratch>,
    pub(crate) layerwise_buffers: Arc<BufferCache>,
    path: HostPath,
    /// The engine's compute stream, when the caller named one (see `set_compute_stream`).
    pub(crate) compute: Mutex<Option<Arc<CudaStream>>>,
}

impl std::fmt::Debug for GpuTransferEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuTransferEngine")
            .field("device", &self.ctx.ordinal())
            .field("order", &self.caches.order())
            .field("layout", self.caches.layout())
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

fn driver<T>(
    call: &'static str,
    r: Result<T, cudarc::driver::DriverError>,
) -> Result<T, CudaError> {
    r.map_err(|e| CudaError::driver(call, e))
}

/// Checks that every layer's tensor, at its first and its last byte, is memory of device
/// `ordinal`. A pointer into host memory, onto another GPU or to nothing at all is rejected
/// before any kernel writes through it.
fn check_layers_on_device(caches: &RegisteredKvCaches, ordinal: usize) -> Result<(), CudaError> {
    let last = caches.geometry().layer_bytes().saturating_sub(1) as u64;
    for (layer, &ptr) in caches.layer_ptrs().iter().enumerate() {
        for at in [ptr, ptr + last] {
            let reject = |what: String| {
                CudaError::Registration(format!(
                    "layer {layer}: address {at:#x} ({} byte {} of the tensor at {ptr:#x}) {what}",
                    if at == ptr { "first" } else { "last" },
                    at - ptr
                ))
            };
            let mut memory_type = 0u32;
            // SAFETY: the attribute is written as an unsigned int, as the driver documents.
            let r = unsafe {
                sys::cuPointerGetAttribute(
                    (&mut memory_type as *mut u32).cast(),
                    sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                    at,
                )
            };
            if r != sys::CUresult::CUDA_SUCCESS {
                return Err(reject(format!(
                    "is not memory the CUDA driver knows ({r:?}): is the tensor as large as \
                     its shape says?"
                )));
            }
            if memory_type != sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 {
                return Err(reject(format!(
                    "is not device memory (memory type {memory_type}): the KV cache must live \
                     on the GPU"
                )));
            }
            let mut device = -1i32;
            // SAFETY: the attribute is written as an int.
            let r = unsafe {
                sys::cuPointerGetAttribute(
                    (&mut device as *mut i32).cast(),
                    sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                    at,
                )
            };
            if r != sys::CUresult::CUDA_SUCCESS || device != ordinal as i32 {
                return Err(reject(format!(
                    "is on device {device} ({r:?}), not on device {ordinal}"
                )));
            }
        }
    }
    Ok(())
}

impl GpuTransferEngine {
    /// An engine on device `ordinal` for `caches`, compiling the kernels with NVRTC. Without a
    /// driver, NVRTC or device this is [`CudaError::CudaUnavailable`]; use
    /// [`kvpool_core::HostPagedKvCache`] (the host path) instead. Every layer's tensor must be
    /// memory of this device, first byte to last ([`CudaError::Registration`] otherwise).
    pub fn new(
        ordinal: usize,
        caches: RegisteredKvCaches,
        path: HostPath,
    ) -> Result<Self, CudaError> {
        let ctx = open_context(ordinal)?;
        check_layers_on_device(&caches, ordinal)?;
        let kernels = Kernels::compile(&ctx)?;
        let stream = driver("cuStreamCreate", ctx.new_stream())?;
        let ptrs = caches.layer_ptrs();
        let layer_ptrs = DeviceBuffer::new(&ctx, std::mem::size_of_val(ptrs))?;
        // SAFETY: copies the pointer table into a buffer of its size; synchronous.
        driver("cuMemcpyHtoD", unsafe {
            sys::cuMemcpyHtoD_v2(
                layer_ptrs.ptr,
                ptrs.as_ptr().cast(),
                std::mem::size_of_val(ptrs),
            )
            .result()
        })?;
        Ok(GpuTransferEngine {
            ctx,
            stream,
            kernels,
            caches,
            layer_ptrs,
            scratch: Mutex::new(Scratch::default()),
            layerwise_buffers: Arc::new(BufferCache::default()),
            path,
            compute: Mutex::new(None),
        })
    }

    /// The registered caches.
    pub fn caches(&self) -> &RegisteredKvCaches {
        &self.caches
    }

    /// The copy stream (separate from the engine's compute stream).
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The context (the device's primary context).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Frees the device buffers kept for reuse (staging and finished layer-wise loads'). Loads
    /// still in flight keep theirs until they are dropped.
    pub fn release_cached_buffers(&self) {
        let _ = self.bind();
        let mut scratch = self.scratch.lock();
        scratch.slots = None;
        scratch.staging = None;
        self.layerwise_buffers.clear();
    }

    /// Later transfers wait for `event` (e.g. recorded on the compute stream after a layer's KV
    /// was written) before reading the paged cache.
    pub fn wait_for(&self, event: &CudaEvent) -> Result<(), CudaError> {
        driver("cuStreamWaitEvent", self.stream.wait(event))
    }

    pub(crate) fn check_slots(&self, slots: &[i64]) -> Result<(), TransferError> {
        let num_slots = self.caches.geometry().num_slots();
        for &slot in slots {
            if slot < 0 || slot as usize >= num_slots {
                return Err(TransferError::SlotOutOfRange { slot, num_slots });
            }
        }
        Ok(())
    }

    fn upload_slots(
        &self,
        scratch: &mut Scratch,
        slots: &[i64],
    ) -> Result<sys::CUdeviceptr, CudaError> {
        let bytes = std::mem::size_of_val(slots);
        let dst = ensure(&mut scratch.slots, &self.ctx, bytes)?;
        // SAFETY: `dst` holds at least `bytes`; callers synchronise the stream before they
        // release `slots`.
        unsafe { self.copy_to_device(dst, bytemuck::cast_slice(slots))? };
        Ok(dst)
    }

    /// Queues a host-to-device copy of `src` into `dst` on the copy stream.
    ///
    /// # Safety
    /// `dst` must hold `src.len()` bytes, and `src` must stay alive and unchanged until the
    /// stream has been synchronised past this copy.
    pub(crate) unsafe fn copy_to_device(
        &self,
        dst: sys::CUdeviceptr,
        src: &[u8],
    ) -> Result<(), CudaError> {
        // SAFETY: as the caller promised.
        driver("cuMemcpyHtoDAsync", unsafe {
            sys::cuMemcpyHtoDAsync_v2(dst, src.as_ptr().cast(), src.len(), self.stream.cu_stream())
                .result()
        })
    }

    /// Makes the engine's context current on the calling thread. Every entry point calls it
    /// first: callers (the cache engine's tasks, the connector) may run on any thread, and a
    /// raw driver call on a thread without a current context fails.
    pub(crate) fn bind(&self) -> Result<(), CudaError> {
        driver("cuCtxSetCurrent", self.ctx.bind_to_thread())
    }

    /// The device address of `host..host + len` if all of it is pinned, device-mapped host
    /// memory that the device sees as one contiguous range. Both ends are asked: a buffer
    /// that runs past the registered memory, or across two registrations the device maps
    /// apart, takes the staged path instead.
    fn mapped(&self, host: *const u8, len: usize) -> Option<sys::CUdeviceptr> {
        let device_of = |at: *const u8| {
            let mut device = 0;
            // SAFETY: only queries the driver about an address.
            let r = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device, at as *mut _, 0) };
            (r == sys::CUresult::CUDA_SUCCESS).then_some(device)
        };
        let first = device_of(host)?;
        if len > 1 {
            let last = device_of(host.wrapping_add(len - 1))?;
            if last != first + (len as u64 - 1) {
                return None;
            }
        }
        Some(first)
    }

    pub(crate) fn launch(&self, copy: &RowCopy) -> Result<(), CudaError> {
        let Some(plan) = LaunchPlan::new(
            self.caches.geometry(),
            copy.direction,
            self.caches.layer_ptrs(),
            copy.first_layer,
            copy.layers,
            copy.tokens,
            copy.chunk,
            copy.chunk_tokens,
            copy.token_offset,
        ) else {
            return Ok(());
        };
        let function = match plan.direction {
            Direction::Gather => self.kernels.gather(plan.width),
            Direction::Scatter => self.kernels.scatter(plan.width),
        };
        let config = LaunchConfig {
            grid_dim: (plan.grid.0, plan.grid.1, 1),
            block_dim: (plan.threads, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut builder = self.stream.launch_builder(function);
        builder
            .arg(&self.layer_ptrs.ptr)
            .arg(&plan.first_layer)
            .arg(&copy.slots)
            .arg(&copy.chunk)
            .arg(&plan.chunk_tokens)
            .arg(&plan.token_offset)
            .arg(&plan.planes)
            .arg(&plan.row_bytes)
            .arg(&plan.block_size)
            .arg(&plan.block_stride_rows)
            .arg(&plan.plane_stride_rows);
        // SAFETY: the argument list matches the kernel signature in kernels.cu; every slot was
        // checked against the cache, and `chunk` holds `layers * planes * chunk_tokens` rows.
        driver("cuLaunchKernel", unsafe { builder.launch(config) })?;
        Ok(())
    }

    fn synchronize(&self) -> Result<(), CudaError> {
        driver("cuStreamSynchronize", self.stream.synchronize())
    }

    /// Binds the context to this thread, checks and uploads `slots`, and picks where the kernel reads or writes the chunk: the
    /// mapped host buffer itself (`HostPath::Mapped` and pinned memory) or device staging of
    /// `host_len` bytes (then `staged` is true and the caller moves the bytes).
    #[allow(clippy::too_many_arguments)]
    fn prepare(
        &self,
        scratch: &mut Scratch,
        direction: Direction,
        first_layer: usize,
        layers: usize,
        slots: &[i64],
        chunk_tokens: usize,
        token_offset: usize,
        host: *const u8,
        host_len: usize,
    ) -> Result<(RowCopy, bool), CudaError> {
        self.bind()?;
        self.check_slots(slots)?;
        let slots_dev = self.upload_slots(scratch, slots)?;
        let mapped = match self.path {
            HostPath::Mapped => self.mapped(host, host_len),
            HostPath::Staged => None,
        };
        let chunk = match mapped {
            Some(device) => device,
            None => ensure(&mut scratch.staging, &self.ctx, host_len)?,
        };
        let copy = RowCopy {
            direction,
            first_layer,
            layers,
            slots: slots_dev,
            tokens: slots.len(),
            chunk,
            chunk_tokens,
            token_offset,
        };
        Ok((copy, mapped.is_none()))
    }

    /// Gathers layers `first_layer..first_layer + layers` of `slots` into `chunk` (host memory,
    /// those layers' region of a `slots.len()`-token chunk) and waits for it.
    fn gather_layers(
        &self,
        first_layer: usize,
        layers: usize,
        slots: &[i64],
        chunk: &mut [u8],
    ) -> Result<(), CudaError> {
        let mut scratch = self.scratch.lock();
        let (copy, staged) = self.prepare(
            &mut scratch,
            Direction::Gather,
            first_layer,
            layers,
            slots,
            slots.len(),
            0,
            chunk.as_ptr(),
            chunk.len(),
        )?;
        self.launch(&copy)?;
        if staged {
            // SAFETY: staging holds `chunk.len()` bytes written by the kernel; we wait below,
            // so `chunk` outlives the copy.
            driver("cuMemcpyDtoHAsync", unsafe {
                sys::cuMemcpyDtoHAsync_v2(
                    chunk.as_mut_ptr().cast(),
                    copy.chunk,
                    chunk.len(),
                    self.stream.cu_stream(),
                )
                .result()
            })?;
        }
        self.synchronize()
    }

    /// Scatters tokens `token_offset..token_offset + slots.len()` of `region` (host memory,
    /// layers `first_layer..first_layer + layers` of a `chunk_tokens`-token chunk) to `slots`.
    fn scatter_layers(
        &self,
        first_layer: usize,
        layers: usize,
        region: &[u8],
        chunk_tokens: usize,
        token_offset: usize,
        slots: &[i64],
    ) -> Result<(), CudaError> {
        let mut scratch = self.scratch.lock();
        let (copy, staged) = self.prepare(
            &mut scratch,
            Direction::Scatter,
            first_layer,
            layers,
            slots,
            chunk_tokens,
            token_offset,
            region.as_ptr(),
            region.len(),
        )?;
        if staged {
            // SAFETY: staging holds `region.len()` bytes; we wait below, so `region` outlives it.
            unsafe { self.copy_to_device(copy.chunk, region)? };
        }
        self.launch(&copy)?;
        self.synchronize()
    }
}

impl KvTransfer for GpuTransferEngine {
    fn layout(&self) -> &KvLayout {
        self.caches.layout()
    }

    fn gather_layer(
        &self,
        layer: usize,
        slots: &[i64],
        chunk: &mut [u8],
    ) -> Result<(), TransferError> {
        let layout = *self.layout();
        let n = slots.len();
        check_chunk_window(&layout, layer, chunk.len(), n, 0, n)?;
        let region = n * layout.bytes_per_token_per_layer();
        let chunk = &mut chunk[layer * region..(layer + 1) * region];
        Ok(self.gather_layers(layer, 1, slots, chunk)?)
    }

    fn scatter_layer(
        &mut self,
        layer: usize,
        chunk: &[u8],
        chunk_tokens: usize,
        token_offset: usize,
        slots: &[i64],
    ) -> Result<(), TransferError> {
        let layout = *self.layout();
        check_chunk_window(
            &layout,
            layer,
            chunk.len(),
            chunk_tokens,
            token_offset,
            slots.len(),
        )?;
        let region = chunk_tokens * layout.bytes_per_token_per_layer();
        let chunk = &chunk[layer * region..(layer + 1) * region];
        Ok(self.scatter_layers(layer, 1, chunk, chunk_tokens, token_offset, slots)?)
    }

    /// All layers in one kernel launch and one DMA.
    fn gather(&self, slots: &[i64], chunk: &mut [u8]) -> Result<(), TransferError> {
        let layout = *self.layout();
        let n = slots.len();
        check_chunk_window(&layout, 0, chunk.len(), n, 0, n)?;
        Ok(self.gather_layers(0, layout.num_layers, slots, chunk)?)
    }

    /// All layers in one DMA and one kernel launch.
    fn scatter(
        &mut self,
        chunk: &[u8],
        chunk_tokens: usize,
        token_offset: usize,
        slots: &[i64],
    ) -> Result<(), TransferError> {
        let layout = *self.layout();
        check_chunk_window(
            &layout,
            0,
            chunk.len(),
            chunk_tokens,
            token_offset,
            slots.len(),
        )?;
        Ok(self.scatter_layers(
            0,
            layout.num_layers,
            chunk,
            chunk_tokens,
            token_offset,
            slots,
        )?)
    }
}
