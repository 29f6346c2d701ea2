//! The gather/scatter kernels: their CUDA source (`kernels.cu`, kept in the crate), NVRTC
//! compilation at run time, and the choice of access width.

use std::ffi::{CStr, CString};
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction};
use cudarc::nvrtc::{CompileOptions, Ptx, compile_ptx_with_opts};
use tracing::{debug, warn};

use crate::driver::nvrtc_library_present;
use crate::error::CudaError;

/// The CUDA C source of the kernels.
pub const KERNEL_SOURCE: &str = include_str!("kernels.cu");

/// Bytes moved per access by a kernel variant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AccessWidth {
    /// `uint4`: 16-byte loads and stores.
    Vec16,
    /// `unsigned int`: 4 bytes.
    Vec4,
    /// Single bytes.
    Byte,
}

impl AccessWidth {
    /// The widest access that divides `row_bytes` and every address in `addresses`.
    pub fn widest(row_bytes: usize, addresses: impl IntoIterator<Item = u64> + Clone) -> Self {
        let fits = |w: u64| {
            (row_bytes as u64).is_multiple_of(w)
                && addresses.clone().into_iter().all(|a| a % w == 0)
        };
        if fits(16) {
            AccessWidth::Vec16
        } else if fits(4) {
            AccessWidth::Vec4
        } else {
            AccessWidth::Byte
        }
    }

    /// Bytes per access.
    pub fn bytes(self) -> usize {
        match self {
            AccessWidth::Vec16 => 16,
            AccessWidth::Vec4 => 4,
            AccessWidth::Byte => 1,
        }
    }

    fn suffix(self) -> &'static str {
        match self {
            AccessWidth::Vec16 => "v16",
            AccessWidth::Vec4 => "v4",
            AccessWidth::Byte => "v1",
        }
    }
}

/// The compiled kernels, loaded into one context.
pub struct Kernels {
    gather: [CudaFunction; 3],
    scatter: [CudaFunction; 3],
}

fn index(width: AccessWidth) -> usize {
    match width {
        AccessWidth::Vec16 => 0,
        AccessWidth::Vec4 => 1,
        AccessWidth::Byte => 2,
    }
}

/// Compiles `source` with NVRTC straight to machine code (a cubin) for the real architecture
/// `arch` (`"sm_90"`). Unlike PTX, a cubin needs no JIT by the driver, so it loads even when
/// NVRTC is newer than the driver (whose JIT rejects a newer PTX version).
pub fn compile_cubin(source: &str, arch: &str) -> Result<Vec<u8>, CudaError> {
    use cudarc::nvrtc::{result, sys};
    if !nvrtc_library_present() {
        return Err(nvrtc_missing());
    }
    let failed = |what: &str, e: result::NvrtcError| CudaError::Compile(format!("{what}: {e:?}"));
    let src = CString::new(source).map_err(|e| CudaError::Compile(e.to_string()))?;
    let prog = result::create_program(&src, Some(c"kvpool_kernels.cu"))
        .map_err(|e| failed("nvrtcCreateProgram", e))?;
    let options = [format!("--gpu-architecture={arch}")];
    // SAFETY: `prog` is live until `destroy_program` below; `src` outlives it.
    let cubin = unsafe {
        let compiled = result::compile_program(prog, &options).map_err(|e| {
            let log = result::get_program_log(prog)
                .map(|raw| CStr::from_ptr(raw.as_ptr()).to_string_lossy().into_owned())
                .unwrap_or_default();
            CudaError::Compile(format!("nvrtcCompileProgram for {arch}: {e:?}: {log}"))
        });
        let cubin = compiled.and_then(|()| {
            let mut size = 0usize;
            sys::nvrtcGetCUBINSize(prog, &mut size)
                .result()
                .map_err(|e| failed("nvrtcGetCUBINSize", e))?;
            let mut bytes = vec![0u8; size];
            sys::nvrtcGetCUBIN(prog, bytes.as_mut_ptr().cast())
                .result()
                .map_err(|e| failed("nvrtcGetCUBIN", e))?;
            Ok(bytes)
        });
        let _ = result::destroy_program(prog);
        cubin?
    };
    if cubin.is_empty() {
        return Err(CudaError::Compile(format!(
            "NVRTC produced no machine code for {arch}"
        )));
    }
    Ok(cubin)
}

fn nvrtc_missing() -> CudaError {
    CudaError::CudaUnavailable(
        "no NVRTC library (libnvrtc.so.13) could be loaded to compile the kernels; put the \
         CUDA toolkit's lib64 (or pip's nvidia/cu13/lib) on LD_LIBRARY_PATH"
            .into(),
    )
}

