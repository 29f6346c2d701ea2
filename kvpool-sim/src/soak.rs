//! What a chaos soak measures besides wrong rows: resident memory over time, and whether writes
//! acknowledged after the faults stop reach every lower tier intact.
//!
//! `cargo xtask soak` runs `kvpool sim --soak-minutes N` against L1 + disk + Redis + S3 while
//! it kills servers, fills the disk and corrupts values; this module is the simulator's side.

use std::time::Duration;

use kvpool_core::{HostPagedKvCache, KvLayout, PoolConfig};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;

use crate::kv_model::{model_compute, model_mismatches};

/// Resident set size of this process, in bytes (Linux: `VmRSS` in `/proc/self/status`);
/// `None` elsewhere.
pub fn resident_bytes() -> Option<u64> {
    status_kib("VmRSS:").map(|k| k * 1024)
}

/// Resident anonymous memory (`RssAnon`: heap, stacks, pools), in bytes: RSS without the
/// pages of mapped files (code and libraries, which grow as more code paths run). The soak's
/// memory check uses it.
pub fn resident_anon_bytes() -> Option<u64> {
    status_kib("RssAnon:").map(|k| k * 1024)
}

fn status_kib(field: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with(field))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// Bytes the C heap has handed out and not taken back (glibc's `mallinfo2`: small blocks plus
/// mmapped ones): unlike RSS, blind to fragmentation and to pages the allocator keeps. It
/// does count the blocks glibc's per-thread caches hold (`tcache`), which fill slowly over a
/// long run; with those off (`GLIBC_TUNABLES=glibc.malloc.tcache_count=0`, as `cargo xtask
/// soak` runs engines) a steady rise is a leak. `None` off glibc.
pub fn heap_in_use_bytes() -> Option<u64> {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallinfo2 takes no arguments and only reads the allocator's statistics.
        let info = unsafe { libc::mallinfo2() };
        Some((info.uordblks + info.hblkhd) as u64)
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    None
}

/// Samples memory during a timed run: anonymous RSS every 2 s (for the growth check), and
/// RSS, anonymous RSS and heap in use every 10 s (the timeline in the report).
///
/// Growth is judged on medians, not on single samples: anonymous RSS swings by a few MiB from
/// one sample to the next as caches fill and drain, so a single end sample can land on a low
/// or a high point. [`RssSampler::growth_window_medians`] compares the median of the first
/// window after the warm-up with the median of the last window.
#[derive(Debug, Clone, Default)]
pub struct RssSampler {
    warm_up: Option<Duration>,
    /// Anonymous RSS when the warm-up ended.
    pub after_warm_up: Option<u64>,
    /// (second, RSS, anonymous RSS, C heap in use) every 10 s.
    pub timeline: Vec<(u64, u64, u64, u64)>,
    /// (elapsed, anonymous RSS) every 2 s.
    anon: Vec<(Duration, u64)>,
}

/// The median of `values` (`None` when empty).
fn median(mut values: Vec<u64>) -> Option<u64> {
    values.sort_unstable();
    values.get(values.len() / 2).copied()
}

impl RssSampler {
    /// A sampler for a run of `duration` (none: no sampling); the warm-up is a quarter of the
    /// run, at most 90 s: the pool's caches (L1, RocksDB's block cache and memtables, the
    /// connection pools) take about that long to fill in the soak, and until they are full
    /// their growth is not a leak.
    pub fn new(duration: Option<Duration>) -> Self {
        Self {
            warm_up: duration.map(|d| (d / 4).min(Duration::from_secs(90))),
            ..Self::default()
        }
    }

    /// Takes the samples that are due at `elapsed`.
    pub fn tick(&mut self, elapsed: Duration) {
        let Some(warm_up) = self.warm_up else {
            return;
        };
        if self.after_warm_up.is_none() && elapsed >= warm_up {
            self.after_warm_up = resident_anon_bytes();
        }
        if self
            .anon
            .last()
            .is_none_or(|(at, _)| elapsed >= *at + Duration::from_secs(2))
            && let Some(anon) = resident_anon_bytes()
        {
            self.anon.push((elapsed, anon));
        }
        let second = elapsed.as_secs();
        if second >= 10 * self.timeline.len() as u64
            && let Some(rss) = resident_bytes()
        {
            self.timeline.push((
                second,
                rss,
                resident_anon_bytes().unwrap_or(0),
                heap_in_use_bytes().unwrap_or(0),
            ));
        }
    }

