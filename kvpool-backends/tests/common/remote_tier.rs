//! The fixture every networked tier's tests share (Redis, S3, Mooncake Store): the conformance
//! kit through the chunk format, and the outage scenario (the server killed under load, then
//! back).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use kvpool_backends::conformance::{self, Outcome};
use kvpool_core::{
    ByteSize, ChunkCodec, HostPagedKvCache, PoolConfig, RemoteBackend, RemoteConnector, TierConfig,
};

use super::{
    StoredPrompt, assert_outage_is_misses, assert_rows_equal, chunk_format_subject, engine_over,
    recovers, small_layout, store_prompt,
};

/// Runs the whole conformance kit, each check on a fresh connector from `connect` behind the
/// chunk format, and fails naming every check that did not pass (none may be skipped).
pub async fn assert_passes_the_kit<C, F, Fut>(name: &str, connect: F)
where
    C: RemoteConnector + Clone,
    F: Fn() -> Fut,
    Fut: Future<Output = C>,
{
    let results = conformance::run_all(&|| {
        let connecting = connect();
        async move { chunk_format_subject(connecting.await) }
    })
    .await;
    conformance::assert_all_passed(name, &results);
    assert!(
        results.iter().all(|r| r.outcome == Outcome::Passed),
        "{name}: {results:?}"
    );
}

/// The outage scenario, over an engine whose only tier is `connector`: a prompt is stored;
/// `kill` stops the server; then the prompt misses and loads nothing, a store of another prompt
/// is counted as failed writes, and all of that ends within `limit` (calls time out, never
/// hang). `restart` brings the server back (what it returns, a server handle, is handed back
/// so it lives as long as the caller wants); within three tries of about ten seconds each, a
/// store of the other prompt succeeds again, and a retrieve of it gives back its exact rows.
pub async fn assert_outage_then_recovery<C: RemoteConnector + 'static, R>(
    connector: C,
    name: &str,
    kill: impl FnOnce(),
    limit: Duration,
    restart: impl FnOnce() -> R,
) -> R {
    let engine = engine_over(
        Arc::new(RemoteBackend::new(
            connector,
            ChunkCodec::default(),
            64 << 20,
        )),
        name,
    );
    let StoredPrompt { tokens, slots, kv } = store_prompt(&engine, 64, 1).await;
    kill();
    let other: Vec<u32> = (1000..1000 + tokens.len() as u32).collect();
    assert_outage_is_misses(&engine, &tokens, &other, &kv, &slots, limit).await;

    let server = restart();
    let mut recovered = false;
    for _ in 0..3 {
        if recovers(&engine, &other, &kv, &slots).await {
            recovered = true;
            break;
        }
    }
    assert!(recovered, "{name}: no recovery after the server came back");
    let mut dst = HostPagedKvCache::new(small_layout(), 32);
    let mask = engine
        .retrieve(&other, None, &mut dst, &slots)
        .await
        .unwrap();
    assert!(
        mask.iter().all(|m| *m),
        "{name}: the recovered prompt loads"
    );
    assert_rows_equal(&kv, &slots, &dst, &slots, &mask);
    server
}

/// `build_pool` over L1 and `tier` opens the tiers `["cpu", name]`; with the tier's URL replaced
/// by `bad_url` it fails at start-up with an error that names `tier.url` and contains `needle`.
pub async fn assert_pool_opens_tier_and_rejects_a_bad_url(
    tier: TierConfig,
    name: &str,
    bad_url: String,
    needle: &str,
) {
    let mut config = PoolConfig::default();
    config.local_cpu.max_size = ByteSize::mib(64);
    config.tiers.push(tier);
    let pool = kvpool_backends::build_pool(&config).await.unwrap();
    assert_eq!(pool.engine.storage().tier_names(), ["cpu", name]);
    config.tiers[0].url = bad_url;
    let err = kvpool_backends::build_pool(&config)
        .await
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("tier.url") && err.to_lowercase().contains(needle),
        "{err}"
    );
}
