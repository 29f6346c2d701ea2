#!/usr/bin/env bash
# Measures the host memory of a node daemon and one engine-like pool attached to it, for the
# sizing formula in docs/configuration.md: `kvpool serve` (512 MiB arena, 256 MiB write-behind
# quota) and `kvpool bench` (256 MiB L1, the daemon as its lower tier), sampling
# /proc/PID/status. Usage: deploy/measure-node-memory.sh [path/to/kvpool]
set -euo pipefail
K=${1:-target/release/kvpool}
D=$(mktemp -d)
trap 'kill $SP 2>/dev/null || true; rm -rf "$D"' EXIT
cat > "$D/serve.toml" <<T
[local_cpu]
max_size = "512MiB"
[write_behind]
quota = "256MiB"
T
"$K" serve --config "$D/serve.toml" --socket "$D/kvpool.sock" > "$D/serve.log" 2>&1 &
SP=$!
for _ in $(seq 100); do [ -S "$D/kvpool.sock" ] && break; sleep 0.1; done
status() { grep -E "^(VmRSS|RssAnon|RssFile|RssShmem|VmPTE)" "/proc/$1/status" | tr -s ' \t' ' ' | tr '\n' ' '; echo; }
echo "daemon at start: $(status $SP)"
"$K" bench --cpu-size 256MiB --tier "kvpool+unix://$D/kvpool.sock" > "$D/bench.out" 2>&1 &
BP=$!
declare -A peak
while kill -0 $BP 2>/dev/null; do
  for f in RssAnon RssShmem VmPTE VmRSS; do
    v=$(grep "^$f" "/proc/$BP/status" 2>/dev/null | awk '{print $2}' || true)
    [ -n "$v" ] && [ "$v" -gt "${peak[$f]:-0}" ] && peak[$f]=$v
  done
  sleep 0.1
done
wait $BP
echo "engine (bench) peaks, kB: RssAnon ${peak[RssAnon]} RssShmem ${peak[RssShmem]} VmPTE ${peak[VmPTE]} VmRSS ${peak[VmRSS]}"
echo "daemon after: $(status $SP)"
grep -E "prompt tokens|tokens stored" "$D/bench.out"
