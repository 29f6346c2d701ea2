//! Tenants: two daemons (as `kvpool serve` runs one per `[[tenant]]`) over one shared lower
//! tier, each with its own socket and arena and its keys under its own prefix there. An
//! engine of tenant B can neither read, learn of, overwrite nor delete tenant A's values, and
//! its mapping holds none of A's bytes.

use std::sync::Arc;
use std::time::Duration;

use kvpool_core::storage::remote::{NodeMemoryConnector, RemoteConnector};

use super::*;
use crate::memory::InMemoryConnector;

fn tenant(dir: &tempfile::TempDir, name: &str, shared: &Arc<dyn RemoteConnector>) -> Running {
    tenant_with(dir, name, shared, None)
}

fn tenant_with(
    dir: &tempfile::TempDir,
    name: &str,
    shared: &Arc<dyn RemoteConnector>,
    mac_key: Option<&[u8]>,
) -> Running {
    let view = NamespacedConnector::new(shared.clone(), format!("tenant/{name}/"));
    let view: Arc<dyn RemoteConnector> = Arc::new(match mac_key {
        Some(key) => view.with_mac_key(key.to_vec()),
        None => view,
    });
    start(
        &dir.path().join(format!("{name}.sock")),
        4 * MIB,
        vec![view],
    )
}

