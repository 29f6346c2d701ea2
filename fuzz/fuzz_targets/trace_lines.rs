//! `kvpool replay`'s trace reader (JSONL from users): never a panic; every line is either a
//! request or a reported bad line.
#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "../../kvpool-cli/src/trace.rs"]
#[allow(dead_code)]
mod trace;

fuzz_target!(|data: &[u8]| {
    if let Ok((requests, bad)) = trace::read_trace(data) {
        let lines = data.split(|&b| b == b'\n').count();
        assert!(requests.len() + bad.len() <= lines);
    }
});
