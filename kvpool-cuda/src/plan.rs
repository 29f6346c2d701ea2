//! Copy plans: one job's block copies between the engine's paged KV and kvpool's host chunks,
//! as `(source, destination, length)` segments in ordered phases, merged where both sides run
//! on. Built once per job from what the worker planned; run by either executor.
//!
//! The engine's KV is a set of *planes* ([`KvPlanes`]): per layer, `num_blocks` pages of
//! `page_bytes` (one block of one layer: all its heads and tokens), `row_stride` bytes apart.
//! A host chunk holds its blocks plane by plane: `[planes, chunk_blocks, page_bytes]`, so a
//! chunk's block `j` of plane `p` lies `(p * chunk_blocks + j) * page_bytes` bytes in.
//!
//! A job may name, per chunk, a *staged copy*: a buffer of the worker's that the chunk passes
//! through, because the chunk's own place is memory other processes can write (the node
//! daemon's arena). A load then copies the chunk into that buffer first (phase 0, host to host:
//! [`CopyPlan::host_phase`]) and fills the blocks from the buffer (phase 1), so the blocks get
//! exactly the bytes the worker checks; a save copies each page both into the buffer and into
//! the place, in one phase (the worker seals the chunk from its buffer; no host-to-host copy,
//! which CUDA runs synchronously with the host). Copies within a phase may run in any order
//! (a CUDA batch gives no order); phases run one after the other.

use std::collections::HashSet;

/// Which way a job copies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// Host chunks into the engine's blocks.
    Load,
    /// The engine's blocks into host chunks.
    Save,
}

/// One plane of the engine's KV: one layer's pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Plane {
    /// Address of block 0's page.
    pub base: u64,
    /// Bytes from one block's page to the next (at least the page's length: vLLM pads pages).
    pub row_stride: u64,
}

/// Why a plan (or the planes it is built over) was refused. Each is a fault in what the
/// caller handed in, never a condition to retry: the job fails and its blocks are recomputed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    /// No planes, no blocks, or pages of no bytes.
    #[error("KV planes: {0}")]
    Planes(String),
    /// A plane's address arithmetic would overflow, or its pages overlap one another.
    #[error("KV plane {plane}: {reason}")]
    Plane {
        /// The plane's index.
        plane: usize,
        /// What is wrong with it.
        reason: String,
    },
    /// The job's block length is not the planes' (one page per plane).
    #[error("chunk blocks of {got} bytes for {planes} planes of {page_bytes} bytes")]
    BlockBytes {
        /// The job's block length.
        got: u64,
        /// The number of planes.
        planes: usize,
        /// Each plane's page length.
        page_bytes: u64,
    },
    /// The job's per-chunk lists disagree in length.
    #[error("{what}: {got} for {chunks} chunks")]
    ChunkCount {
        /// Which list.
        what: &'static str,
        /// Its length.
        got: usize,
        /// The number of chunks (chunk addresses).
        chunks: usize,
    },
    /// The job names another number of engine blocks than its chunks hold (a save with fewer
    /// would leave part of a chunk unwritten, and that chunk would be stored as KV).
    #[error("{got} engine blocks for chunks of {blocks} blocks less {skip} held")]
    BlockCount {
        /// Engine block ids given.
        got: usize,
        /// Blocks in the job's chunks.
        blocks: usize,
        /// Leading blocks of the first chunk the engine already holds.
        skip: usize,
    },
    /// Leading blocks skipped where that means nothing: on a save, or all of the first chunk.
    #[error("{0}")]
    Skip(String),
    /// An engine block id past the planes' blocks.
    #[error("engine block {block} of {num_blocks}")]
    BlockOutOfRange {
        /// The id.
        block: u32,
        /// The planes' block count.
        num_blocks: u64,
    },
    /// One engine block named twice in a load: its bytes would depend on which copy ran last.
    #[error("engine block {0} named twice in one load")]
    DuplicateBlock(u32),
    /// A chunk with no address, or an empty chunk.
    #[error("chunk {0} has no address or no blocks")]
    Chunk(usize),
    /// A job's address arithmetic overflows.
    #[error("address arithmetic overflows")]
    Overflow,
}

