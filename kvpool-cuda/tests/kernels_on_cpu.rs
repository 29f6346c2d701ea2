//! The real kernel source (`src/kernels.cu`), compiled for the CPU with a tiny shim that runs
//! the CUDA grid as loops, driven by the same [`LaunchPlan`] the GPU engine launches, and
//! compared byte for byte with the host transfer (the oracle). This checks the kernels' address
//! arithmetic, every access width and the launch parameters on machines without a GPU (CI);
//! `tests/gpu.rs` checks the real device. Skips (with a message) where no C++ compiler exists.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use common::{layer_in_order, layouts, random_cache, random_slots};
use kvpool_core::{HostPagedKvCache, KvTransfer};
use kvpool_cuda::{Direction, LaunchPlan, PagedGeometry, PagedOrder};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

/// The CUDA built-ins the kernels use, as host globals, and a `main` that runs one launch.
const SHIM: &str = r#"
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>
struct uint4 { unsigned int x, y, z, w; };
struct Dim { unsigned int x, y, z; };
static Dim blockIdx, threadIdx, blockDim;
#define __global__
#define __restrict__
#include "kernels.cu"

static std::vector<unsigned char> slurp(const std::string& path) {
    FILE* f = std::fopen(path.c_str(), "rb");
    if (!f) { std::perror(path.c_str()); std::exit(2); }
    std::fseek(f, 0, SEEK_END); long n = std::ftell(f); std::fseek(f, 0, SEEK_SET);
    std::vector<unsigned char> v(n);
    if (n && std::fread(v.data(), 1, n, f) != (size_t)n) { std::exit(3); }
    std::fclose(f);
    return v;
}
static void spit(const std::string& path, const unsigned char* p, size_t n) {
    FILE* f = std::fopen(path.c_str(), "wb");
    if (!f || std::fwrite(p, 1, n, f) != n) { std::exit(4); }
    std::fclose(f);
}
static unsigned char* aligned_copy(const std::vector<unsigned char>& v) {
    size_t n = (v.size() + 63) / 64 * 64;
    unsigned char* p = (unsigned char*)std::aligned_alloc(64, n ? n : 64);
    std::memcpy(p, v.data(), v.size());
    return p;
}

// argv: dir kernel grid_x grid_y threads first_layer chunk_tokens token_offset planes
//       row_bytes block_size block_stride_rows plane_stride_rows num_layers
int main(int argc, char** argv) {
    if (argc != 15) { std::fprintf(stderr, "bad arguments\n"); return 1; }
    std::string dir = argv[1], kernel = argv[2];
    long long a[12];
    for (int i = 0; i < 12; i++) a[i] = std::atoll(argv[3 + i]);
    unsigned gx = a[0], gy = a[1], threads = a[2];
    int first_layer = a[3]; i64 chunk_tokens = a[4], token_offset = a[5]; int planes = a[6];
    i64 row_bytes = a[7], block_size = a[8], block_stride = a[9], plane_stride = a[10];
    int num_layers = a[11];
    std::vector<unsigned char*> layers; std::vector<size_t> sizes; std::vector<u64> ptrs;
    for (int l = 0; l < num_layers; l++) {
        auto v = slurp(dir + "/layer" + std::to_string(l) + ".bin");
        layers.push_back(aligned_copy(v)); sizes.push_back(v.size());
        ptrs.push_back((u64)(uintptr_t)layers.back());
    }
    auto slots_v = slurp(dir + "/slots.bin");
    i64* slots = (i64*)aligned_copy(slots_v);
    auto chunk_v = slurp(dir + "/chunk.bin");
    unsigned char* chunk = aligned_copy(chunk_v);
    blockDim = Dim{threads, 1, 1};
    for (unsigned y = 0; y < gy; y++)
        for (unsigned x = 0; x < gx; x++)
            for (unsigned t = 0; t < threads; t++) {
                blockIdx = Dim{x, y, 0}; threadIdx = Dim{t, 0, 0};
#define RUN(NAME, CHUNK) if (kernel == #NAME) NAME(ptrs.data(), first_layer, slots, CHUNK, \
    chunk_tokens, token_offset, planes, row_bytes, block_size, block_stride, plane_stride); else
                RUN(kvpool_gather_v16, chunk) RUN(kvpool_gather_v4, chunk) RUN(kvpool_gather_v1, chunk)
                RUN(kvpool_scatter_v16, chunk) RUN(kvpool_scatter_v4, chunk) RUN(kvpool_scatter_v1, chunk)
                { std::fprintf(stderr, "unknown kernel %s\n", kernel.c_str()); return 1; }
            }
    for (int l = 0; l < num_layers; l++) spit(dir + "/layer" + std::to_string(l) + ".bin", layers[l], sizes[l]);
    spit(dir + "/chunk.bin", chunk, chunk_v.size());
    return 0;
}
"#;

