//! The checksum a stored chunk carries: the algorithms, computing one over a value in
//! pieces, copying while hashing, and checking a value's stored checksum.

use std::hash::Hasher as _;

use serde::{Deserialize, Serialize};

use super::{CHECKED_HEADER_LEN, HEADER_LEN, HeaderFields, u64_at};
use crate::error::FormatError;

/// Checksum used for stored chunks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ChecksumAlgorithm {
    /// xxh3-64 (seed 0). Fast; the default.
    #[default]
    Xxh3,
    /// CRC-32C (hardware accelerated on x86 and ARM).
    Crc32c,
}

impl ChecksumAlgorithm {
    pub(super) fn code(self) -> u8 {
        match self {
            ChecksumAlgorithm::Xxh3 => 1,
            ChecksumAlgorithm::Crc32c => 2,
        }
    }

    pub(super) fn from_code(code: u8) -> Option<Self> {
        match code {
            1 => Some(ChecksumAlgorithm::Xxh3),
            2 => Some(ChecksumAlgorithm::Crc32c),
            _ => None,
        }
    }

    pub(super) fn compute(self, header: &[u8], payload: &[u8]) -> u64 {
        self.compute_over(header, [payload])
    }

    /// The checksum of `header` followed by `pieces`, as if they were one buffer.
    pub(super) fn compute_over<'a>(
        self,
        header: &[u8],
        pieces: impl IntoIterator<Item = &'a [u8]>,
    ) -> u64 {
        let mut running = RunningChecksum::new(self, header);
        pieces.into_iter().for_each(|p| running.update(p));
        running.finish()
    }

    /// Copies `src` into `dst` (of the same length) and returns the checksum of `header`
    /// followed by the bytes *copied*, hashing each piece of the copy while it is still in
    /// the CPU's cache: one pass over main memory instead of a copy and then a second pass
    /// to hash it.
    pub(super) fn copy_and_compute(self, header: &[u8], src: &[u8], dst: &mut [u8]) -> u64 {
        debug_assert_eq!(src.len(), dst.len());
        let mut running = RunningChecksum::new(self, header);
        for (from, to) in src
            .chunks(COPY_HASH_PIECE)
            .zip(dst.chunks_mut(COPY_HASH_PIECE))
        {
            to.copy_from_slice(from);
            running.update(to);
        }
        running.finish()
    }
}

/// Bytes copied, then hashed, at a time by [`ChecksumAlgorithm::copy_and_compute`]: well
/// inside a core's L2 cache, large enough that the copy runs at full speed.
const COPY_HASH_PIECE: usize = 64 * 1024;

/// A checksum fed piece by piece. XXH3 is twox-hash's, which picks its vector code (AVX2,
/// SSE2, NEON) by the CPU it runs on: the wheel is built for any x86-64, where a hash compiled
/// for the baseline runs at SSE2 speed, about as long as a copy of the same bytes.
enum RunningChecksum {
    Xxh3(Box<twox_hash::XxHash3_64>),
    Crc32c(u32),
}

impl RunningChecksum {
    fn new(algorithm: ChecksumAlgorithm, header: &[u8]) -> Self {
        match algorithm {
            ChecksumAlgorithm::Xxh3 => {
                let mut h = Box::new(twox_hash::XxHash3_64::new());
                h.write(header);
                RunningChecksum::Xxh3(h)
            }
            ChecksumAlgorithm::Crc32c => RunningChecksum::Crc32c(crc32c::crc32c(header)),
        }
    }

    fn update(&mut self, piece: &[u8]) {
        match self {
            RunningChecksum::Xxh3(h) => h.write(piece),
            RunningChecksum::Crc32c(crc) => *crc = crc32c::crc32c_append(*crc, piece),
        }
    }

    fn finish(self) -> u64 {
        match self {
            RunningChecksum::Xxh3(h) => h.finish(),
            RunningChecksum::Crc32c(crc) => u64::from(crc),
        }
    }
}

/// Copies the stored payload into `dst` and checks the checksum over the header's first
/// bytes and the copy (what the checksum vouches for is what `dst` holds), in one pass.
pub(super) fn copy_verifying_checksum(
    head: &[u8; HEADER_LEN],
    fields: &HeaderFields,
    stored_payload: &[u8],
    dst: &mut [u8],
) -> Result<(), FormatError> {
    let stored = u64_at(head, 64);
    let computed = fields.checksum_algorithm.copy_and_compute(
        &head[..CHECKED_HEADER_LEN],
        stored_payload,
        dst,
    );
    if stored != computed {
        return Err(FormatError::Checksum { stored, computed });
    }
    Ok(())
}

/// Checks the checksum over the header's first bytes and the stored payload.
pub(super) fn verify_checksum(
    head: &[u8; HEADER_LEN],
    fields: &HeaderFields,
    stored_payload: &[u8],
) -> Result<(), FormatError> {
    let stored = u64_at(head, 64);
    let computed = fields
        .checksum_algorithm
        .compute(&head[..CHECKED_HEADER_LEN], stored_payload);
    if stored != computed {
        return Err(FormatError::Checksum { stored, computed });
    }
    Ok(())
}
