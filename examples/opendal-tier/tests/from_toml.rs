//! The OpenDAL tier is selected by URL from a kvpool TOML config, and KV stored through it
//! comes back byte-exact through a fresh pool (so from the filesystem, not from L1).

use kvpool_core::PoolConfig;

fn demo_config(root: &std::path::Path) -> PoolConfig {
    let text = include_str!("../kvpool-opendal.toml")
        .replace("$TMPDIR/kvpool-opendal-demo", &root.display().to_string());
    PoolConfig::from_toml(&text).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_pool_loads_kv_stored_through_the_opendal_tier() {
    let _ = kvpool_opendal_tier::register();
    let dir = tempfile::tempdir().unwrap();
    let config = demo_config(dir.path());
    let report = kvpool_opendal_tier::demo::store_then_reload(&config, 1000)
        .await
        .unwrap();
    // 1000 tokens in 64-token chunks: 15 whole chunks (the partial 16th is not stored).
    assert_eq!(report.stored_chunks, 15);
    assert_eq!(report.loaded_tokens, 960);
    assert!(report.bytes_match);
    assert_eq!(
        report.served_by,
        [("cpu".to_string(), 0), ("opendal-fs".to_string(), 15)]
    );
    let files = walk(dir.path());
    assert!(files >= 15, "{files} chunk files");
}

/// Files under `dir` (recursively), ignoring the atomic-write scratch directory.
fn walk(dir: &std::path::Path) -> usize {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.file_name().is_some_and(|n| n != ".tmp"))
        .map(|p| if p.is_dir() { walk(&p) } else { 1 })
        .sum()
}

#[tokio::test]
async fn options_the_tier_does_not_take_and_relative_paths_are_errors() {
    let _ = kvpool_opendal_tier::register();
    let mut config = demo_config(std::path::Path::new("/tmp/unused"));
    config.tiers[0].url = "opendal+fs://relative".into();
    let err = kvpool_backends::build_pool(&config).await.unwrap_err();
    assert!(err.to_string().contains("absolute path"), "{err}");
    config.tiers[0].url = "opendal+fs:///tmp/kvpool-opendal-options".into();
    config.tiers[0].options.set("atomic_write_dri", "/tmp/x");
    let err = kvpool_backends::build_pool(&config).await.unwrap_err();
    assert!(
        err.to_string().contains("`atomic_write_dri`")
            && err.to_string().contains("atomic_write_dir"),
        "{err}"
    );
}

#[test]
fn the_demo_binary_selects_the_tier_from_toml_and_prints_identical_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("kvpool.toml");
    let text = include_str!("../kvpool-opendal.toml").replace(
        "$TMPDIR/kvpool-opendal-demo",
        &dir.path().join("tier").display().to_string(),
    );
    std::fs::write(&path, text).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvpool-opendal-demo"))
        .arg(&path)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("opendal-fs   served 15 chunks"), "{stdout}");
    assert!(stdout.contains("bytes identical"), "{stdout}");
}
