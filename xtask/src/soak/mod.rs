//! `cargo xtask soak --minutes N`: a chaos soak. `kvpool sim` drives the connector the way
//! vLLM does through L1 + disk (RocksDB on a small tmpfs) + Redis + S3 (moto) and checks every
//! KV row it gets against recomputation, while this process kills and restarts Redis and moto,
//! fills the disk, corrupts stored values and copies values under other keys. When the faults
//! stop, the simulator checks that writes acknowledged after them come back intact from every
//! tier and that its anonymous resident memory did not grow; this process prints the faults it
//! injected.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

pub(crate) mod daemon;
mod engines;

use self::engines::{print_sim_report, sim_command};
use crate::servers::{self, Server};
use crate::system::SYSTEM_PACKAGES;
use crate::{ensure_system_packages, workspace_root};

const REDIS_PASSWORD: &str = "kvpool-soak";
const BUCKET: &str = "kvpool-soak";

/// Damages the soak bucket with signed requests (moto refuses unsigned overwrites of objects
/// written with signatures): `argv` = port, bucket, `corrupt` | `copy`, seed, count.
const S3_FAULT_SCRIPT: &str = r#"
import random, sys
import boto3
port, bucket, action, seed, count = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
s3 = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", region_name="us-east-1",
                  aws_access_key_id="kvpool-soak", aws_secret_access_key="kvpool-soak")
keys = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket, MaxKeys=100).get("Contents", [])]
rng = random.Random(seed)
done = 0
if action == "corrupt":
    for key in rng.sample(keys, min(count, len(keys))):
        s3.put_object(Bucket=bucket, Key=key, Body=rng.randbytes(64 + rng.randrange(8192)))
        done += 1
elif action == "copy" and len(keys) >= 2:
    src, dst = rng.sample(keys, 2)
    s3.copy_object(Bucket=bucket, Key=dst, CopySource={"Bucket": bucket, "Key": src})
    done = 1
print(done)
"#;
/// Size of the tmpfs the disk tier lives on (the tier keeps 64 MiB of it free), and the
/// tier's own capacity inside it.
const DISK_FS_MIB: u64 = 256;
const DISK_TIER_MIB: u64 = 16;
/// Seconds before the simulator's end at which the faults stop (the servers must be back by
/// the time it checks acknowledged writes).
pub(crate) const CALM_SECS: u64 = 10;

/// A tiny xorshift generator: the fault schedule only needs to be varied and reproducible.
pub(crate) struct Dice(pub(crate) u64);

impl Dice {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    pub(crate) fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    pub(crate) fn millis(&mut self, from: u64, to: u64) -> Duration {
        Duration::from_millis(from + self.below(to - from))
    }
}

/// Faults injected, by kind.
#[derive(Default, Debug)]
struct Faults {
    redis_kills: u32,
    moto_kills: u32,
    disk_fills: u32,
    redis_values_corrupted: u32,
    s3_values_corrupted: u32,
    values_copied_under_other_keys: u32,
}

impl Faults {
    fn total(&self) -> u32 {
        self.redis_kills
            + self.moto_kills
            + self.disk_fills
            + self.redis_values_corrupted
            + self.s3_values_corrupted
            + self.values_copied_under_other_keys
    }
}

/// The servers under test, restartable on the same ports.
struct Chaos {
    dir: PathBuf,
    moto_server: PathBuf,
    redis_port: u16,
    moto_port: u16,
    redis: Option<Server>,
    moto: Option<Server>,
    disk: PathBuf,
    disk_is_small_fs: bool,
    dice: Dice,
    faults: Faults,
}

impl Chaos {
    fn start_redis(&mut self) -> Result<(), String> {
        self.redis = Some(servers::start_redis(
            "redis (soak)",
            self.redis_port,
            &["--requirepass", REDIS_PASSWORD],
            &self.dir.join("redis.log"),
        )?);
        Ok(())
    }

    fn start_moto(&mut self) -> Result<(), String> {
        self.moto = Some(servers::start_moto_with_bucket(
            &self.moto_server,
            self.moto_port,
            BUCKET,
            &self.dir.join("moto.log"),
        )?);
        Ok(())
    }