/// The engine's KV as planes, each `num_blocks` pages of `page_bytes`. Plain values: whether
/// the addresses are valid is for the executor that runs plans over them to be told.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvPlanes {
    planes: Vec<Plane>,
    page_bytes: u64,
    num_blocks: u64,
    block_bytes: u64,
}

impl KvPlanes {
    /// Planes in the chunk layout's plane order, each of `num_blocks` pages of `page_bytes`.
    /// Refuses no planes, empty pages, a null base, pages that overlap (`row_stride <
    /// page_bytes`, or one plane's pages another's), and planes whose last page's end does not
    /// fit in 64 bits.
    pub fn new(planes: Vec<Plane>, page_bytes: u64, num_blocks: u64) -> Result<Self, PlanError> {
        if planes.is_empty() || page_bytes == 0 || num_blocks == 0 {
            return Err(PlanError::Planes(format!(
                "{} planes of {num_blocks} blocks of {page_bytes} bytes",
                planes.len()
            )));
        }
        for (i, p) in planes.iter().enumerate() {
            let fail = |reason: &str| PlanError::Plane {
                plane: i,
                reason: reason.to_string(),
            };
            if p.base == 0 {
                return Err(fail("no address"));
            }
            if p.row_stride < page_bytes {
                return Err(fail(&format!(
                    "rows {} bytes apart hold pages of {page_bytes} bytes (overlapping)",
                    p.row_stride
                )));
            }
            (num_blocks - 1)
                .checked_mul(p.row_stride)
                .and_then(|v| v.checked_add(page_bytes))
                .and_then(|v| v.checked_add(p.base))
                .ok_or_else(|| fail("its last page ends past the address space"))?;
        }
        for (i, a) in planes.iter().enumerate() {
            for b in &planes[..i] {
                if pages_overlap(a, b, page_bytes, num_blocks) {
                    return Err(PlanError::Plane {
                        plane: i,
                        reason: format!(
                            "its pages overlap another plane's (bases {:#x} and {:#x})",
                            a.base, b.base
                        ),
                    });
                }
            }
        }
        let block_bytes = page_bytes
            .checked_mul(planes.len() as u64)
            .ok_or_else(|| PlanError::Planes("a block's bytes overflow".into()))?;
        Ok(KvPlanes {
            planes,
            page_bytes,
            num_blocks,
            block_bytes,
        })
    }

    /// The planes.
    pub fn planes(&self) -> &[Plane] {
        &self.planes
    }

    /// Bytes of one block in one plane.
    pub fn page_bytes(&self) -> u64 {
        self.page_bytes
    }

    /// Blocks per plane.
    pub fn num_blocks(&self) -> u64 {
        self.num_blocks
    }

    /// Bytes of one block across all planes: a chunk's block length.
    pub fn block_bytes(&self) -> u64 {
        self.block_bytes
    }

    /// Where block `block`'s page of plane `plane` starts (both checked by the caller).
    fn page(&self, plane: usize, block: u32) -> u64 {
        let p = self.planes[plane];
        p.base + u64::from(block) * p.row_stride
    }
}

/// Whether any page of plane `a` overlaps any page of plane `b` (both `num_blocks` pages of
/// `page` bytes). Planes whose extents are disjoint do not; planes with one row stride may
/// interleave (one plane's pages in the gaps of the other's rows).
fn pages_overlap(a: &Plane, b: &Plane, page: u64, num_blocks: u64) -> bool {
    let end = |p: &Plane| p.base + (num_blocks - 1) * p.row_stride + page;
    if end(a) <= b.base || end(b) <= a.base {
        return false;
    }
    if a.row_stride != b.row_stride {
        return true;
    }
    let stride = a.row_stride;
    let delta = a.base.abs_diff(b.base) % stride;
    !(delta >= page && delta <= stride - page)
}

/// One copy job as the worker plans it (the fields of `kvpool_connector::CopyJob`).
#[derive(Debug, Clone, Copy)]
pub struct JobSpec<'a> {
    /// Which way it copies.
    pub direction: Direction,
    /// Engine block ids: every block of the job's chunks, in order, but the first chunk's
    /// leading `skip_blocks`.
    pub block_ids: &'a [u32],
    /// Leading blocks of the first chunk the engine already holds (a load only).
    pub skip_blocks: usize,
    /// Blocks in each chunk.
    pub chunk_blocks: &'a [usize],
    /// Bytes of one block across all planes.
    pub block_bytes: u64,
    /// Each chunk's host address.
    pub chunk_ptrs: &'a [u64],
    /// Empty, or per chunk 0 or the address of the worker's buffer the chunk passes through.
    pub check_copy_ptrs: &'a [u64],
}

