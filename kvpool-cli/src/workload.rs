//! The synthetic serving workload of `kvpool bench`: shared system prompts and multi-turn chats.

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

/// Shape of the workload.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct WorkloadSpec {
    /// Distinct system prompts shared by sessions.
    pub system_prompts: usize,
    /// Tokens per system prompt.
    pub system_prompt_tokens: usize,
    /// Concurrent chat sessions.
    pub sessions: usize,
    /// Turns per session.
    pub turns: usize,
    /// New user tokens per turn.
    pub user_tokens: usize,
    /// Model output tokens per turn (they join the history).
    pub output_tokens: usize,
    /// Random seed.
    pub seed: u64,
}

impl WorkloadSpec {
    /// Requests the workload issues.
    pub fn requests(&self) -> usize {
        self.sessions * self.turns
    }

    /// Longest prompt in tokens.
    pub fn max_prompt_tokens(&self) -> usize {
        self.system_prompt_tokens + self.turns * (self.user_tokens + self.output_tokens)
    }
}

fn random_tokens(rng: &mut SmallRng, n: usize) -> Vec<u32> {
    (0..n).map(|_| rng.random_range(0..128_000)).collect()
}

/// Generates requests turn by turn, sessions interleaved, so reuse competes for capacity.
pub struct Workload {
    spec: WorkloadSpec,
    rng: SmallRng,
    histories: Vec<Vec<u32>>,
    next: usize,
}

impl Workload {
    /// A deterministic workload for `spec`.
    pub fn new(spec: WorkloadSpec) -> Self {
        let mut rng = SmallRng::seed_from_u64(spec.seed);
        let prompts: Vec<Vec<u32>> = (0..spec.system_prompts.max(1))
            .map(|_| random_tokens(&mut rng, spec.system_prompt_tokens))
            .collect();
        let histories = (0..spec.sessions)
            .map(|s| prompts[s % prompts.len()].clone())
            .collect();
        Workload {
            spec,
            rng,
            histories,
            next: 0,
        }
    }
}

impl Iterator for Workload {
    type Item = Vec<u32>;

    /// The next prompt: the session's history plus a new user message. The history then grows
    /// by that message and the model's output.
    fn next(&mut self) -> Option<Vec<u32>> {
        if self.next >= self.spec.requests() {
            return None;
        }
        let session = self.next % self.spec.sessions;
        self.next += 1;
        let user = random_tokens(&mut self.rng, self.spec.user_tokens);
        let output = random_tokens(&mut self.rng, self.spec.output_tokens);
        let history = &mut self.histories[session];
        history.extend_from_slice(&user);
        let prompt = history.clone();
        history.extend_from_slice(&output);
        Some(prompt)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sessions_share_system_prompts_and_grow() {
        let spec = WorkloadSpec {
            system_prompts: 2,
            system_prompt_tokens: 10,
            sessions: 4,
            turns: 2,
            user_tokens: 3,
            output_tokens: 2,
            seed: 1,
        };
        let reqs: Vec<Vec<u32>> = Workload::new(spec).collect();
        assert_eq!(reqs.len(), 8);
        assert_eq!(
            reqs[0][..10],
            reqs[2][..10],
            "sessions 0 and 2 share prompt 0"
        );
        assert_ne!(reqs[0][..10], reqs[1][..10]);
        assert_eq!(reqs[4].len(), 10 + 3 + 2 + 3);
        assert_eq!(reqs[4][..13], reqs[0][..], "turn 2 extends turn 1");
        assert_eq!(
            reqs.iter().map(Vec::len).max().unwrap(),
            spec.max_prompt_tokens() - 2
        );
    }
}