    /// Signed S3 requests through boto3 (moto's own dependency, in its venv): `corrupt`
    /// overwrites up to `n` stored objects with random bytes, `copy` stores one object's value
    /// under another object's key. Returns how many objects it changed.
    fn s3_fault(&mut self, action: &str, n: u32) -> Result<u32, String> {
        let python = self
            .moto_server
            .parent()
            .ok_or("moto_server has no directory")?
            .join("python");
        let seed = self.dice.next().to_string();
        let out = Command::new(&python)
            .args([
                "-c",
                S3_FAULT_SCRIPT,
                &self.moto_port.to_string(),
                BUCKET,
                action,
            ])
            .args([seed, n.to_string()])
            .output()
            .map_err(|e| format!("cannot run {}: {e}", python.display()))?;
        let stdout = String::from_utf8_lossy(&out.stdout);
        if !out.status.success() {
            // moto is being restarted, or has nothing yet: not a soak failure.
            return Ok(0);
        }
        stdout
            .trim()
            .parse()
            .map_err(|_| format!("the S3 fault script printed {stdout:?}"))
    }

    fn redis_cli(&self, args: &[&str]) -> Result<String, String> {
        let port = self.redis_port.to_string();
        let out = Command::new("redis-cli")
            .args(["-p", &port, "--no-auth-warning", "-a", REDIS_PASSWORD])
            .args(args)
            .output()
            .map_err(|e| format!("cannot run redis-cli: {e}"))?;
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    fn redis_keys(&self) -> Result<Vec<String>, String> {
        // One SCAN page (the first line of the reply is the next cursor).
        Ok(self
            .redis_cli(&["SCAN", "0", "COUNT", "200"])?
            .lines()
            .skip(1)
            .map(str::to_string)
            .filter(|k| !k.is_empty())
            .collect())
    }

    fn pick<'a>(&mut self, keys: &'a [String]) -> Option<&'a String> {
        (!keys.is_empty()).then(|| &keys[self.dice.below(keys.len() as u64) as usize])
    }

    /// One fault, chosen at random; servers killed here are back when it returns. Returns
    /// what it did, for the log.
    fn inject(&mut self) -> Result<String, String> {
        let before = self.faults.total();
        let what = match self.dice.below(7) {
            0 => {
                self.redis = None; // SIGKILL
                std::thread::sleep(self.dice.millis(500, 3000));
                self.start_redis()?;
                self.faults.redis_kills += 1;
                "killed and restarted Redis"
            }
            1 => {
                self.moto = None;
                std::thread::sleep(self.dice.millis(500, 3000));
                self.start_moto()?;
                self.faults.moto_kills += 1;
                "killed and restarted moto"
            }
            2 if self.disk_is_small_fs => {
                let filler = self.disk.join("filler");
                fill(&filler);
                std::thread::sleep(self.dice.millis(1000, 4000));
                let _ = std::fs::remove_file(&filler);
                self.faults.disk_fills += 1;
                "filled the disk"
            }
            3 => {
                let keys = self.redis_keys()?;
                for _ in 0..3 {
                    let Some(key) = self.pick(&keys) else { break };
                    let len: u64 = self
                        .redis_cli(&["STRLEN", key])?
                        .trim()
                        .parse()
                        .unwrap_or(0);
                    if len > 16 {
                        let at = (self.dice.below(len - 8)).to_string();
                        self.redis_cli(&["SETRANGE", key, &at, "CHAOS!!!"])?;
                        self.faults.redis_values_corrupted += 1;
                    }
                }
                "corrupted Redis values"
            }
            4 => {
                let keys = self.redis_keys()?;
                if let (Some(from), Some(to)) = (self.pick(&keys), self.pick(&keys))
                    && from != to
                    && self.redis_cli(&["COPY", from, to, "REPLACE"])?.trim() == "1"
                {
                    self.faults.values_copied_under_other_keys += 1;
                }
                "copied a Redis value under another key"
            }
            5 => {
                let done = self.s3_fault("corrupt", 3)?;
                self.faults.s3_values_corrupted += done;
                "overwrote S3 values with garbage"
            }
            _ => {
                let done = self.s3_fault("copy", 1)?;
                self.faults.values_copied_under_other_keys += done;
                "copied an S3 value under another key"
            }
        };
        let done = self.faults.total() - before;
        Ok(if done == 0 {
            format!("{what}: nothing to act on yet")
        } else {
            format!("{what} ({done})")
        })
    }
}

