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
//! byte, so a truncated, oversized or corrupt value is a typed [`FormatError`], never data. The
//! value is bound to its key: read under any other key, it is [`FormatError::KeyMismatch`].
//! Version 1 values (without the binding) are [`FormatError::UnsupportedVersion`]: misses.

use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::Xxh3;

use crate::error::FormatError;
use crate::layout::Dtype;

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
    fn code(self) -> u8 {
        match self {
            ChecksumAlgorithm::Xxh3 => 1,
            ChecksumAlgorithm::Crc32c => 2,
        }
    }

    fn from_code(code: u8) -> Option<Self> {
        match code {
            1 => Some(ChecksumAlgorithm::Xxh3),
            2 => Some(ChecksumAlgorithm::Crc32c),
            _ => None,
        }
    }

    fn compute(self, header: &[u8], payload: &[u8]) -> u64 {
        match self {
            ChecksumAlgorithm::Xxh3 => {
                let mut h = Xxh3::new();
                h.update(header);
                h.update(payload);
                h.digest()
            }
            ChecksumAlgorithm::Crc32c => {
                u64::from(crc32c::crc32c_append(crc32c::crc32c(header), payload))
            }
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
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        out.push(self.checksum.code());
        out.push(code);
        out.extend_from_slice(&meta.layout_fingerprint.to_le_bytes());
        out.extend_from_slice(&meta.token_count.to_le_bytes());
        out.push(meta.dtype.code());
        out.extend_from_slice(&[0, 0, 0]);
        out.extend_from_slice(&(stored.len() as u64).to_le_bytes());
        out.extend_from_slice(&(payload.len() as u64).to_le_bytes());
        out.extend_from_slice(&key.chunk_hash);
        out.extend_from_slice(&key.scope_digest.to_le_bytes());
        let sum = self.checksum.compute(&out[..CHECKED_HEADER_LEN], stored);
        out.extend_from_slice(&sum.to_le_bytes());
        out.extend_from_slice(stored);
        out
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
    if bytes.len() < HEADER_LEN {
        return Err(FormatError::TruncatedHeader {
            len: bytes.len(),
            needed: HEADER_LEN,
        });
    }
    let magic: [u8; 4] = bytes[0..4].try_into().expect("4 bytes");
    if magic != MAGIC {
        return Err(FormatError::BadMagic(magic));
    }
    let version = u16::from_le_bytes([bytes[4], bytes[5]]);
    if version != FORMAT_VERSION {
        return Err(FormatError::UnsupportedVersion(version, FORMAT_VERSION));
    }
    let checksum_algorithm =
        ChecksumAlgorithm::from_code(bytes[6]).ok_or(FormatError::UnknownField {
            field: "checksum",
            value: u64::from(bytes[6]),
        })?;
    let compressed = match bytes[7] {
        0 => false,
        1 => true,
        v => {
            return Err(FormatError::UnknownField {
                field: "compression",
                value: u64::from(v),
            });
        }
    };
    if bytes[21..24] != [0, 0, 0] {
        return Err(FormatError::UnknownField {
            field: "reserved",
            value: u64::from(u32::from_le_bytes([bytes[21], bytes[22], bytes[23], 0])),
        });
    }
    let payload_len = u64_at(bytes, 24);
    let actual = (bytes.len() - HEADER_LEN) as u64;
    if payload_len != actual {
        return Err(FormatError::PayloadLength {
            expected: payload_len,
            actual,
        });
    }
    let raw_len = u64_at(bytes, 32);
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
    let stored = u64_at(bytes, 64);
    let computed = checksum_algorithm.compute(&bytes[..CHECKED_HEADER_LEN], &bytes[HEADER_LEN..]);
    if stored != computed {
        return Err(FormatError::Checksum { stored, computed });
    }
    // The checksum vouches for the header from here on; remaining checks are semantic.
    let found = KeyBinding {
        chunk_hash: bytes[40..56].try_into().expect("16 bytes"),
        scope_digest: u64_at(bytes, 56),
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
    let layout_fingerprint = u64_at(bytes, 8);
    if let Some(expected) = expect.layout_fingerprint
        && expected != layout_fingerprint
    {
        return Err(FormatError::LayoutMismatch {
            expected,
            found: layout_fingerprint,
        });
    }
    let token_count = u32::from_le_bytes(bytes[16..20].try_into().expect("4 bytes"));
    let dtype = Dtype::from_code(bytes[20]).ok_or(FormatError::UnknownField {
        field: "dtype",
        value: u64::from(bytes[20]),
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
            layout_fingerprint,
            dtype,
            token_count,
        },
        checksum_algorithm,
        compressed,
        payload_len,
        raw_len,
    })
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
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn meta(tokens: u32) -> ChunkMeta {
        ChunkMeta {
            layout_fingerprint: 0x1234,
            dtype: Dtype::Bf16,
            token_count: tokens,
        }
    }

    fn open(max: u64) -> DecodeExpectation {
        DecodeExpectation {
            max_raw_len: max,
            layout_fingerprint: None,
            bytes_per_token: None,
            key: None,
        }
    }

    #[test]
    fn a_value_read_under_another_key_is_rejected() {
        let codec = ChunkCodec::default();
        let bound = KeyBinding {
            chunk_hash: [7; 16],
            scope_digest: 42,
        };
        let encoded = codec.encode(&meta(3), &bound, &[1, 2, 3]);
        let mut expect = open(1 << 20);
        expect.key = Some(bound);
        assert!(decode_to_vec(&encoded, &expect).is_ok());
        for other in [
            KeyBinding {
                chunk_hash: [8; 16],
                ..bound
            },
            KeyBinding {
                scope_digest: 43,
                ..bound
            },
        ] {
            expect.key = Some(other);
            assert!(matches!(
                decode_to_vec(&encoded, &expect),
                Err(FormatError::KeyMismatch { .. })
            ));
        }
        // A version-1 value (no binding) is a typed error: a miss, never data.
        let mut v1 = encoded.clone();
        v1[4] = 1;
        assert!(matches!(
            decode_to_vec(&v1, &open(1 << 20)),
            Err(FormatError::UnsupportedVersion(1, 2))
        ));
    }

    fn codecs() -> impl Strategy<Value = ChunkCodec> {
        (
            prop_oneof![
                Just(ChecksumAlgorithm::Xxh3),
                Just(ChecksumAlgorithm::Crc32c)
            ],
            prop_oneof![
                Just(Compression::None),
                (1i32..4).prop_map(|level| Compression::Zstd { level })
            ],
        )
            .prop_map(|(checksum, compression)| ChunkCodec {
                checksum,
                compression,
            })
    }

    fn payloads() -> impl Strategy<Value = Vec<u8>> {
        prop_oneof![
            proptest::collection::vec(any::<u8>(), 0..2048),
            // Compressible: few distinct values.
            proptest::collection::vec(0u8..3, 0..4096),
        ]
    }

    proptest! {
        #[test]
        fn round_trip_is_exact(codec in codecs(), payload in payloads(), tokens in 0u32..1000) {
            let encoded = codec.encode(&meta(tokens), &KeyBinding::default(), &payload);
            let (m, decoded) = decode_to_vec(&encoded, &open(1 << 20)).unwrap();
            prop_assert_eq!(m, meta(tokens));
            prop_assert_eq!(decoded, payload);
        }

        #[test]
        fn any_single_byte_corruption_is_rejected(
            codec in codecs(), payload in payloads(), pos in any::<prop::sample::Index>(), flip in 1u8..=255
        ) {
            let mut encoded = codec.encode(&meta(3), &KeyBinding::default(), &payload);
            let i = pos.index(encoded.len());
            encoded[i] ^= flip;
            prop_assert!(decode_to_vec(&encoded, &open(1 << 20)).is_err());
        }

        #[test]
        fn truncation_and_extension_are_rejected(codec in codecs(), payload in payloads(), cut in any::<prop::sample::Index>()) {
            let encoded = codec.encode(&meta(3), &KeyBinding::default(), &payload);
            let n = cut.index(encoded.len());
            prop_assert!(decode_to_vec(&encoded[..n], &open(1 << 20)).is_err());
            let mut longer = encoded.clone();
            longer.push(0);
            prop_assert!(decode_to_vec(&longer, &open(1 << 20)).is_err());
        }

        #[test]
        fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = decode_to_vec(&bytes, &open(1 << 20));
        }
    }

    #[test]
    fn oversized_chunk_is_rejected_before_allocation() {
        let codec = ChunkCodec::default();
        let encoded = codec.encode(&meta(1), &KeyBinding::default(), &[7u8; 1000]);
        assert!(matches!(
            decode_header(&encoded, &open(999)),
            Err(FormatError::TooLarge {
                size: 1000,
                limit: 999
            })
        ));
        // A header that claims a huge raw size is rejected by the limit, not by allocating.
        let mut forged = encoded.clone();
        forged[7] = 1; // claims zstd so raw_len may differ from payload_len
        forged[32..40].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(matches!(
            decode_header(&forged, &open(1 << 20)),
            Err(FormatError::TooLarge { .. })
        ));
    }

    #[test]
    fn layout_and_size_expectations_are_enforced() {
        let codec = ChunkCodec::default();
        let encoded = codec.encode(&meta(4), &KeyBinding::default(), &[1u8; 64]);
        let mut expect = open(1 << 20);
        expect.layout_fingerprint = Some(0x9999);
        assert!(matches!(
            decode_header(&encoded, &expect),
            Err(FormatError::LayoutMismatch { .. })
        ));
        expect.layout_fingerprint = Some(0x1234);
        expect.bytes_per_token = Some(16);
        assert!(decode_header(&encoded, &expect).is_ok());
        expect.bytes_per_token = Some(32);
        assert!(matches!(
            decode_header(&encoded, &expect),
            Err(FormatError::SizeMismatch { .. })
        ));
    }

    #[test]
    fn wrong_destination_size_is_rejected() {
        let encoded = ChunkCodec::default().encode(&meta(1), &KeyBinding::default(), &[5u8; 10]);
        let header = decode_header(&encoded, &open(100)).unwrap();
        let mut small = [0u8; 9];
        assert!(decode_payload_into(&encoded, &header, &mut small).is_err());
    }
}
