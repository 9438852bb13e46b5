#!/usr/bin/env bash
# Two fovea binaries compared in one run (A/B), on a Hopper GPU: did a change move the encoder or serve?
#   bench/ab.sh OLD_FOVEA NEW_FOVEA [MODEL]        (MODEL: default synthetic:qwen3-vl-8b)
#  1. load images: photographs ($PHOTOS, default data/photos: tools/fetch-photos.sh) cropped to the
#     FullHD frame (bench/serve-matrix.py images; needs Pillow), else generated 1920x1080 PNGs;
#  2. one scale file, calibrated by NEW (`fovea bench calibration` on all but 2 of those images, as
#     bench/serve-matrix.sh does), used by both servers for FP8 static;
#  3. encoder: `fovea bench encoder MODEL --resolutions HD,4K --images-per-request 3 --dtype
#     bf16,fp8-static` with each binary (median ms of CUDA-graph replays; its fp8-static calibrates
#     inside the bench from one dynamic forward on fixed pixels, the same for both binaries);
#  4. serve: for each dtype in $SERVE_DTYPES, `fovea serve MODEL --max-pixels 2073600` and
#     bench/serve-load.py with 16 concurrent clients (images/s, p50, p99);
#  5. one table, metric | A | B | B/A: each cell the median over the rounds, with the range.
# Every step runs $ROUNDS times, A and B alternating (A B, then B A, ...) to spread drift and noise
# over both. Both binaries run with the same CUDNN_LIB. JSON of every run in $OUT (ab.json: the table).
# Environment: ROUNDS (2), RESOLUTIONS (HD,4K), ENCODER_DTYPES (bf16,fp8-static), REPS (10),
# SERVE_DTYPES ("bf16 fp8-static"; "none" skips serve), BUDGET (2073600), CONCURRENCY (16),
# REQUESTS (128), WARMUP (8), NIMAGES (8), PHOTOS, SCALES (an existing scale file: no calibration),
# DEADLINE (s; steps that would start later are skipped, the table is still printed; default none),
# ENGINE_FLAGS (more flags for calibration and both servers, e.g. --fp8-linears; "--device cpu" with
# MODEL synthetic:tiny and a small BUDGET tries the script on a machine without a GPU, serve only),
# and CUDNN_LIB, OUT, PYTHON (scripts/lib-gpu.sh).
set -uo pipefail
source "$(dirname "$0")/../scripts/lib-gpu.sh"
case "${1:-}" in -h|--help) usage; exit 0 ;; esac
if [ $# -lt 2 ] || [ $# -gt 3 ]; then usage >&2; exit 2; fi
A=$(realpath -m -- "$1")
B=$(realpath -m -- "$2")
M=${3:-synthetic:qwen3-vl-8b}
[ -d "$M" ] && M=$(realpath -- "$M")
[ -x "$A" ] || die "OLD_FOVEA: no executable at $A"
P=""
if [ -n "${PHOTOS:-}" ] || [ -d "$FOVEA_ROOT/data/photos" ]; then
  P=$(photos_dir "${PHOTOS:-$FOVEA_ROOT/data/photos}") || exit 2
fi
SCALES=${SCALES:+$(realpath -m -- "$SCALES")}
ROUNDS=${ROUNDS:-2}
RESOLUTIONS=${RESOLUTIONS:-HD,4K}
ENCODER_DTYPES=${ENCODER_DTYPES:-bf16,fp8-static}
REPS=${REPS:-10}
SERVE_DTYPES=${SERVE_DTYPES:-bf16 fp8-static}
[ "$SERVE_DTYPES" = none ] && SERVE_DTYPES=""
BUDGET=${BUDGET:-2073600}
CONCURRENCY=${CONCURRENCY:-16}
REQUESTS=${REQUESTS:-128}
WARMUP=${WARMUP:-8}
NIMAGES=${NIMAGES:-8}
DEADLINE=${DEADLINE:-0}
[ "$DEADLINE" -gt 0 ] 2>/dev/null || DEADLINE=1000000000  # none
read -r -a EXTRA <<< "${ENGINE_FLAGS:-}"
gpu_setup "$B"
T0=$SECONDS
WORK=$(mktemp -d /tmp/fovea-ab.XXXXXX)
trap '[ -n "${pid:-}" ] && kill "$pid" 2>/dev/null; rm -rf "$WORK"' EXIT
elapsed() { echo $((SECONDS - T0)); }
say() { echo "== [$(elapsed) s] $*"; }
# need S WHAT: true if S seconds are left before DEADLINE, else says WHAT is skipped.
need() {
  [ $((DEADLINE - (SECONDS - T0))) -ge "$1" ] && return 0
  echo "   SKIPPED $2: past DEADLINE=$DEADLINE s"
  return 1
}
# order R: "A B" in odd rounds, "B A" in even ones.
order() { if [ $(($1 % 2)) = 1 ]; then echo "A B"; else echo "B A"; fi; }
bin_of() { if [ "$1" = A ]; then echo "$A"; else echo "$B"; fi; }

gpu_state
{ echo "A: $A ($("$A" --version 2>&1))"; echo "B: $B ($("$B" --version 2>&1))"; echo "model: $M"; } | tee "$OUT/binaries.txt"

IMG=$WORK/images
if [ -n "$SERVE_DTYPES" ]; then
  say "load images at budget $BUDGET"
  if [ -z "$P" ] || ! $PY -c "import PIL" 2>/dev/null ||
     ! $PY bench/serve-matrix.py images --photos "$P" --out "$IMG" --budget "$BUDGET" --count "$NIMAGES"; then
    echo "   no photographs or no Pillow: $NIMAGES generated 1920x1080 PNGs"
    mkdir -p "$IMG"
    $PY - "$IMG" "$NIMAGES" <<'PY'
import importlib, os, sys
sys.path.insert(0, "bench")
load = importlib.import_module("serve-load")
for i in range(int(sys.argv[2])):
    with open(os.path.join(sys.argv[1], f"img{i:02d}.png"), "wb") as f:
        f.write(load.png_bytes(1920, 1080, i))
PY
  fi
  if [[ " $SERVE_DTYPES " == *" fp8-static "* ]] && [ -z "$SCALES" ]; then
    SCALES=$OUT/scales.json
    say "scale file: B calibrates on $((NIMAGES - 2)) of the load images"
    "$B" bench calibration --model "$M" --dataset-path "$IMG" --calibration-images $((NIMAGES - 2)) --scale-file "$SCALES" \
      --max-pixels "$BUDGET" --output-json "$OUT/calibration.json" "${EXTRA[@]}" > "$OUT/calibration.txt" 2>&1
    grep -E "calibrated on| \| |rror" "$OUT/calibration.txt"
    "$B" scales inspect "$SCALES" 2>&1 | tail -1
  fi
fi

for r in $(seq "$ROUNDS"); do
  for who in $(order "$r"); do
    need 90 "encoder round $r $who" || continue
    say "encoder, round $r, $who"
    timeout 900 "$(bin_of $who)" bench encoder "$M" --resolutions "$RESOLUTIONS" --images-per-request 3 \
      --dtype "$ENCODER_DTYPES" --reps "$REPS" --warmup 2 --json "$OUT/encoder-$who-r$r.json" > "$OUT/encoder-$who-r$r.txt" 2>&1 ||
      { echo "   failed:"; tail -5 "$OUT/encoder-$who-r$r.txt"; }
    tail -n +3 "$OUT/encoder-$who-r$r.txt" | sed 's/^/   /'
  done
done

for r in $(seq "$ROUNDS"); do
  for dt in $SERVE_DTYPES; do
    case $dt in
      bf16) flags=(--mm-encoder-attn-dtype bf16) ;;
      fp8|fp8-dynamic) flags=(--mm-encoder-attn-dtype fp8) ;;
      fp8-static)
        [ -s "$SCALES" ] || { echo "   SKIPPED serve fp8-static: no scale file"; continue; }
        flags=(--mm-encoder-attn-dtype fp8 --mm-encoder-fp8-scale-path "$SCALES") ;;
      *) echo "   SKIPPED serve dtype '$dt': not one of bf16, fp8, fp8-dynamic, fp8-static"; continue ;;
    esac
    # The queue sized to the load (every client's request may wait), as bench/serve-matrix.sh does.
    qtokens=$((CONCURRENCY * BUDGET / 1024)); [ $qtokens -gt 65536 ] || qtokens=65536
    for who in $(order "$r"); do
      need 60 "serve $dt round $r $who" || continue
      tag=$dt-$who-r$r
      say "serve $dt, round $r, $who"
      start_server "$(bin_of $who)" "$OUT/serve-$tag.log" "$M" "${flags[@]}" "${EXTRA[@]}" --max-pixels "$BUDGET" \
        --max-queue $((CONCURRENCY > 64 ? CONCURRENCY : 64)) --max-queue-tokens $qtokens || continue
      timeout 600 $PY bench/serve-load.py --url "$url" --images "$IMG" --concurrency "$CONCURRENCY" --requests "$REQUESTS" \
        --warmup "$WARMUP" --json "$OUT/serve-$tag.json" 2>&1 | grep -E "^serve-load \| +[0-9]|first error" | sed 's/^/   /'
      stop_server; echo "   server exit code $? (SIGTERM)"
    done
  done