/// Writes zeros to `path` until the filesystem is full.
fn fill(path: &Path) {
    let Ok(mut file) = std::fs::File::create(path) else {
        return;
    };
    let block = vec![0u8; 1 << 20];
    while file.write_all(&block).is_ok() {}
    let _ = file.sync_all();
}

/// What `cargo xtask soak` was asked for.
#[derive(Clone, Copy)]
pub(crate) struct SoakArgs {
    pub(crate) minutes: f64,
    pub(crate) seed: u64,
    /// The control run: the same workload with no faults.
    pub(crate) no_faults: bool,
    /// Largest allowed growth of anonymous RSS from the warm-up to the end.
    pub(crate) max_rss_growth: f64,
    /// MiB of anonymous RSS allowed on top of that growth.
    pub(crate) rss_slack_mib: u64,
    /// Engines attached to one pool daemon (`kvpool serve`) instead of tiers of their own.
    pub(crate) daemon: bool,
}

pub(crate) fn parse_args(args: &[String]) -> Result<SoakArgs, String> {
    let (mut minutes, mut seed, mut no_faults, mut max_rss_growth) = (2.0, 1, false, 0.05);
    let (mut rss_slack_mib, mut daemon) = (0, false);
    let mut it = args.iter();
    while let Some(a) = it.next() {
        if a == "--no-faults" {
            no_faults = true;
            continue;
        }
        if a == "--daemon" {
            daemon = true;
            continue;
        }
        let value = it.next().ok_or(format!("{a} needs a value"))?;
        match a.as_str() {
            "--minutes" => minutes = value.parse().map_err(|e| format!("--minutes: {e}"))?,
            "--seed" => seed = value.parse().map_err(|e| format!("--seed: {e}"))?,
            "--max-rss-growth" => {
                max_rss_growth = value
                    .parse()
                    .map_err(|e| format!("--max-rss-growth: {e}"))?;
            }
            "--rss-slack-mib" => {
                rss_slack_mib = value.parse().map_err(|e| format!("--rss-slack-mib: {e}"))?;
            }
            _ => {
                return Err(format!(
                    "unknown argument {a}; use --minutes N [--seed S] [--no-faults] [--daemon] [--max-rss-growth F] [--rss-slack-mib M]"
                ));
            }
        }
    }
    if minutes * 60.0 < 2.0 * CALM_SECS as f64 {
        return Err(format!(
            "--minutes must leave room for {CALM_SECS} s without faults"
        ));
    }
    Ok(SoakArgs {
        minutes,
        seed,
        no_faults,
        max_rss_growth,
        rss_slack_mib,
        daemon,
    })
}

