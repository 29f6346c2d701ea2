//! The gather/scatter kernels: their CUDA source (`kernels.cu`, kept in the crate), NVRTC
//! compilation at run time, and the choice of access width.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction};
use cudarc::nvrtc::{CompileOptions, compile_ptx_with_opts};

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

impl Kernels {
    /// Compiles [`KERNEL_SOURCE`] with NVRTC and loads it into `ctx`.
    pub fn compile(ctx: &Arc<CudaContext>) -> Result<Self, CudaError> {
        if !nvrtc_library_present() {
            return Err(CudaError::CudaUnavailable(
                "no NVRTC library (libnvrtc.so) could be loaded to compile the kernels".into(),
            ));
        }
        let ptx = compile_ptx_with_opts(
            KERNEL_SOURCE,
            CompileOptions {
                name: Some("kvpool_kernels.cu".into()),
                ..Default::default()
            },
        )
        .map_err(|e| CudaError::Compile(format!("{e:?}")))?;
        let module = ctx
            .load_module(ptx)
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
    }
}
