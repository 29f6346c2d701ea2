//! Chunk-key hashing of a 128K-token prompt: xxh3-128 chain vs a chained SHA-256 baseline,
//! chunk encode/decode with each checksum, and the copying decoder (a tier's value into an
//! L1 buffer) against a copy followed by a separate checksum pass.

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use kvpool_core::format::chunk_format::{
    ChunkCodec, DecodeExpectation, HEADER_LEN, KeyBinding, decode_copied, decode_to_vec,
};
use kvpool_core::{
    ChecksumAlgorithm, ChunkMeta, ChunkedTokenDatabase, ChunkingConfig, Dtype, HashAlgorithm,
    KeyScope,
};
use std::hint::black_box;

const TOKENS: usize = 128 * 1024;

fn hashing(c: &mut Criterion) {
    let tokens: Vec<u32> = (0..TOKENS as u32)
        .map(|i| i.wrapping_mul(2654435761) % 128_000)
        .collect();
    let mut g = c.benchmark_group("chunk_keys_128k_tokens");
    g.throughput(Throughput::Bytes((TOKENS * 4) as u64));
    for algo in [HashAlgorithm::Xxh3_128, HashAlgorithm::Sha256] {
        let db = ChunkedTokenDatabase::new(
            ChunkingConfig {
                hash_algorithm: algo,
                ..Default::default()
            },
            KeyScope::new("bench", 1, 0, 0, 1).unwrap(),
        )
        .unwrap();
        g.bench_function(BenchmarkId::from_parameter(format!("{algo:?}")), |b| {
            b.iter(|| black_box(db.process_tokens(black_box(&tokens), None).unwrap()))
        });
    }
    g.finish();
}

/// The metadata of a bf16 chunk of 256 tokens and what its decoder expects.
fn bf16_chunk() -> (ChunkMeta, DecodeExpectation) {
    let meta = ChunkMeta {
        layout_fingerprint: 1,
        dtype: Dtype::Bf16,
        token_count: 256,
    };
    let expect = DecodeExpectation {
        max_raw_len: 1 << 30,
        layout_fingerprint: Some(1),
        bytes_per_token: None,
        key: Some(KeyBinding::default()),
    };
    (meta, expect)
}

fn chunk_format(c: &mut Criterion) {
    let payload: Vec<u8> = (0..8 << 20)
        .map(|i: u32| (i.wrapping_mul(31) >> 7) as u8)
        .collect();
    let (meta, expect) = bf16_chunk();
    let mut g = c.benchmark_group("chunk_format_8MiB");
    g.throughput(Throughput::Bytes(payload.len() as u64));
    g.sample_size(20);
    for checksum in [ChecksumAlgorithm::Xxh3, ChecksumAlgorithm::Crc32c] {
        let codec = ChunkCodec {
            checksum,
            ..Default::default()
        };
        let encoded = codec.encode(&meta, &KeyBinding::default(), &payload);
        g.bench_function(BenchmarkId::new("encode", format!("{checksum:?}")), |b| {
            b.iter(|| black_box(codec.encode(&meta, &KeyBinding::default(), black_box(&payload))))
        });
        g.bench_function(BenchmarkId::new("decode", format!("{checksum:?}")), |b| {
            b.iter(|| black_box(decode_to_vec(black_box(&encoded), &expect).unwrap()))
        });
    }
    g.finish();
}

/// A 4 MiB value (an SGLang page, two vLLM chunks) decoded into a reused buffer, as a tier's
/// read into L1 does: `decode_copied` (copies and hashes each 64 KiB piece while it is in
/// cache) against the named baseline, a whole copy then an xxh3 pass over it (what
/// `decode_copied` did before), and a bare copy (the floor).
fn copying_decoder(c: &mut Criterion) {
    let payload: Vec<u8> = (0..4 << 20)
        .map(|i: u32| (i.wrapping_mul(2_654_435_761) >> 11) as u8)
        .collect();
    let (meta, expect) = bf16_chunk();
    let encoded = ChunkCodec::default().encode(&meta, &KeyBinding::default(), &payload);
    let mut dst = vec![0u8; payload.len()];
    let mut g = c.benchmark_group("copying_decoder_4MiB");
    g.throughput(Throughput::Bytes(payload.len() as u64));
    g.bench_function("copy_then_xxh3 (baseline)", |b| {
        b.iter(|| {
            dst.copy_from_slice(&encoded[HEADER_LEN..]);
            black_box(xxhash_rust::xxh3::xxh3_64(&dst))
        })
    });
    g.bench_function("decode_copied", |b| {
        b.iter(|| {
            let (header, _) =
                decode_copied(black_box(&encoded), &expect, |_| dst.as_mut_slice()).unwrap();
            black_box(header)
        })
    });
    g.bench_function("memcpy (floor)", |b| {
        b.iter(|| dst.copy_from_slice(black_box(&encoded[HEADER_LEN..])))
    });
    g.finish();
}

criterion_group!(benches, hashing, chunk_format, copying_decoder);
criterion_main!(benches);
