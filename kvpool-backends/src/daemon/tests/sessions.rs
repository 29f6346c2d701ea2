//! Engines coming and going on the daemon's socket: one killed holding leases, one sending
//! garbage, one dying with a reply unread, one started before the daemon, many calls at once,
//! and a request too large to answer.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_killed_holding_leases_leaks_nothing_and_its_half_written_value_stays_invisible()
{
    let dir = tempfile::tempdir().unwrap();
    let path = socket(&dir);
    let run = start(&path, 16 * MIB, vec![]);
    let other = client(&path);
    other
        .batch_put(vec![("held".into(), value(1, MIB))])
        .await
        .unwrap();
    let baseline = run.daemon.stats().used_bytes;

    let mut engine = raw_session(&path);
    let Reply::Pinned(pins) = call(
        &mut engine,
        Request::Get {
            keys: vec!["held".into()],
        },
    ) else {
        panic!("no pins")
    };
    assert!(pins[0].is_some());
    let Reply::Prepared(allocs) = call(
        &mut engine,
        Request::PrepareSave {
            lens: vec![MIB as u64; 3],
        },
    ) else {
        panic!("no allocations")
    };
    assert!(allocs.iter().all(Option::is_some));
    // Written (or not: the daemon cannot tell) but never committed: nobody sees it.
    assert_eq!(
        other.batch_exists(&["half".into()]).await.unwrap(),
        vec![false]
    );
    let held = run.daemon.stats();
    assert_eq!((held.pins, held.allocations), (1, 3));
    assert_eq!(held.used_bytes, baseline + 3 * MIB as u64);

    drop(engine); // the process dies: its socket closes
    let after = wait_for(&run.daemon, |s| s.sessions == 1);
    assert_eq!((after.pins, after.allocations), (0, 0));
    assert_eq!(
        after.used_bytes, baseline,
        "the allocations' memory came back"
    );
    assert_eq!(after.leases_reclaimed, 4);
    assert_eq!(
        other
            .batch_get(&["held".into(), "half".into()])
            .await
            .unwrap()[1],
        None
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_from_one_engine_closes_only_its_session() {
    let dir = tempfile::tempdir().unwrap();
    let path = socket(&dir);
    let run = start(&path, 16 * MIB, vec![]);
    let good = client(&path);
    good.batch_put(vec![("k".into(), value(3, 4096))])
        .await
        .unwrap();

    let mut bad = raw_session(&path);
    bad.write_all(&[5, 0, 0, 0, 0xff, 0xfe, 0xfd, 0xfc, 0xfb])
        .unwrap();
    wait_for(&run.daemon, |s| s.refused == 1 && s.sessions == 1);
    // A request before attaching, and an old protocol version, are refused with a reason.
    let mut early = UnixStream::connect(&path).unwrap();
    let reply = call(&mut early, Request::Stats);
    assert!(
        matches!(reply, Reply::Error(ref why) if why.contains("attach first")),
        "{reply:?}"
    );
    let mut old = UnixStream::connect(&path).unwrap();
    let reply = call(
        &mut old,
        Request::Attach {
            version: PROTOCOL_VERSION + 1,
            client: "future".into(),
        },
    );
    assert!(
        matches!(reply, Reply::Error(ref why) if why.contains("protocol version")),
        "{reply:?}"
    );

    let got = good.batch_get(&["k".into()]).await.unwrap();
    assert_eq!(got[0].as_deref(), Some(&[3u8; 4096][..]));
}

/// An engine killed with a reply still unread resets its socket: that is an engine leaving,
/// as every `kill -9` of an engine mid-call does, not garbage to count and warn about.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_that_dies_with_a_reply_unread_leaves_without_a_refusal() {
    let dir = tempfile::tempdir().unwrap();
    let path = socket(&dir);
    let run = start(&path, 16 * MIB, vec![]);
    let mut dying = raw_session(&path);
    wait_for(&run.daemon, |s| s.sessions == 1);
    write_frame(&mut dying, &Request::Stats).unwrap();
    // The reply lands in the socket's buffer and is never read: closing it now resets the
    // connection (ECONNRESET on the daemon's next read) rather than ending it cleanly.
    std::thread::sleep(Duration::from_millis(200));
    drop(dying);
    let after = wait_for(&run.daemon, |s| s.sessions == 0);
    assert_eq!(after.refused, 0, "{after:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_started_before_the_daemon_attaches_once_it_runs() {
    let dir = tempfile::tempdir().unwrap();
    let path = socket(&dir);
    let tier = kvpool_core::TierConfig::new(format!("kvpool+unix://{}", path.display()));
    // Opening succeeds (with a warning): the engine serves with misses meanwhile.
    let request = crate::backend_factory::TierRequest {
        tier: &tier,
        max_chunk_bytes: 1 << 20,
    };
    let engine = crate::backend_factory::BackendFactory::open(&DaemonFactory, &request)
        .await
        .unwrap();
    assert!(
        engine.batch_get(&["k".into()]).await.is_err(),
        "no daemon yet"
    );
    let _run = start(&path, MIB, vec![]);
    tokio::time::sleep(RECONNECT_INTERVAL + Duration::from_millis(100)).await;
    let direct = client(&path);
    direct.attach().unwrap();
    assert_eq!(
        socket_path("unix:///run/kvpool/kvpool.sock").unwrap(),
        PathBuf::from("/run/kvpool/kvpool.sock")
    );
    assert!(socket_path("kvpool+unix://relative.sock").is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_calls_of_one_engine_share_a_few_sessions_and_all_succeed() {
    let dir = tempfile::tempdir().unwrap();
    let path = socket(&dir);
    let run = start(&path, 64 * MIB, vec![]);
    let engine = client(&path);
    let tasks: Vec<_> = (0..32u8)
        .map(|i| {
            let engine = engine.clone();
            tokio::spawn(async move {
                let key = format!("k{i}");
                engine
                    .batch_put(vec![(key.clone(), value(i, 256 << 10))])
                    .await
                    .unwrap();
                let got = engine.batch_get(&[key]).await.unwrap();
                assert_eq!(got[0].as_deref(), Some(&vec![i; 256 << 10][..]));
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    let s = run.daemon.stats();
    assert!(
        (1..=SESSIONS_PER_CONNECTOR as u64).contains(&s.sessions),
        "{s:?}"
    );
    assert_eq!((s.entries, s.pins, s.allocations), (32, 0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_with_too_many_items_is_refused_and_the_session_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let path = socket(&dir);
    let _run = start(&path, MIB, vec![]);
    let mut engine = raw_session(&path);
    let keys = vec![String::new(); MAX_ITEMS_PER_REQUEST + 1];
    let reply = call(&mut engine, Request::Exists { keys });
    assert!(
        matches!(reply, Reply::Error(ref why) if why.contains("items")),
        "{reply:?}"
    );
    let reply = call(
        &mut engine,
        Request::Exists {
            keys: vec!["k".into()],
        },
    );
    assert_eq!(reply, Reply::Exists(vec![false]));
}
