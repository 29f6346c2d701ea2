//! The TOML pool config: never a panic, and a config that parses and validates prints (TOML
//! and Debug) and parses back to itself.
#![no_main]

use kvpool_core::PoolConfig;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(config) = PoolConfig::from_toml(text) {
        let printed = toml::to_string(&config).expect("a valid config serialises");
        let again = PoolConfig::from_toml(&printed).expect("its own TOML parses");
        assert_eq!(again, config);
        let _ = format!("{config:?}");
    }
});
