//! [`CudaDriver`] through cudarc's driver API bindings, loaded at run time (`libcuda.so`), on
//! a device's primary context: the context torch and vLLM use, so their streams and kvpool's
//! can wait for one another.

use std::ffi::c_void;

use cudarc::driver::sys;

use crate::driver::{CudaDriver, CudaError, RawEvent, RawStream};
use crate::plan::Segment;

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
            Ok(CudarcDriver {
                device,
                context,
                ordinal,
                driver_version: version,
                batch,
            })
        }
    }

    fn bind(&self) -> Result<(), CudaError> {
        // SAFETY: the context is retained while `self` lives.
        check("cuCtxSetCurrent", unsafe {
            sys::cuCtxSetCurrent(self.context)
        })
    }
}

impl Drop for CudarcDriver {
    fn drop(&mut self) {
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
            }
        )
    }

    unsafe fn host_register(&self, ptr: usize, len: usize) -> Result<(), CudaError> {
        self.bind()?;
        // SAFETY: the caller keeps the range allocated until it is unregistered.
        check("cuMemHostRegister", unsafe {
            sys::cuMemHostRegister_v2(ptr as *mut c_void, len, 0)
        })
    }

    fn host_unregister(&self, ptr: usize) -> Result<(), CudaError> {
        self.bind()?;
        // SAFETY: the driver checks that `ptr` starts a registered range.
        check("cuMemHostUnregister", unsafe {
            sys::cuMemHostUnregister(ptr as *mut c_void)
        })
    }

    fn stream_create(&self) -> Result<RawStream, CudaError> {
        self.bind()?;
        let mut s = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        check("cuStreamCreate", unsafe {
            sys::cuStreamCreate(&mut s, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32)
        })?;
        Ok(RawStream(s as usize))
    }

    fn stream_destroy(&self, s: RawStream) {
        if self.bind().is_ok() {
            // SAFETY: a stream this driver created, destroyed once by its owner.
            let _ = unsafe { sys::cuStreamDestroy_v2(stream(s)) };
        }
    }

    fn stream_synchronize(&self, s: RawStream) -> Result<(), CudaError> {
        self.bind()?;
        // SAFETY: a live stream handle.
        check("cuStreamSynchronize", unsafe {
            sys::cuStreamSynchronize(stream(s))
        })
    }

    fn stream_wait_event(&self, s: RawStream, e: RawEvent) -> Result<(), CudaError> {
        self.bind()?;
        // SAFETY: live handles.
        check("cuStreamWaitEvent", unsafe {
            sys::cuStreamWaitEvent(stream(s), event(e), 0)
        })
    }

    fn event_create(&self) -> Result<RawEvent, CudaError> {
        self.bind()?;
        let mut e = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        check("cuEventCreate", unsafe {
            sys::cuEventCreate(&mut e, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32)
        })?;
        Ok(RawEvent(e as usize))
    }

    fn event_destroy(&self, e: RawEvent) {
        if self.bind().is_ok() {
            // SAFETY: an event this driver created, destroyed once by its owner.
            let _ = unsafe { sys::cuEventDestroy_v2(event(e)) };
        }
    }

    fn event_record(&self, e: RawEvent, s: RawStream) -> Result<(), CudaError> {
        self.bind()?;
        // SAFETY: live handles.
        check("cuEventRecord", unsafe {
            sys::cuEventRecord(event(e), stream(s))
        })
    }

    fn event_query(&self, e: RawEvent) -> Result<bool, CudaError> {
        self.bind()?;
        // SAFETY: a live event handle.
        match unsafe { sys::cuEventQuery(event(e)) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            other => check("cuEventQuery", other).map(|()| false),
        }
    }

    fn event_synchronize(&self, e: RawEvent) -> Result<(), CudaError> {
        self.bind()?;
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
        self.bind()?;
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
        self.bind()?;
        // SAFETY: the caller keeps both ranges valid until the stream ran the copy; unified
        // addressing tells host from device addresses.
        check("cuMemcpyAsync", unsafe {
            sys::cuMemcpyAsync(segment.dst, segment.src, segment.len as usize, stream(s))
        })
    }
}
