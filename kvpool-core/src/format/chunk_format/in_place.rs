//! Values read in memory another process can write while they are read (the pool daemon's
//! shared arena): every check is made on a private copy, never on the shared bytes.
//! [`decode_copied`] copies into the reader's buffer and checks there; [`check_before_copy`]
//! and [`CopyCheck::verify`] split the same checks around a copy the reader makes elsewhere
//! (into an engine's KV blocks), the checksum checked on that copy.

use super::{
    CHECKED_HEADER_LEN, ChecksumAlgorithm, ChunkHeader, DecodeExpectation, HEADER_LEN,
    check_binding, check_key_and_layout, copy_verifying_checksum, decode_header,
    decode_payload_into, header_bytes, parse_fields, u64_at,
};
use crate::error::FormatError;

/// Decodes a value that lies in memory another process can write while it is read (the pool
/// daemon's shared arena) with one copy: the header is copied first, then the payload straight
/// into the buffer `allocate` returns for its decoded length, and every check, the checksum
/// included, is made on those private copies. Bytes changed during the read therefore fail the
/// checksum instead of reaching a model. A compressed value is copied whole and then decoded
/// as [`decode_header`] and [`decode_payload_into`] do.
///
/// Unlike [`decode_header`], this allocates before the checksum is checked: a buffer of the
/// payload's own length (as long as the value read), no larger than `expect.max_raw_len`,
/// and only for a value whose header names the expected key and layout.
pub fn decode_copied<B: AsMut<[u8]>>(
    shared: &[u8],
    expect: &DecodeExpectation,
    allocate: impl FnOnce(usize) -> B,
) -> Result<(ChunkHeader, B), FormatError> {
    let head: [u8; HEADER_LEN] = *header_bytes(shared)?;
    let fields = parse_fields(&head, shared.len() - HEADER_LEN, expect)?;
    if fields.compressed {
        let private = shared.to_vec();
        let header = decode_header(&private, expect)?;
        let mut dst = allocate(header.raw_len as usize);
        decode_payload_into(&private, &header, dst.as_mut())?;
        return Ok((header, dst));
    }
    // Uncompressed: the payload is the decoded chunk (`parse_fields` checked the lengths). A
    // value under another key or layout is refused before its buffer is taken (which may evict
    // from L1); it would fail after the checksum anyway.
    check_key_and_layout(&head, expect)?;
    let mut dst = allocate(fields.raw_len as usize);
    let payload = dst.as_mut();
    if payload.len() != shared.len() - HEADER_LEN {
        return Err(FormatError::Destination {
            expected: shared.len() - HEADER_LEN,
            actual: payload.len(),
        });
    }
    copy_verifying_checksum(&head, &fields, &shared[HEADER_LEN..], payload)?;
    let header = check_binding(&head, fields, expect)?;
    Ok((header, dst))
}

/// What a value read where it lies must hash to once copied: its header (copied privately
/// before the copy) and the checksum it states. Made by [`check_before_copy`]; see
/// [`CopyCheck::verify`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopyCheck {
    head: [u8; HEADER_LEN],
    algorithm: ChecksumAlgorithm,
    payload_len: usize,
}

impl CopyCheck {
    /// Bytes of the payload the copy must hold.
    pub fn payload_len(&self) -> usize {
        self.payload_len
    }

    /// Checks the payload's copy, given as `pieces` in the payload's byte order (a chunk's
    /// blocks where the copy scattered them), against the checksum of the header copied
    /// before the copy. The copy must be memory no other process writes: what passes is what
    /// the copy holds, and nothing can change it afterwards.
    pub fn verify<'a>(
        &self,
        pieces: impl IntoIterator<Item = &'a [u8]>,
    ) -> Result<(), FormatError> {
        let mut len = 0;
        let pieces = pieces.into_iter().inspect(|p| len += p.len());
        let computed = self
            .algorithm
            .compute_over(&self.head[..CHECKED_HEADER_LEN], pieces);
        if len != self.payload_len {
            return Err(FormatError::Destination {
                expected: self.payload_len,
                actual: len,
            });
        }
        let stored = u64_at(&self.head, 64);
        if stored != computed {
            return Err(FormatError::Checksum { stored, computed });
        }
        Ok(())
    }
}

/// The checks a value in memory another process can write passes before it is copied where
/// it lies (one copy, straight into the engine's blocks): the header is copied privately and
/// checked (fields, length, key, layout, size per token), and the checksum is left to
/// [`CopyCheck::verify`] on the copy. Returns the header those checks vouch for once the
/// copy verifies; until then nothing of the value may be used. A compressed value cannot be
/// copied where it lies ([`FormatError::Compressed`]): read it with [`decode_copied`].
pub fn check_before_copy(
    shared: &[u8],
    expect: &DecodeExpectation,
) -> Result<(ChunkHeader, CopyCheck), FormatError> {
    let head: [u8; HEADER_LEN] = *header_bytes(shared)?;
    let fields = parse_fields(&head, shared.len() - HEADER_LEN, expect)?;
    if fields.compressed {
        return Err(FormatError::Compressed);
    }
    let algorithm = fields.checksum_algorithm;
    let header = check_binding(&head, fields, expect)?;
    let check = CopyCheck {
        head,
        algorithm,
        payload_len: shared.len() - HEADER_LEN,
    };
    Ok((header, check))
}
