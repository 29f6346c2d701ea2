//! Tests of the chunk format: round trips; corrupt, truncated, oversized and misfiled values
//! refused; the one-copy decoder against the two-step one; the in-place encoder against `encode`.

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

    /// The one-copy decoder of shared memory accepts exactly what the two-step decoder
    /// accepts, with the same bytes, and rejects with the same error: a value intact, with
    /// one byte changed, or cut short.
    #[test]
    fn the_copying_decoder_agrees_with_the_two_step_one(
        codec in codecs(), payload in payloads(), pos in any::<prop::sample::Index>(), flip in 0u8..=255, cut in any::<bool>()
    ) {
        let mut encoded = codec.encode(&meta(3), &KeyBinding::default(), &payload);
        let i = pos.index(encoded.len());
        encoded[i] ^= flip;
        if cut {
            encoded.truncate(i);
        }
        let two_step = decode_to_vec(&encoded, &open(1 << 20));
        let copied = decode_copied(&encoded, &open(1 << 20), |len| vec![0u8; len])
            .map(|(header, buf)| (header.meta, buf));
        prop_assert_eq!(format!("{two_step:?}"), format!("{copied:?}"));
    }
}

proptest! {
    /// Writing a value in place is byte for byte the encoding of a codec that does not
    /// compress.
    #[test]
    fn encoding_in_place_is_the_uncompressed_encoding(payload in payloads(), tokens in 0u32..1000, crc in any::<bool>()) {
        let codec = ChunkCodec {
            checksum: if crc { ChecksumAlgorithm::Crc32c } else { ChecksumAlgorithm::Xxh3 },
            compression: Compression::None,
        };
        let key = KeyBinding { chunk_hash: [5; 16], scope_digest: 77 };
        let len = codec.stored_len_uncompressed(payload.len()).unwrap();
        let mut dst = vec![0xAA; len];
        codec.encode_uncompressed_into(&meta(tokens), &key, &payload, &mut dst).unwrap();
        prop_assert_eq!(&dst, &codec.encode(&meta(tokens), &key, &payload));
        let short = codec.encode_uncompressed_into(&meta(tokens), &key, &payload, &mut dst[1..]);
        prop_assert!(matches!(short, Err(FormatError::Destination { .. })), "a short destination was written");
    }
}

#[test]
fn a_compressing_codec_does_not_know_its_stored_length_in_advance() {
    let codec = ChunkCodec {
        compression: Compression::Zstd { level: 1 },
        ..ChunkCodec::default()
    };
    assert_eq!(codec.stored_len_uncompressed(10), None);
    assert!(codec.compresses() && !ChunkCodec::default().compresses());
    assert_eq!(
        ChunkCodec::default().stored_len_uncompressed(10),
        Some(HEADER_LEN + 10)
    );
}

#[test]
fn the_copying_decoder_refuses_a_destination_of_another_length() {
    let codec = ChunkCodec::default();
    let encoded = codec.encode(&meta(1), &KeyBinding::default(), &[7u8; 64]);
    // A destination of another length is refused before anything is copied.
    let got = decode_copied(&encoded, &open(1 << 20), |len| vec![0u8; len + 1]);
    assert!(matches!(got, Err(FormatError::Destination { .. })));
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

/// The copying decoder copies and hashes a large value piece by piece: intact it decodes to
/// the payload, and one byte changed in any piece (the first, a middle one, the short last
/// one) is a checksum error, with either checksum.
#[test]
fn the_copying_decoder_checks_every_piece_of_a_large_value() {
    let payload: Vec<u8> = (0..(3 * 64 * 1024 + 7) as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    for checksum in [ChecksumAlgorithm::Xxh3, ChecksumAlgorithm::Crc32c] {
        let codec = ChunkCodec {
            checksum,
            compression: Compression::None,
        };
        let encoded = codec.encode(&meta(3), &KeyBinding::default(), &payload);
        let (_, copied) = decode_copied(&encoded, &open(1 << 20), |len| vec![0u8; len]).unwrap();
        assert_eq!(copied, payload, "{checksum:?}");
        for at in [0, 64 * 1024 + 5, 2 * 64 * 1024 - 1, payload.len() - 1] {
            let mut changed = encoded.clone();
            changed[HEADER_LEN + at] ^= 0x10;
            let got = decode_copied(&changed, &open(1 << 20), |len| vec![0u8; len]);
            assert!(
                matches!(got, Err(FormatError::Checksum { .. })),
                "{checksum:?}: a byte changed at {at} was not caught: {got:?}"
            );
        }
    }
}

proptest! {
    /// The XXH3 checksum fed piece by piece is the one-shot XXH3-64 of the header and payload
    /// as one buffer (the format's stored checksum: values written before the hasher changed
    /// still verify), over sizes that take every code path (short, mid, one stripe, many
    /// blocks) and any split into pieces.
    #[test]
    fn the_xxh3_checksum_is_xxh3_64_of_the_whole_value(
        len in prop_oneof![0usize..300, 1000usize..1100, 1usize << 16..(1 << 16) + 2000],
        seed in any::<u32>(),
        cuts in proptest::collection::vec(any::<prop::sample::Index>(), 0..4),
    ) {
        let bytes: Vec<u8> = (0..len as u32 + 64)
            .map(|i| (i ^ seed).wrapping_mul(2_654_435_761).rotate_left(7) as u8)
            .collect();
        let (header, payload) = bytes.split_at(64);
        let mut at: Vec<usize> = cuts.iter().map(|c| c.index(payload.len() + 1)).collect();
        at.sort_unstable();
        let mut pieces = Vec::new();
        let mut from = 0;
        for to in at.into_iter().chain([payload.len()]) {
            pieces.push(&payload[from..to]);
            from = to;
        }
        let expected = xxhash_rust::xxh3::xxh3_64(&bytes);
        prop_assert_eq!(ChecksumAlgorithm::Xxh3.compute_over(header, pieces), expected);
        let mut copy = vec![0u8; payload.len()];
        prop_assert_eq!(ChecksumAlgorithm::Xxh3.copy_and_compute(header, payload, &mut copy), expected);
        prop_assert_eq!(&copy[..], payload);
    }
}
