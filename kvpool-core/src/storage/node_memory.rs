//! Chunks lent where they lie in memory on this node that another process can write (the pool
//! daemon's arena): pinned by the tier, copied once by the reader, checked on the copy.

use std::fmt;
use std::time::Instant;

use crate::error::FormatError;
use crate::format::ChunkMeta;
use crate::format::chunk_format::CopyCheck;

/// Bytes a tier lends where they lie in node memory ([`crate::NodeMemoryConnector::batch_pin`]):
/// mapped and pinned by the tier until this is dropped. Another process can still write them
/// (a misbehaving engine, or a pin the tier reclaimed), so a reader never trusts what it reads
/// here: it checks its own copy ([`SharedChunk`]).
pub struct PinnedBytes {
    ptr: usize,
    len: usize,
    usable_until: Instant,
    _pin: Box<dyn Send + Sync>,
}

impl PinnedBytes {
    /// Bytes at `ptr..ptr + len`, lent until `usable_until` (after that the tier may have
    /// reclaimed them, and the reader touches nothing); `pin` releases them when dropped.
    ///
    /// # Safety
    ///
    /// `ptr..ptr + len` must stay mapped and readable for as long as `pin` lives.
    pub unsafe fn new(
        ptr: *const u8,
        len: usize,
        usable_until: Instant,
        pin: Box<dyn Send + Sync>,
    ) -> Self {
        PinnedBytes {
            ptr: ptr as usize,
            len,
            usable_until,
            _pin: pin,
        }
    }

    /// Whether the lender still promises the bytes (a reader touches nothing otherwise).
    pub fn usable(&self) -> bool {
        Instant::now() < self.usable_until
    }

    /// The bytes, as another process may be changing them: read them only to copy them (or,
    /// while [`PinnedBytes::usable`], to digest a value that failed its checks).
    pub(crate) fn bytes(&self) -> &[u8] {
        // SAFETY: `new`'s caller promised the range stays mapped while the pin (a field of
        // self) lives.
        unsafe { std::slice::from_raw_parts(self.ptr as *const u8, self.len) }
    }
}

impl fmt::Debug for PinnedBytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PinnedBytes")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .finish()
    }
}

/// A chunk a tier lends where it lies: pinned, its header copied and checked (key, layout,
/// lengths), its payload not yet. The reader copies the payload once, wherever it needs it (an
/// engine's KV blocks), and then [verifies](SharedChunk::verify_copy) the copy against the
/// header's checksum; until that passes, the copy is not KV.
#[derive(Debug)]
pub struct SharedChunk {
    /// What the header says the chunk holds (vouched for once a copy verifies).
    pub meta: ChunkMeta,
    bytes: PinnedBytes,
    check: CopyCheck,
}

impl SharedChunk {
    /// A chunk over `bytes` (the whole stored value), whose header passed
    /// [`crate::format::chunk_format::check_before_copy`] as `meta` and `check`.
    pub fn new(meta: ChunkMeta, bytes: PinnedBytes, check: CopyCheck) -> Self {
        SharedChunk { meta, bytes, check }
    }

    /// Address of the payload (the chunk's KV bytes), to copy from while this lives.
    pub fn payload_ptr(&self) -> usize {
        self.bytes.ptr + crate::format::chunk_format::HEADER_LEN
    }

    /// Length of the payload.
    pub fn payload_len(&self) -> usize {
        self.check.payload_len()
    }

    /// Whether the lender still promises the bytes; a chunk past it is not copied.
    pub fn usable(&self) -> bool {
        self.bytes.usable()
    }

    /// Checks a copy of the payload, given as `pieces` in payload order, against the
    /// checksum in the header copied before it. The copy must be memory no other process
    /// writes.
    pub fn verify_copy<'a>(
        &self,
        pieces: impl IntoIterator<Item = &'a [u8]>,
    ) -> Result<(), FormatError> {
        self.check.verify(pieces)
    }

    /// Copies the payload into `dst` (exactly its length) and verifies the copy: for a
    /// reader that needs the chunk in its own buffer.
    pub fn copy_into(&self, dst: &mut [u8]) -> Result<(), FormatError> {
        let payload = &self.bytes.bytes()[crate::format::chunk_format::HEADER_LEN..];
        if dst.len() != payload.len() {
            return Err(FormatError::Destination {
                expected: payload.len(),
                actual: dst.len(),
            });
        }
        dst.copy_from_slice(payload);
        self.verify_copy([&*dst])
    }
}

