#!/usr/bin/env bash
# The wgpu backend on the H200's Vulkan in one command: the tiny-model tests, then decode speed
# on the full-size synthetic file (issue 16, point 5). Run by the lead through the device tool,
# in the repository root there:
#
#   run(command="bash scripts/wgpu-h200.sh", carry=[".dev/wgpu"], timeout_s=600)
#
# What it needs under .dev/wgpu (built on the dev machine, which has the toolchain):
#   strata     the release binary, stripped:
#                cargo build --release -p strata-cli && strip -o .dev/wgpu/strata target/release/strata
#   bin/model  the wgpu model test binary:
#                cargo test --release -p strata-wgpu --test model --no-run   (prints the path)
#                cp <that path> .dev/wgpu/bin/model
#                echo "$PWD" > .dev/wgpu/bin/model.root   (the checkout it was built in; needed
#                when the binary is stripped)
#   bin/kernels  the wgpu kernel test binary (optimized kernels bitwise against their
#              baselines and the CPU's oracles, every decoder format), likewise:
#                cargo test --release -p strata-wgpu --test kernels --no-run
#                cp <that path> .dev/wgpu/bin/kernels
#   gl/*.deb   the Vulkan loader and the glvnd libraries (with the loader alone no adapter is
#              found): the device README's recipe, into .dev/wgpu/gl:
#                apt-get download libvulkan1 libegl1 libglvnd0 libopengl0 libgl1 libglx0 libgles2
#
# Steps (STEPS="tests bench profile" by default; one step alone with e.g. STEPS=bench):
#   tests    the kernel tests (crates/wgpu/tests/kernels.rs) and the tiny-model tests of
#            crates/wgpu/tests/model.rs on the H200 adapter (the ignored 0.5B ones need the
#            default model, which is not on the device machine)
#   bench    `strata synth` of the full-size file into /dev/shm (kept for later calls while the
#            machine stays warm), then `strata bench model --backend wgpu -p 0 -n 32 -r 2`
#   profile  `strata bench model --backend wgpu -p 0 -n 8 -r 1 --profile`: dispatches and
#            submits per decode token and the per-kernel table
#   small    `strata synth --experts 32` into /dev/shm (6 GB: the same per-token work as the
#            full file, 10 routed experts a token, in a 10 s load instead of 45 s), then
#            `bench model --backend wgpu -p 0 -n $N -r 1 --profile` on it (N=32), once per line of
#            $AB (environment settings, "-" for the defaults): an A/B per line, one load each
#   full     the full-size file: `bench model -p 0 -n 32 -r 2 --profile` in one load (bench and
#            the timestamp profile)
#   base     (not in the default steps) the bench again with session 5's products, norm,
#            single submit and fresh temporaries (STRATA_WGPU_MM=wg STRATA_WGPU_NORM=seq
#            STRATA_WGPU_CHUNK=0 STRATA_WGPU_POOL=0; the images keep rms_xprep_par, since
#            STRATA_WGPU_FUSE=0 would also undo session 5's fusions), for an A/B on one machine;
#            then with the products by mq::mmr instead of the default mq::mmb (STRATA_WGPU_MM=rows)
# TMAX (seconds, default 300) bounds each bench of `small` and each test binary.
# Logs go to $OUT (the device tool brings them back) or /tmp/wgpu-h200. A dry run here:
#   REQUIRE_NVIDIA=0 FULL=fixtures/qwen4exp/tiny/model-f32.gguf bash scripts/wgpu-h200.sh
set -uo pipefail
DEV=${DEV:-.dev/wgpu}
S=$DEV/strata
LOG=${OUT:-/tmp/wgpu-h200}
FULL=${FULL:-/dev/shm/full.gguf}
SMALL=${SMALL:-/dev/shm/e32.gguf}
STEPS=${STEPS:-tests bench profile}
AB=${AB:--}
mkdir -p "$LOG"

say() { echo "== $(date -u +%H:%M:%S) $*"; }

