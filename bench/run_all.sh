#!/usr/bin/env bash
# Regenerate docs/benchmarks/ by running every benchmark in bench/, one after another (they time things, so never
# two at once). A calibrated cluster spec is measured first, with `primepar-fx calibrate`, and written to
# docs/benchmarks/calibrated-cpu-gloo.json. The cost-fidelity page uses it and fits a step-fitted spec on top
# (docs/benchmarks/stepfit-cpu-gloo.json), which the baselines page then plans with.
#
#   bench/run_all.sh                      # everything (tens of minutes on 2 cores; see each page's "took")
#   bench/run_all.sh baselines fidelity   # only these steps (names below)
#   SKIP="search_time explain" bench/run_all.sh
#
# Steps: calibrate step_time fidelity baselines baselines_gpt2 baselines_opt pipeline_fidelity memory ilp_check
# search_time paper_fig7 paper_fig7_fit explain search_engine. Every bench/*.py must be a step, a shared helper or one of the scripts run by hand (MANUAL,
# each with its reason below); the script stops if one is none of these.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=docs/benchmarks
SPEC=$OUT/calibrated-cpu-gloo.json
STEP_SPEC=$OUT/stepfit-cpu-gloo.json
HELPERS="measure.py plans.py"
COVERED="step_time.py baselines_step_time.py cost_fidelity.py memory_check.py ilp_check.py search_time.py paper_fig7.py
explain_time.py search_engine.py pipeline_fidelity.py"
# run by hand: gpu_check.py needs a GPU (the prepared device check); coverage.py trains every covered Hugging Face
# family (an hour here); real_configs.py plans every family at full size; same_plans.py compares two versions of the
# code (it takes their paths); fig9_preset.py derives a preset from the paper's figure (no measurement);
# gloo_collectives.py prints this machine's gloo collective times (no page)
MANUAL="gpu_check.py coverage.py real_configs.py same_plans.py fig9_preset.py gloo_collectives.py"
mkdir -p "$OUT"

for script in bench/*.py; do
    name=$(basename "$script")
    case " $(echo $HELPERS $COVERED $MANUAL) " in
        *" $name "*) ;;
        *) echo "run_all.sh: $script is not run by this script; add it" >&2; exit 1 ;;
    esac
done

wanted() {
    local step=$1
    case " ${SKIP:-} " in *" $step "*) return 1 ;; esac
    [ -z "$ONLY" ] && return 0
    case " $ONLY " in *" $step "*) return 0 ;; esac
    return 1
}

ONLY="$*"
TOTAL_START=$(date +%s)
run() {
    local step=$1
    shift
    wanted "$step" || { echo "== $step: skipped"; return 0; }
    echo "== $step: $*  (load average: $(cut -d' ' -f1-3 /proc/loadavg))"
    local start
    start=$(date +%s)
    "$@"
    echo "== $step: $(($(date +%s) - start)) s"
}

run calibrate python -m primepar_fx.cli calibrate --world-size 4 --quick -o "$SPEC"
[ -f "$SPEC" ] || { echo "run_all.sh: no calibrated spec at $SPEC (run the calibrate step)" >&2; exit 1; }
run step_time python bench/step_time.py
run fidelity python bench/cost_fidelity.py --spec "$SPEC"  # also writes the step-fitted spec, $STEP_SPEC
[ -f "$STEP_SPEC" ] || { echo "run_all.sh: no step-fitted spec at $STEP_SPEC (run the fidelity step)" >&2; exit 1; }
run baselines python bench/baselines_step_time.py --spec "$STEP_SPEC"
run baselines_gpt2 python bench/baselines_step_time.py --model gpt2 --spec "$STEP_SPEC"
run baselines_opt python bench/baselines_step_time.py --model opt --spec "$STEP_SPEC"
run pipeline_fidelity python bench/pipeline_fidelity.py --spec "$STEP_SPEC"
run memory python bench/memory_check.py
run ilp_check python bench/ilp_check.py
run search_time python bench/search_time.py
run paper_fig7 python bench/paper_fig7.py
run paper_fig7_fit python bench/paper_fig7.py --fit
run explain python bench/explain_time.py
run search_engine bash -c "python bench/search_engine.py | tee $OUT/search_engine.txt"
echo "== all: $(($(date +%s) - TOTAL_START)) s"