/// `cargo xtask soak [--minutes N] [--seed S] [--no-faults] [--daemon] [--max-rss-growth F]
/// [--rss-slack-mib M]`.
pub(crate) fn soak(args: &SoakArgs) -> Result<(), String> {
    let args = *args;
    ensure_system_packages(SYSTEM_PACKAGES)?;
    ensure_system_packages(servers::SERVER_PACKAGES)?;
    let target_dir = std::env::var("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| workspace_root().join("target"));
    let moto_server = servers::ensure_moto(&target_dir)?;
    let kvpool = crate::vllm::build_kvpool_cli()?;

    let dir = servers::scratch_dir("soak")?;
    let disk = dir.join("disk");
    std::fs::create_dir_all(&disk).map_err(|e| e.to_string())?;
    let small_fs = match kvpool_testservers::TmpfsMount::at(&disk, &format!("{DISK_FS_MIB}m")) {
        Ok(mount) => Some(mount),
        Err(why) => {
            eprintln!(
                "warning: cannot mount a tmpfs ({why}; needs root): the disk tier uses {} and no disk-full faults are injected",
                disk.display()
            );
            None
        }
    };
    let disk_is_small_fs = small_fs.is_some();
    let mut chaos = Chaos {
        dir: dir.clone(),
        moto_server,
        redis_port: servers::free_port()?,
        moto_port: servers::free_port()?,
        redis: None,
        moto: None,
        disk: disk.clone(),
        disk_is_small_fs,
        dice: Dice(args.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1),
        faults: Faults::default(),
    };
    let result = run_soak(&mut chaos, &kvpool, &args);
    chaos.redis = None;
    chaos.moto = None;
    drop(small_fs);
    if result.is_ok() {
        let _ = std::fs::remove_dir_all(&dir);
    } else {
        eprintln!("soak files kept in {}", dir.display());
    }
    result
}

fn run_soak(chaos: &mut Chaos, kvpool: &Path, args: &SoakArgs) -> Result<(), String> {
    let (minutes, seed) = (args.minutes, args.seed);
    chaos.start_redis()?;
    chaos.start_moto()?;
    let config = chaos.dir.join("soak.toml");
    std::fs::write(
        &config,
        format!(
            r#"# kvpool soak: L1, then disk, Redis and S3; short timeouts so dead servers are misses.
# glibc keeps freed pages resident; hand them back, as a long-running deployment would, every
# 10 s: the growth check compares medians of windows of about 20 s, which then hold whole cycles.
[allocator]
release_free_pages_secs = 10

[[tier]]
url = "file://{disk}"
capacity = "{DISK_TIER_MIB}MiB"
# Small caches fill during the warm-up, so later growth of resident memory is a leak.
block_cache = "4MiB"
write_buffer = "2MiB"
timeout_ms = 1000

[[tier]]
url = "redis://:{REDIS_PASSWORD}@127.0.0.1:{redis}"
timeout_ms = 500

[[tier]]
url = "s3://{BUCKET}/soak"
endpoint = "http://127.0.0.1:{moto}"
region = "us-east-1"
access_key_id = "kvpool-soak"
secret_access_key = "kvpool-soak"
timeout_ms = 1000
"#,
            disk = chaos.disk.display(),
            redis = chaos.redis_port,
            moto = chaos.moto_port,
        ),
    )
    .map_err(|e| e.to_string())?;
    let out_path = chaos.dir.join("sim.json");
    let log_path = chaos.dir.join("sim.log");
    let mut sim = sim_command(kvpool, &config, args, seed, &out_path, &log_path)?
        .spawn()
        .map_err(|e| format!("cannot start {}: {e}", kvpool.display()))?;
    eprintln!(
        "==> soak: {minutes} min of `kvpool sim` against L1 + disk + Redis + S3, faults until {CALM_SECS} s before the end"
    );
    let started = Instant::now();
    let faults_until = Duration::from_secs_f64(minutes * 60.0 - CALM_SECS as f64);
    while !args.no_faults && started.elapsed() < faults_until {
        std::thread::sleep(chaos.dice.millis(1000, 4000));
        if sim.try_wait().map_err(|e| e.to_string())?.is_some() {
            break;
        }
        let what = chaos.inject()?;
        eprintln!("    {:>5.1} s: {what}", started.elapsed().as_secs_f64());
    }
    let status = sim.wait().map_err(|e| e.to_string())?;
    let report = std::fs::read_to_string(&out_path).unwrap_or_default();
    let f = &chaos.faults;
    println!("\n== chaos soak: {minutes} min, seed {seed} ==");
    for (what, n) in [
        ("Redis killed and restarted", f.redis_kills),
        ("moto (S3) killed and restarted", f.moto_kills),
        ("disk filled to the last byte", f.disk_fills),
        ("Redis values corrupted", f.redis_values_corrupted),
        ("S3 values overwritten with garbage", f.s3_values_corrupted),
        (
            "values copied under another key",
            f.values_copied_under_other_keys,
        ),
    ] {
        println!("{what:<40} {n:>8}");
    }
    print_sim_report(&report);
    if status.success() {
        Ok(())
    } else {
        let log = std::fs::read_to_string(&log_path).unwrap_or_default();
        let tail: Vec<&str> = log.lines().rev().take(20).collect();
        for line in tail.iter().rev() {
            eprintln!("    {line}");
        }
        Err(format!("the soak failed ({status}); report: {report}"))
    }
}
