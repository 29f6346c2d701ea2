#!/bin/sh
# Transfer-path variants side by side on one GPU machine: gpu_check.py once per variant and
# round (three rounds, interleaved), each with the bundle's wheel but that variant's
# kvpool/transfer.py; prints each run's throughput (each figure a median of 5 inside the run).
# The shipped transfer.py always runs first in a round. From the bundle's directory:
#   sh ab.sh variants/per_plane.py variants/two_streams.py
# (variants: kvpool/transfer.py with a diff of kvpool-py/gpu/variants/ applied; docs/benchmarks.md)
set -e
cd "$(dirname "$0")"
python3 -c "import glob, zipfile; zipfile.ZipFile(glob.glob('kvpool-*.whl')[0]).extractall('site')"
mkdir -p ab
cp site/kvpool/transfer.py ab/shipped.py
for round in 1 2 3; do
  for variant in ab/shipped.py "$@"; do
    name=$(basename "$variant" .py)
    cp "$variant" site/kvpool/transfer.py
    PYTHONPATH="$PWD/site" python3 gpu_check.py > "ab/$name-$round.json" 2>/dev/null || true
    python3 - "$name" "$round" "ab/$name-$round.json" <<'EOF' || echo "$name $round: no report"
import json, sys
name, rnd, path = sys.argv[1:]
r = json.load(open(path))
t = r.get("throughput")
if t is None:
    sys.exit(print(name, rnd, "FAILED " + "; ".join(r["failures"])))
keys = ("save_vs_torch", "load_vs_torch", "kvpool_save_GBps_median", "kvpool_load_GBps_median",
        "torch_d2h_GBps", "torch_h2d_GBps", "save_enqueue_ms_median", "load_enqueue_ms_median")
status = "FAILED " + "; ".join(r["failures"]) if r["failures"] else "ok"
print(name, rnd, status, *(f"{k}={t[k]:.3f}" for k in keys))
EOF
  done
done
cp ab/shipped.py site/kvpool/transfer.py