/// One copy of `len` bytes (laid out as kvpool's copy kernel reads its table: three `u64`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(C)]
pub struct Segment {
    /// Source address.
    pub src: u64,
    /// Destination address.
    pub dst: u64,
    /// Bytes.
    pub len: u64,
}

/// What a plan moves, for logs and metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PlanStats {
    /// Segments, all phases (after merging).
    pub segments: usize,
    /// Pages before merging (planes times blocks).
    pub pages: usize,
    /// Bytes moved, all phases (a staged chunk's bytes count twice).
    pub bytes: u64,
    /// Phases.
    pub phases: usize,
}

/// A job's copies: phases run one after the other; a phase's segments in any order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CopyPlan {
    direction: Direction,
    phases: Vec<Vec<Segment>>,
    pages: usize,
    host_phase: Option<usize>,
}

/// Segments of one phase, each merged into the one before when both sides run on.
#[derive(Default)]
struct PhaseBuilder(Vec<Segment>);

impl PhaseBuilder {
    fn push(&mut self, src: u64, dst: u64, len: u64) {
        if let Some(last) = self.0.last_mut()
            && last.src + last.len == src
            && last.dst + last.len == dst
        {
            last.len += len;
            return;
        }
        self.0.push(Segment { src, dst, len });
    }
}

