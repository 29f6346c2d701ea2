//! The OpenDAL tier passes kvpool's conformance kit, on a real local filesystem, exactly as
//! kvpool's own backends do.

use std::sync::Arc;

use bytes::Bytes;
use kvpool_backends::conformance::{self, Outcome, Subject};
use kvpool_backends::registry::open_tier;
use kvpool_core::{ChunkCodec, TierConfig};

/// A conformance subject: the tier opened by URL through kvpool's registry (so the chunk
/// format and timeouts are kvpool's own), with hooks that corrupt or copy the files directly.
async fn subject(root: &std::path::Path) -> Subject {
    let _ = kvpool_opendal_tier::register(); // the first call registers; later ones find it taken
    let url = format!("opendal+fs://{}", root.display());
    let backend = open_tier(&TierConfig::new(url), ChunkCodec::default(), 64 << 20)
        .await
        .expect("the OpenDAL tier opens");
    let file_of = {
        let root = root.to_path_buf();
        move |key: &str| {
            let shard: String = key.chars().rev().take(2).collect();
            root.join(shard).join(key)
        }
    };
    let corrupt_file = file_of.clone();
    Subject::new(backend, 32 << 20)
        .with_corruptor(Arc::new(move |key| {
            let path = corrupt_file(&key.to_string());
            Box::pin(async move {
                assert!(path.exists(), "{} was stored", path.display());
                std::fs::write(&path, Bytes::from_static(b"not a chunk")).unwrap();
            })
        }))
        .with_raw_copier(Arc::new(move |from, to| {
            let (from, to) = (file_of(&from.to_string()), file_of(&to.to_string()));
            Box::pin(async move {
                std::fs::create_dir_all(to.parent().unwrap()).unwrap();
                std::fs::copy(&from, &to).unwrap();
            })
        }))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn opendal_fs_tier_passes_the_conformance_kit() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().to_path_buf();
    let results = conformance::run_all(&|| subject(&root)).await;
    conformance::assert_all_passed("opendal-fs", &results);
    // The checks of stored bytes ran (they are skipped only for tiers without raw access).
    for check in ["corrupted_value_rejected", "value_under_wrong_key_rejected"] {
        let result = results.iter().find(|r| r.name == check).unwrap();
        assert_eq!(result.outcome, Outcome::Passed, "{check}");
    }
}
