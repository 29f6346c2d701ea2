//! Finding the CUDA driver and NVRTC at run time, without panicking when they are absent.
//!
//! cudarc loads `libcuda` and `libnvrtc` lazily and panics if they are missing, so every entry
//! point of this crate asks [`open_context`] first, which checks for the libraries and turns
//! their absence (or a machine without a device) into [`CudaError::CudaUnavailable`].

use std::sync::Arc;

use cudarc::driver::CudaContext;

use crate::error::CudaError;

/// Whether the CUDA driver library can be loaded.
pub fn driver_library_present() -> bool {
    // SAFETY: only tries to dlopen the library by its known names.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// Whether the NVRTC library (run-time kernel compilation) can be loaded.
pub fn nvrtc_library_present() -> bool {
    // SAFETY: as above.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// Number of CUDA devices, or why there are none to use.
pub fn device_count() -> Result<usize, CudaError> {
    if !driver_library_present() {
        return Err(CudaError::CudaUnavailable(
            "no CUDA driver library (libcuda.so) could be loaded".into(),
        ));
    }
    let n = CudaContext::device_count()
        .map_err(|e| CudaError::CudaUnavailable(format!("cuInit failed: {e:?}")))?;
    Ok(n.max(0) as usize)
}

/// The primary context of device `ordinal` (the one PyTorch and vLLM also use).
pub fn open_context(ordinal: usize) -> Result<Arc<CudaContext>, CudaError> {
    let count = device_count()?;
    if ordinal >= count {
        return Err(CudaError::CudaUnavailable(format!(
            "device {ordinal} requested, {count} present"
        )));
    }
    CudaContext::new(ordinal).map_err(|e| CudaError::driver("cuDevicePrimaryCtxRetain", e))
}
