//! Every backend in this crate that needs no server runs the whole conformance kit.

use kvpool_core::RemoteConnector;
use std::sync::Arc;

use bytes::Bytes;
use kvpool_backends::conformance::{self, Outcome, Subject};
use kvpool_backends::{InMemoryConnector, LocalCpuBackend, TimeoutConnector};
use kvpool_core::{ChunkCodec, EvictionKind, RemoteBackend};

#[tokio::test]
async fn cpu_tier_passes_the_kit() {
    let results = conformance::run_all(&|| async {
        let cpu = LocalCpuBackend::new(96 << 20, EvictionKind::S3fifo).unwrap();
        Subject::new(Arc::new(cpu), 32 << 20)
    })
    .await;
    conformance::assert_all_passed("cpu", &results);
    let skipped: Vec<_> = results
        .iter()
        .filter(|r| matches!(r.outcome, Outcome::Skipped(_)))
        .map(|r| r.name)
        .collect();
    assert_eq!(
        skipped,
        ["corrupted_value_rejected", "value_under_wrong_key_rejected"],
        "only the checks of stored bytes are skipped for memory"
    );
}

#[tokio::test]
async fn memory_connector_through_the_chunk_format_passes_the_kit() {
    let results = conformance::run_all(&|| async {
        let store = InMemoryConnector::new();
        let bounded = TimeoutConnector::new(store.clone(), std::time::Duration::from_secs(5));
        let backend = RemoteBackend::new(bounded, ChunkCodec::default(), 64 << 20);
        let copier = store.clone();
        Subject::new(Arc::new(backend), 32 << 20)
            .with_corruptor(Arc::new(move |key| {
                let store = store.clone();
                Box::pin(async move {
                    assert!(store.overwrite_raw(
                        &key.to_string(),
                        Bytes::from_static(b"garbage, not a chunk")
                    ));
                })
            }))
            .with_raw_copier(Arc::new(move |from, to| {
                let store = copier.clone();
                Box::pin(async move {
                    let bytes = store.get(&from.to_string()).await.unwrap().expect("stored");
                    store.put(&to.to_string(), bytes).await.unwrap();
                })
            }))
    })
    .await;
    conformance::assert_all_passed("memory", &results);
    assert!(
        results.iter().all(|r| r.outcome == Outcome::Passed),
        "{results:?}"
    );
}

/// The kit itself must catch a backend that misbehaves.
#[tokio::test]
async fn the_kit_fails_a_backend_that_hands_out_corrupt_bytes() {
    let results = conformance::run_all(&|| async {
        let store = InMemoryConnector::new();
        let backend = RemoteBackend::new(store.clone(), ChunkCodec::default(), 64 << 20);
        // This "corruption" forges a well-formed chunk (valid checksum) holding other bytes.
        // The adapter cannot tell and returns it as data, so the kit must report a failure.
        Subject::new(Arc::new(backend), 1 << 20).with_corruptor(Arc::new(move |key| {
            let store = store.clone();
            Box::pin(async move {
                let meta = kvpool_core::ChunkMeta {
                    layout_fingerprint: 0x5eed,
                    dtype: kvpool_core::Dtype::Bf16,
                    token_count: 1,
                };
                let binding = kvpool_core::format::chunk_format::KeyBinding::of(&key);
                let forged = ChunkCodec::default().encode(&meta, &binding, &[1, 2, 3]);
                store.overwrite_raw(&key.to_string(), Bytes::from(forged));
            })
        }))
    })
    .await;
    let corrupted = results
        .iter()
        .find(|r| r.name == "corrupted_value_rejected")
        .unwrap();
    assert!(
        matches!(corrupted.outcome, Outcome::Failed(_)),
        "{corrupted:?}"
    );
    let round_trip = results
        .iter()
        .find(|r| r.name == "round_trip_sizes")
        .unwrap();
    assert_eq!(
        round_trip.outcome,
        Outcome::Passed,
        "1 KiB and 1 MiB still run; 32 MiB is skipped"
    );
}
