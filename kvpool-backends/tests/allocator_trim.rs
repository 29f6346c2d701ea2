//! `release_free_pages` really gives freed heap pages back: resident memory falls by most of
//! what was freed in the middle of the heap (which glibc's `free` alone keeps resident).

#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[test]
fn freed_heap_pages_leave_resident_memory_when_released() {
    fn resident_anon_kib() -> u64 {
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        let line = status.lines().find(|l| l.starts_with("RssAnon:")).unwrap();
        line.split_whitespace().nth(1).unwrap().parse().unwrap()
    }
    const PIECES: usize = 16 * 1024;
    // 64 MiB in 4 KiB pieces (far below the mmap threshold: all from the heap), every byte
    // written so that it is resident.
    let mut pieces: Vec<Vec<u8>> = (0..PIECES).map(|i| vec![i as u8; 4096]).collect();
    // Keep the last piece so that the freed ones sit below it: glibc can then only trim them
    // with `malloc_trim`, not by shrinking the top of the heap.
    let last = pieces.pop().unwrap();
    drop(pieces);
    let before = resident_anon_kib();
    assert!(kvpool_backends::allocator_trim::release_free_pages());
    let after = resident_anon_kib();
    assert!(
        before.saturating_sub(after) >= 32 * 1024,
        "resident anonymous memory {before} KiB before, {after} KiB after releasing"
    );
    assert_eq!(last[0], (PIECES - 1) as u8);
}
