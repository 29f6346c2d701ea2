//! [`CudaDriver`] through cudarc's driver API bindings, loaded at run time (`libcuda.so`), on
//! a device's primary context: the context torch and vLLM use, so their streams and kvpool's
//! can wait for one another.

use std::ffi::c_void;

use cudarc::driver::sys;

use crate::driver::{CudaDriver, CudaError, RawEvent, RawStream};
use crate::plan::Segment;

/// kvpool's copy kernel (`kernels/copy_segments.cu`), as PTX the driver compiles at load.
const COPY_KERNEL_PTX: &str = concat!(include_str!("../kernels/copy_segments.ptx"), "\0");

/// Threads per block of the copy kernel.
const COPY_KERNEL_THREADS: u32 = 256;

/// The first driver with `cuMemcpyBatchAsync` (12.8).
const BATCH_DRIVER_VERSION: i32 = 12080;

/// `cuMemcpyBatchAsync` as CUDA 12.8 and 12.9 declare it (with `failIdx`); later drivers
/// keep this ABI under that name.
type BatchV1 = unsafe extern "C" fn(
    *mut sys::CUdeviceptr,
    *mut sys::CUdeviceptr,
    *mut usize,
    usize,
    *mut sys::CUmemcpyAttributes,
    *mut usize,
    usize,
    *mut usize,
    sys::CUstream,
) -> sys::CUresult;

/// `cuMemcpyBatchAsync_v2`, what CUDA 13's headers call `cuMemcpyBatchAsync` (no `failIdx`).
type BatchV2 = unsafe extern "C" fn(
    *mut sys::CUdeviceptr,
    *mut sys::CUdeviceptr,
    *mut usize,
    usize,
    *mut sys::CUmemcpyAttributes,
    *mut usize,
    usize,
    sys::CUstream,
) -> sys::CUresult;

/// The batch entry point the driver has: the newest ABI it exports.
#[derive(Debug, Clone, Copy)]
enum BatchEntry {
    V2(BatchV2),
    V1(BatchV1),
}

impl BatchEntry {
    /// Looks the entry point up in the loaded driver, without cudarc's loader (which panics
    /// on a missing symbol).
    fn find(driver_version: i32) -> Option<Self> {
        if driver_version < BATCH_DRIVER_VERSION {
            return None;
        }
        // SAFETY: the symbols have these signatures in every driver that exports them (the
        // CUDA headers of 12.8 and 13.0); the library stays loaded for the process's life.
        unsafe {
            let lib = sys::culib();
            if let Ok(f) = lib.get::<BatchV2>(b"cuMemcpyBatchAsync_v2") {
                return Some(BatchEntry::V2(*f));
            }
            lib.get::<BatchV1>(b"cuMemcpyBatchAsync")
                .ok()
                .map(|f| BatchEntry::V1(*f))
        }
    }
}

/// The CUDA driver through cudarc, bound to one device's primary context (retained while this
/// lives).
#[derive(Debug)]
pub struct CudarcDriver {
    device: sys::CUdevice,
    context: sys::CUcontext,
    ordinal: i32,
    driver_version: i32,
    batch: Option<BatchEntry>,
    /// The copy kernel's module and function, where it loaded and registered host memory is
    /// addressable at its host address.
    kernel: Option<(sys::CUmodule, sys::CUfunction)>,
    kernel_note: String,
}

// SAFETY: a CUcontext handle may be used from any thread (each call makes it current on the
// calling thread first); the struct holds no thread-bound state.
unsafe impl Send for CudarcDriver {}
// SAFETY: as above; no method mutates the struct.
unsafe impl Sync for CudarcDriver {}

fn check(call: &'static str, result: sys::CUresult) -> Result<(), CudaError> {
    if result == sys::CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    let name = cudarc::driver::result::DriverError(result)
        .error_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|_| format!("{result:?}"));
    Err(CudaError {
        call,
        code: result as i32,
        name,
    })
}

fn no_driver(why: String) -> CudaError {
    CudaError {
        call: "loading libcuda",
        code: -1,
        name: why,
    }
}