async fn written_below(shared: &Arc<dyn RemoteConnector>, key: &str) {
    for _ in 0..500 {
        if shared.batch_exists(&[key.to_string()]).await.unwrap()[0] {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("{key} never reached the shared tier");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_of_one_tenant_cannot_read_learn_overwrite_or_delete_anothers_values() {
    let dir = tempfile::tempdir().unwrap();
    let shared: Arc<dyn RemoteConnector> = Arc::new(InMemoryConnector::new());
    let _a = tenant(&dir, "a", &shared);
    let _b = tenant(&dir, "b", &shared);
    let a = client(&dir.path().join("a.sock"));
    let b = client(&dir.path().join("b.sock"));
    let (key, theirs) = chunk_value(0x01, &[0xa1; 8192]);
    a.batch_put(vec![(key.clone(), theirs.clone())])
        .await
        .unwrap();
    written_below(&shared, &format!("tenant/a/{key}")).await;

    // B asks for A's key: nothing, in shared memory or below.
    assert_eq!(
        b.batch_exists(std::slice::from_ref(&key)).await.unwrap(),
        [false]
    );
    assert_eq!(
        b.batch_get(std::slice::from_ref(&key)).await.unwrap(),
        [None]
    );
    // B deletes it, then writes its own value under it: A's is untouched.
    assert_eq!(b.batch_delete(std::slice::from_ref(&key)).await.unwrap(), 0);
    let (_, ours) = chunk_value(0x01, &[0xb2; 8192]);
    b.batch_put(vec![(key.clone(), ours)]).await.unwrap();
    written_below(&shared, &format!("tenant/b/{key}")).await;
    let got = a.batch_get(std::slice::from_ref(&key)).await.unwrap();
    assert_eq!(got[0].as_deref(), Some(&theirs[..]));
    // B's mapping is B's arena: none of A's bytes are in it.
    let mapping = b
        .node_memory_mapping()
        .expect("an attached engine maps its arena");
    // SAFETY: the mapping is live (held) and `len` bytes long; read only.
    let arena = unsafe { std::slice::from_raw_parts(mapping.as_ptr().as_ptr(), mapping.len()) };
    assert!(
        !arena.windows(64).any(|w| w.iter().all(|&x| x == 0xa1)),
        "tenant A's bytes are in tenant B's mapping"
    );
    assert!(arena.windows(64).any(|w| w.iter().all(|&x| x == 0xb2)));
}

/// With the tenant's secret, a value someone put in the shared tier under the tenant's key
/// without it (a chunk with a consistent header and checksum) is a miss for the tenant; its
/// own values, tagged by the daemon, come back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_value_forged_in_a_shared_tier_without_the_tenants_secret_is_a_miss() {
    let dir = tempfile::tempdir().unwrap();
    let shared: Arc<dyn RemoteConnector> = Arc::new(InMemoryConnector::new());
    let secret = b"0123456789abcdef0123456789abcdef";
    let run = tenant_with(&dir, "a", &shared, Some(secret));
    let a = client(&dir.path().join("a.sock"));
    let (mine, my_value) = chunk_value(4, &[1u8; 4096]);
    a.batch_put(vec![(mine.clone(), my_value.clone())])
        .await
        .unwrap();
    written_below(&shared, &format!("tenant/a/{mine}")).await;
    let stored = shared
        .batch_get(&[format!("tenant/a/{mine}")])
        .await
        .unwrap();
    assert_eq!(
        stored[0].as_ref().unwrap().len(),
        my_value.len() + MAC_BYTES
    );
    // A forger writes a well-formed chunk under another of the tenant's keys.
    let (forged_key, forged) = chunk_value(5, &[9u8; 4096]);
    shared
        .batch_put(vec![(format!("tenant/a/{forged_key}"), forged)])
        .await
        .unwrap();
    // A fresh daemon for the tenant (nothing in shared memory): both come from below.
    run.server.shutdown();
    drop(run.daemon);
    // The engine notices (a failed call), then attaches to the new daemon by itself.
    assert!(a.batch_get(std::slice::from_ref(&mine)).await.is_err());
    let _run = tenant_with(&dir, "a", &shared, Some(secret));
    tokio::time::sleep(RECONNECT_INTERVAL + Duration::from_millis(100)).await;
    let got = a.batch_get(&[mine.clone(), forged_key]).await.unwrap();
    assert_eq!(
        got[0].as_deref(),
        Some(&my_value[..]),
        "its own value, checked"
    );
    assert_eq!(got[1], None, "the forged value is a miss");
    assert!(
        !shared
            .exists(&format!("tenant/a/{}", chunk_value(5, &[]).0))
            .await
            .unwrap(),
        "and is deleted: lookups stop offering it"
    );
}

/// An untenanted daemon over tiers tenants also use refuses keys in their namespaces.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_untenanted_daemon_refuses_keys_in_tenants_namespaces() {
    let dir = tempfile::tempdir().unwrap();
    let shared: Arc<dyn RemoteConnector> = Arc::new(InMemoryConnector::new());
    let _run = start(&dir.path().join("open.sock"), MIB, vec![shared.clone()]);
    let mut s = raw_session(&dir.path().join("open.sock"));
    let reply = call(
        &mut s,
        Request::Get {
            keys: vec!["tenant/a/k".into()],
        },
    );
    assert!(
        matches!(reply, Reply::Error(ref why) if why.contains("tenants")),
        "{reply:?}"
    );
}

/// A daemon's lower tier may be shared with other programs (one Redis, one bucket): an engine
/// that can attach reaches only kvpool keys there. Another program's value is not read,
/// probed, overwritten or deleted through the daemon, whatever key the engine names; a value
/// the engine commits under such a key stays in shared memory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_reaches_only_kvpool_keys_in_a_shared_lower_tier() {
    let dir = tempfile::tempdir().unwrap();
    let path = socket(&dir);
    let shared: Arc<dyn RemoteConnector> = Arc::new(InMemoryConnector::new());
    let secret = Bytes::from_static(b"another program's session token");
    shared.put("app:session", secret.clone()).await.unwrap();
    let run = start(&path, 16 * MIB, vec![shared.clone()]);
    let engine = client(&path);
    let key = ["app:session".to_string()];
    assert_eq!(engine.batch_exists(&key).await.unwrap(), [false]);
    assert_eq!(engine.batch_get(&key).await.unwrap(), [None]);
    assert_eq!(engine.batch_delete(&key).await.unwrap(), 0);
    engine
        .batch_put(vec![("app:session".into(), value(0xee, 4096))])
        .await
        .unwrap();
    // The engine's own value is in shared memory; the tier keeps the program's.
    let got = engine.batch_get(&key).await.unwrap();
    assert_eq!(got[0].as_deref(), Some(&vec![0xee; 4096][..]));
    // A kvpool key committed alongside reaches the tier (the write-behind ran).
    let (k, v) = chunk_value(9, &[9u8; 4096]);
    engine.batch_put(vec![(k.clone(), v)]).await.unwrap();
    written_below(&shared, &k).await;
    assert_eq!(shared.get("app:session").await.unwrap(), Some(secret));
    assert_eq!(run.daemon.stats().tier_hits, 0);
}

/// Each tenant's options carry its own arena size and copy buffers sized by that arena, not
/// the daemon-wide ones (`kvpool serve` builds every tenant's from one base).
#[test]
fn a_tenants_options_size_its_copy_buffers_by_its_own_arena() {
    let base = options(1024 * MIB);
    let small = base.for_tenant("small", 64 * MIB);
    assert_eq!(small.tenant, "small");
    assert_eq!(small.capacity, 64 * MIB);
    assert_eq!(small.copy_buffer_bytes, default_copy_buffer_bytes(64 * MIB));
    assert!(small.copy_buffer_bytes < base.copy_buffer_bytes);
    assert_eq!(small.write_behind_quota, base.write_behind_quota);
}
