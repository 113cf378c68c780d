"""Plant each wrong speculative-sampling rule of ``tests/mutations.py`` in ``verify_sampling``
and run the end-to-end sampling tests against it; print rule -> tests failed / run.

A correct suite fails for every planted rule (issue 80's target: >= 3 end-to-end tests each).
The rule is planted in the pytest process by ``tests/conftest.py`` when the environment
variable ``SELFSPEC_PLANT_RULE`` is set (only this script sets it). The script also sets
``SELFSPEC_SAMPLING_POWER=1``: the per-method powered cases of
``tests/decoding/test_sampling_power.py`` (too slow for the default suite) run here.

Usage: python scripts/mutation_check.py [pytest arguments ...]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# every end-to-end distribution test of the rejection rule (the seeded tests take the keyed rule)
DEFAULT_TESTS = ["tests/decoding", "-k", "(reproduces_the_target_distribution or "
                 "samples_the_target_distribution) and not seeded"]


def run_rule(rule: str | None, tests: list[str]) -> tuple[int, int, list[str]]:
    """(failed, run, names of the failed tests) of ``tests`` with ``rule`` planted (``None``:
    the real rule)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SELFSPEC_SAMPLING_POWER": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"),
                                                       os.environ.get("PYTHONPATH")]))}
    env.pop("SELFSPEC_PLANT_RULE", None)
    if rule:
        env["SELFSPEC_PLANT_RULE"] = rule
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.xml"
        subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        f"--junitxml={report}", *tests], cwd=ROOT, env=env,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
        import xml.etree.ElementTree as ET

        suite = ET.parse(report).getroot()
        suite = suite if suite.tag == "testsuite" else suite[0]
        failed = int(suite.get("failures", 0)) + int(suite.get("errors", 0))
        names = [case.get("name") for case in suite.iter("testcase")
                 if case.find("failure") is not None or case.find("error") is not None]
        return failed, int(suite.get("tests", 0)) - int(suite.get("skipped", 0)), names


def main(argv: list[str]) -> int:
    sys.path.insert(0, str(ROOT / "tests"))
    from mutations import RULES

    tests = argv or DEFAULT_TESTS
    rows = {}
    for rule in (*RULES, None):  # each row on stderr as it finishes (a rule takes minutes)
        rows[rule or "(none: the real rule)"] = row = run_rule(rule, tests)
        print(f"{rule}: {row[0]} / {row[1]} failed: {', '.join(row[2])}", file=sys.stderr,
              flush=True)
    width = max(map(len, rows))
    print(f"{'planted rule':<{width}}  tests failed / run")
    for rule, (failed, run, _) in rows.items():
        print(f"{rule:<{width}}  {failed} / {run}")
    print(json.dumps({r: f for r, (f, _, _) in rows.items()}))
    clean = rows["(none: the real rule)"][0] == 0
    return 0 if clean and all(f > 0 for r, (f, _, _) in rows.items() if r in RULES) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
