#!/usr/bin/env bash
# The CUDA backend on one H200 in one command: the GPU tests, then speed on the full-size
# synthetic file (issues 10 and 11). Two halves:
#
#   bash scripts/cuda-h200.sh pack      on the dev machine (it has the toolchain): builds the
#                                       release binary and the CUDA test binaries, strips them
#                                       and packs them with the small fixtures into
#                                       .dev/cuda/pack.tar.xz (git-ignored; it travels by `carry`)
#   run(command="bash scripts/cuda-h200.sh", carry=[".dev/cuda"], timeout_s=600)
#                                       on the device machine, in the repository root there
#
# Steps on the device ($STEPS, default "tests bench"), each bounded by what is left of $BUDGET
# seconds (default 560) so that the logs always come back:
#   tests    crates/cuda/tests/{model_gpu,model_ops,mmq}.rs on the GPU (STRATA_REQUIRE_GPU=1)
#   synth    `strata synth` of the full-size file into /dev/shm (kept while the machine is warm;
#            the steps below run it when the file is missing); SYNTH_ARGS adds e.g. --mtp
#   bench    `bench model -p 0 -n 32 -r 3 -c 4096`, then `-p 512,4096 -n 0 -r 2 -c 8192`
#   tg       `bench model -p 0 -n 32 -r 3 -c 4096` once per line of $AB ("-" for the defaults,
#            else environment settings such as "STRATA_CUDA_X=0"), alternating, one load each
#   ab       `bench model -p 0 -n 32 -r 5 -c 4096 --ab SWITCH=0|1[,…]` for each ';'-separated
#            entry of $AB: both arms in one process (the spread between processes, 5–7 % on
#            one machine, stays out of the comparison; session 11)
#   profile  `bench model -p 0 -n 8 -r 1 --profile` (per-kernel table against the floors)
#   depth    `bench model -p 0 -n 32 -d 32768 -r 1 -c 33000`, and its profile at that depth
#   pp       `bench model -p 512,4096 -n 0 -r 2 -c 8192`
#   spec     `bench spec --backend cuda` with a synthetic MTP head (SYNTH_ARGS=--mtp is implied)
#   ablate   the marginal cost of each costly kernel inside the graph, in one process (the step)
#   cmd      runs $CMD (with $S the binary) — anything else
# The NVRTC cubins are cached in .dev/cuda/cubin and come back as $OUT/cubin.tar.xz: copied to
# .dev/cuda/cubin.tar.xz here, the next call unpacks it and skips the compile of unchanged
# modules (about 30 s for all of them).
set -uo pipefail
DEV=${DEV:-.dev/cuda}
if [ "${1:-}" = pack ]; then
    set -e
    mkdir -p "$DEV/stage/bin" "$DEV/stage/small"
    cargo build --release -p strata-cli
    strip -o "$DEV/stage/strata" target/release/strata
    for t in model_gpu model_ops mmq; do
        p=$(cargo test --release -p strata-cuda --test "$t" --no-run --message-format=json 2>/dev/null |
            python3 -c 'import sys,json
for l in sys.stdin:
    m=json.loads(l)
    if m.get("reason")=="compiler-artifact" and m.get("executable") and m["target"]["kind"]==["test"]: print(m["executable"])' | tail -1)
        strip -o "$DEV/stage/bin/$t" "$p"
    done
    SMALL=${SMALL_SRC:-../shared/fixtures/qwen4exp/small}
    if [ -d "$SMALL" ]; then
        cp "$SMALL"/*.gguf "$SMALL"/*.safetensors "$SMALL"/meta.json "$DEV/stage/small/"
    fi
    tar -C "$DEV/stage" -cJf "$DEV/pack.tar.xz" .
    rm -rf "$DEV/stage"
    ls -la "$DEV/pack.tar.xz"
    exit 0
fi

T0=$(date +%s)
BUDGET=${BUDGET:-560}
LOG=${OUT:-/tmp/cuda-h200}
FULL=${FULL:-/dev/shm/full.gguf}
STEPS=${STEPS:-tests bench}
AB=${AB:--}
mkdir -p "$LOG" "$DEV/cubin"
say() { echo "== $(date -u +%H:%M:%S) +$(($(date +%s) - T0))s $*"; }
left() { echo $((BUDGET - ($(date +%s) - T0))); }
# Runs "$@" with what is left of the budget (minus a margin for the copy back), or skips it.
bounded() {
    local l=$(($(left) - 15))
    if [ "$l" -lt 10 ]; then
        say "SKIPPED (budget spent): $*"
        return 0
    fi
    timeout "$l" "$@"
    local rc=$?
    [ $rc = 124 ] && say "TIMED OUT after ${l}s: $*"
    return $rc
}

X=$DEV/x
rm -rf "$X" && mkdir -p "$X" && tar -C "$X" -xJf "$DEV/pack.tar.xz"
[ -f "$DEV/cubin.tar.xz" ] && tar -C "$DEV/cubin" -xJf "$DEV/cubin.tar.xz"
S=$X/strata
export S FULL
export STRATA_CUDA_CACHE=$PWD/$DEV/cubin STRATA_REQUIRE_GPU=1 STRATA_FIXTURES=$PWD/fixtures
[ -d "$X/small" ] && export STRATA_SMALL_FIXTURES=$PWD/$X/small
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader || true
git log -1 --format='tree at %h %s' 2>/dev/null || true

synth() {
    if [ ! -f "$FULL" ]; then
        say "synth $FULL ${SYNTH_ARGS:-}"
        # shellcheck disable=SC2086
        bounded "$S" synth --out "$FULL" --ctx 65536 ${SYNTH_ARGS:-} 2>&1 | tail -3
    fi
}
bench() { bounded "$S" bench model -m "$FULL" --backend cuda "$@" 2>&1; }

for step in $STEPS; do
    case $step in
    tests)
        for t in model_gpu model_ops mmq; do
            say "test $t"
            bounded "$X/bin/$t" --test-threads 1 2>&1 | tee "$LOG/test-$t.txt" | grep -E "^test |test result|panicked|FAILED" | tail -40
        done
        ;;
    synth) synth ;;
    bench)
        synth
        say "tg32"
        bench -p 0 -n 32 -r 3 -c 4096 | tee "$LOG/tg.txt" | tail -6
        say "pp512,4096"
        bench -p 512,4096 -n 0 -r 2 -c 8192 | tee "$LOG/pp.txt" | tail -6
        ;;
    tg)
        synth
        for round in 1 2; do
            while IFS= read -r line; do
                [ -z "$line" ] && continue
                say "tg32 round $round [$line]"
                if [ "$line" = - ]; then
                    bench -p 0 -n 32 -r 3 -c 4096 | grep -E "tg|error" | tail -3
                else
                    # shellcheck disable=SC2086
                    env $line "$S" bench model -m "$FULL" --backend cuda -p 0 -n 32 -r 3 -c 4096 2>&1 | grep -E "tg|error" | tail -3
                fi
            done <<<"$(echo "$AB" | tr ';' '\n')"
        done
        ;;
    ab)
        synth
        while IFS= read -r line; do
            [ -z "$line" ] || [ "$line" = - ] && continue
            say "A/B in one process [--ab $line]"
            bench -p 0 -n 32 -r 5 -c 4096 --ab "$line" | grep -E "tg|error" | tail -3
        done <<<"$(echo "$AB" | tr ';' '\n')"
        ;;
    profile)
        synth
        say "profile"
        bench -p 0 -n 8 -r 1 -c 4096 --profile | tee "$LOG/profile.txt" | head -70
        ;;
    depth)
        synth
        say "tg32 at 32K"
        bench -p 0 -n 32 -d 32768 -r 1 -c 33000 | tee "$LOG/depth.txt" | tail -4
        say "profile at 32K"
        bench -p 0 -n 4 -d 32768 -r 1 -c 33000 --profile | tee "$LOG/depth-profile.txt" | head -50
        ;;
    pp)
        synth
        say "pp512,4096"
        bench -p 512,4096 -n 0 -r 2 -c 8192 | tee "$LOG/pp.txt" | tail -6
        ;;
    spec)
        if [ ! -f "${FULL%.gguf}-mtp.gguf" ]; then
            say "synth $FULL --mtp"
            bounded "$S" synth --out "$FULL" --ctx 65536 --mtp --force 2>&1 | tail -3
        fi
        say "bench spec"
        bounded "$S" bench spec --backend cuda -m "$FULL" --mtp "${FULL%.gguf}-mtp.gguf" -n 48 --windows 2,4,8 \
            --force-accept 0.85 --reps 2 2>&1 | tee "$LOG/spec.txt" | tail -20
        ;;
    ablate)
        # The $NABL (default 24) costliest kernels of the profile, each ablated in turn
        # (`bench model --ablate`: its launches become empty ones, the results are wrong), plus
        # the groups in $ABL_GROUPS (';'-separated lists; bash's own GROUPS is read-only), the
        # kernels without stated bytes, those with them, and every kernel (the launch floor),
        # all in one process: the time a token saved is the kernels' marginal cost inside the
        # graph (session 12; before, a process per kernel and its 5-7 % spread).
        synth
        [ -s "$LOG/profile.txt" ] || bench -p 0 -n 8 -r 1 -c 4096 --profile >"$LOG/profile.txt"
        rows() { grep -E '^\| [a-z_0-9]+ \| [0-9]' "$LOG/profile.txt"; }
        names=$(rows | awk -F'|' '{gsub(/ /,"",$2); print $2}' | awk '!seen[$0]++' | head -"${NABL:-24}" | paste -sd';')
        nob=$(rows | awk -F'|' '{gsub(/ /,"",$2); gsub(/ /,"",$6); if ($6 == "-") print $2}' | awk '!seen[$0]++' | paste -sd,)
        wb=$(rows | awk -F'|' '{gsub(/ /,"",$2); gsub(/ /,"",$6); if ($6 != "-") print $2}' | awk '!seen[$0]++' | paste -sd,)
        lists="$names;${ABL_GROUPS:-};$nob;$wb;*"
        say "ablate in one process: $lists"
        bench -p 0 -n 16 -r "${ABL_REPS:-3}" -c 4096 --ablate "$lists" >"$LOG/ablate.txt" 2>&1
        grep -E '^\| (arm|---|A|ablated)' "$LOG/ablate.txt" | tee "$LOG/ablate.md"
        grep -E 'error|panicked' "$LOG/ablate.txt" | head -5
        ;;
    cmd)
        synth
        say "cmd: ${CMD:-}"
        bounded bash -c "${CMD:-true}" 2>&1 | tee "$LOG/cmd.txt" | tail -60
        ;;
    *) say "unknown step $step" ;;
    esac
done
tar -C "$DEV/cubin" -cJf "$LOG/cubin.tar.xz" . 2>/dev/null
say "done"
