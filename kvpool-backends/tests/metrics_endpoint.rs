//! `[metrics] listen`: build_pool serves Prometheus metrics, a taken port is a warning and a
//! pool without an endpoint (not a failed start), and a process has exactly one endpoint.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};

use kvpool_core::{ByteSize, PoolConfig};

fn free_port() -> u16 {
    kvpool_testservers::free_port().unwrap()
}

fn config(listen: Option<String>) -> PoolConfig {
    let mut c = PoolConfig::default();
    c.local_cpu.max_size = ByteSize::mib(64);
    c.metrics.listen = listen;
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
async fn build_pool_serves_metrics_once_per_process_and_starts_without_a_taken_port() {
    // Another process's port (TP rank r's port + r may be someone else's): the pool starts,
    // without an endpoint.
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let pool = kvpool_backends::build_pool(&config(Some(addr.clone())))
        .await
        .expect("a taken metrics port does not stop a pool from starting");
    let tokens: Vec<u32> = (0..256).collect();
    assert_eq!(pool.engine.lookup(&tokens).await.unwrap(), 0);
    assert_eq!(kvpool_backends::metrics_address(), None);
    drop(pool);
    let err = kvpool_backends::build_pool(&config(Some("localhost".into())))
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("not an address"), "{err}");

    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let pool = kvpool_backends::build_pool(&config(Some(listen.clone())))
        .await
        .unwrap();
    let tokens: Vec<u32> = (0..512).collect();
    assert_eq!(pool.engine.lookup(&tokens).await.unwrap(), 0);
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(s, "GET /metrics HTTP/1.0\r\n\r\n").unwrap();
    let mut page = String::new();
    s.read_to_string(&mut page).unwrap();
    assert!(
        page.starts_with("HTTP/1.0 200") || page.starts_with("HTTP/1.1 200"),
        "{page}"
    );
    assert!(page.contains("kvpool_l1_capacity_bytes 67108864"), "{page}");
    assert!(page.contains("kvpool_lookup_tokens_total 512"), "{page}");
    assert!(
        page.contains("# HELP kvpool_hit_tokens_total"),
        "help texts are described"
    );

    // The same address again shares the endpoint; another one is refused.
    kvpool_backends::build_pool(&config(Some(listen.clone())))
        .await
        .unwrap();
    let other = format!("127.0.0.1:{}", free_port());
    let err = kvpool_backends::build_pool(&config(Some(other)))
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(&format!("already serves metrics on {listen}")),
        "{err}"
    );
    assert_eq!(
        kvpool_backends::metrics_address(),
        Some(listen.parse().unwrap())
    );
}
