"""The HTML report of a conformance run with one planted failing case (docs/conformance.md).

``PlantedFsdpLite`` is fsdp_lite's adapter under the name ``fsdp_lite_planted`` with one bug
planted in one case: in ``PLANTED_CASE`` it doubles every gradient just before the optimizer's
second step, after the suite read them. So that case passes its loss and grads at step 2 and
fails ``params`` at step 2 against both references; every other case is fsdp_lite's own.

    python scripts/conformance_html_demo.py --out report.html       # default matrix, 3 impls
    python scripts/conformance_html_demo.py --out r.html -- --quick # anything after -- goes to
                                                                    # python -m conformance

runs ``python -m conformance --impl conformance_html_demo:PlantedFsdpLite torch_fsdp2
torch_fsdp1 --json ... --html ...`` with this directory on the ranks' path.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
from pathlib import Path

from conformance.adapters.lite import FsdpLiteAdapter

PLANTED_CASE = "fsdp_lite_planted/FULL_SHARD/fp32/plain/lm_untied/ws2"
PLANTED_STEP = 2


class PlantedFsdpLite(FsdpLiteAdapter):
    name = "fsdp_lite_planted"
    description = "fsdp_lite with its gradients doubled before step 2 of one case (planted)"

    @contextlib.contextmanager
    def case_context(self, case):
        self._planted, self._steps = case.name == PLANTED_CASE, 0
        with super().case_context(case):
            yield

    def step(self, model, optim):
        self._steps += 1
        if self._planted and self._steps == PLANTED_STEP:
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.mul_(2.0)  # planted
        super().step(model, optim)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", default="report.html", help="the HTML report (default report.html)"
    )
    parser.add_argument("--json", default=None, help="the JSON report (default: beside --out)")
    parser.add_argument("rest", nargs="*", help="after --: more options for python -m conformance")
    args = parser.parse_args(argv)
    out = Path(args.out)
    json_path = args.json or str(out.with_suffix(".json"))
    here = Path(__file__).resolve().parent
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(here), str(here.parent), env.get("PYTHONPATH", "")) if p
    )
    command = [
        sys.executable,
        "-m",
        "conformance",
        "--impl",
        "conformance_html_demo:PlantedFsdpLite",
        "torch_fsdp2",
        "torch_fsdp1",
        "--json",
        json_path,
        "--html",
        str(out),
        *args.rest,
    ]
    print(" ".join(command), flush=True)
    return subprocess.run(command, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
