//! The public Mooncake trace format (JSONL): reading with line-numbered errors, and a generator.

use std::io::{BufRead, Write};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

/// Tokens per `hash_ids` block in Mooncake traces.
pub const TRACE_BLOCK_TOKENS: usize = 512;

/// One request of a Mooncake trace.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TraceRequest {
    /// Arrival time in milliseconds.
    pub timestamp: u64,
    /// Prompt tokens.
    pub input_length: usize,
    /// Generated tokens.
    pub output_length: usize,
    /// Ids of the prompt's 512-token blocks; equal ids mean equal prefixes.
    pub hash_ids: Vec<u64>,
}

/// A line that could not be used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadLine {
    /// 1-based line number.
    pub line: usize,
    /// What was wrong.
    pub error: String,
}

/// Parses a JSONL trace; bad lines are returned with their numbers instead of aborting.
pub fn read_trace(reader: impl BufRead) -> std::io::Result<(Vec<TraceRequest>, Vec<BadLine>)> {
    let mut requests = Vec::new();
    let mut bad = Vec::new();
    for (i, line) in reader.lines().enumerate() {
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        match serde_json::from_str::<TraceRequest>(&line) {
            Ok(r) => requests.push(r),
            Err(e) => bad.push(BadLine {
                line: i + 1,
                error: e.to_string(),
            }),
        }
    }
    Ok((requests, bad))
}

/// Shape of a generated trace.
#[derive(Debug, Clone, Copy)]
pub struct TraceSpec {
    /// Requests.
    pub requests: usize,
    /// Shared documents (prefixes) requests draw from.
    pub documents: usize,
    /// Zipf exponent of document popularity.
    pub zipf: f64,
    /// Seed.
    pub seed: u64,
}

/// Writes a synthetic trace in the Mooncake format: each prompt is a prefix of a shared
/// document (Zipf-popular, 1K-30K tokens) followed by a unique suffix (200-4000 tokens), which
/// averages about 12K input tokens per request.
pub fn generate_trace(spec: TraceSpec, mut out: impl Write) -> std::io::Result<u64> {
    let mut rng = SmallRng::seed_from_u64(spec.seed);
    let docs = spec.documents.max(1);
    let doc_len: Vec<usize> = (0..docs).map(|_| rng.random_range(1_000..30_000)).collect();
    let mut cdf = Vec::with_capacity(docs);
    let mut acc = 0.0;
    for i in 0..docs {
        acc += 1.0 / ((i + 1) as f64).powf(spec.zipf);
        cdf.push(acc);
    }
    let mut next_unique = 1u64 << 40;
    let mut total_tokens = 0u64;
    let mut timestamp = 0u64;
    for _ in 0..spec.requests {
        let x = rng.random::<f64>() * acc;
        let d = cdf.partition_point(|&c| c < x).min(docs - 1);
        let shared_blocks =
            (doc_len[d] as f64 * rng.random_range(0.3..1.0)) as usize / TRACE_BLOCK_TOKENS;
        let suffix = rng.random_range(200..4_000);
        let input_length = shared_blocks * TRACE_BLOCK_TOKENS + suffix;
        let total_blocks = input_length.div_ceil(TRACE_BLOCK_TOKENS);
        let mut hash_ids: Vec<u64> = (0..shared_blocks as u64)
            .map(|j| ((d as u64) << 20) | j)
            .collect();
        for _ in shared_blocks..total_blocks {
            hash_ids.push(next_unique);
            next_unique += 1;
        }
        timestamp += rng.random_range(0..300);
        let r = TraceRequest {
            timestamp,
            input_length,
            output_length: rng.random_range(10..600),
            hash_ids,
        };
        serde_json::to_writer(&mut out, &r)?;
        out.write_all(b"\n")?;
        total_tokens += input_length as u64;
    }
    out.flush()?;
    Ok(total_tokens)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_good_lines_and_numbers_bad_ones() {
        let text = "{\"timestamp\":0,\"input_length\":600,\"output_length\":5,\"hash_ids\":[1,2]}\n\
                    \n\
                    not json\n\
                    {\"timestamp\":1,\"input_length\":\"x\",\"output_length\":5,\"hash_ids\":[]}\n";
        let (reqs, bad) = read_trace(text.as_bytes()).unwrap();
        assert_eq!(reqs.len(), 1);
        assert_eq!(reqs[0].hash_ids, vec![1, 2]);
        assert_eq!(bad.iter().map(|b| b.line).collect::<Vec<_>>(), vec![3, 4]);
    }

    #[test]
    fn generated_traces_parse_and_share_prefixes() {
        let mut buf = Vec::new();
        let spec = TraceSpec {
            requests: 200,
            documents: 10,
            zipf: 1.0,
            seed: 3,
        };
        let total = generate_trace(spec, &mut buf).unwrap();
        let (reqs, bad) = read_trace(buf.as_slice()).unwrap();
        assert!(bad.is_empty());
        assert_eq!(reqs.len(), 200);
        assert_eq!(
            reqs.iter().map(|r| r.input_length as u64).sum::<u64>(),
            total
        );
        for r in &reqs {
            assert_eq!(
                r.hash_ids.len(),
                r.input_length.div_ceil(TRACE_BLOCK_TOKENS)
            );
        }
        let firsts: std::collections::HashSet<u64> = reqs
            .iter()
            .filter_map(|r| r.hash_ids.first().copied())
            .collect();
        assert!(
            firsts.len() < reqs.len(),
            "some requests share a first block"
        );
    }
}
