//! Telemetry: the catalogue of every Prometheus metric kvpool records, and `StatCounter`, the
//! counter behind every `stats()` snapshot.

mod catalog;
pub mod counter;

pub use catalog::*;
pub use counter::StatCounter;
