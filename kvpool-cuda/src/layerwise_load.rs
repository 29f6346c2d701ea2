//! Layer-wise loads on the GPU: every layer queued on the copy stream with an event per layer,
//! the chunk memory owned by the load until the copies are done, and kvpool-core's
//! `LayerwiseTransfer` (submit, wait per layer, fence before a store) for `GpuTransferEngine`.

use std::sync::Arc;

use cudarc::driver::{CudaEvent, CudaStream, sys};
use kvpool_core::{
    ChunkWindows, EngineError, LayerLoad, LayerwiseRetrieve, LayerwiseTransfer, OwnedChunkWindow,
    TransferError, transfer::check_chunk_window,
};

use crate::device_buffers::{BufferCache, DeviceBuffer};
use crate::error::CudaError;
use crate::kernels::Direction;
use crate::transfer_engine::{GpuTransferEngine, RowCopy};

fn driver<T>(
    call: &'static str,
    r: Result<T, cudarc::driver::DriverError>,
) -> Result<T, CudaError> {
    r.map_err(|e| CudaError::driver(call, e))
}

impl GpuTransferEngine {
    /// Names the engine's compute stream (the one attention runs on, e.g. PyTorch's
    /// `torch.cuda.current_stream()` wrapped with `CudaContext::wrap_borrowed_stream` on
    /// [`GpuTransferEngine::context`]). With it, [`LayerwiseTransfer::submit_load`]'s loads make
    /// that stream wait per layer without blocking the host, and
    /// [`LayerwiseTransfer::fence_before_store`] waits for exactly that stream's work. Without
    /// one, both block the host until the device is idle (correct, slower).
    pub fn set_compute_stream(&self, stream: Arc<CudaStream>) {
        *self.compute.lock() = Some(stream);
    }

    /// [`GpuTransferEngine::set_compute_stream`] for a stream another library owns, given as
    /// its raw `CUstream` handle (PyTorch: `torch.cuda.current_stream().cuda_stream`; 0 is
    /// the legacy default stream).
    ///
    /// # Safety
    ///
    /// `raw` must be a stream of this engine's device (its primary context) that stays alive
    /// while the engine, or a load it returned, is used.
    pub unsafe fn set_borrowed_compute_stream(&self, raw: usize) {
        // SAFETY: as the caller promised.
        let stream = unsafe { self.context().wrap_borrowed_stream(raw as sys::CUstream) };
        self.set_compute_stream(stream);
    }

    /// Starts loading `chunks` into the paged cache layer by layer on the copy stream and
    /// returns at once. Layer `l` of every chunk is copied host-to-device and scattered, then
    /// event `l` is recorded: the compute stream waits on it ([`LayerwiseLoad::wait_layer`])
    /// right before layer `l`'s attention, so loading overlaps compute. For real overlap the
    /// chunk buffers must be pinned (a pool on [`crate::PinnedAllocator`]).
    ///
    /// The load owns `chunks` until its copies are done: dropping it waits for them; leaking
    /// it leaks the chunk memory, which therefore can never be reused under a copy.
    ///
    /// The chunks usually come from the cache engine:
    ///
    /// ```no_run
    /// # async fn demo(
    /// #     engine: &kvpool_core::CacheEngine,
    /// #     gpu: &kvpool_cuda::GpuTransferEngine,
    /// #     compute: &cudarc::driver::CudaStream,
    /// #     tokens: &[u32],
    /// #     slots: &[i64],
    /// # ) -> Result<(), Box<dyn std::error::Error>> {
    /// let plan = engine.begin_retrieve_layerwise(tokens, None, slots).await?;
    /// let load = gpu.retrieve_layerwise(plan)?;
    /// for layer in 0..engine.layout().num_layers {
    ///     load.wait_layer(layer, compute)?; // then queue layer `layer`'s attention
    /// }
    /// # Ok(()) }
    /// ```
    pub fn retrieve_layerwise(
        &self,
        chunks: impl ChunkWindows,
    ) -> Result<LayerwiseLoad, CudaError> {
        self.bind()?;
        let layout = *self.caches().layout();
        let per_token_layer = layout.bytes_per_token_per_layer();
        // From here on the load owns what it enqueues: if anything below fails, dropping it
        // waits for the work already queued before the buffers and chunks are released.
        let mut load = LayerwiseLoad {
            events: Vec::with_capacity(layout.num_layers),
            stream: self.stream().clone(),
            buffers: Vec::with_capacity(2),
            cache: self.layerwise_buffers.clone(),
            host_slots: Vec::new(),
            chunks: Box::new(chunks),
        };
        let windows = load.chunks.windows();
        let mut offsets = Vec::with_capacity(windows.len());
        for c in &windows {
            check_chunk_window(
                &layout,
                0,
                c.data.len(),
                c.chunk_tokens,
                c.token_offset,
                c.slots.len(),
            )?;
            self.check_slots(c.slots)?;
            offsets.push(load.host_slots.len());
            load.host_slots.extend_from_slice(c.slots);
        }
        // Staging for every layer of every chunk, so no layer's bytes wait for another's.
        let per_layer: usize = windows
            .iter()
            .map(|c| c.chunk_tokens * per_token_layer)
            .sum();
        let slot_bytes = std::mem::size_of_val(load.host_slots.as_slice());
        let ctx = self.context();
        load.buffers
            .push(self.layerwise_buffers.take(ctx, slot_bytes)?);
        load.buffers.push(
            self.layerwise_buffers
                .take(ctx, per_layer * layout.num_layers)?,
        );
        let (slots, staging) = (load.buffers[0].ptr, load.buffers[1].ptr);
        // On the copy stream, not a synchronous copy: that would run on the legacy default
        // stream and wait for the engine's queued compute. The host slots live in `load`.
        // SAFETY: `slots` holds `slot_bytes`; `load` keeps the source until it synchronises.
        unsafe { self.copy_to_device(slots, bytemuck::cast_slice(&load.host_slots))? };
        for layer in 0..layout.num_layers {
            let mut at = staging + (layer * per_layer) as u64;
            for (c, &offset) in windows.iter().zip(&offsets) {
                let region_len = c.chunk_tokens * per_token_layer;
                let region = &c.data[layer * region_len..(layer + 1) * region_len];
                // SAFETY: staging holds `region_len` bytes at `at`; `region` is memory `load`
                // owns (its `chunks`), released only after the stream is synchronised.
                unsafe { self.copy_to_device(at, region)? };
                self.launch(&RowCopy {
                    direction: Direction::Scatter,
                    first_layer: layer,
                    layers: 1,
                    slots: slots + (offset * std::mem::size_of::<i64>()) as u64,
                    tokens: c.slots.len(),
                    chunk: at,
                    chunk_tokens: c.chunk_tokens,
                    token_offset: c.token_offset,
                })?;
                at += region_len as u64;
            }
            load.events
                .push(driver("cuEventRecord", self.stream().record_event(None))?);
        }
        Ok(load)
    }
}

