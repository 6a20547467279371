"""The test suite's own settings (issue 32, item 7): markers are strict and every declared one is used, the
conftest's skips (``gpu`` without a GPU, ``sm100`` off Blackwell), and the GPU runner keeps a record per test
id for each mode (JUnit XML and one outcome line per test; the sanitizer script's cases too)."""
from __future__ import annotations

import pathlib
import re
import subprocess
import sys
import tomllib

import conftest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def pytest_options() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["pytest"]["ini_options"]


def test_markers_are_strict_and_every_declared_one_is_used():
    options = pytest_options()
    assert "--strict-markers" in options["addopts"].split()
    declared = {line.split(":")[0].strip() for line in options["markers"]}
    assert declared == {"gpu", "sm100", "slow"}
    text = "\n".join(p.read_text() for p in (ROOT / "tests").glob("*.py"))
    used = set(re.findall(r"pytest\.mark\.([a-z_0-9]+)", text))
    assert declared <= used, f"declared but never used: {sorted(declared - used)}"


def test_an_undeclared_marker_is_an_error(tmp_path):
    test = tmp_path / "test_typo.py"
    test.write_text("import pytest\n\n@pytest.mark.gpuu\ndef test_x():\n    pass\n")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c",
                           str(ROOT / "pyproject.toml"), "--rootdir", str(tmp_path), str(test)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "'gpuu' not found in `markers`" in done.stdout + done.stderr


def test_conftest_skips_gpu_tests_without_a_gpu_and_sm100_tests_off_blackwell():
    assert set(conftest.skip_markers(False, None)) == {"gpu", "sm100"}
    on_h200 = conftest.skip_markers(True, (9, 0))
    assert set(on_h200) == {"sm100"} and "sm_90" in on_h200["sm100"].kwargs["reason"]
    assert conftest.skip_markers(True, (10, 0)) == {}


def test_gpu_runner_keeps_junit_xml_and_per_test_lines_for_each_mode():
    script = (ROOT / "scripts" / "gpu_run.sh").read_text()
    assert '--junitxml="$OUT/gpu_tests-$what.xml"' in script and '"$OUT/gpu_tests-$what.log"' in script
    assert re.search(r"pytest -q -m gpu -rap ", script), "one outcome line per test id in the log"
    assert '--junitxml "$OUT/sanitize-$tool-$kernel.xml"' in script and "sanitize-summary.txt" in script
    assert subprocess.run(["bash", "-n", str(ROOT / "scripts" / "gpu_run.sh")]).returncode == 0