[ -x "$S" ] || { echo "no binary at $S (see the header of this script)"; exit 2; }
if ! ldconfig -p | grep libvulkan >/dev/null; then
    ls "$DEV"/gl/*.deb >/dev/null 2>&1 || { echo "no Vulkan loader and no $DEV/gl/*.deb"; exit 2; }
    for f in "$DEV"/gl/*.deb; do dpkg -x "$f" /; done
    ldconfig
fi
# The NVIDIA ICD where the loader does not find it by itself.
if [ -z "${VK_DRIVER_FILES:-}" ] && [ -f /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json ]; then
    export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
    export __EGL_VENDOR_LIBRARY_FILENAMES=/usr/local/nvidia/share/glvnd/egl_vendor.d/10_nvidia.json
fi
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader || true
TINY=fixtures/qwen4exp/tiny/model-f32.gguf
say "adapter check"
"$S" run -m "$TINY" -p hello -n 4 --temp 0 --backend wgpu -v 2>&1 | tee "$LOG/adapter.txt" | grep -i "wgpu\|error" | head -5
# REQUIRE_NVIDIA=0: a dry run on another adapter (lavapipe on the dev machine).
if [ "${REQUIRE_NVIDIA:-1}" = 1 ] && ! grep -q "NVIDIA" "$LOG/adapter.txt"; then
    echo "the wgpu adapter is not the NVIDIA GPU (see adapter.txt)"
    exit 3
fi

for step in $STEPS; do
    case $step in
    tests)
        say "kernel and tiny-model tests on the H200's Vulkan"
        if [ -x "$DEV/bin/kernels" ]; then
            timeout "${TMAX:-300}" "$DEV/bin/kernels" --test-threads 1 2>&1 | grep -v XDG_RUNTIME_DIR | tee "$LOG/kernels.txt" | grep -E "^test |test result|panicked"
        else
            echo "no $DEV/bin/kernels: kernel tests skipped"
        fi
        if [ -x "$DEV/bin/model" ]; then
            # The test binary finds the fixtures through the path it was built in
            # (CARGO_MANIFEST_DIR/../../fixtures); point that path at this checkout.
            # The build's root: $DEV/bin/model.root when given (a stripped binary's strings
            # run together, so the path found in it may carry a neighbour's bytes).
            if [ -s "$DEV/bin/model.root" ]; then
                root=$(cat "$DEV/bin/model.root")
            else
                dir=$(grep -a -o '/[[:alnum:]_./+-]*/crates/wgpu' "$DEV/bin/model" | sort | uniq -c | sort -rn | awk 'NR==1{print $2}')
                root=${dir%/crates/wgpu}
            fi
            if [ -n "$root" ] && [ ! -e "$root/fixtures" ]; then
                mkdir -p "$root/crates/wgpu" && ln -s "$PWD/fixtures" "$root/fixtures"
            fi
            timeout "${TMAX:-300}" "$DEV/bin/model" --test-threads 1 2>&1 | grep -v XDG_RUNTIME_DIR | tee "$LOG/tests.txt" | grep -E "^test |test result|vs |same bits|bit for bit"
        else
            echo "no $DEV/bin/model: tests skipped"
        fi
        ;;
    bench)
        if [ ! -s "$FULL" ]; then
            say "synth the full-size file into $FULL"
            "$S" synth --out "$FULL" --ctx 65536 2>&1 | tail -3
        fi
        say "bench model --backend wgpu -p 0 -n 32 -r 2"
        "$S" bench model -m "$FULL" --backend wgpu -p 0 -n 32 -r 2 --ctx 4096 2>&1 | tee "$LOG/bench.txt"
        ;;
    profile)
        [ -s "$FULL" ] || { echo "no $FULL: run the bench step first"; continue; }
        say "bench model --backend wgpu --profile"
        "$S" bench model -m "$FULL" --backend wgpu -p 0 -n 8 -r 1 --ctx 4096 --profile 2>&1 | tee "$LOG/profile.txt"
        ;;
    small)
        if [ ! -s "$SMALL" ]; then
            say "synth the 32-expert file into $SMALL"
            "$S" synth --out "$SMALL" --experts 32 --ctx 65536 2>&1 | tail -1
        fi
        i=0
        while read -r env; do
            [ -n "$env" ] || continue
            i=$((i + 1))
            say "small file, settings: $env"
            [ "$env" = - ] && env=
            # shellcheck disable=SC2086
            env $env timeout "${TMAX:-300}" "$S" bench model -m "$SMALL" --backend wgpu -p 0 -n "${N:-32}" -r 1 --ctx 4096 --profile \
                >"$LOG/small-$i.txt" 2>&1
            echo "settings: ${env:--}" >>"$LOG/small-$i.txt"
            grep -E "^profile|host per|GPU \(|tg32" "$LOG/small-$i.txt"
        done <<<"$(echo "$AB" | tr ';' '\n')"
        ;;
    full)
        if [ ! -s "$FULL" ]; then
            say "synth the full-size file into $FULL"
            "$S" synth --out "$FULL" --ctx 65536 2>&1 | tail -1
        fi
        say "full file: bench model --backend wgpu -p 0 -n 32 -r 2 --profile"
        "$S" bench model -m "$FULL" --backend wgpu -p 0 -n 32 -r 2 --ctx 4096 --profile >"$LOG/full.txt" 2>&1
        grep -E "^profile|host per|GPU \(|tg32" "$LOG/full.txt"
        ;;
    base)
        [ -s "$FULL" ] || { echo "no $FULL: run the bench step first"; continue; }
        say "bench model --backend wgpu with session 5's kernels (A/B)"
        STRATA_WGPU_MM=wg STRATA_WGPU_NORM=seq STRATA_WGPU_CHUNK=0 STRATA_WGPU_POOL=0 \
            "$S" bench model -m "$FULL" --backend wgpu -p 0 -n 32 -r 2 --ctx 4096 2>&1 | tee "$LOG/bench-base.txt"
        say "bench model --backend wgpu with STRATA_WGPU_MM=rows (mq::mmr)"
        STRATA_WGPU_MM=rows "$S" bench model -m "$FULL" --backend wgpu -p 0 -n 32 -r 2 --ctx 4096 2>&1 | tee "$LOG/bench-mmr.txt"
        ;;
    *) echo "unknown step $step" ;;
    esac
done
say "done"
