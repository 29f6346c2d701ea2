//! The stored-chunk decoder on arbitrary bytes: never a panic, never more memory than the
//! bound allows, and the one-copy decoder of shared memory answers exactly as the two-step one;
//! and a real encoding with any one byte changed is always rejected.
#![no_main]

use kvpool_core::format::chunk_format::{
    DecodeExpectation, KeyBinding, decode_copied, decode_to_vec,
};
use kvpool_core::{ChecksumAlgorithm, ChunkCodec, ChunkMeta, Compression, Dtype};
use libfuzzer_sys::fuzz_target;

const MAX_RAW: u64 = 1 << 20;

fuzz_target!(|data: &[u8]| {
    // Arbitrary bytes as a stored value, with and without expectations.
    let loose = DecodeExpectation {
        max_raw_len: MAX_RAW,
        layout_fingerprint: None,
        bytes_per_token: None,
        key: None,
    };
    let two_step = decode_to_vec(data, &loose);
    if let Ok((_, raw)) = &two_step {
        assert!(raw.len() as u64 <= MAX_RAW);
    }
    let copied = decode_copied(data, &loose, |len| vec![0u8; len]).map(|(h, raw)| (h.meta, raw));
    assert_eq!(two_step, copied, "the two decoders disagree");
    let key = KeyBinding {
        chunk_hash: [7; 16],
        scope_digest: 9,
    };
    let strict = DecodeExpectation {
        layout_fingerprint: Some(1),
        bytes_per_token: Some(4),
        key: Some(key),
        ..loose
    };
    if let Ok((meta, raw)) = decode_to_vec(data, &strict) {
        assert_eq!(meta.layout_fingerprint, 1);
        assert_eq!(raw.len() as u64, u64::from(meta.token_count) * 4);
    }

    // The input as a payload: it round-trips, and any single changed byte is caught.
    let Some((&selector, payload)) = data.split_first() else {
        return;
    };
    let payload = &payload[..payload.len() / 4 * 4];
    let codec = ChunkCodec {
        checksum: if selector & 1 == 0 {
            ChecksumAlgorithm::Xxh3
        } else {
            ChecksumAlgorithm::Crc32c
        },
        compression: if selector & 2 == 0 {
            Compression::None
        } else {
            Compression::Zstd { level: 1 }
        },
    };
    let meta = ChunkMeta {
        layout_fingerprint: 1,
        dtype: Dtype::F16,
        token_count: (payload.len() / 4) as u32,
    };
    let mut stored = codec.encode(&meta, &key, payload);
    let (back_meta, back) = decode_to_vec(&stored, &strict).expect("own encoding decodes");
    assert_eq!(back_meta, meta);
    assert_eq!(back, payload);
    let at = usize::from(selector) * 7919 % stored.len();
    stored[at] ^= 1 << (selector % 8);
    assert!(
        decode_to_vec(&stored, &strict).is_err(),
        "a flipped bit at byte {at} of {} was accepted",
        stored.len()
    );
});