impl CudarcDriver {
    /// Loads the driver, initialises it and retains device `ordinal`'s primary context. Fails
    /// (never panics) where there is no `libcuda` or no such device.
    pub fn new(ordinal: i32) -> Result<Self, CudaError> {
        // SAFETY: only tries to open the library.
        if !unsafe { sys::is_culib_present() } {
            return Err(no_driver("no libcuda.so on this machine".into()));
        }
        // SAFETY: plain driver calls with valid out-pointers; the library is present.
        unsafe {
            check("cuInit", sys::cuInit(0))?;
            let mut version = 0;
            check("cuDriverGetVersion", sys::cuDriverGetVersion(&mut version))?;
            let mut device = 0;
            check("cuDeviceGet", sys::cuDeviceGet(&mut device, ordinal))?;
            let mut context = std::ptr::null_mut();
            check(
                "cuDevicePrimaryCtxRetain",
                sys::cuDevicePrimaryCtxRetain(&mut context, device),
            )?;
            let batch = BatchEntry::find(version);
            let mut driver = CudarcDriver {
                device,
                context,
                ordinal,
                driver_version: version,
                batch,
                kernel: None,
                kernel_note: String::new(),
            };
            match driver.load_kernel() {
                Ok(kernel) => driver.kernel = kernel,
                Err(e) => {
                    tracing::warn!(
                        "kvpool-cuda: the copy kernel did not load ({e}); copies go as DMA"
                    );
                    driver.kernel_note = e.to_string();
                }
            }
            Ok(driver)
        }
    }

    /// Loads the copy kernel where the device reads registered host memory at its host
    /// address (`None` where it cannot).
    fn load_kernel(&mut self) -> Result<Option<(sys::CUmodule, sys::CUfunction)>, CudaError> {
        let _bound = self.bind()?;
        let mut direct = 0;
        // SAFETY: valid out-pointer and device.
        check("cuDeviceGetAttribute", unsafe {
            sys::cuDeviceGetAttribute(
                &mut direct,
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM,
                self.device,
            )
        })?;
        if direct != 1 {
            self.kernel_note =
                "registered host memory is not addressable at its host address".into();
            return Ok(None);
        }
        let mut module = std::ptr::null_mut();
        // SAFETY: a NUL-terminated PTX image.
        check("cuModuleLoadData", unsafe {
            sys::cuModuleLoadData(&mut module, COPY_KERNEL_PTX.as_ptr().cast())
        })?;
        let mut function = std::ptr::null_mut();
        // SAFETY: the module just loaded; a NUL-terminated name.
        let found = check("cuModuleGetFunction", unsafe {
            sys::cuModuleGetFunction(&mut function, module, c"kvpool_copy_segments".as_ptr())
        });
        if let Err(e) = found {
            // SAFETY: the module loaded above, used by nothing.
            unsafe { sys::cuModuleUnload(module) };
            return Err(e);
        }
        Ok(Some((module, function)))
    }

    /// Makes the device's primary context current on this thread for one call, restoring
    /// the thread's own when the guard drops (a thread of a process with engines on several
    /// devices keeps its device).
    fn bind(&self) -> Result<ContextGuard, CudaError> {
        let mut current = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        check("cuCtxGetCurrent", unsafe {
            sys::cuCtxGetCurrent(&mut current)
        })?;
        if current == self.context {
            return Ok(ContextGuard { pushed: false });
        }
        // SAFETY: the context is retained while `self` lives.
        check("cuCtxPushCurrent", unsafe {
            sys::cuCtxPushCurrent_v2(self.context)
        })?;
        Ok(ContextGuard { pushed: true })
    }
}

/// Pops the context [`CudarcDriver::bind`] pushed, if it pushed one.
struct ContextGuard {
    pushed: bool,
}

impl Drop for ContextGuard {
    fn drop(&mut self) {
        if self.pushed {
            let mut popped = std::ptr::null_mut();
            // SAFETY: pops exactly what `bind` pushed on this thread.
            let _ = unsafe { sys::cuCtxPopCurrent_v2(&mut popped) };
        }
    }
}

impl Drop for CudarcDriver {
    fn drop(&mut self) {
        if let Some((module, _)) = self.kernel.take()
            && let Ok(_bound) = self.bind()
        {
            // SAFETY: the module `load_kernel` loaded; no launch is queued (every stream
            // kvpool made was synchronized and destroyed before the driver drops).
            unsafe { sys::cuModuleUnload(module) };
        }
        // SAFETY: releases the retain `new` made.
        let result = unsafe { sys::cuDevicePrimaryCtxRelease_v2(self.device) };
        if let Err(e) = check("cuDevicePrimaryCtxRelease", result) {
            tracing::warn!("kvpool-cuda: {e}");
        }
    }
}

fn stream(s: RawStream) -> sys::CUstream {
    s.0 as sys::CUstream
}

fn event(e: RawEvent) -> sys::CUevent {
    e.0 as sys::CUevent
}

