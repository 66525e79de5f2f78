"""The soak (scripts/soak.py), short: >= 100 mixed requests against serve and against one Eagle3Llama on the
tiny pair (serve also with --parallel 4: slots of the same context, answers past its end included); every answer
equals its alone-answer, memory after warm-up stays within 5%, no handles leak."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "soak.py"


@pytest.mark.slow
@pytest.mark.parametrize("mode, n, parallel", [("serve", 100, 1), ("serve", 100, 4), ("llama", 100, 1)])
def test_short_soak(tmp_path, tiny_target, tiny_head, mode, n, parallel):
    if mode == "serve":
        pytest.importorskip("uvicorn")
    out = tmp_path / "soak.json"
    r = subprocess.run([sys.executable, str(SCRIPT), mode, "-m", str(tiny_target), "--draft", str(tiny_head),
                        "--requests", str(n), "-c", "160", "--sample-every", "10", "--drop-rate", "0.05",
                        "--server-log", str(tmp_path / "serve.log"), "--json", str(out), "--parallel", str(parallel)],
                       capture_output=True, text=True, timeout=900)
    report = json.loads(out.read_text())
    summary = {k: v for k, v in report.items() if k != "samples"}
    assert report["errors"] == [] and report["mismatches"] == [], summary
    assert report["compared"] + report["dropped"] == n and report["equal"] == report["compared"], summary
    assert report["dropped"] > 0, summary
    assert abs(report["rss_growth"]) <= 0.05, summary
    assert r.returncode == 0, r.stdout + r.stderr
    if mode == "serve":
        assert "Traceback" not in (tmp_path / "serve.log").read_text()