impl Kernels {
    /// Compiles [`KERNEL_SOURCE`] with NVRTC and loads it into `ctx`: machine code for the
    /// device's own architecture where NVRTC knows it, else PTX that the driver compiles.
    pub fn compile(ctx: &Arc<CudaContext>) -> Result<Self, CudaError> {
        if !nvrtc_library_present() {
            return Err(nvrtc_missing());
        }
        let (major, minor) = ctx
            .compute_capability()
            .map_err(|e| CudaError::driver("cuDeviceGetAttribute", e))?;
        let arch = format!("sm_{major}{minor}");
        let image = match compile_cubin(KERNEL_SOURCE, &arch) {
            Ok(cubin) => {
                debug!(%arch, bytes = cubin.len(), "compiled the kernels to machine code");
                Ptx::from_binary(cubin)
            }
            Err(e) => {
                warn!(%arch, error = %e, "no machine code for this device; loading PTX");
                compile_ptx_with_opts(
                    KERNEL_SOURCE,
                    CompileOptions {
                        name: Some("kvpool_kernels.cu".into()),
                        ..Default::default()
                    },
                )
                .map_err(|e| CudaError::Compile(format!("{e:?}")))?
            }
        };
        let module = ctx
            .load_module(image)
            .map_err(|e| CudaError::driver("cuModuleLoadData", e))?;
        let load = |kind: &str, width: AccessWidth| {
            module
                .load_function(&format!("kvpool_{kind}_{}", width.suffix()))
                .map_err(|e| CudaError::driver("cuModuleGetFunction", e))
        };
        let widths = [AccessWidth::Vec16, AccessWidth::Vec4, AccessWidth::Byte];
        Ok(Kernels {
            gather: [
                load("gather", widths[0])?,
                load("gather", widths[1])?,
                load("gather", widths[2])?,
            ],
            scatter: [
                load("scatter", widths[0])?,
                load("scatter", widths[1])?,
                load("scatter", widths[2])?,
            ],
        })
    }

    /// The gather kernel (paged cache -> chunk) for `width`.
    pub fn gather(&self, width: AccessWidth) -> &CudaFunction {
        &self.gather[index(width)]
    }

    /// The scatter kernel (chunk -> paged cache) for `width`.
    pub fn scatter(&self, width: AccessWidth) -> &CudaFunction {
        &self.scatter[index(width)]
    }
}

/// Which way a kernel moves rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Direction {
    /// Paged cache -> chunk.
    Gather,
    /// Chunk -> paged cache.
    Scatter,
}

/// Everything one kernel launch needs besides the three device pointers (layer table, slots,
/// chunk): which kernel, the grid, and the scalar arguments in kernel order. The GPU engine
/// launches exactly this; the CPU emulation test (`tests/kernels_on_cpu.rs`) runs the same
/// plan over `kernels.cu` compiled for the host.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchPlan {
    /// Gather or scatter.
    pub direction: Direction,
    /// Access width, so which kernel variant.
    pub width: AccessWidth,
    /// Grid: (tokens, layers x planes).
    pub grid: (u32, u32),
    /// Threads per block.
    pub threads: u32,
    /// First layer of the range.
    pub first_layer: i32,
    /// Tokens in the chunk buffer.
    pub chunk_tokens: i64,
    /// First chunk token moved.
    pub token_offset: i64,
    /// Planes per layer.
    pub planes: i32,
    /// Bytes per row.
    pub row_bytes: i64,
    /// Tokens per block.
    pub block_size: i64,
    /// Rows between blocks.
    pub block_stride_rows: i64,
    /// Rows between planes.
    pub plane_stride_rows: i64,
}