impl CudaDriver for CudarcDriver {
    fn describe(&self) -> String {
        let name = cudarc::driver::result::device::get_name(self.device)
            .unwrap_or_else(|_| "unknown device".into());
        format!(
            "{name} (device {}), driver API {}.{}, batched copies {}",
            self.ordinal,
            self.driver_version / 1000,
            self.driver_version % 1000 / 10,
            match self.batch {
                Some(BatchEntry::V2(_)) => "yes (cuMemcpyBatchAsync_v2)",
                Some(BatchEntry::V1(_)) => "yes (cuMemcpyBatchAsync)",
                None => "no",
            },
        ) + &match self.kernel {
            Some(_) => ", copy kernel loaded".to_string(),
            None => format!(", no copy kernel ({})", self.kernel_note),
        }
    }

    unsafe fn host_register(&self, ptr: usize, len: usize) -> Result<(), CudaError> {
        let _bound = self.bind()?;
        // Portable (every context) and mapped: the copy kernel reads and writes it in place.
        let flags = sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP;
        // SAFETY: the caller keeps the range allocated until it is unregistered.
        check("cuMemHostRegister", unsafe {
            sys::cuMemHostRegister_v2(ptr as *mut c_void, len, flags)
        })
    }

    fn host_unregister(&self, ptr: usize) -> Result<(), CudaError> {
        let _bound = self.bind()?;
        // SAFETY: the driver checks that `ptr` starts a registered range.
        check("cuMemHostUnregister", unsafe {
            sys::cuMemHostUnregister(ptr as *mut c_void)
        })
    }

    fn stream_create(&self) -> Result<RawStream, CudaError> {
        let _bound = self.bind()?;
        let mut s = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        check("cuStreamCreate", unsafe {
            sys::cuStreamCreate(&mut s, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32)
        })?;
        Ok(RawStream(s as usize))
    }

    fn stream_destroy(&self, s: RawStream) {
        if let Ok(_bound) = self.bind() {
            // SAFETY: a stream this driver created, destroyed once by its owner.
            let _ = unsafe { sys::cuStreamDestroy_v2(stream(s)) };
        }
    }

    fn stream_synchronize(&self, s: RawStream) -> Result<(), CudaError> {
        let _bound = self.bind()?;
        // SAFETY: a live stream handle.
        check("cuStreamSynchronize", unsafe {
            sys::cuStreamSynchronize(stream(s))
        })
    }

    fn stream_wait_event(&self, s: RawStream, e: RawEvent) -> Result<(), CudaError> {
        let _bound = self.bind()?;
        // SAFETY: live handles.
        check("cuStreamWaitEvent", unsafe {
            sys::cuStreamWaitEvent(stream(s), event(e), 0)
        })
    }

    fn event_create(&self) -> Result<RawEvent, CudaError> {
        let _bound = self.bind()?;
        let mut e = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        check("cuEventCreate", unsafe {
            sys::cuEventCreate(&mut e, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32)
        })?;
        Ok(RawEvent(e as usize))
    }

    fn event_destroy(&self, e: RawEvent) {
        if let Ok(_bound) = self.bind() {
            // SAFETY: an event this driver created, destroyed once by its owner.
            let _ = unsafe { sys::cuEventDestroy_v2(event(e)) };
        }
    }

    fn event_record(&self, e: RawEvent, s: RawStream) -> Result<(), CudaError> {
        let _bound = self.bind()?;
        // SAFETY: live handles.
        check("cuEventRecord", unsafe {
            sys::cuEventRecord(event(e), stream(s))
        })
    }

    fn event_query(&self, e: RawEvent) -> Result<bool, CudaError> {
        let _bound = self.bind()?;
        // SAFETY: a live event handle.
        match unsafe { sys::cuEventQuery(event(e)) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            other => check("cuEventQuery", other).map(|()| false),
        }
    }

    fn event_synchronize(&self, e: RawEvent) -> Result<(), CudaError> {
        let _bound = self.bind()?;
        // SAFETY: a live event handle.
        check("cuEventSynchronize", unsafe {
            sys::cuEventSynchronize(event(e))
        })
    }

    fn batch_copy_available(&self) -> bool {
        self.batch.is_some()
    }

