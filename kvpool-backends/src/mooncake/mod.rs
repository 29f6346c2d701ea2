//! `mooncakestore://master:port`: Mooncake Store as a remote tier, behind a small client trait.
//!
//! The connector owns a staging arena registered with Mooncake's transfer engine: values are
//! copied into it once before `batch_upsert_from`, and `batch_get_into` lands values in it
//! directly, where they are handed out as [`Bytes`](bytes::Bytes) without another copy. The client itself is a
//! [`MooncakeStoreClient`]; today that is [`PythonStoreClient`](python::PythonStoreClient)
//! (the Python extension from Mooncake's wheel, embedded), and a client over Mooncake's C API
//! can take its place without touching this module.
//!
//! Configuration comes from the tier URL, optionally on top of the JSON file Mooncake users
//! already keep (`MOONCAKE_CONFIG_PATH`, or `config=` in the URL):
//!
//! ```text
//! mooncakestore://10.0.0.5:50051?metadata_server=P2PHANDSHAKE&protocol=tcp&local_hostname=10.0.0.7
//! mooncakestore://10.0.0.5:50051?protocol=rdma&device_name=mlx5_0,mlx5_1&replica_num=2
//! mooncakestore://?config=/etc/mooncake.json
//! ```
//!
//! | file | owns |
//! |---|---|
//! | `client.rs` | [`MooncakeStoreClient`], status codes, [`RawBuffer`] |
//! | `config.rs` | [`MooncakeConfig`] from the URL and Mooncake's JSON |
//! | `staging.rs` | the registered staging arena |
//! | `connector.rs` | [`MooncakeConnector`] |
//! | `python.rs` | [`PythonStoreClient`](python::PythonStoreClient), every Python detail |

mod client;
mod config;
mod connector;
mod key_claims;
pub mod python;
mod staging;
#[cfg(test)]
mod tests;

use async_trait::async_trait;

use kvpool_core::{ConfigError, RemoteConnector};

use crate::backend_factory::{BackendFactory, TierRequest};

pub use client::{MooncakeStoreClient, RawBuffer, describe_code};
pub use config::MooncakeConfig;
pub use connector::MooncakeConnector;

/// The URL schemes the Mooncake tier opens.
pub const SCHEMES: &[&str] = &["mooncakestore"];

/// Registers [`SCHEMES`] with the scheme registry. Mooncake's options travel in the URL's
/// query (`?protocol=rdma&device_name=mlx5_0`), named as in Mooncake's own JSON config.
pub struct MooncakeFactory;

#[async_trait]
impl BackendFactory for MooncakeFactory {
    fn example(&self) -> String {
        "url = \"mooncakestore://127.0.0.1:50051?protocol=tcp&global_segment_size=1GiB\"  # options in the query: config, local_hostname, metadata_server, protocol, device_name, global_segment_size, local_buffer_size, staging_size, replica_num, python_path".into()
    }

    async fn open(&self, tier: &TierRequest<'_>) -> Result<Box<dyn RemoteConnector>, ConfigError> {
        tier.options().finish()?;
        let mut config = MooncakeConfig::from_url(tier.url())?;
        // Room for a few values of the largest chunk the pool stores.
        let needed = (tier.max_chunk_bytes + 4096).saturating_mul(4);
        config.staging_bytes = config.staging_bytes.max(needed);
        // Just inside the tier's timeout (the registry's `TimeoutConnector` around this one),
        // so that the connector's own deadline fires first and pauses it.
        config.call_timeout = tier.timeout().mul_f64(0.9);
        let connector = MooncakeConnector::connect(&config)
            .await
            .map_err(|e| config::invalid(e.to_string()))?;
        Ok(Box::new(connector))
    }
}
