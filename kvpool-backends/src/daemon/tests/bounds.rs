//! The daemon bounded against its clients: repeated keys, frames built to cost memory,
//! requests that stall half-way, and sessions that hoard leases.

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use kvpool_core::frame::write_frame;

use super::*;

/// The resident set of this process, in bytes (the daemon runs in it).
fn rss() -> usize {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kib: usize = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches(" kB").trim().parse().ok())
        .unwrap();
    kib << 10
}

/// `GetResident` naming one key 65,536 times pins it once (before: 65,536 pins, each made
/// with a sweep of every lease under the daemon's lock, about 10^9 steps), and another
/// session is answered meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_repeated_65536_times_is_pinned_once_and_others_are_answered() {
    let dir = tempfile::tempdir().unwrap();
    let path = socket(&dir);
    let run = start(&path, 16 * MIB, vec![]);
    client(&path)
        .batch_put(vec![("k".into(), value(1, 4096))])
        .await
        .unwrap();
    let storm = std::thread::spawn({
        let path = path.clone();
        move || {
            let mut s = raw_session(&path);
            let keys = vec!["k".to_string(); MAX_ITEMS_PER_REQUEST];
            // The session stays open (its pins with it) until the caller drops it.
            (call(&mut s, Request::GetResident { keys }), s)
        }
    });
    // Another engine, meanwhile: answered (a liveness bound, not a timing: the old code took
    // minutes).
    let mut other = raw_session(&path);
    let started = Instant::now();
    let reply = call(
        &mut other,
        Request::Exists {
            keys: vec!["k".into()],
        },
    );
    assert_eq!(reply, Reply::Exists(vec![true]));
    assert!(started.elapsed() < Duration::from_secs(10));
    let (reply, _storm_session) = storm.join().unwrap();
    let Reply::Pinned(regions) = reply else {
        panic!("{reply:?}")
    };
    assert_eq!(regions.len(), MAX_ITEMS_PER_REQUEST);
    assert!(regions.iter().all(|r| *r == regions[0] && r.is_some()));
    assert_eq!(run.daemon.stats().pins, 1, "one pin for one key");
}

/// Fifty engines each send an 8 MiB frame of empty strings (8 million "keys"): each is
/// refused from the frame's first bytes, read to its end without being stored, and the
/// daemon's memory stays within a bound (stated: 64 MiB over the start, for 400 MiB sent).
/// Before, each frame was decoded first (about 200 MB of heap per frame).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frames_built_to_cost_memory_are_refused_before_they_are_stored() {
    let dir = tempfile::tempdir().unwrap();
    let path = socket(&dir);
    let run = start(&path, MIB, vec![]);
    let before = rss();
    let body_len = MAX_REQUEST_BYTES - 8;
    let senders: Vec<_> = (0..50)
        .map(|_| {
            let path = path.clone();
            std::thread::spawn(move || {
                let mut s = raw_session(&path);
                // Exists (variant 1), then a count of `items` as a varint, then that many
                // empty strings (one zero byte each).
                let items = body_len - 5;
                let mut head = (body_len as u32).to_le_bytes().to_vec();
                head.push(1);
                let mut n = items as u64;
                while n >= 0x80 {
                    head.push((n as u8) | 0x80);
                    n >>= 7;
                }
                head.push(n as u8);
                s.write_all(&head).unwrap();
                // The empty strings, streamed (this test's own memory stays small).
                let zeros = [0u8; 64 << 10];
                let mut left = body_len - (head.len() - 4);
                while left > 0 {
                    let n = left.min(zeros.len());
                    s.write_all(&zeros[..n]).unwrap();
                    left -= n;
                }
                let reply: Reply = kvpool_core::frame::read_frame(&mut s).unwrap();
                // The session goes on.
                let again = call(
                    &mut s,
                    Request::Exists {
                        keys: vec!["x".into()],
                    },
                );
                (reply, again)
            })
        })
        .collect();
    for sender in senders {
        let (reply, again) = sender.join().unwrap();
        assert!(
            matches!(reply, Reply::Error(ref why) if why.contains("items")),
            "{reply:?}"
        );
        assert_eq!(again, Reply::Exists(vec![false]));
    }
    let grown = rss().saturating_sub(before);
    assert!(
        grown < 64 * MIB,
        "the daemon's process grew by {grown} bytes"
    );
    assert!(run.daemon.stats().refused >= 50);
}

/// A request whose length arrived but whose body trickles in (a byte every 2 s, each read
/// well within any per-read timeout) closes its session once `FRAME_BODY_TIMEOUT` has passed
/// since the length (an idle session between requests is not bounded).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_trickling_in_closes_its_session_at_its_deadline() {
    let dir = tempfile::tempdir().unwrap();
    let path = socket(&dir);
    let run = start(&path, MIB, vec![]);
    let mut s = raw_session(&path);
    wait_for(&run.daemon, |st| st.sessions == 1);
    s.write_all(&100u32.to_le_bytes()).unwrap();
    let started = Instant::now();
    let mut trickle = s.try_clone().unwrap();
    let limit = super::super::server::FRAME_BODY_TIMEOUT;
    std::thread::spawn(move || {
        for _ in 0..20 {
            if trickle.write_all(&[1]).is_err() {
                return;
            }
            std::thread::sleep(Duration::from_secs(2));
        }
    });
    let mut byte = [0u8; 1];
    s.set_read_timeout(Some(limit * 4)).unwrap();
    // The daemon closes the socket: the read ends (EOF), at the body's deadline.
    assert_eq!(s.read(&mut byte).unwrap_or(0), 0);
    let took = started.elapsed();
    assert!(took >= limit && took < limit * 3, "closed after {took:?}");
    wait_for(&run.daemon, |st| st.sessions == 0 && st.refused == 1);
    let _ = write_frame(&mut s, &Request::Stats);
}

/// One process holds at most `MAX_SESSIONS_PER_PROCESS` sessions: the next connection is
/// refused (before, one process could open all 1,024 and lock every other engine out), and a
/// session it ends makes room for another.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_process_cannot_take_more_than_its_share_of_sessions() {
    use crate::daemon::server::MAX_SESSIONS_PER_PROCESS;
    let dir = tempfile::tempdir().unwrap();
    let path = socket(&dir);
    let run = start(&path, 4 * MIB, vec![]);
    // Connections that have not attached yet hold a session each.
    let mut held: Vec<UnixStream> = (0..MAX_SESSIONS_PER_PROCESS)
        .map(|_| UnixStream::connect(&path).unwrap())
        .collect();
    wait_for(&run.daemon, |s| {
        s.sessions == MAX_SESSIONS_PER_PROCESS as u64
    });
    let mut one_more = UnixStream::connect(&path).unwrap();
    one_more
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    match read_frame::<Reply>(&mut one_more).unwrap() {
        Reply::Error(why) => assert!(why.contains("per process"), "{why}"),
        other => panic!("not refused: {other:?}"),
    }
    // One of them leaves: a new connection is served (it attaches).
    drop(held.pop());
    wait_for(&run.daemon, |s| {
        s.sessions == MAX_SESSIONS_PER_PROCESS as u64 - 1
    });
    drop(raw_session(&path));
}
