//! The one-copy read of a value in shared memory (`check_before_copy`, then `CopyCheck::verify`
//! on the copy, however it is split into pieces): on arbitrary bytes it never panics and
//! accepts exactly what the copying decoder accepts, with the same header and payload; on a
//! real encoding it accepts, and rejects the copy once any one byte of it changes.
#![no_main]

use kvpool_core::format::chunk_format::{
    DecodeExpectation, KeyBinding, check_before_copy, decode_copied,
};
use kvpool_core::{ChecksumAlgorithm, ChunkCodec, ChunkMeta, Compression, Dtype, FormatError};
use libfuzzer_sys::fuzz_target;

const KEY: KeyBinding = KeyBinding {
    chunk_hash: [7; 16],
    scope_digest: 9,
};

/// Checks `value` both ways under `expect`, the copy split at `cut`; whether it was accepted.
fn agree(value: &[u8], expect: &DecodeExpectation, cut: usize) -> bool {
    let copied = decode_copied(value, expect, |len| vec![0u8; len]);
    match check_before_copy(value, expect) {
        Ok((header, check)) => {
            let payload = &value[value.len() - check.payload_len()..];
            let at = cut % (payload.len() + 1);
            let verdict = check.verify([&payload[..at], &payload[at..]]);
            assert_eq!(
                verdict.is_ok(),
                copied.is_ok(),
                "one-copy {verdict:?}, copying decoder {:?}",
                copied.as_ref().map(|(h, _)| h)
            );
            if let Ok((h, raw)) = &copied {
                assert_eq!(h, &header);
                assert_eq!(raw.as_slice(), payload);
            }
            if !payload.is_empty() {
                assert!(
                    check.verify([&payload[1..]]).is_err(),
                    "a short copy passed"
                );
            }
            verdict.is_ok()
        }
        // The copying decoder may inflate a compressed value; the one-copy path never does.
        Err(FormatError::Compressed) => false,
        Err(e) => {
            assert!(copied.is_err(), "refused before the copy ({e}) but decoded");
            false
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&selector, rest)) = data.split_first() else {
        return;
    };
    let loose = DecodeExpectation {
        max_raw_len: 1 << 20,
        layout_fingerprint: None,
        bytes_per_token: None,
        key: None,
    };
    let strict = DecodeExpectation {
        layout_fingerprint: Some(1),
        bytes_per_token: Some(4),
        key: Some(KEY),
        ..loose
    };
    // Arbitrary bytes as a value in shared memory.
    agree(rest, &loose, usize::from(selector));
    agree(rest, &strict, usize::from(selector));

    // The bytes as a payload: its encoding passes, and any one changed byte does not.
    let payload = &rest[..rest.len() / 4 * 4];
    let codec = ChunkCodec {
        checksum: if selector & 1 == 0 {
            ChecksumAlgorithm::Xxh3
        } else {
            ChecksumAlgorithm::Crc32c
        },
        compression: Compression::None,
    };
    let meta = ChunkMeta {
        layout_fingerprint: 1,
        dtype: Dtype::F16,
        token_count: (payload.len() / 4) as u32,
    };
    let mut stored = codec.encode(&meta, &KEY, payload);
    assert!(agree(&stored, &strict, usize::from(selector) * 31));
    let at = usize::from(selector) * 7919 % stored.len();
    stored[at] ^= 1 << (selector % 8);
    assert!(
        !agree(&stored, &strict, usize::from(selector)),
        "a flipped bit at byte {at} of {} was accepted",
        stored.len()
    );
});