impl CopyPlan {
    /// Plans `job` over `planes`, checking it first (see [`PlanError`]): every address the
    /// plan touches on the engine's side lies in a plane's pages; the host side is the
    /// job's chunks and staged copies, as long as the job says they are.
    pub fn build(planes: &KvPlanes, job: &JobSpec<'_>) -> Result<Self, PlanError> {
        let page = planes.page_bytes;
        let n_planes = planes.planes.len();
        if job.block_bytes != planes.block_bytes() {
            return Err(PlanError::BlockBytes {
                got: job.block_bytes,
                planes: n_planes,
                page_bytes: page,
            });
        }
        let chunks = job.chunk_ptrs.len();
        if job.chunk_blocks.len() != chunks {
            return Err(PlanError::ChunkCount {
                what: "block counts",
                got: job.chunk_blocks.len(),
                chunks,
            });
        }
        if !job.check_copy_ptrs.is_empty() && job.check_copy_ptrs.len() != chunks {
            return Err(PlanError::ChunkCount {
                what: "staged copies",
                got: job.check_copy_ptrs.len(),
                chunks,
            });
        }
        let blocks = job
            .chunk_blocks
            .iter()
            .try_fold(0usize, |sum, &b| sum.checked_add(b))
            .ok_or(PlanError::Overflow)?;
        if job.skip_blocks > 0 {
            if job.direction == Direction::Save {
                return Err(PlanError::Skip(
                    "a save starts at a chunk's first block".into(),
                ));
            }
            if job
                .chunk_blocks
                .first()
                .is_none_or(|&b| job.skip_blocks >= b)
            {
                return Err(PlanError::Skip(format!(
                    "{} blocks skipped of a first chunk of {:?}",
                    job.skip_blocks,
                    job.chunk_blocks.first()
                )));
            }
        }
        if job.block_ids.len() + job.skip_blocks != blocks {
            return Err(PlanError::BlockCount {
                got: job.block_ids.len(),
                blocks,
                skip: job.skip_blocks,
            });
        }
        for (c, (&ptr, &bpc)) in job.chunk_ptrs.iter().zip(job.chunk_blocks).enumerate() {
            if ptr == 0 || bpc == 0 {
                return Err(PlanError::Chunk(c));
            }
            let len = (bpc as u64)
                .checked_mul(job.block_bytes)
                .ok_or(PlanError::Overflow)?;
            ptr.checked_add(len).ok_or(PlanError::Overflow)?;
            if let Some(&buffer) = job.check_copy_ptrs.get(c)
                && buffer != 0
            {
                buffer.checked_add(len).ok_or(PlanError::Overflow)?;
            }
        }
        for &id in job.block_ids {
            if u64::from(id) >= planes.num_blocks {
                return Err(PlanError::BlockOutOfRange {
                    block: id,
                    num_blocks: planes.num_blocks,
                });
            }
        }
        if job.direction == Direction::Load {
            let mut seen = HashSet::with_capacity(job.block_ids.len());
            if let Some(&dup) = job.block_ids.iter().find(|&&id| !seen.insert(id)) {
                return Err(PlanError::DuplicateBlock(dup));
            }
        }
        let staged = |c: usize| job.check_copy_ptrs.get(c).copied().filter(|&p| p != 0);
        // A load's staging: each staged chunk into its buffer (host to host).
        let mut staging = PhaseBuilder::default();
        if job.direction == Direction::Load {
            for (c, (&ptr, &bpc)) in job.chunk_ptrs.iter().zip(job.chunk_blocks).enumerate() {
                if let Some(buffer) = staged(c) {
                    staging.push(ptr, buffer, bpc as u64 * job.block_bytes);
                }
            }
        }
        // The pages' copies; a save's staged chunk gets each page twice (place and buffer).
        let mut pages = PhaseBuilder::default();
        let mut copies = PhaseBuilder::default();
        let mut n_pages = 0;
        for plane in 0..n_planes {
            let mut first = 0;
            for (c, (&ptr, &bpc)) in job.chunk_ptrs.iter().zip(job.chunk_blocks).enumerate() {
                let skip = if c == 0 { job.skip_blocks } else { 0 };
                let ids = &job.block_ids[first..first + bpc - skip];
                first += bpc - skip;
                for (j, &id) in (skip..bpc).zip(ids) {
                    let offset = ((plane * bpc + j) as u64) * page;
                    let engine_page = planes.page(plane, id);
                    match job.direction {
                        Direction::Load => {
                            let host = staged(c).unwrap_or(ptr);
                            pages.push(host + offset, engine_page, page);
                        }
                        Direction::Save => {
                            pages.push(engine_page, ptr + offset, page);
                            if let Some(buffer) = staged(c) {
                                copies.push(engine_page, buffer + offset, page);
                            }
                        }
                    }
                    n_pages += 1;
                }
            }
        }
        let mut page_phase = pages.0;
        page_phase.extend(copies.0);
        let phases = match job.direction {
            Direction::Load => vec![staging.0, page_phase],
            Direction::Save => vec![page_phase],
        };
        let phases: Vec<Vec<Segment>> = phases.into_iter().filter(|p| !p.is_empty()).collect();
        let host_phase = (job.direction == Direction::Load && phases.len() == 2).then_some(0);
        Ok(CopyPlan {
            direction: job.direction,
            phases,
            pages: n_pages,
            host_phase,
        })
    }

    /// Which way the plan copies.
    pub fn direction(&self) -> Direction {
        self.direction
    }

    /// The phases, in the order they must run.
    pub fn phases(&self) -> &[Vec<Segment>] {
        &self.phases
    }

    /// The phase that copies the engine's pages, and whether each of its segments' host side
    /// is its source (a load) rather than its destination (a save).
    pub fn page_phase(&self) -> Option<(usize, bool)> {
        if self.pages == 0 {
            return None;
        }
        Some(match self.direction {
            Direction::Load => (self.phases.len() - 1, true),
            Direction::Save => (0, false),
        })
    }

    /// The phase that copies host memory to host memory (a load's staged chunks into their
    /// buffers), if any: the CUDA engine runs it with memcpy before it queues the rest (CUDA
    /// would run such a copy synchronously with the host, after the stream's earlier work).
    pub fn host_phase(&self) -> Option<usize> {
        self.host_phase
    }

