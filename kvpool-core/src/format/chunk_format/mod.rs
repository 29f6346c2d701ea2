//! The stored chunk format: a versioned, checksummed header, then the (optionally zstd) payload.
//!
//! ```text
//! offset size field
//!  0      4   magic "KVPC"
//!  4      2   format version (u16 LE), currently 2
//!  6      1   checksum algorithm (1 = xxh3-64, 2 = crc32c)
//!  7      1   compression (0 = none, 1 = zstd)
//!  8      8   KV layout fingerprint (u64 LE)
//! 16      4   token count (u32 LE)
//! 20      1   dtype code
//! 21      3   reserved, zero
//! 24      8   payload length as stored (u64 LE)
//! 32      8   raw (decoded) payload length (u64 LE)
//! 40     16   the chunk hash of the key it was stored under
//! 56      8   the digest of that key's scope (model, ranks, layout; `KeyScope::digest`)
//! 64      8   checksum over bytes 0..64 and the stored payload (u64 LE)
//! 72      …   payload
//! ```
//! Decoding checks every field, the length and the checksum before it allocates or hands out a
//! byte, so a truncated, oversized or corrupt value is a typed [`FormatError`], never data.
//! [`decode_copied`], for values in memory another process can write, checks the checksum on
//! its one copy instead, so it allocates that copy's buffer first (bounded the same way);
//! [`check_before_copy`] and [`CopyCheck::verify`] split the same checks around a copy the
//! caller makes (into an engine's blocks), the checksum checked on the copy. The
//! value is bound to its key: read under any other key, it is [`FormatError::KeyMismatch`].
//! Version 1 values (without the binding) are [`FormatError::UnsupportedVersion`]: misses.

use serde::{Deserialize, Serialize};

use crate::error::FormatError;
use crate::layout::Dtype;

mod checksum;
mod in_place;
pub use checksum::ChecksumAlgorithm;
use checksum::{copy_verifying_checksum, verify_checksum};
pub use in_place::{CopyCheck, check_before_copy, decode_copied};

/// Magic bytes opening every chunk.
pub const MAGIC: [u8; 4] = *b"KVPC";
/// Format version written by this build.
pub const FORMAT_VERSION: u16 = 2;
/// Header size in bytes.
pub const HEADER_LEN: usize = 72;
const CHECKED_HEADER_LEN: usize = 64;

/// The key a value is stored under, as recorded in its header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct KeyBinding {
    /// The key's chunk hash.
    pub chunk_hash: [u8; 16],
    /// The digest of the key's scope.
    pub scope_digest: u64,
}

impl KeyBinding {
    /// The binding of `key`.
    pub fn of(key: &crate::keys::cache_key::CacheKey) -> Self {
        KeyBinding {
            chunk_hash: key.hash.0,
            scope_digest: key.scope.digest(),
        }
    }
}

/// Payload compression.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum Compression {
    /// Stored as is.
    #[default]
    None,
    /// zstd at the given level (1..=22; 1-3 are fast).
    Zstd {
        /// Compression level.
        level: i32,
    },
}

/// What a chunk holds, as recorded in its header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ChunkMeta {
    /// Fingerprint of the layout the bytes were written with.
    pub layout_fingerprint: u64,
    /// Element type.
    pub dtype: Dtype,
    /// Tokens in the chunk.
    pub token_count: u32,
}

/// A parsed, fully validated header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkHeader {
    /// Chunk metadata.
    pub meta: ChunkMeta,
    /// Checksum algorithm.
    pub checksum_algorithm: ChecksumAlgorithm,
    /// Compression used.
    pub compressed: bool,
    /// Stored payload length.
    pub payload_len: u64,
    /// Decoded payload length.
    pub raw_len: u64,
}

/// What the reader expects; anything else is rejected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeExpectation {
    /// Largest decoded payload accepted (bounds memory before allocating).
    pub max_raw_len: u64,
    /// Required layout fingerprint, if known.
    pub layout_fingerprint: Option<u64>,
    /// Bytes per token of that layout, if known; raw length must be tokens x this.
    pub bytes_per_token: Option<u64>,
    /// The key the value is read under, if known: the header must name it.
    pub key: Option<KeyBinding>,
}