    unsafe fn copy_batch(&self, segments: &[Segment], s: RawStream) -> Result<(), CudaError> {
        if segments.is_empty() {
            return Ok(());
        }
        let Some(entry) = self.batch else {
            return Err(CudaError {
                call: "cuMemcpyBatchAsync",
                code: sys::CUresult::CUDA_ERROR_NOT_SUPPORTED as i32,
                name: "not in this driver".into(),
            });
        };
        let _bound = self.bind()?;
        let mut dsts: Vec<sys::CUdeviceptr> = segments.iter().map(|s| s.dst).collect();
        let mut srcs: Vec<sys::CUdeviceptr> = segments.iter().map(|s| s.src).collect();
        let mut sizes: Vec<usize> = segments.iter().map(|s| s.len as usize).collect();
        // SAFETY: an all-zero CUmemLocation is "no location hint" (type INVALID); the other
        // fields are set below.
        let mut attrs: sys::CUmemcpyAttributes = unsafe { std::mem::zeroed() };
        // Sources are read in stream order: a save never reads KV the compute stream (which
        // kvpool's stream waits for) has not finished writing.
        attrs.srcAccessOrder = sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;
        attrs.flags = sys::CUmemcpyFlags::CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE as u32;
        let mut attr_index = 0usize;
        let mut fail_index = usize::MAX;
        // SAFETY: the arrays hold `segments.len()` entries; one attribute applies to all
        // copies (index 0); the caller keeps every range valid until the stream ran them.
        let result = unsafe {
            match entry {
                BatchEntry::V2(f) => f(
                    dsts.as_mut_ptr(),
                    srcs.as_mut_ptr(),
                    sizes.as_mut_ptr(),
                    segments.len(),
                    &mut attrs,
                    &mut attr_index,
                    1,
                    stream(s),
                ),
                BatchEntry::V1(f) => f(
                    dsts.as_mut_ptr(),
                    srcs.as_mut_ptr(),
                    sizes.as_mut_ptr(),
                    segments.len(),
                    &mut attrs,
                    &mut attr_index,
                    1,
                    &mut fail_index,
                    stream(s),
                ),
            }
        };
        check("cuMemcpyBatchAsync", result).map_err(|mut e| {
            if fail_index != usize::MAX {
                e.name = format!("{} (copy {fail_index} of {})", e.name, segments.len());
            }
            e
        })
    }

    unsafe fn copy_async(&self, segment: Segment, s: RawStream) -> Result<(), CudaError> {
        let _bound = self.bind()?;
        // SAFETY: the caller keeps both ranges valid until the stream ran the copy; unified
        // addressing tells host from device addresses.
        check("cuMemcpyAsync", unsafe {
            sys::cuMemcpyAsync(segment.dst, segment.src, segment.len as usize, stream(s))
        })
    }

    fn kernel_copy_available(&self) -> bool {
        self.kernel.is_some()
    }

    fn host_alloc(&self, bytes: usize) -> Result<usize, CudaError> {
        let _bound = self.bind()?;
        let mut p = std::ptr::null_mut();
        let flags = sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP;
        // SAFETY: valid out-pointer.
        check("cuMemHostAlloc", unsafe {
            sys::cuMemHostAlloc(&mut p, bytes, flags)
        })?;
        Ok(p as usize)
    }

    fn host_free(&self, ptr: usize) {
        if let Ok(_bound) = self.bind() {
            // SAFETY: memory from `host_alloc`, freed once by its owner.
            let _ = unsafe { sys::cuMemFreeHost(ptr as *mut c_void) };
        }
    }

    unsafe fn copy_kernel(
        &self,
        table: usize,
        count: usize,
        s: RawStream,
    ) -> Result<(), CudaError> {
        let Some((_, function)) = self.kernel else {
            return Err(CudaError {
                call: "cuLaunchKernel",
                code: sys::CUresult::CUDA_ERROR_NOT_SUPPORTED as i32,
                name: "no copy kernel".into(),
            });
        };
        if count == 0 {
            return Ok(());
        }
        let blocks = u32::try_from(count)
            .ok()
            .filter(|&b| b <= i32::MAX as u32)
            .ok_or(CudaError {
                call: "cuLaunchKernel",
                code: sys::CUresult::CUDA_ERROR_INVALID_VALUE as i32,
                name: format!("{count} segments in one launch"),
            })?;
        let _bound = self.bind()?;
        let mut table_arg = table as u64;
        let mut count_arg = blocks;
        let mut params = [
            (&mut table_arg as *mut u64).cast::<c_void>(),
            (&mut count_arg as *mut u32).cast::<c_void>(),
        ];
        // SAFETY: the kernel takes (const Segment*, unsigned int), as `params` point to; the
        // caller keeps the table and every segment's memory valid until the stream ran it.
        check("cuLaunchKernel", unsafe {
            sys::cuLaunchKernel(
                function,
                blocks,
                1,
                1,
                COPY_KERNEL_THREADS,
                1,
                1,
                0,
                stream(s),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        })
    }
}