/// A layer-wise load in flight. It owns the chunks it reads; dropping it waits for the whole
/// load, then releases them and hands its device buffers back to the engine for the next load.
pub struct LayerwiseLoad {
    events: Vec<CudaEvent>,
    stream: Arc<CudaStream>,
    /// The device slot table and the staging for every layer.
    buffers: Vec<DeviceBuffer>,
    cache: Arc<BufferCache>,
    /// The slots the device table is copied from, kept until the copy is done.
    host_slots: Vec<i64>,
    /// The chunk memory the copies read.
    chunks: Box<dyn ChunkWindows>,
}

impl LayerwiseLoad {
    /// Makes `compute` wait until layer `layer` is in the paged cache (no host blocking).
    ///
    /// `compute` is the stream the engine runs attention on; one owned by another library
    /// (PyTorch's `torch.cuda.current_stream().cuda_stream`) can be wrapped with
    /// `CudaContext::wrap_borrowed_stream` on [`GpuTransferEngine::context`].
    pub fn wait_layer(&self, layer: usize, compute: &CudaStream) -> Result<(), CudaError> {
        driver("cuStreamWaitEvent", compute.wait(self.event(layer)?))
    }

    /// The event recorded after layer `layer` was scattered.
    pub fn layer_event(&self, layer: usize) -> &CudaEvent {
        &self.events[layer]
    }

    fn event(&self, layer: usize) -> Result<&CudaEvent, CudaError> {
        self.events
            .get(layer)
            .ok_or(CudaError::Transfer(TransferError::LayerOutOfRange {
                layer,
                layers: self.events.len(),
            }))
    }

    /// Blocks until every layer is loaded.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        driver("cuStreamSynchronize", self.stream.synchronize())
    }
}

impl Drop for LayerwiseLoad {
    fn drop(&mut self) {
        if self.stream.synchronize().is_ok() {
            self.cache.give(self.buffers.drain(..));
        } else {
            // The context is broken and copies may still reference the chunks: keep them
            // alive for ever rather than free memory a device might read.
            let chunks =
                std::mem::replace(&mut self.chunks, Box::new(Vec::<OwnedChunkWindow>::new()));
            std::mem::forget(chunks);
        }
    }
}

/// A [`LayerwiseLoad`] seen through kvpool-core's [`LayerLoad`]: waits make the engine's
/// compute stream wait (or block the host when none was named).
struct GpuLayerLoad {
    load: LayerwiseLoad,
    compute: Option<Arc<CudaStream>>,
    tokens: usize,
}

impl LayerLoad for GpuLayerLoad {
    fn wait_layer(&self, layer: usize) -> Result<(), TransferError> {
        match &self.compute {
            Some(compute) => self.load.wait_layer(layer, compute)?,
            None => driver("cuEventSynchronize", self.load.event(layer)?.synchronize())?,
        }
        Ok(())
    }

    fn loaded_tokens(&self) -> usize {
        self.tokens
    }
}

impl LayerwiseTransfer for GpuTransferEngine {
    fn submit_load(&mut self, plan: LayerwiseRetrieve) -> Result<Box<dyn LayerLoad>, EngineError> {
        let tokens = plan.loaded_tokens();
        let load = self.retrieve_layerwise(plan).map_err(TransferError::from)?;
        Ok(Box::new(GpuLayerLoad {
            load,
            compute: self.compute.lock().clone(),
            tokens,
        }))
    }

    fn fence_before_store(&self) -> Result<(), TransferError> {
        self.bind()?;
        let compute = self.compute.lock().clone();
        match compute {
            Some(compute) => {
                let written = driver("cuEventRecord", compute.record_event(None))?;
                self.wait_for(&written)?;
            }
            // No stream named: wait for everything queued on the device.
            // SAFETY: a plain driver call on the bound context.
            None => driver("cuCtxSynchronize", unsafe {
                sys::cuCtxSynchronize().result()
            })?,
        }
        Ok(())
    }
}