impl DecodeExpectation {
    /// What a value read under `key` must be: a chunk bound to that key (its hash and scope),
    /// of its scope's layout, decoding to at most `max_raw_len` bytes. Every reader of a tier
    /// checks against this: a value stored under another key, or by an engine of another
    /// layout, is rejected rather than handed to a model.
    pub fn bound_to(key: &crate::keys::cache_key::CacheKey, max_raw_len: u64) -> Self {
        DecodeExpectation {
            max_raw_len,
            layout_fingerprint: Some(key.scope.layout_fingerprint),
            bytes_per_token: None,
            key: Some(KeyBinding::of(key)),
        }
    }
}

/// Encodes chunks with a chosen checksum and compression.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct ChunkCodec {
    /// Checksum algorithm.
    #[serde(default)]
    pub checksum: ChecksumAlgorithm,
    /// Compression.
    #[serde(default)]
    pub compression: Compression,
}

impl ChunkCodec {
    /// Encodes `payload` with its metadata into one stored value, bound to `key`.
    pub fn encode(&self, meta: &ChunkMeta, key: &KeyBinding, payload: &[u8]) -> Vec<u8> {
        let compressed;
        let (stored, code): (&[u8], u8) = match self.compression {
            Compression::None => (payload, 0),
            Compression::Zstd { level } => match zstd::bulk::compress(payload, level) {
                Ok(c) if c.len() < payload.len() => {
                    compressed = c;
                    (&compressed, 1)
                }
                // Incompressible (or a zstd failure): store raw, the header says so.
                _ => (payload, 0),
            },
        };
        let mut out = Vec::with_capacity(HEADER_LEN + stored.len());
        out.extend_from_slice(&self.header(meta, key, code, stored, payload.len()));
        out.extend_from_slice(stored);
        out
    }

    /// Whether this codec compresses (then a value's stored length is known only once it is
    /// encoded).
    pub fn compresses(&self) -> bool {
        !matches!(self.compression, Compression::None)
    }

    /// The length of `payload_len` bytes stored by this codec, when it is known before
    /// encoding: always for a codec that does not compress, never for one that does.
    pub fn stored_len_uncompressed(&self, payload_len: usize) -> Option<usize> {
        match self.compression {
            Compression::None => Some(HEADER_LEN + payload_len),
            Compression::Zstd { .. } => None,
        }
    }

    /// Encodes `payload` uncompressed straight into `dst`, which must be
    /// [`HEADER_LEN`] + `payload.len()` bytes (for a store that lends the memory a value is
    /// written to, such as the pool daemon's arena: one copy). The checksum is computed from
    /// `payload`, so what another process does to `dst` meanwhile is caught on decoding.
    pub fn encode_uncompressed_into(
        &self,
        meta: &ChunkMeta,
        key: &KeyBinding,
        payload: &[u8],
        dst: &mut [u8],
    ) -> Result<(), FormatError> {
        if dst.len() != HEADER_LEN + payload.len() {
            return Err(FormatError::Destination {
                expected: HEADER_LEN + payload.len(),
                actual: dst.len(),
            });
        }
        let (head, rest) = dst.split_at_mut(HEADER_LEN);
        head.copy_from_slice(&self.header(meta, key, 0, payload, payload.len()));
        rest.copy_from_slice(payload);
        Ok(())
    }

    /// The header of an uncompressed value whose payload is `pieces`, in payload order (for a
    /// payload written where the value will lie, and hashed from memory no other process
    /// writes: the engine's blocks the payload was copied from). Fails unless the pieces add up
    /// to `payload_len` bytes.
    pub fn uncompressed_header_over<'a>(
        &self,
        meta: &ChunkMeta,
        key: &KeyBinding,
        payload_len: usize,
        pieces: impl IntoIterator<Item = &'a [u8]>,
    ) -> Result<[u8; HEADER_LEN], FormatError> {
        let mut len = 0;
        let pieces = pieces.into_iter().inspect(|p| len += p.len());
        let head = self.header_over(meta, key, 0, payload_len, payload_len, pieces);
        if len != payload_len {
            return Err(FormatError::Destination {
                expected: payload_len,
                actual: len,
            });
        }
        Ok(head)
    }

    /// The header of a value whose stored payload is `stored` (compressed when `code` is 1)
    /// and decodes to `raw_len` bytes, its checksum included.
    fn header(
        &self,
        meta: &ChunkMeta,
        key: &KeyBinding,
        code: u8,
        stored: &[u8],
        raw_len: usize,
    ) -> [u8; HEADER_LEN] {
        self.header_over(meta, key, code, stored.len(), raw_len, [stored])
    }

    /// [`ChunkCodec::header`] with the stored payload given as `pieces` of `stored_len` bytes
    /// in all.
    fn header_over<'a>(
        &self,
        meta: &ChunkMeta,
        key: &KeyBinding,
        code: u8,
        stored_len: usize,
        raw_len: usize,
        pieces: impl IntoIterator<Item = &'a [u8]>,
    ) -> [u8; HEADER_LEN] {
        let mut h = [0u8; HEADER_LEN];
        h[0..4].copy_from_slice(&MAGIC);
        h[4..6].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
        h[6] = self.checksum.code();
        h[7] = code;
        h[8..16].copy_from_slice(&meta.layout_fingerprint.to_le_bytes());
        h[16..20].copy_from_slice(&meta.token_count.to_le_bytes());
        h[20] = meta.dtype.code();
        // 21..24: reserved, zero.
        h[24..32].copy_from_slice(&(stored_len as u64).to_le_bytes());
        h[32..40].copy_from_slice(&(raw_len as u64).to_le_bytes());
        h[40..56].copy_from_slice(&key.chunk_hash);
        h[56..64].copy_from_slice(&key.scope_digest.to_le_bytes());
        let sum = self.checksum.compute_over(&h[..CHECKED_HEADER_LEN], pieces);
        h[64..72].copy_from_slice(&sum.to_le_bytes());
        h
    }
}

