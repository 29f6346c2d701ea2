//! What the daemon records about its own work: each request's time by kind.

use metrics_util::debugging::{DebugValue, DebuggingRecorder};

use super::*;
use crate::telemetry;

/// Every request the daemon answers is timed under its kind and tenant, one it refuses after
/// decoding too (a frame refused before decoding, in `read_request`, never reaches `handle`).
#[tokio::test]
async fn each_request_is_timed_by_its_kind() {
    let daemon =
        PoolDaemon::with_tiers(options(MIB), vec![], tokio::runtime::Handle::current()).unwrap();
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    metrics::with_local_recorder(&recorder, || {
        let session = daemon.new_session();
        let exists = daemon.handle(
            session,
            Request::Exists {
                keys: vec!["k".into()],
            },
        );
        assert!(matches!(exists, Reply::Exists(ref found) if found == &[false]));
        daemon.handle(
            session,
            Request::Exists {
                keys: vec!["j".into()],
            },
        );
        assert!(matches!(
            daemon.handle(session, Request::Stats),
            Reply::Stats(_)
        ));
        // Refused (too many items): timed all the same.
        let keys = vec!["k".to_string(); MAX_ITEMS_PER_REQUEST + 1];
        assert!(matches!(
            daemon.handle(session, Request::Get { keys }),
            Reply::Error(_)
        ));
        daemon.end_session(session);
    });
    let mut timed: Vec<(String, String, usize)> = snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .filter(|(key, _, _, _)| key.key().name() == telemetry::DAEMON_REQUEST_SECONDS)
        .map(|(key, _, _, value)| {
            let label = |name: &str| {
                key.key()
                    .labels()
                    .find(|l| l.key() == name)
                    .map(|l| l.value().to_string())
                    .expect("labelled")
            };
            let DebugValue::Histogram(samples) = value else {
                panic!("not a histogram");
            };
            (label("tenant"), label("kind"), samples.len())
        })
        .collect();
    timed.sort();
    let expected = [
        ("default", "exists", 2),
        ("default", "get", 1),
        ("default", "stats", 1),
    ]
    .map(|(tenant, kind, n)| (tenant.to_string(), kind.to_string(), n));
    assert_eq!(timed, expected);
}
