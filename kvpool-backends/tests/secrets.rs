//! No secret (a URL's password, an S3 secret key) appears in `Debug` output or error messages.

use kvpool_core::{PoolConfig, TierConfig};

const SECRET: &str = "hunter2-secret";

fn assert_hidden(what: &str, text: &str) {
    assert!(!text.contains(SECRET), "{what} shows the secret: {text}");
}

#[test]
fn configs_hide_secrets_in_debug_output() {
    let tier = TierConfig::new(format!("redis://user:{SECRET}@127.0.0.1:6379"))
        .with_option("access_key_id", "AKIDEXAMPLE")
        .with_option("secret_access_key", SECRET)
        .with_option("password", SECRET)
        .with_option("endpoint", format!("http://admin:{SECRET}@127.0.0.1:9000"));
    assert_hidden("TierConfig", &format!("{tier:?}"));
    assert!(
        format!("{tier:?}").contains("AKIDEXAMPLE"),
        "the key id is not a secret"
    );
    let mut pool = PoolConfig::default();
    pool.tiers.push(tier);
    assert_hidden("PoolConfig", &format!("{pool:?}"));
    assert_hidden("PoolConfig (pretty)", &format!("{pool:#?}"));
    #[cfg(feature = "redis")]
    {
        let redis = kvpool_backends::redis::RedisConfig::new(format!(
            "redis+cluster://user:{SECRET}@127.0.0.1:7000,127.0.0.1:7001"
        ));
        assert_hidden("RedisConfig", &format!("{redis:?}"));
    }
    #[cfg(feature = "s3")]
    {
        let mut s3 = kvpool_backends::s3::S3Config::new("s3://bucket/prefix");
        s3.credentials = Some(("AKIDEXAMPLE".into(), SECRET.into()));
        assert_hidden("S3Config", &format!("{s3:?}"));
    }
}

#[tokio::test]
async fn errors_do_not_echo_passwords() {
    let err = kvpool_backends::registry::scheme_of(&format!("user:{SECRET}@host:6379"))
        .unwrap_err()
        .to_string();
    assert_hidden("a non-URL's error", &err);
    #[cfg(feature = "redis")]
    {
        // Nothing listens on port 1: the tier opens down (a miss, retried in the background),
        // and the error its calls answer names the URL.
        use kvpool_core::RemoteConnector;
        let mut tier = TierConfig::new(format!("redis://user:{SECRET}@127.0.0.1:1"));
        tier.timeout_ms = 500;
        let down = kvpool_backends::registry::open_connector(&tier, 1 << 20)
            .await
            .unwrap();
        let err = down.batch_get(&["k".to_string()]).await.unwrap_err();
        assert!(err.to_string().contains("127.0.0.1:1"), "{err}");
        assert_hidden("a Redis connection error", &err.to_string());
        assert_hidden("a Redis connection error (Debug)", &format!("{err:?}"));
    }
    // A backend's complaint about one of its options names the tier without its password.
    let mut config = PoolConfig::default();
    config
        .tiers
        .push(TierConfig::new(format!("memory://user:{SECRET}@h")).with_option("colour", "blue"));
    let err = kvpool_backends::build_pool(&config).await.unwrap_err();
    assert!(err.to_string().contains("`colour`"), "{err}");
    assert_hidden("an option error", &err.to_string());
}