impl LaunchPlan {
    /// Plans moving `tokens` rows of layers `first_layer..first_layer + layers` between the
    /// paged cache (`geometry`, layers at `layer_ptrs`) and a chunk buffer at `chunk` of
    /// `chunk_tokens` tokens, starting at chunk token `token_offset`. `None` if there is
    /// nothing to move.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        geometry: &crate::PagedGeometry,
        direction: Direction,
        layer_ptrs: &[u64],
        first_layer: usize,
        layers: usize,
        tokens: usize,
        chunk: u64,
        chunk_tokens: usize,
        token_offset: usize,
    ) -> Option<Self> {
        let grid_y = layers * geometry.planes;
        if tokens == 0 || grid_y == 0 {
            return None;
        }
        let width = AccessWidth::widest(
            geometry.row_bytes,
            layer_ptrs.iter().copied().chain([chunk]),
        );
        Some(LaunchPlan {
            direction,
            width,
            grid: (tokens as u32, grid_y as u32),
            threads: threads_per_row(geometry.row_bytes, width),
            first_layer: first_layer as i32,
            chunk_tokens: chunk_tokens as i64,
            token_offset: token_offset as i64,
            planes: geometry.planes as i32,
            row_bytes: geometry.row_bytes as i64,
            block_size: geometry.block_size as i64,
            block_stride_rows: geometry.block_stride_rows as i64,
            plane_stride_rows: geometry.plane_stride_rows as i64,
        })
    }

    /// The kernel's name in [`KERNEL_SOURCE`].
    pub fn kernel_name(&self) -> String {
        let kind = match self.direction {
            Direction::Gather => "gather",
            Direction::Scatter => "scatter",
        };
        format!("kvpool_{kind}_{}", self.width.suffix())
    }
}

/// Threads per CUDA block for rows of `row_bytes` moved `width` at a time: enough for one pass
/// over the row where possible, a multiple of the warp size, at most 256.
pub fn threads_per_row(row_bytes: usize, width: AccessWidth) -> u32 {
    let accesses = row_bytes.div_ceil(width.bytes()).max(1);
    (accesses.div_ceil(32) * 32).min(256) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_widest_access_the_addresses_allow() {
        assert_eq!(
            AccessWidth::widest(256, [0x1000u64, 0x2000]),
            AccessWidth::Vec16
        );
        assert_eq!(
            AccessWidth::widest(256, [0x1000u64, 0x2004]),
            AccessWidth::Vec4
        );
        assert_eq!(AccessWidth::widest(2 * 3, [0x1000u64]), AccessWidth::Byte);
        assert_eq!(AccessWidth::widest(20, [0x1000u64]), AccessWidth::Vec4);
        assert_eq!(threads_per_row(2048, AccessWidth::Vec16), 128);
        assert_eq!(threads_per_row(16, AccessWidth::Vec16), 32);
        assert_eq!(threads_per_row(1 << 20, AccessWidth::Byte), 256);
    }

    #[test]
    fn every_kernel_variant_is_in_the_source() {
        for kind in ["gather", "scatter"] {
            for suffix in ["v16", "v4", "v1"] {
                let name = format!("kvpool_{kind}_##SUFFIX");
                assert!(KERNEL_SOURCE.contains(&name), "{name}");
                assert!(KERNEL_SOURCE.contains(&format!("KVPOOL_COPY_KERNELS({suffix},")));
            }
        }
    }

    /// Compiles the real source wherever NVRTC can be loaded: GPU machines, and CI, where
    /// `cargo xtask ci` installs NVRTC from PyPI (no GPU needed) and requires it.
    #[test]
    fn the_kernels_compile_with_nvrtc_where_it_exists() {
        if !nvrtc_library_present() {
            assert!(
                std::env::var("KVPOOL_REQUIRE_NVRTC").is_err(),
                "KVPOOL_REQUIRE_NVRTC is set but libnvrtc cannot be loaded"
            );
            println!("SKIP: no libnvrtc on this machine; `cargo xtask ci` installs one from PyPI");
            return;
        }
        let ptx = compile_ptx_with_opts(KERNEL_SOURCE, CompileOptions::default())
            .unwrap_or_else(|e| panic!("{e:?}"));
        let text = ptx.to_src();
        for suffix in ["v16", "v4", "v1"] {
            assert!(text.contains(&format!("kvpool_gather_{suffix}")));
            assert!(text.contains(&format!("kvpool_scatter_{suffix}")));
        }
        // Machine code for Ampere and Hopper (the H100/H200), as `Kernels::compile` builds it.
        for arch in ["sm_80", "sm_90"] {
            let cubin = compile_cubin(KERNEL_SOURCE, arch).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(&cubin[..4], b"\x7fELF", "{arch}: a cubin is an ELF image");
            let has = |name: &str| cubin.windows(name.len()).any(|w| w == name.as_bytes());
            assert!(
                has("kvpool_gather_v16") && has("kvpool_scatter_v1"),
                "{arch}"
            );
        }
        let bad = compile_cubin("extern \"C\" __global__ void k() { nope; }", "sm_90");
        assert!(
            matches!(&bad, Err(CudaError::Compile(m)) if m.contains("nope")),
            "a compile error carries NVRTC's log: {bad:?}"
        );
    }
}
