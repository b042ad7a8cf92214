"""scripts/bench_data_loading.py: both sides read the same records of a cut-off JSON array,
and the run ends with its JSON line."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

_PATH = Path(__file__).resolve().parents[2] / "scripts" / "bench_data_loading.py"
_spec = importlib.util.spec_from_file_location("bench_data_loading", _PATH)
bd = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bd)


def test_both_sides_read_the_complete_elements_of_a_cut_file(tmp_path, monkeypatch, capsys):
    records = [{"id": f"r{i}", "conversations": [{"from": "human", "value": f"q{i} é"},
                                                 {"from": "gpt", "value": f"a{i}"}]}
               for i in range(5)]
    full = json.dumps(records, indent=2, ensure_ascii=False).encode()
    path = tmp_path / "cut.json"
    path.write_bytes(full[:full.index(b'"a4"') + 2])  # cut inside the last element's answer
    _, result = bd.ours(path)
    assert result.report.truncated_tail and result.report.records_seen == 4
    _, n = bd.base(path, result.report.tail_chars_dropped)
    assert n == 4
    monkeypatch.setattr(sys, "argv", ["bench", "--path", str(path), "--reps", "2"])
    bd.main()
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["bench"] == "data_loading" and last["records"] == last["kept"] == 4
    assert last["ratio"] > 0 and last["reps"] == 2 and {"ours_s", "base_s"} <= last.keys()