/// Reads the header of a value lent where it lies (`bytes`) as `check_before_copy` does; a
/// value that fails is handed back with the error, for the caller to say what it read.
pub(crate) fn shared_chunk(
    bytes: PinnedBytes,
    expect: &crate::format::chunk_format::DecodeExpectation,
) -> Result<SharedChunk, (FormatError, PinnedBytes)> {
    match crate::format::chunk_format::check_before_copy(bytes.bytes(), expect) {
        Ok((header, check)) => Ok(SharedChunk::new(header.meta, bytes, check)),
        Err(error) => Err((error, bytes)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::chunk_format::{ChunkCodec, DecodeExpectation, KeyBinding};
    use crate::layout::Dtype;

    fn stored(payload: &[u8]) -> (Vec<u8>, DecodeExpectation) {
        let meta = ChunkMeta {
            layout_fingerprint: 7,
            dtype: Dtype::F32,
            token_count: 2,
        };
        let key = KeyBinding {
            chunk_hash: [3; 16],
            scope_digest: 9,
        };
        let value = ChunkCodec::default().encode(&meta, &key, payload);
        let expect = DecodeExpectation {
            max_raw_len: 1 << 20,
            layout_fingerprint: Some(7),
            bytes_per_token: None,
            key: Some(key),
        };
        (value, expect)
    }

    fn lent(value: &[u8]) -> PinnedBytes {
        // SAFETY: the tests keep `value` alive longer than the PinnedBytes.
        unsafe {
            PinnedBytes::new(
                value.as_ptr(),
                value.len(),
                Instant::now() + std::time::Duration::from_secs(30),
                Box::new(()),
            )
        }
    }

    #[test]
    fn a_copy_scattered_in_pieces_verifies_and_a_changed_byte_does_not() {
        let payload: Vec<u8> = (0..64u8).collect();
        let (value, expect) = stored(&payload);
        let chunk = shared_chunk(lent(&value), &expect).unwrap();
        assert_eq!(chunk.payload_len(), 64);
        assert_eq!(chunk.meta.token_count, 2);
        // The copy as an engine's blocks hold it: in pieces, in payload order.
        let mut copy = payload.clone();
        assert!(
            chunk
                .verify_copy([&copy[..10], &copy[10..40], &copy[40..]])
                .is_ok()
        );
        copy[33] ^= 1;
        assert!(matches!(
            chunk.verify_copy([&copy[..10], &copy[10..40], &copy[40..]]),
            Err(FormatError::Checksum { .. })
        ));
        // A copy with a piece missing is refused, whatever its bytes.
        assert!(matches!(
            chunk.verify_copy([&payload[..40]]),
            Err(FormatError::Destination { .. })
        ));
        let mut own = vec![0u8; 64];
        chunk.copy_into(&mut own).unwrap();
        assert_eq!(own, payload);
    }

    #[test]
    fn bytes_changed_after_the_header_was_read_fail_the_copy_check() {
        let payload = vec![5u8; 64];
        let (mut value, expect) = stored(&payload);
        let chunk = shared_chunk(lent(&value), &expect).unwrap();
        // Another process rewrites the payload between the header's check and the copy.
        let at = value.len() - 1;
        value[at] ^= 0xff;
        let mut own = vec![0u8; 64];
        assert!(matches!(
            chunk.copy_into(&mut own),
            Err(FormatError::Checksum { .. })
        ));
    }

    #[test]
    fn a_value_under_another_key_or_compressed_is_refused_before_any_copy() {
        let (value, mut expect) = stored(&[1u8; 64]);
        expect.key = Some(KeyBinding {
            chunk_hash: [4; 16],
            scope_digest: 9,
        });
        assert!(matches!(
            shared_chunk(lent(&value), &expect),
            Err((FormatError::KeyMismatch { .. }, _))
        ));
        let (_, expect) = stored(&[1u8; 64]);
        let zstd = ChunkCodec {
            compression: crate::Compression::Zstd { level: 1 },
            ..ChunkCodec::default()
        };
        let meta = ChunkMeta {
            layout_fingerprint: 7,
            dtype: Dtype::F32,
            token_count: 2,
        };
        let compressed = zstd.encode(&meta, &expect.key.unwrap(), &[1u8; 64]);
        assert!(matches!(
            shared_chunk(lent(&compressed), &expect),
            Err((FormatError::Compressed, _))
        ));
    }
}