done

say "table"
$PY - "$OUT" "$BUDGET" "$CONCURRENCY" <<'PY'
import glob, json, os, re, statistics, sys

out, budget, conc = sys.argv[1], int(sys.argv[2]), sys.argv[3]
runs = {}  # metric -> {"A": [...], "B": [...]}
order = []


def add(metric, who, value):
    if value is None:
        return
    if metric not in runs:
        runs[metric] = {"A": [], "B": []}
        order.append(metric)
    runs[metric][who].append(value)


def key(path):
    m = re.search(r"-(A|B)-r(\d+)\.json$", path)
    return int(m.group(2)), m.group(1)


for path in sorted(sorted(glob.glob(os.path.join(out, "encoder-*-r*.json"))), key=key):
    _, who = key(path)
    for row in json.load(open(path))["rows"]:
        add(f"encoder {row['resolution']} {row['mode']}, ms", who, row["median_ms"])
frame = {2073600: "FullHD", 8294400: "4K"}.get(budget, f"{budget} px")
for path in sorted(sorted(glob.glob(os.path.join(out, "serve-*-r*.json"))), key=key):
    _, who = key(path)
    dt = os.path.basename(path)[len("serve-"):].rsplit("-", 2)[0]
    level = json.load(open(path))["results"][0]
    name = f"serve {frame} c={conc} {dt}"
    add(f"{name}, images/s", who, level["images_per_s"])
    add(f"{name}, p50 ms", who, level["p50_ms"])
    add(f"{name}, p99 ms", who, level["p99_ms"])
    if level["errors"]:
        add(f"{name}, errors", who, sum(level["errors"].values()))


def cell(v):
    if not v:
        return "-"
    m = statistics.median(v)
    return f"{m:.2f}" + (f" ({min(v):.2f}-{max(v):.2f})" if len(v) > 1 else "")


print("| metric | A | B | B/A |")
print("|---|---|---|---|")
table = []
for metric in order:
    a, b = runs[metric]["A"], runs[metric]["B"]
    ratio = statistics.median(b) / statistics.median(a) if a and b and statistics.median(a) else None
    print(f"| {metric} | {cell(a)} | {cell(b)} | {f'{ratio:.3f}' if ratio else '-'} |")
    table.append({"metric": metric, "A": a, "B": b, "B/A": ratio})
json.dump({"binaries": open(os.path.join(out, "binaries.txt")).read(), "rows": table},
          open(os.path.join(out, "ab.json"), "w"), indent=1)
print("(median over the rounds, range in brackets; ms: lower is better, images/s: higher is better)")
PY
