//! The one place an engine integration's facts become a key scope's model text:
//! `<name>@w=<weights>|<interface>=<digest of the byte layout>`, and a part's below it.

use std::fmt;
use std::str::FromStr;

/// How an engine hands kvpool its KV. Each interface stores other bytes for the same tokens
/// (whole engine blocks, rows of vLLM's offloading region, SGLang's host pages), so each has a
/// scope of its own and two interfaces never share a value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EngineInterface {
    /// vLLM's KV connector (`kvpool.vllm`): chunks of whole engine blocks. Tag `kv`.
    VllmConnector,
    /// A secondary tier of vLLM's native offloading (`kvpool.vllm.tier`): rows of vLLM's CPU
    /// region. Tag `offload`.
    VllmOffloadTier,
    /// SGLang's HiCache storage backend (`kvpool.sglang`): pages of SGLang's host pool. Tag
    /// `sglang`.
    SglangHiCache,
}

impl EngineInterface {
    /// Every interface, in declaration order.
    pub const ALL: [EngineInterface; 3] = [
        EngineInterface::VllmConnector,
        EngineInterface::VllmOffloadTier,
        EngineInterface::SglangHiCache,
    ];

    /// The tag the scope text carries (`kv`, `offload`, `sglang`).
    pub fn tag(self) -> &'static str {
        match self {
            EngineInterface::VllmConnector => "kv",
            EngineInterface::VllmOffloadTier => "offload",
            EngineInterface::SglangHiCache => "sglang",
        }
    }

    /// The name integrations pass across the Python boundary (`vllm-connector`,
    /// `vllm-offload`, `sglang`).
    pub fn name(self) -> &'static str {
        match self {
            EngineInterface::VllmConnector => "vllm-connector",
            EngineInterface::VllmOffloadTier => "vllm-offload",
            EngineInterface::SglangHiCache => "sglang",
        }
    }
}

impl fmt::Display for EngineInterface {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for EngineInterface {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|i| i.name() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = Self::ALL.iter().map(|i| i.name()).collect();
                format!(
                    "unknown engine interface {s:?} (known: {})",
                    names.join(", ")
                )
            })
    }
}

/// The digest of a layout description in scope text: xxh3-64, 16 lowercase hex digits.
fn layout_digest(layout_description: &str) -> String {
    format!(
        "{:016x}",
        xxhash_rust::xxh3::xxh3_64(layout_description.as_bytes())
    )
}

/// The model text of a key scope ([`crate::KeyScope::model`]) for an engine's KV:
/// `<name>@w=<weights>|<tag>=<xxh3-64 of layout_description, 16 hex>`.
///
/// - `name`: the served model's name (or the config's `[model] name`);
/// - `weights`: what identifies the weights (a digest of their files, or `named:<id>` from an
///   operator's `weights_id`);
/// - `layout_description`: every fact that decides the stored bytes of a value (the engine's
///   version, block format, shapes, dtype, parallel sizes, the machine), as text; two engines
///   whose descriptions differ never share a value.
///
/// The ranks a scope binds are the caller's (each engine knows which of its ranks hold the
/// same bytes); docs/keys.md has the table.
///
/// ```
/// use kvpool_core::keys::engine_scope::{EngineInterface, engine_scope_model};
///
/// let model = engine_scope_model(EngineInterface::SglangHiCache, "llama", "0123", "pages");
/// assert!(model.starts_with("llama@w=0123|sglang="));
/// ```
pub fn engine_scope_model(
    interface: EngineInterface,
    name: &str,
    weights: &str,
    layout_description: &str,
) -> String {
    format!(
        "{name}@w={weights}|{}={}",
        interface.tag(),
        layout_digest(layout_description)
    )
}

/// The model text of a part of an engine's KV kept apart from the rest (one of SGLang's side
/// host pools of a hybrid model: Mamba states, sliding-window KV, draft pools):
/// `<scope_model>|pool=<part>:<xxh3-64 of layout_description, 16 hex>`, so a part's value is
/// never read as another part's.
pub fn part_scope_model(scope_model: &str, part: &str, layout_description: &str) -> String {
    format!(
        "{scope_model}|pool={part}:{}",
        layout_digest(layout_description)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_scope_text_names_model_weights_interface_and_layout() {
        let kv = engine_scope_model(EngineInterface::VllmConnector, "m", "w1", "layout");
        assert_eq!(
            kv,
            format!("m@w=w1|kv={:016x}", xxhash_rust::xxh3::xxh3_64(b"layout"))
        );
        // Any fact that differs gives another scope.
        for other in [
            engine_scope_model(EngineInterface::VllmOffloadTier, "m", "w1", "layout"),
            engine_scope_model(EngineInterface::SglangHiCache, "m", "w1", "layout"),
            engine_scope_model(EngineInterface::VllmConnector, "n", "w1", "layout"),
            engine_scope_model(EngineInterface::VllmConnector, "m", "w2", "layout"),
            engine_scope_model(EngineInterface::VllmConnector, "m", "w1", "layout2"),
            part_scope_model(&kv, "mamba", "pool"),
        ] {
            assert_ne!(other, kv);
        }
        assert!(part_scope_model(&kv, "mamba", "pool").starts_with(&format!("{kv}|pool=mamba:")));
    }

    #[test]
    fn interfaces_parse_from_their_names_only() {
        for i in EngineInterface::ALL {
            assert_eq!(i.name().parse::<EngineInterface>(), Ok(i));
        }
        let err = "kv".parse::<EngineInterface>().unwrap_err();
        assert!(
            err.contains("vllm-connector, vllm-offload, sglang"),
            "{err}"
        );
    }
}