    /// Medians of anonymous RSS over the first window after the warm-up and over the last
    /// window of the run (each a quarter of the time after the warm-up, at most 60 s);
    /// `None` without enough samples in both.
    pub fn growth_window_medians(&self) -> Option<(u64, u64)> {
        let warm_up = self.warm_up?;
        let (end, _) = *self.anon.last()?;
        let window = ((end.saturating_sub(warm_up)) / 4).min(Duration::from_secs(60));
        let within = |from: Duration, to: Duration| -> Vec<u64> {
            self.anon
                .iter()
                .filter(|(at, _)| *at >= from && *at <= to)
                .map(|(_, anon)| *anon)
                .collect()
        };
        let first = within(warm_up, warm_up + window);
        let last = within(end.saturating_sub(window), end);
        if first.len() < 3 || last.len() < 3 {
            return None;
        }
        Some((median(first)?, median(last)?))
    }
}

/// One lower tier's share of the acknowledged-writes check.
#[derive(Debug, Clone, Default, Serialize)]
pub struct TierDurability {
    /// The tier's URL, password redacted.
    pub tier: String,
    /// Chunks acknowledged (stored, and the flush that followed succeeded).
    pub acknowledged_chunks: usize,
    /// Of those, chunks this tier did not return.
    pub lost_chunks: usize,
    /// Rows (token x layer x plane) the tier returned with wrong bytes.
    pub wrong_rows: usize,
}

/// Stores `prompts` fresh prompts of `chunks_per_prompt` chunks through a pool built from
/// `config` (all its tiers), flushes, closes it; then opens a pool on each lower tier alone and
/// reads every prompt back, comparing each row with the model.
///
/// Run it after the faults stopped: it proves that every tier accepts writes again and keeps
/// what it acknowledged. A flush that fails is an error (the writes were never acknowledged).
pub fn check_acknowledged_writes(
    config: &PoolConfig,
    layout: KvLayout,
    prompts: usize,
    chunks_per_prompt: usize,
    seed: u64,
) -> anyhow::Result<Vec<TierDurability>> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let chunk = config.chunking.chunk_size;
    let n = chunk * chunks_per_prompt;
    let blocks: Vec<u32> = (0..n.div_ceil(layout.block_size) as u32).collect();
    let slots: Vec<i64> = (0..n as i64).collect();
    let mut rng = SmallRng::seed_from_u64(seed ^ 0x6361_6c6d);
    let prompts: Vec<Vec<u32>> = (0..prompts)
        .map(|_| (0..n).map(|_| rng.random_range(0..50_000)).collect())
        .collect();

    let mut acknowledged = 0;
    {
        let pool = runtime.block_on(build_pool_patiently(config))?;
        let mut kv = HostPagedKvCache::new(layout, blocks.len());
        for tokens in &prompts {
            for layer in 0..layout.num_layers {
                model_compute(&mut kv, layer, tokens, &blocks, 0..n);
            }
            let report = runtime.block_on(pool.engine.store(tokens, None, &kv, &slots))?;
            acknowledged += report.stored_chunks;
        }
        runtime
            .block_on(pool.engine.storage().close())
            .map_err(|e| anyhow::anyhow!("flushing the acknowledged writes failed: {e}"))?;
    }

    let mut out = Vec::new();
    for tier in &config.tiers {
        let mut alone = config.clone();
        alone.tiers = vec![tier.clone()];
        let pool = runtime.block_on(build_pool_patiently(&alone))?;
        let mut result = TierDurability {
            tier: kvpool_core::redact_url(&tier.url),
            acknowledged_chunks: acknowledged,
            ..Default::default()
        };
        for tokens in &prompts {
            let mut kv = HostPagedKvCache::new(layout, blocks.len());
            let mask = runtime.block_on(pool.engine.retrieve(tokens, None, &mut kv, &slots))?;
            let loaded = mask.iter().take_while(|&&m| m).count();
            result.lost_chunks += chunks_per_prompt - loaded / chunk;
            result.wrong_rows += model_mismatches(&kv, &tokens[..loaded], &blocks);
        }
        runtime.block_on(pool.engine.storage().close())?;
        out.push(result);
    }
    Ok(out)
}

