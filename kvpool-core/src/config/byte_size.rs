//! `ByteSize`: a byte count written as `"2GiB"`, `"512MiB"`, `"1.5GB"` or a plain integer.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A byte count that reads and writes as `"2GiB"`, `"512MiB"`, `"1.5GB"` or a plain integer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default)]
pub struct ByteSize(pub u64);

impl ByteSize {
    /// `n` gibibytes.
    pub const fn gib(n: u64) -> Self {
        ByteSize(n << 30)
    }
    /// `n` mebibytes.
    pub const fn mib(n: u64) -> Self {
        ByteSize(n << 20)
    }
    /// Rounded, for reports: `17.9GiB`, `512.0MiB`, `300B`.
    pub fn human(self) -> String {
        for (unit, shift) in [("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)] {
            if self.0 >= 1 << shift {
                return format!("{:.1}{unit}", self.0 as f64 / (1u64 << shift) as f64);
            }
        }
        format!("{}B", self.0)
    }

    /// As `usize`.
    pub fn as_usize(self) -> usize {
        usize::try_from(self.0).unwrap_or(usize::MAX)
    }
}

impl fmt::Display for ByteSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (unit, shift) in [("GiB", 30), ("MiB", 20), ("KiB", 10)] {
            if self.0 >= 1 << shift && self.0.is_multiple_of(1 << shift) {
                return write!(f, "{}{unit}", self.0 >> shift);
            }
        }
        write!(f, "{}B", self.0)
    }
}

impl FromStr for ByteSize {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let t = s.trim();
        let split = t
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(t.len());
        let (num, unit) = t.split_at(split);
        let value: f64 = num
            .parse()
            .map_err(|_| format!("`{s}` is not a size: use e.g. 2GiB, 512MiB or 1073741824"))?;
        let mult: f64 = match unit.trim().to_ascii_lowercase().as_str() {
            "" | "b" => 1.0,
            "k" | "kb" => 1e3,
            "kib" => 1024.0,
            "m" | "mb" => 1e6,
            "mib" => 1024.0 * 1024.0,
            "g" | "gb" => 1e9,
            "gib" => 1024.0 * 1024.0 * 1024.0,
            "t" | "tb" => 1e12,
            "tib" => 1024f64.powi(4),
            other => {
                return Err(format!(
                    "unknown size unit `{other}` in `{s}`: use B, KiB, MiB, GiB, TiB (or KB, MB, GB, TB)"
                ));
            }
        };
        Ok(ByteSize((value * mult).round() as u64))
    }
}

impl Serialize for ByteSize {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Int(u64),
            Text(String),
        }
        match Raw::deserialize(d)? {
            Raw::Int(n) => Ok(ByteSize(n)),
            Raw::Text(t) => t.parse().map_err(serde::de::Error::custom),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse() {
        assert_eq!("2GiB".parse::<ByteSize>().unwrap(), ByteSize::gib(2));
        assert_eq!("1.5 MiB".parse::<ByteSize>().unwrap(), ByteSize(1572864));
        assert_eq!(
            "10GB".parse::<ByteSize>().unwrap(),
            ByteSize(10_000_000_000)
        );
        assert_eq!("4096".parse::<ByteSize>().unwrap(), ByteSize(4096));
        assert!("lots".parse::<ByteSize>().is_err());
        assert_eq!(ByteSize(3 << 29).human(), "1.5GiB");
        assert_eq!(ByteSize(300).human(), "300B");
        assert!("3 parsecs".parse::<ByteSize>().is_err());
    }
}