/// The emulator binary, built once per test process; `None` if there is no C++ compiler.
fn emulator() -> Option<&'static Path> {
    static BUILT: OnceLock<Option<PathBuf>> = OnceLock::new();
    BUILT
        .get_or_init(|| {
            // Per process: nextest runs tests of this binary in parallel processes.
            let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
                .join(format!("kernels-on-cpu-{}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join("shim.cpp"), SHIM).unwrap();
            let binary = dir.join("emulator");
            let src = concat!(env!("CARGO_MANIFEST_DIR"), "/src");
            let out = Command::new("c++")
                .args(["-std=c++17", "-O1", "-I", src, "-o"])
                .arg(&binary)
                .arg(dir.join("shim.cpp"))
                .output()
                .ok()?;
            assert!(
                out.status.success(),
                "kernels.cu does not compile for the CPU emulation:\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
            Some(binary)
        })
        .as_deref()
}

/// Runs `plan` over the kernel source on the CPU: `layers` (one tensor per layer, engine
/// order) and `chunk` are updated in place.
fn run_on_cpu(plan: &LaunchPlan, layers: &mut [Vec<u8>], slots: &[i64], chunk: &mut Vec<u8>) {
    let binary = emulator().unwrap();
    let dir = tempfile::tempdir().unwrap();
    for (l, bytes) in layers.iter().enumerate() {
        std::fs::write(dir.path().join(format!("layer{l}.bin")), bytes).unwrap();
    }
    let slot_bytes: Vec<u8> = slots.iter().flat_map(|s| s.to_le_bytes()).collect();
    std::fs::write(dir.path().join("slots.bin"), slot_bytes).unwrap();
    std::fs::write(dir.path().join("chunk.bin"), &chunk).unwrap();
    let args = [
        plan.grid.0 as i64,
        plan.grid.1 as i64,
        plan.threads as i64,
        plan.first_layer as i64,
        plan.chunk_tokens,
        plan.token_offset,
        plan.planes as i64,
        plan.row_bytes,
        plan.block_size,
        plan.block_stride_rows,
        plan.plane_stride_rows,
        layers.len() as i64,
    ];
    let out = Command::new(binary)
        .arg(dir.path())
        .arg(plan.kernel_name())
        .args(args.iter().map(i64::to_string))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for (l, bytes) in layers.iter_mut().enumerate() {
        *bytes = std::fs::read(dir.path().join(format!("layer{l}.bin"))).unwrap();
    }
    *chunk = std::fs::read(dir.path().join("chunk.bin")).unwrap();
}

fn have_emulator() -> bool {
    if emulator().is_none() {
        println!("SKIP: no C++ compiler (`c++`) to run the kernels on the CPU");
        return false;
    }
    true
}

/// Fake device addresses: 16-byte aligned layers, and a chunk address whose alignment picks
/// the access width under test.
fn fake_layer_ptrs(n: usize) -> Vec<u64> {
    (0..n as u64)
        .map(|i| 0x7f00_0000_0000 + i * (1 << 30))
        .collect()
}

#[test]
fn gathers_match_the_host_oracle_for_every_order_and_width() {
    if !have_emulator() {
        return;
    }
    let mut rng = SmallRng::seed_from_u64(11);
    let mut widths_seen = std::collections::HashSet::new();
    for (layout, order) in layouts() {
        let blocks = 9;
        let host = random_cache(layout, blocks, &mut rng);
        let geometry = PagedGeometry::new(order, &layout, blocks);
        let ptrs = fake_layer_ptrs(layout.num_layers);
        for chunk_address in [0x10_0000u64, 0x10_0004, 0x10_0001] {
            let n = 37;
            let slots = random_slots(n, blocks * 16, &mut rng);
            let mut want = vec![0u8; layout.chunk_bytes(n)];
            host.gather(&slots, &mut want).unwrap();

            // All layers in one launch.
            let plan = LaunchPlan::new(
                &geometry,
                Direction::Gather,
                &ptrs,
                0,
                layout.num_layers,
                n,
                chunk_address,
                n,
                0,
            )
            .unwrap();
            widths_seen.insert(plan.width);
            let mut layers: Vec<Vec<u8>> = (0..layout.num_layers)
                .map(|l| layer_in_order(&host, l, order, blocks))
                .collect();
            let mut chunk = vec![0xAAu8; want.len()];
            run_on_cpu(&plan, &mut layers, &slots, &mut chunk);
            assert!(chunk == want, "{order:?} {:?}: whole gather", plan.width);

            // One layer into that layer's region, as `gather_layer` launches it.
            let region = n * layout.bytes_per_token_per_layer();
            let plan = LaunchPlan::new(
                &geometry,
                Direction::Gather,
                &ptrs,
                1,
                1,
                n,
                chunk_address,
                n,
                0,
            )
            .unwrap();
            let mut chunk = vec![0x55u8; region];
            run_on_cpu(&plan, &mut layers, &slots, &mut chunk);
            assert!(
                chunk == want[region..2 * region],
                "{order:?} {:?}: layer 1 gather",
                plan.width
            );
        }
    }
    assert_eq!(widths_seen.len(), 3, "every access width was exercised");
}

#[test]
fn scatters_match_the_host_oracle_and_touch_nothing_else() {
    if !have_emulator() {
        return;
    }
    let mut rng = SmallRng::seed_from_u64(12);
    for (layout, order) in layouts() {
        for chunk_address in [0x10_0000u64, 0x10_0004, 0x10_0001] {
            let blocks = 7;
            let mut host: HostPagedKvCache = random_cache(layout, blocks, &mut rng);
            let geometry = PagedGeometry::new(order, &layout, blocks);
            let ptrs = fake_layer_ptrs(layout.num_layers);
            let mut layers: Vec<Vec<u8>> = (0..layout.num_layers)
                .map(|l| layer_in_order(&host, l, order, blocks))
                .collect();
            // A partial window: chunk tokens 5..16 of a 20-token chunk.
            let (chunk_tokens, offset, count) = (20, 5, 11);
            let mut chunk = vec![0u8; layout.chunk_bytes(chunk_tokens)];
            rng.fill(chunk.as_mut_slice());
            let slots = random_slots(count, blocks * 16, &mut rng);
            host.scatter(&chunk, chunk_tokens, offset, &slots).unwrap();
            let plan = LaunchPlan::new(
                &geometry,
                Direction::Scatter,
                &ptrs,
                0,
                layout.num_layers,
                count,
                chunk_address,
                chunk_tokens,
                offset,
            )
            .unwrap();
            let original_chunk = chunk.clone();
            run_on_cpu(&plan, &mut layers, &slots, &mut chunk);
            assert_eq!(chunk, original_chunk, "a scatter does not write the chunk");
            for (l, bytes) in layers.iter().enumerate() {
                assert!(
                    *bytes == layer_in_order(&host, l, order, blocks),
                    "{order:?} {:?}: layer {l} after scatter",
                    plan.width
                );
            }
            // Layer 2 only, from its region of the chunk (as `scatter_layer` launches it).
            let region = chunk_tokens * layout.bytes_per_token_per_layer();
            let slots = random_slots(6, blocks * 16, &mut rng);
            host.scatter_layer(2, &chunk, chunk_tokens, 0, &slots)
                .unwrap();
            let plan = LaunchPlan::new(
                &geometry,
                Direction::Scatter,
                &ptrs,
                2,
                1,
                6,
                chunk_address,
                chunk_tokens,
                0,
            )
            .unwrap();
            let mut region_bytes = chunk[2 * region..3 * region].to_vec();
            run_on_cpu(&plan, &mut layers, &slots, &mut region_bytes);
            for (l, bytes) in layers.iter().enumerate() {
                assert!(
                    *bytes == layer_in_order(&host, l, order, blocks),
                    "{order:?} {:?}: layer {l} after the layer-2 scatter",
                    plan.width
                );
            }
        }
    }
}

#[test]
fn nothing_to_move_plans_no_launch() {
    let layout = layouts()[0].0;
    let g = PagedGeometry::new(PagedOrder::FlashAttention, &layout, 4);
    assert!(LaunchPlan::new(&g, Direction::Gather, &[16], 0, 1, 0, 0, 0, 0).is_none());
    assert!(LaunchPlan::new(&g, Direction::Gather, &[16], 0, 0, 5, 0, 5, 0).is_none());
}
