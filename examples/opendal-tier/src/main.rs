//! `kvpool-opendal-demo [CONFIG.toml]`: registers the OpenDAL schemes, builds a kvpool pool from
//! a TOML config whose `[[tier]]` selects `opendal+fs://…`, stores KV, and loads it back
//! through a fresh pool. Without an argument it uses `kvpool-opendal.toml` next to this crate's
//! manifest, with the tier's root under the system's temporary directory.

use std::process::ExitCode;

const DEFAULT_CONFIG: &str = include_str!("../kvpool-opendal.toml");

#[tokio::main]
async fn main() -> ExitCode {
    match run().await {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(2),
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run() -> Result<bool, Box<dyn std::error::Error + Send + Sync>> {
    kvpool_opendal_tier::register()?;
    let text = match std::env::args().nth(1) {
        Some(path) => std::fs::read_to_string(&path).map_err(|e| format!("{path}: {e}"))?,
        None => DEFAULT_CONFIG.replace("$TMPDIR", &std::env::temp_dir().display().to_string()),
    };
    let config = kvpool_core::PoolConfig::from_toml(&text)?;
    let tiers: Vec<&str> = config.tiers.iter().map(|t| t.url.as_str()).collect();
    println!("tiers after L1: {}", tiers.join(", "));
    let report = kvpool_opendal_tier::demo::store_then_reload(&config, 1000).await?;
    println!(
        "stored {} tokens ({} chunks); a fresh pool loaded {} of them",
        report.tokens, report.stored_chunks, report.loaded_tokens
    );
    for (tier, chunks) in &report.served_by {
        println!("  {tier:<12} served {chunks} chunks");
    }
    println!(
        "bytes {}",
        if report.bytes_match {
            "identical"
        } else {
            "DIFFER"
        }
    );
    Ok(report.bytes_match && report.loaded_tokens > 0)
}
