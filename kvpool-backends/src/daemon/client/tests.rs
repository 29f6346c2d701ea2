//! The daemon client's sessions and loans, against a real daemon on a socket in a temp dir.

use super::*;
use crate::daemon::tests::{Running, socket, start};

/// Polls `done` for up to 5 s.
fn eventually(what: &str, mut done: impl FnMut() -> bool) {
    for _ in 0..500 {
        if done() {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!("never: {what}");
}

/// A daemon of 4 MiB on a socket in a fresh temp dir, and a connector to it (not yet
/// attached). The temp dir must outlive both.
fn daemon_and_connector() -> (
    tempfile::TempDir,
    std::path::PathBuf,
    Running,
    DaemonConnector,
) {
    let dir = tempfile::tempdir().unwrap();
    let path = socket(&dir);
    let run = start(&path, 4 << 20, vec![]);
    let connector = DaemonConnector::new(&path, Duration::from_secs(5));
    (dir, path, run, connector)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_loan_outlives_its_session_ending_on_an_error_and_is_reclaimed_after_it() {
    // A save's copy may still write into a place lent on a session that has since ended
    // on an error: the daemon must not reuse that memory until the loan is dropped.
    let (_dir, _path, run, connector) = daemon_and_connector();
    let daemon = run.daemon.clone();
    let inner = connector.inner.clone();
    tokio::task::spawn_blocking(move || {
        let mut lent = inner.lend(vec![4096]).unwrap();
        let loan = lent.pop().flatten().expect("room for 4 KiB");
        assert_eq!(daemon.stats().allocations, 1);
        let ended =
            inner.with_session(|_| -> io::Result<()> { Err(io::Error::other("a bad frame")) });
        assert!(ended.is_err());
        assert!(inner.sessions[0].lock().is_none(), "the session ended");
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(
            daemon.stats().allocations,
            1,
            "still lent while the loan lives"
        );
        drop(loan);
        eventually(
            "the daemon reclaims the loan once its socket closes",
            || daemon.stats().allocations == 0,
        );
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_loan_let_go_on_an_idle_session_is_released_by_another_sessions_call() {
    let (_dir, _path, run, connector) = daemon_and_connector();
    let daemon = run.daemon.clone();
    let inner = connector.inner.clone();
    tokio::task::spawn_blocking(move || {
        inner.with_session(|_| Ok(())).unwrap();
        // Lent on slot 1 (slot 0 busy), then let go; slot 1 sees no call of its own.
        let loan = {
            let _busy = inner.sessions[0].lock();
            inner.lend(vec![4096]).unwrap().pop().flatten().unwrap()
        };
        drop(loan);
        assert_eq!(daemon.stats().allocations, 1);
        inner.with_session(|_| Ok(())).unwrap();
        assert_eq!(
            daemon.stats().allocations,
            0,
            "released through slot 1 by slot 0's call"
        );
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_daemon_ends_every_idle_session_still_attached_to_the_old_one() {
    let (_dir, path, run, connector) = daemon_and_connector();
    let inner = connector.inner.clone();
    let attached = |inner: &Inner, slot: usize| {
        inner.sessions[slot]
            .lock()
            .as_ref()
            .map(|s: &Session| s.daemon_id)
    };
    tokio::task::spawn_blocking(move || {
        // Slot 1 is used only while slot 0 is busy (calls that overlap).
        {
            let _busy = inner.sessions[0].lock();
            inner.with_session(|_| Ok(())).unwrap();
        }
        inner.with_session(|_| Ok(())).unwrap();
        inner
    })
    .await
    .map(|inner| {
        let old = run.daemon.daemon_id;
        assert_eq!(attached(&inner, 0), Some(old));
        assert_eq!(attached(&inner, 1), Some(old));
    })
    .unwrap();

    run.server.shutdown();
    drop(run.daemon);
    let run = start(&path, 4 << 20, vec![]);
    let inner = connector.inner.clone();
    let new = run.daemon.daemon_id;
    tokio::task::spawn_blocking(move || {
        // Slot 0's call fails on the dead daemon (its session ends); once the reconnect
        // interval has passed, the next call attaches to the new one.
        assert!(inner.with_session(|s| s.call(&Request::Stats)).is_err());
        std::thread::sleep(RECONNECT_INTERVAL + Duration::from_millis(100));
        inner.with_session(|_| Ok(())).unwrap();
        assert_eq!(attached(&inner, 0), Some(new));
        assert_eq!(
            attached(&inner, 1),
            None,
            "the idle session on the old daemon ended, unmapping its arena"
        );
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_unmaps_a_dead_daemons_arena_at_its_next_call() {
    // A restarted daemon allocates a new arena at start: an engine still mapping the old one
    // (which keeps its pages alive) would double the node's memory until it attached again.
    let (_dir, _path, run, connector) = daemon_and_connector();
    connector
        .batch_put(vec![("k".into(), Bytes::from(vec![1u8; 4096]))])
        .await
        .unwrap();
    let mapping = connector
        .node_memory_mapping()
        .expect("an attached engine maps the arena");
    let old = Arc::downgrade(&mapping);
    drop(mapping);

    run.server.shutdown();
    drop(run.daemon);
    // The call that finds the daemon gone ends the session and lets its arena go.
    assert!(connector.batch_get(&["k".into()]).await.is_err());
    assert!(connector.node_memory_mapping().is_none());
    // The connector's watch thread may be ending the old session in its own slot at this
    // moment (it drops the session with the slot locked, and a loaded machine can preempt
    // it there): once every slot has been locked, no such drop is in flight.
    for slot in &connector.inner.sessions {
        drop(slot.lock());
    }
    // The thread mapping the arena ahead holds it while it maps one step (4 MiB, the whole
    // of this arena), and may only now be scheduled on a loaded machine: it lets go at the
    // end of that step. Before, it held the arena until all of it was mapped.
    eventually("the engine let go of the dead daemon's arena", || {
        old.upgrade().is_none()
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_engine_unmaps_a_dead_daemons_arena_without_making_a_call() {
    // An engine that makes no call after its daemon died kept the dead daemon's whole arena
    // mapped (and so alive), so a restarted daemon's new arena doubled the node's memory
    // for as long as that engine stayed idle.
    let (_dir, _path, run, connector) = daemon_and_connector();
    connector
        .batch_put(vec![("k".into(), Bytes::from(vec![1u8; 4096]))])
        .await
        .unwrap();
    let old = Arc::downgrade(
        &connector
            .node_memory_mapping()
            .expect("an attached engine maps the arena"),
    );
    run.server.shutdown();
    drop(run.daemon);
    eventually("the idle engine let go of the dead daemon's arena", || {
        connector.node_memory_mapping().is_none() && old.upgrade().is_none()
    });
}

/// Each call an engine makes is timed on its side by kind (what it waited for, the daemon's
/// answer and the scheduling around it: `kvpool_daemon_client_call_seconds`); a refused call
/// (a reply that is an error) too, as it was waited for all the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_call_is_timed_on_the_engines_side_by_kind() {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};

    let dir = tempfile::tempdir().unwrap();
    let path = socket(&dir);
    let _run = start(&path, 4 << 20, vec![]);
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    metrics::with_local_recorder(&recorder, || {
        let mut session = Session::attach(&path, Duration::from_secs(5), None, 0).unwrap();
        for key in ["k", "j"] {
            let reply = session.call(&Request::Exists {
                keys: vec![key.into()],
            });
            assert!(matches!(reply, Ok(Reply::Exists(ref found)) if found == &[false]));
        }
        assert!(matches!(session.call(&Request::Stats), Ok(Reply::Stats(_))));
        let second_attach = Request::Attach {
            version: crate::daemon::protocol::PROTOCOL_VERSION,
            client: "test".into(),
        };
        assert!(session.call(&second_attach).is_err(), "refused");
    });
    let mut timed: Vec<(String, usize)> = snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .filter(|(key, _, _, _)| key.key().name() == crate::telemetry::DAEMON_CLIENT_CALL_SECONDS)
        .map(|(key, _, _, value)| {
            let kind = key.key().labels().find(|l| l.key() == "kind").unwrap();
            let DebugValue::Histogram(samples) = value else {
                panic!("not a histogram");
            };
            (kind.value().to_string(), samples.len())
        })
        .collect();
    timed.sort();
    assert_eq!(
        timed,
        [("attach", 1), ("exists", 2), ("stats", 1)].map(|(k, n)| (k.to_string(), n))
    );
}
