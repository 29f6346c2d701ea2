//! A request's extra keys: what its KV depends on besides token ids (LoRA adapter, multimodal
//! inputs, cache salt), in one canonical byte encoding that every process derives alike.
//!
//! Encoding (see docs/keys.md): for each present item, in this order — the LoRA adapter name,
//! the cache salt, then each multimodal input hash in prompt order — one tag byte (`1` LoRA,
//! `2` salt, `3` multimodal), its UTF-8 length as a little-endian `u32`, and its bytes. A
//! request with none of them encodes to nothing, so its keys equal the plain token keys.

/// What a request's KV depends on besides its token ids.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExtraKeys {
    /// The LoRA adapter's name (vLLM `lora_request.lora_name`), if any.
    pub lora_name: Option<String>,
    /// vLLM's `cache_salt` (per tenant / per user isolation), if any.
    pub cache_salt: Option<String>,
    /// Identifiers of multimodal inputs (vLLM `mm_features[i].identifier`), in prompt order.
    pub mm_hashes: Vec<String>,
}

const TAG_LORA: u8 = 1;
const TAG_SALT: u8 = 2;
const TAG_MM: u8 = 3;
/// Tag of the random salt a scheduler adds after `reset_cache` (see
/// `ConnectorScheduler::reset`).
pub(crate) const TAG_RESET: u8 = 4;

fn push(out: &mut Vec<u8>, tag: u8, value: &str) {
    out.push(tag);
    out.extend_from_slice(&(value.len() as u32).to_le_bytes());
    out.extend_from_slice(value.as_bytes());
}

impl ExtraKeys {
    /// The canonical encoding (empty when there is nothing).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        if let Some(l) = &self.lora_name {
            push(&mut out, TAG_LORA, l);
        }
        if let Some(s) = &self.cache_salt {
            push(&mut out, TAG_SALT, s);
        }
        for m in &self.mm_hashes {
            push(&mut out, TAG_MM, m);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nothing_encodes_to_nothing_and_fields_do_not_alias() {
        assert!(ExtraKeys::default().encode().is_empty());
        let lora = ExtraKeys {
            lora_name: Some("a".into()),
            ..Default::default()
        };
        let salt = ExtraKeys {
            cache_salt: Some("a".into()),
            ..Default::default()
        };
        assert_ne!(lora.encode(), salt.encode());
        // Length prefixes keep ["ab"] and ["a", "b"] apart.
        let one = ExtraKeys {
            mm_hashes: vec!["ab".into()],
            ..Default::default()
        };
        let two = ExtraKeys {
            mm_hashes: vec!["a".into(), "b".into()],
            ..Default::default()
        };
        assert_ne!(one.encode(), two.encode());
        assert_eq!(lora.encode(), [1, 1, 0, 0, 0, b'a']);
    }
}