/// The longest stored value a chunk of at most `max_raw_len` decoded bytes can be: the header
/// plus the payload, compressed or not (zstd's worst case). Stores use it to refuse reading a
/// value that cannot be a chunk before transferring it.
pub fn max_stored_len(max_raw_len: u64) -> u64 {
    let raw = usize::try_from(max_raw_len).unwrap_or(usize::MAX);
    let compressed = zstd::zstd_safe::compress_bound(raw) as u64;
    HEADER_LEN as u64 + max_raw_len.max(compressed)
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// Parses and validates a stored value's header, length, checksum and expectations.
///
/// Reads no more than it was given and allocates nothing.
pub fn decode_header(bytes: &[u8], expect: &DecodeExpectation) -> Result<ChunkHeader, FormatError> {
    let head = header_bytes(bytes)?;
    let fields = parse_fields(head, bytes.len() - HEADER_LEN, expect)?;
    verify_checksum(head, &fields, &bytes[HEADER_LEN..])?;
    check_binding(head, fields, expect)
}

/// The header of a stored value, which must be at least that long.
fn header_bytes(bytes: &[u8]) -> Result<&[u8; HEADER_LEN], FormatError> {
    bytes
        .get(..HEADER_LEN)
        .and_then(|h| h.try_into().ok())
        .ok_or(FormatError::TruncatedHeader {
            len: bytes.len(),
            needed: HEADER_LEN,
        })
}

/// The header's fields the checksum is computed with, checked against the stored payload's
/// length (`stored_len`) and the reader's bound, before the checksum vouches for them.
struct HeaderFields {
    checksum_algorithm: ChecksumAlgorithm,
    compressed: bool,
    payload_len: u64,
    raw_len: u64,
}

fn parse_fields(
    head: &[u8; HEADER_LEN],
    stored_len: usize,
    expect: &DecodeExpectation,
) -> Result<HeaderFields, FormatError> {
    let magic: [u8; 4] = head[0..4].try_into().expect("4 bytes");
    if magic != MAGIC {
        return Err(FormatError::BadMagic(magic));
    }
    let version = u16::from_le_bytes([head[4], head[5]]);
    if version != FORMAT_VERSION {
        return Err(FormatError::UnsupportedVersion(version, FORMAT_VERSION));
    }
    let checksum_algorithm =
        ChecksumAlgorithm::from_code(head[6]).ok_or(FormatError::UnknownField {
            field: "checksum",
            value: u64::from(head[6]),
        })?;
    let compressed = match head[7] {
        0 => false,
        1 => true,
        v => {
            return Err(FormatError::UnknownField {
                field: "compression",
                value: u64::from(v),
            });
        }
    };
    if head[21..24] != [0, 0, 0] {
        return Err(FormatError::UnknownField {
            field: "reserved",
            value: u64::from(u32::from_le_bytes([head[21], head[22], head[23], 0])),
        });
    }
    let payload_len = u64_at(head, 24);
    let actual = stored_len as u64;
    if payload_len != actual {
        return Err(FormatError::PayloadLength {
            expected: payload_len,
            actual,
        });
    }
    let raw_len = u64_at(head, 32);
    if raw_len > expect.max_raw_len {
        return Err(FormatError::TooLarge {
            size: raw_len,
            limit: expect.max_raw_len,
        });
    }
    if !compressed && raw_len != payload_len {
        return Err(FormatError::PayloadLength {
            expected: raw_len,
            actual: payload_len,
        });
    }
    Ok(HeaderFields {
        checksum_algorithm,
        compressed,
        payload_len,
        raw_len,
    })
}

/// The checks that follow the checksum, which vouches for the header from then on: the key
/// the value is bound to, the layout, the dtype and the size per token.
fn check_binding(
    head: &[u8; HEADER_LEN],
    fields: HeaderFields,
    expect: &DecodeExpectation,
) -> Result<ChunkHeader, FormatError> {
    let HeaderFields {
        checksum_algorithm,
        compressed,
        payload_len,
        raw_len,
    } = fields;
    check_key_and_layout(head, expect)?;
    let token_count = u32::from_le_bytes(head[16..20].try_into().expect("4 bytes"));
    let dtype = Dtype::from_code(head[20]).ok_or(FormatError::UnknownField {
        field: "dtype",
        value: u64::from(head[20]),
    })?;
    if let Some(bpt) = expect.bytes_per_token {
        let needed = u64::from(token_count) * bpt;
        if needed != raw_len {
            return Err(FormatError::SizeMismatch {
                raw_len,
                tokens: token_count,
                expected: needed,
            });
        }
    }
    Ok(ChunkHeader {
        meta: ChunkMeta {
            layout_fingerprint: u64_at(head, 8),
            dtype,
            token_count,
        },
        checksum_algorithm,
        compressed,
        payload_len,
        raw_len,
    })
}

/// The key the header names and its layout, against what the reader expects.
fn check_key_and_layout(
    head: &[u8; HEADER_LEN],
    expect: &DecodeExpectation,
) -> Result<(), FormatError> {
    let found = KeyBinding {
        chunk_hash: head[40..56].try_into().expect("16 bytes"),
        scope_digest: u64_at(head, 56),
    };
    if let Some(expected) = expect.key
        && expected != found
    {
        let hex = |h: &[u8; 16]| h.iter().map(|b| format!("{b:02x}")).collect::<String>();
        return Err(FormatError::KeyMismatch {
            expected_hash: hex(&expected.chunk_hash),
            expected_scope: expected.scope_digest,
            found_hash: hex(&found.chunk_hash),
            found_scope: found.scope_digest,
        });
    }
    let layout_fingerprint = u64_at(head, 8);
    if let Some(expected) = expect.layout_fingerprint
        && expected != layout_fingerprint
    {
        return Err(FormatError::LayoutMismatch {
            expected,
            found: layout_fingerprint,
        });
    }
    Ok(())
}

/// Writes the decoded payload of an already validated value into `dst`, which must be exactly
/// `header.raw_len` bytes.
pub fn decode_payload_into(
    bytes: &[u8],
    header: &ChunkHeader,
    dst: &mut [u8],
) -> Result<(), FormatError> {
    if dst.len() as u64 != header.raw_len {
        return Err(FormatError::Destination {
            expected: header.raw_len as usize,
            actual: dst.len(),
        });
    }
    let payload = bytes
        .get(HEADER_LEN..)
        .filter(|p| p.len() as u64 == header.payload_len)
        .ok_or(FormatError::PayloadLength {
            expected: header.payload_len,
            actual: bytes.len().saturating_sub(HEADER_LEN) as u64,
        })?;
    if !header.compressed {
        dst.copy_from_slice(payload);
        return Ok(());
    }
    let written = zstd::bulk::decompress_to_buffer(payload, dst)
        .map_err(|e| FormatError::Decompress(e.to_string()))?;
    if written as u64 != header.raw_len {
        return Err(FormatError::Decompress(format!(
            "produced {written} bytes, header says {}",
            header.raw_len
        )));
    }
    Ok(())
}

/// Validates and decodes a value into a fresh `Vec` (convenience over the two-step API).
pub fn decode_to_vec(
    bytes: &[u8],
    expect: &DecodeExpectation,
) -> Result<(ChunkMeta, Vec<u8>), FormatError> {
    let header = decode_header(bytes, expect)?;
    let mut out = vec![0u8; header.raw_len as usize];
    decode_payload_into(bytes, &header, &mut out)?;
    Ok((header.meta, out))
}

#[cfg(test)]
mod tests;