    /// What the plan moves.
    pub fn stats(&self) -> PlanStats {
        PlanStats {
            segments: self.phases.iter().map(Vec::len).sum(),
            pages: self.pages,
            bytes: self.phases.iter().flatten().map(|s| s.len).sum(),
            phases: self.phases.len(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn planes(n: usize, page: u64, stride: u64, blocks: u64) -> KvPlanes {
        let planes = (0..n as u64)
            .map(|i| Plane {
                base: 0x1000_0000 * (i + 1),
                row_stride: stride,
            })
            .collect();
        KvPlanes::new(planes, page, blocks).unwrap()
    }

    fn job<'a>(
        direction: Direction,
        ids: &'a [u32],
        chunk_blocks: &'a [usize],
        ptrs: &'a [u64],
        block_bytes: u64,
    ) -> JobSpec<'a> {
        JobSpec {
            direction,
            block_ids: ids,
            skip_blocks: 0,
            chunk_blocks,
            block_bytes,
            chunk_ptrs: ptrs,
            check_copy_ptrs: &[],
        }
    }

    #[test]
    fn consecutive_blocks_of_compact_planes_merge_into_one_segment_per_plane_and_chunk() {
        let kv = planes(2, 64, 64, 100);
        let ids = [10, 11, 12, 13];
        let plan =
            CopyPlan::build(&kv, &job(Direction::Save, &ids, &[4], &[0x9000_0000], 128)).unwrap();
        assert_eq!(
            plan.phases(),
            &[vec![
                Segment {
                    src: 0x1000_0000 + 640,
                    dst: 0x9000_0000,
                    len: 256
                },
                Segment {
                    src: 0x2000_0000 + 640,
                    dst: 0x9000_0000 + 256,
                    len: 256
                },
            ]]
        );
        assert_eq!(plan.stats().pages, 8);
        assert_eq!(plan.stats().bytes, 512);
    }

    #[test]
    fn padded_rows_and_scattered_blocks_stay_one_segment_per_page() {
        let kv = planes(1, 64, 96, 100);
        let ids = [10, 11];
        let plan =
            CopyPlan::build(&kv, &job(Direction::Load, &ids, &[2], &[0x9000_0000], 64)).unwrap();
        assert_eq!(plan.stats().segments, 2);
        let kv = planes(1, 64, 64, 100);
        let ids = [10, 12];
        let plan =
            CopyPlan::build(&kv, &job(Direction::Load, &ids, &[2], &[0x9000_0000], 64)).unwrap();
        assert_eq!(plan.stats().segments, 2);
    }

    #[test]
    fn a_load_skips_the_blocks_the_engine_holds() {
        let kv = planes(1, 64, 64, 100);
        let ids = [7, 9];
        let mut j = job(Direction::Load, &ids, &[3], &[0x9000_0000], 64);
        j.skip_blocks = 1;
        let plan = CopyPlan::build(&kv, &j).unwrap();
        assert_eq!(
            plan.phases()[0],
            vec![
                Segment {
                    src: 0x9000_0000 + 64,
                    dst: 0x1000_0000 + 7 * 64,
                    len: 64
                },
                Segment {
                    src: 0x9000_0000 + 128,
                    dst: 0x1000_0000 + 9 * 64,
                    len: 64
                },
            ]
        );
    }

    #[test]
    fn staged_chunks_pass_through_their_buffers_in_a_phase_of_their_own() {
        let kv = planes(1, 64, 64, 100);
        let ids = [1, 2, 5];
        let ptrs = [0x9000_0000, 0xa000_0000];
        let checks = [0xb000_0000, 0];
        let mut j = job(Direction::Load, &ids, &[2, 1], &ptrs, 64);
        j.check_copy_ptrs = &checks;
        let plan = CopyPlan::build(&kv, &j).unwrap();
        assert_eq!(plan.phases().len(), 2);
        assert_eq!(
            plan.phases()[0],
            vec![Segment {
                src: 0x9000_0000,
                dst: 0xb000_0000,
                len: 128
            }]
        );
        // The staged chunk's blocks come from the buffer, the other chunk's from its place.
        assert_eq!(plan.phases()[1][0].src, 0xb000_0000);
        assert_eq!(plan.phases()[1][1].src, 0xa000_0000);
        assert_eq!(plan.host_phase(), Some(0));
        // A save: one phase, each page of the staged chunk to its place and to its buffer.
        j.direction = Direction::Save;
        let plan = CopyPlan::build(&kv, &j).unwrap();
        assert_eq!(plan.phases().len(), 1);
        assert_eq!(plan.host_phase(), None);
        let dsts: Vec<u64> = plan.phases()[0].iter().map(|s| s.dst).collect();
        assert!(
            dsts.contains(&0x9000_0000) && dsts.contains(&0xb000_0000),
            "{dsts:x?}"
        );
        assert!(dsts.contains(&0xa000_0000));
        assert_eq!(plan.stats().bytes, 3 * 64 + 2 * 64);
    }

    #[test]
    fn faults_in_a_job_are_refused() {
        let kv = planes(2, 64, 64, 16);
        let ptrs = [0x9000_0000];
        let bad = |j: JobSpec<'_>| CopyPlan::build(&kv, &j).unwrap_err();
        assert!(matches!(
            bad(job(Direction::Load, &[1, 2], &[2], &ptrs, 64)),
            PlanError::BlockBytes { .. }
        ));
        assert!(matches!(
            bad(job(Direction::Load, &[1], &[2], &ptrs, 128)),
            PlanError::BlockCount { .. }
        ));
        assert!(matches!(
            bad(job(Direction::Load, &[1, 16], &[2], &ptrs, 128)),
            PlanError::BlockOutOfRange { block: 16, .. }
        ));
        assert!(matches!(
            bad(job(Direction::Load, &[3, 3], &[2], &ptrs, 128)),
            PlanError::DuplicateBlock(3)
        ));
        // A save may read one block twice.
        CopyPlan::build(&kv, &job(Direction::Save, &[3, 3], &[2], &ptrs, 128)).unwrap();
        assert!(matches!(
            bad(job(Direction::Load, &[1, 2], &[2], &[0], 128)),
            PlanError::Chunk(0)
        ));
        assert!(matches!(
            bad(job(Direction::Load, &[1, 2], &[2, 0], &ptrs, 128)),
            PlanError::ChunkCount { .. }
        ));
        let mut j = job(Direction::Save, &[2], &[2], &ptrs, 128);
        j.skip_blocks = 1;
        assert!(matches!(bad(j), PlanError::Skip(_)));
        let mut j = job(Direction::Load, &[], &[2], &ptrs, 128);
        j.skip_blocks = 2;
        assert!(matches!(bad(j), PlanError::Skip(_)));
        let mut j = job(Direction::Load, &[1, 2], &[2], &ptrs, 128);
        j.check_copy_ptrs = &[1, 2];
        assert!(matches!(bad(j), PlanError::ChunkCount { .. }));
        assert!(matches!(
            bad(job(Direction::Load, &[1, 2], &[2], &[u64::MAX - 10], 128)),
            PlanError::Overflow
        ));
    }

    #[test]
    fn planes_whose_pages_overlap_are_refused_and_interleaved_ones_taken() {
        let p = |base, row_stride| Plane { base, row_stride };
        // Overlapping extents, one stride, pages colliding.
        assert!(KvPlanes::new(vec![p(4096, 128), p(4096 + 64, 128)], 96, 8).is_err());
        // Interleaved: the second plane's pages fill the first's gaps.
        KvPlanes::new(vec![p(4096, 128), p(4096 + 64, 128)], 64, 8).unwrap();
        // Other strides over the same memory.
        assert!(KvPlanes::new(vec![p(4096, 128), p(4096, 256)], 64, 8).is_err());
        // Disjoint.
        KvPlanes::new(vec![p(4096, 64), p(4096 + 8 * 64, 64)], 64, 8).unwrap();
    }

    #[test]
    fn planes_that_cannot_hold_their_pages_are_refused() {
        let p = |base, row_stride| Plane { base, row_stride };
        assert!(KvPlanes::new(vec![], 64, 4).is_err());
        assert!(KvPlanes::new(vec![p(0, 64)], 64, 4).is_err());
        assert!(KvPlanes::new(vec![p(4096, 32)], 64, 4).is_err());
        assert!(KvPlanes::new(vec![p(u64::MAX - 100, 64)], 64, 4).is_err());
        assert!(KvPlanes::new(vec![p(4096, 64)], 0, 4).is_err());
        assert_eq!(
            KvPlanes::new(vec![p(4096, 64), p(8192, 64)], 64, 4)
                .unwrap()
                .block_bytes(),
            128
        );
    }
}
