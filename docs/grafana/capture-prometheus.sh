#!/usr/bin/env bash
# Captures docs/grafana/*.png: Debian's Prometheus scrapes `kvpool bench --metrics-listen`
# (L1 + a RocksDB disk tier) every second, and headless Chromium (Debian's `chromium`)
# screenshots Prometheus's graph page for the token hit rate and per-tier get latency.
#
# Needs: apt-get install prometheus chromium librocksdb-dev libclang-dev; run from the
# repository root: bash docs/grafana/capture-prometheus.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
out=docs/grafana
work=$(mktemp -d /tmp/kvpool-capture.XXXXXX)
pids=()
cleanup() {
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    rm -rf "$work"
}
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
metrics_port=$(free_port)
prom_port=$(free_port)

cargo build -q -p kvpool-cli --features disk
kvpool=target/debug/kvpool

cat > "$work/prometheus.yml" <<EOF
global:
  scrape_interval: 1s
scrape_configs:
  - job_name: kvpool
    static_configs:
      - targets: ['127.0.0.1:$metrics_port']
EOF
prometheus --config.file="$work/prometheus.yml" --storage.tsdb.path="$work/tsdb" \
    --web.listen-address="127.0.0.1:$prom_port" > "$work/prometheus.log" 2>&1 &
pids+=($!)

# Two benchmark runs back to back (a cold disk tier, then a warm one), serving metrics.
"$kvpool" bench --cpu-size 256MiB --tier "file://$work/disk" --sessions 64 --turns 6 \
    --metrics-listen "127.0.0.1:$metrics_port" --metrics-linger 15 > "$work/bench.txt"
cat "$work/bench.txt"

shot() { # name, PromQL
    local expr
    expr=$(python3 -c 'import sys, urllib.parse; print(urllib.parse.quote(sys.argv[1]))' "$2")
    chromium --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
        --disable-background-networking --disable-component-update --disable-sync \
        --user-data-dir="$work/chromium" --hide-scrollbars --window-size=1400,800 \
        --virtual-time-budget=15000 --screenshot="$out/$1.png" \
        "http://127.0.0.1:$prom_port/graph?g0.expr=$expr&g0.tab=0&g0.range_input=2m" 2>/dev/null
    echo "wrote $out/$1.png"
}
shot prometheus-hit-rate 'rate(kvpool_hit_tokens_total[15s]) / rate(kvpool_lookup_tokens_total[15s])'
shot prometheus-tier-get-latency 'histogram_quantile(0.5, sum by (tier, le) (rate(kvpool_tier_op_seconds_bucket{op="get"}[15s])))'
