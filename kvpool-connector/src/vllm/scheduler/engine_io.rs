//! What the engine's scheduler hands the connector's scheduler side each step (requests, their
//! block lists) and what the workers report back for a step.

/// A request as the engine's scheduler sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineRequest {
    /// Request id.
    pub req_id: String,
    /// Prompt token ids.
    pub prompt_token_ids: Vec<u32>,
    /// Do not save this request's KV (e.g. a private prompt).
    pub skip_save: bool,
    /// What the request's KV depends on besides its token ids: LoRA adapter, multimodal input
    /// hashes, cache salt (see [`crate::extra_keys`]). Empty for a plain text request.
    pub extra_keys: Vec<u8>,
}

/// How a step changes a request's engine block list.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum BlockUpdate {
    /// No new blocks.
    #[default]
    Unchanged,
    /// Blocks allocated this step, appended (vLLM `scheduled_cached_reqs.new_block_ids`).
    Append(Vec<u32>),
    /// The whole list (a new request, or one resumed after preemption).
    Replace(Vec<u32>),
}

/// One scheduled request of a step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScheduledRequest {
    /// Request id.
    pub req_id: String,
    /// Tokens joining the sequence (generated ones, with `save_decode_tokens`), starting at
    /// position `new_tokens_start` of the request's sequence: the scheduler's own count
    /// ([`ConnectorScheduler::token_count`](super::ConnectorScheduler::token_count)), so both sides agree on the sequence by
    /// construction; a mismatch stops the request's decode saves.
    pub new_token_ids: Vec<u32>,
    /// The position of `new_token_ids[0]`.
    pub new_tokens_start: usize,
    /// How the request's blocks changed.
    pub blocks: BlockUpdate,
    /// Tokens whose KV will be in the engine's cache when this step ends.
    pub num_computed_tokens_after_step: usize,
}

/// What the workers reported back for a step (vLLM's `KVConnectorOutput`, aggregated over
/// ranks).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ConnectorOutput {
    /// Requests whose asynchronous loads ended on every rank.
    pub finished_recving: Vec<String>,
    /// Engine blocks whose load failed on some rank: the engine recomputes them.
    pub failed_block_ids: Vec<u32>,
    /// Steps run, with how many ranks reported each.
    pub executed_steps: Vec<(u64, u32)>,
    /// Steps whose save copies ended, with how many ranks reported each.
    pub copied_steps: Vec<(u64, u32)>,
}
