"""How long sana2-plan takes, and how much memory, for a cluster-scale run: SanaMS_1600M at 1024 ranks.

    python benchmarks/bench_plan_scale.py                 # FSDP and HSDP (128 replicas of 8 ranks)
    python benchmarks/bench_plan_scale.py --repeat 3      # the best of three runs each

The plan is a dry run on a fake process group and the `meta` device: it should take seconds and stay far
below the model's 6 GiB of fp32 weights whatever the world size. Each row runs `python -m sana2.plan` in a
fresh process (imports included, as a user runs it) and reports its wall time and peak RSS against the
targets below; the exit code is 1 when a target is missed. tests/test_plan.py checks that the plan
completes, fits and stays below the memory bound; the time is measured here, on a quiet machine (on a
shared, oversubscribed CPU the seconds grow with the load: 118 s at load average 11 on 2 cores).
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30
TARGET_SECONDS = 30.0
TARGET_PEAK_RSS = 1.0 * GIB
SHARDINGS = {"FSDP": [], "HSDP": ["--parallelism.data_parallel_replicate_degree=128"]}
# the plan's command line in a process that reports its own peak RSS (getrusage: the whole process's high-water mark)
MEASURE = (
    "import resource, sys; from sana2.plan import main; code = main(sys.argv[1:]); "
    "print('peak_rss_kib', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr); sys.exit(code)"
)


def plan_once(sharding: list[str]) -> dict:
    """One sana2-plan run at 1024 ranks: its seconds, peak RSS and verdict."""
    arguments = [str(ROOT / "train_configs/sana_1600m_img1024.toml"), "--nproc-per-node", "8", "--nnodes", "128"]
    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-c", MEASURE, *arguments, "--gpu-memory", "80", "--json", *sharding],
        capture_output=True,
        text=True,
    )
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"sana2.plan failed ({result.returncode}):\n{result.stderr[-2000:]}")
    peak_rss = int(result.stderr.split("peak_rss_kib")[1].split()[0]) * 1024
    return {"seconds": seconds, "peak_rss": peak_rss, "fits": json.loads(result.stdout)["fits"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=1, help="runs per sharding; the fastest is reported")
    args = parser.parse_args()
    print(f"sana2-plan, SanaMS_1600M at 1024 ranks; targets: < {TARGET_SECONDS:.0f} s, < {TARGET_PEAK_RSS / GIB} GiB")
    print(f"{'sharding':<9} {'seconds':>8} {'peak RSS':>10}  fits  target")
    missed = False
    for name, sharding in SHARDINGS.items():
        runs = [plan_once(sharding) for _ in range(args.repeat)]
        best = min(runs, key=lambda run: run["seconds"])
        met = best["seconds"] < TARGET_SECONDS and max(run["peak_rss"] for run in runs) < TARGET_PEAK_RSS
        missed |= not met
        rss = max(run["peak_rss"] for run in runs) / 2**20
        print(f"{name:<9} {best['seconds']:>8.1f} {rss:>7.0f} MiB  {best['fits']!s:<5} {'met' if met else 'MISSED'}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