/// `build_pool`, tried up to five times a second apart: a server restarted just before the
/// check may still be starting (the check is about what the tiers keep, not how fast they
/// come back).
async fn build_pool_patiently(config: &PoolConfig) -> anyhow::Result<kvpool_backends::Pool> {
    let mut attempt = 1;
    loop {
        match kvpool_backends::build_pool(config).await {
            Ok(pool) => return Ok(pool),
            Err(e) if attempt < 5 => {
                eprintln!("opening the pool failed (attempt {attempt}): {e}; retrying");
                attempt += 1;
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            Err(e) => return Err(e.into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resident_memory_is_read_on_linux() {
        if cfg!(target_os = "linux") {
            let rss = resident_bytes().expect("statm is readable");
            assert!(rss > 1 << 20, "{rss}");
        }
    }

    #[test]
    fn the_warm_up_sample_is_taken_once_after_the_warm_up() {
        let mut s = RssSampler::new(Some(Duration::from_secs(8)));
        s.tick(Duration::from_secs(1));
        assert_eq!(s.after_warm_up, None);
        s.tick(Duration::from_secs(2));
        let first = s.after_warm_up;
        assert!(first.is_some() || !cfg!(target_os = "linux"));
        s.tick(Duration::from_secs(5));
        assert_eq!(s.after_warm_up, first);
        let mut none = RssSampler::new(None);
        none.tick(Duration::from_secs(100));
        assert_eq!(none.after_warm_up, None);
    }

    #[test]
    fn growth_is_judged_on_window_medians_not_single_samples() {
        let mut s = RssSampler::new(Some(Duration::from_secs(120)));
        // Samples as `tick` would take them: a flat run with one spike at the very end.
        s.anon = (15..=60)
            .map(|i| (Duration::from_secs(2 * i), 100 + (i % 3)))
            .collect();
        s.anon.push((Duration::from_secs(122), 500));
        let (first, last) = s.growth_window_medians().unwrap();
        assert_eq!(
            (first, last),
            (101, 101),
            "one spike does not move a median"
        );
        assert!(
            RssSampler::new(Some(Duration::from_secs(120)))
                .growth_window_medians()
                .is_none()
        );
    }

    fn soak_layout() -> (KvLayout, PoolConfig) {
        let layout = KvLayout::new(
            2,
            2,
            8,
            kvpool_core::Dtype::F16,
            kvpool_core::KvKind::KeyValue,
            16,
        )
        .unwrap();
        let mut config = PoolConfig::default();
        config.local_cpu.max_size = kvpool_core::ByteSize(1 << 20);
        config.chunking.chunk_size = 64;
        config.layout.num_layers = 2;
        config.layout.num_kv_heads = 2;
        config.layout.head_size = 8;
        config.layout.block_size = 16;
        config.layout.dtype = kvpool_core::Dtype::F16;
        (layout, config)
    }

    #[test]
    fn acknowledged_writes_come_back_intact_from_a_disk_tier() {
        let dir = tempfile::tempdir().unwrap();
        let (layout, mut config) = soak_layout();
        config.tiers = vec![kvpool_core::TierConfig::new(format!(
            "file://{}",
            dir.path().display()
        ))];
        let got = check_acknowledged_writes(&config, layout, 3, 2, 1).unwrap();
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].acknowledged_chunks, 6);
        assert_eq!((got[0].lost_chunks, got[0].wrong_rows), (0, 0), "{got:?}");
    }

    #[test]
    fn acknowledged_writes_come_back_from_a_lower_tier_and_a_missing_tier_loses_them() {
        let (layout, mut config) = soak_layout();
        // memory:// is per pool: a fresh pool on it has lost everything, which the check must
        // report as lost (this is what makes it able to fail).
        config.tiers = vec![kvpool_core::TierConfig::new("memory://")];
        let got = check_acknowledged_writes(&config, layout, 3, 2, 1).unwrap();
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].acknowledged_chunks, 6);
        assert_eq!(got[0].lost_chunks, 6);
        assert_eq!(got[0].wrong_rows, 0);
    }
}
