//! Per-request traces of the worker: what it loaded and stored for each request, logged once
//! as one structured `debug` event (target `kvpool::request`) when vLLM says the request
//! finished (`get_finished`). Bounded: past [`MAX_TRACED_REQUESTS`] live requests, new ones
//! are not traced (and counted), so an engine that never reports finished ids cannot grow it.

use std::collections::HashMap;
use std::time::Duration;

/// Most requests traced at once.
pub const MAX_TRACED_REQUESTS: usize = 16_384;

/// What the worker did for one request so far.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RequestTrace {
    /// Tokens the scheduler asked this worker to load.
    pub load_requested_tokens: u64,
    /// Tokens loaded into the engine's cache.
    pub loaded_tokens: u64,
    /// Tokens whose load failed (their blocks were reported).
    pub failed_tokens: u64,
    /// Time fetching, verifying and submitting loads.
    pub load_time: Duration,
    /// Tokens stored into the pool.
    pub stored_tokens: u64,
    /// Time gathering and storing.
    pub store_time: Duration,
    /// Saves that failed.
    pub save_errors: u64,
    /// Loaded tokens per tier that served them (`cpu` for L1, then `disk`, `redis`, ...), in
    /// the order first served.
    pub loaded_tokens_by_tier: Vec<(String, u64)>,
}

impl RequestTrace {
    /// Counts `tokens` loaded from `tier`.
    pub fn add_tier_tokens(&mut self, tier: &str, tokens: u64) {
        match self
            .loaded_tokens_by_tier
            .iter_mut()
            .find(|(t, _)| t == tier)
        {
            Some((_, n)) => *n += tokens,
            None => self.loaded_tokens_by_tier.push((tier.to_string(), tokens)),
        }
    }

    /// `cpu=512 disk=256`: the per-tier loads as one log field.
    pub fn tiers_summary(&self) -> String {
        let parts: Vec<String> = self
            .loaded_tokens_by_tier
            .iter()
            .map(|(tier, n)| format!("{tier}={n}"))
            .collect();
        parts.join(" ")
    }
}

/// The traces of live requests.
#[derive(Debug, Default)]
pub(crate) struct RequestTraces {
    live: HashMap<String, RequestTrace>,
    untraced: u64,
}

impl RequestTraces {
    /// The trace of `req`, started if new; `None` when too many requests are live.
    pub(crate) fn of(&mut self, req: &str) -> Option<&mut RequestTrace> {
        if !self.live.contains_key(req) {
            if self.live.len() >= MAX_TRACED_REQUESTS {
                self.untraced += 1;
                return None;
            }
            self.live.insert(req.to_string(), RequestTrace::default());
        }
        self.live.get_mut(req)
    }

    /// The trace of a live request.
    pub(crate) fn get(&self, req: &str) -> Option<&RequestTrace> {
        self.live.get(req)
    }

    /// Requests being traced.
    pub(crate) fn len(&self) -> usize {
        self.live.len()
    }

    /// Requests not traced because too many were live.
    pub(crate) fn untraced(&self) -> u64 {
        self.untraced
    }

    /// `req` finished: logs its trace and forgets it.
    pub(crate) fn finish(&mut self, req: &str) {
        if let Some(t) = self.live.remove(req) {
            tracing::debug!(
                target: "kvpool::request",
                req,
                load_requested_tokens = t.load_requested_tokens,
                loaded_tokens = t.loaded_tokens,
                loaded_by_tier = %t.tiers_summary(),
                failed_tokens = t.failed_tokens,
                load_ms = t.load_time.as_secs_f64() * 1e3,
                stored_tokens = t.stored_tokens,
                store_ms = t.store_time.as_secs_f64() * 1e3,
                save_errors = t.save_errors,
                "request finished"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traces_are_bounded_and_forgotten_at_finish() {
        let mut t = RequestTraces::default();
        t.of("a").unwrap().loaded_tokens += 5;
        assert_eq!(t.get("a").unwrap().loaded_tokens, 5);
        let a = t.of("a").unwrap();
        a.add_tier_tokens("cpu", 3);
        a.add_tier_tokens("disk", 2);
        a.add_tier_tokens("cpu", 1);
        assert_eq!(a.tiers_summary(), "cpu=4 disk=2");
        t.finish("a");
        assert!(t.get("a").is_none());
        for i in 0..MAX_TRACED_REQUESTS {
            assert!(t.of(&i.to_string()).is_some());
        }
        assert!(t.of("one too many").is_none());
        assert_eq!((t.len(), t.untraced()), (MAX_TRACED_REQUESTS, 1));
        assert!(t.of("0").is_some(), "live ones are still traced");
    }
}
